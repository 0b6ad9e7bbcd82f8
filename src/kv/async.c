/*
 * async.c - the store's worker threads: asynchronous store/retrieve
 * operations, L2 write-through and prefetch reads.
 *
 * Invariant: every job queued is run exactly once, by one worker; close
 * (and flush) wait until the queue is empty and no worker is busy, so no
 * job outlives the store and every write-through has landed (or failed and
 * released its extent) before the tiers are torn down. An operation's
 * handle is freed only by its owner (ferry_kv_op_free), after it is done.
 */
#include <errno.h>
#include <time.h>

#include "kv_impl.h"

static void op_finish(ferry_kv_op *op, int result)
{
    pthread_mutex_lock(&op->mu);
    op->result = result;
    op->done = 1;
    pthread_cond_broadcast(&op->cv);
    pthread_mutex_unlock(&op->mu);
}

static void run_job(ferry_kv *kv, ferry__kv_job *j)
{
    if (j->kind == FERRY__KV_JOB_OP) {
        ferry_kv_op *op = j->op;
        int rc = op->kind == FERRY__KV_OP_STORE
                     ? ferry__kv_do_store(kv, op->ids, op->nchunks, op->n, &op->req, &op->buf)
                     : ferry__kv_do_retrieve(kv, op->ids, op->nchunks, op->n, &op->req, &op->buf);
        op_finish(op, rc);
    } else {
        ferry__kv_job_run(kv, j);
    }
    ferry__free(j);
}

static void *worker(void *arg)
{
    ferry_kv *kv = arg;
    pthread_mutex_lock(&kv->qmu);
    for (;;) {
        while (!kv->qhead && !kv->stopping)
            pthread_cond_wait(&kv->qcv, &kv->qmu);
        if (!kv->qhead)
            break;
        ferry__kv_job *j = kv->qhead;
        kv->qhead = j->next;
        if (!kv->qhead)
            kv->qtail = NULL;
        kv->active++;
        pthread_mutex_unlock(&kv->qmu);
        run_job(kv, j);
        pthread_mutex_lock(&kv->qmu);
        kv->active--;
        if (!kv->qhead && !kv->active)
            pthread_cond_broadcast(&kv->idle);
    }
    pthread_mutex_unlock(&kv->qmu);
    return NULL;
}

void ferry__kv_enqueue(ferry_kv *kv, ferry__kv_job *j)
{
    j->next = NULL;
    pthread_mutex_lock(&kv->qmu);
    if (kv->qtail)
        kv->qtail->next = j;
    else
        kv->qhead = j;
    kv->qtail = j;
    pthread_cond_signal(&kv->qcv);
    pthread_mutex_unlock(&kv->qmu);
}

int ferry__kv_workers_start(ferry_kv *kv, unsigned n)
{
    kv->threads = ferry__calloc(n, sizeof *kv->threads);
    if (!kv->threads)
        return ferry__err_set(&kv->err, -ENOMEM, "kv open: out of memory for %u workers", n);
    for (unsigned i = 0; i < n; i++) {
        int rc = pthread_create(&kv->threads[i], NULL, worker, kv);
        if (rc != 0) {
            ferry__kv_workers_stop(kv);
            return ferry__err_set(&kv->err, -rc, "kv open: starting worker %u of %u failed", i,
                                  n);
        }
        kv->nthreads++;
    }
    return 0;
}

int ferry_kv_flush(ferry_kv *kv)
{
    if (!kv)
        return ferry__err_set(NULL, -EINVAL, "kv flush: store is NULL");
    pthread_mutex_lock(&kv->qmu);
    while (kv->qhead || kv->active)
        pthread_cond_wait(&kv->idle, &kv->qmu);
    pthread_mutex_unlock(&kv->qmu);
    return 0;
}

void ferry__kv_workers_stop(ferry_kv *kv)
{
    if (!kv->threads)
        return;
    if (kv->nthreads)
        ferry_kv_flush(kv);
    pthread_mutex_lock(&kv->qmu);
    kv->stopping = 1;
    pthread_cond_broadcast(&kv->qcv);
    pthread_mutex_unlock(&kv->qmu);
    for (unsigned i = 0; i < kv->nthreads; i++)
        pthread_join(kv->threads[i], NULL);
    kv->nthreads = 0;
    /* with no worker, nothing can still be queued: run leftovers inline */
    for (ferry__kv_job *j = kv->qhead, *next; j; j = next) {
        next = j->next;
        run_job(kv, j);
    }
    kv->qhead = kv->qtail = NULL;
    ferry__free(kv->threads);
    kv->threads = NULL;
}

int ferry_kv_op_wait(ferry_kv_op *op, int timeout_ms)
{
    if (!op)
        return ferry__err_set(NULL, -EINVAL, "kv op wait: op is NULL");
    pthread_mutex_lock(&op->mu);
    if (timeout_ms < 0) {
        while (!op->done)
            pthread_cond_wait(&op->cv, &op->mu);
    } else if (!op->done && timeout_ms > 0) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_sec += timeout_ms / 1000;
        ts.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        while (!op->done)
            if (pthread_cond_timedwait(&op->cv, &op->mu, &ts) == ETIMEDOUT)
                break;
    }
    int done = op->done, rc = op->result;
    pthread_mutex_unlock(&op->mu);
    return done ? rc : -ETIMEDOUT;
}

int ferry_kv_op_test(ferry_kv_op *op)
{
    int rc = ferry_kv_op_wait(op, 0);
    return rc == -ETIMEDOUT ? -EAGAIN : rc;
}

void ferry_kv_op_free(ferry_kv_op *op)
{
    if (!op)
        return;
    ferry_kv_op_wait(op, -1);
    pthread_mutex_destroy(&op->mu);
    pthread_cond_destroy(&op->cv);
    ferry__free(op->ids);
    ferry__free(op);
}
