"""ferry's SGLang backend against the HiCache surface of the newest
sgl-project/sglang commits the reference index holds, where it differs
from the 001067fffe33427bee0ed2f007fb7551a1d76b44 the stand-ins of
ferry/adapters/_sglang_base.py follow. Each test cites what it mirrors."""
from dataclasses import dataclass
from typing import Optional

import torch

from ferry.adapters import unregister_store
from ferry.adapters.sglang import FerryHiCacheStorage
from sglang_pools import MHAHost, fill, indices, page_hashes


@dataclass
class Config00fe477f:
    """HiCacheStorageConfig at sgl-project/sglang
    00fe477f32b3878f64d44cc36895e1de4a113afe
    (python/sglang/srt/mem_cache/hicache_storage.py): the fields in that
    order, dp_rank last as Optional[int] = None and no dp_size."""
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    attn_cp_rank: int
    attn_cp_size: int
    is_mla_model: bool
    enable_storage_metrics: bool
    is_page_first_layout: bool
    model_name: Optional[str]
    tp_lcm_size: Optional[int] = None
    should_split_heads: bool = False
    extra_config: Optional[dict] = None
    dp_rank: Optional[int] = None


def test_a_config_whose_dp_rank_is_none_builds_and_keeps_pages():
    """At 00fe477f a controller that does not pass dp_rank leaves it None,
    and the dynamic backend factory builds the backend with that config
    (mem_cache/storage/backend_factory.py, _create_dynamic_backend:
    backend_class(storage_config, kwargs)). ferry read int(None) there, a
    TypeError at start-up; None now reads as DP rank 0 (the default), and
    the backend stores and reads pages bitwise."""
    extra = {"backend_name": "ferry", "module_path": "ferry.adapters.sglang",
             "class_name": "FerryHiCacheStorage", "interface_v1": 1, "ferry_l1": "4M",
             "ferry_store": "newest-dp-none"}
    cfg = Config00fe477f(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0,
                         attn_cp_size=1, is_mla_model=False, enable_storage_metrics=False,
                         is_page_first_layout=True, model_name="tiny", extra_config=extra)
    b = FerryHiCacheStorage(cfg, {})
    try:
        pool = MHAHost("page_first", 4)
        b.register_mem_pool_host(pool)
        fill(pool.kv_buffer, 7)
        h = page_hashes(list(range(8)), 4)
        assert b.batch_set_v1(h, indices(0, 2, 4)) == [True, True]
        want = pool.kv_buffer[:, :8].clone()
        assert b.batch_exists(h) == 2
        assert b.batch_get_v1(h, indices(4, 2, 4)) == [True, True]
        assert torch.equal(pool.kv_buffer[:, 16:24], want)
    finally:
        b.close()
        unregister_store("newest-dp-none")
