"""A Planner or ExpertPool closed from inside a call of its own thread, and
a close() interrupted anywhere, each in a process of its own (a crash is
the child's exit status, a hang its watchdog's timeout):

- a SIGTERM handler (here SIGALRM's), a __del__ or a weakref callback runs
  between two bytecodes of the thread it interrupts, which may be inside
  ensure(), slot_tensor(), hint_prefetch() or check() on that very object,
  between two of its C calls. Its close() went through the object's
  (reentrant) lock and freed the planner, slots, rows and device under the
  call: the call's next C call used freed memory (slot_tensor keeps the
  executor's device context across three C calls) or a NULL handle. Now
  such a close marks the object closed and returns at once; the call
  inside finishes, exact, and frees the handles as it leaves; later calls
  raise FerryError (EBADF, "closed").
- a KeyboardInterrupt at any point of close() itself: a second close()
  finishes the release, freeing each handle once (no double free), leaking
  none (the rows file's descriptors come back), and slot_tensor views
  keep the slots' last bytes.
"""
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")

PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PRELUDE = """
import errno, faulthandler, gc, os, signal, sys, time
faulthandler.dump_traceback_later({hang}, exit=True)   # a hang: every thread's stack
import numpy as np, torch
sys.path.insert(0, {pkg!r})
import ferry
from ferry import FerryError
L, E, S, RB = 4, 16, 6, 16384
BANK = torch.randint(0, 256, (L * E, RB), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
ROWS = {tmp!r} + "/rows.bin"
with open(ROWS, "wb") as f:
    f.write(BANK.numpy().tobytes())
def pool(kind="banks"):
    if kind == "file":
        return ferry.ExpertPool(L, E, S, rows_file=ROWS, row_bytes=[RB])
    return ferry.ExpertPool(L, E, S, [BANK])
def closed_after(call):
    try:
        call()
    except FerryError as e:
        assert e.code == -errno.EBADF and "closed" in str(e), e
        return
    raise AssertionError("a call after close went through")
def fds():
    gc.collect()
    return len(os.listdir("/proc/self/fd"))
rng = np.random.default_rng(3)
def experts():
    return rng.choice(E, 4, replace=False)
"""


def run_child(body, tmp_path, timeout=150):
    code = PRELUDE.format(pkg=PKG, hang=timeout - 15, tmp=str(tmp_path)) + textwrap.dedent(body)
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"child hung past {timeout} s\n{e.stdout}\n{e.stderr}")
    assert p.returncode == 0, f"child exited {p.returncode}\n{p.stdout}\n{p.stderr}"
    return p.stdout


CALLS = ["pool_ensure", "pool_ensure_file", "pool_slot_tensor", "pool_hint_prefetch",
         "pool_check", "planner_ensure", "planner_hint_prefetch"]


@pytest.mark.parametrize("what", CALLS)
def test_a_close_inside_a_call_of_its_own_thread_waits_for_that_call(tmp_path, what):
    out = run_child("""
        WHAT = WHAT_
        nested = inside = 0
        def on_alarm(sig, frame):
            global nested
            nested += 1
            cur.close()
        signal.signal(signal.SIGALRM, on_alarm)
        base = fds()
        for r in range(300):
            if WHAT.startswith("planner"):
                cur = ferry.Planner(L, E, S, expert_bytes=RB)
            else:
                cur = pool("file" if WHAT.endswith("file") else "banks")
                view = cur.slot_tensor(0)   # (holds the slots' memory past close)
            done = 0
            signal.setitimer(signal.ITIMER_REAL, 0.00002 * (1 + r % 50))   # 20 us .. 1 ms
            t0 = time.monotonic()
            try:
                while time.monotonic() - t0 < 2:
                    layer = done % L
                    ex = experts()
                    before = nested
                    if WHAT.startswith("pool_ensure"):
                        got = cur.ensure(layer, ex)
                        # the call the close came inside finished exact
                        for e, s in zip(ex, got):
                            assert torch.equal(view[s], BANK[layer * E + e]), (r, e, s)
                    elif WHAT == "pool_slot_tensor":
                        v = cur.slot_tensor(0, torch.float32, (RB // 4,))
                        assert v.shape == (S, RB // 4) and torch.equal(v.view(torch.uint8), view)
                    elif WHAT == "pool_hint_prefetch":
                        cur.hint(layer, 1, ex, confidence=0.95)
                        n = cur.hint_prefetch(max_rows=4)
                        assert 0 <= n <= 4, n
                        got = cur.ensure(layer, ex)
                        for e, s in zip(ex, got):
                            assert torch.equal(view[s], BANK[layer * E + e]), (r, e, s)
                    elif WHAT == "pool_check":
                        cur.ensure(layer, ex)
                        cur.check()
                        assert cur.stats()["misses"] > 0
                        cur.hint_stats()
                    elif WHAT == "planner_ensure":
                        slots, plan = cur.ensure(layer, ex)
                        assert len(slots) == 4 and all(0 <= s < S for s in slots), slots
                        assert cur.lookup(layer, int(ex[0])) == slots[0]
                    else:
                        cur.hint(layer, 1, ex, confidence=0.95)
                        plan = cur.hint_prefetch(4)
                        assert len(plan["dst_slots"]) <= 4, plan
                        cur.ensure(layer, ex)
                    inside += nested != before   # (closed inside the last call, which went on)
                    done += 1
            except FerryError as e:
                assert e.code == -errno.EBADF and "closed" in str(e), e
            signal.setitimer(signal.ITIMER_REAL, 0)
            closed_after(lambda: cur.stats())
            closed_after(lambda: cur.ensure(0, [1]))
            cur.close()
            if not WHAT.startswith("planner"):
                closed_after(lambda: cur.slot_tensor(0))
                assert view.shape == (S, RB) and int(view.sum()) >= 0   # still readable
                del view
            del cur
        assert nested > 0 and inside > 0, (nested, inside)
        assert fds() == base, (base, fds())   # no descriptor left behind
        print("ok", nested, inside)
    """.replace("WHAT_", repr(what)), tmp_path)
    assert out.startswith("ok")
    print(out)


@pytest.mark.parametrize("kind", ["banks", "file", "planner"])
def test_a_close_interrupted_anywhere_is_finished_by_the_next(tmp_path, kind):
    run_child("""
        KIND = KIND_
        armed = False
        def on_alarm(sig, frame):
            if armed:
                raise KeyboardInterrupt
        signal.signal(signal.SIGALRM, on_alarm)
        base = fds()
        hit = 0
        for r in range(400):
            if KIND == "planner":
                cur = ferry.Planner(L, E, S, expert_bytes=RB)
                cur.ensure(1, [2, 3])
                view = None
            else:
                cur = pool(KIND)
                cur.ensure(1, [2, 3])
                view = cur.slot_tensor(0) if r % 3 else None
                slot = cur.ensure(1, [2])[0]
            signal.setitimer(signal.ITIMER_REAL, 0.00001 * (1 + r % 100))   # 10 us .. 1 ms
            try:
                armed = True
                cur.close()
                armed = False
            except KeyboardInterrupt:
                armed = False
                hit += 1
            signal.setitimer(signal.ITIMER_REAL, 0)
            armed = False
            cur.close()
            closed_after(lambda: cur.ensure(0, [1]))
            if view is not None:   # the slots' last bytes, still there
                assert torch.equal(view[slot], BANK[1 * E + 2])
            del view, cur
        assert fds() == base, (base, fds())   # each handle freed: none leaked
        assert hit > 0, hit
        print("ok", hit)
    """.replace("KIND_", repr(kind)), tmp_path)


@pytest.mark.parametrize("kind", ["pool", "planner"])
def test_a_call_inside_a_call_of_its_own_thread_is_refused(tmp_path, kind):
    """A signal handler (or a __del__) that calls stats() (or any call but
    close) on the object its thread is inside ensure() of: the object's
    reentrant lock let it in, where it dropped the outer call's pending
    plan, and the outer call then copied that plan's rows into slots the
    planner no longer held for them (the planner and the slots disagreed,
    a slot answered another expert's bytes). Now it raises FerryError
    (EBUSY) naming the call in progress, and the outer call is exact."""
    run_child("""
        KIND = KIND_
        let_in = refused = 0
        def on_alarm(sig, frame):
            global let_in, refused
            try:   # (read-only: made between two calls it changes nothing)
                cur.stats()
                let_in += 1
            except FerryError as e:
                assert e.code == -errno.EBUSY and "stats() was called on the " in str(e) \\
                    and "inside its own thread's ensure()" in str(e), e
                refused += 1
        signal.signal(signal.SIGALRM, on_alarm)
        layer, ex = 0, [0]
        for r in range(20):
            cur = pool("banks") if KIND == "pool" else ferry.Planner(L, E, S, expert_bytes=RB)
            view = cur.slot_tensor(0) if KIND == "pool" else None
            for i in range(300):
                layer = (layer + 1) % L
                ex = [int(x) for x in experts()]
                # one alarm per call, 5 us .. 300 us in: before, inside, after it
                signal.setitimer(signal.ITIMER_REAL, 0.000005 * (1 + (r * 300 + i) % 60))
                if KIND == "pool":
                    got = cur.ensure(layer, ex)
                else:
                    got, plan = cur.ensure(layer, ex)
                signal.setitimer(signal.ITIMER_REAL, 0)
                for e, s in zip(ex, got):
                    if KIND == "pool":   # the outer call's slots hold its rows
                        assert torch.equal(view[s], BANK[layer * E + e]), (r, e, s)
                    else:                # the planner still holds them there
                        assert cur.lookup(layer, e) == s, (r, e, s)
                if KIND == "pool":
                    cur.check()
            if KIND == "pool":
                del view
            cur.close()
        assert refused > 0, (refused, let_in)   # (let in: between two calls)
        print("ok", refused, let_in)
    """.replace("KIND_", repr(kind)), tmp_path)
