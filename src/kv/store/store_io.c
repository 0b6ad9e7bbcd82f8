/*
 * store_io.c - the KV store's clock, test fault seam and tier I/O.
 *
 * Every read or write of a tier below L1 goes through ferry__kv_tier_io:
 * the fault seam first (tests fail the Nth read or write of a tier), then
 * the tier's op, then ferry__kv_tier_io_done, which counts the bytes or the
 * failure (and logs it, rate-limited) in one place, so no path can move
 * bytes without being counted or fail without being seen.
 */
#include <errno.h>
#include <stddef.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv/kv_impl.h"
#include "kv/store/store_int.h"

uint64_t ferry__kv_now_ns(ferry_kv *kv)
{
    return kv->clock ? kv->clock(kv->clock_ctx) : ferry__now_ns();
}

void ferry__kv_set_handoff_min(ferry_kv *kv, uint64_t bytes)
{
    kv->handoff_min = bytes;
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
        atomic_store(&t->fail_code, code ? code : FERRY_EINJECTED);
        atomic_store(&t->fail_sticky, sticky);
        /* the count restarts, then the fault is armed (released last) */
        if (write) {
            atomic_store(&t->n_writes, 0);
            atomic_store_explicit(&t->fail_write_nth, nth, memory_order_release);
        } else {
            atomic_store(&t->n_reads, 0);
            atomic_store_explicit(&t->fail_read_nth, nth, memory_order_release);
        }
    }
    pthread_mutex_unlock(&kv->mu);
}

/* the fault seam: the code the nth read or write of t is to fail with, or 0 */
int ferry__kv_tier_piece_check(ferry__kv_tier *t, uint64_t loc, const ferry_kv_hash *id,
                               uint64_t k, uint64_t len, uint64_t got)
{
    uint64_t want = 0;
    int rc = t->aops->psum(t, loc, id, k, &want);
    if (rc < 0)
        return rc;
    if (got == want)
        return 0;
    uint64_t piece = t->aops->vpiece(t, loc);
    return ferry__err_set(NULL, FERRY_ECORRUPT, "kv %s: piece %llu (%llu bytes at byte %llu) of "
                          "chunk %016llx%016llx read from location %llu fails its checksum "
                          "(%016llx, written %016llx): a miss", t->ops->name,
                          (unsigned long long)k, (unsigned long long)len,
                          (unsigned long long)(k * piece), (unsigned long long)id->hi,
                          (unsigned long long)id->lo, (unsigned long long)loc,
                          (unsigned long long)got, (unsigned long long)want);
}

int ferry__kv_tier_check_whole(ferry__kv_tier *t, uint64_t loc, const ferry_kv_hash *id,
                               const void *data, uint64_t len)
{
    uint64_t piece = t->aops->vpiece ? t->aops->vpiece(t, loc) : 0;
    if (!piece)
        return t->aops->verify(t, loc, id, ferry__kv_sum(data, len));
    const char *d = data;
    for (uint64_t off = 0, k = 0; off < len; off += piece, k++) {
        uint64_t n = FERRY__MIN(piece, len - off);
        int rc = ferry__kv_tier_piece_check(t, loc, id, k, n, ferry__kv_sum(d + off, (size_t)n));
        if (rc < 0)
            return rc;
    }
    return 0;
}

int ferry__kv_tier_fault(ferry_kv *kv, ferry__kv_tier *t, int write, uint64_t loc, size_t len)
{
    (void)kv;
    uint64_t n = atomic_fetch_add(write ? &t->n_writes : &t->n_reads, 1) + 1;
    uint64_t nth = atomic_load_explicit(write ? &t->fail_write_nth : &t->fail_read_nth,
                                        memory_order_acquire);
    if (!nth)
        return 0;
    int code = atomic_load(&t->fail_code), sticky = atomic_load(&t->fail_sticky);
    if (n == nth || (sticky && n > nth))
        return ferry__err_set(NULL, code, "kv %s: injected %s fault at location %llu (%zu bytes)",
                              t->ops->name, write ? "write" : "read", (unsigned long long)loc,
                              len);
    return 0;
}

/* count a finished tier read or write (rc 0 or its code, message set) */
int ferry__kv_tier_io_done(ferry_kv *kv, ferry__kv_tier *t, int write, uint64_t loc,
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
int ferry__kv_tier_io(ferry_kv *kv, ferry__kv_tier *t, int write, uint64_t loc,
                   const ferry_kv_hash *id, void *buf, size_t len)
{
    int rc = ferry__kv_tier_fault(kv, t, write, loc, len);
    if (rc == 0)
        rc = write ? t->ops->write(t, loc, id, buf, len) : t->ops->read(t, loc, id, buf, len);
    return ferry__kv_tier_io_done(kv, t, write, loc, id, len, rc);
}
