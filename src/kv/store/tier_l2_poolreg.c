/*
 * tier_l2_poolreg.c - the L1 pool registered with L2's I/O engines after
 * open, on a thread of the store.
 *
 * L2 reads land in L1 slots and write-throughs leave from them, so the
 * pool is registered with the L2 tier's engines (io_uring fixed buffers:
 * no page pinning per request). The kernel pins, so faults and zeroes,
 * every page of the pool inside that registration: done in open, it made
 * `ferry_kv_open` of a 4 GiB pool with an L2 take seconds, whatever the L1
 * fill thread (tier_l1_fill.c) saved. Here a thread waits until the fill
 * thread has faulted the pool in (the pin then only takes present pages),
 * then registers it, while the store already serves. A fill that ended
 * early (the kernel refused a step: out of memory) leaves the pool
 * unregistered for good: pinning it would fault every page left inside
 * the registration, one system call close cannot interrupt, asking again
 * for the memory the kernel just refused (state: the fill's -errno).
 *
 * Why that is safe: until the registration returned, the engines do not
 * know the pool and move its bytes the plain way (uring.c publishes a
 * fixed buffer only once the kernel took all of it, and the submit path
 * reads the table with acquire); the same bytes move either way. A
 * registration that fails leaves it so for good (logged once). Close
 * stops the thread: while it waits for the fill, at once; inside the
 * registration (the kernel's pin of present pages: milliseconds a GiB)
 * once that returned; then it joins it and undoes the registration, as
 * before, after the store's own I/O has ended. The state is an atomic the
 * thread publishes; close reads it after the join.
 *
 * Only io_uring registers host memory: posix and the cufile engine accept
 * and ignore it, and cuFile's own registration (cuFileBufRegister, through
 * ferry_gds_register or ferry_io_register_dev) is of device memory, which
 * the store never asks for the pool; so nothing else is pinned at open.
 */
#include <errno.h>
#include <string.h>
#include <time.h>

#include "kv/kv_impl.h"

_Atomic unsigned ferry__kv_poolreg_test_hold;

static int waiting(ferry__kv_poolreg *r)
{
    return atomic_load_explicit(&ferry__kv_poolreg_test_hold, memory_order_relaxed) ||
           ferry__kv_tier_l1_filling(r->l1);
}

static void register_now(ferry__kv_poolreg *r)
{
    ferry__kv_tier *l1 = r->l1, *l2 = r->l2;
    size_t len = (size_t)(l1->capacity * l1->slot_bytes);
    int e = 0;
    if (ferry__kv_tier_l1_filling(l1) || !ferry__kv_tier_l1_faulted(l1, &e)) {
        /* (filling: no thread to wait for the fill with) */
        FERRY_LOGI("kv: the L1 pool (%zu bytes) is not faulted in whole (%s): not registered "
                   "with the L2 tier's engines (the pin would fault the rest); L2 transfers "
                   "take the engines' plain path",
                   len, e ? strerror(e) : "its fill has not finished");
        atomic_store_explicit(&r->state, e ? -e : FERRY_ESTATE, memory_order_release);
        return;
    }
    int rc = l2->ops->reg_pool(l2, l1->ops->host_ptr(l1, 0), len);
    if (rc < 0)
        FERRY_LOGI("kv: the L1 pool (%zu bytes) is not registered with the L2 tier's engines "
                   "(%s): L2 transfers take the engines' plain path", len, ferry_last_error());
    atomic_store_explicit(&r->state, rc < 0 ? rc : FERRY__KV_POOLREG_DONE, memory_order_release);
}

static void *reg_main(void *arg)
{
    ferry__kv_poolreg *r = arg;
    while (waiting(r)) {
        if (atomic_load_explicit(&r->stop, memory_order_relaxed))
            return NULL;
        struct timespec ms = {0, 2000000};
        nanosleep(&ms, NULL);
    }
    if (!atomic_load_explicit(&r->stop, memory_order_relaxed))
        register_now(r);
    return NULL;
}

void ferry__kv_poolreg_start(ferry__kv_poolreg *r, ferry__kv_tier *l1, ferry__kv_tier *l2)
{
    memset(r, 0, sizeof *r);
    atomic_init(&r->state, FERRY__KV_POOLREG_PENDING);
    if (!l2 || !l2->ops->reg_pool)
        return;
    r->l1 = l1;
    r->l2 = l2;
    int e = pthread_create(&r->th, NULL, reg_main, r);
    if (e == 0) {
        r->on = 1;
        return;
    }
    FERRY_LOGD("kv: no thread to register the L1 pool with L2 (%s): registering it now",
               strerror(e));
    register_now(r);
}

int ferry__kv_poolreg_state(const ferry__kv_poolreg *r)
{
    return atomic_load_explicit(&r->state, memory_order_acquire);
}

void ferry__kv_poolreg_stop(ferry__kv_poolreg *r)
{
    if (r->on) {
        atomic_store_explicit(&r->stop, 1, memory_order_relaxed);
        pthread_join(r->th, NULL);
        r->on = 0;
    }
    if (r->l2 && ferry__kv_poolreg_state(r) == FERRY__KV_POOLREG_DONE)
        r->l2->ops->unreg_pool(r->l2);
    r->l2 = NULL;
    atomic_store_explicit(&r->state, FERRY__KV_POOLREG_PENDING, memory_order_relaxed);
}
