/*
 * kv_bench_workload.c - `ferry kv bench`'s workloads and one run of them.
 *
 * Token ids are random, so only reuse makes hits:
 *  - qa:   D documents of T tokens; Q questions, each a document picked
 *          with Zipf popularity followed by a fresh question of q tokens.
 *  - chat: S sessions of N turns interleaved; each turn's prompt is the
 *          previous prompt plus a reply and a new message (t tokens).
 * Each prompt does what an engine does: lookup, retrieve the cached
 * prefix into the engine's buffer, store the whole prompt.
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kv_bench.h"

double kvb_now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* this thread's CPU time: on a loaded machine it separates what the code
 * costs from the time other processes took the core */
double kvb_cpu_now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

uint64_t kvb_rng_next(uint64_t *s)
{
    uint64_t x = *s;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *s = x;
    return x * 0x2545F4914F6CDD1Dull;
}

double kvb_ratio(double a, double b)
{
    return b > 0 ? a / b : 0;
}

double kvb_pct(double *v, size_t n, double q)
{
    if (!n)
        return 0;
    qsort(v, n, sizeof *v, cli_cmp_double);
    size_t i = (size_t)(q * (double)(n - 1) + 0.5);
    return v[i < n ? i : n - 1];
}

int kvb_layout_for(const opts *o, ferry_kv_layout *l)
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
void kvb_workload_free(workload *w)
{
    free(w->pool);
    free(w->p);
}

int kvb_make_workload(const opts *o, workload *w)
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
            docs[i] = (int32_t)(kvb_rng_next(&s) % 128000);
        double *cdf = malloc(o->docs * sizeof *cdf), tot = 0;
        if (!cdf)
            return -ENOMEM;
        for (unsigned d = 0; d < o->docs; d++)
            cdf[d] = (tot += 1.0 / pow((double)(d + 1), o->zipf));
        for (unsigned i = 0; i < o->questions; i++) {
            double u = (double)(kvb_rng_next(&s) >> 11) / 9007199254740992.0 * tot;
            unsigned d = 0;
            while (d + 1 < o->docs && cdf[d] < u)
                d++;
            memcpy(q, docs + (size_t)d * dt, dt * sizeof(int32_t));
            for (size_t k = 0; k < qt; k++)
                q[dt + k] = (int32_t)(kvb_rng_next(&s) % 128000);
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
            w->pool[i] = (int32_t)(kvb_rng_next(&s) % 128000);
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
int kvb_run_workload(ferry_kv *kv, const workload *w, const ferry_kv_buffer *buf, int quiet,
                     run_result *r)
{
    memset(r, 0, sizeof *r);
    double *lat = malloc(w->np * sizeof *lat);
    if (!lat)
        return -ENOMEM;
    ferry_kv_stats a = FERRY_KV_STATS_INIT, b = FERRY_KV_STATS_INIT;
    ferry_kv_stats_get(kv, &a);
    for (size_t i = 0; i < w->np; i++) {
        const prompt *p = &w->p[i];
        double t0 = kvb_now_s();
        int hit = ferry_kv_lookup(kv, p->tok, p->n, NULL);
        lat[i] = (kvb_now_s() - t0) * 1e6;
        if (hit < 0) {
            free(lat);
            return hit;
        }
        r->prompt_tokens += p->n;
        r->hit_tokens += (uint64_t)hit;
        if (hit > 0) {
            t0 = kvb_now_s();
            int got = ferry_kv_retrieve(kv, p->tok, (size_t)hit, NULL, buf);
            r->retrieve_s += kvb_now_s() - t0;
            if (got < 0) {
                free(lat);
                return got;
            }
            r->retrieved_tokens += (uint64_t)got;
        }
        t0 = kvb_now_s();
        int st = ferry_kv_store(kv, p->tok, p->n, NULL, buf);
        r->store_s += kvb_now_s() - t0;
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
    ferry_kv_stats_get(kv, &b);
    r->stored_bytes = b.stored_bytes - a.stored_bytes;
    r->retrieved_bytes = b.retrieved_bytes - a.retrieved_bytes;
    r->lookup_p50_us = kvb_pct(lat, w->np, 0.5);
    r->lookup_p99_us = kvb_pct(lat, w->np, 0.99);
    r->m = b;
    free(lat);
    return 0;
}
