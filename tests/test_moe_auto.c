/*
 * test_moe_auto.c - the "auto" policy follows the better of LRU and the
 * routing policy: on a trace where routing loses to LRU it stays with LRU,
 * where routing wins it takes at least a tenth of the LRU -> Belady gap;
 * it is deterministic, listed, and its routing half stays consistent.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "ferry_test.h"
#include "moe/moe_internal.h"

static ferry_moe_trace *gen(const char *model, uint32_t tokens, uint64_t seed)
{
    ferry_moe_gen_options go = FERRY_MOE_GEN_OPTIONS_INIT;
    go.model = model;
    go.tokens = tokens;
    go.seed = seed;
    ferry_moe_trace *t = NULL;
    FT_ASSERT_OK(ferry_moe_trace_generate(&go, &t));
    return t;
}

static double rate(const ferry_moe_trace *t, const char *policy, uint32_t slots)
{
    ferry_moe_replay_result r;
    FT_ASSERT_OK(ferry_moe_replay(t, policy, slots, 0, &r));
    return 100.0 * r.hit_rate;
}

static uint32_t share(const ferry_moe_trace *t, double pct)
{
    const ferry_moe_model *m = ferry_moe_trace_model(t);
    return (uint32_t)((double)m->num_layers * m->num_experts * pct / 100.0);
}

static void auto_follows_the_better_of_lru_and_routing(void **state)
{
    (void)state;
    struct {
        const char *model;
        double pct;
    } cases[] = {{"mixtral-8x7b", 25}, {"mixtral-8x7b", 12.5}, {"qwen3-30b-a3b", 12.5},
                 {"qwen3-30b-a3b", 25}};
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        ferry_moe_trace *t = gen(cases[c].model, 512, 2);
        uint32_t slots = share(t, cases[c].pct);
        double lru = rate(t, "lru", slots), rt = rate(t, "routing", slots);
        double au = rate(t, "auto", slots), bel = rate(t, "belady", slots);
        double best = lru > rt ? lru : rt;
        print_message("%s %.1f%%: lru %.2f routing %.2f auto %.2f belady %.2f\n",
                      cases[c].model, cases[c].pct, lru, rt, au, bel);
        if (au < lru - 0.2)
            fail_msg("%s at %.1f%%: auto %.2f, more than 0.2 below lru %.2f", cases[c].model,
                     cases[c].pct, au, lru);
        if (au < best - 1.0)
            fail_msg("%s at %.1f%%: auto %.2f, a point below the better policy %.2f",
                     cases[c].model, cases[c].pct, au, best);
        if (cases[c].pct == 12.5 && au < lru + 0.1 * (bel - lru))
            fail_msg("%s at 12.5%%: auto %.2f below lru + a tenth of the gap to belady %.2f",
                     cases[c].model, au, lru + 0.1 * (bel - lru));
        ferry_moe_trace_destroy(t);
    }
    /* where routing loses (Mixtral at 25%), auto is LRU within a hair */
    ferry_moe_trace *t = gen("mixtral-8x7b", 512, 2);
    uint32_t slots = share(t, 25);
    assert_true(rate(t, "routing", slots) < rate(t, "lru", slots));
    ferry_moe_trace_destroy(t);
}

static void auto_is_deterministic_and_listed(void **state)
{
    (void)state;
    int listed = 0;
    for (const char *const *p = ferry_moe_policies(); *p; p++)
        listed += !strcmp(*p, "auto");
    assert_int_equal(listed, 1);
    assert_non_null(ferry_moe_policy_describe("auto"));
    ferry_moe_trace *t = gen("qwen3-30b-a3b", 64, 5);
    ferry_moe_replay_result a, b;
    FT_ASSERT_OK(ferry_moe_replay(t, "auto", share(t, 12.5), 0, &a));
    FT_ASSERT_OK(ferry_moe_replay(t, "auto", share(t, 12.5), 0, &b));
    assert_int_equal(a.hits, b.hits);
    assert_int_equal(a.evictions, b.evictions);
    assert_string_equal(a.policy, "auto");
    ferry_moe_trace_destroy(t);
}

/* every step: the step's experts resident, the routing half consistent,
 * through prefetches, a resize and a budget below a step */
static void auto_keeps_its_structures_through_a_trace(void **state)
{
    (void)state;
    ferry_moe_trace *t = gen("qwen3-30b-a3b", 48, 3);
    const ferry_moe_model *m = ferry_moe_trace_model(t);
    ferry_moe_planner_options o = FERRY_MOE_PLANNER_OPTIONS_INIT;
    o.num_layers = m->num_layers;
    o.num_experts = m->num_experts;
    o.slots = share(t, 6.25);
    o.policy = "auto";
    ferry_moe_planner *p;
    FT_ASSERT_OK(ferry_moe_planner_create(&o, &p));
    size_t n = ferry_moe_trace_steps(t);
    for (size_t i = 0; i < n; i++) {
        uint32_t tok, layer, k;
        const uint32_t *ex;
        FT_ASSERT_OK(ferry_moe_trace_step(t, i, &tok, &layer, &ex, &k));
        FT_ASSERT_OK(ferry_moe_planner_ensure(p, layer, ex, k, NULL, NULL, NULL));
        for (uint32_t j = 0; j < k; j++)
            assert_true(ferry_moe_planner_lookup(p, layer, ex[j]) != FERRY_MOE_NONE);
        if (i + 1 < n && i % 3 == 0) {
            FT_ASSERT_OK(ferry_moe_trace_step(t, i + 1, &tok, &layer, &ex, &k));
            assert_true(ferry_moe_planner_prefetch(p, layer, ex, k, NULL) >= 0);
        }
        if (i == n / 2)
            assert_true(ferry_moe_planner_resize(p, o.slots / 2) >= 0);
        char why[256];
        if (ferry__routing_check(ferry__auto_routing(ferry__planner_policy(p)), why,
                                 sizeof why) < 0)
            fail_msg("step %zu: %s", i, why);
        /* the shadow's lists follow the real policy's model */
        if (ferry__routing_check(ferry__auto_shadow_routing(ferry__planner_policy(p)), why,
                                 sizeof why) < 0)
            fail_msg("step %zu, shadow: %s", i, why);
    }
    ferry_moe_planner_destroy(p);
    ferry_moe_trace_destroy(t);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(auto_follows_the_better_of_lru_and_routing),
        cmocka_unit_test(auto_is_deterministic_and_listed),
        cmocka_unit_test(auto_keeps_its_structures_through_a_trace),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
