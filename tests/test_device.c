/*
 * test_device.c - the device front and the host backend: allocation
 * tables and bad pointers, pinned memory, copies, streams and events
 * (asynchrony and cross-stream ordering observed deterministically through
 * the hold seam), fault injection, allocation-hook out-of-memory, and use
 * from several threads.
 */
/* ferry-test-labels: concurrent */
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "device/device_impl.h"
#include "ferry_test.h"

static ferry_device *open_host(void)
{
    ferry_device_options o = FERRY_DEVICE_OPTIONS_INIT;
    o.backend = "host";
    ferry_device *dev = NULL;
    FT_ASSERT_OK(ferry_device_open(&o, &dev));
    assert_non_null(dev);
    return dev;
}

static void assert_msg_has(const char *msg, const char *needle)
{
    if (!strstr(msg, needle))
        fail_msg("message '%s' does not contain '%s'", msg, needle);
}

/* ---- open, names, selection ---- */

static void open_host_names_and_null_close(void **state)
{
    (void)state;
    ferry_device *dev = open_host();
    assert_string_equal(ferry_device_backend(dev), "host");
    assert_string_equal(ferry_device_name(dev), "host (simulated)");
    assert_string_equal(ferry_device_last_error(dev), "");
    ferry_device_close(dev);
    ferry_device_close(NULL);
    assert_int_equal(ferry_stream_destroy(NULL), 0);
    ferry_event_destroy(NULL);
}

static void open_rejects_bad_arguments(void **state)
{
    (void)state;
    ferry_device *dev = (ferry_device *)0x1;
    ferry_device_options o = FERRY_DEVICE_OPTIONS_INIT;
    assert_int_equal(ferry_device_open(&o, NULL), -EINVAL);
    o.backend = "tpu";
    assert_int_equal(ferry_device_open(&o, &dev), -EINVAL);
    assert_msg_has(ferry_last_error(), "unknown backend 'tpu'");
    assert_ptr_equal(dev, (ferry_device *)0x1); /* untouched on failure */
    o.backend = "host";
    o.size = 8;
    assert_int_equal(ferry_device_open(&o, &dev), -EINVAL);
    assert_msg_has(ferry_last_error(), "options size 8");
    o.size = sizeof o;
    o.ordinal = -1;
    assert_int_equal(ferry_device_open(&o, &dev), -EINVAL);
}

static void auto_follows_env_and_availability(void **state)
{
    (void)state;
    const char *why = "x";
    assert_true(ferry_device_backend_available("host", &why));
    assert_string_equal(why, "");
    assert_true(ferry_device_backend_available("auto", NULL));
    assert_false(ferry_device_backend_available("tpu", &why));
    assert_msg_has(why, "unknown");
    int cuda = ferry_device_backend_available("cuda", &why);
    if (!cuda)
        assert_true(strlen(why) > 0);

    setenv("FERRY_DEVICE", "host", 1);
    ferry_device *dev = NULL;
    FT_ASSERT_OK(ferry_device_open(NULL, &dev)); /* NULL options = auto */
    assert_string_equal(ferry_device_backend(dev), "host");
    ferry_device_close(dev);
    /* an explicit backend is not overridden by the environment */
    setenv("FERRY_DEVICE", "bogus", 1);
    dev = open_host();
    ferry_device_close(dev);
    assert_int_equal(ferry_device_open(NULL, &dev), -EINVAL);
    assert_msg_has(ferry_last_error(), "env FERRY_DEVICE");
    unsetenv("FERRY_DEVICE");
    /* auto without env: cuda where it opens, host otherwise */
    FT_ASSERT_OK(ferry_device_open(NULL, &dev));
    assert_string_equal(ferry_device_backend(dev), cuda ? "cuda" : "host");
    ferry_device_close(dev);
}

/* ---- memory ---- */

static void open_range_checks_every_option(void **state)
{
    (void)state;
    /* the field each case below spoils */
    static const char *const field[] = {"backend", "ordinal", "ordinal"};
    for (size_t i = 0; i < FERRY__ARRAY_LEN(field); i++) {
        ferry_device_options o = FERRY_DEVICE_OPTIONS_INIT;
        o.backend = "host";
        switch (i) {
        case 0: o.backend = ""; break;
        case 1: o.ordinal = -1; break;
        default: o.ordinal = INT_MIN; break;
        }
        ferry_device *dev = (ferry_device *)0x1;
        assert_int_equal(ferry_device_open(&o, &dev), -EINVAL);
        assert_ptr_equal(dev, (ferry_device *)0x1);
        assert_msg_has(ferry_last_error(), field[i]);
        assert_msg_has(ferry_last_error(), "accepted");
    }
    /* every value of the fields that have no range is taken, and the
     * hostile sizes fail cleanly later instead of wrapping */
    ferry_device_options o = FERRY_DEVICE_OPTIONS_INIT;
    o.backend = "host";
    o.mem_limit = UINT64_MAX;
    ferry_device *dev = NULL;
    FT_ASSERT_OK(ferry_device_open(&o, &dev));
    /* the test faults (ferry/testctl.h) are range-checked the same way */
    static const char *const ffield[] = {"fail_code", "fail_code", "fault_mask", "fault_mask"};
    for (size_t i = 0; i < FERRY__ARRAY_LEN(ffield); i++) {
        ferry_device_faults f = FERRY_DEVICE_FAULTS_INIT;
        switch (i) {
        case 0: f.fail_code = 1; break;
        case 1: f.fail_code = INT_MAX; break;
        case 2: f.fault_mask = 1u << 4; break;
        default: f.fault_mask = UINT_MAX; break;
        }
        assert_int_equal(ferry_test_control(FERRY_TEST_DEVICE_FAULTS, dev, &f), -EINVAL);
        assert_msg_has(ferry_last_error(), ffield[i]);
        assert_msg_has(ferry_last_error(), "accepted");
    }
    FT_ASSERT_OK(ft_device_faults(dev, UINT64_MAX, INT_MIN, SIZE_MAX,
                                  FERRY_FAULT_ALLOC | FERRY_FAULT_COPY | FERRY_FAULT_SYNC |
                                      FERRY_FAULT_EVENT));
    ferry_devptr p = 0;
    assert_int_equal(ferry_device_alloc(dev, SIZE_MAX, &p), -ENOMEM);
    void *h = NULL;
    assert_int_equal(ferry_device_host_alloc(dev, SIZE_MAX, &h), -ENOMEM);
    char byte = 0;
    assert_int_equal(ferry_device_pin(dev, &byte, SIZE_MAX), -EINVAL);
    FT_ASSERT_OK(ferry_device_alloc(dev, 4096, &p));
    assert_int_equal(ferry_device_memset(dev, p, 0, SIZE_MAX), FERRY_EBOUNDS);
    assert_int_equal(ferry_device_upload(dev, p + 4095, &byte, SIZE_MAX), FERRY_EBOUNDS);

    /* set_faults has the same ranges */
    assert_int_equal(ft_device_faults(dev, 1, 0, 0, 1u << 31), -EINVAL);
    assert_msg_has(ferry_device_last_error(dev), "fault_mask");
    assert_int_equal(ft_device_faults(dev, 1, 5, 0, 0), -EINVAL);
    assert_msg_has(ferry_device_last_error(dev), "fail_code");
    FT_ASSERT_OK(ft_device_faults(dev, 0, 0, 0, 0));
    FT_ASSERT_OK(ferry_device_free(dev, p));
    ferry_device_close(dev);
}

static void alloc_free_and_bad_pointers(void **state)
{
    (void)state;
    ferry_device *dev = open_host();
    ferry_devptr p = 7, q = 0;
    assert_int_equal(ferry_device_alloc(dev, 0, &p), -EINVAL);
    assert_int_equal(p, 7);
    assert_int_equal(ferry_device_alloc(NULL, 64, &p), -EINVAL);
    assert_int_equal(ferry_device_alloc(dev, 64, NULL), -EINVAL);
    FT_ASSERT_OK(ferry_device_alloc(dev, 1000, &p));
    FT_ASSERT_OK(ferry_device_alloc(dev, 3, &q));
    assert_true(p % 256 == 0 && q % 256 == 0);
    assert_true(p != q);
    assert_ptr_equal(ferry_devptr_host(dev, p), (void *)(uintptr_t)p);
    assert_null(ferry_devptr_host(dev, 12345));

    assert_int_equal(ferry_device_free(dev, p + 8), -EINVAL);
    assert_msg_has(ferry_device_last_error(dev), "interior pointer (+8)");
    assert_int_equal(ferry_device_free(dev, 0x10), -EINVAL);
    assert_msg_has(ferry_device_last_error(dev), "not a live allocation");
    FT_ASSERT_OK(ferry_device_free(dev, p));
    assert_int_equal(ferry_device_free(dev, p), -EINVAL); /* double free */
    assert_msg_has(ferry_device_last_error(dev), "already freed");
    assert_string_equal(ferry_last_error(), ferry_device_last_error(dev));
    FT_ASSERT_OK(ferry_device_free(dev, q));
    ferry_device_close(dev);
}

/* an older header's options (a prefix) open with the defaults past it; a
 * size below the minimum, or ending inside a member, is refused */
static void older_options_prefix_is_accepted(void **state)
{
    (void)state;
    ferry_device_options o = FERRY_DEVICE_OPTIONS_INIT;
    o.backend = "host";
    o.mem_limit = 1; /* past the prefix: not read (else every alloc fails) */
    o.size = FERRY_DEVICE_OPTIONS_MIN_SIZE;
    ferry_device *dev = NULL;
    FT_ASSERT_OK(ferry_device_open(&o, &dev));
    ferry_devptr p = 0;
    FT_ASSERT_OK(ferry_device_alloc(dev, 1 << 20, &p));
    FT_ASSERT_OK(ferry_device_free(dev, p));
    ferry_device_close(dev);
    dev = (ferry_device *)0x1;
    o.size = FERRY_DEVICE_OPTIONS_MIN_SIZE - 1;
    assert_int_equal(ferry_device_open(&o, &dev), -EINVAL);
    assert_msg_has(ferry_last_error(), "FERRY_DEVICE_OPTIONS_MIN_SIZE");
    o.size = offsetof(ferry_device_options, mem_limit) + 4;
    assert_int_equal(ferry_device_open(&o, &dev), -EINVAL);
    assert_msg_has(ferry_last_error(), "inside mem_limit");
    o.size = sizeof o + 8; /* a newer header's: its members would be ignored */
    assert_int_equal(ferry_device_open(&o, &dev), -EINVAL);
    assert_ptr_equal(dev, (ferry_device *)0x1);
}

static void mem_limit_caps_device_bytes(void **state)
{
    (void)state;
    ferry_device_options o = FERRY_DEVICE_OPTIONS_INIT;
    o.backend = "host";
    o.mem_limit = 1 << 20;
    ferry_device *dev = NULL;
    FT_ASSERT_OK(ferry_device_open(&o, &dev));
    ferry_devptr a = 0, b = 0, c = 0;
    FT_ASSERT_OK(ferry_device_alloc(dev, 768 << 10, &a));
    assert_int_equal(ferry_device_alloc(dev, 512 << 10, &b), -ENOMEM);
    assert_msg_has(ferry_device_last_error(dev), "out of device memory");
    FT_ASSERT_OK(ferry_device_alloc(dev, 256 << 10, &b));
    FT_ASSERT_OK(ferry_device_free(dev, a));
    FT_ASSERT_OK(ferry_device_alloc(dev, 512 << 10, &c));
    ferry_device_close(dev); /* frees b and c */
}

static void pinned_memory_and_pin_tables(void **state)
{
    (void)state;
    ferry_device *dev = open_host();
    long page = sysconf(_SC_PAGESIZE);
    void *h = NULL;
    assert_int_equal(ferry_device_host_alloc(dev, 0, &h), -EINVAL);
    FT_ASSERT_OK(ferry_device_host_alloc(dev, 10000, &h));
    assert_true((uintptr_t)h % (uintptr_t)page == 0);
    memset(h, 0x5a, 10000);
    int x;
    assert_int_equal(ferry_device_host_free(dev, &x), -EINVAL);
    assert_int_equal(ferry_device_host_free(dev, (char *)h + 1), -EINVAL);
    assert_msg_has(ferry_device_last_error(dev), "interior pointer");
    /* pinned allocations cannot be pinned again or unpinned */
    assert_int_equal(ferry_device_pin(dev, (char *)h + 4096, 100), FERRY_EEXIST);
    assert_int_equal(ferry_device_unpin(dev, h), -EINVAL);
    assert_msg_has(ferry_device_last_error(dev), "pinned host allocation, not a pinned range");

    char *buf = malloc(1 << 16);
    assert_int_equal(ferry_device_pin(dev, buf, 0), -EINVAL);
    assert_int_equal(ferry_device_pin(dev, NULL, 10), -EINVAL);
    FT_ASSERT_OK(ferry_device_pin(dev, buf, 1 << 15));
    assert_int_equal(ferry_device_pin(dev, buf + 100, 10), FERRY_EEXIST);
    assert_msg_has(ferry_device_last_error(dev), "overlaps pinned range");
    FT_ASSERT_OK(ferry_device_pin(dev, buf + (1 << 15), 1 << 15)); /* adjacent is fine */
    assert_int_equal(ferry_device_host_free(dev, buf), -EINVAL);
    FT_ASSERT_OK(ferry_device_unpin(dev, buf));
    assert_int_equal(ferry_device_unpin(dev, buf), -EINVAL);
    FT_ASSERT_OK(ferry_device_unpin(dev, buf + (1 << 15)));
    FT_ASSERT_OK(ferry_device_host_free(dev, h));
    assert_int_equal(ferry_device_host_free(dev, h), -EINVAL);
    ferry_device_close(dev);
    free(buf);
}

static void upload_download_memset_roundtrip(void **state)
{
    (void)state;
    ferry_device *dev = open_host();
    const size_t n = 1 << 20;
    unsigned char *src = malloc(n), *dst = malloc(n);
    ft_fill_pattern(src, n, 11);
    ferry_devptr a = 0, b = 0;
    FT_ASSERT_OK(ferry_device_alloc(dev, n, &a));
    FT_ASSERT_OK(ferry_device_alloc(dev, n, &b));
    FT_ASSERT_OK(ferry_device_upload(dev, a, src, n));
    ferry_stream *s = NULL;
    FT_ASSERT_OK(ferry_stream_create(dev, &s));
    FT_ASSERT_OK(ferry_memcpy_dtod_async(s, b, a, n));
    FT_ASSERT_OK(ferry_stream_sync(s));
    memset(dst, 0, n);
    FT_ASSERT_OK(ferry_device_download(dev, dst, b, n));
    assert_int_equal(ft_check_pattern(dst, n, 11), -1);

    FT_ASSERT_OK(ferry_device_memset(dev, b + 4096, 0xab, 100));
    FT_ASSERT_OK(ferry_device_download(dev, dst, b, 8192));
    assert_int_equal(dst[4095], src[4095]);
    assert_int_equal(dst[4096], 0xab);
    assert_int_equal(dst[4195], 0xab);
    assert_int_equal(dst[4196], src[4196]);
    /* zero-length copies are no-ops */
    assert_int_equal(ferry_device_upload(dev, a, src, 0), 0);
    assert_int_equal(ferry_memcpy_htod_async(s, a, src, 0), 0);
    FT_ASSERT_OK(ferry_stream_destroy(s));
    ferry_device_close(dev);
    free(src);
    free(dst);
}

static void copies_outside_allocations_are_refused(void **state)
{
    (void)state;
    ferry_device *dev = open_host();
    ferry_devptr a = 0;
    FT_ASSERT_OK(ferry_device_alloc(dev, 4096, &a));
    char buf[8192] = {0};
    ferry_stream *s = NULL;
    FT_ASSERT_OK(ferry_stream_create(dev, &s));
    assert_int_equal(ferry_memcpy_htod_async(s, a + 4000, buf, 200), FERRY_EBOUNDS);
    assert_msg_has(ferry_device_last_error(dev), "runs 104 bytes past the end");
    assert_int_equal(ferry_memcpy_dtoh_async(s, buf, a + 8192, 1), FERRY_EBOUNDS);
    assert_msg_has(ferry_device_last_error(dev), "not inside any live device allocation");
    assert_int_equal(ferry_memcpy_dtod_async(s, a, a + 1, 4096), FERRY_EBOUNDS);
    assert_int_equal(ferry_memcpy_htod_async(s, 0, buf, 1), -EINVAL);
    assert_int_equal(ferry_memcpy_htod_async(s, a, NULL, 1), -EINVAL);
    assert_int_equal(ferry_memcpy_dtoh_async(NULL, buf, a, 1), -EINVAL);
    assert_int_equal(ferry_device_upload(dev, a, buf, 4097), FERRY_EBOUNDS);
    assert_int_equal(ferry_device_memset(dev, a + 1, 0, 4096), FERRY_EBOUNDS);
    FT_ASSERT_OK(ferry_device_free(dev, a));
    /* freed memory is no longer a valid target */
    assert_int_equal(ferry_memcpy_htod_async(s, a, buf, 1), FERRY_EBOUNDS);
    FT_ASSERT_OK(ferry_stream_sync(s));
    FT_ASSERT_OK(ferry_stream_destroy(s));
    ferry_device_close(dev);
}

/* ---- streams and events ---- */

static void async_copies_and_cross_stream_order(void **state)
{
    (void)state;
    ferry_device *dev = open_host();
    const size_t n = 1 << 16;
    unsigned char *src = malloc(n), *out = calloc(1, n);
    ft_fill_pattern(src, n, 3);
    ferry_devptr a = 0;
    FT_ASSERT_OK(ferry_device_alloc(dev, n, &a));
    FT_ASSERT_OK(ferry_device_memset(dev, a, 0, n));
    ferry_stream *s1 = NULL, *s2 = NULL;
    FT_ASSERT_OK(ferry_stream_create(dev, &s1));
    FT_ASSERT_OK(ferry_stream_create(dev, &s2));
    assert_ptr_equal(ferry_stream_device(s1), dev);
    assert_true(ferry_stream_handle(s1) != 0 && ferry_stream_handle(s1) != ferry_stream_handle(s2));
    ferry_event *e1 = NULL, *e2 = NULL;
    FT_ASSERT_OK(ferry_event_create(dev, &e1));
    FT_ASSERT_OK(ferry_event_create(dev, &e2));
    /* never recorded: complete, as in CUDA */
    assert_int_equal(ferry_event_query(e1), 0);

    FT_ASSERT_OK(ferry__device_host_hold(s1, 1));
    FT_ASSERT_OK(ferry_memcpy_htod_async(s1, a, src, n));
    FT_ASSERT_OK(ferry_event_record(e1, s1));
    /* the call returned but nothing moved: the copy is queued */
    assert_int_equal(ferry_event_query(e1), -EAGAIN);
    unsigned char *dev_bytes = ferry_devptr_host(dev, a);
    assert_int_equal(dev_bytes[0], 0);
    assert_int_equal(dev_bytes[n - 1], 0);

    /* s2 reads the same device memory after waiting for e1 */
    FT_ASSERT_OK(ferry_stream_wait_event(s2, e1));
    FT_ASSERT_OK(ferry_memcpy_dtoh_async(s2, out, a, n));
    FT_ASSERT_OK(ferry_event_record(e2, s2));
    float ms = 0;
    assert_int_equal(ferry_event_elapsed_ms(e1, e2, &ms), -EAGAIN);
    assert_int_equal(ferry_event_query(e2), -EAGAIN);
    assert_int_equal(out[0], 0);

    FT_ASSERT_OK(ferry__device_host_hold(s1, 0));
    FT_ASSERT_OK(ferry_event_sync(e2));
    assert_int_equal(ferry_event_query(e1), 0);
    assert_int_equal(ft_check_pattern(out, n, 3), -1);
    ms = -1;
    FT_ASSERT_OK(ferry_event_elapsed_ms(e1, e2, &ms));
    assert_true(ms >= 0.0f);

    /* an event destroyed while its mark is still queued is safe */
    FT_ASSERT_OK(ferry__device_host_hold(s1, 1));
    ferry_event *e3 = NULL;
    FT_ASSERT_OK(ferry_event_create(dev, &e3));
    FT_ASSERT_OK(ferry_event_record(e3, s1));
    FT_ASSERT_OK(ferry_stream_wait_event(s2, e3));
    ferry_event_destroy(e3);
    FT_ASSERT_OK(ferry__device_host_hold(s1, 0));
    FT_ASSERT_OK(ferry_stream_sync(s2));

    ferry_event_destroy(e1);
    ferry_event_destroy(e2);
    FT_ASSERT_OK(ferry_stream_destroy(s1));
    FT_ASSERT_OK(ferry_stream_destroy(s2));
    ferry_device_close(dev);
    free(src);
    free(out);
}

static void events_elapsed_needs_records(void **state)
{
    (void)state;
    ferry_device *dev = open_host();
    ferry_stream *s = NULL;
    FT_ASSERT_OK(ferry_stream_create(dev, &s));
    ferry_event *a = NULL, *b = NULL;
    FT_ASSERT_OK(ferry_event_create(dev, &a));
    FT_ASSERT_OK(ferry_event_create(dev, &b));
    float ms = 42;
    assert_int_equal(ferry_event_elapsed_ms(a, b, &ms), FERRY_ESTATE);
    assert_msg_has(ferry_device_last_error(dev), "never recorded");
    assert_true(ms == 42);
    assert_int_equal(ferry_event_elapsed_ms(a, b, NULL), -EINVAL);
    FT_ASSERT_OK(ferry_event_record(a, s));
    ferry_devptr d = 0;
    FT_ASSERT_OK(ferry_device_alloc(dev, 8 << 20, &d));
    char *h = malloc(8 << 20);
    memset(h, 1, 8 << 20);
    FT_ASSERT_OK(ferry_memcpy_htod_async(s, d, h, 8 << 20));
    FT_ASSERT_OK(ferry_event_record(b, s));
    FT_ASSERT_OK(ferry_event_sync(b));
    FT_ASSERT_OK(ferry_event_elapsed_ms(a, b, &ms));
    assert_true(ms >= 0.0f);
    /* re-recording makes the event pending again until the stream passes it */
    FT_ASSERT_OK(ferry__device_host_hold(s, 1));
    FT_ASSERT_OK(ferry_event_record(a, s));
    assert_int_equal(ferry_event_query(a), -EAGAIN);
    FT_ASSERT_OK(ferry__device_host_hold(s, 0));
    FT_ASSERT_OK(ferry_event_sync(a));
    /* end before start: a negative interval, as in CUDA */
    FT_ASSERT_OK(ferry_event_elapsed_ms(a, b, &ms));
    assert_true(ms <= 0.0f);
    /* freeing memory a queued copy uses waits for that copy */
    FT_ASSERT_OK(ferry_memcpy_htod_async(s, d, h, 8 << 20));
    FT_ASSERT_OK(ferry_device_free(dev, d));
    ferry_event_destroy(a);
    ferry_event_destroy(b);
    FT_ASSERT_OK(ferry_stream_destroy(s));
    ferry_device_close(dev);
    free(h);
}

static void objects_of_two_devices_do_not_mix(void **state)
{
    (void)state;
    ferry_device *d1 = open_host(), *d2 = open_host();
    ferry_stream *s1 = NULL, *s2 = NULL;
    ferry_event *e1 = NULL, *e2 = NULL;
    FT_ASSERT_OK(ferry_stream_create(d1, &s1));
    FT_ASSERT_OK(ferry_stream_create(d2, &s2));
    FT_ASSERT_OK(ferry_event_create(d1, &e1));
    FT_ASSERT_OK(ferry_event_create(d2, &e2));
    assert_int_equal(ferry_event_record(e1, s2), -EINVAL);
    assert_msg_has(ferry_device_last_error(d1), "another device");
    assert_int_equal(ferry_stream_wait_event(s1, e2), -EINVAL);
    float ms = 0;
    assert_int_equal(ferry_event_elapsed_ms(e1, e2, &ms), -EINVAL);
    /* a pointer of one device is unknown to the other */
    ferry_devptr p = 0;
    FT_ASSERT_OK(ferry_device_alloc(d1, 4096, &p));
    assert_int_equal(ferry_device_free(d2, p), -EINVAL);
    char buf[16] = {0};
    assert_int_equal(ferry_memcpy_htod_async(s2, p, buf, sizeof buf), FERRY_EBOUNDS);
    FT_ASSERT_OK(ferry_device_free(d1, p));
    ferry_event_destroy(e1);
    ferry_event_destroy(e2);
    FT_ASSERT_OK(ferry_stream_destroy(s1));
    FT_ASSERT_OK(ferry_stream_destroy(s2));
    ferry_device_close(d1);
    ferry_device_close(d2);
}

/* ---- fault injection ---- */

static void batch_copies_on_host_check_everything_first(void **state)
{
    (void)state;
    ferry_device *dev = open_host();
    ferry_devptr d = 0, e = 0;
    FT_ASSERT_OK(ferry_device_alloc(dev, 4096, &d));
    FT_ASSERT_OK(ferry_device_alloc(dev, 4096, &e));
    ferry_stream *s = NULL;
    FT_ASSERT_OK(ferry_stream_create(dev, &s));
    unsigned char a[1024], b[1024], out[2048];
    ft_fill_pattern(a, sizeof a, 1);
    ft_fill_pattern(b, sizeof b, 2);
    ferry_copy up[3] = {{d + 1024, (uintptr_t)a, 1024}, {d, (uintptr_t)b, 1024},
                        {d + 2048, (uintptr_t)a, 0}};
    assert_int_equal(ferry_memcpy_batch_async(s, FERRY_COPY_HTOD, up, 3), 2); /* a call each */
    ferry_copy dd = {e, d, 2048};
    assert_int_equal(ferry_memcpy_batch_async(s, FERRY_COPY_DTOD, &dd, 1), 1);
    ferry_copy down = {(uintptr_t)out, e, 2048};
    assert_int_equal(ferry_memcpy_batch_async(s, FERRY_COPY_DTOH, &down, 1), 1);
    FT_ASSERT_OK(ferry_stream_sync(s));
    assert_int_equal(ft_check_pattern(out, 1024, 2), -1);
    assert_int_equal(ft_check_pattern(out + 1024, 1024, 1), -1);
    /* the third copy runs past its allocation: refused, and the first two
     * were not queued either */
    memset(out, 0, sizeof out);
    ferry_copy bad[3] = {{(uintptr_t)out, e, 1024}, {(uintptr_t)out + 1024, e + 1024, 1024},
                         {(uintptr_t)out, e + 3072, 2048}};
    assert_int_equal(ferry_memcpy_batch_async(s, FERRY_COPY_DTOH, bad, 3), FERRY_EBOUNDS);
    assert_non_null(strstr(ferry_device_last_error(dev), "memcpy batch"));
    FT_ASSERT_OK(ferry_stream_sync(s));
    for (size_t i = 0; i < sizeof out; i++)
        assert_int_equal(out[i], 0);
    assert_int_equal(ferry_memcpy_batch_async(s, -1, bad, 1), -EINVAL);
    FT_ASSERT_OK(ferry_stream_destroy(s));
    FT_ASSERT_OK(ferry_device_free(dev, d));
    FT_ASSERT_OK(ferry_device_free(dev, e));
    ferry_device_close(dev);
}

static void fail_nth_alloc_then_retry(void **state)
{
    (void)state;
    ferry_device_options o = FERRY_DEVICE_OPTIONS_INIT;
    o.backend = "host";
    ferry_device *dev = NULL;
    FT_ASSERT_OK(ferry_device_open(&o, &dev));
    FT_ASSERT_OK(ft_device_faults(dev, 2, -EIO, 0, FERRY_FAULT_ALLOC));
    ferry_devptr a = 0, b = 0;
    void *h = NULL;
    FT_ASSERT_OK(ferry_device_alloc(dev, 4096, &a));
    assert_int_equal(ferry_device_host_alloc(dev, 4096, &h), -EIO); /* 2nd alloc-kind call */
    assert_null(h);
    assert_msg_has(ferry_device_last_error(dev), "injected fault (alloc call 2)");
    FT_ASSERT_OK(ferry_device_host_alloc(dev, 4096, &h)); /* only the Nth fails */
    FT_ASSERT_OK(ferry_device_host_free(dev, h));
    /* reconfigure: default code, and clear */
    FT_ASSERT_OK(ft_device_faults(dev, 1, 0, 0, FERRY_FAULT_ALLOC));
    assert_int_equal(ferry_device_alloc(dev, 4096, &b), FERRY_EINJECTED);
    char buf[64];
    assert_int_equal(ferry_device_pin(dev, buf, sizeof buf), 0); /* call 2: fine */
    FT_ASSERT_OK(ferry_device_unpin(dev, buf));
    FT_ASSERT_OK(ft_device_faults(dev, 0, 0, 0, 0));
    FT_ASSERT_OK(ferry_device_alloc(dev, 4096, &b));
    assert_int_equal(ft_device_faults(dev, 1, 5, 0, 0), -EINVAL);
    assert_int_equal(ft_device_faults(NULL, 1, 0, 0, 0), -EINVAL);
    FT_ASSERT_OK(ferry_device_free(dev, a));
    FT_ASSERT_OK(ferry_device_free(dev, b));
    ferry_device_close(dev);
}

static void injected_copy_fails_at_sync_then_retry_works(void **state)
{
    (void)state;
    ferry_device *dev = open_host();
    const size_t n = 8192;
    unsigned char src[8192], out[8192];
    ft_fill_pattern(src, n, 9);
    ferry_devptr a = 0;
    FT_ASSERT_OK(ferry_device_alloc(dev, n, &a));
    FT_ASSERT_OK(ferry_device_memset(dev, a, 0, n));
    ferry_stream *s = NULL;
    FT_ASSERT_OK(ferry_stream_create(dev, &s));
    ferry_event *e = NULL;
    FT_ASSERT_OK(ferry_event_create(dev, &e));
    /* fail the 2nd copy: the first lands, the second moves nothing */
    FT_ASSERT_OK(ft_device_faults(dev, 2, -EIO, 0, FERRY_FAULT_COPY));
    FT_ASSERT_OK(ferry_memcpy_htod_async(s, a, src, 4096));
    FT_ASSERT_OK(ferry_memcpy_htod_async(s, a + 4096, src + 4096, 4096)); /* queued fine */
    FT_ASSERT_OK(ferry_event_record(e, s));
    assert_int_equal(ferry_event_sync(e), -EIO); /* the event saw the stream's error */
    assert_int_equal(ferry_stream_sync(s), -EIO);
    assert_msg_has(ferry_device_last_error(dev), "async memcpy htod of 4096 bytes");
    assert_msg_has(ferry_device_last_error(dev), "injected fault");
    assert_int_equal(ferry_stream_sync(s), 0); /* reported once */
    unsigned char *d = ferry_devptr_host(dev, a);
    assert_int_equal(ft_check_pattern(d, 4096, 9), -1);
    assert_int_equal(d[4096], 0);
    /* retry the failed copy */
    FT_ASSERT_OK(ferry_memcpy_htod_async(s, a + 4096, src + 4096, 4096));
    FT_ASSERT_OK(ferry_stream_sync(s));
    FT_ASSERT_OK(ferry_device_download(dev, out, a, n));
    assert_int_equal(ft_check_pattern(out, n, 9), -1);

    /* upload/download count as one copy each and fail synchronously */
    FT_ASSERT_OK(ft_device_faults(dev, 1, 0, 0, FERRY_FAULT_COPY));
    assert_int_equal(ferry_device_download(dev, out, a, n), FERRY_EINJECTED);
    FT_ASSERT_OK(ferry_device_download(dev, out, a, n));

    /* a failed sync still waits for the work, and the retry succeeds */
    FT_ASSERT_OK(ft_device_faults(dev, 1, -ETIMEDOUT, 0, FERRY_FAULT_SYNC));
    FT_ASSERT_OK(ferry_memcpy_dtoh_async(s, out, a, n));
    assert_int_equal(ferry_stream_sync(s), -ETIMEDOUT);
    assert_msg_has(ferry_device_last_error(dev), "stream sync: injected fault (sync call 1)");
    assert_int_equal(ft_check_pattern(out, n, 9), -1);
    FT_ASSERT_OK(ferry_stream_sync(s));
    FT_ASSERT_OK(ft_device_faults(dev, 2, 0, 0, FERRY_FAULT_SYNC));
    FT_ASSERT_OK(ferry_event_record(e, s));
    FT_ASSERT_OK(ferry_event_sync(e));
    assert_int_equal(ferry_event_sync(e), FERRY_EINJECTED);

    /* event record fault */
    FT_ASSERT_OK(ft_device_faults(dev, 1, 0, 0, FERRY_FAULT_EVENT));
    assert_int_equal(ferry_event_record(e, s), FERRY_EINJECTED);
    FT_ASSERT_OK(ferry_event_record(e, s));
    FT_ASSERT_OK(ferry_event_sync(e));

    /* mask 0 counts every kind: alloc(1) copy(2) sync(3) */
    FT_ASSERT_OK(ft_device_faults(dev, 3, 0, 0, 0));
    ferry_devptr b = 0;
    FT_ASSERT_OK(ferry_device_alloc(dev, 64, &b));
    FT_ASSERT_OK(ferry_memcpy_htod_async(s, b, src, 64));
    assert_int_equal(ferry_stream_sync(s), FERRY_EINJECTED);
    FT_ASSERT_OK(ft_device_faults(dev, 0, 0, 0, 0));

    ferry_event_destroy(e);
    FT_ASSERT_OK(ferry_stream_destroy(s));
    ferry_device_close(dev);
}

static void short_copies_report_eshort(void **state)
{
    (void)state;
    ferry_device_options o = FERRY_DEVICE_OPTIONS_INIT;
    o.backend = "host";
    ferry_device *dev = NULL;
    FT_ASSERT_OK(ferry_device_open(&o, &dev));
    FT_ASSERT_OK(ft_device_faults(dev, 0, 0, 100, 0));
    unsigned char src[4096], out[4096];
    ft_fill_pattern(src, sizeof src, 1);
    ferry_devptr a = 0;
    FT_ASSERT_OK(ferry_device_alloc(dev, 4096, &a));
    FT_ASSERT_OK(ferry_device_memset(dev, a, 0, 4096));
    assert_int_equal(ferry_device_upload(dev, a, src, 4096), FERRY_ESHORT);
    assert_msg_has(ferry_device_last_error(dev), "moved only 100 bytes");
    unsigned char *d = ferry_devptr_host(dev, a);
    assert_int_equal(ft_check_pattern(d, 100, 1), -1);
    assert_int_equal(d[100], 0);
    /* copies no larger than the limit are whole */
    FT_ASSERT_OK(ferry_device_upload(dev, a, src, 100));
    ferry_stream *s = NULL;
    FT_ASSERT_OK(ferry_stream_create(dev, &s));
    FT_ASSERT_OK(ferry_memcpy_dtoh_async(s, out, a, 4096));
    /* a stream destroyed with an unreported error reports it */
    assert_int_equal(ferry_stream_destroy(s), FERRY_ESHORT);
    FT_ASSERT_OK(ft_device_faults(dev, 0, 0, 0, 0));
    FT_ASSERT_OK(ferry_device_upload(dev, a, src, 4096));
    FT_ASSERT_OK(ferry_device_download(dev, out, a, 4096));
    assert_int_equal(ft_check_pattern(out, 4096, 1), -1);
    ferry_device_close(dev);
}

/* ---- allocation hook ---- */

static int exercise_device(void)
{
    ferry_device_options o = FERRY_DEVICE_OPTIONS_INIT;
    o.backend = "host";
    ferry_device *dev = NULL;
    int rc = ferry_device_open(&o, &dev);
    if (rc < 0)
        return rc;
    ferry_stream *s = NULL;
    ferry_event *e = NULL;
    ferry_devptr a = 0;
    char buf[256] = {1};
    if ((rc = ferry_stream_create(dev, &s)) < 0)
        goto out;
    if ((rc = ferry_event_create(dev, &e)) < 0)
        goto out;
    if ((rc = ferry_device_alloc(dev, 256, &a)) < 0)
        goto out;
    if ((rc = ferry_memcpy_htod_async(s, a, buf, sizeof buf)) < 0)
        goto out;
    if ((rc = ferry_event_record(e, s)) < 0)
        goto out;
    if ((rc = ferry_stream_wait_event(s, e)) < 0)
        goto out;
    if ((rc = ferry_device_download(dev, buf, a, sizeof buf)) < 0)
        goto out;
    rc = ferry_stream_sync(s);
out:
    /* leave the rest to close: it must free streams, events and memory */
    if (s && rc == 0)
        rc = ferry_stream_destroy(s);
    ferry_device_close(dev);
    return rc;
}

static int exercise_run(void *ctx)
{
    (void)ctx;
    return exercise_device();
}

static void allocation_failures_unwind_without_leaks(void **state)
{
    (void)state;
    int level = ferry_log_get_level();
    ferry_log_set_level(FERRY_LOG_ERROR); /* close warns about the streams left behind */
    ft_oom_each(200, 0, exercise_run, NULL);
    /* sticky: everything after the first failure fails too, and every run
     * that was refused an allocation fails with -ENOMEM */
    ft_oom_each(200, FT_OOM_STICKY | FT_OOM_STRICT, exercise_run, NULL);
    ferry_log_set_level(level);
}

static void close_frees_leftovers(void **state)
{
    (void)state;
    int level = ferry_log_get_level();
    ferry_log_set_level(FERRY_LOG_ERROR);
    ft_alloc_install(0, 0);
    ferry_device *dev = open_host();
    ferry_devptr a = 0;
    void *h = NULL;
    static char pinme[4096];
    ferry_stream *s = NULL;
    ferry_event *e = NULL;
    FT_ASSERT_OK(ferry_device_alloc(dev, 1 << 20, &a));
    FT_ASSERT_OK(ferry_device_host_alloc(dev, 1 << 20, &h));
    FT_ASSERT_OK(ferry_device_pin(dev, pinme, sizeof pinme));
    FT_ASSERT_OK(ferry_stream_create(dev, &s));
    FT_ASSERT_OK(ferry_event_create(dev, &e));
    FT_ASSERT_OK(ferry_memcpy_htod_async(s, a, h, 1 << 20));
    FT_ASSERT_OK(ferry_event_record(e, s));
    ferry_device_close(dev); /* LeakSanitizer checks the payloads */
    assert_int_equal(ft_alloc_live(), 0);
    ft_alloc_reset();
    ferry_log_set_level(level);
}

/* ---- threads ---- */

struct worker_arg {
    ferry_device *dev;
    unsigned seed;
    int rc;
};

static void *worker(void *p)
{
    struct worker_arg *w = p;
    const size_t n = 64 << 10;
    unsigned char *src = malloc(n), *out = malloc(n);
    ferry_stream *s = NULL;
    ferry_event *e = NULL;
    int rc = ferry_stream_create(w->dev, &s);
    if (rc == 0)
        rc = ferry_event_create(w->dev, &e);
    for (int it = 0; rc == 0 && it < 40; it++) {
        ferry_devptr a = 0, b = 0;
        ft_fill_pattern(src, n, w->seed + (unsigned)it);
        if ((rc = ferry_device_alloc(w->dev, n, &a)) < 0)
            break;
        if ((rc = ferry_device_alloc(w->dev, n, &b)) < 0)
            break;
        if (it % 2 == 0) {
            rc = ferry_device_upload(w->dev, a, src, n);
        } else {
            rc = ferry_memcpy_htod_async(s, a, src, n);
            if (rc == 0)
                rc = ferry_event_record(e, s);
            if (rc == 0)
                rc = ferry_event_sync(e);
        }
        if (rc == 0)
            rc = ferry_memcpy_dtod_async(s, b, a, n);
        if (rc == 0)
            rc = ferry_memcpy_dtoh_async(s, out, b, n);
        if (rc == 0)
            rc = ferry_stream_sync(s);
        if (rc == 0 && ft_check_pattern(out, n, w->seed + (unsigned)it) != -1)
            rc = -EBADMSG;
        ferry_device_free(w->dev, a);
        ferry_device_free(w->dev, b);
    }
    ferry_event_destroy(e);
    int rd = ferry_stream_destroy(s);
    w->rc = rc ? rc : rd;
    free(src);
    free(out);
    return NULL;
}

static void shared_device_from_threads(void **state)
{
    (void)state;
    ferry_device *dev = open_host();
    enum { T = 4 };
    pthread_t th[T];
    struct worker_arg args[T];
    for (int i = 0; i < T; i++) {
        args[i] = (struct worker_arg){dev, (unsigned)i * 17u, -1};
        assert_int_equal(pthread_create(&th[i], NULL, worker, &args[i]), 0);
    }
    for (int i = 0; i < T; i++) {
        pthread_join(th[i], NULL);
        if (args[i].rc != 0)
            fail_msg("thread %d: %d (%s): %s", i, args[i].rc, ferry_strerror(args[i].rc),
                     ferry_device_last_error(dev));
    }
    ferry_device_close(dev);
}

/* "events may be queried from any thread" (ferry/device.h): one thread
 * records an event after each copy on its own stream and another waits
 * on it, while a third polls it; whoever sees it complete sees the
 * copy's bytes. */
typedef struct ev_share {
    ferry_device *dev;
    ferry_event *e;
    ferry_stream *s;
    ferry_devptr d;
    unsigned char *out;
    size_t n;
    atomic_int round;   /* recorded rounds */
    atomic_int checked; /* rounds the waiter verified */
    atomic_int stop;
    atomic_int bad;
} ev_share;

static void *ev_waiter(void *p)
{
    ev_share *x = p;
    for (int r = 1; r <= 30 && !atomic_load(&x->bad); r++) {
        while (atomic_load(&x->round) < r)
            sched_yield();
        /* the recorder re-records only after this round is checked */
        if (ferry_event_sync(x->e) != 0 || ft_check_pattern(x->out, x->n, (unsigned)r) != -1)
            atomic_store(&x->bad, r);
        atomic_store(&x->checked, r);
    }
    atomic_store(&x->stop, 1);
    return NULL;
}

static void *ev_poller(void *p)
{
    ev_share *x = p;
    while (!atomic_load(&x->stop)) {
        int rc = ferry_event_query(x->e);
        if (rc != 0 && rc != -EAGAIN)
            atomic_store(&x->bad, -1);
    }
    return NULL;
}

static void events_are_waited_on_from_other_threads(void **state)
{
    (void)state;
    ev_share x = {0};
    x.dev = open_host();
    x.n = 256 << 10;
    unsigned char *src = malloc(x.n);
    x.out = malloc(x.n);
    FT_ASSERT_OK(ferry_stream_create(x.dev, &x.s));
    FT_ASSERT_OK(ferry_event_create(x.dev, &x.e));
    FT_ASSERT_OK(ferry_device_alloc(x.dev, x.n, &x.d));
    pthread_t w, q;
    assert_int_equal(pthread_create(&w, NULL, ev_waiter, &x), 0);
    assert_int_equal(pthread_create(&q, NULL, ev_poller, &x), 0);
    for (int r = 1; r <= 30; r++) {
        if (atomic_load(&x.bad))
            break;
        ft_fill_pattern(src, x.n, (unsigned)r);
        FT_ASSERT_OK(ferry_memcpy_htod_async(x.s, x.d, src, x.n));
        FT_ASSERT_OK(ferry_memcpy_dtoh_async(x.s, x.out, x.d, x.n));
        FT_ASSERT_OK(ferry_event_record(x.e, x.s));
        atomic_store(&x.round, r);
        /* src may change only once the copy is done: the waiter says so */
        while (atomic_load(&x.checked) < r && !atomic_load(&x.bad))
            sched_yield();
    }
    atomic_store(&x.round, 1000);
    pthread_join(w, NULL);
    atomic_store(&x.stop, 1);
    pthread_join(q, NULL);
    assert_int_equal(atomic_load(&x.bad), 0);
    assert_int_equal(atomic_load(&x.checked), 30);
    FT_ASSERT_OK(ferry_device_free(x.dev, x.d));
    ferry_event_destroy(x.e);
    FT_ASSERT_OK(ferry_stream_destroy(x.s));
    ferry_device_close(x.dev);
    free(src);
    free(x.out);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(open_host_names_and_null_close),
        cmocka_unit_test(open_rejects_bad_arguments),
        cmocka_unit_test(open_range_checks_every_option),
        cmocka_unit_test(auto_follows_env_and_availability),
        cmocka_unit_test(alloc_free_and_bad_pointers),
        cmocka_unit_test(older_options_prefix_is_accepted),
        cmocka_unit_test(mem_limit_caps_device_bytes),
        cmocka_unit_test(pinned_memory_and_pin_tables),
        cmocka_unit_test(upload_download_memset_roundtrip),
        cmocka_unit_test(copies_outside_allocations_are_refused),
        cmocka_unit_test(async_copies_and_cross_stream_order),
        cmocka_unit_test(batch_copies_on_host_check_everything_first),
        cmocka_unit_test(events_elapsed_needs_records),
        cmocka_unit_test(objects_of_two_devices_do_not_mix),
        cmocka_unit_test(fail_nth_alloc_then_retry),
        cmocka_unit_test(injected_copy_fails_at_sync_then_retry_works),
        cmocka_unit_test(short_copies_report_eshort),
        cmocka_unit_test(allocation_failures_unwind_without_leaks),
        cmocka_unit_test(close_frees_leftovers),
        cmocka_unit_test(shared_device_from_threads),
        cmocka_unit_test(events_are_waited_on_from_other_threads),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
