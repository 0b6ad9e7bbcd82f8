/*
 * kv_bench_refs.c - the figures `ferry kv bench` puts its own next to,
 * measured in the same process with the same buffers:
 *  - memcpy bandwidth against L1 store and retrieve of the same bytes;
 *  - hashing GB/s of token ids (the XXH3-128 chain);
 *  - lookup of a 32k-token prompt with its 128 chunks indexed;
 *  - with --dir, the read throughput of the slab's I/O engine for
 *    chunk-size requests, as `ferry bench io` reads, in rounds alternating
 *    with an L2 retrieve and an L2 -> L1 prefetch;
 *  - with --remote, a second store with empty local tiers (another engine
 *    sharing the server) that looks up and retrieves every prompt from the
 *    server, against ferry_remote_get of the same value size on the same
 *    server; the run's keys are deleted at the end.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kv_bench.h"

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
    double t0 = kvb_now_s(), c0 = kvb_cpu_now_s(), el;
    do {
        ferry_kv_hash_chunks(FERRY_KV_HASH_SEED_DEFAULT + reps, t, n, 256, 0, all, n / 256);
        reps++;
        el = kvb_now_s() - t0;
    } while (el < 0.4);
    double cpu = kvb_cpu_now_s() - c0;
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
    so.dev = NULL; /* a stand-in layout: host memory */
    if (kvb_open_store(&so, &l, 200 * chunk, 0, NULL, &kv) < 0)
        return;
    size_t n = 32768;
    int32_t *t = malloc(n * sizeof *t);
    engine_buf b;
    if (!t || kvb_buffer_alloc(NULL, &l, n, &b) < 0) {
        free(t);
        ferry_kv_close(kv);
        return;
    }
    uint64_t s = 77;
    for (size_t i = 0; i < n; i++)
        t[i] = (int32_t)(kvb_rng_next(&s) % 128000);
    if (ferry_kv_store(kv, t, n, NULL, &b.b) == (int)n) {
        enum { REPS = 4000 };
        double *lat = malloc(REPS * sizeof *lat), sum = 0, c0 = kvb_cpu_now_s();
        for (int i = 0; lat && i < REPS; i++) {
            double t0 = kvb_now_s();
            int hit = ferry_kv_lookup(kv, t, n, NULL);
            lat[i] = (kvb_now_s() - t0) * 1e6;
            sum += lat[i];
            if (hit != (int)n)
                lat[i] = 1e9;
        }
        r->lookup32k_cpu_us = (kvb_cpu_now_s() - c0) / REPS * 1e6;
        if (lat) {
            r->lookup32k_mean_us = sum / REPS;
            r->lookup32k_p50_us = kvb_pct(lat, REPS, 0.5);
            r->lookup32k_p99_us = kvb_pct(lat, REPS, 0.99);
        }
        free(lat);
    }
    free(t);
    kvb_buffer_free(&b);
    ferry_kv_close(kv);
}

/* L1 store / retrieve of N chunks vs memcpy of the same bytes (host to
 * host: with a device buffer, from a host buffer of the same size) */
static void ref_l1(const opts *o, const ferry_kv_layout *l, uint64_t chunk, refs *r)
{
    unsigned nch = 16;
    while (nch > 2 && (uint64_t)nch * chunk > (1ull << 30))
        nch /= 2;
    size_t n = (size_t)nch * o->chunk_tokens, bytes = (size_t)nch * chunk;
    ferry_kv *kv;
    if (kvb_open_store(o, l, (uint64_t)(nch * 2 + 2) * chunk, 0, NULL, &kv) < 0)
        return;
    engine_buf b, d, h;
    memset(&b, 0, sizeof b);
    memset(&d, 0, sizeof d);
    memset(&h, 0, sizeof h);
    int32_t *t = malloc(n * sizeof *t);
    unsigned char *dst = NULL;
    int ok = t && kvb_buffer_alloc(o, l, n, &b) == 0 && kvb_buffer_alloc(o, l, n, &d) == 0;
    if (ok && !b.host && kvb_buffer_alloc(NULL, l, n, &h) < 0)
        ok = 0;
    if (ok && posix_memalign((void **)&dst, 4096, bytes))
        ok = 0;
    const unsigned char *src = ok ? (b.host ? b.host : h.host) : NULL;
    if (!ok) {
        free(t);
        free(dst);
        kvb_buffer_free(&b);
        kvb_buffer_free(&d);
        kvb_buffer_free(&h);
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
        double t0 = kvb_now_s(), c0 = kvb_cpu_now_s();
        memcpy(dst, src, bytes);
        w[0] = kvb_now_s() - t0;
        c[0] = kvb_cpu_now_s() - c0;
        t0 = kvb_now_s();
        c0 = kvb_cpu_now_s();
        int st = ferry_kv_store(kv, t, n, NULL, &b.b);
        w[1] = kvb_now_s() - t0;
        c[1] = kvb_cpu_now_s() - c0;
        t0 = kvb_now_s();
        c0 = kvb_cpu_now_s();
        int rt = ferry_kv_retrieve(kv, t, n, NULL, &d.b);
        w[2] = kvb_now_s() - t0;
        c[2] = kvb_cpu_now_s() - c0;
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
    kvb_buffer_free(&b);
    kvb_buffer_free(&d);
    kvb_buffer_free(&h);
    free(dst);
    ferry_kv_close(kv);
}

/* one pass of `ferry bench io`'s read loop over nch chunk-size requests,
 * depth in flight: GB/s, 0 on a failure */
static double io_read_pass(ferry_io *io, ferry_file *f, char *buf, unsigned depth, unsigned nch,
                           uint64_t slot, ferry_io_req *reqs, ferry_io_req **ptrs,
                           ferry_io_req **done)
{
    double t0 = kvb_now_s();
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
    double el = kvb_now_s() - t0;
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
typedef struct l2_ref {
    char path[4096];
    ferry_io *io;
    ferry_file *f;
    void *buf; /* depth slots, the reads' destination */
    unsigned depth, nch;
    uint64_t slot, chunk;
    ferry_io_req *reqs, **ptrs, **done;
    ferry_kv *kv;
    int32_t *t; /* three prompts of n tokens */
    size_t n;
    engine_buf b;
} l2_ref;

/* the reference file in DIR: nch slots written and synced, and the
 * request arrays of the read passes */
static int l2_ref_io(const opts *o, l2_ref *x)
{
    snprintf(x->path, sizeof x->path, "%s/ferry-kv-bench-ref.bin", o->dir);
    ferry_io_options io_opt = FERRY_IO_OPTIONS_INIT;
    io_opt.engine = o->engine;
    if (ferry_io_open(&io_opt, &x->io) < 0)
        return -1;
    x->depth = ferry_io_depth(x->io);
    if (ferry_file_open(x->io, x->path,
                        FERRY_FILE_READ | FERRY_FILE_WRITE | FERRY_FILE_CREATE | FERRY_FILE_TRUNC |
                            FERRY_FILE_DIRECT,
                        &x->f) < 0 ||
        ferry_io_buffer_alloc(x->io, (size_t)x->slot * x->depth, &x->buf) < 0)
        return -1;
    memset(x->buf, 7, (size_t)x->slot * x->depth);
    ferry_file_allocate(x->f, 0, x->slot * x->nch);
    for (unsigned i = 0; i < x->nch; i++)
        if (ferry_io_pwrite(x->io, x->f, (char *)x->buf + (size_t)(i % x->depth) * x->slot,
                            x->slot, i * x->slot) < 0)
            return -1;
    ferry_file_sync(x->f);
    x->reqs = calloc(x->depth, sizeof *x->reqs);
    x->ptrs = calloc(x->depth, sizeof *x->ptrs);
    x->done = calloc(x->depth, sizeof *x->done);
    return x->reqs && x->ptrs && x->done ? 0 : -1;
}

/* a store of L1 nch + 10 slots over DIR holding three prompts of nch chunks */
static int l2_ref_store(const opts *o, const ferry_kv_layout *l, l2_ref *x)
{
    opts so = *o;
    so.prefetch_max = (uint64_t)x->nch * x->slot;
    if (kvb_open_store(&so, l, (uint64_t)(x->nch + 10) * x->slot,
                       (uint64_t)(x->nch + 8) * 4 * x->slot, o->dir, &x->kv) < 0) {
        fprintf(stderr, "ferry %s: L2 reference: opening the store: %s\n", KVB_CMD,
                ferry_last_error());
        x->kv = NULL;
        return -1;
    }
    x->n = (size_t)x->nch * o->chunk_tokens;
    x->t = malloc(3 * x->n * sizeof *x->t);
    if (!x->t || kvb_buffer_alloc(o, l, x->n, &x->b) < 0)
        return -1;
    for (size_t i = 0; i < 3 * x->n; i++)
        x->t[i] = (int32_t)(i * 7 + 3);
    for (int p = 0; p < 3; p++) {
        int s = ferry_kv_store(x->kv, x->t + (size_t)p * x->n, x->n, NULL, &x->b.b);
        ferry_kv_flush(x->kv);
        if (s != (int)x->n) {
            fprintf(stderr, "ferry %s: L2 reference: storing prompt %d of %zu tokens gave %d: %s\n",
                    KVB_CMD, p, x->n, s, ferry_last_error());
            return -1;
        }
    }
    return 0;
}

/* bytes the store read from L2 since *a */
static uint64_t l2_read_since(ferry_kv *kv, const ferry_kv_stats *a)
{
    ferry_kv_stats z = FERRY_KV_STATS_INIT;
    ferry_kv_stats_get(kv, &z);
    return z.tier[FERRY_KV_TIER_L2].bytes_read - a->tier[FERRY_KV_TIER_L2].bytes_read;
}

/* one round: io read pass, retrieve of one prompt, prefetch of the next;
 * gbps[3] in that order; -1 on a failure (printed) */
static int l2_ref_round(l2_ref *x, unsigned round, double gbps[3])
{
    gbps[0] = io_read_pass(x->io, x->f, x->buf, x->depth, x->nch, x->slot, x->reqs, x->ptrs,
                           x->done);
    if (gbps[0] <= 0) {
        fprintf(stderr, "ferry %s: L2 reference: slab read pass failed: %s\n", KVB_CMD,
                ferry_last_error());
        return -1;
    }
    const int32_t *rt = x->t + (size_t)((2 * round) % 3) * x->n;
    const int32_t *pf = x->t + (size_t)((2 * round + 1) % 3) * x->n;
    ferry_kv_stats a = FERRY_KV_STATS_INIT;
    ferry_kv_stats_get(x->kv, &a);
    double t0 = kvb_now_s();
    int got = ferry_kv_retrieve(x->kv, rt, x->n, NULL, &x->b.b);
    double el = kvb_now_s() - t0;
    uint64_t from_l2 = l2_read_since(x->kv, &a);
    if (got != (int)x->n || from_l2 < (uint64_t)x->nch * x->chunk) {
        fprintf(stderr,
                "ferry %s: L2 reference: round %u: retrieve of %zu tokens gave %d, %llu bytes "
                "from L2: %s\n",
                KVB_CMD, round, x->n, got, (unsigned long long)from_l2, ferry_last_error());
        return -1;
    }
    gbps[1] = (double)from_l2 / el / 1e9;
    ferry_kv_stats_get(x->kv, &a);
    t0 = kvb_now_s();
    ferry_kv_prefetch(x->kv, pf, x->n, NULL);
    ferry_kv_flush(x->kv);
    el = kvb_now_s() - t0;
    gbps[2] = (double)l2_read_since(x->kv, &a) / el / 1e9;
    return 0;
}

static void l2_ref_free(l2_ref *x)
{
    free(x->t);
    kvb_buffer_free(&x->b);
    ferry_kv_close(x->kv);
    free(x->reqs);
    free(x->ptrs);
    free(x->done);
    if (x->buf)
        ferry_io_buffer_free(x->io, x->buf);
    ferry_file_close(x->f);
    ferry_io_close(x->io);
    if (x->path[0])
        unlink(x->path);
}

static void ref_l2(const opts *o, const ferry_kv_layout *l, uint64_t chunk, refs *r)
{
    l2_ref x;
    memset(&x, 0, sizeof x);
    x.nch = 24;
    while (x.nch > 6 && (uint64_t)x.nch * chunk > (3ull << 30))
        x.nch /= 2;
    x.chunk = chunk;
    x.slot = (chunk + 4095) & ~4095ull;
    int rc = l2_ref_io(o, &x);
    if (x.io)
        r->io_engine = ferry_io_engine(x.io);
    if (rc == 0)
        rc = l2_ref_store(o, l, &x);
    double ratios[L2_ROUNDS], pratios[L2_ROUNDS], col[3][L2_ROUNDS];
    unsigned m = 0;
    for (unsigned round = 0; rc == 0 && round <= L2_ROUNDS; round++) {
        double g[3];
        rc = l2_ref_round(&x, round, g);
        if (rc < 0 || round == 0)
            continue; /* round 0: the warm-up */
        for (int k = 0; k < 3; k++)
            r->l2_round[m][k] = col[k][m] = g[k];
        ratios[m] = g[1] / g[0];
        pratios[m] = g[2] / g[0];
        m++;
    }
    if (rc == 0 && m > 0) {
        r->l2_rounds = m;
        r->io_read_gbps = kvb_pct(col[0], m, 0.5);
        r->l2_retrieve_gbps = kvb_pct(col[1], m, 0.5);
        r->l2_promote_gbps = kvb_pct(col[2], m, 0.5);
        r->l2_retrieve_ratio = kvb_pct(ratios, m, 0.5); /* sorts ratios */
        r->l2_retrieve_ratio_min = ratios[0];
        r->l2_retrieve_ratio_max = ratios[m - 1];
        r->l2_promote_ratio = kvb_pct(pratios, m, 0.5);
        r->have_l2 = 1;
    }
    l2_ref_free(&x);
}

/* a second store, local tiers empty, retrieves every prompt from the
 * server (clearing its local tiers after each); the bytes it retrieved
 * after the first (a warm-up) */
static uint64_t ref_remote_store(const opts *o, const char *url, const ferry_kv_layout *l,
                                 const workload *w, refs *r)
{
    opts so = *o;
    so.remote = url;
    so.persistent = 0;
    ferry_kv *kv;
    if (kvb_open_store(&so, l, o->l1, 0, NULL, &kv) < 0) {
        fprintf(stderr, "ferry %s: remote reference: opening the store: %s\n", KVB_CMD,
                ferry_last_error());
        return 0;
    }
    engine_buf b;
    double *lat = malloc(w->np * sizeof *lat);
    if (!lat || kvb_buffer_alloc(o, l, w->max_tokens, &b) < 0) {
        free(lat);
        ferry_kv_close(kv);
        return 0;
    }
    double el = 0;
    uint64_t bytes = 0, hit = 0, asked = 0;
    int warm = 0;
    for (size_t i = 0; i < w->np; i++) {
        const prompt *p = &w->p[i];
        double t0 = kvb_now_s();
        int h = ferry_kv_lookup(kv, p->tok, p->n, NULL);
        lat[i] = (kvb_now_s() - t0) * 1e6;
        asked += p->n;
        if (h <= 0)
            continue;
        hit += (uint64_t)h;
        ferry_kv_stats a = FERRY_KV_STATS_INIT, z = FERRY_KV_STATS_INIT;
        ferry_kv_stats_get(kv, &a);
        t0 = kvb_now_s();
        int got = ferry_kv_retrieve(kv, p->tok, (size_t)h, NULL, &b.b);
        double d = kvb_now_s() - t0;
        ferry_kv_stats_get(kv, &z);
        if (got > 0 && warm++) { /* the first one is a warm-up (connections, caches) */
            el += d;
            bytes += z.retrieved_bytes - a.retrieved_bytes;
        }
        ferry_kv_clear(kv); /* local only: the next prompt comes from the server again */
    }
    r->remote_retrieve_gbps = el > 0 ? (double)bytes / el / 1e9 : 0;
    r->remote_retrieved_bytes = bytes;
    r->remote_hit_rate = asked ? (double)hit / (double)asked : 0;
    r->remote_lookup_p50_us = kvb_pct(lat, w->np, 0.5);
    /* leave nothing behind: delete this run's chunks on the server */
    for (size_t i = 0; i < w->np; i++)
        ferry_kv_delete(kv, w->p[i].tok, w->p[i].n, NULL);
    ferry_kv_close(kv);
    free(lat);
    kvb_buffer_free(&b);
    return bytes;
}

/*
 * The reference: the remote client alone, same value size and server:
 * ferry_remote_get of one value of the chunk size, about as many times as
 * the store retrieved chunks (distinct values into distinct buffers, as
 * the store's chunks land in distinct L1 slots), one thread, each value
 * read once per round. The store's retrieve reads ahead on its workers,
 * so on an idle machine it can pass this; on a loaded 2-core one both are
 * noisy.
 */
static void ref_remote_get(const opts *o, const char *url, uint64_t chunk, uint64_t bytes,
                           refs *r)
{
    ferry_remote_options ro = kvb_remote_opts(o);
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
            ok = ferry_remote_put_sync(rc, key, (size_t)kl, dst, chunk) == 0;
        }
    }
    /* like the store's figure: the first round warms up, the rest add up */
    double el_ref = 0;
    for (int round = 0; ok && round < 4; round++) {
        double t0 = kvb_now_s();
        for (uint64_t i = 0; ok && i < nref; i++) {
            char key[32];
            int kl = snprintf(key, sizeof key, "ref:%llu", (unsigned long long)i);
            ok = ferry_remote_get(rc, key, (size_t)kl, dst + i * chunk, chunk) == (int)chunk;
        }
        if (round)
            el_ref += kvb_now_s() - t0;
    }
    r->remote_get_gbps = ok && el_ref > 0 ? (double)(3 * nref * chunk) / el_ref / 1e9 : 0;
    if (!ok)
        fprintf(stderr, "ferry %s: remote reference: %s\n", KVB_CMD, ferry_last_error());
    for (uint64_t i = 0; rc && i < nref; i++) {
        char key[32];
        int kl = snprintf(key, sizeof key, "ref:%llu", (unsigned long long)i);
        ferry_remote_key k = {key, (size_t)kl};
        ferry_remote_delete(rc, &k, 1);
    }
    free(dst);
    ferry_remote_close(rc);
    r->have_remote = 1;
}

void kvb_refs_run(const opts *o, const char *url, const ferry_kv_layout *l, uint64_t chunk,
                  const workload *w, refs *r)
{
    memset(r, 0, sizeof *r);
    if (url)
        ref_remote_get(o, url, chunk, ref_remote_store(o, url, l, w, r), r);
    ref_hash(r);
    ref_lookup32k(o, r);
    ref_l1(o, l, chunk, r);
    if (o->dir)
        ref_l2(o, l, chunk, r);
}
