"""SGLang's dummy MLA host pool against a shared `ferry serve` daemon.

Under MLA host-memory dedup SGLang gives every attention-TP rank but 0 of
an MLA model an allocator-only host pool (MLATokenToKVPoolHost with
is_dummy=True: page slots, kv_buffer None), rank 0 keeping the one host
copy and broadcasting what it loads to the other ranks' GPUs
(sgl-project/sglang 01c0ede38cc9645488fd2847dbea8a2f6a9241d8,
python/sglang/srt/mem_cache/pool_host/mla.py: _init_dummy; its loads and
backups assert "on a dummy (non-src MLA) host pool").

What SGLang then calls on the storage backend, at that commit
(python/sglang/srt/managers/cache_controller.py, HiCacheController):
attach_storage_backend builds the backend on every rank
(StorageBackendFactory.create_backend) and calls
register_mem_pool_host(self.storage_host_pool) with whatever host pool the
rank has, the dummy included; backup_skip (is_mla_model and tp_rank != 0)
keeps every rank but 0 from backing up; prefetch_thread_func has every
rank call batch_exists and all-reduce the least hit; _page_transfer has
every rank read the hit pages (batch_get_v1 with "interface_v1", else
batch_get and set_from_flat_data_page into its host pool) and
_reduce_prefetch_ack all-reduces the least count of pages read.

So a dummy rank registers against the daemon rank 0 uses, moves no byte,
and answers what rank 0 finds: never a page of its own, and never fewer
hits than rank 0 gets (the least of the ranks' counts would lose them)."""
import logging

import pytest
import torch

from ferry.adapters import _sglang_base as base
from ferry.errors import FerryError
from sglang_pools import DummyIndexerHost, DummyMLAHost, IndexerHost, MLAHost, \
    STORAGE_BATCH_SIZE, create_backend, fill, indices, page_hashes
from test_adapter_sglang import LayoutDaemon

PAGE, LAYERS, DIM = 4, 2, 64


def _daemon(tmp_path):
    return LayoutDaemon(str(tmp_path), dict(L=LAYERS, kv=1, H=1, D=DIM, dtype=torch.bfloat16),
                        PAGE)


def _ranks(url, layout, tp_size=2, v1=True):
    """HiCacheController.attach_storage_backend on every rank: rank 0's full
    MLA pool, a dummy on each other rank, each registered as it is."""
    out = []
    for r in range(tp_size):
        # each rank its own client of the daemon, as each is its own process
        extra = {"ferry_server": url, "ferry_store": f"dummy-test-r{r}"}
        if v1:
            extra["interface_v1"] = 1
        host = MLAHost(layout, PAGE, LAYERS, DIM) if r == 0 else DummyMLAHost(
            layout, PAGE, LAYERS, DIM)
        out.append((create_backend(extra, {"kv": host}, mla=True, tp=(r, tp_size)), host))
    return out


def _close(ranks):
    for b, *_ in ranks:
        b.close()


def _backup(ranks, hashes, host_idx):
    """_page_backup on every rank; backup_skip on all but TP rank 0."""
    for r, (b, _) in enumerate(ranks):
        if r == 0:
            assert all(b.batch_set_v1(hashes, host_idx, base.HiCacheStorageExtraInfo()))


def _prefetch(ranks, hashes, host_idx, v1=True):
    """prefetch_thread_func's batch_exists (least over the ranks), then
    _page_transfer's reads on every rank (least count over the ranks).
    Returns (hit pages, pages read, each rank's read answers)."""
    hits = min(b.batch_exists(hashes, base.HiCacheStorageExtraInfo()) for b, _ in ranks)
    got, answers = [], []
    for b, host in ranks:
        want = hashes[:hits]
        idx = host_idx[:hits * PAGE]
        if v1:                                  # _page_get_zero_copy
            res = b.batch_get_v1(want, idx, base.HiCacheStorageExtraInfo())
            n = res.index(False) if False in res else len(res)
        else:                                   # _generic_page_get
            res = b.batch_get(want, [host.get_dummy_flat_data_page() for _ in want])
            n = 0
            for i, page in enumerate(res):
                if page is None:
                    break
                host.set_from_flat_data_page(idx[i * PAGE], page)
                n += 1
        got.append(n)
        answers.append(res)
    return hits, min(got), answers


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_a_dummy_rank_registers_against_the_daemon_and_answers_rank0s_hits(tmp_path, layout):
    """Registered as SGLang registers it (before the fix: refused, its flat
    pages read as a u8 layout the daemon does not serve), the dummy rank
    answers batch_exists and batch_get_v1 as rank 0 does, rank 0's pages
    come back bitwise, and the dummy pool is never written."""
    d = _daemon(tmp_path)
    ranks = []
    try:
        ranks = _ranks(d.url, layout)
        (b0, full), (b1, dummy) = ranks
        fill(full.kv_buffer, 3)
        h = page_hashes(list(range(5 * PAGE)), PAGE)
        _backup(ranks, h[:3], indices(0, 3, PAGE))
        want = [full.get_data_page(int(i)).clone() for i in indices(0, 3, PAGE)[::PAGE]]
        full.kv_buffer.zero_()
        hits, got, answers = _prefetch(ranks, h, indices(8, 5, PAGE))
        assert (hits, got) == (3, 3)
        assert answers[0] == answers[1] == [True] * 3
        for i, w in enumerate(want):
            assert torch.equal(full.get_data_page(int((8 + i) * PAGE)), w)
        assert dummy.kv_buffer is None
        # pages no rank stored: a miss on every rank, never a hit of the dummy's
        assert b1.batch_exists(h[3:]) == b0.batch_exists(h[3:]) == 0
        assert b1.batch_get_v1(h[3:], indices(0, 2, PAGE)) == [False, False]
        assert b1.exists(h[0]) and not b1.exists(h[4])
        # v2 on the kv pool: the same answers as v1
        t = base.PoolTransfer(name=base.PoolName.KV, host_indices=indices(0, 4, PAGE),
                              keys=h[:4])
        assert b1.batch_get_v2([t]) == {base.PoolName.KV: [True, True, True, False]}
        assert b1.batch_exists_v2(h).kv_hit_pages == b0.batch_exists_v2(h).kv_hit_pages == 3
        # a dummy rank never writes: backup_skip keeps SGLang from asking, and
        # were it asked, nothing is stored under rank 0's keys from it
        assert b1.batch_set_v1(h[3:4], indices(0, 1, PAGE)) == [True]
        assert b0.batch_exists(h[3:4]) == 0
        assert b1.ferry_stats()["kv"]["pages"]["got"] == 6
    finally:
        _close(ranks)
        d.stop()


def test_a_dummy_rank_without_interface_v1_reads_misses_never_a_page(tmp_path, caplog):
    """SGLang's generic read (_generic_page_get) writes each page it gets
    into the rank's host pool with set_from_flat_data_page, which on a
    dummy pool indexes its None kv_buffer (a TypeError that ends the
    prefetch thread, and the ranks then wait for it in the all-reduce).
    So the dummy rank's flat reads are misses (the least count: none
    read, no byte wrong), warned once to give "interface_v1"."""
    d = _daemon(tmp_path)
    ranks = []
    try:
        ranks = _ranks(d.url, "page_first", v1=False)
        (b0, full), (b1, dummy) = ranks
        fill(full.kv_buffer, 5)
        h = page_hashes(list(range(2 * PAGE)), PAGE)
        for i, k in enumerate(h):
            assert b0.set(k, full.get_data_page(i * PAGE))
        with caplog.at_level(logging.WARNING, logger="ferry.sglang"):
            hits, got, answers = _prefetch(ranks, h, indices(4, 2, PAGE), v1=False)
            b1.get(h[0])
        assert (hits, got) == (2, 0)
        assert all(p is not None for p in answers[0]) and answers[1] == [None, None]
        assert dummy.kv_buffer is None
        assert sum("interface_v1" in r.getMessage() for r in caplog.records) == 1
        assert b1.set(h[0], None)      # nothing stored: rank 0 writes the page
    finally:
        _close(ranks)
        d.stop()


def test_a_dummy_ranks_done_is_bounded_by_what_rank0_then_reads(tmp_path):
    """The dummy rank answers what the store holds when it reads, and rank 0
    reads after it: the pages may be gone by then (evicted, or the daemon
    emptied). SGLang uses no rank's count alone: _reduce_prefetch_ack
    (01c0ede38cc9645488fd2847dbea8a2f6a9241d8, managers/cache_controller.py)
    and HiRadixCache.check_prefetch_progress all-reduce the least count
    over the TP group before any page is inserted, so rank 0's miss bounds
    the dummy's done and no rank takes a page rank 0 did not load. And a
    dummy that reads after the loss answers a miss, not the earlier hit."""
    d = _daemon(tmp_path)
    ranks = []
    try:
        ranks = _ranks(d.url, "page_first")
        (b0, full), (b1, _) = ranks
        fill(full.kv_buffer, 4)
        h = page_hashes(list(range(3 * PAGE)), PAGE)
        _backup(ranks, h, indices(0, 3, PAGE))
        hits = min(b.batch_exists(h) for b, _ in ranks)
        assert hits == 3
        dummy_first = b1.batch_get_v1(h, indices(8, 3, PAGE))
        b0.clear()                  # rank 0's store loses the pages in between
        rank0 = b0.batch_get_v1(h, indices(8, 3, PAGE))
        assert dummy_first == [True] * 3 and rank0 == [False] * 3
        count = [r.index(False) if False in r else len(r) for r in (dummy_first, rank0)]
        assert min(count) == 0      # what SGLang takes: nothing loaded, nothing used
        assert b1.batch_get_v1(h, indices(8, 3, PAGE)) == [False] * 3
    finally:
        _close(ranks)
        d.stop()


@pytest.mark.parametrize("mla,tp", [(True, (0, 2)), (False, (1, 2))])
def test_a_dummy_pool_where_no_rank_writes_its_pages_is_refused(mla, tp):
    """A dummy pool holds pages only another rank writes: TP rank 0 of an
    MLA model. On rank 0 itself, or in a model whose pages are each rank's
    own, its pages would never be stored: refused when it registers,
    before any store opens."""
    with pytest.raises(ValueError, match="dummy MLA pool"):
        create_backend({"ferry_server": "unix:/nonexistent/ferry.sock", "interface_v1": 1},
                       {"kv": DummyMLAHost("page_first", PAGE, LAYERS, DIM)}, mla=mla, tp=tp)


def test_a_dummy_pool_of_another_layout_than_rank0s_is_refused(tmp_path):
    """The daemon serves rank 0's layout; a dummy pool whose fields name
    another (here a kv_cache_dim of 32 against 64) is refused by the
    daemon when it registers, rather than answering for pages it does not
    match."""
    d = _daemon(tmp_path)
    try:
        with pytest.raises(FerryError, match="layout, chunk size or seed differs"):
            create_backend({"ferry_server": d.url, "ferry_store": "dummy-test-r1",
                            "interface_v1": 1},
                           {"kv": DummyMLAHost("page_first", PAGE, LAYERS, 32)}, mla=True,
                           tp=(1, 2))
    finally:
        d.stop()


def test_a_dummy_dsa_rank_answers_rank0s_kv_and_indexer_pages(tmp_path):
    """A DSA model under the same dedup: rank 0 keeps the MLA latent and
    the index pages (DSAIndexerPoolHost), every other rank a dummy of each
    (sgl-project/sglang 03ba7b5b7dd249244bd5af01b236fd6449c66e8d,
    python/sglang/srt/mem_cache/pool_host/dsa.py: is_dummy leaves
    index_k_with_scale_buffer None). Registered as the hybrid controller
    registers them (register_mem_pool_host, then register_mem_host_pool_v2
    for the indexer), the dummy rank answers batch_exists_v2 and the reads
    of _page_transfer_kv_batch (01c0ede38cc9645488fd2847dbea8a2f6a9241d8,
    managers/cache_controller.py: batch_get_v1 for the kv pages, then
    batch_get_v2 for the KV-derived indexer with the kv host indices) as
    rank 0 does, and rank 0's index pages come back bitwise."""
    (tmp_path / "kv").mkdir()
    (tmp_path / "ix").mkdir()
    dk = _daemon(tmp_path / "kv")
    di = LayoutDaemon(str(tmp_path / "ix"), dict(L=LAYERS, kv=1, H=1, D=132, dtype=torch.uint8),
                      PAGE)
    ranks = []
    try:
        for r in range(2):
            kv = MLAHost("page_first", PAGE, LAYERS, DIM) if r == 0 else DummyMLAHost(
                "page_first", PAGE, LAYERS, DIM)
            ix = IndexerHost(kv) if r == 0 else DummyIndexerHost(kv)
            extra = {"ferry_server": dk.url, "ferry_server_indexer": di.url,
                     "ferry_store": f"dummy-dsa-r{r}", "interface_v1": 1}
            ranks.append((create_backend(extra, {"kv": kv, "indexer": ix}, mla=True,
                                         tp=(r, 2)), kv, ix))
        (b0, kv0, ix0), (b1, _, ix1) = ranks
        fill(kv0.kv_buffer, 1)
        fill(ix0.index_k_with_scale_buffer, 2)
        h = page_hashes(list(range(3 * PAGE)), PAGE)
        IX = base.PoolName.INDEXER
        assert all(b0.batch_set_v1(h[:2], indices(0, 2, PAGE)))
        assert b0.batch_set_v2([base.PoolTransfer(name=IX, host_indices=indices(0, 2, PAGE),
                                                  keys=h[:2])]) == {IX: [True, True]}
        want = [ix0.page(i * PAGE) for i in range(2)]
        ix0.index_k_with_scale_buffer.zero_()
        t = [base.PoolTransfer(name=IX, keys=h)]
        r0, r1 = b0.batch_exists_v2(h, t), b1.batch_exists_v2(h, t)
        assert (r0.kv_hit_pages, r0.extra_pool_hit_pages) == \
            (r1.kv_hit_pages, r1.extra_pool_hit_pages) == (2, {base.PoolName.KV: 2, IX: 2})
        for b, _, _ in ranks:
            assert b.batch_get_v1(h[:2], indices(4, 2, PAGE)) == [True, True]
            got = b.batch_get_v2([base.PoolTransfer(name=IX, host_indices=indices(4, 2, PAGE),
                                                    keys=h[:2])])
            assert got == {IX: [True, True]}
        for i, w in enumerate(want):
            assert torch.equal(ix0.page((4 + i) * PAGE), w)
        assert ix1.index_k_with_scale_buffer is None
    finally:
        _close(ranks)
        dk.stop()
        di.stop()


assert STORAGE_BATCH_SIZE >= 5     # each prefetch above is one batch
