/*
 * store_reserve.c - eviction and reservation of tier slots (under kv->mu).
 *
 * A tier evicts by its policy from the watermark down, never a locked or
 * in-flight entry; a reservation that finds the tier full of those declines
 * or waits for a write-through or read, as its caller asked.
 */
#include <errno.h>
#include <stddef.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_impl.h"
#include "store_int.h"

typedef struct evict_ctx {
    ferry_kv *kv;
    uint64_t now;
    int keep_ahead; /* spare a retrieve's landed read-ahead (kv_impl.h: ahead_until) */
} evict_ctx;

static int evictable(ferry__kv_entry *e, void *ctx)
{
    evict_ctx *c = ctx;
    return e->state == FERRY__KV_READY && !ferry__kv_locked(c->kv, e, c->now) &&
           (!c->keep_ahead || c->now >= e->ahead_until);
}

/* evict one chunk from tier; 1 when one went. keep_ahead: not a landed
 * read-ahead that a retrieve is about to copy out (a preference only: a
 * reservation that finds nothing else takes one rather than fail) */
static int evict_one(ferry_kv *kv, int tier, uint64_t now, int keep_ahead)
{
    ferry__kv_tier *t = kv->tier[tier];
    evict_ctx c = {kv, now, keep_ahead};
    ferry__kv_entry *v = t->policy->ops->victim(t->policy, evictable, &c);
    if (!v)
        return 0;
    /* the policy already unlinked it */
    ferry__kv_count_expired(kv, v);
    ferry__kv_tier_release(kv, tier, v->loc[tier]);
    v->resident &= (uint8_t) ~(1u << tier);
    atomic_fetch_add(&t->evictions, 1);
    if (!v->resident)
        ferry__kv_doom(kv, v);
    return 1;
}

/* reserve room for one chunk in tier, evicting by the watermark and when
 * full. 0 and *loc, or FERRY_ENOSPACE (everything left is locked) / -ENOMEM,
 * or (may_wait) -EAGAIN after waiting for a write-through to free a slot:
 * kv->mu was released, the caller must look its entry up again. */
int ferry__kv_reserve(ferry_kv *kv, int tier, uint64_t now, uint64_t *loc, int may_wait)
{
    ferry__kv_tier *t = kv->tier[tier];
    double cap = (double)t->capacity;
    if ((double)(t->used + 1) >= kv->watermark * cap && (double)t->used > kv->low * cap) {
        while ((double)t->used > kv->low * cap && evict_one(kv, tier, now, 1))
            ;
    }
    for (;;) {
        int rc = t->used < t->capacity ? t->ops->reserve(t, loc) : FERRY_ENOSPACE;
        if (rc == 0) {
            t->used++;
            if (tier == FERRY_KV_TIER_L1)
                kv->l1_gen[*loc]++;
            return 0;
        }
        if (rc == FERRY_ENOSPACE && (evict_one(kv, tier, now, 1) || evict_one(kv, tier, now, 0)))
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
