/*
 * async.c - the store's worker threads: asynchronous store/retrieve
 * operations on one queue, L2 write-throughs and prefetch reads on another.
 *
 * Why two queues: a retrieve that finds its chunk being promoted into L1
 * waits for that promotion. If prefetch reads shared a queue with
 * operations, every worker could be such a retrieve, waiting for a
 * prefetch queued behind it: a deadlock. I/O jobs never wait for anything
 * but the store's mutex, so their queue always drains. For the same reason
 * a retrieve's copy lent to an idle operation worker (ferry__kv_lend) is
 * never queued behind an operation: operations may wait for it.
 *
 * Invariant: every job queued is run exactly once (or withdrawn once:
 * read-ahead for a daemon's client that is gone is taken back out of the
 * queue and dropped by whoever withdrew it); flush and close wait
 * until both queues are empty, no worker is busy and no withdrawer is still
 * dropping what it took (its slots and budget given back), so no job outlives the
 * store and every write-through has landed (or failed and released its
 * extent) before the tiers are torn down. An operation's handle and its
 * life are op.c's.
 */
#include <errno.h>
#include "kv/backend.h"
#include "kv/kv_impl.h"
#include "kv/store/store_int.h"
#include "kv/kv_layers.h"

/* a job carries what to do with it: the pool runs it, whatever it is */
static void run_job(ferry_kv *kv, ferry__kv_job *j)
{
    j->run(kv, j);
    ferry__free(j);
}

static int all_idle(const ferry_kv *kv)
{
    return !kv->q[0].head && !kv->q[1].head && !kv->q[0].lhead && !kv->q[1].lhead &&
           !kv->q[0].active && !kv->q[1].active && !kv->q[1].withdrawing;
}

/* under qmu: the next job of q, a lent copy first, or NULL */
static ferry__kv_job *take(struct ferry__kv_queue *q)
{
    ferry__kv_job *j = q->lhead;
    if (j) {
        q->lhead = j->next;
        if (!q->lhead)
            q->ltail = NULL;
        q->nlent--;
        return j;
    }
    j = q->head;
    if (j) {
        q->head = j->next;
        if (!q->head)
            q->tail = NULL;
    }
    return j;
}

static void *worker(void *arg)
{
    struct ferry__kv_queue *q = arg;
    ferry_kv *kv = q->kv;
    pthread_mutex_lock(&kv->qmu);
    for (;;) {
        while (!q->head && !q->lhead && !kv->stopping)
            pthread_cond_wait(&q->cv, &kv->qmu);
        ferry__kv_job *j = take(q);
        if (!j)
            break;
        q->active++;
        pthread_mutex_unlock(&kv->qmu);
        run_job(kv, j);
        pthread_mutex_lock(&kv->qmu);
        q->active--;
        if (all_idle(kv))
            pthread_cond_broadcast(&kv->idle);
    }
    pthread_mutex_unlock(&kv->qmu);
    return NULL;
}

void ferry__kv_enqueue(ferry_kv *kv, ferry__kv_job *j)
{
    struct ferry__kv_queue *q = &kv->q[j->kind == FERRY__KV_JOB_OP ? 0 : 1];
    j->next = NULL;
    pthread_mutex_lock(&kv->qmu);
    if (q->tail)
        q->tail->next = j;
    else
        q->head = j;
    q->tail = j;
    pthread_cond_signal(&q->cv);
    pthread_mutex_unlock(&kv->qmu);
}

ferry__kv_job *ferry__kv_withdraw(ferry_kv *kv, int (*match)(const ferry__kv_job *, void *),
                                  void *ctx)
{
    ferry__kv_job *out = NULL, **otail = &out;
    struct ferry__kv_queue *q = &kv->q[1];
    pthread_mutex_lock(&kv->qmu);
    ferry__kv_job **pp = &q->head, *prev = NULL;
    while (*pp) {
        ferry__kv_job *j = *pp;
        if (!match(j, ctx)) {
            prev = j;
            pp = &j->next;
            continue;
        }
        *pp = j->next;
        if (q->tail == j)
            q->tail = prev;
        j->next = NULL;
        *otail = j;
        otail = &j->next;
    }
    if (out)
        q->withdrawing++; /* (busy as a worker until ferry__kv_withdraw_end) */
    pthread_mutex_unlock(&kv->qmu);
    return out;
}

void ferry__kv_withdraw_end(ferry_kv *kv)
{
    pthread_mutex_lock(&kv->qmu);
    FERRY__ASSERT(kv->q[1].withdrawing > 0);
    kv->q[1].withdrawing--;
    if (all_idle(kv))
        pthread_cond_broadcast(&kv->idle);
    pthread_mutex_unlock(&kv->qmu);
}

int ferry__kv_io_worker_free(ferry_kv *kv, unsigned mine)
{
    pthread_mutex_lock(&kv->qmu);
    struct ferry__kv_queue *q = &kv->q[1];
    int free_ = !q->head && !kv->stopping &&
                (q->active < q->nthreads || (mine > 0 && mine < q->nthreads));
    pthread_mutex_unlock(&kv->qmu);
    return free_;
}

int ferry__kv_op_worker_free(ferry_kv *kv)
{
    pthread_mutex_lock(&kv->qmu);
    struct ferry__kv_queue *q = &kv->q[0];
    int free_ = !q->head && !kv->stopping && q->active < q->nthreads;
    pthread_mutex_unlock(&kv->qmu);
    return free_;
}

int ferry__kv_lend(ferry_kv *kv, ferry__kv_job *j)
{
    struct ferry__kv_queue *q = &kv->q[0];
    j->next = NULL;
    pthread_mutex_lock(&kv->qmu);
    /* idle workers >= lent copies queued, before and after: a worker takes
     * a lent copy before anything else, an operation only when none is
     * queued, so every lent copy is run by a worker that waits for nothing */
    int ok = !q->head && !kv->stopping && q->active + q->nlent < q->nthreads;
    if (ok) {
        if (q->ltail)
            q->ltail->next = j;
        else
            q->lhead = j;
        q->ltail = j;
        q->nlent++;
        pthread_cond_signal(&q->cv);
    }
    pthread_mutex_unlock(&kv->qmu);
    return ok;
}

int ferry__kv_workers_start(ferry_kv *kv, unsigned n)
{
    for (int k = 0; k < 2; k++) {
        struct ferry__kv_queue *q = &kv->q[k];
        q->kv = kv;
        q->threads = ferry__calloc(n, sizeof *q->threads);
        if (!q->threads) {
            ferry__kv_workers_stop(kv);
            return ferry__kv_err(kv, -ENOMEM, "kv open: out of memory for %u workers", n);
        }
        for (unsigned i = 0; i < n; i++) {
            int rc = pthread_create(&q->threads[i], NULL, worker, q);
            if (rc != 0) {
                ferry__kv_workers_stop(kv);
                return ferry__kv_err(kv, -rc, "kv open: starting worker %u of %u failed",
                                      i, n);
            }
            q->nthreads++;
        }
    }
    return 0;
}

int ferry_kv_flush(ferry_kv *kv)
{
    FERRY__KV_CALL(kv, "flush", ferry__kv_flush(kv));
}

int ferry__kv_flush(ferry_kv *kv)
{
    pthread_mutex_lock(&kv->qmu);
    while (!all_idle(kv))
        pthread_cond_wait(&kv->idle, &kv->qmu);
    pthread_mutex_unlock(&kv->qmu);
    /* the store's own operations are done: now what the backend holds (the
     * tiers' queues, or the daemon's) */
    return kv->be->flush(kv);
}

int ferry__kv_local_flush(ferry_kv *kv)
{
    /* the write-throughs the workers handed to a tier's own queue */
    for (int t = 0; t < FERRY_KV_TIERS; t++)
        if (kv->tier[t] && kv->tier[t]->ops->flush)
            kv->tier[t]->ops->flush(kv->tier[t]);
    return 0;
}

void ferry__kv_workers_stop(ferry_kv *kv)
{
    if (kv->q[0].nthreads && kv->q[1].nthreads)
        ferry__kv_flush(kv);
    pthread_mutex_lock(&kv->qmu);
    kv->stopping = 1;
    pthread_cond_broadcast(&kv->q[0].cv);
    pthread_cond_broadcast(&kv->q[1].cv);
    pthread_mutex_unlock(&kv->qmu);
    for (int k = 0; k < 2; k++) {
        struct ferry__kv_queue *q = &kv->q[k];
        for (unsigned i = 0; i < q->nthreads; i++)
            pthread_join(q->threads[i], NULL);
        q->nthreads = 0;
    }
    /* with no worker left, run what is still queued inline (I/O jobs last:
     * an operation may queue more of them) */
    for (int k = 0; k < 2; k++) {
        struct ferry__kv_queue *q = &kv->q[k];
        for (ferry__kv_job *j; (j = take(q));)
            run_job(kv, j);
        ferry__free(q->threads);
        q->threads = NULL;
    }
}
