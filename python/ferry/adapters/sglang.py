"""ferry as an SGLang hierarchical-cache (HiCache) storage backend.

SGLang loads it as a dynamic storage backend:

    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "ferry",
        "module_path": "ferry.adapters.sglang", "class_name": "FerryHiCacheStorage",
        "interface_v1": 1, "ferry_l1": "16G"}'

Its cache controller calls, from its prefetch and backup threads:
batch_exists / batch_exists_v2 (leading pages held, per-pool hit
policies), batch_get_v1 / batch_set_v1 (pages in the host pool, by host
index), batch_get_v2 / batch_set_v2 (the same for every registered pool:
kv, mamba, the DSA indexer, ...), and the older flat-page get / set.

Pages are ferry chunks named by SGLang's own page keys (KVStore.
store_named and friends): chunk_tokens is the pool's page size, any size
from 1 token. Each registered pool has its own KVStore, because each has
its own page shape:
- the kv pool (MHA: K and V, heads, head_dim; MLA: one latent) and the
  DSA indexer pool are ferry layouts, and their host pools are handed to
  ferry in place, by strides, in every host layout (layer_first,
  page_first, page_first_direct, page_head; the indexer's layer_first
  and page_first): nothing is copied in Python, the flat pages of the
  generic get/set included; a kv pool with bytes outside kv_buffer (the
  MXFP8 / FP4 pools' block scales: its size_per_token says more) or
  sharded over decode-context-parallel ranks (dcp_size > 1), or whose K
  and V have two head dims (v_head_dim: K and V in two buffers), is
  refused when it registers, as SGLang's own flat-page calls refuse them;
- any other pool (mamba: a temporal state and conv states, separate
  tensors of their own dtypes) is stored as its flat page bytes
  (host_pool.get_data_page / set_from_flat_data_page), one copy each way:
  DeepSeek V4's compressed pools too (C4 / C128 KV and indexer, their
  compress states; a page is a uint8 row of every layer; one that keeps
  its scales beside the rows, scale_kv_buffer, is refused);
- SGLang's dummy host pools (is_dummy: page slots, no buffer; the MLA
  latent's and the DSA indexer's on every attention-TP rank but 0 under
  MLA host-memory dedup, rank 0 holding the one host copy) are rank 0's
  pages under rank 0's keys, of the full pool's layout: it registers
  against the store or daemon rank 0 uses, moves no byte, and answers
  rank 0's hits (batch_exists, and batch_get_v1 / _v2: done for the
  leading pages the store holds); its flat reads are misses (SGLang
  would write them into the missing buffer); anywhere but an MLA model's
  TP rank > 0 it is refused.
  SGLang engages that dedup only with no storage backend or its "file"
  one (storage_supports_host_dedup: None, "", "file"), so a "dynamic"
  backend given at start-up meets full pools on every rank; ferry meets a
  dummy where it is attached at run time to a server started without a
  storage backend (some SGLangs refuse that attach). Its answers are
  safe because SGLang inserts no prefetched page before taking the least
  count over the TP ranks: rank 0's own read bounds the dummy's "done";
- a logical pool (DeepSeek V4's KV anchor: page slots, no tensor) has
  no bytes and no store: a page move on it moves nothing and answers
  done, and batch_exists_v2 takes its prefix from the pools that carry
  the pages (batch_exists alone finds nothing in it).

Keys. A page's ferry name is SGLang's key; the request salt says whose
slice it is: "sglang/<pool>/<rank tag>". The rank tag holds the pipeline
stage (pp), the attention-DP rank (dp, unless "ferry_share_dp": true:
DP replicas compute the same KV for the same tokens), the context-parallel
rank when attn_cp_size > 1 (each holds a disjoint slice of a page, MLA
too), and the TP rank. An MLA model's pages are the same on every TP
rank: one key for all, written by TP rank 0 only, read by all; but not
its mamba state (its heads are split over TP, and SGLang backs it up on
every rank) nor a pool of MHA pages (a draft model's): those keep the TP
rank. SGLang backs such a draft pool up from TP rank 0 alone (any backend
but Mooncake), so at TP > 1 the other ranks' draft pages are never stored,
their prefixes miss, and the least hit over the ranks is 0: no prefix is
restored while it is registered (warned when it registers). With
should_split_heads (tp_lcm_size > tp_size, page_head), a rank's kv (and
draft) page is tp_lcm_size / tp_size head groups, each stored under the TP
rank it would have at TP = tp_lcm_size, so instances of different TP sizes
share pages; the other pools' pages (SWA, mamba, ...) stay whole, under
the rank's own TP rank and size.

Stores (extra config):
- "ferry_store": NAME uses the KVStore registered as NAME (kv pool) and
  NAME.<pool> (other pools) with ferry.adapters.register_store(); for an
  MLA model's shared pools at TP > 1 (a dummy pool's included) it must be
  one every rank reads, a client of a shared `ferry serve` daemon: SGLang
  writes them from TP rank 0 only, so another rank's in-process store
  stays empty and the least hit over the ranks is 0 (not checked: the
  registered store is the caller's). The stores ferry_l1 / ferry_server
  open are registered under that name ("sglang" by default), so a
  second backend in one process finds them: one of another model
  (model_name) is refused, for it would read the first model's pages;
  each model takes its own "ferry_store";
- "ferry_server": "unix:/run/ferry/ferry.sock" connects the kv pool to a
  `ferry serve` daemon (every TP worker of the host shares its cache); a
  daemon serves one layout, so another pool needs its own daemon,
  "ferry_server_<pool>" (e.g. "ferry_server_mamba"), or an in-process
  store;
- "ferry_l1" (and "ferry_l1_<pool>", "ferry_l2", "ferry_l2_<pool>",
  "ferry_persistent") opens an in-process store per pool when the pool
  registers; not for an MLA model's shared pools at TP > 1 (SGLang
  writes them from TP rank 0 only: other ranks' own stores would stay
  empty, and SGLang takes the smallest hit of all ranks), refused. An
  L2 directory has one owner, so "DIR:SIZE" gives each pool of each rank
  DIR/<pool>-pp<r>of<n>-dp..-cp..-tp<r>of<n> of SIZE (a persistent one
  is found again by the same rank). SGLang's plain DP replicas (--dp-size
  without attention DP) all report DP rank 0, so their TP rank r shares a
  name: the first replica to open it owns it, the next take <name>.1,
  <name>.2, ... (at most _L2_REPLICAS, then refused naming them). The
  replicas run one model with one TP layout, so whichever finds whichever
  directory after a restart reads valid pages: the name keeps the TP rank
  and pipeline stage, the page names carry them too, and a persistent L2
  refuses another model, layout, page size or hash seed.
  Any other "ferry_" key is refused (a misspelt setting), and so is a
  "ferry." or "ferry-" key in any case (another adapter's spelling).
"ferry_key_len": N (1 .. 1024) refuses keys that are not N bytes
(SGLang's SHA-256 hex keys are 64); "ferry_server_timeout_ms" is 0 ..
2^32-1 (0: ferry's default); either may be a string of digits or a whole
float (16.0; 16.5, a bool or "0x10" is refused). The flags
("ferry_share_dp", "ferry_persistent") are bools, 0 / 1 or strings of
one ("false", "on", ...), as a JSON, TOML or YAML extra-config file may
carry them. A value a setting cannot take (a size that is not one, an L2
not "DIR:SIZE", a server address not a string, "ferry_store" not a
non-empty string) is refused when SGLang builds the backend, a
ValueError naming the key, before any store opens: not when a pool
registers, nor in SGLang's controller threads, which catch nothing.

Failures. SGLang calls from its controller's threads, which catch
nothing and are never restarted: a call's own mistakes (bad keys, host
indices, pools; a closed backend or store) raise, but the store failing
(a daemon gone or restarted with another layout, an I/O error, a full
pool) reads as a miss or a page not stored, with a warning, and the
next call tries the store again. A DeepSeek V4 row pool's host indices
that are not its whole pages move nothing: misses, not stored, warned
once. SGLang's V4 stack hands it none: its KV-derived pools (C4, C128,
the C4 indexer) take the tree's page size and the anchor's page count,
so the anchor's host indices are their whole pages (anchor page k, row
k), and the states take the SWA pool's; the guard is for a pool built
otherwise, whose rows ferry will not guess.

Metrics. With enable_storage_metrics on, get_stats returns SGLang's
StorageMetrics (kv pages per prefetch / backup call and their GB/s,
drained by each call), the type its scheduler's metrics collector
asserts; ferry_stats() gives ferry's own page counts and store stats.

Older SGLangs: their configs lack the newer fields (pp, dp, cp, metrics,
split heads read as their defaults), and the base class is theirs even
where their hicache_storage.py has no v2 names (_sglang_base).
"""
import errno
import logging
import os
import threading
import time
import weakref
from operator import itemgetter

import numpy as np

from .. import errors
from ..errors import FerryError
from ..kv import KVStore, Layout
from . import _check_opener, _mark_opener, register_store, registered_store, unregister_store
from . import _l2dir, _settings
from ._sglang_base import (SGLANG, UPSTREAM, HiCacheStorage, HiCacheStorageConfig,
                           HiCacheStorageExtraInfo, PoolHitPolicy, PoolName, PoolTransfer,
                           PoolTransferResult, StorageMetrics)

log = logging.getLogger("ferry.sglang")

_SKIPPABLE = {errors.ENOSPACE, errors.ELOCKED, -errno.ENOMEM}
# a call's own mistakes (bad keys, host indices, pools) are found before any
# store call and raised. Whatever a store call raises is the store's: a
# daemon gone, one restarted with another layout (FERRY_EMISMATCH), one of
# another version (ENOTSUP, EPARSE), an I/O error, a timeout. SGLang calls
# from its cache controller's threads, which catch nothing and are never
# restarted, so it reads as a miss / a page not stored (_failed); only a
# closed backend or store still raises (EBADF: the owner closed it, and
# no later call can succeed)
_WARN_EVERY_S = 10.0
# every backend of this process, by id (a backend need not hash): its locks
# are renewed in a forked child
_backends = weakref.WeakValueDictionary()


def _after_fork_in_child():
    # a thread of the parent's inside a backend's call at the fork (its
    # _lock or _warn_lock held) is not in the child, where that lock stays
    # held: the child's first call taking it hung for ever. Each backend
    # gets locks of its own (its stores are the parent's: their calls
    # refuse, naming the fork), as the adapters' store registry does
    for b in list(_backends.values()):
        b._lock = threading.Lock()
        b._warn_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
# the extra-config settings ferry reads (SGLang reads none of them): any
# other "ferry_" key is a misspelling, refused; the per-pool forms take a
# pool name (PoolName's values) after the setting
_KEYS = {"ferry_store", "ferry_server", "ferry_server_timeout_ms", "ferry_l1", "ferry_l2",
         "ferry_persistent", "ferry_share_dp", "ferry_key_len"}
_POOL_KEYS = ("ferry_server_", "ferry_l1_", "ferry_l2_")
_OK = {0, errors.EEXIST}
_KV_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
_NAME_MAX = 1024
_OLD_L2_WARNED = set()    # L2 roots holding a persistent L2 of their own, warned of
_L2_WHAT = "ferry: SGLang extra config: an L2 is"
# a rank's L2 directory and its series: SGLang's storage config does not
# tell plain DP replicas apart (dp_rank is attention DP's, "plain --dp-size
# replicas all report 0": sgl-project/sglang 001067fffe33427bee0ed2f007fb7551a1d76b44,
# python/sglang/srt/mem_cache/hicache_storage.py), so every replica's TP
# rank r names the same directory; the first opens it, the next ones
# DIR/<name>.1, .2, ... (see _store_for). A replica is a copy of the same
# model and TP layout, so after a restart either may take either's pages
_L2_REPLICAS = 16
# newer SGLang's PoolTransferResult carries the stop points every pool
# restores (restorable_prefix_pages, a default None: sgl-project/sglang
# 00fe477f32b3878f64d44cc36895e1de4a113afe); an older one has two fields
_RESTORABLE = "restorable_prefix_pages" in getattr(PoolTransferResult, "__dataclass_fields__", {})


def _key_list(keys):
    """keys as a list; TypeError for None, one str or bytes (which would be
    read as its characters) or anything that is not a sequence of keys."""
    if isinstance(keys, list):
        return keys
    if keys is None or isinstance(keys, (str, bytes, bytearray)):
        what = "None" if keys is None else f"one {type(keys).__name__}"
        raise TypeError(f"ferry: SGLang keys are a list of str or bytes keys, got {what}")
    try:
        return list(keys)
    except TypeError:
        raise TypeError(f"ferry: SGLang keys are a list of str or bytes keys, got "
                        f"{type(keys).__name__}") from None


def _check_extra(extra):
    """Refuse, where SGLang builds the backend, a ferry setting ferry does not
    know (a misspelling would switch nothing, in silence: "ferry_" keys, and
    "ferry." / "ferry-" ones in any case, the other adapters' spellings) and
    a value its setting cannot take (else a pool fails when it registers, or
    every call of SGLang's cache-controller threads raises): a ValueError
    naming the key. SGLang's own keys (backend_name, interface_v1, ...) are
    left alone."""
    pools = {str(p.value) for p in PoolName} | {"kv"}

    def per_pool(k, prefix):
        return k.startswith(prefix) and k[len(prefix):] in pools

    for k in extra:
        low = k.lower() if isinstance(k, str) else ""
        if low.startswith(("ferry_", "ferry.", "ferry-")) and k not in _KEYS and not any(
                per_pool(k, p) for p in _POOL_KEYS):
            raise ValueError(f"ferry: SGLang extra config {k!r} is no ferry setting (they "
                             f"are {', '.join(sorted(_KEYS))} and {', '.join(_POOL_KEYS)}"
                             "<pool>)")
    what = "SGLang extra config {!r}".format
    if "ferry_store" in extra:
        v = extra["ferry_store"]
        if not isinstance(v, str) or not v:
            raise ValueError(f"ferry: {what('ferry_store')} is the non-empty name of a "
                             f"registered store, got {v!r}")
    for k, v in extra.items():
        if not isinstance(k, str) or v is None:
            continue
        if k == "ferry_server" or per_pool(k, "ferry_server_"):
            if not isinstance(v, str):
                raise ValueError(f"ferry: {what(k)} is a `ferry serve` address such as "
                                 f"\"unix:/run/ferry/ferry.sock\", got {v!r}")
        elif k == "ferry_l1" or per_pool(k, "ferry_l1_"):
            _settings.size(v, what(k))
        elif k == "ferry_l2" or per_pool(k, "ferry_l2_"):
            _settings.l2_spec(v, what(k))
        elif k == "ferry_server_timeout_ms":
            _timeout_ms(v)
        elif k == "ferry_key_len":
            _key_len(v)
    for k in ("ferry_share_dp", "ferry_persistent"):
        _flag(extra, k)


def _timeout_ms(v):
    """"ferry_server_timeout_ms" (None: 0, ferry's default) by the rule of
    every engine's count settings (_settings.count)."""
    if v is None:
        return 0
    return _settings.count(v, "SGLang extra config 'ferry_server_timeout_ms'", 0, 2**32 - 1)


def _key_len(v):
    """"ferry_key_len", by the same rule."""
    return _settings.count(v, "SGLang extra config 'ferry_key_len'", 1, _NAME_MAX)


def _flag(extra, key):
    """A boolean of the extra config (--hicache-storage-backend-extra-config
    may be a YAML file, where a quoted value is a string)."""
    return _settings.flag(extra, key, f"SGLang extra config {key!r}")


def _pool_key(name):
    return str(name.value if isinstance(name, PoolName) else name)


def _unflat(t, dim, nb, page):
    return t.unflatten(dim, (nb, page))


class _PageMap:
    """How one host pool's pages are ferry chunks.

    structured: layout is the page's ferry Layout and planes(t) gives, for a
    tensor in the pool's layout (the pool's buffer, or one flat page viewed
    as a one-page pool), the per-layer paged views ferry reads by strides:
    MHA [2][pages][page][heads][head_dim], MLA [pages][page][1][dim], the
    indexer [pages][page][bytes]. Otherwise the page is its flat bytes."""

    def __init__(self, name, host, split):
        import torch
        self.name, self.host = name, host
        self.page = int(getattr(host, "page_size", 1) or 1)
        self.hlayout = getattr(host, "layout", None)
        self.split = split
        self.kind = None
        self.layout = None
        buf = getattr(host, "kv_buffer", None)
        idx = getattr(host, "index_k_with_scale_buffer", None)
        vd = getattr(host, "v_head_dim", None)
        if vd is not None and vd != getattr(host, "head_dim", vd):
            # SGLang's AsymmetricMHATokenToKVPoolHost (MiMo-V2): K and V in two
            # buffers of two head dims, and no flat pages (they raise)
            raise ValueError(
                f"ferry: SGLang pool {name!r}: K and V of different head dims (head_dim "
                f"{host.head_dim}, v_head_dim {vd}) are not a ferry layout (one head_dim "
                "for K and V); this pool's pages cannot be stored")
        # DeepSeek V4's compressed pools (C4 / C128 KV and indexer; their
        # compress states): a page is a uint8 row of every layer, host index
        # i in row i // page_size, the buffer a list of layers or a tensor
        # of neither MHA's nor MLA's shape: their flat pages
        self.rows = any(hasattr(host, a) for a in ("slot_page_size", "swa_page_size")) or \
            isinstance(buf, (list, tuple))
        if self.rows:
            if getattr(host, "scale_kv_buffer", None) is not None:
                # DeepSeekV4PagedHostPool.attach_scale_buffers (the NPU C4
                # indexer's fp16 scales): beside the rows, and not in the
                # flat pages ferry stores of a row pool
                raise ValueError(
                    f"ferry: SGLang pool {name!r} keeps each page's scales in "
                    "scale_kv_buffer, outside the rows of kv_buffer that its flat pages "
                    "hold and ferry moves; this pool's pages cannot be stored")
            self._bytes()
        elif isinstance(buf, torch.Tensor):
            self._kv(buf)
        elif isinstance(idx, torch.Tensor):
            self._indexer(idx)
        elif buf is None and getattr(host, "_is_dummy", False) is True:
            self._dummy()
        elif buf is None and self._no_bytes():
            self.kind = "logical"
        else:
            self._bytes()

    def _dummy(self):
        """SGLang's dummy host pools: the host-memory dedup of an MLA (or DSA)
        model's TP ranks gives every rank but attention-TP rank 0 pools of
        page slots and no buffer, rank 0 keeping the one host copy
        (MLATokenToKVPoolHost(is_dummy=True): kv_buffer None;
        DSAIndexerPoolHost(is_dummy=True): index_k_with_scale_buffer None).
        Their pages are rank 0's, under rank 0's keys: the layout is the
        full pool's, from the same fields (layer_num and kv_cache_dim, or
        indexer_page_stride_size, and the dtype), so a store or daemon of
        that layout serves it; no byte of it is ever moved (there is none)."""
        h, lay, p = self.host, self.hlayout, self.page
        if lay not in ("layer_first", "page_first", "page_first_direct"):
            raise ValueError(f"ferry: SGLang pool {self.name!r}: a dummy pool of host layout "
                             f"{lay!r}; ferry maps MLA and indexer pools of layer_first, "
                             "page_first and page_first_direct")
        if self.split != 1:
            raise ValueError("ferry: split heads do not apply to an MLA pool")
        if hasattr(h, "kv_cache_dim"):          # the MLA latent
            L, D, dt = int(h.layer_num), int(h.kv_cache_dim), h.dtype
            self.flat_shape = {"layer_first": (L, p, 1, D), "page_first": (p, L, 1, D),
                               "page_first_direct": (1, L, p, 1, D)}[lay]
        elif hasattr(h, "indexer_page_stride_size"):    # the DSA indexer's page rows
            L, pb, dt = int(h.layer_num), int(h.indexer_page_stride_size), h.indexer_dtype
            if pb % p:
                raise ValueError(f"ferry: SGLang pool {self.name!r}: a {pb}-byte index page "
                                 f"does not split over {p} tokens")
            D, self.flat_shape = pb // p, None
        else:
            raise ValueError(f"ferry: SGLang pool {self.name!r} ({type(h).__name__}) is a dummy "
                             "pool (no buffer) of neither an MLA latent (kv_cache_dim) nor a "
                             "DSA indexer (indexer_page_stride_size): its pages' layout is "
                             "unknown to ferry")
        self.kind, self.kv, self.layers, self.heads, self.head_dim = "dummy", 1, L, 1, D
        self.layout = Layout(L, 1, D, dt, kv=1)
        import torch
        self._whole_page_in(torch.empty(0, dtype=dt))
        self.dtype, self.buffer, self.pool_planes = dt, None, None

    def _no_bytes(self):
        """A logical pool (DeepSeek V4's KV anchor, LogicalHostPool): page
        slots and no tensor, its pages empty. Nothing of it is stored."""
        dummy = getattr(self.host, "get_dummy_flat_data_page", None)
        return dummy is None or dummy().numel() == 0

    def _kv(self, buf):
        lay, nd, p = self.hlayout, buf.dim(), self.page
        if lay not in _KV_LAYOUTS:
            raise ValueError(f"ferry: SGLang pool {self.name!r}: host layout {lay!r} is not one of "
                             f"{', '.join(_KV_LAYOUTS)}")
        mha = (lay in ("layer_first", "page_first") and nd == 5) or \
            (lay in ("page_first_direct", "page_head") and nd == 6)
        mla = (lay in ("layer_first", "page_first") and nd == 4) or \
            (lay == "page_first_direct" and nd == 5)
        if not mha and not mla:
            raise ValueError(f"ferry: SGLang pool {self.name!r}: a {lay} kv_buffer of shape "
                             f"{list(buf.shape)} is neither MHA's nor MLA's")
        s = buf.shape
        if mha:
            at = {"layer_first": (1, 3, 4), "page_first": (2, 3, 4),
                  "page_first_direct": (2, 4, 5), "page_head": (4, 2, 5)}[lay]
            L, H, D = (s[i] for i in at)
            if H % self.split:
                raise ValueError(f"ferry: SGLang pool {self.name!r}: {H} heads do not split into "
                                 f"{self.split} groups (tp_lcm_size / tp_size)")
            self.kind, self.kv, self.layers = "mha", 2, L
            self.heads, self.head_dim = H, D
            self.layout = Layout(L, H // self.split, D, buf.dtype, kv=2)
            self.flat_shape = {"layer_first": (2, L, p, H, D), "page_first": (2, p, L, H, D),
                               "page_first_direct": (2, 1, L, p, H, D),
                               "page_head": (2, 1, H, p, L, D)}[lay]
        else:
            if self.split != 1:
                raise ValueError("ferry: split heads do not apply to an MLA pool")
            L, D = (s[0], s[3]) if lay == "layer_first" else \
                (s[1], s[3]) if lay == "page_first" else (s[1], s[4])
            self.kind, self.kv, self.layers, self.heads, self.head_dim = "mla", 1, L, 1, D
            self.layout = Layout(L, 1, D, buf.dtype, kv=1)
            self.flat_shape = {"layer_first": (L, p, 1, D), "page_first": (p, L, 1, D),
                               "page_first_direct": (1, L, p, 1, D)}[lay]
        self._whole_page_in(buf)
        self.dtype = buf.dtype
        self.buffer = buf
        self.pool_planes = [self.planes(buf, g) for g in range(self.split)]

    def _whole_page_in(self, buf):
        """Refuse a kv pool whose tokens are not all in kv_buffer, or not this
        rank's whole tokens: ferry moves kv_buffer's bytes and nothing else.
        SGLang's block-scaled host pools (MXFP8, FP4) keep each page's
        scales in side buffers that its size_per_token counts (their flat
        pages raise: "scales live outside kv_buffer"); a decode-context-
        parallel MLA pool (dcp_size > 1) holds a shard of each page under
        keys that do not name the shard. Stored, either would load values
        that are not the page's."""
        dcp = getattr(self.host, "dcp_size", 1)
        if isinstance(dcp, int) and dcp > 1:
            raise ValueError(f"ferry: SGLang pool {self.name!r} is sharded over {dcp} decode-"
                             "context-parallel ranks (dcp_size); its pages are no rank's whole "
                             "pages, and ferry does not store them")
        want = getattr(self.host, "size_per_token", None)
        have = self.kv * self.layers * self.heads * self.head_dim * buf.element_size()
        if isinstance(want, (int, np.integer)) and not isinstance(want, bool) and want != have:
            raise ValueError(
                f"ferry: SGLang pool {self.name!r} ({type(self.host).__name__}) holds "
                f"{int(want)} bytes a token, its kv_buffer {have}: part of each page (a "
                "block-scaled pool's scales) lives outside kv_buffer, which is all ferry "
                "moves; this pool's pages cannot be stored")

    def _indexer(self, buf):
        lay, s, p = self.hlayout, buf.shape, self.page
        if lay == "layer_first" and buf.dim() == 3:
            L, pb = s[0], s[2]
        elif lay in ("page_first", "page_first_direct") and buf.dim() == 4 and s[2] == 1:
            L, pb = s[1], s[3]
        else:
            raise ValueError(f"ferry: SGLang pool {self.name!r}: an indexer buffer of layout "
                             f"{lay!r} and shape {list(s)} is not one ferry maps")
        if pb % p:
            raise ValueError(f"ferry: SGLang pool {self.name!r}: a {pb}-byte index page does not "
                             f"split over {p} tokens")
        self.kind, self.kv, self.layers, self.heads, self.head_dim = "indexer", 1, L, 1, pb // p
        self.layout = Layout(L, 1, pb // p, buf.dtype, kv=1)
        self.flat_shape = None
        self.dtype, self.buffer = buf.dtype, buf
        self.pool_planes = [self.planes(buf, 0)]

    def _bytes(self):
        dummy = self.host.get_dummy_flat_data_page()
        self.kind = "bytes"
        self.flat_dtype = dummy.dtype
        self.page_bytes = dummy.numel() * dummy.element_size()
        self.layout = Layout(1, 1, self.page_bytes, "u8", kv=1)
        self.buffer = None

    @property
    def chunk_tokens(self):
        return 1 if self.kind in ("bytes", "logical") else self.page

    @property
    def structured(self):
        return self.kind not in ("bytes", "logical")

    @property
    def logical(self):
        return self.kind == "logical"

    @property
    def dummy(self):
        """SGLang's dummy MLA pool: rank 0's pages, no buffer (see _dummy)."""
        return self.kind == "dummy"

    def planes(self, t, g=0):
        """Per-layer paged views of t (a tensor in the pool's layout) for head group g."""
        lay, p, L = self.hlayout, self.page, self.layers
        if self.kind == "mha":
            if lay == "layer_first":
                out = [_unflat(t[:, l], 1, t.shape[2] // p, p) for l in range(L)]
            elif lay == "page_first":
                out = [_unflat(t[:, :, l], 1, t.shape[1] // p, p) for l in range(L)]
            elif lay == "page_first_direct":
                out = [t[:, :, l] for l in range(L)]
            else:   # page_head [2][pages][heads][page][layers][dim]
                out = [t[:, :, :, :, l].transpose(2, 3) for l in range(L)]
            if self.split > 1:
                hs = self.heads // self.split
                out = [x[:, :, :, g * hs:(g + 1) * hs] for x in out]
            return out
        if self.kind == "mla":
            if lay == "layer_first":
                return [_unflat(t[l], 0, t.shape[1] // p, p) for l in range(L)]
            if lay == "page_first":
                return [_unflat(t[:, l], 0, t.shape[0] // p, p) for l in range(L)]
            return [t[:, l] for l in range(L)]
        # indexer: [layers][pages][bytes] or [pages][layers][1][bytes]
        row = self.head_dim
        if lay == "layer_first":
            return [_unflat(t[l], 1, p, row) for l in range(L)]
        return [_unflat(t[:, l, 0], 1, p, row) for l in range(L)]

    def block_of(self, start):
        """The host pool's page holding host index `start` (a page boundary)."""
        if start % self.page:
            raise ValueError(f"ferry: SGLang pool {self.name!r}: host index {start} is not at a "
                             f"page boundary (page size {self.page})")
        return start // self.page

    def flat_planes(self, flat, g=0):
        """The paged views of one flat page (the pool's own page order)."""
        n = int(np.prod(self.flat_shape))
        if flat.numel() != n or flat.dtype != self.dtype:
            raise ValueError(
                f"ferry: SGLang pool {self.name!r}: a page is {n} x {self.dtype} "
                f"({self.hlayout} {list(self.flat_shape)}), got {flat.numel()} x {flat.dtype}")
        return self.planes(flat.reshape(-1).view(self.flat_shape), g)


class FerryHiCacheStorage(HiCacheStorage):
    """ferry's HiCache storage backend for SGLang (see the module's documentation)."""

    def __init__(self, storage_config, kwargs=None):
        c = self.config = storage_config
        self._extra = dict(c.extra_config or {})
        _check_extra(self._extra)
        self._name = self._extra.get("ferry_store", "sglang")
        self._mla = bool(c.is_mla_model)
        # older SGLangs' configs lack the newer fields (at bb424de23a46 there is
        # no pp, cp, dp, metrics or split-heads field), and some give a field
        # as None (at 00fe477f32b3 dp_rank is Optional[int] = None, and no
        # dp_size): each read with its default where absent or None
        g = lambda k, d: d if getattr(c, k, None) is None else getattr(c, k)  # noqa: E731
        self._tp, self._tp_size = int(c.tp_rank), int(c.tp_size)
        self._cp, self._cp_size = int(g("attn_cp_rank", 0)), int(g("attn_cp_size", 1))
        self._split = 1
        if g("should_split_heads", False):
            lcm = g("tp_lcm_size", None)
            if self._mla or not lcm or lcm % self._tp_size or lcm <= self._tp_size:
                raise ValueError(f"ferry: should_split_heads needs an MHA model and tp_lcm_size "
                                 f"a multiple of tp_size {self._tp_size} above it, got {lcm}")
            self._split = lcm // self._tp_size
        base = f"pp{int(g('pp_rank', 0))}/{int(g('pp_size', 1))}"
        if not _flag(self._extra, "ferry_share_dp"):
            base += f"/dp{int(g('dp_rank', 0))}/{int(g('dp_size', 1))}"
        if self._cp_size > 1:
            base += f"/cp{self._cp}/{self._cp_size}"
        self._base_tag = base
        g2 = lambda k, d: int(g(k, d))  # noqa: E731
        self._rank_dir = (f"pp{g2('pp_rank', 0)}of{g2('pp_size', 1)}-dp{g2('dp_rank', 0)}of"
                          f"{g2('dp_size', 1)}-cp{self._cp}of{self._cp_size}-tp{self._tp}of"
                          f"{self._tp_size}")
        self._persistent = _flag(self._extra, "ferry_persistent")   # refused before any store opens
        kl = self._extra.get("ferry_key_len")
        self._key_len = _key_len(kl) if kl is not None else None
        self._key_range = (1, _NAME_MAX) if kl is None else (self._key_len, self._key_len)
        self._pools = {}      # pool name -> (_PageMap, KVStore)
        self._opened = []     # (registry name, store) opened here
        self._lock = threading.Lock()
        self._warn_lock = threading.Lock()   # _warned_at, _rows_warned
        _backends[id(self)] = self   # (a forked child renews both locks)
        self._warned_at = {}        # (pool, error code) -> _failed's last warning of it
        self._rows_warned = set()   # V4 row pools warned of host indices not their pages
        self._counts = {}
        self._tallies = {}     # pool -> (keys asked, pages held) per exists, not yet counted
        self._salt_cache = {}  # pool -> its salts
        self._lookups = {}     # pool -> (its store's lookup_named_packed, its salts)
        # SGLang's StorageMetrics of the kv pool's page moves (pages, GB/s per
        # call), kept only while storage metrics are on: get_stats drains them
        self._metrics = bool(g("enable_storage_metrics", False))
        self._io = ([], [], [], [])   # prefetch pages, backup pages, their GB/s
        self.store = None

    # ---- names and salts ----
    def _salts(self, pool):
        """One salt per head group of a page (one unless split heads), made
        once per pool (an exists asks for them on every call)."""
        got = self._salt_cache.get(pool)
        if got is None:
            got = self._salt_cache[pool] = self._make_salts(pool)
        return got

    def _replicated(self, pool, pm=None):
        """Whether pool `pool`'s pages are the same on every TP rank: one key
        for all, written by TP rank 0. Only under an MLA (rank-replicated)
        model, and only for a pool that is not split over TP there: a mamba
        state (its heads are; SGLang backs it up on every TP rank) or a
        pool of MHA pages (a draft model's) is each rank's own."""
        if not self._mla or pool == "mamba":
            return False
        if pm is None:
            got = self._pools.get(pool)
            pm = got[0] if got else None
        return pm is None or pm.kind != "mha"

    def _make_salts(self, pool):
        tag = f"sglang/{pool}/{self._base_tag}"
        if self._replicated(pool):
            return [tag]
        # split heads apply to the pools whose pages split (kv, draft): one
        # salt per head group there. Another pool (mamba, SWA, ...) is moved
        # whole, so one salt, under this rank at its own TP size: a salt per
        # group there asked for groups never stored (no hit) and indexed
        # head groups the pool does not have
        got = self._pools.get(pool)
        split = got[0].split if got else 1
        if split > 1:
            lcm = self._tp_size * split
            return [f"{tag}/tp{self._tp * split + g}/{lcm}" for g in range(split)]
        return [f"{tag}/tp{self._tp}/{self._tp_size}"]

    def _names(self, keys):
        """keys as ferry names: bytes (str as UTF-8) of 1 .. _NAME_MAX bytes,
        or of ferry_key_len bytes; TypeError / ValueError naming the key."""
        lo, hi = self._key_range
        out = []
        for i, k in enumerate(keys):
            b = k.encode() if isinstance(k, str) else k
            if type(b) is not bytes:
                if not isinstance(b, (bytes, bytearray)):
                    raise TypeError(f"ferry: SGLang key {i} is {type(k).__name__}, "
                                    "not str or bytes")
                b = bytes(b)
            if not lo <= len(b) <= hi:
                want = lo if lo == hi else f"{lo} .. {hi}"
                raise ValueError(f"ferry: SGLang key {i} of {len(keys)} is {len(b)} bytes; "
                                 f"keys are {want} bytes")
            out.append(b)
        return out

    # ---- set-up ----
    def register_mem_pool_host(self, mem_pool_host):
        super().register_mem_pool_host(mem_pool_host)
        self._register(PoolName.KV, mem_pool_host)
        self.store = self._pools["kv"][1]

    def register_mem_host_pool_v2(self, host_pool, host_pool_name):
        up = getattr(super(), "register_mem_host_pool_v2", None)
        if up is not None:
            up(host_pool, host_pool_name)
        else:       # an older SGLang's base class has no v2 pools: keep its table here
            if not hasattr(self, "registered_pools"):
                self.registered_pools = {}
            self.registered_pools[host_pool_name] = host_pool
        self._register(host_pool_name, host_pool)
        if _pool_key(host_pool_name) == "kv":
            self.mem_pool_host = host_pool
            self.store = self._pools["kv"][1]

    def _register(self, name, host):
        key = _pool_key(name)
        pm = _PageMap(key, host, self._split if key in ("kv", "draft") else 1)
        if pm.dummy and not (self._tp != 0 and self._replicated(key, pm)):
            # SGLang makes one only where another rank (attention-TP rank 0 of
            # an MLA model) holds and writes the pages; here nothing would
            # ever be written, and every read would be a miss
            raise ValueError(
                f"ferry: SGLang pool {key!r} is a dummy MLA pool (no buffer) on TP rank "
                f"{self._tp} of {self._tp_size} of a{'n MLA' if self._mla else ' non-MLA'} "
                "model: only a rank whose pages TP rank 0 of an MLA model writes may hold "
                "one; this rank's pages would never be stored")
        if self._mla and self._tp_size > 1 and key in ("draft", "draft_swa") and \
                pm.kind == "mha":
            # HybridCacheController.should_backup (sgl-project/sglang
            # 00343773d3293d382f0b39101f36b656d30ad2f0, mem_cache/hybrid_cache/
            # hybrid_cache_controller.py): under an MLA model a TP rank above 0
            # backs up MHA draft pools for backend "mooncake" only
            log.warning(
                "ferry: SGLang pool %r holds MHA pages (each TP rank its own heads, under "
                "its own keys) beside an MLA model at TP %d: SGLang backs it up from TP "
                "rank 0 alone for any storage backend but \"mooncake\", so the other "
                "ranks' pages are never stored and their prefixes read as misses; SGLang "
                "takes the least hit over the ranks, so no prefix is restored from ferry "
                "while this pool is registered (and no rank reads another's heads)",
                key, self._tp_size)
        old = self._pools.get(key)
        if old is not None:
            if old[0].layout != pm.layout or old[0].chunk_tokens != pm.chunk_tokens:
                raise ValueError(
                    f"ferry: SGLang pool {key!r} registered again with pages {pm.layout} x "
                    f"{pm.chunk_tokens}; it holds {old[0].layout} x {old[0].chunk_tokens}")
            self._pools[key] = (pm, old[1])
            return
        # a pool is published (self._pools) last: a caller that finds it, on
        # another thread (SGLang registers sidecar pools while its prefetch and
        # backup threads run), finds its counts
        if pm.logical:      # no bytes: no store; the other pools carry the pages
            self._counts[key] = dict(exists=0, hit=0, get=0, got=0, set=0, stored=0)
            self._tallies[key] = []
            self._pools[key] = (pm, None)
            return
        store = self._store_for(key, pm)
        if store.layout != pm.layout or store.chunk_tokens != pm.chunk_tokens:
            raise ValueError(
                f"ferry: SGLang pool {key!r} has pages {pm.layout} x {pm.chunk_tokens} tokens; "
                f"its store holds {store.layout} x {store.chunk_tokens} tokens")
        self._counts[key] = dict(exists=0, hit=0, get=0, got=0, set=0, stored=0)
        self._tallies[key] = []
        self._pools[key] = (pm, store)

    def _store_for(self, key, pm):
        reg = self._name if key == "kv" else f"{self._name}.{key}"
        store = registered_store(reg)
        model = self.config.model_name or "sglang"
        if store is not None:   # (one another adapter opened for its model: refused)
            _check_opener(reg, store, f"SGLang pool {key!r}", model, "\"ferry_store\"")
            return store
        e = self._extra
        server = e.get(f"ferry_server_{key}") or (e.get("ferry_server") if key == "kv" else None)
        if server:
            timeout = _timeout_ms(e.get("ferry_server_timeout_ms"))
            store = KVStore(model=model, layout=pm.layout, server=server,
                            chunk_tokens=pm.chunk_tokens, server_timeout_ms=timeout)
        else:
            l1 = e.get(f"ferry_l1_{key}", e.get("ferry_l1"))
            if l1 is not None and self._tp_size > 1 and self._replicated(key, pm):
                setting = "ferry_server" if key == "kv" else f"ferry_server_{key}"
                raise ValueError(
                    f"ferry: SGLang pool {key!r} of an MLA model at TP {self._tp_size}: SGLang "
                    "stores its pages from TP rank 0 only, and an in-process store is its own "
                    "rank's, so no other rank would ever find a page; give "
                    f"\"{setting}\" (a `ferry serve` daemon every rank shares) for this pool")
            if l1 is None:
                how = ("\"ferry_server\"" if key == "kv"
                       else f"\"ferry_server_{key}\" (a daemon serves one layout)")
                raise RuntimeError(f"ferry: SGLang pool {key!r}: no store registered as {reg!r}, "
                                   f"no {how} and no \"ferry_l1\" to open one")
            store = _l2dir.open_in_series(
                lambda l2: KVStore(model=model, layout=pm.layout, l1=l1, l2=l2,
                                   chunk_tokens=pm.chunk_tokens, persistent=self._persistent),
                e.get(f"ferry_l2_{key}", e.get("ferry_l2")), f"{key}-{self._rank_dir}",
                _L2_WHAT, self._old_l2(key), _L2_REPLICAS,
                f"ferry: SGLang pool {key!r} of rank {self._rank_dir}")
        _mark_opener(store, "SGLang", model)
        try:
            register_store(reg, store)
        except ValueError:
            store.close()
            raise
        self._opened.append((reg, store))
        return store

    def _old_l2(self, key):
        """The word about a persistent L2 an older ferry kept in DIR itself."""
        def name(d, sub):
            if self._persistent and d not in _OLD_L2_WARNED and \
                    os.path.exists(os.path.join(d, "ferry_pslab.idx")):
                # a persistent L2 of the directory itself: one rank's, from
                # before each rank and pool had its own. Not read (whose it
                # is, is not ferry's to guess), but not lost without a word
                _OLD_L2_WARNED.add(d)
                log.warning("ferry: SGLang L2 directory %s holds a persistent L2 of its own "
                            "(each rank and pool once shared it); this rank's %r pool now keeps "
                            "its pages in %s and does not read those (remove them to free the "
                            "space)", d, key, sub)
        return name

    def _pool(self, name):
        key = _pool_key(name)
        got = self._pools.get(key)
        if getattr(self, "_closed", False):
            raise FerryError(-errno.EBADF, f"the backend is closed (pool {key!r})",
                             "FerryHiCacheStorage")
        if got is None:
            known = ", ".join(sorted(self._pools)) or "none"
            raise ValueError(f"ferry: SGLang pool {key!r} is not registered with this backend "
                             f"(registered: {known})")
        return got

    def _count(self, key, **kw):
        with self._lock:
            c = self._counts[key]
            for k, v in kw.items():
                c[k] += v

    def _failed(self, e, key, what):
        """A FerryError of a store call: re-raised when the backend or its
        store is closed (EBADF), else the store failed (or was full):
        warned (at most once per _WARN_EVERY_S for each pool and error
        code, the others at debug level) and the call answers a miss / not
        stored. Per pool and code: one pool's failing daemon must not keep
        another pool's first failure, or a new one (a daemon back with
        another layout), at debug level."""
        if e.code == -errno.EBADF:
            raise e
        now, seen = time.monotonic(), (key, e.code)
        with self._warn_lock:   # the prefetch and backup threads fail at once
            quiet = now - self._warned_at.get(seen, -1e9) < _WARN_EVERY_S
            if not quiet:
                self._warned_at[seen] = now
        (log.debug if quiet else log.warning)(
            "ferry: SGLang pool %r: %s failed, read as %s: %s", key, what,
            "a miss" if what != "set" else "not stored", e)

    # ---- the page moves ----
    def _starts(self, pm, n, host_indices):
        """The host index each of n pages starts at; None for host indices
        that are not whole pages of a V4 row pool (then nothing moves)."""
        if pm.logical:      # no page of it moves: its indices name nothing
            return [0] * n
        if not pm.rows:
            return self._page_starts(pm, n, host_indices)
        # SGLang's V4 stack gives a KV-derived pool the anchor's page size,
        # so the anchor's host indices it hands on backup and prefetch are
        # whole pages of it. Indices that are not (a pool of another page
        # size: the anchor's then name no row of it, the anchor's over a
        # compression ratio repeat) name rows ferry will not guess, and
        # SGLang's threads catch nothing: nothing moves (a miss, not
        # stored), warned once for the pool
        try:
            out = self._page_starts(pm, n, host_indices)
            if any(x % pm.page for x in out):
                raise ValueError(f"ferry: SGLang pool {pm.name!r}: host indices start off "
                                 f"its page rows ({pm.page} a row)")
            return out
        except (ValueError, TypeError, FerryError) as e:
            with self._warn_lock:
                first = pm.name not in self._rows_warned
                self._rows_warned.add(pm.name)
            (log.warning if first else log.debug)(
                "ferry: SGLang pool %r: host indices that are not whole pages of it (%s); "
                "its pages read as misses and are not stored (warned once)", pm.name, e)
            return None

    def _page_starts(self, pm, n, host_indices):
        if n == 0 and (host_indices is None or len(host_indices) == 0):
            return []
        if host_indices is None:
            raise ValueError(f"ferry: SGLang pool {pm.name!r}: no host indices for {n} pages")
        hi = host_indices
        if hasattr(hi, "detach"):
            hi = hi.detach().cpu().numpy()
        hi = np.asarray(hi).reshape(-1)
        if hi.size and hi.dtype.kind not in "iu":
            raise TypeError(f"ferry: SGLang pool {pm.name!r}: host indices are integers, got "
                            f"dtype {hi.dtype}")
        if hi.size != n * pm.page:
            raise ValueError(f"ferry: SGLang pool {pm.name!r}: {n} pages of {pm.page} tokens "
                             f"need {n * pm.page} host indices, got {hi.size}")
        # a page moves whole from its first index: the others must follow it, or
        # the page ferry moves would not be the tokens the indices name
        pages = hi.reshape(n, pm.page).astype(np.int64)
        off = pages - pages[:, :1]
        bad = np.flatnonzero((off != np.arange(pm.page)).any(axis=1))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"ferry: SGLang pool {pm.name!r}: page {i}'s host indices "
                             f"{pages[i].tolist()} are not one run of {pm.page} from a page start")
        # inside the pool: a negative index would be Python's from the end (a
        # flat-byte pool's page read or written in another slot)
        size = getattr(pm.host, "size", None)
        out = pages[:, 0]
        oob = np.flatnonzero((out < 0) | (out > size - pm.page if size is not None else False))
        if oob.size:
            i = int(oob[0])
            raise FerryError(-errno.EINVAL, f"SGLang pool {pm.name!r}: page {i}'s host "
                             f"indices {pages[i].tolist()} are outside the pool (0 .. {size})",
                             "FerryHiCacheStorage")
        return [int(x) for x in out]

    def _shared_reader(self, pool):
        """A rank-replicated pool's pages are written by TP rank 0 only."""
        return self._tp != 0 and self._replicated(pool)

    def _set_pages(self, key, keys, starts):
        pm, store = self._pool(key)
        names = self._names(keys)
        if not names:
            return []
        if pm.logical:      # nothing to move (Mooncake's answer too)
            return [True] * len(names)
        if starts is None:  # host indices that are not whole pages of a row pool
            self._count(key, set=len(names))
            return [False] * len(names)
        if pm.structured:
            blocks = [pm.block_of(s) for s in starts]
        if self._shared_reader(key):
            return [True] * len(names)
        ok = [True] * len(names)
        wrote = [0] * len(names)    # head groups stored (or found present), per page
        t0 = time.perf_counter()
        try:
            if pm.structured:
                for g, salt in enumerate(self._salts(key)):
                    _, st = store.store_named(names, pm.pool_planes[g], blocks, salt=salt,
                                              statuses=True)
                    ok = [a and s in _OK for a, s in zip(ok, st)]
                    wrote = [w + (s == 0) for w, s in zip(wrote, st)]
            else:
                import torch
                stage = torch.empty((1, 1, len(names), pm.page_bytes), dtype=torch.uint8)
                for i, s in enumerate(starts):
                    stage[0, 0, i] = pm.host.get_data_page(s, flat=True).reshape(-1) \
                        .contiguous().view(torch.uint8)
                _, st = store.store_named(names, stage, salt=self._salts(key)[0], statuses=True)
                ok = [s in _OK for s in st]
                wrote = [int(s == 0) for s in st]
        except FerryError as e:
            self._failed(e, key, "set")
            ok, wrote = [False] * len(names), [0] * len(names)
        self._count(key, set=len(names), stored=sum(ok))
        self._measure(key, 1, sum(map(bool, wrote)), sum(wrote), store, t0)
        return ok

    def _get_pages(self, key, keys, starts):
        pm, store = self._pool(key)
        names = self._names(keys)
        if not names:
            return []
        if pm.logical:
            return [True] * len(names)
        if starts is None:
            self._count(key, get=len(names))
            return [False] * len(names)
        if pm.dummy:
            return self._dummy_got(key, store, names)
        ok = [True] * len(names)
        t0 = time.perf_counter()
        if pm.structured:
            blocks = [pm.block_of(s) for s in starts]
            for g, salt in enumerate(self._salts(key)):
                try:
                    _, st = store.retrieve_named(names, pm.pool_planes[g], blocks, salt=salt,
                                                 statuses=True)
                except FerryError as e:
                    self._failed(e, key, "get")
                    st = [e.code] * len(names)
                ok = [a and s == 0 for a, s in zip(ok, st)]
        else:
            import torch
            stage = torch.empty((1, 1, len(names), pm.page_bytes), dtype=torch.uint8)
            try:
                _, st = store.retrieve_named(names, stage, salt=self._salts(key)[0],
                                             statuses=True)
            except FerryError as e:
                self._failed(e, key, "get")
                st = [e.code] * len(names)
            ok = [s == 0 for s in st]
            for i, s in enumerate(starts):
                if ok[i]:
                    pm.host.set_from_flat_data_page(s, stage[0, 0, i].view(pm.flat_dtype))
        self._count(key, get=len(names), got=sum(ok))
        self._measure(key, 0, sum(ok), sum(ok) * len(self._salts(key)), store, t0)
        return ok

    def _dummy_got(self, key, store, names):
        """A page read on one of SGLang's dummy pools: nothing moves (it has no
        buffer; SGLang's load from it asserts, and the rank's device pages
        come from rank 0's host copy), and each page answers what rank 0's
        read of the same shared page finds: done for the leading pages the
        store holds, a miss after. SGLang takes the least of the ranks'
        counts, so rank 0's own result bounds it."""
        try:
            n = store.lookup_named(names, salt=self._salts(key)[0])
        except FerryError as e:
            self._failed(e, key, "get")
            n = 0
        self._count(key, get=len(names), got=n)
        return [i < n for i in range(len(names))]

    def _packed(self, keys):
        """(keys back to back as one bytes, each key's size) for keys of one
        size, in range, all str of ASCII or all bytes (SGLang's); else None
        (then _names checks them one by one). A str list is joined first
        and encoded once: its bytes are its characters when all ASCII."""
        lo, hi = self._key_range
        if len(keys) == 1:
            k = keys[0]
            b = k.encode() if type(k) is str else k
            return (b, len(b)) if type(b) is bytes and lo <= len(b) <= hi else None
        sizes = set(map(len, keys))
        if len(sizes) != 1:
            return None
        size = sizes.pop()
        kinds = set(map(type, keys))
        if kinds == {str}:
            b = "".join(keys).encode()
        elif kinds == {bytes}:
            b = b"".join(keys)
        else:
            return None
        return (b, size) if len(b) == size * len(keys) and lo <= size <= hi else None

    def _held(self, key, keys):
        """Leading pages of keys (in pool `key`) that every head group holds.
        Keys of one size (SGLang's all are) go to ferry packed in one
        buffer, and what a lookup needs is made once per pool: a one-key
        exists is on the scheduler's path."""
        got = self._lookups.get(key)
        if got is None:
            pm, store = self._pool(key)     # raises for a pool not registered
            got = self._lookups[key] = (None, ()) if pm.logical else \
                (store.lookup_named_packed, tuple(self._salts(key)))
        lookup, salts = got
        if type(keys) is not list and not isinstance(keys, (list, tuple)):
            keys = _key_list(keys)
        if lookup is None:      # a logical pool holds no page: never a hit on its own
            self._names(keys)
            self._tallies[key].append((len(keys), 0))
            return 0
        asked = n = len(keys)
        if n == 1 and type(keys[0]) is str:     # the scheduler's one-key exists
            b = keys[0].encode()
            lo, hi = self._key_range
            packed = (b, len(b)) if lo <= len(b) <= hi else None
        else:
            if not n:
                return 0
            packed = self._packed(keys)
        if packed is None:
            names = self._names(keys)      # raises for a bad key
        else:
            buf, size = packed
        try:
            for salt in salts:    # a page is held when every head group is
                if packed is not None:
                    n = lookup(buf, size, n, salt=salt)
                else:
                    n = self._pools[key][1].lookup_named(names[:n], salt=salt)
                if not n:
                    break
        except FerryError as e:
            self._failed(e, key, "exists")
            n = 0
        tally = self._tallies[key]     # no lock on this path: list.append is atomic
        tally.append((asked, n))
        if len(tally) >= 256:
            self._fold(key)
        return n

    def _fold(self, key):
        """Pool key's tallied exists calls, into its page counts. Those
        appended meanwhile stay: a copy and a delete of a list's first k
        items are each atomic, and appends go after them."""
        with self._lock:
            tally = self._tallies[key]
            done = tally[:]
            del tally[:len(done)]
            c = self._counts[key]
            c["exists"] += sum(map(itemgetter(0), done))
            c["hit"] += sum(map(itemgetter(1), done))

    # ---- existence ----
    def exists(self, key):
        return self._held("kv", [key]) == 1

    def batch_exists(self, keys, extra_info=None):
        """Leading keys whose kv pages ferry holds."""
        return self._held("kv", keys)

    def batch_exists_v2(self, keys, pool_transfers=None, extra_info=None):
        """The usable prefix: the greatest stop point (a page count) that
        the kv pool and every pool transfer restore, each by its own hit
        policy (ALL_PAGES: each page up to it; TRAILING_PAGES: the last
        len(transfer.keys) pages before it). A trailing pool restores only
        at the ends of its stored windows, so the stop points are
        intersected, never the pools' greatest ones taken at their least;
        they go back as restorable_prefix_pages where SGLang's result has
        that field (the caller intersects them over ranks)."""
        for t in pool_transfers or []:
            self._pool(t.name)          # unknown pools refused before any lookup
        if self._pool("kv")[0].logical and pool_transfers:
            # a logical anchor (DeepSeek V4) holds no bytes: every kv prefix is
            # one, and the pools that carry the pages decide (as Mooncake's)
            keys = _key_list(keys)
            self._names(keys)
            kv_pages = len(keys)
        else:
            kv_pages = self._held("kv", keys)
        hits = {PoolName.KV: kv_pages} if kv_pages else {}
        stops = set(range(1, kv_pages + 1))
        for t in pool_transfers or []:
            if not stops:
                break
            name = _pool_key(t.name)
            if PoolHitPolicy(t.hit_policy) == PoolHitPolicy.ALL_PAGES:
                boundary = self._held(name, keys[:kv_pages])
                own = set(range(1, boundary + 1))
            else:
                trailing = max(1, len(t.keys) if t.keys else 1)
                held = self._presence(name, keys[:kv_pages])
                own = {end for end in range(1, kv_pages + 1)
                       if all(held[max(0, end - trailing):end])}
                boundary = max(own, default=0)
            if boundary:
                hits[t.name] = boundary
            stops &= own
        final = max(stops, default=0)
        if _RESTORABLE:
            return PoolTransferResult(final, hits, restorable_prefix_pages=sorted(stops))
        return PoolTransferResult(final, hits)

    def _presence(self, name, keys):
        """Whether pool `name` holds each of keys: a lookup per run of held
        keys and the gap after it (the leading keys held, from each start)."""
        held, i = [False] * len(keys), 0
        while i < len(keys):
            n = self._held(name, keys[i:])
            held[i:i + n] = [True] * n
            i += n + 1
        return held

    # ---- pages in the host pools (v1: the kv pool; v2: every pool) ----
    def batch_get_v1(self, keys, host_indices, extra_info=None):
        """Read kv pages into the host pool at host_indices (page i at
        host_indices[i * page_size]); one bool per key."""
        keys = _key_list(keys)
        pm, _ = self._pool("kv")
        return self._get_pages("kv", keys, self._starts(pm, len(keys), host_indices))

    def batch_set_v1(self, keys, host_indices, extra_info=None):
        """Store the host pool's kv pages at host_indices under keys."""
        keys = _key_list(keys)
        pm, _ = self._pool("kv")
        return self._set_pages("kv", keys, self._starts(pm, len(keys), host_indices))

    def _v2(self, transfers, fn):
        plan = []
        seen = set()
        for t in transfers:     # every transfer checked before any page moves
            pm, _ = self._pool(t.name)
            if pm.name in seen:     # one result per pool: a second would hide the first's
                raise ValueError(f"ferry: SGLang pool {pm.name!r} has two transfers in one "
                                 "call; give its keys in one")
            seen.add(pm.name)
            keys = [] if t.keys is None else _key_list(t.keys)
            self._names(keys)
            plan.append((t.name, keys, self._starts(pm, len(keys), t.host_indices)))
        return {name: fn(_pool_key(name), keys, starts) for name, keys, starts in plan}

    def batch_get_v2(self, transfers, extra_info=None):
        """Read each transfer's pages into its pool: {pool name: [bool per key]}."""
        return self._v2(transfers, self._get_pages)

    def batch_set_v2(self, transfers, extra_info=None):
        """Store each transfer's pages from its pool: {pool name: [bool per key]}."""
        return self._v2(transfers, self._set_pages)

    # ---- flat pages (SGLang's generic path, kv pool) ----
    def get(self, key, target_location=None, target_sizes=None):
        """Read the kv page into target_location (a flat page in the pool's
        page order); None on a miss (target_location then unchanged)."""
        pm, store = self._pool("kv")
        if target_location is None:
            target_location = self.mem_pool_host.get_dummy_flat_data_page()
        names = self._names([key])
        if pm.logical:      # no bytes of its own: never a page to read
            self._count("kv", get=1)
            return None
        if pm.dummy:
            # SGLang writes a page read here into the host pool
            # (set_from_flat_data_page), and a dummy pool has no buffer: a
            # miss, never a page (batch_get_v1, "interface_v1": 1, answers)
            self._count("kv", get=1)
            with self._warn_lock:
                first = "dummy-get" not in self._rows_warned
                self._rows_warned.add("dummy-get")
            (log.warning if first else log.debug)(
                "ferry: SGLang's dummy MLA host pool (TP rank %d) takes no flat page: its reads "
                "are misses, and SGLang keeps the least hit of all ranks; give \"interface_v1\": "
                "1 in the extra config (batch_get_v1 answers rank 0's hits)", self._tp)
            return None
        if not pm.structured:
            raise ValueError("ferry: the kv pool's pages are not a ferry layout")
        views = [pm.flat_planes(target_location, g) for g in range(self._split)]
        ok = True
        try:
            for g, salt in enumerate(self._salts("kv")):
                if store.lookup_named(names, salt=salt) != 1:
                    self._count("kv", get=1)
                    return None
            for g, salt in enumerate(self._salts("kv")):
                ok = store.retrieve_named(names, views[g], [0], salt=salt) == 1 and ok
        except FerryError as e:
            self._failed(e, "kv", "get")
            ok = False
        self._count("kv", get=1, got=int(ok))
        return target_location if ok else None

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        targets = target_locations or [None] * len(keys)
        t0 = time.perf_counter()
        out = [self.get(k, t) for k, t in zip(keys, targets)]
        got = sum(x is not None for x in out)
        self._measure("kv", 0, got, got * len(self._salts("kv")), self._pool("kv")[1], t0)
        return out

    def set(self, key, value=None, target_location=None, target_sizes=None):
        """Store one flat kv page; False when ferry declined it (full)."""
        pm, store = self._pool("kv")
        names = self._names([key])
        if pm.logical or pm.dummy:      # nothing to store (a dummy's pages are rank 0's)
            return True
        views = [pm.flat_planes(value, g) for g in range(self._split)]
        if self._shared_reader("kv"):
            return True
        try:
            for g, salt in enumerate(self._salts("kv")):
                if store.store_named(names, views[g], [0], salt=salt) != 1:
                    return False
        except FerryError as e:
            self._failed(e, "kv", "set")
            return False
        self._count("kv", set=1, stored=1)
        return True

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None):
        t0 = time.perf_counter()
        n = 0
        for k, v in zip(keys, values):
            if not self.set(k, v):
                break
            n += 1
        self._measure("kv", 1, n, n * len(self._salts("kv")), self._pool("kv")[1], t0)
        return n == len(keys)

    # ---- housekeeping ----
    def _measure(self, key, backup, pages, chunks, store, t0):
        """One kv-pool page move for get_stats: the pages moved (read, or
        stored) and the GB/s of their chunks (one per head group). A call
        that moved nothing (the store failed, a shared page another rank
        writes) is no sample: no pages, and no bandwidth of a call that
        returned at once."""
        if not self._metrics or key != "kv" or not pages or store is None:
            return
        dt = max(time.perf_counter() - t0, 1e-9)
        gb = chunks * store.chunk_bytes / (1 << 30)
        with self._lock:
            self._io[backup].append(pages)
            self._io[2 + backup].append(gb / dt)

    def get_stats(self):
        """SGLang's StorageMetrics (its scheduler hands get_stats() to
        StorageMetricsCollector.log_storage_metrics on every step, which
        asserts the type): pages per kv prefetch / backup call and their
        GB/s since the last call, drained by it. None while the config's
        enable_storage_metrics is off, as SGLang's base. ferry's own page
        counts and store stats: ferry_stats()."""
        if not self._metrics:
            return None
        with self._lock:
            lists = [list(x) for x in self._io]
            for x in self._io:
                x.clear()
        return StorageMetrics(prefetch_pgs=lists[0], backup_pgs=lists[1],
                              prefetch_bandwidth=lists[2], backup_bandwidth=lists[3])

    def ferry_stats(self):
        """{pool: {"pages": the adapter's page counts (exists, hit, get, got,
        set, stored), "store": that pool's KVStore.stats()}}."""
        out = {}
        # copies: another thread may register a pool meanwhile. The pools
        # first, then the counts: a pool is published after its counts
        # (_register), so each pool taken here has them
        pools = list(self._pools.items())
        for key, _ in pools:
            self._fold(key)
        with self._lock:
            counts = {k: dict(v) for k, v in list(self._counts.items())}
        for key, (_, store) in pools:
            out[key] = {"pages": counts[key], "store": store and store.stats()}
        return out

    def clear(self):
        """Empty every pool's store (a shared daemon's cache too: every rank's)."""
        seen = set()
        for _, store in list(self._pools.values()):    # a copy: a pool may register meanwhile
            if store is not None and id(store) not in seen:
                seen.add(id(store))
                store.clear()
        return True

    def close(self):
        # refused first: a call racing the close then answers EBADF, never
        # "pool not registered" from the emptied pool table
        self._closed = True
        for reg, store in self._opened:
            if registered_store(reg) is store:
                unregister_store(reg)
            store.close()
        self._opened = []
        self._pools = {}
        self._lookups = {}
        self.store = None


__all__ = ["FerryHiCacheStorage", "HiCacheStorageConfig", "HiCacheStorageExtraInfo", "PoolName",
           "PoolHitPolicy", "PoolTransfer", "PoolTransferResult", "SGLANG", "UPSTREAM"]
