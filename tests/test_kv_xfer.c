/*
 * test_kv_xfer.c - moving one chunk between an engine's KV buffer and a
 * chunk image: the runs a paged buffer becomes (blocks back to back in
 * memory make one run, anything else does not), and the bytes those runs
 * move, checked against a token-by-token reference.
 */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ferry/kv.h"
#include "kv/kv_impl.h"

#define LAYERS 2u
#define HEADS 2u
#define HD 4u
#define TB (HEADS * HD * 2u) /* bf16 token bytes */
#define CHUNK 16u
#define BT 4u               /* tokens per block */
#define NBLK 16u

typedef struct runs {
    unsigned n;
    uint64_t bytes;
} runs;

static int count_run(void *ctx, uint64_t addr, unsigned char *img, uint64_t len)
{
    (void)addr;
    (void)img;
    runs *r = ctx;
    r->n++;
    r->bytes += len;
    return 0;
}

static ferry_kv_layout layout(void)
{
    ferry_kv_layout l = FERRY_KV_LAYOUT_INIT;
    l.num_layers = LAYERS;
    l.kv = 2;
    l.num_heads = HEADS;
    l.head_dim = HD;
    l.dtype = FERRY_DTYPE_BF16;
    return l;
}

typedef struct paged {
    unsigned char *mem;       /* 2 * LAYERS caches of NBLK blocks */
    uint64_t bases[2 * LAYERS];
    uint64_t stride;
    ferry_kv_buffer buf;
} paged;

static void paged_init(paged *p, const int32_t *table, size_t len, uint64_t stride)
{
    p->stride = stride;
    p->mem = calloc(2 * LAYERS, NBLK * stride);
    assert_non_null(p->mem);
    for (unsigned i = 0; i < 2 * LAYERS; i++)
        p->bases[i] = (uintptr_t)(p->mem + (size_t)i * NBLK * stride);
    ferry_kv_buffer b = FERRY_KV_BUFFER_INIT;
    b.layout = layout();
    b.form = FERRY_KV_PAGED;
    b.block_bases = p->bases;
    b.block_tokens = BT;
    b.block_stride = stride == BT * TB ? 0 : stride;
    b.num_blocks = NBLK;
    b.block_table = table;
    b.table_len = len;
    p->buf = b;
}

static runs walk(const paged *p, uint64_t tok0, uint32_t ntok)
{
    runs r = {0, 0};
    unsigned char img[2 * LAYERS * CHUNK * TB];
    assert_int_equal(ferry__kv_xfer_walk(&p->buf, CHUNK, tok0, ntok, img, count_run, &r), 0);
    return r;
}

static void blocks_in_order_are_one_run_per_plane(void **state)
{
    (void)state;
    int32_t table[8] = {3, 4, 5, 6, 7, 8, 9, 10};
    paged p;
    paged_init(&p, table, 8, BT * TB);
    runs r = walk(&p, 0, CHUNK);
    assert_int_equal(r.n, 2 * LAYERS);           /* 4 blocks each, merged */
    assert_int_equal(r.bytes, 2 * LAYERS * CHUNK * TB);
    r = walk(&p, 2, 12);                         /* starts mid-block: still one run */
    assert_int_equal(r.n, 2 * LAYERS);
    assert_int_equal(r.bytes, 2 * LAYERS * 12 * TB);
    free(p.mem);
}

static void scattered_blocks_are_one_run_each(void **state)
{
    (void)state;
    int32_t table[4] = {9, 2, 14, 0};
    paged p;
    paged_init(&p, table, 4, BT * TB);
    assert_int_equal(walk(&p, 0, CHUNK).n, 2 * LAYERS * 4);
    int32_t partly[4] = {5, 6, 1, 2};            /* two pairs */
    p.buf.block_table = partly;
    assert_int_equal(walk(&p, 0, CHUNK).n, 2 * LAYERS * 2);
    int32_t backwards[4] = {7, 6, 5, 4};         /* adjacent, but in the wrong order */
    p.buf.block_table = backwards;
    assert_int_equal(walk(&p, 0, CHUNK).n, 2 * LAYERS * 4);
    free(p.mem);
}

static void a_gap_between_blocks_keeps_them_apart(void **state)
{
    (void)state;
    int32_t table[4] = {0, 1, 2, 3};
    paged p;
    paged_init(&p, table, 4, BT * TB + 64);      /* padded blocks */
    assert_int_equal(walk(&p, 0, CHUNK).n, 2 * LAYERS * 4);
    free(p.mem);
}

/* token t of plane (kv, layer) in the paged buffer, the slow way */
static unsigned char *tok_addr(const paged *p, unsigned plane, uint64_t t)
{
    const int32_t *tab = p->buf.block_table;
    return p->mem + (size_t)plane * NBLK * p->stride + (size_t)tab[t / BT] * p->stride +
           (t % BT) * TB;
}

static void merged_runs_move_the_same_bytes(void **state)
{
    (void)state;
    const int32_t tables[3][8] = {{0, 1, 2, 3, 4, 5, 6, 7},
                                  {4, 5, 6, 0, 1, 9, 10, 11},
                                  {15, 3, 4, 8, 2, 12, 13, 14}};
    unsigned char src[2 * LAYERS * CHUNK * TB], back[sizeof src];
    for (size_t i = 0; i < sizeof src; i++)
        src[i] = (unsigned char)(i * 7 + 3);
    for (int v = 0; v < 3; v++) {
        for (uint64_t tok0 = 0; tok0 <= 16; tok0 += 16) {
            paged p;
            paged_init(&p, tables[v], 8, BT * TB);
            assert_int_equal(ferry__kv_xfer(&p.buf, CHUNK, tok0, CHUNK, src, 0, NULL, NULL), 0);
            for (unsigned plane = 0; plane < 2 * LAYERS; plane++)
                for (uint64_t t = 0; t < CHUNK; t++)
                    assert_memory_equal(tok_addr(&p, plane, tok0 + t),
                                        src + ((size_t)plane * CHUNK + t) * TB, TB);
            memset(back, 0, sizeof back);
            assert_int_equal(ferry__kv_xfer(&p.buf, CHUNK, tok0, CHUNK, back, 1, NULL, NULL), 0);
            assert_memory_equal(back, src, sizeof src);
            free(p.mem);
        }
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(blocks_in_order_are_one_run_per_plane),
        cmocka_unit_test(scattered_blocks_are_one_run_each),
        cmocka_unit_test(a_gap_between_blocks_keeps_them_apart),
        cmocka_unit_test(merged_runs_move_the_same_bytes),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
