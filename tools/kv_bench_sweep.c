/*
 * kv_bench_sweep.c - `ferry kv bench --plot`: the workload's hit rate over
 * L1 (and with --dir L2) sizes, with a small stand-in layout of the same
 * chunk count (only hit rates are drawn), and a gnuplot PNG of it.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kv_bench.h"

#define FERRY_MAXU(a, b) ((a) > (b) ? (a) : (b))

int kvb_sweep(const opts *o, const workload *w, point **out, size_t *np)
{
    ferry_kv_layout l = FERRY_KV_LAYOUT_INIT;
    l.num_layers = 1;
    l.num_heads = 1;
    l.head_dim = 64; /* a stand-in of 64 KiB per 256 tokens: same chunk counts */
    engine_buf b;
    int rc = kvb_buffer_alloc(NULL, &l, w->max_tokens, &b);
    if (rc < 0)
        return rc;
    uint64_t small = 2ull * o->chunk_tokens * 64 * 2, sslot = (small + 4095) & ~4095ull;
    uint64_t ws = w->unique_chunks ? w->unique_chunks : 1;
    static const double l1f[] = {1.0 / 16, 1.0 / 8, 1.0 / 4, 1.0 / 2, 1.0, 1.5};
    static const double l2f[] = {0, 0.25, 0.5, 1.0};
    size_t nl2 = o->dir ? 4 : 1;
    point *p = calloc(6 * nl2, sizeof *p);
    if (!p) {
        kvb_buffer_free(&b);
        return -ENOMEM;
    }
    size_t k = 0;
    for (size_t j = 0; j < nl2; j++) {
        uint64_t prev = 0;
        for (size_t i = 0; i < 6; i++) {
            uint64_t c1 = (uint64_t)((double)ws * l1f[i]), c2 = (uint64_t)((double)ws * l2f[j]);
            if (c1 < 2)
                c1 = 2;
            if (c1 == prev) /* a small workload: the floor again, the same point */
                continue;
            prev = c1;
            ferry_kv *kv;
            opts so = *o;
            so.model = "sweep";
            so.persistent = 0; /* each point starts empty */
            so.dev = NULL;     /* a stand-in layout: host memory */
            rc = kvb_open_store(&so, &l, c1 * sslot, c2 * sslot, c2 ? o->dir : NULL, &kv);
            if (rc < 0)
                break;
            run_result rr;
            rc = kvb_run_workload(kv, w, &b.b, 1, &rr);
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
    kvb_buffer_free(&b);
    *out = p;
    *np = k;
    return rc < 0 ? rc : 0;
}

int kvb_plot(const opts *o, const point *p, size_t np, uint64_t chunk)
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
