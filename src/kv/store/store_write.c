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

#include "kv/kv_impl.h"
#include "kv/store/store_int.h"

/* ---- store ---- */

typedef struct pend {
    ferry__kv_entry *e;
    size_t chunk;
    ferry__kv_job *job;  /* write-through, when L2 is configured */
    ferry__kv_job *rjob; /* write-through to the remote tier, when configured */
} pend;

/* one store call: its request and what its batches did so far */
typedef struct wr {
    ferry_kv *kv;
    const ferry_kv_hash *ids;
    size_t nch, n;
    const ferry_kv_buffer *buf;
    ferry_stream *s;           /* device buffers: the copies' stream */
    ferry__kv_tier *l1;
    size_t batch_max;          /* chunks placed at once: half of L1 */
    pend *p;                   /* this batch's placed chunks, np of them */
    size_t np;
    int *st;                   /* per chunk: 0, or why it is not stored */
    size_t next;               /* the first chunk not yet placed */
    int place_rc, copy_rc;     /* the first failure of either step */
    unsigned locked;           /* chunks another writer held */
    uint64_t stored;           /* chunks this call made READY */
} wr;

/* the chunk another writer holds: its status, and (the call's first) a
 * message saying it was skipped, as the layerwise store says it */
static void wr_locked(wr *w, size_t i)
{
    w->st[i] = FERRY_ELOCKED;
    if (!w->locked++)
        ferry__kv_err(w->kv, FERRY_ELOCKED,
                      "kv store: chunk %zu is being written by another writer: skipped, not "
                      "stored by this call", i);
}

/* under mu: a slot for chunk i of the batch: the first waits for one (a
 * batch that holds none); later ones only take what is free. 0, 1 (the
 * batch ends before chunk i, which the next batch asks for again),
 * -EAGAIN (the mutex was dropped: look chunk i up again) or a code */
static int wr_slot(wr *w, ferry__kv_waiter *wt, size_t i, uint64_t *loc)
{
    ferry_kv *kv = w->kv;
    if (w->np)
        return ferry__kv_reserve(kv, FERRY_KV_TIER_L1, ferry__kv_now_ns(kv), loc, RESERVE_TRY) ==
                       0 ? 0 : 1;
    int r = ferry__kv_reserve_l1(kv, wt, kv->pool_wait_ns, RESERVE_WAIT, loc);
    if (r == FERRY_ENOSPACE) {
        char why[320];
        ferry__kv_pool_holders(kv, why, sizeof why);
        return ferry__kv_err(kv, r, "kv store: no L1 slot for chunk %zu after waiting %llu ms: %s",
                             i, (unsigned long long)(kv->pool_wait_ns / 1000000u), why);
    }
    if (r == -ECANCELED)
        return ferry__kv_err(kv, r,
                             "kv store: chunk %zu: the store is closing (ferry_kv_close_begin): "
                             "stopped waiting for an L1 slot; it and the chunks after it are "
                             "not stored", i);
    if (r < 0 && r != -EAGAIN)
        return ferry__kv_err(kv, r, "kv store: no L1 slot for chunk %zu", i);
    return r;
}

/* 1. place: an L1 slot per missing chunk of the next batch, WRITING
 * (invisible); chunks already READY are touched and count as stored. A
 * batch that finds the pool full waits for its first slot only, then
 * takes what is free: the rest goes in the next batch, once this one is
 * committed (a store streams through a crowded pool in pieces that fit) */
static void wr_place(wr *w)
{
    ferry_kv *kv = w->kv;
    ferry__kv_waiter wt = {0};
    size_t i;
    w->np = 0;
    pthread_mutex_lock(&kv->mu);
    uint64_t now = ferry__kv_now_ns(kv);
    for (i = w->next; i < w->nch && w->np < w->batch_max; i++) {
        ferry__kv_entry *e = ferry__kv_find(kv, w->ids[i]);
        if (e && e->state == FERRY__KV_READY) {
            for (int t = 1; t < FERRY_KV_TIERS; t++)
                if (kv->tier[t] && (e->resident & (1u << t)))
                    kv->tier[t]->policy->ops->touch(kv->tier[t]->policy, e);
            w->st[i] = 0;
            continue;
        }
        if (e && ferry__kv_write_locked(e, now)) {
            wr_locked(w, i);
            continue;
        }
        if (e) {
            atomic_fetch_add(&kv->lock_expired, 1);
            ferry__kv_doom(kv, e);
        }
        ferry__kv_entry *ne = ferry__calloc(1, sizeof *ne);
        if (!ne) {
            w->place_rc = ferry__kv_err(kv, -ENOMEM,
                                        "kv store: out of memory for the entry of chunk %zu", i);
            break;
        }
        uint64_t loc;
        int r = wr_slot(w, &wt, i, &loc);
        if (r == -EAGAIN) {
            ferry__free(ne);
            now = ferry__kv_now_ns(kv);
            i--; /* look chunk i up again: another writer may have placed it */
            continue;
        }
        if (r != 0) {
            ferry__free(ne);
            if (r < 0)
                w->place_rc = r;
            break;
        }
        ne->id = w->ids[i];
        ne->state = FERRY__KV_WRITING;
        ne->write_deadline = now + kv->write_ttl_ns;
        ne->refs = 1;
        ne->tokens = ferry__kv_chunk_ntok(kv, i, w->n);
        for (int t = 0; t < FERRY_KV_TIERS; t++)
            ne->loc[t] = UINT64_MAX;
        ne->loc[FERRY_KV_TIER_L1] = loc;
        ferry__kv_index_insert(kv, ne);
        w->p[w->np++] = (pend){ne, i, NULL, NULL};
    }
    ferry__kv_wait_leave(kv, &wt);
    pthread_mutex_unlock(&kv->mu);
    if (w->place_rc < 0)
        w->st[i] = w->place_rc;
    if (w->place_rc < 0 && w->place_rc != -ECANCELED) { /* (a close is no failure) */
        atomic_fetch_add(&kv->alloc_failures, 1);
        atomic_fetch_add(&kv->failures, 1);
    }
    w->next = i;
}

/* 2. copy the batch's bytes in (device: queued, then one synchronization),
 * and allocate its write-through jobs before the commit takes the lock */
static void wr_copy(wr *w)
{
    ferry_kv *kv = w->kv;
    for (size_t k = 0; k < w->np && w->copy_rc == 0; k++) {
        size_t c = w->p[k].chunk;
        void *slot = w->l1->ops->host_ptr(w->l1, w->p[k].e->loc[FERRY_KV_TIER_L1]);
        int rc = ferry__kv_xfer(w->buf, kv->chunk_tokens, (uint64_t)c * kv->chunk_tokens,
                                w->p[k].e->tokens, slot, 1, w->s, NULL);
        if (rc < 0)
            w->copy_rc = ferry__kv_err_pass(kv, rc);
        else
            ferry__kv_count_device_copy(kv, w->buf, rc);
    }
    if (w->s && w->np) {
        int r = ferry_stream_sync(w->s);
        if (r < 0 && w->copy_rc == 0)
            w->copy_rc = ferry__kv_err(kv, r, "kv store: device copies from %s failed: %s",
                                       ferry_device_name(kv->dev), ferry_last_error());
    }
    if (kv->tier[FERRY_KV_TIER_L2] && w->copy_rc == 0)
        for (size_t k = 0; k < w->np; k++)
            w->p[k].job = ferry__calloc(1, sizeof(ferry__kv_job));
    if (kv->tier[FERRY_KV_TIER_REMOTE] && w->copy_rc == 0)
        for (size_t k = 0; k < w->np; k++)
            w->p[k].rjob = ferry__calloc(1, sizeof(ferry__kv_job));
}

/* under mu: queue e's write-throughs (L2 with job, remote with rjob; either
 * may be NULL) on *tail; a job that is not queued is freed */
void ferry__kv_write_through(ferry_kv *kv, ferry__kv_entry *e, ferry__kv_job *j,
                             ferry__kv_job *rj, uint64_t now, ferry__kv_job ***tail)
{
    uint64_t l2loc;
    /* a tier's job that could not be allocated: that write-through is not
     * made, so it is counted as that tier's failure (kv.h), never silent */
    for (int t = FERRY_KV_TIER_L2; t <= FERRY_KV_TIER_REMOTE; t++)
        if (kv->tier[t] && !(t == FERRY_KV_TIER_L2 ? j : rj)) {
            atomic_fetch_add(&kv->tier[t]->failures, 1);
            atomic_fetch_add(&kv->failures, 1);
        }
    if (j && ferry__kv_reserve(kv, FERRY_KV_TIER_L2, now, &l2loc, RESERVE_NOW) == 0) {
        e->l2_writing = 1;
        kv->l2_writes_inflight++;
        ferry__kv_read_lock(kv, e, now);
        e->refs++;
        j->kind = FERRY__KV_JOB_L2WRITE;
        j->run = ferry__kv_job_run;
        j->e = e;
        j->l1_loc = e->loc[FERRY_KV_TIER_L1];
        j->l2_loc = l2loc;
        **tail = j;
        *tail = &j->next;
    } else {
        ferry__free(j);
    }
    if ((j = rj) != NULL) {
        /* the worker hands the L1 copy to the remote's queue; the slot
         * stays read-locked until then */
        kv->l2_writes_inflight++;
        ferry__kv_read_lock(kv, e, now);
        e->refs++;
        j->kind = FERRY__KV_JOB_RWRITE;
        j->run = ferry__kv_job_run;
        j->e = e;
        j->l1_loc = e->loc[FERRY_KV_TIER_L1];
        **tail = j;
        *tail = &j->next;
    }
}

/* 3. commit: the batch READY (visible) and its write-throughs queued, or
 * removed whole when its copy failed */
static void wr_commit(wr *w)
{
    ferry_kv *kv = w->kv;
    ferry__kv_job *head = NULL, **tail = &head;
    pthread_mutex_lock(&kv->mu);
    uint64_t now = ferry__kv_now_ns(kv);
    for (size_t k = 0; k < w->np; k++) {
        ferry__kv_entry *e = w->p[k].e;
        size_t c = w->p[k].chunk;
        if (w->copy_rc < 0 || e->doomed) {
            w->st[c] = w->copy_rc < 0 ? w->copy_rc : FERRY_ELOCKED;
            if (!e->doomed) {
                ferry__kv_tier_release(kv, FERRY_KV_TIER_L1, e->loc[FERRY_KV_TIER_L1]);
                e->loc[FERRY_KV_TIER_L1] = UINT64_MAX;
                ferry__kv_doom(kv, e);
            }
            ferry__kv_put(kv, e);
            ferry__free(w->p[k].job);
            ferry__free(w->p[k].rjob);
            continue;
        }
        e->state = FERRY__KV_READY;
        e->resident |= 1u << FERRY_KV_TIER_L1;
        w->l1->policy->ops->insert(w->l1->policy, e);
        w->st[c] = 0;
        w->stored++;
        ferry__kv_write_through(kv, e, w->p[k].job, w->p[k].rjob, now, &tail);
        ferry__kv_put(kv, e);
    }
    ferry__kv_room(kv); /* the batch is evictable now (or its slots free) */
    pthread_mutex_unlock(&kv->mu);
    for (ferry__kv_job *j = head, *nx; j; j = nx) {
        nx = j->next;
        ferry__kv_enqueue(kv, j);
    }
}

/*
 * Store in batches of at most half of L1: place (reserve slots, WRITING),
 * copy, commit, queue the write-throughs, next batch. A prompt longer than
 * L1 thus streams through it (each batch's write-through overlaps the next
 * batch's copies) instead of needing all its slots at once.
 */
int ferry__kv_do_store(ferry_kv *kv, const ferry_kv_hash *ids, size_t nch, size_t n,
                       const ferry_kv_req *req, const ferry_kv_buffer *buf)
{
    wr w = {0};
    w.kv = kv;
    w.ids = ids;
    w.nch = nch;
    w.n = n;
    w.buf = buf;
    int rc = 0;
    if (buf->mem == FERRY_KV_MEM_DEVICE && (rc = ferry__kv_stream_get(kv, &w.s)) < 0) {
        atomic_fetch_add(&kv->failures, 1);
        return rc;
    }
    w.l1 = kv->tier[FERRY_KV_TIER_L1];
    w.batch_max = (size_t)FERRY__MAX(w.l1->capacity / 2, 1);
    w.p = ferry__calloc(FERRY__MIN(nch, w.batch_max), sizeof *w.p);
    w.st = ferry__malloc(nch * sizeof *w.st);
    if (!w.p || !w.st) {
        ferry__free(w.p);
        ferry__free(w.st);
        ferry__kv_stream_put(kv, w.s);
        atomic_fetch_add(&kv->failures, 1);
        atomic_fetch_add(&kv->alloc_failures, 1);
        return ferry__kv_err(kv, -ENOMEM, "kv store: out of memory for %zu chunks", nch);
    }
    for (size_t i = 0; i < nch; i++)
        w.st[i] = FERRY_ENOTFOUND;
    const atomic_int *cancel = ferry__kv_cancel_flag();
    int cancelled = 0;
    while (w.next < nch && w.place_rc == 0 && w.copy_rc == 0) {
        if (ferry__kv_cancelled(cancel)) { /* between batches: later chunks are not read */
            for (size_t i = w.next; i < nch; i++)
                w.st[i] = -ECANCELED;
            cancelled = 1;
            break;
        }
        wr_place(&w);
        wr_copy(&w);
        wr_commit(&w);
    }
    if (w.place_rc == -ECANCELED) { /* its wait for a slot ended by the close */
        for (size_t i = w.next; i < nch; i++)
            w.st[i] = -ECANCELED;
        cancelled = 1;
    }
    ferry__kv_stream_put(kv, w.s);
    atomic_fetch_add(&w.l1->bytes_written, w.stored * kv->chunk_bytes);
    atomic_fetch_add(&kv->stored_chunks, w.stored);
    atomic_fetch_add(&kv->stored_bytes, w.stored * kv->chunk_bytes);

    size_t lead = 0;
    for (size_t i = 0; i < nch && w.st[i] == 0; i++)
        lead += ferry__kv_chunk_ntok(kv, i, n);
    for (size_t i = 0; i < nch; i++)
        ferry__kv_set_status(req, i, w.st[i]);
    int first = w.st[0];
    ferry__free(w.st);
    ferry__free(w.p);
    if (w.copy_rc < 0) {
        atomic_fetch_add(&kv->failures, 1);
        return w.copy_rc;
    }
    if (lead == 0 && w.place_rc < 0 && first == w.place_rc)
        return w.place_rc;
    return cancelled ? -ECANCELED : (int)lead;
}
