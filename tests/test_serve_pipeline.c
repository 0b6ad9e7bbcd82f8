/*
 * test_serve_pipeline.c - retrieves through `ferry serve` of many more
 * chunks than the daemon's pool holds, every one read from its L2, as the
 * client pipelines them: a proxy between client and daemon sees the next
 * batch's PREFETCH and ACQUIRE go before the current batch's RELEASE, and
 * never more than two batches held at once; several client processes
 * retrieving at once (their own prompts and each other's) get every chunk
 * exact or as a miss, never a wrong byte; clients killed mid-pipeline
 * leave no slot locked and the pool whole.
 */
/* ferry-test-labels: concurrent */
/* ferry-test-timeout: 300 */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdatomic.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ferry_test.h"
#include "serve_fixture.h"
#include "proto/proto.h"

#define CT 16
#define TB 64u
#define PLANES 4u
#define CHUNK (PLANES * CT * TB)
#define POOL 8    /* the daemon's L1: batches of an eighth of it, one chunk */
#define NCH 40    /* chunks a prompt: five pools' worth */
#define N (NCH * CT)
#define PROMPTS 4

static char g_dir[256], g_sock[300], g_proxy[300], g_l2[300];

static ferry_kv_config store_config(void)
{
    ferry_kv_config c = FERRY_KV_CONFIG_INIT;
    c.model = "test-model";
    c.layout = ft_kv_layout(TB);
    c.chunk_tokens = CT;
    c.l1_bytes = POOL * CHUNK;
    c.workers = 2;
    return c;
}

static ferry_kv_config client_config(const char *sock)
{
    ferry_kv_config c = store_config();
    c.server = sock;
    c.server_timeout_ms = 5000;
    return c;
}

/* ---- the daemon, in a thread, its L2 a slab in the test's directory ---- */

typedef ft_srv srv;

static void srv_start(srv *v)
{
    ferry_kv_config kc = store_config();
    kc.l2_dir = g_l2;
    kc.l2_bytes = 4 * PROMPTS * NCH * CHUNK;
    ferry_serve_config sc = FERRY_SERVE_CONFIG_INIT;
    sc.socket_path = g_sock;
    sc.kv = &kc;
    ft_srv_open(v, &sc);
}

static int setup(void **state)
{
    (void)state;
    ft_tmpdir(g_dir, sizeof g_dir);
    snprintf(g_sock, sizeof g_sock, "%s/ferry.sock", g_dir);
    snprintf(g_proxy, sizeof g_proxy, "%s/proxy.sock", g_dir);
    snprintf(g_l2, sizeof g_l2, "%s/l2", g_dir);
    assert_int_equal(mkdir(g_l2, 0700), 0);
    signal(SIGPIPE, SIG_IGN);
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    ft_rmtree(g_dir);
    return 0;
}

/* ---- prompts: tokens and the bytes stored for them ---- */

static void prompt_tokens(int p, int32_t *t)
{
    for (size_t i = 0; i < N; i++)
        t[i] = 1000 + p * 100000 + (int32_t)(i * 7919 % 32000);
}

static unsigned char *prompt_bytes(int p)
{
    unsigned char *m = malloc(PLANES * N * TB);
    assert_non_null(m);
    ft_fill_pattern(m, PLANES * N * TB, 10u + (unsigned)p);
    return m;
}

static ferry_kv_buffer buffer_of(unsigned char *m)
{
    ferry_kv_buffer b = FERRY_KV_BUFFER_INIT;
    b.layout = ft_kv_layout(TB);
    b.base = (uint64_t)(uintptr_t)m;
    b.capacity_tokens = N;
    return b;
}

/* every prompt stored through the daemon, written through to its L2 */
static void store_prompts(void)
{
    ferry_kv_config c = client_config(g_sock);
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    for (int p = 0; p < PROMPTS; p++) {
        int32_t t[N];
        prompt_tokens(p, t);
        unsigned char *m = prompt_bytes(p);
        ferry_kv_buffer b = buffer_of(m);
        assert_int_equal(ferry_kv_store(kv, t, N, NULL, &b), N);
        free(m);
    }
    FT_ASSERT_OK(ferry_kv_flush(kv));
    for (int p = 0; p < PROMPTS; p++) {
        int32_t t[N];
        prompt_tokens(p, t);
        assert_int_equal(ferry_kv_lookup(kv, t, N, NULL), N);
    }
    ferry_kv_close(kv);
}

/* retrieve prompt p into a zeroed buffer: each chunk exact (status 0) or a
 * miss with its bytes untouched (zero); the chunks retrieved, or -1 on a
 * wrong byte */
static int retrieve_checked(ferry_kv *kv, int p, const unsigned char *want)
{
    int32_t t[N];
    prompt_tokens(p, t);
    static unsigned char got[PLANES * N * TB];
    memset(got, 0, sizeof got);
    ferry_kv_buffer b = buffer_of(got);
    int st[NCH];
    ferry_kv_req r = FERRY_KV_REQ_INIT;
    r.status = st;
    r.max_chunks = NCH;
    int rc = ferry_kv_retrieve(kv, t, N, &r, &b);
    if (rc < 0)
        return 0;
    int ok = 0;
    for (size_t i = 0; i < NCH; i++)
        for (unsigned pl = 0; pl < PLANES; pl++) {
            size_t off = ((size_t)pl * N + i * CT) * TB;
            for (size_t k = 0; k < CT * TB; k++)
                if (got[off + k] != (st[i] == 0 ? want[off + k] : 0)) {
                    fprintf(stderr, "prompt %d chunk %zu (status %d): byte %zu of plane %u "
                            "is %#x\n", p, i, st[i], k, pl, got[off + k]);
                    return -1;
                }
            ok += st[i] == 0 && pl == 0;
        }
    return ok;
}

/* ---- a proxy that logs the client's requests ---- */

#define LOG_MAX 4096

typedef struct proxy {
    int lfd, cfd, dfd;
    pthread_t th, back;
    uint8_t type[LOG_MAX];
    size_t n;
} proxy;

static int recv_full(int fd, uint8_t *p, size_t n)
{
    while (n) {
        ssize_t r = recv(fd, p, n, 0);
        if (r <= 0)
            return -1;
        p += r;
        n -= (size_t)r;
    }
    return 0;
}

/* daemon -> client: bytes as they come, the pool's fd passed along */
static void *proxy_back(void *arg)
{
    proxy *x = arg;
    uint8_t buf[1 << 16];
    for (;;) {
        int fd = -1;
        ssize_t r = ft_recv_fd(x->dfd, buf, sizeof buf, 0, &fd);
        if (r <= 0)
            break;
        int w = ft_send_fd(x->cfd, buf, (size_t)r, fd);
        if (fd >= 0)
            close(fd);
        if (w < 0)
            break;
    }
    shutdown(x->cfd, SHUT_RDWR);
    return NULL;
}

/* client -> daemon: frame by frame, each request's type logged */
static void *proxy_main(void *arg)
{
    proxy *x = arg;
    x->cfd = accept(x->lfd, NULL, NULL);
    assert_true(x->cfd >= 0);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    memcpy(a.sun_path, g_sock, strlen(g_sock) + 1);
    x->dfd = socket(AF_UNIX, SOCK_STREAM, 0);
    assert_int_equal(connect(x->dfd, (struct sockaddr *)&a, sizeof a), 0);
    assert_int_equal(pthread_create(&x->back, NULL, proxy_back, x), 0);
    static uint8_t frame[FERRY__PROTO_HDR + FERRY__PROTO_MAX_PAYLOAD];
    for (;;) {
        ferry__proto_hdr h;
        char why[128];
        if (recv_full(x->cfd, frame, FERRY__PROTO_HDR) < 0 ||
            ferry__proto_hdr_decode(frame, FERRY__PROTO_HDR, &h, why, sizeof why) < 0 ||
            recv_full(x->cfd, frame + FERRY__PROTO_HDR, h.len) < 0)
            break;
        if (x->n < LOG_MAX)
            x->type[x->n++] = h.type;
        if (ft_send_fd(x->dfd, frame, FERRY__PROTO_HDR + h.len, -1) < 0)
            break;
    }
    shutdown(x->dfd, SHUT_RDWR);
    pthread_join(x->back, NULL);
    close(x->cfd);
    close(x->dfd);
    return NULL;
}

static void proxy_start(proxy *x)
{
    memset(x, 0, sizeof *x);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    memcpy(a.sun_path, g_proxy, strlen(g_proxy) + 1);
    x->lfd = socket(AF_UNIX, SOCK_STREAM, 0);
    assert_true(x->lfd >= 0);
    assert_int_equal(bind(x->lfd, (struct sockaddr *)&a, sizeof a), 0);
    assert_int_equal(listen(x->lfd, 1), 0);
    assert_int_equal(pthread_create(&x->th, NULL, proxy_main, x), 0);
}

static void proxy_stop(proxy *x)
{
    pthread_join(x->th, NULL);
    close(x->lfd);
    unlink(g_proxy);
}

/* ---- the pipeline's shape ---- */

static void test_pipelined_order(void **state)
{
    (void)state;
    srv v;
    srv_start(&v);
    store_prompts();
    proxy x;
    proxy_start(&x);
    ferry_kv_config c = client_config(g_proxy);
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    unsigned char *want = prompt_bytes(1);
    ferry_kv_stats a = FERRY_KV_STATS_INIT, z = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(kv, &a));
    assert_int_equal(retrieve_checked(kv, 1, want), NCH);
    FT_ASSERT_OK(ferry_kv_stats_get(kv, &z));
    /* (most chunks came from the drive: the pool holds a fifth of them) */
    assert_true(z.tier[FERRY_KV_TIER_L2].bytes_read - a.tier[FERRY_KV_TIER_L2].bytes_read >=
                (uint64_t)(NCH - POOL) * CHUNK);
    ferry_kv_close(kv);
    proxy_stop(&x);
    /* the requests of the retrieve, in the order the daemon got them */
    size_t acq = 0, rel = 0, pf = 0, ahead = 0, most = 0;
    for (size_t i = 0; i < x.n; i++) {
        int t = x.type[i];
        if (t == FERRY__P_ACQUIRE) {
            ahead += acq > rel; /* sent while the batch before is still held */
            acq++;
        }
        rel += t == FERRY__P_RELEASE;
        pf += t == FERRY__P_PREFETCH;
        if (acq - rel > most)
            most = acq - rel;
    }
    size_t batches = NCH / (POOL / 8);
    assert_int_equal(acq, batches); /* (one client alone: no chunk refused a slot) */
    assert_int_equal(rel, batches);
    assert_int_equal(ahead, batches - 1);
    assert_int_equal(most, 2);
    /* a PREFETCH of the next three batches goes before every ACQUIRE but
     * the last one's */
    assert_int_equal(pf, batches - 1);
    free(want);
    ft_srv_close(&v);
}

/* ---- clients at once ---- */

#define ROUNDS 4

/* a client process: prompts c and c + 1 in turns; exit 0 (and at least one
 * chunk retrieved), 1 on a wrong byte, 2 when it retrieved nothing */
static void client_run(int c, int forever)
{
    ferry_kv_config cfg = client_config(g_sock);
    ferry_kv *kv = NULL;
    if (ferry_kv_open(&cfg, &kv) < 0)
        _exit(3);
    unsigned char *want[2] = {prompt_bytes(c % PROMPTS), prompt_bytes((c + 1) % PROMPTS)};
    long got = 0;
    for (int r = 0; forever || r < ROUNDS; r++) {
        int k = retrieve_checked(kv, (c + r % 2) % PROMPTS, want[r % 2]);
        if (k < 0)
            _exit(1);
        got += k;
    }
    ferry_kv_close(kv);
    fprintf(stderr, "client %d: %ld of %d chunks retrieved\n", c, got, ROUNDS * NCH);
    _exit(got > 0 ? 0 : 2);
}

static void test_clients_at_once(void **state)
{
    (void)state;
    srv v;
    srv_start(&v);
    store_prompts();
    pid_t pid[PROMPTS];
    for (int c = 0; c < PROMPTS; c++) {
        pid[c] = fork();
        assert_true(pid[c] >= 0);
        if (pid[c] == 0)
            client_run(c, 0);
    }
    for (int c = 0; c < PROMPTS; c++) {
        int ws;
        assert_int_equal(waitpid(pid[c], &ws, 0), pid[c]);
        assert_true(WIFEXITED(ws));
        assert_int_equal(WEXITSTATUS(ws), 0);
    }
    ft_srv_close(&v);
}

/* ---- clients killed mid-pipeline ---- */

/* no chunk of the prompts is locked: each deletes, and the pool is empty */
static void assert_nothing_held(ferry_serve *s)
{
    ferry_kv *dk = ferry_serve_kv(s);
    FT_ASSERT_OK(ferry_kv_flush(dk)); /* (read-aheads still landing hold their chunk) */
    for (int p = 0; p < PROMPTS; p++) {
        int32_t t[N];
        prompt_tokens(p, t);
        int rc = ferry_kv_delete(dk, t, N, NULL);
        assert_int_not_equal(rc, FERRY_ELOCKED);
        assert_true(rc >= 0);
    }
    ferry_kv_stats m = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(dk, &m));
    assert_int_equal(m.tier[FERRY_KV_TIER_L1].chunks, 0);
    assert_int_equal(m.tier[FERRY_KV_TIER_L1].used_bytes, 0);
}


static void test_killed_mid_pipeline(void **state)
{
    (void)state;
    srv v;
    srv_start(&v);
    store_prompts();
    unsigned seed = (unsigned)time(NULL);
    fprintf(stderr, "seed %u\n", seed);
    srand(seed);
    for (int round = 0; round < 8; round++) {
        pid_t pid[2];
        for (int c = 0; c < 2; c++) {
            pid[c] = fork();
            assert_true(pid[c] >= 0);
            if (pid[c] == 0)
                client_run(round + c, 1);
        }
        usleep(2000 + (useconds_t)(rand() % 40000));
        for (int c = 0; c < 2; c++) {
            int ws;
            kill(pid[c], SIGKILL);
            assert_int_equal(waitpid(pid[c], &ws, 0), pid[c]);
            /* killed, not exited: an exit would be a wrong byte or a failure */
            assert_true(WIFSIGNALED(ws));
        }
    }
    /* the daemon saw every connection end and let go of what each held */
    ferry_serve_stats ss = FERRY_SERVE_STATS_INIT;
    for (int i = 0; i < 500; i++) {
        FT_ASSERT_OK(ferry_serve_stats_get(v.s, &ss));
        if (ss.clients == 0)
            break;
        usleep(10000);
    }
    assert_int_equal(ss.clients, 0);
    /* a fresh client gets every prompt whole and exact */
    ferry_kv_config c = client_config(g_sock);
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    for (int p = 0; p < PROMPTS; p++) {
        unsigned char *want = prompt_bytes(p);
        assert_int_equal(retrieve_checked(kv, p, want), NCH);
        free(want);
    }
    ferry_kv_close(kv);
    assert_nothing_held(v.s);
    ft_srv_close(&v);
}

/* ---- a retrieve cancelled mid-pipeline ---- */

/* an asynchronous retrieve cancelled at moments along it: the chunks moved
 * are exact (status 0), the rest -ECANCELED from some chunk on with their
 * bytes untouched; the connection stays in step (the next retrieve on it
 * gets the whole prompt) and nothing stays held */
static void test_cancel_mid_pipeline(void **state)
{
    (void)state;
    srv v;
    srv_start(&v);
    store_prompts();
    ferry_kv_config c = client_config(g_sock);
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    unsigned char *want = prompt_bytes(2);
    static unsigned char got[PLANES * N * TB];
    int32_t t[N];
    prompt_tokens(2, t);
    int cancelled = 0;
    for (int round = 0; round < 12; round++) {
        memset(got, 0, sizeof got);
        ferry_kv_buffer b = buffer_of(got);
        int st[NCH];
        ferry_kv_req r = FERRY_KV_REQ_INIT;
        r.status = st;
        r.max_chunks = NCH;
        ferry_kv_op *op = NULL;
        FT_ASSERT_OK(ferry_kv_retrieve_async(kv, t, N, &r, &b, &op));
        usleep((useconds_t)(round * 400));
        int rc = ferry_kv_op_cancel(op);
        ferry_kv_op_free(op);
        assert_true(rc == -ECANCELED || rc == N);
        cancelled += rc == -ECANCELED;
        int from = NCH;
        for (int i = 0; i < NCH; i++) {
            if (st[i] == -ECANCELED && from == NCH)
                from = i;
            assert_int_equal(st[i], i >= from ? -ECANCELED : 0);
            for (unsigned pl = 0; pl < PLANES; pl++) {
                size_t off = ((size_t)pl * N + (size_t)i * CT) * TB;
                if (st[i] == 0)
                    assert_memory_equal(got + off, want + off, CT * TB);
                else
                    for (size_t k = 0; k < CT * TB; k++)
                        assert_int_equal(got[off + k], 0);
            }
        }
        assert_int_equal(retrieve_checked(kv, 2, want), NCH);
    }
    fprintf(stderr, "%d of 12 retrieves stopped by their cancel\n", cancelled);
    ferry_kv_close(kv);
    free(want);
    assert_nothing_held(v.s);
    ft_srv_close(&v);
}

/* ---- stores and retrieves at once, under pressure ---- */

#define WRITERS 6
#define WROUNDS 8

/* what a writer's store answered, for the parent to hold it to: written
 * before done is set, so a writer killed mid-store leaves done 0 */
typedef struct wrec {
    int rc;
    int st[NCH];
    atomic_int done;
} wrec;

/* the prompt writer c stores in round r: in odd rounds the same as its
 * neighbour's (c ^ 1), so two writers race for the same chunks */
static int wprompt(int c, int r)
{
    return 100 + (r % 2 ? c / 2 * 2 : c) * 10 + r;
}

/* a store's answer against kv.h: rc the leading tokens whose chunks are
 * status 0, the chunk it stopped at declined with a code (never 0), or rc
 * < 0 with the first chunk declined; 0 when it holds */
static int store_answer_ok(int rc, const int *st)
{
    if (rc < 0)
        return rc == FERRY_ENOSPACE && st[0] < 0;
    if (rc % CT || rc > (int)N)
        return 0;
    for (int i = 0; i < rc / (int)CT; i++)
        if (st[i] != 0)
            return 0;
    return rc == (int)N || st[rc / CT] < 0;
}

/* a writer process: each round stores a prompt of its own, then reads it
 * and a prompt every writer reads back; exit 0, 1 on a wrong byte, 5 on a
 * store answer that breaks the contract */
static void writer_run(int c, wrec *tab, int forever)
{
    ferry_kv_config cfg = client_config(g_sock);
    cfg.pool_wait_ms = c % 2 ? 0 : 2; /* declines at once, or nearly */
    ferry_kv *kv = NULL;
    if (ferry_kv_open(&cfg, &kv) < 0)
        _exit(3);
    unsigned char *shared = prompt_bytes(c % PROMPTS);
    for (int r = 0; forever || r < WROUNDS; r++) {
        int p = wprompt(c, r % WROUNDS);
        int32_t t[N];
        prompt_tokens(p, t);
        unsigned char *m = prompt_bytes(p);
        ferry_kv_buffer b = buffer_of(m);
        wrec *w = &tab[c * WROUNDS + r % WROUNDS];
        ferry_kv_req q = FERRY_KV_REQ_INIT;
        q.status = w->st;
        q.max_chunks = NCH;
        w->rc = ferry_kv_store(kv, t, N, &q, &b);
        if (!store_answer_ok(w->rc, w->st)) {
            fprintf(stderr, "writer %d round %d: store answered %d, chunk 0 status %d: %s\n", c,
                    r, w->rc, w->st[0], ferry_kv_last_error(kv));
            _exit(5);
        }
        if (!forever)
            atomic_store(&w->done, 1);
        if (retrieve_checked(kv, p, m) < 0 || retrieve_checked(kv, c % PROMPTS, shared) < 0)
            _exit(1);
        free(m);
    }
    ferry_kv_close(kv);
    free(shared);
    _exit(0);
}

/* retrieve prompt p: each chunk's status into st; -1 on a wrong byte */
static int retrieve_status(ferry_kv *kv, int p, const unsigned char *want, int *st)
{
    int32_t t[N];
    prompt_tokens(p, t);
    static unsigned char got[PLANES * N * TB];
    memset(got, 0, sizeof got);
    ferry_kv_buffer b = buffer_of(got);
    ferry_kv_req r = FERRY_KV_REQ_INIT;
    r.status = st;
    r.max_chunks = NCH;
    if (ferry_kv_retrieve(kv, t, N, &r, &b) < 0)
        return 0;
    for (size_t i = 0; i < NCH; i++)
        for (unsigned pl = 0; pl < PLANES; pl++) {
            size_t off = ((size_t)pl * N + i * CT) * TB;
            if (memcmp(got + off, st[i] == 0 ? want + off : got + off, CT * TB) != 0)
                return -1;
        }
    return 0;
}

/*
 * Several engines on one small pool: writers storing prompts longer than
 * the pool and reading them back at once, while this process holds a
 * layerwise store's window reserved and a layerwise retrieve's chunks
 * acquired and never lets either go, and later writers killed mid-store or
 * mid-retrieve. Every store answers by the contract (a chunk not stored
 * is declined with a code, never a silent 0), no byte is ever wrong, and
 * every chunk a store answered 0 for is found afterwards, exact.
 */
static void test_stores_and_retrieves_at_once(void **state)
{
    (void)state;
    srv v;
    {
        ferry_kv_config kc = store_config();
        kc.l2_dir = g_l2;
        kc.l2_bytes = 8 * WRITERS * WROUNDS * NCH * CHUNK;
        ferry_serve_config sc = FERRY_SERVE_CONFIG_INIT;
        sc.socket_path = g_sock;
        sc.kv = &kc;
        ft_srv_open(&v, &sc);
    }
    store_prompts();
    wrec *tab = mmap(NULL, 2 * WRITERS * WROUNDS * sizeof *tab, PROT_READ | PROT_WRITE,
                     MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    assert_true(tab != MAP_FAILED);
    memset(tab, 0, 2 * WRITERS * WROUNDS * sizeof *tab);
    /* a client that never lets go: a prefill's window and a retrieve's chunks */
    ferry_kv_config hc = client_config(g_sock);
    ferry_kv *hog = NULL;
    FT_ASSERT_OK(ferry_kv_open(&hc, &hog));
    int32_t ht[4 * CT], pt[N];
    for (size_t i = 0; i < 4 * CT; i++)
        ht[i] = 77000000 + (int32_t)i;
    prompt_tokens(0, pt);
    unsigned char *hm = prompt_bytes(0);
    ferry_kv_buffer hb = buffer_of(hm);
    static unsigned char hgot[PLANES * N * TB];
    ferry_kv_buffer hg = buffer_of(hgot);
    ferry_kv_op *hs = NULL, *hr = NULL;
    FT_ASSERT_OK(ferry_kv_store_layers(hog, ht, 4 * CT, NULL, &hb, NULL, &hs));
    FT_ASSERT_OK(ferry_kv_retrieve_layers(hog, pt, 2 * CT, NULL, &hg, NULL, &hr));
    pid_t pid[WRITERS];
    for (int c = 0; c < WRITERS; c++) {
        pid[c] = fork();
        assert_true(pid[c] >= 0);
        if (pid[c] == 0)
            writer_run(c, tab, 0);
    }
    for (int c = 0; c < WRITERS; c++) {
        int ws;
        assert_int_equal(waitpid(pid[c], &ws, 0), pid[c]);
        assert_true(WIFEXITED(ws));
        assert_int_equal(WEXITSTATUS(ws), 0);
    }
    ferry_kv_op_free(hs);
    ferry_kv_op_free(hr);
    ferry_kv_close(hog);
    /* writers killed mid-op: what they finished is held to the same */
    unsigned seed = (unsigned)time(NULL);
    fprintf(stderr, "seed %u\n", seed);
    srand(seed);
    wrec *tab2 = tab + WRITERS * WROUNDS;
    for (int round = 0; round < 4; round++) {
        for (int c = 0; c < 2; c++) {
            pid[c] = fork();
            assert_true(pid[c] >= 0);
            if (pid[c] == 0)
                writer_run(c, tab2, 1);
        }
        usleep(5000 + (useconds_t)(rand() % 60000));
        for (int c = 0; c < 2; c++) {
            int ws;
            kill(pid[c], SIGKILL);
            assert_int_equal(waitpid(pid[c], &ws, 0), pid[c]);
            assert_true(WIFSIGNALED(ws)); /* an exit: a wrong byte or a broken answer */
        }
    }
    ferry_serve_stats ss = FERRY_SERVE_STATS_INIT;
    for (int i = 0; i < 500; i++) {
        FT_ASSERT_OK(ferry_serve_stats_get(v.s, &ss));
        if (ss.clients == 0)
            break;
        usleep(10000);
    }
    assert_int_equal(ss.clients, 0);
    /* every chunk a finished store answered 0 for is there, exact */
    ferry_kv_config fc = client_config(g_sock);
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&fc, &kv));
    FT_ASSERT_OK(ferry_kv_flush(kv));
    long stored = 0, declined = 0;
    for (int c = 0; c < WRITERS; c++)
        for (int r = 0; r < WROUNDS; r++) {
            wrec *w = &tab[c * WROUNDS + r];
            assert_int_equal(atomic_load(&w->done), 1);
            unsigned char *m = prompt_bytes(wprompt(c, r));
            int st[NCH];
            assert_int_equal(retrieve_status(kv, wprompt(c, r), m, st), 0);
            for (int i = 0; i < NCH; i++) {
                if (w->st[i] == 0 && st[i] != 0)
                    fprintf(stderr, "writer %d round %d chunk %d: stored, now %d\n", c, r, i,
                            st[i]);
                assert_true(w->st[i] != 0 || st[i] == 0);
                stored += w->st[i] == 0;
                declined += w->st[i] != 0;
            }
            free(m);
        }
    fprintf(stderr, "%ld chunks stored, %ld declined, by %d writers at once\n", stored,
            declined, WRITERS);
    ferry_kv_close(kv);
    for (int c = 0; c < WRITERS; c++)
        for (int r = 0; r < WROUNDS; r++) {
            int32_t t[N];
            prompt_tokens(wprompt(c, r), t);
            assert_true(ferry_kv_delete(ferry_serve_kv(v.s), t, N, NULL) >= 0);
        }
    assert_nothing_held(v.s);
    munmap(tab, 2 * WRITERS * WROUNDS * sizeof *tab);
    free(hm);
    ft_srv_close(&v);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_pipelined_order, setup, teardown),
        cmocka_unit_test_setup_teardown(test_clients_at_once, setup, teardown),
        cmocka_unit_test_setup_teardown(test_killed_mid_pipeline, setup, teardown),
        cmocka_unit_test_setup_teardown(test_cancel_mid_pipeline, setup, teardown),
        cmocka_unit_test_setup_teardown(test_stores_and_retrieves_at_once, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
