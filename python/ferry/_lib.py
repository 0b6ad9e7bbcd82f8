"""Loading libferry and declaring the C functions the package calls.

The library is found, in order, at $FERRY_LIB, next to this package
(ferry/libferry.so.0, where an installed wheel would put it), in the
source tree's build directory (build/libferry.so.0 beside python/), and
through the system's loader path (libferry.so.0).
"""
import ctypes
import os

from . import _abi as A

_c_int, _c_size, _c_u32, _c_u64 = ctypes.c_int, ctypes.c_size_t, ctypes.c_uint32, ctypes.c_uint64
_vp, _cp = ctypes.c_void_p, ctypes.c_char_p
_i32p = ctypes.POINTER(ctypes.c_int32)


def _candidates():
    env = os.environ.get("FERRY_LIB")
    if env:
        yield env
        return
    here = os.path.dirname(os.path.abspath(__file__))
    yield os.path.join(here, "libferry.so.0")
    yield os.path.join(os.path.dirname(os.path.dirname(here)), "build", "libferry.so.0")
    yield "libferry.so.0"


def _load():
    errors = []
    for path in _candidates():
        if os.sep in path and not os.path.exists(path):
            errors.append(f"{path}: no such file")
            continue
        try:
            return ctypes.CDLL(path)
        except OSError as e:
            errors.append(f"{path}: {e}")
    raise ImportError("ferry: cannot load libferry (set FERRY_LIB to its path): " + "; ".join(errors))


lib = _load()

# name: (restype, argtypes)
_PROTOS = {
    "ferry_version": (_cp, []),
    "ferry_version_number": (_c_int, []),
    "ferry_strerror": (_cp, [_c_int]),
    "ferry_err_name": (_cp, [_c_int]),
    "ferry_last_error": (_cp, []),
    "ferry_parse_size": (_c_int, [_cp, ctypes.POINTER(_c_u64)]),
    "ferry_log_set_level": (None, [_c_int]),
    "ferry_kv_layout_chunk_bytes": (_c_int, [ctypes.POINTER(A.KVLayout), _c_u32, ctypes.POINTER(_c_u64)]),
    "ferry_kv_hash_chunks": (_c_int, [_c_u64, _i32p, _c_size, _c_u32, _c_int,
                                      ctypes.POINTER(A.KVHash), _c_size]),
    "ferry_kv_open": (_c_int, [ctypes.POINTER(A.KVConfig), ctypes.POINTER(_vp)]),
    "ferry_kv_close": (None, [_vp]),
    "ferry_kv_close_begin": (None, [_vp]),
    "ferry_kv_last_error": (_cp, [_vp]),
    "ferry_kv_chunk_bytes": (_c_u64, [_vp]),
    "ferry_kv_chunk_tokens": (_c_u32, [_vp]),
    "ferry_kv_lookup": (_c_int, [_vp, _i32p, _c_size, ctypes.POINTER(A.KVReq)]),
    "ferry_kv_store": (_c_int, [_vp, _i32p, _c_size, ctypes.POINTER(A.KVReq), ctypes.POINTER(A.KVBuffer)]),
    "ferry_kv_retrieve": (_c_int, [_vp, _i32p, _c_size, ctypes.POINTER(A.KVReq), ctypes.POINTER(A.KVBuffer)]),
    "ferry_kv_store_async": (_c_int, [_vp, _i32p, _c_size, ctypes.POINTER(A.KVReq),
                                      ctypes.POINTER(A.KVBuffer), ctypes.POINTER(_vp)]),
    "ferry_kv_retrieve_async": (_c_int, [_vp, _i32p, _c_size, ctypes.POINTER(A.KVReq),
                                         ctypes.POINTER(A.KVBuffer), ctypes.POINTER(_vp)]),
    "ferry_kv_retrieve_layers": (_c_int, [_vp, _i32p, _c_size, ctypes.POINTER(A.KVReq),
                                          ctypes.POINTER(A.KVBuffer),
                                          ctypes.POINTER(A.KVLayersOpt), ctypes.POINTER(_vp)]),
    "ferry_kv_store_layers": (_c_int, [_vp, _i32p, _c_size, ctypes.POINTER(A.KVReq),
                                       ctypes.POINTER(A.KVBuffer),
                                       ctypes.POINTER(A.KVLayersOpt), ctypes.POINTER(_vp)]),
    "ferry_kv_op_wait_layer": (_c_int, [_vp, _c_u32, _c_int]),
    "ferry_kv_op_stream_wait_layer": (_c_int, [_vp, _c_u32, _vp, _c_int]),
    "ferry_kv_op_layer_done": (_c_int, [_vp, _c_u32, _vp]),
    "ferry_kv_op_wait": (_c_int, [_vp, _c_int]),
    "ferry_kv_op_test": (_c_int, [_vp]),
    "ferry_kv_op_cancel": (_c_int, [_vp]),
    "ferry_kv_op_free": (None, [_vp]),
    "ferry_kv_prefetch": (_c_int, [_vp, _i32p, _c_size, ctypes.POINTER(A.KVReq)]),
    "ferry_kv_pin": (_c_int, [_vp, _i32p, _c_size, ctypes.POINTER(A.KVReq)]),
    "ferry_kv_unpin": (_c_int, [_vp, _i32p, _c_size, ctypes.POINTER(A.KVReq)]),
    "ferry_kv_delete": (_c_int, [_vp, _i32p, _c_size, ctypes.POINTER(A.KVReq)]),
    "ferry_kv_store_named": (_c_int, [_vp, ctypes.POINTER(A.KVName), _c_size,
                                      ctypes.POINTER(A.KVReq), ctypes.POINTER(A.KVBuffer)]),
    "ferry_kv_retrieve_named": (_c_int, [_vp, ctypes.POINTER(A.KVName), _c_size,
                                         ctypes.POINTER(A.KVReq), ctypes.POINTER(A.KVBuffer)]),
    "ferry_kv_lookup_named": (_c_int, [_vp, ctypes.POINTER(A.KVName), _c_size,
                                       ctypes.POINTER(A.KVReq)]),
    "ferry_kv_lookup_named_packed": (_c_int, [_vp, _cp, _c_size, _c_size,
                                              ctypes.POINTER(A.KVReq)]),
    "ferry_kv_delete_named": (_c_int, [_vp, ctypes.POINTER(A.KVName), _c_size,
                                       ctypes.POINTER(A.KVReq)]),
    "ferry_kv_clear": (_c_int, [_vp]),
    "ferry_kv_flush": (_c_int, [_vp]),
    "ferry_kv_sync": (_c_int, [_vp]),
    "ferry_kv_stats_get": (_c_int, [_vp, ctypes.POINTER(A.KVStats)]),
    "ferry_kv_metrics_prometheus": (_c_int, [_vp, _cp, _c_size]),
    "ferry_kv_hist_quantile": (ctypes.c_double, [ctypes.POINTER(_c_u64), ctypes.c_double]),
    # devices and I/O engines (what the expert pool needs)
    "ferry_device_open": (_c_int, [ctypes.POINTER(A.DeviceOptions), ctypes.POINTER(_vp)]),
    "ferry_device_close": (None, [_vp]),
    "ferry_device_name": (_cp, [_vp]),
    "ferry_devptr_host": (_vp, [_vp, _c_u64]),
    "ferry_device_alloc": (_c_int, [_vp, _c_size, ctypes.POINTER(_c_u64)]),
    "ferry_device_free": (_c_int, [_vp, _c_u64]),
    "ferry_stream_import": (_c_int, [_vp, _c_u64, ctypes.POINTER(_vp)]),
    "ferry_stream_destroy": (_c_int, [_vp]),
    "ferry_io_open": (_c_int, [ctypes.POINTER(A.IoOptions), ctypes.POINTER(_vp)]),
    "ferry_io_close": (None, [_vp]),
    # the expert pool
    "ferry_moe_planner_create": (_c_int, [ctypes.POINTER(A.MoePlannerOptions), ctypes.POINTER(_vp)]),
    "ferry_moe_planner_destroy": (None, [_vp]),
    "ferry_moe_planner_ensure": (_c_int, [_vp, _c_u32, ctypes.POINTER(_c_u32), _c_u32,
                                          ctypes.POINTER(_c_u32), ctypes.POINTER(A.MoeCopyPlan),
                                          ctypes.POINTER(A.MoeCounts)]),
    "ferry_moe_planner_stats_get": (_c_int, [_vp, ctypes.POINTER(A.MoePlannerStats)]),
    "ferry_moe_planner_policy": (_cp, [_vp]),
    "ferry_moe_planner_last_error": (_cp, [_vp]),
    "ferry_moe_planner_slots": (_c_u32, [_vp]),
    "ferry_moe_planner_lookup": (_c_u32, [_vp, _c_u32, _c_u32]),
    "ferry_moe_planner_forget": (_c_int, [_vp, _c_u32]),
    "ferry_moe_planner_resize": (_c_int, [_vp, _c_u32]),
    "ferry_moe_planner_hint": (_c_int, [_vp, _c_u32, _c_u32, ctypes.POINTER(_c_u32), _c_u32,
                                        ctypes.c_double]),
    "ferry_moe_planner_hint_prefetch": (_c_int, [_vp, _c_u32, ctypes.POINTER(A.MoeCopyPlan)]),
    "ferry_moe_planner_hint_stats_get": (_c_int, [_vp, ctypes.POINTER(A.MoeHintStats)]),
    "ferry_moe_device_slots_open": (_c_int, [_vp, ctypes.POINTER(A.MoeGeometry),
                                             ctypes.POINTER(_vp), ctypes.POINTER(_vp)]),
    "ferry_moe_device_slot_ptr": (_c_u64, [_vp, _c_u32, _c_u32]),
    "ferry_moe_slots_create": (_c_int, [ctypes.POINTER(A.MoeGeometry), _vp, _vp,
                                        ctypes.POINTER(_vp)]),
    "ferry_moe_slots_destroy": (None, [_vp]),
    "ferry_moe_slots_device": (_vp, [_vp]),
    "ferry_moe_slots_apply": (_c_int, [_vp, ctypes.POINTER(A.MoeCopyPlan), _vp,
                                       ctypes.POINTER(_c_u32), ctypes.POINTER(_c_u32)]),
    "ferry_moe_slots_invalidate": (_c_int, [_vp, _c_u32]),
    "ferry_moe_slots_occupant": (_c_u32, [_vp, _c_u32]),
    "ferry_moe_rows_host": (_c_int, [ctypes.POINTER(A.MoeGeometry), ctypes.POINTER(_vp), _vp,
                                     _c_u64, ctypes.POINTER(_vp)]),
    "ferry_moe_rows_file": (_c_int, [ctypes.POINTER(A.MoeGeometry), _vp, _cp,
                                     ctypes.POINTER(_c_u64), ctypes.POINTER(_vp)]),
    "ferry_moe_rows_destroy": (None, [_vp]),
    "ferry_moe_check": (_c_int, [_vp, _vp]),
    "ferry_moe_trace_load": (_c_int, [_cp, ctypes.POINTER(_vp)]),
    "ferry_moe_trace_destroy": (None, [_vp]),
    "ferry_moe_trace_steps": (_c_size, [_vp]),
    "ferry_moe_trace_model": (ctypes.POINTER(A.MoeModel), [_vp]),
    "ferry_moe_replay": (_c_int, [_vp, _cp, _c_u32, _c_u64, ctypes.POINTER(A.MoeReplayResult)]),
    "ferry_moe_policies": (ctypes.POINTER(_cp), []),
}

for _name, (_res, _args) in _PROTOS.items():
    _f = getattr(lib, _name)
    _f.restype = _res
    _f.argtypes = _args
