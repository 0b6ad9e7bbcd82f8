/*
 * trace_parse.h - the routing-trace reader's state, shared by trace.c
 * (ferry's own form, the line loop, headers) and trace_capture.c (engine
 * captures: stages, logged layers, multi-token records).
 *
 * Memory is bounded whatever the input: one line at a time, the trace
 * bounds of moe_internal.h, at most FERRY__TRACE_MAX_STAGES stages and
 * FERRY_MOE_MAX_LAYERS distinct layers, one byte per step for its stage.
 */
#ifndef FERRY_MOE_TRACE_PARSE_H
#define FERRY_MOE_TRACE_PARSE_H

#include <jansson.h>

#include "moe/moe_internal.h"

#define FERRY__TRACE_MAX_STAGES 8
#define FERRY__TRACE_STAGE_LEN 32
/* the stage a capture applies experts at: the default one */
#define FERRY__TRACE_APPLY_STAGE "apply"

enum { TRACE_FORM_NONE = 0, TRACE_FORM_FERRY = 1, TRACE_FORM_CAPTURE = 2 };

typedef struct ferry__trace_parser {
    ferry_moe_trace *t;
    const char *want_stage; /* the stage asked for; NULL: chosen at close */
    int have_header, have_routes, declared_k, form;
    uint32_t max_layer, max_expert;
    uint32_t *buf; /* one route */
    uint32_t buf_cap;
    /* captures */
    uint32_t cap_experts, cap_k; /* what the records carry (0: not yet) */
    size_t cap_experts_line;
    uint32_t n_lid;
    uint32_t *lid;  /* FERRY_MOE_MAX_LAYERS: sorted model layer ids seen */
    uint32_t *pass; /* STAGES x MAX_LAYERS: records so far per (stage, lid) */
    int n_stages;
    char stage[FERRY__TRACE_MAX_STAGES][FERRY__TRACE_STAGE_LEN];
    uint64_t stage_records[FERRY__TRACE_MAX_STAGES];
    uint32_t widest[FERRY__TRACE_MAX_STAGES]; /* widest per-token list */
    uint8_t *stage_of; /* per step (only while the stage is not chosen) */
    size_t stage_cap;
    uint32_t *mark; /* FERRY_MOE_MAX_EXPERTS: union of a record's lists */
    uint32_t mark_gen;
    uint32_t *pbuf; /* a prediction (FERRY_MOE_MAX_EXPERTS) */
    uint32_t *pmark, pmark_gen;
} ferry__trace_parser;

#define FERRY__PERR(line, fmt, ...) \
    ferry__err_set(NULL, FERRY_EPARSE, "moe trace line %zu: " fmt, (size_t)(line), ##__VA_ARGS__)

/* a non-negative integer field <= max: 0, 1 when absent and not required,
 * or FERRY_EPARSE naming the line and field */
int ferry__trace_get_uint(json_t *o, const char *field, uint64_t max, size_t line, uint64_t *out,
                          int required);
/* append one step without checking the shape (the callers have); -ENOMEM */
int ferry__trace_push(ferry_moe_trace *t, uint32_t token, uint32_t layer, const uint32_t *experts,
                      uint32_t n, uint32_t ntok);
/* a record's prediction field (an array of ids, or with lists=1 of per-token
 * lists) into the last step pushed: 0, FERRY_EPARSE naming the line, -ENOMEM */
int ferry__trace_read_pred(ferry__trace_parser *ps, json_t *v, const char *field, int lists,
                           uint32_t E, size_t line);
/* the step bounds (FERRY_EPARSE naming the line) then push */
int ferry__trace_add(ferry__trace_parser *ps, uint32_t token, uint32_t layer, uint32_t n,
                     uint32_t ntok, size_t line);
/* "model.layers.12.mlp.experts" -> 12; -1 when no 'layers.N' */
int ferry__trace_module_layer(const char *s, uint64_t *out);

/* one capture record (it has 'topk_ids') */
int ferry__capture_record(ferry__trace_parser *ps, json_t *o, size_t line);
/* after the last line: the stage, the shape and the logged layers */
int ferry__capture_close(ferry__trace_parser *ps);
void ferry__capture_free(ferry__trace_parser *ps);

#endif
