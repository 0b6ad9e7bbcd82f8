/*
 * test_kv.c - the tiered KV store: chunk hashes and keys, store / lookup /
 * retrieve over contiguous and paged host and device buffers, bad input,
 * chunk states and lock TTLs, eviction (LRU, S3-FIFO, watermark, locked
 * chunks), the L2 slab tier (write-through, promotion, prefetch, I/O
 * errors), async ops, metrics and out-of-memory at every allocation.
 */
/* ferry-test-labels: concurrent */
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <errno.h>
#include <stddef.h>
#include <math.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry/kv.h"
#include "ferry_test.h"
#include "io/sys.h"
#include "kv/kv_impl.h"
#include "kv/store/store_int.h"

/* a small layout: 2 layers, K and V, 2 heads of 16 bf16: 64 bytes per token
 * and plane, 16-token chunks of 4096 bytes (the tests of chunks read in
 * pieces widen the heads to 256: chunks of 64 KiB) */
#define CT 16
static unsigned g_tb = 64;
#define TB g_tb
#define PLANES 4u
#define CHUNK (PLANES * CT * TB)

static ferry_kv_layout small_layout(void)
{
    return ft_kv_layout(TB);
}

static ferry_kv_config small_config(uint64_t l1_chunks)
{
    ferry_kv_config c = FERRY_KV_CONFIG_INIT;
    c.model = "test-model";
    c.layout = small_layout();
    c.chunk_tokens = CT;
    c.l1_bytes = l1_chunks * CHUNK;
    c.workers = 2;
    return c;
}

/* a host contiguous tensor [kv][layers][cap][64 bytes] */
typedef struct hbuf {
    ferry_kv_buffer b;
    unsigned char *mem;
    uint64_t cap;
} hbuf;

static void hbuf_init(hbuf *h, uint64_t cap, unsigned seed)
{
    ferry_kv_buffer b = FERRY_KV_BUFFER_INIT;
    b.layout = small_layout();
    h->cap = cap;
    h->mem = malloc(PLANES * cap * TB);
    assert_non_null(h->mem);
    ft_fill_pattern(h->mem, PLANES * cap * TB, seed);
    b.base = (uint64_t)(uintptr_t)h->mem;
    b.capacity_tokens = cap;
    h->b = b;
}

static const unsigned char *tok_at(const hbuf *h, unsigned plane, uint64_t t)
{
    return h->mem + ((uint64_t)plane * h->cap + t) * TB;
}

/* tokens [from, to) of a and b agree in every plane */
static int same_tokens(const hbuf *a, const hbuf *b, uint64_t from, uint64_t to)
{
    for (unsigned p = 0; p < PLANES; p++)
        if (memcmp(tok_at(a, p, from), tok_at(b, p, from), (to - from) * TB))
            return 0;
    return 1;
}

static void make_tokens(int32_t *t, size_t n, int32_t base)
{
    for (size_t i = 0; i < n; i++)
        t[i] = base + (int32_t)(i * 7919 % 32000);
}

/* ---- hashes and keys ---- */

static void hash_chain_matches_the_definition(void **state)
{
    (void)state;
    int32_t tok[3 * CT + 5];
    make_tokens(tok, 3 * CT + 5, 11);
    ferry_kv_hash h[8];
    assert_int_equal(ferry_kv_hash_chunks(42, tok, 3 * CT + 5, CT, 0, h, 8), 3);
    /* recompute one-shot from the little-endian definition */
    unsigned char buf[16 + 4 * CT];
    uint64_t lo = 0, hi = 0;
    for (int c = 0; c < 3; c++) {
        for (int i = 0; i < 8; i++) {
            buf[i] = (unsigned char)(lo >> (8 * i));
            buf[8 + i] = (unsigned char)(hi >> (8 * i));
        }
        for (int i = 0; i < CT; i++) {
            uint32_t v = (uint32_t)tok[c * CT + i];
            for (int k = 0; k < 4; k++)
                buf[16 + 4 * i + k] = (unsigned char)(v >> (8 * k));
        }
        XXH128_hash_t x = XXH3_128bits_withSeed(buf, sizeof buf, 42);
        lo = x.low64;
        hi = x.high64;
        assert_true(h[c].lo == lo && h[c].hi == hi);
    }
    /* a pinned vector: the hash of tokens 0..15 under the default seed never
     * changes (other processes and machines must agree) */
    int32_t z[CT];
    for (int i = 0; i < CT; i++)
        z[i] = i;
    ferry_kv_hash v;
    assert_int_equal(ferry_kv_hash_chunks(FERRY_KV_HASH_SEED_DEFAULT, z, CT, CT, 0, &v, 1), 1);
    unsigned char b2[16 + 4 * CT] = {0};
    for (int i = 0; i < CT; i++)
        b2[16 + 4 * i] = (unsigned char)i;
    XXH128_hash_t x = XXH3_128bits_withSeed(b2, sizeof b2, FERRY_KV_HASH_SEED_DEFAULT);
    assert_true(v.lo == x.low64 && v.hi == x.high64);
}

/* chunks longer than the hasher's one-call buffer (2048 tokens) stream
 * into a state: still the one-shot hash of the definition */
static void hash_chain_of_long_chunks_matches_the_definition(void **state)
{
    (void)state;
    enum { LCT = 3001, NT = 2 * LCT + 2500 };
    int32_t *tok = malloc(NT * sizeof *tok);
    unsigned char *buf = malloc(16 + 4 * LCT);
    assert_non_null(tok);
    assert_non_null(buf);
    make_tokens(tok, NT, 5);
    ferry_kv_hash h[4];
    assert_int_equal(ferry_kv_hash_chunks(7, tok, NT, LCT, 1, h, 4), 3);
    uint64_t lo = 0, hi = 0;
    for (int c = 0; c < 3; c++) {
        size_t len = c < 2 ? LCT : NT - 2 * LCT;
        for (int i = 0; i < 8; i++) {
            buf[i] = (unsigned char)(lo >> (8 * i));
            buf[8 + i] = (unsigned char)(hi >> (8 * i));
        }
        for (size_t i = 0; i < len; i++) {
            uint32_t v = (uint32_t)tok[c * LCT + i];
            for (int k = 0; k < 4; k++)
                buf[16 + 4 * i + k] = (unsigned char)(v >> (8 * k));
        }
        XXH128_hash_t x = XXH3_128bits_withSeed(buf, 16 + 4 * len, 7);
        lo = x.low64;
        hi = x.high64;
        assert_true(h[c].lo == lo && h[c].hi == hi);
    }
    free(buf);
    free(tok);
}

static void hash_prefix_and_partial(void **state)
{
    (void)state;
    int32_t tok[4 * CT + 3];
    make_tokens(tok, 4 * CT + 3, 5);
    ferry_kv_hash a[8], b[8];
    assert_int_equal(ferry_kv_hash_chunks(1, tok, 4 * CT + 3, CT, 0, a, 8), 4);
    assert_int_equal(ferry_kv_hash_chunks(1, tok, 4 * CT + 3, CT, 1, b, 8), 5);
    /* a prefix hashes to the leading hashes of the longer prompt */
    assert_memory_equal(a, b, 4 * sizeof a[0]);
    ferry_kv_hash c[2];
    assert_int_equal(ferry_kv_hash_chunks(1, tok, 2 * CT, CT, 0, c, 2), 2);
    assert_memory_equal(a, c, 2 * sizeof a[0]);
    /* changing one token of chunk 1 changes chunk 1 and every later hash */
    tok[CT + 3]++;
    assert_int_equal(ferry_kv_hash_chunks(1, tok, 4 * CT, CT, 0, c, 2), 4);
    assert_memory_equal(&a[0], &c[0], sizeof a[0]);
    assert_memory_not_equal(&a[1], &c[1], sizeof a[0]);
    /* count only, and bad arguments */
    assert_int_equal(ferry_kv_hash_chunks(1, tok, 10 * CT, CT, 0, NULL, 0), 10);
    assert_int_equal(ferry_kv_hash_chunks(1, tok, CT, 0, 0, c, 1), -EINVAL);
    assert_int_equal(ferry_kv_hash_chunks(1, NULL, CT, CT, 0, c, 1), -EINVAL);
}

static void key_format_is_stable_and_salted(void **state)
{
    (void)state;
    ferry_kv_key k = {"llama", 1, 4, {0x1122334455667788ull, 0x99aabbccddeeff00ull}, NULL, 0};
    char buf[128];
    int n = ferry_kv_key_format(&k, buf, sizeof buf);
    assert_string_equal(buf, "ferry1:llama:1/4:99aabbccddeeff001122334455667788");
    assert_int_equal(n, (int)strlen(buf));
    k.salt = "tenant-a";
    k.salt_len = 8;
    char s1[128], s2[128];
    ferry_kv_key_format(&k, s1, sizeof s1);
    k.salt = "tenant-b";
    ferry_kv_key_format(&k, s2, sizeof s2);
    assert_string_not_equal(s1, s2);
    assert_int_equal(strncmp(s1, buf, strlen(buf)), 0);
    /* snprintf semantics: truncated, full length reported */
    char tiny[8];
    assert_int_equal(ferry_kv_key_format(&k, tiny, sizeof tiny), (int)strlen(s2));
    assert_int_equal(strlen(tiny), 7);
    k.model = NULL;
    assert_int_equal(ferry_kv_key_format(&k, buf, sizeof buf), -EINVAL);
}

static void layout_chunk_bytes(void **state)
{
    (void)state;
    ferry_kv_layout l = FERRY_KV_LAYOUT_INIT;
    uint64_t b = 0;
    FT_ASSERT_OK(ferry_kv_layout_chunk_bytes(&l, 256, &b));
    assert_int_equal(b, 32ull << 20); /* Llama-3-8B: 32 MiB per 256 tokens */
    l.kv = 3;
    assert_int_equal(ferry_kv_layout_chunk_bytes(&l, 256, &b), -EINVAL);
    l.kv = 2;
    l.dtype = 999;
    assert_int_equal(ferry_kv_layout_chunk_bytes(&l, 256, &b), -EINVAL);
}

/* ---- eviction policies, directly ---- */

static ferry__kv_entry *pent(uint64_t id)
{
    ferry__kv_entry *e = calloc(1, sizeof *e);
    assert_non_null(e);
    e->id.lo = id;
    e->id.hi = ~id;
    return e;
}

static const ferry__kv_entry *g_refuse;
static int ok_unless_refused(ferry__kv_entry *e, void *ctx)
{
    (void)ctx;
    return e != g_refuse;
}

static void lru_policy_order_and_skips(void **state)
{
    (void)state;
    ferry__kv_policy *p;
    FT_ASSERT_OK(ferry__kv_policy_create(FERRY_KV_EVICT_LRU, 1, 8, &p));
    ferry__kv_entry *a = pent(1), *b = pent(2), *c = pent(3);
    p->ops->insert(p, a);
    p->ops->insert(p, b);
    p->ops->insert(p, c);
    p->ops->touch(p, a); /* order now a, c, b (b least recent) */
    g_refuse = NULL;
    assert_ptr_equal(p->ops->victim(p, ok_unless_refused, NULL), b);
    g_refuse = c; /* a locked chunk is skipped, not evicted */
    assert_ptr_equal(p->ops->victim(p, ok_unless_refused, NULL), a);
    assert_null(p->ops->victim(p, ok_unless_refused, NULL));
    assert_int_equal(c->node[1].queue != 0, 1);
    p->ops->remove(p, c);
    assert_int_equal(c->node[1].queue, 0);
    ferry__kv_policy_destroy(p);
    free(a);
    free(b);
    free(c);
}

static void s3fifo_policy_small_main_and_ghost(void **state)
{
    (void)state;
    ferry__kv_policy *p;
    FT_ASSERT_OK(ferry__kv_policy_create(FERRY_KV_EVICT_S3FIFO, 2, 10, &p)); /* S target 1 */
    ferry__kv_entry *a = pent(1), *b = pent(2), *c = pent(3), *d = pent(4);
    g_refuse = NULL;
    p->ops->insert(p, a);
    p->ops->insert(p, b);
    /* S holds both; the oldest unused one leaves and is remembered */
    assert_ptr_equal(p->ops->victim(p, ok_unless_refused, NULL), a);
    /* stored again while remembered: straight into M (queue 2) */
    p->ops->insert(p, a);
    assert_int_equal(a->node[2].queue, 2);
    p->ops->insert(p, c);
    p->ops->touch(p, c);
    p->ops->insert(p, d);
    /* S = d, c, b over its target: b (unused) goes */
    assert_ptr_equal(p->ops->victim(p, ok_unless_refused, NULL), b);
    /* S = d, c still over: c (used) moves to M; S is then at its target,
     * so M's unused tail a goes */
    assert_ptr_equal(p->ops->victim(p, ok_unless_refused, NULL), a);
    assert_int_equal(c->node[2].queue, 2);
    assert_int_equal(d->node[2].queue, 1);
    /* M is a CLOCK: c, used again, gets another round before it goes */
    p->ops->touch(p, c);
    g_refuse = d;
    assert_ptr_equal(p->ops->victim(p, ok_unless_refused, NULL), c);
    /* only a locked chunk is left: nothing to evict */
    assert_null(p->ops->victim(p, ok_unless_refused, NULL));
    assert_int_equal(d->node[2].queue, 1);
    ferry__kv_policy_destroy(p);
    free(a);
    free(b);
    free(c);
    free(d);
}

/* ---- open ---- */

static void open_rejects_bad_configs(void **state)
{
    (void)state;
    ferry_kv *kv = NULL;
    ferry_kv_config c = small_config(4);
    c.model = NULL;
    assert_int_equal(ferry_kv_open(&c, &kv), -EINVAL);
    c = small_config(4);
    c.l1_bytes = CHUNK - 1;
    assert_int_equal(ferry_kv_open(&c, &kv), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "l1_bytes"));
    c = small_config(4);
    c.watermark = 1.5;
    assert_int_equal(ferry_kv_open(&c, &kv), -EINVAL);
    c = small_config(4);
    c.layout.num_heads = 0;
    assert_int_equal(ferry_kv_open(&c, &kv), -EINVAL);
    c = small_config(4);
    c.l1_policy = 77;
    assert_int_equal(ferry_kv_open(&c, &kv), -EINVAL);
    /* every option is range-checked before it is used */
    c = small_config(4);
    c.watermark = -0.5;
    assert_int_equal(ferry_kv_open(&c, &kv), -EINVAL);
    c = small_config(4);
    c.watermark = NAN;
    assert_int_equal(ferry_kv_open(&c, &kv), -EINVAL);
    c = small_config(4);
    c.evict_fraction = -1;
    assert_int_equal(ferry_kv_open(&c, &kv), -EINVAL);
    c = small_config(4);
    c.tp_world = 2;
    c.tp_rank = 2;
    assert_int_equal(ferry_kv_open(&c, &kv), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "tp_rank"));
    c = small_config(4);
    c.tp_rank = 1; /* world 0 means 1 */
    assert_int_equal(ferry_kv_open(&c, &kv), -EINVAL);
    c = small_config(4);
    c.l2_policy = -1;
    assert_int_equal(ferry_kv_open(&c, &kv), -EINVAL);
    c = small_config(4);
    c.workers = 100000;
    assert_int_equal(ferry_kv_open(&c, &kv), -EINVAL);
    c = small_config(4);
    c.l2_dir = "";
    c.l2_bytes = 64 * CHUNK;
    assert_int_equal(ferry_kv_open(&c, &kv), -EINVAL);
    c = small_config(4);
    c.l2_mode = 0777; /* execute bits are not a file mode */
    assert_int_equal(ferry_kv_open(&c, &kv), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "l2_mode"));
    c = small_config(4);
    c.l2_mode = 0044; /* the owner without access */
    assert_int_equal(ferry_kv_open(&c, &kv), -EINVAL);
    c = small_config(4);
    c.l2_reset = 7;
    assert_int_equal(ferry_kv_open(&c, &kv), -EINVAL);
    /* a config from an older header (a prefix) opens with the defaults for
     * the rest; less than FERRY_KV_CONFIG_MIN_SIZE is refused */
    c = small_config(4);
    c.workers = 99999;   /* past the prefix: not read */
    c.l2_mode = 0777;    /* likewise */
    c.size = FERRY_KV_CONFIG_MIN_SIZE;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    ferry_kv_close(kv);
    kv = NULL;
    c.size = FERRY_KV_CONFIG_MIN_SIZE - 1;
    assert_int_equal(ferry_kv_open(&c, &kv), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "FERRY_KV_CONFIG_MIN_SIZE"));
    assert_null(kv);
    ferry_kv_close(NULL);
    c = small_config(4);
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    assert_int_equal(ferry_kv_chunk_bytes(kv), CHUNK);
    assert_int_equal(ferry_kv_chunk_tokens(kv), CT);
    ferry_kv_close(kv);
}

/* ---- store / lookup / retrieve on host memory ---- */

static void store_lookup_retrieve_contiguous(void **state)
{
    (void)state;
    ferry_kv_config c = small_config(16);
    ferry_kv *kv;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    size_t n = 3 * CT + 5;
    int32_t tok[3 * CT + 5];
    make_tokens(tok, n, 100);
    hbuf src, dst;
    hbuf_init(&src, n, 3);
    hbuf_init(&dst, n, 0);
    memset(dst.mem, 0xEE, PLANES * n * TB);

    assert_int_equal(ferry_kv_lookup(kv, tok, n, NULL), 0);
    int st[4] = {9, 9, 9, 9};
    ferry_kv_req r = FERRY_KV_REQ_INIT;
    r.status = st;
    r.max_chunks = 4;
    assert_int_equal(ferry_kv_store(kv, tok, n, &r, &src.b), 3 * CT);
    assert_int_equal(st[0], 0);
    assert_int_equal(st[2], 0);
    assert_int_equal(st[3], 9); /* no partial chunk without FERRY_KV_PARTIAL */

    uint8_t tiers[4] = {9, 9, 9, 9};
    ferry_kv_req lr = FERRY_KV_REQ_INIT;
    lr.tiers = tiers;
    lr.max_chunks = 4;
    assert_int_equal(ferry_kv_lookup(kv, tok, n, &lr), 3 * CT);
    assert_int_equal(tiers[0], FERRY_KV_TIER_L1);
    assert_int_equal(tiers[2], FERRY_KV_TIER_L1);
    /* a prefix finds its whole chunks */
    assert_int_equal(ferry_kv_lookup(kv, tok, 2 * CT + 3, NULL), 2 * CT);

    assert_int_equal(ferry_kv_retrieve(kv, tok, n, &r, &dst.b), 3 * CT);
    assert_true(same_tokens(&src, &dst, 0, 3 * CT));
    /* the tail beyond the cached chunks is not written */
    for (unsigned p = 0; p < PLANES; p++)
        for (uint64_t t = 3 * CT; t < n; t++)
            assert_int_equal(tok_at(&dst, p, t)[0], 0xEE);

    /* the partial last chunk, when asked */
    ferry_kv_req pr = FERRY_KV_REQ_INIT;
    pr.flags = FERRY_KV_PARTIAL;
    assert_int_equal(ferry_kv_lookup(kv, tok, n, &pr), 3 * CT);
    assert_int_equal(ferry_kv_store(kv, tok, n, &pr, &src.b), (int)n);
    assert_int_equal(ferry_kv_lookup(kv, tok, n, &pr), (int)n);
    assert_int_equal(ferry_kv_lookup(kv, tok, n, NULL), 3 * CT);
    assert_int_equal(ferry_kv_retrieve(kv, tok, n, &pr, &dst.b), (int)n);
    assert_true(same_tokens(&src, &dst, 0, n));

    /* a second store of the same tokens writes nothing new */
    ferry_kv_stats m = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(kv, &m));
    uint64_t stored = m.stored_chunks;
    assert_int_equal(ferry_kv_store(kv, tok, n, NULL, &src.b), 3 * CT);
    FT_ASSERT_OK(ferry_kv_stats_get(kv, &m));
    assert_int_equal(m.stored_chunks, stored);
    assert_int_equal(stored, 4);
    FT_ASSERT_OK(ferry__kv_check(kv));
    ferry_kv_close(kv);
    free(src.mem);
    free(dst.mem);
}

static void lookup_stops_at_the_first_miss_across_blocks(void **state)
{
    (void)state;
    ferry_kv_config c = small_config(64);
    ferry_kv *kv;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    size_t n = 40 * CT;
    int32_t *tok = malloc(n * sizeof *tok);
    make_tokens(tok, n, 31337);
    hbuf h;
    hbuf_init(&h, n, 2);
    assert_int_equal(ferry_kv_store(kv, tok, 20 * CT, NULL, &h.b), 20 * CT);
    uint8_t tiers[40];
    memset(tiers, 9, sizeof tiers);
    ferry_kv_req r = FERRY_KV_REQ_INIT;
    r.tiers = tiers;
    r.max_chunks = 40;
    assert_int_equal(ferry_kv_lookup(kv, tok, n, &r), 20 * CT);
    assert_int_equal(tiers[19], FERRY_KV_TIER_L1);
    assert_int_equal(tiers[20], FERRY_KV_TIER_NONE);
    assert_int_equal(tiers[21], 9); /* not looked at */
    /* a chunk missing in the middle hides everything after it */
    assert_int_equal(ferry_kv_delete(kv, tok + 0, 18 * CT, NULL) >= 0, 1);
    assert_int_equal(ferry_kv_store(kv, tok, 17 * CT, NULL, &h.b), 17 * CT);
    assert_int_equal(ferry_kv_lookup(kv, tok, n, NULL), 17 * CT);
    ferry_kv_close(kv);
    free(tok);
    free(h.mem);
}

/* a paged cache: per plane, num_blocks blocks of 4 tokens */
#define BT 4
#define NBLK 40
typedef struct pbuf {
    ferry_kv_buffer b;
    unsigned char *mem[PLANES];
    uint64_t bases[PLANES];
    int32_t table[NBLK];
} pbuf;

static void pbuf_init(pbuf *p, unsigned seed)
{
    ferry_kv_buffer b = FERRY_KV_BUFFER_INIT;
    b.layout = small_layout();
    b.form = FERRY_KV_PAGED;
    for (unsigned i = 0; i < PLANES; i++) {
        p->mem[i] = calloc(NBLK, BT * TB);
        assert_non_null(p->mem[i]);
        p->bases[i] = (uint64_t)(uintptr_t)p->mem[i];
    }
    /* a scrambled block table: sequence block k lives in cache block (k*7+3) % 40 */
    for (int k = 0; k < NBLK; k++)
        p->table[k] = (k * 7 + 3) % NBLK;
    (void)seed;
    b.block_bases = p->bases;
    b.block_tokens = BT;
    b.num_blocks = NBLK;
    b.block_table = p->table;
    b.table_len = NBLK;
    p->b = b;
}

static unsigned char *ptok(pbuf *p, unsigned plane, uint64_t t)
{
    return p->mem[plane] + ((uint64_t)p->table[t / BT] * BT + t % BT) * TB;
}

static void pbuf_free(pbuf *p)
{
    for (unsigned i = 0; i < PLANES; i++)
        free(p->mem[i]);
}

static void paged_blocks_round_trip(void **state)
{
    (void)state;
    ferry_kv_config c = small_config(16);
    ferry_kv *kv;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    size_t n = 4 * CT;
    int32_t tok[4 * CT];
    make_tokens(tok, n, 7);
    hbuf src, back;
    hbuf_init(&src, n, 9);
    hbuf_init(&back, n, 0);
    /* contiguous -> store -> paged */
    assert_int_equal(ferry_kv_store(kv, tok, n, NULL, &src.b), (int)n);
    pbuf pg;
    pbuf_init(&pg, 0);
    assert_int_equal(ferry_kv_retrieve(kv, tok, n, NULL, &pg.b), (int)n);
    for (unsigned p = 0; p < PLANES; p++)
        for (uint64_t t = 0; t < n; t++)
            assert_memory_equal(ptok(&pg, p, t), tok_at(&src, p, t), TB);
    /* paged -> store (other tokens) -> contiguous */
    int32_t tok2[4 * CT];
    make_tokens(tok2, n, 900);
    assert_int_equal(ferry_kv_store(kv, tok2, n, NULL, &pg.b), (int)n);
    assert_int_equal(ferry_kv_retrieve(kv, tok2, n, NULL, &back.b), (int)n);
    assert_true(same_tokens(&src, &back, 0, n));
    /* a block stride larger than a block (vLLM's K/V interleaving) */
    pbuf wide;
    pbuf_init(&wide, 0);
    for (unsigned i = 0; i < PLANES; i++) {
        free(wide.mem[i]);
        wide.mem[i] = calloc(NBLK, 2 * BT * TB);
        wide.bases[i] = (uint64_t)(uintptr_t)wide.mem[i];
    }
    wide.b.block_stride = 2 * BT * TB;
    assert_int_equal(ferry_kv_retrieve(kv, tok, n, NULL, &wide.b), (int)n);
    for (unsigned p = 0; p < PLANES; p++)
        for (uint64_t t = 0; t < n; t++)
            assert_memory_equal(wide.mem[p] + ((uint64_t)wide.table[t / BT] * 2 * BT + t % BT) * TB,
                                tok_at(&src, p, t), TB);
    ferry_kv_close(kv);
    pbuf_free(&pg);
    pbuf_free(&wide);
    free(src.mem);
    free(back.mem);
}

static void bad_input_has_clear_codes(void **state)
{
    (void)state;
    ferry_kv_config c = small_config(8);
    ferry_kv *kv;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    int32_t tok[2 * CT];
    make_tokens(tok, 2 * CT, 1);
    hbuf h;
    hbuf_init(&h, 2 * CT, 1);
    /* zero-length tokens */
    assert_int_equal(ferry_kv_lookup(kv, tok, 0, NULL), -EINVAL);
    assert_int_equal(ferry_kv_store(kv, tok, 0, NULL, &h.b), -EINVAL);
    assert_int_equal(ferry_kv_retrieve(kv, NULL, 5, NULL, &h.b), -EINVAL);
    /* a layout that is not the store's */
    ferry_kv_buffer bad = h.b;
    bad.layout.num_heads = 4;
    assert_int_equal(ferry_kv_store(kv, tok, 2 * CT, NULL, &bad), FERRY_EMISMATCH);
    assert_non_null(strstr(ferry_kv_last_error(kv), "layout"));
    bad = h.b;
    bad.layout.dtype = FERRY_DTYPE_F16;
    assert_int_equal(ferry_kv_retrieve(kv, tok, 2 * CT, NULL, &bad), FERRY_EMISMATCH);
    /* a destination too small */
    bad = h.b;
    bad.capacity_tokens = CT;
    assert_int_equal(ferry_kv_retrieve(kv, tok, 2 * CT, NULL, &bad), -ENOBUFS);
    assert_non_null(strstr(ferry_kv_last_error(kv), "holds 16 tokens"));
    /* device memory on a store without a device */
    bad = h.b;
    bad.mem = FERRY_KV_MEM_DEVICE;
    assert_int_equal(ferry_kv_store(kv, tok, 2 * CT, NULL, &bad), FERRY_ENODEV);
    /* paged: short table, block id out of range */
    pbuf pg;
    pbuf_init(&pg, 0);
    pg.b.table_len = 3;
    assert_int_equal(ferry_kv_retrieve(kv, tok, 2 * CT, NULL, &pg.b), -ENOBUFS);
    pg.b.table_len = NBLK;
    pg.table[2] = NBLK;
    assert_int_equal(ferry_kv_store(kv, tok, 2 * CT, NULL, &pg.b), -EINVAL);
    pg.table[2] = -1;
    assert_int_equal(ferry_kv_store(kv, tok, 2 * CT, NULL, &pg.b), -EINVAL);
    /* none of it stored anything */
    assert_int_equal(ferry_kv_lookup(kv, tok, 2 * CT, NULL), 0);
    /* a salt length without a salt */
    ferry_kv_req r = FERRY_KV_REQ_INIT;
    r.salt_len = 3;
    assert_int_equal(ferry_kv_lookup(kv, tok, 2 * CT, &r), -EINVAL);
    ferry_kv_close(kv);
    pbuf_free(&pg);
    free(h.mem);
}

static void salt_and_model_isolate_keys(void **state)
{
    (void)state;
    ferry_kv_config c = small_config(8);
    ferry_kv *kv;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    int32_t tok[2 * CT];
    make_tokens(tok, 2 * CT, 1);
    hbuf h;
    hbuf_init(&h, 2 * CT, 1);
    ferry_kv_req a = FERRY_KV_REQ_INIT, b = FERRY_KV_REQ_INIT;
    a.salt = "tenant-a";
    a.salt_len = 8;
    b.salt = "tenant-b";
    b.salt_len = 8;
    assert_int_equal(ferry_kv_store(kv, tok, 2 * CT, &a, &h.b), 2 * CT);
    assert_int_equal(ferry_kv_lookup(kv, tok, 2 * CT, &a), 2 * CT);
    assert_int_equal(ferry_kv_lookup(kv, tok, 2 * CT, &b), 0);
    assert_int_equal(ferry_kv_lookup(kv, tok, 2 * CT, NULL), 0);
    ferry_kv_close(kv);
    /* another model, or another TP rank, does not see the chunks */
    ferry_kv *k1, *k2;
    c = small_config(8);
    FT_ASSERT_OK(ferry_kv_open(&c, &k1));
    c.tp_world = 2;
    c.tp_rank = 1;
    FT_ASSERT_OK(ferry_kv_open(&c, &k2));
    assert_int_equal(ferry_kv_store(k1, tok, 2 * CT, NULL, &h.b), 2 * CT);
    ferry_kv_hash hs[2];
    ferry_kv_hash_chunks(FERRY_KV_HASH_SEED_DEFAULT, tok, 2 * CT, CT, 0, hs, 2);
    assert_int_equal(ferry__kv_chunk_state(k1, hs[1], NULL, 0, NULL, NULL), 2);
    assert_int_equal(ferry__kv_chunk_state(k2, hs[1], NULL, 0, NULL, NULL), -1);
    ferry_kv_close(k1);
    ferry_kv_close(k2);
    free(h.mem);
}

/* ---- states, locks, TTLs ---- */

static uint64_t g_clock;
static uint64_t fake_clock(void *ctx)
{
    (void)ctx;
    return g_clock;
}

static void delete_of_locked_chunk_and_pin_ttl(void **state)
{
    (void)state;
    ferry_kv_config c = small_config(8);
    c.read_ttl_ms = 1000;
    ferry_kv *kv;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    g_clock = 1000000000ull;
    ferry__kv_set_clock(kv, fake_clock, NULL);
    int32_t tok[2 * CT];
    make_tokens(tok, 2 * CT, 3);
    hbuf h;
    hbuf_init(&h, 2 * CT, 1);
    assert_int_equal(ferry_kv_store(kv, tok, 2 * CT, NULL, &h.b), 2 * CT);
    assert_int_equal(ferry_kv_pin(kv, tok, CT, NULL), CT); /* chunk 0 only */
    assert_int_equal(ferry_kv_delete(kv, tok, 2 * CT, NULL), FERRY_ELOCKED);
    assert_non_null(strstr(ferry_kv_last_error(kv), "locked"));
    /* the unlocked chunk 1 went, the pinned chunk 0 stayed */
    assert_int_equal(ferry_kv_lookup(kv, tok, 2 * CT, NULL), CT);
    assert_int_equal(ferry_kv_clear(kv), FERRY_ELOCKED);
    assert_int_equal(ferry_kv_lookup(kv, tok, CT, NULL), CT);
    /* past the read TTL the pin no longer holds */
    g_clock += 1000000000ull + 1;
    assert_int_equal(ferry_kv_delete(kv, tok, CT, NULL), 1);
    assert_int_equal(ferry_kv_lookup(kv, tok, CT, NULL), 0);
    ferry_kv_stats m = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(kv, &m));
    assert_true(m.lock_expired >= 1);
    /* pin / unpin balance; unpin of an unpinned chunk does nothing */
    assert_int_equal(ferry_kv_store(kv, tok, 2 * CT, NULL, &h.b), 2 * CT);
    assert_int_equal(ferry_kv_pin(kv, tok, 2 * CT, NULL), 2 * CT);
    assert_int_equal(ferry_kv_unpin(kv, tok, 2 * CT, NULL), 2 * CT);
    assert_int_equal(ferry_kv_unpin(kv, tok, 2 * CT, NULL), 0);
    assert_int_equal(ferry_kv_clear(kv), 2);
    FT_ASSERT_OK(ferry__kv_check(kv));
    ferry_kv_close(kv);
    free(h.mem);
}

static void crashed_writer_is_invisible_then_reclaimed(void **state)
{
    (void)state;
    ferry_kv_config c = small_config(4);
    c.write_ttl_ms = 5000;
    c.watermark = 1.0;
    c.evict_fraction = 0.25;
    ferry_kv *kv;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    g_clock = 5000000000ull;
    ferry__kv_set_clock(kv, fake_clock, NULL);
    int32_t tok[2 * CT];
    make_tokens(tok, 2 * CT, 8);
    hbuf h, d;
    hbuf_init(&h, 2 * CT, 1);
    hbuf_init(&d, 2 * CT, 0);
    /* a writer placed both chunks (WRITING) and died */
    assert_int_equal(ferry__kv_test_abandon_write(kv, tok, 2 * CT, NULL), 2);
    assert_int_equal(ferry_kv_lookup(kv, tok, 2 * CT, NULL), 0);       /* invisible */
    int st[2];
    ferry_kv_req r = FERRY_KV_REQ_INIT;
    r.status = st;
    r.max_chunks = 2;
    assert_int_equal(ferry_kv_retrieve(kv, tok, 2 * CT, &r, &d.b), 0);
    assert_int_equal(st[0], FERRY_ENOTFOUND);
    /* another store skips chunks being written; delete calls them locked */
    assert_int_equal(ferry_kv_store(kv, tok, 2 * CT, &r, &h.b), 0);
    assert_int_equal(st[0], FERRY_ELOCKED);
    assert_int_equal(ferry_kv_delete(kv, tok, 2 * CT, NULL), FERRY_ELOCKED);
    /* their slots are not evictable: only 2 of 4 left */
    ferry_kv_stats m = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(kv, &m));
    assert_int_equal(m.tier[FERRY_KV_TIER_L1].chunks, 2);
    /* after the write TTL the store reclaims them */
    g_clock += 5000000000ull + 1;
    assert_int_equal(ferry_kv_store(kv, tok, 2 * CT, &r, &h.b), 2 * CT);
    assert_int_equal(ferry_kv_retrieve(kv, tok, 2 * CT, NULL, &d.b), 2 * CT);
    assert_true(same_tokens(&h, &d, 0, 2 * CT));
    FT_ASSERT_OK(ferry_kv_stats_get(kv, &m));
    assert_int_equal(m.tier[FERRY_KV_TIER_L1].chunks, 2); /* the dead writer's slots came back */
    assert_true(m.lock_expired >= 2);
    FT_ASSERT_OK(ferry__kv_check(kv));
    ferry_kv_close(kv);
    free(h.mem);
    free(d.mem);
}

/* ---- eviction ---- */

/* store k one-chunk prompts, prompt i made of tokens base+i */
static void store_singles(ferry_kv *kv, int32_t base, int k, hbuf *h)
{
    for (int i = 0; i < k; i++) {
        int32_t tok[CT];
        make_tokens(tok, CT, base + i * 1000);
        assert_int_equal(ferry_kv_store(kv, tok, CT, NULL, &h->b), CT);
    }
}

static int single_cached(ferry_kv *kv, int32_t base, int i)
{
    int32_t tok[CT];
    make_tokens(tok, CT, base + i * 1000);
    return ferry_kv_lookup(kv, tok, CT, NULL) == CT;
}

static void lru_watermark_evicts_oldest_unlocked(void **state)
{
    (void)state;
    ferry_kv_config c = small_config(10); /* watermark 0.8 -> down to 0.6 */
    ferry_kv *kv;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    hbuf h;
    hbuf_init(&h, CT, 1);
    store_singles(kv, 0, 7, &h);
    ferry_kv_stats m = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(kv, &m));
    assert_int_equal(m.tier[FERRY_KV_TIER_L1].chunks, 7);
    assert_int_equal(m.tier[FERRY_KV_TIER_L1].evictions, 0);
    /* pin the oldest: it must survive */
    int32_t t0[CT];
    make_tokens(t0, CT, 0);
    assert_int_equal(ferry_kv_pin(kv, t0, CT, NULL), CT);
    /* the 8th reaches the watermark: evict down to 6 before placing it */
    store_singles(kv, 7000, 1, &h);
    FT_ASSERT_OK(ferry_kv_stats_get(kv, &m));
    assert_int_equal(m.tier[FERRY_KV_TIER_L1].evictions, 1);
    assert_int_equal(m.tier[FERRY_KV_TIER_L1].chunks, 7);
    assert_true(single_cached(kv, 0, 0));  /* pinned, kept */
    assert_false(single_cached(kv, 0, 1)); /* the least recently used unlocked one */
    assert_true(single_cached(kv, 0, 2));
    assert_true(single_cached(kv, 7000, 0));
    FT_ASSERT_OK(ferry__kv_check(kv));
    /* everything pinned and the pool full: the store declines cleanly */
    ferry_kv_close(kv);
    c = small_config(2);
    c.watermark = 1.0;
    c.evict_fraction = 0.5;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    store_singles(kv, 0, 2, &h);
    int32_t a[CT], b[CT], x[CT];
    make_tokens(a, CT, 0);
    make_tokens(b, CT, 1000);
    make_tokens(x, CT, 99000);
    ferry_kv_pin(kv, a, CT, NULL);
    ferry_kv_pin(kv, b, CT, NULL);
    assert_int_equal(ferry_kv_store(kv, x, CT, NULL, &h.b), FERRY_ENOSPACE);
    assert_int_equal(ferry_kv_lookup(kv, x, CT, NULL), 0);
    FT_ASSERT_OK(ferry_kv_stats_get(kv, &m));
    assert_int_equal(m.alloc_failures, 1);
    FT_ASSERT_OK(ferry__kv_check(kv));
    ferry_kv_close(kv);
    free(h.mem);
}

/* A chunk used once more than the stream of one-hit chunks that follows:
 * S3-FIFO keeps it (it moved to the main queue), LRU does not. */
static int survivor_after_scan(int policy)
{
    ferry_kv_config c = small_config(10);
    c.l1_policy = policy;
    c.watermark = 1.0;
    c.evict_fraction = 0.1;
    ferry_kv *kv;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    hbuf h, d;
    hbuf_init(&h, CT, 1);
    hbuf_init(&d, CT, 0);
    int32_t hot[CT];
    make_tokens(hot, CT, 424242);
    assert_int_equal(ferry_kv_store(kv, hot, CT, NULL, &h.b), CT);
    assert_int_equal(ferry_kv_retrieve(kv, hot, CT, NULL, &d.b), CT);
    store_singles(kv, 0, 30, &h);
    int kept = ferry_kv_lookup(kv, hot, CT, NULL) == CT;
    FT_ASSERT_OK(ferry__kv_check(kv));
    ferry_kv_close(kv);
    free(h.mem);
    free(d.mem);
    return kept;
}

static void s3fifo_keeps_reused_chunk_through_a_scan(void **state)
{
    (void)state;
    assert_true(survivor_after_scan(FERRY_KV_EVICT_S3FIFO));
    assert_false(survivor_after_scan(FERRY_KV_EVICT_LRU));
}

static void evicted_between_lookup_and_retrieve_is_a_miss(void **state)
{
    (void)state;
    ferry_kv_config c = small_config(8);
    ferry_kv *kv;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    int32_t tok[3 * CT];
    make_tokens(tok, 3 * CT, 77);
    hbuf h, d;
    hbuf_init(&h, 3 * CT, 5);
    hbuf_init(&d, 3 * CT, 0);
    memset(d.mem, 0xEE, PLANES * 3 * CT * TB);
    assert_int_equal(ferry_kv_store(kv, tok, 3 * CT, NULL, &h.b), 3 * CT);
    assert_int_equal(ferry_kv_lookup(kv, tok, 3 * CT, NULL), 3 * CT);
    /* chunk 1 disappears (here deleted; eviction takes the same path) */
    int32_t sub[2 * CT];
    memcpy(sub, tok, sizeof sub);
    ferry_kv_hash hs[3];
    ferry_kv_hash_chunks(FERRY_KV_HASH_SEED_DEFAULT, tok, 3 * CT, CT, 0, hs, 3);
    assert_int_equal(ferry_kv_delete(kv, sub, 2 * CT, NULL), 2);
    assert_int_equal(ferry_kv_store(kv, tok, CT, NULL, &h.b), CT); /* chunk 0 back */
    int st[3];
    ferry_kv_req r = FERRY_KV_REQ_INIT;
    r.status = st;
    r.max_chunks = 3;
    assert_int_equal(ferry_kv_retrieve(kv, tok, 3 * CT, &r, &d.b), CT);
    assert_int_equal(st[0], 0);
    assert_int_equal(st[1], FERRY_ENOTFOUND);
    assert_int_equal(st[2], 0);
    assert_true(same_tokens(&h, &d, 0, CT));
    assert_true(same_tokens(&h, &d, 2 * CT, 3 * CT));
    for (unsigned p = 0; p < PLANES; p++)
        for (uint64_t t = CT; t < 2 * CT; t++)
            assert_int_equal(tok_at(&d, p, t)[0], 0xEE); /* never stale bytes */
    ferry_kv_stats m = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(kv, &m));
    assert_int_equal(m.misses, 1);
    ferry_kv_close(kv);
    free(h.mem);
    free(d.mem);
}

/* ---- L2: write-through, promotion, prefetch, I/O errors ---- */

typedef struct l2fix {
    char dir[256];
    ferry_kv *kv;
    hbuf h, d;
} l2fix;

static void l2_open(l2fix *f, uint64_t l1_chunks, uint64_t l2_chunks, uint64_t prefetch_chunks)
{
    ft_tmpdir(f->dir, sizeof f->dir);
    assert_true(f->dir[0] != 0);
    ferry_kv_config c = small_config(l1_chunks);
    c.l2_dir = f->dir;
    c.l2_bytes = l2_chunks * CHUNK;
    c.l2_engine = "posix";
    c.prefetch_max_bytes = prefetch_chunks * CHUNK;
    c.watermark = 1.0;
    c.evict_fraction = 0.25;
    FT_ASSERT_OK(ferry_kv_open(&c, &f->kv));
    hbuf_init(&f->h, 8 * CT, 21);
    hbuf_init(&f->d, 8 * CT, 0);
}

static void l2_close(l2fix *f)
{
    FT_ASSERT_OK(ferry__kv_check(f->kv));
    ferry_kv_close(f->kv);
    ft_rmtree(f->dir);
    free(f->h.mem);
    free(f->d.mem);
}

static void l2_write_through_and_promotion(void **state)
{
    (void)state;
    l2fix f;
    l2_open(&f, 4, 64, 4);
    int32_t tok[8 * CT];
    make_tokens(tok, 8 * CT, 31);
    /* 8 chunks into an L1 of 4: all reach L2, the first ones leave L1 */
    assert_int_equal(ferry_kv_store(f.kv, tok, 4 * CT, NULL, &f.h.b), 4 * CT);
    FT_ASSERT_OK(ferry_kv_flush(f.kv));
    int32_t tok2[8 * CT];
    make_tokens(tok2, 8 * CT, 5000);
    hbuf h2;
    hbuf_init(&h2, 8 * CT, 99);
    assert_int_equal(ferry_kv_store(f.kv, tok2, 4 * CT, NULL, &h2.b), 4 * CT);
    FT_ASSERT_OK(ferry_kv_flush(f.kv));
    uint8_t tiers[4];
    ferry_kv_req r = FERRY_KV_REQ_INIT;
    r.tiers = tiers;
    r.max_chunks = 4;
    assert_int_equal(ferry_kv_lookup(f.kv, tok, 4 * CT, &r), 4 * CT);
    int in_l2 = 0;
    for (int i = 0; i < 4; i++)
        in_l2 += tiers[i] == FERRY_KV_TIER_L2;
    assert_true(in_l2 >= 1);
    /* retrieve reads them back from L2 byte for byte and promotes them */
    assert_int_equal(ferry_kv_retrieve(f.kv, tok, 4 * CT, NULL, &f.d.b), 4 * CT);
    assert_true(same_tokens(&f.h, &f.d, 0, 4 * CT));
    ferry_kv_stats m = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(f.kv, &m));
    assert_true(m.tier[FERRY_KV_TIER_L2].hits >= (uint64_t)in_l2);
    assert_int_equal(m.tier[FERRY_KV_TIER_L2].chunks, 8);
    assert_int_equal(m.tier[FERRY_KV_TIER_L2].bytes_written, 8 * CHUNK);
    assert_true(m.tier[FERRY_KV_TIER_L2].bytes_read >= (uint64_t)in_l2 * CHUNK);
    assert_int_equal(ferry_kv_lookup(f.kv, tok, CT, &r), CT);
    assert_int_equal(tiers[0], FERRY_KV_TIER_L1);
    free(h2.mem);
    l2_close(&f);
}

/* A's 4 chunks stored, then pushed out of an L1 of 8 by B's 8: A is in L2 only */
static void l2_only_prompt(l2fix *f, int32_t *a, int32_t *b)
{
    make_tokens(a, 4 * CT, 41);
    make_tokens(b, 8 * CT, 90000);
    assert_int_equal(ferry_kv_store(f->kv, a, 4 * CT, NULL, &f->h.b), 4 * CT);
    FT_ASSERT_OK(ferry_kv_flush(f->kv));
    hbuf hb;
    hbuf_init(&hb, 8 * CT, 77);
    assert_int_equal(ferry_kv_store(f->kv, b, 8 * CT, NULL, &hb.b), 8 * CT);
    FT_ASSERT_OK(ferry_kv_flush(f->kv));
    free(hb.mem);
    uint8_t tiers[4];
    ferry_kv_req r = FERRY_KV_REQ_INIT;
    r.tiers = tiers;
    r.max_chunks = 4;
    assert_int_equal(ferry_kv_lookup(f->kv, a, 4 * CT, &r), 4 * CT);
    for (int i = 0; i < 4; i++)
        assert_int_equal(tiers[i], FERRY_KV_TIER_L2);
}

static void l2_retrieve_keeps_reads_in_flight_past_the_prefetch_budget(void **state)
{
    (void)state;
    l2fix f;
    /* a prefetch budget of one chunk does not bound a retrieve: it keeps
     * whole-chunk reads in flight itself (here 2: a quarter of an L1 of 8)
     * and copies each chunk out as it lands */
    l2_open(&f, 8, 64, 1);
    int32_t a[4 * CT], b[8 * CT];
    l2_only_prompt(&f, a, b);
    ferry_kv_stats m0 = FERRY_KV_STATS_INIT, m1 = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(f.kv, &m0));
    atomic_store(&f.kv->tier[FERRY_KV_TIER_L2]->aread_peak, 0);
    assert_int_equal(ferry_kv_retrieve(f.kv, a, 4 * CT, NULL, &f.d.b), 4 * CT);
    assert_true(same_tokens(&f.h, &f.d, 0, 4 * CT));
    FT_ASSERT_OK(ferry_kv_flush(f.kv));
    FT_ASSERT_OK(ferry_kv_stats_get(f.kv, &m1));
    assert_int_equal(atomic_load(&f.kv->tier[FERRY_KV_TIER_L2]->aread_peak), 2);
    assert_int_equal(m1.prefetched_chunks, m0.prefetched_chunks); /* not prefetches */
    assert_int_equal(m1.tier[FERRY_KV_TIER_L2].hits - m0.tier[FERRY_KV_TIER_L2].hits, 4);
    assert_int_equal(m1.tier[FERRY_KV_TIER_L2].bytes_read - m0.tier[FERRY_KV_TIER_L2].bytes_read,
                     4 * CHUNK);
    /* promoted: the next lookup finds every chunk in L1 */
    uint8_t tiers[4];
    ferry_kv_req r = FERRY_KV_REQ_INIT;
    r.tiers = tiers;
    r.max_chunks = 4;
    assert_int_equal(ferry_kv_lookup(f.kv, a, 4 * CT, &r), 4 * CT);
    for (int i = 0; i < 4; i++)
        assert_int_equal(tiers[i], FERRY_KV_TIER_L1);
    l2_close(&f);
}

/* ---- L2 batches: many chunks in flight, faults in the middle ---- */

#define BIG 24 /* chunks */

typedef struct bigfix {
    char dir[256];
    ferry_kv *kv;
    hbuf h, d;
    int32_t a[BIG * CT], fill[2 * BIG * CT];
} bigfix;

/* an L1 of l1_chunks, the posix engine, the device dev (may be NULL);
 * prompt a (na chunks) stored and pushed out of L1 by two prompts of BIG
 * chunks */
static void big_open_dev(bigfix *f, uint64_t l1_chunks, size_t na, ferry_device *dev)
{
    ft_tmpdir(f->dir, sizeof f->dir);
    assert_true(f->dir[0] != 0);
    ferry_kv_config c = small_config(l1_chunks);
    c.device = dev;
    c.l2_dir = f->dir;
    c.l2_bytes = 4 * BIG * CHUNK;
    c.l2_engine = "posix";
    c.watermark = 1.0;
    c.evict_fraction = 0.25;
    FT_ASSERT_OK(ferry_kv_open(&c, &f->kv));
    hbuf_init(&f->h, 2 * BIG * CT, 61);
    hbuf_init(&f->d, 2 * BIG * CT, 0);
    make_tokens(f->a, BIG * CT, 3);
    make_tokens(f->fill, 2 * BIG * CT, 500000);
    assert_int_equal(ferry_kv_store(f->kv, f->a, na * CT, NULL, &f->h.b), (int)(na * CT));
    FT_ASSERT_OK(ferry_kv_flush(f->kv));
    hbuf x;
    hbuf_init(&x, 2 * BIG * CT, 9);
    assert_int_equal(ferry_kv_store(f->kv, f->fill, 2 * BIG * CT, NULL, &x.b), 2 * BIG * CT);
    FT_ASSERT_OK(ferry_kv_flush(f->kv));
    free(x.mem);
    uint8_t tiers[BIG];
    ferry_kv_req r = FERRY_KV_REQ_INIT;
    r.tiers = tiers;
    r.max_chunks = BIG;
    assert_int_equal(ferry_kv_lookup(f->kv, f->a, na * CT, &r), (int)(na * CT));
    for (size_t i = 0; i < na; i++)
        assert_int_equal(tiers[i], FERRY_KV_TIER_L2);
    memset(f->d.mem, 0xEE, PLANES * 2 * BIG * CT * TB);
    atomic_store(&f->kv->tier[FERRY_KV_TIER_L2]->aread_peak, 0);
}

static void big_open(bigfix *f, uint64_t l1_chunks, size_t na)
{
    big_open_dev(f, l1_chunks, na, NULL);
}

/* likewise with chunks of 64 KiB that the L2 tier reads in pieces of
 * `piece` bytes (0: whole chunks of 4 KiB, as big_open) */
static void big_open_pieces(bigfix *f, uint64_t l1_chunks, size_t na, uint64_t piece)
{
    g_tb = piece ? 1024 : 64;
    big_open(f, l1_chunks, na);
    f->kv->tier[FERRY_KV_TIER_L2]->apiece = piece;
}

static void big_close(bigfix *f)
{
    FT_ASSERT_OK(ferry__kv_check(f->kv));
    ferry_kv_close(f->kv);
    ft_rmtree(f->dir);
    free(f->h.mem);
    free(f->d.mem);
    g_tb = 64;
}

/* the L2 location of chunk k of tokens[0..n) (no salt) */
static uint64_t l2_loc_of(ferry_kv *kv, const int32_t *tok, size_t n, size_t k)
{
    ferry_kv_hash h[BIG];
    assert_true((size_t)ferry_kv_hash_chunks(kv->seed, tok, n, CT, 0, h, BIG) > k);
    ferry_kv_hash id = {h[k].lo ^ kv->ns0.lo, h[k].hi ^ kv->ns0.hi};
    uint64_t loc = UINT64_MAX;
    pthread_mutex_lock(&kv->mu);
    for (uint64_t b = 0; b < kv->nbuckets && loc == UINT64_MAX; b++)
        for (ferry__kv_entry *e = kv->buckets[b]; e; e = e->hnext)
            if (e->id.lo == id.lo && e->id.hi == id.hi)
                loc = e->loc[FERRY_KV_TIER_L2];
    pthread_mutex_unlock(&kv->mu);
    assert_true(loc != UINT64_MAX);
    return loc;
}

static void l2_batch_of_many_chunks_lands_byte_exact(void **state)
{
    (void)state;
    bigfix f;
    big_open(&f, 40, BIG); /* reads 8 at a time (a quarter of 40, at most 8) */
    int st[BIG];
    ferry_kv_req r = FERRY_KV_REQ_INIT;
    r.status = st;
    r.max_chunks = BIG;
    ferry_kv_stats m0 = FERRY_KV_STATS_INIT, m1 = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(f.kv, &m0));
    assert_int_equal(ferry_kv_retrieve(f.kv, f.a, BIG * CT, &r, &f.d.b), BIG * CT);
    for (int i = 0; i < BIG; i++)
        assert_int_equal(st[i], 0);
    /* f.h holds a's bytes in its first BIG * CT tokens; f.d is as wide */
    assert_true(same_tokens(&f.h, &f.d, 0, BIG * CT));
    for (unsigned p = 0; p < PLANES; p++)
        for (uint64_t t = BIG * CT; t < 2 * BIG * CT; t++)
            assert_int_equal(tok_at(&f.d, p, t)[0], 0xEE); /* nothing past the prompt */
    assert_int_equal(atomic_load(&f.kv->tier[FERRY_KV_TIER_L2]->aread_peak), 8);
    FT_ASSERT_OK(ferry_kv_stats_get(f.kv, &m1));
    assert_int_equal(m1.tier[FERRY_KV_TIER_L2].hits - m0.tier[FERRY_KV_TIER_L2].hits, BIG);
    assert_int_equal(m1.tier[FERRY_KV_TIER_L2].bytes_read - m0.tier[FERRY_KV_TIER_L2].bytes_read,
                     BIG * CHUNK);
    assert_int_equal(m1.retrieved_chunks - m0.retrieved_chunks, BIG);
    assert_int_equal(m1.tier[FERRY_KV_TIER_L2].failures, 0);
    big_close(&f);
}

/* the syscall seam: preads of g_count_len bytes counted */
static _Atomic size_t g_count_len;
static _Atomic int g_counted;

static ssize_t counting_pread(int fd, void *buf, size_t n, off_t off)
{
    if (n == atomic_load(&g_count_len))
        atomic_fetch_add(&g_counted, 1);
    return ferry__sys_default()->pread(fd, buf, n, off);
}

/* chunks of 64 KiB read in pieces of 16 KiB: every chunk arrives whole and
 * byte-exact, each read as exactly 4 requests, several chunks at once */
static void l2_chunks_read_in_pieces_land_byte_exact(void **state)
{
    (void)state;
    bigfix f;
    big_open_pieces(&f, 40, BIG, 16384);
    ferry_kv_stats m0 = FERRY_KV_STATS_INIT, m1 = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(f.kv, &m0));
    atomic_store(&g_count_len, 16384);
    atomic_store(&g_counted, 0);
    ferry__sys sys = *ferry__sys_default();
    sys.pread = counting_pread;
    ferry__sys_set(&sys);
    int st[BIG];
    ferry_kv_req r = FERRY_KV_REQ_INIT;
    r.status = st;
    r.max_chunks = BIG;
    int got = ferry_kv_retrieve(f.kv, f.a, BIG * CT, &r, &f.d.b);
    ferry__sys_set(NULL);
    assert_int_equal(got, BIG * CT);
    for (int i = 0; i < BIG; i++)
        assert_int_equal(st[i], 0);
    assert_true(same_tokens(&f.h, &f.d, 0, BIG * CT));
    for (unsigned p = 0; p < PLANES; p++)
        for (uint64_t t = BIG * CT; t < 2 * BIG * CT; t++)
            assert_int_equal(tok_at(&f.d, p, t)[0], 0xEE); /* nothing past the prompt */
    assert_int_equal(atomic_load(&g_counted), 4 * BIG);
    /* 16 pieces in flight: at least four chunks at once, never more than
     * the 8 chunks a retrieve reads at once */
    uint64_t peak = atomic_load(&f.kv->tier[FERRY_KV_TIER_L2]->aread_peak);
    assert_true(peak >= 4 && peak <= 8);
    FT_ASSERT_OK(ferry_kv_stats_get(f.kv, &m1));
    assert_int_equal(m1.tier[FERRY_KV_TIER_L2].hits - m0.tier[FERRY_KV_TIER_L2].hits, BIG);
    assert_int_equal(m1.tier[FERRY_KV_TIER_L2].bytes_read - m0.tier[FERRY_KV_TIER_L2].bytes_read,
                     BIG * CHUNK);
    assert_int_equal(m1.tier[FERRY_KV_TIER_L2].failures, 0);
    /* promoted whole: the next retrieve is served from L1 */
    uint8_t tiers[BIG];
    ferry_kv_req lr = FERRY_KV_REQ_INIT;
    lr.tiers = tiers;
    lr.max_chunks = BIG;
    assert_int_equal(ferry_kv_lookup(f.kv, f.a, BIG * CT, &lr), BIG * CT);
    for (int i = 0; i < BIG; i++)
        assert_int_equal(tiers[i], FERRY_KV_TIER_L1);
    big_close(&f);
}

/* out of memory at each allocation of a retrieve whose chunks are read in
 * pieces: every chunk it reports is byte-exact, the others are untouched,
 * and no L2 copy is dropped for it (memory ran out, not the disk) */
static int oom_retrieve_pieces_run(void *ctx)
{
    (void)ctx;
    ft_oom_pause(); /* the store's every block through the counting allocator */
    bigfix f;
    big_open_pieces(&f, 40, BIG, 16384);
    ferry_kv_stats m0 = FERRY_KV_STATS_INIT, m1 = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(f.kv, &m0));
    int st[BIG];
    for (int i = 0; i < BIG; i++)
        st[i] = 1;
    ferry_kv_req r = FERRY_KV_REQ_INIT;
    r.status = st;
    r.max_chunks = BIG;
    ft_oom_resume();
    int got = ferry_kv_retrieve(f.kv, f.a, BIG * CT, &r, &f.d.b);
    /* the workers' last allocations happen before the allocator pauses */
    FT_ASSERT_OK(ferry_kv_flush(f.kv));
    ft_oom_pause();
    int clean = ft_alloc_failures() == 0;
    assert_true(got >= 0 || got == -ENOMEM);
    if (got >= 0)
        for (int i = 0; i < BIG; i++) {
            uint64_t t0 = (uint64_t)i * CT;
            if (st[i] == 0) {
                assert_true(same_tokens(&f.h, &f.d, t0, t0 + CT));
                continue;
            }
            for (unsigned p = 0; p < PLANES; p++)
                assert_int_equal(tok_at(&f.d, p, t0)[0], 0xEE);
        }
    if (clean)
        assert_int_equal(got, BIG * CT);
    FT_ASSERT_OK(ferry_kv_stats_get(f.kv, &m1));
    assert_int_equal(m1.tier[FERRY_KV_TIER_L2].failures, m0.tier[FERRY_KV_TIER_L2].failures);
    assert_int_equal(ferry_kv_lookup(f.kv, f.a, BIG * CT, NULL), BIG * CT);
    big_close(&f);
    return got;
}

static void l2_out_of_memory_in_a_retrieve_in_pieces_keeps_every_copy(void **state)
{
    (void)state;
    ft_oom_each(200, 0, oom_retrieve_pieces_run, NULL);
}

/* copies on the I/O workers hold their chunks' L1 slots until they are
 * done: over an L1 of two slots a retrieve waits for them instead of
 * reporting stored chunks as misses for want of room */
static void l2_retrieve_over_a_tiny_l1_waits_for_its_copies(void **state)
{
    (void)state;
    bigfix f;
    big_open_pieces(&f, 40, 8, 16384);
    ferry_kv_close(f.kv);
    ferry_kv_config c = small_config(2);
    c.l2_dir = f.dir;
    c.l2_bytes = 4 * BIG * CHUNK;
    c.l2_engine = "posix";
    c.l2_persistent = 0;
    c.watermark = 1.0;
    FT_ASSERT_OK(ferry_kv_open(&c, &f.kv));
    ferry__kv_set_handoff_min(f.kv, 0); /* small chunks' copies on the workers too */
    f.kv->tier[FERRY_KV_TIER_L2]->apiece = 16384;
    assert_int_equal(ferry_kv_store(f.kv, f.a, 8 * CT, NULL, &f.h.b), 8 * CT);
    FT_ASSERT_OK(ferry_kv_flush(f.kv));
    ferry_kv_stats m0 = FERRY_KV_STATS_INIT, m1 = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(f.kv, &m0));
    for (int round = 0; round < 20; round++) {
        memset(f.d.mem, 0xEE, PLANES * 2 * BIG * CT * TB);
        assert_int_equal(ferry_kv_retrieve(f.kv, f.a, 8 * CT, NULL, &f.d.b), 8 * CT);
        assert_true(same_tokens(&f.h, &f.d, 0, 8 * CT));
    }
    /* waiting for a copy is not an L1 failure */
    FT_ASSERT_OK(ferry_kv_stats_get(f.kv, &m1));
    assert_int_equal(m1.tier[FERRY_KV_TIER_L1].failures, m0.tier[FERRY_KV_TIER_L1].failures);
    big_close(&f);
}

/* the syscall seam: a pread at one file offset fails with EIO */
static _Atomic long long g_eio_off = -1;
static _Atomic int g_eio_hits;

static ssize_t eio_pread(int fd, void *buf, size_t n, off_t off)
{
    if ((long long)off == atomic_load(&g_eio_off)) {
        atomic_fetch_add(&g_eio_hits, 1);
        errno = EIO;
        return -1;
    }
    return ferry__sys_default()->pread(fd, buf, n, off);
}

/* from now on a pread at file offset off fails with EIO (the seam) */
static void eio_arm(uint64_t off)
{
    static ferry__sys sys;
    sys = *ferry__sys_default();
    sys.pread = eio_pread;
    atomic_store(&g_eio_off, (long long)off);
    atomic_store(&g_eio_hits, 0);
    ferry__sys_set(&sys);
}

/* the seam off again: how many preads it failed */
static int eio_disarm(void)
{
    ferry__sys_set(NULL);
    atomic_store(&g_eio_off, -1);
    return atomic_load(&g_eio_hits);
}

/* the disk fails the read of chunk 5 (its third piece when read in
 * pieces) while 4 and 6.. are in flight */
static void read_error_in_the_middle_of_a_batch(uint64_t piece)
{
    bigfix f;
    big_open_pieces(&f, 40, 12, piece);
    ferry_kv_stats m0 = FERRY_KV_STATS_INIT, m = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(f.kv, &m0));
    eio_arm(l2_loc_of(f.kv, f.a, 12 * CT, 5) + 2 * piece);
    int st[12];
    ferry_kv_req r = FERRY_KV_REQ_INIT;
    r.status = st;
    r.max_chunks = 12;
    int got = ferry_kv_retrieve(f.kv, f.a, 12 * CT, &r, &f.d.b);
    assert_int_equal(eio_disarm(), 1);
    assert_int_equal(got, 5 * CT); /* the leading chunks before the miss */
    for (int i = 0; i < 12; i++) {
        if (i == 5) {
            assert_int_equal(st[i], FERRY_ENOTFOUND);
            continue;
        }
        assert_int_equal(st[i], 0);
        assert_true(same_tokens(&f.h, &f.d, (uint64_t)i * CT, (uint64_t)(i + 1) * CT));
    }
    for (unsigned p = 0; p < PLANES; p++)
        for (uint64_t t = 5 * CT; t < 6 * CT; t++)
            assert_int_equal(tok_at(&f.d, p, t)[0], 0xEE); /* never stale bytes */
    FT_ASSERT_OK(ferry_kv_stats_get(f.kv, &m));
    assert_int_equal(m.tier[FERRY_KV_TIER_L2].failures, 1);
    assert_int_equal(m.tier[FERRY_KV_TIER_L2].hits - m0.tier[FERRY_KV_TIER_L2].hits, 11);
    assert_int_equal(m.misses - m0.misses, 1);
    FT_ASSERT_OK(ferry__kv_check(f.kv));
    /* the unreadable chunk left the index, the others are in L1 now */
    uint8_t tiers[12];
    ferry_kv_req lr = FERRY_KV_REQ_INIT;
    lr.tiers = tiers;
    lr.max_chunks = 12;
    assert_int_equal(ferry_kv_lookup(f.kv, f.a, 12 * CT, &lr), 5 * CT);
    for (int i = 0; i < 5; i++)
        assert_int_equal(tiers[i], FERRY_KV_TIER_L1);
    /* and the store keeps serving: stored again, read back whole */
    assert_int_equal(ferry_kv_store(f.kv, f.a, 12 * CT, NULL, &f.h.b), 12 * CT);
    FT_ASSERT_OK(ferry_kv_flush(f.kv));
    assert_int_equal(ferry_kv_retrieve(f.kv, f.a, 12 * CT, NULL, &f.d.b), 12 * CT);
    assert_true(same_tokens(&f.h, &f.d, 0, 12 * CT));
    big_close(&f);
}

static void l2_read_error_in_the_middle_of_a_batch(void **state)
{
    (void)state;
    read_error_in_the_middle_of_a_batch(0);
}

static void l2_read_error_in_a_piece_fails_only_its_chunk(void **state)
{
    (void)state;
    read_error_in_the_middle_of_a_batch(16384);
}

/* a prefetch reads its chunks from L2 as one stream on one worker
 * (store_aprefetch.c): the disk failing chunk 5 (its third piece when
 * read in pieces) drops only that chunk; the others land in L1,
 * byte-exact, and a retrieve takes them from there */
static void prefetch_read_error(uint64_t piece)
{
    bigfix f;
    big_open_pieces(&f, 40, 12, piece);
    f.kv->prefetch_max = 40 * f.kv->slot_bytes;
    ferry_kv_stats m0 = FERRY_KV_STATS_INIT, m = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(f.kv, &m0));
    eio_arm(l2_loc_of(f.kv, f.a, 12 * CT, 5) + 2 * piece);
    assert_int_equal(ferry_kv_prefetch(f.kv, f.a, 12 * CT, NULL), 12 * CT);
    FT_ASSERT_OK(ferry_kv_flush(f.kv));
    assert_int_equal(eio_disarm(), 1);
    FT_ASSERT_OK(ferry_kv_stats_get(f.kv, &m));
    assert_int_equal(m.tier[FERRY_KV_TIER_L2].failures - m0.tier[FERRY_KV_TIER_L2].failures, 1);
    assert_int_equal(m.prefetched_chunks - m0.prefetched_chunks, 11);
    FT_ASSERT_OK(ferry__kv_check(f.kv));
    uint8_t tiers[12];
    ferry_kv_req lr = FERRY_KV_REQ_INIT;
    lr.tiers = tiers;
    lr.max_chunks = 12;
    assert_int_equal(ferry_kv_lookup(f.kv, f.a, 12 * CT, &lr), 5 * CT);
    for (int i = 0; i < 5; i++)
        assert_int_equal(tiers[i], FERRY_KV_TIER_L1);
    int st[12];
    ferry_kv_req r = FERRY_KV_REQ_INIT;
    r.status = st;
    r.max_chunks = 12;
    assert_int_equal(ferry_kv_retrieve(f.kv, f.a, 12 * CT, &r, &f.d.b), 5 * CT);
    for (int i = 0; i < 12; i++) {
        assert_int_equal(st[i], i == 5 ? FERRY_ENOTFOUND : 0);
        if (i != 5)
            assert_true(same_tokens(&f.h, &f.d, (uint64_t)i * CT, (uint64_t)(i + 1) * CT));
    }
    FT_ASSERT_OK(ferry_kv_stats_get(f.kv, &m0));
    assert_int_equal(m0.tier[FERRY_KV_TIER_L2].hits, m.tier[FERRY_KV_TIER_L2].hits);
    big_close(&f);
}

static void l2_prefetch_read_error_drops_only_its_chunk(void **state)
{
    (void)state;
    prefetch_read_error(0);
}

static void l2_prefetch_read_error_in_a_piece_drops_only_its_chunk(void **state)
{
    (void)state;
    prefetch_read_error(16384);
}

/* a prefetch stream sends the reads that replace the ones that landed
 * before it checks the chunks they completed (store_aprefetch.c): a drive
 * that completes its whole queue at once otherwise idles for every check.
 * Chunks of 64 KiB in pieces of 16 KiB, 16 pieces in flight: each check
 * made while pieces remain to be sent finds all 16 in flight (before, the
 * check came first: the landed chunk's reads not yet replaced), and every
 * chunk lands byte-exact */
static atomic_int g_checks, g_early, g_short;
static void on_check(ferry_kv *kv, unsigned inflight, unsigned depth, int more)
{
    (void)kv;
    atomic_fetch_add(&g_checks, 1);
    if (more) {
        atomic_fetch_add(&g_early, 1);
        if (inflight < depth)
            atomic_fetch_add(&g_short, 1);
    }
}

static void l2_prefetch_sends_the_next_reads_before_it_checks(void **state)
{
    (void)state;
    bigfix f;
    big_open_pieces(&f, 40, 12, 16384);
    f.kv->prefetch_max = 40 * f.kv->slot_bytes;
    assert_int_equal(f.kv->slot_bytes, 4 * 16384);
    atomic_store(&g_checks, 0);
    atomic_store(&g_early, 0);
    atomic_store(&g_short, 0);
    ferry__kv_aprefetch_on_check = on_check;
    assert_int_equal(ferry_kv_prefetch(f.kv, f.a, 12 * CT, NULL), 12 * CT);
    FT_ASSERT_OK(ferry_kv_flush(f.kv));
    ferry__kv_aprefetch_on_check = NULL;
    assert_int_equal(atomic_load(&g_checks), 12);
    assert_true(atomic_load(&g_early) > 0); /* (the first 8 of them, at least) */
    assert_int_equal(atomic_load(&g_short), 0);
    memset(f.d.mem, 0xEE, PLANES * 2 * 12 * CT * TB);
    assert_int_equal(ferry_kv_retrieve(f.kv, f.a, 12 * CT, NULL, &f.d.b), 12 * CT);
    assert_true(same_tokens(&f.h, &f.d, 0, 12 * CT));
    big_close(&f);
}

/* the tier's read queue breaks under a prefetch's stream: no copy is
 * dropped for it (every chunk is still found), the slots a read may still
 * land in are never handed out again, and a retrieve (now synchronous)
 * gets every chunk byte-exact */
static void l2_prefetch_with_the_queue_breaking_keeps_every_copy(void **state)
{
    (void)state;
    bigfix f;
    big_open_pieces(&f, 40, BIG, 16384);
    f.kv->prefetch_max = 40 * f.kv->slot_bytes;
    ferry__kv_tier_l2_break_after(f.kv->tier[FERRY_KV_TIER_L2], 1, -EIO);
    assert_true(ferry_kv_prefetch(f.kv, f.a, BIG * CT, NULL) > 0);
    FT_ASSERT_OK(ferry_kv_flush(f.kv));
    FT_ASSERT_OK(ferry__kv_check(f.kv));
    pthread_mutex_lock(&f.kv->mu);
    uint64_t retired = f.kv->l1_retired;
    pthread_mutex_unlock(&f.kv->mu);
    assert_true(retired > 0); /* it broke with reads in flight */
    assert_int_equal(ferry_kv_lookup(f.kv, f.a, BIG * CT, NULL), BIG * CT);
    memset(f.d.mem, 0xEE, PLANES * 2 * BIG * CT * TB);
    assert_int_equal(ferry_kv_retrieve(f.kv, f.a, BIG * CT, NULL, &f.d.b), BIG * CT);
    assert_true(same_tokens(&f.h, &f.d, 0, BIG * CT));
    big_close(&f);
}

/* the tier's read queue breaks with reads in flight (an engine failure,
 * through the tier's seam): those chunks are misses here, their L1 slots
 * are never handed out again (the reads may still land in them), their L2
 * copies stay, and the rest of the prompt is read synchronously */
static void queue_breaking_mid_batch(uint64_t piece)
{
    bigfix f;
    big_open_pieces(&f, 40, BIG, piece);
    ferry__kv_tier_l2_break_after(f.kv->tier[FERRY_KV_TIER_L2], 1, -EIO);
    int st[BIG];
    ferry_kv_req r = FERRY_KV_REQ_INIT;
    r.status = st;
    r.max_chunks = BIG;
    int got = ferry_kv_retrieve(f.kv, f.a, BIG * CT, &r, &f.d.b);
    int loaded = 0, missed = 0;
    for (int i = 0; i < BIG; i++) {
        uint64_t t0 = (uint64_t)i * CT;
        if (st[i] == 0) {
            loaded++;
            assert_true(same_tokens(&f.h, &f.d, t0, t0 + CT));
        } else {
            missed++;
            assert_int_equal(st[i], FERRY_ENOTFOUND);
            for (unsigned p = 0; p < PLANES; p++)
                for (uint64_t t = t0; t < t0 + CT; t++)
                    assert_int_equal(tok_at(&f.d, p, t)[0], 0xEE);
        }
    }
    assert_true(missed > 0 && missed <= 8); /* at most one batch in flight */
    assert_true(loaded >= BIG - 8);
    assert_true(got < BIG * CT);
    FT_ASSERT_OK(ferry_kv_flush(f.kv));
    /* nothing was dropped: every chunk is still found, and a second
     * retrieve gets all of them, byte-exact, with the queue broken */
    assert_int_equal(ferry_kv_lookup(f.kv, f.a, BIG * CT, NULL), BIG * CT);
    memset(f.d.mem, 0xEE, PLANES * 2 * BIG * CT * TB);
    assert_int_equal(ferry_kv_retrieve(f.kv, f.a, BIG * CT, NULL, &f.d.b), BIG * CT);
    assert_true(same_tokens(&f.h, &f.d, 0, BIG * CT));
    big_close(&f);
}

static void l2_queue_breaking_mid_batch_retires_the_slots_in_flight(void **state)
{
    (void)state;
    queue_breaking_mid_batch(0);
}

static void l2_queue_breaking_mid_chunk_retires_the_slots_in_flight(void **state)
{
    (void)state;
    queue_breaking_mid_batch(16384); /* the queue breaks after one piece landed */
}

static void l2_refused_reads_in_a_batch_are_misses(void **state)
{
    (void)state;
    bigfix f;
    big_open(&f, 40, 12);
    /* the 3rd and every later read refused before it reaches the disk
     * (the tier's fault seam): two chunks load, the rest are misses */
    ferry__kv_set_tier_fault(f.kv, FERRY_KV_TIER_L2, 0, 3, -EIO, 1);
    int st[12];
    ferry_kv_req r = FERRY_KV_REQ_INIT;
    r.status = st;
    r.max_chunks = 12;
    assert_int_equal(ferry_kv_retrieve(f.kv, f.a, 12 * CT, &r, &f.d.b), 2 * CT);
    ferry__kv_set_tier_fault(f.kv, FERRY_KV_TIER_L2, 0, 0, 0, 0);
    assert_int_equal(st[0], 0);
    assert_int_equal(st[1], 0);
    assert_true(same_tokens(&f.h, &f.d, 0, 2 * CT));
    for (int i = 2; i < 12; i++)
        assert_int_equal(st[i], FERRY_ENOTFOUND);
    for (unsigned p = 0; p < PLANES; p++)
        for (uint64_t t = 2 * CT; t < 12 * CT; t++)
            assert_int_equal(tok_at(&f.d, p, t)[0], 0xEE);
    ferry_kv_stats m = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(f.kv, &m));
    assert_int_equal(m.tier[FERRY_KV_TIER_L2].failures, 10);
    assert_int_equal(ferry_kv_lookup(f.kv, f.a, 12 * CT, NULL), 2 * CT);
    big_close(&f);
}

static void l2_retrieve_into_an_unaligned_buffer(void **state)
{
    (void)state;
    bigfix f;
    big_open(&f, 40, 12);
    /* the engine's tensor one byte past an aligned address */
    unsigned char *raw = malloc(PLANES * 12 * CT * TB + 1);
    assert_non_null(raw);
    hbuf u = {f.d.b, raw + 1, 12 * CT};
    u.b.base = (uint64_t)(uintptr_t)u.mem;
    u.b.capacity_tokens = 12 * CT;
    assert_int_equal(ferry_kv_retrieve(f.kv, f.a, 12 * CT, NULL, &u.b), 12 * CT);
    hbuf a = {f.h.b, f.h.mem, f.h.cap};
    for (unsigned p = 0; p < PLANES; p++)
        assert_memory_equal(tok_at(&a, p, 0), tok_at(&u, p, 0), 12 * CT * TB);
    free(raw);
    big_close(&f);
}

static void l2_batch_into_a_device_buffer(void **state)
{
    (void)state;
    /* device copies are queued as chunks land and synchronized every half
     * of L1 (here 8 of 16) while later reads are still in flight */
    ferry_device_options dopt = FERRY_DEVICE_OPTIONS_INIT;
    dopt.backend = "host";
    ferry_device *dev;
    FT_ASSERT_OK(ferry_device_open(&dopt, &dev));
    bigfix f;
    big_open_dev(&f, 16, BIG, dev);
    size_t bytes = PLANES * 2 * BIG * CT * TB;
    ferry_devptr dst;
    FT_ASSERT_OK(ferry_device_alloc(dev, bytes, &dst));
    FT_ASSERT_OK(ferry_device_memset(dev, dst, 0xEE, bytes));
    ferry_kv_buffer b = f.d.b;
    b.mem = FERRY_KV_MEM_DEVICE;
    b.base = dst;
    int st[BIG];
    ferry_kv_req r = FERRY_KV_REQ_INIT;
    r.status = st;
    r.max_chunks = BIG;
    assert_int_equal(ferry_kv_retrieve(f.kv, f.a, BIG * CT, &r, &b), BIG * CT);
    for (int i = 0; i < BIG; i++)
        assert_int_equal(st[i], 0);
    assert_int_equal(atomic_load(&f.kv->tier[FERRY_KV_TIER_L2]->aread_peak), 4);
    FT_ASSERT_OK(ferry_device_download(dev, f.d.mem, dst, bytes));
    assert_true(same_tokens(&f.h, &f.d, 0, BIG * CT));
    FT_ASSERT_OK(ferry_device_free(dev, dst));
    big_close(&f);
    ferry_device_close(dev);
}


/* ---- every byte read from below L1 is verified ---- */

/* n bytes at byte off of chunk k's copy in the L2 slab file, changed
 * behind the store's back (another process writing the file, a torn
 * write, rot): set to x (set), else xor'ed with it */
static void edit_l2_chunk(bigfix *f, size_t k, uint64_t off, size_t n, unsigned char x, int set)
{
    char path[400];
    snprintf(path, sizeof path, "%s/%s", f->dir, FERRY_GDS_SLAB_NAME);
    int fd = open(path, O_RDWR);
    assert_true(fd >= 0);
    unsigned char junk[256];
    assert_true(n <= sizeof junk);
    uint64_t loc = l2_loc_of(f->kv, f->a, BIG * CT, k);
    if (set)
        memset(junk, x, n);
    else
        assert_int_equal(pread(fd, junk, n, (off_t)(loc + off)), (ssize_t)n);
    for (size_t i = 0; !set && i < n; i++)
        junk[i] ^= x;
    assert_int_equal(pwrite(fd, junk, n, (off_t)(loc + off)), (ssize_t)n);
    assert_int_equal(fsync(fd), 0);
    close(fd);
}

/* overwrite 100 bytes in the middle of chunk k's L2 copy */
static void corrupt_l2_chunk(bigfix *f, size_t k)
{
    edit_l2_chunk(f, k, CHUNK / 2, 100, 0x5A, 1);
}

/* a retrieve of the whole prompt after chunk 5 was corrupted: 5 chunks,
 * chunk 5 FERRY_ECORRUPT, every reported chunk byte-exact, counted once,
 * and that copy is gone (the next lookup stops at it) */
static void check_corrupt_chunk_is_a_miss(bigfix *f, const ferry_kv_buffer *b, hbuf *out)
{
    ferry_kv_stats m0 = FERRY_KV_STATS_INIT, m1 = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(f->kv, &m0));
    int st[BIG];
    ferry_kv_req r = FERRY_KV_REQ_INIT;
    r.status = st;
    r.max_chunks = BIG;
    assert_int_equal(ferry_kv_retrieve(f->kv, f->a, BIG * CT, &r, b), 5 * CT);
    for (int i = 0; i < BIG; i++)
        assert_int_equal(st[i], i == 5 ? FERRY_ECORRUPT : 0);
    FT_ASSERT_OK(ferry_kv_flush(f->kv));
    FT_ASSERT_OK(ferry_kv_stats_get(f->kv, &m1));
    assert_int_equal(m1.corrupt_chunks - m0.corrupt_chunks, 1);
    assert_int_equal(m1.tier[FERRY_KV_TIER_L2].failures - m0.tier[FERRY_KV_TIER_L2].failures, 1);
    assert_int_equal(m1.misses - m0.misses, 1);
    assert_int_equal(m1.retrieved_chunks - m0.retrieved_chunks, BIG - 1);
    if (out) {
        assert_true(same_tokens(&f->h, out, 0, 5 * CT));
        assert_true(same_tokens(&f->h, out, 6 * CT, BIG * CT));
        /* the bad chunk's bytes never stay in the engine's buffer */
        for (unsigned p = 0; p < PLANES; p++)
            for (uint64_t t = 5 * CT; t < 6 * CT; t++)
                for (unsigned x = 0; x < TB; x++)
                    assert_int_equal(tok_at(out, p, t)[x], 0);
    }
    ferry_kv_req lr = FERRY_KV_REQ_INIT;
    assert_int_equal(ferry_kv_lookup(f->kv, f->a, BIG * CT, &lr), 5 * CT);
    /* and again: still a miss, never the bad bytes */
    assert_int_equal(ferry_kv_retrieve(f->kv, f->a, BIG * CT, &r, b), 5 * CT);
    assert_int_equal(st[5], FERRY_ENOTFOUND);
}

static void corrupt_chunk_in_a_batch(uint64_t piece)
{
    bigfix f;
    big_open_pieces(&f, 40, BIG, piece);
    corrupt_l2_chunk(&f, 5);
    check_corrupt_chunk_is_a_miss(&f, &f.d.b, &f.d);
    big_close(&f);
}

static void l2_corrupt_chunk_in_a_batch_is_a_miss_never_bytes(void **state)
{
    (void)state;
    corrupt_chunk_in_a_batch(0);
}

static void l2_corrupt_chunk_read_in_pieces_is_a_miss_never_bytes(void **state)
{
    (void)state;
    corrupt_chunk_in_a_batch(16 << 10);
}

/* one retrieve of one chunk (no worker copies): the retrieving thread's
 * own checked copy */
static void l2_corrupt_single_chunk_retrieve_is_a_miss(void **state)
{
    (void)state;
    bigfix f;
    big_open(&f, 40, BIG);
    corrupt_l2_chunk(&f, 0);
    int st[1];
    ferry_kv_req r = FERRY_KV_REQ_INIT;
    r.status = st;
    r.max_chunks = 1;
    assert_int_equal(ferry_kv_retrieve(f.kv, f.a, CT, &r, &f.d.b), 0);
    assert_int_equal(st[0], FERRY_ECORRUPT);
    ferry_kv_stats m = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(f.kv, &m));
    assert_int_equal(m.corrupt_chunks, 1);
    /* its L1 slot was never published: nothing finds the chunk anywhere */
    uint8_t tiers[1];
    ferry_kv_req lr = FERRY_KV_REQ_INIT;
    lr.tiers = tiers;
    lr.max_chunks = 1;
    assert_int_equal(ferry_kv_lookup(f.kv, f.a, CT, &lr), 0);
    big_close(&f);
}

/* a device destination: the slot is checked before it is promoted or copied */
/* check_corrupt_chunk_is_a_miss (chunk 5 damaged) into a buffer on dev;
 * the chunks before it (and with after: those after it too) exact */
static void check_corrupt_chunk_on_device(bigfix *f, ferry_device *dev, int after)
{
    size_t bytes = PLANES * 2 * BIG * CT * TB;
    ferry_devptr dst;
    FT_ASSERT_OK(ferry_device_alloc(dev, bytes, &dst));
    ferry_kv_buffer b = f->d.b;
    b.mem = FERRY_KV_MEM_DEVICE;
    b.base = dst;
    check_corrupt_chunk_is_a_miss(f, &b, NULL);
    FT_ASSERT_OK(ferry_device_download(dev, f->d.mem, dst, bytes));
    assert_true(same_tokens(&f->h, &f->d, 0, 5 * CT));
    if (after)
        assert_true(same_tokens(&f->h, &f->d, 6 * CT, BIG * CT));
    FT_ASSERT_OK(ferry_device_free(dev, dst));
}

static void l2_corrupt_chunk_into_a_device_buffer_is_a_miss(void **state)
{
    (void)state;
    ferry_device_options dopt = FERRY_DEVICE_OPTIONS_INIT;
    dopt.backend = "host";
    ferry_device *dev;
    FT_ASSERT_OK(ferry_device_open(&dopt, &dev));
    bigfix f;
    big_open_dev(&f, 16, BIG, dev);
    corrupt_l2_chunk(&f, 5);
    check_corrupt_chunk_on_device(&f, dev, 0);
    big_close(&f);
    ferry_device_close(dev);
}

/* ---- pieces checked (and copied out) as they land ---- */

/* chunks of 64 KiB (tokens of 1 KiB) read in 16 KiB requests (read 0:
 * whole) and checked in pieces of cp bytes; the check piece is a seam read
 * when the tier opens */
static void big_open_checked(bigfix *f, size_t na, uint64_t read, uint64_t cp)
{
    ferry__kv_l2_check_piece = cp;
    big_open_pieces(f, 40, na, 16384);
    f->kv->tier[FERRY_KV_TIER_L2]->apiece = read;
    ferry__kv_l2_check_piece = 2u << 20;
    /* these small chunks' checks and copies on the workers too (odd
     * pieces), else on the retrieving thread */
    if ((cp / 1000) % 2)
        ferry__kv_set_handoff_min(f->kv, 0);
}

/* xor n bytes at byte off of chunk k's L2 copy with x */
static void damage_l2_chunk(bigfix *f, size_t k, uint64_t off, size_t n, unsigned char x)
{
    edit_l2_chunk(f, k, off, n, x, 0);
}

/* the whole of prompt a retrieved from f: every chunk status 0, byte-exact */
static void big_retrieve_exact(bigfix *f)
{
    int st[BIG];
    ferry_kv_req r = FERRY_KV_REQ_INIT;
    r.status = st;
    r.max_chunks = BIG;
    assert_int_equal(ferry_kv_retrieve(f->kv, f->a, BIG * CT, &r, &f->d.b), BIG * CT);
    for (int i = 0; i < BIG; i++)
        assert_int_equal(st[i], 0);
    assert_true(same_tokens(&f->h, &f->d, 0, BIG * CT));
}

/* every chunk comes back byte-exact, checked piece by piece, for check
 * pieces that split tokens (6000 bytes), hold several (8 and 24 KiB,
 * smaller and larger than a read request), and one request's worth */
static void l2_pieces_checked_as_they_land_are_exact(void **state)
{
    (void)state;
    const uint64_t cps[] = {6000, 8192, 9000, 16384, 24576, 25000};
    const uint64_t reads[] = {16384, 0};
    for (size_t a = 0; a < FERRY__ARRAY_LEN(cps); a++)
        for (size_t b = 0; b < FERRY__ARRAY_LEN(reads); b++) {
            bigfix f;
            big_open_checked(&f, BIG, reads[b], cps[a]);
            assert_int_equal(f.kv->tier[FERRY_KV_TIER_L2]->aops->vpiece(
                                 f.kv->tier[FERRY_KV_TIER_L2], 0),
                             cps[a]);
            ferry_kv_stats m0 = FERRY_KV_STATS_INIT, m = FERRY_KV_STATS_INIT;
            FT_ASSERT_OK(ferry_kv_stats_get(f.kv, &m0));
            big_retrieve_exact(&f);
            FT_ASSERT_OK(ferry_kv_stats_get(f.kv, &m));
            assert_int_equal(m.corrupt_chunks, 0);
            assert_int_equal(m.tier[FERRY_KV_TIER_L2].hits - m0.tier[FERRY_KV_TIER_L2].hits, BIG);
            big_close(&f);
        }
}

/* one bad piece (at `off` of chunk 5, n bytes): that chunk is a miss whose
 * tokens are zeroed (its good pieces were copied out before the bad one
 * was seen), every other chunk exact */
static void bad_piece_is_a_miss(uint64_t read, uint64_t cp, uint64_t off, size_t n)
{
    bigfix f;
    big_open_checked(&f, BIG, read, cp);
    damage_l2_chunk(&f, 5, off, n, 0x01);
    check_corrupt_chunk_is_a_miss(&f, &f.d.b, &f.d);
    big_close(&f);
}

static void l2_one_bad_piece_is_a_miss_never_bytes(void **state)
{
    (void)state;
    bad_piece_is_a_miss(16384, 8192, 3 * 8192 + 100, 1); /* inside piece 3 */
    bad_piece_is_a_miss(16384, 9000, 3 * 9000 + 100, 1); /* (on the workers) */
    bad_piece_is_a_miss(16384, 9000, 7 * 9000 + 10, 2);  /* the last piece, short */
    bad_piece_is_a_miss(16384, 8192, 7 * 8192 + 10, 1);  /* the last piece */
    bad_piece_is_a_miss(0, 6000, 5 * 6000 + 7, 3);       /* pieces that split tokens */
}

/* FERRY_KV_READ_DEPTH sets the reads kept in flight (1-32, others
 * ignored); at 1, 2 and 32 every chunk is exact and one bad piece (its
 * check on a worker, queued behind the refill) still a zeroed miss */
static void l2_read_depth_from_the_environment_keeps_every_byte(void **state)
{
    (void)state;
    const struct {
        const char *v;
        unsigned want;
    } cases[] = {{"1", 1}, {"2", 2}, {"32", 32}, {"0", 16}, {"33", 16}, {"4x", 16}, {"", 16}};
    for (size_t k = 0; k < FERRY__ARRAY_LEN(cases); k++) {
        assert_int_equal(setenv("FERRY_KV_READ_DEPTH", cases[k].v, 1), 0);
        assert_int_equal(ferry__kv_read_depth(16), cases[k].want);
        if (cases[k].want == 16)
            continue;
        bigfix f;
        big_open_checked(&f, BIG, 16384, 9000);
        big_retrieve_exact(&f);
        big_close(&f);
        bad_piece_is_a_miss(16384, 9000, 3 * 9000 + 100, 1);
        bad_piece_is_a_miss(16384, 8192, 7 * 8192 + 10, 1);
    }
    assert_int_equal(unsetenv("FERRY_KV_READ_DEPTH"), 0);
    assert_int_equal(ferry__kv_read_depth(16), 16);
}

/* a retrieve checks (and copies) the pieces that landed on its own thread
 * while no more than a chunk's bytes of them wait (one memory stream at a
 * time: store_rpiece.c): with one read in flight at a time nothing ever
 * waits beyond it, and no check goes to a worker; with 32 in flight
 * (completing out of order) a backlog may; every byte exact either way,
 * and a bad piece a zeroed miss */
static void l2_checks_stay_on_one_thread_within_a_chunk_of_backlog(void **state)
{
    (void)state;
    const char *depths[] = {"1", "32"};
    for (size_t k = 0; k < FERRY__ARRAY_LEN(depths); k++) {
        assert_int_equal(setenv("FERRY_KV_READ_DEPTH", depths[k], 1), 0);
        bigfix f;
        big_open_checked(&f, BIG, 16384, 16384); /* (a check piece a read, as 2 MiB are) */
        ferry__kv_set_handoff_min(f.kv, 0);
        uint64_t h0 = atomic_load(&f.kv->rt_handed);
        big_retrieve_exact(&f);
        if (k == 0)
            assert_int_equal(atomic_load(&f.kv->rt_handed) - h0, 0);
        big_close(&f);
        bad_piece_is_a_miss(16384, 9000, 3 * 9000 + 100, 1);
    }
    assert_int_equal(unsetenv("FERRY_KV_READ_DEPTH"), 0);
}

/* a piece torn at its edge: its last byte, or the next piece's first */
static void l2_piece_torn_at_its_edge_is_a_miss(void **state)
{
    (void)state;
    bad_piece_is_a_miss(16384, 8192, 4 * 8192 - 1, 1);
    bad_piece_is_a_miss(16384, 8192, 4 * 8192, 1);
    bad_piece_is_a_miss(16384, 6000, 2 * 6000 - 1, 1);
    bad_piece_is_a_miss(16384, 6000, 2 * 6000, 1);
    bad_piece_is_a_miss(16384, 9000, 2 * 9000 - 1, 1);
    bad_piece_is_a_miss(0, 9000, 2 * 9000, 1);
}

/* a cancel in the middle of a retrieve in pieces: each chunk is moved
 * whole (status 0) or untouched (-ECANCELED), never half its pieces */
static void l2_pieces_cancelled_chunks_are_whole_or_untouched(void **state)
{
    (void)state;
    for (int round = 0; round < 12; round++) {
        bigfix f;
        big_open_checked(&f, BIG, 16384, round % 2 ? 9000 : 8192);
        int st[BIG];
        ferry_kv_req r = FERRY_KV_REQ_INIT;
        r.status = st;
        r.max_chunks = BIG;
        ferry_kv_op *op = NULL;
        FT_ASSERT_OK(ferry_kv_retrieve_async(f.kv, f.a, BIG * CT, &r, &f.d.b, &op));
        struct timespec ts = {0, (long)(round * 150000)};
        nanosleep(&ts, NULL);
        int rc = ferry_kv_op_cancel(op);
        ferry_kv_op_free(op);
        assert_true(rc == -ECANCELED || rc == BIG * CT);
        for (int i = 0; i < BIG; i++) {
            assert_true(st[i] == 0 || st[i] == -ECANCELED);
            for (unsigned p = 0; p < PLANES; p++)
                for (uint64_t t = (uint64_t)i * CT; t < (uint64_t)(i + 1) * CT; t++) {
                    if (st[i] == 0) {
                        assert_memory_equal(tok_at(&f.d, p, t), tok_at(&f.h, p, t), TB);
                        continue;
                    }
                    for (unsigned x = 0; x < TB; x++)
                        assert_int_equal(tok_at(&f.d, p, t)[x], 0xEE);
                }
        }
        big_close(&f);
    }
}

/* a device buffer, and a retrieve of one chunk (no worker copies): pieces
 * checked as they land, the chunk copied once whole and checked */
static void l2_pieces_checked_into_a_device_buffer_and_alone(void **state)
{
    (void)state;
    ferry_device_options dopt = FERRY_DEVICE_OPTIONS_INIT;
    dopt.backend = "host";
    ferry_device *dev;
    FT_ASSERT_OK(ferry_device_open(&dopt, &dev));
    ferry__kv_l2_check_piece = 8192;
    bigfix f;
    g_tb = 1024;
    big_open_dev(&f, 16, BIG, dev);
    ferry__kv_l2_check_piece = 2u << 20;
    f.kv->tier[FERRY_KV_TIER_L2]->apiece = 16384;
    damage_l2_chunk(&f, 5, 3 * 8192 + 5, 1, 0x80);
    check_corrupt_chunk_on_device(&f, dev, 1);
    big_close(&f);
    ferry_device_close(dev);
    /* alone: one chunk, the retrieving thread's own checks and copy */
    big_open_checked(&f, BIG, 16384, 8192);
    damage_l2_chunk(&f, 0, 8192 + 1, 1, 0x02);
    int st[2];
    ferry_kv_req r = FERRY_KV_REQ_INIT;
    r.status = st;
    r.max_chunks = 1;
    assert_int_equal(ferry_kv_retrieve(f.kv, f.a, CT, &r, &f.d.b), 0);
    assert_int_equal(st[0], FERRY_ECORRUPT);
    for (unsigned p = 0; p < PLANES; p++)
        for (uint64_t t = 0; t < CT; t++)
            for (unsigned x = 0; x < TB; x++)
                assert_true(tok_at(&f.d, p, t)[x] == 0 || tok_at(&f.d, p, t)[x] == 0xEE);
    r.max_chunks = 2;
    memset(f.d.mem, 0xEE, PLANES * 2 * BIG * CT * TB);
    /* chunk 1 alone in a second prompt's place: exact */
    assert_int_equal(ferry_kv_retrieve(f.kv, f.a, 2 * CT, &r, &f.d.b), 0);
    big_close(&f);
}

/* a prefetch stream checks a chunk with piece sums piece by piece as its
 * reads land (store_aprefetch.c), not in a whole pass once the last one
 * landed: what the stream checks, counted through its seam */
static atomic_uint_fast64_t g_vpieces, g_vwholes, g_vbytes;
static void on_verify(ferry_kv *kv, uint64_t bytes, int whole)
{
    (void)kv;
    atomic_fetch_add(whole ? &g_vwholes : &g_vpieces, 1);
    atomic_fetch_add(&g_vbytes, bytes);
}

/* prefetch the BIG chunks of f (big_open_checked) through the stream,
 * counting its checks: chunk bad (-1: none) is dropped (a corrupt miss,
 * its L2 copy gone), every other lands in L1 and a retrieve takes it from
 * there byte-exact */
static void prefetch_checked(bigfix *f, int bad)
{
    f->kv->prefetch_max = 40 * f->kv->slot_bytes;
    ferry_kv_stats m0 = FERRY_KV_STATS_INIT, m = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(f->kv, &m0));
    atomic_store(&g_vpieces, 0);
    atomic_store(&g_vwholes, 0);
    atomic_store(&g_vbytes, 0);
    ferry__kv_aprefetch_on_verify = on_verify;
    assert_int_equal(ferry_kv_prefetch(f->kv, f->a, BIG * CT, NULL), BIG * CT);
    FT_ASSERT_OK(ferry_kv_flush(f->kv));
    ferry__kv_aprefetch_on_verify = NULL;
    FT_ASSERT_OK(ferry_kv_stats_get(f->kv, &m));
    FT_ASSERT_OK(ferry__kv_check(f->kv));
    assert_int_equal(m.corrupt_chunks - m0.corrupt_chunks, bad >= 0);
    assert_int_equal(m.prefetched_chunks - m0.prefetched_chunks, BIG - (bad >= 0));
    uint8_t tiers[BIG];
    ferry_kv_req lr = FERRY_KV_REQ_INIT;
    lr.tiers = tiers;
    lr.max_chunks = BIG;
    uint64_t upto = bad >= 0 ? (uint64_t)bad : BIG;
    assert_int_equal(ferry_kv_lookup(f->kv, f->a, BIG * CT, &lr), upto * CT);
    for (uint64_t i = 0; i < upto; i++)
        assert_int_equal(tiers[i], FERRY_KV_TIER_L1);
    int st[BIG];
    ferry_kv_req r = FERRY_KV_REQ_INIT;
    r.status = st;
    r.max_chunks = BIG;
    memset(f->d.mem, 0xEE, PLANES * 2 * BIG * CT * TB);
    assert_int_equal(ferry_kv_retrieve(f->kv, f->a, BIG * CT, &r, &f->d.b), upto * CT);
    for (int i = 0; i < BIG; i++) {
        assert_int_equal(st[i], i == bad ? FERRY_ENOTFOUND : 0);
        if (i != bad)
            assert_true(same_tokens(&f->h, &f->d, (uint64_t)i * CT, (uint64_t)(i + 1) * CT));
    }
    FT_ASSERT_OK(ferry_kv_stats_get(f->kv, &m0));
    assert_int_equal(m0.tier[FERRY_KV_TIER_L2].hits, m.tier[FERRY_KV_TIER_L2].hits);
}

/* read in 16 KiB requests (0: whole), checked in pieces of cp bytes: every
 * chunk exact, each byte checked once in pieces, none in a whole pass */
static void l2_prefetch_checks_pieces_as_they_land(void **state)
{
    (void)state;
    const struct {
        uint64_t read, cp;
    } cases[] = {{16384, 8192}, {16384, 9000}, {16384, 16384}, {16384, 25000}, {0, 6000}};
    for (size_t k = 0; k < FERRY__ARRAY_LEN(cases); k++) {
        bigfix f;
        big_open_checked(&f, BIG, cases[k].read, cases[k].cp);
        prefetch_checked(&f, -1);
        uint64_t per = (CHUNK + cases[k].cp - 1) / cases[k].cp;
        assert_int_equal(atomic_load(&g_vwholes), 0);
        assert_int_equal(atomic_load(&g_vpieces), BIG * per);
        assert_int_equal(atomic_load(&g_vbytes), (uint64_t)BIG * CHUNK);
        big_close(&f);
    }
}

/* one bad byte at off of chunk k (read in requests of read bytes, checked
 * in pieces of cp): that chunk is a miss, never published; the others
 * exact, and still no whole pass */
static void prefetch_bad_piece(uint64_t read, uint64_t cp, uint64_t off, int k)
{
    bigfix f;
    big_open_checked(&f, BIG, read, cp);
    damage_l2_chunk(&f, (size_t)k, off, 1, 0x40);
    prefetch_checked(&f, k);
    assert_int_equal(atomic_load(&g_vwholes), 0);
    big_close(&f);
}

static void l2_prefetch_bad_piece_drops_only_its_chunk(void **state)
{
    (void)state;
    prefetch_bad_piece(16384, 8192, 3 * 8192 + 5, 4);   /* a middle piece */
    prefetch_bad_piece(16384, 8192, 4 * 8192 - 1, 1);   /* a piece's last byte */
    prefetch_bad_piece(16384, 8192, 4 * 8192, 1);       /* the next one's first */
    prefetch_bad_piece(16384, 9000, 2 * 9000 - 1, 7);   /* an edge inside a read */
    prefetch_bad_piece(16384, 8192, 7 * 8192 + 10, 2);  /* the last piece */
    prefetch_bad_piece(16384, 9000, 7 * 9000 + 10, 0);  /* the last piece, short */
    prefetch_bad_piece(16384, 8192, CHUNK - 1, BIG - 1); /* the last byte of the last */
    prefetch_bad_piece(0, 6000, 5 * 6000 + 7, 3);       /* one read, pieces split tokens */
}

/* a chunk without piece sums (a check piece over the chunk: an older
 * slab's whole-sum records) is checked whole as its last read lands:
 * every chunk exact, and a bad byte still makes its chunk a miss */
static void l2_prefetch_whole_sum_chunks_are_checked_whole(void **state)
{
    (void)state;
    bigfix f;
    big_open_checked(&f, BIG, 16384, 1u << 20);
    assert_int_equal(f.kv->tier[FERRY_KV_TIER_L2]->aops->vpiece(f.kv->tier[FERRY_KV_TIER_L2], 0),
                     0);
    prefetch_checked(&f, -1);
    assert_int_equal(atomic_load(&g_vpieces), 0);
    assert_int_equal(atomic_load(&g_vwholes), BIG);
    big_close(&f);
    big_open_checked(&f, BIG, 16384, 1u << 20);
    damage_l2_chunk(&f, 6, 5 * 8192 + 3, 1, 0x01);
    prefetch_checked(&f, 6);
    assert_int_equal(atomic_load(&g_vwholes), BIG);
    big_close(&f);
}

/* the synchronous read (a prefetch on the workers) checks too */
static void l2_corrupt_chunk_prefetched_is_dropped(void **state)
{
    (void)state;
    bigfix f;
    big_open(&f, 40, 8);
    corrupt_l2_chunk(&f, 3);
    ferry_kv_stats m0 = FERRY_KV_STATS_INIT, m1 = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(f.kv, &m0));
    assert_true(ferry_kv_prefetch(f.kv, f.a, 8 * CT, NULL) >= 0);
    FT_ASSERT_OK(ferry_kv_flush(f.kv));
    FT_ASSERT_OK(ferry_kv_stats_get(f.kv, &m1));
    assert_int_equal(m1.corrupt_chunks - m0.corrupt_chunks, 1);
    ferry_kv_req lr = FERRY_KV_REQ_INIT;
    assert_int_equal(ferry_kv_lookup(f.kv, f.a, 8 * CT, &lr), 3 * CT);
    assert_int_equal(ferry_kv_retrieve(f.kv, f.a, 8 * CT, NULL, &f.d.b), 3 * CT);
    assert_true(same_tokens(&f.h, &f.d, 0, 3 * CT));
    big_close(&f);
}

/* L2 chunks retrieved into a paged buffer: the check folded into the
 * copy-out walks the blocks in the image's order, so every chunk passes
 * (none counted corrupt) and lands byte-exact */
static void l2_chunks_into_a_paged_buffer_pass_their_check(void **state)
{
    (void)state;
    bigfix f;
    big_open(&f, 40, 8);
    pbuf pg;
    pbuf_init(&pg, 0);
    int st[8];
    ferry_kv_req r = FERRY_KV_REQ_INIT;
    r.status = st;
    r.max_chunks = 8;
    assert_int_equal(ferry_kv_retrieve(f.kv, f.a, 8 * CT, &r, &pg.b), 8 * CT);
    for (int i = 0; i < 8; i++)
        assert_int_equal(st[i], 0);
    hbuf a = {f.h.b, f.h.mem, f.h.cap};
    for (unsigned p = 0; p < PLANES; p++)
        for (uint64_t t = 0; t < 8 * CT; t++)
            assert_memory_equal(ptok(&pg, p, t), tok_at(&a, p, t), TB);
    ferry_kv_stats m = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(f.kv, &m));
    assert_int_equal(m.corrupt_chunks, 0);
    assert_true(m.tier[FERRY_KV_TIER_L2].hits >= 8);
    pbuf_free(&pg);
    big_close(&f);
}

/* the entry of chunk k of tokens (no salt), or NULL; under the store's mutex */
static ferry__kv_entry *entry_of(ferry_kv *kv, const int32_t *tok, size_t n, size_t k)
{
    ferry_kv_hash h[BIG];
    assert_true((size_t)ferry_kv_hash_chunks(kv->seed, tok, n, CT, 0, h, BIG) > k);
    ferry_kv_hash id = {h[k].lo ^ kv->ns0.lo, h[k].hi ^ kv->ns0.hi};
    return ferry__kv_find(kv, id);
}

/* a pinned chunk whose only copy failed its check is dropped with its pin;
 * when the same tokens are stored again, an unpin finds no pin on the new
 * entry and must not take the read lock an operation holds on it */
static void unpin_never_takes_an_operations_lock(void **state)
{
    (void)state;
    bigfix f;
    big_open(&f, 40, 4);
    assert_int_equal(ferry_kv_pin(f.kv, f.a, CT, NULL), CT);
    corrupt_l2_chunk(&f, 0);
    int st[1];
    ferry_kv_req r = FERRY_KV_REQ_INIT;
    r.status = st;
    r.max_chunks = 1;
    assert_int_equal(ferry_kv_retrieve(f.kv, f.a, CT, &r, &f.d.b), 0);
    assert_int_equal(st[0], FERRY_ECORRUPT);
    /* stored again: a new entry, which an operation read-locks */
    assert_int_equal(ferry_kv_store(f.kv, f.a, CT, NULL, &f.h.b), CT);
    FT_ASSERT_OK(ferry_kv_flush(f.kv));
    pthread_mutex_lock(&f.kv->mu);
    ferry__kv_entry *e = entry_of(f.kv, f.a, BIG * CT, 0);
    assert_non_null(e);
    ferry__kv_read_lock(f.kv, e, ferry__kv_now_ns(f.kv));
    uint32_t held = e->readers;
    pthread_mutex_unlock(&f.kv->mu);
    /* the old pin went with the old entry: nothing to unpin */
    assert_int_equal(ferry_kv_unpin(f.kv, f.a, CT, NULL), 0);
    pthread_mutex_lock(&f.kv->mu);
    assert_int_equal(e->readers, held);
    ferry__kv_read_unlock(e);
    pthread_mutex_unlock(&f.kv->mu);
    /* a pin of the new entry is unpinned as before */
    assert_int_equal(ferry_kv_pin(f.kv, f.a, CT, NULL), CT);
    assert_int_equal(ferry_kv_unpin(f.kv, f.a, CT, NULL), CT);
    assert_int_equal(ferry_kv_unpin(f.kv, f.a, CT, NULL), 0);
    big_close(&f);
}

/* a tier that fails every write (a full or dying drive) fails at the rate
 * of the stores: its warnings are the first few, then one a second with a
 * count, not one per chunk */
static _Atomic int g_warns;
static void count_warns(int level, const char *msg, void *ctx)
{
    (void)ctx;
    if (level == FERRY_LOG_WARN && strstr(msg, "kv l2: write of chunk"))
        atomic_fetch_add(&g_warns, 1);
}

static void failing_tier_warnings_are_rate_limited(void **state)
{
    (void)state;
    l2fix f;
    l2_open(&f, 8, 64, 4);
    ferry__kv_set_tier_fault(f.kv, FERRY_KV_TIER_L2, 1, 1, -EIO, 1);
    atomic_store(&g_warns, 0);
    ferry_log_set_callback(count_warns, NULL);
    int32_t tok[8 * CT];
    for (int k = 0; k < 25; k++) {
        make_tokens(tok, 8 * CT, 100000 + k * 1000);
        assert_int_equal(ferry_kv_store(f.kv, tok, 8 * CT, NULL, &f.h.b), 8 * CT);
    }
    FT_ASSERT_OK(ferry_kv_flush(f.kv));
    ferry_log_set_callback(NULL, NULL);
    ferry_kv_stats m = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(f.kv, &m));
    assert_int_equal(m.tier[FERRY_KV_TIER_L2].failures, 200); /* every one counted */
    int w = atomic_load(&g_warns);
    assert_true(w >= 1 && w <= FERRY__WARN_BURST + 2);
    ferry__kv_set_tier_fault(f.kv, FERRY_KV_TIER_L2, 1, 0, 0, 0);
    l2_close(&f);
}

/* one L2 directory has one owner: two stores on it (the ordinary mistake
 * of one cache directory for every TP rank) are refused, not mixed */
static void two_stores_on_one_l2_directory_are_refused(void **state)
{
    (void)state;
    char dir[256];
    ft_tmpdir(dir, sizeof dir);
    ferry_kv_config c = small_config(8);
    c.l2_dir = dir;
    c.l2_bytes = 64 * CHUNK;
    c.l2_engine = "posix";
    c.tp_world = 2;
    c.tp_rank = 0;
    ferry_kv *a = NULL, *b = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &a));
    /* the slab and the lock are the owner's alone */
    char path[400];
    struct stat sb;
    snprintf(path, sizeof path, "%s/%s", dir, FERRY_GDS_SLAB_NAME);
    assert_int_equal(stat(path, &sb), 0);
    assert_int_equal(sb.st_mode & 0777, 0600);
    snprintf(path, sizeof path, "%s/ferry.lock", dir);
    assert_int_equal(stat(path, &sb), 0);
    assert_int_equal(sb.st_mode & 0777, 0600);
    c.tp_rank = 1;
    assert_int_equal(ferry_kv_open(&c, &b), FERRY_EBUSY);
    assert_null(b);
    assert_non_null(strstr(ferry_last_error(), dir));
    char pid[32];
    snprintf(pid, sizeof pid, "%d", (int)getpid());
    assert_non_null(strstr(ferry_last_error(), pid));
    /* a persistent L2 on it is refused as well */
    c.l2_persistent = 1;
    assert_int_equal(ferry_kv_open(&c, &b), FERRY_EBUSY);
    c.l2_persistent = 0;
    /* and another process */
    pid_t ch = fork();
    if (ch == 0) {
        ferry_kv *x = NULL;
        _exit(ferry_kv_open(&c, &x) == FERRY_EBUSY ? 0 : 1);
    }
    int ws = 0;
    assert_int_equal(waitpid(ch, &ws, 0), ch);
    assert_true(WIFEXITED(ws) && WEXITSTATUS(ws) == 0);
    /* rank 0's chunks are still its own */
    hbuf h, d;
    hbuf_init(&h, 4 * CT, 3);
    hbuf_init(&d, 4 * CT, 0);
    int32_t tok[4 * CT];
    make_tokens(tok, 4 * CT, 700);
    assert_int_equal(ferry_kv_store(a, tok, 4 * CT, NULL, &h.b), 4 * CT);
    FT_ASSERT_OK(ferry_kv_flush(a));
    assert_int_equal(ferry_kv_retrieve(a, tok, 4 * CT, NULL, &d.b), 4 * CT);
    assert_true(same_tokens(&h, &d, 0, 4 * CT));
    ferry_kv_close(a);
    /* the directory is free again once its owner closed; a mode given
     * for a deliberate group is what a new directory and slab get */
    FT_ASSERT_OK(ferry_kv_open(&c, &b));
    ferry_kv_close(b);
    char sub[300];
    snprintf(sub, sizeof sub, "%s/group/rank1", dir);
    c.l2_dir = sub;
    c.l2_mode = 0640;
    FT_ASSERT_OK(ferry_kv_open(&c, &b));
    snprintf(path, sizeof path, "%s/%s", sub, FERRY_GDS_SLAB_NAME);
    assert_int_equal(stat(path, &sb), 0);
    assert_int_equal(sb.st_mode & 0777, 0640);
    assert_int_equal(stat(sub, &sb), 0);
    assert_int_equal(sb.st_mode & 0777, 0750);
    ferry_kv_close(b);
    free(h.mem);
    free(d.mem);
    ft_rmtree(dir);
}

/* several threads retrieve the same L2-only prompt at once: every chunk
 * is read from L2 once (a thread finding it on its way waits for it) and
 * every thread gets every byte */
typedef struct rtarg {
    bigfix *f;
    hbuf d;
    int got;
} rtarg;

static void *retrieve_thread(void *p)
{
    rtarg *a = p;
    a->got = ferry_kv_retrieve(a->f->kv, a->f->a, BIG * CT, NULL, &a->d.b);
    return NULL;
}

static void l2_concurrent_retrieves_share_the_reads(void **state)
{
    (void)state;
    bigfix f;
    big_open(&f, 40, BIG);
    enum { NT = 4 };
    rtarg args[NT];
    pthread_t th[NT];
    ferry_kv_stats m0 = FERRY_KV_STATS_INIT, m1 = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(f.kv, &m0));
    for (int i = 0; i < NT; i++) {
        args[i].f = &f;
        hbuf_init(&args[i].d, 2 * BIG * CT, 0);
        assert_int_equal(pthread_create(&th[i], NULL, retrieve_thread, &args[i]), 0);
    }
    for (int i = 0; i < NT; i++)
        pthread_join(th[i], NULL);
    FT_ASSERT_OK(ferry_kv_stats_get(f.kv, &m1));
    for (int i = 0; i < NT; i++) {
        assert_int_equal(args[i].got, BIG * CT);
        assert_true(same_tokens(&f.h, &args[i].d, 0, BIG * CT));
        free(args[i].d.mem);
    }
    assert_int_equal(m1.tier[FERRY_KV_TIER_L2].bytes_read - m0.tier[FERRY_KV_TIER_L2].bytes_read,
                     BIG * CHUNK);
    assert_int_equal(m1.tier[FERRY_KV_TIER_L2].hits - m0.tier[FERRY_KV_TIER_L2].hits, BIG);
    big_close(&f);
}

static void l2_with_the_default_engine_reads_back_into_the_registered_pool(void **state)
{
    (void)state;
    /* the default engine (io_uring where the kernel has it) with the L1
     * pool registered as fixed buffers: write-throughs leave from and
     * reads land in registered slots, byte for byte */
    l2fix f;
    ft_tmpdir(f.dir, sizeof f.dir);
    assert_true(f.dir[0] != 0);
    ferry_kv_config c = small_config(8);
    c.l2_dir = f.dir;
    c.l2_bytes = 64 * CHUNK;
    c.watermark = 1.0;
    c.evict_fraction = 0.25;
    FT_ASSERT_OK(ferry_kv_open(&c, &f.kv));
    hbuf_init(&f.h, 8 * CT, 23);
    hbuf_init(&f.d, 8 * CT, 0);
    int32_t a[4 * CT], b[8 * CT];
    l2_only_prompt(&f, a, b);
    assert_int_equal(ferry_kv_retrieve(f.kv, a, 4 * CT, NULL, &f.d.b), 4 * CT);
    assert_true(same_tokens(&f.h, &f.d, 0, 4 * CT));
    l2_close(&f);
}

static void l2_io_error_makes_a_miss_and_store_keeps_serving(void **state)
{
    (void)state;
    l2fix f;
    l2_open(&f, 4, 64, 4);
    int32_t a[4 * CT], b[CT];
    make_tokens(a, 4 * CT, 1);
    make_tokens(b, CT, 70000);
    assert_int_equal(ferry_kv_store(f.kv, a, 4 * CT, NULL, &f.h.b), 4 * CT);
    FT_ASSERT_OK(ferry_kv_flush(f.kv));
    /* one more chunk pushes a's first (least recently used) chunk out of L1 */
    assert_int_equal(ferry_kv_store(f.kv, b, CT, NULL, &f.h.b), CT);
    FT_ASSERT_OK(ferry_kv_flush(f.kv));
    uint8_t tiers[4];
    ferry_kv_req lr = FERRY_KV_REQ_INIT;
    lr.tiers = tiers;
    lr.max_chunks = 4;
    assert_int_equal(ferry_kv_lookup(f.kv, a, 4 * CT, &lr), 4 * CT);
    assert_int_equal(tiers[0], FERRY_KV_TIER_L2);
    assert_int_equal(tiers[1], FERRY_KV_TIER_L1);
    assert_int_equal(tiers[3], FERRY_KV_TIER_L1);
    /* every L2 read fails: chunk 0 is a miss, the others load */
    ferry__kv_set_tier_fault(f.kv, FERRY_KV_TIER_L2, 0, 1, -EIO, 1);
    memset(f.d.mem, 0xEE, PLANES * 8 * CT * TB);
    int st[4];
    ferry_kv_req r = FERRY_KV_REQ_INIT;
    r.status = st;
    r.max_chunks = 4;
    assert_int_equal(ferry_kv_retrieve(f.kv, a, 4 * CT, &r, &f.d.b), 0);
    assert_int_equal(st[0], FERRY_ENOTFOUND);
    for (int i = 1; i < 4; i++) {
        assert_int_equal(st[i], 0);
        assert_true(same_tokens(&f.h, &f.d, (uint64_t)i * CT, (uint64_t)(i + 1) * CT));
    }
    for (unsigned p = 0; p < PLANES; p++)
        for (uint64_t t = 0; t < CT; t++)
            assert_int_equal(tok_at(&f.d, p, t)[0], 0xEE); /* never stale bytes */
    /* the unreadable chunk left the index; the store keeps serving */
    assert_int_equal(ferry_kv_lookup(f.kv, a, 4 * CT, NULL), 0);
    ferry_kv_stats m = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(f.kv, &m));
    assert_int_equal(m.tier[FERRY_KV_TIER_L2].failures, 1);
    ferry__kv_set_tier_fault(f.kv, FERRY_KV_TIER_L2, 0, 0, 0, 0);
    assert_int_equal(ferry_kv_store(f.kv, a, 4 * CT, NULL, &f.h.b), 4 * CT);
    FT_ASSERT_OK(ferry_kv_flush(f.kv));
    assert_int_equal(ferry_kv_retrieve(f.kv, a, 4 * CT, NULL, &f.d.b), 4 * CT);
    assert_true(same_tokens(&f.h, &f.d, 0, 4 * CT));
    /* a failed write-through leaves the chunk in L1 only, still served */
    ferry__kv_set_tier_fault(f.kv, FERRY_KV_TIER_L2, 1, 1, -EIO, 1);
    int32_t c3[CT];
    make_tokens(c3, CT, 123456);
    assert_int_equal(ferry_kv_store(f.kv, c3, CT, NULL, &f.h.b), CT);
    FT_ASSERT_OK(ferry_kv_flush(f.kv));
    assert_int_equal(ferry_kv_lookup(f.kv, c3, CT, &lr), CT);
    assert_int_equal(tiers[0], FERRY_KV_TIER_L1);
    FT_ASSERT_OK(ferry_kv_stats_get(f.kv, &m));
    assert_int_equal(m.tier[FERRY_KV_TIER_L2].failures, 2);
    ferry__kv_set_tier_fault(f.kv, FERRY_KV_TIER_L2, 1, 0, 0, 0);
    l2_close(&f);
}

static void prompt_longer_than_l1_streams_through_it(void **state)
{
    (void)state;
    l2fix f;
    l2_open(&f, 4, 64, 2);
    size_t n = 12 * CT;
    int32_t tok[12 * CT];
    make_tokens(tok, n, 4242);
    hbuf h, d;
    hbuf_init(&h, n, 77);
    hbuf_init(&d, n, 0);
    assert_int_equal(ferry_kv_store(f.kv, tok, n, NULL, &h.b), (int)n);
    FT_ASSERT_OK(ferry_kv_flush(f.kv));
    assert_int_equal(ferry_kv_lookup(f.kv, tok, n, NULL), (int)n);
    assert_int_equal(ferry_kv_retrieve(f.kv, tok, n, NULL, &d.b), (int)n);
    assert_true(same_tokens(&h, &d, 0, n));
    ferry_kv_stats m = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(f.kv, &m));
    assert_int_equal(m.tier[FERRY_KV_TIER_L2].chunks, 12);
    assert_true(m.tier[FERRY_KV_TIER_L2].hits >= 8);
    free(h.mem);
    free(d.mem);
    l2_close(&f);
}

static void prefetch_brings_l2_chunks_up_within_its_bound(void **state)
{
    (void)state;
    l2fix f;
    l2_open(&f, 8, 64, 2);
    int32_t a[4 * CT], b[8 * CT];
    make_tokens(a, 4 * CT, 1);
    make_tokens(b, 8 * CT, 70000);
    assert_int_equal(ferry_kv_store(f.kv, a, 4 * CT, NULL, &f.h.b), 4 * CT);
    FT_ASSERT_OK(ferry_kv_flush(f.kv));
    assert_int_equal(ferry_kv_store(f.kv, b, 8 * CT, NULL, &f.h.b), 8 * CT);
    FT_ASSERT_OK(ferry_kv_flush(f.kv));
    uint8_t tiers[4];
    ferry_kv_req lr = FERRY_KV_REQ_INIT;
    lr.tiers = tiers;
    lr.max_chunks = 4;
    assert_int_equal(ferry_kv_lookup(f.kv, a, 4 * CT, &lr), 4 * CT);
    for (int i = 0; i < 4; i++)
        assert_int_equal(tiers[i], FERRY_KV_TIER_L2);
    /* at most 2 chunks in flight: the first two are queued */
    assert_int_equal(ferry_kv_prefetch(f.kv, a, 4 * CT, NULL), 2 * CT);
    FT_ASSERT_OK(ferry_kv_flush(f.kv));
    assert_int_equal(ferry_kv_lookup(f.kv, a, 4 * CT, &lr), 4 * CT);
    assert_int_equal(tiers[0], FERRY_KV_TIER_L1);
    assert_int_equal(tiers[1], FERRY_KV_TIER_L1);
    assert_int_equal(tiers[2], FERRY_KV_TIER_L2);
    /* the next call continues where the bound stopped */
    assert_int_equal(ferry_kv_prefetch(f.kv, a, 4 * CT, NULL), 4 * CT);
    FT_ASSERT_OK(ferry_kv_flush(f.kv));
    ferry_kv_stats m = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(f.kv, &m));
    assert_int_equal(m.prefetched_chunks, 4);
    assert_int_equal(ferry_kv_retrieve(f.kv, a, 4 * CT, NULL, &f.d.b), 4 * CT);
    assert_true(same_tokens(&f.h, &f.d, 0, 4 * CT));
    l2_close(&f);
}

static void persistent_l2_survives_a_reopen(void **state)
{
    (void)state;
    char dir[256];
    ft_tmpdir(dir, sizeof dir);
    ferry_kv_config c = small_config(4);
    c.l2_dir = dir;
    c.l2_bytes = 64 * CHUNK;
    c.l2_engine = "posix";
    c.l2_persistent = 1;
    size_t n = 6 * CT;
    int32_t tok[6 * CT];
    make_tokens(tok, n, 2024);
    hbuf h, d;
    hbuf_init(&h, n, 55);
    hbuf_init(&d, n, 0);
    ferry_kv *kv;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    assert_int_equal(ferry_kv_lookup(kv, tok, n, NULL), 0);
    assert_int_equal(ferry_kv_store(kv, tok, n, NULL, &h.b), (int)n);
    FT_ASSERT_OK(ferry_kv_flush(kv));
    ferry_kv_close(kv);
    /* a new store over the same slab finds every chunk, in L2, byte for byte */
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    uint8_t tiers[6];
    ferry_kv_req r = FERRY_KV_REQ_INIT;
    r.tiers = tiers;
    r.max_chunks = 6;
    assert_int_equal(ferry_kv_lookup(kv, tok, n, &r), (int)n);
    for (int i = 0; i < 6; i++)
        assert_int_equal(tiers[i], FERRY_KV_TIER_L2);
    assert_int_equal(ferry_kv_retrieve(kv, tok, n, NULL, &d.b), (int)n);
    assert_true(same_tokens(&h, &d, 0, n));
    ferry_kv_stats m = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(kv, &m));
    assert_int_equal(m.tier[FERRY_KV_TIER_L2].chunks, 6);
    FT_ASSERT_OK(ferry__kv_check(kv));
    ferry_kv_close(kv);
    /* another model over the same slab is refused, naming it, and the
     * slab is left as it was: the first model finds every chunk again */
    c.model = "another-model";
    kv = NULL;
    assert_int_equal(ferry_kv_open(&c, &kv), FERRY_EMISMATCH);
    assert_null(kv);
    assert_non_null(strstr(ferry_last_error(), "another-model"));
    c.model = "test-model";
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    assert_int_equal(ferry_kv_lookup(kv, tok, n, NULL), (int)n);
    ferry_kv_close(kv);
    /* unless a reset is asked for */
    c.model = "another-model";
    c.l2_reset = 1;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    ferry_kv_close(kv);
    c.model = "test-model";
    c.l2_reset = 0;
    assert_int_equal(ferry_kv_open(&c, &kv), FERRY_EMISMATCH);
    ft_rmtree(dir);
    free(h.mem);
    free(d.mem);
}

/* ---- device buffers (host backend) ---- */

static void device_buffers_round_trip_and_copy_faults(void **state)
{
    (void)state;
    ferry_device_options dopt = FERRY_DEVICE_OPTIONS_INIT;
    dopt.backend = "host";
    ferry_device *dev;
    FT_ASSERT_OK(ferry_device_open(&dopt, &dev));
    ferry_kv_config c = small_config(8);
    c.device = dev;
    ferry_kv *kv;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    size_t n = 3 * CT;
    int32_t tok[3 * CT];
    make_tokens(tok, n, 17);
    hbuf h;
    hbuf_init(&h, n, 4);
    ferry_devptr src, dst;
    FT_ASSERT_OK(ferry_device_alloc(dev, PLANES * n * TB, &src));
    FT_ASSERT_OK(ferry_device_alloc(dev, PLANES * n * TB, &dst));
    FT_ASSERT_OK(ferry_device_upload(dev, src, h.mem, PLANES * n * TB));
    FT_ASSERT_OK(ferry_device_memset(dev, dst, 0, PLANES * n * TB));
    ferry_kv_buffer b = h.b;
    b.mem = FERRY_KV_MEM_DEVICE;
    b.base = src;
    assert_int_equal(ferry_kv_store(kv, tok, n, NULL, &b), (int)n);
    b.base = dst;
    assert_int_equal(ferry_kv_retrieve(kv, tok, n, NULL, &b), (int)n);
    hbuf back;
    hbuf_init(&back, n, 0);
    FT_ASSERT_OK(ferry_device_download(dev, back.mem, dst, PLANES * n * TB));
    assert_true(same_tokens(&h, &back, 0, n));

    /* paged device blocks */
    ferry_devptr cache[PLANES];
    uint64_t bases[PLANES];
    int32_t table[3 * CT / BT];
    for (unsigned p = 0; p < PLANES; p++) {
        FT_ASSERT_OK(ferry_device_alloc(dev, NBLK * BT * TB, &cache[p]));
        bases[p] = cache[p];
    }
    for (unsigned k = 0; k < 3 * CT / BT; k++)
        table[k] = (int32_t)((k * 11 + 5) % NBLK);
    ferry_kv_buffer pb = FERRY_KV_BUFFER_INIT;
    pb.layout = small_layout();
    pb.mem = FERRY_KV_MEM_DEVICE;
    pb.form = FERRY_KV_PAGED;
    pb.block_bases = bases;
    pb.block_tokens = BT;
    pb.num_blocks = NBLK;
    pb.block_table = table;
    pb.table_len = 3 * CT / BT;
    assert_int_equal(ferry_kv_retrieve(kv, tok, n, NULL, &pb), (int)n);
    for (unsigned p = 0; p < PLANES; p++) {
        const unsigned char *m = ferry_devptr_host(dev, cache[p]);
        for (uint64_t t = 0; t < n; t++)
            assert_memory_equal(m + ((uint64_t)table[t / BT] * BT + t % BT) * TB,
                                tok_at(&h, p, t), TB);
    }

    /* a failing device copy: the store fails and nothing becomes visible */
    int32_t tok2[3 * CT];
    make_tokens(tok2, n, 5555);
    FT_ASSERT_OK(ft_device_faults(dev, 3, -EIO, 0, FERRY_FAULT_COPY));
    b.base = src;
    int rc = ferry_kv_store(kv, tok2, n, NULL, &b);
    assert_true(rc < 0);
    FT_ASSERT_OK(ft_device_faults(dev, 0, 0, 0, 0));
    assert_int_equal(ferry_kv_lookup(kv, tok2, n, NULL), 0);
    FT_ASSERT_OK(ferry__kv_check(kv));
    /* and it works again once the fault is gone */
    assert_int_equal(ferry_kv_store(kv, tok2, n, NULL, &b), (int)n);
    ferry_kv_close(kv);
    for (unsigned p = 0; p < PLANES; p++)
        ferry_device_free(dev, cache[p]);
    ferry_device_free(dev, src);
    ferry_device_free(dev, dst);
    ferry_device_close(dev);
    free(h.mem);
    free(back.mem);
}

/* ---- async ---- */

static void async_store_and_retrieve(void **state)
{
    (void)state;
    ferry_kv_config c = small_config(16);
    ferry_kv *kv;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    size_t n = 4 * CT;
    int32_t tok[4 * CT];
    make_tokens(tok, n, 44);
    hbuf h, d;
    hbuf_init(&h, n, 12);
    hbuf_init(&d, n, 0);
    ferry_kv_op *op = NULL;
    FT_ASSERT_OK(ferry_kv_store_async(kv, tok, n, NULL, &h.b, &op));
    memset(tok, 0, sizeof tok); /* tokens may be reused at once */
    assert_int_equal(ferry_kv_op_wait(op, -1), (int)n);
    assert_int_equal(ferry_kv_op_test(op), (int)n);
    ferry_kv_op_free(op);
    make_tokens(tok, n, 44);
    int st[4] = {1, 1, 1, 1};
    ferry_kv_req r = FERRY_KV_REQ_INIT;
    r.status = st;
    r.max_chunks = 4;
    FT_ASSERT_OK(ferry_kv_retrieve_async(kv, tok, n, &r, &d.b, &op));
    assert_int_equal(ferry_kv_op_wait(op, -1), (int)n);
    ferry_kv_op_free(op);
    assert_int_equal(st[3], 0);
    assert_true(same_tokens(&h, &d, 0, n));
    /* bad input is reported before anything is queued */
    ferry_kv_buffer bad = h.b;
    bad.layout.head_dim = 8;
    op = NULL;
    assert_int_equal(ferry_kv_store_async(kv, tok, n, NULL, &bad, &op), FERRY_EMISMATCH);
    assert_null(op);
    ferry_kv_op_free(NULL);
    ferry_kv_close(kv);
    free(h.mem);
    free(d.mem);
}

/* ---- metrics ---- */

/* stats_get writes only the size the caller's header knows */
static void stats_get_honours_the_callers_size(void **state)
{
    (void)state;
    ferry_kv_config c = small_config(4);
    ferry_kv *kv;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    int32_t tok[2 * CT];
    make_tokens(tok, 2 * CT, 5);
    hbuf h;
    hbuf_init(&h, 2 * CT, 1);
    assert_int_equal(ferry_kv_store(kv, tok, 2 * CT, NULL, &h.b), 2 * CT);
    unsigned char raw[sizeof(ferry_kv_stats) + 16];
    memset(raw, 0xA5, sizeof raw);
    ferry_kv_stats *old = (ferry_kv_stats *)(void *)raw;
    size_t old_size = offsetof(ferry_kv_stats, corrupt_chunks); /* an older header */
    old->size = old_size;
    FT_ASSERT_OK(ferry_kv_stats_get(kv, old));
    assert_int_equal(old->size, old_size);
    assert_int_equal(old->stores, 1);
    assert_int_equal(old->stored_chunks, 2);
    for (size_t k = old_size; k < sizeof raw; k++)
        assert_int_equal(raw[k], 0xA5); /* nothing past the caller's struct */
    ferry_kv_stats full = FERRY_KV_STATS_INIT;
    full.size = sizeof full;
    FT_ASSERT_OK(ferry_kv_stats_get(kv, &full));
    assert_int_equal(full.corrupt_chunks, 0);
    full.size = 3;
    assert_int_equal(ferry_kv_stats_get(kv, &full), -EINVAL);
    assert_int_equal(ferry_kv_stats_get(kv, NULL), -EINVAL);
    ferry_kv_close(kv);
    free(h.mem);
}

static void metrics_struct_and_prometheus(void **state)
{
    (void)state;
    ferry_kv_config c = small_config(8);
    ferry_kv *kv;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    int32_t tok[2 * CT];
    make_tokens(tok, 2 * CT, 9);
    hbuf h;
    hbuf_init(&h, 2 * CT, 1);
    ferry_kv_lookup(kv, tok, 2 * CT, NULL);
    ferry_kv_store(kv, tok, 2 * CT, NULL, &h.b);
    ferry_kv_lookup(kv, tok, 2 * CT, NULL);
    ferry_kv_lookup(kv, tok, CT, NULL);
    ferry_kv_retrieve(kv, tok, 2 * CT, NULL, &h.b);
    ferry_kv_stats m = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(kv, &m));
    assert_int_equal(m.size, sizeof m);
    assert_int_equal(m.lookups, 3);
    assert_int_equal(m.lookup_tokens, 5 * CT);
    assert_int_equal(m.hit_tokens, 3 * CT);
    assert_int_equal(m.stores, 1);
    assert_int_equal(m.stored_chunks, 2);
    assert_int_equal(m.stored_bytes, 2 * CHUNK);
    assert_int_equal(m.retrieves, 1);
    assert_int_equal(m.retrieved_chunks, 2);
    assert_int_equal(m.chunks, 2);
    assert_int_equal(m.tier[FERRY_KV_TIER_L1].hits, 5); /* 3 by lookups, 2 by the retrieve */
    assert_int_equal(m.tier[FERRY_KV_TIER_L1].used_bytes, 2 * CHUNK);
    assert_int_equal(m.tier[FERRY_KV_TIER_L1].capacity_bytes, 8 * CHUNK);
    assert_true(m.tier[FERRY_KV_TIER_L1].usage > 0.24 && m.tier[FERRY_KV_TIER_L1].usage < 0.26);
    uint64_t cnt = 0;
    for (int b = 0; b < FERRY_KV_HIST_BUCKETS; b++)
        cnt += m.lookup_ns[b];
    assert_int_equal(cnt, 3);
    assert_true(ferry_kv_hist_quantile(m.lookup_ns, 0.5) > 0);
    uint64_t hist[FERRY_KV_HIST_BUCKETS] = {0};
    assert_true(ferry_kv_hist_quantile(hist, 0.5) == 0);
    hist[10] = 100; /* all in [1024, 2048) ns */
    double p50 = ferry_kv_hist_quantile(hist, 0.5);
    assert_true(p50 >= 1024 && p50 <= 2048);

    int need = ferry_kv_metrics_prometheus(kv, NULL, 0);
    assert_true(need > 0);
    char *text = malloc((size_t)need + 1);
    assert_int_equal(ferry_kv_metrics_prometheus(kv, text, (size_t)need + 1), need);
    assert_non_null(strstr(text, "# TYPE ferry_kv_lookups_total counter\nferry_kv_lookups_total 3\n"));
    assert_non_null(strstr(text, "ferry_kv_hit_tokens_total 48\n"));
    assert_non_null(strstr(text, "ferry_kv_tier_hits_total{tier=\"l1\"} 5\n"));
    assert_non_null(strstr(text, "ferry_kv_tier_used_bytes{tier=\"l1\"} 8192\n"));
    assert_non_null(strstr(text, "ferry_kv_lookup_seconds_bucket{le=\"+Inf\"} 3\n"));
    assert_non_null(strstr(text, "ferry_kv_lookup_seconds_count 3\n"));
    assert_null(strstr(text, "tier=\"l2\"")); /* no L2 configured */
    char small[32];
    assert_int_equal(ferry_kv_metrics_prometheus(kv, small, sizeof small), need);
    assert_int_equal(strlen(small), sizeof small - 1);
    free(text);
    ferry_kv_close(kv);
    free(h.mem);
}

/* ---- out of memory at every allocation ---- */

typedef struct oom_store_ctx {
    int32_t tok[3 * CT];
    hbuf h, d;
    int opened;
} oom_store_ctx;

/* open, store, look up and retrieve with allocation n failing */
static int oom_store_run(void *arg)
{
    oom_store_ctx *x = arg;
    ferry_kv_config c = small_config(8);
    ferry_kv *kv = NULL;
    int rc = ferry_kv_open(&c, &kv);
    if (rc < 0) {
        assert_true(rc == -ENOMEM || rc == -EAGAIN);
        assert_null(kv);
        return -ENOMEM; /* -EAGAIN: a worker's start refused for want of memory */
    }
    x->opened++;
    int st[3] = {1, 1, 1};
    ferry_kv_req r = FERRY_KV_REQ_INIT;
    r.status = st;
    r.max_chunks = 3;
    rc = ferry_kv_store(kv, x->tok, 3 * CT, &r, &x->h.b);
    /* whatever failed, what is visible is whole and exact */
    int lead = ferry_kv_lookup(kv, x->tok, 3 * CT, NULL);
    if (rc >= 0)
        assert_int_equal(lead, rc);
    else
        assert_true(rc == -ENOMEM);
    if (lead > 0) {
        memset(x->d.mem, 0, PLANES * 3 * CT * TB);
        int got = ferry_kv_retrieve(kv, x->tok, 3 * CT, NULL, &x->d.b);
        if (got >= 0) {
            assert_true(got >= 0 && got <= lead);
            assert_true(same_tokens(&x->h, &x->d, 0, (uint64_t)got));
        }
    }
    FT_ASSERT_OK(ferry__kv_check(kv));
    if (ft_alloc_failures() == 0)
        assert_int_equal(rc, 3 * CT); /* the clean run stores everything */
    ferry_kv_close(kv);
    return rc;
}

static void out_of_memory_at_every_allocation(void **state)
{
    (void)state;
    oom_store_ctx *x = calloc(1, sizeof *x);
    assert_non_null(x);
    make_tokens(x->tok, 3 * CT, 600);
    hbuf_init(&x->h, 3 * CT, 8);
    hbuf_init(&x->d, 3 * CT, 0);
    ft_oom_each(400, 0, oom_store_run, x);
    assert_true(x->opened > 0);
    hbuf h = x->h, d = x->d;
    free(x);
    free(h.mem);
    free(d.mem);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(hash_chain_matches_the_definition),
        cmocka_unit_test(hash_chain_of_long_chunks_matches_the_definition),
        cmocka_unit_test(hash_prefix_and_partial),
        cmocka_unit_test(key_format_is_stable_and_salted),
        cmocka_unit_test(layout_chunk_bytes),
        cmocka_unit_test(lru_policy_order_and_skips),
        cmocka_unit_test(s3fifo_policy_small_main_and_ghost),
        cmocka_unit_test(open_rejects_bad_configs),
        cmocka_unit_test(store_lookup_retrieve_contiguous),
        cmocka_unit_test(lookup_stops_at_the_first_miss_across_blocks),
        cmocka_unit_test(paged_blocks_round_trip),
        cmocka_unit_test(bad_input_has_clear_codes),
        cmocka_unit_test(salt_and_model_isolate_keys),
        cmocka_unit_test(delete_of_locked_chunk_and_pin_ttl),
        cmocka_unit_test(crashed_writer_is_invisible_then_reclaimed),
        cmocka_unit_test(lru_watermark_evicts_oldest_unlocked),
        cmocka_unit_test(s3fifo_keeps_reused_chunk_through_a_scan),
        cmocka_unit_test(evicted_between_lookup_and_retrieve_is_a_miss),
        cmocka_unit_test(l2_write_through_and_promotion),
        cmocka_unit_test(l2_retrieve_keeps_reads_in_flight_past_the_prefetch_budget),
        cmocka_unit_test(l2_batch_of_many_chunks_lands_byte_exact),
        cmocka_unit_test(l2_read_error_in_the_middle_of_a_batch),
        cmocka_unit_test(l2_chunks_read_in_pieces_land_byte_exact),
        cmocka_unit_test(l2_read_error_in_a_piece_fails_only_its_chunk),
        cmocka_unit_test(l2_queue_breaking_mid_chunk_retires_the_slots_in_flight),
        cmocka_unit_test(l2_prefetch_read_error_drops_only_its_chunk),
        cmocka_unit_test(l2_prefetch_read_error_in_a_piece_drops_only_its_chunk),
        cmocka_unit_test(l2_prefetch_with_the_queue_breaking_keeps_every_copy),
        cmocka_unit_test(l2_prefetch_sends_the_next_reads_before_it_checks),
        cmocka_unit_test(l2_prefetch_checks_pieces_as_they_land),
        cmocka_unit_test(l2_prefetch_bad_piece_drops_only_its_chunk),
        cmocka_unit_test(l2_prefetch_whole_sum_chunks_are_checked_whole),
        cmocka_unit_test(l2_out_of_memory_in_a_retrieve_in_pieces_keeps_every_copy),
        cmocka_unit_test(l2_retrieve_over_a_tiny_l1_waits_for_its_copies),
        cmocka_unit_test(l2_refused_reads_in_a_batch_are_misses),
        cmocka_unit_test(l2_queue_breaking_mid_batch_retires_the_slots_in_flight),
        cmocka_unit_test(l2_retrieve_into_an_unaligned_buffer),
        cmocka_unit_test(l2_batch_into_a_device_buffer),
        cmocka_unit_test(l2_corrupt_chunk_in_a_batch_is_a_miss_never_bytes),
        cmocka_unit_test(l2_corrupt_chunk_read_in_pieces_is_a_miss_never_bytes),
        cmocka_unit_test(l2_corrupt_single_chunk_retrieve_is_a_miss),
        cmocka_unit_test(l2_corrupt_chunk_into_a_device_buffer_is_a_miss),
        cmocka_unit_test(l2_pieces_checked_as_they_land_are_exact),
        cmocka_unit_test(l2_one_bad_piece_is_a_miss_never_bytes),
        cmocka_unit_test(l2_piece_torn_at_its_edge_is_a_miss),
        cmocka_unit_test(l2_read_depth_from_the_environment_keeps_every_byte),
        cmocka_unit_test(l2_checks_stay_on_one_thread_within_a_chunk_of_backlog),
        cmocka_unit_test(l2_pieces_checked_into_a_device_buffer_and_alone),
        cmocka_unit_test(l2_pieces_cancelled_chunks_are_whole_or_untouched),
        cmocka_unit_test(l2_corrupt_chunk_prefetched_is_dropped),
        cmocka_unit_test(two_stores_on_one_l2_directory_are_refused),
        cmocka_unit_test(failing_tier_warnings_are_rate_limited),
        cmocka_unit_test(l2_chunks_into_a_paged_buffer_pass_their_check),
        cmocka_unit_test(unpin_never_takes_an_operations_lock),
        cmocka_unit_test(l2_concurrent_retrieves_share_the_reads),
        cmocka_unit_test(l2_with_the_default_engine_reads_back_into_the_registered_pool),
        cmocka_unit_test(l2_io_error_makes_a_miss_and_store_keeps_serving),
        cmocka_unit_test(prompt_longer_than_l1_streams_through_it),
        cmocka_unit_test(prefetch_brings_l2_chunks_up_within_its_bound),
        cmocka_unit_test(persistent_l2_survives_a_reopen),
        cmocka_unit_test(device_buffers_round_trip_and_copy_faults),
        cmocka_unit_test(async_store_and_retrieve),
        cmocka_unit_test(metrics_struct_and_prometheus),
        cmocka_unit_test(stats_get_honours_the_callers_size),
        cmocka_unit_test(out_of_memory_at_every_allocation),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
