/*
 * store_slots.c - the store slot by slot, for `ferry serve` (kv_slots.h):
 * reserve / commit a chunk's L1 slot for a client's store, acquire /
 * release it for a client's retrieve, lookups by chunk id.
 *
 * The same states as the in-process paths (store_write.c,
 * store_retrieve.c): a reserved chunk is WRITING (invisible) until its
 * commit, an acquired one is read-locked (never evicted or deleted) until
 * its release. What differs is who copies the bytes (the client, in its
 * own mapping of the pool) and how long a reservation lives: until its
 * connection says commit or abort, or closes.
 */
#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "kv/kv_impl.h"
#include "kv/kv_slots.h"
#include "kv/store/store_int.h"

int ferry__kv_pool(ferry_kv *kv, uint64_t *map_bytes, uint64_t *slot_bytes, uint64_t *nslots)
{
    ferry__kv_tier *l1 = kv->tier[FERRY_KV_TIER_L1];
    *slot_bytes = l1->slot_bytes;
    *nslots = l1->capacity;
    return ferry__kv_tier_l1_fd(l1, map_bytes);
}

uint64_t ferry__kv_pool_wait_ns(ferry_kv *kv)
{
    return kv->pool_wait_ns;
}

void ferry__kv_geometry(ferry_kv *kv, ferry_kv_layout *layout, uint32_t *chunk_tokens,
                        uint64_t *seed)
{
    *layout = kv->layout;
    *chunk_tokens = kv->chunk_tokens;
    *seed = kv->seed;
}

static int top_tier(const ferry__kv_entry *e)
{
    for (int t = FERRY_KV_TIER_L1; t < FERRY_KV_TIERS; t++)
        if (e->resident & (1u << t))
            return t;
    return FERRY_KV_TIER_NONE;
}

int ferry__kv_slot_lookup(ferry_kv *kv, const ferry_kv_hash *ids, size_t n, uint64_t tokens,
                          uint8_t *tiers)
{
    uint64_t t0 = ferry__now_ns();
    ferry__kv_remote_discover_missing(kv, ids, n, n * kv->chunk_tokens);
    size_t i;
    pthread_mutex_lock(&kv->mu);
    for (i = 0; i < n; i++) {
        ferry__kv_entry *e = ferry__kv_find(kv, ids[i]);
        if (!e || e->state != FERRY__KV_READY || !e->resident)
            break;
        int tier = top_tier(e);
        kv->tier[tier]->policy->ops->touch(kv->tier[tier]->policy, e);
        atomic_fetch_add(&kv->tier[tier]->hits, 1);
        tiers[i] = (uint8_t)tier;
    }
    pthread_mutex_unlock(&kv->mu);
    atomic_fetch_add(&kv->lookups, 1);
    atomic_fetch_add(&kv->lookup_tokens, tokens);
    atomic_fetch_add(&kv->hit_tokens, FERRY__MIN((uint64_t)i * kv->chunk_tokens, tokens));
    ferry__kv_hist_record(&kv->h_lookup, ferry__now_ns() - t0);
    return (int)i;
}

int ferry__kv_slot_reserve(ferry_kv *kv, ferry_kv_hash id, uint32_t tokens, ferry__kv_entry **out,
                           uint64_t *slot, uint64_t *gen)
{
    return ferry__kv_slot_reserve_wait(kv, id, tokens, 0, out, slot, gen);
}

int ferry__kv_slot_reserve_wait(ferry_kv *kv, ferry_kv_hash id, uint32_t tokens, uint64_t wait_ns,
                                ferry__kv_entry **out, uint64_t *slot, uint64_t *gen)
{
    if (tokens == 0 || tokens > kv->chunk_tokens)
        return ferry__kv_err(kv, -EINVAL, "kv reserve: a chunk of %u tokens (1 to %u)", tokens,
                             kv->chunk_tokens);
    ferry__kv_entry *ne = ferry__calloc(1, sizeof *ne);
    if (!ne)
        return ferry__kv_err(kv, -ENOMEM, "kv reserve: out of memory for an entry");
    ferry__kv_waiter wt = {0};
    pthread_mutex_lock(&kv->mu);
    for (;;) {
        uint64_t now = ferry__kv_now_ns(kv);
        ferry__kv_entry *e = ferry__kv_find(kv, id);
        if (e && e->state == FERRY__KV_READY) {
            for (int t = 1; t < FERRY_KV_TIERS; t++)
                if (kv->tier[t] && (e->resident & (1u << t)))
                    kv->tier[t]->policy->ops->touch(kv->tier[t]->policy, e);
            ferry__kv_wait_leave(kv, &wt);
            pthread_mutex_unlock(&kv->mu);
            ferry__free(ne);
            return 1;
        }
        if (e && ferry__kv_write_locked(e, now)) {
            ferry__kv_wait_leave(kv, &wt);
            pthread_mutex_unlock(&kv->mu);
            ferry__free(ne);
            return ferry__kv_err(kv, FERRY_ELOCKED,
                                 "kv store: a chunk is being written by another writer: "
                                 "skipped, not stored by this call");
        }
        if (e) {
            atomic_fetch_add(&kv->lock_expired, 1);
            ferry__kv_doom(kv, e);
        }
        uint64_t loc;
        int r = ferry__kv_reserve_l1(kv, &wt, wait_ns, RESERVE_WAIT, &loc);
        if (r == -EAGAIN)
            continue; /* the mutex was dropped: look the chunk up again */
        ferry__kv_wait_leave(kv, &wt);
        if (r == -ECANCELED) {
            pthread_mutex_unlock(&kv->mu);
            ferry__free(ne);
            return ferry__kv_err(kv, r, "kv store: the store is closing (ferry_kv_close_begin): "
                                 "stopped waiting for an L1 slot; not stored");
        }
        if (r < 0) {
            char why[320];
            ferry__kv_pool_holders(kv, why, sizeof why);
            pthread_mutex_unlock(&kv->mu);
            ferry__free(ne);
            atomic_fetch_add(&kv->alloc_failures, 1);
            return ferry__kv_err(kv, r, "kv store: no L1 slot after waiting %llu ms: %s",
                                 (unsigned long long)(wait_ns == FERRY__KV_TAKE_FREE ? 0 : wait_ns / 1000000u), why);
        }
        ne->id = id;
        ne->state = FERRY__KV_WRITING;
        ne->write_deadline = UINT64_MAX; /* held by its connection, not by a TTL */
        ne->refs = 1;
        ne->tokens = tokens;
        for (int t = 0; t < FERRY_KV_TIERS; t++)
            ne->loc[t] = UINT64_MAX;
        ne->loc[FERRY_KV_TIER_L1] = loc;
        ferry__kv_index_insert(kv, ne);
        *out = ne;
        *slot = loc;
        *gen = kv->l1_gen[loc];
        pthread_mutex_unlock(&kv->mu);
        return 0;
    }
}

int ferry__kv_slot_commit(ferry_kv *kv, ferry__kv_entry *e, int abort)
{
    ferry__kv_job *j = NULL, *rj = NULL;
    if (!abort && kv->tier[FERRY_KV_TIER_L2])
        j = ferry__calloc(1, sizeof *j);
    if (!abort && kv->tier[FERRY_KV_TIER_REMOTE])
        rj = ferry__calloc(1, sizeof *rj);
    ferry__kv_job *head = NULL, **tail = &head;
    int rc = 0;
    pthread_mutex_lock(&kv->mu);
    uint64_t now = ferry__kv_now_ns(kv);
    if (abort || e->doomed || e->state != FERRY__KV_WRITING) {
        if (!e->doomed && e->state == FERRY__KV_WRITING) {
            ferry__kv_tier_release(kv, FERRY_KV_TIER_L1, e->loc[FERRY_KV_TIER_L1]);
            e->loc[FERRY_KV_TIER_L1] = UINT64_MAX;
            ferry__kv_doom(kv, e);
        } else if (!abort) {
            rc = FERRY_ESTATE;
        }
        ferry__free(j);
        ferry__free(rj);
    } else {
        ferry__kv_tier *l1 = kv->tier[FERRY_KV_TIER_L1];
        e->state = FERRY__KV_READY;
        e->resident |= 1u << FERRY_KV_TIER_L1;
        l1->policy->ops->insert(l1->policy, e);
        ferry__kv_write_through(kv, e, j, rj, now, &tail);
        atomic_fetch_add(&kv->stored_chunks, 1);
        atomic_fetch_add(&kv->stored_bytes, kv->chunk_bytes);
        atomic_fetch_add(&l1->bytes_written, kv->chunk_bytes);
    }
    ferry__kv_put(kv, e);
    ferry__kv_room(kv);
    pthread_mutex_unlock(&kv->mu);
    for (ferry__kv_job *x = head, *nx; x; x = nx) {
        nx = x->next;
        ferry__kv_enqueue(kv, x);
    }
    return rc;
}

/* under mu: e is READY in L1: hold it for the caller */
static void hold(ferry_kv *kv, ferry__kv_entry *e, uint64_t now, ferry__kv_entry **out,
                 uint64_t *slot, uint64_t *gen, uint32_t *tokens)
{
    ferry__kv_tier *l1 = kv->tier[FERRY_KV_TIER_L1];
    ferry__kv_read_lock(kv, e, now);
    e->refs++;
    l1->policy->ops->touch(l1->policy, e);
    /* a read-ahead that landed for this acquire is consumed now: it loses
     * its sparing, as an in-process retrieve's copy-out takes it away */
    e->ahead_until = 0;
    *out = e;
    *slot = e->loc[FERRY_KV_TIER_L1];
    *gen = kv->l1_gen[*slot];
    *tokens = e->tokens;
}

/* under mu, returns under mu: read e's copy in tier src into a new L1 slot;
 * 0 when e is in L1 now, 1 when the caller must look again (the mutex was
 * dropped while waiting for a slot, or e went), or a code */
static int promote(ferry_kv *kv, ferry__kv_entry *e, int src, uint64_t now, ferry__kv_waiter *wt,
                   uint64_t wait_ns)
{
    uint64_t loc;
    int r = ferry__kv_reserve_l1(kv, wt, wait_ns, RESERVE_WAIT, &loc);
    if (r == -EAGAIN)
        return 1;
    ferry__kv_wait_leave(kv, wt);
    if (r == -ECANCELED)
        return ferry__kv_err(kv, r, "kv retrieve: the store is closing (ferry_kv_close_begin): "
                             "stopped waiting for an L1 slot to promote a chunk from %s into",
                             kv->tier[src]->ops->name);
    if (r < 0) {
        char why[320];
        ferry__kv_pool_holders(kv, why, sizeof why);
        return ferry__kv_err(kv, r, "kv retrieve: no L1 slot to promote a chunk from %s into "
                             "after waiting %llu ms: %s", kv->tier[src]->ops->name,
                             (unsigned long long)(wait_ns == FERRY__KV_TAKE_FREE ? 0 : wait_ns / 1000000u), why);
    }
    e->l1_loading = 1;
    ferry__kv_read_lock(kv, e, now); /* keeps its location in src */
    e->refs++;
    pthread_mutex_unlock(&kv->mu);
    ferry__kv_tier *l1 = kv->tier[FERRY_KV_TIER_L1];
    r = ferry__kv_tier_io(kv, kv->tier[src], 0, e->loc[src], &e->id,
                          l1->ops->host_ptr(l1, loc), kv->slot_bytes);
    pthread_mutex_lock(&kv->mu);
    ferry__kv_promote_finish(kv, e, loc, r, src);
    if (r == 0)
        atomic_fetch_add(&kv->tier[src]->bytes_read, kv->chunk_bytes);
    ferry__kv_read_unlock(e);
    ferry__kv_put(kv, e);
    return r < 0 ? r : 0;
}

int ferry__kv_slot_acquire(ferry_kv *kv, ferry_kv_hash id, ferry__kv_entry **out,
                           uint64_t *slot, uint64_t *gen, uint32_t *tokens, uint8_t *tier)
{
    return ferry__kv_slot_acquire_wait(kv, id, 0, out, slot, gen, tokens, tier);
}

/*
 * A chunk that is there is never reported missing: waiting for another
 * promotion of it, or for an L1 slot, is not a try. Only a promotion that
 * landed and was evicted again before this caller could lock it counts,
 * and a chunk evicted that way every time is FERRY_ENOSPACE (the pool is
 * too crowded to hold it), not FERRY_ENOTFOUND.
 */
int ferry__kv_slot_acquire_wait(ferry_kv *kv, ferry_kv_hash id, uint64_t wait_ns,
                                ferry__kv_entry **out, uint64_t *slot, uint64_t *gen,
                                uint32_t *tokens, uint8_t *tier)
{
    int rc = FERRY_ENOTFOUND, held = 0;
    int found = FERRY_KV_TIER_NONE;
    ferry__kv_waiter wt = {0};
    pthread_mutex_lock(&kv->mu);
    for (int tries = 0; !held;) {
        uint64_t now = ferry__kv_now_ns(kv);
        ferry__kv_entry *e = ferry__kv_find(kv, id);
        if (!e || e->state != FERRY__KV_READY || !(e->resident || e->l1_loading)) {
            rc = FERRY_ENOTFOUND;
            break;
        }
        if (e->l1_loading) { /* another promotion of it is in flight: it lands on its own */
            pthread_cond_wait(&kv->loaded, &kv->mu);
            continue;
        }
        if (!found)
            found = top_tier(e);
        if (e->resident & (1u << FERRY_KV_TIER_L1)) {
            hold(kv, e, now, out, slot, gen, tokens);
            *tier = (uint8_t)found;
            atomic_fetch_add(&kv->tier[found]->hits, 1);
            held = 1;
            break;
        }
        int src = ferry__kv_lower_tier(kv, e);
        if (!src) {
            rc = FERRY_ENOTFOUND;
            break;
        }
        rc = promote(kv, e, src, now, &wt, wait_ns);
        if (rc < 0)
            break;
        if (rc == 0 && ++tries >= 16) {
            rc = ferry__kv_err(kv, FERRY_ENOSPACE, "kv retrieve: a chunk promoted into L1 was "
                               "evicted again %d times before it could be locked: the pool "
                               "is too crowded", tries);
            break;
        }
    }
    ferry__kv_wait_leave(kv, &wt);
    pthread_mutex_unlock(&kv->mu);
    if (held)
        return 0;
    if (rc == FERRY_ENOTFOUND)
        atomic_fetch_add(&kv->misses, 1);
    return rc;
}

int ferry__kv_slot_release(ferry_kv *kv, ferry__kv_entry *e, uint64_t slot, uint64_t gen)
{
    pthread_mutex_lock(&kv->mu);
    int ok = !e->doomed && (e->resident & (1u << FERRY_KV_TIER_L1)) &&
             e->loc[FERRY_KV_TIER_L1] == slot && kv->l1_gen[slot] == gen;
    ferry__kv_read_unlock(e);
    ferry__kv_put(kv, e);
    ferry__kv_room(kv);
    pthread_mutex_unlock(&kv->mu);
    if (!ok)
        return ferry__kv_err(kv, FERRY_ESTATE,
                             "kv release: slot %llu no longer holds the chunk it was acquired "
                             "for (its lock outlived the read TTL): the bytes read are void",
                             (unsigned long long)slot);
    atomic_fetch_add(&kv->retrieved_chunks, 1);
    atomic_fetch_add(&kv->retrieved_bytes, kv->chunk_bytes);
    atomic_fetch_add(&kv->tier[FERRY_KV_TIER_L1]->bytes_read, kv->chunk_bytes);
    return 0;
}

void ferry__kv_slot_prefetch(ferry_kv *kv, const ferry_kv_hash *ids, size_t n)
{
    ferry__kv_cut *cut = ferry__kv_thread_cut_get();
    if (cut && ferry__kv_cancelled(&cut->why))
        return; /* its client is gone: nothing is read for it */
    if (kv->tier[FERRY_KV_TIER_L2] || kv->tier[FERRY_KV_TIER_REMOTE]) {
        ferry__kv_remote_discover_missing(kv, ids, n, n * kv->chunk_tokens);
        ferry__kv_prefetch_ids(kv, ids, n, n * kv->chunk_tokens, 2, NULL);
    }
}

uint64_t ferry__kv_ahead_dropped(ferry_kv *kv)
{
    return atomic_load(&kv->ahead_dropped);
}
