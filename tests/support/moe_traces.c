/*
 * moe_traces.c - the MoE tests' shared traces and replays (moe_traces.h).
 */
#include "moe_traces.h"

#include <stdio.h>
#include <string.h>

#include "ferry_test.h"
#include "moe/moe_internal.h"

ferry_moe_planner *ft_moe_mk(uint32_t L, uint32_t E, uint32_t slots, const char *policy,
                             const ferry_moe_trace *oracle)
{
    ferry_moe_planner_options o = FERRY_MOE_PLANNER_OPTIONS_INIT;
    o.num_layers = L;
    o.num_experts = E;
    o.slots = slots;
    o.policy = policy;
    o.oracle = oracle;
    ferry_moe_planner *p = NULL;
    FT_ASSERT_OK(ferry_moe_planner_create(&o, &p));
    return p;
}

ferry_moe_geometry ft_moe_geom(uint32_t L, uint32_t E, uint32_t slots, size_t width)
{
    ferry_moe_geometry g = FERRY_MOE_GEOMETRY_INIT;
    g.num_layers = L;
    g.num_experts = E;
    g.slots = slots;
    g.banks = 1;
    g.row_bytes[0] = width;
    return g;
}

ferry_moe_trace *ft_moe_gen(const char *model, uint32_t tokens, uint64_t seed)
{
    ferry_moe_gen_options go = FERRY_MOE_GEN_OPTIONS_INIT;
    go.model = model;
    go.tokens = tokens;
    go.seed = seed;
    ferry_moe_trace *t = NULL;
    FT_ASSERT_OK(ferry_moe_trace_generate(&go, &t));
    return t;
}

uint32_t ft_moe_share(const ferry_moe_trace *t, double pct)
{
    const ferry_moe_model *m = ferry_moe_trace_model(t);
    return (uint32_t)((double)m->num_layers * m->num_experts * pct / 100.0);
}

ferry_moe_planner *ft_moe_planner(const ferry_moe_trace *t, const char *policy, uint32_t slots)
{
    const ferry_moe_model *mo = ferry_moe_trace_model(t);
    ferry_moe_planner_options o = FERRY_MOE_PLANNER_OPTIONS_INIT;
    o.num_layers = mo->num_layers;
    o.num_experts = mo->num_experts;
    o.top_k = mo->top_k;
    o.slots = slots;
    o.policy = policy;
    ferry_moe_planner *p = NULL;
    FT_ASSERT_OK(ferry_moe_planner_create(&o, &p));
    return p;
}

double ft_moe_rate(const ferry_moe_trace *t, const char *policy, uint32_t slots)
{
    ferry_moe_replay_result r;
    FT_ASSERT_OK(ferry_moe_replay(t, policy, slots, 0, &r));
    return 100.0 * r.hit_rate;
}

void ft_moe_policy_listed_and_deterministic(const char *policy, double pct)
{
    int listed = 0;
    for (const char *const *p = ferry_moe_policies(); *p; p++)
        listed += !strcmp(*p, policy);
    assert_int_equal(listed, 1);
    assert_non_null(ferry_moe_policy_describe(policy));
    ferry_moe_trace *t = ft_moe_gen("qwen3-30b-a3b", 64, 5);
    ferry_moe_replay_result a, b;
    FT_ASSERT_OK(ferry_moe_replay(t, policy, ft_moe_share(t, pct), 0, &a));
    FT_ASSERT_OK(ferry_moe_replay(t, policy, ft_moe_share(t, pct), 0, &b));
    assert_int_equal(a.hits, b.hits);
    assert_int_equal(a.evictions, b.evictions);
    assert_string_equal(a.policy, policy);
    ferry_moe_trace_destroy(t);
}

void ft_moe_duel_follows(const char *duel, const char *member)
{
    struct {
        const char *model;
        double pct;
    } cases[] = {{"mixtral-8x7b", 25}, {"mixtral-8x7b", 12.5}, {"qwen3-30b-a3b", 12.5},
                 {"qwen3-30b-a3b", 25}};
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        ferry_moe_trace *t = ft_moe_gen(cases[c].model, 512, 2);
        uint32_t slots = ft_moe_share(t, cases[c].pct);
        double lru = ft_moe_rate(t, "lru", slots), mb = ft_moe_rate(t, member, slots);
        double du = ft_moe_rate(t, duel, slots), bel = ft_moe_rate(t, "belady", slots);
        double best = lru > mb ? lru : mb;
        print_message("%s %.1f%%: lru %.2f %s %.2f %s %.2f belady %.2f\n", cases[c].model,
                      cases[c].pct, lru, member, mb, duel, du, bel);
        if (du < lru - 0.2)
            fail_msg("%s at %.1f%%: %s %.2f, more than 0.2 below lru %.2f", cases[c].model,
                     cases[c].pct, duel, du, lru);
        if (du < best - 1.0)
            fail_msg("%s at %.1f%%: %s %.2f, a point below the better policy %.2f",
                     cases[c].model, cases[c].pct, duel, du, best);
        if (cases[c].pct == 12.5 && du < lru + 0.1 * (bel - lru))
            fail_msg("%s at 12.5%%: %s %.2f below lru + a tenth of the gap to belady %.2f",
                     cases[c].model, duel, du, lru + 0.1 * (bel - lru));
        ferry_moe_trace_destroy(t);
    }
}

void ft_moe_drive(ferry_moe_planner *p, const ferry_moe_trace *t, uint32_t resize_to,
                  void (*each)(const ferry_moe_planner *p, size_t step))
{
    size_t n = ferry_moe_trace_steps(t);
    for (size_t i = 0; i < n; i++) {
        uint32_t tok, layer, k;
        const uint32_t *ex;
        FT_ASSERT_OK(ferry_moe_trace_step(t, i, &tok, &layer, &ex, &k));
        FT_ASSERT_OK(ferry_moe_planner_ensure(p, layer, ex, k, NULL, NULL, NULL));
        if (resize_to) {
            for (uint32_t j = 0; j < k; j++)
                assert_true(ferry_moe_planner_lookup(p, layer, ex[j]) != FERRY_MOE_NONE);
            if (i + 1 < n && i % 3 == 0) {
                FT_ASSERT_OK(ferry_moe_trace_step(t, i + 1, &tok, &layer, &ex, &k));
                assert_true(ferry_moe_planner_prefetch(p, layer, ex, k, NULL) >= 0);
            }
            if (i == n / 2)
                assert_true(ferry_moe_planner_resize(p, resize_to) >= 0);
        }
        if (each)
            each(p, i);
    }
}

void ft_moe_hits_jumping(const ferry_moe_trace *t, const char *policy, uint32_t slots, size_t at,
                         void (*jump)(ferry__policy *pol, uint64_t visits_before), uint64_t *hits,
                         uint64_t *misses)
{
    ferry_moe_planner *p = ft_moe_planner(t, policy, slots);
    uint32_t L = ferry_moe_trace_model(t)->num_layers;
    for (size_t i = 0; i < ferry_moe_trace_steps(t); i++) {
        if (i == at && jump)
            jump((ferry__policy *)ferry__planner_policy(p), at / L);
        uint32_t tok, layer, k;
        const uint32_t *ex;
        FT_ASSERT_OK(ferry_moe_trace_step(t, i, &tok, &layer, &ex, &k));
        FT_ASSERT_OK(ferry_moe_planner_ensure(p, layer, ex, k, NULL, NULL, NULL));
    }
    ferry_moe_planner_stats st = FERRY_MOE_PLANNER_STATS_INIT;
    ferry_moe_planner_stats_get(p, &st);
    *hits = st.hits;
    *misses = st.misses;
    ferry_moe_planner_destroy(p);
}

ferry_moe_trace *ft_moe_pair_trace(uint32_t L, uint32_t tokens, uint32_t switch_tenths, uint64_t seed)
{
    assert_true(L >= 1 && L <= 64);
    ferry_moe_model m = {.num_layers = L, .num_experts = 64, .top_k = 2};
    snprintf(m.name, sizeof m.name, "pair-%u", switch_tenths);
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
            if (ferry__rng_below(&r, 10) < switch_tenths)
                cur[l] ^= 1;
            uint32_t ex[2] = {cyc[l][cur[l]], 0};
            do
                ex[1] = ferry__rng_below(&r, 64);
            while (ex[1] == cyc[l][0] || ex[1] == cyc[l][1]);
            FT_ASSERT_OK(ferry_moe_trace_append(t, tk, l, ex, 2));
        }
    return t;
}

ferry_moe_trace *ft_moe_context_trace(uint32_t L, uint32_t tokens, uint64_t seed)
{
    assert_true(L >= 1 && L <= 64);
    ferry_moe_model m = {.num_layers = L, .num_experts = 64, .top_k = 2};
    snprintf(m.name, sizeof m.name, "context");
    ferry_moe_trace *t;
    FT_ASSERT_OK(ferry_moe_trace_create(&m, &t));
    ferry__rng r;
    ferry__rng_seed(&r, seed);
    uint32_t hot[64][4], next[64];
    for (uint32_t l = 0; l < L; l++) {
        for (uint32_t i = 0; i < 4; i++)
            hot[l][i] = (l * 7 + i * 16 + 3) % 64;
        next[l] = hot[l][0];
    }
    for (uint32_t tk = 0; tk < tokens; tk++)
        for (uint32_t l = 0; l < L; l++) {
            uint32_t ex[2] = {next[l], 0};
            int is_hot;
            do {
                ex[1] = ferry__rng_below(&r, 64);
                is_hot = 0;
                for (uint32_t i = 0; i < 4; i++)
                    is_hot |= ex[1] == hot[l][i];
            } while (is_hot);
            next[l] = ferry__rng_below(&r, 10) < 9 ? hot[l][ex[1] % 4]
                                                   : hot[l][ferry__rng_below(&r, 4)];
            FT_ASSERT_OK(ferry_moe_trace_append(t, tk, l, ex, 2));
        }
    return t;
}
