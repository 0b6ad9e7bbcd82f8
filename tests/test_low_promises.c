/*
 * test_low_promises.c - promises of the lower-tier headers (ferry/core.h,
 * ferry/slab.h, ferry/pslab.h) that no other test checks from outside:
 * NULL handles and bad arguments fail with a code and a message, sizes
 * parse exactly or are refused, a read-only store refuses every write and
 * leaves its files alone, iterate hands back the callback's code; every
 * pslab call but close from several threads at once on one store.
 */
/* ferry-test-labels: concurrent */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ferry_test.h"
#include "redis_server.h"
#include "io/sys.h"
#include "pslab/pslab_int.h"

#define K4 4096u
#define MiB (1024ull * 1024)

/* the calling thread's message names `what` */
static void msg_names(const char *what)
{
    const char *m = ferry_last_error();
    if (!strstr(m, what))
        fail_msg("message \"%s\" does not name \"%s\"", m, what);
}

/* ---- core.h ---- */

static void parse_size_is_exact_or_refused(void **state)
{
    (void)state;
    uint64_t v = 7;
    /* integers past 2^53 are bytes, not the nearest double */
    FT_ASSERT_OK(ferry_parse_size("9007199254740993", &v));
    assert_true(v == 9007199254740993ull);
    FT_ASSERT_OK(ferry_parse_size("18446744073709551615", &v));
    assert_true(v == UINT64_MAX);
    FT_ASSERT_OK(ferry_parse_size("10000000000000000000", &v));
    assert_true(v == 10000000000000000000ull);
    assert_int_equal(ferry_parse_size("15E", &v), -EINVAL); /* no exa suffix */
    FT_ASSERT_OK(ferry_parse_size("16777215T", &v));
    assert_true(v == 16777215ull << 40);
    FT_ASSERT_OK(ferry_parse_size("1.5k", &v));
    assert_true(v == 1536);
    /* too large for 64 bits: -EINVAL (the header's one code), out untouched */
    const char *big[] = {"18446744073709551616", "16777216T", "99999999999999999999999",
                         "17179869184G", "1e30", "inf"};
    for (size_t i = 0; i < sizeof big / sizeof *big; i++) {
        v = 7;
        int rc = ferry_parse_size(big[i], &v);
        if (rc != -EINVAL)
            fail_msg("ferry_parse_size(\"%s\") = %d (%s), want -EINVAL", big[i], rc,
                     ferry_err_name(rc));
        assert_true(v == 7);
        msg_names(big[i]);
    }
    assert_int_equal(ferry_parse_size(NULL, &v), -EINVAL);
    assert_int_equal(ferry_parse_size("8M", NULL), -EINVAL);
    assert_int_equal(ferry_parse_size("nan", &v), -EINVAL);
    assert_true(v == 7);
    /* the CLI's grammar: no hex, exponent, sign, space or stray "i" (strtod
     * took 0x10 as 16, 1e3 as 1000, " 8M" as 8 MiB and "1ib" as 1) */
    const char *bad[] = {"0x10", "1e3", " 8M", "8M ", "+8M", "-0", "1ib", "8MiBx", ".5G", "1.",
                         "1.5.2", "8 M", "8Mi"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        v = 7;
        int rc = ferry_parse_size(bad[i], &v);
        if (rc != -EINVAL || v != 7)
            fail_msg("ferry_parse_size(\"%s\") = %d, %llu: want -EINVAL, untouched", bad[i], rc,
                     (unsigned long long)v);
        msg_names(bad[i]);
    }
    /* every documented form */
    static const struct {
        const char *s;
        uint64_t v;
    } good[] = {{"4096", 4096},   {"256k", 256 << 10},        {"8M", 8 << 20},
                {"8MB", 8 << 20}, {"8MiB", 8 << 20},          {"2G", 2ull << 30},
                {"1T", 1ull << 40}, {"1.5G", 3ull << 29},     {"100B", 100},
                {"0.3K", 307},    {"1.0000000000000000001K", 1024}};
    for (size_t i = 0; i < sizeof good / sizeof *good; i++) {
        FT_ASSERT_OK(ferry_parse_size(good[i].s, &v));
        if (v != good[i].v)
            fail_msg("ferry_parse_size(\"%s\") = %llu, want %llu", good[i].s,
                     (unsigned long long)v, (unsigned long long)good[i].v);
    }
}

static void log_level_parse_takes_every_name_and_digit(void **state)
{
    (void)state;
    const char *names[] = {"off", "error", "warn", "info", "debug", "trace"};
    for (int i = 0; i < 6; i++) {
        char d[2] = {(char)('0' + i), 0};
        assert_int_equal(ferry_log_level_parse(names[i]), i);
        assert_int_equal(ferry_log_level_parse(d), i);
    }
    assert_int_equal(ferry_log_level_parse(NULL), -1);
    assert_int_equal(ferry_log_level_parse(""), -1);
    assert_int_equal(ferry_log_level_parse("6"), -1);
    assert_int_equal(ferry_log_level_parse("-1"), -1);
    assert_int_equal(ferry_log_level_parse("33"), -1);
}

static void *fresh_thread_message(void *arg)
{
    (void)arg;
    return (void *)ferry_last_error();
}

static void every_code_has_a_name_and_text(void **state)
{
    (void)state;
    for (int c = FERRY_ENODEV; c >= FERRY_ECONN; c--) {
        assert_non_null(ferry_strerror(c));
        assert_true(strncmp(ferry_err_name(c), "FERRY_E", 7) == 0);
        assert_string_not_equal(ferry_err_name(c), "FERRY_EUNKNOWN");
    }
    /* a thread that never failed has "" */
    assert_int_equal(ferry_parse_size("x", &(uint64_t){0}), -EINVAL);
    pthread_t t;
    void *m = NULL;
    assert_int_equal(pthread_create(&t, NULL, fresh_thread_message, NULL), 0);
    assert_int_equal(pthread_join(t, &m), 0);
    assert_non_null(m);
    assert_string_equal((const char *)m, "");
}

/* ---- slab.h ---- */

static ferry_slab *mk(uint64_t cap)
{
    ferry_slab_options o = FERRY_SLAB_OPTIONS_INIT;
    o.capacity = cap;
    ferry_slab *s = NULL;
    FT_ASSERT_OK(ferry_slab_create(&o, &s));
    return s;
}

static void slab_null_handle_fails_with_a_message(void **state)
{
    (void)state;
    ferry_slab_destroy(NULL);
    assert_string_equal(ferry_slab_last_error(NULL), "");
    assert_int_equal(ferry_slab_capacity(NULL), 0);
    assert_int_equal(ferry_slab_alignment(NULL), 0);
    struct {
        const char *name;
        int rc;
    } calls[] = {
        {"commit", ferry_slab_commit(NULL, 0)},
        {"read lock", ferry_slab_read_lock(NULL, 0)},
        {"read unlock", ferry_slab_read_unlock(NULL, 0)},
        {"write lock", ferry_slab_write_lock(NULL, 0)},
        {"state", ferry_slab_state(NULL, 0, NULL)},
        {"check", ferry_slab_check(NULL)},
    };
    for (size_t i = 0; i < sizeof calls / sizeof *calls; i++) {
        assert_int_equal(calls[i].rc, -EINVAL);
    }
    /* each records its own message, naming the call */
    const char *what[] = {"commit", "read lock", "read unlock", "write lock", "state",
                          "check"};
    for (int i = 0; i < 6; i++) {
        ferry_parse_size("x", &(uint64_t){0}); /* another message first */
        int rc = i == 0   ? ferry_slab_commit(NULL, 0)
                 : i == 1 ? ferry_slab_read_lock(NULL, 0)
                 : i == 2 ? ferry_slab_read_unlock(NULL, 0)
                 : i == 3 ? ferry_slab_write_lock(NULL, 0)
                 : i == 4 ? ferry_slab_state(NULL, 0, NULL)
                          : ferry_slab_check(NULL);
        assert_int_equal(rc, -EINVAL);
        msg_names(what[i]);
        msg_names("NULL");
    }
    ferry_slab_stats st = FERRY_SLAB_STATS_INIT;
    assert_int_equal(ferry_slab_stats_get(NULL, &st), -EINVAL);
    ferry_slab *s = mk(16 * K4);
    assert_int_equal(ferry_slab_stats_get(s, NULL), -EINVAL);
    st.size = 0;
    assert_int_equal(ferry_slab_stats_get(s, &st), -EINVAL);
    assert_int_equal(st.size, 0);
    ferry_extent e = {1, 2};
    assert_int_equal(ferry_slab_alloc_bytes(s, 0, &e), -EINVAL);
    assert_int_equal(ferry_slab_alloc_bytes(s, 1, NULL), -EINVAL);
    assert_int_equal(ferry_slab_alloc_bytes(NULL, 1, &e), -EINVAL);
    assert_int_equal(ferry_slab_alloc(s, NULL, 1, &e), -EINVAL);
    assert_true(e.offset == 1 && e.size == 2); /* out untouched */
    FT_ASSERT_OK(ferry_slab_check(s));
    ferry_slab_destroy(s);
}

static void slab_layout_refusals(void **state)
{
    (void)state;
    uint64_t n = 99;
    ferry_shape sh = {1, {8}};
    int dt = FERRY_DTYPE_F16;
    ferry_layout l = {1, &sh, 1, &dt};
    FT_ASSERT_OK(ferry_layout_bytes(&l, &n));
    assert_int_equal(n, 16);
    n = 99;
    ferry_shape deep = {FERRY_SHAPE_MAX_DIMS + 1, {1}};
    ferry_layout bad = {1, &deep, 1, &dt};
    assert_int_equal(ferry_layout_bytes(&bad, &n), -EINVAL);
    msg_names("dims");
    int unknown = FERRY_DTYPE_COUNT;
    ferry_layout bad_dt = {1, &sh, 1, &unknown};
    assert_int_equal(ferry_layout_bytes(&bad_dt, &n), -EINVAL);
    msg_names("dtype");
    ferry_shape zero = {2, {8, 0}};
    ferry_layout bad_zero = {1, &zero, 1, &dt};
    assert_int_equal(ferry_layout_bytes(&bad_zero, &n), -EINVAL);
    ferry_layout none = {0, NULL, 0, NULL};
    assert_int_equal(ferry_layout_bytes(&none, &n), -EINVAL);
    assert_int_equal(ferry_layout_bytes(NULL, &n), -EINVAL);
    assert_int_equal(ferry_layout_bytes(&l, NULL), -EINVAL);
    assert_int_equal(n, 99);
    /* a scalar is one element */
    ferry_shape scalar = {0, {0}};
    ferry_layout sc = {1, &scalar, 1, &dt};
    FT_ASSERT_OK(ferry_layout_bytes(&sc, &n));
    assert_int_equal(n, 2);
    assert_string_equal(ferry_dtype_name(FERRY_DTYPE_COUNT), "?");
    assert_string_equal(ferry_dtype_name(-1), "?");
    assert_int_equal(ferry_dtype_size(FERRY_DTYPE_COUNT), 0);
}

static void slab_state_refusals_on_every_state(void **state)
{
    (void)state;
    ferry_slab *s = mk(16 * K4);
    ferry_extent e;
    assert_int_equal(ferry_slab_alloc_bytes(s, 1, &e), 1);
    /* WRITING: no read unlock, no second write lock */
    assert_int_equal(ferry_slab_read_unlock(s, e.offset), FERRY_ESTATE);
    assert_int_equal(ferry_slab_write_lock(s, e.offset), FERRY_ESTATE);
    FT_ASSERT_OK(ferry_slab_commit(s, e.offset));
    FT_ASSERT_OK(ferry_slab_read_lock(s, e.offset));
    /* READING: commit is FERRY_ESTATE (not WRITING) and changes nothing */
    assert_int_equal(ferry_slab_commit(s, e.offset), FERRY_ESTATE);
    unsigned r = 0;
    assert_int_equal(ferry_slab_state(s, e.offset, &r), FERRY_EXTENT_READING);
    assert_int_equal(r, 1);
    /* an interior or unaligned offset is no extent */
    assert_int_equal(ferry_slab_commit(s, e.offset + 1), FERRY_ENOTFOUND);
    assert_int_equal(ferry_slab_read_lock(s, e.offset + K4 / 2), FERRY_ENOTFOUND);
    assert_int_equal(ferry_slab_state(s, e.offset + 1, &r), FERRY_EXTENT_ABSENT);
    assert_int_equal(r, 0);
    FT_ASSERT_OK(ferry_slab_read_unlock(s, e.offset));
    /* a WRITING extent may be freed (no read lock) */
    FT_ASSERT_OK(ferry_slab_write_lock(s, e.offset));
    FT_ASSERT_OK(ferry_slab_free(s, &e));
    FT_ASSERT_OK(ferry_slab_check(s));
    ferry_slab_destroy(s);
}

/* ---- pslab.h ---- */

static ferry_pslab_options popts(const char *const *dirs, uint64_t bytes, unsigned flags)
{
    ferry_pslab_options o = FERRY_PSLAB_OPTIONS_INIT;
    o.dirs = dirs;
    o.n_dirs = 1;
    o.bytes = bytes;
    o.flags = flags;
    o.direct = 0;
    return o;
}

/* one directory given twice (as written, in another spelling, or through
 * a link) is -EINVAL naming both places, and the store then opens with it
 * once; it was FERRY_EBUSY saying this very process held the directory */
static void pslab_one_directory_given_twice_is_einval(void **state)
{
    (void)state;
    char d[256], dot[300], link[300];
    ft_tmpdir(d, sizeof d);
    snprintf(dot, sizeof dot, "%s/.", d);
    snprintf(link, sizeof link, "%s.link", d);
    assert_int_equal(symlink(d, link), 0);
    const char *const twice[][2] = {{d, d}, {d, dot}, {link, d}};
    for (int i = 0; i < 3; i++) {
        ferry_pslab_options o = popts(twice[i], 2 * MiB, FERRY_PSLAB_CREATE);
        o.n_dirs = 2;
        ferry_pslab *p = NULL;
        int rc = ferry_pslab_open(&o, &p);
        const char *msg = ferry_last_error();
        if (rc != -EINVAL || p || !strstr(msg, "are one directory") ||
            !strstr(msg, twice[i][1]))
            fail_msg("dirs %s, %s: %d (%s)", twice[i][0], twice[i][1], rc, msg);
    }
    const char *once[] = {d};
    ferry_pslab_options o = popts(once, 2 * MiB, FERRY_PSLAB_CREATE);
    ferry_pslab *p = NULL;
    FT_ASSERT_OK(ferry_pslab_open(&o, &p));
    ferry_pslab_close(p);
    unlink(link);
    ft_rmtree(d);
}

static void pslab_bad_arguments_are_einval(void **state)
{
    (void)state;
    char d[256];
    ft_tmpdir(d, sizeof d);
    const char *dirs[] = {d};
    ferry_pslab_options o = popts(dirs, 1 * MiB, FERRY_PSLAB_CREATE);
    ferry_pslab *p = NULL;
    FT_ASSERT_OK(ferry_pslab_open(&o, &p));
    static char key[FERRY_PSLAB_KEY_MAX + 1];
    memset(key, 'k', sizeof key);
    char data[64] = "payload";
    FT_ASSERT_OK(ferry_pslab_put(p, key, FERRY_PSLAB_KEY_MAX, data, sizeof data));
    assert_int_equal(ferry_pslab_put(p, key, FERRY_PSLAB_KEY_MAX + 1, data, 1), -EINVAL);
    assert_int_equal(ferry_pslab_put(p, NULL, 3, data, 1), -EINVAL);
    assert_int_equal(ferry_pslab_put(p, "k", 1, NULL, 1), -EINVAL);
    assert_int_equal(ferry_pslab_put(NULL, "k", 1, data, 1), -EINVAL);
    /* len 1..capacity */
    char *huge = calloc(1, 2 * MiB);
    assert_int_equal(ferry_pslab_put(p, "big", 3, huge, 1 * MiB + 1), -EINVAL);
    msg_names("1048577");
    free(huge);
    size_t len = 5;
    char buf[64];
    assert_int_equal(ferry_pslab_get(p, key, FERRY_PSLAB_KEY_MAX + 1, buf, sizeof buf, &len),
                     -EINVAL);
    assert_int_equal(ferry_pslab_get(p, key, FERRY_PSLAB_KEY_MAX, NULL, sizeof buf, &len),
                     -EINVAL);
    assert_int_equal(ferry_pslab_get(p, key, FERRY_PSLAB_KEY_MAX, buf, sizeof buf, NULL),
                     -EINVAL);
    assert_int_equal(ferry_pslab_get(NULL, "k", 1, buf, sizeof buf, &len), -EINVAL);
    assert_int_equal(len, 5);
    ferry_pslab_info info = {1, 2, 3, 4};
    assert_int_equal(ferry_pslab_stat(p, "k", 0, &info), -EINVAL);
    assert_int_equal(ferry_pslab_stat(p, "k", 1, NULL), -EINVAL);
    assert_int_equal(ferry_pslab_stat(p, "absent", 6, &info), FERRY_ENOTFOUND);
    assert_int_equal(info.offset, 1); /* untouched */
    assert_int_equal(ferry_pslab_delete(p, "k", 0), -EINVAL);
    assert_int_equal(ferry_pslab_delete(p, "absent", 6), FERRY_ENOTFOUND);
    assert_int_equal(ferry_pslab_forget(p, "k", 0), -EINVAL);
    assert_int_equal(ferry_pslab_delete(NULL, "k", 1), -EINVAL);
    assert_int_equal(ferry_pslab_forget(NULL, "k", 1), -EINVAL);
    assert_int_equal(ferry_pslab_put_many(p, NULL, 1), -EINVAL);
    assert_int_equal(ferry_pslab_put_many(p, NULL, 0), 0);
    assert_int_equal(ferry_pslab_iterate(p, NULL, NULL), -EINVAL);
    assert_int_equal(ferry_pslab_sync(NULL), -EINVAL);
    assert_int_equal(ferry_pslab_compact(NULL), -EINVAL);
    assert_int_equal(ferry_pslab_verify(NULL, 0, NULL, NULL, NULL), -EINVAL);
    ferry_pslab_stats st = FERRY_PSLAB_STATS_INIT;
    assert_int_equal(ferry_pslab_stats_get(NULL, &st), -EINVAL);
    assert_int_equal(ferry_pslab_stats_get(p, NULL), -EINVAL);
    st.size = 0;
    assert_int_equal(ferry_pslab_stats_get(p, &st), -EINVAL);
    assert_string_equal(ferry_pslab_last_error(NULL), "");
    assert_int_equal(ferry_pslab_close(NULL), 0);
    /* the long key survived all of it */
    FT_ASSERT_OK(ferry_pslab_get(p, key, FERRY_PSLAB_KEY_MAX, buf, sizeof buf, &len));
    assert_int_equal(len, sizeof data);
    assert_string_equal(buf, "payload");
    FT_ASSERT_OK(ferry_pslab_close(p));
    ft_rmtree(d);
}

static int stop_at_second(const void *key, size_t klen, const ferry_pslab_info *info, void *ctx)
{
    (void)key;
    (void)klen;
    (void)info;
    int *n = ctx;
    return ++*n == 2 ? 42 : 0;
}

static void pslab_readonly_refuses_writes_and_touches_nothing(void **state)
{
    (void)state;
    char d[256], jpath[300];
    ft_tmpdir(d, sizeof d);
    const char *dirs[] = {d};
    ferry_pslab_options o = popts(dirs, 1 * MiB, FERRY_PSLAB_CREATE);
    ferry_pslab *p = NULL;
    FT_ASSERT_OK(ferry_pslab_open(&o, &p));
    for (int i = 0; i < 4; i++) {
        char k[8];
        snprintf(k, sizeof k, "k%d", i);
        FT_ASSERT_OK(ferry_pslab_put(p, k, strlen(k), k, strlen(k)));
    }
    FT_ASSERT_OK(ferry_pslab_delete(p, "k3", 2));
    FT_ASSERT_OK(ferry_pslab_close(p));
    snprintf(jpath, sizeof jpath, "%s/%s", d, FERRY_PSLAB_JOURNAL);
    struct stat before, after;
    assert_int_equal(stat(jpath, &before), 0);

    o = popts(dirs, 0, FERRY_PSLAB_READONLY);
    FT_ASSERT_OK(ferry_pslab_open(&o, &p));
    assert_int_equal(ferry_pslab_put(p, "n", 1, "v", 1), FERRY_ESTATE);
    assert_int_equal(ferry_pslab_delete(p, "k0", 2), FERRY_ESTATE);
    assert_int_equal(ferry_pslab_forget(p, "k1", 2), FERRY_ESTATE);
    ferry_pslab_item it = {"n", 1, "v", 1, 7};
    int rc = ferry_pslab_put_many(p, &it, 1);
    assert_true(rc == 0 || rc == FERRY_ESTATE);
    assert_int_equal(it.result, FERRY_ESTATE);
    assert_int_equal(ferry_pslab_compact(p), FERRY_ESTATE);
    /* iterate hands back the callback's code and stops there */
    int n = 0;
    assert_int_equal(ferry_pslab_iterate(p, stop_at_second, &n), 42);
    assert_int_equal(n, 2);
    char buf[8];
    size_t len = 0;
    FT_ASSERT_OK(ferry_pslab_get(p, "k0", 2, buf, sizeof buf, &len));
    assert_int_equal(ferry_pslab_get(p, "n", 1, buf, sizeof buf, &len), FERRY_ENOTFOUND);
    FT_ASSERT_OK(ferry_pslab_close(p));
    assert_int_equal(stat(jpath, &after), 0);
    assert_int_equal(before.st_size, after.st_size);
    assert_true(before.st_mtim.tv_sec == after.st_mtim.tv_sec &&
                before.st_mtim.tv_nsec == after.st_mtim.tv_nsec);
    ft_rmtree(d);
}

static int failing_fdatasync(int fd)
{
    (void)fd;
    errno = EIO;
    return -1;
}

/* after a failed sync every write is FERRY_ESTATE, put_many included:
 * a negative code with every result set, and what was stored stays */
static void pslab_failed_journal_refuses_every_write(void **state)
{
    (void)state;
    char d[256];
    ft_tmpdir(d, sizeof d);
    const char *dirs[] = {d};
    ferry_pslab_options o = popts(dirs, 1 * MiB, FERRY_PSLAB_CREATE);
    ferry_pslab *p = NULL;
    FT_ASSERT_OK(ferry_pslab_open(&o, &p));
    FT_ASSERT_OK(ferry_pslab_put(p, "old", 3, "kept", 4));
    ferry__sys bad = *ferry__sys_default();
    bad.fdatasync = failing_fdatasync;
    ferry__sys_set(&bad);
    int rc = ferry_pslab_put(p, "new", 3, "lost", 4);
    ferry__sys_set(NULL);
    assert_int_equal(rc, -EIO);
    ferry_pslab_stats st = FERRY_PSLAB_STATS_INIT;
    FT_ASSERT_OK(ferry_pslab_stats_get(p, &st));
    assert_int_equal(st.failed, 1);
    assert_int_equal(ferry_pslab_put(p, "new", 3, "lost", 4), FERRY_ESTATE);
    ferry_pslab_item items[2] = {{"a", 1, "x", 1, 7}, {"b", 1, "y", 1, 7}};
    ferry_parse_size("x", &(uint64_t){0}); /* another message first */
    assert_int_equal(ferry_pslab_put_many(p, items, 2), FERRY_ESTATE);
    assert_int_equal(items[0].result, FERRY_ESTATE);
    assert_int_equal(items[1].result, FERRY_ESTATE);
    msg_names("journal failed");
    msg_names(d);
    assert_int_equal(ferry_pslab_delete(p, "old", 3), FERRY_ESTATE);
    char buf[8];
    size_t len = 0;
    assert_int_equal(ferry_pslab_get(p, "a", 1, buf, sizeof buf, &len), FERRY_ENOTFOUND);
    FT_ASSERT_OK(ferry_pslab_get(p, "old", 3, buf, sizeof buf, &len));
    assert_memory_equal(buf, "kept", 4);
    ferry_pslab_close(p);
    /* a reopen replays what reached the disk */
    o.flags = 0;
    FT_ASSERT_OK(ferry_pslab_open(&o, &p));
    FT_ASSERT_OK(ferry_pslab_get(p, "old", 3, buf, sizeof buf, &len));
    assert_int_equal(ferry_pslab_put_many(p, items, 2), 2);
    assert_int_equal(items[0].result, 0);
    FT_ASSERT_OK(ferry_pslab_close(p));
    ft_rmtree(d);
}

struct bad_seen {
    int calls;
    char key[16];
    ferry_pslab_info info;
    int code;
};

static void note_bad(const void *key, size_t klen, const ferry_pslab_info *info, int code,
                     void *ctx)
{
    struct bad_seen *b = ctx;
    b->calls++;
    memcpy(b->key, key, klen < sizeof b->key - 1 ? klen : sizeof b->key - 1);
    b->info = *info;
    b->code = code;
}

/* verify calls report once per bad chunk, with its key, index entry and
 * FERRY_ECORRUPT; without repair the chunk stays, a get of it is a miss
 * whose buffer holds none of its bytes */
static void pslab_verify_reports_each_bad_chunk(void **state)
{
    (void)state;
    char d[256], path[300];
    ft_tmpdir(d, sizeof d);
    const char *dirs[] = {d};
    ferry_pslab_options o = popts(dirs, 1 * MiB, FERRY_PSLAB_CREATE);
    ferry_pslab *p = NULL;
    FT_ASSERT_OK(ferry_pslab_open(&o, &p));
    char data[3][5000];
    for (int i = 0; i < 3; i++) {
        char k[4] = {'c', (char)('0' + i), 0, 0};
        memset(data[i], 'a' + i, sizeof data[i]);
        FT_ASSERT_OK(ferry_pslab_put(p, k, 2, data[i], sizeof data[i]));
    }
    ferry_pslab_info info;
    FT_ASSERT_OK(ferry_pslab_stat(p, "c1", 2, &info));
    FT_ASSERT_OK(ferry_pslab_close(p));
    snprintf(path, sizeof path, "%s/%s", d, FERRY_PSLAB_FILE);
    int fd = open(path, O_RDWR);
    assert_true(fd >= 0);
    assert_int_equal(pwrite(fd, "Z", 1, (off_t)(ferry__pslab_data_off(4096) + info.offset + 7)),
                     1);
    close(fd);

    o.flags = 0;
    FT_ASSERT_OK(ferry_pslab_open(&o, &p));
    struct bad_seen seen = {0};
    uint64_t bad = 99;
    FT_ASSERT_OK(ferry_pslab_verify(p, 0, &bad, note_bad, &seen));
    assert_int_equal(bad, 1);
    assert_int_equal(seen.calls, 1);
    assert_string_equal(seen.key, "c1");
    assert_int_equal(seen.code, FERRY_ECORRUPT);
    assert_int_equal(seen.info.offset, info.offset);
    assert_int_equal(seen.info.length, info.length);
    assert_int_equal(seen.info.seq, info.seq);
    /* not repaired: still indexed, and a get refuses it */
    FT_ASSERT_OK(ferry_pslab_stat(p, "c1", 2, &info));
    char buf[5000];
    memset(buf, 'b', sizeof buf);
    size_t len = 0;
    assert_int_equal(ferry_pslab_get(p, "c1", 2, buf, sizeof buf, &len), FERRY_ECORRUPT);
    msg_names("c1");
    for (size_t i = 0; i < sizeof buf; i++)
        assert_int_equal(buf[i], 0);
    FT_ASSERT_OK(ferry_pslab_get(p, "c2", 2, buf, sizeof buf, &len));
    assert_memory_equal(buf, data[2], sizeof buf);
    FT_ASSERT_OK(ferry_pslab_close(p));
    ft_rmtree(d);
}

/* close returns the final sync's error (SYNC_NONE: it is the first sync)
 * and frees the store all the same */
static void pslab_close_returns_the_final_sync_error(void **state)
{
    (void)state;
    char d[256];
    ft_tmpdir(d, sizeof d);
    const char *dirs[] = {d};
    ferry_pslab_options o = popts(dirs, 1 * MiB, FERRY_PSLAB_CREATE);
    o.sync = FERRY_PSLAB_SYNC_NONE;
    ferry_pslab *p = NULL;
    FT_ASSERT_OK(ferry_pslab_open(&o, &p));
    FT_ASSERT_OK(ferry_pslab_put(p, "k", 1, "v", 1));
    ferry__sys bad = *ferry__sys_default();
    bad.fdatasync = failing_fdatasync;
    ferry__sys_set(&bad);
    int rc = ferry_pslab_close(p);
    ferry__sys_set(NULL);
    assert_int_equal(rc, -EIO);
    msg_names("fdatasync");
    /* the directory is free again (the lock went with the store) */
    o.flags = 0;
    FT_ASSERT_OK(ferry_pslab_open(&o, &p));
    FT_ASSERT_OK(ferry_pslab_close(p));
    ft_rmtree(d);
}

static int g_syncs;
static int counting_fdatasync(int fd)
{
    g_syncs++;
    return ferry__sys_default()->fdatasync(fd);
}

/* SYNC_NONE: puts write without syncing; ferry_pslab_sync() then syncs
 * the slab file and the journal and makes every put durable (durable_seq) */
static void pslab_sync_none_is_durable_at_sync(void **state)
{
    (void)state;
    char d[256];
    ft_tmpdir(d, sizeof d);
    const char *dirs[] = {d};
    ferry_pslab_options o = popts(dirs, 1 * MiB, FERRY_PSLAB_CREATE);
    o.sync = FERRY_PSLAB_SYNC_NONE;
    ferry_pslab *p = NULL;
    FT_ASSERT_OK(ferry_pslab_open(&o, &p));
    ferry__sys counting = *ferry__sys_default();
    counting.fdatasync = counting_fdatasync;
    ferry__sys_set(&counting);
    g_syncs = 0;
    FT_ASSERT_OK(ferry_pslab_put(p, "a", 1, "1", 1));
    FT_ASSERT_OK(ferry_pslab_put(p, "b", 1, "2", 1));
    int after_puts = g_syncs;
    ferry_pslab_info info;
    FT_ASSERT_OK(ferry_pslab_stat(p, "b", 1, &info));
    ferry_pslab_stats st = FERRY_PSLAB_STATS_INIT;
    FT_ASSERT_OK(ferry_pslab_stats_get(p, &st));
    assert_true(st.durable_seq < info.seq);
    FT_ASSERT_OK(ferry_pslab_sync(p));
    int after_sync = g_syncs;
    FT_ASSERT_OK(ferry_pslab_stats_get(p, &st));
    /* a second sync with nothing new written syncs nothing */
    FT_ASSERT_OK(ferry_pslab_sync(p));
    int again = g_syncs;
    ferry__sys_set(NULL);
    assert_int_equal(after_puts, 0);
    assert_true(after_sync >= 2); /* the slab file, then the journal */
    assert_int_equal(again, after_sync);
    assert_true(st.durable_seq >= info.seq);
    FT_ASSERT_OK(ferry_pslab_close(p));
    ft_rmtree(d);
}

/* ---- pslab: every call but close from several threads at once ---- */

enum { MT_WRITERS = 3, MT_KEYS = 24, MT_ROUNDS = 40, MT_MAX = 12000 };

typedef struct mt_arg {
    ferry_pslab *p;
    int id;
    _Atomic int *stop;
    int bad; /* a wrong byte, a refused good call */
} mt_arg;

/* chunk of writer w, key k, version v: its length and bytes say all three */
static size_t mt_fill(int w, int k, int v, uint8_t *buf)
{
    size_t n = 1000 + (size_t)((w * 131 + k * 17 + v * 7) % (MT_MAX - 1000));
    ft_fill_pattern(buf, n, (unsigned)(w * 100000 + k * 1000 + v));
    return n;
}

static int mt_key(int w, int k, char *key)
{
    return snprintf(key, 16, "w%dk%d", w, k);
}

/* thousands of commits: their syncs only counted */
static _Atomic long g_nop_syncs;
static int nop_fdatasync(int fd)
{
    (void)fd;
    atomic_fetch_add(&g_nop_syncs, 1);
    return 0;
}

static void *mt_writer(void *arg)
{
    mt_arg *a = arg;
    uint8_t *buf = malloc(MT_MAX), *got = malloc(MT_MAX);
    for (int v = 0; v < MT_ROUNDS; v++)
        for (int k = 0; k < MT_KEYS; k++) {
            char key[16];
            int kl = mt_key(a->id, k, key);
            size_t n = mt_fill(a->id, k, v, buf);
            int rc;
            if (k % 6 == 5 && v % 2) { /* every other round: forget it */
                rc = ferry_pslab_forget(a->p, key, (size_t)kl);
                a->bad += rc != 0 && !(v == 1 && rc == FERRY_ENOTFOUND);
                continue;
            }
            if (k % 4 == 0) {
                ferry_pslab_item it = {key, (size_t)kl, buf, n, 1};
                rc = ferry_pslab_put_many(a->p, &it, 1);
                a->bad += rc != 1 || it.result != 0;
            } else {
                a->bad += ferry_pslab_put(a->p, key, (size_t)kl, buf, n) != 0;
            }
            size_t len = 0;
            rc = ferry_pslab_get(a->p, key, (size_t)kl, got, MT_MAX, &len);
            a->bad += rc != 0 || len != n || memcmp(got, buf, n) != 0;
        }
    free(buf);
    free(got);
    return NULL;
}

static int mt_count(const void *key, size_t klen, const ferry_pslab_info *info, void *ctx)
{
    (void)key;
    (void)klen;
    int *n = ctx;
    *n += info->length >= 1000 && info->length < MT_MAX;
    return 0;
}

/* compaction, verify, iterate, stat, stats and sync while the writers run */
static void *mt_keeper(void *arg)
{
    mt_arg *a = arg;
    while (!atomic_load(a->stop)) {
        int rc;
        switch (a->id) {
        case 0:
            a->bad += ferry_pslab_compact(a->p) != 0;
            break;
        case 1: {
            uint64_t bad = 9;
            rc = ferry_pslab_verify(a->p, 0, &bad, NULL, NULL);
            a->bad += rc != 0 || bad != 0;
            break;
        }
        case 2: {
            int n = 0;
            a->bad += ferry_pslab_iterate(a->p, mt_count, &n) != 0;
            ferry_pslab_stats st = FERRY_PSLAB_STATS_INIT;
            a->bad += ferry_pslab_stats_get(a->p, &st) != 0 || st.corrupt != 0;
            ferry_pslab_info info;
            rc = ferry_pslab_stat(a->p, "w0k1", 4, &info);
            a->bad += rc != 0 && rc != FERRY_ENOTFOUND;
            a->bad += ferry_pslab_sync(a->p) != 0;
            break;
        }
        }
    }
    return NULL;
}

static void pslab_every_call_from_threads_at_once(void **state)
{
    (void)state;
    char d[256];
    ft_tmpdir(d, sizeof d);
    const char *dirs[] = {d};
    ferry_pslab_options o = popts(dirs, 8 * MiB, FERRY_PSLAB_CREATE);
    o.sync = FERRY_PSLAB_SYNC_BATCH;
    o.batch_bytes = 256 * 1024;
    o.batch_ms = 5;
    o.compact_bytes = 16 * 1024; /* compactions at commits too */
    ferry_pslab *p = NULL;
    FT_ASSERT_OK(ferry_pslab_open(&o, &p));
    ferry__sys fast = *ferry__sys_default();
    fast.fdatasync = nop_fdatasync;
    ferry__sys_set(&fast);
    _Atomic int stop = 0;
    pthread_t wt[MT_WRITERS], kt[3];
    mt_arg wa[MT_WRITERS], ka[3];
    for (int i = 0; i < 3; i++) {
        ka[i] = (mt_arg){p, i, &stop, 0};
        assert_int_equal(pthread_create(&kt[i], NULL, mt_keeper, &ka[i]), 0);
    }
    for (int i = 0; i < MT_WRITERS; i++) {
        wa[i] = (mt_arg){p, i, &stop, 0};
        assert_int_equal(pthread_create(&wt[i], NULL, mt_writer, &wa[i]), 0);
    }
    for (int i = 0; i < MT_WRITERS; i++) {
        assert_int_equal(pthread_join(wt[i], NULL), 0);
        if (wa[i].bad)
            fail_msg("writer %d: %d wrong answers (%s)", i, wa[i].bad, ferry_pslab_last_error(p));
    }
    atomic_store(&stop, 1);
    for (int i = 0; i < 3; i++) {
        assert_int_equal(pthread_join(kt[i], NULL), 0);
        if (ka[i].bad)
            fail_msg("keeper %d: %d wrong answers (%s)", i, ka[i].bad, ferry_pslab_last_error(p));
    }
    ferry_pslab_stats st = FERRY_PSLAB_STATS_INIT;
    FT_ASSERT_OK(ferry_pslab_stats_get(p, &st));
    assert_true(st.compactions >= 2);
    assert_int_equal(st.corrupt, 0);
    FT_ASSERT_OK(ferry_pslab_close(p));
    ferry__sys_set(NULL);
    /* every key holds its last version, forgotten ones none */
    o.flags = 0;
    FT_ASSERT_OK(ferry_pslab_open(&o, &p));
    uint8_t *buf = malloc(MT_MAX), *got = malloc(MT_MAX);
    for (int w = 0; w < MT_WRITERS; w++)
        for (int k = 0; k < MT_KEYS; k++) {
            char key[16];
            int kl = mt_key(w, k, key);
            size_t len = 0;
            int rc = ferry_pslab_get(p, key, (size_t)kl, got, MT_MAX, &len);
            if (k % 6 == 5) {
                assert_int_equal(rc, FERRY_ENOTFOUND);
                continue;
            }
            size_t n = mt_fill(w, k, MT_ROUNDS - 1, buf);
            FT_ASSERT_OK(rc);
            assert_int_equal(len, n);
            assert_memory_equal(got, buf, n);
        }
    free(buf);
    free(got);
    FT_ASSERT_OK(ferry_pslab_close(p));
    ft_rmtree(d);
}

/* every stats_get writes only out->size bytes and keeps out->size: a
 * caller built with an older, shorter header is not overrun */
static void stats_of_an_older_header_write_only_its_bytes(void **state)
{
    (void)state;
    union {
        ferry_slab_stats st;
        ferry_pslab_stats pst;
        unsigned char b[1024];
    } u;
    ferry_slab *s = mk(16 * K4);
    memset(&u, 0xa5, sizeof u);
    u.st.size = offsetof(ferry_slab_stats, used);
    FT_ASSERT_OK(ferry_slab_stats_get(s, &u.st));
    assert_int_equal(u.st.size, offsetof(ferry_slab_stats, used));
    assert_int_equal(u.st.capacity, 16 * K4);
    for (size_t i = offsetof(ferry_slab_stats, used); i < sizeof u.b; i++)
        assert_int_equal(u.b[i], 0xa5);
    ferry_slab_destroy(s);

    char d[256];
    ft_tmpdir(d, sizeof d);
    const char *dirs[] = {d};
    ferry_pslab_options o = popts(dirs, 1 * MiB, FERRY_PSLAB_CREATE);
    ferry_pslab *p = NULL;
    FT_ASSERT_OK(ferry_pslab_open(&o, &p));
    memset(&u, 0xa5, sizeof u);
    u.pst.size = offsetof(ferry_pslab_stats, chunks);
    FT_ASSERT_OK(ferry_pslab_stats_get(p, &u.pst));
    assert_int_equal(u.pst.capacity, 1 * MiB);
    for (size_t i = offsetof(ferry_pslab_stats, chunks); i < sizeof u.b; i++)
        assert_int_equal(u.b[i], 0xa5);
    /* a newer header's larger struct: this library's bytes, the rest kept */
    memset(&u, 0xa5, sizeof u);
    u.pst.size = sizeof u.b;
    FT_ASSERT_OK(ferry_pslab_stats_get(p, &u.pst));
    assert_int_equal(u.pst.size, sizeof u.b);
    assert_int_equal(u.pst.drives, 1);
    for (size_t i = sizeof(ferry_pslab_stats); i < sizeof u.b; i++)
        assert_int_equal(u.b[i], 0xa5);
    FT_ASSERT_OK(ferry_pslab_close(p));
    ft_rmtree(d);
}

/* ---- remote.h (a redis-server per test) ---- */

static ferry_remote *remote_open(ft_redis *srv, uint32_t command_timeout_ms)
{
    char url[128];
    ferry_remote_options o = FERRY_REMOTE_OPTIONS_INIT;
    o.command_timeout_ms = command_timeout_ms;
    o.backoff_initial_ms = 60000;
    o.backoff_max_ms = 60000;
    o.key_prefix = "low:";
    o.layout = "L1";
    o.layout_len = 2;
    ferry_remote *r = NULL;
    FT_ASSERT_OK(ferry_remote_open(ft_redis_url(srv, 0, url, sizeof url), &o, &r));
    return r;
}

/* flush(timeout) is -ETIMEDOUT naming what is still queued while the
 * server hangs, and 0 once the writer got through; nothing is lost */
static void remote_flush_times_out_then_drains(void **state)
{
    ft_redis *srv = *state;
    if (!srv)
        return;
    ferry_remote *r = remote_open(srv, 5000);
    FT_ASSERT_OK(ferry_remote_put_sync(r, "warm", 4, "w", 1));
    ft_redis_pause(srv);
    FT_ASSERT_OK(ferry_remote_put(r, "q", 1, "queued", 6));
    ferry_parse_size("x", &(uint64_t){0}); /* another message first */
    assert_int_equal(ferry_remote_flush(r, 100), -ETIMEDOUT);
    msg_names("still queued after 100 ms");
    ft_redis_resume(srv);
    FT_ASSERT_OK(ferry_remote_flush(r, 0));
    char dst[16];
    assert_int_equal(ferry_remote_get(r, "q", 1, dst, sizeof dst), 6);
    assert_memory_equal(dst, "queued", 6);
    ferry_remote_close(r);
}

/* close writes what is queued before it returns */
static void remote_close_writes_the_queue(void **state)
{
    ft_redis *srv = *state;
    if (!srv)
        return;
    ferry_remote *r = remote_open(srv, 2000);
    enum { N = 200 };
    uint8_t v[512];
    for (int i = 0; i < N; i++) {
        char k[16];
        snprintf(k, sizeof k, "c%d", i);
        ft_fill_pattern(v, sizeof v, (unsigned)i);
        FT_ASSERT_OK(ferry_remote_put(r, k, strlen(k), v, sizeof v));
    }
    ferry_remote_close(r);
    r = remote_open(srv, 2000);
    for (int i = 0; i < N; i++) {
        char k[16];
        snprintf(k, sizeof k, "c%d", i);
        assert_int_equal(ferry_remote_get(r, k, strlen(k), v, sizeof v), (int)sizeof v);
        assert_int_equal(ft_check_pattern(v, sizeof v, (unsigned)i), -1);
    }
    ferry_remote_close(r);
}

/* an empty payload round-trips (data may be NULL with len 0); a buffer
 * too small is -ENOBUFS whose message says how big the payload is; while
 * down, exists is 0 and a get a miss, both without I/O */
static void remote_edges_of_sizes_and_down(void **state)
{
    ft_redis *srv = *state;
    if (!srv)
        return;
    ferry_remote *r = remote_open(srv, 300);
    FT_ASSERT_OK(ferry_remote_put_sync(r, "empty", 5, NULL, 0));
    char dst[64];
    assert_int_equal(ferry_remote_get(r, "empty", 5, dst, sizeof dst), 0);
    assert_int_equal(ferry_remote_get(r, "empty", 5, NULL, 0), 0);
    FT_ASSERT_OK(ferry_remote_put_sync(r, "five", 4, "12345", 5));
    assert_int_equal(ferry_remote_get(r, "five", 4, dst, 4), -ENOBUFS);
    msg_names("5");
    assert_int_equal(ferry_remote_get(r, "five", 4, NULL, 0), -ENOBUFS);
    ferry_remote_key ks[3] = {{"empty", 5}, {"five", 4}, {"none", 4}};
    assert_int_equal(ferry_remote_exists(r, ks, 3), 2);
    assert_int_equal(ferry_remote_exists(r, ks, 0), 0);
    ferry_remote_key bad[1] = {{"", 0}};
    assert_int_equal(ferry_remote_exists(r, bad, 1), -EINVAL);
    assert_int_equal(ferry_remote_delete(r, bad, 1), -EINVAL);
    /* down: the hung server costs one timeout, then answers come at once */
    ft_redis_pause(srv);
    assert_int_equal(ferry_remote_get(r, "five", 4, dst, sizeof dst), FERRY_ENOTFOUND);
    ferry_remote_stats st = FERRY_REMOTE_STATS_INIT;
    FT_ASSERT_OK(ferry_remote_stats_get(r, &st));
    assert_int_equal(st.down, 1);
    uint64_t deg = st.degraded;
    assert_int_equal(ferry_remote_exists(r, ks, 3), 0);
    assert_int_equal(ferry_remote_get(r, "five", 4, dst, sizeof dst), FERRY_ENOTFOUND);
    msg_names("down");
    FT_ASSERT_OK(ferry_remote_stats_get(r, &st));
    assert_int_equal(st.degraded, deg + 2);
    ft_redis_resume(srv);
    ferry_remote_close(r);
}

int main(void)
{
    ft_redis_check();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(parse_size_is_exact_or_refused),
        cmocka_unit_test(log_level_parse_takes_every_name_and_digit),
        cmocka_unit_test(every_code_has_a_name_and_text),
        cmocka_unit_test(slab_null_handle_fails_with_a_message),
        cmocka_unit_test(slab_layout_refusals),
        cmocka_unit_test(slab_state_refusals_on_every_state),
        cmocka_unit_test(pslab_bad_arguments_are_einval),
        cmocka_unit_test(pslab_readonly_refuses_writes_and_touches_nothing),
        cmocka_unit_test(pslab_failed_journal_refuses_every_write),
        cmocka_unit_test(pslab_verify_reports_each_bad_chunk),
        cmocka_unit_test(pslab_close_returns_the_final_sync_error),
        cmocka_unit_test(pslab_sync_none_is_durable_at_sync),
        cmocka_unit_test(pslab_every_call_from_threads_at_once),
        cmocka_unit_test(stats_of_an_older_header_write_only_its_bytes),
        cmocka_unit_test(pslab_one_directory_given_twice_is_einval),
        FT_REDIS_TEST(remote_flush_times_out_then_drains),
        FT_REDIS_TEST(remote_close_writes_the_queue),
        FT_REDIS_TEST(remote_edges_of_sizes_and_down),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
