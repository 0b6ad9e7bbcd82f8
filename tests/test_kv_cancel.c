/*
 * test_kv_cancel.c - ferry_kv_op_cancel as an engine that aborts a
 * request uses it: after the call returns the engine frees or reuses its
 * buffer at once, so from then on ferry must not write (retrieve) or read
 * (store) it. Whatever moment the cancel lands at (queued, reading L2,
 * copying out), every chunk reported 0 holds exactly its bytes, every
 * chunk reported -ECANCELED left its destination as it was, nothing is
 * written after the call returns, and the store stays consistent.
 */
/* ferry-test-labels: concurrent */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ferry/kv.h"
#include "ferry_test.h"
#include "kv/kv_impl.h"

#define CT 256u        /* tokens per chunk */
#define TB 512u        /* token bytes per plane: 4 layers x 2 planes -> 1 MiB chunks */
#define NCH 48u        /* chunks in a prompt */
#define SENT 0xA5

static ferry_kv_layout layout(void)
{
    ferry_kv_layout l = FERRY_KV_LAYOUT_INIT;
    l.num_layers = 4;
    l.num_heads = 4;
    l.head_dim = TB / 4 / 2;
    return l;
}

static size_t plane_bytes(void)
{
    return (size_t)NCH * CT * TB;
}

static ferry_kv_buffer buffer(void *base)
{
    ferry_kv_buffer b = FERRY_KV_BUFFER_INIT;
    b.layout = layout();
    b.base = (uintptr_t)base;
    b.capacity_tokens = (uint64_t)NCH * CT;
    return b;
}

static ferry_kv *open_store(const char *dir, unsigned workers)
{
    ferry_kv_config c = FERRY_KV_CONFIG_INIT;
    c.model = "cancel";
    c.layout = layout();
    c.chunk_tokens = CT;
    uint64_t cb = 0;
    FT_ASSERT_OK(ferry_kv_layout_chunk_bytes(&c.layout, CT, &cb));
    c.l1_bytes = 12 * cb; /* smaller than a prompt: L2 reads stream through it */
    c.l2_dir = dir;
    c.l2_bytes = 2 * NCH * cb;
    c.l2_direct = 0;
    c.workers = workers;
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    return kv;
}

static void sleep_us(long us)
{
    struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
    nanosleep(&ts, NULL);
}

/* chunk i's bytes in a contiguous buffer: each of its 8 planes */
static int chunk_is(const unsigned char *buf, size_t i, const unsigned char *want, int sentinel)
{
    size_t run = (size_t)CT * TB;
    for (size_t p = 0; p < 8; p++) {
        const unsigned char *got = buf + p * plane_bytes() + i * run;
        if (sentinel) {
            for (size_t k = 0; k < run; k++)
                if (got[k] != SENT)
                    return 0;
        } else if (memcmp(got, want + p * plane_bytes() + i * run, run) != 0) {
            return 0;
        }
    }
    return 1;
}

static void retrieve_cancelled_at_any_moment_writes_nothing_after(void **state)
{
    (void)state;
    char dir[256];
    ft_tmpdir(dir, sizeof dir);
    ferry_kv *kv = open_store(dir, 1);
    size_t bytes = 8 * plane_bytes();
    unsigned char *src = malloc(bytes), *dst = malloc(bytes), *snap = malloc(bytes);
    assert_non_null(src);
    assert_non_null(dst);
    assert_non_null(snap);
    ft_fill_pattern(src, bytes, 9);
    int32_t *tok = malloc(sizeof(int32_t) * NCH * CT);
    for (size_t t = 0; t < (size_t)NCH * CT; t++)
        tok[t] = (int32_t)(t * 5 + 2);
    ferry_kv_buffer sb = buffer(src), db = buffer(dst);
    assert_int_equal(ferry_kv_store(kv, tok, (size_t)NCH * CT, NULL, &sb), NCH * CT);
    FT_ASSERT_OK(ferry_kv_flush(kv)); /* every chunk in L2; most left L1 */
    int cancelled = 0, queued_cancels = 0, partial_cancels = 0;
    static const long delays[] = {0, 0, 200, 1000, 2000, 4000, 8000, 15000, 30000, 60000};
    for (size_t d = 0; d < 2 * sizeof delays / sizeof delays[0]; d++) {
        /* even rounds: our op waits behind another (cancelled while queued);
         * odd rounds: it runs at once (cancelled while reading and copying) */
        int behind = d % 2 == 0;
        long delay = delays[d / 2];
        memset(dst, SENT, bytes);
        int st[NCH], st2[NCH];
        ferry_kv_req rq = FERRY_KV_REQ_INIT, rq2 = FERRY_KV_REQ_INIT;
        rq.status = st;
        rq.max_chunks = NCH;
        rq2.status = st2;
        rq2.max_chunks = NCH;
        /* one worker: a first retrieve ahead of ours keeps ours queued for a while */
        unsigned char *other = malloc(bytes);
        assert_non_null(other);
        ferry_kv_buffer ob = buffer(other);
        ferry_kv_op *first = NULL, *op = NULL;
        if (behind)
            FT_ASSERT_OK(ferry_kv_retrieve_async(kv, tok, (size_t)NCH * CT, &rq2, &ob, &first));
        FT_ASSERT_OK(ferry_kv_retrieve_async(kv, tok, (size_t)NCH * CT, &rq, &db, &op));
        sleep_us(delay);
        int rc = ferry_kv_op_cancel(op);
        memcpy(snap, dst, bytes);
        if (rc == -ECANCELED) {
            cancelled++;
            int moved = 0;
            for (size_t i = 0; i < NCH; i++) {
                if (st[i] == 0) {
                    moved++;
                    assert_true(chunk_is(dst, i, src, 0)); /* exactly its bytes */
                } else {
                    assert_int_equal(st[i], -ECANCELED);
                    assert_true(chunk_is(dst, i, NULL, 1)); /* untouched */
                }
            }
            queued_cancels += moved == 0;
            partial_cancels += moved > 0;
            if (getenv("FT_CANCEL_DEBUG"))
                fprintf(stderr, "delay %ld%s: moved %d of %u\n", delay, behind ? " behind" : "",
                        moved, NCH);
        } else {
            assert_int_equal(rc, NCH * CT); /* it was done: all of it, exactly */
            assert_memory_equal(dst, src, bytes);
        }
        sleep_us(20000); /* nothing lands in dst after the cancel returned */
        assert_memory_equal(dst, snap, bytes);
        if (first) {
            assert_int_equal(ferry_kv_op_wait(first, -1), NCH * CT);
            assert_memory_equal(other, src, bytes);
            ferry_kv_op_free(first);
        }
        ferry_kv_op_free(op);
        free(other);
        FT_ASSERT_OK(ferry__kv_check(kv));
    }
    assert_true(cancelled > 0);
    assert_true(queued_cancels > 0); /* at least once it was stopped before it moved anything */
    if (getenv("FT_CANCEL_DEBUG"))
        fprintf(stderr, "cancels: %d queued, %d part way\n", queued_cancels, partial_cancels);
    /* and the store still serves every chunk, bit for bit */
    memset(dst, 0, bytes);
    assert_int_equal(ferry_kv_retrieve(kv, tok, (size_t)NCH * CT, NULL, &db), NCH * CT);
    assert_memory_equal(dst, src, bytes);
    /* cancelling a finished op changes nothing; NULL is refused */
    ferry_kv_op *op = NULL;
    FT_ASSERT_OK(ferry_kv_retrieve_async(kv, tok, CT, NULL, &db, &op));
    assert_int_equal(ferry_kv_op_wait(op, -1), CT);
    assert_int_equal(ferry_kv_op_cancel(op), CT);
    ferry_kv_op_free(op);
    assert_int_equal(ferry_kv_op_cancel(NULL), -EINVAL);
    ferry_kv_close(kv);
    free(src);
    free(dst);
    free(snap);
    free(tok);
    ft_rmtree(dir);
}

static void store_cancelled_keeps_only_whole_chunks(void **state)
{
    (void)state;
    char dir[256];
    ft_tmpdir(dir, sizeof dir);
    ferry_kv *kv = open_store(dir, 1);
    size_t bytes = 8 * plane_bytes();
    unsigned char *src = malloc(bytes), *back = malloc(bytes);
    assert_non_null(src);
    assert_non_null(back);
    int32_t *tok = malloc(sizeof(int32_t) * NCH * CT);
    int cancelled = 0;
    for (unsigned round = 0; round < 6; round++) {
        ft_fill_pattern(src, bytes, 40 + round);
        for (size_t t = 0; t < (size_t)NCH * CT; t++)
            tok[t] = (int32_t)(t * 7 + round * 1000003u);
        ferry_kv_buffer sb = buffer(src), bb = buffer(back);
        int st[NCH];
        ferry_kv_req rq = FERRY_KV_REQ_INIT;
        rq.status = st;
        rq.max_chunks = NCH;
        ferry_kv_op *op = NULL;
        FT_ASSERT_OK(ferry_kv_store_async(kv, tok, (size_t)NCH * CT, &rq, &sb, &op));
        sleep_us(round * 2000);
        int rc = ferry_kv_op_cancel(op);
        ferry_kv_op_free(op);
        unsigned char *keep = malloc(bytes);
        assert_non_null(keep);
        memcpy(keep, src, bytes);
        memset(src, 0, bytes); /* the engine reuses its buffer at once */
        FT_ASSERT_OK(ferry_kv_flush(kv));
        size_t stored = 0;
        if (rc == -ECANCELED) {
            cancelled++;
            while (stored < NCH && st[stored] == 0)
                stored++;
            for (size_t i = stored; i < NCH; i++)
                assert_int_equal(st[i], -ECANCELED);
        } else {
            assert_int_equal(rc, NCH * CT);
            stored = NCH;
        }
        /* what it stored is whole and exact; nothing after it is visible */
        assert_int_equal(ferry_kv_lookup(kv, tok, (size_t)NCH * CT, NULL), (int)(stored * CT));
        if (stored) {
            memset(back, 0, bytes);
            assert_int_equal(ferry_kv_retrieve(kv, tok, stored * CT, NULL, &bb),
                             (int)(stored * CT));
            for (size_t i = 0; i < stored; i++)
                assert_true(chunk_is(back, i, keep, 0));
        }
        free(keep);
        FT_ASSERT_OK(ferry__kv_check(kv));
        ferry_kv_clear(kv);
    }
    assert_true(cancelled > 0);
    ferry_kv_close(kv);
    free(src);
    free(back);
    free(tok);
    ft_rmtree(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(retrieve_cancelled_at_any_moment_writes_nothing_after),
        cmocka_unit_test(store_cancelled_keeps_only_whole_chunks),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
