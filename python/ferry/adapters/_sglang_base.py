"""SGLang's HiCache storage interface, or stand-ins with the same surface.

Each name is SGLang's own (sglang/srt/mem_cache/hicache_storage.py) where
the installed SGLang has it, else a stand-in that keeps upstream's names,
fields, defaults and method signatures as of sgl-project/sglang commit
001067fffe33427bee0ed2f007fb7551a1d76b44: HiCacheStorageConfig,
HiCacheStorageExtraInfo, PoolName, PoolHitPolicy, PoolTransfer,
PoolTransferResult and the HiCacheStorage base class (v1 and v2 calls).
Name by name, because an older SGLang has the base class but not the v2
names (at commit bb424de23a4659f89cfd97dcad3aa1935a1e1d3e the module
holds HiCacheStorageConfig of six fields, HiCacheStorageExtraInfo and
HiCacheStorage with batch_get_v1 / batch_set_v1 only): the backend must
still subclass that SGLang's HiCacheStorage, or its backend factory
refuses it (StorageBackendFactory._load_backend_class: "must inherit
from HiCacheStorage"). The stand-ins carry no behaviour of SGLang's
beyond the base class's defaults; they are not SGLang.
"""
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, List, Optional


@dataclass
class HiCacheStorageConfig:
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
    dp_rank: int = 0
    dp_size: int = 1
    tp_lcm_size: Optional[int] = None
    should_split_heads: bool = False
    extra_config: Optional[dict] = None

@dataclass
class HiCacheStorageExtraInfo:
    prefix_keys: Optional[List[str]] = None
    extra_info: Optional[dict] = None

class PoolName(str, Enum):
    KV = "kv"
    MAMBA = "mamba"
    SWA = "swa"
    INDEXER = "indexer"
    DEEPSEEK_V4_C4 = "deepseek_v4_c4"
    DEEPSEEK_V4_C4_INDEXER = "deepseek_v4_c4_indexer"
    # an FP4 indexer's scale pool (sgl-project/sglang 00fe477f32b3878f64d44cc36895e1de4a113afe)
    DEEPSEEK_V4_C4_INDEXER_SCALE = "deepseek_v4_c4_indexer_scale"
    DEEPSEEK_V4_C128 = "deepseek_v4_c128"
    DEEPSEEK_V4_C4_STATE = "deepseek_v4_c4_state"
    DEEPSEEK_V4_C4_INDEXER_STATE = "deepseek_v4_c4_indexer_state"
    DEEPSEEK_V4_C128_STATE = "deepseek_v4_c128_state"
    DRAFT = "draft"
    DRAFT_INDEXER = "draft_indexer"
    DRAFT_SWA = "draft_swa"

    def __str__(self) -> str:
        return self.value

class PoolHitPolicy(str, Enum):
    ALL_PAGES = "all_pages"
    TRAILING_PAGES = "trailing_pages"

@dataclass
class PoolTransfer:
    name: PoolName
    host_indices: Optional[Any] = None
    device_indices: Optional[Any] = None
    keys: Optional[List[str]] = None
    hit_policy: PoolHitPolicy = PoolHitPolicy.ALL_PAGES
    nodes_to_load: Optional[List[Any]] = None
    indices_from_pool: Optional[PoolName] = None

@dataclass
class PoolTransferResult:
    kv_hit_pages: int
    extra_pool_hit_pages: dict
    # the stop points every pool restores, as sgl-project/sglang commit
    # 00fe477f32b3878f64d44cc36895e1de4a113afe has it (the caller
    # intersects them over ranks); None where a backend gives none
    restorable_prefix_pages: Optional[List[int]] = None

@dataclass
class StorageMetrics:
    """Stand-in for SGLang's StorageMetrics (what get_stats returns, and
    its StorageMetricsCollector.log_storage_metrics asserts it is): pages
    per prefetch / backup call and their GB/s, since the last get_stats."""
    prefetch_pgs: List[int] = field(default_factory=list)
    backup_pgs: List[int] = field(default_factory=list)
    prefetch_bandwidth: List[float] = field(default_factory=list)
    backup_bandwidth: List[float] = field(default_factory=list)


class HiCacheStorage(ABC):
    """Stand-in for SGLang's HiCacheStorage (same method names and arguments)."""

    def register_mem_pool_host(self, mem_pool_host):
        self.mem_pool_host = mem_pool_host

    def register_mem_host_pool_v2(self, host_pool, host_pool_name):
        if not hasattr(self, "registered_pools"):
            self.registered_pools = {}
        self.registered_pools[host_pool_name] = host_pool

    def batch_exists_v2(self, keys, pool_transfers=None, extra_info=None):
        raise NotImplementedError()

    def batch_get_v2(self, transfers, extra_info=None):
        raise NotImplementedError()

    def batch_set_v2(self, transfers, extra_info=None):
        raise NotImplementedError()

    def batch_get_v1(self, keys, host_indices, extra_info=None):
        raise NotImplementedError()

    def batch_set_v1(self, keys, host_indices, extra_info=None):
        raise NotImplementedError()

    @abstractmethod
    def get(self, key, target_location=None, target_sizes=None):
        ...

    @abstractmethod
    def batch_get(self, keys, target_locations=None, target_sizes=None):
        ...

    @abstractmethod
    def set(self, key, value=None, target_location=None, target_sizes=None):
        ...

    @abstractmethod
    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None):
        ...

    @abstractmethod
    def exists(self, key):
        ...

    def batch_exists(self, keys, extra_info=None):
        for i in range(len(keys)):
            if not self.exists(keys[i]):
                return i
        return len(keys)

    def clear(self):
        pass

    def get_stats(self):
        return None


try:
    from sglang.srt.mem_cache import hicache_storage as _upstream
except ImportError:
    _upstream = None

_NAMES = ("HiCacheStorage", "HiCacheStorageConfig", "HiCacheStorageExtraInfo", "PoolName",
          "PoolHitPolicy", "PoolTransfer", "PoolTransferResult")
# the names taken from the installed SGLang (the others are the stand-ins above)
FROM_SGLANG = tuple(n for n in _NAMES if hasattr(_upstream, n))
for _n in FROM_SGLANG:
    globals()[_n] = getattr(_upstream, _n)
SGLANG = "HiCacheStorage" in FROM_SGLANG
# StorageMetrics lives beside the metrics collector: sglang/srt/observability/
# metrics_collector.py (001067ff), sglang/srt/metrics/collector.py before
for _mod in ("sglang.srt.observability.metrics_collector", "sglang.srt.metrics.collector"):
    try:
        StorageMetrics = __import__(_mod, fromlist=["StorageMetrics"]).StorageMetrics
        break
    except (ImportError, AttributeError):
        continue

UPSTREAM = ("sgl-project/sglang", "001067fffe33427bee0ed2f007fb7551a1d76b44")

__all__ = ["HiCacheStorage", "HiCacheStorageConfig", "HiCacheStorageExtraInfo", "PoolName",
           "PoolHitPolicy", "PoolTransfer", "PoolTransferResult", "StorageMetrics", "SGLANG",
           "FROM_SGLANG", "UPSTREAM"]
