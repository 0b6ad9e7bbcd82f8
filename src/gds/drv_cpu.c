/*
 * drv_cpu.c - the "cpu" GDS driver: no GPUDirect, ferry's own CPU path.
 *
 * Device memory moves through the I/O layer's double-buffered bounce path
 * (ferry_io_read_dev / ferry_io_write_dev: the file I/O of one segment
 * overlaps the device copy of the next), on the drive's own ferry_io
 * queue. Registration has nothing to pin (the bounce buffers are the
 * engine's, pinned once), so buffer and stream registration succeed
 * without doing anything; the context still keeps its regions, so the
 * region rules (no interior pointers, EBOUNDS outside every region) hold
 * whatever the driver.
 *
 * O_DIRECT and unaligned pieces: the bounce path needs 4096-aligned file
 * offsets (and lengths, for writes), but the context cuts a slice where it
 * crosses a region boundary, and a device slice at an unaligned address
 * crosses it at an unaligned point, so a piece may start or end inside a
 * 4096-byte block of the file. Such a head or tail moves through one
 * aligned staging block per handle: reads read the whole block and copy
 * out the wanted bytes; writes read the block, overlay the device's bytes
 * and write it back. The rest of the block is the same transfer's own
 * slab range (slab offsets and lengths are aligned, so no block is shared
 * with another transfer), written by its neighbouring piece either before
 * or after in the same thread, and the drive's lock in the context keeps
 * other transfers off the handle while its staging block is in use.
 *
 * Invariant: an async call has finished its bytes before it returns, with
 * its device copies queued on the caller's stream, so it is ordered after
 * the work already on that stream and *done is final at once. A batch
 * spanning several drives runs one thread per extra drive: each drive's
 * queue is driven by exactly one thread (a ferry_io is single-threaded),
 * and the drives work at the same time.
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "driver.h"

typedef struct cpu_drv {
    ferry_device *dev;
} cpu_drv;

typedef struct cpu_handle {
    ferry_io *io;
    ferry_file *f;
    void *stage; /* FERRY_IO_ALIGN bytes, aligned; allocated at first need */
} cpu_handle;

static int cpu_open(void *ctx, ferry_device *dev)
{
    ((cpu_drv *)ctx)->dev = dev;
    return 0;
}

static int cpu_handle_register(void *ctx, ferry_io *io, ferry_file *f, void **handle)
{
    (void)ctx;
    cpu_handle *h = ferry__calloc(1, sizeof *h);
    if (!h)
        return ferry__err_set(NULL, -ENOMEM, "cpu driver: out of memory registering %s",
                              ferry_file_path(f));
    h->io = io;
    h->f = f;
    *handle = h;
    return 0;
}

static void cpu_handle_deregister(void *ctx, void *handle)
{
    (void)ctx;
    cpu_handle *h = handle;
    if (h)
        ferry__free(h->stage);
    ferry__free(h);
}

static int cpu_buf_register(void *ctx, ferry_devptr base, size_t len, int flags)
{
    (void)ctx, (void)base, (void)len, (void)flags;
    return 0;
}

static int cpu_buf_deregister(void *ctx, ferry_devptr base)
{
    (void)ctx, (void)base;
    return 0;
}

static int cpu_stream_register(void *ctx, ferry_stream *s, uint64_t raw, unsigned flags)
{
    (void)ctx, (void)s, (void)raw, (void)flags;
    return 0;
}

static int cpu_stream_deregister(void *ctx, ferry_stream *s, uint64_t raw)
{
    (void)ctx, (void)s, (void)raw;
    return 0;
}

/* device <-> host copy of n bytes, ordered after the work on s when s is
 * given (as the bounce path's own copies are), and finished on return */
static int dev_copy(cpu_drv *d, int op, ferry_stream *s, ferry_devptr p, void *host, size_t n)
{
    if (!s)
        return op == FERRY_IO_READ ? ferry_device_upload(d->dev, p, host, n)
                                   : ferry_device_download(d->dev, host, p, n);
    int rc = op == FERRY_IO_READ ? ferry_memcpy_htod_async(s, p, host, n)
                                 : ferry_memcpy_dtoh_async(s, host, p, n);
    int rs = ferry_stream_sync(s); /* even after a failed enqueue: nothing may touch host */
    return rc < 0 ? rc : rs;
}

/* n bytes at file offset off (inside one aligned block) <-> device p,
 * through the handle's staging block */
static int edge(cpu_drv *d, cpu_handle *h, int op, ferry_stream *s, ferry_devptr p, size_t n,
                uint64_t off)
{
    const size_t blk = FERRY_IO_ALIGN;
    uint64_t at = off & ~(uint64_t)(blk - 1);
    size_t in = (size_t)(off - at);
    if (!h->stage && !(h->stage = ferry__aligned_alloc(blk, blk)))
        return ferry__err_set(NULL, -ENOMEM, "cpu driver: out of memory for a staging block");
    const char *step = "reading the block";
    int rc = ferry_io_pread(h->io, h->f, h->stage, blk, at);
    if (rc == 0) {
        step = op == FERRY_IO_READ ? "copying to the device" : "copying from the device";
        rc = dev_copy(d, op, s, p, (char *)h->stage + in, n);
    }
    if (rc == 0 && op == FERRY_IO_WRITE) {
        step = "writing the block back";
        rc = ferry_io_pwrite(h->io, h->f, h->stage, blk, at);
    }
    if (rc < 0) {
        char m[FERRY__ERRMSG_MAX];
        snprintf(m, sizeof m, "%s", ferry_last_error());
        return ferry__err_set(NULL, rc,
                              "cpu driver: %s of %zu unaligned bytes at file offset %llu of %s "
                              "(device 0x%llx) through the %zu-byte block at %llu: %s: %s",
                              op == FERRY_IO_READ ? "read" : "write", n, (unsigned long long)off,
                              ferry_file_path(h->f), (unsigned long long)p, blk,
                              (unsigned long long)at, step, m);
    }
    return 0;
}

static int64_t rw(cpu_drv *d, cpu_handle *h, int op, ferry_stream *s, ferry_devptr base,
                  size_t size, int64_t file_off, int64_t buf_off)
{
    if (!d->dev)
        return ferry__err_set(NULL, FERRY_ENODEV,
                              "cpu driver: %s of device memory on %s, but the context has no "
                              "device (set ferry_gds_config.device)",
                              op == FERRY_IO_READ ? "read" : "write", ferry_file_path(h->f));
    ferry_devptr p = base + (uint64_t)buf_off;
    uint64_t off = (uint64_t)file_off;
    if (ferry_file_is_direct(h->f) &&
        (!FERRY__IS_ALIGNED(off, FERRY_IO_ALIGN) || !FERRY__IS_ALIGNED(size, FERRY_IO_ALIGN))) {
        /* unaligned head and tail through the staging block, the aligned
         * middle through the bounce path */
        for (size_t pos = 0; pos < size;) {
            uint64_t o = off + pos;
            size_t in = (size_t)(o & (FERRY_IO_ALIGN - 1)), n, left = size - pos;
            int rc;
            if (in || left < FERRY_IO_ALIGN) {
                n = FERRY__MIN(left, (size_t)FERRY_IO_ALIGN - in);
                rc = edge(d, h, op, s, p + pos, n, o);
            } else {
                n = left & ~(size_t)(FERRY_IO_ALIGN - 1);
                rc = op == FERRY_IO_READ ? ferry_io_read_dev(h->io, h->f, s, p + pos, n, o)
                                         : ferry_io_write_dev(h->io, h->f, s, p + pos, n, o);
            }
            if (rc < 0)
                return rc;
            pos += n;
        }
        return (int64_t)size;
    }
    int rc = op == FERRY_IO_READ ? ferry_io_read_dev(h->io, h->f, s, p, size, (uint64_t)file_off)
                                 : ferry_io_write_dev(h->io, h->f, s, p, size, (uint64_t)file_off);
    return rc < 0 ? rc : (int64_t)size;
}

static int64_t cpu_read(void *ctx, void *handle, ferry_devptr base, size_t size,
                        int64_t file_off, int64_t buf_off)
{
    return rw(ctx, handle, FERRY_IO_READ, NULL, base, size, file_off, buf_off);
}

static int64_t cpu_write(void *ctx, void *handle, ferry_devptr base, size_t size,
                         int64_t file_off, int64_t buf_off)
{
    return rw(ctx, handle, FERRY_IO_WRITE, NULL, base, size, file_off, buf_off);
}

static int cpu_read_async(void *ctx, void *handle, ferry_devptr base, size_t *size,
                          int64_t *file_off, int64_t *buf_off, int64_t *done, ferry_stream *s)
{
    *done = rw(ctx, handle, FERRY_IO_READ, s, base, *size, *file_off, *buf_off);
    return 0;
}

static int cpu_write_async(void *ctx, void *handle, ferry_devptr base, size_t *size,
                           int64_t *file_off, int64_t *buf_off, int64_t *done, ferry_stream *s)
{
    *done = rw(ctx, handle, FERRY_IO_WRITE, s, base, *size, *file_off, *buf_off);
    return 0;
}

/* one drive's share of a batch, run by one thread */
typedef struct lane {
    cpu_drv *d;
    ferry_gds_io *ios;
    unsigned n;
    void *handle;
    int rc;
} lane;

static void *lane_run(void *arg)
{
    lane *l = arg;
    l->rc = 0;
    for (unsigned i = 0; i < l->n; i++) {
        ferry_gds_io *io = &l->ios[i];
        if (io->handle != l->handle)
            continue;
        io->result = rw(l->d, io->handle, io->op == FERRY_GDS_READ ? FERRY_IO_READ : FERRY_IO_WRITE,
                        NULL, io->base, io->size, io->file_off, io->buf_off);
        if (io->result < 0 && l->rc == 0)
            l->rc = (int)io->result;
    }
    return NULL;
}

static int cpu_batch(void *ctx, ferry_gds_io *ios, unsigned n)
{
    lane lanes[FERRY_GDS_MAX_DIRS];
    unsigned nl = 0;
    for (unsigned i = 0; i < n; i++) {
        unsigned j = 0;
        while (j < nl && lanes[j].handle != ios[i].handle)
            j++;
        if (j == nl) {
            if (nl == FERRY_GDS_MAX_DIRS)
                return FERRY_ENOTSUP; /* more handles than drives: let the caller loop */
            lanes[nl++] = (lane){ctx, ios, n, ios[i].handle, 0};
        }
    }
    pthread_t th[FERRY_GDS_MAX_DIRS];
    int started[FERRY_GDS_MAX_DIRS] = {0};
    for (unsigned j = 1; j < nl; j++)
        started[j] = pthread_create(&th[j], NULL, lane_run, &lanes[j]) == 0;
    lane_run(&lanes[0]);
    for (unsigned j = 1; j < nl; j++) {
        if (started[j])
            pthread_join(th[j], NULL);
        else
            lane_run(&lanes[j]); /* no thread to be had: this one does it */
    }
    for (unsigned j = 0; j < nl; j++)
        if (lanes[j].rc < 0)
            return lanes[j].rc;
    return 0;
}

static void cpu_destroy(void *ctx)
{
    ferry__free(ctx);
}

static int cpu_make(ferry_gds_driver *out, ferry__gds_destroy_fn *destroy)
{
    cpu_drv *d = ferry__calloc(1, sizeof *d);
    if (!d)
        return ferry__err_set(NULL, -ENOMEM, "cpu driver: out of memory");
    *out = (ferry_gds_driver){
        .size = sizeof(ferry_gds_driver),
        .name = "cpu",
        .ctx = d,
        .open = cpu_open,
        .close = NULL,
        .handle_register = cpu_handle_register,
        .handle_deregister = cpu_handle_deregister,
        .buf_register = cpu_buf_register,
        .buf_deregister = cpu_buf_deregister,
        .stream_register = cpu_stream_register,
        .stream_deregister = cpu_stream_deregister,
        .read = cpu_read,
        .write = cpu_write,
        .read_async = cpu_read_async,
        .write_async = cpu_write_async,
        .batch = cpu_batch,
    };
    *destroy = cpu_destroy;
    return 0;
}

/* never probed: "auto" ends here when no GDS driver could be had */
const ferry__gds_backend ferry__gds_backend_cpu = {"cpu", NULL, cpu_make, NULL};
