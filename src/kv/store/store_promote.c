/*
 * store_promote.c - bringing a chunk up into L1, and the I/O workers' jobs.
 *
 * A promotion reads a lower tier's copy into a reserved L1 slot and only then
 * publishes the slot; a read that failed drops that copy (the chunk is a miss
 * without another one), never publishes the slot.
 */
#include <errno.h>
#include <stddef.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv/kv_impl.h"
#include "kv/store/store_int.h"

/* ---- promotion into L1 (retrieve, prefetch) ---- */

/* the nearest tier below L1 holding e, or 0 */
int ferry__kv_lower_tier(const ferry_kv *kv, const ferry__kv_entry *e)
{
    for (int t = FERRY_KV_TIER_L2; t < FERRY_KV_TIERS; t++)
        if (kv->tier[t] && (e->resident & (1u << t)))
            return t;
    return 0;
}

/* under mu, after the read from tier src into the reserved slot finished
 * with rc */
void ferry__kv_promote_finish(ferry_kv *kv, ferry__kv_entry *e, uint64_t slot, int rc, int src)
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
    ferry__kv_tier_release(kv, FERRY_KV_TIER_L1, slot);
    if (rc < 0 && !e->doomed) {
        /* that copy is unreadable: without another one the chunk is a miss */
        ferry__kv_drop_tier(kv, e, src);
        if (!e->resident)
            ferry__kv_doom(kv, e);
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
        ferry__kv_tier_io(kv, kv->tier[FERRY_KV_TIER_REMOTE], 1, 0, &e->id, slot, kv->chunk_bytes);
        pthread_mutex_lock(&kv->mu);
        kv->l2_writes_inflight--;
        pthread_cond_broadcast(&kv->loaded);
        ferry__kv_read_unlock(e);
        ferry__kv_put(kv, e);
        pthread_mutex_unlock(&kv->mu);
        return;
    }
    if (j->kind == FERRY__KV_JOB_L2WRITE) {
        int rc = ferry__kv_tier_io(kv, l2, 1, j->l2_loc, &e->id, slot, kv->slot_bytes);
        pthread_mutex_lock(&kv->mu);
        e->l2_writing = 0;
        kv->l2_writes_inflight--;
        pthread_cond_broadcast(&kv->loaded);
        if (rc == 0 && !e->doomed) {
            e->loc[FERRY_KV_TIER_L2] = j->l2_loc;
            e->resident |= 1u << FERRY_KV_TIER_L2;
            l2->policy->ops->insert(l2->policy, e);
        } else {
            ferry__kv_tier_release(kv, FERRY_KV_TIER_L2, j->l2_loc);
        }
        ferry__kv_read_unlock(e);
        ferry__kv_put(kv, e);
        pthread_mutex_unlock(&kv->mu);
        return;
    }
    if (ferry__kv_ahead_gone(j)) { /* its client is gone: never read */
        ferry__kv_prefetch_land(kv, j, 0, FERRY__KV_LAND_DROP);
        return;
    }
    /* prefetch: the entry is read-locked, its location in src is stable */
    int src = j->src_tier;
    int rc = ferry__kv_tier_io(kv, kv->tier[src], 0, e->loc[src], &e->id, slot, kv->slot_bytes);
    ferry__kv_prefetch_land(kv, j, rc, FERRY__KV_LAND_PROMOTE);
}

void ferry__kv_prefetch_land(ferry_kv *kv, ferry__kv_job *j, int rc, int how)
{
    ferry__kv_entry *e = j->e;
    int src = j->src_tier;
    pthread_mutex_lock(&kv->mu);
    if (how == FERRY__KV_LAND_PROMOTE) {
        ferry__kv_promote_finish(kv, e, j->l1_loc, rc, src);
    } else {
        /* not the copy's failure (or never read: DROP): it stays where it
         * is, the chunk is not promoted; a slot a read may still land in
         * is never reused */
        e->l1_loading = 0;
        pthread_cond_broadcast(&kv->loaded);
        if (how == FERRY__KV_LAND_RETIRE) {
            kv->l1_retired++;
            FERRY_LOGW("kv prefetch: the %s read queue broke with a read in flight; its L1 "
                       "slot %llu is retired", kv->tier[src]->ops->name,
                       (unsigned long long)j->l1_loc);
        } else {
            ferry__kv_tier_release(kv, FERRY_KV_TIER_L1, j->l1_loc);
            if (how == FERRY__KV_LAND_DROP)
                atomic_fetch_add(&kv->ahead_dropped, 1);
        }
        rc = rc < 0 ? rc : FERRY_ENOTFOUND;
    }
    if (rc == 0)
        atomic_fetch_add(&kv->prefetched, 1);
    /* a retrieve's read-ahead is what it copies out next: an LRU would
     * take it first (landed before the copies that touched older chunks),
     * and the drive would read it again; it stays until that copy, or a
     * while if the retrieve went away */
    if (rc == 0 && j->ahead && !ferry__kv_ahead_gone(j))
        e->ahead_until = ferry__kv_now_ns(kv) + KV_AHEAD_HOLD_NS;
    FERRY__ASSERT(kv->prefetch_inflight >= kv->slot_bytes);
    kv->prefetch_inflight -= kv->slot_bytes;
    ferry__kv_read_unlock(e);
    ferry__kv_put(kv, e);
    pthread_mutex_unlock(&kv->mu);
    ferry__kv_cut_put(j->cut);
    j->cut = NULL;
}

static int cut_match(const ferry__kv_job *j, void *cut)
{
    return j->kind == FERRY__KV_JOB_PREFETCH && j->cut == cut;
}

void ferry__kv_ahead_cut(ferry_kv *kv, ferry__kv_cut *cut)
{
    /* those queued: no read of theirs has begun (an asynchronous tier's
     * group is queued whole, every chunk of it from one call, one cut) */
    ferry__kv_job *head = ferry__kv_withdraw(kv, cut_match, cut);
    for (ferry__kv_job *j = head, *next; j; j = next) {
        next = j->next;
        for (ferry__kv_job *g = j, *gn; g; g = gn) {
            gn = g->group;
            ferry__kv_prefetch_land(kv, g, 0, FERRY__KV_LAND_DROP);
            ferry__free(g);
        }
    }
    if (head)
        ferry__kv_withdraw_end(kv); /* (a flush waiting for these returns now) */
}
