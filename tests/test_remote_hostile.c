/*
 * test_remote_hostile.c - the remote tier's "no wrong byte" promise
 * (ferry/remote.h) against a real redis-server that other writers share:
 * foreign, older, newer, empty and huge values under ferry's keys; a
 * read-only ACL user; a server that sleeps (DEBUG SLEEP) past the
 * timeout; a first call made before the topology is known; and threads
 * that read while other writers (other layouts, other sizes), SETRANGE,
 * APPEND, FLUSHALL and maxmemory eviction change the values under them,
 * or the server is killed and restarted under them.
 * Every get is either exactly a value this layout stored for that key or
 * a refusal. Skipped (77) without redis-server.
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

#include <hiredis/hiredis.h>
#include <xxhash.h>

#include "ferry_test.h"
#include "le.h"
#include "remote/remote_int.h"
#include "redis_server.h"

static ft_redis g_srv;
static const char LAYOUT_A[] = "ferry-kv/1;layers=2;dtype=bf16;model=a";
static const char LAYOUT_B[] = "ferry-kv/1;layers=2;dtype=fp16;model=a";

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static ferry_remote_options opts(const char *layout, const char *prefix)
{
    ferry_remote_options o = FERRY_REMOTE_OPTIONS_INIT;
    o.layout = layout;
    o.layout_len = strlen(layout);
    o.key_prefix = prefix;
    o.connect_timeout_ms = 300;
    o.command_timeout_ms = 300;
    o.backoff_initial_ms = 20;
    o.backoff_max_ms = 100;
    return o;
}

static ferry_remote *open_on(const ft_redis *s, const char *layout, const char *prefix,
                             uint32_t flags)
{
    char url[128];
    ferry_remote_options o = opts(layout, prefix);
    o.flags = flags;
    ferry_remote *r = NULL;
    FT_ASSERT_OK(ferry_remote_open(ft_redis_url(s, 0, url, sizeof url), &o, &r));
    return r;
}

static ferry_remote_stats metrics(ferry_remote *r)
{
    ferry_remote_stats m = FERRY_REMOTE_STATS_INIT;
    FT_ASSERT_OK(ferry_remote_stats_get(r, &m));
    return m;
}

static void raw_set(const ft_redis *s, const char *key, const void *v, size_t len)
{
    const char *argv[] = {"SET", key, v};
    size_t lens[] = {3, strlen(key), len};
    assert_int_equal(ft_redis_cmd_bin(s, NULL, 0, 3, argv, lens), REDIS_REPLY_STATUS);
}

/* a well-formed value of format version `version` (its header checksum
 * right) for layout and key */
static size_t craft(uint8_t *dst, unsigned version, const char *layout, const char *key,
                    const void *payload, size_t len)
{
    size_t ll = strlen(layout);
    ferry__rvalue_encode_header(dst, layout, ll, ferry__rvalue_key_sum(key, strlen(key)),
                                payload, len);
    ferry__put16(dst + 4, (uint16_t)version);
    uint8_t tmp[40 + FERRY_REMOTE_LAYOUT_MAX];
    memcpy(tmp, dst, 40);
    memcpy(tmp + 40, layout, ll);
    ferry__put64(dst + 40, XXH3_64bits(tmp, 40 + ll));
    memcpy(dst + FERRY_REMOTE_HEADER_FIXED + ll, payload, len);
    return FERRY_REMOTE_HEADER_FIXED + ll + len;
}

static int srv_setup(void **state)
{
    (void)state;
    /* a server older than 7 has no such option (and DEBUG on): without it */
    static const char *const args[] = {"--enable-debug-command", "yes", NULL};
    if (ft_redis_start(&g_srv, args) == 0)
        return 0;
    return ft_redis_start(&g_srv, NULL) == 0 ? 0 : -1;
}
static int srv_teardown(void **state)
{
    (void)state;
    ft_redis_destroy(&g_srv);
    return 0;
}

/* values ferry did not write for this reader: never data, the handle not
 * marked down, and the connection still in step afterwards */
static void foreign_values_are_never_data(void **state)
{
    (void)state;
    ferry_remote *r = open_on(&g_srv, LAYOUT_A, "fv:", 0);
    uint8_t good[512], dst[512];
    ft_fill_pattern(good, sizeof good, 7);
    FT_ASSERT_OK(ferry_remote_put_sync(r, "good", 4, good, sizeof good));

    size_t vmax = 16u << 20;
    uint8_t *v = malloc(vmax);
    assert_non_null(v);
    /* zero length */
    raw_set(&g_srv, "fv:k", "", 0);
    assert_int_equal(ferry_remote_get(r, "k", 1, dst, sizeof dst), FERRY_ECORRUPT);
    /* format version 0 (never written) and a newer one */
    size_t n = craft(v, 0, LAYOUT_A, "k", good, sizeof good);
    raw_set(&g_srv, "fv:k", v, n);
    assert_int_equal(ferry_remote_get(r, "k", 1, dst, sizeof dst), FERRY_ECORRUPT);
    n = craft(v, 2, LAYOUT_A, "k", good, sizeof good);
    raw_set(&g_srv, "fv:k", v, n);
    assert_int_equal(ferry_remote_get(r, "k", 1, dst, sizeof dst), FERRY_EVERSION);
    ferry_remote_key kk = {"k", 1};
    assert_int_equal(ferry_remote_exists(r, &kk, 1), 0);
    /* the same format (version 1) crafted by hand is data: the control */
    n = craft(v, 1, LAYOUT_A, "k", good, sizeof good);
    raw_set(&g_srv, "fv:k", v, n);
    assert_int_equal(ferry_remote_get(r, "k", 1, dst, sizeof dst), (int)sizeof good);
    assert_memory_equal(dst, good, sizeof good);
    /* a huge value, not ferry's, behind a small destination */
    memset(v, 'x', vmax);
    raw_set(&g_srv, "fv:k", v, vmax);
    assert_int_equal(ferry_remote_get(r, "k", 1, dst, sizeof dst), FERRY_ECORRUPT);
    /* a huge ferry value of another layout, and of this one */
    uint8_t *pl = calloc(1, vmax);
    assert_non_null(pl);
    n = craft(v, 1, LAYOUT_B, "k", pl, vmax - 8192);
    raw_set(&g_srv, "fv:k", v, n);
    assert_int_equal(ferry_remote_get(r, "k", 1, dst, sizeof dst), FERRY_EMISMATCH);
    n = craft(v, 1, LAYOUT_A, "k", pl, vmax - 8192);
    free(pl);
    raw_set(&g_srv, "fv:k", v, n);
    assert_int_equal(ferry_remote_get(r, "k", 1, dst, sizeof dst), -ENOBUFS);
    /* prefix "fv:" + key "xk" and prefix "fv:x" + key "k" name the same
     * server key: the key hash tells them apart */
    ferry_remote *r2 = open_on(&g_srv, LAYOUT_A, "fv:x", 0);
    FT_ASSERT_OK(ferry_remote_put_sync(r2, "k", 1, good, 100));
    assert_int_equal(ferry_remote_get(r, "xk", 2, dst, sizeof dst), FERRY_EMISMATCH);
    assert_int_equal(ferry_remote_get(r2, "k", 1, dst, sizeof dst), 100);

    /* none of that took the remote down or put a connection out of step */
    ferry_remote_stats m = metrics(r);
    assert_int_equal(m.down, 0);
    assert_int_equal(m.hits, 1);
    assert_int_equal(ferry_remote_get(r, "good", 4, dst, sizeof dst), (int)sizeof good);
    assert_memory_equal(dst, good, sizeof good);
    ferry_remote_close(r2);
    ferry_remote_close(r);
    free(v);
}

/* The first call of a handle opened FERRY_REMOTE_LAZY while the server was
 * unreachable runs before the topology is known, through the generic
 * reply path (the one a cluster always takes): a value bigger than the
 * destination there is refused like on the direct path, and is not a
 * transport failure that marks the shared remote down. */
static void oversized_value_on_the_first_lazy_call(void **state)
{
    (void)state;
    ft_redis s;
    assert_int_equal(ft_redis_start(&s, NULL), 0);
    ft_redis_stop(&s);
    uint8_t dst[256];
    size_t big = 1u << 20;
    uint8_t *v = malloc(big + 4096), *pl = calloc(1, big);
    static const int want[] = {FERRY_EMISMATCH, -ENOBUFS, FERRY_ECORRUPT, FERRY_ENOTFOUND,
                               200};
    for (int i = 0; i < 5; i++) {
        ferry_remote *r = open_on(&s, LAYOUT_A, "lz:", FERRY_REMOTE_LAZY);
        assert_int_equal(ft_redis_restart(&s), 0);
        size_t n = 0;
        if (i == 0)
            n = craft(v, 1, LAYOUT_B, "k", pl, big);
        else if (i == 1)
            n = craft(v, 1, LAYOUT_A, "k", pl, big);
        else if (i == 2)
            memset(v, 'y', n = big);
        else if (i == 4)
            n = craft(v, 1, LAYOUT_A, "k", pl, 200);
        if (i != 3)
            raw_set(&s, "lz:k", v, n);
        sleep_ms(150); /* past the backoff: the next call probes */
        memset(dst, 0xee, sizeof dst);
        assert_int_equal(ferry_remote_get(r, "k", 1, dst, sizeof dst), want[i]);
        if (i == 4)
            assert_memory_equal(dst, pl, 200);
        assert_int_equal(metrics(r).down, 0);
        ferry_remote_close(r);
        ft_redis_stop(&s);
    }
    ft_redis_destroy(&s);
    free(v);
    free(pl);
}

/* a user the server lets read but not write */
static void read_only_acl_user(void **state)
{
    (void)state;
    static const char *const acl[] = {"ACL", "SETUSER", "reader", "on", ">r3ad", "~*",
                                      "+@read", "+ping", "+select", NULL};
    assert_int_equal(ft_redis_cmd(&g_srv, NULL, 0, acl), REDIS_REPLY_STATUS);
    ferry_remote *w = open_on(&g_srv, LAYOUT_A, "ro:", 0);
    uint8_t src[64], dst[64];
    ft_fill_pattern(src, sizeof src, 9);
    FT_ASSERT_OK(ferry_remote_put_sync(w, "k", 1, src, sizeof src));
    char url[160];
    snprintf(url, sizeof url, "redis://reader:r3ad@127.0.0.1:%d/0", g_srv.port);
    ferry_remote_options o = opts(LAYOUT_A, "ro:");
    ferry_remote *r = NULL;
    FT_ASSERT_OK(ferry_remote_open(url, &o, &r));
    assert_int_equal(ferry_remote_put_sync(r, "k2", 2, src, sizeof src), FERRY_EREMOTE);
    assert_non_null(strstr(ferry_remote_last_error(r), "NOPERM"));
    FT_ASSERT_OK(ferry_remote_put(r, "k3", 2, src, sizeof src));
    FT_ASSERT_OK(ferry_remote_flush(r, 5000));
    ferry_remote_key k = {"k", 1};
    assert_int_equal(ferry_remote_exists(r, &k, 1), 1);
    assert_int_equal(ferry_remote_get(r, "k", 1, dst, sizeof dst), (int)sizeof src);
    assert_memory_equal(dst, src, sizeof src);
    assert_int_equal(ferry_remote_delete(r, &k, 1), FERRY_EREMOTE);
    ferry_remote_stats m = metrics(r);
    assert_int_equal(m.dropped, 1);
    assert_int_equal(m.down, 0);
    ferry_remote_close(r);
    ferry_remote_close(w);
}

typedef struct sleeper {
    int port, ms;
} sleeper;

static void *debug_sleep(void *arg)
{
    sleeper *s = arg;
    redisContext *c = redisConnect("127.0.0.1", s->port);
    redisReply *rep = redisCommand(c, "DEBUG SLEEP %f", s->ms / 1000.0);
    freeReplyObject(rep);
    redisFree(c);
    return NULL;
}

/* a server busy past the command timeout: the get is a miss within about
 * the timeout, and once it answers again no late reply is ever read as
 * the answer to a later call */
static void slow_server_is_a_miss_then_in_step(void **state)
{
    (void)state;
    ferry_remote *r = open_on(&g_srv, LAYOUT_A, "sl:", 0);
    uint8_t a[300], b[300], dst[300];
    ft_fill_pattern(a, sizeof a, 1);
    ft_fill_pattern(b, sizeof b, 2);
    FT_ASSERT_OK(ferry_remote_put_sync(r, "a", 1, a, sizeof a));
    FT_ASSERT_OK(ferry_remote_put_sync(r, "b", 1, b, sizeof b));
    static const char *const probe[] = {"DEBUG", "SLEEP", "0", NULL};
    if (ft_redis_cmd(&g_srv, NULL, 0, probe) != REDIS_REPLY_STATUS) {
        ferry_remote_close(r);
        skip(); /* DEBUG refused by this server's configuration */
    }
    sleeper sl = {g_srv.port, 1000};
    pthread_t th;
    pthread_create(&th, NULL, debug_sleep, &sl);
    sleep_ms(100);
    int64_t t0 = now_ms();
    assert_int_equal(ferry_remote_get(r, "a", 1, dst, sizeof dst), FERRY_ENOTFOUND);
    int64_t took = now_ms() - t0;
    assert_true(took < 800);
    assert_int_equal(metrics(r).down, 1);
    pthread_join(th, NULL);
    sleep_ms(150);
    for (int i = 0; i < 20; i++) {
        memset(dst, 0, sizeof dst);
        assert_int_equal(ferry_remote_get(r, "b", 1, dst, sizeof dst), (int)sizeof b);
        assert_memory_equal(dst, b, sizeof b);
        assert_int_equal(ferry_remote_get(r, "a", 1, dst, sizeof dst), (int)sizeof a);
        assert_memory_equal(dst, a, sizeof a);
    }
    ferry_remote_close(r);
}

/* ---- many writers and vandals on the same keys ---- */

#define NKEYS 160
#define VAL_MAX 20000

typedef struct chaos {
    ft_redis *srv;
    ferry_remote *a1, *a2, *b;
    atomic_int stop;
    atomic_ullong hits, refused, misses, wrong;
} chaos;

/* a payload that names its key and generation and is checkable alone:
 * [key u32][gen u32][len u32][pattern seeded by key and gen] */
static size_t make_payload(uint8_t *p, unsigned key, unsigned gen, int other)
{
    size_t len = 64 + (size_t)((key * 7919u + gen * 104729u) % (VAL_MAX - 64));
    if (other)
        len = VAL_MAX - 1 - (len % 100);
    ferry__put32(p, key);
    ferry__put32(p + 4, gen);
    ferry__put32(p + 8, (uint32_t)len);
    ft_fill_pattern(p + 12, len - 12, key * 31 + gen);
    return len;
}

static int payload_ok(const uint8_t *p, size_t len, unsigned key)
{
    if (len < 12 || ferry__get32(p) != key || ferry__get32(p + 8) != len)
        return 0;
    unsigned gen = ferry__get32(p + 4);
    return ft_check_pattern(p + 12, len - 12, key * 31 + gen) == -1;
}

static void *chaos_writer(void *arg)
{
    chaos *c = arg;
    static atomic_uint gens;
    uint8_t *p = malloc(VAL_MAX);
    unsigned seed = atomic_fetch_add(&gens, 1) + 1;
    while (!atomic_load(&c->stop)) {
        unsigned key = (unsigned)rand_r(&seed) % NKEYS, gen = atomic_fetch_add(&gens, 1);
        char name[16];
        snprintf(name, sizeof name, "key-%u", key);
        int which = rand_r(&seed) % 3;
        size_t len = make_payload(p, key, gen, which == 2);
        ferry_remote *r = which == 0 ? c->a1 : which == 1 ? c->a2 : c->b;
        if (rand_r(&seed) & 1)
            ferry_remote_put_sync(r, name, strlen(name), p, len);
        else
            ferry_remote_put(r, name, strlen(name), p, len);
    }
    free(p);
    return NULL;
}

static void *chaos_reader(void *arg)
{
    chaos *c = arg;
    uint8_t *dst = malloc(VAL_MAX);
    unsigned seed = 99;
    while (!atomic_load(&c->stop)) {
        unsigned key = (unsigned)rand_r(&seed) % NKEYS;
        char name[16];
        snprintf(name, sizeof name, "key-%u", key);
        ferry_remote *r = (rand_r(&seed) & 1) ? c->a1 : c->a2;
        int rc = ferry_remote_get(r, name, strlen(name), dst, VAL_MAX);
        if (rc >= 0) {
            atomic_fetch_add(&c->hits, 1);
            if (!payload_ok(dst, (size_t)rc, key))
                atomic_fetch_add(&c->wrong, 1);
        } else if (rc == FERRY_ENOTFOUND) {
            atomic_fetch_add(&c->misses, 1);
        } else {
            atomic_fetch_add(&c->refused, 1);
        }
    }
    free(dst);
    return NULL;
}

static void *chaos_vandal(void *arg)
{
    chaos *c = arg;
    redisContext *rc = redisConnect("127.0.0.1", c->srv->port);
    unsigned seed = 5;
    while (!atomic_load(&c->stop)) {
        unsigned key = (unsigned)rand_r(&seed) % NKEYS;
        char name[24];
        snprintf(name, sizeof name, "ch:key-%u", key);
        redisReply *rep = NULL;
        switch (rand_r(&seed) % 8) {
        case 0:
            rep = redisCommand(rc, "SETRANGE %s %u x", name, (unsigned)rand_r(&seed) % 9000);
            break;
        case 1:
            rep = redisCommand(rc, "APPEND %s zz", name);
            break;
        case 2:
            rep = redisCommand(rc, "DEL %s", name);
            break;
        case 3:
            if (rand_r(&seed) % 16 == 0)
                rep = redisCommand(rc, "FLUSHALL");
            break;
        case 4:
            rep = redisCommand(rc, "COPY ch:key-%u %s REPLACE", (key + 1) % NKEYS, name);
            break;
        default:
            break;
        }
        if (rep)
            freeReplyObject(rep);
        sleep_ms(1);
    }
    redisFree(rc);
    return NULL;
}

/* c on server s: two handles of layout A and one of B on one prefix,
 * three writers (th[0..2]) and three readers (th[3..5]) started */
static void chaos_start(chaos *c, ft_redis *s, pthread_t *th)
{
    memset(c, 0, sizeof *c);
    c->srv = s;
    c->a1 = open_on(s, LAYOUT_A, "ch:", 0);
    c->a2 = open_on(s, LAYOUT_A, "ch:", 0);
    c->b = open_on(s, LAYOUT_B, "ch:", 0);
    for (int i = 0; i < 3; i++)
        pthread_create(&th[i], NULL, chaos_writer, c);
    for (int i = 3; i < 6; i++)
        pthread_create(&th[i], NULL, chaos_reader, c);
}

/* Two handles of one layout and one of another (other sizes) write the
 * same keys from several threads, readers read them through both, and a
 * vandal SETRANGEs, APPENDs, deletes, copies and FLUSHALLs, all while a
 * small maxmemory evicts: every hit is exactly a value written for that
 * key by this layout, the rest refusals or misses. */
static void writers_and_vandals_never_give_wrong_bytes(void **state)
{
    (void)state;
    static const char *const args[] = {"--maxmemory", "2mb", "--maxmemory-policy",
                                       "allkeys-lru", NULL};
    ft_redis s;
    assert_int_equal(ft_redis_start(&s, args), 0);
    chaos c;
    pthread_t th[7];
    chaos_start(&c, &s, th);
    pthread_create(&th[6], NULL, chaos_vandal, &c);
    sleep_ms(3000);
    atomic_store(&c.stop, 1);
    for (int i = 0; i < 7; i++)
        pthread_join(th[i], NULL);
    /* maxmemory did evict under them */
    static const char *const info[] = {"INFO", "stats", NULL};
    char out[8192];
    assert_int_equal(ft_redis_cmd(&s, out, sizeof out, info), REDIS_REPLY_STRING);
    const char *ev = strstr(out, "evicted_keys:");
    assert_non_null(ev);
    fprintf(stderr, "chaos: %ld keys evicted\n", atol(ev + 13));
    assert_true(atol(ev + 13) > 0);
    fprintf(stderr, "chaos: %llu hits, %llu refused, %llu misses, %llu wrong\n",
            (unsigned long long)c.hits, (unsigned long long)c.refused,
            (unsigned long long)c.misses, (unsigned long long)c.wrong);
    assert_int_equal(atomic_load(&c.wrong), 0);
    assert_true(atomic_load(&c.hits) > 0);
    assert_true(atomic_load(&c.refused) > 0);
    ferry_remote_close(c.a1);
    ferry_remote_close(c.a2);
    ferry_remote_close(c.b);
    ft_redis_destroy(&s);
}

/* The same writers and readers while the server is killed (SIGKILL, its
 * data gone) and restarted on the same port, again and again: every hit
 * is exactly a value written for that key, and both handles are up and
 * reading again afterwards. */
static void killed_server_mid_traffic(void **state)
{
    (void)state;
    ft_redis s;
    assert_int_equal(ft_redis_start(&s, NULL), 0);
    chaos c;
    pthread_t th[6];
    chaos_start(&c, &s, th);
    for (int k = 0; k < 4; k++) {
        sleep_ms(300);
        kill(s.pid, SIGKILL);
        int st;
        waitpid(s.pid, &st, 0);
        s.pid = 0;
        sleep_ms(100);
        assert_int_equal(ft_redis_restart(&s), 0);
    }
    sleep_ms(400);
    atomic_store(&c.stop, 1);
    for (int i = 0; i < 6; i++)
        pthread_join(th[i], NULL);
    fprintf(stderr, "killed: %llu hits, %llu refused, %llu misses, %llu wrong\n",
            (unsigned long long)c.hits, (unsigned long long)c.refused,
            (unsigned long long)c.misses, (unsigned long long)c.wrong);
    assert_int_equal(atomic_load(&c.wrong), 0);
    assert_true(atomic_load(&c.hits) > 0);
    sleep_ms(150); /* past any backoff */
    uint8_t p[VAL_MAX], dst[VAL_MAX];
    size_t len = make_payload(p, 1, 12345, 0);
    FT_ASSERT_OK(ferry_remote_put_sync(c.a1, "key-1", 5, p, len));
    assert_int_equal(ferry_remote_get(c.a2, "key-1", 5, dst, sizeof dst), (int)len);
    assert_memory_equal(dst, p, len);
    assert_true(metrics(c.a1).reconnects > 0);
    ferry_remote_close(c.a1);
    ferry_remote_close(c.a2);
    ferry_remote_close(c.b);
    ft_redis_destroy(&s);
}

/* A value longer than Redis's default 512 MiB limit (a server whose
 * proto-max-bulk-len was raised, written by another client) is no value
 * ferry writes: its read is refused as such, naming the key, the size and
 * the limit, without reading it and without taking the remote down; and
 * a put of one is refused before anything is queued, naming the same. */
static void values_over_the_limit(void **state)
{
    (void)state;
    static const char *const args[] = {"--proto-max-bulk-len", "1gb", NULL};
    ft_redis s;
    if (ft_redis_start(&s, args) != 0)
        skip();
    /* the server copies the whole value into its reply before the first
     * byte of it goes: time enough for that */
    char url[128];
    ferry_remote_options o = opts(LAYOUT_A, "big:");
    o.command_timeout_ms = 10000;
    ferry_remote *r = NULL;
    FT_ASSERT_OK(ferry_remote_open(ft_redis_url(&s, 0, url, sizeof url), &o, &r));
    uint8_t good[512], dst[4096];
    ft_fill_pattern(good, sizeof good, 5);
    FT_ASSERT_OK(ferry_remote_put_sync(r, "good", 4, good, sizeof good));
    /* one byte over: SETRANGE grows the value with zeros on the server */
    char off[32];
    snprintf(off, sizeof off, "%llu", (unsigned long long)FERRY_REMOTE_VALUE_MAX);
    const char *argv[] = {"SETRANGE", "big:huge", off, "x", NULL};
    assert_int_equal(ft_redis_cmd(&s, NULL, 0, argv), REDIS_REPLY_INTEGER);
    memset(dst, 0xee, sizeof dst);
    assert_int_equal(ferry_remote_get(r, "huge", 4, dst, sizeof dst), FERRY_ECORRUPT);
    const char *msg = ferry_remote_last_error(r);
    assert_non_null(strstr(msg, "huge"));
    assert_non_null(strstr(msg, "536870913"));
    assert_non_null(strstr(msg, "536870912"));
    for (size_t i = 0; i < sizeof dst; i++)
        assert_int_equal(dst[i], 0xee); /* not a byte of it */
    ferry_remote_stats m = metrics(r);
    assert_int_equal(m.down, 0);
    assert_int_equal(m.corrupt, 1);
    assert_int_equal(m.bytes_read, 0); /* refused unread: no byte of it received */
    /* the connection it came on was closed, not left out of step */
    assert_int_equal(ferry_remote_get(r, "good", 4, dst, sizeof dst), (int)sizeof good);
    assert_memory_equal(dst, good, sizeof good);
    /* a put of a payload that would make such a value */
    size_t over = FERRY_REMOTE_VALUE_MAX - FERRY_REMOTE_HEADER_FIXED - strlen(LAYOUT_A) + 1;
    uint8_t *big = malloc(over); /* (never touched: refused before a byte is read) */
    assert_non_null(big);
    assert_int_equal(ferry_remote_put(r, "p", 1, big, over), -EINVAL);
    free(big);
    msg = ferry_remote_last_error(r);
    assert_non_null(strstr(msg, "put p"));
    assert_non_null(strstr(msg, "536870912"));
    assert_int_equal(metrics(r).down, 0);
    ferry_remote_close(r);
    ft_redis_destroy(&s);
}

int main(void)
{
    if (!ft_redis_available()) {
        fprintf(stderr, "redis-server not installed: skipping\n");
        return 77;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(foreign_values_are_never_data),
        cmocka_unit_test(oversized_value_on_the_first_lazy_call),
        cmocka_unit_test(values_over_the_limit),
        cmocka_unit_test(read_only_acl_user),
        cmocka_unit_test(slow_server_is_a_miss_then_in_step),
        cmocka_unit_test(writers_and_vandals_never_give_wrong_bytes),
        cmocka_unit_test(killed_server_mid_traffic),
    };
    return cmocka_run_group_tests_name("remote_hostile", tests, srv_setup, srv_teardown);
}
