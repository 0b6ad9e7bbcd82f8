"""The C structs the package passes to libferry, as ctypes structures.

Each is written here once, in the header's field order; tests/abi_dump
prints the C compiler's sizeof and offsetof of the same structs and
python/tests/test_abi.py checks every field against it, so a header
change that is not made here fails a test instead of corrupting memory.
"""
import ctypes

_u8, _u32, _u64, _i32 = ctypes.c_uint8, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int32
_size, _int, _uint, _dbl = ctypes.c_size_t, ctypes.c_int, ctypes.c_uint, ctypes.c_double
_vp, _cp = ctypes.c_void_p, ctypes.c_char_p

KV_HIST_BUCKETS = 40
KV_TIERS = 4


class _Sized(ctypes.Structure):
    """A struct whose first field is its own size (ferry's versioning rule)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.size = ctypes.sizeof(self)


class KVHash(ctypes.Structure):
    _fields_ = [("lo", _u64), ("hi", _u64)]


class KVLayout(_Sized):
    _fields_ = [("size", _size), ("num_layers", _u32), ("kv", _u32), ("num_heads", _u32),
                ("head_dim", _u32), ("dtype", _int)]


class KVBuffer(_Sized):
    _fields_ = [("size", _size), ("layout", KVLayout), ("mem", _int), ("form", _int),
                ("base", _u64), ("capacity_tokens", _u64),
                ("block_bases", ctypes.POINTER(_u64)), ("block_tokens", _u32),
                ("block_stride", _u64), ("num_blocks", _u64),
                ("block_table", ctypes.POINTER(_i32)), ("table_len", _size),
                ("token_stride", _u64), ("head_stride", _u64)]


class KVName(ctypes.Structure):
    # (bytes as char *: a bytes object is assigned without a cast, kept alive by the array)
    _fields_ = [("bytes", ctypes.c_char_p), ("len", _size)]


class KVConfig(_Sized):
    _fields_ = [("size", _size), ("model", _cp), ("tp_rank", _u32), ("tp_world", _u32),
                ("layout", KVLayout), ("chunk_tokens", _u32), ("hash_seed", _u64),
                ("l1_bytes", _u64), ("l2_dir", _cp), ("l2_bytes", _u64), ("l2_direct", _int),
                ("l2_engine", _cp), ("l1_policy", _int), ("l2_policy", _int),
                ("watermark", _dbl), ("evict_fraction", _dbl), ("write_ttl_ms", _u32),
                ("read_ttl_ms", _u32), ("device", _vp), ("prefetch_max_bytes", _u64),
                ("workers", _uint), ("l2_persistent", _int), ("remote_url", _cp),
                ("remote_options", _vp), ("remote_index_chunks", _u64), ("l2_reset", _int),
                ("l2_mode", _uint), ("server", _cp), ("server_timeout_ms", _u32),
                ("l2_dirs", ctypes.POINTER(_cp)), ("l2_n_dirs", _uint),
                ("pool_wait_ms", _i32)]


class KVReq(_Sized):
    _fields_ = [("size", _size), ("salt", _vp), ("salt_len", _size), ("flags", _uint),
                ("tiers", ctypes.POINTER(_u8)), ("status", ctypes.POINTER(_int)),
                ("max_chunks", _size), ("skip_tokens", _u64)]


class KVLayersOpt(_Sized):
    _fields_ = [("size", _size), ("stream", _vp), ("flags", _u32)]


class KVTierStats(ctypes.Structure):
    _fields_ = [("hits", _u64), ("evictions", _u64), ("bytes_written", _u64),
                ("bytes_read", _u64), ("used_bytes", _u64), ("capacity_bytes", _u64),
                ("chunks", _u64), ("usage", _dbl), ("failures", _u64)]


class KVStats(_Sized):
    _fields_ = [("size", _size)] + [(n, _u64) for n in (
        "lookups", "lookup_tokens", "hit_tokens", "stores", "stored_chunks", "stored_bytes",
        "retrieves", "retrieved_chunks", "retrieved_bytes", "misses", "prefetched_chunks",
        "deleted_chunks", "failures", "alloc_failures", "lock_expired", "chunks")] + [
        ("tier", KVTierStats * KV_TIERS),
        ("lookup_ns", _u64 * KV_HIST_BUCKETS), ("store_ns", _u64 * KV_HIST_BUCKETS),
        ("retrieve_ns", _u64 * KV_HIST_BUCKETS)] + [(n, _u64) for n in (
            "remote_lookups", "remote_lookup_chunks", "remote_found_chunks", "remote_puts",
            "remote_put_bytes", "remote_written", "remote_dropped", "remote_gets",
            "remote_get_bytes", "remote_misses", "remote_refused", "remote_errors",
            "remote_degraded")] + [("remote_down", _u32), ("corrupt_chunks", _u64),
                                  ("device_chunks", _u64), ("device_copy_calls", _u64),
                                  ("pool_waits", _u64), ("pool_wait_us", _u64),
                                  ("pool_declines", _u64),
                                  ("retrieve_check_us", _u64), ("retrieve_copy_us", _u64),
                                  ("retrieve_first_bytes_ns", _u64 * KV_HIST_BUCKETS),
                                  ("retrieve_first_chunk_ns", _u64 * KV_HIST_BUCKETS),
                                  ("retrieve_first_bytes_sum_ns", _u64),
                                  ("retrieve_first_chunk_sum_ns", _u64),
                                  ("lookup_sum_ns", _u64), ("store_sum_ns", _u64),
                                  ("retrieve_sum_ns", _u64)]


MOE_MAX_BANKS = 8


class DeviceOptions(_Sized):
    _fields_ = [("size", _size), ("backend", _cp), ("ordinal", _int), ("mem_limit", _u64)]


class IoOptions(_Sized):
    _fields_ = [("size", _size), ("engine", _cp), ("depth", _uint), ("max_request", _size),
                ("device", _vp), ("bounce_bytes", _size)]


class MoeGeometry(_Sized):
    _fields_ = [("size", _size), ("num_layers", _u32), ("num_experts", _u32), ("slots", _u32),
                ("banks", _u32), ("row_bytes", _size * MOE_MAX_BANKS)]


class MoePlannerOptions(_Sized):
    _fields_ = [("size", _size), ("num_layers", _u32), ("num_experts", _u32), ("slots", _u32),
                ("policy", _cp), ("oracle", _vp), ("expert_bytes", _u64), ("top_k", _u32)]


class MoeCopyPlan(ctypes.Structure):
    _fields_ = [("layer", _u32), ("n", _u32), ("dst_slots", ctypes.POINTER(_u32)),
                ("src_rows", ctypes.POINTER(_u32))]


class MoeCounts(ctypes.Structure):
    _fields_ = [("active", _u32), ("missing", _u32), ("fetched", _u32), ("prefetch_hits", _u32)]


class MoePlannerStats(_Sized):
    _fields_ = [("size", _size)] + [(n, _u64) for n in (
        "steps", "routes", "hits", "misses", "evictions", "forgotten", "prefetch_requests",
        "prefetch_fetched", "prefetch_hits", "prefetch_wasted", "prefetch_bytes",
        "prefetch_wasted_bytes")]


class MoeHintStats(_Sized):
    _fields_ = [("size", _size)] + [(n, _u64) for n in (
        "hinted", "right", "wrong", "saves", "evicted", "fetched", "live")]


class MoeModel(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char * 64), ("num_layers", _u32), ("num_experts", _u32),
                ("top_k", _u32), ("expert_bytes", _u64)]


class MoeReplayResult(ctypes.Structure):
    _fields_ = [("policy", ctypes.c_char * 32), ("slots", _u32), ("steps", _u64), ("hits", _u64),
                ("misses", _u64), ("hit_rate", _dbl), ("host_bytes", _u64), ("evictions", _u64),
                ("ns_per_step", _dbl)]


# name -> structure, the set test_abi checks against the C compiler's view
STRUCTS = {
    "ferry_kv_hash": KVHash,
    "ferry_kv_layout": KVLayout,
    "ferry_kv_buffer": KVBuffer,
    "ferry_kv_name": KVName,
    "ferry_kv_config": KVConfig,
    "ferry_kv_req": KVReq,
    "ferry_kv_layers_opt": KVLayersOpt,
    "ferry_kv_tier_stats": KVTierStats,
    "ferry_kv_stats": KVStats,
    "ferry_device_options": DeviceOptions,
    "ferry_io_options": IoOptions,
    "ferry_moe_geometry": MoeGeometry,
    "ferry_moe_planner_options": MoePlannerOptions,
    "ferry_moe_copy_plan": MoeCopyPlan,
    "ferry_moe_counts": MoeCounts,
    "ferry_moe_planner_stats": MoePlannerStats,
    "ferry_moe_hint_stats": MoeHintStats,
    "ferry_moe_replay_result": MoeReplayResult,
    "ferry_moe_model": MoeModel,
}
