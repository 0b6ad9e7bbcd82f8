/*
 * store_check.c - test seams: a chunk's state, an abandoned write, and a
 * walk that checks every invariant of the index and the tiers' accounting.
 */
#include <errno.h>
#include <stddef.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv/kv_impl.h"
#include "kv/store/store_int.h"

/* ---- test seams: state and a consistency walk ---- */

int ferry__kv_chunk_state(ferry_kv *kv, ferry_kv_hash h, const void *salt, size_t salt_len,
                          uint8_t *resident, uint32_t *readers)
{
    ferry_kv_req r = FERRY_KV_REQ_INIT;
    r.salt = salt;
    r.salt_len = salt_len;
    ferry_kv_hash ns = ferry__kv_ns_of(kv, &r);
    h.lo ^= ns.lo;
    h.hi ^= ns.hi;
    pthread_mutex_lock(&kv->mu);
    ferry__kv_entry *e = ferry__kv_find(kv, h);
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
    int nch = ferry__kv_make_ids(kv, tokens, n, req, "abandon", stack, &ids);
    if (nch < 0)
        return nch;
    int placed = 0;
    pthread_mutex_lock(&kv->mu);
    uint64_t now = ferry__kv_now_ns(kv);
    for (int i = 0; i < nch; i++) {
        if (ferry__kv_find(kv, ids[i]))
            continue;
        ferry__kv_entry *e = ferry__calloc(1, sizeof *e);
        uint64_t loc;
        if (!e || ferry__kv_reserve(kv, FERRY_KV_TIER_L1, now, &loc, RESERVE_NOW) < 0) {
            ferry__free(e);
            break;
        }
        e->id = ids[i];
        e->state = FERRY__KV_WRITING;
        e->write_deadline = now + kv->write_ttl_ns;
        e->tokens = ferry__kv_chunk_ntok(kv, (size_t)i, n);
        for (int t = 0; t < FERRY_KV_TIERS; t++)
            e->loc[t] = UINT64_MAX;
        e->loc[FERRY_KV_TIER_L1] = loc;
        ferry__kv_index_insert(kv, e);
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
            if (ferry__kv_bucket_of(kv, e->id) != b)
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
