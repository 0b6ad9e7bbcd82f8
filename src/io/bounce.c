/*
 * bounce.c - the CPU path for device memory: file <-> pinned bounce buffer
 * <-> device, double-buffered.
 *
 * Invariant: a bounce buffer is used by one party at a time, handed over
 * only at a completion the host has seen. Reads (file -> device): the file
 * reads of segments i and i+1 are in flight together; segment i's device
 * copy starts when its read finished, and buffer i%2 is refilled (segment
 * i+2) only after the event recorded behind that copy completed. Writes
 * (device -> file): segment i's file write starts once the event of its
 * copy completed; the copy of segment i+1 goes into the other buffer once
 * that buffer's file write (segment i-1) finished. So the file I/O of one
 * segment overlaps the device copy of the next, and file requests never
 * drain between segments, which KvikIO, DeepSpeed and LMCache do not do.
 * File requests started here are always finished before returning, even
 * on failure: they point into the caller's stack and the bounce buffers.
 *
 * O_DIRECT files: reads are padded to a multiple of 4096 inside the bounce
 * buffer (end of file inside the padding is fine; only the requested bytes
 * reach the device). Writes cannot be padded without writing bytes the
 * caller did not give, so a direct-file write whose length is not a
 * multiple of 4096 fails with FERRY_EALIGN before anything moves. File
 * offsets must be 4096-aligned for direct files in both directions.
 *
 * On any failure the stream is drained before returning, so no copy still
 * touches a bounce buffer when the next transfer starts.
 */
#include <errno.h>
#include <string.h>

#include "io_impl.h"

struct ferry__bounce {
    void *buf[2];
    size_t bytes;
    ferry_stream *stream;
    ferry_event *ev[2];
};

void *ferry__bounce_buffer(const ferry_io *io, int k)
{
    return io->bounce && (k == 0 || k == 1) ? io->bounce->buf[k] : NULL;
}

void ferry__bounce_free(ferry_io *io)
{
    struct ferry__bounce *b = io->bounce;
    if (!b)
        return;
    if (b->stream)
        ferry_stream_destroy(b->stream);
    ferry_event_destroy(b->ev[0]);
    ferry_event_destroy(b->ev[1]);
    for (int i = 0; i < 2; i++)
        if (b->buf[i])
            ferry_device_host_free(io->device, b->buf[i]);
    ferry__free(b);
    io->bounce = NULL;
}

static int bounce_get(ferry_io *io, struct ferry__bounce **out)
{
    if (io->bounce) {
        *out = io->bounce;
        return 0;
    }
    struct ferry__bounce *b = ferry__calloc(1, sizeof *b);
    if (!b)
        return ferry__err_set(&io->err, -ENOMEM, "io: out of memory for the bounce path");
    io->bounce = b;
    b->bytes = io->bounce_bytes;
    int rc = 0;
    for (int i = 0; i < 2 && rc == 0; i++)
        rc = ferry_device_host_alloc(io->device, b->bytes, &b->buf[i]);
    if (rc == 0)
        rc = ferry_stream_create(io->device, &b->stream);
    for (int i = 0; i < 2 && rc == 0; i++)
        rc = ferry_event_create(io->device, &b->ev[i]);
    if (rc < 0) {
        ferry__err_set(&io->err, rc, "io: setting up two %zu-byte pinned bounce buffers: %s",
                       b->bytes, ferry_last_error());
        ferry__bounce_free(io);
        return rc;
    }
    *out = b;
    return 0;
}

static int dev_fail(ferry_io *io, ferry_file *f, int op, size_t len, uint64_t off, size_t seg,
                    size_t seglen, const char *what, int rc)
{
    return ferry__err_set(&io->err, rc,
                          "file %s: device %s of %zu bytes at offset %llu: %s of segment %zu "
                          "(%zu bytes) failed: %s (%s)", f->path, ferry__op_name(op), len,
                          (unsigned long long)off, what, seg, seglen, ferry_err_name(rc),
                          ferry_last_error());
}

/* finish every file request still in flight (after a failure), so no
 * request outlives the stack frame or the buffer it points into */
static void drain_files(ferry_io *io, ferry_io_req *fr, int *started)
{
    for (int k = 0; k < 2; k++)
        if (started[k]) {
            ferry__io_finish(io, &fr[k]);
            started[k] = 0;
        }
}

static int start_read(ferry_io *io, struct ferry__bounce *b, ferry_file *f, ferry_io_req *fr,
                      int *started, size_t len, uint64_t off, size_t i)
{
    int k = (int)(i & 1);
    size_t pos = i * b->bytes, seglen = FERRY__MIN(b->bytes, len - pos);
    size_t rlen = f->direct ? FERRY__ALIGN_UP(seglen, (size_t)FERRY_IO_ALIGN) : seglen;
    int rc = ferry__io_start(io, &fr[k], f, FERRY_IO_READ, b->buf[k], 0, rlen, off + pos, seglen);
    if (rc == 0)
        started[k] = 1;
    return rc;
}

/*
 * Reads: the file reads of two segments are in flight while the device
 * copy of the one before drains; a buffer is refilled from the file only
 * after the event recorded behind its last copy completed.
 */
static int bounce_read(ferry_io *io, struct ferry__bounce *b, ferry_file *f, ferry_stream *s,
                       ferry_devptr dst, size_t len, uint64_t off)
{
    size_t B = b->bytes, nseg = (len + B - 1) / B;
    ferry_io_req fr[2];
    int started[2] = {0, 0};
    int rc = start_read(io, b, f, fr, started, len, off, 0);
    if (rc == 0 && nseg > 1)
        rc = start_read(io, b, f, fr, started, len, off, 1);
    for (size_t i = 0; i < nseg && rc == 0; i++) {
        int k = (int)(i & 1);
        size_t pos = i * B, seglen = FERRY__MIN(B, len - pos);
        started[k] = 0;
        rc = ferry__io_finish(io, &fr[k]);
        if (rc < 0)
            break;
        rc = ferry_memcpy_htod_async(s, dst + pos, b->buf[k], seglen);
        if (rc < 0) {
            rc = dev_fail(io, f, FERRY_IO_READ, len, off, i, seglen, "device copy", rc);
            break;
        }
        rc = ferry_event_record(b->ev[k], s);
        if (rc < 0) {
            rc = dev_fail(io, f, FERRY_IO_READ, len, off, i, seglen, "event record", rc);
            break;
        }
        if (i + 2 < nseg) {
            rc = ferry_event_sync(b->ev[k]);
            if (rc < 0) {
                rc = dev_fail(io, f, FERRY_IO_READ, len, off, i, seglen, "device copy", rc);
                break;
            }
            rc = start_read(io, b, f, fr, started, len, off, i + 2);
        }
    }
    drain_files(io, fr, started);
    return rc;
}

static int issue_dtoh(ferry_io *io, struct ferry__bounce *b, ferry_file *f, ferry_stream *s,
                      ferry_devptr src, size_t len, uint64_t off, size_t i)
{
    size_t B = b->bytes, pos = i * B, seglen = FERRY__MIN(B, len - pos);
    int k = (int)(i & 1);
    int rc = ferry_memcpy_dtoh_async(s, b->buf[k], src + pos, seglen);
    if (rc < 0)
        return dev_fail(io, f, FERRY_IO_WRITE, len, off, i, seglen, "device copy", rc);
    rc = ferry_event_record(b->ev[k], s);
    if (rc < 0)
        return dev_fail(io, f, FERRY_IO_WRITE, len, off, i, seglen, "event record", rc);
    return 0;
}

/*
 * Writes: once the copy of segment i landed, its file write starts; the
 * copy of segment i+1 goes into the other buffer as soon as that buffer's
 * previous file write (segment i-1) finished. So the file writes of two
 * segments overlap each other and the device copy of the next.
 */
static int bounce_write(ferry_io *io, struct ferry__bounce *b, ferry_file *f, ferry_stream *s,
                        ferry_devptr src, size_t len, uint64_t off)
{
    size_t B = b->bytes, nseg = (len + B - 1) / B;
    ferry_io_req fr[2];
    int started[2] = {0, 0};
    int rc = issue_dtoh(io, b, f, s, src, len, off, 0);
    for (size_t i = 0; i < nseg && rc == 0; i++) {
        int k = (int)(i & 1);
        size_t pos = i * B, seglen = FERRY__MIN(B, len - pos);
        rc = ferry_event_sync(b->ev[k]);
        if (rc < 0) {
            rc = dev_fail(io, f, FERRY_IO_WRITE, len, off, i, seglen, "device copy", rc);
            break;
        }
        rc = ferry__io_start(io, &fr[k], f, FERRY_IO_WRITE, b->buf[k], 0, seglen, off + pos,
                             seglen);
        if (rc < 0)
            break;
        started[k] = 1;
        if (i + 1 < nseg) {
            int k2 = (int)((i + 1) & 1);
            if (started[k2]) {
                started[k2] = 0;
                rc = ferry__io_finish(io, &fr[k2]);
                if (rc < 0)
                    break;
            }
            rc = issue_dtoh(io, b, f, s, src, len, off, i + 1);
        }
    }
    for (int k = 0; k < 2; k++)
        if (started[k]) {
            started[k] = 0;
            int r2 = ferry__io_finish(io, &fr[k]);
            if (rc == 0)
                rc = r2;
        }
    return rc;
}

int ferry__bounce_rw(ferry_io *io, ferry_file *f, ferry_stream *s, int op, ferry_devptr p,
                     size_t len, uint64_t off)
{
    if (!io->device)
        return ferry__err_set(&io->err, -EINVAL,
                              "file %s: device %s of %zu bytes at offset %llu: the engine has no "
                              "device (ferry_io_options.device)", f->path, ferry__op_name(op), len,
                              (unsigned long long)off);
    if (f->direct && (!FERRY__IS_ALIGNED(off, FERRY_IO_ALIGN) ||
                      (op == FERRY_IO_WRITE && !FERRY__IS_ALIGNED(len, FERRY_IO_ALIGN))))
        return ferry__err_set(&io->err, FERRY_EALIGN,
                              "file %s: O_DIRECT device %s of %zu bytes at offset %llu: the offset "
                              "%smust be a multiple of %u", f->path, ferry__op_name(op), len,
                              (unsigned long long)off,
                              op == FERRY_IO_WRITE ? "and the length " : "", FERRY_IO_ALIGN);
    struct ferry__bounce *b = NULL;
    int rc = bounce_get(io, &b);
    if (rc < 0)
        return rc;
    ferry_stream *st = s ? s : b->stream;
    rc = op == FERRY_IO_READ ? bounce_read(io, b, f, st, p, len, off)
                             : bounce_write(io, b, f, st, p, len, off);
    /* drain: on success the data has landed; on failure nothing may still
     * be copying into or out of a bounce buffer */
    int src = ferry_stream_sync(st);
    if (rc == 0 && src < 0)
        rc = ferry__err_set(&io->err, src,
                            "file %s: device %s of %zu bytes at offset %llu: stream failed: %s",
                            f->path, ferry__op_name(op), len, (unsigned long long)off,
                            ferry_last_error());
    return rc;
}
