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

An adapter given a server address ("ferry.server" / "ferry_server")
instead refuses with NotImplementedError: the package has no client for
`ferry serve` yet, and that address is where one slots in.
"""
import threading

_lock = threading.Lock()
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


def no_server(address, engine):
    """The answer to a server address until the package has a server client."""
    return NotImplementedError(
        f"ferry: {engine} adapter: server address {address!r} given, but the Python "
        "package has no client for `ferry serve` yet; register an in-process store "
        "with ferry.adapters.register_store() instead")


__all__ = ["register_store", "unregister_store", "registered_store"]
