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
import os
import sys
import threading
import time
import weakref

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
    """

    def __init__(self, what):
        super().__init__()
        self._what = what
        self._lock = threading.Lock()   # (only `with`: its release cannot be skipped)
        self._inside = []      # one entry per call inside
        self._ended = False
        if not _GIL:
            self.enter, self.leave = self._enter_locked, self._leave_locked

    def enter(self):
        self._inside.append(None)
        if self._ended:
            self.leave()
            return False
        return True

    def leave(self):
        self._inside.pop()

    def _enter_locked(self):
        with self._lock:
            if self._ended:
                return False
            self._inside.append(None)
            return True

    def _leave_locked(self):
        with self._lock:
            self._inside.pop()

    def call(self, fn, *args):
        """fn(*args) as one call inside the guard, or REFUSED (ended). The
        entry is this call's own token, taken out in the finally whatever
        exception comes at whichever step (see Interrupts above)."""
        tok = object()
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

    def end(self):
        """True once, to the thread that ends the guard, after every call
        inside returned; False to the others (and later calls)."""
        with self._lock:
            if self._ended:
                return False
            self._ended = True
        return self._drained()

    def drain(self):
        """After end() (in any thread): once every call inside returned."""
        return self._drained()

    def _drained(self):
        pause = 0.0001
        while self._inside:   # (no lock, no notify: nothing an interrupt can leave held)
            time.sleep(pause)
            pause = min(pause * 2, 0.005)
        return True

    def _after_fork(self):
        super()._after_fork()
        self._lock = threading.Lock()
        self._inside = []
        self._ended = True

    @property
    def ended(self):
        return self._ended
