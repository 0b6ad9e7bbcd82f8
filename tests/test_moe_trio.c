/*
 * test_moe_trio.c - the "trio" policy (the three-way duel that was auto until
 * auto became the cheaper lru-successor duel) follows the best of LRU, the
 * routing policy and the transition policy: on a trace where routing loses
 * to LRU it stays with LRU, where routing wins it takes at least a tenth
 * of the LRU -> Belady gap, where only transition learns the structure it
 * follows transition; it is deterministic, listed, and its routing half
 * stays consistent; while LRU leads its learners sleep off the sampled
 * layers (exact on those, half the work); a challenger takes the lead
 * only past one standard deviation of the score difference. A policy's
 * line that names a duel it is in names one whose line names it.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "ferry_test.h"
#include "moe_traces.h"
#include "moe/moe_internal.h"

static void trio_follows_the_better_of_lru_and_routing(void **state)
{
    (void)state;
    ft_moe_duel_follows("trio", "routing");
    /* where routing loses (Mixtral at 25%), trio is LRU within a hair */
    ferry_moe_trace *t = ft_moe_gen("mixtral-8x7b", 512, 2);
    uint32_t slots = ft_moe_share(t, 25);
    assert_true(ft_moe_rate(t, "routing", slots) < ft_moe_rate(t, "lru", slots));
    ferry_moe_trace_destroy(t);
}

/* the context trace: only transition learns which hot expert follows a
 * context, and at a tight budget that is worth hits; trio takes it, from
 * shadows that start cold */
static void trio_follows_transition_where_it_learns_more(void **state)
{
    (void)state;
    ferry_moe_trace *t = ft_moe_context_trace(4, 4000, 11);
    uint32_t slots = 4 + 2;
    double lru = ft_moe_rate(t, "lru", slots), rt = ft_moe_rate(t, "routing", slots);
    double tr = ft_moe_rate(t, "transition", slots), au = ft_moe_rate(t, "trio", slots);
    print_message("context trace, %u slots: lru %.2f routing %.2f transition %.2f trio %.2f\n", slots, lru,
                  rt, tr, au);
    if (tr < (lru > rt ? lru : rt) + 5.0)
        fail_msg("the trace does not tell transition apart: %.2f against %.2f / %.2f", tr, lru, rt);
    if (au < tr - 1.0)
        fail_msg("trio %.2f, a point below transition %.2f", au, tr);
    ferry_moe_trace_destroy(t);
}

static void trio_is_deterministic_and_listed(void **state)
{
    (void)state;
    ft_moe_policy_listed_and_deterministic("trio", 12.5);
}

/* a policy whose line says it is "one of X's" members is named on X's
 * line (transition is one of trio's three, not of auto's two) */
static void policy_lines_name_the_duels_they_are_in(void **state)
{
    (void)state;
    int claims = 0;
    for (const char *const *p = ferry_moe_policies(); *p; p++) {
        const char *line = ferry_moe_policy_describe(*p);
        assert_non_null(line);
        const char *at = strstr(line, "one of ");
        if (!at)
            continue;
        char duel[32];
        size_t n = strcspn(at + 7, "'");
        assert_true(n > 0 && n < sizeof duel);
        memcpy(duel, at + 7, n);
        duel[n] = '\0';
        const char *of = ferry_moe_policy_describe(duel);
        if (!of || !strstr(of, *p))
            fail_msg("%s's line says it is one of %s's, whose line is \"%s\"", *p, duel,
                     of ? of : "(no such policy)");
        claims++;
    }
    assert_true(claims > 0);
}

/* trio's routing and its shadow (which follows the real policy's model)
 * consistent after a step */
static void check_routing_halves(const ferry_moe_planner *p, size_t i)
{
    char why[256];
    if (ferry__routing_check(ferry__auto_routing(ferry__planner_policy(p)), why, sizeof why) < 0)
        fail_msg("step %zu: %s", i, why);
    if (ferry__routing_check(ferry__auto_shadow_routing(ferry__planner_policy(p)), why,
                             sizeof why) < 0)
        fail_msg("step %zu, shadow: %s", i, why);
}

/* every step: the step's experts resident, the routing half consistent,
 * through prefetches, a resize and a budget below a step */
static void trio_keeps_its_structures_through_a_trace(void **state)
{
    (void)state;
    ferry_moe_trace *t = ft_moe_gen("qwen3-30b-a3b", 48, 3);
    const ferry_moe_model *m = ferry_moe_trace_model(t);
    ferry_moe_planner_options o = FERRY_MOE_PLANNER_OPTIONS_INIT;
    o.num_layers = m->num_layers;
    o.num_experts = m->num_experts;
    o.slots = ft_moe_share(t, 6.25);
    o.policy = "trio";
    ferry_moe_planner *p;
    FT_ASSERT_OK(ferry_moe_planner_create(&o, &p));
    ft_moe_drive(p, t, o.slots / 2, check_routing_halves);
    ferry_moe_planner_destroy(p);
    ferry_moe_trace_destroy(t);
}

/* set dueling's followers pay for the winner only: while LRU leads, trio's
 * routing and transition sleep off the layers their shadows sample (those
 * stay exact: the shadows read them). On a 58-layer trace at a budget
 * where every policy hits alike (the tie goes to LRU): on the sampled
 * layers both match a lone routing and a lone transition cell for cell at
 * every step, and trio's transition does less than half the lone one's
 * counted work */
static void trio_learners_sleep_while_lru_leads(void **state)
{
    (void)state;
    ferry_moe_trace *t = ft_moe_gen("deepseek-v3", 24, 1);
    const ferry_moe_model *mo = ferry_moe_trace_model(t);
    uint32_t slots = 4096, E = mo->num_experts; /* 24 x 58 x 8 routes fit: no eviction */
    uint32_t stride = (mo->num_layers + 15) / 16; /* trio samples at most 16 layers */
    ferry_moe_planner *au = ft_moe_planner(t, "trio", slots);
    ferry_moe_planner *tr = ft_moe_planner(t, "transition", slots);
    ferry_moe_planner *rt = ft_moe_planner(t, "routing", slots);
    const ferry__policy *at = ferry__auto_transition(ferry__planner_policy(au));
    const ferry__policy *ar = ferry__auto_routing(ferry__planner_policy(au));
    const ferry__policy *lt = ferry__planner_policy(tr), *lr = ferry__planner_policy(rt);
    assert_non_null(at);
    size_t n = ferry_moe_trace_steps(t);
    for (size_t i = 0; i < n; i++) {
        uint32_t tok, layer, k;
        const uint32_t *ex;
        FT_ASSERT_OK(ferry_moe_trace_step(t, i, &tok, &layer, &ex, &k));
        FT_ASSERT_OK(ferry_moe_planner_ensure(au, layer, ex, k, NULL, NULL, NULL));
        FT_ASSERT_OK(ferry_moe_planner_ensure(tr, layer, ex, k, NULL, NULL, NULL));
        FT_ASSERT_OK(ferry_moe_planner_ensure(rt, layer, ex, k, NULL, NULL, NULL));
        long d = ferry__transition_cells_differ(at, lt);
        if (d != 0)
            fail_msg("step %zu: %ld cells of trio's transition differ", i, d);
        for (uint32_t id = layer * E; layer % stride == 0 && id < (layer + 1) * E; id++)
            if (ferry__routing_cell(ar, id) != ferry__routing_cell(lr, id))
                fail_msg("step %zu: expert %u in trio's routing cell %u, alone %u", i, id,
                         ferry__routing_cell(ar, id), ferry__routing_cell(lr, id));
        char why[256];
        if (ferry__routing_check(ar, why, sizeof why) < 0)
            fail_msg("step %zu: %s", i, why);
    }
    assert_int_equal(ferry__auto_lead(ferry__planner_policy(au), NULL), 0); /* LRU */
    uint64_t wa = ferry__transition_ops(at), wb = ferry__transition_ops(lt);
    print_message("trio's transition %.1f ops a step, alone %.1f\n", (double)wa / (double)n,
                  (double)wb / (double)n);
    if (wa * 2 > wb)
        fail_msg("trio's transition works %.1f a step while LRU leads, alone %.1f",
                 (double)wa / (double)n, (double)wb / (double)n);
    ferry_moe_planner_destroy(au);
    ferry_moe_planner_destroy(tr);
    ferry_moe_planner_destroy(rt);
    ferry_moe_trace_destroy(t);
}

/* the switching rule: a challenger ahead by less than one standard
 * deviation of the score difference stays out, one clearly ahead takes
 * over, a tie keeps the leader; and on a trace the rule holds back noise
 * while a clearly better policy still takes the lead (the context trace) */
static void trio_switches_only_past_the_noise(void **state)
{
    (void)state;
    /* sd 4: ahead by 3 or by exactly 4 is noise, by 4.5 or 10 it is not */
    assert_false(ferry__auto_overtakes(103.0, 100.0, 16.0));
    assert_false(ferry__auto_overtakes(104.0, 100.0, 16.0));
    assert_true(ferry__auto_overtakes(104.5, 100.0, 16.0));
    assert_true(ferry__auto_overtakes(110.0, 100.0, 16.0));
    /* a tie, or behind, never takes over, whatever the variance */
    assert_false(ferry__auto_overtakes(100.0, 100.0, 0.0));
    assert_false(ferry__auto_overtakes(99.0, 100.0, 0.0));
    /* one more hit at each of 9 steps: D 9, sd 3 - it takes over */
    assert_true(ferry__auto_overtakes(9.0, 0.0, 9.0));
    /* +3, -3, +3, -3, +3 (D 3, sd sqrt 45): it does not */
    assert_false(ferry__auto_overtakes(3.0, 0.0, 45.0));
    /* on the context trace transition is clearly better and leads */
    ferry_moe_trace *t = ft_moe_context_trace(4, 4000, 11);
    ferry_moe_planner *p = ft_moe_planner(t, "trio", 4 + 2);
    ft_moe_drive(p, t, 0, NULL);
    uint64_t sw = 0;
    assert_int_equal(ferry__auto_lead(ferry__planner_policy(p), &sw), 2); /* transition */
    print_message("context trace: transition leads after %llu switches\n", (unsigned long long)sw);
    ferry_moe_planner_destroy(p);
    ferry_moe_trace_destroy(t);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(trio_follows_the_better_of_lru_and_routing),
        cmocka_unit_test(trio_follows_transition_where_it_learns_more),
        cmocka_unit_test(trio_is_deterministic_and_listed),
        cmocka_unit_test(policy_lines_name_the_duels_they_are_in),
        cmocka_unit_test(trio_keeps_its_structures_through_a_trace),
        cmocka_unit_test(trio_learners_sleep_while_lru_leads),
        cmocka_unit_test(trio_switches_only_past_the_noise),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
