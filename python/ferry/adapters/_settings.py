"""Settings as engines hand them over: an engine's extra config may come
from JSON, a YAML or TOML file or an environment variable, so a boolean
may arrive as a string, and bool("false") would be True."""
import math
import numbers
import re

_DECIMAL = re.compile(r"[+-]?[0-9]+")   # (not str.isdecimal: "\u0661" is one)
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "", "none")


def truthy(value, what):
    """value as a boolean: a bool, None (False), or 0/1, true/false,
    yes/no, on/off in any case ("" and "none" are False). Anything else
    raises ValueError naming `what`: a misspelt value must not silently
    switch a setting."""
    if isinstance(value, bool) or value is None:
        return bool(value)
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"ferry: {what} is true or false, got {value!r}")


def flag(extra, key, what=None):
    """The boolean setting `key` of an engine's extra config (absent: False)."""
    return truthy((extra or {}).get(key, False), what or repr(key))


def size(value, what):
    """Bytes of a size setting: an int or a string of ferry's size grammar
    ("8G", "512M", "4096"). A bool, a negative or a misspelt size raises
    ValueError naming `what`, where the engine builds the adapter: not
    later, where a pool or worker opens its store."""
    from ..errors import FerryError
    from ..kv import parse_size
    try:
        if isinstance(value, bool):
            raise TypeError("a bool")
        return parse_size(value)
    except (TypeError, ValueError, FerryError) as e:
        raise ValueError(f"ferry: {what} is a size (\"8G\", \"512M\", bytes), got {value!r}: "
                         f"{getattr(e, 'message', e)}") from None


def l2_spec(value, what):
    """An L2 setting: "DIR:SIZE" or a list of them, each SIZE a size;
    else ValueError naming `what`."""
    from . import _l2dir
    try:
        specs = _l2dir.split(value, "")
    except (TypeError, ValueError):
        raise ValueError(f"ferry: {what} is 'DIR:SIZE' or a list of them, got {value!r}") \
            from None
    for _, sz in specs:
        size(sz, f"{what} ({value!r}): its SIZE")
    return specs


def count(value, what, lo, hi):
    """An integer setting in lo .. hi, the one rule of every engine's count
    settings: an int (numpy's too), its decimal string (a YAML or TOML file
    or an environment variable may quote it; ASCII digits, an optional
    sign, spaces around) or a whole float (16.0, as a JSON writer may give
    it). A bool, a fraction, NaN or an infinity, any other string ("0x10",
    "1_000", "16.0") or type, and a value outside lo .. hi raise ValueError
    naming `what`, the value and what is accepted."""
    n = None
    try:
        if isinstance(value, str):
            text = value.strip()
            if _DECIMAL.fullmatch(text):
                n = int(text)   # (ValueError past int()'s digit limit: out of range)
        elif isinstance(value, bool):
            pass
        elif isinstance(value, numbers.Integral):
            n = int(value)
        elif isinstance(value, numbers.Real):
            f = float(value)    # (OverflowError: a Fraction past any float)
            if math.isfinite(f) and f.is_integer():
                n = int(f)
    except (ValueError, OverflowError, TypeError):
        n = None
    if n is None or not lo <= n <= hi:
        raise ValueError(f"ferry: {what} is an integer in {lo} .. {hi} (an int, a string of "
                         f"its decimal digits or a whole float such as 16.0), got {value!r}")
    return n
