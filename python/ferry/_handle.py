"""What every handle of the package shares: `with` closes it, and so does
garbage collection (close() must be safe to call more than once)."""
import threading


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
    """

    def __init__(self, what):
        self._what = what
        self._cv = threading.Condition(threading.Lock())
        self._inside = 0
        self._ended = False

    def enter(self):
        with self._cv:
            if self._ended:
                return False
            self._inside += 1
            return True

    def leave(self):
        with self._cv:
            self._inside -= 1
            if self._ended and self._inside == 0:   # end() waits for that
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
