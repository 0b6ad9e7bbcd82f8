/*
 * gds_live.c - which asynchronous host requests are in flight, in the
 * whole process.
 *
 * Invariant: a ferry_gds_req is in this table from the moment a
 * ferry_gds_submit accepts it until it is reaped or its context closes,
 * and accepting it is one look-up-and-insert under its bucket's lock: of
 * any number of threads submitting one request at once, to one context or
 * to several, exactly one takes it and every other learns which context
 * holds it (FERRY_EBUSY naming that). Why a table keyed by the request's
 * address, and one for the process: a request's priv_ is the caller's
 * garbage until it is first submitted (nothing says the struct was
 * cleared), so it cannot tell whether the request is in flight, nor where,
 * and a context cannot see into another's lists without racing its close.
 * Buckets keep submitters of different requests off one lock.
 */
#include <pthread.h>
#include <stdint.h>

#include "gds_impl.h"

#define LIVE_BUCKETS 64 /* a power of two */

typedef struct bucket {
    pthread_mutex_t mu;
    ferry__gds_live *head;
} bucket;

#define B1 {PTHREAD_MUTEX_INITIALIZER, NULL}
#define B4 B1, B1, B1, B1
#define B16 B4, B4, B4, B4
static bucket g_live[LIVE_BUCKETS] = {B16, B16, B16, B16};

static bucket *bucket_of(const ferry_gds_req *req)
{
    uint64_t x = (uint64_t)(uintptr_t)req;
    x ^= x >> 29;
    x *= 0x9E3779B97F4A7C15ull; /* requests sit in arrays: spread neighbours */
    return &g_live[x >> 58 & (LIVE_BUCKETS - 1)];
}

ferry_gds *ferry__gds_live_take(ferry__gds_live *e)
{
    bucket *b = bucket_of(e->req);
    pthread_mutex_lock(&b->mu);
    ferry_gds *holder = NULL;
    for (const ferry__gds_live *x = b->head; x && !holder; x = x->next)
        if (x->req == e->req)
            holder = x->owner;
    if (!holder) {
        e->next = b->head;
        b->head = e;
    }
    pthread_mutex_unlock(&b->mu);
    return holder;
}

void ferry__gds_live_drop(ferry__gds_live *e)
{
    bucket *b = bucket_of(e->req);
    pthread_mutex_lock(&b->mu);
    ferry__gds_live **pp = &b->head;
    while (*pp && *pp != e)
        pp = &(*pp)->next;
    FERRY__ASSERT(*pp == e); /* only a request taken is dropped */
    if (*pp)
        *pp = e->next;
    pthread_mutex_unlock(&b->mu);
}
