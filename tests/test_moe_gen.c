/*
 * test_moe_gen.c - the synthetic routing-trace generator measured against
 * the published routing statistics it is calibrated to (facts.md section
 * 6), within tolerances: popularity skew, reuse distance, cross-layer
 * correlation, U-shaped miss rates over depth; and determinism by seed.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry_test.h"
#include "moe_traces.h"
#include "moe/moe_internal.h"

/* ferry-test-timeout: 120 */

static void in_range(const char *what, double v, double lo, double hi)
{
    if (v < lo || v > hi)
        fail_msg("%s = %.4f, outside [%.3f, %.3f]", what, v, lo, hi);
}

/* Qwen3 / DeepSeek-style 256-expert top-8 routing: the top 32 experts of
 * a layer cover 58-76% of its routes; 45% of selections repeat at the next
 * token, 80% within 8, median reuse distance about 2 tokens */
static void deepseek_preset_matches_published_statistics(void **state)
{
    (void)state;
    for (uint64_t seed = 1; seed <= 2; seed++) {
        ferry_moe_trace *t = ft_moe_gen("deepseek-v3", 1024, seed);
        const ferry_moe_model *m = ferry_moe_trace_model(t);
        assert_int_equal(m->num_experts, 256);
        assert_int_equal(m->top_k, 8);
        ferry__trace_stats st;
        FT_ASSERT_OK(ferry__trace_stats_compute(t, &st));
        in_range("top-32 cover", st.top32_cover, 0.58, 0.76);
        in_range("repeat at next token", st.repeat_next, 0.40, 0.50);
        in_range("within 8 tokens", st.within8, 0.75, 0.88);
        in_range("median reuse distance", st.median_reuse, 1.5, 2.5);
        /* an expert's learned partner at the next layer is routed with it
         * far more often than chance (an uncorrelated trace measures ~1) */
        in_range("cross-layer lift", st.cross_lift, 1.4, 100);
        ferry__free(st.layer_repeat);
        ferry_moe_trace_destroy(t);
    }
}

/* Mixtral 8 experts top-2: the top expert of a layer takes 14-19% of the
 * routes (uniform would be 12.5%) */
static void mixtral_preset_matches_its_top_expert_share(void **state)
{
    (void)state;
    ferry_moe_trace *t = ft_moe_gen("mixtral-8x7b", 1024, 4);
    ferry__trace_stats st;
    FT_ASSERT_OK(ferry__trace_stats_compute(t, &st));
    in_range("top expert share", st.top1_share, 0.14, 0.19);
    in_range("repeat at next token", st.repeat_next, 0.35, 0.50);
    ferry__free(st.layer_repeat);
    ferry_moe_trace_destroy(t);
}

/* control: a uniform random trace of the same shape is far from every
 * target, so the tolerances above do discriminate */
static void a_uniform_trace_fails_the_same_checks(void **state)
{
    (void)state;
    ferry_moe_model m = {0};
    m.num_layers = 8;
    m.num_experts = 256;
    m.top_k = 8;
    ferry_moe_trace *t;
    FT_ASSERT_OK(ferry_moe_trace_create(&m, &t));
    ferry__rng r;
    ferry__rng_seed(&r, 1);
    for (uint32_t tok = 0; tok < 512; tok++)
        for (uint32_t l = 0; l < 8; l++) {
            uint32_t ex[8];
            for (int k = 0; k < 8; k++)
                ex[k] = ferry__rng_below(&r, 256);
            FT_ASSERT_OK(ferry_moe_trace_append(t, tok, l, ex, 8));
        }
    ferry__trace_stats st;
    FT_ASSERT_OK(ferry__trace_stats_compute(t, &st));
    assert_true(st.top32_cover < 0.3);
    assert_true(st.repeat_next < 0.1);
    assert_true(st.cross_lift < 1.3);
    ferry__free(st.layer_repeat);
    ferry_moe_trace_destroy(t);
}

/* miss rates are U-shaped over depth: the first and last layers miss more
 * than the middle ones, under the same per-layer LRU budget */
static void miss_rates_are_u_shaped_over_depth(void **state)
{
    (void)state;
    ferry_moe_trace *t = ft_moe_gen("qwen3-30b-a3b", 512, 7);
    const ferry_moe_model *m = ferry_moe_trace_model(t);
    uint32_t L = m->num_layers;
    ferry_moe_planner_options o = FERRY_MOE_PLANNER_OPTIONS_INIT;
    o.num_layers = L;
    o.num_experts = m->num_experts;
    o.slots = L * m->num_experts / 4;
    o.policy = "lru-layer";
    ferry_moe_planner *p;
    FT_ASSERT_OK(ferry_moe_planner_create(&o, &p));
    double *miss = calloc(L, sizeof *miss), *act = calloc(L, sizeof *act);
    for (size_t i = 0; i < ferry_moe_trace_steps(t); i++) {
        uint32_t tok, layer, n;
        const uint32_t *ex;
        FT_ASSERT_OK(ferry_moe_trace_step(t, i, &tok, &layer, &ex, &n));
        ferry_moe_counts c;
        assert_true(ferry_moe_planner_ensure(p, layer, ex, n, NULL, NULL, &c) >= 0);
        if (tok >= 64) { /* past the cold start */
            miss[layer] += c.missing;
            act[layer] += c.active;
        }
    }
    double edge = 0, mid = 0;
    int ne = 0, nm = 0;
    for (uint32_t l = 0; l < L; l++) {
        double rate = miss[l] / act[l];
        if (l < L / 8 || l >= L - L / 8) {
            edge += rate;
            ne++;
        } else if (l >= 3 * L / 8 && l < 5 * L / 8) {
            mid += rate;
            nm++;
        }
    }
    edge /= ne;
    mid /= nm;
    if (!(edge > 1.3 * mid))
        fail_msg("edge layers miss %.3f, middle %.3f: not U-shaped", edge, mid);
    ferry__trace_stats st;
    FT_ASSERT_OK(ferry__trace_stats_compute(t, &st));
    assert_true(st.layer_repeat[0] < st.layer_repeat[L / 2]);
    assert_true(st.layer_repeat[L - 1] < st.layer_repeat[L / 2]);
    ferry__free(st.layer_repeat);
    free(miss);
    free(act);
    ferry_moe_planner_destroy(p);
    ferry_moe_trace_destroy(t);
}

static int same(const ferry_moe_trace *a, const ferry_moe_trace *b)
{
    if (ferry_moe_trace_steps(a) != ferry_moe_trace_steps(b))
        return 0;
    for (size_t i = 0; i < ferry_moe_trace_steps(a); i++) {
        uint32_t na, nb, la, lb;
        const uint32_t *ea, *eb;
        ferry_moe_trace_step(a, i, NULL, &la, &ea, &na);
        ferry_moe_trace_step(b, i, NULL, &lb, &eb, &nb);
        if (la != lb || na != nb || memcmp(ea, eb, na * sizeof *ea))
            return 0;
    }
    return 1;
}

/* each case spoils one option: -EINVAL naming it, nothing generated */
static void gen_options_are_range_checked(void **state)
{
    (void)state;
    struct {
        const char *model;
        uint32_t tokens, layers, experts, top_k;
        const char *field;
    } bad[] = {
        {NULL, 1, 1025, 0, 0, "num_layers 1025"},
        {NULL, 1, UINT32_MAX, 0, 0, "num_layers"},
        {NULL, 1, 0, 16385, 0, "num_experts 16385"},
        {NULL, 1, 0, UINT32_MAX, 0, "num_experts"},
        {NULL, 1, 0, 8, 9, "top_k 9"},
        {NULL, 1, 0, 8, UINT32_MAX, "top_k"},
        {NULL, 1, 0, 4, 0, "top_k 8 (the preset's)"}, /* deepseek routes 8 */
        {"gpt-5", 1, 0, 0, 0, "model 'gpt-5'"},
        {"", 1, 0, 0, 0, "model ''"},
        {NULL, UINT32_MAX, 0, 0, 0, "tokens 4294967295"},
        /* 58 layers: one token more than 2^26 steps hold */
        {NULL, ((1u << 26) / 58) + 1, 0, 0, 0, "tokens"},
        /* 2^26 steps fit, but x top_k 16 is past 2^29 ids */
        {"small", 1u << 24, 4, 16, 16, "tokens 16777216"},
        /* the largest shape at the largest top_k: the product, not a wrap */
        {NULL, UINT32_MAX, 1024, 16384, 16384, "tokens"},
    };
    for (size_t i = 0; i < FERRY__ARRAY_LEN(bad); i++) {
        ferry_moe_gen_options o = FERRY_MOE_GEN_OPTIONS_INIT;
        o.model = bad[i].model;
        o.tokens = bad[i].tokens;
        o.num_layers = bad[i].layers;
        o.num_experts = bad[i].experts;
        o.top_k = bad[i].top_k;
        ferry_moe_trace *t = (ferry_moe_trace *)0x1;
        assert_int_equal(ferry_moe_trace_generate(&o, &t), -EINVAL);
        assert_ptr_equal(t, (ferry_moe_trace *)0x1);
        if (!strstr(ferry_last_error(), bad[i].field) || !strstr(ferry_last_error(), "accepted"))
            fail_msg("case %zu: message '%s' does not name '%s' and its range", i,
                     ferry_last_error(), bad[i].field);
    }
    ferry_moe_gen_options o = FERRY_MOE_GEN_OPTIONS_INIT;
    o.size = sizeof o - 1;
    ferry_moe_trace *t = NULL;
    assert_int_equal(ferry_moe_trace_generate(&o, &t), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "options size"));

    /* the smallest shape of every range, and the seed takes any value */
    o = (ferry_moe_gen_options)FERRY_MOE_GEN_OPTIONS_INIT;
    o.tokens = 1;
    o.num_layers = 1;
    o.num_experts = 1;
    o.top_k = 1;
    o.seed = UINT64_MAX;
    FT_ASSERT_OK(ferry_moe_trace_generate(&o, &t));
    assert_int_equal(ferry_moe_trace_steps(t), 1);
    ferry_moe_trace_destroy(t);
}

static void a_seed_determines_the_trace(void **state)
{
    (void)state;
    ferry_moe_trace *a = ft_moe_gen("small", 100, 11), *b = ft_moe_gen("small", 100, 11), *c = ft_moe_gen("small", 100, 12);
    assert_true(same(a, b));
    assert_false(same(a, c));
    /* every route is top_k distinct experts in range */
    const ferry_moe_model *m = ferry_moe_trace_model(a);
    for (size_t i = 0; i < ferry_moe_trace_steps(a); i++) {
        uint32_t n;
        const uint32_t *ex;
        FT_ASSERT_OK(ferry_moe_trace_step(a, i, NULL, NULL, &ex, &n));
        assert_int_equal(n, m->top_k);
        for (uint32_t x = 0; x < n; x++) {
            assert_true(ex[x] < m->num_experts);
            for (uint32_t y = 0; y < x; y++)
                assert_int_not_equal(ex[x], ex[y]);
        }
    }
    ferry_moe_trace_destroy(a);
    ferry_moe_trace_destroy(b);
    ferry_moe_trace_destroy(c);
    ferry_moe_gen_options o = FERRY_MOE_GEN_OPTIONS_INIT;
    ferry_moe_trace *t = NULL;
    o.model = "gpt-9";
    assert_int_equal(ferry_moe_trace_generate(&o, &t), -EINVAL);
    o.model = "small";
    o.top_k = 17;
    assert_int_equal(ferry_moe_trace_generate(&o, &t), -EINVAL);
    assert_null(t);
    /* a top-k as wide as the layer still yields distinct experts */
    o.top_k = 16;
    o.tokens = 5;
    FT_ASSERT_OK(ferry_moe_trace_generate(&o, &t));
    ferry_moe_trace_destroy(t);
}

/* the generator's next-turn probabilities (what bench/moe_ceiling.c evicts
 * by) are calibrated: over a trace, the experts predicted at p are routed
 * about p of the time, and each layer's probabilities add up to about
 * top_k; a routed expert was predicted well above an unrouted one */
static void next_turn_probabilities_are_calibrated(void **state)
{
    (void)state;
    const char *models[] = {"qwen3-30b-a3b", "mixtral-8x7b"};
    for (int mi = 0; mi < 2; mi++) {
        ferry_moe_gen_options o = FERRY_MOE_GEN_OPTIONS_INIT;
        o.model = models[mi];
        o.seed = 3;
        ferry_moe_model m;
        ferry__gen *g = NULL;
        FT_ASSERT_OK(ferry__gen_open(&o, &g, &m));
        uint32_t E = m.num_experts, K = m.top_k;
        double *p = calloc(E, sizeof *p);
        assert_non_null(p);
        double bin_p[10] = {0}, bin_hit[10] = {0}, bin_n[10] = {0}, sum_dev = 0, p_routed = 0, p_other = 0;
        uint64_t n_routed = 0, n_other = 0, layers = 0;
        for (uint32_t tk = 0; tk < 200; tk++)
            for (uint32_t l = 0; l < m.num_layers; l++) {
                double sum = 0;
                for (uint32_t e = 0; e < E; e++)
                    sum += p[e] = ferry__gen_prob(g, tk, l, e);
                const uint32_t *set = ferry__gen_next(g);
                if (tk < 10)
                    continue; /* the window fills */
                sum_dev += sum / K;
                layers++;
                for (uint32_t e = 0; e < E; e++) {
                    int routed = 0;
                    for (uint32_t k = 0; k < K; k++)
                        routed |= set[k] == e;
                    int b = p[e] >= 1.0 ? 9 : (int)(p[e] * 10);
                    bin_p[b] += p[e];
                    bin_hit[b] += routed;
                    bin_n[b] += 1;
                    if (routed) {
                        p_routed += p[e];
                        n_routed++;
                    } else {
                        p_other += p[e];
                        n_other++;
                    }
                }
            }
        /* the sum of a layer's probabilities: K up to the redraw of duplicates */
        in_range("mean sum of probabilities / top_k", sum_dev / (double)layers, 0.8, 1.1);
        /* each decile with enough experts in it: the mean prediction and
         * the share routed agree within 0.1 */
        for (int b = 0; b < 10; b++)
            if (bin_n[b] >= 200)
                in_range("routed share - mean prediction of a decile",
                         (bin_hit[b] - bin_p[b]) / bin_n[b], -0.1, 0.1);
        double all_p = 0, all_hit = 0;
        for (int b = 0; b < 10; b++) {
            all_p += bin_p[b];
            all_hit += bin_hit[b];
        }
        in_range("routes predicted / routes drawn", all_p / all_hit, 0.8, 1.15);
        /* Qwen3's routed experts were predicted ~7x above the rest, Mixtral's
         * only ~1.3x: its routing is barely predictable online */
        assert_true(p_routed / (double)n_routed > (mi == 0 ? 4.0 : 1.2) * p_other / (double)n_other);
        free(p);
        ferry__gen_close(g);
    }
    /* out of range questions answer 0, never read outside the tables */
    ferry_moe_gen_options o = FERRY_MOE_GEN_OPTIONS_INIT;
    o.model = "small";
    ferry_moe_model m;
    ferry__gen *g = NULL;
    FT_ASSERT_OK(ferry__gen_open(&o, &g, &m));
    assert_true(ferry__gen_prob(g, 0, m.num_layers, 0) == 0.0);
    assert_true(ferry__gen_prob(g, 0, 0, m.num_experts) == 0.0);
    assert_true(ferry__gen_prob(g, 5, 0, 0) == 0.0); /* not the layer's next turn */
    ferry__gen_close(g);
    o.model = "gpt-9";
    assert_int_equal(ferry__gen_open(&o, &g, &m), -EINVAL);
}

/* the decode-capture mode: next-token reuse scaled to what is asked,
 * within a point, on both 256- and 128-expert presets; out of range is
 * refused; an older header's options (without the field) still work */
static void a_reuse_target_is_met(void **state)
{
    (void)state;
    const char *models[] = {"deepseek-v3", "qwen3-30b-a3b"};
    const double targets[] = {0.35, 0.40};
    for (int m = 0; m < 2; m++)
        for (int k = 0; k < 2; k++) {
            ferry_moe_gen_options o = FERRY_MOE_GEN_OPTIONS_INIT;
            o.model = models[m];
            o.tokens = 512;
            o.repeat_next = targets[k];
            ferry_moe_trace *t = NULL;
            FT_ASSERT_OK(ferry_moe_trace_generate(&o, &t));
            ferry__trace_stats st;
            FT_ASSERT_OK(ferry__trace_stats_compute(t, &st));
            char what[64];
            snprintf(what, sizeof what, "%s repeat_next at %.2f", models[m], targets[k]);
            in_range(what, st.repeat_next, targets[k] - 0.01, targets[k] + 0.01);
            ferry__free(st.layer_repeat);
            ferry_moe_trace_destroy(t);
        }
    ferry_moe_gen_options o = FERRY_MOE_GEN_OPTIONS_INIT;
    ferry_moe_trace *t = NULL;
    o.tokens = 8;
    o.repeat_next = 0.95;
    assert_int_equal(ferry_moe_trace_generate(&o, &t), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "repeat_next"));
    o.repeat_next = -0.5;
    assert_int_equal(ferry_moe_trace_generate(&o, &t), -EINVAL);
    /* below what popularity alone repeats: refused with the reachable range */
    o.repeat_next = 0.05;
    assert_int_equal(ferry_moe_trace_generate(&o, &t), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "reaches"));
    o.repeat_next = 0.5; /* past the field: the preset's reuse */
    o.size = FERRY_MOE_GEN_OPTIONS_MIN_SIZE;
    FT_ASSERT_OK(ferry_moe_trace_generate(&o, &t));
    ferry__trace_stats st;
    FT_ASSERT_OK(ferry__trace_stats_compute(t, &st));
    ferry__free(st.layer_repeat);
    ferry_moe_trace_destroy(t);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(deepseek_preset_matches_published_statistics),
        cmocka_unit_test(mixtral_preset_matches_its_top_expert_share),
        cmocka_unit_test(a_uniform_trace_fails_the_same_checks),
        cmocka_unit_test(miss_rates_are_u_shaped_over_depth),
        cmocka_unit_test(gen_options_are_range_checked),
        cmocka_unit_test(a_seed_determines_the_trace),
        cmocka_unit_test(next_turn_probabilities_are_calibrated),
        cmocka_unit_test(a_reuse_target_is_met),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
