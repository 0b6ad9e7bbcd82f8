"""What every handle of the package shares: `with` closes it, and so does
garbage collection (close() must be safe to call more than once)."""
import sys
import threading

# free-threaded CPython (3.13t) says so here; every other interpreter holds a GIL
_GIL = getattr(sys, "_is_gil_enabled", lambda: True)()


class Closing:
    def close(self):  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may be gone
            pass


class CallGuard:
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
    """

    def __init__(self, what):
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

    @property
    def ended(self):
        return self._ended
