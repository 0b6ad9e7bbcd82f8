/*
 * test_tier_promises.c - the lower tiers' promises as an outside user of
 * the public API meets them, bytes compared: a persistent L2 whose owner
 * was killed after ferry_kv_sync gives back every synced chunk; the remote
 * tier's TTL reaches every chunk key a store writes; a server restarted
 * empty between a lookup and a retrieve, or a value copied from another
 * chunk's key, is a miss that leaves the destination untouched; a unix://
 * URL with a database number works end to end; a bad URL is named
 * without its password. The remote tests skip (their bodies pass) when
 * redis-server is not installed.
 */
/* ferry-test-timeout: 300 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <hiredis/hiredis.h>

#include "ferry/kv.h"
#include "ferry/remote.h"
#include "ferry_test.h"
#include "redis_server.h"

/* 64 bytes per token and plane, 16-token chunks of 4 KiB */
#define CT 16
#define TB 64u
#define PLANES 4u
#define CHUNK (PLANES * CT * TB)
#define MODEL "tier-promises-model"

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

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

static unsigned char kv_byte(const int32_t *t, size_t p, unsigned plane, unsigned b)
{
    return (unsigned char)((uint32_t)t[p] * 131u + (uint32_t)p * 7u + plane * 13u + b);
}

typedef struct hbuf {
    ferry_kv_buffer b;
    unsigned char *mem;
    uint64_t cap;
} hbuf;

static void hbuf_init(hbuf *h, uint64_t cap)
{
    h->cap = cap;
    h->mem = malloc(PLANES * cap * TB);
    assert_non_null(h->mem);
    memset(h->mem, 0xEE, PLANES * cap * TB);
    h->b = ft_kv_host_buffer(h->mem, cap, TB);
}

static void hbuf_fill(hbuf *h, const int32_t *t, size_t n)
{
    for (unsigned k = 0; k < PLANES; k++)
        for (size_t p = 0; p < n; p++)
            for (unsigned b = 0; b < TB; b++)
                h->mem[((size_t)k * h->cap + p) * TB + b] = kv_byte(t, p, k, b);
}

static int hbuf_ok(const hbuf *h, const int32_t *t, size_t from, size_t to)
{
    for (unsigned k = 0; k < PLANES; k++)
        for (size_t p = from; p < to; p++)
            for (unsigned b = 0; b < TB; b++)
                if (h->mem[((size_t)k * h->cap + p) * TB + b] != kv_byte(t, p, k, b))
                    return 0;
    return 1;
}

static int hbuf_untouched(const hbuf *h, size_t from, size_t to)
{
    for (unsigned k = 0; k < PLANES; k++)
        for (size_t p = from; p < to; p++)
            for (unsigned b = 0; b < TB; b++)
                if (h->mem[((size_t)k * h->cap + p) * TB + b] != 0xEE)
                    return 0;
    return 1;
}

static int store_prompt(ferry_kv *kv, const int32_t *t, size_t n)
{
    hbuf h;
    hbuf_init(&h, n);
    hbuf_fill(&h, t, n);
    int rc = ferry_kv_store(kv, t, n, NULL, &h.b);
    free(h.mem);
    return rc;
}

static ferry_kv_stats stats(ferry_kv *kv)
{
    ferry_kv_stats m = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(kv, &m));
    return m;
}

/* ---- persistent L2 ---- */

static ferry_kv_config pslab_config(const char *dir)
{
    ferry_kv_config c = FERRY_KV_CONFIG_INIT;
    c.model = MODEL;
    c.layout = ft_kv_layout(TB);
    c.chunk_tokens = CT;
    c.l1_bytes = 4 * CHUNK;
    c.workers = 2;
    c.l2_dir = dir;
    c.l2_bytes = 64 * CHUNK;
    c.l2_engine = "posix";
    c.l2_persistent = 1;
    return c;
}

/* A process stores, syncs (told every chunk is durable), stores more and
 * is killed without closing: the next open of the directory finds every
 * synced chunk, byte for byte, and the unsynced ones are whole or misses. */
static void synced_chunks_survive_a_killed_owner(void **state)
{
    (void)state;
    char dir[256];
    ft_tmpdir(dir, sizeof dir);
    enum { N = 8 * CT, M = 4 * CT };
    int32_t t[N], u[M];
    make_tokens(t, N, 7);
    make_tokens(u, M, 8);
    int fds[2];
    assert_int_equal(pipe(fds), 0);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        close(fds[0]);
        ferry_kv_config c = pslab_config(dir);
        ferry_kv *kv = NULL;
        if (ferry_kv_open(&c, &kv) != 0)
            _exit(2);
        if (store_prompt(kv, t, N) != N)
            _exit(3);
        int synced = ferry_kv_sync(kv);
        if (synced != N / CT) {
            fprintf(stderr, "sync -> %d: %s\n", synced, ferry_last_error());
            _exit(4);
        }
        store_prompt(kv, u, M); /* not synced: may or may not survive */
        char ok = 1;
        if (write(fds[1], &ok, 1) != 1)
            _exit(5);
        raise(SIGKILL);
        _exit(6);
    }
    close(fds[1]);
    char ok = 0;
    assert_int_equal(read(fds[0], &ok, 1), 1);
    close(fds[0]);
    int ws = 0;
    assert_int_equal(waitpid(pid, &ws, 0), pid);
    assert_true(WIFSIGNALED(ws) && WTERMSIG(ws) == SIGKILL);

    ferry_kv_config c = pslab_config(dir);
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv)); /* the dead owner's lock is gone */
    assert_int_equal(ferry_kv_lookup(kv, t, N, NULL), N);
    hbuf d;
    hbuf_init(&d, N);
    assert_int_equal(ferry_kv_retrieve(kv, t, N, NULL, &d.b), N);
    assert_true(hbuf_ok(&d, t, 0, N));
    free(d.mem);
    /* the unsynced prompt: a leading run of whole chunks, the rest untouched */
    hbuf_init(&d, M);
    int got = ferry_kv_retrieve(kv, u, M, NULL, &d.b);
    assert_true(got >= 0 && got <= M && got % CT == 0);
    assert_true(hbuf_ok(&d, u, 0, (size_t)got));
    assert_true(hbuf_untouched(&d, (size_t)got, M));
    free(d.mem);
    assert_int_equal(stats(kv).corrupt_chunks, 0);
    ferry_kv_close(kv);
    ft_rmtree(dir);
}

/* the slab's size changes between runs: a chunk found is the chunk stored,
 * byte for byte, whatever the new size keeps */
static void reopen_with_another_l2_size_never_gives_other_bytes(void **state)
{
    (void)state;
    char dir[256];
    ft_tmpdir(dir, sizeof dir);
    enum { N = 12 * CT };
    int32_t t[N];
    make_tokens(t, N, 61);
    ferry_kv_config c = pslab_config(dir);
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    assert_int_equal(store_prompt(kv, t, N), N);
    assert_int_equal(ferry_kv_sync(kv), N / CT);
    ferry_kv_close(kv);
    static const uint64_t sizes[] = {4 * CHUNK, 128 * CHUNK, 64 * CHUNK};
    for (size_t i = 0; i < 3; i++) {
        c.l2_bytes = sizes[i];
        kv = NULL;
        int rc = ferry_kv_open(&c, &kv);
        if (rc)
            fail_msg("l2_bytes %llu: %d %s", (unsigned long long)sizes[i], rc,
                     ferry_last_error());
        hbuf d;
        hbuf_init(&d, N);
        int got = ferry_kv_retrieve(kv, t, N, NULL, &d.b);
        assert_true(got >= 0 && got % CT == 0);
        assert_true(hbuf_ok(&d, t, 0, (size_t)got));
        assert_true(hbuf_untouched(&d, (size_t)got, N));
        free(d.mem);
        ferry_kv_stats m = stats(kv);
        assert_int_equal(m.corrupt_chunks, 0);
        /* the slab keeps the size it was made with */
        assert_int_equal(m.tier[FERRY_KV_TIER_L2].capacity_bytes, 64 * CHUNK);
        ferry_kv_close(kv);
    }
    /* l2_reset makes it anew at the configured size, empty */
    c.l2_bytes = 32 * CHUNK;
    c.l2_reset = 1;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    assert_int_equal(stats(kv).tier[FERRY_KV_TIER_L2].capacity_bytes, 32 * CHUNK);
    assert_int_equal(ferry_kv_lookup(kv, t, N, NULL), 0);
    ferry_kv_close(kv);
    ft_rmtree(dir);
}

/* an L2 larger than the disk: the open fails naming the file, size and
 * cause, and leaves the directory to a later open of a size that fits */
static void l2_larger_than_the_disk_fails_and_leaves_room(void **state)
{
    (void)state;
    char dir[256];
    ft_tmpdir(dir, sizeof dir);
    for (int persistent = 1; persistent >= 0; persistent--) {
        ferry_kv_config c = pslab_config(dir);
        c.l2_persistent = persistent;
        c.l2_bytes = (uint64_t)1 << 43; /* 8 TiB: more than the test disk */
        ferry_kv *kv = NULL;
        int rc = ferry_kv_open(&c, &kv);
        assert_true(rc < 0);
        assert_null(kv);
        const char *msg = ferry_last_error();
        if (!strstr(msg, dir) || !strstr(msg, "bytes") ||
            (!strstr(msg, "ENOSPC") && !strstr(msg, "EFBIG") && !strstr(msg, "space")))
            fail_msg("persistent %d: %d '%s'", persistent, rc, msg);
        /* the same directory with a size that fits works, bytes compared */
        c.l2_bytes = 64 * CHUNK;
        FT_ASSERT_OK(ferry_kv_open(&c, &kv));
        int32_t t[4 * CT];
        make_tokens(t, 4 * CT, 70 + (unsigned)persistent);
        assert_int_equal(store_prompt(kv, t, 4 * CT), 4 * CT);
        FT_ASSERT_OK(ferry_kv_flush(kv));
        hbuf d;
        hbuf_init(&d, 4 * CT);
        assert_int_equal(ferry_kv_retrieve(kv, t, 4 * CT, NULL, &d.b), 4 * CT);
        assert_true(hbuf_ok(&d, t, 0, 4 * CT));
        free(d.mem);
        ferry_kv_close(kv);
    }
    ft_rmtree(dir);
}

/* ---- remote tier ---- */

static ferry_remote_options g_ro;

static ferry_kv_config remote_config(const char *url, const char *prefix)
{
    ferry_remote_options o = FERRY_REMOTE_OPTIONS_INIT;
    o.connect_timeout_ms = 300;
    o.command_timeout_ms = 300;
    o.backoff_initial_ms = 20;
    o.backoff_max_ms = 100;
    o.key_prefix = prefix;
    g_ro = o;
    ferry_kv_config c = FERRY_KV_CONFIG_INIT;
    c.model = MODEL;
    c.layout = ft_kv_layout(TB);
    c.chunk_tokens = CT;
    c.l1_bytes = 16 * CHUNK;
    c.workers = 2;
    c.remote_url = url;
    c.remote_options = &g_ro;
    return c;
}

/* remote_config for the server s, its database 0 */
static ferry_kv_config remote_config_of(const ft_redis *s, const char *prefix)
{
    static char url[128];
    return remote_config(ft_redis_url(s, 0, url, sizeof url), prefix);
}

/* the keys under prefix, sorted; returns how many (at most max) */
static int list_keys(const ft_redis *s, const char *prefix, char keys[][96], int max)
{
    redisContext *rc = redisConnect("127.0.0.1", s->port);
    assert_true(rc && !rc->err);
    redisReply *rep = redisCommand(rc, "KEYS %s*", prefix);
    assert_non_null(rep);
    assert_int_equal(rep->type, REDIS_REPLY_ARRAY);
    int n = 0;
    for (size_t i = 0; i < rep->elements && n < max; i++)
        snprintf(keys[n++], 96, "%s", rep->element[i]->str);
    freeReplyObject(rep);
    redisFree(rc);
    return n;
}

static long long key_ttl(const ft_redis *s, const char *key)
{
    const char *argv[] = {"TTL", key, NULL};
    char out[32];
    assert_int_equal(ft_redis_cmd(s, out, sizeof out, argv), REDIS_REPLY_INTEGER);
    return atoll(out);
}

/* remote_options.ttl_s: every chunk a store writes through expires */
static void remote_ttl_reaches_every_chunk_key(void **state)
{
    ft_redis *s = *state;
    if (!s)
        return;
    ferry_kv_config c = remote_config_of(s, "ttl:");
    g_ro.ttl_s = 1000;
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    enum { N = 5 * CT };
    int32_t t[N];
    make_tokens(t, N, 11);
    assert_int_equal(store_prompt(kv, t, N), N);
    FT_ASSERT_OK(ferry_kv_flush(kv));
    char keys[8][96];
    assert_int_equal(list_keys(s, "ttl:", keys, 8), N / CT);
    for (int i = 0; i < N / CT; i++) {
        long long ttl = key_ttl(s, keys[i]);
        if (!(ttl > 900 && ttl <= 1000))
            fail_msg("%s: TTL %lld, expected 900..1000", keys[i], ttl);
    }
    ferry_kv_close(kv);
}

/* ttl_s 1: once the values expired, a store that had indexed them as
 * remote-resident misses each chunk, its buffer untouched, and a new
 * store's lookup finds none */
static void expired_values_are_misses(void **state)
{
    ft_redis *s = *state;
    if (!s)
        return;
    ferry_kv_config c = remote_config_of(s, "exp:");
    g_ro.ttl_s = 1;
    ferry_kv *a = NULL, *b = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &a));
    FT_ASSERT_OK(ferry_kv_open(&c, &b));
    enum { N = 3 * CT };
    int32_t t[N];
    make_tokens(t, N, 81);
    assert_int_equal(store_prompt(a, t, N), N);
    FT_ASSERT_OK(ferry_kv_flush(a));
    assert_int_equal(ferry_kv_lookup(b, t, N, NULL), N);
    sleep_ms(2200);
    hbuf d;
    hbuf_init(&d, N);
    assert_int_equal(ferry_kv_retrieve(b, t, N, NULL, &d.b), 0);
    assert_true(hbuf_untouched(&d, 0, N));
    free(d.mem);
    ferry_kv *n = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &n));
    assert_int_equal(ferry_kv_lookup(n, t, N, NULL), 0);
    assert_int_equal(ferry_kv_lookup(b, t, N, NULL), 0);
    ferry_kv_close(n);
    ferry_kv_close(a);
    ferry_kv_close(b);
}

/* b indexes a's chunks as remote; the server restarts empty; b's retrieve
 * is a miss for each chunk, its buffer untouched, and b's next lookup no
 * longer claims them */
static void server_restarted_empty_between_lookup_and_retrieve(void **state)
{
    ft_redis *s = *state;
    if (!s)
        return;
    ferry_kv_config c = remote_config_of(s, "rst:");
    ferry_kv *a = NULL, *b = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &a));
    FT_ASSERT_OK(ferry_kv_open(&c, &b));
    enum { N = 4 * CT };
    int32_t t[N];
    make_tokens(t, N, 21);
    assert_int_equal(store_prompt(a, t, N), N);
    FT_ASSERT_OK(ferry_kv_flush(a));
    uint8_t tiers[4];
    ferry_kv_req r = FERRY_KV_REQ_INIT;
    r.tiers = tiers;
    r.max_chunks = 4;
    assert_int_equal(ferry_kv_lookup(b, t, N, &r), N);
    for (int i = 0; i < 4; i++)
        assert_int_equal(tiers[i], FERRY_KV_TIER_REMOTE);
    ft_redis_stop(s);
    assert_int_equal(ft_redis_restart(s), 0);
    hbuf d;
    hbuf_init(&d, N);
    int st[4];
    ferry_kv_req q = FERRY_KV_REQ_INIT;
    q.status = st;
    q.max_chunks = 4;
    int got = -1;
    /* the first call may find the connection dead and the remote down */
    for (int i = 0; i < 50; i++) {
        got = ferry_kv_retrieve(b, t, N, &q, &d.b);
        assert_int_equal(got, 0);
        assert_true(hbuf_untouched(&d, 0, N));
        if (stats(b).remote_down == 0)
            break;
        sleep_ms(20);
    }
    assert_int_equal(stats(b).remote_down, 0);
    for (int i = 0; i < 4; i++)
        assert_int_equal(st[i], FERRY_ENOTFOUND);
    assert_int_equal(ferry_kv_lookup(b, t, N, NULL), 0);
    free(d.mem);
    ferry_kv_close(a);
    ferry_kv_close(b);
}

/* another chunk's value copied under a chunk's key (same layout, same
 * prefix): a miss for that chunk, never the other chunk's bytes */
static void value_copied_from_another_key_is_a_miss(void **state)
{
    ft_redis *s = *state;
    if (!s)
        return;
    ferry_kv_config c = remote_config_of(s, "cp:");
    ferry_kv *a = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &a));
    int32_t t1[CT], t2[CT];
    make_tokens(t1, CT, 31);
    make_tokens(t2, CT, 32);
    char k1[1][96], k2[2][96];
    assert_int_equal(store_prompt(a, t1, CT), CT);
    FT_ASSERT_OK(ferry_kv_flush(a));
    assert_int_equal(list_keys(s, "cp:", k1, 1), 1);
    assert_int_equal(store_prompt(a, t2, CT), CT);
    FT_ASSERT_OK(ferry_kv_flush(a));
    assert_int_equal(list_keys(s, "cp:", k2, 2), 2);
    const char *other = strcmp(k2[0], k1[0]) ? k2[0] : k2[1];
    const char *copy[] = {"COPY", other, k1[0], "REPLACE", NULL};
    char out[32];
    assert_int_equal(ft_redis_cmd(s, out, sizeof out, copy), REDIS_REPLY_INTEGER);
    ferry_kv *b = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &b));
    hbuf d;
    hbuf_init(&d, CT);
    assert_int_equal(ferry_kv_retrieve(b, t1, CT, NULL, &d.b), 0);
    assert_true(hbuf_untouched(&d, 0, CT));
    ferry_kv_stats mb = stats(b);
    if (mb.remote_refused < 1)
        fail_msg("refused %llu misses %llu gets %llu lookups %llu found %llu errors %llu: %s",
                 (unsigned long long)mb.remote_refused, (unsigned long long)mb.remote_misses,
                 (unsigned long long)mb.remote_gets, (unsigned long long)mb.remote_lookups,
                 (unsigned long long)mb.remote_found_chunks,
                 (unsigned long long)mb.remote_errors, ferry_last_error());
    /* the source chunk itself still reads back */
    assert_int_equal(ferry_kv_retrieve(b, t2, CT, NULL, &d.b), CT);
    assert_true(hbuf_ok(&d, t2, 0, CT));
    free(d.mem);
    ferry_kv_close(a);
    ferry_kv_close(b);
}

/* unix:// with a database number: shared end to end, and only in that db */
static void unix_socket_url_with_a_database(void **state)
{
    ft_redis *s = *state;
    if (!s)
        return;
    char url[512];
    snprintf(url, sizeof url, "unix://%s?db=3", s->sock);
    ferry_kv_config c = remote_config(url, "ux:");
    ferry_kv *a = NULL, *b = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &a));
    FT_ASSERT_OK(ferry_kv_open(&c, &b));
    enum { N = 3 * CT };
    int32_t t[N];
    make_tokens(t, N, 41);
    assert_int_equal(store_prompt(a, t, N), N);
    FT_ASSERT_OK(ferry_kv_flush(a));
    hbuf d;
    hbuf_init(&d, N);
    assert_int_equal(ferry_kv_retrieve(b, t, N, NULL, &d.b), N);
    assert_true(hbuf_ok(&d, t, 0, N));
    free(d.mem);
    /* db 3 holds them, db 0 does not */
    redisContext *rc = redisConnect("127.0.0.1", s->port);
    assert_true(rc && !rc->err);
    redisReply *rep = redisCommand(rc, "DBSIZE");
    assert_int_equal(rep->integer, 0);
    freeReplyObject(rep);
    freeReplyObject(redisCommand(rc, "SELECT 3"));
    rep = redisCommand(rc, "DBSIZE");
    assert_int_equal(rep->integer, N / CT);
    freeReplyObject(rep);
    redisFree(rc);
    ferry_kv_close(a);
    ferry_kv_close(b);
}

/* a bad URL fails the open naming what is wrong, never the password */
static void bad_url_is_named_without_its_password(void **state)
{
    (void)state;
    static const char *const bad[] = {
        "redis://bob:s3cr3t@localhost:99999/0",
        "redis://bob:s3cr3t@localhost/abc",
        "rediss://bob:s3cr3t@localhost",
        "redis://:s3cr3t@localhost?db=1&bogus=2",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        ferry_kv_config c = remote_config(bad[i], NULL);
        ferry_kv *kv = NULL;
        int rc = ferry_kv_open(&c, &kv);
        if (rc != FERRY_EPARSE && rc != FERRY_ENOTSUP)
            fail_msg("%s -> %d (%s)", bad[i], rc, ferry_last_error());
        assert_null(kv);
        const char *msg = ferry_last_error();
        if (strstr(msg, "s3cr3t") || !strstr(msg, "remote URL"))
            fail_msg("%s: '%s'", bad[i], msg);
    }
}

int main(void)
{
    ft_redis_check();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(synced_chunks_survive_a_killed_owner), /* forks first */
        cmocka_unit_test(reopen_with_another_l2_size_never_gives_other_bytes),
        cmocka_unit_test(l2_larger_than_the_disk_fails_and_leaves_room),
        FT_REDIS_TEST(remote_ttl_reaches_every_chunk_key),
        FT_REDIS_TEST(expired_values_are_misses),
        FT_REDIS_TEST(server_restarted_empty_between_lookup_and_retrieve),
        FT_REDIS_TEST(value_copied_from_another_key_is_a_miss),
        FT_REDIS_TEST(unix_socket_url_with_a_database),
        cmocka_unit_test(bad_url_is_named_without_its_password),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
