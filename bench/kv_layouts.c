/*
 * kv_layouts.c - the store and retrieve of a paged KV cache in each layout
 * an engine hands ferry (vLLM's NHD, HND, FlashInfer's [blocks][2][...],
 * packed K|V), side by side with memcpy of the same bytes, in one run.
 *
 *   kv_layouts [--layers 8] [--heads 8] [--head-dim 128] [--block 16]
 *              [--tokens 4096] [--chunk 256] [--rounds 5] [--offset 0]
 *
 * Each round, in a rotating order, each layout's cache (its blocks in a
 * shuffled table) is stored into an in-process store (after a clear) and
 * retrieved back, and memcpy copies the same bytes between two buffers.
 * Prints, per layout, the median GB/s of store and retrieve, and their
 * ratio to NHD's and to memcpy's in the same rounds. NHD's rows are whole
 * blocks (one run per block run); HND's and packed's runs are one head's
 * head_dim each (2 * head_dim bytes at bf16), FlashInfer's whole rows.
 *
 * Each cache starts --offset bytes past a page boundary: 0 is where an
 * engine's cache lies (torch's host allocator aligns to 64 bytes, pinned
 * memory to a page); 16 is where a plain malloc of that size puts it, so
 * that every short run of a strided layout starts and ends inside a cache
 * line, the copy's worst case.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_util.h"
#include "ferry.h"

enum { NHD, HND, FLASHINFER, PACKED, NK };
static const char *const names[NK] = {"NHD", "HND", "FlashInfer", "packed"};

typedef struct cache {
    unsigned char *alloc, *mem;
    uint64_t *bases;
    ferry_kv_buffer b;
} cache;

/* one layout's caches: layers x (its per-layer tensor), the same table */
static int cache_make(cache *c, int k, const ferry_kv_layout *l, uint32_t bs, uint64_t nb,
                      const int32_t *table, size_t nblk, int offset)
{
    uint64_t run = (uint64_t)l->head_dim * 2, row = run * l->num_heads, blk = row * bs;
    uint64_t layer = 2 * nb * blk;
    c->alloc = aligned_alloc(4096, (layer * l->num_layers + 4096 + 4095) / 4096 * 4096);
    c->bases = calloc(2 * l->num_layers, sizeof *c->bases);
    if (!c->alloc || !c->bases)
        return -1;
    c->mem = c->alloc + offset;
    for (size_t i = 0; i < layer * l->num_layers; i++)
        c->mem[i] = (unsigned char)(i * 2654435761u >> 13);
    for (uint32_t kv = 0; kv < 2; kv++)
        for (uint32_t ly = 0; ly < l->num_layers; ly++) {
            uint64_t at = ly * layer + (k == FLASHINFER ? kv * blk
                                        : k == PACKED   ? kv * run
                                                        : kv * nb * blk);
            c->bases[kv * l->num_layers + ly] = (uint64_t)(uintptr_t)(c->mem + at);
        }
    ferry_kv_buffer b = FERRY_KV_BUFFER_INIT;
    b.layout = *l;
    b.form = FERRY_KV_PAGED;
    b.block_bases = c->bases;
    b.block_tokens = bs;
    b.num_blocks = nb;
    b.block_table = table;
    b.table_len = nblk;
    b.block_stride = k == FLASHINFER || k == PACKED ? 2 * blk : blk;
    b.token_stride = k == HND ? run : k == PACKED ? 2 * run : row;
    b.head_stride = k == HND ? bs * run : k == PACKED ? bs * 2 * run : run;
    c->b = b;
    return 0;
}

int main(int argc, char **argv)
{
    ferry_kv_layout l = FERRY_KV_LAYOUT_INIT;
    l.num_layers = (uint32_t)arg_int(argc, argv, "--layers", 8);
    l.num_heads = (uint32_t)arg_int(argc, argv, "--heads", 8);
    l.head_dim = (uint32_t)arg_int(argc, argv, "--head-dim", 128);
    l.kv = 2;
    l.dtype = FERRY_DTYPE_BF16;
    int bs = arg_int(argc, argv, "--block", 16), ntok = arg_int(argc, argv, "--tokens", 4096);
    int ct = arg_int(argc, argv, "--chunk", 256), rounds = arg_int(argc, argv, "--rounds", 5);
    int offset = arg_int(argc, argv, "--offset", 0);
    if (bs < 1 || ct < 1 || ntok < ct || ntok % bs || rounds < 1 || rounds > 64 || offset < 0 ||
        offset > 4096 ||
        !l.num_layers || !l.num_heads || !l.head_dim) {
        fprintf(stderr, "kv_layouts: bad arguments\n");
        return 2;
    }
    size_t nblk = (size_t)ntok / (size_t)bs;
    uint64_t nb = nblk + nblk / 4; /* some blocks outside the table */
    int32_t *table = malloc(nblk * sizeof *table), *tokens = malloc((size_t)ntok * 4);
    uint64_t *perm = malloc(nb * sizeof *perm);
    if (!table || !tokens || !perm)
        return 1;
    srand(7);
    for (uint64_t i = 0; i < nb; i++)
        perm[i] = i;
    for (uint64_t i = nb - 1; i > 0; i--) { /* shuffled, but runs of 4 kept in order */
        uint64_t j = (uint64_t)rand() % (i + 1), t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    for (size_t i = 0; i < nblk; i++)
        table[i] = (int32_t)(i % 4 ? table[i - 1] + 1 < (int32_t)nb ? table[i - 1] + 1 : 0
                                   : (int32_t)(perm[i / 4] / 4 * 4));
    for (int i = 0; i < ntok; i++)
        tokens[i] = i;
    cache c[NK];
    for (int k = 0; k < NK; k++)
        if (cache_make(&c[k], k, &l, (uint32_t)bs, nb, table, nblk, offset) < 0)
            return 1;
    uint64_t bytes = (uint64_t)ntok * l.num_heads * l.head_dim * 2 * 2 * l.num_layers;
    ferry_kv_config cfg = FERRY_KV_CONFIG_INIT;
    cfg.model = "layouts";
    cfg.layout = l;
    cfg.chunk_tokens = (uint32_t)ct;
    cfg.l1_bytes = bytes + bytes / 2;
    ferry_kv *kv = NULL;
    if (ferry_kv_open(&cfg, &kv) < 0) {
        fprintf(stderr, "kv_layouts: %s\n", ferry_last_error());
        return 1;
    }
    unsigned char *m0 = malloc(bytes), *m1 = malloc(bytes);
    if (!m0 || !m1)
        return 1;
    memset(m0, 1, bytes);
    memset(m1, 2, bytes);
    double st[NK][64], rt[NK][64], mc[64];
    for (int r = 0; r < rounds; r++) {
        double t0 = now_ns();
        memcpy(m1, m0, bytes);
        mc[r] = bytes / (now_ns() - t0);
        for (int q = 0; q < NK; q++) {
            int k = (q + r) % NK;
            ferry_kv_clear(kv);
            t0 = now_ns();
            int s = ferry_kv_store(kv, tokens, (size_t)ntok, NULL, &c[k].b);
            double t1 = now_ns();
            int g = ferry_kv_retrieve(kv, tokens, (size_t)ntok, NULL, &c[k].b);
            double t2 = now_ns();
            if (s != ntok || g != ntok) {
                fprintf(stderr, "kv_layouts: %s: stored %d, retrieved %d: %s\n", names[k], s, g,
                        ferry_last_error());
                return 1;
            }
            st[k][r] = bytes / (t1 - t0);
            rt[k][r] = bytes / (t2 - t1);
        }
    }
    double mcm = median(mc, rounds), sn = 0, rn = 0;
    printf("kv_layouts: %u layers, %u heads x %u bf16, blocks of %d, %d tokens (%.1f MiB), "
           "caches at page + %d, %d rounds; memcpy %.2f GB/s\n",
           l.num_layers, l.num_heads, l.head_dim, bs, ntok, bytes / 1048576.0, offset, rounds,
           mcm);
    printf("%-11s %9s %9s %8s %8s %9s %9s\n", "layout", "store", "retrieve", "st/NHD", "rt/NHD",
           "st/memcpy", "rt/memcpy");
    for (int k = 0; k < NK; k++) {
        double s = median(st[k], rounds), g = median(rt[k], rounds);
        if (k == NHD) {
            sn = s;
            rn = g;
        }
        printf("%-11s %9.2f %9.2f %8.3f %8.3f %9.3f %9.3f\n", names[k], s, g, s / sn, g / rn,
               s / mcm, g / mcm);
    }
    ferry_kv_close(kv);
    return 0;
}
