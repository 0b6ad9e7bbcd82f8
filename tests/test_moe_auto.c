/*
 * test_moe_auto.c - "auto", the planner's default: LRU or the successor
 * policy, whichever hits more lately in shadow caches of sampled layers.
 * On generator traces it stays within a point of the better of the two
 * and never 0.2 below LRU; where only successor learns the structure (the
 * context trace) it takes the lead; every victim its successor names, real
 * or shadow, is a scan's, through prefetches, hints, a resize and a wake;
 * while LRU leads its successor sleeps (rows and window only) and wakes
 * with every expert in the class a successor that never slept gives it;
 * its work per layer-step once full does not grow with the slots.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "ferry_test.h"
#include "moe_traces.h"
#include "moe/moe_internal.h"

static void auto_follows_the_better_of_lru_and_successor(void **state)
{
    (void)state;
    ft_moe_duel_follows("auto", "successor");
}

/* the context trace: only the learned successors tell which hot expert
 * follows a context; auto takes successor's lead from a cold start */
static void auto_takes_successor_where_it_learns_more(void **state)
{
    (void)state;
    ferry_moe_trace *t = ft_moe_context_trace(4, 4000, 11);
    uint32_t slots = 4 + 2;
    double lru = ft_moe_rate(t, "lru", slots), sc = ft_moe_rate(t, "successor", slots);
    double au = ft_moe_rate(t, "auto", slots);
    print_message("context trace, %u slots: lru %.2f successor %.2f auto %.2f\n", slots, lru, sc,
                  au);
    if (sc < lru + 5.0)
        fail_msg("the trace does not tell successor apart: %.2f against %.2f", sc, lru);
    if (au < sc - 1.0)
        fail_msg("auto %.2f, a point below successor %.2f", au, sc);
    ferry_moe_planner *p = ft_moe_planner(t, "auto", slots);
    ft_moe_drive(p, t, 0, NULL);
    uint64_t sw = 0;
    assert_int_equal(ferry__auto_lead(ferry__planner_policy(p), &sw), 1); /* successor */
    print_message("context trace: successor leads after %llu switches\n", (unsigned long long)sw);
    ferry_moe_planner_destroy(p);
    ferry_moe_trace_destroy(t);
}

static void auto_is_deterministic_and_listed(void **state)
{
    (void)state;
    ft_moe_policy_listed_and_deterministic("auto", 12.5);
}

/* a replay of t at `slots` through prefetches and a resize, every
 * step's experts resident after it; the lead changes it saw */
static uint64_t replay_checked(const ferry_moe_trace *t, uint32_t slots)
{
    ferry_moe_planner *p = ft_moe_planner(t, "auto", slots);
    ft_moe_drive(p, t, slots - slots / 8, NULL);
    uint64_t switches = 0;
    (void)ferry__auto_lead(ferry__planner_policy(p), &switches);
    ferry_moe_planner_destroy(p);
    return switches;
}

/* every victim of auto's successor or its shadow is the one a scan of
 * its slots names, through prefetches, a resize, and the successor's
 * sleeps and wakes as the lead changes: on the context trace (6 layers)
 * and generated Mixtral routing (32 x 8), every layer sampled, and on
 * generated Qwen3 routing (48 x 128: a third sampled, the rest asleep
 * while LRU leads, woken when successor takes the lead) */
static void auto_victims_are_the_scans_through_a_trace(void **state)
{
    (void)state;
    ferry__successor_verify(1);
    ferry_moe_trace *t = ft_moe_context_trace(6, 3000, 4);
    uint64_t sw = replay_checked(t, 24);
    ferry_moe_trace_destroy(t);
    t = ft_moe_gen("mixtral-8x7b", 160, 3);
    sw += replay_checked(t, ft_moe_share(t, 12.5)) + replay_checked(t, ft_moe_share(t, 25));
    ferry_moe_trace_destroy(t);
    t = ft_moe_gen("qwen3-30b-a3b", 160, 3);
    uint64_t swq = replay_checked(t, ft_moe_share(t, 12.5)) + replay_checked(t, ft_moe_share(t, 25));
    ferry_moe_trace_destroy(t);
    print_message("qwen3: %llu lead changes\n", (unsigned long long)swq);
    assert_true(swq >= 1); /* (a wake of the layers that slept) */
    sw += swq;
    uint64_t checked, bad;
    ferry__successor_verified(&checked, &bad);
    ferry__successor_verify(0);
    print_message("%llu victims checked, %llu lead changes\n", (unsigned long long)checked,
                  (unsigned long long)sw);
    assert_true(sw >= 2);
    assert_true(checked > 10000);
    assert_int_equal(bad, 0);
}

/* set dueling pays for the winner only: while LRU leads (a budget where
 * nothing is evicted, so every policy ties and the tie goes to LRU),
 * auto's successor classes only the layers its shadow samples - exactly
 * as a lone successor does, at every step - and learns rows and window
 * elsewhere; woken, it gives every expert the lone one's class */
static void auto_successor_sleeps_while_lru_leads_and_wakes_as_if_awake(void **state)
{
    (void)state;
    ferry_moe_trace *t = ft_moe_gen("deepseek-v3", 24, 1);
    const ferry_moe_model *mo = ferry_moe_trace_model(t);
    uint32_t E = mo->num_experts, ids = mo->num_layers * E;
    uint32_t stride = (mo->num_layers + 15) / 16; /* auto samples at most 16 layers */
    ferry_moe_planner *au = ft_moe_planner(t, "auto", 4096); /* 24 x 58 x 8 routes fit */
    ferry_moe_planner *sc = ft_moe_planner(t, "successor", 4096);
    ferry__policy *as = (ferry__policy *)ferry__auto_successor(ferry__planner_policy(au));
    const ferry__policy *lone = ferry__planner_policy(sc);
    assert_non_null(as);
    assert_non_null(ferry__auto_shadow_successor(ferry__planner_policy(au)));
    size_t n = ferry_moe_trace_steps(t);
    for (size_t i = 0; i < n; i++) {
        uint32_t tok, layer, k;
        const uint32_t *ex;
        FT_ASSERT_OK(ferry_moe_trace_step(t, i, &tok, &layer, &ex, &k));
        FT_ASSERT_OK(ferry_moe_planner_ensure(au, layer, ex, k, NULL, NULL, NULL));
        FT_ASSERT_OK(ferry_moe_planner_ensure(sc, layer, ex, k, NULL, NULL, NULL));
        for (uint32_t id = layer * E; layer % stride == 0 && id < (layer + 1) * E; id++)
            if (ferry__successor_class(as, id) != ferry__successor_class(lone, id))
                fail_msg("step %zu: expert %u in auto's class %u, alone %u", i, id,
                         ferry__successor_class(as, id), ferry__successor_class(lone, id));
    }
    assert_int_equal(ferry__auto_lead(ferry__planner_policy(au), NULL), 0); /* LRU */
    uint64_t wa = ferry__successor_ops(as), wb = ferry__successor_ops(lone);
    print_message("auto's successor %.1f ops a step while LRU leads, alone %.1f\n",
                  (double)wa / (double)n, (double)wb / (double)n);
    if (wa * 2 > wb)
        fail_msg("auto's successor works %.1f a step while LRU leads, alone %.1f",
                 (double)wa / (double)n, (double)wb / (double)n);
    uint32_t differ = 0, classed = 0;
    for (uint32_t id = 0; id < ids; id++)
        differ += ferry__successor_class(as, id) != ferry__successor_class(lone, id);
    print_message("%u of %u experts in another class while asleep\n", differ, ids);
    assert_true(differ > 0); /* (the sleeping layers were not classed) */
    FT_ASSERT_OK(ferry__successor_sleep(as, 0));
    for (uint32_t id = 0; id < ids; id++) {
        uint32_t a = ferry__successor_class(as, id), b = ferry__successor_class(lone, id);
        if (a != b)
            fail_msg("expert %u: class %u after the wake, %u never asleep", id, a, b);
        classed += b != 0;
    }
    print_message("%u of %u experts out of class 0\n", classed, ids);
    assert_true(classed > ids / 8);
    assert_int_equal(ferry__successor_sleep(NULL, 0), -EINVAL);
    assert_int_equal(ferry__successor_sleep((ferry__policy *)ferry__planner_policy(au), 0), -EINVAL);
    ferry_moe_planner_destroy(au);
    ferry_moe_planner_destroy(sc);
    ferry_moe_trace_destroy(t);
}

/* the work of auto's successor (its classes, its victims and its
 * shadow's) per layer-step once the slots are full, at DeepSeek-V3's
 * shape: flat from 1024 to 8192 slots, where a scan of the residents
 * would grow eightfold */
static double auto_work_when_full(const ferry_moe_trace *t, uint32_t slots)
{
    ferry_moe_planner *p = ft_moe_planner(t, "auto", slots);
    const ferry__policy *sc = ferry__auto_successor(ferry__planner_policy(p));
    assert_non_null(sc);
    uint64_t missed = 0, total = 0, steps = 0;
    for (size_t i = 0; i < ferry_moe_trace_steps(t); i++) {
        uint32_t tok, layer, k;
        const uint32_t *ex;
        FT_ASSERT_OK(ferry_moe_trace_step(t, i, &tok, &layer, &ex, &k));
        uint64_t before = ferry__successor_ops(sc);
        ferry_moe_counts c;
        FT_ASSERT_OK(ferry_moe_planner_ensure(p, layer, ex, k, NULL, NULL, &c));
        if (missed >= slots) {
            total += ferry__successor_ops(sc) - before;
            steps++;
        }
        missed += c.missing;
    }
    ferry_moe_planner_destroy(p);
    assert_true(steps > 5000);
    return (double)total / (double)steps;
}

static void auto_steady_work_does_not_grow_with_slots(void **state)
{
    (void)state;
    ferry_moe_trace *t = ft_moe_gen("deepseek-v3", 512, 1);
    double m1 = auto_work_when_full(t, 1024), m2 = auto_work_when_full(t, 8192);
    print_message("full: 1024 slots %.1f ops a step, 8192 slots %.1f\n", m1, m2);
    if (m2 > 1.25 * m1)
        fail_msg("work grows with slots once full: %.1f at 1024, %.1f at 8192", m1, m2);
    ferry_moe_trace_destroy(t);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(auto_follows_the_better_of_lru_and_successor),
        cmocka_unit_test(auto_takes_successor_where_it_learns_more),
        cmocka_unit_test(auto_is_deterministic_and_listed),
        cmocka_unit_test(auto_victims_are_the_scans_through_a_trace),
        cmocka_unit_test(auto_successor_sleeps_while_lru_leads_and_wakes_as_if_awake),
        cmocka_unit_test(auto_steady_work_does_not_grow_with_slots),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
