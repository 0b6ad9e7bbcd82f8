/*
 * test_kv_skip.c - a retrieve's skip_tokens: the leading tokens the engine
 * already holds (blocks it shares with other requests) are never written,
 * whichever tier the chunks come from (L1, checked L2 reads) and whether
 * the request is async; a chunk that straddles the skip point is copied
 * from that token on; an older, shorter request means "skip nothing".
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "ferry/kv.h"
#include "ferry_test.h"
#include "kv/kv_impl.h"

#define CT 16u
#define TB 64u
#define NCH 10u
#define NTOK (NCH * CT)
#define SENT 0x5A

static ferry_kv *open_store(const char *dir, uint64_t l1_chunks)
{
    ferry_kv_config c = FERRY_KV_CONFIG_INIT;
    c.model = "skip";
    c.layout = ft_kv_layout(TB);
    c.chunk_tokens = CT;
    uint64_t cb = 0;
    FT_ASSERT_OK(ferry_kv_layout_chunk_bytes(&c.layout, CT, &cb));
    c.l1_bytes = l1_chunks * cb;
    if (dir) {
        c.l2_dir = dir;
        c.l2_bytes = 4 * NCH * cb + (1u << 20);
        c.l2_direct = 0;
    }
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    return kv;
}

static ferry_kv_buffer buffer(void *base)
{
    ferry_kv_buffer b = FERRY_KV_BUFFER_INIT;
    b.layout = ft_kv_layout(TB);
    b.base = (uintptr_t)base;
    b.capacity_tokens = NTOK;
    return b;
}

#define PLANES 4u /* 2 layers x K and V */

/* tokens below skip still hold the sentinel, tokens from skip on are src's */
static void check_split(const unsigned char *dst, const unsigned char *src, uint64_t skip)
{
    for (unsigned p = 0; p < PLANES; p++)
        for (uint64_t t = 0; t < NTOK; t++) {
            const unsigned char *d = dst + ((size_t)p * NTOK + t) * TB;
            if (t < skip) {
                for (unsigned k = 0; k < TB; k++)
                    if (d[k] != SENT)
                        fail_msg("plane %u token %llu below skip %llu was written", p,
                                 (unsigned long long)t, (unsigned long long)skip);
            } else if (memcmp(d, src + ((size_t)p * NTOK + t) * TB, TB) != 0) {
                fail_msg("plane %u token %llu past skip %llu is wrong", p, (unsigned long long)t,
                         (unsigned long long)skip);
            }
        }
}

static void run_skips(ferry_kv *kv, const int32_t *tok, const unsigned char *src)
{
    static const uint64_t skips[] = {0, 1, 15, 16, 40, 159, 160};
    size_t bytes = (size_t)PLANES * NTOK * TB;
    unsigned char *dst = malloc(bytes);
    assert_non_null(dst);
    for (size_t s = 0; s < sizeof skips / sizeof skips[0]; s++) {
        for (int async = 0; async < 2; async++) {
            memset(dst, SENT, bytes);
            ferry_kv_buffer db = buffer(dst);
            ferry_kv_req rq = FERRY_KV_REQ_INIT;
            int st[NCH];
            rq.status = st;
            rq.max_chunks = NCH;
            rq.skip_tokens = skips[s];
            int got;
            if (async) {
                ferry_kv_op *op = NULL;
                FT_ASSERT_OK(ferry_kv_retrieve_async(kv, tok, NTOK, &rq, &db, &op));
                got = ferry_kv_op_wait(op, -1);
                ferry_kv_op_free(op);
            } else {
                got = ferry_kv_retrieve(kv, tok, NTOK, &rq, &db);
            }
            assert_int_equal(got, NTOK); /* the skipped chunks count: they are cached */
            check_split(dst, src, skips[s]);
        }
    }
    free(dst);
}

static void skipped_tokens_are_never_written_from_l1(void **state)
{
    (void)state;
    ferry_kv *kv = open_store(NULL, 2 * NCH);
    size_t bytes = (size_t)PLANES * NTOK * TB;
    unsigned char *src = malloc(bytes);
    assert_non_null(src);
    ft_fill_pattern(src, bytes, 3);
    int32_t tok[NTOK];
    for (unsigned t = 0; t < NTOK; t++)
        tok[t] = (int32_t)(t * 3 + 7);
    ferry_kv_buffer sb = buffer(src);
    assert_int_equal(ferry_kv_store(kv, tok, NTOK, NULL, &sb), NTOK);
    run_skips(kv, tok, src);
    ferry_kv_close(kv);
    free(src);
}

static void skipped_tokens_are_never_written_from_checked_l2_reads(void **state)
{
    (void)state;
    char dir[256];
    ft_tmpdir(dir, sizeof dir);
    ferry_kv *kv = open_store(dir, 4); /* L1 of 4 chunks: the rest come from L2 */
    size_t bytes = (size_t)PLANES * NTOK * TB;
    unsigned char *src = malloc(bytes), *dst = malloc(bytes);
    assert_non_null(src);
    assert_non_null(dst);
    ft_fill_pattern(src, bytes, 5);
    int32_t tok[NTOK];
    for (unsigned t = 0; t < NTOK; t++)
        tok[t] = (int32_t)(t * 11 + 1);
    ferry_kv_buffer sb = buffer(src), db = buffer(dst);
    assert_int_equal(ferry_kv_store(kv, tok, NTOK, NULL, &sb), NTOK);
    FT_ASSERT_OK(ferry_kv_flush(kv));
    static const uint64_t skips[] = {0, 8, 16, 40, 100, 160};
    for (size_t s = 0; s < sizeof skips / sizeof skips[0]; s++) {
        /* push the prompt's early chunks out of L1 with other prompts */
        int32_t other[NTOK];
        for (unsigned t = 0; t < NTOK; t++)
            other[t] = (int32_t)(t * 13 + 100000 + s * 1000);
        assert_int_equal(ferry_kv_store(kv, other, NTOK, NULL, &sb), NTOK);
        FT_ASSERT_OK(ferry_kv_flush(kv));
        memset(dst, SENT, bytes);
        ferry_kv_req rq = FERRY_KV_REQ_INIT;
        rq.skip_tokens = skips[s];
        assert_int_equal(ferry_kv_retrieve(kv, tok, NTOK, &rq, &db), NTOK);
        check_split(dst, src, skips[s]);
    }
    ferry_kv_stats m = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(kv, &m));
    assert_true(m.tier[FERRY_KV_TIER_L2].hits > 0); /* the checked L2 path ran */
    FT_ASSERT_OK(ferry__kv_check(kv));
    ferry_kv_close(kv);
    free(src);
    free(dst);
    ft_rmtree(dir);
}

static void an_older_request_skips_nothing(void **state)
{
    (void)state;
    ferry_kv *kv = open_store(NULL, 2 * NCH);
    size_t bytes = (size_t)PLANES * NTOK * TB;
    unsigned char *src = malloc(bytes), *dst = malloc(bytes);
    assert_non_null(src);
    assert_non_null(dst);
    ft_fill_pattern(src, bytes, 8);
    int32_t tok[NTOK];
    for (unsigned t = 0; t < NTOK; t++)
        tok[t] = (int32_t)t;
    ferry_kv_buffer sb = buffer(src), db = buffer(dst);
    assert_int_equal(ferry_kv_store(kv, tok, NTOK, NULL, &sb), NTOK);
    /* a request exactly as long as the first version's (ASan sees any read
     * past it), async too: its copy must not over-read */
    unsigned char *raw = malloc(FERRY_KV_REQ_MIN_SIZE);
    assert_non_null(raw);
    ferry_kv_req full = FERRY_KV_REQ_INIT;
    memcpy(raw, &full, FERRY_KV_REQ_MIN_SIZE);
    size_t sz = FERRY_KV_REQ_MIN_SIZE;
    memcpy(raw, &sz, sizeof sz); /* its size field: the first version's */
    const ferry_kv_req *old = (const ferry_kv_req *)(void *)raw;
    memset(dst, SENT, bytes);
    assert_int_equal(ferry_kv_retrieve(kv, tok, NTOK, old, &db), NTOK);
    assert_memory_equal(dst, src, bytes);
    memset(dst, SENT, bytes);
    ferry_kv_op *op = NULL;
    FT_ASSERT_OK(ferry_kv_retrieve_async(kv, tok, NTOK, old, &db, &op));
    assert_int_equal(ferry_kv_op_wait(op, -1), NTOK);
    ferry_kv_op_free(op);
    assert_memory_equal(dst, src, bytes);
    sz = FERRY_KV_REQ_MIN_SIZE - 1; /* inside max_chunks: refused */
    memcpy(raw, &sz, sizeof sz);
    assert_int_equal(ferry_kv_retrieve(kv, tok, NTOK, old, &db), -EINVAL);
    free(raw);
    ferry_kv_close(kv);
    free(src);
    free(dst);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(skipped_tokens_are_never_written_from_l1),
        cmocka_unit_test(skipped_tokens_are_never_written_from_checked_l2_reads),
        cmocka_unit_test(an_older_request_skips_nothing),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
