/*
 * test_moe_hints.c - predicted routes in the planner: a hinted expert is
 * protected until the step it was predicted for, hints of least value go
 * first when nothing else can, a step always wins over hints, hints expire
 * and are counted right or wrong, a hint prefetch brings the missing ones
 * in best first, protection and prefetch scale with a hint's calibrated
 * confidence (a hint never costs more than it is expected to save), and
 * bad hints change nothing.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry_test.h"
#include "moe_traces.h"
#include "moe/moe_internal.h"

static void step1(ferry_moe_planner *p, uint32_t layer, uint32_t e)
{
    FT_ASSERT_OK(ferry_moe_planner_ensure(p, layer, &e, 1, NULL, NULL, NULL));
}

static ferry_moe_hint_stats hstats(const ferry_moe_planner *p)
{
    ferry_moe_hint_stats h = FERRY_MOE_HINT_STATS_INIT;
    FT_ASSERT_OK(ferry_moe_planner_hint_stats_get(p, &h));
    return h;
}

static int resident(const ferry_moe_planner *p, uint32_t layer, uint32_t e)
{
    return ferry_moe_planner_lookup(p, layer, e) != FERRY_MOE_NONE;
}

/* occupant and lookup are inverse maps */
static void assert_consistent(const ferry_moe_planner *p, uint32_t L, uint32_t E)
{
    uint32_t n = ferry_moe_planner_slots(p);
    for (uint32_t s = 0; s < n; s++) {
        uint32_t id = ferry_moe_planner_occupant(p, s);
        if (id == FERRY_MOE_NONE)
            continue;
        assert_true(id < L * E);
        assert_int_equal(ferry_moe_planner_lookup(p, id / E, id % E), s);
    }
}

static const char *const online[] = {"lru",     "lru-layer", "lfu", "lfru", "trio", "successor",
                                     "s3fifo",  "routing",   "arc", "auto"};

/* the routing policy's structures, on its own or inside trio */
static void check_routing(const ferry_moe_planner *p, const char *policy, uint32_t at)
{
    const ferry__policy *pol = ferry__planner_policy(p);
    if (!strcmp(policy, "trio"))
        pol = ferry__auto_routing(pol);
    else if (strcmp(policy, "routing"))
        return;
    char why[256];
    if (ferry__routing_check(pol, why, sizeof why) < 0)
        fail_msg("%s at %u: %s", policy, at, why);
}

static void a_hinted_expert_survives_until_its_step_under_every_policy(void **state)
{
    (void)state;
    for (size_t k = 0; k < sizeof online / sizeof *online; k++) {
        ferry_moe_planner *p = ft_moe_mk(1, 16, 4, online[k], NULL);
        for (uint32_t e = 0; e < 4; e++)
            step1(p, 0, e);
        uint32_t x = 0;
        assert_int_equal(ferry_moe_planner_hint(p, 0, 4, &x, 1, 1.0), 1);
        for (uint32_t e = 4; e < 7; e++) { /* three steps of strangers */
            step1(p, 0, e);
            if (!resident(p, 0, 0))
                fail_msg("%s evicted the expert hinted for a later step (step of %u)",
                         online[k], e);
        }
        ferry_moe_counts c;
        FT_ASSERT_OK(ferry_moe_planner_ensure(p, 0, &x, 1, NULL, NULL, &c));
        assert_int_equal(c.missing, 0);
        ferry_moe_hint_stats h = hstats(p);
        assert_int_equal(h.hinted, 1);
        assert_int_equal(h.right, 1);
        assert_int_equal(h.wrong, 0);
        assert_int_equal(h.evicted, 0);
        assert_int_equal(h.live, 0);
        if (!strcmp(online[k], "lru"))
            assert_true(h.saves >= 1); /* LRU's first victim was expert 0 */
        check_routing(p, online[k], 0);
        ferry_moe_planner_destroy(p);
    }
}

static void a_hint_expires_at_its_step_and_counts_wrong(void **state)
{
    (void)state;
    ferry_moe_planner *p = ft_moe_mk(1, 16, 4, "lru", NULL);
    for (uint32_t e = 0; e < 4; e++)
        step1(p, 0, e);
    uint32_t x = 0;
    assert_int_equal(ferry_moe_planner_hint(p, 0, 2, &x, 1, 0.9), 1);
    assert_int_equal(hstats(p).live, 1);
    step1(p, 0, 4); /* protected: 1 goes (LRU after 0) */
    assert_true(resident(p, 0, 0));
    assert_false(resident(p, 0, 1));
    assert_int_equal(hstats(p).wrong, 0);
    /* the hinted step routes 5, not 0: wrong, expired, and its own step
     * is not protected from it: 0 is LRU's victim again */
    step1(p, 0, 5);
    assert_false(resident(p, 0, 0));
    ferry_moe_hint_stats h = hstats(p);
    assert_int_equal(h.wrong, 1);
    assert_int_equal(h.right, 0);
    assert_int_equal(h.live, 0);
    ferry_moe_planner_destroy(p);
}

static void hints_of_one_expert_merge_and_protect_until_the_latest(void **state)
{
    (void)state;
    ferry_moe_planner *p = ft_moe_mk(1, 16, 4, "lru", NULL);
    for (uint32_t e = 0; e < 4; e++)
        step1(p, 0, e);
    uint32_t x = 0;
    FT_ASSERT_OK(ferry_moe_planner_hint(p, 0, 1, &x, 1, 0.5));
    FT_ASSERT_OK(ferry_moe_planner_hint(p, 0, 3, &x, 1, 0.8));
    assert_int_equal(hstats(p).live, 1);
    for (uint32_t e = 4; e < 6; e++) {
        step1(p, 0, e);
        assert_true(resident(p, 0, 0));
    }
    ferry_moe_counts c;
    FT_ASSERT_OK(ferry_moe_planner_ensure(p, 0, &x, 1, NULL, NULL, &c));
    assert_int_equal(c.missing, 0);
    ferry_moe_hint_stats h = hstats(p);
    assert_int_equal(h.wrong, 1); /* step +1 routed 4 */
    assert_int_equal(h.right, 1); /* step +3 routed 0 */
    assert_int_equal(h.live, 0);
    ferry_moe_planner_destroy(p);
}

static void the_least_confident_then_the_farthest_hint_goes_first(void **state)
{
    (void)state;
    /* every slot hinted: a step's miss evicts the hint of least value */
    ferry_moe_planner *p = ft_moe_mk(1, 16, 4, "lru", NULL);
    for (uint32_t e = 0; e < 4; e++)
        step1(p, 0, e);
    const double conf[4] = {0.9, 0.5, 0.9, 0.9}; /* each worth keeping */
    for (uint32_t e = 0; e < 4; e++)
        FT_ASSERT_OK(ferry_moe_planner_hint(p, 0, 5, &e, 1, conf[e]));
    step1(p, 0, 8);
    assert_false(resident(p, 0, 1));
    assert_true(resident(p, 0, 0) && resident(p, 0, 2) && resident(p, 0, 3));
    assert_int_equal(hstats(p).evicted, 1);
    /* unhinted first: 8 goes before any hinted one */
    step1(p, 0, 9);
    assert_false(resident(p, 0, 8));
    assert_true(resident(p, 0, 0) && resident(p, 0, 2) && resident(p, 0, 3));
    ferry_moe_planner_destroy(p);

    /* the same confidence: the farthest goes first */
    p = ft_moe_mk(1, 16, 4, "lru", NULL);
    for (uint32_t e = 0; e < 4; e++)
        step1(p, 0, e);
    const uint32_t ahead[4] = {2, 7, 4, 3};
    for (uint32_t e = 0; e < 4; e++)
        FT_ASSERT_OK(ferry_moe_planner_hint(p, 0, ahead[e], &e, 1, 0.5));
    step1(p, 0, 8);
    assert_false(resident(p, 0, 1));
    assert_true(resident(p, 0, 0) && resident(p, 0, 2) && resident(p, 0, 3));
    ferry_moe_planner_destroy(p);
}

static void a_step_wider_than_the_unhinted_slots_still_succeeds(void **state)
{
    (void)state;
    for (size_t k = 0; k < sizeof online / sizeof *online; k++) {
        ferry_moe_planner *p = ft_moe_mk(2, 16, 4, online[k], NULL);
        uint32_t all[4] = {0, 1, 2, 3};
        FT_ASSERT_OK(ferry_moe_planner_ensure(p, 0, all, 4, NULL, NULL, NULL));
        assert_int_equal(ferry_moe_planner_hint(p, 0, 10, all, 4, 1.0), 4);
        uint32_t wide[3] = {4, 5, 6}, slots[3];
        ferry_moe_counts c;
        assert_int_equal(ferry_moe_planner_ensure(p, 1, wide, 3, slots, NULL, &c), 3);
        for (int i = 0; i < 3; i++)
            assert_int_equal(ferry_moe_planner_lookup(p, 1, wide[i]), slots[i]);
        assert_int_equal(hstats(p).evicted, 3);
        /* a streamed step of more experts than slots, every slot hinted */
        FT_ASSERT_OK(ferry_moe_planner_hint(p, 1, 5, wide, 3, 1.0));
        uint32_t big[6] = {7, 8, 9, 10, 11, 12};
        FT_ASSERT_OK(ferry_moe_planner_stream_begin(p, 1, big, 6, NULL));
        ferry_moe_wave w;
        uint32_t served = 0;
        int r;
        while ((r = ferry_moe_planner_stream_next(p, &w)) > 0) {
            for (uint32_t i = 0; i < w.n; i++)
                assert_int_equal(ferry_moe_planner_lookup(p, 1, w.experts[i]), w.slots[i]);
            served += w.n;
        }
        FT_ASSERT_OK(r);
        assert_int_equal(served, 6);
        assert_consistent(p, 2, 16);
        ferry_moe_planner_destroy(p);
    }
}

static void hint_prefetch_brings_the_best_missing_hints_in(void **state)
{
    (void)state;
    ferry_moe_planner *p = ft_moe_mk(2, 8, 4, "lru", NULL);
    step1(p, 0, 0);
    uint32_t next[2] = {2, 3};
    FT_ASSERT_OK(ferry_moe_planner_hint(p, 1, 1, next, 2, 0.9));
    ferry_moe_copy_plan plan;
    assert_int_equal(ferry_moe_planner_hint_prefetch(p, 8, &plan), 2);
    assert_int_equal(plan.layer, 1);
    assert_int_equal(plan.n, 2);
    for (uint32_t i = 0; i < 2; i++)
        assert_int_equal(ferry_moe_planner_lookup(p, 1, plan.src_rows[i]), plan.dst_slots[i]);
    /* nothing hinted is missing now */
    assert_int_equal(ferry_moe_planner_hint_prefetch(p, 8, &plan), 0);
    ferry_moe_counts c;
    FT_ASSERT_OK(ferry_moe_planner_ensure(p, 1, next, 2, NULL, NULL, &c));
    assert_int_equal(c.missing, 0);
    assert_int_equal(c.prefetch_hits, 2);
    ferry_moe_hint_stats h = hstats(p);
    assert_int_equal(h.right, 2);
    assert_int_equal(h.fetched, 2);
    ferry_moe_planner_stats st = FERRY_MOE_PLANNER_STATS_INIT;
    FT_ASSERT_OK(ferry_moe_planner_stats_get(p, &st));
    assert_int_equal(st.prefetch_fetched, 2);
    assert_int_equal(st.prefetch_hits, 2);

    /* max_rows bounds the plan, the most valuable first: the nearer,
     * then the more confident (each sure enough to take a victim's slot) */
    uint32_t a = 5, b = 6, d = 7;
    FT_ASSERT_OK(ferry_moe_planner_hint(p, 0, 1, &a, 1, 0.7));
    FT_ASSERT_OK(ferry_moe_planner_hint(p, 0, 1, &b, 1, 0.9));
    FT_ASSERT_OK(ferry_moe_planner_hint(p, 0, 3, &d, 1, 0.66)); /* 0.22 a step */
    assert_int_equal(ferry_moe_planner_hint_prefetch(p, 1, &plan), 1);
    assert_int_equal(plan.layer, 0);
    assert_int_equal(plan.src_rows[0], 6);
    assert_int_equal(ferry_moe_planner_hint_prefetch(p, 1, &plan), 1);
    assert_int_equal(plan.src_rows[0], 5);
    /* the step's two and the two prefetched are pinned: no room for 7 */
    assert_int_equal(ferry_moe_planner_hint_prefetch(p, 1, &plan), 0);
    assert_false(resident(p, 0, 7));
    ferry_moe_planner_destroy(p);
}

/* ferry/moe.h: a hint prefetch fails with a policy's -ENOMEM and no plan.
 * The rows it had placed before the failure were never copied (the caller
 * got no plan), so none of them may be left resident: a later step would
 * "hit" a slot holding another expert's row (before: the first hinted
 * expert stayed resident, and the next ensure found it with nothing to
 * copy). Every policy that prefetches, failing at the 2nd and 3rd insert. */
static void a_hint_prefetch_that_fails_part_way_places_nothing(void **state)
{
    (void)state;
    for (size_t k = 0; k < sizeof online / sizeof *online; k++) {
        for (uint64_t at = 2; at <= 3; at++) {
            ferry_moe_planner *p = ft_moe_mk(2, 8, 6, online[k], NULL);
            step1(p, 0, 0);
            uint32_t next[3] = {2, 3, 4};
            FT_ASSERT_OK(ferry_moe_planner_hint(p, 1, 1, next, 3, 1.0));
            ferry_moe_copy_plan plan;
            ferry__planner_fault_insert = at;
            int rc = ferry_moe_planner_hint_prefetch(p, 8, &plan);
            uint64_t left = ferry__planner_fault_insert;
            ferry__planner_fault_insert = 0;
            if (rc != -ENOMEM || left != 0)
                fail_msg("%s, insert %llu failing: %d (%s)", online[k], (unsigned long long)at,
                         rc, ferry_moe_planner_last_error(p));
            for (uint32_t i = 0; i < 3; i++)
                if (resident(p, 1, next[i]))
                    fail_msg("%s, insert %llu failing: expert %u is resident in slot %u, yet "
                             "no plan copied its row there", online[k], (unsigned long long)at,
                             next[i], ferry_moe_planner_lookup(p, 1, next[i]));
            assert_consistent(p, 2, 8);
            check_routing(p, online[k], (uint32_t)at);
            /* the next step misses all three, and every slot can be used */
            ferry_moe_counts c;
            FT_ASSERT_OK(ferry_moe_planner_ensure(p, 1, next, 3, NULL, &plan, &c));
            assert_int_equal(c.missing, 3);
            assert_int_equal(plan.n, 3);
            uint32_t all[6] = {0, 1, 2, 3, 4, 5};
            FT_ASSERT_OK(ferry_moe_planner_ensure(p, 0, all, 6, NULL, NULL, NULL));
            assert_consistent(p, 2, 8);
            ferry_moe_planner_destroy(p);
        }
    }
}

static void hint_prefetch_never_evicts_a_hint_worth_as_much(void **state)
{
    (void)state;
    ferry_moe_planner *p = ft_moe_mk(2, 8, 2, "lru", NULL);
    step1(p, 0, 0);
    step1(p, 1, 4); /* 4 is pinned by this step; 0 is LRU's victim */
    uint32_t x = 0, y = 5;
    FT_ASSERT_OK(ferry_moe_planner_hint(p, 0, 1, &x, 1, 0.9)); /* worth 0.9 */
    FT_ASSERT_OK(ferry_moe_planner_hint(p, 1, 2, &y, 1, 0.9)); /* worth 0.45 */
    ferry_moe_copy_plan plan;
    assert_int_equal(ferry_moe_planner_hint_prefetch(p, 4, &plan), 0);
    assert_int_equal(plan.n, 0);
    assert_true(resident(p, 0, 0));
    /* a more valuable one may take its place */
    FT_ASSERT_OK(ferry_moe_planner_hint(p, 1, 1, &y, 1, 1.0)); /* now worth 1.0 */
    assert_int_equal(ferry_moe_planner_hint_prefetch(p, 4, &plan), 1);
    assert_int_equal(plan.src_rows[0], 5);
    assert_false(resident(p, 0, 0));
    ferry_moe_planner_destroy(p);
}

static void prefetch_and_forget_keep_the_pin_counts_with_hints(void **state)
{
    (void)state;
    /* a prefetch names a hinted expert that a victim search soft pinned:
     * it is the prefetch's now, and the refusal of a too-large prefetch
     * still counts it */
    ferry_moe_planner *p = ft_moe_mk(1, 16, 4, "lru", NULL);
    for (uint32_t e = 0; e < 4; e++)
        step1(p, 0, e);
    uint32_t h2[2] = {0, 1};
    FT_ASSERT_OK(ferry_moe_planner_hint(p, 0, 6, h2, 2, 1.0));
    step1(p, 0, 4); /* soft pins 0 and 1, evicts 2 */
    assert_true(resident(p, 0, 0) && resident(p, 0, 1));
    uint32_t pf[4] = {0, 5, 6, 7}; /* 0 and 4 pinned: 3 misses, 2 slots */
    assert_int_equal(ferry_moe_planner_prefetch(p, 0, pf, 4, NULL), FERRY_ENOSPACE);
    uint32_t pf2[3] = {0, 1, 5}; /* 3 pinned, 1 miss: fits */
    assert_int_equal(ferry_moe_planner_prefetch(p, 0, pf2, 3, NULL), 1);
    assert_true(resident(p, 0, 0) && resident(p, 0, 1) && resident(p, 0, 5));
    /* forgetting a soft pinned slot frees it and leaves the step's pins
     * counted: a prefetch of as many misses as unpinned slots fits */
    for (uint32_t e = 0; e < 4; e++)
        step1(p, 0, 8 + e); /* 0 and 1 stay (hinted), soft pinned by the last */
    assert_true(resident(p, 0, 0) && resident(p, 0, 1));
    FT_ASSERT_OK(ferry_moe_planner_forget(p, ferry_moe_planner_lookup(p, 0, 0)));
    uint32_t q3[3] = {12, 13, 14};
    assert_int_equal(ferry_moe_planner_prefetch(p, 0, q3, 3, NULL), 3);
    assert_true(resident(p, 0, 11));
    uint32_t q[4] = {12, 13, 14, 15};
    FT_ASSERT_OK(ferry_moe_planner_ensure(p, 0, q, 4, NULL, NULL, NULL));
    assert_consistent(p, 1, 16);
    ferry_moe_planner_destroy(p);
}

/* one step of each expert of cycle[] in turn, n steps, layer 0 */
static void cycle_steps(ferry_moe_planner *p, const uint32_t *cycle, uint32_t len, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++)
        step1(p, 0, cycle[i % len]);
}

static void a_hint_protects_only_when_surer_than_the_victims_return(void **state)
{
    (void)state;
    /* 5 experts cycling through 4 slots: LRU's every victim is the next
     * one routed, so an evicted expert almost always comes back within a
     * token (one step here): a 90% hint is not worth the victim kept
     * instead, a certain one is */
    const uint32_t cyc[5] = {0, 1, 2, 3, 4};
    uint32_t far = 15;
    for (int sure = 0; sure < 2; sure++) {
        ferry_moe_planner *p = ft_moe_mk(1, 16, 4, "lru", NULL);
        FT_ASSERT_OK(ferry_moe_planner_hint(p, 0, 1000, &far, 1, 1.0)); /* the table on */
        cycle_steps(p, cyc, 5, 200); /* ends with 4; resident: 1 2 3 4, 1 the LRU */
        assert_true(resident(p, 0, 1));
        uint32_t x = 1;
        FT_ASSERT_OK(ferry_moe_planner_hint(p, 0, 3, &x, 1, sure ? 1.0 : 0.9));
        step1(p, 0, 9); /* a miss: LRU's victim is 1 */
        if (sure) {
            assert_true(resident(p, 0, 1));
            assert_false(resident(p, 0, 2));
        } else {
            assert_false(resident(p, 0, 1));
            assert_true(resident(p, 0, 2));
        }
        ferry_moe_planner_destroy(p);
    }
    /* where evictions do not come back (a fresh planner), 90% protects */
    ferry_moe_planner *p = ft_moe_mk(1, 16, 4, "lru", NULL);
    cycle_steps(p, cyc, 4, 4);
    uint32_t x = 0;
    FT_ASSERT_OK(ferry_moe_planner_hint(p, 0, 3, &x, 1, 0.9));
    step1(p, 0, 9);
    assert_true(resident(p, 0, 0));
    ferry_moe_planner_destroy(p);
}

static void hint_prefetch_scales_with_confidence(void **state)
{
    (void)state;
    ferry_moe_planner *p = ft_moe_mk(2, 8, 4, "lru", NULL);
    const uint32_t cyc[4] = {0, 1, 2, 3};
    cycle_steps(p, cyc, 4, 4); /* every slot full, none pinned but 3 */
    ferry_moe_copy_plan plan;
    /* wrong more often than right: never worth a row */
    uint32_t e = 5;
    FT_ASSERT_OK(ferry_moe_planner_hint(p, 1, 1, &e, 1, 0.45));
    assert_int_equal(ferry_moe_planner_hint_prefetch(p, 8, &plan), 0);
    /* right a bit more often than not: a free slot only, and none is free */
    FT_ASSERT_OK(ferry_moe_planner_hint(p, 1, 1, &e, 1, 0.55));
    assert_int_equal(ferry_moe_planner_hint_prefetch(p, 8, &plan), 0);
    assert_true(resident(p, 0, 0));
    FT_ASSERT_OK(ferry_moe_planner_forget(p, ferry_moe_planner_lookup(p, 0, 1)));
    assert_int_equal(ferry_moe_planner_hint_prefetch(p, 8, &plan), 1);
    assert_int_equal(plan.src_rows[0], 5);
    assert_true(resident(p, 0, 0)); /* into the free slot */
    /* sure: worth a victim's slot (LRU's: expert 0) */
    uint32_t f = 6;
    FT_ASSERT_OK(ferry_moe_planner_hint(p, 1, 1, &f, 1, 0.95));
    assert_int_equal(ferry_moe_planner_hint_prefetch(p, 8, &plan), 1);
    assert_int_equal(plan.src_rows[0], 6);
    assert_false(resident(p, 0, 0));
    assert_int_equal(hstats(p).fetched, 2);
    assert_consistent(p, 2, 8);
    ferry_moe_planner_destroy(p);
}

static void hints_that_do_not_come_true_lose_their_rows(void **state)
{
    (void)state;
    /* stated 90% sure, always wrong: the first rounds prefetch, then the
     * calibration has seen enough and no more rows go */
    ferry_moe_planner *p = ft_moe_mk(1, 64, 8, "lru", NULL);
    uint32_t fetched = 0, late = 0;
    for (uint32_t r = 0; r < 60; r++) {
        uint32_t guess = 32 + r % 32, truth = r % 8;
        FT_ASSERT_OK(ferry_moe_planner_hint(p, 0, 1, &guess, 1, 0.9));
        ferry_moe_copy_plan plan;
        int n = ferry_moe_planner_hint_prefetch(p, 4, &plan);
        FT_ASSERT_OK(n);
        fetched += (uint32_t)n;
        if (r >= 20)
            late += (uint32_t)n;
        step1(p, 0, truth);
    }
    assert_true(fetched >= 1);
    assert_int_equal(late, 0);
    assert_int_equal(hstats(p).wrong, 60);
    /* stated 60% sure and always right: trusted more than stated */
    ferry_moe_planner_destroy(p);
    p = ft_moe_mk(1, 64, 8, "lru", NULL);
    for (uint32_t r = 0; r < 40; r++) {
        uint32_t guess = 32 + r % 32;
        FT_ASSERT_OK(ferry_moe_planner_hint(p, 0, 1, &guess, 1, 0.6));
        step1(p, 0, guess);
    }
    assert_true(ferry__planner_hint_p(p, 0.6) > 0.8);
    ferry_moe_planner_destroy(p);
}

static void bad_hints_are_refused_and_change_nothing(void **state)
{
    (void)state;
    ferry_moe_planner *p = ft_moe_mk(2, 8, 4, "lru", NULL);
    uint32_t ok = 1, bad = 8;
    assert_int_equal(ferry_moe_planner_hint(NULL, 0, 1, &ok, 1, 0.5), -EINVAL);
    assert_int_equal(ferry_moe_planner_hint(p, 2, 1, &ok, 1, 0.5), -EINVAL);
    assert_non_null(strstr(ferry_moe_planner_last_error(p), "layer 2"));
    assert_int_equal(ferry_moe_planner_hint(p, 0, 1, &ok, 0, 0.5), -EINVAL);
    assert_int_equal(ferry_moe_planner_hint(p, 0, 1, NULL, 1, 0.5), -EINVAL);
    assert_int_equal(ferry_moe_planner_hint(p, 0, 1, &bad, 1, 0.5), -EINVAL);
    assert_non_null(strstr(ferry_moe_planner_last_error(p), "expert 8"));
    assert_int_equal(ferry_moe_planner_hint(p, 0, 0, &ok, 1, 0.5), -EINVAL);
    assert_non_null(strstr(ferry_moe_planner_last_error(p), "steps_ahead 0"));
    assert_int_equal(ferry_moe_planner_hint(p, 0, FERRY_MOE_MAX_HINT_STEPS + 1, &ok, 1, 0.5),
                     -EINVAL);
    assert_int_equal(ferry_moe_planner_hint(p, 0, 1, &ok, 1, -0.01), -EINVAL);
    assert_int_equal(ferry_moe_planner_hint(p, 0, 1, &ok, 1, 1.01), -EINVAL);
    assert_int_equal(ferry_moe_planner_hint(p, 0, 1, &ok, 1, NAN), -EINVAL);
    assert_non_null(strstr(ferry_moe_planner_last_error(p), "confidence"));
    ferry_moe_hint_stats h = hstats(p);
    assert_int_equal(h.hinted, 0);
    assert_int_equal(h.live, 0);
    assert_int_equal(ferry_moe_planner_hint_prefetch(NULL, 1, NULL), -EINVAL);
    assert_int_equal(ferry_moe_planner_hint_stats_get(NULL, &h), -EINVAL);
    assert_int_equal(ferry_moe_planner_hint_stats_get(p, NULL), -EINVAL);
    /* the limits are accepted */
    assert_int_equal(ferry_moe_planner_hint(p, 0, FERRY_MOE_MAX_HINT_STEPS, &ok, 1, 0.0), 1);
    assert_int_equal(ferry_moe_planner_hint(p, 1, 1, &ok, 1, 1.0), 1);
    /* no hint prefetch while a streamed step is open; hints are fine */
    uint32_t big[6] = {0, 1, 2, 3, 4, 5};
    FT_ASSERT_OK(ferry_moe_planner_stream_begin(p, 0, big, 6, NULL));
    assert_int_equal(ferry_moe_planner_hint_prefetch(p, 1, NULL), FERRY_ESTATE);
    assert_int_equal(ferry_moe_planner_hint(p, 1, 1, &ok, 1, 1.0), 1);
    ferry_moe_wave w;
    while (ferry_moe_planner_stream_next(p, &w) > 0)
        ;
    ferry_moe_planner_destroy(p);
}

static void belady_refuses_hints(void **state)
{
    (void)state;
    ferry_moe_model m = {.num_layers = 1, .num_experts = 4, .top_k = 1};
    strcpy(m.name, "t");
    ferry_moe_trace *t;
    FT_ASSERT_OK(ferry_moe_trace_create(&m, &t));
    uint32_t e = 1;
    FT_ASSERT_OK(ferry_moe_trace_append(t, 0, 0, &e, 1));
    ferry_moe_planner_options o = FERRY_MOE_PLANNER_OPTIONS_INIT;
    o.num_layers = 1;
    o.num_experts = 4;
    o.slots = 2;
    o.policy = "belady";
    o.oracle = t;
    ferry_moe_planner *p;
    FT_ASSERT_OK(ferry_moe_planner_create(&o, &p));
    assert_int_equal(ferry_moe_planner_hint(p, 0, 1, &e, 1, 1.0), FERRY_ENOTSUP);
    assert_int_equal(ferry_moe_planner_hint_prefetch(p, 1, NULL), FERRY_ENOTSUP);
    FT_ASSERT_OK(ferry_moe_planner_ensure(p, 0, &e, 1, NULL, NULL, NULL));
    ferry_moe_planner_destroy(p);
    ferry_moe_trace_destroy(t);
}

/* random steps, hints, hint prefetches, forgets and resizes: every step
 * succeeds, its experts are resident, the maps stay inverse */
static void random_hints_never_fail_a_step(void **state)
{
    (void)state;
    enum { L = 3, E = 16, K = 4 };
    for (size_t k = 0; k < sizeof online / sizeof *online; k++) {
        ferry__rng r;
        ferry__rng_seed(&r, 7 + k);
        ferry_moe_planner *p = ft_moe_mk(L, E, 6, online[k], NULL);
        for (uint32_t i = 0; i < 3000; i++) {
            uint32_t layer = i % L, ex[K], hx[K];
            for (int j = 0; j < K; j++)
                ex[j] = ferry__rng_below(&r, E);
            if (ferry_moe_planner_slots(p) < K) {
                FT_ASSERT_OK(ferry_moe_planner_stream_begin(p, layer, ex, K, NULL));
                ferry_moe_wave w;
                int rc;
                while ((rc = ferry_moe_planner_stream_next(p, &w)) > 0)
                    ;
                FT_ASSERT_OK(rc);
            } else {
                FT_ASSERT_OK(ferry_moe_planner_ensure(p, layer, ex, K, NULL, NULL, NULL));
                for (int j = 0; j < K; j++)
                    assert_true(resident(p, layer, ex[j]));
            }
            uint32_t nh = 1 + ferry__rng_below(&r, K);
            for (uint32_t j = 0; j < nh; j++)
                hx[j] = ferry__rng_below(&r, E);
            FT_ASSERT_OK(ferry_moe_planner_hint(p, ferry__rng_below(&r, L),
                                                1 + ferry__rng_below(&r, 8), hx, nh,
                                                ferry__rng_unit(&r)));
            int rc = ferry_moe_planner_hint_prefetch(p, ferry__rng_below(&r, 4), NULL);
            assert_true(rc >= 0);
            if (ferry__rng_below(&r, 50) == 0)
                FT_ASSERT_OK(ferry_moe_planner_forget(p, ferry__rng_below(&r, 6) %
                                                             ferry_moe_planner_slots(p)));
            if (ferry__rng_below(&r, 400) == 0)
                assert_true(ferry_moe_planner_resize(p, 3 + ferry__rng_below(&r, 6)) >= 0);
            assert_consistent(p, L, E);
            check_routing(p, online[k], i);
        }
        ferry_moe_hint_stats h = hstats(p);
        assert_true(h.right > 0 && h.wrong > 0 && h.saves > 0);
        ferry_moe_planner_destroy(p);
    }
}

/* hints drive real copies: each step's and each hint prefetch's plan
 * goes through a host executor (the prefetch on its prefetch path), the
 * planner and the executor agree on every slot after each call, and each
 * routed expert's slot holds exactly its row */
enum { XL = 3, XE = 16, XROW = 128, XSLOTS = 7 };

static void apply_ok(ferry_moe_slots *x, const ferry_moe_copy_plan *plan,
                     const ferry_moe_rows *rows, int prefetch)
{
    uint32_t unk[XSLOTS * 2], nu = 0;
    int rc = prefetch ? ferry_moe_slots_prefetch_start(x, plan, rows, unk, &nu)
                      : ferry_moe_slots_apply(x, plan, rows, unk, &nu);
    assert_true(rc >= 0);
    assert_int_equal(nu, 0);
}

static void hinted_plans_move_the_right_bytes_through_an_executor(void **state)
{
    (void)state;
    ferry_device_options d = FERRY_DEVICE_OPTIONS_INIT;
    d.backend = "host";
    ferry_device *dev;
    FT_ASSERT_OK(ferry_device_open(&d, &dev));
    unsigned char *bank = malloc((size_t)XL * XE * XROW);
    assert_non_null(bank);
    for (int i = 0; i < XL * XE; i++)
        memset(bank + (size_t)i * XROW, i + 1, XROW);
    ferry_moe_geometry g = FERRY_MOE_GEOMETRY_INIT;
    g.num_layers = XL;
    g.num_experts = XE;
    g.slots = XSLOTS;
    g.banks = 1;
    g.row_bytes[0] = XROW;
    void *bases[1] = {bank};
    ferry_moe_rows *rows;
    FT_ASSERT_OK(ferry_moe_rows_host(&g, bases, NULL, 0, &rows));
    const ferry_moe_slot_device_ops *ops;
    void *ctx;
    ferry_moe_slots *x;
    FT_ASSERT_OK(ferry_moe_device_slots_open(dev, &g, &ops, &ctx));
    FT_ASSERT_OK(ferry_moe_slots_create(&g, ops, ctx, &x));
    ferry_moe_planner *p = ft_moe_mk(XL, XE, XSLOTS, "auto", NULL);
    ferry__rng r;
    ferry__rng_seed(&r, 11);
    for (uint32_t i = 0; i < 600; i++) {
        uint32_t layer = i % XL, ex[3], sl[3];
        for (int j = 0; j < 3; j++)
            ex[j] = ferry__rng_below(&r, XE / 2) * (1 + (ferry__rng_below(&r, 4) == 0));
        ferry_moe_copy_plan plan;
        FT_ASSERT_OK(ferry_moe_planner_ensure(p, layer, ex, 3, sl, &plan, NULL));
        apply_ok(x, &plan, rows, 0);
        FT_ASSERT_OK(ferry_moe_check(p, x));
        for (int j = 0; j < 3; j++) {
            unsigned char got[XROW];
            ferry_devptr dp = ferry_moe_device_slot_ptr(ferry_moe_slots_device(x), 0, sl[j]);
            FT_ASSERT_OK(ferry_device_download(dev, got, dp, XROW));
            assert_memory_equal(got, bank + ((size_t)layer * XE + ex[j]) * XROW, XROW);
        }
        /* the next layer's routes, mostly right, and a draft of the next
         * token's same layer */
        uint32_t nl = (layer + 1) % XL, h[3];
        for (int j = 0; j < 3; j++)
            h[j] = ferry__rng_below(&r, XE / 2);
        FT_ASSERT_OK(ferry_moe_planner_hint(p, nl, 1, h, 3, 0.9));
        FT_ASSERT_OK(ferry_moe_planner_hint(p, layer, XL, ex, 3, 0.5));
        int n = ferry_moe_planner_hint_prefetch(p, 2, &plan);
        assert_true(n >= 0);
        if (n > 0)
            apply_ok(x, &plan, rows, 1);
        uint32_t unk[XSLOTS], nu = 0;
        assert_true(ferry_moe_slots_prefetch_finish(x, unk, &nu) >= 0);
        assert_int_equal(nu, 0);
        FT_ASSERT_OK(ferry_moe_check(p, x));
    }
    ferry_moe_hint_stats h = hstats(p);
    assert_true(h.fetched > 0 && h.right > 0);
    ferry_moe_planner_destroy(p);
    ferry_moe_slots_destroy(x);
    ferry_moe_rows_destroy(rows);
    ferry_device_close(dev);
    free(bank);
}

typedef struct oom_ctx {
    int calls;
} oom_ctx;

static int hint_oom_run(void *ctx)
{
    (void)ctx;
    ft_oom_pause();
    ferry_moe_planner_options o = FERRY_MOE_PLANNER_OPTIONS_INIT;
    o.num_layers = 2;
    o.num_experts = 8;
    o.slots = 3;
    ferry_moe_planner *p;
    if (ferry_moe_planner_create(&o, &p) < 0)
        return -1;
    uint32_t e[2] = {1, 2};
    ft_oom_resume();
    int rc = ferry_moe_planner_hint(p, 1, 2, e, 2, 0.5);
    if (rc >= 0) {
        rc = ferry_moe_planner_hint_prefetch(p, 2, NULL);
        if (rc >= 0)
            rc = ferry_moe_planner_resize(p, 5);
    }
    ft_oom_pause();
    /* whatever failed, the planner still works */
    uint32_t x = 3;
    if (ferry_moe_planner_ensure(p, 0, &x, 1, NULL, NULL, NULL) < 0)
        rc = -EIO;
    ferry_moe_planner_destroy(p);
    ft_oom_resume();
    return rc;
}

static void hints_survive_out_of_memory_at_every_allocation(void **state)
{
    (void)state;
    oom_ctx c = {0};
    ft_oom_each(512, 0, hint_oom_run, &c); /* (the default policy, auto, allocates its three) */
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(a_hinted_expert_survives_until_its_step_under_every_policy),
        cmocka_unit_test(a_hint_expires_at_its_step_and_counts_wrong),
        cmocka_unit_test(hints_of_one_expert_merge_and_protect_until_the_latest),
        cmocka_unit_test(the_least_confident_then_the_farthest_hint_goes_first),
        cmocka_unit_test(a_step_wider_than_the_unhinted_slots_still_succeeds),
        cmocka_unit_test(hint_prefetch_brings_the_best_missing_hints_in),
        cmocka_unit_test(hint_prefetch_never_evicts_a_hint_worth_as_much),
        cmocka_unit_test(prefetch_and_forget_keep_the_pin_counts_with_hints),
        cmocka_unit_test(a_hint_protects_only_when_surer_than_the_victims_return),
        cmocka_unit_test(hint_prefetch_scales_with_confidence),
        cmocka_unit_test(hints_that_do_not_come_true_lose_their_rows),
        cmocka_unit_test(bad_hints_are_refused_and_change_nothing),
        cmocka_unit_test(belady_refuses_hints),
        cmocka_unit_test(random_hints_never_fail_a_step),
        cmocka_unit_test(hinted_plans_move_the_right_bytes_through_an_executor),
        cmocka_unit_test(hints_survive_out_of_memory_at_every_allocation),
        cmocka_unit_test(a_hint_prefetch_that_fails_part_way_places_nothing),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
