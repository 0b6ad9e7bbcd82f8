"""DeepSeek V4's host pools under the SGLang backend: the logical KV
anchor (no bytes), the compressed page-row pools, and host indices that
are not whole pages of them. Pools are the stand-ins of
tests/sglang_pools.py (V4's mirror sgl-project/sglang 00343773d3293d382f0b
39101f36b656d30ad2f0, python/sglang/srt/mem_cache/memory_pool_host.py);
what a test mirrors of SGLang is cited at the test."""
import logging

import pytest
import torch

from ferry.adapters import _sglang_base as base, unregister_store
from sglang_pools import (IndexerHost, LogicalHost, MambaHost, MHAHost, V4RowsHost,
                          create_backend, fill, indices, page_hashes)

PN, HP, PT = base.PoolName, base.PoolHitPolicy, base.PoolTransfer
C4, C4S = PN.DEEPSEEK_V4_C4, PN.DEEPSEEK_V4_C4_STATE
C4I, SWA = PN.DEEPSEEK_V4_C4_INDEXER, PN.SWA


@pytest.fixture(autouse=True)
def _clean():
    yield
    for n in ("v4", "v4.deepseek_v4_c4", "v4.deepseek_v4_c4_state", "v4.swa",
              "v4.deepseek_v4_c4_indexer", "h", "h.indexer", "h.mamba"):
        s = unregister_store(n)
        if s is not None:
            s.close()


def v4_backend(pools, **kw):
    return create_backend({"ferry_store": "v4", "ferry_l1": "4M"}, pools, mla=True, **kw)


def restorable(r):
    return getattr(r, "restorable_prefix_pages", None)


def test_a_logical_kv_anchor_registers_and_holds_no_bytes():
    """V4's KV anchor is a LogicalHostPool (kv_buffer None, empty pages):
    SGLang registers it as the kv pool (register_mem_pool_host). Mooncake's
    backend (sgl-project/sglang 00fe477f32b3878f64d44cc36895e1de4a113afe,
    python/sglang/srt/mem_cache/storage/mooncake_store/mooncake_store.py:
    register_mem_pool_host returns for kv_buffer None, batch_get_v1 and
    batch_set_v1 answer [True] * len(keys), batch_exists_v2 starts from
    every KV prefix and lets the side pools decide) treats it as holding
    nothing to move. ferry too: it opens no store for it, moves nothing
    for it, and the side pools' pages decide the usable prefix; with no
    side pool asked, nothing is a hit (no page would carry a byte)."""
    anchor, c4 = LogicalHost(page=8), V4RowsHost("page_first", 2)
    b = v4_backend({"kv": anchor, C4.value: c4}, metrics=True)
    h = page_hashes(list(range(48)), 8)
    assert b.batch_set_v1(h[:2], indices(0, 2, 8)) == [True, True]
    assert b.batch_get_v1(h[:2], indices(2, 2, 8)) == [True, True]
    assert b.batch_exists(h) == 0 and b.exists(h[0]) is False
    assert b.get(h[0], anchor.get_dummy_flat_data_page()) is None
    c4.fill(5)
    t = PT(name=C4, host_indices=indices(0, 3, 2), keys=h[:3])
    assert b.batch_set_v2([t]) == {C4: [True] * 3}
    r = b.batch_exists_v2(h[:5], [PT(name=C4)])
    assert r.kv_hit_pages == 3 and r.extra_pool_hit_pages[C4] == 3
    assert restorable(r) in (None, [1, 2, 3])
    assert b.batch_exists_v2(h[:5], []).kv_hit_pages == 0
    assert b.get_stats() is not None and set(b.ferry_stats()) == {"kv", C4.value}
    assert b.clear()
    b.close()


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
@pytest.mark.parametrize("state", [False, True])
def test_v4_row_pools_round_trip_bitwise(layout, state):
    """A compressed pool's page is one row of every layer (its
    get_data_page / set_from_flat_data_page at 00343773, host index i in
    row i // page_size): stored from rows 1..3, read into rows 5..7, the
    same bytes, in each host layout V4 allocates (layer_first is a list
    of per-layer tensors, which ferry used to refuse at register)."""
    name = C4S if state else C4
    pool = V4RowsHost(layout, 4, state=state)
    pool.fill(7)
    b = v4_backend({"kv": LogicalHost(page=16), name.value: pool})
    h = page_hashes(list(range(48)), 16)
    want = [pool.row(i * 4).clone() for i in (1, 2, 3)]
    assert b.batch_set_v2([PT(name=name, host_indices=indices(1, 3, 4), keys=h)]) == \
        {name: [True] * 3}
    assert b.batch_get_v2([PT(name=name, host_indices=indices(5, 3, 4), keys=h)]) == \
        {name: [True] * 3}
    for i, w in zip((5, 6, 7), want):
        assert torch.equal(pool.row(i * 4), w)
    b.close()


def test_v4_host_indices_not_whole_pool_pages_read_as_misses(caplog):
    """Host indices that are not a V4 row pool's whole pages. HybridCache-
    Controller (sgl-project/sglang 00343773d3293d382f0b39101f36b656d30ad2f0,
    python/sglang/srt/mem_cache/hybrid_cache/hybrid_cache_controller.py)
    gives a KV-derived pool the KV anchor's indices on backup and prefetch,
    and _apply_kv_anchor_ratio would divide them by page_size //
    slot_page_size: SGLang's V4 stack builds those pools with the anchor's
    page size (ratio 1, the anchor's indices whole pages of them: the test
    below replays that), but a pool of a smaller page (here 4 under an
    anchor of 16) would get the anchor's, the anchor's over the ratio, or
    token-granular ones (backup_from_device_all_layer's C4 copy). Each used
    to raise ValueError into SGLang's backup or prefetch thread, which
    dies. ferry cannot tell which rows such indices name, so it moves
    nothing: not stored, a miss, the host pool untouched, one warning
    naming the pool; pages at whole rows still move."""
    pool = V4RowsHost("page_first", 4)
    pool.fill(3)
    b = v4_backend({"kv": LogicalHost(page=16), C4.value: pool})
    h = page_hashes(list(range(64)), 16)
    caplog.set_level(logging.WARNING, logger="ferry.sglang")
    bad = [indices(0, 2, 16),                      # the anchor's (16 a page, not 4)
           indices(0, 2, 16) // 4,                 # the anchor's over the ratio: repeats
           torch.tensor([2, 3, 4, 5, 6, 7, 8, 9]),   # a run of 4 off a row start
           torch.arange(6)]                        # token-granular
    for hi in bad:
        assert b.batch_set_v2([PT(name=C4, host_indices=hi, keys=h[:2])]) == {C4: [False] * 2}
    assert b.batch_exists_v2(h[:2], [PT(name=C4)]).kv_hit_pages == 0
    assert b.batch_set_v2([PT(name=C4, host_indices=indices(0, 2, 4), keys=h[:2])]) == \
        {C4: [True] * 2}
    before = pool.kv_buffer.clone()
    for hi in bad:
        assert b.batch_get_v2([PT(name=C4, host_indices=hi, keys=h[:2])]) == {C4: [False] * 2}
    assert torch.equal(pool.kv_buffer, before)
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "deepseek_v4_c4" in warned[0].getMessage()
    b.close()


def test_v2_usable_prefix_is_a_stop_point_every_pool_restores():
    """A trailing-pages pool (mamba, SWA) can restore only at the ends of
    its stored windows, so the usable prefix is the greatest stop point
    every pool restores, not the least of the pools' greatest ones.
    Mooncake's batch_exists_v2 (sgl-project/sglang 00fe477f32b3878f64d44c
    c36895e1de4a113afe, mooncake_store.py) intersects the pools' stop
    points and returns them as PoolTransferResult.restorable_prefix_pages
    (hicache_storage.py at that commit: the caller intersects these sets
    over ranks). kv holds 6 pages, the indexer the first 5, mamba the
    states ending pages 3 and 6: 3 is the prefix; 5 (the old answer) has
    no mamba state."""
    kv = MHAHost("page_first", 4)
    idx, mamba = IndexerHost(kv), MambaHost(slots=8)
    fill(kv.kv_buffer, 1)
    mamba.fill(2)
    b = create_backend({"ferry_store": "h", "ferry_l1": "4M"},
                       {"kv": kv, "indexer": idx, "mamba": mamba})
    h = page_hashes(list(range(24)), 4)
    assert b.batch_set_v1(h, indices(0, 6, 4)) == [True] * 6
    assert b.batch_set_v2([PT(name=PN.INDEXER, host_indices=indices(0, 5, 4), keys=h[:5])]) \
        == {PN.INDEXER: [True] * 5}
    for end in (3, 6):
        assert b.batch_set_v2([PT(name=PN.MAMBA, host_indices=torch.tensor([end]),
                                  keys=h[end - 1:end])]) == {PN.MAMBA: [True]}
    r = b.batch_exists_v2(h, [PT(name=PN.INDEXER),
                              PT(name=PN.MAMBA, keys=h[-1:], hit_policy=HP.TRAILING_PAGES)])
    assert r.kv_hit_pages == 3
    assert r.extra_pool_hit_pages == {PN.KV: 6, PN.INDEXER: 5, PN.MAMBA: 6}
    assert restorable(r) == [3]
    b.close()


def test_a_v4_scale_pool_takes_its_own_settings():
    """SGLang names an FP4 indexer's scale pool DEEPSEEK_V4_C4_INDEXER_SCALE
    (sgl-project/sglang 00fe477f32b3878f64d44cc36895e1de4a113afe,
    python/sglang/srt/mem_cache/hicache_storage.py PoolName): its per-pool
    settings ("ferry_l1_deepseek_v4_c4_indexer_scale") are ferry's, not a
    misspelling, and the pool registers as a row pool."""
    name = "deepseek_v4_c4_indexer_scale"
    assert PN(name).value == name
    pools = {"kv": LogicalHost(page=16), name: V4RowsHost("page_first", 4)}
    b = create_backend({"ferry_store": "v4", f"ferry_l1_{name}": "1M"}, pools, mla=True)
    assert set(b._pools) == {"kv", name}
    b.close()


def test_v4_pools_at_tp_above_one_are_refused_naming_their_own_server_setting():
    """DeepSeek V4 is an MLA model: SGLang backs its side pools up from TP
    rank 0 only (sgl-project/sglang 00343773d3293d382f0b39101f36b656d30ad2f0,
    hybrid_cache_controller.py should_backup: False but for mamba and
    Mooncake's MHA drafts), so an in-process store of another rank would
    never hold a page. The refusal names the setting that gives this pool
    a shared daemon, "ferry_server_<pool>" ("ferry_server" is the kv
    pool's alone); the logical anchor needs no store at all."""
    pools = {"kv": LogicalHost(page=16), C4.value: V4RowsHost("page_first", 4)}
    with pytest.raises(ValueError, match='"ferry_server_deepseek_v4_c4"'):
        v4_backend(pools, tp=(1, 2))


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_a_v4_prefix_backed_up_as_sglang_does_hits_and_loads_its_rows(layout):
    """SGLang's own V4 storage calls, in its order (sgl-project/sglang
    00343773d3293d382f0b39101f36b656d30ad2f0, python/sglang/srt/mem_cache/
    hybrid_cache/hybrid_cache_controller.py and managers/cache_controller.py
    as the index holds them). The stack builder (build_deepseek_v4_hicache_
    stack) makes the C4 KV and indexer pools with slot_page_size = the tree
    page size and the anchor's num_host_pages, so the anchor's host indices
    are whole pages of them, anchor page k their row k; the states ride the
    SWA pool's indices, swa_page_size a page each.
    Backup (_page_backup): the KV-derived pools get the anchor's host
    indices and every hash (_resolve_sidecar_kv_derived_pool_transfers),
    the states the SWA pool's (_resolve_sidecar_nonkv_derived_pool_
    transfers), all in one batch_set_v2; then batch_set_v1 for the anchor.
    Prefetch: batch_exists_v2; per batch batch_get_v1 on the anchor, then
    batch_get_v2 of the KV-derived pools on that batch's anchor host
    indices and hashes (_page_transfer_kv_batch); then the trailing
    pools, keys realigned to the hit (_sync_trailing_keys), the states on
    the SWA pool's indices. Mooncake (00fe477f32b3, mooncake_store.py
    _batch_io_v2) maps each to one object per key at row indices[::page]
    // page (get_page_buffer_meta). The prefix hits whole, and each pool's
    rows land bitwise where the prefetch's indices name, no other row
    touched."""
    P, S = 8, 4                     # tree page, swa_page_size (P % S == 0)
    anchor = LogicalHost(pages=16, page=P, layout=layout)
    c4 = V4RowsHost(layout, P, pages=16)
    c4i = V4RowsHost(layout, P, pages=16, item_bytes=40)
    swa = V4RowsHost(layout, S, pages=8, item_bytes=64)
    c4s = V4RowsHost(layout, S, pages=8, item_bytes=24, state=True)
    pools = (c4, c4i, swa, c4s)
    for i, p in enumerate(pools):
        p.fill(10 * i + 1)
    b = v4_backend({"kv": anchor, C4.value: c4, C4I.value: c4i, SWA.value: swa,
                    C4S.value: c4s})
    h = page_hashes(list(range(6 * P)), P)
    # backup of 5 pages: anchor host pages 2..6, the SWA window in SWA row 3
    kv_hi, swa_hi = indices(2, 5, P), indices(3, 1, S)
    want = {id(c4): [c4.row(i * P).clone() for i in range(2, 7)],
            id(c4i): [c4i.row(i * P).clone() for i in range(2, 7)],
            id(swa): [swa.row(3 * S).clone()], id(c4s): [c4s.row(3 * S).clone()]}
    backup = [PT(name=C4, host_indices=kv_hi, keys=h[:5], indices_from_pool=PN.KV),
              PT(name=C4I, host_indices=kv_hi, keys=h[:5], indices_from_pool=PN.KV),
              PT(name=SWA, host_indices=swa_hi, keys=h[4:5], hit_policy=HP.TRAILING_PAGES),
              PT(name=C4S, host_indices=swa_hi, keys=h[4:5],
                 hit_policy=HP.TRAILING_PAGES, indices_from_pool=SWA)]
    assert b.batch_set_v2(backup) == {C4: [True] * 5, C4I: [True] * 5, SWA: [True],
                                      C4S: [True]}
    assert b.batch_set_v1(h[:5], kv_hi) == [True] * 5
    # a later request of 6 pages: 5 stored
    asked = [PT(name=C4, indices_from_pool=PN.KV), PT(name=C4I, indices_from_pool=PN.KV),
             PT(name=SWA, keys=h[5:6], hit_policy=HP.TRAILING_PAGES),
             PT(name=C4S, keys=h[5:6], hit_policy=HP.TRAILING_PAGES, indices_from_pool=SWA)]
    r = b.batch_exists_v2(h, asked)
    assert r.kv_hit_pages == 5
    assert restorable(r) in (None, [5])
    before = {id(p): [p.row(i * p.page_size).clone() for i in range(p.num_host_pages)]
              for p in pools}
    kv_new, swa_new = indices(9, 5, P), indices(6, 1, S)
    assert b.batch_get_v1(h[:5], kv_new) == [True] * 5
    got = b.batch_get_v2([PT(name=C4, host_indices=kv_new, keys=h[:5]),
                          PT(name=C4I, host_indices=kv_new, keys=h[:5])])
    assert got == {C4: [True] * 5, C4I: [True] * 5}
    trailing = h[4:5]               # _sync_trailing_keys at 5 pages hit
    got = b.batch_get_v2([PT(name=SWA, host_indices=swa_new, keys=trailing,
                             hit_policy=HP.TRAILING_PAGES),
                          PT(name=C4S, host_indices=swa_new, keys=trailing,
                             hit_policy=HP.TRAILING_PAGES, indices_from_pool=SWA)])
    assert got == {SWA: [True], C4S: [True]}
    for p, rows in ((c4, range(9, 14)), (c4i, range(9, 14)), (swa, [6]), (c4s, [6])):
        loaded = dict(zip(rows, want[id(p)]))
        for i in range(p.num_host_pages):
            expect = loaded.get(i, before[id(p)][i])
            assert torch.equal(p.row(i * p.page_size), expect), (p.page_size, i)
    b.close()
