/*
 * test_kv_named.c - chunks named by the caller: stored, found, retrieved
 * bitwise and deleted by name, in process, through a daemon, and across a
 * reopen of a persistent L2; names never find token chains (nor the other
 * way), another salt's, or half a request; bad names refused before any
 * byte moves.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry/kv.h"
#include "ferry/serve.h"
#include "ferry_test.h"
#include "serve_fixture.h"

#define TB 64u
#define CT 16u
#define NP 6u                      /* pages */
#define NTOK (NP * CT)
#define IMG ((size_t)4 * NTOK * TB)  /* 2 layers x K/V */

static ferry_kv_config config(void)
{
    ferry_kv_config c = FERRY_KV_CONFIG_INIT;
    c.model = "named";
    c.layout = ft_kv_layout(TB);
    c.chunk_tokens = CT;
    c.l1_bytes = 64 * 4 * CT * TB;
    c.workers = 2;
    return c;
}

static ferry_kv_buffer host_buf(unsigned char *img)
{
    return ft_kv_host_buffer(img, NTOK, TB);
}

/* SGLang-like page keys: 64 hex digits of a SHA-256 and a suffix */
static char g_keys[NP][80];
static ferry_kv_name g_names[NP];

static void make_names(const char *suffix)
{
    for (unsigned i = 0; i < NP; i++) {
        snprintf(g_keys[i], sizeof g_keys[i], "%016x%016x%016x%016x%s", i * 2654435761u, i + 7,
                 i * 40503u, 99u - i, suffix);
        g_names[i].bytes = g_keys[i];
        g_names[i].len = strlen(g_keys[i]);
    }
}

/* plane p, token t of an image of NTOK tokens */
static int same_page(const unsigned char *a, const unsigned char *b, unsigned page)
{
    for (unsigned p = 0; p < 4; p++)
        if (memcmp(a + ((size_t)p * NTOK + page * CT) * TB, b + ((size_t)p * NTOK + page * CT) * TB,
                   (size_t)CT * TB))
            return 0;
    return 1;
}

static void round_trip(ferry_kv *kv)
{
    unsigned char *src = malloc(IMG), *dst = calloc(1, IMG);
    assert_non_null(src);
    assert_non_null(dst);
    ft_fill_pattern(src, IMG, 41);
    ferry_kv_buffer sb = host_buf(src), db = host_buf(dst);
    make_names(":tp0");
    int st[NP];
    ferry_kv_req req = FERRY_KV_REQ_INIT;
    req.status = st;
    req.max_chunks = NP;
    assert_int_equal(ferry_kv_store_named(kv, g_names, NP, &req, &sb), NP);
    for (unsigned i = 0; i < NP; i++)
        assert_int_equal(st[i], 0);
    assert_int_equal(ferry_kv_store_named(kv, g_names, NP, NULL, &sb), NP); /* present */
    assert_int_equal(ferry_kv_lookup_named(kv, g_names, NP, NULL), NP);
    assert_int_equal(ferry_kv_retrieve_named(kv, g_names, NP, NULL, &db), NP);
    assert_memory_equal(src, dst, IMG);
    /* pages in another order land where their names are */
    ferry_kv_name rev[NP];
    for (unsigned i = 0; i < NP; i++)
        rev[i] = g_names[NP - 1 - i];
    memset(dst, 0, IMG);
    assert_int_equal(ferry_kv_retrieve_named(kv, rev, NP, NULL, &db), NP);
    for (unsigned i = 0; i < NP; i++) {
        /* page i of dst holds what was stored under name NP-1-i: src's page NP-1-i */
        for (unsigned p = 0; p < 4; p++)
            assert_memory_equal(dst + ((size_t)p * NTOK + i * CT) * TB,
                                src + ((size_t)p * NTOK + (NP - 1 - i) * CT) * TB,
                                (size_t)CT * TB);
    }
    /* a missing name ends the leading run; every page present is loaded */
    ferry_kv_name gap[3] = {g_names[0], {"no such page", 12}, g_names[2]};
    assert_int_equal(ferry_kv_lookup_named(kv, gap, 3, NULL), 1);
    memset(dst, 0xAB, IMG);
    int gst[3];
    ferry_kv_req greq = FERRY_KV_REQ_INIT;
    greq.status = gst;
    greq.max_chunks = 3;
    assert_int_equal(ferry_kv_retrieve_named(kv, gap, 3, &greq, &db), 1);
    assert_int_equal(gst[0], 0);
    assert_int_equal(gst[1], FERRY_ENOTFOUND);
    assert_int_equal(gst[2], 0);
    assert_true(same_page(dst, src, 0));
    assert_true(same_page(dst, src, 2));
    for (unsigned p = 0; p < 4; p++)
        for (size_t i = 0; i < (size_t)CT * TB; i++)
            assert_int_equal(dst[((size_t)p * NTOK + CT) * TB + i], 0xAB); /* page 1 untouched */
    /* another salt: not found */
    ferry_kv_req salted = FERRY_KV_REQ_INIT;
    salted.salt = "other";
    salted.salt_len = 5;
    assert_int_equal(ferry_kv_lookup_named(kv, g_names, NP, &salted), 0);
    /* names never find token chains, nor token chains names */
    int32_t toks[NTOK];
    memcpy(toks, g_keys, sizeof toks < sizeof g_keys ? sizeof toks : sizeof g_keys);
    for (unsigned i = 0; i < NTOK; i++)
        toks[i] &= 0x7fffffff;
    assert_int_equal(ferry_kv_lookup(kv, toks, NTOK, NULL), 0);
    assert_int_equal(ferry_kv_store(kv, toks, NTOK, NULL, &sb), NTOK);
    ferry_kv_name tn[NP];
    for (unsigned i = 0; i < NP; i++) {
        tn[i].bytes = toks + i * CT;
        tn[i].len = CT * sizeof(int32_t);
    }
    assert_int_equal(ferry_kv_lookup_named(kv, tn, NP, NULL), 0);
    /* delete */
    assert_int_equal(ferry_kv_delete_named(kv, g_names, 2, NULL), 2);
    assert_int_equal(ferry_kv_lookup_named(kv, g_names, NP, NULL), 0);
    assert_int_equal(ferry_kv_lookup_named(kv, g_names + 2, NP - 2, NULL), NP - 2);
    free(src);
    free(dst);
}

static void bad_names(ferry_kv *kv)
{
    unsigned char *img = calloc(1, IMG);
    assert_non_null(img);
    ferry_kv_buffer b = host_buf(img);
    make_names(":bad");
    static char longname[FERRY_KV_NAME_MAX + 1];
    memset(longname, 'k', sizeof longname);
    ferry_kv_name bad[3][2] = {{g_names[0], {NULL, 4}},
                               {g_names[0], {"", 0}},
                               {g_names[0], {longname, sizeof longname}}};
    for (int i = 0; i < 3; i++) {
        assert_int_equal(ferry_kv_store_named(kv, bad[i], 2, NULL, &b), -EINVAL);
        assert_non_null(strstr(ferry_last_error(), "name 1 of 2"));
        assert_int_equal(ferry_kv_lookup_named(kv, bad[i], 2, NULL), -EINVAL);
    }
    ferry_kv_name fits = {longname, FERRY_KV_NAME_MAX};
    assert_int_equal(ferry_kv_store_named(kv, &fits, 1, NULL, &b), 1);
    ferry_kv_req req = FERRY_KV_REQ_INIT;
    req.flags = FERRY_KV_PARTIAL;
    assert_int_equal(ferry_kv_store_named(kv, g_names, 2, &req, &b), -EINVAL);
    req.flags = 0;
    req.skip_tokens = 3;
    assert_int_equal(ferry_kv_retrieve_named(kv, g_names, 2, &req, &b), -EINVAL);
    assert_int_equal(ferry_kv_store_named(kv, NULL, 2, NULL, &b), -EINVAL);
    assert_int_equal(ferry_kv_store_named(kv, g_names, 0, NULL, &b), -EINVAL);
    ferry_kv_name more[NP + 1];
    memcpy(more, g_names, sizeof g_names);
    more[NP] = g_names[0];
    assert_int_equal(ferry_kv_store_named(kv, more, NP + 1, NULL, &b), -ENOBUFS);
    assert_int_equal(ferry_kv_lookup_named(kv, g_names, 2, NULL), 0);
    assert_int_equal(ferry_kv_store_named(NULL, g_names, 2, NULL, &b), -EINVAL);
    free(img);
}

/* the packed form finds what the array form finds: hits, a miss ending the
 * leading run, another salt's; bad input refused as the array form's is */
static void packed_names(ferry_kv *kv)
{
    unsigned char *img = malloc(IMG);
    assert_non_null(img);
    ft_fill_pattern(img, IMG, 17);
    ferry_kv_buffer b = host_buf(img);
    make_names(":packed");
    size_t len = g_names[0].len;
    char packed[NP * 80];
    for (unsigned i = 0; i < NP; i++) {
        assert_int_equal(g_names[i].len, len);
        memcpy(packed + i * len, g_keys[i], len);
    }
    assert_int_equal(ferry_kv_lookup_named_packed(kv, packed, len, NP, NULL), 0);
    assert_int_equal(ferry_kv_store_named(kv, g_names, NP - 2, NULL, &b), NP - 2);
    for (size_t n = 1; n <= NP; n++) /* NP - 2 stored: a prefix of each n */
        assert_int_equal(ferry_kv_lookup_named_packed(kv, packed, len, n, NULL),
                         ferry_kv_lookup_named(kv, g_names, n, NULL));
    assert_int_equal(ferry_kv_lookup_named_packed(kv, packed, len, NP, NULL), NP - 2);
    assert_int_equal(ferry_kv_lookup_named_packed(kv, packed + len, len, 1, NULL), 1);
    assert_int_equal(ferry_kv_lookup_named_packed(kv, packed + (NP - 1) * len, len, 1, NULL), 0);
    char gap[3 * 80]; /* page 0, a page never stored, page 2 */
    memcpy(gap, packed, len);
    memcpy(gap + len, packed + (NP - 1) * len, len);
    memcpy(gap + 2 * len, packed + 2 * len, len);
    assert_int_equal(ferry_kv_lookup_named_packed(kv, gap, len, 3, NULL), 1);
    /* one name's bytes split at another length are other names */
    assert_int_equal(ferry_kv_lookup_named_packed(kv, packed, len / 2, 2, NULL), 0);
    /* tiers and the salt, as the array form */
    uint8_t tiers[NP];
    ferry_kv_req req = FERRY_KV_REQ_INIT;
    req.tiers = tiers;
    req.max_chunks = NP;
    assert_int_equal(ferry_kv_lookup_named_packed(kv, packed, len, 2, &req), 2);
    assert_int_equal(tiers[0], FERRY_KV_TIER_L1);
    ferry_kv_req salted = FERRY_KV_REQ_INIT;
    salted.salt = "other";
    salted.salt_len = 5;
    assert_int_equal(ferry_kv_lookup_named_packed(kv, packed, len, NP, &salted), 0);
    assert_int_equal(ferry_kv_store_named(kv, g_names, 1, &salted, &b), 1);
    assert_int_equal(ferry_kv_lookup_named_packed(kv, packed, len, NP, &salted), 1);
    /* bad input */
    static char longname[FERRY_KV_NAME_MAX + 1];
    assert_int_equal(ferry_kv_lookup_named_packed(kv, NULL, len, 1, NULL), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "no names"));
    assert_int_equal(ferry_kv_lookup_named_packed(kv, packed, len, 0, NULL), -EINVAL);
    assert_int_equal(ferry_kv_lookup_named_packed(kv, packed, 0, 1, NULL), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "name 0 of 1 is empty or too long"));
    assert_int_equal(ferry_kv_lookup_named_packed(kv, longname, sizeof longname, 1, NULL),
                     -EINVAL);
    assert_int_equal(ferry_kv_lookup_named_packed(kv, packed, len, SIZE_MAX / 2, NULL), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "too many"));
    req.flags = FERRY_KV_PARTIAL;
    assert_int_equal(ferry_kv_lookup_named_packed(kv, packed, len, 1, &req), -EINVAL);
    assert_int_equal(ferry_kv_lookup_named_packed(NULL, packed, len, 1, NULL), -EINVAL);
    assert_int_equal(ferry_kv_lookup_named_packed(kv, packed, len, NP, NULL), NP - 2);
    free(img);
}

static void test_named_in_process(void **state)
{
    (void)state;
    ferry_kv_config c = config();
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    round_trip(kv);
    bad_names(kv);
    packed_names(kv);
    ferry_kv_close(kv);
}

static void test_named_through_a_daemon(void **state)
{
    (void)state;
    ferry_kv_config kc = config();
    ft_kv_daemon d;
    ft_kv_daemon_start(&d, &kc);
    ferry_kv *kv = ft_kv_daemon_client(&d, config());
    round_trip(kv);
    bad_names(kv);
    packed_names(kv);
    ferry_kv_close(kv);
    ft_kv_daemon_stop(&d);
}

static void test_named_survive_a_reopen_of_a_persistent_l2(void **state)
{
    (void)state;
    char dir[256];
    assert_non_null(ft_tmpdir(dir, sizeof dir));
    ferry_kv_config c = config();
    c.l2_dir = dir;
    c.l2_bytes = 16u << 20;
    c.l2_persistent = 1;
    unsigned char *src = malloc(IMG), *dst = calloc(1, IMG);
    assert_non_null(src);
    assert_non_null(dst);
    ft_fill_pattern(src, IMG, 5);
    ferry_kv_buffer sb = host_buf(src), db = host_buf(dst);
    make_names(":persist");
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    assert_int_equal(ferry_kv_store_named(kv, g_names, NP, NULL, &sb), NP);
    assert_true(ferry_kv_sync(kv) >= 0);
    ferry_kv_close(kv);
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    assert_int_equal(ferry_kv_lookup_named(kv, g_names, NP, NULL), NP);
    assert_int_equal(ferry_kv_retrieve_named(kv, g_names, NP, NULL, &db), NP);
    assert_memory_equal(src, dst, IMG);
    ferry_kv_close(kv);
    free(src);
    free(dst);
    ft_rmtree(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_named_in_process),
        cmocka_unit_test(test_named_through_a_daemon),
        cmocka_unit_test(test_named_survive_a_reopen_of_a_persistent_l2),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
