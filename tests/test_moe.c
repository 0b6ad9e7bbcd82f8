/*
 * test_moe.c - the expert planner and its policies, routing traces (both
 * formats, malformed input), replay and Belady.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ferry_test.h"
#include "moe_traces.h"
#include "moe/moe_internal.h"

/* occupant and lookup are inverse maps, and no expert is in two slots */
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
    for (uint32_t l = 0; l < L; l++)
        for (uint32_t e = 0; e < E; e++) {
            uint32_t s = ferry_moe_planner_lookup(p, l, e);
            if (s != FERRY_MOE_NONE)
                assert_int_equal(ferry_moe_planner_occupant(p, s), l * E + e);
        }
}

static void ensure_collapses_duplicates_and_counts(void **state)
{
    (void)state;
    ferry_moe_planner *p = ft_moe_mk(2, 8, 8, "lru", NULL);
    uint32_t route[] = {5, 2, 5, 7}, slots[4];
    ferry_moe_copy_plan plan;
    ferry_moe_counts c;
    assert_int_equal(ferry_moe_planner_ensure(p, 1, route, 4, slots, &plan, &c), 3);
    assert_int_equal(c.active, 3);
    assert_int_equal(c.missing, 3);
    assert_int_equal(c.fetched, 3);
    /* free slots go lowest first, in route order; the duplicate shares */
    assert_int_equal(slots[0], 0);
    assert_int_equal(slots[1], 1);
    assert_int_equal(slots[2], 0);
    assert_int_equal(slots[3], 2);
    assert_int_equal(plan.layer, 1);
    assert_int_equal(plan.n, 3);
    assert_int_equal(plan.dst_slots[0], 0);
    assert_int_equal(plan.src_rows[0], 5); /* layer-local row */
    assert_int_equal(plan.src_rows[1], 2);
    assert_int_equal(plan.src_rows[2], 7);
    assert_int_equal(ferry_moe_planner_occupant(p, 0), 1 * 8 + 5);
    assert_consistent(p, 2, 8);
    ferry_moe_planner_destroy(p);
}

static void a_resident_route_is_a_warm_step_with_an_empty_plan(void **state)
{
    (void)state;
    ferry_moe_planner *p = ft_moe_mk(1, 4, 4, "lru", NULL);
    uint32_t route[] = {1, 3}, slots[2];
    ferry_moe_copy_plan plan;
    ferry_moe_counts c;
    assert_int_equal(ferry_moe_planner_ensure(p, 0, route, 2, NULL, NULL, NULL), 2);
    assert_int_equal(ferry_moe_planner_ensure(p, 0, route, 2, slots, &plan, &c), 0);
    assert_int_equal(plan.n, 0);
    assert_int_equal(c.active, 2);
    assert_int_equal(c.missing, 0);
    assert_int_equal(slots[0], 0);
    assert_int_equal(slots[1], 1);
    ferry_moe_planner_stats st = FERRY_MOE_PLANNER_STATS_INIT;
    ferry_moe_planner_stats_get(p, &st);
    assert_int_equal(st.hits, 2);
    assert_int_equal(st.misses, 2);
    assert_int_equal(st.steps, 2);
    ferry_moe_planner_destroy(p);
}

static void lru_evicts_least_recent_with_lowest_slot_ties(void **state)
{
    (void)state;
    /* 2 layers x 2 experts, 2 slots: each layer's step needs both slots */
    ferry_moe_planner *p = ft_moe_mk(2, 2, 2, "lru", NULL);
    uint32_t a[] = {0}, b[] = {1}, slots[1];
    assert_int_equal(ferry_moe_planner_ensure(p, 0, a, 1, slots, NULL, NULL), 1);
    assert_int_equal(slots[0], 0);
    assert_int_equal(ferry_moe_planner_ensure(p, 0, b, 1, slots, NULL, NULL), 1);
    assert_int_equal(slots[0], 1);
    /* layer 1 expert 0: victim is slot 0 (used at step 1, older) */
    assert_int_equal(ferry_moe_planner_ensure(p, 1, a, 1, slots, NULL, NULL), 1);
    assert_int_equal(slots[0], 0);
    assert_int_equal(ferry_moe_planner_lookup(p, 0, 0), FERRY_MOE_NONE);
    /* touch (0,1) again, then a new expert evicts (1,0) in slot 0 */
    assert_int_equal(ferry_moe_planner_ensure(p, 0, b, 1, slots, NULL, NULL), 0);
    assert_int_equal(ferry_moe_planner_ensure(p, 1, b, 1, slots, NULL, NULL), 1);
    assert_int_equal(slots[0], 0);
    assert_int_equal(ferry_moe_planner_lookup(p, 0, 1), 1);
    ferry_moe_planner_destroy(p);
}

/* random routes through every online policy: every routed expert ends the
 * step resident in the slot ensure() named, nothing of the step was
 * evicted by its own misses, the maps stay inverse */
static void every_policy_keeps_the_current_step_resident(void **state)
{
    (void)state;
    const char *const *pols = ferry_moe_policies();
    const uint32_t L = 6, E = 16, K = 4;
    for (int i = 0; pols[i]; i++) {
        if (!strcmp(pols[i], "belady"))
            continue;
        for (uint32_t slots = E; slots <= 3 * E; slots += E) {
            ferry_moe_planner *p = ft_moe_mk(L, E, slots, pols[i], NULL);
            ferry__rng r;
            ferry__rng_seed(&r, 42 + slots);
            for (int t = 0; t < 300; t++) {
                for (uint32_t l = 0; l < L; l++) {
                    uint32_t route[K], out[K];
                    for (uint32_t k = 0; k < K; k++)
                        route[k] = ferry__rng_below(&r, k == 0 ? 3 : E); /* some skew */
                    ferry_moe_counts c;
                    ferry_moe_copy_plan plan;
                    int rc = ferry_moe_planner_ensure(p, l, route, K, out, &plan, &c);
                    if (rc < 0)
                        fail_msg("%s: %s", pols[i], ferry_last_error());
                    for (uint32_t k = 0; k < K; k++)
                        assert_int_equal(ferry_moe_planner_occupant(p, out[k]), l * E + route[k]);
                    for (uint32_t j = 0; j < plan.n; j++)
                        assert_int_equal(ferry_moe_planner_occupant(p, plan.dst_slots[j]),
                                         l * E + plan.src_rows[j]);
                }
                if (t % 50 == 0)
                    assert_consistent(p, L, E);
            }
            /* a prefill layer fits and stays whole */
            ferry_moe_copy_plan plan;
            assert_true(ferry_moe_planner_prefill(p, 2, &plan, NULL) >= 0);
            for (uint32_t e = 0; e < E; e++)
                assert_int_not_equal(ferry_moe_planner_lookup(p, 2, e), FERRY_MOE_NONE);
            assert_consistent(p, L, E);
            ferry_moe_planner_destroy(p);
        }
    }
}

/* slots as few as a step routes (top_k up to twice it): every policy
 * places every step; a victim is always there (the slots not of the step).
 * s3fifo failed this: with its small queue at its target and the main one
 * holding only the step's experts, it cycled the main queue and gave up. */
static void every_policy_fits_a_step_in_as_few_slots_as_it_routes(void **state)
{
    (void)state;
    const char *const *pols = ferry_moe_policies();
    const uint32_t L = 2, E = 8;
    for (int i = 0; pols[i]; i++) {
        if (!strcmp(pols[i], "belady"))
            continue;
        for (uint32_t K = 1; K <= 3; K++)
            for (uint32_t slots = K; slots <= 2 * K; slots++) {
                ferry_moe_planner *p = ft_moe_mk(L, E, slots, pols[i], NULL);
                ferry__rng r;
                ferry__rng_seed(&r, 7 * slots + K);
                for (int t = 0; t < 200; t++)
                    for (uint32_t l = 0; l < L; l++) {
                        uint32_t route[3], out[3];
                        for (uint32_t k = 0; k < K; k++)
                            route[k] = ferry__rng_below(&r, k == 0 ? 2 : E);
                        if (ferry_moe_planner_ensure(p, l, route, K, out, NULL, NULL) < 0)
                            fail_msg("%s, top-%u in %u slots, token %d layer %u: %s", pols[i], K,
                                     slots, t, l, ferry_last_error());
                        for (uint32_t k = 0; k < K; k++)
                            assert_int_equal(ferry_moe_planner_occupant(p, out[k]),
                                             l * E + route[k]);
                    }
                assert_consistent(p, L, E);
                ferry_moe_planner_destroy(p);
            }
    }
}

/* held[slot]: the expert whose row a caller copied there, from the plans
 * it was given (a failed call gives none) */
static void apply_plan(uint32_t *held, uint32_t E, const ferry_moe_copy_plan *plan)
{
    for (uint32_t i = 0; i < plan->n; i++)
        held[plan->dst_slots[i]] = plan->layer * E + plan->src_rows[i];
}

/* every slot the planner calls some expert's holds that expert's row */
static void assert_rows_right(const ferry_moe_planner *p, const uint32_t *held, const char *pol,
                              int t)
{
    for (uint32_t s = 0; s < ferry_moe_planner_slots(p); s++) {
        uint32_t id = ferry_moe_planner_occupant(p, s);
        if (id != FERRY_MOE_NONE && held[s] != id)
            fail_msg("%s, call %d: slot %u said to hold expert id %u, holds %u's row", pol, t, s,
                     id, held[s]);
    }
}

/* A policy that fails part way through a step's misses (-ENOMEM, or a
 * policy that finds no victim) must not leave the misses placed before it
 * resident: the caller got an error and no plan, so those slots still
 * hold other experts' rows, and a later step would "hit" them. Each call
 * below fails at its first, second or later insert in turn; after every
 * call, failed or not, each resident expert's slot holds its row. */
static void a_step_that_fails_part_way_places_nothing(void **state)
{
    (void)state;
    const char *const *pols = ferry_moe_policies();
    const uint32_t L = 2, E = 16, K = 4;
    for (int i = 0; pols[i]; i++) {
        if (!strcmp(pols[i], "belady"))
            continue;
        ferry_moe_planner *p = ft_moe_mk(L, E, 10, pols[i], NULL);
        uint32_t held[10];
        for (uint32_t s = 0; s < 10; s++)
            held[s] = FERRY_MOE_NONE;
        ferry__rng r;
        ferry__rng_seed(&r, 11);
        int failed = 0;
        for (int t = 0; t < 300; t++) {
            uint32_t l = (uint32_t)t % L, route[K], out[K];
            for (uint32_t k = 0; k < K; k++)
                route[k] = ferry__rng_below(&r, E);
            ferry__planner_fault_insert = t % 3 ? 0 : 1 + (uint64_t)(t / 3) % 3;
            ferry_moe_copy_plan plan;
            int rc;
            if (t % 7 == 3) {
                rc = ferry_moe_planner_prefetch(p, (l + 1) % L, route, K, &plan);
            } else if (t % 7 == 5) {
                rc = ferry_moe_planner_stream_begin(p, l, route, K, NULL);
                ferry_moe_wave w;
                while (rc >= 0 && (rc = ferry_moe_planner_stream_next(p, &w)) > 0)
                    apply_plan(held, E, &w.plan);
            } else {
                rc = ferry_moe_planner_ensure(p, l, route, K, out, &plan, NULL);
            }
            if (rc == -ENOMEM) {
                failed++;
                assert_non_null(strstr(ferry_moe_planner_last_error(p), pols[i]));
            } else if (rc < 0) {
                fail_msg("%s, call %d: %s", pols[i], t, ferry_moe_planner_last_error(p));
            } else if (t % 7 != 5) {
                apply_plan(held, E, &plan);
            }
            ferry__planner_fault_insert = 0;
            assert_rows_right(p, held, pols[i], t);
            assert_consistent(p, L, E);
        }
        assert_true(failed > 20); /* (the loop tested failures) */
        ferry_moe_planner_destroy(p);
    }
}

static void bad_routes_fail_and_change_nothing(void **state)
{
    (void)state;
    ferry_moe_planner *p = ft_moe_mk(2, 4, 4, "routing", NULL);
    uint32_t ok[] = {1}, big[] = {1, 4};
    assert_int_equal(ferry_moe_planner_ensure(p, 0, ok, 1, NULL, NULL, NULL), 1);
    ferry_moe_planner_stats before = FERRY_MOE_PLANNER_STATS_INIT, after = FERRY_MOE_PLANNER_STATS_INIT;
    ferry_moe_planner_stats_get(p, &before);
    assert_int_equal(ferry_moe_planner_ensure(p, 0, big, 2, NULL, NULL, NULL), -EINVAL);
    assert_non_null(strstr(ferry_moe_planner_last_error(p), "expert 4"));
    assert_int_equal(ferry_moe_planner_ensure(p, 2, ok, 1, NULL, NULL, NULL), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "layer 2"));
    assert_int_equal(ferry_moe_planner_ensure(p, 1, ok, 0, NULL, NULL, NULL), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "empty route"));
    ferry_moe_planner_stats_get(p, &after);
    assert_memory_equal(&before, &after, sizeof before);
    assert_int_equal(ferry_moe_planner_lookup(p, 0, 1), 0);
    assert_int_equal(ferry_moe_planner_occupant(p, 1), FERRY_MOE_NONE);
    ferry_moe_planner_destroy(p);

    ferry_moe_planner_options o = FERRY_MOE_PLANNER_OPTIONS_INIT;
    ferry_moe_planner *q = NULL;
    o.num_layers = 2;
    o.num_experts = 8;
    o.slots = 0;
    assert_int_equal(ferry_moe_planner_create(&o, &q), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "slots 0"));
    o.slots = 8;
    o.policy = "mru";
    assert_int_equal(ferry_moe_planner_create(&o, &q), -EINVAL);
    o.policy = "belady";
    assert_int_equal(ferry_moe_planner_create(&o, &q), -EINVAL);
    assert_null(q);
}

/* moe.h: a NULL planner's accessors answer ("", 0, NONE, -EINVAL), never
 * dereference it (a binding that closed its planner may still ask) */
static void a_null_planner_is_answered_not_dereferenced(void **state)
{
    (void)state;
    ferry_moe_planner_stats st = FERRY_MOE_PLANNER_STATS_INIT;
    uint32_t one = 1;
    assert_string_equal(ferry_moe_planner_policy(NULL), "");
    assert_string_equal(ferry_moe_planner_last_error(NULL), "");
    assert_int_equal(ferry_moe_planner_slots(NULL), 0);
    assert_int_equal(ferry_moe_planner_occupant(NULL, 0), FERRY_MOE_NONE);
    assert_int_equal(ferry_moe_planner_lookup(NULL, 0, 0), FERRY_MOE_NONE);
    assert_int_equal(ferry_moe_planner_stats_get(NULL, &st), -EINVAL);
    assert_int_equal(ferry_moe_planner_ensure(NULL, 0, &one, 1, NULL, NULL, NULL), -EINVAL);
    ferry_moe_planner_destroy(NULL);
}

static void planner_options_are_range_checked(void **state)
{
    (void)state;
    struct {
        uint32_t layers, experts, slots;
        const char *policy, *field;
    } bad[] = {
        {0, 8, 8, NULL, "num_layers 0"},
        {1025, 8, 8, NULL, "num_layers 1025"},
        {UINT32_MAX, 8, 8, NULL, "num_layers"},
        {2, 0, 8, NULL, "num_experts 0"},
        {2, 16385, 16385, NULL, "num_experts 16385"},
        {2, UINT32_MAX, UINT32_MAX, NULL, "num_experts"},
        /* the old check let L x E up to 2^32 through: far past any array */
        {65536, 65535, 65535, NULL, "num_layers 65536"},
        {2, 8, 0, NULL, "slots 0"},
        {2, 8, (1u << 24) + 1, NULL, "slots 16777217"},
        {2, 8, UINT32_MAX, NULL, "slots 4294967295"},
        {2, 8, 8, "mru", "policy 'mru'"},
        {2, 8, 8, "", "policy ''"},
    };
    for (size_t i = 0; i < FERRY__ARRAY_LEN(bad); i++) {
        ferry_moe_planner_options o = FERRY_MOE_PLANNER_OPTIONS_INIT;
        o.num_layers = bad[i].layers;
        o.num_experts = bad[i].experts;
        o.slots = bad[i].slots;
        o.policy = bad[i].policy;
        ferry_moe_planner *p = (ferry_moe_planner *)0x1;
        assert_int_equal(ferry_moe_planner_create(&o, &p), -EINVAL);
        assert_ptr_equal(p, (ferry_moe_planner *)0x1);
        if (!strstr(ferry_last_error(), bad[i].field))
            fail_msg("case %zu: message '%s' does not name '%s'", i, ferry_last_error(),
                     bad[i].field);
    }
    ferry_moe_planner_options o = FERRY_MOE_PLANNER_OPTIONS_INIT;
    o.size = 0;
    ferry_moe_planner *p = NULL;
    assert_int_equal(ferry_moe_planner_create(&o, &p), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "options size 0"));

    /* the smallest shape; resize keeps the same slot range */
    p = ft_moe_mk(1, 1, 1, "lru", NULL);
    assert_int_equal(ferry_moe_planner_resize(p, (1u << 24) + 1), -EINVAL);
    assert_non_null(strstr(ferry_moe_planner_last_error(p), "new_slots 16777217"));
    assert_int_equal(ferry_moe_planner_resize(p, UINT32_MAX), -EINVAL);
    assert_int_equal(ferry_moe_planner_slots(p), 1);
    ferry_moe_planner_destroy(p);

    /* any expert_bytes: the byte figures saturate instead of wrapping */
    o = (ferry_moe_planner_options)FERRY_MOE_PLANNER_OPTIONS_INIT;
    o.num_layers = 2;
    o.num_experts = 8;
    o.slots = 16;
    o.expert_bytes = UINT64_MAX;
    FT_ASSERT_OK(ferry_moe_planner_create(&o, &p));
    const uint32_t two[2] = {3, 5};
    assert_int_equal(ferry_moe_planner_prefetch(p, 1, two, 2, NULL), 2);
    ferry_moe_planner_stats st = FERRY_MOE_PLANNER_STATS_INIT;
    ferry_moe_planner_stats_get(p, &st);
    assert_int_equal(st.prefetch_fetched, 2);
    assert_true(st.prefetch_bytes == UINT64_MAX);
    ferry_moe_planner_destroy(p);

    /* replay takes its slot count through the same ranges */
    ferry_moe_model m;
    memset(&m, 0, sizeof m);
    m.num_layers = 1;
    m.num_experts = 4;
    ferry_moe_trace *t = NULL;
    FT_ASSERT_OK(ferry_moe_trace_create(&m, &t));
    for (uint32_t tk = 0; tk < 4; tk++) {
        const uint32_t e = tk;
        FT_ASSERT_OK(ferry_moe_trace_append(t, tk, 0, &e, 1));
    }
    ferry_moe_replay_result r;
    assert_int_equal(ferry_moe_replay(t, "lru", UINT32_MAX, 0, &r), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "slots 4294967295"));
    FT_ASSERT_OK(ferry_moe_replay(t, "lru", 4, UINT64_MAX, &r));
    assert_int_equal(r.misses, 4);
    assert_true(r.host_bytes == UINT64_MAX);
    ferry_moe_trace_destroy(t);
}

/* an older header's options (up to slots) create with the defaults past
 * them (policy auto); a shorter size, or one inside a member, is refused */
static void older_planner_options_prefix_is_accepted(void **state)
{
    (void)state;
    ferry_moe_planner_options o = FERRY_MOE_PLANNER_OPTIONS_INIT;
    o.num_layers = 2;
    o.num_experts = 4;
    o.slots = 4;
    o.policy = "no-such-policy"; /* past the prefix: not read (else refused) */
    o.size = FERRY_MOE_PLANNER_OPTIONS_MIN_SIZE;
    ferry_moe_planner *p = NULL;
    FT_ASSERT_OK(ferry_moe_planner_create(&o, &p));
    assert_string_equal(ferry_moe_planner_policy(p), "auto");
    ferry_moe_planner_destroy(p);
    p = (ferry_moe_planner *)0x1;
    o.size = FERRY_MOE_PLANNER_OPTIONS_MIN_SIZE - 4;
    assert_int_equal(ferry_moe_planner_create(&o, &p), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "FERRY_MOE_PLANNER_OPTIONS_MIN_SIZE"));
    o.size = offsetof(ferry_moe_planner_options, oracle) + 4;
    assert_int_equal(ferry_moe_planner_create(&o, &p), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "inside oracle"));
    assert_ptr_equal(p, (ferry_moe_planner *)0x1);
}

static void forget_frees_the_slot_and_the_expert_misses_again(void **state)
{
    (void)state;
    ferry_moe_planner *p = ft_moe_mk(1, 4, 4, "s3fifo", NULL);
    uint32_t route[] = {2, 3}, slots[2];
    assert_int_equal(ferry_moe_planner_ensure(p, 0, route, 2, slots, NULL, NULL), 2);
    FT_ASSERT_OK(ferry_moe_planner_forget(p, slots[0]));
    assert_int_equal(ferry_moe_planner_occupant(p, slots[0]), FERRY_MOE_NONE);
    assert_int_equal(ferry_moe_planner_lookup(p, 0, 2), FERRY_MOE_NONE);
    FT_ASSERT_OK(ferry_moe_planner_forget(p, slots[0])); /* free already: no-op */
    assert_int_equal(ferry_moe_planner_forget(p, 4), -EINVAL);
    ferry_moe_counts c;
    assert_int_equal(ferry_moe_planner_ensure(p, 0, route, 2, NULL, NULL, &c), 1);
    assert_int_equal(c.missing, 1);
    ferry_moe_planner_stats st = FERRY_MOE_PLANNER_STATS_INIT;
    ferry_moe_planner_stats_get(p, &st);
    assert_int_equal(st.forgotten, 1);
    assert_consistent(p, 1, 4);
    ferry_moe_planner_destroy(p);
}

/* a miss takes the lowest free slot, whichever way slots came free:
 * never used, forgotten, past a shrink's survivors or a grow's end */
static void a_miss_takes_the_lowest_free_slot(void **state)
{
    (void)state;
    ferry_moe_planner *p = ft_moe_mk(1, 64, 16, "lru", NULL);
    uint8_t used[32] = {0};
    uint32_t n = 16, e = 0, slot;
    /* expected: the lowest slot not in use */
#define NEXT_FREE(x) for (x = 0; used[x]; x++)
    for (int round = 0; round < 6; round++) {
        for (int k = 0; k < 5 && e < 64; k++, e++) { /* misses */
            uint32_t want;
            NEXT_FREE(want);
            if (want >= n)
                break;
            assert_int_equal(ferry_moe_planner_ensure(p, 0, &e, 1, &slot, NULL, NULL), 1);
            assert_int_equal(slot, want);
            used[slot] = 1;
        }
        /* forget two, the higher first */
        uint32_t a = (uint32_t)(round * 5 + 3) % n, b = (uint32_t)(round * 3 + 1) % n;
        uint32_t hi = a > b ? a : b, lo = a > b ? b : a;
        FT_ASSERT_OK(ferry_moe_planner_forget(p, hi));
        FT_ASSERT_OK(ferry_moe_planner_forget(p, lo));
        used[hi] = used[lo] = 0;
        if (round == 2) { /* shrink: slots past the end go */
            int dropped = ferry_moe_planner_resize(p, 10);
            assert_true(dropped >= 0);
            for (uint32_t v = 10; v < n; v++)
                used[v] = 0;
            n = 10;
        } else if (round == 4) { /* grow */
            assert_int_equal(ferry_moe_planner_resize(p, 24), 0);
            n = 24;
        }
        for (uint32_t v = 0; v < n; v++)
            assert_int_equal(ferry_moe_planner_occupant(p, v) != FERRY_MOE_NONE, used[v]);
    }
#undef NEXT_FREE
    ferry_moe_planner_destroy(p);
}

static void resize_grows_and_drops_occupants_past_the_end(void **state)
{
    (void)state;
    ferry_moe_planner *p = ft_moe_mk(2, 4, 8, "lfu", NULL);
    ferry_moe_copy_plan plan;
    assert_int_equal(ferry_moe_planner_prefill(p, 0, &plan, NULL), 4);
    assert_int_equal(ferry_moe_planner_prefill(p, 1, &plan, NULL), 4);
    assert_int_equal(ferry_moe_planner_resize(p, 0), -EINVAL);
    assert_int_equal(ferry_moe_planner_resize(p, 6), 2);
    assert_int_equal(ferry_moe_planner_slots(p), 6);
    assert_int_equal(ferry_moe_planner_lookup(p, 1, 2), FERRY_MOE_NONE);
    assert_int_equal(ferry_moe_planner_lookup(p, 1, 1), 5);
    assert_consistent(p, 2, 4);
    assert_int_equal(ferry_moe_planner_resize(p, 10), 0);
    uint32_t r[] = {2, 3};
    uint32_t slots[2];
    assert_int_equal(ferry_moe_planner_ensure(p, 1, r, 2, slots, NULL, NULL), 2);
    assert_int_equal(slots[0], 6); /* the new free slots, lowest first */
    assert_int_equal(slots[1], 7);
    assert_consistent(p, 2, 4);
    ferry_moe_planner_destroy(p);
}

static void prefetch_brings_experts_in_without_evicting_the_step(void **state)
{
    (void)state;
    const char *pols[] = {"lru", "lru-layer", "lfu", "lfru", "s3fifo", "routing"};
    for (size_t i = 0; i < sizeof pols / sizeof pols[0]; i++) {
        ferry_moe_planner *p = ft_moe_mk(2, 4, 4, pols[i], NULL);
        uint32_t step[] = {0, 1}, next[] = {0, 1, 2};
        assert_int_equal(ferry_moe_planner_ensure(p, 0, step, 2, NULL, NULL, NULL), 2);
        /* 2 free slots, 3 asked: the third would need a victim, and the
         * only residents are the current step's: refused */
        ferry_moe_copy_plan plan;
        assert_int_equal(ferry_moe_planner_prefetch(p, 1, next, 3, &plan), FERRY_ENOSPACE);
        assert_int_not_equal(ferry_moe_planner_lookup(p, 0, 0), FERRY_MOE_NONE);
        assert_int_not_equal(ferry_moe_planner_lookup(p, 0, 1), FERRY_MOE_NONE);
        assert_consistent(p, 2, 4);
        ferry_moe_planner_destroy(p);

        p = ft_moe_mk(2, 4, 6, pols[i], NULL);
        assert_int_equal(ferry_moe_planner_ensure(p, 0, step, 2, NULL, NULL, NULL), 2);
        assert_int_equal(ferry_moe_planner_prefetch(p, 1, next, 3, &plan), 3);
        assert_int_equal(plan.layer, 1);
        assert_int_equal(plan.n, 3);
        assert_int_not_equal(ferry_moe_planner_lookup(p, 0, 0), FERRY_MOE_NONE);
        ferry_moe_counts c;
        uint32_t used[] = {1, 2};
        assert_int_equal(ferry_moe_planner_ensure(p, 1, used, 2, NULL, NULL, &c), 0);
        assert_int_equal(c.prefetch_hits, 2);
        ferry_moe_planner_stats st = FERRY_MOE_PLANNER_STATS_INIT;
        ferry_moe_planner_stats_get(p, &st);
        assert_int_equal(st.prefetch_requests, 3);
        assert_int_equal(st.prefetch_fetched, 3);
        assert_int_equal(st.prefetch_hits, 2);
        assert_int_equal(st.prefetch_wasted, 0);
        /* fill up: the unused prefetched expert (1,0) is evicted unused
         * sooner or later, and is billed as wasted */
        for (uint32_t e = 0; e < 4; e++) {
            uint32_t r[] = {e}, three[] = {3};
            assert_true(ferry_moe_planner_ensure(p, 0, r, 1, NULL, NULL, NULL) >= 0);
            assert_true(ferry_moe_planner_ensure(p, 1, three, 1, NULL, NULL, NULL) >= 0);
        }
        FT_ASSERT_OK(ferry_moe_planner_prefill(p, 0, NULL, NULL));
        ferry_moe_planner_stats_get(p, &st);
        if (ferry_moe_planner_lookup(p, 1, 0) == FERRY_MOE_NONE)
            assert_int_equal(st.prefetch_wasted, 1);
        else
            assert_int_equal(st.prefetch_wasted, 0);
        assert_consistent(p, 2, 4);
        ferry_moe_planner_destroy(p);
    }
}

/* ---- traces ---- */
static const char good_ferry[] =
    "{\"model\":\"tiny\",\"num_layers\":2,\"num_experts\":4,\"top_k\":2,\"expert_bytes\":1000}\n"
    "{\"token\":1,\"layer\":0,\"experts\":[3,1]}\n"
    "\n"
    "{\"token\":0,\"layer\":1,\"experts\":[2]}\r\n"
    "{\"token\":0,\"layer\":0,\"experts\":[0,1]}\n";

static void ferry_traces_load_in_token_layer_order(void **state)
{
    (void)state;
    ferry_moe_trace *t = NULL;
    FT_ASSERT_OK(ferry_moe_trace_parse(good_ferry, strlen(good_ferry), &t));
    const ferry_moe_model *m = ferry_moe_trace_model(t);
    assert_string_equal(m->name, "tiny");
    assert_int_equal(m->num_layers, 2);
    assert_int_equal(m->num_experts, 4);
    assert_int_equal(m->top_k, 2);
    assert_int_equal(m->expert_bytes, 1000);
    assert_int_equal(ferry_moe_trace_steps(t), 3);
    assert_int_equal(ferry_moe_trace_tokens(t), 2);
    uint32_t tok, layer, n;
    const uint32_t *ex;
    FT_ASSERT_OK(ferry_moe_trace_step(t, 0, &tok, &layer, &ex, &n));
    assert_int_equal(tok, 0);
    assert_int_equal(layer, 0);
    assert_int_equal(n, 2);
    assert_int_equal(ex[0], 0);
    FT_ASSERT_OK(ferry_moe_trace_step(t, 1, &tok, &layer, &ex, &n));
    assert_int_equal(layer, 1);
    assert_int_equal(ex[0], 2);
    FT_ASSERT_OK(ferry_moe_trace_step(t, 2, &tok, &layer, &ex, &n));
    assert_int_equal(tok, 1);
    assert_int_equal(ex[0], 3);
    assert_int_equal(ferry_moe_trace_step(t, 3, &tok, &layer, &ex, &n), -EINVAL);
    ferry_moe_trace_destroy(t);
}

static void vllm_captures_read_module_paths_and_token_lists(void **state)
{
    (void)state;
    static const char cap[] =
        "{\"layer\":\"model.layers.1.mlp.gate\",\"num_experts\":10,\"topk_ids\":[[5,6],[7,8]]}\n"
        "{\"layer\":\"model.layers.0.mlp.gate\",\"num_experts\":10,\"topk_ids\":[[1,2],[3,4]]}\n"
        "{\"layer\":\"model.layers.0.mlp.gate\",\"num_experts\":10,\"topk_ids\":[[9,1]]}\n";
    ferry_moe_trace *t = NULL;
    FT_ASSERT_OK(ferry_moe_trace_parse(cap, strlen(cap), &t));
    const ferry_moe_model *m = ferry_moe_trace_model(t);
    assert_int_equal(m->num_layers, 2);
    assert_int_equal(m->num_experts, 10); /* what the records say */
    assert_int_equal(m->top_k, 2);        /* the widest per-token list */
    /* a record is one pass of its layer: (0,0) {1,2,3,4}; (0,1) {5,6,7,8};
     * (1,0) {9,1} */
    assert_int_equal(ferry_moe_trace_steps(t), 3);
    assert_int_equal(ferry_moe_trace_tokens(t), 2);
    uint32_t tok, layer, n;
    const uint32_t *ex;
    FT_ASSERT_OK(ferry_moe_trace_step(t, 1, &tok, &layer, &ex, &n));
    assert_int_equal(tok, 0);
    assert_int_equal(layer, 1);
    assert_int_equal(n, 4);
    assert_int_equal(ex[0], 5);
    assert_int_equal(ferry_moe_trace_step_tokens(t, 1), 2);
    FT_ASSERT_OK(ferry_moe_trace_step(t, 2, &tok, &layer, &ex, &n));
    assert_int_equal(tok, 1);
    assert_int_equal(layer, 0);
    assert_int_equal(ex[0], 9);
    assert_int_equal(ferry_moe_trace_step_tokens(t, 2), 1);
    ferry_moe_trace_destroy(t);
}

static void expect_parse_error(const char *text, const char *needle1, const char *needle2)
{
    ferry_moe_trace *t = NULL;
    int rc = ferry_moe_trace_parse(text, strlen(text), &t);
    if (rc != FERRY_EPARSE)
        fail_msg("'%s' -> %d, expected FERRY_EPARSE", text, rc);
    assert_null(t);
    const char *msg = ferry_last_error();
    if (!strstr(msg, needle1) || (needle2 && !strstr(msg, needle2)))
        fail_msg("'%s': message '%s' lacks '%s' / '%s'", text, msg, needle1,
                 needle2 ? needle2 : "");
}

#define HDR "{\"model\":\"m\",\"num_layers\":2,\"num_experts\":4,\"top_k\":2}\n"

static void malformed_traces_name_the_line_and_field(void **state)
{
    (void)state;
    ft_alloc_install(0, 0);
    expect_parse_error(HDR "{\"token\":0,\"layer\":0,\"experts\":[1]}\n{\"token\":1,", "line 3",
                       "not JSON");
    expect_parse_error(HDR "{\"token\":0,\"layer\":0,\"experts\":[4]}\n", "line 2", "'experts'[0]");
    expect_parse_error(HDR "{\"token\":0,\"layer\":0,\"experts\":[]}\n", "line 2", "empty route");
    expect_parse_error(HDR "{\"token\":0,\"layer\":2,\"experts\":[1]}\n", "line 2", "'layer'");
    expect_parse_error(HDR "{\"token\":-1,\"layer\":0,\"experts\":[1]}\n", "line 2", "'token'");
    expect_parse_error(HDR "{\"layer\":0,\"experts\":[1]}\n", "line 2", "'token' missing");
    expect_parse_error(HDR "{\"token\":0,\"layer\":0,\"experts\":[1,2,3]}\n", "line 2", "top_k");
    expect_parse_error(HDR "{\"token\":0,\"layer\":0,\"experts\":[\"1\"]}\n", "line 2",
                       "'experts'[0]");
    expect_parse_error(HDR "{\"token\":0,\"layer\":0,\"experts\":5}\n", "line 2", "'experts'");
    expect_parse_error("{\"token\":0,\"layer\":0,\"experts\":[1]}\n" HDR, "line 2", "header");
    expect_parse_error(HDR "[1,2]\n", "line 2", "object");
    expect_parse_error(HDR "{\"foo\":1}\n", "line 2", "neither");
    expect_parse_error("{\"num_layers\":0,\"num_experts\":4}\n", "line 1", "'num_layers'");
    expect_parse_error("{\"layer\":\"model.mlp\",\"topk_ids\":[[1]]}\n", "line 1", "'layer'");
    expect_parse_error("{\"layer\":\"model.layers.0.mlp\",\"num_experts\":4,\"topk_ids\":[[1],[]]}\n",
                       "line 1", "'topk_ids[1]'");
    expect_parse_error("{\"layer\":\"model.layers.0.mlp\",\"num_experts\":4,\"topk_ids\":[]}\n",
                       "line 1", "'topk_ids'");
    expect_parse_error("\n\n", "no route records", NULL);
    expect_parse_error("{\"token\":0,\"layer\":0,\"experts\":[99999999]}\n", "line 1", "experts");
    assert_int_equal(ft_alloc_live(), 0);
    ft_alloc_reset();
}

static int oom_parse(void *ctx)
{
    (void)ctx;
    ferry_moe_trace *t = NULL;
    int rc = ferry_moe_trace_parse(good_ferry, strlen(good_ferry), &t);
    if (rc < 0)
        assert_null(t);
    ferry_moe_trace_destroy(t);
    return rc;
}

static int oom_planner(void *ctx)
{
    (void)ctx;
    ferry_moe_planner_options o = FERRY_MOE_PLANNER_OPTIONS_INIT;
    o.num_layers = 3;
    o.num_experts = 8;
    o.slots = 12;
    o.policy = "routing";
    ferry_moe_planner *p = NULL;
    int rc = ferry_moe_planner_create(&o, &p);
    ferry_moe_planner_destroy(p);
    return rc;
}

/* one resize with allocation n failing: the planner is made and
 * destroyed with the allocator paused */
static int oom_resize(void *ctx)
{
    (void)ctx;
    ft_oom_pause();
    ferry_moe_planner *p = ft_moe_mk(3, 8, 12, "lru-layer", NULL);
    FT_ASSERT_OK(ferry_moe_planner_prefill(p, 1, NULL, NULL));
    int64_t before = ft_alloc_live();
    ft_oom_resume();
    int rc = ferry_moe_planner_resize(p, 9);
    ft_oom_pause();
    if (rc < 0) {
        assert_int_equal(rc, -ENOMEM);
        assert_int_equal(ft_alloc_live(), before); /* the resize's own blocks freed */
        assert_int_equal(ferry_moe_planner_slots(p), 12);
        for (uint32_t e = 0; e < 8; e++)
            assert_int_equal(ferry_moe_planner_lookup(p, 1, e), e);
    }
    ferry_moe_planner_destroy(p);
    return rc;
}

/* a resize with allocation n failing while a hinted victim is soft pinned:
 * the soft pin holds, so a prefetch may still take that slot */
static int oom_resize_soft(void *ctx)
{
    (void)ctx;
    ft_oom_pause();
    ferry_moe_planner *p = ft_moe_mk(1, 8, 3, "lru", NULL);
    uint32_t fill[] = {0, 1, 2}, zero[] = {0}, three[] = {3}, next[] = {4, 5};
    assert_int_equal(ferry_moe_planner_ensure(p, 0, fill, 3, NULL, NULL, NULL), 3);
    assert_int_equal(ferry_moe_planner_hint(p, 0, 2, zero, 1, 1.0), 1);
    /* 0 is the LRU victim but hinted: kept (soft pinned), 1 goes */
    assert_int_equal(ferry_moe_planner_ensure(p, 0, three, 1, NULL, NULL, NULL), 1);
    assert_int_equal(ferry_moe_planner_lookup(p, 0, 1), FERRY_MOE_NONE);
    ft_oom_resume();
    int rc = ferry_moe_planner_resize(p, 4);
    ft_oom_pause();
    if (rc < 0) {
        assert_int_equal(rc, -ENOMEM);
        assert_int_equal(ferry_moe_planner_slots(p), 3);
        /* 2 and then the soft pinned 0 make room; both rows planned */
        ferry_moe_copy_plan plan;
        assert_int_equal(ferry_moe_planner_prefetch(p, 0, next, 2, &plan), 2);
        assert_int_equal(ferry_moe_planner_lookup(p, 0, 0), FERRY_MOE_NONE);
        assert_int_not_equal(ferry_moe_planner_lookup(p, 0, 3), FERRY_MOE_NONE);
        assert_consistent(p, 1, 8);
    }
    ferry_moe_planner_destroy(p);
    return rc;
}

static void traces_survive_out_of_memory_at_every_allocation(void **state)
{
    (void)state;
    ft_oom_each(200, FT_OOM_STICKY, oom_parse, NULL);
    ft_oom_each(200, FT_OOM_STICKY, oom_planner, NULL);
    /* a resize that runs out of memory changes nothing and leaks nothing */
    ft_oom_each(100, FT_OOM_STICKY, oom_resize, NULL);
    ft_oom_each(100, FT_OOM_STICKY, oom_resize_soft, NULL);
}

static void saved_traces_load_back_identical(void **state)
{
    (void)state;
    char dir[256], path[300];
    ft_tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/t.jsonl", dir);
    ferry_moe_gen_options g = FERRY_MOE_GEN_OPTIONS_INIT;
    g.model = "small";
    g.tokens = 40;
    g.seed = 9;
    ferry_moe_trace *a = NULL, *b = NULL;
    FT_ASSERT_OK(ferry_moe_trace_generate(&g, &a));
    FT_ASSERT_OK(ferry_moe_trace_save(a, path));
    FT_ASSERT_OK(ferry_moe_trace_load(path, &b));
    assert_int_equal(ferry_moe_trace_steps(a), ferry_moe_trace_steps(b));
    const ferry_moe_model *ma = ferry_moe_trace_model(a), *mb = ferry_moe_trace_model(b);
    assert_string_equal(ma->name, mb->name);
    assert_int_equal(ma->num_layers, mb->num_layers);
    assert_int_equal(ma->num_experts, mb->num_experts);
    assert_int_equal(ma->top_k, mb->top_k);
    assert_int_equal(ma->expert_bytes, mb->expert_bytes);
    for (size_t i = 0; i < ferry_moe_trace_steps(a); i++) {
        uint32_t ta, la, na, tb, lb, nb;
        const uint32_t *ea, *eb;
        FT_ASSERT_OK(ferry_moe_trace_step(a, i, &ta, &la, &ea, &na));
        FT_ASSERT_OK(ferry_moe_trace_step(b, i, &tb, &lb, &eb, &nb));
        assert_int_equal(ta, tb);
        assert_int_equal(la, lb);
        assert_int_equal(na, nb);
        assert_memory_equal(ea, eb, na * sizeof *ea);
    }
    snprintf(path, sizeof path, "%s/missing.jsonl", dir);
    assert_int_equal(ferry_moe_trace_load(path, &b), -ENOENT);
    assert_non_null(strstr(ferry_last_error(), "missing.jsonl"));
    ferry_moe_trace_destroy(a);
    ferry_moe_trace_destroy(b);
    ft_rmtree(dir);
}

/* a refused prefetch pins nothing: the experts it named stay victims for
 * the next prefetch of the same step */
static void a_refused_prefetch_leaves_the_pins_as_they_were(void **state)
{
    (void)state;
    ferry_moe_planner *p = ft_moe_mk(1, 8, 4, "lru", NULL);
    uint32_t all[] = {0, 1, 2, 3}, zero[] = {0}, many[] = {1, 2, 3, 4, 5}, four[] = {4};
    assert_int_equal(ferry_moe_planner_ensure(p, 0, all, 4, NULL, NULL, NULL), 4);
    assert_int_equal(ferry_moe_planner_ensure(p, 0, zero, 1, NULL, NULL, NULL), 0);
    /* 2 misses, and 1, 2, 3 named with 0 pinned by the step: no room */
    assert_int_equal(ferry_moe_planner_prefetch(p, 0, many, 5, NULL), FERRY_ENOSPACE);
    assert_non_null(strstr(ferry_last_error(), "0 of 4 slots"));
    /* only 0 is pinned still: 4 evicts one of 1, 2, 3 */
    ferry_moe_copy_plan plan;
    assert_int_equal(ferry_moe_planner_prefetch(p, 0, four, 1, &plan), 1);
    assert_int_not_equal(ferry_moe_planner_lookup(p, 0, 0), FERRY_MOE_NONE);
    assert_int_not_equal(ferry_moe_planner_lookup(p, 0, 4), FERRY_MOE_NONE);
    assert_consistent(p, 1, 8);
    ferry_moe_planner_destroy(p);
}

/* a resize keeps the current step's pins: a prefetch after it still never
 * evicts an expert of the step (the caller may be computing it) */
static void a_resize_keeps_the_steps_pins(void **state)
{
    (void)state;
    uint32_t both[] = {0, 1}, zero[] = {0}, next[] = {2, 3}, four[] = {4};
    ferry_moe_copy_plan plan;
    const char *const pols[] = {"lru", "lfu", "s3fifo", "arc", "auto", "routing"};
    for (size_t i = 0; i < sizeof pols / sizeof pols[0]; i++) {
        ferry_moe_planner *p = ft_moe_mk(1, 8, 2, pols[i], NULL);
        assert_int_equal(ferry_moe_planner_ensure(p, 0, both, 2, NULL, NULL, NULL), 2);
        assert_int_equal(ferry_moe_planner_ensure(p, 0, zero, 1, NULL, NULL, NULL), 0);
        uint32_t s0 = ferry_moe_planner_lookup(p, 0, 0);
        /* the same budget, then a larger one: 0 stays pinned either way */
        assert_int_equal(ferry_moe_planner_resize(p, 2), 0);
        assert_int_equal(ferry_moe_planner_prefetch(p, 0, next, 2, &plan), FERRY_ENOSPACE);
        assert_non_null(strstr(ferry_last_error(), "1 of 2 slots"));
        assert_int_equal(ferry_moe_planner_lookup(p, 0, 0), s0);
        assert_int_equal(ferry_moe_planner_resize(p, 3), 0);
        assert_int_equal(ferry_moe_planner_prefetch(p, 0, next, 2, &plan), 2);
        assert_int_equal(ferry_moe_planner_lookup(p, 0, 0), s0);
        /* the prefetch pinned its own: nothing is left to evict */
        assert_int_equal(ferry_moe_planner_prefetch(p, 0, four, 1, &plan), FERRY_ENOSPACE);
        assert_int_equal(ferry_moe_planner_lookup(p, 0, 0), s0);
        assert_consistent(p, 1, 8);
        /* the next step unpins as ever */
        assert_int_equal(ferry_moe_planner_ensure(p, 0, four, 1, NULL, &plan, NULL), 1);
        assert_consistent(p, 1, 8);
        ferry_moe_planner_destroy(p);
    }
}

/* save refuses, and writes nothing, what would not load back as it is;
 * append refuses what the reader would */
static void save_refuses_what_would_load_differently(void **state)
{
    (void)state;
    char dir[256], path[300];
    ft_tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/t.jsonl", dir);
    ferry_moe_model m = {0};
    m.num_layers = 2;
    m.num_experts = 4;
    ferry_moe_trace *t = NULL, *b = NULL;
    FT_ASSERT_OK(ferry_moe_trace_create(&m, &t));
    /* no steps: the reader refuses a trace of no routes */
    assert_int_equal(ferry_moe_trace_save(t, path), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "no steps"));
    assert_int_equal(access(path, F_OK), -1);
    /* a route wider than the reader takes (repeated ids) */
    static uint32_t wide[16385];
    assert_int_equal(ferry_moe_trace_append(t, 0, 0, wide, 16385), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "16385 experts"));
    assert_int_equal(ferry_moe_trace_steps(t), 0);
    FT_ASSERT_OK(ferry_moe_trace_append(t, 0, 0, wide, 16384));
    /* steps out of (token, layer) order would load back reordered */
    uint32_t e1[] = {1}, e2[] = {2};
    FT_ASSERT_OK(ferry_moe_trace_append(t, 1, 1, e1, 1));
    FT_ASSERT_OK(ferry_moe_trace_append(t, 1, 0, e2, 1));
    assert_int_equal(ferry_moe_trace_save(t, path), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "step 2 (token 1, layer 0)"));
    assert_int_equal(access(path, F_OK), -1);
    ferry_moe_trace_destroy(t);
    /* in order, the same steps load back step for step */
    FT_ASSERT_OK(ferry_moe_trace_create(&m, &t));
    FT_ASSERT_OK(ferry_moe_trace_append(t, 0, 0, wide, 16384));
    FT_ASSERT_OK(ferry_moe_trace_append(t, 1, 0, e2, 1));
    FT_ASSERT_OK(ferry_moe_trace_append(t, 1, 1, e1, 1));
    FT_ASSERT_OK(ferry_moe_trace_save(t, path));
    FT_ASSERT_OK(ferry_moe_trace_load(path, &b));
    assert_int_equal(ferry_moe_trace_steps(b), 3);
    for (size_t i = 0; i < 3; i++) {
        uint32_t ta, la, na, tb, lb, nb;
        const uint32_t *ea, *eb;
        FT_ASSERT_OK(ferry_moe_trace_step(t, i, &ta, &la, &ea, &na));
        FT_ASSERT_OK(ferry_moe_trace_step(b, i, &tb, &lb, &eb, &nb));
        assert_int_equal(ta, tb);
        assert_int_equal(la, lb);
        assert_int_equal(na, nb);
        assert_memory_equal(ea, eb, na * sizeof *ea);
    }
    assert_int_equal(ferry_moe_trace_model(b)->top_k, ferry_moe_trace_model(t)->top_k);
    ferry_moe_trace_destroy(b);
    ferry_moe_trace_destroy(t);
    ft_rmtree(dir);
}

/* whatever a trace holds, what save writes loads back: a shape the
 * reader refuses is refused when the trace is made */
static void every_saved_trace_loads_back(void **state)
{
    (void)state;
    char dir[256], path[300];
    ft_tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/t.jsonl", dir);
    ferry_moe_model m = {0};
    m.num_layers = 2;
    m.num_experts = 3;
    ferry_moe_trace *t = NULL, *b = NULL;
    m.top_k = 4;
    assert_int_equal(ferry_moe_trace_create(&m, &t), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "top_k 4"));
    m.top_k = 1;
    m.expert_bytes = (uint64_t)INT64_MAX + 1;
    assert_int_equal(ferry_moe_trace_create(&m, &t), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "expert_bytes"));
    m.expert_bytes = 100;
    snprintf(m.name, sizeof m.name, "bad\xff");
    assert_int_equal(ferry_moe_trace_create(&m, &t), -EINVAL);
    assert_null(t);
    snprintf(m.name, sizeof m.name, "ok");
    FT_ASSERT_OK(ferry_moe_trace_create(&m, &t));
    /* a token count of 2^32 cannot be held: refused, nothing appended */
    uint32_t dup[] = {1, 1, 1, 1, 1};
    assert_int_equal(ferry_moe_trace_append(t, UINT32_MAX, 0, dup, 1), -EINVAL);
    assert_int_equal(ferry_moe_trace_steps(t), 0);
    /* a route of repeated ids, wider than the experts */
    FT_ASSERT_OK(ferry_moe_trace_append(t, UINT32_MAX - 1, 1, dup, 5));
    FT_ASSERT_OK(ferry_moe_trace_save(t, path));
    FT_ASSERT_OK(ferry_moe_trace_load(path, &b));
    assert_int_equal(ferry_moe_trace_tokens(b), UINT32_MAX);
    assert_int_equal(ferry_moe_trace_model(b)->expert_bytes, 100);
    assert_int_equal(ferry_moe_trace_model(b)->top_k, ferry_moe_trace_model(t)->top_k);
    ferry_moe_trace_destroy(b);
    ferry_moe_trace_destroy(t);
    /* a long name of two-byte characters is cut at a character */
    char buf[512];
    int n = snprintf(buf, sizeof buf, "{\"model\":\"");
    for (int i = 0; i < 40; i++)
        n += snprintf(buf + n, sizeof buf - n, "\xc3\xa9");
    snprintf(buf + n, sizeof buf - n, "\",\"num_layers\":1,\"num_experts\":2}\n"
                                      "{\"token\":0,\"layer\":0,\"experts\":[1]}\n");
    FT_ASSERT_OK(ferry_moe_trace_parse(buf, strlen(buf), &t));
    assert_int_equal(strlen(ferry_moe_trace_model(t)->name), 62);
    FT_ASSERT_OK(ferry_moe_trace_save(t, path));
    FT_ASSERT_OK(ferry_moe_trace_load(path, &b));
    assert_string_equal(ferry_moe_trace_model(b)->name, ferry_moe_trace_model(t)->name);
    ferry_moe_trace_destroy(b);
    ferry_moe_trace_destroy(t);
    assert_int_equal(ferry_moe_trace_model(NULL)->num_layers, 0);
    ft_rmtree(dir);
}

/* ---- replay and Belady ---- */
static ferry_moe_trace *tiny_trace(void)
{
    ferry_moe_model m = {0};
    snprintf(m.name, sizeof m.name, "hand");
    m.num_layers = 2;
    m.num_experts = 2;
    m.expert_bytes = 100;
    ferry_moe_trace *t = NULL;
    FT_ASSERT_OK(ferry_moe_trace_create(&m, &t));
    static const uint32_t seq[][2] = {{0, 0}, {1, 0}, {0, 0}, {1, 1}, {0, 1}, {1, 0}};
    for (uint32_t i = 0; i < 6; i++)
        FT_ASSERT_OK(ferry_moe_trace_append(t, i / 2, seq[i][0], &seq[i][1], 1));
    return t;
}

static void replay_counts_match_a_hand_computed_trace(void **state)
{
    (void)state;
    ferry_moe_trace *t = tiny_trace();
    ferry_moe_replay_result r;
    FT_ASSERT_OK(ferry_moe_replay(t, "lru", 2, 0, &r));
    assert_string_equal(r.policy, "lru");
    assert_int_equal(r.steps, 6);
    assert_int_equal(r.hits, 1);
    assert_int_equal(r.misses, 5);
    assert_int_equal(r.host_bytes, 500);
    FT_ASSERT_OK(ferry_moe_replay(t, "belady", 2, 7, &r));
    assert_int_equal(r.hits, 2);
    assert_int_equal(r.misses, 4);
    assert_int_equal(r.host_bytes, 28);
    assert_true(r.hit_rate > 0.33 && r.hit_rate < 0.34);
    uint32_t bad = 2;
    assert_int_equal(ferry_moe_trace_append(t, 3, 0, &bad, 1), -EINVAL);
    assert_int_equal(ferry_moe_trace_append(t, 3, 2, &bad, 0), -EINVAL);
    ferry_moe_trace_destroy(t);
}

/* one planner of the policy named in ctx->policy made over the tiny trace
 * (its oracle) and driven through it; any allocation may fail */
struct heap_oom {
    const ferry_moe_trace *t;
    const char *policy;
};

static int oom_heap_policy(void *ctx)
{
    const struct heap_oom *c = ctx;
    static const uint32_t seq[][2] = {{0, 0}, {1, 0}, {0, 0}, {1, 1}, {0, 1}, {1, 0}};
    ferry_moe_planner_options o = FERRY_MOE_PLANNER_OPTIONS_INIT;
    o.num_layers = 2;
    o.num_experts = 2;
    o.slots = 2;
    o.policy = c->policy;
    o.oracle = c->t;
    ferry_moe_planner *p = NULL;
    int rc = ferry_moe_planner_create(&o, &p);
    for (uint32_t i = 0; rc >= 0 && i < 6; i++)
        rc = ferry_moe_planner_ensure(p, seq[i][0], &seq[i][1], 1, NULL, NULL, NULL);
    ferry_moe_planner_destroy(p);
    return rc;
}

/* the policies over one slot heap (lru, lfu, lfru, belady) give back all
 * they took when an allocation of theirs fails half-way through init */
static void heap_policies_survive_out_of_memory(void **state)
{
    (void)state;
    ferry_moe_trace *t = tiny_trace();
    static const char *const pols[] = {"lru", "lfu", "lfru", "belady"};
    for (size_t i = 0; i < sizeof pols / sizeof *pols; i++) {
        struct heap_oom c = {t, pols[i]};
        ft_oom_each(100, FT_OOM_STICKY, oom_heap_policy, &c);
        ft_oom_each(100, 0, oom_heap_policy, &c);
    }
    ferry_moe_trace_destroy(t);
}

static void belady_refuses_steps_off_its_trace(void **state)
{
    (void)state;
    ferry_moe_trace *t = tiny_trace();
    ferry_moe_planner *p = ft_moe_mk(2, 2, 2, "belady", t);
    uint32_t e0 = 0, e1 = 1;
    assert_int_equal(ferry_moe_planner_ensure(p, 1, &e0, 1, NULL, NULL, NULL), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "belady"));
    FT_ASSERT_OK(ferry_moe_planner_ensure(p, 0, &e0, 1, NULL, NULL, NULL));
    assert_int_equal(ferry_moe_planner_ensure(p, 1, &e1, 1, NULL, NULL, NULL), -EINVAL);
    FT_ASSERT_OK(ferry_moe_planner_ensure(p, 1, &e0, 1, NULL, NULL, NULL));
    assert_int_equal(ferry_moe_planner_prefetch(p, 1, &e1, 1, NULL), FERRY_ENOTSUP);
    assert_int_equal(ferry_moe_planner_resize(p, 4), FERRY_ENOTSUP);
    ferry_moe_planner_destroy(p);
    ferry_moe_trace_destroy(t);
}

/* on generated traces the offline bound is never beaten, every policy is
 * deterministic, and a larger budget never hurts LRU */
static void belady_bounds_every_policy_on_generated_traces(void **state)
{
    (void)state;
    ferry_moe_gen_options g = FERRY_MOE_GEN_OPTIONS_INIT;
    g.model = "qwen3-30b-a3b";
    g.num_layers = 8;
    g.tokens = 200;
    g.seed = 3;
    ferry_moe_trace *t = NULL;
    FT_ASSERT_OK(ferry_moe_trace_generate(&g, &t));
    uint32_t all = 8 * 128;
    for (uint32_t slots = all / 8; slots <= all / 2; slots *= 2) {
        ferry_moe_replay_result b, r, r2;
        FT_ASSERT_OK(ferry_moe_replay(t, "belady", slots, 0, &b));
        for (const char *const *p = ferry_moe_policies(); *p; p++) {
            FT_ASSERT_OK(ferry_moe_replay(t, *p, slots, 0, &r));
            FT_ASSERT_OK(ferry_moe_replay(t, *p, slots, 0, &r2));
            if (r.hits > b.hits)
                fail_msg("%s beats belady at %u slots: %llu > %llu", *p, slots,
                         (unsigned long long)r.hits, (unsigned long long)b.hits);
            assert_int_equal(r.hits, r2.hits);
            assert_int_equal(r.hits + r.misses, b.hits + b.misses);
        }
    }
    ferry_moe_replay_result small, big;
    FT_ASSERT_OK(ferry_moe_replay(t, "lru", all / 8, 0, &small));
    FT_ASSERT_OK(ferry_moe_replay(t, "lru", all / 2, 0, &big));
    assert_true(big.hits >= small.hits);
    ferry_moe_trace_destroy(t);
}

/* the reader's bounds: a device is refused at once (it would never end), a
 * line over 1 MiB is FERRY_EPARSE naming the file and line (read a line at
 * a time, so the refusal comes without reading the rest), and a pipe is
 * read like a file */
static void trace_reader_refuses_devices_and_overlong_lines(void **state)
{
    (void)state;
    ferry_moe_trace *t = NULL;
    assert_int_equal(ferry_moe_trace_load("/dev/zero", &t), -EINVAL);
    assert_null(t);
    assert_non_null(strstr(ferry_last_error(), "/dev/zero"));
    assert_non_null(strstr(ferry_last_error(), "not a regular file"));

    char dir[256], path[300];
    ft_tmpdir(dir, sizeof dir);
    assert_int_equal(ferry_moe_trace_load(dir, &t), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "a directory"));

    /* line 2 is 1 MiB + 1 byte of spaces inside a valid record */
    snprintf(path, sizeof path, "%s/long.jsonl", dir);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fprintf(f, "{\"token\":0,\"layer\":0,\"experts\":[1]}\n{\"token\":1,");
    for (size_t i = 0; i < FERRY__TRACE_MAX_LINE; i++)
        fputc(' ', f);
    fprintf(f, "\"layer\":0,\"experts\":[2]}\n");
    assert_int_equal(fclose(f), 0);
    assert_int_equal(ferry_moe_trace_load(path, &t), FERRY_EPARSE);
    assert_null(t);
    assert_non_null(strstr(ferry_last_error(), "long.jsonl"));
    assert_non_null(strstr(ferry_last_error(), "line 2"));
    assert_non_null(strstr(ferry_last_error(), "longer than"));

    /* the same from a buffer */
    size_t n = FERRY__TRACE_MAX_LINE + 64;
    char *buf = malloc(n);
    assert_non_null(buf);
    memset(buf, ' ', n);
    memcpy(buf, "{\"token\":0,\"layer\":0,\"experts\":[1]}", 35);
    assert_int_equal(ferry_moe_trace_parse(buf, n, &t), FERRY_EPARSE);
    assert_non_null(strstr(ferry_last_error(), "line 1"));
    /* exactly at the bound is a line like any other */
    assert_int_equal(ferry_moe_trace_parse(buf, FERRY__TRACE_MAX_LINE, &t), 0);
    assert_int_equal(ferry_moe_trace_steps(t), 1);
    ferry_moe_trace_destroy(t);
    t = NULL;
    free(buf);

    /* a pipe: a small trace written by a child */
    snprintf(path, sizeof path, "%s/fifo", dir);
    assert_int_equal(mkfifo(path, 0600), 0);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        FILE *w = fopen(path, "w");
        if (!w)
            _exit(1);
        fprintf(w, "{\"num_layers\":2,\"num_experts\":4,\"top_k\":1}\n");
        for (int i = 0; i < 100; i++)
            fprintf(w, "{\"token\":%d,\"layer\":%d,\"experts\":[%d]}\n", i / 2, i % 2, i % 4);
        _exit(fclose(w) == 0 ? 0 : 1);
    }
    assert_int_equal(ferry_moe_trace_load(path, &t), 0);
    int st = 0;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    assert_int_equal(ferry_moe_trace_steps(t), 100);
    assert_int_equal(ferry_moe_trace_model(t)->num_experts, 4);
    ferry_moe_trace_destroy(t);
    ft_rmtree(dir);
}

/* no policy named: auto (the three-way duel); lru and every other policy
 * stay selectable; top_k reaches the policy, and past num_experts is
 * refused naming it */
static void the_default_policy_is_auto_and_top_k_reaches_it(void **state)
{
    (void)state;
    ferry_moe_planner_options o = FERRY_MOE_PLANNER_OPTIONS_INIT;
    o.num_layers = 4;
    o.num_experts = 16;
    o.slots = 16;
    ferry_moe_planner *p = NULL;
    FT_ASSERT_OK(ferry_moe_planner_create(&o, &p));
    assert_string_equal(ferry_moe_planner_policy(p), "auto");
    assert_int_equal(ferry__planner_policy(p)->env.top_k, 0);
    ferry_moe_planner_destroy(p);
    o.policy = "lru";
    o.top_k = 4;
    FT_ASSERT_OK(ferry_moe_planner_create(&o, &p));
    assert_string_equal(ferry_moe_planner_policy(p), "lru");
    assert_int_equal(ferry__planner_policy(p)->env.top_k, 4);
    ferry_moe_planner_destroy(p);
    o.policy = NULL;
    o.top_k = 17;
    p = NULL;
    assert_int_equal(ferry_moe_planner_create(&o, &p), -EINVAL);
    assert_null(p);
    assert_non_null(strstr(ferry_last_error(), "top_k 17"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(ensure_collapses_duplicates_and_counts),
        cmocka_unit_test(a_resident_route_is_a_warm_step_with_an_empty_plan),
        cmocka_unit_test(lru_evicts_least_recent_with_lowest_slot_ties),
        cmocka_unit_test(every_policy_keeps_the_current_step_resident),
        cmocka_unit_test(every_policy_fits_a_step_in_as_few_slots_as_it_routes),
        cmocka_unit_test(a_step_that_fails_part_way_places_nothing),
        cmocka_unit_test(bad_routes_fail_and_change_nothing),
        cmocka_unit_test(a_null_planner_is_answered_not_dereferenced),
        cmocka_unit_test(planner_options_are_range_checked),
        cmocka_unit_test(older_planner_options_prefix_is_accepted),
        cmocka_unit_test(the_default_policy_is_auto_and_top_k_reaches_it),
        cmocka_unit_test(forget_frees_the_slot_and_the_expert_misses_again),
        cmocka_unit_test(resize_grows_and_drops_occupants_past_the_end),
        cmocka_unit_test(a_miss_takes_the_lowest_free_slot),
        cmocka_unit_test(prefetch_brings_experts_in_without_evicting_the_step),
        cmocka_unit_test(ferry_traces_load_in_token_layer_order),
        cmocka_unit_test(vllm_captures_read_module_paths_and_token_lists),
        cmocka_unit_test(malformed_traces_name_the_line_and_field),
        cmocka_unit_test(traces_survive_out_of_memory_at_every_allocation),
        cmocka_unit_test(saved_traces_load_back_identical),
        cmocka_unit_test(every_saved_trace_loads_back),
        cmocka_unit_test(a_refused_prefetch_leaves_the_pins_as_they_were),
        cmocka_unit_test(a_resize_keeps_the_steps_pins),
        cmocka_unit_test(save_refuses_what_would_load_differently),
        cmocka_unit_test(replay_counts_match_a_hand_computed_trace),
        cmocka_unit_test(belady_refuses_steps_off_its_trace),
        cmocka_unit_test(heap_policies_survive_out_of_memory),
        cmocka_unit_test(belady_bounds_every_policy_on_generated_traces),
        cmocka_unit_test(trace_reader_refuses_devices_and_overlong_lines),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
