/*
 * live_table.h - a process-wide table of the asynchronous requests in
 * flight, keyed by a request's address (private).
 *
 * io (src/io/live.c) and gds (src/gds/gds_live.c) each keep one: of any
 * number of threads submitting one request at once, to one engine or
 * context or to several, exactly one takes it (a look-up-and-insert under
 * its chain's lock), and each of the others sees the node that holds it
 * (under that lock: gds names the holder's context from it). Why a
 * table keyed by the address, one for the process: a fresh request's
 * private words are whatever the caller's memory held, so the request
 * itself cannot say whether it is in flight, nor where, and one engine
 * cannot look into another's queues, which the other's thread changes as
 * it runs.
 *
 * The node is intrusive: the table never allocates. It is one pointer,
 * because io's is in the request's private words, which are full: the key
 * a node stands for is not stored in it but answered by the table's key
 * function (io: the request the node is in; gds: the request its record
 * names). A node is written only under its chain's lock, from take until
 * drop.
 *
 * Cost: a queue has no fixed bound, so a table may hold hundreds of
 * thousands of requests, and every take and drop walks one chain.
 * FERRY__LIVE_HEADS chains keep them a few long at that (with 256 they
 * held a thousand each at 256k requests, and submit and reap spent
 * microseconds per request walking them); FERRY__LIVE_LOCKS mutexes, each
 * over every FERRY__LIVE_LOCKS-th chain, keep submitters of different
 * requests off one lock without a mutex per chain.
 *
 * fork: a child starts with every table empty and every lock free (the
 * parent's requests are not the child's: a copy of one submitted in the
 * child was FERRY_EBUSY for ever; a lock another thread held at the fork
 * stayed held). A child made without the fork handlers, by _Fork or a raw
 * clone, is not helped: nothing runs in it.
 */
#ifndef FERRY_SRC_LIVE_TABLE_H
#define FERRY_SRC_LIVE_TABLE_H

#include <pthread.h>
#include <stdatomic.h>

#define FERRY__LIVE_HEADS_LOG2 14
#define FERRY__LIVE_HEADS (1u << FERRY__LIVE_HEADS_LOG2) /* 128 KiB of chain heads */
#define FERRY__LIVE_LOCKS 256u /* a power of two, at most FERRY__LIVE_HEADS */

/* a request's link in a table, from take until drop */
typedef struct ferry__live_node {
    struct ferry__live_node *next; /* in its chain */
} ferry__live_node;

/* the key (a request's address) node n stands for */
typedef const void *(*ferry__live_key_fn)(const ferry__live_node *n);

/* one table: static storage, FERRY__LIVE_TABLE_INIT(key), nothing to free */
typedef struct ferry__live_table {
    ferry__live_key_fn key;
    pthread_mutex_t mu[FERRY__LIVE_LOCKS]; /* chain i: under mu[i % FERRY__LIVE_LOCKS] */
    ferry__live_node *head[FERRY__LIVE_HEADS];
    /* the process's tables, for the fork handler (live_table.c) */
    struct ferry__live_table *next_table;
    atomic_int listed;
} ferry__live_table;

#define FERRY__LIVE_M1 PTHREAD_MUTEX_INITIALIZER
#define FERRY__LIVE_M4 FERRY__LIVE_M1, FERRY__LIVE_M1, FERRY__LIVE_M1, FERRY__LIVE_M1
#define FERRY__LIVE_M16 FERRY__LIVE_M4, FERRY__LIVE_M4, FERRY__LIVE_M4, FERRY__LIVE_M4
#define FERRY__LIVE_M64 FERRY__LIVE_M16, FERRY__LIVE_M16, FERRY__LIVE_M16, FERRY__LIVE_M16
#define FERRY__LIVE_TABLE_INIT(key_fn)                                                          \
    {                                                                                           \
        (key_fn), {FERRY__LIVE_M64, FERRY__LIVE_M64, FERRY__LIVE_M64, FERRY__LIVE_M64}, {NULL}, \
            NULL, 0                                                                             \
    }

/* what a take that lost sees of the node holding its key (under that
 * node's chain lock: the holder stays in the table until seen returns) */
typedef void (*ferry__live_seen_fn)(const ferry__live_node *holder, void *arg);

/* take node's key (t->key(node)) for node: 1 when taken (node is in t
 * now), 0 when another node holds the key already (nothing written; seen,
 * unless NULL, is called with it first). pre: node is in no table */
int ferry__live_take(ferry__live_table *t, ferry__live_node *node, ferry__live_seen_fn seen,
                     void *arg);
/* whether key is in t now (0 without a lock for a table no take has
 * used: a lock of a table not yet on the fork handler's list is never
 * taken) */
int ferry__live_held(ferry__live_table *t, const void *key);
/* node, which take put in t, leaves it */
void ferry__live_drop(ferry__live_table *t, ferry__live_node *node);
/* (tests) the most nodes one chain of t holds now (a scan of all) */
unsigned ferry__live_longest(ferry__live_table *t);

#endif
