/*
 * test_gpu_io.c - real GPU memory through the I/O engines: the CPU bounce
 * path with the cuda device backend, and GPUDirect Storage through the
 * real libcufile.so.0 (batch API and stream-async), byte for byte.
 * Skipped (exit 77) where no CUDA driver and device are present; the
 * cuFile test skips on its own where libcufile is missing.
 */
/* ferry-test-labels: gpu */
/* ferry-test-timeout: 600 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry_test.h"

static char g_dir[256];

static ferry_device *open_cuda(void)
{
    ferry_device_options d = FERRY_DEVICE_OPTIONS_INIT;
    d.backend = "cuda";
    ferry_device *dev = NULL;
    FT_ASSERT_OK(ferry_device_open(&d, &dev));
    return dev;
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

static void round_trips(ferry_device *dev, ferry_io *io, const char *name)
{
    char path[512];
    snprintf(path, sizeof path, "%s/%s", g_dir, name);
    ferry_file *f = NULL;
    FT_ASSERT_OK(ferry_file_open(io, path, FERRY_FILE_READ | FERRY_FILE_WRITE | FERRY_FILE_CREATE |
                                               FERRY_FILE_TRUNC | FERRY_FILE_DIRECT, &f));
    if (ferry_file_fallback_reason(f))
        fprintf(stderr, "note: %s: %s\n", path, ferry_file_fallback_reason(f));
    ferry_stream *s = NULL;
    FT_ASSERT_OK(ferry_stream_create(dev, &s));
    size_t sizes[] = {4096, (size_t)40 << 20, ((size_t)24 << 20) + 8192};
    for (size_t i = 0; i < 3; i++) {
        size_t n = sizes[i];
        ferry_devptr src = dev_pattern(dev, n, (unsigned)i + 3), dst = 0;
        FT_ASSERT_OK(ferry_device_alloc(dev, n, &dst));
        FT_ASSERT_OK(ferry_io_register_dev(io, src, n));
        /* without a stream (batch API on cufile), then on a stream */
        FT_ASSERT_OK(ferry_io_write_dev(io, f, NULL, src, n, 0));
        FT_ASSERT_OK(ferry_device_memset(dev, dst, 0, n));
        FT_ASSERT_OK(ferry_io_read_dev(io, f, NULL, dst, n, 0));
        assert_int_equal(dev_check(dev, dst, n, (unsigned)i + 3), -1);
        FT_ASSERT_OK(ferry_io_write_dev(io, f, s, src, n, n));
        FT_ASSERT_OK(ferry_device_memset(dev, dst, 0, n));
        FT_ASSERT_OK(ferry_io_read_dev(io, f, s, dst, n, n));
        assert_int_equal(dev_check(dev, dst, n, (unsigned)i + 3), -1);
        FT_ASSERT_OK(ferry_io_unregister_dev(io, src));
        ferry_device_free(dev, src);
        ferry_device_free(dev, dst);
    }
    FT_ASSERT_OK(ferry_stream_destroy(s));
    FT_ASSERT_OK(ferry_file_close(f));
}

static void bounce_path_with_cuda(void **state)
{
    (void)state;
    ferry_device *dev = open_cuda();
    ferry_io_options o = FERRY_IO_OPTIONS_INIT;
    o.engine = "posix";
    o.device = dev;
    o.bounce_bytes = 4 << 20;
    ferry_io *io = NULL;
    FT_ASSERT_OK(ferry_io_open(&o, &io));
    round_trips(dev, io, "bounce.bin");
    /* pinned buffers from the cuda device serve host I/O too */
    void *b = NULL;
    FT_ASSERT_OK(ferry_io_buffer_alloc(io, 1 << 20, &b));
    ferry_io_buffer_free(io, b);
    ferry_io_close(io);
    ferry_device_close(dev);
}

static void cufile_round_trip(void **state)
{
    (void)state;
    char why[512];
    if (ferry_io_engine_probe("cufile", NULL, why, sizeof why) != 0) {
        fprintf(stderr, "cufile skipped: %s\n", why);
        skip();
    }
    ferry_device *dev = open_cuda();
    ferry_io_options o = FERRY_IO_OPTIONS_INIT;
    o.device = dev; /* auto picks cufile with a cuda device and cuFile */
    ferry_io *io = NULL;
    FT_ASSERT_OK(ferry_io_open(&o, &io));
    assert_string_equal(ferry_io_engine(io), "cufile");
    round_trips(dev, io, "gds.bin");
    ferry_io_close(io);
    ferry_device_close(dev);
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
    ft_rmtree(g_dir);
    return 0;
}

int main(void)
{
    const char *why = NULL;
    if (!ferry_device_backend_available("cuda", &why)) {
        fprintf(stderr, "test_gpu_io: skipped: %s\n", why ? why : "no cuda");
        return 77;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(bounce_path_with_cuda),
        cmocka_unit_test(cufile_round_trip),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
