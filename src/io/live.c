/*
 * live.c - which asynchronous requests are in flight, in the whole process.
 *
 * Invariant: a ferry_io_req is in this table from the moment a
 * ferry_io_submit accepts it until it is reaped or its engine closes, and
 * accepting it is one look-up-and-insert under its bucket's lock: of any
 * number of threads submitting one request at once, to one engine or to
 * several, exactly one takes it, and a request in flight on one engine
 * submitted to another is known as busy there. Why a table for the
 * process, keyed by the request's address: a fresh request's priv_ is
 * whatever the caller's memory held (nothing says it was cleared), so the
 * request itself cannot say whether it is in flight, nor where; and an
 * engine cannot look into another's queues, which the other's thread
 * changes as it runs. The chain runs through the request's own private
 * words (ferry__rq.live), so submit still never allocates. Buckets keep
 * submitters of different requests off one lock and chains short.
 */
#include <pthread.h>
#include <stdint.h>

#include "io_impl.h"

#define LIVE_BUCKETS 256 /* a power of two */

typedef struct bucket {
    pthread_mutex_t mu;
    ferry_io_req *head;
} bucket;

#define B1 {PTHREAD_MUTEX_INITIALIZER, NULL}
#define B4 B1, B1, B1, B1
#define B16 B4, B4, B4, B4
#define B64 B16, B16, B16, B16
static bucket g_live[LIVE_BUCKETS] = {B64, B64, B64, B64};

static bucket *bucket_of(const ferry_io_req *r)
{
    uint64_t x = (uint64_t)(uintptr_t)r;
    x ^= x >> 29;
    x *= 0x9E3779B97F4A7C15ull; /* requests sit in arrays: spread neighbours */
    return &g_live[x >> 56 & (LIVE_BUCKETS - 1)];
}

static int in_chain(const bucket *b, const ferry_io_req *r)
{
    for (ferry_io_req *x = b->head; x; x = ferry__rq_of(x)->live)
        if (x == r)
            return 1;
    return 0;
}

int ferry__io_live_take(ferry_io_req *r)
{
    bucket *b = bucket_of(r);
    pthread_mutex_lock(&b->mu);
    int taken = !in_chain(b, r);
    if (taken) {
        ferry__rq_of(r)->live = b->head;
        b->head = r;
    }
    pthread_mutex_unlock(&b->mu);
    return taken;
}

int ferry__io_live_held(const ferry_io_req *r)
{
    bucket *b = bucket_of(r);
    pthread_mutex_lock(&b->mu);
    int held = in_chain(b, r);
    pthread_mutex_unlock(&b->mu);
    return held;
}

void ferry__io_live_drop(ferry_io_req *r)
{
    bucket *b = bucket_of(r);
    pthread_mutex_lock(&b->mu);
    ferry_io_req **pp = &b->head;
    while (*pp && *pp != r)
        pp = &ferry__rq_of(*pp)->live;
    FERRY__ASSERT(*pp == r); /* only a request taken is dropped */
    if (*pp)
        *pp = ferry__rq_of(r)->live;
    pthread_mutex_unlock(&b->mu);
}
