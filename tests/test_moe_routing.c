/*
 * test_moe_routing.c - the routing policy's O(1) structures: per-(layer,
 * cell) lists, rank bitmaps and the tournament over layers stay consistent
 * with the planner (checked after every call), the victim is the furthest
 * predicted use of any listed slot, no current-step expert is evicted (with
 * prefetches in between), runs are deterministic, and resize, forget and
 * prefill keep the structures whole; layers put to sleep wake to the
 * cells they would have had; past 2^32 tokens and learned turns it
 * decides as before, and past 2^32 routes of one expert its cells stay.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry_test.h"
#include "moe/moe_internal.h"
#include "moe_traces.h"

static ferry_moe_trace *gen(const char *model, uint32_t tokens, uint32_t layers, uint32_t experts,
                            uint64_t seed)
{
    ferry_moe_gen_options go = FERRY_MOE_GEN_OPTIONS_INIT;
    go.model = model;
    go.tokens = tokens;
    go.seed = seed;
    go.num_layers = layers;
    go.num_experts = experts;
    ferry_moe_trace *t = NULL;
    FT_ASSERT_OK(ferry_moe_trace_generate(&go, &t));
    return t;
}

static ferry_moe_planner *mk(const ferry_moe_trace *t, uint32_t slots)
{
    const ferry_moe_model *m = ferry_moe_trace_model(t);
    return ft_moe_mk(m->num_layers, m->num_experts, slots, "routing", NULL);
}

static void check(const ferry_moe_planner *p, size_t step)
{
    char why[256] = "";
    int rc = ferry__routing_check(ferry__planner_policy(p), why, sizeof why);
    if (rc != 0)
        fail_msg("after step %zu: %s", step, why);
}

static void structures_stay_consistent_through_a_trace(void **state)
{
    (void)state;
    /* 12 layers x 64 experts, 96 tokens: past the first wait refreshes,
     * with evictions at both budgets */
    ferry_moe_trace *t = gen("qwen3-30b-a3b", 96, 12, 64, 3);
    uint32_t budgets[] = {64, 12 * 64 / 4};
    for (size_t b = 0; b < 2; b++) {
        ferry_moe_planner *p = mk(t, budgets[b]);
        check(p, 0);
        for (size_t i = 0; i < ferry_moe_trace_steps(t); i++) {
            uint32_t tok, layer, n;
            const uint32_t *ex;
            FT_ASSERT_OK(ferry_moe_trace_step(t, i, &tok, &layer, &ex, &n));
            assert_true(ferry_moe_planner_ensure(p, layer, ex, n, NULL, NULL, NULL) >= 0);
            check(p, i);
        }
        ferry_moe_planner_stats st = FERRY_MOE_PLANNER_STATS_INIT;
        ferry_moe_planner_stats_get(p, &st);
        assert_true(st.evictions > 0);
        ferry_moe_planner_destroy(p);
    }
    ferry_moe_trace_destroy(t);
}

/* with prefetches of the next layer between steps (some pinned, listed
 * slots), every routed expert is resident after its ensure, the
 * prefetch never displaces the step's experts, and the structures hold */
static void never_evicts_a_current_step_expert_with_prefetches(void **state)
{
    (void)state;
    ferry_moe_trace *t = gen("small", 200, 0, 0, 5);
    const ferry_moe_model *m = ferry_moe_trace_model(t);
    ferry_moe_planner *p = mk(t, m->num_experts + 4);
    uint32_t slots[64];
    for (size_t i = 0; i < ferry_moe_trace_steps(t); i++) {
        uint32_t tok, layer, n;
        const uint32_t *ex;
        FT_ASSERT_OK(ferry_moe_trace_step(t, i, &tok, &layer, &ex, &n));
        assert_true(n <= 64);
        assert_true(ferry_moe_planner_ensure(p, layer, ex, n, slots, NULL, NULL) >= 0);
        for (uint32_t j = 0; j < n; j++)
            assert_int_equal(ferry_moe_planner_lookup(p, layer, ex[j]), slots[j]);
        check(p, i);
        /* the engine guesses the next layer will reuse this route's ids */
        if (layer + 1 < m->num_layers) {
            ferry_moe_copy_plan plan;
            int rc = ferry_moe_planner_prefetch(p, layer + 1, ex, n, &plan);
            assert_true(rc >= 0 || rc == FERRY_ENOSPACE);
            for (uint32_t j = 0; j < n; j++)
                assert_int_equal(ferry_moe_planner_lookup(p, layer, ex[j]), slots[j]);
            check(p, i);
        }
    }
    ferry_moe_planner_destroy(p);
    ferry_moe_trace_destroy(t);
}

static void same_trace_same_slots(void **state)
{
    (void)state;
    ferry_moe_trace *t = gen("deepseek-v3", 24, 16, 128, 9);
    ferry_moe_planner *a = mk(t, 16 * 128 / 8), *b = mk(t, 16 * 128 / 8);
    uint32_t sa[16], sb[16];
    for (size_t i = 0; i < ferry_moe_trace_steps(t); i++) {
        uint32_t tok, layer, n;
        const uint32_t *ex;
        FT_ASSERT_OK(ferry_moe_trace_step(t, i, &tok, &layer, &ex, &n));
        assert_true(n <= 16);
        assert_int_equal(ferry_moe_planner_ensure(a, layer, ex, n, sa, NULL, NULL),
                         ferry_moe_planner_ensure(b, layer, ex, n, sb, NULL, NULL));
        assert_memory_equal(sa, sb, n * sizeof sa[0]);
    }
    ferry_moe_replay_result ra, rb;
    FT_ASSERT_OK(ferry_moe_replay(t, "routing", 16 * 128 / 8, 0, &ra));
    FT_ASSERT_OK(ferry_moe_replay(t, "routing", 16 * 128 / 8, 0, &rb));
    assert_int_equal(ra.hits, rb.hits);
    assert_int_equal(ra.misses, rb.misses);
    ferry_moe_planner_destroy(a);
    ferry_moe_planner_destroy(b);
    ferry_moe_trace_destroy(t);
}

static void resize_forget_and_prefill_keep_the_structures(void **state)
{
    (void)state;
    ferry_moe_trace *t = gen("qwen3-30b-a3b", 40, 6, 32, 2);
    ferry_moe_planner *p = mk(t, 6 * 32 / 2);
    size_t steps = ferry_moe_trace_steps(t);
    for (size_t i = 0; i < steps; i++) {
        uint32_t tok, layer, n;
        const uint32_t *ex;
        FT_ASSERT_OK(ferry_moe_trace_step(t, i, &tok, &layer, &ex, &n));
        assert_true(ferry_moe_planner_ensure(p, layer, ex, n, NULL, NULL, NULL) >= 0);
        if (i == steps / 4)
            assert_true(ferry_moe_planner_resize(p, 40) >= 0);
        if (i == steps / 2)
            assert_true(ferry_moe_planner_resize(p, 100) >= 0);
        if (i % 7 == 3) {
            uint32_t s = ferry_moe_planner_lookup(p, layer, ex[0]);
            FT_ASSERT_OK(ferry_moe_planner_forget(p, s));
        }
        if (i % 50 == 49)
            assert_true(ferry_moe_planner_prefill(p, layer, NULL, NULL) >= 0);
        check(p, i);
    }
    ferry_moe_planner_destroy(p);
    ferry_moe_trace_destroy(t);
}

/* a layer asleep keeps its experts' features and routed sets, not their
 * cells; woken, each cell is what the features give, as if it had never
 * slept: one routing put to sleep (every 3rd layer awake) and woken every
 * 37 steps against one that never sleeps, the same routes: the
 * structures whole at every step (prefetches too, in the sleeping one),
 * the awake layers' cells equal, and every layer's after each wake (but
 * for the hint bit, which a prefetch only one of them made sets) */
static void sleeping_layers_wake_to_the_cells_they_would_have(void **state)
{
    (void)state;
    ferry_moe_trace *t = gen("qwen3-30b-a3b", 96, 12, 64, 5);
    const ferry_moe_model *m = ferry_moe_trace_model(t);
    uint32_t slots = 12 * 64 / 8;
    ferry_moe_planner *awake = mk(t, slots), *sleepy = mk(t, slots);
    const ferry__policy *a = ferry__planner_policy(awake);
    ferry__policy *z = (ferry__policy *)ferry__planner_policy(sleepy);
    FT_ASSERT_OK(ferry__routing_sleep(z, 3));
    size_t n = ferry_moe_trace_steps(t), wakes = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t tok, layer, k;
        const uint32_t *ex;
        FT_ASSERT_OK(ferry_moe_trace_step(t, i, &tok, &layer, &ex, &k));
        FT_ASSERT_OK(ferry_moe_planner_ensure(awake, layer, ex, k, NULL, NULL, NULL));
        FT_ASSERT_OK(ferry_moe_planner_ensure(sleepy, layer, ex, k, NULL, NULL, NULL));
        if (i + 1 < n && i % 5 == 0) { /* the next step's experts, prefetched */
            FT_ASSERT_OK(ferry_moe_trace_step(t, i + 1, &tok, &layer, &ex, &k));
            assert_true(ferry_moe_planner_prefetch(sleepy, layer, ex, k, NULL) >= 0);
        }
        check(sleepy, i);
        int all = i % 37 == 36;
        if (all) {
            FT_ASSERT_OK(ferry__routing_sleep(z, 0));
            check(sleepy, i);
            wakes++;
        }
        for (uint32_t l = 0; l < m->num_layers; l++)
            for (uint32_t e = 0; (all || l % 3 == 0) && e < m->num_experts; e++)
                if (ferry__routing_cell(a, l * m->num_experts + e) >> 1 !=
                    ferry__routing_cell(z, l * m->num_experts + e) >> 1)
                    fail_msg("step %zu%s: layer %u expert %u: cell %u, never slept %u", i,
                             all ? " (woken)" : "", l, e,
                             ferry__routing_cell(z, l * m->num_experts + e),
                             ferry__routing_cell(a, l * m->num_experts + e));
        if (all)
            FT_ASSERT_OK(ferry__routing_sleep(z, 3));
    }
    print_message("%zu wakes, no cell differed\n", wakes);
    assert_true(wakes > 20);
    assert_int_equal(ferry__routing_sleep(NULL, 3), -EINVAL);
    ferry_moe_planner_destroy(awake);
    ferry_moe_planner_destroy(sleepy);
    ferry_moe_trace_destroy(t);
}

/* t's steps on a planner of `policy` (a prefetch of the next step every
 * 5th, so hints are stamped too); at step `at` (when jump) the tokens
 * leap in whole periods of the ring to 300-316 short of 2^32 and the
 * learned turns in whole refresh periods to 1,000-1,255 short: the rest
 * of the trace crosses both. The structures checked every 64 steps */
static void hits_jumping_tokens(const ferry_moe_trace *t, const char *policy, uint32_t slots,
                                size_t at, int jump, uint64_t *hits, uint64_t *misses)
{
    ferry_moe_planner *p = ft_moe_planner(t, policy, slots);
    const ferry__policy *r = ferry__planner_policy(p);
    if (strcmp(policy, "routing") != 0)
        r = ferry__auto_routing(r);
    assert_non_null(r);
    size_t n = ferry_moe_trace_steps(t);
    for (size_t i = 0; i < n; i++) {
        uint32_t tok, layer, k;
        const uint32_t *ex;
        FT_ASSERT_OK(ferry_moe_trace_step(t, i, &tok, &layer, &ex, &k));
        if (i == at && jump) {
            uint64_t two32 = UINT64_C(1) << 32;
            FT_ASSERT_OK(ferry__planner_skip_tokens(p, (two32 - tok - 300) / 17 * 17,
                                                    (two32 - i - 1000) / 256 * 256));
        }
        FT_ASSERT_OK(ferry_moe_planner_ensure(p, layer, ex, k, NULL, NULL, NULL));
        if (i + 1 < n && i % 5 == 0) {
            FT_ASSERT_OK(ferry_moe_trace_step(t, i + 1, &tok, &layer, &ex, &k));
            assert_true(ferry_moe_planner_prefetch(p, layer, ex, k, NULL) >= 0);
        }
        char why[256] = "";
        if (i % 64 == 0 && ferry__routing_check(r, why, sizeof why) != 0)
            fail_msg("%s, after step %zu: %s", policy, i, why);
    }
    ferry_moe_planner_stats st = FERRY_MOE_PLANNER_STATS_INIT;
    FT_ASSERT_OK(ferry_moe_planner_stats_get(p, &st));
    *hits = st.hits;
    *misses = st.misses;
    ferry_moe_planner_destroy(p);
}

/* a decode server passes 2^32 tokens within months (days for a shallow
 * model) and 2^32 learned turns within days: past both, routing (alone,
 * and as trio's member with its shadow) decides as it did - its features
 * compare tokens, its ring is the token mod 17, its refreshes go by the
 * turn count */
static void routing_decides_alike_past_2_to_the_32_tokens(void **state)
{
    (void)state;
    ferry_moe_trace *t = ft_moe_gen("small", 3000, 7);
    const char *pols[] = {"routing", "trio"};
    for (size_t k = 0; k < 2; k++) {
        uint32_t slots = ft_moe_share(t, 25);
        size_t at = ferry_moe_trace_steps(t) / 2; /* past the early refreshes */
        uint64_t h0, m0, h1, m1;
        hits_jumping_tokens(t, pols[k], slots, at, 0, &h0, &m0);
        hits_jumping_tokens(t, pols[k], slots, at, 1, &h1, &m1);
        print_message("%s: hits %llu / %llu, misses %llu / %llu\n", pols[k],
                      (unsigned long long)h0, (unsigned long long)h1, (unsigned long long)m0,
                      (unsigned long long)m1);
        assert_int_equal(h0, h1);
        assert_int_equal(m0, m1);
    }
    ferry_moe_planner *p = ft_moe_planner(t, "routing", ft_moe_share(t, 25));
    ferry__policy *r = (ferry__policy *)ferry__planner_policy(p);
    assert_int_equal(ferry__routing_skip(NULL, 17, 0), -EINVAL);
    assert_int_equal(ferry__routing_skip(r, 16, 0), -EINVAL);  /* (the ring's phase) */
    assert_int_equal(ferry__routing_skip(r, 17, 255), -EINVAL); /* (the refreshes') */
    assert_int_equal(ferry__routing_skip(r, 17, 256), -EINVAL); /* (early refreshes ahead) */
    assert_int_equal(ferry__planner_skip_tokens(p, 16, 0), -EINVAL);
    FT_ASSERT_OK(ferry__routing_skip(r, 17, 0));
    ferry_moe_planner_destroy(p);
    ferry_moe_trace_destroy(t);
}

/* the cells of a one-layer routing planner's 16 experts after 128 turns
 * that route expert 0 and one of the other 15 in turn (expert 0 in the
 * most popular bucket, the others well inside a lower one), its route
 * counts scaled by 2^shift before turn 64 (none: 0) */
static void cells_after_scaled_routes(uint32_t shift, uint32_t *cells)
{
    ferry_moe_planner_options o = FERRY_MOE_PLANNER_OPTIONS_INIT;
    o.num_layers = 1;
    o.num_experts = 16;
    o.top_k = 2;
    o.slots = 8;
    o.policy = "routing";
    ferry_moe_planner *p = NULL;
    FT_ASSERT_OK(ferry_moe_planner_create(&o, &p));
    ferry__policy *r = (ferry__policy *)ferry__planner_policy(p);
    for (uint32_t t = 0; t < 128; t++) {
        if (t == 64 && shift)
            FT_ASSERT_OK(ferry__routing_scale_routes(r, shift));
        uint32_t ex[2] = {0, 1 + t % 15};
        FT_ASSERT_OK(ferry_moe_planner_ensure(p, 0, ex, 2, NULL, NULL, NULL));
    }
    for (uint32_t e = 0; e < 16; e++)
        cells[e] = ferry__routing_cell(r, e);
    ferry_moe_planner_destroy(p);
}

/* an expert routed at every token passes 2^32 routes as the token count
 * does (its layer's routes, twice as many here, were 64-bit already):
 * with its share kept, its popularity bucket, and every expert's cell,
 * stay as they were (a 32-bit count wrapped to 0 at 2^32 and read the
 * most popular expert as the least) */
static void routing_popularity_alike_past_2_to_the_32_routes(void **state)
{
    (void)state;
    uint32_t want[16], got[16];
    cells_after_scaled_routes(0, want);
    for (uint32_t shift = 25; shift <= 27; shift++) { /* 64 routes of expert 0: 2^31 .. 2^33 */
        cells_after_scaled_routes(shift, got);
        for (uint32_t e = 0; e < 16; e++)
            if (got[e] != want[e])
                fail_msg("routes x 2^%u: expert %u in cell %u, not %u", shift, e, got[e],
                         want[e]);
    }
    assert_int_equal(ferry__routing_scale_routes(NULL, 1), -EINVAL);
    ferry_moe_planner_options o = FERRY_MOE_PLANNER_OPTIONS_INIT;
    o.num_layers = 1;
    o.num_experts = 16;
    o.slots = 8;
    o.policy = "routing";
    ferry_moe_planner *p = NULL;
    FT_ASSERT_OK(ferry_moe_planner_create(&o, &p));
    assert_int_equal(ferry__routing_scale_routes((ferry__policy *)ferry__planner_policy(p), 41),
                     -EINVAL);
    ferry_moe_planner_destroy(p);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(structures_stay_consistent_through_a_trace),
        cmocka_unit_test(never_evicts_a_current_step_expert_with_prefetches),
        cmocka_unit_test(same_trace_same_slots),
        cmocka_unit_test(resize_forget_and_prefill_keep_the_structures),
        cmocka_unit_test(sleeping_layers_wake_to_the_cells_they_would_have),
        cmocka_unit_test(routing_decides_alike_past_2_to_the_32_tokens),
        cmocka_unit_test(routing_popularity_alike_past_2_to_the_32_routes),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
