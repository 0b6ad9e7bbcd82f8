/*
 * trace_capture.c - routing captures from a serving engine (the route
 * logger at the MoE layer), one JSON object per line:
 *
 *   {"stage":"apply","layer":"model.layers.12.mlp.experts",
 *    "num_experts":256,"top_k":8,"topk_ids":[[3,17,...],[...]]}
 *
 * What the records say is what the trace gets; nothing is guessed from the
 * ids seen:
 *  - the shape: num_experts from the records (all must agree; a record
 *    without it is refused unless a header declared it), top_k from the
 *    records or else the widest per-token list;
 *  - the layers: the module paths' numbers, kept sparse. A capture that
 *    logged layers 3, 17 and 38 is a trace of 3 layers whose model layer
 *    numbers are ferry_moe_trace_layer_id() = 3, 17, 38;
 *  - the stage: a record's optional "stage". One stage is read: the one
 *    asked for, else the file's only stage, else the applying stage
 *    ("apply"); a file of several stages without one is refused, so no
 *    route is ever counted twice;
 *  - the order: a record is one forward pass of its layer (its token lists
 *    are one batch), so the n-th record of a layer is pass n. A pass is
 *    one step per layer, whose experts are the union of its tokens' routes:
 *    the engine runs a prefill batch layer by layer, not token by token.
 * Counts-only records ("counts" without "topk_ids") are refused by the
 * caller with a message saying what is absent. A record may carry the
 * engine's own prediction of its routes, made before they were known (a
 * pre-gating predictor at the layer before, a draft): "pred_ids", lists
 * like topk_ids, kept per step for the timeline's hints.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "moe/trace_parse.h"

#define MAX_STAGES FERRY__TRACE_MAX_STAGES
#define PERR FERRY__PERR

void ferry__capture_free(ferry__trace_parser *ps)
{
    ferry__free(ps->lid);
    ferry__free(ps->pass);
    ferry__free(ps->stage_of);
    ferry__free(ps->mark);
    ps->lid = ps->pass = ps->mark = NULL;
    ps->stage_of = NULL;
}

static int capture_tables(ferry__trace_parser *ps, size_t line)
{
    if (ps->lid)
        return 0;
    ps->lid = ferry__malloc(FERRY_MOE_MAX_LAYERS * sizeof *ps->lid);
    ps->pass = ferry__calloc((size_t)MAX_STAGES * FERRY_MOE_MAX_LAYERS, sizeof *ps->pass);
    ps->mark = ferry__calloc(FERRY_MOE_MAX_EXPERTS, sizeof *ps->mark);
    if (!ps->lid || !ps->pass || !ps->mark) {
        ferry__capture_free(ps);
        return ferry__err_set(NULL, -ENOMEM, "moe trace line %zu: out of memory", line);
    }
    return 0;
}

/* the stage's index, adding it when new */
static int stage_index(ferry__trace_parser *ps, json_t *o, size_t line)
{
    const char *s = "";
    json_t *v = json_object_get(o, "stage");
    if (v) {
        if (!json_is_string(v))
            return PERR(line, "field 'stage': expected a string");
        s = json_string_value(v);
        if (strlen(s) >= FERRY__TRACE_STAGE_LEN)
            return PERR(line, "field 'stage': longer than %d bytes", FERRY__TRACE_STAGE_LEN - 1);
    }
    for (int i = 0; i < ps->n_stages; i++)
        if (!strcmp(ps->stage[i], s))
            return i;
    if (ps->n_stages == MAX_STAGES)
        return PERR(line, "field 'stage': '%s' is a stage past the %d a capture may hold", s,
                    MAX_STAGES);
    snprintf(ps->stage[ps->n_stages], FERRY__TRACE_STAGE_LEN, "%s", s);
    return ps->n_stages++;
}

/* num_experts and top_k as the record says, checked against earlier ones */
static int record_shape(ferry__trace_parser *ps, json_t *o, size_t line, uint32_t *E, uint32_t *K)
{
    uint64_t v;
    int rc = ferry__trace_get_uint(o, "num_experts", FERRY_MOE_MAX_EXPERTS, line, &v, 0);
    if (rc < 0)
        return rc;
    uint32_t hdr = ps->have_header ? ps->t->model.num_experts : 0;
    if (rc == 1) {
        if (!ps->cap_experts && !hdr)
            return PERR(line, "field 'num_experts' missing: a capture record must say how many "
                              "experts its layer has (the largest id seen is no measure of it)");
    } else {
        if (v == 0)
            return PERR(line, "field 'num_experts': must be at least 1");
        if (ps->cap_experts && v != ps->cap_experts)
            return PERR(line, "field 'num_experts': %" PRIu64 ", but line %zu said %u", v,
                        ps->cap_experts_line, ps->cap_experts);
        if (hdr && v != hdr)
            return PERR(line, "field 'num_experts': %" PRIu64 ", but the header says %u", v, hdr);
        if (!ps->cap_experts) {
            ps->cap_experts = (uint32_t)v;
            ps->cap_experts_line = line;
        }
    }
    *E = ps->cap_experts ? ps->cap_experts : hdr;
    rc = ferry__trace_get_uint(o, "top_k", *E, line, &v, 0);
    if (rc < 0)
        return rc;
    if (rc == 0) {
        if (v == 0)
            return PERR(line, "field 'top_k': must be at least 1");
        if (ps->cap_k && v != ps->cap_k)
            return PERR(line, "field 'top_k': %" PRIu64 ", but earlier records said %u", v,
                        ps->cap_k);
        ps->cap_k = (uint32_t)v;
    }
    *K = ps->cap_k ? ps->cap_k : (ps->declared_k ? ps->t->model.top_k : 0);
    return 0;
}

/* where layer is, or would go, in the sorted table of layer ids seen */
static uint32_t lid_index(const ferry__trace_parser *ps, uint32_t layer)
{
    uint32_t lo = 0, hi = ps->n_lid;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (ps->lid[mid] < layer)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* the record's model layer number and its index in the sorted table */
static int record_layer(ferry__trace_parser *ps, json_t *o, size_t line, uint32_t *layer,
                        uint32_t *li)
{
    json_t *lv = json_object_get(o, "layer");
    uint64_t l;
    if (!lv)
        return PERR(line, "field 'layer' missing");
    if (json_is_integer(lv) && json_integer_value(lv) >= 0)
        l = (uint64_t)json_integer_value(lv);
    else if (!json_is_string(lv) || ferry__trace_module_layer(json_string_value(lv), &l) < 0)
        return PERR(line, "field 'layer': expected a module path holding 'layers.N' or an integer");
    if (l >= UINT32_MAX)
        return PERR(line, "field 'layer': layer %" PRIu64 " past %u", l, UINT32_MAX - 1);
    if (ps->have_header && l >= ps->t->model.num_layers)
        return PERR(line, "field 'layer': layer %" PRIu64 " >= %u layers (header)", l,
                    ps->t->model.num_layers);
    uint32_t lo = lid_index(ps, (uint32_t)l); /* (l < UINT32_MAX: checked above) */
    if (lo == ps->n_lid || ps->lid[lo] != l) {
        if (ps->n_lid == FERRY_MOE_MAX_LAYERS)
            return PERR(line, "field 'layer': layer %" PRIu64 " is a layer past the %u a trace "
                              "may hold", l, FERRY_MOE_MAX_LAYERS);
        uint32_t tail = ps->n_lid - lo;
        memmove(ps->lid + lo + 1, ps->lid + lo, tail * sizeof *ps->lid);
        ps->lid[lo] = (uint32_t)l;
        for (int s = 0; s < MAX_STAGES; s++) {
            uint32_t *row = ps->pass + (size_t)s * FERRY_MOE_MAX_LAYERS;
            memmove(row + lo + 1, row + lo, tail * sizeof *row);
            row[lo] = 0;
        }
        ps->n_lid++;
    }
    *layer = (uint32_t)l;
    *li = lo;
    return 0;
}

/* the union of the record's per-token lists into ps->buf; the count of
 * lists in *ntok */
static int record_routes(ferry__trace_parser *ps, json_t *ids, uint32_t E, uint32_t K, int si,
                         size_t line, uint32_t *ntok)
{
    if (!json_is_array(ids) || json_array_size(ids) == 0)
        return PERR(line, "field 'topk_ids': expected a non-empty list of per-token lists");
    size_t T = json_array_size(ids);
    if (T > UINT32_MAX / 2)
        return PERR(line, "field 'topk_ids': %zu tokens", T);
    if (ps->buf_cap < E) {
        uint32_t *nb = ferry__realloc(ps->buf, (size_t)E * sizeof *nb);
        if (!nb)
            return ferry__err_set(NULL, -ENOMEM, "moe trace line %zu: out of memory", line);
        ps->buf = nb;
        ps->buf_cap = E;
    }
    if (++ps->mark_gen == 0) {
        memset(ps->mark, 0, FERRY_MOE_MAX_EXPERTS * sizeof *ps->mark);
        ps->mark_gen = 1;
    }
    uint32_t n = 0;
    for (size_t i = 0; i < T; i++) {
        json_t *lst = json_array_get(ids, i);
        size_t k = json_is_array(lst) ? json_array_size(lst) : 0;
        if (k == 0)
            return PERR(line, "field 'topk_ids[%zu]': expected a non-empty list of expert ids",
                        i);
        if (K && k > K)
            return PERR(line, "field 'topk_ids[%zu]': %zu experts, top_k is %u", i, k, K);
        if (k > ps->widest[si])
            ps->widest[si] = (uint32_t)k;
        for (size_t j = 0; j < k; j++) {
            json_t *v = json_array_get(lst, j);
            if (!json_is_integer(v) || json_integer_value(v) < 0)
                return PERR(line, "field 'topk_ids[%zu]'[%zu]: expected a non-negative integer",
                            i, j);
            if ((uint64_t)json_integer_value(v) >= E)
                return PERR(line, "field 'topk_ids[%zu]'[%zu]: expert %" JSON_INTEGER_FORMAT
                                  " >= %u experts", i, j, json_integer_value(v), E);
            uint32_t e = (uint32_t)json_integer_value(v);
            if (ps->mark[e] != ps->mark_gen) {
                ps->mark[e] = ps->mark_gen;
                ps->buf[n++] = e;
            }
        }
    }
    *ntok = (uint32_t)T;
    return (int)n;
}

int ferry__capture_record(ferry__trace_parser *ps, json_t *o, size_t line)
{
    if (ps->form == TRACE_FORM_FERRY)
        return PERR(line, "a capture record ('topk_ids') after ferry records ('experts'): one "
                          "form per file");
    ps->form = TRACE_FORM_CAPTURE;
    if (ps->t->layer_ids) /* two numberings of one trace's layers: refused */
        return PERR(line, "a capture record after a header with 'layer_ids': a capture's "
                          "records name their model layers themselves");
    int rc = capture_tables(ps, line);
    if (rc < 0)
        return rc;
    int si = stage_index(ps, o, line);
    if (si < 0)
        return si;
    ps->stage_records[si]++;
    if (ps->want_stage && strcmp(ps->stage[si], ps->want_stage))
        return 0; /* another stage: not read */
    uint32_t E = 0, K = 0, layer = 0, li = 0, ntok = 0;
    if ((rc = record_layer(ps, o, line, &layer, &li)) < 0 ||
        (rc = record_shape(ps, o, line, &E, &K)) < 0)
        return rc;
    int n = record_routes(ps, json_object_get(o, "topk_ids"), E, K, si, line, &ntok);
    if (n < 0)
        return n;
    uint32_t *pass = ps->pass + (size_t)si * FERRY_MOE_MAX_LAYERS + li;
    if (*pass == UINT32_MAX - 1)
        return PERR(line, "too many records at layer %u", layer);
    if (!ps->want_stage && ps->t->n_steps >= ps->stage_cap) {
        size_t nc = ps->stage_cap ? ps->stage_cap * 2 : 1024;
        uint8_t *ns = ferry__realloc(ps->stage_of, nc);
        if (!ns)
            return ferry__err_set(NULL, -ENOMEM, "moe trace line %zu: out of memory", line);
        ps->stage_of = ns;
        ps->stage_cap = nc;
    }
    size_t at = ps->t->n_steps;
    if ((rc = ferry__trace_add(ps, (*pass)++, layer, (uint32_t)n, ntok, line)) < 0 ||
        (rc = ferry__trace_read_pred(ps, json_object_get(o, "pred_ids"), "pred_ids", 1, E,
                                     line)) < 0)
        return rc;
    if (!ps->want_stage)
        ps->stage_of[at] = (uint8_t)si;
    return 0;
}

/* "'a' (3 records), 'b' (2 records)" */
static void stage_list(const ferry__trace_parser *ps, char *buf, size_t len)
{
    size_t off = 0;
    buf[0] = 0;
    for (int i = 0; i < ps->n_stages && off < len; i++)
        off += (size_t)snprintf(buf + off, len - off, "%s'%s' (%" PRIu64 " records)",
                                i ? ", " : "", ps->stage[i], ps->stage_records[i]);
}

/* which stage is read: its index, or FERRY_EPARSE */
static int choose_stage(ferry__trace_parser *ps)
{
    char list[FERRY__TRACE_MAX_STAGES * (FERRY__TRACE_STAGE_LEN + 24)];
    stage_list(ps, list, sizeof list);
    if (ps->want_stage) {
        for (int i = 0; i < ps->n_stages; i++)
            if (!strcmp(ps->stage[i], ps->want_stage))
                return i;
        return ferry__err_set(NULL, FERRY_EPARSE,
                              "moe trace: no records of stage '%s'; the capture holds %s",
                              ps->want_stage, list);
    }
    if (ps->n_stages == 1)
        return 0;
    for (int i = 0; i < ps->n_stages; i++)
        if (!strcmp(ps->stage[i], FERRY__TRACE_APPLY_STAGE))
            return i;
    return ferry__err_set(NULL, FERRY_EPARSE,
                          "moe trace: records of several stages, %s, and none '%s': reading them "
                          "all would count each route once per stage; choose one (--stage)",
                          list, FERRY__TRACE_APPLY_STAGE);
}

/* keep the steps of stage si only */
static void keep_stage(ferry__trace_parser *ps, int si)
{
    ferry_moe_trace *t = ps->t;
    size_t w = 0, pos = 0;
    uint32_t ppos = 0;
    for (size_t i = 0; i < t->n_steps; i++) {
        size_t a = t->off[i], len = t->off[i + 1] - a;
        if (ps->stage_of[i] != si)
            continue;
        if (t->poff) { /* its prediction moves with it (poff[w] is set) */
            uint32_t pa = t->poff[i], pl = t->poff[i + 1] - pa;
            memmove(t->pex + ppos, t->pex + pa, (size_t)pl * sizeof *t->pex);
            t->poff[w] = ppos;
            ppos += pl;
        }
        t->tok[w] = t->tok[i];
        t->layer[w] = t->layer[i];
        t->ntok[w] = t->ntok[i];
        memmove(t->ex + pos, t->ex + a, len * sizeof *t->ex);
        t->off[w] = pos;
        pos += len;
        w++;
    }
    t->off[w] = pos;
    t->n_steps = w;
    t->n_ex = pos;
    if (t->poff) {
        t->poff[w] = ppos;
        t->n_pex = ppos;
    }
}

/* layers of the kept steps only, renumbered densely in model order */
static int keep_layers(ferry__trace_parser *ps)
{
    ferry_moe_trace *t = ps->t;
    uint32_t *rank = ferry__calloc(FERRY_MOE_MAX_LAYERS, sizeof *rank);
    if (!rank)
        return ferry__err_set(NULL, -ENOMEM, "moe trace: out of memory");
    for (size_t i = 0; i < t->n_steps; i++)
        rank[lid_index(ps, t->layer[i])] = 1;
    uint32_t L = 0;
    for (uint32_t i = 0; i < ps->n_lid; i++)
        rank[i] = rank[i] ? L++ : UINT32_MAX;
    uint32_t *ids = ferry__malloc((size_t)L * sizeof *ids);
    if (!ids) {
        ferry__free(rank);
        return ferry__err_set(NULL, -ENOMEM, "moe trace: out of memory");
    }
    for (uint32_t i = 0; i < ps->n_lid; i++)
        if (rank[i] != UINT32_MAX)
            ids[rank[i]] = ps->lid[i];
    for (size_t i = 0; i < t->n_steps; i++)
        t->layer[i] = rank[lid_index(ps, t->layer[i])];
    ferry__free(rank);
    t->model.num_layers = L;
    int dense = 1;
    for (uint32_t i = 0; i < L; i++)
        dense &= ids[i] == i;
    if (dense)
        ferry__free(ids);
    else
        t->layer_ids = ids;
    return 0;
}

int ferry__capture_close(ferry__trace_parser *ps)
{
    ferry_moe_trace *t = ps->t;
    int si = choose_stage(ps);
    if (si < 0)
        return si;
    if (!ps->want_stage && ps->n_stages > 1)
        keep_stage(ps, si);
    snprintf(t->stage, sizeof t->stage, "%s", ps->stage[si]);
    if (t->n_steps == 0)
        return ferry__err_set(NULL, FERRY_EPARSE, "moe trace: no route records of stage '%s'",
                              ps->stage[si]);
    if (ps->cap_experts)
        t->model.num_experts = ps->cap_experts;
    t->model.top_k = ps->cap_k ? ps->cap_k : ps->declared_k ? t->model.top_k : ps->widest[si];
    t->n_tokens = 0;
    for (size_t i = 0; i < t->n_steps; i++)
        if (t->tok[i] + 1 > t->n_tokens)
            t->n_tokens = t->tok[i] + 1;
    return keep_layers(ps);
}
