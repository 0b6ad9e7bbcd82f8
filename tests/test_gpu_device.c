/*
 * test_gpu_device.c - the cuda backend on a real GPU: a 64 MiB round trip
 * host -> device -> device -> host through pinned memory with events and
 * their elapsed times, a cross-stream wait, the synchronous helpers, and
 * the real driver's errors (out of memory, unknown pointers). Exits 77
 * (skipped) where no CUDA driver or device is present.
 */
/* ferry-test-labels: gpu */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry_test.h"

#define MIB (1024u * 1024u)

static ferry_device *open_cuda(void)
{
    ferry_device_options o = FERRY_DEVICE_OPTIONS_INIT;
    o.backend = "cuda";
    ferry_device *dev = NULL;
    FT_ASSERT_OK(ferry_device_open(&o, &dev));
    return dev;
}

static void roundtrip_64mib_with_events(void **state)
{
    (void)state;
    ferry_device *dev = open_cuda();
    const size_t n = 64 * MIB;
    unsigned char *src = NULL, *dst = NULL;
    FT_ASSERT_OK(ferry_device_host_alloc(dev, n, (void **)&src));
    FT_ASSERT_OK(ferry_device_host_alloc(dev, n, (void **)&dst));
    ft_fill_pattern(src, n, 29);
    memset(dst, 0, n);
    ferry_devptr a = 0, b = 0;
    FT_ASSERT_OK(ferry_device_alloc(dev, n, &a));
    FT_ASSERT_OK(ferry_device_alloc(dev, n, &b));
    assert_true(a % 256 == 0 && b % 256 == 0);
    ferry_stream *s = NULL;
    FT_ASSERT_OK(ferry_stream_create(dev, &s));
    assert_true(ferry_stream_handle(s) != 0);
    ferry_event *ev[4];
    for (int i = 0; i < 4; i++)
        FT_ASSERT_OK(ferry_event_create(dev, &ev[i]));

    FT_ASSERT_OK(ferry_event_record(ev[0], s));
    FT_ASSERT_OK(ferry_memcpy_htod_async(s, a, src, n));
    FT_ASSERT_OK(ferry_event_record(ev[1], s));
    FT_ASSERT_OK(ferry_memcpy_dtod_async(s, b, a, n));
    FT_ASSERT_OK(ferry_event_record(ev[2], s));
    FT_ASSERT_OK(ferry_memcpy_dtoh_async(s, dst, b, n));
    FT_ASSERT_OK(ferry_event_record(ev[3], s));
    FT_ASSERT_OK(ferry_event_sync(ev[3]));
    for (int i = 0; i < 4; i++)
        assert_int_equal(ferry_event_query(ev[i]), 0);
    assert_int_equal(ft_check_pattern(dst, n, 29), -1);

    const char *leg[3] = {"htod", "dtod", "dtoh"};
    for (int i = 0; i < 3; i++) {
        float ms = -1;
        FT_ASSERT_OK(ferry_event_elapsed_ms(ev[i], ev[i + 1], &ms));
        assert_true(ms > 0.0f);
        /* dtod reads and writes n bytes; report the copy rate as the driver sees it */
        printf("# %s %s 64 MiB: %.3f ms, %.1f GB/s\n", ferry_device_name(dev), leg[i], ms,
               (double)n / (ms * 1e6));
    }
    float total = 0;
    FT_ASSERT_OK(ferry_event_elapsed_ms(ev[0], ev[3], &total));
    assert_true(total > 0.0f);

    for (int i = 0; i < 4; i++)
        ferry_event_destroy(ev[i]);
    FT_ASSERT_OK(ferry_stream_destroy(s));
    FT_ASSERT_OK(ferry_device_free(dev, a));
    FT_ASSERT_OK(ferry_device_free(dev, b));
    FT_ASSERT_OK(ferry_device_host_free(dev, src));
    FT_ASSERT_OK(ferry_device_host_free(dev, dst));
    ferry_device_close(dev);
}

static void cross_stream_wait_and_helpers(void **state)
{
    (void)state;
    ferry_device *dev = open_cuda();
    const size_t n = 16 * MIB;
    unsigned char *src = malloc(n), *dst = malloc(n);
    ft_fill_pattern(src, n, 7);
    FT_ASSERT_OK(ferry_device_pin(dev, src, n));
    FT_ASSERT_OK(ferry_device_pin(dev, dst, n));
    ferry_devptr a = 0;
    FT_ASSERT_OK(ferry_device_alloc(dev, n, &a));
    FT_ASSERT_OK(ferry_device_memset(dev, a, 0, n));
    ferry_stream *s1 = NULL, *s2 = NULL;
    FT_ASSERT_OK(ferry_stream_create(dev, &s1));
    FT_ASSERT_OK(ferry_stream_create(dev, &s2));
    ferry_event *e = NULL;
    FT_ASSERT_OK(ferry_event_create(dev, &e));
    FT_ASSERT_OK(ferry_memcpy_htod_async(s1, a, src, n));
    FT_ASSERT_OK(ferry_event_record(e, s1));
    FT_ASSERT_OK(ferry_stream_wait_event(s2, e));
    FT_ASSERT_OK(ferry_memcpy_dtoh_async(s2, dst, a, n));
    FT_ASSERT_OK(ferry_stream_sync(s2));
    assert_int_equal(ft_check_pattern(dst, n, 7), -1);

    FT_ASSERT_OK(ferry_device_memset(dev, a + 4096, 0xcd, 8192));
    FT_ASSERT_OK(ferry_device_download(dev, dst, a, 3 * 4096));
    assert_int_equal(dst[4095], src[4095]);
    assert_int_equal(dst[4096], 0xcd);
    assert_int_equal(dst[3 * 4096 - 1], 0xcd);
    ft_fill_pattern(src, n, 8);
    FT_ASSERT_OK(ferry_device_upload(dev, a, src, n));
    FT_ASSERT_OK(ferry_device_download(dev, dst, a, n));
    assert_int_equal(ft_check_pattern(dst, n, 8), -1);

    ferry_event_destroy(e);
    FT_ASSERT_OK(ferry_stream_destroy(s1));
    FT_ASSERT_OK(ferry_stream_destroy(s2));
    FT_ASSERT_OK(ferry_device_unpin(dev, src));
    FT_ASSERT_OK(ferry_device_unpin(dev, dst));
    FT_ASSERT_OK(ferry_device_free(dev, a));
    ferry_device_close(dev);
    free(src);
    free(dst);
}

static void real_driver_errors(void **state)
{
    (void)state;
    ferry_device *dev = open_cuda();
    ferry_devptr p = 5;
    assert_int_equal(ferry_device_alloc(dev, (size_t)1 << 50, &p), -ENOMEM);
    assert_int_equal(p, 5);
    if (!strstr(ferry_device_last_error(dev), "CUDA_ERROR_OUT_OF_MEMORY"))
        fail_msg("message: %s", ferry_device_last_error(dev));
    assert_int_equal(ferry_device_free(dev, 0x1000), -EINVAL);
    char buf[8192];
    FT_ASSERT_OK(ferry_device_pin(dev, buf, sizeof buf));
    assert_int_equal(ferry_device_pin(dev, buf, sizeof buf), FERRY_EEXIST);
    FT_ASSERT_OK(ferry_device_unpin(dev, buf));
    ferry_device_close(dev);
}

int main(void)
{
    const char *why = NULL;
    if (!ferry_device_backend_available("cuda", &why)) {
        printf("skipped: cuda unusable here: %s\n", why);
        return 77;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(roundtrip_64mib_with_events),
        cmocka_unit_test(cross_stream_wait_and_helpers),
        cmocka_unit_test(real_driver_errors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
