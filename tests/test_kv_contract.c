/*
 * test_kv_contract.c - kv.h's contract, one suite over both backends of
 * the KV API (src/kv/backend.h): every case runs against an in-process
 * store and against a client of a `ferry serve` daemon the fixture starts
 * in a thread, and expects the same return values, per-chunk statuses and
 * bytes from both.
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
#define NTOK (5 * CT + 7)            /* 5 whole chunks and a partial one */
#define IMG ((size_t)4 * NTOK * TB)  /* 2 layers x K/V */

typedef struct fx {
    int server;
    ft_kv_daemon d;
    ferry_kv *kv;
    unsigned char *src, *dst;
    ferry_kv_buffer sb, db;
    int32_t tok[NTOK];
} fx;

static ferry_kv_config config(void)
{
    ferry_kv_config c = FERRY_KV_CONFIG_INIT;
    c.model = "contract";
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

static int setup(void **state, int server)
{
    fx *f = calloc(1, sizeof *f);
    assert_non_null(f);
    f->server = server;
    ferry_kv_config c = config();
    if (server) {
        ft_kv_daemon_start(&f->d, &c);
        f->kv = ft_kv_daemon_client(&f->d, c);
    } else {
        FT_ASSERT_OK(ferry_kv_open(&c, &f->kv));
    }
    f->src = malloc(IMG);
    f->dst = calloc(1, IMG);
    assert_non_null(f->src);
    assert_non_null(f->dst);
    ft_fill_pattern(f->src, IMG, 17);
    f->sb = host_buf(f->src);
    f->db = host_buf(f->dst);
    for (unsigned i = 0; i < NTOK; i++)
        f->tok[i] = (int32_t)(i * 37 + 11);
    *state = f;
    return 0;
}

static int setup_local(void **state) { return setup(state, 0); }
static int setup_server(void **state) { return setup(state, 1); }

static int teardown(void **state)
{
    fx *f = *state;
    ferry_kv_close(f->kv);
    if (f->server)
        ft_kv_daemon_stop(&f->d);
    free(f->src);
    free(f->dst);
    free(f);
    return 0;
}

/* tokens [t0, t0 + n) of every plane of a and b agree */
static void same_tokens(const unsigned char *a, const unsigned char *b, size_t t0, size_t n)
{
    for (unsigned p = 0; p < 4; p++)
        assert_memory_equal(a + ((size_t)p * NTOK + t0) * TB, b + ((size_t)p * NTOK + t0) * TB,
                            n * TB);
}

/* a store, a lookup and a retrieve of whole chunks; a partial one with the flag */
static void store_lookup_retrieve(void **state)
{
    fx *f = *state;
    int st[6];
    uint8_t tiers[6];
    ferry_kv_req req = FERRY_KV_REQ_INIT;
    req.status = st;
    req.tiers = tiers;
    req.max_chunks = 6;
    assert_int_equal(ferry_kv_store(f->kv, f->tok, NTOK, &req, &f->sb), 5 * CT);
    for (int i = 0; i < 5; i++)
        assert_int_equal(st[i], 0);
    assert_int_equal(ferry_kv_store(f->kv, f->tok, NTOK, NULL, &f->sb), 5 * CT); /* present */
    assert_int_equal(ferry_kv_lookup(f->kv, f->tok, NTOK, &req), 5 * CT);
    for (int i = 0; i < 5; i++)
        assert_int_equal(tiers[i], FERRY_KV_TIER_L1);
    assert_int_equal(ferry_kv_lookup(f->kv, f->tok, 3 * CT + 2, NULL), 3 * CT);
    memset(f->dst, 0x5A, IMG);
    assert_int_equal(ferry_kv_retrieve(f->kv, f->tok, NTOK, &req, &f->db), 5 * CT);
    same_tokens(f->src, f->dst, 0, 5 * CT);
    for (unsigned p = 0; p < 4; p++) /* the partial chunk's tokens untouched */
        for (size_t i = 0; i < 7 * TB; i++)
            assert_int_equal(f->dst[((size_t)p * NTOK + 5 * CT) * TB + i], 0x5A);
    req.flags = FERRY_KV_PARTIAL;
    assert_int_equal(ferry_kv_store(f->kv, f->tok, NTOK, &req, &f->sb), NTOK);
    assert_int_equal(ferry_kv_lookup(f->kv, f->tok, NTOK, &req), NTOK);
    assert_int_equal(ferry_kv_retrieve(f->kv, f->tok, NTOK, &req, &f->db), NTOK);
    same_tokens(f->src, f->dst, 0, NTOK);
}

/* a salt names other chunks; skip_tokens leaves the engine's prefix alone */
static void salt_and_skip(void **state)
{
    fx *f = *state;
    ferry_kv_req salted = FERRY_KV_REQ_INIT;
    salted.salt = "tenant-b";
    salted.salt_len = 8;
    assert_int_equal(ferry_kv_store(f->kv, f->tok, 2 * CT, NULL, &f->sb), 2 * CT);
    assert_int_equal(ferry_kv_lookup(f->kv, f->tok, 2 * CT, &salted), 0);
    assert_int_equal(ferry_kv_retrieve(f->kv, f->tok, 2 * CT, &salted, &f->db), 0);
    ferry_kv_req skip = FERRY_KV_REQ_INIT;
    skip.skip_tokens = CT + 3;
    memset(f->dst, 0x77, IMG);
    assert_int_equal(ferry_kv_retrieve(f->kv, f->tok, 2 * CT, &skip, &f->db), 2 * CT);
    for (unsigned p = 0; p < 4; p++)
        for (size_t i = 0; i < (CT + 3) * TB; i++)
            assert_int_equal(f->dst[(size_t)p * NTOK * TB + i], 0x77);
    for (unsigned p = 0; p < 4; p++)
        assert_memory_equal(f->dst + ((size_t)p * NTOK + CT + 3) * TB,
                            f->src + ((size_t)p * NTOK + CT + 3) * TB, (CT - 3) * TB);
}

/* a missing chunk ends the leading run and says so per chunk */
static void a_miss_in_the_middle(void **state)
{
    fx *f = *state;
    assert_int_equal(ferry_kv_store(f->kv, f->tok, 4 * CT, NULL, &f->sb), 4 * CT);
    int32_t other[4 * CT];
    memcpy(other, f->tok, sizeof other);
    other[2 * CT] += 1; /* chunk 2 differs: chunks 2 and 3 are new chains */
    int st[4];
    ferry_kv_req req = FERRY_KV_REQ_INIT;
    req.status = st;
    req.max_chunks = 4;
    assert_int_equal(ferry_kv_lookup(f->kv, other, 4 * CT, NULL), 2 * CT);
    memset(f->dst, 0, IMG);
    assert_int_equal(ferry_kv_retrieve(f->kv, other, 4 * CT, &req, &f->db), 2 * CT);
    assert_int_equal(st[0], 0);
    assert_int_equal(st[1], 0);
    assert_int_equal(st[2], FERRY_ENOTFOUND);
    assert_int_equal(st[3], FERRY_ENOTFOUND);
}

/* pin, delete, clear and unpin */
static void pin_delete_clear(void **state)
{
    fx *f = *state;
    assert_int_equal(ferry_kv_store(f->kv, f->tok, 3 * CT, NULL, &f->sb), 3 * CT);
    assert_int_equal(ferry_kv_pin(f->kv, f->tok, 2 * CT, NULL), 2 * CT);
    assert_int_equal(ferry_kv_clear(f->kv), FERRY_ELOCKED); /* the pinned stay */
    assert_int_equal(ferry_kv_lookup(f->kv, f->tok, 3 * CT, NULL), 2 * CT);
    assert_int_equal(ferry_kv_unpin(f->kv, f->tok, 2 * CT, NULL), 2 * CT);
    assert_int_equal(ferry_kv_delete(f->kv, f->tok, CT, NULL), 1);
    assert_int_equal(ferry_kv_lookup(f->kv, f->tok, 3 * CT, NULL), 0);
    assert_true(ferry_kv_clear(f->kv) >= 0);
    assert_int_equal(ferry_kv_lookup(f->kv, f->tok, 2 * CT, NULL), 0);
    assert_int_equal(ferry_kv_flush(f->kv), 0);
    assert_int_equal(ferry_kv_sync(f->kv), 0); /* no persistent L2: nothing to commit */
}

/* the asynchronous and layerwise forms return what the blocking ones do */
static void async_and_layers(void **state)
{
    fx *f = *state;
    ferry_kv_op *op = NULL;
    FT_ASSERT_OK(ferry_kv_store_async(f->kv, f->tok, 4 * CT, NULL, &f->sb, &op));
    assert_int_equal(ferry_kv_op_wait(op, -1), 4 * CT);
    ferry_kv_op_free(op);
    memset(f->dst, 0, IMG);
    FT_ASSERT_OK(ferry_kv_retrieve_async(f->kv, f->tok, 4 * CT, NULL, &f->db, &op));
    assert_int_equal(ferry_kv_op_wait(op, -1), 4 * CT);
    ferry_kv_op_free(op);
    same_tokens(f->src, f->dst, 0, 4 * CT);
    int32_t t2[3 * CT];
    for (unsigned i = 0; i < 3 * CT; i++)
        t2[i] = (int32_t)(i + 900000);
    FT_ASSERT_OK(ferry_kv_store_layers(f->kv, t2, 3 * CT, NULL, &f->sb, NULL, &op));
    assert_int_equal(ferry_kv_op_wait(op, 0), FERRY_ESTATE); /* layers missing */
    assert_int_equal(ferry_kv_op_layer_done(op, 0, NULL), 0);
    assert_int_equal(ferry_kv_op_layer_done(op, 0, NULL), FERRY_ESTATE);
    assert_int_equal(ferry_kv_op_layer_done(op, 1, NULL), 0);
    assert_int_equal(ferry_kv_op_wait(op, -1), 3 * CT);
    ferry_kv_op_free(op);
    memset(f->dst, 0, IMG);
    FT_ASSERT_OK(ferry_kv_retrieve_layers(f->kv, t2, 3 * CT, NULL, &f->db, NULL, &op));
    assert_int_equal(ferry_kv_op_wait_layer(op, 1, -1), 3 * CT);
    assert_int_equal(ferry_kv_op_wait(op, -1), 3 * CT);
    ferry_kv_op_free(op);
    same_tokens(f->src, f->dst, 0, 3 * CT);
}

/* bad requests: the same code from both, nothing moved */
static void bad_requests(void **state)
{
    fx *f = *state;
    assert_int_equal(ferry_kv_store(f->kv, NULL, CT, NULL, &f->sb), -EINVAL);
    assert_int_equal(ferry_kv_store(f->kv, f->tok, 0, NULL, &f->sb), -EINVAL);
    int32_t neg[CT];
    memcpy(neg, f->tok, sizeof neg);
    neg[3] = -1;
    assert_int_equal(ferry_kv_store(f->kv, neg, CT, NULL, &f->sb), -EINVAL);
    ferry_kv_buffer small = f->sb;
    small.capacity_tokens = CT - 1;
    assert_int_equal(ferry_kv_store(f->kv, f->tok, CT, NULL, &small), -ENOBUFS);
    ferry_kv_buffer other = f->sb;
    other.layout.num_layers = 3;
    assert_int_equal(ferry_kv_retrieve(f->kv, f->tok, CT, NULL, &other), FERRY_EMISMATCH);
    ferry_kv_req bad = FERRY_KV_REQ_INIT;
    bad.salt_len = 4;
    assert_int_equal(ferry_kv_lookup(f->kv, f->tok, CT, &bad), -EINVAL);
    assert_int_equal(ferry_kv_lookup(f->kv, f->tok, CT, NULL), 0);
}

#define BOTH(fn)                                                          \
    cmocka_unit_test_setup_teardown(fn, setup_local, teardown),           \
        cmocka_unit_test_setup_teardown(fn, setup_server, teardown)

int main(void)
{
    const struct CMUnitTest tests[] = {
        BOTH(store_lookup_retrieve), BOTH(salt_and_skip), BOTH(a_miss_in_the_middle),
        BOTH(pin_delete_clear),      BOTH(async_and_layers), BOTH(bad_requests),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
