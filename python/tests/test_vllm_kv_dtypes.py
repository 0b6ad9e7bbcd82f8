"""fp8 KV caches through ferry's vLLM connector. vLLM holds every fp8
format as torch.uint8 caches (STR_DTYPE_TO_TORCH_DTYPE: "fp8", "fp8_e4m3",
"fp8_e5m2" -> torch.uint8; vllm-project/vllm
0024350b5da3ad174435e62a15273c0d3caba57b, vllm/utils/torch_utils.py, the
version the index holds; CacheConfig.cache_dtype documents "fp8" as
fp8_e4m3). So the workers' layout is u8 whatever the format, one byte a
value, and the scheduler's "ferry.layout" must say the same; and two
formats of one layout must never share keys: an fp8_e5m2 reader of an
fp8_e4m3 store's bytes reads other values."""
from types import SimpleNamespace

import pytest
import torch

import ferry
import test_adapter_vllm as tav
from ferry.adapters import _vllm_base as base
from ferry.adapters import vllm as vllm_adapter
from ferry.adapters.vllm import FerryConnector
from test_adapter_vllm import Engine, Request, prompts

Role = base.KVConnectorRole


def _scheduler_layout(monkeypatch, extra, cache_dtype):
    opened = []

    class Client:
        def __init__(self, **kw):
            opened.append(kw)

        def close(self):
            pass

    monkeypatch.setattr(vllm_adapter, "KVStore", Client)
    cfg = tav.vllm_config(dict({"ferry.server": "unix:/nonexistent",
                                "ferry.store": "elsewhere"}, **extra))
    cfg.cache_config.cache_dtype = cache_dtype
    c = FerryConnector(cfg, Role.SCHEDULER)
    c.store
    c._store = None
    return opened[0]["layout"]


@pytest.mark.parametrize("dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_a_ferry_layout_of_vllms_fp8_names_is_the_workers_uint8_layout(monkeypatch, dtype):
    """"ferry.layout" takes vLLM's dtype names. Before the fix "fp8" was
    ferry's own fp8 code, a layout no worker registers (their caches are
    uint8: the daemon refuses the scheduler's HELLO), and "fp8_e4m3" /
    "fp8_e5m2" were refused as no ferry dtype. Now each is the workers'
    layout, with their bytes per token."""
    lay = _scheduler_layout(monkeypatch, {"ferry.layout": {
        "num_layers": 2, "num_kv_heads": 2, "head_dim": 64, "dtype": dtype}}, dtype)
    caches = [torch.zeros(2, 8, 16, 2, 64, dtype=torch.uint8) for _ in range(2)]
    workers = ferry.Layout.from_kv_caches(caches)
    assert lay == workers
    assert lay.token_bytes == workers.token_bytes == 2 * 2 * 2 * 64


@pytest.fixture
def engines(model, store, monkeypatch):
    """Engines over one store (a daemon or persistent L2 two engines share),
    each of its own cache_config.cache_dtype."""
    made = []

    def make(cache_dtype):
        def cfg(extra):
            c = base_cfg(extra)
            c.cache_config.cache_dtype = cache_dtype
            return c
        monkeypatch.setattr(tav, "vllm_config", cfg)
        eng = Engine(model, store)
        made.append(eng)
        return eng
    base_cfg = tav.vllm_config
    yield make
    for eng in made:
        eng.worker.shutdown()
        eng.sched.shutdown()


def _store_prompt(eng, rid):
    a, _ = prompts()
    r = Request(rid, a)
    assert eng.admit(r) == 0
    meta = eng.step_new(r)
    assert [s.tokens for s in meta.saves] == [a[:32]]
    kv = eng.model.kv_of(eng.caches, eng.blocks[rid], 32).clone()
    eng.finish(r)
    return kv


def _lookup(eng, rid):
    a, _ = prompts()
    r = Request(rid, a)
    got = eng.admit(r)
    return r, got


@pytest.mark.parametrize("writer,reader,shared", [
    ("fp8_e4m3", "fp8_e5m2", False), ("fp8_e5m2", "fp8_e4m3", False),
    ("bfloat16", "fp8_e4m3", False), ("fp8", "bfloat16", False), ("auto", "fp8_e5m2", False),
    ("fp8", "fp8_e4m3", True), ("fp8_e5m2", "fp8_e5m2", True), ("auto", "bfloat16", True)])
def test_one_kv_cache_format_never_reads_anothers_chunks(engines, writer, reader, shared):
    """An engine of another KV cache format over the same store. Before the
    fix an fp8_e5m2 engine hit, and loaded, the chunks an fp8_e4m3 engine
    stored (both layouts u8, the keys the same) and read their bytes as
    other values. Now the format is in every key: another format is a miss
    and nothing is loaded; "fp8" and "fp8_e4m3" (one format) share chunks,
    loaded bitwise, and a bf16 cache's keys are those it always had."""
    kv = _store_prompt(engines(writer), "w")
    eng = engines(reader)
    r, got = _lookup(eng, "r")
    if not shared:
        assert got == 0
        eng.finish(r)
        return
    assert got == 32
    eng.load_only(r)
    assert not eng.errors
    assert torch.equal(eng.model.kv_of(eng.caches, eng.blocks["r"], 32), kv)
    eng.finish(r)


def test_a_cache_salt_spelled_as_the_format_tag_is_no_format(engines):
    """The format rides in the salt after a tag; a request whose own
    cache_salt spells that tag is hashed (as every salt tag is), so a bf16
    engine's request cannot name an fp8 engine's keys."""
    a, _ = prompts()
    eng = engines("fp8_e5m2")
    _store_prompt(eng, "w")
    other = engines("auto")
    r = Request("r", a, salt="\0kv-dtype\0fp8_e5m2")
    assert other.admit(r) == 0
    other.finish(r)


def _daemon_scheduler_layout(monkeypatch, cache_dtype):
    """The layout a "ferry.server" scheduler says to the daemon on a vLLM
    that passes no kv_cache_config: model_config's, with
    cache_config.cache_dtype's dtype."""
    opened = []

    class Client:
        def __init__(self, **kw):
            opened.append(kw)

        def close(self):
            pass

    monkeypatch.setattr(vllm_adapter, "KVStore", Client)
    cfg = tav.vllm_config({"ferry.server": "unix:/nonexistent", "ferry.store": "elsewhere"})
    cfg.model_config = SimpleNamespace(model="m", dtype=torch.bfloat16, use_mla=False,
                                       get_num_layers=lambda pc: 2,
                                       get_num_kv_heads=lambda pc: 2, get_head_size=lambda: 64)
    cfg.cache_config.cache_dtype = cache_dtype
    c = FerryConnector(cfg, Role.SCHEDULER)
    try:
        c.store
    finally:
        c._store = None
    return opened[0]["layout"]


@pytest.mark.parametrize("cache_dtype,torch_dtype", [
    pytest.param("fp8_inc", getattr(torch, "float8_e4m3fn", None), marks=pytest.mark.skipif(
        not hasattr(torch, "float8_e4m3fn"), reason="a torch without float8")),
    ("int8_per_token_head", torch.int8),
    ("fp8_e5m2", torch.uint8), ("turboquant_k8v4", torch.uint8), ("nvfp4", torch.uint8),
    ("bfloat16", torch.bfloat16), ("auto", torch.bfloat16)])
def test_a_daemon_schedulers_dtype_is_the_one_vllm_makes_the_caches_of(monkeypatch, cache_dtype,
                                                                      torch_dtype):
    """Where vLLM's get_kv_cache_torch_dtype cannot be asked, ferry reads
    vLLM's STR_DTYPE_TO_TORCH_DTYPE as it knows it (vllm-project/vllm
    0024350b5da3ad174435e62a15273c0d3caba57b, vllm/utils/torch_utils.py).
    Before, every name but the float ones was taken as uint8: fp8_inc
    (float8_e4m3fn caches) and int8_per_token_head (int8) said a layout no
    worker registers, which the daemon refuses."""
    caches = [torch.zeros(2, 8, 16, 2, 64, dtype=torch_dtype) for _ in range(2)]
    assert _daemon_scheduler_layout(monkeypatch, cache_dtype) == \
        ferry.Layout.from_kv_caches(caches)


def test_a_cache_dtype_ferry_does_not_know_is_refused_by_its_name(monkeypatch):
    """Before, a cache_dtype ferry did not know was taken as uint8 in
    silence; now the scheduler's store is refused, naming it."""
    with pytest.raises(ValueError, match="'fp9_e3m4'.*ferry.layout"):
        _daemon_scheduler_layout(monkeypatch, "fp9_e3m4")


def test_a_ferry_layout_of_vllms_turboquant_name_is_uint8(monkeypatch):
    """vLLM's turboquant caches are uint8 (STR_DTYPE_TO_TORCH_DTYPE at
    0024350b); "ferry.layout" refused the name."""
    lay = _scheduler_layout(monkeypatch, {"ferry.layout": {
        "num_layers": 2, "num_kv_heads": 2, "head_dim": 64, "dtype": "turboquant_k8v4"}},
        "turboquant_k8v4")
    assert lay == ferry.Layout.from_model(2, 2, 64, "u8")
