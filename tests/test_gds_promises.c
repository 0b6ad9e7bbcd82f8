/*
 * test_gds_promises.c - ferry/gds.h's host-buffer promises read as an
 * outside user reads them, on the cpu driver over the posix and uring
 * engines, with two drives, bytes compared:
 *   - off: every host call is FERRY_ESTATE (reap: 0), *out untouched;
 *   - refusals (len 0, unaligned offset or length, past the slab's end, a
 *     NULL buffer, an unknown direction) leave the slab's bytes as they were,
 *     synchronous and asynchronous;
 *   - a reaped request is the caller's again: resubmitted with another
 *     direction, buffer and offset it moves the new bytes; a reap with
 *     nothing outstanding returns 0 at once, even with min 1 and no timeout;
 *   - a drive that fails its writes (a full disk): -ENOSPC naming the
 *     drive's file, the slab offset and the file offset, synchronous and
 *     asynchronous (ferry_gds_last_error after the reap), and the same
 *     transfer works once space is back;
 *   - ferry_gds_buffer_alloc: -EINVAL for len 0 or out NULL, *out set only
 *     on success, aligned, registered again with the length asked for as
 *     a no-op, and a round trip through it;
 *   - ferry_gds_stats_get: -EINVAL without size; bytes counted as moved.
 */
/* ferry-test-labels: concurrent */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry_test.h"
#include "ferry/gds.h"
#include "io/sys.h"

#define MiB ((size_t)1 << 20)

static char g_root[256], g_d0[300], g_d1[300];
static const char *g_dirs[2] = {g_d0, g_d1};

static void has(const char *msg, const char *needle)
{
    if (!strstr(msg, needle))
        fail_msg("message '%s' does not contain '%s'", msg, needle);
}

static ferry_gds *open_gds(void **state)
{
    ferry_gds_config c = FERRY_GDS_CONFIG_INIT;
    c.dirs = g_dirs;
    c.n_dirs = 2;
    c.bytes = 8 * MiB;
    c.stripe_bytes = MiB;
    c.driver = "cpu";
    c.engine = (const char *)*state;
    c.depth = 4;
    ferry_gds *g = NULL;
    FT_ASSERT_OK(ferry_gds_open(&c, &g));
    assert_string_equal(ferry_gds_engine(g), (const char *)*state);
    return g;
}

static unsigned char *abuf(size_t n)
{
    void *p = NULL;
    assert_int_equal(posix_memalign(&p, 4096, n), 0);
    return p;
}

static int reap_all(ferry_gds *g, ferry_gds_req **done, unsigned n)
{
    unsigned got = 0;
    while (got < n) {
        int k = ferry_gds_reap(g, done + got, 1, n - got, -1);
        assert_true(k > 0);
        got += (unsigned)k;
    }
    return (int)got;
}

static void off_context_refuses_host_calls(void **state)
{
    (void)state;
    ferry_gds *g = NULL;
    FT_ASSERT_OK(ferry_gds_open(NULL, &g));
    unsigned char *b = abuf(4096);
    assert_int_equal(ferry_gds_pwrite(g, b, 4096, 0), FERRY_ESTATE);
    assert_int_equal(ferry_gds_pread(g, b, 4096, 0), FERRY_ESTATE);
    ferry_gds_req r = {FERRY_GDS_WRITE, b, 4096, 0, NULL, 1, NULL}, *p = &r, *d = NULL;
    assert_int_equal(ferry_gds_submit(g, &p, 1), FERRY_ESTATE);
    assert_int_equal(ferry_gds_reap(g, &d, 1, 1, -1), 0);
    void *out = (void *)0x1;
    assert_int_equal(ferry_gds_buffer_alloc(g, 4096, &out), FERRY_ESTATE);
    assert_ptr_equal(out, (void *)0x1);
    assert_int_equal(ferry_gds_host_register(g, b, 4096), FERRY_ESTATE);
    assert_int_equal(ferry_gds_host_unregister(g, b), FERRY_ESTATE);
    assert_int_equal(ferry_gds_size(g), 0);
    assert_null(ferry_gds_slab(g));
    assert_string_equal(ferry_gds_engine(g), "off");
    ferry_gds_close(g);
    free(b);
}

static void refusals_leave_the_slab_alone(void **state)
{
    ferry_gds *g = open_gds(state);
    const size_t n = 2 * MiB;
    const uint64_t size = ferry_gds_size(g);
    unsigned char *a = abuf(n), *x = abuf(n + 4096), *b = abuf(n);
    ft_fill_pattern(a, n, 7);
    memset(x, 0xcc, n + 4096);
    FT_ASSERT_OK(ferry_gds_pwrite(g, a, n, MiB - 4096)); /* across a stripe unit */
    assert_int_equal(ferry_gds_pwrite(g, x, 0, MiB), -EINVAL);
    assert_int_equal(ferry_gds_pwrite(g, x, 4096, MiB + 100), FERRY_EALIGN);
    has(ferry_gds_last_error(g), "multiples of 4096");
    assert_int_equal(ferry_gds_pwrite(g, x, 1000, MiB), FERRY_EALIGN);
    assert_int_equal(ferry_gds_pwrite(g, x, 8192, size - 4096), FERRY_EBOUNDS);
    has(ferry_gds_last_error(g), "past the slab's end");
    assert_int_equal(ferry_gds_pwrite(g, x, 4096, size), FERRY_EBOUNDS);
    assert_int_equal(ferry_gds_pwrite(g, NULL, 4096, MiB), -EINVAL);
    ferry_gds_req r[5] = {
        {FERRY_GDS_WRITE, x, 0, MiB, NULL, 1, NULL},
        {FERRY_GDS_WRITE, x, 4096, MiB + 512, NULL, 1, NULL},
        {FERRY_GDS_WRITE, x, n + 4096, size - n, NULL, 1, NULL},
        {FERRY_GDS_WRITE, NULL, 4096, MiB, NULL, 1, NULL},
        {7, x, 4096, MiB, NULL, 1, NULL},
    };
    int want[5] = {-EINVAL, FERRY_EALIGN, FERRY_EBOUNDS, -EINVAL, -EINVAL};
    for (int i = 0; i < 5; i++) {
        ferry_gds_req *p = &r[i];
        assert_int_equal(ferry_gds_submit(g, &p, 1), want[i]);
        assert_int_equal(r[i].result, 1); /* untouched */
        assert_null(r[i].priv_);
    }
    ferry_gds_req *none[1];
    assert_int_equal(ferry_gds_reap(g, none, 1, 1, -1), 0);
    assert_int_equal(ferry_gds_reap(g, none, 2, 1, 0), -EINVAL);
    memset(b, 0, n);
    FT_ASSERT_OK(ferry_gds_pread(g, b, n, MiB - 4096));
    assert_memory_equal(b, a, n);
    ferry_gds_close(g);
    free(a);
    free(x);
    free(b);
}

static void request_reused_after_reap(void **state)
{
    ferry_gds *g = open_gds(state);
    const size_t n = MiB + 8192;
    unsigned char *a = abuf(n), *c = abuf(n), *b = abuf(2 * n);
    ft_fill_pattern(a, n, 17);
    ft_fill_pattern(c, n, 18);
    ferry_gds_req r = {FERRY_GDS_WRITE, a, n, 0, NULL, 1, NULL}, *p = &r, *d[2];
    assert_int_equal(ferry_gds_submit(g, &p, 1), 1);
    assert_int_equal(reap_all(g, d, 1), 1);
    assert_ptr_equal(d[0], &r);
    FT_ASSERT_OK(r.result);
    assert_null(r.priv_);
    r.buf = c; /* the same request, other bytes, another place */
    r.slab_off = n;
    assert_int_equal(ferry_gds_submit(g, &p, 1), 1);
    assert_int_equal(reap_all(g, d, 1), 1);
    FT_ASSERT_OK(r.result);
    r.dir = FERRY_GDS_READ; /* and the other direction, over both */
    r.buf = b;
    r.len = 2 * n;
    r.slab_off = 0;
    memset(b, 0, 2 * n);
    assert_int_equal(ferry_gds_submit(g, &p, 1), 1);
    assert_int_equal(reap_all(g, d, 1), 1);
    FT_ASSERT_OK(r.result);
    assert_memory_equal(b, a, n);
    assert_memory_equal(b + n, c, n);
    /* nothing outstanding: 0 at once, even waiting for one forever */
    assert_int_equal(ferry_gds_reap(g, d, 1, 2, -1), 0);
    ferry_gds_close(g);
    free(a);
    free(b);
    free(c);
}

/* a full disk on every drive: writes fail with ENOSPC (posix through the
 * syscall seam, uring through its completion hook) */
static int g_full;
static ssize_t full_pwrite(int fd, const void *b, size_t n, off_t off)
{
    if (g_full) {
        errno = ENOSPC;
        return -1;
    }
    return ferry__sys_default()->pwrite(fd, b, n, off);
}
static int full_uring(void *ctx, int op, int fd, uint64_t off, size_t len, int res)
{
    (void)ctx;
    (void)fd;
    (void)off;
    (void)len;
    return g_full && op == FERRY_IO_WRITE ? -ENOSPC : res;
}

static void full_drive_is_named(void **state)
{
    ferry_gds *g = open_gds(state);
    static ferry__sys t;
    t = *ferry__sys_default();
    t.pwrite = full_pwrite;
    t.uring_result = full_uring;
    ferry__sys_set(&t);
    const size_t n = 2 * MiB;
    unsigned char *a = abuf(n), *b = abuf(n);
    ft_fill_pattern(a, n, 27);
    g_full = 1;
    char slab[400];
    snprintf(slab, sizeof slab, "%s/%s", g_d1, FERRY_GDS_SLAB_NAME);
    /* slab offset 1 MiB is drive 1's first stripe unit (file offset 0) */
    assert_int_equal(ferry_gds_pwrite(g, a, 4096, MiB), -ENOSPC);
    has(ferry_gds_last_error(g), "slab offset 1048576");
    has(ferry_gds_last_error(g), slab);
    has(ferry_gds_last_error(g), "file offset 0");
    ferry_gds_req r = {FERRY_GDS_WRITE, a, n, MiB, NULL, 1, NULL}, *p = &r, *d[1];
    assert_int_equal(ferry_gds_submit(g, &p, 1), 1);
    assert_int_equal(reap_all(g, d, 1), 1);
    assert_int_equal(r.result, -ENOSPC);
    has(ferry_gds_last_error(g), "slab offset 1048576");
    has(ferry_gds_last_error(g), "file offset");
    g_full = 0; /* space is back */
    FT_ASSERT_OK(ferry_gds_pwrite(g, a, n, MiB));
    memset(b, 0, n);
    FT_ASSERT_OK(ferry_gds_pread(g, b, n, MiB));
    assert_memory_equal(b, a, n);
    ferry__sys_set(NULL);
    ferry_gds_close(g);
    free(a);
    free(b);
}

static void buffer_alloc_and_stats(void **state)
{
    ferry_gds *g = open_gds(state);
    void *out = (void *)0x1;
    assert_int_equal(ferry_gds_buffer_alloc(g, 0, &out), -EINVAL);
    assert_ptr_equal(out, (void *)0x1);
    assert_int_equal(ferry_gds_buffer_alloc(g, 4096, NULL), -EINVAL);
    assert_int_equal(ferry_gds_buffer_alloc(g, SIZE_MAX - 10, &out), -EINVAL);
    assert_ptr_equal(out, (void *)0x1);
    unsigned char *p = NULL;
    FT_ASSERT_OK(ferry_gds_buffer_alloc(g, 3 * MiB + 100, (void **)&p));
    assert_true(((uintptr_t)p & 4095) == 0);
    /* registered with the length asked for: again with it is a no-op */
    FT_ASSERT_OK(ferry_gds_host_register(g, p, 3 * MiB + 100));
    assert_int_equal(ferry_gds_host_register(g, p, 3 * MiB + 4096), FERRY_EEXIST);
    const size_t n = 3 * MiB; /* (inside the 3 MiB + 100 asked for) */
    ft_fill_pattern(p, n, 37);
    FT_ASSERT_OK(ferry_gds_pwrite(g, p, n, 4096));
    unsigned char *b = abuf(n);
    FT_ASSERT_OK(ferry_gds_pread(g, b, n, 4096));
    assert_int_equal(ft_check_pattern(b, n, 37), -1);
    ferry_gds_stats st = FERRY_GDS_STATS_INIT;
    FT_ASSERT_OK(ferry_gds_stats_get(g, &st));
    assert_int_equal(st.drives, 2);
    assert_int_equal(st.bytes_written, n);
    assert_int_equal(st.bytes_read, n);
    ferry_gds_stats bad = FERRY_GDS_STATS_INIT;
    bad.size = 0;
    assert_int_equal(ferry_gds_stats_get(g, &bad), -EINVAL);
    assert_int_equal(ferry_gds_stats_get(g, NULL), -EINVAL);
    ferry_gds_buffer_free(g, p);
    ferry_gds_close(g);
    free(b);
}

static int setup(void **state)
{
    (void)state;
    ft_tmpdir(g_root, sizeof g_root);
    snprintf(g_d0, sizeof g_d0, "%s/d0", g_root);
    snprintf(g_d1, sizeof g_d1, "%s/d1", g_root);
    return g_root[0] ? 0 : -1;
}
static int teardown(void **state)
{
    (void)state;
    ferry__sys_set(NULL);
    ft_rmtree(g_root);
    return 0;
}

#define PER_ENGINE(fn) cmocka_unit_test_prestate(fn, "posix"), cmocka_unit_test_prestate(fn, "uring")

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(off_context_refuses_host_calls),
        PER_ENGINE(refusals_leave_the_slab_alone),
        PER_ENGINE(request_reused_after_reap),
        PER_ENGINE(full_drive_is_named),
        PER_ENGINE(buffer_alloc_and_stats),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
