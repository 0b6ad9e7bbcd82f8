/*
 * test_moe_arc.c - "arc" past 2^32 ghosts. Its ghost lists are FIFO rings
 * whose entries leave lazily: an entry is its id's live ghost while the
 * id's sequence number is the entry's. While every victim comes from one
 * list, the other list's ring sits untouched, stale entries and all, and
 * the sequence runs on; once it comes round (32 bits: 2^32 evictions,
 * 12 days at 4,000 a second) a stale entry's number is the live ghost's
 * again, and popping it drops that ghost early.
 */
#include <errno.h>
#include <stdio.h>

#include "ferry_test.h"
#include "moe/moe_internal.h"

/* which experts are resident after each step of seq (one layer, one
 * expert a step), hashed; the sequence jumps `jump` before step `at` */
static uint64_t residency(const uint32_t *seq, size_t n, uint32_t E, uint32_t S, size_t at,
                          uint64_t jump)
{
    ferry_moe_planner_options o = FERRY_MOE_PLANNER_OPTIONS_INIT;
    o.num_layers = 1;
    o.num_experts = E;
    o.top_k = 1;
    o.slots = S;
    o.policy = "arc";
    ferry_moe_planner *p = NULL;
    FT_ASSERT_OK(ferry_moe_planner_create(&o, &p));
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) {
        if (i == at)
            FT_ASSERT_OK(ferry__arc_skip((ferry__policy *)ferry__planner_policy(p), jump));
        FT_ASSERT_OK(ferry_moe_planner_ensure(p, 0, &seq[i], 1, NULL, NULL, NULL));
        for (uint32_t e = 0; e < E; e++)
            h = (h ^ (ferry_moe_planner_lookup(p, 0, e) != FERRY_MOE_NONE)) * 1099511628211ull;
    }
    ferry_moe_planner_destroy(p);
    return h;
}

/* short random runs of 4-9 experts in 2-4 slots (ghosts come and go
 * within a few steps); the sequence jumped 1-11 short of a multiple of
 * 2^32 at steps 5-35: every run keeps the same experts resident as
 * without the jump (with a 32-bit sequence the second run already did not) */
static void arc_decides_alike_past_2_to_the_32_ghosts(void **state)
{
    (void)state;
    uint64_t rng = 1;
    unsigned runs = 0;
    for (int trial = 0; trial < 200; trial++) {
        uint32_t E = 4 + trial % 6, S = 2 + trial % 3, seq[60];
        for (int i = 0; i < 60; i++) {
            rng = rng * 6364136223846793005ull + 1442695040888963407ull;
            seq[i] = (uint32_t)(rng >> 33) % E;
        }
        uint64_t want = residency(seq, 60, E, S, 0, 0);
        for (size_t at = 5; at < 40; at += 5)
            for (uint64_t back = 1; back < 12; back++)
                for (uint64_t wraps = 1; wraps <= 2; wraps++, runs++)
                    if (residency(seq, 60, E, S, at, (wraps << 32) - back) != want)
                        fail_msg("run %d (%u experts, %u slots): jumped %llu x 2^32 - %llu "
                                 "before step %zu, other experts resident",
                                 trial, E, S, (unsigned long long)wraps,
                                 (unsigned long long)back, at);
    }
    print_message("%u runs alike\n", runs);
    ferry_moe_planner *p = NULL;
    ferry_moe_planner_options o = FERRY_MOE_PLANNER_OPTIONS_INIT;
    o.num_layers = 1;
    o.num_experts = 4;
    o.slots = 2;
    o.policy = "lru";
    FT_ASSERT_OK(ferry_moe_planner_create(&o, &p));
    assert_int_equal(ferry__arc_skip(NULL, 1), -EINVAL);
    assert_int_equal(ferry__arc_skip((ferry__policy *)ferry__planner_policy(p), 1), -EINVAL);
    ferry_moe_planner_destroy(p);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(arc_decides_alike_past_2_to_the_32_ghosts),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
