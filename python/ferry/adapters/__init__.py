"""ferry inside inference engines: a vLLM KV connector (ferry.adapters.vllm)
and an SGLang hierarchical-cache storage backend (ferry.adapters.sglang).

Neither engine is a dependency: each adapter imports the engine's base
class when the engine is installed and a small stand-in with the same
methods otherwise, so the adapter (and its tests) load without it.

Stores are found by name. An engine's scheduler and workers that run in
one process share one KVStore through this registry:

    store = ferry.KVStore(model=..., layout=..., l1="8G")
    ferry.adapters.register_store("main", store)
    # vLLM:   kv_connector_extra_config={"ferry.store": "main"}
    # SGLang: hicache storage extra config {"ferry_store": "main", ...}

A `ferry serve` daemon shares one cache between processes. The vLLM
connector takes its address ("ferry.server": "unix:/run/ferry/ferry.sock"):
each worker opens a KVStore(server=...) client for its caches and a
scheduler in another process a lookup-only one (see ferry.adapters.vllm).
The SGLang backend takes one too ("ferry_server": its kv pool's pages go
to the daemon, so the TP workers of a host share one cache; a pool of
another shape needs a daemon of its own, "ferry_server_<pool>", or an
in-process store; see ferry.adapters.sglang).
"""
import logging
import os
import threading

_log = logging.getLogger("ferry.vllm")
_lock = threading.Lock()


def _after_fork_in_child():
    # a thread inside a registry call at the fork holds _lock in the child,
    # where that thread is not: a lock of the child's own (the stores in
    # the registry are the parent's; their calls refuse, naming the fork)
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
_stores = {}


def register_store(name, store):
    """Make `store` (a ferry.KVStore) findable by adapters as `name` in this
    process. A name already taken by another store is refused."""
    with _lock:
        old = _stores.get(name)
        if old is not None and old is not store:
            raise ValueError(f"ferry: a store is already registered as {name!r}")
        _stores[name] = store


def unregister_store(name):
    """Forget the store registered as `name` (it is not closed)."""
    with _lock:
        return _stores.pop(name, None)


def registered_store(name):
    """The store registered as `name`, or None."""
    with _lock:
        return _stores.get(name)


def _mark_opener(store, engine, model, setup=None):
    """Record on a store an adapter opened (and registers) which engine
    ("vLLM", "SGLang"), model and engine-specific setup it serves."""
    store._ferry_opener = (engine, model, setup)


def _check_opener(name, store, me, model, setting):
    """The (engine, model, setup) that opened the store registered as
    `name`, or None for one the user opened and registered. A store an
    adapter of this process (of either engine) opened for another model is
    refused: its chunks are that model's under the keys this one would ask
    (SGLang's hash token ids alone, vLLM's name no model), so a hit would
    load that model's KV. me names the asking adapter, setting the name
    that would give it a store of its own."""
    opener = getattr(store, "_ferry_opener", None)
    if opener is not None and opener[1] != model:
        raise ValueError(
            f"ferry: {me}: the store registered as {name!r} was opened by a {opener[0]} "
            f"adapter for model {opener[1]!r}, and this one serves {model!r}: it would "
            f"load that model's KV; give each model its own {setting}")
    return opener


def register_vllm_connector():
    """vLLM's general plugin hook (the "vllm.general_plugins" entry point
    "ferry"; vLLM runs these in each of its processes): makes
    "FerryConnector" a name vLLM's KVConnectorFactory knows. A connector
    loaded by kv_connector_module_path alone is not registered by name, and
    MultiConnector rebuilds a child's stats in the API server by that name
    (KVConnectorFactory.get_connector_class_by_name, which raises for a name
    not registered). Loading ferry's connector module registers it as well.
    The name never shadows a user's choice: a config that names its own
    "FerryConnector" by kv_connector_module_path gets that class, as it
    would from vLLM without ferry's registration.
    Returns True once the name is registered; False without vLLM, or when
    vLLM's factory would not take it (a warning says why: vLLM calls its
    plugins unguarded, in processes that may not use ferry at all, so
    nothing here raises). The registry loads ferry.adapters.vllm only when
    the name is first used."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:
        return False
    except Exception as e:  # vLLM's own modules failed to import: not ferry's to stop
        _log.warning("ferry: \"FerryConnector\" not registered with vLLM's "
                     "KVConnectorFactory: its module failed to import: %r", e)
        return False
    registry = getattr(KVConnectorFactory, "_registry", None)
    if isinstance(registry, dict) and "FerryConnector" in registry:
        return True
    try:
        # FerryConnectorByName is resolved each time the factory asks: a
        # user's own "FerryConnector" named by kv_connector_module_path is
        # what it gets then, not ferry's (vllm.py, _factory_choice)
        KVConnectorFactory.register_connector("FerryConnector", "ferry.adapters.vllm",
                                              "FerryConnectorByName")
    except ValueError:  # (registered meanwhile)
        pass
    except Exception as e:
        _log.warning("ferry: \"FerryConnector\" not registered with vLLM's "
                     "KVConnectorFactory: %r", e)
        return False
    return True
