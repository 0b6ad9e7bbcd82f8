/*
 * test_pslab_tier.c - the KV store's persistent L2 tier (src/kv/store/tier_pslab.c)
 * through its ops table: slots, durable writes, checked reads, eviction by
 * forget, and the chunks it hands back after a restart.
 */
/* ferry-test-labels: concurrent */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ferry_test.h"
#include "kv/store/store_int.h"
#include "kv/store/tier_pslab.h"
#include "pslab/pslab_impl.h"
#include "pslab/pslab_reader.h"

#define SLOT 8192u

static ferry__kv_tier *tier_open(const char *d, uint64_t slots)
{
    ferry__kv_tier *t = NULL;
    ferry__errbuf eb;
    memset(&eb, 0, sizeof eb);
    FT_ASSERT_OK(ferry__kv_tier_pslab_open(&(ferry__kv_pslab_cfg){.dir = d,
                                                                  .bytes = slots * SLOT,
                                                                  .direct = 1,
                                                                  .slot_bytes = SLOT},
                                           &eb, &t));
    assert_non_null(t);
    return t;
}

static ferry_kv_hash hid(unsigned i)
{
    ferry_kv_hash h = {0x1234567800000000ull + i, 0xfeedface00000000ull ^ i};
    return h;
}

typedef struct seen {
    unsigned n;
    ferry_kv_hash ids[16];
    uint64_t locs[16], lens[16];
} seen;

static int on_chunk(const ferry_kv_hash *id, uint64_t loc, uint64_t len, void *ctx)
{
    seen *s = ctx;
    s->ids[s->n] = *id;
    s->locs[s->n] = loc;
    s->lens[s->n++] = len;
    return 0;
}

static void test_slots_write_read_release(void **state)
{
    (void)state;
    char d[256];
    ft_tmpdir(d, sizeof d);
    ferry__kv_tier *t = tier_open(d, 4);
    assert_int_equal(t->capacity, 4);
    assert_int_equal(t->id, FERRY_KV_TIER_L2);
    uint64_t loc[5];
    for (int i = 0; i < 4; i++)
        FT_ASSERT_OK(t->ops->reserve(t, &loc[i]));
    assert_int_equal(t->ops->reserve(t, &loc[4]), FERRY_ENOSPACE);
    uint8_t *buf = malloc(SLOT), *got = malloc(SLOT);
    for (int i = 0; i < 4; i++) {
        ferry_kv_hash id = hid((unsigned)i);
        ft_fill_pattern(buf, SLOT, (unsigned)i);
        FT_ASSERT_OK(t->ops->write(t, loc[i], &id, buf, SLOT));
    }
    ferry_kv_hash id2 = hid(2);
    FT_ASSERT_OK(t->ops->read(t, loc[2], &id2, got, SLOT));
    assert_int_equal(ft_check_pattern(got, SLOT, 2), -1);
    /* another length under the same id (another layout): a miss */
    assert_int_equal(t->ops->read(t, loc[2], &id2, got, SLOT / 2), FERRY_EMISMATCH);
    assert_int_equal(t->ops->read(t, loc[2], &id2, got, SLOT), FERRY_ENOTFOUND);
    /* eviction: the slot comes back, the chunk is gone */
    ferry_kv_hash id1 = hid(1);
    t->ops->release(t, loc[1]);
    assert_int_equal(t->ops->read(t, loc[1], &id1, got, SLOT), FERRY_ENOTFOUND);
    uint64_t again = 99;
    FT_ASSERT_OK(t->ops->reserve(t, &again));
    assert_int_equal(again, loc[1]);
    assert_null(t->ops->host_ptr(t, loc[0]));
    ferry__kv_tier_free(t);
    free(buf);
    free(got);
    ft_rmtree(d);
}

static void test_restart_hands_back_the_chunks(void **state)
{
    (void)state;
    char d[256];
    ft_tmpdir(d, sizeof d);
    ferry__kv_tier *t = tier_open(d, 8);
    uint8_t *buf = malloc(SLOT), *got = malloc(SLOT);
    uint64_t loc[6];
    for (int i = 0; i < 6; i++) {
        FT_ASSERT_OK(t->ops->reserve(t, &loc[i]));
        ferry_kv_hash id = hid((unsigned)i);
        ft_fill_pattern(buf, SLOT, 100 + (unsigned)i);
        FT_ASSERT_OK(t->ops->write(t, loc[i], &id, buf, SLOT - (size_t)i * 512));
    }
    t->ops->release(t, loc[0]);
    t->ops->release(t, loc[3]);
    ferry__kv_tier_free(t);

    t = tier_open(d, 8);
    seen s;
    memset(&s, 0, sizeof s);
    assert_int_equal(ferry__kv_tier_pslab_recover(t, on_chunk, &s), 4);
    assert_int_equal(s.n, 4);
    unsigned mask = 0;
    for (unsigned j = 0; j < s.n; j++) {
        unsigned i = (unsigned)(s.ids[j].lo - 0x1234567800000000ull);
        assert_true(i == 1 || i == 2 || i == 4 || i == 5);
        assert_int_equal(s.ids[j].hi, 0xfeedface00000000ull ^ i);
        assert_int_equal(s.lens[j], SLOT - (size_t)i * 512);
        FT_ASSERT_OK(t->ops->read(t, s.locs[j], &s.ids[j], got, s.lens[j]));
        assert_int_equal(ft_check_pattern(got, s.lens[j], 100 + i), -1);
        mask |= 1u << s.locs[j];
    }
    assert_int_equal(__builtin_popcount(mask), 4); /* distinct slots */
    /* the other slots are free, the recovered ones are not */
    uint64_t l;
    for (int i = 0; i < 4; i++) {
        FT_ASSERT_OK(t->ops->reserve(t, &l));
        assert_false(mask & (1u << l));
    }
    assert_int_equal(t->ops->reserve(t, &l), FERRY_ENOSPACE);
    ferry__kv_tier_free(t);
    free(buf);
    free(got);
    ft_rmtree(d);
}

static int stop_after_one(const ferry_kv_hash *id, uint64_t loc, uint64_t len, void *ctx)
{
    (void)id;
    (void)loc;
    (void)len;
    return ++*(int *)ctx == 2 ? 7 : 0;
}

static void test_recover_stopped_forgets_the_rest(void **state)
{
    (void)state;
    char d[256];
    ft_tmpdir(d, sizeof d);
    ferry__kv_tier *t = tier_open(d, 8);
    uint8_t buf[SLOT];
    memset(buf, 3, sizeof buf);
    for (unsigned i = 0; i < 5; i++) {
        uint64_t loc;
        FT_ASSERT_OK(t->ops->reserve(t, &loc));
        ferry_kv_hash id = hid(i);
        FT_ASSERT_OK(t->ops->write(t, loc, &id, buf, sizeof buf));
    }
    ferry__kv_tier_free(t);
    t = tier_open(d, 8);
    int calls = 0;
    assert_int_equal(ferry__kv_tier_pslab_recover(t, stop_after_one, &calls), 7);
    ferry_pslab_stats s = FERRY_PSLAB_STATS_INIT;
    FT_ASSERT_OK(ferry_pslab_stats_get(ferry__kv_tier_pslab_store(t), &s));
    assert_int_equal(s.chunks, 1); /* only the one the store accepted */
    /* 7 slots free: the accepted chunk holds one */
    uint64_t l;
    for (int i = 0; i < 7; i++)
        FT_ASSERT_OK(t->ops->reserve(t, &l));
    assert_int_equal(t->ops->reserve(t, &l), FERRY_ENOSPACE);
    ferry__kv_tier_free(t);
    ft_rmtree(d);
}

static void test_bad_geometry_is_einval(void **state)
{
    (void)state;
    char d[256];
    ft_tmpdir(d, sizeof d);
    ferry__kv_tier *t = NULL;
    ferry__errbuf eb;
    memset(&eb, 0, sizeof eb);
    ferry__kv_pslab_cfg c = {.dir = d, .bytes = 4096, .direct = 1, .slot_bytes = 8192};
    assert_int_equal(ferry__kv_tier_pslab_open(&c, &eb, &t), -EINVAL);
    c.bytes = 1 << 20;
    c.slot_bytes = 1000;
    assert_int_equal(ferry__kv_tier_pslab_open(&c, &eb, &t), -EINVAL);
    assert_null(t);
    ft_rmtree(d);
}

/* copy a file as it is now (what a crash at this moment leaves: the
 * page cache's view, which includes every write made so far) */
static void copy_file(const char *from, const char *to)
{
    FILE *a = fopen(from, "rb"), *b = fopen(to, "wb");
    assert_non_null(a);
    assert_non_null(b);
    char buf[65536];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, a)) > 0)
        assert_int_equal(fwrite(buf, 1, n, b), n);
    fclose(a);
    assert_int_equal(fclose(b), 0);
}

/* the KV store's ferry_kv_sync: everything written through is committed
 * when it returns, with no wait for the batch's size or age */
static void test_kv_sync_commits_the_write_throughs(void **state)
{
    (void)state;
    char d[256], snap[256];
    ft_tmpdir(d, sizeof d);
    ft_tmpdir(snap, sizeof snap);
    /* 2 layers x K,V x 16 tokens x 2 heads x 16 bf16 = 4096 bytes a chunk */
    ferry_kv_layout l = FERRY_KV_LAYOUT_INIT;
    l.num_layers = 2;
    l.num_heads = 2;
    l.head_dim = 16;
    ferry_kv_config c = FERRY_KV_CONFIG_INIT;
    c.model = "sync-test";
    c.layout = l;
    c.chunk_tokens = 16;
    c.l1_bytes = 64 * 4096;
    c.l2_dir = d;
    c.l2_bytes = 64 * 4096;
    c.l2_engine = "posix";
    c.l2_persistent = 1;
    c.workers = 2;
    enum { N = 8 * 16 };
    int32_t tok[N];
    for (int i = 0; i < N; i++)
        tok[i] = 1000 + i * 7;
    uint8_t *mem = malloc(N * 4 * 64);
    assert_non_null(mem);
    ft_fill_pattern(mem, N * 4 * 64, 9);
    ferry_kv_buffer b = FERRY_KV_BUFFER_INIT;
    b.layout = l;
    b.base = (uint64_t)(uintptr_t)mem;
    b.capacity_tokens = N;

    assert_int_equal(ferry_kv_sync(NULL), -EINVAL);
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    ferry_pslab *ps = ferry__kv_tier_pslab_store(kv->tier[FERRY_KV_TIER_L2]);
    assert_non_null(ps);
    assert_int_equal(ferry_kv_store(kv, tok, N, NULL, &b), N);
    FT_ASSERT_OK(ferry_kv_sync(kv));
    ferry_pslab_stats s = FERRY_PSLAB_STATS_INIT;
    FT_ASSERT_OK(ferry_pslab_stats_get(ps, &s));
    assert_int_equal(s.puts, 8);
    assert_int_equal(s.committed_records, 8); /* none left queued */
    assert_true(s.commits >= 1);
    /* the files as they are now, with the store still open: all 8 chunks */
    char from[300], to[300];
    snprintf(from, sizeof from, "%s/%s", d, FERRY_PSLAB_FILE);
    snprintf(to, sizeof to, "%s/%s", snap, FERRY_PSLAB_FILE);
    copy_file(from, to);
    snprintf(from, sizeof from, "%s/%s", d, FERRY_PSLAB_JOURNAL);
    snprintf(to, sizeof to, "%s/%s", snap, FERRY_PSLAB_JOURNAL);
    copy_file(from, to);
    const char *dirs[] = {snap};
    ferry_pslab_options o = FERRY_PSLAB_OPTIONS_INIT;
    o.dirs = dirs;
    o.n_dirs = 1;
    o.flags = FERRY_PSLAB_READONLY;
    ferry_pslab *cp = NULL;
    FT_ASSERT_OK(ferry_pslab_open(&o, &cp));
    ferry_pslab_stats cs = FERRY_PSLAB_STATS_INIT;
    FT_ASSERT_OK(ferry_pslab_stats_get(cp, &cs));
    assert_int_equal(cs.chunks, 8);
    uint64_t bad = 99;
    FT_ASSERT_OK(ferry_pslab_verify(cp, 0, &bad, NULL, NULL));
    assert_int_equal(bad, 0);
    FT_ASSERT_OK(ferry_pslab_close(cp));
    ferry_kv_close(kv);

    /* without a persistent L2 there is nothing more to commit */
    c.l2_persistent = 0;
    c.l2_dir = NULL;
    c.l2_bytes = 0;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    assert_int_equal(ferry_kv_store(kv, tok, N, NULL, &b), N);
    FT_ASSERT_OK(ferry_kv_sync(kv));
    ferry_kv_close(kv);
    free(mem);
    ft_rmtree(d);
    ft_rmtree(snap);
}


/* ---- issue 11, through the public ferry_kv API ---- */
/* 2 layers x K,V x 16 tokens x 2 heads x 16 bf16 = 4096 bytes a chunk */
static ferry_kv_config kv_cfg(const char *dir, const char *model, uint64_t l1_chunks,
                              uint64_t l2_chunks)
{
    ferry_kv_layout l = FERRY_KV_LAYOUT_INIT;
    l.num_layers = 2;
    l.num_heads = 2;
    l.head_dim = 16;
    ferry_kv_config c = FERRY_KV_CONFIG_INIT;
    c.model = model;
    c.layout = l;
    c.chunk_tokens = 16;
    c.l1_bytes = l1_chunks * 4096;
    c.l2_dir = dir;
    c.l2_bytes = l2_chunks * 4096;
    c.l2_engine = "posix";
    c.l2_persistent = 1;
    c.workers = 2;
    return c;
}

/* prompt i: n tokens of its own */
static void prompt(int32_t *tok, size_t n, unsigned i)
{
    for (size_t t = 0; t < n; t++)
        tok[t] = (int32_t)(i * 100003u + (unsigned)t * 7u + 1u);
}

static ferry_kv_buffer kv_buf(const ferry_kv_config *c, void *mem, size_t ntok)
{
    ferry_kv_buffer b = FERRY_KV_BUFFER_INIT;
    b.layout = c->layout;
    b.base = (uint64_t)(uintptr_t)mem;
    b.capacity_tokens = ntok;
    return b;
}

static void test_two_stores_on_one_persistent_l2_are_ebusy(void **state)
{
    (void)state;
    char d[256];
    ft_tmpdir(d, sizeof d);
    ferry_kv_config c = kv_cfg(d, "m", 16, 64);
    ferry_kv *a = NULL, *b = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &a));
    enum { N = 64 };
    int32_t tok[N];
    prompt(tok, N, 1);
    uint8_t *mem = malloc(N * 256), *got = malloc(N * 256);
    ft_fill_pattern(mem, N * 256, 5);
    ferry_kv_buffer src = kv_buf(&c, mem, N);
    assert_int_equal(ferry_kv_store(a, tok, N, NULL, &src), N);
    FT_ASSERT_OK(ferry_kv_flush(a));
    /* rank 1 of the same engine given the same directory: refused */
    ferry_kv_config c1 = c;
    c1.tp_rank = 1;
    c1.tp_world = 2;
    assert_int_equal(ferry_kv_open(&c1, &b), FERRY_EBUSY);
    assert_null(b);
    assert_non_null(strstr(ferry_last_error(), d));
    /* the first store's chunks are untouched */
    ferry_kv_buffer dst = kv_buf(&c, got, N);
    ferry_kv_close(a);
    FT_ASSERT_OK(ferry_kv_open(&c, &a));
    assert_int_equal(ferry_kv_retrieve(a, tok, N, NULL, &dst), N);
    assert_memory_equal(got, mem, N * 256);
    ferry_kv_close(a);
    free(mem);
    free(got);
    ft_rmtree(d);
}

static void test_another_layout_is_refused_and_its_chunks_stay(void **state)
{
    (void)state;
    char d[256];
    ft_tmpdir(d, sizeof d);
    ferry_kv_config c = kv_cfg(d, "m", 16, 128);
    enum { N = 1024 };
    int32_t *tok = malloc(N * sizeof *tok);
    prompt(tok, N, 7);
    uint8_t *mem = malloc((size_t)N * 256), *got = malloc((size_t)N * 256);
    ft_fill_pattern(mem, (size_t)N * 256, 11);
    ferry_kv_buffer src = kv_buf(&c, mem, N);
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    assert_int_equal(ferry_kv_store(kv, tok, N, NULL, &src), N);
    ferry_kv_close(kv);
    /* another layout, chunk size, seed or model: FERRY_EMISMATCH naming it */
    ferry_kv_config o = c;
    o.layout.num_heads = 4;
    assert_int_equal(ferry_kv_open(&o, &kv), FERRY_EMISMATCH);
    assert_non_null(strstr(ferry_last_error(), "heads=4"));
    assert_non_null(strstr(ferry_last_error(), "heads=2"));
    /* and names what differs: only the heads (and the chunk bytes they make) */
    assert_non_null(strstr(ferry_last_error(), "(heads 2 here, 4 asked; chunk_bytes 4096 "
                                               "here, 8192 asked)"));
    o = c;
    o.chunk_tokens = 32;
    assert_int_equal(ferry_kv_open(&o, &kv), FERRY_EMISMATCH);
    o = c;
    o.hash_seed = 12345;
    assert_int_equal(ferry_kv_open(&o, &kv), FERRY_EMISMATCH);
    o = c;
    o.model = "other";
    assert_int_equal(ferry_kv_open(&o, &kv), FERRY_EMISMATCH);
    assert_non_null(strstr(ferry_last_error(), "model=other"));
    /* the original layout still finds every token, byte for byte */
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    assert_int_equal(ferry_kv_lookup(kv, tok, N, NULL), N);
    ferry_kv_buffer dst = kv_buf(&c, got, N);
    assert_int_equal(ferry_kv_retrieve(kv, tok, N, NULL, &dst), N);
    assert_memory_equal(got, mem, (size_t)N * 256);
    ferry_kv_close(kv);
    /* only an explicit reset empties it, for the new layout */
    o = c;
    o.model = "other";
    o.l2_reset = 1;
    FT_ASSERT_OK(ferry_kv_open(&o, &kv));
    assert_int_equal(ferry_kv_lookup(kv, tok, N, NULL), 0);
    ferry_kv_close(kv);
    assert_int_equal(ferry_kv_open(&c, &kv), FERRY_EMISMATCH);
    o.l2_reset = 0;
    FT_ASSERT_OK(ferry_kv_open(&o, &kv));
    ferry_kv_close(kv);
    free(tok);
    free(mem);
    free(got);
    ft_rmtree(d);
}

static void test_persistent_l2_files_are_private_unless_a_mode_is_given(void **state)
{
    (void)state;
    char d[256], sub[300], path[400];
    ft_tmpdir(d, sizeof d);
    mode_t um = umask(0);
    const unsigned modes[2] = {0, 0660}, want[2] = {0600, 0660}, wantd[2] = {0700, 0770};
    for (int m = 0; m < 2; m++) {
        snprintf(sub, sizeof sub, "%s/l2-%d/x", d, m);
        ferry_kv_config c = kv_cfg(sub, "m", 16, 16);
        c.l2_mode = modes[m];
        ferry_kv *kv = NULL;
        FT_ASSERT_OK(ferry_kv_open(&c, &kv));
        ferry_kv_close(kv);
        struct stat st;
        assert_int_equal(stat(sub, &st), 0);
        assert_int_equal(st.st_mode & 0777, wantd[m]);
        const char *names[] = {FERRY_PSLAB_FILE, FERRY_PSLAB_JOURNAL, FERRY_PSLAB_LOCK};
        for (int i = 0; i < 3; i++) {
            snprintf(path, sizeof path, "%s/%s", sub, names[i]);
            assert_int_equal(stat(path, &st), 0);
            assert_int_equal(st.st_mode & 0777, want[m]);
        }
    }
    umask(um);
    ft_rmtree(d);
}

/*
 * Churn without a sync: a persistent L2 of 128 chunks evicted many times
 * over by 400 prompts of 2 chunks; every write-through must find room (the
 * slab commits queued evictions when it is full), and the last 20 prompts
 * must all be there, byte for byte.
 */
static void test_persistent_l2_keeps_caching_under_churn(void **state)
{
    (void)state;
    char d[256];
    ft_tmpdir(d, sizeof d);
    ferry_kv_config c = kv_cfg(d, "churn", 8, 128);
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    enum { P = 400, N = 32 };
    int32_t tok[N];
    uint8_t *mem = malloc(N * 256), *got = malloc(N * 256);
    ferry_kv_buffer src = kv_buf(&c, mem, N), dst = kv_buf(&c, got, N);
    for (unsigned i = 0; i < P; i++) {
        prompt(tok, N, i);
        ft_fill_pattern(mem, N * 256, 1000 + i);
        assert_int_equal(ferry_kv_store(kv, tok, N, NULL, &src), N);
        if (i % 16 == 15)
            FT_ASSERT_OK(ferry_kv_flush(kv)); /* let write-throughs land; no sync */
    }
    FT_ASSERT_OK(ferry_kv_flush(kv));
    ferry_kv_stats ms = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(kv, &ms));
    print_message("L2: %llu failures, usage %.2f\n",
                  (unsigned long long)ms.tier[FERRY_KV_TIER_L2].failures,
                  ms.tier[FERRY_KV_TIER_L2].usage);
    assert_int_equal(ms.tier[FERRY_KV_TIER_L2].failures, 0);
    int found = 0;
    for (unsigned i = P - 20; i < P; i++) {
        prompt(tok, N, i);
        if (ferry_kv_retrieve(kv, tok, N, NULL, &dst) != N)
            continue;
        ft_fill_pattern(mem, N * 256, 1000 + i);
        assert_memory_equal(got, mem, N * 256);
        found++;
    }
    assert_int_equal(found, 20);
    ferry_pslab_stats s = FERRY_PSLAB_STATS_INIT;
    FT_ASSERT_OK(ferry_pslab_stats_get(ferry__kv_tier_pslab_store(kv->tier[FERRY_KV_TIER_L2]),
                                       &s));
    print_message("slab: %llu space commits, %llu failures\n",
                  (unsigned long long)s.space_commits, (unsigned long long)s.failures);
    assert_int_equal(s.failures, 0);
    ferry_kv_close(kv);
    free(mem);
    free(got);
    ft_rmtree(d);
}

static void test_kv_sync_says_how_many_chunks_it_made_durable(void **state)
{
    (void)state;
    char d[256];
    ft_tmpdir(d, sizeof d);
    ferry_kv_config c = kv_cfg(d, "count", 64, 64);
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    enum { N = 8 * 16 };
    int32_t tok[N];
    uint8_t *mem = malloc(N * 256);
    ft_fill_pattern(mem, N * 256, 3);
    ferry_kv_buffer src = kv_buf(&c, mem, N);
    prompt(tok, N, 1);
    assert_int_equal(ferry_kv_store(kv, tok, N, NULL, &src), N);
    assert_int_equal(ferry_kv_sync(kv), 8);
    assert_int_equal(ferry_kv_sync(kv), 0); /* nothing new */
    prompt(tok, N, 2);
    assert_int_equal(ferry_kv_store(kv, tok, 4 * 16, NULL, &src), 4 * 16);
    assert_int_equal(ferry_kv_sync(kv), 4);
    ferry_kv_close(kv);
    /* after a reopen, the recovered chunks are durable already: not counted */
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    assert_int_equal(ferry_kv_sync(kv), 0);
    ferry_kv_close(kv);
    free(mem);
    ft_rmtree(d);
}

/* a layout whose 128 KiB chunk spans eight (kv, layer) runs of 16 KiB
 * (and two 64 KiB blocks, should a read be copied out block by block) */
enum { SK_TB = 1024, SK_PLANES = 8, SK_CHUNK = 128 << 10, SK_CT = 16, SK_CH = 8,
       SK_N = SK_CH * SK_CT };

static ferry_kv_config sink_cfg(const char *dir)
{
    ferry_kv_config c = kv_cfg(dir, "sink", 1, 1);
    c.layout.num_layers = 4;
    c.layout.num_heads = 8;
    c.layout.head_dim = 64;
    c.l1_bytes = 4 * (uint64_t)SK_CHUNK; /* half the prompt: read ahead, evicted */
    c.l2_bytes = 32 * (uint64_t)SK_CHUNK;
    return c;
}

/* the slab file offset (a multiple of 4096) of the first run of n bytes
 * equal to want: where a chunk's image starts, found by its first token */
static off_t slab_find(const char *dir, const uint8_t *want, size_t n)
{
    char path[400];
    snprintf(path, sizeof path, "%s/%s", dir, FERRY_PSLAB_FILE);
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    uint8_t *blk = malloc(n);
    off_t at = -1;
    for (off_t o = 0; at < 0 && fseeko(f, o, SEEK_SET) == 0 && fread(blk, 1, n, f) == n;
         o += 4096)
        if (!memcmp(blk, want, n))
            at = o;
    fclose(f);
    free(blk);
    assert_true(at >= 0);
    return at;
}

/* the slab file offset of chunk k's image (its first plane's first token) */
static off_t image_at(const char *dir, const uint8_t *mem, size_t k)
{
    return slab_find(dir, mem + k * SK_CT * SK_TB, SK_TB);
}

/* a sink store's prompt, stored and synced into its persistent L2, the
 * store closed again: its directory, config, tokens and bytes, and a
 * buffer of the same size to retrieve into */
typedef struct sink {
    char d[256];
    ferry_kv_config c;
    int32_t tok[SK_N];
    uint8_t *mem, *got;
    size_t bytes;
} sink;

static void sink_stored(sink *s, unsigned seed, uint64_t l1_chunks)
{
    ft_tmpdir(s->d, sizeof s->d);
    s->c = sink_cfg(s->d);
    if (l1_chunks) {
        s->c.l1_bytes = l1_chunks * SK_CHUNK;
        s->c.prefetch_max_bytes = l1_chunks * SK_CHUNK;
    }
    s->bytes = (size_t)SK_PLANES * SK_N * SK_TB;
    s->mem = malloc(s->bytes);
    s->got = malloc(s->bytes);
    assert_true(s->mem && s->got);
    prompt(s->tok, SK_N, seed);
    ft_fill_pattern(s->mem, s->bytes, seed * 10 + 1);
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&s->c, &kv));
    ferry_kv_buffer src = kv_buf(&s->c, s->mem, SK_N);
    assert_int_equal(ferry_kv_store(kv, s->tok, SK_N, NULL, &src), SK_N);
    FT_ASSERT_OK(ferry_kv_flush(kv));
    assert_int_equal(ferry_kv_sync(kv), SK_CH);
    ferry_kv_close(kv);
}

static void sink_free(sink *s)
{
    free(s->mem);
    free(s->got);
    ft_rmtree(s->d);
}

/* the prompt retrieved from kv into got (0xEE before), chunk statuses in st */
static int sink_retrieve(sink *s, ferry_kv *kv, int *st)
{
    ferry_kv_req r = FERRY_KV_REQ_INIT;
    r.status = st;
    r.max_chunks = SK_CH;
    memset(s->got, 0xEE, s->bytes);
    ferry_kv_buffer dst = kv_buf(&s->c, s->got, SK_N);
    return ferry_kv_retrieve(kv, s->tok, SK_N, &r, &dst);
}

/* what a missed chunk's tokens may hold */
enum { MISS_ANY, MISS_UNTOUCHED, MISS_UNTOUCHED_OR_ZEROED };

/* every chunk of got but miss holds the stored bytes; chunk miss's tokens
 * hold what `held` allows (in each plane all untouched, or all zeros) */
static void sink_check(const sink *s, unsigned miss, int held)
{
    for (unsigned i = 0; i < SK_CH; i++)
        for (unsigned p = 0; p < SK_PLANES; p++) {
            size_t at = (size_t)p * SK_N * SK_TB + (size_t)i * SK_CT * SK_TB;
            if (i != miss) {
                assert_memory_equal(s->got + at, s->mem + at, (size_t)SK_CT * SK_TB);
                continue;
            }
            if (held == MISS_ANY)
                continue;
            uint8_t first = s->got[at];
            assert_true(first == 0xEE || (held == MISS_UNTOUCHED_OR_ZEROED && first == 0));
            for (size_t x = 0; x < (size_t)SK_CT * SK_TB; x++)
                assert_int_equal(s->got[at + x], first);
        }
}

/* change bytes of chunk k's image on disk, behind the store's back: n
 * bytes of b at offset off into its first plane's run */
static void sink_damage(const sink *s, unsigned k, off_t off, uint8_t b, size_t n)
{
    char path[400];
    snprintf(path, sizeof path, "%s/%s", s->d, FERRY_PSLAB_FILE);
    int fd = open(path, O_WRONLY);
    assert_true(fd >= 0);
    uint8_t junk[128];
    assert_true(n <= sizeof junk);
    memset(junk, b, n);
    assert_int_equal(pwrite(fd, junk, n, image_at(s->d, s->mem, k) + off), (ssize_t)n);
    assert_int_equal(fsync(fd), 0);
    close(fd);
}

/* one retrieve of the whole prompt from a reopened store (L1 empty) into
 * a buffer of 0xEE bytes: its result, with every chunk's status */
static int cold_retrieve(const ferry_kv_config *c, const int32_t *tok, uint8_t *got, int *st,
                         ferry_kv_stats *m)
{
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(c, &kv));
    memset(got, 0xEE, (size_t)SK_PLANES * SK_N * SK_TB);
    ferry_kv_buffer dst = kv_buf(c, got, SK_N);
    ferry_kv_req r = FERRY_KV_REQ_INIT;
    r.status = st;
    r.max_chunks = SK_CH;
    int rc = ferry_kv_retrieve(kv, tok, SK_N, &r, &dst);
    FT_ASSERT_OK(ferry_kv_flush(kv));
    FT_ASSERT_OK(ferry_kv_stats_get(kv, m));
    ferry_kv_close(kv);
    return rc;
}

/* a retrieve from a reopened store reads its chunks ahead from the
 * persistent L2: a chunk whose last block was changed on disk is a miss
 * whose tokens are untouched or zeroed (never its bytes, good or bad),
 * every other chunk byte-exact */
static void test_persistent_l2_corrupt_chunk_read_ahead_is_a_miss(void **state)
{
    (void)state;
    sink s;
    sink_stored(&s, 7, 0);
    int st[SK_CH];
    ferry_kv_stats m = FERRY_KV_STATS_INIT;
    assert_int_equal(cold_retrieve(&s.c, s.tok, s.got, st, &m), SK_N);
    assert_memory_equal(s.got, s.mem, s.bytes);
    assert_int_equal(m.tier[FERRY_KV_TIER_L2].hits, SK_CH);
    assert_int_equal(m.retrieved_chunks, SK_CH);
    /* chunk 5's last block, changed behind the store's back */
    sink_damage(&s, 5, SK_CHUNK - 4096, 0x5A, 100);
    m = (ferry_kv_stats)FERRY_KV_STATS_INIT;
    assert_int_equal(cold_retrieve(&s.c, s.tok, s.got, st, &m), 5 * SK_CT);
    for (int i = 0; i < SK_CH; i++)
        if (i == 5)
            assert_true(st[i] == FERRY_ENOTFOUND || st[i] == FERRY_ECORRUPT);
        else
            assert_int_equal(st[i], 0);
    assert_int_equal(m.corrupt_chunks, 1);
    assert_int_equal(m.retrieved_chunks, SK_CH - 1);
    print_message("chunk 5 left as 0x%02x\n", s.got[5 * SK_CT * SK_TB]);
    /* chunk 5: untouched, or all zeros (copied out, then failed) */
    sink_check(&s, 5, MISS_UNTOUCHED_OR_ZEROED);
    sink_free(&s);
}

/* a prefetch from a reopened store reads its chunks from the persistent
 * L2 as one stream and promotes each once checked: with a chunk changed on
 * disk, that one is dropped (counted corrupt) and every other lands in L1
 * byte-exact */
static void test_persistent_l2_prefetch_checks_each_chunk(void **state)
{
    (void)state;
    sink s;
    sink_stored(&s, 9, SK_CH); /* room in L1 (and the prefetch budget) for all of them */
    /* chunk 2's first block, changed behind the store's back */
    sink_damage(&s, 2, 0, 0xA5, 64);
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&s.c, &kv));
    assert_int_equal(ferry_kv_prefetch(kv, s.tok, SK_N, NULL), SK_N);
    FT_ASSERT_OK(ferry_kv_flush(kv));
    ferry_kv_stats m = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(kv, &m));
    assert_int_equal(m.prefetched_chunks, SK_CH - 1);
    assert_int_equal(m.corrupt_chunks, 1);
    uint8_t tiers[SK_CH];
    ferry_kv_req r = FERRY_KV_REQ_INIT;
    r.tiers = tiers;
    r.max_chunks = SK_CH;
    assert_int_equal(ferry_kv_lookup(kv, s.tok, SK_N, &r), 2 * SK_CT);
    assert_int_equal(tiers[0], FERRY_KV_TIER_L1);
    assert_int_equal(tiers[1], FERRY_KV_TIER_L1);
    int st[SK_CH];
    assert_int_equal(sink_retrieve(&s, kv, st), 2 * SK_CT);
    FT_ASSERT_OK(ferry_kv_stats_get(kv, &m));
    assert_int_equal(m.tier[FERRY_KV_TIER_L2].hits, 0); /* all from L1 */
    sink_check(&s, 2, MISS_ANY);
    assert_int_equal(st[2], FERRY_ENOTFOUND);
    ferry_kv_close(kv);
    sink_free(&s);
}

/* the third chunk read from the persistent L2 fails (the tier's fault
 * seam): that one chunk is a miss whose tokens are untouched, its L2 copy
 * is dropped, every other chunk is byte-exact */
static void test_persistent_l2_failed_read_is_one_miss(void **state)
{
    (void)state;
    sink s;
    sink_stored(&s, 11, 0);
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&s.c, &kv));
    ferry__kv_tier *l2 = kv->tier[FERRY_KV_TIER_L2];
    assert_non_null(l2->aops); /* the asynchronous path is the one under test */
    atomic_store(&l2->fail_code, -EIO);
    atomic_store(&l2->fail_read_nth, 3);
    int st[SK_CH];
    assert_int_equal(sink_retrieve(&s, kv, st), 2 * SK_CT);
    atomic_store(&l2->fail_read_nth, 0);
    ferry_kv_stats m = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(kv, &m));
    assert_int_equal(m.tier[FERRY_KV_TIER_L2].failures, 1);
    assert_int_equal(m.retrieved_chunks, SK_CH - 1);
    for (unsigned i = 0; i < SK_CH; i++)
        assert_int_equal(st[i], i == 2 ? FERRY_ENOTFOUND : 0);
    sink_check(&s, 2, MISS_UNTOUCHED);
    /* its L2 copy went with the failed read: the prompt's cache ends there */
    assert_int_equal(ferry_kv_lookup(kv, s.tok, SK_N, NULL), 2 * SK_CT);
    ferry_kv_close(kv);
    sink_free(&s);
}

/* chunk k's id in kv and its L2 location (from the store's index) */
static uint64_t l2_loc_of(ferry_kv *kv, const int32_t *tok, size_t n, size_t k,
                          ferry_kv_hash *id)
{
    ferry_kv_hash h[SK_CH];
    assert_true((size_t)ferry_kv_hash_chunks(kv->seed, tok, n, SK_CT, 0, h, SK_CH) > k);
    *id = (ferry_kv_hash){h[k].lo ^ kv->ns0.lo, h[k].hi ^ kv->ns0.hi};
    uint64_t loc = UINT64_MAX;
    pthread_mutex_lock(&kv->mu);
    for (uint64_t b = 0; b < kv->nbuckets && loc == UINT64_MAX; b++)
        for (ferry__kv_entry *e = kv->buckets[b]; e; e = e->hnext)
            if (e->id.lo == id->lo && e->id.hi == id->hi)
                loc = e->loc[FERRY_KV_TIER_L2];
    pthread_mutex_unlock(&kv->mu);
    assert_true(loc != UINT64_MAX);
    return loc;
}

/* a retrieve that finds a chunk's L2 slot still being read by an earlier
 * read (held here through the tier's begin, as a read whose lock outlived
 * its TTL would hold it) gets that chunk as a miss, untouched, and keeps
 * its L2 copy: once the earlier read ends, the chunk comes back exact */
static void test_persistent_l2_slot_still_read_is_a_miss_not_a_drop(void **state)
{
    (void)state;
    sink s;
    sink_stored(&s, 13, 0);
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&s.c, &kv));
    ferry__kv_tier *l2 = kv->tier[FERRY_KV_TIER_L2];
    assert_non_null(l2->aops);
    ferry_kv_hash id3;
    uint64_t loc3 = l2_loc_of(kv, s.tok, SK_N, 3, &id3);
    FT_ASSERT_OK(l2->aops->begin(l2, loc3, &id3, l2->slot_bytes));
    int st[SK_CH];
    assert_int_equal(sink_retrieve(&s, kv, st), 3 * SK_CT);
    for (unsigned i = 0; i < SK_CH; i++)
        assert_int_equal(st[i], i == 3 ? FERRY_ENOTFOUND : 0);
    sink_check(&s, 3, MISS_UNTOUCHED);
    ferry_kv_stats m = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(kv, &m));
    assert_int_equal(m.tier[FERRY_KV_TIER_L2].failures, 0); /* not the copy's failure */
    assert_int_equal(m.corrupt_chunks, 0);
    l2->aops->end(l2, loc3);
    /* the copy stayed: the whole prompt is found and comes back exact */
    assert_int_equal(ferry_kv_lookup(kv, s.tok, SK_N, NULL), SK_N);
    assert_int_equal(sink_retrieve(&s, kv, st), SK_N);
    assert_memory_equal(s.got, s.mem, s.bytes);
    ferry_kv_close(kv);
    sink_free(&s);
}

/* chunks of 5 MiB: three 2 MiB pieces, the last one short */
#define BIG ((uint64_t)5 << 20)

static ferry__kv_tier *big_tier(const char *d, uint64_t chunk_bytes)
{
    ferry__kv_tier *t = NULL;
    ferry__errbuf eb;
    memset(&eb, 0, sizeof eb);
    FT_ASSERT_OK(ferry__kv_tier_pslab_open(&(ferry__kv_pslab_cfg){.dir = d,
                                                                  .bytes = 4 * BIG,
                                                                  .direct = 1,
                                                                  .slot_bytes = BIG,
                                                                  .chunk_bytes = chunk_bytes},
                                           &eb, &t));
    return t;
}

/* read the chunk at loc through the asynchronous ops, piece by piece, as a
 * retrieve does: its result (begin's, or the first piece's) */
static int aread_chunk(ferry__kv_tier *t, uint64_t loc, const ferry_kv_hash *id, uint8_t *dst)
{
    int rc = t->aops->begin(t, loc, id, BIG);
    if (rc < 0)
        return rc;
    ferry__kv_abatch b;
    memset(&b, 0, sizeof b);
    unsigned sent = 0, landed = 0;
    for (uint64_t off = 0; off < BIG; off += t->apiece) {
        ferry__kv_aread *a = t->aops->get(t);
        assert_non_null(a);
        a->idx = sent;
        FT_ASSERT_OK(t->aops->submit(t, &b, a, loc, off, dst + off,
                                     (size_t)(BIG - off < t->apiece ? BIG - off : t->apiece)));
        sent++;
    }
    while (landed < sent) {
        ferry__kv_aread *done = NULL;
        FT_ASSERT_OK(t->aops->wait(t, &b, &done));
        assert_non_null(done);
        for (ferry__kv_aread *next; done; done = next) {
            next = done->next;
            if (done->result < 0 && rc == 0)
                rc = done->result;
            t->aops->put(t, done);
            landed++;
        }
    }
    t->aops->end(t, loc);
    return rc;
}

/* a tier whose chunk images fill their slots reads asynchronously: each
 * chunk lands whole from its pieces, passes verify only with its own
 * checksum, and begin refuses a chunk that is gone or of another length;
 * a tier whose images are shorter than a slot keeps synchronous reads */
static void test_async_reads_land_whole_and_checked(void **state)
{
    (void)state;
    char d[256];
    ft_tmpdir(d, sizeof d);
    ferry__kv_tier *t = big_tier(d, BIG);
    assert_non_null(t->aops);
    assert_int_equal(t->apiece, 2u << 20);
    uint8_t *buf = NULL, *got = NULL;
    assert_int_equal(posix_memalign((void **)&buf, 4096, BIG), 0);
    assert_int_equal(posix_memalign((void **)&got, 4096, BIG), 0);
    uint64_t loc[3];
    for (unsigned i = 0; i < 3; i++) {
        ferry_kv_hash id = hid(i);
        FT_ASSERT_OK(t->ops->reserve(t, &loc[i]));
        ft_fill_pattern(buf, BIG, 40 + i);
        FT_ASSERT_OK(t->ops->write(t, loc[i], &id, buf, BIG));
    }
    for (unsigned i = 0; i < 3; i++) {
        ferry_kv_hash id = hid(i);
        memset(got, 0xEE, BIG);
        FT_ASSERT_OK(aread_chunk(t, loc[i], &id, got));
        assert_int_equal(ft_check_pattern(got, BIG, 40 + i), -1);
        /* a format 3 slab records a checksum per piece: checked piece by
         * piece, and never against one whole-chunk sum */
        assert_int_equal(t->aops->vpiece(t, loc[i]), 2u << 20);
        FT_ASSERT_OK(ferry__kv_tier_check_whole(t, loc[i], &id, got, BIG));
        assert_int_equal(t->aops->verify(t, loc[i], &id, ferry__kv_sum(got, BIG)), -EINVAL);
        /* one byte off: its piece's checksum is not the recorded one */
        got[BIG / 2] ^= 1;
        assert_int_equal(ferry__kv_tier_check_whole(t, loc[i], &id, got, BIG), FERRY_ECORRUPT);
        assert_non_null(strstr(ferry_last_error(), "piece"));
    }
    /* begin pins: a chunk released while read is still read whole */
    ferry_kv_hash id1 = hid(1);
    FT_ASSERT_OK(t->aops->begin(t, loc[1], &id1, BIG));
    t->ops->release(t, loc[1]);
    ferry__kv_abatch b;
    memset(&b, 0, sizeof b);
    ferry__kv_aread *a = t->aops->get(t), *done = NULL;
    FT_ASSERT_OK(t->aops->submit(t, &b, a, loc[1], 0, got, 2u << 20));
    FT_ASSERT_OK(t->aops->wait(t, &b, &done));
    assert_ptr_equal(done, a);
    FT_ASSERT_OK(a->result);
    t->aops->put(t, a);
    t->aops->end(t, loc[1]);
    ft_fill_pattern(buf, BIG, 41);
    assert_memory_equal(got, buf, 2u << 20);
    /* gone: begin says so and nothing is pinned */
    assert_int_equal(t->aops->begin(t, loc[1], &id1, BIG), FERRY_ENOTFOUND);
    /* another length asked: another layout */
    ferry_kv_hash id0 = hid(0);
    assert_int_equal(t->aops->begin(t, loc[0], &id0, BIG - 4096), FERRY_EMISMATCH);
    /* a slot still being read is refused to a second read; the check is
     * of the chunk the slot was read for, not of whatever sum matches */
    FT_ASSERT_OK(t->aops->begin(t, loc[0], &id0, BIG));
    assert_int_equal(t->aops->begin(t, loc[0], &id0, BIG), -EBUSY);
    t->aops->end(t, loc[0]);
    ft_fill_pattern(buf, BIG, 40);
    FT_ASSERT_OK(ferry__kv_tier_check_whole(t, loc[0], &id0, buf, BIG));
    ferry_kv_hash id2 = hid(2);
    assert_int_equal(ferry__kv_tier_check_whole(t, loc[0], &id2, buf, BIG), FERRY_ENOTFOUND);
    ferry__kv_tier_free(t);
    free(buf);
    free(got);
    ft_rmtree(d);
    /* images shorter than a slot: the slab's checksum is not the image's */
    ft_tmpdir(d, sizeof d);
    t = big_tier(d, BIG - 100);
    assert_null(t->aops);
    ferry__kv_tier_free(t);
    ft_rmtree(d);
}

/* ---- chunks over one piece: checked piece by piece as they land ---- */

/* 80 layers x 8 heads x 128 f16: a chunk of 16 tokens is 160 planes of 32
 * KiB, 5 MiB, so three pieces of 2 MiB (the last one short); 4 chunks */
enum { PC_TB = 2048, PC_PLANES = 160, PC_CT = 16, PC_CH = 4, PC_N = PC_CH * PC_CT,
       PC_CHUNK = PC_PLANES * PC_CT * PC_TB, PC_PIECE = 2 << 20 };

typedef struct pcfix {
    char d[256];
    ferry_kv_config c;
    int32_t tok[PC_N];
    uint8_t *mem, *got;
    size_t bytes;
} pcfix;

/* the prompt stored into a persistent L2 of format `format` (0: the
 * current one), synced, the store closed */
static void pc_stored(pcfix *f, unsigned format)
{
    ft_tmpdir(f->d, sizeof f->d);
    f->c = kv_cfg(f->d, "pieces", 1, 1);
    f->c.layout.num_layers = PC_PLANES / 2;
    f->c.layout.num_heads = 8;
    f->c.layout.head_dim = 128;
    f->c.l1_bytes = 2 * (uint64_t)PC_CHUNK;
    f->c.l2_bytes = 8 * (uint64_t)PC_CHUNK;
    f->bytes = (size_t)PC_PLANES * PC_N * PC_TB;
    f->mem = malloc(f->bytes);
    f->got = malloc(f->bytes);
    assert_true(f->mem && f->got);
    prompt(f->tok, PC_N, 77);
    /* (no period: a chunk's first token is found in the slab file by its bytes) */
    ft_fill_mixed(f->mem, f->bytes, 770);
    atomic_store(&ferry__pslab_test_format, format);
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&f->c, &kv));
    ferry_kv_buffer src = kv_buf(&f->c, f->mem, PC_N);
    assert_int_equal(ferry_kv_store(kv, f->tok, PC_N, NULL, &src), PC_N);
    FT_ASSERT_OK(ferry_kv_flush(kv));
    assert_int_equal(ferry_kv_sync(kv), PC_CH);
    ferry_kv_close(kv);
    atomic_store(&ferry__pslab_test_format, 0);
}

/* change the byte at image offset off of chunk k on disk (xor 0x40) */
static void pc_damage(const pcfix *f, unsigned k, off_t off)
{
    char path[400];
    snprintf(path, sizeof path, "%s/%s", f->d, FERRY_PSLAB_FILE);
    /* (plane 0's first token) */
    off_t at = slab_find(f->d, f->mem + (size_t)k * PC_CT * PC_TB, PC_TB);
    int fd = open(path, O_RDWR);
    assert_true(fd >= 0);
    uint8_t b;
    assert_int_equal(pread(fd, &b, 1, at + off), 1);
    b ^= 0x40;
    assert_int_equal(pwrite(fd, &b, 1, at + off), 1);
    assert_int_equal(fsync(fd), 0);
    close(fd);
}

/* a cold retrieve of the prompt: every chunk but `miss` exact (miss: its
 * status FERRY_ECORRUPT and its tokens untouched or zeroed, plane by
 * plane); the store's counters in m */
static void pc_retrieve(pcfix *f, int miss, ferry_kv_stats *m)
{
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&f->c, &kv));
    memset(f->got, 0xEE, f->bytes);
    ferry_kv_buffer dst = kv_buf(&f->c, f->got, PC_N);
    int st[PC_CH];
    ferry_kv_req r = FERRY_KV_REQ_INIT;
    r.status = st;
    r.max_chunks = PC_CH;
    int want = miss < 0 ? PC_N : miss * PC_CT;
    int got = ferry_kv_retrieve(kv, f->tok, PC_N, &r, &dst);
    if (got != want)
        print_message("retrieved %d: %d %d %d %d\n", got, st[0], st[1], st[2], st[3]);
    assert_int_equal(got, want);
    FT_ASSERT_OK(ferry_kv_flush(kv));
    FT_ASSERT_OK(ferry_kv_stats_get(kv, m));
    ferry_kv_close(kv);
    for (int i = 0; i < PC_CH; i++)
        assert_int_equal(st[i], i == miss ? FERRY_ECORRUPT : 0);
    for (int i = 0; i < PC_CH; i++)
        for (size_t p = 0; p < PC_PLANES; p++) {
            size_t at = (p * PC_N + (size_t)i * PC_CT) * PC_TB;
            if (i != miss) {
                assert_memory_equal(f->got + at, f->mem + at, (size_t)PC_CT * PC_TB);
                continue;
            }
            uint8_t first = f->got[at];
            assert_true(first == 0xEE || first == 0);
            for (size_t x = 0; x < (size_t)PC_CT * PC_TB; x++)
                assert_int_equal(f->got[at + x], first);
        }
}

static void pc_free(pcfix *f)
{
    free(f->mem);
    free(f->got);
    ft_rmtree(f->d);
}

/* a format 3 slab: chunks of three pieces come back exact, each piece
 * checked as it landed; one bad byte inside a piece, or at either edge of
 * one, makes that chunk a miss whose tokens are untouched or zeroed, and
 * every other chunk stays exact */
static void test_persistent_l2_pieces_checked_as_they_land(void **state)
{
    (void)state;
    pcfix f;
    pc_stored(&f, 0);
    ferry_kv_stats m = FERRY_KV_STATS_INIT;
    pc_retrieve(&f, -1, &m);
    assert_int_equal(m.corrupt_chunks, 0);
    assert_int_equal(m.tier[FERRY_KV_TIER_L2].hits, PC_CH);
    assert_true(m.retrieve_check_us + m.retrieve_copy_us > 0);
    uint64_t nfirst = 0;
    for (int b = 0; b < FERRY_KV_HIST_BUCKETS; b++)
        nfirst += m.retrieve_first_bytes_ns[b];
    assert_int_equal(nfirst, 1); /* one retrieve, its first bytes once */
    const off_t bad[] = {PC_PIECE + 100,        /* inside piece 1 */
                         2 * PC_PIECE - 1,      /* piece 1's last byte */
                         2 * PC_PIECE,          /* piece 2's first (the short last piece) */
                         PC_CHUNK - 1};         /* the chunk's last byte */
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        pc_damage(&f, 2, bad[k]);
        m = (ferry_kv_stats)FERRY_KV_STATS_INIT;
        pc_retrieve(&f, 2, &m);
        assert_int_equal(m.corrupt_chunks, 1);
        /* the bad copy is gone: store the prompt again for the next case */
        pc_free(&f);
        pc_stored(&f, 0);
    }
    pc_free(&f);
}

/* a slab written in format 2 (one checksum per chunk) is read and checked
 * whole, by this library as by the old one; a bad byte is still a miss */
static void test_persistent_l2_old_format_chunks_checked_whole(void **state)
{
    (void)state;
    pcfix f;
    pc_stored(&f, 2);
    ferry_kv_stats m = FERRY_KV_STATS_INIT;
    pc_retrieve(&f, -1, &m);
    assert_int_equal(m.corrupt_chunks, 0);
    pc_damage(&f, 1, PC_PIECE + 7);
    m = (ferry_kv_stats)FERRY_KV_STATS_INIT;
    pc_retrieve(&f, 1, &m);
    assert_int_equal(m.corrupt_chunks, 1);
    pc_free(&f);
}

/* nonsense to the asynchronous ops and to the slab's pin: a clear
 * -EINVAL (or a miss), never a crash or a pin left behind */
static void test_async_reads_refuse_nonsense(void **state)
{
    (void)state;
    char d[256];
    ft_tmpdir(d, sizeof d);
    ferry__kv_tier *t = big_tier(d, BIG);
    assert_non_null(t->aops);
    ferry_kv_hash id = hid(7);
    uint8_t *buf = NULL;
    assert_int_equal(posix_memalign((void **)&buf, 4096, BIG), 0);
    assert_int_equal(t->aops->begin(t, t->capacity, &id, BIG), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "capacity"));
    assert_int_equal(t->aops->verify(t, t->capacity + 5, &id, 0), -EINVAL);
    t->aops->end(t, t->capacity); /* ignored */
    t->aops->end(t, 0);           /* nothing begun there: ignored */
    /* a piece of a slot nobody began */
    ferry__kv_abatch b;
    memset(&b, 0, sizeof b);
    ferry__kv_aread *a = t->aops->get(t);
    assert_int_equal(t->aops->submit(t, &b, a, 0, 0, buf, 4096), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "without begin"));
    assert_int_equal(t->aops->submit(t, &b, a, t->capacity, 0, buf, 4096), -EINVAL);
    t->aops->put(t, a);
    assert_int_equal(b.inflight, 0);
    /* a slot whose chunk is not in the slab: a miss */
    assert_int_equal(t->aops->begin(t, 1, &id, BIG), FERRY_ENOTFOUND);
    /* the slab's pin */
    ferry_pslab *ps = ferry__kv_tier_pslab_store(t);
    ferry__pslab_pin pin;
    uint8_t key[FERRY_PSLAB_KEY_MAX + 1];
    memset(key, 1, sizeof key);
    assert_int_equal(ferry__pslab_pin_get(NULL, key, 16, &pin), -EINVAL);
    assert_int_equal(ferry__pslab_pin_get(ps, key, 16, NULL), -EINVAL);
    assert_int_equal(ferry__pslab_pin_get(ps, NULL, 16, &pin), -EINVAL);
    assert_int_equal(ferry__pslab_pin_get(ps, key, 0, &pin), -EINVAL);
    assert_int_equal(ferry__pslab_pin_get(ps, key, sizeof key, &pin), -EINVAL);
    assert_int_equal(ferry__pslab_pin_get(ps, key, 16, &pin), FERRY_ENOTFOUND);
    assert_null(pin.ent);
    ferry__pslab_pin_put(ps, &pin); /* nothing pinned: ignored */
    ferry__pslab_pin_put(ps, NULL);
    ferry__kv_tier_free(t);
    free(buf);
    ft_rmtree(d);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_slots_write_read_release),
        cmocka_unit_test(test_restart_hands_back_the_chunks),
        cmocka_unit_test(test_recover_stopped_forgets_the_rest),
        cmocka_unit_test(test_bad_geometry_is_einval),
        cmocka_unit_test(test_kv_sync_commits_the_write_throughs),
        cmocka_unit_test(test_two_stores_on_one_persistent_l2_are_ebusy),
        cmocka_unit_test(test_another_layout_is_refused_and_its_chunks_stay),
        cmocka_unit_test(test_persistent_l2_files_are_private_unless_a_mode_is_given),
        cmocka_unit_test(test_persistent_l2_keeps_caching_under_churn),
        cmocka_unit_test(test_kv_sync_says_how_many_chunks_it_made_durable),
        cmocka_unit_test(test_persistent_l2_corrupt_chunk_read_ahead_is_a_miss),
        cmocka_unit_test(test_async_reads_land_whole_and_checked),
        cmocka_unit_test(test_persistent_l2_pieces_checked_as_they_land),
        cmocka_unit_test(test_persistent_l2_old_format_chunks_checked_whole),
        cmocka_unit_test(test_async_reads_refuse_nonsense),
        cmocka_unit_test(test_persistent_l2_prefetch_checks_each_chunk),
        cmocka_unit_test(test_persistent_l2_failed_read_is_one_miss),
        cmocka_unit_test(test_persistent_l2_slot_still_read_is_a_miss_not_a_drop),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
