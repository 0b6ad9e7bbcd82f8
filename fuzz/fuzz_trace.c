/*
 * fuzz_trace.c - the routing-trace reader (both JSON Lines forms, captures
 * with stages, sparse layers and multi-token records) on arbitrary bytes,
 * read with the default stage and with stage "apply" asked for.
 *
 * Checks beyond "no crash": a refusal is FERRY_EPARSE (or -ENOMEM) with a
 * message naming a line; an accepted trace keeps its invariants (every
 * layer and expert in the model's range, no empty route, a route no
 * wider than top_k per token, layer numbers rising, steps in (token,
 * layer) order), and small accepted traces replay through the
 * planner under LRU, routing and Belady without error, Belady never worse,
 * and at a budget below a layer (wide steps streamed in waves).
 */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "moe/moe_internal.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int one(const uint8_t *data, size_t size, const char *stage)
{
    ferry_moe_trace_options o = FERRY_MOE_TRACE_OPTIONS_INIT;
    o.stage = stage;
    ferry_moe_trace *t = NULL;
    int rc = ferry_moe_trace_parse_opts((const char *)data, size, &o, &t);
    if (rc != 0) {
        if ((rc != FERRY_EPARSE && rc != -ENOMEM) || t != NULL || ferry_last_error()[0] == 0)
            abort();
        return 0;
    }
    const ferry_moe_model *m = ferry_moe_trace_model(t);
    if (!m->num_layers || !m->num_experts || !ferry_moe_trace_steps(t))
        abort();
    uint32_t pt = 0, pl = 0;
    for (size_t i = 0; i < ferry_moe_trace_steps(t); i++) {
        uint32_t tok, layer, n;
        const uint32_t *ex;
        if (ferry_moe_trace_step(t, i, &tok, &layer, &ex, &n) != 0 || n == 0 ||
            layer >= m->num_layers ||
            (uint64_t)n > (uint64_t)m->top_k * ferry_moe_trace_step_tokens(t, i) ||
            tok >= ferry_moe_trace_tokens(t))
            abort();
        for (uint32_t k = 0; k < n; k++)
            if (ex[k] >= m->num_experts)
                abort();
        const uint32_t *pr;
        uint32_t np;
        if (ferry_moe_trace_step_pred(t, i, &pr, &np) != 0)
            abort();
        for (uint32_t k = 0; k < np; k++)
            if (pr[k] >= m->num_experts)
                abort();
        if (i && (tok < pt || (tok == pt && layer < pl)))
            abort();
        pt = tok;
        pl = layer;
    }
    for (uint32_t l = 1; l < m->num_layers; l++)
        if (ferry_moe_trace_layer_id(t, l) <= ferry_moe_trace_layer_id(t, l - 1))
            abort();
    if ((uint64_t)m->num_layers * m->num_experts <= 4096 && ferry_moe_trace_steps(t) <= 4096) {
        uint32_t slots = m->num_experts + (m->num_layers > 1 ? 1 : 0);
        ferry_moe_replay_result a, b, c;
        if (ferry_moe_replay(t, "lru", slots, 0, &a) != 0 ||
            ferry_moe_replay(t, "routing", slots, 0, &c) != 0 ||
            ferry_moe_replay(t, "belady", slots, 0, &b) != 0 || b.hits < a.hits ||
            b.hits < c.hits || a.hits + a.misses != b.hits + b.misses)
            abort();
        /* a budget below a layer: wide steps stream through the slots */
        uint32_t few = 1 + m->top_k / 2;
        const char *pols[] = {"lru", "lru-layer", "routing", "belady"};
        for (int i = 0; i < 4; i++)
            if (ferry_moe_replay(t, pols[i], few, 0, &c) != 0 ||
                c.hits + c.misses != a.hits + a.misses)
                abort();
        /* the timeline, hints from the records' own predictions */
        ferry_moe_sim_options so = FERRY_MOE_SIM_OPTIONS_INIT;
        so.slots = few;
        so.expert_bytes = 1000;
        so.hint_steps = 1;
        so.hint_trace = 1;
        ferry_moe_sim_result sr = FERRY_MOE_SIM_RESULT_INIT;
        if (ferry_moe_sim(t, &so, &sr) != 0 || sr.hits + sr.misses != a.hits + a.misses)
            abort();
    }
    ferry_moe_trace_destroy(t);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    one(data, size, NULL);
    one(data, size, "apply");
    return 0;
}
