/*
 * test_moe_promises.c - the promises of ferry/moe.h that no other test
 * checks, each asserted as an engine using the header sees it: listings,
 * NULL and out-of-range arguments, options and result sizes, the slot
 * device ops' ownership, rows sources' refusals, the stream's state and
 * traces read from several threads.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ferry_test.h"
#include "moe_traces.h"

#define W 64
#define LEN(a) (sizeof(a) / sizeof((a)[0]))

static ferry_moe_trace *small_trace(uint32_t layers, uint32_t experts, uint32_t tokens)
{
    ferry_moe_model m;
    memset(&m, 0, sizeof m);
    snprintf(m.name, sizeof m.name, "small");
    m.num_layers = layers;
    m.num_experts = experts;
    m.top_k = 1;
    ferry_moe_trace *t = NULL;
    FT_ASSERT_OK(ferry_moe_trace_create(&m, &t));
    for (uint32_t tk = 0; tk < tokens; tk++)
        for (uint32_t l = 0; l < layers; l++) {
            const uint32_t e = (tk * 7 + l * 3) % experts;
            FT_ASSERT_OK(ferry_moe_trace_append(t, tk, l, &e, 1));
        }
    return t;
}

/* ---- a counting fake slot device ---- */
typedef struct fake {
    int destroys, writes, copies, flushes;
    uint8_t mem[16][W];
} fake;

static int fk_begin(void *c, int route)
{
    (void)c;
    (void)route;
    return 0;
}

static int fk_write(void *c, uint32_t bank, uint32_t slot, const void *src, size_t n)
{
    fake *f = c;
    (void)bank;
    f->writes++;
    memcpy(f->mem[slot], src, n < W ? n : W);
    return 0;
}

static int fk_copy(void *c, uint32_t bank, uint32_t dst, uint32_t src)
{
    fake *f = c;
    (void)bank;
    f->copies++;
    memcpy(f->mem[dst], f->mem[src], W);
    return 0;
}

static int fk_flush(void *c)
{
    ((fake *)c)->flushes++;
    return 0;
}

static void fk_destroy(void *c)
{
    ((fake *)c)->destroys++;
}

static const ferry_moe_slot_device_ops fake_ops = {
    .size = sizeof(ferry_moe_slot_device_ops),
    .begin_plan = fk_begin,
    .write_slot = fk_write,
    .copy_slot = fk_copy,
    .flush = fk_flush,
    .destroy = fk_destroy,
};

static uint8_t rows_mem[4][8][W]; /* [layer][expert][byte] */

static const void *row_of(void *ctx, uint32_t bank, uint32_t layer, uint32_t row, size_t *len)
{
    (void)ctx;
    if (bank > 0 || layer >= 4 || row >= 8)
        return NULL;
    *len = W;
    return rows_mem[layer][row];
}

/* moe.h: "The generator's preset names, NULL-terminated" and "Policy
 * names, NULL-terminated"; "One line describing a policy, or NULL when
 * unknown": every name listed is one the generator and the planner take */
static void every_listed_name_is_taken_and_described(void **state)
{
    (void)state;
    const char *const *pre = ferry_moe_gen_presets();
    assert_non_null(pre);
    size_t n = 0;
    for (; pre[n]; n++) {
        ferry_moe_gen_options go = FERRY_MOE_GEN_OPTIONS_INIT;
        go.model = pre[n];
        go.tokens = 4;
        ferry_moe_trace *t = NULL;
        if (ferry_moe_trace_generate(&go, &t) != 0)
            fail_msg("preset '%s' listed but refused: %s", pre[n], ferry_last_error());
        assert_true(ferry_moe_trace_steps(t) > 0);
        ferry_moe_trace_destroy(t);
    }
    assert_true(n >= 4);

    const char *const *pol = ferry_moe_policies();
    ferry_moe_trace *oracle = small_trace(2, 8, 4);
    for (n = 0; pol[n]; n++) {
        const char *d = ferry_moe_policy_describe(pol[n]);
        if (!d || !*d || strchr(d, '\n'))
            fail_msg("policy '%s': description '%s' is not one line", pol[n], d ? d : "(null)");
        ferry_moe_planner *p = ft_moe_mk(2, 8, 4, pol[n], oracle);
        assert_string_equal(ferry_moe_planner_policy(p), pol[n]);
        ferry_moe_planner_destroy(p);
    }
    assert_true(n >= 8);
    assert_null(ferry_moe_policy_describe("no-such-policy"));
    assert_null(ferry_moe_policy_describe(""));
    assert_null(ferry_moe_policy_describe(NULL));
    ferry_moe_trace_destroy(oracle);
}

/* moe.h: destroy(NULL) does nothing (trace, rows; the executor and
 * planner as ARCHITECTURE.md says of every destroy); a NULL trace's
 * accessors answer without dereferencing it */
static void null_objects_are_answered_not_dereferenced(void **state)
{
    (void)state;
    ferry_moe_trace_destroy(NULL);
    ferry_moe_rows_destroy(NULL);
    ferry_moe_slots_destroy(NULL);
    ferry_moe_planner_destroy(NULL);
    const ferry_moe_model *m = ferry_moe_trace_model(NULL);
    assert_non_null(m);
    assert_int_equal(m->num_layers + m->num_experts + m->top_k, 0);
    assert_int_equal(m->expert_bytes, 0);
    assert_int_equal(ferry_moe_trace_steps(NULL), 0);
    assert_int_equal(ferry_moe_trace_tokens(NULL), 0);
    assert_int_equal(ferry_moe_trace_step_tokens(NULL, 0), 0);
    assert_int_equal(ferry_moe_trace_layer_id(NULL, 0), FERRY_MOE_NONE);
    assert_non_null(ferry_moe_trace_stage(NULL));
    uint32_t tok, layer, n;
    const uint32_t *ex;
    assert_int_equal(ferry_moe_trace_step(NULL, 0, &tok, &layer, &ex, &n), -EINVAL);
    assert_int_equal(ferry_moe_trace_step_pred(NULL, 0, &ex, &n), -EINVAL);
    ferry_moe_model shape;
    memset(&shape, 0, sizeof shape);
    assert_int_equal(ferry_moe_trace_create(NULL, NULL), -EINVAL);
    const uint32_t e = 0;
    assert_int_equal(ferry_moe_trace_append(NULL, 0, 0, &e, 1), -EINVAL);
    assert_int_equal(ferry_moe_trace_save(NULL, "/tmp/x"), -EINVAL);
    ferry_moe_replay_result r;
    assert_int_equal(ferry_moe_replay(NULL, "lru", 4, 0, &r), -EINVAL);
    ferry_moe_sim_options so = FERRY_MOE_SIM_OPTIONS_INIT;
    ferry_moe_sim_result sr = FERRY_MOE_SIM_RESULT_INIT;
    so.slots = 4;
    assert_int_equal(ferry_moe_sim(NULL, &so, &sr), -EINVAL);
    assert_null(ferry_moe_slots_device(NULL));
    assert_non_null(ferry_moe_slots_last_error(NULL));
    assert_int_equal(ferry_moe_slots_occupant(NULL, 0), FERRY_MOE_NONE);
    assert_true(ferry_moe_slots_invalidate(NULL, 0) < 0);
    ferry_moe_slots_stats st = FERRY_MOE_SLOTS_STATS_INIT;
    assert_int_equal(ferry_moe_slots_stats_get(NULL, &st), -EINVAL);
    assert_int_equal(ferry_moe_rows_class(NULL, 0), -EINVAL);
    assert_int_equal(ferry_moe_check(NULL, NULL), -EINVAL);
}

/* moe.h: a trace's out-of-range step reads: step and step_pred -EINVAL,
 * step_tokens 0, layer_id FERRY_MOE_NONE */
static void out_of_range_steps_are_answered(void **state)
{
    (void)state;
    ferry_moe_trace *t = small_trace(2, 8, 3);
    const size_t n = ferry_moe_trace_steps(t);
    assert_int_equal(n, 6);
    uint32_t tok, layer, cnt;
    const uint32_t *ex;
    assert_int_equal(ferry_moe_trace_step(t, n, &tok, &layer, &ex, &cnt), -EINVAL);
    assert_int_equal(ferry_moe_trace_step(t, SIZE_MAX, &tok, &layer, &ex, &cnt), -EINVAL);
    assert_int_equal(ferry_moe_trace_step_pred(t, n, &ex, &cnt), -EINVAL);
    FT_ASSERT_OK(ferry_moe_trace_step_pred(t, 0, &ex, &cnt));
    assert_null(ex);
    assert_int_equal(cnt, 0);
    assert_int_equal(ferry_moe_trace_step_tokens(t, n), 0);
    assert_int_equal(ferry_moe_trace_step_tokens(t, 0), 1);
    assert_int_equal(ferry_moe_trace_layer_id(t, 1), 1);
    assert_int_equal(ferry_moe_trace_layer_id(t, 2), FERRY_MOE_NONE);
    assert_string_equal(ferry_moe_trace_stage(t), "");
    assert_int_equal(ferry_moe_trace_tokens(t), 3);
    ferry_moe_trace_destroy(t);
}

/* moe.h trace options: "At most 31 bytes (-EINVAL)" for a stage, and the
 * options size as ARCHITECTURE.md's conventions say */
static void trace_options_are_checked(void **state)
{
    (void)state;
    static const char rec[] = "{\"layer\":0,\"num_experts\":4,\"topk_ids\":[[1]],"
                              "\"stage\":\"0123456789012345678901234567890\"}\n";
    ferry_moe_trace *t = (ferry_moe_trace *)0x1;
    ferry_moe_trace_options o = FERRY_MOE_TRACE_OPTIONS_INIT;
    o.stage = "0123456789012345678901234567890123";
    assert_int_equal(ferry_moe_trace_parse_opts(rec, strlen(rec), &o, &t), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "stage"));
    assert_ptr_equal(t, (ferry_moe_trace *)0x1);
    o.stage = "0123456789012345678901234567890"; /* 31 bytes: taken */
    FT_ASSERT_OK(ferry_moe_trace_parse_opts(rec, strlen(rec), &o, &t));
    ferry_moe_trace_destroy(t);
    t = (ferry_moe_trace *)0x1;
    o.stage = NULL;
    const size_t sizes[] = {0, 1, sizeof o - 1, sizeof o + 8};
    for (size_t i = 0; i < LEN(sizes); i++) {
        o.size = sizes[i];
        assert_int_equal(ferry_moe_trace_parse_opts(rec, strlen(rec), &o, &t), -EINVAL);
        assert_non_null(strstr(ferry_last_error(), "size"));
        assert_ptr_equal(t, (ferry_moe_trace *)0x1);
    }
    assert_int_equal(ferry_moe_trace_load_opts("/nonexistent/trace.jsonl", NULL, &t), -ENOENT);
    assert_non_null(strstr(ferry_last_error(), "/nonexistent/trace.jsonl"));
    assert_int_equal(ferry_moe_trace_parse_opts(NULL, 4, NULL, &t), -EINVAL);
    assert_ptr_equal(t, (ferry_moe_trace *)0x1);
    assert_int_equal(ferry_moe_trace_parse_opts(rec, strlen(rec), NULL, NULL), -EINVAL);
}

/* moe.h trace_create: -EINVAL for each shape field out of range and a
 * name that is not UTF-8; trace_append: n > 16384, layer or expert out of
 * range, nothing appended */
static void trace_shapes_and_appends_are_range_checked(void **state)
{
    (void)state;
    struct {
        uint32_t layers, experts, top_k;
        uint64_t bytes;
        const char *name, *field;
    } bad[] = {
        {0, 8, 1, 0, "m", "num_layers 0: accepted 1..1024"},
        {1025, 8, 1, 0, "m", "num_layers 1025"},
        {2, 0, 0, 0, "m", "num_experts 0: accepted 1..16384"},
        {2, 16385, 1, 0, "m", "num_experts 16385"},
        {2, 8, 9, 0, "m", "top_k 9"},
        {2, 8, 1, (uint64_t)INT64_MAX + 1, "m", "expert_bytes 9223372036854775808"},
        {2, 8, 1, 0, "bad\xff", "name"},
    };
    for (size_t i = 0; i < LEN(bad); i++) {
        ferry_moe_model m;
        memset(&m, 0, sizeof m);
        snprintf(m.name, sizeof m.name, "%s", bad[i].name);
        m.num_layers = bad[i].layers;
        m.num_experts = bad[i].experts;
        m.top_k = bad[i].top_k;
        m.expert_bytes = bad[i].bytes;
        ferry_moe_trace *t = (ferry_moe_trace *)0x1;
        if (ferry_moe_trace_create(&m, &t) != -EINVAL || !strstr(ferry_last_error(), bad[i].field))
            fail_msg("case %zu: '%s' does not refuse %s", i, ferry_last_error(), bad[i].field);
        assert_ptr_equal(t, (ferry_moe_trace *)0x1);
    }
    ferry_moe_trace *none = (ferry_moe_trace *)0x1;
    assert_int_equal(ferry_moe_trace_create(NULL, &none), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "no model"));
    assert_ptr_equal(none, (ferry_moe_trace *)0x1);
    /* a name of 64 bytes with no NUL is not text either */
    ferry_moe_model m;
    memset(&m, 'a', sizeof m.name);
    m.num_layers = 1;
    m.num_experts = 4;
    m.top_k = 1;
    m.expert_bytes = 0;
    ferry_moe_trace *t = NULL;
    int rc = ferry_moe_trace_create(&m, &t);
    if (rc == 0) {
        assert_true(strlen(ferry_moe_trace_model(t)->name) < sizeof m.name);
        ferry_moe_trace_destroy(t);
    } else {
        assert_int_equal(rc, -EINVAL);
    }

    t = small_trace(2, 8, 1);
    static uint32_t wide[16385];
    assert_int_equal(ferry_moe_trace_append(t, 1, 0, wide, 16385), -EINVAL);
    const uint32_t e8 = 8, e0 = 0;
    assert_int_equal(ferry_moe_trace_append(t, 1, 0, &e8, 1), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "8"));
    assert_int_equal(ferry_moe_trace_append(t, 1, 2, &e0, 1), -EINVAL);
    assert_int_equal(ferry_moe_trace_append(t, 1, 0, &e0, 0), -EINVAL);
    assert_int_equal(ferry_moe_trace_append(t, 1, 0, NULL, 1), -EINVAL);
    assert_int_equal(ferry_moe_trace_steps(t), 2);
    ferry_moe_trace_destroy(t);
}

/* moe.h trace_save: -EINVAL (nothing written) for a trace of no steps,
 * -errno on I/O failure */
static void save_refuses_empty_traces_and_reports_io(void **state)
{
    (void)state;
    char dir[256], path[300];
    assert_non_null(ft_tmpdir(dir, sizeof dir));
    snprintf(path, sizeof path, "%s/empty.jsonl", dir);
    ferry_moe_model m;
    memset(&m, 0, sizeof m);
    m.num_layers = 1;
    m.num_experts = 4;
    ferry_moe_trace *t = NULL;
    FT_ASSERT_OK(ferry_moe_trace_create(&m, &t));
    assert_int_equal(ferry_moe_trace_save(t, path), -EINVAL);
    assert_int_equal(access(path, F_OK), -1);
    ferry_moe_trace_destroy(t);
    t = small_trace(1, 4, 2);
    snprintf(path, sizeof path, "%s/no/such/dir/t.jsonl", dir);
    assert_int_equal(ferry_moe_trace_save(t, path), -ENOENT);
    assert_non_null(strstr(ferry_last_error(), "no/such/dir"));
    assert_int_equal(ferry_moe_trace_save(t, NULL), -EINVAL);
    ferry_moe_trace_destroy(t);
    ft_rmtree(dir);
}

/* moe.h planner options: top_k 0..num_experts; "belady" refuses an
 * oracle of another shape and other policies ignore one; a size past
 * this header's struct is a newer header's (ARCHITECTURE.md: -EINVAL) */
static void planner_options_beyond_the_shape_are_refused(void **state)
{
    (void)state;
    ferry_moe_trace *oracle = small_trace(2, 8, 4);
    ferry_moe_planner_options o = FERRY_MOE_PLANNER_OPTIONS_INIT;
    o.num_layers = 2;
    o.num_experts = 8;
    o.slots = 4;
    ferry_moe_planner *p = (ferry_moe_planner *)0x1;
    o.top_k = 9;
    assert_int_equal(ferry_moe_planner_create(&o, &p), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "top_k 9"));
    o.top_k = 8;
    FT_ASSERT_OK(ferry_moe_planner_create(&o, &p));
    ferry_moe_planner_destroy(p);
    p = (ferry_moe_planner *)0x1;
    o.top_k = 0;
    o.size = sizeof o + 8;
    assert_int_equal(ferry_moe_planner_create(&o, &p), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "size"));
    o.size = sizeof o;
    o.policy = "belady";
    o.num_experts = 16;
    o.oracle = oracle;
    assert_int_equal(ferry_moe_planner_create(&o, &p), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "oracle"));
    assert_ptr_equal(p, (ferry_moe_planner *)0x1);
    o.policy = "lru"; /* the oracle is ignored */
    FT_ASSERT_OK(ferry_moe_planner_create(&o, &p));
    ferry_moe_planner_destroy(p);
    assert_int_equal(ferry_moe_planner_create(NULL, &p), -EINVAL);
    o.policy = NULL;
    assert_int_equal(ferry_moe_planner_create(&o, NULL), -EINVAL);
    ferry_moe_trace_destroy(oracle);
}

/* moe.h forget: "-EINVAL when slot >= slots", "Forgetting a free slot is
 * a no-op"; resize: -EINVAL for new_slots 0; occupant and lookup answer
 * FERRY_MOE_NONE out of range; a NULL route is refused */
static void planner_slot_calls_refuse_what_is_out_of_range(void **state)
{
    (void)state;
    ferry_moe_planner *p = ft_moe_mk(2, 8, 4, "lru", NULL);
    const uint32_t two[2] = {1, 5};
    assert_int_equal(ferry_moe_planner_ensure(p, 0, two, 2, NULL, NULL, NULL), 2);
    ferry_moe_planner_stats a = FERRY_MOE_PLANNER_STATS_INIT, b = FERRY_MOE_PLANNER_STATS_INIT;
    ferry_moe_planner_stats_get(p, &a);
    assert_int_equal(ferry_moe_planner_forget(p, 4), -EINVAL);
    assert_non_null(strstr(ferry_moe_planner_last_error(p), "slot 4"));
    assert_int_equal(ferry_moe_planner_forget(p, UINT32_MAX), -EINVAL);
    FT_ASSERT_OK(ferry_moe_planner_forget(p, 3)); /* free: a no-op */
    ferry_moe_planner_stats_get(p, &b);
    assert_memory_equal(&a, &b, sizeof a);
    assert_int_equal(ferry_moe_planner_resize(p, 0), -EINVAL);
    assert_non_null(strstr(ferry_moe_planner_last_error(p), "new_slots 0"));
    assert_int_equal(ferry_moe_planner_slots(p), 4);
    assert_int_equal(ferry_moe_planner_occupant(p, 4), FERRY_MOE_NONE);
    assert_int_equal(ferry_moe_planner_occupant(p, 0), 1);
    assert_int_equal(ferry_moe_planner_lookup(p, 2, 1), FERRY_MOE_NONE);
    assert_int_equal(ferry_moe_planner_lookup(p, 0, 8), FERRY_MOE_NONE);
    assert_int_equal(ferry_moe_planner_lookup(p, 0, 5), 1);
    assert_int_equal(ferry_moe_planner_ensure(p, 0, NULL, 1, NULL, NULL, NULL), -EINVAL);
    assert_int_equal(ferry_moe_planner_prefetch(p, 0, NULL, 1, NULL), -EINVAL);
    assert_int_equal(ferry_moe_planner_stream_begin(p, 0, NULL, 1, NULL), -EINVAL);
    assert_int_equal(ferry_moe_planner_hint(p, 0, 1, NULL, 1, 0.5), -EINVAL);
    assert_int_equal(ferry_moe_planner_prefill(p, 2, NULL, NULL), -EINVAL);
    ferry_moe_wave w;
    assert_int_equal(ferry_moe_planner_stream_next(p, NULL), -EINVAL);
    assert_int_equal(ferry_moe_planner_stream_next(NULL, &w), -EINVAL);
    ferry_moe_planner_stats_get(p, &b);
    assert_memory_equal(&a, &b, sizeof a);
    ferry_moe_planner_destroy(p);
}

/* moe.h stats: "the caller sets out->size ... and only that many bytes
 * are written. Errors: -EINVAL (NULL, size not set)" - for the planner's,
 * the hints' and the executor's totals alike */
static void stats_are_written_only_as_far_as_their_size(void **state)
{
    (void)state;
    ferry_moe_planner *p = ft_moe_mk(2, 8, 4, "lru", NULL);
    const uint32_t e = 3;
    assert_int_equal(ferry_moe_planner_ensure(p, 0, &e, 1, NULL, NULL, NULL), 1);
    assert_int_equal(ferry_moe_planner_hint(p, 1, 1, &e, 1, 0.9), 1);

    union {
        ferry_moe_planner_stats s;
        unsigned char b[sizeof(ferry_moe_planner_stats) + 16];
    } ps;
    memset(&ps, 0xab, sizeof ps);
    ps.s.size = 0;
    assert_int_equal(ferry_moe_planner_stats_get(p, &ps.s), -EINVAL);
    assert_int_equal(ps.b[sizeof(size_t)], 0xab);
    assert_int_equal(ferry_moe_planner_stats_get(p, NULL), -EINVAL);
    ps.s.size = offsetof(ferry_moe_planner_stats, routes); /* up to steps */
    FT_ASSERT_OK(ferry_moe_planner_stats_get(p, &ps.s));
    assert_int_equal(ps.s.size, offsetof(ferry_moe_planner_stats, routes));
    assert_int_equal(ps.s.steps, 1);
    for (size_t i = offsetof(ferry_moe_planner_stats, routes); i < sizeof ps; i++)
        assert_int_equal(ps.b[i], 0xab);

    union {
        ferry_moe_hint_stats s;
        unsigned char b[sizeof(ferry_moe_hint_stats) + 16];
    } hs;
    memset(&hs, 0xab, sizeof hs);
    hs.s.size = 0;
    assert_int_equal(ferry_moe_planner_hint_stats_get(p, &hs.s), -EINVAL);
    hs.s.size = offsetof(ferry_moe_hint_stats, right);
    FT_ASSERT_OK(ferry_moe_planner_hint_stats_get(p, &hs.s));
    assert_int_equal(hs.s.hinted, 1);
    for (size_t i = offsetof(ferry_moe_hint_stats, right); i < sizeof hs; i++)
        assert_int_equal(hs.b[i], 0xab);
    ferry_moe_planner_destroy(p);

    ferry_moe_geometry g = ft_moe_geom(4, 8, 4, W);
    fake f;
    memset(&f, 0, sizeof f);
    ferry_moe_slots *s = NULL;
    FT_ASSERT_OK(ferry_moe_slots_create(&g, &fake_ops, &f, &s));
    ferry_moe_rows *rows = NULL;
    FT_ASSERT_OK(ferry_moe_rows_fn(&g, row_of, NULL, &rows));
    const uint32_t d = 2, r = 5;
    ferry_moe_copy_plan plan = {1, 1, &d, &r};
    assert_int_equal(ferry_moe_slots_apply(s, &plan, rows, NULL, NULL), 1);
    union {
        ferry_moe_slots_stats s;
        unsigned char b[sizeof(ferry_moe_slots_stats) + 16];
    } xs;
    memset(&xs, 0xab, sizeof xs);
    xs.s.size = 0;
    assert_int_equal(ferry_moe_slots_stats_get(s, &xs.s), -EINVAL);
    assert_int_equal(ferry_moe_slots_stats_get(s, NULL), -EINVAL);
    xs.s.size = offsetof(ferry_moe_slots_stats, warm_plans);
    FT_ASSERT_OK(ferry_moe_slots_stats_get(s, &xs.s));
    assert_int_equal(xs.s.plans, 1);
    for (size_t i = offsetof(ferry_moe_slots_stats, warm_plans); i < sizeof xs; i++)
        assert_int_equal(xs.b[i], 0xab);
    ferry_moe_slots_destroy(s);
    ferry_moe_rows_destroy(rows);
    assert_int_equal(f.destroys, 1);
}

/* moe.h slots_create: "Takes ownership of ctx (ops->destroy is called on
 * it ... on failure here when ops->size covers destroy; nothing past
 * ops->size is read). Errors: -EINVAL (the geometry ...; ops->size below
 * this header's sizeof; ops without write_slot, copy_slot or flush)" */
static void a_refused_executor_still_releases_its_context(void **state)
{
    (void)state;
    ferry_moe_geometry g = ft_moe_geom(2, 8, 4, W);
    struct {
        size_t size;
        int drop; /* 1 write_slot, 2 copy_slot, 3 flush */
        int bad_geometry, destroys;
        const char *what;
    } cases[] = {
        {sizeof(ferry_moe_slot_device_ops), 1, 0, 1, "no write_slot"},
        {sizeof(ferry_moe_slot_device_ops), 2, 0, 1, "no copy_slot"},
        {sizeof(ferry_moe_slot_device_ops), 3, 0, 1, "no flush"},
        {sizeof(ferry_moe_slot_device_ops), 0, 1, 1, "num_layers"},
        {offsetof(ferry_moe_slot_device_ops, flush_prefetch), 0, 0, 1, "size"},
        {offsetof(ferry_moe_slot_device_ops, destroy), 0, 0, 0, "size"},
        {0, 0, 0, 0, "size"},
    };
    for (size_t i = 0; i < LEN(cases); i++) {
        ferry_moe_slot_device_ops ops = fake_ops;
        ops.size = cases[i].size;
        if (cases[i].drop == 1)
            ops.write_slot = NULL;
        if (cases[i].drop == 2)
            ops.copy_slot = NULL;
        if (cases[i].drop == 3)
            ops.flush = NULL;
        ferry_moe_geometry gg = g;
        if (cases[i].bad_geometry)
            gg.num_layers = 0;
        fake f;
        memset(&f, 0, sizeof f);
        ferry_moe_slots *s = (ferry_moe_slots *)0x1;
        int rc = ferry_moe_slots_create(&gg, &ops, &f, &s);
        if (rc != -EINVAL || !strstr(ferry_last_error(), cases[i].what))
            fail_msg("case %zu: %d '%s', want -EINVAL naming %s", i, rc, ferry_last_error(),
                     cases[i].what);
        assert_ptr_equal(s, (ferry_moe_slots *)0x1);
        if (f.destroys != cases[i].destroys)
            fail_msg("case %zu: ctx destroyed %d times, want %d", i, f.destroys,
                     cases[i].destroys);
    }
    fake f;
    memset(&f, 0, sizeof f);
    ferry_moe_slots *s = (ferry_moe_slots *)0x1;
    assert_int_equal(ferry_moe_slots_create(&g, NULL, &f, &s), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "no device ops"));
    assert_int_equal(ferry_moe_slots_create(NULL, &fake_ops, &f, &s), -EINVAL);
    assert_int_equal(f.destroys, 1);
    f.destroys = 0;
    assert_int_equal(ferry_moe_slots_create(&g, &fake_ops, &f, NULL), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "no out"));
    assert_int_equal(f.destroys, 1);
    /* and one that opens hands the same context back, and frees it once */
    f.destroys = 0;
    FT_ASSERT_OK(ferry_moe_slots_create(&g, &fake_ops, &f, &s));
    assert_ptr_equal(ferry_moe_slots_device(s), &f);
    ferry_moe_slots_destroy(s);
    assert_int_equal(f.destroys, 1);
}

/* moe.h executor: occupant FERRY_MOE_NONE when unknown (out of range too),
 * invalidate refuses a slot out of range; a gather refuses a destination
 * named twice or one that is also a source, nothing moving; no pending
 * prefetch: prefetch_finish returns 0 at once */
static void executor_slot_calls_refuse_what_is_out_of_range(void **state)
{
    (void)state;
    ferry_moe_geometry g = ft_moe_geom(4, 8, 4, W);
    fake f;
    memset(&f, 0, sizeof f);
    for (uint32_t l = 0; l < 4; l++)
        for (uint32_t e = 0; e < 8; e++)
            memset(rows_mem[l][e], (int)(l * 8 + e + 1), W);
    ferry_moe_slots *s = NULL;
    FT_ASSERT_OK(ferry_moe_slots_create(&g, &fake_ops, &f, &s));
    ferry_moe_rows *rows = NULL;
    FT_ASSERT_OK(ferry_moe_rows_fn(&g, row_of, NULL, &rows));
    const uint32_t d[2] = {0, 1}, r[2] = {2, 3};
    ferry_moe_copy_plan plan = {1, 2, d, r};
    assert_int_equal(ferry_moe_slots_apply(s, &plan, rows, NULL, NULL), 2);
    assert_int_equal(ferry_moe_slots_occupant(s, 0), 8 + 2);
    assert_int_equal(ferry_moe_slots_occupant(s, 4), FERRY_MOE_NONE);
    assert_int_equal(ferry_moe_slots_occupant(s, UINT32_MAX), FERRY_MOE_NONE);
    assert_int_equal(ferry_moe_slots_invalidate(s, 4), -EINVAL);
    assert_non_null(strstr(ferry_moe_slots_last_error(s), "slot 4"));
    int before = f.copies + f.writes + f.flushes;
    const uint32_t dd[2] = {2, 2}, ss[2] = {0, 1};
    ferry_moe_gather_plan twice = {2, dd, ss};
    assert_int_equal(ferry_moe_slots_gather(s, &twice, NULL, NULL), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "slot 2"));
    const uint32_t dd2[2] = {2, 0}, ss2[2] = {0, 1};
    ferry_moe_gather_plan chain = {2, dd2, ss2};
    assert_int_equal(ferry_moe_slots_gather(s, &chain, NULL, NULL), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "slot 0"));
    ferry_moe_gather_plan none = {1, NULL, NULL};
    assert_int_equal(ferry_moe_slots_gather(s, &none, NULL, NULL), -EINVAL);
    assert_int_equal(ferry_moe_slots_gather(s, NULL, NULL, NULL), -EINVAL);
    assert_int_equal(ferry_moe_slots_apply(s, NULL, rows, NULL, NULL), -EINVAL);
    assert_int_equal(f.copies + f.writes + f.flushes, before);
    assert_int_equal(ferry_moe_slots_occupant(s, 0), 8 + 2);
    assert_int_equal(ferry_moe_slots_occupant(s, 2), FERRY_MOE_NONE);
    uint32_t unk[4], nu = 99;
    assert_int_equal(ferry_moe_slots_prefetch_finish(s, unk, &nu), 0);
    assert_int_equal(nu, 0);
    FT_ASSERT_OK(ferry_moe_slots_invalidate(s, 0));
    assert_int_equal(ferry_moe_slots_occupant(s, 0), FERRY_MOE_NONE);
    ferry_moe_slots_destroy(s);
    ferry_moe_rows_destroy(rows);
}

/* moe.h rows sources: rows_host -EINVAL for a NULL bank, rows_fn for a
 * NULL fn; rows_file -errno when the file cannot be opened and
 * FERRY_EMISMATCH for one too short for the geometry; a row fn that has no
 * such row fails the plan before anything moves */
static void rows_sources_refuse_what_they_cannot_serve(void **state)
{
    (void)state;
    ferry_moe_geometry g = ft_moe_geom(4, 8, 4, W);
    g.banks = 2;
    g.row_bytes[1] = W;
    static uint8_t bank0[4 * 8 * W];
    void *base[2] = {bank0, NULL};
    ferry_moe_rows *r = (ferry_moe_rows *)0x1;
    assert_int_equal(ferry_moe_rows_host(&g, base, NULL, 0, &r), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "1"));
    assert_int_equal(ferry_moe_rows_host(&g, NULL, NULL, 0, &r), -EINVAL);
    assert_int_equal(ferry_moe_rows_fn(&g, NULL, NULL, &r), -EINVAL);
    assert_ptr_equal(r, (ferry_moe_rows *)0x1);
    g.banks = 1;
    assert_int_equal(ferry_moe_rows_class(NULL, 0), -EINVAL);

    ferry_io_options io_o = FERRY_IO_OPTIONS_INIT;
    io_o.engine = "posix";
    io_o.depth = 1;
    ferry_io *io = NULL;
    FT_ASSERT_OK(ferry_io_open(&io_o, &io));
    char dir[256], path[300];
    assert_non_null(ft_tmpdir(dir, sizeof dir));
    snprintf(path, sizeof path, "%s/missing.bin", dir);
    assert_int_equal(ferry_moe_rows_file(&g, io, path, NULL, &r), -ENOENT);
    assert_non_null(strstr(ferry_last_error(), "missing.bin"));
    snprintf(path, sizeof path, "%s/short.bin", dir);
    int fd = open(path, O_CREAT | O_WRONLY, 0600);
    assert_true(fd >= 0);
    assert_int_equal(ftruncate(fd, 4 * 8 * W - 1), 0);
    close(fd);
    assert_int_equal(ferry_moe_rows_file(&g, io, path, NULL, &r), FERRY_EMISMATCH);
    assert_non_null(strstr(ferry_last_error(), "2048"));
    assert_ptr_equal(r, (ferry_moe_rows *)0x1);
    assert_int_equal(ferry_moe_rows_file(&g, NULL, path, NULL, &r), -EINVAL);
    assert_int_equal(ferry_moe_rows_file(&g, io, NULL, NULL, &r), -EINVAL);
    ferry_io_close(io);
    ft_rmtree(dir);

    /* a row the fn does not have: refused whole, nothing moves */
    fake f;
    memset(&f, 0, sizeof f);
    ferry_moe_geometry g5 = ft_moe_geom(5, 8, 4, W); /* row_of has 4 layers */
    ferry_moe_slots *s = NULL;
    FT_ASSERT_OK(ferry_moe_slots_create(&g5, &fake_ops, &f, &s));
    FT_ASSERT_OK(ferry_moe_rows_fn(&g5, row_of, NULL, &r));
    const uint32_t d[2] = {0, 1}, rr[2] = {0, 1};
    ferry_moe_copy_plan plan = {4, 2, d, rr};
    assert_int_equal(ferry_moe_slots_apply(s, &plan, r, NULL, NULL), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "row 0"));
    assert_int_equal(f.writes + f.flushes, 0);
    ferry_moe_slots_destroy(s);
    ferry_moe_rows_destroy(r);
}

/* moe.h replay: "Errors as ferry_moe_planner_create" (an unknown policy,
 * slots 0), and belady replays with the trace as its own oracle */
static void replay_refuses_as_the_planner_does(void **state)
{
    (void)state;
    ferry_moe_trace *t = small_trace(2, 8, 8);
    ferry_moe_replay_result r;
    assert_int_equal(ferry_moe_replay(t, "mru", 4, 0, &r), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "mru"));
    assert_int_equal(ferry_moe_replay(t, "lru", 0, 0, &r), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "slots 0"));
    assert_int_equal(ferry_moe_replay(t, "lru", 4, 0, NULL), -EINVAL);
    FT_ASSERT_OK(ferry_moe_replay(t, "belady", 4, 0, &r));
    assert_string_equal(r.policy, "belady");
    assert_int_equal(r.steps, 16);
    assert_int_equal(r.hits + r.misses, 16);
    ferry_moe_replay_result l;
    FT_ASSERT_OK(ferry_moe_replay(t, NULL, 4, 0, &l));
    assert_string_equal(l.policy, "auto");
    assert_true(l.misses >= r.misses);
    ferry_moe_trace_destroy(t);
}

/* moe.h: "Traces are immutable after loading and may be read from several
 * threads": replays and timelines of one trace on several threads at once
 * give what one thread gives */
typedef struct reader {
    const ferry_moe_trace *t;
    ferry_moe_replay_result r;
    ferry_moe_sim_result sr;
    int rc;
} reader;

static void *read_trace(void *arg)
{
    reader *x = arg;
    x->rc = ferry_moe_replay(x->t, "lru", 64, 0, &x->r);
    ferry_moe_sim_options so = FERRY_MOE_SIM_OPTIONS_INIT;
    so.slots = 64;
    so.expert_bytes = 1 << 20;
    so.hint_steps = 1;
    x->sr = (ferry_moe_sim_result)FERRY_MOE_SIM_RESULT_INIT;
    if (x->rc == 0)
        x->rc = ferry_moe_sim(x->t, &so, &x->sr);
    return NULL;
}

static void a_trace_is_read_from_several_threads_at_once(void **state)
{
    (void)state;
    ferry_moe_gen_options go = FERRY_MOE_GEN_OPTIONS_INIT;
    go.model = "small";
    go.tokens = 64;
    ferry_moe_trace *t = NULL;
    FT_ASSERT_OK(ferry_moe_trace_generate(&go, &t));
    reader one = {.t = t};
    read_trace(&one);
    FT_ASSERT_OK(one.rc);
    reader many[4];
    pthread_t th[4];
    for (int i = 0; i < 4; i++) {
        many[i] = (reader){.t = t};
        assert_int_equal(pthread_create(&th[i], NULL, read_trace, &many[i]), 0);
    }
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        FT_ASSERT_OK(many[i].rc);
        assert_int_equal(many[i].r.misses, one.r.misses);
        assert_int_equal(many[i].sr.misses, one.sr.misses);
        assert_true(many[i].sr.total_us == one.sr.total_us);
    }
    ferry_moe_trace_destroy(t);
}

/* moe.h generator: FERRY_MOE_GEN_OPTIONS_MIN_SIZE (up to top_k) is taken
 * with repeat_next then 0 and not read; repeat_next outside 0.01..0.9
 * (0 keeps the preset's) is -EINVAL naming it and its range */
static void gen_repeat_next_and_older_options_are_checked(void **state)
{
    (void)state;
    ferry_moe_gen_options o = FERRY_MOE_GEN_OPTIONS_INIT;
    o.model = "small";
    o.tokens = 16;
    ferry_moe_trace *a = NULL, *b = NULL;
    FT_ASSERT_OK(ferry_moe_trace_generate(&o, &a));
    o.size = FERRY_MOE_GEN_OPTIONS_MIN_SIZE;
    o.repeat_next = 5.0; /* past the size: not read */
    FT_ASSERT_OK(ferry_moe_trace_generate(&o, &b));
    assert_int_equal(ferry_moe_trace_steps(a), ferry_moe_trace_steps(b));
    for (size_t i = 0; i < ferry_moe_trace_steps(a); i++) {
        const uint32_t *ea, *eb;
        uint32_t na, nb;
        FT_ASSERT_OK(ferry_moe_trace_step(a, i, NULL, NULL, &ea, &na));
        FT_ASSERT_OK(ferry_moe_trace_step(b, i, NULL, NULL, &eb, &nb));
        assert_int_equal(na, nb);
        assert_memory_equal(ea, eb, na * sizeof *ea);
    }
    ferry_moe_trace_destroy(a);
    ferry_moe_trace_destroy(b);
    const double bad[] = {0.005, 0.95, -0.5, 1.0 / 0.0, 0.0 / 0.0};
    for (size_t i = 0; i < LEN(bad); i++) {
        o = (ferry_moe_gen_options)FERRY_MOE_GEN_OPTIONS_INIT;
        o.model = "small";
        o.tokens = 16;
        o.repeat_next = bad[i];
        ferry_moe_trace *t = (ferry_moe_trace *)0x1;
        assert_int_equal(ferry_moe_trace_generate(&o, &t), -EINVAL);
        if (!strstr(ferry_last_error(), "repeat_next") || !strstr(ferry_last_error(), "0.9"))
            fail_msg("repeat_next %g: '%s' names neither it nor its range", bad[i],
                     ferry_last_error());
        assert_ptr_equal(t, (ferry_moe_trace *)0x1);
    }
    ferry_moe_trace *t = (ferry_moe_trace *)0x1;
    o = (ferry_moe_gen_options)FERRY_MOE_GEN_OPTIONS_INIT;
    assert_int_equal(ferry_moe_trace_generate(&o, NULL), -EINVAL);
    assert_int_equal(ferry_moe_trace_generate(NULL, &t), -EINVAL);
    assert_ptr_equal(t, (ferry_moe_trace *)0x1);
}

/* moe.h trace_parse: "len bytes; need not be NUL-terminated"; "Blank
 * lines are skipped" */
static void a_parse_reads_len_bytes_and_skips_blank_lines(void **state)
{
    (void)state;
    static const char text[] =
        "{\"model\":\"m\",\"num_layers\":1,\"num_experts\":4,\"top_k\":1}\n"
        "\n   \n"
        "{\"token\":0,\"layer\":0,\"experts\":[1]}\n"
        "\n"
        "{\"token\":1,\"layer\":0,\"experts\":[2]}";
    const size_t len = strlen(text);
    char *buf = malloc(len); /* no NUL: ASan sees a read past it */
    memcpy(buf, text, len);
    ferry_moe_trace *t = NULL;
    FT_ASSERT_OK(ferry_moe_trace_parse(buf, len, &t));
    assert_int_equal(ferry_moe_trace_steps(t), 2);
    ferry_moe_trace_destroy(t);
    /* a len that ends inside the last record reads only that far */
    const size_t cut = strstr(text, "{\"token\":1") - text + 10;
    assert_int_equal(ferry_moe_trace_parse(buf, cut, &t), FERRY_EPARSE);
    assert_non_null(strstr(ferry_last_error(), "line 6"));
    free(buf);
}

/* moe.h gather: "A pending prefetch is finished first and failures are
 * reported, as for apply": a prefetch whose rows did not land fails the
 * gather with its error, lists its slots and moves nothing of the gather */
static int pf_fail(void *c)
{
    (void)c;
    return -EIO;
}

static void a_gather_reports_the_prefetch_it_finished(void **state)
{
    (void)state;
    ferry_moe_geometry g = ft_moe_geom(4, 8, 8, W);
    ferry_moe_slot_device_ops ops = fake_ops;
    ops.flush_prefetch = pf_fail;
    fake f;
    memset(&f, 0, sizeof f);
    ferry_moe_slots *s = NULL;
    FT_ASSERT_OK(ferry_moe_slots_create(&g, &ops, &f, &s));
    ferry_moe_rows *rows = NULL;
    FT_ASSERT_OK(ferry_moe_rows_fn(&g, row_of, NULL, &rows));
    const uint32_t d[2] = {0, 1}, r[2] = {2, 3};
    ferry_moe_copy_plan plan = {1, 2, d, r};
    assert_int_equal(ferry_moe_slots_apply(s, &plan, rows, NULL, NULL), 2);
    const uint32_t pd[2] = {4, 5}, pr[2] = {6, 7};
    ferry_moe_copy_plan pre = {2, 2, pd, pr};
    uint32_t unk[8], nu = 0;
    assert_int_equal(ferry_moe_slots_prefetch_start(s, &pre, rows, unk, &nu), 2);
    const int copies = f.copies;
    const uint32_t gd = 7, gs = 0;
    ferry_moe_gather_plan gp = {1, &gd, &gs};
    assert_int_equal(ferry_moe_slots_gather(s, &gp, unk, &nu), -EIO);
    assert_int_equal(nu, 2);
    assert_true((unk[0] == 4 && unk[1] == 5) || (unk[0] == 5 && unk[1] == 4));
    assert_int_equal(f.copies, copies);
    assert_int_equal(ferry_moe_slots_occupant(s, 7), FERRY_MOE_NONE);
    assert_int_equal(ferry_moe_slots_occupant(s, 4), FERRY_MOE_NONE);
    /* and again, once forgotten, it goes through */
    assert_int_equal(ferry_moe_slots_gather(s, &gp, unk, &nu), 1);
    assert_int_equal(nu, 0);
    assert_int_equal(ferry_moe_slots_occupant(s, 7), 8 + 2);
    ferry_moe_slots_stats st = FERRY_MOE_SLOTS_STATS_INIT;
    FT_ASSERT_OK(ferry_moe_slots_stats_get(s, &st));
    assert_int_equal(st.device_bytes, W);
    assert_int_equal(st.gather_plans, 1);
    ferry_moe_slots_destroy(s);
    ferry_moe_rows_destroy(rows);
}

/* moe.h device slots: -EINVAL for what is missing; a slot pointer of a
 * context that is not there is 0 */
static void device_slots_refuse_what_is_missing(void **state)
{
    (void)state;
    ferry_device_options o = FERRY_DEVICE_OPTIONS_INIT;
    o.backend = "host";
    ferry_device *dev = NULL;
    FT_ASSERT_OK(ferry_device_open(&o, &dev));
    ferry_moe_geometry g = ft_moe_geom(2, 4, 4, W);
    const ferry_moe_slot_device_ops *ops = NULL;
    void *ctx = NULL;
    assert_int_equal(ferry_moe_device_slots_open(NULL, &g, &ops, &ctx), -EINVAL);
    assert_int_equal(ferry_moe_device_slots_open(dev, NULL, &ops, &ctx), -EINVAL);
    assert_int_equal(ferry_moe_device_slots_open(dev, &g, NULL, &ctx), -EINVAL);
    assert_int_equal(ferry_moe_device_slots_open(dev, &g, &ops, NULL), -EINVAL);
    assert_null(ctx);
    assert_int_equal(ferry_moe_device_slot_ptr(NULL, 0, 0), 0);
    FT_ASSERT_OK(ferry_moe_device_slots_open(dev, &g, &ops, &ctx));
    assert_true(ferry_moe_device_slot_ptr(ctx, 0, 3) != 0);
    assert_int_equal(ferry_moe_device_slot_ptr(ctx, 0, 4), 0);
    ops->destroy(ctx);
    ferry_device_close(dev);
}

/* sizes past this header's: a geometry's (its first version is this one)
 * is refused; a newer header's slot device ops are taken (only those
 * below this header's sizeof are refused); a newer header's stats are
 * written as far as this header's sizeof, no further */
typedef struct newer_ops {
    ferry_moe_slot_device_ops ops;
    void (*later)(void *ctx);
} newer_ops;

static void sizes_past_this_headers_are_handled(void **state)
{
    (void)state;
    ferry_moe_geometry g = ft_moe_geom(2, 8, 4, W);
    g.size = sizeof g + 8;
    fake f;
    memset(&f, 0, sizeof f);
    ferry_moe_slots *s = (ferry_moe_slots *)0x1;
    assert_int_equal(ferry_moe_slots_create(&g, &fake_ops, &f, &s), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "geometry size"));
    ferry_moe_rows *r = (ferry_moe_rows *)0x1;
    assert_int_equal(ferry_moe_rows_fn(&g, row_of, NULL, &r), -EINVAL);
    assert_ptr_equal(r, (ferry_moe_rows *)0x1);
    g.size = sizeof g;

    newer_ops n;
    n.ops = fake_ops;
    n.ops.size = sizeof n;
    n.later = NULL;
    memset(&f, 0, sizeof f);
    FT_ASSERT_OK(ferry_moe_slots_create(&g, &n.ops, &f, &s));
    FT_ASSERT_OK(ferry_moe_rows_fn(&g, row_of, NULL, &r));
    const uint32_t d = 1, row = 2;
    ferry_moe_copy_plan plan = {0, 1, &d, &row};
    assert_int_equal(ferry_moe_slots_apply(s, &plan, r, NULL, NULL), 1);
    union {
        ferry_moe_slots_stats s;
        unsigned char b[sizeof(ferry_moe_slots_stats) + 32];
    } xs;
    memset(&xs, 0xab, sizeof xs);
    xs.s.size = sizeof xs;
    int rc = ferry_moe_slots_stats_get(s, &xs.s);
    FT_ASSERT_OK(rc);
    assert_int_equal(xs.s.size, sizeof xs);
    assert_int_equal(xs.s.host_rows, 1);
    for (size_t i = sizeof(ferry_moe_slots_stats); i < sizeof xs; i++)
        assert_int_equal(xs.b[i], 0xab);
    ferry_moe_slots_destroy(s);
    ferry_moe_rows_destroy(r);
    assert_int_equal(f.destroys, 1);

    ferry_moe_planner *p = ft_moe_mk(1, 4, 4, "lru", NULL);
    union {
        ferry_moe_planner_stats s;
        unsigned char b[sizeof(ferry_moe_planner_stats) + 32];
    } ps;
    memset(&ps, 0xab, sizeof ps);
    ps.s.size = sizeof ps;
    rc = ferry_moe_planner_stats_get(p, &ps.s);
    FT_ASSERT_OK(rc);
    for (size_t i = sizeof(ferry_moe_planner_stats); i < sizeof ps; i++)
        assert_int_equal(ps.b[i], 0xab);
    union {
        ferry_moe_hint_stats s;
        unsigned char b[sizeof(ferry_moe_hint_stats) + 32];
    } hs;
    memset(&hs, 0xab, sizeof hs);
    hs.s.size = sizeof hs;
    rc = ferry_moe_planner_hint_stats_get(p, &hs.s);
    FT_ASSERT_OK(rc);
    for (size_t i = sizeof(ferry_moe_hint_stats); i < sizeof hs; i++)
        assert_int_equal(hs.b[i], 0xab);
    ferry_moe_planner_destroy(p);
}

/* a NULL executor is answered -EINVAL by every call that takes one */
static void a_null_executor_is_answered_not_dereferenced(void **state)
{
    (void)state;
    ferry_moe_geometry g = ft_moe_geom(2, 8, 4, W);
    ferry_moe_rows *r = NULL;
    FT_ASSERT_OK(ferry_moe_rows_fn(&g, row_of, NULL, &r));
    const uint32_t d = 1, row = 2;
    ferry_moe_copy_plan plan = {0, 1, &d, &row};
    ferry_moe_gather_plan gp = {1, &d, &row};
    uint32_t unk[4], nu = 7;
    assert_int_equal(ferry_moe_slots_apply(NULL, &plan, r, unk, &nu), -EINVAL);
    assert_int_equal(ferry_moe_slots_gather(NULL, &gp, unk, &nu), -EINVAL);
    assert_int_equal(ferry_moe_slots_prefetch_start(NULL, &plan, r, unk, &nu), -EINVAL);
    assert_int_equal(ferry_moe_slots_prefetch_finish(NULL, unk, &nu), -EINVAL);
    ferry_moe_planner *p = ft_moe_mk(2, 8, 4, "lru", NULL);
    assert_int_equal(ferry_moe_check(p, NULL), -EINVAL);
    assert_int_equal(ferry_moe_planner_hint(NULL, 0, 1, &d, 1, 0.5), -EINVAL);
    assert_int_equal(ferry_moe_planner_hint_stats_get(NULL, NULL), -EINVAL);
    assert_int_equal(ferry_moe_planner_forget(NULL, 0), -EINVAL);
    assert_int_equal(ferry_moe_planner_resize(NULL, 4), -EINVAL);
    assert_int_equal(ferry_moe_planner_prefetch(NULL, 0, &d, 1, NULL), -EINVAL);
    assert_int_equal(ferry_moe_planner_prefill(NULL, 0, NULL, NULL), -EINVAL);
    assert_int_equal(ferry_moe_planner_stream_begin(NULL, 0, &d, 1, NULL), -EINVAL);
    ferry_moe_planner_destroy(p);
    ferry_moe_rows_destroy(r);
}

/* moe.h slots_create takes ownership of ctx, not of the ops table: an
 * engine may build its table on a stack frame that ends, or reuse the
 * memory, once the executor is made */
static int wrong_calls;

static int wrong_write(void *c, uint32_t bank, uint32_t slot, const void *src, size_t n)
{
    (void)c, (void)bank, (void)slot, (void)src, (void)n;
    wrong_calls++;
    return -EIO;
}

static int wrong_flush(void *c)
{
    (void)c;
    wrong_calls++;
    return -EIO;
}

static void wrong_destroy(void *c)
{
    (void)c;
    wrong_calls++;
}

static void the_ops_table_is_the_callers_after_create(void **state)
{
    (void)state;
    ferry_moe_geometry g = ft_moe_geom(2, 8, 4, W);
    ferry_moe_slot_device_ops *ops = malloc(sizeof *ops);
    *ops = fake_ops;
    fake f;
    memset(&f, 0, sizeof f);
    ferry_moe_slots *s = NULL;
    FT_ASSERT_OK(ferry_moe_slots_create(&g, ops, &f, &s));
    /* the caller's memory now holds something else */
    ops->write_slot = wrong_write;
    ops->flush = wrong_flush;
    ops->destroy = wrong_destroy;
    ops->size = 1;
    wrong_calls = 0;
    ferry_moe_rows *r = NULL;
    FT_ASSERT_OK(ferry_moe_rows_fn(&g, row_of, NULL, &r));
    const uint32_t d = 1, row = 2;
    ferry_moe_copy_plan plan = {0, 1, &d, &row};
    assert_int_equal(ferry_moe_slots_apply(s, &plan, r, NULL, NULL), 1);
    assert_int_equal(f.writes, 1);
    free(ops); /* ASan: nothing reads it from here on */
    assert_int_equal(ferry_moe_slots_apply(s, &plan, r, NULL, NULL), 1);
    ferry_moe_slots_destroy(s);
    ferry_moe_rows_destroy(r);
    assert_int_equal(wrong_calls, 0);
    assert_int_equal(f.writes, 2);
    assert_int_equal(f.destroys, 1);
}

/* moe.h hint: "Returns the distinct experts hinted"; ensure: "Duplicate
 * routes are collapsed" in what prefetch plans too */
static void duplicates_count_once(void **state)
{
    (void)state;
    ferry_moe_planner *p = ft_moe_mk(2, 8, 8, "lru", NULL);
    const uint32_t dup[5] = {3, 3, 5, 3, 5};
    assert_int_equal(ferry_moe_planner_hint(p, 1, 2, dup, 5, 0.9), 2);
    ferry_moe_hint_stats hs = FERRY_MOE_HINT_STATS_INIT;
    FT_ASSERT_OK(ferry_moe_planner_hint_stats_get(p, &hs));
    assert_int_equal(hs.hinted, 2);
    assert_int_equal(hs.live, 2);
    ferry_moe_copy_plan plan;
    assert_int_equal(ferry_moe_planner_prefetch(p, 0, dup, 5, &plan), 2);
    assert_int_equal(plan.n, 2);
    assert_int_not_equal(plan.dst_slots[0], plan.dst_slots[1]);
    ferry_moe_planner_destroy(p);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(every_listed_name_is_taken_and_described),
        cmocka_unit_test(null_objects_are_answered_not_dereferenced),
        cmocka_unit_test(out_of_range_steps_are_answered),
        cmocka_unit_test(trace_options_are_checked),
        cmocka_unit_test(trace_shapes_and_appends_are_range_checked),
        cmocka_unit_test(save_refuses_empty_traces_and_reports_io),
        cmocka_unit_test(planner_options_beyond_the_shape_are_refused),
        cmocka_unit_test(planner_slot_calls_refuse_what_is_out_of_range),
        cmocka_unit_test(stats_are_written_only_as_far_as_their_size),
        cmocka_unit_test(a_refused_executor_still_releases_its_context),
        cmocka_unit_test(executor_slot_calls_refuse_what_is_out_of_range),
        cmocka_unit_test(rows_sources_refuse_what_they_cannot_serve),
        cmocka_unit_test(replay_refuses_as_the_planner_does),
        cmocka_unit_test(a_trace_is_read_from_several_threads_at_once),
        cmocka_unit_test(gen_repeat_next_and_older_options_are_checked),
        cmocka_unit_test(a_parse_reads_len_bytes_and_skips_blank_lines),
        cmocka_unit_test(a_gather_reports_the_prefetch_it_finished),
        cmocka_unit_test(device_slots_refuse_what_is_missing),
        cmocka_unit_test(sizes_past_this_headers_are_handled),
        cmocka_unit_test(a_null_executor_is_answered_not_dereferenced),
        cmocka_unit_test(the_ops_table_is_the_callers_after_create),
        cmocka_unit_test(duplicates_count_once),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
