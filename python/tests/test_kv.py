"""KVStore: round trips in every buffer form, errors as exceptions, async, metrics."""
import asyncio
import os

import numpy as np
import pytest
import torch

import ferry
from ferry import FerryError

CHUNK = 16


def small_layout(dtype="f32"):
    return ferry.Layout(num_layers=3, num_heads=2, head_dim=8, dtype=dtype)


def store_for(layout, **kw):
    kw.setdefault("l1", 64 * CHUNK * layout.token_bytes)
    return ferry.KVStore("test-model", layout, chunk_tokens=CHUNK, **kw)


def paged_caches(layout, num_blocks, block_size, seed, torch_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, num_blocks, block_size, layout.num_heads, layout.head_dim,
                        generator=g).to(torch_dtype)
            for _ in range(layout.num_layers)]


def gather(caches, table, n, block_size):
    """[layers][kv][n tokens][heads][head_dim] of a sequence in paged caches."""
    rows = []
    for c in caches:
        idx = torch.tensor([table[t // block_size] for t in range(n)])
        off = torch.tensor([t % block_size for t in range(n)])
        rows.append(c[:, idx, off])
    return torch.stack(rows)


def test_contiguous_numpy_round_trip():
    lay = small_layout()
    tokens = np.arange(100, 164, dtype=np.int64)
    src = np.random.default_rng(1).standard_normal((2, 3, 64, 16)).astype(np.float32)
    with store_for(lay) as s:
        assert s.lookup(tokens) == 0
        assert s.store(tokens, src) == 64
        assert s.lookup(tokens) == 64
        assert s.lookup(tokens[:40]) == 32  # whole chunks only
        dst = np.zeros_like(src)
        assert s.retrieve(tokens, dst) == 64
        assert np.array_equal(dst, src)


def test_paged_vllm_round_trip_into_other_blocks():
    lay = small_layout()
    bs, nb = 4, 40
    src = paged_caches(lay, nb, bs, 7)
    table = torch.tensor([5, 9, 1, 30, 2, 3, 17, 11, 12, 13, 14, 15], dtype=torch.int32)
    tokens = torch.arange(1000, 1048)
    with store_for(lay) as s:
        assert ferry.Layout.from_kv_caches(src) == lay
        assert s.store(tokens, src, table) == 48
        dst = [torch.zeros_like(c) for c in src]
        table2 = torch.tensor(list(range(20, 32)), dtype=torch.int32)
        assert s.retrieve(tokens, dst, table2) == 48
        assert torch.equal(gather(src, table.tolist(), 48, bs), gather(dst, table2.tolist(), 48, bs))
        # blocks the table does not name are untouched
        untouched = [b for b in range(nb) if b not in table2.tolist()]
        for c in dst:
            assert torch.count_nonzero(c[:, untouched]) == 0


def test_mla_latent_paged():
    lay = ferry.Layout.from_model(num_layers=2, num_kv_heads=1, head_dim=32, dtype="bf16", mla=True)
    caches = [torch.randn(10, 8, 32).to(torch.bfloat16) for _ in range(2)]
    assert ferry.Layout.from_kv_caches(caches) == lay
    tokens = list(range(32))
    with store_for(lay) as s:
        assert s.store(tokens, caches, [0, 1, 2, 3]) == 32
        dst = [torch.zeros_like(c) for c in caches]
        assert s.retrieve(tokens, dst, [9, 8, 7, 6]) == 32
        for a, b in zip(caches, dst):
            assert torch.equal(a[0:4], b[[9, 8, 7, 6]])


def test_salt_isolates_tenants():
    lay = small_layout()
    src = np.ones((2, 3, 32, 16), np.float32)
    with store_for(lay) as s:
        s.store(range(32), src, salt=b"tenant-a")
        assert s.lookup(range(32), salt=b"tenant-a") == 32
        assert s.lookup(range(32), salt=b"tenant-b") == 0
        assert s.lookup(range(32)) == 0


def test_partial_chunk_only_when_asked():
    lay = small_layout()
    src = np.random.default_rng(2).standard_normal((2, 3, 40, 16)).astype(np.float32)
    with store_for(lay) as s:
        assert s.store(range(40), src) == 32
        assert s.store(range(40), src, partial=True) == 40
        assert s.lookup(range(40)) == 32
        assert s.lookup(range(40), partial=True) == 40
        dst = np.zeros_like(src)
        n, status = s.retrieve(range(40), dst, partial=True, statuses=True)
        assert n == 40 and status == [0, 0, 0]
        assert np.array_equal(dst, src)


def test_lookup_tiers_and_statuses():
    lay = small_layout()
    src = np.zeros((2, 3, 64, 16), np.float32)
    with store_for(lay) as s:
        s.store(range(32), src[:, :, :32].copy())
        hit, tiers = s.lookup_tiers(range(64))
        assert hit == 32 and tiers == ["l1", "l1", "none"]
        dst = np.zeros_like(src)
        n, status = s.retrieve(range(64), dst, statuses=True)
        assert n == 32
        assert status == [0, 0, ferry.errors.ENOTFOUND, ferry.errors.ENOTFOUND]


def test_errors_carry_code_name_and_message():
    lay = small_layout()
    with pytest.raises(FerryError) as e:
        ferry.KVStore("m", lay, l1=10)
    assert e.value.code == -22 and e.value.name == "EINVAL"
    assert "l1_bytes" in e.value.message
    with store_for(lay) as s:
        small = np.zeros((2, 3, 16, 16), np.float32)
        with pytest.raises(FerryError) as e:
            s.store(range(32), small)  # buffer holds 16 tokens, 32 asked
        assert e.value.name == "ENOBUFS"
        with pytest.raises(ValueError):
            s.store(range(16), np.zeros((2, 3, 16, 16), np.float16))
        with pytest.raises(ValueError):
            s.store(range(16), np.zeros((2, 3, 16, 16), np.float32).transpose(1, 0, 2, 3))
        with pytest.raises(ValueError):
            s.store([], small)
        ro = np.zeros((2, 3, 16, 16), np.float32)
        ro.flags.writeable = False
        with pytest.raises(ValueError):
            s.retrieve(range(16), ro)
    with pytest.raises(FerryError) as e:
        s.lookup(range(16))  # closed
    assert e.value.name == "EBADF"


def test_block_table_out_of_range_is_refused():
    lay = small_layout()
    src = paged_caches(lay, 8, 4, 3)
    with store_for(lay) as s:
        with pytest.raises(FerryError) as e:
            s.store(range(16), src, [0, 1, 2, 8])
        assert e.value.code < 0
        assert s.lookup(range(16)) == 0


def test_async_ops_wait_done_and_await():
    lay = small_layout()
    src = np.random.default_rng(3).standard_normal((2, 3, 64, 16)).astype(np.float32)
    with store_for(lay) as s:
        op = s.store_async(np.arange(64), src)
        assert op.wait(timeout=30) == 64
        dst = np.zeros_like(src)
        op = s.retrieve_async(np.arange(64), dst)
        while not op.done():
            pass
        assert op.wait() == 64 and np.array_equal(dst, src)

        async def main():
            dst2 = np.zeros_like(src)
            n = await s.retrieve_async(np.arange(64), dst2)
            return n, dst2
        n, dst2 = asyncio.run(main())
        assert n == 64 and np.array_equal(dst2, src)


def test_persistent_l2_survives_reopen(l2dir):
    lay = small_layout()
    src = np.random.default_rng(4).standard_normal((2, 3, 64, 16)).astype(np.float32)
    l1 = 8 * CHUNK * lay.token_bytes
    with store_for(lay, l1=l1, l2=f"{l2dir}:16M", persistent=True, l2_direct=False) as s:
        assert s.store(range(64), src) == 64
        assert s.sync() == 4
    with store_for(lay, l1=l1, l2=f"{l2dir}:16M", persistent=True, l2_direct=False) as s:
        hit, tiers = s.lookup_tiers(range(64))
        assert hit == 64 and tiers[0] == "l2"
        dst = np.zeros_like(src)
        assert s.retrieve(range(64), dst) == 64
        assert np.array_equal(dst, src)
        # a second opener of the same directory is refused
        with pytest.raises(FerryError) as e:
            store_for(lay, l1=l1, l2=f"{l2dir}:16M", persistent=True, l2_direct=False)
        assert e.value.name == "FERRY_EBUSY"


def test_persistent_l2_over_two_directories(tmp_path):
    lay = small_layout()
    src = np.random.default_rng(5).standard_normal((2, 3, 64, 16)).astype(np.float32)
    l1 = 8 * CHUNK * lay.token_bytes
    a, b = str(tmp_path / "nvme0"), str(tmp_path / "nvme1")
    l2 = [f"{a}:8M", f"{b}:8M"]
    with store_for(lay, l1=l1, l2=l2, persistent=True, l2_direct=False) as s:
        slot = -(-s.chunk_bytes // 4096) * 4096  # chunks of 4 KiB-aligned slots
        assert s.stats()["tier"]["l2"]["capacity_bytes"] == (16 << 20) // slot * s.chunk_bytes
        assert s.store(range(64), src) == 64
        assert s.sync() == 4
    with store_for(lay, l1=l1, l2=l2, persistent=True, l2_direct=False) as s:
        hit, tiers = s.lookup_tiers(range(64))
        assert hit == 64 and tiers[0] == "l2"
        dst = np.zeros_like(src)
        assert s.retrieve(range(64), dst) == 64
        assert np.array_equal(dst, src)
    # another order is refused, nothing changed; sizes must agree
    with pytest.raises(FerryError) as e:
        store_for(lay, l1=l1, l2=l2[::-1], persistent=True, l2_direct=False)
    assert e.value.name == "FERRY_EMISMATCH"
    with pytest.raises(ValueError):
        store_for(lay, l1=l1, l2=[f"{a}:8M", f"{b}:4M"], persistent=True)


def test_stats_prometheus_and_collector():
    from prometheus_client import CollectorRegistry, generate_latest
    from ferry.prometheus import KVCollector
    lay = small_layout()
    src = np.zeros((2, 3, 32, 16), np.float32)
    with store_for(lay) as s:
        s.store(range(32), src)
        s.lookup(range(32))
        st = s.stats()
        assert st["stores"] == 1 and st["stored_chunks"] == 2 and st["hit_tokens"] == 32
        assert st["tier"]["l1"]["chunks"] == 2
        assert ferry.quantile(st["lookup_ns"], 0.5) > 0
        assert "ferry_kv" in s.prometheus()
        reg = CollectorRegistry()
        reg.register(KVCollector(s))
        text = generate_latest(reg).decode()
        assert 'ferry_kv_tier_chunks{tier="l1"} 2.0' in text
        assert "ferry_kv_lookup_seconds_bucket" in text


def test_hash_chunks_match_lookup_keys():
    hs = ferry.hash_chunks(list(range(512)))
    assert len(hs) == 2 and all(len(h) == 16 for h in hs)
    assert ferry.hash_chunks(list(range(256)))[0] == hs[0]
    assert ferry.hash_chunks(list(range(1, 257)))[0] != hs[0]


def test_parse_size():
    assert ferry.parse_size("8G") == 8 << 30
    assert ferry.parse_size(4096) == 4096
    with pytest.raises(FerryError):
        ferry.parse_size("eight")


def test_async_op_holds_its_buffers_until_it_completes():
    import gc
    lay = small_layout()
    want = np.random.default_rng(5).standard_normal((2, 3, 64, 16)).astype(np.float32)
    with store_for(lay) as s:
        src = torch.from_numpy(want.copy())
        table_free_op = s.store_async(torch.arange(64), src)
        del src  # the caller drops its reference at once: the op keeps the tensor alive
        gc.collect()
        assert table_free_op.wait() == 64
        dst = torch.zeros(2, 3, 64, 16)
        out = dst
        op = s.retrieve_async(torch.arange(64), dst)
        del dst
        gc.collect()
        assert op.wait() == 64
        assert np.array_equal(out.numpy(), want)


def test_device_and_shape_mistakes_are_clear_errors():
    lay = small_layout()
    with store_for(lay) as s:
        meta = torch.empty(2, 3, 16, 16, device="meta")
        with pytest.raises(ValueError, match="device"):
            s.store(range(16), meta)
        with pytest.raises(ValueError, match="contiguous KV tensor"):
            s.store(range(16), np.zeros((2, 4, 16, 16), np.float32))  # 4 layers, not 3
        with pytest.raises(TypeError):
            s.store(range(16), [[1.0]])
        caches = paged_caches(lay, 8, 4, 1)
        with pytest.raises(ValueError, match="layer caches"):
            s.store(range(16), caches[:2], [0, 1, 2, 3])
        bad = [c.transpose(1, 2) for c in caches]  # blocks now overlap each other
        with pytest.raises(FerryError, match="block stride .* is below one block"):
            s.store(range(16), bad, [0, 1, 2, 3])
        with pytest.raises(ValueError, match="one-dimensional"):
            s.store(range(16), caches, [[0, 1, 2, 3]])
        with pytest.raises(FerryError) as e:
            s.store(range(16), caches, [0, 1, -1, 3])
        assert e.value.code < 0
        with pytest.raises(FerryError):
            s.store(range(16), caches, [0, 1])  # table too short for 16 tokens
        assert s.lookup(range(16)) == 0  # nothing half-stored


def test_cancel_stops_an_op_and_leaves_untouched_chunks_alone():
    lay = small_layout()
    src = np.random.default_rng(6).standard_normal((2, 3, 64 * CHUNK, 16)).astype(np.float32)
    with store_for(lay, l1=128 * CHUNK * lay.token_bytes, workers=1) as s:
        toks = np.arange(64 * CHUNK)
        assert s.store(toks, src) == 64 * CHUNK
        stopped = 0
        sink = np.zeros_like(src)
        for i in range(40):  # (until a cancel won its race a few times: a loaded host is slow)
            if i >= 5 and stopped >= 2:
                break
            dst = np.full_like(src, 7.0)
            # ahead of ours on the one worker: a queue of them, so ours is
            # still queued when the cancel comes, however slow this thread is
            blockers = [s.retrieve_async(toks, sink) for _ in range(8)]
            op = s.retrieve_async(toks, dst)
            if op.cancel():
                stopped += 1
                with pytest.raises(FerryError) as e:
                    op.wait()
                assert e.value.name == "ECANCELED"
                for c in range(64):  # each chunk is either exactly its bytes or untouched
                    got = dst[:, :, c * CHUNK:(c + 1) * CHUNK]
                    assert np.array_equal(got, src[:, :, c * CHUNK:(c + 1) * CHUNK]) or \
                        np.all(got == 7.0)
            else:
                assert op.wait() == 64 * CHUNK and np.array_equal(dst, src)
            for b in blockers:
                assert b.wait() == 64 * CHUNK
        assert stopped > 0
        done = s.retrieve_async(toks[:CHUNK], np.zeros_like(src))
        done.wait()
        assert done.cancel() is False
