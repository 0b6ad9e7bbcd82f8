"""An engine team's first hour, second round: the two paths the first
(test_first_hour.py) did not probe, done adversarially.

SGLang's v2 storage API with several host pools (kv, the flat-byte mamba
pool, the DSA indexer; stand-ins in sglang_pools.py):
- batch set / exists / get over every pool from several threads at once
  (HiCache's storage I/O runs on background threads) while two threads
  close the backend: every page got is the page set, no crash, no hang,
  and a call racing the close answers FerryError (EBADF) (it answered
  ValueError "pool not registered (registered: none)");
- host indices outside a pool (FerryError EINVAL): a negative one was the
  from-the-end index, so a mamba page was stored from, and loaded into,
  the last slot;
- two transfers for one pool in one call: the first one's results were
  dropped from the answer; an empty transfer refused for its missing
  indices; one str given as the key list read as its characters;
- keys held by another pool are a miss, and nothing of the pool is written.

The layerwise paths (KVStore.store_layers / retrieve_layers, LayerOp, and
vLLM's save_kv_layer / wait_for_layer_load):
- layer_done / wait_layer from worker threads while the store closes;
- layers out of order, twice, past the last, of the wrong type;
- wait_layer after a cancel or after wait() (was EINVAL "freed"; now the
  op's own answer), layer_done after a cancel (-ECANCELED);
- a store_layers source: changed after layer_done (the layer holds the
  bytes of the call), dropped (kept alive), or given other memory (set_,
  resize_: layer_done read memory that was no longer the tensor's, freed
  for resize_, and committed it; now the store is cancelled, EFAULT);
- a LayerOp dropped by GC in flight.
"""
import errno
import gc
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ferry  # noqa: E402
from ferry import FerryError  # noqa: E402
from ferry.adapters import _sglang_base as base, unregister_store  # noqa: E402
from sglang_pools import IndexerHost, MambaHost, MHAHost, create_backend, fill, indices, \
    page_hashes  # noqa: E402

PN, HP = base.PoolName, base.PoolHitPolicy
TESTS = os.path.dirname(os.path.abspath(__file__))
PKG = os.path.dirname(TESTS)
ESTATE = -4100

PRELUDE = """
import errno, random, sys, threading, time
import numpy as np, torch
sys.path.insert(0, {pkg!r})
sys.path.insert(0, {tests!r})
import ferry
from ferry import FerryError
"""


def run_child(body, timeout=180):
    code = PRELUDE.format(pkg=PKG, tests=TESTS) + textwrap.dedent(body)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=timeout)
    assert p.returncode == 0, f"child exited {p.returncode}\n{p.stdout}\n{p.stderr}"
    return p.stdout


@pytest.fixture(autouse=True)
def _clean():
    yield
    for n in ("sgl", "sgl.mamba", "sgl.indexer"):
        s = unregister_store(n)
        if s is not None:
            s.close()


def hybrid(slots=4, pages=8):
    kv = MHAHost("page_first", page=4, pages=pages)
    pools = {"kv": kv, "mamba": MambaHost(slots=slots), "indexer": IndexerHost(kv)}
    b = create_backend({"ferry_store": "sgl", "ferry_l1": "16M"}, pools)
    fill(kv.kv_buffer, 1)
    pools["mamba"].fill(2)
    fill(pools["indexer"].index_k_with_scale_buffer, 3)
    return b, pools


def snapshot(pools):
    return [pools["kv"].kv_buffer.clone(), pools["indexer"].index_k_with_scale_buffer.clone()] + \
        [t.clone() for t in [pools["mamba"].temporal_buffer] + pools["mamba"].conv_buffer]


# -- SGLang v2, several pools --

def test_sglang_pools_from_threads_with_two_closers_no_wrong_page():
    out = run_child("""
        from ferry.adapters import _sglang_base as base, unregister_store
        from sglang_pools import MHAHost, MambaHost, IndexerHost, create_backend, indices, \\
            page_hashes
        PN, HP = base.PoolName, base.PoolHitPolicy
        T = 6
        res = {"ok": 0, "bad": [], "ebadf": 0, "other": []}
        for rnd in range(3):
            kv = MHAHost("page_first", page=4, pages=4 * T)
            mamba = MambaHost(slots=2 * T)
            idx = IndexerHost(kv)
            b = create_backend({"ferry_store": "sgl", "ferry_l1": "16M"},
                               {"kv": kv, "mamba": mamba, "indexer": idx})
            started = threading.Event()
            stop = time.time() + 1.5
            def worker(i):
                it = 0
                while time.time() < stop:
                    it += 1
                    # keys shared by the three pools, two pages, this thread's slots
                    h = page_hashes([rnd * 10**7 + i * 10**5 + it * 10 + j for j in range(8)], 4)
                    kvs, kvd = indices(4 * i, 2, 4), indices(4 * i + 2, 2, 4)
                    ms, md = 2 * i, 2 * i + 1
                    g = torch.Generator().manual_seed(rnd * 10**6 + i * 1000 + it)
                    for p in range(2):
                        page = kv.get_data_page(int(kvs[4 * p]), flat=False)
                        page.copy_(torch.randn(page.shape, generator=g).to(page.dtype))
                        ib = idx.index_k_with_scale_buffer[int(kvs[4 * p]) // 4]
                        ib.copy_(torch.randint(0, 256, ib.shape, generator=g, dtype=torch.uint8))
                    for t in mamba._iter_page_tensors(ms):
                        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
                    want_kv = [kv.get_data_page(int(kvs[4 * p])).clone() for p in range(2)]
                    want_i = [idx.page(int(kvs[4 * p])) for p in range(2)]
                    want_m = mamba.get_data_page(ms).clone()
                    try:
                        r = b.batch_set_v2([
                            base.PoolTransfer(name=PN.MAMBA, host_indices=torch.tensor([ms]),
                                              keys=h[-1:]),
                            base.PoolTransfer(name=PN.INDEXER, host_indices=kvs, keys=h)])
                        ok = b.batch_set_v1(h, kvs)
                        assert all(ok) and r == {PN.MAMBA: [True], PN.INDEXER: [True, True]}
                        started.set()
                        b.batch_exists_v2(h, [base.PoolTransfer(name=PN.MAMBA, keys=h[-1:],
                                                                hit_policy=HP.TRAILING_PAGES),
                                              base.PoolTransfer(name=PN.INDEXER)])
                        r = b.batch_get_v2([
                            base.PoolTransfer(name=PN.MAMBA, host_indices=torch.tensor([md]),
                                              keys=h[-1:]),
                            base.PoolTransfer(name=PN.INDEXER, host_indices=kvd, keys=h)])
                        ok = b.batch_get_v1(h, kvd)
                        for p in range(2):
                            if ok[p] and not torch.equal(kv.get_data_page(int(kvd[4 * p])),
                                                         want_kv[p]):
                                res["bad"].append(("kv", i, it, p))
                            if r[PN.INDEXER][p] and not torch.equal(idx.page(int(kvd[4 * p])),
                                                                    want_i[p]):
                                res["bad"].append(("indexer", i, it, p))
                        if r[PN.MAMBA][0] and not torch.equal(mamba.get_data_page(md), want_m):
                            res["bad"].append(("mamba", i, it))
                        res["ok"] += 1
                    except FerryError as e:
                        if e.code == -errno.EBADF:
                            res["ebadf"] += 1
                        else:
                            res["other"].append(repr(e))
                    except Exception as e:
                        res["other"].append(repr(e))
            def closer():
                started.wait(10)
                time.sleep(0.4)
                b.close()
            ts = [threading.Thread(target=worker, args=(i,)) for i in range(T)]
            ts += [threading.Thread(target=closer) for _ in range(2)]
            for t in ts:
                t.start()
            for t in ts:
                t.join(60)
            assert not any(t.is_alive() for t in ts), "a thread hangs"
            for n in ("sgl", "sgl.mamba", "sgl.indexer"):
                assert unregister_store(n) is None     # the close let its stores go
        print(res["ok"], len(res["bad"]), res["ebadf"], res["other"][:3], res["bad"][:3])
    """)
    ok, bad, ebadf, rest = out.split(maxsplit=3)
    assert int(ok) > 0 and int(bad) == 0, out
    assert int(ebadf) > 0, out
    assert rest.strip() == "[] []", out          # only EBADF after the close: no ValueError


def test_sglang_calls_racing_close_answer_ebadf_only():
    """Calls spinning on every pool while the backend closes: each answers,
    or raises FerryError (EBADF); none a ValueError of an emptied pool table."""
    out = run_child("""
        from ferry.adapters import _sglang_base as base
        from sglang_pools import MHAHost, MambaHost, IndexerHost, create_backend, indices
        PN, HP = base.PoolName, base.PoolHitPolicy
        other, ebadf = [], 0
        for rnd in range(20):
            kv = MHAHost("page_first", page=4, pages=8)
            b = create_backend({"ferry_store": "sgl", "ferry_l1": "4M"},
                               {"kv": kv, "mamba": MambaHost(slots=4), "indexer": IndexerHost(kv)})
            go = threading.Event()
            def spin(i):
                global ebadf
                go.wait()
                for it in range(400):
                    try:
                        if i % 2:
                            b.batch_exists_v2(["k"], [base.PoolTransfer(name=PN.INDEXER)])
                        else:
                            b.batch_get_v2([base.PoolTransfer(name=PN.MAMBA, keys=["k"],
                                                              host_indices=torch.tensor([1]))])
                    except FerryError as e:
                        if e.code != -errno.EBADF:
                            other.append(repr(e))
                        ebadf += 1
                    except Exception as e:
                        other.append(repr(e))
            ts = [threading.Thread(target=spin, args=(i,)) for i in range(4)]
            for t in ts:
                t.start()
            go.set()
            time.sleep(0.001 * (rnd % 5))
            b.close()
            for t in ts:
                t.join(60)
            assert not any(t.is_alive() for t in ts), "a thread hangs"
        print(ebadf, len(other), other[:2])
    """)
    ebadf, n, _ = out.split(maxsplit=2)
    assert int(ebadf) > 0 and int(n) == 0, out


@pytest.mark.parametrize("hi", [-1, -4, 4, 10**12, 2**63 - 1])
def test_sglang_host_index_outside_the_pool_is_refused_writes_nothing(hi):
    b, pools = hybrid(slots=4)
    before = snapshot(pools)
    h = page_hashes(list(range(8)), 4)
    # one page stored from slot 0, so a get has something to write
    assert b.batch_set_v2([base.PoolTransfer(name=PN.MAMBA, host_indices=torch.tensor([0]),
                                             keys=h[:1])]) == {PN.MAMBA: [True]}
    for call in (b.batch_set_v2, b.batch_get_v2):
        with pytest.raises(FerryError, match=r"'mamba': page 0's host indices .* outside the "
                           r"pool \(0 \.\. 4\)") as e:
            call([base.PoolTransfer(name=PN.MAMBA, host_indices=torch.tensor([hi]),
                                    keys=h[1:2] if call is b.batch_set_v2 else h[:1])])
        assert e.value.code == -errno.EINVAL
    assert b._pools["mamba"][1].lookup_named(h[1:2], salt=b._salts("mamba")[0]) == 0
    # the kv pool (8 pages of 4): a page start as far outside
    start = {-1: -4, -4: -16, 4: 32, 10**12: 4 * 10**12, 2**63 - 1: 2**62}[hi]
    kvi = torch.arange(start, start + 4)
    for call in (b.batch_set_v1, b.batch_get_v1):
        with pytest.raises(FerryError, match="outside the pool") as e:
            call(h[1:2], kvi)
        assert e.value.code == -errno.EINVAL
    assert all(torch.equal(a, c) for a, c in zip(before, snapshot(pools)))
    b.close()


def test_sglang_two_transfers_for_one_pool_are_refused_before_any_move():
    b, pools = hybrid()
    with pytest.raises(ValueError, match="'mamba' has two transfers in one call"):
        b.batch_set_v2([base.PoolTransfer(name=PN.MAMBA, host_indices=torch.tensor([0]),
                                          keys=["d1"]),
                        base.PoolTransfer(name=PN.MAMBA, host_indices=torch.tensor([1, 2]),
                                          keys=["d2", "d3"])])
    assert b._pools["mamba"][1].lookup_named(["d1"], salt=b._salts("mamba")[0]) == 0
    with pytest.raises(ValueError, match="'kv' has two transfers"):   # str and PoolName alike
        b.batch_get_v2([base.PoolTransfer(name=PN.KV, host_indices=indices(0, 1, 4), keys=["a"]),
                        base.PoolTransfer(name="kv", host_indices=indices(1, 1, 4), keys=["b"])])
    b.close()


def test_sglang_empty_transfer_moves_nothing_and_answers_empty():
    b, pools = hybrid()
    before = snapshot(pools)
    for call in (b.batch_set_v2, b.batch_get_v2):
        assert call([base.PoolTransfer(name=PN.MAMBA)]) == {PN.MAMBA: []}
        assert call([base.PoolTransfer(name=PN.INDEXER, keys=[],
                                       host_indices=torch.tensor([], dtype=torch.int64))]) \
            == {PN.INDEXER: []}
    assert all(torch.equal(a, c) for a, c in zip(before, snapshot(pools)))
    with pytest.raises(ValueError, match="no host indices for 1 pages"):
        b.batch_set_v2([base.PoolTransfer(name=PN.MAMBA, keys=["x"])])
    b.close()


def test_sglang_one_str_as_the_key_list_is_a_type_error():
    b, _ = hybrid()
    h = page_hashes(list(range(4)), 4)
    assert b.batch_set_v1(h, indices(0, 1, 4)) == [True]
    for keys in (h[0], h[0].encode()):
        with pytest.raises(TypeError, match="a list of str or bytes keys, got one"):
            b.batch_exists(keys)
    assert b.batch_exists(iter(h)) == 1          # any other iterable of keys is fine
    b.close()


def test_sglang_keys_none_or_not_a_sequence_is_a_type_error_naming_it():
    b, pools = hybrid()
    h = page_hashes(list(range(4)), 4)
    before = snapshot(pools)
    kvi = indices(0, 1, 4)
    for call in (b.batch_set_v1, b.batch_get_v1):
        for keys, what in ((None, "got None"), (h[0], "got one str"), (7, "got int")):
            with pytest.raises(TypeError, match=f"a list of str or bytes keys, {what}"):
                call(keys, kvi)
    for call in (b.batch_set_v2, b.batch_get_v2):
        with pytest.raises(TypeError, match="keys, got one str"):
            call([base.PoolTransfer(name=PN.KV, host_indices=kvi, keys=h[0])])
    assert all(torch.equal(a, c) for a, c in zip(before, snapshot(pools)))
    assert b.batch_set_v1(tuple(h[:1]), kvi) == [True]    # a tuple of keys is fine
    b.close()


def test_sglang_keys_of_another_pool_are_a_miss_and_write_nothing():
    b, pools = hybrid()
    h = page_hashes(list(range(8)), 4)
    assert b.batch_set_v2([base.PoolTransfer(name=PN.MAMBA, host_indices=torch.tensor([0]),
                                             keys=h[:2][-1:])]) == {PN.MAMBA: [True]}
    before = snapshot(pools)
    assert b.batch_exists(h) == 0
    assert b.batch_get_v1(h, indices(4, 2, 4)) == [False, False]
    assert b.get(h[0]) is None
    assert b.batch_get_v2([base.PoolTransfer(name=PN.INDEXER, host_indices=indices(4, 2, 4),
                                             keys=h)]) == {PN.INDEXER: [False, False]}
    r = b.batch_exists_v2(h, [base.PoolTransfer(name=PN.MAMBA, keys=h[-1:],
                                                hit_policy=HP.TRAILING_PAGES)])
    assert (r.kv_hit_pages, r.extra_pool_hit_pages) == (0, {})
    assert all(torch.equal(a, c) for a, c in zip(before, snapshot(pools)))
    # the same keys in every pool: each pool answers with its own page
    kvi = indices(0, 2, 4)
    assert b.batch_set_v1(h, kvi) == [True, True]
    assert b.batch_set_v2([base.PoolTransfer(name=PN.INDEXER, host_indices=kvi, keys=h)]) \
        == {PN.INDEXER: [True, True]}
    want_kv = [pools["kv"].get_data_page(s).clone() for s in (0, 4)]
    want_i = [pools["indexer"].page(s) for s in (0, 4)]
    want_m = pools["mamba"].get_data_page(0).clone()
    dst = indices(5, 2, 4)
    assert b.batch_get_v1(h, dst) == [True, True]
    assert b.batch_get_v2([base.PoolTransfer(name=PN.INDEXER, host_indices=dst, keys=h),
                           base.PoolTransfer(name=PN.MAMBA, host_indices=torch.tensor([3]),
                                             keys=h[-1:])]) \
        == {PN.INDEXER: [True, True], PN.MAMBA: [True]}
    for j, s in enumerate((20, 24)):
        assert torch.equal(pools["kv"].get_data_page(s), want_kv[j])
        assert torch.equal(pools["indexer"].page(s), want_i[j])
    assert torch.equal(pools["mamba"].get_data_page(3), want_m)
    b.close()


def test_sglang_calls_after_close_are_ebadf():
    b, _ = hybrid()
    b.close()
    b.close()
    h = page_hashes(list(range(4)), 4)
    for call in (lambda: b.batch_exists(h), lambda: b.batch_get_v1(h, indices(0, 1, 4)),
                 lambda: b.batch_set_v2([base.PoolTransfer(name=PN.MAMBA, keys=h,
                                                           host_indices=torch.tensor([0]))]),
                 lambda: b.batch_exists_v2(h, [base.PoolTransfer(name=PN.INDEXER)])):
        with pytest.raises(FerryError) as e:
            call()
        assert e.value.code == -errno.EBADF


# -- the layerwise paths --

LAY = ferry.Layout(num_layers=4, num_heads=2, head_dim=64, dtype="bf16")


def kvt(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 4, n, 128, generator=g).to(torch.bfloat16)


@pytest.fixture
def s():
    st = ferry.KVStore("first-hour-2", LAY, l1="16M", chunk_tokens=16)
    yield st
    st.close()


def test_layers_from_threads_while_the_store_closes():
    out = run_child("""
        LAY = ferry.Layout(num_layers=8, num_heads=2, head_dim=64, dtype="bf16")
        res = {"bad": 0, "loaded": 0, "codes": {}}
        for rnd in range(15):
            s = ferry.KVStore("p", LAY, l1="16M", chunk_tokens=16)
            x = torch.randn(2, 8, 64, 128).to(torch.bfloat16)
            s.store(np.arange(64), x)
            def worker(i):
                r = random.Random(rnd * 100 + i)
                for it in range(300):
                    try:
                        if r.random() < 0.5:
                            op = s.store_layers(np.arange(64) + 1000 * (i + 1), x)
                            for l in r.sample(range(8), 8):     # out of order
                                op.layer_done(l)
                            assert op.wait() == 64
                        else:
                            y = torch.zeros_like(x)
                            op = s.retrieve_layers(np.arange(64), y)
                            for l in r.sample(range(8), 8):
                                if op.wait_layer(l, timeout=30) != 64 or \\
                                        not torch.equal(y[:, l], x[:, l]):
                                    res["bad"] += 1
                                res["loaded"] += 1
                    except FerryError as e:
                        res["codes"][e.code] = res["codes"].get(e.code, 0) + 1
            ts = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
            for t in ts:
                t.start()
            time.sleep(random.random() * 0.05)
            s.close()
            for t in ts:
                t.join(60)
            assert not any(t.is_alive() for t in ts), "a thread hangs"
        print(res["bad"], res["loaded"], sorted(res["codes"]))
    """)
    bad, loaded, codes = out.split(maxsplit=2)
    assert int(bad) == 0 and int(loaded) > 0, out
    assert set(eval(codes)) <= {-errno.EBADF, -errno.ECANCELED}, out


def test_layer_done_out_of_order_twice_past_the_last(s):
    x = kvt()
    op = s.store_layers(np.arange(64), x)
    op.layer_done(2)
    op.layer_done(0)
    with pytest.raises(FerryError) as e:
        op.layer_done(0)
    assert e.value.code == ESTATE and "done already" in str(e.value)
    for bad in (4, -1, 2**32):
        with pytest.raises(FerryError, match=f"layer {bad} is outside 0 .. 3") as e:
            op.layer_done(bad)
        assert e.value.code == -errno.EINVAL
    for bad in (True, 1.0, "1", None):
        with pytest.raises(TypeError, match="a layer is an integer"):
            op.layer_done(bad)
    with pytest.raises(FerryError) as e:      # still lacking layers: an error, not a hang
        op.wait(timeout=5)
    assert e.value.code == ESTATE and "[1, 3]" in str(e.value)
    op.layer_done(3)
    op.layer_done(1)
    assert op.wait() == 64
    with pytest.raises(FerryError) as e:      # after the last one, every layer is done
        op.layer_done(2)
    assert e.value.code == ESTATE
    y = torch.zeros_like(x)
    assert s.retrieve(np.arange(64), y) == 64 and torch.equal(x, y)


def test_a_layer_holds_the_source_bytes_of_its_layer_done(s):
    x = kvt()
    want = x.clone()
    op = s.store_layers(np.arange(64), x)
    op.layer_done(0)
    x[:, 0] = 0                  # changed after its layer_done: layer 0 keeps the old bytes
    x[:, 1] = 7                  # changed before: layer 1 takes the new bytes
    want[:, 1] = 7
    for l in (1, 2, 3):
        op.layer_done(l)
    x.zero_()
    assert op.wait() == 64
    y = torch.zeros_like(x)
    assert s.retrieve(np.arange(64), y) == 64 and torch.equal(y, want)


def test_a_dropped_source_is_kept_alive_until_the_store_ends(s):
    x = kvt(seed=3)
    want = x.clone()
    op = s.store_layers(np.arange(64), x)
    del x
    gc.collect()
    torch.randn(2, 4, 64, 128).to(torch.bfloat16)     # reuse freed memory, if it were
    for l in range(4):
        op.layer_done(l)
    assert op.wait() == 64
    y = torch.zeros_like(want)
    assert s.retrieve(np.arange(64), y) == 64 and torch.equal(y, want)


@pytest.mark.parametrize("how", ["set_", "resize_", "data"])
def test_a_source_given_other_memory_cancels_the_store(s, how):
    x = kvt(seed=5)
    op = s.store_layers(np.arange(64), x)
    op.layer_done(0)
    if how == "set_":
        x.set_(torch.zeros(2, 4, 64, 128, dtype=torch.bfloat16))
    elif how == "data":
        x.data = torch.zeros(2, 4, 64, 128, dtype=torch.bfloat16)
    else:   # past its capacity: torch frees the memory the op was given
        x.resize_(2, 4, 64 * 64, 128)
    with pytest.raises(FerryError) as e:
        op.layer_done(1)
    assert e.value.code == -errno.EFAULT and "cancelled, nothing of it stored" in str(e.value)
    with pytest.raises(FerryError) as e:
        op.layer_done(2)
    assert e.value.code == -errno.ECANCELED
    with pytest.raises(FerryError) as e:
        op.wait()
    assert e.value.code == -errno.ECANCELED
    assert s.lookup(np.arange(64)) == 0          # nothing of it stored


def test_a_paged_source_moved_is_caught_at_its_layer(s):
    lay = ferry.Layout(num_layers=4, num_heads=2, head_dim=64, dtype="bf16")
    caches = [torch.randn(2, 8, 16, 2, 64).to(torch.bfloat16) for _ in range(4)]
    st = ferry.KVStore("paged", lay, l1="8M", chunk_tokens=16)
    op = st.store_layers(np.arange(64), caches, [0, 1, 2, 3])
    op.layer_done(0)
    caches[2].set_(torch.zeros_like(caches[2]))
    op.layer_done(1)                 # layer 1's cache is where it was
    with pytest.raises(FerryError) as e:
        op.layer_done(2)
    assert e.value.code == -errno.EFAULT
    assert st.lookup(np.arange(64)) == 0
    st.close()


def test_wait_layer_after_cancel_and_after_wait_answer_the_ops_end(s):
    x = kvt()
    s.store(np.arange(64), x)
    y = torch.zeros_like(x)
    op = s.retrieve_layers(np.arange(64), y)
    assert op.wait() == 64
    for l in range(4):                       # every layer landed: its result
        assert op.wait_layer(l) == 64
    with pytest.raises(FerryError) as e:     # still the wrong kind of op
        op.layer_done(0)
    assert e.value.code == ESTATE
    assert torch.equal(x, y)
    # a store cancelled short of its layers
    st = s.store_layers(np.arange(64) + 500, x)
    st.layer_done(0)
    assert st.cancel() is True
    with pytest.raises(FerryError) as e:
        st.layer_done(1)
    assert e.value.code == -errno.ECANCELED
    with pytest.raises(FerryError) as e:
        st.wait_layer(0)
    assert e.value.code == ESTATE
    assert s.lookup(np.arange(64) + 500) == 0
    # a retrieve cancelled (or finished first: then its result)
    many = np.arange(16 * 64)
    big = torch.randn(2, 4, 16 * 64, 128).to(torch.bfloat16)
    s.store(many, big)
    z = torch.zeros_like(big)
    op = s.retrieve_layers(many, z)
    cancelled = op.cancel()
    for l in range(4):
        if cancelled:
            with pytest.raises(FerryError) as e:
                op.wait_layer(l)
            assert e.value.code == -errno.ECANCELED
        else:
            assert op.wait_layer(l) == 16 * 64


def test_layers_after_the_store_closed(s):
    x = kvt()
    s.store(np.arange(64), x)
    st = s.store_layers(np.arange(64) + 100, x)
    st.layer_done(1)
    r = s.retrieve_layers(np.arange(64), torch.zeros_like(x))
    r.wait_layer(0)
    s.close()
    with pytest.raises(FerryError) as e:
        st.layer_done(2)
    assert e.value.code == -errno.ECANCELED
    with pytest.raises(FerryError) as e:
        st.wait()
    assert e.value.code == -errno.ECANCELED
    assert r.wait_layer(3) == 64 and r.wait() == 64    # the close finished it
    with pytest.raises(FerryError) as e:
        s.store_layers(np.arange(64), x)
    assert e.value.code == -errno.EBADF


def test_layer_ops_dropped_by_gc_in_flight():
    out = run_child("""
        import gc
        LAY = ferry.Layout(num_layers=4, num_heads=2, head_dim=64, dtype="bf16")
        s = ferry.KVStore("p", LAY, l1="16M", chunk_tokens=16)
        x = torch.randn(2, 4, 64, 128).to(torch.bfloat16)
        s.store(np.arange(64), x)
        for i in range(200):
            st = s.store_layers(np.arange(64) + 1000 + i * 64, x)
            st.layer_done(i % 4)
            r = s.retrieve_layers(np.arange(64), torch.zeros_like(x))
            del st, r
            if i % 10 == 0:
                gc.collect()
        gc.collect()
        held = s.lookup(np.arange(64 * 200) + 1000)
        y = torch.zeros_like(x)
        print(held, s.retrieve(np.arange(64), y), bool(torch.equal(x, y)))
        s.close()
    """)
    assert out.split() == ["0", "64", "True"], out


# -- vLLM's layerwise connector --

def test_vllm_layerwise_forward_raced_by_shutdown():
    """save_kv_layer / wait_for_layer_load from a forward thread while another
    thread shuts the worker down: FerryError (EBADF / ECANCELED) or nothing,
    no crash, no hang; what was stored is exactly the forward's KV."""
    out = run_child("""
        from test_adapter_vllm import Engine, Request, prompts, CHUNK, NAME
        from ferry.adapters import unregister_store
        from tiny_llama import TinyLlama
        model = TinyLlama(seed=4321)
        lay = ferry.Layout.from_model(model.layers, model.kv_heads, model.head_dim, dtype="f32")
        codes, bad = {}, 0
        for rnd in range(6):
            st = ferry.KVStore("tiny-llama", lay, l1=64 * CHUNK * lay.token_bytes,
                               chunk_tokens=CHUNK)
            eng = Engine(model, st, extra={"ferry.store": NAME, "ferry.layerwise": True})
            a, _ = prompts()
            ra = Request("a", a)
            eng.admit(ra)
            def fwd():
                try:
                    eng.step_new(ra)
                except FerryError as e:
                    codes[e.code] = codes.get(e.code, 0) + 1
                except AssertionError:
                    pass            # get_finished after the close: the harness's own check
            t = threading.Thread(target=fwd)
            t.start()
            time.sleep(rnd * 0.002)
            st.close()
            t.join(60)
            assert not t.is_alive(), "the forward hangs"
            unregister_store(NAME)
        print(sorted(codes))
    """)
    assert set(eval(out)) <= {-errno.EBADF, -errno.ECANCELED}, out


def test_vllm_wait_for_layer_load_of_an_unknown_layer_is_a_clear_error():
    out = run_child("""
        from test_adapter_vllm import Engine, Request, prompts, CHUNK, NAME, layer_names
        from tiny_llama import TinyLlama
        model = TinyLlama(seed=4321)
        lay = ferry.Layout.from_model(model.layers, model.kv_heads, model.head_dim, dtype="f32")
        st = ferry.KVStore("tiny-llama", lay, l1=64 * CHUNK * lay.token_bytes,
                           chunk_tokens=CHUNK)
        eng = Engine(model, st, extra={"ferry.store": NAME, "ferry.layerwise": True})
        a, b = prompts()
        ra = Request("a", a)
        eng.admit(ra)
        eng.step_new(ra)
        eng.finish(ra)
        rb = Request("b", b)
        assert eng.admit(rb) == 32
        w = eng.worker
        from types import SimpleNamespace
        so = SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(
            req_id="b", prompt_token_ids=b, block_ids=(eng.blocks["b"],),
            num_computed_tokens=32)],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(),
                                                  new_token_ids=[], all_token_ids={},
                                                  new_block_ids=[], num_computed_tokens=[],
                                                  num_output_tokens=[]),
            num_scheduled_tokens={"b": 32}, total_num_scheduled_tokens=32,
            finished_req_ids=set())
        meta = eng.sched.build_connector_meta(so)
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)
        names = layer_names(model)
        try:
            w.wait_for_layer_load("model.layers.99.self_attn.attn")
            print("none")
        except KeyError as e:
            print("KeyError", e)
        except Exception as e:
            print(type(e).__name__, e)
        for n in reversed(names):     # out of order, then the last twice
            w.wait_for_layer_load(n)
        w.wait_for_layer_load(names[-1])
        w.wait_for_save()
        print(w.get_block_ids_with_load_errors() == set())
        w.clear_connector_metadata()
        eng.close()
        st.close()
    """)
    first, ok = out.strip().split("\n")
    assert ok == "True", out
    assert not first.startswith("KeyError"), out
