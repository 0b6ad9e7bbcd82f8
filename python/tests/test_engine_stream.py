"""The engine's CUDA stream in the layerwise calls (LayerOp.wait_layer and
layer_done into / from CUDA tensors) is the store's: imported on the store's
device once and destroyed by its close(). So the lookup and the C call that
uses the stream run inside the store's call guard: a close() from another
thread waits for them, and a closed store answers FerryError (EBADF) before
any lookup, never a freed device or stream.

There is no GPU here: the store runs on the "host" backend, and the test
makes the op a CUDA one (its _cuda flag, the store's DeviceMem kind) and
fakes torch.cuda.current_stream and the stream import (a real stream of the
host device, created by ferry_stream_create, which close() destroys), so
the path runs end to end through the C calls.
"""
import ctypes
import errno
import threading

import pytest
import torch

import ferry
import ferry.kv as kvmod
from ferry import FerryError
from ferry._buffers import DeviceMem

CHUNK = 16
TOKENS = torch.arange(32)
HANDLE = 0x5151


def layout():
    return ferry.Layout(num_layers=3, num_heads=2, head_dim=8, dtype="f32")


def on_device(s, t):
    d = s.device_empty(t.shape, t.dtype)
    d.copy_(t)
    return d


class FakeStream:
    cuda_stream = HANDLE


@pytest.fixture
def cuda_store(monkeypatch):
    """(store, make(kind) -> LayerOp on 'device' memory made a CUDA op, log)."""
    lay = layout()
    s = ferry.KVStore("engine-stream", lay, l1=64 * CHUNK * lay.token_bytes, chunk_tokens=CHUNK,
                      device="host")
    src_cpu = torch.randn(2, 3, 32, 16, generator=torch.Generator().manual_seed(3))
    src = on_device(s, src_cpu)
    assert s.store(TOKENS, src) == 32
    dst = on_device(s, torch.zeros_like(src_cpu))
    log = {"getter": [], "imports": 0}
    getter_hook = []   # an extra action inside the stream getter

    def current_stream(ordinal=None):
        log["getter"].append(bool(s._guard._inside))   # is a call inside the store?
        for f in getter_hook:
            f()
        return FakeStream()

    create = kvmod.lib["ferry_stream_create"]   # a function object of our own
    create.restype = ctypes.c_int
    create.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]

    def stream_import(dev, handle, out):
        assert handle == HANDLE
        log["imports"] += 1
        return create(dev, out)   # an owned stream of the host device: close destroys it

    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(kvmod.lib, "ferry_stream_import", stream_import)

    def make(kind):
        op = s.retrieve_layers(TOKENS, dst) if kind == "retrieve" else \
            s.store_layers(TOKENS + 1000, src)
        op._cuda = True
        s._devmem = DeviceMem("cuda", 0)   # (after device_empty: its tensors are made)
        return op

    try:
        yield s, make, log, getter_hook
    finally:
        s.close()


def test_the_stream_is_looked_up_inside_the_store_guard(cuda_store):
    s, make, log, _ = cuda_store
    op = make("retrieve")
    for layer in range(3):
        assert op.wait_layer(layer) == 32
    assert op.wait() == 32
    st = make("store")
    for layer in range(3):
        st.layer_done(layer)
    assert st.wait() == 32
    assert log["getter"] == [True] * 6      # every lookup with the call inside the store
    assert log["imports"] == 1              # imported once, kept by the store


@pytest.mark.parametrize("kind", ["retrieve", "store"])
def test_a_close_racing_the_lookup_waits_for_the_call(cuda_store, kind):
    s, make, log, hook = cuda_store
    op = make(kind)
    closer = threading.Thread(target=s.close)
    waited = []

    def race():   # close from another thread while this thread looks the stream up
        if not closer.is_alive() and not waited:
            closer.start()
            closer.join(0.3)
            waited.append(closer.is_alive())   # close must wait for the call inside
    hook.append(race)
    if kind == "retrieve":
        assert op.wait_layer(0) == 32
    else:
        op.layer_done(0)                     # the stream and the device are still open
    closer.join(10)
    assert not closer.is_alive()
    assert waited == [True]
    assert log["imports"] == 1
    # the store is closed now: the next call refuses before any lookup
    n = len(log["getter"])
    with pytest.raises(FerryError) as e:
        op.wait_layer(1) if kind == "retrieve" else op.layer_done(1)
    assert e.value.code == -errno.EBADF and "closed" in e.value.message
    assert len(log["getter"]) == n


@pytest.mark.parametrize("kind", ["retrieve", "store"])
def test_a_closed_store_refuses_the_stream_calls_with_ebadf(cuda_store, kind):
    s, make, log, _ = cuda_store
    op = make(kind)
    s.close()
    with pytest.raises(FerryError) as e:
        op.wait_layer(0) if kind == "retrieve" else op.layer_done(0)
    assert e.value.code == -errno.EBADF and "the store is closed" in e.value.message
    assert log["getter"] == [] and log["imports"] == 0
    op.free()
