"""close() while another thread is inside a blocking store or retrieve that
waits for an L1 slot (back-pressure, pool_wait_ms), in process and through
a `ferry serve` daemon: close begins the store's close first
(ferry_kv_close_begin), so the waiting call ends at once with a FerryError
(ECANCELED) naming the close, and close returns in milliseconds instead of
after pool_wait_ms. What was stored before stays whole: a fresh store reads
it back bit for bit.
"""
import errno
import threading
import time

import numpy as np
import pytest
import torch

import ferry
from ferry import FerryError
from test_server import Daemon

LAY = ferry.Layout(num_layers=2, num_heads=2, head_dim=64, dtype="bf16")
CT = 16                       # tokens a chunk: 16 KiB chunks of this layout
WAIT_MS = 20000               # pool_wait_ms: what close() used to wait out
SLOTS = 8                     # the pool's chunks


def kv(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, n, 128, generator=g).to(torch.bfloat16)


@pytest.fixture(params=["local", "server"])
def backend(request, tmp_path):
    """A function opening a store with pool_wait_ms WAIT_MS on a pool of
    SLOTS chunks, and one that opens a fresh store over the same chunks."""
    if request.param == "local":
        l2 = f"{tmp_path}/l2:4M"

        def open_store(**kw):
            return ferry.KVStore("kvclose", LAY, l1=SLOTS * CT * 1024, l2=l2, persistent=True,
                                 chunk_tokens=CT, **kw)
        open_store.kind = "local"
        yield open_store
        return
    (tmp_path / "l2").mkdir()
    d = Daemon(str(tmp_path), l2=f"{tmp_path}/l2:4M")  # evicted chunks stay findable
    d.args[d.args.index("--l1") + 1] = str(SLOTS * CT * 1024)
    d.start()

    def open_client(**kw):
        return ferry.KVStore("tiny", LAY, server=d.url, chunk_tokens=CT, server_timeout_ms=5000,
                             **kw)
    open_client.kind = "server"
    yield open_client
    d.stop()


def holder_of(backend, s):
    """The store that pins the pool full: s itself in process; through a
    daemon another client (a connection that holds slots never waits for
    more: the daemon declines at once)."""
    return s if backend.kind == "local" else backend(pool_wait_ms=WAIT_MS)


def fill_and_pin(s, base=7, seed=1):
    """Store and pin chunks filling the whole pool: every slot read-locked.
    In two halves, the first pinned before the second is stored: a store
    that fills the pool at once crosses the eviction watermark (0.8) at its
    seventh chunk and moves to L2 whichever of its first chunks finished
    their write-through by then (under load, some do), and a pin of a
    chunk in L2 holds no L1 slot, so the pool was not full after all."""
    toks = np.arange(SLOTS * CT, dtype=np.int32) + base
    x = kv(SLOTS * CT, seed)
    half = SLOTS // 2 * CT
    assert s.store(toks[:half], x[:, :, :half].contiguous()) == half
    s.flush()                                   # written through: nothing else holds a slot
    assert s.pin(toks[:half]) == half
    assert s.store(toks, x) == SLOTS * CT       # the rest: one batch, none of it evictable
    s.flush()
    assert s.pin(toks) == SLOTS * CT
    s.unpin(toks[:half])                        # (pinned twice: once, as the rest)
    assert s.stats()["tier"]["l1"]["chunks"] == SLOTS, s.stats()["tier"]["l1"]
    return toks, x


def blocked_call(s, call):
    """call() on another thread, once it waits for a slot; what it raised.
    s: the store whose stats count the wait (through a daemon, another
    client: a client makes one call at a time, so the waiting one's
    stats() would wait behind its call)."""
    out = []

    def run():
        try:
            out.append(call())
        except BaseException as e:              # any exception is the finding
            out.append(e)
    th = threading.Thread(target=run)
    waits0 = s.stats()["pool_waits"]
    th.start()
    t0 = time.monotonic()
    while s.stats()["pool_waits"] == waits0 and th.is_alive() and time.monotonic() - t0 < 30:
        time.sleep(0.01)
    assert s.stats()["pool_waits"] > waits0, \
        f"the call never waited for a slot: {'it returned ' + repr(out) if out else 'none after 30 s'}"
    time.sleep(0.1)                             # well inside its wait
    return th, out


@pytest.mark.parametrize("what", ["store", "retrieve"])
def test_close_ends_a_call_waiting_for_a_slot_at_once(backend, what):
    s = backend(pool_wait_ms=WAIT_MS)
    h = holder_of(backend, s)
    toks, x = fill_and_pin(h)
    other = np.arange(4 * CT, dtype=np.int32) + 100000
    if what == "store":
        th, out = blocked_call(h, lambda: s.store(other, kv(4 * CT, 2)))
        y = None
    else:
        # chunks evicted to L2 only: a retrieve needs a slot to promote
        # them into, and every slot is pinned by other chunks
        y = torch.full((2, 2, 4 * CT, 128), 3.0, dtype=torch.bfloat16)
        h.unpin(toks)
        fill_and_pin(h, 50000, 3)               # evicts the first into L2 only
        th, out = blocked_call(h, lambda: s.retrieve(toks[:4 * CT], y))
    t0 = time.monotonic()
    s.close()
    took = time.monotonic() - t0
    th.join(timeout=30)
    assert not th.is_alive(), "the call still waits after close"
    assert took < 1.0, f"close took {took:.2f} s (pool_wait_ms {WAIT_MS})"
    assert len(out) == 1 and isinstance(out[0], FerryError), out
    assert out[0].code == -errno.ECANCELED and "clos" in str(out[0]), out[0]
    if y is not None:                           # nothing torn: untouched or zeroed
        assert bool(((y == 3.0) | (y == 0)).all())
    h.close()                                   # (through a daemon: its pins go)
    f = backend(pool_wait_ms=WAIT_MS)           # what was stored before is whole
    try:
        got = torch.zeros_like(x)
        assert f.retrieve(toks, got) == SLOTS * CT
        assert torch.equal(got, x)
        if what == "store":                     # nothing of the woken store half-made
            assert f.lookup(other) == 0
    finally:
        f.close()


def test_close_begins_before_it_waits_and_refuses_new_calls(backend):
    s = backend(pool_wait_ms=WAIT_MS)
    h = holder_of(backend, s)
    toks, _ = fill_and_pin(h)
    th, out = blocked_call(h, lambda: s.store(toks + 100000, kv(SLOTS * CT, 2)))
    closer = threading.Thread(target=s.close)
    t0 = time.monotonic()
    closer.start()
    closer.join(timeout=30)
    s.close()                                   # again: returns once released
    assert time.monotonic() - t0 < 1.0
    th.join(timeout=30)
    assert isinstance(out[0], FerryError) and out[0].code == -errno.ECANCELED
    with pytest.raises(FerryError) as e:
        s.lookup(toks)
    assert e.value.code == -errno.EBADF
    h.close()
