/*
 * test_moe_victims.c - the victim structures of "transition" and "trio" (the three-way duel)
 * against their references, on randomized routing: every victim the
 * per-layer lists name is the one a scan of all the slots names by the
 * same rule (ties included), and the work of a layer-step - counted, not
 * timed - stays flat from 512 to 4096 to 32768 slots.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry_test.h"
#include "moe_traces.h"
#include "moe/moe_internal.h"

/* randomized decode routing: L layers of E experts, top-k; each layer
 * draws from its own shuffled popularity, 1 / (flat + rank), and with chance
 * repeat_pct% keeps each of its last set's experts (so recency and
 * transitions both carry something, and equal keys are common) */
static ferry_moe_trace *random_trace(uint32_t L, uint32_t E, uint32_t k, uint32_t tokens,
                                     uint32_t repeat_pct, double flat, uint64_t seed)
{
    ferry_moe_model m = {.num_layers = L, .num_experts = E, .top_k = k};
    snprintf(m.name, sizeof m.name, "random-%u", (unsigned)seed);
    ferry_moe_trace *t;
    FT_ASSERT_OK(ferry_moe_trace_create(&m, &t));
    ferry__rng r;
    ferry__rng_seed(&r, seed);
    uint32_t *perm = malloc((size_t)L * E * sizeof *perm), *last = calloc((size_t)L * k, sizeof *last);
    uint8_t *in = calloc(E, 1);
    double *cdf = malloc((size_t)E * sizeof *cdf), sum = 0;
    assert_true(perm && last && in && cdf);
    for (uint32_t e = 0; e < E; e++)
        cdf[e] = (sum += 1.0 / (flat + e));
    for (uint32_t l = 0; l < L; l++) {
        uint32_t *p = perm + (size_t)l * E;
        for (uint32_t e = 0; e < E; e++)
            p[e] = e;
        for (uint32_t e = E - 1; e > 0; e--) {
            uint32_t j = ferry__rng_below(&r, e + 1), x = p[e];
            p[e] = p[j];
            p[j] = x;
        }
    }
    uint32_t ex[64];
    assert_true(k <= 64 && k <= E);
    for (uint32_t tk = 0; tk < tokens; tk++)
        for (uint32_t l = 0; l < L; l++) {
            uint32_t n = 0;
            for (uint32_t i = 0; tk && i < k; i++)
                if (ferry__rng_below(&r, 100) < repeat_pct)
                    ex[n++] = last[(size_t)l * k + i];
            for (uint32_t i = 0; i < n; i++)
                in[ex[i]] = 1;
            while (n < k) {
                double u = ferry__rng_unit(&r) * sum;
                uint32_t lo = 0, hi = E - 1;
                while (lo < hi) {
                    uint32_t mid = (lo + hi) / 2;
                    if (cdf[mid] > u)
                        hi = mid;
                    else
                        lo = mid + 1;
                }
                uint32_t e = perm[(size_t)l * E + lo];
                if (!in[e]) {
                    in[e] = 1;
                    ex[n++] = e;
                }
            }
            for (uint32_t i = 0; i < n; i++) {
                in[ex[i]] = 0;
                last[(size_t)l * k + i] = ex[i];
            }
            FT_ASSERT_OK(ferry_moe_trace_append(t, tk, l, ex, n));
        }
    free(perm);
    free(last);
    free(in);
    free(cdf);
    return t;
}

/* a replay with every victim checked against the scan: how many were
 * checked, and the planner's evictions */
static uint64_t verified_replay(const ferry_moe_trace *t, const char *policy, uint32_t slots,
                                uint64_t *evictions)
{
    uint64_t c, bad;
    ferry_moe_replay_result r;
    ferry__transition_verify(1);
    FT_ASSERT_OK(ferry_moe_replay(t, policy, slots, 0, &r));
    ferry__transition_verified(&c, &bad);
    ferry__transition_verify(0);
    if (bad)
        fail_msg("%s at %u slots: %llu of %llu victims differ from the scan's", policy, slots,
                 (unsigned long long)bad, (unsigned long long)c);
    *evictions = r.evictions;
    return c;
}

/* randomized routing, several shapes and budgets: transition's every
 * eviction (its planner asks it for each) and every victim of trio's
 * transition (real or shadow) is the scan's */
static void victims_are_the_scans_on_random_routing(void **state)
{
    (void)state;
    static const struct {
        uint32_t L, E, k, repeat;
    } shapes[] = {{6, 32, 4, 30}, {12, 64, 8, 50}, {3, 16, 2, 10}, {8, 128, 6, 70}};
    uint64_t total = 0;
    for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++)
        for (uint64_t seed = 1; seed <= 3; seed++) {
            ferry_moe_trace *t = random_trace(shapes[s].L, shapes[s].E, shapes[s].k, 300,
                                              shapes[s].repeat, 1.0, seed * 17 + s);
            uint32_t ids = shapes[s].L * shapes[s].E;
            uint32_t budgets[] = {shapes[s].k, ids / 16, ids / 8, ids / 4, ids / 2};
            for (size_t b = 0; b < sizeof budgets / sizeof *budgets; b++) {
                uint32_t slots = budgets[b] < shapes[s].k ? shapes[s].k : budgets[b];
                uint64_t ev, ev_trio;
                uint64_t c = verified_replay(t, "transition", slots, &ev);
                /* every eviction compared: the planner asks for each */
                assert_int_equal(c, ev);
                total += c;
                total += verified_replay(t, "trio", slots, &ev_trio);
            }
            ferry_moe_trace_destroy(t);
        }
    print_message("%llu victims compared with the scan\n", (unsigned long long)total);
    assert_true(total > 200000);
}

/* transition's counted work (events, filings, layers and cells visited)
 * per layer-step after the first token, in a planner of `policy` at
 * `slots`: for trio, its transition and that one's shadow together */
static double work_per_step(const ferry_moe_trace *t, const char *policy, uint32_t slots,
                            uint64_t *evictions)
{
    ferry_moe_planner *p = ft_moe_planner(t, policy, slots);
    const ferry__policy *pol = ferry__planner_policy(p), *a = pol, *b = NULL;
    if (!strcmp(policy, "trio")) {
        a = ferry__auto_transition(pol);
        b = ferry__auto_shadow_transition(pol);
        assert_non_null(a);
        assert_non_null(b);
    }
    size_t n = ferry_moe_trace_steps(t);
    uint64_t total = 0, counted = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t tok, layer, k;
        const uint32_t *ex;
        FT_ASSERT_OK(ferry_moe_trace_step(t, i, &tok, &layer, &ex, &k));
        uint64_t before = ferry__transition_ops(a) + (b ? ferry__transition_ops(b) : 0);
        FT_ASSERT_OK(ferry_moe_planner_ensure(p, layer, ex, k, NULL, NULL, NULL));
        uint64_t d = ferry__transition_ops(a) + (b ? ferry__transition_ops(b) : 0) - before;
        if (tok == 0)
            continue;
        total += d;
        counted++;
    }
    ferry_moe_planner_stats st = FERRY_MOE_PLANNER_STATS_INIT;
    FT_ASSERT_OK(ferry_moe_planner_stats_get(p, &st));
    *evictions = st.evictions;
    ferry_moe_planner_destroy(p);
    return (double)total / (double)counted;
}

/* 128 layers x 512 experts (65536 ids), top-8: at 512, 4096 and 32768
 * slots every budget evicts all along, and the work of a step stays
 * flat where a scan of the slots would grow 64-fold (it falls: fewer
 * misses, fewer victims) */
static void work_per_step_is_flat_in_the_slots(void **state)
{
    (void)state;
    ferry_moe_trace *t = random_trace(128, 512, 8, 160, 10, 512.0, 11);
    const uint32_t slots[] = {512, 4096, 32768};
    const char *pols[] = {"transition", "trio"};
    for (size_t p = 0; p < 2; p++) {
        double w[3];
        for (size_t i = 0; i < 3; i++) {
            uint64_t ev;
            w[i] = work_per_step(t, pols[p], slots[i], &ev);
            print_message("%s at %u slots: %.1f ops a layer-step, %llu evictions\n", pols[p],
                          slots[i], w[i], (unsigned long long)ev);
            assert_true(ev > 5000); /* each budget evicts all along */
        }
        for (size_t i = 1; i < 3; i++)
            if (w[i] > 1.25 * w[0])
                fail_msg("%s: %.1f ops a step at %u slots, %.1f at %u", pols[p], w[0], slots[0],
                         w[i], slots[i]);
    }
    ferry_moe_trace_destroy(t);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(victims_are_the_scans_on_random_routing),
        cmocka_unit_test(work_per_step_is_flat_in_the_slots),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
