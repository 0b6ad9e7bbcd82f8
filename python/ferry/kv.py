"""The tiered KV-cache store (ferry/kv.h) for Python engines."""
import asyncio
import ctypes
import errno
import os
import atexit
import threading
import time
import weakref
from functools import partial

import numpy as np

from . import _abi as A
from ._handle import REFUSED, CallGuard, Closing, Opened, Signal, free_and_forget
from ._buffers import (CACHE_LAYOUTS, Buffer, DeviceMem, cache_planes, describe, device_spec,
                       dtype_code, dtype_name, is_torch, is_torch_device, paged_geometry,
                       tokens_array)
from ._lib import lib
from .errors import ELOCKED, FerryError, check, err_name, strerror

TIER_NONE, TIER_L1, TIER_L2, TIER_REMOTE = 0, 1, 2, 3
TIER_NAMES = {TIER_NONE: "none", TIER_L1: "l1", TIER_L2: "l2", TIER_REMOTE: "remote"}
_PARTIAL = 1
# size_t arguments made once (never written): a ctypes object of an argument's
# own type is passed as it is, an int is converted on every call
_NSIZES = 1025
_SIZES = [ctypes.c_size_t(i) for i in range(_NSIZES)]
_FERRY_ESTATE = -4100


def parse_size(s):
    """Bytes from an int or a string like "8G", "512M", "4096" (ferry's size grammar)."""
    if isinstance(s, int):
        if s < 0:
            raise ValueError(f"ferry: negative size {s}")
        return s
    out = ctypes.c_uint64()
    check(lib.ferry_parse_size(str(s).encode(), ctypes.byref(out)), f"size {s!r}")
    return out.value


_U32_MAX = 2**32 - 1
_U64_MAX = 2**64 - 1


def _u32_arg(v, what):
    """A count C takes as uint32 (layers, heads, chunk_tokens, workers ...):
    a negative value or one past 2^32-1 is refused here, where ctypes would
    wrap it (-1 onto 4294967295, 2^32 onto 0) and C name the wrapped value."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"ferry: {what} is an integer, got {type(v).__name__} {v!r}")
    if not 0 <= v <= _U32_MAX:
        raise FerryError(-errno.EINVAL, f"{what} {v} is outside 0 .. 2^32-1")
    return int(v)


def _u64_arg(v, what):
    """A 64-bit value C takes as uint64 (the hash seed): as _u32_arg, up to
    2^64-1 (ctypes would wrap -1 onto 2^64-1, a seed two stores must agree on)."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"ferry: {what} is an integer, got {type(v).__name__} {v!r}")
    if not 0 <= v < 1 << 64:
        raise FerryError(-errno.EINVAL, f"{what} {v} is outside 0 .. 2^64-1")
    return int(v)


def _name_bytes(names):
    """Chunk names as a list of bytes (str as UTF-8); TypeError for a name
    that is neither, and for one str or bytes where a sequence belongs."""
    if isinstance(names, (str, bytes, bytearray, memoryview)):
        raise TypeError("ferry: names are a sequence of str or bytes, one per chunk")
    out = []
    for n in names:
        if isinstance(n, str):
            n = n.encode()
        elif not isinstance(n, bytes):
            if not isinstance(n, (bytearray, memoryview)):
                raise TypeError(f"ferry: name {len(out)} is {type(n).__name__}, "
                                "not str or bytes")
            n = bytes(n)
        out.append(n)
    return out


class Layout:
    """The shape of an engine's KV cache on one TP rank: layers, K and V (or
    one MLA latent), KV heads, head_dim and dtype. Its fields read as it was
    made: num_layers, kv, num_heads and head_dim are ints, dtype ferry's
    name of the element type ("bf16", "fp8", ...: Layout(..., lay.dtype)
    is the same layout)."""

    def __init__(self, num_layers, num_heads, head_dim, dtype="bf16", kv=2):
        self.c = A.KVLayout(num_layers=_u32_arg(num_layers, "num_layers"),
                            kv=_u32_arg(kv, "kv"), num_heads=_u32_arg(num_heads, "num_heads"),
                            head_dim=_u32_arg(head_dim, "head_dim"), dtype=dtype_code(dtype))
        out = ctypes.c_uint64()
        check(lib.ferry_kv_layout_chunk_bytes(ctypes.byref(self.c), 1, ctypes.byref(out)), "layout")
        self.token_bytes = out.value

    @classmethod
    def from_model(cls, num_layers, num_kv_heads, head_dim, dtype="bf16", mla=False):
        """A model's layout per rank (num_kv_heads already divided by the TP size)."""
        return cls(num_layers, 1 if mla else num_kv_heads, head_dim, dtype, kv=1 if mla else 2)

    @classmethod
    def from_kv_caches(cls, kv_caches, cache_layout=None):
        """The layout of an engine's paged caches, and which of them it is
        (.cache_layout: "NHD", "HND", "FlashInfer", "packed", "MLA" or
        "cross-layer"). kv_caches: a list of per-layer tensors, the dict
        {layer_name: tensor} vLLM's register_kv_caches receives (in model
        order), or one tensor holding every layer [blocks][layers][2]
        [block_size][heads][head_dim]. Per layer: vLLM's [2][blocks]
        [block_size][heads][head_dim] (NHD, or HND's permuted view: its
        strides say which), FlashInfer's [blocks][2][block_size][heads]
        [head_dim], packed K|V [blocks][heads][block_size][2*head_dim], or
        MLA's [blocks][block_size][head_dim]. cache_layout names the layout
        where the shape alone cannot (a cache of 2 blocks)."""
        if isinstance(kv_caches, dict):
            caches = list(kv_caches.values())
        elif is_torch(kv_caches) or isinstance(kv_caches, np.ndarray):
            caches = [kv_caches]
        else:
            caches = list(kv_caches)
        if not caches:
            raise ValueError("ferry: no KV caches")
        _, shape, strides, dt, _ = describe(caches[0])
        n = len(caches)
        if len(shape) == 6 and len(caches) == 1:        # cross-layer
            n, heads, dim, kv = shape[1], shape[4], shape[5], 2
        elif len(shape) == 5 and 2 in shape[:2]:          # NHD / HND / FlashInfer
            heads, dim, kv = shape[3], shape[4], 2
        elif len(shape) == 4 and shape[3] % 2 == 0 and shape[2] != 1:   # packed K|V
            heads, dim, kv = shape[1], shape[3] // 2, 2
        elif len(shape) == 3 or (len(shape) == 4 and shape[2] == 1):    # MLA
            heads, dim, kv = 1, shape[-1], 1
        else:
            raise ValueError(f"ferry: cannot read a layout from a cache of shape {list(shape)}: "
                             "expected one of " + ", ".join(CACHE_LAYOUTS))
        lay = cls(n, heads, dim, dt, kv=kv)
        if cache_layout is not None:
            if cache_layout not in CACHE_LAYOUTS:
                raise ValueError(f"ferry: unknown cache layout {cache_layout!r}: one of "
                                 + ", ".join(CACHE_LAYOUTS))
            lay.cache_layout = cache_layout
        planes = cache_planes(kv_caches, n)
        c0, axis = planes[0]
        _, shape, strides, _, _ = describe(c0)
        lay.cache_layout = paged_geometry(shape, strides, lay.c, cache_layout, 0, axis)[0]
        return lay

    cache_layout = None   # which paged layout the engine's caches have, when known

    def __getattr__(self, name):
        if name in ("num_layers", "kv", "num_heads", "head_dim"):
            return getattr(self.c, name)
        if name == "dtype":   # the name a Layout is made with ("bf16"), as repr shows it
            return dtype_name(self.c.dtype)
        raise AttributeError(name)

    def __eq__(self, other):
        return isinstance(other, Layout) and bytes(self.c) == bytes(other.c)

    def __repr__(self):
        c = self.c
        return (f"Layout(num_layers={c.num_layers}, num_heads={c.num_heads}, "
                f"head_dim={c.head_dim}, dtype={dtype_name(c.dtype)!r}, kv={c.kv})")


def _salt_bytes(salt):
    """A salt's bytes: str as UTF-8, bytes, bytearray or memoryview as they
    are. Anything else is refused (TypeError): bytes() of an int is that
    many zero bytes (salt=0 the unsalted tenant, 3 the salt b"\\0\\0\\0"),
    and of a list of ints bytes no tenant meant."""
    if isinstance(salt, str):
        return salt.encode()
    if isinstance(salt, (bytes, bytearray, memoryview)):
        return bytes(salt)
    raise TypeError(f"ferry: a salt is str or bytes (a tenant's key), got "
                    f"{type(salt).__name__} {salt!r:.40}")


class _Req:
    """A ferry_kv_req with optional per-chunk out-arrays."""

    def __init__(self, salt, partial, chunks=0, skip=0):
        self.c = A.KVReq()
        if skip:
            if isinstance(skip, bool) or not isinstance(skip, (int, np.integer)):
                raise TypeError(f"ferry: skip is a count of tokens, got {type(skip).__name__} "
                                f"{skip!r}")
            if skip < 0:
                raise ValueError(f"ferry: skip {skip} is negative")
            if skip > _U64_MAX:   # (ctypes would keep its low 64 bits: a small skip)
                raise FerryError(-errno.EINVAL, f"skip {skip} is past 2^64-1")
            self.c.skip_tokens = int(skip)
        self._salt = salt
        if salt is not None:
            self._salt = _salt_bytes(salt)
            self.c.salt = ctypes.cast(ctypes.c_char_p(self._salt), ctypes.c_void_p)
            self.c.salt_len = len(self._salt)
        self.c.flags = _PARTIAL if partial else 0
        if chunks:
            self.tiers = (ctypes.c_uint8 * chunks)()
            self.status = (ctypes.c_int * chunks)()
            self.c.tiers = self.tiers
            self.c.status = self.status
            self.c.max_chunks = chunks

    def ptr(self):
        return ctypes.byref(self.c)


class Op:
    """An asynchronous store or retrieve. wait() returns the tokens moved (or
    raises FerryError); done() tells whether it finished; cancel() stops it;
    `await op` works in asyncio. The buffers it reads or writes stay
    referenced by the Op until it is freed.

    Threads: wait, done, cancel and free may be called from any number of
    threads at once. The C handle is freed once, after every call on it has
    returned; the first result is kept and every later wait returns it. An
    Op outlives its KVStore: after the store's close() it still answers
    wait() and done() (close finished it: a layerwise store still lacking
    layers was abandoned with FERRY's -ECANCELED, nothing of it stored).
    In a forked child a parent's Op, in flight or ended, raises FerryError
    (EBADF) naming the fork, never its kept result; free forgets it (no C).

    asyncio: `await op` waits on a worker thread of the loop's default
    executor. asyncio.wait_for(op, timeout) timing out, or the awaiting
    task being cancelled, does not stop the operation: it goes on with its
    buffers, and op.cancel() (safe at any time, from any thread) stops it;
    await op again, or wait(), for its result.

    Buffers in flight: the Op keeps each tensor's storage alive, so
    dropping the tensor, or x.set_() / x.data = y on it, leaves the memory
    ferry reads or writes in place. What it cannot hold is memory torch
    itself frees in place (x.resize_() past the storage's capacity): keep a
    buffer's size until wait() returns. A tensor whose data_ptr moved while
    the Op ran makes wait() raise FerryError (EFAULT) instead of returning
    the tokens moved, since that tensor does not hold them; a store's op
    then deletes what it stored (it may have read memory torch freed).
    """

    def __init__(self, kv, handle, keep, call):
        self._kv = kv
        self._h = handle
        self._keep = keep
        self._call = call
        self._result = None
        self._moved = None    # (tensor, address) of a buffer that moved in flight
        self._stores = call.startswith("store")
        self._left = None     # why a moved store's delete left some of it (_forget)
        self._guard = CallGuard(call)
        self._freed = Signal()   # set once free() kept the end and let go
        # in the registry of ops in flight from before the C call hands out
        # the handle until it is freed: holds the handle and the buffers
        self._flight = _Flight(self, kv, handle, keep, self._guard, self._freed,
                               self._stores)

    def _c(self, fn, *args):
        """fn(handle, *args), or None when the handle was freed already, once
        the free (in whichever thread) kept the op's end (FerryError in a
        forked child: the op is its parent's)."""
        rc = self._guard.call(fn, self._h, *args)
        if rc is REFUSED:
            if self._guard.forked:
                raise self._guard.refused("the operation", self._call)
            self._flight.finish(self._keep_result, self._let_go)   # (see free)
            return None
        return rc

    def _here(self):
        """In a forked child: FerryError (EBADF) naming the fork, before any
        answer from a kept result (the op and its result are the parent's)."""
        if self._guard.forked:
            raise self._guard.refused("the operation", self._call)

    def _settle(self, rc):
        """Keep the first result, free the handle; returns the kept result."""
        self._keep_result(rc)
        self.free()
        return self._result

    def _keep_result(self, rc):
        """Keep rc as the result unless one is kept already (with the buffer
        that moved in flight, if one did)."""
        if self._result is None:
            keep = self._keep    # (a free in another thread may drop it meanwhile)
            buf = keep[0] if keep else None
            self._moved = buf.moved_from() if buf is not None else None
            if self._moved is not None and self._stores and rc != -errno.ECANCELED:
                self._left = self._kv._forget_stored(keep[2], keep[1])
            self._result = rc

    def _outcome(self):
        rc = self._result
        if rc is None:
            raise FerryError(-errno.EINVAL, "the operation was freed before it finished",
                             self._call)
        if rc < 0:
            raise FerryError(rc, None, self._call)
        if self._moved is not None:
            raise _moved_error(self._moved, "operation", self._stores, self._call,
                               self._left)
        return rc

    def wait(self, timeout=None):
        self._here()
        if self._result is None:
            ms = _timeout_ms(timeout)
            rc = self._c(lib.ferry_kv_op_wait, ms)
            if rc == -errno.ETIMEDOUT:
                raise TimeoutError(f"ferry: {self._call} still running after {timeout} s")
            if rc is not None:
                self._settle(rc)
        return self._outcome()

    def cancel(self):
        """Stop the operation and wait until it no longer touches its buffer
        (an aborted request may free its blocks as soon as this returns).
        Returns True when the cancel stopped it (chunks already moved stay
        moved), False when it had finished anyway (wait() gives its result)."""
        self._here()
        if self._result is not None:
            return False
        rc = self._c(lib.ferry_kv_op_cancel)
        if rc is None:
            return False
        self._settle(rc)
        return rc == -errno.ECANCELED

    def done(self):
        self._here()
        if self._result is not None:
            return True
        rc = self._c(lib.ferry_kv_op_test)
        if rc == -errno.EAGAIN:
            return False
        if rc is not None:
            self._settle(rc)
        return True

    def free(self):
        """Let the operation go (waiting for it if it still runs). Calls on it
        in other threads finish first; later calls answer from its result."""
        # the first end() stops new calls; then any thread finishes the
        # release, one at a time: a free an interrupt stopped in one thread
        # (which may never come back to it) is gone on with by the next
        # thread that frees the op or calls it, never waited for
        # (a free inside a call of its own thread on the op - a signal
        # handler's, a __del__'s - waits for nothing: that call finishes
        # it as it leaves, CallGuard.on_last, which holds the Op weakly: a
        # free an interrupt stopped leaves the Op free to go, its flight
        # then an orphan for the reaper)
        if not self._guard.end(self._flight.finish_by_op) and self._guard.forked:
            return
        self._flight.finish(self._keep_result, self._let_go)

    def _let_go(self):
        self._keep = None            # the op is over: its buffers may go

    def __await__(self):
        loop = asyncio.get_running_loop()
        return loop.run_in_executor(None, self.wait).__await__()

    __reduce_ex__ = Closing.__reduce_ex__

    def __del__(self):
        # the buffers go with this object once the op is over; a free an
        # interrupt (KeyboardInterrupt) stopped, even at this line, leaves
        # the op in the registry of ops in flight (its handle and buffers
        # held): the reaper frees it (_reap)
        try:
            self.free()
        except Exception:  # interpreter shutdown
            pass


class _Flight:
    """An op whose C handle is not freed yet, in the registry `_flying`
    from before the C call hands the handle out until ferry_kv_op_free
    returned: it holds the handle and the buffers the op reads or writes,
    so neither goes with an Op whose __del__ an interrupt stopped (at its
    first line, before any free). Its Op frees it (free(), __del__); once
    that Op is gone (`op()` is None) with the flight still here, the
    reaper does: at the next call that moves KV (any store's), at its
    store's close(), and at the exit. The reaper visits the orphans alone
    (`_orphans`, which the Op's weak reference joins as the Op goes), never
    the ops alive: a call costs the same with 10,000 ops in flight."""

    def __init__(self, op, kv, hv, keep, guard, freed, stores):
        self.op = _GONE
        self.kv = weakref.ref(kv)
        self.hv = hv              # the ctypes handle the C call fills
        self.keep = keep
        self.guard = guard
        self.freed = freed
        self.stores = stores
        # one finish at a time (only `with`: its release cannot be skipped);
        # an RLock to know its owner (a free inside this thread's own finish)
        self.lock = threading.RLock()
        # the reference last, once the flight is whole: an interrupt above
        # stops the Op's construction before any C call hands a handle out
        ref = _OpRef(op, _orphans.add)   # (C alone: no frame an interrupt stops)
        ref.flight = self
        hash(ref)                 # (kept: the callback hashes it once the Op is gone)
        self.op = ref
        _flying.add(self)

    def release(self, settle, let_go=None):
        """By finish() alone: wait for the C op (a
        layerwise store still lacking layers is abandoned, as a cancel
        does), settle(rc) with its end (None: kept already), free the
        handle, let the buffers go (let_go(): the Op's hold on them).
        Made again from the start after an interrupt: each step is done
        at most once."""
        hv = self.hv
        if hv and hv.value and settle is not None:
            # ferry_kv_op_free waits for the op anyway: wait first and keep
            # its end for the calls that come later
            rc = lib.ferry_kv_op_wait(hv, -1)
            if rc == _FERRY_ESTATE:
                rc = lib.ferry_kv_op_cancel(hv)
            settle(rc)
        h = hv.value if hv else None
        if h:   # (freed and taken out in one step: never twice, never leaked)
            free_and_forget(lib.ferry_kv_op_free, h, setattr, hv, "value", None)
        if let_go is not None:
            let_go()
        self.keep = None
        _flying.discard(self)
        self.op = _GONE           # (its reference goes: no orphan to visit)
        self.freed.set()
        self.guard.released()     # (on_last goes, with the Op it holds)

    def finish(self, settle, let_go=None):
        """Once the op's guard is ended, by any thread: after the calls
        inside returned, release (settle: as release says; it keeps the
        first end alone), unless done. One thread at a time, under a lock
        `with` takes: an interrupt anywhere lets it go, and the next
        thread (or this one, again) goes on from the step it reached."""
        if self.freed.is_set():
            return
        lock = self.lock
        if lock._is_owned():
            # a free (or wait) made inside this thread's own finish (a signal
            # handler's, a __del__'s): waiting for the lock would wait for
            # this thread, for ever. The finish below it goes on once this
            # returns (or, interrupted, the next free or call finishes it)
            return
        with lock:
            # (drain False: a call of this thread is inside the op, which
            # finishes it as it leaves: CallGuard.on_last)
            if not self.freed.is_set() and self.guard.drain():
                self.release(settle, let_go)

    def finish_by_op(self):
        """finish() as its Op's free() makes it, or as the reaper does once
        the Op is gone: the guard's on_last, which must not hold the Op
        (the registry of flights holds the guard: a strong reference would
        keep the Op, and its buffers, for ever once a free was stopped)."""
        op = self.op()
        if op is None:
            self.finish(self._settle_orphan)
        else:
            self.finish(op._keep_result, op._let_go)

    def _settle_orphan(self, rc):
        """An orphan's end: a store whose source moved in flight deletes
        what it stored (as its Op's wait would have)."""
        keep = self.keep
        kv = self.kv()
        if self.stores and keep and kv is not None and rc != -errno.ECANCELED \
                and keep[0].moved_from() is not None:
            kv._forget_stored(keep[2], keep[1])

    def reap(self, block):
        """Free an orphan (its Op gone): at once when its C side is over
        (or a layerwise store still lacking layers, which no one can give
        them now), else only when `block`. False when it is still here."""
        if self.op() is not None:
            return False
        g = self.guard
        if not block:
            rc = g.call(lib.ferry_kv_op_wait, self.hv, 0) if self.hv.value else 0
            if rc == -errno.ETIMEDOUT:
                return False
        fin = partial(self.finish, self._settle_orphan)
        g.end(fin)
        fin()
        # (not freed yet: a finish of this thread's is under way - a signal
        # handler's reap inside it - or a call of its own thread is inside,
        # which frees it as it leaves. Kept an orphan until then: a finish
        # an interrupt stops is the next reap's to make)
        return self.freed.is_set()


class _OpRef(weakref.ref):
    """A weak reference to an Op that names its flight."""
    __slots__ = ("flight",)


def _GONE():
    return None


_flying = set()    # every _Flight of this process (sets: atomic add and discard)
_orphans = set()   # the _OpRef of each Op gone whose flight may still be here


def _reap(block=False, kv=None):
    """Free the orphans of the registry (all, or those of store `kv`)."""
    if not _orphans:
        return
    for ref in list(_orphans):
        f = getattr(ref, "flight", None)   # (None: an Op whose construction stopped)
        if f is None or f.freed.is_set():   # its Op freed it (or a reaper did)
            _orphans.discard(ref)
        elif f.guard.forked:      # a forked child's: the parent's, never freed here
            f.keep = None         # (no C op of the child writes into it)
            _flying.discard(f)
            _orphans.discard(ref)
        elif kv is None or f.kv() is kv:
            if f.reap(block):
                _orphans.discard(ref)


def _reap_at_exit():
    try:
        _reap(block=True)
    except Exception:  # the library going away
        pass


atexit.register(_reap_at_exit)


def _moved_error(moved, what, store, call, left=None):
    """FerryError (EFAULT) for a call or operation whose tensor moved while it
    ran (another thread's resize_, set_ or .data =): moved is (the tensor,
    the address the call took); left: why a store's delete of what it
    stored did not take it all (KVStore._forget), or None."""
    t, addr = moved
    if not store:
        end = "it does not hold the bytes loaded"
    elif left is None:
        end = "what it stored was deleted (it may have read memory torch freed under it)"
    else:
        end = ("what it stored (it may have read memory torch freed under it) could not all "
               f"be deleted: {left}")
    until = "wait() returns" if what == "operation" else "the call returns"
    return FerryError(-errno.EFAULT, f"a tensor of the {what} was resized or given other "
                      f"memory while the {what} ran (its data_ptr moved from {addr:#x} to "
                      f"{t.data_ptr():#x}): {end}; keep a buffer's memory in place until "
                      f"{until}", call)


_INT_MAX = 2**31 - 1


def _timeout_ms(timeout):
    """A timeout in seconds as C's int timeout_ms: None, inf, or more than
    an int of milliseconds holds (24.8 days) is -1 (forever), where a cast
    would wrap it onto a short or negative wait (an int past a float too);
    a negative one, -inf included, is 0 (a test). NaN is refused."""
    if timeout is None:
        return -1
    try:
        t = float(timeout)
    except OverflowError:   # an int past a float: forever, or a test
        return -1 if timeout > 0 else 0
    if t != t:
        raise ValueError("ferry: timeout is NaN (seconds, or None to wait until done)")
    ms = t * 1000
    if ms >= _INT_MAX:
        return -1
    if ms <= 0:             # (-inf too, which int() refuses)
        return 0
    return int(ms)


def _layer_index(layer, num_layers):
    """A layer index as C's uint32: an integer in 0 .. num_layers-1."""
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
        raise TypeError(f"ferry: a layer is an integer, got {type(layer).__name__} {layer!r}")
    if not 0 <= layer < num_layers:
        raise FerryError(-errno.EINVAL, f"layer {layer} is outside 0 .. {num_layers - 1}")
    return int(layer)


class LayerOp(Op):
    """A layer-by-layer retrieve (KVStore.retrieve_layers) or store
    (KVStore.store_layers): an Op (wait, done, cancel, await) that also moves
    one layer at a time.

    A retrieve: wait_layer(l) returns the tokens loaded once layer l is in
    the engine's buffer (later layers may still be moving), or raises
    FerryError (EFAULT) when the tensor holding layer l moved meanwhile
    (as wait() does for any of its tensors). A store:
    layer_done(l) hands layer l over (copied before the call returns for
    host buffers); the chunks become visible only after the last layer,
    and wait() then returns the tokens stored. Cancelling or freeing a
    store before its last layer stores nothing."""

    def __init__(self, kv, handle, keep, call, num_layers, store):
        super().__init__(kv, handle, keep, call)
        self.num_layers = num_layers
        self._store = store
        self._done_layers = set()
        self._cuda = bool(keep[0].device) and kv._devmem is not None \
            and kv._devmem.kind == "cuda"

    def _lacking(self):
        """A store still lacking layers: its wait would be answered FERRY_ESTATE
        (an error, not a hang), which must not end the operation. (Once its
        KVStore closed, the close abandoned it: wait answers that.)"""
        return self._store and not self._guard.ended and not self._kv._guard.ended \
            and len(self._done_layers) < self.num_layers

    def wait(self, timeout=None):
        if self._result is None and self._lacking():
            missing = sorted(set(range(self.num_layers)) - self._done_layers)
            raise FerryError(_FERRY_ESTATE, f"the store still lacks layers {missing} "
                             "(layer_done)", self._call)
        return super().wait(timeout)

    def done(self):
        if self._result is None and self._lacking():
            return False
        return super().done()

    def _live(self, what, fn, *args):
        """fn(handle, *args) on the live handle; once the operation ended (its
        handle freed), what C would answer from its end: _ended's."""
        rc = self._c(fn, *args)
        if rc is None:
            return self._ended(what)
        return rc

    def _ended(self, what):
        """A layer call on an operation that ended (waited, cancelled, or its
        store closed): a retrieve's wait_layer answers its result (every layer
        landed, or its error: -ECANCELED after a cancel); layer_done answers
        -ECANCELED for a store that ended short of its layers, FERRY_ESTATE
        for one that took them all; the wrong kind of op, FERRY_ESTATE."""
        rc = self._result
        call = f"{self._call}: {what}"
        if rc is None:
            raise FerryError(-errno.EINVAL, "the operation was freed before it finished", call)
        if (what == "layer_done") != bool(self._store):
            kind = "store" if what == "layer_done" else "retrieve"
            raise FerryError(_FERRY_ESTATE, f"the op is not a layerwise {kind}", call)
        if rc < 0:
            raise FerryError(rc, "the operation ended", call)
        if what == "layer_done":
            raise FerryError(_FERRY_ESTATE, "the store is over: every layer was done already",
                             call)
        return rc

    def wait_layer(self, layer, timeout=None):
        """Tokens loaded into layer `layer` (a retrieve), once it landed (after
        the op ended: its result, or its error, -ECANCELED after a cancel). Into
        CUDA tensors: torch.cuda.current_stream() is made to wait for the
        layer's copies on the device (ferry_kv_op_stream_wait_layer), so the
        engine's next kernels on that stream read the loaded KV; the stream is
        the store's (imported once), so that wait is a call inside the store:
        a close() from another thread waits for it, and once the store is
        closed it raises FerryError (EBADF). A destination tensor of that
        layer whose data_ptr moved while the op ran (resize_, set_, .data =
        from another thread) makes it raise FerryError (EFAULT) naming the
        move instead of returning the tokens, as wait() does: the tensor
        does not hold them."""
        ms = _timeout_ms(timeout)
        layer = _layer_index(layer, self.num_layers)
        if self._cuda:   # the stream is the store's: looked up and used inside its guard
            rc = self._kv._on_engine_stream(
                lambda s: self._live("wait_layer", lib.ferry_kv_op_stream_wait_layer, layer, s,
                                     ms))
        else:
            rc = self._live("wait_layer", lib.ferry_kv_op_wait_layer, layer, ms)
        if rc == -errno.ETIMEDOUT:
            raise TimeoutError(f"ferry: layer {layer} of {self._call} not loaded after "
                               f"{timeout} s")
        call = f"{self._call}: wait_layer({layer})"
        rc = check(rc, call)
        self._check_layer_moved(layer, call)
        return rc

    def _check_layer_moved(self, layer, call):
        """After a wait_layer that landed: FerryError (EFAULT) when the tensor
        holding layer `layer` moved since retrieve_layers (another thread's
        resize_, set_ or .data =): it does not hold the layer loaded, as a
        blocking retrieve or wait() would say. Once the op ended (its buffers
        let go), what its end found: any tensor of it that moved."""
        keep = self._keep    # (a free in another thread may drop it meanwhile)
        moved = keep[0].moved_layer_from(layer, self.num_layers) if keep else self._moved
        if moved is not None:
            raise _moved_error(moved, "operation", False, call)

    async def wait_layer_async(self, layer):
        """wait_layer for asyncio: awaits layer `layer` without blocking the loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, self.wait_layer, layer)

    def layer_done(self, layer):
        """Layer `layer` of the source is ready: copy it (a store). From CUDA
        tensors the copies are queued after the work already queued on
        torch.cuda.current_stream() (the kernels that computed the layer), so
        the call does not block the host (a call inside the store, as
        wait_layer's: FerryError (EBADF) once the store is closed). A source
        whose memory moved since store_layers (resize_ past its capacity,
        set_) cancels the store: FerryError (EFAULT), nothing of it stored."""
        layer = _layer_index(layer, self.num_layers)
        keep = self._keep
        t = keep[0].moved_layer(layer, self.num_layers) if keep else None
        if t is not None:
            # its memory is not where the op reads (resized past capacity: freed):
            # the layer would be other bytes, so the store ends, committing nothing
            self.cancel()
            raise FerryError(-errno.EFAULT, f"layer {layer}'s source tensor was resized or "
                             "given other memory after store_layers (its data_ptr moved to "
                             f"{t.data_ptr():#x}); the store is cancelled, nothing of it "
                             "stored", f"{self._call}: layer_done")
        if self._cuda:
            rc = self._kv._on_engine_stream(
                lambda s: self._live("layer_done", lib.ferry_kv_op_layer_done, layer, s))
        else:
            rc = self._live("layer_done", lib.ferry_kv_op_layer_done, layer, None)
        check(rc, f"{self._call}: layer_done({layer})")
        self._done_layers.add(layer)


class _DeviceMemory:
    """A closed store's "host" device while device_empty() tensors of it are
    alive: each tensor's buffer holds this, and the device (which frees
    their memory) closes with the last of them, so a tensor read or written
    after close(), from any thread, touches memory that is still there. In
    a forked child the device is the parent's: not closed."""

    def __init__(self):
        self.dev = None
        self.where = Opened()

    def __del__(self):
        # (freed and taken out in one step: an interrupt as the close
        # returns leaves nothing for a second finalization to close again)
        try:
            if self.where.forked:
                self.dev = None
            if self.dev:
                free_and_forget(lib.ferry_device_close, self.dev, setattr, self, "dev", None)
        except Exception:  # interpreter shutdown: the library may be gone
            pass


class KVStore(Closing):
    """A ferry KV store: in this process, or a `ferry serve` daemon's.

    KVStore(model="llama3-8b", layout=Layout(...), l1="8G",
            l2="/nvme/ferry:512G", persistent=False, ...)
    KVStore(model="llama3-8b", layout=Layout(...), server="unix:/run/ferry/ferry.sock")

    l1: host pool size; l2: "DIR:SIZE" (or l2_dir= and l2_bytes=), or a
    list of them, one per drive with the same SIZE (one L2 striped across
    them; a persistent one is reopened with the same list, in order);
    persistent: the L2 survives close and restarts (chunks written
    through before close or sync are found again); remote: a redis://
    URL. server: the daemon owns the tiers (l1/l2/remote are its own) and
    every call goes to it; lookup_only=True maps no shared pool (a
    scheduler that only asks how much is cached). Use as a context
    manager, or call close().

    device: None (host buffers only), "cuda:N" or a torch.device ("cuda"
    alone: torch's current device), or "host" (ferry's host-memory
    stand-in for a GPU, for tests). The store opens that ferry_device (its
    L1 pinned through it) and closes it with the store. Buffers given to a
    store on "cuda:N" may be CUDA tensors on cuda:N: ferry copies between
    their memory (data_ptr()) and L1 on the device's copy engines, no copy
    in Python. CPU tensors stay host buffers. Ordering with the engine's
    work on torch.cuda.current_stream(): store/retrieve (blocking) and the
    *_async forms synchronize that stream before the call (the engine's
    writes to a source are finished, and its reads of a destination too); a
    blocking retrieve returns with its copies complete, an async one once
    wait() returned. retrieve_layers synchronizes the stream once when it
    starts (its copies run on ferry's stream and write the engine's
    memory); after that the layerwise forms do not block: layer_done(l) queues
    the copies after the stream's pending work (ferry_stream_import of the
    stream, passed to ferry_kv_op_layer_done) and wait_layer(l) makes the
    stream wait for layer l on the device (ferry_kv_op_stream_wait_layer).
    On "host", device memory comes from device_empty(); after close() such a
    tensor keeps its memory (the device closes with the last of them).
    """

    def __init__(self, model, layout, l1=None, l2=None, *, l2_dir=None, l2_bytes=None,
                 persistent=False, reset=False, chunk_tokens=0, hash_seed=0, tp_rank=0,
                 tp_world=1, remote=None, workers=0, l2_engine=None, l2_direct=True,
                 eviction="lru", server=None, server_timeout_ms=0, lookup_only=False,
                 device=None, pool_wait_ms=300):
        self._h = None
        self._closing = False   # close() began the C store's close (ferry_kv_close_begin)
        self._guard = CallGuard("KVStore")
        self._released = False   # close() released everything
        # one close() at a time releases; an RLock to know its owner: a
        # close() inside this thread's own (a signal handler's, a __del__'s)
        self._close_lock = threading.RLock()
        self._salt_reqs = {}
        self._dev = None
        self._devmem = None
        self._devhold = None   # what device_empty() tensors hold ("host" only)
        self._streams = {}
        if server is not None:
            if l1 is not None or l2 is not None or l2_dir is not None or remote is not None:
                raise ValueError("ferry: with server= the daemon owns the tiers: "
                                 "give no l1, l2 or remote")
            l1 = 0 if lookup_only else 1
        elif l1 is None:
            raise ValueError("ferry: an in-process store needs l1 (its host pool size)")
        elif lookup_only:
            raise ValueError("ferry: lookup_only is for a store opened with server=")
        l2_dirs = None
        if l2 is not None:
            specs = [l2] if isinstance(l2, (str, bytes, os.PathLike)) else list(l2)
            parsed = []
            for spec in specs:
                d, sep, sz = os.fsdecode(spec).rpartition(":")
                if not sep or not d:
                    raise ValueError(f"ferry: l2 is 'DIR:SIZE' or a list of them, got {spec!r}")
                parsed.append((d, parse_size(sz)))
            if not parsed or len({sz for _, sz in parsed}) != 1:
                raise ValueError("ferry: l2 directories need one SIZE, the same on each "
                                 f"(the slab is striped evenly), got {l2!r}")
            l2_bytes = parsed[0][1]
            if len(parsed) == 1:
                l2_dir = parsed[0][0]
            else:
                l2_dirs = [d for d, _ in parsed]
        if not isinstance(layout, Layout):
            raise TypeError(f"ferry: layout is a ferry.Layout, got {type(layout).__name__}")
        for what, v in (("chunk_tokens", chunk_tokens), ("tp_rank", tp_rank),
                        ("tp_world", tp_world), ("workers", workers),
                        ("server_timeout_ms", server_timeout_ms), ("pool_wait_ms", pool_wait_ms)):
            _u32_arg(v, what)
        self.layout = layout
        self._strs = []
        c = A.KVConfig()
        c.model = self._s(model)
        c.tp_rank, c.tp_world = tp_rank, tp_world
        c.layout = layout.c
        c.chunk_tokens = chunk_tokens
        c.hash_seed = _u64_arg(hash_seed, "hash_seed")
        c.l1_bytes = parse_size(l1)
        if l2_dir is not None:
            c.l2_dir = self._s(os.fspath(l2_dir))
            c.l2_bytes = parse_size(l2_bytes if l2_bytes is not None else 0)
        if l2_dirs:
            self._l2_dirs = (ctypes.c_char_p * len(l2_dirs))(*[self._s(d) for d in l2_dirs])
            c.l2_dirs = ctypes.cast(self._l2_dirs, ctypes.POINTER(ctypes.c_char_p))
            c.l2_n_dirs = len(l2_dirs)
            c.l2_bytes = l2_bytes
        c.l2_direct = 1 if l2_direct else 0
        c.l2_engine = self._s(l2_engine)
        pol = {"lru": 0, "s3fifo": 1}
        if eviction not in pol:
            raise ValueError(f"ferry: eviction is 'lru' or 's3fifo', got {eviction!r}")
        c.l1_policy = c.l2_policy = pol[eviction]
        c.workers = workers
        c.l2_persistent = 1 if persistent else 0
        c.l2_reset = 1 if reset else 0
        c.remote_url = self._s(remote)
        c.server = self._s(server)
        c.server_timeout_ms = server_timeout_ms
        # back-pressure: how long a call that finds every L1 slot locked waits
        # for one (ferry_kv_config.pool_wait_ms; 0 declines at once)
        c.pool_wait_ms = pool_wait_ms
        if device is not None:
            self._open_device(device)
            c.device = self._dev
        self._cfg = c
        h = ctypes.c_void_p()
        try:
            check(lib.ferry_kv_open(ctypes.byref(c), ctypes.byref(h)), "ferry_kv_open")
        except BaseException:
            self.close()
            raise
        self._h = h
        self.chunk_tokens = lib.ferry_kv_chunk_tokens(h)
        self.chunk_bytes = lib.ferry_kv_chunk_bytes(h)

    def _s(self, s):
        if s is None:
            return None
        b = s.encode() if isinstance(s, str) else bytes(s)
        self._strs.append(b)
        return b

    def _call(self, fn, *args):
        """fn(handle, *args) as one call inside the store: close() waits for it."""
        h = self._h   # (valid while a call is inside: close() frees it after its end())
        rc = self._guard.call(fn, h, *args) if h else REFUSED
        if rc is REFUSED:
            raise self._guard.refused("the store", "KVStore")
        if rc == _FERRY_ESTATE and self._closing:
            # C refused it ("the store is closing"): it came in after close()
            # began, as one the guard refuses does
            raise self._guard.refused("the store", "KVStore")
        return rc

    def _open_device(self, device):
        kind, ordinal = device_spec(device)
        spec = str(device)
        opt = A.DeviceOptions()
        self._backend = kind.encode()
        opt.backend = self._backend
        opt.ordinal = ordinal
        h = ctypes.c_void_p()
        check(lib.ferry_device_open(ctypes.byref(opt), ctypes.byref(h)), f"device {spec!r}")
        self._dev = h
        self._devmem = DeviceMem(kind, ordinal)
        if kind == "host":
            self._devhold = _DeviceMemory()

    @property
    def device(self):
        """The store's device as "cuda:N" or "host", or None."""
        return self._devmem.name() if self._devmem is not None else None

    def device_empty(self, shape, dtype):
        """An uninitialised tensor in the store's device memory: on "cuda:N",
        torch.empty on that GPU; on "host", memory from ferry_device_alloc
        viewed as a CPU tensor that the store takes as FERRY_KV_MEM_DEVICE
        (the host backend's device pointers are host addresses). The tensor
        keeps that memory: after close() it is still there (the device
        closes with the last such tensor)."""
        import torch
        if self._devmem is None:
            raise ValueError("ferry: device_empty needs a store opened with device=")
        if self._devmem.kind == "cuda":
            return torch.empty(shape, dtype=dtype, device=self.device)
        shape = tuple(int(d) for d in shape)
        item = torch.empty((), dtype=dtype).element_size()
        n = int(np.prod(shape, dtype=np.int64)) * item
        if n <= 0:
            raise ValueError(f"ferry: device_empty of shape {list(shape)} holds no bytes")
        ptr = ctypes.c_uint64()

        def alloc(_h):   # inside the store's guard: a close() waits, the device stays open
            check(lib.ferry_device_alloc(self._dev, n, ctypes.byref(ptr)), "device_empty")
            host = lib.ferry_devptr_host(self._dev, ptr.value)
            if not host:
                lib.ferry_device_free(self._dev, ptr.value)
                raise FerryError(-errno.EINVAL, "device memory is not host-addressable",
                                 "device_empty")
            return host, self._devhold   # (taken inside: a close after it hands it the device)
        host, hold = self._call(alloc)
        self._devmem.allocs[host] = n
        raw = (ctypes.c_uint8 * n).from_address(host)
        raw._ferry_mem = hold   # every view of raw's bytes holds the device
        return torch.from_numpy(np.frombuffer(raw, np.uint8)).view(dtype).reshape(shape)

    def _on_engine_stream(self, fn):
        """fn(stream) with the engine's current CUDA stream as a ferry_stream
        (_engine_stream), both inside the store's guard: a close() from
        another thread waits until fn returned, so the stream and the device
        it was imported on stay open while the lookup and fn's C call use
        them. A closed store (or a forked child's copy) raises FerryError
        (EBADF) before the lookup."""
        return self._call(lambda _h: fn(self._engine_stream()))

    def _engine_stream(self):
        """The engine's current CUDA stream as a ferry_stream (imported once per
        stream and kept until close), or None on a backend without raw streams.
        Only inside the store's guard (_on_engine_stream): close() destroys the
        streams and closes the device."""
        if self._devmem is None or self._devmem.kind != "cuda":
            return None
        import torch
        handle = int(torch.cuda.current_stream(self._devmem.ordinal).cuda_stream)
        s = self._streams.get(handle)
        if s is None:
            s = ctypes.c_void_p()
            check(lib.ferry_stream_import(self._dev, handle, ctypes.byref(s)), "stream import")
            self._streams[handle] = s
        return s

    def _sync_engine(self, buf):
        """Before a call that reads or writes CUDA tensors at once: the engine's
        pending work on its current stream is finished."""
        if buf.device and self._devmem.kind == "cuda":
            import torch
            torch.cuda.current_stream(self._devmem.ordinal).synchronize()

    def _buffer(self, data, block_table, writable):
        return Buffer(self.layout, data, block_table, writable=writable, dev=self._devmem)

    # -- life --
    def close(self):
        """Close the store: later calls raise FerryError (EBADF); calls other
        threads are inside end first. One waiting for an L1 slot
        (back-pressure, up to pool_wait_ms; in process or through a daemon)
        stops waiting at once and raises FerryError (ECANCELED) naming the
        close (ferry_kv_close_begin: what it stored or loaded whole before
        stays so, nothing torn), so close returns in milliseconds; the
        others finish. Through a daemon, every store or retrieve still
        awaiting the daemon's answer counts as waiting (the daemon may hold
        it for a slot). Ops it started stay valid (close finishes them: one
        waiting for a slot ends ECANCELED) and are freed on their own. Safe
        to call again, and from several threads at once: one releases the
        store, its streams and its device (after every call inside
        returned), the others return once it has. A close an interrupt
        (KeyboardInterrupt) stopped is finished by the next close() from
        any thread: none waits for the interrupted one to come back. A
        close() made inside a call of its own thread on the store, or in
        its own close (a signal handler's, a __del__'s), returns at once:
        later calls are refused, and the call (or close) below it releases
        the store as it leaves."""
        guard = getattr(self, "_guard", None)
        if guard is None:
            return
        if guard.forked:     # a forked child's copy: the parent's to release
            self._h = self._dev = None
            self._streams = {}
            return
        if self._released:
            return
        # begin the close inside the guard: the calls inside stop waiting for
        # slots, and no close can free the handle while this is in it
        h = self._h
        if h and not guard.ended:
            guard.call(self._close_begin, h)
        # the first end() refuses new calls; then any thread finishes the
        # release, one at a time, as an op's free does (_Flight.finish): a
        # close an interrupt stopped in one thread (which may never come
        # back to it) is gone on with by the next close, never waited for.
        # A close inside a call of its own thread (a signal handler's, a
        # __del__'s) waits for nothing: that call releases as it leaves
        guard.end(self._finish_close)
        self._finish_close()

    def _finish_close(self):
        """The release, once the guard ended: by close(), or by the last call
        out of the guard (CallGuard.on_last). Returns without it while this
        thread holds the release lock (a close inside its own release:
        that release goes on once this returns) or has a call inside the
        store (which releases as it leaves)."""
        lock = self._close_lock
        if lock._is_owned():
            return
        with lock:    # (only `with`: its release cannot be skipped)
            if not self._released and self._guard.drain():
                self._release()

    def _release(self):
        """By _finish_close alone, under _close_lock, once no call is
        inside: free the store, its orphan ops, streams and device. Each
        handle stays where a release made again finds it until it is
        freed, and is taken out in the same step (free_and_forget): a
        release an interrupt stopped, made again (by any thread), frees
        each once and leaks none."""
        if self._h:
            free_and_forget(lib.ferry_kv_close, self._h, setattr, self, "_h", None)
        _reap(block=True, kv=self)   # orphans of it (close finished them)
        streams = self._streams
        while streams:
            k = next(iter(streams))
            free_and_forget(lib.ferry_stream_destroy, streams[k], streams.pop, k)
        if self._dev:
            hold = self._devhold
            if hold is not None:   # closed now, or with the last device_empty() tensor
                hold.dev = self._dev   # (made again after an interrupt: the same)
                self._dev = None
                self._devhold = hold = None
            else:
                free_and_forget(lib.ferry_device_close, self._dev, setattr, self, "_dev", None)
        self._released = True
        self._guard.released()

    def _close_begin(self, h):
        self._closing = True
        lib.ferry_kv_close_begin(h)

    # -- lookups --
    def lookup(self, tokens, *, salt=None, partial=False):
        """Leading tokens of `tokens` that are cached (whole chunks)."""
        arr, p = tokens_array(tokens)
        if salt is None and not partial:  # the common case: no request options to build
            return check(self._call(lib.ferry_kv_lookup, p, arr.size, None), "lookup")
        req = _Req(salt, partial)
        return check(self._call(lib.ferry_kv_lookup, p, arr.size, req.ptr()), "lookup")

    def lookup_tiers(self, tokens, *, salt=None, partial=False):
        """(cached tokens, [tier name per chunk up to and including the first miss])."""
        arr, p = tokens_array(tokens)
        n = -(-arr.size // self.chunk_tokens)
        req = _Req(salt, partial, n)
        hit = check(self._call(lib.ferry_kv_lookup, p, arr.size, req.ptr()), "lookup")
        k = min(n, -(-hit // self.chunk_tokens) + 1)
        return hit, [TIER_NAMES[req.tiers[i]] for i in range(k)]

    # -- moving KV --
    def _op(self, fn, name, tokens, data, block_table, salt, partial, writable, statuses,
            skip=0):
        _reap()   # ops dropped by an interrupted __del__, over since
        arr, p = tokens_array(tokens)
        buf = self._buffer(data, block_table, writable)
        n = -(-arr.size // self.chunk_tokens) if statuses else 0
        req = _Req(salt, partial, n, skip)
        self._sync_engine(buf)
        rc = self._call(fn, p, arr.size, req.ptr(), ctypes.byref(buf.c))
        self._check_moved(buf, name, writable, lambda: self._forget_stored(arr, req))
        rc = check(rc, name)
        if statuses:
            return rc, list(req.status)
        return rc

    def _check_moved(self, buf, name, writable, forget):
        """After a blocking call on buf: FerryError (EFAULT) when one of its
        tensors moved while the call ran (another thread's resize_, set_ or
        .data =; ctypes lets the GIL go for the call): a retrieve's tensor
        does not hold the bytes loaded; a store may have read memory torch
        freed under it, so forget() deletes what it stored first."""
        moved = buf.moved_from() if buf.addrs else None
        if moved is None:
            return
        left = forget() if not writable else None
        raise _moved_error(moved, "call", not writable, name, left)

    # how long a moved store's delete waits for a lock on what it stored
    _FORGET_WAIT_S = 2.0

    def _forget(self, fn, *args):
        """fn(handle, *args), a delete of what a store whose source moved
        stored. The store's own write-throughs hold those chunks as it
        returns (an L2's l2_writing, a remote put's read lock; a remote put
        still queued would land after the delete), so they are flushed
        first, and a lock another thread holds a moment (a retrieve copying
        them out) is waited for up to _FORGET_WAIT_S. The delete is then
        synced: a persistent L2 may hold the write-through durably already
        (another thread's sync), and a crash must not bring it back. None
        once deleted, else why some of it stays (a pin held on, the store
        closed, the sync failed)."""
        try:
            self._call(lib.ferry_kv_flush)
            until = time.monotonic() + self._FORGET_WAIT_S
            while True:
                rc = self._call(fn, *args)
                if rc != ELOCKED or time.monotonic() >= until:
                    break
                time.sleep(0.002)
            why = None if rc >= 0 else lib.ferry_last_error().decode(errors="replace")
            synced = self._call(lib.ferry_kv_sync)
            if rc >= 0 and synced < 0:
                rc, why = synced, lib.ferry_last_error().decode(errors="replace")
        except FerryError as e:
            return f"the store was closed first ({e.message})"
        if rc >= 0:
            return None
        return f"{why or strerror(rc)} ({err_name(rc)})"

    def _forget_stored(self, arr, req):
        return self._forget(lib.ferry_kv_delete,
                            arr.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), arr.size,
                            req.ptr())

    def store(self, tokens, kv, block_table=None, *, salt=None, partial=False, statuses=False):
        """Store the KV of `tokens` from `kv`: vLLM's per-layer paged caches with
        `block_table`, or one contiguous tensor [kv][layers][tokens][heads*head_dim].
        Returns the leading tokens stored or already present (and per-chunk codes
        with statuses=True). A source another thread resized or re-pointed
        while the call ran: FerryError (EFAULT), what it stored deleted."""
        return self._op(lib.ferry_kv_store, "store", tokens, kv, block_table, salt, partial,
                        False, statuses)

    def retrieve(self, tokens, kv, block_table=None, *, salt=None, partial=False, statuses=False,
                 skip=0):
        """Load the cached KV of `tokens` into `kv` (same forms as store). Returns
        the leading tokens loaded; every chunk present is copied, past a miss
        too (statuses=True says which), and chunks not loaded leave their
        destination as it was.
        skip: leading tokens the engine already holds; nothing below it is written.
        A `kv` another thread resized or re-pointed while the call ran (it does
        not hold the bytes loaded): FerryError (EFAULT)."""
        return self._op(lib.ferry_kv_retrieve, "retrieve", tokens, kv, block_table, salt,
                        partial, True, statuses, skip)

    def _async(self, fn, name, tokens, data, block_table, salt, partial, writable, skip=0):
        _reap()   # ops dropped by an interrupted __del__, over since
        arr, p = tokens_array(tokens)
        buf = self._buffer(data, block_table, writable)
        req = _Req(salt, partial, 0, skip)
        self._sync_engine(buf)
        # the Op holds the handle (and the buffers) before C hands it out: an
        # interrupt as the call returns drops the Op, whose free waits for the
        # op, never a handle in flight whose buffers nothing holds
        h = ctypes.c_void_p()
        op = Op(self, h, (buf, req, arr), name)
        check(self._call(fn, p, arr.size, req.ptr(), ctypes.byref(buf.c), ctypes.byref(h)), name)
        return op

    def store_async(self, tokens, kv, block_table=None, *, salt=None, partial=False):
        """store as an Op: its wait() returns the leading tokens stored."""
        return self._async(lib.ferry_kv_store_async, "store_async", tokens, kv, block_table,
                           salt, partial, False)

    def retrieve_async(self, tokens, kv, block_table=None, *, salt=None, partial=False, skip=0):
        """retrieve as an Op: its wait() returns the leading tokens loaded."""
        return self._async(lib.ferry_kv_retrieve_async, "retrieve_async", tokens, kv,
                           block_table, salt, partial, True, skip)

    def _layers(self, fn, name, tokens, data, block_table, salt, partial, writable, skip=0):
        _reap()   # ops dropped by an interrupted __del__, over since
        arr, p = tokens_array(tokens)
        buf = self._buffer(data, block_table, writable)
        req = _Req(salt, partial, 0, skip)
        if writable:   # a retrieve writes the engine's memory: its pending reads first
            self._sync_engine(buf)
        opt = A.KVLayersOpt()
        h = ctypes.c_void_p()   # (held by the op before the call: as _async's)
        op = LayerOp(self, h, (buf, req, arr, opt), name, self.layout.num_layers,
                     fn is lib.ferry_kv_store_layers)
        check(self._call(fn, p, arr.size, req.ptr(), ctypes.byref(buf.c), ctypes.byref(opt),
                         ctypes.byref(h)), name)
        return op

    def retrieve_layers(self, tokens, kv, block_table=None, *, salt=None, partial=False, skip=0):
        """Start a layer-by-layer retrieve into `kv` (forms as retrieve): the
        cached chunks are held first, then layer 0 of every chunk is copied,
        layer 1, ...; LayerOp.wait_layer(l) waits for one layer, wait() for all."""
        return self._layers(lib.ferry_kv_retrieve_layers, "retrieve_layers", tokens, kv,
                            block_table, salt, partial, True, skip)

    def store_layers(self, tokens, kv, block_table=None, *, salt=None, partial=False):
        """Start a layer-by-layer store from `kv` (forms as store): the chunks'
        slots are reserved now; LayerOp.layer_done(l) copies layer l; after the
        last layer the chunks are stored and wait() returns the tokens stored."""
        return self._layers(lib.ferry_kv_store_layers, "store_layers", tokens, kv, block_table,
                            salt, partial, False)

    # -- chunks named by the caller --
    @staticmethod
    def _names(names):
        """A ferry_kv_name array over the names (bytes, or str as UTF-8), and
        what keeps their bytes alive."""
        keep = _name_bytes(names)
        arr = (A.KVName * len(keep))(*[(b, len(b)) for b in keep])
        return arr, keep

    def _salt_req(self, salt):
        """A request with only a salt, made once per salt (nothing writes it);
        an unhashable salt (bytearray, a memoryview of one: ValueError) gets
        one of its own."""
        try:
            req = self._salt_reqs.get(salt)
        except (TypeError, ValueError):
            return _Req(salt, False)
        if req is None:
            if len(self._salt_reqs) >= 256:
                self._salt_reqs.clear()
            req = self._salt_reqs[salt] = _Req(salt, False)
        return req

    def _named(self, fn, what, names, data=None, block_table=None, salt=None, writable=False,
               statuses=False):
        arr, keep = self._names(names)
        req = _Req(salt, False, len(keep)) if statuses else self._salt_req(salt)
        args = [arr, len(keep), req.ptr()]
        buf = None
        if data is not None:
            buf = self._buffer(data, block_table, writable)
            self._sync_engine(buf)
            args.append(ctypes.byref(buf.c))
        rc = self._call(fn, *args)
        if buf is not None:
            self._check_moved(buf, what, writable, lambda: self._forget(
                lib.ferry_kv_delete_named, arr, len(keep), req.ptr()))
        rc = check(rc, what)
        return (rc, list(req.status)) if statuses else rc

    def store_named(self, names, kv, block_table=None, *, salt=None, statuses=False):
        """Store chunk i of `kv` (tokens [i*chunk_tokens, (i+1)*chunk_tokens))
        under names[i] (str or bytes, an engine's own page key). Returns the
        leading chunks stored or present (and per-chunk codes with
        statuses=True). A name given twice in one call is refused
        (ValueError naming it and both chunks): one name is one chunk, and
        two chunks under it would keep one and drop the other's bytes."""
        keep = _name_bytes(names)
        if len(set(keep)) != len(keep):
            seen = {}
            for i, n in enumerate(keep):
                if n in seen:
                    raise ValueError(f"ferry: store_named: name {n!r} is given twice, for "
                                     f"chunks {seen[n]} and {i}: one name is one chunk")
                seen[n] = i
        return self._named(lib.ferry_kv_store_named, "store_named", keep, kv, block_table,
                           salt, False, statuses)

    def retrieve_named(self, names, kv, block_table=None, *, salt=None, statuses=False):
        """Load every cached chunk of `names` into `kv` (chunk i at tokens
        [i*chunk_tokens, ...)); returns the leading chunks loaded."""
        return self._named(lib.ferry_kv_retrieve_named, "retrieve_named", names, kv,
                           block_table, salt, True, statuses)

    def lookup_named(self, names, *, salt=None):
        """The leading chunks of `names` that are cached. Names of one length
        go packed (lookup_named_packed), the others as an array."""
        keep = _name_bytes(names)
        n = len(keep)
        if n == 1:
            return self.lookup_named_packed(keep[0], len(keep[0]), 1, salt=salt)
        if n and len(set(map(len, keep))) == 1:
            return self.lookup_named_packed(b"".join(keep), len(keep[0]), n, salt=salt)
        return self._named(lib.ferry_kv_lookup_named, "lookup_named", keep, salt=salt)

    def lookup_named_packed(self, names, name_len, n, *, salt=None):
        """The leading chunks cached of n names of name_len bytes each, back
        to back in `names` (bytes of at least n * name_len bytes): as
        lookup_named, with no array of names built (ferry_kv_lookup_named_
        packed), for an engine's exists on its scheduling path."""
        if not isinstance(names, bytes):
            raise TypeError(f"ferry: packed names are bytes, got {type(names).__name__}")
        if name_len < 0 or n < 0 or len(names) < name_len * n:
            raise ValueError(f"ferry: {n} packed names of {name_len} bytes need "
                             f"{max(0, name_len * n)} bytes, got {len(names)}")
        try:
            req = self._salt_reqs[salt]
        except (KeyError, TypeError, ValueError):   # a salt not seen yet, or unhashable
            req = self._salt_req(salt)
        guard = self._guard
        h = self._h
        # sizes as ctypes objects: argtypes then passes them on unconverted
        rc = guard.call(lib.ferry_kv_lookup_named_packed, h, names,
                        _SIZES[name_len] if name_len < _NSIZES else name_len,
                        _SIZES[n] if n < _NSIZES else n, req.c) if h else REFUSED
        if rc is REFUSED:
            raise guard.refused("the store", "KVStore")
        if rc == _FERRY_ESTATE and self._closing:   # (as _call says)
            raise guard.refused("the store", "KVStore")
        return rc if rc >= 0 else check(rc, "lookup_named")

    def delete_named(self, names, *, salt=None):
        """Delete the named chunks; returns how many were deleted."""
        return self._named(lib.ferry_kv_delete_named, "delete_named", names, salt=salt)

    def _tok(self, fn, name, tokens, salt, partial):
        arr, p = tokens_array(tokens)
        req = _Req(salt, partial)
        return check(self._call(fn, p, arr.size, req.ptr()), name)

    def prefetch(self, tokens, *, salt=None, partial=False):
        """Bring the leading chunks of `tokens` found only in L2 (or remote) up
        to L1 in the background; returns the leading tokens in L1 or on
        their way."""
        return self._tok(lib.ferry_kv_prefetch, "prefetch", tokens, salt, partial)

    def pin(self, tokens, *, salt=None, partial=False):
        """Read-lock the leading cached chunks of `tokens`: no eviction, delete
        or clear takes them until unpin (or the lock's TTL); returns the
        leading tokens pinned."""
        return self._tok(lib.ferry_kv_pin, "pin", tokens, salt, partial)

    def unpin(self, tokens, *, salt=None, partial=False):
        """Drop one pin from each leading pinned chunk; returns the tokens unpinned."""
        return self._tok(lib.ferry_kv_unpin, "unpin", tokens, salt, partial)

    def delete(self, tokens, *, salt=None, partial=False):
        """Delete the chunks of `tokens` from every tier; returns the chunks
        deleted. A locked chunk (pinned, being read or written) stays:
        FerryError (FERRY_ELOCKED) once the others are deleted."""
        return self._tok(lib.ferry_kv_delete, "delete", tokens, salt, partial)

    def clear(self):
        """Delete every unlocked chunk from the local tiers; returns how many,
        or FerryError (FERRY_ELOCKED) when locked ones remain."""
        return check(self._call(lib.ferry_kv_clear), "clear")

    def flush(self):
        """Wait until every queued op, write-through and prefetch is done."""
        return check(self._call(lib.ferry_kv_flush), "flush")

    def sync(self):
        """flush(), then make what was written through to a persistent L2
        durable; returns how many chunks written through since the last
        sync are durable now (0 without a persistent L2)."""
        return check(self._call(lib.ferry_kv_sync), "sync")

    # -- metrics --
    def stats(self):
        """A snapshot of the store's counters as a dict (tiers as a nested dict)."""
        s = A.KVStats()
        check(self._call(lib.ferry_kv_stats_get, ctypes.byref(s)), "stats")
        out = {}
        for name, _ in A.KVStats._fields_:
            if name == "size":
                continue
            v = getattr(s, name)
            if name == "tier":
                out[name] = {TIER_NAMES[i]: {f: getattr(v[i], f) for f, _ in A.KVTierStats._fields_}
                             for i in range(1, A.KV_TIERS)}
            elif isinstance(v, ctypes.Array):  # (the latency histograms)
                out[name] = list(v)
            else:
                out[name] = v
        return out

    def prometheus(self):
        """The store's metrics in Prometheus text exposition format."""
        need = check(self._call(lib.ferry_kv_metrics_prometheus, None, 0), "metrics")
        while True:
            buf = ctypes.create_string_buffer(need + 1)
            n = check(self._call(lib.ferry_kv_metrics_prometheus, buf, need + 1), "metrics")
            if n <= need:
                return buf.value.decode()
            need = n


def quantile(hist, q):
    """The q-quantile, in nanoseconds, of one of stats()' *_ns histograms."""
    arr = (ctypes.c_uint64 * A.KV_HIST_BUCKETS)(*hist)
    return lib.ferry_kv_hist_quantile(arr, q)


def hash_chunks(tokens, chunk_tokens=256, seed=0x66657272794b5631, partial=False):
    """ferry's chained chunk hashes of `tokens` as 16-byte little-endian values."""
    arr, p = tokens_array(tokens)
    n = check(lib.ferry_kv_hash_chunks(seed, p, arr.size, chunk_tokens, 1 if partial else 0,
                                       None, 0), "hash_chunks")
    out = (A.KVHash * n)()
    check(lib.ferry_kv_hash_chunks(seed, p, arr.size, chunk_tokens, 1 if partial else 0, out, n),
          "hash_chunks")
    return [h.lo.to_bytes(8, "little") + h.hi.to_bytes(8, "little") for h in out]


__all__ = ["KVStore", "Layout", "Op", "LayerOp", "parse_size", "quantile", "hash_chunks",
           "TIER_NONE", "TIER_L1", "TIER_L2", "TIER_REMOTE", "np"]
