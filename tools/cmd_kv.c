/*
 * cmd_kv.c - `ferry kv bench`: the KV store under the workloads LMCache
 * measures, over a real model's KV shape, plus the reference figures its
 * targets are judged against, measured in the same run.
 *
 * Workloads (token ids are random, so only reuse makes hits):
 *  - qa:   D documents of T tokens; Q questions, each a document picked
 *          with Zipf popularity followed by a fresh question of q tokens.
 *  - chat: S sessions of N turns interleaved; each turn's prompt is the
 *          previous prompt plus a reply and a new message (t tokens).
 * Each prompt does what an engine does: lookup, retrieve the cached
 * prefix into the engine's buffer, store the whole prompt.
 *
 * References (same process, same buffers): memcpy bandwidth (L1 store and
 * retrieve >= 0.8x), hashing GB/s (>= 5), lookup of a 32k-token prompt with
 * its 128 chunks indexed (<= 20 us), and with --dir the read throughput of
 * the slab's I/O engine for chunk-size requests, as `ferry bench io` reads
 * (L2 retrieve >= 0.9x). --plot sweeps L1/L2 sizes (with a small stand-in
 * layout of the same chunk count, so only hit rates are drawn) and writes a
 * gnuplot PNG of hit rate against them.
 *
 * --remote URL adds the Redis/Valkey tier (keys under a prefix unique to
 * the run, with a 1-hour TTL): the run's stores write through to it and
 * chunks evicted locally are found there again. Its reference is a second
 * store with empty local tiers (another engine sharing the server) that
 * looks up and retrieves every prompt from the server, clearing its local
 * tiers after each, against ferry_remote_get of the same value size on
 * the same server; the run's keys are deleted at the end.
 */
#include <errno.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>

#include "cli.h"
#include "remote/remote_int.h"

#define CMD "kv bench"
#define PC_MAX_ROUNDS 64 /* --persist-rounds */
#define FERRY_MAXU(a, b) ((a) > (b) ? (a) : (b))

typedef struct opts {
    const char *workload, *model, *dir, *policy, *engine, *plot;
    uint64_t l1, l2;
    unsigned docs, doc_tokens, questions, qtokens;
    unsigned sessions, turns, turn_tokens;
    unsigned chunk_tokens;
    unsigned layers, heads, head_dim;
    double zipf;
    uint64_t seed;
    int json, refs, persistent;
    const char *remote;      /* --remote URL */
    char remote_prefix[64];  /* this run's key prefix */
    unsigned persist_rounds; /* --persistent: rounds of each mode in the cost figure */
} opts;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* this thread's CPU time: on a loaded machine it separates what the code
 * costs from the time other processes took the core */
static double cpu_now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static uint64_t rng_next(uint64_t *s)
{
    uint64_t x = *s;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *s = x;
    return x * 0x2545F4914F6CDD1Dull;
}

static double pct(double *v, size_t n, double q)
{
    if (!n)
        return 0;
    qsort(v, n, sizeof *v, cli_cmp_double);
    size_t i = (size_t)(q * (double)(n - 1) + 0.5);
    return v[i < n ? i : n - 1];
}

static int layout_for(const opts *o, ferry_kv_layout *l)
{
    ferry_kv_layout d = FERRY_KV_LAYOUT_INIT;
    if (!strcmp(o->model, "llama3-8b")) {
        /* the default: 32 layers, 8 KV heads, head_dim 128, bf16 */
    } else if (!strcmp(o->model, "qwen2.5-0.5b")) {
        d.num_layers = 24;
        d.num_heads = 2;
        d.head_dim = 64;
    } else if (!strcmp(o->model, "tiny")) {
        d.num_layers = 2;
        d.num_heads = 2;
        d.head_dim = 64;
    } else {
        return -1;
    }
    if (o->layers)
        d.num_layers = o->layers;
    if (o->heads)
        d.num_heads = o->heads;
    if (o->head_dim)
        d.head_dim = o->head_dim;
    *l = d;
    return 0;
}

/* ---- the workload: a list of prompts ---- */
typedef struct prompt {
    const int32_t *tok;
    size_t n;
} prompt;

typedef struct workload {
    int32_t *pool;     /* every prompt's tokens */
    prompt *p;
    size_t np;
    size_t max_tokens;
    uint64_t unique_chunks; /* chunks a cache of infinite size would hold */
} workload;

static void workload_free(workload *w)
{
    free(w->pool);
    free(w->p);
}

static int make_workload(const opts *o, workload *w)
{
    uint64_t s = o->seed * 0x9E3779B97F4A7C15ull + 1;
    memset(w, 0, sizeof *w);
    if (!strcmp(o->workload, "qa")) {
        size_t dt = o->doc_tokens, qt = o->qtokens;
        size_t pool = (size_t)o->docs * dt + (size_t)o->questions * (dt + qt);
        w->pool = malloc(pool * sizeof(int32_t));
        w->p = calloc(o->questions, sizeof *w->p);
        if (!w->pool || !w->p)
            return -ENOMEM;
        int32_t *docs = w->pool, *q = w->pool + (size_t)o->docs * dt;
        for (size_t i = 0; i < (size_t)o->docs * dt; i++)
            docs[i] = (int32_t)(rng_next(&s) % 128000);
        double *cdf = malloc(o->docs * sizeof *cdf), tot = 0;
        if (!cdf)
            return -ENOMEM;
        for (unsigned d = 0; d < o->docs; d++)
            cdf[d] = (tot += 1.0 / pow((double)(d + 1), o->zipf));
        for (unsigned i = 0; i < o->questions; i++) {
            double u = (double)(rng_next(&s) >> 11) / 9007199254740992.0 * tot;
            unsigned d = 0;
            while (d + 1 < o->docs && cdf[d] < u)
                d++;
            memcpy(q, docs + (size_t)d * dt, dt * sizeof(int32_t));
            for (size_t k = 0; k < qt; k++)
                q[dt + k] = (int32_t)(rng_next(&s) % 128000);
            w->p[i].tok = q;
            w->p[i].n = dt + qt;
            q += dt + qt;
        }
        free(cdf);
        w->np = o->questions;
        w->max_tokens = dt + qt;
        w->unique_chunks = (uint64_t)o->docs * (dt / o->chunk_tokens) +
                           (uint64_t)o->questions * ((dt + qt) / o->chunk_tokens - dt / o->chunk_tokens);
        return 0;
    }
    if (!strcmp(o->workload, "chat")) {
        size_t per = (size_t)o->turns * o->turn_tokens;
        size_t np = (size_t)o->sessions * o->turns;
        w->pool = malloc((size_t)o->sessions * per * sizeof(int32_t));
        w->p = calloc(np, sizeof *w->p);
        if (!w->pool || !w->p)
            return -ENOMEM;
        for (size_t i = 0; i < (size_t)o->sessions * per; i++)
            w->pool[i] = (int32_t)(rng_next(&s) % 128000);
        /* turn k of session j: the first (k+1) * turn_tokens tokens of the
         * session's conversation; sessions interleave turn by turn */
        size_t k = 0;
        for (unsigned t = 0; t < o->turns; t++)
            for (unsigned j = 0; j < o->sessions; j++) {
                w->p[k].tok = w->pool + (size_t)j * per;
                w->p[k].n = (size_t)(t + 1) * o->turn_tokens;
                k++;
            }
        w->np = np;
        w->max_tokens = per;
        w->unique_chunks = (uint64_t)o->sessions * (per / o->chunk_tokens);
        return 0;
    }
    return -EINVAL;
}

/* ---- one run of the workload on one store ---- */
typedef struct run_result {
    uint64_t prompt_tokens, hit_tokens, retrieved_tokens;
    double store_s, retrieve_s;
    uint64_t stored_bytes, retrieved_bytes;
    double lookup_p50_us, lookup_p99_us;
    ferry_kv_stats m;
} run_result;

static int run_workload(ferry_kv *kv, const workload *w, ferry_kv_buffer *buf, int quiet,
                        run_result *r)
{
    memset(r, 0, sizeof *r);
    double *lat = malloc(w->np * sizeof *lat);
    if (!lat)
        return -ENOMEM;
    ferry_kv_stats a, b;
    ferry_kv_metrics(kv, &a);
    for (size_t i = 0; i < w->np; i++) {
        const prompt *p = &w->p[i];
        double t0 = now_s();
        int hit = ferry_kv_lookup(kv, p->tok, p->n, NULL);
        lat[i] = (now_s() - t0) * 1e6;
        if (hit < 0) {
            free(lat);
            return hit;
        }
        r->prompt_tokens += p->n;
        r->hit_tokens += (uint64_t)hit;
        if (hit > 0) {
            t0 = now_s();
            int got = ferry_kv_retrieve(kv, p->tok, (size_t)hit, NULL, buf);
            r->retrieve_s += now_s() - t0;
            if (got < 0) {
                free(lat);
                return got;
            }
            r->retrieved_tokens += (uint64_t)got;
        }
        t0 = now_s();
        int st = ferry_kv_store(kv, p->tok, p->n, NULL, buf);
        r->store_s += now_s() - t0;
        if (st < 0 && st != FERRY_ENOSPACE) {
            free(lat);
            return st;
        }
        if (!quiet)
            cli_progress("kv bench", i + 1, w->np);
    }
    if (!quiet)
        cli_progress_end();
    ferry_kv_flush(kv);
    ferry_kv_metrics(kv, &b);
    r->stored_bytes = b.stored_bytes - a.stored_bytes;
    r->retrieved_bytes = b.retrieved_bytes - a.retrieved_bytes;
    r->lookup_p50_us = pct(lat, w->np, 0.5);
    r->lookup_p99_us = pct(lat, w->np, 0.99);
    r->m = b;
    free(lat);
    return 0;
}

static uint64_t g_prefetch_max; /* 0: the store's default */

/* the remote client's options for a run (key prefix unique to it, values
 * expire after an hour so an interrupted run leaves nothing for long) */
static ferry_remote_options remote_opts(const opts *o)
{
    ferry_remote_options ro = FERRY_REMOTE_OPTIONS_INIT;
    ro.key_prefix = o->remote_prefix;
    ro.ttl_s = 3600;
    return ro;
}

static int open_store(const opts *o, const ferry_kv_layout *l, uint64_t l1, uint64_t l2,
                      const char *dir, ferry_kv **kv)
{
    ferry_kv_config c = FERRY_KV_CONFIG_INIT;
    c.prefetch_max_bytes = g_prefetch_max;
    c.model = o->model;
    c.layout = *l;
    c.chunk_tokens = o->chunk_tokens;
    c.l1_bytes = l1;
    c.l1_policy = c.l2_policy =
        !strcmp(o->policy, "s3fifo") ? FERRY_KV_EVICT_S3FIFO : FERRY_KV_EVICT_LRU;
    if (dir && l2) {
        c.l2_dir = dir;
        c.l2_bytes = l2;
        c.l2_direct = 1;
        c.l2_engine = o->engine;
        c.l2_persistent = o->persistent;
    }
    ferry_remote_options ro = remote_opts(o);
    if (o->remote) {
        c.remote_url = o->remote;
        c.remote_options = &ro;
    }
    c.workers = 2;
    return ferry_kv_open(&c, kv);
}

/* a contiguous host buffer of cap tokens in layout l */
static int engine_buffer(const ferry_kv_layout *l, uint64_t cap, ferry_kv_buffer *b, void **mem)
{
    uint64_t tb = (uint64_t)l->num_heads * l->head_dim * ferry_dtype_size(l->dtype);
    size_t bytes = (size_t)(l->kv * l->num_layers * cap * tb);
    void *p = NULL;
    /* on huge pages where the kernel gives them, as an engine's pinned KV
     * cache is: in this VM, copies into freshly written 4 KiB pages of a
     * large buffer intermittently ran 3-4x slower (the L2 retrieve figure
     * collapsing to 0.3x in whole runs), with identical code */
    size_t align = bytes >= (2u << 20) ? (2u << 20) : 4096;
    if (posix_memalign(&p, align, bytes))
        return -ENOMEM;
#ifdef MADV_HUGEPAGE
    if (align > 4096)
        (void)madvise(p, bytes, MADV_HUGEPAGE);
#endif
    unsigned char *c = p;
    for (size_t i = 0; i < bytes; i += 4096)
        c[i] = (unsigned char)(i >> 12);
    ferry_kv_buffer d = FERRY_KV_BUFFER_INIT;
    d.layout = *l;
    d.base = (uint64_t)(uintptr_t)p;
    d.capacity_tokens = cap;
    *b = d;
    *mem = p;
    return 0;
}

/* ---- references ---- */
#define L2_ROUNDS 15 /* measured rounds of the L2 reference, after one warm-up */
typedef struct refs {
    double memcpy_gbps, l1_store_gbps, l1_retrieve_gbps;
    double memcpy_gbps_cpu, l1_store_gbps_cpu, l1_retrieve_gbps_cpu;
    double hash_gbps, hash_gbps_cpu;
    double lookup32k_p50_us, lookup32k_p99_us, lookup32k_mean_us, lookup32k_cpu_us;
    /* L2: medians over alternating rounds (io read, retrieve, prefetch),
     * the ratios the medians of each round's own ratio */
    double io_read_gbps, l2_retrieve_gbps, l2_promote_gbps;
    double l2_retrieve_ratio, l2_promote_ratio, l2_retrieve_ratio_min, l2_retrieve_ratio_max;
    double l2_round[L2_ROUNDS][3]; /* GB/s: io read, retrieve, prefetch */
    unsigned l2_rounds;
    const char *io_engine;
    int have_l2;
    /* --remote */
    double remote_retrieve_gbps, remote_get_gbps, remote_hit_rate, remote_lookup_p50_us;
    uint64_t remote_retrieved_bytes;
    int have_remote;
} refs;

static void ref_hash(refs *r)
{
    size_t n = 8u << 20; /* 32 MiB of token ids, 32768 chunks of 256 */
    int32_t *t = malloc(n * sizeof *t);
    ferry_kv_hash *all = malloc((n / 256) * sizeof *all);
    if (!t || !all) {
        free(t);
        free(all);
        return;
    }
    for (size_t i = 0; i < n; i++)
        t[i] = (int32_t)(i * 2654435761u);
    unsigned reps = 0;
    double t0 = now_s(), c0 = cpu_now_s(), el;
    do {
        ferry_kv_hash_chunks(FERRY_KV_HASH_SEED_DEFAULT + reps, t, n, 256, 0, all, n / 256);
        reps++;
        el = now_s() - t0;
    } while (el < 0.4);
    double cpu = cpu_now_s() - c0;
    r->hash_gbps = (double)n * 4 * reps / el / 1e9;
    r->hash_gbps_cpu = cpu > 0 ? (double)n * 4 * reps / cpu / 1e9 : 0;
    free(all);
    free(t);
}

static void ref_lookup32k(const opts *o, refs *r)
{
    ferry_kv_layout l = FERRY_KV_LAYOUT_INIT;
    l.num_layers = 1;
    l.num_heads = 1;
    l.head_dim = 64;
    ferry_kv *kv;
    uint64_t chunk = 2ull * 256 * 64 * 2;
    opts so = *o;
    so.chunk_tokens = 256;
    if (open_store(&so, &l, 200 * chunk, 0, NULL, &kv) < 0)
        return;
    size_t n = 32768;
    int32_t *t = malloc(n * sizeof *t);
    ferry_kv_buffer b;
    void *mem = NULL;
    if (!t || engine_buffer(&l, n, &b, &mem) < 0) {
        free(t);
        ferry_kv_close(kv);
        return;
    }
    uint64_t s = 77;
    for (size_t i = 0; i < n; i++)
        t[i] = (int32_t)(rng_next(&s) % 128000);
    if (ferry_kv_store(kv, t, n, NULL, &b) == (int)n) {
        enum { REPS = 4000 };
        double *lat = malloc(REPS * sizeof *lat), sum = 0, c0 = cpu_now_s();
        for (int i = 0; lat && i < REPS; i++) {
            double t0 = now_s();
            int hit = ferry_kv_lookup(kv, t, n, NULL);
            lat[i] = (now_s() - t0) * 1e6;
            sum += lat[i];
            if (hit != (int)n)
                lat[i] = 1e9;
        }
        r->lookup32k_cpu_us = (cpu_now_s() - c0) / REPS * 1e6;
        if (lat) {
            r->lookup32k_mean_us = sum / REPS;
            r->lookup32k_p50_us = pct(lat, REPS, 0.5);
            r->lookup32k_p99_us = pct(lat, REPS, 0.99);
        }
        free(lat);
    }
    free(t);
    free(mem);
    ferry_kv_close(kv);
}

/* L1 store / retrieve of N chunks vs memcpy of the same bytes */
static void ref_l1(const opts *o, const ferry_kv_layout *l, uint64_t chunk, refs *r)
{
    unsigned nch = 16;
    while (nch > 2 && (uint64_t)nch * chunk > (1ull << 30))
        nch /= 2;
    size_t n = (size_t)nch * o->chunk_tokens, bytes = (size_t)nch * chunk;
    ferry_kv *kv;
    if (open_store(o, l, (uint64_t)(nch * 2 + 2) * chunk, 0, NULL, &kv) < 0)
        return;
    ferry_kv_buffer b, d;
    void *mb = NULL, *md = NULL;
    int32_t *t = malloc(n * sizeof *t);
    unsigned char *dst = NULL;
    if (!t || engine_buffer(l, n, &b, &mb) < 0 || engine_buffer(l, n, &d, &md) < 0 ||
        posix_memalign((void **)&dst, 4096, bytes)) {
        free(t);
        free(mb);
        free(md);
        ferry_kv_close(kv);
        return;
    }
    memset(dst, 1, bytes);
    /* best of several rounds, by wall time and by this thread's CPU time
     * (all three copy on this thread: on a loaded machine the CPU-time
     * figures are the ones that compare like with like) */
    double best[3] = {1e9, 1e9, 1e9}, best_cpu[3] = {1e9, 1e9, 1e9};
    for (int rep = 0; rep < 7; rep++) {
        for (size_t i = 0; i < n; i++)
            t[i] = (int32_t)(rep * 1000003 + (int)i);
        double w[3], c[3];
        double t0 = now_s(), c0 = cpu_now_s();
        memcpy(dst, mb, bytes);
        w[0] = now_s() - t0;
        c[0] = cpu_now_s() - c0;
        t0 = now_s();
        c0 = cpu_now_s();
        int st = ferry_kv_store(kv, t, n, NULL, &b);
        w[1] = now_s() - t0;
        c[1] = cpu_now_s() - c0;
        t0 = now_s();
        c0 = cpu_now_s();
        int rt = ferry_kv_retrieve(kv, t, n, NULL, &d);
        w[2] = now_s() - t0;
        c[2] = cpu_now_s() - c0;
        ferry_kv_clear(kv);
        if (rep == 0 || st != (int)n || rt != (int)n)
            continue; /* the first round faults the pool's pages in */
        for (int k = 0; k < 3; k++) {
            best[k] = w[k] < best[k] ? w[k] : best[k];
            best_cpu[k] = c[k] > 0 && c[k] < best_cpu[k] ? c[k] : best_cpu[k];
        }
    }
    double *outs[3] = {&r->memcpy_gbps, &r->l1_store_gbps, &r->l1_retrieve_gbps};
    double *outc[3] = {&r->memcpy_gbps_cpu, &r->l1_store_gbps_cpu, &r->l1_retrieve_gbps_cpu};
    for (int k = 0; k < 3; k++) {
        *outs[k] = best[k] < 1e9 ? (double)bytes / best[k] / 1e9 : 0;
        *outc[k] = best_cpu[k] < 1e9 ? (double)bytes / best_cpu[k] / 1e9 : 0;
    }
    free(t);
    free(mb);
    free(md);
    free(dst);
    ferry_kv_close(kv);
}

/* one pass of `ferry bench io`'s read loop over nch chunk-size requests,
 * depth in flight: GB/s, 0 on a failure */
static double io_read_pass(ferry_io *io, ferry_file *f, char *buf, unsigned depth, unsigned nch,
                           uint64_t slot, ferry_io_req *reqs, ferry_io_req **ptrs,
                           ferry_io_req **done)
{
    double t0 = now_s();
    unsigned next = 0, inflight = 0, completed = 0;
    for (unsigned k = 0; k < depth && next < nch; k++, next++) {
        reqs[k] = (ferry_io_req){FERRY_IO_READ, f, buf + (size_t)k * slot, 0, (size_t)slot,
                                 next * slot, NULL, 0, {0}};
        ptrs[k] = &reqs[k];
        inflight++;
    }
    if (ferry_io_submit(io, ptrs, inflight) != (int)inflight)
        return 0;
    int bad = 0;
    while (completed < inflight) {
        int got = ferry_io_reap(io, done, 1, depth, -1);
        if (got <= 0)
            return 0; /* requests may still be in flight: the caller stops */
        for (int k = 0; k < got; k++) {
            completed++;
            if (done[k]->result != (int64_t)slot)
                bad = 1;
            if (next < nch && !bad) {
                done[k]->offset = next * slot;
                next++;
                ferry_io_req *one = done[k];
                if (ferry_io_submit(io, &one, 1) == 1)
                    inflight++;
                else
                    bad = 1;
            }
        }
    }
    double el = now_s() - t0;
    return bad || next < nch ? 0 : (double)nch * slot / el / 1e9;
}

/*
 * The L2 reference, in alternating rounds so both sides see the same
 * machine (the disk is a shared virtio device, the CPUs shared too): each
 * round reads nch chunk-size requests with the slab's engine as `ferry
 * bench io` does (depth in flight), then retrieves a prompt of nch chunks
 * that is only in L2 (slab -> L1 -> engine buffer), then prefetches
 * another (slab -> L1 only: the slab leg alone). Three prompts take turns
 * (retrieve A, prefetch B, retrieve C, prefetch A, ...), so each is two
 * prompts old, out of an L1 of nch + 10 chunks, when its turn comes.
 */
static void ref_l2(const opts *o, const ferry_kv_layout *l, uint64_t chunk, refs *r)
{
    unsigned nch = 24;
    while (nch > 6 && (uint64_t)nch * chunk > (3ull << 30))
        nch /= 2;
    uint64_t slot = (chunk + 4095) & ~4095ull;
    char path[4096];
    snprintf(path, sizeof path, "%s/ferry-kv-bench-ref.bin", o->dir);
    ferry_io_options io_opt = FERRY_IO_OPTIONS_INIT;
    io_opt.engine = o->engine;
    ferry_io *io = NULL;
    ferry_file *f = NULL;
    void *buf = NULL, *mem = NULL;
    ferry_kv *kv = NULL;
    int32_t *t = NULL;
    ferry_io_req *reqs = NULL, **ptrs = NULL, **done = NULL;
    if (ferry_io_open(&io_opt, &io) < 0)
        return;
    r->io_engine = ferry_io_engine(io);
    unsigned depth = ferry_io_depth(io);
    if (ferry_file_open(io, path,
                        FERRY_FILE_READ | FERRY_FILE_WRITE | FERRY_FILE_CREATE | FERRY_FILE_TRUNC |
                            FERRY_FILE_DIRECT,
                        &f) < 0 ||
        ferry_io_buffer_alloc(io, (size_t)slot * depth, &buf) < 0)
        goto out;
    memset(buf, 7, (size_t)slot * depth);
    ferry_file_allocate(f, 0, slot * nch);
    for (unsigned i = 0; i < nch; i++)
        if (ferry_io_pwrite(io, f, (char *)buf + (size_t)(i % depth) * slot, slot, i * slot) < 0)
            goto out;
    ferry_file_sync(f);
    reqs = calloc(depth, sizeof *reqs);
    ptrs = calloc(depth, sizeof *ptrs);
    done = calloc(depth, sizeof *done);
    if (!reqs || !ptrs || !done)
        goto out;

    g_prefetch_max = (uint64_t)nch * slot;
    int orc = open_store(o, l, (uint64_t)(nch + 10) * slot, (uint64_t)(nch + 8) * 4 * slot,
                         o->dir, &kv);
    g_prefetch_max = 0;
    if (orc < 0) {
        fprintf(stderr, "ferry %s: L2 reference: opening the store: %s\n", CMD,
                ferry_last_error());
        kv = NULL;
        goto out;
    }
    size_t n = (size_t)nch * o->chunk_tokens;
    t = malloc(3 * n * sizeof *t);
    ferry_kv_buffer b;
    if (!t || engine_buffer(l, n, &b, &mem) < 0)
        goto out;
    for (size_t i = 0; i < 3 * n; i++)
        t[i] = (int32_t)(i * 7 + 3);
    for (int p = 0; p < 3; p++) {
        int s = ferry_kv_store(kv, t + (size_t)p * n, n, NULL, &b);
        ferry_kv_flush(kv);
        if (s != (int)n) {
            fprintf(stderr, "ferry %s: L2 reference: storing prompt %d of %zu tokens gave %d: %s\n",
                    CMD, p, n, s, ferry_last_error());
            goto out;
        }
    }
    double ratios[L2_ROUNDS], pratios[L2_ROUNDS], col[3][L2_ROUNDS];
    unsigned m = 0;
    for (unsigned round = 0; round <= L2_ROUNDS; round++) {
        double io_gbps = io_read_pass(io, f, buf, depth, nch, slot, reqs, ptrs, done);
        if (io_gbps <= 0) {
            fprintf(stderr, "ferry %s: L2 reference: slab read pass failed: %s\n", CMD,
                    ferry_last_error());
            goto out;
        }
        const int32_t *rt = t + (size_t)((2 * round) % 3) * n;
        const int32_t *pf = t + (size_t)((2 * round + 1) % 3) * n;
        ferry_kv_stats a, z;
        ferry_kv_metrics(kv, &a);
        double t0 = now_s();
        int got = ferry_kv_retrieve(kv, rt, n, NULL, &b);
        double el = now_s() - t0;
        ferry_kv_metrics(kv, &z);
        uint64_t from_l2 = z.tier[FERRY_KV_TIER_L2].bytes_read - a.tier[FERRY_KV_TIER_L2].bytes_read;
        if (got != (int)n || from_l2 < (uint64_t)nch * chunk) {
            fprintf(stderr,
                    "ferry %s: L2 reference: round %u: retrieve of %zu tokens gave %d, %llu bytes "
                    "from L2: %s\n",
                    CMD, round, n, got, (unsigned long long)from_l2, ferry_last_error());
            goto out;
        }
        double rt_gbps = (double)from_l2 / el / 1e9;
        ferry_kv_metrics(kv, &a);
        t0 = now_s();
        ferry_kv_prefetch(kv, pf, n, NULL);
        ferry_kv_flush(kv);
        el = now_s() - t0;
        ferry_kv_metrics(kv, &z);
        from_l2 = z.tier[FERRY_KV_TIER_L2].bytes_read - a.tier[FERRY_KV_TIER_L2].bytes_read;
        double pf_gbps = (double)from_l2 / el / 1e9;
        if (round == 0)
            continue; /* warm-up */
        r->l2_round[m][0] = col[0][m] = io_gbps;
        r->l2_round[m][1] = col[1][m] = rt_gbps;
        r->l2_round[m][2] = col[2][m] = pf_gbps;
        ratios[m] = rt_gbps / io_gbps;
        pratios[m] = pf_gbps / io_gbps;
        m++;
    }
    if (m == 0)
        goto out;
    r->l2_rounds = m;
    r->io_read_gbps = pct(col[0], m, 0.5);
    r->l2_retrieve_gbps = pct(col[1], m, 0.5);
    r->l2_promote_gbps = pct(col[2], m, 0.5);
    r->l2_retrieve_ratio = pct(ratios, m, 0.5); /* sorts ratios */
    r->l2_retrieve_ratio_min = ratios[0];
    r->l2_retrieve_ratio_max = ratios[m - 1];
    r->l2_promote_ratio = pct(pratios, m, 0.5);
    r->have_l2 = 1;
out:
    free(t);
    free(mem);
    ferry_kv_close(kv);
    free(reqs);
    free(ptrs);
    free(done);
    if (buf)
        ferry_io_buffer_free(io, buf);
    ferry_file_close(f);
    ferry_io_close(io);
    unlink(path);
}

/* a second store, local tiers empty, retrieves every prompt from the
 * server (clearing its local tiers after each); then ferry_remote_get of
 * one value of the chunk size, as many times, on the same server */
static void ref_remote(const opts *o, const char *url, const ferry_kv_layout *l, uint64_t chunk,
                       const workload *w, refs *r)
{
    opts so = *o;
    so.remote = url;
    so.persistent = 0;
    ferry_kv *kv;
    if (open_store(&so, l, o->l1, 0, NULL, &kv) < 0) {
        fprintf(stderr, "ferry %s: remote reference: opening the store: %s\n", CMD,
                ferry_last_error());
        return;
    }
    ferry_kv_buffer b;
    void *mem = NULL;
    double *lat = malloc(w->np * sizeof *lat);
    if (!lat || engine_buffer(l, w->max_tokens, &b, &mem) < 0) {
        free(lat);
        ferry_kv_close(kv);
        return;
    }
    double el = 0;
    uint64_t bytes = 0, hit = 0, asked = 0;
    int warm = 0;
    for (size_t i = 0; i < w->np; i++) {
        const prompt *p = &w->p[i];
        double t0 = now_s();
        int h = ferry_kv_lookup(kv, p->tok, p->n, NULL);
        lat[i] = (now_s() - t0) * 1e6;
        asked += p->n;
        if (h <= 0)
            continue;
        hit += (uint64_t)h;
        ferry_kv_stats a, z;
        ferry_kv_metrics(kv, &a);
        t0 = now_s();
        int got = ferry_kv_retrieve(kv, p->tok, (size_t)h, NULL, &b);
        double d = now_s() - t0;
        ferry_kv_metrics(kv, &z);
        if (got > 0 && warm++) { /* the first one is a warm-up (connections, caches) */
            el += d;
            bytes += z.retrieved_bytes - a.retrieved_bytes;
        }
        ferry_kv_clear(kv); /* local only: the next prompt comes from the server again */
    }
    r->remote_retrieve_gbps = el > 0 ? (double)bytes / el / 1e9 : 0;
    r->remote_retrieved_bytes = bytes;
    r->remote_hit_rate = asked ? (double)hit / (double)asked : 0;
    r->remote_lookup_p50_us = pct(lat, w->np, 0.5);
    /* leave nothing behind: delete this run's chunks on the server */
    for (size_t i = 0; i < w->np; i++)
        ferry_kv_delete(kv, w->p[i].tok, w->p[i].n, NULL);
    ferry_kv_close(kv);
    free(lat);

    /* the reference: the remote client alone, same value size and server:
     * distinct values into distinct buffers (as the store's chunks land in
     * distinct L1 slots), one thread, each value read once per round. The
     * store's retrieve reads ahead on its workers, so on an idle machine
     * it can pass this; on a loaded 2-core one both are noisy. */
    ferry_remote_options ro = remote_opts(o);
    ferry_remote *rc = NULL;
    uint64_t nref = bytes / chunk;
    if (nref > 64)
        nref = 64;
    while (nref > 4 && nref * chunk > (512ull << 20))
        nref /= 2;
    if (nref < 4)
        nref = 4;
    unsigned char *dst = NULL;
    int ok = ferry_remote_open(url, &ro, &rc) == 0 &&
             posix_memalign((void **)&dst, 4096, (size_t)(nref * chunk)) == 0;
    if (ok) {
        memset(dst, 3, (size_t)(nref * chunk));
        for (uint64_t i = 0; ok && i < nref; i++) {
            char key[32];
            int kl = snprintf(key, sizeof key, "ref:%llu", (unsigned long long)i);
            ok = ferry_remote_put_sync(rc, key, (size_t)kl, mem, chunk) == 0;
        }
    }
    /* like the store's figure: the first round warms up, the rest add up */
    double el_ref = 0;
    for (int round = 0; ok && round < 4; round++) {
        double t0 = now_s();
        for (uint64_t i = 0; ok && i < nref; i++) {
            char key[32];
            int kl = snprintf(key, sizeof key, "ref:%llu", (unsigned long long)i);
            ok = ferry_remote_get(rc, key, (size_t)kl, dst + i * chunk, chunk) == (int)chunk;
        }
        if (round)
            el_ref += now_s() - t0;
    }
    r->remote_get_gbps = ok && el_ref > 0 ? (double)(3 * nref * chunk) / el_ref / 1e9 : 0;
    if (!ok)
        fprintf(stderr, "ferry %s: remote reference: %s\n", CMD, ferry_last_error());
    for (uint64_t i = 0; rc && i < nref; i++) {
        char key[32];
        int kl = snprintf(key, sizeof key, "ref:%llu", (unsigned long long)i);
        ferry_remote_key k = {key, (size_t)kl};
        ferry_remote_delete(rc, &k, 1);
    }
    free(dst);
    ferry_remote_close(rc);
    free(mem);
    r->have_remote = 1;
}

/* ---- the hit-rate sweep and its plot ---- */
typedef struct point {
    uint64_t l1_chunks, l2_chunks;
    double hit_rate;
} point;

static int sweep(const opts *o, const workload *w, uint64_t chunk, point **out, size_t *np)
{
    ferry_kv_layout l = FERRY_KV_LAYOUT_INIT;
    l.num_layers = 1;
    l.num_heads = 1;
    l.head_dim = 64; /* a stand-in of 64 KiB per 256 tokens: same chunk counts */
    ferry_kv_buffer b;
    void *mem = NULL;
    int rc = engine_buffer(&l, w->max_tokens, &b, &mem);
    if (rc < 0)
        return rc;
    uint64_t small = 2ull * o->chunk_tokens * 64 * 2, sslot = (small + 4095) & ~4095ull;
    uint64_t ws = w->unique_chunks ? w->unique_chunks : 1;
    static const double l1f[] = {1.0 / 16, 1.0 / 8, 1.0 / 4, 1.0 / 2, 1.0, 1.5};
    static const double l2f[] = {0, 0.25, 0.5, 1.0};
    size_t nl2 = o->dir ? 4 : 1;
    point *p = calloc(6 * nl2, sizeof *p);
    if (!p) {
        free(mem);
        return -ENOMEM;
    }
    size_t k = 0;
    (void)chunk;
    for (size_t j = 0; j < nl2; j++) {
        for (size_t i = 0; i < 6; i++) {
            uint64_t c1 = (uint64_t)((double)ws * l1f[i]), c2 = (uint64_t)((double)ws * l2f[j]);
            if (c1 < 2)
                c1 = 2;
            ferry_kv *kv;
            opts so = *o;
            so.model = "sweep";
            so.persistent = 0; /* each point starts empty */
            rc = open_store(&so, &l, c1 * sslot, c2 * sslot, c2 ? o->dir : NULL, &kv);
            if (rc < 0)
                break;
            run_result rr;
            rc = run_workload(kv, w, &b, 1, &rr);
            ferry_kv_close(kv);
            if (rc < 0)
                break;
            p[k].l1_chunks = c1;
            p[k].l2_chunks = c2;
            p[k].hit_rate = rr.prompt_tokens ? (double)rr.hit_tokens / (double)rr.prompt_tokens : 0;
            k++;
            if (!o->json)
                cli_progress("sweep", k, 6 * nl2);
        }
        if (rc < 0)
            break;
    }
    if (!o->json)
        cli_progress_end();
    free(mem);
    *out = p;
    *np = k;
    return rc < 0 ? rc : 0;
}

static int plot(const opts *o, const point *p, size_t np, uint64_t chunk)
{
    char dat[] = "/tmp/ferry-kv-plot-XXXXXX";
    int fd = mkstemp(dat);
    if (fd < 0)
        return -errno;
    FILE *f = fdopen(fd, "w");
    if (!f) {
        close(fd);
        return -errno;
    }
    uint64_t maxb = 0;
    for (size_t i = 0; i < np; i++)
        maxb = FERRY_MAXU(maxb, FERRY_MAXU(p[i].l1_chunks, p[i].l2_chunks) * chunk);
    double unit = maxb >= (1ull << 30) ? (double)(1ull << 30) : (double)(1ull << 20);
    const char *uname = maxb >= (1ull << 30) ? "GiB" : "MiB";
    uint64_t last = UINT64_MAX;
    unsigned blocks = 0;
    for (size_t i = 0; i < np; i++) {
        if (p[i].l2_chunks != last) {
            if (last != UINT64_MAX)
                fprintf(f, "\n\n");
            fprintf(f, "# l2 %.3f %s\n", (double)p[i].l2_chunks * (double)chunk / unit, uname);
            last = p[i].l2_chunks;
            blocks++;
        }
        fprintf(f, "%.4f %.4f\n", (double)p[i].l1_chunks * (double)chunk / unit, p[i].hit_rate);
    }
    fclose(f);
    char gp[] = "/tmp/ferry-kv-gp-XXXXXX";
    fd = mkstemp(gp);
    if (fd < 0) {
        unlink(dat);
        return -errno;
    }
    f = fdopen(fd, "w");
    if (!f) {
        close(fd);
        unlink(dat);
        unlink(gp);
        return -errno;
    }
    fprintf(f, "set terminal png size 900,600\nset output '%s'\n", o->plot);
    fprintf(f, "set title 'ferry kv bench: %s, %s: hit rate vs tier sizes'\n", o->workload,
            o->model);
    fprintf(f, "set xlabel 'L1 (%s of KV)'\nset ylabel 'hit rate (tokens)'\nset yrange [0:1]\n"
               "set logscale x 2\nset key bottom right\nset grid\n",
            uname);
    fprintf(f, "plot ");
    last = UINT64_MAX;
    unsigned b = 0;
    for (size_t i = 0; i < np; i++) {
        if (p[i].l2_chunks == last)
            continue;
        last = p[i].l2_chunks;
        fprintf(f, "%s'%s' index %u using 1:2 with linespoints title 'L2 %.1f %s'",
                b ? ", " : "", dat, b, (double)p[i].l2_chunks * (double)chunk / unit, uname);
        b++;
    }
    fprintf(f, "\n");
    fclose(f);
    char cmd[512];
    snprintf(cmd, sizeof cmd, "gnuplot '%s' 2>&1", gp);
    int rc = system(cmd);
    unlink(dat);
    unlink(gp);
    (void)blocks;
    return rc == 0 ? 0 : -ENOEXEC;
}

static void usage(FILE *f)
{
    fprintf(f,
            "usage: ferry kv bench [options]\n"
            "  --workload qa|chat       long-document QA (default) or multi-turn chat\n"
            "  --docs D --doc-tokens T --questions Q --zipf S --question-tokens q\n"
            "                           qa: D documents of T tokens asked Q times (8, 4096, 64, 1.0, 64)\n"
            "  --sessions S --turns N --turn-tokens t\n"
            "                           chat: S sessions of N turns adding t tokens each (8, 6, 512)\n"
            "  --model llama3-8b|qwen2.5-0.5b|tiny   KV shape (default llama3-8b: 32 MiB/256 tokens)\n"
            "  --layers L --heads H --head-dim D     override the shape\n"
            "  --chunk-tokens N         tokens per chunk (256)\n"
            "  --l1 SIZE                host tier (default 2G)\n"
            "  --dir DIR --l2 SIZE      NVMe slab tier in DIR, an existing directory (--create\n"
            "                           makes it); default size 8G\n"
            "  --engine auto|posix|uring  the slab's I/O engine\n"
            "  --persistent             the L2 slab survives restarts (ferry/pslab.h); also\n"
            "                           measures what that costs: the store workload against\n"
            "                           a non-persistent and a persistent L2 (and the drive's own\n"
            "                           durable writes) in alternating rounds\n"
            "  --persist-rounds N       rounds of each for that figure (default 5, 0: skip)\n"
            "  --policy lru|s3fifo      eviction (default lru)\n"
            "  --remote URL             Redis/Valkey tier (redis://host:port/db, unix:///path)\n"
            "  --seed N  --no-refs  --json  --plot FILE.png\n"
            "ranges: --docs 1..65536, --doc-tokens 1..1048576, --questions 1..1000000,\n"
            "  --question-tokens 0..65536, --sessions 1..65536, --turns 1..4096, --turn-tokens\n"
            "  1..1048576, --chunk-tokens 1..65536, --layers 1..1024, --heads 1..1024,\n"
            "  --head-dim 1..4096, --persist-rounds 0..%d, --zipf 0..10, --l1/--l2 4K..16T;\n"
            "  all prompts at most 2^28 tokens, the longest prompt's KV at most 8 GiB\n",
            PC_MAX_ROUNDS);
}

/* a count option: flag, its field, its range */
typedef struct num_opt {
    const char *flag;
    size_t off;
    unsigned min, max;
} num_opt;

static const num_opt num_opts[] = {
    {"--docs", offsetof(opts, docs), 1, 65536},
    {"--doc-tokens", offsetof(opts, doc_tokens), 1, 1u << 20},
    {"--questions", offsetof(opts, questions), 1, 1000000},
    {"--question-tokens", offsetof(opts, qtokens), 0, 65536},
    {"--sessions", offsetof(opts, sessions), 1, 65536},
    {"--turns", offsetof(opts, turns), 1, 4096},
    {"--turn-tokens", offsetof(opts, turn_tokens), 1, 1u << 20},
    {"--chunk-tokens", offsetof(opts, chunk_tokens), 1, 65536},
    {"--layers", offsetof(opts, layers), 1, 1024},
    {"--heads", offsetof(opts, heads), 1, 1024},
    {"--head-dim", offsetof(opts, head_dim), 1, 4096},
    {"--persist-rounds", offsetof(opts, persist_rounds), 0, PC_MAX_ROUNDS},
};

/* 0 to run, 2 on a usage error (printed), -1 after --help */
static int parse(int argc, char **argv, opts *o)
{
    static const char *const workloads[] = {"qa", "chat", NULL};
    static const char *const models[] = {"llama3-8b", "qwen2.5-0.5b", "tiny", NULL};
    static const char *const policies[] = {"lru", "s3fifo", NULL};
    static const char *const engines[] = {"auto", "posix", "uring", NULL};
    int create = 0, l2_given = 0, engine_given = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        uint64_t x = 0;
        int k = 0, rc = 0, done = 0;
        for (size_t n = 0; n < sizeof num_opts / sizeof num_opts[0]; n++)
            if (!strcmp(a, num_opts[n].flag)) {
                rc = cli_opt_count(CMD, a, v, num_opts[n].min, num_opts[n].max, &x);
                if (rc)
                    return rc;
                *(unsigned *)(void *)((char *)o + num_opts[n].off) = (unsigned)x;
                i++;
                done = 1;
                break;
            }
        if (done)
            continue;
        if (!strcmp(a, "--l1") || !strcmp(a, "--l2")) {
            rc = cli_opt_size(CMD, a, v, 4096, 16ull << 40, 0, a[3] == '1' ? &o->l1 : &o->l2);
            l2_given |= a[3] == '2';
            i++;
        } else if (!strcmp(a, "--zipf")) {
            rc = cli_opt_real(CMD, a, v, 0, 10, &o->zipf);
            i++;
        } else if (!strcmp(a, "--seed")) {
            rc = cli_opt_u64(CMD, a, v, &o->seed);
            i++;
        } else if (!strcmp(a, "--workload")) {
            if ((rc = cli_opt_choice(CMD, a, v, workloads, &k)) == 0)
                o->workload = workloads[k];
            i++;
        } else if (!strcmp(a, "--model")) {
            if ((rc = cli_opt_choice(CMD, a, v, models, &k)) == 0)
                o->model = models[k];
            i++;
        } else if (!strcmp(a, "--policy")) {
            if ((rc = cli_opt_choice(CMD, a, v, policies, &k)) == 0)
                o->policy = policies[k];
            i++;
        } else if (!strcmp(a, "--engine")) {
            if ((rc = cli_opt_choice(CMD, a, v, engines, &k)) == 0)
                o->engine = engines[k];
            engine_given = 1;
            i++;
        } else if (!strcmp(a, "--dir")) {
            rc = cli_opt_string(CMD, a, v, "a directory", &o->dir);
            i++;
        } else if (!strcmp(a, "--plot")) {
            rc = cli_opt_string(CMD, a, v, "a PNG file to write", &o->plot);
            i++;
        } else if (!strcmp(a, "--create")) {
            create = 1;
        } else if (!strcmp(a, "--json")) {
            o->json = 1;
        } else if (!strcmp(a, "--no-refs")) {
            o->refs = 0;
        } else if (!strcmp(a, "--persistent")) {
            o->persistent = 1;
        } else if (!strcmp(a, "--remote")) {
            const char *acc = "redis://[user:password@]host:port/db or unix:///path";
            rc = cli_opt_string(CMD, a, v, acc, &o->remote);
            /* the URL itself is not echoed: it may hold a password */
            if (rc == 0 && ferry_remote_url_validate(o->remote) < 0)
                rc = cli_bad(CMD, a, NULL, acc, "%s", ferry_last_error());
            i++;
        } else if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return -1;
        } else {
            return cli_unknown(CMD, a);
        }
        if (rc)
            return rc;
    }
    char sz[32];
    if (!o->dir && l2_given)
        return cli_usage(CMD, "--l2 %s: the L2 tier needs --dir DIR; accepted: --dir DIR --l2 SIZE",
                         cli_size_str(o->l2, sz, sizeof sz));
    if (!o->dir && o->persistent)
        return cli_usage(CMD, "--persistent: the L2 tier needs --dir DIR; accepted: --dir DIR "
                              "--persistent");
    if (!o->dir && engine_given)
        return cli_usage(CMD, "--engine %s: the L2 tier needs --dir DIR; accepted: --dir DIR "
                              "--engine ENGINE", o->engine);
    /* the token ids of every prompt are held at once (4 bytes each) */
    uint64_t pool = !strcmp(o->workload, "qa")
                        ? (uint64_t)o->docs * o->doc_tokens +
                              (uint64_t)o->questions * (o->doc_tokens + o->qtokens)
                        : (uint64_t)o->sessions * o->turns * o->turn_tokens;
    if (pool > (1ull << 28))
        return cli_usage(CMD, "--%s: the workload's prompts hold %llu tokens; accepted: at most "
                              "268435456 (1G of token ids)",
                         !strcmp(o->workload, "qa") ? "questions x --doc-tokens"
                                                    : "sessions x --turns x --turn-tokens",
                         (unsigned long long)pool);
    if (o->dir) {
        int rc = cli_opt_dir(CMD, "--dir", o->dir, create);
        if (rc)
            return rc;
    }
    return 0;
}

static json_t *tier_json(const ferry_kv_tier_stats *t)
{
    json_t *o = json_object();
    json_object_set_new(o, "hits", json_integer((json_int_t)t->hits));
    json_object_set_new(o, "evictions", json_integer((json_int_t)t->evictions));
    json_object_set_new(o, "bytes_written", json_integer((json_int_t)t->bytes_written));
    json_object_set_new(o, "bytes_read", json_integer((json_int_t)t->bytes_read));
    json_object_set_new(o, "capacity_bytes", json_integer((json_int_t)t->capacity_bytes));
    json_object_set_new(o, "used_bytes", json_integer((json_int_t)t->used_bytes));
    json_object_set_new(o, "failures", json_integer((json_int_t)t->failures));
    return o;
}

static double ratio(double a, double b)
{
    return b > 0 ? a / b : 0;
}

/* ---- --persistent: what persistence costs, measured in this run ----
 *
 * The same store workload (every prompt's ferry_kv_store, in order; no
 * lookups or retrieves) on a fresh store whose L2 is the non-persistent
 * slab (A, ferry/gds.h) or the persistent one (B, ferry/pslab.h), in
 * alternating rounds A B (C) A B (C) ... in one directory on one drive
 * (DIR/ferry-kv-bench-persist, emptied before each round and removed at
 * the end). Timed, per round, from the first store until every chunk is
 * on the slab: the store calls, then ferry_kv_flush (every write-through's
 * write has returned), then for B ferry_kv_sync (the last group commit:
 * slab fdatasync, journal append, journal fdatasync). B's clock thus
 * stops at the durable commit point; A's stops when its O_DIRECT writes
 * have returned, with no sync (the non-persistent slab promises nothing
 * across a crash, and on a host-cached virtual disk its bytes may still
 * be in the host's cache then). Not timed: opening the store (creating
 * and preallocating the slab files), closing it, removing the files.
 * Throughput = bytes written to L2 / that time; the figure is the
 * median of B's rounds over the median of A's.
 *
 * A third round in each cycle (C) measures the drive's own durable write
 * rate, with no store in the loop: the bytes B wrote, as chunk-size
 * O_DIRECT writes (16 requests in flight each, as the L2 tiers write a
 * chunk) into a preallocated file in the same directory, then one
 * fdatasync. B / C is what ferry's persistent path costs over what the
 * durable bytes cost the drive anyway; C / A is what durability itself
 * costs on this drive (on a host-cached virtual disk, the host's cache
 * against its physical disk).
 */
#define PC_SUBDIR "ferry-kv-bench-persist"

typedef struct pc_round {
    int persistent; /* 0: A, 1: B, 2: C (raw durable writes) */
    double gbps, store_s, drain_s, sync_s;
    uint64_t l2_bytes, l2_failures, stored_bytes;
} pc_round;

typedef struct persist_cost {
    unsigned n;                 /* rounds run (both modes) */
    pc_round r[3 * PC_MAX_ROUNDS];
    double median[3], ratio, raw_ratio, load[3];
    int rc;
} persist_cost;

#define PC_RAW_FILE "ferry-kv-bench-raw.bin"

static void pc_clean(const char *sub)
{
    static const char *const names[] = {FERRY_GDS_SLAB_NAME, FERRY_PSLAB_FILE,
                                        FERRY_PSLAB_JOURNAL, FERRY_PSLAB_JOURNAL ".tmp",
                                        PC_RAW_FILE, "ferry.lock"};
    char path[4200];
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        snprintf(path, sizeof path, "%s/%s", sub, names[i]);
        unlink(path);
    }
}

static int pc_round_run(const opts *o, const ferry_kv_layout *l, const workload *w,
                        ferry_kv_buffer *buf, const char *sub, int persistent, pc_round *r)
{
    opts so = *o;
    so.persistent = persistent;
    so.remote = NULL;
    memset(r, 0, sizeof *r);
    r->persistent = persistent;
    pc_clean(sub);
    ferry_kv *kv;
    int rc = open_store(&so, l, o->l1, o->l2, sub, &kv);
    if (rc < 0)
        return rc;
    ferry_kv_stats a, b;
    ferry_kv_metrics(kv, &a);
    double t0 = now_s();
    for (size_t i = 0; i < w->np && rc >= 0; i++) {
        rc = ferry_kv_store(kv, w->p[i].tok, w->p[i].n, NULL, buf);
        if (rc == FERRY_ENOSPACE)
            rc = 0;
    }
    double t1 = now_s();
    if (rc >= 0)
        rc = ferry_kv_flush(kv);
    double t2 = now_s();
    if (rc >= 0 && persistent)
        rc = ferry_kv_sync(kv);
    double t3 = now_s();
    ferry_kv_metrics(kv, &b);
    ferry_kv_close(kv);
    pc_clean(sub);
    if (rc < 0)
        return rc;
    r->store_s = t1 - t0;
    r->drain_s = t2 - t1;
    r->sync_s = t3 - t2;
    r->l2_bytes = b.tier[FERRY_KV_TIER_L2].bytes_written - a.tier[FERRY_KV_TIER_L2].bytes_written;
    r->l2_failures = b.tier[FERRY_KV_TIER_L2].failures - a.tier[FERRY_KV_TIER_L2].failures;
    r->stored_bytes = b.stored_bytes - a.stored_bytes;
    r->gbps = t3 > t0 ? (double)r->l2_bytes / (t3 - t0) / 1e9 : 0;
    return 0;
}

/* C: bytes as chunk-size O_DIRECT writes at depth 16, then one fdatasync */
static int pc_raw_run(const opts *o, const char *sub, uint64_t chunk, uint64_t bytes,
                      pc_round *r)
{
    memset(r, 0, sizeof *r);
    r->persistent = 2;
    pc_clean(sub);
    uint64_t slot = (chunk + 4095) & ~4095ull, n = bytes / slot;
    if (!n)
        return 0;
    char path[4200];
    snprintf(path, sizeof path, "%s/%s", sub, PC_RAW_FILE);
    ferry_io_options io_opt = FERRY_IO_OPTIONS_INIT;
    io_opt.engine = o->engine;
    io_opt.depth = 16;
    ferry_io *io = NULL;
    ferry_file *f = NULL;
    void *buf = NULL;
    int rc = ferry_io_open(&io_opt, &io);
    if (rc == 0)
        rc = ferry_file_open(io, path,
                             FERRY_FILE_WRITE | FERRY_FILE_CREATE | FERRY_FILE_TRUNC |
                                 FERRY_FILE_DIRECT,
                             &f);
    if (rc == 0)
        rc = ferry_file_allocate(f, 0, n * slot);
    if (rc == 0)
        rc = ferry_io_buffer_alloc(io, (size_t)slot, &buf);
    if (rc == 0) {
        memset(buf, 0x5a, (size_t)slot);
        double t0 = now_s();
        for (uint64_t i = 0; i < n && rc == 0; i++)
            rc = ferry_io_pwrite(io, f, buf, (size_t)slot, i * slot);
        double t1 = now_s();
        if (rc == 0)
            rc = ferry_file_sync(f);
        double t2 = now_s();
        r->store_s = t1 - t0;
        r->sync_s = t2 - t1;
        r->l2_bytes = n * slot;
        r->gbps = t2 > t0 ? (double)r->l2_bytes / (t2 - t0) / 1e9 : 0;
    }
    if (buf)
        ferry_io_buffer_free(io, buf);
    ferry_file_close(f);
    ferry_io_close(io);
    pc_clean(sub);
    return rc;
}

static void persist_cost_run(const opts *o, const ferry_kv_layout *l, const workload *w,
                             uint64_t chunk, persist_cost *pc)
{
    memset(pc, 0, sizeof *pc);
    char sub[4096];
    snprintf(sub, sizeof sub, "%s/%s", o->dir, PC_SUBDIR);
    ferry_kv_buffer buf;
    void *mem = NULL;
    pc->rc = engine_buffer(l, w->max_tokens, &buf, &mem);
    double v[3][PC_MAX_ROUNDS];
    unsigned nv[3] = {0, 0, 0};
    uint64_t b_bytes = 0;
    for (unsigned i = 0; pc->rc == 0 && i < 3 * o->persist_rounds; i++) {
        int p = (int)(i % 3); /* A B C A B C ... */
        if (!o->json)
            fprintf(stderr, "  persistence cost: round %u of %u (%s)\r", i + 1,
                    3 * o->persist_rounds,
                    p == 2 ? "raw durable writes" : p ? "persistent" : "non-persistent");
        if (p == 2)
            pc->rc = pc_raw_run(o, sub, chunk, b_bytes, &pc->r[i]);
        else
            pc->rc = pc_round_run(o, l, w, &buf, sub, p, &pc->r[i]);
        if (pc->rc == 0) {
            if (p == 1)
                b_bytes = pc->r[i].l2_bytes;
            v[p][nv[p]++] = pc->r[i].gbps;
            pc->n = i + 1;
        }
    }
    if (!o->json)
        fprintf(stderr, "%60s\r", "");
    rmdir(sub);
    free(mem);
    pc->median[0] = pct(v[0], nv[0], 0.5);
    pc->median[1] = pct(v[1], nv[1], 0.5);
    pc->median[2] = pct(v[2], nv[2], 0.5);
    pc->ratio = ratio(pc->median[1], pc->median[0]);
    pc->raw_ratio = ratio(pc->median[1], pc->median[2]);
    if (getloadavg(pc->load, 3) < 0)
        pc->load[0] = pc->load[1] = pc->load[2] = 0;
}

static json_t *persist_cost_json(const persist_cost *pc)
{
    json_t *j = json_object(), *a = json_array();
    for (unsigned i = 0; i < pc->n; i++) {
        const pc_round *r = &pc->r[i];
        json_t *x = json_object();
        json_object_set_new(x, "mode", json_string(r->persistent == 2 ? "raw_durable"
                                                   : r->persistent ? "persistent"
                                                                   : "nonpersistent"));
        json_object_set_new(x, "gb_per_s", json_real(r->gbps));
        json_object_set_new(x, "store_s", json_real(r->store_s));
        json_object_set_new(x, "drain_s", json_real(r->drain_s));
        json_object_set_new(x, "sync_s", json_real(r->sync_s));
        json_object_set_new(x, "l2_bytes", json_integer((json_int_t)r->l2_bytes));
        json_object_set_new(x, "l2_failures", json_integer((json_int_t)r->l2_failures));
        json_object_set_new(x, "stored_bytes", json_integer((json_int_t)r->stored_bytes));
        json_array_append_new(a, x);
    }
    json_object_set_new(j, "rounds", a);
    json_object_set_new(j, "nonpersistent_median_gb_per_s", json_real(pc->median[0]));
    json_object_set_new(j, "persistent_median_gb_per_s", json_real(pc->median[1]));
    json_object_set_new(j, "raw_durable_median_gb_per_s", json_real(pc->median[2]));
    json_object_set_new(j, "persist_store_ratio", json_real(pc->ratio));
    json_object_set_new(j, "persistent_vs_raw_durable_ratio", json_real(pc->raw_ratio));
    json_object_set_new(j, "raw_durable_vs_nonpersistent_ratio",
                        json_real(ratio(pc->median[2], pc->median[0])));
    json_object_set_new(j, "load_average", json_real(pc->load[0]));
    if (pc->rc < 0)
        json_object_set_new(j, "error", json_string(ferry_last_error()));
    return j;
}

static void persist_cost_print(const persist_cost *pc)
{
    printf("\npersistence cost (same run: the store workload on a fresh store, L2 non-persistent "
           "(A) and persistent (B), and the drive's own durable writes of B's bytes (C), in "
           "alternating rounds; load average %.2f %.2f %.2f on %ld CPUs)\n",
           pc->load[0], pc->load[1], pc->load[2], sysconf(_SC_NPROCESSORS_ONLN));
    printf("  timed: A, B: stores + drain of the write-through (+ B's last durable commit); "
           "C: O_DIRECT writes + one fdatasync\n");
    for (unsigned i = 0; i < pc->n; i++) {
        const pc_round *r = &pc->r[i];
        if (r->persistent == 2)
            printf("  round %2u C raw durable      %6.2f GB/s  (%.2f GiB in %.3f s: writes %.3f, "
                   "fdatasync %.3f)\n",
                   i + 1, r->gbps, (double)r->l2_bytes / (1 << 30), r->store_s + r->sync_s,
                   r->store_s, r->sync_s);
        else
            printf("  round %2u %s  %6.2f GB/s  (%.2f GiB to L2 in %.3f s: stores %.3f, drain "
                   "%.3f, sync %.3f; L2 failures %llu)\n",
                   i + 1, r->persistent ? "B persistent    " : "A non-persistent", r->gbps,
                   (double)r->l2_bytes / (1 << 30), r->store_s + r->drain_s + r->sync_s,
                   r->store_s, r->drain_s, r->sync_s, (unsigned long long)r->l2_failures);
    }
    if (pc->rc < 0)
        printf("  stopped: %s\n", ferry_last_error());
    printf("  median              A %.2f GB/s, B %.2f GB/s, C %.2f GB/s\n", pc->median[0],
           pc->median[1], pc->median[2]);
    printf("  persistent / non-persistent (B/A) = %.3f (target >= 0.90); of that, the drive's "
           "durable rate C/A = %.3f and ferry's persistent path B/C = %.3f\n",
           pc->ratio, ratio(pc->median[2], pc->median[0]), pc->raw_ratio);
}

int cmd_kv_bench(int argc, char **argv)
{
    opts o = {"qa", "llama3-8b", NULL, "lru", NULL, NULL, 2ull << 30, 8ull << 30, 8, 4096, 64, 64,
              8, 6, 512, 256, 0, 0, 0, 1.0, 1, 0, 1, 0, NULL, "", 5};
    int prc = parse(argc, argv, &o);
    if (prc)
        return prc < 0 ? 0 : prc;
    snprintf(o.remote_prefix, sizeof o.remote_prefix, "ferry:kvbench:%ld:%llx:", (long)getpid(),
             (unsigned long long)time(NULL));
    ferry_kv_layout l;
    if (layout_for(&o, &l) < 0)
        return cli_usage(CMD, "--model %s: unknown; accepted: llama3-8b, qwen2.5-0.5b or tiny",
                         o.model);
    uint64_t chunk;
    if (ferry_kv_layout_chunk_bytes(&l, o.chunk_tokens, &chunk) < 0)
        return cli_usage(CMD, "--chunk-tokens %u: %s; accepted: a chunk the layout can hold",
                         o.chunk_tokens, ferry_last_error());
    char c1[32], c2[32];
    if (o.l1 < chunk)
        return cli_usage(CMD, "--l1 %s: less than one %s chunk of this layout; accepted: at "
                              "least %s", cli_size_str(o.l1, c1, sizeof c1),
                         cli_size_str(chunk, c2, sizeof c2), c2);
    if (o.dir && o.l2 < chunk)
        return cli_usage(CMD, "--l2 %s: less than one %s chunk of this layout; accepted: at "
                              "least %s", cli_size_str(o.l2, c1, sizeof c1),
                         cli_size_str(chunk, c2, sizeof c2), c2);
    /* the engine buffer holds the longest prompt's KV */
    uint64_t longest = !strcmp(o.workload, "qa") ? (uint64_t)o.doc_tokens + o.qtokens
                                                 : (uint64_t)o.turns * o.turn_tokens;
    double buf_bytes = (double)chunk / o.chunk_tokens * (double)longest;
    if (buf_bytes > (double)(8ull << 30))
        return cli_usage(CMD, "--%s %u: a prompt of %llu tokens needs %.1f GiB of KV in the "
                              "engine buffer; accepted: at most 8 GiB",
                         !strcmp(o.workload, "qa") ? "doc-tokens" : "turn-tokens",
                         !strcmp(o.workload, "qa") ? o.doc_tokens : o.turn_tokens,
                         (unsigned long long)longest, buf_bytes / (1 << 30));
    workload w;
    int rc = make_workload(&o, &w);
    if (rc < 0)
        return cli_fail(CMD, "building the workload", rc);
    if (!o.json) {
        printf("ferry kv bench: %s", o.workload);
        if (!strcmp(o.workload, "qa"))
            printf(" (%u docs x %u tokens, %u questions of +%u tokens, zipf %.2f)", o.docs,
                   o.doc_tokens, o.questions, o.qtokens, o.zipf);
        else
            printf(" (%u sessions x %u turns of %u tokens)", o.sessions, o.turns, o.turn_tokens);
        printf("\n  shape %s: %u layers x %u KV heads x %u dims, %s: %.2f MiB per %u-token chunk\n",
               o.model, l.num_layers, l.num_heads, l.head_dim, ferry_dtype_name(l.dtype),
               (double)chunk / (1 << 20), o.chunk_tokens);
        printf("  tiers: L1 %.2f GiB (%s)", (double)o.l1 / (1 << 30), o.policy);
        if (o.dir)
            printf(", L2 %.2f GiB in %s%s", (double)o.l2 / (1 << 30), o.dir,
                   o.persistent ? " (persistent)" : "");
        if (o.remote) {
            /* never the password: the URL as the remote module quotes it */
            static ferry__rurl u;
            if (ferry__rurl_parse(o.remote, strlen(o.remote), &u, NULL) == 0)
                printf(", remote %s", u.redacted);
        }
        printf("\n");
        fflush(stdout);
    }

    ferry_kv *kv;
    rc = open_store(&o, &l, o.l1, o.l2, o.dir, &kv);
    if (rc < 0) {
        workload_free(&w);
        return cli_fail(CMD, "opening the store", rc);
    }
    ferry_kv_buffer buf;
    void *mem = NULL;
    rc = engine_buffer(&l, w.max_tokens, &buf, &mem);
    if (rc < 0) {
        ferry_kv_close(kv);
        workload_free(&w);
        return cli_fail(CMD, "allocating the engine buffer", rc);
    }
    run_result rr;
    double t0 = now_s();
    rc = run_workload(kv, &w, &buf, o.json, &rr);
    double wall = now_s() - t0;
    char *prom = NULL;
    ferry_kv_close(kv);
    free(mem);
    if (rc < 0) {
        workload_free(&w);
        return cli_fail(CMD, "running the workload", rc);
    }
    (void)prom;

    refs rf;
    memset(&rf, 0, sizeof rf);
    int persistent = o.persistent;
    const char *remote = o.remote;
    o.remote = NULL; /* references and the sweep run on local tiers */
    if (o.refs && remote)
        ref_remote(&o, remote, &l, chunk, &w, &rf);
    if (o.refs) {
        o.persistent = 0; /* references start from empty tiers */
        ref_hash(&rf);
        ref_lookup32k(&o, &rf);
        ref_l1(&o, &l, chunk, &rf);
        if (o.dir)
            ref_l2(&o, &l, chunk, &rf);
    }
    persist_cost pcost;
    int have_pcost = persistent && o.dir && o.persist_rounds > 0;
    if (have_pcost)
        persist_cost_run(&o, &l, &w, chunk, &pcost);
    point *pts = NULL;
    size_t npts = 0;
    int plot_rc = 0;
    if (o.plot) {
        plot_rc = sweep(&o, &w, chunk, &pts, &npts);
        if (plot_rc == 0)
            plot_rc = plot(&o, pts, npts, chunk);
    }

    double hit_rate = rr.prompt_tokens ? (double)rr.hit_tokens / (double)rr.prompt_tokens : 0;
    double st_gbps = rr.store_s > 0 ? (double)rr.stored_bytes / rr.store_s / 1e9 : 0;
    double rt_gbps = rr.retrieve_s > 0 ? (double)rr.retrieved_bytes / rr.retrieve_s / 1e9 : 0;
    const ferry_kv_tier_stats *t1 = &rr.m.tier[FERRY_KV_TIER_L1], *t2 = &rr.m.tier[FERRY_KV_TIER_L2];
    if (o.json) {
        json_t *j = json_object();
        json_object_set_new(j, "workload", json_string(o.workload));
        json_object_set_new(j, "model", json_string(o.model));
        json_object_set_new(j, "chunk_tokens", json_integer(o.chunk_tokens));
        json_object_set_new(j, "chunk_bytes", json_integer((json_int_t)chunk));
        json_object_set_new(j, "policy", json_string(o.policy));
        json_object_set_new(j, "l1_bytes", json_integer((json_int_t)o.l1));
        json_object_set_new(j, "l2_bytes", json_integer(o.dir ? (json_int_t)o.l2 : 0));
        json_object_set_new(j, "l2_persistent", json_boolean(o.dir && persistent));
        json_object_set_new(j, "prompts", json_integer((json_int_t)w.np));
        json_object_set_new(j, "prompt_tokens", json_integer((json_int_t)rr.prompt_tokens));
        json_object_set_new(j, "hit_tokens", json_integer((json_int_t)rr.hit_tokens));
        json_object_set_new(j, "hit_rate", json_real(hit_rate));
        json_object_set_new(j, "recompute_avoided_tokens",
                            json_integer((json_int_t)rr.retrieved_tokens));
        json_object_set_new(j, "store_gb_per_s", json_real(st_gbps));
        json_object_set_new(j, "retrieve_gb_per_s", json_real(rt_gbps));
        json_object_set_new(j, "stored_bytes", json_integer((json_int_t)rr.stored_bytes));
        json_object_set_new(j, "retrieved_bytes", json_integer((json_int_t)rr.retrieved_bytes));
        json_object_set_new(j, "lookup_p50_us", json_real(rr.lookup_p50_us));
        json_object_set_new(j, "lookup_p99_us", json_real(rr.lookup_p99_us));
        json_object_set_new(j, "wall_s", json_real(wall));
        json_t *tiers = json_object();
        json_object_set_new(tiers, "l1", tier_json(t1));
        if (o.dir)
            json_object_set_new(tiers, "l2", tier_json(t2));
        if (remote)
            json_object_set_new(tiers, "remote", tier_json(&rr.m.tier[FERRY_KV_TIER_REMOTE]));
        json_object_set_new(j, "tiers", tiers);
        if (remote) {
            json_t *x = json_object();
            json_object_set_new(x, "lookups", json_integer((json_int_t)rr.m.remote_lookups));
            json_object_set_new(x, "found_chunks",
                                json_integer((json_int_t)rr.m.remote_found_chunks));
            json_object_set_new(x, "puts", json_integer((json_int_t)rr.m.remote_puts));
            json_object_set_new(x, "written", json_integer((json_int_t)rr.m.remote_written));
            json_object_set_new(x, "dropped", json_integer((json_int_t)rr.m.remote_dropped));
            json_object_set_new(x, "gets", json_integer((json_int_t)rr.m.remote_gets));
            json_object_set_new(x, "get_bytes", json_integer((json_int_t)rr.m.remote_get_bytes));
            json_object_set_new(x, "misses", json_integer((json_int_t)rr.m.remote_misses));
            json_object_set_new(x, "refused", json_integer((json_int_t)rr.m.remote_refused));
            json_object_set_new(x, "errors", json_integer((json_int_t)rr.m.remote_errors));
            json_object_set_new(j, "remote", x);
        }
        if (o.refs) {
            json_t *r = json_object();
            json_object_set_new(r, "memcpy_gb_per_s", json_real(rf.memcpy_gbps));
            json_object_set_new(r, "l1_store_gb_per_s", json_real(rf.l1_store_gbps));
            json_object_set_new(r, "l1_retrieve_gb_per_s", json_real(rf.l1_retrieve_gbps));
            json_object_set_new(r, "l1_store_ratio", json_real(ratio(rf.l1_store_gbps, rf.memcpy_gbps)));
            json_object_set_new(r, "l1_retrieve_ratio",
                                json_real(ratio(rf.l1_retrieve_gbps, rf.memcpy_gbps)));
            json_object_set_new(r, "memcpy_gb_per_cpu_s", json_real(rf.memcpy_gbps_cpu));
            json_object_set_new(r, "l1_store_gb_per_cpu_s", json_real(rf.l1_store_gbps_cpu));
            json_object_set_new(r, "l1_retrieve_gb_per_cpu_s", json_real(rf.l1_retrieve_gbps_cpu));
            json_object_set_new(r, "l1_store_ratio_cpu",
                                json_real(ratio(rf.l1_store_gbps_cpu, rf.memcpy_gbps_cpu)));
            json_object_set_new(r, "l1_retrieve_ratio_cpu",
                                json_real(ratio(rf.l1_retrieve_gbps_cpu, rf.memcpy_gbps_cpu)));
            json_object_set_new(r, "hash_gb_per_s", json_real(rf.hash_gbps));
            json_object_set_new(r, "hash_gb_per_cpu_s", json_real(rf.hash_gbps_cpu));
            json_object_set_new(r, "lookup_32k_cpu_us", json_real(rf.lookup32k_cpu_us));
            json_object_set_new(r, "lookup_32k_p50_us", json_real(rf.lookup32k_p50_us));
            json_object_set_new(r, "lookup_32k_p99_us", json_real(rf.lookup32k_p99_us));
            json_object_set_new(r, "lookup_32k_mean_us", json_real(rf.lookup32k_mean_us));
            if (o.dir) {
                json_object_set_new(r, "io_engine", json_string(rf.io_engine ? rf.io_engine : ""));
                json_object_set_new(r, "io_read_gb_per_s", json_real(rf.io_read_gbps));
                json_object_set_new(r, "l2_retrieve_gb_per_s", json_real(rf.l2_retrieve_gbps));
                json_object_set_new(r, "l2_retrieve_ratio", json_real(rf.l2_retrieve_ratio));
                json_object_set_new(r, "l2_promote_gb_per_s", json_real(rf.l2_promote_gbps));
                json_object_set_new(r, "l2_promote_ratio", json_real(rf.l2_promote_ratio));
                json_t *rounds = json_array();
                for (unsigned i = 0; i < rf.l2_rounds; i++) {
                    json_t *x = json_object();
                    json_object_set_new(x, "io_read_gb_per_s", json_real(rf.l2_round[i][0]));
                    json_object_set_new(x, "l2_retrieve_gb_per_s", json_real(rf.l2_round[i][1]));
                    json_object_set_new(x, "l2_promote_gb_per_s", json_real(rf.l2_round[i][2]));
                    json_array_append_new(rounds, x);
                }
                json_object_set_new(r, "l2_rounds", rounds);
            }
            if (rf.have_remote) {
                json_object_set_new(r, "remote_cold_hit_rate", json_real(rf.remote_hit_rate));
                json_object_set_new(r, "remote_lookup_p50_us", json_real(rf.remote_lookup_p50_us));
                json_object_set_new(r, "remote_retrieve_gb_per_s",
                                    json_real(rf.remote_retrieve_gbps));
                json_object_set_new(r, "remote_get_gb_per_s", json_real(rf.remote_get_gbps));
                json_object_set_new(r, "remote_retrieve_ratio",
                                    json_real(ratio(rf.remote_retrieve_gbps, rf.remote_get_gbps)));
            }
            double la[3] = {0, 0, 0};
            if (getloadavg(la, 3) < 0)
                la[0] = 0;
            json_object_set_new(r, "load_average", json_real(la[0]));
            json_object_set_new(j, "references", r);
        }
        if (have_pcost) {
            json_object_set_new(j, "persistence", persist_cost_json(&pcost));
            json_object_set_new(j, "persist_store_ratio", json_real(pcost.ratio));
        }
        if (o.plot) {
            json_t *a = json_array();
            for (size_t i = 0; i < npts; i++) {
                json_t *p = json_object();
                json_object_set_new(p, "l1_bytes", json_integer((json_int_t)(pts[i].l1_chunks * chunk)));
                json_object_set_new(p, "l2_bytes", json_integer((json_int_t)(pts[i].l2_chunks * chunk)));
                json_object_set_new(p, "hit_rate", json_real(pts[i].hit_rate));
                json_array_append_new(a, p);
            }
            json_object_set_new(j, "sweep", a);
            json_object_set_new(j, "plot", json_string(plot_rc == 0 ? o.plot : ""));
        }
        char *s = json_dumps(j, JSON_COMPACT);
        printf("%s\n", s ? s : "{}");
        free(s);
        json_decref(j);
    } else {
        printf("\nresults (%zu prompts, %.1f s)\n", w.np, wall);
        printf("  hit rate            %.4f  (%llu of %llu prompt tokens cached)\n", hit_rate,
               (unsigned long long)rr.hit_tokens, (unsigned long long)rr.prompt_tokens);
        printf("  recompute avoided   %llu tokens\n", (unsigned long long)rr.retrieved_tokens);
        printf("  store               %.2f GB/s (%.2f GiB new chunks)\n", st_gbps,
               (double)rr.stored_bytes / (1 << 30));
        printf("  retrieve            %.2f GB/s (%.2f GiB)\n", rt_gbps,
               (double)rr.retrieved_bytes / (1 << 30));
        printf("  lookup              p50 %.2f us, p99 %.2f us\n", rr.lookup_p50_us,
               rr.lookup_p99_us);
        printf("  L1                  hits %llu, evictions %llu, written %.2f GiB, read %.2f GiB\n",
               (unsigned long long)t1->hits, (unsigned long long)t1->evictions,
               (double)t1->bytes_written / (1 << 30), (double)t1->bytes_read / (1 << 30));
        if (o.dir)
            printf("  L2                  hits %llu, evictions %llu, written %.2f GiB, read %.2f "
                   "GiB, failures %llu\n",
                   (unsigned long long)t2->hits, (unsigned long long)t2->evictions,
                   (double)t2->bytes_written / (1 << 30), (double)t2->bytes_read / (1 << 30),
                   (unsigned long long)t2->failures);
        if (remote)
            printf("  remote              hits %llu, %llu lookups found %llu chunks, fetched %.2f "
                   "GiB; %llu puts (%llu written, %llu dropped), %llu misses, %llu refused, "
                   "%llu errors\n",
                   (unsigned long long)rr.m.tier[FERRY_KV_TIER_REMOTE].hits,
                   (unsigned long long)rr.m.remote_lookups,
                   (unsigned long long)rr.m.remote_found_chunks,
                   (double)rr.m.remote_get_bytes / (1 << 30), (unsigned long long)rr.m.remote_puts,
                   (unsigned long long)rr.m.remote_written, (unsigned long long)rr.m.remote_dropped,
                   (unsigned long long)rr.m.remote_misses, (unsigned long long)rr.m.remote_refused,
                   (unsigned long long)rr.m.remote_errors);
        if (o.refs) {
            double la[3] = {0, 0, 0};
            if (getloadavg(la, 3) < 0)
                la[0] = 0;
            printf("\nreferences (same run; load average %.2f on %ld CPUs)\n", la[0],
                   sysconf(_SC_NPROCESSORS_ONLN));
            printf("  memcpy              %.2f GB/s, %.2f GB per CPU second\n", rf.memcpy_gbps,
                   rf.memcpy_gbps_cpu);
            printf("  L1 store            %.2f GB/s = %.2fx memcpy; per CPU second %.2f = %.2fx "
                   "(target >= 0.8x)\n",
                   rf.l1_store_gbps, ratio(rf.l1_store_gbps, rf.memcpy_gbps),
                   rf.l1_store_gbps_cpu, ratio(rf.l1_store_gbps_cpu, rf.memcpy_gbps_cpu));
            printf("  L1 retrieve         %.2f GB/s = %.2fx memcpy; per CPU second %.2f = %.2fx "
                   "(target >= 0.8x)\n",
                   rf.l1_retrieve_gbps, ratio(rf.l1_retrieve_gbps, rf.memcpy_gbps),
                   rf.l1_retrieve_gbps_cpu, ratio(rf.l1_retrieve_gbps_cpu, rf.memcpy_gbps_cpu));
            printf("  hashing             %.2f GB/s of token ids, %.2f GB per CPU second "
                   "(target >= 5)\n",
                   rf.hash_gbps, rf.hash_gbps_cpu);
            printf("  lookup 32k tokens   p50 %.2f us, p99 %.2f us, mean %.2f us, %.2f CPU us, with "
                   "128 chunks indexed (target <= 20 us)\n",
                   rf.lookup32k_p50_us, rf.lookup32k_p99_us, rf.lookup32k_mean_us,
                   rf.lookup32k_cpu_us);
            if (o.dir) {
                printf("  L2, %u alternating rounds (GB/s: slab reads as ferry bench io, %s, "
                       "chunk-size requests at depth 8 / L2 retrieve / L2 -> L1 prefetch):\n   ",
                       rf.l2_rounds, rf.io_engine ? rf.io_engine : "?");
                for (unsigned i = 0; i < rf.l2_rounds; i++)
                    printf(" %.2f/%.2f/%.2f", rf.l2_round[i][0], rf.l2_round[i][1],
                           rf.l2_round[i][2]);
                printf("\n  slab reads          %.2f GB/s (median)\n", rf.io_read_gbps);
                printf("  L2 -> L1            %.2f GB/s, median ratio %.2fx (prefetch: the slab "
                       "leg)\n",
                       rf.l2_promote_gbps, rf.l2_promote_ratio);
                printf("  L2 retrieve         %.2f GB/s, median ratio %.2fx, rounds %.2f..%.2fx "
                       "(target >= 0.9x; slab -> L1 -> engine buffer, the last leg a memcpy "
                       "here, a DMA on a GPU)\n",
                       rf.l2_retrieve_gbps, rf.l2_retrieve_ratio, rf.l2_retrieve_ratio_min,
                       rf.l2_retrieve_ratio_max);
            }
            if (rf.have_remote) {
                printf("  remote, cold store  hit rate %.4f, lookup p50 %.1f us (one round trip)\n",
                       rf.remote_hit_rate, rf.remote_lookup_p50_us);
                printf("  remote retrieve     %.2f GB/s = %.2fx ferry_remote_get of the same value "
                       "size (%.2f GB/s; server -> L1 -> engine buffer, %.2f GiB)\n",
                       rf.remote_retrieve_gbps, ratio(rf.remote_retrieve_gbps, rf.remote_get_gbps),
                       rf.remote_get_gbps, (double)rf.remote_retrieved_bytes / (1 << 30));
            }
        }
        if (have_pcost)
            persist_cost_print(&pcost);
        if (o.plot) {
            printf("\nhit rate by tier size (%s)\n", plot_rc == 0 ? o.plot : "plot failed");
            for (size_t i = 0; i < npts; i++)
                printf("  L1 %10.1f MiB  L2 %10.1f MiB  hit rate %.4f\n",
                       (double)(pts[i].l1_chunks * chunk) / (1 << 20),
                       (double)(pts[i].l2_chunks * chunk) / (1 << 20), pts[i].hit_rate);
        }
    }
    free(pts);
    workload_free(&w);
    if (have_pcost && pcost.rc < 0) {
        fprintf(stderr, "ferry %s: the persistence-cost rounds failed: %s\n", CMD,
                ferry_strerror(pcost.rc));
        return 1;
    }
    if (o.plot && plot_rc < 0) {
        fprintf(stderr, "ferry %s: the plot failed (%s); is gnuplot installed?\n", CMD,
                ferry_strerror(plot_rc));
        return 1;
    }
    return 0;
}
