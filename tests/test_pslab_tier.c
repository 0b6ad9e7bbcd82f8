/*
 * test_pslab_tier.c - the KV store's persistent L2 tier (src/kv/tier_pslab.c)
 * through its ops table: slots, durable writes, checked reads, eviction by
 * forget, and the chunks it hands back after a restart.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "ferry_test.h"
#include "kv/tier_pslab.h"

#define SLOT 8192u

static ferry__kv_tier *tier_open(const char *d, uint64_t slots)
{
    ferry__kv_tier *t = NULL;
    ferry__errbuf eb;
    memset(&eb, 0, sizeof eb);
    FT_ASSERT_OK(ferry__kv_tier_pslab_open(d, slots * SLOT, 1, NULL, SLOT, &eb, &t));
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
    ferry_pslab_stats s;
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
    assert_int_equal(ferry__kv_tier_pslab_open(d, 4096, 1, NULL, 8192, &eb, &t), -EINVAL);
    assert_int_equal(ferry__kv_tier_pslab_open(d, 1 << 20, 1, NULL, 1000, &eb, &t), -EINVAL);
    assert_null(t);
    ft_rmtree(d);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_slots_write_read_release),
        cmocka_unit_test(test_restart_hands_back_the_chunks),
        cmocka_unit_test(test_recover_stopped_forgets_the_rest),
        cmocka_unit_test(test_bad_geometry_is_einval),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
