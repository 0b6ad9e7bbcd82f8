"""The MoE expert pool (ferry/moe.h) for Python: a bounded pool of expert
slots on a device, a planner that decides which experts stay, and an
executor that copies only the rows that are missing.

    pool = ferry.ExpertPool(num_layers=2, num_experts=8, slots=6,
                            banks=[w1_rows, w2_rows])         # host tensors, one per bank
    slot_of = pool.ensure(layer, experts)                     # plan + copy what is missing
    w1 = pool.slot_tensor(0, torch.float32, (ffn, dim))       # the slots as a tensor
    w1[slot_of[i]]                                            # expert experts[i]'s rows

Banks hold the rows packed [layer][expert][row bytes] (bank b's row of
expert e of layer l at ((l * num_experts) + e) * row_bytes[b]); the same
layout in a file (bank after bank) is a source too (rows_file=).

Predicted routes (a pre-gating predictor's next layer, a speculative draft's
next tokens) go to the planner as hints, with a confidence:

    pool.hint(layer + 1, 1, predicted, confidence=0.9)   # the next ensure()
    pool.hint_prefetch(max_rows=4)                       # copy the likely ones now
    pool.hint_stats()                                    # right, wrong, fetched, ...

The planner alone (no memory, no copies) is ferry.moe.Planner.
"""
import ctypes
import errno
import functools
import numbers
import os
import threading

import numpy as np

from . import _abi as A
from ._handle import NOT_OPENED, Closing, Opened, free_and_forget
from ._buffers import describe, device_spec, is_torch, is_torch_device, storage_of
from ._lib import lib
from .errors import FerryError, check

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None


def policies():
    """The planner's eviction policies ("lru", "routing", "belady", ...)."""
    arr = lib.ferry_moe_policies()
    out, i = [], 0
    while arr[i]:
        out.append(arr[i].decode())
        i += 1
    return out


def _bank_addr(x):
    """A bank's address now: its dtype, whatever it became, is not asked
    (the rows source reads bytes; describe() refuses a dtype ferry has no
    code for, which a bank given .data = of another dtype may have)."""
    if is_torch(x):
        return x.data_ptr()
    if isinstance(x, np.ndarray):
        return x.__array_interface__["data"][0]
    raise TypeError(f"ferry: an expert bank is a torch.Tensor or numpy.ndarray, got "
                    f"{type(x).__name__}")


def _kept_addr(keep):
    """Where what storage_of() kept for a bank holds its bytes now: it moves
    when the memory the rows source reads is freed (a storage resized,
    resize_() past capacity, or an array resized in place), whatever
    address the bank tensor shows meanwhile."""
    if isinstance(keep, np.ndarray):
        return keep.__array_interface__["data"][0]
    return keep.data_ptr()


def _bank_bytes(x):
    """(address, bytes) of a contiguous host tensor or array."""
    addr, shape, strides, dt, dev = describe(x)
    if dev:
        raise ValueError("ferry: expert banks are host memory (a CPU tensor or array)")
    n = 1
    for d in shape:
        n *= d
    want, acc = [], 1
    for d in reversed(shape):
        want.append(acc)
        acc *= d
    if tuple(reversed(want)) != tuple(strides):
        raise ValueError("ferry: an expert bank must be contiguous")
    item = x.element_size() if is_torch(x) else x.dtype.itemsize
    return addr, n * item


_U32_MAX = 2**32 - 1


def _int(v, what):
    """An integer argument as a Python int: an int, a numpy integer, or a
    numpy or torch integer scalar (0-d: a size computed with either, as
    ctypes took them); bools, floats and arrays are a TypeError."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        if isinstance(v, np.ndarray):
            ok = v.ndim == 0 and v.dtype.kind in "iu"
        elif is_torch(v):
            ok = v.ndim == 0 and not (v.is_floating_point() or v.is_complex()
                                      or v.dtype == torch.bool)
        else:
            ok = False
        if not ok:
            raise TypeError(f"ferry: {what} is an integer, got {type(v).__name__} {v!r}")
    return int(v)


def _u32(v, what):
    """An integer argument C takes as uint32 (a layer, a slot, a count): a
    negative value or one past 2^32-1 is refused here, where ctypes would
    wrap it onto another value (2^32 + 1 onto 1)."""
    v = _int(v, what)
    if not 0 <= v <= _U32_MAX:
        raise FerryError(-errno.EINVAL, f"{what} {v} is outside 0 .. 2^32-1")
    return int(v)


def _u64(v, what):
    """An integer C takes as uint64 or size_t (expert_bytes, row_bytes): refused
    outside 0 .. 2^64-1, where ctypes would wrap it (-1 onto 2^64-1)."""
    v = _int(v, what)
    if not 0 <= v <= 2**64 - 1:
        raise FerryError(-errno.EINVAL, f"{what} {v} is outside 0 .. 2^64-1")
    return int(v)


def _shape(num_layers, num_experts, slots):
    """The (num_layers, num_experts, slots) of a planner or pool as C's uint32
    fields take them: checked here, where a structure's field would wrap
    2^32 + 4 slots onto 4 (the C side then checks their ranges)."""
    return (_u32(num_layers, "num_layers"), _u32(num_experts, "num_experts"),
            _u32(slots, "slots"))


def _u32s(experts):
    """Expert ids as a contiguous uint32 array: a sequence (or array, or
    tensor) of integers, one-dimensional. Floats, bools and strings are a
    TypeError and ids outside 0 .. 2^32-1 a FerryError (EINVAL) naming the
    first, before a cast could truncate 1.7 onto 1 or wrap 2^32 + 1 onto 1."""
    if is_torch(experts):
        experts = experts.detach().cpu().numpy()
    arr = experts if isinstance(experts, np.ndarray) else np.asarray(experts)
    if arr.ndim != 1:
        raise ValueError(f"ferry: expert ids are one-dimensional, got shape {arr.shape}")
    if arr.size and arr.dtype == object:   # ints past int64, or other objects
        for i, v in enumerate(arr):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"ferry: expert ids must be integers, got "
                                f"{type(v).__name__} {v!r} at position {i}")
            if not 0 <= v <= _U32_MAX:
                raise FerryError(-errno.EINVAL, f"expert id {v} at position {i} is outside "
                                 "0 .. 2^32-1")
        arr = arr.astype(np.uint64)
    if arr.size and arr.dtype.kind not in "iu":
        raise TypeError(f"ferry: expert ids must be integers, got dtype {arr.dtype}")
    if arr.size and arr.dtype.kind == "i":
        bad = (arr < 0) | (arr > _U32_MAX)
    else:
        bad = arr > _U32_MAX if arr.size else np.zeros(0, bool)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise FerryError(-errno.EINVAL, f"expert id {int(arr[i])} at position {i} is outside "
                         "0 .. 2^32-1")
    ex = np.ascontiguousarray(arr, dtype=np.uint32)
    return ex, ex.ctypes.data_as(ctypes.POINTER(ctypes.c_uint32))


def _locked(fn):
    """One call at a time on the object (ferry/moe.h: each object is used by
    one thread at a time): threads calling ensure() at once are serialized,
    and a close() from another thread waits for the call inside. In a
    forked child the object is its parent's: calls raise FerryError (EBADF)
    before the lock (a thread the child lacks may have held it), and close()
    forgets the handles, calling no C (ferry/_handle.py).

    After close() calls raise FerryError (EBADF), checked under the lock.
    A close() made inside a call of its own thread (a signal handler's, a
    __del__'s, a weakref callback's, run between two bytecodes of that
    call, which may be between two C calls on the handles) only marks the
    object closed (_Life.close): the call goes on, and the release is made
    by the outermost call of the thread as it leaves the lock.

    Any other call made inside a call of its own thread on the object (a
    signal handler's ensure() inside ensure()) is refused, FerryError
    (EBUSY) naming the object and the call in progress: the lock is that
    thread's own and lets it in, where it would settle (drop) the outer
    call's pending plan, whose rows the outer call then copies into slots
    the planner no longer counts as theirs."""
    name = fn.__name__

    @functools.wraps(fn)
    def call(self, *args, **kwargs):
        where = self._where
        if where.forked:
            raise where.refused(f"the {type(self).__name__}", name)
        try:
            with self._lock:
                if self._closed:
                    raise where.refused(f"the {type(self).__name__}", name)
                busy = self._busy
                if busy is not None:   # (before the try: the outer call's mark stays)
                    raise _reentered(self, name, busy)
                try:
                    self._busy = name   # (only the lock's holder reads or writes it)
                    if self._pending is not None:
                        self._settle_pending()
                    return fn(self, *args, **kwargs)
                finally:
                    self._busy = None
        finally:
            if self._closed:   # (closed during the call: released as it leaves)
                self._finish_close()
    return call


def _reentered(obj, name, busy):
    kind = type(obj).__name__
    return FerryError(-errno.EBUSY, f"{name}() was called on the {kind} inside its own "
                      f"thread's {busy}() on it (a signal handler's, a __del__'s or a weakref "
                      f"callback's call): one call at a time, only close() may come in",
                      f"{kind}.{name}")


class _Life:
    """close() and the release of the object's handles.

    close() marks the object closed (every later call raises), then
    releases the handles under the object's lock: after the call inside
    (another thread's) returned. A close() inside a call of its own thread
    finds the lock its own and returns at once: waiting would wait for
    the call it interrupted, and releasing would free the handles under
    it; that call releases them as it leaves (_locked). The release frees
    each handle and takes it out in one step (free_and_forget): a release
    an interrupt stopped, made again by the next close() (or the garbage
    collection's), frees each handle once and leaks none."""

    _closed = False
    _busy = None   # the name of the call inside (_locked), under the lock

    def close(self):
        if self._where.forked:
            return self._forget_forked()
        self._closed = True
        self._finish_close()

    def _finish_close(self):
        lock = self._lock
        if lock._is_owned():   # (a call of this thread is inside: it releases as it leaves)
            return
        with lock:    # (only `with`: its release cannot be skipped)
            self._pending = None
            self._release()

    def _free(self, attr, fn):
        h = getattr(self, attr, None)
        if h:
            free_and_forget(fn, h, setattr, self, attr, None)


class _Plans:
    """The plan of the call inside (ensure, hint_prefetch) until it is
    returned or copied: `_pending`, set before the C call that fills it.
    An exception (an interrupt as a C call returns, or inside the drop
    itself: _drop_plan is a loop of C calls, each a point it can land
    at) leaves it set, and the next call (any thread's) drops its slots
    first (_settle_pending), so the planner (and the pool's slots) never
    keep an expert in a slot its row did not reach. A drop made twice
    forgets slots already free: a no-op."""

    _pending = None

    def _settle_pending(self):
        plan = self._pending
        if plan is not None:
            _drop_plan(self._planner_h(), plan, self._slots_h())
            self._pending = None


def _policy_bytes(policy):
    if policy is None:
        return None
    if not isinstance(policy, str):
        raise TypeError(f"ferry: policy is a name of ferry.policies() or None, got "
                        f"{type(policy).__name__} {policy!r}")
    return policy.encode()


def _drop_plan(planner, plan, slots=None):
    """The plan's slots are not what the planner placed there (a call cut
    short between the plan and its copy, by an interrupt or a refused
    copy): the planner forgets them, and the executor, when given, marks
    them unknown. Forgetting a free slot is a no-op; a planner call that
    failed changed nothing and left plan.n 0."""
    for i in range(plan.n):
        if slots:
            lib.ferry_moe_slots_invalidate(slots, plan.dst_slots[i])
        lib.ferry_moe_planner_forget(planner, plan.dst_slots[i])


def _plan_dict(plan):
    n = plan.n
    return {"layer": plan.layer, "dst_slots": [plan.dst_slots[i] for i in range(n)],
            "src_rows": [plan.src_rows[i] for i in range(n)]}


def _confidence(v):
    """A hint's confidence as a float: a real number (int, float, Fraction,
    a numpy or torch real scalar); a string ("0.9", which float() would
    parse), a bool, None or a sequence is a TypeError naming it. Its range
    (0..1) is C's."""
    if isinstance(v, bool) or isinstance(v, (np.bool_, str, bytes)):
        ok = False
    elif isinstance(v, numbers.Real):   # (numpy's integers and floats too)
        ok = True
    elif isinstance(v, np.ndarray):
        ok = v.ndim == 0 and v.dtype.kind in "iuf"
    elif is_torch(v):
        ok = v.ndim == 0 and not (v.is_complex() or v.dtype == torch.bool)
    else:
        ok = False
    if not ok:
        raise TypeError(f"ferry: confidence is a number 0..1, got {type(v).__name__} {v!r}")
    return float(v)


def _hint(handle, layer, steps_ahead, experts, confidence):
    ex, ptr = _u32s(experts)
    layer, steps_ahead = _u32(layer, "layer"), _u32(steps_ahead, "steps_ahead")
    confidence = _confidence(confidence)
    return check(lib.ferry_moe_planner_hint(handle, layer, steps_ahead, ptr, ex.size,
                                            confidence), f"hint layer {layer}")


def _hint_stats(handle):
    s = A.MoeHintStats()
    check(lib.ferry_moe_planner_hint_stats_get(handle, ctypes.byref(s)), "hint stats")
    return {f: getattr(s, f) for f, _ in A.MoeHintStats._fields_ if f != "size"}


def _planner_stats(handle):
    s = A.MoePlannerStats()
    check(lib.ferry_moe_planner_stats_get(handle, ctypes.byref(s)), "stats")
    return {f: getattr(s, f) for f, _ in A.MoePlannerStats._fields_ if f != "size"}


class _LastCounts:
    """last_counts: what the calling thread's last ensure() found (its step's
    active, missing, fetched, prefetch_hits), not another thread's that came
    in between; a thread that made no ensure() of its own reads the
    object's last (AttributeError before any). In a forked child they are
    the parent's steps: FerryError (EBADF) naming the fork, as a call."""

    _mine = threading.local()   # until __init__ gives the object its own
    _last = None

    def _counted(self, counts):
        d = {f: getattr(counts, f) for f, _ in A.MoeCounts._fields_}
        self._mine.counts = self._last = d

    @property
    def last_counts(self):
        if self._where.forked:
            raise self._where.refused(f"the {type(self).__name__}", "last_counts")
        d = getattr(self._mine, "counts", None) or self._last
        if d is None:
            raise AttributeError(f"{type(self).__name__}.last_counts: no ensure() yet")
        return d


class Planner(_Life, _Plans, _LastCounts, Closing):
    """The planner of ferry/moe.h alone: which expert lives in which of
    `slots` slots, decided by an eviction policy (None: the library's
    default, "auto"), with no memory and no copies - ensure() returns the slots
    and the copy plan for your own executor. Calls from several threads are
    serialized; after close() they raise FerryError (EBADF)."""

    _lock = threading.RLock()   # until __init__ gives the object its own
    _where = NOT_OPENED

    def __init__(self, num_layers, num_experts, slots, policy=None, expert_bytes=0):
        self._h = None
        self._lock = threading.RLock()
        self._where = Opened()
        self._mine = threading.local()
        num_layers, num_experts, slots = _shape(num_layers, num_experts, slots)
        po = A.MoePlannerOptions(num_layers=num_layers, num_experts=num_experts, slots=slots,
                                 expert_bytes=_u64(expert_bytes, "expert_bytes"))
        self._policy = _policy_bytes(policy)
        po.policy = self._policy
        h = ctypes.c_void_p()
        check(lib.ferry_moe_planner_create(ctypes.byref(po), ctypes.byref(h)), "planner create")
        self._h = h
        self.num_layers, self.num_experts, self.slots = num_layers, num_experts, slots

    def _release(self):
        self._free("_h", lib.ferry_moe_planner_destroy)

    def _forget_forked(self):
        self._h = None

    def _planner_h(self):
        return self._h

    def _slots_h(self):
        return None

    def _need(self):
        if not self._h:
            raise FerryError(-9, "the planner is closed", "Planner")
        return self._h

    @_locked
    def ensure(self, layer, experts):
        """One layer of one step: (the slot of each expert in the order given,
        the copy plan {"layer", "dst_slots", "src_rows"}: copy row
        src_rows[i] of `layer` into slot dst_slots[i], and every slot
        returned then holds its expert). A duplicate id shares its slot and
        row. self.last_counts (the calling thread's last) says what the
        step found. Raises (nothing changes) FerryError EINVAL for a layer
        or an expert out of range or no experts, FERRY_ENOSPACE for more
        distinct experts than slots (split the step: each part's slots are
        kept only until the next ensure()); TypeError for ids that are not
        integers, ValueError for ids not one-dimensional."""
        h = self._need()
        ex, ptr = _u32s(experts)
        layer = _u32(layer, "layer")
        slots = (ctypes.c_uint32 * max(ex.size, 1))()
        plan, counts = A.MoeCopyPlan(), A.MoeCounts()
        self._pending = plan   # until the plan is returned, an interrupt drops what it placed
        try:
            check(lib.ferry_moe_planner_ensure(h, layer, ptr, ex.size, slots, ctypes.byref(plan),
                                               ctypes.byref(counts)), f"ensure layer {layer}")
            self._counted(counts)
            out = [slots[i] for i in range(ex.size)], _plan_dict(plan)
        except BaseException:
            self._settle_pending()
            raise
        self._pending = None
        return out

    @_locked
    def hint(self, layer, steps_ahead, experts, confidence=1.0):
        """`experts` of `layer` are expected at the step `steps_ahead` layer-steps
        from now (1: the next ensure()), right with probability `confidence`:
        eviction keeps them while that (calibrated) is worth more than what it
        evicts instead. Returns the distinct experts hinted. FerryError
        EINVAL (nothing hinted) for a layer or expert out of range, no
        experts, steps_ahead outside 1 .. 2^20 or a confidence outside
        0..1; TypeError for a confidence that is not a number ("0.9")."""
        return _hint(self._need(), layer, steps_ahead, experts, confidence)

    @_locked
    def hint_prefetch(self, max_rows):
        """The copy plan of up to max_rows hinted experts that are missing, the
        most valuable layer first, only those expected to save more copies
        than they cost ({"layer", "dst_slots", "src_rows"}; empty: none).
        It never evicts the experts of the last ensure(): their slots keep
        their rows while the step is computed."""
        plan = A.MoeCopyPlan()
        h = self._need()
        max_rows = _u32(max_rows, "max_rows")
        self._pending = plan   # as ensure(): an interrupt before the plan is returned drops it
        try:
            check(lib.ferry_moe_planner_hint_prefetch(h, max_rows, ctypes.byref(plan)),
                  "hint prefetch")
            out = _plan_dict(plan)
        except BaseException:
            self._settle_pending()
            raise
        self._pending = None
        return out

    @_locked
    def hint_stats(self):
        """hinted, right, wrong, saves, evicted, fetched, live."""
        return _hint_stats(self._need())

    @_locked
    def stats(self):
        return _planner_stats(self._need())

    @_locked
    def lookup(self, layer, expert):
        """The slot holding (layer, expert), or None (also for a layer or an
        expert out of range)."""
        h = self._need()
        s = lib.ferry_moe_planner_lookup(h, _u32(layer, "layer"), _u32(expert, "expert"))
        return None if s == 0xFFFFFFFF else s

    @_locked
    def forget(self, slot):
        """The slot's copy failed: it becomes free and its expert missing (a
        free slot: a no-op). FerryError EINVAL for slot >= slots."""
        h = self._need()
        check(lib.ferry_moe_planner_forget(h, _u32(slot, "slot")), f"forget slot {slot}")

    @_locked
    def resize(self, slots):
        """A new slot budget: growing adds free slots; shrinking drops the
        experts in slots >= `slots` (they miss at their next ensure()).
        Returns how many were dropped; your executor's slots must follow."""
        h = self._need()
        n = _u32(slots, "slots")
        dropped = check(lib.ferry_moe_planner_resize(h, n), f"resize to {n} slots")
        self.slots = n
        return dropped

    @property
    @_locked
    def policy(self):
        return lib.ferry_moe_planner_policy(self._need()).decode()


class _SlotMemory:
    """The slots and the device under them once the pool is closed: freed
    when the last slot_tensor view of them is gone (each view's buffer
    holds this), so a view read after close() reads the last bytes, never
    freed memory. In a forked child they are the parent's: not freed."""

    def __init__(self):
        self.slots = self.dev = None
        self.where = Opened()

    def __del__(self):
        # (each freed and taken out in one step: never twice, whatever
        # interrupts this; the slots before the device they live on)
        try:
            if self.where.forked:
                self.slots = self.dev = None
            if self.slots:
                free_and_forget(lib.ferry_moe_slots_destroy, self.slots, setattr, self,
                                "slots", None)
            if self.dev:
                free_and_forget(lib.ferry_device_close, self.dev, setattr, self, "dev", None)
        except Exception:  # interpreter shutdown: the library may be gone
            pass


class _CudaSlots:
    """A bank's slots in CUDA memory as __cuda_array_interface__ describes
    them ([slots, row_bytes] uint8, the slots `stride` bytes apart); the
    tensor torch makes of it keeps this object, which keeps `mem`."""

    def __init__(self, ptr, slots, row_bytes, stride, mem):
        self._mem = mem
        self.__cuda_array_interface__ = {
            "shape": (slots, row_bytes), "typestr": "|u1", "descr": [("", "|u1")],
            "data": (int(ptr), False), "strides": (stride, 1), "version": 2}


class ExpertPool(_Life, _Plans, _LastCounts, Closing):
    """Expert slots on a ferry device ("host", or "cuda:N" / a torch.device on
    a GPU: slot_tensor then gives CUDA tensors on that GPU), an
    eviction planner over them (policy None: the library's default, "auto"),
    and a rows source (host banks or a file).

    Threads: calls from several threads are serialized (one ensure at a
    time, as the C objects require); close() waits for the call inside, and
    calls after it raise FerryError (EBADF). A close() made inside a call
    of its own thread (a signal handler's, a __del__'s) returns at once:
    the call goes on and frees the pool as it returns; any other call made
    there raises FerryError (EBUSY) naming the call in progress.

    Banks: the pool reads the memory the bank tensors had when it was made
    (it keeps their storages). A bank resized past its capacity or given
    other memory (set_, .data =) after that makes the next copy raise
    FerryError (EFAULT); keep a bank's memory while the pool is open. A
    bank resized from another thread while a copy reads it is refused
    after the copy (EFAULT, its slots forgotten), but the copy may have
    read memory torch freed: a crash where the pages were unmapped."""

    _lock = threading.RLock()   # until __init__ gives the object its own
    _where = NOT_OPENED

    def __init__(self, num_layers, num_experts, slots, banks=None, *, rows_file=None,
                 row_bytes=None, policy=None, device="host"):
        self._dev = self._planner = self._slots = self._rows = self._io = None
        self._mem = None   # the slots' memory, once a slot_tensor view holds it
        self._lock = threading.RLock()
        self._where = Opened()
        self._mine = threading.local()
        if (banks is None) == (rows_file is None):
            raise ValueError("ferry: give banks (host tensors) or rows_file, one of them")
        num_layers, num_experts, slots = _shape(num_layers, num_experts, slots)
        g = A.MoeGeometry(num_layers=num_layers, num_experts=num_experts, slots=slots)
        self._banks = None
        if banks is not None:
            banks = list(banks)
            info = [_bank_bytes(b) for b in banks]
            if not num_layers or not num_experts:
                raise FerryError(-errno.EINVAL, f"num_layers {num_layers} x num_experts "
                                 f"{num_experts}: banks need at least one row", "expert pool")
            for b, (_, n) in enumerate(info):
                if n % (num_layers * num_experts):
                    raise ValueError(f"ferry: bank {b} has {n} bytes, not a whole row per "
                                     f"({num_layers} layers x {num_experts} experts)")
            row_bytes = [n // (num_layers * num_experts) for _, n in info]
            self._banks = banks
            # what the rows source reads: the banks' storages (kept whatever
            # set_() or .data = does to a tensor) at these addresses
            self._bank_keep = [storage_of(b) for b in banks]
            self._bank_addrs = [a for a, _ in info]
            self._keep_addrs = [_kept_addr(k) for k in self._bank_keep]
        elif row_bytes is None:
            raise ValueError("ferry: a rows_file needs row_bytes (one per bank)")
        if not 1 <= len(row_bytes) <= A.MOE_MAX_BANKS:
            raise ValueError(f"ferry: 1..{A.MOE_MAX_BANKS} banks, got {len(row_bytes)}")
        g.banks = len(row_bytes)
        row_bytes = [_u64(n, f"row_bytes[{b}]") for b, n in enumerate(row_bytes)]
        for b, n in enumerate(row_bytes):
            g.row_bytes[b] = n
        self.geometry = g
        self.row_bytes = list(row_bytes)
        self.num_layers, self.num_experts, self.slots = num_layers, num_experts, slots
        try:
            self._open(device, policy, rows_file, info if banks is not None else None)
        except BaseException:
            self.close()
            raise

    def _open(self, device, policy, rows_file, info):
        g = self.geometry
        if not isinstance(device, str) and not is_torch_device(device):
            raise TypeError(f"ferry: device is a name (\"host\", \"cuda\", \"cuda:N\") or a "
                            f"torch.device, got {type(device).__name__} {device!r}")
        kind, self._ordinal = device_spec(device)
        dopt = A.DeviceOptions()
        self._backend = kind.encode()
        dopt.backend = self._backend
        dopt.ordinal = self._ordinal
        h = ctypes.c_void_p()
        check(lib.ferry_device_open(ctypes.byref(dopt), ctypes.byref(h)),
              f"device {str(device)!r}")
        self._dev = h
        ops, ctx = ctypes.c_void_p(), ctypes.c_void_p()
        check(lib.ferry_moe_device_slots_open(h, ctypes.byref(g), ctypes.byref(ops),
                                              ctypes.byref(ctx)), "slots open")
        s = ctypes.c_void_p()
        rc = lib.ferry_moe_slots_create(ctypes.byref(g), ops, ctx, ctypes.byref(s))
        check(rc, "slots create")  # on failure the executor has freed ctx
        self._slots = s
        r = ctypes.c_void_p()
        if info is not None:
            bases = (ctypes.c_void_p * len(info))(*[a for a, _ in info])
            check(lib.ferry_moe_rows_host(ctypes.byref(g), bases, None, 0, ctypes.byref(r)),
                  "rows (host banks)")
        else:
            io = ctypes.c_void_p()
            iopt = A.IoOptions()
            iopt.device = h
            check(lib.ferry_io_open(ctypes.byref(iopt), ctypes.byref(io)), "io open")
            self._io = io
            check(lib.ferry_moe_rows_file(ctypes.byref(g), io, os.fsencode(rows_file), None,
                                          ctypes.byref(r)), f"rows file {rows_file}")
        self._rows = r
        po = A.MoePlannerOptions(num_layers=g.num_layers, num_experts=g.num_experts,
                                 slots=g.slots, expert_bytes=sum(self.row_bytes))
        self._policy = _policy_bytes(policy)
        po.policy = self._policy
        p = ctypes.c_void_p()
        check(lib.ferry_moe_planner_create(ctypes.byref(po), ctypes.byref(p)), "planner create")
        self._planner = p

    # -- life --
    def _release(self):
        """The planner and rows go now; the slots and the device after them,
        or, while slot_tensor views hold the slots' memory, with the last
        of them (handed to it: each step made again after an interrupt is
        the same, _mem dropped last)."""
        self._free("_planner", lib.ferry_moe_planner_destroy)
        self._free("_rows", lib.ferry_moe_rows_destroy)
        mem = getattr(self, "_mem", None)
        if mem is not None:
            if self._slots:
                mem.slots = self._slots
                self._slots = None
        self._free("_slots", lib.ferry_moe_slots_destroy)
        self._free("_io", lib.ferry_io_close)
        if mem is not None:
            if self._dev:
                mem.dev = self._dev
                self._dev = None
            self._mem = None   # (the memory goes now when no view holds it)
        self._free("_dev", lib.ferry_device_close)

    def _forget_forked(self):
        self._dev = self._planner = self._slots = self._rows = self._io = self._mem = None

    def _planner_h(self):
        return self._planner

    def _slots_h(self):
        return self._slots

    def _need(self):
        if not self._planner:
            raise FerryError(-9, "the expert pool is closed", "ExpertPool")

    # -- a step --
    @_locked
    def ensure(self, layer, experts):
        """Make every expert of `experts` (layer-local ids) resident at `layer`:
        the planner picks slots (evicting by its policy) and the executor
        copies only the rows that were missing. Returns the slot of each
        expert, in the order given (a duplicate id shares its slot):
        slot_tensor(b)[slot] is then bank b's row of that expert.
        self.last_counts (the calling thread's last) says what moved.
        Errors as Planner.ensure: FERRY_ENOSPACE for more distinct experts
        than slots (split the step, computing each part before the next
        ensure(), which may evict it)."""
        self._need()
        ex, _ = _u32s(experts)
        layer = _u32(layer, "layer")
        n = ex.size
        slots = (ctypes.c_uint32 * max(n, 1))()
        plan, counts = A.MoeCopyPlan(), A.MoeCounts()
        self._pending = plan   # (_Plans: dropped unless copied whole)
        try:
            check(lib.ferry_moe_planner_ensure(self._planner, layer,
                                               ex.ctypes.data_as(ctypes.POINTER(ctypes.c_uint32)),
                                               n, slots, ctypes.byref(plan), ctypes.byref(counts)),
                  f"ensure layer {layer}")
            self._apply(plan, f"apply layer {layer}")
        except FerryError:
            self._pending = None
            raise   # the planner changed nothing, or _apply settled the plan's slots
        except BaseException:
            # an interrupt (SIGINT surfaces after the C call it came in) between
            # the plan and the end of its copy: none of the plan's slots is trusted
            self._settle_pending()
            raise
        self._pending = None
        self._counted(counts)
        return [slots[i] for i in range(n)]

    @_locked
    def check(self):
        """Raise FerryError unless the planner and the slots agree slot by slot."""
        self._need()
        check(lib.ferry_moe_check(self._planner, self._slots), "check")

    @_locked
    def slot_tensor(self, bank, dtype=None, shape=None):
        """Bank `bank`'s slots as a tensor [slots, *shape] of dtype (default: the
        raw bytes, [slots, row_bytes] uint8), viewing the device memory itself:
        on "host" a CPU tensor (or a NumPy array for a NumPy dtype), on
        "cuda:N" a CUDA tensor on that GPU (through __cuda_array_interface__;
        torch needed). The view keeps that memory: after close() it holds the
        slots' last bytes, and the memory goes with the last view.
        On a GPU, ensure() returns once its rows landed (any stream then
        reads them), but its copies, and hint_prefetch()'s, run on ferry's
        own streams, which do not wait for the engine's: kernels still
        queued on a slot (the last layer's experts) must be done, e.g.
        torch.cuda.current_stream().synchronize(), before a later call may
        copy another expert over it."""
        self._need()
        bank = _int(bank, "bank")
        if not 0 <= bank < len(self.row_bytes):
            raise IndexError(f"ferry: bank {bank} of {len(self.row_bytes)}")
        ctx = lib.ferry_moe_slots_device(self._slots)
        p0 = lib.ferry_moe_device_slot_ptr(ctx, bank, 0)
        stride = (lib.ferry_moe_device_slot_ptr(ctx, bank, 1) - p0) if self.slots > 1 else \
            self.row_bytes[bank]
        rb = self.row_bytes[bank]
        if self._mem is None:
            self._mem = _SlotMemory()
        if self._backend == b"cuda":
            return self._cuda_view(p0, stride, rb, dtype, shape)
        host = lib.ferry_devptr_host(self._dev, p0)
        if not host:
            raise FerryError(-22, "slot memory is not host-addressable", "slot_tensor")
        raw = (ctypes.c_uint8 * (stride * (self.slots - 1) + rb)).from_address(host)
        raw._ferry_mem = self._mem  # every view of raw's bytes holds the memory
        arr = np.lib.stride_tricks.as_strided(np.frombuffer(raw, np.uint8),
                                              shape=(self.slots, rb), strides=(stride, 1))
        if torch is not None and (dtype is None or isinstance(dtype, torch.dtype)):
            v = torch.from_numpy(arr)
            if dtype is not None:
                v = v.view(dtype)
            if shape is not None:
                v = v.reshape((self.slots,) + tuple(shape))
            v._ferry_pool = self  # the pool stays alive while the view does
            return v
        v = arr.view(dtype) if dtype is not None else arr
        return v.reshape((self.slots,) + tuple(shape)) if shape is not None else v

    def _cuda_view(self, p0, stride, rb, dtype, shape):
        """slot_tensor on a CUDA pool: torch.as_tensor of the slots' device
        memory, which keeps the _CudaSlots object (and so the memory) alive."""
        if torch is None:
            raise ValueError("ferry: slot_tensor of a CUDA pool needs torch")
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(f"ferry: a CUDA slot_tensor's dtype is a torch.dtype, got {dtype!r}")
        # (a torch that takes the interface's device from the current one,
        # not from the pointer: made current for the call)
        with torch.cuda.device(self._ordinal):
            v = torch.as_tensor(_CudaSlots(p0, self.slots, rb, stride, self._mem),
                                device=f"cuda:{self._ordinal}")
        if dtype is not None:
            v = v.view(dtype)
        if shape is not None:
            v = v.reshape((self.slots,) + tuple(shape))
        v._ferry_pool = self
        return v

    @_locked
    def stats(self):
        self._need()
        return _planner_stats(self._planner)

    # -- hints --
    @_locked
    def hint(self, layer, steps_ahead, experts, confidence=1.0):
        """Predicted routes: `experts` of `layer` at the step `steps_ahead`
        layer-steps from now (1: the next ensure()), right with probability
        `confidence` (see Planner.hint). Returns the distinct experts hinted."""
        self._need()
        return _hint(self._planner, layer, steps_ahead, experts, confidence)

    @_locked
    def hint_prefetch(self, max_rows=8):
        """Copy up to max_rows hinted experts that are missing into slots now
        (those expected to save more copies than they cost, the most valuable
        layer first), so a later ensure() finds them; never over the experts
        of the last ensure(). Returns the rows copied."""
        self._need()
        plan = A.MoeCopyPlan()
        max_rows = _u32(max_rows, "max_rows")
        self._pending = plan   # as ensure()
        try:
            n = check(lib.ferry_moe_planner_hint_prefetch(self._planner, max_rows,
                                                          ctypes.byref(plan)), "hint prefetch")
            if n:
                self._apply(plan, f"apply hint prefetch of layer {plan.layer}")
        except FerryError:
            self._pending = None
            raise
        except BaseException:
            self._settle_pending()
            raise
        self._pending = None
        return n

    def _apply(self, plan, what):
        """Copy a plan's rows; slots a failure leaves unknown are forgotten by
        the planner too, so the two never disagree on an occupant. Whatever
        is raised before the copy (a bank that moved, an interrupt) forgets
        the plan's slots: the planner placed experts there that never came,
        and the slots lose the experts the planner evicted for them (their
        bytes are still there, but the planner no longer counts them).
        A bank that moved during the copy (freed under it) makes the copied
        slots unknown to both after it: their bytes are not the rows."""
        try:
            if plan.n and self._banks is not None:
                self._banks_in_place(what)
        except BaseException:
            _drop_plan(self._planner, plan, self._slots)
            raise
        unknown = getattr(self, "_unknown", None)
        if unknown is None:  # made once: room for every slot
            unknown = self._unknown = (ctypes.c_uint32 * max(self.slots, 1))()
        n_unknown = ctypes.c_uint32(0)
        rc = lib.ferry_moe_slots_apply(self._slots, ctypes.byref(plan), self._rows, unknown,
                                       ctypes.byref(n_unknown))
        if rc < 0:
            msg = lib.ferry_last_error().decode(errors="replace")
            for i in range(n_unknown.value):
                lib.ferry_moe_planner_forget(self._planner, unknown[i])
            # a plan refused whole (validation: nothing moved) names no slot
            # unknown: every slot of the plan whose row did not land goes
            base = plan.layer * self.num_experts
            for i in range(plan.n):
                d = plan.dst_slots[i]
                if lib.ferry_moe_slots_occupant(self._slots, d) != base + plan.src_rows[i]:
                    lib.ferry_moe_slots_invalidate(self._slots, d)
                    lib.ferry_moe_planner_forget(self._planner, d)
            raise FerryError(rc, msg or None, what)
        if plan.n and self._banks is not None:
            try:   # a bank freed (resize_ in another thread) while the copy read it
                self._banks_in_place(what)
            except BaseException:
                _drop_plan(self._planner, plan, self._slots)
                raise
        return rc

    def _banks_in_place(self, what):
        """Refuse a copy from a bank whose memory moved since the pool was made
        (resize_() past its capacity frees what the rows source reads; set_()
        or .data = leaves it stale): FerryError (EFAULT) names the bank (and
        _apply forgets the plan's slots: nothing was copied into them). The
        kept storage is asked too: freed by a resize, its old address may
        come back under another tensor the bank was then given, of any size."""
        for b, (t, addr) in enumerate(zip(self._banks, self._bank_addrs)):
            now = _bank_addr(t)
            if now == addr and _kept_addr(self._bank_keep[b]) != self._keep_addrs[b]:
                now = _kept_addr(self._bank_keep[b]) + (addr - self._keep_addrs[b])
            if now != addr:
                raise FerryError(-errno.EFAULT, f"expert bank {b} was resized or given other "
                                 f"memory (its address moved from {addr:#x} to {now:#x}) "
                                 "since the pool was made: the pool reads the banks it was "
                                 "given; open a pool over the new banks", what)

    @_locked
    def hint_stats(self):
        """hinted, right, wrong, saves, evicted, fetched, live."""
        self._need()
        return _hint_stats(self._planner)

    @property
    @_locked
    def policy(self):
        self._need()
        return lib.ferry_moe_planner_policy(self._planner).decode()


def _default_slots(t):
    """`ferry moe replay`'s budget when none is named: 25% of the trace's
    layers x experts, at least one step's experts (top-k), at most all."""
    m = lib.ferry_moe_trace_model(t).contents
    every = m.num_layers * m.num_experts
    return min(max(int(every * 0.25 + 0.5), m.top_k, 1), every, 1 << 24)


def replay(trace_path, policy=None, slots=None, expert_bytes=0):
    """Replay a routing trace (ferry moe gen / engine captures) through a planner
    of `slots` slots (None: `ferry moe replay`'s default, 25% of the trace's
    layers x experts, at least its top-k) and `policy` (None: the library's
    default, "auto"; "belady" too): a dict with policy, slots, steps, hits,
    misses, hit_rate, evictions, host_bytes (misses x expert_bytes; 0: the
    trace's) and ns_per_step. FerryError for a trace that does not load and
    for slots outside 1 .. 2^24 (0 included), as the planner's."""
    if slots is not None:
        slots = _u32(slots, "slots")
    expert_bytes = _u64(expert_bytes, "expert_bytes")
    pol = _policy_bytes(policy)
    t = ctypes.c_void_p()
    check(lib.ferry_moe_trace_load(os.fsencode(trace_path), ctypes.byref(t)), f"trace {trace_path}")
    try:
        if slots is None:
            slots = _default_slots(t)
        r = A.MoeReplayResult()
        check(lib.ferry_moe_replay(t, pol, slots, expert_bytes, ctypes.byref(r)),
              "replay")
        out = {f: getattr(r, f) for f, _ in A.MoeReplayResult._fields_}
        out["policy"] = r.policy.decode()
        return out
    finally:
        lib.ferry_moe_trace_destroy(t)
