/*
 * log.c - leveled logging to stderr or a callback.
 *
 * The level is read once from env FERRY_LOG (lazily, on first use; a value
 * that is no level reads as warn, and the first open says so: env.c) and
 * can be changed at run time; reads and writes of the level are atomic so any
 * thread may log while another changes it.
 *
 * The callback and its context are one pair, and a thread that logs must
 * call the pair installed, never the function of one and the context of
 * another, and never a pair after the call that replaced it returned (the
 * context may be freed then). Two slots and a count of the threads in each
 * (a left-right scheme, no lock on the logging path): a setter, one at a
 * time, waits until no thread is in the spare slot, writes the pair there,
 * makes it current, then waits until the old slot's threads leave. A
 * logging thread counts itself into the slot it read as current and reads
 * the pair only once that slot is still current (so it was written before
 * it was made current, and no setter rewrites it while the count holds).
 */
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "core.h"
#include "env.h"

static atomic_int g_level = -1; /* -1: not yet read from the environment */
static struct {
    ferry_log_fn fn;
    void *ctx;
    atomic_uint inside; /* threads that may call this slot's pair */
} g_slot[2];
static atomic_int g_cur;      /* the slot loggers use */
static pthread_mutex_t g_set_lock = PTHREAD_MUTEX_INITIALIZER;
static _Thread_local unsigned t_inside[2]; /* this thread's share of inside */
static pthread_once_t g_fork_once = PTHREAD_ONCE_INIT;

/* a child has only the forking thread: the counts of the others, and a
 * setter's lock, would make its first ferry_log_set_callback wait forever */
static void fork_child(void)
{
    for (int i = 0; i < 2; i++)
        atomic_store(&g_slot[i].inside, t_inside[i]);
    pthread_mutex_init(&g_set_lock, NULL);
}

static void fork_register(void)
{
    pthread_atfork(NULL, NULL, fork_child);
}

int ferry_log_level_parse(const char *s)
{
    static const char *names[] = {"off", "error", "warn", "info", "debug", "trace"};
    if (!s || !*s)
        return -1;
    for (int i = 0; i < 6; i++)
        if (strcasecmp(s, names[i]) == 0)
            return i;
    if (strcasecmp(s, "warning") == 0)
        return FERRY_LOG_WARN;
    if (s[0] >= '0' && s[0] <= '5' && s[1] == 0)
        return s[0] - '0';
    return -1;
}

int ferry_log_get_level(void)
{
    int l = atomic_load(&g_level);
    if (l < 0) {
        /* (a value that is no level is warned of at the first open: env.c) */
        l = ferry__env_log_level(getenv("FERRY_LOG"), NULL);
        atomic_store(&g_level, l);
    }
    return l;
}

void ferry_log_set_level(int level)
{
    if (level < FERRY_LOG_OFF)
        level = FERRY_LOG_OFF;
    if (level > FERRY_LOG_TRACE)
        level = FERRY_LOG_TRACE;
    atomic_store(&g_level, level);
}

/* (this thread's own calls aside: a callback that sets a callback, though
 * the header forbids it, does not wait for itself forever) */
static void wait_slot_empty(int i)
{
    while (atomic_load(&g_slot[i].inside) != t_inside[i])
        sched_yield();
}

void ferry_log_set_callback(ferry_log_fn fn, void *ctx)
{
    pthread_once(&g_fork_once, fork_register);
    pthread_mutex_lock(&g_set_lock);
    int old = atomic_load(&g_cur), spare = !old;
    wait_slot_empty(spare); /* late readers of the slot before old */
    g_slot[spare].fn = fn;
    g_slot[spare].ctx = ctx;
    atomic_store(&g_cur, spare);
    wait_slot_empty(old); /* no thread calls the old pair after we return */
    pthread_mutex_unlock(&g_set_lock);
}

/* enter the current slot: its pair stays as read until slot_leave */
static int slot_enter(void)
{
    pthread_once(&g_fork_once, fork_register);
    for (;;) {
        int i = atomic_load(&g_cur);
        t_inside[i]++;
        atomic_fetch_add(&g_slot[i].inside, 1);
        if (atomic_load(&g_cur) == i)
            return i;
        atomic_fetch_sub(&g_slot[i].inside, 1); /* a setter moved on: retry */
        t_inside[i]--;
    }
}

static void slot_leave(int i)
{
    atomic_fetch_sub(&g_slot[i].inside, 1);
    t_inside[i]--;
}

int ferry__log_enabled(int level)
{
    return level <= ferry_log_get_level();
}

void ferry__log(int level, const char *fmt, ...)
{
    static const char *tags[] = {"", "error", "warn", "info", "debug", "trace"};
    if (level <= 0 || !ferry__log_enabled(level))
        return;
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    int i = slot_enter();
    ferry_log_fn fn = g_slot[i].fn;
    if (fn)
        fn(level, msg, g_slot[i].ctx);
    slot_leave(i);
    if (!fn)
        fprintf(stderr, "ferry %s: %s\n", tags[level > 5 ? 5 : level], msg);
}

int ferry__warn_ok(ferry__warnlim *w, uint64_t *quiet)
{
    uint64_t now = ferry__now_ns();
    if (atomic_fetch_add(&w->said, 1) >= FERRY__WARN_BURST) {
        uint64_t next = atomic_load(&w->next_ns);
        if (now < next ||
            !atomic_compare_exchange_strong(&w->next_ns, &next, now + 1000000000ull)) {
            atomic_fetch_add(&w->quiet, 1);
            return 0;
        }
    } else {
        atomic_store(&w->next_ns, now + 1000000000ull);
    }
    *quiet = atomic_exchange(&w->quiet, 0);
    return 1;
}

void ferry__assert_fail(const char *what, const char *file, int line, const char *fn)
{
    fprintf(stderr, "ferry: invariant broken at %s:%d in %s(): %s\n", file, line, fn, what);
    fflush(stderr);
    abort();
}
