"""Settings as engines hand them over: an engine's extra config may come
from JSON, a YAML or TOML file or an environment variable, so a boolean
may arrive as a string, and bool("false") would be True."""

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
    """An integer setting in lo .. hi: an int, or a string of one (a YAML or
    TOML file may quote it); a bool or anything else raises ValueError
    naming `what`."""
    try:
        if isinstance(value, bool) or isinstance(value, float):
            raise ValueError
        n = int(str(value).strip()) if isinstance(value, str) else int(value)
    except (TypeError, ValueError):
        n = None
    if n is None or not lo <= n <= hi:
        raise ValueError(f"ferry: {what} is an integer in {lo} .. {hi}, got {value!r}")
    return n
