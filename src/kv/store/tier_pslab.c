/*
 * tier_pslab.c - the KV store's persistent L2: chunks in a ferry_pslab.
 *
 * The store speaks in locations (reserve a slot, write/read it, release
 * it); the persistent slab speaks in keys. A location here is a slot
 * number in [0, capacity) and the key of the chunk in it is its 16-byte
 * chunk id (chunk hash ^ namespace digest, little endian lo then hi), so
 * the slab's index *is* the tier's content and survives a restart.
 *
 * Invariant: a slot is either free (on the free stack) or reserved; a
 * reserved slot that was written names the id it holds (ids[loc]), and
 * the slab holds at most one chunk per written slot. release forgets the
 * id's chunk without waiting for the disk: an eviction lost in a crash
 * brings back a chunk whose bytes are still right for its id (ids are
 * content hashes), so it costs space, never correctness.
 *
 * Durability: the slab runs in SYNC_BATCH mode - a chunk is readable as
 * soon as write returns and durable with the next group commit (64 MiB or
 * 8 chunks of data, or 200 ms, or close; the slab's flusher thread runs
 * it, so a write-through never waits for an fdatasync unless two batches
 * are already queued). The store acknowledges a store once the chunk is
 * in L1 and writes through to L2 in the background anyway, so a per-chunk
 * fdatasync would only slow the write-through; a crash loses at most the
 * write-throughs of the commit in flight and the two batches behind it,
 * never returns a torn chunk, and never loses an older one.
 * ferry_kv_sync() (ferry__kv_local_sync, at the end of this file) commits what
 * is queued.
 *
 * A write is 16 requests in flight (o.depth), as the non-persistent L2
 * (tier_l2.c) moves a chunk; the slab hashes the chunk while they run.
 *
 * Reads check everything the slab checks (payload XXH3) and the length:
 * a chunk of another length under the same id (another layout) is a miss.
 * When the chunk images fill their slots, a retrieve reads them
 * asynchronously instead, in pieces on the tier's own engine
 * (tier_pslab_async.c), checked against the same record.
 *
 * What the chunks mean is recorded in the slab (its application tag):
 * layout, chunk tokens and bytes, hash seed, model and TP rank/world. A
 * store that opens the slab with other facts is refused with
 * FERRY_EMISMATCH quoting both, and its chunks stay; only l2_reset (or
 * `ferry slab check --reset`) empties it. Its directory has one owner
 * (the slab's lock): a second store on it gets FERRY_EBUSY.
 *
 * Locking: reserve/release run under the store's mutex, write/read
 * without it and concurrently; the slot table has its own mutex (taken
 * alone, never around slab I/O).
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <xxhash.h>

#include "ferry/pslab.h"
#include "kv/backend.h"
#include "kv/store/store_int.h"
#include "kv/store/tier_pslab.h"

typedef struct tp {
    ferry_pslab *ps;
    pthread_mutex_t mu;
    uint64_t *free_stack;
    uint64_t nfree;
    ferry_kv_hash *ids;
    uint8_t *written;
    uint64_t synced_seq; /* ferry_kv_sync: the slab's durable_seq it last saw (mu) */
    ferry__warnlim warn; /* forget warnings: the first few, then one a second */
    ferry__kv_tpa *async; /* its asynchronous reads, or NULL */
} tp;

#define KEY_BYTES FERRY__KV_PSLAB_KEY
#define BAD_MAX 64
/* the stripe unit across several drives (the slab's default) */
#define PSLAB_STRIPE ((uint64_t)1 << 20)

void ferry__kv_pslab_key(const ferry_kv_hash *id, uint8_t k[FERRY__KV_PSLAB_KEY])
{
    for (int i = 0; i < 8; i++) {
        k[i] = (uint8_t)(id->lo >> (8 * i));
        k[8 + i] = (uint8_t)(id->hi >> (8 * i));
    }
}

static void key_id(const uint8_t k[KEY_BYTES], ferry_kv_hash *id)
{
    id->lo = id->hi = 0;
    for (int i = 7; i >= 0; i--) {
        id->lo = (id->lo << 8) | k[i];
        id->hi = (id->hi << 8) | k[8 + i];
    }
}

static int tp_reserve(ferry__kv_tier *t, uint64_t *loc)
{
    tp *p = t->impl;
    pthread_mutex_lock(&p->mu);
    int rc = FERRY_ENOSPACE;
    if (p->nfree) {
        *loc = p->free_stack[--p->nfree];
        p->written[*loc] = 0;
        rc = 0;
    }
    pthread_mutex_unlock(&p->mu);
    return rc;
}

static void tp_release(ferry__kv_tier *t, uint64_t loc)
{
    tp *p = t->impl;
    if (loc >= t->capacity)
        return;
    pthread_mutex_lock(&p->mu);
    int had = p->written[loc];
    ferry_kv_hash id = p->ids[loc];
    p->written[loc] = 0;
    p->free_stack[p->nfree++] = loc;
    pthread_mutex_unlock(&p->mu);
    if (had) {
        uint8_t k[KEY_BYTES];
        ferry__kv_pslab_key(&id, k);
        int rc = ferry_pslab_forget(p->ps, k, sizeof k);
        if (rc < 0 && rc != FERRY_ENOTFOUND) {
            /* a failed journal fails every forget after it: say so, not
             * once per eviction */
            uint64_t quiet = 0;
            if (ferry__warn_ok(&p->warn, &quiet))
                FERRY_LOGW("kv persistent L2: forgetting the chunk in slot %llu: %s%s%llu%s",
                           (unsigned long long)loc, ferry_pslab_last_error(p->ps),
                           quiet ? " (" : "", (unsigned long long)quiet,
                           quiet ? " more suppressed)" : "");
        }
    }
}

static int tp_write(ferry__kv_tier *t, uint64_t loc, const ferry_kv_hash *id, const void *src,
                    size_t len)
{
    tp *p = t->impl;
    if (loc >= t->capacity || !id || !src || len == 0 || len > t->slot_bytes)
        return ferry__err_set(NULL, -EINVAL, "kv persistent L2: write of %zu bytes to slot %llu "
                              "(capacity %llu slots of %llu bytes)", len,
                              (unsigned long long)loc, (unsigned long long)t->capacity,
                              (unsigned long long)t->slot_bytes);
    uint8_t k[KEY_BYTES];
    ferry__kv_pslab_key(id, k);
    int rc = ferry_pslab_put(p->ps, k, sizeof k, src, len);
    if (rc < 0)
        return ferry__err_set(NULL, rc, "kv persistent L2: storing slot %llu: %s",
                              (unsigned long long)loc, ferry_pslab_last_error(p->ps));
    pthread_mutex_lock(&p->mu);
    p->ids[loc] = *id;
    p->written[loc] = 1;
    pthread_mutex_unlock(&p->mu);
    return 0;
}

static int tp_read(ferry__kv_tier *t, uint64_t loc, const ferry_kv_hash *id, void *dst, size_t len)
{
    tp *p = t->impl;
    if (!id || !dst || len == 0)
        return ferry__err_set(NULL, -EINVAL, "kv persistent L2: read of %zu bytes", len);
    uint8_t k[KEY_BYTES];
    ferry__kv_pslab_key(id, k);
    size_t got = 0;
    int rc = ferry_pslab_get(p->ps, k, sizeof k, dst, len, &got);
    if (rc == -ENOBUFS || (rc == 0 && got != len)) {
        ferry_pslab_forget(p->ps, k, sizeof k);
        return ferry__err_set(NULL, FERRY_EMISMATCH, "kv persistent L2: slot %llu holds a chunk "
                              "of another length than the %zu bytes asked (another layout)",
                              (unsigned long long)loc, len);
    }
    if (rc < 0)
        return ferry__err_set(NULL, rc, "kv persistent L2: reading slot %llu: %s",
                              (unsigned long long)loc, ferry_pslab_last_error(p->ps));
    return 0;
}

static void *tp_host_ptr(ferry__kv_tier *t, uint64_t loc)
{
    (void)t;
    (void)loc;
    return NULL;
}

static void tp_close(ferry__kv_tier *t)
{
    tp *p = t->impl;
    if (!p)
        return;
    ferry__kv_tpa_close(p->async); /* (before the slab: it holds pins there) */
    p->async = NULL;
    if (p->ps && ferry_pslab_close(p->ps) < 0)
        FERRY_LOGW("kv persistent L2: closing: %s", ferry_last_error());
    pthread_mutex_destroy(&p->mu);
    ferry__free(p->free_stack);
    ferry__free(p->ids);
    ferry__free(p->written);
    ferry__free(p);
    t->impl = NULL;
}

static int tp_reg_pool(ferry__kv_tier *t, void *pool, size_t len)
{
    tp *p = t->impl;
    return p->async ? ferry__kv_tpa_register(p->async, pool, len) : 0;
}

static void tp_unreg_pool(ferry__kv_tier *t)
{
    tp *p = t->impl;
    ferry__kv_tpa_unregister(p->async);
}

ferry__kv_tpa *ferry__kv_tier_pslab_tpa(ferry__kv_tier *t)
{
    return t && t->impl ? ((tp *)t->impl)->async : NULL;
}

static const ferry__kv_tier_ops tp_ops = {
    .name = "l2-persistent",
    .reserve = tp_reserve,
    .release = tp_release,
    .write = tp_write,
    .read = tp_read,
    .host_ptr = tp_host_ptr,
    .close = tp_close,
    .recover = ferry__kv_tier_pslab_recover,
    .reg_pool = tp_reg_pool,
    .unreg_pool = tp_unreg_pool,
};

int ferry__kv_pslab_tag(const ferry_kv *kv, char *out, size_t cap)
{
    const ferry_kv_layout *l = &kv->layout;
    char model[80];
    /* a model name too long for the tag is recorded by its digest */
    if (strlen(kv->model) < sizeof model - 1)
        snprintf(model, sizeof model, "%s", kv->model);
    else
        snprintf(model, sizeof model, "xxh3:%016llx",
                 (unsigned long long)XXH3_64bits(kv->model, strlen(kv->model)));
    int n = snprintf(out, cap,
                     "ferry-kv/1;layers=%u;kv=%u;heads=%u;head_dim=%u;dtype=%s;"
                     "chunk_tokens=%u;chunk_bytes=%llu;seed=%016llx;tp=%u/%u;model=%s",
                     l->num_layers, l->kv, l->num_heads, l->head_dim, ferry_dtype_name(l->dtype),
                     kv->chunk_tokens, (unsigned long long)kv->chunk_bytes,
                     (unsigned long long)kv->seed, kv->tp_rank, kv->tp_world, model);
    return n < 0 || (size_t)n >= cap ? -ENAMETOOLONG : n;
}

int ferry__kv_tier_pslab_open_kv(const ferry_kv *kv, const ferry_kv_config *cfg,
                                 uint64_t slot_bytes, ferry__errbuf *eb, ferry__kv_tier **out)
{
    char tag[FERRY_PSLAB_TAG_MAX];
    int n = ferry__kv_pslab_tag(kv, tag, sizeof tag);
    if (n < 0)
        return ferry__err_set(eb, n, "kv persistent L2: the store's description does not fit "
                              "the slab's %u-byte tag", FERRY_PSLAB_TAG_MAX);
    ferry__kv_pslab_cfg c;
    memset(&c, 0, sizeof c);
    c.dir = cfg->l2_n_dirs ? cfg->l2_dirs[0] : cfg->l2_dir;
    c.dirs = cfg->l2_n_dirs ? cfg->l2_dirs : NULL;
    c.n_dirs = cfg->l2_n_dirs;
    c.bytes = cfg->l2_bytes * (cfg->l2_n_dirs ? cfg->l2_n_dirs : 1);
    c.direct = cfg->l2_direct;
    c.engine = cfg->l2_engine;
    c.slot_bytes = slot_bytes;
    c.chunk_bytes = kv->chunk_bytes;
    c.tag = tag;
    c.tag_len = (size_t)n;
    c.mode = cfg->l2_mode;
    c.reset = cfg->l2_reset;
    return ferry__kv_tier_pslab_open(&c, eb, out);
}

/* asynchronous reads, when the chunk images fill their slots (the slab's
 * checksum then covers the bytes the retrieve checks); without them, or
 * when the engine cannot be had, reads stay synchronous */
static void tp_async_open(ferry__kv_tier *t, const ferry__kv_pslab_cfg *c, const char *dir,
                          const ferry_pslab_stats *s)
{
    tp *p = t->impl;
    if (!c->chunk_bytes || c->chunk_bytes != t->slot_bytes || !s->alignment ||
        t->slot_bytes % s->alignment)
        return;
    if (ferry__kv_tpa_open(p->ps, c->engine, t->capacity, s, &p->async) < 0) {
        FERRY_LOGI("kv persistent L2: %s: reads stay synchronous: %s", dir, ferry_last_error());
        return;
    }
    t->aops = &ferry__kv_tpa_aops;
    t->apiece = (uint64_t)2 << 20;
    /* a piece spans at most two drives: at most one stripe unit */
    if (s->drives > 1 && s->stripe_bytes)
        t->apiece = FERRY__MIN(t->apiece, s->stripe_bytes);
}

int ferry__kv_tier_pslab_open(const ferry__kv_pslab_cfg *c, ferry__errbuf *eb,
                              ferry__kv_tier **out)
{
    const char *dir = c ? c->dir : NULL;
    uint64_t bytes = c ? c->bytes : 0, slot_bytes = c ? c->slot_bytes : 0;
    if (!dir || !out || !slot_bytes || slot_bytes % 4096 || bytes < slot_bytes)
        return ferry__err_set(eb, -EINVAL, "kv persistent L2: a slab of %llu bytes in %s cannot "
                              "hold chunks of %llu bytes", (unsigned long long)bytes,
                              dir ? dir : "(null)", (unsigned long long)slot_bytes);
    ferry__kv_tier *t = ferry__calloc(1, sizeof *t);
    tp *p = ferry__calloc(1, sizeof *p);
    if (!t || !p) {
        ferry__free(t);
        ferry__free(p);
        return ferry__err_set(eb, -ENOMEM, "kv persistent L2: out of memory for the tier");
    }
    pthread_mutex_init(&p->mu, NULL);
    t->ops = &tp_ops;
    t->impl = p;
    t->id = FERRY_KV_TIER_L2;
    t->slot_bytes = slot_bytes;
    const char *one[1] = {dir};
    unsigned ndirs = c->n_dirs && c->dirs ? c->n_dirs : 1;
    /* several drives: the slab is striped in units of PSLAB_STRIPE and its
     * size a multiple of a stripe on every drive (so it opens again with
     * the same size, no rounding in between) */
    if (ndirs > 1)
        bytes -= bytes % (PSLAB_STRIPE * ndirs);
    t->capacity = bytes / slot_bytes;
    if (!t->capacity) {
        ferry__kv_tier_free(t);
        return ferry__err_set(eb, -EINVAL, "kv persistent L2: a slab of %llu bytes striped over "
                              "%u directories (%s, ...) in units of %llu holds no chunk of %llu "
                              "bytes", (unsigned long long)c->bytes, ndirs, dir,
                              (unsigned long long)PSLAB_STRIPE, (unsigned long long)slot_bytes);
    }
    ferry_pslab_options o = FERRY_PSLAB_OPTIONS_INIT;
    o.dirs = ndirs > 1 ? c->dirs : one;
    o.n_dirs = ndirs;
    o.bytes = ndirs > 1 ? bytes : t->capacity * slot_bytes;
    o.stripe_bytes = ndirs > 1 ? PSLAB_STRIPE : 0;
    o.direct = c->direct;
    o.engine = c->engine;
    o.flags = FERRY_PSLAB_CREATE | (c->reset ? FERRY_PSLAB_RESET : 0u);
    o.lanes = 4;
    /* the store acknowledges a chunk when it is in L1; its write-through need
     * not wait for the disk: batch the syncs (data still before records) */
    o.sync = FERRY_PSLAB_SYNC_BATCH;
    o.batch_bytes = FERRY__MAX((uint64_t)64 << 20, 8 * slot_bytes);
    o.batch_ms = 200;
    /* 16 requests per chunk, as the non-persistent L2 (tier_l2.c) */
    o.depth = 16;
    o.tag = c->tag;
    o.tag_len = c->tag ? c->tag_len : 0;
    o.mode = c->mode;
    int rc = ferry_pslab_open(&o, &p->ps);
    if (rc == FERRY_EMISMATCH) {
        /* a slab of another size: keep its chunks, size the tier by it. The
         * retry accepts any size only: another tag (layout, chunk size,
         * seed, namespace) is refused again, by the same check */
        o.bytes = 0;
        rc = ferry_pslab_open(&o, &p->ps);
        if (rc == 0) {
            ferry_pslab_stats s = FERRY_PSLAB_STATS_INIT;
            ferry_pslab_stats_get(p->ps, &s);
            t->capacity = s.capacity / slot_bytes;
            FERRY_LOGW("kv persistent L2: %s holds a slab of %llu bytes, not the %llu "
                       "configured: using it as it is", dir, (unsigned long long)s.capacity,
                       (unsigned long long)bytes);
        }
    }
    if (rc < 0) {
        rc = ferry__err_set(eb, rc, "kv persistent L2: %s", ferry_last_error());
        ferry__kv_tier_free(t);
        return rc;
    }
    p->free_stack = ferry__malloc((t->capacity ? t->capacity : 1) * sizeof *p->free_stack);
    p->ids = ferry__calloc(t->capacity ? t->capacity : 1, sizeof *p->ids);
    p->written = ferry__calloc(t->capacity ? t->capacity : 1, 1);
    if (!p->free_stack || !p->ids || !p->written || !t->capacity) {
        rc = ferry__err_set(eb, t->capacity ? -ENOMEM : -EINVAL,
                            "kv persistent L2: %s for %llu slots in %s",
                            t->capacity ? "out of memory" : "no room",
                            (unsigned long long)t->capacity, dir);
        ferry__kv_tier_free(t);
        return rc;
    }
    for (uint64_t i = 0; i < t->capacity; i++)
        p->free_stack[i] = t->capacity - 1 - i; /* slot 0 on top */
    p->nfree = t->capacity;
    ferry_pslab_stats s = FERRY_PSLAB_STATS_INIT;
    ferry_pslab_stats_get(p->ps, &s);
    p->synced_seq = s.durable_seq;
    tp_async_open(t, c, dir, &s);
    *out = t;
    return 0;
}

ferry_pslab *ferry__kv_tier_pslab_store(ferry__kv_tier *t)
{
    return t && t->ops == &tp_ops ? ((tp *)t->impl)->ps : NULL;
}

typedef struct found {
    ferry_kv_hash *ids;
    uint64_t *lens;
    size_t n, cap;
    uint8_t (*bad)[FERRY_PSLAB_KEY_MAX];
    size_t *bad_len;
    size_t nbad;
    uint64_t slot_bytes;
    int oom;
} found;

static int collect(const void *key, size_t klen, const ferry_pslab_info *info, void *ctx)
{
    found *f = ctx;
    if (klen == KEY_BYTES && info->length <= f->slot_bytes && f->n < f->cap) {
        key_id(key, &f->ids[f->n]);
        f->lens[f->n++] = info->length;
    } else if (f->nbad < BAD_MAX) {
        memcpy(f->bad[f->nbad], key, klen);
        f->bad_len[f->nbad++] = klen;
    }
    return 0;
}

int ferry__kv_tier_pslab_recover(ferry__kv_tier *t, ferry__kv_tier_recover_fn fn, void *ctx)
{
    tp *p = t ? t->impl : NULL;
    if (!p || !fn || t->ops != &tp_ops)
        return ferry__err_set(NULL, -EINVAL, "kv persistent L2: recover: not a persistent tier");
    ferry_pslab_stats s = FERRY_PSLAB_STATS_INIT;
    ferry_pslab_stats_get(p->ps, &s);
    found f;
    memset(&f, 0, sizeof f);
    f.slot_bytes = t->slot_bytes;
    f.cap = (size_t)s.chunks;
    size_t n0 = f.cap ? f.cap : 1;
    f.ids = ferry__malloc(n0 * sizeof *f.ids);
    f.lens = ferry__malloc(n0 * sizeof *f.lens);
    f.bad = ferry__malloc(BAD_MAX * sizeof *f.bad);
    f.bad_len = ferry__malloc(BAD_MAX * sizeof *f.bad_len);
    int rc = 0;
    if (!f.ids || !f.lens || !f.bad || !f.bad_len)
        rc = ferry__err_set(NULL, -ENOMEM, "kv persistent L2: out of memory recovering %zu "
                            "chunks", f.cap);
    /* chunks that cannot be this tier's (other key size, too long) go, BAD_MAX a pass */
    do {
        f.n = f.nbad = 0;
        if (rc == 0)
            rc = ferry_pslab_iterate(p->ps, collect, &f);
        for (size_t i = 0; rc == 0 && i < f.nbad; i++)
            ferry_pslab_forget(p->ps, f.bad[i], f.bad_len[i]);
    } while (rc == 0 && f.nbad == BAD_MAX);
    size_t reported = 0;
    for (size_t i = 0; rc == 0 && i < f.n; i++) {
        uint8_t k[KEY_BYTES];
        ferry__kv_pslab_key(&f.ids[i], k);
        uint64_t loc = 0;
        if (tp_reserve(t, &loc) < 0) {
            ferry_pslab_forget(p->ps, k, sizeof k);
            continue;
        }
        pthread_mutex_lock(&p->mu);
        p->ids[loc] = f.ids[i];
        p->written[loc] = 1;
        pthread_mutex_unlock(&p->mu);
        int r = fn(&f.ids[i], loc, f.lens[i], ctx);
        if (r != 0) {
            tp_release(t, loc);
            for (size_t j = i + 1; j < f.n; j++) {
                ferry__kv_pslab_key(&f.ids[j], k);
                ferry_pslab_forget(p->ps, k, sizeof k);
            }
            rc = r;
            break;
        }
        reported++;
    }
    ferry__free(f.ids);
    ferry__free(f.lens);
    ferry__free(f.bad);
    ferry__free(f.bad_len);
    return rc < 0 || rc > 0 ? rc : (int)reported;
}

typedef struct newer {
    uint64_t lo, hi, n;
} newer;

static int count_newer(const void *key, size_t klen, const ferry_pslab_info *info, void *ctx)
{
    (void)key;
    newer *w = ctx;
    if (klen == KEY_BYTES && info->seq > w->lo && info->seq <= w->hi)
        w->n++;
    return 0;
}

int ferry__kv_local_sync(ferry_kv *kv)
{
    int rc = ferry__kv_flush(kv);
    if (rc < 0)
        return rc;
    ferry__kv_tier *t = kv->tier[FERRY_KV_TIER_L2];
    ferry_pslab *ps = ferry__kv_tier_pslab_store(t);
    if (!ps)
        return 0;
    rc = ferry_pslab_sync(ps);
    if (rc < 0)
        return ferry__kv_err(kv, rc, "kv sync: committing the persistent L2: %s",
                             ferry_pslab_last_error(ps));
    /* the chunks in the slab whose put records are durable now and were not
     * at the previous sync: what this sync (and the commits since the last
     * one) made durable */
    tp *p = t->impl;
    ferry_pslab_stats s = FERRY_PSLAB_STATS_INIT;
    ferry_pslab_stats_get(ps, &s);
    pthread_mutex_lock(&p->mu);
    newer w = {p->synced_seq, s.durable_seq, 0};
    if (s.durable_seq > p->synced_seq)
        p->synced_seq = s.durable_seq;
    pthread_mutex_unlock(&p->mu);
    ferry_pslab_iterate(ps, count_newer, &w);
    return w.n > INT32_MAX ? INT32_MAX : (int)w.n;
}

