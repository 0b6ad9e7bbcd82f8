/*
 * tier_l1_fill.h - the L1 pool's pages faulted in off the open path
 * (private; tier_l1_fill.c).
 */
#ifndef FERRY_SRC_KV_TIER_L1_FILL_H
#define FERRY_SRC_KV_TIER_L1_FILL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>

struct ferry__memwatch;

typedef struct ferry__kv_l1_fill {
    unsigned char *pool;
    struct ferry__memwatch *mem; /* the memory asked of before each step (the
                                  * thread's, freed when it ends; NULL: asked anew) */
    size_t from, to;      /* what the thread has left to fault: [from, to) */
    pthread_t th;
    int on;               /* th runs (joined by _stop) */
    atomic_int stop;
    atomic_int busy;      /* th has steps left (cleared, release, when it ends) */
    atomic_int whole;     /* every page faulted in (set, release, before busy clears) */
    atomic_int err;       /* the errno that stopped the faulting early (0: none) */
} ferry__kv_l1_fill;

/*
 * Fault [pool, pool + bytes) in, advised huge: the first step now, the rest
 * by a thread while the store is already in use. f is the caller's (inside
 * the L1 tier) and must stay put until ferry__kv_l1_fill_stop. Never
 * fails: without MADV_POPULATE_WRITE (Linux before 5.14) every page is
 * touched now, as before; without a thread the rest is faulted now.
 */
void ferry__kv_l1_fill_start(ferry__kv_l1_fill *f, unsigned char *pool, size_t bytes);
/* stop the thread within one step (a few ms) and join it; pages it did not
 * reach fault on first use. Idempotent; a zeroed f is a no-op. */
void ferry__kv_l1_fill_stop(ferry__kv_l1_fill *f);
/* whether a thread is still faulting the pool in: 0 once it ended (every
 * page present, or it stopped or failed) and for a pool that has none; any
 * thread may ask */
int ferry__kv_l1_fill_busy(ferry__kv_l1_fill *f);
/* once not busy: 1 when every page of the pool was faulted in (by open or
 * the thread), 0 when the faulting stopped early (out of memory: *err, if
 * given, says why; or close stopped it); any thread may ask */
int ferry__kv_l1_fill_whole(ferry__kv_l1_fill *f, int *err);

/* test seam: while nonzero, every fill thread waits after that many steps
 * (until it is cleared or its pool closes). Unarmed: one relaxed load per
 * step. */
extern _Atomic unsigned ferry__kv_l1_test_hold;
/* test seam: while nonzero, a fill thread's step of that number (2: the
 * thread's first, as open does step 1) fails with ENOMEM, as the kernel's
 * MADV_POPULATE_WRITE does when memory runs out */
extern _Atomic unsigned ferry__kv_l1_test_fail_step;

#endif
