"""The vLLM connector's settings as its module docstring promises them.

An engine team's first hour with ferry is kv_connector_extra_config: every
"ferry.*" key is read when vLLM builds the connector (create_connector,
vllm/distributed/kv_transfer/kv_connector/factory.py, vllm-project/vllm
00f4240ee6458263d76cf51ca7901ce1350bb4d1), for the scheduler and each
worker. A key ferry does not know (a misspelling) or a value its setting
cannot take is refused there, with a ValueError naming the key, rather than
switching nothing in silence, or failing later: in a worker's
register_kv_caches, or in the scheduler's get_num_new_matched_tokens inside
vLLM's loop (a KeyError for a "ferry.layout" without its head_dim). A value
written as a string (a YAML file, an environment variable) is read as
written, as the boolean settings are.
"""
import fractions

import pytest
import torch

import ferry
from ferry.adapters import registered_store, unregister_store
from ferry.adapters import _vllm_base as base
from ferry.adapters import vllm as vllm_adapter
from test_adapter_vllm import (CHUNK, NAME, Engine, Request, connector_class, prompts,
                               serve_a, vllm_config)

Role = base.KVConnectorRole

# the settings the module docstring names
KEYS = ("ferry.store", "ferry.server", "ferry.l1", "ferry.l2", "ferry.model",
        "ferry.chunk_tokens", "ferry.persistent", "ferry.layout", "ferry.layerwise",
        "ferry.async_load", "ferry.async_save", "ferry.kv_events", "ferry.kv_cache_layout",
        "ferry.cross_layer_blocks")


def build(extra, role):
    cfg = vllm_config(extra)
    return connector_class(cfg)(cfg, role, None)


@pytest.mark.parametrize("role", [Role.SCHEDULER, Role.WORKER])
@pytest.mark.parametrize("key", ["ferry.async_laod", "ferry.layer_wise", "ferry.chunk_token",
                                 "ferry.L1", "ferry.kv_event"])
def test_a_misspelt_setting_is_refused_naming_it(key, role):
    """A misspelt key switched nothing, in silence: "ferry.async_laod": true
    loaded synchronously, "ferry.chunk_token" kept the default chunk."""
    with pytest.raises(ValueError) as e:
        build({"ferry.store": NAME, key: True}, role)
    assert repr(key) in str(e.value)
    assert "ferry.async_load" in str(e.value)     # the keys it may have meant


def test_every_documented_setting_and_other_connectors_keys_are_taken():
    for role in Role:
        build({"ferry.store": NAME, "vllm.some_other_setting": 1, "connectors": []}, role)
    doc = vllm_adapter.__doc__ + vllm_adapter.FerryConnector.prefer_cross_layer_blocks.__doc__
    for key in KEYS:
        assert f'"{key}"' in doc


BAD = [("ferry.chunk_tokens", "sixteen"), ("ferry.chunk_tokens", -16),
       ("ferry.chunk_tokens", 16.5), ("ferry.chunk_tokens", True),
       ("ferry.chunk_tokens", "\u00b2"),     # (a digit, not a decimal one: int() refuses it)
       ("ferry.l2", "nosize"), ("ferry.l2", "/tmp/x:lots"), ("ferry.l2", 5),
       ("ferry.l1", "lots"), ("ferry.l1", -1),
       ("ferry.layout", "llama"), ("ferry.layout", {"num_layers": 2}),
       ("ferry.layout", {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "bogus"}),
       ("ferry.layout", {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "mla": "nope"}),
       ("ferry.layout", {"num_layers": 2.5, "num_kv_heads": 2, "head_dim": 8}),
       ("ferry.layout", {"num_layers": 2, "num_kv_heads": True, "head_dim": 8}),
       ("ferry.layout", {"num_layers": 2, "num_kv_heads": 2, "head_dim": -8}),
       ("ferry.store", ""), ("ferry.store", 3), ("ferry.server", 5), ("ferry.model", ""),
       ("ferry.kv_cache_layout", "XYZ")]


@pytest.mark.parametrize("role", [Role.SCHEDULER, Role.WORKER])
@pytest.mark.parametrize("key,value", BAD)
def test_a_bad_value_is_refused_when_the_connector_is_built(key, value, role):
    extra = {"ferry.store": NAME, key: value}
    with pytest.raises(ValueError) as e:
        build(extra, role)
    assert repr(key) in str(e.value) or f'"{key}"' in str(e.value)


def test_a_layout_whose_mla_is_written_false_is_not_mla(monkeypatch):
    """"ferry.layout"'s "mla" is a boolean setting like the others:
    bool("false") is True, and the scheduler's lookup client of a daemon
    took a GQA model for MLA (one latent, no V)."""
    seen = {}

    class KVStore:
        def __init__(self, **kw):
            seen.update(kw)
    monkeypatch.setattr(vllm_adapter, "KVStore", KVStore)
    spec = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "f32"}
    for mla, want in (("false", False), ("0", False), (False, False), ("true", True)):
        c = build({"ferry.server": "unix:/nonexistent/ferry.sock", "ferry.store": "none-such",
                   "ferry.layout": dict(spec, mla=mla)}, Role.SCHEDULER)
        c.store
        assert seen["layout"] == ferry.Layout.from_model(2, 2, 8, "f32", mla=want), mla


def test_settings_written_as_strings_open_the_same_store_bitwise(model):
    """A chunk size from a YAML file or an environment variable ("16") is the
    chunk size: the worker's store opens with it, and a prefix one request
    stored loads bitwise into the next."""
    eng = Engine(model, extra={"ferry.store": NAME, "ferry.l1": "4M",
                               "ferry.chunk_tokens": str(CHUNK), "ferry.async_save": "no"})
    try:
        assert registered_store(NAME).chunk_tokens == CHUNK
        kv_a = serve_a(eng)
        _, b = prompts()
        rb = Request("b", b)
        assert eng.admit(rb) == 32
        eng.step_new(rb)
        assert torch.equal(model.kv_of(eng.caches, eng.blocks["b"], 32), kv_a)
        assert eng.errors == set()
        eng.finish(rb)
    finally:
        eng.close()
    assert registered_store(NAME) is None
    unregister_store(NAME)


def test_decode_tokens_are_never_stored(model, store):
    """"Only prompt tokens are stored, in whole chunks; decode tokens are
    not": a request that decodes past two more chunk boundaries (48, 64)
    plans no save for them, and ferry holds its prompt's whole chunks alone."""
    from test_vllm_newest import _decode
    eng = Engine(model, store)
    a, _ = prompts()
    r = Request("d", a)
    assert eng.admit(r) == 0
    assert [s.tokens for s in eng.step_new(r).saves] == [a[:32]]
    r.all_token_ids.append(500)                     # sampled by the prefill
    for i in range(30):
        assert _decode(eng, r, 470 + i).saves == []
    assert r.num_computed_tokens == 70
    eng.finish(r)
    assert store.lookup(r.all_token_ids) == 32
    assert eng.admit(Request("d2", r.all_token_ids)) == 32
    eng.finish(Request("d2", r.all_token_ids))
    eng.close()


def test_a_null_setting_is_an_unset_one(model):
    """A setting written as JSON null or an empty YAML value (None) is not set,
    as a null boolean is false: a worker opens its store with the model name
    vLLM gives and the store's own chunk size, and a scheduler beside it is
    built. A null "ferry.model" was refused as not a string, and a null
    "ferry.l1" passed the check and then failed the worker's
    register_kv_caches ("an in-process store needs l1")."""
    nulls = {k: None for k in ("ferry.l2", "ferry.model", "ferry.server", "ferry.layout",
                               "ferry.kv_cache_layout", "ferry.async_save",
                               "ferry.persistent")}
    eng = Engine(model, extra={"ferry.store": NAME, "ferry.l1": "4M",
                               "ferry.chunk_tokens": CHUNK, **nulls})
    try:
        kv_a = serve_a(eng)
        _, b = prompts()
        rb = Request("b", b)
        assert eng.admit(rb) == 32
        eng.step_new(rb)
        assert torch.equal(model.kv_of(eng.caches, eng.blocks["b"], 32), kv_a)
        eng.finish(rb)
    finally:
        eng.close()
    unregister_store(NAME)
    # a null "ferry.l1" opens nothing: the scheduler is not told its workers
    # run apart, and a worker finds no store to open
    for role in Role:
        build({"ferry.store": NAME, "ferry.l1": None, "ferry.model": None,
               "ferry.chunk_tokens": None}, role)


def test_an_l2_list_the_worker_cannot_open_is_refused_at_build(tmp_path):
    """"ferry.l2" as a list stripes one size over its directories: a list of
    unequal sizes, or an empty one, failed only when each worker opened its
    store (register_kv_caches), after vLLM had built the engine."""
    for l2 in ([f"{tmp_path}/a:8M", f"{tmp_path}/b:16M"], []):
        for role in Role:
            with pytest.raises(ValueError, match="ferry.l2"):
                build({"ferry.store": NAME, "ferry.l1": "4M", "ferry.l2": l2}, role)
    build({"ferry.store": NAME, "ferry.l1": "4M",     # one size on each: taken
           "ferry.l2": [f"{tmp_path}/a:8M", f"{tmp_path}/b:8M"]}, Role.WORKER)


def test_counts_and_dtypes_as_python_and_vllm_write_them(monkeypatch):
    """A chunk size computed with NumPy (np.int64, which KVStore takes) is a
    count, as it was before the settings were checked; "ferry.layout"'s
    dtype may be vLLM's own name for it ("bfloat16", "half", "float"), as
    vLLM's --dtype and model_config say it."""
    import numpy as np
    for role in Role:
        build({"ferry.store": NAME, "ferry.chunk_tokens": np.int64(16)}, role)
    seen = {}

    class KVStore:
        def __init__(self, **kw):
            seen.update(kw)
    monkeypatch.setattr(vllm_adapter, "KVStore", KVStore)
    for name, ours in (("bfloat16", "bf16"), ("half", "f16"), ("float16", "f16"),
                       ("float", "f32"), ("float32", "f32"), ("bf16", "bf16")):
        c = build({"ferry.server": "unix:/nonexistent/ferry.sock", "ferry.store": "none-such",
                   "ferry.layout": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8,
                                    "dtype": name}}, Role.SCHEDULER)
        c.store
        assert seen["layout"] == ferry.Layout.from_model(2, 2, 8, ours), name


def test_a_second_model_in_one_process_never_reads_the_firsts_store(model):
    """The store "ferry.l1" (or "ferry.server") opens is registered under
    "ferry.store" ("vllm" by default), and a second connector of the same
    process took whatever store it found there: a connector of another model
    with the same layout then found, and loaded, the first model's KV for
    the same prompt (the store's model names the keys). It is refused,
    naming both models; the same model's connectors still share it."""
    from test_adapter_vllm import layer_names
    extra = {"ferry.store": NAME, "ferry.l1": "4M", "ferry.chunk_tokens": CHUNK}
    eng = Engine(model, extra=extra)
    try:
        serve_a(eng)
        a, _ = prompts()
        cfg = vllm_config(dict(extra))
        cfg.model_config.model = "another-model"
        cls = connector_class(cfg)
        w = cls(cfg, Role.WORKER, None)
        with pytest.raises(ValueError, match="'tiny-llama'.*'another-model'"):
            w.register_kv_caches(dict(zip(layer_names(model), model.new_caches(8, 16))))
        s = cls(cfg, Role.SCHEDULER, None)
        with pytest.raises(ValueError, match="give each model its own"):
            s.get_num_new_matched_tokens(Request("x", a), 0)
        same = vllm_config(dict(extra))               # the same model: its store, its hits
        sched = connector_class(same)(same, Role.SCHEDULER, None)
        assert sched.get_num_new_matched_tokens(Request("y", a), 0)[0] > 0
    finally:
        eng.close()


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_another_engines_scheduler_never_counts_the_first_engines_store(model, tp, pp):
    """Two engines of one model in one process (LLM objects under
    VLLM_ENABLE_V1_MULTIPROCESSING=0): the first (TP 1, its worker beside
    its scheduler) opens and registers the store; the second runs its
    workers in other processes (TP or PP above one). Its scheduler took the
    first engine's store as its own and counted that engine's chunks as hits
    its workers, of other heads and keys, never find (a load error per hit,
    a failed request under kv_load_failure_policy "fail"). It is refused,
    naming both engines' parallel sizes; an engine of the same sizes still
    shares the store."""
    from types import SimpleNamespace
    extra = {"ferry.store": NAME, "ferry.l1": "4M", "ferry.chunk_tokens": CHUNK}
    eng = Engine(model, extra=extra)
    try:
        serve_a(eng)
        a, _ = prompts()
        cfg = vllm_config(dict(extra))
        cfg.parallel_config = SimpleNamespace(tensor_parallel_size=tp,
                                              pipeline_parallel_size=pp)
        with pytest.raises(ValueError, match=f"TP size 1 and 1 pipeline.*TP size {tp} and {pp} "):
            s = connector_class(cfg)(cfg, Role.SCHEDULER, None)
            s.get_num_new_matched_tokens(Request("x", a), 0)
        same = vllm_config(dict(extra))
        same.parallel_config = SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1)
        sched = connector_class(same)(same, Role.SCHEDULER, None)
        assert sched.get_num_new_matched_tokens(Request("y", a), 0)[0] > 0
    finally:
        eng.close()


def test_a_whole_float_is_a_count_in_every_setting(monkeypatch):
    """A JSON writer may give 16 as 16.0: "ferry.chunk_tokens" takes it as
    "ferry.layout"'s counts do (one rule for every count), while 16.5 and
    2.5 layers are refused (above), never cut to 16 or 2."""
    seen = {}

    class KVStore:
        def __init__(self, **kw):
            seen.update(kw)
    monkeypatch.setattr(vllm_adapter, "KVStore", KVStore)
    c = build({"ferry.server": "unix:/nonexistent/ferry.sock", "ferry.store": "none-such",
               "ferry.chunk_tokens": 16.0,
               "ferry.layout": {"num_layers": 2.0, "num_kv_heads": "2", "head_dim": 8}},
              Role.SCHEDULER)
    c.store
    assert seen["chunk_tokens"] == 16 and type(seen["chunk_tokens"]) is int
    assert seen["layout"] == ferry.Layout.from_model(2, 2, 8)


# ---- counts: one rule with SGLang's (ferry.adapters._settings.count) ----

COUNT_GOOD = [16, 16.0, "16", " 16 "]
COUNT_BAD = [16.5, True, "0x10", -1, float("nan"), float("inf"), "16.0", "1_000"]


@pytest.mark.parametrize("value", COUNT_GOOD, ids=repr)
def test_a_count_is_an_int_its_decimal_string_or_a_whole_float(monkeypatch, value):
    """"ferry.chunk_tokens" and "ferry.layout"'s counts by the rule SGLang's
    count settings share: the store opens with 16 whichever way 16 is
    written."""
    seen = {}

    class KVStore:
        def __init__(self, **kw):
            seen.update(kw)
    monkeypatch.setattr(vllm_adapter, "KVStore", KVStore)
    spec = {"num_layers": value, "num_kv_heads": 2, "head_dim": value, "dtype": "f32"}
    c = build({"ferry.server": "unix:/nonexistent/ferry.sock", "ferry.store": "none-such",
               "ferry.chunk_tokens": value, "ferry.layout": spec}, Role.SCHEDULER)
    c.store
    assert seen["chunk_tokens"] == 16 and type(seen["chunk_tokens"]) is int
    assert seen["layout"] == ferry.Layout.from_model(16, 2, 16, "f32")


@pytest.mark.parametrize("value", COUNT_BAD, ids=repr)
@pytest.mark.parametrize("where", ["chunk_tokens", "layout"])
def test_a_count_that_is_no_whole_number_is_refused_naming_it(value, where):
    """16.5, a bool, a hex or float string, a negative, NaN: a ValueError
    naming the setting, the value and what a count may be written as."""
    if where == "chunk_tokens":
        extra, key = {"ferry.chunk_tokens": value}, "ferry.chunk_tokens"
    else:
        extra = {"ferry.layout": {"num_layers": 2, "num_kv_heads": value, "head_dim": 8}}
        key = "num_kv_heads"
    with pytest.raises(ValueError) as e:
        build(dict(extra, **{"ferry.store": NAME}), Role.WORKER)
    msg = str(e.value)
    assert key in msg and repr(value) in msg and "whole float" in msg, msg


COUNT_HUGE = ["1" * 5000, fractions.Fraction(10**400)]


@pytest.mark.parametrize("where", ["chunk_tokens", "layout"])
@pytest.mark.parametrize("value", COUNT_HUGE, ids=["5000 digits", "huge Fraction"])
def test_a_count_too_long_for_int_is_refused_naming_it(value, where):
    """A decimal string past int()'s 4300 digits, or a number float() cannot
    hold, is a count out of range: the ValueError names the setting, not
    int()'s digit limit (or an OverflowError the build let through)."""
    if where == "chunk_tokens":
        extra, key = {"ferry.chunk_tokens": value}, "ferry.chunk_tokens"
    else:
        extra = {"ferry.layout": {"num_layers": 2, "num_kv_heads": value, "head_dim": 8}}
        key = "num_kv_heads"
    with pytest.raises(ValueError) as e:
        build(dict(extra, **{"ferry.store": NAME}), Role.WORKER)
    msg = str(e.value)
    assert key in msg and "whole float" in msg, msg
