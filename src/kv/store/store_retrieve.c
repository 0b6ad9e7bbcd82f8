/*
 * store_retrieve.c - one retrieve: chunks from wherever they are into the
 * engine's buffer, L2 reads kept in flight and copied out as they land.
 */
#include <errno.h>
#include <stddef.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/env.h"
#include "kv/kv_impl.h"
#include "kv/kv_slots.h"
#include "kv/store/store_int.h"
#include "kv/store/store_rt.h"

/* ---- retrieve ---- */
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
                if (r->c[r->hidx[k]].st == 0) {
                    r->c[r->hidx[k]].st = r->copy_rc;
                    r->got--;
                }
        }
    }
    pthread_mutex_lock(&kv->mu);
    for (size_t k = 0; k < r->nheld; k++) {
        ferry__kv_entry **h = &r->c[r->hidx[k]].held;
        ferry__kv_read_unlock(*h);
        ferry__kv_put(kv, *h);
        *h = NULL;
    }
    ferry__kv_room(kv);
    pthread_mutex_unlock(&kv->mu);
    r->nheld = 0;
}

/* the copy of chunk i from its L1 bytes into the engine's buffer, and its
 * outcome (under cmu when a worker may run copies too) */
static void rt_copy_chunk(rtv *r, size_t i, const void *src)
{
    ferry_kv *kv = r->kv;
    if (ferry__kv_cancelled(r->cancel)) { /* the caller's buffer is no longer ours */
        if (r->wcopy)
            pthread_mutex_lock(&r->cmu);
        r->c[i].st = -ECANCELED;
        r->ncancel++;
        if (r->wcopy)
            pthread_mutex_unlock(&r->cmu);
        return;
    }
    ferry__kv_span sp = ferry__kv_span_from(&kv->layout, kv->chunk_tokens, i,
                                            ferry__kv_chunk_ntok(kv, i, r->n), r->skip);
    /* (the copies of chunks read from L2 count: a small L1 hit's copy would
     * cost less than reading the clock) */
    int acct = !r->s && r->c[i].froml2;
    uint64_t t = acct ? ferry__thread_cpu_ns() : 0;
    int rc = sp.ntok ? ferry__kv_xfer(r->buf, kv->chunk_tokens, sp.tok0, sp.ntok,
                                      (char *)(uintptr_t)src + sp.img_off, 0, r->s, NULL)
                     : 0; /* wholly the engine's own tokens: nothing to write */
    if (acct)
        rt_spent(&kv->rt_copy_ns, t);
    if (rc >= 0 && r->c[i].froml2) {
        rt_first(r, &r->first_bytes);
        rt_first(r, &r->first_chunk);
    }
    if (r->wcopy)
        pthread_mutex_lock(&r->cmu);
    if (rc < 0) {
        if (r->copy_rc == 0)
            r->copy_rc = ferry__kv_err_pass(kv, rc);
        r->c[i].st = rc;
    } else {
        ferry__kv_count_device_copy(kv, r->buf, rc);
        r->c[i].st = 0;
        r->got++;
    }
    if (r->wcopy)
        pthread_mutex_unlock(&r->cmu);
}

/* a copy failed (the first failure's code), read safely while a worker copies */
int ferry__kv_rt_failed(rtv *r)
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
    ferry__kv_read_unlock(r->c[i].held);
    ferry__kv_put(kv, r->c[i].held);
    r->c[i].held = NULL;
    ferry__kv_room(kv);
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
    rt_copy_chunk(r, i, r->c[i].csrc);
    rt_release(r, i);
    rt_job_done(r);
}

/* a copy job on a worker */
static void rt_run_copy(ferry_kv *kv, ferry__kv_job *j)
{
    (void)kv;
    j->copy(j->ctx, j->idx);
}

/*
 * Host buffer: the I/O workers take a retrieve's copies while they are
 * free for them (nothing queued, fewer of ours pending than workers), else
 * an idle operation worker does, so the retrieving thread goes straight
 * back to the reads. 1: chunk i's copy was queued as job(r, i); 0: no
 * worker is free, the caller copies.
 */
int ferry__kv_rt_hand_off(rtv *r, size_t i, void (*job)(void *ctx, size_t i), void *ctx)
{
    if (!r->wcopy)
        return 0;
    pthread_mutex_lock(&r->cmu);
    unsigned mine = r->wpending;
    pthread_mutex_unlock(&r->cmu);
    /* an I/O worker with nothing to read, else an idle operation worker
     * (while the I/O workers wait on reads of a tier without asynchronous
     * ones, the operation workers usually have nothing to do) */
    int io = ferry__kv_io_worker_free(r->kv, mine);
    int ops = !io && ferry__kv_op_worker_free(r->kv);
    ferry__kv_job *j = io || ops ? ferry__calloc(1, sizeof *j) : NULL;
    if (!j)
        return 0;
    j->kind = FERRY__KV_JOB_COPY;
    j->run = rt_run_copy;
    j->copy = job;
    j->ctx = ctx;
    j->idx = i;
    pthread_mutex_lock(&r->cmu);
    r->wpending++;
    pthread_mutex_unlock(&r->cmu);
    if (io) {
        ferry__kv_enqueue(r->kv, j);
        return 1;
    }
    /* an operation worker only if one is still idle for it: an operation
     * queued meanwhile may wait for this very copy (the chunk it promotes) */
    if (ferry__kv_lend(r->kv, j))
        return 1;
    pthread_mutex_lock(&r->cmu);
    r->wpending--; /* (only this thread waits for its own copies) */
    pthread_mutex_unlock(&r->cmu);
    ferry__free(j);
    return 0;
}

/* chunk i, read-locked and resident in L1, into the engine's buffer.
 * Called with kv->mu held; returns with it released. */
static void rt_copy_out(rtv *r, size_t i, ferry__kv_entry *e)
{
    ferry_kv *kv = r->kv;
    ferry__kv_tier *l1 = kv->tier[FERRY_KV_TIER_L1];
    l1->policy->ops->touch(l1->policy, e);
    e->ahead_until = 0; /* (read ahead for this copy, if it was) */
    void *src = l1->ops->host_ptr(l1, e->loc[FERRY_KV_TIER_L1]);
    pthread_mutex_unlock(&kv->mu);
    r->c[i].held = e;
    if (!r->s) {
        /* host buffer: a free worker copies, else this thread. Each copy
         * drops its chunk's read lock when done, so a retrieve holds no
         * more slots than copies running. */
        r->c[i].csrc = src;
        if (ferry__kv_rt_hand_off(r, i, rt_copy_job, r))
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
    int rc = t->aops->verify(t, r->c[i].aloc, &e->id, sum);
    if (rc < 0)
        ferry__kv_tier_io_done(r->kv, t, 0, r->c[i].aloc, &e->id, 0, rc);
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
    ferry__kv_entry *e = r->c[i].held;
    uint64_t sum = 0;
    int cancelled = ferry__kv_cancelled(r->cancel);
    ferry__kv_span sp = ferry__kv_span_from(&kv->layout, kv->chunk_tokens, i, kv->chunk_tokens,
                                            r->skip);
    /* the whole chunk goes to the engine: hash it while copying it out.
     * Else (cancelled, or a chunk reaching below skip_tokens) the slot is
     * checked first (it is promoted either way) and only then is its part
     * from skip_tokens on copied out. */
    int fused = !cancelled && !sp.img_off && sp.ntok;
    uint64_t ts = ferry__thread_cpu_ns();
    int rc = fused ? ferry__kv_xfer_out_sum(r->buf, kv->chunk_tokens,
                                            (uint64_t)i * kv->chunk_tokens, r->c[i].adst, &sum)
                   : 0;
    rt_spent(&kv->rt_copy_ns, ts);
    ts = ferry__thread_cpu_ns();
    if (!fused || rc < 0) /* (host copies do not fail; the slot is still checked) */
        sum = ferry__kv_sum(r->c[i].adst, kv->chunk_bytes);
    int vrc = rt_check(r, i, e, sum);
    rt_spent(&kv->rt_check_ns, ts);
    if (fused && rc == 0 && vrc < 0) /* the engine never holds the bad bytes */
        ferry__kv_xfer_out_zero(r->buf, kv->chunk_tokens, (uint64_t)i * kv->chunk_tokens,
                                kv->chunk_tokens);
    if (!fused && !cancelled && vrc == 0 && sp.ntok) {
        ts = ferry__thread_cpu_ns();
        rc = ferry__kv_xfer(r->buf, kv->chunk_tokens, sp.tok0, sp.ntok,
                            r->c[i].adst + sp.img_off, 0, NULL, NULL);
        rt_spent(&kv->rt_copy_ns, ts);
    }
    if (!cancelled && vrc == 0 && rc >= 0) {
        rt_first(r, &r->first_bytes);
        rt_first(r, &r->first_chunk);
    }
    pthread_mutex_lock(&kv->mu);
    FERRY__ASSERT(kv->l1_reading > 0);
    kv->l1_reading--;
    ferry__kv_promote_finish(kv, e, r->c[i].slot, vrc, t->id); /* (wakes reserve's waiters) */
    ferry__kv_read_unlock(e);
    ferry__kv_put(kv, e);
    r->c[i].held = NULL;
    pthread_mutex_unlock(&kv->mu);
    if (r->wcopy)
        pthread_mutex_lock(&r->cmu);
    if (cancelled && vrc == 0) {
        r->c[i].st = -ECANCELED;
        r->ncancel++;
    } else if (rc < 0) {
        if (r->copy_rc == 0)
            r->copy_rc = ferry__kv_err_pass(kv, rc);
        r->c[i].st = rc;
    } else if (vrc < 0) {
        r->c[i].st = vrc;
        r->vbad++;
    } else {
        r->c[i].st = 0;
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
    r->c[i].held = e;
    if (!ferry__kv_rt_hand_off(r, i, rt_verify_job, r))
        rt_verify_copy(r, i);
}

static void rt_read_done(rtv *r, size_t i, int rc);

/* chunk i (entry e) landed whole from the async tier: checked */
static int rt_check_whole(rtv *r, size_t i, const ferry__kv_entry *e)
{
    uint64_t t = ferry__thread_cpu_ns();
    int rc = ferry__kv_tier_check_whole(r->at, r->c[i].aloc, &e->id, r->c[i].adst,
                                        r->kv->chunk_bytes);
    rt_spent(&r->kv->rt_check_ns, t);
    return rc;
}

/* chunk i's read is over (every piece sent has landed): count it */
/* chunk i's first failure: its code and message (the message is logged
 * when the chunk's last piece lands, after other chunks' failures) */
static void rt_fail(rtv *r, size_t i, int rc, const char *why)
{
    if (r->c[i].res != 0 && r->c[i].res != -ENOMEM)
        return;
    if (r->c[i].res == -ENOMEM && rc == -ENOMEM)
        return;
    r->c[i].res = rc;
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
    int rc = r->c[i].res;
    r->first_hold = 0; /* (its first chunk read: the others may start) */
    if (r->c[i].begun) { /* (its check, if any, comes after: verify) */
        t->aops->end(t, r->c[i].aloc);
        r->c[i].begun = 0;
    }
    if ((rc == -ENOMEM || rc == -EBUSY) && r->c[i].lost == 2) {
        atomic_fetch_add(&r->kv->failures, 1); /* ours, not the tier's */
    } else {
        if (rc < 0 && r->why && r->why[i][0])
            ferry__err_set(NULL, rc, "%s", r->why[i]);
        ferry__kv_tier_io_done(r->kv, t, 0, r->c[i].aloc, &r->c[i].pend->id, t->slot_bytes, rc);
    }
    r->c[i].fate = RT_LANDED;
    r->reading--;
}

/* send the next piece of chunk i (a: its request, or NULL to take one);
 * a failure ends its read (the pieces in flight still land) */
static void rt_send(rtv *r, size_t i, ferry__kv_aread *a)
{
    ferry_kv *kv = r->kv;
    ferry__kv_tier *t = r->at;
    uint64_t off = (uint64_t)r->c[i].sent * r->piece;
    size_t len = (size_t)FERRY__MIN(r->piece, t->slot_bytes - off);
    if (r->c[i].direct && r->c[i].sent && ferry__kv_cancelled(r->cancel)) {
        /* the engine's buffer is to be let go: no more of it is read; the
         * pieces in flight land, then the chunk is zeroed (kv.h) */
        if (a)
            t->aops->put(t, a);
        r->c[i].dstop = 1;
        r->c[i].sent = r->npieces;
        r->cur = SIZE_MAX;
        if (r->c[i].left == 0) {
            rt_landed(r, i);
            rt_read_done(r, i, r->c[i].res);
        }
        return;
    }
    if (!a)
        a = t->aops->get(t);
    int rc = a ? 0 : ferry__err_set(NULL, -ENOMEM, "kv L2: out of memory for a read request");
    if (rc == 0 && r->c[i].sent == 0)
        rc = ferry__kv_tier_fault(kv, t, 0, r->c[i].aloc, t->slot_bytes);
    int busy = 0; /* begin found the tier's location still being read */
    if (rc == 0 && r->c[i].sent == 0 && t->aops->begin) {
        rc = t->aops->begin(t, r->c[i].aloc, &r->c[i].pend->id, t->slot_bytes);
        r->c[i].begun = rc == 0;
        busy = rc == -EBUSY;
    }
    if (rc == 0 && r->c[i].sent == 0)
        ferry__kv_rt_piece_mode(r, i);
    if (rc == 0) {
        a->idx = i;
        a->piece = r->c[i].sent;
        rc = r->c[i].direct
                 ? ferry__kv_rt_direct_submit(r, i, a, off, len)
                 : t->aops->submit(t, &r->batch, a, r->c[i].aloc, off, r->c[i].adst + off, len);
    }
    if (rc == 0) {
        r->inflight++;
        r->c[i].left++;
        if (++r->c[i].sent == r->npieces)
            r->cur = SIZE_MAX;
        return;
    }
    t->aops->put(t, a);
    rt_fail(r, i, rc, ferry_last_error());
    r->c[i].sent = r->npieces;
    r->cur = SIZE_MAX;
    /* the queue broke, memory ran out, or the tier's slot is still being
     * read by an earlier read (begin's -EBUSY): not this chunk's L2 copy,
     * which is kept, and its slot goes back once the pieces in flight
     * landed (a break with pieces still in flight makes rt_reap retire it) */
    if ((t->aops->broken && t->aops->broken(t)) || rc == -ENOMEM || busy)
        r->c[i].lost = 2;
    if (r->c[i].left == 0) {
        rt_landed(r, i);
        rt_read_done(r, i, r->c[i].res);
    }
}

/* (kv->mu held) e is a chunk only in the async tier t, not being read */
static int rt_async_only(ferry_kv *kv, ferry__kv_tier *t, const ferry__kv_entry *e)
{
    return e && e->state == FERRY__KV_READY && e->resident &&
           !(e->resident & (1u << FERRY_KV_TIER_L1)) && !e->l1_loading &&
           kv->tier[ferry__kv_lower_tier(kv, e)] == t;
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
    /* straight into the engine's buffer when it can be: no L1 slot (its
     * runs planned outside the lock, for a chunk that is to be read) */
    pthread_mutex_lock(&kv->mu);
    int direct = rt_async_only(kv, t, ferry__kv_find(kv, ids[i]));
    pthread_mutex_unlock(&kv->mu);
    direct = direct && ferry__kv_rt_direct_plan(r, i);
    pthread_mutex_lock(&kv->mu);
    uint64_t now = ferry__kv_now_ns(kv);
    ferry__kv_entry *e = ferry__kv_find(kv, ids[i]);
    if (!rt_async_only(kv, t, e)) {
        pthread_mutex_unlock(&kv->mu);
        ferry__kv_rt_direct_drop(r, i);
        t->aops->put(t, a);
        return 0;
    }
    uint64_t slot = 0;
    if (!direct && ferry__kv_reserve(kv, FERRY_KV_TIER_L1, now, &slot, RESERVE_TRY) < 0) {
        pthread_mutex_unlock(&kv->mu);
        t->aops->put(t, a);
        return -1;
    }
    e->l1_loading = 1; /* (direct too: another retrieve of it waits for this read) */
    if (!direct)
        kv->l1_reading++;
    ferry__kv_read_lock(kv, e, now);
    e->refs++;
    r->c[i].aloc = e->loc[t->id];
    ferry__kv_tier *l1 = kv->tier[FERRY_KV_TIER_L1];
    r->c[i].adst = direct ? NULL : l1->ops->host_ptr(l1, slot);
    pthread_mutex_unlock(&kv->mu);
    r->c[i].fate = RT_READING;
    r->c[i].pend = e;
    r->c[i].slot = slot;
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
    ferry__kv_entry *e = r->c[i].pend;
    r->c[i].pend = NULL;
    r->c[i].fate = RT_DONE;
    if (r->c[i].direct) { /* read straight into the engine's buffer */
        ferry__kv_rt_direct_done(r, i, e, rc);
        return;
    }
    /* its bytes count only once checked against what was written there:
     * a whole chunk for a host buffer is checked as it is copied out, and
     * promoted after; any other is checked here, before it is promoted */
    int deferred = 0;
    if (r->c[i].vp) {
        /* piece mode: every piece was checked as it landed (copied out
         * too with pcopy); a chunk that failed in any way is a miss whose
         * copied-out part is zeroed */
        int bad = ferry__kv_rt_pieces_done(r, i);
        if (rc == 0 && bad < 0) {
            rc = bad;
            r->c[i].st = bad;
            ferry__err_set(NULL, bad, "%s", r->why[i]);
            ferry__kv_tier_io_done(kv, r->at, 0, r->c[i].aloc, &e->id, 0, bad);
        }
        if (r->c[i].pcopy && r->c[i].pstate == 1 && (rc < 0 || r->c[i].lost))
            ferry__kv_xfer_out_zero(r->buf, kv->chunk_tokens, (uint64_t)i * kv->chunk_tokens,
                                    kv->chunk_tokens);
        if (rc == 0 && !r->c[i].lost && r->c[i].pcopy) {
            ferry__kv_rt_pieces_finish(r, i, e);
            return;
        }
    } else if (rc == 0 && !r->c[i].lost && r->at->aops->verify) {
        if (!r->s && ferry__kv_chunk_ntok(kv, i, r->n) == kv->chunk_tokens && ferry__kv_rt_failed(r) == 0)
            deferred = 1;
        else if ((rc = rt_check_whole(r, i, e)) < 0) {
            ferry__kv_tier_io_done(kv, r->at, 0, r->c[i].aloc, &e->id, 0, rc);
            r->c[i].st = rc;
        }
    }
    pthread_mutex_lock(&kv->mu);
    if (deferred) {
        r->hits[r->at->id]++; /* (taken back if the check fails) */
        rt_verify_out(r, i, e);
        return;
    }
    FERRY__ASSERT(kv->l1_reading > 0);
    kv->l1_reading--;
    if (r->c[i].lost == 2) {
        /* the queue broke before any piece of it was in flight: its slot
         * goes back, its L2 copy is kept, the chunk is a miss here */
        e->l1_loading = 0;
        ferry__kv_tier_release(kv, FERRY_KV_TIER_L1, r->c[i].slot);
        pthread_cond_broadcast(&kv->loaded);
        r->misses++;
        ferry__kv_read_unlock(e);
        ferry__kv_put(kv, e);
        pthread_mutex_unlock(&kv->mu);
        return;
    }
    if (r->c[i].lost) {
        /* the read may still land, into its slot: the slot stays reserved
         * for good (L1 is one slot smaller), the L2 copy is kept (the disk
         * did not fail, the queue did), and the chunk is a miss here */
        e->l1_loading = 0;
        kv->l1_retired++;
        pthread_cond_broadcast(&kv->loaded);
        FERRY_LOGW("kv retrieve: the L2 read queue broke with a read in flight; its L1 slot "
                   "%llu is retired", (unsigned long long)r->c[i].slot);
        r->misses++;
        ferry__kv_read_unlock(e);
        ferry__kv_put(kv, e);
        pthread_mutex_unlock(&kv->mu);
        return;
    }
    ferry__kv_promote_finish(kv, e, r->c[i].slot, rc, r->at->id); /* (wakes reserve's waiters) */
    int failed = ferry__kv_rt_failed(r);
    if (failed < 0 || !(e->resident & (1u << FERRY_KV_TIER_L1))) {
        if (failed == 0)
            r->misses++;
        ferry__kv_read_unlock(e);
        ferry__kv_put(kv, e);
        pthread_mutex_unlock(&kv->mu);
        return;
    }
    r->hits[r->at->id]++;
    r->c[i].froml2 = 1;
    rt_copy_out(r, i, e);
}

/* wait until at least one of this retrieve's requests landed (none when
 * none is in flight); chunks whose every piece has landed become
 * RT_LANDED with their result in r->res; returns how many did */
static unsigned rt_reap(rtv *r)
{
    ferry__kv_tier *t = r->at;
    ferry__kv_aread *a = NULL;
    ferry__kv_rt_units_run(r); /* (while the reads are in flight) */
    int rc = t->aops->wait(t, &r->batch, &a);
    unsigned k = 0;
    if (rc < 0) {
        /* the tier's queue broke: every read of ours still in flight is lost */
        ferry__kv_err_pass(r->kv, rc);
        for (size_t i = 0; i < r->nch; i++) {
            if (r->c[i].fate != RT_READING)
                continue;
            r->c[i].res = 0; /* the break is what this chunk's warning says */
            rt_fail(r, i, rc, ferry_last_error());
            r->c[i].lost = r->c[i].left ? 1 : 2;
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
            if (r->c[i].res == -ENOMEM && r->c[i].lost == 2)
                r->c[i].res = 0; /* (that was ours, this is the disk's) */
            rt_fail(r, i, rc, a->why);
            r->c[i].lost = 0;
        }
        uint32_t piece = a->piece;
        t->aops->put(t, a);
        if (rc == 0 && r->c[i].vp)
            ferry__kv_rt_piece_landed(r, i, piece); /* (checks nothing once the chunk failed) */
        r->inflight--;
        r->c[i].left--;
        r->ramp = FERRY__MIN(2 * r->ramp, r->pdepth);
        if (rc < 0) {
            /* its pieces not sent yet never are */
            r->c[i].sent = r->npieces;
            if (r->cur == i)
                r->cur = SIZE_MAX;
        }
        if (r->c[i].left == 0 && r->c[i].sent == r->npieces) {
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
    while (r->inflight < FERRY__MIN(r->pdepth, r->ramp)) {
        if (r->cur != SIZE_MAX) {
            rt_send(r, r->cur, NULL);
            continue;
        }
        if (*blocked || r->reading >= r->depth || *ic >= r->nch || ferry__kv_rt_failed(r) < 0 ||
            (r->first_hold && r->reading > 0))
            return;
        if (r->c[*ic].fate == RT_OPEN && rt_issue(r, ids, *ic) < 0) {
            *blocked = 1;
            return;
        }
        (*ic)++;
    }
}

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
        now = ferry__kv_now_ns(kv);
        e = ferry__kv_find(kv, ids[i]);
        if (!e || e->state != FERRY__KV_READY || !e->l1_loading)
            break;
        pthread_cond_wait(&kv->loaded, &kv->mu);
    }
    if (!e || e->state != FERRY__KV_READY || !e->resident) {
        pthread_mutex_unlock(&kv->mu);
        r->misses++;
        return 1;
    }
    ferry__kv_read_lock(kv, e, now);
    e->refs++;
    if (!(e->resident & (1u << FERRY_KV_TIER_L1))) {
        /* only in a lower tier: promote into a fresh L1 slot */
        uint64_t slot;
        int src = ferry__kv_lower_tier(kv, e);
        /* with copies of ours on the workers, only try: if L1 is full
         * this chunk waits for one of them below, no failure counted */
        unsigned copying = 0;
        if (src && r->wcopy) {
            pthread_mutex_lock(&r->cmu);
            copying = r->wpending;
            pthread_mutex_unlock(&r->cmu);
        }
        /* holding nothing (no read or copy of its own in flight), it waits
         * up to the pool's deadline for a slot, in turn with the others */
        int rc = !src      ? FERRY_ENOTFOUND
                 : copying ? ferry__kv_reserve(kv, FERRY_KV_TIER_L1, now, &slot, RESERVE_TRY)
                 : r->inflight
                     ? ferry__kv_reserve(kv, FERRY_KV_TIER_L1, now, &slot, RESERVE_WAIT)
                     : ferry__kv_reserve_l1(kv, &r->wt,
                                            r->declined ? FERRY__KV_TAKE_FREE : kv->pool_wait_ns,
                                            RESERVE_WAIT_READS, &slot);
        if (rc != -EAGAIN)
            ferry__kv_wait_leave(kv, &r->wt);
        if (rc == FERRY_ENOSPACE && !copying && !r->inflight)
            r->declined = 1;
        if (rc == -EAGAIN) {
            /* the mutex was released: start this chunk over */
            ferry__kv_read_unlock(e);
            ferry__kv_put(kv, e);
            pthread_mutex_unlock(&kv->mu);
            return 0;
        }
        if (rc == FERRY_ENOSPACE && r->inflight) {
            /* L1 is full and some of it is our own reads in flight: they
             * land (and free their locks) before this chunk is tried again */
            ferry__kv_read_unlock(e);
            ferry__kv_put(kv, e);
            pthread_mutex_unlock(&kv->mu);
            return -1;
        }
        if (rc == FERRY_ENOSPACE && copying) {
            /* or our own copies on the workers hold the slots: one of them
             * finishes (and drops its lock), then the chunk starts over
             * (only this thread adds copies, so the count only falls) */
            ferry__kv_read_unlock(e);
            ferry__kv_put(kv, e);
            pthread_mutex_unlock(&kv->mu);
            pthread_mutex_lock(&r->cmu);
            while (r->wpending >= copying)
                pthread_cond_wait(&r->ccv, &r->cmu);
            pthread_mutex_unlock(&r->cmu);
            return 0;
        }
        if (rc == -ECANCELED) {
            /* the store's close began: nothing of this chunk was read, and
             * its destination is untouched (the chunks after it go on: one
             * in L1 is copied out, one needing a slot ends so too) */
            ferry__kv_read_unlock(e);
            ferry__kv_put(kv, e);
            pthread_mutex_unlock(&kv->mu);
            if (r->wcopy)
                pthread_mutex_lock(&r->cmu);
            r->c[i].st = rc;
            r->ncancel++;
            if (r->wcopy)
                pthread_mutex_unlock(&r->cmu);
            return 1;
        }
        if (rc < 0) {
            ferry__kv_read_unlock(e);
            ferry__kv_put(kv, e);
            pthread_mutex_unlock(&kv->mu);
            r->c[i].st = rc == FERRY_ENOTFOUND ? rc : FERRY_ENOSPACE;
            r->misses++;
            return 1;
        }
        e->l1_loading = 1;
        uint64_t srcloc = e->loc[src];
        pthread_mutex_unlock(&kv->mu);
        rc = ferry__kv_tier_io(kv, kv->tier[src], 0, srcloc, &e->id, l1->ops->host_ptr(l1, slot),
                     kv->slot_bytes);
        pthread_mutex_lock(&kv->mu);
        ferry__kv_promote_finish(kv, e, slot, rc, src);
        if (!(e->resident & (1u << FERRY_KV_TIER_L1))) {
            ferry__kv_read_unlock(e);
            ferry__kv_put(kv, e);
            pthread_mutex_unlock(&kv->mu);
            if (rc == FERRY_ECORRUPT)
                r->c[i].st = rc;
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
    for (size_t i = 0; r->c && i < r->nch; i++)
        ferry__free(r->c[i].runs); /* (none left but after a failure) */
    void *a[] = {r->c, r->hidx, r->ahead, r->why, r->plnd, r->iov};
    for (size_t k = 0; k < FERRY__ARRAY_LEN(a); k++)
        ferry__free(a[k]);
}

/* the per-chunk state and the read plan of a retrieve of nch chunks:
 * 0, or -ENOMEM with nothing held */
/* a paged buffer's block table naming one block twice among the tokens
 * the retrieve writes ([skip, n)): two chunks' copies would meet in that
 * block, so they are made one after another on this thread, never at once
 * on two (the block then holds whole rows of one of them). 1 also when
 * there is no memory to tell */
static int by_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return (x > y) - (x < y);
}

static int table_repeats(const ferry_kv_buffer *b, uint64_t skip, uint64_t n)
{
    if (b->form != FERRY_KV_PAGED || !b->block_tokens || n <= skip || !b->block_table)
        return 0;
    uint64_t first = skip / b->block_tokens, last = (n - 1) / b->block_tokens;
    if (last >= b->table_len)
        last = b->table_len ? b->table_len - 1 : 0;
    if (last <= first)
        return 0;
    size_t m = (size_t)(last - first + 1);
    uint32_t *ids = ferry__malloc(m * sizeof *ids);
    if (!ids)
        return 1;
    for (size_t k = 0; k < m; k++)
        ids[k] = (uint32_t)b->block_table[first + k];
    qsort(ids, m, sizeof *ids, by_u32);
    int rep = 0;
    for (size_t k = 1; !rep && k < m; k++)
        rep = ids[k] == ids[k - 1];
    ferry__free(ids);
    return rep;
}

/* the pieces kept in flight: the tier's own depth, or FERRY_KV_READ_DEPTH
 * (1-32) where the drive wants another (kv.h, "Read depth") */
unsigned ferry__kv_read_depth(unsigned dflt)
{
    return ferry__env_read_depth(getenv("FERRY_KV_READ_DEPTH"), dflt, NULL);
}

static int rt_init(rtv *r, size_t nch)
{
    ferry_kv *kv = r->kv;
    r->c = ferry__calloc(nch, sizeof *r->c);
    r->hidx = ferry__malloc(nch * sizeof *r->hidx);
    r->ahead = ferry__calloc(nch, 1);
    r->cur = SIZE_MAX;
    if (!r->c || !r->hidx || !r->ahead) {
        rt_free(r);
        return ferry__kv_err(kv, -ENOMEM, "kv retrieve: out of memory for %zu chunks", nch);
    }
    ferry__kv_tier *l1 = kv->tier[FERRY_KV_TIER_L1];
    for (size_t i = 0; i < nch; i++)
        r->c[i].st = FERRY_ENOTFOUND;
    r->batch_max = (size_t)FERRY__MAX(l1->capacity / 2, 1);
    /* asynchronous reads: at most a quarter of L1 in flight, so they never
     * crowd out the slots the copies hold */
    r->at = kv->tier[FERRY_KV_TIER_L2] && kv->tier[FERRY_KV_TIER_L2]->aops
                ? kv->tier[FERRY_KV_TIER_L2]
                : NULL;
    if (r->at) {
        r->depth = (unsigned)FERRY__MIN((uint64_t)r->at->aops->depth,
                                        FERRY__MAX(l1->capacity / 4, 1));
        r->piece = r->at->apiece && r->at->apiece < r->at->slot_bytes ? r->at->apiece
                                                                       : r->at->slot_bytes;
        r->npieces = (uint32_t)((r->at->slot_bytes + r->piece - 1) / r->piece);
        r->pdepth = r->npieces > 1 ? ferry__kv_read_depth(r->at->aops->pdepth) : r->depth;
        r->ramp = r->npieces > 1 ? 1 : r->pdepth;
        r->first_hold = r->npieces > 1;
        /* pieces checked as they land: a map of those landed, and room
         * for each chunk's failure (written by the workers' checks) */
        if (r->at->aops->psum) {
            r->plnd = ferry__malloc(nch * r->npieces);
            r->why = ferry__calloc(nch, sizeof *r->why);
            if (!r->plnd || !r->why) {
                rt_free(r);
                return ferry__kv_err(kv, -ENOMEM, "kv retrieve: out of memory for %zu chunks",
                                     nch);
            }
        }
    }
    /* several chunks into a host buffer: an I/O worker with nothing to
     * read copies one out while this thread keeps the reads going or
     * copies the next (the last chunks of a retrieve from L2 land
     * together: two CPUs copy them, not one after the other). Not for
     * small chunks: waking a worker (tens of us) would cost more than the
     * copy it takes over (a 256 KiB chunk copies in about as long) */
    /* a block named twice: the chunks meeting there are not read straight
     * in either (store_rdirect.c need not walk the request to find it) */
    int repeats = table_repeats(r->buf, r->skip, r->n);
    if (repeats)
        r->dapart = 2;
    if (!r->s && nch > 1 && r->kv->chunk_bytes >= r->kv->handoff_min && !repeats) {
        r->wcopy = 1;
        pthread_mutex_init(&r->cmu, NULL);
        pthread_cond_init(&r->ccv, NULL);
    }
    return 0;
}

/* take the chunks of ours that landed, from chunk k up to ic */
static void rt_landed_from(rtv *r, size_t k, size_t ic)
{
    ferry__kv_rt_units_hand(r); /* (the reads topped up first) */
    for (size_t j = k; j < ic; j++)
        if (r->c[j].fate == RT_LANDED)
            rt_read_done(r, j, r->c[j].res);
}

/* every chunk of ids resolved: read, copied out, or a miss */
static void rt_run(rtv *r, const ferry_kv_hash *ids, int lower)
{
    ferry_kv *kv = r->kv;
    size_t nch = r->nch, k = 0, ic = 0;
    int blocked = 0;
    while (k < nch) {
        if (r->c[k].fate == RT_DONE) {
            k++;
            continue;
        }
        if (r->c[k].fate == RT_OPEN && ferry__kv_rt_failed(r) < 0) {
            r->c[k++].fate = RT_DONE;
            continue;
        }
        if (r->c[k].fate == RT_OPEN && ferry__kv_cancelled(r->cancel)) {
            /* no new read: what is in flight lands in L1 and is not copied out */
            if (r->wcopy)
                pthread_mutex_lock(&r->cmu);
            r->c[k].st = -ECANCELED;
            r->ncancel++;
            if (r->wcopy)
                pthread_mutex_unlock(&r->cmu);
            r->c[k++].fate = RT_DONE;
            continue;
        }
        rt_fill(r, ids, k, &ic, &blocked);
        if (r->c[k].fate == RT_READING || r->c[k].fate == RT_LANDED) {
            /* take what landed, refill, then copy those out (in landing
             * order, not prompt order) while the new reads go on */
            if (r->c[k].fate == RT_READING) {
                rt_reap(r);
                rt_fill(r, ids, k, &ic, &blocked);
            }
            rt_landed_from(r, k, ic);
            continue;
        }
        if (blocked && r->inflight) {
            /* L1 is full: our own reads land first (their slots then hold
             * promoted, unlocked chunks), and read-ahead is tried again */
            if (rt_reap(r))
                rt_landed_from(r, k, ic);
            blocked = 0;
            continue;
        }
        /* top the workers' read-ahead up as earlier reads land: chunks past
         * the prefetch budget get queued once room frees, instead of being
         * read here one at a time (chunks queued or in L1 are skipped) */
        if (lower && k > 0 && k + 1 < nch)
            ferry__kv_prefetch_ids(kv, ids + k + 1, nch - k - 1,
                                   r->n - (k + 1) * kv->chunk_tokens, 0, r->ahead + k + 1);
        int one = rt_one(r, ids, k);
        if (one != 0 && r->wt.queued) { /* resolved without the slot it waited for */
            pthread_mutex_lock(&kv->mu);
            ferry__kv_wait_leave(kv, &r->wt);
            pthread_mutex_unlock(&kv->mu);
        }
        if (one != 0)
            r->wt = (ferry__kv_waiter){0}; /* the next chunk's wait is its own */
        if (one > 0) {
            r->c[k++].fate = RT_DONE;
            blocked = 0; /* its slot's lock is gone (or goes with its copy
                            on a worker): read ahead again */
        } else if (one < 0)
            blocked = 1; /* no room: reap our reads, then try again */
    }
    FERRY__ASSERT(r->inflight == 0); /* every read was waited for above */
    while (r->inflight)
        for (unsigned got = rt_reap(r); got; got = 0)
            rt_landed_from(r, 0, nch);
    rt_sync(r);
}

/* count what the retrieve did into the store's metrics */
static void rt_count(rtv *r)
{
    ferry_kv *kv = r->kv;
    if (r->vbad && r->at) {
        r->hits[r->at->id] -= r->vbad;
        r->misses += r->vbad;
    }
    for (int t = 1; t < FERRY_KV_TIERS; t++)
        if (r->hits[t] && kv->tier[t])
            atomic_fetch_add(&kv->tier[t]->hits, r->hits[t]);
    atomic_fetch_add(&kv->tier[FERRY_KV_TIER_L1]->bytes_read,
                     (r->got - r->dgot) * kv->chunk_bytes);
    atomic_fetch_add(&kv->misses, r->misses);
    atomic_fetch_add(&kv->retrieved_chunks, r->got);
    atomic_fetch_add(&kv->retrieved_bytes, r->got * kv->chunk_bytes);
}

int ferry__kv_do_retrieve(ferry_kv *kv, const ferry_kv_hash *ids, size_t nch, size_t n,
                          const ferry_kv_req *req, const ferry_kv_buffer *buf)
{
    uint64_t t0 = ferry__now_ns();
    rtv r = {0};
    r.t0 = t0;
    r.kv = kv;
    r.buf = buf;
    r.nch = nch;
    r.n = n;
    r.cancel = ferry__kv_cancel_flag();
    r.skip = ferry__kv_req_skip(req);
    int rc = 0;
    if (buf->mem == FERRY_KV_MEM_DEVICE && (rc = ferry__kv_stream_get(kv, &r.s)) < 0) {
        atomic_fetch_add(&kv->failures, 1);
        return rc;
    }
    if ((rc = rt_init(&r, nch)) < 0) {
        ferry__kv_stream_put(kv, r.s);
        atomic_fetch_add(&kv->failures, 1);
        return rc;
    }
    /* read ahead on the workers from the tiers without asynchronous reads */
    int lower = 0;
    for (int t = FERRY_KV_TIER_L2; t < FERRY_KV_TIERS; t++)
        lower |= kv->tier[t] != NULL && kv->tier[t] != r.at;
    ferry__kv_remote_discover_missing(kv, ids, nch, n);
    if (lower)
        ferry__kv_prefetch_ids(kv, ids, nch, n, 0, r.ahead);
    rt_run(&r, ids, lower);
    if (r.wcopy) {
        pthread_mutex_destroy(&r.cmu);
        pthread_cond_destroy(&r.ccv);
    }
    ferry__kv_stream_put(kv, r.s);
    rt_count(&r);
    size_t lead = 0;
    for (size_t i = 0; i < nch && r.c[i].st == 0; i++)
        lead += ferry__kv_chunk_ntok(kv, i, n);
    for (size_t i = 0; i < nch; i++)
        ferry__kv_set_status(req, i, r.c[i].st);
    rt_free(&r);
    if (atomic_load(&r.first_bytes))
        ferry__kv_hist_record(&kv->h_first_bytes, atomic_load(&r.first_bytes));
    if (atomic_load(&r.first_chunk))
        ferry__kv_hist_record(&kv->h_first_chunk, atomic_load(&r.first_chunk));
    if (r.copy_rc < 0) {
        atomic_fetch_add(&kv->failures, 1);
        return r.copy_rc;
    }
    if (r.ncancel && !ferry__kv_cancelled(r.cancel))
        ferry__kv_err(kv, -ECANCELED,
                      "kv retrieve: the store is closing (ferry_kv_close_begin): %u of %zu "
                      "chunks not retrieved (their destination untouched)", r.ncancel, nch);
    return r.ncancel ? -ECANCELED : (int)lead;
}
