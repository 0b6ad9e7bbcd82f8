"""SGLang's HiCache storage interface, or stand-ins with the same surface.

With SGLang installed, these are its own (sglang/srt/mem_cache/
hicache_storage.py). Without it, minimal classes with the methods the
cache controller calls, so ferry's backend loads and can be driven through
the controller's call sequence in tests. The stand-ins are not SGLang.
"""
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional

try:
    from sglang.srt.mem_cache.hicache_storage import (  # noqa: F401
        HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo)
    SGLANG = True
except ImportError:
    SGLANG = False

    @dataclass
    class HiCacheStorageConfig:
        tp_rank: int
        tp_size: int
        pp_rank: int
        pp_size: int
        is_mla_model: bool
        is_page_first_layout: bool
        model_name: Optional[str]
        extra_config: Optional[dict] = None

    @dataclass
    class HiCacheStorageExtraInfo:
        prefix_keys: Optional[list] = None
        extra_info: Optional[dict] = None

    class HiCacheStorage(ABC):
        """Stand-in for SGLang's HiCacheStorage (same method names and arguments)."""

        def register_mem_pool_host(self, mem_pool_host):
            self.mem_pool_host = mem_pool_host

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
            for i, k in enumerate(keys):
                if not self.exists(k):
                    return i
            return len(keys)

        def clear(self):
            pass

        def get_stats(self):
            return None

__all__ = ["HiCacheStorage", "HiCacheStorageConfig", "HiCacheStorageExtraInfo", "SGLANG"]
