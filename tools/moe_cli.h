/*
 * moe_cli.h - what the `ferry moe` commands share (cmd_moe.c, cmd_moe_sim.c).
 */
#ifndef FERRY_TOOLS_MOE_CLI_H
#define FERRY_TOOLS_MOE_CLI_H

#include <jansson.h>

#include "ferry/moe.h"

/* "N" or "P%" of the trace's layers x experts: top_k..all, never adjusted;
 * 0, or 2 after a usage message */
int moe_parse_slots(const char *cmd, const char *flag, const char *s, const ferry_moe_model *m,
                    uint32_t *out);
/* "3 layers x 256 experts (model layers 3, 17, 38), stage 'apply'" */
void moe_layers_desc(const ferry_moe_trace *t, char *buf, size_t n);
/* layers, experts, layer_ids (sparse only), stage into j */
void moe_shape_json(json_t *j, const ferry_moe_trace *t);
/* split "a,b,c" in place into at most max pieces; -1 for an empty piece or
 * more than max */
int moe_split_list(char *s, char **out, int max);
/* ferry_moe_trace_load_opts of a TRACE argument: "-" is standard input */
int moe_trace_load(const char *path, const ferry_moe_trace_options *o, ferry_moe_trace **out);
/* "lru, lru-layer, ..." */
int moe_policy_list(char *acc, size_t n);

/* a prefetch of rows on NVMe: prefetch_start's return, the rows landed,
 * and the synchronous apply of the same plan (medians, us) */
typedef struct moe_prefetch_bench {
    double start_us, landed_us, sync_us;
    uint32_t rows;
    size_t row_bytes;
} moe_prefetch_bench;
int moe_bench_file_prefetch(const char *cmd, const char *backend, size_t row_bytes,
                            uint32_t nrows, int rounds, moe_prefetch_bench *out);

#endif
