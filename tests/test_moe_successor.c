/*
 * test_moe_successor.c - the opt-in "successor" policy: listed and
 * deterministic; every victim is the one a scan of all the slots names by
 * the same rule (generator and structured traces, budgets from top_k to
 * half the ids, and with prefetches and hints pinning other layers'
 * residents); the work of a layer-step once the slots are full does
 * not grow with the slots; on traces whose routes follow a same-layer
 * token-to-token structure it beats LRU clearly at a tight budget; shapes
 * whose model is too large are refused, and a bad step leaves the planner
 * usable.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry_test.h"
#include "moe_traces.h"
#include "moe/moe_internal.h"

static void successor_is_listed_and_deterministic(void **state)
{
    (void)state;
    ft_moe_policy_listed_and_deterministic("successor", 12.5);
    ft_moe_policy_listed_and_deterministic("successor", 25);
}

static uint64_t verify_replay(const ferry_moe_trace *t, uint32_t slots)
{
    uint64_t c, bad;
    ferry_moe_replay_result r;
    ferry__successor_verify(1);
    FT_ASSERT_OK(ferry_moe_replay(t, "successor", slots, 0, &r));
    ferry__successor_verified(&c, &bad);
    ferry__successor_verify(0);
    if (bad)
        fail_msg("successor at %u slots: %llu of %llu victims differ from the scan's", slots,
                 (unsigned long long)bad, (unsigned long long)c);
    assert_int_equal(r.evictions, c);
    return c;
}

/* the cached layers' least, the skipped layers and the early stop choose
 * what a scan of every slot chooses (ties included: every class starts
 * at its prior, so equal p are many) */
static void successor_victims_match_the_scan(void **state)
{
    (void)state;
    const char *models[] = {"qwen3-30b-a3b", "mixtral-8x7b", "small", "deepseek-v3"};
    const double pcts[] = {6.25, 12.5, 25, 50};
    uint64_t checked = 0;
    for (size_t i = 0; i < 4; i++) {
        ferry_moe_trace *t = ft_moe_gen(models[i], i == 3 ? 48 : 160, 7);
        for (size_t j = 0; j < 4; j++)
            checked += verify_replay(t, ft_moe_share(t, pcts[j]));
        ferry_moe_trace_destroy(t);
    }
    ferry_moe_trace *t = ft_moe_pair_trace(4, 3000, 1, 3);
    checked += verify_replay(t, 6) + verify_replay(t, 40);
    ferry_moe_trace_destroy(t);
    t = ft_moe_context_trace(6, 3000, 4);
    checked += verify_replay(t, 12) + verify_replay(t, 24);
    ferry_moe_trace_destroy(t);
    print_message("%llu victims, each as the scan's\n", (unsigned long long)checked);
    assert_true(checked > 50000);
}

/* the work of a layer-step once the slots are full: its mean, the most
 * of one, and how many steps */
static void work_when_full(const ferry_moe_trace *t, uint32_t slots, double *mean, uint64_t *most,
                           uint64_t *steps)
{
    ferry_moe_planner *p = ft_moe_planner(t, "successor", slots);
    const ferry__policy *pol = ferry__planner_policy(p);
    uint64_t missed = 0, total = 0;
    *most = *steps = 0;
    for (size_t i = 0; i < ferry_moe_trace_steps(t); i++) {
        uint32_t tok, layer, k;
        const uint32_t *ex;
        FT_ASSERT_OK(ferry_moe_trace_step(t, i, &tok, &layer, &ex, &k));
        uint64_t before = ferry__successor_ops(pol);
        ferry_moe_counts c;
        FT_ASSERT_OK(ferry_moe_planner_ensure(p, layer, ex, k, NULL, NULL, &c));
        uint64_t d = ferry__successor_ops(pol) - before;
        if (missed >= slots) { /* full before the step */
            total += d;
            *most = d > *most ? d : *most;
            ++*steps;
        }
        missed += c.missing;
    }
    *mean = *steps ? (double)total / (double)*steps : 0;
    ferry_moe_planner_destroy(p);
}

/* at DeepSeek-V3's shape (58 x 256, top-8), once the slots are full, the
 * work of a layer-step does not grow when the slots go from 1024 to 8192,
 * where a scan of the residents would grow eightfold */
static void successor_steady_work_does_not_grow_with_slots(void **state)
{
    (void)state;
    ferry_moe_trace *t = ft_moe_gen("deepseek-v3", 512, 1);
    double m1, m2;
    uint64_t x1, x2, n1, n2;
    work_when_full(t, 1024, &m1, &x1, &n1);
    work_when_full(t, 8192, &m2, &x2, &n2);
    print_message("full: 1024 slots %.1f ops a step (most %llu, %llu steps); 8192 slots %.1f "
                  "(most %llu, %llu steps)\n",
                  m1, (unsigned long long)x1, (unsigned long long)n1, m2, (unsigned long long)x2,
                  (unsigned long long)n2);
    assert_true(n1 > 20000 && n2 > 5000); /* both long past full */
    if (m2 > 1.25 * m1)
        fail_msg("work grows with slots once full: %.1f at 1024, %.1f at 8192", m1, m2);
    ferry_moe_trace_destroy(t);
}

/* routes whose next one at a layer follows from this one: the successor
 * rows keep it where LRU keeps the drawn ones as long */
static void successor_beats_lru_on_a_transition_structure(void **state)
{
    (void)state;
    ferry_moe_trace *t = ft_moe_pair_trace(4, 4000, 1, 11);
    double lru = ft_moe_rate(t, "lru", 6), sc = ft_moe_rate(t, "successor", 6);
    print_message("pair trace, 6 slots: lru %.2f successor %.2f\n", lru, sc);
    if (sc < lru + 10.0)
        fail_msg("successor %.2f not 10 points above lru %.2f", sc, lru);
    ferry_moe_trace_destroy(t);
    t = ft_moe_context_trace(4, 4000, 2);
    lru = ft_moe_rate(t, "lru", 12);
    sc = ft_moe_rate(t, "successor", 12);
    print_message("context trace, 12 slots: lru %.2f successor %.2f\n", lru, sc);
    if (sc < lru + 5.0)
        fail_msg("successor %.2f not 5 points above lru %.2f", sc, lru);
    ferry_moe_trace_destroy(t);
}

static void successor_refuses_huge_shapes(void **state)
{
    (void)state;
    ferry_moe_planner_options o = FERRY_MOE_PLANNER_OPTIONS_INIT;
    o.policy = "successor";
    o.slots = 64;
    ferry_moe_planner *p = NULL;
    o.num_layers = 1024; /* 4 M ids at about 110 bytes each */
    o.num_experts = 4096;
    assert_int_equal(ferry_moe_planner_create(&o, &p), -EINVAL);
    assert_null(p);
    assert_non_null(strstr(ferry_last_error(), "successor"));
    assert_non_null(strstr(ferry_last_error(), "bytes"));
    o.num_layers = FERRY_MOE_MAX_LAYERS;
    o.num_experts = FERRY_MOE_MAX_EXPERTS;
    assert_int_equal(ferry_moe_planner_create(&o, &p), -EINVAL);
    assert_null(p);
    o.num_layers = 58; /* DeepSeek-V3: 1.6 MiB */
    o.num_experts = 256;
    FT_ASSERT_OK(ferry_moe_planner_create(&o, &p));
    assert_true(ferry__successor_bytes(58, 256) < ((size_t)2 << 20));
    /* a bad step (an expert out of range, more experts than slots) is
     * refused before the policy sees it; the planner goes on */
    uint32_t bad[2] = {3, 256}, many[65], out[8];
    for (uint32_t i = 0; i < 65; i++)
        many[i] = i;
    assert_true(ferry_moe_planner_ensure(p, 0, bad, 2, NULL, NULL, NULL) < 0);
    assert_true(ferry_moe_planner_ensure(p, 58, bad, 1, NULL, NULL, NULL) < 0);
    assert_true(ferry_moe_planner_ensure(p, 0, many, 65, NULL, NULL, NULL) < 0);
    uint32_t ok[2] = {3, 4};
    FT_ASSERT_OK(ferry_moe_planner_ensure(p, 0, ok, 2, out, NULL, NULL));
    assert_true(out[0] < 64 && out[1] < 64 && out[0] != out[1]);
    ferry_moe_planner_destroy(p);
}

/* a layer's least resident is cached between victims; pins that come
 * without a step of that layer (a prefetch naming its residents, a
 * hinted victim kept for the round) must not leave the cache naming a
 * pinned slot (the planner then refused the prefetch: "every one of 12
 * slots is pinned"), nor pins that ended leave it passing over the true
 * least (victims that differed from the scan's): with prefetches of other
 * layers and hints of a layer a token or more ahead, every call succeeds
 * and every victim is the scan's ("transition" runs the same calls) */
static void successor_victims_skip_pins_of_prefetches_and_hints(void **state)
{
    (void)state;
    const char *pols[] = {"transition", "successor"};
    for (size_t k = 0; k < FERRY__ARRAY_LEN(pols); k++) {
        ferry_moe_planner_options o = FERRY_MOE_PLANNER_OPTIONS_INIT;
        o.policy = pols[k];
        o.num_layers = 4;
        o.num_experts = 16;
        o.top_k = 2;
        o.slots = 12;
        ferry_moe_planner *p = NULL;
        FT_ASSERT_OK(ferry_moe_planner_create(&o, &p));
        ferry__successor_verify(1);
        uint64_t rng = 12345;
        for (uint32_t step = 0; step < 4000; step++) {
            uint32_t l = step % o.num_layers, ex[3], pf[3], hn[2];
            for (uint32_t i = 0; i < 3; i++) {
                rng = rng * 6364136223846793005ull + 1442695040888963407ull;
                ex[i] = (uint32_t)(rng >> 33) % 6;
                pf[i] = (uint32_t)(rng >> 45) % 6;
            }
            hn[0] = (ex[0] + 1) % 6;
            hn[1] = (ex[1] + 2) % 6;
            int rc = ferry_moe_planner_ensure(p, l, ex, 3, NULL, NULL, NULL);
            if (rc < 0)
                fail_msg("%s: step %u (layer %u): %s", pols[k], step, l, ferry_last_error());
            rc = ferry_moe_planner_prefetch(p, (l + step / 7 % 3 + 1) % o.num_layers, pf, 3, NULL);
            if (rc < 0)
                fail_msg("%s: prefetch after step %u: %s", pols[k], step, ferry_last_error());
            rc = ferry_moe_planner_hint(p, (l + 2) % o.num_layers,
                                        2 + o.num_layers * (step % 3), hn, 2, 1.0);
            if (rc < 0)
                fail_msg("%s: hint after step %u: %s", pols[k], step, ferry_last_error());
        }
        uint64_t checked, bad;
        ferry__successor_verified(&checked, &bad);
        ferry__successor_verify(0);
        ferry_moe_planner_stats st = FERRY_MOE_PLANNER_STATS_INIT;
        FT_ASSERT_OK(ferry_moe_planner_stats_get(p, &st));
        ferry_moe_hint_stats hs = FERRY_MOE_HINT_STATS_INIT;
        FT_ASSERT_OK(ferry_moe_planner_hint_stats_get(p, &hs));
        assert_true(hs.saves > 100); /* (hinted victims kept: soft pins) */
        print_message("%s: %llu evictions (%llu hinted kept), %llu checked, %llu differ\n", pols[k],
                      (unsigned long long)st.evictions, (unsigned long long)hs.saves,
                      (unsigned long long)checked, (unsigned long long)bad);
        if (k == 1) {
            assert_true(checked > 1000);
            assert_int_equal(bad, 0);
        }
        ferry_moe_planner_destroy(p);
    }
}

/* each layer 4,000-12,704 visits short of 2^32 (in whole periods of the
 * ring and the schedules), the clocks 5 touches short: the rest crosses */
static void successor_jump(ferry__policy *pol, uint64_t visits_before)
{
    uint64_t visits = ((UINT64_C(1) << 32) - visits_before - 4000) / 8704 * 8704;
    FT_ASSERT_OK(ferry__successor_skip(pol, visits, (UINT64_C(1) << 32) - 5));
}

/* a decode loop runs a layer 2^32 times in weeks and touches experts 2^32
 * times in a day: past both, the policy decides as it did (its window's
 * ring is the visit count mod 17, its ties the touch clock), every victim
 * still the scan's */
static void successor_decides_alike_past_2_to_the_32_visits(void **state)
{
    (void)state;
    ferry_moe_trace *t = ft_moe_gen("small", 36000, 5); /* 4 x 16: 18,000 visits a layer after */
    uint32_t slots = ft_moe_share(t, 25);
    size_t at = ferry_moe_trace_steps(t) / 2; /* past every layer's early refreshes */
    uint64_t h0, m0, h1, m1;
    ft_moe_hits_jumping(t, "successor", slots, at, NULL, &h0, &m0);
    ferry__successor_verify(1);
    ft_moe_hits_jumping(t, "successor", slots, at, successor_jump, &h1, &m1);
    uint64_t checked, bad;
    ferry__successor_verified(&checked, &bad);
    ferry__successor_verify(0);
    print_message("hits %llu / %llu, misses %llu / %llu; %llu victims checked\n",
                  (unsigned long long)h0, (unsigned long long)h1, (unsigned long long)m0,
                  (unsigned long long)m1, (unsigned long long)checked);
    assert_int_equal(h0, h1);
    assert_int_equal(m0, m1);
    assert_true(checked > 1000);
    assert_int_equal(bad, 0);
    assert_int_equal(ferry__successor_skip(NULL, 0, 0), -EINVAL);
    ferry_moe_planner *p = ft_moe_planner(t, "successor", slots);
    assert_int_equal(ferry__successor_skip((ferry__policy *)ferry__planner_policy(p), 17, 0), -EINVAL);
    ferry_moe_planner_destroy(p);
    ferry_moe_trace_destroy(t);
}

/* an engine that numbers the planner's layers as the model's, dense first
 * layers included, never routes layer 0. The all-layer class counts halved
 * at layer 0's visits alone, so there they grew by E a visit for ever (a
 * whole run's average, not a recent one; past 2^32 within 2^18 visits of
 * 16,384 experts at 32 bits). They halve at the lowest layer counted now:
 * every class stays within two halving periods' worth of members (E x
 * 512 visits each), and none has more routed than members */
static void successor_class_counts_decay_where_layer_0_is_never_routed(void **state)
{
    (void)state;
    ferry_moe_planner_options o = FERRY_MOE_PLANNER_OPTIONS_INIT;
    o.num_layers = 3;
    o.num_experts = 16384;
    o.top_k = 8;
    o.slots = 2048;
    o.policy = "successor";
    ferry_moe_planner *p = NULL;
    FT_ASSERT_OK(ferry_moe_planner_create(&o, &p));
    const ferry__policy *pol = ferry__planner_policy(p);
    uint64_t rng = 11;
    const uint32_t visits = 6000;
    for (uint32_t v = 0; v < visits; v++) { /* layers 1 and 2 alone, 8 of 4,096 hot experts */
        for (uint32_t l = 1; l < 3; l++) {
            uint32_t ex[8];
            for (uint32_t i = 0; i < 8; i++) {
                rng = rng * 6364136223846793005ull + 1442695040888963407ull;
                ex[i] = i * 512 + (uint32_t)(rng >> 40) % 512;
            }
            FT_ASSERT_OK(ferry_moe_planner_ensure(p, l, ex, 8, NULL, NULL, NULL));
        }
    }
    uint64_t most = 0, bound = 2ull * 2 * 16384 * 512; /* two layers, two periods */
    for (uint32_t c = 0; c < 60; c++) {
        uint64_t routed = 0, members = ferry__successor_global(pol, c, &routed);
        if (routed > members)
            fail_msg("class %u: %llu routed of %llu members", c, (unsigned long long)routed,
                     (unsigned long long)members);
        most = members > most ? members : most;
    }
    print_message("largest class: %llu members (at most %llu; %llu visits of 2 x 16,384)\n",
                  (unsigned long long)most, (unsigned long long)bound,
                  (unsigned long long)visits);
    if (most > bound)
        fail_msg("the all-layer class counts never decay: %llu members, bound %llu",
                 (unsigned long long)most, (unsigned long long)bound);
    uint64_t r;
    assert_int_equal(ferry__successor_global(NULL, 0, &r), 0);
    assert_int_equal(ferry__successor_global(pol, 60, &r), 0);
    ferry_moe_planner_destroy(p);
}

/* as above, with the policy asleep off a stride of 2 (auto's follower
 * while LRU leads: ferry__successor_sleep) after a spell awake: layer 1,
 * the lowest routed, sleeps then, and the all-layer counts must go on
 * decaying at the layers still counted (they halved at layer 1's visits
 * alone: never again while it slept) */
static void successor_class_counts_decay_while_the_lowest_layer_sleeps(void **state)
{
    (void)state;
    ferry_moe_planner_options o = FERRY_MOE_PLANNER_OPTIONS_INIT;
    o.num_layers = 4;
    o.num_experts = 16384;
    o.top_k = 8;
    o.slots = 2048;
    o.policy = "successor";
    ferry_moe_planner *p = NULL;
    FT_ASSERT_OK(ferry_moe_planner_create(&o, &p));
    ferry__policy *pol = (ferry__policy *)ferry__planner_policy(p);
    uint64_t rng = 13;
    const uint32_t visits = 6000;
    for (uint32_t v = 0; v < visits; v++) { /* layers 1..3, 8 of 4,096 hot experts */
        if (v == 16)
            FT_ASSERT_OK(ferry__successor_sleep(pol, 2)); /* layers 1 and 3 asleep */
        for (uint32_t l = 1; l < 4; l++) {
            uint32_t ex[8];
            for (uint32_t i = 0; i < 8; i++) {
                rng = rng * 6364136223846793005ull + 1442695040888963407ull;
                ex[i] = i * 512 + (uint32_t)(rng >> 40) % 512;
            }
            FT_ASSERT_OK(ferry_moe_planner_ensure(p, l, ex, 8, NULL, NULL, NULL));
        }
    }
    /* one layer counted, two halving periods */
    uint64_t most = 0, bound = 2ull * 16384 * 512 + 3ull * 16 * 16384;
    for (uint32_t c = 0; c < 60; c++) {
        uint64_t routed = 0, members = ferry__successor_global(pol, c, &routed);
        most = members > most ? members : most;
    }
    print_message("largest class: %llu members (at most %llu)\n", (unsigned long long)most,
                  (unsigned long long)bound);
    if (most > bound)
        fail_msg("the all-layer class counts stopped decaying while layer 1 slept: %llu "
                 "members, bound %llu", (unsigned long long)most, (unsigned long long)bound);
    ferry_moe_planner_destroy(p);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(successor_is_listed_and_deterministic),
        cmocka_unit_test(successor_victims_match_the_scan),
        cmocka_unit_test(successor_steady_work_does_not_grow_with_slots),
        cmocka_unit_test(successor_beats_lru_on_a_transition_structure),
        cmocka_unit_test(successor_refuses_huge_shapes),
        cmocka_unit_test(successor_victims_skip_pins_of_prefetches_and_hints),
        cmocka_unit_test(successor_decides_alike_past_2_to_the_32_visits),
        cmocka_unit_test(successor_class_counts_decay_where_layer_0_is_never_routed),
        cmocka_unit_test(successor_class_counts_decay_while_the_lowest_layer_sleeps),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
