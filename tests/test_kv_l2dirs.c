/*
 * test_kv_l2dirs.c - an L2 over several drives (ferry_kv_config.l2_dirs):
 * the slab is striped across the directories, so chunks land on every one
 * of them; a persistent L2 over two directories is found again, bit for
 * bit, by a reopen with both (and refused, untouched, with another order
 * or one missing); the non-persistent L2 reads back what it striped; the
 * same directory twice, l2_dir with l2_dirs, NULL or empty entries, too
 * many entries are -EINVAL, and a directory another store holds is
 * FERRY_EBUSY, leaving the other directories of the refused store free.
 */
/* ferry-test-labels: concurrent */
/* ferry-test-timeout: 300 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry_test.h"

/* 2 layers x K,V x 256 tokens x 8 heads x 128 bf16: 2 MiB a chunk, two
 * 1 MiB stripe units of a persistent slab, half a unit of the other */
#define CT 256u
#define CHUNK (2u << 20)
#define NCH 8u
#define NTOK (NCH * CT)

static ferry_kv_layout layout(void)
{
    ferry_kv_layout l = FERRY_KV_LAYOUT_INIT;
    l.num_layers = 2;
    l.num_heads = 8;
    l.head_dim = 128;
    return l;
}

static ferry_kv_config config(const char *const *dirs, unsigned n, int persistent)
{
    ferry_kv_config c = FERRY_KV_CONFIG_INIT;
    c.model = "l2dirs-test";
    c.layout = layout();
    c.chunk_tokens = CT;
    c.l1_bytes = 4ull * CHUNK; /* half the chunks: the rest only in L2 */
    c.l2_dirs = dirs;
    c.l2_n_dirs = n;
    c.l2_bytes = 16ull << 20; /* on each directory */
    c.l2_engine = "posix";
    c.l2_persistent = persistent;
    c.workers = 2;
    return c;
}

static int32_t g_tok[NTOK];

static ferry_kv_buffer buffer(void *mem)
{
    ferry_kv_buffer b = FERRY_KV_BUFFER_INIT;
    b.layout = layout();
    b.base = (uint64_t)(uintptr_t)mem;
    b.capacity_tokens = NTOK;
    return b;
}

/* 4 KiB blocks of dir/file that are not all zero */
static uint64_t written_blocks(const char *dir, const char *file)
{
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, file);
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    static uint8_t blk[4096], zero[4096];
    uint64_t n = 0;
    while (fread(blk, 1, sizeof blk, f) == sizeof blk)
        n += memcmp(blk, zero, sizeof blk) != 0;
    fclose(f);
    return n;
}

/* every chunk retrieved from kv into a fresh buffer equals src, each
 * looked up first in tier want (0: any) */
static void all_back(ferry_kv *kv, const uint8_t *src, int want)
{
    uint8_t tiers[NCH];
    ferry_kv_req req = FERRY_KV_REQ_INIT;
    req.tiers = tiers;
    req.max_chunks = NCH;
    assert_int_equal(ferry_kv_lookup(kv, g_tok, NTOK, &req), NTOK);
    for (unsigned i = 0; want && i < NCH; i++)
        assert_int_equal(tiers[i], want);
    uint8_t *dst = calloc(1, (size_t)NCH * CHUNK);
    assert_non_null(dst);
    ferry_kv_buffer b = buffer(dst);
    assert_int_equal(ferry_kv_retrieve(kv, g_tok, NTOK, NULL, &b), NTOK);
    assert_memory_equal(dst, src, (size_t)NCH * CHUNK);
    free(dst);
}

static void persistent_over_two_drives(void **state)
{
    (void)state;
    char d0[256], d1[256];
    ft_tmpdir(d0, sizeof d0);
    ft_tmpdir(d1, sizeof d1);
    const char *dirs[] = {d0, d1}, *swapped[] = {d1, d0};
    uint8_t *src = malloc((size_t)NCH * CHUNK);
    assert_non_null(src);
    ft_fill_pattern(src, (size_t)NCH * CHUNK, 13);
    ferry_kv_buffer b = buffer(src);
    ferry_kv_config c = config(dirs, 2, 1);
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    ferry_kv_stats m = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(kv, &m));
    assert_true(m.tier[FERRY_KV_TIER_L2].capacity_bytes == 32ull << 20); /* 16 MiB each */
    assert_int_equal(ferry_kv_store(kv, g_tok, NTOK, NULL, &b), NTOK);
    FT_ASSERT_OK(ferry_kv_flush(kv));
    assert_true(ferry_kv_sync(kv) >= 0);
    FT_ASSERT_OK(ferry_kv_stats_get(kv, &m));
    assert_int_equal(m.tier[FERRY_KV_TIER_L2].chunks, NCH);
    /* striped in 1 MiB units: every chunk has half its bytes on each drive */
    assert_true(written_blocks(d0, FERRY_PSLAB_FILE) >= NCH * (CHUNK / 2 / 4096));
    assert_true(written_blocks(d1, FERRY_PSLAB_FILE) >= NCH * (CHUNK / 2 / 4096));
    all_back(kv, src, 0);
    ferry_kv_close(kv);

    /* another order, or one drive missing: refused, and nothing changed */
    c = config(swapped, 2, 1);
    assert_int_equal(ferry_kv_open(&c, &kv), FERRY_EMISMATCH);
    assert_non_null(strstr(ferry_last_error(), "another order"));
    c = config(dirs, 1, 1);
    assert_int_equal(ferry_kv_open(&c, &kv), FERRY_EMISMATCH);
    assert_non_null(strstr(ferry_last_error(), "a slab of 2 drives"));

    /* the same two, in order: every chunk from L2, bit for bit */
    c = config(dirs, 2, 1);
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    FT_ASSERT_OK(ferry_kv_stats_get(kv, &m));
    assert_int_equal(m.tier[FERRY_KV_TIER_L2].chunks, NCH);
    all_back(kv, src, FERRY_KV_TIER_L2);
    ferry_kv_close(kv);
    free(src);
    ft_rmtree(d0);
    ft_rmtree(d1);
}

/* four threads retrieving from a reopened persistent L2 over two drives at
 * once (its reads share one engine, an L1 of half the prompt): every chunk
 * a thread gets is bit for bit the stored one, every other is a miss whose
 * bytes it never saw */
typedef struct reader {
    ferry_kv *kv;
    const uint8_t *src;
    unsigned got, bad;
} reader;

/* the buffer is [layer][K/V][token][...]: chunk i's bytes are a run of
 * CT tokens in each of the 4 planes; 1 when every run of chunk i in got
 * equals want's, or (want NULL) when every byte is 0xEE or 0 */
#define PLANES 4u
#define PLANE ((size_t)NCH * CHUNK / PLANES)
#define RUN ((size_t)CHUNK / PLANES)

static int chunk_is(const uint8_t *got, const uint8_t *want, unsigned i)
{
    for (unsigned p = 0; p < PLANES; p++) {
        const uint8_t *g = got + p * PLANE + i * RUN;
        if (want && memcmp(g, want + p * PLANE + i * RUN, RUN))
            return 0;
        for (size_t x = 0; !want && x < RUN; x++)
            if (g[x] != 0xEE && g[x] != 0)
                return 0;
    }
    return 1;
}

static void *read_all(void *arg)
{
    reader *r = arg;
    uint8_t *dst = malloc((size_t)NCH * CHUNK);
    int st[NCH];
    for (int round = 0; dst && round < 3; round++) {
        memset(dst, 0xEE, (size_t)NCH * CHUNK);
        ferry_kv_req req = FERRY_KV_REQ_INIT;
        req.status = st;
        req.max_chunks = NCH;
        ferry_kv_buffer b = buffer(dst);
        r->bad += ferry_kv_retrieve(r->kv, g_tok, NTOK, &req, &b) < 0;
        for (unsigned i = 0; i < NCH; i++) {
            /* a miss is untouched, or zeroed (kv.h): never bytes */
            r->got += st[i] == 0;
            r->bad += !chunk_is(dst, st[i] == 0 ? r->src : NULL, i);
        }
    }
    free(dst);
    return NULL;
}

static void persistent_retrieves_at_once(void **state)
{
    (void)state;
    char d0[256], d1[256];
    ft_tmpdir(d0, sizeof d0);
    ft_tmpdir(d1, sizeof d1);
    const char *dirs[] = {d0, d1};
    uint8_t *src = malloc((size_t)NCH * CHUNK);
    assert_non_null(src);
    ft_fill_pattern(src, (size_t)NCH * CHUNK, 29);
    ferry_kv_buffer b = buffer(src);
    ferry_kv_config c = config(dirs, 2, 1);
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    assert_int_equal(ferry_kv_store(kv, g_tok, NTOK, NULL, &b), NTOK);
    FT_ASSERT_OK(ferry_kv_flush(kv));
    assert_true(ferry_kv_sync(kv) >= 0);
    ferry_kv_close(kv);
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    reader r[4];
    pthread_t th[4];
    for (int i = 0; i < 4; i++) {
        r[i] = (reader){kv, src, 0, 0};
        assert_int_equal(pthread_create(&th[i], NULL, read_all, &r[i]), 0);
    }
    unsigned got = 0;
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        assert_int_equal(r[i].bad, 0);
        got += r[i].got;
    }
    print_message("%u of %u chunks retrieved by 4 threads at once\n", got, 4 * 3 * NCH);
    assert_true(got >= NCH);
    /* and alone, afterwards: all of them, bit for bit */
    all_back(kv, src, 0);
    ferry_kv_close(kv);
    free(src);
    ft_rmtree(d0);
    ft_rmtree(d1);
}

static void striped_without_persistence(void **state)
{
    (void)state;
    char d0[256], d1[256], d2[256];
    ft_tmpdir(d0, sizeof d0);
    ft_tmpdir(d1, sizeof d1);
    ft_tmpdir(d2, sizeof d2);
    const char *dirs[] = {d0, d1, d2};
    uint8_t *src = malloc((size_t)NCH * CHUNK);
    assert_non_null(src);
    ft_fill_pattern(src, (size_t)NCH * CHUNK, 21);
    ferry_kv_buffer b = buffer(src);
    ferry_kv_config c = config(dirs, 3, 0);
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    assert_int_equal(ferry_kv_store(kv, g_tok, NTOK, NULL, &b), NTOK);
    FT_ASSERT_OK(ferry_kv_flush(kv));
    ferry_kv_stats m = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(kv, &m));
    assert_int_equal(m.tier[FERRY_KV_TIER_L2].chunks, NCH);
    assert_true(m.tier[FERRY_KV_TIER_L2].capacity_bytes >= 40ull << 20);
    /* 4 MiB units: 16 MiB of chunks from offset 0 reach all three drives */
    const char *names[] = {d0, d1, d2};
    for (int i = 0; i < 3; i++)
        assert_true(written_blocks(names[i], "ferry_slab.bin") > 0);
    /* half the chunks were evicted from L1: they come back from the stripes */
    all_back(kv, src, 0);
    ferry_kv_close(kv);
    free(src);
    ft_rmtree(d0);
    ft_rmtree(d1);
    ft_rmtree(d2);
}

static void bad_lists_are_refused(void **state)
{
    (void)state;
    char d0[256], d1[256], d2[256];
    ft_tmpdir(d0, sizeof d0);
    ft_tmpdir(d1, sizeof d1);
    ft_tmpdir(d2, sizeof d2);
    ferry_kv *kv = NULL;
    const char *twice[] = {d0, d1, d0};
    ferry_kv_config c = config(twice, 3, 1);
    assert_int_equal(ferry_kv_open(&c, &kv), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "each drive's directory once"));
    const char *withnull[] = {d0, NULL};
    c = config(withnull, 2, 1);
    assert_int_equal(ferry_kv_open(&c, &kv), -EINVAL);
    const char *empty[] = {d0, ""};
    c = config(empty, 2, 0);
    assert_int_equal(ferry_kv_open(&c, &kv), -EINVAL);
    const char *many[FERRY_KV_L2_DIRS_MAX + 1];
    for (unsigned i = 0; i <= FERRY_KV_L2_DIRS_MAX; i++)
        many[i] = d0;
    c = config(many, FERRY_KV_L2_DIRS_MAX + 1, 1);
    assert_int_equal(ferry_kv_open(&c, &kv), -EINVAL);
    const char *two[] = {d0, d1};
    c = config(two, 2, 1);
    c.l2_dir = d2;
    assert_int_equal(ferry_kv_open(&c, &kv), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "l2_dir and l2_dirs"));
    c = config(NULL, 2, 1);
    assert_int_equal(ferry_kv_open(&c, &kv), -EINVAL);

    /* one directory held by another store: FERRY_EBUSY; the refused
     * store's other directory is left free */
    c = config(two, 2, 1);
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    const char *overlap[] = {d2, d1};
    ferry_kv_config c2 = config(overlap, 2, 1);
    ferry_kv *kv2 = NULL;
    assert_int_equal(ferry_kv_open(&c2, &kv2), FERRY_EBUSY);
    assert_non_null(strstr(ferry_last_error(), d1));
    c2 = config(overlap, 1, 1); /* d2 alone */
    FT_ASSERT_OK(ferry_kv_open(&c2, &kv2));
    ferry_kv_close(kv2);
    ferry_kv_close(kv);
    /* one directory is the same as l2_dir */
    const char *one[] = {d2};
    c = config(one, 1, 1);
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    ferry_kv_close(kv);
    ft_rmtree(d0);
    ft_rmtree(d1);
    ft_rmtree(d2);
}

int main(void)
{
    for (unsigned i = 0; i < NTOK; i++)
        g_tok[i] = (int32_t)(7 + i * 13);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(persistent_over_two_drives),
        cmocka_unit_test(persistent_retrieves_at_once),
        cmocka_unit_test(striped_without_persistence),
        cmocka_unit_test(bad_lists_are_refused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
