/*
 * test_cuda_fake.c - the cuda backend's logic over a fake driver table
 * that records every call: which driver function each ferry call reaches
 * and with which arguments, how CUresult errors become ferry codes and
 * messages, the context being made current on every thread, close giving
 * back leftovers, and the missing-driver paths (no library, missing
 * symbol). Where the CUDA toolkit's cuda.h is installed, the prototypes
 * ferry declares for itself are checked against it at compile time.
 */
#include <errno.h>
#include <signal.h>
#include <stddef.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "device/cuda_api.h"
#include "device/device_impl.h"
#include "ferry/kv.h"
#include "ferry_test.h"

/* ---- compile-time check of the prototypes against the real cuda.h ---- */
#if defined(__has_include)
#if __has_include("/usr/local/cuda/include/cuda.h")
#include "/usr/local/cuda/include/cuda.h"
#define HAVE_REAL_CUDA_H 1
#endif
#endif

#ifdef HAVE_REAL_CUDA_H
/* each entry of ferry's list, re-expanded with the real types, must be the
 * type of the real function (cuda.h's macros map names to _v2 symbols) */
#define CHECK_PROTO(name, R, params)                                                      \
    _Static_assert(__builtin_types_compatible_p(__typeof__(&name), R(*) params),          \
                   "ferry's prototype of " #name " differs from cuda.h");
FERRY__CUDA_API_LIST(CHECK_PROTO, CUresult, CUdevice, CUcontext, CUstream, CUevent, CUdeviceptr)
#undef CHECK_PROTO
/* and ferry's stand-in types have the real types' representation */
_Static_assert(sizeof(CUresult) == sizeof(ferry__CUresult), "CUresult size");
_Static_assert(__builtin_types_compatible_p(CUdevice, ferry__CUdevice), "CUdevice");
_Static_assert(__builtin_types_compatible_p(CUdeviceptr, ferry__CUdeviceptr), "CUdeviceptr");
_Static_assert(sizeof(CUcontext) == sizeof(ferry__CUcontext), "CUcontext");
_Static_assert(sizeof(CUstream) == sizeof(ferry__CUstream), "CUstream");
_Static_assert(sizeof(CUevent) == sizeof(ferry__CUevent), "CUevent");
_Static_assert(CUDA_SUCCESS == FERRY__CUDA_SUCCESS, "CUDA_SUCCESS");
_Static_assert(CUDA_ERROR_INVALID_VALUE == FERRY__CUDA_ERROR_INVALID_VALUE, "INVALID_VALUE");
_Static_assert(CUDA_ERROR_OUT_OF_MEMORY == FERRY__CUDA_ERROR_OUT_OF_MEMORY, "OUT_OF_MEMORY");
_Static_assert(CUDA_ERROR_NOT_INITIALIZED == FERRY__CUDA_ERROR_NOT_INITIALIZED, "NOT_INIT");
_Static_assert(CUDA_ERROR_NO_DEVICE == FERRY__CUDA_ERROR_NO_DEVICE, "NO_DEVICE");
_Static_assert(CUDA_ERROR_INVALID_DEVICE == FERRY__CUDA_ERROR_INVALID_DEVICE, "INVALID_DEVICE");
_Static_assert(CUDA_ERROR_NOT_READY == FERRY__CUDA_ERROR_NOT_READY, "NOT_READY");
_Static_assert(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED ==
                   FERRY__CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED,
               "ALREADY_REGISTERED");
_Static_assert(CU_MEMHOSTREGISTER_PORTABLE == FERRY__CU_MEMHOSTREGISTER_PORTABLE, "PORTABLE");
_Static_assert(CU_STREAM_NON_BLOCKING == FERRY__CU_STREAM_NON_BLOCKING, "NON_BLOCKING");
_Static_assert(CU_EVENT_DEFAULT == FERRY__CU_EVENT_DEFAULT, "EVENT_DEFAULT");
#if CUDA_VERSION >= 12080
/* the optional batched copy: CUDA 13's export, and the attributes' layout */
#if CUDA_VERSION >= 13000
_Static_assert(__builtin_types_compatible_p(
                   __typeof__(&cuMemcpyBatchAsync_v2),
                   CUresult (*)(CUdeviceptr *, CUdeviceptr *, size_t *, size_t,
                                CUmemcpyAttributes *, size_t *, size_t, CUstream)),
               "cuMemcpyBatchAsync_v2");
#endif
_Static_assert(sizeof(CUmemcpyAttributes) == sizeof(ferry__CUmemcpyAttributes), "attrs size");
_Static_assert(offsetof(CUmemcpyAttributes, srcAccessOrder) ==
                   offsetof(ferry__CUmemcpyAttributes, srcAccessOrder), "srcAccessOrder");
_Static_assert(offsetof(CUmemcpyAttributes, srcLocHint) ==
                   offsetof(ferry__CUmemcpyAttributes, srcLocHint), "srcLocHint");
_Static_assert(offsetof(CUmemcpyAttributes, dstLocHint) ==
                   offsetof(ferry__CUmemcpyAttributes, dstLocHint), "dstLocHint");
_Static_assert(offsetof(CUmemcpyAttributes, flags) == offsetof(ferry__CUmemcpyAttributes, flags),
               "flags");
_Static_assert(sizeof(CUmemLocation) == sizeof(ferry__CUmemLocation), "CUmemLocation");
_Static_assert(CU_MEMCPY_SRC_ACCESS_ORDER_STREAM == FERRY__CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
               "ORDER_STREAM");
#endif
#endif

/* ---- the fake driver ---- */

#define FAKE_CTX ((ferry__CUcontext)(uintptr_t)0xc0c0)
#define FAKE_DEV_BASE 10

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static char g_log[256][160];
static int g_nlog;
static char g_fail_fn[64];   /* the function that fails next */
static ferry__CUresult g_fail_res;
static int g_query_not_ready; /* cuEventQuery / ElapsedTime answer NOT_READY */
static int g_live_dev, g_live_host, g_live_reg, g_live_streams, g_live_events;
static int g_nstreams;
static _Thread_local ferry__CUcontext t_current;
static float g_clock_ms;
static int g_single_copies;           /* cuMemcpy{HtoD,DtoH,DtoD}Async_v2 calls */
static int g_batch_calls, g_batch_copies, g_batch_bad_attrs;

struct fake_event {
    float t_ms;
    int recorded;
};

static void logf_(const char *fmt, ...) FERRY__PRINTF(1, 2);
static void logf_(const char *fmt, ...)
{
    pthread_mutex_lock(&g_mu);
    if (g_nlog < 256) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(g_log[g_nlog++], sizeof g_log[0], fmt, ap);
        va_end(ap);
    }
    pthread_mutex_unlock(&g_mu);
}

/* a call fails when it is the chosen one (once) */
static ferry__CUresult injected(const char *fn)
{
    pthread_mutex_lock(&g_mu);
    ferry__CUresult r = 0;
    if (g_fail_fn[0] && strcmp(g_fail_fn, fn) == 0) {
        r = g_fail_res;
        g_fail_fn[0] = 0;
    }
    pthread_mutex_unlock(&g_mu);
    return r;
}

#define CTX_REQUIRED()                                                                      \
    do {                                                                                    \
        if (t_current != FAKE_CTX)                                                          \
            return 201; /* CUDA_ERROR_INVALID_CONTEXT */                                    \
    } while (0)

static ferry__CUresult f_cuInit(unsigned int flags)
{
    logf_("cuInit(%u)", flags);
    return injected("cuInit");
}
static ferry__CUresult f_cuDeviceGetCount(int *count)
{
    logf_("cuDeviceGetCount");
    *count = 1;
    return injected("cuDeviceGetCount");
}
static ferry__CUresult f_cuDeviceGet(ferry__CUdevice *d, int ordinal)
{
    logf_("cuDeviceGet(%d)", ordinal);
    if (ordinal != 0)
        return 101;
    *d = FAKE_DEV_BASE + ordinal;
    return injected("cuDeviceGet");
}
static ferry__CUresult f_cuDeviceGetName(char *name, int len, ferry__CUdevice d)
{
    logf_("cuDeviceGetName(%d, %d)", len, d);
    snprintf(name, (size_t)len, "Fake GPU %d", d);
    return injected("cuDeviceGetName");
}
static ferry__CUresult f_cuDevicePrimaryCtxRetain(ferry__CUcontext *c, ferry__CUdevice d)
{
    logf_("cuDevicePrimaryCtxRetain(%d)", d);
    ferry__CUresult r = injected("cuDevicePrimaryCtxRetain");
    if (r == 0)
        *c = FAKE_CTX;
    return r;
}
static ferry__CUresult f_cuDevicePrimaryCtxRelease_v2(ferry__CUdevice d)
{
    logf_("cuDevicePrimaryCtxRelease_v2(%d)", d);
    return injected("cuDevicePrimaryCtxRelease_v2");
}
static ferry__CUresult f_cuCtxSetCurrent(ferry__CUcontext c)
{
    /* not logged: it precedes every call */
    ferry__CUresult r = injected("cuCtxSetCurrent");
    if (r == 0)
        t_current = c;
    return r;
}
static ferry__CUresult f_cuMemAlloc_v2(ferry__CUdeviceptr *p, size_t n)
{
    CTX_REQUIRED();
    logf_("cuMemAlloc_v2(%zu)", n);
    ferry__CUresult r = injected("cuMemAlloc_v2");
    if (r)
        return r;
    void *m = NULL;
    if (posix_memalign(&m, 256, n) != 0)
        return 2;
    __atomic_add_fetch(&g_live_dev, 1, __ATOMIC_SEQ_CST);
    *p = (ferry__CUdeviceptr)(uintptr_t)m;
    return 0;
}
static ferry__CUresult f_cuMemFree_v2(ferry__CUdeviceptr p)
{
    CTX_REQUIRED();
    logf_("cuMemFree_v2(0x%llx)", p);
    __atomic_sub_fetch(&g_live_dev, 1, __ATOMIC_SEQ_CST);
    free((void *)(uintptr_t)p);
    return injected("cuMemFree_v2");
}
static ferry__CUresult f_cuMemAllocHost_v2(void **pp, size_t n)
{
    CTX_REQUIRED();
    logf_("cuMemAllocHost_v2(%zu)", n);
    ferry__CUresult r = injected("cuMemAllocHost_v2");
    if (r)
        return r;
    if (posix_memalign(pp, 4096, n) != 0)
        return 2;
    g_live_host++;
    return 0;
}
static ferry__CUresult f_cuMemFreeHost(void *p)
{
    CTX_REQUIRED();
    logf_("cuMemFreeHost(%p)", p);
    g_live_host--;
    free(p);
    return injected("cuMemFreeHost");
}
static ferry__CUresult f_cuMemHostRegister_v2(void *p, size_t n, unsigned int flags)
{
    CTX_REQUIRED();
    logf_("cuMemHostRegister_v2(%p, %zu, %u)", p, n, flags);
    ferry__CUresult r = injected("cuMemHostRegister_v2");
    if (r == 0)
        g_live_reg++;
    return r;
}
static ferry__CUresult f_cuMemHostUnregister(void *p)
{
    CTX_REQUIRED();
    logf_("cuMemHostUnregister(%p)", p);
    g_live_reg--;
    return injected("cuMemHostUnregister");
}
static ferry__CUresult f_cuMemsetD8_v2(ferry__CUdeviceptr d, unsigned char uc, size_t n)
{
    CTX_REQUIRED();
    logf_("cuMemsetD8_v2(0x%llx, %u, %zu)", d, uc, n);
    memset((void *)(uintptr_t)d, uc, n);
    return injected("cuMemsetD8_v2");
}
static ferry__CUresult f_cuMemcpyHtoDAsync_v2(ferry__CUdeviceptr d, const void *s, size_t n,
                                              ferry__CUstream st)
{
    CTX_REQUIRED();
    logf_("cuMemcpyHtoDAsync_v2(0x%llx, %p, %zu, %p)", d, s, n, (void *)st);
    __atomic_add_fetch(&g_single_copies, 1, __ATOMIC_SEQ_CST);
    ferry__CUresult r = injected("cuMemcpyHtoDAsync_v2");
    if (r == 0)
        memcpy((void *)(uintptr_t)d, s, n);
    return r;
}
static ferry__CUresult f_cuMemcpyDtoHAsync_v2(void *d, ferry__CUdeviceptr s, size_t n,
                                              ferry__CUstream st)
{
    CTX_REQUIRED();
    logf_("cuMemcpyDtoHAsync_v2(%p, 0x%llx, %zu, %p)", d, s, n, (void *)st);
    __atomic_add_fetch(&g_single_copies, 1, __ATOMIC_SEQ_CST);
    ferry__CUresult r = injected("cuMemcpyDtoHAsync_v2");
    if (r == 0)
        memcpy(d, (void *)(uintptr_t)s, n);
    return r;
}
static ferry__CUresult f_cuMemcpyDtoDAsync_v2(ferry__CUdeviceptr d, ferry__CUdeviceptr s,
                                              size_t n, ferry__CUstream st)
{
    CTX_REQUIRED();
    logf_("cuMemcpyDtoDAsync_v2(0x%llx, 0x%llx, %zu, %p)", d, s, n, (void *)st);
    __atomic_add_fetch(&g_single_copies, 1, __ATOMIC_SEQ_CST);
    ferry__CUresult r = injected("cuMemcpyDtoDAsync_v2");
    if (r == 0)
        memmove((void *)(uintptr_t)d, (void *)(uintptr_t)s, n);
    return r;
}
static ferry__CUresult f_cuStreamCreate(ferry__CUstream *st, unsigned int flags)
{
    CTX_REQUIRED();
    logf_("cuStreamCreate(%u)", flags);
    ferry__CUresult r = injected("cuStreamCreate");
    if (r)
        return r;
    pthread_mutex_lock(&g_mu);
    *st = (ferry__CUstream)(uintptr_t)(0x5000 + 0x10 * ++g_nstreams);
    g_live_streams++;
    pthread_mutex_unlock(&g_mu);
    return 0;
}
static ferry__CUresult f_cuStreamDestroy_v2(ferry__CUstream st)
{
    CTX_REQUIRED();
    logf_("cuStreamDestroy_v2(%p)", (void *)st);
    g_live_streams--;
    return injected("cuStreamDestroy_v2");
}
static ferry__CUresult f_cuStreamSynchronize(ferry__CUstream st)
{
    CTX_REQUIRED();
    logf_("cuStreamSynchronize(%p)", (void *)st);
    return injected("cuStreamSynchronize");
}
static ferry__CUresult f_cuStreamWaitEvent(ferry__CUstream st, ferry__CUevent e, unsigned flags)
{
    CTX_REQUIRED();
    logf_("cuStreamWaitEvent(%p, %p, %u)", (void *)st, (void *)e, flags);
    return injected("cuStreamWaitEvent");
}
static ferry__CUresult f_cuEventCreate(ferry__CUevent *e, unsigned int flags)
{
    CTX_REQUIRED();
    logf_("cuEventCreate(%u)", flags);
    ferry__CUresult r = injected("cuEventCreate");
    if (r)
        return r;
    *e = (ferry__CUevent)calloc(1, sizeof(struct fake_event));
    g_live_events++;
    return 0;
}
static ferry__CUresult f_cuEventDestroy_v2(ferry__CUevent e)
{
    CTX_REQUIRED();
    logf_("cuEventDestroy_v2(%p)", (void *)e);
    g_live_events--;
    free(e);
    return injected("cuEventDestroy_v2");
}
static ferry__CUresult f_cuEventRecord(ferry__CUevent e, ferry__CUstream st)
{
    CTX_REQUIRED();
    logf_("cuEventRecord(%p, %p)", (void *)e, (void *)st);
    struct fake_event *fe = (struct fake_event *)e;
    fe->recorded = 1;
    g_clock_ms += 1.5f;
    fe->t_ms = g_clock_ms;
    return injected("cuEventRecord");
}
static ferry__CUresult f_cuEventQuery(ferry__CUevent e)
{
    CTX_REQUIRED();
    logf_("cuEventQuery(%p)", (void *)e);
    return g_query_not_ready ? 600 : injected("cuEventQuery");
}
static ferry__CUresult f_cuEventSynchronize(ferry__CUevent e)
{
    CTX_REQUIRED();
    logf_("cuEventSynchronize(%p)", (void *)e);
    return injected("cuEventSynchronize");
}
static ferry__CUresult f_cuEventElapsedTime(float *ms, ferry__CUevent a, ferry__CUevent b)
{
    CTX_REQUIRED();
    logf_("cuEventElapsedTime(%p, %p)", (void *)a, (void *)b);
    if (g_query_not_ready)
        return 600;
    ferry__CUresult r = injected("cuEventElapsedTime");
    if (r == 0)
        *ms = ((struct fake_event *)b)->t_ms - ((struct fake_event *)a)->t_ms;
    return r;
}
static ferry__CUresult f_cuGetErrorName(ferry__CUresult e, const char **s)
{
    switch (e) {
    case 2: *s = "CUDA_ERROR_OUT_OF_MEMORY"; return 0;
    case 101: *s = "CUDA_ERROR_INVALID_DEVICE"; return 0;
    case 201: *s = "CUDA_ERROR_INVALID_CONTEXT"; return 0;
    case 600: *s = "CUDA_ERROR_NOT_READY"; return 0;
    case 700: *s = "CUDA_ERROR_ILLEGAL_ADDRESS"; return 0;
    case 712: *s = "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED"; return 0;
    default: *s = NULL; return 1;
    }
}
static ferry__CUresult f_cuGetErrorString(ferry__CUresult e, const char **s)
{
    if (e == 700) {
        *s = "an illegal memory access was encountered";
        return 0;
    }
    *s = NULL;
    return 1;
}

/* one fake for both exports: v1 has failIdx, v2 has none */
static ferry__CUresult fake_batch(const char *fn, ferry__CUdeviceptr *dsts,
                                  ferry__CUdeviceptr *srcs, size_t *sizes, size_t count,
                                  ferry__CUmemcpyAttributes *attrs, size_t *idxs, size_t nattrs,
                                  size_t *fail, ferry__CUstream st)
{
    CTX_REQUIRED();
    logf_("%s(%zu copies, %p)", fn, count, (void *)st);
    __atomic_add_fetch(&g_batch_calls, 1, __ATOMIC_SEQ_CST);
    if (nattrs != 1 || idxs[0] != 0 ||
        attrs[0].srcAccessOrder != FERRY__CU_MEMCPY_SRC_ACCESS_ORDER_STREAM ||
        attrs[0].srcLocHint.type != 0 || attrs[0].dstLocHint.type != 0 || attrs[0].flags != 0)
        __atomic_add_fetch(&g_batch_bad_attrs, 1, __ATOMIC_SEQ_CST);
    ferry__CUresult r = injected(fn);
    for (size_t i = 0; i < count; i++) {
        if (r && i == 1) { /* an injected failure hits the second copy */
            if (fail)
                *fail = i;
            return r;
        }
        memcpy((void *)(uintptr_t)dsts[i], (const void *)(uintptr_t)srcs[i], sizes[i]);
        __atomic_add_fetch(&g_batch_copies, 1, __ATOMIC_SEQ_CST);
    }
    return r;
}
static ferry__CUresult f_batch_v2(ferry__CUdeviceptr *d, ferry__CUdeviceptr *s, size_t *n,
                                  size_t count, ferry__CUmemcpyAttributes *a, size_t *ai,
                                  size_t na, ferry__CUstream st)
{
    return fake_batch("cuMemcpyBatchAsync_v2", d, s, n, count, a, ai, na, NULL, st);
}
static ferry__CUresult f_batch_v1(ferry__CUdeviceptr *d, ferry__CUdeviceptr *s, size_t *n,
                                  size_t count, ferry__CUmemcpyAttributes *a, size_t *ai,
                                  size_t na, size_t *fail, ferry__CUstream st)
{
    return fake_batch("cuMemcpyBatchAsync", d, s, n, count, a, ai, na, fail, st);
}

static const struct ferry__cuda_api fake_api = {
#define FAKE_MEMBER(name, R, params) .p_##name = f_##name,
    FERRY__CUDA_API_LIST(FAKE_MEMBER, ferry__CUresult, ferry__CUdevice, ferry__CUcontext,
                         ferry__CUstream, ferry__CUevent, ferry__CUdeviceptr)
#undef FAKE_MEMBER
};

static void fake_reset(void)
{
    pthread_mutex_lock(&g_mu);
    g_nlog = 0;
    g_fail_fn[0] = 0;
    g_query_not_ready = 0;
    pthread_mutex_unlock(&g_mu);
}

static void fake_fail_next(const char *fn, ferry__CUresult r)
{
    pthread_mutex_lock(&g_mu);
    snprintf(g_fail_fn, sizeof g_fail_fn, "%s", fn);
    g_fail_res = r;
    pthread_mutex_unlock(&g_mu);
}

/* index of the first log line at or after `from` equal to line, or -1 */
static int log_find(int from, const char *line)
{
    for (int i = from; i < g_nlog; i++)
        if (strcmp(g_log[i], line) == 0)
            return i;
    return -1;
}

/* index of the first log line starting with prefix, or -1 */
static int log_prefix(int from, const char *prefix)
{
    for (int i = from; i < g_nlog; i++)
        if (strncmp(g_log[i], prefix, strlen(prefix)) == 0)
            return i;
    return -1;
}

static void assert_logged(const char *fmt, ...) FERRY__PRINTF(1, 2);
static void assert_logged(const char *fmt, ...)
{
    char line[160];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    if (log_find(0, line) < 0) {
        for (int i = 0; i < g_nlog; i++)
            fprintf(stderr, "  log[%d] %s\n", i, g_log[i]);
        fail_msg("driver call '%s' was not made", line);
    }
}

static void assert_msg_has(const char *msg, const char *needle)
{
    if (!strstr(msg, needle))
        fail_msg("message '%s' does not contain '%s'", msg, needle);
}

static int setup_fake(void **state)
{
    (void)state;
    ferry__cuda_set_api_for_test(&fake_api);
    fake_reset();
    return 0;
}

static int teardown_fake(void **state)
{
    (void)state;
    ferry__cuda_set_api_for_test(NULL);
    return 0;
}

static ferry_device *open_cuda(void)
{
    ferry_device_options o = FERRY_DEVICE_OPTIONS_INIT;
    o.backend = "cuda";
    ferry_device *dev = NULL;
    FT_ASSERT_OK(ferry_device_open(&o, &dev));
    return dev;
}

/* ---- tests ---- */

static void no_driver_is_enodev_never_a_crash(void **state)
{
    (void)state;
    ferry__cuda_set_api_for_test(NULL);
    ferry__cuda_set_library_for_test("libferry-test-no-such-cuda.so.1");
    ferry_device_options o = FERRY_DEVICE_OPTIONS_INIT;
    o.backend = "cuda";
    ferry_device *dev = NULL;
    assert_int_equal(ferry_device_open(&o, &dev), FERRY_ENODEV);
    assert_null(dev);
    assert_msg_has(ferry_last_error(), "libferry-test-no-such-cuda.so.1 not found: ");
    const char *why = NULL;
    assert_false(ferry_device_backend_available("cuda", &why));
    assert_msg_has(why, "libferry-test-no-such-cuda.so.1 not found");
    /* auto falls back to host */
    FT_ASSERT_OK(ferry_device_open(NULL, &dev));
    assert_string_equal(ferry_device_backend(dev), "host");
    ferry_device_close(dev);
    dev = NULL;

    /* a library that loads but is not a CUDA driver */
    ferry__cuda_set_library_for_test("libc.so.6");
    assert_int_equal(ferry_device_open(&o, &dev), FERRY_ENODEV);
    assert_msg_has(ferry_last_error(), "libc.so.6: symbol cuInit missing");
    assert_null(dev);
    ferry__cuda_set_library_for_test(NULL);
}

static void open_and_close_call_the_driver(void **state)
{
    (void)state;
    ferry_device *dev = open_cuda();
    assert_string_equal(ferry_device_backend(dev), "cuda");
    assert_string_equal(ferry_device_name(dev), "Fake GPU 10");
    assert_int_equal(log_find(0, "cuInit(0)"), 0);
    assert_int_equal(log_find(0, "cuDeviceGet(0)"), 1);
    assert_int_equal(log_find(0, "cuDeviceGetName(128, 10)"), 2);
    assert_int_equal(log_find(0, "cuDevicePrimaryCtxRetain(10)"), 3);
    assert_ptr_equal(ferry__cuda_context(dev), FAKE_CTX);
    assert_int_equal(ferry__cuda_device_ordinal(dev), 10);
    const char *why = NULL;
    assert_true(ferry_device_backend_available("cuda", &why));
    assert_string_equal(why, "");
    /* fault injection is the host backend's */
    assert_int_equal(ft_device_faults(dev, 1, 0, 0, 0), FERRY_ENOTSUP);
    ferry_device_close(dev);
    assert_logged("cuDevicePrimaryCtxRelease_v2(10)");

    /* auto picks cuda when the driver opens */
    FT_ASSERT_OK(ferry_device_open(NULL, &dev));
    assert_string_equal(ferry_device_backend(dev), "cuda");
    ferry_device_close(dev);

    /* a device that does not exist */
    ferry_device_options o = FERRY_DEVICE_OPTIONS_INIT;
    o.backend = "cuda";
    o.ordinal = 3;
    dev = NULL;
    assert_int_equal(ferry_device_open(&o, &dev), FERRY_ENODEV);
    assert_msg_has(ferry_last_error(), "cuDeviceGet(ordinal=3): CUDA_ERROR_INVALID_DEVICE (101)");
    assert_null(dev);
    /* context retain fails: nothing leaks, nothing released that was not retained */
    fake_reset();
    fake_fail_next("cuDevicePrimaryCtxRetain", 700);
    o.ordinal = 0;
    assert_int_equal(ferry_device_open(&o, &dev), FERRY_EDRIVER);
    assert_int_equal(log_find(0, "cuDevicePrimaryCtxRelease_v2(10)"), -1);
}

static void memory_calls_reach_the_right_functions(void **state)
{
    (void)state;
    ferry_device *dev = open_cuda();
    ferry_devptr d = 0;
    FT_ASSERT_OK(ferry_device_alloc(dev, 4096, &d));
    assert_logged("cuMemAlloc_v2(4096)");
    assert_null(ferry_devptr_host(dev, d)); /* never dereferenceable on cuda */
    void *h = NULL;
    FT_ASSERT_OK(ferry_device_host_alloc(dev, 8192, &h));
    assert_logged("cuMemAllocHost_v2(8192)");
    char *buf = malloc(1 << 16);
    FT_ASSERT_OK(ferry_device_pin(dev, buf, 1 << 16));
    assert_logged("cuMemHostRegister_v2(%p, %d, 1)", (void *)buf, 1 << 16);
    FT_ASSERT_OK(ferry_device_memset(dev, d, 0x11, 4096));
    assert_logged("cuMemsetD8_v2(0x%llx, 17, 4096)", (unsigned long long)d);
    assert_logged("cuStreamSynchronize((nil))");

    /* an unknown pointer never reaches the driver */
    int before = g_nlog;
    assert_int_equal(ferry_device_free(dev, d + 64), -EINVAL);
    assert_int_equal(ferry_device_unpin(dev, buf + 1), -EINVAL);
    assert_int_equal(g_nlog, before);

    FT_ASSERT_OK(ferry_device_unpin(dev, buf));
    assert_logged("cuMemHostUnregister(%p)", (void *)buf);
    FT_ASSERT_OK(ferry_device_host_free(dev, h));
    assert_logged("cuMemFreeHost(%p)", h);
    FT_ASSERT_OK(ferry_device_free(dev, d));
    assert_logged("cuMemFree_v2(0x%llx)", (unsigned long long)d);
    assert_int_equal(g_live_dev, 0);
    assert_int_equal(g_live_host, 0);
    assert_int_equal(g_live_reg, 0);
    ferry_device_close(dev);
    free(buf);
}

static void copies_and_events_reach_the_right_functions(void **state)
{
    (void)state;
    ferry_device *dev = open_cuda();
    const size_t n = 4096;
    unsigned char src[4096], out[4096];
    ft_fill_pattern(src, n, 5);
    ferry_devptr a = 0, b = 0;
    FT_ASSERT_OK(ferry_device_alloc(dev, n, &a));
    FT_ASSERT_OK(ferry_device_alloc(dev, n, &b));
    ferry_stream *s = NULL;
    FT_ASSERT_OK(ferry_stream_create(dev, &s));
    assert_logged("cuStreamCreate(1)"); /* non-blocking */
    void *st = (void *)(uintptr_t)ferry_stream_handle(s);
    assert_non_null(st);
    ferry_event *e1 = NULL, *e2 = NULL;
    FT_ASSERT_OK(ferry_event_create(dev, &e1));
    FT_ASSERT_OK(ferry_event_create(dev, &e2));
    assert_logged("cuEventCreate(0)");

    FT_ASSERT_OK(ferry_event_record(e1, s));
    FT_ASSERT_OK(ferry_memcpy_htod_async(s, a, src, n));
    assert_logged("cuMemcpyHtoDAsync_v2(0x%llx, %p, 4096, %p)", (unsigned long long)a,
                  (void *)src, st);
    FT_ASSERT_OK(ferry_memcpy_dtod_async(s, b, a, n));
    assert_logged("cuMemcpyDtoDAsync_v2(0x%llx, 0x%llx, 4096, %p)", (unsigned long long)b,
                  (unsigned long long)a, st);
    FT_ASSERT_OK(ferry_memcpy_dtoh_async(s, out, b, n));
    assert_logged("cuMemcpyDtoHAsync_v2(%p, 0x%llx, 4096, %p)", (void *)out,
                  (unsigned long long)b, st);
    FT_ASSERT_OK(ferry_event_record(e2, s));
    assert_logged("cuEventRecord(%p, %p)", e2->impl, st);
    FT_ASSERT_OK(ferry_stream_wait_event(s, e1));
    assert_logged("cuStreamWaitEvent(%p, %p, 0)", st, e1->impl);
    FT_ASSERT_OK(ferry_event_sync(e2));
    assert_logged("cuEventSynchronize(%p)", e2->impl);
    assert_int_equal(ferry_event_query(e2), 0);
    float ms = 0;
    FT_ASSERT_OK(ferry_event_elapsed_ms(e1, e2, &ms));
    assert_true(ms == 1.5f);
    FT_ASSERT_OK(ferry_stream_sync(s));
    assert_logged("cuStreamSynchronize(%p)", st);
    assert_int_equal(ft_check_pattern(out, n, 5), -1);

    /* upload/download go through an internal stream and wait for it */
    memset(out, 0, n);
    FT_ASSERT_OK(ferry_device_download(dev, out, a, n));
    assert_int_equal(ft_check_pattern(out, n, 5), -1);

    ferry_event_destroy(e1);
    ferry_event_destroy(e2);
    assert_int_equal(g_live_events, 0);
    FT_ASSERT_OK(ferry_stream_destroy(s));
    assert_logged("cuStreamDestroy_v2(%p)", st);
    ferry_device_close(dev);
    assert_int_equal(g_live_streams, 0);
    assert_int_equal(g_live_dev, 0);
}

static void cuda_errors_become_codes_with_names(void **state)
{
    (void)state;
    ferry_device *dev = open_cuda();
    ferry_devptr d = 0;
    FT_ASSERT_OK(ferry_device_alloc(dev, 4096, &d));
    ferry_stream *s = NULL;
    FT_ASSERT_OK(ferry_stream_create(dev, &s));
    char src[4096] = {0};

    fake_fail_next("cuMemcpyHtoDAsync_v2", 700);
    assert_int_equal(ferry_memcpy_htod_async(s, d, src, sizeof src), FERRY_EDRIVER);
    const char *m = ferry_device_last_error(dev);
    assert_msg_has(m, "cuMemcpyHtoDAsync_v2(");
    assert_msg_has(m, "4096 bytes");
    assert_msg_has(m, "CUDA_ERROR_ILLEGAL_ADDRESS (700): an illegal memory access");
    assert_string_equal(ferry_last_error(), m);

    /* out of memory is -ENOMEM and names the size */
    ferry_devptr big = 77;
    fake_fail_next("cuMemAlloc_v2", 2);
    assert_int_equal(ferry_device_alloc(dev, 1ull << 40, &big), -ENOMEM);
    assert_int_equal(big, 77);
    assert_msg_has(ferry_device_last_error(dev), "cuMemAlloc_v2(bytes=1099511627776)");
    assert_msg_has(ferry_device_last_error(dev), "CUDA_ERROR_OUT_OF_MEMORY");
    /* the failed allocation is not tracked: close has nothing extra to free */

    /* an error code the driver cannot name */
    fake_fail_next("cuStreamSynchronize", 9999);
    assert_int_equal(ferry_stream_sync(s), FERRY_EDRIVER);
    assert_msg_has(ferry_device_last_error(dev), "CUDA_ERROR_UNKNOWN_CODE (9999)");

    /* already registered memory */
    char buf[4096];
    fake_fail_next("cuMemHostRegister_v2", 712);
    assert_int_equal(ferry_device_pin(dev, buf, sizeof buf), FERRY_EEXIST);
    /* ...and the failed pin left nothing behind: pinning again works */
    FT_ASSERT_OK(ferry_device_pin(dev, buf, sizeof buf));
    FT_ASSERT_OK(ferry_device_unpin(dev, buf));

    /* not ready is -EAGAIN, without touching the device's message */
    ferry_event *a = NULL, *b = NULL;
    FT_ASSERT_OK(ferry_event_create(dev, &a));
    FT_ASSERT_OK(ferry_event_create(dev, &b));
    FT_ASSERT_OK(ferry_event_record(a, s));
    FT_ASSERT_OK(ferry_event_record(b, s));
    g_query_not_ready = 1;
    assert_int_equal(ferry_event_query(a), -EAGAIN);
    float ms = 3;
    assert_int_equal(ferry_event_elapsed_ms(a, b, &ms), -EAGAIN);
    assert_true(ms == 3);
    g_query_not_ready = 0;

    /* failing to make the context current fails the call, naming it */
    fake_fail_next("cuCtxSetCurrent", 201);
    assert_int_equal(ferry_event_record(a, s), FERRY_EDRIVER);
    assert_msg_has(ferry_device_last_error(dev), "cuCtxSetCurrent(ctx=");
    assert_msg_has(ferry_device_last_error(dev), "CUDA_ERROR_INVALID_CONTEXT");

    ferry_event_destroy(a);
    ferry_event_destroy(b);
    FT_ASSERT_OK(ferry_stream_destroy(s));
    FT_ASSERT_OK(ferry_device_free(dev, d));
    ferry_device_close(dev);
}

struct thread_arg {
    ferry_device *dev;
    int rc;
};

static void *other_thread(void *p)
{
    struct thread_arg *a = p;
    ferry_devptr d = 0;
    a->rc = ferry_device_alloc(a->dev, 256, &d); /* the fake refuses without a context */
    if (a->rc == 0)
        a->rc = ferry_device_free(a->dev, d);
    return NULL;
}

static void every_thread_gets_the_context(void **state)
{
    (void)state;
    ferry_device *dev = open_cuda();
    struct thread_arg a = {dev, -1};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, other_thread, &a), 0);
    pthread_join(th, NULL);
    FT_ASSERT_OK(a.rc);
    ferry_device_close(dev);
}

static void close_gives_back_leftovers(void **state)
{
    (void)state;
    int level = ferry_log_get_level();
    ferry_log_set_level(FERRY_LOG_ERROR);
    ferry_device *dev = open_cuda();
    ferry_devptr d = 0;
    void *h = NULL;
    static char pinme[4096];
    ferry_stream *s = NULL;
    ferry_event *e = NULL;
    FT_ASSERT_OK(ferry_device_alloc(dev, 1024, &d));
    FT_ASSERT_OK(ferry_device_host_alloc(dev, 1024, &h));
    FT_ASSERT_OK(ferry_device_pin(dev, pinme, sizeof pinme));
    FT_ASSERT_OK(ferry_stream_create(dev, &s));
    FT_ASSERT_OK(ferry_event_create(dev, &e));
    fake_reset();
    ferry_device_close(dev);
    /* streams go before the memory their queued copies might touch */
    assert_true(log_prefix(0, "cuStreamDestroy_v2(") >= 0);
    assert_true(log_prefix(0, "cuStreamDestroy_v2(") < log_prefix(0, "cuMemFree_v2("));
    assert_true(log_prefix(0, "cuEventDestroy_v2(") >= 0);
    assert_true(log_prefix(0, "cuMemFreeHost(") >= 0);
    assert_true(log_prefix(0, "cuMemHostUnregister(") >= 0);
    assert_int_equal(g_live_dev, 0);
    assert_int_equal(g_live_host, 0);
    assert_int_equal(g_live_reg, 0);
    assert_int_equal(g_live_streams, 0);
    assert_int_equal(g_live_events, 0);
    /* the context is released last */
    assert_int_equal(log_find(0, "cuDevicePrimaryCtxRelease_v2(10)"), g_nlog - 1);
    ferry_log_set_level(level);
}


/* ---- batched copies ---- */

/* the fake driver with the batched copy of a CUDA 13 driver (2), of 12.8
 * (1), or none (0) */
static void use_batch_driver(int version)
{
    static struct ferry__cuda_api api;
    api = fake_api;
    api.p_cuMemcpyBatchAsync_v2 = version == 2 ? f_batch_v2 : NULL;
    api.p_cuMemcpyBatchAsync_v1 = version == 1 ? f_batch_v1 : NULL;
    ferry__cuda_set_api_for_test(&api);
    fake_reset();
    g_single_copies = g_batch_calls = g_batch_copies = g_batch_bad_attrs = 0;
}

static void a_batch_is_one_driver_call_where_the_driver_has_one(void **state)
{
    (void)state;
    for (int version = 2; version >= 0; version--) {
        use_batch_driver(version);
        ferry_device *dev = open_cuda();
        unsigned char src[3][512], out[3][512];
        ferry_devptr d = 0;
        FT_ASSERT_OK(ferry_device_alloc(dev, 3 * 512, &d));
        ferry_stream *s = NULL;
        FT_ASSERT_OK(ferry_stream_create(dev, &s));
        ferry_copy up[4], down[3];
        for (int i = 0; i < 3; i++) {
            ft_fill_pattern(src[i], 512, (unsigned)(10 + i));
            up[i] = (ferry_copy){d + (uint64_t)(2 - i) * 512, (uintptr_t)src[i], 512};
            down[i] = (ferry_copy){(uintptr_t)out[i], d + (uint64_t)(2 - i) * 512, 512};
        }
        up[3] = (ferry_copy){d, (uintptr_t)src[0], 0}; /* empty: skipped */
        memset(out, 0, sizeof out);
        int want = version ? 1 : 3;
        assert_int_equal(ferry_memcpy_batch_async(s, FERRY_COPY_HTOD, up, 4), want);
        assert_int_equal(ferry_memcpy_batch_async(s, FERRY_COPY_DTOH, down, 3), want);
        FT_ASSERT_OK(ferry_stream_sync(s));
        for (int i = 0; i < 3; i++)
            assert_int_equal(ft_check_pattern(out[i], 512, (unsigned)(10 + i)), -1);
        assert_int_equal(g_batch_calls, version ? 2 : 0);
        assert_int_equal(g_single_copies, version ? 0 : 6);
        assert_int_equal(g_batch_bad_attrs, 0);
        if (version == 2)
            assert_true(log_prefix(0, "cuMemcpyBatchAsync_v2(3 copies") >= 0);
        if (version == 1)
            assert_true(log_prefix(0, "cuMemcpyBatchAsync(3 copies") >= 0);
        /* one copy, or none, needs no batch */
        assert_int_equal(ferry_memcpy_batch_async(s, FERRY_COPY_HTOD, up, 1), 1);
        assert_int_equal(ferry_memcpy_batch_async(s, FERRY_COPY_HTOD, up + 3, 1), 0);
        assert_int_equal(ferry_memcpy_batch_async(s, FERRY_COPY_HTOD, NULL, 0), 0);
        FT_ASSERT_OK(ferry_stream_destroy(s));
        FT_ASSERT_OK(ferry_device_free(dev, d));
        ferry_device_close(dev);
    }
}

static void a_batch_refuses_bad_copies_and_names_a_failed_one(void **state)
{
    (void)state;
    use_batch_driver(1);
    ferry_device *dev = open_cuda();
    ferry_devptr d = 0;
    FT_ASSERT_OK(ferry_device_alloc(dev, 1024, &d));
    ferry_stream *s = NULL;
    FT_ASSERT_OK(ferry_stream_create(dev, &s));
    unsigned char buf[1024] = {0};
    ferry_copy c[2] = {{d, (uintptr_t)buf, 512}, {d + 512, 0, 512}};
    assert_int_equal(ferry_memcpy_batch_async(s, FERRY_COPY_HTOD, c, 2), -EINVAL);
    assert_int_equal(g_batch_calls, 0); /* checked whole before anything is queued */
    c[1].src = (uintptr_t)(buf + 512);
    assert_int_equal(ferry_memcpy_batch_async(s, 7, c, 2), -EINVAL);
    assert_int_equal(ferry_memcpy_batch_async(NULL, FERRY_COPY_HTOD, c, 2), -EINVAL);
    assert_int_equal(ferry_memcpy_batch_async(s, FERRY_COPY_HTOD, NULL, 2), -EINVAL);
    fake_fail_next("cuMemcpyBatchAsync", 700);
    assert_int_equal(ferry_memcpy_batch_async(s, FERRY_COPY_HTOD, c, 2), FERRY_EDRIVER);
    assert_msg_has(ferry_device_last_error(dev), "cuMemcpyBatchAsync(2 copies");
    assert_msg_has(ferry_device_last_error(dev), "copy 1");
    assert_msg_has(ferry_device_last_error(dev), "CUDA_ERROR_ILLEGAL_ADDRESS");
    FT_ASSERT_OK(ferry_stream_destroy(s));
    FT_ASSERT_OK(ferry_device_free(dev, d));
    ferry_device_close(dev);
}

static void engine_streams_and_events_are_used_not_owned(void **state)
{
    (void)state;
    use_batch_driver(2);
    ferry_device *dev = open_cuda();
    ferry__CUstream engine = (ferry__CUstream)(uintptr_t)0x7770;
    ferry__CUevent eng_ev = NULL;
    t_current = FAKE_CTX;
    assert_int_equal(f_cuEventCreate(&eng_ev, 0), 0); /* the engine's own event */
    ferry_stream *s = NULL;
    ferry_event *e = NULL;
    FT_ASSERT_OK(ferry_stream_import(dev, (uint64_t)(uintptr_t)engine, &s));
    FT_ASSERT_OK(ferry_event_import(dev, (uint64_t)(uintptr_t)eng_ev, &e));
    assert_int_equal(ferry_stream_handle(s), (uint64_t)(uintptr_t)engine);
    ferry_devptr d = 0;
    FT_ASSERT_OK(ferry_device_alloc(dev, 1024, &d));
    unsigned char src[1024];
    ft_fill_pattern(src, sizeof src, 3);
    ferry_copy c[2] = {{d, (uintptr_t)src, 512}, {d + 512, (uintptr_t)(src + 512), 512}};
    assert_int_equal(ferry_memcpy_batch_async(s, FERRY_COPY_HTOD, c, 2), 1);
    assert_logged("cuMemcpyBatchAsync_v2(2 copies, %p)", (void *)engine);
    FT_ASSERT_OK(ferry_event_record(e, s));
    assert_logged("cuEventRecord(%p, %p)", (void *)eng_ev, (void *)engine);
    FT_ASSERT_OK(ferry_stream_wait_event(s, e));
    FT_ASSERT_OK(ferry_stream_sync(s));
    int before = g_nlog, streams = g_live_streams, events = g_live_events;
    FT_ASSERT_OK(ferry_stream_destroy(s));
    ferry_event_destroy(e);
    assert_int_equal(log_prefix(before, "cuStreamDestroy"), -1); /* the engine's to destroy */
    assert_int_equal(log_prefix(before, "cuStreamSynchronize"), -1);
    assert_int_equal(log_prefix(before, "cuEventDestroy"), -1);
    assert_int_equal(g_live_streams, streams);
    assert_int_equal(g_live_events, events);

    /* the legacy default stream (0): taken, but a batch goes copy by copy */
    FT_ASSERT_OK(ferry_stream_import(dev, 0, &s));
    g_single_copies = 0;
    assert_int_equal(ferry_memcpy_batch_async(s, FERRY_COPY_HTOD, c, 2), 2);
    assert_int_equal(g_single_copies, 2);
    /* left for close: it forgets imported wrappers without destroying them */
    FT_ASSERT_OK(ferry_event_import(dev, (uint64_t)(uintptr_t)eng_ev, &e));
    assert_int_equal(ferry_event_import(dev, 0, &e), -EINVAL);
    assert_int_equal(ferry_stream_import(dev, 1, NULL), -EINVAL);
    FT_ASSERT_OK(ferry_device_free(dev, d));
    before = g_nlog;
    ferry_device_close(dev);
    assert_int_equal(log_prefix(before, "cuEventDestroy"), -1);
    assert_int_equal(f_cuEventDestroy_v2(eng_ev), 0);
    t_current = NULL;

    /* the host backend has no engine streams */
    ferry_device_options o = FERRY_DEVICE_OPTIONS_INIT;
    o.backend = "host";
    FT_ASSERT_OK(ferry_device_open(&o, &dev));
    assert_int_equal(ferry_stream_import(dev, 0x10, &s), FERRY_ENOTSUP);
    assert_msg_has(ferry_device_last_error(dev), "stream import");
    assert_int_equal(ferry_event_import(dev, 0x10, &e), FERRY_ENOTSUP);
    ferry_device_close(dev);
}

/* a KV store over the fake driver: paged device buffers of 16-token
 * blocks, scattered, so a 64-token chunk is 2 * layers * 4 runs */
#define KL 4u
#define KCHUNK 64u
#define KBT 16u
#define KCHUNKS 4u
#define KBLOCKS 32u

static void kv_round_trip(int version, uint64_t *chunks, uint64_t *calls)
{
    use_batch_driver(version);
    ferry_device *dev = open_cuda();
    ferry_kv_config cfg = FERRY_KV_CONFIG_INIT;
    cfg.model = "fake";
    cfg.layout.num_layers = KL;
    cfg.layout.num_heads = 2;
    cfg.layout.head_dim = 8;
    cfg.chunk_tokens = KCHUNK;
    cfg.device = dev;
    uint64_t tb = 2 * 8 * 2, cb = 0;
    FT_ASSERT_OK(ferry_kv_layout_chunk_bytes(&cfg.layout, KCHUNK, &cb));
    cfg.l1_bytes = 8 * cb;
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&cfg, &kv));
    size_t plane = KBLOCKS * KBT * tb;
    ferry_devptr src = 0, dst = 0;
    FT_ASSERT_OK(ferry_device_alloc(dev, 2 * KL * plane, &src));
    FT_ASSERT_OK(ferry_device_alloc(dev, 2 * KL * plane, &dst));
    ft_fill_pattern((void *)(uintptr_t)src, 2 * KL * plane, 77); /* fake device = host */
    memset((void *)(uintptr_t)dst, 0, 2 * KL * plane);
    uint64_t sb[2 * KL], db[2 * KL];
    for (unsigned i = 0; i < 2 * KL; i++) {
        sb[i] = src + i * plane;
        db[i] = dst + i * plane;
    }
    int32_t st[KCHUNKS * KCHUNK / KBT], dt[KCHUNKS * KCHUNK / KBT];
    for (unsigned b = 0; b < KCHUNKS * KCHUNK / KBT; b++) {
        st[b] = (int32_t)((b * 7) % KBLOCKS);      /* never two in a row */
        dt[b] = (int32_t)(KBLOCKS - 1 - b * 2 % KBLOCKS);
    }
    ferry_kv_buffer in = FERRY_KV_BUFFER_INIT, out = FERRY_KV_BUFFER_INIT;
    in.layout = out.layout = cfg.layout;
    in.mem = out.mem = FERRY_KV_MEM_DEVICE;
    in.form = out.form = FERRY_KV_PAGED;
    in.block_tokens = out.block_tokens = KBT;
    in.num_blocks = out.num_blocks = KBLOCKS;
    in.block_bases = sb;
    out.block_bases = db;
    in.block_table = st;
    out.block_table = dt;
    in.table_len = out.table_len = KCHUNKS * KCHUNK / KBT;
    int32_t tok[KCHUNKS * KCHUNK];
    for (unsigned t = 0; t < KCHUNKS * KCHUNK; t++)
        tok[t] = (int32_t)(t * 3 + 1);
    assert_int_equal(ferry_kv_store(kv, tok, KCHUNKS * KCHUNK, NULL, &in), KCHUNKS * KCHUNK);
    assert_int_equal(ferry_kv_retrieve(kv, tok, KCHUNKS * KCHUNK, NULL, &out),
                     KCHUNKS * KCHUNK);
    for (unsigned p = 0; p < 2 * KL; p++)
        for (unsigned t = 0; t < KCHUNKS * KCHUNK; t++)
            assert_memory_equal((void *)(uintptr_t)(db[p] + ((uint64_t)dt[t / KBT] * KBT +
                                                             t % KBT) * tb),
                                (void *)(uintptr_t)(sb[p] + ((uint64_t)st[t / KBT] * KBT +
                                                             t % KBT) * tb),
                                tb);
    ferry_kv_stats m = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(kv, &m));
    *chunks = m.device_chunks;
    *calls = m.device_copy_calls;
    ferry_kv_close(kv);
    FT_ASSERT_OK(ferry_device_free(dev, src));
    FT_ASSERT_OK(ferry_device_free(dev, dst));
    ferry_device_close(dev);
}

static void kv_device_chunks_move_in_one_driver_call_each(void **state)
{
    (void)state;
    uint64_t chunks = 0, calls = 0;
    kv_round_trip(2, &chunks, &calls);
    assert_int_equal(chunks, 2 * KCHUNKS);             /* stored and retrieved */
    assert_int_equal(calls, chunks);                   /* one batch per chunk */
    assert_int_equal(g_batch_calls, calls);
    assert_int_equal(g_batch_copies, 2 * KCHUNKS * 2 * KL * (KCHUNK / KBT));
    kv_round_trip(0, &chunks, &calls);                 /* no batched copy in the driver */
    assert_int_equal(chunks, 2 * KCHUNKS);
    assert_int_equal(calls, chunks * 2 * KL * (KCHUNK / KBT));
    assert_int_equal(g_single_copies, calls);
}

/* ---- a fork while another thread is inside the driver's load ---- */

struct loader_arg {
    int rc;
    char msg[FERRY__ERRMSG_MAX];
};

static void *open_cuda_in_thread(void *arg)
{
    struct loader_arg *la = arg;
    ferry_device_options o = FERRY_DEVICE_OPTIONS_INIT;
    o.backend = "cuda";
    ferry_device *dev = NULL;
    la->rc = ferry_device_open(&o, &dev);
    snprintf(la->msg, sizeof la->msg, "%s", ferry_last_error());
    if (dev)
        ferry_device_close(dev);
    return NULL;
}

/* the child of a fork taken while a thread of the parent holds the loader
 * lock inside dlopen (a stand-in driver whose constructor blocks until a
 * third thread lets it go) opens and probes cuda: it gets the failed load's
 * answer at once, where it used to wait forever on the lock (the alarm
 * kills such a child) */
static void a_fork_during_the_load_leaves_the_child_a_usable_loader(void **state)
{
    (void)state;
    int sig[2], rel[2];
    assert_int_equal(pipe(sig), 0);
    assert_int_equal(pipe(rel), 0);
    char num[16];
    snprintf(num, sizeof num, "%d", sig[1]);
    assert_int_equal(setenv("FERRY_TEST_LOADER_SIGNAL_FD", num, 1), 0);
    snprintf(num, sizeof num, "%d", rel[0]);
    assert_int_equal(setenv("FERRY_TEST_LOADER_RELEASE_FD", num, 1), 0);
    ferry__cuda_set_api_for_test(NULL);
    ferry__cuda_set_library_for_test(FERRY_TEST_BLOCKING_LOADER);

    struct loader_arg la = {1, ""};
    pthread_t loader, releaser;
    assert_int_equal(pthread_create(&loader, NULL, open_cuda_in_thread, &la), 0);
    char b = 0;
    assert_int_equal(read(sig[0], &b, 1), 1); /* the loader is inside dlopen, lock held */
    assert_int_equal(pthread_create(&releaser, NULL, ft_write_byte_after_300ms, &rel[1]), 0);
    pid_t ch = fork();
    if (ch == 0) {
        alarm(10); /* a child waiting on the parent's lock dies of SIGALRM */
        ferry_device_options o = FERRY_DEVICE_OPTIONS_INIT;
        o.backend = "cuda";
        ferry_device *dev = NULL;
        if (ferry_device_open(&o, &dev) != FERRY_ENODEV || dev)
            _exit(2);
        if (!strstr(ferry_last_error(), "symbol cuInit missing"))
            _exit(3);
        const char *why = NULL;
        if (ferry_device_backend_available("cuda", &why) || !strstr(why, "symbol cuInit missing"))
            _exit(4);
        _exit(0);
    }
    assert_true(ch > 0);
    int cx = ft_child_exit(ch);
    pthread_join(releaser, NULL);
    pthread_join(loader, NULL);
    if (cx < 0)
        fail_msg("the forked child died of signal %d (SIGALRM: it hung on the loader lock)", -cx);
    assert_int_equal(cx, 0);
    /* the parent's own load ended as the library deserves */
    assert_int_equal(la.rc, FERRY_ENODEV);
    assert_msg_has(la.msg, "symbol cuInit missing");

    unsetenv("FERRY_TEST_LOADER_SIGNAL_FD");
    unsetenv("FERRY_TEST_LOADER_RELEASE_FD");
    ferry__cuda_set_library_for_test(NULL);
    close(sig[0]);
    close(sig[1]);
    close(rel[0]);
    close(rel[1]);
}

/* a driver that forks inside its own load (its constructor, run by the
 * dlopen that the loader lock covers) must not deadlock the process: the
 * open goes on to the library's answer (run in a child of the test under
 * an alarm, so a deadlock fails the test rather than hanging it) */
static void a_fork_from_inside_the_load_does_not_deadlock(void **state)
{
    (void)state;
    pid_t subject = fork();
    if (subject == 0) {
        alarm(10);
        setenv("FERRY_TEST_LOADER_FORK", "1", 1);
        ferry__cuda_set_api_for_test(NULL);
        ferry__cuda_set_library_for_test(FERRY_TEST_FORKING_LOADER);
        ferry_device_options o = FERRY_DEVICE_OPTIONS_INIT;
        o.backend = "cuda";
        ferry_device *dev = NULL;
        if (ferry_device_open(&o, &dev) != FERRY_ENODEV || dev)
            _exit(2);
        _exit(strstr(ferry_last_error(), "symbol cuInit missing") ? 0 : 3);
    }
    assert_true(subject > 0);
    FT_ASSERT_CHILD_OK(subject, "the loading process (deadlocked on its fork?)");
}

/* the promises of ferry/device.h that hold on cuda before the driver is
 * asked: an ordinal the driver lacks is FERRY_ENODEV; 0 bytes, NULL
 * handles and pointers the device did not hand out are -EINVAL with a
 * message and reach no driver function; mem_limit caps cuda too; a pin
 * overlapping a pinned allocation is FERRY_EEXIST; n == 0 moves nothing;
 * elapsed_ms leaves *ms alone on failure */
static void cuda_refusals_never_reach_the_driver(void **state)
{
    (void)state;
    ferry_device_options o = FERRY_DEVICE_OPTIONS_INIT;
    o.backend = "cuda";
    o.ordinal = 1;
    ferry_device *dev = (ferry_device *)0x1;
    assert_int_equal(ferry_device_open(&o, &dev), FERRY_ENODEV);
    assert_ptr_equal(dev, (ferry_device *)0x1);
    assert_msg_has(ferry_last_error(), "1");

    o.ordinal = 0;
    o.mem_limit = 8192;
    dev = NULL;
    FT_ASSERT_OK(ferry_device_open(&o, &dev));
    ferry_devptr a = 0, b = 0, c = 7;
    void *h = NULL;
    char *buf = malloc(1 << 16);
    int before = g_nlog;
    assert_int_equal(ferry_device_alloc(dev, 0, &c), -EINVAL);
    assert_int_equal(ferry_device_host_alloc(dev, 0, &h), -EINVAL);
    assert_int_equal(ferry_device_pin(dev, buf, 0), -EINVAL);
    assert_int_equal(ferry_device_alloc(NULL, 64, &c), -EINVAL);
    assert_int_equal(ferry_device_host_alloc(dev, 64, NULL), -EINVAL);
    assert_int_equal(ferry_device_free(dev, 0), -EINVAL);
    assert_int_equal(ferry_device_host_free(dev, buf), -EINVAL);
    assert_int_equal(ferry_device_unpin(dev, buf), -EINVAL);
    assert_int_equal(ferry_stream_sync(NULL), -EINVAL);
    assert_int_equal(ferry_event_query(NULL), -EINVAL);
    assert_int_equal(ferry_event_sync(NULL), -EINVAL);
    assert_int_equal(ferry_event_record(NULL, NULL), -EINVAL);
    assert_int_equal(ferry_stream_wait_event(NULL, NULL), -EINVAL);
    assert_int_equal(ferry_stream_create(dev, NULL), -EINVAL);
    assert_int_equal(ferry_event_create(dev, NULL), -EINVAL);
    assert_int_equal(ferry_device_upload(dev, 0, buf, 1), -EINVAL);
    assert_int_equal(c, 7);
    assert_null(h);
    assert_int_equal(g_nlog, before); /* not one driver call */

    /* mem_limit: 8192 bytes held at once, whatever the backend */
    FT_ASSERT_OK(ferry_device_alloc(dev, 4096, &a));
    FT_ASSERT_OK(ferry_device_alloc(dev, 4096, &b));
    before = g_nlog;
    assert_int_equal(ferry_device_alloc(dev, 1, &c), -ENOMEM);
    assert_msg_has(ferry_last_error(), "8192");
    assert_int_equal(g_nlog, before);
    assert_int_equal(c, 7);
    /* a double free is refused before the driver sees it */
    FT_ASSERT_OK(ferry_device_free(dev, b));
    before = g_nlog;
    assert_int_equal(ferry_device_free(dev, b), -EINVAL);
    assert_int_equal(g_nlog, before);
    FT_ASSERT_OK(ferry_device_alloc(dev, 4096, &b));

    /* host memory: interior and double frees, overlapping pins */
    FT_ASSERT_OK(ferry_device_host_alloc(dev, 8192, &h));
    before = g_nlog;
    assert_int_equal(ferry_device_host_free(dev, (char *)h + 64), -EINVAL);
    assert_int_equal(ferry_device_pin(dev, (char *)h + 4096, 4096), FERRY_EEXIST);
    FT_ASSERT_OK(ferry_device_pin(dev, buf, 1 << 16));
    assert_int_equal(ferry_device_pin(dev, buf + 100, 10), FERRY_EEXIST);
    assert_int_equal(ferry_device_unpin(dev, buf + 100), -EINVAL);
    int pins = g_nlog - before; /* the one good pin */
    assert_int_equal(pins, 1);
    FT_ASSERT_OK(ferry_device_unpin(dev, buf));
    FT_ASSERT_OK(ferry_device_host_free(dev, h));
    before = g_nlog;
    assert_int_equal(ferry_device_host_free(dev, h), -EINVAL);
    assert_int_equal(g_nlog, before);

    /* n == 0 moves nothing */
    ferry_stream *s = NULL;
    FT_ASSERT_OK(ferry_stream_create(dev, &s));
    before = g_nlog;
    FT_ASSERT_OK(ferry_device_memset(dev, a, 1, 0));
    FT_ASSERT_OK(ferry_device_upload(dev, a, buf, 0));
    FT_ASSERT_OK(ferry_device_download(dev, buf, a, 0));
    FT_ASSERT_OK(ferry_memcpy_htod_async(s, a, buf, 0));
    FT_ASSERT_OK(ferry_memcpy_dtoh_async(s, buf, a, 0));
    FT_ASSERT_OK(ferry_memcpy_dtod_async(s, b, a, 0));
    assert_int_equal(g_nlog, before);

    /* elapsed_ms: *ms untouched when one is not complete */
    ferry_event *e1 = NULL, *e2 = NULL;
    FT_ASSERT_OK(ferry_event_create(dev, &e1));
    FT_ASSERT_OK(ferry_event_create(dev, &e2));
    FT_ASSERT_OK(ferry_event_record(e1, s));
    FT_ASSERT_OK(ferry_event_record(e2, s));
    g_query_not_ready = 1;
    float ms = -7.0f;
    assert_int_equal(ferry_event_elapsed_ms(e1, e2, &ms), -EAGAIN);
    assert_true(ms == -7.0f);
    g_query_not_ready = 0;
    ferry_event_destroy(e1);
    ferry_event_destroy(e2);
    FT_ASSERT_OK(ferry_stream_destroy(s));
    FT_ASSERT_OK(ferry_device_free(dev, a));
    FT_ASSERT_OK(ferry_device_free(dev, b));
    ferry_device_close(dev);
    free(buf);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(no_driver_is_enodev_never_a_crash),
        cmocka_unit_test_setup_teardown(open_and_close_call_the_driver, setup_fake,
                                        teardown_fake),
        cmocka_unit_test_setup_teardown(memory_calls_reach_the_right_functions, setup_fake,
                                        teardown_fake),
        cmocka_unit_test_setup_teardown(copies_and_events_reach_the_right_functions, setup_fake,
                                        teardown_fake),
        cmocka_unit_test_setup_teardown(cuda_errors_become_codes_with_names, setup_fake,
                                        teardown_fake),
        cmocka_unit_test_setup_teardown(every_thread_gets_the_context, setup_fake,
                                        teardown_fake),
        cmocka_unit_test_setup_teardown(close_gives_back_leftovers, setup_fake, teardown_fake),
        cmocka_unit_test_setup_teardown(a_batch_is_one_driver_call_where_the_driver_has_one,
                                        setup_fake, teardown_fake),
        cmocka_unit_test_setup_teardown(a_batch_refuses_bad_copies_and_names_a_failed_one,
                                        setup_fake, teardown_fake),
        cmocka_unit_test_setup_teardown(kv_device_chunks_move_in_one_driver_call_each,
                                        setup_fake, teardown_fake),
        cmocka_unit_test_setup_teardown(engine_streams_and_events_are_used_not_owned,
                                        setup_fake, teardown_fake),
        cmocka_unit_test_setup_teardown(cuda_refusals_never_reach_the_driver, setup_fake,
                                        teardown_fake),
        cmocka_unit_test(a_fork_during_the_load_leaves_the_child_a_usable_loader),
        cmocka_unit_test(a_fork_from_inside_the_load_does_not_deadlock),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
