/*
 * test_serve_wait.c - a daemon connection waiting for an L1 slot on its
 * client's behalf (back-pressure, pool_wait_ms) stops waiting when that
 * wait can no longer help anyone: its client hangs up (killed, or closed
 * with ferry_kv_close_begin), or the daemon closes (ferry_serve_close, or
 * `ferry serve` given SIGTERM). Each case ends within a second where the
 * wait would have lasted pool_wait_ms (20 s here); the waiter answers a
 * closing daemon's client with a clear error, and no slot it could have
 * taken is left held (the pool takes a whole L1 again afterwards).
 *
 * And what is no hang-up is not cut: a client that half-closes after its
 * last request gets its answers. The accept loop that watches for
 * hang-ups sleeps: idle clients cost it no CPU, nor do clients a daemon
 * out of descriptors cannot take yet.
 */
/* ferry-test-labels: concurrent */
/* ferry-test-timeout: 300 */
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ferry_test.h"
#include "kv/kv_impl.h"
#include "kv/kv_slots.h"
#include "proto/proto.h"
#include "serve_fixture.h"

#define CT 16
#define TB 64u
#define PLANES 4u
#define CHUNK (PLANES * CT * TB)
#define SLOTS 4
#define WAIT_MS 20000 /* what a waiter would wait out */

static char g_dir[256];
static char g_sock[300];
static char g_ferry[4096];

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static ferry_kv_config store_config(void)
{
    ferry_kv_config c = FERRY_KV_CONFIG_INIT;
    c.model = "wait-model";
    c.layout = ft_kv_layout(TB);
    c.chunk_tokens = CT;
    c.l1_bytes = (uint64_t)SLOTS * CHUNK;
    c.workers = 2;
    c.pool_wait_ms = WAIT_MS;
    return c;
}

static int setup(void **state)
{
    (void)state;
    ft_tmpdir(g_dir, sizeof g_dir);
    snprintf(g_sock, sizeof g_sock, "%s/ferry.sock", g_dir);
    signal(SIGPIPE, SIG_IGN);
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    ft_rmtree(g_dir);
    return 0;
}

/* ---- a raw client: the protocol by hand ---- */

typedef ft_raw raw;

/* (a daemon process may still be starting: tried for 30 s) */
static void raw_connect(raw *r)
{
    for (int i = 0; ft_raw_connect(r, g_sock) != 0; i++) {
        if (i > 3000)
            fail_msg("no daemon on %s: %s", g_sock, strerror(errno));
        ft_raw_close(r);
        usleep(10000);
    }
}

/* HELLO, any geometry, no pool: the daemon's slot count */
static uint64_t raw_hello(raw *r)
{
    ferry__proto_req q;
    memset(&q, 0, sizeof q);
    q.hdr.type = FERRY__P_HELLO;
    q.hello.layout = ft_kv_layout(TB);
    q.hello.chunk_tokens = CT;
    q.hello.seed = FERRY_KV_HASH_SEED_DEFAULT;
    q.hello.flags = FERRY__HELLO_NO_POOL | FERRY__HELLO_ANY;
    ft_raw_req(r, &q);
    int32_t rc;
    char msg[256];
    assert_int_equal(ft_raw_reply(r, &rc, msg, sizeof msg), 0);
    assert_int_equal(rc, 0);
    for (int i = 0; i < 7; i++)
        (void)(i == 6 ? ferry__proto_get_u64(&r->rd) : ferry__proto_get_u32(&r->rd));
    (void)ferry__proto_get_u32(&r->rd); /* pool */
    (void)ferry__proto_get_u64(&r->rd); /* chunk bytes */
    (void)ferry__proto_get_u64(&r->rd); /* slot bytes */
    return ferry__proto_get_u64(&r->rd);
}

/* a RESERVE of n chunks (ids from base), sent */
static void raw_reserve_send(raw *r, uint64_t base, uint32_t n)
{
    ferry__proto_chunk ch[64];
    assert_true(n <= 64);
    memset(ch, 0, sizeof ch);
    for (uint32_t i = 0; i < n; i++) {
        ch[i].id.lo = base + i;
        ch[i].id.hi = 0x5eed;
        ch[i].tokens = 1;
    }
    ferry__proto_req q;
    memset(&q, 0, sizeof q);
    q.hdr.type = FERRY__P_RESERVE;
    q.n = n;
    q.chunks = ch;
    ft_raw_req(r, &q);
}

/* its reply: how many chunks were reserved; codes[] each chunk's (n max) */
static int raw_reserve_reply(raw *r, int32_t *codes, uint32_t n)
{
    int32_t rc;
    char msg[256];
    if (ft_raw_reply(r, &rc, msg, sizeof msg) < 0)
        return -1;
    assert_int_equal(r->h.type, FERRY__P_RESERVE | FERRY__PROTO_REPLY);
    assert_int_equal(rc, 0);
    assert_int_equal(ferry__proto_get_u32(&r->rd), n);
    int got = 0;
    for (uint32_t i = 0; i < n; i++) {
        codes[i] = (int32_t)ferry__proto_get_u32(&r->rd);
        (void)ferry__proto_get_u64(&r->rd);
        (void)ferry__proto_get_u64(&r->rd);
        got += codes[i] == 0;
    }
    return got;
}

/* the daemon's store's counters, asked over a connection */
static ferry_kv_stats raw_stats(raw *r)
{
    ferry__proto_req q;
    memset(&q, 0, sizeof q);
    q.hdr.type = FERRY__P_STATS;
    ft_raw_req(r, &q);
    int32_t rc;
    char msg[256];
    assert_int_equal(ft_raw_reply(r, &rc, msg, sizeof msg), 0);
    assert_int_equal(rc, 0);
    (void)ferry__proto_get_u32(&r->rd);
    uint32_t sz = ferry__proto_get_u32(&r->rd);
    ferry_kv_stats m = FERRY_KV_STATS_INIT;
    assert_true(sz <= sizeof m && r->rd.p + sz <= r->rd.end);
    memcpy(&m, r->rd.p, sz);
    return m;
}

/* until the daemon's count of waits for a slot passes `waits` (read
 * through watch): what waits has begun to */
static void wait_begun(raw *watch, uint64_t waits, const char *what)
{
    for (int i = 0; raw_stats(watch).pool_waits == waits; i++) {
        if (i > 500)
            fail_msg("%s never waited", what);
        usleep(10000);
    }
}

/* ---- the pool held whole, a waiter behind it ---- */

#define MAX_HOLDERS 8

typedef struct crowd {
    raw holder[MAX_HOLDERS];
    int nholders;
    raw waiter, watch;
    uint64_t nslots;
    uint64_t waits0; /* pool_waits before the waiter's */
} crowd;

/* every slot reserved, each holder its share (half the pool), then one
 * RESERVE from the waiter, which waits: back once the daemon counts it */
static void crowd_start(crowd *c)
{
    memset(c, 0, sizeof *c);
    raw_connect(&c->watch);
    c->nslots = raw_hello(&c->watch);
    assert_true(c->nslots >= 1 && c->nslots <= 64);
    c->waits0 = raw_stats(&c->watch).pool_waits;
    uint64_t share = c->nslots > 1 ? c->nslots / 2 : 1, held = 0;
    while (held < c->nslots) {
        assert_true(c->nholders < MAX_HOLDERS);
        raw *h = &c->holder[c->nholders++];
        raw_connect(h);
        raw_hello(h);
        uint32_t n = (uint32_t)FERRY__MIN(share, c->nslots - held);
        int32_t codes[64];
        raw_reserve_send(h, 0x1000u * (uint64_t)c->nholders, n);
        assert_int_equal(raw_reserve_reply(h, codes, n), (int)n);
        held += n;
    }
    raw_connect(&c->waiter);
    raw_hello(&c->waiter);
    raw_reserve_send(&c->waiter, 0x900000u, 1);
    wait_begun(&c->watch, c->waits0, "the waiter's RESERVE");
}

static void crowd_close_holders(crowd *c)
{
    for (int i = 0; i < c->nholders; i++)
        ft_raw_close(&c->holder[i]);
    ft_raw_close(&c->watch);
}

/* the daemon (in this process) serves n clients within limit_s: the time
 * it took */
static double clients_become(ferry_serve *s, unsigned n, double limit_s)
{
    double t0 = now_s();
    ferry_serve_stats ss = FERRY_SERVE_STATS_INIT;
    for (;;) {
        FT_ASSERT_OK(ferry_serve_stats_get(s, &ss));
        if (ss.clients == n)
            return now_s() - t0;
        if (now_s() - t0 > limit_s)
            fail_msg("the daemon still serves %u clients after %.1f s (expected %u)",
                     ss.clients, limit_s, n);
        usleep(2000);
    }
}

/* every slot free again: a fresh connection per share reserves the whole
 * pool at once, and the store's index is sound */
static void assert_pool_whole(ferry_serve *s, uint64_t nslots)
{
    ferry_kv *kv = ferry_serve_kv(s);
    FT_ASSERT_OK(ferry__kv_check(kv));
    ferry_kv_stats m = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(kv, &m));
    assert_int_equal(m.tier[FERRY_KV_TIER_L1].chunks, 0);
    assert_int_equal(m.tier[FERRY_KV_TIER_L1].used_bytes, 0);
    raw r[MAX_HOLDERS];
    uint64_t share = nslots > 1 ? nslots / 2 : 1, held = 0;
    int k = 0;
    for (; held < nslots; k++) {
        raw_connect(&r[k]);
        raw_hello(&r[k]);
        uint32_t n = (uint32_t)FERRY__MIN(share, nslots - held);
        int32_t codes[64];
        /* (WAIT 0: decline at once rather than wait for a slot that leaked) */
        ferry__proto_req q;
        memset(&q, 0, sizeof q);
        q.hdr.type = FERRY__P_WAIT;
        ft_raw_req(&r[k], &q);
        int32_t rc;
        char msg[64];
        assert_int_equal(ft_raw_reply(&r[k], &rc, msg, sizeof msg), 0);
        raw_reserve_send(&r[k], 0x70000u * (uint64_t)(k + 1), n);
        assert_int_equal(raw_reserve_reply(&r[k], codes, n), (int)n);
        held += n;
    }
    for (int i = 0; i < k; i++)
        ft_raw_close(&r[i]);
    clients_become(s, 0, 5);
}

static void srv_start(ft_srv *v)
{
    ferry_kv_config kc = store_config();
    ferry_serve_config sc = FERRY_SERVE_CONFIG_INIT;
    sc.socket_path = g_sock;
    sc.kv = &kc;
    ft_srv_open(v, &sc);
}

/* ---- the client hangs up ---- */

static void test_waiter_whose_client_hangs_up_ends(void **state)
{
    (void)state;
    ft_srv v;
    srv_start(&v);
    crowd c;
    crowd_start(&c);
    unsigned n = 2u + (unsigned)c.nholders; /* watch, holders, waiter */
    clients_become(v.s, n, 5);
    ft_raw_close(&c.waiter); /* (as a kill -9 would) */
    double took = clients_become(v.s, n - 1, 10);
    print_message("waiter's thread ended %.3f s after its client hung up\n", took);
    assert_true(took < 1.0);
    ferry_kv_stats m = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(ferry_serve_kv(v.s), &m));
    assert_true(m.pool_wait_us < 1000000); /* the wait itself ended, not just the thread */
    crowd_close_holders(&c);
    clients_become(v.s, 0, 5);
    assert_pool_whole(v.s, c.nslots);
    ft_srv_close(&v);
}

typedef struct store_arg {
    ferry_kv *kv;
    int rc, st;
    double t_end;
    char msg[512];
} store_arg;

static void *store_main(void *p)
{
    store_arg *a = p;
    int32_t tok[CT];
    for (int i = 0; i < CT; i++)
        tok[i] = 4242 + i;
    unsigned char *mem = calloc(PLANES * CT, TB);
    ferry_kv_buffer b = FERRY_KV_BUFFER_INIT;
    b.layout = ft_kv_layout(TB);
    b.base = (uint64_t)(uintptr_t)mem;
    b.capacity_tokens = CT;
    int st[1] = {1};
    ferry_kv_req r = FERRY_KV_REQ_INIT;
    r.status = st;
    r.max_chunks = 1;
    a->rc = ferry_kv_store(a->kv, tok, CT, &r, &b);
    a->st = st[0];
    a->t_end = now_s();
    snprintf(a->msg, sizeof a->msg, "%s", ferry_kv_last_error(a->kv));
    free(mem);
    return NULL;
}

static ferry_kv *client_open(void)
{
    ferry_kv_config c = store_config();
    c.server = g_sock;
    c.server_timeout_ms = 2000;
    c.l1_bytes = 1;
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    return kv;
}

/* a client's store waits in the daemon; ferry_kv_close_begin drops its
 * connection: the daemon's waiter goes with it */
static void test_waiter_whose_client_closes_ends(void **state)
{
    (void)state;
    ft_srv v;
    srv_start(&v);
    crowd c;
    crowd_start(&c);
    ft_raw_close(&c.waiter);
    unsigned n = 1u + (unsigned)c.nholders;
    clients_become(v.s, n, 5);
    uint64_t waits = raw_stats(&c.watch).pool_waits;
    store_arg a = {client_open(), 1, 1, 0, ""};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, store_main, &a), 0);
    wait_begun(&c.watch, waits, "the client's store");
    ferry_kv_close_begin(a.kv);
    double t0 = now_s();
    pthread_join(th, NULL);
    double took = clients_become(v.s, n, 10) + (now_s() - t0);
    print_message("store returned %d (%s); the daemon's waiter ended within %.3f s\n", a.rc,
                  a.msg, took);
    assert_true(a.rc < 0 || a.st < 0);
    assert_true(took < 1.0);
    ferry_kv_close(a.kv);
    crowd_close_holders(&c);
    clients_become(v.s, 0, 5);
    assert_pool_whole(v.s, c.nslots);
    ft_srv_close(&v);
}

/* ---- the daemon closes ---- */

static void test_close_answers_its_waiters(void **state)
{
    (void)state;
    ft_srv v;
    srv_start(&v);
    crowd c;
    crowd_start(&c);
    uint64_t waits = raw_stats(&c.watch).pool_waits;
    store_arg a = {client_open(), 1, 1, 0, ""};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, store_main, &a), 0);
    wait_begun(&c.watch, waits, "the client's store");
    double t0 = now_s();
    ft_srv_close(&v);
    double took = now_s() - t0;
    pthread_join(th, NULL);
    print_message("serve close took %.3f s; the client's store returned %d/%d after %.3f s: "
                  "%s\n", took, a.rc, a.st, a.t_end - t0, a.msg);
    assert_true(took < 1.0);
    assert_true(a.t_end - t0 < 1.5);
    assert_true(a.rc < 0 || a.st < 0);
    /* the client's message says why (the daemon's word, when its asking
     * why was still read) or names what the daemon answered - not only
     * the broken pipe its asking why met once the daemon read no more */
    assert_true(strstr(a.msg, "the daemon is closing") || strstr(a.msg, "ECANCELED"));
    /* the raw waiter: its RESERVE answered, the chunk declined as cancelled */
    int32_t code = 0;
    assert_int_equal(raw_reserve_reply(&c.waiter, &code, 1), 0);
    assert_int_equal(code, -ECANCELED);
    ft_raw_close(&c.waiter);
    ferry_kv_close(a.kv);
    crowd_close_holders(&c);
}

/*
 * The slots held by something a connection's end does not free (here the
 * daemon's store reserving them itself; in life a write-through that does
 * not finish, a slot retired): before, close joined a waiter that waited
 * its pool_wait_ms out. (The reservations go with the store's close.)
 */
static void test_close_with_slots_held_in_the_daemon(void **state)
{
    (void)state;
    ft_srv v;
    srv_start(&v);
    ferry_kv *skv = ferry_serve_kv(v.s);
    for (uint64_t i = 0; i < SLOTS; i++) {
        ferry__kv_entry *e;
        uint64_t slot, gen;
        ferry_kv_hash id = {0xabc0u + i, 0x1d};
        FT_ASSERT_OK(ferry__kv_slot_reserve(skv, id, 1, &e, &slot, &gen));
    }
    raw w;
    raw_connect(&w);
    raw_hello(&w);
    uint64_t waits = raw_stats(&w).pool_waits;
    raw_reserve_send(&w, 0x900000u, 1);
    raw watch;
    raw_connect(&watch);
    raw_hello(&watch);
    wait_begun(&watch, waits, "the waiter's RESERVE");
    double t0 = now_s();
    ft_srv_close(&v);
    double took = now_s() - t0;
    print_message("serve close with the pool held in the daemon took %.3f s\n", took);
    assert_true(took < 1.0);
    int32_t code = 0;
    assert_int_equal(raw_reserve_reply(&w, &code, 1), 0);
    assert_int_equal(code, -ECANCELED);
    ft_raw_close(&w);
    ft_raw_close(&watch);
}

/* `ferry serve` given SIGTERM while a client waits exits at once */
static void test_sigterm_while_a_client_waits(void **state)
{
    (void)state;
    if (access(g_ferry, X_OK) != 0) {
        print_message("skip: %s not built\n", g_ferry);
        skip();
    }
    char conf[320], log[320];
    snprintf(conf, sizeof conf, "%s/serve.yaml", g_dir);
    snprintf(log, sizeof log, "%s/serve.log", g_dir);
    FILE *f = fopen(conf, "w");
    assert_non_null(f);
    fprintf(f, "model: tiny\nl1_bytes: 4M\nsocket: %s\nworkers: 2\npool_wait_ms: %d\n", g_sock,
            WAIT_MS);
    fclose(f);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        dup2(fd, 2);
        execl(g_ferry, g_ferry, "serve", "--config", conf, (char *)NULL);
        _exit(127);
    }
    crowd c;
    crowd_start(&c);
    double t0 = now_s();
    kill(pid, SIGTERM);
    int st = 0;
    for (;;) {
        pid_t w = waitpid(pid, &st, WNOHANG);
        if (w == pid)
            break;
        if (now_s() - t0 > 60) {
            kill(pid, SIGKILL);
            waitpid(pid, &st, 0);
            fail_msg("ferry serve did not exit within 60 s of SIGTERM");
        }
        usleep(2000);
    }
    double took = now_s() - t0;
    print_message("ferry serve (%llu slots) exited %.3f s after SIGTERM\n",
                  (unsigned long long)c.nslots, took);
    assert_true(WIFEXITED(st));
    assert_int_equal(WEXITSTATUS(st), 0);
    assert_true(took < 2.0);
    int32_t code = 0;
    assert_int_equal(raw_reserve_reply(&c.waiter, &code, 1), 0);
    assert_int_equal(code, -ECANCELED);
    ft_raw_close(&c.waiter);
    crowd_close_holders(&c);
}

/* ---- what is not a hang-up ---- */

/* a client that half-closes (shutdown SHUT_WR) after its last request
 * still reads the answers: its connection is not cut, and its waiting
 * RESERVE gets the slot that frees (its PING, pipelined behind it, its
 * answer too) */
static void test_half_closed_waiter_is_not_cut(void **state)
{
    (void)state;
    ft_srv v;
    srv_start(&v);
    crowd c;
    crowd_start(&c);
    ferry__proto_req q;
    memset(&q, 0, sizeof q);
    q.hdr.type = FERRY__P_PING;
    ft_raw_req(&c.waiter, &q);
    assert_int_equal(shutdown(c.waiter.fd, SHUT_WR), 0);
    usleep(200000); /* (the accept loop has looked at it by now) */
    ft_raw_close(&c.holder[0]); /* its slots free: the waiter's turn */
    int32_t code = 1;
    assert_int_equal(raw_reserve_reply(&c.waiter, &code, 1), 1);
    assert_int_equal(code, 0);
    int32_t rc = 1;
    char msg[64];
    assert_int_equal(ft_raw_reply(&c.waiter, &rc, msg, sizeof msg), 0);
    assert_int_equal(c.waiter.h.type, FERRY__P_PING | FERRY__PROTO_REPLY);
    assert_int_equal(rc, 0);
    ft_raw_close(&c.waiter);
    crowd_close_holders(&c);
    clients_become(v.s, 0, 5);
    assert_pool_whole(v.s, c.nslots);
    ft_srv_close(&v);
}

static double cpu_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

/* idle clients cost the accept loop nothing: it sleeps in poll */
static void test_idle_clients_cost_no_cpu(void **state)
{
    (void)state;
    ft_srv v;
    srv_start(&v);
    enum { N = 64 };
    static raw r[N];
    for (int i = 0; i < N; i++) {
        raw_connect(&r[i]);
        raw_hello(&r[i]);
    }
    /* one half-closed, one hung up whose thread has gone */
    assert_int_equal(shutdown(r[0].fd, SHUT_WR), 0);
    clients_become(v.s, N - 1, 5);
    usleep(100000);
    double c0 = cpu_s(), t0 = now_s();
    usleep(2000000);
    double cpu = cpu_s() - c0, wall = now_s() - t0;
    print_message("%d idle clients: %.4f s of CPU in %.2f s\n", N, cpu, wall);
    assert_true(cpu < 0.1);
    t0 = now_s();
    ft_srv_close(&v);
    double took = now_s() - t0;
    print_message("close with %d idle clients took %.3f s\n", N, took);
    assert_true(took < 1.0); /* (their threads end at once: no grace waited out) */
    for (int i = 0; i < N; i++)
        ft_raw_close(&r[i]);
}

/* many clients waiting when the daemon closes: every wait ends, each
 * answered -ECANCELED, within the grace */
static void test_close_with_many_waiters(void **state)
{
    (void)state;
    ft_srv v;
    srv_start(&v);
    crowd c;
    crowd_start(&c);
    enum { N = 48 };
    static raw w[N];
    uint64_t waits = raw_stats(&c.watch).pool_waits;
    for (int i = 0; i < N; i++) {
        raw_connect(&w[i]);
        raw_hello(&w[i]);
        raw_reserve_send(&w[i], 0xa00000u + 0x100u * (uint64_t)i, 1);
    }
    for (int i = 0; raw_stats(&c.watch).pool_waits < waits + N; i++) {
        if (i > 1000)
            fail_msg("the %d waiters' RESERVEs never all waited", N);
        usleep(10000);
    }
    double t0 = now_s();
    ft_srv_close(&v);
    double took = now_s() - t0;
    print_message("close with %d clients waiting took %.3f s\n", N + 1, took);
    assert_true(took < 1.0);
    for (int i = 0; i < N; i++) {
        int32_t code = 0;
        assert_int_equal(raw_reserve_reply(&w[i], &code, 1), 0);
        assert_int_equal(code, -ECANCELED);
        ft_raw_close(&w[i]);
    }
    int32_t code = 0;
    assert_int_equal(raw_reserve_reply(&c.waiter, &code, 1), 0);
    assert_int_equal(code, -ECANCELED);
    ft_raw_close(&c.waiter);
    crowd_close_holders(&c);
}

/* the CPU time (s) of process pid so far */
static double proc_cpu_s(pid_t pid)
{
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    size_t k = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[k] = 0;
    char *p = strrchr(buf, ')');
    assert_non_null(p);
    unsigned long ut = 0, st = 0;
    /* after ")": state ppid pgrp session tty tpgid flags minflt cminflt
     * majflt cmajflt, then utime stime */
    assert_int_equal(
        sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu", &ut, &st), 2);
    return (double)(ut + st) / (double)sysconf(_SC_CLK_TCK);
}

/* the descriptors this process has open */
static int fds_open(void)
{
    int n = 0;
    for (int fd = 0; fd < 4096; fd++)
        n += fcntl(fd, F_GETFD) >= 0;
    return n;
}

/*
 * A daemon out of descriptors (more clients than its open files limit
 * lets it take) rests its socket instead of polling it hot: accept failed
 * EMFILE with the connection still pending, so the socket stayed readable
 * and the loop spun (a core, and a warning a turn). The clients it could
 * not take wait in the backlog and are served once others leave.
 */
static void test_daemon_out_of_descriptors_does_not_spin(void **state)
{
    (void)state;
    ferry_kv_config kc = store_config();
    ferry_serve_config sc = FERRY_SERVE_CONFIG_INIT;
    sc.socket_path = g_sock;
    sc.kv = &kc;
    struct rlimit old, low;
    assert_int_equal(getrlimit(RLIMIT_NOFILE, &old), 0);
    low = old;
    low.rlim_cur = (rlim_t)fds_open() + 32; /* (the daemon's own, then a few clients) */
    assert_true(low.rlim_cur <= old.rlim_cur);
    assert_int_equal(setrlimit(RLIMIT_NOFILE, &low), 0);
    pid_t pid = ft_srv_fork(&sc, FERRY_LOG_ERROR);
    assert_int_equal(setrlimit(RLIMIT_NOFILE, &old), 0);
    enum { N = 64 };
    static raw r[N];
    for (int i = 0; i < N; i++)
        raw_connect(&r[i]);
    raw_hello(&r[0]); /* (served: the daemon is up) */
    usleep(300000);
    double c0 = proc_cpu_s(pid), t0 = now_s();
    usleep(2000000);
    double cpu = proc_cpu_s(pid) - c0, wall = now_s() - t0;
    print_message("a daemon out of descriptors, %d clients: %.3f s of CPU in %.2f s\n", N, cpu,
                  wall);
    /* the others leave: the last one in the backlog is served */
    for (int i = 0; i < N - 1; i++)
        ft_raw_close(&r[i]);
    struct timeval tv = {10, 0};
    assert_int_equal(setsockopt(r[N - 1].fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv), 0);
    raw_hello(&r[N - 1]);
    ft_raw_close(&r[N - 1]);
    kill(pid, SIGTERM);
    int st = 0;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    assert_true(WIFEXITED(st));
    assert_int_equal(WEXITSTATUS(st), 0);
    assert_true(cpu < 0.25);
}

/* a PING answered on r */
static void raw_ping(raw *r)
{
    ferry__proto_req q;
    memset(&q, 0, sizeof q);
    q.hdr.type = FERRY__P_PING;
    ft_raw_req(r, &q);
    int32_t rc = 1;
    char msg[64];
    assert_int_equal(ft_raw_reply(r, &rc, msg, sizeof msg), 0);
    assert_int_equal(r->h.type, FERRY__P_PING | FERRY__PROTO_REPLY);
    assert_int_equal(rc, 0);
}

static void *run_main(void *p)
{
    ft_srv *v = p;
    intptr_t rc = ferry_serve_run(v->s);
    return (void *)rc;
}

/*
 * The open files limit lowered under a running daemon (prlimit, or the
 * process that hosts it) below the connections it watches: poll refuses
 * more descriptors than the limit (EINVAL), which must not end the
 * daemon's loop; it goes on, its clients served.
 */
static void test_limit_lowered_under_the_daemon(void **state)
{
    (void)state;
    ferry_kv_config kc = store_config();
    ferry_serve_config sc = FERRY_SERVE_CONFIG_INIT;
    sc.socket_path = g_sock;
    sc.kv = &kc;
    ft_srv v;
    FT_ASSERT_OK(ferry_serve_open(&sc, &v.s));
    assert_int_equal(pthread_create(&v.th, NULL, run_main, &v), 0);
    enum { N = 48 };
    static raw r[N];
    for (int i = 0; i < N; i++) {
        raw_connect(&r[i]);
        raw_hello(&r[i]);
    }
    struct rlimit old, low;
    assert_int_equal(getrlimit(RLIMIT_NOFILE, &old), 0);
    low = old;
    low.rlim_cur = N / 2;
    assert_int_equal(setrlimit(RLIMIT_NOFILE, &low), 0);
    usleep(1200000); /* (the loop polls at least every 500 ms) */
    raw_ping(&r[1]);
    ft_raw_close(&r[0]);
    clients_become(v.s, N - 1, 5);
    assert_int_equal(setrlimit(RLIMIT_NOFILE, &old), 0);
    raw_ping(&r[1]);
    for (int i = 1; i < N; i++)
        ft_raw_close(&r[i]);
    clients_become(v.s, 0, 5);
    ferry_serve_stop(v.s);
    void *rc = NULL;
    pthread_join(v.th, &rc);
    assert_int_equal((intptr_t)rc, 0);
    FT_ASSERT_OK(ferry_serve_close(v.s));
}

int main(void)
{
    char self[4096];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n > 0) {
        self[n] = 0;
        snprintf(g_ferry, sizeof g_ferry, "%s/../ferry", dirname(self));
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_waiter_whose_client_hangs_up_ends, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_waiter_whose_client_closes_ends, setup, teardown),
        cmocka_unit_test_setup_teardown(test_close_answers_its_waiters, setup, teardown),
        cmocka_unit_test_setup_teardown(test_close_with_slots_held_in_the_daemon, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_sigterm_while_a_client_waits, setup, teardown),
        cmocka_unit_test_setup_teardown(test_half_closed_waiter_is_not_cut, setup, teardown),
        cmocka_unit_test_setup_teardown(test_idle_clients_cost_no_cpu, setup, teardown),
        cmocka_unit_test_setup_teardown(test_close_with_many_waiters, setup, teardown),
        cmocka_unit_test_setup_teardown(test_limit_lowered_under_the_daemon, setup, teardown),
        cmocka_unit_test_setup_teardown(test_daemon_out_of_descriptors_does_not_spin,
                                        setup, teardown),
    };
    if (getenv("FT_FILTER")) /* (one test by name, when chasing one) */
        cmocka_set_test_filter(getenv("FT_FILTER"));
    return cmocka_run_group_tests(tests, NULL, NULL);
}
