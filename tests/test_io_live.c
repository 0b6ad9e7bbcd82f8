/*
 * test_io_live.c - one taker per asynchronous I/O request, across engines
 * and threads (ferry/io.h: a request submitted and not yet reaped is
 * FERRY_EBUSY naming it), on the posix and uring engines:
 *   - a request in flight on one engine submitted to another: FERRY_EBUSY
 *     naming the engine that holds it, also when its file was switched to
 *     the other engine's; it completes once, on the first; once reaped
 *     there (or dropped by that engine's close) the other takes it;
 *   - threads racing to submit one fresh request (its private words
 *     garbage), to one engine or to two: exactly one takes it, the others
 *     get FERRY_EBUSY (or, on the engine its file is not of, -EINVAL
 *     before it was taken), and it comes back once, from the engine that
 *     took it. Run it in the TSan build too;
 *   - a deep queue (64k requests submitted at once) keeps the table's
 *     chains short, and every request leaves the table when reaped.
 */
/* ferry-test-labels: concurrent */
/* ferry-test-timeout: 120 */
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ferry_test.h"
#include "io/io_impl.h"

static char g_dir[256];

static void assert_msg_has(const char *msg, const char *needle)
{
    if (!strstr(msg, needle))
        fail_msg("message '%s' does not contain '%s'", msg, needle);
}

static const char *engine_of(void **state)
{
    return (const char *)*state;
}

/* the engine, or NULL where it cannot run (uring without io_uring) */
static ferry_io *open_io(const char *engine)
{
    char why[256];
    if (ferry_io_engine_probe(engine, NULL, why, sizeof why) < 0)
        return NULL;
    ferry_io_options o = FERRY_IO_OPTIONS_INIT;
    o.engine = engine;
    o.depth = 4;
    ferry_io *io = NULL;
    FT_ASSERT_OK(ferry_io_open(&o, &io));
    return io;
}

static ferry_file *open_file(ferry_io *io, const char *name)
{
    char path[512];
    snprintf(path, sizeof path, "%s/%s", g_dir, name);
    ferry_file *f = NULL;
    FT_ASSERT_OK(ferry_file_open(io, path,
                                 FERRY_FILE_READ | FERRY_FILE_WRITE | FERRY_FILE_CREATE |
                                     FERRY_FILE_TRUNC,
                                 &f));
    return f;
}

/* A request in flight on engine a, submitted to engine b: FERRY_EBUSY
 * naming a (it was -EINVAL, "file opened on another engine", and with its
 * file switched to b's, b took it a second time: it then completed on
 * both, each writing its result and private words). */
static void in_flight_on_another_engine(void **state)
{
    ferry_io *a = open_io(engine_of(state)), *b = open_io(engine_of(state));
    if (!a)
        skip();
    ferry_file *fa = open_file(a, "a.bin"), *fb = open_file(b, "b.bin");
    char *mem = aligned_alloc(4096, 3 * 4096);
    ft_fill_pattern(mem, 3 * 4096, 5);
    ferry_io_req r = {.op = FERRY_IO_WRITE, .file = fa, .buf = mem, .len = 4096};
    ferry_io_req other = {.op = FERRY_IO_WRITE, .file = fb, .buf = mem + 4096, .len = 4096,
                          .offset = 4096};
    ferry_io_req *p = &r, *two[2] = {&other, &r}, *done[4] = {NULL};
    assert_int_equal(ferry_io_submit(a, &p, 1), 1);
    assert_int_equal(ferry_io_submit(b, &p, 1), FERRY_EBUSY);
    char want[160];
    snprintf(want, sizeof want, "in flight on another engine (%p, not this one, %p)",
             (void *)a, (void *)b);
    assert_msg_has(ferry_io_last_error(b), want);
    snprintf(want, sizeof want, "request %p (reqs[0], write of 4096 bytes at offset 0 of file",
             (void *)&r);
    assert_msg_has(ferry_io_last_error(b), want);
    assert_int_equal(ferry_io_inflight(b), 0);
    /* its file switched to b's while in flight (the caller's mistake, a
     * request reused for another drive before it was reaped): still busy */
    r.file = fb;
    assert_int_equal(ferry_io_submit(b, &p, 1), FERRY_EBUSY);
    assert_msg_has(ferry_io_last_error(b), "in flight");
    /* in a batch: those before it are queued */
    assert_int_equal(ferry_io_submit(b, two, 2), 1);
    assert_msg_has(ferry_io_last_error(b), "reqs[1]");
    r.file = fa;
    assert_int_equal(ferry_io_reap(b, done, 1, 4, -1), 1);
    assert_ptr_equal(done[0], &other);
    assert_int_equal(ferry_io_reap(b, done, 1, 4, 20), 0); /* r never reached b */
    /* done on a and not reaped: still a's */
    while (r.result == 0) /* a synchronous call completes it, leaving it for reap */
        FT_ASSERT_OK(ferry_io_pwrite(a, fa, mem + 8192, 4096, 8192));
    assert_int_equal(ferry_io_submit(b, &p, 1), FERRY_EBUSY);
    assert_int_equal(ferry_io_reap(a, done, 1, 4, -1), 1);
    assert_ptr_equal(done[0], &r);
    assert_int_equal(r.result, 4096);
    assert_int_equal(ferry_io_reap(a, done, 1, 4, 20), 0); /* once */
    /* reaped on a: b takes it now */
    r.file = fb;
    assert_int_equal(ferry_io_submit(b, &p, 1), 1);
    assert_int_equal(ferry_io_reap(b, done, 1, 4, -1), 1);
    assert_int_equal(r.result, 4096);
    /* a completion a's close dropped: the caller's again, for b */
    r.file = fa;
    assert_int_equal(ferry_io_submit(a, &p, 1), 1);
    while (r.result == 0)
        FT_ASSERT_OK(ferry_io_pwrite(a, fa, mem + 8192, 4096, 8192));
    FT_ASSERT_OK(ferry_file_close(fa));
    ferry_io_close(a);
    r.file = fb;
    assert_int_equal(ferry_io_submit(b, &p, 1), 1);
    assert_int_equal(ferry_io_reap(b, done, 1, 4, -1), 1);
    FT_ASSERT_OK(ferry_file_close(fb));
    ferry_io_close(b);
    free(mem);
}

/* ---- racing submitters ---- */
enum { RACERS = 8, ROUNDS = 300 };

typedef struct race {
    ferry_io *io[2];          /* racer i submits to io[i % 2] (io[1] == io[0]: one engine) */
    ferry_io_req *volatile req;
    pthread_barrier_t start, end;
    atomic_int go;            /* the round the racers may submit in */
    int rc[RACERS];
    char msg[RACERS][300];
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
    for (int round = 1;; round++) {
        pthread_barrier_wait(&r->start);
        if (r->stop)
            return NULL;
        ferry_io_req *q = r->req;
        /* (spun, not slept: the racers running leave together) */
        while (atomic_load_explicit(&r->go, memory_order_acquire) != round)
            sched_yield();
        r->rc[me->i] = ferry_io_submit(r->io[me->i % 2], &q, 1);
        snprintf(r->msg[me->i], sizeof r->msg[me->i], "%s", ferry_last_error());
        pthread_barrier_wait(&r->end);
    }
}

/* one round's answers: exactly one racer took q; those on its file's
 * engine got FERRY_EBUSY, those on the other FERRY_EBUSY or, before it
 * was taken, -EINVAL (its file is not theirs); "" when so */
static void judge(const race *r, int round, const ferry_io *home, char *bad, size_t len)
{
    int took = 0;
    for (int i = 0; i < RACERS && !bad[0]; i++) {
        int rc = r->rc[i], mine = r->io[i % 2] == home;
        if (rc == 1 && mine)
            took++;
        else if (rc == FERRY_EBUSY && strstr(r->msg[i], "in flight"))
            ;
        else if (!mine && rc == -EINVAL && strstr(r->msg[i], "another engine"))
            ;
        else
            snprintf(bad, len, "round %d: racer %d: %d (%s)", round, i, rc, r->msg[i]);
    }
    if (!bad[0] && took != 1)
        snprintf(bad, len, "round %d: %d racers took the request", round, took);
}

/* ROUNDS rounds of RACERS threads released at once on one fresh request
 * (its private words zero, or the stale words of one reaped before) */
static void race_rounds(ferry_io *io0, ferry_io *io1)
{
    race r = {{io0, io1}, NULL, {{0}}, {{0}}, 0, {0}, {{0}}, 0};
    assert_int_equal(pthread_barrier_init(&r.start, NULL, RACERS + 1), 0);
    assert_int_equal(pthread_barrier_init(&r.end, NULL, RACERS + 1), 0);
    pthread_t th[RACERS];
    racer who[RACERS];
    for (int i = 0; i < RACERS; i++) {
        who[i] = (racer){&r, i};
        assert_int_equal(pthread_create(&th[i], NULL, racer_run, &who[i]), 0);
    }
    ferry_file *f[2] = {open_file(io0, "race0.bin"), NULL};
    f[1] = io1 == io0 ? f[0] : open_file(io1, "race1.bin");
    const size_t n = 16 * 1024;
    char *mem = aligned_alloc(4096, n);
    memset(mem, 0x5A, n);
    uint64_t stale[4] = {0};
    char bad[512] = "";
    for (int round = 0; round < ROUNDS && !bad[0]; round++) {
        int home = round % 2; /* the engine whose file the request names */
        ferry_io_req q = {.op = FERRY_IO_WRITE, .file = f[home], .buf = mem, .len = n,
                          .offset = (uint64_t)(round % 16) * n};
        if (round % 4 >= 2)
            memcpy(q.priv_, stale, sizeof stale);
        r.req = &q;
        pthread_barrier_wait(&r.start);
        atomic_store_explicit(&r.go, round + 1, memory_order_release);
        pthread_barrier_wait(&r.end);
        judge(&r, round, r.io[home], bad, sizeof bad);
        /* it comes back once, from the engine that took it, and nothing
         * else does (whatever happened: reap everything, never hang) */
        int engines = io1 == io0 ? 1 : 2;
        for (int e = 0; e < engines; e++) {
            ferry_io_req *done[RACERS] = {NULL};
            int k, got = 0;
            while ((k = ferry_io_reap(r.io[e], done, 1, RACERS, 5000)) > 0)
                for (int j = 0; j < k; j++, got++)
                    if (done[j] != &q || q.result != (int64_t)n)
                        snprintf(bad, sizeof bad, "round %d: reaped %p (result %lld), not %p",
                                 round, (void *)done[j], (long long)done[j]->result,
                                 (void *)&q);
            int want = r.io[e] == r.io[home];
            if (!bad[0] && (got != want || ferry_io_inflight(r.io[e]) != 0))
                snprintf(bad, sizeof bad, "round %d: engine %d gave the request back %d times "
                         "(%u left in flight)", round, e, got, ferry_io_inflight(r.io[e]));
        }
        memcpy(stale, q.priv_, sizeof stale);
    }
    r.stop = 1;
    pthread_barrier_wait(&r.start);
    for (int i = 0; i < RACERS; i++)
        pthread_join(th[i], NULL);
    pthread_barrier_destroy(&r.start);
    pthread_barrier_destroy(&r.end);
    FT_ASSERT_OK(ferry_file_close(f[0]));
    if (f[1] != f[0])
        FT_ASSERT_OK(ferry_file_close(f[1]));
    free(mem);
    if (bad[0])
        fail_msg("%s", bad);
}

/* Of threads racing to submit one request to one engine, exactly one
 * takes it (ferry/io.h: a submit answered FERRY_EBUSY leaves the engine
 * alone, so it may run beside the thread driving it). The check (private
 * words holding a mark, confirmed in the queues) and the claim were
 * separate steps, and a fresh request's words are garbage: two could take
 * it, and it completed twice. */
static void racing_submits_to_one_engine(void **state)
{
    ferry_io *io = open_io(engine_of(state));
    if (!io)
        skip();
    race_rounds(io, io);
    ferry_io_close(io);
}

/* the same race, half the threads submitting to another engine */
static void racing_submits_to_two_engines(void **state)
{
    ferry_io *a = open_io(engine_of(state)), *b = open_io(engine_of(state));
    if (!a)
        skip();
    race_rounds(a, b);
    ferry_io_close(b);
    ferry_io_close(a);
}

/* A queue has no fixed bound, and every take and drop walks one chain of
 * the table: 64k requests queued at once on a depth-1 engine must leave
 * each chain a few long (with 256 chains each held 256 or more, and
 * submit and reap walked them for every request: quadratic in the
 * queue). Once all are reaped the table holds none of them. */
static void deep_queue_keeps_chains_short(void **state)
{
    ferry_io *io = open_io(engine_of(state));
    if (!io)
        skip();
    ferry_file *f = open_file(io, "deep.bin");
    char *mem = aligned_alloc(4096, 4096);
    memset(mem, 0x33, 4096);
    enum { N = 65536 }; /* (writes from one buffer: engine threads only read it) */
    ferry_io_req *rq = calloc(N, sizeof *rq), **p = calloc(N, sizeof *p);
    assert_non_null(rq);
    assert_non_null(p);
    for (unsigned i = 0; i < N; i++) {
        rq[i] = (ferry_io_req){.op = FERRY_IO_WRITE, .file = f, .buf = mem, .len = 512,
                               .offset = (i % 8) * 512};
        p[i] = &rq[i];
    }
    assert_int_equal(ferry_io_submit(io, p, N), N);
    unsigned longest = ferry__io_live_longest();
    if (longest > 32)
        fail_msg("%u requests queued: the table's longest chain holds %u", (unsigned)N, longest);
    unsigned got = 0;
    while (got < N) {
        int k = ferry_io_reap(io, p, 1, N, 10000);
        assert_true(k > 0);
        for (int j = 0; j < k; j++)
            assert_int_equal(p[j]->result, 512);
        got += (unsigned)k;
    }
    assert_int_equal(ferry__io_live_longest(), 0);
    FT_ASSERT_OK(ferry_file_close(f));
    ferry_io_close(io);
    free(p);
    free(rq);
    free(mem);
}

static int setup(void **state)
{
    (void)state;
    ft_tmpdir(g_dir, sizeof g_dir);
    return g_dir[0] ? 0 : -1;
}


/* fork: a child's copy of a request the parent had in flight is the
 * child's to submit to an engine of its own (before, the table the child
 * inherited still held it: FERRY_EBUSY for ever, and a lock another thread
 * held at the fork stayed held in the child) */
static void a_fork_child_starts_with_no_request_in_flight(void **state)
{
    /* (not under TSan: its runtime kills a child that starts threads
     * after a multi-threaded fork, and an engine of the child's starts them) */
    if (FT_UNDER_TSAN)
        skip();
    ferry_io *a = open_io(engine_of(state));
    if (!a)
        skip();
    ferry_file *fa = open_file(a, "fa.bin");
    char *mem = aligned_alloc(4096, 4096);
    ft_fill_pattern(mem, 4096, 7);
    ferry_io_req r = {.op = FERRY_IO_WRITE, .file = fa, .buf = mem, .len = 4096};
    ferry_io_req *p = &r, *done[2] = {NULL};
    assert_int_equal(ferry_io_submit(a, &p, 1), 1);
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        ferry_io *c = open_io(engine_of(state));
        char path[512];
        snprintf(path, sizeof path, "%s/child.bin", g_dir);
        ferry_file *fc = NULL;
        int rc = c ? ferry_file_open(c, path, FERRY_FILE_WRITE | FERRY_FILE_CREATE, &fc) : -1;
        r.file = fc; /* (the child's copy of r, at r's address) */
        r.result = 0;
        if (rc == 0 && ferry_io_submit(c, &p, 1) == 1 && ferry_io_reap(c, done, 1, 2, 5000) == 1 &&
            done[0] == &r && r.result == 4096)
            _exit(0);
        fprintf(stderr, "child: %s\n", c ? ferry_io_last_error(c) : "no engine");
        _exit(1);
    }
    int st = 0;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
        fail_msg("the child could not submit its copy of a request in flight in its parent "
                 "(status %d)", st);
    assert_int_equal(ferry_io_reap(a, done, 1, 2, -1), 1);
    assert_ptr_equal(done[0], &r);
    ferry_file_close(fa);
    ferry_io_close(a);
    free(mem);
}

static int teardown(void **state)
{
    (void)state;
    ft_rmtree(g_dir);
    return 0;
}

#define PER_ENGINE(fn)                                                                  \
    cmocka_unit_test_prestate(fn, "posix"), cmocka_unit_test_prestate(fn, "uring")

int main(void)
{
    const struct CMUnitTest tests[] = {
        PER_ENGINE(in_flight_on_another_engine),
        PER_ENGINE(racing_submits_to_one_engine),
        PER_ENGINE(racing_submits_to_two_engines),
        PER_ENGINE(deep_queue_keeps_chains_short),
        PER_ENGINE(a_fork_child_starts_with_no_request_in_flight),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
