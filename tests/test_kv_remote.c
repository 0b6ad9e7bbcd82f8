/*
 * test_kv_remote.c - the KV store's remote tier against a real
 * redis-server on a loopback port (skipped with 77 when redis-server is
 * not installed): stores (and processes) sharing chunks through one
 * server, a different layout under the same chunk ids refused, a damaged
 * value a miss for exactly that chunk, a server stopped mid-run and
 * restarted, delete, bad configuration, metrics, and threads sharing.
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
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <hiredis/hiredis.h>

#include "ferry/kv.h"
#include "ferry_test.h"
#include "kv/kv_impl.h"
#include "redis_server.h"

/* 2 layers, K and V, 2 heads of 16 bf16: 64 bytes per token and plane,
 * 16-token chunks of 4096 bytes */
#define CT 16
#define TB 64u
#define PLANES 4u
#define CHUNK (PLANES * CT * TB)
#define MODEL "remote-test-model"

static ft_redis g_srv;

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static ferry_kv_layout small_layout(void)
{
    return ft_kv_layout(64);
}

static ferry_remote_options g_ro; /* short timeouts and backoff */

static ferry_kv_config remote_config(const ft_redis *s, char *url, size_t ulen,
                                     const char *prefix, uint64_t l1_chunks)
{
    ferry_remote_options o = FERRY_REMOTE_OPTIONS_INIT;
    o.connect_timeout_ms = 300;
    o.command_timeout_ms = 300;
    o.backoff_initial_ms = 20;
    o.backoff_max_ms = 100;
    g_ro = o;
    g_ro.key_prefix = prefix;
    ferry_kv_config c = FERRY_KV_CONFIG_INIT;
    c.model = MODEL;
    c.layout = small_layout();
    c.chunk_tokens = CT;
    c.l1_bytes = l1_chunks * CHUNK;
    c.workers = 2;
    c.remote_url = ft_redis_url(s, 0, url, ulen);
    c.remote_options = &g_ro;
    return c;
}

static ferry_kv *open_store(const ft_redis *s, const char *prefix, uint64_t l1_chunks)
{
    char url[128];
    ferry_kv_config c = remote_config(s, url, sizeof url, prefix, l1_chunks);
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    return kv;
}

static ferry_kv_stats stats(ferry_kv *kv)
{
    ferry_kv_stats m = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(kv, &m));
    return m;
}

/* tokens of prompt `seed`: distinct per seed */
static void make_tokens(int32_t *t, size_t n, unsigned seed)
{
    uint64_t x = 0x9E3779B97F4A7C15ull * (seed + 1);
    for (size_t i = 0; i < n; i++) {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        t[i] = (int32_t)((x * 0x2545F4914F6CDD1Dull) >> 40);
    }
}

/* the KV bytes of token p of a prompt, from the token and its position, so
 * any process can check what it reads */
static unsigned char kv_byte(const int32_t *t, size_t p, unsigned plane, unsigned b)
{
    return (unsigned char)((uint32_t)t[p] * 131u + (uint32_t)p * 7u + plane * 13u + b);
}

/* a host contiguous tensor [PLANES][cap][TB] */
typedef struct hbuf {
    ferry_kv_buffer b;
    unsigned char *mem;
    uint64_t cap;
} hbuf;

static void hbuf_init(hbuf *h, uint64_t cap)
{
    ferry_kv_buffer b = FERRY_KV_BUFFER_INIT;
    b.layout = small_layout();
    h->cap = cap;
    h->mem = malloc(PLANES * cap * TB);
    assert_non_null(h->mem);
    memset(h->mem, 0xEE, PLANES * cap * TB);
    b.base = (uint64_t)(uintptr_t)h->mem;
    b.capacity_tokens = cap;
    h->b = b;
}

static void hbuf_fill(hbuf *h, const int32_t *t, size_t n)
{
    for (unsigned k = 0; k < PLANES; k++)
        for (size_t p = 0; p < n; p++)
            for (unsigned b = 0; b < TB; b++)
                h->mem[((size_t)k * h->cap + p) * TB + b] = kv_byte(t, p, k, b);
}

/* 1 when tokens [from, to) of h hold t's bytes */
static int hbuf_ok(const hbuf *h, const int32_t *t, size_t from, size_t to)
{
    for (unsigned k = 0; k < PLANES; k++)
        for (size_t p = from; p < to; p++)
            for (unsigned b = 0; b < TB; b++)
                if (h->mem[((size_t)k * h->cap + p) * TB + b] != kv_byte(t, p, k, b))
                    return 0;
    return 1;
}

/* 1 when tokens [from, to) of h were never written (0xEE) */
static int hbuf_untouched(const hbuf *h, size_t from, size_t to)
{
    for (unsigned k = 0; k < PLANES; k++)
        for (size_t p = from; p < to; p++)
            for (unsigned b = 0; b < TB; b++)
                if (h->mem[((size_t)k * h->cap + p) * TB + b] != 0xEE)
                    return 0;
    return 1;
}

static void hbuf_free(hbuf *h)
{
    free(h->mem);
}

/* store prompt t[0..n) into kv and flush (write-throughs on the server) */
static void store_prompt(ferry_kv *kv, const int32_t *t, size_t n, const ferry_kv_req *req)
{
    hbuf h;
    hbuf_init(&h, n);
    hbuf_fill(&h, t, n);
    int partial = req && (req->flags & FERRY_KV_PARTIAL);
    int want = (int)(partial ? n : n / CT * CT);
    assert_int_equal(ferry_kv_store(kv, t, n, req, &h.b), want);
    FT_ASSERT_OK(ferry_kv_flush(kv));
    hbuf_free(&h);
}

/* the server key of chunk i of t[0..n) for MODEL (no salt) */
static void chunk_key(const char *prefix, const int32_t *t, size_t n, size_t i, char *key,
                      size_t len)
{
    ferry_kv_hash h[64];
    assert_true(n / CT <= 64);
    ferry__kv_hash_chain(FERRY_KV_HASH_SEED_DEFAULT, t, n, CT, 0, h, 64);
    ferry_kv_hash ns = ferry__kv_namespace(FERRY_KV_HASH_SEED_DEFAULT, MODEL, 0, 1, NULL, 0);
    ferry_kv_hash id = {h[i].lo ^ ns.lo, h[i].hi ^ ns.hi};
    char hex[33];
    assert_int_equal(ferry__kv_remote_key(&id, hex, sizeof hex), 32);
    snprintf(key, len, "%s%s", prefix, hex);
}

static long count_keys(const ft_redis *s, const char *prefix)
{
    char pat[128], out[64];
    snprintf(pat, sizeof pat, "%s*", prefix);
    /* EVAL keeps it to one integer reply */
    const char *argv[] = {"EVAL", "return #redis.call('KEYS', ARGV[1])", "0", pat, NULL};
    assert_int_equal(ft_redis_cmd(s, out, sizeof out, argv), REDIS_REPLY_INTEGER);
    return atol(out);
}

/* ---- sharing ---- */

static void stores_share_chunks(void **state)
{
    (void)state;
    const char *pfx = "share:";
    ferry_kv *a = open_store(&g_srv, pfx, 16), *b = open_store(&g_srv, pfx, 16);
    enum { N = 6 * CT + 5 };
    int32_t t[N];
    make_tokens(t, N, 1);
    ferry_kv_req req = FERRY_KV_REQ_INIT;
    req.flags = FERRY_KV_PARTIAL;
    store_prompt(a, t, N, &req);
    assert_int_equal(count_keys(&g_srv, pfx), 7);
    ferry_kv_stats ma = stats(a);
    assert_int_equal(ma.remote_puts, 7);
    assert_int_equal(ma.remote_put_bytes, 7 * CHUNK);
    assert_int_equal(ma.remote_written, 7);

    /* B has nothing locally: one round trip finds all 7 chunks */
    uint8_t tiers[8];
    memset(tiers, 0xff, sizeof tiers);
    req.tiers = tiers;
    req.max_chunks = 8;
    assert_int_equal(ferry_kv_lookup(b, t, N, &req), N);
    for (int i = 0; i < 7; i++)
        assert_int_equal(tiers[i], FERRY_KV_TIER_REMOTE);
    ferry_kv_stats mb = stats(b);
    assert_int_equal(mb.remote_lookups, 1);
    assert_int_equal(mb.remote_lookup_chunks, 7);
    assert_int_equal(mb.remote_found_chunks, 7);
    assert_int_equal(mb.tier[FERRY_KV_TIER_REMOTE].hits, 7);
    assert_int_equal(mb.tier[FERRY_KV_TIER_REMOTE].chunks, 7);
    /* without the partial flag: the whole chunks only, no more round trips */
    assert_int_equal(ferry_kv_lookup(b, t, N, NULL), N / CT * CT);
    assert_int_equal(stats(b).remote_lookups, 1);

    /* retrieve fetches each into L1 and copies it out */
    hbuf d;
    hbuf_init(&d, N);
    int st[8];
    req.tiers = NULL;
    req.status = st;
    assert_int_equal(ferry_kv_retrieve(b, t, N, &req, &d.b), N);
    assert_true(hbuf_ok(&d, t, 0, N));
    for (int i = 0; i < 7; i++)
        assert_int_equal(st[i], 0);
    mb = stats(b);
    assert_int_equal(mb.remote_gets, 7);
    assert_int_equal(mb.remote_get_bytes, 7 * CHUNK);
    assert_int_equal(mb.remote_misses + mb.remote_refused + mb.remote_errors, 0);
    assert_int_equal(mb.tier[FERRY_KV_TIER_L1].chunks, 7);
    /* promoted: now an L1 hit, no round trip */
    req.status = NULL;
    req.tiers = tiers;
    assert_int_equal(ferry_kv_lookup(b, t, N, &req), N);
    for (int i = 0; i < 7; i++)
        assert_int_equal(tiers[i], FERRY_KV_TIER_L1);
    assert_int_equal(stats(b).remote_lookups, 1);
    /* B's store of the same prompt finds it present: nothing written again */
    store_prompt(b, t, N, &req);
    assert_int_equal(stats(b).remote_puts, 0);
    FT_ASSERT_OK(ferry__kv_check(b));
    hbuf_free(&d);
    ferry_kv_close(a);
    ferry_kv_close(b);
}

static void retrieve_without_lookup_and_prefetch(void **state)
{
    (void)state;
    const char *pfx = "direct:";
    ferry_kv *a = open_store(&g_srv, pfx, 16), *b = open_store(&g_srv, pfx, 16);
    enum { N = 5 * CT };
    int32_t t[N];
    make_tokens(t, N, 2);
    store_prompt(a, t, N, NULL);
    hbuf d;
    hbuf_init(&d, N);
    assert_int_equal(ferry_kv_retrieve(b, t, N, NULL, &d.b), N);
    assert_true(hbuf_ok(&d, t, 0, N));
    assert_int_equal(stats(b).remote_gets, 5);

    /* prefetch brings a remote prompt into L1 ahead of the retrieve (L1 of
     * 32 chunks: prefetch keeps a quarter of it in flight) */
    ferry_kv *c = open_store(&g_srv, pfx, 32);
    assert_int_equal(ferry_kv_prefetch(c, t, N, NULL), N);
    FT_ASSERT_OK(ferry_kv_flush(c));
    ferry_kv_stats mc = stats(c);
    assert_int_equal(mc.prefetched_chunks, 5);
    assert_int_equal(mc.tier[FERRY_KV_TIER_L1].chunks, 5);
    uint8_t tiers[5];
    ferry_kv_req req = FERRY_KV_REQ_INIT;
    req.tiers = tiers;
    req.max_chunks = 5;
    assert_int_equal(ferry_kv_lookup(c, t, N, &req), N);
    for (int i = 0; i < 5; i++)
        assert_int_equal(tiers[i], FERRY_KV_TIER_L1);
    hbuf_free(&d);
    ferry_kv_close(a);
    ferry_kv_close(b);
    ferry_kv_close(c);
}

/* a lookup walks local chunks, then asks the remote about the rest once */
static void local_prefix_then_remote_rest(void **state)
{
    (void)state;
    const char *pfx = "mixed:";
    ferry_kv *a = open_store(&g_srv, pfx, 32), *b = open_store(&g_srv, pfx, 32);
    enum { N = 40 * CT }; /* more than one lookup block of 16 chunks */
    int32_t *t = malloc(N * sizeof *t);
    assert_non_null(t);
    make_tokens(t, N, 3);
    store_prompt(a, t, N, NULL);
    store_prompt(b, t, 20 * CT, NULL); /* B holds the first 20 itself */
    assert_int_equal(stats(b).remote_puts, 20);
    uint8_t tiers[41];
    ferry_kv_req req = FERRY_KV_REQ_INIT;
    req.tiers = tiers;
    req.max_chunks = 41;
    assert_int_equal(ferry_kv_lookup(b, t, N, &req), N);
    for (int i = 0; i < 40; i++)
        assert_int_equal(tiers[i], i < 20 ? FERRY_KV_TIER_L1 : FERRY_KV_TIER_REMOTE);
    ferry_kv_stats mb = stats(b);
    assert_int_equal(mb.remote_lookups, 1);
    assert_int_equal(mb.remote_lookup_chunks, 20);
    assert_int_equal(mb.remote_found_chunks, 20);
    /* one more chunk than anyone stored: a miss reported for it */
    int32_t *t2 = malloc((N + CT) * sizeof *t2);
    assert_non_null(t2);
    memcpy(t2, t, N * sizeof *t);
    make_tokens(t2 + N, CT, 4);
    req.max_chunks = 41;
    assert_int_equal(ferry_kv_lookup(b, t2, N + CT, &req), N);
    assert_int_equal(tiers[40], FERRY_KV_TIER_NONE);
    assert_int_equal(stats(b).remote_lookup_chunks, 21);
    free(t2);
    free(t);
    ferry_kv_close(a);
    ferry_kv_close(b);
}

static void salts_isolate_tenants(void **state)
{
    (void)state;
    const char *pfx = "salt:";
    ferry_kv *a = open_store(&g_srv, pfx, 16), *b = open_store(&g_srv, pfx, 16);
    enum { N = 3 * CT };
    int32_t t[N];
    make_tokens(t, N, 5);
    ferry_kv_req r1 = FERRY_KV_REQ_INIT, r2 = FERRY_KV_REQ_INIT;
    r1.salt = "tenant-1";
    r1.salt_len = 8;
    r2.salt = "tenant-2";
    r2.salt_len = 8;
    store_prompt(a, t, N, &r1);
    assert_int_equal(ferry_kv_lookup(b, t, N, &r2), 0);
    assert_int_equal(ferry_kv_lookup(b, t, N, NULL), 0);
    assert_int_equal(ferry_kv_lookup(b, t, N, &r1), N);
    ferry_kv_close(a);
    ferry_kv_close(b);
}

/* the same model and chunk ids with another dtype of the same size: the
 * same keys and value sizes, refused by the layout fingerprint */
static void other_layout_is_refused(void **state)
{
    (void)state;
    const char *pfx = "layout:";
    ferry_kv *a = open_store(&g_srv, pfx, 16);
    enum { N = 4 * CT };
    int32_t t[N];
    make_tokens(t, N, 6);
    store_prompt(a, t, N, NULL);

    char url[128];
    ferry_kv_config c = remote_config(&g_srv, url, sizeof url, pfx, 16);
    c.layout.dtype = FERRY_DTYPE_F16;
    ferry_kv *f = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &f));
    assert_int_equal(ferry_kv_chunk_bytes(f), CHUNK);
    assert_int_equal(ferry_kv_lookup(f, t, N, NULL), 0);
    hbuf d;
    hbuf_init(&d, N);
    d.b.layout.dtype = FERRY_DTYPE_F16;
    int st[4];
    ferry_kv_req req = FERRY_KV_REQ_INIT;
    req.status = st;
    req.max_chunks = 4;
    assert_int_equal(ferry_kv_retrieve(f, t, N, &req, &d.b), 0);
    for (int i = 0; i < 4; i++)
        assert_int_equal(st[i], FERRY_ENOTFOUND);
    assert_true(hbuf_untouched(&d, 0, N));
    assert_int_equal(stats(f).remote_found_chunks, 0);
    assert_int_equal(stats(f).remote_gets, 0);
    /* refused by its header, once by the lookup and once by the retrieve's
     * (each stops at chunk 0) */
    assert_int_equal(stats(f).remote_refused, 2);

    /* and a value planted under f's key by another layout is refused on
     * read too: index chunk 0 as remote-resident in f through a lookup of
     * f's own store, then overwrite it on the server with a's value */
    hbuf s;
    hbuf_init(&s, N);
    s.b.layout.dtype = FERRY_DTYPE_F16;
    int32_t u[N];
    make_tokens(u, N, 7);
    hbuf_fill(&s, u, N);
    ferry_kv *g = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &g));
    assert_int_equal(ferry_kv_store(g, u, N, NULL, &s.b), N);
    FT_ASSERT_OK(ferry_kv_flush(g));
    assert_int_equal(ferry_kv_lookup(f, u, N, NULL), N); /* indexed in f, remote only */
    char ka[128], kf[128];
    chunk_key(pfx, t, N, 0, ka, sizeof ka);
    chunk_key(pfx, u, N, 0, kf, sizeof kf);
    const char *copy[] = {"COPY", ka, kf, "REPLACE", NULL};
    char out[64];
    assert_int_equal(ft_redis_cmd(&g_srv, out, sizeof out, copy), REDIS_REPLY_INTEGER);
    hbuf_free(&d);
    hbuf_init(&d, N);
    d.b.layout.dtype = FERRY_DTYPE_F16;
    assert_int_equal(ferry_kv_retrieve(f, u, N, &req, &d.b), 0);
    assert_int_equal(st[0], FERRY_ENOTFOUND);
    for (int i = 1; i < 4; i++)
        assert_int_equal(st[i], 0);
    assert_true(hbuf_untouched(&d, 0, CT));
    assert_true(hbuf_ok(&d, u, CT, N));
    assert_int_equal(stats(f).remote_refused, 3);
    /* the refused chunk is forgotten, the others are in L1 */
    ferry_kv_hash hu[4];
    ferry__kv_hash_chain(FERRY_KV_HASH_SEED_DEFAULT, u, N, CT, 0, hu, 4);
    assert_int_equal(ferry__kv_chunk_state(f, hu[0], NULL, 0, NULL, NULL), -1);
    uint8_t res = 0;
    assert_int_equal(ferry__kv_chunk_state(f, hu[1], NULL, 0, &res, NULL), FERRY__KV_READY);
    assert_true(res & (1u << FERRY_KV_TIER_L1));
    FT_ASSERT_OK(ferry__kv_check(f));
    hbuf_free(&s);
    hbuf_free(&d);
    ferry_kv_close(g);
    ferry_kv_close(f);
    ferry_kv_close(a);
}

/* a value damaged on the server: exists still counts it (header only), the
 * read refuses it; a miss for exactly that chunk, its bytes not written */
static void damaged_value_is_a_miss_for_that_chunk(void **state)
{
    (void)state;
    const char *pfx = "damaged:";
    ferry_kv *a = open_store(&g_srv, pfx, 16), *b = open_store(&g_srv, pfx, 16);
    enum { N = 4 * CT };
    int32_t t[N];
    make_tokens(t, N, 8);
    store_prompt(a, t, N, NULL);
    char key[128];
    chunk_key(pfx, t, N, 2, key, sizeof key);
    const char *setrange[] = {"SETRANGE", key, "1000", "DAMAGED-BYTES", NULL};
    assert_int_equal(ft_redis_cmd(&g_srv, NULL, 0, setrange), REDIS_REPLY_INTEGER);
    assert_int_equal(ferry_kv_lookup(b, t, N, NULL), N);
    hbuf d;
    hbuf_init(&d, N);
    int st[4];
    ferry_kv_req req = FERRY_KV_REQ_INIT;
    req.status = st;
    req.max_chunks = 4;
    assert_int_equal(ferry_kv_retrieve(b, t, N, &req, &d.b), 2 * CT);
    assert_int_equal(st[0], 0);
    assert_int_equal(st[1], 0);
    assert_int_equal(st[2], FERRY_ENOTFOUND);
    assert_int_equal(st[3], 0);
    assert_true(hbuf_ok(&d, t, 0, 2 * CT));
    assert_true(hbuf_untouched(&d, 2 * CT, 3 * CT));
    assert_true(hbuf_ok(&d, t, 3 * CT, N));
    ferry_kv_stats mb = stats(b);
    assert_int_equal(mb.remote_refused, 1);
    assert_int_equal(mb.retrieved_chunks, 3);
    assert_int_equal(mb.misses, 1);
    FT_ASSERT_OK(ferry__kv_check(b));
    hbuf_free(&d);
    ferry_kv_close(a);
    ferry_kv_close(b);
}

static void delete_removes_remote_copies(void **state)
{
    (void)state;
    const char *pfx = "delete:";
    ferry_kv *a = open_store(&g_srv, pfx, 16), *b = open_store(&g_srv, pfx, 16);
    enum { N = 3 * CT };
    int32_t t[N], u[N];
    make_tokens(t, N, 9);
    make_tokens(u, N, 10);
    store_prompt(a, t, N, NULL);
    store_prompt(a, u, N, NULL);
    assert_int_equal(count_keys(&g_srv, pfx), 6);
    /* a's own chunks: deleted here and on the server, counted once */
    assert_int_equal(ferry_kv_delete(a, t, N, NULL), 3);
    assert_int_equal(count_keys(&g_srv, pfx), 3);
    assert_int_equal(ferry_kv_lookup(b, t, N, NULL), 0);
    /* b never indexed u: the server's copies count */
    assert_int_equal(ferry_kv_delete(b, u, N, NULL), 3);
    assert_int_equal(count_keys(&g_srv, pfx), 0);
    assert_int_equal(ferry_kv_lookup(a, u, N, NULL), N); /* a's L1 keeps its own */
    /* clear is local only */
    store_prompt(a, t, N, NULL);
    assert_true(ferry_kv_clear(a) >= 3);
    assert_int_equal(count_keys(&g_srv, pfx), 3);
    ferry_kv_close(a);
    ferry_kv_close(b);
}

/* ---- two processes ---- */

static int child_store(const int32_t *t, size_t n)
{
    char url[128];
    ferry_kv_config c = remote_config(&g_srv, url, sizeof url, "procs:", 16);
    ferry_kv *kv = NULL;
    if (ferry_kv_open(&c, &kv) < 0)
        return 2;
    hbuf h;
    hbuf_init(&h, n);
    hbuf_fill(&h, t, n);
    int rc = ferry_kv_store(kv, t, n, NULL, &h.b) == (int)n && ferry_kv_flush(kv) == 0 ? 0 : 3;
    ferry_kv_close(kv);
    hbuf_free(&h);
    return rc;
}

static int child_retrieve(const int32_t *t, size_t n)
{
    char url[128];
    ferry_kv_config c = remote_config(&g_srv, url, sizeof url, "procs:", 16);
    ferry_kv *kv = NULL;
    if (ferry_kv_open(&c, &kv) < 0)
        return 2;
    hbuf h;
    hbuf_init(&h, n);
    int rc = 0;
    if (ferry_kv_lookup(kv, t, n, NULL) != (int)n)
        rc = 3;
    else if (ferry_kv_retrieve(kv, t, n, NULL, &h.b) != (int)n)
        rc = 4;
    else if (!hbuf_ok(&h, t, 0, n))
        rc = 5;
    ferry_kv_close(kv);
    hbuf_free(&h);
    return rc;
}

static void two_processes_share_chunks(void **state)
{
    (void)state;
    enum { N = 4 * CT };
    int32_t p[N], q[N];
    make_tokens(p, N, 11);
    make_tokens(q, N, 12);
    /* both children are forked before this process runs any thread */
    int go[2];
    assert_int_equal(pipe(go), 0);
    pid_t reader = fork();
    assert_true(reader >= 0);
    if (reader == 0) {
        char c;
        close(go[1]);
        _exit(read(go[0], &c, 1) == 1 ? child_retrieve(q, N) : 9);
    }
    close(go[0]);
    pid_t writer = fork();
    assert_true(writer >= 0);
    if (writer == 0)
        _exit(child_store(p, N));
    int ws = 0;
    assert_int_equal(waitpid(writer, &ws, 0), writer);
    assert_true(WIFEXITED(ws));
    assert_int_equal(WEXITSTATUS(ws), 0);

    /* the writer process is gone: its chunks come from the server */
    ferry_kv *kv = open_store(&g_srv, "procs:", 16);
    hbuf h;
    hbuf_init(&h, N);
    assert_int_equal(ferry_kv_lookup(kv, p, N, NULL), N);
    assert_int_equal(ferry_kv_retrieve(kv, p, N, NULL, &h.b), N);
    assert_true(hbuf_ok(&h, p, 0, N));
    /* and the other way: this process stores, the reader process reads */
    store_prompt(kv, q, N, NULL);
    assert_int_equal(write(go[1], "g", 1), 1);
    close(go[1]);
    int rs = 0;
    assert_int_equal(waitpid(reader, &rs, 0), reader);
    assert_true(WIFEXITED(rs));
    assert_int_equal(WEXITSTATUS(rs), 0);
    hbuf_free(&h);
    ferry_kv_close(kv);
}

/* ---- a server that goes away and comes back ---- */

/* ask until the remote is up again (the probe after the backoff period) */
static int wait_remote_up(ferry_kv *kv, unsigned seed)
{
    int32_t t[CT];
    make_tokens(t, CT, seed);
    for (int i = 0; i < 800; i++) {
        ferry_kv_lookup(kv, t, CT, NULL);
        if (stats(kv).remote_down == 0)
            return 1;
        sleep_ms(10);
    }
    return 0;
}

static void stopped_server_degrades_then_recovers(void **state)
{
    (void)state;
    ft_redis s;
    assert_int_equal(ft_redis_start(&s, NULL), 0);
    const char *pfx = "stop:";
    char url[128];
    ferry_kv_config c = remote_config(&s, url, sizeof url, pfx, 16);
    g_ro.backoff_initial_ms = 2000; /* long enough for the checks made while down */
    g_ro.backoff_max_ms = 2000;
    ferry_kv *a = NULL, *b = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &a));
    FT_ASSERT_OK(ferry_kv_open(&c, &b));
    enum { N = 4 * CT };
    int32_t t1[N], t2[N], t3[N], t4[N];
    make_tokens(t1, N, 20);
    make_tokens(t2, N, 21);
    make_tokens(t3, N, 22);
    make_tokens(t4, N, 23);
    store_prompt(a, t1, N, NULL);
    assert_int_equal(ferry_kv_lookup(b, t1, N, NULL), N); /* b indexes t1 as remote */

    ft_redis_stop(&s);
    /* a keeps serving from its local tier; its write-throughs are dropped */
    hbuf d;
    hbuf_init(&d, N);
    store_prompt(a, t2, N, NULL);
    assert_int_equal(ferry_kv_lookup(a, t1, N, NULL), N);
    assert_int_equal(ferry_kv_retrieve(a, t1, N, NULL, &d.b), N);
    assert_true(hbuf_ok(&d, t1, 0, N));
    assert_int_equal(ferry_kv_lookup(a, t3, N, NULL), 0);
    ferry_kv_stats ma = stats(a);
    assert_int_equal(ma.remote_down, 1);
    assert_true(ma.remote_dropped >= 1);
    /* b: what it knew is a miss for each chunk, never bytes */
    hbuf_free(&d);
    hbuf_init(&d, N);
    int st[4];
    ferry_kv_req req = FERRY_KV_REQ_INIT;
    req.status = st;
    req.max_chunks = 4;
    assert_int_equal(ferry_kv_retrieve(b, t1, N, &req, &d.b), 0);
    for (int i = 0; i < 4; i++)
        assert_int_equal(st[i], FERRY_ENOTFOUND);
    assert_true(hbuf_untouched(&d, 0, N));
    assert_int_equal(stats(b).remote_down, 1);
    /* while down, questions are answered at once (degraded), not sent */
    uint64_t deg = stats(b).remote_degraded;
    assert_int_equal(ferry_kv_lookup(b, t2, N, NULL), 0);
    assert_int_equal(ferry_kv_retrieve(b, t3, N, NULL, &d.b), 0);
    assert_int_equal(stats(b).remote_degraded, deg + 2);
    assert_true(hbuf_untouched(&d, 0, N));
    FT_ASSERT_OK(ferry__kv_check(b));

    /* back (empty: no persistence): sharing works again */
    assert_int_equal(ft_redis_restart(&s), 0);
    assert_true(wait_remote_up(a, 24));
    assert_true(wait_remote_up(b, 25));
    store_prompt(a, t4, N, NULL);
    assert_int_equal(ferry_kv_lookup(b, t4, N, NULL), N);
    assert_int_equal(ferry_kv_retrieve(b, t4, N, NULL, &d.b), N);
    assert_true(hbuf_ok(&d, t4, 0, N));
    /* what a stored while the server was down never reached it */
    assert_int_equal(ferry_kv_lookup(b, t2, N, NULL), 0);
    hbuf_free(&d);
    ferry_kv_close(a);
    ferry_kv_close(b);
    ft_redis_destroy(&s);
}

/* a server that stops answering (SIGSTOP: it still accepts connections):
 * calls come back after the timeouts as misses, then at once while down */
static void hung_server_answers_misses(void **state)
{
    (void)state;
    ft_redis s;
    assert_int_equal(ft_redis_start(&s, NULL), 0);
    char url[128];
    ferry_kv_config c = remote_config(&s, url, sizeof url, "hung:", 16);
    g_ro.backoff_initial_ms = 2000;
    g_ro.backoff_max_ms = 2000;
    ferry_kv *a = NULL, *b = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &a));
    FT_ASSERT_OK(ferry_kv_open(&c, &b));
    enum { N = 3 * CT };
    int32_t t1[N], t2[N];
    make_tokens(t1, N, 50);
    make_tokens(t2, N, 51);
    store_prompt(a, t1, N, NULL);
    assert_int_equal(ferry_kv_lookup(b, t1, N, NULL), N);
    ft_redis_pause(&s);
    hbuf d;
    hbuf_init(&d, N);
    /* b's fetch of what it indexed times out: a miss per chunk, no bytes */
    assert_int_equal(ferry_kv_retrieve(b, t1, N, NULL, &d.b), 0);
    assert_true(hbuf_untouched(&d, 0, N));
    assert_int_equal(stats(b).remote_down, 1);
    uint64_t deg = stats(b).remote_degraded;
    assert_int_equal(ferry_kv_lookup(b, t2, N, NULL), 0);
    assert_int_equal(stats(b).remote_degraded, deg + 1);
    /* a stores and finds locally; its write-throughs never wait */
    store_prompt(a, t2, N, NULL);
    assert_int_equal(ferry_kv_lookup(a, t2, N, NULL), N);
    assert_int_equal(ferry_kv_retrieve(a, t2, N, NULL, &d.b), N);
    assert_true(hbuf_ok(&d, t2, 0, N));
    ft_redis_resume(&s);
    hbuf_free(&d);
    ferry_kv_close(a);
    ferry_kv_close(b);
    ft_redis_destroy(&s);
}

/* ---- configuration ---- */

static void bad_and_unreachable_remotes(void **state)
{
    (void)state;
    char url[128];
    ferry_kv_config c = remote_config(&g_srv, url, sizeof url, "cfg:", 4);
    ferry_kv *kv = NULL;
    c.remote_url = "redis://127.0.0.1:notaport";
    assert_int_equal(ferry_kv_open(&c, &kv), FERRY_EPARSE);
    c.remote_url = "rediss://127.0.0.1:6379";
    assert_int_equal(ferry_kv_open(&c, &kv), FERRY_ENOTSUP);
    c.remote_url = url;
    ferry_remote_options bad = g_ro;
    bad.size = 8;
    c.remote_options = &bad;
    assert_int_equal(ferry_kv_open(&c, &kv), -EINVAL);
    assert_null(kv);

    /* nobody listening: open fails, unless lazy */
    ft_redis s;
    assert_int_equal(ft_redis_start(&s, NULL), 0);
    char dead[128];
    ferry_kv_config d = remote_config(&s, dead, sizeof dead, "cfg:", 4);
    ft_redis_stop(&s);
    assert_int_equal(ferry_kv_open(&d, &kv), -ECONNREFUSED);
    assert_null(kv);
    g_ro.flags = FERRY_REMOTE_LAZY;
    FT_ASSERT_OK(ferry_kv_open(&d, &kv));
    enum { N = 2 * CT };
    int32_t t[N];
    make_tokens(t, N, 30);
    assert_int_equal(ferry_kv_lookup(kv, t, N, NULL), 0);
    store_prompt(kv, t, N, NULL);
    assert_int_equal(ferry_kv_lookup(kv, t, N, NULL), N);
    assert_int_equal(stats(kv).remote_down, 1);
    ferry_kv_close(kv);
    ft_redis_destroy(&s);
}

/* A chunk is one remote value: a geometry whose chunks would be over
 * Redis's 512 MiB string limit is refused at open, before anything is
 * allocated or connected, naming the chunk's size, the limit and the
 * largest chunk_tokens that fits; that one opens. */
static void chunks_over_the_value_limit_refused_at_open(void **state)
{
    (void)state;
    char url[128];
    ferry_kv_config c = remote_config(&g_srv, url, sizeof url, "big:", 1);
    uint64_t per = 0;
    FT_ASSERT_OK(ferry_kv_layout_chunk_bytes(&c.layout, 1, &per));
    c.chunk_tokens = (uint32_t)(FERRY_REMOTE_VALUE_MAX / per) + 1;
    c.l1_bytes = (uint64_t)c.chunk_tokens * per + 4096;
    ferry_kv *kv = NULL;
    assert_int_equal(ferry_kv_open(&c, &kv), -EINVAL);
    assert_null(kv);
    const char *msg = ferry_last_error();
    char bytes[32];
    snprintf(bytes, sizeof bytes, "%llu bytes", (unsigned long long)c.chunk_tokens * per);
    assert_non_null(strstr(msg, bytes));
    assert_non_null(strstr(msg, "536870912"));
    const char *at = strstr(msg, "chunk_tokens ");
    assert_non_null(at);
    unsigned long most = strtoul(at + strlen("chunk_tokens "), NULL, 10);
    assert_true(most > 0 && most < c.chunk_tokens);
    c.chunk_tokens = (uint32_t)most + 1;
    assert_int_equal(ferry_kv_open(&c, &kv), -EINVAL);
    c.chunk_tokens = (uint32_t)most;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv)); /* (its L1 is never touched here) */
    ferry_kv_close(kv);
}

/* the chunk_tokens the open-time refusal names as the most that fits */
static unsigned long named_most(void)
{
    const char *at = strstr(ferry_last_error(), "chunk_tokens ");
    assert_non_null(at);
    return strtoul(at + strlen("chunk_tokens "), NULL, 10);
}

/* The value's header holds chunk_tokens in decimal, so the most that fits
 * is counted with its own header: with one byte a token and a chunk of 10
 * digits of tokens, one of 9 digits has a header a byte shorter and one
 * token more fits. A token alone over the limit is said to be so, never
 * "chunk_tokens 0" (which asks for the default). */
static void largest_chunk_named_with_its_own_header(void **state)
{
    (void)state;
    char url[128];
    ferry_kv_config c = remote_config(&g_srv, url, sizeof url, "big1:", 1);
    ferry_kv_layout one = c.layout; /* one byte a token */
    one.num_layers = one.kv = one.num_heads = one.head_dim = 1;
    one.dtype = FERRY_DTYPE_U8;
    c.layout = one;
    c.chunk_tokens = 1000u * 1000u * 1000u;
    c.l1_bytes = (uint64_t)c.chunk_tokens + 4096;
    ferry_kv *kv = NULL;
    assert_int_equal(ferry_kv_open(&c, &kv), -EINVAL);
    unsigned long most = named_most();
    assert_true(most > 0 && most < FERRY_REMOTE_VALUE_MAX);
    c.chunk_tokens = (uint32_t)most + 1;
    c.l1_bytes = (uint64_t)c.chunk_tokens + 4096;
    assert_int_equal(ferry_kv_open(&c, &kv), -EINVAL);
    assert_null(kv);
    c.chunk_tokens = (uint32_t)most;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv)); /* (its L1 is never touched here) */
    ferry_kv_close(kv);
    kv = NULL;
    /* a token over the limit by itself */
    ferry_kv_layout wide = one;
    wide.head_dim = 600u * 1000u * 1000u;
    c.layout = wide;
    c.chunk_tokens = 1;
    c.l1_bytes = (uint64_t)wide.head_dim + 4096;
    assert_int_equal(ferry_kv_open(&c, &kv), -EINVAL);
    assert_null(kv);
    assert_null(strstr(ferry_last_error(), "chunk_tokens 0"));
    assert_non_null(strstr(ferry_last_error(), "600000000 bytes a token"));
}

/* ---- passwords, refused writes, killed servers ---- */

/* every log line (at trace level) that contains the needle */
typedef struct logcap {
    pthread_mutex_t mu;
    const char *needle;
    int lines, hits;
} logcap;

static void log_capture(int level, const char *msg, void *ctx)
{
    (void)level;
    logcap *c = ctx;
    pthread_mutex_lock(&c->mu);
    c->lines++;
    if (strstr(msg, c->needle))
        c->hits++;
    pthread_mutex_unlock(&c->mu);
}

/* A server with requirepass: the password never appears in
 * ferry_last_error() nor in any log line, whether it is wrong, right with
 * a database the server refuses, or missing (then the open fails naming
 * NOAUTH instead of dropping every write-through in silence). */
static void passwords_never_shown_and_noauth_fails_open(void **state)
{
    (void)state;
    static const char pw[] = "Sup3rS3cretPw";
    static const char *const args[] = {"--requirepass", pw, NULL};
    ft_redis s;
    assert_int_equal(ft_redis_start(&s, args), 0);
    logcap cap = {PTHREAD_MUTEX_INITIALIZER, pw, 0, 0};
    int level = ferry_log_get_level();
    ferry_log_set_level(FERRY_LOG_TRACE);
    ferry_log_set_callback(log_capture, &cap);

    char url[256], dummy[128];
    ferry_kv_config c = remote_config(&s, dummy, sizeof dummy, "pw:", 4);
    c.remote_url = url;
    ferry_kv *kv = NULL;
    /* a wrong password (it is quoted nowhere either) */
    snprintf(url, sizeof url, "redis://:Wr0ng%sX@127.0.0.1:%d/0", pw, s.port);
    assert_int_equal(ferry_kv_open(&c, &kv), FERRY_EREMOTE);
    assert_null(kv);
    assert_non_null(strstr(ferry_last_error(), "AUTH"));
    assert_null(strstr(ferry_last_error(), pw));
    assert_non_null(strstr(ferry_last_error(), "***"));
    /* the right one with a database the server does not have */
    snprintf(url, sizeof url, "redis://default:%s@127.0.0.1:%d/99", pw, s.port);
    assert_int_equal(ferry_kv_open(&c, &kv), FERRY_EREMOTE);
    assert_non_null(strstr(ferry_last_error(), "SELECT 99"));
    assert_null(strstr(ferry_last_error(), pw));
    /* the password as a query parameter */
    snprintf(url, sizeof url, "redis://127.0.0.1:%d/99?password=%s", s.port, pw);
    assert_int_equal(ferry_kv_open(&c, &kv), FERRY_EREMOTE);
    assert_null(strstr(ferry_last_error(), pw));
    /* none at all: the open fails now, naming the cause */
    snprintf(url, sizeof url, "redis://127.0.0.1:%d/0", s.port);
    assert_int_equal(ferry_kv_open(&c, &kv), FERRY_EREMOTE);
    assert_null(kv);
    assert_non_null(strstr(ferry_last_error(), "NOAUTH"));
    /* the right one: it works, and the server refusing writes later
     * (here: out of memory) is counted, not a silent drop */
    snprintf(url, sizeof url, "redis://:%s@127.0.0.1:%d/0", pw, s.port);
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    enum { N = 2 * CT };
    int32_t t[N];
    make_tokens(t, N, 70);
    store_prompt(kv, t, N, NULL);
    ferry_kv_stats m = stats(kv);
    assert_int_equal(m.remote_written, N / CT);
    assert_int_equal(m.remote_errors, 0);
    redisContext *rc = redisConnect("127.0.0.1", s.port);
    assert_non_null(rc);
    redisReply *rep = redisCommand(rc, "AUTH %s", pw);
    freeReplyObject(rep);
    rep = redisCommand(rc, "CONFIG SET maxmemory-policy noeviction");
    freeReplyObject(rep);
    rep = redisCommand(rc, "CONFIG SET maxmemory 1");
    assert_int_equal(rep->type, REDIS_REPLY_STATUS);
    freeReplyObject(rep);
    make_tokens(t, N, 71);
    store_prompt(kv, t, N, NULL);
    m = stats(kv);
    assert_int_equal(m.remote_written, N / CT);
    assert_true(m.remote_errors >= N / CT);
    assert_true(m.remote_dropped >= N / CT);
    rep = redisCommand(rc, "CONFIG SET maxmemory 0");
    freeReplyObject(rep);
    redisFree(rc);
    ferry_kv_close(kv);

    ferry_log_set_callback(NULL, NULL);
    ferry_log_set_level(level);
    assert_true(cap.lines > 0); /* the hook saw the failures */
    assert_int_equal(cap.hits, 0);
    ft_redis_destroy(&s);
}

/* Each time the server is killed under a store, the store's own
 * remote_errors moves (the remote module counted the failures; the KV
 * metrics did not use to show them). */
static void server_kills_count_in_remote_errors(void **state)
{
    (void)state;
    ft_redis s;
    assert_int_equal(ft_redis_start(&s, NULL), 0);
    char url[128];
    ferry_kv_config c = remote_config(&s, url, sizeof url, "kill:", 16);
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    enum { N = 2 * CT };
    int32_t t[N];
    uint64_t before = stats(kv).remote_errors;
    assert_int_equal(before, 0);
    for (unsigned round = 0; round < 3; round++) {
        make_tokens(t, N, 80 + round);
        store_prompt(kv, t, N, NULL);
        assert_int_equal(kill(s.pid, SIGKILL), 0);
        waitpid(s.pid, NULL, 0);
        s.pid = 0;
        make_tokens(t, N, 90 + round);
        assert_int_equal(ferry_kv_lookup(kv, t, N, NULL), 0); /* asks, finds it dead */
        uint64_t now = stats(kv).remote_errors;
        assert_true(now > before);
        before = now;
        assert_int_equal(stats(kv).remote_down, 1);
        assert_int_equal(ft_redis_restart(&s), 0);
        assert_true(wait_remote_up(kv, 100 + round));
    }
    ferry_kv_close(kv);
    ft_redis_destroy(&s);
}

static void metrics_and_prometheus(void **state)
{
    (void)state;
    ferry_kv *a = open_store(&g_srv, "prom:", 8);
    enum { N = 2 * CT };
    int32_t t[N];
    make_tokens(t, N, 31);
    store_prompt(a, t, N, NULL);
    ferry_kv *b = open_store(&g_srv, "prom:", 8);
    assert_int_equal(ferry_kv_lookup(b, t, N, NULL), N);
    char buf[65536];
    int len = ferry_kv_metrics_prometheus(b, buf, sizeof buf);
    assert_true(len > 0 && (size_t)len < sizeof buf);
    assert_non_null(strstr(buf, "ferry_kv_remote_lookups_total 1\n"));
    assert_non_null(strstr(buf, "ferry_kv_remote_found_chunks_total 2\n"));
    assert_non_null(strstr(buf, "ferry_kv_remote_down 0\n"));
    assert_non_null(strstr(buf, "ferry_kv_tier_hits_total{tier=\"remote\"} 2\n"));
    assert_non_null(strstr(buf, "ferry_kv_tier_chunks{tier=\"remote\"} 2\n"));
    ferry_kv_close(a);
    ferry_kv_close(b);
}

/* the index remembers a bounded number of remote-only chunks */
static void remote_index_is_bounded(void **state)
{
    (void)state;
    const char *pfx = "bound:";
    ferry_kv *a = open_store(&g_srv, pfx, 32);
    char url[128];
    ferry_kv_config c = remote_config(&g_srv, url, sizeof url, pfx, 32);
    c.remote_index_chunks = 10;
    ferry_kv *b = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &b));
    hbuf d;
    hbuf_init(&d, 4 * CT);
    for (unsigned p = 0; p < 6; p++) {
        int32_t t[4 * CT];
        make_tokens(t, 4 * CT, 40 + p);
        store_prompt(a, t, 4 * CT, NULL);
        assert_int_equal(ferry_kv_lookup(b, t, 4 * CT, NULL), 4 * CT);
        assert_true(stats(b).tier[FERRY_KV_TIER_REMOTE].chunks <= 10);
    }
    /* a forgotten chunk is asked about again and still found */
    int32_t t0[4 * CT];
    make_tokens(t0, 4 * CT, 40);
    assert_int_equal(ferry_kv_retrieve(b, t0, 4 * CT, NULL, &d.b), 4 * CT);
    assert_true(hbuf_ok(&d, t0, 0, 4 * CT));
    assert_true(stats(b).tier[FERRY_KV_TIER_REMOTE].evictions > 0);
    FT_ASSERT_OK(ferry__kv_check(b));
    hbuf_free(&d);
    ferry_kv_close(a);
    ferry_kv_close(b);
}

typedef struct oom_remote_ctx {
    const char *pfx;
    const int32_t *t;
    hbuf *d;
    int opened;
} oom_remote_ctx;

/* open, look up and retrieve the remote chunks with allocation n failing */
static int oom_remote_run(void *arg)
{
    enum { N = 3 * CT };
    oom_remote_ctx *x = arg;
    char url[128];
    ferry_kv_config c = remote_config(&g_srv, url, sizeof url, x->pfx, 8);
    ferry_kv *kv = NULL;
    int rc = ferry_kv_open(&c, &kv);
    if (rc < 0) {
        assert_int_equal(rc, -ENOMEM);
        assert_null(kv);
        return rc;
    }
    x->opened++;
    int lead = ferry_kv_lookup(kv, x->t, N, NULL);
    assert_true(lead >= 0 && lead <= N && lead % CT == 0);
    memset(x->d->mem, 0xEE, PLANES * N * TB);
    int got = ferry_kv_retrieve(kv, x->t, N, NULL, &x->d->b);
    if (got < 0)
        assert_int_equal(got, -ENOMEM);
    else
        assert_true(hbuf_ok(x->d, x->t, 0, (size_t)got));
    FT_ASSERT_OK(ferry__kv_check(kv));
    if (ft_alloc_failures() == 0) { /* the clean run finds and loads every chunk */
        assert_int_equal(lead, N);
        assert_int_equal(got, N);
    }
    ferry_kv_close(kv);
    return got;
}

/* an allocation failure anywhere in open, lookup or retrieve of remote
 * chunks: a clear code or a miss, never wrong bytes, nothing leaked */
static void out_of_memory_anywhere(void **state)
{
    (void)state;
    const char *pfx = "oom:";
    ferry_kv *a = open_store(&g_srv, pfx, 16);
    enum { N = 3 * CT };
    int32_t t[N];
    make_tokens(t, N, 60);
    store_prompt(a, t, N, NULL);
    ferry_kv_close(a);
    hbuf d;
    hbuf_init(&d, N);
    oom_remote_ctx x = {pfx, t, &d, 0};
    ft_oom_each(600, 0, oom_remote_run, &x);
    assert_true(x.opened > 0);
    hbuf_free(&d);
}

/* ---- threads: one store writes, another reads what lands ---- */

enum { TP = 16, TN = 4 * CT };

typedef struct share_ctx {
    ferry_kv *a, *b;
    int32_t tok[TP][TN];
    int bad;
    long reads_ok;
} share_ctx;

static void *writer_thread(void *p)
{
    share_ctx *x = p;
    hbuf h;
    hbuf_init(&h, TN);
    for (int i = 0; i < TP; i++) {
        hbuf_fill(&h, x->tok[i], TN);
        if (ferry_kv_store(x->a, x->tok[i], TN, NULL, &h.b) != TN)
            __atomic_store_n(&x->bad, 1, __ATOMIC_RELAXED);
    }
    hbuf_free(&h);
    return NULL;
}

static void *reader_thread(void *p)
{
    share_ctx *x = p;
    hbuf h;
    hbuf_init(&h, TN);
    for (int round = 0; round < 3; round++) {
        for (int i = 0; i < TP; i++) {
            int hit = ferry_kv_lookup(x->b, x->tok[i], TN, NULL);
            if (hit < 0 || hit % CT) {
                __atomic_store_n(&x->bad, 2, __ATOMIC_RELAXED);
                continue;
            }
            int got = ferry_kv_retrieve(x->b, x->tok[i], TN, NULL, &h.b);
            if (got < 0 || !hbuf_ok(&h, x->tok[i], 0, (size_t)got))
                __atomic_store_n(&x->bad, 3, __ATOMIC_RELAXED);
            else if (got > 0)
                __atomic_add_fetch(&x->reads_ok, 1, __ATOMIC_RELAXED);
        }
    }
    hbuf_free(&h);
    return NULL;
}

static void threads_share_through_the_server(void **state)
{
    (void)state;
    share_ctx *x = calloc(1, sizeof *x);
    assert_non_null(x);
    const char *pfx = "threads:";
    x->a = open_store(&g_srv, pfx, 24);
    x->b = open_store(&g_srv, pfx, 6); /* small: its chunks go and come back */
    for (int i = 0; i < TP; i++)
        make_tokens(x->tok[i], TN, 100 + (unsigned)i);
    pthread_t w, r[2];
    assert_int_equal(pthread_create(&w, NULL, writer_thread, x), 0);
    for (int i = 0; i < 2; i++)
        assert_int_equal(pthread_create(&r[i], NULL, reader_thread, x), 0);
    pthread_join(w, NULL);
    for (int i = 0; i < 2; i++)
        pthread_join(r[i], NULL);
    assert_int_equal(x->bad, 0);
    FT_ASSERT_OK(ferry_kv_flush(x->a));
    /* everything landed: b finds and returns every prompt */
    hbuf h;
    hbuf_init(&h, TN);
    for (int i = 0; i < TP; i++) {
        assert_int_equal(ferry_kv_retrieve(x->b, x->tok[i], TN, NULL, &h.b), TN);
        assert_true(hbuf_ok(&h, x->tok[i], 0, TN));
    }
    FT_ASSERT_OK(ferry__kv_check(x->a));
    FT_ASSERT_OK(ferry__kv_check(x->b));
    hbuf_free(&h);
    ferry_kv_close(x->a);
    ferry_kv_close(x->b);
    free(x);
}

/* ---- two layouts on one prefix, under threads and a vandal ---- */

#define DN (4 * CT)
typedef struct dual_ctx {
    ferry_kv *kv[2]; /* bf16 and f16: the same chunk size, the same keys */
    int32_t tok[DN];
    const ft_redis *srv;
    atomic_int stop, round;
    atomic_long bad, hits, misses;
} dual_ctx;

typedef struct dual_arg {
    dual_ctx *x;
    int which;
} dual_arg;

static void dual_fill(hbuf *h, const int32_t *t, int which)
{
    hbuf_fill(h, t, DN);
    if (which)
        for (size_t i = 0; i < PLANES * h->cap * TB; i++)
            h->mem[i] ^= 0x5A;
}

/* chunk c of h holds exactly layout which's bytes */
static int dual_ok(const hbuf *h, const int32_t *t, int which, size_t c)
{
    for (unsigned k = 0; k < PLANES; k++)
        for (size_t p = c * CT; p < (c + 1) * CT; p++)
            for (unsigned b = 0; b < TB; b++)
                if (h->mem[((size_t)k * h->cap + p) * TB + b] !=
                    (unsigned char)(kv_byte(t, p, k, b) ^ (which ? 0x5A : 0)))
                    return 0;
    return 1;
}

static void *dual_thread(void *arg)
{
    dual_arg *a = arg;
    dual_ctx *x = a->x;
    ferry_kv *kv = x->kv[a->which];
    hbuf src, d;
    hbuf_init(&src, DN);
    dual_fill(&src, x->tok, a->which);
    src.b.layout.dtype = a->which ? FERRY_DTYPE_F16 : FERRY_DTYPE_BF16;
    while (!atomic_load(&x->stop)) {
        ferry_kv_store(kv, x->tok, DN, NULL, &src.b);
        if (atomic_fetch_add(&x->round, 1) % 3 == 0)
            ferry_kv_clear(kv); /* the next retrieve goes to the server */
        hbuf_init(&d, DN);
        d.b.layout.dtype = src.b.layout.dtype;
        int st[4];
        ferry_kv_req req = FERRY_KV_REQ_INIT;
        req.status = st;
        req.max_chunks = 4;
        int rc = ferry_kv_retrieve(kv, x->tok, DN, &req, &d.b);
        for (size_t c = 0; rc >= 0 && c < 4; c++) {
            if (st[c] == 0 && !dual_ok(&d, x->tok, a->which, c))
                atomic_fetch_add(&x->bad, 1);
            else if (st[c] == 0)
                atomic_fetch_add(&x->hits, 1);
            else if (!hbuf_untouched(&d, c * CT, (c + 1) * CT))
                atomic_fetch_add(&x->bad, 1);
            else
                atomic_fetch_add(&x->misses, 1);
        }
        hbuf_free(&d);
    }
    hbuf_free(&src);
    return NULL;
}

static void *dual_vandal(void *arg)
{
    dual_ctx *x = arg;
    unsigned seed = 3;
    while (!atomic_load(&x->stop)) {
        char key[128];
        chunk_key("dual:", x->tok, DN, (size_t)rand_r(&seed) % 4, key, sizeof key);
        const char *setrange[] = {"SETRANGE", key, "2000", "XX", NULL};
        const char *del[] = {"DEL", key, NULL};
        const char *flush[] = {"FLUSHALL", NULL};
        int r = rand_r(&seed) % 10;
        ft_redis_cmd(x->srv, NULL, 0, r < 4 ? setrange : r < 9 ? del : flush);
        sleep_ms(2);
    }
    return NULL;
}

/* Stores of two layouts with the same chunk size (bf16, f16) share one
 * server and key prefix; the same tokens give them the same keys. Threads
 * of each store and retrieve them over and over (clearing their local
 * tiers so reads go to the server) while a vandal damages, deletes and
 * flushes the values: a chunk a retrieve reports is exactly its own
 * layout's bytes, every other chunk untouched. */
static void two_layouts_one_prefix_under_threads(void **state)
{
    (void)state;
    dual_ctx *x = calloc(1, sizeof *x);
    assert_non_null(x);
    x->srv = &g_srv;
    make_tokens(x->tok, DN, 55);
    for (int i = 0; i < 2; i++) {
        char url[128];
        ferry_kv_config c = remote_config(&g_srv, url, sizeof url, "dual:", 16);
        c.layout.dtype = i ? FERRY_DTYPE_F16 : FERRY_DTYPE_BF16;
        FT_ASSERT_OK(ferry_kv_open(&c, &x->kv[i]));
    }
    assert_int_equal(ferry_kv_chunk_bytes(x->kv[0]), ferry_kv_chunk_bytes(x->kv[1]));
    pthread_t th[5];
    dual_arg args[4];
    for (int i = 0; i < 4; i++) {
        args[i].x = x;
        args[i].which = i % 2;
        assert_int_equal(pthread_create(&th[i], NULL, dual_thread, &args[i]), 0);
    }
    assert_int_equal(pthread_create(&th[4], NULL, dual_vandal, x), 0);
    sleep_ms(2500);
    atomic_store(&x->stop, 1);
    for (int i = 0; i < 5; i++)
        pthread_join(th[i], NULL);
    fprintf(stderr, "two layouts: %ld chunks read, %ld misses, %ld wrong\n",
            (long)atomic_load(&x->hits), (long)atomic_load(&x->misses),
            (long)atomic_load(&x->bad));
    assert_int_equal(atomic_load(&x->bad), 0);
    assert_true(atomic_load(&x->hits) > 0);
    assert_true(stats(x->kv[0]).remote_refused + stats(x->kv[1]).remote_refused > 0);
    for (int i = 0; i < 2; i++) {
        FT_ASSERT_OK(ferry__kv_check(x->kv[i]));
        ferry_kv_close(x->kv[i]);
    }
    free(x);
}

static int srv_setup(void **state)
{
    (void)state;
    return ft_redis_start(&g_srv, NULL) == 0 ? 0 : -1;
}

static int srv_teardown(void **state)
{
    (void)state;
    ft_redis_destroy(&g_srv);
    return 0;
}

int main(void)
{
    if (!ft_redis_available()) {
        fprintf(stderr, "redis-server not installed: skipping\n");
        return 77;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(two_processes_share_chunks), /* first: forks before any thread */
        cmocka_unit_test(stores_share_chunks),
        cmocka_unit_test(retrieve_without_lookup_and_prefetch),
        cmocka_unit_test(local_prefix_then_remote_rest),
        cmocka_unit_test(salts_isolate_tenants),
        cmocka_unit_test(other_layout_is_refused),
        cmocka_unit_test(damaged_value_is_a_miss_for_that_chunk),
        cmocka_unit_test(delete_removes_remote_copies),
        cmocka_unit_test(stopped_server_degrades_then_recovers),
        cmocka_unit_test(hung_server_answers_misses),
        cmocka_unit_test(bad_and_unreachable_remotes),
        cmocka_unit_test(chunks_over_the_value_limit_refused_at_open),
        cmocka_unit_test(largest_chunk_named_with_its_own_header),
        cmocka_unit_test(passwords_never_shown_and_noauth_fails_open),
        cmocka_unit_test(server_kills_count_in_remote_errors),
        cmocka_unit_test(metrics_and_prometheus),
        cmocka_unit_test(remote_index_is_bounded),
        cmocka_unit_test(out_of_memory_anywhere),
        cmocka_unit_test(threads_share_through_the_server),
        cmocka_unit_test(two_layouts_one_prefix_under_threads),
    };
    return cmocka_run_group_tests_name("kv_remote", tests, srv_setup, srv_teardown);
}
