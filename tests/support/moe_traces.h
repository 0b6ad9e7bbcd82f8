/*
 * moe_traces.h - set-ups, traces and replays the MoE tests share: a
 * planner or a geometry of a shape, a generator trace, a share of a
 * trace's experts as slots, a planner for a trace, a replay's hit rate,
 * and a trace with a learnable same-layer token-to-token structure.
 */
#ifndef FERRY_TEST_MOE_TRACES_H
#define FERRY_TEST_MOE_TRACES_H

#include <stddef.h>
#include <stdint.h>

#include "ferry/moe.h"

/* a planner of L layers of E experts with `slots`, `policy` and `oracle`
 * (both may be NULL: the defaults) (fails the test on an error) */
ferry_moe_planner *ft_moe_mk(uint32_t L, uint32_t E, uint32_t slots, const char *policy,
                             const ferry_moe_trace *oracle);
/* L layers of E experts in `slots`, one bank of rows `width` bytes */
ferry_moe_geometry ft_moe_geom(uint32_t L, uint32_t E, uint32_t slots, size_t width);
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
/* a set-dueling policy against one of its members on generator routing
 * (Mixtral and Qwen3, 512 tokens, at 12.5% and 25%): never 0.2 below LRU,
 * never a point below the better of LRU and the member, and at 12.5% at
 * least LRU plus a tenth of the LRU -> Belady gap (fails the test if not) */
void ft_moe_duel_follows(const char *duel, const char *member);
/* every step of t through p; with resize_to, checked too: each step's
 * experts resident after it, the next step prefetched every third, the
 * slots resized to resize_to halfway; each(p, step) after each step
 * (NULL: none) */
void ft_moe_drive(ferry_moe_planner *p, const ferry_moe_trace *t, uint32_t resize_to,
                  void (*each)(const ferry_moe_planner *p, size_t step));
/* a replay of t under policy at `slots`, jump(policy, visits of each
 * layer so far) called before step `at` (none: NULL); its hits, misses */
typedef struct ferry__policy ferry__policy;
void ft_moe_hits_jumping(const ferry_moe_trace *t, const char *policy, uint32_t slots, size_t at,
                         void (*jump)(ferry__policy *pol, uint64_t visits_before), uint64_t *hits,
                         uint64_t *misses);
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
