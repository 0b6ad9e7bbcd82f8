"""KVStore(device=...): tensors in device memory as FERRY_KV_MEM_DEVICE buffers.

Without a GPU the store runs on ferry's "host" backend, whose device
pointers are host addresses: KVStore.device_empty() allocates through
ferry_device_alloc and views the memory as a CPU tensor, so every device
path (device <-> L1 copies on the backend's streams, paged device blocks,
layerwise events) runs end to end and is compared bitwise. With
FERRY_TEST_DEVICE=cuda:0 (bench/gpu.sh, where a GPU is present) the same
tests run on CUDA tensors. Through `ferry serve` the client maps the
daemon's pool and moves device buffers the same way (host backend).
"""
import os

import pytest
import torch

import ferry
from ferry._buffers import Buffer, DeviceMem

CHUNK = 16
DEVICE = os.environ.get("FERRY_TEST_DEVICE", "host")
if DEVICE.startswith("cuda") and not torch.cuda.is_available():
    pytest.skip(f"FERRY_TEST_DEVICE={DEVICE} but torch sees no CUDA device",
                allow_module_level=True)


def layout():
    return ferry.Layout(num_layers=3, num_heads=2, head_dim=8, dtype="f32")


def open_store(lay, device=DEVICE):
    return ferry.KVStore("dev-model", lay, l1=64 * CHUNK * lay.token_bytes, chunk_tokens=CHUNK,
                         device=device)


def on_device(s, t):
    """A copy of CPU tensor t in the store's device memory."""
    d = s.device_empty(t.shape, t.dtype)
    d.copy_(t)
    return d


def device_counts(s):
    st = s.stats()
    return st["device_chunks"], st["device_copy_calls"]


class FakeCuda(torch.Tensor):
    """A CPU tensor that reports a CUDA device: the device checks run before
    any byte moves, so they are testable without a GPU."""
    index = 1

    @property
    def device(self):
        return torch.device("cuda", self.index)


def fake_cuda(t, index):
    f = t.as_subclass(FakeCuda)
    f.index = index
    return f


def test_contiguous_device_round_trip_bitwise():
    lay = layout()
    src_cpu = torch.randn(2, 3, 64, 16, generator=torch.Generator().manual_seed(3))
    tokens = torch.arange(500, 564)
    with open_store(lay) as s:
        assert s.device == DEVICE
        src = on_device(s, src_cpu)
        assert s.store(tokens, src) == 64
        chunks, calls = device_counts(s)
        assert chunks == 4 and calls > 0          # the device path, not a host memcpy
        dst = on_device(s, torch.zeros_like(src_cpu))
        assert s.retrieve(tokens, dst) == 64
        assert torch.equal(dst.cpu(), src_cpu)
        assert device_counts(s)[0] == 8
        host = torch.zeros_like(src_cpu)          # a CPU tensor stays a host buffer
        assert s.retrieve(tokens, host) == 64
        assert torch.equal(host, src_cpu)
        assert device_counts(s)[0] == 8


def test_paged_vllm_device_round_trip_into_other_blocks():
    lay = layout()
    bs, nb = 4, 40
    g = torch.Generator().manual_seed(11)
    src_cpu = [torch.randn(2, nb, bs, 2, 8, generator=g) for _ in range(3)]
    t_src = torch.tensor([5, 9, 1, 30, 2, 3, 17, 11, 12, 13, 14, 15], dtype=torch.int32)
    t_dst = torch.tensor([0, 4, 6, 7, 8, 10, 16, 18, 19, 20, 21, 22], dtype=torch.int32)
    tokens = torch.arange(1000, 1048)
    with open_store(lay) as s:
        src = [on_device(s, c) for c in src_cpu]
        assert s.store(tokens, src, t_src) == 48
        dst = [on_device(s, torch.zeros_like(c)) for c in src_cpu]
        assert s.retrieve(tokens, dst, t_dst) == 48
        assert device_counts(s)[0] == 6
        for a, b in zip(src_cpu, dst):
            b = b.cpu()
            for i in range(12):
                assert torch.equal(b[:, int(t_dst[i])], a[:, int(t_src[i])])
            untouched = sorted(set(range(nb)) - set(t_dst.tolist()))
            assert torch.count_nonzero(b[:, untouched]) == 0


def test_layerwise_device_store_and_retrieve():
    lay = layout()
    src_cpu = torch.randn(2, 3, 32, 16, generator=torch.Generator().manual_seed(5))
    tokens = torch.arange(7, 39)
    with open_store(lay) as s:
        src = on_device(s, src_cpu)
        op = s.store_layers(tokens, src)
        for layer in range(3):
            op.layer_done(layer)
        assert op.wait() == 32
        chunks, calls = device_counts(s)
        assert chunks == 2 and calls > 0          # layer_done copied from device memory
        dst = on_device(s, torch.zeros_like(src_cpu))
        op = s.retrieve_layers(tokens, dst)
        for layer in range(3):
            assert op.wait_layer(layer) == 32
        assert op.wait() == 32
        if DEVICE.startswith("cuda"):
            torch.cuda.current_stream().synchronize()
        assert torch.equal(dst.cpu(), src_cpu)
        assert device_counts(s)[0] > chunks       # the layers came into device memory


def test_async_device_round_trip():
    lay = layout()
    src_cpu = torch.randn(2, 3, 32, 16, generator=torch.Generator().manual_seed(9))
    tokens = torch.arange(32)
    with open_store(lay) as s:
        src = on_device(s, src_cpu)
        assert s.store_async(tokens, src).wait() == 32
        dst = on_device(s, torch.zeros_like(src_cpu))
        assert s.retrieve_async(tokens, dst).wait() == 32
        assert torch.equal(dst.cpu(), src_cpu)


# ---- bad input ----

def test_cuda_tensor_on_a_store_without_a_device():
    lay = layout()
    with ferry.KVStore("m", lay, l1=64 * CHUNK * lay.token_bytes, chunk_tokens=CHUNK) as s:
        t = fake_cuda(torch.zeros(2, 3, 32, 16), 1)
        with pytest.raises(ValueError, match=r"cuda:1 needs a store opened with "
                                             r"device='cuda:1'; this store has no device"):
            s.store(range(32), t)
        with pytest.raises(ValueError, match="device_empty needs a store opened with device="):
            s.device_empty((4,), torch.float32)


def test_cuda_tensor_on_a_host_backend_store():
    lay = layout()
    with open_store(lay, "host") as s:
        t = fake_cuda(torch.zeros(2, 3, 32, 16), 0)
        with pytest.raises(ValueError, match=r"cuda:0 needs a store .* device 'host'"):
            s.retrieve(range(32), t)


def test_cuda_tensor_on_another_ordinal_names_both():
    lay = layout()
    t = fake_cuda(torch.zeros(2, 3, 32, 16), 1)
    with pytest.raises(ValueError, match=r"cuda:1 given to a store on cuda:0"):
        Buffer(lay, t, dev=DeviceMem("cuda", 0))
    caches = [fake_cuda(torch.zeros(2, 4, 4, 2, 8), 1) for _ in range(3)]
    with pytest.raises(ValueError, match=r"cuda:1 given to a store on cuda:0"):
        Buffer(lay, caches, [0], dev=DeviceMem("cuda", 0))
    ok = Buffer(lay, fake_cuda(torch.zeros(2, 3, 32, 16), 0), dev=DeviceMem("cuda", 0))
    assert ok.c.mem == 1 and ok.device          # a CUDA tensor is FERRY_KV_MEM_DEVICE


def test_other_torch_devices_refused():
    lay = layout()
    with pytest.raises(ValueError, match="meta cannot be a KV buffer"):
        Buffer(lay, torch.empty(2, 3, 32, 16, device="meta"), dev=DeviceMem("host"))


def test_bad_device_strings():
    lay = layout()
    for bad in ("gpu:0", "cuda:x", "cpu"):
        with pytest.raises(ValueError, match="device is 'cuda:N' or 'host'"):
            open_store(lay, bad)


def test_device_tensor_shape_dtype_contiguity_checks():
    lay = layout()
    with open_store(lay) as s:
        nc = s.device_empty((2, 3, 16, 32), torch.float32).transpose(2, 3)
        with pytest.raises(ValueError, match="must be contiguous"):
            s.store(range(32), nc)
        f16 = s.device_empty((2, 3, 32, 16), torch.float16)
        with pytest.raises(ValueError, match="the tensor is f16, the layout.s dtype is f32"):
            s.store(range(32), f16)
        with pytest.raises(ValueError, match="a contiguous KV tensor is"):
            s.store(range(32), s.device_empty((2, 2, 32, 16), torch.float32))
        paged = [s.device_empty((2, 4, 4, 2, 8), torch.float32) for _ in range(2)]
        paged.append(torch.zeros(2, 4, 4, 2, 8))
        with pytest.raises(ValueError, match="layer 2 is host memory, layer 0 device"):
            s.store(range(16), paged, [0, 1, 2, 3])
        # heads 16 elements apart, each head_dim run contiguous: strides ferry reads
        strided = [s.device_empty((2, 4, 4, 2, 16), torch.float32)[..., :8] for _ in range(3)]
        assert s.store(range(16), strided, [0, 1, 2, 3]) == 16
        # a head_dim that is not contiguous is not
        gapped = [s.device_empty((2, 4, 4, 2, 16), torch.float32)[..., ::2] for _ in range(3)]
        with pytest.raises(ValueError, match="head_dim axis is not contiguous"):
            s.store(range(32, 48), gapped, [0, 1, 2, 3])


def test_device_buffers_through_ferry_serve(tmp_path):
    """A client of `ferry serve` on a device: its view of the daemon's pool is
    pinned through the device and device buffers move through it, bitwise."""
    if DEVICE != "host":
        pytest.skip("the daemon test runs on the host backend")
    from test_server import Daemon
    lay = ferry.Layout(num_layers=2, num_heads=2, head_dim=64, dtype="bf16")  # tiny preset
    d = Daemon(str(tmp_path)).start()
    try:
        src_cpu = torch.randn(2, 2, 48, 128, generator=torch.Generator().manual_seed(2)) \
            .to(torch.bfloat16)
        tokens = torch.arange(300, 348)
        with ferry.KVStore("tiny", lay, server=d.url, chunk_tokens=CHUNK, device=DEVICE,
                           server_timeout_ms=3000) as s:
            src = on_device(s, src_cpu)
            assert s._buffer(src, None, False).c.mem == 1   # FERRY_KV_MEM_DEVICE
            assert s.store(tokens, src) == 48
        with ferry.KVStore("tiny", lay, server=d.url, chunk_tokens=CHUNK, device=DEVICE,
                           server_timeout_ms=3000) as s:
            assert s.lookup(tokens) == 48
            dst = on_device(s, torch.zeros_like(src_cpu))
            assert s.retrieve(tokens, dst) == 48
            assert torch.equal(dst.cpu(), src_cpu)
    finally:
        d.stop()


def test_expert_pool_slot_tensor_on_the_device():
    """ExpertPool(device=DEVICE): slot_tensor views the slots where they are
    (a CPU tensor on "host", a CUDA tensor on cuda:N), and after each
    ensure() every returned slot holds exactly its expert's rows in every
    bank, as an engine reading the view sees them; the view outlives close()
    with the slots' last bytes."""
    L, E, S = 3, 8, 5
    g = torch.Generator().manual_seed(7)
    w = torch.randn(L, E, 4, 6, generator=g)                       # 96-byte rows
    v = torch.randint(-999, 999, (L, E, 10), generator=g, dtype=torch.int16)   # 20-byte rows
    steps = [(0, [1, 2]), (1, [2, 7, 7]), (2, [0, 1, 2, 3]), (0, [5, 6]), (1, [4, 3]),
             (0, [1, 6]), (2, [7, 6, 5])]
    with ferry.ExpertPool(L, E, S, [w, v], policy="lru", device=DEVICE) as pool:
        sw = pool.slot_tensor(0, torch.float32, (4, 6))
        sv = pool.slot_tensor(1, torch.int16)
        want = "cpu" if DEVICE == "host" else DEVICE
        assert str(sw.device) == want and str(sv.device) == want
        assert sw.shape == (S, 4, 6) and sv.shape == (S, 10)
        for layer, ex in steps:
            slots = pool.ensure(layer, ex)
            for e, s in zip(ex, slots):
                assert torch.equal(sw[s].cpu(), w[layer, e]), (layer, e, s)
                assert torch.equal(sv[s].cpu(), v[layer, e]), (layer, e, s)
        last = sw.cpu().clone()
    assert torch.equal(sw.cpu(), last)   # the memory stays with the view


def test_expert_pool_device_names():
    w = torch.zeros(2, 4, 8)
    for bad in ("gpu:0", "cuda:x", "cpu", "cuda:-1", torch.device("cpu")):
        with pytest.raises(ValueError, match="device is 'cuda:N' or 'host'"):
            ferry.ExpertPool(2, 4, 2, [w], device=bad)
    with pytest.raises(TypeError, match="device is a name"):
        ferry.ExpertPool(2, 4, 2, [w], device=0)
    if not torch.cuda.is_available():   # no GPU: the driver is refused, naming the device
        for dev in ("cuda:1", torch.device("cuda", 1)):
            with pytest.raises(ferry.FerryError, match="cuda:1"):
                ferry.ExpertPool(2, 4, 2, [w], device=dev)
    else:   # a GPU: an ordinal past the last is refused, naming it
        n = torch.cuda.device_count()
        with pytest.raises(ferry.FerryError, match=f"cuda:{n}"):
            ferry.ExpertPool(2, 4, 2, [w], device=f"cuda:{n}")


def test_cuda_slots_describe_the_slots():
    """What a CUDA pool's slot_tensor hands torch: the bank's first slot, the
    slots' stride and row bytes, read-write (torch keeps the object, which
    keeps the memory)."""
    from ferry.moe import _CudaSlots
    mem = object()
    c = _CudaSlots(0x7f0000001000, 5, 96, 128, mem)
    ai = c.__cuda_array_interface__
    assert ai["data"] == (0x7f0000001000, False)
    assert ai["shape"] == (5, 96) and ai["strides"] == (128, 1) and ai["typestr"] == "|u1"
    assert c._mem is mem


def test_cuda_without_an_index_is_torchs_current_device(monkeypatch):
    """"cuda" (or torch.device("cuda")) means torch's current device, as it
    does to torch: a tensor-parallel rank that called torch.cuda.set_device(3)
    gets GPU 3, not GPU 0."""
    from ferry._buffers import device_spec
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert device_spec("cuda") == ("cuda", 3)
    assert device_spec(torch.device("cuda")) == ("cuda", 3)
    assert device_spec("cuda:1") == ("cuda", 1)
    assert device_spec(torch.device("cuda", 2)) == ("cuda", 2)
    assert device_spec("host") == ("host", 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_spec("cuda") == ("cuda", 0)
