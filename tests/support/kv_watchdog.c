/*
 * kv_watchdog.c - a deadline for the threaded KV tests: a store that stops
 * making progress fails the test at once, with its queues and counters,
 * instead of running into CTest's timeout without a word.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <unistd.h>

#include "ferry_test.h"
#include "kv/kv_impl.h"

static pthread_t g_thread;
static atomic_int g_stop, g_kicks, g_running;
static ferry_kv *g_kv;
static unsigned g_seconds;
static const char *g_what;

/* what the store is doing (stuck threads wait on condition variables, so
 * the mutexes are normally free; a held one is reported, not waited for) */
static void dump(ferry_kv *kv)
{
    int qlocked = pthread_mutex_trylock(&kv->qmu) == 0;
    int mlocked = pthread_mutex_trylock(&kv->mu) == 0;
    fprintf(stderr,
            "  store (%s, %s): operations queued %s, copies lent %u, operation workers busy "
            "%u of %u; I/O jobs queued %s, busy %u of %u\n",
            qlocked ? "queue lock free" : "queue lock HELD",
            mlocked ? "store lock free" : "store lock HELD", kv->q[0].head ? "yes" : "no",
            kv->q[0].nlent, kv->q[0].active, kv->q[0].nthreads, kv->q[1].head ? "yes" : "no",
            kv->q[1].active, kv->q[1].nthreads);
    ferry__kv_tier *l1 = kv->tier[FERRY_KV_TIER_L1];
    fprintf(stderr,
            "  L1 %llu of %llu slots used (%llu retired); slots reading from L2 %llu, "
            "write-throughs in flight %llu, prefetch bytes in flight %llu\n",
            (unsigned long long)(l1 ? l1->used : 0), (unsigned long long)(l1 ? l1->capacity : 0),
            (unsigned long long)kv->l1_retired, (unsigned long long)kv->l1_reading,
            (unsigned long long)kv->l2_writes_inflight,
            (unsigned long long)kv->prefetch_inflight);
    if (mlocked)
        pthread_mutex_unlock(&kv->mu);
    if (qlocked)
        pthread_mutex_unlock(&kv->qmu);
}

static void *watch(void *arg)
{
    (void)arg;
    int kicks = atomic_load(&g_kicks);
    unsigned ticks = 0;
    while (!atomic_load(&g_stop) && ticks < g_seconds * 10u) {
        usleep(100000);
        int now = atomic_load(&g_kicks);
        ticks = now == kicks ? ticks + 1 : 0;
        kicks = now;
    }
    if (atomic_load(&g_stop))
        return NULL;
    fprintf(stderr, "%s: no progress in %u s: a deadlock or livelock in the store\n", g_what,
            g_seconds);
    if (g_kv)
        dump(g_kv);
    fflush(stderr);
    _exit(1);
}

void ft_kv_watchdog_start(ferry_kv *kv, unsigned seconds, const char *what)
{
    ft_kv_watchdog_stop(); /* (one a failed test left behind) */
    g_kv = kv;
    g_seconds = seconds;
    g_what = what;
    atomic_store(&g_stop, 0);
    if (pthread_create(&g_thread, NULL, watch, NULL) != 0)
        fail_msg("%s: could not start the watchdog", what);
    atomic_store(&g_running, 1);
}

void ft_kv_watchdog_kick(void)
{
    atomic_fetch_add(&g_kicks, 1);
}

void ft_kv_watchdog_stop(void)
{
    if (!atomic_exchange(&g_running, 0))
        return;
    atomic_store(&g_stop, 1);
    pthread_join(g_thread, NULL);
}
