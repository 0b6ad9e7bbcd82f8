/*
 * kv_bench_layers.c - `ferry kv bench --layerwise N`: what layer-by-layer
 * retrieves and stores give an engine. The workload's first prompt is stored once
 * (whole, in L1, or in the daemon's pool with --server); then N rounds
 * each retrieve it three ways into the engine's buffer, in alternating
 * order: the plain retrieve (the time until the engine may start), the
 * layerwise one (the time until layer 0 is usable, and until the last
 * is), and, as the outside reference, memcpy of the same bytes between
 * two host buffers in this process. Then N rounds store it, deleted
 * before each, plainly and layer by layer (every layer handed over at
 * once: the time from the last layer until the chunks are stored is what
 * a prefill that feeds the store would still wait for). One layerwise
 * retrieve before the rounds is not timed (through a server the first
 * one opens the connection layerwise operations then reuse). The figures
 * are medians; the ratios are of the medians.
 */
#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_bench.h"

typedef struct lw_round {
    double plain_s, first_s, all_s, memcpy_s;
    double store_s, lstore_s, tail_s; /* plain store; layerwise store; its last layer -> stored */
} lw_round;

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median_of(const lw_round *r, unsigned n, size_t off)
{
    double v[LAYERWISE_MAX_ROUNDS];
    for (unsigned i = 0; i < n; i++)
        v[i] = *(const double *)(const void *)((const char *)&r[i] + off);
    qsort(v, n, sizeof v[0], cmp_d);
    return n ? (n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2) : 0;
}

/* one layerwise retrieve: the seconds to layer 0 and to the end */
static int layerwise_once(ferry_kv *kv, const prompt *p, const ferry_kv_buffer *b, double *first,
                          double *all)
{
    ferry_kv_op *op = NULL;
    double t0 = kvb_now_s();
    int rc = ferry_kv_retrieve_layers(kv, p->tok, p->n, NULL, b, NULL, &op);
    if (rc < 0)
        return rc;
    rc = ferry_kv_op_wait_layer(op, 0, -1);
    *first = kvb_now_s() - t0;
    int r2 = ferry_kv_op_wait(op, -1);
    *all = kvb_now_s() - t0;
    ferry_kv_op_free(op);
    return rc < 0 ? rc : r2 < 0 ? r2 : (size_t)r2 == p->n ? 0 : -EIO;
}

/* one layerwise store of a prompt not yet stored: every layer handed over
 * at once (as a prefill that ran ahead would), the seconds in all and from
 * the last layer until the chunks are stored */
static int lstore_once(ferry_kv *kv, const prompt *p, const ferry_kv_buffer *b, unsigned layers,
                       double *all, double *tail)
{
    ferry_kv_op *op = NULL;
    double t0 = kvb_now_s();
    int rc = ferry_kv_store_layers(kv, p->tok, p->n, NULL, b, NULL, &op);
    if (rc < 0)
        return rc;
    for (unsigned l = 0; rc == 0 && l < layers; l++)
        rc = ferry_kv_op_layer_done(op, l, NULL);
    double t1 = kvb_now_s();
    int r2 = rc < 0 ? rc : ferry_kv_op_wait(op, -1);
    *all = kvb_now_s() - t0;
    *tail = kvb_now_s() - t1;
    ferry_kv_op_free(op);
    return r2 < 0 ? r2 : (size_t)r2 == p->n ? 0 : -EIO;
}

/* the stores: each on an empty store (the prompt deleted first) */
static int store_rounds(const opts *o, ferry_kv *kv, const prompt *p, const engine_buf *e,
                        unsigned layers, lw_round *r)
{
    for (unsigned i = 0; i < o->layerwise_rounds; i++) {
        for (int k = 0; k < 2; k++) {
            /* the last store's write-through to L2 done first: a chunk
             * still being written is locked, and a delete leaves it */
            int which = (k + (int)i) % 2, rc = ferry_kv_flush(kv);
            if (rc >= 0)
                rc = ferry_kv_delete(kv, p->tok, p->n, NULL);
            if (rc < 0)
                return rc;
            double t0 = kvb_now_s();
            if (which == 0) {
                rc = ferry_kv_store(kv, p->tok, p->n, NULL, &e->b);
                r[i].store_s = kvb_now_s() - t0;
                rc = rc < 0 ? rc : (size_t)rc == p->n ? 0 : -EIO;
            } else {
                rc = lstore_once(kv, p, &e->b, layers, &r[i].lstore_s, &r[i].tail_s);
            }
            if (rc < 0)
                return rc;
        }
    }
    return 0;
}

static int rounds(const opts *o, ferry_kv *kv, const prompt *p, const engine_buf *e,
                  unsigned char *m1, unsigned char *m2, size_t bytes, lw_round *r)
{
    for (unsigned i = 0; i < o->layerwise_rounds; i++) {
        for (int k = 0; k < 3; k++) {
            int which = (k + (int)i) % 3; /* alternate the order */
            double t0 = kvb_now_s();
            int rc = 0;
            if (which == 0) {
                rc = ferry_kv_retrieve(kv, p->tok, p->n, NULL, &e->b);
                r[i].plain_s = kvb_now_s() - t0;
                rc = rc < 0 ? rc : (size_t)rc == p->n ? 0 : -EIO;
            } else if (which == 1) {
                rc = layerwise_once(kv, p, &e->b, &r[i].first_s, &r[i].all_s);
            } else {
                memcpy(m2, m1, bytes);
                r[i].memcpy_s = kvb_now_s() - t0;
            }
            if (rc < 0)
                return rc;
        }
    }
    return 0;
}

int kvb_layerwise_run(const opts *o, const ferry_kv_layout *l, const workload *w, uint64_t chunk)
{
    static lw_round r[LAYERWISE_MAX_ROUNDS];
    const prompt *p = &w->p[0];
    size_t nch = p->n / o->chunk_tokens;
    if (!nch)
        return cli_usage(KVB_CMD, "--layerwise: the first prompt (%zu tokens) holds no whole "
                                  "chunk of %u tokens", p->n, o->chunk_tokens);
    size_t bytes = nch * chunk;
    uint64_t need = 2 * (uint64_t)(nch + 1) * chunk; /* (a layerwise op holds half of L1) */
    uint64_t l1 = o->l1 > need ? o->l1 : need;
    ferry_kv *kv = NULL;
    int rc = kvb_open_store(o, l, l1, 0, NULL, &kv);
    if (rc < 0)
        return cli_fail(KVB_CMD, "--layerwise: opening the store", rc);
    engine_buf e;
    memset(&e, 0, sizeof e);
    unsigned char *m1 = malloc(bytes), *m2 = malloc(bytes);
    if (!m1 || !m2)
        rc = -ENOMEM;
    if (rc == 0)
        rc = kvb_buffer_alloc(o, l, p->n, &e);
    if (rc == 0) {
        memset(m1, 0x5a, bytes);
        memset(m2, 0, bytes);
        if (!e.dev && e.host)
            memset(e.host, 0x5a, bytes); /* (its pages faulted in before any timing) */
        int s = ferry_kv_store(kv, p->tok, nch * o->chunk_tokens, NULL, &e.b);
        rc = s < 0 ? s : (size_t)s == nch * o->chunk_tokens ? 0 : FERRY_ENOSPACE;
    }
    prompt whole = {p->tok, nch * o->chunk_tokens};
    double warm_first = 0, warm_all = 0;
    if (rc == 0) /* (untimed: through a server, the first op opens its connection) */
        rc = layerwise_once(kv, &whole, &e.b, &warm_first, &warm_all);
    if (rc == 0)
        rc = rounds(o, kv, &whole, &e, m1, m2, bytes, r);
    if (rc == 0)
        rc = ferry_kv_flush(kv); /* (the write-throughs of the first store, if any) */
    if (rc == 0)
        rc = store_rounds(o, kv, &whole, &e, l->num_layers, r);
    if (rc == 0) {
        unsigned n = o->layerwise_rounds;
        double plain = median_of(r, n, offsetof(lw_round, plain_s));
        double first = median_of(r, n, offsetof(lw_round, first_s));
        double all = median_of(r, n, offsetof(lw_round, all_s));
        double mc = median_of(r, n, offsetof(lw_round, memcpy_s));
        double st = median_of(r, n, offsetof(lw_round, store_s));
        double ls = median_of(r, n, offsetof(lw_round, lstore_s));
        double tail = median_of(r, n, offsetof(lw_round, tail_s));
        double gb = (double)bytes / 1e9;
        if (o->json) {
            json_t *j = json_pack("{s:{s:s,s:i,s:I,s:I,s:f,s:f,s:f,s:f,s:f,s:f,s:f,s:f,s:f,s:f,"
                                  "s:s,s:s}}",
                                  "layerwise", "server", o->server ? o->server : "",
                                  "rounds", (int)n, "layers", (json_int_t)l->num_layers,
                                  "bytes", (json_int_t)bytes, "first_layer_ms", first * 1e3,
                                  "layerwise_ms", all * 1e3, "retrieve_ms", plain * 1e3,
                                  "memcpy_ms", mc * 1e3, "store_ms", st * 1e3,
                                  "layerwise_store_ms", ls * 1e3, "store_tail_ms", tail * 1e3,
                                  "first_vs_retrieve",
                                  kvb_ratio(first, plain), "layerwise_vs_retrieve",
                                  kvb_ratio(all, plain), "retrieve_gbps", kvb_ratio(gb, plain),
                                  "buffer", kvb_buffer_mem(o), "form", kvb_buffer_form(o));
            json_dumpf(j, stdout, JSON_INDENT(2));
            printf("\n");
            json_decref(j);
        } else {
            printf("  layerwise retrieve of %zu chunks (%.1f MiB, %u layers) into %s %s memory%s%s,"
                   " median of %u rounds:\n",
                   nch, (double)bytes / (1 << 20), l->num_layers, kvb_buffer_form(o),
                   kvb_buffer_mem(o), o->server ? " through " : "", o->server ? o->server : "",
                   n);
            printf("    first layer usable   %8.3f ms  (%.3fx the plain retrieve)\n", first * 1e3,
                   kvb_ratio(first, plain));
            printf("    every layer landed   %8.3f ms  (%.3fx the plain retrieve)\n", all * 1e3,
                   kvb_ratio(all, plain));
            printf("    plain retrieve       %8.3f ms  (%.2f GB/s)\n", plain * 1e3,
                   kvb_ratio(gb, plain));
            printf("    memcpy, same bytes   %8.3f ms  (%.2f GB/s; retrieve at %.2fx of it)\n",
                   mc * 1e3, kvb_ratio(gb, mc), kvb_ratio(mc, plain));
            printf("  store of the same chunks (deleted before each):\n");
            printf("    layerwise store      %8.3f ms  (%.3fx the plain store), of which\n",
                   ls * 1e3, kvb_ratio(ls, st));
            printf("      after the last layer %6.3f ms  (until the chunks are stored)\n",
                   tail * 1e3);
            printf("    plain store          %8.3f ms  (%.2f GB/s)\n", st * 1e3,
                   kvb_ratio(gb, st));
        }
    }
    if (rc < 0)
        rc = cli_fail(KVB_CMD, "--layerwise", rc);
    kvb_buffer_free(&e);
    free(m1);
    free(m2);
    ferry_kv_close(kv);
    return rc;
}
