"""What every handle of the package shares: `with` closes it, and so does
garbage collection (close() must be safe to call more than once)."""


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
