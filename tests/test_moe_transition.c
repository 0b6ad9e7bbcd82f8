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

static uint32_t share(const ferry_moe_trace *t, double pct)
{
    const ferry_moe_model *m = ferry_moe_trace_model(t);
    return (uint32_t)((double)m->num_layers * m->num_experts * pct / 100.0);
}

static double rate(const ferry_moe_trace *t, const char *policy, uint32_t slots)
{
    ferry_moe_replay_result r;
    FT_ASSERT_OK(ferry_moe_replay(t, policy, slots, 0, &r));
    return 100.0 * r.hit_rate;
}

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
    ferry_moe_trace *t = gen(model, 96, 3);
    const ferry_moe_model *mo = ferry_moe_trace_model(t);
    ferry_moe_planner_options o = FERRY_MOE_PLANNER_OPTIONS_INIT;
    o.num_layers = mo->num_layers;
    o.num_experts = mo->num_experts;
    o.slots = share(t, pct);
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
    ferry_moe_trace *t = gen("qwen3-30b-a3b", 64, 5);
    ferry_moe_replay_result a, b;
    FT_ASSERT_OK(ferry_moe_replay(t, "transition", share(t, 25), 0, &a));
    FT_ASSERT_OK(ferry_moe_replay(t, "transition", share(t, 25), 0, &b));
    assert_int_equal(a.hits, b.hits);
    assert_int_equal(a.evictions, b.evictions);
    assert_string_equal(a.policy, "transition");
    ferry_moe_trace_destroy(t);
}

/* each layer: a "sticky" expert of two (a at token t is a again at t+1,
 * nine times in ten, else the other one: a names b at t+1), beside a
 * route drawn from the other 62 experts. The policy learns that the
 * sticky one follows itself and the drawn one does not; LRU keeps the
 * drawn ones as long */
static ferry_moe_trace *sticky_trace(uint32_t L, uint32_t tokens, uint64_t seed)
{
    ferry_moe_model m = {.num_layers = L, .num_experts = 64, .top_k = 2};
    snprintf(m.name, sizeof m.name, "sticky");
    ferry_moe_trace *t;
    FT_ASSERT_OK(ferry_moe_trace_create(&m, &t));
    ferry__rng r;
    ferry__rng_seed(&r, seed);
    uint32_t cyc[64][2], cur[64] = {0};
    for (uint32_t l = 0; l < L; l++) /* a layer's own pair */
        for (uint32_t i = 0; i < 2; i++)
            cyc[l][i] = (l * 7 + i * 32 + 3) % 64;
    for (uint32_t tk = 0; tk < tokens; tk++)
        for (uint32_t l = 0; l < L; l++) {
            if (ferry__rng_below(&r, 10) == 0)
                cur[l] ^= 1;
            uint32_t ex[2] = {cyc[l][cur[l]], 0};
            do
                ex[1] = ferry__rng_below(&r, 64);
            while (ex[1] == cyc[l][0] || ex[1] == cyc[l][1]);
            FT_ASSERT_OK(ferry_moe_trace_append(t, tk, l, ex, 2));
        }
    return t;
}

static void transition_beats_lru_on_a_transition_structure(void **state)
{
    (void)state;
    ferry_moe_trace *t = sticky_trace(4, 4000, 11);
    uint32_t slots = 4 + 2; /* the sticky ones and a step: not LRU's window */
    double lru = rate(t, "lru", slots), tr = rate(t, "transition", slots);
    double bel = rate(t, "belady", slots);
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
    ferry_moe_trace *t = sticky_trace(4, 140000, 5);
    double lru = rate(t, "lru", 6), tr = rate(t, "transition", 6);
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
