/*
 * test_serve.c - `ferry serve` and its client backend: the same store,
 * lookup and retrieve assertions on an in-process store and through a
 * daemon; a client killed mid-store; the daemon killed and restarted on a
 * persistent L2; bad frames, slots not held, a client that never reads,
 * more connections than allowed, another uid, a lock that outlived its TTL,
 * a client's read-ahead spared under pressure until its ACQUIRE.
 */
/* ferry-test-labels: concurrent */
/* ferry-test-timeout: 300 */
#include <dirent.h>
#include <errno.h>
#include <grp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ferry/testctl.h"
#include "ferry_test.h"
#include "serve_fixture.h"
#include "kv/kv_impl.h"
#include "proto/proto.h"
#include "kv/store/store_int.h"

#define CT 16
#define TB 64u
#define PLANES 4u
#define CHUNK (PLANES * CT * TB)

/* how long a daemon process may take to exit after SIGTERM */
#define DAEMON_STOP_MS 60000

static char g_dir[256];
static char g_sock[300];

static ferry_kv_config store_config(uint64_t l1_chunks)
{
    ferry_kv_config c = FERRY_KV_CONFIG_INIT;
    c.model = "test-model";
    c.layout = ft_kv_layout(TB);
    c.chunk_tokens = CT;
    c.l1_bytes = l1_chunks * CHUNK;
    c.workers = 2;
    return c;
}

static ferry_kv_config client_config(void)
{
    ferry_kv_config c = store_config(1);
    c.server = g_sock;
    c.server_timeout_ms = 1000;
    return c;
}

/* ---- a daemon in a thread of this process ---- */

typedef ft_srv srv;

static void srv_start_cfg(srv *v, const ferry_kv_config *kc, unsigned max_clients,
                          uint32_t send_timeout_ms)
{
    ferry_serve_config sc = FERRY_SERVE_CONFIG_INIT;
    sc.socket_path = g_sock;
    sc.kv = kc;
    sc.max_clients = max_clients;
    sc.send_timeout_ms = send_timeout_ms;
    ft_srv_open(v, &sc);
}

static void srv_start(srv *v, uint64_t l1_chunks)
{
    ferry_kv_config kc = store_config(l1_chunks);
    srv_start_cfg(v, &kc, 0, 0);
}

static int setup(void **state)
{
    (void)state;
    ft_sock_dir(g_dir, sizeof g_dir, g_sock, sizeof g_sock);
    signal(SIGPIPE, SIG_IGN);
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    ft_rmtree(g_dir);
    return 0;
}

/* ---- buffers ---- */

typedef struct hbuf {
    ferry_kv_buffer b;
    unsigned char *mem;
    uint64_t cap;
} hbuf;

static void hbuf_init(hbuf *h, uint64_t cap, unsigned seed)
{
    ferry_kv_buffer b = FERRY_KV_BUFFER_INIT;
    b.layout = ft_kv_layout(TB);
    h->cap = cap;
    h->mem = malloc(PLANES * cap * TB);
    assert_non_null(h->mem);
    if (seed)
        ft_fill_pattern(h->mem, PLANES * cap * TB, seed);
    else
        memset(h->mem, 0, PLANES * cap * TB);
    b.base = (uint64_t)(uintptr_t)h->mem;
    b.capacity_tokens = cap;
    h->b = b;
}

static int same_tokens(const hbuf *a, const hbuf *b, uint64_t from, uint64_t to)
{
    for (unsigned p = 0; p < PLANES; p++)
        if (memcmp(a->mem + (p * a->cap + from) * TB, b->mem + (p * b->cap + from) * TB,
                   (to - from) * TB))
            return 0;
    return 1;
}

static void make_tokens(int32_t *t, size_t n, int32_t base)
{
    for (size_t i = 0; i < n; i++)
        t[i] = base + (int32_t)(i * 7919 % 32000);
}

#define BT 4
#define NBLK 40
typedef struct pbuf {
    ferry_kv_buffer b;
    unsigned char *mem[PLANES];
    uint64_t bases[PLANES];
    int32_t table[NBLK];
} pbuf;

static void pbuf_init(pbuf *p)
{
    ferry_kv_buffer b = FERRY_KV_BUFFER_INIT;
    b.layout = ft_kv_layout(TB);
    b.form = FERRY_KV_PAGED;
    for (unsigned i = 0; i < PLANES; i++) {
        p->mem[i] = calloc(NBLK, BT * TB);
        assert_non_null(p->mem[i]);
        p->bases[i] = (uint64_t)(uintptr_t)p->mem[i];
    }
    for (int k = 0; k < NBLK; k++)
        p->table[k] = (k * 7 + 3) % NBLK;
    b.block_bases = p->bases;
    b.block_tokens = BT;
    b.num_blocks = NBLK;
    b.block_table = p->table;
    b.table_len = NBLK;
    p->b = b;
}

static int paged_same(pbuf *p, const hbuf *h, uint64_t n)
{
    for (unsigned pl = 0; pl < PLANES; pl++)
        for (uint64_t t = 0; t < n; t++)
            if (memcmp(p->mem[pl] + ((uint64_t)p->table[t / BT] * BT + t % BT) * TB,
                       h->mem + (pl * h->cap + t) * TB, TB))
                return 0;
    return 1;
}

/* ---- the same assertions, in-process and through the daemon ---- */

static void exercise(ferry_kv *kv)
{
    enum { N = 8 * CT + 5 };
    int32_t tok[N];
    make_tokens(tok, N, 100);
    int32_t other5[N]; /* another prompt sharing the first 5 chunks */
    memcpy(other5, tok, sizeof other5);
    other5[5 * CT] ^= 1;
    hbuf src, dst;
    hbuf_init(&src, N, 7);
    hbuf_init(&dst, N, 0);
    uint8_t tiers[16];
    int st[16];
    ferry_kv_req r = FERRY_KV_REQ_INIT;
    r.tiers = tiers;
    r.status = st;
    r.max_chunks = 16;

    assert_int_equal(ferry_kv_lookup(kv, tok, N, NULL), 0);
    assert_int_equal(ferry_kv_retrieve(kv, tok, 4 * CT, &r, &dst.b), 0);
    assert_int_equal(st[0], FERRY_ENOTFOUND);
    /* whole chunks only, unless the request asks for the partial one */
    assert_int_equal(ferry_kv_store(kv, tok, N, &r, &src.b), 8 * CT);
    for (int i = 0; i < 8; i++)
        assert_int_equal(st[i], 0);
    memset(tiers, 9, sizeof tiers);
    assert_int_equal(ferry_kv_lookup(kv, tok, N, &r), 8 * CT);
    assert_int_equal(tiers[0], FERRY_KV_TIER_L1);
    assert_int_equal(tiers[7], FERRY_KV_TIER_L1);
    assert_int_equal(tiers[8], 9); /* past the request's whole chunks: not written */
    assert_int_equal(ferry_kv_lookup(kv, other5, N, &r), 5 * CT);
    assert_int_equal(tiers[5], FERRY_KV_TIER_NONE); /* the first miss */
    /* a prefix of the prompt */
    assert_int_equal(ferry_kv_lookup(kv, tok, 3 * CT + 2, NULL), 3 * CT);
    /* stored again: already present, counted as stored */
    assert_int_equal(ferry_kv_store(kv, tok, 8 * CT, NULL, &src.b), 8 * CT);
    /* retrieve: the same bytes */
    assert_int_equal(ferry_kv_retrieve(kv, tok, N, &r, &dst.b), 8 * CT);
    assert_true(same_tokens(&src, &dst, 0, 8 * CT));
    /* the partial last chunk */
    ferry_kv_req rp = FERRY_KV_REQ_INIT;
    rp.flags = FERRY_KV_PARTIAL;
    assert_int_equal(ferry_kv_store(kv, tok, N, &rp, &src.b), N);
    assert_int_equal(ferry_kv_lookup(kv, tok, N, &rp), N);
    memset(dst.mem, 0, PLANES * N * TB);
    assert_int_equal(ferry_kv_retrieve(kv, tok, N, &rp, &dst.b), N);
    assert_true(same_tokens(&src, &dst, 0, N));
    /* a paged host buffer */
    pbuf pb;
    pbuf_init(&pb);
    assert_int_equal(ferry_kv_retrieve(kv, tok, 8 * CT, NULL, &pb.b), 8 * CT);
    assert_true(paged_same(&pb, &src, 8 * CT));
    /* a salt is another namespace */
    ferry_kv_req rs = FERRY_KV_REQ_INIT;
    rs.salt = "tenant";
    rs.salt_len = 6;
    assert_int_equal(ferry_kv_lookup(kv, tok, N, &rs), 0);
    /* stats */
    ferry_kv_stats m = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(kv, &m));
    assert_true(m.lookups >= 5);
    assert_true(m.stored_chunks >= 9);
    assert_true(m.hit_tokens >= 8 * CT);
    assert_int_equal(m.tier[FERRY_KV_TIER_L1].chunks, 9);
    /* delete, flush, sync */
    assert_int_equal(ferry_kv_delete(kv, tok, 8 * CT, NULL), 8);
    assert_int_equal(ferry_kv_lookup(kv, tok, N, NULL), 0);
    FT_ASSERT_OK(ferry_kv_flush(kv));
    assert_true(ferry_kv_sync(kv) >= 0);
    for (unsigned i = 0; i < PLANES; i++)
        free(pb.mem[i]);
    free(src.mem);
    free(dst.mem);
}

static void test_in_process(void **state)
{
    (void)state;
    ferry_kv_config c = store_config(64);
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    exercise(kv);
    FT_ASSERT_OK(ferry__kv_check(kv));
    ferry_kv_close(kv);
}

static void test_through_server(void **state)
{
    (void)state;
    srv v;
    srv_start(&v, 64);
    ferry_kv_config c = client_config();
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    assert_int_equal(ferry_kv_chunk_bytes(kv), CHUNK);
    exercise(kv);
    /* the asynchronous forms and prefetch run through the daemon too */
    ferry_kv_op *op = NULL;
    int32_t tok[4 * CT];
    make_tokens(tok, 4 * CT, 4242);
    hbuf h, d;
    hbuf_init(&h, 4 * CT, 1);
    hbuf_init(&d, 4 * CT, 0);
    FT_ASSERT_OK(ferry_kv_store_async(kv, tok, 4 * CT, NULL, &h.b, &op));
    assert_int_equal(ferry_kv_op_wait(op, -1), 4 * CT);
    ferry_kv_op_free(op);
    assert_int_equal(ferry_kv_prefetch(kv, tok, 4 * CT, NULL), 4 * CT);
    FT_ASSERT_OK(ferry_kv_retrieve_async(kv, tok, 4 * CT, NULL, &d.b, &op));
    assert_int_equal(ferry_kv_op_wait(op, -1), 4 * CT);
    ferry_kv_op_free(op);
    assert_true(same_tokens(&h, &d, 0, 4 * CT));
    /* a cancel stops an async retrieve between its batches: every chunk
     * reported moved is exact, every other destination untouched */
    for (int round = 0; round < 4; round++) {
        int32_t lt[40 * CT];
        make_tokens(lt, 40 * CT, 777);
        hbuf ls, ld;
        hbuf_init(&ls, 40 * CT, 3);
        hbuf_init(&ld, 40 * CT, 0);
        assert_int_equal(ferry_kv_store(kv, lt, 40 * CT, NULL, &ls.b), 40 * CT);
        int cst[40];
        ferry_kv_req cr = FERRY_KV_REQ_INIT;
        cr.status = cst;
        cr.max_chunks = 40;
        FT_ASSERT_OK(ferry_kv_retrieve_async(kv, lt, 40 * CT, &cr, &ld.b, &op));
        if (round)
            usleep((useconds_t)(round * 300));
        int crc = ferry_kv_op_cancel(op);
        assert_true(crc == 40 * CT || crc == -ECANCELED);
        for (int k = 0; k < 40; k++) {
            if (cst[k] == 0) {
                assert_true(same_tokens(&ls, &ld, (uint64_t)k * CT, (uint64_t)(k + 1) * CT));
                continue;
            }
            assert_int_equal(cst[k], -ECANCELED);
            for (unsigned pl = 0; pl < PLANES; pl++)
                for (unsigned b = 0; b < CT * TB; b++)
                    assert_int_equal(ld.mem[(pl * 40 * CT + (unsigned)k * CT) * TB + b], 0);
        }
        ferry_kv_op_free(op);
        free(ls.mem);
        free(ld.mem);
    }
    /* pins: held by the daemon for this connection, undone one by one */
    assert_int_equal(ferry_kv_pin(kv, tok, 4 * CT, NULL), 4 * CT);
    assert_int_equal(ferry_kv_pin(kv, tok, 2 * CT, NULL), 2 * CT);
    assert_int_equal(ferry_kv_delete(kv, tok, 4 * CT, NULL), FERRY_ELOCKED);
    assert_int_equal(ferry_kv_unpin(kv, tok, 4 * CT, NULL), 4 * CT);
    assert_int_equal(ferry_kv_unpin(kv, tok, 4 * CT, NULL), 2 * CT); /* only 2 pinned twice */
    assert_int_equal(ferry_kv_unpin(kv, tok, 4 * CT, NULL), 0);
    assert_int_equal(ferry_kv_delete(kv, tok, 4 * CT, NULL), 4);
    free(h.mem);
    free(d.mem);
    ferry_kv_close(kv);
    FT_ASSERT_OK(ferry__kv_check(ferry_serve_kv(v.s)));
    ft_srv_close(&v);
}

/* two clients share one cache; a scheduler maps no pool and only looks up */
static void test_shared_and_lookup_only(void **state)
{
    (void)state;
    srv v;
    srv_start(&v, 32);
    ferry_kv_config c = client_config();
    ferry_kv *a = NULL, *b = NULL, *sched = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &a));
    FT_ASSERT_OK(ferry_kv_open(&c, &b));
    ferry_kv_config sc = c;
    sc.l1_bytes = 0;
    FT_ASSERT_OK(ferry_kv_open(&sc, &sched));
    int32_t tok[4 * CT];
    make_tokens(tok, 4 * CT, 5);
    hbuf src, dst;
    hbuf_init(&src, 4 * CT, 3);
    hbuf_init(&dst, 4 * CT, 0);
    assert_int_equal(ferry_kv_store(a, tok, 4 * CT, NULL, &src.b), 4 * CT);
    assert_int_equal(ferry_kv_lookup(sched, tok, 4 * CT, NULL), 4 * CT);
    assert_int_equal(ferry_kv_retrieve(b, tok, 4 * CT, NULL, &dst.b), 4 * CT);
    assert_true(same_tokens(&src, &dst, 0, 4 * CT));
    assert_int_equal(ferry_kv_store(sched, tok, 4 * CT, NULL, &src.b), FERRY_ENOTSUP);
    assert_non_null(strstr(ferry_kv_last_error(sched), "lookups only"));
    /* another layout is refused at open, naming both */
    ferry_kv_config bad = c;
    bad.chunk_tokens = 32;
    ferry_kv *x = NULL;
    assert_int_equal(ferry_kv_open(&bad, &x), FERRY_EMISMATCH);
    assert_non_null(strstr(ferry_last_error(), "chunk"));
    ferry_kv_close(a);
    ferry_kv_close(b);
    ferry_kv_close(sched);
    free(src.mem);
    free(dst.mem);
    ft_srv_close(&v);
}

/* ---- a raw client: the protocol by hand ---- */

typedef ft_raw raw;

static int raw_connect(raw *r)
{
    return ft_raw_connect(r, g_sock);
}

static void raw_send_bytes(raw *r, const void *p, size_t n)
{
    assert_int_equal(send(r->fd, p, n, MSG_NOSIGNAL), (ssize_t)n);
}

static void raw_hello(raw *r, int pool)
{
    char msg[256];
    assert_int_equal(ft_raw_hello(r, TB, CT, pool, msg, sizeof msg), 0);
    assert_int_equal(pool ? r->pool_fd >= 0 : r->pool_fd < 0, 1);
}

/* a request of type t over n chunks */
static void raw_chunks(raw *r, int t, ferry__proto_chunk *ch, uint32_t n)
{
    ferry__proto_req q;
    memset(&q, 0, sizeof q);
    q.hdr.type = (uint8_t)t;
    q.n = n;
    q.chunks = ch;
    ft_raw_req(r, &q);
}

static void raw_ping(raw *r)
{
    ferry__proto_req q;
    memset(&q, 0, sizeof q);
    q.hdr.type = FERRY__P_PING;
    ft_raw_req(r, &q);
    int32_t rc;
    char msg[64];
    assert_int_equal(ft_raw_reply(r, &rc, msg, sizeof msg), 0);
    assert_int_equal(r->h.type, FERRY__P_PING | FERRY__PROTO_REPLY);
    assert_int_equal(rc, 0);
}

/* the chunk ids of tokens for the test store's namespace */
static void ids_of(const int32_t *tok, size_t n, ferry_kv_hash *ids)
{
    ferry_kv_config c = store_config(4);
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    ferry_kv_hash stack[512], *out = NULL;
    int nch = ferry__kv_make_ids(kv, tok, n, NULL, "ids", stack, &out);
    assert_true(nch > 0);
    memcpy(ids, out, (size_t)nch * sizeof *ids);
    if (out != stack)
        free(out);
    ferry_kv_close(kv);
}

static void assert_idle_pool(ferry_serve *s, uint64_t chunks)
{
    ferry_kv *kv = ferry_serve_kv(s);
    FT_ASSERT_OK(ferry__kv_check(kv));
    ferry_kv_stats m = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(kv, &m));
    assert_int_equal(m.tier[FERRY_KV_TIER_L1].chunks, chunks);
    assert_int_equal(m.tier[FERRY_KV_TIER_L1].used_bytes, chunks * 4096);
}

/* ---- a client killed mid-store ---- */

static void test_client_killed_mid_store(void **state)
{
    (void)state;
    srv v;
    srv_start(&v, 16);
    int32_t tok[4 * CT];
    make_tokens(tok, 4 * CT, 77);
    ferry_kv_hash ids[4];
    ids_of(tok, 4 * CT, ids);
    int pfd[2];
    assert_int_equal(pipe(pfd), 0);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        /* reserve four slots, write half of them, die before the commit */
        raw r;
        if (raw_connect(&r) < 0)
            _exit(3);
        raw_hello(&r, 1);
        ferry__proto_chunk ch[4];
        memset(ch, 0, sizeof ch);
        for (int i = 0; i < 4; i++) {
            ch[i].id = ids[i];
            ch[i].tokens = CT;
        }
        raw_chunks(&r, FERRY__P_RESERVE, ch, 4);
        int32_t rc;
        char msg[64];
        if (ft_raw_reply(&r, &rc, msg, sizeof msg) < 0 || rc != 0)
            _exit(4);
        unsigned char *pool = mmap(NULL, 16 * 4096, PROT_READ | PROT_WRITE, MAP_SHARED,
                                   r.pool_fd, 0);
        if (pool == MAP_FAILED)
            _exit(5);
        ferry__proto_get_u32(&r.rd);
        int32_t s0 = (int32_t)ferry__proto_get_u32(&r.rd);
        uint64_t slot0 = ferry__proto_get_u64(&r.rd);
        if (s0 != 0)
            _exit(6);
        memset(pool + slot0 * 4096, 0xab, 2048);
        char b = 1;
        if (write(pfd[1], &b, 1) != 1)
            _exit(7);
        for (;;)
            pause();
    }
    char b;
    assert_int_equal(read(pfd[0], &b, 1), 1);
    /* the reservations are there, invisible */
    assert_int_equal(ferry_serve_kv(v.s) != NULL, 1);
    ferry_kv_config c = client_config();
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    assert_int_equal(ferry_kv_lookup(kv, tok, 4 * CT, NULL), 0);
    kill(pid, SIGKILL);
    int ws;
    waitpid(pid, &ws, 0);
    assert_true(WIFSIGNALED(ws));
    /* its connection's end released every slot: poll until the daemon saw it */
    ferry_serve_stats ss = FERRY_SERVE_STATS_INIT;
    for (int i = 0; i < 200; i++) {
        FT_ASSERT_OK(ferry_serve_stats_get(v.s, &ss));
        if (ss.released >= 4)
            break;
        usleep(10000);
    }
    assert_int_equal(ss.released, 4);
    assert_idle_pool(v.s, 0);
    assert_int_equal(ferry_kv_lookup(kv, tok, 4 * CT, NULL), 0);
    /* and the whole pool can be stored into again */
    int32_t big[16 * CT];
    make_tokens(big, 16 * CT, 900);
    hbuf h;
    hbuf_init(&h, 16 * CT, 5);
    assert_int_equal(ferry_kv_store(kv, big, 8 * CT, NULL, &h.b), 8 * CT);
    assert_int_equal(ferry_kv_store(kv, tok, 4 * CT, NULL, &h.b), 4 * CT);
    hbuf d;
    hbuf_init(&d, 16 * CT, 0);
    assert_int_equal(ferry_kv_retrieve(kv, tok, 4 * CT, NULL, &d.b), 4 * CT);
    assert_true(same_tokens(&h, &d, 0, 4 * CT));
    free(h.mem);
    free(d.mem);
    close(pfd[0]);
    close(pfd[1]);
    ferry_kv_close(kv);
    ft_srv_close(&v);
}

/* ---- the daemon killed, restarted on its persistent L2 ---- */

static pid_t daemon_fork(const char *l2dir)
{
    ferry_kv_config kc = store_config(16);
    kc.l2_dir = l2dir;
    kc.l2_bytes = 64 * 4096;
    kc.l2_persistent = 1;
    ferry_serve_config sc = FERRY_SERVE_CONFIG_INIT;
    sc.socket_path = g_sock;
    sc.kv = &kc;
    return ft_srv_fork_ready(&sc, -1, FT_SRV_READY_CONNECT, 5000);
}

static void test_daemon_killed_and_restarted(void **state)
{
    (void)state;
    char l2[300];
    snprintf(l2, sizeof l2, "%s/l2", g_dir);
    assert_int_equal(mkdir(l2, 0700), 0);
    pid_t pid = daemon_fork(l2);
    ferry_kv_config c = client_config();
    c.server_timeout_ms = 500;
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    int32_t tok[6 * CT];
    make_tokens(tok, 6 * CT, 31);
    hbuf src, dst;
    hbuf_init(&src, 6 * CT, 9);
    hbuf_init(&dst, 6 * CT, 0);
    assert_int_equal(ferry_kv_store(kv, tok, 6 * CT, NULL, &src.b), 6 * CT);
    assert_int_equal(ferry_kv_sync(kv), 6); /* durable in the daemon's L2 */
    /* a daemon that hangs: FERRY_ECONN within the timeout, never a hang;
     * once it runs again the next call connects again */
    kill(pid, SIGSTOP);
    int ws;
    assert_int_equal(waitpid(pid, &ws, WUNTRACED), pid); /* stopped for sure */
    assert_true(WIFSTOPPED(ws));
    uint64_t h0 = ferry__now_ns();
    assert_int_equal(ferry_kv_lookup(kv, tok, 6 * CT, NULL), FERRY_ECONN);
    uint64_t hung = ferry__now_ns() - h0;
    assert_true(hung >= 400000000ull && hung < 2000000000ull); /* the 500 ms timeout */
    assert_non_null(strstr(ferry_kv_last_error(kv), "within the timeout"));
    kill(pid, SIGCONT);
    assert_int_equal(ferry_kv_lookup(kv, tok, 6 * CT, NULL), 6 * CT);
    kill(pid, SIGKILL);
    waitpid(pid, &ws, 0);
    /* a clean error, not a hang */
    uint64_t t0 = ferry__now_ns();
    assert_int_equal(ferry_kv_lookup(kv, tok, 6 * CT, NULL), FERRY_ECONN);
    assert_int_equal(ferry_kv_retrieve(kv, tok, 6 * CT, NULL, &dst.b), FERRY_ECONN);
    assert_true(ferry__now_ns() - t0 < 3000000000ull);
    /* and each chunk's status says so: a caller's array kept from an
     * earlier call (0: "retrieved") is never left standing */
    for (int store = 0; store < 2; store++) {
        int st[8];
        for (int i = 0; i < 8; i++)
            st[i] = 0;
        ferry_kv_req sr = FERRY_KV_REQ_INIT;
        sr.status = st;
        sr.max_chunks = 8;
        int rc = store ? ferry_kv_store(kv, tok, 6 * CT, &sr, &src.b)
                       : ferry_kv_retrieve(kv, tok, 6 * CT, &sr, &dst.b);
        assert_int_equal(rc, FERRY_ECONN);
        for (int i = 0; i < 6; i++)
            if (st[i] != FERRY_ECONN)
                fail_msg("%s with the daemon gone: chunk %d's status %d", store ? "store" :
                         "retrieve", i, st[i]);
        assert_int_equal(st[6], 0); /* (past the call's chunks: untouched) */
    }
    assert_non_null(strstr(ferry_kv_last_error(kv), g_sock));
    /* back: the next call connects again and finds what L2 kept */
    pid = daemon_fork(l2);
    uint8_t tiers[8];
    ferry_kv_req r = FERRY_KV_REQ_INIT;
    r.tiers = tiers;
    r.max_chunks = 8;
    assert_int_equal(ferry_kv_lookup(kv, tok, 6 * CT, &r), 6 * CT);
    assert_int_equal(tiers[0], FERRY_KV_TIER_L2);
    assert_int_equal(ferry_kv_retrieve(kv, tok, 6 * CT, NULL, &dst.b), 6 * CT);
    assert_true(same_tokens(&src, &dst, 0, 6 * CT));
    assert_int_equal(ferry_kv_lookup(kv, tok, 6 * CT, &r), 6 * CT);
    assert_int_equal(tiers[0], FERRY_KV_TIER_L1); /* promoted */
    ft_srv_fork_stop(pid, DAEMON_STOP_MS);
    ferry_kv_close(kv);
    free(src.mem);
    free(dst.mem);
    /* with no daemon at all: FERRY_ECONN at open */
    assert_int_equal(ferry_kv_open(&c, &kv), FERRY_ECONN);
}

/* PREFETCH queues reads and answers at once with the count, for chunks
 * the daemon has or not; a malformed one is refused and the connection
 * goes on; a retrieve of several batches from L2 (which sends it between
 * them) lands every byte */
static void test_prefetch(void **state)
{
    (void)state;
    char l2[300];
    snprintf(l2, sizeof l2, "%s/l2p", g_dir);
    assert_int_equal(mkdir(l2, 0700), 0);
    pid_t pid = daemon_fork(l2);
    ferry_kv_config c = client_config();
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    enum { NCH = 11 }; /* three batches of a quarter of the 16-slot pool */
    int32_t tok[NCH * CT];
    make_tokens(tok, NCH * CT, 57);
    hbuf src, dst;
    hbuf_init(&src, NCH * CT, 3);
    hbuf_init(&dst, NCH * CT, 0);
    assert_int_equal(ferry_kv_store(kv, tok, NCH * CT, NULL, &src.b), NCH * CT);
    assert_int_equal(ferry_kv_sync(kv), NCH);
    ferry_kv_close(kv);
    ft_srv_fork_stop(pid, DAEMON_STOP_MS); /* L1 goes with it; L2 stays */
    pid = daemon_fork(l2);
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    uint8_t tiers[NCH];
    int st[NCH];
    ferry_kv_req r = FERRY_KV_REQ_INIT;
    r.tiers = tiers;
    r.status = st;
    r.max_chunks = NCH;
    assert_int_equal(ferry_kv_lookup(kv, tok, NCH * CT, &r), NCH * CT);
    for (int i = 0; i < NCH; i++)
        assert_int_equal(tiers[i], FERRY_KV_TIER_L2);
    assert_int_equal(ferry_kv_retrieve(kv, tok, NCH * CT, &r, &dst.b), NCH * CT);
    for (int i = 0; i < NCH; i++)
        assert_int_equal(st[i], 0);
    assert_true(same_tokens(&src, &dst, 0, NCH * CT));
    /* the frame itself */
    raw w;
    int32_t rc;
    char msg[256];
    FT_ASSERT_OK(raw_connect(&w));
    raw_hello(&w, 1);
    ferry__proto_chunk ch[3];
    memset(ch, 0, sizeof ch);
    for (int i = 0; i < 3; i++)
        ch[i].id.lo = 0x5150u + (uint64_t)i; /* chunks nobody stored */
    raw_chunks(&w, FERRY__P_PREFETCH, ch, 3);
    assert_int_equal(ft_raw_reply(&w, &rc, msg, sizeof msg), 0);
    assert_int_equal(w.h.type, FERRY__P_PREFETCH | FERRY__PROTO_REPLY);
    assert_int_equal(rc, 3);
    uint8_t bad[FERRY__PROTO_HDR + 8];
    ferry__proto_hdr h = {FERRY__PROTO_VERSION, FERRY__P_PREFETCH, 0, 8, 99};
    ferry__proto_hdr_encode(bad, &h);
    memset(bad + FERRY__PROTO_HDR, 0, 8); /* n = 0 and 4 stray bytes */
    raw_send_bytes(&w, bad, sizeof bad);
    assert_int_equal(ft_raw_reply(&w, &rc, msg, sizeof msg), 0);
    assert_int_equal(rc, FERRY_EPARSE);
    raw_ping(&w);
    ft_raw_close(&w);
    ferry_kv_close(kv);
    ft_srv_fork_stop(pid, DAEMON_STOP_MS);
    free(src.mem);
    free(dst.mem);
}

/* the starts of this process's mappings of the L1 pool memfd (the
 * daemon's, in its thread, and each client's); how many */
static size_t pool_maps(void **out, size_t max)
{
    FILE *f = fopen("/proc/self/maps", "r");
    assert_non_null(f);
    char line[512];
    size_t n = 0;
    while (fgets(line, sizeof line, f))
        if (strstr(line, "memfd:ferry-l1") && n < max)
            out[n++] = (void *)(uintptr_t)strtoull(line, NULL, 16);
    fclose(f);
    return n;
}

/* how many of the pool mappings are registered with dev (a pin of their
 * first page overlaps one: FERRY_EEXIST) */
static int pool_maps_pinned(ferry_device *dev)
{
    void *m[8];
    size_t n = pool_maps(m, 8);
    int pinned = 0;
    for (size_t i = 0; i < n; i++) {
        int r = ferry_device_pin(dev, m[i], 4096);
        if (r == 0)
            FT_ASSERT_OK(ferry_device_unpin(dev, m[i]));
        else if (r == FERRY_EEXIST)
            pinned++;
        else
            fail_msg("pin of a pool page: %s", ferry_strerror(r));
    }
    return pinned;
}

/* device buffers through the daemon: the client registers the mapped pool
 * with its device (and unregisters it before unmapping it), moves every
 * byte between device memory and the slots, and still works, unregistered,
 * when the device refuses the registration */
static void test_device_buffers(void **state)
{
    (void)state;
    srv v;
    srv_start(&v, 16);
    ferry_device_options dopt = FERRY_DEVICE_OPTIONS_INIT;
    dopt.backend = "host";
    ferry_device *dev = NULL;
    FT_ASSERT_OK(ferry_device_open(&dopt, &dev));
    enum { N = 6 * CT };
    size_t bytes = PLANES * (size_t)N * TB;
    hbuf src;
    hbuf_init(&src, N, 21);
    ferry_devptr a = 0, b = 0;
    FT_ASSERT_OK(ferry_device_alloc(dev, bytes, &a));
    FT_ASSERT_OK(ferry_device_alloc(dev, bytes, &b));
    FT_ASSERT_OK(ferry_device_upload(dev, a, src.mem, bytes));
    ferry_kv_buffer da = FERRY_KV_BUFFER_INIT, db;
    da.layout = ft_kv_layout(TB);
    da.mem = FERRY_KV_MEM_DEVICE;
    da.base = a;
    da.capacity_tokens = N;
    db = da;
    db.base = b;
    unsigned char *back = malloc(bytes);
    assert_non_null(back);
    for (int refuse = 0; refuse < 2; refuse++) {
        int32_t tok[N];
        make_tokens(tok, N, 300 + (unsigned)refuse);
        if (refuse) { /* the next pin (the client's registration) fails */
            ferry_device_faults f = FERRY_DEVICE_FAULTS_INIT;
            f.fail_nth = 1;
            f.fault_mask = FERRY_FAULT_ALLOC;
            FT_ASSERT_OK(ferry_test_control(FERRY_TEST_DEVICE_FAULTS, dev, &f));
        }
        ferry_kv_config c = client_config();
        c.device = dev;
        ferry_kv *kv = NULL;
        FT_ASSERT_OK(ferry_kv_open(&c, &kv));
        assert_int_equal(ferry_kv_lookup(kv, tok, N, NULL), 0); /* connects */
        if (refuse)
            FT_ASSERT_OK(ferry_test_control(FERRY_TEST_DEVICE_FAULTS, dev, NULL));
        assert_int_equal(pool_maps_pinned(dev), refuse ? 0 : 1);
        FT_ASSERT_OK(ferry_device_memset(dev, b, 0, bytes));
        assert_int_equal(ferry_kv_store(kv, tok, N, NULL, &da), N);
        assert_int_equal(ferry_kv_retrieve(kv, tok, N, NULL, &db), N);
        FT_ASSERT_OK(ferry_device_download(dev, back, b, bytes));
        assert_memory_equal(back, src.mem, bytes);
        ferry_kv_close(kv);
        assert_int_equal(pool_maps_pinned(dev), 0); /* unregistered, then unmapped */
    }
    free(back);
    FT_ASSERT_OK(ferry_device_free(dev, a));
    FT_ASSERT_OK(ferry_device_free(dev, b));
    ferry_device_close(dev);
    ft_srv_close(&v);
    free(src.mem);
}

/* ---- bad input: the client gets an error, the daemon serves on ---- */

static void test_bad_frames(void **state)
{
    (void)state;
    srv v;
    srv_start(&v, 16);
    int32_t rc;
    char msg[256];
    raw r;
    /* garbage: an ERROR reply, then the connection is closed */
    FT_ASSERT_OK(raw_connect(&r));
    raw_send_bytes(&r, "GET / HTTP/1.1\r\n\r\n", 18);
    assert_int_equal(ft_raw_reply(&r, &rc, msg, sizeof msg), 0);
    assert_int_equal(r.h.type, FERRY__P_ERROR | FERRY__PROTO_REPLY);
    assert_int_equal(rc, FERRY_EPARSE);
    assert_non_null(strstr(msg, "magic"));
    assert_int_equal(ft_raw_reply(&r, &rc, msg, sizeof msg), -1);
    ft_raw_close(&r);
    /* another version: EVERSION naming both, for that request id */
    FT_ASSERT_OK(raw_connect(&r));
    ferry__proto_hdr h = {9, FERRY__P_PING, 0, 0, 4242};
    uint8_t hb[FERRY__PROTO_HDR];
    ferry__proto_hdr_encode(hb, &h);
    raw_send_bytes(&r, hb, sizeof hb);
    assert_int_equal(ft_raw_reply(&r, &rc, msg, sizeof msg), 0);
    assert_int_equal(rc, FERRY_EVERSION);
    assert_int_equal(r.h.rid, 4242);
    assert_non_null(strstr(msg, "version 9"));
    ft_raw_close(&r);
    /* a payload over the bound is refused before anything is read */
    FT_ASSERT_OK(raw_connect(&r));
    h = (ferry__proto_hdr){FERRY__PROTO_VERSION, FERRY__P_LOOKUP, 0, 0xffffffffu, 1};
    ferry__proto_hdr_encode(hb, &h);
    raw_send_bytes(&r, hb, sizeof hb);
    assert_int_equal(ft_raw_reply(&r, &rc, msg, sizeof msg), 0);
    assert_int_equal(rc, FERRY_EPARSE);
    ft_raw_close(&r);
    /* a truncated frame, then the client leaves */
    FT_ASSERT_OK(raw_connect(&r));
    h = (ferry__proto_hdr){FERRY__PROTO_VERSION, FERRY__P_LOOKUP, 0, 100, 1};
    ferry__proto_hdr_encode(hb, &h);
    raw_send_bytes(&r, hb, sizeof hb);
    raw_send_bytes(&r, "0123456789", 10);
    ft_raw_close(&r);
    /* well framed, malformed inside: an error and the connection goes on */
    FT_ASSERT_OK(raw_connect(&r));
    ferry__proto_req pq;
    memset(&pq, 0, sizeof pq);
    pq.hdr.type = FERRY__P_PING;
    ft_raw_req(&r, &pq); /* before HELLO: refused */
    assert_int_equal(ft_raw_reply(&r, &rc, msg, sizeof msg), 0);
    assert_int_equal(rc, FERRY_ESTATE);
    assert_non_null(strstr(msg, "before HELLO"));
    ft_raw_close(&r);
    FT_ASSERT_OK(raw_connect(&r));
    raw_hello(&r, 0);
    raw_ping(&r);
    uint8_t bad[FERRY__PROTO_HDR + 8];
    h = (ferry__proto_hdr){FERRY__PROTO_VERSION, FERRY__P_LOOKUP, 0, 8, 77};
    ferry__proto_hdr_encode(bad, &h);
    memset(bad + FERRY__PROTO_HDR, 0xff, 8); /* tokens, no count */
    raw_send_bytes(&r, bad, sizeof bad);
    assert_int_equal(ft_raw_reply(&r, &rc, msg, sizeof msg), 0);
    assert_int_equal(r.h.rid, 77);
    assert_int_equal(rc, FERRY_EPARSE);
    h = (ferry__proto_hdr){FERRY__PROTO_VERSION, 0x55, 0, 0, 78};
    ferry__proto_hdr_encode(hb, &h);
    raw_send_bytes(&r, hb, sizeof hb);
    assert_int_equal(ft_raw_reply(&r, &rc, msg, sizeof msg), 0);
    assert_int_equal(rc, FERRY_ENOTSUP);
    /* slots it does not hold: refused per chunk, nothing touched */
    ferry__proto_chunk ch[2];
    memset(ch, 0, sizeof ch);
    ch[0].slot = 3;
    ch[1].slot = 999999;
    raw_chunks(&r, FERRY__P_COMMIT, ch, 2);
    assert_int_equal(ft_raw_reply(&r, &rc, msg, sizeof msg), 0);
    assert_int_equal(rc, 0);
    assert_int_equal(ferry__proto_get_u32(&r.rd), 2);
    assert_int_equal((int32_t)ferry__proto_get_u32(&r.rd), FERRY_ESTATE);
    assert_int_equal((int32_t)ferry__proto_get_u32(&r.rd), FERRY_ESTATE);
    raw_chunks(&r, FERRY__P_RELEASE, ch, 1);
    assert_int_equal(ft_raw_reply(&r, &rc, msg, sizeof msg), 0);
    assert_int_equal(ferry__proto_get_u32(&r.rd), 1);
    assert_int_equal((int32_t)ferry__proto_get_u32(&r.rd), FERRY_ESTATE);
    /* one connection reserves at most half the pool (8 of 16 slots) */
    ferry__proto_chunk many[12];
    memset(many, 0, sizeof many);
    for (int i = 0; i < 12; i++) {
        many[i].id.lo = 0x1234500 + (uint64_t)i;
        many[i].id.hi = 77;
        many[i].tokens = CT;
    }
    raw_chunks(&r, FERRY__P_RESERVE, many, 12);
    assert_int_equal(ft_raw_reply(&r, &rc, msg, sizeof msg), 0);
    assert_int_equal(ferry__proto_get_u32(&r.rd), 12);
    for (int i = 0; i < 12; i++) {
        assert_int_equal((int32_t)ferry__proto_get_u32(&r.rd), i < 8 ? 0 : FERRY_ENOSPACE);
        ferry__proto_get_u64(&r.rd);
        ferry__proto_get_u64(&r.rd);
    }
    /* pipelined: three requests sent at once, three replies in order */
    ferry__proto_req q;
    memset(&q, 0, sizeof q);
    q.hdr.type = FERRY__P_PING;
    ferry__proto_buf all = {0};
    for (int i = 0; i < 3; i++) {
        q.hdr.rid = 500 + (uint64_t)i;
        FT_ASSERT_OK(ferry__proto_req_encode(&r.out, &q));
        for (size_t k = 0; k < r.out.len; k++)
            ferry__proto_put_u8(&all, r.out.p[k]);
    }
    raw_send_bytes(&r, all.p, all.len);
    ferry__proto_buf_free(&all);
    for (int i = 0; i < 3; i++) {
        assert_int_equal(ft_raw_reply(&r, &rc, msg, sizeof msg), 0);
        assert_int_equal(r.h.rid, 500 + (uint64_t)i);
    }
    ft_raw_close(&r);
    /* the daemon serves on */
    ferry_kv_config c = client_config();
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    int32_t tok[CT];
    make_tokens(tok, CT, 1);
    hbuf hh;
    hbuf_init(&hh, CT, 1);
    assert_int_equal(ferry_kv_store(kv, tok, CT, NULL, &hh.b), CT);
    free(hh.mem);
    ferry_kv_close(kv);
    ferry_serve_stats ss = FERRY_SERVE_STATS_INIT;
    for (int i = 0; i < 300; i++) { /* the raw client's 8 reservations went with it */
        FT_ASSERT_OK(ferry_serve_stats_get(v.s, &ss));
        if (ss.released >= 8)
            break;
        usleep(10000);
    }
    assert_int_equal(ss.released, 8);
    assert_true(ss.bad_frames >= 8);
    assert_idle_pool(v.s, 1);
    ft_srv_close(&v);
}

/* a client that sends and never reads is disconnected; others go on */
static void test_client_never_reads(void **state)
{
    (void)state;
    srv v;
    ferry_kv_config kc = store_config(16);
    srv_start_cfg(&v, &kc, 0, 200);
    raw r;
    FT_ASSERT_OK(raw_connect(&r));
    raw_hello(&r, 0);
    int sz = 4096;
    setsockopt(r.fd, SOL_SOCKET, SO_RCVBUF, &sz, sizeof sz);
    ferry__proto_req q;
    memset(&q, 0, sizeof q);
    q.hdr.type = FERRY__P_STATS;
    FT_ASSERT_OK(ferry__proto_req_encode(&r.out, &q));
    int closed = 0;
    for (int i = 0; i < 20000 && !closed; i++) {
        struct pollfd p = {r.fd, POLLOUT, 0};
        if (poll(&p, 1, 1000) <= 0 || (p.revents & (POLLERR | POLLHUP)))
            break;
        if (send(r.fd, r.out.p, r.out.len, MSG_NOSIGNAL | MSG_DONTWAIT) < 0)
            closed = errno != EAGAIN;
    }
    ferry_serve_stats ss = FERRY_SERVE_STATS_INIT;
    for (int i = 0; i < 300; i++) {
        FT_ASSERT_OK(ferry_serve_stats_get(v.s, &ss));
        if (ss.slow_clients)
            break;
        usleep(10000);
    }
    assert_int_equal(ss.slow_clients, 1);
    ft_raw_close(&r);
    ferry_kv_config c = client_config();
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    int32_t tok[CT] = {3};
    assert_int_equal(ferry_kv_lookup(kv, tok, CT, NULL), 0);
    ferry_kv_close(kv);
    ft_srv_close(&v);
}

/* past max_clients: a clear error to that client, the others served */
static void test_many_connections(void **state)
{
    (void)state;
    srv v;
    ferry_kv_config kc = store_config(16);
    srv_start_cfg(&v, &kc, 16, 0);
    enum { N = 200 };
    static raw r[N];
    int refused = 0;
    for (int i = 0; i < N; i++)
        FT_ASSERT_OK(raw_connect(&r[i]));
    for (int i = 0; i < N; i++) {
        ferry__proto_req q;
        ft_raw_hello_req(&q, TB, CT, 0);
        q.hdr.rid = 1;
        FT_ASSERT_OK(ferry__proto_req_encode(&r[i].out, &q));
        send(r[i].fd, r[i].out.p, r[i].out.len, MSG_NOSIGNAL);
        int32_t rc = 0;
        char msg[256];
        /* every connection hears a reply: served, or refused by name */
        assert_int_equal(ft_raw_reply(&r[i], &rc, msg, sizeof msg), 0);
        if (rc == 0)
            continue;
        assert_int_equal(rc, FERRY_EBUSY);
        assert_non_null(strstr(msg, "max_clients 16"));
        refused++;
    }
    assert_int_equal(refused, N - 16);
    for (int i = 0; i < N; i++)
        ft_raw_close(&r[i]);
    /* once they left, a client is served (at once: a connection closed
     * no longer counts) */
    ferry_kv_config c = client_config();
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    ferry_kv_close(kv);
    ft_srv_close(&v);
}

/* a client that closed never counts against max_clients: at max_clients
 * 1, an engine that closes and at once (no retry, no wait) opens again
 * is served, many times over (an engine restart, a worker respawned);
 * before, the daemon counted the closed one until its connection's
 * thread had seen it go, and the new one was refused with FERRY_EBUSY */
static void test_reconnect_at_max_clients(void **state)
{
    (void)state;
    srv v;
    ferry_kv_config kc = store_config(16);
    srv_start_cfg(&v, &kc, 1, 0);
    ferry_kv_config c = client_config();
    for (int i = 0; i < 400; i++) {
        ferry_kv *kv = NULL;
        int rc = ferry_kv_open(&c, &kv);
        if (rc != 0)
            fail_msg("try %d: a client opened right after the last closed, at max_clients 1: "
                     "%d (%s)", i, rc, ferry_last_error());
        ferry_kv_close(kv);
    }
    /* the connections that count past max_clients (monitors) too: as
     * many as the daemon takes, all closed, then at once an engine */
    enum { R = 5 };
    for (int i = 0; i < 200; i++) {
        raw r[R];
        for (int j = 0; j < R; j++)
            FT_ASSERT_OK(raw_connect(&r[j]));
        for (int j = 0; j < R; j++)
            ft_raw_close(&r[j]);
        ferry_kv *kv = NULL;
        int rc = ferry_kv_open(&c, &kv);
        if (rc != 0)
            fail_msg("try %d: a client opened right after %d connections closed, at "
                     "max_clients 1: %d (%s)", i, R, rc, ferry_last_error());
        ferry_kv_close(kv);
    }
    ft_srv_close(&v);
}

/* an engine that sends its HELLO and hangs up at once, while the one
 * engine the daemon took hangs up too, takes no place under max_clients
 * for good: after both went, an engine is served. Before, the HELLO could
 * find the first still counted, retire both (their sockets hung up) and
 * then count the second, retired already, so its thread's end never gave
 * the place back: every engine after was refused with FERRY_EBUSY */
static void test_hello_then_hang_up_at_max_clients(void **state)
{
    (void)state;
    srv v;
    ferry_kv_config kc = store_config(16);
    srv_start_cfg(&v, &kc, 1, 0);
    ferry_kv_config c = client_config();
    for (int i = 0; i < 120; i++) {
        raw a, b;
        FT_ASSERT_OK(raw_connect(&a));
        raw_hello(&a, 0);
        FT_ASSERT_OK(raw_connect(&b));
        ft_raw_close(&a);
        ferry__proto_req q;
        ft_raw_hello_req(&q, TB, CT, 0);
        ft_raw_req(&b, &q);
        ft_raw_close(&b);
        ferry_kv *kv = NULL;
        int rc = ferry_kv_open(&c, &kv);
        if (rc != 0)
            fail_msg("try %d: an engine opened after the two before it hung up, at "
                     "max_clients 1: %d (%s)", i, rc, ferry_last_error());
        ferry_kv_close(kv);
    }
    ft_srv_close(&v);
}

/* a peer of another uid is refused (needs root to be another uid) */
static void test_other_uid(void **state)
{
    (void)state;
    if (getuid() != 0)
        skip();
    srv v;
    srv_start(&v, 16);
    assert_int_equal(chmod(g_dir, 0755), 0);
    assert_int_equal(chmod(g_sock, 0666), 0); /* let it reach the uid check */
    pid_t pid = fork();
    if (pid == 0) {
        if (setuid(65534) != 0)
            _exit(3);
        raw r;
        if (raw_connect(&r) < 0)
            _exit(4);
        int32_t rc;
        char msg[256];
        if (ft_raw_reply(&r, &rc, msg, sizeof msg) < 0)
            _exit(5);
        _exit(rc == -EACCES && strstr(msg, "uid 65534") ? 0 : 6);
    }
    int ws;
    waitpid(pid, &ws, 0);
    assert_true(WIFEXITED(ws));
    assert_int_equal(WEXITSTATUS(ws), 0);
    ferry_serve_stats ss = FERRY_SERVE_STATS_INIT;
    FT_ASSERT_OK(ferry_serve_stats_get(v.s, &ss));
    assert_int_equal(ss.refused, 1);
    ft_srv_close(&v);
}

/* the socket is the owner's alone, and a second daemon on it is refused */
static void test_socket_owner(void **state)
{
    (void)state;
    srv v;
    srv_start(&v, 16);
    struct stat st;
    assert_int_equal(stat(g_sock, &st), 0);
    assert_int_equal(st.st_mode & 0777, 0600);
    ferry_kv_config kc = store_config(16);
    ferry_serve_config sc = FERRY_SERVE_CONFIG_INIT;
    sc.socket_path = g_sock;
    sc.kv = &kc;
    ferry_serve *s2 = NULL;
    assert_int_equal(ferry_serve_open(&sc, &s2), FERRY_EBUSY);
    ft_srv_close(&v);
    assert_int_equal(stat(g_sock, &st), -1);
}

/* a client that waits for the socket file and connects the moment it
 * appears (as a script starting the daemon does) */
typedef struct sockwatch {
    atomic_int go, done;
    int rc; /* 0 connected, else the errno */
} sockwatch;

static void *sock_watch_thread(void *arg)
{
    sockwatch *w = arg;
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    memcpy(a.sun_path, g_sock, strlen(g_sock) + 1); /* (setup: it fits) */
    struct stat st;
    while (!atomic_load(&w->go))
        ;
    while (lstat(g_sock, &st) != 0)
        ;
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    w->rc = connect(fd, (struct sockaddr *)&a, sizeof a) == 0 ? 0 : errno;
    close(fd);
    atomic_store(&w->done, 1);
    return NULL;
}

/* the socket file appears only once the daemon listens on it: a client
 * connecting the moment it sees the file is never refused, and no
 * temporary name is left beside it */
static void test_socket_appears_listening(void **state)
{
    (void)state;
    ferry_kv_config kc = store_config(4);
    ferry_serve_config sc = FERRY_SERVE_CONFIG_INIT;
    sc.socket_path = g_sock;
    sc.kv = &kc;
    unsigned refused = 0;
    for (int round = 0; round < 200; round++) {
        sockwatch w = {0};
        pthread_t t;
        assert_int_equal(pthread_create(&t, NULL, sock_watch_thread, &w), 0);
        atomic_store(&w.go, 1);
        ferry_serve *s = NULL;
        FT_ASSERT_OK(ferry_serve_open(&sc, &s));
        pthread_join(t, NULL);
        refused += w.rc != 0;
        if (w.rc != 0)
            print_message("round %d: connect at the file's appearance: %s\n", round,
                          strerror(w.rc));
        ferry_serve_close(s);
        DIR *d = opendir(g_dir);
        assert_non_null(d);
        for (struct dirent *e; (e = readdir(d));)
            assert_null(strchr(e->d_name, '~'));
        closedir(d);
    }
    assert_int_equal(refused, 0);
}

/* the names in g_dir with a '~' (a temporary socket name left behind) */
static int tmp_names_left(const char *dir)
{
    DIR *d = opendir(dir);
    assert_non_null(d);
    int n = 0;
    for (struct dirent *e; (e = readdir(d));)
        n += strchr(e->d_name, '~') != NULL;
    closedir(d);
    return n;
}

/* a client's connect to path: 0, else the errno */
static int try_connect(const char *path)
{
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    memcpy(a.sun_path, path, strlen(path) + 1);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int rc = connect(fd, (struct sockaddr *)&a, sizeof a) == 0 ? 0 : errno;
    close(fd);
    return rc;
}

/* socket paths of every length up to the limit of 107 bytes (the
 * temporary name beside them fits, or not: then the path is bound itself):
 * each daemon listens at its path, leaves no temporary name, and its close
 * removes the socket; 108 bytes is -ENAMETOOLONG with nothing created */
static void test_socket_paths_near_the_limit(void **state)
{
    (void)state;
    ferry_kv_config kc = store_config(4);
    char dir[300];
    snprintf(dir, sizeof dir, "%s/d", g_dir);
    assert_int_equal(mkdir(dir, 0700), 0);
    size_t dl = strlen(dir);
    assert_true(dl + 2 < 90);
    for (size_t len = 90; len <= 108; len++) {
        char path[400];
        snprintf(path, sizeof path, "%s/", dir);
        memset(path + dl + 1, 's', len - dl - 1);
        path[len] = 0;
        ferry_serve_config sc = FERRY_SERVE_CONFIG_INIT;
        sc.socket_path = path;
        sc.kv = &kc;
        ferry_serve *s = NULL;
        struct stat st;
        if (len == 108) {
            assert_int_equal(ferry_serve_open(&sc, &s), -ENAMETOOLONG);
            assert_int_equal(lstat(path, &st), -1);
        } else {
            FT_ASSERT_OK(ferry_serve_open(&sc, &s));
            assert_int_equal(lstat(path, &st), 0);
            assert_true(S_ISSOCK(st.st_mode));
            assert_int_equal(st.st_mode & 0777, 0600);
            assert_int_equal(try_connect(path), 0);
            ferry_serve_close(s);
            assert_int_equal(lstat(path, &st), -1);
        }
        assert_int_equal(tmp_names_left(dir), 0);
    }
}

/* a group: the linked socket has its gid and mode 0660; a group that does
 * not exist fails the open with nothing left in the directory */
static void test_socket_group_mode_and_no_group(void **state)
{
    (void)state;
    ferry_kv_config kc = store_config(4);
    struct group *gr = getgrgid(getgid());
    if (gr) {
        char name[256];
        snprintf(name, sizeof name, "%s", gr->gr_name);
        ferry_serve_config sc = FERRY_SERVE_CONFIG_INIT;
        sc.socket_path = g_sock;
        sc.kv = &kc;
        sc.group = name;
        ferry_serve *s = NULL;
        FT_ASSERT_OK(ferry_serve_open(&sc, &s));
        struct stat st;
        assert_int_equal(lstat(g_sock, &st), 0);
        assert_int_equal(st.st_mode & 0777, 0660);
        assert_int_equal(st.st_gid, getgid());
        assert_int_equal(st.st_nlink, 1); /* (the temporary name is gone) */
        ferry_serve_close(s);
        assert_int_equal(lstat(g_sock, &st), -1);
    }
    ferry_serve_config sc = FERRY_SERVE_CONFIG_INIT;
    sc.socket_path = g_sock;
    sc.kv = &kc;
    sc.group = "no-such-group-of-ferry-tests";
    ferry_serve *s = NULL;
    assert_int_equal(ferry_serve_open(&sc, &s), -EINVAL);
    assert_null(s);
    DIR *d = opendir(g_dir);
    assert_non_null(d);
    for (struct dirent *e; (e = readdir(d));)
        assert_true(e->d_name[0] == '.');
    closedir(d);
}

/* daemons started together on one path where a dead daemon's socket file
 * lies: exactly one opens, the others are FERRY_EBUSY, and the one that
 * opened is the one a client reaches at the path (none serves a socket
 * whose file another removed) */
#define RACERS 3
typedef struct racer {
    atomic_int *go;
    ferry_serve *s;
    int rc;
} racer;

static void *racer_thread(void *arg)
{
    racer *x = arg;
    ferry_kv_config kc = store_config(1);
    ferry_serve_config sc = FERRY_SERVE_CONFIG_INIT;
    sc.socket_path = g_sock;
    sc.kv = &kc;
    atomic_fetch_add(x->go, 1);
    while (atomic_load(x->go) < RACERS)
        ;
    x->rc = ferry_serve_open(&sc, &x->s);
    return NULL;
}

static void stale_socket(const char *path)
{
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    memcpy(a.sun_path, path, strlen(path) + 1);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
    close(fd); /* (its file stays: a dead daemon's) */
}

static void test_daemons_racing_for_one_path(void **state)
{
    (void)state;
    for (unsigned round = 0; round < 3000; round++) {
        if (round % 2 == 0)
            stale_socket(g_sock);
        atomic_int go = 0;
        racer x[RACERS];
        pthread_t t[RACERS];
        for (int k = 0; k < RACERS; k++) {
            x[k] = (racer){&go, NULL, 0};
            assert_int_equal(pthread_create(&t[k], NULL, racer_thread, &x[k]), 0);
        }
        int opened = 0;
        for (int k = 0; k < RACERS; k++) {
            pthread_join(t[k], NULL);
            if (x[k].rc == 0)
                opened++;
            else
                assert_int_equal(x[k].rc, FERRY_EBUSY);
        }
        if (opened != 1)
            print_message("round %u: %d daemons opened on one path\n", round, opened);
        assert_int_equal(opened, 1);
        assert_int_equal(try_connect(g_sock), 0);
        for (int k = 0; k < RACERS; k++)
            ferry_serve_close(x[k].s);
        struct stat st;
        assert_int_equal(lstat(g_sock, &st), -1);
        assert_int_equal(tmp_names_left(g_dir), 0);
    }
}

/* a read lock that outlived its TTL: the slot was reused, the release says
 * the bytes read are void, never passes them as the chunk's */
static void test_stale_release(void **state)
{
    (void)state;
    srv v;
    ferry_kv_config kc = store_config(4);
    kc.read_ttl_ms = 20;
    srv_start_cfg(&v, &kc, 0, 0);
    ferry_kv_config c = client_config();
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    int32_t tok[CT];
    make_tokens(tok, CT, 11);
    hbuf h;
    hbuf_init(&h, 4 * CT, 2);
    assert_int_equal(ferry_kv_store(kv, tok, CT, NULL, &h.b), CT);
    ferry_kv_hash id;
    ids_of(tok, CT, &id);
    raw r;
    FT_ASSERT_OK(raw_connect(&r));
    raw_hello(&r, 1);
    ferry__proto_chunk ch;
    memset(&ch, 0, sizeof ch);
    ch.id = id;
    raw_chunks(&r, FERRY__P_ACQUIRE, &ch, 1);
    int32_t rc;
    char msg[256];
    assert_int_equal(ft_raw_reply(&r, &rc, msg, sizeof msg), 0);
    assert_int_equal(ferry__proto_get_u32(&r.rd), 1);
    assert_int_equal((int32_t)ferry__proto_get_u32(&r.rd), 0);
    ch.slot = ferry__proto_get_u64(&r.rd);
    ch.gen = ferry__proto_get_u64(&r.rd);
    usleep(50000); /* past the read TTL: the lock no longer protects the slot */
    int32_t more[4 * CT];
    make_tokens(more, 4 * CT, 5000);
    assert_int_equal(ferry_kv_store(kv, more, 4 * CT, NULL, &h.b), 4 * CT);
    raw_chunks(&r, FERRY__P_RELEASE, &ch, 1);
    assert_int_equal(ft_raw_reply(&r, &rc, msg, sizeof msg), 0);
    assert_int_equal(ferry__proto_get_u32(&r.rd), 1);
    assert_int_equal((int32_t)ferry__proto_get_u32(&r.rd), FERRY_ESTATE);
    ft_raw_close(&r);
    free(h.mem);
    ferry_kv_close(kv);
    ft_srv_close(&v);
}

/* WAIT sets a connection's deadline (0 to 60000 ms, 4 bytes exactly);
 * WHY answers the last decline's code and message once, then 0 */
static void raw_simple(raw *r, int t, uint64_t ms, int32_t *rc, char *msg, size_t len)
{
    ferry__proto_req q;
    memset(&q, 0, sizeof q);
    q.hdr.type = (uint8_t)t;
    q.tokens = ms;
    ft_raw_req(r, &q);
    assert_int_equal(ft_raw_reply(r, rc, msg, len), 0);
}

static void test_wait_and_why(void **state)
{
    (void)state;
    srv v;
    ferry_kv_config kc = store_config(4);
    srv_start_cfg(&v, &kc, 0, 0);
    raw r;
    FT_ASSERT_OK(raw_connect(&r));
    raw_hello(&r, 1);
    int32_t rc;
    char msg[512];
    raw_simple(&r, FERRY__P_WHY, 0, &rc, msg, sizeof msg);
    assert_int_equal(r.h.type, FERRY__P_WHY | FERRY__PROTO_REPLY);
    assert_int_equal(rc, 0); /* nothing declined yet */
    raw_simple(&r, FERRY__P_WAIT, FERRY_KV_POOL_WAIT_MS_MAX + 1, &rc, msg, sizeof msg);
    assert_int_equal(rc, FERRY_EPARSE);
    assert_non_null(strstr(msg, "WAIT"));
    uint8_t bad[FERRY__PROTO_HDR + 3];
    ferry__proto_hdr h = {FERRY__PROTO_VERSION, FERRY__P_WAIT, 0, 3, 77};
    ferry__proto_hdr_encode(bad, &h);
    memset(bad + FERRY__PROTO_HDR, 0, 3);
    raw_send_bytes(&r, bad, sizeof bad);
    assert_int_equal(ft_raw_reply(&r, &rc, msg, sizeof msg), 0);
    assert_int_equal(rc, FERRY_EPARSE);
    raw_simple(&r, FERRY__P_WAIT, 0, &rc, msg, sizeof msg);
    assert_int_equal(r.h.type, FERRY__P_WAIT | FERRY__PROTO_REPLY);
    assert_int_equal(rc, 0);
    /* 3 chunks reserved by one connection of a 4-slot pool: past its share
     * (half the pool) the third is declined, and WHY says why, once */
    ferry__proto_chunk ch[3];
    memset(ch, 0, sizeof ch);
    for (int i = 0; i < 3; i++) {
        ch[i].id.lo = 0x7a00u + (uint64_t)i;
        ch[i].tokens = CT;
    }
    raw_chunks(&r, FERRY__P_RESERVE, ch, 3);
    assert_int_equal(ft_raw_reply(&r, &rc, msg, sizeof msg), 0);
    assert_int_equal(ferry__proto_get_u32(&r.rd), 3);
    int32_t cs[3];
    for (int i = 0; i < 3; i++) {
        cs[i] = (int32_t)ferry__proto_get_u32(&r.rd);
        (void)ferry__proto_get_u64(&r.rd);
        (void)ferry__proto_get_u64(&r.rd);
    }
    assert_int_equal(cs[0], 0);
    assert_int_equal(cs[1], 0);
    assert_int_equal(cs[2], FERRY_ENOSPACE);
    raw_simple(&r, FERRY__P_WHY, 0, &rc, msg, sizeof msg);
    assert_int_equal(rc, FERRY_ENOSPACE);
    assert_non_null(strstr(msg, "its share"));
    raw_simple(&r, FERRY__P_WHY, 0, &rc, msg, sizeof msg);
    assert_int_equal(rc, 0); /* told once */
    raw_ping(&r);
    ft_raw_close(&r); /* (its reservations go with it) */
    ft_srv_close(&v);
}

/* ---- a client's read-ahead, spared until its ACQUIRE ---- */

static uint64_t frozen_clock(void *ctx)
{
    (void)ctx;
    return (uint64_t)1000 * 1000 * 1000 * 1000; /* no hold ever runs out here */
}

/* 4 chunks from base through client kv, written through to L2 */
static void store4(ferry_kv *kv, int32_t base, hbuf *h)
{
    int32_t tok[4 * CT];
    make_tokens(tok, 4 * CT, base);
    assert_int_equal(ferry_kv_store(kv, tok, 4 * CT, NULL, &h->b), 4 * CT);
    FT_ASSERT_OK(ferry_kv_flush(kv));
}

/* the tier each of the 4 chunks from base is found in (every one is there;
 * the lookup touches them, as an engine's does) */
static void tiers4(ferry_kv *kv, int32_t base, uint8_t *tiers)
{
    int32_t tok[4 * CT];
    make_tokens(tok, 4 * CT, base);
    ferry_kv_req r = FERRY_KV_REQ_INIT;
    r.tiers = tiers;
    r.max_chunks = 4;
    assert_int_equal(ferry_kv_lookup(kv, tok, 4 * CT, &r), 4 * CT);
}

static void assert_tier4(ferry_kv *kv, int32_t base, int tier)
{
    uint8_t t[4];
    tiers4(kv, base, t);
    for (int i = 0; i < 4; i++)
        if (t[i] != tier)
            fail_msg("chunk %d of the 4 from %d is in tier %u, not %d", i, (int)base,
                     (unsigned)t[i], tier);
}

/* a raw request of type t over the 4 chunks from base (ch: their ids and,
 * for a RELEASE, their slots); the reply is left in r->rd */
static void raw4(raw *r, int t, int32_t base, ferry__proto_chunk *ch)
{
    int32_t tok[4 * CT];
    make_tokens(tok, 4 * CT, base);
    ferry_kv_hash id[4];
    ids_of(tok, 4 * CT, id);
    for (int i = 0; i < 4; i++)
        ch[i].id = id[i];
    raw_chunks(r, t, ch, 4);
    int32_t rc;
    char msg[256];
    assert_int_equal(ft_raw_reply(r, &rc, msg, sizeof msg), 0);
    assert_int_equal(r->h.type, t | FERRY__PROTO_REPLY);
    assert_true(rc >= 0);
}

/* a daemon of an 8-chunk pool over an L2 in g_dir/sub, its clock frozen
 * (a read-ahead's sparing never runs out); evict_at_full: a watermark of
 * 1, one chunk evicted at a time, else the store's defaults */
static ferry_kv *read_ahead_daemon(srv *v, const char *sub, int evict_at_full)
{
    char l2[300];
    snprintf(l2, sizeof l2, "%s/%s", g_dir, sub);
    assert_int_equal(mkdir(l2, 0700), 0);
    ferry_kv_config kc = store_config(8);
    kc.l2_dir = l2;
    kc.l2_bytes = 64 * CHUNK;
    if (evict_at_full) {
        kc.watermark = 1.0;
        kc.evict_fraction = 1.0 / 16;
    }
    srv_start_cfg(v, &kc, 0, 0);
    ferry_kv *skv = ferry_serve_kv(v->s);
    ferry__kv_set_clock(skv, frozen_clock, NULL);
    return skv;
}

/*
 * The chunks a client's PREFETCH landed are what its retrieve acquires
 * next: while other clients store, an LRU pool would evict them first and
 * the drive read them again. They are spared as an in-process retrieve's
 * read-ahead is, and only until acquired: a chunk acquired and released is
 * an ordinary chunk, evicted in LRU order.
 */
static void test_read_ahead_spared_until_acquired(void **state)
{
    (void)state;
    enum { A = 100, S = 2000, C = 4000, D = 6000, E = 8000 }; /* 4 chunks each */
    srv v;
    read_ahead_daemon(&v, "l2ra", 1); /* evict only when full, one chunk at a time */
    ferry_kv_config c = client_config();
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    hbuf h;
    hbuf_init(&h, 4 * CT, 9);
    store4(kv, A, &h);
    store4(kv, S, &h);
    store4(kv, C, &h); /* the pool holds 8: A went to L2 */
    assert_tier4(kv, A, FERRY_KV_TIER_L2);
    raw r;
    FT_ASSERT_OK(raw_connect(&r));
    raw_hello(&r, 1);
    ferry__proto_chunk ch[4];
    memset(ch, 0, sizeof ch);
    raw4(&r, FERRY__P_PREFETCH, A, ch);
    FT_ASSERT_OK(ferry_kv_flush(ferry_serve_kv(v.s))); /* A landed, in S's slots */
    assert_tier4(kv, C, FERRY_KV_TIER_L1); /* C touched after A landed */
    /* another client's store needs 4 slots: C goes, not the read-ahead */
    store4(kv, D, &h);
    assert_tier4(kv, C, FERRY_KV_TIER_L2);
    raw4(&r, FERRY__P_ACQUIRE, A, ch);
    assert_int_equal(ferry__proto_get_u32(&r.rd), 4);
    for (int i = 0; i < 4; i++) {
        assert_int_equal((int32_t)ferry__proto_get_u32(&r.rd), 0);
        ch[i].slot = ferry__proto_get_u64(&r.rd);
        ch[i].gen = ferry__proto_get_u64(&r.rd);
        assert_int_equal(ferry__proto_get_u8(&r.rd), FERRY_KV_TIER_L1); /* no second read */
    }
    raw4(&r, FERRY__P_RELEASE, A, ch);
    assert_int_equal(ferry__proto_get_u32(&r.rd), 4);
    for (int i = 0; i < 4; i++)
        assert_int_equal((int32_t)ferry__proto_get_u32(&r.rd), 0);
    /* consumed: A is the least recently used now, and goes first */
    assert_tier4(kv, D, FERRY_KV_TIER_L1);
    store4(kv, E, &h);
    assert_tier4(kv, D, FERRY_KV_TIER_L1);
    assert_tier4(kv, A, FERRY_KV_TIER_L2);
    ft_raw_close(&r);
    ferry_kv_close(kv);
    free(h.mem);
    ft_srv_close(&v);
}

/* ---- a write-through that cannot be queued ---- */

/* no memory for the daemon's write-through jobs: the chunks are stored in
 * L1 and the client told so, and each write-through not made is counted
 * as the L2 tier's failure (kv.h), not dropped without a trace */
static void test_write_through_without_memory(void **state)
{
    (void)state;
    assert_int_not_equal(sizeof(ferry__kv_job), sizeof(ferry__kv_entry));
    char l2[300];
    snprintf(l2, sizeof l2, "%s/l2wt", g_dir);
    assert_int_equal(mkdir(l2, 0700), 0);
    ft_alloc_install(0, 0);
    srv v;
    ferry_kv_config kc = store_config(8);
    kc.l2_dir = l2;
    kc.l2_bytes = 64 * CHUNK;
    srv_start_cfg(&v, &kc, 0, 0);
    ferry_kv_config c = client_config();
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    hbuf h;
    hbuf_init(&h, 4 * CT, 6);
    int32_t tok[4 * CT];
    make_tokens(tok, 4 * CT, 8700);
    /* (the client's buffers grown first: none of them may fail below) */
    assert_int_equal(ferry_kv_store(kv, tok, 4 * CT, NULL, &h.b), 4 * CT);
    FT_ASSERT_OK(ferry_kv_flush(kv));
    make_tokens(tok, 4 * CT, 8800);
    ft_alloc_fail_size(sizeof(ferry__kv_job));
    int st[4];
    ferry_kv_req r = FERRY_KV_REQ_INIT;
    r.status = st;
    r.max_chunks = 4;
    int src = ferry_kv_store(kv, tok, 4 * CT, &r, &h.b);
    if (src != 4 * CT)
        fprintf(stderr, "store: %d: %s\n", src, ferry_kv_last_error(kv));
    assert_int_equal(src, 4 * CT);
    FT_ASSERT_OK(ferry_kv_flush(kv));
    ft_alloc_fail_size(0);
    assert_true(ft_alloc_failures() >= 4);
    ferry_kv_stats m = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(ferry_serve_kv(v.s), &m));
    assert_int_equal(m.tier[FERRY_KV_TIER_L2].chunks, 4); /* the first store's only */
    assert_int_equal(m.tier[FERRY_KV_TIER_L2].failures, 4);
    assert_true(m.failures >= 4);
    ferry_kv_close(kv);
    ft_srv_close(&v);
    free(h.mem);
    ft_alloc_reset();
}

/*
 * Sparing a client's read-ahead is a preference only: with every L1 slot
 * holding chunks PREFETCHed and never acquired (and a clock that never
 * lets their sparing run out), another client's store still finds room,
 * taking read-ahead rather than failing, as it did before they were spared.
 */
static void test_read_ahead_yields_to_stores(void **state)
{
    (void)state;
    enum { A = 100, B = 2000, C = 4000, D = 6000, E = 8000 }; /* 4 chunks each */
    srv v;
    ferry_kv *skv = read_ahead_daemon(&v, "l2ry", 0);
    ferry_kv_config c = client_config();
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    hbuf h;
    hbuf_init(&h, 4 * CT, 9);
    store4(kv, A, &h);
    store4(kv, B, &h);
    store4(kv, C, &h);
    store4(kv, D, &h); /* the pool holds 8: A and B only in L2 */
    /* the daemon's own write-throughs done (a chunk still being written
     * through is not evictable: the prefetches must find C and D free) */
    FT_ASSERT_OK(ferry_kv_flush(skv));
    assert_tier4(kv, A, FERRY_KV_TIER_L2);
    assert_tier4(kv, B, FERRY_KV_TIER_L2);
    raw r;
    FT_ASSERT_OK(raw_connect(&r));
    raw_hello(&r, 1);
    ferry__proto_chunk ch[4];
    memset(ch, 0, sizeof ch);
    raw4(&r, FERRY__P_PREFETCH, A, ch);
    FT_ASSERT_OK(ferry_kv_flush(skv));
    raw4(&r, FERRY__P_PREFETCH, B, ch);
    FT_ASSERT_OK(ferry_kv_flush(skv)); /* every slot a spared read-ahead */
    assert_tier4(kv, A, FERRY_KV_TIER_L1);
    assert_tier4(kv, B, FERRY_KV_TIER_L1);
    ferry_kv_stats before = FERRY_KV_STATS_INIT, after = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(skv, &before));
    store4(kv, E, &h); /* room taken from the read-ahead, not refused */
    /* E is found (the store's L1 placements are the failure counts below:
     * where it lives now is the pool's business - its evictor, keeping
     * free slots, may already have moved E, the one chunk not spared, to
     * the L2 it was written through to) */
    uint8_t te[4];
    tiers4(kv, E, te);
    FT_ASSERT_OK(ferry_kv_stats_get(skv, &after));
    assert_int_equal(after.alloc_failures, before.alloc_failures);
    assert_int_equal(after.tier[FERRY_KV_TIER_L1].failures,
                     before.tier[FERRY_KV_TIER_L1].failures);
    ft_raw_close(&r);
    ferry_kv_close(kv);
    free(h.mem);
    ft_srv_close(&v);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_in_process, setup, teardown),
        cmocka_unit_test_setup_teardown(test_through_server, setup, teardown),
        cmocka_unit_test_setup_teardown(test_shared_and_lookup_only, setup, teardown),
        cmocka_unit_test_setup_teardown(test_client_killed_mid_store, setup, teardown),
        cmocka_unit_test_setup_teardown(test_daemon_killed_and_restarted, setup, teardown),
        cmocka_unit_test_setup_teardown(test_prefetch, setup, teardown),
        cmocka_unit_test_setup_teardown(test_device_buffers, setup, teardown),
        cmocka_unit_test_setup_teardown(test_bad_frames, setup, teardown),
        cmocka_unit_test_setup_teardown(test_client_never_reads, setup, teardown),
        cmocka_unit_test_setup_teardown(test_many_connections, setup, teardown),
        cmocka_unit_test_setup_teardown(test_reconnect_at_max_clients, setup, teardown),
        cmocka_unit_test_setup_teardown(test_hello_then_hang_up_at_max_clients, setup, teardown),
        cmocka_unit_test_setup_teardown(test_other_uid, setup, teardown),
        cmocka_unit_test_setup_teardown(test_socket_owner, setup, teardown),
        cmocka_unit_test_setup_teardown(test_socket_appears_listening, setup, teardown),
        cmocka_unit_test_setup_teardown(test_socket_paths_near_the_limit, setup, teardown),
        cmocka_unit_test_setup_teardown(test_socket_group_mode_and_no_group, setup, teardown),
        cmocka_unit_test_setup_teardown(test_daemons_racing_for_one_path, setup, teardown),
        cmocka_unit_test_setup_teardown(test_stale_release, setup, teardown),
        cmocka_unit_test_setup_teardown(test_wait_and_why, setup, teardown),
        cmocka_unit_test_setup_teardown(test_read_ahead_spared_until_acquired, setup, teardown),
        cmocka_unit_test_setup_teardown(test_read_ahead_yields_to_stores, setup, teardown),
        cmocka_unit_test_setup_teardown(test_write_through_without_memory, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
