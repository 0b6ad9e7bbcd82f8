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
