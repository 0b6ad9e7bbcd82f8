"""Each worker's own L2 directory under an engine's one L2 setting.

An engine hands every worker process (each TP / PP / DP rank, and in
SGLang each pool) the same extra config, and an L2 directory has one owner
(a second opener gets FERRY_EBUSY). So "DIR:SIZE" (or a list of them, an
L2 striped over drives) becomes DIR/<name>:SIZE, where the adapter's name
says whose store it is; the same worker finds its persistent L2 there
again. Where the engine cannot tell two workers apart (SGLang's plain DP
replicas), the adapter allows a bounded series: the name, then name.1,
name.2, ..., the first one no live store owns. Only workers that are
copies of one another (one model, one layout, the same TP rank, which the
name keeps) may share a series, because a restart may give one of them
another's directory; a persistent L2 refuses any other model, layout,
chunk size or hash seed, and the page names carry the rest."""
import os

from .. import errors
from ..errors import FerryError


def split(spec, what):
    """[(DIR, SIZE)] of spec: one "DIR:SIZE" or a list of them. Anything
    else raises ValueError: `what` and "'DIR:SIZE' or a list of them"."""
    specs = [spec] if isinstance(spec, (str, bytes, os.PathLike)) else list(spec)
    out = []
    for one in specs:
        d, sep, size = os.fsdecode(one).rpartition(":")
        if not sep or not d:
            raise ValueError(f"{what} 'DIR:SIZE' or a list of them, got {spec!r}")
        out.append((d, size))
    return out


def rank_l2(spec, name, what, old=None, suffix=""):
    """The L2 of one worker's store: each DIR:SIZE of spec as
    DIR/<name><suffix>:SIZE, the directory made if absent (None for no
    spec; one string for one directory, else a list). old(DIR, sub), when
    given, is called for each DIR: the adapter's word about an L2 an older
    ferry left in DIR itself."""
    if spec is None:
        return None
    out = []
    for d, size in split(spec, what):
        sub = os.path.join(d, name + suffix)
        os.makedirs(sub, exist_ok=True)
        if old is not None:
            old(d, sub)
        out.append(f"{sub}:{size}")
    return out[0] if len(out) == 1 else out


def open_in_series(open_store, spec, name, what, old=None, series=1, whose="a worker"):
    """open_store(l2) with the first L2 of name, name.1, ... name.<series-1>
    that no live store owns (FERRY_EBUSY moves on to the next; any other
    error is raised). All taken: FERRY_EBUSY naming the limit, `whose`
    (the adapter's name for the worker) and every directory tried. No spec:
    open_store(None)."""
    if spec is None:
        return open_store(None)
    tried, last = [], None
    for i in range(series):
        l2 = rank_l2(spec, name, what, old if i == 0 else None, f".{i}" if i else "")
        try:
            return open_store(l2)
        except FerryError as e:
            if e.code != errors.EBUSY:
                raise
            tried.append(l2 if isinstance(l2, str) else " + ".join(l2))
            last = e.message
    many = "its one L2 directory is" if series == 1 else f"all {series} of its L2 directories are"
    raise FerryError(
        errors.EBUSY,
        f"{whose}: {many} owned by other live stores ({'; '.join(tried)}): at most {series} "
        "copies of one worker (DP replicas) may run on one host with one L2 setting; stop "
        f"the stores left open, or give this one an L2 directory of its own (the last: {last})",
        "ferry_kv_open")
