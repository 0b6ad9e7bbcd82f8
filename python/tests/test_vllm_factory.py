"""ferry's "FerryConnector" in vLLM's KVConnectorFactory never shadows a
user's own "FerryConnector" named by kv_connector_module_path.

vllm-project/vllm a4cd9d0d28bdb41db8dfe0acdafac2bf2f608630,
vllm/distributed/kv_transfer/kv_connector/factory.py: create_connector ->
_get_connector_class_with_compat(kv_transfer_config) looks
kv_transfer_config.kv_connector up in _registry first and reads
kv_connector_module_path only for a name not registered; a registered
class is built as connector_cls(config, role, kv_cache_config), one from a
module path as connector_cls(config, role) when its constructor takes no
kv_cache_config. ferry's "vllm.general_plugins" hook registers
"FerryConnector" in every vLLM process, so a team's own subclass named
FerryConnector in its own module was silently replaced by ferry's class:
its overrides (hooks, class methods such as requires_piecewise_for_cudagraph)
never ran. The stand-in below replays those lines.
"""
import importlib
import sys

import pytest

import ferry.adapters as adapters
from ferry.adapters import _vllm_base as base
from ferry.adapters.vllm import FerryConnector
from test_adapter_vllm import vllm_config

Role = base.KVConnectorRole


class _Factory:
    """KVConnectorFactory as a4cd9d0d declares it (the lines a connector
    meets; supports_kw is inspect's look for the parameter)."""
    _registry = {}

    @classmethod
    def register_connector(cls, name, module_path, class_name):
        if name in cls._registry:
            raise ValueError(f"Connector '{name}' is already registered.")

        def loader():
            return getattr(importlib.import_module(module_path), class_name)
        cls._registry[name] = loader

    @classmethod
    def create_connector(cls, config, role, kv_cache_config=None):
        kv_transfer_config = config.kv_transfer_config
        connector_cls, compat_sig = cls._get_connector_class_with_compat(kv_transfer_config)
        if compat_sig:
            return connector_cls(config, role)
        return connector_cls(config, role, kv_cache_config)

    @classmethod
    def get_connector_class_by_name(cls, connector_name):
        if connector_name not in cls._registry:
            raise ValueError(f"Connector '{connector_name}' is not registered.")
        return cls._registry[connector_name]()

    @classmethod
    def _get_connector_class_with_compat(cls, kv_transfer_config):
        import inspect
        connector_name = kv_transfer_config.kv_connector
        compat_sig = False
        if connector_name in cls._registry:
            connector_cls = cls._registry[connector_name]()
        else:
            connector_module_path = kv_transfer_config.kv_connector_module_path
            if connector_module_path is None:
                raise ValueError(f"Unsupported connector type: {connector_name}")
            connector_module = importlib.import_module(connector_module_path)
            connector_cls = getattr(connector_module, connector_name)
            if "kv_cache_config" not in inspect.signature(connector_cls).parameters:
                compat_sig = True
        return connector_cls, compat_sig

    @classmethod
    def get_connector_class(cls, kv_transfer_config):
        connector_cls, _ = cls._get_connector_class_with_compat(kv_transfer_config)
        return connector_cls


USER_SUBCLASS = '''
from ferry.adapters.vllm import FerryConnector as _Ferry


class FerryConnector(_Ferry):
    """A team's own connector: ferry's, with a hook of its own."""
    built = 0

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        type(self).built += 1

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config):
        return True
'''

USER_OWN = '''
class FerryConnector:
    """A connector of the same name with vLLM's older two-argument form."""

    def __init__(self, vllm_config, role):
        self.args = (vllm_config, role)
'''

USER_WRAPPER = '''
from ferry.adapters.vllm import FerryConnector as _Ferry


class FerryConnector:
    """A team's own connector that wraps ferry's, built with the config it
    is given (which names this module), and hands each call on."""
    built = 0

    def __init__(self, vllm_config, role, kv_cache_config=None):
        type(self).built += 1
        self.inner = _Ferry(vllm_config, role, kv_cache_config)

    def __getattr__(self, name):
        return getattr(self.inner, name)
'''


def _in_vllm(cls, *args):
    """cls(*args) called from code of vLLM's (a factory or a MultiConnector
    that reached the class some other way)."""
    ns = {"__name__": "vllm.distributed.kv_transfer.kv_connector.v1.multi_connector"}
    exec("def build(cls, *args):\n    return cls(*args)\n", ns)
    return ns["build"](cls, *args)


@pytest.fixture
def factory(monkeypatch, tmp_path):
    import types
    parts = "vllm.distributed.kv_transfer.kv_connector.factory".split(".")
    for i in range(1, len(parts) + 1):
        mod = types.ModuleType(".".join(parts[:i]))
        if i == len(parts):
            mod.KVConnectorFactory = type("KVConnectorFactory", (_Factory,), {"_registry": {}})
        monkeypatch.setitem(sys.modules, ".".join(parts[:i]), mod)
    (tmp_path / "team_connector.py").write_text(USER_SUBCLASS)
    (tmp_path / "team_old_connector.py").write_text(USER_OWN)
    (tmp_path / "team_wrapper.py").write_text(USER_WRAPPER)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("team_connector", "team_old_connector", "team_wrapper"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    f = sys.modules[".".join(parts)].KVConnectorFactory
    assert adapters.register_vllm_connector() is True
    return f


def _cfg(path):
    cfg = vllm_config({"ferry.store": "factory-test"})
    cfg.kv_transfer_config.kv_connector_module_path = path
    return cfg


def test_a_users_own_ferryconnector_by_module_path_is_the_one_built(factory):
    import team_connector
    mine = team_connector.FerryConnector
    cfg = _cfg("team_connector")
    ktc = cfg.kv_transfer_config
    assert "FerryConnector" in factory._registry     # ferry's plugin registered the name
    assert factory.get_connector_class(ktc) is mine
    assert factory.get_connector_class(ktc).requires_piecewise_for_cudagraph({}) is True
    c = factory.create_connector(cfg, Role.SCHEDULER, None)
    assert type(c) is mine and mine.built == 1
    # ferry's own module path, or none, is ferry's class
    for path in ("ferry.adapters.vllm", None):
        assert factory.get_connector_class(_cfg(path).kv_transfer_config) is FerryConnector
    # by name alone (a MultiConnector's stats in the API server): ferry's
    assert factory.get_connector_class_by_name("FerryConnector") is FerryConnector


def test_a_multiconnector_child_gets_its_own_modules_class(factory):
    """MultiConnector builds each child by create_connector with the child's
    own kv_transfer_config (a4cd9d0d, v1/multi_connector.py): each is
    resolved for itself."""
    import team_connector

    def multi(children):
        return [factory.create_connector(c, Role.SCHEDULER, None) for c in children]
    got = multi([_cfg("ferry.adapters.vllm"), _cfg("team_connector")])
    assert [type(c) for c in got] == [FerryConnector, team_connector.FerryConnector]


def test_a_two_argument_class_of_the_same_name_is_built_as_vllm_would(factory):
    import team_old_connector
    cfg = _cfg("team_old_connector")
    c = factory.create_connector(cfg, Role.SCHEDULER, "kv-cache-config")
    assert isinstance(c, team_old_connector.FerryConnector)
    assert c.args == (cfg, Role.SCHEDULER)
    assert type(c).__name__ == "FerryConnector"          # (stats are keyed by it)


def test_ferrys_class_built_for_a_users_config_builds_the_users(factory):
    """The last guard: a vLLM whose factory reaches the registered class some
    other way still builds the class the config names."""
    import team_connector
    import team_old_connector
    c = _in_vllm(FerryConnector, _cfg("team_connector"), Role.SCHEDULER, None)
    assert type(c) is team_connector.FerryConnector
    assert team_connector.FerryConnector.built == 1
    c = _in_vllm(FerryConnector, _cfg("team_old_connector"), Role.SCHEDULER, None)
    assert isinstance(c, team_old_connector.FerryConnector)
    assert type(_in_vllm(FerryConnector, _cfg("ferry.adapters.vllm"), Role.SCHEDULER, None)) \
        is FerryConnector


def test_a_users_wrapper_of_ferrys_connector_builds_ferrys_inside(factory):
    """A team's "FerryConnector" that wraps ferry's and builds it with the
    config it was given (naming the team's module) gets ferry's class
    there: the guard above is vLLM's alone, so the wrapper is built once
    and does not build itself again until the stack runs out."""
    import team_wrapper
    for build in (factory.create_connector,
                  lambda cfg, role, kcc: _in_vllm(FerryConnector, cfg, role, kcc)):
        team_wrapper.FerryConnector.built = 0
        c = build(_cfg("team_wrapper"), Role.SCHEDULER, None)
        assert type(c) is team_wrapper.FerryConnector
        assert team_wrapper.FerryConnector.built == 1
        assert type(c.inner) is FerryConnector


def test_a_wrapper_kept_in_vllms_own_tree_builds_ferrys_inside(factory, monkeypatch):
    """The same wrapper in a fork's vLLM tree (a module named vllm.*):
    ferry's class built from the wrapper's own module is ferry's."""
    import types
    name = "vllm.distributed.kv_transfer.kv_connector.v1.team_wrapper"
    mod = types.ModuleType(name)
    exec(compile(USER_WRAPPER, name, "exec"), mod.__dict__)
    monkeypatch.setitem(sys.modules, name, mod)
    c = factory.create_connector(_cfg(name), Role.SCHEDULER, None)
    assert type(c) is mod.FerryConnector and mod.FerryConnector.built == 1
    assert type(c.inner) is FerryConnector


def test_a_module_path_that_will_not_import_raises_as_vllm_raises(factory):
    with pytest.raises(ModuleNotFoundError):
        factory.get_connector_class(_cfg("no_such_team_module").kv_transfer_config)


def test_a_factory_that_renames_its_argument_still_builds_the_users_class(factory):
    """Should vLLM rename _get_connector_class_with_compat's kv_transfer_config
    (or hold only the VllmConfig), ferry's registered name still resolves to
    the class the config's module path names: the config is found by value,
    and its class-level hooks are the user's, not ferry's."""
    import team_connector
    mine = team_connector.FerryConnector

    def renamed(cls, transfer_cfg):      # the registry's lookup, the argument renamed
        return cls._registry[transfer_cfg.kv_connector]()

    def by_config(cls, whole_config):    # or given the whole VllmConfig
        return cls._registry[whole_config.kv_transfer_config.kv_connector]()

    cfg = _cfg("team_connector")
    got = renamed(factory, cfg.kv_transfer_config)
    assert got is mine and got.requires_piecewise_for_cudagraph({}) is True
    assert by_config(factory, cfg) is mine
    # ferry's own path by value is ferry's class; a frame that is not the
    # factory's is not looked through by value
    assert renamed(factory, _cfg("ferry.adapters.vllm").kv_transfer_config) is FerryConnector
    assert renamed(type("NotTheFactory", (), {"_registry": factory._registry}),
                   cfg.kv_transfer_config) is FerryConnector


def test_the_lookup_by_value_runs_no_code_of_other_locals(factory):
    """Locals of the frames walked whose attributes are computed (a property,
    __getattr__) are looked at as stored: none of their code runs."""
    import team_connector
    ran = []

    class Loud:
        def __getattr__(self, name):
            ran.append(name)
            raise AttributeError(name)

        @property
        def kv_transfer_config(self):
            ran.append("property")
            raise RuntimeError("not to be run")

    def renamed(cls, noisy, transfer_cfg):
        return cls._registry[transfer_cfg.kv_connector]()

    got = renamed(factory, Loud(), _cfg("team_connector").kv_transfer_config)
    assert got is team_connector.FerryConnector
    assert ran == []
