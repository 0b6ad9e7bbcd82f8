/*
 * aqueue.c - what the tiers with asynchronous reads share (kv_impl.h's
 * ferry__kv_aq): their request pool and the leader/followers wait.
 *
 * The reads of every thread share a tier's completion queue: whichever
 * waiting thread reaps hands each completion to the batch that submitted
 * it, so a thread never takes another's completion for its own, and only
 * one thread at a time is inside the tier's reap.
 *
 * Invariant: a batch's inflight counts its requests entered and not yet
 * landed; a request is on its batch's ready list only after it landed,
 * and back in the pool only after its caller took it from there.
 */
#include <errno.h>
#include <string.h>

#include "kv/kv_impl.h"

void ferry__kv_aq_init(ferry__kv_aq *q, size_t rd_bytes)
{
    memset(q, 0, sizeof *q);
    pthread_mutex_init(&q->mu, NULL);
    pthread_cond_init(&q->cv, NULL);
    q->rd_bytes = rd_bytes;
}

void ferry__kv_aq_fini(ferry__kv_aq *q)
{
    for (ferry__kv_aread *r = q->all_rd, *next; r; r = next) {
        next = r->all;
        ferry__free(r);
    }
    q->all_rd = q->free_rd = NULL;
    pthread_mutex_destroy(&q->mu);
    pthread_cond_destroy(&q->cv);
}

ferry__kv_aread *ferry__kv_aq_get(ferry__kv_aq *q)
{
    pthread_mutex_lock(&q->mu);
    ferry__kv_aread *r = q->free_rd;
    if (r)
        q->free_rd = r->next;
    pthread_mutex_unlock(&q->mu);
    if (!r) {
        r = ferry__calloc(1, q->rd_bytes);
        if (!r)
            return NULL;
        pthread_mutex_lock(&q->mu);
        r->all = q->all_rd;
        q->all_rd = r;
        pthread_mutex_unlock(&q->mu);
    }
    r->next = NULL;
    r->batch = NULL;
    r->result = 0;
    r->why = NULL;
    return r;
}

void ferry__kv_aq_put(ferry__kv_aq *q, ferry__kv_aread *r)
{
    if (!r)
        return;
    pthread_mutex_lock(&q->mu);
    r->next = q->free_rd;
    q->free_rd = r;
    pthread_mutex_unlock(&q->mu);
}

int ferry__kv_aq_broken(ferry__kv_aq *q)
{
    pthread_mutex_lock(&q->mu);
    int b = q->broken;
    pthread_mutex_unlock(&q->mu);
    return b;
}

int ferry__kv_aq_enter(ferry__kv_aq *q, ferry__kv_abatch *b, ferry__kv_aread *r)
{
    r->batch = b;
    pthread_mutex_lock(&q->mu);
    int broken = q->broken;
    if (!broken)
        b->inflight++; /* before the submit: any thread may reap it at once */
    pthread_mutex_unlock(&q->mu);
    return broken;
}

void ferry__kv_aq_leave(ferry__kv_aq *q, ferry__kv_abatch *b)
{
    pthread_mutex_lock(&q->mu);
    FERRY__ASSERT(b->inflight > 0);
    b->inflight--;
    pthread_mutex_unlock(&q->mu);
}

void ferry__kv_aq_land(ferry__kv_aread *r)
{
    ferry__kv_abatch *b = r->batch;
    r->next = b->ready;
    b->ready = r;
    FERRY__ASSERT(b->inflight > 0);
    b->inflight--;
}

int ferry__kv_aq_wait(ferry__kv_aq *q, ferry__kv_abatch *b, ferry__kv_aread **out,
                      int (*reap)(void *ctx), void *ctx, const char *what)
{
    *out = NULL;
    pthread_mutex_lock(&q->mu);
    for (;;) {
        if (b->ready) {
            *out = b->ready; /* all of them, so the caller refills before it copies */
            b->ready = NULL;
            break;
        }
        if (!b->inflight)
            break;
        if (q->broken) {
            int rc = q->broken;
            unsigned lost = b->inflight;
            pthread_mutex_unlock(&q->mu);
            return ferry__err_set(NULL, rc, "%s: %u reads lost: its read queue broke (%s)", what,
                                  lost, ferry_strerror(rc));
        }
        if (q->reaping) {
            pthread_cond_wait(&q->cv, &q->mu);
            continue;
        }
        /* our turn to reap, for every batch */
        q->reaping = 1;
        pthread_mutex_unlock(&q->mu);
        int rc = reap(ctx);
        pthread_mutex_lock(&q->mu);
        q->reaping = 0;
        if (rc < 0 && !q->broken)
            q->broken = rc;
        pthread_cond_broadcast(&q->cv);
    }
    pthread_mutex_unlock(&q->mu);
    return 0;
}
