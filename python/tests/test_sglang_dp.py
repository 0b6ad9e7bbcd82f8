"""SGLang's data-parallel replicas on one host, each with an in-process
store under one "ferry_l2" directory.

With --dp-size N (no attention DP) SGLang's DataParallelController starts
one scheduler process per TP rank of each replica, on the same host
(sgl-project/sglang fdd9edee7a8faeaeeef5d0f77af7a673b4c06297,
python/sglang/srt/managers/data_parallel_controller.py:
launch_tensor_parallel_group starts run_scheduler_process(..., tp_rank,
dp_rank, ...) for every tp_rank of every dp_rank), and every one builds
its backend from the same extra config. The storage config does not tell the
replicas apart: HiCacheStorageConfig's dp_rank / dp_size are filled by
attention DP only, "plain --dp-size replicas all report 0"
(sgl-project/sglang 001067fffe33427bee0ed2f007fb7551a1d76b44,
python/sglang/srt/mem_cache/hicache_storage.py; older configs have no such
field). So every replica's TP rank r names the same directory, and a
directory has one owner. The replicas are copies of one model with one TP
layout: a page one replica's TP rank r stored is valid for another's TP
rank r, so a replica that finds its rank's directory owned takes the next
of a bounded series, and a restart may find another replica's pages:
exact bytes, of the same TP rank only (the directory names it, and the
page names carry it in their salt). Pools are the stand-ins of
tests/sglang_pools.py."""
import os
import subprocess
import sys

import pytest
import torch

from ferry import errors
from ferry.adapters import sglang, unregister_store
from ferry.errors import FerryError
from sglang_pools import MHAHost, create_backend, fill, indices, page_hashes

HERE = os.path.dirname(os.path.abspath(__file__))
NAMES = [f"{r}{s}" for r in ("a", "b", "c", "d") for s in ("", "-t0", "-t1")]


@pytest.fixture(autouse=True)
def _clean():
    yield
    for n in NAMES:
        s = unregister_store(n)
        if s is not None:
            s.close()


def replica(l2, name, tp=(0, 1), persistent=False):
    """One DP replica's TP rank: its own process in SGLang, its own
    registry name here (each opens its own store), one extra config."""
    pools = {"kv": MHAHost("page_first", 4)}
    b = create_backend({"ferry_store": name, "ferry_l1": "2M", "ferry_l2": l2,
                        "ferry_persistent": persistent}, pools, tp=tp)
    return b, pools["kv"]


def dirs(tmp_path):
    return sorted(p for p in os.listdir(tmp_path) if os.path.isdir(tmp_path / p))


_CHILD = r"""
import sys, torch
sys.path[:0] = [{py!r}, {tests!r}]
from sglang_pools import MHAHost, create_backend, fill, indices, page_hashes
pool = MHAHost("page_first", 4)
b = create_backend({{"ferry_l1": "2M", "ferry_l2": {l2!r}}}, {{"kv": pool}})
fill(pool.kv_buffer, 7)
h = page_hashes(list(range(100, 108)), 4)
assert b.batch_set_v1(h, indices(0, 2, 4)) == [True, True]
want = pool.kv_buffer[:, 0:8].clone()
print("ready", flush=True)
sys.stdin.readline()
assert b.batch_get_v1(h, indices(4, 2, 4)) == [True, True]
assert torch.equal(pool.kv_buffer[:, 16:24], want)
b.close()
print("done", flush=True)
"""


def test_two_dp_replicas_start_on_one_host(tmp_path):
    """Two processes open backends with identical storage configs, as two
    plain DP replicas' TP rank 0 do: both start (the second used to fail
    with FERRY_EBUSY, the directory being the first's), each stores its
    pages and reads back exact bytes while the other runs."""
    l2 = f"{tmp_path}:16M"
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD.format(py=os.path.dirname(HERE), tests=HERE, l2=l2)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready", child.stderr.read()
        b, pool = replica(l2, "a")           # the same config: FERRY_EBUSY before the fix
        fill(pool.kv_buffer, 8)
        h = page_hashes(list(range(200, 208)), 4)
        assert b.batch_set_v1(h, indices(0, 2, 4)) == [True, True]
        want = pool.kv_buffer[:, 0:8].clone()
        assert b.batch_get_v1(h, indices(4, 2, 4)) == [True, True]
        assert torch.equal(pool.kv_buffer[:, 16:24], want)
        assert dirs(tmp_path) == ["kv-pp0of1-dp0of1-cp0of1-tp0of1",
                                  "kv-pp0of1-dp0of1-cp0of1-tp0of1.1"]
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "done", child.stderr.read()
        assert child.wait(timeout=60) == 0
        b.close()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_replicas_that_swap_directories_on_restart_read_exact_bytes(tmp_path):
    """Two replicas at TP 2, persistent: replica A's ranks open first and
    take the rank directories, B's the next ones. Each stores its own
    prompt, each TP rank its own bytes. After a restart B opens first and
    takes A's directories: B's TP rank r finds A's prompt with A's TP rank
    r's bytes exactly (never the other rank's), and A, now in B's old
    directories, finds B's prompt the same way."""
    l2 = f"{tmp_path}:16M"
    ha, hb = page_hashes(list(range(8)), 4), page_hashes(list(range(50, 58)), 4)

    def open_replica(r):
        return [replica(l2, f"{r}-t{t}", tp=(t, 2), persistent=True) for t in range(2)]

    a, b = open_replica("a"), open_replica("b")
    want = {}
    for r, ranks, h in (("a", a, ha), ("b", b, hb)):
        for t, (be, pool) in enumerate(ranks):
            fill(pool.kv_buffer, 10 * (r == "b") + t)
            assert be.batch_set_v1(h, indices(0, 2, 4)) == [True, True]
            be._pools["kv"][1].sync()
            want[r, t] = pool.kv_buffer[:, 0:8].clone()
            be.close()
    assert not torch.equal(want["a", 0], want["a", 1])
    b, a = open_replica("b"), open_replica("a")      # the other order: directories swap
    for r, ranks, h, other in (("b", b, ha, "a"), ("a", a, hb, "b")):
        for t, (be, pool) in enumerate(ranks):
            pool.kv_buffer.zero_()
            assert be.batch_exists(h) == 2
            assert be.batch_get_v1(h, indices(4, 2, 4)) == [True, True]
            assert torch.equal(pool.kv_buffer[:, 16:24], want[other, t])
            be.close()


def test_a_tp_ranks_l2_under_another_ranks_name_is_never_read(tmp_path):
    """The series never crosses TP ranks (each rank's names carry it), and
    even a directory moved under another rank's name gives that rank no
    page: the page names are salted with the TP rank."""
    l2 = f"{tmp_path}:16M"
    b1, pool = replica(l2, "a-t1", tp=(1, 2), persistent=True)
    fill(pool.kv_buffer, 3)
    h = page_hashes(list(range(8)), 4)
    assert b1.batch_set_v1(h, indices(0, 2, 4)) == [True, True]
    b1._pools["kv"][1].sync()
    b1.close()
    os.rename(tmp_path / "kv-pp0of1-dp0of1-cp0of1-tp1of2",
              tmp_path / "kv-pp0of1-dp0of1-cp0of1-tp0of2")
    b0, pool = replica(l2, "a-t0", tp=(0, 2), persistent=True)
    assert b0.batch_exists(h) == 0
    assert b0.batch_get_v1(h, indices(4, 2, 4)) == [False, False]
    assert not pool.kv_buffer.any()
    b0.close()


def test_more_replicas_than_the_series_are_refused_naming_it(tmp_path, monkeypatch):
    """Past the series' last directory a replica is refused at start, with
    FERRY_EBUSY naming the limit and every directory tried."""
    monkeypatch.setattr(sglang, "_L2_REPLICAS", 3)
    l2 = f"{tmp_path}:16M"
    opened = [replica(l2, n)[0] for n in ("a", "b", "c")]
    with pytest.raises(FerryError) as e:
        replica(l2, "d")
    assert e.value.code == errors.EBUSY
    msg = str(e.value)
    assert "3" in msg and "kv-pp0of1-dp0of1-cp0of1-tp0of1.2" in msg
    assert os.path.join(str(tmp_path), "kv-pp0of1-dp0of1-cp0of1-tp0of1") in msg
    assert len(dirs(tmp_path)) == 3
    for b in opened:
        b.close()


def test_a_pools_l2_under_another_pools_name_is_never_read(tmp_path):
    """A persistent L2's header names the model and the page layout, not
    the pool: a draft model's MHA pages can have the kv pool's layout
    exactly, and a directory of the series may be found under another
    name (a replica's, a pool's moved by hand). The page names are salted
    with the pool, so the kv pool reads none of the draft pool's pages:
    misses, its host pool untouched; they are in its store, under the
    draft pool's salt only (the test is not vacuous)."""
    l2 = f"{tmp_path}:16M"

    def open_both():
        pools = {"kv": MHAHost("page_first", 4), "draft": MHAHost("page_first", 4)}
        return create_backend({"ferry_store": "a", "ferry_l1": "2M", "ferry_l2": l2,
                               "ferry_persistent": True}, pools), pools

    b, pools = open_both()
    fill(pools["draft"].kv_buffer, 5)
    h = page_hashes(list(range(8)), 4)
    t = sglang.PoolTransfer(name=sglang.PoolName.DRAFT, host_indices=indices(0, 2, 4), keys=h)
    assert b.batch_set_v2([t]) == {sglang.PoolName.DRAFT: [True, True]}
    b._pools["draft"][1].sync()
    b.close()
    rank = "pp0of1-dp0of1-cp0of1-tp0of1"
    os.rename(tmp_path / f"kv-{rank}", tmp_path / "kv-old")
    os.rename(tmp_path / f"draft-{rank}", tmp_path / f"kv-{rank}")
    b, pools = open_both()
    assert b.batch_exists(h) == 0
    assert b.batch_get_v1(h, indices(4, 2, 4)) == [False, False]
    assert not pools["kv"].kv_buffer.any()
    names = [k.encode() for k in h]
    assert b._pools["kv"][1].lookup_named(names, salt=b._salts("draft")[0]) == 2
    b.close()
