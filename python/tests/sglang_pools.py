"""Stand-ins for SGLang's host pools and cache controller, for the SGLang
backend's tests. SGLang is not installed here; these mirror, with the
same attribute names, buffer shapes and page methods, upstream
sgl-project/sglang at commit 001067fffe33427bee0ed2f007fb7551a1d76b44 (the
newest hicache_storage.py the reference index holds) and the files it
stores beside it:
- python/sglang/srt/mem_cache/pool_host/mha.py: MHATokenToKVPoolHost
  init_kv_buffer (layer_first [2][L][size][H][D], page_first
  [2][size][L][H][D], page_first_direct [2][pages][L][page][H][D],
  page_head [2][pages][H][page][L][D]), get_data_page,
  get_dummy_flat_data_page, set_from_flat_data_page;
- pool_host/mla.py (MLA: layer_first [L][size][1][D], page_first
  [size][L][1][D]; page_first_direct [pages][L][page][1][D] is inferred
  from mha.py's, not read);
- pool_host/mamba.py: MambaPoolHost (page_size 1, page_first: temporal
  [size][L][1][*t] and conv [size][L][1][*c] buffers, a page = the bytes
  of each in turn);
- pool_host/dsa.py: DSAIndexerPoolHost (index_k_with_scale_buffer,
  uint8, layer_first [L][pages][page_bytes], page_first [pages][L][1]
  [page_bytes]; page index = host index // page_size);
- managers/cache_controller.py (HiCacheController: _page_backup,
  _storage_hit_query, _page_transfer with _page_get_zero_copy /
  _generic_page_get, _page_set_zero_copy / _generic_page_set,
  _generate_storage_config) and mem_cache/hybrid_cache/
  hybrid_cache_controller.py (HybridCacheController: attach_storage_backend
  registering each PoolEntry with register_mem_host_pool_v2, _page_backup
  with batch_set_v2 before the kv pages, _page_transfer with batch_get_v2,
  _storage_hit_query with batch_exists_v2, _sync_trailing_keys);
- mem_cache/storage/backend_factory.py (_create_dynamic_backend: import
  module_path, take class_name, check it subclasses HiCacheStorage, build
  it with (storage_config, kwargs)).
"""
import hashlib
import importlib

import torch

from ferry.adapters import _sglang_base as base

STORAGE_BATCH_SIZE = 128


def fill(t, seed):
    g = torch.Generator().manual_seed(seed)
    if t.dtype == torch.uint8:
        t.copy_(torch.randint(0, 256, t.shape, generator=g, dtype=torch.uint8))
    else:
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))


class MHAHost:
    def __init__(self, layout, page, layers=2, heads=2, head_dim=64, pages=16,
                 dtype=torch.bfloat16):
        self.layout, self.page_size, self.layer_num = layout, page, layers
        self.head_num, self.head_dim, self.dtype = heads, head_dim, dtype
        self.page_num, self.size = pages, pages * page
        L, S, H, D, P, N = layers, self.size, heads, head_dim, page, pages
        dims = {"layer_first": (2, L, S, H, D), "page_first": (2, S, L, H, D),
                "page_first_direct": (2, N, L, P, H, D), "page_head": (2, N, H, P, L, D)}[layout]
        self.kv_buffer = torch.zeros(dims, dtype=dtype)

    def get_data_page(self, index, flat=True):
        index = int(index)
        if self.layout == "layer_first":
            p = self.kv_buffer[:, :, index:index + self.page_size]
        elif self.layout == "page_first":
            p = self.kv_buffer[:, index:index + self.page_size]
        else:
            r = index // self.page_size
            p = self.kv_buffer[:, r:r + 1]
        return p.flatten() if flat else p

    def get_dummy_flat_data_page(self):
        return torch.zeros((2, self.layer_num, self.page_size, self.head_num, self.head_dim),
                           dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index, data_page):
        page = self.get_data_page(index, flat=False)
        page[...] = data_page.reshape(page.shape)   # each layout's own page order


class MLAHost(MHAHost):
    def __init__(self, layout, page, layers=2, dim=64, pages=16, dtype=torch.bfloat16):
        self.layout, self.page_size, self.layer_num = layout, page, layers
        self.head_num, self.head_dim, self.dtype = 1, dim, dtype
        self.page_num, self.size = pages, pages * page
        L, S, D, P, N = layers, self.size, dim, page, pages
        dims = {"layer_first": (L, S, 1, D), "page_first": (S, L, 1, D),
                "page_first_direct": (N, L, P, 1, D)}[layout]
        self.kv_buffer = torch.zeros(dims, dtype=dtype)

    def get_data_page(self, index, flat=True):
        index = int(index)
        if self.layout == "layer_first":
            p = self.kv_buffer[:, index:index + self.page_size]
        elif self.layout == "page_first":
            p = self.kv_buffer[index:index + self.page_size]
        else:
            r = index // self.page_size
            p = self.kv_buffer[r:r + 1]
        return p.flatten() if flat else p

    def get_dummy_flat_data_page(self):
        return torch.zeros((self.layer_num, self.page_size, 1, self.head_dim),
                           dtype=self.dtype).flatten()


class DummyMLAHost:
    """MLATokenToKVPoolHost(is_dummy=True), as sgl-project/sglang commit
    01c0ede38cc9645488fd2847dbea8a2f6a9241d8 has it
    (python/sglang/srt/mem_cache/pool_host/mla.py, _init_dummy): the host
    pool of an attention-TP rank other than 0 under MLA host-memory dedup.
    Page slots and the fields of a full pool (layout, page_size, size,
    layer_num, kv_cache_dim, dtype, size_per_token), but kv_buffer,
    data_refs and data_ptrs None; get_dummy_flat_data_page is a full page
    of zeros, and get_data_page / set_from_flat_data_page index the None
    kv_buffer (a TypeError, as upstream's)."""

    def __init__(self, layout, page, layers=2, dim=64, pages=16, dtype=torch.bfloat16):
        self._is_dummy = True
        self.layout, self.page_size, self.layer_num = layout, page, layers
        self.kv_cache_dim, self.dtype, self.dcp_size = dim, dtype, 1
        self.page_num, self.size = pages, pages * page
        self.size_per_token = dim * torch.empty(0, dtype=dtype).element_size() * layers
        self.kv_buffer = self.data_refs = self.data_ptrs = None

    def get_data_page(self, index, flat=True):
        return self.kv_buffer[index:index + self.page_size]

    def get_dummy_flat_data_page(self):
        return torch.zeros((self.layer_num, self.page_size, 1, self.kv_cache_dim),
                           dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index, data_page):
        self.kv_buffer[index:index + self.page_size] = data_page


class DummyIndexerHost:
    """DSAIndexerPoolHost(is_dummy=True), as sgl-project/sglang commit
    03ba7b5b7dd249244bd5af01b236fd6449c66e8d has it
    (python/sglang/srt/mem_cache/pool_host/dsa.py): the DSA index pool
    beside a dummy MLA pool, its slots the anchor's (page_size, layout,
    size, page_num), its page rows' size (indexer_page_stride_size bytes a
    layer, indexer_dtype uint8) and index_k_with_scale_buffer None."""

    def __init__(self, anchor, page_bytes_per_token=132):
        self._is_dummy = True
        self.page_size, self.layout, self.size = anchor.page_size, anchor.layout, anchor.size
        self.page_num, self.layer_num = anchor.page_num, anchor.layer_num
        self.indexer_dtype = self.dtype = torch.uint8
        self.indexer_page_stride_size = page_bytes_per_token * anchor.page_size
        self.size_per_token = page_bytes_per_token * self.layer_num
        self.index_k_with_scale_buffer = None


class MambaHost:
    def __init__(self, slots=8, layers=2, temporal=(2, 4, 4), convs=((3, 8), (3, 4)),
                 layout="page_first"):
        self.page_size, self.layout, self.size = 1, layout, slots
        self.temporal_buffer = torch.zeros((slots, layers, 1) + temporal, dtype=torch.float32)
        self.conv_buffer = [torch.zeros((slots, layers, 1) + c, dtype=torch.bfloat16)
                            for c in convs]
        self.size_per_token = sum(t[0].numel() * t.element_size()
                                  for t in [self.temporal_buffer] + self.conv_buffer)

    def _iter_page_tensors(self, index):
        yield self.temporal_buffer[index]
        for c in self.conv_buffer:
            yield c[index]

    def get_data_page(self, index, flat=True):
        return torch.cat([t.contiguous().view(torch.uint8).reshape(-1)
                          for t in self._iter_page_tensors(int(index))])

    def get_dummy_flat_data_page(self):
        return torch.zeros(self.page_size * self.size_per_token, dtype=torch.uint8)

    def set_from_flat_data_page(self, index, data_page):
        b = data_page.contiguous().view(torch.uint8).reshape(-1)
        start = 0
        for t in self._iter_page_tensors(int(index)):
            n = t.numel() * t.element_size()
            t.copy_(b[start:start + n].view(t.dtype).reshape(t.shape))
            start += n

    def fill(self, seed):
        for i, t in enumerate([self.temporal_buffer] + self.conv_buffer):
            fill(t, seed + i)


class IndexerHost:
    def __init__(self, anchor, page_bytes_per_token=132):
        self.page_size, self.layout, self.size = anchor.page_size, anchor.layout, anchor.size
        self.layer_num = anchor.layer_num
        pb = page_bytes_per_token * anchor.page_size
        n = anchor.page_num
        dims = (self.layer_num, n, pb) if self.layout == "layer_first" else \
            (n, self.layer_num, 1, pb)
        self.index_k_with_scale_buffer = torch.zeros(dims, dtype=torch.uint8)

    def page(self, index):
        p = int(index) // self.page_size
        b = self.index_k_with_scale_buffer
        return (b[:, p] if self.layout == "layer_first" else b[p, :, 0]).clone()


def page_hashes(tokens, page, prior=None):
    """get_hash_str: one hex SHA-256 per whole page, chained over the previous."""
    out = []
    for i in range(0, len(tokens) - len(tokens) % page, page):
        h = hashlib.sha256()
        if prior is not None:
            h.update(bytes.fromhex(prior))
        for t in tokens[i:i + page]:
            h.update(int(t).to_bytes(4, "little", signed=False))
        prior = h.hexdigest()
        out.append(prior)
    return out


def storage_config(extra, mla=False, tp=(0, 1), pp=(0, 1), cp=(0, 1), dp=(0, 1), lcm=None,
                   split=False, metrics=True):
    return base.HiCacheStorageConfig(
        tp_rank=tp[0], tp_size=tp[1], pp_rank=pp[0], pp_size=pp[1], attn_cp_rank=cp[0],
        attn_cp_size=cp[1], is_mla_model=mla, enable_storage_metrics=metrics,
        is_page_first_layout=False, model_name="tiny", dp_rank=dp[0], dp_size=dp[1],
        tp_lcm_size=lcm, should_split_heads=split, extra_config=extra)


def create_backend(extra, pools, **cfg):
    """StorageBackendFactory._create_dynamic_backend, then the controllers'
    registration: register_mem_pool_host(kv host pool) and, for a hybrid
    host pool group, register_mem_host_pool_v2(entry.host_pool, entry.name)."""
    extra = dict({"backend_name": "ferry", "module_path": "ferry.adapters.sglang",
                  "class_name": "FerryHiCacheStorage"}, **extra)
    cls = getattr(importlib.import_module(extra["module_path"]), extra["class_name"])
    assert issubclass(cls, base.HiCacheStorage)
    backend = cls(storage_config(extra, **cfg), {})
    backend.register_mem_pool_host(pools["kv"])
    for name, host in pools.items():
        if name != "kv":
            backend.register_mem_host_pool_v2(host, base.PoolName(name))
    return backend


class Controller:
    """HiCacheController's and HybridCacheController's storage paths."""

    def __init__(self, backend, pool, v1):
        self.backend, self.pool, self.v1 = backend, pool, v1
        self.page = pool.page_size

    def backup(self, hashes, host_indices, pool_transfers=None):
        if pool_transfers:                       # HybridCacheController._page_backup
            self.backend.batch_set_v2(pool_transfers, None)
        done = 0
        for i in range(0, len(hashes), STORAGE_BATCH_SIZE):
            bh = hashes[i:i + STORAGE_BATCH_SIZE]
            bi = host_indices[i * self.page:(i + len(bh)) * self.page]
            if self.v1:
                ok = all(self.backend.batch_set_v1(bh, bi, base.HiCacheStorageExtraInfo()))
            else:
                ok = self.backend.batch_set(bh, [self.pool.get_data_page(bi[j * self.page])
                                                 for j in range(len(bh))])
            if not ok:
                break
            done += len(bh)
        return done

    def hit_query(self, hashes, pool_transfers=None):
        if pool_transfers:
            r = self.backend.batch_exists_v2(hashes, pool_transfers, None)
            for t in pool_transfers if r.kv_hit_pages else []:   # _sync_trailing_keys
                if t.hit_policy == base.PoolHitPolicy.TRAILING_PAGES:
                    n = len(t.keys) if t.keys else 1
                    t.keys = hashes[max(0, r.kv_hit_pages - n):r.kv_hit_pages]
            return r
        return self.backend.batch_exists(hashes, None)

    def fetch(self, hashes, host_indices, pool_transfers=None):
        extra = None
        if pool_transfers:
            extra = self.backend.batch_get_v2(pool_transfers, None)
        n = 0
        for i in range(0, len(hashes), STORAGE_BATCH_SIZE):
            bh = hashes[i:i + STORAGE_BATCH_SIZE]
            bi = host_indices[i * self.page:(i + len(bh)) * self.page]
            if self.v1:
                ok = self.backend.batch_get_v1(bh, bi, None)
                k = ok.index(False) if False in ok else len(ok)
            else:
                pages = self.backend.batch_get(bh, [self.pool.get_dummy_flat_data_page()
                                                    for _ in bh])
                k = 0
                for j, p in enumerate(pages):
                    if p is None:
                        break
                    self.pool.set_from_flat_data_page(bi[j * self.page], p)
                    k += 1
            n += k
            if k < len(bh):
                break
        return (n, extra) if pool_transfers else n


def indices(first_page, pages, page):
    return torch.arange(first_page * page, (first_page + pages) * page, dtype=torch.int64)


# DeepSeek V4's host pools: stand-ins with the attribute names, buffer
# shapes and page methods of sgl-project/sglang at commit
# 00343773d3293d382f0b39101f36b656d30ad2f0,
# python/sglang/srt/mem_cache/memory_pool_host.py (the newest version of
# that file the reference index holds):
# - LogicalHostPool: the pure-logical KV anchor of V4 HiCache; page-aligned
#   token slots and no tensor (kv_buffer None, layer_num 0; get_data_page
#   and get_dummy_flat_data_page give an empty uint8 tensor,
#   set_from_flat_data_page does nothing);
# - DeepSeekV4PagedHostPool (the compressed C4 / C128 KV and indexer pools)
#   and DeepSeekV4StateHostPool (their compress states): uint8 page rows,
#   page_size = slot_page_size (swa_page_size for the states), size =
#   num_host_pages * page_size; kv_buffer a list of [pages][item_bytes] per
#   layer (layer_first), [pages][layers][item_bytes] (page_first) or
#   [pages][layers][1][item_bytes] (page_first_direct); host index i is in
#   row i // page_size, and a flat page is a row's bytes of every layer.
#   SGLang's V4 stack (build_deepseek_v4_hicache_stack) builds the
#   KV-derived ones (C4, C128, the C4 indexer) with slot_page_size = the
#   tree page size and the anchor's num_host_pages (anchor page k is their
#   row k), the SWA pool and the states with swa_page_size and the SWA
#   pool's page count.
class LogicalHost:
    def __init__(self, pages=16, page=8, layout="page_first"):
        self.size, self.page_size, self.layout = pages * page, page, layout
        self.dtype, self.layer_num, self.kv_buffer, self.size_per_token = \
            torch.uint8, 0, None, 0

    def get_data_page(self, index, flat=True):
        return torch.empty(0, dtype=torch.uint8)

    def get_dummy_flat_data_page(self):
        return torch.empty(0, dtype=torch.uint8)

    def set_from_flat_data_page(self, index, data_page):
        pass

    def get_page_buffer_meta(self, indices):
        return None


class V4RowsHost:
    def __init__(self, layout, page, layers=3, item_bytes=96, pages=8, state=False):
        self.layout, self.layer_num, self.item_bytes = layout, layers, item_bytes
        self.num_host_pages, self.dtype = pages, torch.uint8
        if state:
            self.swa_page_size = page
        else:
            self.slot_page_size = page
        self.page_size, self.size = page, pages * page
        if layout == "layer_first":
            self.kv_buffer = [torch.zeros((pages, item_bytes), dtype=torch.uint8)
                              for _ in range(layers)]
        elif layout == "page_first":
            self.kv_buffer = torch.zeros((pages, layers, item_bytes), dtype=torch.uint8)
        else:
            self.kv_buffer = torch.zeros((pages, layers, 1, item_bytes), dtype=torch.uint8)

    def row(self, index):
        r = int(index) // self.page_size
        if self.layout == "layer_first":
            return torch.stack([b[r] for b in self.kv_buffer])
        return self.kv_buffer[r]

    def get_data_page(self, index, flat=True):
        p = self.row(index)
        return p.flatten() if flat else p

    def get_dummy_flat_data_page(self):
        return torch.zeros((self.layer_num, self.item_bytes), dtype=torch.uint8).flatten()

    def set_from_flat_data_page(self, index, data_page):
        r = int(index) // self.page_size
        data = data_page.view(torch.uint8).reshape(self.layer_num, self.item_bytes)
        if self.layout == "layer_first":
            for i, b in enumerate(self.kv_buffer):
                b[r].copy_(data[i])
        else:
            self.kv_buffer[r].copy_(data.reshape(self.kv_buffer[r].shape))

    def fill(self, seed):
        for i, b in enumerate(self.kv_buffer if isinstance(self.kv_buffer, list)
                              else [self.kv_buffer]):
            fill(b, seed + i)
