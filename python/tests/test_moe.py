"""The expert pool on a real computation: a small MoE model whose experts
live in ferry's slots (filled by the planner and executor from host rows,
and from a file) gives outputs bitwise equal to all experts resident; the
planner's hints protect and prefetch by their confidence."""
import subprocess

import numpy as np
import pytest
import torch

import ferry
from ferry import FerryError
from ferry.moe import ExpertPool

LAYERS, EXPERTS, TOPK, DIM, FFN = 2, 8, 2, 32, 48


class TinyMoE:
    """LAYERS MoE blocks (router, top-2, SwiGLU-free expert MLP) with seeded weights."""

    def __init__(self, seed=3):
        g = torch.Generator().manual_seed(seed)
        self.w1 = torch.randn(LAYERS, EXPERTS, FFN, DIM, generator=g) / DIM ** 0.5
        self.w2 = torch.randn(LAYERS, EXPERTS, DIM, FFN, generator=g) / FFN ** 0.5
        self.router = torch.randn(LAYERS, EXPERTS, DIM, generator=g)

    def forward(self, x, weights_of):
        """x [T, DIM]; weights_of(layer, experts) -> [(w1, w2)] for those experts.
        Tokens go one by one (decode), so each step needs TOPK experts."""
        routes = []
        for layer in range(LAYERS):
            out = torch.empty_like(x)
            for t in range(x.shape[0]):
                logits = self.router[layer] @ x[t]
                w, ex = torch.topk(logits, TOPK)
                w = torch.softmax(w, dim=0)
                routes.append((layer, ex.tolist()))
                y = torch.zeros(DIM)
                for k, (w1, w2) in enumerate(weights_of(layer, ex.tolist())):
                    y = y + w[k] * (w2 @ torch.relu(w1 @ x[t]))
                out[t] = x[t] + y
            x = out
        return x, routes


@pytest.fixture(scope="module")
def moe():
    return TinyMoE()


def banks(m):
    # bank 0: every expert's w1, bank 1: its w2; rows packed [layer][expert]
    return [m.w1.reshape(LAYERS, EXPERTS, -1).contiguous(),
            m.w2.reshape(LAYERS, EXPERTS, -1).contiguous()]


def run_through_pool(m, pool, x):
    w1s = pool.slot_tensor(0, torch.float32, (FFN, DIM))
    w2s = pool.slot_tensor(1, torch.float32, (DIM, FFN))

    def weights_of(layer, experts):
        slots = pool.ensure(layer, experts)
        return [(w1s[s], w2s[s]) for s in slots]
    return m.forward(x, weights_of)


def resident(m):
    return lambda layer, experts: [(m.w1[layer, e], m.w2[layer, e]) for e in experts]


def tokens(n=24):
    return torch.randn(n, DIM, generator=torch.Generator().manual_seed(11))


@pytest.mark.parametrize("policy", ["lru", "routing", "s3fifo", "auto"])
def test_outputs_equal_all_experts_resident_from_host_rows(moe, policy):
    x = tokens()
    want, routes = moe.forward(x, resident(moe))
    with ExpertPool(LAYERS, EXPERTS, slots=5, banks=banks(moe), policy=policy) as pool:
        got, routes2 = run_through_pool(moe, pool, x)
        assert routes2 == routes
        assert torch.equal(got, want)
        pool.check()
        st = pool.stats()
        assert st["misses"] > 0 and st["hits"] > 0 and st["evictions"] > 0  # 5 of 16 fit
        assert pool.policy == policy


def test_outputs_equal_all_experts_resident_from_a_file(moe, tmp_path):
    x = tokens(12)
    want, _ = moe.forward(x, resident(moe))
    b = banks(moe)
    path = tmp_path / "experts.bin"
    with open(path, "wb") as f:  # bank after bank, each packed [layer][expert]
        for bank in b:
            f.write(bank.numpy().tobytes())
    row_bytes = [bank[0, 0].numel() * 4 for bank in b]
    with ExpertPool(LAYERS, EXPERTS, slots=4, rows_file=str(path), row_bytes=row_bytes) as pool:
        got, _ = run_through_pool(moe, pool, x)
        assert torch.equal(got, want)
        pool.check()


def test_only_missing_rows_move(moe):
    with ExpertPool(LAYERS, EXPERTS, slots=4, banks=banks(moe)) as pool:
        pool.ensure(0, [1, 2])
        assert pool.last_counts["fetched"] == 2
        pool.ensure(0, [2, 1])
        assert pool.last_counts["fetched"] == 0
        pool.ensure(1, [1, 2])  # other layer: other experts
        assert pool.last_counts["fetched"] == 2
        pool.ensure(0, [3, 4])  # evicts the least recent two
        assert pool.last_counts["fetched"] == 2 and pool.stats()["evictions"] == 2


def test_bad_input_is_refused(moe, tmp_path):
    b = banks(moe)
    with pytest.raises(ValueError):
        ExpertPool(LAYERS, EXPERTS, 4, banks=[b[0][:, :, :5].contiguous()[:, :, :3]])  # not contiguous
    with pytest.raises(ValueError):
        ExpertPool(LAYERS, EXPERTS, 4)  # no rows source
    with pytest.raises(FerryError):
        ExpertPool(LAYERS, EXPERTS, 4, banks=b, policy="nonsense")
    short = tmp_path / "short.bin"
    short.write_bytes(b"\0" * 100)
    with pytest.raises(FerryError) as e:
        ExpertPool(LAYERS, EXPERTS, 4, rows_file=str(short), row_bytes=[FFN * DIM * 4])
    assert e.value.name == "FERRY_EMISMATCH"
    with ExpertPool(LAYERS, EXPERTS, 4, banks=b) as pool:
        with pytest.raises(FerryError):
            pool.ensure(LAYERS, [0])  # no such layer
        with pytest.raises(FerryError):
            pool.ensure(0, [EXPERTS])  # no such expert
        with pytest.raises(IndexError):
            pool.slot_tensor(2)


def test_replay_a_generated_trace(tmp_path):
    import os
    cli = os.environ.get("FERRY_CLI") or os.path.join(os.path.dirname(__file__), "..", "..",
                                                      "build", "ferry")
    trace = tmp_path / "t.jsonl"
    subprocess.run([cli, "moe", "gen", "--model", "small", "--tokens", "64", "-o", str(trace)],
                   check=True, capture_output=True)
    lru = ferry.replay(str(trace), "lru", 64)
    bel = ferry.replay(str(trace), "belady", 64)
    assert lru["steps"] > 0 and lru["policy"] == "lru"
    assert ferry.replay(str(trace), slots=64)["policy"] == "auto"  # the library's default
    assert bel["hit_rate"] >= lru["hit_rate"]  # hindsight is never worse
    assert "routing" in ferry.policies()


def test_planner_hints_protect_until_their_step():
    with ferry.Planner(1, 16, 4, policy="lru") as p:
        for e in range(4):
            p.ensure(0, [e])
        assert p.hint(0, 4, [0], 1.0) == 1
        for e in (4, 5, 6):  # strangers: LRU's victim would be 0 each time
            p.ensure(0, [e])
            assert p.lookup(0, 0) is not None
        slots, plan = p.ensure(0, [0])
        assert plan["dst_slots"] == [] and p.last_counts["missing"] == 0
        h = p.hint_stats()
        assert (h["hinted"], h["right"], h["wrong"], h["live"]) == (1, 1, 0, 0)
        assert h["saves"] >= 1


def test_hint_prefetch_scales_with_confidence():
    with ferry.Planner(2, 8, 4, policy="lru") as p:
        for e in range(4):
            p.ensure(0, [e])
        p.hint(1, 1, [5], 0.45)  # wrong more often than right: no row
        assert p.hint_prefetch(8)["src_rows"] == []
        p.hint(1, 1, [6], 0.95)  # sure: worth a victim's slot
        plan = p.hint_prefetch(8)
        assert plan["layer"] == 1 and plan["src_rows"] == [6]
        assert p.lookup(1, 6) == plan["dst_slots"][0]
        assert p.hint_stats()["fetched"] == 1
        assert p.stats()["prefetch_fetched"] == 1


def test_pool_hint_prefetch_copies_the_rows(moe):
    b = banks(moe)
    with ExpertPool(LAYERS, EXPERTS, slots=6, banks=b, policy="lru") as pool:
        pool.ensure(0, [1, 2])
        assert pool.hint(1, 1, [3, 4], confidence=0.9) == 2
        assert pool.hint_prefetch(max_rows=4) == 2
        slots = pool.ensure(1, [3, 4])
        assert pool.last_counts["missing"] == 0 and pool.last_counts["prefetch_hits"] == 2
        w1s = pool.slot_tensor(0, torch.float32, (FFN, DIM))
        for s, e in zip(slots, (3, 4)):
            assert torch.equal(w1s[s], moe.w1[1, e])
        pool.check()
        h = pool.hint_stats()
        assert h["right"] == 2 and h["fetched"] == 2 and h["wrong"] == 0


def test_bad_hints_are_refused():
    with ferry.Planner(2, 8, 4) as p:
        for bad in [dict(layer=2, steps_ahead=1, experts=[0], confidence=1.0),
                    dict(layer=0, steps_ahead=0, experts=[0], confidence=1.0),
                    dict(layer=0, steps_ahead=1, experts=[8], confidence=1.0),
                    dict(layer=0, steps_ahead=1, experts=[0], confidence=1.5),
                    dict(layer=0, steps_ahead=1, experts=[], confidence=0.5)]:
            with pytest.raises(FerryError) as e:
                p.hint(**bad)
            assert e.value.name == "EINVAL"
        assert p.hint_stats()["hinted"] == 0
    p = ferry.Planner(1, 4, 2)
    p.close()
    with pytest.raises(FerryError):
        p.hint(0, 1, [0])
