/*
 * cuda.c - the "cuda" device backend: the CUDA driver API, loaded with
 * dlopen("libcuda.so.1") at run time, so ferry builds without the CUDA
 * toolkit and runs (with the host backend) without a driver.
 *
 * Invariants:
 *  - The driver is loaded at most once per process and never unloaded; a
 *    failed load is remembered with its reason, so "cuda unusable" costs one
 *    dlopen and always says the same thing.
 *  - Every operation first makes the device's primary context current on
 *    the calling thread (cuCtxSetCurrent is a cheap thread-local store), so
 *    any thread may use a device, stream or event.
 *  - Every CUresult other than success becomes a negative code with a
 *    message naming the call, its arguments and the CUDA error name:
 *    OUT_OF_MEMORY -> -ENOMEM, NOT_READY -> -EAGAIN, NO_DEVICE /
 *    INVALID_DEVICE -> FERRY_ENODEV, HOST_MEMORY_ALREADY_REGISTERED ->
 *    FERRY_EEXIST, anything else -> FERRY_EDRIVER.
 *  - Fork: g_lock is the process's and is held across the driver's dlopen
 *    (and the constructors it runs), so a fork while another thread loads
 *    would leave it locked in the child, whose first cuda open or probe
 *    would wait on it forever. A child handler (pthread_atfork, registered
 *    before g_lock is first taken: cu_lock) gives the child a fresh lock
 *    and, where the fork came during a load (g_state 2), the state of a
 *    driver not tried yet: the child loads it itself. Nothing is taken
 *    before the fork, so a fork never waits for a load: a driver whose
 *    constructor forks (or registers fork handlers, which glibc before 2.36
 *    serialises with a fork in progress) cannot deadlock the parent.
 */
#include <dlfcn.h>
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "device/cuda_api.h"
#include "device/device_impl.h"

#define DEFAULT_LIB "libcuda.so.1"

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_state; /* 0 not tried, 1 loaded, -1 failed, 2 loading */
static struct ferry__cuda_api g_api;
static void *g_handle;
static char g_why[FERRY__ERRMSG_MAX];
static int g_have_test_api;
static struct ferry__cuda_api g_test_api;
static char g_lib[256] = DEFAULT_LIB;
static pthread_once_t g_atfork_once = PTHREAD_ONCE_INIT;

/* the child of a fork: one thread, g_lock perhaps held by a thread it
 * does not have (async-signal-safe work only) */
static void fork_child(void)
{
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    g_lock = fresh;
    if (g_state == 2) /* a load half done: the child's own, when it wants one */
        g_state = 0;
}

static void register_atfork(void)
{
    pthread_atfork(NULL, NULL, fork_child);
}

/* g_lock, its fork handlers registered first */
static void cu_lock(void)
{
    pthread_once(&g_atfork_once, register_atfork);
    pthread_mutex_lock(&g_lock);
}

void ferry__cuda_set_api_for_test(const struct ferry__cuda_api *api)
{
    cu_lock();
    if (api) {
        g_test_api = *api;
        g_have_test_api = 1;
    } else {
        g_have_test_api = 0;
    }
    pthread_mutex_unlock(&g_lock);
}

void ferry__cuda_set_library_for_test(const char *soname)
{
    cu_lock();
    snprintf(g_lib, sizeof g_lib, "%s", soname ? soname : DEFAULT_LIB);
    /* the old handle stays loaded: pointers from it may still be in use */
    g_state = 0;
    g_handle = NULL;
    memset(&g_api, 0, sizeof g_api);
    g_why[0] = 0;
    pthread_mutex_unlock(&g_lock);
}

/* with g_lock held */
static void load_locked(void)
{
    g_state = 2; /* (until it ends, 1 or -1: a fork's child starts over) */
    dlerror();
    void *h = dlopen(g_lib, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        const char *e = dlerror();
        snprintf(g_why, sizeof g_why, "%s not found: %s", g_lib, e ? e : "unknown dlopen error");
        g_state = -1;
        return;
    }
    struct ferry__cuda_api api;
    memset(&api, 0, sizeof api);
#define FERRY__CUDA_SYM(name, R, params)                                                   \
    do {                                                                                   \
        dlerror();                                                                         \
        void *sym = dlsym(h, #name);                                                       \
        if (!sym) {                                                                        \
            const char *e = dlerror();                                                     \
            snprintf(g_why, sizeof g_why, "%s: symbol %s missing: %s", g_lib, #name,       \
                     e ? e : "NULL");                                                      \
            dlclose(h);                                                                    \
            g_state = -1;                                                                  \
            return;                                                                        \
        }                                                                                  \
        memcpy(&api.p_##name, &sym, sizeof sym);                                           \
    } while (0);
    FERRY__CUDA_API_LIST(FERRY__CUDA_SYM, ferry__CUresult, ferry__CUdevice, ferry__CUcontext,
                         ferry__CUstream, ferry__CUevent, ferry__CUdeviceptr)
#undef FERRY__CUDA_SYM
    /* optional entry points: absent on older drivers */
    void *opt = dlsym(h, "cuMemcpyBatchAsync_v2");
    memcpy(&api.p_cuMemcpyBatchAsync_v2, &opt, sizeof opt);
    opt = dlsym(h, "cuMemcpyBatchAsync");
    memcpy(&api.p_cuMemcpyBatchAsync_v1, &opt, sizeof opt);
    dlerror();
    g_api = api;
    g_handle = h;
    /* the table whole before the state that says so: a fork's child reads
     * g_state without this thread's unlock ordering the two (fork_child) */
    atomic_thread_fence(memory_order_release);
    g_state = 1;
}

int ferry__cuda_load(const struct ferry__cuda_api **out)
{
    cu_lock();
    if (g_have_test_api) {
        *out = &g_test_api;
        pthread_mutex_unlock(&g_lock);
        return 0;
    }
    if (g_state == 0)
        load_locked();
    int rc = 0;
    if (g_state == 1)
        *out = &g_api;
    else
        rc = ferry__err_set(NULL, FERRY_ENODEV, "device cuda: %s", g_why);
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* ---- errors ---- */

static int cu_code(ferry__CUresult r)
{
    switch (r) {
    case FERRY__CUDA_ERROR_OUT_OF_MEMORY: return -ENOMEM;
    case FERRY__CUDA_ERROR_NOT_READY: return -EAGAIN;
    case FERRY__CUDA_ERROR_NO_DEVICE:
    case FERRY__CUDA_ERROR_INVALID_DEVICE: return FERRY_ENODEV;
    case FERRY__CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED: return FERRY_EEXIST;
    default: return FERRY_EDRIVER;
    }
}

/* 0 when r is success; otherwise records "device cuda: <call>: NAME (r): text" */
static int cu_check(const struct ferry__cuda_api *api, ferry__CUresult r, const char *fmt, ...)
    FERRY__PRINTF(3, 4);
static int cu_check(const struct ferry__cuda_api *api, ferry__CUresult r, const char *fmt, ...)
{
    if (r == FERRY__CUDA_SUCCESS)
        return 0;
    char what[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    const char *name = NULL, *text = NULL;
    if (api->p_cuGetErrorName(r, &name) != FERRY__CUDA_SUCCESS || !name)
        name = "CUDA_ERROR_UNKNOWN_CODE";
    if (api->p_cuGetErrorString(r, &text) != FERRY__CUDA_SUCCESS || !text)
        text = "no description";
    return ferry__err_set(NULL, cu_code(r), "device cuda: %s: %s (%d): %s", what, name, (int)r,
                          text);
}

/* ---- availability ---- */

static char g_avail_why[FERRY__ERRMSG_MAX];

int ferry__cuda_available(const char **why)
{
    const struct ferry__cuda_api *api = NULL;
    int ok = 0;
    char buf[FERRY__ERRMSG_MAX];
    if (ferry__cuda_load(&api) < 0) {
        snprintf(buf, sizeof buf, "%s", ferry_last_error());
    } else {
        int count = 0;
        ferry__CUresult r = api->p_cuInit(0);
        if (r == FERRY__CUDA_SUCCESS)
            r = api->p_cuDeviceGetCount(&count);
        if (r != FERRY__CUDA_SUCCESS) {
            cu_check(api, r, "cuInit/cuDeviceGetCount");
            snprintf(buf, sizeof buf, "%s", ferry_last_error());
        } else if (count <= 0) {
            snprintf(buf, sizeof buf, "device cuda: the driver loads but sees no device");
        } else {
            snprintf(buf, sizeof buf, "%d device%s", count, count == 1 ? "" : "s");
            ok = 1;
        }
    }
    cu_lock();
    memcpy(g_avail_why, buf, sizeof g_avail_why);
    pthread_mutex_unlock(&g_lock);
    *why = ok ? "" : g_avail_why;
    return ok;
}

/* ---- device ---- */

struct cuda_dev {
    const struct ferry__cuda_api *api;
    ferry__CUdevice cudev;
    ferry__CUcontext ctx;
};

static struct cuda_dev *CD(const ferry_device *dev)
{
    return (struct cuda_dev *)dev->impl;
}

/* makes the device's context current on this thread */
static int ctx_enter(const struct cuda_dev *cd)
{
    return cu_check(cd->api, cd->api->p_cuCtxSetCurrent(cd->ctx), "cuCtxSetCurrent(ctx=%p)",
                    (void *)cd->ctx);
}

ferry__CUcontext ferry__cuda_context(const struct ferry_device *dev)
{
    return dev && dev->ops == &ferry__device_cuda_ops ? CD(dev)->ctx : NULL;
}

int ferry__cuda_device_ordinal(const struct ferry_device *dev)
{
    return dev && dev->ops == &ferry__device_cuda_ops ? CD(dev)->cudev : -1;
}

static int c_open(ferry_device *dev, const ferry_device_options *opt)
{
    const struct ferry__cuda_api *api = NULL;
    int rc = ferry__cuda_load(&api);
    if (rc < 0)
        return rc;
    int ordinal = opt ? opt->ordinal : 0;
    struct cuda_dev *cd = ferry__calloc(1, sizeof *cd);
    if (!cd)
        return ferry__err_set(NULL, -ENOMEM, "device cuda: open: out of memory");
    cd->api = api;
    rc = cu_check(api, api->p_cuInit(0), "cuInit(0)");
    if (rc == 0)
        rc = cu_check(api, api->p_cuDeviceGet(&cd->cudev, ordinal), "cuDeviceGet(ordinal=%d)",
                      ordinal);
    char name[sizeof dev->name];
    if (rc == 0)
        rc = cu_check(api, api->p_cuDeviceGetName(name, (int)sizeof name, cd->cudev),
                      "cuDeviceGetName(dev=%d)", cd->cudev);
    if (rc == 0)
        rc = cu_check(api, api->p_cuDevicePrimaryCtxRetain(&cd->ctx, cd->cudev),
                      "cuDevicePrimaryCtxRetain(dev=%d)", cd->cudev);
    if (rc == 0) {
        rc = ctx_enter(cd);
        if (rc < 0)
            api->p_cuDevicePrimaryCtxRelease_v2(cd->cudev);
    }
    if (rc < 0) {
        ferry__free(cd);
        return rc;
    }
    name[sizeof name - 1] = 0;
    snprintf(dev->name, sizeof dev->name, "%s", name);
    dev->impl = cd;
    return 0;
}

static void c_close(ferry_device *dev)
{
    struct cuda_dev *cd = CD(dev);
    ctx_enter(cd);
    int rc = cu_check(cd->api, cd->api->p_cuDevicePrimaryCtxRelease_v2(cd->cudev),
                      "cuDevicePrimaryCtxRelease_v2(dev=%d)", cd->cudev);
    if (rc < 0)
        FERRY_LOGW("%s", ferry_last_error());
    ferry__free(cd);
    dev->impl = NULL;
}

static int c_alloc(ferry_device *dev, size_t bytes, ferry_devptr *out)
{
    struct cuda_dev *cd = CD(dev);
    int rc = ctx_enter(cd);
    if (rc < 0)
        return rc;
    ferry__CUdeviceptr p = 0;
    rc = cu_check(cd->api, cd->api->p_cuMemAlloc_v2(&p, bytes), "cuMemAlloc_v2(bytes=%zu)",
                  bytes);
    if (rc == 0)
        *out = (ferry_devptr)p;
    return rc;
}

static int c_free(ferry_device *dev, ferry_devptr ptr, size_t bytes)
{
    struct cuda_dev *cd = CD(dev);
    int rc = ctx_enter(cd);
    if (rc < 0)
        return rc;
    return cu_check(cd->api, cd->api->p_cuMemFree_v2((ferry__CUdeviceptr)ptr),
                    "cuMemFree_v2(0x%" PRIx64 ", %zu bytes)", ptr, bytes);
}

static int c_host_alloc(ferry_device *dev, size_t bytes, void **out)
{
    struct cuda_dev *cd = CD(dev);
    int rc = ctx_enter(cd);
    if (rc < 0)
        return rc;
    void *p = NULL;
    rc = cu_check(cd->api, cd->api->p_cuMemAllocHost_v2(&p, bytes),
                  "cuMemAllocHost_v2(bytes=%zu)", bytes);
    if (rc == 0)
        *out = p;
    return rc;
}

static int c_host_free(ferry_device *dev, void *ptr, size_t bytes)
{
    struct cuda_dev *cd = CD(dev);
    int rc = ctx_enter(cd);
    if (rc < 0)
        return rc;
    return cu_check(cd->api, cd->api->p_cuMemFreeHost(ptr), "cuMemFreeHost(%p, %zu bytes)", ptr,
                    bytes);
}

static int c_pin(ferry_device *dev, void *host, size_t bytes)
{
    struct cuda_dev *cd = CD(dev);
    int rc = ctx_enter(cd);
    if (rc < 0)
        return rc;
    return cu_check(cd->api,
                    cd->api->p_cuMemHostRegister_v2(host, bytes,
                                                    FERRY__CU_MEMHOSTREGISTER_PORTABLE),
                    "cuMemHostRegister_v2(%p, bytes=%zu, PORTABLE)", host, bytes);
}

static int c_unpin(ferry_device *dev, void *host, size_t bytes)
{
    struct cuda_dev *cd = CD(dev);
    int rc = ctx_enter(cd);
    if (rc < 0)
        return rc;
    return cu_check(cd->api, cd->api->p_cuMemHostUnregister(host),
                    "cuMemHostUnregister(%p, %zu bytes)", host, bytes);
}

static void *c_devptr_host(const ferry_device *dev, ferry_devptr ptr)
{
    (void)dev;
    (void)ptr;
    return NULL;
}

static int c_memset(ferry_device *dev, ferry_devptr dst, int byte, size_t n)
{
    struct cuda_dev *cd = CD(dev);
    int rc = ctx_enter(cd);
    if (rc < 0)
        return rc;
    rc = cu_check(cd->api, cd->api->p_cuMemsetD8_v2((ferry__CUdeviceptr)dst, (unsigned char)byte, n),
                  "cuMemsetD8_v2(0x%" PRIx64 ", 0x%02x, %zu)", dst, (unsigned)(byte & 0xff), n);
    if (rc == 0) /* the memset runs on the legacy stream: wait for it */
        rc = cu_check(cd->api, cd->api->p_cuStreamSynchronize(NULL),
                      "cuStreamSynchronize(legacy stream) after memset of %zu bytes", n);
    return rc;
}

/* ---- streams ---- */

static ferry__CUstream CS(const ferry_stream *s)
{
    return (ferry__CUstream)s->impl;
}

static int c_stream_create(ferry_device *dev, ferry_stream *s)
{
    struct cuda_dev *cd = CD(dev);
    int rc = ctx_enter(cd);
    if (rc < 0)
        return rc;
    ferry__CUstream st = NULL;
    rc = cu_check(cd->api, cd->api->p_cuStreamCreate(&st, FERRY__CU_STREAM_NON_BLOCKING),
                  "cuStreamCreate(NON_BLOCKING)");
    if (rc == 0)
        s->impl = st;
    return rc;
}

static int c_stream_destroy(ferry_stream *s)
{
    struct cuda_dev *cd = CD(s->dev);
    int rc = ctx_enter(cd);
    if (rc < 0)
        return rc;
    rc = cu_check(cd->api, cd->api->p_cuStreamSynchronize(CS(s)), "cuStreamSynchronize(%p)",
                  (void *)CS(s));
    int rd = cu_check(cd->api, cd->api->p_cuStreamDestroy_v2(CS(s)), "cuStreamDestroy_v2(%p)",
                      (void *)CS(s));
    s->impl = NULL;
    return rc < 0 ? rc : rd;
}

static int c_stream_sync(ferry_stream *s)
{
    struct cuda_dev *cd = CD(s->dev);
    int rc = ctx_enter(cd);
    if (rc < 0)
        return rc;
    return cu_check(cd->api, cd->api->p_cuStreamSynchronize(CS(s)), "cuStreamSynchronize(%p)",
                    (void *)CS(s));
}

static uint64_t c_stream_handle(const ferry_stream *s)
{
    return (uint64_t)(uintptr_t)CS(s);
}

static int c_memcpy_htod(ferry_stream *s, ferry_devptr dst, const void *src, size_t n,
                         const struct ferry__copy_fault *f)
{
    (void)f;
    struct cuda_dev *cd = CD(s->dev);
    int rc = ctx_enter(cd);
    if (rc < 0)
        return rc;
    return cu_check(cd->api,
                    cd->api->p_cuMemcpyHtoDAsync_v2((ferry__CUdeviceptr)dst, src, n, CS(s)),
                    "cuMemcpyHtoDAsync_v2(dst=0x%" PRIx64 ", src=%p, %zu bytes, stream=%p)", dst,
                    src, n, (void *)CS(s));
}

static int c_memcpy_dtoh(ferry_stream *s, void *dst, ferry_devptr src, size_t n,
                         const struct ferry__copy_fault *f)
{
    (void)f;
    struct cuda_dev *cd = CD(s->dev);
    int rc = ctx_enter(cd);
    if (rc < 0)
        return rc;
    return cu_check(cd->api,
                    cd->api->p_cuMemcpyDtoHAsync_v2(dst, (ferry__CUdeviceptr)src, n, CS(s)),
                    "cuMemcpyDtoHAsync_v2(dst=%p, src=0x%" PRIx64 ", %zu bytes, stream=%p)", dst,
                    src, n, (void *)CS(s));
}

/* copies in one cuMemcpyBatchAsync call; FERRY_ENOTSUP without one */
static int c_memcpy_batch(ferry_stream *s, int kind, const ferry_copy *copies, size_t n)
{
    (void)kind; /* unified addressing: the driver tells host from device */
    struct cuda_dev *cd = CD(s->dev);
    const struct ferry__cuda_api *api = cd->api;
    if ((!api->p_cuMemcpyBatchAsync_v2 && !api->p_cuMemcpyBatchAsync_v1) || !CS(s))
        return FERRY_ENOTSUP; /* no batched copy, or the legacy stream it refuses */
    int rc = ctx_enter(cd);
    if (rc < 0)
        return rc;
    if (n > SIZE_MAX / (2 * sizeof(ferry__CUdeviceptr) + sizeof(size_t)))
        return ferry__err_set(NULL, -EINVAL, "device cuda: memcpy batch of %zu copies", n);
    ferry__CUdeviceptr *a = ferry__malloc(n * (2 * sizeof *a + sizeof(size_t)));
    if (!a)
        return ferry__err_set(NULL, -ENOMEM, "device cuda: memcpy batch of %zu: out of memory",
                              n);
    ferry__CUdeviceptr *dsts = a, *srcs = a + n;
    size_t *sizes = (size_t *)(void *)(a + 2 * n), count = 0;
    for (size_t i = 0; i < n; i++) {
        if (!copies[i].bytes)
            continue;
        dsts[count] = copies[i].dst;
        srcs[count] = copies[i].src;
        sizes[count++] = (size_t)copies[i].bytes;
    }
    ferry__CUmemcpyAttributes attr;
    memset(&attr, 0, sizeof attr);
    attr.srcAccessOrder = FERRY__CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
    size_t idx = 0, fail = SIZE_MAX;
    ferry__CUresult r;
    const char *fn;
    if (api->p_cuMemcpyBatchAsync_v2) {
        fn = "cuMemcpyBatchAsync_v2";
        r = api->p_cuMemcpyBatchAsync_v2(dsts, srcs, sizes, count, &attr, &idx, 1, CS(s));
    } else {
        fn = "cuMemcpyBatchAsync";
        r = api->p_cuMemcpyBatchAsync_v1(dsts, srcs, sizes, count, &attr, &idx, 1, &fail, CS(s));
    }
    if (r != FERRY__CUDA_SUCCESS && fail < count)
        rc = cu_check(api, r, "%s(%zu copies, stream=%p): copy %zu (dst=0x%llx, src=0x%llx, %zu "
                      "bytes)", fn, count, (void *)CS(s), fail, (unsigned long long)dsts[fail],
                      (unsigned long long)srcs[fail], sizes[fail]);
    else
        rc = cu_check(api, r, "%s(%zu copies, stream=%p)", fn, count, (void *)CS(s));
    ferry__free(a);
    return rc;
}

static int c_memcpy_dtod(ferry_stream *s, ferry_devptr dst, ferry_devptr src, size_t n,
                         const struct ferry__copy_fault *f)
{
    (void)f;
    struct cuda_dev *cd = CD(s->dev);
    int rc = ctx_enter(cd);
    if (rc < 0)
        return rc;
    return cu_check(cd->api,
                    cd->api->p_cuMemcpyDtoDAsync_v2((ferry__CUdeviceptr)dst,
                                                    (ferry__CUdeviceptr)src, n, CS(s)),
                    "cuMemcpyDtoDAsync_v2(dst=0x%" PRIx64 ", src=0x%" PRIx64
                    ", %zu bytes, stream=%p)",
                    dst, src, n, (void *)CS(s));
}

/* ---- events ---- */

static ferry__CUevent CE(const ferry_event *e)
{
    return (ferry__CUevent)e->impl;
}

static int c_event_create(ferry_device *dev, ferry_event *e)
{
    struct cuda_dev *cd = CD(dev);
    int rc = ctx_enter(cd);
    if (rc < 0)
        return rc;
    ferry__CUevent ev = NULL;
    rc = cu_check(cd->api, cd->api->p_cuEventCreate(&ev, FERRY__CU_EVENT_DEFAULT),
                  "cuEventCreate(DEFAULT)");
    if (rc == 0)
        e->impl = ev;
    return rc;
}

/* an engine's CUstream / CUevent, used as it is (0 is the legacy default
 * stream, which the batched copy does not take: copies go one by one) */
static int c_stream_import(ferry_device *dev, ferry_stream *s, uint64_t handle)
{
    (void)dev;
    s->impl = (void *)(uintptr_t)handle;
    return 0;
}

static int c_event_import(ferry_device *dev, ferry_event *e, uint64_t handle)
{
    if (!handle)
        return ferry__err_set(NULL, -EINVAL, "device %s: event import: the handle is 0",
                              dev->name);
    e->impl = (void *)(uintptr_t)handle;
    return 0;
}

static void c_event_destroy(ferry_event *e)
{
    struct cuda_dev *cd = CD(e->dev);
    if (ctx_enter(cd) == 0 &&
        cu_check(cd->api, cd->api->p_cuEventDestroy_v2(CE(e)), "cuEventDestroy_v2(%p)",
                 (void *)CE(e)) < 0)
        FERRY_LOGW("%s", ferry_last_error());
    e->impl = NULL;
}

static int c_event_record(ferry_event *e, ferry_stream *s)
{
    struct cuda_dev *cd = CD(e->dev);
    int rc = ctx_enter(cd);
    if (rc < 0)
        return rc;
    return cu_check(cd->api, cd->api->p_cuEventRecord(CE(e), CS(s)),
                    "cuEventRecord(event=%p, stream=%p)", (void *)CE(e), (void *)CS(s));
}

static int c_event_query(ferry_event *e)
{
    struct cuda_dev *cd = CD(e->dev);
    int rc = ctx_enter(cd);
    if (rc < 0)
        return rc;
    ferry__CUresult r = cd->api->p_cuEventQuery(CE(e));
    if (r == FERRY__CUDA_ERROR_NOT_READY)
        return -EAGAIN;
    return cu_check(cd->api, r, "cuEventQuery(%p)", (void *)CE(e));
}

static int c_event_sync(ferry_event *e)
{
    struct cuda_dev *cd = CD(e->dev);
    int rc = ctx_enter(cd);
    if (rc < 0)
        return rc;
    return cu_check(cd->api, cd->api->p_cuEventSynchronize(CE(e)), "cuEventSynchronize(%p)",
                    (void *)CE(e));
}

static int c_event_elapsed(ferry_event *a, ferry_event *b, float *ms)
{
    struct cuda_dev *cd = CD(a->dev);
    int rc = ctx_enter(cd);
    if (rc < 0)
        return rc;
    float v = 0;
    rc = cu_check(cd->api, cd->api->p_cuEventElapsedTime(&v, CE(a), CE(b)),
                  "cuEventElapsedTime(start=%p, end=%p)", (void *)CE(a), (void *)CE(b));
    if (rc == 0)
        *ms = v;
    return rc;
}

static int c_stream_wait_event(ferry_stream *s, ferry_event *e)
{
    struct cuda_dev *cd = CD(s->dev);
    int rc = ctx_enter(cd);
    if (rc < 0)
        return rc;
    return cu_check(cd->api, cd->api->p_cuStreamWaitEvent(CS(s), CE(e), 0),
                    "cuStreamWaitEvent(stream=%p, event=%p)", (void *)CS(s), (void *)CE(e));
}

const struct ferry__device_ops ferry__device_cuda_ops = {
    .name = "cuda",
    .simulated = 0,
    .open = c_open,
    .close = c_close,
    .alloc = c_alloc,
    .free = c_free,
    .host_alloc = c_host_alloc,
    .host_free = c_host_free,
    .pin = c_pin,
    .unpin = c_unpin,
    .devptr_host = c_devptr_host,
    .memset = c_memset,
    .stream_create = c_stream_create,
    .stream_destroy = c_stream_destroy,
    .stream_sync = c_stream_sync,
    .stream_handle = c_stream_handle,
    .memcpy_htod = c_memcpy_htod,
    .memcpy_dtoh = c_memcpy_dtoh,
    .memcpy_dtod = c_memcpy_dtod,
    .memcpy_batch = c_memcpy_batch,
    .event_create = c_event_create,
    .event_destroy = c_event_destroy,
    .event_record = c_event_record,
    .event_query = c_event_query,
    .event_sync = c_event_sync,
    .event_elapsed = c_event_elapsed,
    .stream_wait_event = c_stream_wait_event,
    .stream_import = c_stream_import,
    .event_import = c_event_import,
};
