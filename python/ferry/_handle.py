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
      then (holding `_cv`) reads `_inside`. An enter that read False did
      so before end set it, so its append came before end's read: end
      waits for it. An enter that read True takes itself out and refuses.
    - leave pops, then reads `_ended`; when True it notifies under `_cv`.
      end reads `_inside` and waits without letting `_cv` go in between,
      so a leave's notify comes before the read (which then sees its pop)
      or after the wait began (which it wakes): no wake-up is lost.
    list.append and list.pop are single atomic steps. An interpreter
    without the GIL gives no such order: there both take `_cv`.

    In a forked child the guard is ended, with no call inside (the threads
    that were inside are not in the child) and a fresh lock (the parent's
    may have been held): every enter() refuses, end() returns False.
    """

    def __init__(self, what):
        super().__init__()
        self._what = what
        self._cv = threading.Condition(threading.Lock())
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
        if self._ended:          # end() may be waiting for this call
            with self._cv:
                self._cv.notify_all()

    def _enter_locked(self):
        with self._cv:
            if self._ended:
                return False
            self._inside.append(None)
            return True

    def _leave_locked(self):
        with self._cv:
            self._inside.pop()
            if self._ended and not self._inside:
                self._cv.notify_all()

    def end(self):
        with self._cv:
            if self._ended:
                return False
            self._ended = True
            while self._inside:
                self._cv.wait()
            return True

    def _after_fork(self):
        super()._after_fork()
        self._cv = threading.Condition(threading.Lock())
        self._inside = []
        self._ended = True

    @property
    def ended(self):
        return self._ended
