/*
 * test_io.c - the I/O front with the posix and uring engines: round trips
 * with many requests in flight, splitting at max_request, O_DIRECT
 * alignment, end of file, zero length, missing and unwritable
 * directories, faults injected through the syscall seam (posix) and the
 * completion seam (uring): ENOSPC, EIO, short transfers, EINTR, EAGAIN;
 * O_DIRECT fallback, engine selection and probes, out-of-memory at every
 * allocation of open and submit, reap timeouts with a request held in the
 * seam, independent engines on several threads at once, and a buffer
 * registered on one thread while another drives the io.
 *
 * Every engine-dependent test runs once per engine (the prestate names it).
 */
/* ferry-test-labels: concurrent */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "ferry_test.h"
#include "io/io_impl.h"
#include "io/sys.h"

static char g_dir[256];

static void assert_msg_has(const char *msg, const char *needle)
{
    if (!strstr(msg, needle))
        fail_msg("message '%s' does not contain '%s'", msg, needle);
}

/* ---- fault injection through the seams ---- */
enum { F_OPEN, F_PREAD, F_PWRITE, F_FALLOCATE, F_FDATASYNC, F_NCALLS };
typedef struct fault {
    atomic_uint calls[F_NCALLS];
    int which;            /* F_* counted for nth */
    unsigned nth;         /* 1-based call to fail; 0 = none */
    int sticky;           /* every call from nth on */
    int err;              /* errno to fail with */
    unsigned short_every; /* every k-th read/write moves at most half (and >= 4096) */
    unsigned eintr_every; /* every k-th read/write fails with err_every */
    int err_every;        /* EINTR or EAGAIN */
    int direct_einval;    /* open with O_DIRECT fails with EINVAL */
    atomic_uint shorts, intrs;
    atomic_size_t max_len; /* largest read/write length seen */
    atomic_uint rw_calls;
} fault;
static fault g_f;

static int hit(int which)
{
    unsigned n = atomic_fetch_add(&g_f.calls[which], 1) + 1;
    if (g_f.which != which || !g_f.nth)
        return 0;
    return n == g_f.nth || (g_f.sticky && n > g_f.nth);
}

static size_t note_len(size_t n)
{
    size_t m = atomic_load(&g_f.max_len);
    while (n > m && !atomic_compare_exchange_weak(&g_f.max_len, &m, n))
        ;
    return n;
}

/* returns: 0 pass through, else a result to report; *len may be shortened */
static long rw_fault(int which, size_t *len)
{
    note_len(*len);
    unsigned k = atomic_fetch_add(&g_f.rw_calls, 1) + 1;
    if (hit(which)) {
        errno = g_f.err;
        return -1;
    }
    if (g_f.eintr_every && k % g_f.eintr_every == 0) {
        atomic_fetch_add(&g_f.intrs, 1);
        errno = g_f.err_every ? g_f.err_every : EINTR;
        return -1;
    }
    if (g_f.short_every && k % g_f.short_every == 0 && *len > 4096) {
        atomic_fetch_add(&g_f.shorts, 1);
        size_t h = (*len / 2) & ~(size_t)4095;
        *len = h ? h : 4096;
    }
    return 0;
}

static int f_open(const char *p, int fl, mode_t m)
{
    if (g_f.direct_einval && (fl & O_DIRECT)) {
        errno = EINVAL;
        return -1;
    }
    if (hit(F_OPEN)) {
        errno = g_f.err;
        return -1;
    }
    return ferry__sys_default()->open(p, fl, m);
}
static ssize_t f_pread(int fd, void *b, size_t n, off_t o)
{
    if (rw_fault(F_PREAD, &n))
        return -1;
    return ferry__sys_default()->pread(fd, b, n, o);
}
static ssize_t f_pwrite(int fd, const void *b, size_t n, off_t o)
{
    if (rw_fault(F_PWRITE, &n))
        return -1;
    return ferry__sys_default()->pwrite(fd, b, n, o);
}
static int f_fallocate(int fd, off_t o, off_t l)
{
    if (hit(F_FALLOCATE))
        return g_f.err;
    return ferry__sys_default()->fallocate(fd, o, l);
}
static int f_fdatasync(int fd)
{
    if (hit(F_FDATASYNC)) {
        errno = g_f.err;
        return -1;
    }
    return ferry__sys_default()->fdatasync(fd);
}
/* the uring completion hook: same rules, applied to the kernel's result */
static int f_uring(void *ctx, int op, int fd, uint64_t off, size_t len, int res)
{
    (void)ctx;
    (void)fd;
    (void)off;
    if (res < 0)
        return res;
    size_t n = len;
    if (rw_fault(op == FERRY_IO_READ ? F_PREAD : F_PWRITE, &n))
        return -errno;
    return n < (size_t)res ? (int)n : res;
}

static ferry__sys g_table;
static void faults_install(void)
{
    g_table = *ferry__sys_default();
    g_table.open = f_open;
    g_table.pread = f_pread;
    g_table.pwrite = f_pwrite;
    g_table.fallocate = f_fallocate;
    g_table.fdatasync = f_fdatasync;
    g_table.uring_result = f_uring;
    ferry__sys_set(&g_table);
}
static void faults_reset(void)
{
    for (int i = 0; i < F_NCALLS; i++)
        atomic_store(&g_f.calls[i], 0);
    g_f.which = 0;
    g_f.nth = 0;
    g_f.sticky = 0;
    g_f.err = 0;
    g_f.short_every = 0;
    g_f.eintr_every = 0;
    g_f.err_every = 0;
    g_f.direct_einval = 0;
    atomic_store(&g_f.shorts, 0);
    atomic_store(&g_f.intrs, 0);
    atomic_store(&g_f.max_len, 0);
    atomic_store(&g_f.rw_calls, 0);
}
static void fault_at(int which, unsigned nth, int err, int sticky)
{
    faults_reset();
    g_f.which = which;
    g_f.nth = nth;
    g_f.err = err;
    g_f.sticky = sticky;
}

/* ---- helpers ---- */
static ferry_io *open_io(const char *engine, unsigned depth, size_t max_request)
{
    ferry_io_options o = FERRY_IO_OPTIONS_INIT;
    o.engine = engine;
    o.depth = depth;
    o.max_request = max_request;
    ferry_io *io = NULL;
    FT_ASSERT_OK(ferry_io_open(&o, &io));
    assert_string_equal(ferry_io_engine(io), engine);
    return io;
}

static const char *path_of(const char *name)
{
    static char p[512];
    snprintf(p, sizeof p, "%s/%s", g_dir, name);
    return p;
}

static ferry_file *open_file(ferry_io *io, const char *name, unsigned extra)
{
    ferry_file *f = NULL;
    FT_ASSERT_OK(ferry_file_open(io, path_of(name),
                                 FERRY_FILE_READ | FERRY_FILE_WRITE | FERRY_FILE_CREATE | extra,
                                 &f));
    return f;
}

static void *abuf(size_t n)
{
    void *p = NULL;
    assert_int_equal(posix_memalign(&p, 4096, n), 0);
    return p;
}

static const char *engine_of(void **state)
{
    return (const char *)*state;
}

/* ---- round trips ---- */
static void roundtrip_many_in_flight(void **state)
{
    const char *eng = engine_of(state);
    ferry_io *io = open_io(eng, 8, 0);
    ferry_file *f = open_file(io, "rt.bin", FERRY_FILE_DIRECT | FERRY_FILE_TRUNC);
    assert_true(ferry_file_is_direct(f));
    assert_null(ferry_file_fallback_reason(f));
    enum { N = 64, LEN = 64 << 10 };
    char *src = abuf((size_t)N * LEN), *dst = abuf((size_t)N * LEN);
    ft_fill_pattern(src, (size_t)N * LEN, 7);
    memset(dst, 0, (size_t)N * LEN);
    ferry_io_req reqs[N], *ptrs[N], *done[N];
    for (int op = FERRY_IO_WRITE; op >= FERRY_IO_READ; op--) {
        memset(reqs, 0, sizeof reqs);
        for (int i = 0; i < N; i++) {
            reqs[i].op = op;
            reqs[i].file = f;
            reqs[i].buf = (op == FERRY_IO_WRITE ? src : dst) + (size_t)i * LEN;
            reqs[i].len = LEN;
            reqs[i].offset = (uint64_t)(N - 1 - i) * LEN; /* out of order on purpose */
            reqs[i].user = &reqs[i];
            ptrs[i] = &reqs[i];
        }
        assert_int_equal(ferry_io_submit(io, ptrs, N), N);
        assert_int_equal(ferry_io_inflight(io), N);
        int got = 0;
        while (got < N) {
            int k = ferry_io_reap(io, done + got, 1, N - got, -1);
            assert_true(k >= 1);
            got += k;
        }
        assert_int_equal(ferry_io_inflight(io), 0);
        for (int i = 0; i < N; i++) {
            assert_int_equal(done[i]->result, LEN);
            assert_ptr_equal(done[i]->user, done[i]);
        }
    }
    for (int i = 0; i < N; i++)
        assert_int_equal(ft_check_pattern(dst + (size_t)i * LEN, LEN, 7 + (unsigned)i * LEN), -1);
    /* the synchronous helpers see the same bytes */
    memset(dst, 0, (size_t)N * LEN);
    FT_ASSERT_OK(ferry_io_pread(io, f, dst, (size_t)N * LEN, 0));
    assert_int_equal(ft_check_pattern(dst, LEN, 7 + (unsigned)(N - 1) * LEN), -1);
    uint64_t size = 0;
    FT_ASSERT_OK(ferry_file_size(f, &size));
    assert_int_equal(size, (uint64_t)N * LEN);
    FT_ASSERT_OK(ferry_file_close(f));
    ferry_io_close(io);
    free(src);
    free(dst);
}

static void split_at_max_request(void **state)
{
    const char *eng = engine_of(state);
    faults_install();
    faults_reset();
    ferry_io *io = open_io(eng, 4, 64 << 10);
    assert_int_equal(ferry_io_max_request(io), 64 << 10);
    ferry_file *f = open_file(io, "split.bin", FERRY_FILE_DIRECT | FERRY_FILE_TRUNC);
    size_t n = 1 << 20;
    char *src = abuf(n), *dst = abuf(n);
    ft_fill_pattern(src, n, 3);
    ferry_io_req r = {.op = FERRY_IO_WRITE, .file = f, .buf = src, .len = n, .offset = 0};
    ferry_io_req *p = &r, *d = NULL;
    assert_int_equal(ferry_io_submit(io, &p, 1), 1);
    assert_int_equal(ferry_io_reap(io, &d, 1, 1, -1), 1);
    assert_ptr_equal(d, &r);
    assert_int_equal(r.result, (int64_t)n);
    assert_int_equal(atomic_load(&g_f.rw_calls), n / (64 << 10));
    assert_int_equal(atomic_load(&g_f.max_len), 64 << 10);
    FT_ASSERT_OK(ferry_io_pread(io, f, dst, n, 0));
    assert_int_equal(ft_check_pattern(dst, n, 3), -1);
    assert_true(atomic_load(&g_f.max_len) <= (64 << 10));
    FT_ASSERT_OK(ferry_file_close(f));
    ferry_io_close(io);
    ferry__sys_set(NULL);
    free(src);
    free(dst);
}

static void registered_buffers_round_trip(void **state)
{
    const char *eng = engine_of(state);
    ferry_io *io = open_io(eng, 8, 0);
    ferry_file *f = open_file(io, "reg.bin", FERRY_FILE_DIRECT | FERRY_FILE_TRUNC);
    if (!strcmp(eng, "uring"))
        assert_true(f->slot >= 0); /* a registered (fixed) file */
    size_t n = 4 << 20;
    char *a = NULL;
    FT_ASSERT_OK(ferry_io_buffer_alloc(io, n, (void **)&a)); /* registered by the engine */
    assert_true(FERRY__IS_ALIGNED(a, 4096));
    char *b = abuf(n);
    FT_ASSERT_OK(ferry_io_register_buffer(io, b, n));
    FT_ASSERT_OK(ferry_io_register_buffer(io, b, n)); /* same range again: fine */
    ft_fill_pattern(a, n, 5);
    FT_ASSERT_OK(ferry_io_pwrite(io, f, a, n, 0));
    memset(b, 0, n);
    FT_ASSERT_OK(ferry_io_pread(io, f, b, n, 0));
    assert_int_equal(ft_check_pattern(b, n, 5), -1);
    FT_ASSERT_OK(ferry_io_unregister_buffer(io, b));
    if (!strcmp(eng, "uring"))
        assert_int_equal(ferry_io_unregister_buffer(io, b), FERRY_ENOTFOUND);
    /* after unregistering, plain I/O from the same memory still works */
    memset(b, 0, n);
    FT_ASSERT_OK(ferry_io_pread(io, f, b, n, 0));
    assert_int_equal(ft_check_pattern(b, n, 5), -1);
    assert_int_equal(ferry_io_register_buffer(io, NULL, 10), -EINVAL);
    ferry_io_buffer_free(io, a);
    FT_ASSERT_OK(ferry_file_close(f));
    ferry_io_close(io);
    free(b);
}

/* ---- registering beside the I/O (uring) ----
 * ferry/io.h lets one thread register a buffer while another drives the
 * io: the driver's requests from that buffer go the plain way until the
 * registration returned, the fixed way after; every byte is right either
 * way, and a race detector sees the table published, never torn. */
static atomic_int g_reg_delay_ms, g_reg_fail, g_reg_calls;
static int reg_hook(void *ctx, unsigned slot, void *base, size_t len)
{
    (void)ctx;
    (void)slot;
    (void)base;
    (void)len;
    atomic_fetch_add(&g_reg_calls, 1);
    int ms = atomic_load(&g_reg_delay_ms);
    struct timespec t = {0, (long)ms * 1000000};
    nanosleep(&t, NULL);
    return -atomic_load(&g_reg_fail);
}

static uint64_t vmpin_bytes(void)
{
    FILE *f = fopen("/proc/self/status", "r");
    assert_non_null(f);
    char line[256];
    unsigned long long kb = 0;
    while (fgets(line, sizeof line, f) && sscanf(line, "VmPin: %llu kB", &kb) != 1)
        ;
    fclose(f);
    return (uint64_t)kb << 10;
}

typedef struct driver_arg {
    ferry_io *io;
    ferry_file *f;
    char *buf; /* halves: written from the first, read into the second */
    size_t half;
    atomic_int stop;
    unsigned rounds, failures;
} driver_arg;

static void *io_driver(void *p)
{
    driver_arg *a = p;
    while (!atomic_load(&a->stop) || a->rounds < 4) {
        unsigned seed = 100 + a->rounds++;
        ft_fill_pattern(a->buf, a->half, seed);
        memset(a->buf + a->half, 0, a->half);
        if (ferry_io_pwrite(a->io, a->f, a->buf, a->half, 0) < 0 ||
            ferry_io_pread(a->io, a->f, a->buf + a->half, a->half, 0) < 0 ||
            ft_check_pattern(a->buf + a->half, a->half, seed) != -1)
            a->failures++;
    }
    return NULL;
}

static void register_beside_io_on_another_thread(void **state)
{
    (void)state;
    ferry_io *io = open_io("uring", 8, 256 << 10);
    ferry_file *f = open_file(io, "regthr.bin", FERRY_FILE_DIRECT | FERRY_FILE_TRUNC);
    size_t n = 8 << 20;
    char *b = abuf(n);
    memset(b, 0, n);
    static ferry__sys t;
    t = *ferry__sys_default();
    t.uring_register = reg_hook;
    ferry__sys_set(&t);
    atomic_store(&g_reg_calls, 0);
    atomic_store(&g_reg_delay_ms, 100); /* the driver's I/O runs meanwhile */
    for (int round = 0; round < 2; round++) {
        int fails = round == 1; /* the second: the engine refuses it */
        atomic_store(&g_reg_fail, fails ? ENOMEM : 0);
        uint64_t pin0 = vmpin_bytes();
        driver_arg a = {.io = io, .f = f, .buf = b, .half = n / 2};
        pthread_t th;
        assert_int_equal(pthread_create(&th, NULL, io_driver, &a), 0);
        struct timespec ms20 = {0, 20000000};
        nanosleep(&ms20, NULL);
        int rc = ferry_io_register_buffer(io, b, n);
        nanosleep(&ms20, NULL); /* more I/O, now fixed (or plain: refused) */
        atomic_store(&a.stop, 1);
        pthread_join(th, NULL);
        assert_int_equal(a.failures, 0);
        assert_true(a.rounds >= 4);
        if (fails) {
            assert_int_equal(rc, -ENOMEM);
            assert_msg_has(ferry_io_last_error(io), "registering buffer");
            assert_true(vmpin_bytes() < pin0 + n);
            assert_int_equal(ferry_io_unregister_buffer(io, b), FERRY_ENOTFOUND);
        } else {
            FT_ASSERT_OK(rc);
            assert_true(vmpin_bytes() >= pin0 + n); /* the kernel holds it */
            FT_ASSERT_OK(ferry_io_unregister_buffer(io, b));
            assert_true(vmpin_bytes() < pin0 + n);
        }
    }
    assert_int_equal(atomic_load(&g_reg_calls), 2);
    ferry__sys_set(NULL);
    FT_ASSERT_OK(ferry_file_close(f));
    ferry_io_close(io);
    free(b);
}

/* ---- bad input ---- */
static void misaligned_direct_is_ealign(void **state)
{
    ferry_io *io = open_io(engine_of(state), 4, 0);
    ferry_file *f = open_file(io, "align.bin", FERRY_FILE_DIRECT | FERRY_FILE_TRUNC);
    if (!ferry_file_is_direct(f)) {
        ferry_file_close(f);
        ferry_io_close(io);
        skip();
    }
    char *b = abuf(3 * 4096);
    assert_int_equal(ferry_io_pwrite(io, f, b + 64, 4096, 0), FERRY_EALIGN);
    assert_msg_has(ferry_io_last_error(io), path_of("align.bin"));
    assert_msg_has(ferry_io_last_error(io), "buffer");
    assert_msg_has(ferry_io_last_error(io), "at offset 0");
    assert_msg_has(ferry_last_error(), "O_DIRECT");
    assert_int_equal(ferry_io_pread(io, f, b, 4096, 100), FERRY_EALIGN);
    assert_msg_has(ferry_io_last_error(io), "at offset 100");
    assert_msg_has(ferry_io_last_error(io), "offset ");
    assert_int_equal(ferry_io_pwrite(io, f, b, 1000, 0), FERRY_EALIGN);
    assert_msg_has(ferry_io_last_error(io), "1000 bytes");
    ferry_io_req r = {.op = FERRY_IO_READ, .file = f, .buf = b + 1, .len = 4096};
    ferry_io_req *p = &r;
    assert_int_equal(ferry_io_submit(io, &p, 1), FERRY_EALIGN);
    assert_int_equal(ferry_io_inflight(io), 0);
    /* aligned works */
    FT_ASSERT_OK(ferry_io_pwrite(io, f, b, 4096, 4096));
    FT_ASSERT_OK(ferry_file_close(f));
    ferry_io_close(io);
    free(b);
}

static void read_past_eof_is_eshort(void **state)
{
    ferry_io *io = open_io(engine_of(state), 4, 0);
    ferry_file *f = open_file(io, "eof.bin", FERRY_FILE_DIRECT | FERRY_FILE_TRUNC);
    char *b = abuf(64 << 10);
    ft_fill_pattern(b, 8192, 1);
    FT_ASSERT_OK(ferry_io_pwrite(io, f, b, 8192, 0));
    /* partly past the end */
    assert_int_equal(ferry_io_pread(io, f, b, 16384, 0), FERRY_ESHORT);
    assert_msg_has(ferry_io_last_error(io), path_of("eof.bin"));
    assert_msg_has(ferry_io_last_error(io), "end of file at offset 8192");
    assert_msg_has(ferry_io_last_error(io), "request of 16384 bytes at offset 0");
    /* wholly past the end, asynchronously */
    ferry_io_req r = {.op = FERRY_IO_READ, .file = f, .buf = b, .len = 4096, .offset = 1 << 20};
    ferry_io_req *p = &r, *d = NULL;
    assert_int_equal(ferry_io_submit(io, &p, 1), 1);
    assert_int_equal(ferry_io_reap(io, &d, 1, 1, -1), 1);
    assert_int_equal(r.result, FERRY_ESHORT);
    assert_msg_has(ferry_io_last_error(io), "offset 1048576");
    /* a file whose size is not a multiple of 4096, read with O_DIRECT */
    FT_ASSERT_OK(ferry_file_truncate(f, 5000));
    assert_int_equal(ferry_io_pread(io, f, b, 8192, 0), FERRY_ESHORT);
    assert_msg_has(ferry_io_last_error(io), "end of file at offset 5000");
    FT_ASSERT_OK(ferry_io_pread(io, f, b, 4096, 0));
    assert_int_equal(ft_check_pattern(b, 4096, 1), -1);
    FT_ASSERT_OK(ferry_file_close(f));
    ferry_io_close(io);
    free(b);
}

static void zero_length_and_bad_arguments(void **state)
{
    ferry_io *io = open_io(engine_of(state), 4, 0);
    ferry_file *f = open_file(io, "zero.bin", FERRY_FILE_TRUNC);
    char b[16];
    assert_int_equal(ferry_io_pread(io, f, b, 0, 0), -EINVAL);
    assert_msg_has(ferry_io_last_error(io), "zero length");
    assert_msg_has(ferry_io_last_error(io), path_of("zero.bin"));
    assert_int_equal(ferry_io_pwrite(io, f, b, 0, 0), -EINVAL);
    ferry_io_req r = {.op = FERRY_IO_WRITE, .file = f, .buf = b, .len = 0};
    ferry_io_req *p = &r;
    assert_int_equal(ferry_io_submit(io, &p, 1), -EINVAL);
    r.len = 16;
    r.op = 7;
    assert_int_equal(ferry_io_submit(io, &p, 1), -EINVAL);
    r.op = FERRY_IO_WRITE;
    r.offset = UINT64_MAX - 4;
    assert_int_equal(ferry_io_submit(io, &p, 1), -EINVAL);
    assert_int_equal(ferry_io_pread(io, NULL, b, 16, 0), -EINVAL);
    assert_int_equal(ferry_io_pread(io, f, NULL, 16, 0), -EINVAL);
    ferry_io_req *d[1];
    assert_int_equal(ferry_io_reap(io, d, 2, 1, 0), -EINVAL);
    assert_int_equal(ferry_io_reap(io, d, 0, 1, 0), 0);
    assert_int_equal(ferry_io_inflight(io), 0);
    /* device memory needs cufile in async requests */
    ferry_io_req rd = {.op = FERRY_IO_READ, .file = f, .dev = 0x1000, .len = 16};
    p = &rd;
    assert_int_equal(ferry_io_submit(io, &p, 1), FERRY_ENOTSUP);
    assert_msg_has(ferry_io_last_error(io), "device memory");
    /* read-only file refuses writes with a message */
    ferry_file *ro = NULL;
    FT_ASSERT_OK(ferry_file_open(io, path_of("zero.bin"), FERRY_FILE_READ, &ro));
    assert_int_equal(ferry_io_pwrite(io, ro, b, 16, 0), -EBADF);
    assert_msg_has(ferry_io_last_error(io), "not opened for writing");
    FT_ASSERT_OK(ferry_file_close(ro));
    assert_int_equal(ferry_file_open(io, path_of("x"), 0, &ro), -EINVAL);
    assert_int_equal(ferry_file_close(NULL), 0);
    FT_ASSERT_OK(ferry_file_close(f));
    ferry_io_close(io);
    ferry_io_close(NULL);
}

/* one option spoiled: -EINVAL naming the field, out untouched */
static void expect_open_refused(const ferry_io_options *o, const char *field)
{
    ferry_io *io = (ferry_io *)0x1;
    assert_int_equal(ferry_io_open(o, &io), -EINVAL);
    assert_ptr_equal(io, (ferry_io *)0x1);
    assert_msg_has(ferry_last_error(), field);
}

/* an older header's options (a prefix) open with the defaults past it; a
 * size below the minimum (the size field) or inside a member is refused */
static void older_options_prefix_is_accepted(void **state)
{
    (void)state;
    ferry_io_options o = FERRY_IO_OPTIONS_INIT;
    o.engine = "posix";
    o.depth = 3;
    o.bounce_bytes = SIZE_MAX; /* past the prefix: not read (else refused) */
    o.size = offsetof(ferry_io_options, bounce_bytes);
    ferry_io *io = NULL;
    FT_ASSERT_OK(ferry_io_open(&o, &io));
    assert_int_equal(ferry_io_depth(io), 3);
    ferry_io_close(io);
    o.size = FERRY_IO_OPTIONS_MIN_SIZE; /* the size field alone: every default */
    FT_ASSERT_OK(ferry_io_open(&o, &io));
    assert_int_equal(ferry_io_depth(io), 8);
    ferry_io_close(io);
    o.size = FERRY_IO_OPTIONS_MIN_SIZE - 1;
    expect_open_refused(&o, "FERRY_IO_OPTIONS_MIN_SIZE");
    o.size = offsetof(ferry_io_options, depth) + 2;
    expect_open_refused(&o, "inside depth");
}

static void open_range_checks_every_option(void **state)
{
    (void)state;
    static const size_t huge[] = {FERRY_IO_REQUEST_MAX + 1, (size_t)1 << 32, (size_t)1 << 63,
                                  SIZE_MAX};
    for (int forced = 0; forced < 2; forced++) {
        /* explicit engine, and "auto" forced through the environment: the
         * ranges hold on every path to an engine */
        if (forced)
            setenv("FERRY_IO_ENGINE", "posix", 1);
        ferry_io_options o = FERRY_IO_OPTIONS_INIT;
        o.engine = forced ? NULL : "posix";
        o.depth = FERRY_IO_DEPTH_MAX + 1;
        expect_open_refused(&o, "depth 4097");
        assert_msg_has(ferry_last_error(), "1..4096");
        o.depth = UINT_MAX;
        expect_open_refused(&o, "depth");
        o.depth = 0;
        for (size_t i = 0; i < FERRY__ARRAY_LEN(huge); i++) {
            o.max_request = huge[i];
            expect_open_refused(&o, "max_request");
            o.max_request = 0;
            o.bounce_bytes = huge[i];
            expect_open_refused(&o, "bounce_bytes");
            o.bounce_bytes = 0;
        }
        unsetenv("FERRY_IO_ENGINE");
    }
    ferry_io_options o = FERRY_IO_OPTIONS_INIT;
    o.engine = "nvme";
    expect_open_refused(&o, "engine 'nvme'");
    o.engine = "posix";
    o.size = 1;
    expect_open_refused(&o, "options size 1");
    o.size = sizeof o + 1;
    expect_open_refused(&o, "options size");

    /* the edges of each range open, and keep their documented rounding */
    o = (ferry_io_options)FERRY_IO_OPTIONS_INIT;
    o.engine = "posix";
    o.depth = 1;
    o.max_request = FERRY_IO_REQUEST_MAX;
    o.bounce_bytes = FERRY_IO_BOUNCE_MAX;
    ferry_io *io = NULL;
    FT_ASSERT_OK(ferry_io_open(&o, &io));
    assert_int_equal(ferry_io_depth(io), 1);
    assert_int_equal(ferry_io_max_request(io), FERRY_IO_REQUEST_MAX);
    ferry_io_close(io);
    o.max_request = 1;
    o.bounce_bytes = 1;
    FT_ASSERT_OK(ferry_io_open(&o, &io));
    assert_int_equal(ferry_io_max_request(io), FERRY_IO_ALIGN);
    ferry_io_close(io);
    o.max_request = FERRY_IO_ALIGN + 1;
    FT_ASSERT_OK(ferry_io_open(&o, &io));
    assert_int_equal(ferry_io_max_request(io), FERRY_IO_ALIGN);

    /* sizes and counts of the other calls: refused, never wrapped */
    char b[16];
    uintptr_t end = UINTPTR_MAX - 15;
    assert_int_equal(ferry_io_register_buffer(io, b, SIZE_MAX), -EINVAL);
    assert_msg_has(ferry_io_last_error(io), "wraps");
    assert_int_equal(ferry_io_register_buffer(io, (void *)end, 32), -EINVAL);
    assert_int_equal(ferry_io_register_dev(io, (ferry_devptr)1 << 63, SIZE_MAX), -EINVAL);
    assert_msg_has(ferry_io_last_error(io), "wraps");
    void *buf = (void *)0x1;
    assert_int_equal(ferry_io_buffer_alloc(io, SIZE_MAX, &buf), -EINVAL);
    assert_int_equal(ferry_io_buffer_alloc(io, SIZE_MAX - FERRY_IO_ALIGN + 2, &buf), -EINVAL);
    assert_ptr_equal(buf, (void *)0x1);
    ferry_io_req *none[1] = {NULL};
    assert_int_equal(ferry_io_submit(io, none, (unsigned)INT_MAX + 1), -EINVAL);
    assert_msg_has(ferry_io_last_error(io), "n 2147483648");
    ferry_io_req *d[1];
    assert_int_equal(ferry_io_reap(io, d, 0, UINT_MAX, 0), 0);
    assert_int_equal(ferry_io_reap(io, d, 0, 1, INT_MIN), 0);
    ferry_io_close(io);
}

static void missing_and_unwritable_directories(void **state)
{
    ferry_io *io = open_io(engine_of(state), 2, 0);
    ferry_file *f = (ferry_file *)0x1;
    char p[600];
    snprintf(p, sizeof p, "%s/no/such/dir/f.bin", g_dir);
    assert_int_equal(ferry_file_open(io, p, FERRY_FILE_WRITE | FERRY_FILE_CREATE, &f), -ENOENT);
    assert_ptr_equal(f, (ferry_file *)0x1);
    assert_msg_has(ferry_io_last_error(io), p);
    assert_msg_has(ferry_io_last_error(io), "ENOENT");
    /* unwritable: through permissions when not root, through the seam always */
    if (geteuid() != 0) {
        char ro[400];
        snprintf(ro, sizeof ro, "%s/ro", g_dir);
        assert_int_equal(mkdir(ro, 0500), 0);
        snprintf(p, sizeof p, "%s/f.bin", ro);
        assert_int_equal(ferry_file_open(io, p, FERRY_FILE_WRITE | FERRY_FILE_CREATE, &f),
                         -EACCES);
        assert_msg_has(ferry_io_last_error(io), p);
        chmod(ro, 0700);
    }
    faults_install();
    fault_at(F_OPEN, 1, EACCES, 0);
    snprintf(p, sizeof p, "%s/denied.bin", g_dir);
    assert_int_equal(ferry_file_open(io, p, FERRY_FILE_WRITE | FERRY_FILE_CREATE, &f), -EACCES);
    assert_msg_has(ferry_io_last_error(io), p);
    assert_msg_has(ferry_io_last_error(io), "EACCES");
    /* the cause fixed, the same call works */
    FT_ASSERT_OK(ferry_file_open(io, p, FERRY_FILE_WRITE | FERRY_FILE_CREATE, &f));
    FT_ASSERT_OK(ferry_file_close(f));
    ferry__sys_set(NULL);
    /* a directory opens for reading (and O_DIRECT falls back on it), and
     * its reads fail later: refused at the open, naming it */
    for (unsigned extra = 0; extra <= FERRY_FILE_DIRECT; extra += FERRY_FILE_DIRECT) {
        f = (ferry_file *)0x1;
        assert_int_equal(ferry_file_open(io, g_dir, FERRY_FILE_READ | extra, &f), -EISDIR);
        assert_ptr_equal(f, (ferry_file *)0x1);
        assert_msg_has(ferry_io_last_error(io), g_dir);
        assert_msg_has(ferry_io_last_error(io), "a directory");
    }
    char why[256];
    assert_int_equal(ferry_io_direct_probe(path_of("no/such"), why, sizeof why), -ENOENT);
    assert_msg_has(why, "no/such");
    assert_int_equal(ferry_io_engine_probe("posix", path_of("no/such"), why, sizeof why),
                     -ENOENT);
    ferry_io_close(io);
}

/* ---- faults ---- */
static void enospc_and_eio_then_retry(void **state)
{
    const char *eng = engine_of(state);
    faults_install();
    ferry_io *io = open_io(eng, 4, 0);
    ferry_file *f = open_file(io, "fault.bin", FERRY_FILE_DIRECT | FERRY_FILE_TRUNC);
    size_t n = 2 << 20; /* 4 pieces of 512 KiB at depth 4 */
    char *src = abuf(n), *dst = abuf(n);
    ft_fill_pattern(src, n, 9);

    fault_at(F_PWRITE, 3, ENOSPC, 0);
    assert_int_equal(ferry_io_pwrite(io, f, src, n, 0), -ENOSPC);
    const char *m = ferry_io_last_error(io);
    assert_msg_has(m, path_of("fault.bin"));
    assert_msg_has(m, "write of");
    assert_msg_has(m, "at offset");
    assert_msg_has(m, "ENOSPC");
    assert_msg_has(m, "request of 2097152 bytes at offset 0");
    assert_int_equal(ferry_io_inflight(io), 0);
    faults_reset(); /* space freed: the retry works */
    FT_ASSERT_OK(ferry_io_pwrite(io, f, src, n, 0));

    fault_at(F_PREAD, 2, EIO, 0);
    assert_int_equal(ferry_io_pread(io, f, dst, n, 0), -EIO);
    assert_msg_has(ferry_io_last_error(io), "read of");
    assert_msg_has(ferry_io_last_error(io), "EIO");
    faults_reset();
    memset(dst, 0, n);
    FT_ASSERT_OK(ferry_io_pread(io, f, dst, n, 0));
    assert_int_equal(ft_check_pattern(dst, n, 9), -1);

    /* asynchronous: the failed request reports, the others complete */
    fault_at(F_PREAD, 1, EIO, 0);
    ferry_io_req r[4], *p[4], *d[4];
    for (int i = 0; i < 4; i++) {
        r[i] = (ferry_io_req){.op = FERRY_IO_READ, .file = f, .buf = dst + (size_t)i * 4096,
                              .len = 4096, .offset = (uint64_t)i * 4096};
        p[i] = &r[i];
    }
    assert_int_equal(ferry_io_submit(io, p, 4), 4);
    int got = 0;
    while (got < 4)
        got += ferry_io_reap(io, d + got, 1, 4 - (unsigned)got, -1);
    int failed = 0;
    for (int i = 0; i < 4; i++) {
        if (r[i].result == -EIO)
            failed++;
        else
            assert_int_equal(r[i].result, 4096);
    }
    assert_int_equal(failed, 1);
    faults_reset();
    FT_ASSERT_OK(ferry_file_close(f));
    ferry_io_close(io);
    ferry__sys_set(NULL);
    free(src);
    free(dst);
}

static void short_eintr_eagain_are_transparent(void **state)
{
    const char *eng = engine_of(state);
    faults_install();
    ferry_io *io = open_io(eng, 4, 0);
    ferry_file *f = open_file(io, "short.bin", FERRY_FILE_DIRECT | FERRY_FILE_TRUNC);
    size_t n = 4 << 20;
    char *src = abuf(n), *dst = abuf(n);
    ft_fill_pattern(src, n, 13);
    faults_reset();
    g_f.short_every = 2;
    g_f.eintr_every = 3;
    g_f.err_every = EINTR;
    FT_ASSERT_OK(ferry_io_pwrite(io, f, src, n, 0));
    assert_true(atomic_load(&g_f.shorts) > 0);
    assert_true(atomic_load(&g_f.intrs) > 0);
    g_f.err_every = EAGAIN;
    unsigned before = atomic_load(&g_f.intrs);
    memset(dst, 0, n);
    FT_ASSERT_OK(ferry_io_pread(io, f, dst, n, 0));
    assert_true(atomic_load(&g_f.intrs) > before);
    assert_int_equal(ft_check_pattern(dst, n, 13), -1);
    faults_reset();
    memset(dst, 0, n);
    FT_ASSERT_OK(ferry_io_pread(io, f, dst, n, 0));
    assert_int_equal(ft_check_pattern(dst, n, 13), -1);
    FT_ASSERT_OK(ferry_file_close(f));
    ferry_io_close(io);
    ferry__sys_set(NULL);
    free(src);
    free(dst);
}

static void file_calls_report_faults(void **state)
{
    faults_install();
    ferry_io *io = open_io(engine_of(state), 2, 0);
    ferry_file *f = open_file(io, "alloc.bin", FERRY_FILE_TRUNC);
    fault_at(F_FALLOCATE, 1, ENOSPC, 0);
    assert_int_equal(ferry_file_allocate(f, 0, 1 << 20), -ENOSPC);
    assert_msg_has(ferry_io_last_error(io), path_of("alloc.bin"));
    assert_msg_has(ferry_io_last_error(io), "1048576 bytes at offset 0");
    faults_reset();
    FT_ASSERT_OK(ferry_file_allocate(f, 0, 1 << 20));
    uint64_t sz = 0;
    FT_ASSERT_OK(ferry_file_size(f, &sz));
    assert_int_equal(sz, 1 << 20);
    FT_ASSERT_OK(ferry_file_truncate(f, 8192));
    FT_ASSERT_OK(ferry_file_size(f, &sz));
    assert_int_equal(sz, 8192);
    fault_at(F_FDATASYNC, 1, EIO, 0);
    assert_int_equal(ferry_file_sync(f), -EIO);
    assert_msg_has(ferry_io_last_error(io), "fdatasync");
    faults_reset();
    FT_ASSERT_OK(ferry_file_sync(f));
    FT_ASSERT_OK(ferry_file_drop_cache(f));
    assert_int_equal(ferry_file_allocate(f, 0, 0), -EINVAL);
    FT_ASSERT_OK(ferry_file_close(f));
    ferry_io_close(io);
    ferry__sys_set(NULL);
}

/* ---- O_DIRECT fallback ---- */
static void direct_fallback_with_reason(void **state)
{
    const char *eng = engine_of(state);
    faults_install();
    faults_reset();
    g_f.direct_einval = 1; /* a file system that refuses O_DIRECT */
    ferry_io *io = open_io(eng, 2, 0);
    ferry_file *f = open_file(io, "fb.bin", FERRY_FILE_DIRECT | FERRY_FILE_TRUNC);
    assert_false(ferry_file_is_direct(f));
    assert_non_null(ferry_file_fallback_reason(f));
    assert_msg_has(ferry_file_fallback_reason(f), "O_DIRECT refused");
    char b[5000];
    ft_fill_pattern(b, sizeof b, 2);
    FT_ASSERT_OK(ferry_io_pwrite(io, f, b + 1, 4999, 3)); /* buffered: any alignment */
    memset(b, 0, sizeof b);
    FT_ASSERT_OK(ferry_io_pread(io, f, b + 1, 4999, 3));
    assert_int_equal(ft_check_pattern(b + 1, 4999, 2 + 1), -1);
    FT_ASSERT_OK(ferry_file_drop_cache(f));
    FT_ASSERT_OK(ferry_file_close(f));
    ferry_file *g = (ferry_file *)0x1;
    assert_int_equal(ferry_file_open(io, path_of("fb.bin"),
                                     FERRY_FILE_READ | FERRY_FILE_REQUIRE_DIRECT, &g),
                     -EINVAL);
    assert_ptr_equal(g, (ferry_file *)0x1);
    assert_msg_has(ferry_io_last_error(io), "REQUIRE_DIRECT");
    faults_reset();
    ferry__sys_set(NULL);
    /* a real tmpfs: either it takes O_DIRECT (Linux >= 6.6) or we fall back
     * with a reason; both ways the I/O works */
    char shm[] = "/dev/shm/ferry-test-XXXXXX";
    if (mkdtemp(shm)) {
        char p[128];
        snprintf(p, sizeof p, "%s/t.bin", shm);
        ferry_file *t = NULL;
        FT_ASSERT_OK(ferry_file_open(io, p,
                                     FERRY_FILE_READ | FERRY_FILE_WRITE | FERRY_FILE_CREATE |
                                         FERRY_FILE_DIRECT, &t));
        char why[256];
        int probe = ferry_io_direct_probe(shm, why, sizeof why);
        if (ferry_file_is_direct(t)) {
            assert_null(ferry_file_fallback_reason(t));
            assert_int_equal(probe, 0);
        } else {
            assert_non_null(ferry_file_fallback_reason(t));
            assert_int_equal(probe, -EINVAL);
            assert_msg_has(why, "O_DIRECT refused");
        }
        char *x = abuf(4096);
        ft_fill_pattern(x, 4096, 4);
        FT_ASSERT_OK(ferry_io_pwrite(io, t, x, 4096, 0));
        memset(x, 0, 4096);
        FT_ASSERT_OK(ferry_io_pread(io, t, x, 4096, 0));
        assert_int_equal(ft_check_pattern(x, 4096, 4), -1);
        free(x);
        FT_ASSERT_OK(ferry_file_close(t));
        unlink(p);
        rmdir(shm);
    }
    ferry_io_close(io);
}

/* ---- out of memory at every allocation of open and submit ---- */
typedef struct oom_io_ctx {
    const char *eng;
    char *b;
} oom_io_ctx;

/* open, write 1 MiB asynchronously, read it back; close whatever opened */
static int oom_io_run(void *ctx)
{
    oom_io_ctx *c = ctx;
    ferry_io_options o = FERRY_IO_OPTIONS_INIT;
    o.engine = c->eng;
    o.depth = 4;
    ferry_io *io = NULL;
    ferry_file *f = NULL;
    int rc = ferry_io_open(&o, &io);
    if (rc == 0)
        rc = ferry_file_open(io, path_of("oom.bin"),
                             FERRY_FILE_READ | FERRY_FILE_WRITE | FERRY_FILE_CREATE |
                                 FERRY_FILE_DIRECT, &f);
    if (rc == 0) {
        ferry_io_req r = {.op = FERRY_IO_WRITE, .file = f, .buf = c->b, .len = 1 << 20};
        ferry_io_req *p = &r, *d = NULL;
        rc = ferry_io_submit(io, &p, 1);
        if (rc == 1) {
            assert_int_equal(ferry_io_reap(io, &d, 1, 1, -1), 1);
            assert_int_equal(r.result, 1 << 20);
            rc = ferry_io_pread(io, f, c->b, 1 << 20, 0);
        }
    }
    if (rc < 0)
        assert_true(strlen(ferry_last_error()) > 0);
    ferry_file_close(f);
    ferry_io_close(io);
    return rc < 0 ? rc : 0;
}

static void oom_everywhere_without_leaks(void **state)
{
    oom_io_ctx c = {engine_of(state), abuf(1 << 20)};
    char *b = c.b;
    ft_fill_pattern(b, 1 << 20, 6);
    ft_oom_each(200, FT_OOM_STICKY, oom_io_run, &c);
    assert_int_equal(ft_check_pattern(b, 1 << 20, 6), -1);
    free(b);
}

/* ---- async odds and ends ---- */
static void sync_helper_leaves_async_completions(void **state)
{
    ferry_io *io = open_io(engine_of(state), 4, 0);
    ferry_file *f = open_file(io, "mix.bin", FERRY_FILE_DIRECT | FERRY_FILE_TRUNC);
    char *b = abuf(1 << 20), *c = abuf(1 << 20);
    ft_fill_pattern(b, 1 << 20, 8);
    ferry_io_req r = {.op = FERRY_IO_WRITE, .file = f, .buf = b, .len = 1 << 20, .offset = 0};
    ferry_io_req *p = &r, *d[2] = {NULL, NULL};
    assert_int_equal(ferry_io_submit(io, &p, 1), 1);
    FT_ASSERT_OK(ferry_io_pwrite(io, f, b, 1 << 20, 1 << 20));
    assert_int_equal(ferry_io_inflight(io), 1);
    assert_int_equal(ferry_io_reap(io, d, 1, 2, -1), 1);
    assert_ptr_equal(d[0], &r);
    assert_int_equal(r.result, 1 << 20);
    FT_ASSERT_OK(ferry_io_pread(io, f, c, 1 << 20, 1 << 20));
    assert_int_equal(ft_check_pattern(c, 1 << 20, 8), -1);
    /* a timed reap with nothing in flight returns 0 at once */
    assert_int_equal(ferry_io_reap(io, d, 1, 2, 10), 0);
    FT_ASSERT_OK(ferry_file_close(f));
    ferry_io_close(io);
    free(b);
    free(c);
}

/* a pread that blocks until the test lets it go (posix only: uring's I/O
 * runs in the kernel) */
/* A request is the engine's from submit until reaped: submitting it again
 * meanwhile (in flight, or done and not yet reaped, or twice in one call)
 * is FERRY_EBUSY naming it, and it still completes exactly once; where it
 * was queued anyway, the in-flight count reached 2 for one completion and
 * a caller waiting for both hung. A copy of a request in flight (its
 * private words included) is a different request and is taken. */
static void resubmit_in_flight_is_ebusy(void **state)
{
    const char *eng = engine_of(state);
    ferry_io *io = open_io(eng, 4, 0);
    ferry_file *f = open_file(io, "busy.bin", FERRY_FILE_TRUNC);
    char *b = abuf(8192);
    memset(b, 3, 8192);
    ferry_io_req r = {.op = FERRY_IO_WRITE, .file = f, .buf = b, .len = 4096};
    ferry_io_req *p[2] = {&r, &r}, *d[4] = {NULL};
    assert_int_equal(ferry_io_submit(io, p, 1), 1);
    assert_int_equal(ferry_io_submit(io, p, 1), FERRY_EBUSY);
    char want[64];
    snprintf(want, sizeof want, "request %p", (void *)&r);
    assert_msg_has(ferry_io_last_error(io), want);
    assert_msg_has(ferry_io_last_error(io), "already in flight");
    assert_int_equal(ferry_io_inflight(io), 1);
    ferry_io_req copy = r; /* the private words of one in flight */
    copy.buf = b + 4096;
    copy.offset = 4096;
    ferry_io_req *cp = &copy;
    assert_int_equal(ferry_io_submit(io, &cp, 1), 1);
    assert_int_equal(ferry_io_reap(io, d, 2, 4, -1), 2);
    assert_int_equal(ferry_io_inflight(io), 0);
    assert_int_equal(r.result, 4096);
    assert_int_equal(copy.result, 4096);
    /* done but not reaped is still the engine's */
    assert_int_equal(ferry_io_submit(io, p, 1), 1);
    while (r.result == 0) /* a synchronous call completes it, leaving it for reap */
        FT_ASSERT_OK(ferry_io_pwrite(io, f, b + 4096, 4096, 8192));
    assert_int_equal(ferry_io_submit(io, p, 1), FERRY_EBUSY);
    assert_int_equal(ferry_io_reap(io, d, 1, 4, -1), 1);
    /* the same request twice in one call: the first is queued */
    assert_int_equal(ferry_io_submit(io, p, 2), 1);
    assert_msg_has(ferry_io_last_error(io), "already in flight");
    assert_int_equal(ferry_io_inflight(io), 1);
    assert_int_equal(ferry_io_reap(io, d, 1, 4, -1), 1);
    assert_ptr_equal(d[0], &r);
    assert_int_equal(ferry_io_reap(io, d, 1, 4, 50), 0); /* nothing more comes */
    assert_int_equal(ferry_io_inflight(io), 0);
    /* reaped: it is the caller's again */
    assert_int_equal(ferry_io_submit(io, p, 1), 1);
    assert_int_equal(ferry_io_reap(io, d, 1, 4, -1), 1);
    FT_ASSERT_OK(ferry_file_close(f));
    ferry_io_close(io);
    free(b);
}

static pthread_mutex_t g_gate_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_gate_cv = PTHREAD_COND_INITIALIZER;
static int g_gate_open;
static ssize_t gated_pread(int fd, void *b, size_t n, off_t o)
{
    pthread_mutex_lock(&g_gate_mu);
    while (!g_gate_open)
        pthread_cond_wait(&g_gate_cv, &g_gate_mu);
    pthread_mutex_unlock(&g_gate_mu);
    return ferry__sys_default()->pread(fd, b, n, o);
}

static void reap_timeout_returns_zero_then_completes(void **state)
{
    (void)state;
    ferry_io *io = open_io("posix", 2, 0);
    ferry_file *f = open_file(io, "gate.bin", FERRY_FILE_TRUNC);
    char b[4096];
    memset(b, 1, sizeof b);
    FT_ASSERT_OK(ferry_io_pwrite(io, f, b, sizeof b, 0));
    static ferry__sys gate;
    gate = *ferry__sys_default();
    gate.pread = gated_pread;
    g_gate_open = 0;
    ferry__sys_set(&gate);
    ferry_io_req r = {.op = FERRY_IO_READ, .file = f, .buf = b, .len = sizeof b};
    ferry_io_req *p = &r, *d = NULL;
    assert_int_equal(ferry_io_submit(io, &p, 1), 1);
    assert_int_equal(ferry_io_reap(io, &d, 1, 1, 0), 0);  /* poll */
    assert_int_equal(ferry_io_reap(io, &d, 1, 1, 20), 0); /* timed out */
    assert_int_equal(ferry_io_inflight(io), 1);
    pthread_mutex_lock(&g_gate_mu);
    g_gate_open = 1;
    pthread_cond_broadcast(&g_gate_cv);
    pthread_mutex_unlock(&g_gate_mu);
    assert_int_equal(ferry_io_reap(io, &d, 1, 1, -1), 1);
    assert_ptr_equal(d, &r);
    assert_int_equal(r.result, 4096);
    ferry__sys_set(NULL);
    FT_ASSERT_OK(ferry_file_close(f));
    ferry_io_close(io);
}

/* independent engines driven from several threads at once (TSan) */
typedef struct worker_arg {
    const char *engine;
    int id;
    int failures;
} worker_arg;
static void *engine_worker(void *argp)
{
    worker_arg *a = argp;
    ferry_io_options o = FERRY_IO_OPTIONS_INIT;
    o.engine = a->engine;
    o.depth = 4;
    ferry_io *io = NULL;
    if (ferry_io_open(&o, &io) < 0) {
        a->failures++;
        return NULL;
    }
    char name[64];
    snprintf(name, sizeof name, "thread-%d.bin", a->id);
    ferry_file *f = NULL;
    char p[600];
    snprintf(p, sizeof p, "%s/%s", g_dir, name);
    size_t n = 1 << 20;
    char *src = NULL, *dst = NULL;
    if (ferry_file_open(io, p, FERRY_FILE_READ | FERRY_FILE_WRITE | FERRY_FILE_CREATE |
                                   FERRY_FILE_DIRECT, &f) < 0 ||
        ferry_io_buffer_alloc(io, n, (void **)&src) < 0 ||
        ferry_io_buffer_alloc(io, n, (void **)&dst) < 0)
        a->failures++;
    for (int round = 0; round < 8 && !a->failures; round++) {
        ft_fill_pattern(src, n, (unsigned)(a->id * 10 + round));
        if (ferry_io_pwrite(io, f, src, n, (uint64_t)round * n) < 0 ||
            ferry_io_pread(io, f, dst, n, (uint64_t)round * n) < 0 ||
            ft_check_pattern(dst, n, (unsigned)(a->id * 10 + round)) != -1)
            a->failures++;
    }
    ferry_io_buffer_free(io, src);
    ferry_io_buffer_free(io, dst);
    ferry_file_close(f);
    ferry_io_close(io);
    return NULL;
}

static void engines_on_several_threads(void **state)
{
    (void)state;
    enum { T = 4 };
    pthread_t th[T];
    worker_arg args[T];
    for (int i = 0; i < T; i++) {
        args[i] = (worker_arg){i % 2 ? "uring" : "posix", i, 0};
        assert_int_equal(pthread_create(&th[i], NULL, engine_worker, &args[i]), 0);
    }
    for (int i = 0; i < T; i++) {
        pthread_join(th[i], NULL);
        assert_int_equal(args[i].failures, 0);
    }
}

/* ---- selection and probes (engine-independent) ---- */
static void selection_env_and_reasons(void **state)
{
    (void)state;
    ferry_io *io = NULL;
    unsetenv("FERRY_IO_ENGINE");
    FT_ASSERT_OK(ferry_io_open(NULL, &io));
    char why[256];
    if (ferry_io_engine_probe("uring", NULL, why, sizeof why) == 0) {
        assert_string_equal(ferry_io_engine(io), "uring");
        assert_msg_has(ferry_io_reason(io), "io_uring works");
    } else
        assert_string_equal(ferry_io_engine(io), "posix");
    assert_msg_has(ferry_io_reason(io), "cufile not tried: no device given");
    assert_int_equal(ferry_io_depth(io), 8);
    ferry_io_close(io);

    setenv("FERRY_IO_ENGINE", "posix", 1);
    FT_ASSERT_OK(ferry_io_open(NULL, &io));
    assert_string_equal(ferry_io_engine(io), "posix");
    assert_msg_has(ferry_io_reason(io), "FERRY_IO_ENGINE=posix");
    ferry_io_close(io);
    /* an explicit name is not overridden */
    ferry_io_options o = FERRY_IO_OPTIONS_INIT;
    o.engine = "uring";
    if (ferry_io_engine_probe("uring", NULL, why, sizeof why) == 0) {
        FT_ASSERT_OK(ferry_io_open(&o, &io));
        assert_string_equal(ferry_io_engine(io), "uring");
        assert_msg_has(ferry_io_reason(io), "chosen by the caller");
        ferry_io_close(io);
    }
    setenv("FERRY_IO_ENGINE", "warp", 1);
    assert_int_equal(ferry_io_open(NULL, &io), -EINVAL);
    assert_msg_has(ferry_last_error(), "FERRY_IO_ENGINE=warp");
    unsetenv("FERRY_IO_ENGINE");
    o.engine = "warp";
    assert_int_equal(ferry_io_open(&o, &io), -EINVAL);
    o.engine = "cufile"; /* no device, and no libcufile here */
    io = (ferry_io *)0x1;
    assert_int_equal(ferry_io_open(&o, &io), FERRY_ENODEV);
    assert_ptr_equal(io, (ferry_io *)0x1);
    o.engine = NULL;
    o.size = 3;
    assert_int_equal(ferry_io_open(&o, &io), -EINVAL);
}

static void probes_really_try(void **state)
{
    (void)state;
    char why[512];
    assert_int_equal(ferry_io_direct_probe(g_dir, why, sizeof why), 0);
    assert_msg_has(why, "O_DIRECT works");
    assert_int_equal(ferry_io_engine_probe("posix", g_dir, why, sizeof why), 0);
    int u = ferry_io_engine_probe("uring", g_dir, why, sizeof why);
    assert_true(u == 0 || u == FERRY_ENODEV);
    assert_msg_has(why, "io_uring");
    int c = ferry_io_engine_probe("cufile", NULL, why, sizeof why);
    if (c != 0)
        assert_true(strstr(why, "libcufile") || strstr(why, "cuFile"));
    assert_int_equal(ferry_io_engine_probe("warp", NULL, why, sizeof why), -EINVAL);
    assert_int_equal(ferry_io_engine_probe(NULL, NULL, NULL, 0), -EINVAL);
    /* the probe leaves nothing behind */
    char cmd[600];
    snprintf(cmd, sizeof cmd, "ls -A %s | grep -q ferry-direct-probe", g_dir);
    assert_int_not_equal(system(cmd), 0);
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
    ft_rmtree(g_dir);
    return 0;
}

#define PER_ENGINE(fn)                                                                  \
    cmocka_unit_test_prestate(fn, "posix"), cmocka_unit_test_prestate(fn, "uring")

int main(void)
{
    const struct CMUnitTest tests[] = {
        PER_ENGINE(roundtrip_many_in_flight),
        PER_ENGINE(split_at_max_request),
        PER_ENGINE(registered_buffers_round_trip),
        PER_ENGINE(misaligned_direct_is_ealign),
        PER_ENGINE(read_past_eof_is_eshort),
        PER_ENGINE(zero_length_and_bad_arguments),
        PER_ENGINE(missing_and_unwritable_directories),
        PER_ENGINE(enospc_and_eio_then_retry),
        PER_ENGINE(short_eintr_eagain_are_transparent),
        PER_ENGINE(file_calls_report_faults),
        PER_ENGINE(direct_fallback_with_reason),
        PER_ENGINE(oom_everywhere_without_leaks),
        PER_ENGINE(sync_helper_leaves_async_completions),
        PER_ENGINE(resubmit_in_flight_is_ebusy),
        cmocka_unit_test(older_options_prefix_is_accepted),
        cmocka_unit_test(open_range_checks_every_option),
        cmocka_unit_test(reap_timeout_returns_zero_then_completes),
        cmocka_unit_test(engines_on_several_threads),
        cmocka_unit_test(register_beside_io_on_another_thread),
        cmocka_unit_test(selection_env_and_reasons),
        cmocka_unit_test(probes_really_try),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
