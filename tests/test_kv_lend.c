/*
 * test_kv_lend.c - a retrieve's copy-outs lent to the operation workers
 * never deadlock the operations' queue.
 *
 * A retrieve into a host buffer hands copy-outs to an idle worker,
 * including the check-and-copy of a chunk that landed from L2, which keeps
 * that chunk "loading" (other retrieves of it wait) until it runs. When
 * the I/O workers are busy (write-throughs) it lends them to an idle
 * operation worker. An asynchronous retrieve queued at that moment must not
 * take the worker first and leave the lent job queued behind it: it may
 * wait for the very chunk the lent job finishes, and the lender for its
 * job. One operation worker, one thread storing, one doing asynchronous
 * retrieves and three doing blocking ones of the same L2 prompts meet that
 * order often (before the fix, 6 runs of 8 deadlocked). A watchdog fails
 * the test with the store's state after a deadline instead of letting it
 * hang.
 */
/* ferry-test-labels: concurrent */
/* ferry-test-timeout: 600 */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ferry/kv.h"
#include "ferry_test.h"
#include "kv/kv_impl.h"

#define CT 16
#define TB 64
#define PLANES 4u
#define CHUNK (PLANES * CT * TB)
#define PROMPTS 4
#define PCH 4 /* chunks per prompt */
#define THREADS 4
#define ITERS 300
#define ROUNDS 5
#define DEADLINE_S 60 /* without any retrieve finishing: a deadlock */

static ferry_kv *g_kv;
static int32_t g_tok[PROMPTS][PCH * CT];
static unsigned char *g_src;
static atomic_long g_bad, g_whole;
static atomic_int g_round_over;

static size_t prompt_bytes(void)
{
    return (size_t)PLANES * PCH * CT * TB;
}

static unsigned rnd(unsigned *s)
{
    *s = *s * 1103515245u + 12345u;
    return (*s >> 16) & 0x7fff;
}

static ferry_kv_buffer host_buf(unsigned char *mem)
{
    ferry_kv_buffer b = FERRY_KV_BUFFER_INIT;
    b.layout = ft_kv_layout(TB);
    b.base = (uint64_t)(uintptr_t)mem;
    b.capacity_tokens = PCH * CT;
    return b;
}

/* keeps the I/O workers busy with write-throughs of fresh prompts, so
 * the retrieves lend their copies to the operation worker */
static void *storer(void *arg)
{
    (void)arg;
    unsigned char *mem = calloc(1, prompt_bytes());
    ferry_kv_buffer b = host_buf(mem);
    int32_t tok[PCH * CT];
    for (int it = 0; mem && !atomic_load(&g_round_over); it++) {
        for (int i = 0; i < PCH * CT; i++)
            tok[i] = 1000000 + (it % 4) * 1000 + i;
        int rc = ferry_kv_store(g_kv, tok, PCH * CT, NULL, &b);
        if (rc < 0 && rc != FERRY_ENOSPACE && rc != -ENOMEM)
            atomic_fetch_add(&g_bad, 1);
        rc = ferry_kv_delete(g_kv, tok, PCH * CT, NULL); /* stored again next round */
        if (rc < 0 && rc != FERRY_ELOCKED)
            atomic_fetch_add(&g_bad, 1);
    }
    free(mem);
    return NULL;
}

/* one thread in four retrieves through the single operation worker, the
 * others retrieve blocking (they lend copies); every byte retrieved is
 * checked */
static void *worker(void *arg)
{
    unsigned s = *(unsigned *)arg;
    int async = s % 4 == 0; /* one thread in four: the seeds are 4k + i */
    size_t pb = prompt_bytes();
    unsigned char *mem = malloc(pb);
    ferry_kv_buffer b = host_buf(mem);
    for (int it = 0; mem && it < ITERS; it++) {
        int p = (int)(rnd(&s) % PROMPTS);
        memset(mem, 0, pb);
        int got;
        if (async) {
            usleep(rnd(&s) % 50); /* the worker idles now and then */
            ferry_kv_op *o = NULL;
            got = ferry_kv_retrieve_async(g_kv, g_tok[p], PCH * CT, NULL, &b, &o);
            if (got == 0) {
                got = ferry_kv_op_wait(o, -1);
                ferry_kv_op_free(o);
            }
        } else {
            got = ferry_kv_retrieve(g_kv, g_tok[p], PCH * CT, NULL, &b);
        }
        if (got < 0 || got % CT)
            atomic_fetch_add(&g_bad, 1);
        if (got == PCH * CT)
            atomic_fetch_add(&g_whole, 1);
        ft_kv_watchdog_kick();
        /* whole prompt or a prefix: the loaded planes hold the stored bytes */
        for (unsigned pl = 0; got > 0 && pl < PLANES; pl++) {
            size_t off = (size_t)pl * PCH * CT * TB;
            if (memcmp(mem + off, g_src + (size_t)p * pb + off, (size_t)got * TB) != 0) {
                atomic_fetch_add(&g_bad, 1);
                break;
            }
        }
    }
    free(mem);
    return NULL;
}

/* the retrieving threads and the storer, once */
static void run_round(int round)
{
    pthread_t st, th[THREADS];
    unsigned seeds[THREADS];
    atomic_store(&g_round_over, 0);
    assert_int_equal(pthread_create(&st, NULL, storer, NULL), 0);
    for (int i = 0; i < THREADS; i++) {
        seeds[i] = 4u * (11u + (unsigned)i * 7919u + (unsigned)round * 104729u) + (unsigned)i;
        assert_int_equal(pthread_create(&th[i], NULL, worker, &seeds[i]), 0);
    }
    for (int i = 0; i < THREADS; i++)
        pthread_join(th[i], NULL);
    atomic_store(&g_round_over, 1);
    pthread_join(st, NULL);
}

static void retrieves_lending_to_one_operation_worker_finish(void **state)
{
    (void)state;
    char dir[256] = "";
    ft_tmpdir(dir, sizeof dir);
    ferry_kv_config c = FERRY_KV_CONFIG_INIT;
    c.model = "lend";
    c.layout = ft_kv_layout(TB);
    c.chunk_tokens = CT;
    c.l1_bytes = 8 * CHUNK;
    c.workers = 1;
    c.l2_dir = dir;
    c.l2_bytes = 4 * PROMPTS * PCH * CHUNK;
    c.l2_engine = "posix";
    FT_ASSERT_OK(ferry_kv_open(&c, &g_kv));
    ferry__kv_set_handoff_min(g_kv, 0); /* these 4 KiB chunks too: the hand-off is the test */
    size_t pb = prompt_bytes();
    g_src = malloc((size_t)PROMPTS * pb);
    assert_non_null(g_src);
    for (size_t i = 0; i < (size_t)PROMPTS * pb; i++)
        g_src[i] = (unsigned char)((i * 131 + 7) ^ (i >> 11));
    for (int p = 0; p < PROMPTS; p++) {
        for (int i = 0; i < PCH * CT; i++)
            g_tok[p][i] = p * 100000 + i * 7 + 3;
        ferry_kv_buffer b = host_buf(g_src + (size_t)p * pb);
        assert_int_equal(ferry_kv_store(g_kv, g_tok[p], PCH * CT, NULL, &b), PCH * CT);
        FT_ASSERT_OK(ferry_kv_flush(g_kv));
    }
    atomic_store(&g_bad, 0);
    atomic_store(&g_whole, 0);
    ft_kv_watchdog_start(g_kv, DEADLINE_S, "test_kv_lend");
    for (int round = 0; round < ROUNDS; round++)
        run_round(round);
    ft_kv_watchdog_stop();
    ferry_kv_stats m = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(g_kv, &m));
    assert_int_equal(atomic_load(&g_bad), 0);
    assert_true(atomic_load(&g_whole) > 0);
    assert_true(m.tier[FERRY_KV_TIER_L2].hits > 0);
    FT_ASSERT_OK(ferry__kv_check(g_kv));
    ferry_kv_close(g_kv);
    g_kv = NULL;
    free(g_src);
    g_src = NULL;
    ft_rmtree(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(retrieves_lending_to_one_operation_worker_finish),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
