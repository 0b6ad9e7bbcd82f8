/*
 * pid.c - this process's id, cheap to ask for on every call.
 *
 * A handle belongs to the process that opened it (docs/ARCHITECTURE.md),
 * so the KV store's public calls check, each time, that the caller is the
 * opener and not a fork of it. getpid() is a system call (glibc caches it
 * no more): about 1 us in a VM or a sandbox, too much for every lookup. So
 * the id is kept here and read with one load (two: the cell's address).
 *
 * The cell is a page of its own advised MADV_WIPEONFORK: the kernel hands
 * every child made without CLONE_VM a zeroed copy, whatever made it -
 * fork() and its pthread_atfork handlers (os.fork, multiprocessing,
 * torch's DataLoader), but also _Fork(), a raw clone or a runtime's own
 * fork, which run no handler. A child reading 0 asks getpid() once. A
 * handler alone kept the parent's id in those children, and their calls
 * went on into a store whose pool they do not map (a SIGSEGV) and whose
 * workers they lack (a hang). Where the kernel has no WIPEONFORK (before
 * Linux 4.14) or the page cannot be had, the cell is a static and a
 * pthread_atfork child handler (registered either way) keeps it right in
 * fork()'s children only.
 *
 * Invariant: after the first ferry__pid(), the value read is this
 * process's id in every process that came from it without sharing its
 * memory (with WIPEONFORK), or through fork() (without). A vfork child
 * shares its parent's memory and calls nothing but exec or _exit.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <sys/mman.h>
#include <unistd.h>

#include "core.h"

static _Atomic long g_static;          /* the cell without WIPEONFORK */
static _Atomic long *_Atomic g_cell;   /* NULL until the first call */
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

static void pid_in_child(void)
{
    _Atomic long *c = atomic_load_explicit(&g_cell, memory_order_acquire);
    if (c)
        atomic_store_explicit(c, (long)getpid(), memory_order_relaxed);
}

/* a page of its own that a child (not sharing memory) gets zeroed, or NULL */
static _Atomic long *wiped_cell(void)
{
#ifdef MADV_WIPEONFORK
    long pg = sysconf(_SC_PAGESIZE);
    size_t len = pg > 0 ? (size_t)pg : 4096;
    void *m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED)
        return NULL;
    if (madvise(m, len, MADV_WIPEONFORK) != 0) {
        munmap(m, len);
        return NULL;
    }
    return (_Atomic long *)m; /* (kept for the life of the process) */
#else
    return NULL;
#endif
}

static void pid_init(void)
{
    _Atomic long *c = wiped_cell();
    if (!c)
        c = &g_static;
    atomic_store_explicit(c, (long)getpid(), memory_order_relaxed);
    atomic_store_explicit(&g_cell, c, memory_order_release);
    pthread_atfork(NULL, NULL, pid_in_child);
}

long ferry__pid(void)
{
    _Atomic long *c = atomic_load_explicit(&g_cell, memory_order_acquire);
    if (!c) {
        pthread_once(&g_once, pid_init);
        c = atomic_load_explicit(&g_cell, memory_order_acquire);
    }
    long p = atomic_load_explicit(c, memory_order_relaxed);
    if (p)
        return p;
    /* a child the kernel wiped the cell in: its own id, once */
    p = (long)getpid();
    atomic_store_explicit(c, p, memory_order_relaxed);
    return p;
}
