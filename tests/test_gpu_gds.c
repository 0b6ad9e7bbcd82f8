/*
 * test_gpu_gds.c - LMCache's three GDS round trips on a real GPU: 8 MiB of
 * 0xAB written and read back; 24 MiB of i % 251 across the 16 MiB region
 * boundary; two streams with their own buffers and chunks (0xA1, 0xB2)
 * that do not clobber each other. Each runs with the cufile driver (real
 * cuFile DMA; skipped when libcufile.so.0 does not open or cannot
 * register the slab file) and with the cpu driver over the cuda device
 * (the double-buffered bounce path). Issue 11: a slice at an unaligned
 * device address across the region boundary (the cpu driver stages its
 * unaligned head and tail with O_DIRECT), sync and async, and async
 * transfers on the default (NULL) stream. Exits 77 (skipped) where no CUDA
 * driver or device is present. No fork: CUDA does not survive one.
 */
/* ferry-test-labels: gpu */
/* ferry-test-timeout: 600 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry_test.h"

#define MiB (1u << 20)

static ferry_device *g_dev;
static char g_dir[256];
static const char *g_dirs[1];

static int setup(void **state)
{
    (void)state;
    ft_tmpdir(g_dir, sizeof g_dir);
    g_dirs[0] = g_dir;
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    ft_rmtree(g_dir);
    return 0;
}

/* open a context with driver, or skip the test when it cannot work here */
static ferry_gds *open_or_skip(const char *driver)
{
    ferry_gds_config c = FERRY_GDS_CONFIG_INIT;
    c.dirs = g_dirs;
    c.n_dirs = 1;
    c.bytes = 64 * MiB;
    c.device = g_dev;
    c.driver = driver;
    ferry_gds *g = NULL;
    int rc = ferry_gds_open(&c, &g);
    if (rc < 0 && !strcmp(driver, "cufile")) {
        printf("# cufile driver not usable here: %s\n", ferry_last_error());
        skip();
    }
    FT_ASSERT_OK(rc);
    printf("# driver %s, engine %s%s%s\n", ferry_gds_driver_name(g), ferry_gds_engine(g),
           ferry_gds_fallback_reason(g) ? ", fallback: " : "",
           ferry_gds_fallback_reason(g) ? ferry_gds_fallback_reason(g) : "");
    return g;
}

static ferry_extent alloc_chunk(ferry_gds *g, size_t n)
{
    ferry_shape sh = {1, {n}};
    int dt = FERRY_DTYPE_U8;
    ferry_layout l = {1, &sh, 1, &dt};
    ferry_extent e = {0, 0};
    assert_int_equal(ferry_slab_alloc(ferry_gds_slab(g), &l, 1, &e), 1);
    return e;
}

static void check_all(const unsigned char *p, size_t n, unsigned char v)
{
    for (size_t i = 0; i < n; i++)
        if (p[i] != v)
            fail_msg("byte %zu is 0x%02x, not 0x%02x", i, p[i], v);
}

static void write_read_roundtrip(const char *driver)
{
    ferry_gds *g = open_or_skip(driver);
    const size_t n = 8 * MiB;
    ferry_stream *s;
    FT_ASSERT_OK(ferry_stream_create(g_dev, &s));
    ferry_devptr buf;
    FT_ASSERT_OK(ferry_device_alloc(g_dev, n, &buf));
    FT_ASSERT_OK(ferry_gds_register(g, buf, n, s));
    ferry_extent e = alloc_chunk(g, n);
    FT_ASSERT_OK(ferry_device_memset(g_dev, buf, 0xAB, n));
    FT_ASSERT_OK(ferry_gds_extent_transfer_async(g, FERRY_GDS_WRITE, &e, buf, s));
    FT_ASSERT_OK(ferry_gds_stream_sync(g, s));
    FT_ASSERT_OK(ferry_device_memset(g_dev, buf, 0, n));
    FT_ASSERT_OK(ferry_gds_extent_transfer_async(g, FERRY_GDS_READ, &e, buf, s));
    FT_ASSERT_OK(ferry_gds_stream_sync(g, s));
    unsigned char *host = malloc(n);
    FT_ASSERT_OK(ferry_device_download(g_dev, host, buf, n));
    check_all(host, n, 0xAB);
    free(host);
    FT_ASSERT_OK(ferry_gds_deregister(g, buf));
    ferry_gds_close(g);
    FT_ASSERT_OK(ferry_device_free(g_dev, buf));
    ferry_stream_destroy(s);
}

static void chunk_larger_than_region(const char *driver)
{
    ferry_gds *g = open_or_skip(driver);
    const size_t n = 24 * MiB;
    ferry_stream *s;
    FT_ASSERT_OK(ferry_stream_create(g_dev, &s));
    ferry_devptr buf;
    FT_ASSERT_OK(ferry_device_alloc(g_dev, n, &buf));
    FT_ASSERT_OK(ferry_gds_register(g, buf, n, s));
    ferry_gds_stats st = FERRY_GDS_STATS_INIT;
    FT_ASSERT_OK(ferry_gds_stats_get(g, &st));
    assert_int_equal(st.regions, 2);
    ferry_extent e = alloc_chunk(g, n);
    unsigned char *pat = malloc(n), *back = malloc(n);
    for (size_t i = 0; i < n; i++)
        pat[i] = (unsigned char)(i % 251);
    FT_ASSERT_OK(ferry_device_upload(g_dev, buf, pat, n));
    FT_ASSERT_OK(ferry_gds_extent_transfer_async(g, FERRY_GDS_WRITE, &e, buf, s));
    FT_ASSERT_OK(ferry_gds_stream_sync(g, s));
    FT_ASSERT_OK(ferry_device_memset(g_dev, buf, 0, n));
    FT_ASSERT_OK(ferry_gds_extent_transfer_async(g, FERRY_GDS_READ, &e, buf, s));
    FT_ASSERT_OK(ferry_gds_stream_sync(g, s));
    FT_ASSERT_OK(ferry_device_download(g_dev, back, buf, n));
    assert_memory_equal(back, pat, n);
    /* the synchronous form too */
    FT_ASSERT_OK(ferry_device_memset(g_dev, buf, 0, n));
    FT_ASSERT_OK(ferry_gds_extent_transfer(g, FERRY_GDS_READ, &e, buf, s));
    FT_ASSERT_OK(ferry_device_download(g_dev, back, buf, n));
    assert_memory_equal(back, pat, n);
    free(pat);
    free(back);
    ferry_gds_close(g);
    FT_ASSERT_OK(ferry_device_free(g_dev, buf));
    ferry_stream_destroy(s);
}

static void two_streams(const char *driver)
{
    ferry_gds *g = open_or_skip(driver);
    const size_t n = 8 * MiB;
    const unsigned char pat[2] = {0xA1, 0xB2};
    ferry_stream *s[2];
    ferry_devptr buf[2];
    ferry_extent e[2];
    for (int i = 0; i < 2; i++) {
        FT_ASSERT_OK(ferry_stream_create(g_dev, &s[i]));
        FT_ASSERT_OK(ferry_device_alloc(g_dev, n, &buf[i]));
        FT_ASSERT_OK(ferry_gds_register(g, buf[i], n, s[i]));
        e[i] = alloc_chunk(g, n);
        FT_ASSERT_OK(ferry_device_memset(g_dev, buf[i], pat[i], n));
        FT_ASSERT_OK(ferry_gds_extent_transfer_async(g, FERRY_GDS_WRITE, &e[i], buf[i], s[i]));
        FT_ASSERT_OK(ferry_gds_stream_sync(g, s[i]));
    }
    unsigned char *host = malloc(n);
    for (int i = 0; i < 2; i++) {
        FT_ASSERT_OK(ferry_device_memset(g_dev, buf[i], 0, n));
        FT_ASSERT_OK(ferry_gds_extent_transfer_async(g, FERRY_GDS_READ, &e[i], buf[i], s[i]));
        FT_ASSERT_OK(ferry_gds_stream_sync(g, s[i]));
        FT_ASSERT_OK(ferry_device_download(g_dev, host, buf[i], n));
        check_all(host, n, pat[i]);
    }
    free(host);
    for (int i = 0; i < 2; i++) {
        FT_ASSERT_OK(ferry_gds_deregister(g, buf[i]));
        FT_ASSERT_OK(ferry_device_free(g_dev, buf[i]));
    }
    ferry_gds_close(g);
    for (int i = 0; i < 2; i++)
        ferry_stream_destroy(s[i]);
}

static void cufile_write_read(void **st)
{
    (void)st;
    write_read_roundtrip("cufile");
}
static void cufile_chunk_larger_than_region(void **st)
{
    (void)st;
    chunk_larger_than_region("cufile");
}
static void cufile_two_streams(void **st)
{
    (void)st;
    two_streams("cufile");
}
static void cpu_write_read(void **st)
{
    (void)st;
    write_read_roundtrip("cpu");
}
static void cpu_chunk_larger_than_region(void **st)
{
    (void)st;
    chunk_larger_than_region("cpu");
}
static void cpu_two_streams(void **st)
{
    (void)st;
    two_streams("cpu");
}

/* 8192 bytes from 4000 before the 16 MiB region boundary to slab offset
 * 0, read back to 1 byte before it; sync (async 0) or async */
static void unaligned_slice(const char *driver, int async)
{
    ferry_gds *g = open_or_skip(driver);
    const size_t n = 24 * MiB, len = 8192, wo = 16 * MiB - 4000, ro = 16 * MiB - 1;
    ferry_stream *s;
    FT_ASSERT_OK(ferry_stream_create(g_dev, &s));
    ferry_devptr buf;
    FT_ASSERT_OK(ferry_device_alloc(g_dev, n, &buf));
    FT_ASSERT_OK(ferry_gds_register(g, buf, n, s));
    unsigned char *pat = malloc(n), *back = malloc(n);
    for (size_t i = 0; i < n; i++)
        pat[i] = (unsigned char)(i % 251);
    FT_ASSERT_OK(ferry_device_upload(g_dev, buf, pat, n));
    if (async) {
        FT_ASSERT_OK(ferry_gds_transfer_async(g, FERRY_GDS_WRITE, 0, len, buf + wo, s));
        FT_ASSERT_OK(ferry_gds_stream_sync(g, s));
    } else {
        FT_ASSERT_OK(ferry_gds_transfer(g, FERRY_GDS_WRITE, 0, len, buf + wo, s));
    }
    FT_ASSERT_OK(ferry_device_memset(g_dev, buf, 0, n));
    if (async) {
        FT_ASSERT_OK(ferry_gds_transfer_async(g, FERRY_GDS_READ, 0, len, buf + ro, s));
        FT_ASSERT_OK(ferry_gds_stream_sync(g, s));
    } else {
        FT_ASSERT_OK(ferry_gds_transfer(g, FERRY_GDS_READ, 0, len, buf + ro, s));
    }
    FT_ASSERT_OK(ferry_device_download(g_dev, back, buf + ro - 4096, len + 8192));
    assert_memory_equal(back + 4096, pat + wo, len);
    for (size_t i = 0; i < 4096; i++)
        if (back[i] || back[4096 + len + i])
            fail_msg("a byte outside the slice changed (%zu)", i);
    free(pat);
    free(back);
    ferry_gds_close(g);
    FT_ASSERT_OK(ferry_device_free(g_dev, buf));
    ferry_stream_destroy(s);
}

/* registered with, and moved on, the default stream */
static void default_stream(const char *driver)
{
    ferry_gds *g = open_or_skip(driver);
    const size_t n = 24 * MiB;
    ferry_devptr buf;
    FT_ASSERT_OK(ferry_device_alloc(g_dev, n, &buf));
    FT_ASSERT_OK(ferry_gds_register(g, buf, n, NULL));
    unsigned char *pat = malloc(n), *back = malloc(n);
    for (size_t i = 0; i < n; i++)
        pat[i] = (unsigned char)(i % 241);
    FT_ASSERT_OK(ferry_device_upload(g_dev, buf, pat, n));
    FT_ASSERT_OK(ferry_gds_transfer_async(g, FERRY_GDS_WRITE, 4096, n, buf, NULL));
    FT_ASSERT_OK(ferry_gds_stream_sync(g, NULL));
    FT_ASSERT_OK(ferry_device_memset(g_dev, buf, 0, n));
    FT_ASSERT_OK(ferry_gds_transfer_async(g, FERRY_GDS_READ, 4096, n, buf, NULL));
    FT_ASSERT_OK(ferry_gds_stream_sync(g, NULL));
    FT_ASSERT_OK(ferry_device_download(g_dev, back, buf, n));
    assert_memory_equal(back, pat, n);
    free(pat);
    free(back);
    ferry_gds_close(g);
    FT_ASSERT_OK(ferry_device_free(g_dev, buf));
}

static void cufile_unaligned_slice(void **st)
{
    (void)st;
    unaligned_slice("cufile", 0);
    unaligned_slice("cufile", 1);
}
static void cpu_unaligned_slice(void **st)
{
    (void)st;
    unaligned_slice("cpu", 0);
    unaligned_slice("cpu", 1);
}
static void cufile_default_stream(void **st)
{
    (void)st;
    default_stream("cufile");
}
static void cpu_default_stream(void **st)
{
    (void)st;
    default_stream("cpu");
}

int main(void)
{
    const char *why = NULL;
    if (!ferry_device_backend_available("cuda", &why)) {
        printf("# skipped: %s\n", why ? why : "no CUDA");
        return 77;
    }
    ferry_device_options o = FERRY_DEVICE_OPTIONS_INIT;
    o.backend = "cuda";
    if (ferry_device_open(&o, &g_dev) < 0) {
        printf("# skipped: %s\n", ferry_last_error());
        return 77;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(cufile_write_read, setup, teardown),
        cmocka_unit_test_setup_teardown(cufile_chunk_larger_than_region, setup, teardown),
        cmocka_unit_test_setup_teardown(cufile_two_streams, setup, teardown),
        cmocka_unit_test_setup_teardown(cpu_write_read, setup, teardown),
        cmocka_unit_test_setup_teardown(cpu_chunk_larger_than_region, setup, teardown),
        cmocka_unit_test_setup_teardown(cpu_two_streams, setup, teardown),
        cmocka_unit_test_setup_teardown(cufile_unaligned_slice, setup, teardown),
        cmocka_unit_test_setup_teardown(cpu_unaligned_slice, setup, teardown),
        cmocka_unit_test_setup_teardown(cufile_default_stream, setup, teardown),
        cmocka_unit_test_setup_teardown(cpu_default_stream, setup, teardown),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    ferry_device_close(g_dev);
    return rc;
}
