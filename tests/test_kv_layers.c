/*
 * test_kv_layers.c - layer-by-layer retrieves and stores (ferry/kv.h,
 * "layer by layer"): bytes bitwise equal to the source for contiguous and
 * paged buffers in host memory and in device memory (the host backend,
 * whose streams really run behind the caller, and a fake CUDA driver that
 * logs the engine's imported stream waiting on ferry's per-layer events);
 * a layer present once its wait returned while later ones are still held
 * back; a store invisible until its last layer and then visible whole;
 * cancel and free mid-way leaving nothing behind (no visible chunk, no
 * slot, no byte written after the call); misuse answered with a code; and
 * both forms through a `ferry serve` daemon, including a client that dies
 * halfway through a store.
 */
/* ferry-test-labels: concurrent */
/* ferry-test-timeout: 300 */
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "device/cuda_api.h"
#include "device/device_impl.h"
#include "ferry/kv.h"
#include "ferry/serve.h"
#include "ferry_test.h"
#include "serve_fixture.h"
#include "kv/kv_impl.h"

#define CT 16u                /* tokens per chunk */
#define L 4u                  /* layers */
#define TB 64u                /* bytes per token and plane */
#define NCH 5u                /* chunks in the prompt */
#define NTOK (NCH * CT)
#define PLANES (2u * L)
#define CHUNK_BYTES (PLANES * CT * TB)
#define SENT 0xEE

static char g_dir[256];
static char g_sock[300];

static ferry_kv_layout layout(void)
{
    ferry_kv_layout l = FERRY_KV_LAYOUT_INIT;
    l.num_layers = L;
    l.kv = 2;
    l.num_heads = 2;
    l.head_dim = TB / 4;
    l.dtype = FERRY_DTYPE_BF16;
    return l;
}

static ferry_kv_config config(uint64_t l1_chunks, ferry_device *dev)
{
    ferry_kv_config c = FERRY_KV_CONFIG_INIT;
    c.model = "layers";
    c.layout = layout();
    c.chunk_tokens = CT;
    c.l1_bytes = l1_chunks * CHUNK_BYTES;
    c.device = dev;
    c.workers = 2;
    return c;
}

static ferry_kv *open_store(uint64_t l1_chunks, ferry_device *dev)
{
    ferry_kv_config c = config(l1_chunks, dev);
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    return kv;
}

static void make_tokens(int32_t *t, size_t n, int32_t base)
{
    for (size_t i = 0; i < n; i++)
        t[i] = base + (int32_t)(i * 7 % 1000);
}

/* ---- buffers: a host image [plane][NTOK][TB] and the engine's forms ---- */

static size_t plane_bytes(void)
{
    return (size_t)NTOK * TB;
}

/* the bytes of (plane, token) in a contiguous image */
static unsigned char *at(unsigned char *img, unsigned plane, size_t tok)
{
    return img + plane * plane_bytes() + tok * TB;
}

static ferry_kv_buffer contiguous(uint64_t base, int mem)
{
    ferry_kv_buffer b = FERRY_KV_BUFFER_INIT;
    b.layout = layout();
    b.mem = mem;
    b.base = base;
    b.capacity_tokens = NTOK;
    return b;
}

/* a paged buffer: PLANES caches of NBLK blocks of BT tokens, the sequence's
 * blocks shuffled (some back to back, some not) */
#define BT 4u
#define NBLK 32u
typedef struct paged {
    unsigned char *mem;      /* host view of the caches */
    uint64_t bases[PLANES];
    int32_t table[NTOK / BT];
    ferry_kv_buffer b;
} paged;

static void paged_init(paged *p, unsigned char *mem, uint64_t base0, int mem_kind)
{
    p->mem = mem;
    for (unsigned i = 0; i < PLANES; i++)
        p->bases[i] = base0 + (uint64_t)i * NBLK * BT * TB;
    for (unsigned k = 0; k < NTOK / BT; k++)
        p->table[k] = (int32_t)(k % 4 == 3 ? NBLK - 1 - k / 4 : k); /* runs, and jumps */
    ferry_kv_buffer b = FERRY_KV_BUFFER_INIT;
    b.layout = layout();
    b.mem = mem_kind;
    b.form = FERRY_KV_PAGED;
    b.block_bases = p->bases;
    b.block_tokens = BT;
    b.num_blocks = NBLK;
    b.block_table = p->table;
    b.table_len = NTOK / BT;
    p->b = b;
}

static size_t paged_bytes(void)
{
    return (size_t)PLANES * NBLK * BT * TB;
}

static unsigned char *paged_at(paged *p, unsigned plane, size_t tok)
{
    return p->mem + (size_t)plane * NBLK * BT * TB +
           ((size_t)p->table[tok / BT] * BT + tok % BT) * TB;
}

/* does (plane, tokens [t0, t1)) of got hold want's bytes (paged NULL:
 * got is contiguous)? */
static int layer_same(unsigned char *want, unsigned char *got, paged *p, unsigned layer,
                      size_t t0, size_t t1)
{
    for (unsigned kv = 0; kv < 2; kv++) {
        unsigned plane = kv * L + layer;
        for (size_t t = t0; t < t1; t++) {
            unsigned char *g = p ? paged_at(p, plane, t) : at(got, plane, t);
            if (memcmp(g, at(want, plane, t), TB) != 0)
                return 0;
        }
    }
    return 1;
}

static int layer_untouched(unsigned char *got, paged *p, unsigned layer, size_t t0, size_t t1)
{
    for (unsigned kv = 0; kv < 2; kv++) {
        unsigned plane = kv * L + layer;
        for (size_t t = t0; t < t1; t++) {
            unsigned char *g = p ? paged_at(p, plane, t) : at(got, plane, t);
            for (unsigned b = 0; b < TB; b++)
                if (g[b] != SENT)
                    return 0;
        }
    }
    return 1;
}

static unsigned char *pattern_image(unsigned seed)
{
    unsigned char *img = malloc(PLANES * plane_bytes());
    assert_non_null(img);
    ft_fill_pattern(img, PLANES * plane_bytes(), seed);
    return img;
}

/* store tokens from a host image with the plain call */
static void store_plain(ferry_kv *kv, const int32_t *tok, unsigned char *img)
{
    ferry_kv_buffer src = contiguous((uintptr_t)img, FERRY_KV_MEM_HOST);
    assert_int_equal(ferry_kv_store(kv, tok, NTOK, NULL, &src), (int)NTOK);
}

static int lookup(ferry_kv *kv, const int32_t *tok)
{
    return ferry_kv_lookup(kv, tok, NTOK, NULL);
}

static void assert_l1_chunks(ferry_kv *kv, uint64_t chunks)
{
    FT_ASSERT_OK(ferry__kv_check(kv));
    ferry_kv_stats m = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(kv, &m));
    assert_int_equal(m.tier[FERRY_KV_TIER_L1].chunks, chunks);
    assert_int_equal(m.tier[FERRY_KV_TIER_L1].used_bytes, chunks * CHUNK_BYTES);
}

static int setup(void **state)
{
    (void)state;
    ft_tmpdir(g_dir, sizeof g_dir);
    snprintf(g_sock, sizeof g_sock, "%s/ferry.sock", g_dir);
    signal(SIGPIPE, SIG_IGN);
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    ft_rmtree(g_dir);
    return 0;
}

/* ---- retrieves into host memory ---- */

/* a layerwise retrieve of tok into dst: each layer, once waited for, holds
 * the source's bytes; the op returns every token */
static void retrieve_all(ferry_kv *kv, const int32_t *tok, unsigned char *want,
                         ferry_kv_buffer *dst, unsigned char *got, paged *p)
{
    ferry_kv_op *op = NULL;
    int st[NCH];
    ferry_kv_req req = FERRY_KV_REQ_INIT;
    req.status = st;
    req.max_chunks = NCH;
    FT_ASSERT_OK(ferry_kv_retrieve_layers(kv, tok, NTOK, &req, dst, NULL, &op));
    for (unsigned l = 0; l < L; l++) {
        assert_int_equal(ferry_kv_op_wait_layer(op, l, -1), (int)NTOK);
        assert_true(layer_same(want, got, p, l, 0, NTOK));
    }
    assert_int_equal(ferry_kv_op_wait_layer(op, 1, 0), (int)NTOK); /* again, any order */
    assert_int_equal(ferry_kv_op_wait(op, -1), (int)NTOK);
    for (unsigned i = 0; i < NCH; i++)
        assert_int_equal(st[i], 0);
    ferry_kv_op_free(op);
}

static void test_retrieve_host(void **state)
{
    (void)state;
    ferry_kv *kv = open_store(32, NULL);
    int32_t tok[NTOK];
    make_tokens(tok, NTOK, 100);
    unsigned char *src = pattern_image(3);
    store_plain(kv, tok, src);

    unsigned char *got = malloc(PLANES * plane_bytes());
    memset(got, SENT, PLANES * plane_bytes());
    ferry_kv_buffer dst = contiguous((uintptr_t)got, FERRY_KV_MEM_HOST);
    retrieve_all(kv, tok, src, &dst, got, NULL);
    assert_memory_equal(got, src, PLANES * plane_bytes());

    paged p;
    unsigned char *pm = malloc(paged_bytes());
    memset(pm, SENT, paged_bytes());
    paged_init(&p, pm, (uintptr_t)pm, FERRY_KV_MEM_HOST);
    retrieve_all(kv, tok, src, &p.b, NULL, &p);

    /* a prompt sharing only its first two chunks: the leading run loads */
    int32_t tok2[NTOK];
    memcpy(tok2, tok, sizeof tok2);
    tok2[2 * CT + 3] ^= 0x5555;
    memset(got, SENT, PLANES * plane_bytes());
    ferry_kv_op *op = NULL;
    FT_ASSERT_OK(ferry_kv_retrieve_layers(kv, tok2, NTOK, NULL, &dst, NULL, &op));
    for (unsigned l = 0; l < L; l++) {
        assert_int_equal(ferry_kv_op_wait_layer(op, l, -1), (int)(2 * CT));
        assert_true(layer_same(src, got, NULL, l, 0, 2 * CT));
        assert_true(layer_untouched(got, NULL, l, 2 * CT, NTOK));
    }
    assert_int_equal(ferry_kv_op_wait(op, -1), (int)(2 * CT));
    ferry_kv_op_free(op);

    /* nothing cached: every layer answers 0 at once */
    int32_t tok3[NTOK];
    make_tokens(tok3, NTOK, 9000);
    FT_ASSERT_OK(ferry_kv_retrieve_layers(kv, tok3, NTOK, NULL, &dst, NULL, &op));
    for (unsigned l = 0; l < L; l++)
        assert_int_equal(ferry_kv_op_wait_layer(op, l, -1), 0);
    assert_int_equal(ferry_kv_op_wait(op, -1), 0);
    ferry_kv_op_free(op);
    assert_l1_chunks(kv, NCH); /* every read lock was let go */
    free(pm);
    free(got);
    free(src);
    ferry_kv_close(kv);
}

/* ---- misuse ---- */

static void test_misuse(void **state)
{
    (void)state;
    ferry_kv *kv = open_store(32, NULL);
    int32_t tok[NTOK];
    make_tokens(tok, NTOK, 200);
    unsigned char *src = pattern_image(5);
    store_plain(kv, tok, src);
    unsigned char *got = malloc(PLANES * plane_bytes());
    ferry_kv_buffer dst = contiguous((uintptr_t)got, FERRY_KV_MEM_HOST);

    ferry_kv_op *op = NULL;
    ferry_kv_layers_opt o = FERRY_KV_LAYERS_OPT_INIT;
    o.flags = 1;
    assert_int_equal(ferry_kv_retrieve_layers(kv, tok, NTOK, NULL, &dst, &o, &op), -EINVAL);
    o = (ferry_kv_layers_opt)FERRY_KV_LAYERS_OPT_INIT;
    o.size = 3;
    assert_int_equal(ferry_kv_retrieve_layers(kv, tok, NTOK, NULL, &dst, &o, &op), -EINVAL);
    assert_int_equal(ferry_kv_retrieve_layers(kv, tok, NTOK, NULL, &dst, NULL, NULL), -EINVAL);
    assert_int_equal(ferry_kv_retrieve_layers(NULL, tok, NTOK, NULL, &dst, NULL, &op), -EINVAL);
    ferry_kv_buffer small = dst;
    small.capacity_tokens = NTOK - 1;
    assert_int_equal(ferry_kv_store_layers(kv, tok, NTOK, NULL, &small, NULL, &op), -ENOBUFS);
    ferry_kv_buffer devbuf = dst;
    devbuf.mem = FERRY_KV_MEM_DEVICE; /* a store without a device */
    assert_int_equal(ferry_kv_retrieve_layers(kv, tok, NTOK, NULL, &devbuf, NULL, &op),
                     FERRY_ENODEV);
    assert_null(op);

    FT_ASSERT_OK(ferry_kv_retrieve_layers(kv, tok, NTOK, NULL, &dst, NULL, &op));
    assert_int_equal(ferry_kv_op_wait_layer(op, L, -1), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "layer 4"));
    assert_int_equal(ferry_kv_op_layer_done(op, 0, NULL), FERRY_ESTATE);
    assert_int_equal(ferry_kv_op_wait_layer(op, L - 1, -1), (int)NTOK);
    assert_int_equal(ferry_kv_op_wait(op, -1), (int)NTOK);
    assert_int_equal(ferry_kv_op_wait_layer(op, 0, 0), (int)NTOK); /* after the end too */
    ferry_kv_op_free(op);
    assert_int_equal(ferry_kv_op_wait_layer(NULL, 0, 0), -EINVAL);
    assert_int_equal(ferry_kv_op_layer_done(NULL, 0, NULL), -EINVAL);

    /* a plain async op has no layers */
    FT_ASSERT_OK(ferry_kv_retrieve_async(kv, tok, NTOK, NULL, &dst, &op));
    assert_int_equal(ferry_kv_op_wait_layer(op, 0, -1), FERRY_ESTATE);
    assert_int_equal(ferry_kv_op_layer_done(op, 0, NULL), FERRY_ESTATE);
    assert_int_equal(ferry_kv_op_wait(op, -1), (int)NTOK);
    ferry_kv_op_free(op);

    /* a layerwise store: layers twice, past the end, waits that would hang */
    int32_t tok2[NTOK];
    make_tokens(tok2, NTOK, 7000);
    FT_ASSERT_OK(ferry_kv_store_layers(kv, tok2, NTOK, NULL, &dst, NULL, &op));
    assert_int_equal(ferry_kv_op_wait(op, -1), FERRY_ESTATE); /* layers missing: no hang */
    assert_non_null(strstr(ferry_last_error(), "lacks 4 of 4 layers"));
    assert_int_equal(ferry_kv_op_wait_layer(op, 0, -1), FERRY_ESTATE);
    assert_int_equal(ferry_kv_op_layer_done(op, L, NULL), -EINVAL);
    FT_ASSERT_OK(ferry_kv_op_layer_done(op, 2, NULL));
    assert_int_equal(ferry_kv_op_layer_done(op, 2, NULL), FERRY_ESTATE);
    assert_non_null(strstr(ferry_last_error(), "layer 2 was done already"));
    assert_int_equal(ferry_kv_op_test(op), FERRY_ESTATE);
    for (unsigned l = 0; l < L; l++)
        if (l != 2)
            FT_ASSERT_OK(ferry_kv_op_layer_done(op, l, NULL));
    assert_int_equal(ferry_kv_op_wait(op, -1), (int)NTOK);
    assert_int_equal(ferry_kv_op_layer_done(op, 1, NULL), FERRY_ESTATE);
    ferry_kv_op_free(op);
    free(got);
    free(src);
    ferry_kv_close(kv);
}

/* ---- stores ---- */

static void test_store_host(void **state)
{
    (void)state;
    ferry_kv *kv = open_store(32, NULL);
    int32_t tok[NTOK];
    make_tokens(tok, NTOK, 300);
    unsigned char *src = malloc(PLANES * plane_bytes());
    unsigned char *want = pattern_image(11);
    memset(src, 0, PLANES * plane_bytes());
    ferry_kv_buffer sb = contiguous((uintptr_t)src, FERRY_KV_MEM_HOST);
    ferry_kv_op *op = NULL;
    int st[NCH];
    ferry_kv_req req = FERRY_KV_REQ_INIT;
    req.status = st;
    req.max_chunks = NCH;
    FT_ASSERT_OK(ferry_kv_store_layers(kv, tok, NTOK, &req, &sb, NULL, &op));
    /* prefill computes the layers (out of order here): each is copied when
     * it is declared done, and the chunks stay invisible until the last */
    static const unsigned order[L] = {1, 0, 3, 2};
    for (unsigned k = 0; k < L; k++) {
        unsigned l = order[k];
        for (unsigned kvi = 0; kvi < 2; kvi++)
            memcpy(at(src, kvi * L + l, 0), at(want, kvi * L + l, 0), plane_bytes());
        assert_int_equal(lookup(kv, tok), 0);
        FT_ASSERT_OK(ferry_kv_op_layer_done(op, l, NULL));
        /* the engine reuses its buffer for the layer at once: the copy was taken */
        for (unsigned kvi = 0; kvi < 2; kvi++)
            memset(at(src, kvi * L + l, 0), 0x11, plane_bytes());
    }
    assert_int_equal(ferry_kv_op_wait(op, -1), (int)NTOK);
    for (unsigned i = 0; i < NCH; i++)
        assert_int_equal(st[i], 0);
    ferry_kv_op_free(op);
    assert_int_equal(lookup(kv, tok), (int)NTOK);
    unsigned char *got = malloc(PLANES * plane_bytes());
    ferry_kv_buffer gb = contiguous((uintptr_t)got, FERRY_KV_MEM_HOST);
    assert_int_equal(ferry_kv_retrieve(kv, tok, NTOK, NULL, &gb), (int)NTOK);
    assert_memory_equal(got, want, PLANES * plane_bytes());

    /* the same prompt again: every chunk present, nothing to feed */
    FT_ASSERT_OK(ferry_kv_store_layers(kv, tok, NTOK, NULL, &sb, NULL, &op));
    assert_int_equal(ferry_kv_op_wait(op, -1), (int)NTOK);
    FT_ASSERT_OK(ferry_kv_op_layer_done(op, 0, NULL)); /* (accepted, nothing to copy) */
    ferry_kv_op_free(op);

    /* paged source */
    int32_t tok2[NTOK];
    make_tokens(tok2, NTOK, 4000);
    paged p;
    unsigned char *pm = malloc(paged_bytes());
    memset(pm, 0, paged_bytes());
    paged_init(&p, pm, (uintptr_t)pm, FERRY_KV_MEM_HOST);
    for (unsigned pl = 0; pl < PLANES; pl++)
        for (size_t t = 0; t < NTOK; t++)
            memcpy(paged_at(&p, pl, t), at(want, pl, t), TB);
    FT_ASSERT_OK(ferry_kv_store_layers(kv, tok2, NTOK, NULL, &p.b, NULL, &op));
    for (unsigned l = 0; l < L; l++)
        FT_ASSERT_OK(ferry_kv_op_layer_done(op, l, NULL));
    assert_int_equal(ferry_kv_op_wait(op, -1), (int)NTOK);
    ferry_kv_op_free(op);
    memset(got, 0, PLANES * plane_bytes());
    assert_int_equal(ferry_kv_retrieve(kv, tok2, NTOK, NULL, &gb), (int)NTOK);
    assert_memory_equal(got, want, PLANES * plane_bytes());
    assert_l1_chunks(kv, 2 * NCH);
    free(pm);
    free(got);
    free(want);
    free(src);
    ferry_kv_close(kv);
}

/* cancel or free a store before its last layer: nothing visible, no slot */
static void test_store_abandoned(void **state)
{
    (void)state;
    ferry_kv *kv = open_store(32, NULL);
    int32_t tok[NTOK];
    make_tokens(tok, NTOK, 500);
    unsigned char *src = pattern_image(13);
    ferry_kv_buffer sb = contiguous((uintptr_t)src, FERRY_KV_MEM_HOST);
    ferry_kv_op *op = NULL;
    int st[NCH];
    ferry_kv_req req = FERRY_KV_REQ_INIT;
    req.status = st;
    req.max_chunks = NCH;
    FT_ASSERT_OK(ferry_kv_store_layers(kv, tok, NTOK, &req, &sb, NULL, &op));
    FT_ASSERT_OK(ferry_kv_op_layer_done(op, 0, NULL));
    FT_ASSERT_OK(ferry_kv_op_layer_done(op, 1, NULL));
    assert_int_equal(ferry_kv_op_cancel(op), -ECANCELED);
    for (unsigned i = 0; i < NCH; i++)
        assert_int_equal(st[i], -ECANCELED);
    assert_int_equal(ferry_kv_op_layer_done(op, 2, NULL), -ECANCELED);
    assert_int_equal(ferry_kv_op_wait(op, 0), -ECANCELED);
    ferry_kv_op_free(op);
    assert_int_equal(lookup(kv, tok), 0);
    assert_l1_chunks(kv, 0);

    FT_ASSERT_OK(ferry_kv_store_layers(kv, tok, NTOK, NULL, &sb, NULL, &op));
    FT_ASSERT_OK(ferry_kv_op_layer_done(op, 3, NULL));
    ferry_kv_op_free(op); /* freed before its last layer */
    assert_int_equal(lookup(kv, tok), 0);
    assert_l1_chunks(kv, 0);

    /* and the prompt stores whole afterwards */
    FT_ASSERT_OK(ferry_kv_store_layers(kv, tok, NTOK, NULL, &sb, NULL, &op));
    for (unsigned l = 0; l < L; l++)
        FT_ASSERT_OK(ferry_kv_op_layer_done(op, l, NULL));
    assert_int_equal(ferry_kv_op_wait(op, -1), (int)NTOK);
    ferry_kv_op_free(op);
    assert_int_equal(lookup(kv, tok), (int)NTOK);
    assert_l1_chunks(kv, NCH);

    /* a partial last chunk, stored and loaded layer by layer */
    int32_t tok4[NTOK];
    make_tokens(tok4, NTOK, 6000);
    size_t np = NTOK - 5;
    ferry_kv_req preq = FERRY_KV_REQ_INIT;
    preq.flags = FERRY_KV_PARTIAL;
    FT_ASSERT_OK(ferry_kv_store_layers(kv, tok4, np, &preq, &sb, NULL, &op));
    for (unsigned l = 0; l < L; l++)
        FT_ASSERT_OK(ferry_kv_op_layer_done(op, l, NULL));
    assert_int_equal(ferry_kv_op_wait(op, -1), (int)np);
    ferry_kv_op_free(op);
    assert_int_equal(ferry_kv_lookup(kv, tok4, np, &preq), (int)np);
    unsigned char *pg = malloc(PLANES * plane_bytes());
    memset(pg, SENT, PLANES * plane_bytes());
    ferry_kv_buffer pgb = contiguous((uintptr_t)pg, FERRY_KV_MEM_HOST);
    FT_ASSERT_OK(ferry_kv_retrieve_layers(kv, tok4, np, &preq, &pgb, NULL, &op));
    for (unsigned l = 0; l < L; l++) {
        assert_int_equal(ferry_kv_op_wait_layer(op, l, -1), (int)np);
        assert_true(layer_same(src, pg, NULL, l, 0, np));
        assert_true(layer_untouched(pg, NULL, l, np, NTOK));
    }
    assert_int_equal(ferry_kv_op_wait(op, -1), (int)np);
    ferry_kv_op_free(op);
    free(pg);
    assert_l1_chunks(kv, 2 * NCH);

    /* a store longer than its window (a quarter of L1) reserves the window
     * and takes the other chunks' layers into images of its own. While it
     * waits for layers it holds two of the eight slots: another writer's
     * five chunks all fit beside it (a store holding half would leave
     * room for four, and the fifth would evict the first). In the end
     * every chunk is stored, exact, whatever the order of its layers */
    ferry_kv_config sc = config(8, NULL);
    sc.watermark = 0.99; /* (evictions only when the eight are full) */
    ferry_kv *small = NULL;
    FT_ASSERT_OK(ferry_kv_open(&sc, &small));
    FT_ASSERT_OK(ferry_kv_store_layers(small, tok, NTOK, &req, &sb, NULL, &op));
    int32_t tok5[NTOK];
    make_tokens(tok5, NTOK, 9000);
    assert_int_equal(ferry_kv_store(small, tok5, NTOK, NULL, &sb), (int)NTOK);
    assert_int_equal(lookup(small, tok5), (int)NTOK);
    assert_int_equal(lookup(small, tok), 0); /* (nothing visible before the last layer) */
    for (unsigned l = L; l-- > 0;)
        FT_ASSERT_OK(ferry_kv_op_layer_done(op, l, NULL));
    assert_int_equal(ferry_kv_op_wait(op, -1), (int)NTOK);
    for (unsigned i = 0; i < NCH; i++)
        assert_int_equal(st[i], 0);
    ferry_kv_op_free(op);
    unsigned char *back = malloc(PLANES * plane_bytes());
    ferry_kv_buffer bb = contiguous((uintptr_t)back, FERRY_KV_MEM_HOST);
    memset(back, 0, PLANES * plane_bytes());
    assert_int_equal(ferry_kv_retrieve(small, tok, NTOK, NULL, &bb), (int)NTOK);
    assert_memory_equal(back, src, PLANES * plane_bytes());
    FT_ASSERT_OK(ferry__kv_check(small));

    /* the store closed right after the last layer, while the staged
     * chunks are stored: the op still answers (after close), stored or
     * cancelled as a whole, and nothing leaks */
    ferry_kv *gone = open_store(8, NULL);
    int32_t tok7[NTOK];
    make_tokens(tok7, NTOK, 15000);
    int st7[NCH];
    ferry_kv_req req7 = FERRY_KV_REQ_INIT;
    req7.status = st7;
    req7.max_chunks = NCH;
    FT_ASSERT_OK(ferry_kv_store_layers(gone, tok7, NTOK, &req7, &sb, NULL, &op));
    for (unsigned l = 0; l < L; l++)
        FT_ASSERT_OK(ferry_kv_op_layer_done(op, l, NULL));
    ferry_kv_close(gone);
    int rc7 = ferry_kv_op_wait(op, -1);
    assert_true(rc7 == (int)NTOK || rc7 == -ECANCELED);
    for (unsigned i = 0; i < NCH; i++)
        assert_int_equal(st7[i], rc7 < 0 ? rc7 : 0);
    ferry_kv_op_free(op);

    /* staged chunks of a store cancelled or freed before its last layer:
     * nothing of them becomes visible */
    int32_t tok6[NTOK];
    make_tokens(tok6, NTOK, 12000);
    FT_ASSERT_OK(ferry_kv_store_layers(small, tok6, NTOK, NULL, &sb, NULL, &op));
    FT_ASSERT_OK(ferry_kv_op_layer_done(op, 0, NULL));
    assert_int_equal(ferry_kv_op_cancel(op), -ECANCELED);
    ferry_kv_op_free(op);
    FT_ASSERT_OK(ferry_kv_store_layers(small, tok6, NTOK, NULL, &sb, NULL, &op));
    for (unsigned l = 0; l + 1 < L; l++)
        FT_ASSERT_OK(ferry_kv_op_layer_done(op, l, NULL));
    ferry_kv_op_free(op);
    assert_int_equal(lookup(small, tok6), 0);
    FT_ASSERT_OK(ferry__kv_check(small));
    free(back);
    ferry_kv_close(small);
    free(src);
    ferry_kv_close(kv);
}

/* a retrieve cancelled mid-way (from another thread, while it copies
 * layers of big chunks): afterwards no byte of dst changes, every layer a
 * wait reported holds the source's bytes, and the rest hold either the
 * source's bytes or what was there before, never anything else */
#define BIG_TB 16384u
#define BIG_CT 64u
#define BIG_NCH 16u
#define BIG_L 8u

static ferry_kv_layout big_layout(void)
{
    ferry_kv_layout l = layout();
    l.num_layers = BIG_L;
    l.head_dim = BIG_TB / 4;
    return l;
}

static void test_retrieve_cancel(void **state)
{
    (void)state;
    ferry_kv_config c = config(0, NULL);
    c.layout = big_layout();
    c.chunk_tokens = BIG_CT;
    size_t chunk = (size_t)2 * BIG_L * BIG_CT * BIG_TB; /* 16 MiB */
    c.l1_bytes = (uint64_t)(2 * BIG_NCH + 2) * chunk;
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    size_t n = (size_t)BIG_NCH * BIG_CT, plane = n * BIG_TB, all = 2 * BIG_L * plane;
    int32_t *tok = malloc(n * sizeof *tok);
    make_tokens(tok, n, 42);
    unsigned char *src = malloc(all), *got = malloc(all), *snap = malloc(all);
    ft_fill_pattern(src, all, 17);
    ferry_kv_buffer b = FERRY_KV_BUFFER_INIT;
    b.layout = big_layout();
    b.base = (uintptr_t)src;
    b.capacity_tokens = n;
    assert_int_equal(ferry_kv_store(kv, tok, n, NULL, &b), (int)n);
    b.base = (uintptr_t)got;
    int cancelled = 0;
    for (int round = 0; round < 6; round++) {
        memset(got, SENT, all);
        ferry_kv_op *op = NULL;
        FT_ASSERT_OK(ferry_kv_retrieve_layers(kv, tok, n, NULL, &b, NULL, &op));
        int w0 = ferry_kv_op_wait_layer(op, 0, -1);
        int rc = ferry_kv_op_cancel(op);
        memcpy(snap, got, all);
        struct timespec ts = {0, 20 * 1000 * 1000};
        nanosleep(&ts, NULL);
        assert_memory_equal(snap, got, all); /* nothing lands after the cancel */
        if (rc == -ECANCELED)
            cancelled++;
        else
            assert_int_equal(rc, (int)n);
        for (unsigned l = 0; l < BIG_L; l++) {
            int w = ferry_kv_op_wait_layer(op, l, 0);
            if (l == 0 && w0 >= 0)
                assert_int_equal(w, (int)n);
            for (unsigned kvi = 0; kvi < 2; kvi++) {
                size_t off = (size_t)(kvi * BIG_L + l) * plane;
                int same = memcmp(got + off, src + off, plane) == 0;
                if (w >= 0) {
                    assert_true(same);
                    continue;
                }
                assert_int_equal(w, -ECANCELED);
                for (size_t k = 0; !same && k < plane; k++)
                    if (got[off + k] != SENT && got[off + k] != src[off + k])
                        fail_msg("layer %u byte %zu: neither the source's nor untouched", l, k);
            }
        }
        ferry_kv_op_free(op);
    }
    FT_ASSERT_OK(ferry__kv_check(kv));
    fprintf(stderr, "retrieve cancel: %d of 6 rounds stopped mid-way\n", cancelled);
    free(snap);
    free(got);
    free(src);
    free(tok);
    ferry_kv_close(kv);
}

/* ---- device memory on the host backend ---- */

static ferry_device *host_device(void)
{
    ferry_device_options o = FERRY_DEVICE_OPTIONS_INIT;
    o.backend = "host";
    ferry_device *dev = NULL;
    FT_ASSERT_OK(ferry_device_open(&o, &dev));
    return dev;
}

/* retrieve into device memory: a layer is not reported before its copies
 * ran (ferry's copy stream held back), the engine's stream made to wait for
 * it on the device sees its bytes, and paged device buffers too */
static void test_retrieve_device(void **state)
{
    (void)state;
    ferry_device *dev = host_device();
    ferry_kv *kv = open_store(32, dev);
    int32_t tok[NTOK];
    make_tokens(tok, NTOK, 600);
    unsigned char *src = pattern_image(19);
    store_plain(kv, tok, src);
    size_t all = PLANES * plane_bytes();
    ferry_devptr d = 0;
    FT_ASSERT_OK(ferry_device_alloc(dev, all, &d));
    FT_ASSERT_OK(ferry_device_memset(dev, d, SENT, all));
    ferry_stream *copy = NULL, *engine = NULL;
    FT_ASSERT_OK(ferry_stream_create(dev, &copy));
    FT_ASSERT_OK(ferry_stream_create(dev, &engine));
    ferry_kv_layers_opt o = FERRY_KV_LAYERS_OPT_INIT;
    o.stream = copy;
    FT_ASSERT_OK(ferry__device_host_hold(copy, 1));
    ferry_kv_buffer db = contiguous(d, FERRY_KV_MEM_DEVICE);
    ferry_kv_op *op = NULL;
    FT_ASSERT_OK(ferry_kv_retrieve_layers(kv, tok, NTOK, NULL, &db, &o, &op));
    /* queued, not run: the engine's stream waits for layer 2 on the device */
    assert_int_equal(ferry_kv_op_stream_wait_layer(op, 2, engine, -1), (int)NTOK);
    unsigned char *h = malloc(all);
    memset(h, 0, all);
    unsigned char *hk = at(h, 0 * L + 2, 0), *hv = at(h, 1 * L + 2, 0);
    FT_ASSERT_OK(ferry_memcpy_dtoh_async(engine, hk, d + (uint64_t)(0 * L + 2) * plane_bytes(),
                                         plane_bytes()));
    FT_ASSERT_OK(ferry_memcpy_dtoh_async(engine, hv, d + (uint64_t)(1 * L + 2) * plane_bytes(),
                                         plane_bytes()));
    ferry_event *after = NULL;
    FT_ASSERT_OK(ferry_event_create(dev, &after));
    FT_ASSERT_OK(ferry_event_record(after, engine));
    assert_int_equal(ferry_kv_op_wait_layer(op, 0, 30), -ETIMEDOUT);
    assert_int_equal(ferry_event_query(after), -EAGAIN); /* the engine waits too */
    FT_ASSERT_OK(ferry__device_host_hold(copy, 0));
    FT_ASSERT_OK(ferry_stream_sync(engine));
    assert_true(layer_same(src, h, NULL, 2, 0, NTOK));
    assert_int_equal(ferry_kv_op_wait_layer(op, 0, -1), (int)NTOK);
    assert_int_equal(ferry_kv_op_wait(op, -1), (int)NTOK);
    ferry_kv_op_free(op);
    FT_ASSERT_OK(ferry_device_download(dev, h, d, all));
    assert_memory_equal(h, src, all);

    /* host-memory misuse of the stream form */
    unsigned char *hb = malloc(all);
    ferry_kv_buffer hbuf = contiguous((uintptr_t)hb, FERRY_KV_MEM_HOST);
    FT_ASSERT_OK(ferry_kv_retrieve_layers(kv, tok, NTOK, NULL, &hbuf, NULL, &op));
    assert_int_equal(ferry_kv_op_stream_wait_layer(op, 0, engine, -1), FERRY_ESTATE);
    assert_int_equal(ferry_kv_op_stream_wait_layer(op, 0, NULL, -1), -EINVAL);
    assert_int_equal(ferry_kv_op_wait(op, -1), (int)NTOK);
    ferry_kv_op_free(op);
    free(hb);

    /* paged device caches, the store's own stream */
    ferry_devptr pd = 0;
    FT_ASSERT_OK(ferry_device_alloc(dev, paged_bytes(), &pd));
    FT_ASSERT_OK(ferry_device_memset(dev, pd, SENT, paged_bytes()));
    paged p;
    unsigned char *pm = malloc(paged_bytes());
    paged_init(&p, pm, pd, FERRY_KV_MEM_DEVICE);
    FT_ASSERT_OK(ferry_kv_retrieve_layers(kv, tok, NTOK, NULL, &p.b, NULL, &op));
    for (unsigned l = 0; l < L; l++)
        assert_int_equal(ferry_kv_op_stream_wait_layer(op, l, engine, -1), (int)NTOK);
    FT_ASSERT_OK(ferry_memcpy_dtoh_async(engine, pm, pd, paged_bytes()));
    FT_ASSERT_OK(ferry_stream_sync(engine));
    for (unsigned l = 0; l < L; l++)
        assert_true(layer_same(src, NULL, &p, l, 0, NTOK));
    assert_int_equal(ferry_kv_op_wait(op, -1), (int)NTOK);
    ferry_kv_op_free(op);
    assert_l1_chunks(kv, NCH);

    ferry_event_destroy(after);
    ferry_stream_destroy(copy);
    ferry_stream_destroy(engine);
    free(pm);
    free(h);
    free(src);
    ferry_kv_close(kv);
    ferry_device_close(dev);
}

/* store from device memory: a layer declared done with the engine's stream
 * is copied after the engine's work queued before it (here a held stream
 * whose pending copy writes the layer's final bytes) */
/* no memory for the images of the chunks past the window: those chunks
 * report -ENOMEM with a message saying so, the window's are stored */
static void test_store_stage_nomem(void **state)
{
    (void)state;
    ft_alloc_install(0, 0);
    ft_alloc_fail_size(3 * (size_t)CHUNK_BYTES); /* the images of chunks 2..4 */
    ferry_kv *kv = open_store(8, NULL);
    int32_t tok[NTOK];
    make_tokens(tok, NTOK, 3300);
    unsigned char *src = pattern_image(29);
    ferry_kv_buffer sb = contiguous((uintptr_t)src, FERRY_KV_MEM_HOST);
    int st[NCH];
    ferry_kv_req req = FERRY_KV_REQ_INIT;
    req.status = st;
    req.max_chunks = NCH;
    ferry_kv_op *op = NULL;
    FT_ASSERT_OK(ferry_kv_store_layers(kv, tok, NTOK, &req, &sb, NULL, &op));
    assert_non_null(strstr(ferry_kv_last_error(kv), "no memory to stage chunks 2..4"));
    for (unsigned l = 0; l < L; l++)
        FT_ASSERT_OK(ferry_kv_op_layer_done(op, l, NULL));
    assert_int_equal(ferry_kv_op_wait(op, -1), (int)(2 * CT));
    assert_int_equal(st[1], 0);
    for (unsigned i = 2; i < NCH; i++)
        assert_int_equal(st[i], -ENOMEM);
    ferry_kv_op_free(op);
    assert_int_equal(lookup(kv, tok), (int)(2 * CT));
    ferry_kv_close(kv);
    assert_true(ft_alloc_failures() >= 1);
    assert_int_equal(ft_alloc_live(), 0); /* (nothing of the op or its store left) */
    ft_alloc_reset();
    free(src);
}

/* a layerwise store from device memory whose layers the engine's stream
 * computes (held back until declared done): nothing visible before the
 * last layer, then every chunk, exact */
static void store_device_layers(ferry_device *dev, ferry_kv *kv, const int32_t *tok,
                                const unsigned char *want, ferry_devptr d, ferry_stream *engine)
{
    size_t all = PLANES * plane_bytes();
    FT_ASSERT_OK(ferry_device_memset(dev, d, 0x33, all)); /* not yet computed */
    ferry_kv_buffer sb = contiguous(d, FERRY_KV_MEM_DEVICE);
    ferry_kv_op *op = NULL;
    FT_ASSERT_OK(ferry_kv_store_layers(kv, tok, NTOK, NULL, &sb, NULL, &op));
    FT_ASSERT_OK(ferry__device_host_hold(engine, 1));
    for (unsigned l = 0; l < L; l++) {
        /* "compute" layer l on the engine's stream, then declare it done */
        for (unsigned kvi = 0; kvi < 2; kvi++) {
            uint64_t off = (uint64_t)(kvi * L + l) * plane_bytes();
            FT_ASSERT_OK(ferry_memcpy_htod_async(engine, d + off, want + off, plane_bytes()));
        }
        FT_ASSERT_OK(ferry_kv_op_layer_done(op, l, engine));
    }
    assert_int_equal(lookup(kv, tok), 0);
    FT_ASSERT_OK(ferry__device_host_hold(engine, 0));
    assert_int_equal(ferry_kv_op_wait(op, -1), (int)NTOK);
    ferry_kv_op_free(op);
    assert_int_equal(lookup(kv, tok), (int)NTOK);
    unsigned char *got = malloc(all);
    ferry_kv_buffer gb = contiguous((uintptr_t)got, FERRY_KV_MEM_HOST);
    assert_int_equal(ferry_kv_retrieve(kv, tok, NTOK, NULL, &gb), (int)NTOK);
    assert_memory_equal(got, want, all);
    free(got);
}

static void test_store_device(void **state)
{
    (void)state;
    ferry_device *dev = host_device();
    ferry_kv *kv = open_store(32, dev);
    int32_t tok[NTOK];
    make_tokens(tok, NTOK, 700);
    unsigned char *want = pattern_image(23);
    size_t all = PLANES * plane_bytes();
    ferry_devptr d = 0;
    FT_ASSERT_OK(ferry_device_alloc(dev, all, &d));
    ferry_stream *engine = NULL;
    FT_ASSERT_OK(ferry_stream_create(dev, &engine));
    ferry_kv_buffer sb = contiguous(d, FERRY_KV_MEM_DEVICE);
    ferry_kv_op *op = NULL;
    store_device_layers(dev, kv, tok, want, d, engine);
    /* past the window of a smaller pool (two of eight slots): three chunks
     * staged in pinned images of the op's own, copied there on the device's
     * stream after the engine's */
    ferry_kv *small = open_store(8, dev);
    store_device_layers(dev, small, tok, want, d, engine);
    ferry_kv_close(small);
    unsigned char *got = malloc(all);

    /* cancelled with copies held back on the engine's stream: the cancel
     * waits for them, then aborts; nothing is visible, no slot is kept */
    int32_t tok2[NTOK];
    make_tokens(tok2, NTOK, 800);
    FT_ASSERT_OK(ferry_kv_store_layers(kv, tok2, NTOK, NULL, &sb, NULL, &op));
    FT_ASSERT_OK(ferry__device_host_hold(engine, 1));
    FT_ASSERT_OK(ferry_memcpy_htod_async(engine, d, want, plane_bytes()));
    FT_ASSERT_OK(ferry_kv_op_layer_done(op, 0, engine));
    FT_ASSERT_OK(ferry__device_host_hold(engine, 0));
    assert_int_equal(ferry_kv_op_cancel(op), -ECANCELED);
    ferry_kv_op_free(op);
    assert_int_equal(lookup(kv, tok2), 0);
    assert_l1_chunks(kv, NCH);
    ferry_stream_destroy(engine);
    free(got);
    free(want);
    ferry_kv_close(kv);
    ferry_device_close(dev);
}


/* ---- a fake CUDA driver: copies at once, and a log of the ordering calls ---- */

#define FAKE_CTX ((ferry__CUcontext)(uintptr_t)0xc0c0)
#define ENGINE_STREAM 0xe0e0u

enum { EV_REC = 1, EV_WAIT = 2, EV_BATCH = 3, EV_COPY = 4 };
typedef struct fake_ev {
    int what;
    uintptr_t a, b; /* REC: event, stream; WAIT: stream, event; BATCH / COPY: stream */
} fake_ev;
static pthread_mutex_t g_fmu = PTHREAD_MUTEX_INITIALIZER;
static fake_ev g_flog[4096];
static int g_nflog;
static int g_nstreams;

static void flog(int what, uintptr_t a, uintptr_t b)
{
    pthread_mutex_lock(&g_fmu);
    if (g_nflog < 4096)
        g_flog[g_nflog++] = (fake_ev){what, a, b};
    pthread_mutex_unlock(&g_fmu);
}

static ferry__CUresult f_cuInit(unsigned int f) { (void)f; return 0; }
static ferry__CUresult f_cuDeviceGetCount(int *n) { *n = 1; return 0; }
static ferry__CUresult f_cuDeviceGet(ferry__CUdevice *d, int o) { *d = o; return 0; }
static ferry__CUresult f_cuDeviceGetName(char *n, int len, ferry__CUdevice d)
{
    snprintf(n, (size_t)len, "Fake GPU %d", d);
    return 0;
}
static ferry__CUresult f_cuDevicePrimaryCtxRetain(ferry__CUcontext *c, ferry__CUdevice d)
{
    (void)d;
    *c = FAKE_CTX;
    return 0;
}
static ferry__CUresult f_cuDevicePrimaryCtxRelease_v2(ferry__CUdevice d) { (void)d; return 0; }
static ferry__CUresult f_cuCtxSetCurrent(ferry__CUcontext c) { (void)c; return 0; }
static ferry__CUresult f_cuMemAlloc_v2(ferry__CUdeviceptr *p, size_t n)
{
    void *m = NULL;
    if (posix_memalign(&m, 256, n) != 0)
        return 2;
    *p = (ferry__CUdeviceptr)(uintptr_t)m;
    return 0;
}
static ferry__CUresult f_cuMemFree_v2(ferry__CUdeviceptr p)
{
    free((void *)(uintptr_t)p);
    return 0;
}
static ferry__CUresult f_cuMemAllocHost_v2(void **pp, size_t n)
{
    return posix_memalign(pp, 4096, n) == 0 ? 0 : 2;
}
static ferry__CUresult f_cuMemFreeHost(void *p)
{
    free(p);
    return 0;
}
static ferry__CUresult f_cuMemHostRegister_v2(void *p, size_t n, unsigned int f)
{
    (void)p, (void)n, (void)f;
    return 0;
}
static ferry__CUresult f_cuMemHostUnregister(void *p) { (void)p; return 0; }
static ferry__CUresult f_cuMemsetD8_v2(ferry__CUdeviceptr d, unsigned char uc, size_t n)
{
    memset((void *)(uintptr_t)d, uc, n);
    return 0;
}
static ferry__CUresult f_cuMemcpyHtoDAsync_v2(ferry__CUdeviceptr d, const void *s, size_t n,
                                              ferry__CUstream st)
{
    flog(EV_COPY, (uintptr_t)st, 0);
    memcpy((void *)(uintptr_t)d, s, n);
    return 0;
}
static ferry__CUresult f_cuMemcpyDtoHAsync_v2(void *d, ferry__CUdeviceptr s, size_t n,
                                              ferry__CUstream st)
{
    flog(EV_COPY, (uintptr_t)st, 0);
    memcpy(d, (void *)(uintptr_t)s, n);
    return 0;
}
static ferry__CUresult f_cuMemcpyDtoDAsync_v2(ferry__CUdeviceptr d, ferry__CUdeviceptr s,
                                              size_t n, ferry__CUstream st)
{
    flog(EV_COPY, (uintptr_t)st, 0);
    memmove((void *)(uintptr_t)d, (void *)(uintptr_t)s, n);
    return 0;
}
static ferry__CUresult f_cuStreamCreate(ferry__CUstream *st, unsigned int f)
{
    (void)f;
    pthread_mutex_lock(&g_fmu);
    *st = (ferry__CUstream)(uintptr_t)(0x5000 + 0x10 * ++g_nstreams);
    pthread_mutex_unlock(&g_fmu);
    return 0;
}
static ferry__CUresult f_cuStreamDestroy_v2(ferry__CUstream st) { (void)st; return 0; }
static ferry__CUresult f_cuStreamSynchronize(ferry__CUstream st) { (void)st; return 0; }
static ferry__CUresult f_cuStreamWaitEvent(ferry__CUstream st, ferry__CUevent e, unsigned f)
{
    (void)f;
    flog(EV_WAIT, (uintptr_t)st, (uintptr_t)e);
    return 0;
}
static ferry__CUresult f_cuEventCreate(ferry__CUevent *e, unsigned int f)
{
    (void)f;
    *e = (ferry__CUevent)calloc(1, 16);
    return *e ? 0 : 2;
}
static ferry__CUresult f_cuEventDestroy_v2(ferry__CUevent e)
{
    free(e);
    return 0;
}
static ferry__CUresult f_cuEventRecord(ferry__CUevent e, ferry__CUstream st)
{
    flog(EV_REC, (uintptr_t)e, (uintptr_t)st);
    return 0;
}
static ferry__CUresult f_cuEventQuery(ferry__CUevent e) { (void)e; return 0; }
static ferry__CUresult f_cuEventSynchronize(ferry__CUevent e) { (void)e; return 0; }
static ferry__CUresult f_cuEventElapsedTime(float *ms, ferry__CUevent a, ferry__CUevent b)
{
    (void)a, (void)b;
    *ms = 0;
    return 0;
}
static ferry__CUresult f_cuGetErrorName(ferry__CUresult e, const char **s)
{
    (void)e;
    *s = "CUDA_ERROR_FAKE";
    return 0;
}
static ferry__CUresult f_cuGetErrorString(ferry__CUresult e, const char **s)
{
    (void)e;
    *s = "fake";
    return 0;
}
static ferry__CUresult f_batch_v2(ferry__CUdeviceptr *d, ferry__CUdeviceptr *s, size_t *n,
                                  size_t count, ferry__CUmemcpyAttributes *a, size_t *ai,
                                  size_t na, ferry__CUstream st)
{
    (void)a, (void)ai, (void)na;
    flog(EV_BATCH, (uintptr_t)st, count);
    for (size_t i = 0; i < count; i++)
        memcpy((void *)(uintptr_t)d[i], (const void *)(uintptr_t)s[i], n[i]);
    return 0;
}

static struct ferry__cuda_api g_fake_api = {
#define FAKE_MEMBER(name, R, params) .p_##name = f_##name,
    FERRY__CUDA_API_LIST(FAKE_MEMBER, ferry__CUresult, ferry__CUdevice, ferry__CUcontext,
                         ferry__CUstream, ferry__CUevent, ferry__CUdeviceptr)
#undef FAKE_MEMBER
    .p_cuMemcpyBatchAsync_v2 = f_batch_v2,
};

/* the log entries since `from` of kind what (a, b: 0 = any) */
static int flog_count(int from, int what, uintptr_t a, uintptr_t b)
{
    int n = 0;
    for (int i = from; i < g_nflog; i++)
        n += g_flog[i].what == what && (!a || g_flog[i].a == a) && (!b || g_flog[i].b == b);
    return n;
}

/* the engine's own (imported) stream: a retrieve's layer l is waited for
 * on the device, on an event ferry recorded after that layer's one
 * batched copy; a store's layer l is copied after an event recorded on
 * the engine's stream, which ferry's copy stream waits for first */
static void test_fake_cuda(void **state)
{
    (void)state;
    ferry__cuda_set_api_for_test(&g_fake_api);
    ferry_device_options o = FERRY_DEVICE_OPTIONS_INIT;
    o.backend = "cuda";
    ferry_device *dev = NULL;
    FT_ASSERT_OK(ferry_device_open(&o, &dev));
    ferry_kv *kv = open_store(32, dev);
    int32_t tok[NTOK];
    make_tokens(tok, NTOK, 3000);
    unsigned char *want = pattern_image(31);
    size_t all = PLANES * plane_bytes();
    ferry_devptr d = 0;
    FT_ASSERT_OK(ferry_device_alloc(dev, all, &d));
    memcpy((void *)(uintptr_t)d, want, all); /* (fake device memory is host memory) */
    ferry_stream *eng = NULL;
    FT_ASSERT_OK(ferry_stream_import(dev, ENGINE_STREAM, &eng));

    /* store: layer l ordered after the engine's stream */
    ferry_kv_buffer db = contiguous(d, FERRY_KV_MEM_DEVICE);
    ferry_kv_op *op = NULL;
    FT_ASSERT_OK(ferry_kv_store_layers(kv, tok, NTOK, NULL, &db, NULL, &op));
    for (unsigned l = 0; l < L; l++) {
        int from = g_nflog;
        FT_ASSERT_OK(ferry_kv_op_layer_done(op, l, eng));
        /* record(ev, engine), wait(S, ev), one batch on S: in that order */
        assert_int_equal(g_nflog - from, 3);
        assert_int_equal(g_flog[from].what, EV_REC);
        assert_int_equal(g_flog[from].b, ENGINE_STREAM);
        assert_int_equal(g_flog[from + 1].what, EV_WAIT);
        assert_int_equal(g_flog[from + 1].b, g_flog[from].a);
        assert_int_not_equal(g_flog[from + 1].a, ENGINE_STREAM);
        assert_int_equal(g_flog[from + 2].what, EV_BATCH);
        assert_int_equal(g_flog[from + 2].a, g_flog[from + 1].a);
        assert_int_equal(g_flog[from + 2].b, 2 * NCH); /* K and V of every chunk */
    }
    assert_int_equal(ferry_kv_op_wait(op, -1), (int)NTOK);
    ferry_kv_op_free(op);

    /* retrieve into other device memory, the engine's stream waiting per layer */
    ferry_devptr d2 = 0;
    FT_ASSERT_OK(ferry_device_alloc(dev, all, &d2));
    memset((void *)(uintptr_t)d2, SENT, all);
    ferry_kv_buffer d2b = contiguous(d2, FERRY_KV_MEM_DEVICE);
    int from = g_nflog;
    FT_ASSERT_OK(ferry_kv_retrieve_layers(kv, tok, NTOK, NULL, &d2b, NULL, &op));
    for (unsigned l = 0; l < L; l++)
        assert_int_equal(ferry_kv_op_stream_wait_layer(op, l, eng, -1), (int)NTOK);
    assert_int_equal(ferry_kv_op_wait(op, -1), (int)NTOK);
    ferry_kv_op_free(op);
    assert_memory_equal((void *)(uintptr_t)d2, want, all);
    assert_int_equal(flog_count(from, EV_WAIT, ENGINE_STREAM, 0), (int)L);
    assert_int_equal(flog_count(from, EV_BATCH, 0, 2 * NCH), (int)L); /* a call per layer */
    assert_int_equal(flog_count(from, EV_COPY, 0, 0), 0);
    /* every event the engine waited for was recorded after a batch, on its stream */
    for (int i = from; i < g_nflog; i++) {
        if (g_flog[i].what != EV_WAIT)
            continue;
        int ok = 0;
        for (int k = i - 1; k > from && !ok; k--) {
            if (g_flog[k].what != EV_REC || g_flog[k].a != g_flog[i].b)
                continue;
            int p = k - 1; /* (the engine's waits may interleave with ferry's calls) */
            while (p > from && g_flog[p].what == EV_WAIT)
                p--;
            ok = g_flog[p].what == EV_BATCH && g_flog[p].a == g_flog[k].b;
        }
        assert_true(ok);
    }
    ferry_stream_destroy(eng);
    ferry_kv_close(kv);
    FT_ASSERT_OK(ferry_device_free(dev, d));
    FT_ASSERT_OK(ferry_device_free(dev, d2));
    ferry_device_close(dev);
    ferry__cuda_set_api_for_test(NULL);
    free(want);
}

/* ---- through a daemon ---- */

typedef ft_srv srv;

static void srv_start_l1(srv *v, uint64_t l1_chunks)
{
    ferry_kv_config kc = config(l1_chunks, NULL);
    ferry_serve_config sc = FERRY_SERVE_CONFIG_INIT;
    sc.socket_path = g_sock;
    sc.kv = &kc;
    ft_srv_open(v, &sc);
}

static void srv_start(srv *v)
{
    srv_start_l1(v, 32);
}

static ferry_kv *open_client(void)
{
    ferry_kv_config c = config(1, NULL);
    c.server = g_sock;
    c.server_timeout_ms = 2000;
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    return kv;
}

/* wait until the daemon let go of `released` slots in all */
static void wait_released(srv *v, uint64_t released)
{
    ferry_serve_stats ss = FERRY_SERVE_STATS_INIT;
    for (int i = 0; i < 300; i++) {
        FT_ASSERT_OK(ferry_serve_stats_get(v->s, &ss));
        if (ss.released >= released)
            break;
        usleep(10000);
    }
    assert_true(ss.released >= released);
}

/* device memory through the daemon: the client's copies into and out of
 * the pool ordered after, and waited for by, the engine's stream */
static void server_device(ferry_kv *other, unsigned char *want)
{
    ferry_kv_op *op = NULL;
    ferry_device *dev = host_device();
    ferry_kv_config dc = config(1, dev);
    dc.server = g_sock;
    dc.server_timeout_ms = 2000;
    ferry_kv *dk = NULL;
    FT_ASSERT_OK(ferry_kv_open(&dc, &dk));
    size_t all = PLANES * plane_bytes();
    ferry_devptr d = 0, d2 = 0;
    FT_ASSERT_OK(ferry_device_alloc(dev, all, &d));
    FT_ASSERT_OK(ferry_device_alloc(dev, all, &d2));
    FT_ASSERT_OK(ferry_device_memset(dev, d, 0x33, all));
    FT_ASSERT_OK(ferry_device_memset(dev, d2, SENT, all));
    ferry_stream *engine = NULL;
    FT_ASSERT_OK(ferry_stream_create(dev, &engine));
    int32_t tok3[NTOK];
    make_tokens(tok3, NTOK, 3000);
    ferry_kv_buffer ds = contiguous(d, FERRY_KV_MEM_DEVICE);
    FT_ASSERT_OK(ferry_kv_store_layers(dk, tok3, NTOK, NULL, &ds, NULL, &op));
    FT_ASSERT_OK(ferry__device_host_hold(engine, 1));
    for (unsigned l = 0; l < L; l++) {
        for (unsigned kvi = 0; kvi < 2; kvi++) {
            uint64_t off = (uint64_t)(kvi * L + l) * plane_bytes();
            FT_ASSERT_OK(ferry_memcpy_htod_async(engine, d + off, want + off, plane_bytes()));
        }
        FT_ASSERT_OK(ferry_kv_op_layer_done(op, l, engine));
    }
    assert_int_equal(lookup(other, tok3), 0);
    FT_ASSERT_OK(ferry__device_host_hold(engine, 0));
    assert_int_equal(ferry_kv_op_wait(op, -1), (int)NTOK);
    ferry_kv_op_free(op);
    assert_int_equal(lookup(other, tok3), (int)NTOK);
    ferry_kv_buffer dd = contiguous(d2, FERRY_KV_MEM_DEVICE);
    FT_ASSERT_OK(ferry_kv_retrieve_layers(dk, tok3, NTOK, NULL, &dd, NULL, &op));
    for (unsigned l = 0; l < L; l++)
        assert_int_equal(ferry_kv_op_stream_wait_layer(op, l, engine, -1), (int)NTOK);
    unsigned char *h = malloc(all);
    FT_ASSERT_OK(ferry_memcpy_dtoh_async(engine, h, d2, all));
    FT_ASSERT_OK(ferry_stream_sync(engine));
    assert_memory_equal(h, want, all);
    assert_int_equal(ferry_kv_op_wait(op, -1), (int)NTOK);
    ferry_kv_op_free(op);
    ferry_stream_destroy(engine);
    free(h);
    ferry_kv_close(dk);
    ferry_device_close(dev);
}

static void test_server(void **state)
{
    (void)state;
    srv v;
    srv_start(&v);
    ferry_kv *kv = open_client(), *other = open_client();
    ferry_kv *daemon = ferry_serve_kv(v.s);
    int32_t tok[NTOK];
    make_tokens(tok, NTOK, 1000);
    unsigned char *want = pattern_image(29);
    ferry_kv_buffer sb = contiguous((uintptr_t)want, FERRY_KV_MEM_HOST);

    /* a store fed layer by layer: invisible to everyone until the last */
    ferry_kv_op *op = NULL;
    FT_ASSERT_OK(ferry_kv_store_layers(kv, tok, NTOK, NULL, &sb, NULL, &op));
    for (unsigned l = 0; l + 1 < L; l++) {
        FT_ASSERT_OK(ferry_kv_op_layer_done(op, l, NULL));
        assert_int_equal(lookup(other, tok), 0);
        assert_int_equal(lookup(kv, tok), 0); /* (the store's own calls go on meanwhile) */
    }
    FT_ASSERT_OK(ferry_kv_op_layer_done(op, L - 1, NULL));
    assert_int_equal(ferry_kv_op_wait(op, -1), (int)NTOK);
    ferry_kv_op_free(op);
    assert_int_equal(lookup(other, tok), (int)NTOK);
    assert_l1_chunks(daemon, NCH);

    /* retrieved layer by layer through the pool, contiguous and paged */
    unsigned char *got = malloc(PLANES * plane_bytes());
    memset(got, SENT, PLANES * plane_bytes());
    ferry_kv_buffer db = contiguous((uintptr_t)got, FERRY_KV_MEM_HOST);
    retrieve_all(other, tok, want, &db, got, NULL);
    assert_memory_equal(got, want, PLANES * plane_bytes());
    paged p;
    unsigned char *pm = malloc(paged_bytes());
    memset(pm, SENT, paged_bytes());
    paged_init(&p, pm, (uintptr_t)pm, FERRY_KV_MEM_HOST);
    retrieve_all(kv, tok, want, &p.b, NULL, &p);

    /* a store cancelled halfway: nothing visible, its slots back (aborted
     * by the cancel itself, before it returned) */
    int32_t tok2[NTOK];
    make_tokens(tok2, NTOK, 2000);
    FT_ASSERT_OK(ferry_kv_store_layers(kv, tok2, NTOK, NULL, &sb, NULL, &op));
    FT_ASSERT_OK(ferry_kv_op_layer_done(op, 1, NULL));
    assert_int_equal(ferry_kv_op_cancel(op), -ECANCELED);
    ferry_kv_op_free(op);
    assert_int_equal(lookup(other, tok2), 0);
    assert_l1_chunks(daemon, NCH);

    /* a client process that dies halfway through a layerwise store */
    ferry_serve_stats ss = FERRY_SERVE_STATS_INIT;
    FT_ASSERT_OK(ferry_serve_stats_get(v.s, &ss));
    uint64_t released = ss.released;
    int pfd[2];
    assert_int_equal(pipe(pfd), 0);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) { /* a fresh process (no threads inherited): child_store */
        char fd[16];
        snprintf(fd, sizeof fd, "%d", pfd[1]);
        execl("/proc/self/exe", "test_kv_layers", "--child-store", g_sock, fd, (char *)NULL);
        _exit(2);
    }
    char b;
    assert_int_equal(read(pfd[0], &b, 1), 1);
    assert_int_equal(lookup(other, tok2), 0);
    kill(pid, SIGKILL);
    int ws;
    waitpid(pid, &ws, 0);
    assert_true(WIFSIGNALED(ws));
    wait_released(&v, released + NCH);
    assert_int_equal(lookup(other, tok2), 0);
    assert_l1_chunks(daemon, NCH);
    /* and the prompt stores whole afterwards */
    FT_ASSERT_OK(ferry_kv_store_layers(other, tok2, NTOK, NULL, &sb, NULL, &op));
    for (unsigned l = 0; l < L; l++)
        FT_ASSERT_OK(ferry_kv_op_layer_done(op, l, NULL));
    assert_int_equal(ferry_kv_op_wait(op, -1), (int)NTOK);
    ferry_kv_op_free(op);
    assert_int_equal(lookup(kv, tok2), (int)NTOK);
    close(pfd[0]);
    close(pfd[1]);

    server_device(other, want);

    free(pm);
    free(got);
    free(want);
    ferry_kv_close(other);
    ferry_kv_close(kv);
    ft_srv_close(&v);
}

/* the child of test_server: half a layerwise store through the daemon at
 * sock, then a byte on fd, then it waits to be killed */
static int child_store(const char *sock, int fd)
{
    ferry_kv_config c = config(1, NULL);
    c.server = sock;
    int32_t tok2[NTOK];
    make_tokens(tok2, NTOK, 2000);
    unsigned char *want = pattern_image(29);
    ferry_kv_buffer sb = contiguous((uintptr_t)want, FERRY_KV_MEM_HOST);
    ferry_kv *ck = NULL;
    ferry_kv_op *cop = NULL;
    if (ferry_kv_open(&c, &ck) < 0 ||
        ferry_kv_store_layers(ck, tok2, NTOK, NULL, &sb, NULL, &cop) < 0 ||
        ferry_kv_op_layer_done(cop, 0, NULL) < 0 || ferry_kv_op_layer_done(cop, 1, NULL) < 0)
        return 3;
    char b = 1;
    if (write(fd, &b, 1) != 1)
        return 4;
    for (;;)
        pause();
}

/* ---- a store past its window among other writers ---- */

typedef struct writer {
    ferry_kv *kv;
    atomic_int stop;
    unsigned stores, exact, missed;
} writer;

/* store prompts of its own over and over (evicting), each read back: a
 * chunk it gets is its own bytes */
static void *writer_thread(void *arg)
{
    writer *w = arg;
    unsigned char *img = pattern_image(41), *got = malloc(PLANES * plane_bytes());
    ferry_kv_buffer sb = contiguous((uintptr_t)img, FERRY_KV_MEM_HOST);
    ferry_kv_buffer gb = contiguous((uintptr_t)got, FERRY_KV_MEM_HOST);
    int32_t tok[NTOK];
    for (unsigned i = 0; !atomic_load(&w->stop); i++) {
        make_tokens(tok, NTOK, 30000 + (int32_t)(i % 6) * 1000);
        int rc = ferry_kv_store(w->kv, tok, NTOK, NULL, &sb);
        assert_true(rc >= 0 || rc == FERRY_ENOSPACE);
        w->stores++;
        int st[NCH];
        ferry_kv_req req = FERRY_KV_REQ_INIT;
        req.status = st;
        req.max_chunks = NCH;
        memset(got, SENT, PLANES * plane_bytes());
        rc = ferry_kv_retrieve(w->kv, tok, NTOK, &req, &gb);
        assert_true(rc >= 0);
        for (unsigned c = 0; c < NCH; c++) {
            if (st[c] != 0) {
                w->missed++;
                continue;
            }
            for (unsigned l = 0; l < L; l++)
                assert_true(layer_same(img, got, NULL, l, c * CT, (c + 1) * CT));
            w->exact++;
        }
    }
    free(img);
    free(got);
    return NULL;
}

typedef struct scribbler {
    unsigned char *src;
    pthread_mutex_t mu; /* held while it scribbles, and to change layer */
    int layer;          /* the layer it scribbles over; -1 none */
    atomic_int stop;
} scribbler;

/* the engine computing a layer into its buffer meanwhile */
static void *scribble_thread(void *arg)
{
    scribbler *s = arg;
    for (unsigned v = 0; !atomic_load(&s->stop); v++) {
        pthread_mutex_lock(&s->mu);
        if (s->layer >= 0)
            for (unsigned kvi = 0; kvi < 2; kvi++)
                memset(at(s->src, kvi * L + (unsigned)s->layer, 0), (int)(v & 0xff),
                       plane_bytes());
        pthread_mutex_unlock(&s->mu);
        sched_yield();
    }
    return NULL;
}

static void scribble_on(scribbler *s, int layer)
{
    pthread_mutex_lock(&s->mu);
    s->layer = layer;
    pthread_mutex_unlock(&s->mu);
}

/* a store of five chunks into an L1 of eight (a window of two, three
 * staged) while another writer stores and evicts, the engine writing
 * each next layer into its buffer while the previous one is declared
 * done and reusing each layer at once after: every chunk it reports
 * stored is the layers' bytes as they were at their layer_done, exact,
 * and the other writer only ever reads back its own bytes */
static void test_store_window_among_evicting_writers(void **state)
{
    (void)state;
    ferry_kv_config c = config(8, NULL);
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    unsigned char *want = pattern_image(43), *src = malloc(PLANES * plane_bytes());
    unsigned char *got = malloc(PLANES * plane_bytes());
    ferry_kv_buffer sb = contiguous((uintptr_t)src, FERRY_KV_MEM_HOST);
    ferry_kv_buffer gb = contiguous((uintptr_t)got, FERRY_KV_MEM_HOST);
    writer w = {kv, 0, 0, 0, 0};
    pthread_t wt, stt;
    assert_int_equal(pthread_create(&wt, NULL, writer_thread, &w), 0);
    unsigned stored = 0;
    /* 12 rounds, and more while none read back: on a loaded host the other
     * writer can evict every round's chunks before their retrieve */
    for (int rep = 0; rep < 12 || (stored == 0 && rep < 400); rep++) {
        int32_t tok[NTOK];
        make_tokens(tok, NTOK, 50000 + rep * 1000);
        memset(src, 0x5A, PLANES * plane_bytes());
        scribbler s = {src, PTHREAD_MUTEX_INITIALIZER, -1, 0};
        assert_int_equal(pthread_create(&stt, NULL, scribble_thread, &s), 0);
        int st[NCH];
        ferry_kv_req req = FERRY_KV_REQ_INIT;
        req.status = st;
        req.max_chunks = NCH;
        ferry_kv_op *op = NULL;
        int rc = ferry_kv_store_layers(kv, tok, NTOK, &req, &sb, NULL, &op);
        if (rc == FERRY_ENOSPACE) { /* (the other writer held every slot) */
            atomic_store(&s.stop, 1);
            pthread_join(stt, NULL);
            pthread_mutex_destroy(&s.mu);
            continue;
        }
        FT_ASSERT_OK(rc);
        static const unsigned order[L] = {2, 0, 3, 1};
        for (unsigned k = 0; k < L; k++) {
            unsigned l = order[k];
            scribble_on(&s, -1);
            for (unsigned kvi = 0; kvi < 2; kvi++)
                memcpy(at(src, kvi * L + l, 0), at(want, kvi * L + l, 0), plane_bytes());
            scribble_on(&s, k + 1 < L ? (int)order[k + 1] : -1); /* the next one */
            FT_ASSERT_OK(ferry_kv_op_layer_done(op, l, NULL));
            scribble_on(&s, (int)l); /* reused at once */
        }
        atomic_store(&s.stop, 1);
        pthread_join(stt, NULL);
        pthread_mutex_destroy(&s.mu);
        rc = ferry_kv_op_wait(op, -1);
        assert_true(rc >= 0 || rc == FERRY_ENOSPACE);
        ferry_kv_op_free(op);
        int gst[NCH];
        req.status = gst;
        memset(got, SENT, PLANES * plane_bytes());
        assert_true(ferry_kv_retrieve(kv, tok, NTOK, &req, &gb) >= 0);
        for (unsigned i = 0; i < NCH; i++) {
            assert_true(st[i] == 0 || st[i] == FERRY_ENOSPACE);
            if (gst[i] != 0)
                continue; /* (not stored, or evicted since) */
            assert_int_equal(st[i], 0);
            for (unsigned l = 0; l < L; l++)
                assert_true(layer_same(want, got, NULL, l, i * CT, (i + 1) * CT));
            stored++;
        }
    }
    atomic_store(&w.stop, 1);
    pthread_join(wt, NULL);
    print_message("layerwise chunks read back %u; the writer's %u stores: %u exact, %u "
                  "missed\n", stored, w.stores, w.exact, w.missed);
    assert_true(stored > 0);
    FT_ASSERT_OK(ferry__kv_check(kv));
    ferry_kv_close(kv);
    free(want);
    free(src);
    free(got);
}

typedef struct canceller {
    ferry_kv_op *op;
    pthread_barrier_t *go;
    int rc;
} canceller;

static void *cancel_thread(void *arg)
{
    canceller *c = arg;
    pthread_barrier_wait(c->go);
    c->rc = ferry_kv_op_cancel(c->op);
    return NULL;
}

/* the last layer declared done while another thread cancels (past the
 * window: staged chunks too): the store ends whole or not at all (the
 * cancel answers the tokens stored, or -ECANCELED and nothing visible),
 * the layer's call answers 0 or -ECANCELED, and no slot is left held */
static void test_store_last_layer_races_cancel(void **state)
{
    (void)state;
    ferry_kv *kv = open_store(8, NULL);
    unsigned char *src = pattern_image(47);
    ferry_kv_buffer sb = contiguous((uintptr_t)src, FERRY_KV_MEM_HOST);
    unsigned whole = 0, none = 0;
    for (int rep = 0; rep < 40; rep++) {
        int32_t tok[NTOK];
        make_tokens(tok, NTOK, 70000 + rep * 1000);
        int st[NCH];
        ferry_kv_req req = FERRY_KV_REQ_INIT;
        req.status = st;
        req.max_chunks = NCH;
        ferry_kv_op *op = NULL;
        FT_ASSERT_OK(ferry_kv_store_layers(kv, tok, NTOK, &req, &sb, NULL, &op));
        for (unsigned l = 0; l + 1 < L; l++)
            FT_ASSERT_OK(ferry_kv_op_layer_done(op, l, NULL));
        pthread_barrier_t go;
        pthread_barrier_init(&go, NULL, 2);
        canceller c = {op, &go, 0};
        pthread_t th;
        assert_int_equal(pthread_create(&th, NULL, cancel_thread, &c), 0);
        pthread_barrier_wait(&go);
        int lrc = ferry_kv_op_layer_done(op, L - 1, NULL);
        pthread_join(th, NULL);
        pthread_barrier_destroy(&go);
        assert_true(lrc == 0 || lrc == -ECANCELED);
        assert_true(c.rc == (int)NTOK || c.rc == -ECANCELED);
        assert_int_equal(ferry_kv_op_wait(op, 0), c.rc);
        for (unsigned i = 0; i < NCH; i++)
            assert_int_equal(st[i], c.rc < 0 ? -ECANCELED : 0);
        ferry_kv_op_free(op);
        assert_int_equal(lookup(kv, tok), c.rc < 0 ? 0 : (int)NTOK);
        whole += c.rc >= 0;
        none += c.rc < 0;
        FT_ASSERT_OK(ferry__kv_check(kv));
        assert_true(ferry_kv_clear(kv) >= 0);
    }
    print_message("stored whole %u, cancelled %u\n", whole, none);
    assert_l1_chunks(kv, 0);
    ferry_kv_close(kv);
    free(src);
}

static uint64_t hist_total(const uint64_t *h)
{
    uint64_t t = 0;
    for (int i = 0; i < FERRY_KV_HIST_BUCKETS; i++)
        t += h[i];
    return t;
}

/* one layerwise store and one layerwise retrieve of a prompt longer than
 * the store's window (its chunks past it staged, then stored as a plain
 * store would be) count one store call and one retrieve call, and no more
 * latencies than calls: in process and through a daemon */
static void layerwise_calls_count_once(ferry_kv *kv, int32_t base)
{
    int32_t tok[NTOK];
    make_tokens(tok, NTOK, base);
    unsigned char *want = pattern_image((unsigned)base);
    unsigned char *got = malloc(PLANES * plane_bytes());
    assert_non_null(got);
    ferry_kv_buffer sb = contiguous((uintptr_t)want, FERRY_KV_MEM_HOST);
    ferry_kv_buffer gb = contiguous((uintptr_t)got, FERRY_KV_MEM_HOST);
    ferry_kv_stats a = FERRY_KV_STATS_INIT, b = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(kv, &a));
    ferry_kv_op *op = NULL;
    FT_ASSERT_OK(ferry_kv_store_layers(kv, tok, NTOK, NULL, &sb, NULL, &op));
    for (unsigned l = 0; l < L; l++)
        FT_ASSERT_OK(ferry_kv_op_layer_done(op, l, NULL));
    assert_int_equal(ferry_kv_op_wait(op, -1), (int)NTOK);
    ferry_kv_op_free(op);
    FT_ASSERT_OK(ferry_kv_stats_get(kv, &b));
    assert_int_equal(b.stored_chunks - a.stored_chunks, NCH);
    if (b.stores - a.stores != 1)
        fail_msg("one layerwise store counted as %llu store calls",
                 (unsigned long long)(b.stores - a.stores));
    assert_true(hist_total(b.store_ns) - hist_total(a.store_ns) <= 1);
    a = b;
    FT_ASSERT_OK(ferry_kv_retrieve_layers(kv, tok, NTOK, NULL, &gb, NULL, &op));
    int rc = ferry_kv_op_wait(op, -1); /* (as many chunks as one op may hold) */
    assert_true(rc >= (int)CT);
    ferry_kv_op_free(op);
    assert_memory_equal(got, want, (size_t)rc * TB);
    FT_ASSERT_OK(ferry_kv_stats_get(kv, &b));
    assert_int_equal(b.retrieves - a.retrieves, 1);
    assert_int_equal(hist_total(b.retrieve_ns) - hist_total(a.retrieve_ns), 1);
    assert_int_equal(b.stores, a.stores);
    free(got);
    free(want);
}

static void test_layerwise_calls_count_once(void **state)
{
    (void)state;
    ferry_kv *kv = open_store(8, NULL); /* a window of 2 chunks: 3 of 5 staged */
    layerwise_calls_count_once(kv, 7000);
    ferry_kv_close(kv);
    srv v;
    srv_start_l1(&v, 8);
    kv = open_client();
    layerwise_calls_count_once(kv, 8000);
    ferry_kv_close(kv);
    ft_srv_close(&v);
}

int main(int argc, char **argv)
{
    if (argc == 4 && strcmp(argv[1], "--child-store") == 0)
        return child_store(argv[2], atoi(argv[3]));
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_retrieve_host, setup, teardown),
        cmocka_unit_test_setup_teardown(test_misuse, setup, teardown),
        cmocka_unit_test_setup_teardown(test_store_host, setup, teardown),
        cmocka_unit_test_setup_teardown(test_store_abandoned, setup, teardown),
        cmocka_unit_test_setup_teardown(test_retrieve_cancel, setup, teardown),
        cmocka_unit_test_setup_teardown(test_retrieve_device, setup, teardown),
        cmocka_unit_test_setup_teardown(test_store_device, setup, teardown),
        cmocka_unit_test_setup_teardown(test_store_stage_nomem, setup, teardown),
        cmocka_unit_test_setup_teardown(test_store_window_among_evicting_writers, setup, teardown),
        cmocka_unit_test_setup_teardown(test_store_last_layer_races_cancel, setup, teardown),
        cmocka_unit_test_setup_teardown(test_fake_cuda, setup, teardown),
        cmocka_unit_test_setup_teardown(test_server, setup, teardown),
        cmocka_unit_test_setup_teardown(test_layerwise_calls_count_once, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
