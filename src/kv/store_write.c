/*
 * store_write.c - the store path: place, copy, commit, write through.
 *
 * Nothing half-written becomes visible: an entry turns READY only after all
 * its bytes landed; if any copy fails, the entries of that call are removed
 * and their slots released. A prompt longer than L1 streams through it in
 * batches whose write-throughs overlap the next batch's copies.
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
#include "store_int.h"
#include "tier_pslab.h"

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
    if (buf->mem == FERRY_KV_MEM_DEVICE && (rc = ferry__kv_stream_get(kv, &s)) < 0) {
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
        ferry__kv_stream_put(kv, s);
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
        uint64_t now = ferry__kv_now_ns(kv);
        for (i = next; i < nch && np < batch_max; i++) {
            ferry__kv_entry *e = ferry__kv_find(kv, ids[i]);
            if (e && e->state == FERRY__KV_READY) {
                for (int t = 1; t < FERRY_KV_TIERS; t++)
                    if (kv->tier[t] && (e->resident & (1u << t)))
                        kv->tier[t]->policy->ops->touch(kv->tier[t]->policy, e);
                st[i] = 0;
                continue;
            }
            if (e && ferry__kv_write_locked(e, now)) {
                st[i] = FERRY_ELOCKED;
                continue;
            }
            if (e) {
                atomic_fetch_add(&kv->lock_expired, 1);
                ferry__kv_doom(kv, e);
            }
            ferry__kv_entry *ne = ferry__calloc(1, sizeof *ne);
            if (!ne) {
                place_rc = ferry__kv_err(kv, -ENOMEM,
                                          "kv store: out of memory for the entry of chunk %zu", i);
                break;
            }
            uint64_t loc;
            int r = ferry__kv_reserve(kv, FERRY_KV_TIER_L1, now, &loc, RESERVE_WAIT);
            if (r == -EAGAIN) {
                ferry__free(ne);
                now = ferry__kv_now_ns(kv);
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
            ne->tokens = ferry__kv_chunk_ntok(kv, i, n);
            for (int t = 0; t < FERRY_KV_TIERS; t++)
                ne->loc[t] = UINT64_MAX;
            ne->loc[FERRY_KV_TIER_L1] = loc;
            ferry__kv_index_insert(kv, ne);
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
        now = ferry__kv_now_ns(kv);
        for (size_t k = 0; k < np; k++) {
            ferry__kv_entry *e = p[k].e;
            size_t c = p[k].chunk;
            if (copy_rc < 0 || e->doomed) {
                st[c] = copy_rc < 0 ? copy_rc : FERRY_ELOCKED;
                if (!e->doomed) {
                    ferry__kv_tier_release(kv, FERRY_KV_TIER_L1, e->loc[FERRY_KV_TIER_L1]);
                    e->loc[FERRY_KV_TIER_L1] = UINT64_MAX;
                    ferry__kv_doom(kv, e);
                }
                ferry__kv_put(kv, e);
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
            if (j && ferry__kv_reserve(kv, FERRY_KV_TIER_L2, now, &l2loc, RESERVE_NOW) == 0) {
                e->l2_writing = 1;
                kv->l2_writes_inflight++;
                ferry__kv_read_lock(kv, e, now);
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
                ferry__kv_read_lock(kv, e, now);
                e->refs++;
                j->kind = FERRY__KV_JOB_RWRITE;
                j->e = e;
                j->l1_loc = e->loc[FERRY_KV_TIER_L1];
                *tail = j;
                tail = &j->next;
            }
            ferry__kv_put(kv, e);
        }
        pthread_mutex_unlock(&kv->mu);
        for (ferry__kv_job *j = head, *nx; j; j = nx) {
            nx = j->next;
            ferry__kv_enqueue(kv, j);
        }
    }
    ferry__kv_stream_put(kv, s);
    atomic_fetch_add(&l1->bytes_written, stored * kv->chunk_bytes);
    atomic_fetch_add(&kv->stored_chunks, stored);
    atomic_fetch_add(&kv->stored_bytes, stored * kv->chunk_bytes);

    size_t lead = 0;
    for (i = 0; i < nch && st[i] == 0; i++)
        lead += ferry__kv_chunk_ntok(kv, i, n);
    for (i = 0; i < nch; i++)
        ferry__kv_set_status(req, i, st[i]);
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
