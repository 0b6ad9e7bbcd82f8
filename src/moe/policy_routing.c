/*
 * policy_routing.c - "routing": an online approximation of Belady's MIN
 * built from the structure of MoE routing.
 *
 * Belady evicts the resident expert whose next use is furthest away. This
 * policy predicts that next use and evicts the furthest prediction, in
 * absolute steps (token * num_layers + layer). Measuring in steps is what
 * global LRU gets backwards: layers run in a cycle, so while layer l runs,
 * the experts layer l+1 used at the previous token are the OLDEST in LRU
 * order and yet the soonest needed. The prediction comes from:
 *
 *  - the reuse-distance distribution, learned online: a histogram of the
 *    gaps (in tokens) between consecutive routes of the same expert, kept
 *    per frequency class; from it, the expected remaining time to the next
 *    route GIVEN the tokens already waited, E[gap - a | gap > a]. Routing
 *    reuse is bursty (a route at the next token is far likelier than at any
 *    later one), so this conditional expectation grows as an expert waits,
 *    which plain recency or frequency cannot express;
 *  - the frequency class: an expert's route count decayed with a half-life
 *    of HALF_LIFE tokens, in half-octaves; hot experts and one-off ones
 *    have very different gap distributions, so each class has its own;
 *  - cross-layer correlation: a space-saving table learns, for each expert
 *    at layer l, the experts most often routed with it at layer l+1 on the
 *    same token (in excess of the partner's own rate); when it is routed,
 *    its strongest resident partner is predicted for the very next step.
 *
 * A prediction changes only when the expert is routed or has waited past a
 * check point (ages 1, 2, 4, 8, ... tokens, or its predicted token): a
 * per-layer min-heap on the check token finds those when their layer runs,
 * so keys never change with time alone, the eviction heap stays valid, and
 * each route costs O(log n) amortised. Ties go to the lowest slot index.
 */
#include <errno.h>
#include <math.h>
#include <string.h>

#include "moe/moe_internal.h"
#include <stdlib.h>
static int knob(const char *n, int d) { const char *v = getenv(n); return v ? atoi(v) : d; }

#define SUCC_WAYS 4
#define CLASSES 8
#define MAX_GAP 64           /* gaps >= MAX_GAP share the last bucket */
#define HALF_LIFE 4.0        /* tokens */
#define REFRESH_ROUTES 2048u /* rebuild the expectation tables this often */

typedef struct succ_entry {
    uint32_t id;     /* layer-local expert of the next layer, NONE if empty */
    uint32_t count;
} succ_entry;

typedef struct routing {
    ferry__policy base;
    ferry__heap evict;        /* key: -(predicted step) -> top = furthest */
    ferry__heap *due;         /* per layer, key: token of the next check */
    uint32_t *pos_e, *pos_d, *scratch;
    double *key_e, *key_d;
    uint32_t *last_tok;       /* per id: token of the last route, NONE never */
    float *cnt;               /* per id: decayed route count at last_tok */
    uint8_t *cls;             /* per id: frequency class at the last route */
    double hist[CLASSES][MAX_GAP + 1];
    double ovf_sum[CLASSES];  /* sum of the gaps in the last bucket */
    double erem[CLASSES][MAX_GAP + 1]; /* E[gap - a | gap > a] */
    double phor[CLASSES][MAX_GAP + 1]; /* P(gap <= a + H | gap > a) */
    uint32_t since_refresh;
    succ_entry *succ;         /* [(layer * E + e) * SUCC_WAYS] */
    uint32_t *prev_ids;       /* previous step's ids (for learning pairs) */
    uint32_t prev_n, prev_layer, prev_tok;
    int have_prev;
} routing;

#include <stdio.h>
static void rt_fini(ferry__policy *p)
{
    routing *s = (routing *)p;
    if (knob("RT_DUMP", 0) && s->due) for (int c = 0; c < CLASSES; c++) { fprintf(stderr, "c%d n=%.0f:", c, s->hist[c][1]); for (int a = 0; a < 12; a++) fprintf(stderr, " %.2f", s->erem[c][a]); fprintf(stderr, "\n"); }
    ferry__heap_fini(&s->evict);
    if (s->due)
        for (uint32_t l = 0; l < p->env.num_layers; l++)
            ferry__heap_fini(&s->due[l]);
    ferry__free(s->due);
    ferry__free(s->pos_e);
    ferry__free(s->pos_d);
    ferry__free(s->scratch);
    ferry__free(s->key_e);
    ferry__free(s->key_d);
    ferry__free(s->last_tok);
    ferry__free(s->cnt);
    ferry__free(s->cls);
    ferry__free(s->succ);
    ferry__free(s->prev_ids);
}

/* the expectation tables from the histograms; a class with no data yet
 * borrows a geometric prior with mean 4 tokens */
static void refresh(routing *s)
{
    for (int c = 0; c < CLASSES; c++) {
        double h_last = s->hist[c][MAX_GAP];
        double mean_last = h_last > 0 ? s->ovf_sum[c] / h_last : 2.0 * MAX_GAP;
        double s0 = 0, s1 = 0; /* count and sum of the gaps > a */
        s->erem[c][MAX_GAP] = h_last >= 4 ? mean_last - MAX_GAP : MAX_GAP;
        for (int a = MAX_GAP - 1; a >= 0; a--) {
            double h = s->hist[c][a + 1];
            s0 += h;
            s1 += h * (a + 1 == MAX_GAP ? mean_last : a + 1);
            /* with little data, a prior: the longer waited, the longer to go */
            double e = s0 >= 4 ? s1 / s0 - a : 4.0 + a;
            s->erem[c][a] = e < 0.5 ? 0.5 : e;
        }
        if (s->erem[c][MAX_GAP] < 0.5)
            s->erem[c][MAX_GAP] = 0.5;
        int H = knob("RT_H", 8);
        for (int a = 0; a <= MAX_GAP; a++) {
            double tot = 0, in = 0;
            for (int g = a + 1; g <= MAX_GAP; g++) { tot += s->hist[c][g]; if (g <= a + H) in += s->hist[c][g]; }
            s->phor[c][a] = tot >= 4 ? in / tot : 0.5 / (1 + a);
        }
        int q = knob("RT_Q", 0);
        if (q) {
            for (int a = 0; a < MAX_GAP; a++) {
                double tot = 0;
                for (int g = a + 1; g <= MAX_GAP; g++) tot += s->hist[c][g];
                if (tot < 4) continue;
                double acc = 0; int g;
                for (g = a + 1; g < MAX_GAP; g++) { acc += s->hist[c][g]; if (acc >= tot * q / 100.0) break; }
                s->erem[c][a] = g - a;
            }
        }
    }
    s->since_refresh = 0;
}

static int rt_init(ferry__policy *p)
{
    routing *s = (routing *)p;
    uint32_t n = p->env.slots, L = p->env.num_layers, E = p->env.num_experts;
    size_t ids = (size_t)L * E;
    s->due = ferry__calloc(L, sizeof *s->due);
    s->pos_e = ferry__malloc((size_t)n * sizeof(uint32_t));
    s->pos_d = ferry__malloc((size_t)n * sizeof(uint32_t));
    s->scratch = ferry__malloc((size_t)n * sizeof(uint32_t));
    s->key_e = ferry__calloc(n, sizeof(double));
    s->key_d = ferry__calloc(n, sizeof(double));
    s->last_tok = ferry__malloc(ids * sizeof(uint32_t));
    s->cnt = ferry__calloc(ids, sizeof(float));
    s->cls = ferry__calloc(ids, 1);
    s->succ = ferry__malloc(ids * SUCC_WAYS * sizeof(succ_entry));
    s->prev_ids = ferry__malloc((size_t)E * sizeof(uint32_t));
    if (!s->due || !s->pos_e || !s->pos_d || !s->scratch || !s->key_e || !s->key_d ||
        !s->last_tok || !s->cnt || !s->cls || !s->succ || !s->prev_ids ||
        ferry__heap_init(&s->evict, n, s->pos_e, s->key_e) < 0) {
        rt_fini(p);
        return -ENOMEM;
    }
    memset(s->pos_e, 0xff, (size_t)n * sizeof(uint32_t));
    memset(s->pos_d, 0xff, (size_t)n * sizeof(uint32_t));
    memset(s->last_tok, 0xff, ids * sizeof(uint32_t));
    for (size_t i = 0; i < ids * SUCC_WAYS; i++) {
        s->succ[i].id = FERRY_MOE_NONE;
        s->succ[i].count = 0;
    }
    /* room for every slot in each layer's heap, so an insert never fails
     * half-way through a step */
    for (uint32_t l = 0; l < L; l++)
        if (ferry__heap_init(&s->due[l], n, s->pos_d, s->key_d) < 0) {
            rt_fini(p);
            return -ENOMEM;
        }
    memset(s->hist, 0, sizeof s->hist);
    memset(s->ovf_sum, 0, sizeof s->ovf_sum);
    refresh(s);
    return 0;
}

/* slot (holding id) is predicted for token `tok`; check it again at `check` */
static int predict(routing *s, uint32_t slot, uint32_t id, double tok, double check, uint32_t age)
{
    ferry__policy *p = &s->base;
    uint32_t layer = id / p->env.num_experts;
    double key = knob("RT_CYC", 1) ? -(tok * p->env.num_layers + layer) : -tok;
    if (knob("RT_MODE", 0) == 1) {
        key = s->phor[s->cls[id]][age < MAX_GAP ? age : MAX_GAP];
    }
    int rc = ferry__heap_set(&s->evict, slot, key);
    if (rc == 0)
        rc = ferry__heap_set(&s->due[layer], slot, check);
    return rc;
}

/* prediction for id, which has waited `age` tokens since its last route */
static void forecast(routing *s, uint32_t id, uint32_t now, uint32_t age, double *tok,
                     double *check)
{
    int c = s->cls[id];
    double e = s->erem[c][age < MAX_GAP ? age : MAX_GAP];
    if (age >= MAX_GAP)
        e += age - MAX_GAP;
    *tok = now + e;
    /* look again at the next power-of-two age, or at the predicted token */
    uint32_t next_age = (knob("RT_EVERY", 0) || age < 16) ? age + 1 : age ? age * 2 : 1;
    double at = (double)(now - age) + next_age;
    double pt = ceil(*tok);
    *check = pt < at ? pt : at;
    if (*check <= now)
        *check = now + 1;
}

/* a route of id at the current token */
static void observe(routing *s, uint32_t id)
{
    uint32_t now = *s->base.env.token;
    uint32_t last = s->last_tok[id];
    double c = 1.0;
    if (last != UINT32_MAX && now > last) {
        uint32_t g = now - last;
        int cl = s->cls[id];
        s->hist[cl][g < MAX_GAP ? g : MAX_GAP] += 1;
        if (g >= MAX_GAP)
            s->ovf_sum[cl] += g;
        c += s->cnt[id] * exp2(-(double)g / HALF_LIFE);
    } else if (last == now)
        c = s->cnt[id];
    s->cnt[id] = (float)c;
    int cl = (int)floor(2.0 * log2(c));
    s->cls[id] = (uint8_t)(cl < 0 ? 0 : cl >= CLASSES ? CLASSES - 1 : cl);
    s->last_tok[id] = now;
    if (++s->since_refresh >= REFRESH_ROUTES)
        refresh(s);
}

static void routed(routing *s, uint32_t slot, uint32_t id)
{
    observe(s, id);
    double tok, check;
    forecast(s, id, *s->base.env.token, 0, &tok, &check);
    (void)predict(s, slot, id, tok, check, 0);
}

static void rt_hit(ferry__policy *p, uint32_t slot, uint32_t id)
{
    routed((routing *)p, slot, id);
}

static int rt_insert(ferry__policy *p, uint32_t slot, uint32_t id, int prefetch)
{
    routing *s = (routing *)p;
    uint32_t now = *p->env.token;
    if (prefetch) /* wanted within the token by whoever predicted it */
        return predict(s, slot, id, now, now + 1, 0);
    observe(s, id);
    double tok, check;
    forecast(s, id, now, 0, &tok, &check);
    return predict(s, slot, id, tok, check, 0);
}

static void rt_remove(ferry__policy *p, uint32_t slot, uint32_t id, int evicted)
{
    routing *s = (routing *)p;
    ferry__heap_remove(&s->evict, slot);
    ferry__heap_remove(&s->due[id / p->env.num_experts], slot);
}

static int rt_victim(ferry__policy *p, uint32_t id, int have_free, uint32_t *slot)
{
    routing *s = (routing *)p;
    if (have_free)
        return 1;
    uint32_t v = ferry__heap_first_unpinned(&s->evict, p->env.pin_step, *p->env.step, s->scratch,
                                            p->env.slots);
    if (v == UINT32_MAX)
        return -1;
    *slot = v;
    return 0;
}

/* space-saving update of (layer, a)'s successor table with b */
static void learn(routing *s, uint32_t layer, uint32_t a, uint32_t b)
{
    succ_entry *t = &s->succ[((size_t)layer * s->base.env.num_experts + a) * SUCC_WAYS];
    uint32_t min_i = 0;
    for (uint32_t i = 0; i < SUCC_WAYS; i++) {
        if (t[i].id == b) {
            t[i].count++;
            return;
        }
        if (t[i].count < t[min_i].count)
            min_i = i;
    }
    t[min_i].id = b;
    t[min_i].count++;
}

static void rt_end_step(ferry__policy *p, uint32_t layer, const uint32_t *ids, uint32_t n)
{
    routing *s = (routing *)p;
    uint32_t E = p->env.num_experts, L = p->env.num_layers;
    uint32_t tok = *p->env.token;

    /* check points reached: residents of this layer not routed now (those
     * routed were just re-predicted, with checks after now) */
    ferry__heap *d = &s->due[layer];
    while (d->n) {
        uint32_t slot = ferry__heap_top(d);
        if (s->key_d[slot] > (double)tok)
            break;
        uint32_t id = p->env.occupant[slot];
        uint32_t last = s->last_tok[id];
        uint32_t age = last == UINT32_MAX || last > tok ? 1 : tok - last;
        double pt, check;
        forecast(s, id, tok, age, &pt, &check);
        if (predict(s, slot, id, pt, check, age) < 0)
            break;
    }

    /* cross-layer: learn pairs (previous layer -> this layer) of this token */
    if (s->have_prev && s->prev_tok == tok && s->prev_layer + 1 == layer) {
        for (uint32_t i = 0; i < s->prev_n; i++)
            for (uint32_t j = 0; j < n; j++)
                learn(s, s->prev_layer, s->prev_ids[i] % E, ids[j] % E);
    }
    /* hint: each routed expert's strongest partner at the next layer is
     * predicted for the next step */
    if (layer + 1 < L && knob("RT_HINT", 1)) {
        for (uint32_t j = 0; j < n; j++) {
            const succ_entry *t = &s->succ[((size_t)layer * E + ids[j] % E) * SUCC_WAYS];
            uint32_t best = 0;
            for (uint32_t i = 1; i < SUCC_WAYS; i++)
                if (t[i].count > t[best].count)
                    best = i;
            if (t[best].id == FERRY_MOE_NONE || t[best].count < 3)
                continue;
            uint32_t pid = (layer + 1) * E + t[best].id;
            uint32_t slot = p->env.where[pid];
            if (slot != FERRY_MOE_NONE && !ferry__pinned(p, slot))
                (void)ferry__heap_set(&s->evict, slot, -((double)tok * L + layer + 1));
        }
    }
    memcpy(s->prev_ids, ids, (size_t)n * sizeof *ids);
    s->prev_n = n;
    s->prev_layer = layer;
    s->prev_tok = tok;
    s->have_prev = 1;
}

const ferry__policy_ops ferry__policy_routing = {
    .name = "routing",
    .describe = "predicted next use from the learned reuse-distance distribution per frequency "
                "class and cross-layer partners; evicts the furthest prediction",
    .state_size = sizeof(routing),
    .init = rt_init,
    .fini = rt_fini,
    .end_step = rt_end_step,
    .hit = rt_hit,
    .insert = rt_insert,
    .remove = rt_remove,
    .victim = rt_victim,
};
