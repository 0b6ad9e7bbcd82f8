/*
 * kv_calls.c - the cost of ferry_kv calls made from C, the reference the
 * Python package is measured against (bench/py_overhead.py runs this and
 * the same calls through the package, alternately, in one run).
 *
 *   kv_calls [--chunks 8] [--lookup-tokens 32768] [--iters 200] [--rounds 1]
 *
 * A Llama-3-8B layout (32 MiB per 256-token chunk), an L1 of 2 x chunks.
 * Each round: a lookup of a lookup-tokens prompt whose first `chunks`
 * chunks are cached (iters times), then `chunks` chunks stored from a
 * contiguous host buffer (after deleting them) and retrieved back into
 * another, each 5 times. Prints one JSON object per round: the median ns
 * of a lookup, and the median GB/s of a store and of a retrieve.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_util.h"
#include "ferry.h"

int main(int argc, char **argv)
{
    int chunks = arg_int(argc, argv, "--chunks", 8);
    int lt = arg_int(argc, argv, "--lookup-tokens", 32768);
    int iters = arg_int(argc, argv, "--iters", 200);
    int rounds = arg_int(argc, argv, "--rounds", 1);
    if (chunks < 1 || iters < 1 || rounds < 1 || lt < chunks * 256) {
        fprintf(stderr, "kv_calls: bad arguments\n");
        return 2;
    }
    size_t ntok = (size_t)chunks * 256;
    uint64_t cb = 0;
    ferry_kv_config cfg = FERRY_KV_CONFIG_INIT;
    ferry_kv_layout_chunk_bytes(&cfg.layout, 256, &cb);
    cfg.model = "bench";
    cfg.l1_bytes = 2 * (uint64_t)chunks * cb;
    ferry_kv *kv = NULL;
    int rc = ferry_kv_open(&cfg, &kv);
    int32_t *tok = malloc((size_t)lt * sizeof *tok);
    char *src = malloc((size_t)(chunks * cb)), *dst = malloc((size_t)(chunks * cb));
    double *t = malloc(sizeof(double) * (size_t)(iters > 5 ? iters : 5));
    if (rc || !tok || !src || !dst || !t) {
        fprintf(stderr, "kv_calls: open: %s\n", ferry_strerror(rc ? rc : -12));
        return 1;
    }
    for (int i = 0; i < lt; i++)
        tok[i] = i * 7 + 1;
    memset(src, 0x5a, (size_t)(chunks * cb));
    memset(dst, 0, (size_t)(chunks * cb));
    ferry_kv_buffer sb = FERRY_KV_BUFFER_INIT, db = FERRY_KV_BUFFER_INIT;
    sb.base = (uintptr_t)src;
    db.base = (uintptr_t)dst;
    sb.capacity_tokens = db.capacity_tokens = ntok;
    if (ferry_kv_store(kv, tok, ntok, NULL, &sb) != (int)ntok)
        return 1;
    for (int r = 0; r < rounds; r++) {
        for (int i = 0; i < iters; i++) {
            double t0 = now_ns();
            int hit = ferry_kv_lookup(kv, tok, (size_t)lt, NULL);
            t[i] = now_ns() - t0;
            if (hit != (int)ntok)
                return 1;
        }
        double look = median(t, iters);
        for (int i = 0; i < 5; i++) {
            ferry_kv_delete(kv, tok, ntok, NULL);
            double t0 = now_ns();
            int n = ferry_kv_store(kv, tok, ntok, NULL, &sb);
            t[i] = now_ns() - t0;
            if (n != (int)ntok)
                return 1;
        }
        double st = median(t, 5);
        for (int i = 0; i < 5; i++) {
            double t0 = now_ns();
            int n = ferry_kv_retrieve(kv, tok, ntok, NULL, &db);
            t[i] = now_ns() - t0;
            if (n != (int)ntok)
                return 1;
        }
        double rt = median(t, 5);
        double bytes = (double)chunks * (double)cb;
        printf("{\"lookup_ns\": %.0f, \"store_gbs\": %.3f, \"retrieve_gbs\": %.3f}\n", look,
               bytes / st, bytes / rt);
    }
    ferry_kv_close(kv);
    free(tok);
    free(src);
    free(dst);
    free(t);
    return 0;
}
