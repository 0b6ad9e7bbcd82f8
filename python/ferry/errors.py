"""ferry's errors as Python exceptions."""
from ._lib import lib


class FerryError(Exception):
    """A libferry call failed.

    code: the negative code the call returned (a -errno or a FERRY_E*
    value); name: its symbolic name ("FERRY_ENOTFOUND", "EINVAL");
    message: ferry's message naming what failed (the calling thread's
    last error when the call set one, else the code's description).
    """

    def __init__(self, code, message=None, call=None):
        self.code = int(code)
        self.name = lib.ferry_err_name(self.code).decode()
        self.message = message or lib.ferry_strerror(self.code).decode()
        self.call = call
        where = f"{call}: " if call else ""
        super().__init__(f"{where}{self.message} ({self.name})")


def check(rc, call):
    """Raise FerryError for a negative rc (with the thread's last message), else return rc."""
    if rc >= 0:
        return rc
    msg = lib.ferry_last_error().decode(errors="replace")
    raise FerryError(rc, msg or None, call)


def strerror(code):
    return lib.ferry_strerror(int(code)).decode()


def err_name(code):
    return lib.ferry_err_name(int(code)).decode()


def _library_codes():
    """FERRY_E* codes as the library names them (ENOTFOUND -> -4103, ...)."""
    codes = {}
    for code in range(-4097, -4097 - 256, -1):
        name = err_name(code)
        if not name.startswith("FERRY_E"):
            break
        codes[name[len("FERRY_"):]] = code
    return codes


codes = _library_codes()
globals().update(codes)
