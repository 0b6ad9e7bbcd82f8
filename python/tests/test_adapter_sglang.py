"""ferry's SGLang HiCache storage backend driven through the calls SGLang
makes, against stand-ins of upstream's host pools and cache controllers
(tests/sglang_pools.py says which upstream files and commit they mirror):
every host layout, MHA and MLA, the v1 zero-copy and generic flat-page
paths and the v2 pools (kv, mamba, indexer) with both hit policies,
bitwise, in process and through `ferry serve`; the rank fields keeping
slices apart; bad input refused with nothing written."""
import os
import subprocess
import time

import numpy as np
import pytest
import torch

import ferry
from ferry.adapters import _sglang_base as base, register_store, unregister_store
from sglang_pools import (Controller, IndexerHost, MambaHost, MHAHost, MLAHost, create_backend,
                          fill, indices, page_hashes)
from test_server import cli

PN, HP = base.PoolName, base.PoolHitPolicy
MHA_LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]
MLA_LAYOUTS = ["layer_first", "page_first", "page_first_direct"]


class LayoutDaemon:
    """`ferry serve` for one layout (a daemon serves one), from a YAML config."""

    def __init__(self, tmp, layout, chunk_tokens):
        self.sock = os.path.join(tmp, "ferry.sock")
        dt = {torch.bfloat16: "bf16", torch.float32: "f32", torch.uint8: "u8"}
        cfg = os.path.join(tmp, "serve.yaml")
        with open(cfg, "w") as f:
            f.write(f"model: sglang-test\nchunk_tokens: {chunk_tokens}\nl1_bytes: 16M\n"
                    f"layout: {{num_layers: {layout['L']}, kv: {layout['kv']}, num_heads: "
                    f"{layout['H']}, head_dim: {layout['D']}, dtype: {dt[layout['dtype']]}}}\n")
        self.proc = subprocess.Popen([cli(), "serve", "--config", cfg, "--socket", self.sock],
                                     stderr=subprocess.PIPE, text=True)
        for _ in range(500):
            if os.path.exists(self.sock):
                return
            if self.proc.poll() is not None:
                pytest.fail(f"ferry serve exited: {self.proc.stderr.read()}")
            time.sleep(0.02)
        pytest.fail("ferry serve did not start")

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)

    @property
    def url(self):
        return "unix:" + self.sock


def canon(pool, start):
    """A kv page in one order for every layout: [kv][layers][page][heads][dim]."""
    p = pool.get_data_page(start, flat=False)
    if isinstance(pool, MLAHost):
        return {"layer_first": lambda: p, "page_first": lambda: p.transpose(0, 1),
                "page_first_direct": lambda: p[0]}[pool.layout]().reshape(
                    1, pool.layer_num, pool.page_size, -1)
    return {"layer_first": lambda: p, "page_first": lambda: p.transpose(1, 2),
            "page_first_direct": lambda: p[:, 0],
            "page_head": lambda: p[:, 0].permute(0, 3, 2, 1, 4)}[pool.layout]()


def bits(t):
    return t.contiguous().view(torch.uint8)


@pytest.fixture
def where(request, tmp_path):
    """("local", extra) or ("server", extra) for a kv pool like `pool`; the
    fixture's param names which."""
    daemons = []

    def make(kind, pool, name="sgl"):
        if kind == "local":
            return {"ferry_store": name, "ferry_l1": "8M"}
        lay = dict(L=pool.layer_num, kv=1 if isinstance(pool, MLAHost) else 2,
                   H=pool.head_num, D=pool.head_dim, dtype=pool.dtype)
        d = LayoutDaemon(str(tmp_path / f"d{len(daemons)}"), lay, pool.page_size) \
            if os.makedirs(tmp_path / f"d{len(daemons)}") is None else None
        daemons.append(d)
        return {"ferry_store": name, "ferry_server": d.url, "ferry_server_timeout_ms": 3000}
    yield make
    for d in daemons:
        d.stop()


@pytest.fixture(autouse=True)
def _clean():
    yield
    for n in ("sgl", "sgl.mamba", "sgl.indexer", "shared", "shared.mamba"):
        s = unregister_store(n)
        if s is not None:
            s.close()


def roundtrip(pool, backend, v1, seed=1):
    fill(pool.kv_buffer, seed)
    ctl = Controller(backend, pool, v1)
    page = pool.page_size
    hashes = page_hashes(list(range(500, 500 + 6 * page - 1)), page)
    assert ctl.hit_query(hashes) == 0
    assert ctl.backup(hashes, indices(2, 5, page)) == 5
    assert ctl.hit_query(hashes) == 5
    want = [bits(canon(pool, (2 + i) * page)).clone() for i in range(5)]
    pool.kv_buffer.zero_()
    assert ctl.fetch(hashes, indices(9, 5, page)) == 5
    for i, w in enumerate(want):
        assert torch.equal(bits(canon(pool, (9 + i) * page)), w)
    for p in range(pool.page_num):          # nothing else written
        if not 9 <= p < 14:
            assert torch.count_nonzero(bits(canon(pool, p * page))) == 0


@pytest.mark.parametrize("v1", [True, False], ids=["v1", "generic"])
@pytest.mark.parametrize("layout", MHA_LAYOUTS)
@pytest.mark.parametrize("kind", ["local", "server"])
def test_mha_pages_round_trip_bitwise(kind, layout, v1, where):
    pool = MHAHost(layout, page=4)
    b = create_backend(where(kind, pool), {"kv": pool})
    roundtrip(pool, b, v1)
    b.close()


@pytest.mark.parametrize("v1", [True, False], ids=["v1", "generic"])
@pytest.mark.parametrize("layout", MLA_LAYOUTS)
@pytest.mark.parametrize("kind", ["local", "server"])
def test_mla_pages_round_trip_bitwise(kind, layout, v1, where):
    pool = MLAHost(layout, page=4)
    b = create_backend(where(kind, pool), {"kv": pool}, mla=True)
    roundtrip(pool, b, v1)
    b.close()


@pytest.mark.parametrize("page", [1, 2, 3, 16])
def test_any_page_size(page):
    pool = MHAHost("page_head", page=page, heads=2, head_dim=8, dtype=torch.float32)
    b = create_backend({"ferry_store": "sgl", "ferry_l1": "4M"}, {"kv": pool})
    assert b.store.chunk_tokens == page
    roundtrip(pool, b, True, seed=page)


def test_a_page_is_read_bitwise_into_another_host_layout():
    """ferry holds one chunk order: a page backed up from a page_first pool
    loads into a layer_first or page_head pool of another process."""
    pools = {lay: MHAHost(lay, page=4) for lay in MHA_LAYOUTS}
    s = ferry.KVStore("tiny", ferry.Layout(2, 2, 64, "bf16"), l1="8M", chunk_tokens=4)
    register_store("shared", s)
    src = pools["page_first"]
    fill(src.kv_buffer, 7)
    hashes = page_hashes(list(range(12)), 4)
    wb = create_backend({"ferry_store": "shared"}, {"kv": src})
    assert wb.batch_set_v1(hashes, indices(0, 3, 4)) == [True] * 3
    for lay in ("layer_first", "page_first_direct", "page_head"):
        dst = pools[lay]
        rb = create_backend({"ferry_store": "shared"}, {"kv": dst})
        assert rb.batch_get_v1(hashes, indices(5, 3, 4)) == [True] * 3
        for i in range(3):
            assert torch.equal(bits(canon(dst, (5 + i) * 4)), bits(canon(src, i * 4)))


def hybrid_pools(layout="page_first", mla=True):
    kv = MLAHost(layout, page=4) if mla else MHAHost(layout, page=4)
    return {"kv": kv, "mamba": MambaHost(), "indexer": IndexerHost(kv)}


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("kind", ["local", "server"])
def test_v2_hybrid_pools_round_trip_and_hit_policies(kind, layout, where, tmp_path):
    pools = hybrid_pools(layout)
    kv, mamba, idx = pools["kv"], pools["mamba"], pools["indexer"]
    extra = where(kind, kv)
    mdaemon = None
    if kind == "server":    # the mamba pool's flat pages: a daemon of their own
        os.makedirs(tmp_path / "m")
        mdaemon = LayoutDaemon(str(tmp_path / "m"), dict(L=1, kv=1, H=1, D=mamba.size_per_token,
                                                         dtype=torch.uint8), 1)
        extra["ferry_server_mamba"] = mdaemon.url
        extra["ferry_l1_indexer"] = "4M"          # the indexer in process
    try:
        b = create_backend(extra, pools, mla=True)
        fill(kv.kv_buffer, 3)
        mamba.fill(4)
        fill(idx.index_k_with_scale_buffer, 5)
        ctl = Controller(b, kv, True)
        hashes = page_hashes(list(range(6 * 4)), 4)
        kvi = indices(1, 6, 4)
        # the mamba state of the last page, the indexer's pages beside the kv pages
        m_t = base.PoolTransfer(name=PN.MAMBA, host_indices=torch.tensor([3]),
                                keys=hashes[-1:], hit_policy=HP.TRAILING_PAGES)
        i_t = base.PoolTransfer(name=PN.INDEXER, host_indices=kvi, keys=list(hashes),
                                hit_policy=HP.ALL_PAGES, indices_from_pool=PN.KV)
        r = ctl.hit_query(hashes, [m_t, i_t])
        assert (r.kv_hit_pages, r.extra_pool_hit_pages) == (0, {})
        assert ctl.backup(hashes, kvi, [m_t, i_t]) == 6
        want_m = mamba.get_data_page(3).clone()
        want_i = [idx.page(s) for s in kvi[::4]]
        want_kv = [bits(canon(kv, int(s))).clone() for s in kvi[::4]]
        m_t.keys = hashes[-1:]
        r = ctl.hit_query(hashes, [m_t, i_t])
        assert r.kv_hit_pages == 6
        assert r.extra_pool_hit_pages == {PN.KV: 6, PN.MAMBA: 6, PN.INDEXER: 6}
        kv.kv_buffer.zero_()
        mamba.fill(99)
        idx.index_k_with_scale_buffer.zero_()
        dst = indices(8, 6, 4)
        m_get = base.PoolTransfer(name=PN.MAMBA, host_indices=torch.tensor([6]),
                                  keys=hashes[-1:], hit_policy=HP.TRAILING_PAGES)
        i_get = base.PoolTransfer(name=PN.INDEXER, host_indices=dst, keys=list(hashes))
        n, res = ctl.fetch(hashes, dst, [m_get, i_get])
        assert n == 6 and res == {PN.MAMBA: [True], PN.INDEXER: [True] * 6}
        assert torch.equal(mamba.get_data_page(6), want_m)
        for j, s in enumerate(dst[::4]):
            assert torch.equal(idx.page(s), want_i[j])
            assert torch.equal(bits(canon(kv, int(s))), want_kv[j])
        # hit policies: a prefix of 4 kv pages whose mamba state is not stored
        # (TRAILING_PAGES) finds the longest prefix ending on a stored state;
        # the indexer missing page 2 (ALL_PAGES) cuts the prefix to 2.
        longer = hashes + page_hashes(list(range(40, 48)), 4, prior=hashes[-1])
        assert b.batch_set_v1(longer[6:], indices(0, 2, 4)) == [True, True]
        r = b.batch_exists_v2(longer, [base.PoolTransfer(name=PN.MAMBA, keys=["x"],
                                                         hit_policy=HP.TRAILING_PAGES)])
        assert (r.kv_hit_pages, r.extra_pool_hit_pages[PN.MAMBA]) == (6, 6)
        r = b.batch_exists_v2(longer, [base.PoolTransfer(name=PN.MAMBA, keys=["x", "y"],
                                                         hit_policy=HP.TRAILING_PAGES)])
        assert r.kv_hit_pages == 0 and PN.MAMBA not in r.extra_pool_hit_pages
        r = b.batch_exists_v2(longer, [base.PoolTransfer(name=PN.INDEXER)])
        assert (r.kv_hit_pages, r.extra_pool_hit_pages[PN.INDEXER]) == (6, 6)
        b._pools["indexer"][1].delete_named([hashes[2]], salt=b._salts("indexer")[0])
        r = b.batch_exists_v2(hashes, [base.PoolTransfer(name=PN.INDEXER)])
        assert (r.kv_hit_pages, r.extra_pool_hit_pages) == (2, {PN.KV: 6, PN.INDEXER: 2})
        st = b.ferry_stats()
        assert set(st) == {"kv", "mamba", "indexer"}
        assert st["mamba"]["pages"]["stored"] == 1 and st["kv"]["pages"]["got"] == 6
        assert st["kv"]["store"] == b.store.stats() or st["kv"]["store"].keys() == b.store.stats().keys()
        assert b.clear() is True
        assert b.batch_exists(hashes) == 0
        b.close()
    finally:
        if mdaemon:
            mdaemon.stop()


def two_ranks(extra_cfgs, pool_fn, mla=False):
    """Backends of two ranks sharing one registered store."""
    pools = [pool_fn(), pool_fn()]
    s = ferry.KVStore("tiny", ferry.Layout(2, 1 if mla else pools[0].head_num, pools[0].head_dim,
                                           "bf16", kv=1 if mla else 2),
                      l1="8M", chunk_tokens=4)
    register_store("shared", s)
    return [create_backend({"ferry_store": "shared"}, {"kv": p}, mla=mla, **c)
            for p, c in zip(pools, extra_cfgs)], pools


@pytest.mark.parametrize("field", ["tp", "pp", "dp", "cp"])
def test_two_ranks_pages_never_collide(field):
    cfgs = [{field: (0, 2)}, {field: (1, 2)}]
    (b0, b1), (p0, p1) = two_ranks(cfgs, lambda: MHAHost("page_first", 4))
    fill(p0.kv_buffer, 10)
    fill(p1.kv_buffer, 11)
    h = page_hashes(list(range(8)), 4)
    assert b0.batch_set_v1(h, indices(0, 2, 4)) == [True, True]
    assert b1.batch_exists(h) == 0                        # rank 1 sees none of rank 0's
    assert b1.batch_set_v1(h, indices(0, 2, 4)) == [True, True]
    w0, w1 = p0.kv_buffer.clone(), p1.kv_buffer.clone()
    p0.kv_buffer.zero_()
    p1.kv_buffer.zero_()
    assert b0.batch_get_v1(h, indices(3, 2, 4)) == [True, True]
    assert b1.batch_get_v1(h, indices(3, 2, 4)) == [True, True]
    assert torch.equal(bits(p0.kv_buffer[:, 12:20]), bits(w0[:, 0:8]))
    assert torch.equal(bits(p1.kv_buffer[:, 12:20]), bits(w1[:, 0:8]))


def test_dp_replicas_share_when_asked():
    cfgs = [{"dp": (0, 2)}, {"dp": (1, 2)}]
    (b0, b1), (p0, _) = two_ranks(cfgs, lambda: MHAHost("layer_first", 4))
    for b in (b0, b1):
        b._base_tag = b._base_tag.split("/dp")[0]        # what "ferry_share_dp": true builds
    fill(p0.kv_buffer, 3)
    h = page_hashes(list(range(4)), 4)
    assert b0.batch_set_v1(h, indices(0, 1, 4)) == [True]
    assert b1.batch_exists(h) == 1
    cfg = create_backend({"ferry_store": "shared", "ferry_share_dp": True},
                         {"kv": MHAHost("layer_first", 4)}, dp=(1, 2))
    assert "dp" not in cfg._base_tag and cfg.batch_exists(h) == 1


def test_mla_pages_shared_by_tp_ranks_split_by_cp_ranks():
    (b0, b1), (p0, p1) = two_ranks([{"tp": (0, 2)}, {"tp": (1, 2)}],
                                   lambda: MLAHost("page_first", 4), mla=True)
    fill(p0.kv_buffer, 5)
    fill(p1.kv_buffer, 6)
    h = page_hashes(list(range(4)), 4)
    assert b1.batch_set_v1(h, indices(0, 1, 4)) == [True]    # rank 1 does not write
    assert b0.batch_exists(h) == 0
    assert b0.batch_set_v1(h, indices(0, 1, 4)) == [True]
    assert b1.batch_get_v1(h, indices(2, 1, 4)) == [True]    # every rank reads rank 0's
    assert torch.equal(bits(p1.kv_buffer[8:12]), bits(p0.kv_buffer[0:4]))
    c0 = create_backend({"ferry_store": "shared"}, {"kv": MLAHost("page_first", 4)}, mla=True,
                        cp=(0, 2))
    c1 = create_backend({"ferry_store": "shared"}, {"kv": MLAHost("page_first", 4)}, mla=True,
                        cp=(1, 2))
    assert c0.batch_exists(h) == 0 and c1.batch_exists(h) == 0


def test_split_heads_share_pages_across_tp_sizes():
    """TP 2 with tp_lcm_size 4 stores each page as two head groups under
    TP-4 ranks; a TP-4 instance's rank reads its group bitwise."""
    s = ferry.KVStore("tiny", ferry.Layout(2, 2, 16, "bf16"), l1="8M", chunk_tokens=4)
    register_store("shared", s)
    big = MHAHost("page_head", 4, heads=4, head_dim=16)      # TP 2: 4 heads a rank
    fill(big.kv_buffer, 8)
    b2 = create_backend({"ferry_store": "shared"}, {"kv": big}, tp=(1, 2), lcm=4, split=True)
    h = page_hashes(list(range(8)), 4)
    assert b2.batch_set_v1(h, indices(0, 2, 4)) == [True, True]
    for g in range(2):                                         # TP-4 ranks 2 and 3
        small = MHAHost("page_head", 4, heads=2, head_dim=16)
        b4 = create_backend({"ferry_store": "shared"}, {"kv": small}, tp=(2 + g, 4), lcm=4)
        assert b4.batch_get_v1(h, indices(5, 2, 4)) == [True, True]
        assert torch.equal(bits(small.kv_buffer[:, 5:7]),
                           bits(big.kv_buffer[:, 0:2, 2 * g:2 * g + 2]))
    big.kv_buffer.zero_()
    assert b2.batch_get_v1(h, indices(3, 2, 4)) == [True, True]  # and back, both groups
    assert torch.count_nonzero(big.kv_buffer[:, 3:5]) == big.kv_buffer[:, 3:5].numel()


@pytest.mark.parametrize("kind", ["local", "server"])
def test_exists_answers_alike_packed_and_not(kind, where):
    """batch_exists sends keys of one length packed, others as an array:
    the same leading hits either way, over two head groups too; after
    the store's close, an error."""
    pool = MHAHost("page_head", 4, heads=4, head_dim=16)
    b = create_backend(where(kind, pool), {"kv": pool})
    big = MHAHost("page_head", 4, heads=4, head_dim=16)
    bs = create_backend({"ferry_store": "shared", "ferry_l1": "8M"}, {"kv": big}, tp=(0, 2),
                        lcm=4, split=True)
    fill(pool.kv_buffer, 2)
    fill(big.kv_buffer, 3)
    h = page_hashes(list(range(16)), 4)
    assert len({len(k) for k in h}) == 1 and len(h) == 4
    for x in (b, bs):
        assert x.batch_set_v1(h[:3], indices(0, 3, 4)) == [True] * 3
        for n in range(1, 5):
            assert x.batch_exists(h[:n]) == min(n, 3)
            assert x.batch_exists(h[:n] + ["short"]) == min(n, 3)      # mixed: the array
        assert x.exists(h[0]) and not x.exists(h[3])
        assert x.batch_exists([h[0], h[3], h[1]]) == 1
        assert x.batch_exists([h[0].encode(), bytearray(h[1].encode())]) == 2
        assert x.batch_exists([np.bytes_(h[0].encode())]) == 1         # a bytes subclass
        assert x.batch_exists([h[0], h[1], "\u00e9" * 64]) == 2         # 64 chars, 128 bytes
        assert x.batch_exists([]) == 0
    # one head group missing: no page is held
    bs.store.delete_named(h[1:2], salt=bs._salts("kv")[1])
    assert bs.batch_exists(h) == 1 and bs.batch_exists(h[:1] + ["short"]) == 1
    b._fold("kv")
    assert b._counts["kv"]["exists"] == (1 + 2 + 3 + 4) + (2 + 3 + 4 + 5) + 2 + 3 + 2 + 1 + 3
    assert b._counts["kv"]["hit"] == 2 * (1 + 2 + 3 + 3) + 1 + 1 + 2 + 1 + 2
    b.store.close()
    for keys in (h[:1], h[:2], h[:1] + ["short"]):
        with pytest.raises(ferry.FerryError, match="closed"):
            b.batch_exists(keys)
    b.close()
    bs.close()


def nothing_stored(b, keys):
    return b.store.lookup_named(keys, salt=b._salts("kv")[0]) == 0


def test_bad_input_is_refused_and_writes_nothing():
    pool = MHAHost("page_first", 4)
    pools = hybrid_pools("page_first", mla=False)
    b = create_backend({"ferry_store": "sgl", "ferry_l1": "8M", "ferry_key_len": 64},
                       {"kv": pools["kv"], "mamba": pools["mamba"]})
    fill(pools["kv"].kv_buffer, 1)
    h = page_hashes(list(range(8)), 4)
    # a page of the wrong size
    with pytest.raises(ValueError, match="a page is"):
        b.set(h[0], torch.zeros(pool.get_dummy_flat_data_page().numel() - 1, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="need 8 host indices, got 7"):
        b.batch_set_v1(h, indices(0, 2, 4)[:7])
    # an unknown pool name: refused before any pool's pages move
    with pytest.raises(ValueError, match="'indexer' is not registered"):
        b.batch_set_v2([base.PoolTransfer(name=PN.MAMBA, host_indices=torch.tensor([0]),
                                          keys=h[:1]),
                        base.PoolTransfer(name=PN.INDEXER, host_indices=indices(0, 1, 4),
                                          keys=h[:1])])
    with pytest.raises(ValueError, match="'swa' is not registered"):
        b.batch_exists_v2(h, [base.PoolTransfer(name=PN.SWA)])
    # keys of the wrong length
    with pytest.raises(ValueError, match="key 1 of 2 is 63 bytes; keys are 64 bytes"):
        b.batch_set_v1([h[0], h[1][:63]], indices(0, 2, 4))
    with pytest.raises(TypeError, match="key 0 is int"):
        b.batch_exists([7])
    for bad in ([h[0][:63]], [h[0], h[1][:63]]):       # the one-key and the packed paths
        with pytest.raises(ValueError, match=f"key {len(bad) - 1} of {len(bad)} is 63 bytes"):
            b.batch_exists(bad)
    # a host index off a page boundary
    with pytest.raises(ValueError, match="not at a page boundary"):
        b.batch_set_v1(h[:1], indices(0, 1, 4) + 1)
    assert nothing_stored(b, h)
    assert b._pools["mamba"][1].lookup_named(h[:1], salt=b._salts("mamba")[0]) == 0
    # a pool whose layout differs from what the backend (or its store) holds
    with pytest.raises(ValueError, match="registered again"):
        b.register_mem_host_pool_v2(MHAHost("page_first", 4, heads=1), PN.KV)
    with pytest.raises(ValueError, match="its store holds"):
        create_backend({"ferry_store": "sgl"}, {"kv": MHAHost("page_first", 8)})
    b.close()


def test_setups_refused_before_anything_opens():
    pools = hybrid_pools("page_first", mla=False)
    with pytest.raises(RuntimeError, match="no store registered as 'nowhere'"):
        create_backend({"ferry_store": "nowhere"}, {"kv": pools["kv"]})
    with pytest.raises(RuntimeError, match=r"ferry_server_mamba\" \(a daemon serves one layout"):
        create_backend({"ferry_store": "sgl", "ferry_l1_kv": "1M"},
                       {"kv": pools["kv"], "mamba": pools["mamba"]})
    with pytest.raises(ValueError, match="should_split_heads needs"):
        create_backend({"ferry_store": "sgl", "ferry_l1": "1M"}, {"kv": pools["kv"]}, mla=True,
                       lcm=4, split=True, tp=(0, 2))


def test_real_sglang_base_class_when_installed():
    mod = pytest.importorskip("sglang.srt.mem_cache.hicache_storage")
    from ferry.adapters.sglang import FerryHiCacheStorage
    assert issubclass(FerryHiCacheStorage, mod.HiCacheStorage)


def test_stand_in_base_without_sglang():
    if base.SGLANG:
        pytest.skip("SGLang is installed: its own base class is used")
    from ferry.adapters.sglang import FerryHiCacheStorage
    assert FerryHiCacheStorage.__mro__[1].__module__ == "ferry.adapters._sglang_base"
    assert not getattr(FerryHiCacheStorage, "__abstractmethods__", None)


def test_extra_config_flags_read_as_booleans_from_a_file():
    """SGLang's HiRadixCache._parse_storage_backend_extra_config (sgl-project/
    sglang, the stored versions of python/sglang/srt/mem_cache/
    hiradix_cache.py) reads --hicache-storage-backend-extra-config inline as
    JSON or as @file.json / .toml / .yaml, and hands the dict on as
    HiCacheStorageConfig.extra_config: a quoted YAML value is a string.
    "false" must read False (bool("false") is True: DP replicas would
    share pages they do not compute alike), and a value that is neither
    is refused naming the key, before any store opens."""
    pool = MHAHost("page_first", 4)
    base_extra = {"ferry_store": "sgl", "ferry_l1": "4M"}
    for val, shared in (("false", False), ("No", False), (0, False), (False, False),
                        ("true", True), ("on", True), (1, True), (True, True)):
        b = create_backend(dict(base_extra, ferry_share_dp=val), {"kv": pool}, dp=(1, 2))
        assert ("/dp1/2" not in b._base_tag) == shared, (val, b._base_tag)
        b.close()
    for key in ("ferry_share_dp", "ferry_persistent"):
        with pytest.raises(ValueError, match=f"'{key}' is true or false, got 'maybe'"):
            create_backend(dict(base_extra, **{key: "maybe"}), {"kv": pool})
        assert ferry.adapters.registered_store("sgl") is None     # nothing opened
