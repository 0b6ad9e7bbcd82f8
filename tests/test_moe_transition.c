/*
 * test_moe_transition.c - the opt-in "transition" policy: through a
 * generator trace every step's experts are resident where the planner
 * says, hits are never moved (a pinned expert is never evicted), the
 * counts add up and two runs agree; on a trace whose routes follow a
 * same-layer token-to-token structure it beats LRU clearly at a tight
 * budget, also after its counters are halved; shapes whose model is too
 * large are refused; layers put to sleep wake to the cells they would
 * have had.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry_test.h"
#include "moe_traces.h"
#include "moe/moe_internal.h"

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
    ferry_moe_trace *t = ft_moe_gen(model, 96, 3);
    const ferry_moe_model *mo = ferry_moe_trace_model(t);
    ferry_moe_planner_options o = FERRY_MOE_PLANNER_OPTIONS_INIT;
    o.num_layers = mo->num_layers;
    o.num_experts = mo->num_experts;
    o.slots = ft_moe_share(t, pct);
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
    ft_moe_policy_listed_and_deterministic("transition", 25);
}

static void transition_beats_lru_on_a_transition_structure(void **state)
{
    (void)state;
    ferry_moe_trace *t = ft_moe_pair_trace(4, 4000, 1, 11);
    uint32_t slots = 4 + 2; /* the sticky ones and a step: not LRU's window */
    double lru = ft_moe_rate(t, "lru", slots), tr = ft_moe_rate(t, "transition", slots);
    double bel = ft_moe_rate(t, "belady", slots);
    print_message("sticky trace, %u slots: lru %.2f transition %.2f belady %.2f\n", slots, lru, tr,
                  bel);
    if (tr < lru + 20.0)
        fail_msg("transition %.2f not 20 points above lru %.2f", tr, lru);
    assert_true(tr <= bel + 1e-9);
    ferry_moe_trace_destroy(t);
}

/* 140,000 tokens: a sticky expert's transition row passes 32,767 and is
 * halved (four times); the policy keeps the sticky ones all along */
static void transition_survives_counter_halving(void **state)
{
    (void)state;
    ferry_moe_trace *t = ft_moe_pair_trace(4, 140000, 1, 5);
    double lru = ft_moe_rate(t, "lru", 6), tr = ft_moe_rate(t, "transition", 6);
    print_message("140000 tokens, 6 slots: lru %.2f transition %.2f\n", lru, tr);
    if (tr < lru + 20.0)
        fail_msg("transition %.2f not 20 points above lru %.2f after halving", tr, lru);
    ferry_moe_trace_destroy(t);
}

/* every victim the lists name, by the lead and by trio's shadow, is the
 * one a scan of all the slots names by the same rule (ties included: the
 * traces start with every cell at its prior, so equal p are many) */
static void verify_replay(const ferry_moe_trace *t, const char *policy, uint32_t slots,
                          uint64_t *checked)
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
    *checked += c;
}

static void transition_lists_choose_as_the_scan(void **state)
{
    (void)state;
    uint64_t checked = 0;
    const char *models[] = {"qwen3-30b-a3b", "mixtral-8x7b", "small"};
    const double pcts[] = {6.25, 12.5, 25, 50};
    for (size_t m = 0; m < sizeof models / sizeof *models; m++) {
        ferry_moe_trace *t = ft_moe_gen(models[m], 96, 4);
        for (size_t i = 0; i < sizeof pcts / sizeof *pcts; i++) {
            verify_replay(t, "transition", ft_moe_share(t, pcts[i]), &checked);
            verify_replay(t, "trio", ft_moe_share(t, pcts[i]), &checked);
        }
        ferry_moe_trace_destroy(t);
    }
    ferry_moe_trace *ctx = ft_moe_context_trace(4, 2000, 3), *pair = ft_moe_pair_trace(4, 2000, 1, 3);
    for (uint32_t slots = 3; slots <= 24; slots *= 2) {
        verify_replay(ctx, "transition", slots, &checked);
        verify_replay(ctx, "trio", slots, &checked);
        verify_replay(pair, "transition", slots, &checked);
    }
    ferry_moe_trace_destroy(ctx);
    ferry_moe_trace_destroy(pair);
    print_message("%llu victims checked against the scan\n", (unsigned long long)checked);
    assert_true(checked > 100000);
}

/* one layer of four experts whose routed pair alternates, A = {0, 1}
 * then B = {2, 3}, at top_k + 1 slots: the cell of least p is the routed
 * pair's (what is routed now never follows itself), whose residents the
 * step pins, so a victim is the least of the next rank (the other pair's,
 * resident, unpinned) */
static void transition_looks_past_a_pinned_least_cell(void **state)
{
    (void)state;
    ferry_moe_model m = {.num_layers = 1, .num_experts = 4, .top_k = 2};
    snprintf(m.name, sizeof m.name, "alternate");
    ferry_moe_trace *t;
    FT_ASSERT_OK(ferry_moe_trace_create(&m, &t));
    for (uint32_t tk = 0; tk < 400; tk++) {
        uint32_t ex[2] = {tk % 2 * 2, tk % 2 * 2 + 1};
        FT_ASSERT_OK(ferry_moe_trace_append(t, tk, 0, ex, 2));
    }
    uint64_t checked = 0;
    verify_replay(t, "transition", 3, &checked);
    verify_replay(t, "trio", 3, &checked);
    print_message("%llu victims checked against the scan\n", (unsigned long long)checked);
    assert_true(checked >= 700);
    ferry_moe_trace_destroy(t);
}

/* shapes whose experts a layer are no multiple of the 8 or 16 ids the
 * vector compares take (1, 3, 5, 17, 33), top_k odd, 1 or all of them,
 * one layer or a few, at top_k, top_k + 1, a quarter and every slot:
 * each victim is the scan's, and the AVX2 forms (the least of a cell, a
 * full row's sums four at a time) decide as the SSE2 and scalar ones do,
 * step by step (the same residents after every step) */
static void transition_odd_shapes_decide_as_the_scan_and_narrow(void **state)
{
    (void)state;
    static const uint32_t shapes[][3] = {{3, 1, 1},  {2, 3, 3},  {3, 5, 3},  {1, 5, 1},
                                         {4, 17, 5}, {2, 17, 17}, {3, 33, 7}, {1, 33, 3},
                                         {2, 33, 33}};
    uint64_t checked = 0, steps = 0;
    for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++) {
        ferry_moe_gen_options go = FERRY_MOE_GEN_OPTIONS_INIT;
        go.tokens = 160;
        go.seed = 3 + i;
        go.num_layers = shapes[i][0];
        go.num_experts = shapes[i][1];
        go.top_k = shapes[i][2];
        ferry_moe_trace *t;
        FT_ASSERT_OK(ferry_moe_trace_generate(&go, &t));
        uint32_t L = shapes[i][0], E = shapes[i][1], K = shapes[i][2];
        uint32_t budgets[] = {K, K + 1, L * E / 4, L * E};
        for (size_t j = 0; j < sizeof budgets / sizeof *budgets; j++) {
            uint32_t slots = budgets[j];
            if (slots < K || slots > L * E)
                continue;
            verify_replay(t, "transition", slots, &checked);
            verify_replay(t, "trio", slots, &checked);
            ferry_moe_planner *w = ft_moe_planner(t, "transition", slots);
            ferry__transition_narrow = 1;
            ferry_moe_planner *nr = ft_moe_planner(t, "transition", slots);
            ferry__transition_narrow = 0;
            size_t n = ferry_moe_trace_steps(t);
            for (size_t s = 0; s < n; s++, steps++) {
                uint32_t tok, layer, k;
                const uint32_t *ex;
                FT_ASSERT_OK(ferry_moe_trace_step(t, s, &tok, &layer, &ex, &k));
                FT_ASSERT_OK(ferry_moe_planner_ensure(w, layer, ex, k, NULL, NULL, NULL));
                FT_ASSERT_OK(ferry_moe_planner_ensure(nr, layer, ex, k, NULL, NULL, NULL));
                for (uint32_t v = 0; v < slots; v++)
                    if (ferry_moe_planner_occupant(w, v) != ferry_moe_planner_occupant(nr, v))
                        fail_msg("%ux%u top-%u at %u slots, step %zu: slot %u holds %u, "
                                 "narrow %u", L, E, K, slots, s, v,
                                 ferry_moe_planner_occupant(w, v),
                                 ferry_moe_planner_occupant(nr, v));
            }
            ferry_moe_planner_destroy(w);
            ferry_moe_planner_destroy(nr);
        }
        ferry_moe_trace_destroy(t);
    }
    print_message("%llu victims checked against the scan, %llu steps against narrow\n",
                  (unsigned long long)checked, (unsigned long long)steps);
    assert_true(checked > 10000);
}

/* a planner's transition work per layer-step on trace t at `slots`:
 * the mean after the first token, and the most of one step */
static void work_per_step(const ferry_moe_trace *t, uint32_t slots, double *mean, uint64_t *most,
                          uint64_t *evictions)
{
    const ferry_moe_model *mo = ferry_moe_trace_model(t);
    ferry_moe_planner_options o = FERRY_MOE_PLANNER_OPTIONS_INIT;
    o.num_layers = mo->num_layers;
    o.num_experts = mo->num_experts;
    o.slots = slots;
    o.policy = "transition";
    ferry_moe_planner *p;
    FT_ASSERT_OK(ferry_moe_planner_create(&o, &p));
    const ferry__policy *pol = ferry__planner_policy(p);
    size_t n = ferry_moe_trace_steps(t);
    uint64_t first = 0, total = 0;
    *most = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t tok, layer, k;
        const uint32_t *ex;
        FT_ASSERT_OK(ferry_moe_trace_step(t, i, &tok, &layer, &ex, &k));
        uint64_t before = ferry__transition_ops(pol);
        FT_ASSERT_OK(ferry_moe_planner_ensure(p, layer, ex, k, NULL, NULL, NULL));
        uint64_t d = ferry__transition_ops(pol) - before;
        if (tok == 0) {
            first += d;
            continue;
        }
        total += d;
        if (d > *most)
            *most = d;
    }
    ferry_moe_planner_stats st = {.size = sizeof st};
    FT_ASSERT_OK(ferry_moe_planner_stats_get(p, &st));
    *evictions = st.evictions;
    *mean = (double)total / (double)(n - mo->num_layers);
    ferry_moe_planner_destroy(p);
}

/* the work of a layer-step - events, filings, layers and cells
 * visited - does not grow with the slots: 8 times the slots, where a
 * scan of a layer's residents would look at 8 times as many */
static void transition_work_does_not_grow_with_slots(void **state)
{
    (void)state;
    ferry_moe_trace *t = ft_moe_gen("qwen3-30b-a3b", 256, 7);
    const ferry_moe_model *mo = ferry_moe_trace_model(t);
    uint32_t small = mo->num_layers * 8, big = small * 8; /* 6.25% and 50% */
    double m1, m2;
    uint64_t x1, x2, e1, e2;
    work_per_step(t, small, &m1, &x1, &e1);
    work_per_step(t, big, &m2, &x2, &e2);
    print_message("%u slots: %.1f ops a step (most %llu), %llu evictions; %u slots: %.1f (most "
                  "%llu), %llu evictions\n",
                  small, m1, (unsigned long long)x1, (unsigned long long)e1, big, m2,
                  (unsigned long long)x2, (unsigned long long)e2);
    assert_true(e1 > 10000 && e2 > 1000); /* both evict all along */
    /* (the mean: a change is filed again at the next victim, so one step
     * can pay for the steps before it) */
    if (m2 > 1.5 * m1)
        fail_msg("work grows with slots: %.1f (most %llu) at %u, %.1f (most %llu) at %u", m1,
                 (unsigned long long)x1, small, m2, (unsigned long long)x2, big);
    ferry_moe_trace_destroy(t);
}

/* the transition work of a layer-step once the slots are full (every
 * miss evicting): its mean over those steps, the most of one, and how
 * many; trio's is its transition's and that one's shadow's */
static void work_when_full(const ferry_moe_trace *t, const char *policy, uint32_t slots,
                           double *mean, uint64_t *most, uint64_t *steps)
{
    ferry_moe_planner *p = ft_moe_planner(t, policy, slots);
    const ferry__policy *pol = ferry__planner_policy(p), *sh = NULL;
    if (!strcmp(policy, "trio")) {
        sh = ferry__auto_shadow_transition(pol);
        pol = ferry__auto_transition(pol);
        assert_non_null(pol);
    }
    uint64_t missed = 0, total = 0;
    *most = *steps = 0;
    for (size_t i = 0; i < ferry_moe_trace_steps(t); i++) {
        uint32_t tok, layer, k;
        const uint32_t *ex;
        FT_ASSERT_OK(ferry_moe_trace_step(t, i, &tok, &layer, &ex, &k));
        uint64_t before = ferry__transition_ops(pol) + (sh ? ferry__transition_ops(sh) : 0);
        ferry_moe_counts c;
        FT_ASSERT_OK(ferry_moe_planner_ensure(p, layer, ex, k, NULL, NULL, &c));
        uint64_t d = ferry__transition_ops(pol) + (sh ? ferry__transition_ops(sh) : 0) - before;
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
 * work of a layer-step does not grow when the slots go from 1024 to 8192
 * - transition alone and as trio's - where a scan of the residents, or a
 * victim that looked at every layer's, would grow with them */
static void transition_steady_work_does_not_grow_with_slots(void **state)
{
    (void)state;
    ferry_moe_trace *t = ft_moe_gen("deepseek-v3", 512, 1);
    const char *pols[] = {"transition", "trio"};
    for (size_t i = 0; i < 2; i++) {
        double m1, m2;
        uint64_t x1, x2, n1, n2;
        work_when_full(t, pols[i], 1024, &m1, &x1, &n1);
        work_when_full(t, pols[i], 8192, &m2, &x2, &n2);
        print_message("%s, full: 1024 slots %.1f ops a step (most %llu, %llu steps); 8192 "
                      "slots %.1f (most %llu, %llu steps)\n",
                      pols[i], m1, (unsigned long long)x1, (unsigned long long)n1, m2,
                      (unsigned long long)x2, (unsigned long long)n2);
        assert_true(n1 > 20000 && n2 > 5000); /* both long past full */
        if (m2 > 1.25 * m1)
            fail_msg("%s: work grows with slots once full: %.1f at 1024, %.1f at 8192", pols[i],
                     m1, m2);
    }
    ferry_moe_trace_destroy(t);
}

static void transition_refuses_huge_shapes(void **state)
{
    (void)state;
    ferry_moe_planner_options o = FERRY_MOE_PLANNER_OPTIONS_INIT;
    o.policy = "transition";
    o.slots = 64;
    ferry_moe_planner *p = NULL;
    /* 1024 x 4096 ids at 133 bytes each: 532 MiB of model */
    o.num_layers = 1024;
    o.num_experts = 4096;
    assert_int_equal(ferry_moe_planner_create(&o, &p), -EINVAL);
    assert_null(p);
    assert_non_null(strstr(ferry_last_error(), "transition"));
    assert_non_null(strstr(ferry_last_error(), "bytes"));
    o.num_layers = FERRY_MOE_MAX_LAYERS;
    o.num_experts = FERRY_MOE_MAX_EXPERTS;
    assert_int_equal(ferry_moe_planner_create(&o, &p), -EINVAL);
    assert_null(p);
    /* DeepSeek-V3's shape (58 x 256) fits: 1.7 MiB; so does one of 64 x
     * 2048, refused while the model held an E x E table a layer */
    o.num_layers = 64;
    o.num_experts = 2048;
    FT_ASSERT_OK(ferry_moe_planner_create(&o, &p));
    ferry_moe_planner_destroy(p);
    o.num_layers = 58;
    o.num_experts = 256;
    FT_ASSERT_OK(ferry_moe_planner_create(&o, &p));
    ferry_moe_planner_destroy(p);
}

/* a layer asleep keeps its rows and routed sets only; woken, every
 * expert's cell is what it would be had the layer never slept: a
 * transition put to sleep (every 3rd layer awake) and woken every
 * `period` steps against one that never sleeps, the same routes, cell for
 * cell at every step (layers asleep skipped), and all of them at each
 * wake. Returns the wakes. */
static size_t sleep_and_wake(uint32_t tokens, size_t period)
{
    ferry_moe_trace *t = ft_moe_gen("qwen3-30b-a3b", tokens, 5);
    uint32_t slots = ft_moe_share(t, 12.5);
    ferry_moe_planner *awake = ft_moe_planner(t, "transition", slots);
    ferry_moe_planner *sleepy = ft_moe_planner(t, "transition", slots);
    const ferry__policy *a = ferry__planner_policy(awake);
    ferry__policy *z = (ferry__policy *)ferry__planner_policy(sleepy);
    FT_ASSERT_OK(ferry__transition_sleep(z, 3));
    size_t n = ferry_moe_trace_steps(t), wakes = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t tok, layer, k;
        const uint32_t *ex;
        FT_ASSERT_OK(ferry_moe_trace_step(t, i, &tok, &layer, &ex, &k));
        FT_ASSERT_OK(ferry_moe_planner_ensure(awake, layer, ex, k, NULL, NULL, NULL));
        FT_ASSERT_OK(ferry_moe_planner_ensure(sleepy, layer, ex, k, NULL, NULL, NULL));
        long d = ferry__transition_cells_differ(a, z);
        if (d != 0)
            fail_msg("step %zu: %ld cells differ from the policy that never slept", i, d);
        if (i % period == period - 1) {
            FT_ASSERT_OK(ferry__transition_sleep(z, 0)); /* all awake: all compared */
            if ((d = ferry__transition_cells_differ(a, z)) != 0)
                fail_msg("woken at step %zu: %ld cells differ", i, d);
            wakes++;
            FT_ASSERT_OK(ferry__transition_sleep(z, 3));
        }
    }
    ferry_moe_planner_destroy(awake);
    ferry_moe_planner_destroy(sleepy);
    ferry_moe_trace_destroy(t);
    return wakes;
}

static void transition_wakes_to_the_cells_it_would_have(void **state)
{
    (void)state;
    /* woken often: a layer sleeps through a visit or two */
    size_t wakes = sleep_and_wake(96, 37);
    print_message("%zu wakes, no cell differed\n", wakes);
    assert_true(wakes > 50);
    /* woken every 20.8 visits of a layer (48 layers): a sleeping layer's
     * rows, learned in batches of 16 visits, have visits pending at most
     * wakes and a batch behind them */
    wakes = sleep_and_wake(400, 997);
    print_message("%zu long sleeps, no cell differed\n", wakes);
    assert_true(wakes >= 19);
    assert_int_equal(ferry__transition_sleep(NULL, 3), -EINVAL);
}

/* the rows counted with AVX2 (where the processor has it) and with SSE2
 * alone, and the cells' counts folded four at a time or one at a time
 * (ferry__transition_narrow), give the same counts: the same hits for
 * transition and trio */
static void transition_rows_count_the_same_narrow(void **state)
{
    (void)state;
    const char *models[] = {"deepseek-v3", "mixtral-8x7b"};
    for (size_t i = 0; i < sizeof models / sizeof *models; i++) {
        ferry_moe_trace *t = ft_moe_gen(models[i], 300, 7);
        uint32_t slots = ft_moe_share(t, 12.5);
        const char *pol[] = {"transition", "trio"};
        for (size_t j = 0; j < 2; j++) {
            ferry_moe_replay_result w, nr;
            FT_ASSERT_OK(ferry_moe_replay(t, pol[j], slots, 0, &w));
            ferry__transition_narrow = 1;
            int rc = ferry_moe_replay(t, pol[j], slots, 0, &nr);
            ferry__transition_narrow = 0;
            FT_ASSERT_OK(rc);
            print_message("%s %s: %llu hits (SSE2: %llu)\n", models[i], pol[j],
                          (unsigned long long)w.hits, (unsigned long long)nr.hits);
            assert_int_equal(w.hits, nr.hits);
            assert_int_equal(w.misses, nr.misses);
            assert_int_equal(w.evictions, nr.evictions);
        }
        ferry_moe_trace_destroy(t);
    }
}

/* the rows' newcomers placed in rounds (AVX2, where the processor has
 * it) as the serial rule places them one at a time (SSE2): the same rows
 * at every step, on rows whose least counts come near the most a count
 * holds (one layer of 17 experts, all routed: a row's 16 lanes each gain
 * one a visit until the total halves them; and 18 of 20 at random, so
 * that a row's least count is one below the most with fewer lanes at it
 * than newcomers, which the serial rule then gives to the first lane at
 * the most, again and again, not one each), on steps of more than 8
 * newcomers a row (top_k 12 of 40: the first 8 in rounds) and on the
 * generator's DeepSeek-V3 */
static void transition_rows_place_as_the_serial_rule(void **state)
{
    (void)state;
    static const uint32_t shapes[][4] = {{1, 17, 17, 33500}, {1, 20, 18, 33500}, {1, 40, 12, 3000},
                                         {3, 33, 9, 1500}};
    for (size_t i = 0; i < 5; i++) {
        ferry_moe_trace *t;
        if (i == 4) {
            t = ft_moe_gen("deepseek-v3", 96, 5);
        } else {
            ferry_moe_model m = {.num_layers = shapes[i][0], .num_experts = shapes[i][1],
                                 .top_k = shapes[i][2]};
            snprintf(m.name, sizeof m.name, "rows");
            FT_ASSERT_OK(ferry_moe_trace_create(&m, &t));
            uint64_t r = 88172645463325252ull + i;
            for (uint32_t tk = 0; tk < shapes[i][3]; tk++)
                for (uint32_t l = 0; l < m.num_layers; l++) {
                    uint32_t ex[64], k = m.top_k, E = m.num_experts, o = 0;
                    r ^= r << 13, r ^= r >> 7, r ^= r << 17;
                    for (uint32_t j = 0; j < k; j++) /* k distinct (layer-local), drifting */
                        ex[j] = (uint32_t)(r % 5 + tk / 7 + j * (j < 4 ? 1 : 3)) % E;
                    for (uint32_t j = 0; j < k && i == 1; j++) /* (or at random) */
                        ex[j] = (uint32_t)((r >> (j % 48)) + 7 * j) % E;
                    for (uint32_t j = 1; j < k; j++)
                        for (o = 0; o < j; o++)
                            if (ex[o] == ex[j]) {
                                ex[j] = (ex[j] + 1) % E;
                                o = (uint32_t)-1;
                            }
                    FT_ASSERT_OK(ferry_moe_trace_append(t, tk, l, ex, k));
                }
        }
        uint32_t slots = ft_moe_share(t, 25), k0 = t->model.top_k + 1;
        uint32_t ids = t->model.num_layers * t->model.num_experts;
        slots = slots > k0 ? slots : k0;
        slots = slots < ids ? slots : ids;
        ferry_moe_planner *w = ft_moe_planner(t, "transition", slots);
        ferry__transition_narrow = 1;
        ferry_moe_planner *nr = ft_moe_planner(t, "transition", slots);
        ferry__transition_narrow = 0;
        const ferry__policy *a = ferry__planner_policy(w), *z = ferry__planner_policy(nr);
        size_t n = ferry_moe_trace_steps(t);
        for (size_t s = 0; s < n; s++) {
            uint32_t tok, layer, k;
            const uint32_t *ex;
            FT_ASSERT_OK(ferry_moe_trace_step(t, s, &tok, &layer, &ex, &k));
            FT_ASSERT_OK(ferry_moe_planner_ensure(w, layer, ex, k, NULL, NULL, NULL));
            FT_ASSERT_OK(ferry_moe_planner_ensure(nr, layer, ex, k, NULL, NULL, NULL));
            long d = ferry__transition_rows_differ(a, z);
            if (d != 0)
                fail_msg("shape %zu, step %zu: %ld rows differ from the serial rule's", i, s, d);
        }
        print_message("shape %zu: %zu steps, the same rows\n", i, n);
        ferry_moe_planner_destroy(w);
        ferry_moe_planner_destroy(nr);
        ferry_moe_trace_destroy(t);
    }
}

/* the order's keys are below 2^31, renumbered in their order before the
 * clock would pass: a planner whose clock is moved on to 300 below that
 * part way (so that it wraps within a few steps) evicts as one whose is
 * not, step by step, and its clock is renumbered (below the slots) */
static void transition_keys_renumbered_decide_alike(void **state)
{
    (void)state;
    ferry_moe_trace *t = ft_moe_gen("deepseek-v3", 64, 9);
    uint32_t slots = ft_moe_share(t, 12.5);
    ferry_moe_planner *a = ft_moe_planner(t, "transition", slots);
    ferry_moe_planner *b = ft_moe_planner(t, "transition", slots);
    ferry__policy *pb = (ferry__policy *)ferry__planner_policy(b);
    size_t n = ferry_moe_trace_steps(t), renumbered = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t tok, layer, k;
        const uint32_t *ex;
        FT_ASSERT_OK(ferry_moe_trace_step(t, i, &tok, &layer, &ex, &k));
        if (i == n / 3 || i == 2 * n / 3)
            ferry__transition_clock(pb, INT32_MAX - 300);
        uint32_t before = ferry__transition_clock(pb, 0);
        FT_ASSERT_OK(ferry_moe_planner_ensure(a, layer, ex, k, NULL, NULL, NULL));
        FT_ASSERT_OK(ferry_moe_planner_ensure(b, layer, ex, k, NULL, NULL, NULL));
        renumbered += ferry__transition_clock(pb, 0) < before;
        for (uint32_t v = 0; v < slots; v++)
            if (ferry_moe_planner_occupant(a, v) != ferry_moe_planner_occupant(b, v))
                fail_msg("step %zu: slot %u holds %u, renumbered %u", i, v,
                         ferry_moe_planner_occupant(a, v), ferry_moe_planner_occupant(b, v));
    }
    print_message("%zu steps, %zu renumberings, the same residents\n", n, renumbered);
    assert_int_equal(renumbered, 2);
    ferry_moe_planner_destroy(a);
    ferry_moe_planner_destroy(b);
    ferry_moe_trace_destroy(t);
}

/* the keys renumbered at any step decide alike on odd shapes, the SSE2
 * rows and scalar folds too: a planner whose clock is moved on to the
 * top every few steps (a renumbering at the next filing or victim, most
 * steps that evict) keeps the residents of one whose is not; 1 to 17
 * experts a layer, more than 8 newcomers a visit, at the fewest slots a
 * step takes, one more and half */
static void transition_keys_renumbered_often_decide_alike(void **state)
{
    (void)state;
    static const uint32_t shapes[][3] = {{3, 1, 1}, {3, 5, 2}, {1, 9, 1}, {3, 17, 17}, {2, 40, 12}};
    for (size_t sh = 0; sh < sizeof shapes / sizeof *shapes; sh++) {
        ferry_moe_gen_options go = FERRY_MOE_GEN_OPTIONS_INIT;
        go.tokens = 400;
        go.seed = 3 + sh;
        go.num_layers = shapes[sh][0];
        go.num_experts = shapes[sh][1];
        go.top_k = shapes[sh][2];
        ferry_moe_trace *t = NULL;
        FT_ASSERT_OK(ferry_moe_trace_generate(&go, &t));
        uint32_t ids = go.num_layers * go.num_experts, k = go.top_k;
        uint32_t budgets[] = {k, k + 1 < ids ? k + 1 : ids, (ids + k) / 2};
        for (size_t bi = 0; bi < 3; bi++)
            for (int narrow = 0; narrow < 2; narrow++) {
                ferry__transition_narrow = narrow;
                ferry_moe_planner *a = ft_moe_planner(t, "transition", budgets[bi]);
                ferry_moe_planner *b = ft_moe_planner(t, "transition", budgets[bi]);
                ferry__transition_narrow = 0;
                ferry__policy *pb = (ferry__policy *)ferry__planner_policy(b);
                size_t n = ferry_moe_trace_steps(t), renumbered = 0;
                for (size_t i = 0; i < n; i++) {
                    uint32_t tok, layer, kk;
                    const uint32_t *ex;
                    FT_ASSERT_OK(ferry_moe_trace_step(t, i, &tok, &layer, &ex, &kk));
                    if (i % 5 == 0)
                        ferry__transition_clock(pb, INT32_MAX - 1 - (uint32_t)(i % 3));
                    uint32_t before = ferry__transition_clock(pb, 0);
                    FT_ASSERT_OK(ferry_moe_planner_ensure(a, layer, ex, kk, NULL, NULL, NULL));
                    FT_ASSERT_OK(ferry_moe_planner_ensure(b, layer, ex, kk, NULL, NULL, NULL));
                    renumbered += ferry__transition_clock(pb, 0) < before;
                    for (uint32_t v = 0; v < budgets[bi]; v++)
                        if (ferry_moe_planner_occupant(a, v) != ferry_moe_planner_occupant(b, v))
                            fail_msg("%u x %u top-%u, %u slots%s, step %zu: slot %u holds %u, "
                                     "renumbered %u", go.num_layers, go.num_experts, k, budgets[bi],
                                     narrow ? " (narrow)" : "", i, v, ferry_moe_planner_occupant(a, v),
                                     ferry_moe_planner_occupant(b, v));
                }
                print_message("%u x %u top-%u, %u slots%s: %zu renumberings\n", go.num_layers,
                              go.num_experts, k, budgets[bi], narrow ? " (narrow)" : "", renumbered);
                if (budgets[bi] < ids) /* (every fifth step moves the clock) */
                    assert_true(renumbered > 0);
                ferry_moe_planner_destroy(a);
                ferry_moe_planner_destroy(b);
            }
        ferry_moe_trace_destroy(t);
    }
}

/* step by step, a planner whose rows and folds are SSE2's and scalar
 * holds every expert in the cell the AVX2 one does (its rows' counts
 * give the same bins), and evicts the same */
static void transition_narrow_keeps_the_same_cells(void **state)
{
    (void)state;
    ferry_moe_trace *t = ft_moe_gen("deepseek-v3", 160, 11);
    uint32_t slots = ft_moe_share(t, 12.5);
    ferry_moe_planner *w = ft_moe_planner(t, "transition", slots);
    ferry__transition_narrow = 1;
    ferry_moe_planner *nr = ft_moe_planner(t, "transition", slots);
    ferry__transition_narrow = 0;
    const ferry__policy *a = ferry__planner_policy(w), *z = ferry__planner_policy(nr);
    size_t n = ferry_moe_trace_steps(t), compared = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t tok, layer, k;
        const uint32_t *ex;
        FT_ASSERT_OK(ferry_moe_trace_step(t, i, &tok, &layer, &ex, &k));
        FT_ASSERT_OK(ferry_moe_planner_ensure(w, layer, ex, k, NULL, NULL, NULL));
        FT_ASSERT_OK(ferry_moe_planner_ensure(nr, layer, ex, k, NULL, NULL, NULL));
        if (i % 7 == 0 || i + 1 == n) {
            long d = ferry__transition_cells_differ(a, z);
            if (d != 0)
                fail_msg("step %zu: %ld cells differ between AVX2 and SSE2", i, d);
            compared++;
        }
    }
    ferry_moe_planner_stats sw = FERRY_MOE_PLANNER_STATS_INIT, sn = FERRY_MOE_PLANNER_STATS_INIT;
    FT_ASSERT_OK(ferry_moe_planner_stats_get(w, &sw));
    FT_ASSERT_OK(ferry_moe_planner_stats_get(nr, &sn));
    print_message("%zu steps compared, %llu evictions each\n", compared,
                  (unsigned long long)sw.evictions);
    assert_true(compared > 1000 && sw.evictions > 0);
    assert_int_equal(sw.hits, sn.hits);
    assert_int_equal(sw.evictions, sn.evictions);
    ferry_moe_planner_destroy(w);
    ferry_moe_planner_destroy(nr);
    ferry_moe_trace_destroy(t);
}

/* each visited layer 4,000-4,017 visits short of 2^32 (whole turns of
 * the ring): the rest crosses */
static void transition_jump(ferry__policy *pol, uint64_t visits_before)
{
    uint64_t visits = ((UINT64_C(1) << 32) - visits_before - 4000) / 17 * 17;
    FT_ASSERT_OK(ferry__transition_skip(pol, visits));
}

/* a decode loop runs a layer 2^32 times within weeks: past that the
 * policy decides as it did (its ring of routed sets is the visit count
 * mod 17; at 32 bits the count wrapped, and the learning of a layer's
 * pending visits ran on forever at the last one) */
static void transition_decides_alike_past_2_to_the_32_visits(void **state)
{
    (void)state;
    ferry_moe_trace *t = ft_moe_gen("small", 16000, 5); /* 4 layers: 8,000 visits each after */
    uint32_t slots = ft_moe_share(t, 25);
    size_t at = ferry_moe_trace_steps(t) / 2;
    uint64_t h0, m0, h1, m1;
    ft_moe_hits_jumping(t, "transition", slots, at, NULL, &h0, &m0);
    ft_moe_hits_jumping(t, "transition", slots, at, transition_jump, &h1, &m1);
    print_message("hits %llu / %llu, misses %llu / %llu\n", (unsigned long long)h0,
                  (unsigned long long)h1, (unsigned long long)m0, (unsigned long long)m1);
    assert_int_equal(h0, h1);
    assert_int_equal(m0, m1);
    assert_int_equal(ferry__transition_skip(NULL, 17), -EINVAL);
    ferry_moe_planner *p = ft_moe_planner(t, "transition", slots);
    assert_int_equal(ferry__transition_skip((ferry__policy *)ferry__planner_policy(p), 16), -EINVAL);
    ferry_moe_planner_destroy(p);
    ferry_moe_trace_destroy(t);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(transition_keeps_the_invariants),
        cmocka_unit_test(transition_is_listed_and_deterministic),
        cmocka_unit_test(transition_beats_lru_on_a_transition_structure),
        cmocka_unit_test(transition_survives_counter_halving),
        cmocka_unit_test(transition_refuses_huge_shapes),
        cmocka_unit_test(transition_lists_choose_as_the_scan),
        cmocka_unit_test(transition_looks_past_a_pinned_least_cell),
        cmocka_unit_test(transition_odd_shapes_decide_as_the_scan_and_narrow),
        cmocka_unit_test(transition_work_does_not_grow_with_slots),
        cmocka_unit_test(transition_steady_work_does_not_grow_with_slots),
        cmocka_unit_test(transition_wakes_to_the_cells_it_would_have),
        cmocka_unit_test(transition_rows_count_the_same_narrow),
        cmocka_unit_test(transition_narrow_keeps_the_same_cells),
        cmocka_unit_test(transition_rows_place_as_the_serial_rule),
        cmocka_unit_test(transition_keys_renumbered_decide_alike),
        cmocka_unit_test(transition_keys_renumbered_often_decide_alike),
        cmocka_unit_test(transition_decides_alike_past_2_to_the_32_visits),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
