"""The MoE side (ferry.moe: Planner, ExpertPool) as an engine team misuses
it in its first hour, each case that could crash or hang the interpreter
in a child process (its exit status and a timeout are the test's, not the
runner's death):

- sizes ctypes would wrap: a planner or pool made with num_layers,
  num_experts, slots, expert_bytes or row_bytes past their C type (2^32 + 4
  slots became 4, and the pool sized its Python-side arrays by 2^32 + 4),
  and ferry.replay's slots and expert_bytes (2^32 + 64 slots replayed 64);
- a bank given another dtype after its pool was made (.data = a view or a
  tensor of a dtype ferry has no code for): the copy was refused with a
  ValueError after the planner had placed the experts, so planner and
  slots disagreed and the next ensure() answered slots holding other bytes;
- a bank resized (its memory freed) by another thread while a copy from it
  runs: the copy read freed memory and ensure() returned its slots as the
  experts' rows; now the copy is refused after the fact (EFAULT) and its
  slots forgotten (a free that unmaps the pages under the copy is a crash
  no Python-side check can prevent: the class says to keep the banks);
- a KeyboardInterrupt (a notebook's interrupt, Ctrl-C) arriving while the
  planner's C call runs: it surfaced after the planner had placed the
  step's experts and before their copy, so the pool answered those slots
  later as resident with other experts' bytes (and a Planner kept experts
  whose copy plan never reached its caller);
- last_counts read by a thread after its own ensure() while another
  thread's ensure() came between: it answered the other thread's step;
- a slot_tensor bank that is not an integer (a ctypes ArgumentError) and
  a device that is not a name (an AttributeError), while sizes and banks
  that are numpy or torch integer scalars stay taken, as ctypes took them;
- a bank found moved before a copy that evicted (a full pool): the slots
  kept naming the evicted experts the planner had forgotten;
- a bank resized past its capacity, then given a tensor that the
  allocator put at the freed address: the address check passed and the
  copy read past the end of a smaller array;
- a plan the executor refuses whole (nothing moved, no slot named
  unknown): the planner kept the step's experts in slots without them;
- every method of one Planner and one ExpertPool from 8 threads at once
  (ensure, hint, hint_prefetch, lookup, forget, stats, check, slot_tensor,
  with numpy and torch ids and bad arguments among them), then a close()
  mid-way and calls after it, over host banks and over a rows file: only
  the package's errors, no slot named for two experts, every resident
  slot holding its expert's bytes.
"""
import errno
import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

import ferry  # noqa: E402
from ferry import FerryError  # noqa: E402

PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PRELUDE = """
import errno, gc, random, sys, threading, time
import numpy as np, torch
sys.path.insert(0, {pkg!r})
import ferry
from ferry import FerryError
"""


def run_child(body, timeout=120):
    """Run body in a fresh interpreter: it must exit 0 (not by a signal) in time."""
    code = PRELUDE.format(pkg=PKG) + textwrap.dedent(body)
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"child hung past {timeout} s\n{e.stdout}\n{e.stderr}")
    assert p.returncode == 0, f"child exited {p.returncode}\n{p.stdout}\n{p.stderr}"
    return p.stdout


# -- sizes ctypes would wrap --

@pytest.mark.parametrize("args", [dict(num_layers=2**32 + 2), dict(num_experts=2**32 + 8),
                                  dict(slots=2**32 + 4), dict(slots=-1), dict(num_layers=-2),
                                  dict(expert_bytes=-1), dict(expert_bytes=2**64 + 5)])
def test_planner_refuses_sizes_a_cast_would_wrap(args):
    kw = dict(num_layers=2, num_experts=8, slots=4)
    kw.update(args)
    with pytest.raises(FerryError) as e:
        ferry.Planner(**kw)
    (name, v), = args.items()
    assert e.value.code == -errno.EINVAL and name in e.value.message
    assert str(v) in e.value.message, e.value.message
    with pytest.raises(TypeError):
        ferry.Planner(2, 8, 4.0)


def test_sizes_may_be_integer_scalars_of_numpy_and_torch():
    # a size computed with numpy or torch (np.array(4), torch.tensor(4))
    # was taken before the checks against wrapping (ctypes reads __index__);
    # they made it a TypeError. Floats, bools and arrays of several stay one.
    import numpy as np
    bank = torch.zeros(2 * 8, 64, dtype=torch.uint8)
    for v in (np.uint16(4), np.array(4), torch.tensor(4), torch.tensor(4, dtype=torch.uint8)):
        with ferry.Planner(np.array(2), torch.tensor(8), v, expert_bytes=torch.tensor(64)) as p:
            assert (p.num_layers, p.num_experts, p.slots) == (2, 8, 4)
            assert type(p.slots) is int
            assert p.ensure(torch.tensor(1), [3])[0] == [0]
        with ferry.ExpertPool(2, 8, v, [bank]) as pool:
            assert pool.slots == 4 and pool.ensure(np.array(1), [3]) == [0]
    for bad in (4.0, np.float32(4), np.array(4.0), torch.tensor(4.0), True, np.bool_(True),
                np.array(True), torch.tensor(True), np.array([4]), torch.tensor([4]), "4"):
        with pytest.raises(TypeError, match="slots"):
            ferry.Planner(2, 8, bad)
    with pytest.raises(FerryError) as e:
        ferry.Planner(2, 8, torch.tensor(-4))
    assert e.value.code == -errno.EINVAL and "-4" in e.value.message


def test_pool_refuses_sizes_a_cast_would_wrap(tmp_path):
    # slots 2^32 + 4 was a pool of 4 slots whose Python side believed in
    # 2^32 + 4 (its first copy allocated a 16 GiB array: a hang, or the
    # OOM killer); a row_bytes of 2^64 + 64 read rows of 64 bytes
    out = run_child("""
        bank = torch.zeros(2 * 8, 64, dtype=torch.uint8)
        for kw in (dict(slots=2**32 + 4), dict(num_layers=2**32 + 2), dict(slots=-4)):
            a = dict(num_layers=2, num_experts=8, slots=4)
            a.update(kw)
            try:
                ferry.ExpertPool(banks=[bank], **a)
            except FerryError as e:
                (name, v), = kw.items()
                assert e.code == -errno.EINVAL and name in e.message and str(v) in e.message, e
            else:
                raise AssertionError(f"pool made with {kw}")
        for L, E in ((0, 8), (2, 0)):
            try:
                ferry.ExpertPool(L, E, 4, [bank])       # was a ZeroDivisionError
            except FerryError as e:
                assert e.code == -errno.EINVAL, e
            else:
                raise AssertionError("pool made with no rows")
        path = %r
        open(path, "wb").write(bytes(2 * 8 * 64))
        for rb in (2**64 + 64, -64):
            try:
                ferry.ExpertPool(2, 8, 4, rows_file=path, row_bytes=[rb])
            except FerryError as e:
                assert e.code == -errno.EINVAL and str(rb) in e.message, e
            else:
                raise AssertionError(f"pool made with row_bytes {rb}")
        with ferry.ExpertPool(2, 8, 4, rows_file=path, row_bytes=[64]) as pool:
            assert pool.ensure(1, [7]) == [0]
        print("ok")
    """ % str(tmp_path / "rows.bin"), timeout=60)
    assert "ok" in out


def test_replay_refuses_sizes_a_cast_would_wrap(tmp_path):
    cli = os.environ.get("FERRY_CLI") or os.path.join(PKG, "..", "build", "ferry")
    trace = tmp_path / "t.jsonl"
    subprocess.run([cli, "moe", "gen", "--model", "small", "--tokens", "16", "-o", str(trace)],
                   check=True, capture_output=True)
    assert ferry.replay(str(trace), "lru", 64)["slots"] == 64
    for kw in (dict(slots=2**32 + 64), dict(slots=-1), dict(expert_bytes=-1),
               dict(expert_bytes=2**64 + 1)):
        a = dict(policy="lru", slots=64)
        a.update(kw)
        with pytest.raises(FerryError) as e:
            ferry.replay(str(trace), **a)
        (name, v), = kw.items()
        assert e.value.code == -errno.EINVAL and name in e.value.message
        assert str(v) in e.value.message, e.value.message


def test_pool_argument_types_are_type_errors():
    bank = torch.zeros(2 * 8, 64, dtype=torch.uint8)
    for device in (None, b"host", 0):
        with pytest.raises(TypeError, match="device"):
            ferry.ExpertPool(2, 8, 4, [bank], device=device)
    with ferry.ExpertPool(2, 8, 4, [bank]) as pool:
        for b in (0.0, "0", None, True):
            with pytest.raises(TypeError, match="bank"):
                pool.slot_tensor(b)
        with pytest.raises(IndexError):
            pool.slot_tensor(-1)
        import numpy as np
        assert pool.slot_tensor(np.int64(0)).shape == (4, 64)


def test_slot_tensor_bank_may_be_an_integer_scalar():
    # slot_tensor(torch.tensor(1)) viewed bank 1 before bank became a
    # TypeError unless an int or numpy integer
    import numpy as np
    banks = [torch.zeros(2 * 8, 64, dtype=torch.uint8), torch.ones(2 * 8, 32, dtype=torch.uint8)]
    with ferry.ExpertPool(2, 8, 4, banks) as pool:
        for b in (torch.tensor(1), np.array(1), np.uint8(1)):
            assert pool.slot_tensor(b).shape == (4, 32)
        for b in (torch.tensor(1.0), np.array([1]), torch.tensor(True)):
            with pytest.raises(TypeError, match="bank"):
                pool.slot_tensor(b)


# -- banks changed under the pool --

@pytest.mark.parametrize("how", ["view", "other"])
def test_bank_given_another_dtype_keeps_planner_and_slots_agreed(how):
    L, E, S, R = 2, 8, 4, 64
    bank = torch.arange(L * E * R, dtype=torch.int32).to(torch.uint8).reshape(L * E, R)
    want = bank.clone()
    with ferry.ExpertPool(L, E, S, [bank], policy="lru") as pool:
        view = pool.slot_tensor(0)
        first = pool.ensure(0, [1, 2])
        if how == "view":      # the same memory as bools: the rows are the same bytes
            bank.data = bank.data.view(torch.bool)
            slots = pool.ensure(1, [5, 6])
        else:                  # other memory of a dtype ferry has no code for
            bank.data = torch.zeros(L * E, R // 8, dtype=torch.complex64)
            with pytest.raises(FerryError) as e:
                pool.ensure(1, [5, 6])
            assert e.value.code == -errno.EFAULT and "bank 0" in e.value.message
            bank.data = want.clone()
            with pytest.raises(FerryError):     # still not the memory the pool reads
                pool.ensure(1, [5, 6])
            slots = None
        pool.check()                            # planner and slots agree slot by slot
        assert pool.ensure(0, [1, 2]) == first and pool.last_counts["missing"] == 0
        for sl, ex in zip(first, (1, 2)):
            assert torch.equal(view[sl], want[ex])
        if slots is not None:
            for sl, ex in zip(slots, (5, 6)):
                assert torch.equal(view[sl], want[E + ex])


@pytest.mark.parametrize("how", ["dtype", "set_"])
def test_bank_moved_before_an_evicting_copy_keeps_planner_and_slots_agreed(how):
    # the copy refused before it starts (EFAULT) after the planner evicted
    # the pool's experts for the step's: the slots still named the evicted
    # experts while the planner had forgotten them (check() raised)
    L, E, S, R = 2, 8, 4, 64
    bank = torch.arange(L * E * R, dtype=torch.int32).to(torch.uint8).reshape(L * E, R)
    want = bank.clone()
    with ferry.ExpertPool(L, E, S, [bank], policy="lru") as pool:
        view = pool.slot_tensor(0)
        pool.ensure(0, [0, 1, 2, 3])               # every slot taken: the next step evicts
        orig = bank.data
        if how == "dtype":
            bank.data = torch.zeros(L * E, R // 8, dtype=torch.complex64)
        else:
            bank.set_(want.clone())
        with pytest.raises(FerryError) as e:
            pool.ensure(1, [5, 6])
        assert e.value.code == -errno.EFAULT and "bank 0" in e.value.message
        pool.check()                               # planner and slots agree slot by slot
        bank.data = orig                           # the memory the pool reads, again
        for layer, ex in ((1, [5, 6]), (0, [0, 1]), (1, [5, 6])):
            for sl, x in zip(pool.ensure(layer, ex), ex):
                assert torch.equal(view[sl], want[layer * E + x]), (layer, x, sl)
            pool.check()


@pytest.mark.parametrize("full", [False, True])
def test_copy_refused_whole_by_the_executor_leaves_no_phantom_expert(full):
    # ferry_moe_slots_apply refuses a plan it cannot validate whole
    # (-EINVAL, nothing moves) without naming any slot unknown: the pool
    # forgot only the slots named, so the planner kept the step's experts
    # in slots that never got their rows, and the next ensure() answered
    # them as hits over other bytes. (The call is wrapped to pass no rows
    # source, one of the things validation refuses.)
    import ferry.moe as moe
    L, E, S, R = 2, 8, 4, 64
    bank = torch.randint(0, 256, (L * E, R), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(3))
    with ferry.ExpertPool(L, E, S, [bank], policy="lru") as pool:
        view = pool.slot_tensor(0)
        pool.ensure(0, [0, 1, 2, 3] if full else [0, 1])
        real = moe.lib.ferry_moe_slots_apply
        moe.lib.ferry_moe_slots_apply = lambda s, plan, rows, u, n: real(s, plan, None, u, n)
        try:
            with pytest.raises(FerryError) as e:
                pool.ensure(1, [5, 6])
        finally:
            moe.lib.ferry_moe_slots_apply = real
        assert e.value.code == -errno.EINVAL, e.value
        pool.check()                                # planner and slots agree
        for layer, ex in ((1, [5, 6]), (0, [0, 1])):
            for sl, x in zip(pool.ensure(layer, ex), ex):
                assert torch.equal(view[sl], bank[layer * E + x]), (layer, x, sl)


def test_bank_freed_then_given_memory_at_its_old_address_is_refused():
    # resize_() past capacity frees the memory the rows source reads; the
    # next allocation of about that size takes the same address, and a bank
    # given it (set_) passed the address check: the copy read the rows of
    # a smaller array and past its end (the last row's tail: heap bytes)
    import numpy as np
    L, E, S, R = 2, 8, 4, 256                  # 4 KiB: past numpy's small-block cache
    bank = torch.arange(L * E * R, dtype=torch.int32).to(torch.uint8).reshape(L * E, R)
    a0 = bank.data_ptr()
    with ferry.ExpertPool(L, E, S, [bank], policy="lru") as pool:
        bank.resize_(L * E * R * 4)            # its storage moves; the old memory is freed
        cands = [np.full(L * E * R - 48, 0xAB, np.uint8) for _ in range(16)]
        at = [c for c in cands if c.__array_interface__["data"][0] == a0]
        if not at:
            pytest.skip("the allocator gave no array the freed address")
        bank.set_(torch.from_numpy(at[0]))     # the bank's address is the old one again
        with pytest.raises(FerryError) as e:
            pool.ensure(1, [E - 1])
        assert e.value.code == -errno.EFAULT and "bank 0" in e.value.message
        pool.check()


@pytest.mark.parametrize("how", ["resize_", "storage"])
def test_bank_freed_while_its_copy_runs_is_refused_after_the_copy(how):
    # the copy's C call is wrapped to free the bank just before it reads
    # (another thread's resize_ landing inside the copy, made deterministic);
    # the bank is small, so its freed memory stays mapped (taken by junk)
    out = run_child("""
        import ferry.moe as moe
        L, E, S, R = 2, 8, 4, 64
        bank = torch.arange(L * E * R, dtype=torch.int32).to(torch.uint8).reshape(L * E, R)
        want = bank.clone()
        pool = ferry.ExpertPool(L, E, S, [bank], policy="lru")
        view = pool.slot_tensor(0)
        first = pool.ensure(0, [1, 2])
        real, junk = moe.lib.ferry_moe_slots_apply, []
        def apply_after_a_free(*a):
            if %r == "resize_":
                bank.resize_(L * E * R * 64)
            else:
                bank.storage().resize_(0)
            junk.append(torch.full((L * E * R,), 0xAB, dtype=torch.uint8))
            return real(*a)
        moe.lib.ferry_moe_slots_apply = apply_after_a_free
        try:
            got = pool.ensure(1, [5, 6])
        except FerryError as e:
            assert e.code == -errno.EFAULT and "bank 0" in str(e), e
        else:
            raise AssertionError(f"slots {got} answered from a bank freed under the copy: "
                                 f"{[view[s][:4].tolist() for s in got]}")
        finally:
            moe.lib.ferry_moe_slots_apply = real
        pool.check()                                  # planner and slots agree
        assert pool.ensure(0, [1, 2]) == first and pool.last_counts["missing"] == 0
        for sl, ex in zip(first, (1, 2)):
            assert torch.equal(view[sl], want[ex])
        pool.close()
        print("ok")
    """ % how, timeout=60)
    assert "ok" in out


# -- one object, many threads --

STORM = """
    L, E, S, R = 3, 16, 8, 512
    bank = torch.randint(0, 256, (L * E, R), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(5))
    if %r == "file":
        open(%r, "wb").write(bank.numpy().tobytes())
        pool = ferry.ExpertPool(L, E, S, rows_file=%r, row_bytes=[R], policy=%r)
    else:
        pool = ferry.ExpertPool(L, E, S, [bank], policy=%r)
    planner = ferry.Planner(L, E, S, policy=%r)
    view = pool.slot_tensor(0)
    other, codes = [], {}
    def call(r, obj):
        layer = r.randrange(L + 1)             # L: no such layer
        k = r.choice([0, 1, 2, 3, S + 1])      # 0: no route; S + 1: more than the slots
        ex = r.sample(range(E), min(k, E))
        form = r.randrange(3)
        ids = np.array(ex, dtype=np.int64)[::-1][::-1] if form == 1 else \
            torch.tensor(ex, dtype=torch.int32) if form == 2 else ex
        op = r.randrange(10)
        if op < 4:
            return obj.ensure(layer, ids)
        if op == 4:
            return obj.hint(layer, r.choice([1, 2, L, 0]), ids, r.random())
        if op == 5:
            return obj.hint_prefetch(r.randrange(4))
        if op == 6:
            return obj.stats(), obj.hint_stats(), obj.policy
        if obj is planner:
            if op == 7:
                return planner.forget(r.randrange(S + 1))
            return planner.lookup(layer, r.randrange(E))
        return pool.check() if op == 7 else pool.slot_tensor(0, torch.int32, (R // 4,))
    def worker(i, n):
        r = random.Random(i)
        for _ in range(n):
            for obj in (pool, planner):
                try:
                    call(r, obj)
                except FerryError as e:
                    codes[e.name] = codes.get(e.name, 0) + 1
                except Exception as e:
                    other.append(f"{type(e).__name__}: {e}")
    def verify():
        pool.check()
        seen = {}
        for layer in range(L):
            for e in range(E):
                s = planner.lookup(layer, e)
                if s is not None:
                    assert s not in seen, f"slot {s} named for {seen[s]} and {(layer, e)}"
                    seen[s] = (layer, e)
        for layer in range(L):
            for e in range(E):
                sl = pool.ensure(layer, [e])[0]
                assert torch.equal(view[sl], bank[layer * E + e]), (layer, e, sl)
    th = [threading.Thread(target=worker, args=(i, 150)) for i in range(8)]
    for t in th: t.start()
    for t in th: t.join()
    assert not other, other[:5]
    verify()
    # the same, with a close() of each from another thread mid-way
    def closer():
        time.sleep(0.05)
        pool.close()
        planner.close()
    th = [threading.Thread(target=worker, args=(i, 400)) for i in range(8)]
    th.append(threading.Thread(target=closer))
    for t in th: t.start()
    for t in th: t.join()
    assert not other, other[:5]
    assert set(codes) <= {"EINVAL", "FERRY_ENOSPACE", "EBADF"}, codes
    assert codes.get("EBADF"), codes
    for f in (lambda: pool.ensure(0, [1]), lambda: planner.stats(), lambda: pool.policy,
              lambda: planner.hint(0, 1, [1]), lambda: pool.slot_tensor(0)):
        try:
            f()
        except FerryError as e:
            assert e.code == -errno.EBADF, e
        else:
            raise AssertionError("a call after close() answered")
    pool.close(); planner.close()                  # twice: a no-op
    assert view[0].numel() == R                    # the view outlives the pool
    print("ok", sorted(codes.items()))
"""


@pytest.mark.parametrize("policy,rows", [("lru", "banks"), ("routing", "file"),
                                         ("auto", "banks")])
def test_every_method_from_threads_then_close(policy, rows, tmp_path):
    path = str(tmp_path / "rows.bin")
    out = run_child(STORM % (rows, path, path, policy, policy, policy), timeout=240)
    assert "ok" in out, out


# -- an interrupt between the plan and its copy --

@pytest.mark.parametrize("call", ["pool.ensure", "pool.hint_prefetch", "planner.ensure",
                                  "planner.hint_prefetch"])
def test_interrupt_during_the_planner_call_leaves_no_phantom_expert(call):
    # the planner's C call is wrapped to deliver SIGINT's KeyboardInterrupt
    # while it runs (as a notebook's interrupt does): it surfaces after the
    # call returned, with the planner holding the step's experts
    out = run_child("""
        import _thread
        import ferry.moe as moe
        L, E, S, R = 2, 8, 4, 64
        bank = torch.randint(0, 256, (L * E, R), dtype=torch.uint8,
                             generator=torch.Generator().manual_seed(2))
        pool = ferry.ExpertPool(L, E, S, [bank], policy="lru")
        planner = ferry.Planner(L, E, S, policy="lru")
        view = pool.slot_tensor(0)
        for obj in (pool, planner):
            obj.ensure(0, [0, 1])
            obj.hint(1, 1, [5, 6], 0.99)
        call = %r
        name = "ferry_moe_planner_" + call.split(".")[1]
        real = getattr(moe.lib, name)
        def interrupted(*a):
            rc = real(*a)
            _thread.interrupt_main()
            return rc
        setattr(moe.lib, name, interrupted)
        try:
            if call == "pool.ensure":
                pool.ensure(1, [5, 6])
            elif call == "planner.ensure":
                planner.ensure(1, [5, 6])
            else:
                eval(call)(4)
            for _ in range(1000):   # the interrupt lands at the next check
                pass
        except KeyboardInterrupt:
            pass
        else:
            raise AssertionError("no interrupt")
        setattr(moe.lib, name, real)
        pool.check()                                    # planner and slots agree
        for e in (5, 6):
            assert planner.lookup(1, e) is None, "a slot placed by an interrupted call"
        for layer, ex in ((1, [5, 6]), (0, [0, 1])):
            slots = pool.ensure(layer, ex)
            for sl, e in zip(slots, ex):
                assert torch.equal(view[sl], bank[layer * E + e]), (layer, e, sl)
        print("ok")
    """ % call, timeout=60)
    assert "ok" in out


@pytest.mark.parametrize("call", ["ensure", "hint_prefetch"])
def test_interrupt_during_the_copy_leaves_no_phantom_expert(call):
    # the same interrupt during the copy's C call: it surfaces after the
    # rows landed; the plan's slots are dropped (a copy wasted, no wrong byte)
    out = run_child("""
        import _thread
        import ferry.moe as moe
        L, E, S, R = 2, 8, 4, 64
        bank = torch.randint(0, 256, (L * E, R), dtype=torch.uint8,
                             generator=torch.Generator().manual_seed(4))
        pool = ferry.ExpertPool(L, E, S, [bank], policy="lru")
        view = pool.slot_tensor(0)
        # ensure: a full pool (the step evicts); a prefetch takes free slots
        pool.ensure(0, [0, 1, 2, 3] if %r == "ensure" else [0, 1])
        pool.hint(1, 1, [5, 6], 0.99)
        real = moe.lib.ferry_moe_slots_apply
        def interrupted(*a):
            rc = real(*a)
            _thread.interrupt_main()
            return rc
        moe.lib.ferry_moe_slots_apply = interrupted
        try:
            pool.ensure(1, [5, 6]) if %r == "ensure" else pool.hint_prefetch(4)
            for _ in range(1000):
                pass
        except KeyboardInterrupt:
            pass
        else:
            raise AssertionError("no interrupt")
        moe.lib.ferry_moe_slots_apply = real
        pool.check()
        for layer, ex in ((1, [5, 6]), (0, [0, 1]), (1, [5, 6])):
            for sl, e in zip(pool.ensure(layer, ex), ex):
                assert torch.equal(view[sl], bank[layer * E + e]), (layer, e, sl)
            pool.check()
        print("ok")
    """ % (call, call), timeout=60)
    assert "ok" in out


# -- what a thread's own step found --

@pytest.mark.parametrize("kind", ["pool", "planner"])
def test_last_counts_are_the_calling_threads_step(kind):
    import threading
    bank = torch.zeros(2 * 8, 64, dtype=torch.uint8)
    obj = ferry.ExpertPool(2, 8, 6, [bank]) if kind == "pool" else ferry.Planner(2, 8, 6)
    with obj:
        mine_done, theirs_done, seen = threading.Event(), threading.Event(), []

        def other():
            mine_done.wait()
            obj.ensure(1, [4, 5])            # two rows fetched
            theirs_done.set()

        t = threading.Thread(target=other)
        t.start()
        obj.ensure(0, [1])                   # one row fetched
        mine_done.set()
        theirs_done.wait()
        seen.append(dict(obj.last_counts))
        t.join()
        assert seen[0]["fetched"] == 1 and seen[0]["active"] == 1, seen
        t = threading.Thread(target=lambda: seen.append(dict(obj.last_counts)))
        t.start()
        t.join()
        assert seen[1]["fetched"] == 2, seen  # a thread with no step of its own: the last
