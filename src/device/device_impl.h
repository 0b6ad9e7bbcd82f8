/*
 * device_impl.h - private: the operations table every device backend
 * implements, and the front's objects (ferry_device, ferry_stream,
 * ferry_event). Not installed.
 *
 * Division of work: the front (device.c) validates arguments, keeps the
 * tables of what was allocated (so an unknown or double free is -EINVAL on
 * every backend, and close can free leftovers), applies host fault
 * injection and records per-device messages. A backend only does the work.
 * Backend operations report failures through the calling thread's message
 * (ferry__err_set(NULL, ...)); the front copies it onto the device handle.
 */
#ifndef FERRY_SRC_DEVICE_IMPL_H
#define FERRY_SRC_DEVICE_IMPL_H

#include <pthread.h>
#include <stdatomic.h>

#include "core.h"
#include "ferry/device.h"

/* A fault the front decided to inject into one asynchronous copy. The copy
 * is still queued (the error is asynchronous, as on a GPU): when fail_code is
 * nonzero it moves nothing and fails with fail_code; otherwise when
 * short_bytes < n it moves short_bytes and fails with FERRY_ESHORT. The
 * failure is reported by the next stream/event synchronization. */
struct ferry__copy_fault {
    int fail_code;
    size_t short_bytes;
};

struct ferry__device_ops {
    const char *name;
    /* host only: the front checks device ranges and applies fault injection */
    int simulated;
    /* open fills dev->impl and dev->name */
    int (*open)(ferry_device *dev, const ferry_device_options *opt);
    void (*close)(ferry_device *dev);
    int (*alloc)(ferry_device *dev, size_t bytes, ferry_devptr *out);
    int (*free)(ferry_device *dev, ferry_devptr ptr, size_t bytes);
    int (*host_alloc)(ferry_device *dev, size_t bytes, void **out);
    int (*host_free)(ferry_device *dev, void *ptr, size_t bytes);
    int (*pin)(ferry_device *dev, void *host, size_t bytes);
    int (*unpin)(ferry_device *dev, void *host, size_t bytes);
    void *(*devptr_host)(const ferry_device *dev, ferry_devptr ptr);
    /* synchronous: returns when the bytes are set */
    int (*memset)(ferry_device *dev, ferry_devptr dst, int byte, size_t n);

    /* stream_create fills s->impl; stream_destroy waits for queued work */
    int (*stream_create)(ferry_device *dev, ferry_stream *s);
    int (*stream_destroy)(ferry_stream *s);
    int (*stream_sync)(ferry_stream *s);
    uint64_t (*stream_handle)(const ferry_stream *s);
    /* f is NULL when nothing is injected */
    int (*memcpy_htod)(ferry_stream *s, ferry_devptr dst, const void *src, size_t n,
                       const struct ferry__copy_fault *f);
    int (*memcpy_dtoh)(ferry_stream *s, void *dst, ferry_devptr src, size_t n,
                       const struct ferry__copy_fault *f);
    int (*memcpy_dtod)(ferry_stream *s, ferry_devptr dst, ferry_devptr src, size_t n,
                       const struct ferry__copy_fault *f);
    /* optional: copies[0..n) (checked; empty ones skipped) in one driver call;
     * FERRY_ENOTSUP when this driver has no batched copy (the front then
     * queues them one by one) */
    int (*memcpy_batch)(ferry_stream *s, int kind, const ferry_copy *copies, size_t n);

    /* event_create fills e->impl */
    int (*event_create)(ferry_device *dev, ferry_event *e);
    void (*event_destroy)(ferry_event *e);
    int (*event_record)(ferry_event *e, ferry_stream *s);
    int (*event_query)(ferry_event *e);
    int (*event_sync)(ferry_event *e);
    int (*event_elapsed)(ferry_event *start, ferry_event *end, float *ms);
    int (*stream_wait_event)(ferry_stream *s, ferry_event *e);

    /* optional: wrap an engine's raw stream / event handle (fills impl);
     * NULL: the backend has none (FERRY_ENOTSUP) */
    int (*stream_import)(ferry_device *dev, ferry_stream *s, uint64_t handle);
    int (*event_import)(ferry_device *dev, ferry_event *e, uint64_t handle);
};

/* put a new stream / event on the device's lists (for close) */
void ferry__dev_track_stream(ferry_device *dev, ferry_stream *s);
void ferry__dev_track_event(ferry_device *dev, ferry_event *e);

/* A tracked range: device allocation, pinned host allocation or pinned
 * caller memory. */
struct ferry__region {
    uint64_t base;
    size_t len;
    int kind; /* FERRY__REG_* */
};
enum { FERRY__REG_DEVICE = 1, FERRY__REG_HOST_ALLOC = 2, FERRY__REG_PINNED = 3 };

struct ferry__region_table {
    struct ferry__region *v; /* sorted by base, non-overlapping */
    size_t n, cap;
};

struct ferry_device {
    const struct ferry__device_ops *ops;
    void *impl;
    char name[128];

    pthread_mutex_t lock; /* err, tables, faults, object lists, mem_used */
    ferry__errbuf err;
    struct ferry__region_table dev_regions;
    struct ferry__region_table host_regions;
    uint64_t mem_limit, mem_used;

    /* test faults (ferry_test_control), under lock; faults_on says whether
     * any is armed, so an unarmed device never takes the lock for them */
    atomic_int faults_on;
    uint64_t fail_nth, fault_count;
    int fail_code;
    size_t short_copy;
    unsigned fault_mask;

    pthread_mutex_t helper_lock; /* serializes memset/upload/download */
    ferry_stream *helper;        /* internal stream, created on first use */

    ferry_stream *streams; /* live streams, for close */
    ferry_event *events;   /* live events, for close */
};

struct ferry_stream {
    ferry_device *dev;
    void *impl;
    int imported; /* the engine's (ferry_stream_import): never destroyed here */
    ferry_stream *prev, *next;
};

struct ferry_event {
    ferry_device *dev;
    void *impl;
    int imported; /* the engine's (ferry_event_import): never destroyed here */
    ferry_event *prev, *next;
};

extern const struct ferry__device_ops ferry__device_host_ops;
extern const struct ferry__device_ops ferry__device_cuda_ops;

/*
 * Host backend test seam: while held, the stream's worker starts no new
 * operation (one already running finishes), so a test can observe queued
 * work deterministically: copies that have not happened, events not yet
 * complete, a second stream blocked in stream_wait_event. Release with
 * hold = 0. FERRY_ENOTSUP on other backends.
 */
int ferry__device_host_hold(ferry_stream *s, int hold);

/* cuda.c: whether the driver loads and has a device; *why when not */
int ferry__cuda_available(const char **why);

#endif
