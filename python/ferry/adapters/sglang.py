"""ferry as an SGLang hierarchical-cache (HiCache) storage backend.

SGLang loads it as a dynamic storage backend:

    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "ferry",
        "module_path": "ferry.adapters.sglang", "class_name": "FerryHiCacheStorage",
        "interface_v1": 1, "ferry_store": "main"}'

Its cache controller then calls, from its prefetch and backup threads:
batch_exists(keys) to learn how many leading pages storage holds,
batch_get_v1(keys, host_indices) (or batch_get(keys, pages) without
"interface_v1") to read them into its host pool, and batch_set_v1 /
batch_set to back pages up.

Where the store comes from (extra config): "ferry_store" names a
ferry.KVStore registered with ferry.adapters.register_store() (default
"sglang"); without one, "ferry_l1" (and "ferry_l2", "ferry_persistent")
opens one when SGLang registers its host pool, with chunk_tokens = SGLang's
page size and the layout read from the pool. "ferry_server" (a `ferry
serve` address) is refused with NotImplementedError: this backend does not
connect to the daemon yet (the vLLM connector does, with "ferry.server").

How SGLang's keys map onto ferry. SGLang names a page by a string key (a
chained hash of its tokens, computed by SGLang); the storage interface
never sees the tokens. libferry's store is keyed by token ids (the chained
hash of the tokens it is given) and has no form that takes a caller's key.
So each page is stored as a sequence of one chunk (chunk_tokens = page
size) whose "tokens" are the 128-bit BLAKE2b digest of the key as four
int32 values, zero-padded to the page size. The bytes are SGLang's page,
verbatim, in ferry's chunk order [kv][layers][page tokens][heads *
head_dim] (a page_first pool's pages are transposed into it and back), and
they move through ferry's tiers, eviction and checksums like any chunk; two
keys share a chunk only if their digests collide (as likely as two token
prefixes sharing a ferry chunk id). The cost of the mapping: pages need at
least 4 tokens (a smaller page cannot carry 128 bits in its int32 ids),
ferry's prefix chaining is unused (each page is its own sequence), and
batch_exists asks one lookup per key. A libferry form addressed by the
caller's 128-bit chunk id (store, retrieve and lookup of ids instead of
tokens) would remove all three.

Zero-copy: with "interface_v1" and a layer_first host pool, pages move
between ferry and the host pool in place (the pool is ferry's paged form,
one block per page); page_first pools go through a staging page.
"""
import errno
import hashlib
import logging

import numpy as np

from .. import errors
from ..errors import FerryError
from ..kv import KVStore, Layout
from . import no_server, register_store, registered_store, unregister_store
from ._sglang_base import SGLANG, HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

log = logging.getLogger("ferry.sglang")

_SKIPPABLE = {errors.ENOSPACE, errors.ELOCKED, -errno.ENOMEM}
_KEY_TOKENS = 4  # 128 bits of digest as int32 token ids


def key_tokens(key, page_size):
    """The token ids a page key is stored under: BLAKE2b-128 of the key as
    four little-endian int32, then zeros up to the page size."""
    if page_size < _KEY_TOKENS:
        raise ValueError(
            f"ferry: SGLang page size {page_size} is below {_KEY_TOKENS} tokens: a page key "
            "needs 128 bits of token ids (libferry has no form keyed by the caller's id)")
    if isinstance(key, str):
        key = key.encode()
    d = hashlib.blake2b(bytes(key), digest_size=16).digest()
    out = np.zeros(page_size, dtype=np.int32)
    # token ids are 0 .. 2^31-1: the top bit of each word is dropped (124 bits left)
    out[:_KEY_TOKENS] = np.frombuffer(d, dtype="<u4") & 0x7FFFFFFF
    return out


class _Geometry:
    """An SGLang host pool's pages in ferry's terms."""

    def __init__(self, pool, mla):
        buf = pool.kv_buffer
        self.page = int(pool.page_size)
        self.layers = int(pool.layer_num)
        self.layout_name = pool.layout
        shape = tuple(buf.shape)
        if pool.layout not in ("layer_first", "page_first"):
            raise NotImplementedError(
                f"ferry: SGLang host pool layout {pool.layout!r}: only layer_first and "
                "page_first are mapped")
        self.kv = 1 if mla else 2
        if mla:   # [layers, size, 1, dim] or [size, layers, 1, dim]
            self.heads, self.head_dim = 1, shape[-1] * shape[-2]
            self.size = shape[1] if pool.layout == "layer_first" else shape[0]
        else:     # [2, layers, size, heads, head_dim] or [2, size, layers, heads, head_dim]
            self.heads, self.head_dim = shape[3], shape[4]
            self.size = shape[2] if pool.layout == "layer_first" else shape[1]
        self.row = self.heads * self.head_dim
        self.dtype = buf.dtype
        self.layout = Layout(self.layers, self.heads, self.head_dim, buf.dtype, kv=self.kv)
        self.layer_first = pool.layout == "layer_first"
        self.paged = None
        if self.layer_first and self.size % self.page == 0 and buf.is_contiguous():
            nb = self.size // self.page
            if mla:
                self.paged = [buf[l].view(nb, self.page, self.row) for l in range(self.layers)]
            else:
                self.paged = [buf[:, l].view(2, nb, self.page, self.heads, self.head_dim)
                              for l in range(self.layers)]

    def chunk_view(self, flat):
        """A flat page as ferry's contiguous chunk [kv][layers][page][row]
        (a view for layer_first, a transposed copy for page_first)."""
        flat = flat.reshape(-1)
        if self.layer_first:
            return flat.view(self.kv, self.layers, self.page, self.row)
        return flat.view(self.kv, self.page, self.layers, self.row).transpose(1, 2).contiguous()

    def new_chunk(self):
        import torch
        return torch.empty((self.kv, self.layers, self.page, self.row), dtype=self.dtype)

    def chunk_into(self, chunk, flat):
        """Write a chunk back into a flat page in the pool's page order."""
        flat.reshape(-1).view(self.kv, self.page, self.layers, self.row).copy_(chunk.transpose(1, 2))


class FerryHiCacheStorage(HiCacheStorage):
    """ferry's HiCache storage backend for SGLang (see the module's documentation)."""

    def __init__(self, storage_config, kwargs=None):
        self.config = storage_config
        extra = dict(storage_config.extra_config or {})
        self._extra = extra
        if extra.get("ferry_server"):
            raise no_server(extra["ferry_server"], "SGLang")
        self._name = extra.get("ferry_store", "sglang")
        mla = bool(storage_config.is_mla_model)
        self._mla = mla
        # MLA caches are the same on every rank: one key space for all of them
        self._rank = (0, 1) if mla else (storage_config.tp_rank, storage_config.tp_size)
        self.store = None
        self._geo = None
        self._opened = False

    # ---- set-up ----
    def register_mem_pool_host(self, mem_pool_host):
        super().register_mem_pool_host(mem_pool_host)
        geo = _Geometry(mem_pool_host, self._mla)
        key_tokens("", geo.page)  # refuses pages under 4 tokens now, not at the first page
        store = registered_store(self._name)
        if store is None:
            if "ferry_l1" not in self._extra:
                raise RuntimeError(f"ferry: SGLang backend: no store registered as "
                                   f"{self._name!r} and no \"ferry_l1\" to open one")
            e = self._extra
            store = KVStore(model=self.config.model_name or "sglang", layout=geo.layout,
                            l1=e["ferry_l1"], l2=e.get("ferry_l2"), chunk_tokens=geo.page,
                            tp_rank=self._rank[0], tp_world=self._rank[1],
                            persistent=bool(e.get("ferry_persistent", False)))
            register_store(self._name, store)
            self._opened = True
        if store.layout != geo.layout or store.chunk_tokens != geo.page:
            raise ValueError(
                f"ferry: SGLang pages are {geo.layout} x {geo.page} tokens; the store "
                f"{self._name!r} holds {store.layout} x {store.chunk_tokens} tokens")
        self.store, self._geo = store, geo

    def _tokens(self, key):
        if self._geo is None:
            raise RuntimeError("ferry: SGLang backend used before register_mem_pool_host")
        return key_tokens(key, self._geo.page)

    def _full(self, n):
        return n == self._geo.page

    # ---- existence ----
    def exists(self, key):
        return self._full(self.store.lookup(self._tokens(key)))

    def batch_exists(self, keys, extra_info=None):
        """Leading keys whose pages ferry holds."""
        for i, k in enumerate(keys):
            if not self.exists(k):
                return i
        return len(keys)

    # ---- pages as flat tensors (SGLang's generic path) ----
    def get(self, key, target_location=None, target_sizes=None):
        """Read the page into target_location (a flat page); None on a miss."""
        geo = self._geo
        if target_location is None:
            target_location = self.mem_pool_host.get_dummy_flat_data_page()
        toks = self._tokens(key)
        if geo.layer_first:
            got = self.store.retrieve(toks, geo.chunk_view(target_location))
        else:
            chunk = geo.new_chunk()
            got = self.store.retrieve(toks, chunk)
            if self._full(got):
                geo.chunk_into(chunk, target_location)
        return target_location if self._full(got) else None

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        targets = target_locations or [None] * len(keys)
        return [self.get(k, t) for k, t in zip(keys, targets)]

    def set(self, key, value=None, target_location=None, target_sizes=None):
        """Store one flat page; False when ferry declined it (full)."""
        return self._put(self._tokens(key), self._geo.chunk_view(value), None)

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None):
        for k, v in zip(keys, values):
            if not self.set(k, v):
                return False
        return True

    def _put(self, toks, data, table):
        try:
            return self._full(self.store.store(toks, data, table))
        except FerryError as e:
            if e.code not in _SKIPPABLE:
                raise
            log.warning("ferry: SGLang page not stored: %s", e)
            return False

    # ---- pages in the host pool (SGLang's zero-copy "v1" path) ----
    def _page_of(self, host_indices, i):
        start = int(host_indices[i * self._geo.page])
        if start % self._geo.page:
            raise ValueError(f"ferry: host index {start} is not at a page boundary")
        return start

    def batch_get_v1(self, keys, host_indices, extra_info=None):
        """Read pages into the host pool at host_indices (page i at
        host_indices[i * page]); stops at the first miss (SGLang uses the
        leading run)."""
        geo, out = self._geo, []
        for i, k in enumerate(keys):
            start = self._page_of(host_indices, i)
            if geo.paged is not None:
                ok = self._full(self.store.retrieve(self._tokens(k), geo.paged,
                                                    [start // geo.page]))
            else:
                page = self.get(k)
                ok = page is not None
                if ok:
                    self.mem_pool_host.set_from_flat_data_page(start, page)
            out.append(ok)
            if not ok:
                break
        return out + [False] * (len(keys) - len(out))

    def batch_set_v1(self, keys, host_indices, extra_info=None):
        """Store the host pool's pages at host_indices under keys."""
        geo, out = self._geo, []
        for i, k in enumerate(keys):
            start = self._page_of(host_indices, i)
            if geo.paged is not None:
                ok = self._put(self._tokens(k), geo.paged, [start // geo.page])
            else:
                ok = self.set(k, self.mem_pool_host.get_data_page(start, flat=True))
            out.append(ok)
        return out

    # ---- housekeeping ----
    def clear(self):
        if self.store is not None:
            self.store.clear()
        return True

    def close(self):
        if self._opened and self.store is not None:
            if registered_store(self._name) is self.store:
                unregister_store(self._name)
            self.store.close()
            self._opened = False
        self.store = None


__all__ = ["FerryHiCacheStorage", "HiCacheStorageConfig", "HiCacheStorageExtraInfo", "SGLANG",
           "key_tokens"]
