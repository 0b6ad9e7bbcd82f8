/*
 * cmd_moe.c - `ferry moe gen|replay|bench`: synthetic routing traces,
 * trace replay against Belady's MIN, and the planner/executor benchmarks.
 *
 *   ferry moe gen [--model M] [--tokens N] [--seed S] [--layers N]
 *                 [--experts N] [--top-k N] [--repeat F] [--json] -o FILE
 *   ferry moe replay TRACE [--slots N|P%] [--policy P] [--expert-bytes SIZE]
 *                 [--stage S] [--json] [--sweep [--budgets 6.25%,12.5%,...]
 *                 [--policies a,b,..] [--plot FILE.png]]
 *   ferry moe bench [--json] [--quick] [--row-bytes SIZE]
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <jansson.h>

#include "cli.h"
#include "moe_cli.h"
#include "moe/moe_internal.h"

#define GEN_MAX_TOKENS 1048576u /* --tokens; the trace bounds hold for the presets */

/* "N" or "P%" of the trace's experts (layers present x experts): at least
 * one step's experts (top_k) and at most all of them, never adjusted */
int moe_parse_slots(const char *cmd, const char *flag, const char *s, const ferry_moe_model *m,
                       uint32_t *out)
{
    uint64_t all = (uint64_t)m->num_layers * m->num_experts;
    uint32_t min = m->top_k ? m->top_k : 1;
    size_t n = s ? strlen(s) : 0;
    char acc[200];
    snprintf(acc, sizeof acc, "a slot count %u..%llu (one step's experts, top-k, .. all %u x %u "
                              "of the trace's) or a percentage P%% of them giving at least %u",
             min, (unsigned long long)all, m->num_layers, m->num_experts, min);
    if (n > 1 && s[n - 1] == '%') {
        double pct;
        if (cli_opt_percent(cmd, flag, s, &pct))
            return 2;
        uint64_t v = (uint64_t)((double)all * pct / 100.0 + 0.5);
        if (v < min)
            return cli_bad(cmd, flag, s, acc, "%llu slots, fewer than one step's %u experts "
                           "(%.3g%% is the least)", (unsigned long long)v, min,
                           100.0 * min / (double)all);
        *out = (uint32_t)v;
        return 0;
    }
    if (!s)
        return cli_bad(cmd, flag, NULL, acc, "needs a value");
    uint64_t v;
    /* the count parser's message names its own range; this one names the trace's */
    const char *p = s;
    while (*p >= '0' && *p <= '9')
        p++;
    if (p == s || *p || n > 19)
        return cli_bad(cmd, flag, s, acc, "not a count or a percentage");
    v = strtoull(s, NULL, 10);
    if (v == 0)
        return cli_bad(cmd, flag, s, acc, "zero slots hold nothing");
    if (v < min)
        return cli_bad(cmd, flag, s, acc, "fewer slots than one step's %u experts", min);
    if (v > all)
        return cli_bad(cmd, flag, s, acc, "more slots than the trace has experts");
    *out = (uint32_t)v;
    return 0;
}

/* ---------------------------------------------------------------- gen */
static void gen_usage(void)
{
    printf("usage: ferry moe gen [--model M] [--tokens N] [--seed S] [--layers N] "
           "[--experts N] [--top-k N] [--repeat F] [--json] -o FILE\n"
           "  -o         the trace's file; - writes it to standard output (the summary\n"
           "             then goes to standard error)\n"
           "  --tokens   1..%u (default 2048); tokens x layers at most %zu steps and\n"
           "             x top-k at most %zu expert ids\n"
           "  --layers 1..1024  --experts 1..16384  --top-k 1..experts (default: the model's)\n"
           "  --seed     0..2^64-1 (default 1)\n"
           "  --repeat   0.01..0.9: the share of selections routed again at the next\n"
           "             token, same layer (default: the preset's, ~0.45; decode\n"
           "             captures of large models show 0.34-0.37)\n"
           "  progress on stderr when it is a terminal (FERRY_NO_PROGRESS=1: none)\n"
           "models:", GEN_MAX_TOKENS, FERRY__TRACE_MAX_STEPS, FERRY__TRACE_MAX_IDS);
    for (const char *const *p = ferry_moe_gen_presets(); *p; p++)
        printf(" %s", *p);
    printf("\n");
}

/* ferry_moe_trace_generate's loop, with progress */
static int generate(const char *cmd, const ferry_moe_gen_options *o, ferry_moe_trace **out)
{
    ferry_moe_model m;
    ferry__gen *g;
    int rc = ferry__gen_open(o, &g, &m);
    if (rc < 0)
        return cli_fail(cmd, "generate", rc);
    ferry_moe_trace *t;
    if ((rc = ferry_moe_trace_create(&m, &t)) < 0) {
        ferry__gen_close(g);
        return cli_fail(cmd, "generate", rc);
    }
    for (uint32_t tk = 0; tk < o->tokens && rc == 0; tk++) {
        for (uint32_t l = 0; l < m.num_layers && rc == 0; l++)
            rc = ferry_moe_trace_append(t, tk, l, ferry__gen_next(g), m.top_k);
        if ((tk & 1023) == 1023 || tk + 1 == o->tokens)
            cli_progress("moe gen", tk + 1, o->tokens);
    }
    cli_progress_end();
    ferry__gen_close(g);
    if (rc < 0) {
        ferry_moe_trace_destroy(t);
        return cli_fail(cmd, "generate", rc);
    }
    *out = t;
    return 0;
}

/* what moe gen wrote: the trace's shape and its statistics */
/* the trace's summary into f (stderr where the trace went to stdout) */
static void gen_report(FILE *f, const ferry_moe_trace *t, const char *outp, int json)
{
    ferry__trace_stats st;
    int rc = ferry__trace_stats_compute(t, &st);
    const ferry_moe_model *tm = ferry_moe_trace_model(t);
    /* the share of the 32 busiest experts says something only where a
     * layer has many more (the library reports 0 under 64) */
    int top32 = tm->num_experts >= 64;
    if (json) {
        json_t *j = json_pack("{s:s,s:s,s:i,s:i,s:i,s:i,s:I}", "file", outp, "model", tm->name,
                              "num_layers", (int)tm->num_layers, "num_experts",
                              (int)tm->num_experts, "top_k", (int)tm->top_k, "tokens",
                              (int)ferry_moe_trace_tokens(t), "steps",
                              (json_int_t)ferry_moe_trace_steps(t));
        if (rc == 0)
            json_object_set_new(
                j, "stats",
                json_pack("{s:f,s:o,s:f,s:f,s:f,s:f}", "top1_share", st.top1_share, "top32_cover",
                          top32 ? json_real(st.top32_cover) : json_null(), "repeat_next",
                          st.repeat_next, "within8", st.within8, "median_reuse",
                          st.median_reuse, "cross_lift", st.cross_lift));
        char *s = json_dumps(j, JSON_COMPACT | JSON_PRESERVE_ORDER);
        fprintf(f, "%s\n", s ? s : "{}");
        free(s);
        json_decref(j);
    } else {
        fprintf(f, "%s: %s, %u layers x %u experts, top-%u, %u tokens, %zu steps\n", outp, tm->name,
               tm->num_layers, tm->num_experts, tm->top_k, ferry_moe_trace_tokens(t),
               ferry_moe_trace_steps(t));
        char cover[48] = "";
        if (top32)
            snprintf(cover, sizeof cover, "top-32 cover %.1f%%, ", 100 * st.top32_cover);
        if (rc == 0)
            fprintf(f, "top expert share %.1f%%, %srepeat at next token %.1f%%, "
                   "within 8 tokens %.1f%%, median reuse %.0f tokens, cross-layer lift %.1fx\n",
                   100 * st.top1_share, cover, 100 * st.repeat_next, 100 * st.within8,
                   st.median_reuse, st.cross_lift);
    }
    if (rc == 0)
        ferry__free(st.layer_repeat);
}

int cmd_moe_gen(int argc, char **argv)
{
    const char *cmd = "moe gen";
    ferry_moe_gen_options o = FERRY_MOE_GEN_OPTIONS_INIT;
    o.tokens = 2048;
    const char *outp = NULL;
    int json = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        uint64_t x = 0;
        int rc = 0, k = 0;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            gen_usage();
            return 0;
        } else if (!strcmp(a, "--json")) {
            json = 1;
            continue;
        } else if (!strcmp(a, "--model")) {
            if ((rc = cli_opt_choice(cmd, a, v, ferry_moe_gen_presets(), &k)) == 0)
                o.model = ferry_moe_gen_presets()[k];
        } else if (!strcmp(a, "-o") || !strcmp(a, "--output"))
            rc = cli_opt_outfile(cmd, a, v, "a file to write", &outp);
        else if (!strcmp(a, "--tokens")) {
            if ((rc = cli_opt_count(cmd, a, v, 1, GEN_MAX_TOKENS, &x)) == 0)
                o.tokens = (uint32_t)x;
        } else if (!strcmp(a, "--seed"))
            rc = cli_opt_u64(cmd, a, v, &o.seed);
        else if (!strcmp(a, "--layers")) {
            if ((rc = cli_opt_count(cmd, a, v, 1, 1024, &x)) == 0)
                o.num_layers = (uint32_t)x;
        } else if (!strcmp(a, "--experts")) {
            if ((rc = cli_opt_count(cmd, a, v, 1, 16384, &x)) == 0)
                o.num_experts = (uint32_t)x;
        } else if (!strcmp(a, "--top-k")) {
            if ((rc = cli_opt_count(cmd, a, v, 1, 16384, &x)) == 0)
                o.top_k = (uint32_t)x;
        } else if (!strcmp(a, "--repeat"))
            rc = cli_opt_real(cmd, a, v, 0.01, 0.9, &o.repeat_next);
        else
            return cli_unknown(cmd, a);
        if (rc)
            return rc;
        i++;
    }
    if (!outp)
        return cli_usage(cmd, "-o FILE is required; accepted: -o FILE (the trace to write)");
    /* the shape the preset and overrides give, before anything is generated */
    ferry_moe_gen_options probe = o;
    probe.top_k = 0;
    ferry_moe_model m;
    ferry__gen *g0;
    int rc = ferry__gen_open(&probe, &g0, &m);
    if (rc < 0 && probe.num_experts == 0)
        return cli_fail(cmd, "generate", rc);
    if (rc == 0)
        ferry__gen_close(g0);
    else { /* the preset's top-k above --experts: the top-k must come down */
        probe.top_k = 1;
        if ((rc = ferry__gen_open(&probe, &g0, &m)) < 0)
            return cli_fail(cmd, "generate", rc);
        ferry__gen_close(g0);
        if (!o.top_k)
            return cli_usage(cmd, "--experts %u: fewer than the model's top-k; accepted: --top-k "
                                  "1..%u with it", m.num_experts, m.num_experts);
    }
    uint32_t k = o.top_k ? o.top_k : m.top_k;
    if (k > m.num_experts)
        return cli_usage(cmd, "--top-k %u: more than the %u experts; accepted: 1..%u", k,
                         m.num_experts, m.num_experts);
    uint64_t steps = (uint64_t)o.tokens * m.num_layers;
    if (steps > FERRY__TRACE_MAX_STEPS || steps * k > FERRY__TRACE_MAX_IDS)
        return cli_usage(cmd, "--tokens %u: %llu steps of %u experts at %u layers; accepted: "
                              "tokens x layers at most %zu, x top-k at most %zu", o.tokens,
                         (unsigned long long)steps, k, m.num_layers, FERRY__TRACE_MAX_STEPS,
                         FERRY__TRACE_MAX_IDS);
    ferry_moe_trace *t = NULL;
    if ((rc = generate(cmd, &o, &t)) != 0)
        return rc;
    int to_stdout = !strcmp(outp, "-"); /* the trace on stdout, the summary on stderr */
    fflush(stdout);
    rc = to_stdout ? ferry__moe_trace_save_fd(t, STDOUT_FILENO, "(standard output)")
                   : ferry_moe_trace_save(t, outp);
    if (rc < 0) {
        ferry_moe_trace_destroy(t);
        return cli_fail(cmd, outp, rc);
    }
    gen_report(to_stdout ? stderr : stdout, t, to_stdout ? "(standard output)" : outp, json);
    ferry_moe_trace_destroy(t);
    return 0;
}

/* ---------------------------------------------------------------- replay */
/* "3 layers x 256 experts (model layers 3, 17, 38), stage 'apply'" */
void moe_layers_desc(const ferry_moe_trace *t, char *buf, size_t n)
{
    const ferry_moe_model *m = ferry_moe_trace_model(t);
    size_t off = (size_t)snprintf(buf, n, "%u layers x %u experts", m->num_layers, m->num_experts);
    int sparse = 0;
    for (uint32_t l = 0; l < m->num_layers; l++)
        sparse |= ferry_moe_trace_layer_id(t, l) != l;
    if (sparse) {
        off += (size_t)snprintf(buf + off, off < n ? n - off : 0, " (model layers");
        for (uint32_t l = 0; l < m->num_layers && l < 8; l++)
            off += (size_t)snprintf(buf + off, off < n ? n - off : 0, "%s %u", l ? "," : "",
                                    ferry_moe_trace_layer_id(t, l));
        off += (size_t)snprintf(buf + off, off < n ? n - off : 0, "%s)",
                                m->num_layers > 8 ? ", ..." : "");
    }
    if (ferry_moe_trace_stage(t)[0])
        snprintf(buf + off, off < n ? n - off : 0, ", stage '%s'", ferry_moe_trace_stage(t));
}

/* the trace's shape as JSON: layers, layer_ids (sparse only), stage */
void moe_shape_json(json_t *j, const ferry_moe_trace *t)
{
    const ferry_moe_model *m = ferry_moe_trace_model(t);
    json_object_set_new(j, "layers", json_integer(m->num_layers));
    json_object_set_new(j, "experts", json_integer(m->num_experts));
    json_t *ids = json_array();
    int sparse = 0;
    for (uint32_t l = 0; l < m->num_layers; l++) {
        sparse |= ferry_moe_trace_layer_id(t, l) != l;
        json_array_append_new(ids, json_integer(ferry_moe_trace_layer_id(t, l)));
    }
    if (sparse)
        json_object_set_new(j, "layer_ids", ids);
    else
        json_decref(ids);
    if (ferry_moe_trace_stage(t)[0])
        json_object_set_new(j, "stage", json_string(ferry_moe_trace_stage(t)));
}

static json_t *result_json(const ferry_moe_replay_result *r)
{
    return json_pack("{s:s,s:i,s:I,s:I,s:I,s:f,s:I}", "policy", r->policy, "slots", (int)r->slots,
                     "steps", (json_int_t)r->steps, "hits", (json_int_t)r->hits, "misses",
                     (json_int_t)r->misses, "hit_rate", r->hit_rate, "host_bytes",
                     (json_int_t)r->host_bytes);
}

static void human_bytes(uint64_t b, char *buf, size_t n)
{
    const char *u[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
    double v = (double)b;
    int i = 0;
    while (v >= 1024 && i < 5) {
        v /= 1024;
        i++;
    }
    snprintf(buf, n, "%.1f %s", v, u[i]);
}

int moe_trace_load(const char *path, const ferry_moe_trace_options *o, ferry_moe_trace **out)
{
    if (!strcmp(path, "-"))
        return ferry__moe_trace_load_fd(STDIN_FILENO, "(standard input)", o, out);
    return ferry_moe_trace_load_opts(path, o, out);
}

/* split "a,b,c" into at most max pieces (in place); -1 for an empty piece
 * or more than max */
int moe_split_list(char *s, char **out, int max)
{
    int n = 0;
    for (char *p = s;; p++) {
        char *c = strchr(p, ',');
        if (c)
            *c = 0;
        if (!*p || n == max)
            return -1;
        out[n++] = p;
        if (!c)
            return n;
        p = c;
    }
}

static int plot_sweep(const char *cmd, const char *png, const char *title, int nb,
                      const uint32_t *budgets, uint64_t all, int np, char **pols,
                      const double *rates)
{
    char dat[] = "/tmp/ferry-moe-sweep-XXXXXX";
    int fd = mkstemp(dat);
    if (fd < 0)
        return cli_fail(cmd, "plot data file", -errno);
    FILE *f = fdopen(fd, "w");
    for (int b = 0; b < nb; b++) {
        fprintf(f, "%u %.4f", budgets[b], 100.0 * budgets[b] / (double)all);
        for (int p = 0; p < np; p++)
            fprintf(f, " %.4f", 100 * rates[b * np + p]);
        fprintf(f, "\n");
    }
    fclose(f);
    FILE *g = popen("gnuplot 2>&1", "w");
    if (!g) {
        unlink(dat);
        return cli_fail(cmd, "gnuplot", -errno);
    }
    fprintf(g, "set terminal pngcairo size 900,560\nset output '%s'\n", png);
    fprintf(g, "set title '%s'\nset xlabel 'slots (%% of all experts)'\nset ylabel 'hit rate (%%)'\n",
            title);
    fprintf(g, "set key bottom right\nset grid\nplot ");
    for (int p = 0; p < np; p++)
        fprintf(g, "%s'%s' using 2:%d with linespoints title '%s'", p ? ", " : "", dat, p + 3,
                pols[p]);
    fprintf(g, "\n");
    int st = pclose(g);
    unlink(dat);
    if (st != 0) {
        fprintf(stderr, "ferry %s: gnuplot failed (status %d)\n", cmd, st);
        return 1;
    }
    return 0;
}

static int replay_sweep(const char *cmd, const ferry_moe_trace *t, char *budgets_s,
                        char *policies_s, uint64_t expert_bytes, int json, const char *plot)
{
    const ferry_moe_model *m = ferry_moe_trace_model(t);
    uint64_t all = (uint64_t)m->num_layers * m->num_experts;
    char defb[] = "6.25%,12.5%,25%,37.5%,50%";
    char defp[] = "lru,lru-layer,lfu,lfru,s3fifo,routing,auto,belady";
    char *bl[32], *pl[16];
    char orig[256];
    snprintf(orig, sizeof orig, "%s", budgets_s ? budgets_s : defb);
    int nb = moe_split_list(budgets_s ? budgets_s : defb, bl, 32);
    int np = moe_split_list(policies_s ? policies_s : defp, pl, 16); /* checked by the caller */
    if (nb < 0)
        return cli_bad(cmd, "--budgets", orig, "1..32 comma-separated slot counts or P%",
                       "an empty piece or more than 32");
    uint32_t budgets[32];
    for (int b = 0; b < nb; b++)
        if (moe_parse_slots(cmd, "--budgets", bl[b], m, &budgets[b]))
            return 2;
    double *rates = calloc((size_t)nb * np, sizeof *rates);
    json_t *arr = json_array();
    if (!json) {
        char ld[256];
        moe_layers_desc(t, ld, sizeof ld);
        printf("trace: %s, %s, top-%u, %u passes, %zu steps\n", m->name, ld, m->top_k,
               ferry_moe_trace_tokens(t), ferry_moe_trace_steps(t));
        printf("%-8s %6s", "slots", "%all");
        for (int p = 0; p < np; p++)
            printf(" %9s", pl[p]);
        printf("\n");
    }
    int rc = 0;
    for (int b = 0; b < nb && rc == 0; b++) {
        if (!json)
            printf("%-8u %5.1f%%", budgets[b], 100.0 * budgets[b] / all);
        for (int p = 0; p < np; p++) {
            ferry_moe_replay_result r;
            rc = ferry_moe_replay(t, pl[p], budgets[b], expert_bytes, &r);
            if (rc < 0)
                break;
            rates[b * np + p] = r.hit_rate;
            if (json) {
                json_t *e = result_json(&r);
                moe_shape_json(e, t);
                json_array_append_new(arr, e);
            }
            else
                printf(" %8.2f%%", 100 * r.hit_rate);
            fflush(stdout);
        }
        if (!json)
            printf("\n");
    }
    if (rc < 0) {
        free(rates);
        json_decref(arr);
        return cli_fail(cmd, "replay", rc);
    }
    if (json) {
        char *s = json_dumps(arr, JSON_COMPACT | JSON_PRESERVE_ORDER);
        printf("%s\n", s);
        free(s);
    }
    json_decref(arr);
    int ret = 0;
    if (plot) {
        char title[160];
        snprintf(title, sizeof title, "%s: %u layers x %u experts, top-%u, %u tokens", m->name,
                 m->num_layers, m->num_experts, m->top_k, ferry_moe_trace_tokens(t));
        ret = plot_sweep(cmd, plot, title, nb, budgets, all, np, pl, rates);
        if (ret == 0 && !json)
            printf("plot: %s\n", plot);
    }
    free(rates);
    return ret;
}

int moe_policy_list(char *acc, size_t n)
{
    size_t off = 0;
    acc[0] = 0;
    for (const char *const *p = ferry_moe_policies(); *p && off < n; p++)
        off += (size_t)snprintf(acc + off, n - off, "%s%s", off ? ", " : "", *p);
    return 0;
}

static void replay_usage(void)
{
    printf("usage: ferry moe replay TRACE [--slots N|P%%] [--policy P] "
           "[--expert-bytes SIZE] [--json]\n"
           "       ferry moe replay TRACE --sweep [--budgets 6.25%%,12.5%%,..] "
           "[--policies a,b,..] [--plot FILE.png] [--json]\n"
           "  (both take --stage S)\n"
           "  TRACE          a regular file or a pipe of JSON Lines, - for standard input\n"
           "                 (lines up to 1 MiB, at most %zu steps)\n"
           "  --slots        top-k..layers x experts, or P%% of layers x experts (the\n"
           "                 layers the trace holds; default 25%%); never adjusted\n"
           "  --policy       one of the policies below (default auto: the hits of\n"
           "                 lru or successor, whichever is ahead lately)\n"
           "  --expert-bytes 1..1T (default: the trace's)\n"
           "  --budgets      up to 32 of --slots' values; --policies up to 16 policies\n"
           "  --stage        a capture's stage to read (default: its only stage, else\n"
           "                 'apply'; a file of several stages and no 'apply' needs it)\n"
           "policies:\n", FERRY__TRACE_MAX_STEPS);
    for (const char *const *p = ferry_moe_policies(); *p; p++)
        printf("  %-10s %s\n", *p, ferry_moe_policy_describe(*p));
}

/* one policy and Belady's MIN on the same trace and budget */
static int replay_one(const char *cmd, const ferry_moe_trace *t, const char *policy,
                      const char *slots_s, uint64_t expert_bytes, int json)
{
    const ferry_moe_model *m = ferry_moe_trace_model(t);
    uint32_t slots;
    if (moe_parse_slots(cmd, "--slots", slots_s, m, &slots))
        return 2;
    ferry_moe_replay_result r, b;
    int rc = ferry_moe_replay(t, policy, slots, expert_bytes, &r);
    if (rc == 0)
        rc = ferry_moe_replay(t, "belady", slots, expert_bytes, &b);
    if (rc < 0)
        return cli_fail(cmd, "replay", rc);
    if (json) {
        json_t *j = result_json(&r);
        moe_shape_json(j, t);
        json_object_set_new(j, "belady",
                            json_pack("{s:I,s:I,s:f,s:I}", "hits", (json_int_t)b.hits, "misses",
                                      (json_int_t)b.misses, "hit_rate", b.hit_rate, "host_bytes",
                                      (json_int_t)b.host_bytes));
        char *s = json_dumps(j, JSON_COMPACT | JSON_PRESERVE_ORDER);
        printf("%s\n", s);
        free(s);
        json_decref(j);
    } else {
        uint64_t all = (uint64_t)m->num_layers * m->num_experts;
        char hb[32], bb[32];
        human_bytes(r.host_bytes, hb, sizeof hb);
        human_bytes(b.host_bytes, bb, sizeof bb);
        char ld[256];
        moe_layers_desc(t, ld, sizeof ld);
        printf("trace: %s, %s, top-%u, %u passes, %llu steps\n", m->name, ld, m->top_k,
               ferry_moe_trace_tokens(t), (unsigned long long)r.steps);
        printf("slots: %u (%.1f%% of %llu experts)\n", slots, 100.0 * slots / all,
               (unsigned long long)all);
        printf("%-10s %12s %12s %9s %14s\n", "policy", "hits", "misses", "hit_rate",
               "link bytes");
        printf("%-10s %12llu %12llu %8.2f%% %14s\n", r.policy, (unsigned long long)r.hits,
               (unsigned long long)r.misses, 100 * r.hit_rate, hb);
        printf("%-10s %12llu %12llu %8.2f%% %14s\n", "belady", (unsigned long long)b.hits,
               (unsigned long long)b.misses, 100 * b.hit_rate, bb);
        if (!m->expert_bytes && !expert_bytes)
            printf("(link bytes need --expert-bytes: the trace does not say how big an expert "
                   "is)\n");
    }
    return 0;
}

int cmd_moe_replay(int argc, char **argv)
{
    const char *cmd = "moe replay";
    const char *path = NULL, *slots_s = NULL, *policy = "auto", *plot = NULL, *stage = NULL;
    char *budgets = NULL, *policies = NULL;
    uint64_t expert_bytes = 0;
    int json = 0, sweep = 0, policy_given = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        int rc = 0, k = 0;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            replay_usage();
            return 0;
        } else if (!strcmp(a, "--json")) {
            json = 1;
            continue;
        } else if (!strcmp(a, "--sweep")) {
            sweep = 1;
            continue;
        } else if (!strcmp(a, "--slots"))
            rc = cli_opt_string(cmd, a, v, "a slot count N or a percentage P%", &slots_s);
        else if (!strcmp(a, "--policy")) {
            if ((rc = cli_opt_choice(cmd, a, v, ferry_moe_policies(), &k)) == 0)
                policy = ferry_moe_policies()[k];
            policy_given = 1;
        } else if (!strcmp(a, "--plot"))
            rc = cli_opt_outfile(cmd, a, v, "a PNG file to write", &plot);
        else if (!strcmp(a, "--stage"))
            rc = cli_opt_string(cmd, a, v, "a capture stage (at most 31 bytes)", &stage);
        else if (!strcmp(a, "--budgets")) {
            const char *b = NULL;
            rc = cli_opt_string(cmd, a, v, "comma-separated slot counts or P%", &b);
            budgets = (char *)(uintptr_t)b;
        } else if (!strcmp(a, "--policies")) {
            const char *b = NULL;
            rc = cli_opt_string(cmd, a, v, "comma-separated policies", &b);
            policies = (char *)(uintptr_t)b;
        } else if (!strcmp(a, "--expert-bytes"))
            rc = cli_opt_size(cmd, a, v, 1, 1ull << 40, 0, &expert_bytes);
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
    if (plot && !sweep)
        return cli_usage(cmd, "--plot %s: needs --sweep", plot);
    if (sweep && slots_s)
        return cli_usage(cmd, "--slots %s: --sweep takes --budgets; accepted: --slots or "
                              "--sweep [--budgets ...], not both", slots_s);
    if (sweep && policy_given)
        return cli_usage(cmd, "--policy %s: --sweep takes --policies; accepted: --policy or "
                              "--sweep [--policies ...], not both", policy);
    if (!sweep && (budgets || policies))
        return cli_usage(cmd, "%s: needs --sweep", budgets ? "--budgets" : "--policies");
    if (policies) {
        char acc[256], copy[512], *pl[16];
        moe_policy_list(acc, sizeof acc);
        snprintf(copy, sizeof copy, "%s", policies);
        int np = moe_split_list(copy, pl, 16);
        if (np < 0)
            return cli_bad(cmd, "--policies", policies, acc, "an empty piece or more than 16");
        for (int p = 0; p < np; p++)
            if (!ferry_moe_policy_describe(pl[p]))
                return cli_bad(cmd, "--policies", policies, acc, "unknown policy '%s'", pl[p]);
    }
    if (!slots_s)
        slots_s = "25%";
    if (stage && strlen(stage) > 31)
        return cli_bad(cmd, "--stage", stage, "a capture stage of at most 31 bytes", "too long");
    ferry_moe_trace_options to = FERRY_MOE_TRACE_OPTIONS_INIT;
    to.stage = stage;
    ferry_moe_trace *t;
    int rc = moe_trace_load(path, &to, &t);
    if (rc < 0)
        return cli_fail(cmd, "load", rc);
    if (sweep) {
        int r = replay_sweep(cmd, t, budgets, policies, expert_bytes, json, plot);
        ferry_moe_trace_destroy(t);
        return r;
    }
    rc = replay_one(cmd, t, policy, slots_s, expert_bytes, json);
    ferry_moe_trace_destroy(t);
    return rc;
}

/* ---------------------------------------------------------------- bench */
static double now_s(void)
{
    return (double)ferry__now_ns() / 1e9;
}

typedef struct exec_bench {
    double slot_gbs, memcpy_gbs, warm_ns;
    double ratio; /* median of the paired rounds' ratios */
    size_t row_bytes;
    uint32_t rows;
} exec_bench;

/* slot writes through the executor on a device (backend "host" or "cuda")
 * vs plain memcpy of the same bytes in host memory, interleaved in the
 * same run; the median of `rounds` paired rounds */
static int bench_executor(const char *cmd, const char *backend, size_t row_bytes, uint32_t nrows,
                          int rounds, exec_bench *out)
{
    ferry_device_options dopt = FERRY_DEVICE_OPTIONS_INIT;
    dopt.backend = backend;
    ferry_device *dev = NULL;
    int rc = ferry_device_open(&dopt, &dev);
    if (rc < 0)
        return cli_fail(cmd, backend, rc);
    ferry_moe_geometry g = FERRY_MOE_GEOMETRY_INIT;
    g.num_layers = 1;
    g.num_experts = nrows;
    g.slots = nrows;
    g.banks = 3;
    for (int b = 0; b < 3; b++)
        g.row_bytes[b] = row_bytes;
    void *banks[3] = {NULL, NULL, NULL};
    void *dst = NULL;
    ferry_moe_rows *rows = NULL;
    ferry_moe_slots *slots = NULL;
    uint32_t *dsts = malloc(nrows * sizeof *dsts), *srcs = malloc(nrows * sizeof *srcs);
    size_t bank_bytes = row_bytes * nrows;
    for (int b = 0; b < 3 && rc == 0; b++)
        rc = ferry_device_host_alloc(dev, bank_bytes, &banks[b]);
    if (rc == 0)
        rc = ferry_device_host_alloc(dev, bank_bytes * 3, &dst);
    if (rc == 0)
        rc = ferry_moe_rows_host(&g, banks, dev, 0, &rows);
    const ferry_moe_slot_device_ops *ops;
    void *ctx;
    if (rc == 0 && (rc = ferry_moe_device_slots_open(dev, &g, &ops, &ctx)) == 0)
        rc = ferry_moe_slots_create(&g, ops, ctx, &slots);
    if (rc < 0 || !dsts || !srcs) {
        rc = cli_fail(cmd, "set up the executor bench", rc < 0 ? rc : -ENOMEM);
        goto done;
    }
    for (int b = 0; b < 3; b++)
        memset(banks[b], 0x5a + b, bank_bytes);
    memset(dst, 0, bank_bytes * 3);
    for (uint32_t i = 0; i < nrows; i++) {
        dsts[i] = i;
        srcs[i] = (i * 7 + 3) % nrows; /* a permutation: rows land out of order */
    }
    ferry_moe_copy_plan plan = {0, nrows, dsts, srcs};
    double ts[64], tm[64], tr[64];
    if (rounds > 64)
        rounds = 64;
    /* one untimed pass each to fault the pages in */
    rc = ferry_moe_slots_apply(slots, &plan, rows, NULL, NULL);
    for (uint32_t i = 0; i < nrows * 3; i++)
        memcpy((char *)dst + (size_t)i * row_bytes, (char *)banks[i % 3] + (size_t)srcs[i / 3] * row_bytes,
               row_bytes);
    /* paired rounds, the order alternating, so drift and a neighbour's load
     * hit both sides: the ratio is the median of the rounds' own ratios */
    for (int r = 0; r < rounds && rc >= 0; r++) {
        for (int side = 0; side < 2 && rc >= 0; side++) {
            double t0 = now_s();
            if ((side ^ (r & 1)) == 0) {
                rc = ferry_moe_slots_apply(slots, &plan, rows, NULL, NULL);
                ts[r] = now_s() - t0;
            } else {
                for (uint32_t i = 0; i < nrows; i++)
                    for (int b = 0; b < 3; b++)
                        memcpy((char *)dst + ((size_t)i * 3 + b) * row_bytes,
                               (char *)banks[b] + (size_t)srcs[i] * row_bytes, row_bytes);
                tm[r] = now_s() - t0;
            }
        }
        tr[r] = tm[r] / ts[r];
    }
    if (rc < 0) {
        rc = cli_fail(cmd, "apply", rc);
        goto done;
    }
    ferry_moe_copy_plan warm = {0, 0, dsts, srcs};
    uint64_t w0 = ferry__now_ns();
    for (int i = 0; i < 100000; i++)
        (void)ferry_moe_slots_apply(slots, &warm, rows, NULL, NULL);
    uint64_t w1 = ferry__now_ns();
    double bytes = (double)bank_bytes * 3;
    out->slot_gbs = bytes / cli_median(ts, (unsigned)rounds) / 1e9;
    out->memcpy_gbs = bytes / cli_median(tm, (unsigned)rounds) / 1e9;
    out->ratio = cli_median(tr, (unsigned)rounds);
    out->warm_ns = (double)(w1 - w0) / 100000;
    out->row_bytes = row_bytes;
    out->rows = nrows;
    rc = 0;
done:
    ferry_moe_slots_destroy(slots);
    ferry_moe_rows_destroy(rows);
    for (int b = 0; b < 3; b++)
        if (banks[b])
            ferry_device_host_free(dev, banks[b]);
    if (dst)
        ferry_device_host_free(dev, dst);
    ferry_device_close(dev);
    free(dsts);
    free(srcs);
    return rc;
}

/* one timed pass of a policy's planner over t (as ferry_moe_replay drives
 * it): ns per layer-step while the slots fill (no victim yet) and after
 * (every miss evicts: the steady state a long decode runs in) */
typedef struct bench_pass {
    double fill_ns, steady_ns, hit_rate;
    size_t fill_steps, steady_steps;
} bench_pass;

static int bench_pass_run(const ferry_moe_trace *t, const char *policy, uint32_t slots,
                          bench_pass *out)
{
    const ferry_moe_model *m = ferry_moe_trace_model(t);
    ferry_moe_planner_options o = FERRY_MOE_PLANNER_OPTIONS_INIT;
    o.num_layers = m->num_layers;
    o.num_experts = m->num_experts;
    o.slots = slots;
    o.policy = policy;
    o.top_k = m->top_k <= m->num_experts ? m->top_k : 0;
    o.oracle = t;
    ferry_moe_planner *p;
    int rc = ferry_moe_planner_create(&o, &p);
    if (rc < 0)
        return rc;
    size_t n_steps = ferry_moe_trace_steps(t), full = n_steps;
    uint64_t missed = 0, t0 = ferry__now_ns(), tf = 0;
    for (size_t i = 0; i < n_steps && rc >= 0; i++) {
        uint32_t tok, layer, n;
        const uint32_t *ex;
        if (full == n_steps && missed >= slots) { /* full: every miss from here evicts */
            full = i;
            tf = ferry__now_ns();
        }
        if ((rc = ferry_moe_trace_step(t, i, &tok, &layer, &ex, &n)) < 0)
            break;
        if (n <= slots) {
            ferry_moe_counts c;
            rc = ferry_moe_planner_ensure(p, layer, ex, n, NULL, NULL, &c);
            missed += c.missing;
            continue;
        }
        /* more experts than slots: waves, the slots full after it */
        rc = ferry_moe_planner_stream_begin(p, layer, ex, n, NULL);
        ferry_moe_wave w;
        while (rc >= 0 && (rc = ferry_moe_planner_stream_next(p, &w)) > 0)
            ;
        missed = slots;
    }
    uint64_t t1 = ferry__now_ns();
    ferry_moe_planner_stats st = FERRY_MOE_PLANNER_STATS_INIT;
    ferry_moe_planner_stats_get(p, &st);
    ferry_moe_planner_destroy(p);
    if (rc < 0)
        return rc;
    if (full == n_steps)
        tf = t1;
    out->fill_steps = full;
    out->steady_steps = n_steps - full;
    out->fill_ns = full ? (double)(tf - t0) / (double)full : 0.0;
    out->steady_ns = n_steps > full ? (double)(t1 - tf) / (double)(n_steps - full) : 0.0;
    out->hit_rate = st.hits + st.misses ? (double)st.hits / (double)(st.hits + st.misses) : 0.0;
    return 0;
}

/* the planner's ns per layer-step, each policy's phases the best of 3
 * passes (a neighbour on a shared host stretches one of them by half);
 * 0 or cli_fail's code */
static int bench_planner(const char *cmd, const ferry_moe_trace *t, uint32_t slots, int json,
                         json_t *pl)
{
    const char *const *pols = ferry_moe_policies();
    size_t fill = 0, steady = 0;
    for (int i = 0; pols[i]; i++) {
        bench_pass best = {1e30, 1e30, 0, 0, 0}, r;
        int rc = 0;
        for (int rep = 0; rep < 3 && rc >= 0; rep++)
            if ((rc = bench_pass_run(t, pols[i], slots, &r)) >= 0) {
                best.fill_ns = r.fill_ns < best.fill_ns ? r.fill_ns : best.fill_ns;
                best.steady_ns = r.steady_ns < best.steady_ns ? r.steady_ns : best.steady_ns;
                best.hit_rate = r.hit_rate;
                best.fill_steps = r.fill_steps;
                best.steady_steps = r.steady_steps;
            }
        if (rc < 0)
            return cli_fail(cmd, pols[i], rc);
        if (json)
            json_array_append_new(
                pl, json_pack("{s:s,s:f,s:I,s:f,s:I,s:f}", "policy", pols[i], "ns_per_step",
                              best.steady_ns, "steady_steps", (json_int_t)best.steady_steps,
                              "fill_ns_per_step", best.fill_ns, "fill_steps",
                              (json_int_t)best.fill_steps, "hit_rate", best.hit_rate));
        else
            printf("  %-10s %8.0f ns/layer-step full, %6.0f filling   (hit rate %.2f%%)\n",
                   pols[i], best.steady_ns, best.fill_ns, 100 * best.hit_rate);
        if (!strcmp(pols[i], "lru")) {
            fill = best.fill_steps;
            steady = best.steady_steps;
        }
    }
    if (!json)
        printf("  (full: the %zu layer-steps once the slots are full, each miss evicting;\n"
               "   filling: the %zu before, lru's count)\n", steady, fill);
    return 0;
}

int cmd_moe_bench(int argc, char **argv)
{
    const char *cmd = "moe bench";
    static const char *const devices[] = {"host", "cuda", NULL};
    const char *device = "host";
    int json = 0, quick = 0, k = 0;
    uint64_t row_bytes = 0;
    uint32_t tokens = 512, tokens_set = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--json"))
            json = 1;
        else if (!strcmp(argv[i], "--quick"))
            quick = 1;
        else if (!strcmp(argv[i], "--device")) {
            if (cli_opt_choice(cmd, argv[i], i + 1 < argc ? argv[i + 1] : NULL, devices, &k))
                return 2;
            device = devices[k];
            i++;
        } else if (!strcmp(argv[i], "--tokens")) {
            uint64_t x;
            if (cli_opt_count(cmd, argv[i], i + 1 < argc ? argv[i + 1] : NULL, 16, 8192, &x))
                return 2;
            tokens_set = (uint32_t)x;
            i++;
        } else if (!strcmp(argv[i], "--row-bytes")) {
            /* 64 rows x 3 banks, twice over (banks and destination): 1.5 GiB at 4M */
            if (cli_opt_size(cmd, argv[i], i + 1 < argc ? argv[i + 1] : NULL, 64, 4u << 20, 0,
                             &row_bytes))
                return 2;
            i++;
        } else if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            printf("usage: ferry moe bench [--json] [--quick] [--tokens N] [--row-bytes SIZE] "
                   "[--device host|cuda]\n"
                   "planner: ns per layer-step, top-8 of 256 experts x 58 layers, 4096 slots,\n"
                   "         per policy, on the generator's deepseek-v3 trace (512 tokens,\n"
                   "         256 with --quick), the best of 3 passes: once the slots are\n"
                   "         full (every miss evicts: the steady state), and while they\n"
                   "         fill (the first tokens' steps, no victim), apart;\n"
                   "executor: GB/s of slot writes (3 banks) on the device (default host, the\n"
                   "         host backend) vs plain memcpy of the same bytes in the same run.\n"
                   "  --tokens     16..8192: the trace's length (default 512, 256 with --quick)\n"
                   "  --row-bytes  64..4M (default 1M, 256K with --quick)\n");
            return 0;
        } else
            return cli_unknown(cmd, argv[i]);
    }
    if (quick)
        tokens = 256; /* (64 would only fill the slots: no eviction to time) */
    if (tokens_set)
        tokens = tokens_set;
    if (!row_bytes) /* not given: the default of the mode */
        row_bytes = quick ? 256u << 10 : 1u << 20;
    ferry_moe_gen_options go = FERRY_MOE_GEN_OPTIONS_INIT;
    go.tokens = tokens;
    go.seed = 1;
    ferry_moe_trace *t;
    int rc = ferry_moe_trace_generate(&go, &t);
    if (rc < 0)
        return cli_fail(cmd, "generate", rc);
    json_t *root = json_object(), *pl = json_array();
    if (!json)
        printf("planner: %s, %u layers x 256 experts, top-8, 4096 slots, %zu layer-steps\n",
               ferry_moe_trace_model(t)->name, ferry_moe_trace_model(t)->num_layers,
               ferry_moe_trace_steps(t));
    rc = bench_planner(cmd, t, 4096, json, pl);
    if (rc != 0) {
        ferry_moe_trace_destroy(t);
        json_decref(root);
        json_decref(pl);
        return rc;
    }
    ferry_moe_trace_destroy(t);
    exec_bench eb = {0};
    rc = bench_executor(cmd, device, (size_t)row_bytes, quick ? 16 : 64, quick ? 3 : 31, &eb);
    if (rc != 0) {
        json_decref(root);
        json_decref(pl);
        return rc;
    }
    moe_prefetch_bench pb = {0};
    rc = moe_bench_file_prefetch(cmd, device, 1u << 20, quick ? 4 : 8, quick ? 3 : 21, &pb);
    if (rc != 0) {
        json_decref(root);
        json_decref(pl);
        return rc;
    }
    double ratio = eb.ratio;
    if (json) {
        json_object_set_new(root, "nvme_prefetch",
                            json_pack("{s:i,s:I,s:f,s:f,s:f}", "rows", (int)pb.rows, "row_bytes",
                                      (json_int_t)pb.row_bytes, "start_us", pb.start_us,
                                      "landed_us", pb.landed_us, "sync_apply_us", pb.sync_us));
        json_object_set_new(root, "planner", pl);
        json_object_set_new(root, "executor",
                            json_pack("{s:s,s:I,s:i,s:i,s:f,s:f,s:f,s:f}", "device", device,
                                      "row_bytes", (json_int_t)eb.row_bytes, "banks", 3, "rows",
                                      (int)eb.rows, "slot_write_gbs", eb.slot_gbs, "memcpy_gbs",
                                      eb.memcpy_gbs, "ratio", ratio, "warm_plan_ns", eb.warm_ns));
        char *s = json_dumps(root, JSON_COMPACT | JSON_PRESERVE_ORDER);
        printf("%s\n", s);
        free(s);
    } else {
        json_decref(pl);
        printf("executor (%s device): %u rows x 3 banks x %zu bytes per plan\n", device, eb.rows,
               eb.row_bytes);
        printf("  slot writes %.2f GB/s, memcpy %.2f GB/s, ratio %.2f; warm plan %.0f ns\n",
               eb.slot_gbs, eb.memcpy_gbs, ratio, eb.warm_ns);
        printf("nvme prefetch (%u rows x %zu bytes from a file): prefetch_start returns in "
               "%.1f us, rows landed %.0f us; the same plan applied synchronously %.0f us\n",
               pb.rows, pb.row_bytes, pb.start_us, pb.landed_us, pb.sync_us);
    }
    json_decref(root);
    return 0;
}
