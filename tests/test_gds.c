/*
 * test_gds.c - the GDS context observed at its driver table.
 *
 * LMCache's tests/v1/gpu_connector/test_gds_context.py, one for one, with
 * a recording fake driver in place of the monkeypatched cuFile seam:
 *   - a fresh context is off; init with no config leaves it off;
 *   - off: register does nothing and calls nothing;
 *   - 40 MiB registers as 16 + 16 + 8 MiB regions;
 *   - a slice 4 KiB into a region resolves to (region base, 4096);
 *   - streams [11, 22] registered once each, deregistered [22] then
 *     [22, 11], three buffer deregistrations.
 * Then what the issue adds: splits at region boundaries, bounds, double
 * registration, unknown buffers, rollback of partial failures, a driver
 * failing mid-transfer, short transfers continued, async checkpoint
 * batches, the batch entry, close releasing everything, out-of-memory
 * through the allocation hook, init failures (bad directory, a full disk
 * through the syscall seam, O_DIRECT refused by tmpfs), second init.
 * Issue 11: async transfers on the default (NULL) stream; one owner per
 * directory (a second context, a directory named twice, a forked child:
 * FERRY_EBUSY naming the directory and the pid, and the first owner's
 * bytes intact); modes 0600/0700 and an explicit mode; every config option
 * range-checked; the size of an older config accepted.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core.h"
#include "ferry_test.h"
#include "io/sys.h"
#include "stripe.h"

#define MiB (1u << 20)

/* ---- the recording fake driver ---- */
typedef struct rec_io {
    int op;
    ferry_devptr base;
    int64_t buf_off, file_off;
    size_t size;
    int async;
} rec_io;

typedef struct fake {
    int calls; /* every call, whatever it is */
    int opened, closed;
    int handles, handle_deregs;
    size_t reg_sizes[64];
    ferry_devptr reg_bases[64];
    int nreg;
    ferry_devptr dereg_buf[64];
    int ndereg_buf;
    uint64_t reg_str[16];
    unsigned reg_flags[16];
    int nreg_str;
    uint64_t dereg_str[16];
    int ndereg_str;
    rec_io ios[512];
    int nios;
    int batches, batch_n;
    /* faults: the Nth call of that kind fails (1-based; 0 = never) */
    int fail_buf_register_at, buf_register_calls;
    int fail_stream_register;
    int fail_write_at, write_calls;
    int short_by_half; /* read/write move half of what is asked (at least 4096) */
    int async_fail_at, async_calls;
    int no_async, with_batch;
    /* lifetimes: every async argument block seen, checked at stream sync */
    size_t *a_size[512];
    int64_t *a_file[512], *a_buf[512], *a_done[512];
    size_t a_expect_size[512];
    int na;
} fake;

static fake F;

static int f_open(void *ctx, ferry_device *dev)
{
    (void)ctx, (void)dev;
    F.calls++;
    F.opened++;
    return 0;
}
static void f_close(void *ctx)
{
    (void)ctx;
    F.calls++;
    F.closed++;
}
static int f_hreg(void *ctx, ferry_io *io, ferry_file *f, void **h)
{
    (void)ctx, (void)io;
    F.calls++;
    F.handles++;
    *h = f;
    return 0;
}
static void f_hdereg(void *ctx, void *h)
{
    (void)ctx, (void)h;
    F.calls++;
    F.handle_deregs++;
}
static int f_breg(void *ctx, ferry_devptr base, size_t len, int flags)
{
    (void)ctx, (void)flags;
    F.calls++;
    if (F.fail_buf_register_at && ++F.buf_register_calls == F.fail_buf_register_at)
        return ferry__err_set(NULL, FERRY_EDRIVER, "fake: buf_register refused");
    F.reg_bases[F.nreg] = base;
    F.reg_sizes[F.nreg++] = len;
    return 0;
}
static int f_bdereg(void *ctx, ferry_devptr base)
{
    (void)ctx;
    F.calls++;
    F.dereg_buf[F.ndereg_buf++] = base;
    return 0;
}
static int f_sreg(void *ctx, ferry_stream *s, uint64_t raw, unsigned flags)
{
    (void)ctx, (void)s;
    F.calls++;
    if (F.fail_stream_register)
        return ferry__err_set(NULL, FERRY_EDRIVER, "fake: stream_register refused");
    F.reg_flags[F.nreg_str] = flags;
    F.reg_str[F.nreg_str++] = raw;
    return 0;
}
static int f_sdereg(void *ctx, ferry_stream *s, uint64_t raw)
{
    (void)ctx, (void)s;
    F.calls++;
    F.dereg_str[F.ndereg_str++] = raw;
    return 0;
}
static int64_t f_rw(int op, ferry_devptr base, size_t size, int64_t file_off, int64_t buf_off)
{
    F.calls++;
    if (op == FERRY_GDS_WRITE && F.fail_write_at && ++F.write_calls == F.fail_write_at)
        return ferry__err_set(NULL, -EIO, "fake: write failed");
    if (F.nios < 512)
        F.ios[F.nios++] = (rec_io){op, base, buf_off, file_off, size, 0};
    if (F.short_by_half && size > 4096)
        return (int64_t)(size / 2);
    return (int64_t)size;
}
static int64_t f_read(void *ctx, void *h, ferry_devptr base, size_t size, int64_t fo, int64_t bo)
{
    (void)ctx, (void)h;
    return f_rw(FERRY_GDS_READ, base, size, fo, bo);
}
static int64_t f_write(void *ctx, void *h, ferry_devptr base, size_t size, int64_t fo, int64_t bo)
{
    (void)ctx, (void)h;
    return f_rw(FERRY_GDS_WRITE, base, size, fo, bo);
}
static int f_async(int op, ferry_devptr base, size_t *size, int64_t *fo, int64_t *bo,
                   int64_t *done)
{
    F.calls++;
    F.async_calls++;
    if (F.nios < 512)
        F.ios[F.nios++] = (rec_io){op, base, *bo, *fo, *size, 1};
    if (F.na < 512) {
        F.a_size[F.na] = size;
        F.a_file[F.na] = fo;
        F.a_buf[F.na] = bo;
        F.a_done[F.na] = done;
        F.a_expect_size[F.na++] = *size;
    }
    /* like cuFile: the result lands in *done when the "stream" runs the op */
    *done = F.async_fail_at && F.async_calls == F.async_fail_at ? -EIO : (int64_t)*size;
    return 0;
}
static int f_rasync(void *ctx, void *h, ferry_devptr base, size_t *size, int64_t *fo, int64_t *bo,
                    int64_t *done, ferry_stream *s)
{
    (void)ctx, (void)h, (void)s;
    return f_async(FERRY_GDS_READ, base, size, fo, bo, done);
}
static int f_wasync(void *ctx, void *h, ferry_devptr base, size_t *size, int64_t *fo, int64_t *bo,
                    int64_t *done, ferry_stream *s)
{
    (void)ctx, (void)h, (void)s;
    return f_async(FERRY_GDS_WRITE, base, size, fo, bo, done);
}
static int f_batch(void *ctx, ferry_gds_io *ios, unsigned n)
{
    (void)ctx;
    F.batches++;
    F.batch_n += (int)n;
    for (unsigned i = 0; i < n; i++)
        ios[i].result = f_rw(ios[i].op, ios[i].base, ios[i].size, ios[i].file_off, ios[i].buf_off);
    return 0;
}

static ferry_gds_driver fake_table(void)
{
    ferry_gds_driver d = {sizeof(ferry_gds_driver), "fake", &F, f_open, f_close, f_hreg,
                          f_hdereg, f_breg, f_bdereg, f_sreg, f_sdereg, f_read, f_write,
                          F.no_async ? NULL : f_rasync, F.no_async ? NULL : f_wasync,
                          F.with_batch ? f_batch : NULL};
    return d;
}

/* ---- fixtures ---- */
typedef struct fx {
    char dir[256];
    const char *dirs[1];
    ferry_device *dev;
    ferry_gds_driver drv;
    ferry_gds_config cfg;
} fx;

static fx X;

static int setup(void **state)
{
    (void)state;
    memset(&F, 0, sizeof F);
    ft_tmpdir(X.dir, sizeof X.dir);
    X.dirs[0] = X.dir;
    ferry_device_options o = FERRY_DEVICE_OPTIONS_INIT;
    o.backend = "host";
    if (ferry_device_open(&o, &X.dev) < 0)
        return -1;
    ferry_gds_config c = FERRY_GDS_CONFIG_INIT;
    c.dirs = X.dirs;
    c.n_dirs = 1;
    c.bytes = 64 * MiB;
    c.device = X.dev;
    X.cfg = c;
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    ferry_device_close(X.dev);
    X.dev = NULL;
    ft_rmtree(X.dir);
    ft_alloc_reset();
    return 0;
}

/* init a context on the fake driver (the table is built now, so flags set
 * in F before this call choose which optional entries exist) */
static ferry_gds *on_fake(void)
{
    X.drv = fake_table();
    X.cfg.custom_driver = &X.drv;
    ferry_gds *g = NULL;
    FT_ASSERT_OK(ferry_gds_open(&X.cfg, &g));
    return g;
}

static ferry_stream *stream(void)
{
    ferry_stream *s = NULL;
    FT_ASSERT_OK(ferry_stream_create(X.dev, &s));
    return s;
}

/* ---- LMCache's cases ---- */

static void fresh_context_is_off(void **state)
{
    (void)state;
    ferry_gds *g = NULL;
    FT_ASSERT_OK(ferry_gds_open(NULL, &g));
    assert_int_equal(ferry_gds_is_on(g), 0);
    assert_string_equal(ferry_gds_driver_name(g), "off");
    assert_null(ferry_gds_slab(g));
    assert_int_equal(ferry_gds_size(g), 0);
    ferry_gds_close(g);
    ferry_gds_close(NULL);
}

static void initialize_with_none_is_noop(void **state)
{
    (void)state;
    ferry_gds *g = NULL;
    FT_ASSERT_OK(ferry_gds_open(NULL, &g));
    FT_ASSERT_OK(ferry_gds_init(g, NULL));
    assert_int_equal(ferry_gds_is_on(g), 0);
    ferry_gds_close(g);
}

static void register_is_noop_when_uninitialized(void **state)
{
    (void)state;
    ferry_gds *g = NULL;
    FT_ASSERT_OK(ferry_gds_open(NULL, &g));
    /* a failed init leaves it off too (size 0 is refused before any call) */
    X.drv = fake_table();
    X.cfg.custom_driver = &X.drv;
    X.cfg.bytes = 0;
    assert_int_equal(ferry_gds_init(g, &X.cfg), -EINVAL);
    assert_int_equal(ferry_gds_is_on(g), 0);
    ferry_stream *s = stream();
    FT_ASSERT_OK(ferry_gds_register(g, 0x10000000, 4096, s));
    FT_ASSERT_OK(ferry_gds_deregister(g, 0x10000000));
    FT_ASSERT_OK(ferry_gds_deregister(g, 0x999)); /* even unknown: off means no-op */
    assert_int_equal(F.calls, 0);
    ferry_gds_stats st = FERRY_GDS_STATS_INIT;
    FT_ASSERT_OK(ferry_gds_stats_get(g, &st));
    assert_int_equal(st.regions, 0);
    assert_int_equal(ferry_gds_transfer(g, FERRY_GDS_WRITE, 0, 4096, 0x10000000, NULL),
                     FERRY_ESTATE);
    assert_int_equal(F.calls, 0);
    ferry_gds_close(g);
    ferry_stream_destroy(s);
}

static void splits_buffer_into_regions(void **state)
{
    (void)state;
    ferry_gds *g = on_fake();
    ferry_devptr buf = 0x7f0000000000ull; /* the fake never dereferences it */
    FT_ASSERT_OK(ferry_gds_register(g, buf, 40 * MiB, NULL));
    assert_int_equal(F.nreg, 3);
    assert_int_equal(F.reg_sizes[0], 16 * MiB);
    assert_int_equal(F.reg_sizes[1], 16 * MiB);
    assert_int_equal(F.reg_sizes[2], 8 * MiB);
    assert_int_equal(F.reg_bases[0], buf);
    assert_int_equal(F.reg_bases[1], buf + 16 * MiB);
    assert_int_equal(F.reg_bases[2], buf + 32 * MiB);
    ferry_gds_stats st = FERRY_GDS_STATS_INIT;
    FT_ASSERT_OK(ferry_gds_stats_get(g, &st));
    assert_int_equal(st.regions, 3);
    assert_int_equal(st.buffers, 1);
    ferry_gds_close(g);
}

static void maps_slice_to_base_and_offset(void **state)
{
    (void)state;
    ferry_gds *g = on_fake();
    ferry_devptr buf = 0x7f0000100000ull;
    FT_ASSERT_OK(ferry_gds_register(g, buf, 8192, NULL));
    /* a slice 4 KiB into the region maps to (region base, offset 4096) */
    ferry_stream *s = stream();
    FT_ASSERT_OK(ferry_gds_transfer_async(g, FERRY_GDS_WRITE, 0, 4096, buf + 4096, s));
    assert_int_equal(F.nios, 1);
    assert_int_equal(F.ios[0].base, buf);
    assert_int_equal(F.ios[0].buf_off, 4096);
    assert_int_equal(F.ios[0].file_off, 0);
    assert_int_equal(F.ios[0].size, 4096);
    assert_int_equal(F.ios[0].op, FERRY_GDS_WRITE);
    /* the synchronous form resolves the same way */
    FT_ASSERT_OK(ferry_gds_transfer(g, FERRY_GDS_READ, 8192, 4096, buf + 4096, NULL));
    assert_int_equal(F.ios[1].base, buf);
    assert_int_equal(F.ios[1].buf_off, 4096);
    assert_int_equal(F.ios[1].file_off, 8192);
    ferry_gds_close(g); /* also syncs and frees the stream's batches */
    ferry_stream_destroy(s);
}

static void register_and_deregister_per_stream(void **state)
{
    (void)state;
    ferry_gds *g = on_fake();
    ferry_stream *s11 = stream(), *s22 = stream();
    uint64_t h11 = ferry_stream_handle(s11), h22 = ferry_stream_handle(s22);
    assert_true(h11 != h22);
    ferry_devptr a = 0x7f0001000000ull, b = 0x7f0004000000ull;
    FT_ASSERT_OK(ferry_gds_register(g, a, 24 * MiB, s11)); /* 2 regions on stream 11 */
    FT_ASSERT_OK(ferry_gds_register(g, b, 4096, s22));    /* 1 region on stream 22 */
    assert_int_equal(F.nreg_str, 2); /* each distinct stream registered exactly once */
    assert_int_equal(F.reg_str[0], h11);
    assert_int_equal(F.reg_str[1], h22);
    assert_int_equal(F.reg_flags[0], 0x7);
    assert_int_equal(F.reg_flags[1], 0x7);
    /* dropping B frees stream 22's only region -> stream 22 deregistered */
    FT_ASSERT_OK(ferry_gds_deregister(g, b));
    assert_int_equal(F.ndereg_str, 1);
    assert_int_equal(F.dereg_str[0], h22);
    /* stream 11 still has 2 regions until A goes */
    FT_ASSERT_OK(ferry_gds_deregister(g, a));
    assert_int_equal(F.ndereg_str, 2);
    assert_int_equal(F.dereg_str[1], h11);
    assert_int_equal(F.ndereg_buf, 3); /* all three regions deregistered */
    ferry_gds_stats st = FERRY_GDS_STATS_INIT;
    FT_ASSERT_OK(ferry_gds_stats_get(g, &st));
    assert_int_equal(st.regions, 0);
    assert_int_equal(st.streams, 0);
    ferry_gds_close(g);
    ferry_stream_destroy(s11);
    ferry_stream_destroy(s22);
}

/* ---- the rest of the issue ---- */

static void chunk_larger_than_region_splits(void **state)
{
    (void)state;
    ferry_gds *g = on_fake();
    ferry_devptr buf = 0x7f0010000000ull;
    FT_ASSERT_OK(ferry_gds_register(g, buf, 24 * MiB, NULL));
    FT_ASSERT_OK(ferry_gds_transfer(g, FERRY_GDS_WRITE, 8 * MiB, 24 * MiB, buf, NULL));
    assert_int_equal(F.nios, 2);
    assert_int_equal(F.ios[0].base, buf);
    assert_int_equal(F.ios[0].buf_off, 0);
    assert_int_equal(F.ios[0].size, 16 * MiB);
    assert_int_equal(F.ios[0].file_off, 8 * MiB);
    assert_int_equal(F.ios[1].base, buf + 16 * MiB); /* the next region's base, offset 0 */
    assert_int_equal(F.ios[1].buf_off, 0);
    assert_int_equal(F.ios[1].size, 8 * MiB);
    assert_int_equal(F.ios[1].file_off, 24 * MiB);
    /* a slice starting inside region 1 and crossing into region 2 */
    F.nios = 0;
    FT_ASSERT_OK(ferry_gds_transfer(g, FERRY_GDS_READ, 0, 8 * MiB, buf + 12 * MiB, NULL));
    assert_int_equal(F.nios, 2);
    assert_int_equal(F.ios[0].base, buf);
    assert_int_equal(F.ios[0].buf_off, 12 * MiB);
    assert_int_equal(F.ios[0].size, 4 * MiB);
    assert_int_equal(F.ios[1].base, buf + 16 * MiB);
    assert_int_equal(F.ios[1].buf_off, 0);
    assert_int_equal(F.ios[1].file_off, 4 * MiB);
    ferry_gds_close(g);
}

static void slice_outside_regions_is_ebounds(void **state)
{
    (void)state;
    ferry_gds *g = on_fake();
    ferry_devptr buf = 0x7f0020000000ull;
    FT_ASSERT_OK(ferry_gds_register(g, buf, 1 * MiB, NULL));
    int before = F.calls;
    assert_int_equal(ferry_gds_transfer(g, FERRY_GDS_WRITE, 0, 4096, buf - 4096, NULL),
                     FERRY_EBOUNDS);
    assert_non_null(strstr(ferry_gds_last_error(g), "no registered region"));
    /* starts inside, runs past the region's end: refused before any I/O */
    assert_int_equal(ferry_gds_transfer(g, FERRY_GDS_WRITE, 0, 2 * MiB, buf, NULL),
                     FERRY_EBOUNDS);
    ferry_stream *s = stream();
    assert_int_equal(ferry_gds_transfer_async(g, FERRY_GDS_READ, 0, 8192, buf + MiB - 4096, s),
                     FERRY_EBOUNDS);
    assert_int_equal(F.calls, before);
    assert_int_equal(F.nios, 0);
    ferry_gds_close(g);
    ferry_stream_destroy(s);
}

static void bad_transfers_are_refused(void **state)
{
    (void)state;
    ferry_gds *g = on_fake();
    ferry_devptr buf = 0x7f0030000000ull;
    FT_ASSERT_OK(ferry_gds_register(g, buf, 1 * MiB, NULL));
    int before = F.calls;
    assert_int_equal(ferry_gds_transfer(g, FERRY_GDS_WRITE, 100, 4096, buf, NULL), FERRY_EALIGN);
    assert_non_null(strstr(ferry_gds_last_error(g), "multiples of 4096"));
    assert_int_equal(ferry_gds_transfer(g, FERRY_GDS_WRITE, 0, 1000, buf, NULL), FERRY_EALIGN);
    assert_int_equal(ferry_gds_transfer(g, FERRY_GDS_WRITE, 0, 0, buf, NULL), -EINVAL);
    /* past the slab's end (64 MiB) */
    assert_int_equal(ferry_gds_transfer(g, FERRY_GDS_WRITE, 64 * MiB - 4096, 8192, buf, NULL),
                     FERRY_EBOUNDS);
    assert_non_null(strstr(ferry_gds_last_error(g), "past the slab's end"));
    assert_int_equal(ferry_gds_transfer(g, FERRY_GDS_WRITE, UINT64_MAX - 4095, 4096, buf, NULL),
                     FERRY_EBOUNDS);
    assert_int_equal(ferry_gds_transfer(g, 7, 0, 4096, buf, NULL), -EINVAL);
    /* the default stream is a stream: only the length makes this -EINVAL */
    assert_int_equal(ferry_gds_transfer_async(g, FERRY_GDS_WRITE, 0, 0, buf, NULL), -EINVAL);
    assert_int_equal(ferry_gds_transfer_async(g, FERRY_GDS_WRITE, 100, 4096, buf, NULL),
                     FERRY_EALIGN);
    assert_int_equal(F.calls, before);
    ferry_gds_close(g);
}

static void double_registration_and_unknown_buffers(void **state)
{
    (void)state;
    ferry_gds *g = on_fake();
    ferry_devptr buf = 0x7f0040000000ull;
    FT_ASSERT_OK(ferry_gds_register(g, buf, 20 * MiB, NULL));
    int before = F.calls;
    assert_int_equal(ferry_gds_register(g, buf, 20 * MiB, NULL), FERRY_EEXIST);
    assert_int_equal(ferry_gds_register(g, buf + 4 * MiB, 4096, NULL), FERRY_EEXIST);
    assert_int_equal(ferry_gds_register(g, buf - 4096, 8192, NULL), FERRY_EEXIST);
    assert_non_null(strstr(ferry_gds_last_error(g), "overlaps"));
    assert_int_equal(ferry_gds_register(g, buf + 64 * MiB, 0, NULL), -EINVAL);
    assert_int_equal(ferry_gds_deregister(g, 0x1234000), FERRY_ENOTFOUND);
    /* an interior pointer, even a region's base, is not the buffer */
    assert_int_equal(ferry_gds_deregister(g, buf + 16 * MiB), FERRY_ENOTFOUND);
    assert_int_equal(F.calls, before);
    /* adjacent buffers are fine */
    FT_ASSERT_OK(ferry_gds_register(g, buf + 20 * MiB, 4096, NULL));
    FT_ASSERT_OK(ferry_gds_register(g, buf - 4096, 4096, NULL));
    ferry_gds_stats st = FERRY_GDS_STATS_INIT;
    FT_ASSERT_OK(ferry_gds_stats_get(g, &st));
    assert_int_equal(st.regions, 4);
    assert_int_equal(st.buffers, 3);
    FT_ASSERT_OK(ferry_gds_deregister(g, buf));
    FT_ASSERT_OK(ferry_gds_stats_get(g, &st));
    assert_int_equal(st.regions, 2);
    ferry_gds_close(g);
}

static void partial_registration_failure_rolls_back(void **state)
{
    (void)state;
    ferry_gds *g = on_fake();
    ferry_stream *s = stream();
    ferry_devptr buf = 0x7f0050000000ull;
    F.fail_buf_register_at = 2; /* the second region of 40 MiB fails */
    assert_int_equal(ferry_gds_register(g, buf, 40 * MiB, s), FERRY_EDRIVER);
    assert_non_null(strstr(ferry_gds_last_error(g), "region 2 of 3"));
    assert_non_null(strstr(ferry_gds_last_error(g), "fake: buf_register refused"));
    assert_int_equal(F.nreg, 1);             /* the first one went in ... */
    assert_int_equal(F.ndereg_buf, 1);       /* ... and was taken out again */
    assert_int_equal(F.dereg_buf[0], buf);
    assert_int_equal(F.nreg_str, 1);         /* the new stream was registered ... */
    assert_int_equal(F.ndereg_str, 1);       /* ... and deregistered */
    ferry_gds_stats st = FERRY_GDS_STATS_INIT;
    FT_ASSERT_OK(ferry_gds_stats_get(g, &st));
    assert_int_equal(st.regions, 0);
    assert_int_equal(st.streams, 0);
    assert_int_equal(st.buffers, 0);
    assert_int_equal(ferry_gds_deregister(g, buf), FERRY_ENOTFOUND);
    /* the cause fixed, the same call works */
    F.fail_buf_register_at = 0;
    FT_ASSERT_OK(ferry_gds_register(g, buf, 40 * MiB, s));
    FT_ASSERT_OK(ferry_gds_stats_get(g, &st));
    assert_int_equal(st.regions, 3);
    /* a stream registration failure registers no region at all */
    F.fail_stream_register = 1;
    int nreg = F.nreg;
    ferry_stream *s2 = stream();
    assert_int_equal(ferry_gds_register(g, buf + 64 * MiB, 4096, s2), FERRY_EDRIVER);
    assert_int_equal(F.nreg, nreg);
    FT_ASSERT_OK(ferry_gds_stats_get(g, &st));
    assert_int_equal(st.regions, 3);
    ferry_gds_close(g);
    ferry_stream_destroy(s);
    ferry_stream_destroy(s2);
}

static void driver_failure_mid_transfer(void **state)
{
    (void)state;
    ferry_gds *g = on_fake();
    ferry_devptr buf = 0x7f0060000000ull;
    FT_ASSERT_OK(ferry_gds_register(g, buf, 40 * MiB, NULL));
    F.fail_write_at = 2; /* the second of three segments */
    assert_int_equal(ferry_gds_transfer(g, FERRY_GDS_WRITE, 0, 40 * MiB, buf, NULL), -EIO);
    const char *m = ferry_gds_last_error(g);
    assert_non_null(strstr(m, "slab offset 16777216"));
    assert_non_null(strstr(m, "fake: write failed"));
    assert_non_null(strstr(m, X.dir));
    assert_int_equal(F.nios, 1); /* stopped at the failure */
    /* the context is intact: the next transfer works */
    F.fail_write_at = 0;
    FT_ASSERT_OK(ferry_gds_transfer(g, FERRY_GDS_WRITE, 0, 40 * MiB, buf, NULL));
    ferry_gds_stats st = FERRY_GDS_STATS_INIT;
    FT_ASSERT_OK(ferry_gds_stats_get(g, &st));
    assert_int_equal(st.bytes_written, 40 * MiB);
    assert_int_equal(st.regions, 3);
    ferry_gds_close(g);
}

static void short_transfers_are_continued(void **state)
{
    (void)state;
    F.short_by_half = 1;
    ferry_gds *g = on_fake();
    ferry_devptr buf = 0x7f0070000000ull;
    FT_ASSERT_OK(ferry_gds_register(g, buf, 1 * MiB, NULL));
    FT_ASSERT_OK(ferry_gds_transfer(g, FERRY_GDS_READ, 4096, 64 * 1024, buf + 8192, NULL));
    /* 64K -> 32K + 16K + 8K + 4K + 4K, always from the region base */
    assert_int_equal(F.nios, 5);
    size_t total = 0;
    for (int i = 0; i < F.nios; i++) {
        assert_int_equal(F.ios[i].base, buf);
        assert_int_equal(F.ios[i].buf_off, 8192 + (int64_t)total);
        assert_int_equal(F.ios[i].file_off, 4096 + (int64_t)total);
        total += F.ios[i].size > 4096 ? F.ios[i].size / 2 : F.ios[i].size;
    }
    assert_int_equal(total, 64 * 1024);
    ferry_gds_close(g);
}

static void async_arguments_live_until_checkpoints(void **state)
{
    (void)state;
    ferry_gds *g = on_fake();
    ferry_stream *s = stream();
    ferry_devptr buf = 0x7f0080000000ull;
    FT_ASSERT_OK(ferry_gds_register(g, buf, 1 * MiB, s));
    /* 130 submissions: two checkpoint events (after 64 and 128) */
    for (int i = 0; i < 130; i++)
        FT_ASSERT_OK(ferry_gds_transfer_async(g, FERRY_GDS_WRITE, (uint64_t)i * 4096, 4096,
                                              buf + (uint64_t)(i % 256) * 4096, s));
    ferry_gds_stats st = FERRY_GDS_STATS_INIT;
    FT_ASSERT_OK(ferry_gds_stats_get(g, &st));
    assert_int_equal(st.checkpoints, 2);
    assert_true(st.async_pending >= 2 && st.async_pending <= 130);
    /* argument blocks not yet released are still intact (ASan would catch
     * a block freed early once the stream passed nothing) */
    for (int i = 128; i < 130; i++) {
        assert_int_equal(*F.a_size[i], F.a_expect_size[i]);
        assert_int_equal(*F.a_file[i], (int64_t)i * 4096);
        assert_int_equal(*F.a_buf[i], (int64_t)(i % 256) * 4096);
        assert_int_equal(*F.a_done[i], 4096);
    }
    FT_ASSERT_OK(ferry_gds_stream_sync(g, s));
    FT_ASSERT_OK(ferry_gds_stats_get(g, &st));
    assert_int_equal(st.async_pending, 0);
    assert_int_equal(F.async_calls, 130);
    /* an op that fails in the stream surfaces at the stream sync */
    F.async_fail_at = 131;
    FT_ASSERT_OK(ferry_gds_transfer_async(g, FERRY_GDS_READ, 0, 4096, buf, s));
    assert_int_equal(ferry_gds_stream_sync(g, s), -EIO);
    assert_non_null(strstr(ferry_gds_last_error(g), "async read of 4096 bytes at slab offset 0"));
    FT_ASSERT_OK(ferry_gds_stream_sync(g, s)); /* reported once */
    ferry_gds_close(g);
    ferry_stream_destroy(s);
}

static void no_async_entry_falls_back_to_sync(void **state)
{
    (void)state;
    F.no_async = 1;
    ferry_gds *g = on_fake();
    ferry_stream *s = stream();
    ferry_devptr buf = 0x7f0090000000ull;
    FT_ASSERT_OK(ferry_gds_register(g, buf, 24 * MiB, s));
    FT_ASSERT_OK(ferry_gds_transfer_async(g, FERRY_GDS_WRITE, 0, 24 * MiB, buf, s));
    assert_int_equal(F.async_calls, 0);
    assert_int_equal(F.nios, 2);
    assert_int_equal(F.ios[0].async, 0);
    FT_ASSERT_OK(ferry_gds_stream_sync(g, s));
    ferry_gds_close(g);
    ferry_stream_destroy(s);
}

static void batch_entry_carries_multi_segment_transfers(void **state)
{
    (void)state;
    F.with_batch = 1;
    ferry_gds *g = on_fake();
    ferry_devptr buf = 0x7f00a0000000ull;
    FT_ASSERT_OK(ferry_gds_register(g, buf, 40 * MiB, NULL));
    FT_ASSERT_OK(ferry_gds_transfer(g, FERRY_GDS_WRITE, 0, 40 * MiB, buf, NULL));
    assert_int_equal(F.batches, 1);
    assert_int_equal(F.batch_n, 3);
    /* one segment needs no batch */
    FT_ASSERT_OK(ferry_gds_transfer(g, FERRY_GDS_READ, 0, 4096, buf, NULL));
    assert_int_equal(F.batches, 1);
    ferry_gds_close(g);
}

static void close_releases_everything(void **state)
{
    (void)state;
    ferry_gds *g = on_fake();
    ferry_stream *s1 = stream(), *s2 = stream();
    FT_ASSERT_OK(ferry_gds_register(g, 0x7f00b0000000ull, 40 * MiB, s1));
    FT_ASSERT_OK(ferry_gds_register(g, 0x7f00c0000000ull, 4096, s2));
    FT_ASSERT_OK(ferry_gds_register(g, 0x7f00d0000000ull, 4096, s2));
    FT_ASSERT_OK(ferry_gds_transfer_async(g, FERRY_GDS_WRITE, 0, 4096, 0x7f00c0000000ull, s2));
    assert_int_equal(F.handles, 1);
    ferry_gds_close(g);
    assert_int_equal(F.ndereg_buf, 5);
    assert_int_equal(F.ndereg_str, 2);
    assert_int_equal(F.handle_deregs, 1);
    assert_int_equal(F.opened, 1);
    assert_int_equal(F.closed, 1);
    ferry_stream_destroy(s1);
    ferry_stream_destroy(s2);
}

static void second_init_is_an_error(void **state)
{
    (void)state;
    ferry_gds *g = on_fake();
    assert_int_equal(ferry_gds_init(g, &X.cfg), FERRY_ESTATE);
    assert_non_null(strstr(ferry_gds_last_error(g), "already initialized"));
    assert_int_equal(ferry_gds_is_on(g), 1);
    assert_int_equal(F.opened, 1);
    assert_int_equal(ferry_gds_size(g), 64 * MiB);
    ferry_gds_close(g);
}

static void size_rounds_up_and_slab_file_is_preallocated(void **state)
{
    (void)state;
    X.cfg.bytes = 10 * MiB + 1;
    ferry_gds *g = on_fake();
    assert_int_equal(ferry_gds_size(g), 10 * MiB + 4096);
    assert_int_equal(ferry_slab_capacity(ferry_gds_slab(g)), 10 * MiB + 4096);
    char p[512];
    snprintf(p, sizeof p, "%s/%s", X.dir, FERRY_GDS_SLAB_NAME);
    struct stat st;
    assert_int_equal(stat(p, &st), 0);
    assert_int_equal(st.st_size, 10 * MiB + 4096);
    assert_true((uint64_t)st.st_blocks * 512 >= 10 * MiB + 4096); /* reserved, not sparse */
    assert_string_equal(ferry_gds_driver_name(g), "fake");
    ferry_gds_close(g);
}

static void init_failures_leave_it_off(void **state)
{
    (void)state;
    ferry_gds *g = NULL;
    FT_ASSERT_OK(ferry_gds_open(NULL, &g));
    X.drv = fake_table();
    X.cfg.custom_driver = &X.drv;
    /* a directory under a regular file */
    char file[300], sub[340];
    snprintf(file, sizeof file, "%s/plain", X.dir);
    FILE *fp = fopen(file, "w");
    assert_non_null(fp);
    fclose(fp);
    snprintf(sub, sizeof sub, "%s/slab", file);
    const char *bad[1] = {sub};
    X.cfg.dirs = bad;
    int rc = ferry_gds_init(g, &X.cfg);
    assert_true(rc == -ENOTDIR || rc == -EEXIST);
    assert_non_null(strstr(ferry_gds_last_error(g), sub));
    assert_int_equal(ferry_gds_is_on(g), 0);
    assert_int_equal(F.opened, F.closed); /* the driver was closed again */
    /* unknown driver name */
    X.cfg.dirs = X.dirs;
    X.cfg.custom_driver = NULL;
    X.cfg.driver = "nvme-of";
    assert_int_equal(ferry_gds_init(g, &X.cfg), -EINVAL);
    /* bad geometry */
    X.cfg.driver = "cpu";
    X.cfg.alignment = 3000;
    assert_int_equal(ferry_gds_init(g, &X.cfg), -EINVAL);
    X.cfg.alignment = 0;
    X.cfg.region_cap = 5000;
    assert_int_equal(ferry_gds_init(g, &X.cfg), -EINVAL);
    X.cfg.region_cap = 0;
    X.cfg.n_dirs = 0;
    assert_int_equal(ferry_gds_init(g, &X.cfg), -EINVAL);
    X.cfg.n_dirs = 1;
    /* after all that, a good config works on the same context */
    FT_ASSERT_OK(ferry_gds_init(g, &X.cfg));
    assert_string_equal(ferry_gds_driver_name(g), "cpu");
    ferry_gds_close(g);
}

/* posix_fallocate answering ENOSPC: the slab is larger than the free disk */
static int enospc_fallocate(int fd, off_t off, off_t len)
{
    (void)fd, (void)off, (void)len;
    return ENOSPC;
}

static void slab_larger_than_free_disk(void **state)
{
    (void)state;
    ferry__sys sys = *ferry__sys_default();
    sys.fallocate = enospc_fallocate;
    ferry__sys_set(&sys);
    ferry_gds *g = NULL;
    FT_ASSERT_OK(ferry_gds_open(NULL, &g));
    X.drv = fake_table();
    X.cfg.custom_driver = &X.drv;
    int rc = ferry_gds_init(g, &X.cfg);
    ferry__sys_set(NULL);
    assert_int_equal(rc, -ENOSPC);
    assert_non_null(strstr(ferry_gds_last_error(g), "larger than the free disk"));
    assert_int_equal(ferry_gds_is_on(g), 0);
    assert_int_equal(F.handles, 0);
    assert_int_equal(F.opened, F.closed);
    /* the disk has room again: init works */
    FT_ASSERT_OK(ferry_gds_init(g, &X.cfg));
    ferry_gds_close(g);
}

/* a file system that refuses O_DIRECT (tmpfs before 6.6, some overlayfs):
 * open with O_DIRECT answers EINVAL */
static int refuse_direct_open(const char *path, int flags, mode_t mode)
{
    if (flags & O_DIRECT) {
        errno = EINVAL;
        return -1;
    }
    return open(path, flags, mode);
}

static void odirect_refused_falls_back_and_says_so(void **state)
{
    (void)state;
    ferry__sys sys = *ferry__sys_default();
    sys.open = refuse_direct_open;
    ferry__sys_set(&sys);
    X.cfg.driver = "cpu";
    ferry_gds *g = NULL;
    int rc = ferry_gds_open(&X.cfg, &g);
    ferry__sys_set(NULL);
    FT_ASSERT_OK(rc);
    const char *why = ferry_gds_fallback_reason(g);
    assert_non_null(why);
    assert_non_null(strstr(why, "O_DIRECT refused"));
    assert_non_null(strstr(why, X.dir));
    /* and it works, buffered, even from an unaligned host buffer */
    char *buf = malloc(64 * 1024 + 1), *back = malloc(64 * 1024 + 1);
    ft_fill_pattern(buf + 1, 64 * 1024, 3);
    FT_ASSERT_OK(ferry_gds_pwrite(g, buf + 1, 64 * 1024, 4096));
    FT_ASSERT_OK(ferry_gds_pread(g, back + 1, 64 * 1024, 4096));
    assert_int_equal(ft_check_pattern(back + 1, 64 * 1024, 3), -1);
    free(buf);
    free(back);
    ferry_gds_close(g);
}

/* one run: a device and a context on the fake driver made with the
 * allocator paused, then 20 registrations with allocation n failing */
static int oom_register_run(void *ctx)
{
    ferry_device *setup_dev = ctx;
    memset(&F, 0, sizeof F);
    ft_oom_pause();
    ferry_device_options o = FERRY_DEVICE_OPTIONS_INIT;
    o.backend = "host";
    FT_ASSERT_OK(ferry_device_open(&o, &X.dev));
    X.cfg.device = X.dev;
    ferry_gds *g = on_fake();
    ferry_stream *s = stream();
    FT_ASSERT_OK(ferry_gds_register(g, 0x7f00e0000000ull, 4096, s));
    ft_oom_resume();
    /* new buffers, some on a stream not seen yet (NULL, the default
     * stream): region array growth and a new stream record */
    ferry_devptr b = 0x7f0100000000ull;
    int rc = 0;
    for (int i = 0; i < 20 && rc == 0; i++)
        rc = ferry_gds_register(g, b + (uint64_t)i * 32 * MiB, 20 * MiB, i % 2 ? s : NULL);
    int failed = ft_alloc_failures() > 0;
    ft_oom_pause();
    ferry_gds_stats st = FERRY_GDS_STATS_INIT;
    FT_ASSERT_OK(ferry_gds_stats_get(g, &st));
    if (rc < 0) {
        assert_int_equal(rc, -ENOMEM);
        assert_true(failed);
        assert_non_null(strstr(ferry_gds_last_error(g), "out of memory"));
    } else {
        assert_int_equal(st.regions, 1 + 20 * 2);
    }
    /* every region the driver saw registered is one the context holds */
    assert_int_equal((int)st.regions, F.nreg - F.ndereg_buf);
    assert_int_equal((int)st.streams, F.nreg_str - F.ndereg_str);
    ferry_gds_close(g);
    assert_int_equal(F.nreg, F.ndereg_buf);
    assert_int_equal(F.nreg_str, F.ndereg_str);
    ferry_stream_destroy(s);
    ferry_device_close(X.dev);
    X.dev = setup_dev;
    X.cfg.device = setup_dev;
    return rc;
}

static void out_of_memory_registers_nothing(void **state)
{
    (void)state;
    /* every block is freed by the allocator that made it: the counting
     * allocator stays installed (refusing or paused) for the device and
     * the context's whole lives, and the run's live count covers them */
    ft_oom_each(400, FT_OOM_STICKY, oom_register_run, X.dev);
}

/* one run: init with allocation n failing (and every later one) */
static int oom_init_run(void *ctx)
{
    (void)ctx;
    memset(&F, 0, sizeof F);
    X.drv = fake_table();
    X.cfg.custom_driver = &X.drv;
    ferry_gds *g = NULL;
    int rc = ferry_gds_open(&X.cfg, &g);
    if (rc == 0) {
        ferry_gds_close(g);
    } else {
        assert_null(g);
        assert_int_equal(F.opened, F.closed);
        assert_int_equal(F.handles, F.handle_deregs);
    }
    return rc;
}

static void out_of_memory_in_init_leaves_nothing(void **state)
{
    (void)state;
    /* every allocation point of init in turn fails (and all after it): the
     * context stays off, the driver was closed again, and nothing leaks;
     * the loop reaches the end of init's allocations */
    ft_oom_each(60, FT_OOM_STICKY, oom_init_run, NULL);
}

/* ---- issue 11 ---- */

/* the default stream: the transfer is done by the time the call returns,
 * through the synchronous entries (nothing queued that could outlive an
 * argument block), and its errors come back from the call itself */
static void async_on_the_default_stream(void **state)
{
    (void)state;
    ferry_gds *g = on_fake();
    ferry_devptr buf = 0x7f0110000000ull;
    FT_ASSERT_OK(ferry_gds_register(g, buf, 24 * MiB, NULL));
    /* across the region boundary: two segments, each from its region's base */
    FT_ASSERT_OK(ferry_gds_transfer_async(g, FERRY_GDS_WRITE, 4096, 8 * MiB, buf + 12 * MiB,
                                          NULL));
    assert_int_equal(F.nios, 2);
    assert_int_equal(F.async_calls, 0);
    assert_int_equal(F.ios[0].async, 0);
    assert_int_equal(F.ios[0].op, FERRY_GDS_WRITE);
    assert_int_equal(F.ios[0].base, buf);
    assert_int_equal(F.ios[0].buf_off, 12 * MiB);
    assert_int_equal(F.ios[0].file_off, 4096);
    assert_int_equal(F.ios[0].size, 4 * MiB);
    assert_int_equal(F.ios[1].base, buf + 16 * MiB);
    assert_int_equal(F.ios[1].buf_off, 0);
    assert_int_equal(F.ios[1].file_off, 4096 + 4 * MiB);
    FT_ASSERT_OK(ferry_gds_stream_sync(g, NULL));
    FT_ASSERT_OK(ferry_gds_transfer_async(g, FERRY_GDS_READ, 0, 4096, buf, NULL));
    assert_int_equal(F.ios[2].op, FERRY_GDS_READ);
    ferry_gds_stats st = FERRY_GDS_STATS_INIT;
    FT_ASSERT_OK(ferry_gds_stats_get(g, &st));
    assert_int_equal(st.async_pending, 0);
    assert_int_equal(st.bytes_written, 8 * MiB);
    assert_int_equal(st.bytes_read, 4096);
    /* a failing write: returned by the call, nothing left for the sync */
    F.fail_write_at = 1;
    assert_int_equal(ferry_gds_transfer_async(g, FERRY_GDS_WRITE, 0, 4096, buf, NULL), -EIO);
    assert_non_null(strstr(ferry_gds_last_error(g), "fake: write failed"));
    FT_ASSERT_OK(ferry_gds_stream_sync(g, NULL));
    ferry_gds_close(g);
}

static void fill_aligned(ferry_gds *g, void **out, size_t n, unsigned seed)
{
    FT_ASSERT_OK(ferry_gds_buffer_alloc(g, n, out));
    ft_fill_pattern(*out, n, seed);
}

static void assert_busy_message(const char *m, const char *dir, long pid)
{
    char want[64];
    snprintf(want, sizeof want, "process %ld", pid);
    if (!strstr(m, dir) || !strstr(m, want))
        fail_msg("'%s' does not name %s and %s", m, dir, want);
}

static void one_owner_per_directory(void **state)
{
    (void)state;
    ferry_gds *g = on_fake();
    const size_t n = 64 * 1024;
    void *a = NULL, *back = NULL;
    fill_aligned(g, &a, n, 11);
    FT_ASSERT_OK(ferry_gds_pwrite(g, a, n, 0));
    /* a second context on the same directory: refused before it truncates */
    ferry_gds *g2 = NULL;
    assert_int_equal(ferry_gds_open(&X.cfg, &g2), FERRY_EBUSY);
    assert_null(g2);
    assert_busy_message(ferry_last_error(), X.dir, (long)getpid());
    /* the same directory spelled another way is the same directory */
    char other[300];
    snprintf(other, sizeof other, "%s/.", X.dir);
    const char *dirs_other[1] = {other};
    ferry_gds_config c = X.cfg;
    c.dirs = dirs_other;
    assert_int_equal(ferry_gds_open(&c, &g2), FERRY_EBUSY);
    /* the owner's bytes are still there (the second open used to truncate) */
    FT_ASSERT_OK(ferry_gds_buffer_alloc(g, n, &back));
    memset(back, 0, n);
    FT_ASSERT_OK(ferry_gds_pread(g, back, n, 0));
    assert_int_equal(ft_check_pattern(back, n, 11), -1);
    ferry_gds_buffer_free(g, a);
    ferry_gds_buffer_free(g, back);
    ferry_gds_close(g);
    /* released at close: the directory can be opened again */
    FT_ASSERT_OK(ferry_gds_open(&X.cfg, &g2));
    ferry_gds_close(g2);
    /* one config naming a directory twice owns it once: refused, and
     * nothing stays locked by the failed init */
    const char *twice[2] = {X.dir, X.dir};
    c = X.cfg;
    c.dirs = twice;
    c.n_dirs = 2;
    assert_int_equal(ferry_gds_open(&c, &g2), FERRY_EBUSY);
    FT_ASSERT_OK(ferry_gds_open(&X.cfg, &g2));
    ferry_gds_close(g2);
}

static void forked_child_is_refused(void **state)
{
    (void)state;
    ferry_gds *g = on_fake();
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        /* the child shares the parent's lock file description, and still
         * may not own the directory */
        ferry_gds *g2 = NULL;
        int rc = ferry_gds_open(&X.cfg, &g2);
        char want[64];
        snprintf(want, sizeof want, "process %ld", (long)getppid());
        int ok = rc == FERRY_EBUSY && g2 == NULL && strstr(ferry_last_error(), X.dir) &&
                 strstr(ferry_last_error(), want);
        _exit(ok ? 0 : 10 + (rc == FERRY_EBUSY));
    }
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status));
    assert_int_equal(WEXITSTATUS(status), 0);
    /* the child's exit did not take the parent's lock with it */
    ferry_gds *g2 = NULL;
    assert_int_equal(ferry_gds_open(&X.cfg, &g2), FERRY_EBUSY);
    ferry_gds_close(g);
    /* and a process that dies holding it leaves no stale lock */
    fflush(NULL);
    pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        ferry_gds *gc = NULL;
        _exit(ferry_gds_open(&X.cfg, &gc) == 0 ? 0 : 1); /* dies still open */
    }
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status));
    assert_int_equal(WEXITSTATUS(status), 0);
    FT_ASSERT_OK(ferry_gds_open(&X.cfg, &g2));
    ferry_gds_close(g2);
}

static unsigned mode_of(const char *path)
{
    struct stat st;
    if (stat(path, &st) != 0)
        fail_msg("stat %s: %s", path, strerror(errno));
    return (unsigned)(st.st_mode & 07777);
}

static void created_files_and_dirs_are_private(void **state)
{
    (void)state;
    mode_t old = umask(0); /* what ferry asks for, not what a umask leaves */
    char top[300], sub[340], p[400];
    snprintf(top, sizeof top, "%s/a", X.dir);
    snprintf(sub, sizeof sub, "%s/a/b", X.dir);
    const char *dirs[1] = {sub};
    X.cfg.dirs = dirs;
    ferry_gds *g = on_fake();
    umask(old);
    assert_int_equal(mode_of(top), 0700);
    assert_int_equal(mode_of(sub), 0700);
    snprintf(p, sizeof p, "%s/%s", sub, FERRY_GDS_SLAB_NAME);
    assert_int_equal(mode_of(p), 0600);
    snprintf(p, sizeof p, "%s/ferry.lock", sub);
    assert_int_equal(mode_of(p), 0600);
    ferry_gds_close(g);
    X.cfg.dirs = X.dirs;
}

static void explicit_mode_is_honoured(void **state)
{
    (void)state;
    mode_t old = umask(0);
    char sub[340], p[400];
    snprintf(sub, sizeof sub, "%s/group/slab", X.dir);
    const char *dirs[1] = {sub};
    X.cfg.dirs = dirs;
    X.cfg.mode = 0660;
    ferry_gds *g = on_fake();
    umask(old);
    assert_int_equal(mode_of(sub), 0770);
    snprintf(p, sizeof p, "%s/group", X.dir);
    assert_int_equal(mode_of(p), 0770);
    snprintf(p, sizeof p, "%s/%s", sub, FERRY_GDS_SLAB_NAME);
    assert_int_equal(mode_of(p), 0660);
    ferry_gds_close(g);
    X.cfg.dirs = X.dirs;
    X.cfg.mode = 0;
}

/* one bad value for one option: -EINVAL, a message naming the option,
 * nothing on disk and no driver call */
static void expect_refused(ferry_gds_config c, const char *option)
{
    int calls = F.calls;
    ferry_gds *g = NULL;
    int rc = ferry_gds_open(&c, &g);
    if (rc != -EINVAL)
        fail_msg("%s: open returned %d (%s), not -EINVAL", option, rc, ferry_strerror(rc));
    assert_null(g);
    if (!strstr(ferry_last_error(), option))
        fail_msg("message '%s' does not name %s", ferry_last_error(), option);
    assert_int_equal(F.calls, calls);
}

static void bad_config_values_are_refused(void **state)
{
    (void)state;
    X.drv = fake_table();
    X.cfg.custom_driver = &X.drv;
    ferry_gds_config c;
    const char *null_dir[2] = {X.dir, NULL};
    const char *empty_dir[1] = {""};
#define REFUSED(field, value, name)                                                                \
    do {                                                                                           \
        c = X.cfg;                                                                                 \
        c.field = value;                                                                           \
        expect_refused(c, name);                                                                   \
    } while (0)
    REFUSED(n_dirs, 0, "n_dirs");
    REFUSED(n_dirs, FERRY_GDS_MAX_DIRS + 1, "n_dirs");
    c = X.cfg;
    c.dirs = null_dir;
    c.n_dirs = 2;
    expect_refused(c, "dirs[1]");
    REFUSED(dirs, empty_dir, "dirs[0]");
    REFUSED(bytes, 0, "bytes");
    REFUSED(bytes, FERRY_GDS_BYTES_MAX + 1, "bytes");
    REFUSED(bytes, UINT64_MAX, "bytes");
    REFUSED(direct, 2, "direct");
    REFUSED(direct, -1, "direct");
    REFUSED(alignment, 3000, "alignment");
    REFUSED(alignment, 512, "alignment");
    REFUSED(alignment, (size_t)1 << 31, "alignment");
    REFUSED(alignment, (size_t)1 << 32, "alignment"); /* the divide-by-zero kin */
    REFUSED(alignment, SIZE_MAX, "alignment");
    REFUSED(alignment, 32 * MiB, "region_cap"); /* does not divide the default cap */
    REFUSED(region_cap, 5000, "region_cap");
    REFUSED(region_cap, FERRY_GDS_REGION_CAP_MAX + 4096, "region_cap");
    REFUSED(region_cap, SIZE_MAX, "region_cap");
    REFUSED(stripe_bytes, 4097, "stripe_bytes");
    REFUSED(stripe_bytes, SIZE_MAX & ~(size_t)4095, "stripe_bytes");
    REFUSED(depth, FERRY_IO_DEPTH_MAX + 1, "depth");
    REFUSED(depth, UINT32_MAX, "depth");
    REFUSED(mode, 0777, "mode");
    REFUSED(mode, 01600, "mode");
    REFUSED(mode, 0066, "mode");
    REFUSED(size, 0, "size");
    REFUSED(size, sizeof(ferry_gds_config) + 8, "size");
    REFUSED(size, offsetof(ferry_gds_config, mode) - 8, "size");
#undef REFUSED
    /* the messages say what is accepted */
    c = X.cfg;
    c.depth = 5000;
    expect_refused(c, "1..4096");
    /* nothing was created for the refused ones, and the edges are fine */
    c = X.cfg;
    c.alignment = 32 * MiB;
    c.region_cap = 32 * MiB;
    c.stripe_bytes = 32 * MiB;
    c.depth = FERRY_IO_DEPTH_MAX;
    c.mode = 0600;
    ferry_gds *g = NULL;
    FT_ASSERT_OK(ferry_gds_open(&c, &g));
    assert_int_equal(ferry_gds_size(g), 64 * MiB);
    ferry_gds_close(g);
}

/* a caller built before `mode` existed passes the shorter size: accepted,
 * mode 0 (0600), whatever follows its struct in memory */
static void older_config_size_is_accepted(void **state)
{
    (void)state;
    X.drv = fake_table();
    struct {
        ferry_gds_config c;
        unsigned char junk[64];
    } old;
    memset(&old, 0xA5, sizeof old); /* the old struct has no mode: junk where it would be */
    memcpy(&old.c, &X.cfg, offsetof(ferry_gds_config, mode));
    old.c.size = offsetof(ferry_gds_config, mode);
    old.c.custom_driver = &X.drv;
    mode_t um = umask(0);
    ferry_gds *g = NULL;
    int rc = ferry_gds_open(&old.c, &g);
    umask(um);
    FT_ASSERT_OK(rc);
    char p[400];
    snprintf(p, sizeof p, "%s/%s", X.dir, FERRY_GDS_SLAB_NAME);
    assert_int_equal(mode_of(p), 0600);
    ferry_gds_close(g);
}

/* core/stripe.c: every byte of the space maps to one (drive, file offset),
 * inside that drive's share, and the shares add up to the space */
static void stripe_map_and_share_agree(void **state)
{
    (void)state;
    static const struct {
        uint64_t unit;
        unsigned n;
        uint64_t size;
    } cases[] = {{8, 1, 77}, {8, 3, 100}, {8, 3, 96}, {16, 4, 13}, {4, 2, 4}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        uint64_t unit = cases[c].unit, size = cases[c].size;
        unsigned n = cases[c].n;
        uint64_t total = 0, seen[4] = {0};
        for (unsigned d = 0; d < n; d++)
            total += ferry__stripe_share(size, unit, n, d);
        assert_int_equal(total, size);
        for (uint64_t o = 0; o < size; o++) {
            unsigned d;
            uint64_t foff, run;
            ferry__stripe_map(unit, n, o, &d, &foff, &run);
            assert_true(d < n);
            assert_true(foff < ferry__stripe_share(size, unit, n, d));
            /* a drive's bytes arrive in file order, back to back */
            assert_int_equal(foff, seen[d]);
            seen[d]++;
            if (n == 1) {
                assert_int_equal(foff, o);
                assert_true(run == UINT64_MAX);
            } else {
                assert_int_equal(run, unit - o % unit);
            }
        }
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(stripe_map_and_share_agree),
        cmocka_unit_test_setup_teardown(fresh_context_is_off, setup, teardown),
        cmocka_unit_test_setup_teardown(initialize_with_none_is_noop, setup, teardown),
        cmocka_unit_test_setup_teardown(register_is_noop_when_uninitialized, setup, teardown),
        cmocka_unit_test_setup_teardown(splits_buffer_into_regions, setup, teardown),
        cmocka_unit_test_setup_teardown(maps_slice_to_base_and_offset, setup, teardown),
        cmocka_unit_test_setup_teardown(register_and_deregister_per_stream, setup, teardown),
        cmocka_unit_test_setup_teardown(chunk_larger_than_region_splits, setup, teardown),
        cmocka_unit_test_setup_teardown(slice_outside_regions_is_ebounds, setup, teardown),
        cmocka_unit_test_setup_teardown(bad_transfers_are_refused, setup, teardown),
        cmocka_unit_test_setup_teardown(double_registration_and_unknown_buffers, setup, teardown),
        cmocka_unit_test_setup_teardown(partial_registration_failure_rolls_back, setup, teardown),
        cmocka_unit_test_setup_teardown(driver_failure_mid_transfer, setup, teardown),
        cmocka_unit_test_setup_teardown(short_transfers_are_continued, setup, teardown),
        cmocka_unit_test_setup_teardown(async_arguments_live_until_checkpoints, setup, teardown),
        cmocka_unit_test_setup_teardown(no_async_entry_falls_back_to_sync, setup, teardown),
        cmocka_unit_test_setup_teardown(batch_entry_carries_multi_segment_transfers, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(close_releases_everything, setup, teardown),
        cmocka_unit_test_setup_teardown(second_init_is_an_error, setup, teardown),
        cmocka_unit_test_setup_teardown(size_rounds_up_and_slab_file_is_preallocated, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(init_failures_leave_it_off, setup, teardown),
        cmocka_unit_test_setup_teardown(slab_larger_than_free_disk, setup, teardown),
        cmocka_unit_test_setup_teardown(odirect_refused_falls_back_and_says_so, setup, teardown),
        cmocka_unit_test_setup_teardown(out_of_memory_registers_nothing, setup, teardown),
        cmocka_unit_test_setup_teardown(out_of_memory_in_init_leaves_nothing, setup, teardown),
        cmocka_unit_test_setup_teardown(async_on_the_default_stream, setup, teardown),
        cmocka_unit_test_setup_teardown(one_owner_per_directory, setup, teardown),
        cmocka_unit_test_setup_teardown(forked_child_is_refused, setup, teardown),
        cmocka_unit_test_setup_teardown(created_files_and_dirs_are_private, setup, teardown),
        cmocka_unit_test_setup_teardown(explicit_mode_is_honoured, setup, teardown),
        cmocka_unit_test_setup_teardown(bad_config_values_are_refused, setup, teardown),
        cmocka_unit_test_setup_teardown(older_config_size_is_accepted, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
