/*
 * test_moe_budget.c - slot budgets below a layer: decode planning with any
 * budget of at least one step's experts, prefill and wide steps streamed
 * through the slots in waves (the bytes checked through a real executor),
 * and every policy at such budgets.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry_test.h"
#include "moe_traces.h"
#include "moe/moe_internal.h"

static void decode_runs_with_a_budget_below_a_layer(void **state)
{
    (void)state;
    /* 4 layers x 64 experts, top-4, 6 slots: under a tenth of one layer */
    for (const char *const *pol = ferry_moe_policies(); *pol; pol++) {
        if (!strcmp(*pol, "belady"))
            continue;
        ferry_moe_planner *p = ft_moe_mk(4, 64, 6, *pol, NULL);
        ferry__rng r;
        ferry__rng_seed(&r, 7);
        for (int step = 0; step < 400; step++) {
            uint32_t layer = (uint32_t)step % 4, route[4], slots[4];
            for (int i = 0; i < 4; i++)
                route[i] = ferry__rng_below(&r, 64);
            int rc = ferry_moe_planner_ensure(p, layer, route, 4, slots, NULL, NULL);
            if (rc < 0)
                fail_msg("%s: step %d: %s", *pol, step, ferry_moe_planner_last_error(p));
            for (int i = 0; i < 4; i++) {
                assert_true(slots[i] < 6);
                assert_int_equal(ferry_moe_planner_occupant(p, slots[i]), layer * 64 + route[i]);
            }
        }
        ferry_moe_planner_destroy(p);
    }
}

static void a_step_wider_than_the_slots_is_refused_and_changes_nothing(void **state)
{
    (void)state;
    ferry_moe_planner *p = ft_moe_mk(2, 16, 4, "lru", NULL);
    uint32_t a[] = {1, 2, 3}, wide[] = {4, 5, 6, 7, 8};
    assert_int_equal(ferry_moe_planner_ensure(p, 0, a, 3, NULL, NULL, NULL), 3);
    ferry_moe_planner_stats b = FERRY_MOE_PLANNER_STATS_INIT, c = FERRY_MOE_PLANNER_STATS_INIT;
    FT_ASSERT_OK(ferry_moe_planner_stats_get(p, &b));
    assert_int_equal(ferry_moe_planner_ensure(p, 0, wide, 5, NULL, NULL, NULL), FERRY_ENOSPACE);
    assert_non_null(strstr(ferry_moe_planner_last_error(p), "stream"));
    ferry_moe_copy_plan plan;
    assert_int_equal(ferry_moe_planner_prefill(p, 1, &plan, NULL), FERRY_ENOSPACE);
    FT_ASSERT_OK(ferry_moe_planner_stats_get(p, &c));
    assert_memory_equal(&b, &c, sizeof b);
    for (uint32_t i = 0; i < 3; i++)
        assert_int_equal(ferry_moe_planner_lookup(p, 0, a[i]), i);
    ferry_moe_planner_destroy(p);
}

/* one bank of 256-byte rows, every byte of row (l, e) = l * E + e + 1 */
enum { L = 2, E = 16, ROW = 256 };

typedef struct rig {
    ferry_device *dev;
    unsigned char *bank;
    ferry_moe_rows *rows;
    ferry_moe_slots *slots;
} rig;

static void rig_open(rig *x, uint32_t nslots)
{
    ferry_device_options d = FERRY_DEVICE_OPTIONS_INIT;
    d.backend = "host";
    FT_ASSERT_OK(ferry_device_open(&d, &x->dev));
    x->bank = malloc((size_t)L * E * ROW);
    assert_non_null(x->bank);
    for (int i = 0; i < L * E; i++)
        memset(x->bank + (size_t)i * ROW, i + 1, ROW);
    ferry_moe_geometry g = FERRY_MOE_GEOMETRY_INIT;
    g.num_layers = L;
    g.num_experts = E;
    g.slots = nslots;
    g.banks = 1;
    g.row_bytes[0] = ROW;
    void *bases[1] = {x->bank};
    FT_ASSERT_OK(ferry_moe_rows_host(&g, bases, NULL, 0, &x->rows));
    const ferry_moe_slot_device_ops *ops;
    void *ctx;
    FT_ASSERT_OK(ferry_moe_device_slots_open(x->dev, &g, &ops, &ctx));
    FT_ASSERT_OK(ferry_moe_slots_create(&g, ops, ctx, &x->slots));
}

static void rig_close(rig *x)
{
    ferry_moe_slots_destroy(x->slots);
    ferry_moe_rows_destroy(x->rows);
    ferry_device_close(x->dev);
    free(x->bank);
}

/* the slot holds exactly row (layer, e) */
static void assert_slot_holds(rig *x, uint32_t slot, uint32_t layer, uint32_t e)
{
    unsigned char got[ROW];
    ferry_devptr p = ferry_moe_device_slot_ptr(ferry_moe_slots_device(x->slots), 0, slot);
    FT_ASSERT_OK(ferry_device_download(x->dev, got, p, ROW));
    assert_memory_equal(got, x->bank + ((size_t)layer * E + e) * ROW, ROW);
}

/* stream every expert of `layer`; each wave's rows checked in its slots */
static uint32_t stream_layer(rig *x, ferry_moe_planner *p, uint32_t layer, uint32_t nslots,
                             uint32_t *waves)
{
    uint32_t all[E], seen[E] = {0};
    for (uint32_t e = 0; e < E; e++)
        all[e] = e;
    ferry_moe_counts c;
    int rows = ferry_moe_planner_stream_begin(p, layer, all, E, &c);
    assert_true(rows >= 0);
    assert_int_equal(c.active, E);
    assert_int_equal(c.missing, (uint32_t)rows);
    /* while open, the planner takes nothing else */
    assert_int_equal(ferry_moe_planner_ensure(p, layer, all, 1, NULL, NULL, NULL), FERRY_ESTATE);
    assert_int_equal(ferry_moe_planner_prefetch(p, layer, all, 1, NULL), FERRY_ESTATE);
    assert_int_equal(ferry_moe_planner_resize(p, nslots + 1), FERRY_ESTATE);
    assert_int_equal(ferry_moe_planner_stream_begin(p, layer, all, 1, NULL), FERRY_ESTATE);
    ferry_moe_wave w;
    uint32_t copied = 0, n = 0;
    int k;
    *waves = 0;
    while ((k = ferry_moe_planner_stream_next(p, &w)) > 0) {
        assert_int_equal((uint32_t)k, w.n);
        assert_true(w.n <= nslots);
        (*waves)++;
        assert_int_equal(ferry_moe_slots_apply(x->slots, &w.plan, x->rows, NULL, NULL),
                         (int)w.plan.n);
        copied += w.plan.n;
        FT_ASSERT_OK(ferry_moe_check(p, x->slots));
        for (uint32_t i = 0; i < w.n; i++) {
            assert_int_equal(seen[w.experts[i]]++, 0); /* each expert once */
            assert_int_equal(ferry_moe_planner_occupant(p, w.slots[i]), layer * E + w.experts[i]);
            assert_slot_holds(x, w.slots[i], layer, w.experts[i]);
        }
        n += w.n;
    }
    assert_int_equal(k, 0);
    assert_int_equal(w.n, 0);
    assert_int_equal(n, E);
    assert_int_equal(copied, (uint32_t)rows);
    assert_int_equal(ferry_moe_planner_stream_next(p, &w), FERRY_ESTATE); /* closed */
    return (uint32_t)rows;
}

static void prefill_streams_a_layer_through_the_slots_in_waves(void **state)
{
    (void)state;
    for (const char *const *pol = ferry_moe_policies(); *pol; pol++) {
        if (!strcmp(*pol, "belady"))
            continue;
        rig x;
        rig_open(&x, 6);
        ferry_moe_planner *p = ft_moe_mk(L, E, 6, *pol, NULL);
        uint32_t waves;
        /* cold: every expert copied, 16 through 6 slots: 6 + 6 + 4 */
        assert_int_equal(stream_layer(&x, p, 0, 6, &waves), E);
        assert_int_equal(waves, 3);
        /* warm: what stayed resident is served first and not copied again */
        uint32_t resident = 0;
        for (uint32_t e = 0; e < E; e++)
            resident += ferry_moe_planner_lookup(p, 0, e) != FERRY_MOE_NONE;
        assert_int_equal(resident, 6);
        assert_int_equal(stream_layer(&x, p, 0, 6, &waves), E - resident);
        /* a decode step after it, on the other layer, and back */
        uint32_t r[] = {3, 9}, s[2];
        ferry_moe_copy_plan plan;
        assert_true(ferry_moe_planner_ensure(p, 1, r, 2, s, &plan, NULL) >= 0);
        assert_true(ferry_moe_slots_apply(x.slots, &plan, x.rows, NULL, NULL) >= 0);
        assert_slot_holds(&x, s[0], 1, 3);
        assert_slot_holds(&x, s[1], 1, 9);
        FT_ASSERT_OK(ferry_moe_check(p, x.slots));
        ferry_moe_planner_stats st = FERRY_MOE_PLANNER_STATS_INIT;
        FT_ASSERT_OK(ferry_moe_planner_stats_get(p, &st));
        assert_int_equal(st.steps, 3);
        assert_int_equal(st.hits + st.misses, 2 * E + 2);
        ferry_moe_planner_destroy(p);
        rig_close(&x);
    }
}

/* a trace of decode steps with a prefill batch every 16 passes */
static ferry_moe_trace *mixed_trace(void)
{
    ferry_moe_model m = {.num_layers = 3, .num_experts = 32};
    snprintf(m.name, sizeof m.name, "mixed");
    ferry_moe_trace *t = NULL;
    FT_ASSERT_OK(ferry_moe_trace_create(&m, &t));
    ferry__rng r;
    ferry__rng_seed(&r, 11);
    uint32_t all[32];
    for (uint32_t e = 0; e < 32; e++)
        all[e] = e;
    for (uint32_t tk = 0; tk < 96; tk++)
        for (uint32_t l = 0; l < 3; l++) {
            if (tk % 16 == 0) {
                FT_ASSERT_OK(ferry_moe_trace_append(t, tk, l, all, 20 + l));
                continue;
            }
            uint32_t route[4];
            for (int i = 0; i < 4; i++)
                route[i] = ferry__rng_below(&r, 12 + 4 * l);
            FT_ASSERT_OK(ferry_moe_trace_append(t, tk, l, route, 4));
        }
    return t;
}

static void every_policy_replays_budgets_below_a_layer(void **state)
{
    (void)state;
    ferry_moe_trace *t = mixed_trace();
    for (uint32_t slots = 4; slots <= 40; slots += 12) {
        ferry_moe_replay_result b;
        FT_ASSERT_OK(ferry_moe_replay(t, "belady", slots, 0, &b));
        for (const char *const *pol = ferry_moe_policies(); *pol; pol++) {
            ferry_moe_replay_result r;
            int rc = ferry_moe_replay(t, *pol, slots, 0, &r);
            if (rc != 0)
                fail_msg("%s at %u slots: %s", *pol, slots, ferry_last_error());
            assert_int_equal(r.slots, slots);
            assert_int_equal(r.hits + r.misses, b.hits + b.misses);
            if (r.hits > b.hits)
                fail_msg("%s at %u slots: %llu hits, belady %llu", *pol, slots,
                         (unsigned long long)r.hits, (unsigned long long)b.hits);
        }
    }
    ferry_moe_trace_destroy(t);
}

static void lru_layer_divides_by_the_layers_a_capture_logged(void **state)
{
    (void)state;
    /* 2 layers logged of 40: the trace has 2 layers, and lru-layer's quota
     * is slots / 2, as on the same routes written as a 2-layer trace */
    char cap[4096], dense[4096];
    size_t a = 0, d = 0;
    a += (size_t)snprintf(cap + a, sizeof cap - a, "%s", "");
    d += (size_t)snprintf(dense + d, sizeof dense - d,
                          "{\"num_layers\":2,\"num_experts\":16,\"top_k\":2}\n");
    for (int tk = 0; tk < 24; tk++)
        for (int i = 0; i < 2; i++) {
            int e1 = (tk * 5 + i * 3) % 16, e2 = (tk * 3 + 7 * i + 1) % 16;
            a += (size_t)snprintf(cap + a, sizeof cap - a,
                                  "{\"layer\":\"model.layers.%d.mlp.experts\",\"num_experts\":16,"
                                  "\"topk_ids\":[[%d,%d]]}\n", i ? 39 : 12, e1, e2);
            d += (size_t)snprintf(dense + d, sizeof dense - d,
                                  "{\"token\":%d,\"layer\":%d,\"experts\":[%d,%d]}\n", tk, i, e1,
                                  e2);
        }
    ferry_moe_trace *tc = NULL, *td = NULL;
    FT_ASSERT_OK(ferry_moe_trace_parse(cap, a, &tc));
    FT_ASSERT_OK(ferry_moe_trace_parse(dense, d, &td));
    assert_int_equal(ferry_moe_trace_model(tc)->num_layers, 2);
    ferry_moe_replay_result rc, rd;
    FT_ASSERT_OK(ferry_moe_replay(tc, "lru-layer", 6, 0, &rc));
    FT_ASSERT_OK(ferry_moe_replay(td, "lru-layer", 6, 0, &rd));
    assert_int_equal(rc.hits, rd.hits);
    assert_int_equal(rc.misses, rd.misses);
    /* and a ferry trace that declares 22 layers and routes 2: the same */
    ferry_moe_model m = {.num_layers = 22, .num_experts = 16};
    ferry_moe_trace *tw = NULL;
    FT_ASSERT_OK(ferry_moe_trace_create(&m, &tw));
    for (size_t i = 0; i < ferry_moe_trace_steps(td); i++) {
        uint32_t tok, layer, n;
        const uint32_t *ex;
        FT_ASSERT_OK(ferry_moe_trace_step(td, i, &tok, &layer, &ex, &n));
        FT_ASSERT_OK(ferry_moe_trace_append(tw, tok, layer ? 17 : 3, ex, n));
    }
    ferry_moe_replay_result rw;
    FT_ASSERT_OK(ferry_moe_replay(tw, "lru-layer", 6, 0, &rw));
    assert_int_equal(rw.hits, rd.hits);
    assert_int_equal(rw.misses, rd.misses);
    ferry_moe_trace_destroy(tw);
    ferry_moe_trace_destroy(tc);
    ferry_moe_trace_destroy(td);
}

static void the_routing_policy_stays_consistent_through_waves(void **state)
{
    (void)state;
    ferry_moe_planner *p = ft_moe_mk(3, 32, 5, "routing", NULL);
    ferry__rng r;
    ferry__rng_seed(&r, 3);
    uint32_t all[32];
    for (uint32_t e = 0; e < 32; e++)
        all[e] = e;
    char why[256];
    for (uint32_t tk = 0; tk < 80; tk++)
        for (uint32_t l = 0; l < 3; l++) {
            if (tk % 10 == 0) {
                assert_true(ferry_moe_planner_stream_begin(p, l, all, 8 + 8 * l, NULL) >= 0);
                ferry_moe_wave w;
                int k;
                while ((k = ferry_moe_planner_stream_next(p, &w)) > 0)
                    if (ferry__routing_check(ferry__planner_policy(p), why, sizeof why) != 0)
                        fail_msg("token %u layer %u: %s", tk, l, why);
                assert_int_equal(k, 0);
            } else {
                uint32_t route[3];
                for (int i = 0; i < 3; i++)
                    route[i] = ferry__rng_below(&r, 32);
                assert_true(ferry_moe_planner_ensure(p, l, route, 3, NULL, NULL, NULL) >= 0);
            }
            if (ferry__routing_check(ferry__planner_policy(p), why, sizeof why) != 0)
                fail_msg("token %u layer %u: %s", tk, l, why);
        }
    ferry_moe_planner_destroy(p);
}

static void a_prefetch_that_cannot_fit_places_nothing(void **state)
{
    (void)state;
    /* 6 slots; the step pins 4; a prefetch of 3 misses cannot fit whole */
    ferry_moe_planner *p = ft_moe_mk(2, 16, 6, "lru", NULL);
    uint32_t now[] = {0, 1, 2, 3}, three[] = {5, 6, 7}, two[] = {5, 6};
    assert_int_equal(ferry_moe_planner_ensure(p, 0, now, 4, NULL, NULL, NULL), 4);
    ferry_moe_copy_plan plan;
    assert_int_equal(ferry_moe_planner_prefetch(p, 1, three, 3, &plan), FERRY_ENOSPACE);
    for (int i = 0; i < 3; i++)
        assert_int_equal(ferry_moe_planner_lookup(p, 1, three[i]), FERRY_MOE_NONE);
    assert_int_equal(ferry_moe_planner_prefetch(p, 1, two, 2, &plan), 2);
    /* the next step unpins: now 2 more fit, evicting the old step */
    uint32_t next[] = {5};
    assert_int_equal(ferry_moe_planner_ensure(p, 1, next, 1, NULL, NULL, NULL), 0);
    assert_int_equal(ferry_moe_planner_prefetch(p, 0, three, 3, &plan), 3);
    ferry_moe_planner_destroy(p);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(decode_runs_with_a_budget_below_a_layer),
        cmocka_unit_test(a_step_wider_than_the_slots_is_refused_and_changes_nothing),
        cmocka_unit_test(prefill_streams_a_layer_through_the_slots_in_waves),
        cmocka_unit_test(every_policy_replays_budgets_below_a_layer),
        cmocka_unit_test(lru_layer_divides_by_the_layers_a_capture_logged),
        cmocka_unit_test(the_routing_policy_stays_consistent_through_waves),
        cmocka_unit_test(a_prefetch_that_cannot_fit_places_nothing),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
