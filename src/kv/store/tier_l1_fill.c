/*
 * tier_l1_fill.c - fault the L1 pool's pages in off the open path.
 *
 * A first touch of a pool page costs a fault that zeroes it (about 0.15 s
 * a GiB with huge pages on an idle host, several times that in a VM whose
 * memory was never touched), so faulting an 8 GiB pool on open made
 * `ferry_kv_open` take seconds. Now open faults the first step and a
 * thread faults the rest while the store is already in use.
 *
 * Why this is safe while stores write into the pool: the thread never
 * writes a byte. It asks the kernel, with madvise(MADV_POPULATE_WRITE), to
 * map each page as a write fault would; a page already present (a store's
 * copy got there first) is left as it is, so no store's bytes are ever
 * overwritten and there is nothing for a race detector to see. A store
 * into a page not yet faulted simply faults it itself, as with any
 * anonymous memory. The memory the pool takes is the same as before, it is
 * only taken during the first seconds instead of inside open.
 *
 * Close stops the thread between steps (FILL_STEP bytes, a few ms) and
 * joins it before the pool is unmapped; the pages it did not reach are
 * never faulted. A step the kernel refuses (out of memory) ends the
 * thread too, and so does one that would leave less memory available
 * than a reserve (room_for: a 32nd of what the process may have, 64 MiB
 * to 4 GiB), asked before each step (of a watch, core/meminfo.h, that
 * found the process's cgroups once, when the fill started: only their
 * numbers are read again): the kernel does not refuse a shared
 * pool's pages, it brings the OOM killer onto the host's largest process. Either way `whole` stays 0, and the L2 pool registration
 * (tier_l2_poolreg.c), which waits for the thread, then does not pin the
 * pool: pinning would fault every page left inside one system call that
 * close cannot interrupt, the memory the kernel just refused.
 */
#include "kv/store/tier_l1_fill.h"

#include <errno.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "core/core.h"
#include "core/meminfo.h"

#define FILL_STEP ((size_t)8 << 20)

_Atomic unsigned ferry__kv_l1_test_hold;
_Atomic unsigned ferry__kv_l1_test_fail_step;

/* 0, or the errno of MADV_POPULATE_WRITE (EINVAL: the kernel has none) */
static int populate(unsigned char *at, size_t n)
{
#ifdef MADV_POPULATE_WRITE
    return madvise(at, n, MADV_POPULATE_WRITE) == 0 ? 0 : errno;
#else
    (void)at;
    (void)n;
    return EINVAL;
#endif
}

/* the old way: write a zero into every page (before any store can see it) */
static void touch_all(unsigned char *pool, size_t bytes)
{
    for (size_t off = 0; off < bytes; off += 4096)
        pool[off] = 0;
}

/* the memory left free when faulting the pool in: a 32nd of what the
 * process may have, between 64 MiB and 4 GiB */
static uint64_t reserve_of(uint64_t total)
{
    uint64_t r = total / 32;
    return r < ((uint64_t)64 << 20) ? (uint64_t)64 << 20 : r > ((uint64_t)4 << 30) ? (uint64_t)4 << 30 : r;
}

/* whether n more bytes of the pool may be faulted in now: they leave the
 * reserve available. Else (said once, at off of bytes) the pool's pages
 * are taken as chunks arrive: faulted ahead past what is available, the
 * pool would bring the OOM killer onto the largest process of the host.
 * Asked of the fill's watch (its cgroups found once, at the start), or
 * anew where it has none (out of memory for it). */
static int room_for(ferry__kv_l1_fill *f, size_t n, size_t off, size_t bytes)
{
    uint64_t total, avail;
    if (f->mem)
        ferry__memwatch_read(f->mem, &total, &avail);
    else
        ferry__host_memory(&total, &avail);
    if (avail >= n && avail - n >= reserve_of(total))
        return 1;
    FERRY_LOGW("kv L1: faulting the pool in stopped at %zu of %zu bytes: %.2f GiB of memory "
               "is available and %.2f GiB is kept free; the rest of the pool is taken as "
               "chunks arrive",
               off, bytes, (double)avail / (1u << 30), (double)reserve_of(total) / (1u << 30));
    return 0;
}

/* test seam: wait while the hold says this thread has done its steps */
static void held(ferry__kv_l1_fill *f, unsigned steps)
{
    for (;;) {
        unsigned hold = atomic_load_explicit(&ferry__kv_l1_test_hold, memory_order_relaxed);
        if (!hold || steps < hold || atomic_load_explicit(&f->stop, memory_order_relaxed))
            return;
        struct timespec ms = {0, 1000000};
        nanosleep(&ms, NULL);
    }
}

/* fault [from, to) step by step until stopped; `seam`: the test hold and
 * failure apply (the thread's run, not open's own when it has no thread).
 * Sets whole when it reached the end, err when the kernel refused. */
static void fill_range(ferry__kv_l1_fill *f, int seam)
{
    unsigned steps = 2; /* open did the first */
    for (size_t off = f->from; off < f->to; off += FILL_STEP, steps++) {
        if (seam)
            held(f, steps - 1);
        if (atomic_load_explicit(&f->stop, memory_order_relaxed))
            return;
        size_t n = f->to - off < FILL_STEP ? f->to - off : FILL_STEP;
        int e = seam && atomic_load_explicit(&ferry__kv_l1_test_fail_step,
                                             memory_order_relaxed) == steps
                    ? ENOMEM
                : !room_for(f, n, off, f->to) ? ENOMEM
                                           : populate(f->pool + off, n);
        if (e) { /* out of memory: what is left faults on first use */
            FERRY_LOGD("kv L1: faulting in %zu bytes at offset %zu of the pool: %s; the rest "
                       "faults on first use",
                       n, off, strerror(e));
            atomic_store_explicit(&f->err, e, memory_order_relaxed);
            return;
        }
    }
    atomic_store_explicit(&f->whole, 1, memory_order_relaxed);
}

/* the watch the fill asked of, closed (its files) and freed */
static void mem_done(ferry__kv_l1_fill *f)
{
    if (!f->mem)
        return;
    ferry__memwatch_close(f->mem);
    ferry__free(f->mem);
    f->mem = NULL;
}

static void *fill_main(void *arg)
{
    ferry__kv_l1_fill *f = arg;
    fill_range(f, 1);
    mem_done(f);
    atomic_store_explicit(&f->busy, 0, memory_order_release); /* (whole and err before) */
    return NULL;
}

int ferry__kv_l1_fill_busy(ferry__kv_l1_fill *f)
{
    return atomic_load_explicit(&f->busy, memory_order_acquire);
}

int ferry__kv_l1_fill_whole(ferry__kv_l1_fill *f, int *err)
{
    if (ferry__kv_l1_fill_busy(f)) /* (acquire: whole and err as the thread left them) */
        return 0;
    if (err)
        *err = atomic_load_explicit(&f->err, memory_order_relaxed);
    return atomic_load_explicit(&f->whole, memory_order_relaxed);
}

void ferry__kv_l1_fill_start(ferry__kv_l1_fill *f, unsigned char *pool, size_t bytes)
{
    memset(f, 0, sizeof *f);
#ifdef MADV_HUGEPAGE
    if (madvise(pool, bytes, MADV_HUGEPAGE) != 0)
        FERRY_LOGD("kv L1: madvise(MADV_HUGEPAGE) on %zu bytes: %s", bytes, strerror(errno));
#endif
    if ((f->mem = ferry__malloc(sizeof *f->mem)) != NULL)
        ferry__memwatch_open(f->mem, NULL);
    size_t first = bytes < FILL_STEP ? bytes : FILL_STEP;
    int e = room_for(f, first, 0, bytes) ? populate(pool, first) : ENOMEM;
    if (e == EINVAL && room_for(f, bytes, 0, bytes)) {
        touch_all(pool, bytes);
        atomic_store_explicit(&f->whole, 1, memory_order_relaxed);
        mem_done(f);
        return;
    }
    if (e) {
        FERRY_LOGD("kv L1: faulting in the pool's first %zu bytes: %s; pages fault on first use",
                   first, strerror(e));
        atomic_store_explicit(&f->err, e, memory_order_relaxed);
        mem_done(f);
        return;
    }
    if (first == bytes) {
        atomic_store_explicit(&f->whole, 1, memory_order_relaxed);
        mem_done(f);
        return;
    }
    f->pool = pool;
    f->from = first;
    f->to = bytes;
    atomic_init(&f->stop, 0);
    atomic_store_explicit(&f->busy, 1, memory_order_relaxed); /* (before the thread can end) */
    e = pthread_create(&f->th, NULL, fill_main, f);
    if (e == 0) {
        f->on = 1;
        return;
    }
    atomic_store_explicit(&f->busy, 0, memory_order_relaxed);
    FERRY_LOGD("kv L1: no thread to fault the pool in (%s): faulting %zu bytes now", strerror(e),
               bytes - first);
    fill_range(f, 0);
    mem_done(f);
}

void ferry__kv_l1_fill_stop(ferry__kv_l1_fill *f)
{
    if (!f->on)
        return;
    atomic_store_explicit(&f->stop, 1, memory_order_relaxed);
    pthread_join(f->th, NULL);
    f->on = 0;
}
