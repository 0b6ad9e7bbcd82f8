"""Each worker's own L2 directory under an engine's one L2 setting.

An engine hands every worker process (each TP / PP / DP rank, and in
SGLang each pool) the same extra config, and an L2 directory has one owner
(a second opener gets FERRY_EBUSY). So "DIR:SIZE" (or a list of them, an
L2 striped over drives) becomes DIR/<name>:SIZE, where the adapter's name
says whose store it is; the same worker finds its persistent L2 there
again."""
import os


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

