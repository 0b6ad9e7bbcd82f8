/*
 * test_slab.c - the slab allocator: first fit by address, alignment,
 * coalescing, all-or-nothing allocation, layouts, key states and their
 * status codes, the fragmentation figure, out-of-memory through the
 * allocation hook, a randomized comparison against a bitmap model, and
 * several threads at once. ferry_slab_check() runs after every operation.
 */
/* ferry-test-labels: concurrent */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "ferry_test.h"
#include "slab/slab_impl.h"

#define K4 4096u

static ferry_slab *mk(uint64_t cap)
{
    ferry_slab_options o = FERRY_SLAB_OPTIONS_INIT;
    o.capacity = cap;
    ferry_slab *s = NULL;
    FT_ASSERT_OK(ferry_slab_create(&o, &s));
    return s;
}

#define CHECK(s) FT_ASSERT_OK(ferry_slab_check(s))

static ferry_extent alloc1(ferry_slab *s, uint64_t bytes)
{
    ferry_extent e = {0, 0};
    assert_int_equal(ferry_slab_alloc_bytes(s, bytes, &e), 1);
    CHECK(s);
    return e;
}

static void create_rejects_bad_options(void **state)
{
    (void)state;
    ferry_slab *s = (ferry_slab *)0x1;
    ferry_slab_options o = FERRY_SLAB_OPTIONS_INIT;
    o.capacity = 0;
    assert_int_equal(ferry_slab_create(&o, &s), -EINVAL);
    o.capacity = 4095; /* rounds down to 0 */
    assert_int_equal(ferry_slab_create(&o, &s), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "below the alignment"));
    o.capacity = 1 << 20;
    o.alignment = 3000;
    assert_int_equal(ferry_slab_create(&o, &s), -EINVAL);
    assert_ptr_equal(s, (ferry_slab *)0x1); /* out untouched */
    assert_int_equal(ferry_slab_create(NULL, &s), -EINVAL);
    ferry_slab_destroy(NULL);
}

/* -EINVAL naming the field, and out untouched */
static void expect_refused(const ferry_slab_options *o, const char *field)
{
    ferry_slab *s = (ferry_slab *)0x1;
    assert_int_equal(ferry_slab_create(o, &s), -EINVAL);
    assert_ptr_equal(s, (ferry_slab *)0x1);
    if (!strstr(ferry_last_error(), field))
        fail_msg("message '%s' does not name %s", ferry_last_error(), field);
}

static void create_range_checks_every_option(void **state)
{
    (void)state;
    ferry_slab_options o = FERRY_SLAB_OPTIONS_INIT;
    o.capacity = UINT64_MAX;
    /* the slab kin of the persistent slab's SIGFPE: 2^32 is a power of
     * two but above what a slab accepts */
    o.alignment = (size_t)1 << 32;
    expect_refused(&o, "alignment");
    assert_non_null(strstr(ferry_last_error(), "4294967296"));
    const size_t bad_align[] = {(size_t)1 << 31, (size_t)1 << 63, SIZE_MAX, 3, 4097,
                                (size_t)3 << 20, ((size_t)1 << 30) + 4096};
    for (size_t i = 0; i < FERRY__ARRAY_LEN(bad_align); i++) {
        o.alignment = bad_align[i];
        expect_refused(&o, "alignment");
    }
    /* capacity below one unit of the alignment, however large the alignment */
    o.alignment = (size_t)1 << 30;
    o.capacity = ((uint64_t)1 << 30) - 1;
    expect_refused(&o, "capacity");
    o.capacity = 0;
    o.alignment = 0;
    expect_refused(&o, "capacity");
    o.capacity = 1 << 20;
    o.size = sizeof o - 1;
    expect_refused(&o, "size");
    o.size = 0;
    expect_refused(&o, "size");

    /* the edges of the range still work */
    o = (ferry_slab_options)FERRY_SLAB_OPTIONS_INIT;
    ferry_slab *s = NULL;
    o.capacity = UINT64_MAX;
    o.alignment = (size_t)1 << 30;
    FT_ASSERT_OK(ferry_slab_create(&o, &s));
    assert_int_equal(ferry_slab_capacity(s), UINT64_MAX & ~(((uint64_t)1 << 30) - 1));
    ferry_extent e;
    assert_int_equal(ferry_slab_alloc_bytes(s, UINT64_MAX, &e), FERRY_ENOSPACE);
    assert_int_equal(ferry_slab_alloc_bytes(s, 1, &e), 1);
    assert_int_equal(e.size, (uint64_t)1 << 30);
    CHECK(s);
    ferry_slab_destroy(s);
    o.capacity = 1;
    o.alignment = 1;
    FT_ASSERT_OK(ferry_slab_create(&o, &s));
    assert_int_equal(ferry_slab_alloc_bytes(s, 1, &e), 1);
    CHECK(s);
    ferry_slab_destroy(s);
}

/* a count whose extents could never fit is refused before anything is
 * sized by it (no bookkeeping of INT32_MAX entries) */
/* an older header's options (a prefix up to capacity) create with the
 * default alignment; a shorter size is refused */
static void older_options_prefix_is_accepted(void **state)
{
    (void)state;
    ferry_slab_options o = FERRY_SLAB_OPTIONS_INIT;
    o.capacity = 1 << 20;
    o.alignment = 3; /* past the prefix: not read (else refused) */
    o.size = FERRY_SLAB_OPTIONS_MIN_SIZE;
    ferry_slab *s = NULL;
    FT_ASSERT_OK(ferry_slab_create(&o, &s));
    assert_int_equal(ferry_slab_alignment(s), 4096);
    ferry_slab_destroy(s);
    o.size = FERRY_SLAB_OPTIONS_MIN_SIZE - 8;
    expect_refused(&o, "FERRY_SLAB_OPTIONS_MIN_SIZE");
}

static void alloc_count_beyond_the_free_bytes_is_refused_early(void **state)
{
    (void)state;
    ferry_slab *s = mk(10 * K4);
    ferry_shape sh = {1, {K4}};
    int dt = FERRY_DTYPE_U8;
    ferry_layout l = {1, &sh, 1, &dt};
    ferry_extent one[1];
    ft_alloc_install(0, 0);
    uint64_t before = ft_alloc_count();
    assert_int_equal(ferry_slab_alloc(s, &l, INT32_MAX, one), FERRY_ENOSPACE);
    assert_int_equal(ft_alloc_count(), before);
    assert_non_null(strstr(ferry_slab_last_error(s), "out of space"));
    assert_int_equal(ferry_slab_alloc(s, &l, UINT32_MAX, one), -EINVAL);
    ft_alloc_reset();
    /* need * count overflows 64 bits */
    ferry_slab_options o = FERRY_SLAB_OPTIONS_INIT;
    o.capacity = UINT64_MAX;
    ferry_slab *big = NULL;
    FT_ASSERT_OK(ferry_slab_create(&o, &big));
    sh.dims[0] = (uint64_t)1 << 62;
    assert_int_equal(ferry_slab_alloc(big, &l, 8, one), FERRY_ENOSPACE);
    CHECK(big);
    ferry_slab_destroy(big);
    CHECK(s);
    ferry_slab_destroy(s);
}

static void capacity_rounds_down_to_alignment(void **state)
{
    (void)state;
    ferry_slab *s = mk(10 * K4 + 100);
    assert_int_equal(ferry_slab_capacity(s), 10 * K4);
    assert_int_equal(ferry_slab_alignment(s), K4);
    CHECK(s);
    ferry_slab_destroy(s);
}

static void first_fit_by_address_rounds_sizes_up(void **state)
{
    (void)state;
    ferry_slab *s = mk(64 * K4);
    ferry_extent a = alloc1(s, 5000), b = alloc1(s, 1), c = alloc1(s, 3 * K4);
    assert_int_equal(a.offset, 0);
    assert_int_equal(a.size, 2 * K4);
    assert_int_equal(b.offset, 2 * K4);
    assert_int_equal(b.size, K4);
    assert_int_equal(c.offset, 3 * K4);
    /* free a: a 1-block request goes to the lowest hole (offset 0), not the tail */
    FT_ASSERT_OK(ferry_slab_free(s, &a));
    CHECK(s);
    ferry_extent d = alloc1(s, K4);
    assert_int_equal(d.offset, 0);
    /* a 2-block request no longer fits the 1-block hole at K4: goes to the tail */
    ferry_extent e = alloc1(s, 2 * K4);
    assert_int_equal(e.offset, 6 * K4);
    ferry_slab_destroy(s);
}

static void free_coalesces_with_both_neighbours(void **state)
{
    (void)state;
    ferry_slab *s = mk(4 * K4);
    ferry_extent x[4];
    for (int i = 0; i < 4; i++)
        x[i] = alloc1(s, K4);
    ferry_slab_stats st = FERRY_SLAB_STATS_INIT;
    FT_ASSERT_OK(ferry_slab_free(s, &x[0]));
    CHECK(s);
    FT_ASSERT_OK(ferry_slab_free(s, &x[2]));
    CHECK(s);
    FT_ASSERT_OK(ferry_slab_stats_get(s, &st));
    assert_int_equal(st.free_blocks, 2);
    FT_ASSERT_OK(ferry_slab_free(s, &x[1])); /* joins 0 and 2 */
    CHECK(s);
    FT_ASSERT_OK(ferry_slab_stats_get(s, &st));
    assert_int_equal(st.free_blocks, 1);
    assert_int_equal(st.largest_free, 3 * K4);
    FT_ASSERT_OK(ferry_slab_free(s, &x[3])); /* joins on the left only */
    CHECK(s);
    FT_ASSERT_OK(ferry_slab_stats_get(s, &st));
    assert_int_equal(st.free_blocks, 1);
    assert_int_equal(st.free, 4 * K4);
    assert_int_equal(st.used, 0);
    /* the whole slab is one block again */
    ferry_extent all = alloc1(s, 4 * K4);
    assert_int_equal(all.offset, 0);
    ferry_slab_destroy(s);
}

static void alloc_count_is_all_or_nothing(void **state)
{
    (void)state;
    ferry_slab *s = mk(10 * K4);
    ferry_shape sh = {1, {K4}};
    int dt = FERRY_DTYPE_U8;
    ferry_layout l = {1, &sh, 1, &dt};
    ferry_extent out[11];
    memset(out, 0x5a, sizeof out);
    assert_int_equal(ferry_slab_alloc(s, &l, 11, out), FERRY_ENOSPACE);
    assert_non_null(strstr(ferry_slab_last_error(s), "out of space"));
    CHECK(s);
    ferry_slab_stats st = FERRY_SLAB_STATS_INIT;
    FT_ASSERT_OK(ferry_slab_stats_get(s, &st));
    assert_int_equal(st.used, 0);
    assert_int_equal(st.used_blocks, 0);
    assert_int_equal(st.failures, 1);
    for (size_t i = 0; i < sizeof out; i++)
        assert_int_equal(((unsigned char *)out)[i], 0x5a); /* out untouched */
    assert_int_equal(ferry_slab_alloc(s, &l, 10, out), 10);
    CHECK(s);
    for (int i = 0; i < 10; i++) {
        assert_int_equal(out[i].offset, (uint64_t)i * K4);
        assert_int_equal(out[i].size, K4);
    }
    ferry_extent one;
    assert_int_equal(ferry_slab_alloc_bytes(s, 1, &one), FERRY_ENOSPACE);
    CHECK(s);
    /* an object larger than the whole slab */
    assert_int_equal(ferry_slab_alloc_bytes(s, 11 * K4, &one), FERRY_ENOSPACE);
    CHECK(s);
    ferry_slab_destroy(s);
}

static void layout_bytes_and_mismatch(void **state)
{
    (void)state;
    /* Llama-3-8B: [2, 32, 256, 8*128] bf16 = 32 MiB per chunk */
    ferry_shape kv = {4, {2, 32, 256, 1024}};
    int bf16 = FERRY_DTYPE_BF16;
    ferry_layout l = {1, &kv, 1, &bf16};
    uint64_t n = 0;
    FT_ASSERT_OK(ferry_layout_bytes(&l, &n));
    assert_int_equal(n, 32u << 20);
    /* two tensors back to back */
    ferry_shape two[2] = {{1, {100}}, {2, {3, 10}}};
    int dts[2] = {FERRY_DTYPE_U8, FERRY_DTYPE_F32};
    ferry_layout l2 = {2, two, 2, dts};
    FT_ASSERT_OK(ferry_layout_bytes(&l2, &n));
    assert_int_equal(n, 100 + 120);
    /* mismatched lengths */
    ferry_layout bad = {2, two, 1, dts};
    assert_int_equal(ferry_layout_bytes(&bad, &n), FERRY_EMISMATCH);
    assert_non_null(strstr(ferry_last_error(), "2 shapes but 1 dtypes"));
    ferry_slab *s = mk(16 * K4);
    ferry_extent e = {7, 7};
    assert_int_equal(ferry_slab_alloc(s, &bad, 1, &e), FERRY_EMISMATCH);
    assert_int_equal(e.offset, 7);
    CHECK(s);
    int unknown = 99;
    ferry_layout bad2 = {1, &kv, 1, &unknown};
    assert_int_equal(ferry_layout_bytes(&bad2, &n), -EINVAL);
    ferry_shape zero = {1, {0}};
    ferry_layout bad3 = {1, &zero, 1, &bf16};
    assert_int_equal(ferry_layout_bytes(&bad3, &n), -EINVAL);
    ferry_shape huge = {3, {UINT64_MAX / 2, 4, 4}};
    ferry_layout bad4 = {1, &huge, 1, &bf16};
    assert_int_equal(ferry_layout_bytes(&bad4, &n), -EOVERFLOW);
    assert_int_equal(ferry_slab_alloc(s, &l2, 0, &e), -EINVAL);
    /* a 220-byte object takes one aligned block */
    assert_int_equal(ferry_slab_alloc(s, &l2, 1, &e), 1);
    assert_int_equal(e.size, K4);
    CHECK(s);
    assert_string_equal(ferry_dtype_name(FERRY_DTYPE_BF16), "bf16");
    assert_int_equal(ferry_dtype_size(FERRY_DTYPE_F64), 8);
    assert_int_equal(ferry_dtype_size(-1), 0);
    ferry_slab_destroy(s);
}

static void free_rejects_unknown_wrong_size_and_double_free(void **state)
{
    (void)state;
    ferry_slab *s = mk(16 * K4);
    ferry_extent a = alloc1(s, 2 * K4);
    ferry_extent bogus = {K4, K4};
    assert_int_equal(ferry_slab_free(s, &bogus), FERRY_ENOTFOUND); /* interior */
    assert_non_null(strstr(ferry_slab_last_error(s), "offset 4096"));
    CHECK(s);
    ferry_extent unaligned = {100, K4};
    assert_int_equal(ferry_slab_free(s, &unaligned), FERRY_ENOTFOUND);
    CHECK(s);
    ferry_extent wrong = {0, K4};
    assert_int_equal(ferry_slab_free(s, &wrong), FERRY_EMISMATCH);
    CHECK(s);
    FT_ASSERT_OK(ferry_slab_free(s, &a));
    CHECK(s);
    assert_int_equal(ferry_slab_free(s, &a), FERRY_ENOTFOUND); /* double free */
    CHECK(s);
    assert_int_equal(ferry_slab_free(s, NULL), -EINVAL);
    ferry_slab_destroy(s);
}

static void key_states_map_lmcache_status_codes(void **state)
{
    (void)state;
    ferry_slab *s = mk(16 * K4);
    ferry_extent e = alloc1(s, K4);
    unsigned r = 9;
    assert_int_equal(ferry_slab_state(s, e.offset, &r), FERRY_EXTENT_WRITING);
    assert_int_equal(r, 0);
    assert_int_equal(ferry_slab_state(s, 8 * K4, NULL), FERRY_EXTENT_ABSENT);
    /* KEY_NOT_EXIST */
    assert_int_equal(ferry_slab_commit(s, 8 * K4), FERRY_ENOTFOUND);
    assert_int_equal(ferry_slab_read_lock(s, 8 * K4), FERRY_ENOTFOUND);
    /* KEY_NOT_READABLE: being written */
    assert_int_equal(ferry_slab_read_lock(s, e.offset), FERRY_ENOTREADABLE);
    FT_ASSERT_OK(ferry_slab_commit(s, e.offset));
    /* KEY_IN_WRONG_STATE: commit twice, unlock without a lock, write lock twice */
    assert_int_equal(ferry_slab_commit(s, e.offset), FERRY_ESTATE);
    assert_int_equal(ferry_slab_read_unlock(s, e.offset), FERRY_ESTATE);
    FT_ASSERT_OK(ferry_slab_read_lock(s, e.offset));
    FT_ASSERT_OK(ferry_slab_read_lock(s, e.offset));
    assert_int_equal(ferry_slab_state(s, e.offset, &r), FERRY_EXTENT_READING);
    assert_int_equal(r, 2);
    /* KEY_IS_LOCKED: free while read-locked */
    assert_int_equal(ferry_slab_free(s, &e), FERRY_ELOCKED);
    CHECK(s);
    /* KEY_NOT_WRITABLE: write lock while read-locked */
    assert_int_equal(ferry_slab_write_lock(s, e.offset), FERRY_ENOTWRITABLE);
    FT_ASSERT_OK(ferry_slab_read_unlock(s, e.offset));
    FT_ASSERT_OK(ferry_slab_read_unlock(s, e.offset));
    assert_int_equal(ferry_slab_state(s, e.offset, NULL), FERRY_EXTENT_READY);
    FT_ASSERT_OK(ferry_slab_write_lock(s, e.offset));
    assert_int_equal(ferry_slab_write_lock(s, e.offset), FERRY_ESTATE);
    assert_int_equal(ferry_slab_state(s, e.offset, NULL), FERRY_EXTENT_WRITING);
    FT_ASSERT_OK(ferry_slab_free(s, &e)); /* the writer may abort */
    CHECK(s);
    assert_int_equal(ferry_slab_state(s, e.offset, NULL), FERRY_EXTENT_ABSENT);
    ferry_slab_destroy(s);
}

static void fragmentation_figure(void **state)
{
    (void)state;
    ferry_slab *s = mk(8 * K4);
    ferry_slab_stats st = FERRY_SLAB_STATS_INIT;
    FT_ASSERT_OK(ferry_slab_stats_get(s, &st));
    assert_true(st.fragmentation == 0.0);
    ferry_extent x[8];
    for (int i = 0; i < 8; i++)
        x[i] = alloc1(s, K4);
    FT_ASSERT_OK(ferry_slab_stats_get(s, &st));
    assert_true(st.fragmentation == 0.0); /* nothing free */
    assert_true(st.usage == 1.0);
    /* free 0, 2, 4, 5: holes of 1, 1, 2 blocks -> 1 - 2/4 = 0.5 */
    int fr[] = {0, 2, 4, 5};
    for (int i = 0; i < 4; i++) {
        FT_ASSERT_OK(ferry_slab_free(s, &x[fr[i]]));
        CHECK(s);
    }
    FT_ASSERT_OK(ferry_slab_stats_get(s, &st));
    assert_int_equal(st.free_blocks, 3);
    assert_int_equal(st.largest_free, 2 * K4);
    assert_true(st.fragmentation == 0.5);
    assert_true(st.usage == 0.5);
    assert_int_equal(st.allocs, 8);
    assert_int_equal(st.frees, 4);
    ferry_slab_destroy(s);
}

/* one run: create, 300 pair allocations, free every other extent, with
 * the n-th bookkeeping allocation failing (and every later one) */
static int oom_slab_run(void *ctx)
{
    (void)ctx;
    ferry_slab_options o = FERRY_SLAB_OPTIONS_INIT;
    o.capacity = 4096 * K4;
    ferry_slab *s = NULL;
    int rc = ferry_slab_create(&o, &s);
    if (rc < 0) {
        assert_int_equal(rc, -ENOMEM);
        assert_null(s);
        return rc;
    }
    uint64_t held = 0;
    ferry_extent ex[300];
    int nex = 0;
    for (int i = 0; i < 300; i++) {
        ferry_shape sh = {1, {K4}};
        int dt = FERRY_DTYPE_U8;
        ferry_layout l = {1, &sh, 1, &dt};
        ferry_extent pair[2] = {{1, 1}, {1, 1}};
        rc = ferry_slab_alloc(s, &l, 2, pair);
        FT_ASSERT_OK(ferry_slab_check(s));
        if (rc < 0) {
            assert_int_equal(rc, -ENOMEM);
            assert_int_equal(pair[0].offset, 1); /* untouched */
            continue;
        }
        held += 2;
        if (nex < 298) {
            ex[nex++] = pair[0];
            ex[nex++] = pair[1];
        }
    }
    /* free every other extent: needs new free nodes, which may fail */
    for (int i = 0; i < nex; i += 2) {
        rc = ferry_slab_free(s, &ex[i]);
        FT_ASSERT_OK(ferry_slab_check(s));
        if (rc == 0)
            held--;
        else
            assert_int_equal(rc, -ENOMEM);
    }
    ferry_slab_stats st = FERRY_SLAB_STATS_INIT;
    FT_ASSERT_OK(ferry_slab_stats_get(s, &st));
    assert_int_equal(st.used_blocks, held);
    assert_int_equal(st.used, held * K4);
    ferry_slab_destroy(s);
    return 0;
}

static void out_of_memory_leaves_the_slab_unchanged(void **state)
{
    (void)state;
    /* for each allocation point n, the n-th bookkeeping allocation fails (and
     * every later one): whatever call hit it fails with -ENOMEM and the slab
     * still passes check with exactly the extents that succeeded */
    ft_oom_each(400, FT_OOM_STICKY, oom_slab_run, NULL);
}

/* a bitmap of blocks as the model: first fit = lowest run of free blocks */
static void matches_a_bitmap_model_at_random(void **state)
{
    (void)state;
    enum { BLOCKS = 512 };
    unsigned char used[BLOCKS] = {0};
    ferry_slab *s = mk(BLOCKS * (uint64_t)K4);
    ferry_extent live[BLOCKS];
    int nlive = 0;
    srand(12345);
    for (int op = 0; op < 6000; op++) {
        if (nlive && (rand() % 100) < 45) {
            int k = rand() % nlive;
            ferry_extent e = live[k];
            FT_ASSERT_OK(ferry_slab_free(s, &e));
            memset(used + e.offset / K4, 0, e.size / K4);
            live[k] = live[--nlive];
        } else {
            unsigned nb = 1 + (unsigned)(rand() % 8);
            int want = -1;
            for (int b = 0; b + (int)nb <= BLOCKS && want < 0; b++) {
                int ok = 1;
                for (unsigned j = 0; j < nb && ok; j++)
                    ok = !used[b + j];
                if (ok)
                    want = b;
            }
            ferry_extent e = {0, 0};
            int rc = ferry_slab_alloc_bytes(s, nb * (uint64_t)K4 - (unsigned)(rand() % 100), &e);
            if (want < 0) {
                assert_int_equal(rc, FERRY_ENOSPACE);
            } else {
                assert_int_equal(rc, 1);
                assert_int_equal(e.offset, (uint64_t)want * K4);
                assert_int_equal(e.size, nb * (uint64_t)K4);
                memset(used + want, 1, nb);
                live[nlive++] = e;
            }
        }
        FT_ASSERT_OK(ferry_slab_check(s));
        ferry_slab_stats st = FERRY_SLAB_STATS_INIT;
        FT_ASSERT_OK(ferry_slab_stats_get(s, &st));
        uint64_t u = 0, runs = 0;
        for (int b = 0; b < BLOCKS; b++) {
            u += used[b];
            runs += !used[b] && (b == 0 || used[b - 1]);
        }
        assert_int_equal(st.used, u * K4);
        assert_int_equal(st.free_blocks, runs);
    }
    ferry_slab_destroy(s);
}


static used_ent *find_used(ferry_slab *s, uint64_t off)
{
    for (uint64_t i = 0; i < s->ucap; i++)
        if (s->used[i].size && s->used[i].off == off)
            return &s->used[i];
    return NULL;
}

static void expect_corrupt(ferry_slab *s, const char *what)
{
    assert_int_equal(ferry_slab_check(s), FERRY_ECORRUPT);
    if (!strstr(ferry_slab_last_error(s), what))
        fail_msg("check said '%s', expected '%s'", ferry_slab_last_error(s), what);
}

/* the walker really looks: each broken invariant is caught and named */
static void check_names_broken_invariants(void **state)
{
    (void)state;
    ferry_slab *s = mk(8 * K4);
    ferry_extent x0 = alloc1(s, K4), x1 = alloc1(s, K4), x2 = alloc1(s, K4);
    (void)x2;
    FT_ASSERT_OK(ferry_slab_free(s, &x0)); /* free: [0,4K) and [12K,32K) */
    CHECK(s);
    /* a stale cached maximum */
    s->nodes[s->root].max += K4;
    expect_corrupt(s, "cached maximum");
    s->nodes[s->root].max -= K4;
    CHECK(s);
    /* an extent whose recorded size runs into its neighbour */
    used_ent *u = find_used(s, x1.offset);
    assert_non_null(u);
    u->size = 2 * K4;
    expect_corrupt(s, "extents tile the slab but 2 are recorded"); /* x2 hidden under it */
    u->size = K4;
    CHECK(s);
    /* bytes that belong to nobody: an extent forgotten by the table */
    used_ent saved = *u;
    u->size = 0;
    s->ucount--;
    expect_corrupt(s, "belong to no block");
    *u = saved;
    s->ucount++;
    CHECK(s);
    /* the free-block count disagrees with the tree */
    s->free_blocks++;
    expect_corrupt(s, "free blocks in the tree");
    s->free_blocks--;
    CHECK(s);
    /* used bytes that do not add up */
    s->used_bytes += K4;
    expect_corrupt(s, "do not add up");
    s->used_bytes -= K4;
    CHECK(s);
    ferry_slab_destroy(s);
}

static ferry_slab *g_shared;
static void *hammer(void *arg)
{
    unsigned seed = (unsigned)(uintptr_t)arg;
    ferry_extent mine[64];
    int n = 0;
    for (int i = 0; i < 20000; i++) {
        if (n == 64 || (n && rand_r(&seed) % 2)) {
            int k = (int)(rand_r(&seed) % (unsigned)n);
            if (ferry_slab_free(g_shared, &mine[k]) != 0)
                return (void *)1;
            mine[k] = mine[--n];
        } else {
            int rc = ferry_slab_alloc_bytes(g_shared, K4 * (1 + rand_r(&seed) % 4), &mine[n]);
            if (rc == 1)
                n++;
            else if (rc != FERRY_ENOSPACE)
                return (void *)1;
        }
    }
    while (n)
        if (ferry_slab_free(g_shared, &mine[--n]) != 0)
            return (void *)1;
    return NULL;
}

static void threads_allocate_and_free_concurrently(void **state)
{
    (void)state;
    g_shared = mk(1024 * (uint64_t)K4);
    pthread_t t[4];
    for (uintptr_t i = 0; i < 4; i++)
        assert_int_equal(pthread_create(&t[i], NULL, hammer, (void *)(i + 1)), 0);
    for (int i = 0; i < 4; i++) {
        void *ret = (void *)1;
        pthread_join(t[i], &ret);
        assert_null(ret);
    }
    CHECK(g_shared);
    ferry_slab_stats st = FERRY_SLAB_STATS_INIT;
    FT_ASSERT_OK(ferry_slab_stats_get(g_shared, &st));
    assert_int_equal(st.used, 0);
    assert_int_equal(st.free_blocks, 1);
    assert_int_equal(st.allocs, st.frees);
    ferry_slab_destroy(g_shared);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(create_rejects_bad_options),
        cmocka_unit_test(capacity_rounds_down_to_alignment),
        cmocka_unit_test(first_fit_by_address_rounds_sizes_up),
        cmocka_unit_test(free_coalesces_with_both_neighbours),
        cmocka_unit_test(alloc_count_is_all_or_nothing),
        cmocka_unit_test(layout_bytes_and_mismatch),
        cmocka_unit_test(free_rejects_unknown_wrong_size_and_double_free),
        cmocka_unit_test(key_states_map_lmcache_status_codes),
        cmocka_unit_test(fragmentation_figure),
        cmocka_unit_test(create_range_checks_every_option),
        cmocka_unit_test(older_options_prefix_is_accepted),
        cmocka_unit_test(alloc_count_beyond_the_free_bytes_is_refused_early),
        cmocka_unit_test(out_of_memory_leaves_the_slab_unchanged),
        cmocka_unit_test(matches_a_bitmap_model_at_random),
        cmocka_unit_test(check_names_broken_invariants),
        cmocka_unit_test(threads_allocate_and_free_concurrently),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
