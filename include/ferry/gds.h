/*
 * ferry/gds.h - the NVMe slab tier: a GPUDirect Storage context.
 *
 * A ferry_gds keeps one preallocated slab file ("ferry_slab.bin") in each
 * configured directory (one per drive; the slab is striped across them) and
 * moves byte ranges of it to and from device buffers and host buffers:
 *
 *  - Life: ferry_gds_open(NULL, &g) gives a context that is OFF:
 *    registering and deregistering are no-ops that call nothing.
 *    ferry_gds_init() turns it on (creates, preallocates and opens the slab
 *    files, O_DIRECT when the file system allows it and a logged fallback
 *    when not); a second init is FERRY_ESTATE. ferry_gds_close() releases
 *    every region, stream and handle. ferry_gds_open(cfg, &g) is both
 *    steps at once.
 *  - Device buffers are registered in regions of at most region_cap bytes
 *    (16 MiB: 40 MiB -> 16 + 16 + 8), kept sorted. Each distinct stream is
 *    registered with the driver once (flags FERRY_GDS_STREAM_FLAGS) and
 *    deregistered when its last region goes.
 *  - A transfer of (slab offset, length, device buffer slice) resolves the
 *    slice to (region base, offset in region), splits where it crosses a
 *    region boundary or a stripe boundary, and passes the driver the region
 *    base plus an offset, never an interior pointer. A slice outside every
 *    registered region is FERRY_EBOUNDS.
 *  - The driver is a table of calls (ferry_gds_driver below). ferry ships
 *    "cufile" (libcufile.so.0), "hipfile" (libhipfile.so), both loaded with
 *    dlopen, and "cpu" (the I/O engines of ferry/io.h plus the
 *    double-buffered bounce path for device memory). "auto" picks cufile,
 *    then hipfile, when the device is cuda and the library opens, else cpu.
 *    A test or another vendor supplies its own table.
 *  - Host buffers always move through the I/O engines (one ferry_io queue
 *    per drive, driven concurrently), whatever the driver: synchronously
 *    (ferry_gds_pwrite/pread, cut so each drive has `depth` requests in
 *    flight) or asynchronously (ferry_gds_submit/reap, the caller keeping
 *    several in flight). Buffers from ferry_gds_buffer_alloc, or caller
 *    memory passed to ferry_gds_host_register, take the engines' fast path
 *    (io_uring fixed buffers, huge pages).
 *
 * The context also owns a ferry_slab allocator over the slab's bytes
 * (ferry_gds_slab()); extents from it are what callers transfer.
 *
 * One owner per directory: init takes an exclusive lock on each directory
 * (an OFD lock on dir/ferry.lock, dropped at ferry_gds_close or by the
 * kernel when the process dies) before it creates or truncates the slab
 * file there. A second opener of the same directory, in this process or
 * another, gets FERRY_EBUSY naming the directory and the holder's pid: two
 * contexts on one slab file would hand each other's bytes back. Give each
 * rank and store its own directory.
 *
 * Modes: directories ferry creates get 0700 and the slab and lock files
 * 0600 (cached KV is what prompts can be rebuilt from), unless the config
 * gives a mode (0660 for a deliberate group: directories then 0770);
 * the process umask applies as usual.
 *
 * Alignment: slab offsets and lengths must be multiples of the alignment
 * (4096); host buffers must be too when the slab is open with O_DIRECT.
 * Device buffers may sit at any address: with the cpu driver and O_DIRECT,
 * a piece whose file offset or length is not 4096-aligned (a slice cut
 * where it crosses a region boundary at an unaligned device address) moves
 * its unaligned head and tail through an aligned 4096-byte staging block
 * (read-modify-write for writes, within the transfer's own slab range), the
 * rest through the bounce path; the bytes are exact in both directions.
 * cuFile and hipFile align device transfers themselves.
 *
 * Thread-safety: registration, deregistration and close take the context's
 * lock; transfers look regions up under it and may run from several
 * threads at once, each with its own stream. Every call but close may run
 * while another thread's ferry_gds_init turns the context on: it sees the
 * context off (FERRY_ESTATE, or a no-op where off is one) or wholly on. A ferry_stream is used by one
 * thread at a time (ferry/device.h). cuFile's stream registration is
 * process-wide: keep one context per process when the driver is cufile.
 */
#ifndef FERRY_GDS_H
#define FERRY_GDS_H

#include "core.h"
#include "device.h"
#include "io.h"
#include "slab.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FERRY_GDS_SLAB_NAME "ferry_slab.bin"
#define FERRY_GDS_REGION_CAP_DEFAULT (16u << 20)
#define FERRY_GDS_ALIGN_DEFAULT 4096u
#define FERRY_GDS_STRIPE_DEFAULT (4u << 20)
/** Stream registration flags: fixed buffer offset | fixed file offset | fixed size. */
#define FERRY_GDS_STREAM_FLAGS 0x7u
/** An argument batch is closed by a checkpoint event every this many async submissions. */
#define FERRY_GDS_CHECKPOINT_EVERY 64u
#define FERRY_GDS_MAX_DIRS 16

/** File directions, as cuFile's: READ = slab -> memory, WRITE = memory -> slab. */
enum ferry_gds_dir { FERRY_GDS_READ = 0, FERRY_GDS_WRITE = 1 };

/* ---- the driver table ---- */

/** One I/O of a batch: what cuFileBatchIOSubmit takes, in ferry's types. */
typedef struct ferry_gds_io {
    int op;                 /**< FERRY_GDS_READ or FERRY_GDS_WRITE */
    void *handle;           /**< from handle_register */
    ferry_devptr base;      /**< a registered region's base */
    size_t size;
    int64_t file_off;
    int64_t buf_off;        /**< offset from base */
    int64_t result;         /**< out: size, or a negative code */
} ferry_gds_io;

/**
 * The calls a GDS driver makes. Every call gets the table's ctx first.
 * Returns: 0 (or a byte count for read/write) on success, a negative ferry
 * code on failure, with a message recorded through ferry_last_error()'s
 * thread buffer when the driver can say more. Entries marked optional may
 * be NULL. The table is copied by ferry_gds_init(); ctx must outlive the
 * context.
 */
typedef struct ferry_gds_driver {
    size_t size;            /**< sizeof(ferry_gds_driver) */
    const char *name;       /**< "cufile", "hipfile", "cpu", "fake", ... */
    void *ctx;
    /** optional: at init, before any other call. dev may be NULL. */
    int (*open)(void *ctx, ferry_device *dev);
    /** optional: at close, after every deregistration. */
    void (*close)(void *ctx);
    /** Register an open slab file (opened through engine io, the drive's
     *  queue); *handle is passed back to I/O calls. */
    int (*handle_register)(void *ctx, ferry_io *io, ferry_file *f, void **handle);
    void (*handle_deregister)(void *ctx, void *handle);
    /** Register device memory [base, base+len) (one region, len <= region cap). */
    int (*buf_register)(void *ctx, ferry_devptr base, size_t len, int flags);
    int (*buf_deregister)(void *ctx, ferry_devptr base);
    /** s may be NULL (the default stream); raw = ferry_stream_handle(s) or 0. */
    int (*stream_register)(void *ctx, ferry_stream *s, uint64_t raw, unsigned flags);
    int (*stream_deregister)(void *ctx, ferry_stream *s, uint64_t raw);
    /** Synchronous I/O of size bytes at base + buf_off. Returns bytes done
     *  (the context continues short transfers) or a negative code. */
    int64_t (*read)(void *ctx, void *handle, ferry_devptr base, size_t size, int64_t file_off,
                    int64_t buf_off);
    int64_t (*write)(void *ctx, void *handle, ferry_devptr base, size_t size, int64_t file_off,
                     int64_t buf_off);
    /**
     * Asynchronous I/O queued on stream s (cuFileReadAsync): the argument
     * pointers are read when the stream reaches the op and *done receives
     * the bytes done or a negative code; the context keeps them alive until
     * a checkpoint event after the op has completed. Optional: when NULL
     * the context synchronizes s and calls read/write.
     */
    int (*read_async)(void *ctx, void *handle, ferry_devptr base, size_t *size,
                      int64_t *file_off, int64_t *buf_off, int64_t *done, ferry_stream *s);
    int (*write_async)(void *ctx, void *handle, ferry_devptr base, size_t *size,
                       int64_t *file_off, int64_t *buf_off, int64_t *done, ferry_stream *s);
    /** Optional: run n I/Os concurrently and wait for all; each gets its
     *  result. Returns 0 when all succeeded, else the first failure's code. */
    int (*batch)(void *ctx, ferry_gds_io *ios, unsigned n);
} ferry_gds_driver;

/* ---- the context ---- */
typedef struct ferry_gds ferry_gds;

/** Largest alignment, region cap and stripe unit a config may give. */
#define FERRY_GDS_ALIGN_MAX (1u << 30)
#define FERRY_GDS_REGION_CAP_MAX ((size_t)1 << 40)
#define FERRY_GDS_STRIPE_MAX ((size_t)1 << 40)
/** Largest slab: 2^62 bytes. */
#define FERRY_GDS_BYTES_MAX (UINT64_MAX >> 2)

/**
 * Every option is range-checked before use: a value outside its range is
 * -EINVAL with a message naming the option and the accepted range.
 * Size-versioned: callers built before `mode` existed pass the shorter
 * size (offsetof(ferry_gds_config, mode)) and get mode 0.
 */
typedef struct ferry_gds_config {
    size_t size;                /**< sizeof(ferry_gds_config) */
    const char *const *dirs;    /**< directories, one per drive, none NULL or "" (created if
                                     missing); each distinct and owned by this context alone */
    unsigned n_dirs;            /**< 1..FERRY_GDS_MAX_DIRS */
    uint64_t bytes;             /**< slab size in all, 1..FERRY_GDS_BYTES_MAX; rounded up to
                                     the alignment */
    int direct;                 /**< 1: O_DIRECT, falling back when refused; 0: buffered */
    size_t alignment;           /**< 0 -> 4096; else a power of two, 4096..FERRY_GDS_ALIGN_MAX */
    size_t region_cap;          /**< 0 -> 16 MiB; else a multiple of the alignment, at most
                                     FERRY_GDS_REGION_CAP_MAX */
    const char *driver;         /**< "auto" (NULL), "cufile", "hipfile", "cpu" */
    const ferry_gds_driver *custom_driver; /**< when set, used instead of `driver` */
    ferry_device *device;       /**< device of the buffers; NULL: host buffers only */
    const char *engine;         /**< I/O engine per drive: NULL/"auto", "posix", "uring" */
    unsigned depth;             /**< requests in flight per drive: 0 -> 8, else
                                     1..FERRY_IO_DEPTH_MAX */
    size_t stripe_bytes;        /**< stripe unit across drives; 0 -> 4 MiB; else a multiple
                                     of the alignment, at most FERRY_GDS_STRIPE_MAX */
    unsigned mode;              /**< files ferry creates: 0 -> 0600 (directories 0700); else
                                     read/write bits only (<= 0666) including the owner's
                                     (0600), e.g. 0660 (directories 0770) */
} ferry_gds_config;
/** The smallest size ferry_gds_init takes: the config before `mode` (0600). */
#define FERRY_GDS_CONFIG_MIN_SIZE offsetof(ferry_gds_config, mode)
#define FERRY_GDS_CONFIG_INIT \
    {FERRY_FIELD(size) sizeof(ferry_gds_config), FERRY_FIELD(dirs) NULL, FERRY_FIELD(n_dirs) 0, \
     FERRY_FIELD(bytes) 0, FERRY_FIELD(direct) 1, FERRY_FIELD(alignment) 0, \
     FERRY_FIELD(region_cap) 0, FERRY_FIELD(driver) NULL, FERRY_FIELD(custom_driver) NULL, \
     FERRY_FIELD(device) NULL, FERRY_FIELD(engine) NULL, FERRY_FIELD(depth) 0, \
     FERRY_FIELD(stripe_bytes) 0, FERRY_FIELD(mode) 0}

/**
 * Turn the context on. cfg NULL leaves it off and returns 0. Creates each
 * directory (mkdir -p, 0700 or the config's mode), locks it (one owner per
 * directory, see above), creates (0600 or the config's mode) and truncates
 * dir/ferry_slab.bin, reserves
 * its share of the slab with posix_fallocate, opens it (O_DIRECT when
 * cfg->direct, falling back to buffered with a warning and
 * ferry_gds_fallback_reason() when the file system refuses), opens the
 * driver and registers each file. On failure everything done is undone
 * and the context stays off (and no directory stays locked). Errors:
 * FERRY_ESTATE (already on), -EINVAL (an option out of its range, see
 * ferry_gds_config), FERRY_EBUSY (a directory is owned by another
 * context, in this process or another: the message names the directory
 * and the owner's pid), -ENOTDIR (a directory path names a file), -ENOSPC
 * (size larger than the free disk), FERRY_ENODEV (forced driver not
 * here), driver and system errors.
 */
FERRY_API int ferry_gds_init(ferry_gds *g, const ferry_gds_config *cfg);
/**
 * Open a context: with cfg NULL one that is off (a later ferry_gds_init
 * turns it on), else one that is on (ferry_gds_init's work and errors;
 * on failure nothing is left open). Errors: -EINVAL (out NULL), -ENOMEM,
 * ferry_gds_init's. Close with ferry_gds_close().
 */
FERRY_API int ferry_gds_open(const ferry_gds_config *cfg, ferry_gds **out);
/**
 * Synchronize every known stream, deregister all regions, streams and file
 * handles, close the driver and the files, release the directory locks,
 * free the context. The slab files stay on disk (the next init truncates
 * them). NULL does nothing.
 */
FERRY_API void ferry_gds_close(ferry_gds *g);

/** 1 when on (initialized). */
FERRY_API int ferry_gds_is_on(const ferry_gds *g);
/** The driver in use ("cufile", "hipfile", "cpu", a custom name); "off" when off. */
FERRY_API const char *ferry_gds_driver_name(const ferry_gds *g);
/** The I/O engine of the drive queues ("posix", "uring"); "off" when off. */
FERRY_API const char *ferry_gds_engine(const ferry_gds *g);
/** Why O_DIRECT (or the requested driver) fell back, or NULL (always NULL when off). */
FERRY_API const char *ferry_gds_fallback_reason(const ferry_gds *g);
/** The message of this context's last failure, "" if none. */
FERRY_API const char *ferry_gds_last_error(const ferry_gds *g);
/** Slab size in bytes (after rounding); 0 when off. */
FERRY_API uint64_t ferry_gds_size(const ferry_gds *g);
/** The allocator over [0, size) the context owns; NULL when off. */
FERRY_API ferry_slab *ferry_gds_slab(ferry_gds *g);

/* ---- registration of device buffers ---- */
/**
 * Register device memory [buf, buf+len) used with stream s (NULL: the
 * default stream) in regions of at most region_cap. Off: returns 0 and
 * calls nothing. All or nothing: when a driver call fails, what was
 * registered by this call is deregistered again. Errors: -EINVAL (len 0),
 * FERRY_EEXIST (overlaps a registered buffer), driver codes, -ENOMEM.
 */
FERRY_API int ferry_gds_register(ferry_gds *g, ferry_devptr buf, size_t len, ferry_stream *s);
/**
 * Deregister the buffer registered at buf: synchronize its stream,
 * deregister each of its regions (driver errors are logged, not returned),
 * and the stream when its last region goes. Off: returns 0, calls nothing.
 * Errors: FERRY_ENOTFOUND (no buffer registered at buf).
 */
FERRY_API int ferry_gds_deregister(ferry_gds *g, ferry_devptr buf);

/* ---- transfers ---- */
/**
 * Move len bytes between the slab at slab_off and device memory at buf
 * (inside registered regions; any address, aligned or not, also across a
 * region boundary), in direction dir. s (may be NULL) is
 * synchronized first, so work queued on it before (a kernel filling buf)
 * is done. Returns when the bytes are in place (on the slab for writes, in
 * device memory for reads). Segments on different drives move at once
 * (the driver's batch call).
 * Errors: FERRY_ESTATE (off), FERRY_EALIGN (slab_off or len not aligned),
 * -EINVAL (len 0), FERRY_EBOUNDS (the slice leaves the registered regions,
 * or slab_off + len is past the slab's end), driver and I/O codes (with a
 * message naming the drive's file, the offset, the size and the cause).
 */
FERRY_API int ferry_gds_transfer(ferry_gds *g, int dir, uint64_t slab_off, size_t len,
                                 ferry_devptr buf, ferry_stream *s);
/**
 * The same, queued on stream s (the stream the buffer was registered with,
 * or any other registered one): returns once queued; the bytes move when
 * the stream reaches the ops. Complete with ferry_gds_stream_sync() (or by
 * synchronizing s and then calling ferry_gds_stream_sync() to collect
 * errors). The buffer must not be touched until then. Same errors, found
 * before anything is queued; I/O errors surface at ferry_gds_stream_sync().
 * s NULL is the default stream (cuFile's stream handle 0), with every
 * driver: ferry's device layer queues nothing on it to wait for, so the
 * transfer is done (through the driver's synchronous calls) when this
 * returns, its I/O errors are returned here, and ferry_gds_stream_sync(g,
 * NULL) has nothing left to wait for (it returns 0).
 */
FERRY_API int ferry_gds_transfer_async(ferry_gds *g, int dir, uint64_t slab_off, size_t len,
                                       ferry_devptr buf, ferry_stream *s);
/**
 * Wait until every async transfer queued on s (NULL: the default stream)
 * is done and release their argument blocks. Returns 0, or the first
 * error any of them reported.
 */
FERRY_API int ferry_gds_stream_sync(ferry_gds *g, ferry_stream *s);

/**
 * Host memory -> slab at slab_off, striped over the drives concurrently.
 * Returns only once every engine request it made is back from the drives'
 * engines, so nothing touches buf after it returned: where a drive's reap
 * fails, it keeps waiting for them and returns that failure (with a
 * message naming the drive), not before.
 */
FERRY_API int ferry_gds_pwrite(ferry_gds *g, const void *buf, size_t len, uint64_t slab_off);
/** Slab at slab_off -> host memory; returns as ferry_gds_pwrite does. */
FERRY_API int ferry_gds_pread(ferry_gds *g, void *buf, size_t len, uint64_t slab_off);

/* ---- host buffers ---- */
/**
 * Register host memory [buf, buf+len) with every drive queue (io_uring
 * fixed buffers): transfers from inside it skip the kernel's per-I/O page
 * pinning, which is most of the cost of large O_DIRECT requests. Engines
 * without registration accept and ignore it. Unregister before freeing the
 * memory. Registering buf again with the same len does nothing.
 * Errors: FERRY_ESTATE (off), -EINVAL, FERRY_EEXIST (buf registered with
 * another len), the engine's codes (FERRY_ENOSPACE when its fixed-buffer
 * table is full); on failure nothing stays registered. It may run while
 * other threads transfer through the context (from buf too: those go the
 * plain way until it returned), and it may take long (the kernel pins, so
 * faults, every page of buf).
 */
FERRY_API int ferry_gds_host_register(ferry_gds *g, void *buf, size_t len);
/** Undo ferry_gds_host_register. FERRY_ENOTFOUND when buf was not registered
 *  (with every engine, those that ignore registrations too), FERRY_ESTATE
 *  (off), -EINVAL (NULL). */
FERRY_API int ferry_gds_host_unregister(ferry_gds *g, void *buf);
/**
 * Allocate len bytes of host memory aligned for the slab (pinned when the
 * context has a device) and registered, (buf, len), with the drive queues
 * (ferry_gds_host_register of the same again is a no-op); free with
 * ferry_gds_buffer_free before closing the context. Errors: -EINVAL (out
 * NULL, len 0 or too large to round up to the alignment), FERRY_ESTATE
 * (off), -ENOMEM; *out is set only on success.
 */
FERRY_API int ferry_gds_buffer_alloc(ferry_gds *g, size_t len, void **out);
FERRY_API void ferry_gds_buffer_free(ferry_gds *g, void *buf);

/* ---- asynchronous host transfers ---- */
/** One host-memory transfer for ferry_gds_submit. */
typedef struct ferry_gds_req {
    int dir;            /**< FERRY_GDS_READ (slab -> buf) or FERRY_GDS_WRITE */
    void *buf;          /**< host memory of len bytes (4096-aligned with O_DIRECT) */
    size_t len;         /**< a multiple of the alignment */
    uint64_t slab_off;  /**< a multiple of the alignment */
    void *user;         /**< the caller's */
    int result;         /**< on completion: 0, or a negative code (message:
                             ferry_gds_last_error after the reap) */
    void *priv_;        /**< the context's, from submit until reaped */
} ferry_gds_req;

/**
 * Queue n host transfers on the drive queues (striped, each drive's share
 * in flight at once). The requests and their buffers stay the caller's but
 * must not be touched until reaped. Keep several in flight to reach the
 * drives' bandwidth (as `ferry bench io` does with its depth). Returns the
 * number queued (fewer than n when request k is invalid: the code of its
 * failure is then in ferry_gds_last_error) or a negative code when none
 * was. A request submitted and not yet reaped (earlier, or earlier in the
 * same reqs, or by another thread at the same moment: exactly one of them
 * takes it) is FERRY_EBUSY naming it, and stays as it was; so is one
 * submitted to another context and not yet reaped there (the message
 * names that context). priv_ need not be initialized before the first
 * submission. Thread-safe; any thread may reap any request.
 */
FERRY_API int ferry_gds_submit(ferry_gds *g, ferry_gds_req *const *reqs, unsigned n);
/**
 * Wait until at least min submitted requests have completed (timeout_ms;
 * -1 = forever) and hand back up to max of them in done[], each with its
 * result. Returns the count (0 on timeout or when none is outstanding) or
 * a negative code when a drive queue broke. ferry_gds_close() waits for
 * requests in flight (a drive whose queue broke hands none back, but
 * every drive's engine finishes what it holds before its file is closed)
 * and drops unreaped ones: their memory is freed and each request is the
 * caller's again (priv_ NULL), to submit to any context.
 */
FERRY_API int ferry_gds_reap(ferry_gds *g, ferry_gds_req **done, unsigned min, unsigned max,
                             int timeout_ms);

/* ---- extents (from ferry_gds_slab()) ---- */
/** ferry_gds_transfer over a whole extent (e->size bytes at e->offset). */
FERRY_API int ferry_gds_extent_transfer(ferry_gds *g, int dir, const ferry_extent *e,
                                        ferry_devptr buf, ferry_stream *s);
FERRY_API int ferry_gds_extent_transfer_async(ferry_gds *g, int dir, const ferry_extent *e,
                                              ferry_devptr buf, ferry_stream *s);
/** Host buffer of at least e->size bytes <-> a whole extent. */
FERRY_API int ferry_gds_extent_pwrite(ferry_gds *g, const ferry_extent *e, const void *buf);
FERRY_API int ferry_gds_extent_pread(ferry_gds *g, const ferry_extent *e, void *buf);

/* ---- accounting ---- */
typedef struct ferry_gds_stats {
    size_t size;               /**< set by the caller: sizeof(ferry_gds_stats) */
    unsigned drives;
    unsigned regions;          /**< registered regions */
    unsigned buffers;          /**< registered buffers */
    unsigned streams;          /**< registered streams */
    uint64_t bytes_read;       /**< slab -> memory, all paths */
    uint64_t bytes_written;    /**< memory -> slab */
    uint64_t driver_ios;       /**< I/Os handed to the driver */
    uint64_t engine_ios;       /**< host-buffer I/Os handed to the engines */
    uint64_t async_pending;    /**< async argument blocks not yet released */
    uint64_t checkpoints;      /**< checkpoint events recorded */
} ferry_gds_stats;
#define FERRY_GDS_STATS_INIT \
    {FERRY_FIELD(size) sizeof(ferry_gds_stats), FERRY_FIELD(drives) 0, FERRY_FIELD(regions) 0, \
     FERRY_FIELD(buffers) 0, FERRY_FIELD(streams) 0, FERRY_FIELD(bytes_read) 0, \
     FERRY_FIELD(bytes_written) 0, FERRY_FIELD(driver_ios) 0, FERRY_FIELD(engine_ios) 0, \
     FERRY_FIELD(async_pending) 0, FERRY_FIELD(checkpoints) 0}
/**
 * A snapshot of the counters: the caller sets out->size (its header's
 * sizeof(ferry_gds_stats), e.g. with FERRY_GDS_STATS_INIT) and only that
 * many bytes are written; out->size stays. Errors: -EINVAL (NULL,
 * out->size not set).
 */
FERRY_API int ferry_gds_stats_get(const ferry_gds *g, ferry_gds_stats *out);

#ifdef __cplusplus
}
#endif
#endif
