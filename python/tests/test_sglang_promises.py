"""What ferry.adapters.sglang's documentation promises an engine team in
its first hour with `--hicache-storage-backend` (the module docstring and
FerryHiCacheStorage's), held here where no other test holds it: each
extra-config key's values and what a bad one gets (a ValueError naming
the key when SGLang builds the backend, before any store opens), what a
read of a page never stored gives, and the salts keeping models and a
draft model's pool apart. Driven through the calls SGLang makes, against
the stand-ins of tests/sglang_pools.py (which name the upstream commit
they mirror); bytes compared where KV moves."""
import os

import fractions

import pytest
import torch

import ferry
from ferry.adapters import _sglang_base as base, registered_store, unregister_store
from ferry.adapters.sglang import FerryHiCacheStorage
from sglang_pools import (MHAHost, MLAHost, create_backend, fill, indices, page_hashes,
                          storage_config)
from test_adapter_sglang import LayoutDaemon, bits

PN = base.PoolName


@pytest.fixture(autouse=True)
def _clean():
    yield
    for n in ("sgl", "sgl.draft", "p", "p.draft", "sglang"):
        s = unregister_store(n)
        if s is not None:
            s.close()


def build(extra, **cfg):
    """StorageBackendFactory._create_dynamic_backend: the class built with
    (storage_config, kwargs), no pool registered yet."""
    extra = dict({"backend_name": "ferry", "module_path": "ferry.adapters.sglang",
                  "class_name": "FerryHiCacheStorage", "interface_v1": 1}, **extra)
    return FerryHiCacheStorage(storage_config(extra, **cfg), {})


# ---- each key's values: a bad one refused at build, naming the key ----
BAD = [
    ("ferry_key_len", "abc"), ("ferry_key_len", 0), ("ferry_key_len", -64),
    ("ferry_key_len", True), ("ferry_key_len", 2000), ("ferry_key_len", 64.5),
    ("ferry_l1", "16X"), ("ferry_l1", True), ("ferry_l1", -1), ("ferry_l1", [1]),
    ("ferry_l1_mamba", "lots"), ("ferry_l1_draft", "8 gigs"),
    ("ferry_l2", "nodir"), ("ferry_l2", "/tmp/x:9Q"), ("ferry_l2", 7),
    ("ferry_l2_indexer", ["/tmp/a:1G", "/tmp/b"]),
    ("ferry_server", 5), ("ferry_server_mamba", ["unix:/a"]),
    ("ferry_server_timeout_ms", "soon"), ("ferry_server_timeout_ms", -1),
    ("ferry_server_timeout_ms", 2**32), ("ferry_server_timeout_ms", False),
    ("ferry_store", ""), ("ferry_store", 3),
    ("ferry_share_dp", "maybe"), ("ferry_persistent", 2),
]


@pytest.mark.parametrize("key,value", BAD)
def test_a_bad_value_is_refused_when_the_backend_is_built(key, value):
    """Before the fix a bad size, L2, address, timeout or key length passed
    the build: refused only when a pool registered (a per-pool one only
    when that pool did, with a FerryError naming no key), or never
    ("ferry_key_len": 0 built, and then every call of SGLang's controller
    threads raised)."""
    extra = {"ferry_store": "sgl", "ferry_l1": "4M"}
    extra[key] = value
    with pytest.raises(ValueError, match=f"'{key}'"):
        build(extra)
    assert registered_store("sgl") is None     # nothing opened


@pytest.mark.parametrize("key", ["ferry.l1", "ferry.l2", "FERRY_L1", "Ferry_persistent",
                                 "ferry-server", "ferry_l1_nopool", "ferry_l1_"])
def test_another_adapters_spelling_is_refused_not_ignored(key):
    """"ferry.l1" is vLLM's spelling: in SGLang's extra config it switched
    nothing, in silence (a "ferry.l2" beside a "ferry_l1" left the store
    without its L2)."""
    with pytest.raises(ValueError, match=f"{key!r} is no ferry setting"):
        build({"ferry_store": "sgl", "ferry_l1": "4M", key: "8M"})


def test_good_values_as_a_file_carries_them_build_and_work():
    """Strings of digits (a quoted YAML value), ints of bytes, None for
    unset, and SGLang's own keys beside them, all taken."""
    pool = MHAHost("page_first", 4)
    b = create_backend({"ferry_store": "sgl", "ferry_l1": 8 << 20, "ferry_l2": None,
                        "ferry_key_len": " 64", "ferry_server_timeout_ms": "500",
                        "ferry_server": None, "ferry_persistent": "off", "prefetch_threshold": 3},
                       {"kv": pool})
    fill(pool.kv_buffer, 4)
    h = page_hashes(list(range(8)), 4)
    assert b.batch_set_v1(h, indices(0, 2, 4)) == [True, True]
    want = pool.kv_buffer[:, 0:8].clone()
    assert b.batch_get_v1(h, indices(5, 2, 4)) == [True, True]
    assert torch.equal(bits(pool.kv_buffer[:, 20:28]), bits(want))
    with pytest.raises(ValueError, match="keys are 64 bytes"):
        b.batch_exists(["short"])
    b.close()


# ---- a page never stored ----
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_head"])
def test_a_missing_page_reads_as_a_miss_and_writes_nothing(layout):
    """get: None, target_location unchanged; batch_get_v1 / _v2: False for
    the missing page and after, the host pool's bytes there untouched,
    the leading held pages read bitwise."""
    pool = MHAHost(layout, 4)
    b = create_backend({"ferry_store": "sgl", "ferry_l1": "8M"}, {"kv": pool})
    fill(pool.kv_buffer, 7)
    h = page_hashes(list(range(12)), 4)
    assert b.batch_set_v1(h[:1], indices(0, 1, 4)) == [True]
    target = torch.full_like(pool.get_dummy_flat_data_page(), 3.0)
    assert b.get(h[1], target) is None
    assert torch.all(target == 3.0)
    out = b.batch_get([h[0], h[1]], [target.clone(), target.clone()])
    assert out[1] is None and torch.equal(bits(out[0]), bits(pool.get_data_page(0)))
    before = pool.kv_buffer.clone()
    got = b.batch_get_v1(h, indices(8, 3, 4))
    assert got == [True, False, False]
    page0 = MHAHost(layout, 4)
    page0.kv_buffer.copy_(before)
    # the held page landed at host page 8, the rest of the pool as it was
    for i in range(16):
        a, w = pool.get_data_page(i * 4), (page0.get_data_page(0) if i == 8
                                           else page0.get_data_page(i * 4))
        assert torch.equal(bits(a), bits(w)), i
    r = b.batch_get_v2([base.PoolTransfer(name=PN.KV, host_indices=indices(9, 2, 4),
                                          keys=h[1:])])
    assert r == {PN.KV: [False, False]}
    for i in (9, 10):
        assert torch.equal(bits(pool.get_data_page(i * 4)), bits(page0.get_data_page(i * 4)))
    b.close()


# ---- salts and namespaces ----
def test_two_models_on_one_daemon_never_read_each_others_pages(tmp_path):
    """SGLang's page keys hash token ids only: two models of one layout
    served by one `ferry serve` daemon give the same keys for the same
    prompt. The model name (HiCacheStorageConfig.model_name) keeps them
    apart: the other model's backend finds no page of it."""
    pool_a, pool_b = MHAHost("page_first", 4), MHAHost("page_first", 4)
    os.makedirs(tmp_path / "d")
    d = LayoutDaemon(str(tmp_path / "d"), dict(L=2, kv=2, H=2, D=64, dtype=torch.bfloat16), 4)
    try:
        extra = {"ferry_server": d.url, "ferry_server_timeout_ms": 3000}
        a = FerryHiCacheStorage(storage_config(dict(extra, ferry_store="a")), {})
        cfg_b = storage_config(dict(extra, ferry_store="b"))
        cfg_b.model_name = "another-model"
        b = FerryHiCacheStorage(cfg_b, {})
        a.register_mem_pool_host(pool_a)
        b.register_mem_pool_host(pool_b)
        fill(pool_a.kv_buffer, 1)
        h = page_hashes(list(range(8)), 4)
        assert a.batch_set_v1(h, indices(0, 2, 4)) == [True, True]
        assert a.batch_exists(h) == 2
        assert b.batch_exists(h) == 0
        assert b.batch_get_v1(h, indices(0, 2, 4)) == [False, False]
        assert torch.count_nonzero(pool_b.kv_buffer) == 0
        a.close()
        b.close()
    finally:
        d.stop()


def test_an_mla_models_draft_pool_of_mha_pages_keeps_each_tp_rank_apart():
    """Under an MLA model the kv pool is one key for all TP ranks, written by
    rank 0; a draft model's MHA pool is not (its heads are split over TP):
    each rank stores and reads its own, bitwise, and never another's."""
    s = ferry.KVStore("tiny", ferry.Layout(2, 1, 64, "bf16", kv=1), l1="8M", chunk_tokens=4)
    sd = ferry.KVStore("tiny", ferry.Layout(2, 2, 64, "bf16", kv=2), l1="8M", chunk_tokens=4)
    ferry.adapters.register_store("p", s)
    ferry.adapters.register_store("p.draft", sd)
    ranks = []
    for r in range(2):
        pools = {"kv": MLAHost("page_first", 4), "draft": MHAHost("page_first", 4)}
        fill(pools["draft"].kv_buffer, 20 + r)
        ranks.append((create_backend({"ferry_store": "p"}, pools, mla=True, tp=(r, 2)), pools))
    h = page_hashes(list(range(8)), 4)
    (b0, p0), (b1, p1) = ranks
    t = lambda first: [base.PoolTransfer(name=PN.DRAFT, host_indices=indices(first, 2, 4),  # noqa
                                         keys=h)]
    assert b0.batch_set_v2(t(0)) == {PN.DRAFT: [True, True]}
    r1 = b1.batch_exists_v2(h, [base.PoolTransfer(name=PN.DRAFT)])
    assert r1.extra_pool_hit_pages.get(PN.DRAFT, 0) == 0     # rank 0's are not rank 1's
    assert b1.batch_set_v2(t(0)) == {PN.DRAFT: [True, True]}
    w0, w1 = p0["draft"].kv_buffer[:, 0:8].clone(), p1["draft"].kv_buffer[:, 0:8].clone()
    assert not torch.equal(bits(w0), bits(w1))
    for b, p, w in ((b0, p0, w0), (b1, p1, w1)):
        assert b.batch_get_v2(t(4)) == {PN.DRAFT: [True, True]}
        assert torch.equal(bits(p["draft"].kv_buffer[:, 16:24]), bits(w))
    b0.close()
    b1.close()


def test_a_second_model_in_one_process_never_reads_the_firsts_store():
    """The store "ferry_l1" opens is registered as "ferry_store" ("sglang" by
    default), and a second backend of the process finds it there. Before
    the fix a backend of another model took it and hit, and read, the
    first model's pages for the same prompt (SGLang's keys hash token ids
    only). Now refused naming both models; its own "ferry_store" gives it
    its own store, empty, and the same model still shares."""
    pa, pb = MHAHost("page_first", 4), MHAHost("page_first", 4)
    fill(pa.kv_buffer, 1)
    a = create_backend({"ferry_l1": "8M"}, {"kv": pa})
    h = page_hashes(list(range(8)), 4)
    assert a.batch_set_v1(h, indices(0, 2, 4)) == [True, True]
    other = build({"ferry_l1": "8M"})
    other.config.model_name = "another-model"
    with pytest.raises(ValueError, match="model 'tiny'.*'another-model'"):
        other.register_mem_pool_host(pb)
    other = build({"ferry_l1": "8M", "ferry_store": "sgl"})
    other.config.model_name = "another-model"
    other.register_mem_pool_host(pb)
    assert other.batch_exists(h) == 0
    assert other.batch_get_v1(h, indices(0, 2, 4)) == [False, False]
    assert torch.count_nonzero(pb.kv_buffer) == 0
    same = create_backend({"ferry_l1": "8M"}, {"kv": MHAHost("page_first", 4)})
    assert same.batch_exists(h) == 2 and same.store is a.store
    for b in (other, same, a):
        b.close()


def test_a_store_shared_by_name_across_engines_keeps_to_its_model():
    """A vLLM connector and an SGLang backend in one process, given one store
    name: each engine's adapter refused another model's store only when its
    own kind had opened it (vLLM read a mark SGLang never wrote, and back),
    so a vLLM engine of another model took the SGLang backend's store and
    would count, and load, that model's pages. Either adapter now refuses a
    store either one opened for another model, naming both models; the same
    model still shares it."""
    from test_vllm_promises import Role, build as build_vllm
    pa = MHAHost("page_first", 4)
    a = create_backend({"ferry_l1": "8M", "ferry_store": "shared"}, {"kv": pa})
    try:
        for role in Role:
            with pytest.raises(ValueError,
                               match="SGLang adapter for model 'tiny'.*'tiny-llama'"):
                build_vllm({"ferry.store": "shared"}, role).store
    finally:
        a.close()
    assert registered_store("shared") is None
    # the other way: a store a vLLM connector opened, found by SGLang
    import test_vllm_promises as tv
    from tiny_llama import TinyLlama
    model = TinyLlama(seed=4321)
    extra = {"ferry.store": "shared", "ferry.l1": "4M", "ferry.chunk_tokens": tv.CHUNK}
    eng = tv.Engine(model, extra=extra)
    try:
        assert registered_store("shared") is not None   # (its worker opened it)
        other = build({"ferry_l1": "8M", "ferry_store": "shared"})
        with pytest.raises(ValueError, match="vLLM adapter for model 'tiny-llama'.*'tiny'"):
            other.register_mem_pool_host(MHAHost("page_first", 4))
        other.close()
    finally:
        eng.close()


# ---- counts: one rule with vLLM's (ferry.adapters._settings.count) ----

COUNT_GOOD = [16, 16.0, "16", " 16 "]
COUNT_BAD = [16.5, True, "0x10", -1, float("nan"), float("inf"), "16.0", "1_000"]


@pytest.mark.parametrize("value", COUNT_GOOD, ids=repr)
def test_a_count_is_an_int_its_decimal_string_or_a_whole_float(monkeypatch, value):
    """"ferry_key_len" and "ferry_server_timeout_ms" by the rule vLLM's
    count settings share: 16 whichever way it is written (a whole float
    passed the build, then int("16.0") raised as the pool registered)."""
    from ferry.adapters import sglang
    seen = {}

    class KVStore:
        def __init__(self, **kw):
            seen.update(kw)
            self.layout, self.chunk_tokens = kw["layout"], kw["chunk_tokens"]

        def close(self):
            pass
    monkeypatch.setattr(sglang, "KVStore", KVStore)
    b = create_backend({"ferry_server": "unix:/nonexistent/ferry.sock",
                        "ferry_server_timeout_ms": value, "ferry_key_len": value},
                       {"kv": MHAHost("page_first", 4)})
    assert seen["server_timeout_ms"] == 16 and type(seen["server_timeout_ms"]) is int
    b.close()
    monkeypatch.undo()
    b = create_backend({"ferry_store": "sgl", "ferry_l1": "8M", "ferry_key_len": value},
                       {"kv": MHAHost("page_first", 4)})
    assert b.batch_exists(["k" * 16]) == 0
    with pytest.raises(ValueError, match="keys are 16 bytes"):
        b.batch_exists(["short"])
    b.close()


@pytest.mark.parametrize("value", COUNT_BAD, ids=repr)
@pytest.mark.parametrize("key", ["ferry_key_len", "ferry_server_timeout_ms"])
def test_a_count_that_is_no_whole_number_is_refused_naming_it(key, value):
    with pytest.raises(ValueError) as e:
        build({"ferry_store": "sgl", "ferry_l1": "4M", key: value})
    msg = str(e.value)
    assert repr(key) in msg and repr(value) in msg and "whole float" in msg, msg
    assert registered_store("sgl") is None


COUNT_HUGE = ["1" * 5000, fractions.Fraction(10**400)]


@pytest.mark.parametrize("value", COUNT_HUGE, ids=["5000 digits", "huge Fraction"])
@pytest.mark.parametrize("key", ["ferry_key_len", "ferry_server_timeout_ms"])
def test_a_count_too_long_for_int_is_refused_naming_it(key, value):
    with pytest.raises(ValueError) as e:
        build({"ferry_store": "sgl", "ferry_l1": "4M", key: value})
    msg = str(e.value)
    assert repr(key) in msg and "whole float" in msg, msg
    assert registered_store("sgl") is None
