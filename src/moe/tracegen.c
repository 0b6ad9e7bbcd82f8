/*
 * tracegen.c - seeded synthetic routing traces, and the statistics they are
 * calibrated against.
 *
 * The generator draws each token's top-k set at each layer one expert at a
 * time from a mixture whose weights are the calibration knobs:
 *   - with probability r1(l): an expert of the previous token's set at this
 *     layer (temporal locality: ~45% of selections repeat at the next token);
 *   - with probability r2(l): an expert of the set 2..8 tokens back
 *     (medium-range reuse: ~80% within 8 tokens, median distance ~2);
 *   - with probability c: the fixed partner, at this layer, of an expert of
 *     this token's set at the previous layer (cross-layer correlation);
 *   - otherwise: the layer's own Zipf popularity over a random permutation
 *     of experts (skew: the top expert of 8 takes 14-19% of routes, the top
 *     32 of 256 cover 58-76%).
 * r1 and r2 are scaled by a depth factor that is lowest at the first and
 * last layers, so locality is weaker there and miss rates over depth are
 * U-shaped, as measured on real models. A candidate already in the set is
 * redrawn. The whole trace is a function of (preset, sizes, tokens, seed):
 * one xoshiro256** stream drives every choice.
 *
 * ferry__trace_stats_compute() measures those same statistics on any trace
 * (generated or captured); the calibration test and `ferry moe gen` use it.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moe/moe_internal.h"
#include "sized.h"

typedef struct preset {
    const char *name;
    uint32_t layers, experts, top_k;
    uint64_t expert_bytes;
    double zipf_s, r1, r2, cross, edge_drop;
} preset;

/* expert_bytes: gate + up + down of one expert at the model's usual
 * inference precision (fp8 for DeepSeek-V3, bf16 otherwise) */
static const preset presets[] = {
    {"deepseek-v3", 58, 256, 8, 3ull * 7168 * 2048, 1.38, 0.31, 0.42, 0.15, 0.35},
    {"qwen3-30b-a3b", 48, 128, 8, 3ull * 2048 * 768 * 2, 1.1, 0.33, 0.42, 0.15, 0.35},
    {"mixtral-8x7b", 32, 8, 2, 3ull * 4096 * 14336 * 2, 0.25, 0.26, 0.20, 0.15, 0.35},
    {"small", 4, 16, 2, 3ull * 4096, 1.0, 0.33, 0.42, 0.15, 0.35},
};

static const char *const preset_names[] = {"deepseek-v3", "qwen3-30b-a3b", "mixtral-8x7b", "small",
                                           NULL};

const char *const *ferry_moe_gen_presets(void)
{
    return preset_names;
}

#define HIST 9 /* tokens of history kept: this one and 8 back */

struct ferry__gen {
    const preset *ps;
    double scale;     /* of the temporal reuse weights (repeat_next) */
    uint32_t L, E, K;
    ferry__rng rng;
    double *cdf;      /* [L][E] cumulative popularity by rank */
    double *share;    /* [L][E] popularity of each expert (sums to 1) */
    uint32_t *rank;   /* [L][E] rank -> expert */
    uint32_t *partner;/* [L][E] expert at l-1 -> partner at l */
    uint32_t *inv;    /* [L][E] partner at l -> expert at l-1 */
    uint32_t *hist;   /* [HIST][L][K] ring of sets */
    uint32_t *stamp;  /* [E] membership of the set being built */
    uint32_t gen_no;
    uint32_t tk, l;   /* the next set to draw */
};

void ferry__gen_close(ferry__gen *g)
{
    if (!g)
        return;
    ferry__free(g->cdf);
    ferry__free(g->share);
    ferry__free(g->rank);
    ferry__free(g->partner);
    ferry__free(g->inv);
    ferry__free(g->hist);
    ferry__free(g->stamp);
    ferry__free(g);
}

static void shuffle(ferry__rng *r, uint32_t *a, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++)
        a[i] = i;
    for (uint32_t i = n; i > 1; i--) {
        uint32_t j = ferry__rng_below(r, i);
        uint32_t t = a[i - 1];
        a[i - 1] = a[j];
        a[j] = t;
    }
}

static uint32_t popular(ferry__gen *g, uint32_t l)
{
    const double *c = g->cdf + (size_t)l * g->E;
    double u = ferry__rng_unit(&g->rng) * c[g->E - 1];
    uint32_t lo = 0, hi = g->E - 1;
    while (lo < hi) {
        uint32_t mid = (lo + hi) / 2;
        if (c[mid] > u)
            hi = mid;
        else
            lo = mid + 1;
    }
    return g->rank[(size_t)l * g->E + lo];
}

static uint32_t *set_at(const ferry__gen *g, uint32_t t, uint32_t l)
{
    return g->hist + (((size_t)(t % HIST) * g->L + l) * g->K);
}

static int gen_open_scaled(const ferry_moe_gen_options *opt, double scale, ferry__gen **out,
                           ferry_moe_model *model);

/* the measured repeat_next of a short trace at this scale */
static int probe_repeat(const ferry_moe_gen_options *o, double scale, double *out)
{
    ferry_moe_gen_options p = *o;
    p.tokens = 192;
    ferry_moe_model m;
    ferry__gen *g;
    int rc = gen_open_scaled(&p, scale, &g, &m);
    if (rc < 0)
        return rc;
    ferry_moe_trace *t;
    if ((rc = ferry_moe_trace_create(&m, &t)) < 0) {
        ferry__gen_close(g);
        return rc;
    }
    for (uint32_t tk = 0; tk < p.tokens && rc == 0; tk++)
        for (uint32_t l = 0; l < m.num_layers && rc == 0; l++)
            rc = ferry_moe_trace_append(t, tk, l, ferry__gen_next(g), m.top_k);
    ferry__gen_close(g);
    ferry__trace_stats st;
    if (rc == 0 && (rc = ferry__trace_stats_compute(t, &st)) == 0) {
        *out = st.repeat_next;
        ferry__free(st.layer_repeat);
    }
    ferry_moe_trace_destroy(t);
    return rc;
}

int ferry__gen_open(const ferry_moe_gen_options *uopt, ferry__gen **out, ferry_moe_model *model)
{
    if (!uopt || !out || !model)
        return ferry__err_set(NULL, -EINVAL, "moe gen: options missing");
    static const ferry__member later[] = {FERRY__MEMBER(ferry_moe_gen_options, repeat_next)};
    static const ferry__sized sized =
        FERRY__SIZED(ferry_moe_gen_options, FERRY_MOE_GEN_OPTIONS_MIN_SIZE, later);
    ferry_moe_gen_options o = FERRY_MOE_GEN_OPTIONS_INIT;
    int rc = ferry__opts_take(NULL, "moe gen", &sized, &o, uopt);
    if (rc < 0)
        return rc;
    double target = o.repeat_next;
    if (target == 0)
        return gen_open_scaled(&o, 1.0, out, model);
    if (!(target >= 0.01 && target <= 0.9))
        return ferry__err_set(NULL, -EINVAL,
                              "moe gen: repeat_next %g: accepted 0.01..0.9 (0: the preset's)",
                              target);
    /* the shape checks first (a probe would make the same complaint) */
    ferry__gen *g;
    if ((rc = gen_open_scaled(&o, 1.0, &g, model)) < 0)
        return rc;
    const preset *ps = g->ps;
    ferry__gen_close(g);
    /* the reuse weights may grow until the mixture is all reuse */
    double lo = 0, hi = (1.0 - ps->cross) / (ps->r1 + ps->r2), floor_r = 0, ceil_r = 0;
    /* popularity alone repeats experts: a target below what no reuse at
     * all gives (or above what all reuse gives) is refused, not missed */
    if ((rc = probe_repeat(&o, lo, &floor_r)) < 0 || (rc = probe_repeat(&o, hi, &ceil_r)) < 0)
        return rc;
    if (target < floor_r - 0.01 || target > ceil_r + 0.01)
        return ferry__err_set(NULL, -EINVAL,
                              "moe gen: repeat_next %.3f: this shape (%s, %u x %u, top-%u) "
                              "reaches %.3f..%.3f",
                              target, ps->name, model->num_layers, model->num_experts,
                              model->top_k, floor_r, ceil_r);
    for (int i = 0; i < 14; i++) {
        double mid = (lo + hi) / 2, got = 0;
        if ((rc = probe_repeat(&o, mid, &got)) < 0)
            return rc;
        if (got < target)
            lo = mid;
        else
            hi = mid;
    }
    return gen_open_scaled(&o, (lo + hi) / 2, out, model);
}

static int gen_open_scaled(const ferry_moe_gen_options *opt, double scale, ferry__gen **out,
                           ferry_moe_model *model)
{
    const char *name = opt->model ? opt->model : "deepseek-v3";
    const preset *ps = NULL;
    for (size_t i = 0; i < FERRY__ARRAY_LEN(presets); i++)
        if (!strcmp(presets[i].name, name))
            ps = &presets[i];
    if (!ps)
        return ferry__err_set(NULL, -EINVAL,
                              "moe gen: model '%s': unknown preset (accepted: deepseek-v3, "
                              "qwen3-30b-a3b, mixtral-8x7b, small; NULL means deepseek-v3)",
                              name);
    /* every size in range before the arrays are sized by their products */
    if (opt->num_layers > FERRY_MOE_MAX_LAYERS)
        return ferry__err_set(NULL, -EINVAL,
                              "moe gen: num_layers %u: accepted 1..%u (0: the preset's %u)",
                              opt->num_layers, FERRY_MOE_MAX_LAYERS, ps->layers);
    if (opt->num_experts > FERRY_MOE_MAX_EXPERTS)
        return ferry__err_set(NULL, -EINVAL,
                              "moe gen: num_experts %u: accepted 1..%u (0: the preset's %u)",
                              opt->num_experts, FERRY_MOE_MAX_EXPERTS, ps->experts);
    uint32_t L = opt->num_layers ? opt->num_layers : ps->layers;
    uint32_t E = opt->num_experts ? opt->num_experts : ps->experts;
    uint32_t K = opt->top_k ? opt->top_k : ps->top_k;
    if (K > E)
        return ferry__err_set(NULL, -EINVAL,
                              "moe gen: top_k %u%s: accepted 1..num_experts (%u)", K,
                              opt->top_k ? "" : " (the preset's)", E);
    uint32_t T = opt->tokens ? opt->tokens : 2048;
    uint64_t steps = (uint64_t)T * L, ids = steps * K; /* < 2^32 * 2^10 * 2^14 */
    if (steps > FERRY__TRACE_MAX_STEPS || ids > FERRY__TRACE_MAX_IDS)
        return ferry__err_set(NULL, -EINVAL,
                              "moe gen: tokens %u: %llu steps (tokens x %u layers) of %u experts; "
                              "accepted: tokens x layers at most %zu and x top_k at most %zu",
                              T, (unsigned long long)steps, L, K, FERRY__TRACE_MAX_STEPS,
                              FERRY__TRACE_MAX_IDS);
    ferry__gen *g = ferry__calloc(1, sizeof *g);
    if (!g)
        return ferry__err_set(NULL, -ENOMEM, "moe gen: out of memory");
    g->ps = ps;
    g->scale = scale;
    g->L = L;
    g->E = E;
    g->K = K;
    size_t le = (size_t)L * E;
    g->cdf = ferry__malloc(le * sizeof *g->cdf);
    g->share = ferry__malloc(le * sizeof *g->share);
    g->rank = ferry__malloc(le * sizeof *g->rank);
    g->partner = ferry__malloc(le * sizeof *g->partner);
    g->inv = ferry__malloc(le * sizeof *g->inv);
    g->hist = ferry__malloc((size_t)HIST * L * K * sizeof *g->hist);
    g->stamp = ferry__calloc(E, sizeof *g->stamp);
    if (!g->cdf || !g->share || !g->rank || !g->partner || !g->inv || !g->hist || !g->stamp) {
        ferry__gen_close(g);
        return ferry__err_set(NULL, -ENOMEM, "moe gen: out of memory for %u x %u experts", L, E);
    }
    ferry__rng_seed(&g->rng, opt->seed);
    for (uint32_t l = 0; l < L; l++) {
        uint32_t *rk = g->rank + (size_t)l * E, *pt = g->partner + (size_t)l * E;
        shuffle(&g->rng, rk, E);
        shuffle(&g->rng, pt, E);
        double acc = 0;
        for (uint32_t r = 0; r < E; r++) {
            acc += 1.0 / pow(r + 1.0, ps->zipf_s);
            g->cdf[(size_t)l * E + r] = acc;
        }
        for (uint32_t r = 0; r < E; r++) {
            g->share[(size_t)l * E + rk[r]] = 1.0 / pow(r + 1.0, ps->zipf_s) / acc;
            g->inv[(size_t)l * E + pt[r]] = r;
        }
    }
    memset(model, 0, sizeof *model);
    snprintf(model->name, sizeof model->name, "%s", ps->name);
    model->num_layers = L;
    model->num_experts = E;
    model->top_k = K;
    model->expert_bytes = ps->expert_bytes;
    *out = g;
    return 0;
}

/* the mixture weights of layer l: previous token, 2..8 back, partner */
static void weights(const ferry__gen *g, uint32_t l, double *r1, double *r2)
{
    double x = g->L > 1 ? 2.0 * l / (g->L - 1) - 1.0 : 0.0;
    double f = 1.0 - g->ps->edge_drop * x * x;
    *r1 = g->ps->r1 * f * g->scale;
    *r2 = g->ps->r2 * f * g->scale;
}

const uint32_t *ferry__gen_next(ferry__gen *g)
{
    uint32_t tk = g->tk, l = g->l;
    double r1, r2;
    weights(g, l, &r1, &r2);
    uint32_t *cur = set_at(g, tk, l);
    uint32_t gn = ++g->gen_no;
    for (uint32_t j = 0; j < g->K; j++) {
        uint32_t cand = 0;
        int ok = 0;
        for (int attempt = 0; attempt < 8 && !ok; attempt++) {
            double u = ferry__rng_unit(&g->rng);
            if (tk >= 1 && u < r1)
                cand = set_at(g, tk - 1, l)[ferry__rng_below(&g->rng, g->K)];
            else if (tk >= 2 && u < r1 + r2) {
                uint32_t back = tk - 1 < HIST - 1 ? tk - 1 : HIST - 1;
                uint32_t d = 2 + ferry__rng_below(&g->rng, back - 1 ? back - 1 : 1);
                if (d > tk)
                    d = tk;
                cand = set_at(g, tk - d, l)[ferry__rng_below(&g->rng, g->K)];
            } else if (l >= 1 && u < r1 + r2 + g->ps->cross) {
                uint32_t a = set_at(g, tk, l - 1)[ferry__rng_below(&g->rng, g->K)];
                cand = g->partner[(size_t)l * g->E + a];
            } else
                cand = popular(g, l);
            ok = g->stamp[cand] != gn;
        }
        while (!ok) { /* a set nearly as wide as the layer: take the next free */
            cand = (cand + 1) % g->E;
            ok = g->stamp[cand] != gn;
        }
        g->stamp[cand] = gn;
        cur[j] = cand;
    }
    if (++g->l == g->L) {
        g->l = 0;
        g->tk++;
    }
    return cur;
}

static uint32_t count_in(const ferry__gen *g, uint32_t t, uint32_t l, uint32_t e)
{
    const uint32_t *set = set_at(g, t, l);
    uint32_t n = 0;
    for (uint32_t k = 0; k < g->K; k++)
        n += set[k] == e;
    return n;
}

/* the probability one draw of (tk, l) picks e, from what is drawn so far;
 * with_cross = 0 leaves out the partner term (its set is not drawn yet) */
static double draw_prob(const ferry__gen *g, uint32_t tk, uint32_t l, uint32_t e, int with_cross)
{
    double r1, r2, c = l >= 1 ? g->ps->cross : 0.0, q = 0.0;
    weights(g, l, &r1, &r2);
    if (tk < 1)
        r1 = 0;
    if (tk < 2)
        r2 = 0;
    if (r1 > 0)
        q += r1 * count_in(g, tk - 1, l, e) / g->K;
    if (r2 > 0) {
        uint32_t back = tk - 1 < HIST - 1 ? tk - 1 : HIST - 1;
        uint32_t nd = back - 1 ? back - 1 : 1;
        double n = 0;
        for (uint32_t d = 2; d < 2 + nd; d++)
            n += count_in(g, tk - (d > tk ? tk : d), l, e);
        q += r2 * n / ((double)g->K * nd);
    }
    if (c > 0 && with_cross) {
        uint32_t a = g->inv[(size_t)l * g->E + e]; /* the one expert at l-1 whose partner is e */
        int drawn = tk < g->tk || (tk == g->tk && l - 1 < g->l);
        double pa;
        if (drawn)
            pa = count_in(g, tk, l - 1, a) ? 1.0 : 0.0;
        else {
            double qa = draw_prob(g, tk, l - 1, a, 0);
            pa = 1.0 - pow(1.0 - qa, g->K);
        }
        q += c * pa / g->K;
    }
    double rest = 1.0 - r1 - r2 - c;
    if (rest > 0)
        q += rest * g->share[(size_t)l * g->E + e];
    return q;
}

double ferry__gen_prob(const ferry__gen *g, uint32_t tk, uint32_t l, uint32_t e)
{
    /* the layer's next turn: tk's sets 1..8 back are all in the ring */
    if (l >= g->L || e >= g->E || tk + 1 < g->tk || tk > g->tk + 1)
        return 0.0;
    double q = draw_prob(g, tk, l, e, 1);
    return 1.0 - pow(1.0 - (q < 1.0 ? q : 1.0), g->K);
}

int ferry_moe_trace_generate(const ferry_moe_gen_options *opt, ferry_moe_trace **out)
{
    if (!out)
        return ferry__err_set(NULL, -EINVAL, "moe gen: options missing or too old");
    ferry_moe_model m;
    ferry__gen *g;
    int rc = ferry__gen_open(opt, &g, &m);
    if (rc < 0)
        return rc;
    uint32_t tokens = opt->tokens ? opt->tokens : 2048;
    ferry_moe_trace *t;
    rc = ferry_moe_trace_create(&m, &t);
    if (rc < 0) {
        ferry__gen_close(g);
        return rc;
    }
    for (uint32_t tk = 0; tk < tokens && rc == 0; tk++)
        for (uint32_t l = 0; l < m.num_layers && rc == 0; l++)
            rc = ferry_moe_trace_append(t, tk, l, ferry__gen_next(g), m.top_k);
    ferry__gen_close(g);
    if (rc < 0) {
        ferry_moe_trace_destroy(t);
        return rc;
    }
    *out = t;
    return 0;
}

/* ---- statistics ---- */
static int cmp_desc(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? 1 : x > y ? -1 : 0;
}

/* the work arrays of ferry__trace_stats_compute over one trace */
typedef struct tsw {
    const ferry_moe_trace *t;
    uint32_t L, E, T, half;
    size_t ids;
    uint64_t *count, *stamp, *dist, *sorted, *lrep, *ltot, *count_half;
    uint32_t *last, *pairs, *best;
    double *layer_repeat;
    int do_pairs;
    uint64_t rep, rep_tot, w8, w8_tot;
} tsw;

static void tsw_free(tsw *w)
{
    void *a[] = {w->count, w->last, w->stamp, w->dist, w->sorted, w->lrep,
                 w->ltot,  w->pairs, w->best, w->count_half};
    for (size_t k = 0; k < sizeof a / sizeof a[0]; k++)
        ferry__free(a[k]);
}

static int tsw_alloc(tsw *w)
{
    size_t ids = w->ids;
    uint32_t L = w->L, E = w->E;
    w->count = ferry__calloc(ids, sizeof *w->count);
    w->last = ferry__malloc(ids * sizeof *w->last);
    w->stamp = ferry__calloc(ids, sizeof *w->stamp);
    w->dist = ferry__calloc(65, sizeof *w->dist); /* 1..64, 64 = more */
    w->sorted = ferry__malloc((size_t)E * sizeof *w->sorted);
    w->lrep = ferry__calloc(L, sizeof *w->lrep);
    w->ltot = ferry__calloc(L, sizeof *w->ltot);
    w->layer_repeat = ferry__calloc(L, sizeof *w->layer_repeat);
    w->do_pairs = E <= 512 && w->T >= 4;
    if (w->do_pairs) {
        w->pairs = ferry__calloc((size_t)L * E * E, sizeof *w->pairs);
        w->best = ferry__malloc(ids * sizeof *w->best);
        w->count_half = ferry__calloc(ids, sizeof *w->count_half);
    }
    if (!w->count || !w->last || !w->stamp || !w->dist || !w->sorted || !w->lrep || !w->ltot ||
        !w->layer_repeat || (w->do_pairs && (!w->pairs || !w->best || !w->count_half))) {
        tsw_free(w);
        ferry__free(w->layer_repeat);
        return -ENOMEM;
    }
    memset(w->last, 0xff, ids * sizeof *w->last);
    return 0;
}

/* pass 1: counts, reuse distances, and pairs of consecutive layers on the
 * first half of the tokens */
static void tsw_pass(tsw *w)
{
    const ferry_moe_trace *t = w->t;
    uint32_t E = w->E;
    for (size_t i = 0; i < t->n_steps; i++) {
        uint32_t tk = t->tok[i], l = t->layer[i];
        for (size_t j = t->off[i]; j < t->off[i + 1]; j++) {
            size_t id = (size_t)l * E + t->ex[j];
            if (w->stamp[id] == i + 1)
                continue;
            w->stamp[id] = i + 1;
            w->count[id]++;
            if (w->do_pairs && tk < w->half)
                w->count_half[id]++;
            if (tk >= 1) {
                w->rep_tot++;
                w->ltot[l]++;
                if (w->last[id] == tk - 1) {
                    w->rep++;
                    w->lrep[l]++;
                }
            }
            if (w->last[id] != UINT32_MAX && tk > w->last[id]) {
                uint32_t d = tk - w->last[id];
                w->dist[d > 64 ? 64 : d]++;
            }
            if (tk >= 8) {
                w->w8_tot++;
                if (w->last[id] != UINT32_MAX && tk - w->last[id] <= 8)
                    w->w8++;
            }
            w->last[id] = tk;
        }
        /* pairs with the previous step when it is layer l-1 of this token */
        if (w->do_pairs && tk < w->half && i > 0 && l > 0 && t->tok[i - 1] == tk &&
            t->layer[i - 1] == l - 1)
            for (size_t a = t->off[i - 1]; a < t->off[i]; a++)
                for (size_t b = t->off[i]; b < t->off[i + 1]; b++)
                    w->pairs[((size_t)l * E + t->ex[a]) * E + t->ex[b]]++;
    }
}

/* each layer's top-1 share, top-32 cover and next-token repeat rate; the
 * median reuse distance */
static void tsw_shares(tsw *w, ferry__trace_stats *out)
{
    uint32_t L = w->L, E = w->E;
    double top1 = 0, top32 = 0;
    for (uint32_t l = 0; l < L; l++) {
        uint64_t tot = 0;
        for (uint32_t e = 0; e < E; e++) {
            w->sorted[e] = w->count[(size_t)l * E + e];
            tot += w->sorted[e];
        }
        qsort(w->sorted, E, sizeof *w->sorted, cmp_desc);
        uint64_t c32 = 0;
        for (uint32_t e = 0; e < E && e < 32; e++)
            c32 += w->sorted[e];
        if (tot) {
            top1 += (double)w->sorted[0] / tot;
            top32 += (double)c32 / tot;
        }
        w->layer_repeat[l] = w->ltot[l] ? (double)w->lrep[l] / w->ltot[l] : 0;
    }
    out->top1_share = top1 / L;
    out->top32_cover = E >= 64 ? top32 / L : 0;
    out->repeat_next = w->rep_tot ? (double)w->rep / w->rep_tot : 0;
    out->within8 = w->w8_tot ? (double)w->w8 / w->w8_tot : 0;
    uint64_t dtot = 0, acc = 0;
    for (int d = 1; d <= 64; d++)
        dtot += w->dist[d];
    for (int d = 1; d <= 64; d++) {
        acc += w->dist[d];
        if (2 * acc >= dtot && dtot) {
            out->median_reuse = d;
            break;
        }
    }
}

/* learn each expert's best next-layer partner on the first half of the
 * tokens: the partner co-occurring most in excess of chance (count minus
 * what independence predicts): a raw count would name the layer's most
 * popular expert, a ratio a rare one */
static void tsw_partners(tsw *w)
{
    uint32_t L = w->L, E = w->E;
    for (size_t id = 0; id < w->ids; id++) {
        uint32_t l = (uint32_t)(id / E);
        w->best[id] = UINT32_MAX;
        if (l + 1 >= L)
            continue;
        const uint32_t *row = w->pairs + ((size_t)(l + 1) * E + id % E) * E;
        double bl = 0, ca = (double)w->count_half[id];
        for (uint32_t b = 0; b < E; b++) {
            double cb = (double)w->count_half[(size_t)(l + 1) * E + b];
            double excess = row[b] - ca * cb / (w->half ? w->half : 1);
            if (row[b] >= 3 && excess > bl) {
                bl = excess;
                w->best[id] = b;
            }
        }
    }
}

/* measure the partners on the second half against chance: an unbiased
 * lift (0 when memory runs out for the pass) */
static double tsw_lift(tsw *w)
{
    const ferry_moe_trace *t = w->t;
    uint32_t E = w->E;
    uint64_t hit = 0, tries = 0;
    uint64_t *present = ferry__calloc(w->ids, sizeof *present);
    if (!present)
        return 0;
    for (size_t i = 0; i < t->n_steps; i++) {
        uint32_t tk = t->tok[i], l = t->layer[i];
        if (tk < w->half)
            continue;
        for (size_t j = t->off[i]; j < t->off[i + 1]; j++)
            present[(size_t)l * E + t->ex[j]] = i + 1;
        if (l == 0 || i == 0 || t->tok[i - 1] != tk || t->layer[i - 1] != l - 1)
            continue;
        for (size_t a = t->off[i - 1]; a < t->off[i]; a++) {
            uint32_t b = w->best[(size_t)(l - 1) * E + t->ex[a]];
            if (b == UINT32_MAX)
                continue;
            tries++;
            hit += present[(size_t)l * E + b] == i + 1;
        }
    }
    ferry__free(present);
    /* chance: the partner is just one of the layer's experts, routed with
     * that expert's share of this layer's steps */
    double p_cond = tries ? (double)hit / tries : 0;
    double p_base = 0;
    uint64_t n_base = 0;
    for (size_t id = 0; id < w->ids; id++) {
        if (w->best[id] == UINT32_MAX)
            continue;
        uint32_t l = (uint32_t)(id / E) + 1;
        p_base += (double)w->count[(size_t)l * E + w->best[id]] / (w->T ? w->T : 1);
        n_base++;
    }
    p_base = n_base ? p_base / n_base : 0;
    return p_base > 0 ? p_cond / p_base : 0;
}

int ferry__trace_stats_compute(const ferry_moe_trace *t, ferry__trace_stats *out)
{
    tsw w;
    memset(&w, 0, sizeof w);
    memset(out, 0, sizeof *out);
    w.t = t;
    w.L = t->model.num_layers;
    w.E = t->model.num_experts;
    w.T = t->n_tokens;
    w.half = w.T / 2;
    w.ids = (size_t)w.L * w.E;
    if (tsw_alloc(&w) < 0)
        return -ENOMEM;
    tsw_pass(&w);
    tsw_shares(&w, out);
    if (w.do_pairs) {
        tsw_partners(&w);
        out->cross_lift = tsw_lift(&w);
    }
    out->layer_repeat = w.layer_repeat;
    tsw_free(&w);
    return 0;
}
