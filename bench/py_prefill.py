#!/usr/bin/env python3
"""Prefill time saved by ferry against recompute, for growing cached prefixes.

A Llama-style decoder (python/tests/tiny_llama.py; default 8 layers, dim
512, 8 heads, 4 KV heads, float32, on the CPU) prefills a prompt of
--tokens tokens in two ways, alternating, --rounds times each:
  recompute: the whole prompt from nothing;
  ferry:     retrieve the cached prefix (P tokens) from a KVStore into the
             paged cache, then prefill only the remaining tokens.
For each prefix P it prints the medians and the time saved as a ratio
(recompute / ferry). The logits of both are checked to agree (the ferry
path's prefix KV is bitwise what the stored prefill produced).

usage: bench/py_prefill.py [--tokens 512] [--chunk 64] [--rounds 3]
       [--layers 4] [--dim 256] [--threads 1] [--l2 DIR]   (with --l2: an L2-only retrieve,
       the store reopened on a persistent L2 so every chunk comes from disk)
needs: PYTHONPATH=python, libferry (FERRY_LIB or build/), torch, numpy
"""
import argparse
import os
import statistics
import sys
import time

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "python"))
sys.path.insert(0, os.path.join(here, "..", "python", "tests"))

import torch  # noqa: E402

import ferry  # noqa: E402
from tiny_llama import TinyLlama  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--l2", default=None)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    m = TinyLlama(vocab=4096, dim=a.dim, layers=a.layers, heads=8, kv_heads=4, ffn=4 * a.dim,
                  seed=7)
    lay = ferry.Layout.from_model(m.layers, m.kv_heads, m.head_dim, dtype="f32")
    blocks = a.tokens // a.block + 1
    table = list(range(blocks))
    prompt = torch.randint(0, m.vocab, (a.tokens,), generator=torch.Generator().manual_seed(1))
    nbytes = a.tokens * lay.token_bytes
    kw = dict(l1=max(4 * nbytes, 64 << 20), chunk_tokens=a.chunk)
    if a.l2:
        kw.update(l2=f"{a.l2}:{8 * nbytes + (64 << 20)}", persistent=True, reset=True)
    store = ferry.KVStore("bench", lay, **kw)
    src = m.new_caches(blocks, a.block)
    full_logits = m.forward(prompt, 0, src, table)
    store.store(prompt, src, table)
    if a.l2:
        store.sync()
        store.close()
        kw["reset"] = False
        store = ferry.KVStore("bench", lay, **kw)
        l1_only = kw.copy()
    print(f"model: {a.layers} layers, dim {a.dim}; prompt {a.tokens} tokens, "
          f"KV {nbytes / 2**20:.1f} MiB; chunks of {a.chunk}; prefix from "
          f"{'L2 (persistent, reopened; evicted from L1 before each round)' if a.l2 else 'L1'}")
    print(f"{'prefix':>7} {'recompute ms':>13} {'ferry ms':>9} {'retrieve ms':>12} {'saved':>7}")
    prefixes = sorted({int(a.tokens * f) // a.chunk * a.chunk for f in (0, .25, .5, .75, .9375)})
    for p in prefixes:
        rec, fer, ret = [], [], []
        for _ in range(a.rounds):
            t0 = time.perf_counter()
            m.forward(prompt, 0, m.new_caches(blocks, a.block), table)
            rec.append(time.perf_counter() - t0)
            dst = m.new_caches(blocks, a.block)
            if a.l2 and p:
                store.close()  # drop L1: the prefix comes from the drive
                store = ferry.KVStore("bench", lay, **l1_only)
            t0 = time.perf_counter()
            got = store.retrieve(prompt[:p], dst, table) if p else 0
            t1 = time.perf_counter()
            assert got == p, f"retrieved {got} of {p}"
            logits = m.forward(prompt[p:], p, dst, table)
            fer.append(time.perf_counter() - t0)
            ret.append(t1 - t0)
            torch.testing.assert_close(logits, full_logits[p:], rtol=1e-3, atol=1e-4)
        r, f, t = (statistics.median(x) * 1e3 for x in (rec, fer, ret))
        print(f"{p:>7} {r:>13.1f} {f:>9.1f} {t:>12.2f} {r / f:>6.2f}x")
    store.close()


if __name__ == "__main__":
    main()
