/*
 * moe_traces.h - traces and replays the MoE tests share: a generator
 * trace, a share of a trace's experts as slots, a planner for a trace, a
 * replay's hit rate, and
 * a trace with a learnable same-layer token-to-token structure.
 */
#ifndef FERRY_TEST_MOE_TRACES_H
#define FERRY_TEST_MOE_TRACES_H

#include <stdint.h>

#include "ferry/moe.h"

/* the generator's trace of a preset (fails the test on an error) */
ferry_moe_trace *ft_moe_gen(const char *model, uint32_t tokens, uint64_t seed);
/* pct % of the trace's layers x experts, as slots */
uint32_t ft_moe_share(const ferry_moe_trace *t, double pct);
/* a planner for t's model (its layers, experts and top_k) with `slots`
 * and `policy` (fails the test on an error) */
ferry_moe_planner *ft_moe_planner(const ferry_moe_trace *t, const char *policy, uint32_t slots);
/* the replay's hit rate in percent */
double ft_moe_rate(const ferry_moe_trace *t, const char *policy, uint32_t slots);
/* a policy is listed once in ferry_moe_policies(), described, and
 * deterministic: two replays of the same generator trace (qwen3-30b-a3b,
 * 64 tokens, seed 5) with pct % of its experts as slots agree on hits and
 * evictions, and name the policy */
void ft_moe_policy_listed_and_deterministic(const char *policy, double pct);
/* L layers (at most 64) of 64 experts, top-2: at each layer one expert of
 * the layer's own pair, which switches to the other of the pair from one
 * token to the next switch_tenths times in ten (1: "sticky", 9:
 * alternating), beside one route drawn from the other 62. A policy that
 * learns transitions keeps the pair's next one; LRU keeps the drawn ones
 * as long */
ferry_moe_trace *ft_moe_pair_trace(uint32_t L, uint32_t tokens, uint32_t switch_tenths,
                                   uint64_t seed);
/* L layers (at most 64) of 64 experts, top-2: at each layer one of the
 * layer's four hot experts, beside a context expert drawn from the other
 * 60 that names the next token's hot one (the context's number mod 4,
 * nine times in ten; else a hot one at random). Every hot expert is as
 * frequent and as recent as the others: only a policy that learns what
 * follows the context knows which of them to keep */
ferry_moe_trace *ft_moe_context_trace(uint32_t L, uint32_t tokens, uint64_t seed);

#endif
