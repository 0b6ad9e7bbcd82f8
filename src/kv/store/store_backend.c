/*
 * store_backend.c - the in-process tiered store as a backend of the KV API
 * (backend.h): the table of its operations, each the store's own path.
 */
#include "kv/backend.h"
#include "kv/kv_layers.h"
#include "kv/kv_slots.h"
#include "kv/store/store_int.h"

const ferry__kv_backend ferry__kv_backend_store = {
    .name = "store",
    .lookup = ferry__kv_local_lookup,
    .store = ferry__kv_do_store,
    .retrieve = ferry__kv_do_retrieve,
    .prefetch = ferry__kv_local_prefetch,
    .pin = ferry__kv_local_pin,
    .del = ferry__kv_slot_delete,
    .clear = ferry__kv_local_clear,
    .flush = ferry__kv_local_flush,
    .sync = ferry__kv_local_sync,
    .stats = ferry__kv_local_stats,
    .async_start = NULL, /* the workers start with the store */
    .lw_cap = ferry__kv_lw_local_cap,
    .lw_acquire = ferry__kv_lw_local_acquire,
    .lw_release = ferry__kv_lw_local_release,
    .lw_reserve = ferry__kv_lw_local_reserve,
    .lw_commit = ferry__kv_lw_local_commit,
    .lw_unlease = NULL,
    .close = NULL,
};
