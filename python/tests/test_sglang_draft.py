"""An MHA draft model's pool (EAGLE) beside an MLA target at TP 2, through
SGLang's own storage calls in its order (sgl-project/sglang
00343773d3293d382f0b39101f36b656d30ad2f0, the version the index holds:
python/sglang/srt/mem_cache/hybrid_cache/hybrid_cache_controller.py and
managers/cache_controller.py). The draft pool registers as a sidecar of
the kv pool (SidecarPoolSpec(DRAFT, indices_from_pool=KV, ALL_PAGES)).
Backup: backup_skip = is_mla_model and tp_rank != 0; _page_backup runs on
every rank and calls batch_set_v2 with the transfers should_backup keeps
(all of them on rank 0; on another rank mamba, and the MHA draft pools for
backend "mooncake" only: ferry is "dynamic"), then the kv pages
(batch_set_v1) unless backup_skip. Prefetch: batch_exists_v2 with the draft
transfer, the ranks' hits reduced to their least."""
import logging

import torch

import ferry
from ferry.adapters import _sglang_base as base, unregister_store
from sglang_pools import MHAHost, MLAHost, create_backend, fill, indices, page_hashes
from test_adapter_sglang import bits

PN, PT = base.PoolName, base.PoolTransfer


def should_backup(rank, transfer, backend_type="dynamic"):
    """HybridCacheController.should_backup for an MLA model (backup_skip on
    every TP rank but 0); the draft pool's host pool is MHA."""
    if rank == 0:
        return True
    if transfer.name == PN.MAMBA:
        return True
    return backend_type == "mooncake" and transfer.name in (PN.DRAFT, PN.DRAFT_SWA)


def backup(rank, b, h, hi):
    """HybridCacheController._page_backup on TP rank `rank`."""
    keep = [t for t in [PT(name=PN.DRAFT, host_indices=hi, keys=h,
                           indices_from_pool=PN.KV)] if should_backup(rank, t)]
    if keep:
        b.batch_set_v2(keep)
    if rank == 0:                                   # not backup_skip
        assert b.batch_set_v1(h, hi) == [True] * len(h)


def test_an_mha_draft_pool_beside_an_mla_target_at_tp_2(caplog):
    """Rank 0 writes the MLA kv pages (one key for all ranks) and its own
    draft heads; rank 1 writes nothing. So rank 1's draft pages are never
    stored: its exists is 0, SGLang's least over the ranks is 0, and rank 1
    never reads rank 0's heads (its buffer untouched). Before the fix this
    went unsaid: registering the pool now warns that no prefix will be
    restored from ferry at this TP."""
    s = ferry.KVStore("tiny", ferry.Layout(2, 1, 64, "bf16", kv=1), l1="8M", chunk_tokens=4)
    sd0 = ferry.KVStore("tiny", ferry.Layout(2, 2, 64, "bf16", kv=2), l1="8M", chunk_tokens=4)
    sd1 = ferry.KVStore("tiny", ferry.Layout(2, 2, 64, "bf16", kv=2), l1="8M", chunk_tokens=4)
    ranks = []
    try:
        with caplog.at_level(logging.WARNING, logger="ferry.sglang"):
            for r, sd in ((0, sd0), (1, sd1)):
                ferry.adapters.register_store(f"r{r}", s)
                ferry.adapters.register_store(f"r{r}.draft", sd)    # each rank's own process
                pools = {"kv": MLAHost("page_first", 4), "draft": MHAHost("page_first", 4)}
                fill(pools["kv"].kv_buffer, 7)              # MLA: the same on every rank
                fill(pools["draft"].kv_buffer, 20 + r)      # MHA: each rank's heads
                ranks.append((create_backend({"ferry_store": f"r{r}"}, pools, mla=True,
                                             tp=(r, 2)), pools))
        warned = [m for m in caplog.messages if "'draft'" in m and "mooncake" in m]
        assert len(warned) == 2                         # once per rank
        h = page_hashes(list(range(8)), 4)
        for r, (b, _) in enumerate(ranks):
            backup(r, b, h, indices(0, 2, 4))
        # rank 0 holds the kv pages and its draft heads; rank 1 only the kv
        # pages (shared key), never rank 0's draft heads under its own key
        asked = [PT(name=PN.DRAFT, indices_from_pool=PN.KV)]
        hits = [b.batch_exists_v2(h, asked) for b, _ in ranks]
        assert hits[0].kv_hit_pages == 2
        assert hits[0].extra_pool_hit_pages.get(PN.DRAFT) == 2
        assert ranks[1][0].batch_exists(h) == 2         # the MLA kv key is one for all
        assert hits[1].kv_hit_pages == 0
        assert hits[1].extra_pool_hit_pages.get(PN.DRAFT, 0) == 0
        assert min(x.kv_hit_pages for x in hits) == 0   # SGLang's all-reduce MIN
        # a read on rank 1 of its draft pages fills nothing, and never rank 0's
        b1, p1 = ranks[1]
        before = p1["draft"].kv_buffer.clone()
        got = b1.batch_get_v2([PT(name=PN.DRAFT, host_indices=indices(4, 2, 4), keys=h)])
        assert got == {PN.DRAFT: [False, False]}
        assert torch.equal(bits(p1["draft"].kv_buffer), bits(before))
        # rank 0 reads back its own heads bitwise
        b0, p0 = ranks[0]
        want = p0["draft"].kv_buffer[:, 0:8].clone()
        got = b0.batch_get_v2([PT(name=PN.DRAFT, host_indices=indices(4, 2, 4), keys=h)])
        assert got == {PN.DRAFT: [True, True]}
        assert torch.equal(bits(p0["draft"].kv_buffer[:, 16:24]), bits(want))
        # no two ranks wrote one key: rank 1's draft store holds nothing
        assert sd1.lookup_named([k.encode() for k in h],
                                salt=b1._salts("draft")[0]) == 0
    finally:
        for b, _ in ranks:
            b.close()
        for n in ("r0", "r0.draft", "r1", "r1.draft"):
            unregister_store(n)
        for x in (s, sd0, sd1):
            x.close()


def test_an_mla_draft_pool_at_tp_2_is_not_warned_of(caplog):
    """A draft pool of the target's kind (an MLA draft: MTP, NextN) is the
    same on every rank, one key for all, written by rank 0: nothing to warn of."""
    s = ferry.KVStore("tiny", ferry.Layout(2, 1, 64, "bf16", kv=1), l1="8M", chunk_tokens=4)
    ferry.adapters.register_store("m", s)
    ferry.adapters.register_store("m.draft", s)
    try:
        with caplog.at_level(logging.WARNING, logger="ferry.sglang"):
            pools = {"kv": MLAHost("page_first", 4), "draft": MLAHost("page_first", 4)}
            b = create_backend({"ferry_store": "m"}, pools, mla=True, tp=(0, 2))
        assert not [m for m in caplog.messages if "mooncake" in m]
        assert b._salts("draft") == [b._salts("draft")[0]] and "/tp" not in b._salts("draft")[0]
        b.close()
    finally:
        for n in ("m", "m.draft"):
            unregister_store(n)
        s.close()


def test_an_mha_draft_pool_is_warned_of_only_beside_an_mla_target_above_tp_1(caplog):
    """At TP 1 rank 0 backs every pool up, and beside an MHA target every
    rank backs its own pages up (backup_skip is for MLA models only): no
    prefix misses for the draft pool's sake, nothing to warn of."""
    for mla, tp in ((True, (0, 1)), (False, (0, 2)), (False, (1, 2))):
        kv = ferry.Layout(2, 1, 64, "bf16", kv=1) if mla else \
            ferry.Layout(2, 2, 64, "bf16", kv=2)
        s = ferry.KVStore("tiny", kv, l1="8M", chunk_tokens=4)
        sd = ferry.KVStore("tiny", ferry.Layout(2, 2, 64, "bf16", kv=2), l1="8M",
                           chunk_tokens=4)
        ferry.adapters.register_store("w", s)
        ferry.adapters.register_store("w.draft", sd)
        caplog.clear()
        try:
            with caplog.at_level(logging.WARNING, logger="ferry.sglang"):
                pools = {"kv": (MLAHost if mla else MHAHost)("page_first", 4),
                         "draft": MHAHost("page_first", 4)}
                b = create_backend({"ferry_store": "w"}, pools, mla=mla, tp=tp)
            assert not [m for m in caplog.messages if "mooncake" in m], (mla, tp)
            b.close()
        finally:
            for n in ("w", "w.draft"):
                unregister_store(n)
            s.close()
            sd.close()
