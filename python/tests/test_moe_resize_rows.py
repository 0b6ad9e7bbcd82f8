"""Planner.resize: the slot budget changed under a running planner, as
ferry_moe_planner_resize does in C: growing adds free slots, shrinking
drops the experts of the slots cut off (they miss at their next ensure),
bad budgets are refused naming them, a closed planner refuses. And a
rows_file that is a directory is refused when the pool is made."""
import pytest

import ferry
from ferry import FerryError


@pytest.mark.parametrize("policy", ["lru", "auto", "transition"])
def test_shrink_drops_the_cut_slots_and_grow_adds_free_ones(policy):
    with ferry.Planner(2, 8, 6, policy=policy) as p:
        slots, plan = p.ensure(0, [0, 1, 2])
        slots2, _ = p.ensure(1, [3, 4, 5])
        assert sorted(slots + slots2) == list(range(6))
        held = {(0, e): s for e, s in zip([0, 1, 2], slots)}
        held.update({(1, e): s for e, s in zip([3, 4, 5], slots2)})
        cut = [k for k, s in held.items() if s >= 3]
        assert p.resize(3) == len(cut) == 3
        assert p.slots == 3
        for (layer, e), s in held.items():
            assert p.lookup(layer, e) == (None if s >= 3 else s)
        # the cut experts miss again; every slot the planner names is below 3
        layer, e = cut[0]
        got, plan = p.ensure(layer, [e])
        assert got[0] < 3 and plan["dst_slots"] == [got[0]]
        assert p.resize(5) == 0 and p.slots == 5
        got, plan = p.ensure(1 - layer, [7])
        assert got[0] < 5 and p.lookup(1 - layer, 7) == got[0]


def test_bad_budgets_are_refused_and_change_nothing():
    with ferry.Planner(1, 8, 4, policy="lru") as p:
        p.ensure(0, [0, 1, 2, 3])
        for bad in (0, (1 << 24) + 1):   # the C range: 1 .. 2^24
            with pytest.raises(FerryError) as e:
                p.resize(bad)
            assert "resize" in str(e.value)
        for bad in (-1, 2 ** 32 + 4):    # never wrapped onto a valid budget
            with pytest.raises(FerryError) as e:
                p.resize(bad)
            assert "slots" in str(e.value)
        for bad in ("4", 2.0, None):
            with pytest.raises(TypeError):
                p.resize(bad)
        assert p.slots == 4
        assert [p.lookup(0, e) is not None for e in range(4)] == [True] * 4
    with pytest.raises(FerryError):
        p.resize(4)


def test_a_directory_as_rows_file_is_refused_at_creation(tmp_path):
    """A directory opens for reading, and (a small geometry: under its
    4 KiB size) passed the size check, so the pool was made and its first
    ensure() failed; now the pool is refused when made, naming it."""
    from ferry.moe import ExpertPool
    with pytest.raises(FerryError) as e:
        ExpertPool(1, 4, 2, rows_file=str(tmp_path), row_bytes=[64])
    assert "a directory" in str(e.value) and str(tmp_path) in str(e.value)
