/*
 * client_backend.c - a client of `ferry serve` as a backend of the KV API
 * (backend.h): the table of its operations, each a request to the daemon
 * (client_ops.c, client_retrieve.c, client_layers.c) or its connection's
 * own (client.c).
 */
#include <errno.h>

#include "kv/backend.h"
#include "kv/kv_layers.h"
#include "kv/client/kvc.h"
#include "kv/store/store_int.h"

/* every chunk id at once, one round trip */
static int lookup(ferry_kv *kv, ferry__kv_idsrc *src, const ferry_kv_req *req)
{
    if (!src->nch)
        return 0;
    ferry_kv_hash stack[STACK_CHUNKS], *ids = stack;
    if (src->nch > STACK_CHUNKS && !(ids = ferry__malloc(src->nch * sizeof *ids)))
        return ferry__kv_err(kv, -ENOMEM, "kv lookup: out of memory for %zu chunk ids",
                             src->nch);
    ferry__kv_idsrc_take(src, src->nch, ids);
    int rc = ferry__kvc_lookup(kv, ids, src->nch, src->n, req);
    if (ids != stack)
        ferry__free(ids);
    return rc;
}

static int clear(ferry_kv *kv)
{
    return ferry__kvc_simple(kv, FERRY__P_CLEAR);
}

static int flush(ferry_kv *kv)
{
    return ferry__kvc_simple(kv, FERRY__P_FLUSH);
}

static int sync(ferry_kv *kv)
{
    return ferry__kvc_simple(kv, FERRY__P_SYNC);
}

/* the daemon's counters, all its clients', but for the calls: this
 * client's own, which the front counted (ferry__kv_be_call, layers.c: the
 * daemon sees chunks, not calls; kv.h) */
static int stats(ferry_kv *kv, ferry_kv_stats *out)
{
    int rc = ferry__kvc_stats(kv, out, NULL);
    if (rc < 0)
        return rc;
    out->stores = atomic_load_explicit(&kv->stores, memory_order_relaxed);
    out->retrieves = atomic_load_explicit(&kv->retrieves, memory_order_relaxed);
    for (int i = 0; i < FERRY_KV_HIST_BUCKETS; i++) {
        out->store_ns[i] = atomic_load_explicit(&kv->h_store.b[i], memory_order_relaxed);
        out->retrieve_ns[i] = atomic_load_explicit(&kv->h_retrieve.b[i], memory_order_relaxed);
    }
    out->store_sum_ns = atomic_load_explicit(&kv->h_store.sum_ns, memory_order_relaxed);
    out->retrieve_sum_ns = atomic_load_explicit(&kv->h_retrieve.sum_ns, memory_order_relaxed);
    return 0;
}

/* ferry_kv_open of a store that is a client of a `ferry serve` daemon */
int ferry__kv_client_open(const ferry_kv_config *cfg, ferry_kv **out)
{
    if (!cfg->model)
        return ferry__err_set(NULL, -EINVAL, "kv open: no model (config->model is required)");
    if (ferry__kv_pool_wait_check(cfg) < 0)
        return -EINVAL;
    uint32_t ct = cfg->chunk_tokens ? cfg->chunk_tokens : FERRY_KV_CHUNK_TOKENS_DEFAULT;
    uint64_t chunk_bytes = 0;
    int rc = ferry_kv_layout_chunk_bytes(&cfg->layout, ct, &chunk_bytes);
    if (rc < 0)
        return rc;
    uint32_t world = cfg->tp_world ? cfg->tp_world : 1;
    if (cfg->tp_rank >= world)
        return ferry__err_set(NULL, -EINVAL,
                              "kv open: tp_rank %u is not below tp_world %u (0 means 1)",
                              cfg->tp_rank, world);
    ferry_kv *kv = ferry__kv_alloc(cfg, ct, chunk_bytes);
    if (!kv)
        return ferry__err_set(NULL, -ENOMEM, "kv open: out of memory");
    kv->be = &ferry__kv_backend_client;
    rc = ferry__kvc_open(kv, cfg);
    if (rc < 0) {
        kv->be->close(kv);
        ferry__kv_free(kv);
        return rc;
    }
    *out = kv;
    return 0;
}

const ferry__kv_backend ferry__kv_backend_client = {
    .name = "client",
    .lookup = lookup,
    .store = ferry__kvc_store,
    .retrieve = ferry__kvc_retrieve,
    .prefetch = ferry__kvc_prefetch,
    .pin = ferry__kvc_pin,
    .del = ferry__kvc_delete,
    .clear = clear,
    .flush = flush,
    .sync = sync,
    .stats = stats,
    .async_start = ferry__kvc_workers,
    .lw_cap = ferry__kvc_lw_cap,
    .lw_acquire = ferry__kvc_lw_acquire,
    .lw_release = ferry__kvc_lw_release,
    .lw_reserve = ferry__kvc_lw_reserve,
    .lw_commit = ferry__kvc_lw_commit,
    .lw_unlease = ferry__kvc_lw_unlease,
    .close = ferry__kvc_close,
    .close_begin = ferry__kvc_close_begin,
};
