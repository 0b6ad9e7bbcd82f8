/*
 * open.c - opening and closing a store, and its plain accessors.
 *
 * Every option is range-checked before any arithmetic; tiers open bottom-up
 * and a failure closes what was opened, so a failed open leaves nothing
 * behind (no thread, no slab, no lock).
 */
#include <errno.h>
#include <stddef.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ferry/pslab.h"
#include "ferry/remote.h"
#include "dirlock.h"
#include "kv/kv_impl.h"
#include "kv/kv_layers.h"
#include "kv/kv_slots.h"
#include "kv/backend.h"
#include "sized.h"
#include "kv/store/store_int.h"
#include "kv/store/tier_pslab.h"

/* ---- open / close ---- */

/* a chunk the persistent L2 kept from the last run: READY, in L2 only */
static int recover_one(const ferry_kv_hash *id, uint64_t loc, uint64_t len, void *ctx)
{
    ferry_kv *kv = ctx;
    ferry__kv_tier *t = kv->tier[FERRY_KV_TIER_L2];
    if (len != kv->slot_bytes || ferry__kv_find(kv, *id)) {
        /* written by a store of another geometry: not ours, forget it */
        t->ops->release(t, loc);
        return 0;
    }
    ferry__kv_entry *e = ferry__calloc(1, sizeof *e);
    if (!e)
        return -ENOMEM;
    e->id = *id;
    e->state = FERRY__KV_READY;
    e->tokens = kv->chunk_tokens;
    for (int k = 0; k < FERRY_KV_TIERS; k++)
        e->loc[k] = UINT64_MAX;
    e->loc[FERRY_KV_TIER_L2] = loc;
    e->resident = 1u << FERRY_KV_TIER_L2;
    ferry__kv_index_insert(kv, e);
    t->policy->ops->insert(t->policy, e);
    t->used++;
    return 0;
}

void ferry__kv_free(ferry_kv *kv)
{
    for (uint64_t b = 0; kv->buckets && b < kv->nbuckets; b++) {
        for (ferry__kv_entry *e = kv->buckets[b], *next; e; e = next) {
            next = e->hnext;
            ferry__free(e);
        }
    }
    for (ferry__kv_entry *e = kv->doomed, *next; e; e = next) {
        next = e->dnext;
        ferry__free(e);
    }
    ferry__free(kv->buckets);
    for (unsigned i = 0; i < kv->nstreams; i++)
        ferry_stream_destroy(kv->streams[i]);
    ferry__free(kv->streams);
    /* the L1 pool is registered with L2's drive queues (or about to be):
     * stop that and undo it first */
    ferry__kv_poolreg_stop(&kv->l2reg);
    /* the lower tiers first: a read of theirs still in flight after a
     * failure lands in an L1 slot, so the pool goes last */
    for (int t = FERRY_KV_TIERS - 1; t >= 1; t--)
        ferry__kv_tier_free(kv->tier[t]);
    pthread_mutex_destroy(&kv->mu);
    pthread_mutex_destroy(&kv->err_mu);
    pthread_cond_destroy(&kv->loaded);
    pthread_mutex_destroy(&kv->qmu);
    pthread_cond_destroy(&kv->q[0].cv);
    pthread_cond_destroy(&kv->q[1].cv);
    pthread_cond_destroy(&kv->idle);
    pthread_mutex_destroy(&kv->call_mu);
    ferry__kv_lw_stage_drop(kv);
    pthread_mutex_destroy(&kv->lw_mu);
    pthread_cond_destroy(&kv->call_cv);
    ferry__free(kv->l1_gen);
    ferry__free(kv->model);
    ferry__free(kv);
}

/* everything that makes the bytes of a chunk of ct tokens mean something,
 * into fp (FERRY_REMOTE_LAYOUT_MAX bytes): a value written under another
 * fingerprint is refused as a miss. Its length. */
static size_t remote_fingerprint(const ferry_kv *kv, uint32_t ct, char *fp)
{
    int fl = snprintf(fp, FERRY_REMOTE_LAYOUT_MAX,
                      "ferry-kv/1;layers=%u;kv=%u;heads=%u;head_dim=%u;dtype=%s;chunk_tokens=%u;"
                      "seed=%016llx;tp=%u/%u;model=%s",
                      kv->layout.num_layers, kv->layout.kv, kv->layout.num_heads,
                      kv->layout.head_dim, ferry_dtype_name(kv->layout.dtype), ct,
                      (unsigned long long)kv->seed, kv->tp_rank, kv->tp_world, kv->model);
    return fl < 0 ? 0 : FERRY__MIN((size_t)fl, (size_t)FERRY_REMOTE_LAYOUT_MAX - 1);
}

/* the remote value of a chunk of ct tokens of per bytes each: its payload
 * and its header, whose fingerprint spells ct out */
static uint64_t remote_value_bytes(const ferry_kv *kv, uint32_t ct, uint64_t per)
{
    char fp[FERRY_REMOTE_LAYOUT_MAX];
    return (uint64_t)ct * per + FERRY_REMOTE_HEADER_FIXED + remote_fingerprint(kv, ct, fp);
}

/* a chunk is one remote value: one over Redis's limit would make every
 * write-through fail, so such a store is refused before anything opens */
static int remote_chunk_fits(ferry_kv *kv)
{
    uint64_t per = kv->chunk_bytes / kv->chunk_tokens;
    uint64_t value = remote_value_bytes(kv, kv->chunk_tokens, per);
    if (value <= FERRY_REMOTE_VALUE_MAX)
        return 0;
    /* the most that fits, counted with its own header (fewer digits of
     * tokens, a shorter one): from the estimate with this chunk's header,
     * which fits, up by the few tokens the shorter header leaves room for */
    uint64_t most = (FERRY_REMOTE_VALUE_MAX - (value - kv->chunk_bytes)) / per;
    while (most + 1 < kv->chunk_tokens &&
           remote_value_bytes(kv, (uint32_t)(most + 1), per) <= FERRY_REMOTE_VALUE_MAX)
        most++;
    char fix[160];
    if (most)
        snprintf(fix, sizeof fix, "chunk_tokens %llu at most (%llu bytes a token)",
                 (unsigned long long)most, (unsigned long long)per);
    else
        snprintf(fix, sizeof fix, "not one token fits (%llu bytes a token)",
                 (unsigned long long)per);
    return ferry__err_set(&kv->err, -EINVAL,
                          "kv open: remote tier: a chunk of %u tokens is %llu bytes, a value of "
                          "%llu bytes with its header: over Redis's 512 MiB string limit "
                          "(FERRY_REMOTE_VALUE_MAX, %zu bytes), so no chunk could be written "
                          "through; %s, or no remote_url",
                          kv->chunk_tokens, (unsigned long long)kv->chunk_bytes,
                          (unsigned long long)value, FERRY_REMOTE_VALUE_MAX, fix);
}

/* the remote tier: the caller's options with the store's layout
 * fingerprint and key prefix */
static int open_remote(ferry_kv *kv, const ferry_kv_config *cfg, const char *url)
{
    ferry_remote_options ro = FERRY_REMOTE_OPTIONS_INIT;
    const ferry_remote_options *uo = cfg->remote_options;
    static const ferry__sized sized =
        FERRY__SIZED0(ferry_remote_options, FERRY_REMOTE_OPTIONS_MIN_SIZE);
    if (uo) {
        int rc = ferry__opts_take(&kv->err, "kv open: remote_options", &sized, &ro, uo);
        if (rc < 0)
            return rc;
    }
    if (!ro.key_prefix)
        ro.key_prefix = "ferry:kv:";
    /* an engine thread asking a hung server waits at most these, once per
     * backoff period: the connect, and a whole call's deadline (the
     * command timeout plus an allowance per byte moved; ferry/remote.h) */
    if (!ro.connect_timeout_ms)
        ro.connect_timeout_ms = 200;
    if (!ro.command_timeout_ms)
        ro.command_timeout_ms = 300;
    char fp[FERRY_REMOTE_LAYOUT_MAX];
    ro.layout = fp;
    ro.layout_len = remote_fingerprint(kv, kv->chunk_tokens, fp);
    uint64_t cap = cfg->remote_index_chunks ? cfg->remote_index_chunks : 65536;
    return ferry__kv_tier_remote_open(url, &ro, kv->chunk_bytes, kv->slot_bytes, cap, &kv->err,
                                      &kv->tier[FERRY_KV_TIER_REMOTE]);
}

/* l2_dirs: without l2_dir, each entry set, non-empty and distinct, at
 * most FERRY_KV_L2_DIRS_MAX, their bytes in all within a slab's reach */
static int l2_dirs_check(const ferry_kv_config *cfg)
{
    unsigned n = cfg->l2_n_dirs;
    if (!n)
        return 0;
    if (cfg->l2_dir)
        return ferry__err_set(NULL, -EINVAL, "kv open: l2_dir and l2_dirs both given (l2_dir "
                              "%s): the L2 is one or the other", cfg->l2_dir);
    if (!cfg->l2_dirs || n > FERRY_KV_L2_DIRS_MAX)
        return ferry__err_set(NULL, -EINVAL, "kv open: l2_n_dirs %u: accepted 1..%u with "
                              "l2_dirs set (0: no list)", n, FERRY_KV_L2_DIRS_MAX);
    for (unsigned i = 0; i < n; i++) {
        if (!cfg->l2_dirs[i] || !*cfg->l2_dirs[i])
            return ferry__err_set(NULL, -EINVAL, "kv open: l2_dirs[%u] is %s", i,
                                  cfg->l2_dirs[i] ? "empty" : "NULL");
        for (unsigned j = 0; j < i; j++)
            if (!strcmp(cfg->l2_dirs[i], cfg->l2_dirs[j]))
                return ferry__err_set(NULL, -EINVAL, "kv open: l2_dirs[%u] and l2_dirs[%u] are "
                                      "both %s: each drive's directory once", j, i,
                                      cfg->l2_dirs[i]);
    }
    if (cfg->l2_bytes > ((uint64_t)1 << 56) / n)
        return ferry__err_set(NULL, -EINVAL, "kv open: l2_bytes %llu on each of %u directories: "
                              "more than 2^56 bytes in all", (unsigned long long)cfg->l2_bytes,
                              n);
    return 0;
}

/* every option in range before any arithmetic on it: 0 and the chunk's
 * tokens and bytes, or -EINVAL with the message set */
/* back-pressure's deadline: 0 (decline at once) to FERRY_KV_POOL_WAIT_MS_MAX */
int ferry__kv_pool_wait_check(const ferry_kv_config *cfg)
{
    if (cfg->pool_wait_ms < 0 || cfg->pool_wait_ms > FERRY_KV_POOL_WAIT_MS_MAX)
        return ferry__err_set(NULL, -EINVAL,
                              "kv open: pool_wait_ms %d: accepted 0 (decline at once) to %d",
                              (int)cfg->pool_wait_ms, FERRY_KV_POOL_WAIT_MS_MAX);
    return 0;
}

static int config_check(const ferry_kv_config *cfg, uint32_t *ct, uint64_t *chunk_bytes)
{
    if (!cfg->model)
        return ferry__err_set(NULL, -EINVAL, "kv open: no model (config->model is required)");
    *ct = cfg->chunk_tokens ? cfg->chunk_tokens : FERRY_KV_CHUNK_TOKENS_DEFAULT;
    int rc = ferry_kv_layout_chunk_bytes(&cfg->layout, *ct, chunk_bytes);
    if (rc < 0)
        return rc;
    if (!(cfg->watermark >= 0 && cfg->watermark <= 1) ||
        !(cfg->evict_fraction >= 0 && cfg->evict_fraction <= 1))
        return ferry__err_set(NULL, -EINVAL,
                              "kv open: watermark %g / evict_fraction %g: each must be in "
                              "[0, 1] (0: the default)",
                              cfg->watermark, cfg->evict_fraction);
    uint32_t world = cfg->tp_world ? cfg->tp_world : 1;
    if (cfg->tp_rank >= world)
        return ferry__err_set(NULL, -EINVAL,
                              "kv open: tp_rank %u is not below tp_world %u (0 means 1)",
                              cfg->tp_rank, world);
    if ((cfg->l1_policy != FERRY_KV_EVICT_LRU && cfg->l1_policy != FERRY_KV_EVICT_S3FIFO) ||
        (cfg->l2_policy != FERRY_KV_EVICT_LRU && cfg->l2_policy != FERRY_KV_EVICT_S3FIFO))
        return ferry__err_set(NULL, -EINVAL,
                              "kv open: l1_policy %d / l2_policy %d: each must be "
                              "FERRY_KV_EVICT_LRU (0) or FERRY_KV_EVICT_S3FIFO (1)",
                              cfg->l1_policy, cfg->l2_policy);
    if (cfg->workers > FERRY_KV_WORKERS_MAX)
        return ferry__err_set(NULL, -EINVAL, "kv open: workers %u: accepted 0..%u (0 means 2)",
                              cfg->workers, FERRY_KV_WORKERS_MAX);
    if (cfg->l2_dir && !*cfg->l2_dir)
        return ferry__err_set(NULL, -EINVAL, "kv open: l2_dir is empty (NULL means no L2)");
    rc = l2_dirs_check(cfg);
    if (rc < 0)
        return rc;
    if (ferry__mode_check(cfg->l2_mode, "kv open: l2_mode", NULL) < 0)
        return -EINVAL;
    if ((rc = ferry__kv_pool_wait_check(cfg)) < 0)
        return rc;
    if (cfg->l2_reset != 0 && cfg->l2_reset != 1)
        return ferry__err_set(NULL, -EINVAL, "kv open: l2_reset %d: accepted 0 or 1",
                              cfg->l2_reset);
    double wm = cfg->watermark > 0 ? cfg->watermark : 0.8;
    double frac = cfg->evict_fraction > 0 ? cfg->evict_fraction : 0.2;
    if (wm > 1.0 || frac > wm)
        return ferry__err_set(NULL, -EINVAL,
                              "kv open: watermark %.3f / evict fraction %.3f out of range "
                              "(0 < fraction <= watermark <= 1)",
                              wm, frac);
    uint64_t slot = FERRY__ALIGN_UP(*chunk_bytes, (uint64_t)4096);
    if (cfg->l1_bytes < slot)
        return ferry__err_set(NULL, -EINVAL,
                              "kv open: l1_bytes %llu is below one chunk of %llu bytes "
                              "(%u tokens)",
                              (unsigned long long)cfg->l1_bytes, (unsigned long long)slot, *ct);
    return 0;
}

/* a store with the checked cfg's settings and no tiers yet, or NULL */
ferry_kv *ferry__kv_alloc(const ferry_kv_config *cfg, uint32_t ct, uint64_t chunk_bytes)
{
    ferry_kv *kv = ferry__calloc(1, sizeof *kv);
    if (!kv)
        return NULL;
    kv->opener = ferry__pid();
    pthread_mutex_init(&kv->mu, NULL);
    pthread_mutex_init(&kv->err_mu, NULL);
    pthread_cond_init(&kv->loaded, NULL);
    pthread_mutex_init(&kv->qmu, NULL);
    pthread_mutex_init(&kv->call_mu, NULL);
    pthread_mutex_init(&kv->lw_mu, NULL);
    pthread_cond_init(&kv->call_cv, NULL);
    pthread_cond_init(&kv->q[0].cv, NULL);
    pthread_cond_init(&kv->q[1].cv, NULL);
    pthread_cond_init(&kv->idle, NULL);
    kv->be = &ferry__kv_backend_store;
    kv->handoff_min = (uint64_t)256 << 10; /* a worker's wake-up costs about such a copy */
    kv->model = ferry__strdup(cfg->model);
    if (!kv->model) {
        ferry__kv_free(kv);
        return NULL;
    }
    double wm = cfg->watermark > 0 ? cfg->watermark : 0.8;
    double frac = cfg->evict_fraction > 0 ? cfg->evict_fraction : 0.2;
    kv->tp_rank = cfg->tp_rank;
    kv->tp_world = cfg->tp_world ? cfg->tp_world : 1;
    kv->layout = cfg->layout;
    kv->chunk_tokens = ct;
    kv->seed = cfg->hash_seed ? cfg->hash_seed : FERRY_KV_HASH_SEED_DEFAULT;
    kv->chunk_bytes = chunk_bytes;
    kv->slot_bytes = FERRY__ALIGN_UP(chunk_bytes, (uint64_t)4096);
    kv->dev = cfg->device;
    kv->watermark = wm;
    kv->low = wm - frac;
    kv->write_ttl_ns =
        (uint64_t)(cfg->write_ttl_ms ? cfg->write_ttl_ms : FERRY_KV_WRITE_TTL_MS_DEFAULT) * 1000000u;
    kv->read_ttl_ns =
        (uint64_t)(cfg->read_ttl_ms ? cfg->read_ttl_ms : FERRY_KV_READ_TTL_MS_DEFAULT) * 1000000u;
    kv->ns0 = ferry__kv_namespace(kv->seed, kv->model, kv->tp_rank, kv->tp_world, NULL, 0);
    kv->pool_wait_ns = (uint64_t)cfg->pool_wait_ms * 1000000u;
    kv->prefetch_max = cfg->prefetch_max_bytes ? cfg->prefetch_max_bytes : cfg->l1_bytes / 4;
    atomic_store(&kv->lw_keep, cfg->server ? 0 : cfg->l1_bytes);
    if (kv->prefetch_max < kv->slot_bytes)
        kv->prefetch_max = kv->slot_bytes;
    return kv;
}

/* L1, then L2 (persistent or not; the L1 pool registered with it), then
 * the remote: 0, or the first failure (what opened is closed by kv_free) */
static int open_tiers(ferry_kv *kv, const ferry_kv_config *cfg, int persistent, int shared)
{
    ferry__errbuf *eb = &kv->err;
    uint64_t slot = kv->slot_bytes;
    if (cfg->remote_url) {
        int rc = remote_chunk_fits(kv);
        if (rc < 0)
            return rc;
    }
    int rc = ferry__kv_tier_l1_open(shared ? NULL : cfg->device, slot, cfg->l1_bytes / slot,
                                    shared, eb, &kv->tier[FERRY_KV_TIER_L1]);
    if (rc == 0) {
        kv->l1_gen = ferry__calloc(cfg->l1_bytes / slot, sizeof *kv->l1_gen);
        if (!kv->l1_gen)
            rc = ferry__err_set(eb, -ENOMEM, "kv open: out of memory for the L1 generations");
    }
    const char *const *dirs = cfg->l2_n_dirs ? cfg->l2_dirs : &cfg->l2_dir;
    unsigned ndirs = cfg->l2_n_dirs ? cfg->l2_n_dirs : 1;
    if (rc == 0 && dirs[0])
        rc = persistent ? ferry__kv_tier_pslab_open_kv(kv, cfg, slot, eb,
                                                       &kv->tier[FERRY_KV_TIER_L2])
                        : ferry__kv_tier_l2_open(dirs, ndirs, cfg->l2_bytes * ndirs,
                                                 cfg->l2_direct, cfg->l2_engine, cfg->l2_mode,
                                                 kv->chunk_bytes, slot, eb,
                                                 &kv->tier[FERRY_KV_TIER_L2]);
    /* L2 reads land in L1 slots and write-throughs leave from them: the
     * pool is registered for the engines' fixed-buffer path, after open
     * (the kernel pins every page: seconds for a pool not yet faulted in).
     * Optional: until then, or when an engine cannot (memlock limit, table
     * full), L2 transfers take the engine's plain path */
    if (rc == 0)
        ferry__kv_poolreg_start(&kv->l2reg, kv->tier[FERRY_KV_TIER_L1],
                                kv->tier[FERRY_KV_TIER_L2]);
    if (rc == 0 && cfg->remote_url)
        rc = open_remote(kv, cfg, cfg->remote_url);
    return rc;
}

/* each tier's eviction policy, and an index sized for every local chunk */
static int open_index(ferry_kv *kv, const ferry_kv_config *cfg)
{
    uint64_t chunks = 0;
    int rc = 0;
    for (int t = 1; rc == 0 && t < FERRY_KV_TIERS; t++) {
        ferry__kv_tier *tr = kv->tier[t];
        if (!tr)
            continue;
        int pol = t == FERRY_KV_TIER_L1   ? cfg->l1_policy
                  : t == FERRY_KV_TIER_L2 ? cfg->l2_policy
                                          : FERRY_KV_EVICT_LRU;
        rc = ferry__kv_policy_create(pol, t, tr->capacity, &tr->policy);
        if (t != FERRY_KV_TIER_REMOTE) /* the index grows as it needs to */
            chunks += tr->capacity;
    }
    if (rc < 0)
        return rc;
    kv->nbuckets = 64;
    while (kv->nbuckets < chunks)
        kv->nbuckets <<= 1;
    kv->buckets = ferry__calloc(kv->nbuckets, sizeof *kv->buckets);
    if (!kv->buckets)
        return ferry__err_set(&kv->err, -ENOMEM, "kv open: out of memory for the index");
    return 0;
}

#define KV_CFG(m) FERRY__MEMBER(ferry_kv_config, m)
static const ferry__member kv_config_later[] = {
    KV_CFG(l2_dir),        KV_CFG(l2_bytes),           KV_CFG(l2_direct),
    KV_CFG(l2_engine),     KV_CFG(l1_policy),          KV_CFG(l2_policy),
    KV_CFG(watermark),     KV_CFG(evict_fraction),     KV_CFG(write_ttl_ms),
    KV_CFG(read_ttl_ms),   KV_CFG(device),             KV_CFG(prefetch_max_bytes),
    KV_CFG(workers),       KV_CFG(l2_persistent),      KV_CFG(remote_url),
    KV_CFG(remote_options), KV_CFG(remote_index_chunks), KV_CFG(l2_reset),
    KV_CFG(l2_mode),       KV_CFG(server),             KV_CFG(server_timeout_ms),
    KV_CFG(l2_dirs),       KV_CFG(l2_n_dirs),          KV_CFG(pool_wait_ms)};
#undef KV_CFG
static const ferry__sized kv_config_sized =
    FERRY__SIZED(ferry_kv_config, FERRY_KV_CONFIG_MIN_SIZE, kv_config_later);

/* open a store whose L1 pool is shared (a memfd) or private */
static int kv_open(const ferry_kv_config *ucfg, int shared, ferry_kv **out)
{
    if (!ucfg || !out)
        return ferry__err_set(NULL, -EINVAL, "kv open: config or out is NULL");
    /* any prefix the size field covers; the rest takes its defaults */
    ferry_kv_config cfgv = FERRY_KV_CONFIG_INIT;
    int rc = ferry__opts_take(NULL, "kv open", &kv_config_sized, &cfgv, ucfg);
    if (rc < 0)
        return rc;
    const ferry_kv_config *cfg = &cfgv;
    uint32_t ct = 0;
    uint64_t chunk_bytes = 0;
    if (cfg->server && !shared)
        return ferry__kv_client_open(cfg, out);
    rc = config_check(cfg, &ct, &chunk_bytes);
    if (rc < 0)
        return rc;
    ferry_kv *kv = ferry__kv_alloc(cfg, ct, chunk_bytes);
    if (!kv)
        return ferry__err_set(NULL, -ENOMEM, "kv open: out of memory");
    int persistent = cfg->l2_persistent;
    rc = open_tiers(kv, cfg, persistent, shared);
    if (rc == 0)
        rc = open_index(kv, cfg);
    ferry__kv_tier *l2 = kv->tier[FERRY_KV_TIER_L2];
    if (rc == 0 && l2 && l2->ops->recover) {
        const char *d0 = cfg->l2_n_dirs ? cfg->l2_dirs[0] : cfg->l2_dir;
        const char *more = cfg->l2_n_dirs > 1 ? " and the other L2 directories" : "";
        int r = l2->ops->recover(l2, recover_one, kv);
        if (r < 0)
            rc = ferry__err_set(&kv->err, r, "kv open: recovering the persistent L2 in %s%s: %s",
                                d0, more, ferry_last_error());
        else
            FERRY_LOGI("kv open: %d chunks recovered from the persistent L2 in %s%s", r, d0,
                       more);
    }
    if (rc == 0)
        rc = ferry__kv_workers_start(kv, cfg->workers ? cfg->workers : 2);
    if (rc < 0) {
        ferry__err_pass(NULL, rc);
        ferry__kv_free(kv);
        return rc;
    }
    *out = kv;
    return 0;
}

int ferry_kv_open(const ferry_kv_config *cfg, ferry_kv **out)
{
    return kv_open(cfg, 0, out);
}

int ferry__kv_open_shared(const ferry_kv_config *cfg, ferry_kv **out)
{
    return kv_open(cfg, 1, out);
}

void ferry_kv_close_begin(ferry_kv *kv)
{
    if (!kv)
        return;
    if ((long)getpid() != kv->opener) { /* a fork's: nothing of it is this process's */
        FERRY_LOGW("kv close_begin in process %ld: the store was opened in process %ld, of "
                   "which this is a fork; nothing done (the opener's to close)",
                   (long)getpid(), kv->opener);
        return;
    }
    ferry__kv_refuse_store_calls(kv);
    /* under mu, as every waiter checks it: a waiter between its check and
     * its sleep holds mu, so the broadcast cannot fall between them */
    pthread_mutex_lock(&kv->mu);
    atomic_store_explicit(&kv->close_begun, 1, memory_order_release);
    pthread_cond_broadcast(&kv->loaded);
    pthread_mutex_unlock(&kv->mu);
    if (kv->be->close_begin)
        kv->be->close_begin(kv);
}

void ferry_kv_close(ferry_kv *kv)
{
    if (!kv)
        return;
    if ((long)getpid() != kv->opener) {
        /* a forked child: the store's workers, calls inside, files, rings and
         * connection are its opener's (joining them here would crash or wait
         * forever, and a connection's goodbye would be the opener's) */
        FERRY_LOGW("kv close in process %ld: the store was opened in process %ld, of "
                   "which this is a fork; nothing released (the opener's to close)",
                   (long)getpid(), kv->opener);
        return;
    }
    ferry__kv_refuse_calls(kv); /* no new call (guard.c) */
    ferry__kv_ops_abandon(kv);  /* their slots free before calls and ops are waited for */
    ferry__kv_close_wait(kv);   /* calls still inside end first */
    ferry__kv_workers_stop(kv);
    ferry__kv_ops_orphan(kv);   /* ops outlive it (op.c) */
    if (kv->be->close)
        kv->be->close(kv);
    ferry__kv_free(kv);
}

const char *ferry_kv_last_error(const ferry_kv *kv)
{
    return kv ? ferry__err_msg(&kv->err) : "";
}

uint64_t ferry_kv_chunk_bytes(const ferry_kv *kv)
{
    return kv ? kv->chunk_bytes : 0;
}

uint32_t ferry_kv_chunk_tokens(const ferry_kv *kv)
{
    return kv ? kv->chunk_tokens : 0;
}
