/*
 * live_table.c - the process's tables of requests in flight (live_table.h).
 *
 * Invariant: a node is in its table from the take that returned NULL for
 * it until its drop, and take is one look-up-and-insert under the chain's
 * lock, so of threads taking one key at once exactly one inserts. Every
 * table that ever took a key is on one list before its first insert, so
 * the fork handler (one for all tables) empties them all in the child.
 */
#include "live_table.h"

#include <stdint.h>

#include "core.h"

/* the tables that took a key, newest first (pushed under g_list_mu; read
 * by the fork handler, where only the forking thread runs) */
static _Atomic(ferry__live_table *) g_tables;
static pthread_mutex_t g_list_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t g_atfork_once = PTHREAD_ONCE_INIT;

/* in the child only the forking thread runs: whatever another thread was
 * doing to a table is gone with it, so the chains start empty and every
 * lock unheld (one may have been held at the fork) */
static void fork_child(void)
{
    for (ferry__live_table *t = atomic_load(&g_tables); t; t = t->next_table) {
        for (unsigned c = 0; c < FERRY__LIVE_HEADS; c++)
            t->head[c] = NULL;
        for (unsigned i = 0; i < FERRY__LIVE_LOCKS; i++)
            pthread_mutex_init(&t->mu[i], NULL);
    }
    pthread_mutex_init(&g_list_mu, NULL);
}

static void atfork_register(void)
{
    pthread_atfork(NULL, NULL, fork_child);
}

/* t on the list (and the handler registered) before its first insert: a
 * table not listed yet holds nothing a child would have to forget. The
 * list, not the flag, says whether t is on it: a fork between the push
 * and the flag's store gives a child t listed with the flag clear, and
 * pushing t again there made it its own successor (the child's next fork
 * ran its handler round that loop for ever). */
static void enlist(ferry__live_table *t)
{
    if (atomic_load_explicit(&t->listed, memory_order_acquire))
        return;
    pthread_once(&g_atfork_once, atfork_register);
    pthread_mutex_lock(&g_list_mu);
    const ferry__live_table *x = atomic_load(&g_tables);
    while (x && x != t)
        x = x->next_table;
    if (!x) {
        t->next_table = atomic_load(&g_tables);
        atomic_store(&g_tables, t);
    }
    atomic_store_explicit(&t->listed, 1, memory_order_release);
    pthread_mutex_unlock(&g_list_mu);
}

/* whether t may hold a key or a chain lock: a table never listed has
 * neither, and is not locked, as the fork handler would not free a lock of
 * one (a look-up of a table no take has used yet, in a thread beside a
 * fork, left that chain's lock held in the child) */
static int listed(ferry__live_table *t)
{
    return atomic_load_explicit(&t->listed, memory_order_acquire);
}

static unsigned chain_of(const void *key)
{
    uint64_t x = (uint64_t)(uintptr_t)key;
    x ^= x >> 29;
    x *= 0x9E3779B97F4A7C15ull; /* requests sit in arrays: spread neighbours */
    return (unsigned)(x >> (64 - FERRY__LIVE_HEADS_LOG2));
}

static pthread_mutex_t *lock_of(ferry__live_table *t, unsigned c)
{
    return &t->mu[c & (FERRY__LIVE_LOCKS - 1)];
}

static ferry__live_node *find(const ferry__live_table *t, unsigned c, const void *key)
{
    for (ferry__live_node *x = t->head[c]; x; x = x->next)
        if (t->key(x) == key)
            return x;
    return NULL;
}

int ferry__live_take(ferry__live_table *t, ferry__live_node *node, ferry__live_seen_fn seen,
                     void *arg)
{
    const void *key = t->key(node);
    enlist(t);
    unsigned c = chain_of(key);
    pthread_mutex_lock(lock_of(t, c));
    const ferry__live_node *holder = find(t, c, key);
    if (!holder) {
        node->next = t->head[c];
        t->head[c] = node;
    } else if (seen) {
        seen(holder, arg); /* under the lock: the holder cannot be dropped meanwhile */
    }
    pthread_mutex_unlock(lock_of(t, c));
    return !holder;
}

int ferry__live_held(ferry__live_table *t, const void *key)
{
    if (!listed(t))
        return 0;
    unsigned c = chain_of(key);
    pthread_mutex_lock(lock_of(t, c));
    int held = find(t, c, key) != NULL;
    pthread_mutex_unlock(lock_of(t, c));
    return held;
}

void ferry__live_drop(ferry__live_table *t, ferry__live_node *node)
{
    unsigned c = chain_of(t->key(node));
    pthread_mutex_lock(lock_of(t, c));
    ferry__live_node **pp = &t->head[c];
    while (*pp && *pp != node)
        pp = &(*pp)->next;
    FERRY__ASSERT(*pp == node); /* only a node taken is dropped */
    if (*pp)
        *pp = node->next;
    pthread_mutex_unlock(lock_of(t, c));
}

unsigned ferry__live_longest(ferry__live_table *t)
{
    unsigned most = 0;
    if (!listed(t))
        return 0;
    for (unsigned c = 0; c < FERRY__LIVE_HEADS; c++) {
        unsigned n = 0;
        pthread_mutex_lock(lock_of(t, c));
        for (const ferry__live_node *x = t->head[c]; x; x = x->next)
            n++;
        pthread_mutex_unlock(lock_of(t, c));
        most = n > most ? n : most;
    }
    return most;
}
