/*
 * kv_bench_cold.c - `ferry kv bench --cold N`: the L2-only retrieve, as an
 * independent client meets it.
 *
 * The run's documents (--docs x --doc-tokens) are stored once into a
 * persistent L2 in DIR/ferry-kv-bench-cold (kept between runs, so a script
 * can alternate this figure with another program's; a chunk already there
 * is not stored again), synced, and the store closed. Then N rounds each
 * open the store afresh (L1 of --l1, empty: every chunk comes from the
 * drive), retrieve every document into an engine buffer of plain host
 * memory (malloc, touched once, no huge-page advice) and close it again.
 * A round's figure is the bytes retrieved (all from L2) over the time of
 * its retrieves (opening and closing not counted); the process's CPU
 * time over the same span says how much of two CPUs the pipeline took.
 *
 * With --server the daemon owns the tiers: the documents are stored
 * through it into its L2 (which must be persistent, as `ferry serve --l2`
 * is), and each round is a new client process's connection retrieving
 * every document. A document's chunks come from the daemon's L2 when its
 * L1 holds fewer chunks than the other documents together (each round
 * says how many bytes the daemon read from L2, so a round served from L1
 * shows itself).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/mman.h>

#include "kv_bench.h"

#define COLD_SUBDIR "ferry-kv-bench-cold"

static double cpu_process_s(void)
{
    struct rusage u;
    getrusage(RUSAGE_SELF, &u);
    return (double)u.ru_utime.tv_sec + (double)u.ru_utime.tv_usec / 1e6 +
           (double)u.ru_stime.tv_sec + (double)u.ru_stime.tv_usec / 1e6;
}

/* the store of a round: the run's own, or a client of the daemon */
static int cold_open(const opts *o, const ferry_kv_layout *l, const char *sub, ferry_kv **kv)
{
    if (o->server)
        return kvb_open_store(o, l, 1, 0, NULL, kv);
    return kvb_open_store(o, l, o->l1, o->l2, sub, kv);
}

/* the documents in the slab: each stored unless already all there, then synced */
static int cold_fill(const opts *o, const ferry_kv_layout *l, const char *sub, const workload *w,
                     const ferry_kv_buffer *b, unsigned *stored)
{
    ferry_kv *kv;
    int rc = cold_open(o, l, sub, &kv);
    if (rc < 0)
        return rc;
    *stored = 0;
    for (unsigned d = 0; d < o->docs && rc >= 0; d++) {
        const int32_t *t = w->pool + (size_t)d * o->doc_tokens;
        if (ferry_kv_lookup(kv, t, o->doc_tokens, NULL) == (int)o->doc_tokens)
            continue;
        rc = ferry_kv_store(kv, t, o->doc_tokens, NULL, b);
        if (rc >= 0 && rc != (int)o->doc_tokens)
            rc = FERRY_ENOSPACE;
        (*stored)++;
    }
    if (rc >= 0)
        rc = ferry_kv_sync(kv);
    ferry_kv_close(kv);
    return rc < 0 ? rc : 0;
}

/* every document retrieved, o->cold_inflight at once (asynchronous
 * retrieves, document d into buffer d % inflight); the tokens retrieved */
static int cold_retrieve_all(const opts *o, ferry_kv *kv, const workload *w,
                             const engine_buf *bufs, uint64_t *got)
{
    unsigned n = o->cold_inflight ? o->cold_inflight : 1;
    int rc = 0;
    if (n == 1) {
        for (unsigned d = 0; d < o->docs && rc >= 0; d++) {
            rc = ferry_kv_retrieve(kv, w->pool + (size_t)d * o->doc_tokens, o->doc_tokens, NULL,
                                   &bufs[0].b);
            if (rc >= 0)
                *got += (uint64_t)rc;
        }
        return rc < 0 ? rc : 0;
    }
    ferry_kv_op *op[COLD_MAX_INFLIGHT] = {0};
    for (unsigned d = 0; d < o->docs + n; d++) {
        unsigned k = d % n;
        if (op[k]) { /* that buffer's previous document first */
            int r = ferry_kv_op_wait(op[k], -1);
            ferry_kv_op_free(op[k]);
            op[k] = NULL;
            if (r >= 0)
                *got += (uint64_t)r;
            else if (rc == 0)
                rc = r;
        }
        if (d < o->docs && rc == 0)
            rc = ferry_kv_retrieve_async(kv, w->pool + (size_t)d * o->doc_tokens, o->doc_tokens,
                                         NULL, &bufs[k].b, &op[k]);
    }
    return rc;
}

/* one round: a fresh store, every document retrieved from L2 */
static int cold_once(const opts *o, const ferry_kv_layout *l, const char *sub, const workload *w,
                      const engine_buf *bufs, cold_round *r)
{
    ferry_kv *kv;
    int rc = cold_open(o, l, sub, &kv);
    if (rc < 0)
        return rc;
    ferry_kv_stats a, z;
    a.size = z.size = sizeof a;
    ferry_kv_stats_get(kv, &a);
    double t0 = kvb_now_s(), c0 = cpu_process_s();
    uint64_t got = 0;
    rc = cold_retrieve_all(o, kv, w, bufs, &got);
    double el = kvb_now_s() - t0, cpu = cpu_process_s() - c0;
    ferry_kv_stats_get(kv, &z);
    ferry_kv_close(kv);
    if (rc < 0)
        return rc;
    r->seconds = el;
    r->cpu_s = cpu;
    r->l2_bytes = z.tier[FERRY_KV_TIER_L2].bytes_read - a.tier[FERRY_KV_TIER_L2].bytes_read;
    r->tokens = got;
    r->check_s = (double)(z.retrieve_check_us - a.retrieve_check_us) / 1e6;
    r->copy_s = (double)(z.retrieve_copy_us - a.retrieve_copy_us) / 1e6;
    uint64_t nb = 0, nc = 0;
    for (int k = 0; k < FERRY_KV_HIST_BUCKETS; k++) {
        nb += z.retrieve_first_bytes_ns[k] - a.retrieve_first_bytes_ns[k];
        nc += z.retrieve_first_chunk_ns[k] - a.retrieve_first_chunk_ns[k];
    }
    r->first_bytes_ms = nb ? (double)(z.retrieve_first_bytes_sum_ns -
                                      a.retrieve_first_bytes_sum_ns) / (double)nb / 1e6
                           : 0;
    r->first_chunk_ms = nc ? (double)(z.retrieve_first_chunk_sum_ns -
                                      a.retrieve_first_chunk_sum_ns) / (double)nc / 1e6
                           : 0;
    /* the bytes the client got, not the drive's reads (a chunk read twice counts once) */
    r->bytes = z.retrieved_bytes - a.retrieved_bytes;
    r->gbps = el > 0 ? (double)r->bytes / el / 1e9 : 0;
    if (got != (uint64_t)o->docs * o->doc_tokens) {
        fprintf(stderr, "ferry %s: --cold: a round retrieved %llu of %llu tokens\n", KVB_CMD,
                (unsigned long long)got, (unsigned long long)o->docs * o->doc_tokens);
        return FERRY_ENOTFOUND;
    }
    return 0;
}

/* plain host memory for the engine buffer: no alignment beyond malloc's
 * (aligned 1: a page's, as pinned host memory has, so chunks are read
 * straight into it; 2: also advised huge pages), touched once as an
 * engine's resident cache is */
static int plain_buffer(const ferry_kv_layout *l, uint64_t cap, int aligned, engine_buf *e)
{
    int rc = kvb_buffer_alloc(NULL, l, 1, e); /* the descriptor; its memory is replaced */
    if (rc < 0)
        return rc;
    free(e->host);
    uint64_t tb = (uint64_t)l->kv * l->num_layers * l->num_heads * l->head_dim *
                  ferry_dtype_size(l->dtype);
    size_t bytes = (size_t)(cap * tb);
    e->host = NULL;
    /* (huge: on a huge page's boundary, as a hugetlbfs pool is, so every
     * page of it can be one) */
    size_t align = aligned == 2 ? (size_t)2 << 20 : 4096;
    if (aligned ? posix_memalign(&e->host, align, bytes) != 0 : !(e->host = malloc(bytes)))
        return -ENOMEM;
#ifdef MADV_HUGEPAGE
    if (aligned == 2 && madvise(e->host, bytes, MADV_HUGEPAGE) != 0)
        fprintf(stderr, "ferry %s: --aligned-huge: madvise(MADV_HUGEPAGE): %s\n", KVB_CMD,
                strerror(errno));
#endif
    memset(e->host, 0x5a, bytes);
    e->b.base = (uint64_t)(uintptr_t)e->host;
    e->b.capacity_tokens = cap;
    return 0;
}

int kvb_cold_run(const opts *o, const ferry_kv_layout *l, const workload *w, uint64_t chunk,
                 cold_result *c)
{
    memset(c, 0, sizeof *c);
    c->l1_chunks = o->l1 / chunk;
    if (o->server) {
        snprintf(c->dir, sizeof c->dir, "the daemon at %s", o->server);
        ferry_kv *kv;
        int rc = kvb_open_store(o, l, 0, 0, NULL, &kv); /* lookups only: its stats */
        ferry_kv_stats m = FERRY_KV_STATS_INIT;
        if (rc == 0) {
            rc = ferry_kv_stats_get(kv, &m);
            ferry_kv_close(kv);
        }
        if (rc < 0)
            return rc;
        if (!m.tier[FERRY_KV_TIER_L2].capacity_bytes) {
            fprintf(stderr, "ferry %s: --cold: the daemon at %s has no L2 (ferry serve --l2 "
                    "DIR:SIZE)\n", KVB_CMD, o->server);
            return -EINVAL;
        }
        c->l1_chunks = m.tier[FERRY_KV_TIER_L1].capacity_bytes / chunk;
    } else {
        snprintf(c->dir, sizeof c->dir, "%s/%s", o->dir, COLD_SUBDIR);
        if (mkdir(c->dir, 0700) < 0 && errno != EEXIST)
            return -errno;
    }
    opts so = *o;
    so.persistent = 1;
    so.remote = NULL;
    so.dev = NULL;
    static engine_buf b[COLD_MAX_INFLIGHT];
    unsigned nb = o->cold_inflight ? o->cold_inflight : 1, made = 0;
    int rc = 0;
    for (; rc == 0 && made < nb; made++)
        rc = plain_buffer(l, o->doc_tokens, o->cold_aligned, &b[made]);
    if (rc == 0)
        rc = cold_fill(&so, l, c->dir, w, &b[0].b, &c->stored_docs);
    for (unsigned i = 0; rc == 0 && i < o->cold_rounds; i++) {
        rc = cold_once(&so, l, c->dir, w, b, &c->r[i]);
        if (rc == 0)
            c->n++;
    }
    for (unsigned i = 0; i < made; i++)
        kvb_buffer_free(&b[i]);
    double v[COLD_MAX_ROUNDS];
    for (unsigned i = 0; i < c->n; i++)
        v[i] = c->r[i].gbps;
    c->median_gbps = kvb_pct(v, c->n, 0.5);
    return rc;
}

json_t *kvb_cold_json(const opts *o, const cold_result *c)
{
    json_t *j = json_object(), *a = json_array();
    json_object_set_new(j, "dir", json_string(c->dir));
    json_object_set_new(j, "docs", json_integer(o->docs));
    json_object_set_new(j, "doc_tokens", json_integer(o->doc_tokens));
    json_object_set_new(j, "l1_chunks", json_integer((json_int_t)c->l1_chunks));
    json_object_set_new(j, "aligned", json_boolean(o->cold_aligned));
    json_object_set_new(j, "huge_pages_advised", json_boolean(o->cold_aligned == 2));
    json_object_set_new(j, "inflight", json_integer(o->cold_inflight ? o->cold_inflight : 1));
    json_object_set_new(j, "stored_docs", json_integer(c->stored_docs));
    for (unsigned i = 0; i < c->n; i++) {
        json_t *x = json_object();
        json_object_set_new(x, "gb_per_s", json_real(c->r[i].gbps));
        json_object_set_new(x, "seconds", json_real(c->r[i].seconds));
        json_object_set_new(x, "cpu_s", json_real(c->r[i].cpu_s));
        json_object_set_new(x, "check_s", json_real(c->r[i].check_s));
        json_object_set_new(x, "copy_s", json_real(c->r[i].copy_s));
        json_object_set_new(x, "first_bytes_ms", json_real(c->r[i].first_bytes_ms));
        json_object_set_new(x, "first_chunk_ms", json_real(c->r[i].first_chunk_ms));
        json_object_set_new(x, "bytes", json_integer((json_int_t)c->r[i].bytes));
        json_object_set_new(x, "l2_bytes", json_integer((json_int_t)c->r[i].l2_bytes));
        json_array_append_new(a, x);
    }
    json_object_set_new(j, "rounds", a);
    json_object_set_new(j, "median_gb_per_s", json_real(c->median_gbps));
    return j;
}

void kvb_cold_print(const opts *o, const cold_result *c)
{
    printf("L2-only retrieve (persistent L2 in %s, a new client each round; L1 of %llu chunks; "
           "%u docs x %u tokens into plain host memory%s, %u at once):\n",
           c->dir, (unsigned long long)c->l1_chunks, o->docs, o->doc_tokens,
           o->cold_aligned == 2 ? " (page-aligned, huge pages advised: read straight into it)"
           : o->cold_aligned    ? " (page-aligned: read straight into it)"
                                : "",
           o->cold_inflight ? o->cold_inflight : 1);
    for (unsigned i = 0; i < c->n; i++) {
        const cold_round *r = &c->r[i];
        double gb = (double)r->bytes / 1e9;
        printf("  round %u: %.2f GB/s (%.1f MiB retrieved, %.1f MiB read from L2, in %.3f s, "
               "CPU %.2f s)\n", i + 1, r->gbps, (double)r->bytes / (1 << 20),
               (double)r->l2_bytes / (1 << 20), r->seconds, r->cpu_s);
        double g = gb > 0 ? gb : 1;
        if (o->server) /* the process's CPU is the client's; checks and copies the daemon's */
            printf("    CPU per GB: the client %.3f s; the daemon checking %.3f s, copying out "
                   "%.3f s", r->cpu_s / g, r->check_s / g, r->copy_s / g);
        else
            printf("    CPU per GB: %.3f s (checking %.3f, copying out %.3f, the rest %.3f: "
                   "%.2f cores per 10 GB/s)", r->cpu_s / g, r->check_s / g, r->copy_s / g,
                   (r->cpu_s - r->check_s - r->copy_s) / g, r->cpu_s / g * 10);
        printf("; first bytes after %.2f ms, first chunk after %.2f ms (means)\n",
               r->first_bytes_ms, r->first_chunk_ms);
    }
    printf("  median %.2f GB/s\n", c->median_gbps);
}
