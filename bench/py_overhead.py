#!/usr/bin/env python3
"""What the Python package adds to ferry_kv calls: the same calls from C
(build/kv_calls) and through ferry.KVStore, alternately, in one run.

Lookup of a --lookup-tokens prompt (an int32 NumPy array, and a Python
list, which the package converts) whose first --chunks chunks are cached;
store and retrieve of --chunks chunks (32 MiB each, Llama-3-8B) from and
into torch tensors. Prints per round and the medians: the microseconds
Python adds to a lookup, and store/retrieve GB/s through Python as a
ratio to C's.

usage: bench/py_overhead.py [--build build] [--rounds 5] [--chunks 8]
       [--lookup-tokens 32768] [--iters 200]
goals (issue 14): <= 5 us added per lookup; store and retrieve >= 0.95x C.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "python"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import ferry  # noqa: E402


def py_round(store, tok, tok_list, ntok, src, dst, iters):
    def med(fn, k):
        ts = []
        for _ in range(k):
            t0 = time.perf_counter_ns()
            fn()
            ts.append(time.perf_counter_ns() - t0)
        return statistics.median(ts)
    look = med(lambda: store.lookup(tok), iters)
    look_list = med(lambda: store.lookup(tok_list), max(10, iters // 10))
    sts = []
    for _ in range(5):
        store.delete(tok[:ntok])
        t0 = time.perf_counter_ns()
        assert store.store(tok[:ntok], src) == ntok
        sts.append(time.perf_counter_ns() - t0)
    rt = med(lambda: store.retrieve(tok[:ntok], dst), 5)
    nbytes = src.numel() * src.element_size()
    return dict(lookup_ns=look, lookup_list_ns=look_list, store_gbs=nbytes / statistics.median(sts),
                retrieve_gbs=nbytes / rt)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--lookup-tokens", type=int, default=32768)
    ap.add_argument("--iters", type=int, default=200)
    a = ap.parse_args()
    os.environ.setdefault("FERRY_LIB", os.path.join(a.build, "libferry.so.0"))
    lay = ferry.Layout(32, 8, 128, "bf16")
    ntok = a.chunks * 256
    tok = (np.arange(a.lookup_tokens, dtype=np.int32) * 7 + 1)
    tok_list = tok.tolist()
    src = torch.full((2, 32, ntok, 1024), 1.0, dtype=torch.bfloat16)
    dst = torch.zeros_like(src)
    cmd = [os.path.join(a.build, "kv_calls"), "--chunks", str(a.chunks), "--lookup-tokens",
           str(a.lookup_tokens), "--iters", str(a.iters), "--rounds", "1"]
    rows = []
    with ferry.KVStore("bench", lay, l1=2 * a.chunks * (32 << 20)) as store:
        store.store(tok[:ntok], src)
        for r in range(a.rounds):
            c = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
            p = py_round(store, tok, tok_list, ntok, src, dst, a.iters)
            assert torch.equal(dst, src)
            row = dict(lookup_added_us=(p["lookup_ns"] - c["lookup_ns"]) / 1e3,
                       lookup_list_added_us=(p["lookup_list_ns"] - c["lookup_ns"]) / 1e3,
                       store_ratio=p["store_gbs"] / c["store_gbs"],
                       retrieve_ratio=p["retrieve_gbs"] / c["retrieve_gbs"],
                       c=c, py=p)
            rows.append(row)
            print(f"round {r + 1}: lookup C {c['lookup_ns'] / 1e3:.1f} us, +{row['lookup_added_us']:.1f} us "
                  f"from Python (+{row['lookup_list_added_us']:.0f} us for a list); store "
                  f"{p['store_gbs']:.2f}/{c['store_gbs']:.2f} GB/s = {row['store_ratio']:.2f}x, retrieve "
                  f"{p['retrieve_gbs']:.2f}/{c['retrieve_gbs']:.2f} GB/s = {row['retrieve_ratio']:.2f}x")
    med = {k: statistics.median(r[k] for r in rows)
           for k in ("lookup_added_us", "lookup_list_added_us", "store_ratio", "retrieve_ratio")}
    print(f"median of {a.rounds}: lookup +{med['lookup_added_us']:.1f} us (goal <= 5), "
          f"list +{med['lookup_list_added_us']:.0f} us; store {med['store_ratio']:.2f}x, "
          f"retrieve {med['retrieve_ratio']:.2f}x of C (goal >= 0.95)")


if __name__ == "__main__":
    main()
