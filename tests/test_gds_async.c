/*
 * test_gds_async.c - the GDS context's asynchronous host engine
 * (ferry_gds_submit/reap) and its other thread-safety promises (ferry/gds.h),
 * under races and misuse, on the cpu driver over the posix and uring
 * engines (no GPU, no cuFile: a host request never reaches a GDS driver):
 *   - threads racing to submit one fresh request, to one context or two:
 *     exactly one takes it, every other gets FERRY_EBUSY, it comes back once;
 *   - a request in flight on one context submitted to another: FERRY_EBUSY
 *     naming the other context, taken once reaped there;
 *   - close with requests unreaped on drives failing every I/O, and on a
 *     drive whose queue broke (its completions never delivered): every
 *     block freed, every request submittable again;
 *   - close on a drive whose queue broke with I/O still in its engine: the
 *     I/O finishes before the slab files close;
 *   - a synchronous read whose reap fails: it returns only once its
 *     requests are back from the engine, nothing lands after;
 *   - threads allocating buffers, transferring and asking the accessors
 *     while another thread turns the context on (a TSan build checks the
 *     reads of its state);
 *   - several submitters and several reapers at once: each request comes
 *     back exactly once, to some reaper, with its bytes in place.
 * Run it in the TSan and ASan builds too (docs: the sanitizer builds).
 */
/* ferry-test-labels: concurrent */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core.h"
#include "ferry_test.h"
#include "gds/gds_impl.h"
#include "io/sys.h"

#define MiB (1u << 20)

/* ASan builds: a returned frame's memory stays poisoned for a while, so a
 * request an engine still holds in a frame that returned is reported
 * (stack-use-after-return); other builds never call this */
const char *__asan_default_options(void);
const char *__asan_default_options(void)
{
    return "detect_stack_use_after_return=1";
}

static char g_dir[4][256];
static const char *g_dirs[4];

static int setup(void **state)
{
    (void)state;
    for (int i = 0; i < 4; i++) {
        ft_tmpdir(g_dir[i], sizeof g_dir[i]);
        g_dirs[i] = g_dir[i];
    }
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    ferry__sys_set(NULL);
    for (int i = 0; i < 4; i++)
        ft_rmtree(g_dir[i]);
    return 0;
}

/* a context on the cpu driver over dirs [first, first + ndirs) */
static ferry_gds_config config(unsigned first, unsigned ndirs, const char *engine)
{
    ferry_gds_config c = FERRY_GDS_CONFIG_INIT;
    c.dirs = g_dirs + first;
    c.n_dirs = ndirs;
    c.bytes = 64 * MiB;
    c.driver = "cpu";
    c.engine = engine;
    return c;
}

/* ---- a drive failing every I/O ---- */
static ssize_t eio_pwrite(int fd, const void *b, size_t n, off_t o)
{
    (void)fd, (void)b, (void)n, (void)o;
    errno = EIO;
    return -1;
}

static ssize_t eio_pread(int fd, void *b, size_t n, off_t o)
{
    (void)fd, (void)b, (void)n, (void)o;
    errno = EIO;
    return -1;
}

static int eio_uring(void *ctx, int op, int fd, uint64_t off, size_t len, int res)
{
    (void)ctx, (void)op, (void)fd, (void)off, (void)len, (void)res;
    return -EIO;
}

/* ---- racing submitters ---- */
enum { RACERS = 8, ROUNDS = 400 };

typedef struct race {
    ferry_gds *g[2];          /* racer i submits to g[i % 2] (g[1] == g[0] for one context) */
    ferry_gds_req *volatile req;
    pthread_barrier_t start, end;
    int rc[RACERS];
    char msg[RACERS][256];
    int stop;
} race;

typedef struct racer {
    race *r;
    int i;
} racer;

static void *racer_run(void *arg)
{
    racer *me = arg;
    race *r = me->r;
    for (;;) {
        pthread_barrier_wait(&r->start);
        if (r->stop)
            return NULL;
        ferry_gds_req *q = r->req;
        ferry_gds *g = r->g[me->i % 2];
        r->rc[me->i] = ferry_gds_submit(g, &q, 1);
        snprintf(r->msg[me->i], sizeof r->msg[me->i], "%s", ferry_last_error());
        pthread_barrier_wait(&r->end);
    }
}

/* ROUNDS rounds of RACERS threads released at once on one fresh request */
static void race_rounds(ferry_gds *g0, ferry_gds *g1)
{
    race r = {{g0, g1}, NULL, {{0}}, {{0}}, {0}, {{0}}, 0};
    assert_int_equal(pthread_barrier_init(&r.start, NULL, RACERS + 1), 0);
    assert_int_equal(pthread_barrier_init(&r.end, NULL, RACERS + 1), 0);
    pthread_t th[RACERS];
    racer who[RACERS];
    for (int i = 0; i < RACERS; i++) {
        who[i] = (racer){&r, i};
        assert_int_equal(pthread_create(&th[i], NULL, racer_run, &who[i]), 0);
    }
    const size_t n = 64 * 1024;
    unsigned char *mem = aligned_alloc(4096, n);
    memset(mem, 0x5A, n);
    static int garbage;
    char bad[512] = "";
    for (int round = 0; round < ROUNDS && !bad[0]; round++) {
        /* fresh: never submitted, priv_ whatever the caller's memory held
         * (NULL, or anything: the struct need not have been cleared) */
        ferry_gds_req q = {FERRY_GDS_WRITE, mem, n, (uint64_t)(round % 64) * n, NULL, 7,
                           round % 2 ? (void *)&garbage : NULL};
        r.req = &q;
        pthread_barrier_wait(&r.start);
        pthread_barrier_wait(&r.end);
        int won = -1, busy = 0, took = 0;
        for (int i = 0; i < RACERS; i++) {
            if (r.rc[i] == 1) {
                took++;
                won = i;
            } else if (r.rc[i] == FERRY_EBUSY && strstr(r.msg[i], "in flight")) {
                busy++;
            } else {
                snprintf(bad, sizeof bad, "round %d: racer %d: %d (%s)", round, i, r.rc[i],
                         r.msg[i]);
            }
        }
        if (!bad[0] && (took != 1 || busy != RACERS - 1))
            snprintf(bad, sizeof bad, "round %d: %d racers took the request, %d got EBUSY",
                     round, took, busy);
        /* it comes back once, from the context that took it, and nothing
         * else does (whoever took it: reap everything, never hang) */
        int contexts = r.g[1] == r.g[0] ? 1 : 2;
        for (int c = 0; c < contexts; c++) {
            ferry_gds_req *done[RACERS] = {NULL};
            int k, got = 0;
            /* (returns at once when nothing is outstanding) */
            while ((k = ferry_gds_reap(r.g[c], done, 1, RACERS, 5000)) > 0)
                for (int j = 0; j < k; j++, got++)
                    if (done[j] != &q || q.result != 0)
                        snprintf(bad, sizeof bad, "round %d: reaped %p (result %d), not %p",
                                 round, (void *)done[j], done[j]->result, (void *)&q);
            int want = won >= 0 && r.g[c] == r.g[won % 2];
            if (!bad[0] && got != want)
                snprintf(bad, sizeof bad, "round %d: context %d gave the request back %d times",
                         round, c, got);
        }
    }
    r.stop = 1;
    pthread_barrier_wait(&r.start);
    for (int i = 0; i < RACERS; i++)
        pthread_join(th[i], NULL);
    pthread_barrier_destroy(&r.start);
    pthread_barrier_destroy(&r.end);
    free(mem);
    if (bad[0])
        fail_msg("%s", bad);
}

/* ferry/gds.h: a request submitted and not yet reaped is FERRY_EBUSY. The
 * check and the claim were two steps (and a fresh request, priv_ NULL,
 * was not checked at all), so two threads submitting one request at once
 * could both take it: it then completed twice. */
static void racing_submits_of_one_request(void **state)
{
    (void)state;
    ferry_gds_config c = config(0, 2, NULL);
    ferry_gds *g = NULL;
    FT_ASSERT_OK(ferry_gds_open(&c, &g));
    race_rounds(g, g);
    ferry_gds_close(g);
}

/* the same race, half the threads submitting to another context */
static void racing_submits_to_two_contexts(void **state)
{
    (void)state;
    ferry_gds_config c0 = config(0, 2, NULL), c1 = config(2, 2, NULL);
    ferry_gds *g0 = NULL, *g1 = NULL;
    FT_ASSERT_OK(ferry_gds_open(&c0, &g0));
    FT_ASSERT_OK(ferry_gds_open(&c1, &g1));
    race_rounds(g0, g1);
    ferry_gds_close(g1);
    ferry_gds_close(g0);
}

/* A request in flight on one context, submitted to another: FERRY_EBUSY
 * naming the other context (it was taken a second time, and then
 * completed once on each, its priv_ and result written by both). Reaped
 * there, it is the caller's again for any context. */
static void request_in_flight_on_another_context(void **state)
{
    (void)state;
    ferry_gds_config c0 = config(0, 2, NULL), c1 = config(2, 1, NULL);
    ferry_gds *g0 = NULL, *g1 = NULL;
    FT_ASSERT_OK(ferry_gds_open(&c0, &g0));
    FT_ASSERT_OK(ferry_gds_open(&c1, &g1));
    const size_t n = 1 * MiB;
    unsigned char *mem = aligned_alloc(4096, 2 * n), *back = aligned_alloc(4096, n);
    ft_fill_pattern(mem, 2 * n, 9);
    ferry_gds_req r = {FERRY_GDS_WRITE, mem, n, 0, NULL, 1, NULL};
    ferry_gds_req other = {FERRY_GDS_WRITE, mem + n, n, n, NULL, 1, NULL};
    ferry_gds_req *p = &r, *two[2] = {&other, &r}, *done[4] = {NULL};
    assert_int_equal(ferry_gds_submit(g0, &p, 1), 1);
    assert_int_equal(ferry_gds_submit(g1, &p, 1), FERRY_EBUSY);
    char want[128];
    snprintf(want, sizeof want, "in flight on another context (%p", (void *)g0);
    assert_non_null(strstr(ferry_gds_last_error(g1), want));
    snprintf(want, sizeof want, "(%p, write of 1048576 bytes at slab offset 0)", (void *)&r);
    assert_non_null(strstr(ferry_gds_last_error(g1), want));
    /* in a batch: those before it are queued, on g1 */
    assert_int_equal(ferry_gds_submit(g1, two, 2), 1);
    assert_non_null(strstr(ferry_gds_last_error(g1), "request 1 ("));
    assert_int_equal(ferry_gds_reap(g1, done, 1, 4, -1), 1);
    assert_ptr_equal(done[0], &other);
    assert_int_equal(ferry_gds_reap(g1, done, 1, 4, 20), 0); /* r never reached g1 */
    assert_int_equal(ferry_gds_reap(g0, done, 1, 4, -1), 1);
    assert_ptr_equal(done[0], &r);
    FT_ASSERT_OK(r.result);
    assert_null(r.priv_);
    /* reaped on g0: g1 takes it now */
    r.dir = FERRY_GDS_WRITE;
    assert_int_equal(ferry_gds_submit(g1, &p, 1), 1);
    assert_int_equal(ferry_gds_reap(g1, done, 1, 4, -1), 1);
    FT_ASSERT_OK(r.result);
    FT_ASSERT_OK(ferry_gds_pread(g0, back, n, 0));
    assert_memory_equal(back, mem, n);
    FT_ASSERT_OK(ferry_gds_pread(g1, back, n, 0));
    assert_memory_equal(back, mem, n);
    ferry_gds_close(g1);
    ferry_gds_close(g0);
    free(mem);
    free(back);
}

/* ---- close with requests unreaped on failing and broken drives ---- */

/* a drive queue that broke: it still finishes what the engine holds (so
 * closing the files is safe), but hands back none of it and fails */
static _Atomic int g_broken;

static int broken_reap(ferry_io *io, ferry_io_req **done, unsigned min, unsigned max,
                       int timeout_ms)
{
    if (!atomic_load(&g_broken))
        return ferry_io_reap(io, done, min, max, timeout_ms);
    while (ferry_io_inflight(io) > 0)
        if (ferry_io_reap(io, done, 1, max, -1) < 0)
            break;
    return ferry__err_set(NULL, -EIO, "test: the drive's queue broke");
}

enum { NQ = 70 }; /* more than one submission batch (32) */

static void submit_all(ferry_gds *g, ferry_gds_req *rq, unsigned char *mem, size_t n)
{
    ferry_gds_req *p[NQ];
    for (int i = 0; i < NQ; i++) {
        rq[i] = (ferry_gds_req){i % 2 ? FERRY_GDS_READ : FERRY_GDS_WRITE, mem + i * n, n,
                                (uint64_t)i * n, NULL, 1, NULL};
        p[i] = &rq[i];
    }
    assert_int_equal(ferry_gds_submit(g, p, NQ), NQ);
}

/* after close: every request is the caller's again, for a new context */
static void resubmit_all(const ferry_gds_config *c, ferry_gds_req *rq)
{
    ferry_gds *g = NULL;
    FT_ASSERT_OK(ferry_gds_open(c, &g));
    ferry_gds_req *p[NQ], *done[NQ];
    for (int i = 0; i < NQ; i++) {
        assert_null(rq[i].priv_);
        p[i] = &rq[i];
    }
    assert_int_equal(ferry_gds_submit(g, p, NQ), NQ);
    for (int seen = 0; seen < NQ;) {
        int k = ferry_gds_reap(g, done, 1, NQ, -1);
        assert_true(k > 0);
        for (int j = 0; j < k; j++)
            FT_ASSERT_OK(done[j]->result);
        seen += k;
    }
    ferry_gds_close(g);
}

/* ferry/gds.h: close waits for requests in flight and drops unreaped ones.
 * On drives failing every I/O, and on a drive whose queue broke at close
 * (the drain gave up: what it held never landed on the done list, and
 * those requests were neither freed nor given back). Every block the
 * context allocated is freed at close (the counting allocator; ASan's leak
 * check too), and each request can be submitted again. */
static void close_frees_requests_on_failing_drives(void **state)
{
    (void)state;
    static const char *const engines[] = {"posix", "uring"};
    const size_t n = 256 * 1024;
    unsigned char *mem = aligned_alloc(4096, NQ * n);
    memset(mem, 1, NQ * n);
    ferry_gds_req rq[NQ], *done[2];
    for (size_t e = 0; e < 2; e++) {
        for (int broken = 0; broken < 2; broken++) {
            ferry_gds_config c = config(0, 3, engines[e]);
            ferry_gds *g = NULL;
            ft_alloc_install(0, 0);
            if (ferry_gds_open(&c, &g) < 0) {
                ft_alloc_reset();
                assert_string_equal(engines[e], "uring"); /* (no io_uring here) */
                continue;
            }
            ferry__sys sys = *ferry__sys_default();
            sys.pwrite = eio_pwrite;
            sys.pread = eio_pread;
            sys.uring_result = eio_uring;
            if (!broken)
                ferry__sys_set(&sys);
            submit_all(g, rq, mem, n);
            if (!broken) {
                assert_int_equal(ferry_gds_reap(g, done, 1, 1, -1), 1);
                assert_int_equal(done[0]->result, -EIO);
                if (!strstr(ferry_gds_last_error(g), "slab offset"))
                    fail_msg("no message: %s", ferry_gds_last_error(g));
            }
            atomic_store(&g_broken, broken);
            ferry__gds_reap_seam(broken_reap);
            ferry_gds_close(g);
            ferry__gds_reap_seam(NULL);
            atomic_store(&g_broken, 0);
            ferry__sys_set(NULL);
            int64_t live = ft_alloc_live();
            ft_alloc_reset();
            if (live != 0)
                fail_msg("%s, %s: %lld blocks left allocated after close", engines[e],
                         broken ? "a broken queue" : "EIO", (long long)live);
            resubmit_all(&c, rq);
        }
    }
    free(mem);
}

/* ---- close with one drive's queue broken and the others still busy ---- */

/* the fds the library closed (set before the close), and the writes it
 * issued on one of them afterwards */
static _Atomic int g_fd_closed[1024];
static _Atomic int g_io_after_close;
static ferry_io *_Atomic g_broken_io;

static int track_close(int fd)
{
    if (fd >= 0 && fd < 1024)
        atomic_store(&g_fd_closed[fd], 1);
    return close(fd);
}

static ssize_t slow_pwrite(int fd, const void *b, size_t n, off_t o)
{
    usleep(2000); /* the healthy drives are still busy when close comes */
    if (fd >= 0 && fd < 1024 && atomic_load(&g_fd_closed[fd]))
        atomic_fetch_add(&g_io_after_close, 1);
    return pwrite(fd, b, n, o);
}

/* drive 0's queue breaks (what it holds finishes, nothing is handed back) */
static int one_broken_reap(ferry_io *io, ferry_io_req **done, unsigned min, unsigned max,
                           int timeout_ms)
{
    if (io != atomic_load(&g_broken_io))
        return ferry_io_reap(io, done, min, max, timeout_ms);
    while (ferry_io_inflight(io) > 0)
        if (ferry_io_reap(io, done, 1, max, -1) < 0)
            break;
    return ferry__err_set(NULL, -EIO, "test: drive 0's queue broke");
}

/* ferry/gds.h: close waits for requests in flight, but for those of a
 * drive whose queue broke. Drive 0's queue breaks at close while drives 1
 * and 2 still hold queued writes: close must let those finish before it
 * closes their files (before, the drain gave up at the broken drive and
 * the files were closed under the engines' pending writes, which then ran
 * on the closed descriptors: a number the process may have given to
 * another file meanwhile) */
static void close_waits_for_healthy_drives_when_one_broke(void **state)
{
    (void)state;
    memset(g_fd_closed, 0, sizeof g_fd_closed);
    atomic_store(&g_io_after_close, 0);
    const size_t n = 64 * 1024;
    unsigned char *mem = aligned_alloc(4096, NQ * n);
    memset(mem, 5, NQ * n);
    ferry_gds_config c = config(0, 3, "posix");
    c.stripe_bytes = n;
    c.depth = 2;
    ferry_gds *g = NULL;
    FT_ASSERT_OK(ferry_gds_open(&c, &g));
    ferry__sys sys = *ferry__sys_default();
    sys.pwrite = slow_pwrite;
    sys.close = track_close;
    ferry__sys_set(&sys);
    ferry_gds_req rq[NQ], *p[NQ];
    for (int i = 0; i < NQ; i++) {
        rq[i] = (ferry_gds_req){FERRY_GDS_WRITE, mem + i * n, n, (uint64_t)i * n, NULL, 1, NULL};
        p[i] = &rq[i];
    }
    assert_int_equal(ferry_gds_submit(g, p, NQ), NQ);
    atomic_store(&g_broken_io, g->drives[0].io);
    ferry__gds_reap_seam(one_broken_reap);
    ferry_gds_close(g);
    ferry__gds_reap_seam(NULL);
    atomic_store(&g_broken_io, NULL);
    ferry__sys_set(NULL);
    int after = atomic_load(&g_io_after_close);
    if (after)
        fail_msg("%d writes ran on a drive's descriptor after close closed it", after);
    for (int i = 0; i < NQ; i++)
        assert_null(rq[i].priv_);
    free(mem);
}

/* ---- close with I/O in flight on a broken queue ---- */
/* a queue that broke hard: it fails at once, and its engine keeps what it
 * holds (in flight, or landed and not reaped) */
static int hard_broken_reap(ferry_io *io, ferry_io_req **done, unsigned min, unsigned max,
                            int timeout_ms)
{
    (void)io, (void)done, (void)min, (void)max, (void)timeout_ms;
    return ferry__err_set(NULL, -EIO, "test: the drive's queue broke with I/O in flight");
}

/* I/O that outlives the file it was issued on: each write and completion
 * checks its descriptor is still open (the engine's I/O would otherwise
 * land in whatever file took the number next), the first writes slowly
 * enough for close to reach the files meanwhile; then fails with EIO (a
 * failed part's message names its file, freed under it: ASan) */
static atomic_int g_io_on_closed, g_slow_writes;

static void check_still_open(int fd)
{
    if (fcntl(fd, F_GETFD) < 0 && errno == EBADF)
        atomic_fetch_add(&g_io_on_closed, 1);
}

static ssize_t slow_eio_pwrite(int fd, const void *b, size_t n, off_t o)
{
    (void)b, (void)n, (void)o;
    if (atomic_fetch_add(&g_slow_writes, 1) < 8)
        usleep(50 * 1000);
    check_still_open(fd);
    errno = EIO;
    return -1;
}

static int checked_eio_uring(void *ctx, int op, int fd, uint64_t off, size_t len, int res)
{
    (void)ctx, (void)op, (void)off, (void)len, (void)res;
    check_still_open(fd);
    return -EIO;
}

/* Close shut each drive's slab file before its engine: with the queue
 * broken (the drain gave up), the engine still held I/O on the file, and
 * its close then finished it on a closed descriptor and failed it with a
 * message read from the freed file ("2 I/Os ran on a closed file"; ASan:
 * heap-use-after-free in the engine's close). The engine's I/O is drained
 * before the files close now: none runs on a closed file, every block is
 * freed, every request can be submitted again. */
static void close_drains_io_before_files(void **state)
{
    (void)state;
    static const char *const engines[] = {"posix", "uring"};
    const size_t n = 256 * 1024;
    unsigned char *mem = aligned_alloc(4096, NQ * n);
    memset(mem, 1, NQ * n);
    ferry_gds_req rq[NQ];
    for (size_t e = 0; e < 2; e++) {
        ferry_gds_config c = config(0, 3, engines[e]);
        ferry_gds *g = NULL;
        ft_alloc_install(0, 0);
        if (ferry_gds_open(&c, &g) < 0) {
            ft_alloc_reset();
            assert_string_equal(engines[e], "uring"); /* (no io_uring here) */
            continue;
        }
        ferry__sys sys = *ferry__sys_default();
        sys.pwrite = slow_eio_pwrite;
        sys.uring_result = checked_eio_uring;
        atomic_store(&g_io_on_closed, 0);
        atomic_store(&g_slow_writes, 0);
        ferry__sys_set(&sys);
        for (int i = 0; i < NQ; i++)
            rq[i] = (ferry_gds_req){FERRY_GDS_WRITE, mem + i * n, n, (uint64_t)i * n, NULL, 1,
                                    NULL};
        ferry_gds_req *p[NQ];
        for (int i = 0; i < NQ; i++)
            p[i] = &rq[i];
        assert_int_equal(ferry_gds_submit(g, p, NQ), NQ);
        ferry__gds_reap_seam(hard_broken_reap);
        ferry_gds_close(g);
        ferry__gds_reap_seam(NULL);
        ferry__sys_set(NULL);
        int after = atomic_load(&g_io_on_closed);
        int64_t live = ft_alloc_live();
        ft_alloc_reset();
        if (after)
            fail_msg("%s: %d I/Os ran on a closed file", engines[e], after);
        if (live != 0)
            fail_msg("%s: %lld blocks left allocated after close", engines[e], (long long)live);
        resubmit_all(&c, rq);
    }
    free(mem);
}

/* ---- a synchronous transfer whose reap fails ---- */
/* the drive's queue fails the next g_reaps_to_fail reaps (handing nothing
 * back, its engine keeping what it holds), then works again */
static atomic_int g_reaps_to_fail;

static int failing_reap(ferry_io *io, ferry_io_req **done, unsigned min, unsigned max,
                        int timeout_ms)
{
    int left = atomic_load(&g_reaps_to_fail);
    while (left > 0 && !atomic_compare_exchange_weak(&g_reaps_to_fail, &left, left - 1))
        ;
    if (left > 0)
        return ferry__err_set(NULL, -EIO, "test: the drive's reap failed");
    return ferry_io_reap(io, done, min, max, timeout_ms);
}

static ssize_t slow_pread(int fd, void *b, size_t n, off_t o)
{
    usleep(20 * 1000); /* still reading when the first reap fails */
    return pread(fd, b, n, o);
}

/* ferry_gds_pread's reads land in the caller's buffer, and its engine
 * requests live in its own frame: it may not return while the drive's
 * engine holds any of them. Its first reap fails while the reads are still
 * running. Before, it returned -EIO at once: the reads landed in the
 * buffer after it had returned (the caller's again: here overwritten with
 * 0xee), and the engine went on using requests in the dead frame (ASan,
 * with detect_stack_use_after_return: stack-use-after-return when close
 * hands them back; other builds hung in that close). Now it waits for every one of them and returns the
 * reap's failure, with its message. */
static void pread_waits_for_its_reads_when_a_reap_fails(void **state)
{
    (void)state;
    const size_t n = 1 * MiB;
    unsigned char *want = aligned_alloc(4096, n), *buf = aligned_alloc(4096, n);
    ft_fill_pattern(want, n, 11);
    memset(buf, 0, n);
    ferry_gds_config c = config(0, 1, "posix");
    c.depth = 4; /* 4 reads of 256 KiB, all running at once */
    ferry_gds *g = NULL;
    FT_ASSERT_OK(ferry_gds_open(&c, &g));
    FT_ASSERT_OK(ferry_gds_pwrite(g, want, n, 0));
    ferry__sys sys = *ferry__sys_default();
    sys.pread = slow_pread;
    ferry__sys_set(&sys);
    atomic_store(&g_reaps_to_fail, 1);
    ferry__gds_reap_seam(failing_reap);
    int rc = ferry_gds_pread(g, buf, n, 0);
    char msg[512];
    snprintf(msg, sizeof msg, "%s", ferry_gds_last_error(g));
    int landed = memcmp(buf, want, n) == 0;
    memset(buf, 0xee, n); /* the caller's again */
    usleep(100 * 1000);   /* (reads still in the engine would land meanwhile) */
    size_t changed = 0;
    for (size_t i = 0; i < n; i++)
        changed += buf[i] != 0xee;
    ferry__gds_reap_seam(NULL);
    ferry__sys_set(NULL);
    if (!landed || changed) {
        /* its engine still holds requests in the frame that returned:
         * closing hands them back (ASan: stack-use-after-return there);
         * elsewhere the context is left open (the close could hang on the
         * engine's counts, which that frame's next tenants overwrote) */
        if (FT_UNDER_ASAN)
            ferry_gds_close(g);
        if (!landed)
            fail_msg("ferry_gds_pread returned (%d) before its reads had landed", rc);
        fail_msg("%zu bytes of the caller's buffer changed after ferry_gds_pread returned",
                 changed);
    }
    ferry_gds_close(g);
    assert_int_equal(rc, -EIO);
    if (!strstr(msg, "read of 1048576 bytes at slab offset 0: drive 0") || !strstr(msg, "reap"))
        fail_msg("message: %s", msg);
    free(want);
    free(buf);
}

/* ---- many requests in flight ---- */
/* A queue has no fixed bound, and every submit and reap walks one chain of
 * the process's table of requests in flight: with 64 chains, 32k requests
 * queued made chains of hundreds and submit and reap quadratic in the
 * depth. The chains stay a few long; all of them are dropped at reap. */
static void deep_queues_keep_the_table_chains_short(void **state)
{
    (void)state;
    enum { DEEP = 32768 };
    const size_t n = 4096;
    unsigned char *mem = aligned_alloc(4096, 64 * n);
    memset(mem, 9, 64 * n);
    ferry_gds_req *rq = calloc(DEEP, sizeof *rq), **p = calloc(DEEP, sizeof *p);
    assert_non_null(rq);
    assert_non_null(p);
    ferry_gds_config c = config(0, 1, "posix");
    c.depth = 4;
    ferry_gds *g = NULL;
    FT_ASSERT_OK(ferry_gds_open(&c, &g));
    for (int i = 0; i < DEEP; i++) {
        rq[i] = (ferry_gds_req){FERRY_GDS_WRITE, mem + (i % 64) * n, n, (uint64_t)(i % 64) * n,
                                NULL, 1, NULL};
        p[i] = &rq[i];
    }
    assert_int_equal(ferry_gds_submit(g, p, DEEP), DEEP);
    unsigned longest = ferry__gds_live_longest();
    if (longest > 32)
        fail_msg("%u requests in flight: the longest chain holds %u", (unsigned)DEEP, longest);
    for (int got = 0; got < DEEP;) {
        int r = ferry_gds_reap(g, p, 1, DEEP, -1);
        assert_true(r > 0);
        for (int i = 0; i < r; i++)
            assert_int_equal(p[i]->result, 0);
        got += r;
    }
    assert_int_equal(ferry__gds_live_longest(), 0);
    ferry_gds_close(g);
    free(p);
    free(rq);
    free(mem);
}

/* ---- fork ---- */

/* a child's copy of a request its parent had in flight is the child's to
 * submit to a context of its own (before: the table the child inherited
 * still held it, FERRY_EBUSY for ever) */
static void a_fork_child_starts_with_no_request_in_flight(void **state)
{
    (void)state;
    /* (not under TSan: its runtime kills a child that starts threads
     * after a multi-threaded fork, and a context of the child's starts them) */
    if (FT_UNDER_TSAN)
        skip();
    const size_t n = 4096;
    unsigned char *mem = aligned_alloc(4096, n);
    memset(mem, 3, n);
    ferry_gds_config c = config(0, 1, "posix");
    ferry_gds *g = NULL;
    FT_ASSERT_OK(ferry_gds_open(&c, &g));
    ferry_gds_req r = {FERRY_GDS_WRITE, mem, n, 0, NULL, 1, NULL}, *p = &r, *done[2];
    assert_int_equal(ferry_gds_submit(g, &p, 1), 1);
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        ferry_gds_config cc = config(1, 1, "posix");
        ferry_gds *gc = NULL;
        r.priv_ = NULL;
        if (ferry_gds_open(&cc, &gc) == 0 && ferry_gds_submit(gc, &p, 1) == 1 &&
            ferry_gds_reap(gc, done, 1, 2, 5000) == 1 && done[0] == &r && r.result == 0)
            _exit(0);
        fprintf(stderr, "child: %s\n", ferry_last_error());
        _exit(1);
    }
    int st = 0;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
        fail_msg("the child could not submit its copy of a request in flight in its parent "
                 "(status %d)", st);
    assert_int_equal(ferry_gds_reap(g, done, 1, 2, -1), 1);
    assert_ptr_equal(done[0], &r);
    ferry_gds_close(g);
    free(mem);
}

/* ---- init on one thread while others use the context ---- */
typedef struct user {
    ferry_gds *g;
    int kind;       /* 0: buffer alloc, 1: pwrite, 2: accessors and reap */
    int rc;
    long refused;   /* FERRY_ESTATE answers before it was on */
    char what[200];
} user;

static void *user_run(void *arg)
{
    user *u = arg;
    u->rc = -1;
    static unsigned char block[4096] __attribute__((aligned(4096)));
    for (long spin = 0; spin < 100000000; spin++) {
        int rc = 0;
        if (u->kind == 0) {
            void *p = NULL;
            rc = ferry_gds_buffer_alloc(u->g, 8192, &p);
            if (rc == 0) {
                memset(p, 3, 8192); /* as large as asked */
                ferry_gds_buffer_free(u->g, p);
            }
        } else if (u->kind == 1) {
            rc = ferry_gds_pwrite(u->g, block, sizeof block, 4096);
        } else {
            /* every accessor agrees with is_on once it says on */
            if (!ferry_gds_is_on(u->g)) {
                rc = FERRY_ESTATE;
            } else if (ferry_gds_size(u->g) != 64 * MiB || !ferry_gds_slab(u->g) ||
                       strcmp(ferry_gds_driver_name(u->g), "cpu") ||
                       !strcmp(ferry_gds_engine(u->g), "off")) {
                snprintf(u->what, sizeof u->what, "on, yet size %llu, driver %s, engine %s",
                         (unsigned long long)ferry_gds_size(u->g),
                         ferry_gds_driver_name(u->g), ferry_gds_engine(u->g));
                return NULL;
            }
            (void)ferry_gds_fallback_reason(u->g);
            ferry_gds_req *none;
            if (ferry_gds_reap(u->g, &none, 0, 1, 0) != 0) { /* nothing submitted */
                snprintf(u->what, sizeof u->what, "reap: %s", ferry_last_error());
                return NULL;
            }
        }
        if (rc == FERRY_ESTATE) {
            u->refused++;
            continue;
        }
        u->rc = rc;
        snprintf(u->what, sizeof u->what, "%s", ferry_last_error());
        return NULL;
    }
    snprintf(u->what, sizeof u->what, "never saw the context on");
    return NULL;
}

/* ferry/gds.h: ferry_gds_open(NULL) is off and a later init turns it on.
 * Threads that take no lock of the context (buffer alloc read its `on`
 * flag, alignment and device unlocked; host transfers and the accessors
 * likewise) meanwhile see it off (FERRY_ESTATE) or wholly on. A TSan
 * build reports the unsynchronized reads; any build checks the answers. */
static void users_while_init_turns_it_on(void **state)
{
    (void)state;
    ferry_gds *g = NULL;
    FT_ASSERT_OK(ferry_gds_open(NULL, &g));
    user u[3];
    pthread_t th[3];
    for (int i = 0; i < 3; i++) {
        u[i] = (user){g, i, -1, 0, {0}};
        assert_int_equal(pthread_create(&th[i], NULL, user_run, &u[i]), 0);
    }
    usleep(2000);
    ferry_gds_config c = config(0, 2, NULL);
    FT_ASSERT_OK(ferry_gds_init(g, &c));
    for (int i = 0; i < 3; i++) {
        pthread_join(th[i], NULL);
        if (u[i].rc != 0)
            fail_msg("user %d: %d after %ld refusals: %s", i, u[i].rc, u[i].refused, u[i].what);
    }
    ferry_gds_close(g);
}

/* ---- several submitters and several reapers ---- */
enum { SUBMITTERS = 4, PER = 48, REAPERS = 3 };

typedef struct crowd {
    ferry_gds *g;
    ferry_gds_req rq[SUBMITTERS][PER];
    _Atomic int seen[SUBMITTERS][PER];
    _Atomic int reaped;
    unsigned char *mem;
    size_t n;
} crowd;

typedef struct crowd_arg {
    crowd *c;
    int i;
    int rc;
} crowd_arg;

static void *submitter_run(void *arg)
{
    crowd_arg *a = arg;
    crowd *c = a->c;
    a->rc = 0;
    for (int j = 0; j < PER; j++) {
        size_t at = ((size_t)a->i * PER + (size_t)j) * c->n;
        c->rq[a->i][j] = (ferry_gds_req){FERRY_GDS_WRITE, c->mem + at, c->n, at,
                                         (void *)(uintptr_t)(a->i * PER + j), 1, NULL};
        ferry_gds_req *p = &c->rq[a->i][j];
        if (ferry_gds_submit(c->g, &p, 1) != 1) {
            a->rc = -1;
            return NULL;
        }
    }
    return NULL;
}

static void *reaper_run(void *arg)
{
    crowd_arg *a = arg;
    crowd *c = a->c;
    a->rc = 0;
    while (atomic_load(&c->reaped) < SUBMITTERS * PER) {
        ferry_gds_req *done[8];
        int k = ferry_gds_reap(c->g, done, 1, 8, 5);
        if (k < 0) {
            a->rc = k;
            return NULL;
        }
        for (int j = 0; j < k; j++) {
            uintptr_t id = (uintptr_t)done[j]->user;
            if (done[j]->result != 0 || id >= SUBMITTERS * PER) {
                a->rc = -2;
                return NULL;
            }
            atomic_fetch_add(&c->seen[id / PER][id % PER], 1);
        }
        atomic_fetch_add(&c->reaped, k);
    }
    return NULL;
}

/* ferry/gds.h: submit is thread-safe; any thread may reap any request */
static void submitters_and_reapers_at_once(void **state)
{
    (void)state;
    static crowd c;
    memset(&c, 0, sizeof c);
    ferry_gds_config cfg = config(0, 3, NULL);
    FT_ASSERT_OK(ferry_gds_open(&cfg, &c.g));
    c.n = 64 * 1024;
    c.mem = aligned_alloc(4096, SUBMITTERS * PER * c.n);
    ft_fill_pattern(c.mem, SUBMITTERS * PER * c.n, 21);
    crowd_arg sa[SUBMITTERS], ra[REAPERS];
    pthread_t st[SUBMITTERS], rt[REAPERS];
    for (int i = 0; i < REAPERS; i++) {
        ra[i] = (crowd_arg){&c, i, -1};
        assert_int_equal(pthread_create(&rt[i], NULL, reaper_run, &ra[i]), 0);
    }
    for (int i = 0; i < SUBMITTERS; i++) {
        sa[i] = (crowd_arg){&c, i, -1};
        assert_int_equal(pthread_create(&st[i], NULL, submitter_run, &sa[i]), 0);
    }
    for (int i = 0; i < SUBMITTERS; i++) {
        pthread_join(st[i], NULL);
        assert_int_equal(sa[i].rc, 0);
    }
    for (int i = 0; i < REAPERS; i++) {
        pthread_join(rt[i], NULL);
        assert_int_equal(ra[i].rc, 0);
    }
    for (int i = 0; i < SUBMITTERS; i++)
        for (int j = 0; j < PER; j++)
            if (atomic_load(&c.seen[i][j]) != 1)
                fail_msg("request %d/%d reaped %d times", i, j, atomic_load(&c.seen[i][j]));
    unsigned char *back = aligned_alloc(4096, SUBMITTERS * PER * c.n);
    FT_ASSERT_OK(ferry_gds_pread(c.g, back, SUBMITTERS * PER * c.n, 0));
    assert_int_equal(ft_check_pattern(back, SUBMITTERS * PER * c.n, 21), -1);
    ferry_gds_close(c.g);
    free(back);
    free(c.mem);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(racing_submits_of_one_request, setup, teardown),
        cmocka_unit_test_setup_teardown(racing_submits_to_two_contexts, setup, teardown),
        cmocka_unit_test_setup_teardown(request_in_flight_on_another_context, setup, teardown),
        cmocka_unit_test_setup_teardown(close_frees_requests_on_failing_drives, setup, teardown),
        cmocka_unit_test_setup_teardown(close_waits_for_healthy_drives_when_one_broke, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(close_drains_io_before_files, setup, teardown),
        cmocka_unit_test_setup_teardown(pread_waits_for_its_reads_when_a_reap_fails, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(deep_queues_keep_the_table_chains_short, setup, teardown),
        cmocka_unit_test_setup_teardown(a_fork_child_starts_with_no_request_in_flight, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(users_while_init_turns_it_on, setup, teardown),
        cmocka_unit_test_setup_teardown(submitters_and_reapers_at_once, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
