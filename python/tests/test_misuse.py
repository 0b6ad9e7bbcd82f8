"""Misuse from Python, each case in a process of its own (a crash or an abort
is the child's exit status, not the test runner's death), in process and
through a `ferry serve` daemon:

- one Op waited on, cancelled and tested from several threads at once;
- asyncio.wait_for(op, timeout) timing out, then op.cancel();
- a layerwise store lacking a layer when its store is closed, then the op's
  free, cancel and layer_done; and a store finalized before its op at exit;
- close() from one thread while others are inside store and lookup, or
  in a tight loop of one-name lookups;
- ids a cast to int32 would wrap, negative ids, floats and strings;
- an async retrieve's destination given other memory (set_, .data =)
  while the op runs: the op's bytes land in the memory it holds;
- an expert bank given other memory after its pool was made: refused;
- an engine's block table rewritten in place while an async op runs.
"""
import os
import subprocess
import sys
import textwrap

import pytest

from test_server import Daemon

PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PRELUDE = """
import asyncio, errno, sys, threading, time
import numpy as np, torch
sys.path.insert(0, {pkg!r})
import ferry
from ferry import FerryError
LAY = ferry.Layout(num_layers=2, num_heads=2, head_dim=64, dtype="bf16")
URL = {url!r}
def store():
    if URL:
        return ferry.KVStore("misuse", LAY, server=URL, chunk_tokens=16, server_timeout_ms=3000)
    return ferry.KVStore("misuse", LAY, l1="16M", chunk_tokens=16)
def kv(n):
    return torch.randn(2, 2, n, 128).to(torch.bfloat16)
"""


@pytest.fixture(scope="module", params=["local", "server"])
def url(request, tmp_path_factory):
    if request.param == "local":
        yield ""
        return
    d = Daemon(str(tmp_path_factory.mktemp("misuse"))).start()
    yield d.url
    d.stop()


def run_child(url, body):
    code = PRELUDE.format(pkg=PKG, url=url) + textwrap.dedent(body)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, f"child exited {p.returncode}\n{p.stdout}\n{p.stderr}"
    return p.stdout


def test_one_op_from_many_threads(url):
    out = run_child(url, """
        s = store()
        src = kv(1024)
        for r in range(30):
            toks = np.arange(1024, dtype=np.int32) + 2000 * r
            op = s.store_async(toks, src)
            res = []
            def waiter():
                try:
                    res.append(op.wait())
                except FerryError as e:
                    res.append(e.code)
            def tester():
                while not op.done():
                    pass
            th = [threading.Thread(target=waiter), threading.Thread(target=waiter),
                  threading.Thread(target=tester)]
            for t in th:
                t.start()
            stopped = op.cancel()
            op.free()
            for t in th:
                t.join()
            want = -errno.ECANCELED if stopped else 1024
            assert res == [want, want], (res, stopped)
            assert op.done() and (stopped or op.wait() == 1024)
        s.close()
        print("ok")
    """)
    assert "ok" in out


def test_asyncio_timeout_then_cancel(url):
    run_child(url, """
        s = store()
        src = kv(8192)
        async def main():
            for r in range(40):
                toks = np.arange(8192, dtype=np.int32) + 10000 * r
                op = s.store_async(toks, src)
                try:
                    # (the executor's thread is inside the C wait when cancel comes)
                    await asyncio.wait_for(op, timeout=0.0005 * (r % 4))
                except asyncio.TimeoutError:
                    pass
                op.cancel()                      # after the timeout: safe
                rc = None
                try:
                    rc = await op                # the kept result, again
                except FerryError as e:
                    assert e.code == -errno.ECANCELED
                assert rc in (None, 8192)
                # the awaiting task cancelled: the op goes on until op.cancel()
                op2 = s.store_async(toks + 100000, src)
                task = asyncio.ensure_future(op2)
                await asyncio.sleep(0)
                task.cancel()
                op2.cancel()
        asyncio.run(main())
        s.close()
    """)


def test_layerwise_store_outlives_close(url):
    run_child(url, """
        toks = np.arange(64, dtype=np.int32)
        for act in ("free", "cancel", "layer_done", "wait", "exit"):
            s = store()
            op = s.store_layers(toks, kv(64))
            op.layer_done(0)                  # layer 1 never comes
            s.close()
            if act == "free":
                op.free()
            elif act == "cancel":
                assert op.cancel() is True
            elif act == "layer_done":
                try:
                    op.layer_done(1)
                    raise AssertionError("layer_done after close succeeded")
                except FerryError as e:
                    assert e.code == -errno.ECANCELED, e
            elif act == "wait":
                try:
                    op.wait()
                    raise AssertionError("wait after close succeeded")
                except FerryError as e:
                    assert e.code == -errno.ECANCELED, e
            else:
                keep = (s, op)                # finalized at exit: the store first
                del s
            if act != "exit":
                del op
        s2 = store()
        assert s2.lookup(toks) == 0           # nothing of them was stored
        s2.close()
        # and at exit: a store finalized before its op, the other way round too
        a = store(); opa = a.store_layers(toks, kv(64)); opa.layer_done(0)
        b = store(); opb = b.store_layers(toks + 1, kv(64))
        del a
    """)


def test_close_while_other_threads_are_inside(url):
    run_child(url, """
        for r in range(5):
            s = store()
            src = kv(2048)
            errs, stop = [], False
            def worker(i):
                toks = np.arange(2048, dtype=np.int32) + 10000 * (i + 4 * r)
                while True:
                    try:
                        s.store(toks, src)
                        s.lookup(toks)
                    except FerryError as e:
                        errs.append(e.code)
                        return
            th = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
            for t in th:
                t.start()
            time.sleep(0.05)
            s.close()                          # waits for the calls inside
            for t in th:
                t.join()
            # EBADF: refused after the close; ECANCELED: a store inside
            # whose wait for the daemon's slots the close cut short (a
            # client cannot tell a wait for a slot from a slow answer)
            ok = {-errno.EBADF} if not URL else {-errno.EBADF, -errno.ECANCELED}
            assert len(errs) == 3 and set(errs) <= ok, errs
    """)


def test_close_while_other_threads_look_up_names(url):
    # the one-key exists path: calls so short that close lands among many
    # entering and leaving (the store's guard takes no lock on that path)
    run_child(url, """
        for r in range(20):
            s = store()
            src = kv(16)
            s.store_named([b"k" * 64], src)
            errs, hits = [], []
            going = [threading.Event() for _ in range(3)]
            def worker(i):
                n = 0
                while True:
                    try:
                        n += s.lookup_named([b"k" * 64]) + s.lookup_named([b"k" * 64, b"m"])
                        going[i].set()
                    except FerryError as e:
                        errs.append(e.code)
                        hits.append(n)
                        return
            th = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
            for t in th:
                t.start()
            for g in going:                    # every thread has looked up (a
                assert g.wait(30)              # busy host may take more than
            time.sleep(0.02)                   # the 20 ms given to them)
            s.close()                          # waits for the calls inside
            for t in th:
                t.join()
            assert errs == [-errno.EBADF] * 3, errs
            assert all(h > 0 for h in hits), hits
    """)


def test_ids_out_of_range_are_refused(url):
    run_child(url, """
        s = store()
        src = [torch.zeros(2, 8, 16, 2, 64, dtype=torch.bfloat16) for _ in range(2)]
        toks = list(range(32))
        def refused(exc, fn, *a, **k):
            try:
                fn(*a, **k)
            except exc as e:
                return str(e)
            raise AssertionError(f"{fn.__name__}{a[:1]} was accepted")
        m = refused(FerryError, s.store, toks, src, [0, 2**32 + 7])
        assert "block id 4294967303 at position 1" in m, m
        m = refused(FerryError, s.store, toks, src, [0, -1])
        assert "block id -1" in m, m
        assert s.lookup(toks) == 0
        big = np.array(toks, dtype=np.int64); big[3] += 2**32
        m = refused(FerryError, s.store, big, src, [0, 1])
        assert "token id 4294967299 at position 3" in m, m
        refused(FerryError, s.lookup, [5, -1] + toks[2:])
        refused(FerryError, s.lookup, [2**40] + toks[1:])
        refused(TypeError, s.lookup, [float(t) for t in toks])
        refused(TypeError, s.lookup, np.arange(32, dtype=np.float32))
        refused(TypeError, s.lookup, ["1"] * 32)
        refused(TypeError, s.store, toks, src, [0.0, 1.0])
        refused(TypeError, s.store, toks, src, [True, False])
        op = s.store_layers(toks, src, [0, 1])
        refused(FerryError, op.layer_done, 2**32)   # would wrap to layer 0
        refused(TypeError, op.layer_done, 0.0)
        op.layer_done(0); op.layer_done(1)
        assert op.wait() == 32
        assert s.lookup(np.array(toks, dtype=np.int64)) == 32
        s.close()
    """)


def test_destination_given_other_memory_in_flight_is_not_written(url):
    # retrieve_async into y, then y.set_() / y.data = ... before it lands:
    # the op holds y's old storage (on a torch without untyped_storage too),
    # so the bytes land there, never in freed memory a new tensor took;
    # wait() says EFAULT (y does not hold them)
    run_child(url, """
        import gc
        s = store()
        n = 8192
        toks = np.arange(n, dtype=np.int32) + 500000
        x = kv(n)
        assert s.store(toks, x) == n
        for r in range(12):
            y = torch.zeros_like(x)
            op = s.retrieve_async(toks, y)
            if r % 2:
                y.set_(torch.zeros(4, dtype=torch.bfloat16))
            else:
                y.data = torch.zeros(4, dtype=torch.bfloat16)
            gc.collect()
            z = torch.full(x.shape, 3.0, dtype=torch.bfloat16)   # may reuse freed memory
            try:
                rc = op.wait()
            except FerryError as e:
                assert e.code == -errno.EFAULT and "moved" in e.message, e
            else:
                assert rc == n   # (landed before the set_)
            assert bool((z == 3.0).all()), f"round {r}: a tensor allocated later was written"
        s.close()
        print("ok")
    """)


def test_block_table_rewritten_in_flight_moves_the_blocks_given(url):
    # an engine hands its own int32 block table (an array, a tensor) to an
    # async op and rewrites it in place for the next step at once: the op
    # moves the blocks the table named at the call, never the new ones
    # (another request's blocks) nor ids past the cache (out of bounds)
    run_child(url, """
        BS, NB, NBLK = 16, 256, 128
        caches = [torch.randn(2, NB, BS, 2, 64).to(torch.bfloat16) for _ in range(2)]
        n = NBLK * BS
        toks = np.arange(n, dtype=np.int32) + 900000
        s = store()
        assert s.store(toks, caches, np.arange(NBLK, dtype=np.int32)) == n
        for r in range(40):
            dst = [torch.zeros_like(c) for c in caches]
            arr = np.arange(NBLK, dtype=np.int32) + NBLK          # blocks 128..255
            t = arr if r % 2 else torch.from_numpy(arr)
            op = s.retrieve_async(toks, dst, t)
            arr[:] = 0 if r % 4 < 2 else 2**31 - 1               # rewritten at once
            assert op.wait() == n
            for l in range(2):
                assert torch.equal(dst[l][:, NBLK:], caches[l][:, :NBLK]), (r, l)
                assert not dst[l][:, :NBLK].any(), f"round {r}: KV landed in other blocks"
        # a store: the chunks hold the blocks named at the call
        src = [torch.randn(2, NB, BS, 2, 64).to(torch.bfloat16) for _ in range(2)]
        arr = np.arange(NBLK, dtype=np.int32) + NBLK
        op = s.store_async(toks + 5000000, src, arr)
        arr[:] = 0
        assert op.wait() == n
        back = [torch.zeros_like(c) for c in caches]
        assert s.retrieve(toks + 5000000, back, np.arange(NBLK, dtype=np.int32)) == n
        for l in range(2):
            assert torch.equal(back[l][:, :NBLK], src[l][:, NBLK:])
        s.close()
    """)


@pytest.mark.parametrize("how", ["set_", "data", "resize_"])
def test_expert_bank_given_other_memory_is_refused(how):
    # an ExpertPool over host banks, then a bank given other memory: its
    # next copy is refused (EFAULT naming the bank), never read from freed
    # or stale memory; the slots it planned are forgotten, so planner and
    # slots agree and the experts resident before stay exact
    out = run_child("", """
        L, E, S, R = 2, 8, 4, 4096
        bank = torch.arange(L * E * R, dtype=torch.int32).to(torch.uint8)
        want = bank.clone().view(L, E, R)
        pool = ferry.ExpertPool(L, E, S, [bank])
        view = pool.slot_tensor(0)
        first = pool.ensure(0, [1, 2])
        how = %r
        if how == "set_":
            bank.set_(torch.zeros(4, dtype=torch.uint8))
        elif how == "data":
            bank.data = torch.zeros(4, dtype=torch.uint8)
        else:
            bank.resize_(L * E * R * 64)     # past its capacity: moved, the old freed
        import gc; gc.collect()
        junk = torch.full((L * E * R,), 0xAB, dtype=torch.uint8)  # may take the freed memory
        try:
            pool.ensure(1, [5, 6])
        except FerryError as e:
            assert e.code == -errno.EFAULT and "bank 0" in str(e), e
        else:
            raise AssertionError("a copy from a moved bank was made")
        pool.check()                                            # planner and slots agree
        assert pool.ensure(0, [1, 2]) == first                  # resident: no copy
        assert pool.last_counts["missing"] == 0
        for sl, e in zip(first, [1, 2]):
            assert torch.equal(view[sl], want[0, e])
        pool.close()
        del junk
        print("ok")
    """ % how)
    assert "ok" in out


@pytest.mark.parametrize("locked", [False, True])
def test_call_guard_never_ends_under_a_call(locked):
    """CallGuard: end() returns once, only when no call is inside, and no call
    enters after it; lock-free under the GIL, or the locked form an
    interpreter without one uses (forced here)."""
    import threading
    import time
    from ferry._handle import CallGuard
    for _ in range(10):
        g = CallGuard("test")
        if locked:
            g.enter, g.leave = g._enter_locked, g._leave_locked
        released, bad, calls = [False], [], [0]

        def caller():
            while g.enter():
                for _ in range(50):        # a call's length, for end() to come in
                    if released[0]:
                        bad.append("inside after the end")
                calls[0] += 1
                g.leave()

        th = [threading.Thread(target=caller) for _ in range(3)]
        for t in th:
            t.start()
        time.sleep(0.01)
        ends = [g.end(), g.end()]
        released[0] = True
        for t in th:
            t.join()
        assert ends == [True, False]
        assert not bad and calls[0] > 0 and not g.enter() and g._inside == []
