/*
 * store.c - the tiered KV store: index, chunk states, tiers, eviction, and
 * the store / retrieve / lookup / prefetch / pin / delete operations.
 *
 * Design. One hash index maps a chunk id (chunk hash ^ namespace digest of
 * model, TP rank and world, salt) to an entry that records which tiers hold
 * the chunk's bytes and where. One mutex (kv->mu) guards the index, every
 * entry's fields, the tiers' reservations and the policies; it is held for
 * table work only. Bytes move outside it, under one of two protections:
 *  - a WRITING entry belongs to its writer: no reader sees it (lookups and
 *    retrieves treat it as absent) and nothing evicts it;
 *  - a READY entry with readers > 0 (a retrieve in flight, a write-through
 *    or promotion reading it, a pin) is never evicted or deleted.
 * Both protections expire after their TTL (write 600 s, read 300 s) so a
 * writer or pinner that died does not hold memory forever; past it the
 * entry may be reclaimed and its slots reused.
 *
 * Entry lifetime: an entry is either in the index or "doomed" (removed, its
 * tier space released). A doomed entry is freed when the last operation
 * holding a pointer to it (refs) lets go, so nobody ever touches freed
 * memory, and a retrieve that finds its chunk gone reports a miss for
 * exactly that chunk rather than reading bytes that now belong to another.
 *
 * Nothing half-written becomes visible: an entry turns READY only after all
 * its bytes landed (device copies synchronized); if any copy fails, the
 * entries of that call are removed and their slots released.
 *
 * The remote tier (tier_remote.c) never makes the engine wait on the
 * network except for what it asked: a lookup or retrieve that misses
 * locally asks the server once (pipelined) about the rest of the request,
 * and the chunks it reads are promoted into L1 slots like L2's. Its
 * write-throughs are queued on the I/O workers, which hand them to the
 * remote's own bounded queue. A chunk only becomes remote-resident in the
 * index on the server's word (exists), never because a put was queued.
 */
#include <errno.h>
#include <stddef.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry/pslab.h"
#include "dirlock.h"
#include "kv_impl.h"
#include "tier_pslab.h"

#define STACK_CHUNKS 512

int ferry__kv_err(ferry_kv *kv, int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    pthread_mutex_lock(&kv->err_mu);
    int rc = ferry__err_vset(&kv->err, code, fmt, ap);
    pthread_mutex_unlock(&kv->err_mu);
    va_end(ap);
    return rc;
}

int ferry__kv_err_pass(ferry_kv *kv, int code)
{
    pthread_mutex_lock(&kv->err_mu);
    int rc = ferry__err_pass(&kv->err, code);
    pthread_mutex_unlock(&kv->err_mu);
    return rc;
}

static uint64_t now_ns(ferry_kv *kv)
{
    return kv->clock ? kv->clock(kv->clock_ctx) : ferry__now_ns();
}

void ferry__kv_set_clock(ferry_kv *kv, ferry__kv_clock_fn fn, void *ctx)
{
    pthread_mutex_lock(&kv->mu);
    kv->clock = fn;
    kv->clock_ctx = ctx;
    pthread_mutex_unlock(&kv->mu);
}

void ferry__kv_set_tier_fault(ferry_kv *kv, int tier, int write, uint64_t nth, int code,
                              int sticky)
{
    pthread_mutex_lock(&kv->mu);
    ferry__kv_tier *t = tier > 0 && tier < FERRY_KV_TIERS ? kv->tier[tier] : NULL;
    if (t) {
        if (write) {
            atomic_store(&t->n_writes, 0);
            t->fail_write_nth = nth;
        } else {
            atomic_store(&t->n_reads, 0);
            t->fail_read_nth = nth;
        }
        t->fail_code = code ? code : FERRY_EINJECTED;
        t->fail_sticky = sticky;
    }
    pthread_mutex_unlock(&kv->mu);
}

/* the fault seam: the code the nth read or write of t is to fail with, or 0 */
static int tier_fault(ferry_kv *kv, ferry__kv_tier *t, int write, uint64_t loc, size_t len)
{
    uint64_t n = atomic_fetch_add(write ? &t->n_writes : &t->n_reads, 1) + 1;
    pthread_mutex_lock(&kv->mu);
    uint64_t nth = write ? t->fail_write_nth : t->fail_read_nth;
    int code = t->fail_code, sticky = t->fail_sticky;
    pthread_mutex_unlock(&kv->mu);
    if (nth && (n == nth || (sticky && n > nth)))
        return ferry__err_set(NULL, code, "kv %s: injected %s fault at location %llu (%zu bytes)",
                              t->ops->name, write ? "write" : "read", (unsigned long long)loc,
                              len);
    return 0;
}

/* count a finished tier read or write (rc 0 or its code, message set) */
static int tier_io_done(ferry_kv *kv, ferry__kv_tier *t, int write, uint64_t loc,
                        const ferry_kv_hash *id, size_t len, int rc)
{
    if (rc < 0) {
        /* the remote answering "not there" or dropping a write-through
         * while it is down is a miss, counted by that tier, not a failure
         * (and no warning per chunk for as long as it is down) */
        if (t->id == FERRY_KV_TIER_REMOTE &&
            (rc == FERRY_ENOTFOUND || rc == -EAGAIN || rc == FERRY_ENOSPACE))
            return rc;
        atomic_fetch_add(&t->failures, 1);
        atomic_fetch_add(&kv->failures, 1);
        if (rc == FERRY_ECORRUPT)
            atomic_fetch_add(&kv->corrupt, 1);
        /* (a full or failing tier fails at the rate of the I/O) */
        uint64_t quiet = 0;
        if (ferry__warn_ok(&t->warn, &quiet)) {
            if (quiet)
                FERRY_LOGW("kv %s: %s of chunk %016llx%016llx at %llu failed: %s (%llu more "
                           "failures not logged)",
                           t->ops->name, write ? "write" : "read", (unsigned long long)id->hi,
                           (unsigned long long)id->lo, (unsigned long long)loc,
                           ferry_last_error(), (unsigned long long)quiet);
            else
                FERRY_LOGW("kv %s: %s of chunk %016llx%016llx at %llu failed: %s",
                           t->ops->name, write ? "write" : "read", (unsigned long long)id->hi,
                           (unsigned long long)id->lo, (unsigned long long)loc,
                           ferry_last_error());
        }
        return rc;
    }
    atomic_fetch_add(write ? &t->bytes_written : &t->bytes_read, len);
    return 0;
}

/* a tier read or write through the fault seam; outside kv->mu */
static int tier_io(ferry_kv *kv, ferry__kv_tier *t, int write, uint64_t loc,
                   const ferry_kv_hash *id, void *buf, size_t len)
{
    int rc = tier_fault(kv, t, write, loc, len);
    if (rc == 0)
        rc = write ? t->ops->write(t, loc, id, buf, len) : t->ops->read(t, loc, id, buf, len);
    return tier_io_done(kv, t, write, loc, id, len, rc);
}

/* ---- the index (under mu) ---- */

static uint64_t bucket_of(const ferry_kv *kv, ferry_kv_hash id)
{
    return (id.lo ^ (id.hi >> 17)) & (kv->nbuckets - 1);
}

static ferry__kv_entry *find(ferry_kv *kv, ferry_kv_hash id)
{
    for (ferry__kv_entry *e = kv->buckets[bucket_of(kv, id)]; e; e = e->hnext)
        if (e->id.lo == id.lo && e->id.hi == id.hi)
            return e;
    return NULL;
}

static void index_grow(ferry_kv *kv)
{
    uint64_t nb = kv->nbuckets * 2;
    ferry__kv_entry **b = ferry__calloc(nb, sizeof *b);
    if (!b)
        return; /* longer chains, still correct */
    ferry__kv_entry **old = kv->buckets;
    uint64_t onb = kv->nbuckets;
    kv->buckets = b;
    kv->nbuckets = nb;
    for (uint64_t i = 0; i < onb; i++) {
        for (ferry__kv_entry *e = old[i], *next; e; e = next) {
            next = e->hnext;
            uint64_t k = bucket_of(kv, e->id);
            e->hnext = b[k];
            b[k] = e;
        }
    }
    ferry__free(old);
}

static void index_insert(ferry_kv *kv, ferry__kv_entry *e)
{
    if (kv->count >= 2 * kv->nbuckets)
        index_grow(kv);
    uint64_t k = bucket_of(kv, e->id);
    e->hnext = kv->buckets[k];
    kv->buckets[k] = e;
    kv->count++;
}

static void index_remove(ferry_kv *kv, ferry__kv_entry *e)
{
    ferry__kv_entry **pp = &kv->buckets[bucket_of(kv, e->id)];
    while (*pp && *pp != e)
        pp = &(*pp)->hnext;
    if (*pp) {
        *pp = e->hnext;
        kv->count--;
    }
    e->hnext = NULL;
}

/* ---- entry state (under mu) ---- */

static int read_locked(ferry_kv *kv, const ferry__kv_entry *e, uint64_t now)
{
    return e->readers > 0 && now < e->read_deadline;
}

static int write_locked(const ferry__kv_entry *e, uint64_t now)
{
    return e->state == FERRY__KV_WRITING && now < e->write_deadline;
}

static int locked(ferry_kv *kv, const ferry__kv_entry *e, uint64_t now)
{
    return e->l1_loading || e->l2_writing || write_locked(e, now) || read_locked(kv, e, now);
}

/* e is about to go although it holds a lock: the lock outlived its TTL */
static void count_expired(ferry_kv *kv, const ferry__kv_entry *e)
{
    if (e->readers > 0 || e->state == FERRY__KV_WRITING)
        atomic_fetch_add(&kv->lock_expired, 1);
}

static void read_lock(ferry_kv *kv, ferry__kv_entry *e, uint64_t now)
{
    e->readers++;
    uint64_t d = now + kv->read_ttl_ns;
    if (d > e->read_deadline)
        e->read_deadline = d;
}

static void read_unlock(ferry__kv_entry *e)
{
    if (e->readers > 0)
        e->readers--;
}

static void tier_release(ferry_kv *kv, int tier, uint64_t loc)
{
    ferry__kv_tier *t = kv->tier[tier];
    t->ops->release(t, loc);
    t->used--;
}

/* drop one tier's copy of e (policy, space) */
static void drop_tier(ferry_kv *kv, ferry__kv_entry *e, int tier)
{
    if (!(e->resident & (1u << tier)))
        return;
    ferry__kv_tier *t = kv->tier[tier];
    t->policy->ops->remove(t->policy, e);
    tier_release(kv, tier, e->loc[tier]);
    e->resident &= (uint8_t) ~(1u << tier);
}

static void entry_free(ferry_kv *kv, ferry__kv_entry *e)
{
    (void)kv;
    ferry__free(e);
}

/* remove e from the index and every tier; free it when nobody holds it */
static void doom(ferry_kv *kv, ferry__kv_entry *e)
{
    if (e->doomed)
        return;
    for (int t = 1; t < FERRY_KV_TIERS; t++)
        if (kv->tier[t])
            drop_tier(kv, e, t);
    if (e->state == FERRY__KV_WRITING && (e->resident == 0) && e->loc[FERRY_KV_TIER_L1] != UINT64_MAX) {
        /* a writer's reserved (not yet resident) L1 slot: reclaimed with the
         * expired write lock */
        tier_release(kv, FERRY_KV_TIER_L1, e->loc[FERRY_KV_TIER_L1]);
        e->loc[FERRY_KV_TIER_L1] = UINT64_MAX;
    }
    index_remove(kv, e);
    e->doomed = 1;
    if (e->refs == 0) {
        entry_free(kv, e);
        return;
    }
    e->dnext = kv->doomed;
    kv->doomed = e;
}

/* let go of a pointer to e */
static void put(ferry_kv *kv, ferry__kv_entry *e)
{
    if (e->refs > 0)
        e->refs--;
    if (!e->doomed || e->refs)
        return;
    ferry__kv_entry **pp = &kv->doomed;
    while (*pp && *pp != e)
        pp = &(*pp)->dnext;
    if (*pp)
        *pp = e->dnext;
    entry_free(kv, e);
}

typedef struct evict_ctx {
    ferry_kv *kv;
    uint64_t now;
} evict_ctx;

static int evictable(ferry__kv_entry *e, void *ctx)
{
    evict_ctx *c = ctx;
    return e->state == FERRY__KV_READY && !locked(c->kv, e, c->now);
}

/* evict one chunk from tier; 1 when one went */
static int evict_one(ferry_kv *kv, int tier, uint64_t now)
{
    ferry__kv_tier *t = kv->tier[tier];
    evict_ctx c = {kv, now};
    ferry__kv_entry *v = t->policy->ops->victim(t->policy, evictable, &c);
    if (!v)
        return 0;
    /* the policy already unlinked it */
    count_expired(kv, v);
    tier_release(kv, tier, v->loc[tier]);
    v->resident &= (uint8_t) ~(1u << tier);
    atomic_fetch_add(&t->evictions, 1);
    if (!v->resident)
        doom(kv, v);
    return 1;
}

/* reserve room for one chunk in tier, evicting by the watermark and when
 * full. 0 and *loc, or FERRY_ENOSPACE (everything left is locked) / -ENOMEM,
 * or (may_wait) -EAGAIN after waiting for a write-through to free a slot:
 * kv->mu was released, the caller must look its entry up again. */
/* what reserve does when the tier is full and nothing can be evicted */
enum {
    RESERVE_NOW = 0,       /* decline at once (counted as a failure) */
    RESERVE_WAIT = 1,      /* L1: wait for a write-through to free a slot (-EAGAIN: start over) */
    RESERVE_TRY = 2,       /* decline at once, not a failure (a read-ahead that falls back) */
    RESERVE_WAIT_READS = 3 /* RESERVE_WAIT, and for other retrieves' async reads too (only
                              for a caller with no read of its own in flight: those land
                              only when it reaps them) */
};
static int reserve(ferry_kv *kv, int tier, uint64_t now, uint64_t *loc, int may_wait)
{
    ferry__kv_tier *t = kv->tier[tier];
    double cap = (double)t->capacity;
    if ((double)(t->used + 1) >= kv->watermark * cap && (double)t->used > kv->low * cap) {
        while ((double)t->used > kv->low * cap && evict_one(kv, tier, now))
            ;
    }
    for (;;) {
        int rc = t->used < t->capacity ? t->ops->reserve(t, loc) : FERRY_ENOSPACE;
        if (rc == 0) {
            t->used++;
            return 0;
        }
        if (rc == FERRY_ENOSPACE && evict_one(kv, tier, now))
            continue;
        /* L1 full of chunks whose write-through is in flight: those finish
         * without waiting for anyone, so wait for one rather than decline.
         * The mutex was released meanwhile: the caller starts over. */
        if (rc == FERRY_ENOSPACE && tier == FERRY_KV_TIER_L1 &&
            ((may_wait == RESERVE_WAIT && kv->l2_writes_inflight) ||
             (may_wait == RESERVE_WAIT_READS && (kv->l2_writes_inflight || kv->l1_reading)))) {
            pthread_cond_wait(&kv->loaded, &kv->mu);
            return -EAGAIN;
        }
        if (may_wait != RESERVE_TRY)
            atomic_fetch_add(&t->failures, 1);
        return rc;
    }
}

/* ---- streams for device buffers ---- */

static int stream_get(ferry_kv *kv, ferry_stream **out)
{
    pthread_mutex_lock(&kv->mu);
    if (kv->nstreams) {
        *out = kv->streams[--kv->nstreams];
        pthread_mutex_unlock(&kv->mu);
        return 0;
    }
    pthread_mutex_unlock(&kv->mu);
    int rc = ferry_stream_create(kv->dev, out);
    if (rc < 0)
        return ferry__kv_err(kv, rc, "kv: creating a stream on %s: %s",
                              ferry_device_name(kv->dev), ferry_last_error());
    return 0;
}

static void stream_put(ferry_kv *kv, ferry_stream *s)
{
    if (!s)
        return;
    pthread_mutex_lock(&kv->mu);
    if (kv->nstreams == kv->cap_streams) {
        unsigned nc = kv->cap_streams ? 2 * kv->cap_streams : 4;
        ferry_stream **n = ferry__realloc(kv->streams, nc * sizeof *n);
        if (!n) {
            pthread_mutex_unlock(&kv->mu);
            ferry_stream_destroy(s);
            return;
        }
        kv->streams = n;
        kv->cap_streams = nc;
    }
    kv->streams[kv->nstreams++] = s;
    pthread_mutex_unlock(&kv->mu);
}

/* ---- helpers ---- */

static uint32_t chunk_ntok(const ferry_kv *kv, size_t i, size_t n)
{
    uint64_t start = (uint64_t)i * kv->chunk_tokens;
    return (uint32_t)FERRY__MIN((uint64_t)kv->chunk_tokens, n - start);
}

static ferry_kv_hash ns_of(ferry_kv *kv, const ferry_kv_req *req)
{
    if (!req || !req->salt || !req->salt_len)
        return kv->ns0;
    return ferry__kv_namespace(kv->seed, kv->model, kv->tp_rank, kv->tp_world, req->salt,
                               req->salt_len);
}

static int req_ok(ferry_kv *kv, const ferry_kv_req *req, const char *what)
{
    if (req && req->size < sizeof(ferry_kv_req))
        return ferry__kv_err(kv, -EINVAL, "kv %s: request size field %zu is too small",
                              what, req->size);
    if (req && req->salt_len && !req->salt)
        return ferry__kv_err(kv, -EINVAL, "kv %s: salt_len %zu with a NULL salt", what,
                              req->salt_len);
    return 0;
}

/* hash tokens into ids (stack buffer when it fits); *ids must be freed when
 * != stack. Returns the number of chunks or a negative code. */
static int make_ids(ferry_kv *kv, const int32_t *tokens, size_t n, const ferry_kv_req *req,
                    const char *what, ferry_kv_hash *stack, ferry_kv_hash **ids)
{
    int rc = req_ok(kv, req, what);
    if (rc < 0)
        return rc;
    if (!tokens || n == 0)
        return ferry__kv_err(kv, -EINVAL, "kv %s: no tokens (tokens %p, n %zu)", what,
                              (const void *)tokens, n);
    int partial = req && (req->flags & FERRY_KV_PARTIAL);
    size_t nch = n / kv->chunk_tokens + (partial && n % kv->chunk_tokens ? 1 : 0);
    if (nch > INT32_MAX / 2)
        return ferry__kv_err(kv, -EINVAL, "kv %s: %zu tokens is too many", what, n);
    ferry_kv_hash *out = stack;
    if (nch > STACK_CHUNKS) {
        out = ferry__malloc(nch * sizeof *out);
        if (!out)
            return ferry__kv_err(kv, -ENOMEM, "kv %s: out of memory for %zu chunk ids",
                                  what, nch);
    }
    ferry__kv_hash_chain(kv->seed, tokens, n, kv->chunk_tokens, partial, out, nch);
    ferry_kv_hash ns = ns_of(kv, req);
    for (size_t i = 0; i < nch; i++) {
        out[i].lo ^= ns.lo;
        out[i].hi ^= ns.hi;
    }
    *ids = out;
    return (int)nch;
}

static void set_status(const ferry_kv_req *req, size_t i, int code)
{
    if (req && req->status && i < req->max_chunks)
        req->status[i] = code;
}

static void set_tier(const ferry_kv_req *req, size_t i, int tier)
{
    if (req && req->tiers && i < req->max_chunks)
        req->tiers[i] = (uint8_t)tier;
}

/* ---- the remote tier: finding chunks this process never indexed ---- */

/* the tier a lookup reports for e (the nearest holding it) */
static int top_tier(const ferry__kv_entry *e)
{
    return (e->resident & (1u << FERRY_KV_TIER_L1))   ? FERRY_KV_TIER_L1
           : (e->resident & (1u << FERRY_KV_TIER_L2)) ? FERRY_KV_TIER_L2
                                                      : FERRY_KV_TIER_REMOTE;
}

/* usable by a lookup or retrieve: ready, and held by a tier or on its way to L1 */
static int present(const ferry__kv_entry *e)
{
    return e && e->state == FERRY__KV_READY && (e->resident || e->l1_loading);
}

/*
 * Ask the remote which of ids[0..cnt) (chunks first.. of a request of n
 * tokens) it has, counted from the first, and record that in the index:
 * a chunk not indexed gets a READY entry resident in the remote tier only,
 * an indexed ready one gains the remote bit. Stops at a chunk being
 * written here (invisible until its writer commits). One round trip,
 * outside kv->mu; nothing at all while the remote is down. Returns how
 * many leading chunks of ids the remote has and the index now shows.
 */
static size_t remote_discover(ferry_kv *kv, const ferry_kv_hash *ids, size_t cnt, size_t first,
                              size_t n)
{
    ferry__kv_tier *rt = kv->tier[FERRY_KV_TIER_REMOTE];
    if (!rt || !cnt)
        return 0;
    int got = ferry__kv_remote_exists(rt, ids, cnt);
    if (got <= 0)
        return 0;
    size_t i;
    pthread_mutex_lock(&kv->mu);
    uint64_t now = now_ns(kv);
    for (i = 0; i < (size_t)got; i++) {
        ferry__kv_entry *e = find(kv, ids[i]);
        if (e && e->state != FERRY__KV_READY && write_locked(e, now))
            break;
        if (e && (e->resident & (1u << FERRY_KV_TIER_REMOTE)))
            continue;
        if (e && e->state != FERRY__KV_READY) {
            /* a writer that outlived its lock: reclaim its entry */
            atomic_fetch_add(&kv->lock_expired, 1);
            doom(kv, e);
            e = NULL;
        }
        ferry__kv_entry *ne = e ? NULL : ferry__calloc(1, sizeof *ne);
        uint64_t loc;
        if ((!e && !ne) || reserve(kv, FERRY_KV_TIER_REMOTE, now, &loc, RESERVE_NOW) < 0) {
            ferry__free(ne);
            break;
        }
        if (!e) {
            ne->id = ids[i];
            ne->state = FERRY__KV_READY;
            ne->tokens = chunk_ntok(kv, first + i, n);
            for (int t = 0; t < FERRY_KV_TIERS; t++)
                ne->loc[t] = UINT64_MAX;
            index_insert(kv, ne);
            e = ne;
        }
        e->loc[FERRY_KV_TIER_REMOTE] = loc;
        e->resident |= 1u << FERRY_KV_TIER_REMOTE;
        rt->policy->ops->insert(rt->policy, e);
    }
    pthread_mutex_unlock(&kv->mu);
    return i;
}

/* with a remote tier: discover from the first of ids[0..nch) that is not
 * present locally (retrieve and prefetch ask before they read) */
static void remote_discover_missing(ferry_kv *kv, const ferry_kv_hash *ids, size_t nch, size_t n)
{
    if (!kv->tier[FERRY_KV_TIER_REMOTE])
        return;
    size_t first = nch;
    pthread_mutex_lock(&kv->mu);
    for (size_t i = 0; i < nch; i++)
        if (!present(find(kv, ids[i]))) {
            first = i;
            break;
        }
    pthread_mutex_unlock(&kv->mu);
    if (first < nch)
        remote_discover(kv, ids + first, nch - first, first, n);
}

/* ---- lookup ---- */

/* Lookup hashes as it goes, a block of chunks at a time, and stops at the
 * first miss: a cold prompt costs one block of hashing, not all of it.
 * With a remote tier, the first local miss hashes the rest of the prompt
 * and asks the remote about all of it in one round trip, then walks the
 * index once more from there. */
#define LOOKUP_BLOCK 16

/* walk ids[0..cnt) (chunks first..) under mu: count leading present
 * chunks, touching and reporting each; returns how many */
static size_t lookup_walk(ferry_kv *kv, const ferry_kv_hash *ids, size_t cnt, size_t first,
                          size_t n, const ferry_kv_req *req, uint64_t *hits, size_t *tokens)
{
    size_t j;
    for (j = 0; j < cnt; j++) {
        ferry__kv_entry *e = find(kv, ids[j]);
        if (!e || e->state != FERRY__KV_READY || !e->resident)
            break;
        int tier = top_tier(e);
        ferry__kv_tier *t = kv->tier[tier];
        if (t)
            t->policy->ops->touch(t->policy, e);
        hits[tier]++;
        set_tier(req, first + j, tier);
        *tokens += chunk_ntok(kv, first + j, n);
    }
    return j;
}

int ferry_kv_lookup(ferry_kv *kv, const int32_t *tokens, size_t n, const ferry_kv_req *req)
{
    if (!kv)
        return ferry__err_set(NULL, -EINVAL, "kv lookup: store is NULL");
    uint64_t t0 = ferry__now_ns();
    int rc = req_ok(kv, req, "lookup");
    if (rc < 0)
        return rc;
    if (!tokens || n == 0)
        return ferry__kv_err(kv, -EINVAL, "kv lookup: no tokens (tokens %p, n %zu)",
                             (const void *)tokens, n);
    int partial = req && (req->flags & FERRY_KV_PARTIAL);
    size_t nch = n / kv->chunk_tokens + (partial && n % kv->chunk_tokens ? 1 : 0);
    if (nch > INT32_MAX / 2)
        return ferry__kv_err(kv, -EINVAL, "kv lookup: %zu tokens is too many", n);
    ferry_kv_hash ns = ns_of(kv, req), prev = {0, 0}, blk[LOOKUP_BLOCK];
    size_t hit = 0, i = 0, k = 0, got = 0;
    uint64_t hits[FERRY_KV_TIERS] = {0};
    while (i < nch) {
        k = FERRY__MIN((size_t)LOOKUP_BLOCK, nch - i);
        ferry__kv_hash_step(kv->seed, tokens, n, kv->chunk_tokens, i, k, &prev, blk);
        for (size_t j = 0; j < k; j++) {
            blk[j].lo ^= ns.lo;
            blk[j].hi ^= ns.hi;
        }
        pthread_mutex_lock(&kv->mu);
        got = lookup_walk(kv, blk, k, i, n, req, hits, &hit);
        pthread_mutex_unlock(&kv->mu);
        i += got;
        if (got < k)
            break;
    }
    if (i < nch && kv->tier[FERRY_KV_TIER_REMOTE]) {
        /* ids of chunks i..nch: the rest of this block, then hash the rest */
        size_t cnt = nch - i, have = k - got;
        ferry_kv_hash stack[STACK_CHUNKS], *ids = stack;
        if (cnt > STACK_CHUNKS)
            ids = ferry__malloc(cnt * sizeof *ids);
        if (ids) {
            memcpy(ids, blk + got, have * sizeof *ids);
            if (cnt > have)
                ferry__kv_hash_step(kv->seed, tokens, n, kv->chunk_tokens, i + have, cnt - have,
                                    &prev, ids + have);
            for (size_t j = have; j < cnt; j++) {
                ids[j].lo ^= ns.lo;
                ids[j].hi ^= ns.hi;
            }
            remote_discover(kv, ids, cnt, i, n);
            pthread_mutex_lock(&kv->mu);
            i += lookup_walk(kv, ids, cnt, i, n, req, hits, &hit);
            pthread_mutex_unlock(&kv->mu);
            if (ids != stack)
                ferry__free(ids);
        }
    }
    if (i < nch)
        set_tier(req, i, FERRY_KV_TIER_NONE);
    for (int t = 1; t < FERRY_KV_TIERS; t++)
        if (hits[t] && kv->tier[t])
            atomic_fetch_add(&kv->tier[t]->hits, hits[t]);
    atomic_fetch_add(&kv->lookups, 1);
    atomic_fetch_add(&kv->lookup_tokens, n);
    atomic_fetch_add(&kv->hit_tokens, hit);
    ferry__kv_hist_record(&kv->h_lookup, ferry__now_ns() - t0);
    return (int)hit;
}

/* ---- store ---- */

typedef struct pend {
    ferry__kv_entry *e;
    size_t chunk;
    ferry__kv_job *job;  /* write-through, when L2 is configured */
    ferry__kv_job *rjob; /* write-through to the remote tier, when configured */
} pend;

/*
 * Store in batches of at most half of L1: place (reserve slots, WRITING),
 * copy, commit, queue the write-throughs, next batch. A prompt longer than
 * L1 thus streams through it (each batch's write-through overlaps the next
 * batch's copies) instead of needing all its slots at once.
 */
int ferry__kv_do_store(ferry_kv *kv, const ferry_kv_hash *ids, size_t nch, size_t n,
                       const ferry_kv_req *req, const ferry_kv_buffer *buf)
{
    uint64_t t0 = ferry__now_ns();
    atomic_fetch_add(&kv->stores, 1);
    ferry_stream *s = NULL;
    int rc = 0;
    if (buf->mem == FERRY_KV_MEM_DEVICE && (rc = stream_get(kv, &s)) < 0) {
        atomic_fetch_add(&kv->failures, 1);
        return rc;
    }
    ferry__kv_tier *l1 = kv->tier[FERRY_KV_TIER_L1];
    size_t batch_max = (size_t)FERRY__MAX(l1->capacity / 2, 1);
    size_t pcap = FERRY__MIN(nch, batch_max);
    pend *p = ferry__calloc(pcap, sizeof *p);
    int *st = ferry__malloc(nch * sizeof *st);
    if (!p || !st) {
        ferry__free(p);
        ferry__free(st);
        stream_put(kv, s);
        atomic_fetch_add(&kv->failures, 1);
        atomic_fetch_add(&kv->alloc_failures, 1);
        return ferry__kv_err(kv, -ENOMEM, "kv store: out of memory for %zu chunks", nch);
    }
    size_t i;
    int place_rc = 0, copy_rc = 0;
    uint64_t stored = 0;
    for (i = 0; i < nch; i++)
        st[i] = FERRY_ENOTFOUND;
    size_t next = 0;
    while (next < nch && place_rc == 0 && copy_rc == 0) {
        /* 1. place: an L1 slot per missing chunk, WRITING (invisible) */
        size_t np = 0;
        pthread_mutex_lock(&kv->mu);
        uint64_t now = now_ns(kv);
        for (i = next; i < nch && np < batch_max; i++) {
            ferry__kv_entry *e = find(kv, ids[i]);
            if (e && e->state == FERRY__KV_READY) {
                for (int t = 1; t < FERRY_KV_TIERS; t++)
                    if (kv->tier[t] && (e->resident & (1u << t)))
                        kv->tier[t]->policy->ops->touch(kv->tier[t]->policy, e);
                st[i] = 0;
                continue;
            }
            if (e && write_locked(e, now)) {
                st[i] = FERRY_ELOCKED;
                continue;
            }
            if (e) {
                atomic_fetch_add(&kv->lock_expired, 1);
                doom(kv, e);
            }
            ferry__kv_entry *ne = ferry__calloc(1, sizeof *ne);
            if (!ne) {
                place_rc = ferry__kv_err(kv, -ENOMEM,
                                          "kv store: out of memory for the entry of chunk %zu", i);
                break;
            }
            uint64_t loc;
            int r = reserve(kv, FERRY_KV_TIER_L1, now, &loc, RESERVE_WAIT);
            if (r == -EAGAIN) {
                ferry__free(ne);
                now = now_ns(kv);
                i--; /* look chunk i up again: another writer may have placed it */
                continue;
            }
            if (r < 0) {
                ferry__free(ne);
                place_rc = ferry__kv_err(kv, r,
                                          "kv store: no L1 slot for chunk %zu (%llu of %llu slots "
                                          "used, the rest locked)",
                                          i, (unsigned long long)l1->used,
                                          (unsigned long long)l1->capacity);
                break;
            }
            ne->id = ids[i];
            ne->state = FERRY__KV_WRITING;
            ne->write_deadline = now + kv->write_ttl_ns;
            ne->refs = 1;
            ne->tokens = chunk_ntok(kv, i, n);
            for (int t = 0; t < FERRY_KV_TIERS; t++)
                ne->loc[t] = UINT64_MAX;
            ne->loc[FERRY_KV_TIER_L1] = loc;
            index_insert(kv, ne);
            p[np].e = ne;
            p[np].chunk = i;
            p[np].job = NULL;
            p[np].rjob = NULL;
            np++;
        }
        pthread_mutex_unlock(&kv->mu);
        if (place_rc < 0) {
            st[i] = place_rc;
            atomic_fetch_add(&kv->alloc_failures, 1);
            atomic_fetch_add(&kv->failures, 1);
        }
        next = i;

        /* 2. copy the bytes in (device: queued, then one synchronization) */
        for (size_t k = 0; k < np && copy_rc == 0; k++) {
            size_t c = p[k].chunk;
            void *slot = l1->ops->host_ptr(l1, p[k].e->loc[FERRY_KV_TIER_L1]);
            copy_rc = ferry__kv_xfer(buf, kv->chunk_tokens, (uint64_t)c * kv->chunk_tokens,
                                     p[k].e->tokens, slot, 1, s, NULL);
            if (copy_rc < 0)
                ferry__kv_err_pass(kv, copy_rc);
        }
        if (s && np) {
            int r = ferry_stream_sync(s);
            if (r < 0 && copy_rc == 0)
                copy_rc = ferry__kv_err(kv, r,
                                         "kv store: device copies from %s failed: %s",
                                         ferry_device_name(kv->dev), ferry_last_error());
        }
        /* write-through jobs, allocated before taking the lock */
        if (kv->tier[FERRY_KV_TIER_L2] && copy_rc == 0)
            for (size_t k = 0; k < np; k++)
                p[k].job = ferry__calloc(1, sizeof(ferry__kv_job));
        if (kv->tier[FERRY_KV_TIER_REMOTE] && copy_rc == 0)
            for (size_t k = 0; k < np; k++)
                p[k].rjob = ferry__calloc(1, sizeof(ferry__kv_job));

        /* 3. commit: READY (visible), or remove what this batch placed */
        ferry__kv_job *head = NULL, **tail = &head;
        pthread_mutex_lock(&kv->mu);
        now = now_ns(kv);
        for (size_t k = 0; k < np; k++) {
            ferry__kv_entry *e = p[k].e;
            size_t c = p[k].chunk;
            if (copy_rc < 0 || e->doomed) {
                st[c] = copy_rc < 0 ? copy_rc : FERRY_ELOCKED;
                if (!e->doomed) {
                    tier_release(kv, FERRY_KV_TIER_L1, e->loc[FERRY_KV_TIER_L1]);
                    e->loc[FERRY_KV_TIER_L1] = UINT64_MAX;
                    doom(kv, e);
                }
                put(kv, e);
                ferry__free(p[k].job);
                ferry__free(p[k].rjob);
                continue;
            }
            e->state = FERRY__KV_READY;
            e->resident |= 1u << FERRY_KV_TIER_L1;
            l1->policy->ops->insert(l1->policy, e);
            st[c] = 0;
            stored++;
            ferry__kv_job *j = p[k].job;
            uint64_t l2loc;
            if (j && reserve(kv, FERRY_KV_TIER_L2, now, &l2loc, RESERVE_NOW) == 0) {
                e->l2_writing = 1;
                kv->l2_writes_inflight++;
                read_lock(kv, e, now);
                e->refs++;
                j->kind = FERRY__KV_JOB_L2WRITE;
                j->e = e;
                j->l1_loc = e->loc[FERRY_KV_TIER_L1];
                j->l2_loc = l2loc;
                *tail = j;
                tail = &j->next;
            } else {
                ferry__free(j);
            }
            if ((j = p[k].rjob) != NULL) {
                /* the worker hands the L1 copy to the remote's queue; the
                 * slot stays read-locked until then */
                kv->l2_writes_inflight++;
                read_lock(kv, e, now);
                e->refs++;
                j->kind = FERRY__KV_JOB_RWRITE;
                j->e = e;
                j->l1_loc = e->loc[FERRY_KV_TIER_L1];
                *tail = j;
                tail = &j->next;
            }
            put(kv, e);
        }
        pthread_mutex_unlock(&kv->mu);
        for (ferry__kv_job *j = head, *nx; j; j = nx) {
            nx = j->next;
            ferry__kv_enqueue(kv, j);
        }
    }
    stream_put(kv, s);
    atomic_fetch_add(&l1->bytes_written, stored * kv->chunk_bytes);
    atomic_fetch_add(&kv->stored_chunks, stored);
    atomic_fetch_add(&kv->stored_bytes, stored * kv->chunk_bytes);

    size_t lead = 0;
    for (i = 0; i < nch && st[i] == 0; i++)
        lead += chunk_ntok(kv, i, n);
    for (i = 0; i < nch; i++)
        set_status(req, i, st[i]);
    int first = st[0];
    ferry__free(st);
    ferry__free(p);
    ferry__kv_hist_record(&kv->h_store, ferry__now_ns() - t0);
    if (copy_rc < 0) {
        atomic_fetch_add(&kv->failures, 1);
        return copy_rc;
    }
    if (lead == 0 && place_rc < 0 && first == place_rc)
        return place_rc;
    return (int)lead;
}

/* ---- promotion into L1 (retrieve, prefetch) ---- */

/* the nearest tier below L1 holding e, or 0 */
static int lower_tier(const ferry_kv *kv, const ferry__kv_entry *e)
{
    for (int t = FERRY_KV_TIER_L2; t < FERRY_KV_TIERS; t++)
        if (kv->tier[t] && (e->resident & (1u << t)))
            return t;
    return 0;
}

/* under mu, after the read from tier src into the reserved slot finished
 * with rc */
static void promote_finish(ferry_kv *kv, ferry__kv_entry *e, uint64_t slot, int rc, int src)
{
    e->l1_loading = 0;
    pthread_cond_broadcast(&kv->loaded);
    if (rc == 0 && !e->doomed && (e->resident & (1u << src))) {
        ferry__kv_tier *l1 = kv->tier[FERRY_KV_TIER_L1];
        e->loc[FERRY_KV_TIER_L1] = slot;
        e->resident |= 1u << FERRY_KV_TIER_L1;
        l1->policy->ops->insert(l1->policy, e);
        return;
    }
    tier_release(kv, FERRY_KV_TIER_L1, slot);
    if (rc < 0 && !e->doomed) {
        /* that copy is unreadable: without another one the chunk is a miss */
        drop_tier(kv, e, src);
        if (!e->resident)
            doom(kv, e);
    }
}

void ferry__kv_job_run(ferry_kv *kv, ferry__kv_job *j)
{
    ferry__kv_entry *e = j->e;
    ferry__kv_tier *l1 = kv->tier[FERRY_KV_TIER_L1], *l2 = kv->tier[FERRY_KV_TIER_L2];
    void *slot = l1->ops->host_ptr(l1, j->l1_loc);
    if (j->kind == FERRY__KV_JOB_RWRITE) {
        /* a failure is counted (a drop while the remote is down is not a
         * failure); the chunk is not marked remote-resident either way */
        tier_io(kv, kv->tier[FERRY_KV_TIER_REMOTE], 1, 0, &e->id, slot, kv->chunk_bytes);
        pthread_mutex_lock(&kv->mu);
        kv->l2_writes_inflight--;
        pthread_cond_broadcast(&kv->loaded);
        read_unlock(e);
        put(kv, e);
        pthread_mutex_unlock(&kv->mu);
        return;
    }
    if (j->kind == FERRY__KV_JOB_L2WRITE) {
        int rc = tier_io(kv, l2, 1, j->l2_loc, &e->id, slot, kv->slot_bytes);
        pthread_mutex_lock(&kv->mu);
        e->l2_writing = 0;
        kv->l2_writes_inflight--;
        pthread_cond_broadcast(&kv->loaded);
        if (rc == 0 && !e->doomed) {
            e->loc[FERRY_KV_TIER_L2] = j->l2_loc;
            e->resident |= 1u << FERRY_KV_TIER_L2;
            l2->policy->ops->insert(l2->policy, e);
        } else {
            tier_release(kv, FERRY_KV_TIER_L2, j->l2_loc);
        }
        read_unlock(e);
        put(kv, e);
        pthread_mutex_unlock(&kv->mu);
        return;
    }
    /* prefetch: the entry is read-locked, its location in src is stable */
    int src = j->src_tier;
    int rc = tier_io(kv, kv->tier[src], 0, e->loc[src], &e->id, slot, kv->slot_bytes);
    pthread_mutex_lock(&kv->mu);
    promote_finish(kv, e, j->l1_loc, rc, src);
    if (rc == 0)
        atomic_fetch_add(&kv->prefetched, 1);
    kv->prefetch_inflight -= kv->slot_bytes;
    read_unlock(e);
    put(kv, e);
    pthread_mutex_unlock(&kv->mu);
}

/* ---- retrieve ---- */

/*
 * One retrieve. Chunks resolve in any order: a chunk whose bytes are in L1
 * (or on their way there by another operation) is copied out in prompt
 * order; a chunk only in a tier with asynchronous reads (L2) gets an L1
 * slot and is read into it, whole or in the tier's pieces, in prompt
 * order, several requests in flight at once (the tier's depth), and is
 * copied out as soon as its last piece lands, whatever the order, while
 * the later reads go on. Chunks only in a tier without them (the remote,
 * the persistent slab) are read ahead on the I/O workers (prefetch jobs)
 * and copied out in order.
 */
enum { RT_OPEN = 0, RT_READING = 1, RT_LANDED = 2, RT_DONE = 3 };

typedef struct rtv {
    ferry_kv *kv;
    const ferry_kv_buffer *buf;
    ferry_stream *s;
    size_t nch, n;
    ferry__kv_entry **held;     /* read-locked while a copy may still read its slot */
    size_t *hidx;               /* the chunks held, nheld of them */
    ferry__kv_entry **pend;     /* RT_READING: the entry (read-locked, referenced) */
    uint64_t *slot;             /* RT_READING: the L1 slot the read lands in */
    int *st;
    uint8_t *ahead;             /* the tier a worker read-ahead was queued from */
    uint8_t *fate;              /* RT_* */
    int *res;                   /* RT_READING: its first failure; RT_LANDED: the read's result */
    uint8_t *lost;              /* RT_LANDED: lost with a broken queue: 1
                                   pieces may still land (its L1 slot is never
                                   reused), 2 none was in flight */
    /* RT_READING: pieces sent (npieces: all, or no more after a failure),
     * pieces in flight, where from and where to */
    uint32_t *sent, *left;
    uint64_t *aloc;
    char **adst;
    char (*why)[FERRY__ERRMSG_MAX]; /* each chunk's first failure (allocated on the first) */
    size_t cur;                 /* the chunk with pieces still to send, or SIZE_MAX */
    uint64_t piece;             /* bytes per request */
    uint32_t npieces;           /* requests per chunk */
    unsigned reading;           /* chunks RT_READING */
    unsigned pdepth;            /* requests kept in flight */
    uint64_t hits[FERRY_KV_TIERS], misses, got;
    int copy_rc;
    size_t nheld, batch_max;
    ferry__kv_tier *at;         /* the tier whose reads are asynchronous, or NULL */
    ferry__kv_abatch batch;
    unsigned inflight, depth;   /* requests in flight; chunks read at once */
    /* host copy-outs handed to an I/O worker (one at a time), so two CPUs
     * copy while the next reads are in flight: under cmu, the copy's
     * outcome (st, got, copy_rc) and whether one is pending */
    int wcopy;                  /* copies may go to a worker */
    pthread_mutex_t cmu;
    pthread_cond_t ccv;
    unsigned wpending;
    uint64_t vbad;              /* chunks counted as hits that failed their check */
    const void **csrc;          /* chunk i's L1 bytes, for the worker */
} rtv;

/* wait for the device copies of the held chunks (none for host buffers:
 * their copies are done), then drop their read locks. A failed copy fails
 * every chunk it may have touched. */
static void rt_sync(rtv *r)
{
    ferry_kv *kv = r->kv;
    if (r->wcopy) {
        pthread_mutex_lock(&r->cmu);
        while (r->wpending)
            pthread_cond_wait(&r->ccv, &r->cmu);
        pthread_mutex_unlock(&r->cmu);
    }
    if (r->s && r->nheld) {
        int rc = ferry_stream_sync(r->s);
        if (rc < 0) {
            if (r->copy_rc == 0)
                r->copy_rc = ferry__kv_err(kv, rc, "kv retrieve: device copies to %s failed: %s",
                                           ferry_device_name(kv->dev), ferry_last_error());
            for (size_t k = 0; k < r->nheld; k++)
                if (r->st[r->hidx[k]] == 0) {
                    r->st[r->hidx[k]] = r->copy_rc;
                    r->got--;
                }
        }
    }
    pthread_mutex_lock(&kv->mu);
    for (size_t k = 0; k < r->nheld; k++) {
        ferry__kv_entry **h = &r->held[r->hidx[k]];
        read_unlock(*h);
        put(kv, *h);
        *h = NULL;
    }
    pthread_mutex_unlock(&kv->mu);
    r->nheld = 0;
}

/* the copy of chunk i from its L1 bytes into the engine's buffer, and its
 * outcome (under cmu when a worker may run copies too) */
static void rt_copy_chunk(rtv *r, size_t i, const void *src)
{
    ferry_kv *kv = r->kv;
    int rc = ferry__kv_xfer(r->buf, kv->chunk_tokens, (uint64_t)i * kv->chunk_tokens,
                            chunk_ntok(kv, i, r->n), (void *)(uintptr_t)src, 0, r->s, NULL);
    if (r->wcopy)
        pthread_mutex_lock(&r->cmu);
    if (rc < 0) {
        if (r->copy_rc == 0)
            r->copy_rc = ferry__kv_err_pass(kv, rc);
        r->st[i] = rc;
    } else {
        r->st[i] = 0;
        r->got++;
    }
    if (r->wcopy)
        pthread_mutex_unlock(&r->cmu);
}

/* a copy failed (the first failure's code), read safely while a worker copies */
static int rt_failed(rtv *r)
{
    if (!r->wcopy)
        return r->copy_rc;
    pthread_mutex_lock(&r->cmu);
    int rc = r->copy_rc;
    pthread_mutex_unlock(&r->cmu);
    return rc;
}

/* a worker's copy job */
/* chunk i's read lock goes once its host copy is done */
static void rt_release(rtv *r, size_t i)
{
    ferry_kv *kv = r->kv;
    pthread_mutex_lock(&kv->mu);
    read_unlock(r->held[i]);
    put(kv, r->held[i]);
    r->held[i] = NULL;
    pthread_mutex_unlock(&kv->mu);
}

/* one of this retrieve's copy jobs finished on a worker */
static void rt_job_done(rtv *r)
{
    pthread_mutex_lock(&r->cmu);
    r->wpending--;
    pthread_cond_broadcast(&r->ccv);
    pthread_mutex_unlock(&r->cmu);
}

/* a worker's copy job: the copy, then the chunk's read lock */
static void rt_copy_job(void *ctx, size_t i)
{
    rtv *r = ctx;
    rt_copy_chunk(r, i, r->csrc[i]);
    rt_release(r, i);
    rt_job_done(r);
}

/*
 * Host buffer: the I/O workers take a retrieve's copies while they are
 * free for them (nothing queued, fewer of ours pending than workers), so
 * the retrieving thread goes straight back to the reads. 1: chunk i's copy
 * was queued as job(r, i); 0: no worker is free, the caller copies.
 */
static int rt_hand_off(rtv *r, size_t i, void (*job)(void *ctx, size_t i))
{
    if (!r->wcopy)
        return 0;
    pthread_mutex_lock(&r->cmu);
    unsigned mine = r->wpending;
    pthread_mutex_unlock(&r->cmu);
    ferry__kv_job *j =
        ferry__kv_io_worker_free(r->kv, mine) ? ferry__calloc(1, sizeof *j) : NULL;
    if (!j)
        return 0;
    j->kind = FERRY__KV_JOB_COPY;
    j->copy = job;
    j->ctx = r;
    j->idx = i;
    pthread_mutex_lock(&r->cmu);
    r->wpending++;
    pthread_mutex_unlock(&r->cmu);
    ferry__kv_enqueue(r->kv, j);
    return 1;
}

/* chunk i, read-locked and resident in L1, into the engine's buffer.
 * Called with kv->mu held; returns with it released. */
static void rt_copy_out(rtv *r, size_t i, ferry__kv_entry *e)
{
    ferry_kv *kv = r->kv;
    ferry__kv_tier *l1 = kv->tier[FERRY_KV_TIER_L1];
    l1->policy->ops->touch(l1->policy, e);
    void *src = l1->ops->host_ptr(l1, e->loc[FERRY_KV_TIER_L1]);
    pthread_mutex_unlock(&kv->mu);
    r->held[i] = e;
    if (!r->s) {
        /* host buffer: a free worker copies, else this thread. Each copy
         * drops its chunk's read lock when done, so a retrieve holds no
         * more slots than copies running. */
        if (r->csrc)
            r->csrc[i] = src;
        if (rt_hand_off(r, i, rt_copy_job))
            return;
        rt_copy_chunk(r, i, src);
        rt_release(r, i);
        return;
    }
    r->hidx[r->nheld++] = i;
    rt_copy_chunk(r, i, src);
    /* device copies hold their read locks until the next synchronization,
     * every half of L1, so a prompt longer than L1 streams through it */
    if (r->nheld >= r->batch_max)
        rt_sync(r);
}

/* chunk i landed in its L1 slot from the async tier: is it the chunk that
 * was written there (sum: its image's checksum)? A mismatch is counted and
 * logged as a failed read of the tier */
static int rt_check(rtv *r, size_t i, const ferry__kv_entry *e, uint64_t sum)
{
    ferry__kv_tier *t = r->at;
    int rc = t->aops->verify(t, r->aloc[i], &e->id, sum);
    if (rc < 0)
        tier_io_done(r->kv, t, 0, r->aloc[i], &e->id, 0, rc);
    return rc;
}

/*
 * A whole chunk that landed from the async tier into a host buffer: copied
 * out while it is checksummed (ferry__kv_xfer_out_sum), and only then
 * promoted into L1, so no one else ever reads its slot before the check
 * passed. A chunk that fails it is a miss whose L1 slot and L2 copy go.
 * Either thread may run it (a worker's copy job, or the retrieving thread).
 */
static void rt_verify_copy(rtv *r, size_t i)
{
    ferry_kv *kv = r->kv;
    ferry__kv_tier *t = r->at;
    ferry__kv_entry *e = r->held[i];
    uint64_t sum = 0;
    int rc = ferry__kv_xfer_out_sum(r->buf, kv->chunk_tokens, (uint64_t)i * kv->chunk_tokens,
                                    r->adst[i], &sum);
    if (rc < 0) /* (host copies do not fail; the slot is still checked) */
        sum = ferry__kv_sum(r->adst[i], kv->chunk_bytes);
    int vrc = rt_check(r, i, e, sum);
    if (vrc < 0 && rc == 0) /* the engine never holds the bad bytes */
        ferry__kv_xfer_out_zero(r->buf, kv->chunk_tokens, (uint64_t)i * kv->chunk_tokens,
                                kv->chunk_tokens);
    pthread_mutex_lock(&kv->mu);
    kv->l1_reading--;
    promote_finish(kv, e, r->slot[i], vrc, t->id); /* (wakes reserve's waiters) */
    read_unlock(e);
    put(kv, e);
    r->held[i] = NULL;
    pthread_mutex_unlock(&kv->mu);
    if (r->wcopy)
        pthread_mutex_lock(&r->cmu);
    if (rc < 0) {
        if (r->copy_rc == 0)
            r->copy_rc = ferry__kv_err_pass(kv, rc);
        r->st[i] = rc;
    } else if (vrc < 0) {
        r->st[i] = vrc;
        r->vbad++;
    } else {
        r->st[i] = 0;
        r->got++;
    }
    if (r->wcopy)
        pthread_mutex_unlock(&r->cmu);
}

static void rt_verify_job(void *ctx, size_t i)
{
    rtv *r = ctx;
    rt_verify_copy(r, i);
    rt_job_done(r);
}

/* hand rt_verify_copy of chunk i (entry e, read-locked) to a free worker,
 * else run it here. Called with kv->mu held; returns with it released. */
static void rt_verify_out(rtv *r, size_t i, ferry__kv_entry *e)
{
    pthread_mutex_unlock(&r->kv->mu);
    r->held[i] = e;
    if (!rt_hand_off(r, i, rt_verify_job))
        rt_verify_copy(r, i);
}

static void rt_read_done(rtv *r, size_t i, int rc);

/* chunk i's read is over (every piece sent has landed): count it */
/* chunk i's first failure: its code and message (the message is logged
 * when the chunk's last piece lands, after other chunks' failures) */
static void rt_fail(rtv *r, size_t i, int rc, const char *why)
{
    if (r->res[i] != 0 && r->res[i] != -ENOMEM)
        return;
    if (r->res[i] == -ENOMEM && rc == -ENOMEM)
        return;
    r->res[i] = rc;
    if (!r->why)
        r->why = ferry__calloc(r->nch, sizeof *r->why);
    if (r->why)
        snprintf(r->why[i], sizeof r->why[i], "%s", why ? why : ferry_strerror(rc));
}

/* chunk i's read is over (every piece sent has landed): count it; out of
 * memory for a request is a miss here, not a failure of the tier */
static void rt_landed(rtv *r, size_t i)
{
    ferry__kv_tier *t = r->at;
    int rc = r->res[i];
    if (rc == -ENOMEM && r->lost[i] == 2) {
        atomic_fetch_add(&r->kv->failures, 1); /* ours, not the tier's */
    } else {
        if (rc < 0 && r->why && r->why[i][0])
            ferry__err_set(NULL, rc, "%s", r->why[i]);
        tier_io_done(r->kv, t, 0, r->aloc[i], &r->pend[i]->id, t->slot_bytes, rc);
    }
    r->fate[i] = RT_LANDED;
    r->reading--;
}

/* send the next piece of chunk i (a: its request, or NULL to take one);
 * a failure ends its read (the pieces in flight still land) */
static void rt_send(rtv *r, size_t i, ferry__kv_aread *a)
{
    ferry_kv *kv = r->kv;
    ferry__kv_tier *t = r->at;
    uint64_t off = (uint64_t)r->sent[i] * r->piece;
    size_t len = (size_t)FERRY__MIN(r->piece, t->slot_bytes - off);
    if (!a)
        a = t->aops->get(t);
    int rc = a ? 0 : ferry__err_set(NULL, -ENOMEM, "kv L2: out of memory for a read request");
    if (rc == 0 && r->sent[i] == 0)
        rc = tier_fault(kv, t, 0, r->aloc[i], t->slot_bytes);
    if (rc == 0) {
        a->idx = i;
        rc = t->aops->submit(t, &r->batch, a, r->aloc[i] + off, r->adst[i] + off, len);
    }
    if (rc == 0) {
        r->inflight++;
        r->left[i]++;
        if (++r->sent[i] == r->npieces)
            r->cur = SIZE_MAX;
        return;
    }
    t->aops->put(t, a);
    rt_fail(r, i, rc, ferry_last_error());
    r->sent[i] = r->npieces;
    r->cur = SIZE_MAX;
    /* the queue broke, or memory ran out: not this chunk's L2 copy, which
     * is kept, and its slot goes back once the pieces in flight landed
     * (a break with pieces still in flight makes rt_reap retire it) */
    if ((t->aops->broken && t->aops->broken(t)) || rc == -ENOMEM)
        r->lost[i] = 2;
    if (r->left[i] == 0) {
        rt_landed(r, i);
        rt_read_done(r, i, r->res[i]);
    }
}

/* start the asynchronous read of chunk i when it is only in the async
 * tier (its pieces go out through rt_send): 1 started, 0 not such a
 * chunk, -1 no room for it in L1 now */
static int rt_issue(rtv *r, const ferry_kv_hash *ids, size_t i)
{
    ferry_kv *kv = r->kv;
    ferry__kv_tier *t = r->at;
    if (t->aops->broken && t->aops->broken(t))
        return 0; /* the queue broke: the synchronous path reads it */
    ferry__kv_aread *a = t->aops->get(t); /* the first piece's, before the slot */
    if (!a)
        return -1;
    pthread_mutex_lock(&kv->mu);
    uint64_t now = now_ns(kv);
    ferry__kv_entry *e = find(kv, ids[i]);
    if (!e || e->state != FERRY__KV_READY || !e->resident ||
        (e->resident & (1u << FERRY_KV_TIER_L1)) || e->l1_loading ||
        kv->tier[lower_tier(kv, e)] != t) {
        pthread_mutex_unlock(&kv->mu);
        t->aops->put(t, a);
        return 0;
    }
    uint64_t slot;
    if (reserve(kv, FERRY_KV_TIER_L1, now, &slot, RESERVE_TRY) < 0) {
        pthread_mutex_unlock(&kv->mu);
        t->aops->put(t, a);
        return -1;
    }
    e->l1_loading = 1;
    kv->l1_reading++;
    read_lock(kv, e, now);
    e->refs++;
    r->aloc[i] = e->loc[t->id];
    ferry__kv_tier *l1 = kv->tier[FERRY_KV_TIER_L1];
    r->adst[i] = l1->ops->host_ptr(l1, slot);
    pthread_mutex_unlock(&kv->mu);
    r->fate[i] = RT_READING;
    r->pend[i] = e;
    r->slot[i] = slot;
    r->cur = i;
    r->reading++;
    uint64_t peak = atomic_load(&t->aread_peak);
    while (r->reading > peak && !atomic_compare_exchange_weak(&t->aread_peak, &peak, r->reading))
        ;
    rt_send(r, i, a);
    return 1;
}

/* chunk i's read finished with rc: promote it, copy it out (or count the miss) */
static void rt_read_done(rtv *r, size_t i, int rc)
{
    ferry_kv *kv = r->kv;
    ferry__kv_entry *e = r->pend[i];
    r->pend[i] = NULL;
    r->fate[i] = RT_DONE;
    /* its bytes count only once checked against what was written there:
     * a whole chunk for a host buffer is checked as it is copied out, and
     * promoted after; any other is checked here, before it is promoted */
    int deferred = 0;
    if (rc == 0 && !r->lost[i] && r->at->aops->verify) {
        if (!r->s && chunk_ntok(kv, i, r->n) == kv->chunk_tokens && rt_failed(r) == 0)
            deferred = 1;
        else if ((rc = rt_check(r, i, e, ferry__kv_sum(r->adst[i], kv->chunk_bytes))) < 0)
            r->st[i] = rc;
    }
    pthread_mutex_lock(&kv->mu);
    if (deferred) {
        r->hits[r->at->id]++; /* (taken back if the check fails) */
        rt_verify_out(r, i, e);
        return;
    }
    kv->l1_reading--;
    if (r->lost[i] == 2) {
        /* the queue broke before any piece of it was in flight: its slot
         * goes back, its L2 copy is kept, the chunk is a miss here */
        e->l1_loading = 0;
        tier_release(kv, FERRY_KV_TIER_L1, r->slot[i]);
        pthread_cond_broadcast(&kv->loaded);
        r->misses++;
        read_unlock(e);
        put(kv, e);
        pthread_mutex_unlock(&kv->mu);
        return;
    }
    if (r->lost[i]) {
        /* the read may still land, into its slot: the slot stays reserved
         * for good (L1 is one slot smaller), the L2 copy is kept (the disk
         * did not fail, the queue did), and the chunk is a miss here */
        e->l1_loading = 0;
        kv->l1_retired++;
        pthread_cond_broadcast(&kv->loaded);
        FERRY_LOGW("kv retrieve: the L2 read queue broke with a read in flight; its L1 slot "
                   "%llu is retired", (unsigned long long)r->slot[i]);
        r->misses++;
        read_unlock(e);
        put(kv, e);
        pthread_mutex_unlock(&kv->mu);
        return;
    }
    promote_finish(kv, e, r->slot[i], rc, r->at->id); /* (wakes reserve's waiters) */
    int failed = rt_failed(r);
    if (failed < 0 || !(e->resident & (1u << FERRY_KV_TIER_L1))) {
        if (failed == 0)
            r->misses++;
        read_unlock(e);
        put(kv, e);
        pthread_mutex_unlock(&kv->mu);
        return;
    }
    r->hits[r->at->id]++;
    rt_copy_out(r, i, e);
}

/* wait until at least one of this retrieve's requests landed (none when
 * none is in flight); chunks whose every piece has landed become
 * RT_LANDED with their result in r->res; returns how many did */
static unsigned rt_reap(rtv *r)
{
    ferry__kv_tier *t = r->at;
    ferry__kv_aread *a = NULL;
    int rc = t->aops->wait(t, &r->batch, &a);
    unsigned k = 0;
    if (rc < 0) {
        /* the tier's queue broke: every read of ours still in flight is lost */
        ferry__kv_err_pass(r->kv, rc);
        for (size_t i = 0; i < r->nch; i++) {
            if (r->fate[i] != RT_READING)
                continue;
            r->res[i] = 0; /* the break is what this chunk's warning says */
            rt_fail(r, i, rc, ferry_last_error());
            r->lost[i] = r->left[i] ? 1 : 2;
            rt_landed(r, i);
            k++;
        }
        r->inflight = 0;
        r->cur = SIZE_MAX;
        return k;
    }
    for (ferry__kv_aread *next; a; a = next) {
        next = a->next;
        size_t i = a->idx;
        rc = a->result;
        if (rc < 0) {
            /* the read itself failed (whatever its code): that copy is
             * unreadable after all, even if a request of this chunk ran
             * out of memory or the queue broke since */
            if (r->res[i] == -ENOMEM && r->lost[i] == 2)
                r->res[i] = 0; /* (that was ours, this is the disk's) */
            rt_fail(r, i, rc, a->why);
            r->lost[i] = 0;
        }
        t->aops->put(t, a);
        r->inflight--;
        r->left[i]--;
        if (rc < 0) {
            /* its pieces not sent yet never are */
            r->sent[i] = r->npieces;
            if (r->cur == i)
                r->cur = SIZE_MAX;
        }
        if (r->left[i] == 0 && r->sent[i] == r->npieces) {
            rt_landed(r, i);
            k++;
        }
    }
    return k;
}

/* keep pdepth requests in flight: the rest of the chunk being sent, then
 * (at most depth chunks at once) chunks from the first open chunk k on
 * (*ic: the next chunk to consider; *blocked: L1 had no room, the rest in
 * order). A chunk started is always sent whole, so its read finishes. */
static void rt_fill(rtv *r, const ferry_kv_hash *ids, size_t k, size_t *ic, int *blocked)
{
    if (!r->at)
        return;
    if (*ic < k)
        *ic = k;
    while (r->inflight < r->pdepth) {
        if (r->cur != SIZE_MAX) {
            rt_send(r, r->cur, NULL);
            continue;
        }
        if (*blocked || r->reading >= r->depth || *ic >= r->nch || rt_failed(r) < 0)
            return;
        if (r->fate[*ic] == RT_OPEN && rt_issue(r, ids, *ic) < 0) {
            *blocked = 1;
            return;
        }
        (*ic)++;
    }
}

static size_t prefetch_ids(ferry_kv *kv, const ferry_kv_hash *ids, size_t nch, size_t n,
                           int leading, uint8_t *queued);

/* chunk i in prompt order, from wherever it is: 1 resolved, 0 start it
 * over, -1 no L1 room until this retrieve's own reads in flight land */
static int rt_one(rtv *r, const ferry_kv_hash *ids, size_t i)
{
    ferry_kv *kv = r->kv;
    ferry__kv_tier *l1 = kv->tier[FERRY_KV_TIER_L1];
    pthread_mutex_lock(&kv->mu);
    ferry__kv_entry *e;
    uint64_t now;
    for (;;) {
        now = now_ns(kv);
        e = find(kv, ids[i]);
        if (!e || e->state != FERRY__KV_READY || !e->l1_loading)
            break;
        pthread_cond_wait(&kv->loaded, &kv->mu);
    }
    if (!e || e->state != FERRY__KV_READY || !e->resident) {
        pthread_mutex_unlock(&kv->mu);
        r->misses++;
        return 1;
    }
    read_lock(kv, e, now);
    e->refs++;
    if (!(e->resident & (1u << FERRY_KV_TIER_L1))) {
        /* only in a lower tier: promote into a fresh L1 slot */
        uint64_t slot;
        int src = lower_tier(kv, e);
        /* with copies of ours on the workers, only try: if L1 is full
         * this chunk waits for one of them below, no failure counted */
        unsigned copying = 0;
        if (src && r->wcopy) {
            pthread_mutex_lock(&r->cmu);
            copying = r->wpending;
            pthread_mutex_unlock(&r->cmu);
        }
        int rc = src ? reserve(kv, FERRY_KV_TIER_L1, now, &slot,
                               copying       ? RESERVE_TRY
                               : r->inflight ? RESERVE_WAIT
                                             : RESERVE_WAIT_READS)
                     : FERRY_ENOTFOUND;
        if (rc == -EAGAIN) {
            /* the mutex was released: start this chunk over */
            read_unlock(e);
            put(kv, e);
            pthread_mutex_unlock(&kv->mu);
            return 0;
        }
        if (rc == FERRY_ENOSPACE && r->inflight) {
            /* L1 is full and some of it is our own reads in flight: they
             * land (and free their locks) before this chunk is tried again */
            read_unlock(e);
            put(kv, e);
            pthread_mutex_unlock(&kv->mu);
            return -1;
        }
        if (rc == FERRY_ENOSPACE && copying) {
            /* or our own copies on the workers hold the slots: one of them
             * finishes (and drops its lock), then the chunk starts over
             * (only this thread adds copies, so the count only falls) */
            read_unlock(e);
            put(kv, e);
            pthread_mutex_unlock(&kv->mu);
            pthread_mutex_lock(&r->cmu);
            while (r->wpending >= copying)
                pthread_cond_wait(&r->ccv, &r->cmu);
            pthread_mutex_unlock(&r->cmu);
            return 0;
        }
        if (rc < 0) {
            read_unlock(e);
            put(kv, e);
            pthread_mutex_unlock(&kv->mu);
            r->st[i] = rc == FERRY_ENOTFOUND ? rc : FERRY_ENOSPACE;
            r->misses++;
            return 1;
        }
        e->l1_loading = 1;
        uint64_t srcloc = e->loc[src];
        pthread_mutex_unlock(&kv->mu);
        rc = tier_io(kv, kv->tier[src], 0, srcloc, &e->id, l1->ops->host_ptr(l1, slot),
                     kv->slot_bytes);
        pthread_mutex_lock(&kv->mu);
        promote_finish(kv, e, slot, rc, src);
        if (!(e->resident & (1u << FERRY_KV_TIER_L1))) {
            read_unlock(e);
            put(kv, e);
            pthread_mutex_unlock(&kv->mu);
            if (rc == FERRY_ECORRUPT)
                r->st[i] = rc;
            r->misses++;
            return 1;
        }
        r->hits[src]++;
    } else {
        r->hits[r->ahead[i] ? r->ahead[i] : FERRY_KV_TIER_L1]++;
    }
    rt_copy_out(r, i, e);
    return 1;
}

/* the retrieve's per-chunk arrays (any of them may be NULL) */
static void rt_free(rtv *r)
{
    void *a[] = {r->held, r->hidx, r->pend, r->slot, r->st,   r->ahead, r->fate, r->res,
                 r->lost, r->sent, r->left, r->aloc, r->adst, r->why,   r->csrc};
    for (size_t k = 0; k < FERRY__ARRAY_LEN(a); k++)
        ferry__free(a[k]);
}

int ferry__kv_do_retrieve(ferry_kv *kv, const ferry_kv_hash *ids, size_t nch, size_t n,
                          const ferry_kv_req *req, const ferry_kv_buffer *buf)
{
    uint64_t t0 = ferry__now_ns();
    atomic_fetch_add(&kv->retrieves, 1);
    rtv r = {0};
    r.kv = kv;
    r.buf = buf;
    r.nch = nch;
    r.n = n;
    int rc = 0;
    if (buf->mem == FERRY_KV_MEM_DEVICE && (rc = stream_get(kv, &r.s)) < 0) {
        atomic_fetch_add(&kv->failures, 1);
        return rc;
    }
    r.held = ferry__calloc(nch, sizeof *r.held);
    r.hidx = ferry__malloc(nch * sizeof *r.hidx);
    r.pend = ferry__calloc(nch, sizeof *r.pend);
    r.slot = ferry__calloc(nch, sizeof *r.slot);
    r.st = ferry__malloc(nch * sizeof *r.st);
    r.ahead = ferry__calloc(nch, 1);
    r.fate = ferry__calloc(nch, 1);
    r.res = ferry__calloc(nch, sizeof *r.res);
    r.lost = ferry__calloc(nch, 1);
    r.sent = ferry__calloc(nch, sizeof *r.sent);
    r.left = ferry__calloc(nch, sizeof *r.left);
    r.aloc = ferry__calloc(nch, sizeof *r.aloc);
    r.adst = ferry__calloc(nch, sizeof *r.adst);
    r.cur = SIZE_MAX;
    if (!r.held || !r.hidx || !r.pend || !r.slot || !r.st || !r.ahead || !r.fate || !r.res ||
        !r.lost || !r.sent || !r.left || !r.aloc || !r.adst) {
        rt_free(&r);
        stream_put(kv, r.s);
        atomic_fetch_add(&kv->failures, 1);
        return ferry__kv_err(kv, -ENOMEM, "kv retrieve: out of memory for %zu chunks", nch);
    }
    ferry__kv_tier *l1 = kv->tier[FERRY_KV_TIER_L1];
    for (size_t i = 0; i < nch; i++)
        r.st[i] = FERRY_ENOTFOUND;
    r.batch_max = (size_t)FERRY__MAX(l1->capacity / 2, 1);
    /* asynchronous reads: at most a quarter of L1 in flight, so they never
     * crowd out the slots the copies hold */
    r.at = kv->tier[FERRY_KV_TIER_L2] && kv->tier[FERRY_KV_TIER_L2]->aops
               ? kv->tier[FERRY_KV_TIER_L2]
               : NULL;
    if (r.at) {
        r.depth = (unsigned)FERRY__MIN((uint64_t)r.at->aops->depth,
                                       FERRY__MAX(l1->capacity / 4, 1));
        r.piece = r.at->apiece && r.at->apiece < r.at->slot_bytes ? r.at->apiece
                                                                   : r.at->slot_bytes;
        r.npieces = (uint32_t)((r.at->slot_bytes + r.piece - 1) / r.piece);
        r.pdepth = r.npieces > 1 ? r.at->aops->pdepth : r.depth;
    }
    /* several chunks landing from L2 into a host buffer: the I/O workers
     * copy them out while this thread keeps the reads going */
    if (r.at && !r.s && nch > 1 && (r.csrc = ferry__calloc(nch, sizeof *r.csrc)) != NULL) {
        r.wcopy = 1;
        pthread_mutex_init(&r.cmu, NULL);
        pthread_cond_init(&r.ccv, NULL);
    }
    /* read ahead on the workers from the tiers without asynchronous reads */
    int lower = 0;
    for (int t = FERRY_KV_TIER_L2; t < FERRY_KV_TIERS; t++)
        lower |= kv->tier[t] != NULL && kv->tier[t] != r.at;
    remote_discover_missing(kv, ids, nch, n);
    if (lower)
        prefetch_ids(kv, ids, nch, n, 0, r.ahead);
    size_t k = 0, ic = 0;
    int blocked = 0;
    while (k < nch) {
        if (r.fate[k] == RT_DONE) {
            k++;
            continue;
        }
        if (r.fate[k] == RT_OPEN && rt_failed(&r) < 0) {
            r.fate[k++] = RT_DONE;
            continue;
        }
        rt_fill(&r, ids, k, &ic, &blocked);
        if (r.fate[k] == RT_READING || r.fate[k] == RT_LANDED) {
            /* take what landed, refill, then copy those out (in landing
             * order, not prompt order) while the new reads go on */
            if (r.fate[k] == RT_READING) {
                rt_reap(&r);
                rt_fill(&r, ids, k, &ic, &blocked);
            }
            for (size_t j = k; j < ic; j++)
                if (r.fate[j] == RT_LANDED)
                    rt_read_done(&r, j, r.res[j]);
            continue;
        }
        if (blocked && r.inflight) {
            /* L1 is full: our own reads land first (their slots then hold
             * promoted, unlocked chunks), and read-ahead is tried again */
            if (rt_reap(&r))
                for (size_t j = k; j < ic; j++)
                    if (r.fate[j] == RT_LANDED)
                        rt_read_done(&r, j, r.res[j]);
            blocked = 0;
            continue;
        }
        /* top the workers' read-ahead up as earlier reads land: chunks past
         * the prefetch budget get queued once room frees, instead of being
         * read here one at a time (chunks queued or in L1 are skipped) */
        if (lower && k > 0 && k + 1 < nch)
            prefetch_ids(kv, ids + k + 1, nch - k - 1, n - (k + 1) * kv->chunk_tokens, 0,
                         r.ahead + k + 1);
        int one = rt_one(&r, ids, k);
        if (one > 0) {
            r.fate[k++] = RT_DONE;
            blocked = 0; /* its slot's lock is gone (or goes with its copy
                            on a worker): read ahead again */
        } else if (one < 0)
            blocked = 1; /* no room: reap our reads, then try again */
    }
    while (r.inflight) /* cannot be: every read was waited for above */
        for (unsigned got = rt_reap(&r); got; got = 0)
            for (size_t j = 0; j < nch; j++)
                if (r.fate[j] == RT_LANDED)
                    rt_read_done(&r, j, r.res[j]);
    rt_sync(&r);
    if (r.vbad && r.at) {
        r.hits[r.at->id] -= r.vbad;
        r.misses += r.vbad;
    }
    if (r.wcopy) {
        pthread_mutex_destroy(&r.cmu);
        pthread_cond_destroy(&r.ccv);
    }
    stream_put(kv, r.s);
    for (int t = 1; t < FERRY_KV_TIERS; t++)
        if (r.hits[t] && kv->tier[t])
            atomic_fetch_add(&kv->tier[t]->hits, r.hits[t]);
    atomic_fetch_add(&l1->bytes_read, r.got * kv->chunk_bytes);
    atomic_fetch_add(&kv->misses, r.misses);
    atomic_fetch_add(&kv->retrieved_chunks, r.got);
    atomic_fetch_add(&kv->retrieved_bytes, r.got * kv->chunk_bytes);
    size_t lead = 0;
    for (size_t i = 0; i < nch && r.st[i] == 0; i++)
        lead += chunk_ntok(kv, i, n);
    for (size_t i = 0; i < nch; i++)
        set_status(req, i, r.st[i]);
    rt_free(&r);
    ferry__kv_hist_record(&kv->h_retrieve, ferry__now_ns() - t0);
    if (r.copy_rc < 0) {
        atomic_fetch_add(&kv->failures, 1);
        return r.copy_rc;
    }
    return (int)lead;
}

/* ---- the public blocking forms ---- */

static int prepare(ferry_kv *kv, const int32_t *tokens, size_t n, const ferry_kv_req *req,
                   const ferry_kv_buffer *buf, const char *what, ferry_kv_hash *stack,
                   ferry_kv_hash **ids)
{
    int nch = make_ids(kv, tokens, n, req, what, stack, ids);
    if (nch < 0)
        return nch;
    int rc = ferry__kv_buffer_check(buf, &kv->layout, kv->dev, n, what, NULL);
    if (rc < 0) {
        ferry__kv_err_pass(kv, rc);
        if (*ids != stack)
            ferry__free(*ids);
        return rc;
    }
    return nch;
}

int ferry_kv_store(ferry_kv *kv, const int32_t *tokens, size_t n, const ferry_kv_req *req,
                   const ferry_kv_buffer *src)
{
    if (!kv)
        return ferry__err_set(NULL, -EINVAL, "kv store: store is NULL");
    ferry_kv_hash stack[STACK_CHUNKS], *ids = NULL;
    int nch = prepare(kv, tokens, n, req, src, "store", stack, &ids);
    if (nch < 0)
        return nch;
    int rc = nch ? ferry__kv_do_store(kv, ids, (size_t)nch, n, req, src) : 0;
    if (ids != stack)
        ferry__free(ids);
    return rc;
}

int ferry_kv_retrieve(ferry_kv *kv, const int32_t *tokens, size_t n, const ferry_kv_req *req,
                      const ferry_kv_buffer *dst)
{
    if (!kv)
        return ferry__err_set(NULL, -EINVAL, "kv retrieve: store is NULL");
    ferry_kv_hash stack[STACK_CHUNKS], *ids = NULL;
    int nch = prepare(kv, tokens, n, req, dst, "retrieve", stack, &ids);
    if (nch < 0)
        return nch;
    int rc = nch ? ferry__kv_do_retrieve(kv, ids, (size_t)nch, n, req, dst) : 0;
    if (ids != stack)
        ferry__free(ids);
    return rc;
}

static int op_submit(ferry_kv *kv, int kind, const int32_t *tokens, size_t n,
                     const ferry_kv_req *req, const ferry_kv_buffer *buf, ferry_kv_op **out)
{
    const char *what = kind == FERRY__KV_OP_STORE ? "store_async" : "retrieve_async";
    if (!kv || !out)
        return kv ? ferry__kv_err(kv, -EINVAL, "kv %s: store or op is NULL", what)
                  : ferry__err_set(NULL, -EINVAL, "kv %s: store or op is NULL", what);
    ferry_kv_hash stack[STACK_CHUNKS], *ids = NULL;
    int nch = prepare(kv, tokens, n, req, buf, what, stack, &ids);
    if (nch < 0)
        return nch;
    ferry_kv_op *op = ferry__calloc(1, sizeof *op);
    ferry__kv_job *j = ferry__calloc(1, sizeof *j);
    ferry_kv_hash *copy = nch ? ferry__malloc((size_t)nch * sizeof *copy) : NULL;
    if (!op || !j || (nch && !copy)) {
        ferry__free(op);
        ferry__free(j);
        ferry__free(copy);
        if (ids != stack)
            ferry__free(ids);
        return ferry__kv_err(kv, -ENOMEM, "kv %s: out of memory for the operation",
                              what);
    }
    memcpy(copy, ids, (size_t)nch * sizeof *copy);
    if (ids != stack)
        ferry__free(ids);
    op->kv = kv;
    op->kind = kind;
    op->ids = copy;
    op->nchunks = (size_t)nch;
    op->n = n;
    if (req)
        op->req = *req;
    else
        op->req.size = sizeof op->req;
    op->req.salt = NULL; /* already folded into the ids */
    op->req.salt_len = 0;
    op->buf = *buf;
    pthread_mutex_init(&op->mu, NULL);
    pthread_cond_init(&op->cv, NULL);
    j->kind = FERRY__KV_JOB_OP;
    j->op = op;
    ferry__kv_enqueue(kv, j);
    *out = op;
    return 0;
}

int ferry_kv_store_async(ferry_kv *kv, const int32_t *tokens, size_t n, const ferry_kv_req *req,
                         const ferry_kv_buffer *src, ferry_kv_op **op)
{
    return op_submit(kv, FERRY__KV_OP_STORE, tokens, n, req, src, op);
}

int ferry_kv_retrieve_async(ferry_kv *kv, const int32_t *tokens, size_t n,
                            const ferry_kv_req *req, const ferry_kv_buffer *dst, ferry_kv_op **op)
{
    return op_submit(kv, FERRY__KV_OP_RETRIEVE, tokens, n, req, dst, op);
}

/* ---- prefetch, pin, delete, clear ---- */

/*
 * Queue L2 -> L1 reads for the chunks ids[0..nch) that are only in L2, up
 * to prefetch_max bytes in flight, in order. Leading mode (the public
 * prefetch) stops at the first chunk that is not cached or does not fit;
 * otherwise (a retrieve's read-ahead) it skips those. queued[i] (when
 * non-NULL) gets the source tier of each chunk queued. Returns the leading tokens that
 * are in L1 or on their way.
 */
static size_t prefetch_ids(ferry_kv *kv, const ferry_kv_hash *ids, size_t nch, size_t n,
                           int leading, uint8_t *queued)
{
    size_t lead = 0;
    int in_lead = 1;
    ferry__kv_job *head = NULL, **tail = &head;
    pthread_mutex_lock(&kv->mu);
    uint64_t now = now_ns(kv);
    for (size_t i = 0; i < nch; i++) {
        ferry__kv_entry *e = find(kv, ids[i]);
        int ok = e && e->state == FERRY__KV_READY && e->resident;
        if (ok && ((e->resident & (1u << FERRY_KV_TIER_L1)) || e->l1_loading)) {
            if (in_lead)
                lead += chunk_ntok(kv, i, n);
            continue;
        }
        int src = ok ? lower_tier(kv, e) : 0;
        ok = ok && src;
        if (ok && !leading && kv->tier[src]->aops)
            continue; /* a retrieve reads these itself, asynchronously */
        if (ok && kv->prefetch_inflight + kv->slot_bytes > kv->prefetch_max)
            break;
        ferry__kv_job *j = ok ? ferry__calloc(1, sizeof *j) : NULL;
        uint64_t slot;
        if (!j || reserve(kv, FERRY_KV_TIER_L1, now, &slot, RESERVE_NOW) < 0) {
            ferry__free(j);
            if (leading)
                break;
            in_lead = 0;
            continue;
        }
        e->l1_loading = 1;
        read_lock(kv, e, now);
        e->refs++;
        kv->prefetch_inflight += kv->slot_bytes;
        j->kind = FERRY__KV_JOB_PREFETCH;
        j->e = e;
        j->l1_loc = slot;
        j->src_tier = src;
        *tail = j;
        tail = &j->next;
        if (queued)
            queued[i] = (uint8_t)src;
        if (in_lead)
            lead += chunk_ntok(kv, i, n);
    }
    pthread_mutex_unlock(&kv->mu);
    for (ferry__kv_job *j = head, *next; j; j = next) {
        next = j->next;
        ferry__kv_enqueue(kv, j);
    }
    return lead;
}

int ferry_kv_prefetch(ferry_kv *kv, const int32_t *tokens, size_t n, const ferry_kv_req *req)
{
    if (!kv)
        return ferry__err_set(NULL, -EINVAL, "kv prefetch: store is NULL");
    ferry_kv_hash stack[STACK_CHUNKS], *ids = NULL;
    int nch = make_ids(kv, tokens, n, req, "prefetch", stack, &ids);
    if (nch < 0)
        return nch;
    remote_discover_missing(kv, ids, (size_t)nch, n);
    size_t lead = prefetch_ids(kv, ids, (size_t)nch, n, 1, NULL);
    if (ids != stack)
        ferry__free(ids);
    return (int)lead;
}

static int pin_common(ferry_kv *kv, const int32_t *tokens, size_t n, const ferry_kv_req *req,
                      int pin)
{
    const char *what = pin ? "pin" : "unpin";
    if (!kv)
        return ferry__err_set(NULL, -EINVAL, "kv %s: store is NULL", what);
    ferry_kv_hash stack[STACK_CHUNKS], *ids = NULL;
    int nch = make_ids(kv, tokens, n, req, what, stack, &ids);
    if (nch < 0)
        return nch;
    size_t lead = 0;
    pthread_mutex_lock(&kv->mu);
    uint64_t now = now_ns(kv);
    for (size_t i = 0; i < (size_t)nch; i++) {
        ferry__kv_entry *e = find(kv, ids[i]);
        if (!e || e->state != FERRY__KV_READY || (!pin && e->readers == 0))
            break;
        if (pin)
            read_lock(kv, e, now);
        else
            read_unlock(e);
        lead += chunk_ntok(kv, i, n);
    }
    pthread_mutex_unlock(&kv->mu);
    if (ids != stack)
        ferry__free(ids);
    return (int)lead;
}

int ferry_kv_pin(ferry_kv *kv, const int32_t *tokens, size_t n, const ferry_kv_req *req)
{
    return pin_common(kv, tokens, n, req, 1);
}

int ferry_kv_unpin(ferry_kv *kv, const int32_t *tokens, size_t n, const ferry_kv_req *req)
{
    return pin_common(kv, tokens, n, req, 0);
}

int ferry_kv_delete(ferry_kv *kv, const int32_t *tokens, size_t n, const ferry_kv_req *req)
{
    if (!kv)
        return ferry__err_set(NULL, -EINVAL, "kv delete: store is NULL");
    ferry_kv_hash stack[STACK_CHUNKS], *ids = NULL;
    int nch = make_ids(kv, tokens, n, req, "delete", stack, &ids);
    if (nch < 0)
        return nch;
    int deleted = 0;
    size_t locked_at = SIZE_MAX;
    ferry__kv_tier *rt = kv->tier[FERRY_KV_TIER_REMOTE];
    /* with a remote: the ids to delete there, those deleted here first
     * (ngone), then those not indexed here (counted by the server) */
    ferry_kv_hash *rids = rt ? ferry__malloc((size_t)nch * sizeof *rids) : NULL;
    size_t ngone = 0, nabsent = 0;
    pthread_mutex_lock(&kv->mu);
    uint64_t now = now_ns(kv);
    for (size_t i = 0; i < (size_t)nch; i++) {
        ferry__kv_entry *e = find(kv, ids[i]);
        if (!e) {
            if (rids)
                rids[(size_t)nch - 1 - nabsent++] = ids[i];
            continue;
        }
        if (locked(kv, e, now)) {
            if (locked_at == SIZE_MAX)
                locked_at = i;
            continue;
        }
        count_expired(kv, e);
        doom(kv, e);
        deleted++;
        if (rids)
            rids[ngone++] = ids[i];
    }
    pthread_mutex_unlock(&kv->mu);
    if (ids != stack)
        ferry__free(ids);
    if (rt && !rids) {
        FERRY_LOGW("kv delete: out of memory for %d remote keys; the remote copies stay", nch);
    } else if (rt) {
        int r1 = ferry__kv_remote_delete(rt, rids, ngone);
        int r2 = ferry__kv_remote_delete(rt, rids + (size_t)nch - nabsent, nabsent);
        if (r2 > 0)
            deleted += r2;
        if (r1 < 0 || r2 < 0)
            FERRY_LOGD("kv delete: the remote copies of some chunks stay: %s",
                       ferry_last_error());
        ferry__free(rids);
    }
    atomic_fetch_add(&kv->deleted, (uint64_t)deleted);
    if (locked_at != SIZE_MAX)
        return ferry__kv_err(kv, FERRY_ELOCKED,
                              "kv delete: chunk %zu (and maybe others) is locked (pinned, read or "
                              "being written); %d other chunks deleted",
                              locked_at, deleted);
    return deleted;
}

int ferry_kv_clear(ferry_kv *kv)
{
    if (!kv)
        return ferry__err_set(NULL, -EINVAL, "kv clear: store is NULL");
    int deleted = 0, left = 0;
    pthread_mutex_lock(&kv->mu);
    uint64_t now = now_ns(kv);
    for (uint64_t b = 0; b < kv->nbuckets; b++) {
        for (ferry__kv_entry *e = kv->buckets[b], *next; e; e = next) {
            next = e->hnext;
            if (locked(kv, e, now)) {
                left++;
                continue;
            }
            count_expired(kv, e);
            doom(kv, e);
            deleted++;
        }
    }
    pthread_mutex_unlock(&kv->mu);
    atomic_fetch_add(&kv->deleted, (uint64_t)deleted);
    if (left)
        return ferry__kv_err(kv, FERRY_ELOCKED,
                              "kv clear: %d chunks are locked and stay; %d deleted", left,
                              deleted);
    return deleted;
}

/* ---- open / close ---- */

/* a chunk the persistent L2 kept from the last run: READY, in L2 only */
static int recover_one(const ferry_kv_hash *id, uint64_t loc, uint64_t len, void *ctx)
{
    ferry_kv *kv = ctx;
    ferry__kv_tier *t = kv->tier[FERRY_KV_TIER_L2];
    if (len != kv->slot_bytes || find(kv, *id)) {
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
    index_insert(kv, e);
    t->policy->ops->insert(t->policy, e);
    t->used++;
    return 0;
}

static void kv_free(ferry_kv *kv)
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
    /* the L1 pool is registered with L2's drive queues: undo that first */
    if (kv->l2_registered)
        ferry__kv_tier_l2_unregister(kv->tier[FERRY_KV_TIER_L2]);
    for (int t = 1; t < FERRY_KV_TIERS; t++)
        ferry__kv_tier_free(kv->tier[t]);
    pthread_mutex_destroy(&kv->mu);
    pthread_mutex_destroy(&kv->err_mu);
    pthread_cond_destroy(&kv->loaded);
    pthread_mutex_destroy(&kv->qmu);
    pthread_cond_destroy(&kv->q[0].cv);
    pthread_cond_destroy(&kv->q[1].cv);
    pthread_cond_destroy(&kv->idle);
    ferry__free(kv->model);
    ferry__free(kv);
}

/* the remote tier: the caller's options with the store's layout
 * fingerprint and key prefix */
static int open_remote(ferry_kv *kv, const ferry_kv_config *cfg, const char *url)
{
    ferry_remote_options ro = FERRY_REMOTE_OPTIONS_INIT;
    const ferry_remote_options *uo = cfg->remote_options;
    if (uo) {
        if (uo->size < offsetof(ferry_remote_options, flags) + sizeof(uint32_t) ||
            uo->size > sizeof ro)
            return ferry__err_set(&kv->err, -EINVAL,
                                  "kv open: remote_options size field %zu is not %zu", uo->size,
                                  sizeof ro);
        memcpy(&ro, uo, uo->size);
    }
    ro.size = sizeof ro;
    if (!ro.key_prefix)
        ro.key_prefix = "ferry:kv:";
    /* an engine thread asking a hung server waits at most these, once per
     * backoff period: the connect, and a whole call's deadline (the
     * command timeout plus an allowance per byte moved; ferry/remote.h) */
    if (!ro.connect_timeout_ms)
        ro.connect_timeout_ms = 200;
    if (!ro.command_timeout_ms)
        ro.command_timeout_ms = 300;
    /* everything that makes the bytes of a chunk mean something: a value
     * written under another fingerprint is refused as a miss */
    char fp[FERRY_REMOTE_LAYOUT_MAX];
    int fl = snprintf(fp, sizeof fp,
                      "ferry-kv/1;layers=%u;kv=%u;heads=%u;head_dim=%u;dtype=%s;chunk_tokens=%u;"
                      "seed=%016llx;tp=%u/%u;model=%s",
                      kv->layout.num_layers, kv->layout.kv, kv->layout.num_heads,
                      kv->layout.head_dim, ferry_dtype_name(kv->layout.dtype), kv->chunk_tokens,
                      (unsigned long long)kv->seed, kv->tp_rank, kv->tp_world, kv->model);
    ro.layout = fp;
    ro.layout_len = fl < 0 ? 0 : FERRY__MIN((size_t)fl, sizeof fp - 1);
    uint64_t cap = cfg->remote_index_chunks ? cfg->remote_index_chunks : 65536;
    return ferry__kv_tier_remote_open(url, &ro, kv->chunk_bytes, kv->slot_bytes, cap, &kv->err,
                                      &kv->tier[FERRY_KV_TIER_REMOTE]);
}

int ferry_kv_open(const ferry_kv_config *cfg, ferry_kv **out)
{
    if (!cfg || !out || cfg->size < sizeof(ferry_kv_config) || !cfg->model)
        return ferry__err_set(NULL, -EINVAL,
                              "kv open: config or out is NULL, config size is wrong, or no model");
    uint32_t ct = cfg->chunk_tokens ? cfg->chunk_tokens : FERRY_KV_CHUNK_TOKENS_DEFAULT;
    uint64_t chunk_bytes;
    int rc = ferry_kv_layout_chunk_bytes(&cfg->layout, ct, &chunk_bytes);
    if (rc < 0)
        return rc;
    /* every option in range before any arithmetic on it */
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
    if (ferry__mode_check(cfg->l2_mode, "kv open: l2_mode", NULL) < 0)
        return -EINVAL;
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
    uint64_t slot = FERRY__ALIGN_UP(chunk_bytes, (uint64_t)4096);
    if (cfg->l1_bytes < slot)
        return ferry__err_set(NULL, -EINVAL,
                              "kv open: l1_bytes %llu is below one chunk of %llu bytes "
                              "(%u tokens)",
                              (unsigned long long)cfg->l1_bytes, (unsigned long long)slot, ct);
    ferry_kv *kv = ferry__calloc(1, sizeof *kv);
    if (!kv)
        return ferry__err_set(NULL, -ENOMEM, "kv open: out of memory");
    pthread_mutex_init(&kv->mu, NULL);
    pthread_mutex_init(&kv->err_mu, NULL);
    pthread_cond_init(&kv->loaded, NULL);
    pthread_mutex_init(&kv->qmu, NULL);
    pthread_cond_init(&kv->q[0].cv, NULL);
    pthread_cond_init(&kv->q[1].cv, NULL);
    pthread_cond_init(&kv->idle, NULL);
    kv->model = ferry__strdup(cfg->model);
    if (!kv->model) {
        kv_free(kv);
        return ferry__err_set(NULL, -ENOMEM, "kv open: out of memory");
    }
    kv->tp_rank = cfg->tp_rank;
    kv->tp_world = cfg->tp_world ? cfg->tp_world : 1;
    kv->layout = cfg->layout;
    kv->chunk_tokens = ct;
    kv->seed = cfg->hash_seed ? cfg->hash_seed : FERRY_KV_HASH_SEED_DEFAULT;
    kv->chunk_bytes = chunk_bytes;
    kv->slot_bytes = slot;
    kv->dev = cfg->device;
    kv->watermark = wm;
    kv->low = wm - frac;
    kv->write_ttl_ns =
        (uint64_t)(cfg->write_ttl_ms ? cfg->write_ttl_ms : FERRY_KV_WRITE_TTL_MS_DEFAULT) * 1000000u;
    kv->read_ttl_ns =
        (uint64_t)(cfg->read_ttl_ms ? cfg->read_ttl_ms : FERRY_KV_READ_TTL_MS_DEFAULT) * 1000000u;
    kv->ns0 = ferry__kv_namespace(kv->seed, kv->model, kv->tp_rank, kv->tp_world, NULL, 0);
    kv->prefetch_max = cfg->prefetch_max_bytes ? cfg->prefetch_max_bytes : cfg->l1_bytes / 4;
    if (kv->prefetch_max < slot)
        kv->prefetch_max = slot;

    ferry__errbuf *eb = &kv->err;
    rc = ferry__kv_tier_l1_open(cfg->device, slot, cfg->l1_bytes / slot, eb,
                                &kv->tier[FERRY_KV_TIER_L1]);
    int persistent = cfg->size >= offsetof(ferry_kv_config, l2_persistent) + sizeof(int) &&
                     cfg->l2_persistent;
    if (rc == 0 && cfg->l2_dir)
        rc = persistent ? ferry__kv_tier_pslab_open_kv(kv, cfg, slot, eb,
                                                       &kv->tier[FERRY_KV_TIER_L2])
                        : ferry__kv_tier_l2_open(cfg->l2_dir, cfg->l2_bytes, cfg->l2_direct,
                                                 cfg->l2_engine, cfg->l2_mode, kv->chunk_bytes,
                                                 slot, eb,
                                                 &kv->tier[FERRY_KV_TIER_L2]);
    if (rc == 0 && cfg->l2_dir && !persistent) {
        /* L2 reads land in L1 slots and write-throughs leave from them:
         * register the pool for the engines' fixed-buffer path. Optional:
         * an engine that cannot (memlock limit, table full) still works */
        ferry__kv_tier *l1 = kv->tier[FERRY_KV_TIER_L1];
        int r = ferry__kv_tier_l2_register(kv->tier[FERRY_KV_TIER_L2],
                                           l1->ops->host_ptr(l1, 0),
                                           (size_t)(l1->capacity * l1->slot_bytes));
        if (r < 0)
            FERRY_LOGI("kv open: L1 pool not registered with the L2 slab in %s (%s): "
                       "L2 transfers take the engine's plain path",
                       cfg->l2_dir, ferry_last_error());
        else
            kv->l2_registered = 1;
    }
    const char *remote_url =
        cfg->size >= offsetof(ferry_kv_config, remote_index_chunks) + sizeof(uint64_t)
            ? cfg->remote_url
            : NULL;
    if (rc == 0 && remote_url)
        rc = open_remote(kv, cfg, remote_url);
    uint64_t chunks = 0;
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
    if (rc == 0) {
        kv->nbuckets = 64;
        while (kv->nbuckets < chunks)
            kv->nbuckets <<= 1;
        kv->buckets = ferry__calloc(kv->nbuckets, sizeof *kv->buckets);
        if (!kv->buckets)
            rc = ferry__err_set(eb, -ENOMEM, "kv open: out of memory for the index");
    }
    if (rc == 0 && persistent && kv->tier[FERRY_KV_TIER_L2]) {
        int r = ferry__kv_tier_pslab_recover(kv->tier[FERRY_KV_TIER_L2], recover_one, kv);
        if (r < 0)
            rc = ferry__err_set(eb, r, "kv open: recovering the persistent L2 in %s: %s",
                                cfg->l2_dir, ferry_last_error());
        else
            FERRY_LOGI("kv open: %d chunks recovered from the persistent L2 in %s", r,
                       cfg->l2_dir);
    }
    if (rc == 0)
        rc = ferry__kv_workers_start(kv, cfg->workers ? cfg->workers : 2);
    if (rc < 0) {
        ferry__err_pass(NULL, rc);
        kv_free(kv);
        return rc;
    }
    *out = kv;
    return 0;
}

void ferry_kv_close(ferry_kv *kv)
{
    if (!kv)
        return;
    ferry__kv_workers_stop(kv);
    kv_free(kv);
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

/* ---- test seams: state and a consistency walk ---- */

int ferry__kv_chunk_state(ferry_kv *kv, ferry_kv_hash h, const void *salt, size_t salt_len,
                          uint8_t *resident, uint32_t *readers)
{
    ferry_kv_req r = FERRY_KV_REQ_INIT;
    r.salt = salt;
    r.salt_len = salt_len;
    ferry_kv_hash ns = ns_of(kv, &r);
    h.lo ^= ns.lo;
    h.hi ^= ns.hi;
    pthread_mutex_lock(&kv->mu);
    ferry__kv_entry *e = find(kv, h);
    int st = e ? (int)e->state : -1;
    if (e && resident)
        *resident = e->resident;
    if (e && readers)
        *readers = e->readers;
    pthread_mutex_unlock(&kv->mu);
    return st;
}

int ferry__kv_test_abandon_write(ferry_kv *kv, const int32_t *tokens, size_t n,
                                 const ferry_kv_req *req)
{
    ferry_kv_hash stack[STACK_CHUNKS], *ids = NULL;
    int nch = make_ids(kv, tokens, n, req, "abandon", stack, &ids);
    if (nch < 0)
        return nch;
    int placed = 0;
    pthread_mutex_lock(&kv->mu);
    uint64_t now = now_ns(kv);
    for (int i = 0; i < nch; i++) {
        if (find(kv, ids[i]))
            continue;
        ferry__kv_entry *e = ferry__calloc(1, sizeof *e);
        uint64_t loc;
        if (!e || reserve(kv, FERRY_KV_TIER_L1, now, &loc, RESERVE_NOW) < 0) {
            ferry__free(e);
            break;
        }
        e->id = ids[i];
        e->state = FERRY__KV_WRITING;
        e->write_deadline = now + kv->write_ttl_ns;
        e->tokens = chunk_ntok(kv, (size_t)i, n);
        for (int t = 0; t < FERRY_KV_TIERS; t++)
            e->loc[t] = UINT64_MAX;
        e->loc[FERRY_KV_TIER_L1] = loc;
        index_insert(kv, e);
        placed++;
    }
    pthread_mutex_unlock(&kv->mu);
    if (ids != stack)
        ferry__free(ids);
    return placed;
}

int ferry__kv_check(ferry_kv *kv)
{
    int rc = 0;
    pthread_mutex_lock(&kv->mu);
    uint64_t count = 0, res[FERRY_KV_TIERS] = {0};
    for (uint64_t b = 0; b < kv->nbuckets && rc == 0; b++) {
        for (ferry__kv_entry *e = kv->buckets[b]; e && rc == 0; e = e->hnext) {
            count++;
            if (e->doomed)
                rc = ferry__kv_err(kv, FERRY_ECORRUPT, "kv check: doomed entry in index");
            if (bucket_of(kv, e->id) != b)
                rc = ferry__kv_err(kv, FERRY_ECORRUPT, "kv check: entry in wrong bucket");
            for (int t = 1; t < FERRY_KV_TIERS; t++) {
                if (!(e->resident & (1u << t)))
                    continue;
                if (!kv->tier[t])
                    rc = ferry__kv_err(kv, FERRY_ECORRUPT,
                                        "kv check: entry resident in absent tier %d", t);
                else if (!e->node[t].queue)
                    rc = ferry__kv_err(kv, FERRY_ECORRUPT,
                                        "kv check: resident entry not in tier %d's policy", t);
                res[t]++;
            }
            if (e->state == FERRY__KV_READY && !e->resident && !e->l1_loading)
                rc = ferry__kv_err(kv, FERRY_ECORRUPT,
                                    "kv check: READY entry resident nowhere");
        }
    }
    if (rc == 0 && count != kv->count)
        rc = ferry__kv_err(kv, FERRY_ECORRUPT, "kv check: index count %llu, walked %llu",
                            (unsigned long long)kv->count, (unsigned long long)count);
    for (int t = 1; rc == 0 && t < FERRY_KV_TIERS; t++) {
        ferry__kv_tier *tr = kv->tier[t];
        if (!tr)
            continue;
        if (tr->used > tr->capacity || res[t] > tr->used)
            rc = ferry__kv_err(kv, FERRY_ECORRUPT,
                                "kv check: tier %s uses %llu of %llu, %llu resident",
                                tr->ops->name, (unsigned long long)tr->used,
                                (unsigned long long)tr->capacity, (unsigned long long)res[t]);
    }
    /* with no operation in flight, used == resident (+ L1 slots retired
     * by a broken read queue) */
    int idle = 1;
    for (uint64_t b = 0; b < kv->nbuckets && idle; b++)
        for (ferry__kv_entry *e = kv->buckets[b]; e; e = e->hnext)
            if (e->refs || e->l1_loading || e->l2_writing || e->state != FERRY__KV_READY)
                idle = 0;
    for (int t = 1; rc == 0 && idle && !kv->doomed && t < FERRY_KV_TIERS; t++)
        if (kv->tier[t] &&
            kv->tier[t]->used != res[t] + (t == FERRY_KV_TIER_L1 ? kv->l1_retired : 0))
            rc = ferry__kv_err(kv, FERRY_ECORRUPT,
                                "kv check: tier %s has %llu slots reserved but %llu resident",
                                kv->tier[t]->ops->name, (unsigned long long)kv->tier[t]->used,
                                (unsigned long long)res[t]);
    pthread_mutex_unlock(&kv->mu);
    return rc;
}
