"""Turning tensors, arrays and token lists into what libferry reads.

Nothing here copies payload: a buffer is the address of the caller's own
memory (torch.Tensor.data_ptr(), a NumPy array's data pointer) plus its
shape. Token ids and block tables are small and are converted to int32
arrays when they are not already.
"""
import ctypes
import errno

import numpy as np

from . import _abi as A

try:  # PyTorch is optional: NumPy arrays work without it
    import torch
except ImportError:  # pragma: no cover - exercised only where torch is absent
    torch = None

# enum ferry_dtype (ferry/slab.h)
DTYPES = {"u8": 0, "i8": 1, "fp8": 2, "f16": 3, "bf16": 4, "i16": 5, "f32": 6, "i32": 7,
          "f64": 8, "i64": 9}
_DTYPE_BYTES = {0: 1, 1: 1, 2: 1, 3: 2, 4: 2, 5: 2, 6: 4, 7: 4, 8: 8, 9: 8}
_NP = {np.dtype(np.uint8): "u8", np.dtype(np.int8): "i8", np.dtype(np.float16): "f16",
       np.dtype(np.int16): "i16", np.dtype(np.float32): "f32", np.dtype(np.int32): "i32",
       np.dtype(np.float64): "f64", np.dtype(np.int64): "i64"}
_TORCH = {}
if torch is not None:
    _TORCH = {torch.uint8: "u8", torch.int8: "i8", torch.float16: "f16", torch.bfloat16: "bf16",
              torch.int16: "i16", torch.float32: "f32", torch.int32: "i32",
              torch.float64: "f64", torch.int64: "i64"}
    for _n in ("float8_e4m3fn", "float8_e5m2"):
        if hasattr(torch, _n):
            _TORCH[getattr(torch, _n)] = "fp8"


def dtype_code(dt):
    """ferry's dtype code for a torch dtype, NumPy dtype or name ("bf16", "f32", ...)."""
    if isinstance(dt, int) and dt in _DTYPE_BYTES:
        return dt
    if isinstance(dt, str) and dt in DTYPES:
        return DTYPES[dt]
    if torch is not None and isinstance(dt, torch.dtype):
        if dt in _TORCH:
            return DTYPES[_TORCH[dt]]
    else:
        try:
            npdt = np.dtype(dt)
            if npdt in _NP:
                return DTYPES[_NP[npdt]]
        except TypeError:
            pass
    raise ValueError(f"ferry: no ferry dtype for {dt!r}")


def dtype_bytes(code):
    return _DTYPE_BYTES[code]


_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def dtype_name(code):
    """The name of a ferry dtype code ("bf16", ...), for messages."""
    return _DTYPE_NAMES.get(code, f"code {code}")


_I32_MAX = 2**31 - 1


def _out_of_range(what, v, i):
    from .errors import FerryError  # (errors loads the library; this module need not)
    return FerryError(-errno.EINVAL, f"{what} {v} at position {i} is outside 0 .. 2^31-1")


def id_array(ids, what):
    """A C-contiguous int32 NumPy array of ids (token ids, block ids): each an
    integer in 0 .. 2^31-1. Anything else is refused here, before a cast
    could wrap it onto another id: floats, strings and bools (TypeError),
    negative ids or ids past int32 (FerryError EINVAL, naming the first, as
    libferry answers a block id it cannot use)."""
    if is_torch(ids):
        ids = ids.detach().cpu().numpy()
    arr = ids if isinstance(ids, np.ndarray) else np.asarray(ids)
    if arr.size == 0:
        return np.zeros(arr.shape, np.int32)
    if arr.dtype == object:  # Python ints past int64, or objects of other kinds
        for i, v in enumerate(arr.reshape(-1)):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
                raise TypeError(f"ferry: {what}s must be integers, got {type(v).__name__} "
                                f"{v!r} at position {i}")
            if not 0 <= v <= _I32_MAX:
                raise _out_of_range(what, v, i)
        arr = arr.astype(np.int64)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"ferry: {what}s must be integers, got dtype {arr.dtype}")
    bad = (arr < 0) | (arr > _I32_MAX)
    if bad.any():
        i = int(np.flatnonzero(bad.reshape(-1))[0])
        raise _out_of_range(what, int(arr.reshape(-1)[i]), i)
    return np.ascontiguousarray(arr, dtype=np.int32)


def is_torch(x):
    return torch is not None and isinstance(x, torch.Tensor)


def describe(x):
    """(address, shape, strides in elements, dtype code, is_device) of a tensor or array."""
    if is_torch(x):
        return (x.data_ptr(), tuple(x.shape), tuple(x.stride()), dtype_code(x.dtype),
                x.device.type != "cpu")
    if isinstance(x, np.ndarray):
        item = x.dtype.itemsize
        if any(s % item for s in x.strides):
            raise ValueError("ferry: array strides are not whole elements")
        return (x.__array_interface__["data"][0], x.shape, tuple(s // item for s in x.strides),
                dtype_code(x.dtype), False)
    raise TypeError(f"ferry: expected a torch.Tensor or numpy.ndarray, got {type(x).__name__}")


def _contiguous_strides(shape):
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    return tuple(reversed(strides))


def _is_contiguous(shape, strides):
    """Row-major with no gaps. As torch's is_contiguous: the stride of an
    axis of size 1 is never used, so any value is; an empty tensor holds no
    element (its capacity, 0 tokens, is checked where the tokens are)."""
    if any(d == 0 for d in shape):
        return True
    want = _contiguous_strides(shape)
    return all(d == 1 or s == w for d, s, w in zip(shape, strides, want))


def storage_of(x):
    """What keeps a tensor's bytes alive while ferry reads or writes them,
    whatever later happens to the tensor object (x.set_(), x.data = y):
    its storage (a torch tensor) or the array itself. A torch before 2.0
    has no untyped_storage(): its storage() (a TypedStorage over the same
    storage) holds the bytes as well, where the tensor would not (set_()
    gives the tensor another storage and frees the old one in flight)."""
    if is_torch(x):
        for get in ("untyped_storage", "storage"):
            try:
                return getattr(x, get)()
            except (AttributeError, RuntimeError):   # that torch lacks it, or no storage (meta)
                pass
        return x
    return x


def _writable(x):
    if isinstance(x, np.ndarray) and not x.flags.writeable:
        raise ValueError("ferry: the destination array is read-only")


_I32 = np.dtype(np.int32)


def tokens_array(tokens):
    """A C-contiguous int32 NumPy array of the token ids, and a ctypes pointer to it.
    An int32 array that is already one contiguous run is used as it is."""
    if type(tokens) is np.ndarray and tokens.dtype is _I32 and tokens.ndim == 1 \
            and tokens.strides == (4,) and tokens.size and tokens.min() >= 0:
        try:  # the fast path: a ctypes view of the array's own memory
            return tokens, ctypes.c_int32.from_buffer(tokens)
        except (TypeError, ValueError):  # read-only: fall through
            pass
    if isinstance(tokens, (int, np.integer)) or (hasattr(tokens, "ndim") and tokens.ndim == 0):
        raise ValueError("ferry: token ids are a sequence (a list, an array, a tensor), "
                         f"got the single value {tokens!r}")
    arr = id_array(tokens, "token id")
    if arr.ndim != 1:
        raise ValueError(f"ferry: token ids must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError("ferry: no token ids")
    return arr, arr.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))


def is_torch_device(x):
    try:
        import torch
    except ImportError:  # pragma: no cover
        return False
    return isinstance(x, torch.device)


def _current_cuda():
    """torch's current CUDA device (torch.cuda.set_device's), 0 without one:
    what "cuda" without an index means to torch, so a tensor-parallel rank
    that set its device gets that GPU, not GPU 0."""
    try:
        import torch
        if torch.cuda.is_available():
            return int(torch.cuda.current_device())
    except Exception:  # no torch, or a CUDA torch that cannot start here
        pass
    return 0


def device_spec(device):
    """(kind, ordinal) of a device given as "host", "cuda", "cuda:N" or a
    torch.device of those ("cuda" alone: torch's current device, as torch
    reads it): ValueError naming what was given otherwise."""
    spec = str(device) if is_torch_device(device) else device
    if spec == "host":
        return "host", 0
    if isinstance(spec, str) and (spec == "cuda" or spec.startswith("cuda:")):
        _, _, n = spec.partition(":")
        if not n:
            return "cuda", _current_cuda()
        if n.isdigit() and n.isascii():
            return "cuda", int(n)
    raise ValueError(f"ferry: device is 'cuda:N' or 'host', got {device!r}")


class DeviceMem:
    """What a store opened on a device accepts as device memory: CUDA tensors
    on its ordinal (kind "cuda"), or memory from its own ferry_device_alloc
    (kind "host": the host backend's device pointers are host addresses, so
    such memory is viewed as a CPU tensor; `allocs` maps address -> bytes)."""

    def __init__(self, kind, ordinal=0):
        self.kind, self.ordinal = kind, ordinal
        self.allocs = {}

    def name(self):
        return f"cuda:{self.ordinal}" if self.kind == "cuda" else self.kind

    def owns(self, addr, nbytes):
        for a, n in self.allocs.items():
            if a <= addr and addr + nbytes <= a + n:
                return True
        return False


def _extent(shape, strides, item):
    """Bytes from a tensor's first element to one past its last."""
    if any(d == 0 for d in shape):
        return 0
    return (sum((d - 1) * s for d, s in zip(shape, strides)) + 1) * item


def mem_kind(x, addr, shape, strides, item, dev):
    """FERRY_KV_MEM_HOST (0) or FERRY_KV_MEM_DEVICE (1) for one tensor or array,
    or a ValueError naming the tensor's device and the store's."""
    if is_torch(x) and x.device.type != "cpu":
        have = "no device" if dev is None else f"device {dev.name()!r}"
        if x.device.type != "cuda":
            raise ValueError(f"ferry: a tensor on {x.device} cannot be a KV buffer "
                             f"(CPU or CUDA tensors only; this store has {have})")
        idx = x.device.index if x.device.index is not None else 0
        if dev is None or dev.kind != "cuda":
            raise ValueError(f"ferry: a tensor on cuda:{idx} needs a store opened with "
                             f"device='cuda:{idx}'; this store has {have}")
        if idx != dev.ordinal:
            raise ValueError(f"ferry: a tensor on cuda:{idx} given to a store on "
                             f"cuda:{dev.ordinal}: the tensor must be on the store's device")
        return 1
    if dev is not None and dev.kind == "host" and dev.allocs \
            and dev.owns(addr, _extent(shape, strides, item)):
        return 1
    return 0


CACHE_LAYOUTS = ("NHD", "HND", "FlashInfer", "packed", "MLA", "cross-layer")


def cache_planes(caches, num_layers):
    """[(layer tensor, None)] for per-layer caches (a list, a tuple, a dict of
    layer name -> tensor in model order, or one layer's tensor), or [(the
    tensor, its layer axis)] * num_layers for one tensor holding every layer
    ([blocks][layers][2][block_size][heads][head_dim], vLLM's cross-layer)."""
    if isinstance(caches, dict):
        return [(c, None) for c in caches.values()]
    if is_torch(caches) or isinstance(caches, np.ndarray):
        if len(caches.shape) == 6:
            if caches.shape[1] != num_layers:
                raise ValueError(f"ferry: a cross-layer cache is [blocks][layers={num_layers}][2]"
                                 f"[block_size][heads][head_dim], got {list(caches.shape)}")
            return [(caches, 1)] * num_layers
        return [(caches, None)]  # one layer
    return [(c, None) for c in caches]


def paged_geometry(shape, strides, lc, hint=None, i=0, layer_axis=None):
    """Read one layer's paged cache: (layout name, (num_blocks, block_tokens,
    block, token, head strides in elements), [K, V plane offsets in elements]).
    The layouts: vLLM's [2][blocks][bs][heads][hd] with NHD or HND strides,
    FlashInfer's [blocks][2][bs][heads][hd], packed K|V [blocks][heads][bs][2*hd],
    MLA's [blocks][bs][hd] (or [..][1][hd]), and a cross-layer tensor's slice.
    A head_dim that is not contiguous, or a shape that is none of them, is
    refused (ValueError naming it)."""
    H, D = lc.num_heads, lc.head_dim
    n = len(shape)

    def axes(kv, blk, tok, head, dim, name):
        if strides[dim] != 1:
            raise ValueError(f"ferry: layer {i}: the head_dim axis is not contiguous "
                             f"(stride {strides[dim]} elements)")
        kv_offs = [k * strides[kv] for k in range(2)] if kv is not None else [0]
        hs = strides[head] if head is not None else D
        return name, (shape[blk], shape[tok], strides[blk], strides[tok], hs), kv_offs

    if lc.kv == 1:
        if n == 3 and shape[2] == D:
            return axes(None, 0, 1, None, 2, "MLA")
        if n == 4 and shape[2] == 1 and shape[3] == D:
            return axes(None, 0, 1, 2, 3, "MLA")
        raise ValueError(f"ferry: layer {i}: a paged latent cache is [num_blocks][block_size]"
                         f"[{D}], got {list(shape)}")
    if layer_axis is not None:   # [blocks][layers][2][bs][heads][hd]
        if n == 6 and shape[2] == 2 and shape[4] == H and shape[5] == D:
            return axes(2, 0, 3, 4, 5, "cross-layer")
        raise ValueError(f"ferry: a cross-layer cache is [blocks][layers][2][block_size][{H}]"
                         f"[{D}], got {list(shape)}")
    if n == 5 and shape[3] == H and shape[4] == D and 2 in (shape[0], shape[1]):
        kv_first = shape[0] == 2
        if shape[0] == 2 and shape[1] == 2:   # 2 blocks: vLLM's or FlashInfer's?
            if hint not in CACHE_LAYOUTS:
                raise ValueError(f"ferry: layer {i}: a cache of shape {list(shape)} is "
                                 "[2][blocks][...] or FlashInfer's [blocks][2][...]: give "
                                 "Layout(..., cache_layout=\"NHD\" | \"HND\" | \"FlashInfer\")")
            kv_first = hint != "FlashInfer"
        if kv_first:
            name = "NHD" if strides[2] >= strides[3] else "HND"
            return axes(0, 1, 2, 3, 4, name)
        return axes(1, 0, 2, 3, 4, "FlashInfer")
    if n == 4 and shape[1] == H and shape[3] == 2 * D:
        name, g, _ = axes(None, 0, 2, 1, 3, "packed")
        return name, g, [0, D * strides[3]]
    raise ValueError(f"ferry: layer {i}: a paged K/V cache is [2][num_blocks][block_size][{H}]"
                     f"[{D}] (NHD or HND strides), FlashInfer's [num_blocks][2][block_size]"
                     f"[{H}][{D}] or packed [num_blocks][{H}][block_size][{2 * D}]; got "
                     f"{list(shape)}")


class Buffer:
    """An engine buffer as a ferry_kv_buffer, holding references to what it points at.
    dev: the store's DeviceMem (None: a store without a device)."""

    def __init__(self, layout, data, block_table=None, *, writable=False, dev=None):
        self.c = A.KVBuffer()
        self.c.layout = layout.c
        self._keep = [data]
        self.addrs = []       # (tensor, data_ptr) of each tensor given, for moved()
        self._dev = dev
        self.device = False   # FERRY_KV_MEM_DEVICE
        if block_table is None:
            self._contiguous(layout, data, writable)
        else:
            self._paged(layout, data, block_table, writable)

    def _contiguous(self, layout, t, writable):
        addr, shape, strides, dt, _ = describe(t)
        lc = layout.c
        mem = mem_kind(t, addr, shape, strides, dtype_bytes(dt), self._dev)
        if dt != lc.dtype:
            raise ValueError(f"ferry: the tensor is {dtype_name(dt)}, the layout's dtype is "
                             f"{dtype_name(lc.dtype)}")
        row = lc.num_heads * lc.head_dim
        if len(shape) == 5:
            ok = shape[3] * shape[4] == row
        elif len(shape) == 4:
            ok = shape[3] == row
        else:
            ok = False
        if not ok or shape[0] != lc.kv or shape[1] != lc.num_layers:
            raise ValueError(
                f"ferry: a contiguous KV tensor is [kv={lc.kv}][layers={lc.num_layers}][tokens]"
                f"[heads*head_dim={row}] (or [..][heads][head_dim]), got {list(shape)}")
        if any(d == 0 for d in shape):
            raise ValueError(f"ferry: the KV tensor {list(shape)} holds no element")
        if not _is_contiguous(shape, strides):
            raise ValueError(f"ferry: the KV tensor must be contiguous (shape {list(shape)}, "
                             f"strides {list(strides)} elements)")
        if writable:
            _writable(t)
        self._hold(t, addr)
        self.device = bool(mem)
        self.c.mem = mem
        self.c.form = 0
        self.c.base = addr
        self.c.capacity_tokens = shape[2]

    def _hold(self, t, addr):
        self._keep.append(storage_of(t))
        if is_torch(t):
            self.addrs.append((t, addr))

    def moved(self):
        """A tensor whose memory is no longer where the call read or wrote it
        (resize_() past its capacity, set_(), .data = ...), or None."""
        m = self.moved_from()
        return m[0] if m is not None else None

    def moved_from(self):
        """(tensor, the address the call took) of a tensor that moved, or None."""
        for t, addr in self.addrs:
            if t.data_ptr() != addr:
                return t, addr
        return None

    def moved_layer(self, layer, num_layers):
        """moved() for the tensor holding layer `layer` alone when each layer
        is a tensor of its own (a paged buffer's per-layer caches: addrs are
        in layer order), else for every tensor: one check per layer_done."""
        m = self.moved_layer_from(layer, num_layers)
        return m[0] if m is not None else None

    def moved_layer_from(self, layer, num_layers):
        """moved_from() for layer `layer` as moved_layer chooses its tensors:
        (tensor, the address the call took), or None."""
        a = self.addrs
        if len(a) == num_layers > 1:
            t, addr = a[layer]
            return (t, addr) if t.data_ptr() != addr else None
        return self.moved_from()

    def _paged(self, layout, caches, block_table, writable):
        lc = layout.c
        hint = getattr(layout, "cache_layout", None)
        planes = cache_planes(caches, lc.num_layers)
        if len(planes) != lc.num_layers:
            raise ValueError(f"ferry: {len(planes)} layer caches for a {lc.num_layers}-layer layout")
        bases, geom, found = [], None, None
        per_kv = [[] for _ in range(lc.kv)]
        mem = None
        for i, (c, layer_axis) in enumerate(planes):
            addr, shape, strides, dt, _ = describe(c)
            m = mem_kind(c, addr, shape, strides, dtype_bytes(dt), self._dev)
            if mem is None:
                mem = m
            elif m != mem:
                raise ValueError(f"ferry: layer {i} is {'device' if m else 'host'} memory, "
                                 f"layer 0 {'device' if mem else 'host'}: every layer must match")
            if dt != lc.dtype:
                raise ValueError(f"ferry: layer {i} is {dtype_name(dt)}, the layout's dtype is "
                                 f"{dtype_name(lc.dtype)}")
            if writable:
                _writable(c)
            if layer_axis is None or i == 0:
                self._hold(c, addr)
            item = dtype_bytes(dt)
            name, g, kv_offs = paged_geometry(shape, strides, lc, hint, i, layer_axis)
            if layer_axis is not None:   # one tensor for every layer: this layer's slice
                addr += i * strides[layer_axis] * item
            g = tuple(x * item if k >= 2 else x for k, x in enumerate(g))
            if min(g[2:]) < 0:
                # C takes the strides as uint64 and would name -4096 as
                # 18446744073709547520: refused here, signed
                raise ValueError(f"ferry: layer {i} ({name}) has a negative stride (block "
                                 f"{g[2]}, token {g[3]}, head {g[4]} bytes): a reversed view "
                                 "of a cache; give the cache itself (or a copy)")
            for k in range(lc.kv):
                per_kv[k].append(addr + kv_offs[k] * item)
            if geom is None:
                geom, found = g, name
            elif g != geom or name != found:
                raise ValueError(f"ferry: layer {i} is {name} with (blocks, block_size, strides "
                                 f"in bytes) {g}; layer 0 is {found} with {geom}: every layer "
                                 "must have one layout")
        self.cache_layout = found
        for k in range(lc.kv):
            bases.extend(per_kv[k])
        self._bases = (ctypes.c_uint64 * len(bases))(*bases)
        table = id_array(block_table, "block id")
        if table.ndim != 1:
            raise ValueError(f"ferry: a block table is one-dimensional, got shape {table.shape}")
        if table is block_table or table.base is not None:
            # the engine's own memory (an int32 array, a tensor's view): an
            # async op reads the table after the call returns, and an engine
            # rewrites its table in place for the next step; ferry checked
            # the ids at the call, so it reads a copy of them
            table = table.copy()
        self._table = table
        self._keep.append(caches)
        c = self.c
        self.device = bool(mem)
        c.mem = mem
        c.form = 1
        c.block_bases = self._bases
        c.num_blocks, c.block_tokens, c.block_stride, c.token_stride, c.head_stride = geom
        c.block_table = table.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        c.table_len = table.size
