/*
 * test_moe_capture.c - engine route captures read right: the shape from
 * the records, sparse logged layers kept sparse, one stage, multi-token
 * records as one pass per layer in execution order, counts-only files
 * refused, and bounded tables on hostile input.
 *
 * The records are those of a route logger at the MoE layer of a 40-layer,
 * 256-expert, top-8 model that logged only some layers.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ferry_test.h"
#include "moe/moe_internal.h"

/* a growable text buffer */
typedef struct sbuf {
    char *s;
    size_t n, cap;
} sbuf;

static void sb_add(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_add(sbuf *b, const char *fmt, ...)
{
    va_list ap;
    for (;;) {
        va_start(ap, fmt);
        int k = vsnprintf(b->s ? b->s + b->n : NULL, b->s ? b->cap - b->n : 0, fmt, ap);
        va_end(ap);
        assert_true(k >= 0);
        if (b->s && b->n + (size_t)k < b->cap) {
            b->n += (size_t)k;
            return;
        }
        b->cap = (b->cap + (size_t)k + 1) * 2;
        b->s = realloc(b->s, b->cap);
        assert_non_null(b->s);
    }
}

/* one record: stage (NULL: none), model layer, T token lists of k ids */
static void rec(sbuf *b, const char *stage, uint32_t layer, uint32_t T, uint32_t k, uint32_t seed)
{
    sb_add(b, "{");
    if (stage)
        sb_add(b, "\"stage\":\"%s\",", stage);
    sb_add(b, "\"layer\":\"model.layers.%u.mlp.experts\",\"num_experts\":256,\"top_k\":8,"
              "\"topk_ids\":[", layer);
    for (uint32_t t = 0; t < T; t++) {
        sb_add(b, "%s[", t ? "," : "");
        for (uint32_t j = 0; j < k; j++) /* never reaches 254 or 255 */
            sb_add(b, "%s%u", j ? "," : "", (seed * 31 + t * 7 + j * 29 + layer) % 254);
        sb_add(b, "]");
    }
    sb_add(b, "]}\n");
}

static ferry_moe_trace *parse_ok(const sbuf *b, const char *stage)
{
    ferry_moe_trace_options o = FERRY_MOE_TRACE_OPTIONS_INIT;
    o.stage = stage;
    ferry_moe_trace *t = NULL;
    FT_ASSERT_OK(ferry_moe_trace_parse_opts(b->s, b->n, &o, &t));
    return t;
}

static void parse_fails(const sbuf *b, const char *stage, const char *n1, const char *n2)
{
    ferry_moe_trace_options o = FERRY_MOE_TRACE_OPTIONS_INIT;
    o.stage = stage;
    ferry_moe_trace *t = NULL;
    int rc = ferry_moe_trace_parse_opts(b->s, b->n, &o, &t);
    if (rc != FERRY_EPARSE)
        fail_msg("parse -> %d, expected FERRY_EPARSE", rc);
    assert_null(t);
    const char *msg = ferry_last_error();
    if (!strstr(msg, n1) || (n2 && !strstr(msg, n2)))
        fail_msg("message '%s' lacks '%s' / '%s'", msg, n1, n2 ? n2 : "");
}

static void decode_capture(sbuf *b, const char *stage, uint32_t tokens)
{
    static const uint32_t logged[] = {3, 17, 38};
    for (uint32_t tk = 0; tk < tokens; tk++)
        for (int i = 0; i < 3; i++)
            rec(b, stage, logged[i], 1, 8, tk);
}

static void shape_comes_from_the_records_and_sparse_layers_stay_sparse(void **state)
{
    (void)state;
    sbuf b = {0};
    decode_capture(&b, "apply", 20);
    ferry_moe_trace *t = parse_ok(&b, NULL);
    const ferry_moe_model *m = ferry_moe_trace_model(t);
    /* the ids never reach 254, yet the model has 256; 3 layers were logged
     * of 40 and the largest is 38 */
    assert_int_equal(m->num_experts, 256);
    assert_int_equal(m->top_k, 8);
    assert_int_equal(m->num_layers, 3);
    assert_int_equal(ferry_moe_trace_layer_id(t, 0), 3);
    assert_int_equal(ferry_moe_trace_layer_id(t, 1), 17);
    assert_int_equal(ferry_moe_trace_layer_id(t, 2), 38);
    assert_int_equal(ferry_moe_trace_layer_id(t, 3), FERRY_MOE_NONE);
    assert_string_equal(ferry_moe_trace_stage(t), "apply");
    assert_int_equal(ferry_moe_trace_steps(t), 60);
    assert_int_equal(ferry_moe_trace_tokens(t), 20);
    for (size_t i = 0; i < 60; i++) {
        uint32_t tok, layer, n;
        const uint32_t *ex;
        FT_ASSERT_OK(ferry_moe_trace_step(t, i, &tok, &layer, &ex, &n));
        assert_int_equal(tok, i / 3);
        assert_int_equal(layer, i % 3);
        assert_int_equal(n, 8);
    }
    ferry_moe_trace_destroy(t);
    free(b.s);
}

static void a_mixed_capture_reads_one_stage(void **state)
{
    (void)state;
    /* the router and the apply stage both logged: each route twice */
    sbuf b = {0};
    for (uint32_t tk = 0; tk < 10; tk++) {
        rec(&b, "router", 3, 1, 8, tk);
        rec(&b, "apply", 3, 1, 8, tk);
        rec(&b, "router", 17, 1, 8, tk + 100);
        rec(&b, "apply", 17, 1, 8, tk + 100);
    }
    ferry_moe_trace *t = parse_ok(&b, NULL); /* default: the apply stage */
    assert_int_equal(ferry_moe_trace_steps(t), 20);
    assert_int_equal(ferry_moe_trace_tokens(t), 10);
    assert_string_equal(ferry_moe_trace_stage(t), "apply");
    ferry_moe_trace_destroy(t);
    t = parse_ok(&b, "router");
    assert_int_equal(ferry_moe_trace_steps(t), 20);
    assert_string_equal(ferry_moe_trace_stage(t), "router");
    ferry_moe_trace_destroy(t);
    parse_fails(&b, "gate", "no records of stage 'gate'", "'router' (20 records)");
    free(b.s);

    /* several stages and none that applies experts: refused, not summed */
    sbuf c = {0};
    rec(&c, "router", 3, 1, 8, 1);
    rec(&c, "gate", 3, 1, 8, 1);
    parse_fails(&c, NULL, "several stages", "--stage");
    ferry_moe_trace *r = parse_ok(&c, "gate");
    assert_int_equal(ferry_moe_trace_steps(r), 1);
    ferry_moe_trace_destroy(r);
    free(c.s);

    /* a file of one stage, whatever its name, is that stage */
    sbuf d = {0};
    rec(&d, "router", 3, 1, 8, 1);
    rec(&d, "router", 3, 1, 8, 2);
    r = parse_ok(&d, NULL);
    assert_int_equal(ferry_moe_trace_steps(r), 2);
    assert_string_equal(ferry_moe_trace_stage(r), "router");
    ferry_moe_trace_destroy(r);
    free(d.s);
}

static void multi_token_records_run_layer_by_layer(void **state)
{
    (void)state;
    /* a prefill batch of 4 tokens at both logged layers, then 2 decode
     * passes: the engine runs the batch layer by layer */
    sbuf b = {0};
    sb_add(&b, "{\"stage\":\"apply\",\"layer\":\"model.layers.5.mlp.experts\",\"num_experts\":16,"
               "\"top_k\":2,\"topk_ids\":[[1,2],[2,3],[1,4],[9,1]]}\n");
    sb_add(&b, "{\"stage\":\"apply\",\"layer\":\"model.layers.9.mlp.experts\",\"num_experts\":16,"
               "\"top_k\":2,\"topk_ids\":[[0,2],[2,0],[0,2],[2,0]]}\n");
    for (int tk = 0; tk < 2; tk++) {
        sb_add(&b, "{\"stage\":\"apply\",\"layer\":\"model.layers.5.mlp.experts\","
                   "\"num_experts\":16,\"top_k\":2,\"topk_ids\":[[%d,7]]}\n", tk);
        sb_add(&b, "{\"stage\":\"apply\",\"layer\":\"model.layers.9.mlp.experts\","
                   "\"num_experts\":16,\"top_k\":2,\"topk_ids\":[[%d,8]]}\n", tk);
    }
    ferry_moe_trace *t = parse_ok(&b, NULL);
    assert_int_equal(ferry_moe_trace_model(t)->top_k, 2);
    assert_int_equal(ferry_moe_trace_steps(t), 6);
    assert_int_equal(ferry_moe_trace_tokens(t), 3); /* passes */
    uint32_t tok, layer, n;
    const uint32_t *ex;
    FT_ASSERT_OK(ferry_moe_trace_step(t, 0, &tok, &layer, &ex, &n));
    assert_int_equal(tok, 0);
    assert_int_equal(layer, 0);
    assert_int_equal(n, 5); /* {1,2,3,4,9}: the batch's union, once each */
    assert_int_equal(ex[0], 1);
    assert_int_equal(ex[4], 9);
    assert_int_equal(ferry_moe_trace_step_tokens(t, 0), 4);
    FT_ASSERT_OK(ferry_moe_trace_step(t, 1, &tok, &layer, &ex, &n));
    assert_int_equal(layer, 1);
    assert_int_equal(n, 2);
    FT_ASSERT_OK(ferry_moe_trace_step(t, 2, &tok, &layer, &ex, &n));
    assert_int_equal(tok, 1);
    assert_int_equal(layer, 0);
    assert_int_equal(n, 2);
    assert_int_equal(ferry_moe_trace_step_tokens(t, 2), 1);
    ferry_moe_trace_destroy(t);
    free(b.s);
}

static void counts_only_and_shapeless_records_are_refused_clearly(void **state)
{
    (void)state;
    sbuf b = {0};
    sb_add(&b, "{\"stage\":\"apply\",\"layer\":\"model.layers.3.mlp.experts\",\"num_experts\":4,"
               "\"counts\":[0,3,1,0]}\n");
    parse_fails(&b, NULL, "line 1", "counts-only record ('counts' without 'topk_ids')");
    free(b.s);
    sbuf c = {0};
    sb_add(&c, "{\"layer\":\"model.layers.3.mlp.experts\",\"topk_ids\":[[1,2]]}\n");
    parse_fails(&c, NULL, "line 1", "'num_experts' missing");
    free(c.s);
    sbuf d = {0};
    sb_add(&d, "{\"layer\":3,\"num_experts\":8,\"topk_ids\":[[1,2]]}\n"
               "{\"layer\":4,\"num_experts\":16,\"topk_ids\":[[1,2]]}\n");
    parse_fails(&d, NULL, "line 2", "line 1 said 8");
    free(d.s);
    sbuf e = {0};
    sb_add(&e, "{\"layer\":3,\"num_experts\":8,\"top_k\":1,\"topk_ids\":[[1,2]]}\n");
    parse_fails(&e, NULL, "line 1", "top_k is 1");
    free(e.s);
    sbuf f = {0};
    sb_add(&f, "{\"layer\":3,\"num_experts\":8}\n");
    parse_fails(&f, NULL, "line 1", "no routes");
    free(f.s);
    sbuf g = {0};
    sb_add(&g, "{\"token\":0,\"layer\":0,\"experts\":[1]}\n"
               "{\"layer\":3,\"num_experts\":8,\"topk_ids\":[[1,2]]}\n");
    parse_fails(&g, NULL, "line 2", "one form per file");
    free(g.s);
    /* a header's layer numbers and the records' own: refused (they made
     * layer 0 model layer 10, and the header's table leaked) */
    sbuf h = {0};
    sb_add(&h, "{\"num_layers\":4,\"num_experts\":8,\"layer_ids\":[10,20,30,40]}\n"
               "{\"layer\":0,\"num_experts\":8,\"topk_ids\":[[1]]}\n");
    parse_fails(&h, NULL, "line 2", "'layer_ids'");
    free(h.s);
}

static void hostile_captures_stay_bounded(void **state)
{
    (void)state;
    ft_alloc_install(0, 0);
    sbuf b = {0};
    for (int s = 0; s < 9; s++)
        sb_add(&b, "{\"stage\":\"s%d\",\"layer\":3,\"num_experts\":8,\"topk_ids\":[[1]]}\n", s);
    parse_fails(&b, "s0", "line 9", "past the 8");
    free(b.s);
    sbuf c = {0};
    for (uint32_t l = 0; l <= FERRY_MOE_MAX_LAYERS; l++)
        sb_add(&c, "{\"layer\":%u,\"num_experts\":8,\"topk_ids\":[[1]]}\n", l * 1000003u);
    parse_fails(&c, NULL, "line 1025", "past the 1024");
    free(c.s);
    sbuf d = {0};
    sb_add(&d, "{\"layer\":4294967295,\"num_experts\":8,\"topk_ids\":[[1]]}\n");
    parse_fails(&d, NULL, "line 1", "'layer'");
    free(d.s);
    assert_int_equal(ft_alloc_live(), 0);
    ft_alloc_reset();
    ferry_moe_trace_options o = FERRY_MOE_TRACE_OPTIONS_INIT;
    o.size = 1;
    ferry_moe_trace *t = NULL;
    assert_int_equal(ferry_moe_trace_parse_opts("{}", 2, &o, &t), -EINVAL);
    o = (ferry_moe_trace_options)FERRY_MOE_TRACE_OPTIONS_INIT;
    o.stage = "a-stage-name-that-is-far-longer-than-thirty-one-bytes";
    assert_int_equal(ferry_moe_trace_parse_opts("{}", 2, &o, &t), -EINVAL);
    assert_null(t);
}

static int oom_capture(void *ctx)
{
    const sbuf *b = ctx;
    ferry_moe_trace *t = NULL;
    int rc = ferry_moe_trace_parse(b->s, b->n, &t);
    if (rc < 0)
        assert_null(t);
    ferry_moe_trace_destroy(t);
    return rc;
}

static void captures_survive_out_of_memory(void **state)
{
    (void)state;
    sbuf b = {0};
    for (uint32_t tk = 0; tk < 3; tk++) {
        rec(&b, "router", 3, 2, 8, tk);
        rec(&b, "apply", 3, 2, 8, tk);
        rec(&b, "apply", 9, 1, 8, tk);
    }
    ft_oom_each(400, FT_OOM_STICKY, oom_capture, &b);
    free(b.s);
}

static void a_saved_capture_loads_back_with_its_layers_stage_and_batches(void **state)
{
    (void)state;
    sbuf b = {0};
    decode_capture(&b, "apply", 4);
    rec(&b, "apply", 17, 5, 8, 99); /* a batch of 5 at layer 17 */
    char path[] = "/tmp/ferry-capture-XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, b.s, b.n), (ssize_t)b.n);
    close(fd);
    ferry_moe_trace_options o = FERRY_MOE_TRACE_OPTIONS_INIT;
    o.stage = "apply";
    ferry_moe_trace *t = NULL, *u = NULL;
    FT_ASSERT_OK(ferry_moe_trace_load_opts(path, &o, &t));
    FT_ASSERT_OK(ferry_moe_trace_save(t, path));
    FT_ASSERT_OK(ferry_moe_trace_load(path, &u));
    unlink(path);
    const ferry_moe_model *a = ferry_moe_trace_model(t), *c = ferry_moe_trace_model(u);
    assert_int_equal(a->num_layers, c->num_layers);
    assert_int_equal(a->num_experts, c->num_experts);
    assert_int_equal(a->top_k, c->top_k);
    assert_string_equal(ferry_moe_trace_stage(u), "apply");
    for (uint32_t l = 0; l < 3; l++)
        assert_int_equal(ferry_moe_trace_layer_id(u, l), ferry_moe_trace_layer_id(t, l));
    assert_int_equal(ferry_moe_trace_steps(t), ferry_moe_trace_steps(u));
    for (size_t i = 0; i < ferry_moe_trace_steps(t); i++) {
        uint32_t t1, l1, n1, t2, l2, n2;
        const uint32_t *e1, *e2;
        FT_ASSERT_OK(ferry_moe_trace_step(t, i, &t1, &l1, &e1, &n1));
        FT_ASSERT_OK(ferry_moe_trace_step(u, i, &t2, &l2, &e2, &n2));
        assert_int_equal(t1, t2);
        assert_int_equal(l1, l2);
        assert_int_equal(n1, n2);
        assert_memory_equal(e1, e2, n1 * sizeof *e1);
        assert_int_equal(ferry_moe_trace_step_tokens(t, i), ferry_moe_trace_step_tokens(u, i));
    }
    ferry_moe_trace_destroy(t);
    ferry_moe_trace_destroy(u);
    free(b.s);
}

static void the_engines_predictions_ride_with_their_steps(void **state)
{
    (void)state;
    sbuf b = {0};
    /* records out of order (layer 9 first), the second stage skipped, a
     * prediction that is partly wrong, one record without any */
    sb_add(&b, "{\"stage\":\"apply\",\"layer\":9,\"num_experts\":16,\"topk_ids\":[[1,2]],"
               "\"pred_ids\":[[1,7]]}\n"
               "{\"stage\":\"router\",\"layer\":5,\"num_experts\":16,\"topk_ids\":[[4,5]],"
               "\"pred_ids\":[[9]]}\n"
               "{\"stage\":\"apply\",\"layer\":5,\"num_experts\":16,\"topk_ids\":[[3,4],[4,6]],"
               "\"pred_ids\":[[3,4],[6,3]]}\n"
               "{\"stage\":\"apply\",\"layer\":5,\"num_experts\":16,\"topk_ids\":[[0,1]]}\n");
    ferry_moe_trace *t = parse_ok(&b, NULL);
    assert_int_equal(ferry_moe_trace_steps(t), 3);
    const uint32_t *p;
    uint32_t n;
    /* (0, layer 5): {3,4,6}; (0, layer 9): {1,7}; (1, layer 5): none */
    FT_ASSERT_OK(ferry_moe_trace_step_pred(t, 0, &p, &n));
    assert_int_equal(n, 3);
    assert_int_equal(p[0], 3);
    assert_int_equal(p[2], 6);
    FT_ASSERT_OK(ferry_moe_trace_step_pred(t, 1, &p, &n));
    assert_int_equal(n, 2);
    assert_int_equal(p[1], 7);
    FT_ASSERT_OK(ferry_moe_trace_step_pred(t, 2, &p, &n));
    assert_int_equal(n, 0);
    assert_int_equal(ferry_moe_trace_step_pred(t, 3, &p, &n), -EINVAL);
    /* saved and read back in ferry's form ("pred") */
    char path[] = "/tmp/ferry-pred-XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    FT_ASSERT_OK(ferry_moe_trace_save(t, path));
    ferry_moe_trace *u = NULL;
    FT_ASSERT_OK(ferry_moe_trace_load(path, &u));
    unlink(path);
    for (size_t i = 0; i < 3; i++) {
        const uint32_t *q;
        uint32_t m;
        FT_ASSERT_OK(ferry_moe_trace_step_pred(t, i, &p, &n));
        FT_ASSERT_OK(ferry_moe_trace_step_pred(u, i, &q, &m));
        assert_int_equal(n, m);
        if (n)
            assert_memory_equal(p, q, n * sizeof *p);
    }
    ferry_moe_trace_destroy(u);
    ferry_moe_trace_destroy(t);
    free(b.s);
    sbuf c = {0};
    sb_add(&c, "{\"layer\":3,\"num_experts\":8,\"topk_ids\":[[1]],\"pred_ids\":[[8]]}\n");
    parse_fails(&c, NULL, "line 1", "'pred_ids'");
    free(c.s);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(shape_comes_from_the_records_and_sparse_layers_stay_sparse),
        cmocka_unit_test(a_mixed_capture_reads_one_stage),
        cmocka_unit_test(multi_token_records_run_layer_by_layer),
        cmocka_unit_test(counts_only_and_shapeless_records_are_refused_clearly),
        cmocka_unit_test(hostile_captures_stay_bounded),
        cmocka_unit_test(captures_survive_out_of_memory),
        cmocka_unit_test(a_saved_capture_loads_back_with_its_layers_stage_and_batches),
        cmocka_unit_test(the_engines_predictions_ride_with_their_steps),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
