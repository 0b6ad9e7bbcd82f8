/*
 * api.c - the public operations of the token form: lookup, blocking and
 * asynchronous store and retrieve, prefetch, pin, unpin, delete, clear,
 * sync.
 *
 * Each validates its request whole before anything moves, hashes its chunk
 * ids, then hands them to the store's backend (backend.h): the in-process
 * store's paths (kv/store/) or the daemon's client (kv/client/).
 */
#include <errno.h>
#include <stddef.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv/backend.h"
#include "kv/kv_impl.h"
#include "kv/kv_slots.h"
#include "kv/store/store_int.h"

/* ---- the public blocking forms ---- */

static int prepare(ferry_kv *kv, const int32_t *tokens, size_t n, const ferry_kv_req *req,
                   const ferry_kv_buffer *in, ferry_kv_buffer *buf, const char *what,
                   ferry_kv_hash *stack, ferry_kv_hash **ids)
{
    int nch = ferry__kv_make_ids(kv, tokens, n, req, what, stack, ids);
    if (nch < 0)
        return nch;
    int rc = ferry__kv_buffer_take(in, buf, &kv->layout, kv->dev, n, what, NULL);
    if (rc < 0) {
        ferry__kv_err_pass(kv, rc);
        if (*ids != stack)
            ferry__free(*ids);
        return rc;
    }
    return nch;
}

/* a status no chunk ever has: set before a backend runs, so a chunk it
 * left unsaid (a call that failed before it reached the chunks: the
 * daemon gone, memory) gets the call's code, never the caller's old 0 */
#define STATUS_UNSAID INT32_MIN

int ferry__kv_be_call(ferry_kv *kv, int store, const ferry_kv_hash *ids, size_t nch, size_t n,
                      const ferry_kv_req *req, const ferry_kv_buffer *buf)
{
    uint64_t t0 = ferry__now_ns();
    size_t said = req && req->status ? FERRY__MIN(nch, req->max_chunks) : 0;
    for (size_t i = 0; i < said; i++)
        req->status[i] = STATUS_UNSAID;
    atomic_fetch_add(store ? &kv->stores : &kv->retrieves, 1);
    int rc = (store ? kv->be->store : kv->be->retrieve)(kv, ids, nch, n, req, buf);
    for (size_t i = 0; i < said; i++)
        if (req->status[i] == STATUS_UNSAID)
            req->status[i] = rc < 0 ? rc : FERRY_ENOTFOUND;
    ferry__kv_hist_record(store ? &kv->h_store : &kv->h_retrieve, ferry__now_ns() - t0);
    return rc;
}

/* a blocking store or retrieve (kind: FERRY__KV_OP_*) on this thread */
static int blocking(ferry_kv *kv, int kind, const int32_t *tokens, size_t n,
                    const ferry_kv_req *req, const ferry_kv_buffer *in)
{
    const char *what = kind == FERRY__KV_OP_STORE ? "store" : "retrieve";
    ferry_kv_hash stack[STACK_CHUNKS], *ids = NULL;
    ferry_kv_buffer whole, *buf = &whole;
    int nch = prepare(kv, tokens, n, req, in, buf, what, stack, &ids);
    if (nch < 0)
        return nch;
    int rc = !nch ? 0
                  : ferry__kv_be_call(kv, kind == FERRY__KV_OP_STORE, ids, (size_t)nch, n, req,
                                      buf);
    if (ids != stack)
        ferry__free(ids);
    return rc;
}

int ferry_kv_store(ferry_kv *kv, const int32_t *tokens, size_t n, const ferry_kv_req *req,
                   const ferry_kv_buffer *src)
{
    FERRY__KV_CALL(kv, "store", blocking(kv, FERRY__KV_OP_STORE, tokens, n, req, src));
}

int ferry_kv_retrieve(ferry_kv *kv, const int32_t *tokens, size_t n, const ferry_kv_req *req,
                      const ferry_kv_buffer *dst)
{
    FERRY__KV_CALL(kv, "retrieve", blocking(kv, FERRY__KV_OP_RETRIEVE, tokens, n, req, dst));
}

/* an asynchronous operation on a worker: the store or retrieve, then its
 * handle says done */
static _Thread_local const atomic_int *t_cancel;

const atomic_int *ferry__kv_cancel_flag(void)
{
    return t_cancel;
}

static void op_run(ferry_kv *kv, ferry__kv_job *j)
{
    ferry_kv_op *op = j->op;
    int store = op->kind == FERRY__KV_OP_STORE;
    if (ferry__kv_cancelled(&op->cancel)) { /* cancelled while queued: nothing moves */
        for (size_t i = 0; i < op->nchunks; i++)
            ferry__kv_set_status(&op->req, i, -ECANCELED);
        pthread_mutex_lock(&op->mu);
        op->result = -ECANCELED;
        op->done = 1;
        pthread_cond_broadcast(&op->cv);
        pthread_mutex_unlock(&op->mu);
        return;
    }
    t_cancel = &op->cancel;
    int rc = ferry__kv_be_call(kv, store, op->ids, op->nchunks, op->n, &op->req, &op->buf);
    t_cancel = NULL;
    pthread_mutex_lock(&op->mu);
    op->result = rc;
    op->done = 1;
    pthread_cond_broadcast(&op->cv);
    pthread_mutex_unlock(&op->mu);
}

static int op_submit(ferry_kv *kv, int kind, const int32_t *tokens, size_t n,
                     const ferry_kv_req *req, const ferry_kv_buffer *buf, ferry_kv_op **out)
{
    const char *what = kind == FERRY__KV_OP_STORE ? "store_async" : "retrieve_async";
    if (!out)
        return ferry__kv_err(kv, -EINVAL, "kv %s: op is NULL", what);
    int wrc = kv->be->async_start ? kv->be->async_start(kv) : 0;
    if (wrc < 0)
        return wrc;
    ferry_kv_hash stack[STACK_CHUNKS], *ids = NULL;
    ferry_kv_buffer whole;
    int nch = prepare(kv, tokens, n, req, buf, &whole, what, stack, &ids);
    if (nch < 0)
        return nch;
    ferry__kv_job *j = ferry__calloc(1, sizeof *j);
    ferry_kv_op *op = j ? ferry__kv_op_new(kv, kind, ids, (size_t)nch, n, req, &whole) : NULL;
    if (ids != stack)
        ferry__free(ids);
    if (!op) {
        ferry__free(j);
        return ferry__kv_err(kv, -ENOMEM, "kv %s: out of memory for the operation", what);
    }
    j->kind = FERRY__KV_JOB_OP;
    j->run = op_run;
    j->op = op;
    ferry__kv_enqueue(kv, j);
    *out = op;
    return 0;
}

int ferry_kv_store_async(ferry_kv *kv, const int32_t *tokens, size_t n, const ferry_kv_req *req,
                         const ferry_kv_buffer *src, ferry_kv_op **op)
{
    FERRY__KV_CALL(kv, "store_async",
                   op_submit(kv, FERRY__KV_OP_STORE, tokens, n, req, src, op));
}

int ferry_kv_retrieve_async(ferry_kv *kv, const int32_t *tokens, size_t n,
                            const ferry_kv_req *req, const ferry_kv_buffer *dst, ferry_kv_op **op)
{
    FERRY__KV_CALL(kv, "retrieve_async",
                   op_submit(kv, FERRY__KV_OP_RETRIEVE, tokens, n, req, dst, op));
}

/* ---- prefetch, pin, delete, clear ---- */

/*
 * Queue L2 -> L1 reads for the chunks ids[0..nch) that are only in L2, up
 * to prefetch_max bytes in flight, in order. Leading mode (the public
 * prefetch) stops at the first chunk that is not cached or does not fit;
 * otherwise (a retrieve's read-ahead) it skips those. Leading 2 (the
 * daemon's reads for a client's ACQUIRE and PREFETCH: its retrieve's
 * read-ahead) is leading mode with the read-ahead's budget, and what it
 * lands is spared as a retrieve's read-ahead is (kv_impl.h: ahead_until)
 * until an ACQUIRE holds it; its jobs carry the thread's cut (kv_slots.h),
 * so they are dropped unread once the client is gone. queued[i] (when
 * non-NULL) gets the source tier of each chunk queued. Returns the leading tokens that
 * are in L1 or on their way.
 */
size_t ferry__kv_prefetch_ids(ferry_kv *kv, const ferry_kv_hash *ids, size_t nch, size_t n,
                           int leading, uint8_t *queued)
{
    size_t lead = 0;
    int in_lead = 1;
    ferry__kv_job *head = NULL, **tail = &head;
    /* a retrieve's read-ahead keeps every I/O worker reading with one more
     * chunk queued behind each (when half of L1 holds them), so a worker
     * that finishes a read starts the next at once instead of when the
     * retrieving thread comes round after its copy-out (with a quarter of
     * an L1 of 8 chunks, 2 reads for 2 workers, the drive idled between) */
    uint64_t budget = kv->prefetch_max;
    if (leading != 1) {
        uint64_t want = (uint64_t)2 * kv->q[1].nthreads * kv->slot_bytes;
        uint64_t half = kv->tier[FERRY_KV_TIER_L1]->capacity / 2 * kv->slot_bytes;
        budget = FERRY__MAX(budget, FERRY__MIN(want, half));
    }
    ferry__kv_cut *cut = leading == 2 ? ferry__kv_thread_cut_get() : NULL;
    pthread_mutex_lock(&kv->mu);
    uint64_t now = ferry__kv_now_ns(kv);
    for (size_t i = 0; i < nch; i++) {
        ferry__kv_entry *e = ferry__kv_find(kv, ids[i]);
        int ok = e && e->state == FERRY__KV_READY && e->resident;
        if (ok && ((e->resident & (1u << FERRY_KV_TIER_L1)) || e->l1_loading)) {
            if (in_lead)
                lead += ferry__kv_chunk_ntok(kv, i, n);
            continue;
        }
        int src = ok ? ferry__kv_lower_tier(kv, e) : 0;
        ok = ok && src;
        if (ok && !leading && kv->tier[src]->aops)
            continue; /* a retrieve reads these itself, asynchronously */
        if (ok && kv->prefetch_inflight + kv->slot_bytes > budget)
            break;
        ferry__kv_job *j = ok ? ferry__calloc(1, sizeof *j) : NULL;
        uint64_t slot;
        if (!j || ferry__kv_reserve(kv, FERRY_KV_TIER_L1, now, &slot, RESERVE_NOW) < 0) {
            ferry__free(j);
            if (leading)
                break;
            in_lead = 0;
            continue;
        }
        e->l1_loading = 1;
        ferry__kv_read_lock(kv, e, now);
        e->refs++;
        kv->prefetch_inflight += kv->slot_bytes;
        j->kind = FERRY__KV_JOB_PREFETCH;
        j->run = ferry__kv_job_run;
        j->e = e;
        j->l1_loc = slot;
        j->src_tier = src;
        j->ahead = leading != 1; /* a retrieve's, in process or a client's */
        if (cut) {
            atomic_fetch_add(&cut->refs, 1);
            j->cut = cut;
        }
        *tail = j;
        tail = &j->next;
        if (queued)
            queued[i] = (uint8_t)src;
        if (in_lead)
            lead += ferry__kv_chunk_ntok(kv, i, n);
    }
    pthread_mutex_unlock(&kv->mu);
    ferry__kv_prefetch_queue(kv, head, leading);
    return lead;
}

static int prefetch_call(ferry_kv *kv, const int32_t *tokens, size_t n, const ferry_kv_req *req)
{
    ferry_kv_hash stack[STACK_CHUNKS], *ids = NULL;
    int nch = ferry__kv_make_ids(kv, tokens, n, req, "prefetch", stack, &ids);
    if (nch < 0)
        return nch;
    int rc = nch ? kv->be->prefetch(kv, ids, (size_t)nch, n) : 0;
    if (ids != stack)
        ferry__free(ids);
    return rc;
}

int ferry__kv_local_prefetch(ferry_kv *kv, const ferry_kv_hash *ids, size_t nch, size_t n)
{
    ferry__kv_remote_discover_missing(kv, ids, nch, n);
    return (int)ferry__kv_prefetch_ids(kv, ids, nch, n, 1, NULL);
}

int ferry_kv_prefetch(ferry_kv *kv, const int32_t *tokens, size_t n, const ferry_kv_req *req)
{
    FERRY__KV_CALL(kv, "prefetch", prefetch_call(kv, tokens, n, req));
}

static int pin_common(ferry_kv *kv, const int32_t *tokens, size_t n, const ferry_kv_req *req,
                      int pin)
{
    const char *what = pin ? "pin" : "unpin";
    ferry_kv_hash stack[STACK_CHUNKS], *ids = NULL;
    int nch = ferry__kv_make_ids(kv, tokens, n, req, what, stack, &ids);
    if (nch < 0)
        return nch;
    int rc = nch ? kv->be->pin(kv, ids, (size_t)nch, n, pin) : 0;
    if (ids != stack)
        ferry__free(ids);
    return rc;
}

int ferry__kv_local_pin(ferry_kv *kv, const ferry_kv_hash *ids, size_t nch, size_t n, int pin)
{
    size_t lead = 0;
    pthread_mutex_lock(&kv->mu);
    uint64_t now = ferry__kv_now_ns(kv);
    for (size_t i = 0; i < nch; i++) {
        ferry__kv_entry *e = ferry__kv_find(kv, ids[i]);
        if (!e || e->state != FERRY__KV_READY || (!pin && e->pins == 0))
            break;
        if (pin) {
            ferry__kv_read_lock(kv, e, now);
            e->pins++;
        } else {
            e->pins--;
            ferry__kv_read_unlock(e);
        }
        lead += ferry__kv_chunk_ntok(kv, i, n);
    }
    pthread_mutex_unlock(&kv->mu);
    return (int)lead;
}

int ferry_kv_pin(ferry_kv *kv, const int32_t *tokens, size_t n, const ferry_kv_req *req)
{
    FERRY__KV_CALL(kv, "pin", pin_common(kv, tokens, n, req, 1));
}

int ferry_kv_unpin(ferry_kv *kv, const int32_t *tokens, size_t n, const ferry_kv_req *req)
{
    FERRY__KV_CALL(kv, "unpin", pin_common(kv, tokens, n, req, 0));
}

/* delete the chunks ids[0..nch) (ferry_kv_delete and the server's DELETE) */
int ferry__kv_slot_delete(ferry_kv *kv, const ferry_kv_hash *ids, size_t nchunks)
{
    int nch = (int)nchunks;
    int deleted = 0;
    size_t locked_at = SIZE_MAX;
    ferry__kv_tier *rt = kv->tier[FERRY_KV_TIER_REMOTE];
    if (rt && !rt->ops->forget)
        rt = NULL;
    /* with a shared tier: the ids to delete there, those deleted here first
     * (ngone), then those not indexed here (counted by the server) */
    ferry_kv_hash *rids = rt ? ferry__malloc((size_t)nch * sizeof *rids) : NULL;
    size_t ngone = 0, nabsent = 0;
    pthread_mutex_lock(&kv->mu);
    uint64_t now = ferry__kv_now_ns(kv);
    for (size_t i = 0; i < (size_t)nch; i++) {
        ferry__kv_entry *e = ferry__kv_find(kv, ids[i]);
        if (!e) {
            if (rids)
                rids[(size_t)nch - 1 - nabsent++] = ids[i];
            continue;
        }
        if (ferry__kv_locked(kv, e, now)) {
            if (locked_at == SIZE_MAX)
                locked_at = i;
            continue;
        }
        ferry__kv_count_expired(kv, e);
        ferry__kv_doom(kv, e);
        deleted++;
        if (rids)
            rids[ngone++] = ids[i];
    }
    pthread_mutex_unlock(&kv->mu);
    if (rt && !rids) {
        FERRY_LOGW("kv delete: out of memory for %d remote keys; the remote copies stay", nch);
    } else if (rt) {
        int r1 = rt->ops->forget(rt, rids, ngone);
        int r2 = rt->ops->forget(rt, rids + (size_t)nch - nabsent, nabsent);
        if (r2 > 0)
            deleted += r2;
        if (r1 < 0 || r2 < 0)
            FERRY_LOGD("kv delete: the remote copies of some chunks stay: %s",
                       ferry_last_error());
        ferry__free(rids);
    }
    atomic_fetch_add(&kv->deleted, (uint64_t)deleted);
    if (locked_at != SIZE_MAX)
        return ferry__kv_err(kv, FERRY_ELOCKED,
                              "kv delete: chunk %zu (and maybe others) is locked (pinned, read or "
                              "being written); %d other chunks deleted",
                              locked_at, deleted);
    return deleted;
}

static int delete_call(ferry_kv *kv, const int32_t *tokens, size_t n, const ferry_kv_req *req)
{
    ferry_kv_hash stack[STACK_CHUNKS], *ids = NULL;
    int nch = ferry__kv_make_ids(kv, tokens, n, req, "delete", stack, &ids);
    if (nch < 0)
        return nch;
    int rc = kv->be->del(kv, ids, (size_t)nch);
    if (ids != stack)
        ferry__free(ids);
    return rc;
}

int ferry_kv_delete(ferry_kv *kv, const int32_t *tokens, size_t n, const ferry_kv_req *req)
{
    FERRY__KV_CALL(kv, "delete", delete_call(kv, tokens, n, req));
}

int ferry__kv_local_clear(ferry_kv *kv)
{
    int deleted = 0, left = 0;
    pthread_mutex_lock(&kv->mu);
    uint64_t now = ferry__kv_now_ns(kv);
    for (uint64_t b = 0; b < kv->nbuckets; b++) {
        for (ferry__kv_entry *e = kv->buckets[b], *next; e; e = next) {
            next = e->hnext;
            if (ferry__kv_locked(kv, e, now)) {
                left++;
                continue;
            }
            ferry__kv_count_expired(kv, e);
            ferry__kv_doom(kv, e);
            deleted++;
        }
    }
    pthread_mutex_unlock(&kv->mu);
    atomic_fetch_add(&kv->deleted, (uint64_t)deleted);
    if (left)
        return ferry__kv_err(kv, FERRY_ELOCKED,
                              "kv clear: %d chunks are locked and stay; %d deleted", left,
                              deleted);
    return deleted;
}

int ferry_kv_clear(ferry_kv *kv)
{
    FERRY__KV_CALL(kv, "clear", kv->be->clear(kv));
}

int ferry_kv_sync(ferry_kv *kv)
{
    FERRY__KV_CALL(kv, "sync", kv->be->sync(kv));
}

/* ---- lookups (the ids are the backend's to pull: backend.h) ---- */

static int lookup_call(ferry_kv *kv, const int32_t *tokens, size_t n, const ferry_kv_req *req)
{
    int rc = ferry__kv_tokens_ok(kv, tokens, n, "lookup");
    if (rc < 0 || (rc = ferry__kv_req_ok(kv, req, "lookup")) < 0)
        return rc;
    int partial = req && (req->flags & FERRY_KV_PARTIAL);
    size_t nch = n / kv->chunk_tokens + (partial && n % kv->chunk_tokens ? 1 : 0);
    if (nch > INT32_MAX / 2)
        return ferry__kv_err(kv, -EINVAL, "kv lookup: %zu tokens is too many", n);
    ferry__kv_idsrc src = {NULL, tokens, n, kv->chunk_tokens, kv->seed,
                           ferry__kv_ns_of(kv, req), {0, 0}, nch, 0};
    return kv->be->lookup(kv, &src, req);
}

int ferry__kv_lookup_ids(ferry_kv *kv, const ferry_kv_hash *ids, size_t nch, size_t n,
                         const ferry_kv_req *req)
{
    ferry__kv_idsrc src = {ids, NULL, n, kv->chunk_tokens, kv->seed, {0, 0}, {0, 0}, nch, 0};
    return kv->be->lookup(kv, &src, req);
}

int ferry_kv_lookup(ferry_kv *kv, const int32_t *tokens, size_t n, const ferry_kv_req *req)
{
    FERRY__KV_CALL(kv, "lookup", lookup_call(kv, tokens, n, req));
}
