/*
 * log.c - leveled logging to stderr or a callback.
 *
 * The level is read once from env FERRY_LOG (lazily, on first use; a value
 * that is no level reads as warn, and the first open says so: env.c) and
 * can be changed at run time; reads and writes of the level are atomic so any
 * thread may log while another changes it.
 */
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "core.h"
#include "env.h"

static atomic_int g_level = -1; /* -1: not yet read from the environment */
static ferry_log_fn g_fn;
static void *g_ctx;

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

void ferry_log_set_callback(ferry_log_fn fn, void *ctx)
{
    g_fn = fn;
    g_ctx = ctx;
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
    if (g_fn) {
        g_fn(level, msg, g_ctx);
        return;
    }
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
