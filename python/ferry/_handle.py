"""What every handle of the package shares: `with` closes it, and so does
garbage collection (close() must be safe to call more than once); and a
forked child refuses it.

Fork: a handle opened in one process is the library's state of that
process: its worker threads (which a forked child lacks), io_uring rings,
files, locks (held, at the fork, by threads the child lacks) and daemon
connection. A child using it hangs on a lock or a worker that never
answers, reads replies meant for its parent, or crashes closing it (a
join of threads that are not there). So at a fork every handle's Opened
is marked in the child (os.register_at_fork): calls on it raise
FerryError (EBADF) naming the fork, and close() and garbage collection
forget it without a call into the library (its memory is the child's copy
of the parent's, gone with the child). The parent's handles go on
unchanged. A child opens its own handles (as a spawned process does).
"""
import errno
import operator
import os
import sys
import threading
import time
import weakref
from collections import deque
from functools import partial
from threading import get_ident

from .errors import FerryError

# free-threaded CPython (3.13t) says so here; every other interpreter holds a GIL
_GIL = getattr(sys, "_is_gil_enabled", lambda: True)()


_pid = os.getpid()            # this process (a fork's child updates it)
_opened = weakref.WeakSet()   # every Opened of this process, marked at a fork


class Opened:
    """Which process a handle was opened in; `forked` is that process's id
    once this process is a fork of it (0 in the process that opened it)."""

    forked = 0

    def __init__(self):
        self.pid = _pid
        _opened.add(self)

    def _after_fork(self):
        self.forked = self.pid

    def refused(self, what, call):
        """The FerryError of a call on the handle that cannot be made: it is
        closed, or it is its parent's (this process is a fork)."""
        if self.forked:
            return FerryError(-errno.EBADF, f"{what} was opened in process {self.forked} and "
                              f"this process ({_pid}) is a fork of it: the library's threads, "
                              "rings and connections of a handle are its opener's; open one "
                              "in this process", call)
        return FerryError(-errno.EBADF, f"{what} is closed", call)


NOT_OPENED = object.__new__(Opened)   # an object's before __init__ gives it its own
REFUSED = object()   # CallGuard.call's answer once the guard ended


def _after_fork_in_child():
    global _pid
    _pid = os.getpid()
    for o in list(_opened):
        o._after_fork()
    _opened.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def free_and_forget(free, h, forget, *args):
    """free(h), then forget(*args) (which takes h out of the place where a
    release made again would find it), as one step that no interrupt
    splits. A signal handler's exception lands between two bytecodes:
    taking a handle out before its free leaks it when it lands between
    them, taking it out after frees it twice on the next try. Both calls
    here run from C (a deque consuming a map), with no bytecode between
    them, so the handle is findable until it is freed and freed once."""
    deque(map(operator.call, (partial(free, h), partial(forget, *args))), 0)


class Closing:
    def close(self):  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def __reduce_ex__(self, protocol):
        # a copy would share (and close) the handle; a pickle is for another
        # process, which opens its own
        raise TypeError(f"ferry: a {type(self).__name__} cannot be copied or pickled (it is "
                        "a handle of this process); open one where it is needed")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may be gone
            pass


class Signal:
    """A one-shot event whose wait no interrupt can wedge. threading.Event
    runs Python code (its Condition's __enter__, wait, notify) holding an
    internal lock: a signal handler's exception (KeyboardInterrupt) landing
    there leaves that lock held, and every later set() or wait() blocks
    for ever. Here set() stores a flag, then releases a plain lock held
    since __init__; wait() reads the flag and waits on the lock in slices,
    never holding it past a release in the same C step. An interrupt in
    either leaves at worst the lock held: the flag, read every slice, is
    then the answer."""

    __slots__ = ("_flag", "_lock")

    def __init__(self):
        self._flag = False
        self._lock = threading.Lock()
        self._lock.acquire()

    def is_set(self):
        return self._flag

    def set(self):
        if self._flag:
            return
        self._flag = True
        try:
            self._lock.release()
        except RuntimeError:   # (a set() an interrupt stopped, made again)
            pass

    def wait(self):
        while not self._flag:
            if self._lock.acquire(timeout=0.05):
                self._lock.release()


class CallGuard(Opened):
    """Calls on a C handle from several threads, and the handle's end.

    Each call runs between enter() and leave(); end() refuses new calls
    from then on, waits until the calls inside have returned, and returns
    True once (to the one caller that must release the handle). So a handle
    is never released while a thread is inside a C call on it, and a call
    that comes after never reaches the released handle: it raises instead.

    enter() and leave() take no lock (they are on every call's path; a
    lock pair costs more than the lookup it guards). Under the GIL each
    bytecode runs alone, so the guard's steps fall in one order that every
    thread sees:
    - enter appends to `_inside`, then reads `_ended`; end sets `_ended`,
      then reads `_inside` until it is empty. An enter that read False
      did so before end set it, so its append came before end's reads:
      end waits for it. An enter that read True takes itself out and
      refuses.
    - leave pops; end's next read sees it.
    list.append and list.pop are single atomic steps. An interpreter
    without the GIL gives no such order: there both take `_lock`.

    In a forked child the guard is ended, with no call inside (the threads
    that were inside are not in the child) and a fresh lock (the parent's
    may have been held): every enter() refuses, end() returns False.

    Interrupts: a signal handler's exception (KeyboardInterrupt, or an
    alarm's) is raised in the main thread at whatever bytecode it runs
    when the C call returns; between enter() and a caller's try, or at
    the start of leave(), it would leave an entry in `_inside` that no
    leave takes out, and end() (close, or the exit's garbage collection)
    would wait for it for ever. call() holds each entry in its own try:
    the entry is a token of this call, appended in the try and removed in
    its finally by C methods alone (no Python frame to be interrupted at).
    end() polls `_inside` in short sleeps, holding no lock and waiting on
    no threading.Condition (whose Python code an interrupt can stop with
    its lock held, or let go, wedging every later wait). The release
    after end() is any thread's to finish, under a lock of the handle's
    that only `with` takes (KVStore.close, _Flight.finish): an end() or
    release an interrupt stopped is gone on with by the next thread that
    closes (or frees), never waited for by it.

    A close inside a call of its own thread: a signal handler (or a
    __del__, or a weakref callback) runs between two bytecodes of the
    thread it interrupts, which may be inside a call on this very handle
    (between enter and the C call, or between two C calls of one entry:
    device_empty's). Waiting there for the calls inside to return would
    wait for that thread, which cannot go on until the handler returns:
    for ever. So each entry names its thread, and drain() waits for the
    other threads' calls alone: with one of its own thread's inside it
    returns False at once, and the release is that call's to make as it
    leaves: the last call out of an ended guard runs `on_last` (end()'s),
    whichever thread it is in. The release never comes between two C
    calls of one entry, and `on_last` is idempotent (released once).
    Only such a drain() makes the calls out run it (`_owed`): otherwise
    the thread that ended the guard releases, and a call out (a refused
    one too) never waits for it - a refused call of a thread that holds
    a lock the release takes (an op's, while the store's close reaps
    that op) would wait on it for ever.
    """

    def __init__(self, what):
        super().__init__()
        self._what = what
        # (only `with`: its release cannot be skipped; an RLock: an end() made
        # by a signal handler inside this thread's own end() goes through)
        self._lock = threading.RLock()
        self._inside = []      # one entry per call inside
        self._ended = False
        self._on_last = None   # what the last call out does once ended (end())
        self._owed = False     # a drain() left the release to a call inside
        if not _GIL:
            self.enter, self.leave = self._enter_locked, self._leave_locked

    def enter(self):
        tok = (get_ident(), None)   # (this thread's: drain() tells its own apart)
        self._inside.append(tok)
        if self._ended:
            self._inside.remove(tok)
            return False
        return True

    def leave(self):
        self._inside.remove((get_ident(), None))

    def _enter_locked(self):
        with self._lock:
            if self._ended:
                return False
            self._inside.append((get_ident(), None))
            return True

    def _leave_locked(self):
        with self._lock:
            self._inside.remove((get_ident(), None))

    def call(self, fn, *args):
        """fn(*args) as one call inside the guard, or REFUSED (ended). The
        entry is this call's own token, taken out in the finally whatever
        exception comes at whichever step (see Interrupts above)."""
        tok = (get_ident(), object())   # (this call's alone, naming its thread)
        inside = self._inside
        try:
            if _GIL:
                inside.append(tok)
                if self._ended:
                    return REFUSED
            else:
                with self._lock:
                    if self._ended:
                        return REFUSED
                    inside.append(tok)
            return fn(*args)
        finally:
            if _GIL:
                if tok in inside:
                    inside.remove(tok)
            else:
                with self._lock:
                    if tok in inside:
                        inside.remove(tok)
            if self._owed and self._ended and not inside:
                self._last_out()

    def _last_out(self):
        """The last call out of an ended guard: on_last (the release, which
        a close inside a call of its own thread left to it)."""
        fn = self._on_last
        if fn is not None:
            fn()

    def end(self, on_last=None):
        """Refuse every call from now on, then drain(): True once, to the
        thread that ended the guard, after every call inside returned;
        False to the others (and later calls), and at once to a caller
        with a call of its own thread inside (see drain). on_last: the
        release, run by the last call out of the ended guard (made
        idempotent by its owner)."""
        with self._lock:
            if on_last is not None and self._on_last is None:
                self._on_last = on_last   # (before _ended: a call out that sees one sees it)
            if self._ended:
                return False
            self._ended = True
        return self.drain()

    def drain(self):
        """After end() (in any thread): True once every call inside returned;
        False at once while a call of this thread is inside (the caller is a
        signal handler, a __del__ or a weakref callback run inside it, and
        that call would never return while this waits): then the release
        is that call's (or a later caller's) as it leaves (on_last)."""
        me = get_ident()
        pause = 0.0001
        while True:
            inside = list(self._inside)   # (one C step: a copy no append changes)
            if not inside:
                return True
            for t in inside:
                if t[0] == me:
                    self._owed = True   # (before the False: its call out sees it)
                    return False
            time.sleep(pause)   # (no lock, no notify: nothing an interrupt can leave held)
            pause = min(pause * 2, 0.005)

    def released(self):
        """Once the release is done: on_last goes (with what it holds)."""
        self._on_last = None

    def _after_fork(self):
        super()._after_fork()
        self._lock = threading.RLock()
        self._inside = []
        self._ended = True
        self._on_last = None
        self._owed = False

    @property
    def ended(self):
        return self._ended
