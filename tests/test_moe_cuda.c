/*
 * test_moe_cuda.c - the seed's hardware test on a real CUDA device: a plan
 * lands each expert in the slot it named, a gather moves a slot without
 * the host, a warm step copies nothing; then a routed trace through the
 * planner with every slot read back. Skipped (77) without a CUDA driver.
 */
/* ferry-test-labels: gpu */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry_test.h"
#include "moe/moe_internal.h"

#define EXPERTS 4
#define WIDTH 4096

static void a_cuda_pool_lands_each_expert_in_the_slot_the_plan_named(void **state)
{
    (void)state;
    ferry_device_options o = FERRY_DEVICE_OPTIONS_INIT;
    o.backend = "cuda";
    ferry_device *dev;
    FT_ASSERT_OK(ferry_device_open(&o, &dev));
    ferry_moe_geometry g = FERRY_MOE_GEOMETRY_INIT;
    g.num_layers = 1;
    g.num_experts = EXPERTS;
    g.slots = EXPERTS;
    g.banks = 1;
    g.row_bytes[0] = WIDTH;
    void *bank;
    FT_ASSERT_OK(ferry_device_host_alloc(dev, EXPERTS * WIDTH, &bank));
    for (int e = 0; e < EXPERTS; e++)
        ft_fill_pattern((char *)bank + e * WIDTH, WIDTH, (unsigned)e * 17);
    ferry_moe_rows *rows;
    FT_ASSERT_OK(ferry_moe_rows_host(&g, &bank, NULL, 0, &rows));
    const ferry_moe_slot_device_ops *ops;
    void *ctx;
    ferry_moe_slots *s;
    FT_ASSERT_OK(ferry_moe_device_slots_open(dev, &g, &ops, &ctx));
    FT_ASSERT_OK(ferry_moe_slots_create(&g, ops, ctx, &s));
    uint32_t dst[] = {0, 2}, src[] = {3, 1};
    ferry_moe_copy_plan plan = {0, 2, dst, src};
    assert_int_equal(ferry_moe_slots_apply(s, &plan, rows, NULL, NULL), 2);
    char buf[WIDTH];
    for (int i = 0; i < 2; i++) {
        FT_ASSERT_OK(ferry_device_download(dev, buf, ferry_moe_device_slot_ptr(ctx, 0, dst[i]), WIDTH));
        assert_int_equal(ft_check_pattern(buf, WIDTH, src[i] * 17), -1);
    }
    uint32_t gd = 1, gs = 0;
    ferry_moe_gather_plan gp = {1, &gd, &gs};
    assert_int_equal(ferry_moe_slots_gather(s, &gp, NULL, NULL), 1);
    FT_ASSERT_OK(ferry_device_download(dev, buf, ferry_moe_device_slot_ptr(ctx, 0, 1), WIDTH));
    assert_int_equal(ft_check_pattern(buf, WIDTH, 3 * 17), -1);
    assert_int_equal(ferry_moe_slots_occupant(s, 1), 3);
    ferry_moe_slots_stats st = FERRY_MOE_SLOTS_STATS_INIT;
    ferry_moe_slots_stats_get(s, &st);
    assert_int_equal(st.host_bytes, 2 * WIDTH);
    assert_int_equal(st.device_bytes, WIDTH);
    ferry_moe_copy_plan warm = {0, 0, dst, src};
    assert_int_equal(ferry_moe_slots_apply(s, &warm, rows, NULL, NULL), 0);
    ferry_moe_slots_stats_get(s, &st);
    assert_int_equal(st.host_bytes, 2 * WIDTH);
    ferry_moe_slots_destroy(s);
    ferry_moe_rows_destroy(rows);
    FT_ASSERT_OK(ferry_device_host_free(dev, bank));
    ferry_device_close(dev);
}

static void a_routed_trace_keeps_every_cuda_slot_right(void **state)
{
    (void)state;
    ferry_device_options o = FERRY_DEVICE_OPTIONS_INIT;
    o.backend = "cuda";
    ferry_device *dev;
    FT_ASSERT_OK(ferry_device_open(&o, &dev));
    ferry_moe_gen_options go = FERRY_MOE_GEN_OPTIONS_INIT;
    go.model = "small";
    go.tokens = 50;
    ferry_moe_trace *t;
    FT_ASSERT_OK(ferry_moe_trace_generate(&go, &t));
    const ferry_moe_model *m = ferry_moe_trace_model(t);
    ferry_moe_geometry g = FERRY_MOE_GEOMETRY_INIT;
    g.num_layers = m->num_layers;
    g.num_experts = m->num_experts;
    g.slots = m->num_experts + 8;
    g.banks = 3;
    size_t w = 1000; /* not a multiple of 256: the pitch pads it */
    g.row_bytes[0] = g.row_bytes[1] = g.row_bytes[2] = w;
    size_t ids = (size_t)m->num_layers * m->num_experts;
    void *banks[3];
    for (int b = 0; b < 3; b++) {
        banks[b] = malloc(ids * w);
        for (size_t id = 0; id < ids; id++)
            ft_fill_pattern((char *)banks[b] + id * w, w, (unsigned)(id * 3 + b));
    }
    ferry_moe_rows *rows;
    FT_ASSERT_OK(ferry_moe_rows_host(&g, banks, dev, 0, &rows));
    const ferry_moe_slot_device_ops *ops;
    void *ctx;
    ferry_moe_slots *s;
    FT_ASSERT_OK(ferry_moe_device_slots_open(dev, &g, &ops, &ctx));
    FT_ASSERT_OK(ferry_moe_slots_create(&g, ops, ctx, &s));
    ferry_moe_planner_options po = FERRY_MOE_PLANNER_OPTIONS_INIT;
    po.num_layers = g.num_layers;
    po.num_experts = g.num_experts;
    po.slots = g.slots;
    po.policy = "routing";
    ferry_moe_planner *p;
    FT_ASSERT_OK(ferry_moe_planner_create(&po, &p));
    char *buf = malloc(w);
    for (size_t i = 0; i < ferry_moe_trace_steps(t); i++) {
        uint32_t layer, n;
        const uint32_t *ex;
        FT_ASSERT_OK(ferry_moe_trace_step(t, i, NULL, &layer, &ex, &n));
        ferry_moe_copy_plan plan;
        assert_true(ferry_moe_planner_ensure(p, layer, ex, n, NULL, &plan, NULL) >= 0);
        assert_true(ferry_moe_slots_apply(s, &plan, rows, NULL, NULL) >= 0);
        FT_ASSERT_OK(ferry_moe_check(p, s));
    }
    for (uint32_t slot = 0; slot < g.slots; slot++) {
        uint32_t id = ferry_moe_planner_occupant(p, slot);
        if (id == FERRY_MOE_NONE)
            continue;
        for (int b = 0; b < 3; b++) {
            FT_ASSERT_OK(ferry_device_download(dev, buf, ferry_moe_device_slot_ptr(ctx, b, slot), w));
            assert_int_equal(ft_check_pattern(buf, w, (unsigned)(id * 3 + b)), -1);
        }
    }
    free(buf);
    ferry_moe_planner_destroy(p);
    ferry_moe_slots_destroy(s);
    ferry_moe_rows_destroy(rows);
    for (int b = 0; b < 3; b++)
        free(banks[b]);
    ferry_moe_trace_destroy(t);
    ferry_device_close(dev);
}

int main(void)
{
    const char *why = NULL;
    if (ferry_device_backend_available("cuda", &why) != 1) {
        printf("skipped: no CUDA device (%s)\n", why ? why : "unavailable");
        return 77;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(a_cuda_pool_lands_each_expert_in_the_slot_the_plan_named),
        cmocka_unit_test(a_routed_trace_keeps_every_cuda_slot_right),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
