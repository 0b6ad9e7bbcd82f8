/*
 * io.c - the I/O front: engine selection, files, validation, splitting,
 * continuation and the synchronous helpers.
 *
 * Invariant: a request handed to ferry_io_submit completes exactly once,
 * with result == len or a negative code, never a partial count. The front
 * keeps that promise for every engine by owning the judgement of results:
 * engines report raw syscall-style results per part, and the front
 * continues short transfers, retries EINTR/EAGAIN, turns end of file into
 * FERRY_ESHORT and stops dispatching the rest of a request after its first
 * error. A request is finished when it is fully dispatched (or failed) and
 * none of its parts is still in the engine, so its buffer is never touched
 * after the caller reaps it.
 *
 * Submit and reap never allocate: pending and done requests are linked
 * through the request's own private words, and parts come from a pool
 * sized at open.
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/mman.h>
#include <unistd.h>

#include "dirlock.h"
#include "io_impl.h"
#include "room.h"
#include "sized.h"
#include "sys.h"

/* ---- per-request private state: ferry__rq (io_impl.h) over priv_ ---- */
enum {
    RQ_PENDING = 1u << 0,  /* on the pending list (not fully dispatched) */
    RQ_DONE = 1u << 1,     /* finished */
    RQ_INTERNAL = 1u << 2, /* a synchronous helper's: never on the done list */
    RQ_EOF_OK = 1u << 3    /* end of file after len - pad bytes is success */
};
typedef ferry__rq rq_priv;

static rq_priv *P(ferry_io_req *r)
{
    return ferry__rq_of(r);
}

/* A request submitted through ferry_io_submit is in the process's table
 * of requests in flight (live.c) until it is reaped or its engine closes,
 * so a second submit of it, to this engine or any other, is caught before
 * it relinks the queues (it would complete once, with the in-flight count
 * left one too high and a caller waiting for both hanging, or complete on
 * two engines that both write its result and private words). The
 * synchronous helpers' own requests never leave this file and stay out of
 * the table. */

#define RETRY_MAX 1000u      /* consecutive EINTR/EAGAIN on one part */
#define ZERO_WRITE_MAX 8u    /* consecutive zero-byte writes before giving up */

const char *ferry__op_name(int op)
{
    return op == FERRY_IO_READ ? "read" : "write";
}

/* ---- engine table ---- */
static const ferry__io_ops *engine_by_name(const char *n)
{
    if (!strcmp(n, "posix"))
        return &ferry__io_posix_ops;
    if (!strcmp(n, "uring"))
        return &ferry__io_uring_ops;
    if (!strcmp(n, "cufile"))
        return &ferry__io_cufile_ops;
    return NULL;
}

/* ---- open / close ---- */
static int io_create(const ferry__io_ops *ops, const ferry_io_options *o, ferry_io **out)
{
    ferry_io *io = ferry__calloc(1, sizeof *io);
    if (!io)
        return ferry__err_set(NULL, -ENOMEM, "io: out of memory allocating the %s engine",
                              ops->name);
    io->ops = ops;
    /* ferry_io_open checked the ranges: nothing here can wrap */
    io->depth = o->depth ? o->depth : 8;
    size_t mr = o->max_request ? o->max_request : ops->default_max_request;
    mr &= ~(size_t)(FERRY_IO_ALIGN - 1);
    io->max_request = mr ? mr : FERRY_IO_ALIGN;
    size_t bb = o->bounce_bytes ? o->bounce_bytes : (size_t)8 << 20;
    io->bounce_bytes = FERRY__ALIGN_UP(bb, (size_t)FERRY_IO_ALIGN);
    io->device = o->device;
    io->nparts = ops->slots ? ops->slots(io->depth) : io->depth;
    io->parts = ferry__calloc(io->nparts, sizeof *io->parts);
    io->scratch = ferry__calloc(io->nparts, sizeof *io->scratch);
    if (!io->parts || !io->scratch) {
        unsigned n = io->nparts;
        ferry__free(io->parts);
        ferry__free(io->scratch);
        ferry__free(io);
        return ferry__err_set(NULL, -ENOMEM, "io: out of memory allocating %u request slots", n);
    }
    for (unsigned i = 0; i < io->nparts; i++) {
        io->parts[i].next = io->free_parts;
        io->free_parts = &io->parts[i];
    }
    int rc = ops->init(io);
    if (rc < 0) {
        ferry__free(io->parts);
        ferry__free(io->scratch);
        ferry__free(io);
        return rc; /* init recorded the message */
    }
    *out = io;
    return 0;
}

int ferry_io_open(const ferry_io_options *opt, ferry_io **out)
{
    ferry_io_options o = FERRY_IO_OPTIONS_INIT;
    if (!out)
        return ferry__err_set(NULL, -EINVAL, "ferry_io_open: out is NULL");
    static const ferry__member later[] = {
        FERRY__MEMBER(ferry_io_options, engine), FERRY__MEMBER(ferry_io_options, depth),
        FERRY__MEMBER(ferry_io_options, max_request), FERRY__MEMBER(ferry_io_options, device),
        FERRY__MEMBER(ferry_io_options, bounce_bytes)};
    static const ferry__sized sized =
        FERRY__SIZED(ferry_io_options, FERRY_IO_OPTIONS_MIN_SIZE, later);
    if (opt) {
        int rc = ferry__opts_take(NULL, "ferry_io_open", &sized, &o, opt);
        if (rc < 0)
            return rc;
    }
    /* every option in range before any arithmetic on it (the part pool is
     * sized by depth, split pieces are 32-bit) */
    if (o.depth > FERRY_IO_DEPTH_MAX)
        return ferry__err_set(NULL, -EINVAL,
                              "ferry_io_open: depth %u: accepted 1..%u (0 means 8)", o.depth,
                              FERRY_IO_DEPTH_MAX);
    if (o.max_request > FERRY_IO_REQUEST_MAX)
        return ferry__err_set(NULL, -EINVAL,
                              "ferry_io_open: max_request %zu: accepted 1..%zu bytes (0 means the "
                              "engine's default)",
                              o.max_request, (size_t)FERRY_IO_REQUEST_MAX);
    if (o.bounce_bytes > FERRY_IO_BOUNCE_MAX)
        return ferry__err_set(NULL, -EINVAL,
                              "ferry_io_open: bounce_bytes %zu: accepted 1..%zu bytes (0 means "
                              "8 MiB)",
                              o.bounce_bytes, (size_t)FERRY_IO_BOUNCE_MAX);
    const char *name = o.engine && *o.engine ? o.engine : "auto";
    char reason[512];
    if (!strcmp(name, "auto")) {
        const char *env = getenv("FERRY_IO_ENGINE");
        if (env && *env && strcmp(env, "auto") != 0) {
            const ferry__io_ops *ops = engine_by_name(env);
            if (!ops)
                return ferry__err_set(NULL, -EINVAL,
                                      "FERRY_IO_ENGINE=%s: unknown engine (posix|uring|cufile)",
                                      env);
            ferry_io *io = NULL;
            int rc = io_create(ops, &o, &io);
            if (rc < 0)
                return rc;
            snprintf(io->reason, sizeof io->reason, "%s: forced by env FERRY_IO_ENGINE=%s",
                     ops->name, env);
            *out = io;
            return 0;
        }
        /* fastest first: cufile (device must be cuda), uring, posix */
        char why_cf[256] = "", why_ur[256] = "";
        size_t used = 0;
        int cf_ok = 0;
        if (!o.device)
            snprintf(why_cf, sizeof why_cf, "cufile not tried: no device given");
        else if (strcmp(ferry_device_backend(o.device), "cuda") != 0)
            snprintf(why_cf, sizeof why_cf, "cufile not tried: device backend is %s, not cuda",
                     ferry_device_backend(o.device));
        else {
            char w[200] = "";
            if (ferry__cufile_probe(w, sizeof w) == 0)
                cf_ok = 1;
            else
                snprintf(why_cf, sizeof why_cf, "cufile not usable: %s", w);
        }
        ferry_io *io = NULL;
        if (cf_ok) {
            int rc = io_create(&ferry__io_cufile_ops, &o, &io);
            if (rc == 0) {
                snprintf(io->reason, sizeof io->reason,
                         "cufile: auto, cuda device and cuFile driver open");
                *out = io;
                return 0;
            }
            snprintf(why_cf, sizeof why_cf, "cufile failed to open: %s", ferry_last_error());
        }
        char w[200] = "";
        int urc = ferry__uring_probe(w, sizeof w);
        if (urc == 0) {
            int rc = io_create(&ferry__io_uring_ops, &o, &io);
            if (rc == 0) {
                snprintf(io->reason, sizeof io->reason, "uring: auto, io_uring works here; %s",
                         why_cf);
                *out = io;
                return 0;
            }
            snprintf(why_ur, sizeof why_ur, "uring failed to open: %s", ferry_last_error());
        } else
            snprintf(why_ur, sizeof why_ur, "uring not usable: %s", w);
        int rc = io_create(&ferry__io_posix_ops, &o, &io);
        if (rc < 0)
            return rc;
        used = (size_t)snprintf(reason, sizeof reason, "posix: auto; %s; %s", why_ur, why_cf);
        (void)used;
        snprintf(io->reason, sizeof io->reason, "%s", reason);
        *out = io;
        return 0;
    }
    const ferry__io_ops *ops = engine_by_name(name);
    if (!ops)
        return ferry__err_set(NULL, -EINVAL, "ferry_io_open: unknown engine '%s' "
                              "(auto|posix|uring|cufile)", name);
    ferry_io *io = NULL;
    int rc = io_create(ops, &o, &io);
    if (rc < 0)
        return rc;
    snprintf(io->reason, sizeof io->reason, "%s: chosen by the caller", ops->name);
    *out = io;
    return 0;
}

static void pump(ferry_io *io, int timeout_ms);

void ferry_io_close(ferry_io *io)
{
    if (!io)
        return;
    while (io->parts_busy || io->pend_head)
        pump(io, -1);
    /* completions not reaped are dropped: each request is the caller's
     * again, to submit anywhere */
    for (ferry_io_req *r = io->done_head, *nx; r; r = nx) {
        nx = P(r)->next;
        ferry__io_live_drop(r);
    }
    if (io->nfiles)
        FERRY_LOGW("io %s: closed with %u file(s) still open; close files first", io->ops->name,
                   io->nfiles);
    ferry__bounce_free(io);
    io->ops->fini(io);
    ferry__free(io->parts);
    ferry__free(io->scratch);
    ferry__free(io);
}

const char *ferry_io_engine(const ferry_io *io)
{
    return io ? io->ops->name : "";
}
const char *ferry_io_reason(const ferry_io *io)
{
    return io ? io->reason : "";
}
const char *ferry_io_last_error(const ferry_io *io)
{
    return io ? ferry__err_msg(&io->err) : "";
}
unsigned ferry_io_depth(const ferry_io *io)
{
    return io ? io->depth : 0;
}
unsigned ferry_io_inflight(const ferry_io *io)
{
    return io ? io->inflight : 0;
}
size_t ferry_io_max_request(const ferry_io *io)
{
    return io ? io->max_request : 0;
}

/* ---- files ---- */
static const char *access_name(unsigned flags)
{
    if ((flags & FERRY_FILE_READ) && (flags & FERRY_FILE_WRITE))
        return "read/write";
    return (flags & FERRY_FILE_WRITE) ? "write" : "read";
}

int ferry_file_open(ferry_io *io, const char *path, unsigned flags, ferry_file **out)
{
    return ferry_file_open_mode(io, path, flags, 0, out);
}

int ferry_file_open_mode(ferry_io *io, const char *path, unsigned flags, unsigned mode,
                         ferry_file **out)
{
    if (!io || !path || !*path || !out)
        return ferry__err_set(io ? &io->err : NULL, -EINVAL,
                              "ferry_file_open: io, path and out must be given");
    if (!(flags & (FERRY_FILE_READ | FERRY_FILE_WRITE)))
        return ferry__err_set(&io->err, -EINVAL,
                              "file %s: open needs FERRY_FILE_READ and/or FERRY_FILE_WRITE", path);
    if (flags & ~(unsigned)0x3f)
        return ferry__err_set(&io->err, -EINVAL, "file %s: unknown open flags 0x%x", path,
                              flags & ~(unsigned)0x3f);
    if (ferry__mode_check(mode, path, &io->err) < 0)
        return -EINVAL;
    mode_t fmode = (mode_t)ferry__file_mode(mode);
    ferry_file *f = ferry__calloc(1, sizeof *f);
    char *p = ferry__strdup(path);
    if (!f || !p) {
        ferry__free(f);
        ferry__free(p);
        return ferry__err_set(&io->err, -ENOMEM, "file %s: out of memory", path);
    }
    int of = O_CLOEXEC;
    if ((flags & FERRY_FILE_READ) && (flags & FERRY_FILE_WRITE))
        of |= O_RDWR;
    else if (flags & FERRY_FILE_WRITE)
        of |= O_WRONLY;
    else
        of |= O_RDONLY;
    if (flags & FERRY_FILE_CREATE)
        of |= O_CREAT;
    if (flags & FERRY_FILE_TRUNC)
        of |= O_TRUNC;
    const ferry__sys *sys = ferry__sys_get();
    int want_direct = (flags & (FERRY_FILE_DIRECT | FERRY_FILE_REQUIRE_DIRECT)) != 0;
    int fd = -1, e = 0, direct = 0;
    if (want_direct) {
        fd = sys->open(path, of | O_DIRECT, fmode);
        e = errno;
        if (fd >= 0)
            direct = 1;
        else if (e == EINVAL && !(flags & FERRY_FILE_REQUIRE_DIRECT)) {
            fd = sys->open(path, of, fmode);
            e = errno;
            if (fd >= 0)
                snprintf(f->fallback, sizeof f->fallback,
                         "O_DIRECT refused by the file system (open: EINVAL); using buffered "
                         "I/O through the page cache");
        } else if (e == EINVAL) {
            ferry__free(p);
            ferry__free(f);
            return ferry__err_set(&io->err, -EINVAL,
                                  "file %s: open for %s with O_DIRECT refused by the file system "
                                  "(EINVAL) and FERRY_FILE_REQUIRE_DIRECT was given",
                                  path, access_name(flags));
        }
    } else {
        fd = sys->open(path, of, fmode);
        e = errno;
    }
    if (fd < 0) {
        ferry__free(p);
        ferry__free(f);
        if (e == 0)
            e = EIO;
        return ferry__err_set(&io->err, -e, "file %s: open for %s%s failed: %s (%s)", path,
                              access_name(flags), (flags & FERRY_FILE_CREATE) ? " (create)" : "",
                              ferry_err_name(-e), strerror(e));
    }
    struct stat st; /* (a directory opens for reading, and its reads fail later) */
    if (sys->fstat(fd, &st) == 0 && S_ISDIR(st.st_mode)) {
        sys->close(fd);
        ferry__free(p);
        ferry__free(f);
        return ferry__err_set(&io->err, -EISDIR, "file %s: open for %s: a directory, not a file",
                              path, access_name(flags));
    }
    if (f->fallback[0])
        FERRY_LOGW("file %s: %s", path, f->fallback);
    f->io = io;
    f->path = p;
    f->fd = fd;
    f->flags = flags;
    f->direct = direct;
    f->slot = -1;
    int rc = io->ops->file_open ? io->ops->file_open(io, f) : 0;
    if (rc < 0) {
        sys->close(fd);
        ferry__free(p);
        ferry__free(f);
        return rc;
    }
    io->nfiles++;
    *out = f;
    return 0;
}

/* whether the engine still holds a part of a request on f, or a request
 * on f waits to be dispatched */
static int file_busy(const ferry_io *io, const ferry_file *f)
{
    for (const ferry_io_req *r = io->pend_head; r; r = ferry__rq_of((ferry_io_req *)r)->next)
        if (r->file == f)
            return 1;
    for (unsigned i = 0; io->parts_busy && i < io->nparts; i++)
        if (io->parts[i].parent && io->parts[i].file == f)
            return 1;
    return 0;
}

int ferry_file_close(ferry_file *f)
{
    if (!f)
        return 0;
    ferry_io *io = f->io;
    /* its requests still queued or in the engine run to their end first
     * (their completions stay for ferry_io_reap): closed under them, the
     * descriptor would go to the next file opened, and their bytes with it */
    while (file_busy(io, f))
        pump(io, -1);
    if (io->ops->file_close)
        io->ops->file_close(io, f);
    int rc = 0;
    if (ferry__sys_get()->close(f->fd) != 0) {
        int e = errno;
        rc = ferry__err_set(&io->err, -e, "file %s: close failed: %s", f->path, strerror(e));
    }
    io->nfiles--;
    ferry__free(f->path);
    ferry__free(f);
    return rc;
}

const char *ferry_file_path(const ferry_file *f)
{
    return f ? f->path : "";
}
int ferry_file_fd(const ferry_file *f)
{
    return f ? f->fd : -1;
}
int ferry_file_is_direct(const ferry_file *f)
{
    return f ? f->direct : 0;
}
const char *ferry_file_fallback_reason(const ferry_file *f)
{
    return f && f->fallback[0] ? f->fallback : NULL;
}
int ferry_file_is_gds(const ferry_file *f)
{
    return f ? f->gds : 0;
}

int ferry_file_size(ferry_file *f, uint64_t *out)
{
    if (!f || !out)
        return ferry__err_set(NULL, -EINVAL, "ferry_file_size: file and out must be given");
    struct stat st;
    if (ferry__sys_get()->fstat(f->fd, &st) != 0) {
        int e = errno;
        return ferry__err_set(&f->io->err, -e, "file %s: fstat failed: %s", f->path, strerror(e));
    }
    *out = (uint64_t)st.st_size;
    return 0;
}

int ferry_file_allocate(ferry_file *f, uint64_t off, uint64_t len)
{
    if (!f)
        return ferry__err_set(NULL, -EINVAL, "ferry_file_allocate: file is NULL");
    if (len == 0 || off > (uint64_t)INT64_MAX || len > (uint64_t)INT64_MAX - off)
        return ferry__err_set(&f->io->err, -EINVAL,
                              "file %s: allocate of %llu bytes at offset %llu: bad range", f->path,
                              (unsigned long long)len, (unsigned long long)off);
    /* more than the file system has free is refused before any block is
     * taken: fallocate would fill the disk (every process on it then gets
     * ENOSPC) for minutes before it failed. The host's root may take the
     * blocks the file system keeps for it (ext4's reserve, not btrfs's
     * f_bfree): room.c (a user namespace's root is not the host's) */
    struct stat st;
    uint64_t room;
    if (ferry__fs_room(f->fd, &room) == 0 && ferry__sys_get()->fstat(f->fd, &st) == 0) {
        uint64_t have = (uint64_t)st.st_blocks * 512;
        if (len > have && len - have > room)
            return ferry__err_set(&f->io->err, -ENOSPC,
                                  "file %s: allocate of %llu bytes at offset %llu: the file "
                                  "system has %llu bytes free (ENOSPC); accepted: a size that "
                                  "fits there, or free space first",
                                  f->path, (unsigned long long)len, (unsigned long long)off,
                                  (unsigned long long)room);
    }
    int e = ferry__sys_get()->fallocate(f->fd, (off_t)off, (off_t)len);
    if (e != 0)
        return ferry__err_set(&f->io->err, -e,
                              "file %s: allocate of %llu bytes at offset %llu failed: %s (%s)",
                              f->path, (unsigned long long)len, (unsigned long long)off,
                              ferry_err_name(-e), strerror(e));
    return 0;
}

int ferry_file_truncate(ferry_file *f, uint64_t len)
{
    if (!f)
        return ferry__err_set(NULL, -EINVAL, "ferry_file_truncate: file is NULL");
    if (len > (uint64_t)INT64_MAX)
        return ferry__err_set(&f->io->err, -EINVAL, "file %s: truncate to %llu: too large",
                              f->path, (unsigned long long)len);
    if (ferry__sys_get()->ftruncate(f->fd, (off_t)len) != 0) {
        int e = errno;
        return ferry__err_set(&f->io->err, -e, "file %s: truncate to %llu bytes failed: %s (%s)",
                              f->path, (unsigned long long)len, ferry_err_name(-e), strerror(e));
    }
    return 0;
}

int ferry_file_sync(ferry_file *f)
{
    if (!f)
        return ferry__err_set(NULL, -EINVAL, "ferry_file_sync: file is NULL");
    if (ferry__sys_get()->fdatasync(f->fd) != 0) {
        int e = errno;
        return ferry__err_set(&f->io->err, -e, "file %s: fdatasync failed: %s (%s)", f->path,
                              ferry_err_name(-e), strerror(e));
    }
    return 0;
}

int ferry_file_drop_cache(ferry_file *f)
{
    if (!f)
        return ferry__err_set(NULL, -EINVAL, "ferry_file_drop_cache: file is NULL");
    if (f->direct)
        return 0;
    const ferry__sys *sys = ferry__sys_get();
    if (sys->fdatasync(f->fd) != 0) {
        int e = errno;
        return ferry__err_set(&f->io->err, -e, "file %s: fdatasync failed: %s", f->path,
                              strerror(e));
    }
    int e = sys->fadvise(f->fd, 0, 0, POSIX_FADV_DONTNEED);
    if (e != 0)
        return ferry__err_set(&f->io->err, -e, "file %s: posix_fadvise(DONTNEED) failed: %s",
                              f->path, strerror(e));
    return 0;
}

/* ---- buffers ---- */
int ferry_io_register_buffer(ferry_io *io, void *buf, size_t len)
{
    if (!io || !buf || !len)
        return ferry__err_set(io ? &io->err : NULL, -EINVAL,
                              "io: register_buffer needs a buffer and a length");
    /* the engines count slots by rounding len up and compare buf + len:
     * a range past the end of the address space must not reach them */
    if (len > UINTPTR_MAX - (uintptr_t)buf)
        return ferry__err_set(&io->err, -EINVAL,
                              "io: register_buffer of %zu bytes at %p: len wraps around the "
                              "address space",
                              len, buf);
    return io->ops->buf_register ? io->ops->buf_register(io, buf, len) : 0;
}

int ferry_io_unregister_buffer(ferry_io *io, void *buf)
{
    if (!io || !buf)
        return ferry__err_set(io ? &io->err : NULL, -EINVAL,
                              "io: unregister_buffer needs a buffer");
    return io->ops->buf_unregister ? io->ops->buf_unregister(io, buf) : 0;
}

int ferry_io_register_dev(ferry_io *io, ferry_devptr p, size_t len)
{
    if (!io || !p || !len)
        return ferry__err_set(io ? &io->err : NULL, -EINVAL,
                              "io: register_dev needs a device pointer and a length");
    if (len > UINT64_MAX - p)
        return ferry__err_set(&io->err, -EINVAL,
                              "io: register_dev of %zu bytes at 0x%llx: len wraps around the "
                              "address space",
                              len, (unsigned long long)p);
    return io->ops->dev_register ? io->ops->dev_register(io, p, len) : 0;
}

int ferry_io_unregister_dev(ferry_io *io, ferry_devptr p)
{
    if (!io || !p)
        return ferry__err_set(io ? &io->err : NULL, -EINVAL,
                              "io: unregister_dev needs a device pointer");
    return io->ops->dev_unregister ? io->ops->dev_unregister(io, p) : 0;
}

int ferry_io_buffer_alloc(ferry_io *io, size_t len, void **out)
{
    if (!io || !len || !out)
        return ferry__err_set(io ? &io->err : NULL, -EINVAL,
                              "io: buffer_alloc needs a length and out");
    size_t n = FERRY__ALIGN_UP(len, (size_t)FERRY_IO_ALIGN);
    if (n < len)
        return ferry__err_set(&io->err, -EINVAL, "io: buffer_alloc of %zu bytes: too large", len);
    void *p = NULL;
    if (io->device) {
        int rc = ferry_device_host_alloc(io->device, n, &p);
        if (rc < 0)
            return ferry__err_pass(&io->err, rc);
    } else {
        /* large buffers on 2 MiB boundaries, backed by transparent huge
         * pages where the kernel allows: pinning them for O_DIRECT (per
         * request, or once at registration) walks 512x fewer pages */
        size_t huge = (size_t)2 << 20;
        size_t align = n >= huge ? huge : FERRY_IO_ALIGN;
        p = ferry__aligned_alloc(align, n);
        if (!p)
            return ferry__err_set(&io->err, -ENOMEM, "io: out of memory allocating a %zu-byte "
                                  "aligned buffer", n);
        if (n >= huge && FERRY__IS_ALIGNED(p, huge))
            madvise(p, n & ~(huge - 1), MADV_HUGEPAGE);
    }
    /* best effort: a registered buffer takes the engine's fast path. The
     * length asked for, not the rounded one: the caller registering (p,
     * len) again must find "the same (buf, len)", a no-op (ferry/io.h) */
    if (io->ops->buf_register && io->ops->buf_register(io, p, len) < 0)
        FERRY_LOGD("io %s: buffer %p not registered: %s", io->ops->name, p,
                   ferry__err_msg(&io->err));
    *out = p;
    return 0;
}

void ferry_io_buffer_free(ferry_io *io, void *buf)
{
    if (!io || !buf)
        return;
    if (io->ops->buf_unregister)
        io->ops->buf_unregister(io, buf);
    if (io->device)
        ferry_device_host_free(io->device, buf);
    else
        ferry__free(buf);
}

/* ---- requests ---- */
/* a vectored read's own rules (ferry/io.h), after the common ones */
static int validate_vec(ferry_io *io, const ferry_io_vreq *v)
{
    const ferry_io_req *r = &v->req;
    const ferry_file *f = r->file;
    if (!io->ops->vec)
        return ferry__err_set(&io->err, FERRY_ENOTSUP, "file %s: vectored read of %zu bytes at "
                              "offset %llu: the %s engine has none", f->path, r->len,
                              (unsigned long long)r->offset, io->ops->name);
    if (!v->iov || v->niov == 0 || v->niov > FERRY_IO_IOV_MAX || r->len > io->max_request)
        return ferry__err_set(&io->err, -EINVAL, "file %s: vectored read of %zu bytes at offset "
                              "%llu in %u pieces: accepted 1..%u pieces and at most %zu bytes "
                              "(max_request)", f->path, r->len, (unsigned long long)r->offset,
                              v->iov ? v->niov : 0, FERRY_IO_IOV_MAX, io->max_request);
    uint64_t sum = 0;
    for (unsigned k = 0; k < v->niov; k++) {
        const struct iovec *e = &v->iov[k];
        int bad = !e->iov_base || !e->iov_len || e->iov_len > r->len; /* (no sum wraps) */
        int unaligned = f->direct && (!FERRY__IS_ALIGNED(e->iov_base, FERRY_IO_ALIGN) ||
                                      !FERRY__IS_ALIGNED(e->iov_len, FERRY_IO_ALIGN));
        if (bad || unaligned)
            return ferry__err_set(&io->err, bad ? -EINVAL : FERRY_EALIGN,
                                  "file %s: vectored read of %zu bytes at offset %llu: piece %u "
                                  "(%zu bytes at %p) %s", f->path, r->len,
                                  (unsigned long long)r->offset, k, e->iov_len, e->iov_base,
                                  bad ? "is empty, NULL or longer than the read"
                                      : "is not 4096-aligned for O_DIRECT");
        sum += e->iov_len;
    }
    if (sum != r->len || (f->direct && !FERRY__IS_ALIGNED(r->offset, FERRY_IO_ALIGN)))
        return ferry__err_set(&io->err, sum != r->len ? -EINVAL : FERRY_EALIGN,
                              "file %s: vectored read of %zu bytes at offset %llu: %s", f->path,
                              r->len, (unsigned long long)r->offset,
                              sum != r->len ? "its pieces hold another length"
                                            : "offset not 4096-aligned for O_DIRECT");
    return 0;
}

static int validate(ferry_io *io, ferry_io_req *r)
{
    if (!r)
        return ferry__err_set(&io->err, -EINVAL, "io: request is NULL");
    ferry_file *f = r->file;
    if (!f || f->io != io)
        return ferry__err_set(&io->err, -EINVAL,
                              "io: request's file is NULL or was opened on another engine");
    const char *opn = r->op == FERRY_IO_READ     ? "read"
                      : r->op == FERRY_IO_WRITE  ? "write"
                      : r->op == FERRY_IO_READV ? "vectored read"
                                                 : NULL;
    if (!opn)
        return ferry__err_set(&io->err, -EINVAL, "file %s: unknown op %d", f->path, r->op);
    if (r->len == 0)
        return ferry__err_set(&io->err, -EINVAL, "file %s: %s of 0 bytes at offset %llu: zero "
                              "length", f->path, opn, (unsigned long long)r->offset);
    if (r->offset > (uint64_t)INT64_MAX || r->len > (uint64_t)INT64_MAX - r->offset)
        return ferry__err_set(&io->err, -EINVAL,
                              "file %s: %s of %zu bytes at offset %llu: range past the largest "
                              "file offset", f->path, opn, r->len, (unsigned long long)r->offset);
    if (r->op != FERRY_IO_WRITE && !(f->flags & FERRY_FILE_READ))
        return ferry__err_set(&io->err, -EBADF, "file %s: read of %zu bytes at offset %llu: file "
                              "not opened for reading", f->path, r->len,
                              (unsigned long long)r->offset);
    if (r->op == FERRY_IO_WRITE && !(f->flags & FERRY_FILE_WRITE))
        return ferry__err_set(&io->err, -EBADF, "file %s: write of %zu bytes at offset %llu: file "
                              "not opened for writing", f->path, r->len,
                              (unsigned long long)r->offset);
    if (r->op == FERRY_IO_READV)
        return validate_vec(io, (const ferry_io_vreq *)(const void *)r);
    if (!r->buf) {
        if (!r->dev)
            return ferry__err_set(&io->err, -EINVAL, "file %s: %s of %zu bytes at offset %llu: "
                                  "no buffer (buf and dev are both 0)", f->path, opn, r->len,
                                  (unsigned long long)r->offset);
        if (!io->ops->dev_ok || !io->ops->dev_ok(io, f))
            return ferry__err_set(&io->err, FERRY_ENOTSUP,
                                  "file %s: %s of %zu bytes at offset %llu: device memory in an "
                                  "asynchronous request needs the cufile engine on a GDS file "
                                  "(engine %s%s); use ferry_io_read_dev/write_dev",
                                  f->path, opn, r->len, (unsigned long long)r->offset,
                                  io->ops->name, f->fallback[0] ? ", file fell back" : "");
        return 0; /* cuFile aligns device transfers itself */
    }
    if (f->direct && (!FERRY__IS_ALIGNED(r->buf, FERRY_IO_ALIGN) ||
                      !FERRY__IS_ALIGNED(r->offset, FERRY_IO_ALIGN) ||
                      !FERRY__IS_ALIGNED(r->len, FERRY_IO_ALIGN)))
        return ferry__err_set(&io->err, FERRY_EALIGN,
                              "file %s: O_DIRECT %s of %zu bytes at offset %llu from buffer %p: "
                              "buffer, offset and length must be multiples of %u (%s%s%s)",
                              f->path, opn, r->len, (unsigned long long)r->offset, r->buf,
                              FERRY_IO_ALIGN,
                              FERRY__IS_ALIGNED(r->buf, FERRY_IO_ALIGN) ? "" : "buffer ",
                              FERRY__IS_ALIGNED(r->offset, FERRY_IO_ALIGN) ? "" : "offset ",
                              FERRY__IS_ALIGNED(r->len, FERRY_IO_ALIGN) ? "" : "length ");
    return 0;
}

static void enqueue(ferry_io *io, ferry_io_req *r, uint32_t piece, uint16_t flags, uint16_t pad)
{
    rq_priv *p = P(r);
    /* (not p->live: the table's, and r may be in it already) */
    p->next = NULL;
    p->cursor = 0;
    p->piece_pg = piece / FERRY_IO_ALIGN & ((1u << 20) - 1);
    p->flags = (flags | RQ_PENDING) & 0xfu;
    p->outstanding = 0;
    p->pad = pad;
    r->result = 0;
    if (io->pend_tail)
        P(io->pend_tail)->next = r;
    else
        io->pend_head = r;
    io->pend_tail = r;
}

static void pend_pop(ferry_io *io)
{
    ferry_io_req *r = io->pend_head;
    FERRY__ASSERT(r && (P(r)->flags & RQ_PENDING));
    io->pend_head = P(r)->next;
    if (!io->pend_head)
        io->pend_tail = NULL;
    P(r)->next = NULL;
    P(r)->flags &= ~RQ_PENDING & 0xfu;
}

static void req_finish(ferry_io *io, ferry_io_req *r)
{
    rq_priv *p = P(r);
    /* exactly once: fully dispatched (or failed) and no part in the engine */
    FERRY__ASSERT(!(p->flags & (RQ_DONE | RQ_PENDING)) && p->outstanding == 0);
    if (r->result == 0)
        r->result = (int64_t)r->len;
    p->flags |= RQ_DONE;
    if (p->flags & RQ_INTERNAL)
        return;
    p->next = NULL;
    if (io->done_tail)
        P(io->done_tail)->next = r;
    else
        io->done_head = r;
    io->done_tail = r;
    io->ndone++;
}

static void part_release(ferry_io *io, ferry__part *pt)
{
    ferry_io_req *r = pt->parent;
    FERRY__ASSERT(r && io->parts_busy > 0 && P(r)->outstanding > 0);
    pt->parent = NULL;
    pt->next = io->free_parts;
    io->free_parts = pt;
    io->parts_busy--;
    rq_priv *p = P(r);
    p->outstanding--;
    if (p->outstanding == 0 && !(p->flags & RQ_PENDING))
        req_finish(io, r);
}

static void part_fail(ferry_io *io, ferry__part *pt, int code, const char *cause)
{
    ferry_io_req *r = pt->parent;
    const char *opn = ferry__op_name(pt->op);
    if (r->result == 0) {
        r->result = code;
        if (cause)
            ferry__err_set(&io->err, code,
                           "file %s: %s of %zu bytes at offset %llu: %s (request of %zu bytes at "
                           "offset %llu)", pt->file->path, opn, pt->len,
                           (unsigned long long)pt->off, cause, r->len,
                           (unsigned long long)r->offset);
        else
            ferry__err_set(&io->err, code,
                           "file %s: %s of %zu bytes at offset %llu failed: %s (%s) (request of "
                           "%zu bytes at offset %llu)", pt->file->path, opn, pt->len,
                           (unsigned long long)pt->off, ferry_err_name(code),
                           ferry_strerror(code), r->len, (unsigned long long)r->offset);
    }
    part_release(io, pt);
}

static void parts_submit(ferry_io *io, ferry__part **parts, unsigned n)
{
    int k = io->ops->submit(io, parts, n);
    int err = k < 0 ? k : -EIO; /* an engine that takes fewer recorded why */
    if (k < 0)
        k = 0;
    for (unsigned i = (unsigned)k; i < n; i++)
        part_fail(io, parts[i], err, NULL);
}

static void dispatch(ferry_io *io)
{
    unsigned n = 0;
    while (io->pend_head && io->free_parts) {
        ferry_io_req *r = io->pend_head;
        rq_priv *p = P(r);
        if (r->result < 0) { /* failed: dispatch nothing more of it */
            pend_pop(io);
            if (p->outstanding == 0)
                req_finish(io, r);
            continue;
        }
        size_t piece = (size_t)p->piece_pg * FERRY_IO_ALIGN;
        size_t chunk = FERRY__MIN(piece, r->len - (size_t)p->cursor);
        ferry__part *pt = io->free_parts;
        io->free_parts = pt->next;
        io->parts_busy++;
        FERRY__ASSERT(io->parts_busy <= io->nparts && !pt->parent);
        pt->next = NULL;
        pt->parent = r;
        pt->file = r->file;
        pt->op = r->op == FERRY_IO_READV ? FERRY_IO_READ : r->op;
        pt->fd = r->file->fd;
        pt->iov = NULL;
        pt->niov = 0;
        if (r->op == FERRY_IO_READV) { /* (whole: validate saw len <= piece) */
            const ferry_io_vreq *v = (const ferry_io_vreq *)(const void *)r;
            pt->iov = v->iov;
            pt->niov = v->niov;
        }
        pt->buf = pt->iov ? (char *)pt->iov[0].iov_base
                  : r->buf ? (char *)r->buf + p->cursor
                           : NULL;
        pt->dev = pt->buf ? 0 : r->dev + p->cursor;
        pt->len = chunk;
        pt->off = r->offset + p->cursor;
        pt->done = 0;
        pt->retries = 0;
        pt->res = 0;
        p->cursor += chunk;
        p->outstanding++;
        if (p->cursor == r->len)
            pend_pop(io);
        io->scratch[n++] = pt;
    }
    if (n)
        parts_submit(io, io->scratch, n);
}

static void resubmit(ferry_io *io, ferry__part *pt)
{
    ferry__part *one[1] = {pt};
    parts_submit(io, one, 1);
}

static void part_eof(ferry_io *io, ferry__part *pt)
{
    ferry_io_req *r = pt->parent;
    rq_priv *p = P(r);
    if ((p->flags & RQ_EOF_OK) && pt->off >= r->offset + r->len - p->pad) {
        part_release(io, pt);
        return;
    }
    char cause[160];
    snprintf(cause, sizeof cause, "end of file at offset %llu (FERRY_ESHORT)",
             (unsigned long long)pt->off);
    part_fail(io, pt, FERRY_ESHORT, cause);
}

static void part_result(ferry_io *io, ferry__part *pt)
{
    int64_t res = pt->res;
    if (res == -EINTR || res == -EAGAIN) {
        if (++pt->retries <= RETRY_MAX) {
            resubmit(io, pt);
            return;
        }
        part_fail(io, pt, (int)res, NULL);
        return;
    }
    if (res < 0) {
        part_fail(io, pt, res < INT32_MIN ? -EIO : (int)res, NULL);
        return;
    }
    if (res == 0) {
        if (pt->op == FERRY_IO_READ) {
            part_eof(io, pt);
            return;
        }
        if (++pt->retries <= ZERO_WRITE_MAX) {
            resubmit(io, pt);
            return;
        }
        part_fail(io, pt, FERRY_ESHORT, "the write made no progress (0 bytes written, "
                  "FERRY_ESHORT)");
        return;
    }
    size_t n = (size_t)res > pt->len ? pt->len : (size_t)res;
    if (pt->iov && n < pt->len) { /* (not continued: ferry/io.h) */
        char cause[160];
        snprintf(cause, sizeof cause, "vectored read came back short at offset %llu "
                 "(FERRY_ESHORT)", (unsigned long long)(pt->off + n));
        part_fail(io, pt, FERRY_ESHORT, cause);
        return;
    }
    pt->done += n;
    pt->len -= n;
    pt->off += n;
    if (pt->buf)
        pt->buf += n;
    else
        pt->dev += n;
    pt->retries = 0;
    if (pt->len == 0) {
        part_release(io, pt);
        return;
    }
    /* O_DIRECT reads come back short only at end of file; continuing at an
     * unaligned offset would fail with EINVAL */
    if (pt->op == FERRY_IO_READ && pt->file->direct && pt->buf &&
        !FERRY__IS_ALIGNED(pt->off, FERRY_IO_ALIGN)) {
        part_eof(io, pt);
        return;
    }
    resubmit(io, pt);
}

static void pump(ferry_io *io, int timeout_ms)
{
    dispatch(io);
    if (io->parts_busy == 0)
        return;
    int n = io->ops->wait(io, io->scratch, 1, io->nparts, timeout_ms);
    for (int i = 0; i < n; i++)
        part_result(io, io->scratch[i]);
    dispatch(io);
}

/* reqs[k] is in flight already (on this engine or another): FERRY_EBUSY
 * naming it and its engine. Its file is the holder's (the holder checked
 * it, and a request is not the caller's to change until reaped). The
 * table itself cannot name the holder, as gds's does: its node is in the
 * request's private words, all 32 bytes of them taken, and an owner would
 * need a word more (a larger public ferry_io_req, or an allocation per
 * submit). So a caller who switched r->file while in flight is told the
 * new file's engine. */
static int submit_busy(ferry_io *io, unsigned k, const ferry_io_req *r)
{
    const ferry_io *holder = r->file ? r->file->io : NULL;
    const char *opn = r->op == FERRY_IO_WRITE ? "write" : "read";
    if (holder == io)
        return ferry__err_set(&io->err, FERRY_EBUSY,
                              "io: submit: request %p (reqs[%u], %s of %zu bytes at offset %llu "
                              "of file %s) is already in flight: a request is the engine's from "
                              "submit until reaped", (const void *)r, k, opn, r->len,
                              (unsigned long long)r->offset, r->file->path);
    return ferry__err_set(&io->err, FERRY_EBUSY,
                          "io: submit: request %p (reqs[%u], %s of %zu bytes at offset %llu of "
                          "file %s) is in flight on another engine (%p, not this one, %p): a "
                          "request is the engine's it was submitted to until reaped there",
                          (const void *)r, k, opn, r->len, (unsigned long long)r->offset,
                          r->file ? r->file->path : "?", (const void *)holder, (void *)io);
}

int ferry_io_submit(ferry_io *io, ferry_io_req *const *reqs, unsigned n)
{
    if (!io || (!reqs && n))
        return ferry__err_set(io ? &io->err : NULL, -EINVAL, "ferry_io_submit: io or reqs is "
                              "NULL");
    if (n > INT_MAX) /* the count returned must fit an int */
        return ferry__err_set(&io->err, -EINVAL, "ferry_io_submit: n %u: accepted 0..%d", n,
                              INT_MAX);
    unsigned k = 0;
    int rc = 0;
    for (; k < n; k++) {
        ferry_io_req *r = reqs[k];
        rc = validate(io, r);
        /* a request in flight elsewhere fails validation here (its file is
         * the other engine's): busy is what it is. Checked first, taken
         * last: only a request this engine can run enters the table. */
        if (rc < 0 ? r && ferry__io_live_held(r) : !ferry__io_live_take(r))
            rc = submit_busy(io, k, r);
        if (rc < 0)
            break;
        enqueue(io, r, (uint32_t)io->max_request, 0, 0);
        io->inflight++;
    }
    /* none taken: the engine untouched (a racer that lost to another
     * thread's submit of the same request must not drive the io) */
    if (k)
        dispatch(io);
    return k ? (int)k : rc;
}

int ferry_io_reap(ferry_io *io, ferry_io_req **done, unsigned min, unsigned max, int timeout_ms)
{
    if (!io || (!done && max))
        return ferry__err_set(io ? &io->err : NULL, -EINVAL, "ferry_io_reap: io or done is NULL");
    if (min > max)
        return ferry__err_set(&io->err, -EINVAL, "ferry_io_reap: min %u > max %u", min, max);
    if (max > INT_MAX)
        max = INT_MAX; /* the count returned must fit an int; more are reaped next call */
    if (min > io->inflight)
        min = io->inflight;
    uint64_t deadline = timeout_ms < 0 ? 0 : ferry__now_ns() + (uint64_t)timeout_ms * 1000000ull;
    if (io->ndone < max)
        pump(io, 0); /* collect what has finished without waiting */
    while (io->ndone < min) {
        int left = -1;
        if (timeout_ms >= 0) {
            uint64_t now = ferry__now_ns();
            left = now >= deadline ? 0 : (int)((deadline - now + 999999) / 1000000);
        }
        pump(io, left);
        if (timeout_ms >= 0 && ferry__now_ns() >= deadline)
            break;
    }
    unsigned k = 0;
    while (k < max && io->done_head) {
        ferry_io_req *r = io->done_head;
        io->done_head = P(r)->next;
        if (!io->done_head)
            io->done_tail = NULL;
        P(r)->next = NULL;
        ferry__io_live_drop(r); /* the caller's again: any engine may take it */
        FERRY__ASSERT(io->ndone > 0 && io->inflight >= io->ndone);
        io->ndone--;
        io->inflight--;
        done[k++] = r;
    }
    return (int)k;
}

/* ---- synchronous helpers ---- */
static uint32_t sync_piece(const ferry_io *io, size_t len)
{
    size_t piece = (len + io->depth - 1) / io->depth;
    piece = FERRY__ALIGN_UP(piece, (size_t)FERRY_IO_ALIGN);
    if (piece < ((size_t)128 << 10))
        piece = (size_t)128 << 10;
    if (piece > io->max_request)
        piece = io->max_request;
    return (uint32_t)piece;
}

int ferry__io_start(ferry_io *io, ferry_io_req *r, ferry_file *f, int op, void *buf,
                    ferry_devptr dev, size_t len, uint64_t off, size_t min_len)
{
    return ferry__io_start_piece(io, r, f, op, buf, dev, len, off, min_len, 0);
}

int ferry__io_start_piece(ferry_io *io, ferry_io_req *r, ferry_file *f, int op, void *buf,
                          ferry_devptr dev, size_t len, uint64_t off, size_t min_len,
                          size_t piece)
{
    memset(r, 0, sizeof *r);
    r->op = op;
    r->file = f;
    r->buf = buf;
    r->dev = buf ? 0 : dev;
    r->len = len;
    r->offset = off;
    int rc = validate(io, r);
    if (rc < 0)
        return rc;
    uint16_t flags = RQ_INTERNAL, pad = 0;
    if (op == FERRY_IO_READ && min_len < len && len - min_len < 65536) {
        flags |= RQ_EOF_OK;
        pad = (uint16_t)(len - min_len);
    }
    if (piece) {
        piece = FERRY__ALIGN_UP(piece, (size_t)FERRY_IO_ALIGN);
        piece = FERRY__MIN(piece, (size_t)io->max_request);
    }
    enqueue(io, r, piece ? (uint32_t)piece : sync_piece(io, len), flags, pad);
    dispatch(io);
    return 0;
}

int ferry__io_finish(ferry_io *io, ferry_io_req *r)
{
    while (!(P(r)->flags & RQ_DONE))
        pump(io, -1);
    return r->result < 0 ? (int)r->result : 0;
}

int ferry__io_rw(ferry_io *io, ferry_file *f, int op, void *buf, ferry_devptr dev, size_t len,
                 uint64_t off, size_t min_len)
{
    ferry_io_req r;
    int rc = ferry__io_start(io, &r, f, op, buf, dev, len, off, min_len);
    return rc < 0 ? rc : ferry__io_finish(io, &r);
}

int ferry_io_pread(ferry_io *io, ferry_file *f, void *buf, size_t len, uint64_t off)
{
    if (!io)
        return ferry__err_set(NULL, -EINVAL, "ferry_io_pread: io is NULL");
    if (!buf)
        return ferry__err_set(&io->err, -EINVAL, "ferry_io_pread: buf is NULL");
    return ferry__io_rw(io, f, FERRY_IO_READ, buf, 0, len, off, len);
}

int ferry_io_pwrite(ferry_io *io, ferry_file *f, const void *buf, size_t len, uint64_t off)
{
    if (!io)
        return ferry__err_set(NULL, -EINVAL, "ferry_io_pwrite: io is NULL");
    if (!buf)
        return ferry__err_set(&io->err, -EINVAL, "ferry_io_pwrite: buf is NULL");
    return ferry__io_rw(io, f, FERRY_IO_WRITE, (void *)(uintptr_t)buf, 0, len, off, len);
}

static int dev_rw(ferry_io *io, ferry_file *f, ferry_stream *s, int op, ferry_devptr p,
                  size_t len, uint64_t off)
{
    if (!io)
        return ferry__err_set(NULL, -EINVAL, "ferry_io_%s_dev: io is NULL", ferry__op_name(op));
    if (!f || f->io != io)
        return ferry__err_set(&io->err, -EINVAL, "ferry_io_%s_dev: file is NULL or was opened "
                              "on another engine", ferry__op_name(op));
    if (!p)
        return ferry__err_set(&io->err, -EINVAL, "file %s: device %s of %zu bytes at offset "
                              "%llu: device pointer is 0", f->path, ferry__op_name(op), len,
                              (unsigned long long)off);
    if (len == 0)
        return ferry__err_set(&io->err, -EINVAL, "file %s: device %s of 0 bytes at offset %llu: "
                              "zero length", f->path, ferry__op_name(op),
                              (unsigned long long)off);
    if (off > (uint64_t)INT64_MAX || len > (uint64_t)INT64_MAX - off)
        return ferry__err_set(&io->err, -EINVAL, "file %s: device %s of %zu bytes at offset "
                              "%llu: range past the largest file offset", f->path,
                              ferry__op_name(op), len, (unsigned long long)off);
    unsigned need = op == FERRY_IO_READ ? FERRY_FILE_READ : FERRY_FILE_WRITE;
    if (!(f->flags & need))
        return ferry__err_set(&io->err, -EBADF, "file %s: device %s of %zu bytes at offset "
                              "%llu: file not opened for %s", f->path, ferry__op_name(op), len,
                              (unsigned long long)off, op == FERRY_IO_READ ? "reading" : "writing");
    if (io->ops->dev_rw && f->gds) {
        int rc = io->ops->dev_rw(io, f, s, op, p, len, off);
        if (rc != FERRY_ENOTSUP)
            return rc;
    }
    return ferry__bounce_rw(io, f, s, op, p, len, off);
}

int ferry_io_read_dev(ferry_io *io, ferry_file *f, ferry_stream *s, ferry_devptr dst, size_t len,
                      uint64_t off)
{
    return dev_rw(io, f, s, FERRY_IO_READ, dst, len, off);
}

int ferry_io_write_dev(ferry_io *io, ferry_file *f, ferry_stream *s, ferry_devptr src, size_t len,
                       uint64_t off)
{
    return dev_rw(io, f, s, FERRY_IO_WRITE, src, len, off);
}
