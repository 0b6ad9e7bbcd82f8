/*
 * test_moe_sim.c - the decode timeline: a hand-computed timeline, its
 * bounds, hints that hide the link when compute covers it and never cost
 * more than their rule allows, determinism and option checks.
 */
#include <errno.h>
#include <stddef.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry_test.h"
#include "moe/moe_internal.h"

static ferry_moe_trace *one_layer(const uint32_t *experts, uint32_t n)
{
    ferry_moe_model m = {.num_layers = 1, .num_experts = 4, .expert_bytes = 5000};
    ferry_moe_trace *t = NULL;
    FT_ASSERT_OK(ferry_moe_trace_create(&m, &t));
    for (uint32_t i = 0; i < n; i++)
        FT_ASSERT_OK(ferry_moe_trace_append(t, i, 0, &experts[i], 1));
    return t;
}

static void a_hand_computed_timeline(void **state)
{
    (void)state;
    /* rows of 5000 bytes at 1 GB/s: 5 us each; 10 us compute per step.
     * e0 miss: lands at 5 (stall 5), computed by 15; e1 miss: lands at 20
     * (stall 5), computed by 30; e0 hit: computed by 40 */
    uint32_t ex[] = {0, 1, 0};
    ferry_moe_trace *t = one_layer(ex, 3);
    ferry_moe_sim_options o = FERRY_MOE_SIM_OPTIONS_INIT;
    o.slots = 4;
    o.compute_us = 10;
    o.link_gbs = 1;
    ferry_moe_sim_result r = FERRY_MOE_SIM_RESULT_INIT;
    FT_ASSERT_OK(ferry_moe_sim(t, &o, &r));
    assert_true(fabs(r.total_us - 40) < 1e-9);
    assert_true(fabs(r.stall_us - 10) < 1e-9);
    assert_true(fabs(r.compute_us - 30) < 1e-9);
    assert_true(fabs(r.no_wait_share - 1.0 / 3) < 1e-12);
    assert_int_equal(r.hits, 1);
    assert_int_equal(r.misses, 2);
    assert_int_equal(r.bytes_moved, 10000);
    assert_true(fabs(r.tokens_per_s - 3 / 40e-6) < 1e-3);
    /* perfect hints one step ahead: e1 is copied while e0 computes */
    o.hint_steps = 1;
    o.hint_accuracy = 1;
    FT_ASSERT_OK(ferry_moe_sim(t, &o, &r));
    assert_true(fabs(r.stall_us - 5) < 1e-9);
    assert_true(fabs(r.total_us - 35) < 1e-9);
    assert_int_equal(r.bytes_moved, 10000);
    /* every expert on NVMe at 0.5 GB/s: 10 us a row; stall 10 + 10 */
    o.hint_steps = 0;
    o.nvme_share = 1;
    o.nvme_gbs = 0.5;
    FT_ASSERT_OK(ferry_moe_sim(t, &o, &r));
    assert_true(fabs(r.stall_us - 20) < 1e-9);
    assert_true(fabs(r.total_us - 50) < 1e-9);
    o.nvme_gbs = 0;
    assert_int_equal(ferry_moe_sim(t, &o, &r), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "nvme_gbs"));
    o.nvme_share = 2;
    assert_int_equal(ferry_moe_sim(t, &o, &r), -EINVAL);
    o.nvme_share = 0;
    o.hint_steps = 1;
    /* the bounds: nothing waits; Belady's 2 misses on an ideal link: the
     * first waits 5, the second lands at 10, before its step at 15 */
    ferry_moe_sim_result a = FERRY_MOE_SIM_RESULT_INIT, b = FERRY_MOE_SIM_RESULT_INIT;
    FT_ASSERT_OK(ferry_moe_sim_bounds(t, &o, &a, &b));
    assert_true(a.stall_us == 0 && fabs(a.total_us - 30) < 1e-9);
    assert_true(fabs(b.stall_us - 5) < 1e-9);
    assert_int_equal(b.misses, 2);
    ferry_moe_trace_destroy(t);
}

static ferry_moe_trace *generated(const char *model, uint32_t tokens)
{
    ferry_moe_gen_options g = FERRY_MOE_GEN_OPTIONS_INIT;
    g.model = model;
    g.tokens = tokens;
    ferry_moe_trace *t = NULL;
    FT_ASSERT_OK(ferry_moe_trace_generate(&g, &t));
    return t;
}

static void hints_hide_the_link_when_compute_covers_it(void **state)
{
    (void)state;
    /* qwen3-30b-a3b experts (9.4 MB) on a 50 GB/s link: 189 us a row,
     * 300 us of compute per layer-step */
    ferry_moe_trace *t = generated("qwen3-30b-a3b", 96);
    const ferry_moe_model *m = ferry_moe_trace_model(t);
    ferry_moe_sim_options o = FERRY_MOE_SIM_OPTIONS_INIT;
    o.slots = m->num_layers * m->num_experts / 4;
    o.compute_us = 300;
    o.link_gbs = 50;
    ferry_moe_sim_result none = FERRY_MOE_SIM_RESULT_INIT, h90 = FERRY_MOE_SIM_RESULT_INIT,
                         h100 = FERRY_MOE_SIM_RESULT_INIT, res = FERRY_MOE_SIM_RESULT_INIT,
                         bel = FERRY_MOE_SIM_RESULT_INIT;
    o.policy = "lru";
    FT_ASSERT_OK(ferry_moe_sim(t, &o, &none));
    o.hint_steps = 1;
    o.hint_accuracy = 0.9;
    FT_ASSERT_OK(ferry_moe_sim(t, &o, &h90));
    o.hint_accuracy = 1;
    FT_ASSERT_OK(ferry_moe_sim(t, &o, &h100));
    FT_ASSERT_OK(ferry_moe_sim_bounds(t, &o, &res, &bel));
    assert_true(none.stall_us > 0);
    assert_true(h90.stall_us < none.stall_us);
    assert_true(h100.stall_us <= h90.stall_us);
    assert_true(bel.stall_us <= h100.stall_us);
    assert_true(res.stall_us == 0 && res.total_us <= bel.total_us);
    assert_true(h90.prefetch_bytes > 0);
    assert_int_equal(none.prefetch_bytes, 0);
    /* the same seed, the same timeline */
    ferry_moe_sim_result again = FERRY_MOE_SIM_RESULT_INIT;
    o.hint_accuracy = 0.9;
    FT_ASSERT_OK(ferry_moe_sim(t, &o, &again));
    assert_true(again.stall_us == h90.stall_us && again.bytes_moved == h90.bytes_moved);
    ferry_moe_trace_destroy(t);
}

static void half_right_hints_cost_nothing_at_any_horizon(void **state)
{
    (void)state;
    /* the link about as fast as compute (qwen3 rows at 50 GB/s, 300 us a
     * layer-step), a quarter of the experts resident: hints that are right
     * half the time, one layer, two layers or a token ahead, leave the
     * stall within 1% of LRU's without hints; 90% one layer ahead removes
     * at least a third of it (the README's run, 256 tokens: half) */
    ferry_moe_trace *t = generated("qwen3-30b-a3b", 64);
    const ferry_moe_model *m = ferry_moe_trace_model(t);
    ferry_moe_sim_options o = FERRY_MOE_SIM_OPTIONS_INIT;
    o.slots = m->num_layers * m->num_experts / 4;
    o.compute_us = 300;
    o.link_gbs = 50;
    o.policy = "lru";
    ferry_moe_sim_result none = FERRY_MOE_SIM_RESULT_INIT, r = FERRY_MOE_SIM_RESULT_INIT;
    FT_ASSERT_OK(ferry_moe_sim(t, &o, &none));
    const uint32_t ahead[3] = {1, 2, m->num_layers};
    for (int i = 0; i < 3; i++) {
        o.hint_steps = ahead[i];
        o.hint_accuracy = 0.5;
        FT_ASSERT_OK(ferry_moe_sim(t, &o, &r));
        if (r.stall_us > none.stall_us * 1.01)
            fail_msg("%u steps ahead, 50%% right: stall %.0f us, without hints %.0f", ahead[i],
                     r.stall_us, none.stall_us);
    }
    o.hint_steps = 1;
    o.hint_accuracy = 0.9;
    FT_ASSERT_OK(ferry_moe_sim(t, &o, &r));
    if (r.stall_us > none.stall_us * 2 / 3)
        fail_msg("1 step ahead, 90%% right: stall %.0f us, without hints %.0f", r.stall_us,
                 none.stall_us);
    ferry_moe_trace_destroy(t);
}

static void a_slow_link_takes_no_hint_that_costs_more_than_it_saves(void **state)
{
    (void)state;
    /* deepseek-v3 experts (44 MB) at 25 GB/s: 1.76 ms a row against 100 us
     * of compute; a 10%-wrong row costs 176 us of link, more than the lead:
     * no hint is sent and the timeline is LRU's */
    ferry_moe_trace *t = generated("deepseek-v3", 24);
    const ferry_moe_model *m = ferry_moe_trace_model(t);
    ferry_moe_sim_options o = FERRY_MOE_SIM_OPTIONS_INIT;
    o.slots = m->num_layers * m->num_experts / 8;
    ferry_moe_sim_result a = FERRY_MOE_SIM_RESULT_INIT, b = FERRY_MOE_SIM_RESULT_INIT;
    FT_ASSERT_OK(ferry_moe_sim(t, &o, &a));
    o.hint_steps = 1;
    o.hint_accuracy = 0.9;
    FT_ASSERT_OK(ferry_moe_sim(t, &o, &b));
    assert_int_equal(b.prefetch_bytes, 0);
    assert_true(a.stall_us == b.stall_us);
    /* every policy runs, with and without hints (belady without) */
    for (const char *const *p = ferry_moe_policies(); *p; p++) {
        o.policy = *p;
        o.hint_steps = strcmp(*p, "belady") ? 2 : 0;
        o.hint_accuracy = 1;
        o.compute_us = 5000;
        FT_ASSERT_OK(ferry_moe_sim(t, &o, &a));
        assert_int_equal(a.steps, ferry_moe_trace_steps(t));
    }
    ferry_moe_trace_destroy(t);
}

static void options_are_range_checked(void **state)
{
    (void)state;
    uint32_t ex[] = {0, 1};
    ferry_moe_trace *t = one_layer(ex, 2);
    ferry_moe_sim_result r = FERRY_MOE_SIM_RESULT_INIT;
    ferry_moe_sim_options o = FERRY_MOE_SIM_OPTIONS_INIT;
    o.slots = 2;
    o.size = 8;
    assert_int_equal(ferry_moe_sim(t, &o, &r), -EINVAL);
    o = (ferry_moe_sim_options)FERRY_MOE_SIM_OPTIONS_INIT;
    o.slots = 2;
    o.compute_us = 0;
    assert_int_equal(ferry_moe_sim(t, &o, &r), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "compute_us"));
    o.compute_us = NAN;
    assert_int_equal(ferry_moe_sim(t, &o, &r), -EINVAL);
    o.compute_us = 10;
    o.link_gbs = -1;
    assert_int_equal(ferry_moe_sim(t, &o, &r), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "link_gbs"));
    o.link_gbs = 10;
    o.hint_accuracy = 1.5;
    assert_int_equal(ferry_moe_sim(t, &o, &r), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "hint_accuracy"));
    o.hint_accuracy = 0.5;
    o.hint_steps = 1;
    o.policy = "belady";
    assert_int_equal(ferry_moe_sim(t, &o, &r), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "belady"));
    o.policy = "lru";
    o.slots = 0;
    assert_int_equal(ferry_moe_sim(t, &o, &r), -EINVAL);
    ferry_moe_trace_destroy(t);
    ferry_moe_model m = {.num_layers = 1, .num_experts = 4};
    FT_ASSERT_OK(ferry_moe_trace_create(&m, &t));
    FT_ASSERT_OK(ferry_moe_trace_append(t, 0, 0, ex, 1));
    o = (ferry_moe_sim_options)FERRY_MOE_SIM_OPTIONS_INIT;
    o.slots = 2;
    assert_int_equal(ferry_moe_sim(t, &o, &r), -EINVAL); /* no expert_bytes anywhere */
    assert_non_null(strstr(ferry_last_error(), "expert_bytes"));
    o.expert_bytes = 1000;
    FT_ASSERT_OK(ferry_moe_sim(t, &o, &r));
    ferry_moe_trace_destroy(t);
}

static void wide_steps_stream_in_the_timeline(void **state)
{
    (void)state;
    /* a prefill of all 4 experts through 2 slots: 2 waves of 2 rows */
    uint32_t all[] = {0, 1, 2, 3};
    ferry_moe_model m = {.num_layers = 1, .num_experts = 4, .expert_bytes = 5000};
    ferry_moe_trace *t = NULL;
    FT_ASSERT_OK(ferry_moe_trace_create(&m, &t));
    FT_ASSERT_OK(ferry_moe_trace_append(t, 0, 0, all, 4));
    ferry_moe_sim_options o = FERRY_MOE_SIM_OPTIONS_INIT;
    o.slots = 2;
    o.compute_us = 10;
    o.link_gbs = 1;
    ferry_moe_sim_result r = FERRY_MOE_SIM_RESULT_INIT;
    FT_ASSERT_OK(ferry_moe_sim(t, &o, &r));
    /* wave 1 lands at 10, computes 5; wave 2 asked at 15, lands at 25 */
    assert_true(fabs(r.total_us - 30) < 1e-9);
    assert_true(fabs(r.stall_us - 20) < 1e-9);
    assert_int_equal(r.bytes_moved, 20000);
    ferry_moe_trace_destroy(t);
}

static void the_traces_own_predictions_are_hints(void **state)
{
    (void)state;
    /* each record predicts its own routes exactly: hints from the trace are
     * the same timeline as hints made at accuracy 1 */
    ferry_moe_trace *g = generated("qwen3-30b-a3b", 24);
    const ferry_moe_model *m = ferry_moe_trace_model(g);
    ferry_moe_trace *t = NULL;
    FT_ASSERT_OK(ferry_moe_trace_create(m, &t));
    for (size_t i = 0; i < ferry_moe_trace_steps(g); i++) {
        uint32_t tok, layer, n;
        const uint32_t *ex;
        FT_ASSERT_OK(ferry_moe_trace_step(g, i, &tok, &layer, &ex, &n));
        FT_ASSERT_OK(ferry_moe_trace_append(t, tok, layer, ex, n));
        FT_ASSERT_OK(ferry__trace_set_pred(t, ex, n));
    }
    ferry_moe_sim_options o = FERRY_MOE_SIM_OPTIONS_INIT;
    o.slots = m->num_layers * m->num_experts / 4;
    o.compute_us = 300;
    o.link_gbs = 50;
    o.hint_steps = 1;
    o.hint_accuracy = 1;
    ferry_moe_sim_result made = FERRY_MOE_SIM_RESULT_INIT, rec = FERRY_MOE_SIM_RESULT_INIT;
    FT_ASSERT_OK(ferry_moe_sim(t, &o, &made));
    o.hint_trace = 1;
    FT_ASSERT_OK(ferry_moe_sim(t, &o, &rec));
    assert_true(made.stall_us == rec.stall_us);
    assert_int_equal(made.bytes_moved, rec.bytes_moved);
    assert_true(rec.prefetch_bytes > 0);
    ferry_moe_trace_destroy(t);
    ferry_moe_trace_destroy(g);
}

/* an older header's result: written only as far as its size says, the
 * bytes past it (a canary) untouched; an unset size is refused before
 * anything is written */
static void the_result_is_written_only_as_far_as_its_size(void **state)
{
    (void)state;
    uint32_t ex[] = {0, 1, 0};
    ferry_moe_trace *t = one_layer(ex, 3);
    ferry_moe_sim_options o = FERRY_MOE_SIM_OPTIONS_INIT;
    o.slots = 4;
    o.compute_us = 10;
    o.link_gbs = 1;
    struct {
        ferry_moe_sim_result r;
        unsigned char canary[64];
    } buf;
    size_t older = offsetof(ferry_moe_sim_result, hits); /* a header without hits and after */
    for (int bounds = 0; bounds < 2; bounds++) {
        memset(&buf, 0xa5, sizeof buf);
        buf.r.size = older;
        if (bounds) {
            ferry_moe_sim_result bel = FERRY_MOE_SIM_RESULT_INIT;
            FT_ASSERT_OK(ferry_moe_sim_bounds(t, &o, &buf.r, &bel));
            assert_true(fabs(buf.r.total_us - 30) < 1e-9);
        } else {
            FT_ASSERT_OK(ferry_moe_sim(t, &o, &buf.r));
            assert_true(fabs(buf.r.total_us - 40) < 1e-9);
        }
        assert_int_equal(buf.r.size, older); /* left as the caller set it */
        const unsigned char *past = (const unsigned char *)&buf.r + older;
        for (size_t i = 0; i < sizeof buf - older; i++)
            if (past[i] != 0xa5)
                fail_msg("%s: byte %zu past the caller's %zu-byte result was written",
                         bounds ? "bounds" : "sim", i, older);
    }
    /* size not set: -EINVAL naming it, nothing written */
    memset(&buf, 0xa5, sizeof buf);
    buf.r.size = 0;
    assert_int_equal(ferry_moe_sim(t, &o, &buf.r), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "size"));
    ferry_moe_sim_result bel = FERRY_MOE_SIM_RESULT_INIT;
    assert_int_equal(ferry_moe_sim_bounds(t, &o, &bel, &buf.r), -EINVAL);
    const unsigned char *all = (const unsigned char *)&buf.r + sizeof buf.r.size;
    for (size_t i = 0; i < sizeof buf - sizeof buf.r.size; i++)
        assert_int_equal(all[i], 0xa5);
    ferry_moe_trace_destroy(t);
}

/* the options' size is the caller's: a size other than this header's
 * (none older exists) is refused with a message naming the struct and
 * the size, before anything else is read or written; options allocated
 * at exactly their size are read no further (ASan builds watch it) */
static void the_options_size_is_the_callers(void **state)
{
    (void)state;
    uint32_t ex[] = {0, 1, 0};
    ferry_moe_trace *t = one_layer(ex, 3);
    const size_t full = sizeof(ferry_moe_sim_options);
    const size_t bad[] = {0, sizeof(size_t), offsetof(ferry_moe_sim_options, nvme_share),
                          full - 1, full + 8};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        ferry_moe_sim_options o = FERRY_MOE_SIM_OPTIONS_INIT;
        o.slots = 2;
        o.size = bad[i];
        ferry_moe_sim_result r = FERRY_MOE_SIM_RESULT_INIT, r0, b0, b1;
        r.steps = 77; /* a canary: nothing is written on a refusal */
        r0 = r;
        b0 = b1 = r;
        assert_int_equal(ferry_moe_sim(t, &o, &r), -EINVAL);
        assert_memory_equal(&r, &r0, sizeof r);
        assert_non_null(strstr(ferry_last_error(), "ferry_moe_sim_options"));
        char want[32];
        snprintf(want, sizeof want, "size %zu", bad[i]);
        assert_non_null(strstr(ferry_last_error(), want));
        assert_int_equal(ferry_moe_sim_bounds(t, &o, &b0, &b1), -EINVAL);
        assert_memory_equal(&b0, &r0, sizeof b0);
        assert_memory_equal(&b1, &r0, sizeof b1);
    }
    ferry_moe_sim_options *o = malloc(full); /* exactly the size it says */
    assert_non_null(o);
    *o = (ferry_moe_sim_options)FERRY_MOE_SIM_OPTIONS_INIT;
    o->slots = 2;
    ferry_moe_sim_result r = FERRY_MOE_SIM_RESULT_INIT, b0 = FERRY_MOE_SIM_RESULT_INIT,
                         b1 = FERRY_MOE_SIM_RESULT_INIT;
    FT_ASSERT_OK(ferry_moe_sim(t, o, &r));
    assert_int_equal(r.steps, 3);
    FT_ASSERT_OK(ferry_moe_sim_bounds(t, o, &b0, &b1));
    free(o);
    ferry_moe_trace_destroy(t);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(a_hand_computed_timeline),
        cmocka_unit_test(hints_hide_the_link_when_compute_covers_it),
        cmocka_unit_test(half_right_hints_cost_nothing_at_any_horizon),
        cmocka_unit_test(a_slow_link_takes_no_hint_that_costs_more_than_it_saves),
        cmocka_unit_test(options_are_range_checked),
        cmocka_unit_test(wide_steps_stream_in_the_timeline),
        cmocka_unit_test(the_traces_own_predictions_are_hints),
        cmocka_unit_test(the_result_is_written_only_as_far_as_its_size),
        cmocka_unit_test(the_options_size_is_the_callers),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
