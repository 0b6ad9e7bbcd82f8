/*
 * test_io_promises.c - ferry/io.h read as an outside user reads it, one
 * promise a test, on the posix and uring engines, bytes compared:
 *   - a file opened for reading only refuses writes (and one opened for
 *     writing only refuses reads), synchronous, asynchronous and vectored,
 *     with -EBADF naming the file, offset and length, and the file's bytes
 *     stay as they were;
 *   - a request reaped is the caller's again: resubmitted with another
 *     buffer, offset and op it moves the new bytes; a vectored read in
 *     flight is FERRY_EBUSY like any other request;
 *   - end of file: a read ending exactly there succeeds with the bytes, one
 *     starting there or crossing it is FERRY_ESHORT naming where the file
 *     ended (plain, asynchronous and vectored), a write past the end leaves
 *     a hole that reads back as zeros;
 *   - the largest offset: a range past INT64_MAX is -EINVAL before any I/O;
 *     len 0 is -EINVAL also on an O_DIRECT file and for vectored reads;
 *   - submit stops at the first invalid request: those before run, those
 *     after stay untouched and may be submitted later;
 *   - a disk that fills in the middle of a request (a short write, then
 *     ENOSPC): -ENOSPC naming the file and the request, the bytes before the
 *     point the space ran out on the file, and the same call works once
 *     space is back;
 *   - a vectored read longer than max_request is -EINVAL;
 *   - registering a buffer again with another length (shorter too) is
 *     FERRY_EEXIST on uring naming both lengths, the first registration
 *     intact; one from ferry_io_buffer_alloc registers again with the
 *     length it was asked for;
 *   - ferry_file_close with requests of the file still queued waits for
 *     them: every byte lands in that file, none in a file opened after it
 *     (which may get the same descriptor).
 * The device-memory ones again on the cufile engine over a fake cuFile
 * table that does real file I/O.
 */
/* ferry-test-labels: concurrent */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ferry_test.h"
#include "ferry/io.h"
#include "io/cufile_api.h"
#include "io/sys.h"

static char g_dir[256];

static void has(const char *msg, const char *needle)
{
    if (!strstr(msg, needle))
        fail_msg("message '%s' does not contain '%s'", msg, needle);
}

static const char *eng(void **state)
{
    return (const char *)*state;
}

static ferry_io *open_io(const char *engine, unsigned depth, size_t max_request)
{
    ferry_io_options o = FERRY_IO_OPTIONS_INIT;
    o.engine = engine;
    o.depth = depth;
    o.max_request = max_request;
    ferry_io *io = NULL;
    FT_ASSERT_OK(ferry_io_open(&o, &io));
    return io;
}

static const char *path_of(const char *name)
{
    static char p[512];
    snprintf(p, sizeof p, "%s/%s", g_dir, name);
    return p;
}

static ferry_file *open_as(ferry_io *io, const char *name, unsigned flags)
{
    ferry_file *f = NULL;
    FT_ASSERT_OK(ferry_file_open(io, path_of(name), flags, &f));
    return f;
}

#define RWC (FERRY_FILE_READ | FERRY_FILE_WRITE | FERRY_FILE_CREATE | FERRY_FILE_TRUNC)

static unsigned char *abuf(size_t n)
{
    void *p = NULL;
    assert_int_equal(posix_memalign(&p, 4096, n), 0);
    return p;
}

/* submit one request and reap it; returns its result */
static int64_t run1(ferry_io *io, ferry_io_req *r)
{
    ferry_io_req *p = r, *d = NULL;
    int k = ferry_io_submit(io, &p, 1);
    if (k != 1)
        return k;
    assert_int_equal(ferry_io_reap(io, &d, 1, 1, -1), 1);
    assert_ptr_equal(d, r);
    return r->result;
}

/* the file's bytes [off, off + n), read with plain syscalls */
static void file_bytes(const char *name, void *out, size_t n, off_t off)
{
    int fd = open(path_of(name), O_RDONLY);
    assert_true(fd >= 0);
    assert_int_equal(pread(fd, out, n, off), (ssize_t)n);
    close(fd);
}

/* ---- access modes ---- */
static void access_mode_is_enforced(void **state)
{
    ferry_io *io = open_io(eng(state), 4, 0);
    ferry_file *rw = open_as(io, "acc.bin", RWC | FERRY_FILE_DIRECT);
    unsigned char *a = abuf(8192), *b = abuf(8192);
    ft_fill_pattern(a, 8192, 21);
    FT_ASSERT_OK(ferry_io_pwrite(io, rw, a, 8192, 0));
    FT_ASSERT_OK(ferry_file_close(rw));

    ferry_file *ro = open_as(io, "acc.bin", FERRY_FILE_READ | FERRY_FILE_DIRECT);
    ferry_file *wo = open_as(io, "acc.bin", FERRY_FILE_WRITE | FERRY_FILE_DIRECT);
    memset(b, 0x5a, 8192);
    assert_int_equal(ferry_io_pwrite(io, ro, b, 4096, 4096), -EBADF);
    has(ferry_io_last_error(io), path_of("acc.bin"));
    has(ferry_io_last_error(io), "write of 4096 bytes at offset 4096");
    has(ferry_io_last_error(io), "not opened for writing");
    ferry_io_req w = {.op = FERRY_IO_WRITE, .file = ro, .buf = b, .len = 8192};
    assert_int_equal(run1(io, &w), -EBADF);
    assert_int_equal(ferry_io_inflight(io), 0);

    assert_int_equal(ferry_io_pread(io, wo, b, 4096, 4096), -EBADF);
    has(ferry_io_last_error(io), "read of 4096 bytes at offset 4096");
    has(ferry_io_last_error(io), "not opened for reading");
    ferry_io_req r = {.op = FERRY_IO_READ, .file = wo, .buf = b, .len = 8192};
    assert_int_equal(run1(io, &r), -EBADF);
    struct iovec iov[2] = {{b, 4096}, {b + 4096, 4096}};
    ferry_io_vreq v = {{.op = FERRY_IO_READV, .file = wo, .len = 8192}, iov, 2};
    assert_int_equal(run1(io, &v.req), -EBADF);
    assert_int_equal(ferry_io_inflight(io), 0);
    for (int i = 0; i < 8192; i++)
        assert_int_equal(b[i], 0x5a); /* nothing read into it */

    /* the file is as it was, and the read-only handle reads it */
    FT_ASSERT_OK(ferry_io_pread(io, ro, b, 8192, 0));
    assert_memory_equal(b, a, 8192);
    FT_ASSERT_OK(ferry_file_close(ro));
    FT_ASSERT_OK(ferry_file_close(wo));
    ferry_io_close(io);
    free(a);
    free(b);
}

/* ---- request reuse ---- */
static void request_reused_after_reap(void **state)
{
    ferry_io *io = open_io(eng(state), 4, 0);
    ferry_file *f = open_as(io, "reuse.bin", RWC | FERRY_FILE_DIRECT);
    enum { N = 65536 };
    unsigned char *a = abuf(N), *b = abuf(N), *back = abuf(2 * N);
    ft_fill_pattern(a, N, 31);
    ft_fill_pattern(b, N, 32);
    ferry_io_req r = {.op = FERRY_IO_WRITE, .file = f, .buf = a, .len = N, .offset = 0};
    assert_int_equal(run1(io, &r), N);
    r.buf = b; /* the same request, other bytes, another place */
    r.offset = N;
    assert_int_equal(run1(io, &r), N);
    r.op = FERRY_IO_READ; /* and another op */
    r.buf = back;
    r.len = 2 * N;
    r.offset = 0;
    memset(back, 0, 2 * N);
    assert_int_equal(run1(io, &r), 2 * N);
    assert_memory_equal(back, a, N);
    assert_memory_equal(back + N, b, N);

    /* a vectored read: in flight it is FERRY_EBUSY; reaped it reads again */
    struct iovec iov[2] = {{back + N, N}, {back, N}};
    ferry_io_vreq v = {{.op = FERRY_IO_READV, .file = f, .len = 2 * N}, iov, 2};
    ferry_io_req *p = &v.req, *d[2];
    memset(back, 0, 2 * N);
    assert_int_equal(ferry_io_submit(io, &p, 1), 1);
    assert_int_equal(ferry_io_submit(io, &p, 1), FERRY_EBUSY);
    has(ferry_io_last_error(io), "already in flight");
    assert_int_equal(ferry_io_reap(io, d, 1, 2, -1), 1);
    assert_int_equal(v.req.result, 2 * N);
    assert_memory_equal(back + N, a, N);
    assert_memory_equal(back, b, N);
    iov[0] = (struct iovec){back, N}; /* swapped pieces, same request */
    iov[1] = (struct iovec){back + N, N};
    memset(back, 0, 2 * N);
    assert_int_equal(run1(io, &v.req), 2 * N);
    assert_memory_equal(back, a, N);
    assert_memory_equal(back + N, b, N);
    FT_ASSERT_OK(ferry_file_close(f));
    ferry_io_close(io);
    free(a);
    free(b);
    free(back);
}

/* ---- end of file ---- */
static void end_of_file_edges(void **state)
{
    ferry_io *io = open_io(eng(state), 4, 0);
    for (int direct = 0; direct < 2; direct++) {
        /* buffered: 5000 bytes; O_DIRECT: 12288 (reads there go by 4096) */
        const size_t size = direct ? 12288 : 5000;
        ferry_file *f = open_as(io, "eof.bin", RWC | (direct ? FERRY_FILE_DIRECT : 0));
        unsigned char *a = abuf(16384), *b = abuf(16384);
        ft_fill_pattern(a, 16384, 41);
        FT_ASSERT_OK(ferry_io_pwrite(io, f, a, direct ? size : 5000, 0));
        uint64_t sz = 0;
        FT_ASSERT_OK(ferry_file_size(f, &sz));
        assert_int_equal(sz, size);
        /* ending exactly at the end: the bytes */
        memset(b, 0, 16384);
        FT_ASSERT_OK(ferry_io_pread(io, f, b, size, 0));
        assert_memory_equal(b, a, size);
        ferry_io_req r = {.op = FERRY_IO_READ, .file = f, .buf = b, .len = size};
        memset(b, 0, 16384);
        assert_int_equal(run1(io, &r), (int64_t)size);
        assert_memory_equal(b, a, size);
        /* starting at the end */
        size_t at = direct ? size : 5000;
        char want[64];
        snprintf(want, sizeof want, "end of file at offset %zu", size);
        r.offset = direct ? size : at;
        r.len = 4096;
        assert_int_equal(run1(io, &r), FERRY_ESHORT);
        has(ferry_io_last_error(io), want);
        has(ferry_io_last_error(io), path_of("eof.bin"));
        /* crossing it */
        r.offset = direct ? size - 4096 : 4096;
        r.len = 8192;
        assert_int_equal(run1(io, &r), FERRY_ESHORT);
        has(ferry_io_last_error(io), want);
        snprintf(want, sizeof want, "request of 8192 bytes at offset %llu",
                 (unsigned long long)r.offset);
        has(ferry_io_last_error(io), want);
        /* vectored: exactly to the end works, past it is FERRY_ESHORT */
        size_t half = direct ? 8192 : 3000;
        struct iovec iov[2] = {{b + half, size - half}, {b, half}};
        ferry_io_vreq v = {{.op = FERRY_IO_READV, .file = f, .len = size}, iov, 2};
        memset(b, 0, 16384);
        assert_int_equal(run1(io, &v.req), (int64_t)size);
        assert_memory_equal(b + half, a, size - half);
        assert_memory_equal(b, a + size - half, half);
        iov[0].iov_len += 4096;
        v.req.len += 4096;
        assert_int_equal(run1(io, &v.req), FERRY_ESHORT);
        has(ferry_io_last_error(io), "short");
        FT_ASSERT_OK(ferry_file_close(f));
        free(a);
        free(b);
    }
    ferry_io_close(io);
}

static void write_past_end_leaves_a_hole(void **state)
{
    ferry_io *io = open_io(eng(state), 4, 0);
    ferry_file *f = open_as(io, "hole.bin", RWC | FERRY_FILE_DIRECT);
    const size_t gap = 1 << 20;
    unsigned char *a = abuf(8192), *b = abuf(gap + 8192);
    ft_fill_pattern(a, 8192, 51);
    ferry_io_req w = {.op = FERRY_IO_WRITE, .file = f, .buf = a, .len = 8192, .offset = gap};
    assert_int_equal(run1(io, &w), 8192);
    uint64_t sz = 0;
    FT_ASSERT_OK(ferry_file_size(f, &sz));
    assert_int_equal(sz, gap + 8192);
    memset(b, 0xee, gap + 8192);
    FT_ASSERT_OK(ferry_io_pread(io, f, b, gap + 8192, 0));
    for (size_t i = 0; i < gap; i++)
        if (b[i])
            fail_msg("byte %zu of the hole is 0x%02x", i, b[i]);
    assert_memory_equal(b + gap, a, 8192);
    FT_ASSERT_OK(ferry_file_close(f));
    ferry_io_close(io);
    free(a);
    free(b);
}

/* ---- argument edges ---- */
static void largest_offset_and_zero_length(void **state)
{
    ferry_io *io = open_io(eng(state), 4, 0);
    ferry_file *f = open_as(io, "edge.bin", RWC);
    ferry_file *d = open_as(io, "edge_d.bin", RWC | FERRY_FILE_DIRECT);
    unsigned char *a = abuf(8192);
    ft_fill_pattern(a, 8192, 61);
    /* one byte past the largest offset: refused before any I/O */
    ferry_io_req r = {.op = FERRY_IO_WRITE, .file = f, .buf = a, .len = 4096,
                      .offset = (uint64_t)INT64_MAX - 4095};
    ferry_io_req *p = &r;
    assert_int_equal(ferry_io_submit(io, &p, 1), -EINVAL);
    has(ferry_io_last_error(io), "largest file offset");
    assert_int_equal(ferry_io_pwrite(io, f, a, 4096, (uint64_t)INT64_MAX - 4095), -EINVAL);
    assert_int_equal(ferry_io_pread(io, f, a, 4096, (uint64_t)INT64_MAX), -EINVAL);
    struct iovec iov[1] = {{a, 4096}};
    ferry_io_vreq v = {{.op = FERRY_IO_READV, .file = f, .len = 4096,
                        .offset = (uint64_t)INT64_MAX - 100}, iov, 1};
    p = &v.req;
    assert_int_equal(ferry_io_submit(io, &p, 1), -EINVAL);
    /* at the edge itself the kernel answers (no file system takes it):
     * its code, with the file in the message, and nothing written */
    int rc = ferry_io_pwrite(io, f, a, 4096, (uint64_t)INT64_MAX - 4096);
    assert_true(rc == -EFBIG || rc == -EINVAL);
    has(ferry_io_last_error(io), path_of("edge.bin"));
    uint64_t sz = 1;
    FT_ASSERT_OK(ferry_file_size(f, &sz));
    assert_int_equal(sz, 0);
    /* zero length: -EINVAL (not FERRY_EALIGN) on an O_DIRECT file too */
    assert_int_equal(ferry_io_pread(io, d, a, 0, 0), -EINVAL);
    has(ferry_io_last_error(io), "zero length");
    assert_int_equal(ferry_io_pwrite(io, d, a, 0, 4096), -EINVAL);
    v.req.offset = 0;
    v.req.len = 0;
    assert_int_equal(ferry_io_submit(io, &p, 1), -EINVAL);
    has(ferry_io_last_error(io), "zero length");
    ferry_io_req *none[1];
    assert_int_equal(ferry_io_reap(io, NULL, 0, 1, 0), -EINVAL);
    assert_int_equal(ferry_io_reap(io, none, 0, 0, 0), 0);
    assert_int_equal(ferry_io_inflight(io), 0);
    FT_ASSERT_OK(ferry_file_close(f));
    FT_ASSERT_OK(ferry_file_close(d));
    ferry_io_close(io);
    free(a);
}

static void submit_stops_at_the_invalid_request(void **state)
{
    ferry_io *io = open_io(eng(state), 4, 0);
    ferry_file *f = open_as(io, "stop.bin", RWC | FERRY_FILE_DIRECT);
    unsigned char *a = abuf(3 * 4096), *b = abuf(3 * 4096);
    ft_fill_pattern(a, 3 * 4096, 71);
    ferry_io_req r[3];
    for (int i = 0; i < 3; i++)
        r[i] = (ferry_io_req){.op = FERRY_IO_WRITE, .file = f, .buf = a + i * 4096, .len = 4096,
                              .offset = (uint64_t)i * 4096, .result = 777};
    r[1].buf = a + 1; /* misaligned for O_DIRECT */
    ferry_io_req *p[3] = {&r[0], &r[1], &r[2]}, *d[3];
    assert_int_equal(ferry_io_submit(io, p, 3), 1);
    has(ferry_io_last_error(io), "buffer");
    assert_int_equal(ferry_io_inflight(io), 1);
    assert_int_equal(ferry_io_reap(io, d, 1, 3, -1), 1);
    assert_ptr_equal(d[0], &r[0]);
    assert_int_equal(r[0].result, 4096);
    assert_int_equal(r[1].result, 777); /* untouched */
    assert_int_equal(r[2].result, 777);
    uint64_t sz = 0;
    FT_ASSERT_OK(ferry_file_size(f, &sz));
    assert_int_equal(sz, 4096); /* reqs[2] never ran */
    /* the ones not queued are the caller's: fixed and submitted, they run */
    r[1].buf = a + 4096;
    assert_int_equal(ferry_io_submit(io, p + 1, 2), 2);
    assert_int_equal(ferry_io_reap(io, d, 2, 3, -1), 2);
    FT_ASSERT_OK(ferry_io_pread(io, f, b, 3 * 4096, 0));
    assert_memory_equal(b, a, 3 * 4096);
    FT_ASSERT_OK(ferry_file_close(f));
    ferry_io_close(io);
    free(a);
    free(b);
}

/* ---- a disk that fills in the middle of a request ----
 * Files may grow to g_room bytes: a write crossing it is written short, one
 * past it fails with ENOSPC, as a file system does when it fills. posix:
 * through the syscall seam; uring: through its completion hook (the kernel
 * wrote the bytes, the engine is told fewer, or ENOSPC). */
static off_t g_room = -1;
static ssize_t full_pwrite(int fd, const void *b, size_t n, off_t off)
{
    if (g_room >= 0) {
        if (off >= g_room) {
            errno = ENOSPC;
            return -1;
        }
        if (off + (off_t)n > g_room)
            n = (size_t)(g_room - off);
    }
    return ferry__sys_default()->pwrite(fd, b, n, off);
}
static int full_uring(void *ctx, int op, int fd, uint64_t off, size_t len, int res)
{
    (void)ctx;
    (void)fd;
    (void)len;
    if (op != FERRY_IO_WRITE || res < 0 || g_room < 0)
        return res;
    if ((off_t)off >= g_room)
        return -ENOSPC;
    return (off_t)off + res > g_room ? (int)(g_room - (off_t)off) : res;
}

static void disk_fills_mid_request(void **state)
{
    static ferry__sys t;
    t = *ferry__sys_default();
    t.pwrite = full_pwrite;
    t.uring_result = full_uring;
    ferry__sys_set(&t);
    ferry_io *io = open_io(eng(state), 4, 256 << 10);
    ferry_file *f = open_as(io, "full.bin", RWC | FERRY_FILE_DIRECT);
    const size_t n = 1 << 20;
    unsigned char *a = abuf(n), *b = abuf(n);
    ft_fill_pattern(a, n, 81);
    g_room = 300 << 10; /* inside the second 256 KiB piece */
    for (int async = 0; async < 2; async++) {
        ferry_io_req r = {.op = FERRY_IO_WRITE, .file = f, .buf = a, .len = n};
        int rc = async ? (int)run1(io, &r) : ferry_io_pwrite(io, f, a, n, 0);
        assert_int_equal(rc, -ENOSPC);
        has(ferry_io_last_error(io), path_of("full.bin"));
        has(ferry_io_last_error(io), "ENOSPC");
        has(ferry_io_last_error(io), "request of 1048576 bytes at offset 0");
        assert_int_equal(ferry_io_inflight(io), 0);
        /* what went before the space ran out is on the file */
        file_bytes("full.bin", b, (size_t)g_room, 0);
        assert_memory_equal(b, a, (size_t)g_room);
    }
    g_room = -1; /* space is back: the same call works */
    FT_ASSERT_OK(ferry_io_pwrite(io, f, a, n, 0));
    memset(b, 0, n);
    FT_ASSERT_OK(ferry_io_pread(io, f, b, n, 0));
    assert_memory_equal(b, a, n);
    ferry__sys_set(NULL);
    FT_ASSERT_OK(ferry_file_close(f));
    ferry_io_close(io);
    free(a);
    free(b);
}

/* ---- vectored reads and max_request ---- */
static void vectored_read_is_not_split(void **state)
{
    ferry_io *io = open_io(eng(state), 4, 64 << 10);
    ferry_file *f = open_as(io, "vec.bin", RWC);
    unsigned char *a = abuf(256 << 10), *b = abuf(256 << 10);
    ft_fill_pattern(a, 256 << 10, 91);
    FT_ASSERT_OK(ferry_io_pwrite(io, f, a, 256 << 10, 0));
    struct iovec iov[2] = {{b, 64 << 10}, {b + (64 << 10), 4096}};
    ferry_io_vreq v = {{.op = FERRY_IO_READV, .file = f, .len = (64 << 10) + 4096}, iov, 2};
    ferry_io_req *p = &v.req;
    assert_int_equal(ferry_io_submit(io, &p, 1), -EINVAL);
    has(ferry_io_last_error(io), "max_request");
    /* unaligned pieces at an unaligned offset, on a buffered file */
    iov[0] = (struct iovec){b + 1, 5000};
    iov[1] = (struct iovec){b + 9000, 777};
    v.req.len = 5777;
    v.req.offset = 333;
    memset(b, 0, 256 << 10);
    assert_int_equal(run1(io, &v.req), 5777);
    assert_memory_equal(b + 1, a + 333, 5000);
    assert_memory_equal(b + 9000, a + 5333, 777);
    assert_int_equal(b[0], 0);
    assert_int_equal(b[5001], 0);
    FT_ASSERT_OK(ferry_file_close(f));
    ferry_io_close(io);
    free(a);
    free(b);
}

/* ---- registration ---- */
static void register_again_with_another_length(void **state)
{
    ferry_io *io = open_io(eng(state), 4, 0);
    ferry_file *f = open_as(io, "reg.bin", RWC | FERRY_FILE_DIRECT);
    unsigned char *a = abuf(16384), *b = abuf(16384);
    FT_ASSERT_OK(ferry_io_register_buffer(io, a, 8192));
    FT_ASSERT_OK(ferry_io_register_buffer(io, a, 8192)); /* the same: a no-op */
    int uring = !strcmp(eng(state), "uring");
    assert_int_equal(ferry_io_register_buffer(io, a, 4096), uring ? FERRY_EEXIST : 0);
    assert_int_equal(ferry_io_register_buffer(io, a, 16384), uring ? FERRY_EEXIST : 0);
    if (uring) {
        has(ferry_io_last_error(io), "another length");
        has(ferry_io_last_error(io), "(8192 bytes, not 16384)");
    }
    /* the first registration is intact and works */
    ft_fill_pattern(a, 8192, 101);
    FT_ASSERT_OK(ferry_io_pwrite(io, f, a, 8192, 0));
    FT_ASSERT_OK(ferry_io_pread(io, f, b, 8192, 0));
    assert_memory_equal(b, a, 8192);
    FT_ASSERT_OK(ferry_io_unregister_buffer(io, a));
    assert_int_equal(ferry_io_unregister_buffer(io, a), uring ? FERRY_ENOTFOUND : 0);
    FT_ASSERT_OK(ferry_file_close(f));
    ferry_io_close(io);
    free(a);
    free(b);
}

/* a buffer from ferry_io_buffer_alloc is registered with the length asked
 * for: registering it again with that length is the no-op "the same (buf,
 * len) again" is, though the allocation was rounded up to 4096 */
static void buffer_alloc_then_register(void **state)
{
    ferry_io *io = open_io(eng(state), 4, 0);
    ferry_file *f = open_as(io, "alloc.bin", RWC);
    unsigned char *a = NULL, *b = abuf(8192);
    FT_ASSERT_OK(ferry_io_buffer_alloc(io, 5000, (void **)&a));
    FT_ASSERT_OK(ferry_io_register_buffer(io, a, 5000));
    int uring = !strcmp(eng(state), "uring");
    assert_int_equal(ferry_io_register_buffer(io, a, 8192), uring ? FERRY_EEXIST : 0);
    if (uring)
        has(ferry_io_last_error(io), "(5000 bytes, not 8192)");
    ft_fill_pattern(a, 5000, 102);
    FT_ASSERT_OK(ferry_io_pwrite(io, f, a, 5000, 0));
    FT_ASSERT_OK(ferry_io_pread(io, f, b, 5000, 0));
    assert_memory_equal(b, a, 5000);
    ferry_io_buffer_free(io, a);
    FT_ASSERT_OK(ferry_file_close(f));
    ferry_io_close(io);
    free(b);
}

/* ---- closing a file with its requests queued ----
 * At depth 1 most of the requests wait in the engine's queue; the file
 * closes, and another file opened right after gets its descriptor back.
 * Every byte must land in the first file and none in the second. */
static void file_close_waits_for_its_requests(void **state)
{
    ferry_io *io = open_io(eng(state), 1, 0);
    ferry_file *f = open_as(io, "first.bin", RWC);
    enum { N = 32, LEN = 64 << 10 };
    unsigned char *a = abuf((size_t)N * LEN), *b = abuf((size_t)N * LEN);
    ft_fill_pattern(a, (size_t)N * LEN, 111);
    ferry_io_req r[N], *p[N], *d[N];
    for (int i = 0; i < N; i++) {
        r[i] = (ferry_io_req){.op = FERRY_IO_WRITE, .file = f, .buf = a + (size_t)i * LEN,
                              .len = LEN, .offset = (uint64_t)i * LEN};
        p[i] = &r[i];
    }
    assert_int_equal(ferry_io_submit(io, p, N), N);
    FT_ASSERT_OK(ferry_file_close(f));
    ferry_file *g = open_as(io, "second.bin", RWC);
    int got = 0;
    while (got < N) {
        int k = ferry_io_reap(io, d + got, 1, N - (unsigned)got, -1);
        assert_true(k > 0);
        got += k;
    }
    for (int i = 0; i < N; i++)
        assert_int_equal(r[i].result, LEN);
    uint64_t sz = 1;
    FT_ASSERT_OK(ferry_file_size(g, &sz));
    assert_int_equal(sz, 0);
    file_bytes("first.bin", b, (size_t)N * LEN, 0);
    assert_memory_equal(b, a, (size_t)N * LEN);
    FT_ASSERT_OK(ferry_file_close(g));
    ferry_io_close(io);
    free(a);
    free(b);
}


/* ---- the cufile engine, through a fake cuFile table ----
 * The host device stands in for GPU memory (its device pointers are host
 * addresses), and the fake does real file I/O, so the bytes are checked. */
static ferry__CUfileError_t cf_ok(void)
{
    return (ferry__CUfileError_t){0, 0};
}
static ferry__CUfileError_t cf_void(void)
{
    return cf_ok();
}
static int g_cf_fds[64];
static unsigned g_cf_nh;
static ferry__CUfileError_t cf_hreg(ferry__CUfileHandle_t *fh, ferry__CUfileDescr_t *d)
{
    g_cf_fds[g_cf_nh % 64] = d->handle.fd;
    *fh = &g_cf_fds[g_cf_nh++ % 64];
    return cf_ok();
}
static void cf_hdereg(ferry__CUfileHandle_t fh)
{
    (void)fh;
}
static ferry__CUfileError_t cf_breg(const void *b, size_t n, int fl)
{
    (void)b;
    (void)n;
    (void)fl;
    return cf_ok();
}
static ferry__CUfileError_t cf_bdereg(const void *b)
{
    (void)b;
    return cf_ok();
}
static ssize_t cf_io(void *fh, int w, void *base, size_t n, off_t fo, off_t bo)
{
    int fd = *(int *)fh;
    char *p = (char *)base + bo;
    return w ? pwrite(fd, p, n, fo) : pread(fd, p, n, fo);
}
static ssize_t cf_read(ferry__CUfileHandle_t fh, void *base, size_t n, off_t fo, off_t bo)
{
    return cf_io(fh, 0, base, n, fo, bo);
}
static ssize_t cf_write(ferry__CUfileHandle_t fh, const void *base, size_t n, off_t fo, off_t bo)
{
    return cf_io(fh, 1, (void *)base, n, fo, bo);
}
static ferry__CUfileError_t cf_sreg(void *s, unsigned fl)
{
    (void)s;
    (void)fl;
    return cf_ok();
}
static ferry__CUfileError_t cf_sdereg(void *s)
{
    (void)s;
    return cf_ok();
}
typedef struct cf_batch_fake {
    ferry__CUfileIOEvents_t ev[256];
    unsigned nev;
} cf_batch_fake;
static ferry__CUfileError_t cf_setup(ferry__CUfileBatchHandle_t *id, unsigned nr)
{
    (void)nr;
    *id = calloc(1, sizeof(cf_batch_fake));
    return cf_ok();
}
static ferry__CUfileError_t cf_submit(ferry__CUfileBatchHandle_t id, unsigned nr,
                                      ferry__CUfileIOParams_t *p, unsigned fl)
{
    (void)fl;
    cf_batch_fake *b = id;
    for (unsigned i = 0; i < nr; i++) {
        ssize_t r = cf_io(p[i].fh, p[i].opcode == 1, p[i].u.batch.devPtr_base,
                          p[i].u.batch.size, p[i].u.batch.file_offset,
                          p[i].u.batch.devPtr_offset);
        b->ev[b->nev++] = (ferry__CUfileIOEvents_t){p[i].cookie, r < 0 ? 0x40 : 0x10,
                                                    (size_t)r};
    }
    return cf_ok();
}
static ferry__CUfileError_t cf_status(ferry__CUfileBatchHandle_t id, unsigned min, unsigned *nr,
                                      ferry__CUfileIOEvents_t *ev, struct timespec *ts)
{
    (void)min;
    (void)ts;
    cf_batch_fake *b = id;
    unsigned k = *nr < b->nev ? *nr : b->nev;
    memcpy(ev, b->ev, k * sizeof *ev);
    memmove(b->ev, b->ev + k, (b->nev - k) * sizeof *ev);
    b->nev -= k;
    *nr = k;
    return cf_ok();
}
static ferry__CUfileError_t cf_cancel(ferry__CUfileBatchHandle_t id)
{
    ((cf_batch_fake *)id)->nev = 0;
    return cf_ok();
}
static void cf_destroy(ferry__CUfileBatchHandle_t id)
{
    free(id);
}
static const ferry__cufile_api g_cf_fake = {
    cf_void, cf_void, cf_hreg, cf_hdereg, cf_breg, cf_bdereg, cf_read, cf_write, NULL,
    NULL, cf_sreg, cf_sdereg, cf_setup, cf_submit, cf_status, cf_cancel, cf_destroy, 1,
};

/* The promises above that concern device memory, on the cufile engine:
 * access modes, end of file, zero length, request reuse, vectored reads
 * refused, and a file closed with its device requests queued. */
static void cufile_engine_promises(void **state)
{
    (void)state;
    ferry__cufile_set_api(&g_cf_fake);
    ferry_device_options dopt = FERRY_DEVICE_OPTIONS_INIT;
    dopt.backend = "host";
    ferry_device *dev = NULL;
    FT_ASSERT_OK(ferry_device_open(&dopt, &dev));
    ferry_io_options o = FERRY_IO_OPTIONS_INIT;
    o.engine = "cufile";
    o.depth = 1;
    o.device = dev;
    ferry_io *io = NULL;
    FT_ASSERT_OK(ferry_io_open(&o, &io));
    ferry_file *f = open_as(io, "cf.bin", RWC | FERRY_FILE_DIRECT);
    assert_true(ferry_file_is_gds(f));
    enum { N = 16, LEN = 64 << 10 };
    ferry_devptr src = 0, dst = 0;
    FT_ASSERT_OK(ferry_device_alloc(dev, (size_t)N * LEN, &src));
    FT_ASSERT_OK(ferry_device_alloc(dev, (size_t)N * LEN, &dst));
    unsigned char *hs = ferry_devptr_host(dev, src), *hd = ferry_devptr_host(dev, dst);
    ft_fill_pattern(hs, (size_t)N * LEN, 121);
    /* requests of a file closed while queued land in it (depth 1) */
    ferry_io_req r[N], *p[N], *d[N];
    for (int i = 0; i < N; i++) {
        r[i] = (ferry_io_req){.op = FERRY_IO_WRITE, .file = f, .dev = src + (size_t)i * LEN,
                              .len = LEN, .offset = (uint64_t)i * LEN};
        p[i] = &r[i];
    }
    assert_int_equal(ferry_io_submit(io, p, N), N);
    FT_ASSERT_OK(ferry_file_close(f));
    ferry_file *other = open_as(io, "cf_other.bin", RWC);
    int got = 0;
    while (got < N)
        got += ferry_io_reap(io, d + got, 1, N - (unsigned)got, -1);
    for (int i = 0; i < N; i++)
        assert_int_equal(r[i].result, LEN);
    uint64_t sz = 1;
    FT_ASSERT_OK(ferry_file_size(other, &sz));
    assert_int_equal(sz, 0);
    FT_ASSERT_OK(ferry_file_close(other));
    unsigned char *hb = abuf((size_t)N * LEN);
    file_bytes("cf.bin", hb, (size_t)N * LEN, 0);
    assert_memory_equal(hb, hs, (size_t)N * LEN);
    /* reuse: the same request reads it back into device memory */
    f = open_as(io, "cf.bin", FERRY_FILE_READ | FERRY_FILE_DIRECT);
    r[0] = (ferry_io_req){.op = FERRY_IO_READ, .file = f, .dev = dst, .len = (size_t)N * LEN};
    memset(hd, 0, (size_t)N * LEN);
    assert_int_equal(run1(io, &r[0]), (int64_t)N * LEN);
    assert_memory_equal(hd, hs, (size_t)N * LEN);
    /* end of file: crossing it, and starting there */
    r[0].offset = (uint64_t)(N - 1) * LEN;
    r[0].len = 2 * LEN;
    assert_int_equal(run1(io, &r[0]), FERRY_ESHORT);
    has(ferry_io_last_error(io), "end of file");
    r[0].offset = (uint64_t)N * LEN;
    r[0].len = 4096;
    assert_int_equal(run1(io, &r[0]), FERRY_ESHORT);
    assert_int_equal(ferry_io_read_dev(io, f, NULL, dst, 2 * LEN, (uint64_t)(N - 1) * LEN),
                     FERRY_ESHORT);
    /* zero length, writes to a read-only file, vectored reads */
    r[0].offset = 0;
    r[0].len = 0;
    assert_int_equal(run1(io, &r[0]), -EINVAL);
    assert_int_equal(ferry_io_read_dev(io, f, NULL, dst, 0, 0), -EINVAL);
    r[0].op = FERRY_IO_WRITE;
    r[0].len = LEN;
    assert_int_equal(run1(io, &r[0]), -EBADF);
    assert_int_equal(ferry_io_write_dev(io, f, NULL, src, LEN, 0), -EBADF);
    has(ferry_io_last_error(io), "not opened for writing");
    struct iovec iov[1] = {{hb, 4096}};
    ferry_io_vreq v = {{.op = FERRY_IO_READV, .file = f, .len = 4096}, iov, 1};
    assert_int_equal(run1(io, &v.req), FERRY_ENOTSUP);
    file_bytes("cf.bin", hb, (size_t)N * LEN, 0);
    assert_memory_equal(hb, hs, (size_t)N * LEN); /* untouched by the refusals */
    FT_ASSERT_OK(ferry_file_close(f));
    ferry_io_close(io);
    FT_ASSERT_OK(ferry_device_free(dev, src));
    FT_ASSERT_OK(ferry_device_free(dev, dst));
    ferry_device_close(dev);
    ferry__cufile_set_api(NULL);
    free(hb);
}

static int setup(void **state)
{
    (void)state;
    ft_tmpdir(g_dir, sizeof g_dir);
    return g_dir[0] ? 0 : -1;
}
static int teardown(void **state)
{
    (void)state;
    ferry__sys_set(NULL);
    ferry__cufile_set_api(NULL);
    ft_rmtree(g_dir);
    return 0;
}

#define PER_ENGINE(fn) cmocka_unit_test_prestate(fn, "posix"), cmocka_unit_test_prestate(fn, "uring")

int main(void)
{
    const struct CMUnitTest tests[] = {
        PER_ENGINE(access_mode_is_enforced),
        PER_ENGINE(request_reused_after_reap),
        PER_ENGINE(end_of_file_edges),
        PER_ENGINE(write_past_end_leaves_a_hole),
        PER_ENGINE(largest_offset_and_zero_length),
        PER_ENGINE(submit_stops_at_the_invalid_request),
        PER_ENGINE(disk_fills_mid_request),
        PER_ENGINE(vectored_read_is_not_split),
        PER_ENGINE(register_again_with_another_length),
        PER_ENGINE(buffer_alloc_then_register),
        PER_ENGINE(file_close_waits_for_its_requests),
        cmocka_unit_test(cufile_engine_promises),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
