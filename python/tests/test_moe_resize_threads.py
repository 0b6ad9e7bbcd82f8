"""Planner.resize racing ensure from threads, as an engine that changes its
expert budget (memory pressure, a new batch size) while its layer threads
keep routing: 3 threads call ensure (and hint, lookup, forget) in a loop
while another resizes the planner 300 times with varied budgets (1 slot,
fewer slots than a step's experts, more than the experts, refused ones),
then closes it while they still call. Each policy runs in a child process
(a crash or a hang fails the test, not the runner):

- no exception but the documented ones: FERRY_ENOSPACE (a step of more
  experts than the budget), EINVAL (refused budgets and ids) and, after
  the close, EBADF;
- every ensure answers distinct slots below the largest budget, and its
  copy plan names only slots it answered;
- afterwards the planner agrees with itself: Python's slots is C's, every
  resident expert sits in a slot below it, no slot holds two experts, and
  an ensure after the race still answers.
"""
import os
import subprocess
import sys
import textwrap

import pytest

PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = """
import errno, random, sys, threading
sys.path.insert(0, {pkg!r})
import ferry
from ferry import FerryError
from ferry._lib import lib

L, E, S0 = 4, 32, 8
BUDGETS = [1, 2, 3, 5, 8, 13, 32, 64, 129]
policy = {policy!r}
p = ferry.Planner(L, E, S0, policy=policy)
codes, other, bad = {{}}, [], []
stop = threading.Event()

def ensurer(seed):
    r = random.Random(seed)
    while not stop.is_set():
        layer = r.randrange(L)
        ex = r.sample(range(E), r.choice([1, 2, 4, 6]))
        try:
            op = r.randrange(8)
            if op < 5:
                slots, plan = p.ensure(layer, ex)
                if len(set(slots)) != len(slots) or max(slots) >= max(BUDGETS):
                    bad.append(("slots", ex, slots))
                if not set(plan["dst_slots"]) <= set(slots):
                    bad.append(("plan", slots, plan))
            elif op == 5:
                p.hint(layer, 1, ex, r.random())
            elif op == 6:
                s = p.lookup(layer, ex[0])
                if s is not None and s >= max(BUDGETS):
                    bad.append(("lookup", layer, ex[0], s))
            else:
                p.forget(r.randrange(8))
        except FerryError as e:
            codes[e.name] = codes.get(e.name, 0) + 1
        except Exception as e:
            other.append(f"{{type(e).__name__}}: {{e}}")

def resizer():
    r = random.Random(99)
    for i in range(300):
        n = 0 if i % 50 == 49 else r.choice(BUDGETS)   # 0: refused, nothing changes
        try:
            before = p.slots
            dropped = p.resize(n)
            if not 0 <= dropped <= before:
                bad.append(("dropped", before, n, dropped))
        except FerryError as e:
            codes["resize " + e.name] = codes.get("resize " + e.name, 0) + 1
        except Exception as e:
            other.append(f"resize {{type(e).__name__}}: {{e}}")

def consistent():
    assert p.slots == lib.ferry_moe_planner_slots(p._h), (p.slots,
        lib.ferry_moe_planner_slots(p._h))
    seen = {{}}
    for layer in range(L):
        for e in range(E):
            s = p.lookup(layer, e)
            if s is None:
                continue
            assert s < p.slots, f"({{layer}}, {{e}}) in slot {{s}} of {{p.slots}}"
            assert s not in seen, f"slot {{s}} holds {{seen[s]}} and {{(layer, e)}}"
            seen[s] = (layer, e)
    st = p.stats()
    assert st["hits"] + st["misses"] == st["routes"], st

th = [threading.Thread(target=ensurer, args=(i,)) for i in range(3)]
rz = threading.Thread(target=resizer)
for t in th: t.start()
rz.start(); rz.join()
stop.set()
for t in th: t.join()
assert not other, other[:5]
assert not bad, bad[:5]
assert set(codes) <= {{"FERRY_ENOSPACE", "EINVAL", "resize EINVAL"}}, codes
assert codes.get("resize EINVAL") == 6, codes
consistent()
p.resize(8)
slots, _ = p.ensure(0, [1, 2, 3])
assert sorted(slots) == sorted(set(slots)) and max(slots) < 8 and p.lookup(0, 2) == slots[1]
consistent()

# the same race, ended by a close() from the resizing thread
stop.clear()
def resize_then_close():
    resizer()
    p.close()
th = [threading.Thread(target=ensurer, args=(10 + i,)) for i in range(3)]
rz = threading.Thread(target=resize_then_close)
for t in th: t.start()
rz.start(); rz.join()
stop.set()
for t in th: t.join()
assert not other, other[:5]
assert not bad, bad[:5]
assert codes.get("EBADF"), codes
assert set(codes) <= {{"FERRY_ENOSPACE", "EINVAL", "resize EINVAL", "EBADF"}}, codes
for f in (lambda: p.resize(4), lambda: p.ensure(0, [1])):
    try:
        f()
    except FerryError as e:
        assert e.code == -errno.EBADF, e
    else:
        raise AssertionError("a call after close() answered")
p.close()
print("ok", sorted(codes.items()))
"""


@pytest.mark.parametrize("policy", ["lru", "auto", "routing", "transition", "s3fifo", "arc"])
def test_resize_racing_ensure_from_threads_then_close(policy):
    code = CHILD.format(pkg=PKG, policy=policy)
    try:
        r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                           text=True, timeout=60)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"child hung past 60 s\n{e.stdout}\n{e.stderr}")
    assert r.returncode == 0, f"child exited {r.returncode}\n{r.stdout}\n{r.stderr}"
    assert "ok" in r.stdout, r.stdout
