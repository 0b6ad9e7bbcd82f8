/*
 * env.c - the library's own environment variables that no handle's
 * options carry: FERRY_LOG (the log level, log.c), FERRY_KV_DIRECT and
 * FERRY_KV_READ_DEPTH (the KV store's retrieve: ferry/kv.h).
 *
 * Invariant: a value the library does not take is never dropped in
 * silence. The first open of any handle in the process (every open takes
 * its options through ferry__opts_take, which calls ferry__env_check)
 * warns once of each such variable, in one line naming it, its value,
 * what it accepts and what is used instead; the variable still reads as
 * unset, so a valid value's behaviour is unchanged. Variables an open
 * refuses are not checked here: FERRY_IO_ENGINE and FERRY_DEVICE (an
 * "auto" open, the one that reads them, fails naming the value), and
 * ferry serve's FERRY_<KEY> (serve_config.c).
 *
 * The rules are the readers': store_rdirect.c and store_retrieve.c read
 * FERRY_KV_DIRECT and FERRY_KV_READ_DEPTH through ferry__env_kv_direct and
 * ferry__env_read_depth, so what is warned of is what they ignore
 * (tests/test_core.c holds the read depth to the store's own answers).
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "env.h"

static void set_bad(int *bad, int v)
{
    if (bad)
        *bad = v;
}

int ferry__env_log_level(const char *v, int *bad)
{
    int l = ferry_log_level_parse(v);
    set_bad(bad, v && *v && l < 0);
    return l < 0 ? FERRY_LOG_WARN : l;
}

int ferry__env_kv_direct(const char *v, int *bad)
{
    int m = v && !strcmp(v, "0") ? 0 : v && !strcmp(v, "1") ? 1 : 2;
    set_bad(bad, v && *v && m == 2);
    return m;
}

unsigned ferry__env_read_depth(const char *v, unsigned dflt, int *bad)
{
    char *end = NULL;
    long d = v && *v ? strtol(v, &end, 10) : 0;
    int ok = v && *v && *end == 0 && d >= 1 && d <= 32;
    set_bad(bad, v && *v && !ok);
    return ok ? (unsigned)d : dflt;
}

int ferry__env_warn(void)
{
    int n = 0, bad = 0;
    const char *v = getenv("FERRY_LOG");
    ferry__env_log_level(v, &bad);
    if (bad && ++n)
        FERRY_LOGW("FERRY_LOG=%s: not a level (off, error, warn, info, debug, trace or 0..5); "
                   "using warn", v);
    v = getenv("FERRY_KV_DIRECT");
    ferry__env_kv_direct(v, &bad);
    if (bad && ++n)
        FERRY_LOGW("FERRY_KV_DIRECT=%s: accepted 0 (no direct reads) or 1 (into any aligned "
                   "buffer); using the default: direct reads into huge pages only", v);
    v = getenv("FERRY_KV_READ_DEPTH");
    ferry__env_read_depth(v, 0, &bad);
    if (bad && ++n)
        FERRY_LOGW("FERRY_KV_READ_DEPTH=%s: accepted 1..32 reads in flight; using the "
                   "store's own depth (16)", v);
    return n;
}

static pthread_once_t env_once = PTHREAD_ONCE_INIT;

static void env_warn_once(void)
{
    ferry__env_warn();
}

void ferry__env_check(void)
{
    pthread_once(&env_once, env_warn_once);
}
