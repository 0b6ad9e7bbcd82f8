/*
 * ferry/device.h - device memory, pinned host memory, streams and events.
 *
 * One API over several backends, each a table of operations:
 *  - "host": device memory simulated in host memory. Streams are real
 *    FIFO queues executed by a worker thread, so asynchronous copies do
 *    overlap with the caller, and events behave as on a GPU. Tests inject
 *    faults into it (fail the Nth call, short copies) through
 *    ferry_test_control (ferry/testctl.h).
 *  - "cuda": the CUDA driver API, loaded with dlopen("libcuda.so.1") at
 *    run time. Without a driver, opening it fails with FERRY_ENODEV.
 *  - "auto": cuda when it opens, host otherwise.
 *
 * Device addresses are integers (ferry_devptr), like CUdeviceptr: they are
 * never dereferenced by the caller. On the host backend they are host
 * addresses, so tests may inspect them with ferry_devptr_host().
 *
 * Thread-safety: a ferry_device may be used from several threads; a
 * ferry_stream is used by one thread at a time (as CUDA streams are in
 * practice); events may be queried from any thread.
 *
 * Errors: every call returns 0 or a negative code and records a message on
 * the device (ferry_device_last_error) and the thread (ferry_last_error).
 * Common to all calls: -EINVAL for a NULL handle/out-parameter or a pointer
 * this device did not hand out; FERRY_EDRIVER for any other CUDA failure
 * (the message names the call, its arguments and the CUDA error name).
 *
 * Asynchronous errors: a copy that fails after it was queued (host fault
 * injection; on cuda, the driver's sticky errors) is reported by the next
 * ferry_stream_sync on that stream (once), and by ferry_event_sync /
 * ferry_event_query of an event recorded after it on that stream.
 *
 * Host backend specifics: device memory is 4096-byte aligned host memory;
 * every device range a copy or memset touches must lie inside one live
 * allocation of the device (FERRY_EBOUNDS otherwise, with the allocation
 * named), so an overrun fails cleanly instead of corrupting the heap.
 * Freeing device memory, pinned memory or unpinning first waits for all
 * queued work on the device's streams (as cuMemFree does).
 */
#ifndef FERRY_DEVICE_H
#define FERRY_DEVICE_H

#include "core.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef uint64_t ferry_devptr;
typedef struct ferry_device ferry_device;
typedef struct ferry_stream ferry_stream;
typedef struct ferry_event ferry_event;

typedef struct ferry_device_options {
    /** sizeof(ferry_device_options), or an older header's: at least
     *  FERRY_DEVICE_OPTIONS_MIN_SIZE (up to ordinal); members past the
     *  size keep their defaults */
    size_t size;
    /** "auto" (NULL), "host" or "cuda"; anything else (also "") -EINVAL */
    const char *backend;
    int ordinal;          /**< device index for cuda: 0..INT_MAX */
    /** cap on the device bytes this handle may hold at once (any backend),
        any value; an allocation past it fails with -ENOMEM. 0 = no cap. */
    uint64_t mem_limit;
} ferry_device_options;
#define FERRY_DEVICE_OPTIONS_INIT \
    {FERRY_FIELD(size) sizeof(ferry_device_options), FERRY_FIELD(backend) NULL, \
     FERRY_FIELD(ordinal) 0, FERRY_FIELD(mem_limit) 0}
/** The smallest size ferry_device_open takes: the options up to ordinal. */
#define FERRY_DEVICE_OPTIONS_MIN_SIZE (offsetof(ferry_device_options, ordinal) + sizeof(int))

/**
 * Open a device. opt may be NULL (auto, ordinal 0). Backend
 * "auto" (or NULL) takes env FERRY_DEVICE when set, else cuda when it opens,
 * else host; an explicit backend is never overridden.
 * Every option is range-checked before it is used.
 * Errors: FERRY_ENODEV (no driver: "libcuda.so.1 not found: ...", no such
 * ordinal), -EINVAL with a message naming the field, its value and the
 * accepted range (unknown or empty backend, an options size outside
 * FERRY_DEVICE_OPTIONS_MIN_SIZE..sizeof, negative ordinal), -ENOMEM,
 * FERRY_EDRIVER. *out is untouched on failure.
 */
FERRY_API int ferry_device_open(const ferry_device_options *opt, ferry_device **out);
/**
 * Close: destroys the streams and events still alive (waiting for their
 * work), then frees device memory and pinned memory still allocated and
 * unpins what is still pinned. Handles from this device are invalid after.
 * NULL does nothing. Not concurrent with other calls on dev.
 */
FERRY_API void ferry_device_close(ferry_device *dev);
/** "host" or "cuda". */
FERRY_API const char *ferry_device_backend(const ferry_device *dev);
/** A readable name ("host (simulated)", "NVIDIA H200", ...). */
FERRY_API const char *ferry_device_name(const ferry_device *dev);
/** The message of this device's last failure, "" if none. */
FERRY_API const char *ferry_device_last_error(const ferry_device *dev);
/**
 * Whether a backend can be opened here; when not, *why (if non-NULL) gets a
 * static or per-process string saying why ("libcuda.so.1 not found: ...").
 */
FERRY_API int ferry_device_backend_available(const char *backend, const char **why);
/**
 * Allocate device memory (256-byte aligned at least; 4096 on host). The
 * device owns it until ferry_device_free or close.
 * Errors: -EINVAL (0 bytes), -ENOMEM (exhausted, or over mem_limit).
 */
FERRY_API int ferry_device_alloc(ferry_device *dev, size_t bytes, ferry_devptr *out);
/**
 * Free device memory from ferry_device_alloc (waits for queued work on host).
 * Errors: -EINVAL for an unknown, interior or already freed pointer (the
 * driver is never called with it).
 */
FERRY_API int ferry_device_free(ferry_device *dev, ferry_devptr ptr);
/**
 * Allocate page-aligned pinned (page-locked, DMA-able) host memory
 * (cuMemAllocHost; on host: page-aligned memory, mlock best effort).
 * Errors: -EINVAL (0 bytes), -ENOMEM.
 */
FERRY_API int ferry_device_host_alloc(ferry_device *dev, size_t bytes, void **out);
/** Free memory from ferry_device_host_alloc. Unknown/interior/double: -EINVAL. */
FERRY_API int ferry_device_host_free(ferry_device *dev, void *ptr);
/**
 * Pin (page-lock and register for DMA) caller memory; the caller keeps
 * ownership and must unpin before freeing it. Errors: -EINVAL (NULL, 0
 * bytes), FERRY_EEXIST (overlaps a range already pinned or a pinned
 * allocation of this device). On host: mlock best effort.
 */
FERRY_API int ferry_device_pin(ferry_device *dev, void *host, size_t bytes);
/** Unpin a range pinned with ferry_device_pin, by its start. Unknown: -EINVAL. */
FERRY_API int ferry_device_unpin(ferry_device *dev, void *host);
/**
 * On the host backend: the host address behind a device pointer inside a
 * live allocation; NULL otherwise and always on cuda.
 */
FERRY_API void *ferry_devptr_host(const ferry_device *dev, ferry_devptr ptr);

/*
 * Synchronous helpers: set, upload, download; they return when the bytes
 * are in place. Upload/download run on an internal stream (serialized
 * between threads); memset on host first waits for all queued work, on cuda
 * it runs on the legacy stream (not ordered with work queued on ferry
 * streams: sync those first). n == 0 does nothing. Errors: -EINVAL,
 * FERRY_EBOUNDS (host), FERRY_ESHORT / injected codes (host faults),
 * FERRY_EDRIVER.
 */
FERRY_API int ferry_device_memset(ferry_device *dev, ferry_devptr dst, int byte, size_t n);
FERRY_API int ferry_device_upload(ferry_device *dev, ferry_devptr dst, const void *src, size_t n);
FERRY_API int ferry_device_download(ferry_device *dev, void *dst, ferry_devptr src, size_t n);

/* ---- streams ---- */
/**
 * Create a stream: an in-order queue of copies and event marks (on cuda a
 * non-blocking CUstream; on host a worker thread). Errors: -ENOMEM,
 * -EAGAIN (no thread), FERRY_EDRIVER.
 */
FERRY_API int ferry_stream_create(ferry_device *dev, ferry_stream **out);
/**
 * Waits for queued work, then destroys; returns an asynchronous error not
 * yet reported (the stream is destroyed anyway). NULL does nothing (0).
 */
FERRY_API int ferry_stream_destroy(ferry_stream *s);
/**
 * Wrap a stream the engine created (on cuda, a CUstream, as
 * torch.cuda.Stream.cuda_stream gives it; 0 is the legacy default stream)
 * so ferry's copies are queued on it, in the engine's order with its own
 * work. ferry does not own it: ferry_stream_destroy frees only the wrapper
 * (no wait, no cuStreamDestroy), and the engine keeps the stream alive
 * while ferry uses it. Errors: -EINVAL (NULL), FERRY_ENOTSUP (a backend
 * without raw streams: host), -ENOMEM.
 */
FERRY_API int ferry_stream_import(ferry_device *dev, uint64_t handle, ferry_stream **out);
/**
 * Wrap an engine's event (on cuda, a CUevent) for ferry_event_record,
 * ferry_stream_wait_event, query and sync: the way an engine and ferry
 * order work between their streams without blocking the host.
 * ferry_event_destroy frees only the wrapper. Errors: -EINVAL (NULL, a 0
 * handle), FERRY_ENOTSUP (host), -ENOMEM.
 */
FERRY_API int ferry_event_import(ferry_device *dev, uint64_t handle, ferry_event **out);
/** Block until all work queued on s is done; returns the first async error. */
FERRY_API int ferry_stream_sync(ferry_stream *s);
/** The backend's raw stream handle (a CUstream on cuda): what cuFile registers. */
FERRY_API uint64_t ferry_stream_handle(const ferry_stream *s);
FERRY_API ferry_device *ferry_stream_device(const ferry_stream *s);

/* Asynchronous copies: queued on s, in order; the call returns before the
 * bytes move, and both buffers must stay valid until a sync/event says the
 * copy is done. Host memory should be pinned for the copy to be truly
 * asynchronous on cuda. n == 0 does nothing. Errors at queue time: -EINVAL
 * (NULL buffer, device pointer 0), FERRY_EBOUNDS (host: range outside
 * every allocation), -ENOMEM, FERRY_EDRIVER; later ones at sync. dtod
 * ranges may overlap on host (memmove), not on cuda. */
FERRY_API int ferry_memcpy_htod_async(ferry_stream *s, ferry_devptr dst, const void *src, size_t n);
FERRY_API int ferry_memcpy_dtoh_async(ferry_stream *s, void *dst, ferry_devptr src, size_t n);
FERRY_API int ferry_memcpy_dtod_async(ferry_stream *s, ferry_devptr dst, ferry_devptr src, size_t n);

/** One copy of a batch: addresses as its kind says (a host address or a
 *  ferry_devptr), and its length in bytes (0: skipped). */
typedef struct ferry_copy {
    uint64_t dst;
    uint64_t src;
    uint64_t bytes;
} ferry_copy;

enum ferry_copy_kind {
    FERRY_COPY_HTOD = 0, /**< host src -> device dst */
    FERRY_COPY_DTOH = 1, /**< device src -> host dst */
    FERRY_COPY_DTOD = 2  /**< device src -> device dst */
};

/**
 * Queue copies[0..n) of one kind on s as one batch: a single driver call
 * where the backend has a batched copy (cuda: cuMemcpyBatchAsync, CUDA 12.8
 * and later, loaded when the driver exports it; source access in stream
 * order), one call per copy otherwise (the host backend, older drivers,
 * and whenever test faults are armed). The batch runs in stream order with
 * other work; the copies within it may run in any order among themselves,
 * so no copy may write what another reads or writes. Every copy is checked
 * before any is queued. Returns the number of driver calls it took (0 when
 * every copy was empty), or a code as ferry_memcpy_*_async: -EINVAL (NULL
 * s or copies with n > 0, an unknown kind, an address 0), FERRY_EBOUNDS,
 * FERRY_EDRIVER. After a failure part of the batch may have been queued;
 * synchronize before reusing its buffers.
 */
FERRY_API int ferry_memcpy_batch_async(ferry_stream *s, int kind, const ferry_copy *copies,
                                       size_t n);

/* ---- events ---- */
/** Create an event (timing enabled). A never-recorded event counts as complete. */
FERRY_API int ferry_event_create(ferry_device *dev, ferry_event **out);
/** Destroy; safe while a record of it is still queued. NULL does nothing. */
FERRY_API void ferry_event_destroy(ferry_event *e);
/**
 * Mark the point in s's queue; the event completes when s passes it.
 * Re-recording moves the mark (the event is pending again). The stream must
 * belong to the event's device (-EINVAL).
 */
FERRY_API int ferry_event_record(ferry_event *e, ferry_stream *s);
/** 0 when complete, -EAGAIN when not yet, another negative code on error. */
FERRY_API int ferry_event_query(ferry_event *e);
/** Block until the event completes; returns an async error before the mark. */
FERRY_API int ferry_event_sync(ferry_event *e);
/**
 * Make s wait (on the device, not the host) until the record of e made
 * before this call completes; work queued on s later starts after it.
 */
FERRY_API int ferry_stream_wait_event(ferry_stream *s, ferry_event *e);
/**
 * Milliseconds between two completed events (negative if end came first).
 * Errors: -EAGAIN (one not complete), FERRY_ESTATE (host: one never
 * recorded), FERRY_EDRIVER. *ms is untouched on failure.
 */
FERRY_API int ferry_event_elapsed_ms(ferry_event *start, ferry_event *end, float *ms);

#ifdef __cplusplus
}
#endif
#endif
