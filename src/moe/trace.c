/*
 * trace.c - routing traces: JSON Lines in, JSON Lines out.
 *
 * A trace is a flat structure of arrays (token, layer, offset per step and
 * one array of layer-local expert ids) so replaying a million steps touches
 * memory in order. Invariants kept for every trace that leaves this file:
 * every layer < model.num_layers, every expert < model.num_experts, every
 * step has at least one expert, and (after loading) steps are in
 * (token, layer) order - the order a decoder visits them - with file order
 * kept among equal keys. Parsing is all-or-nothing: the first bad line
 * fails the whole load with FERRY_EPARSE and a message naming the line
 * number and the field, and nothing is leaked. The reader is fuzzed
 * (fuzz/fuzz_trace.c), so it never trusts a length, an index or a type.
 * Its memory is bounded whatever it is given: a file is read a line at a
 * time (never whole), a line over FERRY__TRACE_MAX_LINE and a trace over
 * FERRY__TRACE_MAX_STEPS steps or FERRY__TRACE_MAX_IDS expert ids are
 * refused, and only regular files and pipes are opened (a device such as
 * /dev/zero would never end).
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <jansson.h>

#include "sized.h"
#include "moe/trace_parse.h"

/* bounds on an inferred or declared shape: the planner keeps dense arrays
 * over layers * experts, so a hostile trace must not ask for terabytes */
#define MAX_LAYERS 1024u
#define MAX_EXPERTS 16384u

static int trace_new(ferry_moe_trace **out)
{
    ferry_moe_trace *t = ferry__calloc(1, sizeof *t);
    if (!t)
        return -ENOMEM;
    t->off = ferry__malloc(sizeof *t->off);
    if (!t->off) {
        ferry__free(t);
        return -ENOMEM;
    }
    t->off[0] = 0;
    t->sorted = 1;
    *out = t;
    return 0;
}

void ferry_moe_trace_destroy(ferry_moe_trace *t)
{
    if (!t)
        return;
    ferry__free(t->tok);
    ferry__free(t->layer);
    ferry__free(t->ntok);
    ferry__free(t->off);
    ferry__free(t->ex);
    ferry__free(t->layer_ids);
    ferry__free(t->poff);
    ferry__free(t->pex);
    ferry__free(t);
}

int ferry__trace_push(ferry_moe_trace *t, uint32_t token, uint32_t layer, const uint32_t *experts,
                      uint32_t n, uint32_t ntok)
{
    if (t->n_steps == t->cap_steps) {
        size_t nc = t->cap_steps ? t->cap_steps * 2 : 256;
        uint32_t *tok = ferry__realloc(t->tok, nc * sizeof *tok);
        if (!tok)
            return -ENOMEM;
        t->tok = tok;
        uint32_t *lay = ferry__realloc(t->layer, nc * sizeof *lay);
        if (!lay)
            return -ENOMEM;
        t->layer = lay;
        uint32_t *nt = ferry__realloc(t->ntok, nc * sizeof *nt);
        if (!nt)
            return -ENOMEM;
        t->ntok = nt;
        size_t *off = ferry__realloc(t->off, (nc + 1) * sizeof *off);
        if (!off)
            return -ENOMEM;
        t->off = off;
        if (t->poff) {
            uint32_t *po = ferry__realloc(t->poff, (nc + 1) * sizeof *po);
            if (!po)
                return -ENOMEM;
            t->poff = po;
        }
        t->cap_steps = nc;
    }
    if (t->n_ex + n > t->cap_ex) {
        size_t nc = t->cap_ex ? t->cap_ex : 1024;
        while (nc < t->n_ex + n)
            nc *= 2;
        uint32_t *ex = ferry__realloc(t->ex, nc * sizeof *ex);
        if (!ex)
            return -ENOMEM;
        t->ex = ex;
        t->cap_ex = nc;
    }
    if (t->n_steps) {
        uint32_t pt = t->tok[t->n_steps - 1], pl = t->layer[t->n_steps - 1];
        if (token < pt || (token == pt && layer < pl))
            t->sorted = 0;
    }
    memcpy(t->ex + t->n_ex, experts, (size_t)n * sizeof *experts);
    t->n_ex += n;
    t->tok[t->n_steps] = token;
    t->layer[t->n_steps] = layer;
    t->ntok[t->n_steps] = ntok;
    t->n_steps++;
    t->off[t->n_steps] = t->n_ex;
    if (t->poff)
        t->poff[t->n_steps] = (uint32_t)t->n_pex;
    if (token + 1 > t->n_tokens)
        t->n_tokens = token + 1;
    /* a batch of ntok routes holds at least n / ntok experts per route */
    uint32_t per = (uint32_t)(((uint64_t)n + ntok - 1) / ntok);
    if (per > t->model.top_k)
        t->model.top_k = per;
    return 0;
}

int ferry__trace_set_pred(ferry_moe_trace *t, const uint32_t *pred, uint32_t n)
{
    if (!t->n_steps)
        return -EINVAL;
    if (!t->poff) {
        t->poff = ferry__calloc(t->cap_steps + 1, sizeof *t->poff);
        if (!t->poff)
            return -ENOMEM;
    }
    if (t->n_pex + n > t->cap_pex) {
        size_t nc = t->cap_pex ? t->cap_pex : 256;
        while (nc < t->n_pex + n)
            nc *= 2;
        uint32_t *px = ferry__realloc(t->pex, nc * sizeof *px);
        if (!px)
            return -ENOMEM;
        t->pex = px;
        t->cap_pex = nc;
    }
    memcpy(t->pex + t->n_pex, pred, (size_t)n * sizeof *pred);
    t->n_pex += n;
    t->poff[t->n_steps] = (uint32_t)t->n_pex;
    return 0;
}

int ferry_moe_trace_step_pred(const ferry_moe_trace *t, size_t i, const uint32_t **pred,
                              uint32_t *n)
{
    if (!t || i >= t->n_steps || !pred || !n)
        return ferry__err_set(NULL, -EINVAL, "moe trace: step %zu out of range (%zu)", i,
                              t ? t->n_steps : 0);
    *n = t->poff ? t->poff[i + 1] - t->poff[i] : 0;
    *pred = t->poff ? t->pex + t->poff[i] : NULL;
    return 0;
}

int ferry_moe_trace_create(const ferry_moe_model *model, ferry_moe_trace **out)
{
    if (!model || !out)
        return ferry__err_set(NULL, -EINVAL, "moe trace create: no %s", model ? "out" : "model");
    if (!model->num_layers || model->num_layers > MAX_LAYERS)
        return ferry__err_set(NULL, -EINVAL, "moe trace: num_layers %u: accepted 1..%u",
                              model->num_layers, MAX_LAYERS);
    if (!model->num_experts || model->num_experts > MAX_EXPERTS)
        return ferry__err_set(NULL, -EINVAL, "moe trace: num_experts %u: accepted 1..%u",
                              model->num_experts, MAX_EXPERTS);
    /* what ferry_moe_trace_save writes must load back: the reader takes
     * top_k up to num_experts, expert_bytes up to INT64_MAX and a name
     * that is JSON text (UTF-8) */
    if (model->top_k > model->num_experts)
        return ferry__err_set(NULL, -EINVAL, "moe trace: top_k %u: accepted 0..num_experts (%u)",
                              model->top_k, model->num_experts);
    if (model->expert_bytes > (uint64_t)INT64_MAX)
        return ferry__err_set(NULL, -EINVAL, "moe trace: expert_bytes %llu: accepted 0..%llu",
                              (unsigned long long)model->expert_bytes,
                              (unsigned long long)INT64_MAX);
    char name[sizeof model->name];
    snprintf(name, sizeof name, "%.*s", (int)sizeof name - 1, model->name);
    json_t *js = json_string(name);
    if (!js)
        return ferry__err_set(NULL, -EINVAL, "moe trace: model name is not UTF-8 text");
    json_decref(js);
    ferry_moe_trace *t;
    if (trace_new(&t) < 0)
        return ferry__err_set(NULL, -ENOMEM, "moe trace: out of memory");
    t->model = *model;
    t->model.name[sizeof t->model.name - 1] = 0;
    *out = t;
    return 0;
}

int ferry_moe_trace_append(ferry_moe_trace *t, uint32_t token, uint32_t layer,
                           const uint32_t *experts, uint32_t n)
{
    if (!t || !experts || n == 0)
        return ferry__err_set(NULL, -EINVAL, "moe trace: empty route at token %u layer %u", token,
                              layer);
    if (token == UINT32_MAX) /* the token count, token + 1, must fit (as the reader's) */
        return ferry__err_set(NULL, -EINVAL, "moe trace: token %u: accepted 0..%u", token,
                              UINT32_MAX - 1);
    if (layer >= t->model.num_layers)
        return ferry__err_set(NULL, -EINVAL, "moe trace: token %u: layer %u >= %u", token, layer,
                              t->model.num_layers);
    for (uint32_t i = 0; i < n; i++)
        if (experts[i] >= t->model.num_experts)
            return ferry__err_set(NULL, -EINVAL, "moe trace: token %u layer %u: expert %u >= %u",
                                  token, layer, experts[i], t->model.num_experts);
    /* the reader's bounds, so that what save writes loads back */
    if (n > MAX_EXPERTS)
        return ferry__err_set(NULL, -EINVAL,
                              "moe trace: token %u layer %u: a route of %u experts; accepted "
                              "1..%u",
                              token, layer, n, MAX_EXPERTS);
    if (t->n_steps >= FERRY__TRACE_MAX_STEPS || t->n_ex + n > FERRY__TRACE_MAX_IDS)
        return ferry__err_set(NULL, -EINVAL,
                              "moe trace: token %u layer %u: a trace holds at most %zu steps "
                              "and %zu expert ids (it has %zu and %zu)",
                              token, layer, FERRY__TRACE_MAX_STEPS, FERRY__TRACE_MAX_IDS,
                              t->n_steps, t->n_ex);
    if (ferry__trace_push(t, token, layer, experts, n, 1) < 0)
        return ferry__err_set(NULL, -ENOMEM, "moe trace: out of memory at step %zu", t->n_steps);
    return 0;
}

const ferry_moe_model *ferry_moe_trace_model(const ferry_moe_trace *t)
{
    static const ferry_moe_model none;
    return t ? &t->model : &none;
}

size_t ferry_moe_trace_steps(const ferry_moe_trace *t)
{
    return t ? t->n_steps : 0;
}

uint32_t ferry_moe_trace_tokens(const ferry_moe_trace *t)
{
    return t ? t->n_tokens : 0;
}

uint32_t ferry_moe_trace_step_tokens(const ferry_moe_trace *t, size_t i)
{
    return t && i < t->n_steps ? t->ntok[i] : 0;
}

uint32_t ferry_moe_trace_layer_id(const ferry_moe_trace *t, uint32_t layer)
{
    if (!t || layer >= t->model.num_layers)
        return FERRY_MOE_NONE;
    return t->layer_ids ? t->layer_ids[layer] : layer;
}

const char *ferry_moe_trace_stage(const ferry_moe_trace *t)
{
    return t ? t->stage : "";
}

int ferry_moe_trace_step(const ferry_moe_trace *t, size_t i, uint32_t *token, uint32_t *layer,
                         const uint32_t **experts, uint32_t *n)
{
    if (!t || i >= t->n_steps)
        return ferry__err_set(NULL, -EINVAL, "moe trace: step %zu out of range (%zu)", i,
                              t ? t->n_steps : 0);
    if (token)
        *token = t->tok[i];
    if (layer)
        *layer = t->layer[i];
    if (experts)
        *experts = t->ex + t->off[i];
    if (n)
        *n = (uint32_t)(t->off[i + 1] - t->off[i]);
    return 0;
}

/* ---- sorting into (token, layer) order ---- */
typedef struct sort_key {
    uint64_t key;  /* token << 32 | layer */
    size_t idx;
} sort_key;

static int cmp_key(const void *a, const void *b)
{
    const sort_key *x = a, *y = b;
    if (x->key != y->key)
        return x->key < y->key ? -1 : 1;
    return x->idx < y->idx ? -1 : x->idx > y->idx;
}

int ferry__trace_sort(ferry_moe_trace *t)
{
    if (t->sorted)
        return 0;
    size_t n = t->n_steps;
    sort_key *k = ferry__malloc(n * sizeof *k);
    uint32_t *tok = ferry__malloc(n * sizeof *tok);
    uint32_t *lay = ferry__malloc(n * sizeof *lay);
    uint32_t *nt = ferry__malloc(n * sizeof *nt);
    size_t *off = ferry__malloc((n + 1) * sizeof *off);
    uint32_t *ex = ferry__malloc((t->n_ex ? t->n_ex : 1) * sizeof *ex);
    uint32_t *po = t->poff ? ferry__malloc((n + 1) * sizeof *po) : NULL;
    uint32_t *px = t->poff ? ferry__malloc((t->n_pex ? t->n_pex : 1) * sizeof *px) : NULL;
    if (!k || !tok || !lay || !nt || !off || !ex || (t->poff && (!po || !px))) {
        ferry__free(po);
        ferry__free(px);
        ferry__free(k);
        ferry__free(tok);
        ferry__free(lay);
        ferry__free(nt);
        ferry__free(off);
        ferry__free(ex);
        return -ENOMEM;
    }
    for (size_t i = 0; i < n; i++) {
        k[i].key = (uint64_t)t->tok[i] << 32 | t->layer[i];
        k[i].idx = i;
    }
    qsort(k, n, sizeof *k, cmp_key);
    size_t pos = 0;
    off[0] = 0;
    for (size_t i = 0; i < n; i++) {
        size_t s = k[i].idx, len = t->off[s + 1] - t->off[s];
        tok[i] = t->tok[s];
        lay[i] = t->layer[s];
        nt[i] = t->ntok[s];
        memcpy(ex + pos, t->ex + t->off[s], len * sizeof *ex);
        pos += len;
        off[i + 1] = pos;
    }
    if (t->poff) { /* the predictions move with their steps */
        uint32_t pp = 0;
        po[0] = 0;
        for (size_t i = 0; i < n; i++) {
            size_t s = k[i].idx;
            uint32_t len = t->poff[s + 1] - t->poff[s];
            memcpy(px + pp, t->pex + t->poff[s], (size_t)len * sizeof *px);
            pp += len;
            po[i + 1] = pp;
        }
        ferry__free(t->poff);
        ferry__free(t->pex);
        t->poff = po;
        t->pex = px;
        t->cap_pex = t->n_pex ? t->n_pex : 1;
    }
    ferry__free(k);
    ferry__free(t->tok);
    ferry__free(t->layer);
    ferry__free(t->off);
    ferry__free(t->ex);
    t->tok = tok;
    t->layer = lay;
    ferry__free(t->ntok);
    t->ntok = nt;
    t->off = off;
    t->ex = ex;
    t->cap_steps = n;
    t->cap_ex = t->n_ex ? t->n_ex : 1;
    t->sorted = 1;
    return 0;
}

/* ---- parsing ---- */
typedef ferry__trace_parser parser;
#define PERR FERRY__PERR

int ferry__trace_get_uint(json_t *o, const char *field, uint64_t max, size_t line, uint64_t *out,
                          int required)
{
    json_t *v = json_object_get(o, field);
    if (!v) {
        if (required)
            return PERR(line, "field '%s' missing", field);
        return 1;
    }
    if (!json_is_integer(v) || json_integer_value(v) < 0 ||
        (uint64_t)json_integer_value(v) > max)
        return PERR(line, "field '%s': expected an integer in 0..%" PRIu64, field, max);
    *out = (uint64_t)json_integer_value(v);
    return 0;
}
#define get_uint ferry__trace_get_uint

/* the header's optional sparse layer numbers: num_layers of them, rising */
static int parse_layer_ids(parser *ps, json_t *a, size_t line)
{
    ferry_moe_model *m = &ps->t->model;
    if (!json_is_array(a) || json_array_size(a) != m->num_layers)
        return PERR(line, "field 'layer_ids': expected a list of num_layers (%u) layer numbers",
                    m->num_layers);
    uint32_t *ids = ferry__malloc((size_t)m->num_layers * sizeof *ids);
    if (!ids)
        return ferry__err_set(NULL, -ENOMEM, "moe trace line %zu: out of memory", line);
    for (uint32_t i = 0; i < m->num_layers; i++) {
        json_t *v = json_array_get(a, i);
        if (!json_is_integer(v) || json_integer_value(v) < 0 ||
            json_integer_value(v) >= (json_int_t)UINT32_MAX ||
            (i && (uint32_t)json_integer_value(v) <= ids[i - 1])) {
            ferry__free(ids);
            return PERR(line, "field 'layer_ids'[%u]: expected a layer number above the last", i);
        }
        ids[i] = (uint32_t)json_integer_value(v);
    }
    ps->t->layer_ids = ids;
    return 0;
}

static int parse_header(parser *ps, json_t *o, size_t line)
{
    ferry_moe_model *m = &ps->t->model;
    if (ps->have_header || ps->have_routes)
        return PERR(line, "header record after %s", ps->have_header ? "a header" : "routes");
    uint64_t v = 0;
    int rc;
    if ((rc = get_uint(o, "num_layers", MAX_LAYERS, line, &v, 1)) < 0)
        return rc;
    if (v == 0)
        return PERR(line, "field 'num_layers': must be at least 1");
    m->num_layers = (uint32_t)v;
    if ((rc = get_uint(o, "num_experts", MAX_EXPERTS, line, &v, 1)) < 0)
        return rc;
    if (v == 0)
        return PERR(line, "field 'num_experts': must be at least 1");
    m->num_experts = (uint32_t)v;
    rc = get_uint(o, "top_k", m->num_experts, line, &v, 0);
    if (rc < 0)
        return rc;
    if (rc == 0) {
        if (v == 0)
            return PERR(line, "field 'top_k': must be at least 1");
        m->top_k = (uint32_t)v;
        ps->declared_k = 1;
    }
    rc = get_uint(o, "expert_bytes", UINT64_MAX >> 1, line, &v, 0);
    if (rc < 0)
        return rc;
    if (rc == 0)
        m->expert_bytes = v;
    json_t *name = json_object_get(o, "model");
    if (name) {
        if (!json_is_string(name))
            return PERR(line, "field 'model': expected a string");
        /* cut at a character, not inside one: the name saves back as JSON */
        const char *nm = json_string_value(name);
        size_t len = strlen(nm);
        if (len >= sizeof m->name) {
            len = sizeof m->name - 1;
            while (len && ((unsigned char)nm[len] & 0xC0) == 0x80)
                len--;
        }
        memcpy(m->name, nm, len);
        m->name[len] = 0;
    }
    json_t *st = json_object_get(o, "stage");
    if (st) {
        if (!json_is_string(st) || strlen(json_string_value(st)) >= sizeof ps->t->stage)
            return PERR(line, "field 'stage': expected a string of at most %zu bytes",
                        sizeof ps->t->stage - 1);
        snprintf(ps->t->stage, sizeof ps->t->stage, "%s", json_string_value(st));
    }
    json_t *ids = json_object_get(o, "layer_ids");
    if (ids && (rc = parse_layer_ids(ps, ids, line)) < 0)
        return rc;
    ps->have_header = 1;
    return 0;
}

/* read an array of expert ids into ps->buf; returns the count or < 0 */
static int read_route(parser *ps, json_t *arr, const char *field, uint32_t ntok, size_t line)
{
    if (!json_is_array(arr))
        return PERR(line, "field '%s': expected an array of expert ids", field);
    size_t n = json_array_size(arr);
    if (n == 0)
        return PERR(line, "field '%s': empty route", field);
    uint32_t limit = ps->have_header ? ps->t->model.num_experts : MAX_EXPERTS;
    if (ps->declared_k && n > (uint64_t)ps->t->model.top_k * ntok)
        return PERR(line, "field '%s': %zu experts, header top_k is %u (x %u tokens)", field, n,
                    ps->t->model.top_k, ntok);
    if (n > MAX_EXPERTS)
        return PERR(line, "field '%s': %zu experts", field, n);
    if (n > ps->buf_cap) {
        uint32_t *nb = ferry__realloc(ps->buf, n * sizeof *nb);
        if (!nb)
            return ferry__err_set(NULL, -ENOMEM, "moe trace line %zu: out of memory", line);
        ps->buf = nb;
        ps->buf_cap = (uint32_t)n;
    }
    for (size_t i = 0; i < n; i++) {
        json_t *v = json_array_get(arr, i);
        if (!json_is_integer(v) || json_integer_value(v) < 0)
            return PERR(line, "field '%s'[%zu]: expected a non-negative integer", field, i);
        if ((uint64_t)json_integer_value(v) >= limit)
            return PERR(line, "field '%s'[%zu]: expert %" JSON_INTEGER_FORMAT " >= %u experts",
                        field, i, json_integer_value(v), limit);
        ps->buf[i] = (uint32_t)json_integer_value(v);
        if (ps->buf[i] > ps->max_expert)
            ps->max_expert = ps->buf[i];
    }
    return (int)n;
}

static int check_layer(parser *ps, uint64_t layer, size_t line)
{
    uint32_t limit = ps->have_header ? ps->t->model.num_layers : MAX_LAYERS;
    if (layer >= limit)
        return PERR(line, "field 'layer': layer %" PRIu64 " >= %u layers", layer, limit);
    if (layer > ps->max_layer)
        ps->max_layer = (uint32_t)layer;
    return 0;
}

int ferry__trace_add(parser *ps, uint32_t token, uint32_t layer, uint32_t n, uint32_t ntok,
                     size_t line)
{
    if (ps->t->n_steps >= FERRY__TRACE_MAX_STEPS)
        return PERR(line, "more than %zu routing steps; a trace holds at most that many",
                    FERRY__TRACE_MAX_STEPS);
    if (ps->t->n_ex + n > FERRY__TRACE_MAX_IDS)
        return PERR(line, "more than %zu expert ids; a trace holds at most that many",
                    FERRY__TRACE_MAX_IDS);
    if (ferry__trace_push(ps->t, token, layer, ps->buf, n, ntok) < 0)
        return ferry__err_set(NULL, -ENOMEM, "moe trace line %zu: out of memory", line);
    ps->have_routes = 1;
    return 0;
}

static int parse_ferry(parser *ps, json_t *o, size_t line)
{
    if (ps->form == TRACE_FORM_CAPTURE)
        return PERR(line, "a ferry record ('experts') after capture records ('topk_ids'): one "
                          "form per file");
    ps->form = TRACE_FORM_FERRY;
    uint64_t token, layer, ntok = 1;
    int rc;
    if ((rc = get_uint(o, "token", UINT32_MAX - 1, line, &token, 1)) < 0)
        return rc;
    if ((rc = get_uint(o, "layer", UINT32_MAX, line, &layer, 1)) < 0)
        return rc;
    if ((rc = get_uint(o, "tokens", UINT32_MAX / 2, line, &ntok, 0)) < 0)
        return rc;
    if (ntok == 0)
        return PERR(line, "field 'tokens': must be at least 1");
    if ((rc = check_layer(ps, layer, line)) < 0)
        return rc;
    int n = read_route(ps, json_object_get(o, "experts"), "experts", (uint32_t)ntok, line);
    if (n < 0)
        return n;
    if ((rc = ferry__trace_add(ps, (uint32_t)token, (uint32_t)layer, (uint32_t)n, (uint32_t)ntok,
                               line)) < 0)
        return rc;
    return ferry__trace_read_pred(ps, json_object_get(o, "pred"), "pred", 0,
                                  ps->have_header ? ps->t->model.num_experts : MAX_EXPERTS, line);
}

/* one list of ids < E into the prediction (union, first seen order) */
static int pred_list(ferry__trace_parser *ps, json_t *a, const char *field, size_t i, uint32_t E,
                     size_t line, uint32_t *n)
{
    if (!json_is_array(a))
        return PERR(line, "field '%s'[%zu]: expected a list of expert ids", field, i);
    for (size_t j = 0; j < json_array_size(a); j++) {
        json_t *v = json_array_get(a, j);
        if (!json_is_integer(v) || json_integer_value(v) < 0 ||
            (uint64_t)json_integer_value(v) >= E)
            return PERR(line, "field '%s': expected expert ids in 0..%u", field, E - 1);
        uint32_t e = (uint32_t)json_integer_value(v);
        if (e > ps->max_expert) /* a shape without a header covers these too */
            ps->max_expert = e;
        if (ps->pmark[e] != ps->pmark_gen) {
            ps->pmark[e] = ps->pmark_gen;
            ps->pbuf[(*n)++] = e;
        }
    }
    return 0;
}

int ferry__trace_read_pred(ferry__trace_parser *ps, json_t *v, const char *field, int lists,
                           uint32_t E, size_t line)
{
    if (!v)
        return 0;
    if (!ps->pbuf) {
        ps->pbuf = ferry__malloc(FERRY_MOE_MAX_EXPERTS * sizeof *ps->pbuf);
        ps->pmark = ferry__calloc(FERRY_MOE_MAX_EXPERTS, sizeof *ps->pmark);
        if (!ps->pbuf || !ps->pmark)
            return ferry__err_set(NULL, -ENOMEM, "moe trace line %zu: out of memory", line);
    }
    if (++ps->pmark_gen == 0) {
        memset(ps->pmark, 0, FERRY_MOE_MAX_EXPERTS * sizeof *ps->pmark);
        ps->pmark_gen = 1;
    }
    if (!json_is_array(v))
        return PERR(line, "field '%s': expected a list", field);
    uint32_t n = 0;
    int rc = 0;
    if (!lists)
        rc = pred_list(ps, v, field, 0, E, line, &n);
    for (size_t i = 0; lists && i < json_array_size(v) && rc == 0; i++)
        rc = pred_list(ps, json_array_get(v, i), field, i, E, line, &n);
    if (rc < 0)
        return rc;
    if (ps->t->n_pex + n > FERRY__TRACE_MAX_IDS)
        return PERR(line, "more than %zu predicted expert ids; a trace holds at most that many",
                    FERRY__TRACE_MAX_IDS);
    if (n && ferry__trace_set_pred(ps->t, ps->pbuf, n) < 0)
        return ferry__err_set(NULL, -ENOMEM, "moe trace line %zu: out of memory", line);
    return 0;
}

/* "model.layers.12.mlp.gate" -> 12 */
int ferry__trace_module_layer(const char *s, uint64_t *out)
{
    const char *p = s;
    while ((p = strstr(p, "layers.")) != NULL) {
        p += 7;
        if (*p >= '0' && *p <= '9') {
            uint64_t v = 0;
            while (*p >= '0' && *p <= '9' && v <= UINT32_MAX)
                v = v * 10 + (uint64_t)(*p++ - '0');
            if (*p && *p != '.')
                continue;
            *out = v;
            return 0;
        }
    }
    return -1;
}

static int parse_line(parser *ps, const char *s, size_t len, size_t line)
{
    json_error_t je;
    json_t *o = json_loadb(s, len, JSON_REJECT_DUPLICATES, &je);
    if (!o)
        return PERR(line, "not JSON: %s (column %d)", je.text, je.column);
    int rc;
    if (!json_is_object(o))
        rc = PERR(line, "expected a JSON object");
    else if (json_object_get(o, "experts"))
        rc = parse_ferry(ps, o, line);
    else if (json_object_get(o, "topk_ids"))
        rc = ferry__capture_record(ps, o, line);
    else if (json_object_get(o, "counts"))
        rc = PERR(line, "a counts-only record ('counts' without 'topk_ids'): it says how often "
                        "each expert was chosen, not which token chose which, so it cannot be "
                        "replayed; log the per-token routes ('topk_ids') at the apply step");
    else if (json_object_get(o, "num_layers"))
        rc = parse_header(ps, o, line);
    else if (json_object_get(o, "layer"))
        rc = PERR(line, "a record with a 'layer' but no routes: neither 'topk_ids' (a capture) "
                        "nor 'experts' (ferry's form)");
    else if (json_object_get(o, "num_experts"))
        rc = parse_header(ps, o, line);
    else
        rc = PERR(line, "neither a header nor a route record (no 'experts' or 'topk_ids' field)");
    json_decref(o);
    return rc;
}

static int parser_open(parser *ps, const ferry_moe_trace_options *opt)
{
    memset(ps, 0, sizeof *ps);
    static const ferry__sized sized =
        FERRY__SIZED0(ferry_moe_trace_options, FERRY_MOE_TRACE_OPTIONS_MIN_SIZE);
    int rc;
    if (opt && (rc = ferry__opts_size_ok(NULL, "moe trace", &sized, opt->size)) < 0)
        return rc;
    if (opt && opt->stage && strlen(opt->stage) >= FERRY__TRACE_STAGE_LEN)
        return ferry__err_set(NULL, -EINVAL, "moe trace: stage '%.40s...' longer than %d bytes",
                              opt->stage, FERRY__TRACE_STAGE_LEN - 1);
    ps->want_stage = opt ? opt->stage : NULL;
    if (trace_new(&ps->t) < 0)
        return ferry__err_set(NULL, -ENOMEM, "moe trace: out of memory");
    snprintf(ps->t->model.name, sizeof ps->t->model.name, "capture");
    return 0;
}

/* one line without its newline; blank lines are skipped */
static int parser_line(parser *ps, const char *s, size_t n, size_t line)
{
    if (n > FERRY__TRACE_MAX_LINE)
        return PERR(line, "line longer than %zu bytes", FERRY__TRACE_MAX_LINE);
    size_t m = n;
    while (m && (s[m - 1] == '\r' || s[m - 1] == ' ' || s[m - 1] == '\t'))
        m--;
    size_t b = 0;
    while (b < m && (s[b] == ' ' || s[b] == '\t'))
        b++;
    if (b == m)
        return 0;
    return parse_line(ps, s + b, m - b, line);
}

/* rc: the parse so far; the trace goes to *out or is freed */
static int parser_close(parser *ps, int rc, size_t lines, ferry_moe_trace **out)
{
    if (rc == 0 && ps->form == TRACE_FORM_CAPTURE)
        rc = ferry__capture_close(ps);
    else if (rc == 0 && !ps->have_routes)
        rc = ferry__err_set(NULL, FERRY_EPARSE, "moe trace: no route records in %zu lines", lines);
    else if (rc == 0 && ps->want_stage && strcmp(ps->want_stage, ps->t->stage))
        rc = ferry__err_set(NULL, FERRY_EPARSE,
                            "moe trace: stage '%s' asked for; a trace in ferry's form holds "
                            "one stage, '%s'", ps->want_stage, ps->t->stage);
    else if (rc == 0 && !ps->have_header) {
        ps->t->model.num_layers = ps->max_layer + 1;
        ps->t->model.num_experts = ps->max_expert + 1;
    }
    if (rc == 0 && ferry__trace_sort(ps->t) < 0)
        rc = ferry__err_set(NULL, -ENOMEM, "moe trace: out of memory sorting %zu steps",
                            ps->t->n_steps);
    ferry__capture_free(ps);
    ferry__free(ps->buf);
    ferry__free(ps->pbuf);
    ferry__free(ps->pmark);
    if (rc < 0) {
        ferry_moe_trace_destroy(ps->t);
        return rc;
    }
    *out = ps->t;
    return 0;
}

int ferry_moe_trace_parse_opts(const char *buf, size_t len, const ferry_moe_trace_options *opt,
                               ferry_moe_trace **out)
{
    if (!out || (!buf && len))
        return ferry__err_set(NULL, -EINVAL, "moe trace: no buffer");
    parser ps;
    int rc = parser_open(&ps, opt);
    if (rc < 0)
        return rc;
    size_t line = 0, pos = 0;
    while (pos < len && rc == 0) {
        const char *s = buf + pos;
        const char *nl = memchr(s, '\n', len - pos);
        size_t n = nl ? (size_t)(nl - s) : len - pos;
        pos += n + (nl ? 1 : 0);
        rc = parser_line(&ps, s, n, ++line);
    }
    return parser_close(&ps, rc, line, out);
}

/* the file a line at a time: memory is the trace plus one line */
static int load_stream(FILE *f, const char *path, parser *ps, size_t *lines)
{
    enum { BLOCK = 1 << 16 };
    char *blk = ferry__malloc(BLOCK);
    char *ln = ferry__malloc(FERRY__TRACE_MAX_LINE + 1);
    if (!blk || !ln) {
        ferry__free(blk);
        ferry__free(ln);
        return ferry__err_set(NULL, -ENOMEM, "moe trace %s: out of memory", path);
    }
    size_t have = 0; /* bytes of the current line in ln */
    uint64_t total = 0;
    int rc = 0, overlong = 0;
    for (;;) {
        size_t got = fread(blk, 1, BLOCK, f);
        if (got == 0) {
            if (ferror(f))
                rc = ferry__err_set(NULL, -EIO, "moe trace %s: read error at byte %llu", path,
                                    (unsigned long long)total);
            break;
        }
        total += got;
        if (total > FERRY__TRACE_MAX_BYTES) {
            rc = ferry__err_set(NULL, FERRY_EPARSE, "moe trace %s: larger than %llu bytes", path,
                                (unsigned long long)FERRY__TRACE_MAX_BYTES);
            break;
        }
        size_t i = 0;
        while (i < got && rc == 0) {
            const char *nl = memchr(blk + i, '\n', got - i);
            size_t n = nl ? (size_t)(nl - (blk + i)) : got - i;
            if (have + n > FERRY__TRACE_MAX_LINE) {
                /* refused as soon as it is too long, not at its end */
                overlong = 1;
                rc = parser_line(ps, ln, FERRY__TRACE_MAX_LINE + 1, *lines + 1);
                break;
            }
            memcpy(ln + have, blk + i, n);
            have += n;
            i += n;
            if (nl) {
                i++;
                rc = parser_line(ps, ln, have, ++*lines);
                have = 0;
            }
        }
        if (rc < 0)
            break;
    }
    if (rc == 0 && have)
        rc = parser_line(ps, ln, have, ++*lines);
    if (overlong)
        ++*lines;
    ferry__free(blk);
    ferry__free(ln);
    return rc;
}

int ferry_moe_trace_parse(const char *buf, size_t len, ferry_moe_trace **out)
{
    return ferry_moe_trace_parse_opts(buf, len, NULL, out);
}

int ferry_moe_trace_load(const char *path, ferry_moe_trace **out)
{
    return ferry_moe_trace_load_opts(path, NULL, out);
}

/* parse the stream f (closed here), named path in messages; a socket is
 * taken as a pipe is where sock_ok */
static int load_file(FILE *f, const char *path, const ferry_moe_trace_options *opt, int sock_ok,
                     ferry_moe_trace **out)
{
    struct stat st;
    if (fstat(fileno(f), &st) != 0) {
        int e = errno;
        fclose(f);
        return ferry__err_set(NULL, -e, "moe trace %s: stat: %s", path, strerror(e));
    }
    if (!S_ISREG(st.st_mode) && !S_ISFIFO(st.st_mode) && !(sock_ok && S_ISSOCK(st.st_mode))) {
        int tty = isatty(fileno(f));
        fclose(f);
        return ferry__err_set(NULL, -EINVAL, "moe trace %s: not a regular file or a pipe (%s)",
                              path, S_ISDIR(st.st_mode)    ? "a directory"
                                    : tty                  ? "a terminal"
                                    : S_ISCHR(st.st_mode)  ? "a character device"
                                    : S_ISBLK(st.st_mode)  ? "a block device"
                                    : S_ISSOCK(st.st_mode) ? "a socket"
                                                           : "another kind of file");
    }
    parser ps;
    int rc = parser_open(&ps, opt);
    if (rc < 0) {
        fclose(f);
        return rc;
    }
    size_t lines = 0;
    rc = load_stream(f, path, &ps, &lines);
    fclose(f);
    rc = parser_close(&ps, rc, lines, out);
    if (rc < 0 && !strstr(ferry_last_error(), path)) {
        char msg[FERRY__ERRMSG_MAX];
        snprintf(msg, sizeof msg, "%s", ferry_last_error());
        ferry__err_set(NULL, rc, "%s: %s", path, msg);
    }
    return rc;
}

int ferry_moe_trace_load_opts(const char *path, const ferry_moe_trace_options *opt,
                              ferry_moe_trace **out)
{
    if (!path || !out)
        return ferry__err_set(NULL, -EINVAL, "moe trace: no path");
    FILE *f = fopen(path, "rb");
    if (!f) {
        int e = errno;
        return ferry__err_set(NULL, -e, "moe trace %s: open: %s", path, strerror(e));
    }
    return load_file(f, path, opt, 0, out);
}

int ferry__moe_trace_load_fd(int fd, const char *name, const ferry_moe_trace_options *opt,
                             ferry_moe_trace **out)
{
    if (!name || !out)
        return ferry__err_set(NULL, -EINVAL, "moe trace: no name");
    /* the descriptor itself, not /dev/stdin opened again: that fails on a
     * socket (ENXIO) and reads a redirected file from its start */
    int d = dup(fd);
    FILE *f = d >= 0 ? fdopen(d, "rb") : NULL;
    if (!f) {
        int e = errno;
        if (d >= 0)
            close(d);
        return ferry__err_set(NULL, -e, "moe trace %s: open: %s", name, strerror(e));
    }
    return load_file(f, name, opt, 1, out);
}

/* 0 when t may be written (the checks before a file is opened) */
static int check_savable(const ferry_moe_trace *t, const char *path)
{
    if (!t || !path)
        return ferry__err_set(NULL, -EINVAL, "moe trace save: no trace or path");
    /* what is written must load back: the reader refuses a trace of no
     * routes, and holds its steps in (token, layer) order */
    if (!t->n_steps)
        return ferry__err_set(NULL, -EINVAL,
                              "moe trace save %s: the trace has no steps (a trace of no "
                              "routes does not load)", path);
    for (size_t i = 1; i < t->n_steps && !t->sorted; i++)
        if (t->tok[i] < t->tok[i - 1] ||
            (t->tok[i] == t->tok[i - 1] && t->layer[i] < t->layer[i - 1]))
            return ferry__err_set(NULL, -EINVAL,
                                  "moe trace save %s: step %zu (token %u, layer %u) comes after "
                                  "token %u layer %u: it would load back in (token, layer) "
                                  "order, not this one",
                                  path, i, t->tok[i], t->layer[i], t->tok[i - 1], t->layer[i - 1]);
    return 0;
}

static int save_file(const ferry_moe_trace *t, FILE *f, const char *path);

int ferry_moe_trace_save(const ferry_moe_trace *t, const char *path)
{
    int rc = check_savable(t, path);
    if (rc < 0)
        return rc;
    FILE *f = fopen(path, "w");
    if (!f) {
        int e = errno;
        return ferry__err_set(NULL, -e, "moe trace save %s: open: %s", path, strerror(e));
    }
    return save_file(t, f, path);
}

int ferry__moe_trace_save_fd(const ferry_moe_trace *t, int fd, const char *name)
{
    int rc = check_savable(t, name);
    if (rc < 0)
        return rc;
    /* the descriptor itself, not /dev/stdout opened again: that truncated
     * a file opened for appending and fails on a socket (ENXIO) */
    int d = dup(fd);
    FILE *f = d >= 0 ? fdopen(d, "w") : NULL;
    if (!f) {
        int e = errno;
        if (d >= 0)
            close(d);
        return ferry__err_set(NULL, -e, "moe trace save %s: open: %s", name, strerror(e));
    }
    return save_file(t, f, name);
}

/* write t to f (closed here), named path in messages */
static int save_file(const ferry_moe_trace *t, FILE *f, const char *path)
{
    json_t *h = json_pack("{s:s,s:i,s:i,s:i,s:I}", "model", t->model.name, "num_layers",
                          (int)t->model.num_layers, "num_experts", (int)t->model.num_experts,
                          "top_k", (int)t->model.top_k, "expert_bytes",
                          (json_int_t)t->model.expert_bytes);
    /* a route of repeated ids may be wider than the experts: the reader
     * takes no such top_k, and finds the same one from the routes */
    if (h && t->model.top_k > t->model.num_experts)
        json_object_del(h, "top_k");
    if (h && t->stage[0])
        json_object_set_new(h, "stage", json_string(t->stage));
    if (h && t->layer_ids) {
        json_t *ids = json_array();
        for (uint32_t l = 0; l < t->model.num_layers; l++)
            json_array_append_new(ids, json_integer(t->layer_ids[l]));
        json_object_set_new(h, "layer_ids", ids);
    }
    char *hs = h ? json_dumps(h, JSON_COMPACT | JSON_PRESERVE_ORDER) : NULL;
    json_decref(h);
    if (!hs) {
        fclose(f);
        return ferry__err_set(NULL, -ENOMEM, "moe trace save %s: out of memory", path);
    }
    fprintf(f, "%s\n", hs);
    free(hs);
    for (size_t i = 0; i < t->n_steps; i++) {
        if (t->ntok[i] != 1)
            fprintf(f, "{\"token\":%u,\"layer\":%u,\"tokens\":%u,\"experts\":[", t->tok[i],
                    t->layer[i], t->ntok[i]);
        else
            fprintf(f, "{\"token\":%u,\"layer\":%u,\"experts\":[", t->tok[i], t->layer[i]);
        for (size_t j = t->off[i]; j < t->off[i + 1]; j++) {
            if (j != t->off[i])
                fputc(',', f);
            fprintf(f, "%u", t->ex[j]);
        }
        if (t->poff && t->poff[i + 1] > t->poff[i]) {
            fputs("],\"pred\":[", f);
            for (uint32_t j = t->poff[i]; j < t->poff[i + 1]; j++)
                fprintf(f, "%s%u", j != t->poff[i] ? "," : "", t->pex[j]);
        }
        fputs("]}\n", f);
    }
    int bad = ferror(f);
    if (fclose(f) != 0 || bad) {
        int e = errno ? errno : EIO;
        return ferry__err_set(NULL, -e, "moe trace save %s: write: %s", path, strerror(e));
    }
    return 0;
}
