"""The vLLM connector's own cost per request, beyond the copies (issue 22's
goal: <= 50 us): the scheduler's lookup (get_num_new_matched_tokens,
update_state_after_alloc), the step's metadata (build_connector_meta), the
worker's load (bind, start_load_kv, load errors, clear) and the finish
(request_finished), through the stand-ins of python/tests/test_adapter_vllm.py
(vLLM's call order), the tiny Llama's caches and an in-process store.

    PYTHONPATH=python:python/tests /usr/bin/python3 bench/vllm_connector.py [--requests 2000]

Prints the median microseconds of a request that misses (no copy at all)
and of one that loads a 32-token prefix (two chunks of a few KiB: the copies
are a few microseconds of it), and the same with store.retrieve alone for
the hit, so the difference is the connector's.
"""
import argparse
import statistics
import time

import ferry
from test_adapter_vllm import CHUNK, NAME, Engine, Request, prompts, serve_a
from tiny_llama import TinyLlama
from ferry.adapters import unregister_store


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=2000)
    n = ap.parse_args().requests
    model = TinyLlama(seed=4321)
    lay = ferry.Layout.from_model(model.layers, model.kv_heads, model.head_dim, dtype="f32")
    store = ferry.KVStore("tiny-llama", lay, l1=64 * CHUNK * lay.token_bytes, chunk_tokens=CHUNK)
    eng = Engine(model, store)
    serve_a(eng)
    _, b = prompts()
    miss_tokens = list(range(1000, 1064))

    def one(tokens, i):
        r = Request(f"r{i}", tokens)
        t0 = time.perf_counter()
        eng.admit(r)
        eng.load_only(r)
        eng.sched.request_finished(r, eng.blocks[r.request_id])
        t = time.perf_counter() - t0
        eng.finished.add(r.request_id)
        eng.free.extend(eng.blocks.pop(r.request_id))
        return t * 1e6

    for _ in range(50):  # warm
        one(miss_tokens, "w")
    miss = [one(miss_tokens, i) for i in range(n)]
    hit = [one(b, n + i) for i in range(n)]
    caches, table = eng.caches, list(range(16))
    ret = []
    for _ in range(n):
        t0 = time.perf_counter()
        store.retrieve(b[:32], caches, table)
        ret.append((time.perf_counter() - t0) * 1e6)
    m, h, r = statistics.median(miss), statistics.median(hit), statistics.median(ret)
    print(f"vllm_connector: {n} requests each, tiny Llama ({model.layers} layers), in process")
    print(f"  a miss (no copy):                  {m:7.1f} us per request")
    print(f"  a 32-token hit:                    {h:7.1f} us per request")
    print(f"  store.retrieve of that prefix:     {r:7.1f} us")
    print(f"  the connector beyond the retrieve: {h - r:7.1f} us")
    eng.close()
    unregister_store(NAME)
    store.close()


if __name__ == "__main__":
    main()
