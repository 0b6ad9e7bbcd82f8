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
 * Its chains and their locks: below.
 */
#include <pthread.h>
#include <stdint.h>

#include "gds_impl.h"

/* LIVE_HEADS chains keep them a few long with many thousands in flight
 * (every take and drop walks one; with 64 they grew with the queues and
 * submit and reap went quadratic in their depth); LIVE_LOCKS mutexes, each
 * over every LIVE_LOCKS-th chain, keep submitters of different requests
 * off one lock without a mutex per chain */
#define LIVE_HEADS_LOG2 14
#define LIVE_HEADS (1u << LIVE_HEADS_LOG2) /* 128 KiB of chain heads */
#define LIVE_LOCKS 256u                    /* a power of two, at most LIVE_HEADS */

typedef struct bucket {
    pthread_mutex_t *mu;
    ferry__gds_live **head;
} bucket;

#define M1 PTHREAD_MUTEX_INITIALIZER
#define M4 M1, M1, M1, M1
#define M16 M4, M4, M4, M4
#define M64 M16, M16, M16, M16
static pthread_mutex_t g_mu[LIVE_LOCKS] = {M64, M64, M64, M64};
static ferry__gds_live *g_head[LIVE_HEADS]; /* chain i: under g_mu[i % LIVE_LOCKS] */

/* fork: the child starts with an empty table and every lock free (the
 * parent's contexts' requests are not the child's; a lock another thread
 * held at the fork stayed held in the child). A child made by _Fork or a
 * raw clone runs no handler. */
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

static bucket bucket_of(const ferry_gds_req *req)
{
    uint64_t x = (uint64_t)(uintptr_t)req;
    x ^= x >> 29;
    x *= 0x9E3779B97F4A7C15ull; /* requests sit in arrays: spread neighbours */
    unsigned c = (unsigned)(x >> (64 - LIVE_HEADS_LOG2));
    return (bucket){&g_mu[c & (LIVE_LOCKS - 1)], &g_head[c]};
}

ferry_gds *ferry__gds_live_take(ferry__gds_live *e)
{
    pthread_once(&g_atfork_once, atfork_register);
    bucket b = bucket_of(e->req);
    pthread_mutex_lock(b.mu);
    ferry_gds *holder = NULL;
    for (const ferry__gds_live *x = *b.head; x && !holder; x = x->next)
        if (x->req == e->req)
            holder = x->owner;
    if (!holder) {
        e->next = *b.head;
        *b.head = e;
    }
    pthread_mutex_unlock(b.mu);
    return holder;
}

void ferry__gds_live_drop(ferry__gds_live *e)
{
    bucket b = bucket_of(e->req);
    pthread_mutex_lock(b.mu);
    ferry__gds_live **pp = b.head;
    while (*pp && *pp != e)
        pp = &(*pp)->next;
    FERRY__ASSERT(*pp == e); /* only a request taken is dropped */
    if (*pp)
        *pp = e->next;
    pthread_mutex_unlock(b.mu);
}

unsigned ferry__gds_live_longest(void)
{
    unsigned most = 0;
    for (unsigned c = 0; c < LIVE_HEADS; c++) {
        pthread_mutex_lock(&g_mu[c & (LIVE_LOCKS - 1)]);
        unsigned n = 0;
        for (const ferry__gds_live *x = g_head[c]; x; x = x->next)
            n++;
        pthread_mutex_unlock(&g_mu[c & (LIVE_LOCKS - 1)]);
        most = n > most ? n : most;
    }
    return most;
}
