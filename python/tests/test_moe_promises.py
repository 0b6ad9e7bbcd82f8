"""The promises of ferry.moe's docstrings (Planner, ExpertPool, replay,
policies), each held by a test as an engine team reads them in its first
hour, public API only:

- the plan's meaning: row src_rows[i] of plan["layer"] goes into slot
  dst_slots[i], and a slot ensure() answers holds that expert once the
  plans so far are applied (an executor of a dict, every policy, with
  duplicate ids, hints, hint_prefetch, forget and resize among the steps);
- an ExpertPool's slots hold exactly each expert's rows as an engine reads
  them (slot_tensor of every bank, two banks of other dtypes and row
  sizes, host banks and a rows file, every policy);
- duplicate ids in one step share one slot and one row; a prefetch never
  evicts the experts of the step just served (their slots keep their rows);
- the default policy is "auto" (Planner, ExpertPool, replay);
- last_counts before any ensure() is an AttributeError; every call after
  close() is FerryError (EBADF); forget() frees the slot and the expert
  misses again; hint() returns the distinct experts hinted;
- bad input: ids out of range, of float/bool dtype, 2-D; a layer out of
  range; more distinct experts than slots (FERRY_ENOSPACE); a confidence
  that is not a number (a TypeError, where "0.9" and True were taken);
- replay(path) with no slots replays at the CLI's default budget (it was
  an EINVAL: "slots 0").
"""
import errno
import fractions
import os
import random
import subprocess

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ferry  # noqa: E402
from ferry import FerryError  # noqa: E402
from ferry.moe import ExpertPool, Planner  # noqa: E402

POLICIES = [p for p in ferry.policies() if p != "belady"]  # belady needs a trace
L, E = 3, 10


def test_policies_name_the_default_and_the_baseline():
    names = ferry.policies()
    assert "auto" in names and "lru" in names and len(set(names)) == len(names)


def test_the_default_policy_is_auto():
    bank = torch.zeros(L * E, 16, dtype=torch.uint8)
    with Planner(L, E, 4) as p, ExpertPool(L, E, 4, [bank]) as pool:
        assert p.policy == "auto" and pool.policy == "auto"


# -- the plan's meaning, with an executor of a dict --

@pytest.mark.parametrize("policy", POLICIES)
def test_planner_slots_hold_what_its_plans_copied(policy):
    r = random.Random(policy)
    S = 5
    held = {}   # slot -> (layer, expert): what our executor copied there

    with Planner(L, E, S, policy=policy) as p:
        def apply(plan):
            assert len(plan["dst_slots"]) == len(plan["src_rows"])
            assert len(set(plan["dst_slots"])) == len(plan["dst_slots"])
            for d, e in zip(plan["dst_slots"], plan["src_rows"]):
                assert 0 <= d < p.slots and 0 <= e < E
                held[d] = (plan["layer"], e)

        for step in range(600):
            op = r.random()
            if op < 0.7:
                layer = r.randrange(L)
                ex = [r.randrange(E) for _ in range(r.randint(1, 3))]
                if r.random() < 0.3:
                    ex.append(ex[0])   # a duplicate id in one step
                try:
                    slots, plan = p.ensure(layer, ex)
                except FerryError as e:
                    assert e.name == "FERRY_ENOSPACE" and len(set(ex)) > p.slots
                    continue
                assert plan["layer"] == layer
                assert len(slots) == len(ex)
                apply(plan)
                for e, s in zip(ex, slots):
                    assert held.get(s) == (layer, e), (step, ex, slots, plan)
                    assert p.lookup(layer, e) == s
                by_expert = dict(zip(ex, slots))
                assert len(set(by_expert.values())) == len(by_expert)  # one slot an expert
                c = p.last_counts
                assert c["active"] == len(set(ex)) and c["fetched"] == len(plan["src_rows"])
            elif op < 0.85:
                p.hint(r.randrange(L), r.randint(1, 5), [r.randrange(E)], r.random())
            elif op < 0.95:
                plan = p.hint_prefetch(r.randint(0, 3))
                apply(plan)
                for d, e in zip(plan["dst_slots"], plan["src_rows"]):
                    assert p.lookup(plan["layer"], e) == d
            elif op < 0.98:
                s = r.randrange(p.slots)
                p.forget(s)
                held.pop(s, None)
            else:
                n = r.randint(3, 8)
                p.resize(n)
                held = {s: v for s, v in held.items() if s < n}


def test_duplicate_ids_in_one_step_share_one_slot_and_one_row():
    with Planner(1, 8, 4, policy="lru") as p:
        slots, plan = p.ensure(0, [3, 3, 5, 3])
        assert slots[0] == slots[1] == slots[3] != slots[2]
        assert sorted(plan["src_rows"]) == [3, 5] and p.last_counts["active"] == 2
        slots2, plan2 = p.ensure(0, [5, 5])
        assert slots2 == [slots[2]] * 2 and plan2["dst_slots"] == []
        # duplicates count once against the slots: 4 distinct of 4 fit
        p.ensure(0, [0, 1, 2, 3, 0, 1, 2, 3])
        assert p.last_counts["active"] == 4


def test_forget_frees_the_slot_and_the_expert_misses_again():
    with Planner(1, 8, 2, policy="lru") as p:
        (s,), _ = p.ensure(0, [6])
        p.forget(s)
        p.forget(s)                      # a free slot: a no-op
        assert p.lookup(0, 6) is None
        got, plan = p.ensure(0, [6])
        assert plan["src_rows"] == [6] and plan["dst_slots"] == got
        assert p.last_counts["missing"] == 1
        with pytest.raises(FerryError) as e:
            p.forget(2)                  # no such slot
        assert e.value.code == -errno.EINVAL


def test_hint_returns_the_distinct_experts_hinted():
    with Planner(2, 8, 4) as p:
        assert p.hint(1, 1, [2, 2, 4, 2], 0.9) == 2
        assert p.hint_stats()["hinted"] == 2


def test_prefetch_never_evicts_the_step_just_served():
    """An engine computes with the step's slots after asking for the next
    layer's rows: a prefetch must not copy over them, however sure."""
    with Planner(2, 8, 4, policy="lru") as p:
        slots, _ = p.ensure(0, [0, 1, 2, 3])          # every slot is this step's
        p.hint(1, 1, [4, 5, 6, 7], 1.0)
        plan = p.hint_prefetch(4)
        assert not set(plan["dst_slots"]) & set(slots)
        assert [p.lookup(0, e) for e in range(4)] == slots


# -- the ExpertPool's rows, as an engine reads them --

def _banks():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(L, E, 6, 4, generator=g)                          # float32, 96 bytes
    v = torch.randint(-2**15, 2**15, (L, E, 40), generator=g, dtype=torch.int16)  # 80 bytes
    return w, v


def _rows_right(pool, layer, experts, slots, w, v):
    ws = pool.slot_tensor(0, torch.float32, (6, 4))
    vs = pool.slot_tensor(1, torch.int16, (40,))
    return all(torch.equal(ws[s], w[layer, e]) and torch.equal(vs[s], v[layer, e])
               for e, s in zip(experts, slots))


@pytest.mark.parametrize("source", ["banks", "file"])
@pytest.mark.parametrize("policy", POLICIES)
def test_pool_slots_hold_exactly_each_experts_rows(policy, source, tmp_path):
    w, v = _banks()
    if source == "banks":
        kw = dict(banks=[w, v])
    else:
        path = tmp_path / "rows.bin"
        path.write_bytes(w.numpy().tobytes() + v.numpy().tobytes())   # bank after bank
        kw = dict(rows_file=str(path), row_bytes=[96, 80])
    r = random.Random(policy + source)
    with ExpertPool(L, E, 4, policy=policy, **kw) as pool:
        for step in range(250):
            op = r.random()
            if op < 0.75:
                layer = r.randrange(L)
                ex = [r.randrange(E) for _ in range(r.randint(1, 3))]
                if r.random() < 0.3:
                    ex.insert(0, ex[-1])
                slots = pool.ensure(layer, ex)
                assert _rows_right(pool, layer, ex, slots, w, v), (step, layer, ex, slots)
                assert pool.last_counts["active"] == len(set(ex))
            elif op < 0.9:
                pool.hint(r.randrange(L), r.randint(1, 4), [r.randrange(E), r.randrange(E)],
                          r.choice([0.3, 0.9, 1.0]))
            else:
                n = pool.hint_prefetch(r.randint(0, 3))
                assert 0 <= n <= 3
        pool.check()


def test_pool_hint_prefetch_copies_every_banks_rows_and_keeps_the_step():
    w, v = _banks()
    with ExpertPool(L, E, 4, [w, v], policy="lru") as pool:
        slots = pool.ensure(0, [1, 2])
        pool.hint(1, 1, [7, 8], 1.0)
        assert pool.hint_prefetch(4) == 2
        assert _rows_right(pool, 0, [1, 2], slots, w, v)   # the step's rows stay
        got = pool.ensure(1, [7, 8])
        assert pool.last_counts["missing"] == 0
        assert _rows_right(pool, 1, [7, 8], got, w, v)


def test_bank_rows_are_bytes_whatever_the_banks_shape_and_dtype():
    """Banks are packed [layer][expert][row bytes]: a flat uint8 array and
    a float64 array of another shape are read by their bytes."""
    rng = np.random.default_rng(0)
    flat = rng.integers(0, 256, size=L * E * 24, dtype=np.uint8)
    f64 = rng.standard_normal((L * E, 3))
    with ExpertPool(L, E, 3, [flat, f64]) as pool:
        assert pool.row_bytes == [24, 24]
        slots = pool.ensure(2, [9, 0])
        raw = pool.slot_tensor(0)
        f = pool.slot_tensor(1, torch.float64, (3,))
        for e, s in zip([9, 0], slots):
            i = 2 * E + e
            assert bytes(raw[s].numpy()) == flat[i * 24:(i + 1) * 24].tobytes()
            assert np.array_equal(f[s].numpy(), f64[i])


# -- errors --

def test_last_counts_before_any_ensure_is_an_attribute_error():
    bank = torch.zeros(L * E, 8, dtype=torch.uint8)
    with Planner(L, E, 4) as p, ExpertPool(L, E, 4, [bank]) as pool:
        for obj in (p, pool):
            with pytest.raises(AttributeError, match="no ensure"):
                obj.last_counts


def test_every_call_after_close_is_ebadf():
    bank = torch.zeros(L * E, 8, dtype=torch.uint8)
    p, pool = Planner(L, E, 4), ExpertPool(L, E, 4, [bank])
    calls = {"ensure": (0, [1]), "hint": (0, 1, [1]), "hint_prefetch": (1,),
             "hint_stats": (), "stats": (), "lookup": (0, 1), "forget": (0,),
             "resize": (5,), "check": (), "slot_tensor": (0,)}
    for obj in (p, pool):
        obj.close()
        obj.close()   # twice: a no-op
        for name, args in calls.items():
            if hasattr(obj, name):
                with pytest.raises(FerryError) as e:
                    getattr(obj, name)(*args)
                assert e.value.code == -errno.EBADF, (type(obj).__name__, name)
        with pytest.raises(FerryError) as e:
            obj.policy
        assert e.value.code == -errno.EBADF


@pytest.mark.parametrize("kind", ["planner", "pool"])
def test_bad_routes_are_refused_and_change_nothing(kind):
    bank = torch.zeros(L * E, 8, dtype=torch.uint8)
    obj = Planner(L, E, 4) if kind == "planner" else ExpertPool(L, E, 4, [bank])
    with obj:
        for experts in ([E], [0, E + 3], torch.tensor([-1]), np.array([2**32], np.uint64)):
            with pytest.raises(FerryError) as e:
                obj.ensure(0, experts)
            assert e.value.code == -errno.EINVAL
        for layer in (L, 2**32 - 1):
            with pytest.raises(FerryError) as e:
                obj.ensure(layer, [0])
            assert e.value.code == -errno.EINVAL and str(layer) in str(e.value)
        for experts in (torch.tensor([1.0]), np.array([1], np.float16), torch.tensor([True]),
                        ["1"]):
            with pytest.raises(TypeError):
                obj.ensure(0, experts)
        for experts in (torch.tensor([[1, 2]]), 3):
            with pytest.raises(ValueError):
                obj.ensure(0, experts)
        with pytest.raises(FerryError) as e:
            obj.ensure(0, [])                          # an empty route
        assert e.value.code == -errno.EINVAL
        with pytest.raises(FerryError) as e:
            obj.ensure(0, [0, 1, 2, 3, 4])             # 5 distinct experts, 4 slots
        assert e.value.name == "FERRY_ENOSPACE"
        assert obj.stats()["steps"] == 0 and obj.stats()["routes"] == 0
        # and what is accepted works: a torch int tensor, a strided numpy array
        obj.ensure(1, torch.tensor([4, 2], dtype=torch.int32))
        obj.ensure(1, np.array([2, 9, 4], np.int8)[::2])
        assert obj.last_counts["missing"] == 0


@pytest.mark.parametrize("kind", ["planner", "pool"])
def test_a_confidence_is_a_number(kind):
    bank = torch.zeros(L * E, 8, dtype=torch.uint8)
    obj = Planner(L, E, 4) if kind == "planner" else ExpertPool(L, E, 4, [bank])
    with obj:
        for bad in ("0.9", True, None, [0.9], b"1"):
            with pytest.raises(TypeError, match="confidence"):
                obj.hint(0, 1, [1], bad)
        for bad in (1.5, -0.1, float("nan")):
            with pytest.raises(FerryError) as e:
                obj.hint(0, 1, [1], bad)
            assert e.value.code == -errno.EINVAL
        assert obj.hint_stats()["hinted"] == 0
        for ok in (1, 0.5, np.float32(0.5), np.float64(0.25), torch.tensor(0.75),
                   np.int64(1), fractions.Fraction(9, 10)):   # any real number
            assert obj.hint(0, 1, [1], ok) == 1


# -- replay --

def _trace(tmp_path, tokens=32):
    cli = os.environ.get("FERRY_CLI") or os.path.join(os.path.dirname(__file__), "..", "..",
                                                      "build", "ferry")
    trace = tmp_path / "t.jsonl"
    subprocess.run([cli, "moe", "gen", "--model", "small", "--tokens", str(tokens), "-o",
                    str(trace)], check=True, capture_output=True)
    return trace


def test_replay_returns_what_it_says(tmp_path):
    trace = _trace(tmp_path)
    r = ferry.replay(trace, "lru", 16)       # a path-like is taken
    for k in ("hits", "misses", "hit_rate", "evictions", "host_bytes", "ns_per_step"):
        assert k in r
    assert r["policy"] == "lru" and r["slots"] == 16
    assert r["hit_rate"] == pytest.approx(r["hits"] / (r["hits"] + r["misses"]))
    assert r["host_bytes"] == r["misses"] * 12288       # the trace's expert_bytes
    assert ferry.replay(trace, "lru", 16, expert_bytes=100)["host_bytes"] == r["misses"] * 100
    with pytest.raises(FerryError) as e:
        ferry.replay(tmp_path / "missing.jsonl", "lru", 16)
    assert "missing.jsonl" in str(e.value)


def test_replay_without_slots_takes_the_clis_default_budget(tmp_path):
    """replay(path) named no slots: the default 0 was refused (EINVAL,
    "slots 0"). Now it is `ferry moe replay`'s: 25% of the trace's
    layers x experts (the small model: 4 x 16 -> 16)."""
    trace = _trace(tmp_path)
    r = ferry.replay(str(trace))
    assert r["slots"] == 16 and r["policy"] == "auto"
    assert r == {**ferry.replay(str(trace), slots=16), "ns_per_step": r["ns_per_step"]}
    with pytest.raises(FerryError) as e:
        ferry.replay(str(trace), slots=0)                 # named 0: refused
    assert e.value.code == -errno.EINVAL
