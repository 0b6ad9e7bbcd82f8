/*
 * pid.c - this process's id, cheap to ask for on every call.
 *
 * A handle belongs to the process that opened it (docs/ARCHITECTURE.md),
 * so the KV store's public calls check, each time, that the caller is the
 * opener and not a fork of it. getpid() is a system call (glibc caches it
 * no more): about 1 us in a VM or a sandbox, too much for every lookup. So
 * the id is kept here, read with one relaxed load, and a pthread_atfork
 * child handler puts the child's own id in at every fork() (os.fork,
 * multiprocessing and torch's DataLoader all go through it).
 *
 * Invariant: after the first ferry__pid(), the value is this process's id
 * in every process that came from it through fork(). A process made
 * without fork()'s handlers (a raw clone, _Fork) keeps its parent's id
 * here: that is the only way to fool it, and none of those callers use a
 * ferry handle afterwards (they exec).
 */
#include <pthread.h>
#include <stdatomic.h>
#include <unistd.h>

#include "core.h"

static _Atomic long g_pid; /* 0 until the first call */
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

static void pid_in_child(void)
{
    atomic_store_explicit(&g_pid, (long)getpid(), memory_order_relaxed);
}

static void pid_init(void)
{
    pthread_atfork(NULL, NULL, pid_in_child);
    atomic_store_explicit(&g_pid, (long)getpid(), memory_order_relaxed);
}

long ferry__pid(void)
{
    long p = atomic_load_explicit(&g_pid, memory_order_relaxed);
    if (p)
        return p;
    pthread_once(&g_once, pid_init);
    return atomic_load_explicit(&g_pid, memory_order_relaxed);
}
