"""ferry's SGLang backend against host pools whose pages are not all in
kv_buffer (or in a row pool's rows), and against a pool that registers
while other threads call the backend.

Upstream files mirrored (sgl-project/sglang, the newest stored versions
the reference index holds):
- python/sglang/srt/mem_cache/pool_host/mha.py at
  0047d999bb3a3ad311df5a4b6356bfb5586e0d66: MHATokenToKVPoolHost.
  get_size_per_token is head_dim * head_num * layer_num * itemsize * 2,
  exactly kv_buffer's bytes a token (HostKVCache keeps it as
  size_per_token);
- pool_host/mha_mxfp8.py at 02d20b8bfc3d023a255f8ca70332fb035ee5d7b3:
  MHATokenToKVPoolMXFP8Host, page_first only; the fp8 payload is the MHA
  kv_buffer, the UE8M0 scales are k_scale_host / v_scale_host
  [page_num][layer_num][sf_page_bytes] uint8, get_size_per_token adds
  (k_sf_page_bytes + v_sf_page_bytes) // page_size * layer_num, and
  get_data_page / get_dummy_flat_data_page / set_from_flat_data_page /
  get_page_buffer_meta raise NotImplementedError ("a page's UE8M0 scales
  live outside kv_buffer");
- pool_host/mha_fp4.py at 35efab099f612332025848253fd778f5e3805cbd:
  MHATokenToKVPoolFP4Host, the same boundary ("L3 flat storage is
  unsupported (scales live outside kv_buffer)"), its scales in
  _scale_host_<name> side buffers;
- pool_host/mha.py at 0047d999 too: AsymmetricMHATokenToKVPoolHost (MHA
  models whose K and V head dims differ, e.g. MiMo-V2): kv_buffer is the
  tuple (k_buffer, v_buffer) of [size][L][H][head_dim] and [size][L][H]
  [v_head_dim] (page_first), v_head_dim set beside head_dim, and its
  flat-page calls raise NotImplementedError naming other backends;
- pool_host/mla.py at 01c0ede38cc9645488fd2847dbea8a2f6a9241d8:
  MLATokenToKVPoolHost(dcp_size, dcp_rank): host page_size = page_size //
  dcp_size, and get_data_page asserts dcp_size == 1 ("HiCache L3 storage
  paths are not yet DCP-aware (per-rank shards need dcp_rank-scoped
  keys)").

A backend that stored such a pool through kv_buffer's strides would keep
the fp8 / fp4 payload without its scales (or one DCP rank's shard under
every rank's key), and a later prefetch would load values that are not
the page's: ferry refuses the pool when it registers, naming why.
"""
import pytest
import torch

from ferry.adapters import _sglang_base as base, registered_store, unregister_store
from sglang_pools import (LogicalHost, MambaHost, MHAHost, MLAHost, V4RowsHost, create_backend,
                          fill, indices, page_hashes)


@pytest.fixture(autouse=True)
def _clean():
    yield
    for n in ("sgl", "sgl.mamba", "sgl.deepseek_v4_c4_indexer"):
        s = unregister_store(n)
        if s is not None:
            s.close()


def sized(host):
    """HostKVCache's size_per_token, as SGLang's MHA / MLA host pools give it."""
    kv = 1 if isinstance(host, MLAHost) else 2
    host.size_per_token = kv * host.layer_num * host.head_num * host.head_dim * \
        host.kv_buffer.element_size()
    return host


class MXFP8Host(MHAHost):
    """MHATokenToKVPoolMXFP8Host's storage surface (see the module's note)."""

    def __init__(self, page=4, sf_page_bytes=16):
        super().__init__("page_first", page, dtype=torch.uint8)    # fp8 bytes (this torch has no float8)
        self.k_sf_page_bytes = self.v_sf_page_bytes = sf_page_bytes
        self.k_scale_host = torch.zeros((self.page_num, self.layer_num, sf_page_bytes),
                                        dtype=torch.uint8)
        self.v_scale_host = torch.zeros_like(self.k_scale_host)
        sized(self)
        self.size_per_token += (2 * sf_page_bytes) // page * self.layer_num

    def _unsupported(self, *a, **k):
        raise NotImplementedError("MXFP8 KV host pool does not expose flat storage (L3) "
                                  "pages yet: a page's UE8M0 scales live outside kv_buffer.")

    get_data_page = get_dummy_flat_data_page = set_from_flat_data_page = _unsupported


def test_a_pool_with_scales_outside_kv_buffer_is_refused():
    """Without the check the pool registers, and a page backed up and
    loaded again comes back with the payload and the slot's old scales."""
    pool = MXFP8Host()
    with pytest.raises(ValueError, match=r"outside kv_buffer.*cannot be stored"):
        create_backend({"ferry_store": "sgl", "ferry_l1": "4M"}, {"kv": pool})
    assert registered_store("sgl") is None         # refused before any store opened


def test_a_dcp_sharded_mla_pool_is_refused():
    pool = sized(MLAHost("page_first", 4))
    pool.dcp_size, pool.dcp_rank = 2, 1
    with pytest.raises(ValueError, match="decode-context-parallel"):
        create_backend({"ferry_store": "sgl", "ferry_l1": "4M"}, {"kv": pool}, mla=True)
    assert registered_store("sgl") is None


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_pools_whose_pages_are_all_in_kv_buffer_still_round_trip(layout, mla):
    pool = sized(MLAHost(layout, 4) if mla else MHAHost(layout, 4))
    b = create_backend({"ferry_store": "sgl", "ferry_l1": "4M"}, {"kv": pool}, mla=mla)
    fill(pool.kv_buffer, 9)
    want = [pool.get_data_page(s).clone() for s in (0, 4)]
    h = page_hashes(list(range(8)), 4)
    assert b.batch_set_v1(h, indices(0, 2, 4)) == [True, True]
    pool.kv_buffer.zero_()
    assert b.batch_get_v1(h, indices(5, 2, 4)) == [True, True]
    for w, s in zip(want, (20, 24)):
        assert torch.equal(pool.get_data_page(s).view(torch.uint8), w.view(torch.uint8))
    b.close()


class AsymmetricHost:
    """AsymmetricMHATokenToKVPoolHost's storage surface (see the module's note)."""

    def __init__(self, page=4, layers=2, heads=2, head_dim=64, v_head_dim=32, pages=8):
        self.layout, self.page_size, self.layer_num = "page_first", page, layers
        self.head_num, self.head_dim, self.v_head_dim = heads, head_dim, v_head_dim
        self.dtype, self.page_num, self.size = torch.bfloat16, pages, pages * page
        self.kv_buffer = (torch.zeros((self.size, layers, heads, head_dim), dtype=self.dtype),
                          torch.zeros((self.size, layers, heads, v_head_dim), dtype=self.dtype))
        self.size_per_token = (head_dim + v_head_dim) * heads * layers * 2

    def _unsupported(self, *a, **k):
        raise NotImplementedError("Models with head_dim != v_head_dim do not support the "
                                  "flat-page interface used by HiCache L3 storage backends "
                                  "{hf3fs, eic, nixl}. Use a backend that does not use this "
                                  "interface (e.g. mooncake, simm).")

    get_data_page = get_dummy_flat_data_page = set_from_flat_data_page = _unsupported


def test_k_and_v_of_two_head_dims_are_refused_naming_them():
    """Before, the pool's (k, v) tuple read as a DeepSeek V4 row pool and
    SGLang's NotImplementedError escaped from registration, pointing the
    operator at other backends."""
    with pytest.raises(ValueError, match="head_dim 64, v_head_dim 32"):
        create_backend({"ferry_store": "sgl", "ferry_l1": "4M"}, {"kv": AsymmetricHost()})
    assert registered_store("sgl") is None


class _Publishing(dict):
    """A pool table that lets a caller in the moment a pool is published,
    as another thread may: SGLang's HybridCacheController.
    register_host_pool_entry (sgl-project/sglang 00343773d3293d382f0b39101f36b656d30ad2f0,
    python/sglang/srt/mem_cache/hybrid_cache/hybrid_cache_controller.py)
    registers a sidecar pool with register_mem_host_pool_v2 while the
    controller's prefetch and backup threads run, and ferry_stats may be
    read from any thread."""

    def __init__(self, old, on_publish):
        super().__init__(old)
        self.on_publish = on_publish

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self.on_publish(key)


def test_a_pool_is_published_only_with_its_counts():
    """Before, _register put the pool in the table and then made its page
    counts: a page move or ferry_stats in between raised KeyError (in
    SGLang's backup thread, which catches nothing)."""
    kv = MHAHost("page_first", 4)
    b = create_backend({"ferry_store": "sgl", "ferry_l1": "4M"}, {"kv": kv})
    mamba = MambaHost()
    mamba.fill(3)
    h = page_hashes(list(range(4)), 4)
    seen = []

    def on_publish(key):
        if key != "mamba":
            return
        t = base.PoolTransfer(name=base.PoolName.MAMBA, host_indices=torch.tensor([2]),
                              keys=h)
        seen.append(b.batch_set_v2([t]))
        seen.append(b.ferry_stats()["mamba"]["pages"]["stored"])

    b._pools = _Publishing(b._pools, on_publish)
    b.register_mem_host_pool_v2(mamba, base.PoolName.MAMBA)
    assert seen == [{base.PoolName.MAMBA: [True]}, 1]
    b.close()


def test_ferry_stats_while_a_pool_registers():
    """ferry_stats walked the live pool table, with the counts read before
    it: a pool registered meanwhile (another thread) made it raise
    (RuntimeError: the table changed size, or KeyError: no counts)."""
    kv = MHAHost("page_first", 4)
    b = create_backend({"ferry_store": "sgl", "ferry_l1": "4M"}, {"kv": kv})
    store, stats = b._pools["kv"][1], b._pools["kv"][1].stats

    def registering():      # the other thread, between two reads of ferry_stats
        if "mamba" not in b._pools:
            b.register_mem_host_pool_v2(MambaHost(), base.PoolName.MAMBA)
        return stats()

    store.stats = registering
    got = b.ferry_stats()       # the pools it found when it began
    assert set(got) == {"kv"}
    assert got["kv"]["pages"]["set"] == 0
    assert set(b.ferry_stats()) == {"kv", "mamba"}
    del store.stats
    b.close()


def test_a_row_pool_with_its_scales_beside_kv_buffer_is_refused():
    """DeepSeekV4PagedHostPool.attach_scale_buffers (sgl-project/sglang
    00343773d3293d382f0b39101f36b656d30ad2f0, python/sglang/srt/mem_cache/
    memory_pool_host.py: the NPU C4 indexer's int8 K in kv_buffer, its fp16
    scales in scale_kv_buffer [pages][layers][1][scale_item_bytes] for a
    page_first pool) moves the scales beside the rows, but get_data_page /
    set_from_flat_data_page (what ferry stores of a row pool) hold
    kv_buffer's rows only. Stored, a page would come back with the slot's
    old scales: the pool is refused when it registers, naming them."""
    rows = V4RowsHost("page_first", 4)
    rows.scale_item_bytes = 4 * 2
    rows.scale_kv_buffer = torch.zeros((rows.num_host_pages, rows.layer_num, 1,
                                        rows.scale_item_bytes), dtype=torch.uint8)
    pools = {"kv": LogicalHost(page=4), "deepseek_v4_c4_indexer": rows}
    with pytest.raises(ValueError, match="scale_kv_buffer"):
        create_backend({"ferry_store": "sgl", "ferry_l1": "4M"}, pools, mla=True)
    assert registered_store("sgl.deepseek_v4_c4_indexer") is None


def test_a_row_pool_without_scale_buffers_still_registers():
    rows = V4RowsHost("page_first", 4)
    rows.scale_kv_buffer = None          # attach_scale_buffers never called
    pools = {"kv": LogicalHost(page=4), "deepseek_v4_c4_indexer": rows}
    b = create_backend({"ferry_store": "sgl", "ferry_l1": "4M"}, pools, mla=True)
    assert set(b._pools) == {"kv", "deepseek_v4_c4_indexer"}
    b.close()


@pytest.mark.parametrize("host", [
    # page_head MHA (the layout of should_split_heads), fp8 e4m3 KV (SGLang's
    # store_dtype uint8: size_per_token counts 1 byte an element), and DSA's
    # fp8 MLA page (override_kv_cache_dim: latent, rope and scale packed in
    # one uint8 row of kv_buffer, pool_host/mla.py at 01c0ede3)
    lambda: MHAHost("page_head", 4),
    lambda: MHAHost("page_first", 4, dtype=torch.uint8),
    lambda: MLAHost("page_first", 4, dim=656, dtype=torch.uint8),
], ids=["page_head", "fp8_mha", "dsa_fp8_mla"])
def test_default_pools_with_size_per_token_are_not_refused(host):
    pool = sized(host())
    mla = isinstance(pool, MLAHost)
    b = create_backend({"ferry_store": "sgl", "ferry_l1": "4M"}, {"kv": pool}, mla=mla)
    fill(pool.kv_buffer, 4)
    want = pool.get_data_page(8).clone()
    h = page_hashes(list(range(4)), 4)
    assert b.batch_set_v1(h, indices(2, 1, 4)) == [True]
    pool.kv_buffer.zero_()
    assert b.batch_get_v1(h, indices(2, 1, 4)) == [True]
    assert torch.equal(pool.get_data_page(8).view(torch.uint8), want.view(torch.uint8))
    b.close()


def test_a_logical_kv_pool_is_published_only_with_its_counts():
    """The same order for a logical kv anchor (DeepSeek V4's LogicalHostPool:
    no store, sgl-project/sglang 00343773d3293d382f0b39101f36b656d30ad2f0,
    python/sglang/srt/mem_cache/memory_pool_host.py): an exists the moment
    it is published found no tallies (KeyError) before."""
    from sglang_pools import storage_config
    from ferry.adapters.sglang import FerryHiCacheStorage
    b = FerryHiCacheStorage(storage_config({"ferry_store": "sgl"}, mla=True), {})
    seen = []

    def on_publish(key):
        seen.append(b.batch_exists(page_hashes(list(range(8)), 4)))
        seen.append(b.ferry_stats()[key]["pages"]["exists"])

    b._pools = _Publishing(b._pools, on_publish)
    b.register_mem_pool_host(LogicalHost(page=4))
    assert seen == [0, 2]
    b.close()
