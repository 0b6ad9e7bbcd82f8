/*
 * kv_bench_pool.c - `ferry kv bench --server URL`: what the shared pool
 * costs a client.
 *
 *  - The copy figure: in one client process, alternating rounds of a
 *    memcpy of B bytes, a store of B bytes of fresh chunks through the
 *    daemon (reserve, the client's copy into the pool, commit) and the
 *    retrieve of them (acquire, the client's copy out, release); each
 *    round's store and retrieve against that round's memcpy, the median
 *    of the ratios reported. Every retrieved byte is compared with what
 *    was stored (a difference voids the figure), and each round's chunks
 *    are deleted, so every store is of new chunks.
 *  - Fairness: N client processes started together, each storing and
 *    retrieving its own fresh chunks in a loop for a fixed time; each
 *    client's share of the bytes moved, and the aggregate against one
 *    client alone running the same loop.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kv_bench.h"

#define SP_ROUNDS 9      /* measured rounds of the copy figure, after one warm-up */
#define SP_FAIR_S 2.0    /* seconds each fairness loop runs */
#define SP_MAX_BYTES (256ull << 20) /* per call of the copy figure */

/* the daemon's pool in chunks (0 when the stats say nothing) */
static uint64_t pool_chunks(ferry_kv *kv)
{
    ferry_kv_stats m = FERRY_KV_STATS_INIT;
    uint64_t chunk = ferry_kv_chunk_bytes(kv);
    if (ferry_kv_stats_get(kv, &m) < 0 || !chunk)
        return 0;
    return m.tier[FERRY_KV_TIER_L1].capacity_bytes / chunk;
}

/* fresh token ids for (who, round): no chunk of one is another's */
static void fresh_tokens(int32_t *t, size_t n, uint64_t seed, uint64_t who, uint64_t round)
{
    uint64_t s = seed * 0x9e3779b97f4a7c15ull ^ (who << 40) ^ (round << 8) ^ 0x5bd1e995u;
    for (size_t i = 0; i < n; i++)
        t[i] = (int32_t)(kvb_rng_next(&s) % 128000);
}

/* one round of the copy figure: seconds of memcpy, store, retrieve; 0 or
 * the failure (a short store or retrieve, bytes that differ) */
static int copy_round(ferry_kv *kv, const int32_t *t, size_t n, const engine_buf *src,
                      const engine_buf *dst, size_t bytes, double sec[3])
{
    double t0 = kvb_now_s();
    memcpy(dst->host, src->host, bytes);
    sec[0] = kvb_now_s() - t0;
    memset(dst->host, 0, bytes);
    t0 = kvb_now_s();
    int st = ferry_kv_store(kv, t, n, NULL, &src->b);
    sec[1] = kvb_now_s() - t0;
    t0 = kvb_now_s();
    int rt = st == (int)n ? ferry_kv_retrieve(kv, t, n, NULL, &dst->b) : st;
    sec[2] = kvb_now_s() - t0;
    (void)ferry_kv_delete(kv, t, n, NULL);
    if (st < 0 || rt < 0)
        return st < 0 ? st : rt;
    if (st != (int)n || rt != (int)n)
        return FERRY_ENOSPACE;
    return memcmp(dst->host, src->host, bytes) ? -EIO : 0;
}

static int copy_figure(const opts *o, const ferry_kv_layout *l, ferry_kv *kv, srv_pool *s)
{
    uint64_t chunk = ferry_kv_chunk_bytes(kv), fit = pool_chunks(kv);
    uint64_t nch = fit / 4; /* one batch: a quarter of the pool */
    while (nch > 1 && nch * chunk > SP_MAX_BYTES)
        nch--;
    if (!nch)
        return FERRY_ENOSPACE;
    size_t n = (size_t)nch * o->chunk_tokens, bytes = (size_t)(nch * chunk);
    s->chunks = (size_t)nch;
    s->bytes = bytes;
    int32_t *t = malloc(n * sizeof *t);
    engine_buf a, b;
    memset(&a, 0, sizeof a);
    memset(&b, 0, sizeof b);
    int rc = t ? 0 : -ENOMEM;
    if (rc == 0 && (rc = kvb_buffer_alloc(NULL, l, n, &a)) == 0)
        rc = kvb_buffer_alloc(NULL, l, n, &b);
    double r[3][SP_ROUNDS], g[3][SP_ROUNDS];
    for (unsigned k = 0; rc == 0 && k <= SP_ROUNDS; k++) {
        double sec[3];
        fresh_tokens(t, n, o->seed, 0, k);
        for (size_t i = 0; i < bytes; i += 4096) /* a new payload each round */
            ((unsigned char *)a.host)[i] = (unsigned char)(k * 31 + i / 4096);
        rc = copy_round(kv, t, n, &a, &b, bytes, sec);
        if (rc == 0 && k == 0) /* the client's first store: reported on its own */
            s->first_store_gbps = sec[1] > 0 ? (double)bytes / sec[1] / 1e9 : 0;
        if (rc < 0 || k == 0)
            continue; /* (the engine's own buffers fault in during round 0) */
        for (int j = 0; j < 3; j++) {
            g[j][k - 1] = sec[j] > 0 ? (double)bytes / sec[j] / 1e9 : 0;
            r[j][k - 1] = j ? kvb_ratio(sec[0], sec[j]) : 1;
        }
        s->rounds = k;
    }
    if (rc == 0) {
        s->memcpy_gbps = kvb_pct(g[0], SP_ROUNDS, 0.5);
        s->store_gbps = kvb_pct(g[1], SP_ROUNDS, 0.5);
        s->retrieve_gbps = kvb_pct(g[2], SP_ROUNDS, 0.5);
        s->store_ratio_min = kvb_pct(r[1], SP_ROUNDS, 0);
        s->store_ratio = kvb_pct(r[1], SP_ROUNDS, 0.5);
        s->retrieve_ratio_min = kvb_pct(r[2], SP_ROUNDS, 0);
        s->retrieve_ratio = kvb_pct(r[2], SP_ROUNDS, 0.5);
    }
    kvb_buffer_free(&a);
    kvb_buffer_free(&b);
    free(t);
    return rc;
}

/* what one fairness client did */
typedef struct fair_out {
    double bytes, secs;
    uint64_t calls;
    int32_t rc;
} fair_out;

typedef struct fair_arg {
    const opts *o;
    const ferry_kv_layout *l;
    size_t chunks;
    unsigned id_base;
} fair_arg;

/* one fairness client: store and retrieve its own fresh chunks until the
 * time is up; the first and the last retrieve are compared byte for byte */
static int fair_child(const void *arg, int go, void *out)
{
    const fair_arg *a = arg;
    fair_out *f = out;
    ferry_kv *kv = NULL;
    if (kvb_open_store(a->o, a->l, 1, 0, NULL, &kv) < 0)
        return 3;
    size_t n = a->chunks * a->o->chunk_tokens;
    size_t bytes = (size_t)(a->chunks * ferry_kv_chunk_bytes(kv));
    int32_t *t = malloc(n * sizeof *t);
    engine_buf src, dst;
    memset(&src, 0, sizeof src);
    memset(&dst, 0, sizeof dst);
    if (!t || kvb_buffer_alloc(NULL, a->l, n, &src) < 0 || kvb_buffer_alloc(NULL, a->l, n, &dst) < 0)
        return 2;
    unsigned id = a->id_base + (unsigned)getpid();
    for (size_t i = 0; i < bytes; i += 4096)
        ((unsigned char *)src.host)[i] = (unsigned char)(id + i / 4096);
    char b;
    if (read(go, &b, 1) != 1)
        return 4;
    double t0 = kvb_now_s(), end = t0 + SP_FAIR_S;
    int check = 1;
    for (uint64_t k = 0; f->rc == 0; k++) {
        double now = kvb_now_s();
        if (now >= end)
            break;
        check = check || now + (now - t0) / (double)(k ? k : 1) >= end; /* the last */
        fresh_tokens(t, n, a->o->seed, id, k);
        int st = ferry_kv_store(kv, t, n, NULL, &src.b);
        int rt = st == (int)n ? ferry_kv_retrieve(kv, t, n, NULL, &dst.b) : st;
        if (st < 0 || rt < 0)
            f->rc = st < 0 ? st : rt;
        else if (check && rt == (int)n && memcmp(dst.host, src.host, bytes))
            f->rc = -EIO;
        check = 0;
        f->bytes += (double)((size_t)(st > 0 ? st : 0) + (size_t)(rt > 0 ? rt : 0)) /
                    (double)n * (double)bytes;
        f->calls += 2;
        (void)ferry_kv_delete(kv, t, n, NULL);
    }
    f->secs = kvb_now_s() - t0;
    ferry_kv_close(kv);
    kvb_buffer_free(&src);
    kvb_buffer_free(&dst);
    free(t);
    return 0;
}

static int fairness(const opts *o, const ferry_kv_layout *l, ferry_kv *kv, srv_pool *s)
{
    uint64_t fit = pool_chunks(kv), chunk = ferry_kv_chunk_bytes(kv);
    uint64_t per = fit / (4ull * o->clients); /* all clients' chunks: a quarter of the pool */
    while (per > 1 && per * chunk > (64ull << 20))
        per--;
    if (!per)
        return FERRY_ENOSPACE;
    s->clients = o->clients;
    s->fair_chunks = (size_t)per;
    fair_out *out = calloc(o->clients, sizeof *out);
    if (!out)
        return -ENOMEM;
    fair_arg a = {o, l, (size_t)per, 0};
    int rc = kvb_fork_clients(1, fair_child, &a, out, sizeof *out);
    if (rc == 0 && (rc = out[0].rc) == 0)
        s->one_gbps = out[0].secs > 0 ? out[0].bytes / out[0].secs / 1e9 : 0;
    if (rc == 0) {
        memset(out, 0, o->clients * sizeof *out);
        rc = kvb_fork_clients(o->clients, fair_child, &a, out, sizeof *out);
    }
    double sum = 0, longest = 0, lo = -1, hi = 0;
    for (unsigned i = 0; rc == 0 && i < o->clients; i++) {
        if (out[i].rc < 0)
            rc = out[i].rc;
        sum += out[i].bytes;
        longest = out[i].secs > longest ? out[i].secs : longest;
        lo = lo < 0 || out[i].bytes < lo ? out[i].bytes : lo;
        hi = out[i].bytes > hi ? out[i].bytes : hi;
    }
    if (rc == 0 && sum > 0) {
        s->agg_gbps = longest > 0 ? sum / longest / 1e9 : 0;
        s->min_share = lo / sum;
        s->max_share = hi / sum;
    }
    free(out);
    return rc;
}

int kvb_server_pool(const opts *o, const ferry_kv_layout *l, srv_pool *s)
{
    memset(s, 0, sizeof *s);
    ferry_kv *kv = NULL;
    int rc = kvb_open_store(o, l, 1, 0, NULL, &kv);
    if (rc < 0)
        return s->rc = rc;
    rc = copy_figure(o, l, kv, s);
    if (rc == 0)
        rc = fairness(o, l, kv, s);
    ferry_kv_close(kv);
    return s->rc = rc;
}

void kvb_server_pool_print(const srv_pool *s)
{
    if (s->rc < 0 && !s->rounds) {
        printf("  pool copies         failed: %s\n", ferry_strerror(s->rc));
        return;
    }
    printf("  pool copies         %zu fresh chunks (%.1f MiB) a call, %u rounds alternating "
           "with memcpy (%.2f GB/s): store %.2f GB/s = %.2fx (least %.2fx), retrieve %.2f "
           "GB/s = %.2fx (least %.2fx)\n",
           s->chunks, (double)s->bytes / (1 << 20), s->rounds, s->memcpy_gbps, s->store_gbps,
           s->store_ratio, s->store_ratio_min, s->retrieve_gbps, s->retrieve_ratio,
           s->retrieve_ratio_min);
    printf("  first store         the client's first store into the pool %.2f GB/s = %.2fx the "
           "rounds' memcpy\n",
           s->first_store_gbps, kvb_ratio(s->first_store_gbps, s->memcpy_gbps));
    if (s->rc < 0) {
        printf("  fairness            failed: %s\n", ferry_strerror(s->rc));
        return;
    }
    printf("  fairness            %u clients storing and retrieving %zu chunks a call for "
           "%.0f s: aggregate %.2f GB/s = %.2fx one client alone (%.2f GB/s); shares "
           "%.3f..%.3f of the bytes (even: %.3f)\n",
           s->clients, s->fair_chunks, SP_FAIR_S, s->agg_gbps, kvb_ratio(s->agg_gbps, s->one_gbps),
           s->one_gbps, s->min_share, s->max_share, 1.0 / s->clients);
}

json_t *kvb_server_pool_json(const srv_pool *s)
{
    json_t *j = json_object();
    json_object_set_new(j, "chunks", json_integer((json_int_t)s->chunks));
    json_object_set_new(j, "bytes", json_integer((json_int_t)s->bytes));
    json_object_set_new(j, "rounds", json_integer(s->rounds));
    json_object_set_new(j, "memcpy_gbps", json_real(s->memcpy_gbps));
    json_object_set_new(j, "store_gbps", json_real(s->store_gbps));
    json_object_set_new(j, "retrieve_gbps", json_real(s->retrieve_gbps));
    json_object_set_new(j, "store_ratio", json_real(s->store_ratio));
    json_object_set_new(j, "store_ratio_min", json_real(s->store_ratio_min));
    json_object_set_new(j, "retrieve_ratio", json_real(s->retrieve_ratio));
    json_object_set_new(j, "retrieve_ratio_min", json_real(s->retrieve_ratio_min));
    json_object_set_new(j, "first_store_gbps", json_real(s->first_store_gbps));
    json_object_set_new(j, "clients", json_integer(s->clients));
    json_object_set_new(j, "fair_chunks", json_integer((json_int_t)s->fair_chunks));
    json_object_set_new(j, "one_client_gbps", json_real(s->one_gbps));
    json_object_set_new(j, "aggregate_gbps", json_real(s->agg_gbps));
    json_object_set_new(j, "aggregate_ratio", json_real(kvb_ratio(s->agg_gbps, s->one_gbps)));
    json_object_set_new(j, "min_share", json_real(s->min_share));
    json_object_set_new(j, "max_share", json_real(s->max_share));
    if (s->rc < 0)
        json_object_set_new(j, "error", json_string(ferry_strerror(s->rc)));
    return j;
}
