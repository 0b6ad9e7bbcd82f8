"""Six threads calling a KVStore at random, as a careless engine might:
blocking and async stores and retrieves (some cancelled, some freed
unwaited), layerwise ones (some abandoned before their last layer),
lookups, prefetches, deletes, clears, flushes, stats, and now and then a
close of the store under everyone's feet and a fresh one in its place; in
process and through a `ferry serve` daemon.

What must hold: nothing crashes or hangs, every failure is a FerryError
(a closed store, a locked chunk, a cancel, no slot), and every retrieve
that reports k tokens holds exactly the bytes stored for those k tokens
(each prompt's KV is a function of its tokens, so any other request's
bytes, or torn ones, show).
"""
import random
import threading
import time

import pytest
import torch

import ferry
from ferry import FerryError
from test_server import Daemon

LAY = ferry.Layout(num_layers=2, num_heads=2, head_dim=64, dtype="bf16")
CT = 16
SECONDS = 8.0


@pytest.fixture(scope="module", params=["local", "server"])
def opener(request, tmp_path_factory):
    if request.param == "local":
        yield lambda: ferry.KVStore("chaos", LAY, l1="2M", chunk_tokens=CT, pool_wait_ms=200)
        return
    d = Daemon(str(tmp_path_factory.mktemp("chaos"))).start()
    yield lambda: ferry.KVStore("tiny", LAY, server=d.url, chunk_tokens=CT,
                                server_timeout_ms=5000, pool_wait_ms=200)
    d.stop()


def prompt(pid, n):
    return [pid * 1000 + i for i in range(n)]


def kv_of(tokens):
    """[layers, 2, tokens, heads, head_dim], a function of each token"""
    t = torch.tensor(tokens, dtype=torch.float32).view(1, 1, -1, 1, 1)
    lay = torch.arange(2, dtype=torch.float32).view(2, 1, 1, 1, 1)
    kvx = torch.arange(2, dtype=torch.float32).view(1, 2, 1, 1, 1)
    h = torch.arange(2, dtype=torch.float32).view(1, 1, 1, 2, 1)
    d = torch.arange(64, dtype=torch.float32).view(1, 1, 1, 1, 64)
    return ((t % 512) * 0.25 + lay * 3 + kvx * 7 + h * 11 + d * 0.125).to(torch.bfloat16)


def test_random_calls_from_threads_never_crash_or_return_wrong_bytes(opener):
    store = [opener()]
    swap = threading.Lock()
    wrong, odd = [], []
    retrieved = [0]
    stop = time.monotonic() + SECONDS

    def check(tokens, dst, k, what):
        if k > 0:
            retrieved[0] += 1
            if not torch.equal(dst[:, :, :k], kv_of(tokens[:k])):
                wrong.append(f"{what} of prompt {tokens[0] // 1000}: {k} tokens not as stored")

    def one(s, rng):
        tokens = prompt(rng.randrange(12), rng.choice([16, 20, 32, 48, 64]))
        n = len(tokens)
        op = rng.randrange(13)
        if op == 0:
            s.store(tokens, kv_of(tokens))
        elif op == 1:
            dst = torch.zeros(2, 2, n, 2, 64, dtype=torch.bfloat16)
            check(tokens, dst, s.retrieve(tokens, dst), "retrieve")
        elif op == 2:
            s.lookup(tokens)
        elif op == 3:
            o = s.store_async(tokens, kv_of(tokens))
            if rng.random() < 0.3:
                o.cancel()
            if rng.random() < 0.5:
                try:
                    o.wait()
                finally:
                    o.free()
            else:
                o.free()
        elif op == 4:
            dst = torch.zeros(2, 2, n, 2, 64, dtype=torch.bfloat16)
            o = s.retrieve_async(tokens, dst)
            try:
                if rng.random() < 0.2:
                    o.cancel()
                    o.wait()
                else:
                    check(tokens, dst, o.wait(), "retrieve_async")
            finally:
                o.free()
        elif op == 5:
            s.delete(tokens)
        elif op == 6 and rng.random() < 0.05:
            s.clear()
        elif op == 7:
            s.flush()
            s.stats()
        elif op == 8:
            dst = torch.zeros(2, 2, n, 2, 64, dtype=torch.bfloat16)
            o = s.retrieve_layers(tokens, dst)
            try:
                o.wait_layer(1)
                o.wait_layer(0)
                check(tokens, dst, o.wait(), "retrieve_layers")
            finally:
                o.free()
        elif op == 9:
            o = s.store_layers(tokens, kv_of(tokens))
            try:
                for layer in range(2):
                    if rng.random() < 0.1:
                        break                       # abandoned: nothing of it commits
                    o.layer_done(layer)
                else:
                    o.wait()
            finally:
                o.free()
        elif op == 10:
            s.prefetch(tokens)
        elif op == 11 and rng.random() < 0.03:
            with swap:
                old, store[0] = store[0], opener()
            old.close()                             # under the other threads' calls

    def worker(i):
        rng = random.Random(1000 + i)
        while time.monotonic() < stop and not wrong and not odd:
            try:
                one(store[0], rng)
            except FerryError:
                pass                                # closed, locked, cancelled, no slot
            except BaseException as e:              # anything else is the finding
                odd.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=SECONDS + 60)
    hung = [t for t in threads if t.is_alive()]
    store[0].close()
    assert not hung, f"{len(hung)} threads still inside a call {SECONDS + 60:.0f} s later"
    assert not odd, odd[:3]
    assert not wrong, wrong[:3]
    assert retrieved[0] > 20, "the run retrieved almost nothing: it tested little"
