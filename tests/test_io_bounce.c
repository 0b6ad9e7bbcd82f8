/*
 * test_io_bounce.c - the CPU path for device memory (ferry_io_read_dev /
 * write_dev without GDS) on the host device backend, whose streams run on
 * worker threads: byte-exact round trips with sizes that are not a
 * multiple of the segment, O_DIRECT tails (reads padded, writes refused
 * with FERRY_EALIGN), faults in the device copy and in the file I/O, and
 * the overlap itself in both directions, observed deterministically
 * through the host backend's hold seam (reads) and a held file write
 * (writes).
 */
/* ferry-test-labels: concurrent */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "device/device_impl.h"
#include "ferry_test.h"
#include "io/io_impl.h"
#include "io/sys.h"

#define SEG (64u << 10)

static char g_dir[256];

static void assert_msg_has(const char *msg, const char *needle)
{
    if (!strstr(msg, needle))
        fail_msg("message '%s' does not contain '%s'", msg, needle);
}

/* ---- file seam: count reads, fail the Nth write ---- */
static atomic_uint g_preads, g_pwrites, g_fail_write_at;
static ssize_t c_pread(int fd, void *b, size_t n, off_t o)
{
    atomic_fetch_add(&g_preads, 1);
    return ferry__sys_default()->pread(fd, b, n, o);
}
static ssize_t c_pwrite(int fd, const void *b, size_t n, off_t o)
{
    unsigned k = atomic_fetch_add(&g_pwrites, 1) + 1;
    if (atomic_load(&g_fail_write_at) == k) {
        errno = EIO;
        return -1;
    }
    return ferry__sys_default()->pwrite(fd, b, n, o);
}
static ferry__sys g_table;
static void seam_install(void)
{
    g_table = *ferry__sys_default();
    g_table.pread = c_pread;
    g_table.pwrite = c_pwrite;
    atomic_store(&g_preads, 0);
    atomic_store(&g_pwrites, 0);
    atomic_store(&g_fail_write_at, 0);
    ferry__sys_set(&g_table);
}

typedef struct env {
    ferry_device *dev;
    ferry_io *io;
} env;

static env open_env(const char *engine)
{
    env e = {0};
    ferry_device_options d = FERRY_DEVICE_OPTIONS_INIT;
    d.backend = "host";
    FT_ASSERT_OK(ferry_device_open(&d, &e.dev));
    ferry_io_options o = FERRY_IO_OPTIONS_INIT;
    o.engine = engine;
    o.depth = 4;
    o.device = e.dev;
    o.bounce_bytes = SEG;
    FT_ASSERT_OK(ferry_io_open(&o, &e.io));
    return e;
}
static void close_env(env *e)
{
    ferry_io_close(e->io);
    ferry_device_close(e->dev);
}

static ferry_file *open_file(ferry_io *io, const char *name, unsigned extra)
{
    char p[512];
    snprintf(p, sizeof p, "%s/%s", g_dir, name);
    ferry_file *f = NULL;
    FT_ASSERT_OK(ferry_file_open(io, p, FERRY_FILE_READ | FERRY_FILE_WRITE | FERRY_FILE_CREATE |
                                            FERRY_FILE_TRUNC | extra, &f));
    return f;
}

static ferry_devptr dev_pattern(ferry_device *dev, size_t n, unsigned seed)
{
    ferry_devptr p = 0;
    FT_ASSERT_OK(ferry_device_alloc(dev, n, &p));
    char *h = malloc(n);
    ft_fill_pattern(h, n, seed);
    FT_ASSERT_OK(ferry_device_upload(dev, p, h, n));
    free(h);
    return p;
}
static long dev_check(ferry_device *dev, ferry_devptr p, size_t n, unsigned seed)
{
    char *h = malloc(n);
    FT_ASSERT_OK(ferry_device_download(dev, h, p, n));
    long r = ft_check_pattern(h, n, seed);
    free(h);
    return r;
}

static void odd_sizes_round_trip_buffered(void **state)
{
    env e = open_env((const char *)*state);
    ferry_file *f = open_file(e.io, "odd.bin", 0);
    size_t sizes[] = {1, 4095, SEG - 1, SEG, SEG + 1, 5 * SEG + 12345};
    for (size_t i = 0; i < FERRY__ARRAY_LEN(sizes); i++) {
        size_t n = sizes[i];
        ferry_devptr src = dev_pattern(e.dev, n, (unsigned)i + 1), dst = 0;
        FT_ASSERT_OK(ferry_device_alloc(e.dev, n, &dst));
        FT_ASSERT_OK(ferry_device_memset(e.dev, dst, 0, n));
        FT_ASSERT_OK(ferry_io_write_dev(e.io, f, NULL, src, n, 777));
        FT_ASSERT_OK(ferry_io_read_dev(e.io, f, NULL, dst, n, 777));
        assert_int_equal(dev_check(e.dev, dst, n, (unsigned)i + 1), -1);
        ferry_device_free(e.dev, src);
        ferry_device_free(e.dev, dst);
    }
    FT_ASSERT_OK(ferry_file_close(f));
    close_env(&e);
}

static void direct_tail_read_padded_write_refused(void **state)
{
    env e = open_env((const char *)*state);
    ferry_file *f = open_file(e.io, "direct.bin", FERRY_FILE_DIRECT);
    if (!ferry_file_is_direct(f)) {
        ferry_file_close(f);
        close_env(&e);
        skip();
    }
    size_t whole = 3 * SEG + 8192, n = 3 * SEG + 5000;
    ferry_devptr src = dev_pattern(e.dev, whole, 21), dst = 0;
    FT_ASSERT_OK(ferry_io_write_dev(e.io, f, NULL, src, whole, 0));
    /* a write whose length is not a multiple of 4096: refused, nothing written */
    assert_int_equal(ferry_io_write_dev(e.io, f, NULL, src, n, 0), FERRY_EALIGN);
    assert_msg_has(ferry_io_last_error(e.io), "direct.bin");
    assert_msg_has(ferry_io_last_error(e.io), "length");
    assert_int_equal(ferry_io_write_dev(e.io, f, NULL, src, 4096, 100), FERRY_EALIGN);
    assert_msg_has(ferry_io_last_error(e.io), "offset 100");
    /* a read with an unaligned length: padded inside the bounce buffer */
    FT_ASSERT_OK(ferry_device_alloc(e.dev, whole, &dst));
    FT_ASSERT_OK(ferry_device_memset(e.dev, dst, 0xEE, whole));
    FT_ASSERT_OK(ferry_io_read_dev(e.io, f, NULL, dst, n, 0));
    assert_int_equal(dev_check(e.dev, dst, n, 21), -1);
    char tail[16];
    FT_ASSERT_OK(ferry_device_download(e.dev, tail, dst + n, sizeof tail));
    for (size_t i = 0; i < sizeof tail; i++)
        assert_int_equal((unsigned char)tail[i], 0xEE); /* nothing past len written */
    /* the file ends inside the padding: still fine */
    FT_ASSERT_OK(ferry_file_truncate(f, n));
    FT_ASSERT_OK(ferry_device_memset(e.dev, dst, 0, whole));
    FT_ASSERT_OK(ferry_io_read_dev(e.io, f, NULL, dst, n, 0));
    assert_int_equal(dev_check(e.dev, dst, n, 21), -1);
    /* ... but not when the requested bytes themselves lie past the end */
    assert_int_equal(ferry_io_read_dev(e.io, f, NULL, dst, n + 100, 0), FERRY_ESHORT);
    assert_msg_has(ferry_io_last_error(e.io), "end of file");
    assert_int_equal(ferry_io_read_dev(e.io, f, NULL, dst, 4096, 4000), FERRY_EALIGN);
    ferry_device_free(e.dev, src);
    ferry_device_free(e.dev, dst);
    FT_ASSERT_OK(ferry_file_close(f));
    close_env(&e);
}

static void device_copy_faults_surface(void **state)
{
    env e = open_env((const char *)*state);
    ferry_file *f = open_file(e.io, "devfault.bin", 0);
    size_t n = 4 * SEG + 100;
    ferry_devptr src = dev_pattern(e.dev, n, 5), dst = 0;
    FT_ASSERT_OK(ferry_device_alloc(e.dev, n, &dst));
    ferry_stream *s = NULL;
    FT_ASSERT_OK(ferry_stream_create(e.dev, &s));
    /* the third copy fails */
    FT_ASSERT_OK(ft_device_faults(e.dev, 3, 0, 0, FERRY_FAULT_COPY));
    assert_int_equal(ferry_io_write_dev(e.io, f, s, src, n, 0), FERRY_EINJECTED);
    assert_msg_has(ferry_io_last_error(e.io), "devfault.bin");
    assert_msg_has(ferry_io_last_error(e.io), "device copy");
    FT_ASSERT_OK(ft_device_faults(e.dev, 0, 0, 0, 0));
    FT_ASSERT_OK(ferry_io_write_dev(e.io, f, s, src, n, 0)); /* retry works */
    FT_ASSERT_OK(ft_device_faults(e.dev, 2, 0, 0, FERRY_FAULT_COPY));
    assert_int_equal(ferry_io_read_dev(e.io, f, s, dst, n, 0), FERRY_EINJECTED);
    /* short copies */
    FT_ASSERT_OK(ft_device_faults(e.dev, 0, 0, 100, 0));
    assert_int_equal(ferry_io_read_dev(e.io, f, NULL, dst, n, 0), FERRY_ESHORT);
    FT_ASSERT_OK(ft_device_faults(e.dev, 0, 0, 0, 0));
    FT_ASSERT_OK(ferry_io_read_dev(e.io, f, s, dst, n, 0));
    assert_int_equal(dev_check(e.dev, dst, n, 5), -1);
    FT_ASSERT_OK(ferry_stream_destroy(s));
    ferry_device_free(e.dev, src);
    ferry_device_free(e.dev, dst);
    FT_ASSERT_OK(ferry_file_close(f));
    close_env(&e);
}

static void file_faults_surface(void **state)
{
    seam_install();
    env e = open_env((const char *)*state);
    ferry_file *f = open_file(e.io, "filefault.bin", 0);
    size_t n = 3 * SEG;
    ferry_devptr src = dev_pattern(e.dev, n, 17), dst = 0;
    FT_ASSERT_OK(ferry_device_alloc(e.dev, n, &dst));
    if (!strcmp((const char *)*state, "posix")) {
        atomic_store(&g_fail_write_at, 2);
        assert_int_equal(ferry_io_write_dev(e.io, f, NULL, src, n, 0), -EIO);
        assert_msg_has(ferry_io_last_error(e.io), "filefault.bin");
        assert_msg_has(ferry_io_last_error(e.io), "EIO");
        atomic_store(&g_fail_write_at, 0);
    }
    FT_ASSERT_OK(ferry_io_write_dev(e.io, f, NULL, src, n, 0));
    /* past the end of the file */
    assert_int_equal(ferry_io_read_dev(e.io, f, NULL, dst, n, SEG), FERRY_ESHORT);
    FT_ASSERT_OK(ferry_io_read_dev(e.io, f, NULL, dst, n, 0));
    assert_int_equal(dev_check(e.dev, dst, n, 17), -1);
    ferry_device_free(e.dev, src);
    ferry_device_free(e.dev, dst);
    FT_ASSERT_OK(ferry_file_close(f));
    close_env(&e);
    ferry__sys_set(NULL);
}

/* The read path reads segment 1 from the file while the device copy of
 * segment 0 is still queued: hold the stream, and release it only once the
 * second segment's file read happened. Without overlap the read of segment
 * 1 would wait for the held copy; the helper then gives up after a long
 * grace period (a failsafe against hanging, not a timing assertion) and
 * the test fails on the flag. */
typedef struct holder {
    ferry_stream *s;
    unsigned want_reads;
    int overlapped;
} holder;
static void *release_after_reads(void *arg)
{
    holder *h = arg;
    for (int i = 0; i < 20000; i++) { /* up to 20 s */
        if (atomic_load(&g_preads) >= h->want_reads) {
            h->overlapped = 1;
            break;
        }
        usleep(1000);
    }
    ferry__device_host_hold(h->s, 0);
    return NULL;
}

static void read_overlaps_file_io_with_device_copy(void **state)
{
    env e = open_env("posix");
    (void)state;
    ferry_file *f = open_file(e.io, "overlap.bin", 0);
    size_t n = 2 * SEG;
    ferry_devptr src = dev_pattern(e.dev, n, 31), dst = 0;
    FT_ASSERT_OK(ferry_device_alloc(e.dev, n, &dst));
    FT_ASSERT_OK(ferry_io_write_dev(e.io, f, NULL, src, n, 0));
    ferry_stream *s = NULL;
    FT_ASSERT_OK(ferry_stream_create(e.dev, &s));
    seam_install();
    /* each segment of 64 KiB is one pread at depth 4 (pieces >= 128 KiB) */
    FT_ASSERT_OK(ferry__device_host_hold(s, 1));
    holder h = {s, 2, 0};
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, release_after_reads, &h), 0);
    FT_ASSERT_OK(ferry_io_read_dev(e.io, f, s, dst, n, 0));
    pthread_join(t, NULL);
    assert_true(h.overlapped);
    assert_int_equal(atomic_load(&g_preads), 2);
    assert_int_equal(dev_check(e.dev, dst, n, 31), -1);
    ferry__sys_set(NULL);
    FT_ASSERT_OK(ferry_stream_destroy(s));
    ferry_device_free(e.dev, src);
    ferry_device_free(e.dev, dst);
    FT_ASSERT_OK(ferry_file_close(f));
    close_env(&e);
}

/* The write path copies segment 1 out of the device while segment 0 is
 * being written: the first file write of segment 0 is held in the seam
 * until bounce buffer 1 holds segment 1's bytes. Without overlap the copy
 * of segment 1 would only start after that write returned; the hold then
 * gives up after a long grace period (a failsafe, not a timing assertion)
 * and the test fails on the flag. Reading the buffer while the stream
 * worker fills it is a deliberate (benign) race, so TSan builds skip. */
static ferry_io *g_wio;
static const unsigned char *g_want; /* segment 1's first bytes */
static atomic_int g_w_overlapped, g_w_held;
static ssize_t hold_first_write(int fd, const void *b, size_t n, off_t o)
{
    if (o == 0 && !atomic_exchange(&g_w_held, 1)) {
        const unsigned char *b1 = ferry__bounce_buffer(g_wio, 1);
        for (int i = 0; i < 20000 && b1; i++) { /* up to 20 s */
            if (memcmp(b1, g_want, 64) == 0) {
                atomic_store(&g_w_overlapped, 1);
                break;
            }
            usleep(1000);
        }
    }
    return ferry__sys_default()->pwrite(fd, b, n, o);
}

static void write_overlaps_device_copy_with_file_io(void **state)
{
    (void)state;
    if (FT_UNDER_TSAN)
        skip();
    env e = open_env("posix");
    g_wio = e.io;
    ferry_file *f = open_file(e.io, "woverlap.bin", 0);
    size_t n = 3 * SEG;
    ferry_devptr src = dev_pattern(e.dev, n, 41);
    unsigned char want[64];
    ft_fill_pattern(want, sizeof want, 41 + SEG);
    g_want = want;
    atomic_store(&g_w_overlapped, 0);
    atomic_store(&g_w_held, 0);
    g_table = *ferry__sys_default();
    g_table.pwrite = hold_first_write;
    ferry__sys_set(&g_table);
    FT_ASSERT_OK(ferry_io_write_dev(e.io, f, NULL, src, n, 0));
    ferry__sys_set(NULL);
    assert_true(atomic_load(&g_w_held));
    assert_true(atomic_load(&g_w_overlapped));
    ferry_devptr back = 0;
    FT_ASSERT_OK(ferry_device_alloc(e.dev, n, &back));
    FT_ASSERT_OK(ferry_io_read_dev(e.io, f, NULL, back, n, 0));
    assert_int_equal(dev_check(e.dev, back, n, 41), -1);
    ferry_device_free(e.dev, src);
    ferry_device_free(e.dev, back);
    FT_ASSERT_OK(ferry_file_close(f));
    close_env(&e);
}

static void no_device_and_bad_arguments(void **state)
{
    (void)state;
    ferry_io_options o = FERRY_IO_OPTIONS_INIT;
    o.engine = "posix";
    ferry_io *io = NULL;
    FT_ASSERT_OK(ferry_io_open(&o, &io));
    ferry_file *f = open_file(io, "nodev.bin", 0);
    assert_int_equal(ferry_io_read_dev(io, f, NULL, 0x1000, 4096, 0), -EINVAL);
    assert_msg_has(ferry_io_last_error(io), "no device");
    assert_int_equal(ferry_io_read_dev(io, f, NULL, 0, 4096, 0), -EINVAL);
    assert_int_equal(ferry_io_write_dev(io, f, NULL, 0x1000, 0, 0), -EINVAL);
    assert_msg_has(ferry_io_last_error(io), "zero length");
    assert_int_equal(ferry_io_write_dev(io, NULL, NULL, 0x1000, 10, 0), -EINVAL);
    assert_int_equal(ferry_io_write_dev(NULL, f, NULL, 0x1000, 10, 0), -EINVAL);
    FT_ASSERT_OK(ferry_file_close(f));
    ferry_io_close(io);
}

/* one run: the engine, file and source made with the allocator paused
 * (every block still through it), the write with allocation n failing */
static int oom_bounce_run(void *ctx)
{
    (void)ctx;
    ft_oom_pause();
    env e = open_env("posix");
    ferry_file *f = open_file(e.io, "oom.bin", 0);
    ferry_devptr src = dev_pattern(e.dev, 2 * SEG, 3);
    ft_oom_resume();
    int rc = ferry_io_write_dev(e.io, f, NULL, src, 2 * SEG, 0);
    ft_oom_pause();
    ferry_device_free(e.dev, src);
    ferry_file_close(f);
    close_env(&e);
    return rc; /* everything allocated, before and during the write, freed */
}

static void oom_in_bounce_setup_without_leaks(void **state)
{
    (void)state;
    ft_oom_each(100, FT_OOM_STICKY, oom_bounce_run, NULL);
}

static int setup(void **state)
{
    (void)state;
    ft_tmpdir(g_dir, sizeof g_dir);
    return g_dir[0] ? 0 : -1;
}
static int teardown(void **state)
{
    (void)state;
    ferry__sys_set(NULL);
    ft_rmtree(g_dir);
    return 0;
}

#define PER_ENGINE(fn)                                                                  \
    cmocka_unit_test_prestate(fn, "posix"), cmocka_unit_test_prestate(fn, "uring")

int main(void)
{
    const struct CMUnitTest tests[] = {
        PER_ENGINE(odd_sizes_round_trip_buffered),
        PER_ENGINE(direct_tail_read_padded_write_refused),
        PER_ENGINE(device_copy_faults_surface),
        PER_ENGINE(file_faults_surface),
        cmocka_unit_test(read_overlaps_file_io_with_device_copy),
        cmocka_unit_test(write_overlaps_device_copy_with_file_io),
        cmocka_unit_test(no_device_and_bad_arguments),
        cmocka_unit_test(oom_in_bounce_setup_without_leaks),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
