/*
 * test_kv_strided.c - paged KV caches described by strides: every layout
 * an engine hands ferry (vLLM's NHD, HND, FlashInfer's [blocks][2][...],
 * packed K|V [blocks][heads][bt][2*hd], cross-layer blocks for every layer
 * in one tensor) stored from one and retrieved into every other at other
 * block ids, bitwise, in process and through a daemon; blocks outside the
 * table untouched; strides that overlap refused before any byte moves.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/copy.h"
#include "ferry/kv.h"
#include "ferry/serve.h"
#include "ferry_test.h"
#include "serve_fixture.h"

/* the geometry of the caches a test case builds (the first case's is
 * small; the streaming case's copies are large enough to stream) */
typedef struct geo {
    unsigned layers, heads, dim; /* bf16 head_dim */
    unsigned bs, nb, ct, ntok;   /* tokens per block, blocks, tokens per chunk, in all */
    unsigned offset;             /* each cache this far past a page boundary */
} geo;
static const geo SMALL = {2, 2, 8, 4, 32, 16, 48, 16}; /* runs of 16 bytes, 3 chunks */
static geo G;

#define L G.layers
#define H G.heads
#define D G.dim /* head_dim, bf16 */
#define E 2u
#define BS G.bs         /* tokens per block */
#define NB G.nb         /* blocks per cache */
#define CT G.ct         /* tokens per chunk */
#define NTOK G.ntok
#define MAX_L 4u
#define MAX_BLOCKS 256u /* in a table */
#define MAX_TOK 1024u
#define PLANE_ELEMS ((size_t)NB * BS * H * D)
#define MEM_BYTES ((size_t)2 * L * PLANE_ELEMS * E)
#define SENT 0xEE

typedef enum { NHD, HND, FLASHINFER, PACKED, CROSS, NLAYOUTS } kind;
static const char *const kind_name[] = {"NHD", "HND", "FlashInfer", "packed K|V",
                                        "cross-layer"};

typedef struct cache {
    kind k;
    unsigned char *alloc, *mem; /* mem: G.offset past alloc's page */
    uint64_t bases[2 * MAX_L];
    uint64_t block, tok, head;   /* strides in bytes */
    int32_t table[MAX_BLOCKS];
    ferry_kv_buffer b;
} cache;

static ferry_kv_layout layout(void)
{
    ferry_kv_layout l = FERRY_KV_LAYOUT_INIT;
    l.num_layers = L;
    l.kv = 2;
    l.num_heads = H;
    l.head_dim = D;
    l.dtype = FERRY_DTYPE_BF16;
    return l;
}

/* the layout's bases and strides over one allocation of MEM_BYTES */
static void cache_init(cache *c, kind k, unsigned seed)
{
    memset(c, 0, sizeof *c);
    c->k = k;
    c->alloc = aligned_alloc(4096, (MEM_BYTES + G.offset + 4095) / 4096 * 4096);
    assert_non_null(c->alloc);
    c->mem = c->alloc + G.offset;
    memset(c->mem, SENT, MEM_BYTES);
    const uint64_t run = D * E, row = H * run, blk = BS * row, layer = 2 * NB * blk;
    for (unsigned kv = 0; kv < 2; kv++) {
        for (unsigned ly = 0; ly < L; ly++) {
            uint64_t at = 0;
            switch (k) {
            case NHD: /* per layer [2][NB][BS][H][D] */
            case HND: /* per layer [2][NB][H][BS][D] */
                at = ly * layer + kv * NB * blk;
                break;
            case FLASHINFER: /* per layer [NB][2][BS][H][D] */
                at = ly * layer + kv * blk;
                break;
            case PACKED: /* per layer [NB][H][BS][2*D] */
                at = ly * layer + kv * run;
                break;
            case CROSS: /* one tensor [NB][L][2][BS][H][D] */
                at = (ly * 2 + kv) * blk;
                break;
            default:
                break;
            }
            c->bases[kv * L + ly] = (uint64_t)(uintptr_t)(c->mem + at);
        }
    }
    c->block = k == FLASHINFER ? 2 * blk : k == PACKED ? 2 * blk : k == CROSS ? 2 * L * blk : blk;
    c->tok = k == HND ? run : k == PACKED ? 2 * run : row;
    c->head = k == HND ? BS * run : k == PACKED ? BS * 2 * run : run;
    /* a shuffled table: some blocks back to back, some not */
    srand(seed);
    int used[MAX_BLOCKS * 2] = {0};
    for (unsigned i = 0; i < NTOK / BS; i++) {
        int b;
        do
            b = i % 3 == 1 && c->table[i - 1] + 1 < (int)NB && !used[c->table[i - 1] + 1]
                    ? c->table[i - 1] + 1
                    : rand() % (int)NB;
        while (used[b]);
        used[b] = 1;
        c->table[i] = b;
    }
    ferry_kv_buffer b = FERRY_KV_BUFFER_INIT;
    b.layout = layout();
    b.form = FERRY_KV_PAGED;
    b.block_bases = c->bases;
    b.block_tokens = BS;
    b.num_blocks = NB;
    b.block_table = c->table;
    b.table_len = NTOK / BS;
    b.block_stride = k == NHD ? 0 : c->block; /* NHD: the defaults */
    b.token_stride = k == NHD ? 0 : c->tok;
    b.head_stride = k == NHD ? 0 : c->head;
    c->b = b;
}

static unsigned char *elem(const cache *c, unsigned plane, unsigned t, unsigned h)
{
    uint64_t a = c->bases[plane] + (uint64_t)c->table[t / BS] * c->block + (t % BS) * c->tok +
                 h * c->head;
    return (unsigned char *)(uintptr_t)a;
}

static uint16_t value(unsigned plane, unsigned t, unsigned h, unsigned d)
{
    return (uint16_t)((plane * 7919u + t * 104729u + h * 31u + d * 131u + 17u) * 2654435761u >>
                      16);
}

static void fill(cache *c)
{
    for (unsigned p = 0; p < 2 * L; p++)
        for (unsigned t = 0; t < NTOK; t++)
            for (unsigned h = 0; h < H; h++)
                for (unsigned d = 0; d < D; d++) {
                    uint16_t v = value(p, t, h, d);
                    memcpy(elem(c, p, t, h) + d * E, &v, E);
                }
}

/* every element of the sequence is the reference; every other byte SENT */
static void check(const cache *c)
{
    unsigned char *mark = calloc(1, MEM_BYTES);
    assert_non_null(mark);
    for (unsigned p = 0; p < 2 * L; p++)
        for (unsigned t = 0; t < NTOK; t++)
            for (unsigned h = 0; h < H; h++) {
                unsigned char *at = elem(c, p, t, h);
                for (unsigned d = 0; d < D; d++) {
                    uint16_t v = value(p, t, h, d), got;
                    memcpy(&got, at + d * E, E);
                    if (got != v)
                        fail_msg("%s: plane %u token %u head %u elem %u: %#x, want %#x",
                                 kind_name[c->k], p, t, h, d, got, v);
                }
                memset(mark + (at - c->mem), 1, D * E);
            }
    for (size_t i = 0; i < MEM_BYTES; i++)
        if (!mark[i] && c->mem[i] != SENT)
            fail_msg("%s: byte %zu outside the sequence was written (%#x)", kind_name[c->k], i,
                     c->mem[i]);
    free(mark);
}

static ferry_kv_config config(void)
{
    ferry_kv_config cfg = FERRY_KV_CONFIG_INIT;
    cfg.model = "strided";
    cfg.layout = layout();
    cfg.chunk_tokens = CT;
    cfg.l1_bytes = 64 * 2 * L * CT * H * D * E;
    cfg.workers = 2;
    return cfg;
}

static int32_t g_tokens[MAX_TOK];

/* store from each layout, retrieve into every layout at other block ids */
static void every_pair(ferry_kv *kv)
{
    for (unsigned i = 0; i < NTOK; i++)
        g_tokens[i] = (int32_t)(i * 11 + 3);
    for (kind a = 0; a < NLAYOUTS; a++) {
        cache src;
        cache_init(&src, a, 100 + a);
        fill(&src);
        assert_int_equal(ferry_kv_clear(kv) >= 0, 1);
        assert_int_equal(ferry_kv_store(kv, g_tokens, NTOK, NULL, &src.b), NTOK);
        for (kind b = 0; b < NLAYOUTS; b++) {
            cache dst;
            cache_init(&dst, b, 200 + 10 * a + b);
            assert_int_equal(ferry_kv_retrieve(kv, g_tokens, NTOK, NULL, &dst.b), NTOK);
            check(&dst);
            /* and layer by layer */
            memset(dst.mem, SENT, MEM_BYTES);
            ferry_kv_op *op = NULL;
            assert_int_equal(ferry_kv_retrieve_layers(kv, g_tokens, NTOK, NULL, &dst.b, NULL, &op),
                             0);
            assert_int_equal(ferry_kv_op_wait(op, -1), NTOK);
            ferry_kv_op_free(op);
            check(&dst);
            free(dst.alloc);
        }
        free(src.alloc);
    }
}

static void test_every_layout_pair_in_process(void **state)
{
    (void)state;
    G = SMALL;
    ferry_kv_config cfg = config();
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&cfg, &kv));
    every_pair(kv);
    ferry_kv_close(kv);
}

static void test_every_layout_pair_through_a_daemon(void **state)
{
    (void)state;
    G = SMALL;
    ferry_kv_config kc = config();
    ft_kv_daemon d;
    ft_kv_daemon_start(&d, &kc);
    ferry_kv *kv = ft_kv_daemon_client(&d, config());
    every_pair(kv);
    ferry_kv_close(kv);
    ft_kv_daemon_stop(&d);
}

/* copies large enough to stream (each chunk's over 64 KiB): runs of
 * whole lines, of a line and a part, and shorter than a line, into and
 * out of caches that start on a line or 2, 16, 48 or 62 bytes past one,
 * so that runs start and end inside lines that other runs finish; with
 * 32-byte words where the processor has them, and with 16-byte words */
static void streamed_copies(void)
{
    static const geo geos[] = {
        {2, 4, 128, 8, 40, 32, 96, 0}, /* runs of 256 bytes, 128 KiB a chunk */
        {2, 4, 40, 8, 40, 64, 192, 0}, /* runs of 80 bytes */
        {2, 8, 24, 4, 80, 64, 192, 0}, /* runs of 48 bytes */
        /* runs of a line (head_dim 32), 3 heads, blocks of 8 that chunks
         * of 92 split */
        {2, 3, 32, 8, 60, 92, 184, 0},
        {2, 1, 32, 16, 40, 256, 512, 0}, /* one head */
        {2, 2, 64, 16, 48, 128, 384, 0}, /* two heads of 128 bytes */
        {2, 5, 48, 6, 60, 70, 210, 0},   /* runs of 96 bytes, 5 heads */
        /* runs of a line, 8 heads, blocks of 16: whole blocks (HND's
         * and packed K|V's one stretch each, joined run to run) and
         * halves (chunks of 40 tokens end inside a block) */
        {2, 8, 32, 16, 40, 40, 160, 0},
    };
    static const unsigned offsets[] = {0, 2, 16, 32, 48, 62};
    for (size_t g = 0; g < sizeof geos / sizeof geos[0]; g++)
        for (size_t o = 0; o < sizeof offsets / sizeof offsets[0]; o++) {
            G = geos[g];
            G.offset = offsets[o];
            assert_true(NTOK <= MAX_TOK && NTOK / BS <= MAX_BLOCKS && NB <= 2 * MAX_BLOCKS);
            ferry_kv_config cfg = config();
            ferry_kv *kv = NULL;
            FT_ASSERT_OK(ferry_kv_open(&cfg, &kv));
            every_pair(kv);
            ferry_kv_close(kv);
        }
}

static void test_streamed_copies_at_any_alignment(void **state)
{
    (void)state;
    streamed_copies();
    ferry__copy_narrow = 1;
    streamed_copies();
    ferry__copy_narrow = 0;
}

/* strides ferry cannot express are refused before any byte moves */
static void test_overlapping_strides_are_refused(void **state)
{
    (void)state;
    G = SMALL;
    ferry_kv_config cfg = config();
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&cfg, &kv));
    for (unsigned i = 0; i < NTOK; i++)
        g_tokens[i] = (int32_t)i;
    const uint64_t run = D * E;
    struct {
        uint64_t block, tok, head;
        const char *says;
    } bad[] = {
        {0, run, run, "overlap the runs of a block"},  /* heads and rows on one spot */
        {0, run / 2, 0, "token stride 8 is below one head_dim run"},
        {0, 0, run / 2, "head stride 8 is below one head_dim run"},
        {BS * H * run - 1, 0, 0, "block stride 127 is below one block"},
        {0, (uint64_t)1 << 60, 0, "past any address space"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        cache c;
        cache_init(&c, NHD, 7);
        fill(&c);
        memset(c.mem, SENT, MEM_BYTES);
        c.b.block_stride = bad[i].block;
        c.b.token_stride = bad[i].tok;
        c.b.head_stride = bad[i].head;
        assert_int_equal(ferry_kv_store(kv, g_tokens, NTOK, NULL, &c.b), -EINVAL);
        if (!strstr(ferry_last_error(), bad[i].says))
            fail_msg("case %zu: \"%s\" does not say \"%s\"", i, ferry_last_error(), bad[i].says);
        assert_int_equal(ferry_kv_retrieve(kv, g_tokens, NTOK, NULL, &c.b), -EINVAL);
        for (size_t j = 0; j < MEM_BYTES; j++)
            assert_int_equal(c.mem[j], SENT);
        free(c.alloc);
    }
    assert_int_equal(ferry_kv_lookup(kv, g_tokens, NTOK, NULL), 0);
    /* a caller built against the first header (no stride members): NHD */
    cache c;
    cache_init(&c, NHD, 9);
    fill(&c);
    c.b.size = FERRY_KV_BUFFER_MIN_SIZE;
    c.b.token_stride = 1; /* past its size: never read */
    assert_int_equal(ferry_kv_store(kv, g_tokens, NTOK, NULL, &c.b), NTOK);
    free(c.alloc);
    ferry_kv_close(kv);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_layout_pair_in_process),
        cmocka_unit_test(test_every_layout_pair_through_a_daemon),
        cmocka_unit_test(test_streamed_copies_at_any_alignment),
        cmocka_unit_test(test_overlapping_strides_are_refused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
