"""The SGLang backend's page gets against memcpy, and exists of 1, 8 and 64
keys, in one run (issue 23's goals: batch_get_v1 of 64 pages from L1 >=
0.9x memcpy of the same bytes; exists of one key <= 2 us in process).

    PYTHONPATH=python:python/tests /usr/bin/python3 bench/sglang_pages.py \
        [--layout page_first] [--page 16] [--layers 8] [--rounds 7]

The host pool is a stand-in with SGLang's buffer shapes (python/tests/
sglang_pools.py); the store is in process. memcpy is torch's copy_ of one
contiguous tensor of the same bytes, alternated with the gets.
"""
import argparse
import statistics
import time

import torch

from ferry.adapters import unregister_store
from sglang_pools import Controller, MHAHost, create_backend, fill, indices, page_hashes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", default="page_first")
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    pool = MHAHost(a.layout, page=a.page, layers=a.layers, heads=a.heads, head_dim=a.head_dim,
                   pages=2 * a.pages + 2)
    page_bytes = 2 * a.layers * a.page * a.heads * a.head_dim * 2
    total = page_bytes * a.pages
    l1 = f"{(3 * total) >> 20}M"
    b = create_backend({"ferry_l1": l1, "ferry_store": "bench"}, {"kv": pool})
    fill(pool.kv_buffer, 1)
    ctl = Controller(b, pool, True)
    hashes = page_hashes(list(range(a.pages * a.page)), a.page)
    assert ctl.backup(hashes, indices(0, a.pages, a.page)) == a.pages
    dst = indices(a.pages + 1, a.pages, a.page)
    src_t = torch.empty(total, dtype=torch.uint8)
    dst_t = torch.empty(total, dtype=torch.uint8)
    src_t.fill_(1)
    dst_t.fill_(2)
    gets, cps = [], []
    for _ in range(a.rounds):
        t0 = time.perf_counter()
        ok = b.batch_get_v1(hashes, dst, None)
        t1 = time.perf_counter()
        assert all(ok)
        dst_t.copy_(src_t)
        t2 = time.perf_counter()
        gets.append(total / (t1 - t0) / 1e9)
        cps.append(total / (t2 - t1) / 1e9)
    exists = {}
    for k in sorted({1, min(8, a.pages), min(64, a.pages)}):   # k held keys, median of 5 loops
        keys = hashes[:k]
        assert b.batch_exists(keys, None) == k
        n = max(1, 20000 // k)
        loops = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(n):
                b.batch_exists(keys, None)
            loops.append((time.perf_counter() - t0) / n * 1e6)
        exists[k] = statistics.median(loops)
    g, c = statistics.median(gets), statistics.median(cps)
    print(f"sglang_pages: {a.layout}, {a.pages} pages of {page_bytes >> 10} KiB "
          f"({total >> 20} MiB), {a.rounds} rounds")
    print(f"  batch_get_v1 {g:.2f} GB/s, memcpy {c:.2f} GB/s: {g / c:.3f}x "
          f"(rounds {min(gets):.2f}-{max(gets):.2f} GB/s)")
    print(f"  batch_exists of one key: {exists[1]:.2f} us")
    print("  batch_exists per key: " + ", ".join(f"{k} keys {us / k:.3f} us ({us:.2f} a call)"
                                                for k, us in exists.items()))
    b.close()
    s = unregister_store("bench")
    if s is not None:
        s.close()


if __name__ == "__main__":
    main()
