/*
 * test_kv_promises.c - sentences of ferry/kv.h that no other test held
 * (or held by the return code alone), each checked as an engine sees it:
 * the public API only, the bytes compared, in process and through a
 * `ferry serve` daemon wherever the header says both behave the same.
 */
/* ferry-test-labels: concurrent */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ferry/kv.h"
#include "ferry/serve.h"
#include "ferry_test.h"
#include "serve_fixture.h"

#define TB 64u
#define CT 16u
#define NC 6u                        /* whole chunks in the image */
#define NTOK (NC * CT)
#define IMG ((size_t)4 * NTOK * TB)  /* 2 layers x K/V */
#define SENT 0x5eed

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
    c.model = "promises";
    c.layout = ft_kv_layout(TB);
    c.chunk_tokens = CT;
    c.l1_bytes = 64 * 4 * CT * TB;
    c.workers = 2;
    return c;
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
    ft_fill_pattern(f->src, IMG, 23);
    f->sb = ft_kv_host_buffer(f->src, NTOK, TB);
    f->db = ft_kv_host_buffer(f->dst, NTOK, TB);
    for (unsigned i = 0; i < NTOK; i++)
        f->tok[i] = (int32_t)(i * 53 + 5);
    *state = f;
    return 0;
}

static int setup_local(void **state) { return setup(state, 0); }
static int setup_server(void **state) { return setup(state, 1); }

static int teardown(void **state)
{
    fx *f = *state;
    if (f->kv)
        ferry_kv_close(f->kv);
    if (f->server)
        ft_kv_daemon_stop(&f->d);
    free(f->src);
    free(f->dst);
    free(f);
    return 0;
}

/* chunk c of a and b agree on every plane */
static int same_chunk(const unsigned char *a, const unsigned char *b, unsigned c)
{
    for (unsigned p = 0; p < 4; p++)
        if (memcmp(a + ((size_t)p * NTOK + c * CT) * TB, b + ((size_t)p * NTOK + c * CT) * TB,
                   (size_t)CT * TB))
            return 0;
    return 1;
}

/* every byte of chunk c of img on every plane is v */
static int chunk_is(const unsigned char *img, unsigned c, unsigned char v)
{
    for (unsigned p = 0; p < 4; p++)
        for (size_t i = 0; i < (size_t)CT * TB; i++)
            if (img[((size_t)p * NTOK + c * CT) * TB + i] != v)
                return 0;
    return 1;
}

static void fill_ints(int *a, size_t n, int v)
{
    for (size_t i = 0; i < n; i++)
        a[i] = v;
}

/* ---- per-chunk results: max_chunks entries, no more ---- */

/* req->status and req->tiers hold max_chunks entries: a request of more
 * chunks writes none past them, and a lookup writes no tier past its
 * first miss ("later entries are not written") */
static void results_stay_within_max_chunks(void **state)
{
    fx *f = *state;
    int st[NC + 2];
    uint8_t tiers[NC + 2];
    ferry_kv_req req = FERRY_KV_REQ_INIT;
    req.status = st;
    req.tiers = tiers;
    req.max_chunks = 2;
    fill_ints(st, NC + 2, SENT);
    memset(tiers, 0xEE, sizeof tiers);
    assert_int_equal(ferry_kv_store(f->kv, f->tok, 4 * CT, &req, &f->sb), 4 * CT);
    assert_int_equal(st[0], 0);
    assert_int_equal(st[1], 0);
    for (unsigned i = 2; i < NC + 2; i++)
        assert_int_equal(st[i], SENT);
    fill_ints(st, NC + 2, SENT);
    assert_int_equal(ferry_kv_retrieve(f->kv, f->tok, 4 * CT, &req, &f->db), 4 * CT);
    for (unsigned i = 2; i < NC + 2; i++)
        assert_int_equal(st[i], SENT);
    for (unsigned c = 0; c < 4; c++)
        assert_true(same_chunk(f->src, f->dst, c));
    assert_int_equal(ferry_kv_lookup(f->kv, f->tok, 4 * CT, &req), 4 * CT);
    assert_int_equal(tiers[0], FERRY_KV_TIER_L1);
    assert_int_equal(tiers[1], FERRY_KV_TIER_L1);
    for (unsigned i = 2; i < NC + 2; i++)
        assert_int_equal(tiers[i], 0xEE);
    /* 4 chunks cached of 6 asked: tiers 0..3 L1, 4 NONE, 5 not written */
    req.max_chunks = NC + 2;
    memset(tiers, 0xEE, sizeof tiers);
    assert_int_equal(ferry_kv_lookup(f->kv, f->tok, NTOK, &req), 4 * CT);
    for (unsigned i = 0; i < 4; i++)
        assert_int_equal(tiers[i], FERRY_KV_TIER_L1);
    assert_int_equal(tiers[4], FERRY_KV_TIER_NONE);
    assert_int_equal(tiers[5], 0xEE);
    assert_int_equal(tiers[6], 0xEE);
}

/* "Every chunk that is present is copied": a hole in the cached chain
 * ends the count, not the copies; the hole's tokens are not written */
static void retrieve_copies_present_chunks_past_a_hole(void **state)
{
    fx *f = *state;
    assert_int_equal(ferry_kv_store(f->kv, f->tok, 4 * CT, NULL, &f->sb), 4 * CT);
    assert_int_equal(ferry_kv_delete(f->kv, f->tok, 2 * CT, NULL), 2);
    assert_int_equal(ferry_kv_store(f->kv, f->tok, CT, NULL, &f->sb), CT);
    assert_int_equal(ferry_kv_lookup(f->kv, f->tok, 4 * CT, NULL), CT);
    int st[4];
    ferry_kv_req req = FERRY_KV_REQ_INIT;
    req.status = st;
    req.max_chunks = 4;
    memset(f->dst, 0xC3, IMG);
    assert_int_equal(ferry_kv_retrieve(f->kv, f->tok, 4 * CT, &req, &f->db), CT);
    assert_int_equal(st[0], 0);
    assert_int_equal(st[1], FERRY_ENOTFOUND);
    assert_int_equal(st[2], 0);
    assert_int_equal(st[3], 0);
    assert_true(same_chunk(f->src, f->dst, 0));
    assert_true(chunk_is(f->dst, 1, 0xC3));
    assert_true(same_chunk(f->src, f->dst, 2));
    assert_true(same_chunk(f->src, f->dst, 3));
}

/* dst holding fewer tokens than n: -ENOBUFS before any byte moves */
static void retrieve_into_a_short_buffer_moves_nothing(void **state)
{
    fx *f = *state;
    assert_int_equal(ferry_kv_store(f->kv, f->tok, 2 * CT, NULL, &f->sb), 2 * CT);
    ferry_kv_buffer small = f->db;
    small.capacity_tokens = 2 * CT - 1;
    memset(f->dst, 0x3C, IMG);
    assert_int_equal(ferry_kv_retrieve(f->kv, f->tok, 2 * CT, NULL, &small), -ENOBUFS);
    assert_true(ferry_kv_last_error(f->kv)[0] != '\0');
    for (size_t i = 0; i < IMG; i++)
        assert_int_equal(f->dst[i], 0x3C);
}

/* a device buffer on a store without a device: FERRY_ENODEV, nothing moved */
static void device_buffer_without_a_device(void **state)
{
    fx *f = *state;
    ferry_kv_buffer dev = f->sb;
    dev.mem = FERRY_KV_MEM_DEVICE;
    assert_int_equal(ferry_kv_store(f->kv, f->tok, CT, NULL, &dev), FERRY_ENODEV);
    assert_int_equal(ferry_kv_lookup(f->kv, f->tok, CT, NULL), 0);
    assert_int_equal(ferry_kv_store(f->kv, f->tok, CT, NULL, &f->sb), CT);
    assert_int_equal(ferry_kv_retrieve(f->kv, f->tok, CT, NULL, &dev), FERRY_ENODEV);
}

/* a negative block id in a paged buffer: -EINVAL naming its position */
static void negative_block_id_refused(void **state)
{
    fx *f = *state;
    const unsigned bt = 8, nb = 8;
    uint64_t bases[4];
    for (unsigned p = 0; p < 4; p++)
        bases[p] = (uint64_t)(uintptr_t)(f->src + (size_t)p * nb * bt * TB);
    int32_t table[4] = {0, 1, -1, 3};
    ferry_kv_buffer b = FERRY_KV_BUFFER_INIT;
    b.layout = ft_kv_layout(TB);
    b.form = FERRY_KV_PAGED;
    b.block_bases = bases;
    b.block_tokens = bt;
    b.num_blocks = nb;
    b.block_table = table;
    b.table_len = 4;
    assert_int_equal(ferry_kv_store(f->kv, f->tok, 2 * CT, NULL, &b), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "2"));
    assert_int_equal(ferry_kv_lookup(f->kv, f->tok, 2 * CT, NULL), 0);
    table[2] = 2;
    assert_int_equal(ferry_kv_store(f->kv, f->tok, 2 * CT, NULL, &b), 2 * CT);
}

/* ---- errors name the cause ---- */

/* a fresh store has no failure to tell; a failed call's message names it */
static void last_error_empty_then_names_the_cause(void **state)
{
    fx *f = *state;
    assert_string_equal(ferry_kv_last_error(f->kv), "");
    int32_t neg[CT];
    memcpy(neg, f->tok, sizeof neg);
    neg[5] = -7;
    assert_int_equal(ferry_kv_lookup(f->kv, neg, CT, NULL), -EINVAL);
    assert_non_null(strstr(ferry_kv_last_error(f->kv), "5"));
    assert_non_null(strstr(ferry_last_error(), "5"));
}

/* the message is the thread's own copy, valid until its fourth next
 * *_last_error call: three calls later it still reads whole */
static void last_error_copy_outlives_three_calls(void **state)
{
    fx *f = *state;
    assert_int_equal(ferry_kv_lookup(f->kv, NULL, CT, NULL), -EINVAL);
    const char *first = ferry_kv_last_error(f->kv);
    char want[512];
    snprintf(want, sizeof want, "%s", first);
    assert_non_null(strstr(want, "no tokens"));
    int32_t neg[CT];
    memcpy(neg, f->tok, sizeof neg);
    neg[9] = -1;
    for (int k = 0; k < 3; k++) {
        assert_int_equal(ferry_kv_lookup(f->kv, neg, CT, NULL), -EINVAL);
        (void)ferry_kv_last_error(f->kv);
    }
    assert_string_equal(first, want);
}

/* a stored partial last chunk is found and written only when asked for */
static void partial_chunk_only_when_asked(void **state)
{
    fx *f = *state;
    const size_t n = 2 * CT + 5;
    ferry_kv_req part = FERRY_KV_REQ_INIT;
    part.flags = FERRY_KV_PARTIAL;
    assert_int_equal(ferry_kv_store(f->kv, f->tok, n, &part, &f->sb), (int)n);
    assert_int_equal(ferry_kv_lookup(f->kv, f->tok, n, NULL), 2 * CT);
    assert_int_equal(ferry_kv_lookup(f->kv, f->tok, n, &part), (int)n);
    memset(f->dst, 0x4E, IMG);
    assert_int_equal(ferry_kv_retrieve(f->kv, f->tok, n, NULL, &f->db), 2 * CT);
    for (unsigned p = 0; p < 4; p++)
        for (size_t i = 0; i < (size_t)(CT)*TB; i++)
            assert_int_equal(f->dst[((size_t)p * NTOK + 2 * CT) * TB + i], 0x4E);
    assert_int_equal(ferry_kv_retrieve(f->kv, f->tok, n, &part, &f->db), (int)n);
    for (unsigned p = 0; p < 4; p++) {
        assert_memory_equal(f->dst + (size_t)p * NTOK * TB, f->src + (size_t)p * NTOK * TB,
                            n * TB);
        for (size_t i = n * TB; i < (size_t)3 * CT * TB; i++)
            assert_int_equal(f->dst[(size_t)p * NTOK * TB + i], 0x4E);
    }
    /* a longer prompt: its third chunk is a whole one, not the partial */
    assert_int_equal(ferry_kv_lookup(f->kv, f->tok, 3 * CT, &part), 2 * CT);
    assert_int_equal(ferry_kv_delete(f->kv, f->tok, n, &part), 3);
    assert_int_equal(ferry_kv_lookup(f->kv, f->tok, n, &part), 0);
}

/* hashing writes at most max hashes and counts them all */
static void hash_chunks_writes_at_most_max(void **state)
{
    (void)state;
    int32_t tok[3 * CT + 1];
    for (unsigned i = 0; i < 3 * CT + 1; i++)
        tok[i] = (int32_t)i;
    ferry_kv_hash h[4], all[4];
    memset(h, 0xCD, sizeof h);
    assert_int_equal(ferry_kv_hash_chunks(9, tok, 3 * CT + 1, CT, 1, h, 2), 4);
    assert_int_equal(ferry_kv_hash_chunks(9, tok, 3 * CT + 1, CT, 1, all, 4), 4);
    assert_memory_equal(h, all, 2 * sizeof *h);
    const unsigned char *b = (const unsigned char *)&h[2];
    for (size_t i = 0; i < 2 * sizeof *h; i++)
        assert_int_equal(b[i], 0xCD);
    assert_int_equal(ferry_kv_hash_chunks(9, tok, 3 * CT + 1, CT, 0, NULL, 0), 3);
    assert_int_equal(ferry_kv_hash_chunks(9, NULL, 0, CT, 0, NULL, 0), 0);
    assert_int_equal(ferry_kv_hash_chunks(9, tok, CT - 1, CT, 0, NULL, 0), 0);
}

/* ---- the asynchronous forms ---- */

/* tokens and salt are hashed before the call returns: reusing them at once
 * changes nothing of the queued op */
static void async_tokens_and_salt_may_be_reused_at_once(void **state)
{
    fx *f = *state;
    int32_t tok[3 * CT];
    memcpy(tok, f->tok, sizeof tok);
    char salt[8];
    memcpy(salt, "tenant-a", 8);
    ferry_kv_req req = FERRY_KV_REQ_INIT;
    req.salt = salt;
    req.salt_len = sizeof salt;
    ferry_kv_op *op = NULL;
    FT_ASSERT_OK(ferry_kv_store_async(f->kv, tok, 3 * CT, &req, &f->sb, &op));
    memset(tok, 0x11, sizeof tok);
    memset(salt, 'z', sizeof salt);
    assert_int_equal(ferry_kv_op_wait(op, -1), 3 * CT);
    ferry_kv_op_free(op);
    ferry_kv_req a = FERRY_KV_REQ_INIT;
    a.salt = "tenant-a";
    a.salt_len = 8;
    assert_int_equal(ferry_kv_lookup(f->kv, f->tok, 3 * CT, &a), 3 * CT);
    assert_int_equal(ferry_kv_lookup(f->kv, f->tok, 3 * CT, &req), 0);
    /* the same for a retrieve */
    memcpy(tok, f->tok, sizeof tok);
    memcpy(salt, "tenant-a", 8);
    FT_ASSERT_OK(ferry_kv_retrieve_async(f->kv, tok, 3 * CT, &req, &f->db, &op));
    memset(tok, 0x22, sizeof tok);
    memset(salt, 'y', sizeof salt);
    assert_int_equal(ferry_kv_op_wait(op, -1), 3 * CT);
    ferry_kv_op_free(op);
    for (unsigned c = 0; c < 3; c++)
        assert_true(same_chunk(f->src, f->dst, c));
}

/* a cancel of an op that was done already returns what it returned; NULL
 * handles: -EINVAL, or nothing done */
static void cancel_after_the_end_and_null_handles(void **state)
{
    fx *f = *state;
    ferry_kv_op *op = NULL;
    int st[2];
    ferry_kv_req req = FERRY_KV_REQ_INIT;
    req.status = st;
    req.max_chunks = 2;
    FT_ASSERT_OK(ferry_kv_store_async(f->kv, f->tok, 2 * CT, &req, &f->sb, &op));
    assert_int_equal(ferry_kv_op_wait(op, -1), 2 * CT);
    assert_int_equal(ferry_kv_op_cancel(op), 2 * CT);
    assert_int_equal(ferry_kv_op_test(op), 2 * CT);
    assert_int_equal(ferry_kv_op_wait(op, 0), 2 * CT);
    assert_int_equal(st[0], 0);
    assert_int_equal(st[1], 0);
    ferry_kv_op_free(op);
    assert_int_equal(ferry_kv_op_cancel(NULL), -EINVAL);
    ferry_kv_op_free(NULL);
    ferry_kv_close(NULL);
    ferry_kv_close_begin(NULL);
    assert_int_equal(ferry_kv_lookup(f->kv, f->tok, 2 * CT, NULL), 2 * CT);
}

/* ---- layerwise ---- */

/* a layerwise store: invisible until its last layer; a plain store of the
 * same tokens meanwhile skips them FERRY_ELOCKED, not counted, and says so;
 * the layers' bytes are what is stored */
static void layerwise_store_invisible_and_locked_to_others(void **state)
{
    fx *f = *state;
    ferry_kv_op *op = NULL;
    FT_ASSERT_OK(ferry_kv_store_layers(f->kv, f->tok, 2 * CT, NULL, &f->sb, NULL, &op));
    assert_int_equal(ferry_kv_op_test(op), FERRY_ESTATE);
    FT_ASSERT_OK(ferry_kv_op_layer_done(op, 1, NULL));
    assert_int_equal(ferry_kv_lookup(f->kv, f->tok, 2 * CT, NULL), 0);
    memset(f->dst, 0x99, IMG);
    assert_int_equal(ferry_kv_retrieve(f->kv, f->tok, 2 * CT, NULL, &f->db), 0);
    assert_true(chunk_is(f->dst, 0, 0x99));
    /* another writer of the same chunks, from other bytes */
    unsigned char *other = malloc(IMG);
    assert_non_null(other);
    memset(other, 0x42, IMG);
    ferry_kv_buffer ob = ft_kv_host_buffer(other, NTOK, TB);
    int st[2];
    ferry_kv_req req = FERRY_KV_REQ_INIT;
    req.status = st;
    req.max_chunks = 2;
    ferry_kv_stats s0 = FERRY_KV_STATS_INIT, s1 = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(f->kv, &s0));
    assert_int_equal(ferry_kv_store(f->kv, f->tok, 2 * CT, &req, &ob), 0);
    assert_int_equal(st[0], FERRY_ELOCKED);
    assert_int_equal(st[1], FERRY_ELOCKED);
    assert_non_null(strstr(ferry_kv_last_error(f->kv), "skipped"));
    FT_ASSERT_OK(ferry_kv_stats_get(f->kv, &s1));
    assert_int_equal(s1.stored_chunks, s0.stored_chunks);
    FT_ASSERT_OK(ferry_kv_op_layer_done(op, 0, NULL));
    assert_int_equal(ferry_kv_op_wait(op, -1), 2 * CT);
    ferry_kv_op_free(op);
    assert_int_equal(ferry_kv_retrieve(f->kv, f->tok, 2 * CT, NULL, &f->db), 2 * CT);
    assert_true(same_chunk(f->src, f->dst, 0));
    assert_true(same_chunk(f->src, f->dst, 1));
    free(other);
}

/* layerwise misuse answers the same in both backends */
static void layerwise_misuse(void **state)
{
    fx *f = *state;
    assert_int_equal(ferry_kv_store(f->kv, f->tok, 2 * CT, NULL, &f->sb), 2 * CT);
    ferry_kv_op *op = NULL;
    ferry_kv_layers_opt o = FERRY_KV_LAYERS_OPT_INIT;
    o.flags = 1;
    assert_int_equal(ferry_kv_retrieve_layers(f->kv, f->tok, 2 * CT, NULL, &f->db, &o, &op),
                     -EINVAL);
    o = (ferry_kv_layers_opt)FERRY_KV_LAYERS_OPT_INIT;
    o.size = 3;
    assert_int_equal(ferry_kv_store_layers(f->kv, f->tok, 2 * CT, NULL, &f->sb, &o, &op),
                     -EINVAL);
    assert_null(op);
    /* any order, more than once; a host buffer has no stream wait */
    memset(f->dst, 0, IMG);
    FT_ASSERT_OK(ferry_kv_retrieve_layers(f->kv, f->tok, 2 * CT, NULL, &f->db, NULL, &op));
    assert_int_equal(ferry_kv_op_wait_layer(op, 2, -1), -EINVAL);
    assert_int_equal(ferry_kv_op_wait_layer(op, 1, -1), 2 * CT);
    assert_int_equal(ferry_kv_op_wait_layer(op, 0, -1), 2 * CT);
    assert_int_equal(ferry_kv_op_wait_layer(op, 1, -1), 2 * CT);
    assert_int_equal(ferry_kv_op_layer_done(op, 0, NULL), FERRY_ESTATE);
    assert_int_equal(ferry_kv_op_wait(op, -1), 2 * CT);
    ferry_kv_op_free(op);
    assert_true(same_chunk(f->src, f->dst, 0));
    assert_true(same_chunk(f->src, f->dst, 1));
    /* nothing cached: 0 for every layer */
    int32_t fresh[CT];
    for (unsigned i = 0; i < CT; i++)
        fresh[i] = (int32_t)(777000 + i);
    FT_ASSERT_OK(ferry_kv_retrieve_layers(f->kv, fresh, CT, NULL, &f->db, NULL, &op));
    assert_int_equal(ferry_kv_op_wait_layer(op, 0, -1), 0);
    assert_int_equal(ferry_kv_op_wait(op, -1), 0);
    ferry_kv_op_free(op);
    /* a cancelled layerwise store takes no more layers, commits nothing */
    FT_ASSERT_OK(ferry_kv_store_layers(f->kv, fresh, CT, NULL, &f->sb, NULL, &op));
    FT_ASSERT_OK(ferry_kv_op_layer_done(op, 0, NULL));
    assert_int_equal(ferry_kv_op_layer_done(op, 2, NULL), -EINVAL);
    assert_int_equal(ferry_kv_op_cancel(op), -ECANCELED);
    assert_int_equal(ferry_kv_op_layer_done(op, 1, NULL), -ECANCELED);
    ferry_kv_op_free(op);
    assert_int_equal(ferry_kv_lookup(f->kv, fresh, CT, NULL), 0);
}

/* ---- pins, deletes, clear ---- */

/* pins count: two pins need two unpins; a delete leaves the pinned chunk,
 * deletes the others and answers FERRY_ELOCKED; the survivor's bytes are
 * its own */
static void pins_count_and_delete_spares_the_locked(void **state)
{
    fx *f = *state;
    assert_int_equal(ferry_kv_store(f->kv, f->tok, 3 * CT, NULL, &f->sb), 3 * CT);
    assert_int_equal(ferry_kv_pin(f->kv, f->tok, CT, NULL), CT);
    assert_int_equal(ferry_kv_pin(f->kv, f->tok, CT, NULL), CT);
    assert_int_equal(ferry_kv_unpin(f->kv, f->tok, CT, NULL), CT);
    assert_int_equal(ferry_kv_delete(f->kv, f->tok, 3 * CT, NULL), FERRY_ELOCKED);
    assert_int_equal(ferry_kv_lookup(f->kv, f->tok, 3 * CT, NULL), CT);
    assert_int_equal(ferry_kv_retrieve(f->kv, f->tok, 3 * CT, NULL, &f->db), CT);
    assert_true(same_chunk(f->src, f->dst, 0));
    assert_int_equal(ferry_kv_unpin(f->kv, f->tok, CT, NULL), CT);
    assert_int_equal(ferry_kv_unpin(f->kv, f->tok, CT, NULL), 0); /* none left */
    assert_int_equal(ferry_kv_delete(f->kv, f->tok, 3 * CT, NULL), 1);
    assert_int_equal(ferry_kv_delete(f->kv, f->tok, 3 * CT, NULL), 0);
    assert_int_equal(ferry_kv_store(f->kv, f->tok, 3 * CT, NULL, &f->sb), 3 * CT);
    assert_int_equal(ferry_kv_clear(f->kv), 3);
    assert_int_equal(ferry_kv_lookup(f->kv, f->tok, CT, NULL), 0);
}

/* a prefetch of chunks in L1 answers the leading tokens there */
static void prefetch_counts_what_is_in_l1(void **state)
{
    fx *f = *state;
    assert_int_equal(ferry_kv_store(f->kv, f->tok, 3 * CT, NULL, &f->sb), 3 * CT);
    assert_int_equal(ferry_kv_prefetch(f->kv, f->tok, 5 * CT, NULL), 3 * CT);
    assert_int_equal(ferry_kv_prefetch(f->kv, NULL, 5 * CT, NULL), -EINVAL);
    assert_int_equal(ferry_kv_flush(f->kv), 0);
}

/* skip_tokens at or past n: every chunk found and counted, no byte of dst
 * written, in the blocking, asynchronous and layerwise forms alike */
static void skip_past_the_end_writes_nothing(void **state)
{
    fx *f = *state;
    assert_int_equal(ferry_kv_store(f->kv, f->tok, 3 * CT, NULL, &f->sb), 3 * CT);
    ferry_kv_req req = FERRY_KV_REQ_INIT;
    for (int k = 0; k < 2; k++) {
        req.skip_tokens = k ? 3 * CT + 1000 : 3 * CT;
        memset(f->dst, 0x6D, IMG);
        assert_int_equal(ferry_kv_retrieve(f->kv, f->tok, 3 * CT, &req, &f->db), 3 * CT);
        ferry_kv_op *op = NULL;
        FT_ASSERT_OK(ferry_kv_retrieve_async(f->kv, f->tok, 3 * CT, &req, &f->db, &op));
        assert_int_equal(ferry_kv_op_wait(op, -1), 3 * CT);
        ferry_kv_op_free(op);
        FT_ASSERT_OK(ferry_kv_retrieve_layers(f->kv, f->tok, 3 * CT, &req, &f->db, NULL, &op));
        assert_int_equal(ferry_kv_op_wait(op, -1), 3 * CT);
        ferry_kv_op_free(op);
        for (size_t i = 0; i < IMG; i++)
            assert_int_equal(f->dst[i], 0x6D);
    }
    /* a layerwise retrieve straddling it: below untouched, above exact */
    req.skip_tokens = CT + 5;
    memset(f->dst, 0x6D, IMG);
    ferry_kv_op *op = NULL;
    FT_ASSERT_OK(ferry_kv_retrieve_layers(f->kv, f->tok, 3 * CT, &req, &f->db, NULL, &op));
    assert_int_equal(ferry_kv_op_wait(op, -1), 3 * CT);
    ferry_kv_op_free(op);
    for (unsigned p = 0; p < 4; p++) {
        const unsigned char *d = f->dst + (size_t)p * NTOK * TB;
        for (size_t i = 0; i < (size_t)(CT + 5) * TB; i++)
            assert_int_equal(d[i], 0x6D);
        assert_memory_equal(d + (size_t)(CT + 5) * TB, f->src + ((size_t)p * NTOK + CT + 5) * TB,
                            (size_t)(2 * CT - 5) * TB);
    }
}

/* a request smaller than the first version's: -EINVAL naming it */
static void request_too_small_refused(void **state)
{
    fx *f = *state;
    ferry_kv_req req = FERRY_KV_REQ_INIT;
    req.size = FERRY_KV_REQ_MIN_SIZE - 1;
    assert_int_equal(ferry_kv_lookup(f->kv, f->tok, CT, &req), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "request"));
    assert_int_equal(ferry_kv_store(f->kv, f->tok, CT, &req, &f->sb), -EINVAL);
    assert_int_equal(ferry_kv_lookup(f->kv, f->tok, CT, NULL), 0);
    ferry_kv_op *op = NULL;
    assert_int_equal(ferry_kv_retrieve_async(f->kv, f->tok, CT, &req, &f->db, &op), -EINVAL);
    assert_null(op);
}

/* through a server a pin is the connection's: another client's delete
 * leaves the chunk (FERRY_ELOCKED), and the pin ends with its store's
 * close (server only) */
static void pins_end_with_their_connection(void **state)
{
    fx *f = *state;
    ferry_kv *other = ft_kv_daemon_client(&f->d, config());
    assert_int_equal(ferry_kv_store(f->kv, f->tok, 2 * CT, NULL, &f->sb), 2 * CT);
    assert_int_equal(ferry_kv_pin(other, f->tok, 2 * CT, NULL), 2 * CT);
    assert_int_equal(ferry_kv_delete(f->kv, f->tok, 2 * CT, NULL), FERRY_ELOCKED);
    assert_int_equal(ferry_kv_unpin(f->kv, f->tok, 2 * CT, NULL), 0); /* not its pins */
    assert_int_equal(ferry_kv_delete(f->kv, f->tok, 2 * CT, NULL), FERRY_ELOCKED);
    assert_int_equal(ferry_kv_retrieve(f->kv, f->tok, 2 * CT, NULL, &f->db), 2 * CT);
    assert_true(same_chunk(f->src, f->dst, 1));
    ferry_kv_close(other);
    /* the daemon lets go of the connection's pins once it sees it close
     * (a pin at a time: a delete between two deletes the one let go and
     * answers FERRY_ELOCKED for the other, so the last delete may find
     * one chunk left); then both are gone */
    int rc = FERRY_ELOCKED;
    for (int k = 0; k < 200 && rc == FERRY_ELOCKED; k++) {
        rc = ferry_kv_delete(f->kv, f->tok, 2 * CT, NULL);
        if (rc == FERRY_ELOCKED)
            usleep(10000);
    }
    assert_true(rc == 1 || rc == 2);
    assert_int_equal(ferry_kv_lookup(f->kv, f->tok, 2 * CT, NULL), 0);
}

/* ---- stats and metrics ---- */

/* stats_get writes only out->size bytes, leaves size as set; NULL or a
 * size of 0 are -EINVAL; the call counters move by one a call */
static void stats_honour_size_and_count_calls(void **state)
{
    fx *f = *state;
    assert_int_equal(ferry_kv_stats_get(f->kv, NULL), -EINVAL);
    ferry_kv_stats s;
    memset(&s, 0xAB, sizeof s);
    s.size = 0;
    assert_int_equal(ferry_kv_stats_get(f->kv, &s), -EINVAL);
    assert_int_equal(ferry_kv_stats_get(NULL, &s), -EINVAL);
    ferry_kv_stats a = FERRY_KV_STATS_INIT, b = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(f->kv, &a));
    assert_int_equal(ferry_kv_store(f->kv, f->tok, 2 * CT, NULL, &f->sb), 2 * CT);
    assert_int_equal(ferry_kv_lookup(f->kv, f->tok, 3 * CT, NULL), 2 * CT);
    assert_int_equal(ferry_kv_retrieve(f->kv, f->tok, 3 * CT, NULL, &f->db), 2 * CT);
    FT_ASSERT_OK(ferry_kv_stats_get(f->kv, &b));
    assert_int_equal(b.size, sizeof b);
    /* the call counters: a daemon sees chunks, not its clients' calls, so
     * a client counts its own (kv.h, ferry_kv_stats.stores) */
    assert_int_equal(b.stores - a.stores, 1);
    assert_int_equal(b.stored_chunks - a.stored_chunks, 2);
    assert_int_equal(b.stored_bytes - a.stored_bytes, 2 * ferry_kv_chunk_bytes(f->kv));
    assert_int_equal(b.lookups - a.lookups, 1);
    assert_int_equal(b.lookup_tokens - a.lookup_tokens, 3 * CT);
    assert_int_equal(b.hit_tokens - a.hit_tokens, 2 * CT);
    assert_int_equal(b.retrieves - a.retrieves, 1);
    uint64_t ns_store = 0, ns_retrieve = 0;
    for (int i = 0; i < FERRY_KV_HIST_BUCKETS; i++) {
        ns_store += b.store_ns[i] - a.store_ns[i];
        ns_retrieve += b.retrieve_ns[i] - a.retrieve_ns[i];
    }
    assert_int_equal(ns_store, 1);
    assert_int_equal(ns_retrieve, 1);
    assert_int_equal(b.retrieved_chunks - a.retrieved_chunks, 2);
    assert_int_equal(b.misses - a.misses, 1);
    assert_int_equal(b.chunks, 2);
    /* an older header's struct: the bytes past its size untouched */
    memset(&s, 0xAB, sizeof s);
    s.size = offsetof(ferry_kv_stats, stores);
    FT_ASSERT_OK(ferry_kv_stats_get(f->kv, &s));
    assert_int_equal(s.size, offsetof(ferry_kv_stats, stores));
    assert_int_equal(s.lookups, b.lookups);
    const unsigned char *p = (const unsigned char *)&s;
    for (size_t i = offsetof(ferry_kv_stats, stores); i < sizeof s; i++)
        assert_int_equal(p[i], 0xAB);
    assert_true(ferry_kv_hist_quantile(b.lookup_ns, 0.5) > 0);
    uint64_t empty[FERRY_KV_HIST_BUCKETS] = {0};
    assert_true(ferry_kv_hist_quantile(empty, 0.99) == 0.0);
}

/* the Prometheus text is sized like snprintf: the whole length whatever
 * len, NUL-terminated within len */
static void prometheus_sizes_like_snprintf(void **state)
{
    fx *f = *state;
    int need = ferry_kv_metrics_prometheus(f->kv, NULL, 0);
    assert_true(need > 0);
    char *buf = malloc((size_t)need + 16);
    assert_non_null(buf);
    memset(buf, 'x', (size_t)need + 16);
    assert_int_equal(ferry_kv_metrics_prometheus(f->kv, buf, (size_t)need + 1), need);
    assert_int_equal(strlen(buf), need);
    assert_non_null(strstr(buf, "ferry_kv_"));
    memset(buf, 'x', (size_t)need + 16);
    assert_int_equal(ferry_kv_metrics_prometheus(f->kv, buf, 10), need);
    assert_int_equal(buf[9], '\0');
    assert_int_equal(buf[10], 'x');
    assert_int_equal(ferry_kv_metrics_prometheus(NULL, buf, 10), -EINVAL);
    free(buf);
}

/* the value of the sample `name` (whole name, labels included) in text */
static double prom_value(const char *text, const char *name)
{
    size_t n = strlen(name);
    for (const char *p = text; (p = strstr(p, name)) != NULL; p += n)
        if ((p == text || p[-1] == '\n') && p[n] == ' ')
            return strtod(p + n + 1, NULL);
    fail_msg("no sample %s", name);
    return 0;
}

/* each latency histogram's _sum and _count describe the same calls: a
 * count of calls whose sum is 0 s (buckets from one snapshot, sum from
 * another) reads as calls that took no time. Through a daemon the
 * lookups are the daemon's, the stores and retrieves the client's own */
static void prometheus_histograms_sum_what_they_count(void **state)
{
    fx *f = *state;
    assert_int_equal(ferry_kv_store(f->kv, f->tok, 2 * CT, NULL, &f->sb), 2 * CT);
    assert_int_equal(ferry_kv_lookup(f->kv, f->tok, 3 * CT, NULL), 2 * CT);
    assert_int_equal(ferry_kv_retrieve(f->kv, f->tok, 3 * CT, NULL, &f->db), 2 * CT);
    int need = ferry_kv_metrics_prometheus(f->kv, NULL, 0);
    assert_true(need > 0);
    char *buf = malloc((size_t)need + 1);
    assert_non_null(buf);
    assert_int_equal(ferry_kv_metrics_prometheus(f->kv, buf, (size_t)need + 1), need);
    static const char *const names[] = {"lookup", "store", "retrieve"};
    for (int i = 0; i < 3; i++) {
        char c[96], sum[96];
        snprintf(c, sizeof c, "ferry_kv_%s_seconds_count", names[i]);
        snprintf(sum, sizeof sum, "ferry_kv_%s_seconds_sum", names[i]);
        double count = prom_value(buf, c), s = prom_value(buf, sum);
        if (count < 1 || !(s > 0))
            fail_msg("%s: %g calls summing to %g s", names[i], count, s);
    }
    free(buf);
}

/* ---- close ---- */

/* after close_begin every call that begins is refused FERRY_ESTATE "the
 * store is closing", touching nothing; an op made before goes on */
static void close_begin_refuses_new_calls(void **state)
{
    fx *f = *state;
    assert_int_equal(ferry_kv_store(f->kv, f->tok, 2 * CT, NULL, &f->sb), 2 * CT);
    ferry_kv_op *op = NULL;
    FT_ASSERT_OK(ferry_kv_store_layers(f->kv, f->tok + 2 * CT, 2 * CT, NULL, &f->sb, NULL, &op));
    ferry_kv_close_begin(f->kv);
    ferry_kv_close_begin(f->kv); /* as often as wanted */
    assert_int_equal(ferry_kv_lookup(f->kv, f->tok, 2 * CT, NULL), FERRY_ESTATE);
    assert_non_null(strstr(ferry_last_error(), "closing"));
    memset(f->dst, 0x17, IMG);
    assert_int_equal(ferry_kv_retrieve(f->kv, f->tok, 2 * CT, NULL, &f->db), FERRY_ESTATE);
    assert_true(chunk_is(f->dst, 0, 0x17));
    assert_int_equal(ferry_kv_store(f->kv, f->tok, 2 * CT, NULL, &f->sb), FERRY_ESTATE);
    assert_int_equal(ferry_kv_flush(f->kv), FERRY_ESTATE);
    ferry_kv_stats s = FERRY_KV_STATS_INIT;
    assert_int_equal(ferry_kv_stats_get(f->kv, &s), FERRY_ESTATE);
    ferry_kv_op *op2 = NULL;
    assert_int_equal(ferry_kv_retrieve_async(f->kv, f->tok, 2 * CT, NULL, &f->db, &op2),
                     FERRY_ESTATE);
    assert_null(op2);
    /* the op made before: its calls go on until the close */
    assert_int_equal(ferry_kv_op_test(op), FERRY_ESTATE); /* layers missing */
    ferry_kv_close(f->kv);
    f->kv = NULL;
    assert_int_equal(ferry_kv_op_wait(op, -1), -ECANCELED);
    assert_int_equal(ferry_kv_op_layer_done(op, 0, NULL), -ECANCELED);
    ferry_kv_op_free(op);
}

#define BOTH(fn)                                                          \
    cmocka_unit_test_setup_teardown(fn, setup_local, teardown),           \
        cmocka_unit_test_setup_teardown(fn, setup_server, teardown)

int main(void)
{
    const struct CMUnitTest tests[] = {
        BOTH(results_stay_within_max_chunks),
        BOTH(retrieve_copies_present_chunks_past_a_hole),
        BOTH(retrieve_into_a_short_buffer_moves_nothing),
        BOTH(device_buffer_without_a_device),
        BOTH(negative_block_id_refused),
        BOTH(last_error_empty_then_names_the_cause),
        BOTH(last_error_copy_outlives_three_calls),
        BOTH(partial_chunk_only_when_asked),
        cmocka_unit_test(hash_chunks_writes_at_most_max),
        BOTH(async_tokens_and_salt_may_be_reused_at_once),
        BOTH(cancel_after_the_end_and_null_handles),
        BOTH(layerwise_store_invisible_and_locked_to_others),
        BOTH(layerwise_misuse),
        BOTH(pins_count_and_delete_spares_the_locked),
        BOTH(prefetch_counts_what_is_in_l1),
        BOTH(skip_past_the_end_writes_nothing),
        BOTH(request_too_small_refused),
        cmocka_unit_test_setup_teardown(pins_end_with_their_connection, setup_server, teardown),
        BOTH(stats_honour_size_and_count_calls),
        BOTH(prometheus_sizes_like_snprintf),
        BOTH(prometheus_histograms_sum_what_they_count),
        BOTH(close_begin_refuses_new_calls),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
