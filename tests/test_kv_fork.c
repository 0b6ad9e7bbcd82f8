/*
 * test_kv_fork.c - a process forks after it opened a store (an engine's
 * DataLoader or multiprocessing workers), in process with an L2 whose
 * io_uring engines registered the L1 pool, and through a daemon:
 *
 *  - the child's calls on its parent's store and ops are refused loudly
 *    (FERRY_ESTATE, the message naming the opener's pid and the child's),
 *    write nothing into its buffers, and the child's close and op free
 *    return without crashing or touching the parent's threads, files or
 *    connection;
 *  - the parent's store, after the child exited, returns exactly what it
 *    stored before the fork, and stores and retrieves on;
 *  - the child has no copy of the L1 pool (MADV_DONTFORK on a mapping of
 *    the pool's own): /proc/self/maps shows nothing at its range, the
 *    kernel finds no page there (mincore: ENOMEM), and a read of it in a
 *    grandchild ends that process with SIGSEGV;
 *  - a child made without fork()'s handlers (_Fork) is refused the same;
 *  - an L1 fill that the kernel refused part way (out of memory) leaves
 *    the pool unregistered with L2: nothing pinned, bytes exact.
 *
 * Every case runs in a child process of its own, so a crash or a hang is
 * seen (a signal, an exit code, an alarm) rather than suffered.
 */
/* ferry-test-labels: concurrent */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ferry/io.h"
#include "ferry/kv.h"
#include "ferry_test.h"
#include "serve_fixture.h"
#include "kv/kv_impl.h"
#include "kv/store/tier_l1_fill.h"

#define CT 16u
#define TB 4096u                        /* bytes per token and plane */
#define PLANES 4u                       /* K and V of 2 layers */
#define CHUNK (PLANES * CT * TB)        /* 256 KiB */
#define L1_CHUNKS 128u                  /* 32 MiB: several fill steps */
#define POOL ((uint64_t)L1_CHUNKS * CHUNK)
#define PCH 8u                          /* chunks a prompt */
#define PTOK (PCH * CT)
#define IMG ((size_t)PLANES * PTOK * TB)

/* a failed check in a child: say where and exit 1 (the parent fails) */
#define CHECK(c)                                                                    \
    do {                                                                            \
        if (!(c)) {                                                                 \
            fprintf(stderr, "%s:%d: check failed: %s (last error: %s)\n", __FILE__, \
                    __LINE__, #c, ferry_last_error());                              \
            _exit(1);                                                               \
        }                                                                           \
    } while (0)

static char g_dir[256];

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void sleep_ms(int ms)
{
    struct timespec t = {0, (long)ms * 1000000};
    nanosleep(&t, NULL);
}

static void default_signals(void)
{
    signal(SIGSEGV, SIG_DFL);
    signal(SIGBUS, SIG_DFL);
    signal(SIGABRT, SIG_DFL);
    signal(SIGILL, SIG_DFL);
    signal(SIGFPE, SIG_DFL);
}

/* waitpid's status of pid */
static int reap(pid_t pid)
{
    int st = 0;
    CHECK(waitpid(pid, &st, 0) == pid);
    return st;
}

/* run fn(server) in a child; it must exit 0 within two minutes */
static void in_child(void (*fn)(int server), int server)
{
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        default_signals();
        alarm(120);
        fn(server);
        _exit(0);
    }
    int st = reap(pid);
    if (WIFSIGNALED(st))
        fail_msg("the case died of signal %d (%s)", WTERMSIG(st), strsignal(WTERMSIG(st)));
    assert_true(WIFEXITED(st));
    assert_int_equal(WEXITSTATUS(st), 0);
}

/* bytes the kernel holds pinned for this process */
static uint64_t vmpin(void)
{
    FILE *f = fopen("/proc/self/status", "r");
    CHECK(f);
    char line[256];
    unsigned long long kb = 0;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "VmPin: %llu kB", &kb) == 1)
            break;
    fclose(f);
    return (uint64_t)kb << 10;
}

/* io_uring with a fixed-buffer table: the only engine that pins the pool */
static int uring_registers(void)
{
    ferry_io_options o = FERRY_IO_OPTIONS_INIT;
    o.engine = "uring";
    ferry_io *io = NULL;
    if (ferry_io_open(&o, &io) < 0)
        return 0;
    void *b = NULL;
    int ok = posix_memalign(&b, 4096, 4096) == 0 && ferry_io_register_buffer(io, b, 4096) == 0;
    if (ok)
        ferry_io_unregister_buffer(io, b);
    ferry_io_close(io);
    free(b);
    return ok;
}

static ferry_kv_config config(void)
{
    ferry_kv_config c = FERRY_KV_CONFIG_INIT;
    c.model = "fork";
    c.layout = ft_kv_layout(TB);
    c.chunk_tokens = CT;
    c.l1_bytes = POOL;
    c.workers = 2;
    return c;
}

/* in process, with an L2 on io_uring (the pool registered once faulted) */
static ferry_kv *open_local(void)
{
    static unsigned n;
    char dir[300];
    snprintf(dir, sizeof dir, "%s/l2-%d-%u", g_dir, (int)getpid(), n++);
    ferry_kv_config c = config();
    c.l2_dir = dir;
    c.l2_bytes = 4 * POOL;
    c.l2_engine = "uring";
    ferry_kv *kv = NULL;
    CHECK(ferry_kv_open(&c, &kv) == 0);
    return kv;
}

/* the registration thread done (registered or refused) */
static int settled(ferry_kv *kv)
{
    double end = now_s() + 60;
    while (ferry__kv_poolreg_state(&kv->l2reg) == FERRY__KV_POOLREG_PENDING && now_s() < end)
        sleep_ms(2);
    return ferry__kv_poolreg_state(&kv->l2reg);
}

static void tokens_of(int32_t *t, int p)
{
    for (unsigned i = 0; i < PTOK; i++)
        t[i] = p * 100003 + (int32_t)i;
}

static void store_prompt(ferry_kv *kv, unsigned char *img, int p)
{
    int32_t tok[PTOK];
    tokens_of(tok, p);
    ft_fill_pattern(img, IMG, 500u + (unsigned)p);
    ferry_kv_buffer b = ft_kv_host_buffer(img, PTOK, TB);
    CHECK(ferry_kv_store(kv, tok, PTOK, NULL, &b) == (int)PTOK);
}

static void retrieve_prompt(ferry_kv *kv, unsigned char *img, int p)
{
    int32_t tok[PTOK];
    tokens_of(tok, p);
    memset(img, 0xA5, IMG);
    ferry_kv_buffer b = ft_kv_host_buffer(img, PTOK, TB);
    CHECK(ferry_kv_retrieve(kv, tok, PTOK, NULL, &b) == (int)PTOK);
    CHECK(ft_check_pattern(img, IMG, 500u + (unsigned)p) == -1);
}

/* rc is the fork refusal: FERRY_ESTATE, naming both processes */
static void refused(int rc, long opener)
{
    char want[96];
    if (rc != FERRY_ESTATE)
        fprintf(stderr, "a call in the child returned %d (%s)\n", rc, ferry_last_error());
    CHECK(rc == FERRY_ESTATE);
    snprintf(want, sizeof want, "process %ld", opener);
    CHECK(strstr(ferry_last_error(), want) != NULL);
    snprintf(want, sizeof want, "process %ld", (long)getpid());
    CHECK(strstr(ferry_last_error(), want) != NULL);
    CHECK(strstr(ferry_last_error(), "fork") != NULL);
}

/* the child: every call on the parent's store and op refused, nothing
 * written into its buffer, close and free return */
static void child_calls(ferry_kv *kv, ferry_kv_op *op, long opener)
{
    unsigned char *img = malloc(IMG);
    CHECK(img);
    memset(img, 0x5A, IMG);
    int32_t tok[PTOK];
    tokens_of(tok, 0);
    ferry_kv_buffer b = ft_kv_host_buffer(img, PTOK, TB);
    refused(ferry_kv_retrieve(kv, tok, PTOK, NULL, &b), opener);
    for (size_t i = 0; i < IMG; i++)
        CHECK(img[i] == 0x5A);
    refused(ferry_kv_lookup(kv, tok, PTOK, NULL), opener);
    CHECK(strstr(ferry_kv_last_error(kv), "fork") != NULL); /* the store's message too */
    tokens_of(tok, 900);
    refused(ferry_kv_store(kv, tok, PTOK, NULL, &b), opener);
    ferry_kv_op *op2 = NULL;
    refused(ferry_kv_store_async(kv, tok, PTOK, NULL, &b, &op2), opener);
    CHECK(op2 == NULL);
    refused(ferry_kv_retrieve_async(kv, tok, PTOK, NULL, &b, &op2), opener);
    CHECK(op2 == NULL);
    refused(ferry_kv_prefetch(kv, tok, PTOK, NULL), opener);
    refused(ferry_kv_delete(kv, tok, PTOK, NULL), opener);
    ferry_kv_name name = {"a", 1};
    refused(ferry_kv_lookup_named(kv, &name, 1, NULL), opener);
    refused(ferry_kv_flush(kv), opener);
    refused(ferry_kv_sync(kv), opener);
    refused(ferry_kv_clear(kv), opener);
    ferry_kv_stats st = FERRY_KV_STATS_INIT;
    refused(ferry_kv_stats_get(kv, &st), opener);
    refused(ferry_kv_op_wait(op, -1), opener);
    refused(ferry_kv_op_test(op), opener);
    refused(ferry_kv_op_cancel(op), opener);
    refused(ferry_kv_op_wait_layer(op, 0, 0), opener);
    ferry_kv_op_free(op);
    ferry_kv_close_begin(kv);
    ferry_kv_close(kv);
    free(img);
}

/* the child of a process whose store has an L1 pool at [pool, pool + len):
 * no mapping there, no page, and a read of it a SIGSEGV. First thing in
 * the child: a mapping the child makes (malloc's, a sanitizer's) may land
 * in the hole the pool left, so nothing here allocates before the maps
 * are read (raw reads into static memory) */
static char g_maps[1 << 20];

static void child_has_no_pool(const unsigned char *pool, size_t len)
{
    int fd = open("/proc/self/maps", O_RDONLY);
    CHECK(fd >= 0);
    size_t got = 0, cap = sizeof g_maps - 1;
    for (ssize_t r; got < cap && (r = read(fd, g_maps + got, cap - got)) > 0;)
        got += (size_t)r;
    close(fd);
    CHECK(got < cap);
    g_maps[got] = 0;
    uintptr_t lo = (uintptr_t)pool, hi = lo + len;
    for (char *line = g_maps, *nl; *line; line = nl + 1) {
        nl = strchr(line, '\n');
        CHECK(nl);
        *nl = 0;
        unsigned long a = 0, z = 0;
        CHECK(sscanf(line, "%lx-%lx", &a, &z) == 2);
        if (a < hi && z > lo)
            fprintf(stderr, "the child maps the pool's range [%#lx, %#lx): %s\n",
                    (unsigned long)lo, (unsigned long)hi, line);
        CHECK(!(a < hi && z > lo));
    }
    unsigned char vec[1];
    CHECK(mincore((void *)(uintptr_t)pool, 4096, vec) == -1 && errno == ENOMEM);
    fflush(NULL);
    pid_t g = fork();
    CHECK(g >= 0);
    if (g == 0) {
        default_signals();
        volatile const unsigned char *p = pool + len / 2;
        _exit(*p == 0x77 ? 2 : 3); /* (a read that returns: the pool is there) */
    }
    int st = reap(g);
    if (!WIFSIGNALED(st))
        fprintf(stderr, "the grandchild read the pool: status %#x\n", st);
    CHECK(WIFSIGNALED(st) && WTERMSIG(st) == SIGSEGV);
}

/* fork with a registered pool and an op in flight; parent: exact bytes
 * after the child exited, and stores on */
static void fork_after_open(int server)
{
    ft_kv_daemon d;
    ferry_kv *kv = NULL;
    uint64_t pin0 = vmpin();
    int reg = !server && uring_registers();
    if (server) {
        ferry_kv_config kc = config();
        ft_kv_daemon_start(&d, &kc);
        kv = ft_kv_daemon_client(&d, config());
    } else {
        kv = open_local();
        int s = settled(kv);
        if (reg) /* the pool pinned whole: what a fork used to copy */
            CHECK(s == FERRY__KV_POOLREG_DONE && vmpin() >= pin0 + POOL);
    }
    unsigned char *img = malloc(IMG);
    CHECK(img);
    for (int p = 0; p < 4; p++)
        store_prompt(kv, img, p);
    CHECK(ferry_kv_flush(kv) == 0);
    ferry_kv_op *op = NULL; /* one in flight at the fork */
    int32_t tok[PTOK];
    tokens_of(tok, 10);
    ft_fill_pattern(img, IMG, 510u);
    ferry_kv_buffer b = ft_kv_host_buffer(img, PTOK, TB);
    CHECK(ferry_kv_store_async(kv, tok, PTOK, NULL, &b, &op) == 0);
    const unsigned char *pool = NULL;
    if (!server) {
        ferry__kv_tier *l1 = kv->tier[FERRY_KV_TIER_L1];
        pool = l1->ops->host_ptr(l1, 0);
    }
    long opener = (long)getpid();
    fflush(NULL);
    double t0 = now_s();
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        alarm(30);
        if (pool)
            child_has_no_pool(pool, (size_t)POOL);
        child_calls(kv, op, opener);
        _exit(0);
    }
    double forked = now_s() - t0;
    int st = reap(pid);
    if (!(WIFEXITED(st) && WEXITSTATUS(st) == 0))
        fprintf(stderr, "the child ended with status %#x\n", st);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    fprintf(stderr, "fork of a process with a %s pool of %llu MiB: %.2f ms\n",
            reg ? "registered" : server ? "daemon's" : "", (unsigned long long)(POOL >> 20),
            forked * 1e3);
    /* the parent's store: the op done, every byte as stored, stores on */
    CHECK(ferry_kv_op_wait(op, -1) == (int)PTOK);
    ferry_kv_op_free(op);
    for (int p = 0; p < 4; p++)
        retrieve_prompt(kv, img, p);
    retrieve_prompt(kv, img, 10);
    /* in process twice L1's worth, through L2 and back (the daemon has
     * no L2: a few) */
    int more = server ? 4 : 2 * (int)(L1_CHUNKS / PCH);
    for (int p = 20; p < 20 + more; p++)
        store_prompt(kv, img, p);
    CHECK(ferry_kv_flush(kv) == 0);
    retrieve_prompt(kv, img, 20);
    retrieve_prompt(kv, img, 19 + more);
    ferry_kv_close(kv);
    if (server)
        ft_kv_daemon_stop(&d);
    if (reg)
        CHECK(vmpin() < pin0 + POOL / 2);
    free(img);
}

static void test_a_forked_child_is_refused_and_has_no_pool(void **state)
{
    (void)state;
    in_child(fork_after_open, 0);
}

static void test_a_forked_child_of_a_daemon_client_is_refused(void **state)
{
    (void)state;
    in_child(fork_after_open, 1);
}

/* the fill thread's second step refused (out of memory): the pool is not
 * registered (nothing pinned), and L2 moves every byte the plain way */
static void fill_refused(int server)
{
    (void)server;
    uint64_t pin0 = vmpin();
    atomic_store(&ferry__kv_l1_test_fail_step, 2);
    ferry_kv *kv = open_local();
    int s = settled(kv);
    atomic_store(&ferry__kv_l1_test_fail_step, 0);
    if (s != -ENOMEM)
        fprintf(stderr, "the registration's state is %d\n", s);
    CHECK(s == -ENOMEM);
    CHECK(vmpin() < pin0 + POOL / 2);
    unsigned char *img = malloc(IMG);
    CHECK(img);
    for (int p = 0; p < 2 * (int)(L1_CHUNKS / PCH); p++)
        store_prompt(kv, img, p);
    CHECK(ferry_kv_flush(kv) == 0);
    for (int p = 0; p < 2 * (int)(L1_CHUNKS / PCH); p++)
        retrieve_prompt(kv, img, p);
    double t0 = now_s();
    ferry_kv_close(kv);
    CHECK(now_s() - t0 < 5);
    free(img);
}

static void test_a_refused_fill_leaves_the_pool_unregistered(void **state)
{
    (void)state;
    if (!uring_registers())
        skip();
    in_child(fill_refused, 0);
}

/* a child made without fork()'s handlers (_Fork, as a raw clone or a
 * runtime's own fork does): the pid the library keeps must not be its
 * parent's, or the child's calls go on into a store whose pool it lacks
 * (a SIGSEGV) and whose workers it lacks (a hang) */
static void raw_fork_child(int server)
{
    (void)server;
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 34))
    ferry_kv *kv = open_local();
    unsigned char *img = malloc(IMG);
    CHECK(img);
    store_prompt(kv, img, 3);
    CHECK(ferry_kv_flush(kv) == 0);
    long opener = (long)getpid();
    fflush(NULL);
    pid_t pid = _Fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        alarm(30);
        int32_t tok[PTOK];
        tokens_of(tok, 3);
        refused(ferry_kv_lookup(kv, tok, PTOK, NULL), opener);
        memset(img, 0x5A, IMG);
        ferry_kv_buffer b = ft_kv_host_buffer(img, PTOK, TB);
        refused(ferry_kv_retrieve(kv, tok, PTOK, NULL, &b), opener);
        for (size_t i = 0; i < IMG; i++)
            CHECK(img[i] == 0x5A);
        ferry_kv_close(kv);
        _exit(0);
    }
    int st = reap(pid);
    if (!(WIFEXITED(st) && WEXITSTATUS(st) == 0))
        fprintf(stderr, "the _Fork child ended with status %#x\n", st);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    retrieve_prompt(kv, img, 3);
    ferry_kv_close(kv);
    free(img);
#endif
}

static void test_a_child_made_without_fork_handlers_is_refused(void **state)
{
    (void)state;
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 34))
    /* (not under TSan: its runtime sees only fork(), so a _Fork child's
     * exit reports the parent's threads as leaked and fails the child) */
    if (FT_UNDER_TSAN)
        skip();
    in_child(raw_fork_child, 0);
#else
    skip();
#endif
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
    ft_rmtree(g_dir);
    return 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_a_forked_child_is_refused_and_has_no_pool),
        cmocka_unit_test(test_a_forked_child_of_a_daemon_client_is_refused),
        cmocka_unit_test(test_a_refused_fill_leaves_the_pool_unregistered),
        cmocka_unit_test(test_a_child_made_without_fork_handlers_is_refused),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
