"""Handles across fork, as engines fork workers (vLLM's multiprocessing
with fork, torch DataLoader workers, a bare os.fork): a store, its ops and
an expert pool opened in the parent, used, closed and garbage-collected in
the forked child - while the parent has an operation in flight and a
thread inside a call at the fork. The child's calls raise FerryError
(EBADF) naming the fork, never hang, crash or answer from the parent's
threads; its close and garbage collection leave the parent's store whole
(bitwise); the child opens its own and uses it. Copies and pickles of a
handle (a spawned process's arguments) are refused. Each case runs in a
process of its own with a timeout: a hang fails it, not the suite.
"""
import os
import subprocess
import sys
import textwrap

import pytest

from test_server import Daemon

PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PRELUDE = """
import errno, os, pickle, copy, signal, sys, threading, time
import numpy as np, torch
sys.path.insert(0, {pkg!r})
import ferry
from ferry import FerryError
LAY = ferry.Layout(num_layers=2, num_heads=2, head_dim=64, dtype="bf16")
URL = {url!r}
L2 = {l2!r}
def store(l2=L2):
    if URL:
        return ferry.KVStore("fork", LAY, server=URL, chunk_tokens=16, server_timeout_ms=3000)
    return ferry.KVStore("fork", LAY, l1="16M", chunk_tokens=16,
                         l2=(l2 + ":64M") if l2 else None)
def kv(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, n, 128, generator=g).to(torch.bfloat16)
def refused(fn, *a):
    try:
        fn(*a)
    except FerryError as e:
        assert e.code == -errno.EBADF and "fork" in str(e), e
        return True
    raise AssertionError(f"{{fn}} answered in a forked child")
def in_child(body):
    # body runs in a forked child under a 20 s alarm (a hang: SIGALRM), which
    # then leaves through sys.exit (atexit and garbage collection run)
    pid = os.fork()
    if pid == 0:
        signal.alarm(20)
        code = 0
        try:
            body()
        except BaseException as e:
            import traceback; traceback.print_exc()
            code = 3
        sys.stdout.flush()
        sys.exit(code)
    _, st = os.waitpid(pid, 0)
    assert os.WIFEXITED(st) and os.WEXITSTATUS(st) == 0, f"child ended with status {{st:#x}}"
"""


@pytest.fixture(scope="module", params=["local", "l2", "server"])
def where(request, tmp_path_factory):
    if request.param == "server":
        d = Daemon(str(tmp_path_factory.mktemp("fork"))).start()
        yield d.url, None, tmp_path_factory.mktemp("forkc")
        d.stop()
        return
    t = tmp_path_factory.mktemp("fork")
    yield "", str(t / "l2") if request.param == "l2" else None, t


def run_child(where, body):
    url, l2, _ = where
    code = PRELUDE.format(pkg=PKG, url=url, l2=l2) + textwrap.dedent(body)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, f"process exited {p.returncode}\n{p.stdout}\n{p.stderr}"
    return p.stdout


def test_store_used_closed_and_collected_in_a_forked_child(where):
    # the parent: chunks stored, a long store in flight, a thread inside
    # lookups at the fork. The child: every call refused, the op's wait
    # too, close and collection quiet; then a store of its own works. The
    # parent afterwards: its chunks bitwise, its op's result, its close.
    tmp = str(where[2])
    out = run_child(where, """
        s = store()
        toks = np.arange(64, dtype=np.int32)
        src = kv(64, 1)
        assert s.store(toks, src) == 64
        big = np.arange(4096, dtype=np.int32) + 100000
        op = s.store_async(big, kv(4096, 2))
        stop = threading.Event()
        def looker():
            while not stop.is_set():
                s.lookup(toks)
        th = threading.Thread(target=looker)
        th.start()
        time.sleep(0.01)
        def child():
            dst = torch.zeros_like(src)
            refused(s.lookup, toks)
            refused(s.retrieve, toks, dst)
            refused(s.store, toks + 7, src)
            refused(s.lookup_named, ["a"])
            refused(s.stats)
            refused(op.wait)
            refused(op.done)
            refused(op.cancel)
            op.free()
            assert not dst.any()                # nothing written into it
            s.close()                           # forgets it, calls no C
            s.close()
            refused(s.lookup, toks)
            # a store of the child's own (a server's: its own connection)
            mine = store(os.path.join({tmp!r}, "l2-child") if L2 else None)
            t2 = np.arange(32, dtype=np.int32) + 7000000 + os.getpid()
            k2 = kv(32, 3)
            assert mine.store(t2, k2) == 32
            back = torch.zeros_like(k2)
            assert mine.retrieve(t2, back) == 32 and torch.equal(back, k2)
            mine.close()
            print("child ok", flush=True)
        in_child(child)
        stop.set()
        th.join()
        assert op.wait() == 4096
        dst = torch.zeros_like(src)
        assert s.retrieve(toks, dst) == 64 and torch.equal(dst, src)
        back = torch.zeros(2, 2, 4096, 128, dtype=torch.bfloat16)
        assert s.retrieve(big, back) == 4096 and torch.equal(back, kv(4096, 2))
        # a second child that only drops its references (garbage collection)
        def child_gc():
            global s, op
            del s, op
            import gc; gc.collect()
        in_child(child_gc)
        s2 = s
        assert s2.lookup(toks) == 64
        s.close()
        print("parent ok")
    """.replace("{tmp!r}", repr(tmp)))
    assert "child ok" in out and "parent ok" in out


def test_store_in_a_multiprocessing_fork_worker(where):
    # what vLLM and DataLoader do: a worker of a fork context reaches the
    # parent's store through a global; its call is refused with the fork named
    out = run_child(where, """
        import multiprocessing as mp
        s = store()
        toks = np.arange(64, dtype=np.int32) + 200000   # not the other test's chunks
        src = kv(64, 5)
        s.store(toks, src)
        def work(q):
            try:
                s.lookup(toks)
                q.put("answered")
            except FerryError as e:
                q.put(f"refused {e.name} {'fork' in str(e)}")
        ctx = mp.get_context("fork")
        q = ctx.Queue()
        p = ctx.Process(target=work, args=(q,))
        p.start()
        print(q.get(timeout=20))
        p.join(20)
        assert p.exitcode == 0, p.exitcode
        dst = torch.zeros_like(src)
        assert s.retrieve(toks, dst) == 64 and torch.equal(dst, src)
        s.close()
    """)
    assert "refused EBADF True" in out


def test_expert_pool_and_planner_in_a_forked_child():
    # a thread inside ensure() at the fork holds the pool's lock: the child
    # must not wait for it, and its close must not free the parent's slots
    out = run_child(("", None, None), """
        L, E, S, R = 2, 8, 4, 256
        banks = [torch.arange(L * E * R, dtype=torch.int32).to(torch.uint8)]
        pool = ferry.ExpertPool(L, E, S, banks)
        plan = ferry.Planner(L, E, S)
        view = pool.slot_tensor(0)
        stop = threading.Event()
        def stepper():
            i = 0
            while not stop.is_set():
                pool.ensure(i % L, [i % E, (i + 3) % E])
                plan.ensure(i % L, [i % E])
                i += 1
        th = threading.Thread(target=stepper)
        th.start()
        time.sleep(0.01)
        def child():
            refused(pool.ensure, 0, [1])
            refused(pool.check)
            refused(plan.ensure, 0, [1])
            refused(lambda: plan.policy)
            pool.close()
            plan.close()
            print("child ok", flush=True)
        in_child(child)
        stop.set()
        th.join()
        slots = pool.ensure(1, [5, 6])
        pool.check()
        want = banks[0].view(L, E, R)
        for sl, e in zip(slots, [5, 6]):
            assert torch.equal(view[sl], want[1, e])
        pool.close()
        plan.close()
        print("parent ok")
    """)
    assert "child ok" in out and "parent ok" in out


def test_handles_refuse_copy_and_pickle():
    # a copy would close the handle twice; a pickle (a spawned process's
    # arguments) cannot carry a handle: both a TypeError naming the class
    out = run_child(("", None, None), """
        s = store()
        op = s.store_async(np.arange(32, dtype=np.int32), kv(32, 1))
        plan = ferry.Planner(2, 8, 4)
        for h in (s, op, plan):
            for f in (copy.copy, copy.deepcopy, pickle.dumps):
                try:
                    f(h)
                except TypeError as e:
                    assert "cannot be copied or pickled" in str(e), e
                else:
                    raise AssertionError(f"{f.__name__} of {type(h).__name__} answered")
        assert op.wait() == 32
        s.close()
        plan.close()
        plan.close()
        print("ok")
    """)
    assert "ok" in out


def test_ops_that_ended_in_the_parent_refuse_in_a_forked_child(where):
    # ops the parent waited, polled to done, cancelled, or left to its
    # store's close: their results are the parent's, kept in Python. The
    # child's wait, done, cancel, await and layer calls raise EBADF naming
    # the fork (as an op in flight's do), never answer the parent's result;
    # its free and collection are quiet; the parent's answers stay
    out = run_child(where, """
        import asyncio
        s = store()
        toks = np.arange(64, dtype=np.int32) + 300000
        src = kv(64, 7)
        waited = s.store_async(toks, src)
        assert waited.wait() == 64
        dst = torch.zeros_like(src)
        polled = s.retrieve_async(toks, dst)
        while not polled.done():
            time.sleep(0.001)
        cancelled = s.store_async(toks + 64, kv(64, 8))
        cancelled.cancel()
        lay = s.retrieve_layers(toks, torch.zeros_like(src))
        assert lay.wait_layer(1) == 64 and lay.wait() == 64
        lstore = s.store_layers(toks + 128, kv(64, 9))
        lstore.layer_done(0); lstore.layer_done(1)
        assert lstore.wait() == 64
        s2 = store(L2 + "-2" if L2 else None)
        orphan = s2.store_async(toks + 192, kv(64, 10))
        s2.close()
        ops = [waited, polled, cancelled, lay, lstore, orphan]
        def child():
            for op in ops:
                refused(op.wait)
                refused(op.wait, 0)
                refused(op.done)
                refused(op.cancel)
                async def aw():
                    return await op
                refused(asyncio.run, aw())
            refused(lay.wait_layer, 0)
            refused(lstore.layer_done, 1)
            refused(lstore.wait_layer, 0)
            refused(s.lookup, toks)
            for op in ops:
                op.free()
                refused(op.wait)
            s.close()
            s2.close()
            print("child ok", flush=True)
        in_child(child)
        def child_gc():
            global ops, waited, polled, cancelled, lay, lstore, orphan, s, s2
            del ops, waited, polled, cancelled, lay, lstore, orphan, s, s2
            import gc; gc.collect()
        in_child(child_gc)
        assert waited.wait() == 64 and polled.wait() == 64 and lay.wait() == 64
        assert lstore.wait() == 64 and orphan.done()
        assert torch.equal(dst, src)
        back = torch.zeros_like(src)
        assert s.retrieve(toks + 128, back) == 64 and torch.equal(back, kv(64, 9))
        assert s.lookup(toks) == 64
        s.close()
        print("parent ok")
    """)
    assert "child ok" in out and "parent ok" in out


def test_last_counts_refuse_in_a_forked_child():
    # last_counts is what the parent's last ensure() found, kept in Python:
    # the child's read raises EBADF naming the fork (as its calls do), never
    # answers the parent's step; the parent's stays
    out = run_child(("", None, None), """
        L, E, S, R = 2, 8, 4, 256
        banks = [torch.arange(L * E * R, dtype=torch.int32).to(torch.uint8)]
        pool = ferry.ExpertPool(L, E, S, banks)
        plan = ferry.Planner(L, E, S)
        pool.ensure(0, [1, 2])
        plan.ensure(0, [1, 2])
        seen = threading.Thread(target=lambda: (pool.ensure(1, [3]), plan.ensure(1, [3])))
        seen.start()
        seen.join()
        want = (pool.last_counts, plan.last_counts)
        assert want[0]["missing"] == 2 and want[1]["missing"] == 2
        def child():
            refused(lambda: pool.last_counts)
            refused(lambda: plan.last_counts)
            pool.close()
            plan.close()
            print("child ok", flush=True)
        in_child(child)
        assert (pool.last_counts, plan.last_counts) == want
        pool.close()
        plan.close()
        print("parent ok")
    """)
    assert "child ok" in out and "parent ok" in out


def test_the_adapters_store_registry_works_in_a_child_forked_mid_call():
    """A thread inside register_store (its lock held, here while the name
    hashes) as the process forks: the child has the lock held by a thread
    it lacks, and its first registered_store() (a vLLM worker forked from
    its engine building its connector) hung for ever. Now the child's
    registry starts with a lock of its own and answers."""
    out = run_child(("", None, None), """
        from ferry import adapters
        inside = threading.Event()
        class SlowName(str):
            def __hash__(self):
                inside.set()
                time.sleep(2)
                return str.__hash__(self)
        adapters.register_store("kept", "a store")
        th = threading.Thread(target=adapters.register_store, args=(SlowName("slow"), "b"))
        th.start()
        assert inside.wait(10)
        def child():
            assert adapters.registered_store("kept") == "a store"
            adapters.register_store("mine", "c")
            assert adapters.unregister_store("mine") == "c"
            print("child ok", flush=True)
        in_child(child)
        th.join(10)
        assert adapters.registered_store("slow") == "b"
        print("ok")
    """)
    assert "child ok" in out and out.rstrip().endswith("ok")


def test_the_sglang_backend_works_in_a_child_forked_mid_call():
    """A thread of the parent inside a FerryHiCacheStorage call that holds
    its lock (its metrics, counts) or its warning lock as the process
    forks (an engine forking a worker while its cache controller's
    threads run): the child has those locks held by a thread it lacks,
    and its first get_stats() (or any call counting pages) hung for ever.
    Now the child's backend starts with locks of its own and answers."""
    out = run_child(("", None, None), """
        sys.path.insert(0, {tests!r})
        from ferry.adapters.sglang import FerryHiCacheStorage
        from sglang_pools import storage_config
        b = FerryHiCacheStorage(storage_config({{"ferry_store": "forked"}}), {{}})
        inside, leave = threading.Event(), threading.Event()
        def busy():   # (as a backup thread between two steps of its call)
            with b._lock, b._warn_lock:
                inside.set()
                leave.wait(10)
        th = threading.Thread(target=busy)
        th.start()
        assert inside.wait(10)
        def child():
            s = b.get_stats()
            assert s.prefetch_pgs == [] and s.backup_pgs == [], s
            with b._warn_lock:
                pass
            print("child ok", flush=True)
        in_child(child)
        leave.set()
        th.join(10)
        assert b.get_stats() is not None
        print("ok")
    """.format(tests=os.path.dirname(os.path.abspath(__file__))))
    assert "child ok" in out and out.rstrip().endswith("ok")
