/*
 * test_serve_crash.c - `ferry serve` with both sides killed at random
 * points: a daemon on a persistent L2 and three client processes storing
 * and retrieving prompts that share prefixes, while the test kills (-9) the
 * daemon, a client, or both, at a random moment, round after round.
 *
 * Every chunk's bytes are a function of its position and token, so any
 * reader can check any chunk whoever stored it. What must hold: no client
 * ever retrieves a byte that is not the chunk's (a client exits 1 when it
 * does); after each round, with the killed parties gone and the daemon
 * restarted on its L2, a fresh client retrieves every prompt and every
 * chunk it is given is exact; and the pool takes a whole L1 of new chunks.
 */
/* ferry-test-labels: concurrent */
/* ferry-test-timeout: 600 */
#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ferry_test.h"
#include "serve_fixture.h"

#define CT 16
#define TB 64u
#define PLANES 4u
#define L1_CHUNKS 48
#define PROMPTS 24
#define PROMPT_CHUNKS 6
#define N (PROMPT_CHUNKS * CT)
#define CLIENTS 3
#define ROUNDS 12

static char g_dir[256], g_sock[300], g_l2[300];

static ferry_kv_config store_config(void)
{
    ferry_kv_config c = FERRY_KV_CONFIG_INIT;
    c.model = "crash-model";
    c.layout = ft_kv_layout(TB);
    c.chunk_tokens = CT;
    c.l1_bytes = (uint64_t)L1_CHUNKS * PLANES * CT * TB;
    return c;
}

static ferry_kv_config client_config(void)
{
    ferry_kv_config c = store_config();
    c.server = g_sock;
    c.server_timeout_ms = 1000;
    return c;
}

/* prompt p: 6 chunks; prompts share their first chunks with others */
static void prompt_tokens(int p, int32_t *t)
{
    for (int i = 0; i < N; i++) {
        int chunk = i / CT;
        /* chunk k of prompt p equals chunk k of prompt p / 2^(6-k) ... a tree */
        int owner = p >> (PROMPT_CHUNKS - 1 - chunk);
        t[i] = 1000 + owner * 97 + i;
    }
}

static unsigned char byte_of(int32_t tok, int pos, unsigned plane, unsigned b)
{
    uint32_t x = (uint32_t)tok * 2654435761u ^ (uint32_t)pos * 40503u ^ plane * 97u ^ b;
    return (unsigned char)(x ^ (x >> 13) ^ (x >> 24));
}

static void fill(unsigned char *mem, const int32_t *t)
{
    for (unsigned pl = 0; pl < PLANES; pl++)
        for (int i = 0; i < N; i++)
            for (unsigned b = 0; b < TB; b++)
                mem[((size_t)pl * N + (size_t)i) * TB + b] = byte_of(t[i], i, pl, b);
}

/* chunks [0, upto) of mem are exact: 1, else 0 */
static int exact(const unsigned char *mem, const int32_t *t, int upto_tokens)
{
    for (unsigned pl = 0; pl < PLANES; pl++)
        for (int i = 0; i < upto_tokens; i++)
            for (unsigned b = 0; b < TB; b++)
                if (mem[((size_t)pl * N + (size_t)i) * TB + b] != byte_of(t[i], i, pl, b))
                    return 0;
    return 1;
}

static ferry_kv_buffer buffer_of(unsigned char *mem)
{
    ferry_kv_buffer b = FERRY_KV_BUFFER_INIT;
    b.layout = ft_kv_layout(TB);
    b.base = (uint64_t)(uintptr_t)mem;
    b.capacity_tokens = N;
    return b;
}

/* ---- the daemon ---- */

static pid_t daemon_start(void)
{
    ferry_kv_config kc = store_config();
    kc.l2_dir = g_l2;
    kc.l2_bytes = 256 * PLANES * CT * TB;
    kc.l2_persistent = 1;
    ferry_serve_config sc = FERRY_SERVE_CONFIG_INIT;
    sc.socket_path = g_sock;
    sc.kv = &kc;
    return ft_srv_fork(&sc, FERRY_LOG_ERROR);
}

/* connect, retrying while the daemon starts */
static ferry_kv *client_open(void)
{
    ferry_kv_config c = client_config();
    ferry_kv *kv = NULL;
    for (int i = 0; i < 1000; i++) {
        if (ferry_kv_open(&c, &kv) == 0)
            return kv;
        usleep(5000);
    }
    return NULL;
}

/* ---- a client: stores and retrieves at random until killed ---- */

static int client_main(unsigned seed)
{
    srand(seed);
    ferry_kv *kv = client_open();
    if (!kv)
        return 3;
    unsigned char *mem = malloc((size_t)PLANES * N * TB);
    int32_t t[N];
    if (!mem)
        return 4;
    ferry_kv_buffer b = buffer_of(mem);
    for (;;) {
        int p = rand() % PROMPTS;
        prompt_tokens(p, t);
        if (rand() % 2) {
            fill(mem, t);
            int rc = ferry_kv_store(kv, t, N, NULL, &b);
            if (rc < 0 && rc != FERRY_ECONN && rc != FERRY_ENOSPACE)
                return 5;
            if (rc == FERRY_ECONN)
                usleep(2000); /* the daemon is away: it comes back */
        } else {
            memset(mem, 0xee, (size_t)PLANES * N * TB);
            int rc = ferry_kv_retrieve(kv, t, N, NULL, &b);
            if (rc > 0 && !exact(mem, t, rc)) {
                fprintf(stderr, "client %u: a wrong byte in prompt %d (%d tokens)\n", seed, p,
                        rc);
                return 1;
            }
            if (rc < 0 && rc != FERRY_ECONN)
                return 6;
            if (rc == FERRY_ECONN)
                usleep(2000);
        }
        if (rand() % 8 == 0)
            ferry_kv_sync(kv);
    }
}

static void setup_dirs(void)
{
    ft_tmpdir(g_dir, sizeof g_dir);
    snprintf(g_sock, sizeof g_sock, "%s/ferry.sock", g_dir);
    snprintf(g_l2, sizeof g_l2, "%s/l2", g_dir);
    assert_int_equal(mkdir(g_l2, 0700), 0);
}

/* after a round: every prompt, whatever is found is exact; no slot leaked */
static void verify(void)
{
    ferry_kv *kv = client_open();
    assert_non_null(kv);
    unsigned char *mem = malloc((size_t)PLANES * N * TB);
    assert_non_null(mem);
    ferry_kv_buffer b = buffer_of(mem);
    int32_t t[N];
    long found = 0;
    for (int p = 0; p < PROMPTS; p++) {
        prompt_tokens(p, t);
        memset(mem, 0xee, (size_t)PLANES * N * TB);
        int rc = ferry_kv_retrieve(kv, t, N, NULL, &b);
        assert_true(rc >= 0);
        assert_true(exact(mem, t, rc));
        found += rc;
    }
    printf("verify: %ld tokens of %d prompts found, every byte exact\n", found, PROMPTS);
    /* the pool takes a whole L1 of new chunks (8 prompts of 6, token
     * values of their own) */
    for (int p = 0; p < L1_CHUNKS / PROMPT_CHUNKS; p++) {
        for (int i = 0; i < N; i++)
            t[i] = 900000 + p * N + i + (int)(random() % 1000) * 100000;
        fill(mem, t);
        assert_int_equal(ferry_kv_store(kv, t, N, NULL, &b), N);
    }
    free(mem);
    ferry_kv_close(kv);
}

static void test_kill_both_sides(void **state)
{
    (void)state;
    setup_dirs();
    signal(SIGPIPE, SIG_IGN);
    srandom((unsigned)time(NULL));
    pid_t d = daemon_start();
    pid_t c[CLIENTS];
    for (int k = 0; k < CLIENTS; k++) {
        c[k] = fork();
        if (c[k] == 0)
            _exit(client_main(1000u + (unsigned)k));
    }
    for (int round = 0; round < ROUNDS; round++) {
        usleep((useconds_t)(20000 + random() % 200000));
        int what = (int)(random() % 3); /* 0 the daemon, 1 a client, 2 both */
        if (what != 1) {
            kill(d, SIGKILL);
            waitpid(d, NULL, 0);
        }
        if (what != 0) {
            int k = (int)(random() % CLIENTS);
            kill(c[k], SIGKILL);
            int ws;
            waitpid(c[k], &ws, 0);
            assert_true(WIFSIGNALED(ws)); /* not an exit: a wrong byte would be exit 1 */
            c[k] = fork();
            if (c[k] == 0)
                _exit(client_main(2000u + (unsigned)(round * CLIENTS + k)));
        }
        if (what != 1)
            d = daemon_start();
        /* no client found a wrong byte so far */
        for (int k = 0; k < CLIENTS; k++) {
            int ws;
            pid_t r = waitpid(c[k], &ws, WNOHANG);
            if (r == c[k])
                fail_msg("client %d exited with %d", k, WIFEXITED(ws) ? WEXITSTATUS(ws) : -1);
        }
    }
    for (int k = 0; k < CLIENTS; k++) {
        kill(c[k], SIGKILL);
        int ws;
        waitpid(c[k], &ws, 0);
        assert_true(WIFSIGNALED(ws));
    }
    verify();
    /* and once more after a clean stop: what it synced is back */
    kill(d, SIGTERM);
    int ws;
    waitpid(d, &ws, 0);
    assert_true(WIFEXITED(ws));
    assert_int_equal(WEXITSTATUS(ws), 0);
    d = daemon_start();
    verify();
    kill(d, SIGKILL);
    waitpid(d, NULL, 0);
    ft_rmtree(g_dir);
}

/* ---- a retrieve out of memory at each of its allocations ---- */

#define OOM_CHUNKS 12                      /* a prompt: one batch of a 96-slot pool */
#define OOM_N (OOM_CHUNKS * CT)
#define OOM_L1 96
static pid_t g_oom_daemon;

static void oom_fill(unsigned char *mem, const int32_t *t, int ntok)
{
    for (unsigned pl = 0; pl < PLANES; pl++)
        for (int i = 0; i < ntok; i++)
            for (unsigned b = 0; b < TB; b++)
                mem[((size_t)pl * OOM_N + (size_t)i) * TB + b] = byte_of(t[i], i, pl, b);
}

/* chunk c of mem: 1 exact, 2 all zero (voided), 3 untouched (0xee), 0 else */
static int oom_chunk(const unsigned char *mem, const int32_t *t, int c)
{
    int ex = 1, zero = 1, ee = 1;
    for (unsigned pl = 0; pl < PLANES; pl++)
        for (int i = c * CT; i < (c + 1) * CT; i++)
            for (unsigned b = 0; b < TB; b++) {
                unsigned char v = mem[((size_t)pl * OOM_N + (size_t)i) * TB + b];
                ex &= v == byte_of(t[i], i, pl, b);
                zero &= v == 0;
                ee &= v == 0xee;
            }
    return ex ? 1 : zero ? 2 : ee ? 3 : 0;
}

static ferry_kv *oom_client(void)
{
    ferry_kv_config c = store_config();
    c.l1_bytes = (uint64_t)OOM_L1 * PLANES * CT * TB;
    c.server = g_sock;
    c.server_timeout_ms = 5000;
    ferry_kv *kv = NULL;
    for (int i = 0; i < 1000 && ferry_kv_open(&c, &kv) < 0; i++)
        usleep(5000);
    assert_non_null(kv);
    return kv;
}

/*
 * A retrieve whose k-th allocation fails, for every k: what it returns is
 * exact (a chunk it reports found has the stored bytes; the others hold
 * the stored bytes, zeros or what was there), and afterwards the daemon
 * holds no read lock of it: once the same client stored a whole pool of
 * newer chunks, none of the retrieved ones is left. (A RELEASE that could
 * not be encoded was never sent, over a connection that stayed up: its
 * chunks stayed locked for the lock TTL, five minutes, and outlived the
 * pool's turnover.)
 */
static void oom_leaves_no_lock(int prefetch)
{
    setup_dirs();
    signal(SIGPIPE, SIG_IGN);
    ferry_kv_config kc = store_config();
    kc.l1_bytes = (uint64_t)OOM_L1 * PLANES * CT * TB;
    ferry_serve_config sc = FERRY_SERVE_CONFIG_INIT;
    sc.socket_path = g_sock;
    sc.kv = &kc;
    pid_t d = g_oom_daemon = ft_srv_fork(&sc, FERRY_LOG_ERROR);
    unsigned char *mem = malloc((size_t)PLANES * OOM_N * TB);
    assert_non_null(mem);
    ferry_kv_buffer b = FERRY_KV_BUFFER_INIT;
    b.layout = ft_kv_layout(TB);
    b.base = (uint64_t)(uintptr_t)mem;
    b.capacity_tokens = OOM_N;
    int32_t t[OOM_N];
    int fresh = 0, refused = 1;
    ft_alloc_install(0, 0); /* (the daemon's child keeps libc's) */
    for (uint64_t k = 1; refused && k < 200; k++) {
        ferry_kv *a = oom_client(), *r = oom_client();
        for (int i = 0; i < OOM_N; i++)
            t[i] = 5000000 + fresh++;
        oom_fill(mem, t, OOM_N);
        assert_int_equal(ferry_kv_store(a, t, OOM_N, NULL, &b), OOM_N);
        memset(mem, 0xee, (size_t)PLANES * OOM_N * TB);
        uint64_t f0 = ft_alloc_failures();
        ft_alloc_fail_next(k);
        int rc = prefetch ? ferry_kv_prefetch(r, t, OOM_N, NULL)
                          : ferry_kv_retrieve(r, t, OOM_N, NULL, &b);
        ft_alloc_fail_next(0); /* none from here */
        refused = ft_alloc_failures() != f0;
        if (!refused)
            assert_int_equal(rc, OOM_N);
        if (rc < 0 && rc != -ENOMEM)
            fail_msg("allocation %llu refused: %s %d (%s)", (unsigned long long)k,
                     prefetch ? "prefetch" : "retrieve", rc, ferry_last_error());
        for (int c = 0; c < OOM_CHUNKS; c++) {
            int v = oom_chunk(mem, t, c);
            if (prefetch ? v != 3 : v == 0 || (c * CT < rc && v != 1))
                fail_msg("allocation %llu refused: retrieve %d, chunk %d is %s",
                         (unsigned long long)k, rc, c, v == 0 ? "other bytes" : "not found");
        }
        /* a whole pool of new chunks through the retrieving client */
        int32_t old[OOM_N];
        memcpy(old, t, sizeof old);
        for (int p = 0; p < OOM_L1 / OOM_CHUNKS; p++) {
            for (int i = 0; i < OOM_N; i++)
                t[i] = 5000000 + fresh++;
            oom_fill(mem, t, OOM_N);
            int sr = ferry_kv_store(r, t, OOM_N, NULL, &b);
            if (sr != OOM_N)
                fail_msg("allocation %llu refused in a retrieve: then a store of a pool's "
                         "prompt %d answered %d (%s): the retrieve's chunks are still locked",
                         (unsigned long long)k, p, sr, sr < 0 ? ferry_last_error() : "");
        }
        /* a pool's worth of newer chunks: the retrieved ones made room,
         * unless locked */
        int kept = ferry_kv_lookup(r, old, OOM_N, NULL);
        if (kept != 0)
            fail_msg("allocation %llu refused in a %s (%d: %s): %d of its tokens "
                     "outlived a pool of newer chunks: still read-locked", (unsigned long long)k,
                     prefetch ? "prefetch" : "retrieve", rc, rc < 0 ? ferry_last_error() : "",
                     kept);
        ferry_kv_close(r);
        ferry_kv_close(a);
    }
    ft_alloc_reset();
    assert_false(refused);
    free(mem);
    g_oom_daemon = 0;
    kill(d, SIGTERM);
    int ws;
    waitpid(d, &ws, 0);
    assert_true(WIFEXITED(ws));
    assert_int_equal(WEXITSTATUS(ws), 0);
    ft_rmtree(g_dir);
}

static void test_retrieve_out_of_memory_leaves_no_lock(void **state)
{
    (void)state;
    oom_leaves_no_lock(0);
}

/* the same for a prefetch, whose RELEASE (of the chunks an ACQUIRE
 * found) is a larger frame than the ACQUIRE and grows the frame buffer */
static void test_prefetch_out_of_memory_leaves_no_lock(void **state)
{
    (void)state;
    oom_leaves_no_lock(1);
}

/* a failed run's daemon is not left running */
static int oom_teardown(void **state)
{
    (void)state;
    ft_alloc_reset();
    if (g_oom_daemon > 0) {
        kill(g_oom_daemon, SIGKILL);
        waitpid(g_oom_daemon, NULL, 0);
        g_oom_daemon = 0;
    }
    return 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_retrieve_out_of_memory_leaves_no_lock, oom_teardown),
        cmocka_unit_test_teardown(test_prefetch_out_of_memory_leaves_no_lock, oom_teardown),
        cmocka_unit_test(test_kill_both_sides),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
