/*
 * ferry/io.h - I/O engines: move byte ranges between memory and files.
 *
 * An engine (ferry_io) owns a queue of requests in flight:
 *  - "posix":  pread/pwrite on a thread pool of `depth` workers.
 *  - "uring":  io_uring (liburing) with O_DIRECT, registered files and
 *              buffers, `depth` entries, batched submission.
 *  - "cufile": NVIDIA cuFile (GPUDirect Storage), libcufile.so.0 loaded
 *              with dlopen; device buffers move by DMA, no bounce.
 *  - "auto":   the fastest that works here: cufile when the device is cuda
 *              and cuFile opens, else uring when the kernel allows it, else
 *              posix. ferry_io_reason() says why. Env FERRY_IO_ENGINE
 *              (posix|uring|cufile) overrides "auto" (not an explicit name).
 *
 * Files are opened through an engine. With FERRY_FILE_DIRECT the file is
 * opened O_DIRECT; when the file system refuses it (tmpfs, some overlayfs)
 * or cuFile cannot register the handle, the file falls back (buffered I/O,
 * or the CPU path) and ferry_file_fallback_reason() says why; the reason is
 * also logged at warn level.
 *
 * Requests are split at the engine's cap (ferry_io_options.max_request;
 * 16 MiB for cufile). Short transfers are continued and EINTR retried
 * inside the engine: a request completes with its full length or with a
 * negative code, never with a partial count.
 *
 * Device buffers: with cufile they move by DMA. Otherwise the CPU path
 * stages them through two page-aligned pinned bounce buffers, so the file
 * I/O of one segment overlaps the device copy of the next.
 *
 * O_DIRECT needs buffer address, file offset and length aligned to 4096
 * (FERRY_IO_ALIGN): a misaligned request fails with FERRY_EALIGN and a
 * message naming the file, offset, length and buffer.
 *
 * Errors of requests (in req->result, or returned by the helpers), each
 * with a message naming the file, offset, length and cause:
 *  -EINVAL zero length, no buffer, a range past INT64_MAX, unknown op;
 *  -EBADF  a read on a file not opened for reading (or a write ...);
 *  FERRY_EALIGN  see above;
 *  FERRY_ESHORT  a read that reaches end of file before len bytes (the
 *          message gives the offset where the file ended), or a write the
 *          kernel keeps refusing to make progress on;
 *  -ENOSPC, -EIO, ... what the kernel reported, after short transfers
 *          were continued and EINTR/EAGAIN retried. A request that failed
 *          may have moved part of its bytes.
 *  FERRY_ENOTSUP device memory in an asynchronous request on an engine or
 *          file without GDS (use ferry_io_read_dev/write_dev).
 * Opening a file: -errno of open(2) (-ENOENT for a missing directory,
 * -EACCES for an unwritable one) with the path in the message.
 *
 * Thread-safety: one ferry_io may be driven by one thread at a time
 * (submit/reap); different ferry_io objects are independent. Two
 * exceptions: ferry_io_register_buffer may run on another thread while the
 * io is driven (below); and threads may race to submit one request, to one
 * io or to several: exactly one takes it, and the others get FERRY_EBUSY
 * from a submit that touched nothing of their engine but its last error
 * (ferry_io_submit).
 */
#ifndef FERRY_IO_H
#define FERRY_IO_H

#include <sys/uio.h>

#include "core.h"
#include "device.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FERRY_IO_ALIGN 4096u

typedef struct ferry_io ferry_io;
typedef struct ferry_file ferry_file;

/** The largest ferry_io_options.depth. */
#define FERRY_IO_DEPTH_MAX 4096u
/** The largest ferry_io_options.max_request: 1 GiB. */
#define FERRY_IO_REQUEST_MAX ((size_t)1 << 30)
/** The largest ferry_io_options.bounce_bytes: 1 GiB (two are pinned). */
#define FERRY_IO_BOUNCE_MAX ((size_t)1 << 30)

typedef struct ferry_io_options {
    /** sizeof(ferry_io_options); a shorter prefix (at least the size
     *  field) leaves the rest at their defaults */
    size_t size;
    /** "auto" (NULL or ""), "posix", "uring", "cufile"; else -EINVAL */
    const char *engine;
    /** requests in flight (posix: threads): 1..FERRY_IO_DEPTH_MAX (4096);
     *  0 -> 8 */
    unsigned depth;
    /** split cap in bytes: 1..FERRY_IO_REQUEST_MAX (1 GiB), rounded down
     *  to a multiple of 4096 (at least 4096); 0 -> engine default */
    size_t max_request;
    ferry_device *device;   /**< needed for device buffers; may be NULL */
    /** CPU-path segment size: 1..FERRY_IO_BOUNCE_MAX (1 GiB), rounded up to
     *  a multiple of 4096; 0 -> 8 MiB */
    size_t bounce_bytes;
} ferry_io_options;
/** The smallest size ferry_io_open takes: the size field alone (every
 *  member past a caller's size keeps its default). */
#define FERRY_IO_OPTIONS_MIN_SIZE sizeof(size_t)
#define FERRY_IO_OPTIONS_INIT \
    {FERRY_FIELD(size) sizeof(ferry_io_options), FERRY_FIELD(engine) NULL, FERRY_FIELD(depth) 0, \
     FERRY_FIELD(max_request) 0, FERRY_FIELD(device) NULL, FERRY_FIELD(bounce_bytes) 0}

/**
 * Open an engine. Every option is range-checked before it is used:
 * -EINVAL with a message naming the field, its value and the accepted
 * range (options size, unknown engine, depth, max_request, bounce_bytes
 * out of range). FERRY_ENODEV when a forced engine cannot work here.
 */
FERRY_API int ferry_io_open(const ferry_io_options *opt, ferry_io **out);
/**
 * Waits for requests in flight, then frees (completions not yet reaped are
 * dropped; those requests and their buffers are the caller's again, each
 * request free to be submitted anywhere: keep a request's memory until it
 * is reaped or its engine closed). Close the engine's files first
 * (ferry_file_close lets the file's requests finish), and close the engine
 * before the device it was given (it frees its bounce buffers and stream
 * there). NULL does nothing.
 */
FERRY_API void ferry_io_close(ferry_io *io);
/** "posix", "uring" or "cufile". */
FERRY_API const char *ferry_io_engine(const ferry_io *io);
/** Why this engine was chosen (and why the faster ones were not). */
FERRY_API const char *ferry_io_reason(const ferry_io *io);
FERRY_API const char *ferry_io_last_error(const ferry_io *io);
FERRY_API unsigned ferry_io_depth(const ferry_io *io);
/** The split cap in bytes: ferry_io_options.max_request, or the engine's
 * default (posix, uring: 32 MiB; cufile: 16 MiB), a multiple of 4096. */
FERRY_API size_t ferry_io_max_request(const ferry_io *io);

/**
 * Whether an engine can work on this host (and, when dir is non-NULL, on
 * files in dir). Returns 0 if usable, else a negative code and a reason in
 * why[0..why_len).
 */
FERRY_API int ferry_io_engine_probe(const char *engine, const char *dir, char *why,
                                    size_t why_len);
/** Whether the file system of dir accepts O_DIRECT; same convention. */
FERRY_API int ferry_io_direct_probe(const char *dir, char *why, size_t why_len);

/* ---- files ---- */
enum ferry_file_flags {
    FERRY_FILE_READ = 1u << 0,
    FERRY_FILE_WRITE = 1u << 1,
    FERRY_FILE_CREATE = 1u << 2,
    FERRY_FILE_TRUNC = 1u << 3,
    FERRY_FILE_DIRECT = 1u << 4,          /**< O_DIRECT, falling back if refused */
    FERRY_FILE_REQUIRE_DIRECT = 1u << 5   /**< O_DIRECT or fail */
};
/**
 * Open path through io. With FERRY_FILE_CREATE a new file is made with mode
 * 0600 (KV caches hold what prompts can be rebuilt from); -EINVAL for
 * unknown flags or none of READ/WRITE; -EISDIR when path is a directory.
 */
FERRY_API int ferry_file_open(ferry_io *io, const char *path, unsigned flags, ferry_file **out);
/**
 * ferry_file_open with the mode a new file gets: 0 means 0600; otherwise
 * read/write bits only (0660 for a deliberate group), -EINVAL else.
 */
FERRY_API int ferry_file_open_mode(ferry_io *io, const char *path, unsigned flags,
                                   unsigned mode, ferry_file **out);
/**
 * Close. Requests on f still queued or in the engine run to their end
 * first (their completions stay for ferry_io_reap; a request may not name
 * f once it is closed: a request reaped after the close still holds f in
 * its file member, which is freed - read nothing through it, e.g.
 * ferry_file_path(r->file)). NULL does nothing.
 */
FERRY_API int ferry_file_close(ferry_file *f);
FERRY_API const char *ferry_file_path(const ferry_file *f);
FERRY_API int ferry_file_fd(const ferry_file *f);
/** 1 when the file is open with O_DIRECT. */
FERRY_API int ferry_file_is_direct(const ferry_file *f);
/** Why a requested direct/GDS mode fell back, or NULL when it did not. */
FERRY_API const char *ferry_file_fallback_reason(const ferry_file *f);
/** 1 when device memory moves to and from this file by DMA (cufile engine,
 * handle registered); 0 when it takes the CPU bounce path. */
FERRY_API int ferry_file_is_gds(const ferry_file *f);
FERRY_API int ferry_file_size(ferry_file *f, uint64_t *out);
/** Reserve [off, off+len) on disk (posix_fallocate). -ENOSPC when full, and
 * before any block is taken when len is more than the file system has free
 * for this process (the host's root: its reserved blocks too; a user
 * namespace's root is not the host's), beyond what the file holds
 * already. */
FERRY_API int ferry_file_allocate(ferry_file *f, uint64_t off, uint64_t len);
FERRY_API int ferry_file_truncate(ferry_file *f, uint64_t len);
/** fdatasync. */
FERRY_API int ferry_file_sync(ferry_file *f);
/**
 * Make the next reads of f come from the disk: on a buffered (fallen back)
 * file, fdatasync then posix_fadvise(DONTNEED) over the whole file; on an
 * O_DIRECT file nothing to do. Benchmarks call it between write and read.
 */
FERRY_API int ferry_file_drop_cache(ferry_file *f);

/* ---- buffers ---- */
/**
 * Register host memory with the engine (io_uring fixed buffers, up to 64
 * slots of at most 1 GiB each; a larger buffer takes several); later
 * requests that lie inside one registration use READ_FIXED/WRITE_FIXED.
 * posix and cufile accept and ignore it. Registering the same (buf, len)
 * again is a no-op. -EINVAL (all engines) for NULL, len 0 or a range
 * that wraps around the address space. Errors (uring): FERRY_ENOTSUP when
 * the kernel refused a fixed-buffer table, FERRY_ENOSPACE when the slots
 * are used up, FERRY_EEXIST for buf registered with another length;
 * unregister of an unknown buf: FERRY_ENOTFOUND. Unregister before freeing
 * the memory.
 *
 * Register may run on one thread while another submits and reaps on the
 * same io (it may take long: the kernel pins, so faults, every page of
 * buf): requests submitted before it returned go the plain way, those
 * after it returned 0 the fixed way. Unregister follows the io's one-thread
 * rule, and no request on buf may be submitted once it started (those in
 * flight complete normally).
 */
FERRY_API int ferry_io_register_buffer(ferry_io *io, void *buf, size_t len);
FERRY_API int ferry_io_unregister_buffer(ferry_io *io, void *buf);
/**
 * Register device memory with the engine (cufile: cuFileBufRegister of the
 * whole range). Later device transfers inside it are issued as (base,
 * offset) of the registration. Other engines accept and ignore it.
 * Errors: -EINVAL (0, len 0, a range that wraps around the address
 * space), FERRY_EEXIST when p is already registered, FERRY_ENOSPACE when
 * every registration slot is taken, cuFile errors mapped to ferry codes;
 * unregister of an unknown p: FERRY_ENOTFOUND. Unregister before freeing
 * the device memory.
 */
FERRY_API int ferry_io_register_dev(ferry_io *io, ferry_devptr p, size_t len);
FERRY_API int ferry_io_unregister_dev(ferry_io *io, ferry_devptr p);
/** Allocate len bytes aligned to FERRY_IO_ALIGN (pinned when the engine has a
 * device) and register them, (buf, len), with the engine when it can (best
 * effort: registering the same (buf, len) again is a no-op); free with
 * ferry_io_buffer_free. */
FERRY_API int ferry_io_buffer_alloc(ferry_io *io, size_t len, void **out);
FERRY_API void ferry_io_buffer_free(ferry_io *io, void *buf);

/* ---- asynchronous requests ---- */
enum ferry_io_op {
    FERRY_IO_READ = 0,   /**< file -> memory */
    FERRY_IO_WRITE = 1,  /**< memory -> file */
    FERRY_IO_READV = 2   /**< file -> host memory in pieces: a ferry_io_vreq's req */
};
typedef struct ferry_io_req {
    int op;              /**< FERRY_IO_READ, FERRY_IO_WRITE (or FERRY_IO_READV: ferry_io_vreq) */
    ferry_file *file;
    void *buf;           /**< host memory; NULL to use dev */
    ferry_devptr dev;    /**< device memory, when buf is NULL */
    size_t len;
    uint64_t offset;     /**< file offset */
    void *user;          /**< the caller's */
    int64_t result;      /**< on completion: len, or a negative code */
    /* private to the engine from submit until reaped */
    uint64_t priv_[4];
} ferry_io_req;

/** The most pieces one vectored read takes (the kernel's IOV_MAX). */
#define FERRY_IO_IOV_MAX 1024u

/**
 * A vectored read: the len bytes of req from req.offset land in iov[0],
 * then iov[1], ... (req.len is the sum of their lengths), with one
 * request to the engine (a single preadv or io_uring READV), so an
 * engine's strided buffer fills without a copy. req.op is FERRY_IO_READV;
 * req.buf and req.dev are ignored; submit &v->req (ferry_io_submit finds
 * the rest from it; reap hands back that pointer). Rules, checked at
 * submit: niov 1..FERRY_IO_IOV_MAX, no piece empty or NULL, req.len at
 * most the engine's max_request (it is not split), on an O_DIRECT file
 * every piece's address and length and the offset multiples of 4096;
 * posix and uring engines only (FERRY_ENOTSUP on cufile). A read that
 * comes back short (a regular file does only at its end) fails with
 * FERRY_ESHORT; it is not continued. iov and its memory stay the
 * caller's, untouched until the request is reaped.
 */
typedef struct ferry_io_vreq {
    ferry_io_req req;          /**< first: op FERRY_IO_READV, file, len, offset, user */
    const struct iovec *iov;
    unsigned niov;
} ferry_io_vreq;

/**
 * Queue n requests. The requests (and their buffers) stay the caller's
 * property but must not be touched until reaped. The queue has no fixed
 * bound (requests are linked through their private words; submit never
 * allocates): all valid requests are queued and the engine runs `depth`
 * at a time. n: 0..INT_MAX (-EINVAL beyond). Returns the number queued,
 * or a negative code when reqs[0] is invalid; a count k < n means reqs[k] was invalid (the message says
 * why) and reqs[k..n) were not queued. A request submitted and not yet
 * reaped, to this io or to any other in the process (earlier, or earlier
 * in the same reqs), is FERRY_EBUSY naming it and the io that holds it,
 * and stays as it was: a request is the io's it was submitted to until
 * reaped there or that io is closed. Whether a request is in flight is
 * known by its address, not its private words (a fresh request's may hold
 * anything), so of threads racing to submit one request exactly one takes
 * it; a submit answered FERRY_EBUSY for reqs[0] touches nothing of the
 * io but its last error, and may run beside the thread driving it.
 */
FERRY_API int ferry_io_submit(ferry_io *io, ferry_io_req *const *reqs, unsigned n);
/**
 * Wait until at least min requests have completed (or timeout_ms passes;
 * any negative value = forever) and hand back up to max of them in
 * done[] (at most INT_MAX per call). -EINVAL when min > max or done is
 * NULL with max > 0. Returns the count (possibly 0 on timeout) or a
 * negative code.
 */
FERRY_API int ferry_io_reap(ferry_io *io, ferry_io_req **done, unsigned min, unsigned max,
                            int timeout_ms);
/** Requests submitted and not yet reaped. */
FERRY_API unsigned ferry_io_inflight(const ferry_io *io);

/*
 * ---- synchronous helpers (split, run `depth` at a time, wait; 0 on success) ----
 * The transfer is cut into about `depth` pieces (at least 128 KiB, at most
 * max_request) that run concurrently. Requests of the caller's still in
 * flight are not disturbed: their completions stay for ferry_io_reap.
 */
FERRY_API int ferry_io_pread(ferry_io *io, ferry_file *f, void *buf, size_t len, uint64_t off);
FERRY_API int ferry_io_pwrite(ferry_io *io, ferry_file *f, const void *buf, size_t len,
                              uint64_t off);
/**
 * Device memory <-> file. cufile: DMA (s NULL: the batch API with depth
 * requests in flight; s given: cuFileRead/WriteAsync on s, then s is
 * synchronized). Otherwise the double-buffered CPU path, with device
 * copies on stream s (NULL: the engine's own stream), in segments of
 * bounce_bytes whose file I/O overlaps the device copy of the next.
 * Returns when the whole transfer is done (bytes landed in device memory
 * for reads, on the file for writes).
 * O_DIRECT files on the CPU path: off must be a multiple of 4096; a read
 * of any length works (the last segment is padded inside the bounce
 * buffer; only len bytes reach the device), a write whose length is not a
 * multiple of 4096 fails with FERRY_EALIGN before anything moves (it
 * cannot be padded without writing bytes the caller did not give).
 * Errors: as for requests, plus the device layer's codes for a failed
 * copy or event (e.g. FERRY_EINJECTED, FERRY_ESHORT on the host backend),
 * and -EINVAL when the engine was opened without a device.
 */
FERRY_API int ferry_io_read_dev(ferry_io *io, ferry_file *f, ferry_stream *s, ferry_devptr dst,
                                size_t len, uint64_t off);
FERRY_API int ferry_io_write_dev(ferry_io *io, ferry_file *f, ferry_stream *s, ferry_devptr src,
                                 size_t len, uint64_t off);

#ifdef __cplusplus
}
#endif
#endif
