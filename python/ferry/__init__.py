"""ferry: tiered storage for the KV cache and expert weights of LLM inference.

    import ferry, torch
    layout = ferry.Layout.from_kv_caches(kv_caches)          # vLLM's paged caches
    with ferry.KVStore(model="llama3-8b", layout=layout, l1="8G",
                       l2="/nvme/ferry:512G") as store:
        hit = store.lookup(token_ids)                        # tokens cached
        store.retrieve(token_ids[:hit], kv_caches, block_table)
        store.store(token_ids, kv_caches, block_table)

The package is a thin layer over libferry (loaded with ctypes; set
FERRY_LIB to choose the library file). Tensors and arrays are passed by
address: nothing is copied in Python.
"""
from ._lib import lib as _lib
from .errors import FerryError, err_name, strerror
from .kv import (TIER_L1, TIER_L2, TIER_NONE, TIER_REMOTE, KVStore, LayerOp, Layout, Op, hash_chunks,
                 parse_size, quantile)
from .moe import ExpertPool, Planner, policies, replay

__version__ = _lib.ferry_version().decode()

__all__ = ["ExpertPool", "Planner", "FerryError", "KVStore", "LayerOp", "Layout", "Op", "policies", "replay", "err_name", "hash_chunks", "parse_size",
           "quantile", "strerror", "TIER_NONE", "TIER_L1", "TIER_L2", "TIER_REMOTE",
           "__version__"]
