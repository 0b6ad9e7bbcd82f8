/*
 * test_kv_pressure.c - the store under pressure, one contract in process
 * and through a `ferry serve` daemon (ferry/kv.h, pool_wait_ms): every case
 * runs twice, against a store in this process and against clients of a
 * daemon started on a thread here, and asserts the same return values,
 * statuses and messages both ways.
 *
 * The pool is crowded by layerwise stores left unfinished: each holds its
 * chunks' slots reserved (at most half of L1 each) until it is freed.
 */
/* ferry-test-labels: concurrent */
/* ferry-test-timeout: 300 */
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ferry/device.h"
#include "ferry/kv.h"
#include "ferry/serve.h"
#include "ferry_test.h"
#include "serve_fixture.h"

#define CT 16u                 /* tokens per chunk */
#define L 4u                   /* layers */
#define TB 64u                 /* bytes per token and plane */
#define PLANES (2u * L)
#define CHUNK_BYTES (PLANES * CT * TB)
#define SLOTS 8u               /* the pool */
#define MAXCH 512u             /* chunks a test prompt has at most */
#define BIG 256u               /* the pool of the retrieve from L2 */
#define MAXTOK (MAXCH * CT)

enum { INPROC = 0, DAEMON = 1 };

static char g_dir[256];
static char g_sock[300];
static char g_l2[300];

static ferry_kv_layout layout(void)
{
    ferry_kv_layout l = FERRY_KV_LAYOUT_INIT;
    l.num_layers = L;
    l.kv = 2;
    l.num_heads = 2;
    l.head_dim = TB / 4;
    l.dtype = FERRY_DTYPE_BF16;
    return l;
}

static ferry_kv_config config(uint64_t slots, int wait_ms)
{
    ferry_kv_config c = FERRY_KV_CONFIG_INIT;
    c.model = "pressure";
    c.layout = layout();
    c.chunk_tokens = CT;
    c.l1_bytes = slots * CHUNK_BYTES;
    c.workers = 2;
    c.pool_wait_ms = wait_ms;
    return c;
}

/* one side of the contract: a store in process, or a daemon and its
 * clients (each ferry_kv a connection of its own) */
typedef struct env {
    int mode;
    int wait_ms;
    ferry_kv *home;            /* in process: the store; daemon: its hosted store */
    ft_srv srv;
} env;

static void env_open(env *e, int mode, uint64_t slots, int wait_ms, int l2)
{
    memset(e, 0, sizeof *e);
    e->mode = mode;
    e->wait_ms = wait_ms;
    ferry_kv_config c = config(slots, wait_ms);
    if (l2) {
        c.l2_dir = g_l2;
        c.l2_bytes = 64u << 20;
        c.l2_direct = 0;
    }
    if (mode == INPROC) {
        FT_ASSERT_OK(ferry_kv_open(&c, &e->home));
        return;
    }
    ferry_serve_config sc = FERRY_SERVE_CONFIG_INIT;
    sc.socket_path = g_sock;
    sc.kv = &c;
    ft_srv_open(&e->srv, &sc);
    e->home = ferry_serve_kv(e->srv.s);
}

/* a caller: in process the store itself (shared by threads), through the
 * daemon a client of its own with the env's deadline */
static ferry_kv *env_client(env *e)
{
    if (e->mode == INPROC)
        return e->home;
    ferry_kv_config c = config(1, e->wait_ms);
    c.server = g_sock;
    c.server_timeout_ms = 5000;
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    return kv;
}

static void env_unclient(env *e, ferry_kv *kv)
{
    if (e->mode == DAEMON)
        ferry_kv_close(kv);
}

static void env_close(env *e)
{
    if (e->mode == INPROC)
        ferry_kv_close(e->home);
    else
        ft_srv_close(&e->srv);
}

/* ---- prompts and their bytes ---- */

static unsigned char g_img[PLANES * MAXTOK * TB];

static ferry_kv_buffer buffer(unsigned char *img)
{
    ferry_kv_buffer b = FERRY_KV_BUFFER_INIT;
    b.layout = layout();
    b.mem = FERRY_KV_MEM_HOST;
    b.base = (uintptr_t)img;
    b.capacity_tokens = MAXTOK;
    return b;
}

static void tokens(int32_t *t, size_t n, int32_t base)
{
    for (size_t i = 0; i < n; i++)
        t[i] = base + (int32_t)i;
}

static void fill_image(void)
{
    for (size_t i = 0; i < sizeof g_img; i++)
        g_img[i] = (unsigned char)(i * 131 + i / 4096);
}

static uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* layerwise stores of nch chunks in all from base, left unfinished: each
 * reserves its window (a quarter of a pool of `slots`) and holds those
 * slots until freed (unhold) */
#define HOLD_OPS 8u
typedef struct held {
    ferry_kv_op *op[HOLD_OPS];
    size_t n;
} held;

static held hold(ferry_kv *kv, int32_t base, size_t nch, size_t slots)
{
    static int32_t tok[MAXTOK];
    held h = {.n = 0};
    size_t w = slots / 4 ? slots / 4 : 1;
    for (size_t at = 0; at < nch; at += w) {
        size_t k = nch - at < w ? nch - at : w;
        assert_true(h.n < HOLD_OPS);
        tokens(tok, k * CT, base + (int32_t)(at * CT));
        ferry_kv_buffer b = buffer(g_img);
        FT_ASSERT_OK(ferry_kv_store_layers(kv, tok, k * CT, NULL, &b, NULL, &h.op[h.n]));
        h.n++;
    }
    return h;
}

static void unhold(held *h)
{
    for (size_t i = 0; i < h->n; i++)
        ferry_kv_op_free(h->op[i]);
    h->n = 0;
}

static int store(ferry_kv *kv, int32_t base, size_t nch, int *st)
{
    static _Thread_local int32_t tok[MAXTOK];
    tokens(tok, nch * CT, base);
    ferry_kv_req rq = FERRY_KV_REQ_INIT;
    rq.status = st;
    rq.max_chunks = nch;
    ferry_kv_buffer b = buffer(g_img);
    return ferry_kv_store(kv, tok, nch * CT, &rq, &b);
}

static int lookup(ferry_kv *kv, int32_t base, size_t nch)
{
    static int32_t tok[MAXTOK];
    tokens(tok, nch * CT, base);
    return ferry_kv_lookup(kv, tok, nch * CT, NULL);
}

/* ---- the cases, each run both ways ---- */

/* a pool held whole by other writers: a store that placed nothing fails
 * FERRY_ENOSPACE, its chunks FERRY_ENOSPACE, with a message naming the
 * pool and what holds it; after waiting its deadline (0: at once) */
static void full_declines(int mode, int wait_ms)
{
    env e;
    env_open(&e, mode, SLOTS, wait_ms, 0);
    ferry_kv *a = env_client(&e), *b = env_client(&e), *c = env_client(&e);
    held ha = hold(a, 100000, SLOTS / 2, SLOTS), hb = hold(b, 200000, SLOTS / 2, SLOTS);
    int st[4] = {1, 1, 1, 1};
    uint64_t t0 = now_ms();
    int r = store(c, 300000, 4, st);
    uint64_t took = now_ms() - t0;
    assert_int_equal(r, FERRY_ENOSPACE);
    assert_int_equal(st[0], FERRY_ENOSPACE);
    const char *msg = ferry_kv_last_error(c);
    assert_non_null(strstr(msg, "no L1 slot"));
    assert_non_null(strstr(msg, "the L1 pool's 8 slots"));
    assert_non_null(strstr(msg, "8 being written"));
    assert_true(took + 5 >= (uint64_t)wait_ms);
    assert_true(took < (uint64_t)wait_ms + 3000);
    ferry_kv_stats m = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(e.home, &m));
    assert_true(m.pool_declines >= 1);
    if (wait_ms)
        assert_true(m.pool_waits >= 1);
    if (mode == DAEMON) { /* who holds it, by client; and the client's own counters */
        assert_non_null(strstr(msg, "clients: pid"));
        assert_non_null(strstr(msg, "(2 reserved)")); /* (a window: a quarter) */
        ferry_serve_client cl[8];
        int n = ferry_serve_clients(e.srv.s, cl, 8, sizeof cl[0]);
        assert_true(n >= 3);
        uint64_t declines = 0, waits = 0;
        for (int i = 0; i < n && i < 8; i++) {
            assert_int_equal(cl[i].pid, (int32_t)getpid());
            declines += cl[i].declines;
            waits += cl[i].waits;
        }
        assert_true(declines >= 1);
        assert_true(wait_ms == 0 || waits >= 1);
    }
    /* freed, the pool takes the store */
    unhold(&ha);
    unhold(&hb);
    assert_int_equal(store(c, 300000, 4, st), (int)(4 * CT));
    assert_int_equal(st[3], 0);
    env_unclient(&e, a);
    env_unclient(&e, b);
    env_unclient(&e, c);
    env_close(&e);
}

static void test_full_declines(void **state)
{
    (void)state;
    for (int mode = INPROC; mode <= DAEMON; mode++) {
        full_declines(mode, 0);
        full_declines(mode, 60);
    }
}

/* a store that finds the pool full waits: the slots that free within its
 * deadline take it */
typedef struct bg {
    ferry_kv *kv;
    int32_t base;
    size_t nch;
    int together;
    int rc;
    int st[MAXCH];
} bg;

static pthread_barrier_t g_start; /* the eight writers start together */

static void *bg_store(void *arg)
{
    bg *g = arg;
    if (g->together)
        pthread_barrier_wait(&g_start);
    g->rc = store(g->kv, g->base, g->nch, g->st);
    return NULL;
}

/* until the store's waits counter reaches n: the event that a store on
 * another thread found the pool full and is waiting (a sleep would only
 * guess how soon that thread runs, which a loaded machine can exceed) */
static void await_waits(ferry_kv *home, uint64_t n)
{
    ferry_kv_stats m = FERRY_KV_STATS_INIT;
    uint64_t t0 = now_ms();
    for (;;) {
        FT_ASSERT_OK(ferry_kv_stats_get(home, &m));
        if (m.pool_waits >= n)
            return;
        assert_true(now_ms() - t0 < 60000); /* (never waited: fail, not hang) */
        usleep(1000);
    }
}

static void wait_then_proceed(int mode)
{
    env e;
    env_open(&e, mode, SLOTS, 5000, 0);
    ferry_kv *a = env_client(&e), *b = env_client(&e), *c = env_client(&e);
    held ha = hold(a, 100000, SLOTS / 2, SLOTS), hb = hold(b, 200000, SLOTS / 2, SLOTS);
    bg g = {.kv = c, .base = 300000, .nch = 6};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, bg_store, &g), 0);
    await_waits(e.home, 1); /* it waits; then the slots stay held 150 ms more */
    usleep(150 * 1000);
    unhold(&ha); /* frees half of the pool; the other half stays held */
    pthread_join(th, NULL);
    assert_int_equal(g.rc, (int)(6 * CT));
    for (size_t i = 0; i < 6; i++)
        assert_int_equal(g.st[i], 0);
    ferry_kv_stats m = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(e.home, &m));
    assert_true(m.pool_waits >= 1);
    assert_int_equal(m.pool_declines, 0);
    assert_true(m.pool_wait_us >= 100u * 1000);
    unhold(&hb);
    env_unclient(&e, a);
    env_unclient(&e, b);
    env_unclient(&e, c);
    env_close(&e);
}

static void test_wait_then_proceed(void **state)
{
    (void)state;
    wait_then_proceed(INPROC);
    wait_then_proceed(DAEMON);
}

/* a store longer than the free part of the pool streams through it in
 * pieces that fit: everything stored, none declined */
static void stream_pieces(int mode)
{
    env e;
    env_open(&e, mode, SLOTS, 2000, 0);
    ferry_kv *a = env_client(&e), *c = env_client(&e);
    held ha = hold(a, 100000, SLOTS / 2, SLOTS);
    int st[3 * SLOTS];
    assert_int_equal(store(c, 300000, 3 * SLOTS, st), (int)(3 * SLOTS * CT));
    for (size_t i = 0; i < 3 * SLOTS; i++)
        assert_int_equal(st[i], 0);
    unhold(&ha);
    env_unclient(&e, a);
    env_unclient(&e, c);
    env_close(&e);
}

static void test_stream_pieces(void **state)
{
    (void)state;
    stream_pieces(INPROC);
    stream_pieces(DAEMON);
}

/* two callers each holding half the pool and wanting more: neither waits
 * for the other forever; both get FERRY_ENOSPACE within the deadline */
typedef struct dl {
    env *e;
    ferry_kv *kv;
    int32_t base;
    int rc;
    uint64_t took;
} dl;

static void *dl_run(void *arg)
{
    dl *d = arg;
    int st[4];
    uint64_t t0 = now_ms();
    d->rc = store(d->kv, d->base, 4, st);
    d->took = now_ms() - t0;
    return NULL;
}

static void no_deadlock(int mode)
{
    env e;
    env_open(&e, mode, SLOTS, 150, 0);
    ferry_kv *a = env_client(&e), *b = env_client(&e);
    held ha = hold(a, 100000, SLOTS / 2, SLOTS), hb = hold(b, 200000, SLOTS / 2, SLOTS);
    dl da = {&e, a, 300000, 0, 0}, db = {&e, b, 400000, 0, 0};
    pthread_t ta, tb;
    assert_int_equal(pthread_create(&ta, NULL, dl_run, &da), 0);
    assert_int_equal(pthread_create(&tb, NULL, dl_run, &db), 0);
    pthread_join(ta, NULL);
    pthread_join(tb, NULL);
    assert_int_equal(da.rc, FERRY_ENOSPACE);
    assert_int_equal(db.rc, FERRY_ENOSPACE);
    assert_true(da.took < 150 + 3000 && db.took < 150 + 3000);
    /* one lets go: the other's next store proceeds */
    unhold(&ha);
    int st[4];
    assert_int_equal(store(b, 400000, 4, st), (int)(4 * CT));
    unhold(&hb);
    env_unclient(&e, a);
    env_unclient(&e, b);
    env_close(&e);
}

static void test_no_deadlock(void **state)
{
    (void)state;
    no_deadlock(INPROC);
    no_deadlock(DAEMON);
}

/* chunks another writer holds: a plain store and a layerwise store agree
 * (0, the chunks FERRY_ELOCKED, a message saying they were skipped) */
static void locked_agree(int mode)
{
    env e;
    env_open(&e, mode, 4 * SLOTS, 50, 0); /* (a window of 8: the three in one op) */
    ferry_kv *a = env_client(&e), *c = env_client(&e);
    held ha = hold(a, 100000, 3, 4 * SLOTS);
    assert_int_equal(ha.n, 1);
    int st[3] = {1, 1, 1};
    assert_int_equal(store(c, 100000, 3, st), 0);
    for (size_t i = 0; i < 3; i++)
        assert_int_equal(st[i], FERRY_ELOCKED);
    assert_non_null(strstr(ferry_kv_last_error(c), "another writer"));

    int32_t tok[3 * CT];
    tokens(tok, 3 * CT, 100000);
    int lst[3] = {1, 1, 1};
    ferry_kv_req rq = FERRY_KV_REQ_INIT;
    rq.status = lst;
    rq.max_chunks = 3;
    ferry_kv_buffer b = buffer(g_img);
    ferry_kv_op *op = NULL;
    FT_ASSERT_OK(ferry_kv_store_layers(c, tok, 3 * CT, &rq, &b, NULL, &op));
    assert_int_equal(ferry_kv_op_wait(op, 5000), 0);
    for (size_t i = 0; i < 3; i++)
        assert_int_equal(lst[i], FERRY_ELOCKED);
    assert_non_null(strstr(ferry_kv_last_error(c), "another writer"));
    ferry_kv_op_free(op);
    unhold(&ha);
    env_unclient(&e, a);
    env_unclient(&e, c);
    env_close(&e);
}

static void test_locked_agree(void **state)
{
    (void)state;
    locked_agree(INPROC);
    locked_agree(DAEMON);
}

/* eight writers storing four times the pool at once: none declined with
 * the default deadline */
#define WRITERS 8
static void eight_writers(int mode)
{
    env e;
    env_open(&e, mode, 2 * SLOTS, FERRY_KV_POOL_WAIT_MS_DEFAULT, 0);
    static bg g[WRITERS];
    pthread_t th[WRITERS];
    const size_t nch = 8 * SLOTS; /* each writer four times the pool */
    for (int round = 0; round < 3; round++) {
        pthread_barrier_init(&g_start, NULL, WRITERS);
        for (int w = 0; w < WRITERS; w++) {
            memset(&g[w], 0, sizeof g[w]);
            g[w].kv = env_client(&e);
            g[w].base = 1000000 * (w + 1) + 100000 * round;
            g[w].nch = nch;
            g[w].together = 1;
            assert_int_equal(pthread_create(&th[w], NULL, bg_store, &g[w]), 0);
        }
        for (int w = 0; w < WRITERS; w++) {
            pthread_join(th[w], NULL);
            assert_int_equal(g[w].rc, (int)(nch * CT));
            for (size_t i = 0; i < nch; i++)
                assert_int_equal(g[w].st[i], 0);
            env_unclient(&e, g[w].kv);
        }
        pthread_barrier_destroy(&g_start);
    }
    ferry_kv_stats m = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(e.home, &m));
    assert_int_equal(m.pool_declines, 0);
    env_close(&e);
}

static void test_eight_writers(void **state)
{
    (void)state;
    eight_writers(INPROC);
    eight_writers(DAEMON);
}

/* twice the pool stored, flushed to L2, then read back while the daemon
 * and its clients share one core: every chunk a lookup reported comes
 * back, byte for byte; none FERRY_ENOTFOUND */
static void one_core_retrieve(int mode)
{
    cpu_set_t one, all;
    assert_int_equal(sched_getaffinity(0, sizeof all, &all), 0);
    CPU_ZERO(&one);
    for (int i = 0; i < CPU_SETSIZE; i++)
        if (CPU_ISSET(i, &all)) {
            CPU_SET(i, &one);
            break;
        }
    env e;
    env_open(&e, mode, BIG, FERRY_KV_POOL_WAIT_MS_DEFAULT, 1);
    assert_int_equal(sched_setaffinity(0, sizeof one, &one), 0);
    ferry_kv *c = env_client(&e), *o = env_client(&e);
    const size_t nch = 2 * BIG;
    static int st[2 * BIG];
    for (int round = 0; round < 4; round++) {
        int32_t base = 500000 + 100000 * round;
        assert_int_equal(store(c, base, nch, st), (int)(nch * CT));
        FT_ASSERT_OK(ferry_kv_flush(c));
        assert_int_equal(lookup(c, base, nch), (int)(nch * CT));
        /* another writer crowds the pool meanwhile */
        held h = hold(o, 900000 + round * 10000, BIG / 4, BIG);
        static unsigned char got[PLANES * MAXTOK * TB];
        memset(got, 0, sizeof got);
        static int32_t tok[2 * BIG * CT];
        tokens(tok, nch * CT, base);
        ferry_kv_req rq = FERRY_KV_REQ_INIT;
        rq.status = st;
        rq.max_chunks = nch;
        ferry_kv_buffer b = buffer(got);
        assert_int_equal(ferry_kv_retrieve(c, tok, nch * CT, &rq, &b), (int)(nch * CT));
        for (size_t i = 0; i < nch; i++)
            assert_int_equal(st[i], 0);
        for (unsigned p = 0; p < PLANES; p++)
            assert_memory_equal(got + (size_t)p * MAXTOK * TB, g_img + (size_t)p * MAXTOK * TB,
                                nch * CT * TB);
        unhold(&h);
    }
    env_unclient(&e, c);
    env_unclient(&e, o);
    assert_int_equal(sched_setaffinity(0, sizeof all, &all), 0);
    env_close(&e);
}

static void test_one_core_retrieve(void **state)
{
    (void)state;
    one_core_retrieve(INPROC);
    one_core_retrieve(DAEMON);
}

/* two layerwise prefills each as long as the whole pool, and a plain
 * writer meanwhile: each prefill holds only its window (a quarter of the
 * pool) while its layers come, so the plain store finds room at once and
 * nothing is declined; each prefill stores all its chunks (staged past the
 * window, then streamed through the pool), and each reads back exact */
static void long_prefills(int mode)
{
    env e;
    env_open(&e, mode, SLOTS, 200, 1);
    ferry_kv *a = env_client(&e), *b = env_client(&e), *c = env_client(&e);
    static int32_t ta[SLOTS * CT], tb[SLOTS * CT];
    tokens(ta, SLOTS * CT, 700000);
    tokens(tb, SLOTS * CT, 800000);
    unsigned char *srcb = g_img + 3 * TB; /* (another prompt's bytes) */
    ferry_kv_buffer ba = buffer(g_img), bb = buffer(srcb);
    int sa[SLOTS], sb[SLOTS], sc[4];
    ferry_kv_req ra = FERRY_KV_REQ_INIT, rb = FERRY_KV_REQ_INIT;
    ra.status = sa;
    ra.max_chunks = SLOTS;
    rb.status = sb;
    rb.max_chunks = SLOTS;
    ferry_kv_op *oa = NULL, *ob = NULL;
    FT_ASSERT_OK(ferry_kv_store_layers(a, ta, SLOTS * CT, &ra, &ba, NULL, &oa));
    FT_ASSERT_OK(ferry_kv_store_layers(b, tb, SLOTS * CT, &rb, &bb, NULL, &ob));
    assert_int_equal(store(c, 900000, 4, sc), (int)(4 * CT));
    ferry_kv_stats m = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(e.home, &m));
    assert_int_equal(m.pool_waits, 0); /* (no wait for the prefills' slots) */
    for (unsigned l = 0; l < L; l++) {
        FT_ASSERT_OK(ferry_kv_op_layer_done(oa, l, NULL));
        FT_ASSERT_OK(ferry_kv_op_layer_done(ob, l, NULL));
    }
    assert_int_equal(ferry_kv_op_wait(oa, 10000), (int)(SLOTS * CT));
    assert_int_equal(ferry_kv_op_wait(ob, 10000), (int)(SLOTS * CT));
    for (size_t i = 0; i < SLOTS; i++) {
        assert_int_equal(sa[i], 0);
        assert_int_equal(sb[i], 0);
    }
    ferry_kv_op_free(oa);
    ferry_kv_op_free(ob);
    FT_ASSERT_OK(ferry_kv_stats_get(e.home, &m));
    assert_int_equal(m.pool_declines, 0);
    FT_ASSERT_OK(ferry_kv_flush(c));
    static unsigned char got[PLANES * MAXTOK * TB];
    for (int w = 0; w < 2; w++) {
        const unsigned char *want = w ? srcb : g_img;
        memset(got, 0, sizeof got);
        ferry_kv_buffer gb = buffer(got);
        assert_int_equal(ferry_kv_retrieve(c, w ? tb : ta, SLOTS * CT, NULL, &gb),
                         (int)(SLOTS * CT));
        for (unsigned p = 0; p < PLANES; p++)
            assert_memory_equal(got + (size_t)p * MAXTOK * TB, want + (size_t)p * MAXTOK * TB,
                                SLOTS * CT * TB);
    }
    env_unclient(&e, a);
    env_unclient(&e, b);
    env_unclient(&e, c);
    env_close(&e);
}

static void test_long_prefills(void **state)
{
    (void)state;
    long_prefills(INPROC);
    long_prefills(DAEMON);
}

/* a writer that reserves and never commits: in process, freeing its op
 * gives the slots back; through the daemon, so does its death */
static void test_abandoned_reservation(void **state)
{
    (void)state;
    for (int mode = INPROC; mode <= DAEMON; mode++) {
        env e;
        env_open(&e, mode, SLOTS, 100, 0);
        ferry_kv *c = env_client(&e);
        if (mode == INPROC) {
            held h = hold(c, 100000, SLOTS / 2, SLOTS), h2 = hold(c, 200000, SLOTS / 2, SLOTS);
            unhold(&h);
            unhold(&h2);
        } else {
            pid_t pid = fork();
            assert_true(pid >= 0);
            if (pid == 0) { /* a fresh process (no fork of our threads) */
                execl("/proc/self/exe", "test_kv_pressure", "--child-hold", g_sock,
                      (char *)NULL);
                _exit(127);
            }
            int ws = 0;
            assert_int_equal(waitpid(pid, &ws, 0), pid);
            assert_true(WIFEXITED(ws) && WEXITSTATUS(ws) == 0);
            ferry_serve_stats ss = FERRY_SERVE_STATS_INIT;
            for (int i = 0; i < 300; i++) {
                FT_ASSERT_OK(ferry_serve_stats_get(e.srv.s, &ss));
                if (ss.released >= SLOTS / 2)
                    break;
                usleep(10000);
            }
            assert_true(ss.released >= SLOTS / 2);
        }
        int st[SLOTS];
        assert_int_equal(store(c, 300000, SLOTS, st), (int)(SLOTS * CT));
        ferry_kv_stats m = FERRY_KV_STATS_INIT;
        FT_ASSERT_OK(ferry_kv_stats_get(e.home, &m));
        assert_int_equal(m.pool_declines, 0);
        env_unclient(&e, c);
        env_close(&e);
    }
}

/* an engine shutting down: ferry_kv_close_begin ends a store waiting
 * (pool_wait_ms 20 s) for a pool that pinned chunks and unfinished
 * layerwise stores hold whole, at once: -ECANCELED naming the close, none
 * of its chunks stored, later calls refused; the chunks stored before stay
 * whole (through the daemon a fresh client reads them back) */
typedef struct bgc {
    ferry_kv *kv;
    int rc;
    int st[4];
    char msg[512];
} bgc;

static void *bg_closed_store(void *arg)
{
    bgc *g = arg;
    g->rc = store(g->kv, 300000, 4, g->st);
    snprintf(g->msg, sizeof g->msg, "%s", ferry_last_error());
    return NULL;
}

static void close_begin_ends_waits(int mode)
{
    env e;
    env_open(&e, mode, SLOTS, 20000, 0);
    ferry_kv *a = env_client(&e), *c = env_client(&e);
    int st[SLOTS];
    static int32_t tok[2 * CT];
    tokens(tok, 2 * CT, 50000);
    assert_int_equal(store(a, 50000, 2, st), (int)(2 * CT)); /* stored before */
    assert_int_equal(ferry_kv_pin(a, tok, 2 * CT, NULL), (int)(2 * CT));
    held h = hold(a, 100000, SLOTS - 2, SLOTS); /* the rest of the pool */
    bgc g = {.kv = c, .rc = 1, .st = {1, 1, 1, 1}};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, bg_closed_store, &g), 0);
    await_waits(e.home, 1);
    usleep(50 * 1000); /* well inside its wait */
    uint64_t t0 = now_ms();
    ferry_kv_close_begin(c);
    pthread_join(th, NULL);
    uint64_t took = now_ms() - t0;
    assert_true(took < 1000); /* not the 20 s of its pool_wait_ms */
    assert_int_equal(g.rc, -ECANCELED);
    for (size_t i = 0; i < 4; i++)
        assert_int_equal(g.st[i], -ECANCELED);
    assert_non_null(strstr(g.msg, "closing (ferry_kv_close_begin)"));
    ferry_kv_close_begin(c); /* again: nothing more */
    assert_int_equal(lookup(c, 50000, 2), FERRY_ESTATE);
    assert_non_null(strstr(ferry_last_error(), "the store is closing"));
    if (mode == INPROC) { /* the store: its close abandons the layerwise stores */
        ferry_kv_close(e.home);
        unhold(&h);
        return;
    }
    ferry_kv_close(c);
    unhold(&h);
    ferry_kv *d = env_client(&e);
    static unsigned char back[PLANES * MAXTOK * TB];
    memset(back, 0, sizeof back);
    ferry_kv_buffer b = buffer(back);
    assert_int_equal(ferry_kv_retrieve(d, tok, 2 * CT, NULL, &b), (int)(2 * CT));
    for (size_t p = 0; p < PLANES; p++) /* [plane][token][TB]: the first 2 chunks */
        assert_memory_equal(back + p * MAXTOK * TB, g_img + p * MAXTOK * TB, 2 * CT * TB);
    assert_int_equal(lookup(d, 300000, 4), 0); /* nothing of the woken store */
    env_unclient(&e, d);
    env_unclient(&e, a);
    env_close(&e);
}

static void test_close_begin_ends_waits(void **state)
{
    (void)state;
    ferry_kv_close_begin(NULL); /* does nothing */
    close_begin_ends_waits(INPROC);
    close_begin_ends_waits(DAEMON);
}

/* the deadline's bounds: 0 to 60000, else -EINVAL naming the field, in
 * process and for a client alike */
static void test_bad_deadline(void **state)
{
    (void)state;
    static const int bad[] = {-1, -300, FERRY_KV_POOL_WAIT_MS_MAX + 1, INT32_MAX};
    for (int mode = INPROC; mode <= DAEMON; mode++)
        for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
            ferry_kv_config c = config(SLOTS, bad[i]);
            if (mode == DAEMON)
                c.server = g_sock; /* (refused before any connect) */
            ferry_kv *kv = NULL;
            assert_int_equal(ferry_kv_open(&c, &kv), -EINVAL);
            assert_null(kv);
            assert_non_null(strstr(ferry_last_error(), "pool_wait_ms"));
        }
    ferry_kv_config c = config(SLOTS, 0);
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    ferry_kv_close(kv);
    c = config(SLOTS, FERRY_KV_POOL_WAIT_MS_MAX);
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    ferry_kv_close(kv);
    /* an older caller's config (no pool_wait_ms) takes the default */
    ferry_kv_config d = FERRY_KV_CONFIG_INIT;
    assert_int_equal(d.pool_wait_ms, FERRY_KV_POOL_WAIT_MS_DEFAULT);
}

/* a daemon client's copies between a device buffer and the pool, of which
 * one fails part way through a batch (here: the buffer's last chunk lies
 * past its device allocation): the copies queued before it land before
 * the call returns, as in process. A retrieve's would otherwise go on
 * writing into the engine's buffer after the call returned (over what the
 * engine puts there next), and a store's would go on reading it into
 * slots its abort gave back to the daemon (another client's, once it
 * reserves them). The "host" device's memory is this process's: right
 * after the call the test writes marks into the engine's buffer where the
 * last copies queued read or write, waits for every queued copy, and
 * looks for them: intact in the buffer, nowhere in the pool. */
#define DTB 16384u                      /* token bytes of a plane: 1 MiB chunks */
#define DPLANES 4u
#define DCHUNK (DPLANES * CT * DTB)
#define DSLOTS 64u                      /* a store's batch 16 chunks, a retrieve's 8 */
#define DN 16u                          /* chunks a call moves */
#define DTOK (DN * CT)
#define MARK 0xA5

static ferry_kv_config dconfig(uint64_t slots)
{
    ferry_kv_config c = config(slots, 1000);
    c.layout.num_layers = DPLANES / 2;
    c.layout.head_dim = DTB / 4;
    c.l1_bytes = slots * DCHUNK;
    return c;
}

/* the pool's mapping in this process of that size (the daemon's and its
 * client's are the same memory): its start, or NULL */
static unsigned char *pool_map(size_t bytes)
{
    FILE *f = fopen("/proc/self/maps", "r");
    assert_non_null(f);
    char line[512];
    unsigned char *at = NULL;
    while (!at && fgets(line, sizeof line, f)) {
        unsigned long long a = 0, b = 0;
        if (strstr(line, "memfd:ferry-l1") && sscanf(line, "%llx-%llx", &a, &b) == 2 &&
            b - a == bytes)
            at = (unsigned char *)(uintptr_t)a;
    }
    fclose(f);
    return at;
}

/* every plane's part of chunk i in [plane][DTOK][DTB] at base: set to MARK
 * (set 1), or 1 when it all is MARK (set 0) */
static int marks(uint64_t base, unsigned i, int set)
{
    for (unsigned p = 0; p < DPLANES; p++) {
        unsigned char *q = (unsigned char *)(uintptr_t)(base + ((uint64_t)p * DTOK + i * CT) * DTB);
        if (set)
            memset(q, MARK, CT * DTB);
        for (size_t k = 0; !set && k < CT * DTB; k++)
            if (q[k] != MARK)
                return 0;
    }
    return 1;
}

/* a page-aligned page of MARK bytes anywhere in p[0, n) */
static int has_marked_page(const unsigned char *p, size_t n)
{
    static unsigned char page[4096];
    memset(page, MARK, sizeof page);
    for (size_t o = 0; o + sizeof page <= n; o += sizeof page)
        if (!memcmp(p + o, page, sizeof page))
            return 1;
    return 0;
}

static void test_client_copy_fails_midway(void **state)
{
    (void)state;
    ferry_device_options dopt = FERRY_DEVICE_OPTIONS_INIT;
    dopt.backend = "host";
    ferry_device *dev = NULL;
    FT_ASSERT_OK(ferry_device_open(&dopt, &dev));
    ferry_kv_config kc = dconfig(DSLOTS);
    ferry_serve_config sc = FERRY_SERVE_CONFIG_INIT;
    sc.socket_path = g_sock;
    sc.kv = &kc;
    ft_srv srv;
    ft_srv_open(&srv, &sc);
    ferry_kv_config c = dconfig(1);
    c.server = g_sock;
    c.server_timeout_ms = 5000;
    c.device = dev;
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    size_t pool_bytes = (size_t)DSLOTS * DCHUNK, whole = (size_t)DPLANES * DTOK * DTB;
    /* [plane][token][DTB], the last plane's part of the last chunk past
     * the device allocation: that chunk's copy fails, the others queue */
    size_t bytes = ((size_t)(DPLANES - 1) * DTOK + (DN - 1) * CT) * DTB;
    unsigned char *host = malloc(whole);
    assert_non_null(host);
    for (size_t i = 0; i < whole; i++)
        host[i] = (unsigned char)(i * 131 + i / 4096 + 1);
    ferry_devptr d = 0, one = 0;
    FT_ASSERT_OK(ferry_device_alloc(dev, bytes, &d));
    FT_ASSERT_OK(ferry_device_alloc(dev, 1, &one));
    ferry_kv_buffer hb = FERRY_KV_BUFFER_INIT, db;
    hb.layout = c.layout;
    hb.mem = FERRY_KV_MEM_HOST;
    hb.base = (uintptr_t)host;
    hb.capacity_tokens = DTOK;
    db = hb;
    db.mem = FERRY_KV_MEM_DEVICE;
    db.base = d;
    static int32_t tok[DTOK];
    /* (the copies race the call's return: each try catches a late one
     * about every other time) */
    for (int rep = 0; rep < 10; rep++) {
        tokens(tok, DTOK, 1000000 * (rep + 1));
        assert_int_equal(ferry_kv_store(kv, tok, DTOK, NULL, &hb), (int)DTOK);
        /* a retrieve: the engine's bytes, written once the call returned,
         * stay (no copy of the call lands over them) */
        assert_true(ferry_kv_retrieve(kv, tok, DTOK, NULL, &db) < 0);
        marks(d, DN - 2, 1);
        FT_ASSERT_OK(ferry_device_memset(dev, one, 0, 1)); /* after all queued work */
        assert_true(marks(d, DN - 2, 0));
        /* a store: what the engine writes once it returned reaches no slot */
        memcpy((void *)(uintptr_t)d, host, bytes);
        tokens(tok, DTOK, 1000000 * (rep + 1) + 500000);
        assert_true(ferry_kv_store(kv, tok, DTOK, NULL, &db) < 0);
        marks(d, DN - 2, 1);
        FT_ASSERT_OK(ferry_device_memset(dev, one, 0, 1));
        unsigned char *pool = pool_map(pool_bytes);
        assert_non_null(pool);
        assert_false(has_marked_page(pool, pool_bytes));
    }
    ferry_kv_close(kv);
    ft_srv_close(&srv);
    FT_ASSERT_OK(ferry_device_free(dev, d));
    FT_ASSERT_OK(ferry_device_free(dev, one));
    ferry_device_close(dev);
    free(host);
}

static int setup(void **state)
{
    (void)state;
    ft_tmpdir(g_dir, sizeof g_dir);
    snprintf(g_sock, sizeof g_sock, "%s/ferry.sock", g_dir);
    snprintf(g_l2, sizeof g_l2, "%s/l2", g_dir);
    signal(SIGPIPE, SIG_IGN);
    fill_image();
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    ft_rmtree(g_dir);
    return 0;
}

/* the child of test_abandoned_reservation: reserve half the pool through
 * the daemon, then die without a word (exit 0 when it held them) */
static int child_hold(const char *sock)
{
    snprintf(g_sock, sizeof g_sock, "%s", sock);
    ferry_kv_config c = config(1, 100);
    c.server = g_sock;
    ferry_kv *k = NULL;
    if (ferry_kv_open(&c, &k) < 0)
        return 1;
    /* (two stores: each reserves its window, a quarter) */
    for (int32_t s = 0; s < 2; s++) {
        int32_t tok[SLOTS / 4 * CT];
        tokens(tok, SLOTS / 4 * CT, 100000 + s * 10000);
        ferry_kv_buffer b = buffer(g_img);
        ferry_kv_op *op = NULL;
        if (ferry_kv_store_layers(k, tok, SLOTS / 4 * CT, NULL, &b, NULL, &op) < 0)
            return 2;
    }
    _exit(0);
}

int main(int argc, char **argv)
{
    if (argc == 3 && strcmp(argv[1], "--child-hold") == 0)
        return child_hold(argv[2]);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_full_declines, setup, teardown),
        cmocka_unit_test_setup_teardown(test_wait_then_proceed, setup, teardown),
        cmocka_unit_test_setup_teardown(test_stream_pieces, setup, teardown),
        cmocka_unit_test_setup_teardown(test_no_deadlock, setup, teardown),
        cmocka_unit_test_setup_teardown(test_locked_agree, setup, teardown),
        cmocka_unit_test_setup_teardown(test_eight_writers, setup, teardown),
        cmocka_unit_test_setup_teardown(test_one_core_retrieve, setup, teardown),
        cmocka_unit_test_setup_teardown(test_long_prefills, setup, teardown),
        cmocka_unit_test_setup_teardown(test_abandoned_reservation, setup, teardown),
        cmocka_unit_test_setup_teardown(test_bad_deadline, setup, teardown),
        cmocka_unit_test_setup_teardown(test_close_begin_ends_waits, setup, teardown),
        cmocka_unit_test_setup_teardown(test_client_copy_fails_midway, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
