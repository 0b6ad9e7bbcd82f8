"""The SGLang backend keeps every rank's slice of every pool apart, and
shares only what SGLang's controllers treat as the same on every rank.
Pools and controllers are the stand-ins of tests/sglang_pools.py; what a
test mirrors of SGLang is cited at the test."""
import pytest
import torch

import ferry
from ferry.adapters import _sglang_base as base, register_store, unregister_store
from sglang_pools import MambaHost, MHAHost, MLAHost, create_backend, fill, indices, page_hashes

PN, HP = base.PoolName, base.PoolHitPolicy


@pytest.fixture(autouse=True)
def _clean():
    yield
    for n in ("shared", "shared.mamba", "r0", "r0.mamba", "r1", "r1.mamba", "split",
              "split.swa", "split.mamba"):
        s = unregister_store(n)
        if s is not None:
            s.close()


def _shared_stores(kv, mamba):
    register_store("shared", ferry.KVStore("tiny", ferry.Layout(kv.layer_num, 1, kv.head_dim,
                                                                "bf16", kv=1),
                                           l1="4M", chunk_tokens=kv.page_size))
    register_store("shared.mamba", ferry.KVStore("tiny", ferry.Layout(1, 1, mamba.size_per_token,
                                                                      "u8", kv=1),
                                                 l1="4M", chunk_tokens=1))


def test_mla_model_mamba_state_is_per_tp_rank():
    """An MLA model with a mamba pool (Kimi-style MLA + KDA): the MLA kv
    pages are the same on every TP rank, the mamba state is not (its heads
    are split over TP). SGLang's HybridCacheController.should_backup
    (sgl-project/sglang 00343773d3293d382f0b39101f36b656d30ad2f0,
    python/sglang/srt/mem_cache/hybrid_cache/hybrid_cache_controller.py:
    "Kimi-K3 Mamba/KDA state is TP-sharded even when the primary MLA KV
    pool is replicated") has every TP rank back its mamba pool up with
    batch_set_v2 and read it back with batch_get_v2: each rank must get
    its own state back, never another rank's."""
    ranks = []
    for r in range(2):
        pools = {"kv": MLAHost("page_first", 4), "mamba": MambaHost()}
        if r == 0:
            _shared_stores(pools["kv"], pools["mamba"])
        pools["mamba"].fill(10 + 7 * r)
        ranks.append((create_backend({"ferry_store": "shared"}, pools, mla=True, tp=(r, 2)),
                      pools["mamba"]))
    h = page_hashes(list(range(8)), 4)
    want = []
    for b, m in ranks:
        t = base.PoolTransfer(name=PN.MAMBA, host_indices=torch.tensor([2]), keys=h[-1:],
                              hit_policy=HP.TRAILING_PAGES)
        assert b.batch_set_v2([t]) == {PN.MAMBA: [True]}
        want.append(m.get_data_page(2).clone())
    assert not torch.equal(want[0], want[1])
    for (b, m), w in zip(ranks, want):
        m.fill(99)
        t = base.PoolTransfer(name=PN.MAMBA, host_indices=torch.tensor([5]), keys=h[-1:],
                              hit_policy=HP.TRAILING_PAGES)
        assert b.batch_get_v2([t]) == {PN.MAMBA: [True]}
        assert torch.equal(m.get_data_page(5), w)


def test_a_lost_daemon_reads_as_misses_and_calls_resume(tmp_path):
    """SGLang calls the backend from its cache controller's threads and
    catches nothing there (sgl-project/sglang 001067fffe33427bee0ed2f007f
    b7551a1d76b44, python/sglang/srt/managers/cache_controller.py:
    prefetch_thread_func calls batch_exists, prefetch_io_aux_func
    _page_transfer -> batch_get_v1, backup_thread_func _page_backup ->
    batch_set_v1, each catching only queue.Empty): an exception ends the
    thread for the life of the process, and the other TP ranks then wait
    in the prefetch all_reduce for a rank that never comes. A `ferry
    serve` daemon that went away is the store failing, not the caller: it
    reads as misses and pages not stored, and once a daemon serves the
    socket again the same backend's calls find it."""
    from test_adapter_sglang import LayoutDaemon
    from sglang_pools import MHAHost
    lay = dict(L=2, kv=2, H=2, D=64, dtype=torch.bfloat16)
    pool = MHAHost("page_first", 4)
    fill(pool.kv_buffer, 1)
    d = LayoutDaemon(str(tmp_path), lay, 4)
    b = create_backend({"ferry_store": "shared", "ferry_server": d.url,
                        "ferry_server_timeout_ms": 3000}, {"kv": pool})
    h = page_hashes(list(range(16)), 4)
    try:
        assert b.batch_set_v1(h[:2], indices(0, 2, 4)) == [True, True]
        pool.kv_buffer[:, 16:24] = 0
        d.stop()
        assert b.batch_exists(h) == 0
        assert b.exists(h[0]) is False
        assert b.batch_get_v1(h[:2], indices(4, 2, 4)) == [False, False]
        assert b.batch_set_v1(h[2:4], indices(0, 2, 4)) == [False, False]
        assert b.get(h[0], pool.get_dummy_flat_data_page()) is None
        assert b.set(h[3], pool.get_data_page(0)) is False
        r = b.batch_exists_v2(h, [])
        assert r.kv_hit_pages == 0
        assert torch.count_nonzero(pool.kv_buffer[:, 16:24]) == 0   # nothing read
        d = LayoutDaemon(str(tmp_path), lay, 4)                     # a new daemon, same socket
        assert b.batch_set_v1(h[:2], indices(0, 2, 4)) == [True, True]
        assert b.batch_exists(h) == 2
        assert b.batch_get_v1(h[:2], indices(4, 2, 4)) == [True, True]
        assert torch.equal(pool.kv_buffer[:, 16:24], pool.kv_buffer[:, 0:8])
    finally:
        b.close()
        d.stop()


def test_ferry_l2_opens_for_every_rank_and_pool(tmp_path):
    """SGLang builds one backend per (pp, dp, cp, tp) rank, each in its
    own process, from one shared extra config (sgl-project/sglang
    001067fffe33427bee0ed2f007fb7551a1d76b44, python/sglang/srt/mem_cache/
    hicache_storage.py, HiCacheStorageConfig's dp_rank comment), and a
    hybrid model registers a store per pool. One "ferry_l2" directory has
    one owner: every rank's and pool's store gets its own directory under
    it, found again by the same rank after a restart (persistent). Two
    registry names stand in for two processes (each opens its own store)."""
    from sglang_pools import MHAHost
    l2 = f"{tmp_path}:16M"

    def rank(tp, persistent=False):
        pools = {"kv": MHAHost("page_first", 4), "mamba": MambaHost()}
        return create_backend({"ferry_store": f"r{tp}", "ferry_l1": "2M", "ferry_l2": l2,
                               "ferry_persistent": persistent}, pools, tp=(tp, 2)), pools

    (b0, p0), (b1, p1) = rank(0, True), rank(1, True)
    fill(p0["kv"].kv_buffer, 3)
    h = page_hashes(list(range(8)), 4)
    assert b0.batch_set_v1(h, indices(0, 2, 4)) == [True, True]
    b0._pools["kv"][1].sync()
    want = p0["kv"].kv_buffer[:, 0:8].clone()
    b0.close()
    b1.close()
    b0, p0 = rank(0, True)                    # the same rank again: its pages found
    assert b0.batch_exists(h) == 2
    assert b0.batch_get_v1(h, indices(4, 2, 4)) == [True, True]
    assert torch.equal(p0["kv"].kv_buffer[:, 16:24], want)
    b0.close()


def test_mla_at_tp_above_one_refuses_a_store_of_its_own_rank():
    """SGLang writes an MLA model's pages from TP rank 0 only
    (sgl-project/sglang 001067fffe33427bee0ed2f007fb7551a1d76b44,
    python/sglang/srt/managers/cache_controller.py: backup_skip =
    is_mla_model and tp_rank != 0) and takes the smallest storage hit of
    all ranks (prefetch_thread_func's all_reduce MIN). An in-process
    store is one rank's process's own: rank 1's would never hold a page,
    so no prefetch would ever hit, silently. Refused, naming the way that
    works; TP 1, and a mamba pool (each rank writes its own), still open."""
    pools = {"kv": MLAHost("page_first", 4), "mamba": MambaHost()}
    for tp in ((0, 2), (1, 2)):
        with pytest.raises(ValueError, match="MLA model at TP 2.*ferry_server"):
            create_backend({"ferry_store": "r0", "ferry_l1": "2M"}, pools, mla=True, tp=tp)
        assert ferry.adapters.registered_store("r0") is None
    b = create_backend({"ferry_store": "r0", "ferry_l1": "2M"}, pools, mla=True)
    b.close()
    register_store("shared", ferry.KVStore("tiny", ferry.Layout(2, 1, 64, "bf16", kv=1),
                                           l1="4M", chunk_tokens=4))
    b = create_backend({"ferry_store": "shared", "ferry_l1_mamba": "2M"}, pools, mla=True,
                       tp=(1, 2))
    assert set(b._pools) == {"kv", "mamba"}
    b.close()
    unregister_store("shared.mamba")


def log_storage_metrics(storage_metrics):
    """SGLang's StorageMetricsCollector.log_storage_metrics, which
    HiRadixCache.check_hicache_events calls with storage_backend.
    get_stats() on every scheduler step while storage metrics are on
    (sgl-project/sglang 44cedc2b9c7dd31d9acae4498ea4fa0d3665feed,
    python/sglang/srt/observability/metrics_collector.py: None returns,
    anything else must be a StorageMetrics with four lists of numbers):
    an AssertionError here is one on the scheduler's own thread."""
    if storage_metrics is None:
        return []
    assert isinstance(storage_metrics, base.StorageMetrics)
    out = []
    for name in ("prefetch_pgs", "backup_pgs", "prefetch_bandwidth", "backup_bandwidth"):
        vals = list(getattr(storage_metrics, name))
        assert all(isinstance(v, (int, float)) and v >= 0 for v in vals), (name, vals)
        out.append(vals)
    return out


def test_storage_metrics_are_what_sglangs_collector_takes():
    from sglang_pools import MHAHost
    pool = MHAHost("page_first", 4)
    fill(pool.kv_buffer, 2)
    b = create_backend({"ferry_store": "r0", "ferry_l1": "2M"}, {"kv": pool}, metrics=True)
    assert log_storage_metrics(b.get_stats()) == [[], [], [], []]
    h = page_hashes(list(range(12)), 4)
    assert b.batch_set_v1(h, indices(0, 3, 4)) == [True] * 3
    assert b.batch_exists(h) == 3
    assert b.batch_get_v1(h[:2], indices(5, 2, 4)) == [True, True]
    pre, back, pre_bw, back_bw = log_storage_metrics(b.get_stats())
    assert (pre, back) == ([2], [3]) and len(pre_bw) == 1 and len(back_bw) == 1
    assert log_storage_metrics(b.get_stats()) == [[], [], [], []]   # drained by each call
    st = b.ferry_stats()                     # ferry's own counts, per pool
    assert st["kv"]["pages"]["stored"] == 3 and st["kv"]["pages"]["got"] == 2
    b.close()
    off = create_backend({"ferry_store": "r1", "ferry_l1": "2M"}, {"kv": pool}, metrics=False)
    assert off.batch_set_v1(h[:1], indices(0, 1, 4)) == [True]
    assert off.get_stats() is None           # metrics off: as SGLang's base class
    assert off.ferry_stats()["kv"]["pages"]["stored"] == 1
    off.close()


def test_a_misspelt_ferry_key_is_refused():
    """SGLang hands --hicache-storage-backend-extra-config to the backend as
    a dict (sgl-project/sglang 001067fffe33427bee0ed2f007fb7551a1d76b44,
    cache_controller.py _generate_storage_config: extra_config=...) and
    reads no ferry key itself: a misspelt one ("ferry_persistant") would
    silently leave the setting off. Keys of ferry's prefix that name no
    setting are refused, naming the key, before any store opens; other
    keys (SGLang's own, "interface_v1", ...) pass."""
    from sglang_pools import MHAHost
    pool = MHAHost("page_first", 4)
    for bad in ("ferry_persistant", "ferry_l1_kvv", "ferry_server_mambaa", "ferry_l3"):
        with pytest.raises(ValueError, match=f"'{bad}'"):
            create_backend({"ferry_store": "r0", "ferry_l1": "2M", bad: 1}, {"kv": pool})
        assert ferry.adapters.registered_store("r0") is None
    b = create_backend({"ferry_store": "r0", "ferry_l1": "2M", "ferry_l1_mamba": "1M",
                        "ferry_server_indexer": None, "ferry_key_len": 64, "interface_v1": 1,
                        "ferry_share_dp": False}, {"kv": pool})
    b.close()


def test_a_daemon_restarted_with_another_layout_reads_as_misses(tmp_path):
    """A `ferry serve` restarted on the same socket with another chunk size
    (or layout, or seed) answers the reconnecting client FERRY_EMISMATCH,
    and a daemon of another version may answer ENOTSUP or EPARSE: each is
    the store's state, not the caller's mistake, and SGLang calls from
    threads that catch nothing (sgl-project/sglang 001067fffe33427bee0ed2f
    007fb7551a1d76b44, python/sglang/srt/managers/cache_controller.py,
    prefetch_thread_func / backup_thread_func catch only queue.Empty).
    Every call reads as misses / pages not stored, nothing raises, and
    the host pool is untouched."""
    from test_adapter_sglang import LayoutDaemon
    from sglang_pools import MHAHost
    lay = dict(L=2, kv=2, H=2, D=64, dtype=torch.bfloat16)
    pool = MHAHost("page_first", 4)
    fill(pool.kv_buffer, 1)
    d = LayoutDaemon(str(tmp_path), lay, 4)
    b = create_backend({"ferry_store": "shared", "ferry_server": d.url,
                        "ferry_server_timeout_ms": 3000}, {"kv": pool})
    h = page_hashes(list(range(16)), 4)
    try:
        assert b.batch_set_v1(h[:2], indices(0, 2, 4)) == [True, True]
        d.stop()
        d = LayoutDaemon(str(tmp_path), lay, 8)     # another chunk size, same socket
        pool.kv_buffer[:, 16:24] = 0
        assert b.batch_exists(h) == 0
        assert b.exists(h[0]) is False
        assert b.batch_get_v1(h[:2], indices(4, 2, 4)) == [False, False]
        assert b.batch_set_v1(h[2:4], indices(0, 2, 4)) == [False, False]
        assert b.get(h[0], pool.get_dummy_flat_data_page()) is None
        assert b.set(h[3], pool.get_data_page(0)) is False
        assert b.batch_exists_v2(h, []).kv_hit_pages == 0
        assert torch.count_nonzero(pool.kv_buffer[:, 16:24]) == 0
    finally:
        b.close()
        d.stop()


def test_store_failures_warn_once_across_controller_threads(caplog):
    """SGLang's prefetch and backup threads call the backend at once
    (sgl-project/sglang 001067fffe33427bee0ed2f007fb7551a1d76b44,
    python/sglang/srt/managers/cache_controller.py: prefetch_thread_func,
    prefetch_io_aux_func, backup_thread_func): two failures in one
    interval give one warning, whichever thread comes first. The read of
    the last warning's time is made to hold both threads until both have
    read it (the race; a lock around it lets the second in only after the
    first is done, and the wait then gives up)."""
    import threading
    from ferry.adapters.sglang import FerryHiCacheStorage
    from sglang_pools import MHAHost
    both = threading.Barrier(2, timeout=0.5)

    class Slow(dict):
        def get(self, k, default=None):
            at = dict.get(self, k, default)
            try:
                both.wait()
            except threading.BrokenBarrierError:
                pass
            return at

    class Racy(FerryHiCacheStorage):
        @property
        def _warned_at(self):
            return self.__dict__.setdefault("_slow", Slow())

    b = create_backend({"ferry_store": "r0", "ferry_l1": "2M"}, {"kv": MHAHost("page_first", 4)})
    b.__class__ = Racy
    err = ferry.FerryError(ferry.errors.ECONN, "gone", "test")
    caplog.set_level("WARNING", logger="ferry.sglang")
    ts = [threading.Thread(target=b._failed, args=(err, "kv", "get")) for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert len([r for r in caplog.records if r.levelname == "WARNING"]) == 1
    b.__class__ = FerryHiCacheStorage
    b.close()


def test_a_persistent_l2_of_the_shared_directory_is_named_not_lost(tmp_path, caplog):
    """Before each rank and pool opened its own directory under "ferry_l2"
    (08e4f8d), the one rank SGLang could start (TP 1, the kv pool alone)
    kept its persistent L2 in the directory itself. Upgraded, that rank
    opens DIR/kv-pp0of1-... and never reads the old pages: no wrong byte,
    but a warm cache gone with no word. The backend says so, once, naming
    the directory and where the pages are looked for now."""
    from sglang_pools import MHAHost
    old = ferry.KVStore("tiny", ferry.Layout(2, 2, 64, "bf16"), l1="2M",
                        l2=f"{tmp_path}:16M", chunk_tokens=4, persistent=True)
    old.close()
    caplog.set_level("WARNING", logger="ferry.sglang")
    b = create_backend({"ferry_store": "r0", "ferry_l1": "2M", "ferry_l2": f"{tmp_path}:16M",
                        "ferry_persistent": True},
                       {"kv": MHAHost("page_first", 4), "mamba": MambaHost()})
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and str(tmp_path) in warned[0] and "kv-pp0of1" in warned[0]
    b.close()


def test_storage_metrics_count_pages_moved(tmp_path):
    """StorageMetrics' prefetch_pgs / backup_pgs and their GB/s are pages
    moved (Mooncake's backend, sgl-project/sglang 00fe477f32b3878f64d44cc3
    6895e1de4a113afe, mooncake_store.py batch_set_v1: backup_pgs counts the
    keys it puts, and nothing when it puts none). A store that failed moved
    nothing: no pages, and no bandwidth made of a call that returned at
    once; a read counts the pages found."""
    from test_adapter_sglang import LayoutDaemon
    from sglang_pools import MHAHost
    lay = dict(L=2, kv=2, H=2, D=64, dtype=torch.bfloat16)
    pool = MHAHost("page_first", 4)
    fill(pool.kv_buffer, 1)
    d = LayoutDaemon(str(tmp_path), lay, 4)
    b = create_backend({"ferry_store": "shared", "ferry_server": d.url,
                        "ferry_server_timeout_ms": 3000}, {"kv": pool}, metrics=True)
    h = page_hashes(list(range(16)), 4)
    try:
        assert b.batch_set_v1(h[:2], indices(0, 2, 4)) == [True, True]
        assert b.batch_get_v1(h[:3], indices(4, 3, 4)) == [True, True, False]
        m = b.get_stats()
        assert (m.backup_pgs, m.prefetch_pgs) == ([2], [2])
        assert len(m.backup_bandwidth) == 1 and len(m.prefetch_bandwidth) == 1
        d.stop()
        assert b.batch_set_v1(h[2:4], indices(0, 2, 4)) == [False, False]
        assert b.batch_get_v1(h[:2], indices(4, 2, 4)) == [False, False]
        assert b.batch_get(h[:2], [pool.get_dummy_flat_data_page() for _ in range(2)]) == \
            [None, None]
        m = b.get_stats()
        assert (m.backup_pgs, m.prefetch_pgs, m.backup_bandwidth, m.prefetch_bandwidth) == \
            ([], [], [], [])
    finally:
        b.close()
        d.stop()


def test_a_second_pools_first_failure_is_warned_at_once(caplog):
    """The ten-second limit is per pool and failure: a daemon of the kv pool
    gone (ECONN, warned) must not keep a side pool's own first failure,
    another daemon serving another layout (FERRY_EMISMATCH, a wrong
    setting that reads as misses for ever after), at debug level for ten
    seconds, nor a new failure of the same pool (the daemon back with
    another layout). A repeat of one failure in the interval stays quiet."""
    from sglang_pools import MHAHost
    b = create_backend({"ferry_store": "r0", "ferry_l1": "2M"},
                       {"kv": MHAHost("page_first", 4), "mamba": MambaHost()})
    caplog.set_level("DEBUG", logger="ferry.sglang")
    gone = ferry.FerryError(ferry.errors.ECONN, "daemon gone", "test")
    other = ferry.FerryError(ferry.errors.EMISMATCH, "another layout", "test")
    b._failed(gone, "kv", "get")
    b._failed(gone, "kv", "set")            # the same failure again: quiet
    b._failed(other, "mamba", "get")        # another pool's first failure
    b._failed(other, "kv", "get")           # the kv pool's new failure
    b._failed(other, "mamba", "set")        # a repeat: quiet
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 3, warned
    assert "'kv'" in warned[0] and "daemon gone" in warned[0]
    assert "'mamba'" in warned[1] and "another layout" in warned[1]
    assert "'kv'" in warned[2] and "another layout" in warned[2]
    assert len([r for r in caplog.records if r.levelname == "DEBUG"]) == 2
    b.close()


def test_split_heads_leave_the_other_pools_whole_and_found():
    """should_split_heads (tp_lcm_size above tp_size, page_head: sgl-project/
    sglang 001067fffe33427bee0ed2f007fb7551a1d76b44, python/sglang/srt/
    managers/cache_controller.py, _generate_storage_config) splits the kv
    pool's pages into tp_lcm_size / tp_size head groups. A hybrid model's
    other pools (an MHA SWA pool, a mamba state: HybridCacheController.
    _page_backup and _storage_hit_query at sgl-project/sglang
    00343773d3293d382f0b39101f36b656d30ad2f0, python/sglang/srt/mem_cache/
    hybrid_cache/hybrid_cache_controller.py) are moved whole, one page per
    key. Before, they were keyed once per head group:
    an SWA backup indexed a head group the pool does not have (IndexError
    in SGLang's backup thread) and a mamba state, stored under the first
    group only, was never found."""
    kv = MHAHost("page_head", 4, heads=4, head_dim=16)
    swa = MHAHost("page_head", 4, heads=4, head_dim=16)
    mamba = MambaHost()
    b = create_backend({"ferry_store": "split", "ferry_l1": "8M"},
                       {"kv": kv, "swa": swa, "mamba": mamba}, tp=(1, 2), lcm=4, split=True)
    fill(kv.kv_buffer, 1)
    fill(swa.kv_buffer, 2)
    mamba.fill(3)
    h = page_hashes(list(range(12)), 4)
    assert b.batch_set_v1(h, indices(0, 3, 4)) == [True] * 3
    sets = [base.PoolTransfer(name=PN.SWA, host_indices=indices(1, 2, 4), keys=h[1:],
                              hit_policy=HP.TRAILING_PAGES),
            base.PoolTransfer(name=PN.MAMBA, host_indices=torch.tensor([4]), keys=h[-1:],
                              hit_policy=HP.TRAILING_PAGES)]
    assert b.batch_set_v2(sets) == {PN.SWA: [True, True], PN.MAMBA: [True]}
    want_swa = swa.kv_buffer[:, 1:3].clone()
    want_m = mamba.get_data_page(4).clone()
    r = b.batch_exists_v2(h, [base.PoolTransfer(name=PN.SWA, keys=h[1:],
                                                hit_policy=HP.TRAILING_PAGES),
                              base.PoolTransfer(name=PN.MAMBA, keys=h[-1:],
                                                hit_policy=HP.TRAILING_PAGES)])
    assert r.kv_hit_pages == 3
    assert r.extra_pool_hit_pages == {PN.KV: 3, PN.SWA: 3, PN.MAMBA: 3}
    swa.kv_buffer.zero_()
    mamba.fill(99)
    gets = [base.PoolTransfer(name=PN.SWA, host_indices=indices(6, 2, 4), keys=h[1:]),
            base.PoolTransfer(name=PN.MAMBA, host_indices=torch.tensor([7]), keys=h[-1:])]
    assert b.batch_get_v2(gets) == {PN.SWA: [True, True], PN.MAMBA: [True]}
    assert torch.equal(swa.kv_buffer[:, 6:8].view(torch.uint8), want_swa.view(torch.uint8))
    assert torch.equal(mamba.get_data_page(7), want_m)
    # the whole pools are this rank's at its own TP size; the kv pool's pages,
    # its head groups under the TP-4 ranks 2 and 3
    assert b._salts("swa") == ["sglang/swa/pp0/1/dp0/1/tp1/2"]
    assert [s.rsplit("/", 2)[1:] for s in b._salts("kv")] == [["tp2", "4"], ["tp3", "4"]]
    b.close()
