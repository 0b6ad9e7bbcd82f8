/*
 * test_cufile_fake.c - the cufile engine driven through a fake cuFile
 * table (the host device stands in for GPU memory: its device pointers are
 * host addresses, so the fake can really move the bytes and every round
 * trip is checked byte for byte).
 *
 * What is checked: the calls cuFile sees (driver open/close once per
 * process-wide use, handle and buffer registration, stream registration
 * with flags 0x7, once per stream), the 16 MiB split, (region base,
 * offset) arguments instead of interior pointers, batch status handling
 * (complete, failed, canceled, GetStatus failure), error mapping of the
 * 50xx codes, the fallback to the CPU path when handle registration fails,
 * FERRY_ENODEV without libcufile or without a cuda device, and one
 * driver open shared by the engine and a GDS context (one loader).
 */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ferry_test.h"
#include "io/cufile_api.h"
#include "io/io_impl.h"

static char g_dir[256];

static void assert_msg_has(const char *msg, const char *needle)
{
    if (!strstr(msg, needle))
        fail_msg("message '%s' does not contain '%s'", msg, needle);
}

/* ---- the fake ---- */
typedef struct io_rec {
    int kind; /* 'r' 'w' sync, 'R' 'W' async on a stream, 'b' 'B' batch read/write */
    void *base;
    size_t size;
    off_t file_off;
    off_t buf_off;
} io_rec;

#define MAXREC 256
static struct {
    int driver_open_err, handle_err, bufreg_err, getstatus_err;
    int fail_entry;      /* 1-based batch entry (over all submits) to fail */
    int fail_status;     /* FAILED or CANCELED */
    ssize_t fail_ret;
    int async_short;     /* async ops report half done */
    int opens, closes, handles, dehandles, bufregs, bufdeps, setups, submits, destroys, cancels;
    int stream_regs, stream_deregs;
    unsigned stream_flags;
    int entries;
    io_rec rec[MAXREC];
    int nrec;
    int fds[64];
    int block;           /* DriverOpen signals on g_block[0], waits on g_block[1] */
    int fork_inside;     /* DriverOpen forks (a child that exits at once) */
} F;
static int g_block[2];

static ferry__CUfileError_t ok(void)
{
    ferry__CUfileError_t e = {0, 0};
    return e;
}
static ferry__CUfileError_t err(int n)
{
    ferry__CUfileError_t e = {n, 0};
    return e;
}
static void record(int kind, void *base, size_t size, off_t fo, off_t bo)
{
    if (F.nrec < MAXREC)
        F.rec[F.nrec++] = (io_rec){kind, base, size, fo, bo};
}
static ssize_t do_io(void *fh, int write, void *base, size_t size, off_t fo, off_t bo)
{
    int fd = *(int *)fh;
    char *p = (char *)base + bo;
    ssize_t r = write ? pwrite(fd, p, size, fo) : pread(fd, p, size, fo);
    return r;
}

static ferry__CUfileError_t f_open(void)
{
    if (F.block) {
        char b = 1;
        if (write(g_block[0], &b, 1) != 1 || read(g_block[1], &b, 1) != 1)
            abort();
    }
    if (F.fork_inside) { /* (a driver starting a helper program) */
        pid_t ch = fork();
        if (ch == 0)
            _exit(0);
        if (ch > 0)
            waitpid(ch, NULL, 0);
    }
    F.opens++;
    return F.driver_open_err ? err(F.driver_open_err) : ok();
}
static ferry__CUfileError_t f_close(void)
{
    F.closes++;
    return ok();
}
static ferry__CUfileError_t f_hreg(ferry__CUfileHandle_t *fh, ferry__CUfileDescr_t *d)
{
    if (F.handle_err)
        return err(F.handle_err);
    assert_int_equal(d->type, 1);
    F.fds[F.handles % 64] = d->handle.fd;
    *fh = &F.fds[F.handles % 64];
    F.handles++;
    return ok();
}
static void f_hdereg(ferry__CUfileHandle_t fh)
{
    (void)fh;
    F.dehandles++;
}
static ferry__CUfileError_t f_breg(const void *b, size_t n, int flags)
{
    (void)b;
    (void)n;
    (void)flags;
    if (F.bufreg_err)
        return err(F.bufreg_err);
    F.bufregs++;
    return ok();
}
static ferry__CUfileError_t f_bdereg(const void *b)
{
    (void)b;
    F.bufdeps++;
    return ok();
}
static ssize_t f_read(ferry__CUfileHandle_t fh, void *base, size_t size, off_t fo, off_t bo)
{
    record('r', base, size, fo, bo);
    return do_io(fh, 0, base, size, fo, bo);
}
static ssize_t f_write(ferry__CUfileHandle_t fh, const void *base, size_t size, off_t fo,
                       off_t bo)
{
    record('w', (void *)base, size, fo, bo);
    return do_io(fh, 1, (void *)base, size, fo, bo);
}
static ferry__CUfileError_t f_async(int write, ferry__CUfileHandle_t fh, void *base, size_t *size,
                                    off_t *fo, off_t *bo, ssize_t *done, void *stream)
{
    (void)stream;
    record(write ? 'W' : 'R', base, *size, *fo, *bo);
    size_t n = F.async_short ? *size / 2 : *size;
    *done = do_io(fh, write, base, n, *fo, *bo);
    return ok();
}
static ferry__CUfileError_t f_rasync(ferry__CUfileHandle_t fh, void *base, size_t *size, off_t *fo,
                                     off_t *bo, ssize_t *done, void *stream)
{
    return f_async(0, fh, base, size, fo, bo, done, stream);
}
static ferry__CUfileError_t f_wasync(ferry__CUfileHandle_t fh, void *base, size_t *size, off_t *fo,
                                     off_t *bo, ssize_t *done, void *stream)
{
    return f_async(1, fh, base, size, fo, bo, done, stream);
}
static ferry__CUfileError_t f_sreg(void *s, unsigned flags)
{
    (void)s;
    F.stream_regs++;
    F.stream_flags = flags;
    return ok();
}
static ferry__CUfileError_t f_sdereg(void *s)
{
    (void)s;
    F.stream_deregs++;
    return ok();
}

typedef struct fbatch {
    unsigned cap;
    ferry__CUfileIOEvents_t ev[256];
    unsigned nev;
} fbatch;
static ferry__CUfileError_t f_setup(ferry__CUfileBatchHandle_t *id, unsigned nr)
{
    fbatch *b = calloc(1, sizeof *b);
    b->cap = nr;
    *id = b;
    F.setups++;
    return ok();
}
static ferry__CUfileError_t f_submit(ferry__CUfileBatchHandle_t id, unsigned nr,
                                     ferry__CUfileIOParams_t *p, unsigned flags)
{
    fbatch *b = id;
    assert_int_equal(flags, 0);
    assert_true(nr <= b->cap);
    F.submits++;
    for (unsigned i = 0; i < nr; i++) {
        assert_int_equal(p[i].mode, 1);
        int w = p[i].opcode == 1;
        record(w ? 'B' : 'b', p[i].u.batch.devPtr_base, p[i].u.batch.size,
               p[i].u.batch.file_offset, p[i].u.batch.devPtr_offset);
        ferry__CUfileIOEvents_t *e = &b->ev[b->nev++];
        e->cookie = p[i].cookie;
        if (++F.entries == F.fail_entry) {
            e->status = F.fail_status;
            e->ret = (size_t)F.fail_ret;
            continue;
        }
        ssize_t r = do_io(p[i].fh, w, p[i].u.batch.devPtr_base, p[i].u.batch.size,
                          p[i].u.batch.file_offset, p[i].u.batch.devPtr_offset);
        e->status = r < 0 ? 0x40 : 0x10;
        e->ret = (size_t)r;
    }
    return ok();
}
static ferry__CUfileError_t f_status(ferry__CUfileBatchHandle_t id, unsigned min, unsigned *nr,
                                     ferry__CUfileIOEvents_t *ev, struct timespec *ts)
{
    fbatch *b = id;
    (void)min;
    assert_non_null(ts);
    if (F.getstatus_err)
        return err(F.getstatus_err);
    unsigned k = *nr < b->nev ? *nr : b->nev;
    memcpy(ev, b->ev, k * sizeof *ev);
    memmove(b->ev, b->ev + k, (b->nev - k) * sizeof *ev);
    b->nev -= k;
    *nr = k;
    return ok();
}
static ferry__CUfileError_t f_cancel(ferry__CUfileBatchHandle_t id)
{
    ((fbatch *)id)->nev = 0;
    F.cancels++;
    return ok();
}
static void f_destroy(ferry__CUfileBatchHandle_t id)
{
    F.destroys++;
    free(id);
}

static const ferry__cufile_api g_fake = {
    f_open,  f_close,  f_hreg,  f_hdereg, f_breg,   f_bdereg, f_read,    f_write,   f_rasync,
    f_wasync, f_sreg, f_sdereg, f_setup, f_submit, f_status, f_cancel, f_destroy, 1,
};

/* ---- helpers ---- */
typedef struct env {
    ferry_device *dev;
    ferry_io *io;
} env;

static env open_env(unsigned depth)
{
    env e = {0};
    ferry_device_options d = FERRY_DEVICE_OPTIONS_INIT;
    d.backend = "host";
    FT_ASSERT_OK(ferry_device_open(&d, &e.dev));
    ferry_io_options o = FERRY_IO_OPTIONS_INIT;
    o.engine = "cufile";
    o.depth = depth;
    o.device = e.dev;
    o.bounce_bytes = 1 << 20;
    FT_ASSERT_OK(ferry_io_open(&o, &e.io));
    assert_string_equal(ferry_io_engine(e.io), "cufile");
    assert_int_equal(ferry_io_max_request(e.io), 16 << 20);
    return e;
}
static void close_env(env *e)
{
    ferry_io_close(e->io);
    ferry_device_close(e->dev);
}
static ferry_file *open_file(ferry_io *io, const char *name)
{
    char p[512];
    snprintf(p, sizeof p, "%s/%s", g_dir, name);
    ferry_file *f = NULL;
    FT_ASSERT_OK(ferry_file_open(io, p, FERRY_FILE_READ | FERRY_FILE_WRITE | FERRY_FILE_CREATE |
                                            FERRY_FILE_TRUNC | FERRY_FILE_DIRECT, &f));
    return f;
}
static ferry_devptr dev_pattern(ferry_device *dev, size_t n, unsigned seed)
{
    ferry_devptr p = 0;
    FT_ASSERT_OK(ferry_device_alloc(dev, n, &p));
    void *h = ferry_devptr_host(dev, p);
    ft_fill_pattern(h, n, seed);
    return p;
}

static int fake_setup(void **state)
{
    (void)state;
    memset(&F, 0, sizeof F);
    ferry__cufile_set_api(&g_fake);
    return 0;
}
static int fake_teardown(void **state)
{
    (void)state;
    ferry__cufile_set_api(NULL);
    return 0;
}

/* ---- tests ---- */
static void no_libcufile_is_enodev(void **state)
{
    (void)state;
    ferry__cufile_set_api(NULL);
    char why[256];
    int rc = ferry_io_engine_probe("cufile", NULL, why, sizeof why);
    if (rc == 0)
        skip(); /* a real libcufile is installed here */
    assert_int_equal(rc, FERRY_ENODEV);
    assert_msg_has(why, "libcufile.so.0");
    ferry_device_options d = FERRY_DEVICE_OPTIONS_INIT;
    d.backend = "host";
    ferry_device *dev = NULL;
    FT_ASSERT_OK(ferry_device_open(&d, &dev));
    ferry_io_options o = FERRY_IO_OPTIONS_INIT;
    o.engine = "cufile";
    o.device = dev;
    ferry_io *io = NULL;
    assert_int_equal(ferry_io_open(&o, &io), FERRY_ENODEV);
    assert_null(io);
    assert_msg_has(ferry_last_error(), "libcufile.so.0");
    ferry_device_close(dev);
}

static void needs_a_cuda_device(void **state)
{
    (void)state;
    ferry__cufile_api strict = g_fake;
    strict.allow_host_device = 0;
    ferry__cufile_set_api(&strict);
    ferry_device_options d = FERRY_DEVICE_OPTIONS_INIT;
    d.backend = "host";
    ferry_device *dev = NULL;
    FT_ASSERT_OK(ferry_device_open(&d, &dev));
    ferry_io_options o = FERRY_IO_OPTIONS_INIT;
    o.engine = "cufile";
    ferry_io *io = NULL;
    assert_int_equal(ferry_io_open(&o, &io), FERRY_ENODEV);
    assert_msg_has(ferry_last_error(), "needs a cuda device");
    o.device = dev;
    assert_int_equal(ferry_io_open(&o, &io), FERRY_ENODEV);
    assert_msg_has(ferry_last_error(), "backend is host");
    /* auto with a host device does not even try cufile */
    o.engine = NULL;
    FT_ASSERT_OK(ferry_io_open(&o, &io));
    assert_string_not_equal(ferry_io_engine(io), "cufile");
    assert_msg_has(ferry_io_reason(io), "device backend is host");
    ferry_io_close(io);
    assert_int_equal(F.opens, 0);
    ferry_device_close(dev);
}

static void driver_open_failure_is_mapped(void **state)
{
    (void)state;
    F.driver_open_err = 5011;
    char why[256];
    assert_int_equal(ferry_io_engine_probe("cufile", NULL, why, sizeof why), FERRY_ENODEV);
    assert_msg_has(why, "5011");
    assert_msg_has(why, "CUDA driver error");
    ferry_device_options d = FERRY_DEVICE_OPTIONS_INIT;
    d.backend = "host";
    ferry_device *dev = NULL;
    FT_ASSERT_OK(ferry_device_open(&d, &dev));
    ferry_io_options o = FERRY_IO_OPTIONS_INIT;
    o.engine = "cufile";
    o.device = dev;
    ferry_io *io = NULL;
    assert_int_equal(ferry_io_open(&o, &io), FERRY_ENODEV);
    assert_msg_has(ferry_last_error(), "cuFileDriverOpen");
    ferry_device_close(dev);
}

static void error_table_and_mapping(void **state)
{
    (void)state;
    assert_string_equal(ferry__cufile_strerror(5030), "internal error");
    assert_string_equal(ferry__cufile_strerror(-5008), "I/O not supported (file system or device)");
    assert_string_equal(ferry__cufile_strerror(5020), "file not opened with O_DIRECT");
    assert_string_equal(ferry__cufile_strerror(5999), "unknown cuFile error");
    assert_string_equal(ferry__cufile_strerror(7), "not a cuFile error");
    assert_int_equal(ferry__cufile_code(0), 0);
    assert_int_equal(ferry__cufile_code(5001), FERRY_ENODEV);
    assert_int_equal(ferry__cufile_code(5008), FERRY_ENOTSUP);
    assert_int_equal(ferry__cufile_code(5012), -EFAULT);
    assert_int_equal(ferry__cufile_code(5019), -EINVAL);
    assert_int_equal(ferry__cufile_code(5023), FERRY_EEXIST);
    assert_int_equal(ferry__cufile_code(5028), FERRY_EEXIST);
    assert_int_equal(ferry__cufile_code(5030), FERRY_EDRIVER);
    assert_int_equal(ferry__cufile_code(5035), FERRY_EDRIVER);
    assert_int_equal(ferry__cufile_code(5036), -ENOMEM);
    assert_int_equal(ferry__cufile_ret_code(-1, EIO), -EIO);
    assert_int_equal(ferry__cufile_ret_code(-1, 0), -EIO);
    assert_int_equal(ferry__cufile_ret_code(-5012, 0), -EFAULT);
    assert_int_equal(ferry__cufile_ret_code(4096, 0), 0);
}

static void sync_transfers_split_at_16mib_with_region_base(void **state)
{
    (void)state;
    env e = open_env(2); /* depth 2: the split cap, not the depth, sets the pieces */
    ferry_file *f = open_file(e.io, "split.bin");
    assert_true(ferry_file_is_gds(f));
    assert_null(ferry_file_fallback_reason(f));
    assert_int_equal(F.opens, 1);
    assert_int_equal(F.handles, 1);
    size_t n = (size_t)40 << 20;
    ferry_devptr region = dev_pattern(e.dev, n + 4096, 9), back = 0;
    FT_ASSERT_OK(ferry_io_register_dev(e.io, region, n + 4096));
    assert_int_equal(F.bufregs, 1);
    assert_int_equal(ferry_io_register_dev(e.io, region, n + 4096), FERRY_EEXIST);
    /* a slice 4 KiB into the region */
    FT_ASSERT_OK(ferry_io_write_dev(e.io, f, NULL, region + 4096, n, 0));
    assert_int_equal(F.nrec, 3);
    size_t want[3] = {16 << 20, 16 << 20, 8 << 20};
    size_t fo = 0;
    for (int i = 0; i < 3; i++) {
        assert_int_equal(F.rec[i].kind, 'B');
        assert_ptr_equal(F.rec[i].base, (void *)(uintptr_t)region); /* never interior */
        assert_int_equal(F.rec[i].buf_off, (off_t)(4096 + fo));
        assert_int_equal(F.rec[i].file_off, (off_t)fo);
        assert_int_equal(F.rec[i].size, want[i]);
        fo += want[i];
    }
    /* read back into unregistered memory: base is the pointer itself */
    FT_ASSERT_OK(ferry_device_alloc(e.dev, n, &back));
    F.nrec = 0;
    FT_ASSERT_OK(ferry_io_read_dev(e.io, f, NULL, back, n, 0));
    assert_int_equal(F.nrec, 3);
    assert_int_equal(F.rec[0].kind, 'b');
    assert_ptr_equal(F.rec[1].base, (void *)(uintptr_t)(back + (16 << 20)));
    assert_int_equal(F.rec[1].buf_off, 0);
    assert_int_equal(ft_check_pattern(ferry_devptr_host(e.dev, back), n, 9 + 4096), -1);
    assert_true(F.setups >= 1 && F.setups <= 2); /* batches are reused */
    FT_ASSERT_OK(ferry_io_unregister_dev(e.io, region));
    assert_int_equal(F.bufdeps, 1);
    assert_int_equal(ferry_io_unregister_dev(e.io, region), FERRY_ENOTFOUND);
    FT_ASSERT_OK(ferry_file_close(f));
    assert_int_equal(F.dehandles, 1);
    ferry_device_free(e.dev, region);
    ferry_device_free(e.dev, back);
    close_env(&e);
    assert_int_equal(F.closes, 1);
    assert_int_equal(F.destroys, F.setups);
}

static void stream_async_registers_once_and_continues_short(void **state)
{
    (void)state;
    env e = open_env(4);
    ferry_file *f = open_file(e.io, "async.bin");
    ferry_stream *s = NULL;
    FT_ASSERT_OK(ferry_stream_create(e.dev, &s));
    size_t n = (size_t)24 << 20;
    ferry_devptr src = dev_pattern(e.dev, n, 4), dst = 0;
    FT_ASSERT_OK(ferry_device_alloc(e.dev, n, &dst));
    FT_ASSERT_OK(ferry_io_register_dev(e.io, src, n));
    FT_ASSERT_OK(ferry_io_write_dev(e.io, f, s, src, n, 0));
    assert_int_equal(F.stream_regs, 1);
    assert_int_equal(F.stream_flags, 0x7);
    assert_int_equal(F.nrec, 2); /* 24 MiB = 16 + 8 */
    assert_int_equal(F.rec[0].kind, 'W');
    assert_int_equal(F.rec[0].size, 16 << 20);
    assert_int_equal(F.rec[1].size, 8 << 20);
    assert_ptr_equal(F.rec[1].base, (void *)(uintptr_t)src);
    assert_int_equal(F.rec[1].buf_off, 16 << 20);
    assert_int_equal(F.rec[1].file_off, 16 << 20);
    /* reads done half by the stream op: the engine finishes them synchronously */
    F.nrec = 0;
    F.async_short = 1;
    FT_ASSERT_OK(ferry_io_read_dev(e.io, f, s, dst, n, 0));
    assert_int_equal(F.stream_regs, 1); /* same stream: registered once */
    assert_int_equal(F.rec[0].kind, 'R');
    int sync_reads = 0;
    for (int i = 0; i < F.nrec; i++)
        sync_reads += F.rec[i].kind == 'r';
    assert_int_equal(sync_reads, 2);
    assert_int_equal(ft_check_pattern(ferry_devptr_host(e.dev, dst), n, 4), -1);
    FT_ASSERT_OK(ferry_stream_destroy(s));
    FT_ASSERT_OK(ferry_file_close(f));
    ferry_device_free(e.dev, dst);
    close_env(&e);
    assert_int_equal(F.bufdeps, 1); /* close deregistered what was left */
    assert_int_equal(F.stream_deregs, 1);
}

static void batch_status_failures_map_per_request(void **state)
{
    (void)state;
    env e = open_env(4);
    ferry_file *f = open_file(e.io, "batch.bin");
    enum { N = 10, LEN = 8192 };
    ferry_devptr buf = dev_pattern(e.dev, (size_t)N * LEN, 2);
    F.fail_entry = 3;
    F.fail_status = 0x40;
    F.fail_ret = -5030;
    ferry_io_req r[N], *p[N], *d[N];
    for (int i = 0; i < N; i++) {
        r[i] = (ferry_io_req){.op = FERRY_IO_WRITE, .file = f, .dev = buf + (size_t)i * LEN,
                              .len = LEN, .offset = (uint64_t)i * LEN};
        p[i] = &r[i];
    }
    assert_int_equal(ferry_io_submit(e.io, p, N), N);
    int got = 0;
    while (got < N)
        got += ferry_io_reap(e.io, d + got, 1, N - (unsigned)got, -1);
    int failed = 0;
    for (int i = 0; i < N; i++) {
        if (r[i].result < 0) {
            assert_int_equal(r[i].result, FERRY_EDRIVER);
            failed++;
        } else
            assert_int_equal(r[i].result, LEN);
    }
    assert_int_equal(failed, 1);
    assert_msg_has(ferry_io_last_error(e.io), "batch.bin");
    /* canceled entries */
    F.entries = 0;
    F.fail_entry = 1;
    F.fail_status = 0x8;
    assert_int_equal(ferry_io_submit(e.io, p, 1), 1);
    assert_int_equal(ferry_io_reap(e.io, d, 1, 1, -1), 1);
    assert_int_equal(r[0].result, -ECANCELED);
    /* GetStatus itself failing fails the batch's requests instead of hanging */
    F.fail_entry = 0;
    F.getstatus_err = 5030;
    assert_int_equal(ferry_io_submit(e.io, p, 2), 2);
    got = 0;
    while (got < 2)
        got += ferry_io_reap(e.io, d + got, 1, 2 - (unsigned)got, -1);
    assert_int_equal(r[0].result, FERRY_EDRIVER);
    assert_int_equal(r[1].result, FERRY_EDRIVER);
    assert_true(F.cancels >= 1);
    F.getstatus_err = 0;
    /* and the engine still works afterwards */
    assert_int_equal(ferry_io_submit(e.io, p, N), N);
    got = 0;
    while (got < N)
        got += ferry_io_reap(e.io, d + got, 1, N - (unsigned)got, -1);
    for (int i = 0; i < N; i++)
        assert_int_equal(r[i].result, LEN);
    FT_ASSERT_OK(ferry_file_close(f));
    ferry_device_free(e.dev, buf);
    close_env(&e);
}

static void handle_registration_failure_falls_back(void **state)
{
    (void)state;
    F.handle_err = 5030;
    env e = open_env(4);
    ferry_file *f = open_file(e.io, "fallback.bin");
    assert_false(ferry_file_is_gds(f));
    assert_non_null(ferry_file_fallback_reason(f));
    assert_msg_has(ferry_file_fallback_reason(f), "5030");
    assert_msg_has(ferry_file_fallback_reason(f), "internal error");
    assert_msg_has(ferry_file_fallback_reason(f), "CPU bounce path");
    size_t n = (3 << 20) + 8192;
    ferry_devptr src = dev_pattern(e.dev, n, 12), dst = 0;
    FT_ASSERT_OK(ferry_device_alloc(e.dev, n, &dst));
    FT_ASSERT_OK(ferry_io_write_dev(e.io, f, NULL, src, n, 0));
    FT_ASSERT_OK(ferry_io_read_dev(e.io, f, NULL, dst, n, 0));
    assert_int_equal(ft_check_pattern(ferry_devptr_host(e.dev, dst), n, 12), -1);
    assert_int_equal(F.nrec, 0); /* no cuFile I/O at all */
    ferry_io_req r = {.op = FERRY_IO_READ, .file = f, .dev = dst, .len = 4096};
    ferry_io_req *p = &r;
    assert_int_equal(ferry_io_submit(e.io, &p, 1), FERRY_ENOTSUP);
    FT_ASSERT_OK(ferry_file_close(f));
    assert_int_equal(F.dehandles, 0);
    ferry_device_free(e.dev, src);
    ferry_device_free(e.dev, dst);
    close_env(&e);
}

static void host_buffers_take_the_cpu_side(void **state)
{
    (void)state;
    env e = open_env(4);
    ferry_file *f = open_file(e.io, "host.bin");
    size_t n = 2 << 20;
    void *a = NULL, *b = NULL;
    FT_ASSERT_OK(ferry_io_buffer_alloc(e.io, n, &a)); /* pinned, from the device */
    FT_ASSERT_OK(ferry_io_buffer_alloc(e.io, n, &b));
    ft_fill_pattern(a, n, 30);
    FT_ASSERT_OK(ferry_io_pwrite(e.io, f, a, n, 0));
    FT_ASSERT_OK(ferry_io_pread(e.io, f, b, n, 0));
    assert_int_equal(ft_check_pattern(b, n, 30), -1);
    assert_int_equal(F.nrec, 0);
    /* host and device requests mixed in one submit */
    ferry_devptr d = dev_pattern(e.dev, 4096, 40);
    ferry_io_req r[2] = {
        {.op = FERRY_IO_WRITE, .file = f, .buf = a, .len = 4096, .offset = 0},
        {.op = FERRY_IO_WRITE, .file = f, .dev = d, .len = 4096, .offset = 8192},
    };
    ferry_io_req *p[2] = {&r[0], &r[1]}, *done[2];
    assert_int_equal(ferry_io_submit(e.io, p, 2), 2);
    int got = 0;
    while (got < 2)
        got += ferry_io_reap(e.io, done + got, 1, 2 - (unsigned)got, -1);
    assert_int_equal(r[0].result, 4096);
    assert_int_equal(r[1].result, 4096);
    assert_int_equal(F.nrec, 1);
    FT_ASSERT_OK(ferry_io_pread(e.io, f, b, 4096, 8192));
    assert_int_equal(ft_check_pattern(b, 4096, 40), -1);
    ferry_io_buffer_free(e.io, a);
    ferry_io_buffer_free(e.io, b);
    ferry_device_free(e.dev, d);
    FT_ASSERT_OK(ferry_file_close(f));
    close_env(&e);
}

static void buffer_registration_errors(void **state)
{
    (void)state;
    env e = open_env(2);
    ferry_devptr d = dev_pattern(e.dev, 8192, 1);
    F.bufreg_err = 5036;
    assert_int_equal(ferry_io_register_dev(e.io, d, 8192), -ENOMEM);
    assert_msg_has(ferry_io_last_error(e.io), "GPU memory pinning failed");
    F.bufreg_err = 0;
    assert_int_equal(ferry_io_register_dev(e.io, 0, 8192), -EINVAL);
    assert_int_equal(ferry_io_unregister_dev(e.io, d), FERRY_ENOTFOUND);
    ferry_device_free(e.dev, d);
    close_env(&e);
}

/* a cufile engine opened (and closed) on dev */
static int oom_cufile_open(void *ctx)
{
    ferry_io_options o = FERRY_IO_OPTIONS_INIT;
    o.engine = "cufile";
    o.device = ctx;
    ferry_io *io = NULL;
    int rc = ferry_io_open(&o, &io);
    ferry_io_close(io);
    return rc;
}

static void driver_refcounted_across_engines_and_oom(void **state)
{
    (void)state;
    env a = open_env(2), b = open_env(2);
    assert_int_equal(F.opens, 1);
    close_env(&a);
    assert_int_equal(F.closes, 0);
    close_env(&b);
    assert_int_equal(F.closes, 1);
    /* out of memory at every allocation of open */
    ferry_device_options d = FERRY_DEVICE_OPTIONS_INIT;
    d.backend = "host";
    ferry_device *dev = NULL;
    FT_ASSERT_OK(ferry_device_open(&d, &dev));
    ft_oom_each(50, FT_OOM_STICKY, oom_cufile_open, dev);
    ferry_device_close(dev);
    assert_int_equal(F.opens, F.closes); /* every driver open of a failed open was undone */
}

/* one library, one driver open per process: a cufile engine and a GDS
 * context with the cufile driver share cuFile's load and DriverOpen */
static void engine_and_gds_context_share_one_driver_open(void **state)
{
    (void)state;
    env e = open_env(4);
    assert_int_equal(F.opens, 1);
    char dir[300];
    snprintf(dir, sizeof dir, "%s/gds", g_dir);
    const char *dirs[1] = {dir};
    ferry_gds_config c = FERRY_GDS_CONFIG_INIT;
    c.dirs = dirs;
    c.n_dirs = 1;
    c.bytes = 1 << 20;
    c.driver = "cufile";
    c.device = e.dev;
    ferry_gds *g = NULL;
    FT_ASSERT_OK(ferry_gds_open(&c, &g));
    assert_string_equal(ferry_gds_driver_name(g), "cufile");
    assert_int_equal(F.opens, 1); /* the engine's open serves the context too */
    ferry_gds_close(g);
    assert_int_equal(F.closes, 0); /* the engine still uses the driver */
    close_env(&e);
    assert_int_equal(F.opens, 1);
    assert_int_equal(F.closes, 1);
}

/* ---- a fork while another thread is inside DriverOpen ---- */

struct probe_arg {
    int rc;
    char why[256];
};

static void *probe_in_thread(void *arg)
{
    struct probe_arg *pa = arg;
    pa->rc = ferry_io_engine_probe("cufile", NULL, pa->why, sizeof pa->why);
    return NULL;
}

/* the child of a fork taken while a thread of the parent holds cuFile's
 * loader lock inside DriverOpen (the fake's blocks until a third thread
 * lets it go) probes the cufile engine: it gets an answer, where it used
 * to wait forever on the lock (the alarm kills such a child) */
static void a_fork_during_driver_open_leaves_the_child_a_usable_loader(void **state)
{
    (void)state;
    int sig[2], rel[2];
    assert_int_equal(pipe(sig), 0);
    assert_int_equal(pipe(rel), 0);
    g_block[0] = sig[1];
    g_block[1] = rel[0];
    F.block = 1;
    struct probe_arg pa = {1, ""};
    pthread_t prober, releaser;
    assert_int_equal(pthread_create(&prober, NULL, probe_in_thread, &pa), 0);
    char b = 0;
    assert_int_equal(read(sig[0], &b, 1), 1); /* the prober is inside DriverOpen, lock held */
    assert_int_equal(pthread_create(&releaser, NULL, ft_write_byte_after_300ms, &rel[1]), 0);
    pid_t ch = fork();
    if (ch == 0) {
        alarm(10); /* a child waiting on the parent's lock dies of SIGALRM */
        F.block = 0;
        char why[256] = "";
        int rc = ferry_io_engine_probe("cufile", NULL, why, sizeof why);
        _exit(rc == 0 && strstr(why, "cuFileDriverOpen succeeded") ? 0 : 2);
    }
    assert_true(ch > 0);
    int cx = ft_child_exit(ch);
    pthread_join(releaser, NULL);
    pthread_join(prober, NULL);
    F.block = 0;
    if (cx < 0)
        fail_msg("the forked child died of signal %d (SIGALRM: it hung on the loader lock)", -cx);
    assert_int_equal(cx, 0);
    assert_int_equal(pa.rc, 0); /* the parent's probe went on as usual */
    assert_msg_has(pa.why, "cuFileDriverOpen succeeded");
    assert_int_equal(F.opens, 1);
    assert_int_equal(F.closes, 1);
    close(sig[0]);
    close(sig[1]);
    close(rel[0]);
    close(rel[1]);
}

/* a driver that forks from inside DriverOpen (which the loader lock
 * covers) must not deadlock the process: the probe answers (run in a child
 * of the test under an alarm, so a deadlock fails the test, not hangs it) */
static void a_fork_from_inside_driver_open_does_not_deadlock(void **state)
{
    (void)state;
    pid_t subject = fork();
    if (subject == 0) {
        alarm(10);
        F.fork_inside = 1;
        char why[256] = "";
        int rc = ferry_io_engine_probe("cufile", NULL, why, sizeof why);
        _exit(rc == 0 && strstr(why, "cuFileDriverOpen succeeded") ? 0 : 2);
    }
    assert_true(subject > 0);
    FT_ASSERT_CHILD_OK(subject, "the probing process (deadlocked on its fork?)");
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
    ferry__cufile_set_api(NULL);
    ft_rmtree(g_dir);
    return 0;
}

#define T(fn) cmocka_unit_test_setup_teardown(fn, fake_setup, fake_teardown)

int main(void)
{
    const struct CMUnitTest tests[] = {
        T(no_libcufile_is_enodev),
        T(needs_a_cuda_device),
        T(driver_open_failure_is_mapped),
        T(error_table_and_mapping),
        T(sync_transfers_split_at_16mib_with_region_base),
        T(stream_async_registers_once_and_continues_short),
        T(batch_status_failures_map_per_request),
        T(handle_registration_failure_falls_back),
        T(host_buffers_take_the_cpu_side),
        T(buffer_registration_errors),
        T(driver_refcounted_across_engines_and_oom),
        T(engine_and_gds_context_share_one_driver_open),
        T(a_fork_during_driver_open_leaves_the_child_a_usable_loader),
        T(a_fork_from_inside_driver_open_does_not_deadlock),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
