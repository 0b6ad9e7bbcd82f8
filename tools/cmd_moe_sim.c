/*
 * cmd_moe_sim.c - `ferry moe sim`: the decode timeline of a trace for each
 * policy, with and without hints, next to its two bounds.
 *
 *   ferry moe sim TRACE [--budgets 12.5%,25%] [--policies lru,auto]
 *                 [--compute-us F] [--link-gbs F] [--nvme-share F --nvme-gbs F]
 *                 [--expert-bytes SIZE] [--model M]
 *                 [--hint-steps N] [--hint-accuracy F] [--hints made|trace] [--seed S]
 *                 [--stage S] [--json] [--plot FILE.png]
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <jansson.h>

#include "cli.h"
#include "moe_cli.h"

#define MAX_BUDGETS 16
#define MAX_POLICIES 8
/* rows of one budget: each policy without and with hints, then 2 bounds */
#define MAX_ROWS (MAX_POLICIES * 2 + 2)

typedef struct row {
    char label[48];
    int hints;
    ferry_moe_sim_result r;
} row;

static void usage(void)
{
    printf("usage: ferry moe sim TRACE [--budgets 12.5%%,25%%] [--policies lru,auto]\n"
           "          [--compute-us F] [--link-gbs F] [--nvme-share F --nvme-gbs F]\n"
           "          [--expert-bytes SIZE] [--model M]\n"
           "          [--hint-steps N] [--hint-accuracy F] [--hints made|trace]\n"
           "          [--seed S] [--stage S]\n"
           "          [--json] [--plot FILE.png]\n"
           "a decode timeline: compute and the copy link as two streams; per budget and\n"
           "policy, without hints and with hints of the step N layer-steps ahead made\n"
           "from the trace (a share 1 - F of each replaced by wrong experts); next to\n"
           "every expert resident and Belady's misses on a link that never idles.\n"
           "  --budgets        up to %d slot counts or P%% (of layers x experts)\n"
           "  --policies       up to %d (default lru,auto: the baseline and the default)\n"
           "  --compute-us     per layer-step, (0, 1e9] (default 100)\n"
           "  --link-gbs       host -> device, (0, 1e6] (default 25)\n"
           "  --nvme-share     0..1 of the experts' rows on NVMe (default 0), copied at\n"
           "  --nvme-gbs       (0, 1e6], NVMe -> device\n"
           "  --expert-bytes   1..1T (default: the trace's)\n"
           "  --model          a generator preset whose expert bytes to use (instead of\n"
           "                   --expert-bytes)\n"
           "  --hint-steps     0..1048576 layer-steps ahead (default 1; 0: none)\n"
           "  --hint-accuracy  0..1 (default 0.9; with --hints trace, the predictions'\n"
           "                   confidence)\n"
           "  --hints          made (from the routes, default) or trace (the records'\n"
           "                   own pred_ids)\n",
           MAX_BUDGETS, MAX_POLICIES);
}

static json_t *row_json(const row *w, uint32_t slots)
{
    const ferry_moe_sim_result *r = &w->r;
    return json_pack("{s:s,s:b,s:i,s:f,s:f,s:f,s:f,s:I,s:I,s:I,s:I}", "policy", w->label, "hints",
                     w->hints, "slots", (int)slots, "tokens_per_s", r->tokens_per_s, "stall_us",
                     r->stall_us, "total_us", r->total_us, "no_wait_share", r->no_wait_share,
                     "hits", (json_int_t)r->hits, "misses", (json_int_t)r->misses, "bytes_moved",
                     (json_int_t)r->bytes_moved, "prefetch_wasted_bytes",
                     (json_int_t)r->prefetch_wasted_bytes);
}

static void row_text(const row *w, uint32_t slots, double pct)
{
    const ferry_moe_sim_result *r = &w->r;
    printf("%-7u %5.1f%% %-25s %10.1f %11.2f %7.1f%% %10.2f %7.2f%%\n", slots, pct, w->label,
           r->tokens_per_s, r->stall_us / 1e3, 100 * r->no_wait_share,
           (double)r->bytes_moved / 1e9,
           r->hits + r->misses ? 100.0 * r->hits / (double)(r->hits + r->misses) : 100.0);
}

static int plot(const char *cmd, const char *png, const char *title, int nb, const double *pct,
                int nr, row *rows)
{
    char dat[] = "/tmp/ferry-moe-sim-XXXXXX";
    int fd = mkstemp(dat);
    if (fd < 0)
        return cli_fail(cmd, "plot data file", -errno);
    FILE *f = fdopen(fd, "w");
    for (int b = 0; b < nb; b++) {
        fprintf(f, "%.4f", pct[b]);
        for (int k = 0; k < nr; k++)
            fprintf(f, " %.3f", rows[b * nr + k].r.stall_us / 1e3);
        fprintf(f, "\n");
    }
    fclose(f);
    FILE *g = popen("gnuplot 2>&1", "w");
    if (!g) {
        unlink(dat);
        return cli_fail(cmd, "gnuplot", -errno);
    }
    fprintf(g, "set terminal pngcairo size 900,560\nset output '%s'\n", png);
    fprintf(g, "set title '%s'\nset xlabel 'slots (%% of the trace''s experts)'\n"
               "set ylabel 'stall (ms)'\nset key top right\nset grid\nplot ", title);
    for (int k = 0; k < nr; k++)
        fprintf(g, "%s'%s' using 1:%d with linespoints title '%s'", k ? ", " : "", dat, k + 2,
                rows[k].label);
    fprintf(g, "\n");
    int st = pclose(g);
    unlink(dat);
    if (st != 0) {
        fprintf(stderr, "ferry %s: gnuplot failed (status %d)\n", cmd, st);
        return 1;
    }
    return 0;
}

/* 1 when some step of t carries the engine's own prediction */
static int trace_predicts(const ferry_moe_trace *t)
{
    size_t n = ferry_moe_trace_steps(t);
    for (size_t i = 0; i < n; i++) {
        const uint32_t *pr = NULL;
        uint32_t np = 0;
        if (ferry_moe_trace_step_pred(t, i, &pr, &np) == 0 && np)
            return 1;
    }
    return 0;
}

/* every row of one budget */
static int run_budget(const ferry_moe_trace *t, ferry_moe_sim_options o, int np, char **pols,
                      row *rows, int *nr)
{
    int k = 0, rc = 0;
    uint32_t h = o.hint_steps;
    for (int p = 0; p < np && rc == 0; p++)
        for (int hints = 0; hints < 2 && rc == 0; hints++) {
            if (hints && (!h || !strcmp(pols[p], "belady")))
                continue;
            o.policy = pols[p];
            o.hint_steps = hints ? h : 0;
            row *w = &rows[k++];
            if (hints)
                snprintf(w->label, sizeof w->label, "%s+hints", pols[p]);
            else
                snprintf(w->label, sizeof w->label, "%s", pols[p]);
            w->hints = hints;
            w->r.size = sizeof w->r;
            rc = ferry_moe_sim(t, &o, &w->r);
        }
    if (rc == 0) {
        o.hint_steps = 0;
        snprintf(rows[k].label, sizeof rows[k].label, "bound: all resident");
        snprintf(rows[k + 1].label, sizeof rows[k + 1].label, "bound: belady, ideal link");
        rows[k].hints = rows[k + 1].hints = 0;
        rows[k].r.size = rows[k + 1].r.size = sizeof rows[k].r;
        rc = ferry_moe_sim_bounds(t, &o, &rows[k].r, &rows[k + 1].r);
        k += 2;
    }
    *nr = k;
    return rc;
}

static int sim_run(const char *cmd, const ferry_moe_trace *t, const ferry_moe_sim_options *o,
                   char *budgets_s, char *policies_s, int json, const char *png)
{
    const ferry_moe_model *m = ferry_moe_trace_model(t);
    char *bl[MAX_BUDGETS], *pl[MAX_POLICIES];
    int nb = moe_split_list(budgets_s, bl, MAX_BUDGETS);
    int np = moe_split_list(policies_s, pl, MAX_POLICIES);
    if (nb < 0)
        return cli_bad(cmd, "--budgets", budgets_s, "1..16 comma-separated slot counts or P%",
                       "an empty piece or more than 16");
    uint32_t slots[MAX_BUDGETS];
    double pct[MAX_BUDGETS];
    uint64_t all = (uint64_t)m->num_layers * m->num_experts;
    for (int b = 0; b < nb; b++) {
        if (moe_parse_slots(cmd, "--budgets", bl[b], m, &slots[b]))
            return 2;
        pct[b] = 100.0 * slots[b] / (double)all;
    }
    row *rows = calloc((size_t)nb * MAX_ROWS, sizeof *rows);
    if (!rows)
        return cli_fail(cmd, "sim", -ENOMEM);
    uint64_t B = o->expert_bytes ? o->expert_bytes : m->expert_bytes;
    if (!json) {
        char ld[256];
        moe_layers_desc(t, ld, sizeof ld);
        printf("trace: %s, %s, top-%u, %u passes, %zu steps\n", m->name, ld, m->top_k,
               ferry_moe_trace_tokens(t), ferry_moe_trace_steps(t));
        printf("link %.1f GB/s, %.1f MB per expert (%.1f us), compute %.1f us per layer-step",
               o->link_gbs, (double)B / 1e6, (double)B / (o->link_gbs * 1e3), o->compute_us);
        if (o->nvme_share > 0)
            printf("; %.0f%% of experts on NVMe at %.1f GB/s", 100 * o->nvme_share, o->nvme_gbs);
        if (o->hint_steps && o->hint_trace)
            printf("; hints %u layer-steps ahead from the trace's predictions, confidence "
                   "%.0f%%", o->hint_steps, 100 * o->hint_accuracy);
        else if (o->hint_steps)
            printf("; hints %u layer-steps ahead, %.0f%% right", o->hint_steps,
                   100 * o->hint_accuracy);
        printf("\n%-7s %6s %-25s %10s %11s %8s %10s %8s\n", "slots", "%all", "policy", "tokens/s",
               "stall ms", "no-wait", "GB moved", "hits");
    }
    json_t *arr = json_array();
    int rc = 0, nr = 0;
    for (int b = 0; b < nb && rc == 0; b++) {
        ferry_moe_sim_options ob = *o;
        ob.slots = slots[b];
        rc = run_budget(t, ob, np, pl, rows + (size_t)b * MAX_ROWS, &nr);
        for (int k = 0; k < nr && rc == 0; k++) {
            const row *w = &rows[(size_t)b * MAX_ROWS + k];
            if (json) {
                json_t *e = row_json(w, slots[b]);
                moe_shape_json(e, t);
                json_array_append_new(arr, e);
            } else {
                row_text(w, slots[b], pct[b]);
            }
        }
        fflush(stdout);
    }
    if (rc < 0) {
        free(rows);
        json_decref(arr);
        return cli_fail(cmd, "sim", rc);
    }
    if (json) {
        char *s = json_dumps(arr, JSON_COMPACT | JSON_PRESERVE_ORDER);
        printf("%s\n", s ? s : "[]");
        free(s);
    }
    json_decref(arr);
    int ret = 0;
    if (png) {
        /* the rows packed per budget, as plot() reads them */
        row *packed = calloc((size_t)nb * nr, sizeof *packed);
        if (!packed) {
            free(rows);
            return cli_fail(cmd, "plot", -ENOMEM);
        }
        for (int b = 0; b < nb; b++)
            memcpy(packed + (size_t)b * nr, rows + (size_t)b * MAX_ROWS, (size_t)nr * sizeof *rows);
        char title[200];
        snprintf(title, sizeof title, "%s: stall against budget, %.0f us compute, %.0f GB/s",
                 m->name, o->compute_us, o->link_gbs);
        ret = plot(cmd, png, title, nb, pct, nr, packed);
        free(packed);
        if (ret == 0 && !json)
            printf("plot: %s\n", png);
    }
    free(rows);
    return ret;
}

/* what no single option shows, before the trace is read: 0 or 2 (printed) */
static int sim_check(const char *cmd, const ferry_moe_sim_options *o, const char *pols,
                     const char *hint_flag, const char *stage)
{
    char check[256], acc[256], *pl[MAX_POLICIES];
    snprintf(check, sizeof check, "%s", pols);
    moe_policy_list(acc, sizeof acc);
    int np = moe_split_list(check, pl, MAX_POLICIES);
    if (np < 0)
        return cli_bad(cmd, "--policies", pols, acc, "an empty piece or more than %d",
                       MAX_POLICIES);
    for (int p = 0; p < np; p++)
        if (!ferry_moe_policy_describe(pl[p]))
            return cli_bad(cmd, "--policies", pols, acc, "unknown policy '%s'", pl[p]);
    /* an option the run would ignore is refused */
    if (hint_flag && !o->hint_steps)
        return cli_usage(cmd, "%s with --hint-steps 0: no hints are given then; accepted: "
                              "--hint-steps N (1 or more) %s ...", hint_flag, hint_flag);
    if (o->nvme_gbs > 0 && o->nvme_share <= 0)
        return cli_usage(cmd, "--nvme-gbs %g: the link of the experts on NVMe; accepted: "
                              "--nvme-share F (above 0) --nvme-gbs G", o->nvme_gbs);
    if (o->nvme_share > 0 && o->nvme_gbs <= 0)
        return cli_usage(cmd, "--nvme-share %g needs --nvme-gbs; accepted: (0, 1e6]",
                         o->nvme_share);
    if (stage && strlen(stage) > 31)
        return cli_bad(cmd, "--stage", stage, "a capture stage of at most 31 bytes", "too long");
    return 0;
}

int cmd_moe_sim(int argc, char **argv)
{
    const char *cmd = "moe sim";
    const char *path = NULL, *stage = NULL, *png = NULL, *b = NULL, *pols = NULL;
    ferry_moe_sim_options o = FERRY_MOE_SIM_OPTIONS_INIT;
    o.hint_steps = 1;
    int json = 0;
    uint64_t preset_bytes = 0;
    const char *hint_flag = NULL; /* --hints or --hint-accuracy, as given */
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int rc = 0;
        uint64_t x = 0;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage();
            return 0;
        } else if (!strcmp(a, "--json")) {
            json = 1;
            continue;
        } else if (!strcmp(a, "--budgets"))
            rc = cli_opt_string(cmd, a, v, "comma-separated slot counts or P%", &b);
        else if (!strcmp(a, "--policies"))
            rc = cli_opt_string(cmd, a, v, "comma-separated policies", &pols);
        else if (!strcmp(a, "--compute-us"))
            rc = cli_opt_real(cmd, a, v, 1e-3, 1e9, &o.compute_us);
        else if (!strcmp(a, "--link-gbs"))
            rc = cli_opt_real(cmd, a, v, 1e-3, 1e6, &o.link_gbs);
        else if (!strcmp(a, "--nvme-gbs"))
            rc = cli_opt_real(cmd, a, v, 1e-3, 1e6, &o.nvme_gbs);
        else if (!strcmp(a, "--nvme-share"))
            rc = cli_opt_real(cmd, a, v, 0, 1, &o.nvme_share);
        else if (!strcmp(a, "--expert-bytes"))
            rc = cli_opt_size(cmd, a, v, 1, 1ull << 40, 0, &o.expert_bytes);
        else if (!strcmp(a, "--model")) {
            int k = 0;
            if ((rc = cli_opt_choice(cmd, a, v, ferry_moe_gen_presets(), &k)) == 0) {
                /* the preset's expert bytes (its usual inference precision) */
                ferry_moe_gen_options go = FERRY_MOE_GEN_OPTIONS_INIT;
                go.model = ferry_moe_gen_presets()[k];
                go.tokens = 1;
                ferry_moe_trace *pt = NULL;
                if ((rc = ferry_moe_trace_generate(&go, &pt)) < 0)
                    return cli_fail(cmd, "model preset", rc);
                preset_bytes = ferry_moe_trace_model(pt)->expert_bytes;
                ferry_moe_trace_destroy(pt);
            }
        }
        else if (!strcmp(a, "--hint-steps")) {
            if ((rc = cli_opt_count(cmd, a, v, 0, 1u << 20, &x)) == 0)
                o.hint_steps = (uint32_t)x;
        } else if (!strcmp(a, "--hint-accuracy")) {
            rc = cli_opt_real(cmd, a, v, 0, 1, &o.hint_accuracy);
            hint_flag = hint_flag ? hint_flag : a;
        } else if (!strcmp(a, "--hints")) {
            hint_flag = hint_flag ? hint_flag : a;
            static const char *const kinds[] = {"made", "trace", NULL};
            int k = 0;
            if ((rc = cli_opt_choice(cmd, a, v, kinds, &k)) == 0)
                o.hint_trace = k;
        }
        else if (!strcmp(a, "--seed"))
            rc = cli_opt_u64(cmd, a, v, &o.seed);
        else if (!strcmp(a, "--stage"))
            rc = cli_opt_string(cmd, a, v, "a capture stage (at most 31 bytes)", &stage);
        else if (!strcmp(a, "--plot"))
            rc = cli_opt_outfile(cmd, a, v, "a PNG file to write", &png);
        else if (a[0] == '-' && a[1])
            return cli_unknown(cmd, a);
        else if (!path) {
            path = a;
            continue;
        } else
            return cli_usage(cmd, "%s: a second trace; accepted: one TRACE", a);
        if (rc)
            return rc;
        i++;
    }
    if (!path)
        return cli_usage(cmd, "TRACE is required; accepted: a trace file (ferry moe gen -o FILE "
                              "makes one)");
    if (o.expert_bytes && preset_bytes)
        return cli_usage(cmd, "--model: it gives only the expert bytes, and --expert-bytes "
                              "gives them; accepted: one of the two");
    char bcopy[512], pcopy[256];
    snprintf(bcopy, sizeof bcopy, "%s", b ? b : "12.5%,25%");
    snprintf(pcopy, sizeof pcopy, "%s", pols ? pols : "lru,auto");
    int st = sim_check(cmd, &o, pcopy, hint_flag, stage);
    if (st)
        return st;
    ferry_moe_trace_options to = FERRY_MOE_TRACE_OPTIONS_INIT;
    to.stage = stage;
    ferry_moe_trace *t;
    int rc = moe_trace_load(path, &to, &t);
    if (rc < 0)
        return cli_fail(cmd, "load", rc);
    if (o.hint_trace && o.hint_steps && !trace_predicts(t)) {
        ferry_moe_trace_destroy(t);
        return cli_usage(cmd, "--hints trace: %s holds no predictions (no record has pred_ids, "
                              "or pred in ferry's form); accepted: --hints made, or a capture "
                              "with pred_ids", path);
    }
    if (!o.expert_bytes)
        o.expert_bytes = preset_bytes; /* (one of the two at most) */
    if (!o.expert_bytes && !ferry_moe_trace_model(t)->expert_bytes) {
        ferry_moe_trace_destroy(t);
        return cli_usage(cmd, "--expert-bytes (or --model) is required: the trace does not say "
                              "how big an expert is; accepted: 1..1T, or a preset");
    }
    rc = sim_run(cmd, t, &o, bcopy, pcopy, json, png);
    ferry_moe_trace_destroy(t);
    return rc;
}
