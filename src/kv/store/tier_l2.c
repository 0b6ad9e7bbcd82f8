/*
 * tier_l2.c - L2: chunks on an NVMe slab through the GDS context.
 *
 * The slab (ferry/gds.h) owns a first-fit allocator over its bytes; every
 * chunk takes one extent of slot_bytes (a multiple of 4096), so the slab
 * never fragments and capacity is slab size / slot_bytes. Chunks move
 * between an L1 slot (4096-aligned host memory) and their extent with the
 * slab's host path (its I/O engines, O_DIRECT when the file system allows).
 *
 * Invariant: an extent is allocated exactly while some entry's loc[L2]
 * names it (reserved under the store's mutex, freed on eviction/delete).
 *
 * Every chunk is verified on its way back (sum.c): the tier keeps, per
 * slot, the id of the chunk written there and the XXH3-64 of its image,
 * set when the write completed and cleared when the slot is released. A
 * synchronous read checks both before it returns; an asynchronous read
 * lands in an L1 slot the store does not publish until the copy-out that
 * hashes it as it goes has passed l2_verify. A mismatch (another
 * process's bytes, a torn or rotten block) is FERRY_ECORRUPT: a miss.
 * The slot records are written by the writing thread before the store
 * publishes the location under its mutex, and read after a reader found
 * the location under that mutex, so they need no lock of their own.
 *
 * Transfers run concurrently from any number of threads (the context's
 * host path is thread-safe since gds.c's deliver() fix, e67ae31): the
 * store's read-ahead keeps several chunk reads in flight that way. The L1
 * pool is registered with the context (ferry__kv_tier_l2_register) so
 * reads into and write-throughs from L1 slots take the engines' fixed-
 * buffer path, by a thread of the store after open while transfers run
 * (tier_l2_poolreg.c; `registered` is read only after it was joined); it
 * is unregistered before the pool is freed.
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>

#include "ferry/gds.h"
#include "kv/kv_impl.h"
#include "kv/store/store_int.h"

/* an asynchronous read: the store's part first */
typedef struct l2_rd {
    ferry__kv_aread pub;
    ferry_gds_req req;
    char msg[256];          /* the failure's message */
} l2_rd;

/* a chunk image over this many bytes is checked in pieces of it, each as
 * it lands (kv_impl.h's aops vpiece), so a retrieve checks and copies
 * out the chunk while its later pieces are still being read */
#define L2_CHECK_PIECE ((uint64_t)2 << 20)

uint64_t ferry__kv_l2_check_piece = L2_CHECK_PIECE;

/* what a slot holds: the chunk's id and the checksum of its image (or,
 * for a chunk checked in pieces, of each piece: the tier's psum) */
typedef struct l2_meta {
    ferry_kv_hash id;
    uint64_t sum;
    uint64_t valid;
} l2_meta;

typedef struct l2 {
    ferry_gds *gds;
    l2_meta *meta;          /* per slot (offset / slot_bytes) */
    uint64_t nmeta;
    uint64_t sum_bytes;     /* the image's bytes: the chunk, not its padding */
    uint32_t np;            /* pieces per image checked apart (0: checked whole) */
    uint64_t cp;            /* bytes per piece (ferry__kv_l2_check_piece at open) */
    uint64_t *psum;         /* np per slot: each piece's XXH3-64 */
    ferry_slab *slab;
    void *registered;       /* the L1 pool while registered, else NULL */
    ferry__kv_aq aq;        /* asynchronous reads (kv_impl.h) */
    unsigned break_after;   /* test seam (aq.mu): reaps with completions until... */
    int break_code;         /* ...the next one fails with this (0: off) */
} l2;

static int l2_reserve(ferry__kv_tier *t, uint64_t *loc)
{
    l2 *p = t->impl;
    ferry_extent e;
    int rc = ferry_slab_alloc_bytes(p->slab, t->slot_bytes, &e);
    if (rc < 0)
        return rc == -ENOMEM ? rc : FERRY_ENOSPACE;
    *loc = e.offset;
    return 0;
}

/* the record of the slot at loc, or NULL when loc is not a slot's start */
static l2_meta *meta_at(ferry__kv_tier *t, uint64_t loc)
{
    l2 *p = t->impl;
    uint64_t i = loc / t->slot_bytes;
    return loc % t->slot_bytes == 0 && i < p->nmeta ? &p->meta[i] : NULL;
}

static void l2_release(ferry__kv_tier *t, uint64_t loc)
{
    l2 *p = t->impl;
    l2_meta *m = meta_at(t, loc);
    if (m)
        m->valid = 0;
    ferry_extent e = {loc, t->slot_bytes};
    int rc = ferry_slab_free(p->slab, &e);
    if (rc < 0)
        FERRY_LOGW("kv L2: freeing the extent at %llu: %s", (unsigned long long)loc,
                   ferry_last_error());
}

static int l2_write(ferry__kv_tier *t, uint64_t loc, const ferry_kv_hash *id, const void *src,
                    size_t len)
{
    (void)len;
    l2 *p = t->impl;
    l2_meta *m = meta_at(t, loc);
    if (!m)
        return ferry__err_set(NULL, -EINVAL, "kv L2: write to %llu, not the start of a slot",
                              (unsigned long long)loc);
    m->valid = 0;
    /* (the write-through runs on an I/O worker, off every caller's path) */
    uint64_t sum = 0, *ps = p->psum + (m - p->meta) * p->np;
    for (uint32_t k = 0; k < p->np; k++)
        ps[k] = ferry__kv_sum((const char *)src + k * p->cp,
                              (size_t)FERRY__MIN(p->cp,
                                                 p->sum_bytes - k * p->cp));
    if (!p->np)
        sum = ferry__kv_sum(src, p->sum_bytes);
    ferry_extent e = {loc, t->slot_bytes};
    int rc = ferry_gds_extent_pwrite(p->gds, &e, src);
    if (rc == 0) {
        m->id = *id;
        m->sum = sum;
        m->valid = 1;
    }
    return rc;
}

/* the slot at loc holds chunk id: its record, or NULL and FERRY_ECORRUPT set */
static l2_meta *l2_holds(ferry__kv_tier *t, uint64_t loc, const ferry_kv_hash *id)
{
    l2_meta *m = meta_at(t, loc);
    if (!m || !m->valid) {
        ferry__err_set(NULL, FERRY_ECORRUPT,
                       "kv L2: the slot at offset %llu holds no chunk the store wrote",
                       (unsigned long long)loc);
        return NULL;
    }
    if (m->id.hi != id->hi || m->id.lo != id->lo) {
        ferry__err_set(NULL, FERRY_ECORRUPT,
                       "kv L2: the slot at offset %llu holds chunk %016llx%016llx, not "
                       "%016llx%016llx",
                       (unsigned long long)loc, (unsigned long long)m->id.hi,
                       (unsigned long long)m->id.lo, (unsigned long long)id->hi,
                       (unsigned long long)id->lo);
        return NULL;
    }
    return m;
}

/* the checksum written for piece k of chunk id at loc */
static int l2_psum(ferry__kv_tier *t, uint64_t loc, const ferry_kv_hash *id, uint64_t k,
                   uint64_t *sum)
{
    l2 *p = t->impl;
    l2_meta *m = l2_holds(t, loc, id);
    if (!m)
        return FERRY_ECORRUPT;
    if (k >= p->np)
        return ferry__err_set(NULL, FERRY_ECORRUPT, "kv L2: chunk %016llx%016llx has %u pieces, "
                              "not %llu", (unsigned long long)id->hi, (unsigned long long)id->lo,
                              p->np, (unsigned long long)k + 1);
    *sum = p->psum[(uint64_t)(m - p->meta) * p->np + k];
    return 0;
}

static uint64_t l2_vpiece(ferry__kv_tier *t, uint64_t loc)
{
    (void)loc;
    l2 *p = t->impl;
    return p->np ? p->cp : 0;
}

/* the chunk read from loc is chunk id with image checksum sum, or FERRY_ECORRUPT */
static int l2_verify(ferry__kv_tier *t, uint64_t loc, const ferry_kv_hash *id, uint64_t sum)
{
    if (((l2 *)t->impl)->np)
        return ferry__err_set(NULL, -EINVAL, "kv L2: chunks of %llu bytes are checked in "
                              "pieces, not whole", (unsigned long long)t->chunk_bytes);
    l2_meta *m = l2_holds(t, loc, id);
    if (!m)
        return FERRY_ECORRUPT;
    if (m->sum != sum)
        return ferry__err_set(NULL, FERRY_ECORRUPT,
                              "kv L2: chunk %016llx%016llx read from offset %llu (%llu bytes) "
                              "fails its checksum (%016llx, written %016llx): the slab file "
                              "was changed behind the store",
                              (unsigned long long)id->hi, (unsigned long long)id->lo,
                              (unsigned long long)loc, (unsigned long long)t->chunk_bytes,
                              (unsigned long long)sum, (unsigned long long)m->sum);
    return 0;
}

static int l2_read(ferry__kv_tier *t, uint64_t loc, const ferry_kv_hash *id, void *dst, size_t len)
{
    (void)len;
    l2 *p = t->impl;
    ferry_extent e = {loc, t->slot_bytes};
    int rc = ferry_gds_extent_pread(p->gds, &e, dst);
    if (rc < 0)
        return rc;
    if (p->np)
        return ferry__kv_tier_check_whole(t, loc, id, dst, p->sum_bytes);
    return l2_verify(t, loc, id, ferry__kv_sum(dst, p->sum_bytes));
}

static void *l2_host_ptr(ferry__kv_tier *t, uint64_t loc)
{
    (void)t;
    (void)loc;
    return NULL;
}

/* ---- asynchronous reads ---- */

static ferry__kv_aread *l2_aget(ferry__kv_tier *t)
{
    return ferry__kv_aq_get(&((l2 *)t->impl)->aq);
}

static void l2_aput(ferry__kv_tier *t, ferry__kv_aread *r)
{
    ferry__kv_aq_put(&((l2 *)t->impl)->aq, r);
}

static int l2_asubmit(ferry__kv_tier *t, ferry__kv_abatch *b, ferry__kv_aread *pub, uint64_t loc,
                      uint64_t off, void *dst, size_t len)
{
    loc += off; /* (a location is the chunk's slab offset) */
    l2 *p = t->impl;
    l2_rd *r = (l2_rd *)pub;
    r->req = (ferry_gds_req){0};
    r->req.dir = FERRY_GDS_READ;
    r->req.buf = dst;
    r->req.len = len;
    r->req.slab_off = loc;
    r->req.user = r;
    int broken = ferry__kv_aq_enter(&p->aq, b, pub);
    if (broken)
        return ferry__err_set(NULL, broken,
                              "kv L2: read of the chunk at %llu: the slab's drive queue broke "
                              "earlier (%s)",
                              (unsigned long long)loc, ferry_strerror(broken));
    ferry_gds_req *q = &r->req;
    int rc = ferry_gds_submit(p->gds, &q, 1);
    if (rc == 1)
        return 0;
    ferry__kv_aq_leave(&p->aq, b);
    return ferry__err_set(NULL, rc < 0 ? rc : FERRY_EDRIVER,
                          "kv L2: submitting the read of %zu bytes at %llu: %s", len,
                          (unsigned long long)loc,
                          ferry_gds_last_error(p->gds));
}

/* one reaper's turn (without aq.mu): what completed lands in its batch;
 * < 0 when the drive queue broke (through the test seam too) */
static int l2_reap(void *ctx)
{
    l2 *p = ctx;
    ferry_gds_req *done[32];
    /* a bounded wait, so a completion another path delivered is seen soon */
    int k = ferry_gds_reap(p->gds, done, 1, 32, 50);
    pthread_mutex_lock(&p->aq.mu);
    if (k > 0 && p->break_code && p->break_after-- == 0) {
        /* (the seam: these completions are lost with the queue) */
        k = ferry__err_set(NULL, p->break_code, "kv L2: reap: injected queue failure");
        p->break_code = 0;
    }
    const char *why = k > 0 ? ferry_gds_last_error(p->gds) : NULL;
    for (int i = 0; i < k; i++) {
        l2_rd *r = done[i]->user;
        r->pub.result = done[i]->result;
        if (r->pub.result < 0) {
            snprintf(r->msg, sizeof r->msg, "%s", why && *why ? why : "read failed");
            r->pub.why = r->msg;
        }
        ferry__kv_aq_land(&r->pub);
    }
    pthread_mutex_unlock(&p->aq.mu);
    return k < 0 ? k : 0;
}

static int l2_await(ferry__kv_tier *t, ferry__kv_abatch *b, ferry__kv_aread **out)
{
    l2 *p = t->impl;
    return ferry__kv_aq_wait(&p->aq, b, out, l2_reap, p, "kv L2");
}

static void l2_close(ferry__kv_tier *t)
{
    l2 *p = t->impl;
    if (!p)
        return;
    ferry__kv_tier_l2_unregister(t);
    ferry_gds_close(p->gds); /* reads still in flight (a broken queue) land or drop here */
    ferry__free(p->meta);
    ferry__free(p->psum);
    ferry__kv_aq_fini(&p->aq);
    ferry__free(p);
    t->impl = NULL;
}

int ferry__kv_tier_l2_register(ferry__kv_tier *t, void *pool, size_t len)
{
    l2 *p = t->impl;
    if (p->registered)
        return 0;
    int rc = ferry_gds_host_register(p->gds, pool, len);
    if (rc < 0)
        return rc;
    p->registered = pool;
    return 0;
}

void ferry__kv_tier_l2_unregister(ferry__kv_tier *t)
{
    l2 *p = t ? t->impl : NULL;
    if (!p || !p->registered)
        return;
    if (ferry_gds_host_unregister(p->gds, p->registered) < 0)
        FERRY_LOGW("kv L2: unregistering the L1 pool: %s", ferry_last_error());
    p->registered = NULL;
}

#define L2_PIECE ((uint64_t)4 << 20) /* async read request of a large chunk */

static const ferry__kv_tier_ops l2_ops = {
    .name = "l2",
    .reserve = l2_reserve,
    .release = l2_release,
    .write = l2_write,
    .read = l2_read,
    .host_ptr = l2_host_ptr,
    .close = l2_close,
    .reg_pool = ferry__kv_tier_l2_register,
    .unreg_pool = ferry__kv_tier_l2_unregister,
};

static int l2_abroken(ferry__kv_tier *t)
{
    return ferry__kv_aq_broken(&((l2 *)t->impl)->aq);
}

void ferry__kv_tier_l2_break_after(ferry__kv_tier *t, unsigned reaps, int code)
{
    l2 *p = t->impl;
    pthread_mutex_lock(&p->aq.mu);
    p->break_after = reaps;
    p->break_code = code;
    pthread_mutex_unlock(&p->aq.mu);
}

/* up to 8 chunks in flight for one retrieve; chunks over 4 MiB are read
 * in 4 MiB pieces, 16 in flight (64 MiB), so they land one after another
 * and each is copied out while the next is read: `ferry bench io` on this
 * VM's virtio disk reaches the same 7-8 GB/s from 32 MiB in flight on,
 * and 8 whole 32 MiB reads in flight all land together, about 34 ms after
 * they were sent, which left the copies of the last 8 chunks of a
 * retrieve (about 15 ms of 117) after the last read */
static const ferry__kv_tier_aops l2_aops = {
    .depth = 8,
    .pdepth = 16,
    .get = l2_aget,
    .put = l2_aput,
    .submit = l2_asubmit,
    .wait = l2_await,
    .broken = l2_abroken,
    .verify = l2_verify,
    .vpiece = l2_vpiece,
    .psum = l2_psum,
};

int ferry__kv_tier_l2_open(const char *const *dirs, unsigned ndirs, uint64_t bytes, int direct,
                           const char *engine, unsigned mode, uint64_t chunk_bytes,
                           uint64_t slot_bytes, ferry__errbuf *eb, ferry__kv_tier **out)
{
    const char *dir = dirs && ndirs ? dirs[0] : NULL;
    if (!dir || !slot_bytes || slot_bytes % 4096 || bytes < slot_bytes || !chunk_bytes ||
        chunk_bytes > slot_bytes)
        return ferry__err_set(eb, -EINVAL,
                              "kv L2: slab of %llu bytes in %s cannot hold a chunk of %llu bytes",
                              (unsigned long long)bytes, dir ? dir : "(null)",
                              (unsigned long long)slot_bytes);
    ferry__kv_tier *t = ferry__calloc(1, sizeof *t);
    l2 *p = ferry__calloc(1, sizeof *p);
    if (!t || !p) {
        ferry__free(t);
        ferry__free(p);
        return ferry__err_set(eb, -ENOMEM, "kv L2: out of memory for the tier");
    }
    t->ops = &l2_ops;
    t->aops = &l2_aops;
    t->impl = p;
    ferry__kv_aq_init(&p->aq, sizeof(l2_rd));
    t->id = FERRY_KV_TIER_L2;
    t->slot_bytes = slot_bytes;
    t->chunk_bytes = chunk_bytes;
    p->sum_bytes = chunk_bytes;
    ferry_gds_config cfg = FERRY_GDS_CONFIG_INIT;
    cfg.dirs = dirs; /* several: the slab is striped across them (4 MiB units) */
    cfg.n_dirs = ndirs;
    cfg.bytes = bytes - bytes % slot_bytes;
    cfg.direct = direct;
    cfg.driver = "cpu";
    cfg.mode = mode; /* the slab, its lock file and new directories */
    cfg.engine = engine;
    /* 16 requests per chunk transfer (2 MiB each for a Llama-3-8B chunk of
     * 32 MiB): each of the store's I/O workers then reads its chunk at
     * close to the drive's bandwidth, so read-ahead chunks land in order
     * and the caller's copies overlap them (several half-speed reads that
     * land together leave their copies as a serial tail). Measured with
     * `ferry kv bench` on the 2-core VM: L2 retrieve 7.5-8.2 GB/s against
     * 6.0-7.0 at depth 8 with 4 workers */
    cfg.depth = 16;
    int rc = ferry_gds_open(&cfg, &p->gds);
    if (rc < 0) {
        ferry__kv_tier_free(t);
        return ferry__err_set(eb, rc, "kv L2: opening the slab of %llu bytes in %s: %s",
                              (unsigned long long)cfg.bytes, dir, ferry_last_error());
    }
    p->slab = ferry_gds_slab(p->gds);
    t->capacity = ferry_slab_capacity(p->slab) / slot_bytes;
    t->apiece = slot_bytes > L2_PIECE ? L2_PIECE : 0;
    if (!t->capacity) {
        ferry__kv_tier_free(t);
        return ferry__err_set(eb, -EINVAL, "kv L2: slab in %s holds no chunk of %llu bytes", dir,
                              (unsigned long long)slot_bytes);
    }
    p->nmeta = t->capacity;
    p->meta = ferry__calloc(p->nmeta, sizeof *p->meta);
    p->cp = ferry__kv_l2_check_piece ? ferry__kv_l2_check_piece : L2_CHECK_PIECE;
    p->np = chunk_bytes > p->cp
                ? (uint32_t)((chunk_bytes + p->cp - 1) / p->cp)
                : 0;
    p->psum = p->np ? ferry__calloc(p->nmeta * p->np, sizeof *p->psum) : NULL;
    if (!p->meta || (p->np && !p->psum)) {
        ferry__kv_tier_free(t);
        return ferry__err_set(eb, -ENOMEM, "kv L2: out of memory for %llu slot records",
                              (unsigned long long)p->nmeta);
    }
    *out = t;
    return 0;
}
