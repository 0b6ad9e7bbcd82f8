"""ferry's SGLang HiCache storage backend driven through the calls SGLang makes.

SGLang is not installable here, so its cache controller is replayed from
its source (sgl-project/sglang, 2025-2026):
- loading: StorageBackendFactory.create_backend("dynamic", storage_config,
  mem_pool_host) -> _create_dynamic_backend (sglang/srt/mem_cache/storage/
  backend_factory.py): import extra_config["module_path"], take
  extra_config["class_name"], check it subclasses HiCacheStorage, build it
  with (storage_config, kwargs); then HiCacheController.attach_storage_backend
  (sglang/srt/managers/cache_controller.py) calls
  register_mem_pool_host(host_pool) and picks the zero-copy page functions
  when extra_config["interface_v1"] is set.
- backup, HiCacheController._page_backup: per batch of page hashes,
  _page_set_zero_copy -> all(batch_set_v1(hashes, host_indices, extra_info))
  or _generic_page_set -> batch_set(hashes, [host_pool.get_data_page(
  host_indices[i * page_size]) ...]).
- prefetch, HiCacheController._storage_hit_query: page hashes of the tokens
  (get_hash_str, sglang/srt/mem_cache/utils.py: SHA-256 chained over each
  page's token ids), batch_exists(hashes, extra_info) -> leading pages held;
  then _page_transfer: _page_get_zero_copy -> batch_get_v1(hashes,
  host_indices, extra_info), counting the leading True, or _generic_page_get
  -> batch_get(hashes, [host_pool.get_dummy_flat_data_page() ...]) then
  host_pool.set_from_flat_data_page(host_indices[i * page_size], page).
The host pools below mirror SGLang's MHATokenToKVPoolHost and
MLATokenToKVPoolHost (sglang/srt/mem_cache/pool_host/mha.py, mla.py):
kv_buffer shapes per layout, get_data_page, get_dummy_flat_data_page,
set_from_flat_data_page. SGLang's storage holds no per-request state (no
pins): a finished request leaves nothing behind in the backend.
"""
import hashlib
import importlib

import pytest
import torch

import ferry
from ferry.adapters import _sglang_base, register_store, registered_store, unregister_store

PAGE, LAYERS, HEADS, HD, SIZE = 8, 3, 2, 4, 128
NAME = "sglang-test"


class HostPool:
    """SGLang's MHA (or MLA) host pool, the parts the storage path touches."""

    def __init__(self, layout="layer_first", mla=False, page=PAGE, dtype=torch.float32):
        self.layout, self.page_size, self.layer_num, self.dtype = layout, page, LAYERS, dtype
        self.mla, self.size = mla, SIZE
        self.head_num, self.head_dim = (1, HD * HEADS) if mla else (HEADS, HD)
        if mla:
            dims = (LAYERS, SIZE, 1, self.head_dim) if layout == "layer_first" else \
                (SIZE, LAYERS, 1, self.head_dim)
        else:
            dims = (2, LAYERS, SIZE, HEADS, HD) if layout == "layer_first" else \
                (2, SIZE, LAYERS, HEADS, HD)
        self.kv_buffer = torch.zeros(dims, dtype=dtype)

    def _page(self, index):
        p = self.page_size
        if self.mla:
            return self.kv_buffer[:, index:index + p] if self.layout == "layer_first" \
                else self.kv_buffer[index:index + p]
        return self.kv_buffer[:, :, index:index + p] if self.layout == "layer_first" \
            else self.kv_buffer[:, index:index + p]

    def get_data_page(self, index, flat=True):
        page = self._page(index)
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self):
        return torch.zeros(self._page(0).numel(), dtype=self.dtype)

    def set_from_flat_data_page(self, index, data_page):
        page = self._page(index)
        page[...] = data_page.reshape(page.shape)

    def fill(self, seed):
        g = torch.Generator().manual_seed(seed)
        self.kv_buffer.copy_(torch.randn(self.kv_buffer.shape, generator=g).to(self.dtype))


def page_hashes(tokens, page):
    """get_hash_str: one hex SHA-256 per whole page, chained over the previous."""
    out, prior = [], None
    for i in range(0, len(tokens) - len(tokens) % page, page):
        h = hashlib.sha256()
        if prior is not None:
            h.update(bytes.fromhex(prior))
        for t in tokens[i:i + page]:
            h.update(int(t).to_bytes(4, "little", signed=False))
        prior = h.hexdigest()
        out.append(prior)
    return out


def storage_config(extra, mla=False):
    return _sglang_base.HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, is_mla_model=mla,
        is_page_first_layout=False, model_name="tiny", extra_config=extra)


def create_backend(pool, extra, mla=False):
    """StorageBackendFactory._create_dynamic_backend, then register_mem_pool_host."""
    extra = dict({"backend_name": "ferry", "module_path": "ferry.adapters.sglang",
                  "class_name": "FerryHiCacheStorage"}, **extra)
    cls = getattr(importlib.import_module(extra["module_path"]), extra["class_name"])
    assert issubclass(cls, _sglang_base.HiCacheStorage)
    backend = cls(storage_config(extra, mla), {})
    backend.register_mem_pool_host(pool)
    return backend


class Controller:
    """HiCacheController's storage paths (backup and prefetch)."""

    def __init__(self, backend, pool, v1):
        self.backend, self.pool, self.v1 = backend, pool, v1
        self.page = pool.page_size

    def backup(self, hashes, host_indices):
        if self.v1:
            return all(self.backend.batch_set_v1(hashes, host_indices, None))
        data = [self.pool.get_data_page(int(host_indices[i * self.page]))
                for i in range(len(hashes))]
        return self.backend.batch_set(hashes, data)

    def hit_query(self, hashes):
        return self.backend.batch_exists(hashes, None)

    def fetch(self, hashes, host_indices):
        if self.v1:
            ok = self.backend.batch_get_v1(hashes, host_indices, None)
            return ok.index(False) if False in ok else len(ok)
        pages = self.backend.batch_get(hashes, [self.pool.get_dummy_flat_data_page()
                                                for _ in hashes])
        n = 0
        for i, page in enumerate(pages):
            if page is None:
                break
            self.pool.set_from_flat_data_page(int(host_indices[i * self.page]), page)
            n += 1
        return n


def indices(first_page, pages):
    return torch.arange(first_page * PAGE, (first_page + pages) * PAGE, dtype=torch.int64)


@pytest.fixture(autouse=True)
def _clean():
    yield
    s = unregister_store(NAME)
    if s is not None:
        s.close()


def backend_for(pool, v1, mla=False):
    return create_backend(pool, {"ferry_store": NAME, "ferry_l1": "2M",
                                 "interface_v1": 1 if v1 else 0}, mla=mla)


@pytest.mark.parametrize("v1", [True, False], ids=["zero_copy_v1", "generic"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_pages_backed_up_are_prefetched_bitwise(layout, v1, mla):
    pool = HostPool(layout, mla)
    pool.fill(1)
    ctl = Controller(backend_for(pool, v1, mla), pool, v1)
    tokens = list(range(500, 500 + 5 * PAGE + 3))
    hashes = page_hashes(tokens, PAGE)
    assert len(hashes) == 5
    assert ctl.hit_query(hashes) == 0                      # nothing in storage yet
    assert ctl.backup(hashes, indices(2, 5))               # host pages 2..6
    assert ctl.hit_query(hashes) == 5
    want = [pool.get_data_page(i * PAGE).clone() for i in range(2, 7)]
    other = pool.kv_buffer.clone()
    pool.kv_buffer.zero_()
    assert ctl.fetch(hashes, indices(9, 5)) == 5           # into host pages 9..13
    for i, w in enumerate(want):
        assert torch.equal(pool.get_data_page((9 + i) * PAGE), w)
    # nothing but the fetched pages changed
    for p in range(SIZE // PAGE):
        if not 9 <= p < 14:
            assert torch.count_nonzero(pool.get_data_page(p * PAGE)) == 0
    assert not torch.equal(other, pool.kv_buffer)


@pytest.mark.parametrize("v1", [True, False], ids=["zero_copy_v1", "generic"])
def test_misses_load_nothing_and_stop_at_the_first_gap(v1):
    pool = HostPool()
    pool.fill(2)
    ctl = Controller(backend_for(pool, v1), pool, v1)
    hashes = page_hashes(list(range(4 * PAGE)), PAGE)
    assert ctl.backup(hashes[:2], indices(0, 2))
    unknown = page_hashes(list(range(9000, 9000 + 2 * PAGE)), PAGE)
    assert ctl.hit_query(unknown) == 0
    before = pool.kv_buffer.clone()
    assert ctl.fetch(unknown, indices(10, 2)) == 0
    assert torch.equal(before, pool.kv_buffer)             # a miss writes nothing
    assert ctl.hit_query(hashes) == 2                      # leading pages only
    assert ctl.fetch(hashes, indices(10, 4)) == 2
    assert torch.equal(pool.kv_buffer, before) is False
    assert torch.count_nonzero(pool.get_data_page(12 * PAGE) - before[:, :, 12 * PAGE:13 * PAGE]
                               .flatten()) == 0           # page 3's target untouched


def test_keys_share_nothing_with_token_lookups():
    """A page is stored under its key's digest, not under SGLang's tokens."""
    pool = HostPool()
    pool.fill(3)
    b = backend_for(pool, True)
    tokens = list(range(PAGE))
    h = page_hashes(tokens, PAGE)
    assert b.batch_set_v1(h, indices(0, 1)) == [True]
    assert b.exists(h[0]) and not b.exists(h[0] + "x")
    assert b.store.lookup(tokens) == 0


def test_store_found_by_name_and_checked_against_the_pool():
    pool = HostPool()
    lay = ferry.Layout(LAYERS, HEADS, HD, "f32")
    s = ferry.KVStore("tiny", lay, l1="1M", chunk_tokens=PAGE)
    register_store(NAME, s)
    b = create_backend(pool, {"ferry_store": NAME})
    assert b.store is s
    unregister_store(NAME)
    register_store(NAME, ferry.KVStore("tiny", lay, l1="1M", chunk_tokens=2 * PAGE))
    with pytest.raises(ValueError, match="holds"):
        create_backend(pool, {"ferry_store": NAME})
    s.close()


def test_backend_opened_from_config_is_closed_by_the_controller():
    pool = HostPool()
    b = backend_for(pool, True)
    assert registered_store(NAME) is b.store
    b.close()                                              # detach_storage_backend
    assert registered_store(NAME) is None


def test_unsupported_setups_are_refused():
    with pytest.raises(ValueError, match="below 4 tokens"):
        create_backend(HostPool(page=2), {"ferry_store": NAME, "ferry_l1": "1M"})
    # the module says so: this backend takes no daemon address (the vLLM
    # connector does), and nothing is opened or registered for it
    with pytest.raises(NotImplementedError,
                       match=r"does not connect to `ferry serve` \(the vLLM connector does"):
        create_backend(HostPool(), {"ferry_server": "unix:/run/ferry.sock"})
    assert registered_store("sglang") is None
    with pytest.raises(RuntimeError, match="no store registered"):
        create_backend(HostPool(), {"ferry_store": "nowhere"})


def test_real_sglang_base_class_when_installed():
    base = pytest.importorskip("sglang.srt.mem_cache.hicache_storage")
    from ferry.adapters.sglang import FerryHiCacheStorage
    assert issubclass(FerryHiCacheStorage, base.HiCacheStorage)


def test_stand_in_base_without_sglang():
    if _sglang_base.SGLANG:
        pytest.skip("SGLang is installed: its own base class is used")
    from ferry.adapters.sglang import FerryHiCacheStorage
    assert FerryHiCacheStorage.__mro__[1].__module__ == "ferry.adapters._sglang_base"
    assert not getattr(FerryHiCacheStorage, "__abstractmethods__", None)
