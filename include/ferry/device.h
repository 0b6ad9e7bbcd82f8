/*
 * ferry/device.h - device memory, pinned host memory, streams and events.
 *
 * One API over several backends, each a table of operations:
 *  - "host": device memory simulated in host memory. Streams are real
 *    FIFO queues executed by a worker thread, so asynchronous copies do
 *    overlap with the caller, and events behave as on a GPU. Fault injection
 *    (fail the Nth call, short copies) is available through options.
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
    size_t size;          /**< sizeof(ferry_device_options) */
    const char *backend;  /**< "auto" (NULL), "host" or "cuda" */
    int ordinal;          /**< device index for cuda */
    /* host backend fault injection (ignored by cuda) */
    uint64_t fail_nth;    /**< fail the Nth counted call (1-based); 0 = never */
    int fail_code;        /**< code the failed call returns; 0 -> FERRY_EINJECTED */
    size_t short_copy;    /**< if nonzero, copies move at most this many bytes and
                               report FERRY_ESHORT */
    /** which calls fail_nth counts: FERRY_FAULT_* bits; 0 = all */
    unsigned fault_mask;
    /** cap on the device bytes this handle may hold at once (any backend);
        an allocation past it fails with -ENOMEM. 0 = no cap. */
    uint64_t mem_limit;
} ferry_device_options;
#define FERRY_DEVICE_OPTIONS_INIT {sizeof(ferry_device_options), NULL, 0, 0, 0, 0, 0, 0}

enum ferry_fault_kind {
    FERRY_FAULT_ALLOC = 1u << 0,  /**< device alloc, host pinned alloc, pin */
    FERRY_FAULT_COPY = 1u << 1,   /**< any memcpy */
    FERRY_FAULT_SYNC = 1u << 2,   /**< stream/event synchronize */
    FERRY_FAULT_EVENT = 1u << 3   /**< event record */
};

/** Open a device. Errors: FERRY_ENODEV (no such backend/driver), -EINVAL. */
FERRY_API int ferry_device_open(const ferry_device_options *opt, ferry_device **out);
/** Close; frees what is still allocated. NULL does nothing. */
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
/** Reconfigure host fault injection on an open device (the counter restarts). */
FERRY_API int ferry_device_set_faults(ferry_device *dev, uint64_t fail_nth, int fail_code,
                                      size_t short_copy, unsigned fault_mask);

/** Allocate device memory (256-byte aligned at least). -ENOMEM when exhausted. */
FERRY_API int ferry_device_alloc(ferry_device *dev, size_t bytes, ferry_devptr *out);
/** Free device memory from ferry_device_alloc. Unknown pointer: -EINVAL. */
FERRY_API int ferry_device_free(ferry_device *dev, ferry_devptr ptr);
/** Allocate page-aligned pinned (page-locked, DMA-able) host memory. */
FERRY_API int ferry_device_host_alloc(ferry_device *dev, size_t bytes, void **out);
FERRY_API int ferry_device_host_free(ferry_device *dev, void *ptr);
/** Pin (page-lock and register for DMA) caller memory; unpin undoes it. */
FERRY_API int ferry_device_pin(ferry_device *dev, void *host, size_t bytes);
FERRY_API int ferry_device_unpin(ferry_device *dev, void *host);
/** On the host backend: the host address behind a device pointer; NULL on cuda. */
FERRY_API void *ferry_devptr_host(const ferry_device *dev, ferry_devptr ptr);

/** Synchronous helpers (on an internal stream): set, upload, download. */
FERRY_API int ferry_device_memset(ferry_device *dev, ferry_devptr dst, int byte, size_t n);
FERRY_API int ferry_device_upload(ferry_device *dev, ferry_devptr dst, const void *src, size_t n);
FERRY_API int ferry_device_download(ferry_device *dev, void *dst, ferry_devptr src, size_t n);

/* ---- streams ---- */
FERRY_API int ferry_stream_create(ferry_device *dev, ferry_stream **out);
/** Waits for queued work, then destroys. NULL does nothing. */
FERRY_API int ferry_stream_destroy(ferry_stream *s);
/** Block until all work queued on s is done; returns the first async error. */
FERRY_API int ferry_stream_sync(ferry_stream *s);
/** The backend's raw stream handle (a CUstream on cuda): what cuFile registers. */
FERRY_API uint64_t ferry_stream_handle(const ferry_stream *s);
FERRY_API ferry_device *ferry_stream_device(const ferry_stream *s);

/* Asynchronous copies: queued on s, in order. Host memory should be pinned
 * for the copy to be truly asynchronous on cuda. */
FERRY_API int ferry_memcpy_htod_async(ferry_stream *s, ferry_devptr dst, const void *src, size_t n);
FERRY_API int ferry_memcpy_dtoh_async(ferry_stream *s, void *dst, ferry_devptr src, size_t n);
FERRY_API int ferry_memcpy_dtod_async(ferry_stream *s, ferry_devptr dst, ferry_devptr src, size_t n);

/* ---- events ---- */
FERRY_API int ferry_event_create(ferry_device *dev, ferry_event **out);
FERRY_API void ferry_event_destroy(ferry_event *e);
/** Mark the point in s's queue; the event completes when s passes it. */
FERRY_API int ferry_event_record(ferry_event *e, ferry_stream *s);
/** 0 when complete, -EAGAIN when not yet, another negative code on error. */
FERRY_API int ferry_event_query(ferry_event *e);
/** Block until the event completes. */
FERRY_API int ferry_event_sync(ferry_event *e);
/** Make s wait (on the device, not the host) until e completes. */
FERRY_API int ferry_stream_wait_event(ferry_stream *s, ferry_event *e);
/** Milliseconds between two completed events. */
FERRY_API int ferry_event_elapsed_ms(ferry_event *start, ferry_event *end, float *ms);

#ifdef __cplusplus
}
#endif
#endif
