/*
 * store_entry.c - chunk states and read/write locks with TTLs (under kv->mu).
 *
 * An entry is in the index or doomed; a doomed entry is freed when the last
 * operation holding it (refs) lets go, so nobody touches freed memory. A lock
 * older than its TTL is ignored, so a writer or pinner that died does not
 * hold memory forever.
 */
#include <errno.h>
#include <stddef.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv/kv_impl.h"
#include "kv/store/store_int.h"

/* ---- entry state (under mu) ---- */

static int read_locked(ferry_kv *kv, const ferry__kv_entry *e, uint64_t now)
{
    return e->readers > 0 && now < e->read_deadline;
}

int ferry__kv_write_locked(const ferry__kv_entry *e, uint64_t now)
{
    return e->state == FERRY__KV_WRITING && now < e->write_deadline;
}

int ferry__kv_locked(ferry_kv *kv, const ferry__kv_entry *e, uint64_t now)
{
    return e->l1_loading || e->l2_writing || ferry__kv_write_locked(e, now) || read_locked(kv, e, now);
}

/* e is about to go although it holds a lock: the lock outlived its TTL */
void ferry__kv_count_expired(ferry_kv *kv, const ferry__kv_entry *e)
{
    if (e->readers > 0 || e->state == FERRY__KV_WRITING)
        atomic_fetch_add(&kv->lock_expired, 1);
}

void ferry__kv_read_lock(ferry_kv *kv, ferry__kv_entry *e, uint64_t now)
{
    e->readers++;
    uint64_t d = now + kv->read_ttl_ns;
    if (d > e->read_deadline)
        e->read_deadline = d;
}

void ferry__kv_read_unlock(ferry__kv_entry *e)
{
    FERRY__ASSERT(e->readers > 0);
    if (e->readers > 0)
        e->readers--;
}

void ferry__kv_tier_release(ferry_kv *kv, int tier, uint64_t loc)
{
    ferry__kv_tier *t = kv->tier[tier];
    FERRY__ASSERT(t->used > 0);
    t->ops->release(t, loc);
    t->used--;
}

/* drop one tier's copy of e (policy, space) */
void ferry__kv_drop_tier(ferry_kv *kv, ferry__kv_entry *e, int tier)
{
    if (!(e->resident & (1u << tier)))
        return;
    ferry__kv_tier *t = kv->tier[tier];
    t->policy->ops->remove(t->policy, e);
    ferry__kv_tier_release(kv, tier, e->loc[tier]);
    e->resident &= (uint8_t) ~(1u << tier);
}

static void entry_free(ferry_kv *kv, ferry__kv_entry *e)
{
    (void)kv;
    ferry__free(e);
}

/* remove e from the index and every tier; free it when nobody holds it */
void ferry__kv_doom(ferry_kv *kv, ferry__kv_entry *e)
{
    if (e->doomed)
        return;
    for (int t = 1; t < FERRY_KV_TIERS; t++)
        if (kv->tier[t])
            ferry__kv_drop_tier(kv, e, t);
    if (e->state == FERRY__KV_WRITING && (e->resident == 0) && e->loc[FERRY_KV_TIER_L1] != UINT64_MAX) {
        /* a writer's reserved (not yet resident) L1 slot: reclaimed with the
         * expired write lock */
        ferry__kv_tier_release(kv, FERRY_KV_TIER_L1, e->loc[FERRY_KV_TIER_L1]);
        e->loc[FERRY_KV_TIER_L1] = UINT64_MAX;
    }
    ferry__kv_index_remove(kv, e);
    e->doomed = 1;
    if (e->refs == 0) {
        entry_free(kv, e);
        return;
    }
    e->dnext = kv->doomed;
    kv->doomed = e;
}

/* let go of a pointer to e */
void ferry__kv_put(ferry_kv *kv, ferry__kv_entry *e)
{
    FERRY__ASSERT(e->refs > 0);
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
