/*
 * test_gds_roundtrip.c - bytes through the GDS context to disk and back,
 * on every host: the host device backend (device memory simulated, real
 * asynchronous streams) with the cpu driver, and the cufile and hipfile
 * drivers' own code driven by a fake cuFile library that does real file
 * I/O. LMCache's three round trips (8 MiB of 0xAB; 24 MiB of i % 251
 * across the 16 MiB region boundary; two streams with 0xA1 and 0xB2),
 * then striping over several directories (checked in the files
 * themselves), the host-buffer path, extents from the context's slab, a
 * device fault in the middle of a transfer, and driver selection.
 * Issue 11: device slices at unaligned addresses that cross a region
 * boundary, with O_DIRECT on the cpu driver (the minimal case, sync and
 * async, then random offsets and lengths on one and two drives), checked
 * in the slab file and back in device memory; async transfers on the
 * default (NULL) stream with the cpu driver and the cufile and hipfile
 * drivers over the fake library.
 */
/* ferry-test-labels: concurrent */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "core.h"
#include "ferry_test.h"
#include "gds/driver.h"
#include "io/cufile_api.h"
#include "io/sys.h"

#define MiB (1u << 20)

static char g_dir[4][256];
static const char *g_dirs[4];
static ferry_device *g_dev;

static int setup(void **state)
{
    (void)state;
    for (int i = 0; i < 4; i++) {
        ft_tmpdir(g_dir[i], sizeof g_dir[i]);
        g_dirs[i] = g_dir[i];
    }
    ferry_device_options o = FERRY_DEVICE_OPTIONS_INIT;
    o.backend = "host";
    return ferry_device_open(&o, &g_dev) < 0 ? -1 : 0;
}

static int teardown(void **state)
{
    (void)state;
    ferry_device_close(g_dev);
    for (int i = 0; i < 4; i++)
        ft_rmtree(g_dir[i]);
    return 0;
}

static ferry_gds_config config(unsigned ndirs, const char *driver)
{
    ferry_gds_config c = FERRY_GDS_CONFIG_INIT;
    c.dirs = g_dirs;
    c.n_dirs = ndirs;
    c.bytes = 64 * MiB;
    c.device = g_dev;
    c.driver = driver;
    return c;
}

static ferry_extent alloc_chunk(ferry_gds *g, size_t bytes)
{
    ferry_shape sh = {1, {bytes}};
    int dt = FERRY_DTYPE_U8;
    ferry_layout l = {1, &sh, 1, &dt};
    ferry_extent e = {0, 0};
    assert_int_equal(ferry_slab_alloc(ferry_gds_slab(g), &l, 1, &e), 1);
    return e;
}

static void assert_all(const unsigned char *p, size_t n, unsigned char v)
{
    for (size_t i = 0; i < n; i++)
        if (p[i] != v)
            fail_msg("byte %zu is 0x%02x, not 0x%02x", i, p[i], v);
}

/* the byte at file offset off of dir's slab file */
static void read_slab_file(const char *dir, void *buf, size_t len, uint64_t off)
{
    char p[512];
    snprintf(p, sizeof p, "%s/%s", dir, FERRY_GDS_SLAB_NAME);
    int fd = open(p, O_RDONLY);
    assert_true(fd >= 0);
    assert_int_equal(pread(fd, buf, len, (off_t)off), (ssize_t)len);
    close(fd);
}

/* LMCache's test_gds_write_read_roundtrip */
static void write_read_roundtrip(void **state)
{
    (void)state;
    ferry_gds_config c = config(1, "cpu");
    ferry_gds *g = NULL;
    FT_ASSERT_OK(ferry_gds_open(&c, &g));
    assert_string_equal(ferry_gds_driver_name(g), "cpu");
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
    assert_all(host, n, 0xAB);
    /* and the bytes are on disk, where the extent says */
    memset(host, 0, n);
    read_slab_file(g_dir[0], host, n, e.offset);
    assert_all(host, n, 0xAB);
    free(host);
    FT_ASSERT_OK(ferry_gds_deregister(g, buf));
    ferry_gds_close(g);
    FT_ASSERT_OK(ferry_device_free(g_dev, buf));
    ferry_stream_destroy(s);
}

/* LMCache's test_gds_chunk_larger_than_region_roundtrip */
static void chunk_larger_than_region_roundtrip(void **state)
{
    (void)state;
    ferry_gds_config c = config(1, "cpu");
    ferry_gds *g = NULL;
    FT_ASSERT_OK(ferry_gds_open(&c, &g));
    const size_t n = 24 * MiB;
    ferry_devptr buf;
    FT_ASSERT_OK(ferry_device_alloc(g_dev, n, &buf));
    FT_ASSERT_OK(ferry_gds_register(g, buf, n, NULL));
    ferry_extent pad = alloc_chunk(g, 4096); /* so the chunk is not at offset 0 */
    ferry_extent e = alloc_chunk(g, n);
    assert_int_equal(e.offset, pad.size);
    unsigned char *pat = malloc(n), *back = malloc(n);
    for (size_t i = 0; i < n; i++)
        pat[i] = (unsigned char)(i % 251);
    FT_ASSERT_OK(ferry_device_upload(g_dev, buf, pat, n));
    ferry_gds_stats st0 = FERRY_GDS_STATS_INIT, st1 = FERRY_GDS_STATS_INIT;
    FT_ASSERT_OK(ferry_gds_stats_get(g, &st0));
    FT_ASSERT_OK(ferry_gds_extent_transfer(g, FERRY_GDS_WRITE, &e, buf, NULL));
    FT_ASSERT_OK(ferry_gds_stats_get(g, &st1));
    assert_int_equal(st1.driver_ios - st0.driver_ios, 2); /* 16 MiB + 8 MiB */
    FT_ASSERT_OK(ferry_device_memset(g_dev, buf, 0, n));
    FT_ASSERT_OK(ferry_gds_extent_transfer(g, FERRY_GDS_READ, &e, buf, NULL));
    FT_ASSERT_OK(ferry_device_download(g_dev, back, buf, n));
    assert_memory_equal(back, pat, n);
    free(pat);
    free(back);
    ferry_gds_close(g); /* deregisters the buffer itself */
    FT_ASSERT_OK(ferry_device_free(g_dev, buf));
}

/* LMCache's test_gds_two_stream_write_read */
static void two_stream_write_read(void **state)
{
    (void)state;
    ferry_gds_config c = config(1, "cpu");
    ferry_gds *g = NULL;
    FT_ASSERT_OK(ferry_gds_open(&c, &g));
    const size_t n = 8 * MiB;
    ferry_stream *s[2];
    ferry_devptr buf[2];
    ferry_extent e[2];
    const unsigned char pat[2] = {0xA1, 0xB2};
    for (int i = 0; i < 2; i++) {
        FT_ASSERT_OK(ferry_stream_create(g_dev, &s[i]));
        FT_ASSERT_OK(ferry_device_alloc(g_dev, n, &buf[i]));
        FT_ASSERT_OK(ferry_gds_register(g, buf[i], n, s[i]));
        e[i] = alloc_chunk(g, n);
        FT_ASSERT_OK(ferry_device_memset(g_dev, buf[i], pat[i], n));
        FT_ASSERT_OK(ferry_gds_extent_transfer_async(g, FERRY_GDS_WRITE, &e[i], buf[i], s[i]));
    }
    for (int i = 0; i < 2; i++)
        FT_ASSERT_OK(ferry_gds_stream_sync(g, s[i]));
    unsigned char *host = malloc(n);
    for (int i = 0; i < 2; i++) {
        FT_ASSERT_OK(ferry_device_memset(g_dev, buf[i], 0, n));
        FT_ASSERT_OK(ferry_gds_extent_transfer_async(g, FERRY_GDS_READ, &e[i], buf[i], s[i]));
        FT_ASSERT_OK(ferry_gds_stream_sync(g, s[i]));
        FT_ASSERT_OK(ferry_device_download(g_dev, host, buf[i], n));
        assert_all(host, n, pat[i]);
    }
    free(host);
    for (int i = 0; i < 2; i++) {
        FT_ASSERT_OK(ferry_gds_deregister(g, buf[i]));
        FT_ASSERT_OK(ferry_device_free(g_dev, buf[i]));
    }
    ferry_gds_stats st = FERRY_GDS_STATS_INIT;
    FT_ASSERT_OK(ferry_gds_stats_get(g, &st));
    assert_int_equal(st.regions, 0);
    assert_int_equal(st.async_pending, 0);
    ferry_gds_close(g);
    for (int i = 0; i < 2; i++)
        ferry_stream_destroy(s[i]);
}

/* the slab striped over two directories: each file holds every other 1 MiB */
static void striped_over_two_dirs(void **state)
{
    (void)state;
    ferry_gds_config c = config(2, "cpu");
    c.stripe_bytes = MiB;
    ferry_gds *g = NULL;
    FT_ASSERT_OK(ferry_gds_open(&c, &g));
    ferry_gds_stats st = FERRY_GDS_STATS_INIT;
    FT_ASSERT_OK(ferry_gds_stats_get(g, &st));
    assert_int_equal(st.drives, 2);
    const size_t n = 24 * MiB;
    ferry_devptr buf;
    FT_ASSERT_OK(ferry_device_alloc(g_dev, n, &buf));
    FT_ASSERT_OK(ferry_gds_register(g, buf, n, NULL));
    unsigned char *pat = malloc(n), *back = malloc(n);
    for (size_t i = 0; i < n; i++)
        pat[i] = (unsigned char)(i % 251);
    FT_ASSERT_OK(ferry_device_upload(g_dev, buf, pat, n));
    const uint64_t at = 3 * MiB; /* starts on drive 1 */
    FT_ASSERT_OK(ferry_gds_transfer(g, FERRY_GDS_WRITE, at, n, buf, NULL));
    /* unit k of the slab is on drive k % 2 at file offset (k / 2) MiB */
    unsigned char *unit = malloc(MiB);
    for (uint64_t k = at / MiB; k < (at + n) / MiB; k++) {
        read_slab_file(g_dir[k % 2], unit, MiB, (k / 2) * MiB);
        assert_memory_equal(unit, pat + (k * MiB - at), MiB);
    }
    FT_ASSERT_OK(ferry_device_memset(g_dev, buf, 0, n));
    FT_ASSERT_OK(ferry_gds_transfer(g, FERRY_GDS_READ, at, n, buf, NULL));
    FT_ASSERT_OK(ferry_device_download(g_dev, back, buf, n));
    assert_memory_equal(back, pat, n);
    free(unit);
    free(pat);
    free(back);
    ferry_gds_close(g);
    FT_ASSERT_OK(ferry_device_free(g_dev, buf));
}

/* host buffers go to the drive queues directly, striped over three drives */
static void host_path_striped_three_drives(void **state)
{
    (void)state;
    ferry_gds_config c = config(3, "cpu");
    c.stripe_bytes = MiB;
    c.bytes = 30 * MiB + 8192; /* drive 0 holds 10 MiB + 8 KiB, the others 10 MiB */
    ferry_gds *g = NULL;
    FT_ASSERT_OK(ferry_gds_open(&c, &g));
    assert_int_equal(ferry_gds_size(g), 30 * MiB + 8192);
    const size_t n = 10 * MiB + 12288;
    unsigned char *pat = aligned_alloc(4096, n), *back = aligned_alloc(4096, n);
    ft_fill_pattern(pat, n, 7);
    const uint64_t at = 20 * MiB - 4096; /* mid-unit start, runs to the slab's end */
    FT_ASSERT_OK(ferry_gds_pwrite(g, pat, n, at));
    memset(back, 0, n);
    FT_ASSERT_OK(ferry_gds_pread(g, back, n, at));
    assert_int_equal(ft_check_pattern(back, n, 7), -1);
    /* the last, partial unit (30 MiB .. +8 KiB) is unit 30 -> drive 0 */
    unsigned char tail[8192];
    read_slab_file(g_dir[0], tail, sizeof tail, 10 * MiB);
    assert_memory_equal(tail, pat + (30 * MiB - at), sizeof tail);
    /* extents of the context's slab through the host path */
    ferry_extent e = alloc_chunk(g, 3 * MiB);
    FT_ASSERT_OK(ferry_gds_extent_pwrite(g, &e, pat));
    memset(back, 0, n);
    FT_ASSERT_OK(ferry_gds_extent_pread(g, &e, back));
    assert_memory_equal(back, pat, 3 * MiB);
    /* misaligned host buffer with O_DIRECT, past the end, unaligned offset */
    if (!ferry_gds_fallback_reason(g) || !strstr(ferry_gds_fallback_reason(g), "O_DIRECT"))
        assert_int_equal(ferry_gds_pwrite(g, pat + 1, 4096, 0), FERRY_EALIGN);
    assert_int_equal(ferry_gds_pwrite(g, pat, 16384, ferry_gds_size(g) - 8192), FERRY_EBOUNDS);
    assert_int_equal(ferry_gds_pread(g, back, 4096, 100), FERRY_EALIGN);
    ferry_gds_stats st = FERRY_GDS_STATS_INIT;
    FT_ASSERT_OK(ferry_gds_stats_get(g, &st));
    assert_int_equal(st.bytes_written, n + 3 * MiB);
    assert_true(st.engine_ios >= 11);
    free(pat);
    free(back);
    ferry_gds_close(g);
}

/* the device copy fails in the middle of a transfer: a clear error, then a retry works */
static void device_fault_mid_transfer(void **state)
{
    (void)state;
    ferry_gds_config c = config(1, "cpu");
    ferry_gds *g = NULL;
    FT_ASSERT_OK(ferry_gds_open(&c, &g));
    const size_t n = 24 * MiB;
    ferry_devptr buf;
    FT_ASSERT_OK(ferry_device_alloc(g_dev, n, &buf));
    FT_ASSERT_OK(ferry_gds_register(g, buf, n, NULL));
    FT_ASSERT_OK(ferry_device_memset(g_dev, buf, 0x5C, n));
    FT_ASSERT_OK(ft_device_faults(g_dev, 3, 0, 0, FERRY_FAULT_COPY));
    int rc = ferry_gds_transfer(g, FERRY_GDS_WRITE, 0, n, buf, NULL);
    FT_ASSERT_OK(ft_device_faults(g_dev, 0, 0, 0, 0));
    assert_int_equal(rc, FERRY_EINJECTED);
    assert_non_null(strstr(ferry_gds_last_error(g), "write of"));
    assert_non_null(strstr(ferry_gds_last_error(g), g_dir[0]));
    FT_ASSERT_OK(ferry_gds_transfer(g, FERRY_GDS_WRITE, 0, n, buf, NULL));
    FT_ASSERT_OK(ferry_device_memset(g_dev, buf, 0, n));
    FT_ASSERT_OK(ferry_gds_transfer(g, FERRY_GDS_READ, 0, n, buf, NULL));
    unsigned char *host = malloc(n);
    FT_ASSERT_OK(ferry_device_download(g_dev, host, buf, n));
    assert_all(host, n, 0x5C);
    free(host);
    ferry_gds_close(g);
    FT_ASSERT_OK(ferry_device_free(g_dev, buf));
}

static void driver_selection(void **state)
{
    (void)state;
    ferry_gds *g = NULL;
    ferry_gds_config c = config(1, NULL); /* auto on the host device: cpu, and why */
    FT_ASSERT_OK(ferry_gds_open(&c, &g));
    assert_string_equal(ferry_gds_driver_name(g), "cpu");
    assert_non_null(strstr(ferry_gds_fallback_reason(g), "not cuda"));
    assert_true(!strcmp(ferry_gds_engine(g), "uring") || !strcmp(ferry_gds_engine(g), "posix"));
    ferry_gds_close(g);
    g = NULL;
    c.driver = "cufile"; /* forced, no cuda device and no library */
    assert_int_equal(ferry_gds_open(&c, &g), FERRY_ENODEV);
    assert_non_null(strstr(ferry_last_error(), "cufile"));
    assert_null(g);
    c.driver = "hipfile";
    assert_int_equal(ferry_gds_open(&c, &g), FERRY_ENODEV);
    c.driver = "cpu";
    c.engine = "cufile"; /* the drive queues are posix/uring; cuFile is the driver's */
    assert_int_equal(ferry_gds_open(&c, &g), -EINVAL);
}



/* ---- issue 11: unaligned device slices with O_DIRECT ---- */

static int is_direct(ferry_gds *g)
{
    const char *why = ferry_gds_fallback_reason(g);
    return !why || !strstr(why, "O_DIRECT");
}

/* the slab's bytes [off, off+len), gathered from the drives' files */
static void read_slab(unsigned ndirs, uint64_t unit, void *buf, size_t len, uint64_t off)
{
    for (size_t pos = 0; pos < len;) {
        uint64_t o = off + pos, k = o / unit, in = o % unit;
        size_t n = (size_t)FERRY__MIN((uint64_t)(len - pos), unit - in);
        uint64_t foff = ndirs == 1 ? o : (k / ndirs) * unit + in;
        read_slab_file(g_dir[ndirs == 1 ? 0 : k % ndirs], (char *)buf + pos, n, foff);
        pos += n;
    }
}

typedef struct xfix {
    ferry_gds *g;
    ferry_stream *s;
    ferry_devptr buf;
    unsigned char *pat, *back;
    unsigned ndirs;
    uint64_t unit;
} xfix;

static const size_t XN = 24 * MiB; /* two regions: 16 MiB + 8 MiB */

static void xfix_open(xfix *x, unsigned ndirs, size_t stripe)
{
    memset(x, 0, sizeof *x);
    ferry_gds_config c = config(ndirs, "cpu");
    c.direct = 1;
    c.stripe_bytes = stripe;
    FT_ASSERT_OK(ferry_gds_open(&c, &x->g));
    if (!is_direct(x->g))
        fail_msg("O_DIRECT refused in %s (%s): this test needs it (FERRY_TEST_TMPDIR)",
                 g_dir[0], ferry_gds_fallback_reason(x->g));
    x->ndirs = ndirs;
    x->unit = ndirs == 1 ? UINT64_MAX : stripe;
    FT_ASSERT_OK(ferry_stream_create(g_dev, &x->s));
    FT_ASSERT_OK(ferry_device_alloc(g_dev, XN, &x->buf));
    FT_ASSERT_OK(ferry_gds_register(x->g, x->buf, XN, x->s));
    x->pat = malloc(XN);
    x->back = malloc(XN);
    for (size_t i = 0; i < XN; i++)
        x->pat[i] = (unsigned char)((i * 7 + i / 4096) % 253);
    FT_ASSERT_OK(ferry_device_upload(g_dev, x->buf, x->pat, XN));
}

static void xfix_close(xfix *x)
{
    ferry_gds_close(x->g);
    FT_ASSERT_OK(ferry_device_free(g_dev, x->buf));
    ferry_stream_destroy(x->s);
    free(x->pat);
    free(x->back);
}

static int xfer(xfix *x, int async, int dir, uint64_t slab_off, size_t len, size_t dev_off)
{
    if (!async)
        return ferry_gds_transfer(x->g, dir, slab_off, len, x->buf + dev_off, x->s);
    int rc = ferry_gds_transfer_async(x->g, dir, slab_off, len, x->buf + dev_off, x->s);
    int rs = ferry_gds_stream_sync(x->g, x->s);
    return rc < 0 ? rc : rs;
}

/* write pat[wo, wo+len) to slab_off, check the slab's bytes and that the
 * neighbouring slab bytes kept their values, then read it back to device
 * offset ro (zeroed first) and check device memory around it */
static void cross_once(xfix *x, int async, uint64_t slab_off, size_t len, size_t wo, size_t ro)
{
    /* the slab bytes just outside the slice: known before, same after */
    unsigned char before[2][4096], after[2][4096];
    size_t fringe = 4096;
    int have_lo = slab_off >= fringe, have_hi = slab_off + len + fringe <= ferry_gds_size(x->g);
    if (have_lo)
        read_slab(x->ndirs, x->unit, before[0], fringe, slab_off - fringe);
    if (have_hi)
        read_slab(x->ndirs, x->unit, before[1], fringe, slab_off + len);
    int rc = xfer(x, async, FERRY_GDS_WRITE, slab_off, len, wo);
    if (rc < 0)
        fail_msg("%s write of %zu at slab %llu from device +%zu: %s", async ? "async" : "sync",
                 len, (unsigned long long)slab_off, wo, ferry_gds_last_error(x->g));
    unsigned char *disk = malloc(len);
    read_slab(x->ndirs, x->unit, disk, len, slab_off);
    assert_memory_equal(disk, x->pat + wo, len);
    free(disk);
    if (have_lo) {
        read_slab(x->ndirs, x->unit, after[0], fringe, slab_off - fringe);
        assert_memory_equal(after[0], before[0], fringe);
    }
    if (have_hi) {
        read_slab(x->ndirs, x->unit, after[1], fringe, slab_off + len);
        assert_memory_equal(after[1], before[1], fringe);
    }
    /* read back into another unaligned place: only [ro, ro+len) changes */
    FT_ASSERT_OK(ferry_device_memset(g_dev, x->buf + ro, 0, len));
    rc = xfer(x, async, FERRY_GDS_READ, slab_off, len, ro);
    if (rc < 0)
        fail_msg("%s read of %zu at slab %llu to device +%zu: %s", async ? "async" : "sync", len,
                 (unsigned long long)slab_off, ro, ferry_gds_last_error(x->g));
    size_t lo = ro >= fringe ? ro - fringe : 0, hi = FERRY__MIN(XN, ro + len + fringe);
    FT_ASSERT_OK(ferry_device_download(g_dev, x->back, x->buf + lo, hi - lo));
    assert_memory_equal(x->back + (ro - lo), x->pat + wo, len);
    assert_memory_equal(x->back, x->pat + lo, ro - lo);
    assert_memory_equal(x->back + (ro - lo) + len, x->pat + ro + len, hi - ro - len);
    /* put the pattern back where the read landed */
    FT_ASSERT_OK(ferry_device_upload(g_dev, x->buf + ro, x->pat + ro, len));
}

/* the minimal case: 8192 bytes from 4000 before the 16 MiB
 * region boundary, slab offset 0, sync and async */
static void unaligned_slice_across_regions_direct(void **state)
{
    (void)state;
    xfix x;
    xfix_open(&x, 1, 0);
    cross_once(&x, 0, 0, 8192, 16 * MiB - 4000, 16 * MiB - 4000);
    cross_once(&x, 1, 0, 8192, 16 * MiB - 4000, 16 * MiB - 4000);
    /* elsewhere in the slab, read back across the boundary at another point */
    cross_once(&x, 0, 40 * MiB, 8192, 16 * MiB - 4000, 16 * MiB - 1);
    cross_once(&x, 1, 40 * MiB + 4096, 8192, 16 * MiB - 1, 16 * MiB - 8191);
    /* one byte short of aligned at both ends, and a large slice */
    cross_once(&x, 0, 8192, 2 * MiB, 16 * MiB - MiB - 1, 16 * MiB - 3);
    cross_once(&x, 1, 12 * MiB, 8 * MiB + 4096, 12 * MiB - 4097, 10 * MiB + 17);
    /* an aligned slice still takes the plain path and stays exact */
    cross_once(&x, 0, 4096, 64 * 1024, 16 * MiB - 32 * 1024, 16 * MiB - 8192);
    xfix_close(&x);
}

/* random slab offsets, lengths and device addresses, every slice crossing
 * the region boundary; on one drive and striped over two (64 KiB units,
 * so a slice also crosses drives) */
static void unaligned_slices_random_direct(void **state)
{
    (void)state;
    unsigned seed = 1234567u;
    for (unsigned ndirs = 1; ndirs <= 2; ndirs++) {
        xfix x;
        xfix_open(&x, ndirs, 64 * 1024);
        for (int i = 0; i < 24; i++) {
            seed = seed * 1103515245u + 12345u;
            size_t len = 4096 * (1 + (seed >> 8) % 96);         /* 4 KiB .. 384 KiB */
            seed = seed * 1103515245u + 12345u;
            size_t before_w = 1 + (seed >> 4) % (len - 1);        /* bytes before the boundary */
            seed = seed * 1103515245u + 12345u;
            size_t before_r = 1 + (seed >> 4) % (len - 1);
            seed = seed * 1103515245u + 12345u;
            uint64_t slab_off = 4096 * (uint64_t)((seed >> 6) % ((64 * MiB - len) / 4096));
            cross_once(&x, i & 1, slab_off, len, 16 * MiB - before_w, 16 * MiB - before_r);
        }
        xfix_close(&x);
    }
}

/* ---- issue 11: async transfers on the default stream ---- */

static void null_stream_roundtrip(const char *driver)
{
    ferry_gds_config c = config(1, driver);
    ferry_gds *g = NULL;
    FT_ASSERT_OK(ferry_gds_open(&c, &g));
    assert_string_equal(ferry_gds_driver_name(g), driver);
    const size_t n = 24 * MiB;
    ferry_devptr buf;
    FT_ASSERT_OK(ferry_device_alloc(g_dev, n, &buf));
    FT_ASSERT_OK(ferry_gds_register(g, buf, n, NULL)); /* the default stream, as gds.h allows */
    unsigned char *pat = malloc(n), *back = malloc(n);
    for (size_t i = 0; i < n; i++)
        pat[i] = (unsigned char)(i % 241);
    FT_ASSERT_OK(ferry_device_upload(g_dev, buf, pat, n));
    FT_ASSERT_OK(ferry_gds_transfer_async(g, FERRY_GDS_WRITE, 8192, n, buf, NULL));
    FT_ASSERT_OK(ferry_gds_stream_sync(g, NULL));
    FT_ASSERT_OK(ferry_device_memset(g_dev, buf, 0, n));
    FT_ASSERT_OK(ferry_gds_transfer_async(g, FERRY_GDS_READ, 8192, n, buf, NULL));
    FT_ASSERT_OK(ferry_gds_stream_sync(g, NULL));
    FT_ASSERT_OK(ferry_device_download(g_dev, back, buf, n));
    assert_memory_equal(back, pat, n);
    read_slab_file(g_dir[0], back, n, 8192);
    assert_memory_equal(back, pat, n);
    ferry_gds_stats st = FERRY_GDS_STATS_INIT;
    FT_ASSERT_OK(ferry_gds_stats_get(g, &st));
    assert_int_equal(st.async_pending, 0);
    assert_int_equal(st.bytes_written, n);
    assert_int_equal(st.bytes_read, n);
    FT_ASSERT_OK(ferry_gds_deregister(g, buf));
    ferry_gds_close(g);
    free(pat);
    free(back);
    FT_ASSERT_OK(ferry_device_free(g_dev, buf));
}

static void async_on_default_stream_cpu(void **state)
{
    (void)state;
    null_stream_roundtrip("cpu");
}

/* host buffers registered with the drive queues: the fast path, same bytes */
static void registered_host_buffers(void **state)
{
    (void)state;
    ferry_gds_config c = config(2, "cpu");
    ferry_gds *g = NULL;
    FT_ASSERT_OK(ferry_gds_open(&c, &g));
    unsigned char *a = NULL, *b = NULL;
    FT_ASSERT_OK(ferry_gds_buffer_alloc(g, 4 * MiB, (void **)&a));
    assert_true(((uintptr_t)a & 4095) == 0);
    unsigned char *mine = aligned_alloc(4096, 4 * MiB);
    FT_ASSERT_OK(ferry_gds_host_register(g, mine, 4 * MiB));
    b = mine;
    ft_fill_pattern(a, 4 * MiB, 5);
    FT_ASSERT_OK(ferry_gds_pwrite(g, a, 4 * MiB, 8 * MiB));
    memset(b, 0, 4 * MiB);
    FT_ASSERT_OK(ferry_gds_pread(g, b, 4 * MiB, 8 * MiB));
    assert_int_equal(ft_check_pattern(b, 4 * MiB, 5), -1);
    /* a slice inside a registered buffer works as well */
    FT_ASSERT_OK(ferry_gds_pread(g, b + 4096, 8192, 8 * MiB + 4096));
    FT_ASSERT_OK(ferry_gds_host_unregister(g, mine));
    assert_int_equal(ferry_gds_host_unregister(g, mine), FERRY_ENOTFOUND);
    assert_int_equal(ferry_gds_host_register(g, NULL, 4096), -EINVAL);
    ferry_gds_buffer_free(g, a);
    ferry_gds_close(g);
    free(mine);
    /* off: refused */
    ferry_gds *off = NULL;
    FT_ASSERT_OK(ferry_gds_open(NULL, &off));
    void *p = NULL;
    assert_int_equal(ferry_gds_buffer_alloc(off, 4096, &p), FERRY_ESTATE);
    ferry_gds_close(off);
}

/* ferry_gds_host_unregister of a buffer never registered (or already
 * unregistered) is FERRY_ENOTFOUND with every engine: the posix engine
 * ignores registrations, and it was 0 there. The same buffer again with
 * its length is a no-op, with another length FERRY_EEXIST. A buffer
 * length that cannot be rounded up to the alignment is -EINVAL, as
 * ferry_io_buffer_alloc's, out untouched (it wrapped to a tiny buffer and
 * succeeded). */
static void host_registration_contract_on_every_engine(void **state)
{
    (void)state;
    static const char *const engines[] = {"posix", "uring"};
    for (size_t i = 0; i < 2; i++) {
        ferry_gds_config c = config(2, "cpu");
        c.engine = engines[i];
        ferry_gds *g = NULL;
        if (ferry_gds_open(&c, &g) < 0) {
            assert_string_equal(engines[i], "uring"); /* (no io_uring here) */
            continue;
        }
        unsigned char *mine = aligned_alloc(4096, 2 * MiB), other[64];
        assert_int_equal(ferry_gds_host_unregister(g, other), FERRY_ENOTFOUND);
        assert_non_null(strstr(ferry_gds_last_error(g), "not registered"));
        FT_ASSERT_OK(ferry_gds_host_register(g, mine, 2 * MiB));
        FT_ASSERT_OK(ferry_gds_host_register(g, mine, 2 * MiB));
        assert_int_equal(ferry_gds_host_register(g, mine, 1 * MiB), FERRY_EEXIST);
        FT_ASSERT_OK(ferry_gds_host_unregister(g, mine));
        assert_int_equal(ferry_gds_host_unregister(g, mine), FERRY_ENOTFOUND);
        void *p = (void *)&c;
        assert_int_equal(ferry_gds_buffer_alloc(g, SIZE_MAX - 100, &p), -EINVAL);
        assert_ptr_equal(p, (void *)&c);
        p = NULL;
        FT_ASSERT_OK(ferry_gds_buffer_alloc(g, 4096, &p));
        ferry_gds_buffer_free(g, p);
        assert_int_equal(ferry_gds_host_unregister(g, p), FERRY_ENOTFOUND);
        ferry_gds_close(g);
        free(mine);
    }
}

/* A host registration holds up no device transfer of another thread
 * (ferry/gds.h: it may run beside transfers, and may take long: the
 * kernel pins every page). The registration is held inside the kernel
 * call (the io seam's hook) until the main thread's device transfer and
 * stats returned, or for 3 s: the context's lock was held across the pin,
 * so the transfer waited out the whole registration. uring only. */
static atomic_int g_pin_entered, g_pin_release, g_pin_timed_out;
static int pin_hook(void *ctx, unsigned slot, void *base, size_t len)
{
    (void)ctx;
    (void)slot;
    (void)base;
    (void)len;
    atomic_store(&g_pin_entered, 1);
    for (int ms = 0; !atomic_load(&g_pin_release); ms++) {
        if (ms == 3000) {
            atomic_store(&g_pin_timed_out, 1);
            break;
        }
        struct timespec t = {0, 1000000};
        nanosleep(&t, NULL);
    }
    return 0;
}

typedef struct {
    ferry_gds *g;
    void *buf;
    size_t len;
    int rc;
} pin_arg;

static void *pin_thread(void *p)
{
    pin_arg *a = p;
    a->rc = ferry_gds_host_register(a->g, a->buf, a->len);
    return NULL;
}

static void host_register_holds_up_no_device_transfer(void **state)
{
    (void)state;
    ferry_gds_config c = config(2, "cpu");
    c.engine = "uring";
    ferry_gds *g = NULL;
    if (ferry_gds_open(&c, &g) < 0)
        return; /* (no io_uring here) */
    const size_t n = 4 * MiB;
    ferry_devptr dbuf;
    FT_ASSERT_OK(ferry_device_alloc(g_dev, n, &dbuf));
    FT_ASSERT_OK(ferry_gds_register(g, dbuf, n, NULL));
    unsigned char *pat = malloc(n), *back = malloc(n);
    ft_fill_pattern(pat, n, 29);
    FT_ASSERT_OK(ferry_device_upload(g_dev, dbuf, pat, n));
    static ferry__sys t;
    t = *ferry__sys_default();
    t.uring_register = pin_hook;
    atomic_store(&g_pin_entered, 0);
    atomic_store(&g_pin_release, 0);
    atomic_store(&g_pin_timed_out, 0);
    ferry__sys_set(&t);
    pin_arg a = {g, aligned_alloc(4096, 2 * MiB), 2 * MiB, -1};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, pin_thread, &a), 0);
    /* the posix fallback of a uring without a table never calls the hook */
    for (int ms = 0; !atomic_load(&g_pin_entered) && ms < 500; ms++) {
        struct timespec one = {0, 1000000};
        nanosleep(&one, NULL);
    }
    int entered = atomic_load(&g_pin_entered);
    FT_ASSERT_OK(ferry_gds_transfer(g, FERRY_GDS_WRITE, 0, n, dbuf, NULL));
    FT_ASSERT_OK(ferry_device_memset(g_dev, dbuf, 0, n));
    FT_ASSERT_OK(ferry_gds_transfer(g, FERRY_GDS_READ, 0, n, dbuf, NULL));
    ferry_gds_stats st = FERRY_GDS_STATS_INIT;
    FT_ASSERT_OK(ferry_gds_stats_get(g, &st));
    atomic_store(&g_pin_release, 1);
    pthread_join(th, NULL);
    ferry__sys_set(NULL);
    FT_ASSERT_OK(a.rc);
    if (entered)
        assert_int_equal(atomic_load(&g_pin_timed_out), 0); /* released by the transfer */
    FT_ASSERT_OK(ferry_device_download(g_dev, back, dbuf, n));
    assert_memory_equal(back, pat, n);
    FT_ASSERT_OK(ferry_gds_host_unregister(g, a.buf));
    FT_ASSERT_OK(ferry_gds_deregister(g, dbuf));
    ferry_gds_close(g);
    FT_ASSERT_OK(ferry_device_free(g_dev, dbuf));
    free(a.buf);
    free(pat);
    free(back);
}

/* asynchronous host requests: many in flight over three drives, reaped in any order */
static void async_host_requests(void **state)
{
    (void)state;
    ferry_gds_config c = config(3, "cpu");
    ferry_gds *g = NULL;
    FT_ASSERT_OK(ferry_gds_open(&c, &g));
    enum { N = 12 };
    const size_t chunk = 3 * MiB + 4096; /* never a whole number of stripe units */
    unsigned char *mem = aligned_alloc(4096, N * chunk), *back = aligned_alloc(4096, N * chunk);
    ft_fill_pattern(mem, N * chunk, 11);
    ferry_gds_req rq[N], *ptrs[N], *done[N];
    for (int i = 0; i < N; i++) {
        rq[i] = (ferry_gds_req){FERRY_GDS_WRITE, mem + i * chunk, chunk, i * chunk, (void *)(uintptr_t)i,
                                1, NULL};
        ptrs[i] = &rq[i];
    }
    assert_int_equal(ferry_gds_submit(g, ptrs, N), N);
    int seen = 0;
    while (seen < N) {
        int k = ferry_gds_reap(g, done, 1, N, -1);
        assert_true(k > 0);
        for (int j = 0; j < k; j++)
            FT_ASSERT_OK(done[j]->result);
        seen += k;
    }
    assert_int_equal(ferry_gds_reap(g, done, 1, N, -1), 0); /* nothing outstanding */
    for (int i = 0; i < N; i++) {
        rq[i].dir = FERRY_GDS_READ;
        rq[i].buf = back + i * chunk;
    }
    assert_int_equal(ferry_gds_submit(g, ptrs, N), N);
    for (seen = 0; seen < N;) {
        int k = ferry_gds_reap(g, done, N - seen, N, -1);
        assert_true(k > 0);
        seen += k;
    }
    assert_int_equal(ft_check_pattern(back, N * chunk, 11), -1);
    /* an invalid request stops the batch there: the ones before it are queued */
    rq[1].slab_off = 100;
    assert_int_equal(ferry_gds_submit(g, ptrs, 3), 1);
    assert_non_null(strstr(ferry_gds_last_error(g), "multiples of 4096"));
    assert_int_equal(ferry_gds_submit(g, ptrs + 1, 1), FERRY_EALIGN);
    assert_int_equal(ferry_gds_reap(g, done, 1, N, -1), 1);
    assert_ptr_equal(done[0], &rq[0]);
    /* requests still in flight at close are waited for, then dropped */
    rq[1].slab_off = 4096;
    assert_int_equal(ferry_gds_submit(g, ptrs, 4), 4);
    ferry_gds_close(g);
    free(mem);
    free(back);
}

/* A request is the context's from submit until reaped: submitting it again
 * meanwhile (in flight, done and unreaped, or twice in one call) is
 * FERRY_EBUSY naming it, and it comes back once; where it was queued
 * anyway, two hops shared one request and a caller reaping both hung. A
 * request whose priv_ is stale (a copy of one in flight) is taken. */
static void resubmit_in_flight_is_ebusy(void **state)
{
    (void)state;
    ferry_gds_config c = config(2, "cpu");
    ferry_gds *g = NULL;
    FT_ASSERT_OK(ferry_gds_open(&c, &g));
    const size_t n = 1 * MiB;
    unsigned char *mem = aligned_alloc(4096, 2 * n);
    ft_fill_pattern(mem, 2 * n, 5);
    ferry_gds_req r = {FERRY_GDS_WRITE, mem, n, 0, NULL, 1, NULL};
    ferry_gds_req *p[2] = {&r, &r}, *done[4] = {NULL};
    assert_int_equal(ferry_gds_submit(g, p, 1), 1);
    assert_int_equal(ferry_gds_submit(g, p, 1), FERRY_EBUSY);
    char want[64];
    snprintf(want, sizeof want, "(%p, write of", (void *)&r);
    assert_non_null(strstr(ferry_gds_last_error(g), want));
    assert_non_null(strstr(ferry_gds_last_error(g), "already in flight"));
    ferry_gds_req copy = r; /* priv_ points at r's hop */
    copy.buf = mem + n;
    copy.slab_off = n;
    ferry_gds_req *cp = &copy;
    assert_int_equal(ferry_gds_submit(g, &cp, 1), 1);
    int seen = 0;
    while (seen < 2) {
        int k = ferry_gds_reap(g, done + seen, 1, 4 - (unsigned)seen, -1);
        assert_true(k > 0);
        seen += k;
    }
    assert_int_equal(ferry_gds_reap(g, done, 1, 4, 50), 0); /* nothing more comes */
    assert_null(r.priv_);
    /* done but not reaped is still the context's */
    ferry_gds_stats st = FERRY_GDS_STATS_INIT;
    FT_ASSERT_OK(ferry_gds_stats_get(g, &st));
    uint64_t before = st.bytes_written;
    assert_int_equal(ferry_gds_submit(g, p, 1), 1);
    while (st.bytes_written == before) { /* a poll taking none: completed, left unreaped */
        assert_int_equal(ferry_gds_reap(g, done, 0, 0, 0), 0);
        FT_ASSERT_OK(ferry_gds_stats_get(g, &st));
    }
    assert_int_equal(ferry_gds_submit(g, p, 1), FERRY_EBUSY);
    assert_int_equal(ferry_gds_reap(g, done, 1, 4, -1), 1);
    /* twice in one call: the first is queued */
    assert_int_equal(ferry_gds_submit(g, p, 2), 1);
    assert_non_null(strstr(ferry_gds_last_error(g), "request 1 ("));
    assert_int_equal(ferry_gds_reap(g, done, 1, 4, -1), 1);
    assert_ptr_equal(done[0], &r);
    FT_ASSERT_OK(r.result);
    assert_int_equal(ferry_gds_reap(g, done, 1, 4, 50), 0);
    /* reaped: the caller's again */
    assert_int_equal(ferry_gds_submit(g, p, 1), 1);
    assert_int_equal(ferry_gds_reap(g, done, 1, 4, -1), 1);
    memset(mem, 0, 2 * n);
    FT_ASSERT_OK(ferry_gds_pread(g, mem, 2 * n, 0));
    assert_int_equal(ft_check_pattern(mem, 2 * n, 5), -1);
    ferry_gds_close(g);
    free(mem);
}

/* threads storing and loading their own extents at once; thread 0 mixes in async reads */
typedef struct tjob {
    ferry_gds *g;
    ferry_extent e;
    unsigned seed;
    int rc;
} tjob;

static void *tjob_run(void *arg)
{
    tjob *j = arg;
    size_t n = (size_t)j->e.size;
    unsigned char *a = aligned_alloc(4096, n), *b = aligned_alloc(4096, n);
    j->rc = -1;
    for (int round = 0; round < 4; round++) {
        ft_fill_pattern(a, n, j->seed + (unsigned)round);
        if (ferry_gds_extent_pwrite(j->g, &j->e, a) < 0)
            goto out;
        if (j->seed == 0 && round % 2) {
            /* the one thread that reaps: its completions may be delivered by
             * the others' synchronous calls, and still reach it here */
            ferry_gds_req q = {FERRY_GDS_READ, b, n, j->e.offset, NULL, 1, NULL}, *qp = &q, *d;
            if (ferry_gds_submit(j->g, &qp, 1) != 1)
                goto out;
            if (ferry_gds_reap(j->g, &d, 1, 1, -1) != 1 || d != &q || q.result < 0)
                goto out;
        } else if (ferry_gds_extent_pread(j->g, &j->e, b) < 0) {
            goto out;
        }
        if (ft_check_pattern(b, n, j->seed + (unsigned)round) != -1)
            goto out;
    }
    j->rc = 0;
out:
    free(a);
    free(b);
    return NULL;
}

static void threads_share_the_drive_queues(void **state)
{
    (void)state;
    ferry_gds_config c = config(2, "cpu");
    ferry_gds *g = NULL;
    FT_ASSERT_OK(ferry_gds_open(&c, &g));
    tjob jobs[4];
    pthread_t th[4];
    for (int i = 0; i < 4; i++) {
        jobs[i] = (tjob){g, alloc_chunk(g, 2 * MiB + 8192), (unsigned)i * 7, -1};
        assert_int_equal(pthread_create(&th[i], NULL, tjob_run, &jobs[i]), 0);
    }
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        assert_int_equal(jobs[i].rc, 0);
    }
    ferry_gds_close(g);
}

/* What the header promises of threads (ferry/gds.h): device transfers from
 * several threads at once, each with its own stream, while registrations
 * come and go on other threads; and host requests submitted by one
 * thread are reaped by another. Every byte comes back as written. */
typedef struct dxjob {
    ferry_gds *g;
    ferry_extent e;
    unsigned seed;
    int rc;
    char what[160];
} dxjob;

#define DX_FAIL(j, rc_, step)                                                              \
    do {                                                                               \
        (j)->rc = (rc_) ? (rc_) : -1;                                                  \
        snprintf((j)->what, sizeof (j)->what, "%s: %s", step, ferry_gds_last_error((j)->g)); \
        goto out;                                                                      \
    } while (0)

static void *dxjob_run(void *arg)
{
    dxjob *j = arg;
    size_t n = (size_t)j->e.size;
    unsigned char *a = malloc(n), *b = malloc(n);
    ferry_stream *s = NULL;
    ferry_devptr buf = 0, scratch = 0;
    int rc;
    j->rc = 0;
    if ((rc = ferry_stream_create(g_dev, &s)) < 0 || (rc = ferry_device_alloc(g_dev, n, &buf)) < 0)
        DX_FAIL(j, rc, "setup");
    if ((rc = ferry_gds_register(j->g, buf, n, s)) < 0)
        DX_FAIL(j, rc, "register");
    for (int round = 0; round < 6; round++) {
        unsigned seed = j->seed + (unsigned)round;
        /* a registration that comes and goes while the others transfer */
        if ((rc = ferry_device_alloc(g_dev, 1 * MiB, &scratch)) < 0 ||
            (rc = ferry_gds_register(j->g, scratch, 1 * MiB, s)) < 0)
            DX_FAIL(j, rc, "scratch register");
        ft_fill_pattern(a, n, seed);
        if ((rc = ferry_device_upload(g_dev, buf, a, n)) < 0)
            DX_FAIL(j, rc, "upload");
        rc = round % 2 ? ferry_gds_extent_transfer_async(j->g, FERRY_GDS_WRITE, &j->e, buf, s)
                       : ferry_gds_extent_transfer(j->g, FERRY_GDS_WRITE, &j->e, buf, s);
        if (rc < 0 || (rc = ferry_gds_stream_sync(j->g, s)) < 0)
            DX_FAIL(j, rc, "write");
        if ((rc = ferry_gds_deregister(j->g, scratch)) < 0)
            DX_FAIL(j, rc, "scratch deregister");
        ferry_device_free(g_dev, scratch);
        scratch = 0;
        if ((rc = ferry_device_memset(g_dev, buf, 0, n)) < 0)
            DX_FAIL(j, rc, "memset");
        rc = round % 2 ? ferry_gds_extent_transfer(j->g, FERRY_GDS_READ, &j->e, buf, s)
                       : ferry_gds_extent_transfer_async(j->g, FERRY_GDS_READ, &j->e, buf, s);
        if (rc < 0 || (rc = ferry_gds_stream_sync(j->g, s)) < 0)
            DX_FAIL(j, rc, "read");
        if ((rc = ferry_device_download(g_dev, b, buf, n)) < 0)
            DX_FAIL(j, rc, "download");
        long bad = ft_check_pattern(b, n, seed);
        if (bad != -1) {
            j->rc = -EBADMSG;
            snprintf(j->what, sizeof j->what, "round %d: byte %ld differs", round, bad);
            goto out;
        }
    }
out:
    if (scratch) {
        ferry_gds_deregister(j->g, scratch);
        ferry_device_free(g_dev, scratch);
    }
    if (buf) {
        ferry_gds_deregister(j->g, buf);
        ferry_device_free(g_dev, buf);
    }
    if (s)
        ferry_stream_destroy(s);
    free(a);
    free(b);
    return NULL;
}

enum { RQ_N = 24 };
typedef struct reaper {
    ferry_gds *g;
    ferry_gds_req *rq;
    int got, bad;
} reaper;

static void *reaper_run(void *arg)
{
    reaper *x = arg;
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    while (x->got < RQ_N) {
        ferry_gds_req *d[RQ_N];
        /* 0 at once while none is outstanding (the submitter not there yet) */
        int k = ferry_gds_reap(x->g, d, 1, RQ_N, 100);
        clock_gettime(CLOCK_MONOTONIC, &t);
        if (k < 0 || t.tv_sec - t0.tv_sec > 60) {
            x->bad = k < 0 ? k : -ETIMEDOUT;
            return NULL;
        }
        if (k == 0)
            sched_yield();
        for (int i = 0; i < k; i++) {
            if (d[i] < x->rq || d[i] >= x->rq + RQ_N || d[i]->result != 0)
                x->bad = -EBADMSG;
            x->got++;
        }
    }
    return NULL;
}

static void threads_transfer_register_and_reap(void **state)
{
    (void)state;
    ferry_gds_config c = config(2, "cpu");
    c.region_cap = 1 * MiB; /* buffers of several regions: more to look up */
    c.stripe_bytes = 1 * MiB;
    ferry_gds *g = NULL;
    FT_ASSERT_OK(ferry_gds_open(&c, &g));
    enum { T = 3 };
    dxjob jobs[T];
    pthread_t th[T + 1];
    for (int i = 0; i < T; i++) {
        jobs[i] = (dxjob){g, alloc_chunk(g, 3 * MiB), 100u + (unsigned)i * 13u, -1, ""};
        assert_int_equal(pthread_create(&th[i], NULL, dxjob_run, &jobs[i]), 0);
    }
    /* host requests submitted here, reaped by another thread */
    const size_t chunk = 256 << 10;
    ferry_extent he = alloc_chunk(g, RQ_N * chunk);
    unsigned char *mem = aligned_alloc(4096, RQ_N * chunk);
    ft_fill_pattern(mem, RQ_N * chunk, 77);
    ferry_gds_req rq[RQ_N];
    reaper x = {g, rq, 0, 0};
    for (int i = 0; i < RQ_N; i++)
        rq[i] = (ferry_gds_req){FERRY_GDS_WRITE, mem + i * chunk, chunk,
                                he.offset + (uint64_t)i * chunk, NULL, 1, NULL};
    assert_int_equal(pthread_create(&th[T], NULL, reaper_run, &x), 0);
    for (int i = 0; i < RQ_N; i++) {
        ferry_gds_req *p = &rq[i];
        assert_int_equal(ferry_gds_submit(g, &p, 1), 1);
    }
    for (int i = 0; i <= T; i++)
        pthread_join(th[i], NULL);
    for (int i = 0; i < T; i++)
        if (jobs[i].rc != 0)
            fail_msg("thread %d: %d (%s): %s", i, jobs[i].rc, ferry_strerror(jobs[i].rc),
                     jobs[i].what);
    assert_int_equal(x.bad, 0);
    assert_int_equal(x.got, RQ_N);
    memset(mem, 0, RQ_N * chunk);
    FT_ASSERT_OK(ferry_gds_extent_pread(g, &he, mem));
    assert_int_equal(ft_check_pattern(mem, RQ_N * chunk, 77), -1);
    ferry_gds_stats st = FERRY_GDS_STATS_INIT;
    FT_ASSERT_OK(ferry_gds_stats_get(g, &st));
    assert_int_equal(st.regions, 0);
    assert_int_equal(st.streams, 0);
    assert_int_equal(st.async_pending, 0);
    ferry_gds_close(g);
    free(mem);
}

/* ---- a fake cuFile library that moves real bytes ---- */
typedef struct fcf {
    int opens, closes, handles, handle_deregs, bufregs, bufderegs, sregs, sderegs;
    unsigned sflags;
    int reads, writes, asyncs, batches;
    int fail_handle;
    size_t regsizes[8];
} fcf;
static fcf C;

static ferry__CUfileError_t ok(void)
{
    ferry__CUfileError_t e = {0, 0};
    return e;
}
static ferry__CUfileError_t c_open(void)
{
    C.opens++;
    return ok();
}
static ferry__CUfileError_t c_close(void)
{
    C.closes++;
    return ok();
}
static ferry__CUfileError_t c_hreg(ferry__CUfileHandle_t *fh, ferry__CUfileDescr_t *d)
{
    if (C.fail_handle) {
        ferry__CUfileError_t e = {FERRY__CU_FILE_INTERNAL_ERROR, 0};
        return e;
    }
    assert_int_equal(d->type, FERRY__CU_FILE_HANDLE_TYPE_OPAQUE_FD);
    /* our own descriptor without O_DIRECT: the fake's buffers are not aligned */
    char p[64];
    snprintf(p, sizeof p, "/proc/self/fd/%d", d->handle.fd);
    int fd = open(p, O_RDWR);
    assert_true(fd >= 0);
    C.handles++;
    *fh = (void *)(intptr_t)(fd + 1);
    return ok();
}
static void c_hdereg(ferry__CUfileHandle_t fh)
{
    C.handle_deregs++;
    close((int)(intptr_t)fh - 1);
}
static ferry__CUfileError_t c_breg(const void *base, size_t len, int flags)
{
    (void)base, (void)flags;
    if (C.bufregs < 8)
        C.regsizes[C.bufregs] = len;
    C.bufregs++;
    return ok();
}
static ferry__CUfileError_t c_bdereg(const void *base)
{
    (void)base;
    C.bufderegs++;
    return ok();
}
static ssize_t c_read(ferry__CUfileHandle_t fh, void *base, size_t size, off_t fo, off_t bo)
{
    C.reads++;
    return pread((int)(intptr_t)fh - 1, (char *)base + bo, size, fo);
}
static ssize_t c_write(ferry__CUfileHandle_t fh, const void *base, size_t size, off_t fo, off_t bo)
{
    C.writes++;
    return pwrite((int)(intptr_t)fh - 1, (const char *)base + bo, size, fo);
}
static ferry__CUfileError_t c_rasync(ferry__CUfileHandle_t fh, void *base, size_t *size,
                                     off_t *fo, off_t *bo, ssize_t *done, void *stream)
{
    (void)stream;
    C.asyncs++;
    *done = c_read(fh, base, *size, *fo, *bo);
    return ok();
}
static ferry__CUfileError_t c_wasync(ferry__CUfileHandle_t fh, void *base, size_t *size,
                                     off_t *fo, off_t *bo, ssize_t *done, void *stream)
{
    (void)stream;
    C.asyncs++;
    *done = c_write(fh, base, *size, *fo, *bo);
    return ok();
}
static ferry__CUfileError_t c_sreg(void *stream, unsigned flags)
{
    (void)stream;
    C.sregs++;
    C.sflags = flags;
    return ok();
}
static ferry__CUfileError_t c_sdereg(void *stream)
{
    (void)stream;
    C.sderegs++;
    return ok();
}
typedef struct cbatch {
    unsigned n, given;
    ferry__CUfileIOEvents_t ev[128];
} cbatch;
static ferry__CUfileError_t c_bsetup(ferry__CUfileBatchHandle_t *id, unsigned nr)
{
    assert_true(nr <= 128);
    *id = calloc(1, sizeof(cbatch));
    return ok();
}
static ferry__CUfileError_t c_bsubmit(ferry__CUfileBatchHandle_t id, unsigned nr,
                                      ferry__CUfileIOParams_t *p, unsigned flags)
{
    (void)flags;
    cbatch *b = id;
    C.batches++;
    for (unsigned i = 0; i < nr; i++) {
        assert_int_equal(p[i].mode, FERRY__CUFILE_BATCH);
        ssize_t r = p[i].opcode == FERRY__CUFILE_READ
                        ? c_read(p[i].fh, p[i].u.batch.devPtr_base, p[i].u.batch.size,
                                 p[i].u.batch.file_offset, p[i].u.batch.devPtr_offset)
                        : c_write(p[i].fh, p[i].u.batch.devPtr_base, p[i].u.batch.size,
                                  p[i].u.batch.file_offset, p[i].u.batch.devPtr_offset);
        b->ev[b->n].cookie = p[i].cookie;
        b->ev[b->n].status = r >= 0 ? FERRY__CUFILE_COMPLETE : FERRY__CUFILE_FAILED;
        b->ev[b->n++].ret = r >= 0 ? (size_t)r : 0;
    }
    return ok();
}
static ferry__CUfileError_t c_bstatus(ferry__CUfileBatchHandle_t id, unsigned min_nr,
                                      unsigned *nr, ferry__CUfileIOEvents_t *ev,
                                      struct timespec *to)
{
    (void)min_nr, (void)to;
    cbatch *b = id;
    unsigned k = 0;
    while (k < *nr && b->given < b->n)
        ev[k++] = b->ev[b->given++];
    *nr = k;
    return ok();
}
static ferry__CUfileError_t c_bcancel(ferry__CUfileBatchHandle_t id)
{
    (void)id;
    return ok();
}
static void c_bdestroy(ferry__CUfileBatchHandle_t id)
{
    free(id);
}

static ferry__cufile_api fake_api(int with_async)
{
    ferry__cufile_api a;
    memset(&a, 0, sizeof a);
    a.DriverOpen = c_open;
    a.DriverClose = c_close;
    a.HandleRegister = c_hreg;
    a.HandleDeregister = c_hdereg;
    a.BufRegister = c_breg;
    a.BufDeregister = c_bdereg;
    a.Read = c_read;
    a.Write = c_write;
    if (with_async) {
        a.ReadAsync = c_rasync;
        a.WriteAsync = c_wasync;
        a.StreamRegister = c_sreg;
        a.StreamDeregister = c_sdereg;
        a.BatchIOSetUp = c_bsetup;
        a.BatchIOSubmit = c_bsubmit;
        a.BatchIOGetStatus = c_bstatus;
        a.BatchIOCancel = c_bcancel;
        a.BatchIODestroy = c_bdestroy;
    }
    a.allow_host_device = 1;
    return a;
}

static void roundtrip_on(const char *driver, int with_async)
{
    memset(&C, 0, sizeof C);
    ferry__cufile_api api = fake_api(with_async);
    ferry__gdsdl_set_api(driver, &api);
    ferry_gds_config c = config(1, driver);
    ferry_gds *g = NULL;
    int rc = ferry_gds_open(&c, &g);
    if (rc < 0)
        ferry__gdsdl_set_api(driver, NULL);
    FT_ASSERT_OK(rc);
    assert_string_equal(ferry_gds_driver_name(g), driver);
    assert_int_equal(C.opens, 1);
    assert_int_equal(C.handles, 1);
    const size_t n = 24 * MiB;
    ferry_stream *s;
    FT_ASSERT_OK(ferry_stream_create(g_dev, &s));
    ferry_devptr buf;
    FT_ASSERT_OK(ferry_device_alloc(g_dev, n, &buf));
    FT_ASSERT_OK(ferry_gds_register(g, buf, n, s));
    assert_int_equal(C.bufregs, 2);
    assert_int_equal(C.regsizes[0], 16 * MiB);
    assert_int_equal(C.regsizes[1], 8 * MiB);
    assert_int_equal(C.sregs, with_async ? 1 : 0);
    if (with_async)
        assert_int_equal(C.sflags, 0x7);
    unsigned char *pat = malloc(n), *back = malloc(n);
    for (size_t i = 0; i < n; i++)
        pat[i] = (unsigned char)(i % 251);
    FT_ASSERT_OK(ferry_device_upload(g_dev, buf, pat, n));
    /* synchronous write: two segments, through the batch API when there is one */
    FT_ASSERT_OK(ferry_gds_transfer(g, FERRY_GDS_WRITE, 4096, n, buf, s));
    assert_int_equal(C.batches, with_async ? 1 : 0);
    FT_ASSERT_OK(ferry_device_memset(g_dev, buf, 0, n));
    /* asynchronous read (or its synchronous fallback) */
    FT_ASSERT_OK(ferry_gds_transfer_async(g, FERRY_GDS_READ, 4096, n, buf, s));
    FT_ASSERT_OK(ferry_gds_stream_sync(g, s));
    assert_int_equal(C.asyncs, with_async ? 2 : 0);
    FT_ASSERT_OK(ferry_device_download(g_dev, back, buf, n));
    assert_memory_equal(back, pat, n);
    FT_ASSERT_OK(ferry_gds_deregister(g, buf));
    assert_int_equal(C.bufderegs, 2);
    assert_int_equal(C.sderegs, with_async ? 1 : 0);
    ferry_gds_close(g);
    assert_int_equal(C.handle_deregs, 1);
    assert_int_equal(C.closes, 1);
    ferry__gdsdl_set_api(driver, NULL);
    free(pat);
    free(back);
    FT_ASSERT_OK(ferry_device_free(g_dev, buf));
    ferry_stream_destroy(s);
}

static void cufile_driver_over_fake_library(void **state)
{
    (void)state;
    roundtrip_on("cufile", 1);
}

static void cufile_driver_over_old_library(void **state)
{
    (void)state;
    roundtrip_on("cufile", 0); /* no stream, async or batch calls (cuFile < 1.7) */
}

static void hipfile_driver_over_fake_library(void **state)
{
    (void)state;
    roundtrip_on("hipfile", 1);
}

/* the default stream with the cufile and hipfile drivers' own code */
static void async_on_default_stream_fake_libraries(void **state)
{
    (void)state;
    static const char *const drivers[] = {"cufile", "hipfile"};
    for (int i = 0; i < 2; i++) {
        for (int with_async = 0; with_async <= 1; with_async++) {
            memset(&C, 0, sizeof C);
            ferry__cufile_api api = fake_api(with_async);
            ferry__gdsdl_set_api(drivers[i], &api);
            null_stream_roundtrip(drivers[i]);
            ferry__gdsdl_set_api(drivers[i], NULL);
            assert_int_equal(C.opens, 1);
            assert_int_equal(C.closes, 1);
            assert_int_equal(C.bufregs, 2);
            assert_int_equal(C.bufderegs, 2);
            /* done in the call: the synchronous or batch entries moved it */
            assert_int_equal(C.asyncs, 0);
            assert_true(C.reads + C.writes + C.batches > 0);
        }
    }
}

static void cufile_handle_registration_failure(void **state)
{
    (void)state;
    memset(&C, 0, sizeof C);
    C.fail_handle = 1;
    ferry__cufile_api api = fake_api(1);
    ferry__gdsdl_set_api("cufile", &api);
    ferry_gds_config c = config(1, "cufile");
    ferry_gds *g = NULL;
    int rc = ferry_gds_open(&c, &g);
    ferry__gdsdl_set_api("cufile", NULL);
    assert_true(rc < 0);
    assert_null(g);
    assert_non_null(strstr(ferry_last_error(), "cuFileHandleRegister"));
    assert_non_null(strstr(ferry_last_error(), "5030"));
    assert_int_equal(C.opens, 1);
    assert_int_equal(C.closes, 1); /* nothing left open */
}


/* auto: cuFile opens but refuses the slab file (overlayfs, LVM: LMCache
 * issues 5030/5008): fall back to the cpu driver, say so, keep working */
static void auto_falls_back_when_cufile_refuses_the_file(void **state)
{
    (void)state;
    memset(&C, 0, sizeof C);
    C.fail_handle = 1;
    ferry__cufile_api api = fake_api(1);
    ferry__gdsdl_set_api("cufile", &api);
    ferry_gds_config c = config(1, NULL);
    ferry_gds *g = NULL;
    int rc = ferry_gds_open(&c, &g);
    ferry__gdsdl_set_api("cufile", NULL);
    FT_ASSERT_OK(rc);
    assert_string_equal(ferry_gds_driver_name(g), "cpu");
    const char *why = ferry_gds_fallback_reason(g);
    assert_non_null(why);
    assert_non_null(strstr(why, "cuFileHandleRegister"));
    assert_non_null(strstr(why, "using the cpu driver"));
    assert_int_equal(C.opens, 1);
    assert_int_equal(C.closes, 1); /* cuFile closed again before the cpu driver took over */
    const size_t n = 4 * MiB;
    ferry_devptr buf;
    FT_ASSERT_OK(ferry_device_alloc(g_dev, n, &buf));
    FT_ASSERT_OK(ferry_gds_register(g, buf, n, NULL));
    FT_ASSERT_OK(ferry_device_memset(g_dev, buf, 0x3C, n));
    FT_ASSERT_OK(ferry_gds_transfer(g, FERRY_GDS_WRITE, 0, n, buf, NULL));
    FT_ASSERT_OK(ferry_device_memset(g_dev, buf, 0, n));
    FT_ASSERT_OK(ferry_gds_transfer(g, FERRY_GDS_READ, 0, n, buf, NULL));
    unsigned char *host = malloc(n);
    FT_ASSERT_OK(ferry_device_download(g_dev, host, buf, n));
    assert_all(host, n, 0x3C);
    free(host);
    ferry_gds_close(g);
    FT_ASSERT_OK(ferry_device_free(g_dev, buf));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(write_read_roundtrip, setup, teardown),
        cmocka_unit_test_setup_teardown(chunk_larger_than_region_roundtrip, setup, teardown),
        cmocka_unit_test_setup_teardown(two_stream_write_read, setup, teardown),
        cmocka_unit_test_setup_teardown(striped_over_two_dirs, setup, teardown),
        cmocka_unit_test_setup_teardown(host_path_striped_three_drives, setup, teardown),
        cmocka_unit_test_setup_teardown(device_fault_mid_transfer, setup, teardown),
        cmocka_unit_test_setup_teardown(driver_selection, setup, teardown),
        cmocka_unit_test_setup_teardown(registered_host_buffers, setup, teardown),
        cmocka_unit_test_setup_teardown(host_registration_contract_on_every_engine, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(host_register_holds_up_no_device_transfer, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(async_host_requests, setup, teardown),
        cmocka_unit_test_setup_teardown(resubmit_in_flight_is_ebusy, setup, teardown),
        cmocka_unit_test_setup_teardown(threads_share_the_drive_queues, setup, teardown),
        cmocka_unit_test_setup_teardown(threads_transfer_register_and_reap, setup, teardown),
        cmocka_unit_test_setup_teardown(cufile_driver_over_fake_library, setup, teardown),
        cmocka_unit_test_setup_teardown(cufile_driver_over_old_library, setup, teardown),
        cmocka_unit_test_setup_teardown(hipfile_driver_over_fake_library, setup, teardown),
        cmocka_unit_test_setup_teardown(cufile_handle_registration_failure, setup, teardown),
        cmocka_unit_test_setup_teardown(unaligned_slice_across_regions_direct, setup, teardown),
        cmocka_unit_test_setup_teardown(unaligned_slices_random_direct, setup, teardown),
        cmocka_unit_test_setup_teardown(async_on_default_stream_cpu, setup, teardown),
        cmocka_unit_test_setup_teardown(async_on_default_stream_fake_libraries, setup, teardown),
        cmocka_unit_test_setup_teardown(auto_falls_back_when_cufile_refuses_the_file, setup,
                                        teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
