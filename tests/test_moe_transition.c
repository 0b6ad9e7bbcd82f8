/*
 * test_moe_transition.c - the opt-in "transition" policy: through a
 * generator trace every step's experts are resident where the planner
 * says, hits are never moved (a pinned expert is never evicted), the
 * counts add up and two runs agree; on a trace whose routes follow a
 * same-layer token-to-token structure it beats LRU clearly at a tight
 * budget, also after its counters are halved; shapes whose transition
 * table is too large are refused.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry_test.h"
#include "moe_traces.h"
#include "moe/moe_internal.h"

/* one step checked against the planner's slots before and after */
static void check_step(ferry_moe_planner *p, uint32_t layer, const uint32_t *ex, uint32_t k,
                       uint32_t num_experts, uint32_t *before, uint32_t nslots, uint64_t *hits, uint64_t *misses)
{
    uint32_t was[64], out[64];
    assert_true(k <= 64);
    for (uint32_t s = 0; s < nslots; s++)
        before[s] = ferry_moe_planner_occupant(p, s);
    uint32_t expect_miss = 0;
    for (uint32_t j = 0; j < k; j++) {
        was[j] = ferry_moe_planner_lookup(p, layer, ex[j]);
        expect_miss += was[j] == FERRY_MOE_NONE;
    }
    ferry_moe_counts c;
    FT_ASSERT_OK(ferry_moe_planner_ensure(p, layer, ex, k, out, NULL, &c));
    assert_int_equal(c.active, k);
    assert_int_equal(c.missing, expect_miss);
    *hits += k - expect_miss;
    *misses += expect_miss;
    uint32_t changed = 0;
    for (uint32_t j = 0; j < k; j++) {
        /* the right expert where the planner says */
        uint32_t s = out[j];
        assert_true(s < nslots);
        assert_int_equal(ferry_moe_planner_lookup(p, layer, ex[j]), s);
        assert_int_equal(ferry_moe_planner_occupant(p, s), layer * num_experts + ex[j]);
        /* a hit stays where it was: pinned, never evicted */
        if (was[j] != FERRY_MOE_NONE)
            assert_int_equal(was[j], s);
    }
    for (uint32_t s = 0; s < nslots; s++)
        changed += ferry_moe_planner_occupant(p, s) != before[s];
    /* only the misses took slots */
    assert_int_equal(changed, expect_miss);
}

static void replay_invariants(const char *model, double pct, uint64_t *h, uint64_t *m)
{
    ferry_moe_trace *t = ft_moe_gen(model, 96, 3);
    const ferry_moe_model *mo = ferry_moe_trace_model(t);
    ferry_moe_planner_options o = FERRY_MOE_PLANNER_OPTIONS_INIT;
    o.num_layers = mo->num_layers;
    o.num_experts = mo->num_experts;
    o.slots = ft_moe_share(t, pct);
    o.policy = "transition";
    ferry_moe_planner *p;
    FT_ASSERT_OK(ferry_moe_planner_create(&o, &p));
    assert_string_equal(ferry_moe_planner_policy(p), "transition");
    uint32_t *before = malloc(o.slots * sizeof *before);
    assert_non_null(before);
    size_t n = ferry_moe_trace_steps(t);
    *h = *m = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t tok, layer, k;
        const uint32_t *ex;
        FT_ASSERT_OK(ferry_moe_trace_step(t, i, &tok, &layer, &ex, &k));
        check_step(p, layer, ex, k, mo->num_experts, before, o.slots, h, m);
    }
    ferry_moe_planner_stats st = {.size = sizeof st};
    FT_ASSERT_OK(ferry_moe_planner_stats_get(p, &st));
    assert_int_equal(st.hits, *h);
    assert_int_equal(st.misses, *m);
    /* the replay counts the same */
    ferry_moe_replay_result r;
    FT_ASSERT_OK(ferry_moe_replay(t, "transition", o.slots, 0, &r));
    assert_int_equal(r.hits, *h);
    assert_int_equal(r.misses, *m);
    assert_int_equal(r.hits + r.misses, st.routes);
    free(before);
    ferry_moe_planner_destroy(p);
    ferry_moe_trace_destroy(t);
}

static void transition_keeps_the_invariants(void **state)
{
    (void)state;
    const char *models[] = {"qwen3-30b-a3b", "mixtral-8x7b", "small"};
    for (size_t i = 0; i < sizeof models / sizeof *models; i++) {
        uint64_t h1, m1, h2, m2;
        replay_invariants(models[i], 12.5, &h1, &m1);
        replay_invariants(models[i], 12.5, &h2, &m2);
        assert_int_equal(h1, h2); /* deterministic */
        assert_int_equal(m1, m2);
        assert_true(h1 > 0);
        print_message("%s 12.5%%: %llu hits %llu misses\n", models[i], (unsigned long long)h1,
                      (unsigned long long)m1);
    }
}

static void transition_is_listed_and_deterministic(void **state)
{
    (void)state;
    int listed = 0;
    for (const char *const *p = ferry_moe_policies(); *p; p++)
        listed += !strcmp(*p, "transition");
    assert_int_equal(listed, 1);
    assert_non_null(ferry_moe_policy_describe("transition"));
    ferry_moe_trace *t = ft_moe_gen("qwen3-30b-a3b", 64, 5);
    ferry_moe_replay_result a, b;
    FT_ASSERT_OK(ferry_moe_replay(t, "transition", ft_moe_share(t, 25), 0, &a));
    FT_ASSERT_OK(ferry_moe_replay(t, "transition", ft_moe_share(t, 25), 0, &b));
    assert_int_equal(a.hits, b.hits);
    assert_int_equal(a.evictions, b.evictions);
    assert_string_equal(a.policy, "transition");
    ferry_moe_trace_destroy(t);
}

static void transition_beats_lru_on_a_transition_structure(void **state)
{
    (void)state;
    ferry_moe_trace *t = ft_moe_pair_trace(4, 4000, 1, 11);
    uint32_t slots = 4 + 2; /* the sticky ones and a step: not LRU's window */
    double lru = ft_moe_rate(t, "lru", slots), tr = ft_moe_rate(t, "transition", slots);
    double bel = ft_moe_rate(t, "belady", slots);
    print_message("sticky trace, %u slots: lru %.2f transition %.2f belady %.2f\n", slots, lru, tr,
                  bel);
    if (tr < lru + 20.0)
        fail_msg("transition %.2f not 20 points above lru %.2f", tr, lru);
    assert_true(tr <= bel + 1e-9);
    ferry_moe_trace_destroy(t);
}

/* 140,000 tokens: a sticky expert's transition row passes 65,535 and is
 * halved; the policy keeps the sticky ones all along */
static void transition_survives_counter_halving(void **state)
{
    (void)state;
    ferry_moe_trace *t = ft_moe_pair_trace(4, 140000, 1, 5);
    double lru = ft_moe_rate(t, "lru", 6), tr = ft_moe_rate(t, "transition", 6);
    print_message("140000 tokens, 6 slots: lru %.2f transition %.2f\n", lru, tr);
    if (tr < lru + 20.0)
        fail_msg("transition %.2f not 20 points above lru %.2f after halving", tr, lru);
    ferry_moe_trace_destroy(t);
}

static void transition_refuses_huge_shapes(void **state)
{
    (void)state;
    ferry_moe_planner_options o = FERRY_MOE_PLANNER_OPTIONS_INIT;
    o.policy = "transition";
    o.slots = 64;
    ferry_moe_planner *p = NULL;
    /* 64 x 2048 x 2048 x 2 bytes = 512 MiB of counters */
    o.num_layers = 64;
    o.num_experts = 2048;
    assert_int_equal(ferry_moe_planner_create(&o, &p), -EINVAL);
    assert_null(p);
    assert_non_null(strstr(ferry_last_error(), "transition"));
    assert_non_null(strstr(ferry_last_error(), "bytes"));
    o.num_layers = FERRY_MOE_MAX_LAYERS;
    o.num_experts = FERRY_MOE_MAX_EXPERTS;
    assert_int_equal(ferry_moe_planner_create(&o, &p), -EINVAL);
    assert_null(p);
    /* DeepSeek-V3's shape (58 x 256) fits: 7.25 MiB */
    o.num_layers = 58;
    o.num_experts = 256;
    FT_ASSERT_OK(ferry_moe_planner_create(&o, &p));
    ferry_moe_planner_destroy(p);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(transition_keeps_the_invariants),
        cmocka_unit_test(transition_is_listed_and_deterministic),
        cmocka_unit_test(transition_beats_lru_on_a_transition_structure),
        cmocka_unit_test(transition_survives_counter_halving),
        cmocka_unit_test(transition_refuses_huge_shapes),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
