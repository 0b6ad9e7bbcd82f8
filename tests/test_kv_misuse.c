/*
 * test_kv_misuse.c - what an engine can do wrong with a store and its ops,
 * in process and through a daemon: each case runs in a child process of
 * its own, so a crash, an abort or a hang is seen (a signal, an exit code,
 * a SIGALRM) rather than suffered by the runner.
 *
 *  - one op waited on, tested and cancelled from several threads, and
 *    freed by its owner while other threads are still inside its calls;
 *  - a layerwise store lacking a layer when its store is closed: its
 *    free, cancel, wait and layer_done afterwards (nothing committed);
 *  - a layerwise retrieve that outlives its store;
 *  - close while another thread is inside a store call;
 *  - close while an op waits for the L1 slots that layerwise stores
 *    lacking layers hold: the close frees them before it waits;
 *  - negative token and block ids;
 *  - a store closed in a forked child: nothing released, the parent's
 *    store whole;
 *  - a daemon connection ends with its store's close while a forked
 *    child (holding a copy of its socket) lives on;
 *  - a fork while threads are inside op calls: the child's own store
 *    makes, waits and frees ops (no lock left held by the fork).
 */
/* ferry-test-labels: concurrent */
/* ferry-test-timeout: 300 */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ferry/kv.h"
#include "ferry/serve.h"
#include "ferry_test.h"
#include "serve_fixture.h"
#include "kv/kv_impl.h"

#define TB 64u                    /* bytes per token and plane */
#define CT 16u                    /* tokens per chunk */
#define NCH 256u                  /* chunks of the big request */
#define NTOK (NCH * CT)
#define CHUNK_BYTES (4u * CT * TB) /* 2 layers x K/V */

/* a failed check in a child: say where and exit 1 (the parent fails) */
#define CHECK(c)                                                                    \
    do {                                                                            \
        if (!(c)) {                                                                 \
            fprintf(stderr, "%s:%d: check failed: %s (last error: %s)\n", __FILE__, \
                    __LINE__, #c, ferry_last_error());                              \
            _exit(1);                                                               \
        }                                                                           \
    } while (0)

typedef struct env {
    int server;        /* 1: through a daemon the child runs in a thread */
    char dir[256], sock[300];
    ft_srv srv;
} env;

static ferry_kv_config config(uint64_t l1_chunks)
{
    ferry_kv_config c = FERRY_KV_CONFIG_INIT;
    c.model = "misuse";
    c.layout = ft_kv_layout(TB);
    c.chunk_tokens = CT;
    c.l1_bytes = l1_chunks * CHUNK_BYTES;
    c.workers = 2;
    return c;
}

static ferry_kv *open_kv(env *e)
{
    ferry_kv_config c = config(4 * NCH);
    if (e->server) {
        c.server = e->sock;
        c.server_timeout_ms = 5000;
    }
    ferry_kv *kv = NULL;
    CHECK(ferry_kv_open(&c, &kv) == 0);
    return kv;
}

static void env_up(env *e, int server)
{
    memset(e, 0, sizeof *e);
    e->server = server;
    if (!server)
        return;
    CHECK(ft_tmpdir(e->dir, sizeof e->dir));
    snprintf(e->sock, sizeof e->sock, "%s/ferry.sock", e->dir);
    ferry_kv_config kc = config(4 * NCH);
    ferry_serve_config sc = FERRY_SERVE_CONFIG_INIT;
    sc.socket_path = e->sock;
    sc.kv = &kc;
    ft_srv_open(&e->srv, &sc);
}

static void env_down(env *e)
{
    if (!e->server)
        return;
    ft_srv_close(&e->srv);
    ft_rmtree(e->dir);
}

static void tokens(int32_t *t, size_t n, int32_t base)
{
    for (size_t i = 0; i < n; i++)
        t[i] = base + (int32_t)(i * 13 % 5000);
}

static ferry_kv_buffer host_buf(unsigned char *img)
{
    return ft_kv_host_buffer(img, NTOK, TB);
}

#define IMG_BYTES ((size_t)4 * NTOK * TB)

/* run fn(server) in a child; it must exit 0 within a minute */
static void in_child(void (*fn)(int server), int server)
{
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) { /* the runner's handlers out: a crash is the parent's to see */
        signal(SIGSEGV, SIG_DFL);
        signal(SIGBUS, SIG_DFL);
        signal(SIGABRT, SIG_DFL);
        signal(SIGILL, SIG_DFL);
        signal(SIGFPE, SIG_DFL);
        alarm(60);
        fn(server);
        _exit(0);
    }
    int st = 0;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    if (WIFSIGNALED(st))
        fail_msg("the child died of signal %d (%s)", WTERMSIG(st), strsignal(WTERMSIG(st)));
    assert_true(WIFEXITED(st));
    assert_int_equal(WEXITSTATUS(st), 0);
}

/* ---- one op, several threads ---- */

typedef struct sharer {
    ferry_kv_op *op;
    int kind; /* 0 wait, 1 test until done */
    int rc;
} sharer;

static void *share(void *arg)
{
    sharer *s = arg;
    if (s->kind == 0) {
        s->rc = ferry_kv_op_wait(s->op, -1);
    } else {
        while ((s->rc = ferry_kv_op_test(s->op)) == -EAGAIN)
            ;
    }
    return NULL;
}

static void shared_op(int server)
{
    env e;
    env_up(&e, server);
    ferry_kv *kv = open_kv(&e);
    unsigned char *img = malloc(IMG_BYTES);
    CHECK(img);
    ft_fill_pattern(img, IMG_BYTES, 7);
    ferry_kv_buffer b = host_buf(img);
    static int32_t t[NTOK];
    int covered = 0;
    /* until the free came while both waiters were inside, a few times
     * (how often depends on the scheduler: on a loaded host, or under a
     * sanitizer, the op often finishes before the second waiter is in, so
     * up to 3000 rounds of a millisecond or so) */
    for (int round = 0; round < 3000 && covered < 3; round++) {
        tokens(t, NTOK, 10000 * round);
        ferry_kv_op *op = NULL;
        CHECK(ferry_kv_store_async(kv, t, NTOK, NULL, &b, &op) == 0);
        sharer w[2] = {{op, 0, 0}, {op, 0, 0}}, tester = {op, 1, 0};
        pthread_t th[3];
        CHECK(pthread_create(&th[0], NULL, share, &w[0]) == 0);
        CHECK(pthread_create(&th[1], NULL, share, &w[1]) == 0);
        /* both waiters inside wait (the owner's reference + theirs), or the
         * first one done already */
        int first_done = 0;
        while (ferry__kv_op_refs(op) < 3 && !(first_done = pthread_tryjoin_np(th[0], NULL) == 0))
            ;
        CHECK(pthread_create(&th[2], NULL, share, &tester) == 0);
        int rc = ferry_kv_op_cancel(op);
        CHECK(rc == -ECANCELED || rc == (int)NTOK);
        pthread_join(th[2], NULL); /* the tester tests until done: joined before the free */
        if (!first_done) {
            ferry_kv_op_free(op); /* both waiters were inside wait: they may still be */
            covered++;
            pthread_join(th[0], NULL);
            pthread_join(th[1], NULL);
        } else {
            pthread_join(th[1], NULL);
            ferry_kv_op_free(op);
        }
        CHECK(w[0].rc == rc && w[1].rc == rc && tester.rc == rc);
    }
    CHECK(covered > 0);
    /* the store still answers, with what it kept of round 0 */
    tokens(t, NTOK, 0);
    unsigned char *out = calloc(1, IMG_BYTES);
    CHECK(out);
    ferry_kv_buffer ob = host_buf(out);
    int got = ferry_kv_retrieve(kv, t, NTOK, NULL, &ob);
    CHECK(got >= 0 && got % CT == 0);
    ferry_kv_close(kv);
    free(img);
    free(out);
    env_down(&e);
}

static void test_one_op_many_threads(void **state)
{
    (void)state;
    in_child(shared_op, 0);
    in_child(shared_op, 1);
}

/* ---- ops that outlive their store ---- */

static void store_lacking_layer_then_close(int server)
{
    env e;
    env_up(&e, server);
    ferry_kv *kv = open_kv(&e);
    unsigned char *img = malloc(IMG_BYTES);
    CHECK(img);
    ft_fill_pattern(img, IMG_BYTES, 3);
    ferry_kv_buffer b = host_buf(img);
    static int32_t t[NTOK], t2[NTOK], t3[NTOK];
    tokens(t, NTOK, 5);
    tokens(t2, NTOK, 6);
    tokens(t3, NTOK, 7);
    ferry_kv_op *a = NULL, *c = NULL, *d = NULL;
    CHECK(ferry_kv_store_layers(kv, t, 4 * CT, NULL, &b, NULL, &a) == 0);
    CHECK(ferry_kv_store_layers(kv, t2, 4 * CT, NULL, &b, NULL, &c) == 0);
    CHECK(ferry_kv_store_layers(kv, t3, 4 * CT, NULL, &b, NULL, &d) == 0);
    CHECK(ferry_kv_op_layer_done(a, 0, NULL) == 0); /* layer 1 never comes */
    ferry_kv_close(kv);
    /* every call on the ops answers, none reaches the freed store */
    CHECK(ferry_kv_op_layer_done(a, 1, NULL) == -ECANCELED);
    CHECK(ferry_kv_op_wait(a, -1) == -ECANCELED);
    CHECK(ferry_kv_op_test(a) == -ECANCELED);
    CHECK(ferry_kv_op_cancel(a) == -ECANCELED);
    CHECK(ferry_kv_op_wait_layer(a, 0, 0) == FERRY_ESTATE); /* not a retrieve */
    ferry_kv_op_free(a);
    CHECK(ferry_kv_op_cancel(c) == -ECANCELED);
    ferry_kv_op_free(c);
    ferry_kv_op_free(d); /* freed untouched */
    if (server) { /* nothing of them was committed in the daemon */
        ferry_kv *other = open_kv(&e);
        CHECK(ferry_kv_lookup(other, t, 4 * CT, NULL) == 0);
        CHECK(ferry_kv_lookup(other, t2, 4 * CT, NULL) == 0);
        CHECK(ferry_kv_lookup(other, t3, 4 * CT, NULL) == 0);
        ferry_kv_close(other);
    }
    free(img);
    env_down(&e);
}

static void retrieve_outlives_store(int server)
{
    env e;
    env_up(&e, server);
    ferry_kv *kv = open_kv(&e);
    unsigned char *img = malloc(IMG_BYTES), *out = calloc(1, IMG_BYTES);
    CHECK(img && out);
    ft_fill_pattern(img, IMG_BYTES, 9);
    ferry_kv_buffer b = host_buf(img), ob = host_buf(out);
    static int32_t t[NTOK];
    tokens(t, NTOK, 77);
    CHECK(ferry_kv_store(kv, t, 8 * CT, NULL, &b) == (int)(8 * CT));
    ferry_kv_op *op = NULL;
    CHECK(ferry_kv_retrieve_layers(kv, t, 8 * CT, NULL, &ob, NULL, &op) == 0);
    CHECK(ferry_kv_op_wait_layer(op, 1, -1) == (int)(8 * CT));
    ferry_kv_close(kv);
    CHECK(ferry_kv_op_wait_layer(op, 0, 0) == (int)(8 * CT));
    CHECK(ferry_kv_op_wait(op, -1) == (int)(8 * CT));
    CHECK(ferry_kv_op_layer_done(op, 0, NULL) == FERRY_ESTATE); /* not a store */
    ferry_kv_op_free(op);
    /* the bytes are the stored ones: token 0..8*CT of each plane */
    for (unsigned p = 0; p < 4; p++)
        CHECK(memcmp(out + (size_t)p * NTOK * TB, img + (size_t)p * NTOK * TB,
                     (size_t)8 * CT * TB) == 0);
    free(img);
    free(out);
    env_down(&e);
}

static void test_ops_outlive_their_store(void **state)
{
    (void)state;
    for (int server = 0; server < 2; server++) {
        in_child(store_lacking_layer_then_close, server);
        in_child(retrieve_outlives_store, server);
    }
}

/* ---- close while a call is inside ---- */

typedef struct inside {
    ferry_kv *kv;
    ferry_kv_buffer b;
    int32_t *t;
    int rc;
} inside;

static void *store_call(void *arg)
{
    inside *in = arg;
    in->rc = ferry_kv_store(in->kv, in->t, NTOK, NULL, &in->b);
    return NULL;
}

static void close_during_call(int server)
{
    env e;
    env_up(&e, server);
    for (int round = 0; round < 10; round++) {
        ferry_kv *kv = open_kv(&e);
        unsigned char *img = malloc(IMG_BYTES);
        CHECK(img);
        ft_fill_pattern(img, IMG_BYTES, 11);
        static int32_t t[NTOK];
        tokens(t, NTOK, 31 * round);
        inside in = {kv, host_buf(img), t, 0};
        pthread_t th;
        CHECK(pthread_create(&th, NULL, store_call, &in) == 0);
        /* close only once the call is inside (a call begun after close
         * returned would use a freed handle: the caller's to avoid) */
        int joined = 0;
        while (ferry__kv_calls(kv) == 0 && !(joined = pthread_tryjoin_np(th, NULL) == 0))
            ;
        ferry_kv_close(kv); /* waits for the store call */
        if (!joined)
            pthread_join(th, NULL);
        CHECK(in.rc == (int)NTOK);
        free(img);
    }
    env_down(&e);
}

static void test_close_waits_for_calls_inside(void **state)
{
    (void)state;
    in_child(close_during_call, 0);
    in_child(close_during_call, 1);
}

/* ---- close while an op waits for slots layerwise stores hold ---- */

static double ms_since(const struct timespec *t0)
{
    struct timespec t1;
    clock_gettime(CLOCK_MONOTONIC, &t1);
    return (double)(t1.tv_sec - t0->tv_sec) * 1e3 + (double)(t1.tv_nsec - t0->tv_nsec) / 1e6;
}

static void *wait_forever(void *arg)
{
    sharer *s = arg;
    s->rc = ferry_kv_op_wait(s->op, -1);
    return NULL;
}

/* a store of HLCH chunks (pool_wait_ms 20 s) whose every L1 slot is held
 * by four layerwise stores lacking their last layer (a quarter each);
 * t[4] the tokens of a fifth request, which must wait for a slot */
enum { HLCH = 64, HWIN = HLCH / 4, HWTOK = HWIN * CT };
typedef struct held {
    ferry_kv *kv;
    unsigned char *img;
    ferry_kv_buffer b;
    ferry_kv_op *lw[4];
    int32_t t[5][HWTOK];
} held;

static void held_open(held *h, int seed)
{
    ferry_kv_config c = config(HLCH);
    c.pool_wait_ms = 20000;
    h->kv = NULL;
    CHECK(ferry_kv_open(&c, &h->kv) == 0);
    h->img = malloc(IMG_BYTES);
    CHECK(h->img);
    ft_fill_pattern(h->img, IMG_BYTES, seed);
    h->b = host_buf(h->img);
    for (int i = 0; i < 4; i++) {
        for (int k = 0; k < HWTOK; k++)
            h->t[i][k] = 1000 * i + k;
        CHECK(ferry_kv_store_layers(h->kv, h->t[i], HWTOK, NULL, &h->b, NULL, &h->lw[i]) == 0);
        CHECK(ferry_kv_op_layer_done(h->lw[i], 0, NULL) == 0);
    }
    for (int k = 0; k < HWTOK; k++)
        h->t[4][k] = 90000 + k;
}

/* after the store's close: the four were abandoned (-ECANCELED) */
static void held_done(held *h)
{
    for (int i = 0; i < 4; i++) {
        CHECK(ferry_kv_op_wait(h->lw[i], 0) == -ECANCELED);
        ferry_kv_op_free(h->lw[i]);
    }
    free(h->img);
}

/* four layerwise stores lacking their last layer hold every L1 slot (a
 * quarter each); a store_async waits for one (pool_wait_ms: 20 s), and
 * with waiter != 0 a thread waits on it (a call inside the store, which
 * close waits for). The close abandons those stores: it frees their slots
 * before it waits for the op or the calls inside, so the op then stores,
 * rather than waiting its 20 s out (and failing FERRY_ENOSPACE) */
static void close_with_an_op_waiting_for_slots(int waiter)
{
    static held h;
    held_open(&h, 5);
    ferry_kv *kv = h.kv;
    ferry_kv_op *op = NULL;
    CHECK(ferry_kv_store_async(kv, h.t[4], HWTOK, NULL, &h.b, &op) == 0);
    CHECK(ferry_kv_op_wait(op, 100) == -ETIMEDOUT); /* waiting for a slot */
    sharer w = {op, 0, 0};
    pthread_t th;
    if (waiter) {
        CHECK(pthread_create(&th, NULL, wait_forever, &w) == 0);
        while (ferry__kv_calls(kv) == 0) /* inside its wait */
            ;
    }
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    ferry_kv_close(kv);
    double ms = ms_since(&t0);
    if (waiter) {
        pthread_join(th, NULL);
        CHECK(w.rc == HWTOK);
    }
    if (ms > 5000) {
        fprintf(stderr, "close took %.0f ms: it waited the op's pool wait out\n", ms);
        _exit(1);
    }
    CHECK(ferry_kv_op_wait(op, 0) == HWTOK); /* stored in the slots freed */
    held_done(&h);
    ferry_kv_op_free(op);
}

typedef struct last_layer {
    ferry_kv_op *op;
    pthread_barrier_t *go;
    int rc;
} last_layer;

static void *do_last_layer(void *arg)
{
    last_layer *l = arg;
    pthread_barrier_wait(l->go);
    l->rc = ferry_kv_op_layer_done(l->op, 1, NULL);
    return NULL;
}

/* the last layer_done of a layerwise store racing the close: a layer_done
 * the close found inside finishes first (the store commits), one that came
 * after is refused; never a layer_done answered 0 whose store the close
 * then abandoned */
static void close_racing_the_last_layer(int server)
{
    (void)server;
    ferry_kv_config c = config(64);
    unsigned char *img = malloc(IMG_BYTES);
    CHECK(img);
    ft_fill_pattern(img, IMG_BYTES, 9);
    ferry_kv_buffer b = host_buf(img);
    static int32_t t[4 * CT];
    int first = 0;
    for (int round = 0; round < 400; round++) {
        ferry_kv *kv = NULL;
        CHECK(ferry_kv_open(&c, &kv) == 0);
        tokens(t, 4 * CT, 77 * round);
        ferry_kv_op *op = NULL;
        CHECK(ferry_kv_store_layers(kv, t, 4 * CT, NULL, &b, NULL, &op) == 0);
        CHECK(ferry_kv_op_layer_done(op, 0, NULL) == 0);
        pthread_barrier_t go;
        pthread_barrier_init(&go, NULL, 2);
        last_layer l = {op, &go, 1};
        pthread_t th;
        CHECK(pthread_create(&th, NULL, do_last_layer, &l) == 0);
        pthread_barrier_wait(&go);
        ferry_kv_close(kv);
        pthread_join(th, NULL);
        pthread_barrier_destroy(&go);
        int rc = ferry_kv_op_wait(op, -1);
        if (l.rc == 0) {
            first++;
            if (rc != (int)(4 * CT)) {
                fprintf(stderr, "round %d: layer_done answered 0, the store %d\n", round, rc);
                _exit(1);
            }
        } else {
            CHECK(l.rc == -ECANCELED && rc == -ECANCELED);
        }
        ferry_kv_op_free(op);
    }
    fprintf(stderr, "%d of 400 last layers came first\n", first);
    free(img);
}

typedef struct maker {
    ferry_kv *kv;
    const int32_t *t;
    size_t n;
    ferry_kv_buffer *b;
    ferry_kv_op *op;
    int rc, lrc;
} maker;

static void *make_store_layers(void *arg)
{
    maker *m = arg;
    m->rc = ferry_kv_store_layers(m->kv, m->t, m->n, NULL, m->b, NULL, &m->op);
    if (m->rc == 0)
        m->lrc = ferry_kv_op_layer_done(m->op, 0, NULL);
    return NULL;
}

/* a store_layers call inside the store when close begins, waiting for an
 * L1 slot that four layerwise stores lacking layers hold: its op is on the
 * store's list but not yet its caller's. The close's early abandonment
 * must leave that op alone (the call is still filling it in, without the
 * op's lock); the call finishes first, as close promises, gets the slots
 * the others gave back, and its op is abandoned after it (-ECANCELED).
 * Under ThreadSanitizer an abandonment racing the call's reservation is a
 * data race on the op's layer state. */
static void close_with_a_store_layers_inside(int server)
{
    (void)server;
    static held h;
    held_open(&h, 6);
    ferry_kv *kv = h.kv;
    maker m = {kv, h.t[4], HWTOK, &h.b, NULL, 1, 1};
    pthread_t th;
    CHECK(pthread_create(&th, NULL, make_store_layers, &m) == 0);
    while (ferry__kv_calls(kv) == 0) /* inside its store_layers */
        ;
    struct timespec nap = {0, 200 * 1000 * 1000}; /* (waiting for a slot by now) */
    nanosleep(&nap, NULL);
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    ferry_kv_close(kv);
    double ms = ms_since(&t0);
    pthread_join(th, NULL);
    if (ms > 5000) {
        fprintf(stderr, "close took %.0f ms: the call waited its pool wait out\n", ms);
        _exit(1);
    }
    /* the call found the slots the close gave back: an op, which the
     * close abandoned after the call (its layer_done came after close
     * began: refused) */
    CHECK(m.rc == 0 && m.op);
    CHECK(m.lrc == -ECANCELED);
    CHECK(ferry_kv_op_wait(m.op, 0) == -ECANCELED);
    ferry_kv_op_free(m.op);
    held_done(&h);
}

static void test_close_frees_abandoned_slots_before_waiting_for_ops(void **state)
{
    (void)state;
    in_child(close_with_an_op_waiting_for_slots, 0);
    in_child(close_with_an_op_waiting_for_slots, 1);
    in_child(close_racing_the_last_layer, 0);
    in_child(close_with_a_store_layers_inside, 0);
}

/* ---- ids out of range ---- */

static void bad_ids(int server)
{
    env e;
    env_up(&e, server);
    ferry_kv *kv = open_kv(&e);
    unsigned char *img = calloc(1, IMG_BYTES);
    CHECK(img);
    ferry_kv_buffer b = host_buf(img);
    static int32_t t[NTOK];
    tokens(t, NTOK, 0);
    t[CT + 3] = -7;
    CHECK(ferry_kv_store(kv, t, 2 * CT, NULL, &b) == -EINVAL);
    CHECK(strstr(ferry_last_error(), "token id -7 at position 19") != NULL);
    CHECK(ferry_kv_lookup(kv, t, 2 * CT, NULL) == -EINVAL);
    ferry_kv_op *op = NULL;
    CHECK(ferry_kv_retrieve_async(kv, t, 2 * CT, NULL, &b, &op) == -EINVAL && !op);
    CHECK(ferry_kv_store_layers(kv, t, 2 * CT, NULL, &b, NULL, &op) == -EINVAL && !op);
    CHECK(ferry_kv_prefetch(kv, t, 2 * CT, NULL) == -EINVAL);
    CHECK(ferry_kv_delete(kv, t, 2 * CT, NULL) == -EINVAL);
    /* a paged buffer with a negative block id: refused, nothing stored */
    tokens(t, NTOK, 0);
    uint64_t bases[4];
    for (unsigned p = 0; p < 4; p++)
        bases[p] = (uint64_t)(uintptr_t)(img + (size_t)p * NTOK * TB);
    int32_t table[2] = {0, -1};
    ferry_kv_buffer pb = FERRY_KV_BUFFER_INIT;
    pb.layout = ft_kv_layout(TB);
    pb.mem = FERRY_KV_MEM_HOST;
    pb.form = FERRY_KV_PAGED;
    pb.block_bases = bases;
    pb.block_tokens = CT;
    pb.num_blocks = NCH;
    pb.block_table = table;
    pb.table_len = 2;
    CHECK(ferry_kv_store(kv, t, 2 * CT, NULL, &pb) == -EINVAL);
    CHECK(ferry_kv_lookup(kv, t, 2 * CT, NULL) == 0);
    ferry_kv_close(kv);
    free(img);
    env_down(&e);
}

static void test_ids_out_of_range(void **state)
{
    (void)state;
    in_child(bad_ids, 0);
    in_child(bad_ids, 1);
}

/* ---- server addresses ---- */

static void bad_servers(int unused)
{
    (void)unused;
    const char *bad[] = {"tcp://127.0.0.1:7000", "unix://host/x.sock", "redis://x", "unix:"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        ferry_kv_config c = config(1);
        c.server = bad[i];
        ferry_kv *kv = NULL;
        int rc = ferry_kv_open(&c, &kv);
        CHECK(rc == -EINVAL && !kv);
    }
    /* a listener whose queue is full: the open gives up at the deadline */
    char dir[256], path[300];
    CHECK(ft_tmpdir(dir, sizeof dir));
    snprintf(path, sizeof path, "%s/full.sock", dir);
    int l = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un a;
    memset(&a, 0, sizeof a);
    a.sun_family = AF_UNIX;
    CHECK(strlen(path) < sizeof a.sun_path);
    memcpy(a.sun_path, path, strlen(path) + 1);
    CHECK(l >= 0 && bind(l, (struct sockaddr *)&a, sizeof a) == 0 && listen(l, 0) == 0);
    int fill[4];
    for (int i = 0; i < 4; i++) { /* fill the queue (what fits; the rest would block) */
        fill[i] = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0);
        (void)connect(fill[i], (struct sockaddr *)&a, sizeof a);
    }
    ferry_kv_config c = config(1);
    c.server = path;
    c.server_timeout_ms = 300;
    ferry_kv *kv = NULL;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    int rc = ferry_kv_open(&c, &kv);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double s = (double)(t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) / 1e9;
    CHECK(rc == FERRY_ECONN && !kv);
    CHECK(s < 5.0);
    for (int i = 0; i < 4; i++)
        close(fill[i]);
    close(l);
    ft_rmtree(dir);
}

static void test_server_addresses_and_a_full_listener(void **state)
{
    (void)state;
    in_child(bad_servers, 0);
}

/* ---- a store closed in a forked child ---- */

/* the child's close releases nothing: it returns at once (no join of
 * workers the child lacks, no goodbye on the parent's connection), and the
 * parent's store answers bitwise afterwards */
static void close_in_forked_child(int server)
{
    env e;
    env_up(&e, server);
    ferry_kv *kv = open_kv(&e);
    unsigned char *img = malloc(IMG_BYTES), *back = calloc(1, IMG_BYTES);
    CHECK(img && back);
    ft_fill_pattern(img, IMG_BYTES, 11);
    ferry_kv_buffer b = host_buf(img), bb = host_buf(back);
    static int32_t t[NTOK];
    tokens(t, NTOK, 77);
    CHECK(ferry_kv_store(kv, t, NTOK, NULL, &b) == (int)NTOK);
    ferry_kv_op *op = NULL;  /* one in flight at the fork too */
    tokens(t, NTOK, 555555);
    CHECK(ferry_kv_store_async(kv, t, NTOK, NULL, &b, &op) == 0);
    fflush(NULL);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        alarm(10);
        ferry_kv_close(kv);
        _exit(0);
    }
    int st = 0;
    CHECK(waitpid(pid, &st, 0) == pid);
    if (!(WIFEXITED(st) && WEXITSTATUS(st) == 0))
        fprintf(stderr, "the child's close ended it with status %#x\n", st);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    CHECK(ferry_kv_op_wait(op, -1) == (int)NTOK);
    ferry_kv_op_free(op);
    tokens(t, NTOK, 77);
    CHECK(ferry_kv_retrieve(kv, t, NTOK, NULL, &bb) == (int)NTOK);
    CHECK(memcmp(img, back, IMG_BYTES) == 0);
    ferry_kv_close(kv);
    free(img);
    free(back);
    env_down(&e);
}

static void test_close_in_a_forked_child(void **state)
{
    (void)state;
    in_child(close_in_forked_child, 0);
    in_child(close_in_forked_child, 1);
}

/* ---- a daemon connection ends with its store's close, a fork alive ---- */

/* the child holds a copy of the connection's socket: the parent's close
 * still ends the connection (the daemon sees it go, and lets go of what it
 * held for it) while the child lives on */
static void connection_ends_with_close_in_parent(int server)
{
    (void)server;
    env e;
    env_up(&e, 1);
    ferry_kv *kv = open_kv(&e);
    int go[2];
    CHECK(pipe(go) == 0);
    fflush(NULL);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        alarm(20);
        close(go[1]);
        char b;
        _exit(read(go[0], &b, 1) == 0 ? 0 : 1); /* lives until the parent is done */
    }
    close(go[0]);
    ferry_kv_close(kv);
    ferry_serve_stats st = FERRY_SERVE_STATS_INIT;
    for (int i = 0; i < 500; i++) {
        CHECK(ferry_serve_stats_get(e.srv.s, &st) == 0);
        if (st.clients == 0)
            break;
        usleep(10000);
    }
    if (st.clients)
        fprintf(stderr, "the daemon still serves %llu connection(s) after the close\n",
                (unsigned long long)st.clients);
    close(go[1]);
    int ws = 0;
    CHECK(waitpid(pid, &ws, 0) == pid);
    CHECK(st.clients == 0);
    CHECK(WIFEXITED(ws) && WEXITSTATUS(ws) == 0);
    env_down(&e);
}

static void test_connection_ends_with_its_close(void **state)
{
    (void)state;
    in_child(connection_ends_with_close_in_parent, 1);
}

/* ---- fork while threads are inside op calls ---- */

typedef struct poller {
    ferry_kv_op *op;
    atomic_int *stop;
} poller;

static void *poll_op(void *arg)
{
    poller *p = arg;
    while (!atomic_load(p->stop))
        (void)ferry_kv_op_test(p->op);  /* each call takes the ops' lock */
    return NULL;
}

/* a forked child: a store of its own, one op made, waited, freed */
static void own_store_after_fork(void)
{
    alarm(10);
    env e;
    env_up(&e, 0);
    ferry_kv *kv = open_kv(&e);
    unsigned char *img = calloc(1, IMG_BYTES);
    CHECK(img);
    ferry_kv_buffer b = host_buf(img);
    int32_t t[2 * CT];
    tokens(t, 2 * CT, 7);
    ferry_kv_op *op = NULL;
    CHECK(ferry_kv_store_async(kv, t, 2 * CT, NULL, &b, &op) == 0);
    CHECK(ferry_kv_op_wait(op, -1) == (int)(2 * CT));
    ferry_kv_op_free(op);
    ferry_kv_close(kv);
    free(img);
    _exit(0);
}

static void fork_with_op_calls_inside(int server)
{
    (void)server;
    env e;
    env_up(&e, 0);
    ferry_kv *kv = open_kv(&e);
    unsigned char *img = calloc(1, IMG_BYTES);
    CHECK(img);
    ferry_kv_buffer b = host_buf(img);
    static int32_t t[NTOK];
    tokens(t, NTOK, 3);
    ferry_kv_op *op = NULL;
    CHECK(ferry_kv_store_async(kv, t, NTOK, NULL, &b, &op) == 0);
    atomic_int stop = 0;
    poller p = {op, &stop};
    pthread_t th[2];
    for (int i = 0; i < 2; i++)
        CHECK(pthread_create(&th[i], NULL, poll_op, &p) == 0);
    int bad = 0;
    for (int i = 0; i < 40 && !bad; i++) {
        fflush(NULL);
        pid_t pid = fork();
        CHECK(pid >= 0);
        if (pid == 0)
            own_store_after_fork();
        int st = 0;
        CHECK(waitpid(pid, &st, 0) == pid);
        bad += !(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    }
    atomic_store(&stop, 1);
    for (int i = 0; i < 2; i++)
        pthread_join(th[i], NULL);
    if (bad)
        fprintf(stderr, "a forked child hung or failed making an op\n");
    CHECK(bad == 0);
    CHECK(ferry_kv_op_wait(op, -1) == (int)NTOK);
    ferry_kv_op_free(op);
    ferry_kv_close(kv);
    free(img);
}

static void test_fork_with_op_calls_inside(void **state)
{
    (void)state;
    /* a sanitizer's runtime keeps locks of its own (ASan's allocator, TSan's
     * threads) that a threaded fork leaves held in the child: skipped there */
    if (FT_UNDER_TSAN || FT_UNDER_ASAN)
        skip();
    in_child(fork_with_op_calls_inside, 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_one_op_many_threads),
        cmocka_unit_test(test_ops_outlive_their_store),
        cmocka_unit_test(test_close_waits_for_calls_inside),
        cmocka_unit_test(test_close_frees_abandoned_slots_before_waiting_for_ops),
        cmocka_unit_test(test_ids_out_of_range),
        cmocka_unit_test(test_server_addresses_and_a_full_listener),
        cmocka_unit_test(test_close_in_a_forked_child),
        cmocka_unit_test(test_connection_ends_with_its_close),
        cmocka_unit_test(test_fork_with_op_calls_inside),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
