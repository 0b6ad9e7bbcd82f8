/*
 * store_lookup.c - the longest cached prefix of a prompt.
 *
 * A lookup walks the index chunk by chunk and stops at the first miss; what
 * this process never indexed is asked of the remote tier once, pipelined, and
 * a chunk is remote-resident only on the server's word.
 */
#include <errno.h>
#include <stddef.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv/kv_impl.h"
#include "kv/backend.h"
#include "kv/store/store_int.h"

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
    int got = rt->ops->exists ? rt->ops->exists(rt, ids, cnt) : 0;
    if (got <= 0)
        return 0;
    size_t i;
    pthread_mutex_lock(&kv->mu);
    uint64_t now = ferry__kv_now_ns(kv);
    for (i = 0; i < (size_t)got; i++) {
        ferry__kv_entry *e = ferry__kv_find(kv, ids[i]);
        if (e && e->state != FERRY__KV_READY && ferry__kv_write_locked(e, now))
            break;
        if (e && (e->resident & (1u << FERRY_KV_TIER_REMOTE)))
            continue;
        if (e && e->state != FERRY__KV_READY) {
            /* a writer that outlived its lock: reclaim its entry */
            atomic_fetch_add(&kv->lock_expired, 1);
            ferry__kv_doom(kv, e);
            e = NULL;
        }
        ferry__kv_entry *ne = e ? NULL : ferry__calloc(1, sizeof *ne);
        uint64_t loc;
        if ((!e && !ne) || ferry__kv_reserve(kv, FERRY_KV_TIER_REMOTE, now, &loc, RESERVE_NOW) < 0) {
            ferry__free(ne);
            break;
        }
        if (!e) {
            ne->id = ids[i];
            ne->state = FERRY__KV_READY;
            ne->tokens = ferry__kv_chunk_ntok(kv, first + i, n);
            for (int t = 0; t < FERRY_KV_TIERS; t++)
                ne->loc[t] = UINT64_MAX;
            ferry__kv_index_insert(kv, ne);
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
void ferry__kv_remote_discover_missing(ferry_kv *kv, const ferry_kv_hash *ids, size_t nch, size_t n)
{
    if (!kv->tier[FERRY_KV_TIER_REMOTE])
        return;
    size_t first = nch;
    pthread_mutex_lock(&kv->mu);
    for (size_t i = 0; i < nch; i++)
        if (!present(ferry__kv_find(kv, ids[i]))) {
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
        ferry__kv_entry *e = ferry__kv_find(kv, ids[j]);
        if (!e || e->state != FERRY__KV_READY || !e->resident)
            break;
        int tier = top_tier(e);
        ferry__kv_tier *t = kv->tier[tier];
        if (t)
            t->policy->ops->touch(t->policy, e);
        hits[tier]++;
        ferry__kv_set_tier(req, first + j, tier);
        *tokens += ferry__kv_chunk_ntok(kv, first + j, n);
    }
    return j;
}

/* the in-process lookup: ids a block at a time (a miss ends the hashing),
 * then the remote tier asked about the rest at once */
int ferry__kv_local_lookup(ferry_kv *kv, ferry__kv_idsrc *src, const ferry_kv_req *req)
{
    uint64_t t0 = ferry__now_ns();
    size_t nch = src->nch, n = src->n;
    ferry_kv_hash blk[LOOKUP_BLOCK];
    size_t hit = 0, i = 0, k = 0, got = 0;
    uint64_t hits[FERRY_KV_TIERS] = {0};
    while (i < nch) {
        k = FERRY__MIN((size_t)LOOKUP_BLOCK, nch - i);
        ferry__kv_idsrc_take(src, k, blk);
        pthread_mutex_lock(&kv->mu);
        got = lookup_walk(kv, blk, k, i, n, req, hits, &hit);
        pthread_mutex_unlock(&kv->mu);
        i += got;
        if (got < k)
            break;
    }
    if (i < nch && kv->tier[FERRY_KV_TIER_REMOTE]) {
        /* ids of chunks i..nch: the rest of this block, then the rest */
        size_t cnt = nch - i, have = k - got;
        ferry_kv_hash stack[STACK_CHUNKS], *ids = stack;
        if (cnt > STACK_CHUNKS)
            ids = ferry__malloc(cnt * sizeof *ids);
        if (ids) {
            memcpy(ids, blk + got, have * sizeof *ids);
            if (cnt > have)
                ferry__kv_idsrc_take(src, cnt - have, ids + have);
            remote_discover(kv, ids, cnt, i, n);
            pthread_mutex_lock(&kv->mu);
            i += lookup_walk(kv, ids, cnt, i, n, req, hits, &hit);
            pthread_mutex_unlock(&kv->mu);
            if (ids != stack)
                ferry__free(ids);
        }
    }
    if (i < nch)
        ferry__kv_set_tier(req, i, FERRY_KV_TIER_NONE);
    for (int t = 1; t < FERRY_KV_TIERS; t++)
        if (hits[t] && kv->tier[t])
            atomic_fetch_add(&kv->tier[t]->hits, hits[t]);
    atomic_fetch_add(&kv->lookups, 1);
    atomic_fetch_add(&kv->lookup_tokens, n);
    atomic_fetch_add(&kv->hit_tokens, hit);
    ferry__kv_hist_record(&kv->h_lookup, ferry__now_ns() - t0);
    return (int)hit;
}
