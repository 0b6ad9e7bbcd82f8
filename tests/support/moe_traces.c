/*
 * moe_traces.c - the MoE tests' shared traces and replays (moe_traces.h).
 */
#include "moe_traces.h"

#include <stdio.h>
#include <string.h>

#include "ferry_test.h"
#include "moe/moe_internal.h"

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
