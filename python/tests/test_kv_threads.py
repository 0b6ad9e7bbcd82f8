"""KVStore as an engine team misuses it in its first hour, in process and
through a `ferry serve` daemon (test_misuse.py, test_first_hour*.py cover
close races, ids, moved buffers and a rewritten block table):

- salts of odd types: an int tenant id is refused, not turned into that
  many zero bytes (salt=0 read the unsalted tenant's chunks, salt=3 the
  chunks of salt b"\\0\\0\\0"); bytearray and memoryview salts work on
  every call, the named ones too;
- wait(timeout=) and wait_layer(timeout=) past what C's int of
  milliseconds holds (a "forever" of 1e9 s, inf) wait, they do not time
  out at once or raise OverflowError;
- a retrieve's skip past 2^64-1 is refused, not wrapped onto a small skip
  that writes the engine's prefix;
- a name given twice in one store_named is refused (ValueError naming it),
  not stored once with the other chunk's bytes dropped (ELOCKED);
- a reversed (negative-stride) NumPy cache is refused with its strides
  signed, not as 2^64 - 4096.
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


@pytest.fixture(scope="module", params=["local", "server"])
def url(request, tmp_path_factory):
    if request.param == "local":
        yield ""
        return
    d = Daemon(str(tmp_path_factory.mktemp("kvthreads"))).start()
    yield d.url
    d.stop()


def open_store(url, **kw):
    if url:
        return ferry.KVStore("kvthreads", LAY, server=url, chunk_tokens=16,
                             server_timeout_ms=5000, **kw)
    return ferry.KVStore("kvthreads", LAY, l1="16M", chunk_tokens=16, **kw)


@pytest.fixture
def s(url):
    st = open_store(url)
    st.clear()
    yield st
    st.close()


def kv(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, n, 128, generator=g).to(torch.bfloat16)


# -- salts --

@pytest.mark.parametrize("salt", [0, 3, True, 2.5, [1, 2], np.int64(7)])
def test_a_salt_that_is_not_str_or_bytes_is_refused(s, salt):
    # bytes(3) is b"\0\0\0": an int tenant id was the salt of 3 zero bytes,
    # and tenant 0 the unsalted tenant, whose chunks it then read
    toks = np.arange(32, dtype=np.int32)
    s.store(toks, kv(32))                       # an unsalted tenant's chunks
    for call in (lambda: s.lookup(toks, salt=salt),
                 lambda: s.retrieve(toks, torch.zeros(2, 2, 32, 128, dtype=torch.bfloat16),
                                    salt=salt),
                 lambda: s.store(toks + 100, kv(32), salt=salt),
                 lambda: s.lookup_named([b"page"], salt=salt),
                 lambda: s.store_named([b"page"], kv(16), salt=salt)):
        with pytest.raises(TypeError, match="salt"):
            call()
    assert s.lookup(toks + 100) == 0 and s.lookup(toks + 100, salt=b"\0\0\0") == 0


def test_bytes_like_salts_work_on_every_call(s):
    # bytearray and memoryview are bytes: the same tenant as the bytes,
    # on the named calls too (whose per-salt cache needs a hashable key)
    toks = np.arange(32, dtype=np.int32) + 7000
    x = kv(32, 1)
    assert s.store(toks, x, salt=bytearray(b"tenant")) == 32
    assert s.lookup(toks, salt=b"tenant") == 32 and s.lookup(toks) == 0
    assert s.store_named([b"p0", b"p1"], x, salt=memoryview(b"tenant")) == 2
    assert s.lookup_named([b"p0", b"p1"], salt=bytearray(b"tenant")) == 2
    assert s.lookup_named([b"p0"], salt=memoryview(b"tenant")) == 1
    assert s.lookup_named([b"p0"], salt="tenant") == 1 and s.lookup_named([b"p0"]) == 0
    y = torch.zeros_like(x)
    assert s.retrieve_named([b"p0", b"p1"], y, salt=bytearray(b"tenant")) == 2
    assert torch.equal(x, y)
    assert s.delete_named([b"p0"], salt=bytearray(b"tenant")) == 1


# -- timeouts past C's int of milliseconds --

def test_wait_with_a_timeout_past_an_int_of_milliseconds_waits():
    # a store_async waiting for L1 slots that layerwise stores hold: it
    # ends only when they are done, from another thread half a second on
    s = ferry.KVStore("kvthreads-wait", LAY, l1="2M", chunk_tokens=16, pool_wait_ms=20000)
    x = kv(512)
    try:
        for to in (4294967.297, 1e9, float("inf")):
            hold = []
            for i in range(4):                  # a quarter of L1 each: all of it
                op = s.store_layers(np.arange(512, dtype=np.int32) + 1000 * i, x)
                op.layer_done(0)
                hold.append(op)
            op = s.store_async(np.arange(512, dtype=np.int32) + 99999, x)

            def release():
                time.sleep(0.5)
                for h in hold:
                    h.layer_done(1)
            th = threading.Thread(target=release)
            th.start()
            t0 = time.monotonic()
            assert op.wait(timeout=to) == 512, to
            assert time.monotonic() - t0 >= 0.4, to
            th.join()
            assert [h.wait() for h in hold] == [512] * 4
            s.clear()
        op = s.store_async(np.arange(32, dtype=np.int32) + 5, x[:, :, :32].contiguous())
        with pytest.raises(ValueError, match="timeout"):
            op.wait(timeout=float("nan"))
        assert op.wait() == 32
        lop = s.retrieve_layers(np.arange(32, dtype=np.int32) + 5, torch.zeros(2, 2, 32, 128,
                                                                               dtype=torch.bfloat16))
        assert lop.wait_layer(1, timeout=float("inf")) == 32
        assert lop.wait(timeout=1e12) == 32
    finally:
        s.close()


# -- skip past what the request's uint64 holds --

@pytest.mark.parametrize("skip", [2**64, 2**64 + 5, 2**70])
def test_a_skip_past_uint64_writes_nothing_below_it(s, skip):
    # "nothing below skip is written": ctypes kept skip's low 64 bits, so
    # 2**64 was 0 and the engine's whole prefix was overwritten
    toks = np.arange(64, dtype=np.int32) + 3
    x = kv(64, 2)
    assert s.store(toks, x) == 64
    for call in (lambda y: s.retrieve(toks, y, skip=skip),
                 lambda y: s.retrieve_async(toks, y, skip=skip).wait(),
                 lambda y: s.retrieve_layers(toks, y, skip=skip).wait()):
        y = torch.full_like(x, 7.0)
        with pytest.raises(FerryError) as e:
            call(y)
        assert e.value.code == -errno.EINVAL and "skip" in str(e.value)
        assert bool((y == 7.0).all())
    for bad in (1.5, True, "3"):
        with pytest.raises(TypeError, match="skip"):
            s.retrieve(toks, torch.zeros_like(x), skip=bad)


# -- an op freed by one thread, waited on by another --

def test_a_freed_op_answers_its_result(s):
    # free() waits for the op (C's ferry_kv_op_free does); a wait, done,
    # cancel or wait_layer after it answers from that end ("later calls
    # answer from its result"), not EINVAL "freed before it finished"
    x = kv(1024, 3)
    toks = np.arange(1024, dtype=np.int32) + 20000
    op = s.store_async(toks, x)
    op.free()
    assert op.done() and op.wait() == 1024 and op.cancel() is False
    assert s.lookup(toks) == 1024
    y = torch.zeros_like(x)
    rop = s.retrieve_layers(toks, y)
    rop.free()
    assert rop.wait_layer(1) == 1024 and rop.wait() == 1024 and torch.equal(x, y)
    lop = s.store_layers(toks + 5000, x)
    lop.layer_done(0)
    lop.free()                                  # lacking layer 1: abandoned
    for call in (lop.wait, lambda: lop.layer_done(1)):
        with pytest.raises(FerryError) as e:
            call()
        assert e.value.code == -errno.ECANCELED
    assert s.lookup(toks + 5000) == 0


def test_an_op_waited_on_while_another_thread_frees_it(s):
    x = kv(2048, 4)
    got, bad = [], []
    for r in range(40):
        toks = np.arange(2048, dtype=np.int32) + 30000 * (r + 1)
        op = s.store_async(toks, x)
        go = threading.Barrier(2)

        def waiter():
            go.wait()
            try:
                got.append(op.wait())
            except Exception as e:      # any exception is the finding
                bad.append(repr(e))

        th = threading.Thread(target=waiter)
        th.start()
        go.wait()
        op.free()
        th.join()
    assert not bad and got == [2048] * 40, (bad[:3], got)


# -- close while an op waits for slots unfinished layerwise stores hold --

def test_close_gives_back_a_lacking_layerwise_stores_slots_first():
    # four layerwise stores lacking their last layer hold all of L1; a
    # store_async another thread waits on (a call inside the store, which
    # close waits for) needs a slot (pool_wait_ms 20 s). close() begins the
    # store's close first (ferry_kv_close_begin), which ends the op's wait
    # for a slot (ECANCELED), and ferry_kv_close abandons those stores
    # before it waits; the op, woken, may find their slots free already
    # and store. Either way close returns at once (test_kv_close.py: a
    # blocking store waiting so ends ECANCELED).
    s = ferry.KVStore("kvthreads-close", LAY, l1="2M", chunk_tokens=16, pool_wait_ms=20000)
    x = kv(512)
    hold = []
    for i in range(4):
        op = s.store_layers(np.arange(512, dtype=np.int32) + 1000 * i, x)
        op.layer_done(0)
        hold.append(op)
    res = []

    def wait():
        try:
            res.append(op.wait())
        except FerryError as e:
            res.append(e.code)
    op = s.store_async(np.arange(512, dtype=np.int32) + 99999, x)
    th = threading.Thread(target=wait)
    th.start()
    time.sleep(0.3)                            # it waits for a slot
    t0 = time.monotonic()
    s.close()
    took = time.monotonic() - t0
    th.join()
    assert res in ([512], [-errno.ECANCELED]) and took < 5, (res, took)
    for h in hold:
        with pytest.raises(FerryError) as e:
            h.wait()
        assert e.value.code == -errno.ECANCELED


def test_wait_with_a_negative_infinite_or_huge_timeout():
    # -inf is a negative timeout (a test, as -1 s is); an int of seconds
    # past what a float holds is forever, as inf is
    s = ferry.KVStore("kvthreads-wait-inf", LAY, l1="2M", chunk_tokens=16)
    x = kv(512)
    try:
        lop = s.store_layers(np.arange(64, dtype=np.int32) + 7, x[:, :, :64].contiguous())
        lop.layer_done(0)
        with pytest.raises(FerryError):      # lacks a layer: the wait is refused at once
            lop.wait(timeout=-float("inf"))
        lop.layer_done(1)
        assert lop.wait(timeout=10**400) == 64
        rop = s.retrieve_layers(np.arange(64, dtype=np.int32) + 7,
                                torch.zeros(2, 2, 64, 128, dtype=torch.bfloat16))
        assert rop.wait_layer(1, timeout=10**400) == 64
        # the op ends once its chunks were let go, which may follow the last
        # layer's landing (kv.h): a test then is done or still running
        try:
            n = rop.wait(timeout=-float("inf"))
        except TimeoutError:
            n = rop.wait(timeout=10**400)
        assert n == 64
        assert rop.wait(timeout=-float("inf")) == 64     # ended: answers from its end
        op = s.store_async(np.arange(32, dtype=np.int32) + 5, x[:, :, :32].contiguous())
        assert op.wait(timeout=10**400) == 32
    finally:
        s.close()


# -- a name twice in one store_named; a reversed cache's strides --

def test_a_name_given_twice_in_one_store_named_is_refused(s):
    # the second chunk under one name was skipped FERRY_ELOCKED (the call's
    # own first chunk "being written by another writer"), its bytes dropped
    x = kv(48, 5)
    with pytest.raises(ValueError, match=r"name b'p0' is given twice, for chunks 0 and 2"):
        s.store_named(["p0", b"p1", b"p0"], x)
    assert s.lookup_named([b"p0"]) == 0 and s.lookup_named([b"p1"]) == 0   # nothing stored
    assert s.store_named([b"p0", b"p1", b"p2"], x) == 3
    y = torch.zeros(2, 2, 32, 128, dtype=torch.bfloat16)
    assert s.retrieve_named([b"p2", b"p2"], y) == 2      # loading one twice is fine
    assert torch.equal(y[:, :, :16], x[:, :, 32:]) and torch.equal(y[:, :, 16:], x[:, :, 32:])


def test_a_reversed_paged_cache_names_its_strides_signed():
    # a view with blocks reversed has a negative block stride: C took it as
    # uint64 and said "block 18446744073709547520"
    caches = [np.zeros((2, 8, 16, 2, 64), np.float16)[:, ::-1] for _ in range(2)]
    lay = ferry.Layout(num_layers=2, num_heads=2, head_dim=64, dtype="f16")
    st = ferry.KVStore("kvthreads-rev", lay, l1="2M", chunk_tokens=16)
    try:
        with pytest.raises(ValueError) as e:
            st.store(np.arange(32, dtype=np.int32), caches, [0, 1])
        assert "block -4096" in str(e.value) and "18446744" not in str(e.value)
        assert st.lookup(np.arange(32, dtype=np.int32)) == 0
    finally:
        st.close()
