/*
 * live.c - which asynchronous requests are in flight, in the whole process.
 *
 * Invariant: a ferry_io_req is in this table from the moment a
 * ferry_io_submit accepts it until it is reaped or its engine closes, and
 * accepting it is one look-up-and-insert under its chain's lock: of any
 * number of threads submitting one request at once, to one engine or to
 * several, exactly one takes it, and a request in flight on one engine
 * submitted to another is known as busy there. Why a table for the
 * process, keyed by the request's address: a fresh request's priv_ is
 * whatever the caller's memory held (nothing says it was cleared), so the
 * request itself cannot say whether it is in flight, nor where; and an
 * engine cannot look into another's queues, which the other's thread
 * changes as it runs. The chain runs through the request's own private
 * words (ferry__rq.live), so submit still never allocates.
 *
 * Cost: a queue has no fixed bound (ferry_io_submit), so the table may
 * hold hundreds of thousands of requests, and every take and drop walks
 * one chain. LIVE_HEADS chains keep them a few long at that (with 256
 * they held a thousand each at 256k requests, and submit and reap spent
 * microseconds per request walking them); LIVE_LOCKS mutexes, each over
 * every LIVE_LOCKS-th chain, keep submitters of different requests off
 * one lock without a mutex per chain.
 */
#include <pthread.h>
#include <stdint.h>

#include "io_impl.h"

#define LIVE_HEADS_LOG2 14
#define LIVE_HEADS (1u << LIVE_HEADS_LOG2) /* 128 KiB of chain heads */
#define LIVE_LOCKS 256u                    /* a power of two, at most LIVE_HEADS */

#define M1 PTHREAD_MUTEX_INITIALIZER
#define M4 M1, M1, M1, M1
#define M16 M4, M4, M4, M4
#define M64 M16, M16, M16, M16
static pthread_mutex_t g_mu[LIVE_LOCKS] = {M64, M64, M64, M64};
static ferry_io_req *g_head[LIVE_HEADS]; /* chain i: under g_mu[i % LIVE_LOCKS] */

/* fork: a child gets the table as the fork left it, the requests of the
 * parent's engines in it (engines the child does not have: a copy of such
 * a request submitted to an engine of the child's was FERRY_EBUSY for
 * ever) and a mutex another thread held at that moment still held (the
 * child's first submit on that chain hung). The child starts with an
 * empty table and every lock free. (A child made without the handlers, by _Fork or a raw clone, is
 * not helped: nothing runs in it.) */
static pthread_once_t g_atfork_once = PTHREAD_ONCE_INIT;

/* in the child only the forking thread runs: whatever another thread
 * was doing to the table is gone with it, so the chains start empty and
 * every lock unheld (one may have been held at the fork) */
static void fork_child(void)
{
    for (unsigned c = 0; c < LIVE_HEADS; c++)
        g_head[c] = NULL;
    for (unsigned i = 0; i < LIVE_LOCKS; i++)
        pthread_mutex_init(&g_mu[i], NULL);
}

static void atfork_register(void)
{
    pthread_atfork(NULL, NULL, fork_child);
}

static unsigned chain_of(const ferry_io_req *r)
{
    uint64_t x = (uint64_t)(uintptr_t)r;
    x ^= x >> 29;
    x *= 0x9E3779B97F4A7C15ull; /* requests sit in arrays: spread neighbours */
    return (unsigned)(x >> (64 - LIVE_HEADS_LOG2));
}

static pthread_mutex_t *lock_of(unsigned c)
{
    return &g_mu[c & (LIVE_LOCKS - 1)];
}

static int in_chain(unsigned c, const ferry_io_req *r)
{
    for (ferry_io_req *x = g_head[c]; x; x = ferry__rq_of(x)->live)
        if (x == r)
            return 1;
    return 0;
}

int ferry__io_live_take(ferry_io_req *r)
{
    pthread_once(&g_atfork_once, atfork_register);
    unsigned c = chain_of(r);
    pthread_mutex_lock(lock_of(c));
    int taken = !in_chain(c, r);
    if (taken) {
        ferry__rq_of(r)->live = g_head[c];
        g_head[c] = r;
    }
    pthread_mutex_unlock(lock_of(c));
    return taken;
}

int ferry__io_live_held(const ferry_io_req *r)
{
    unsigned c = chain_of(r);
    pthread_mutex_lock(lock_of(c));
    int held = in_chain(c, r);
    pthread_mutex_unlock(lock_of(c));
    return held;
}

void ferry__io_live_drop(ferry_io_req *r)
{
    unsigned c = chain_of(r);
    pthread_mutex_lock(lock_of(c));
    ferry_io_req **pp = &g_head[c];
    while (*pp && *pp != r)
        pp = &ferry__rq_of(*pp)->live;
    FERRY__ASSERT(*pp == r); /* only a request taken is dropped */
    if (*pp)
        *pp = ferry__rq_of(r)->live;
    pthread_mutex_unlock(lock_of(c));
}

unsigned ferry__io_live_longest(void)
{
    unsigned most = 0;
    for (unsigned c = 0; c < LIVE_HEADS; c++) {
        unsigned n = 0;
        pthread_mutex_lock(lock_of(c));
        for (ferry_io_req *x = g_head[c]; x; x = ferry__rq_of(x)->live)
            n++;
        pthread_mutex_unlock(lock_of(c));
        most = n > most ? n : most;
    }
    return most;
}
