/*
 * policy_transition.c - "transition": a learned same-layer token-to-token
 * transition model (opt-in; the research prototype's "trans2-lite",
 * /work/research-policy/REPORT.md section 3).
 *
 * At each visit of layer l (begin_step, which sees the step's routes R
 * before hits and misses are resolved) the policy
 *   1. counts, for every expert e of l, its previous cell and whether it
 *      is routed now (one global table of P(routed | cell));
 *   2. counts the transitions "r routed at l's last visit -> e routed
 *      now" (A[l][r][e], An[l][r]);
 *   3. computes e's transition feature: the mean over r in R of
 *      (A[l][r][e] + n/E) / (An[l][r] + 1), the smoothed probability that
 *      e follows R at l's next visit;
 *   4. gives e a new cell (routed now, routes in its last 16 visits, the
 *      feature's bin of 17) and p = (k[c] + 20 prior[c]) / (n[c] + 20),
 *      prior 0.45 when routed now and 0.08 otherwise (LRU-like until the
 *      table has data).
 * The victim is the unpinned resident with the least p / d, d the steps
 * until its layer runs again ((layer - l) mod L, 0 read as L), compared
 * by cross-multiplication; ties go to the older last use, then the lowest
 * slot. The smoothing uses the step's own route count n where the
 * prototype uses top_k: the same on decode traces.
 *
 * Memory: A is L x E x E uint16 counters; a row is halved with its total
 * before a count would overflow (A[r][e] <= An[r] always holds), so the
 * ratios survive. Shapes whose A would pass FERRY__TRANSITION_MAX_BYTES
 * are refused at planner create. Victim: a scan over the slots, O(slots)
 * per eviction; a visit costs O(E n).
 */
#include <errno.h>
#include <string.h>

#include "moe/moe_internal.h"

#define TR_W 16   /* history window (visits of the id's layer) */
#define TR_NQ 17  /* transition bins: 1 + the edges */
#define TR_NC (2 * (TR_W + 1) * TR_NQ)
#define TR_M 20.0 /* backoff strength toward the prior */
#define TR_P_HI 0.45
#define TR_P_LO 0.08

static const double tr_edges[TR_NQ - 1] = {0.01, 0.02, 0.03, 0.05, 0.07, 0.10, 0.13, 0.16,
                                           0.20, 0.25, 0.30, 0.35, 0.40, 0.50, 0.60, 0.70};

typedef struct trans {
    ferry__policy base;
    uint32_t layer;    /* the current step's layer */
    uint32_t *hist;    /* per id: bit i = routed at its layer's (i+1)-th last visit */
    uint16_t *cell;    /* per id: cell as of its layer's last visit */
    double *psnap;     /* per id: p as of its layer's last visit */
    uint64_t *last;    /* per id: step of its last use (ties) */
    uint16_t *A;       /* [L][E][E]: r at a visit -> e at the next visit */
    uint16_t *An;      /* [L][E]: visits with r routed and a following visit */
    uint16_t *prev;    /* [L][E]: the experts of layer l's last visit */
    int32_t *nprev;    /* per layer: how many, -1 before the first visit */
    double *tv;        /* E */
    uint8_t *used;     /* E */
    double nG[TR_NC], kG[TR_NC];
} trans;

size_t ferry__transition_bytes(uint32_t num_layers, uint32_t num_experts)
{
    return (size_t)num_layers * num_experts * num_experts * sizeof(uint16_t);
}

static void tr_fini(ferry__policy *p)
{
    trans *s = (trans *)p;
    ferry__free(s->hist);
    ferry__free(s->cell);
    ferry__free(s->psnap);
    ferry__free(s->last);
    ferry__free(s->A);
    ferry__free(s->An);
    ferry__free(s->prev);
    ferry__free(s->nprev);
    ferry__free(s->tv);
    ferry__free(s->used);
}

static int tr_init(ferry__policy *p)
{
    trans *s = (trans *)p;
    uint32_t L = p->env.num_layers, E = p->env.num_experts;
    if (ferry__transition_bytes(L, E) > FERRY__TRANSITION_MAX_BYTES)
        return -EINVAL;
    size_t ids = (size_t)L * E;
    s->hist = ferry__calloc(ids, sizeof *s->hist);
    s->cell = ferry__calloc(ids, sizeof *s->cell);
    s->psnap = ferry__calloc(ids, sizeof *s->psnap);
    s->last = ferry__calloc(ids, sizeof *s->last);
    s->A = ferry__calloc(ids * E, sizeof *s->A);
    s->An = ferry__calloc(ids, sizeof *s->An);
    s->prev = ferry__calloc(ids, sizeof *s->prev);
    s->nprev = ferry__malloc((size_t)L * sizeof *s->nprev);
    s->tv = ferry__calloc(E, sizeof *s->tv);
    s->used = ferry__calloc(E, sizeof *s->used);
    if (!s->hist || !s->cell || !s->psnap || !s->last || !s->A || !s->An || !s->prev ||
        !s->nprev || !s->tv || !s->used) {
        tr_fini(p);
        return -ENOMEM;
    }
    for (uint32_t l = 0; l < L; l++)
        s->nprev[l] = -1;
    return 0;
}

static uint32_t popcount16(uint32_t x)
{
    x &= 0xffffu;
    x = x - ((x >> 1) & 0x5555u);
    x = (x & 0x3333u) + ((x >> 2) & 0x3333u);
    x = (x + (x >> 4)) & 0x0f0fu;
    return (x + (x >> 8)) & 0x1fu;
}

/* 2. the transitions from layer l's last visit to this one's routes */
static void learn_transitions(trans *s, uint32_t l, const uint32_t *ids, uint32_t n)
{
    uint32_t E = s->base.env.num_experts;
    uint16_t *A = s->A + (size_t)l * E * E, *An = s->An + (size_t)l * E;
    uint16_t *pv = s->prev + (size_t)l * E;
    for (int32_t i = 0; i < s->nprev[l]; i++) {
        uint32_t r = pv[i];
        uint16_t *row = A + (size_t)r * E;
        if (An[r] == UINT16_MAX) { /* halve the row with its total */
            for (uint32_t e = 0; e < E; e++)
                row[e] >>= 1;
            An[r] >>= 1;
        }
        An[r]++;
        for (uint32_t j = 0; j < n; j++)
            row[ids[j] % E]++;
    }
    for (uint32_t j = 0; j < n; j++)
        pv[j] = (uint16_t)(ids[j] % E);
    s->nprev[l] = (int32_t)n;
}

static int tr_begin_step(ferry__policy *p, uint32_t layer, const uint32_t *ids, uint32_t n)
{
    trans *s = (trans *)p;
    uint32_t E = p->env.num_experts;
    size_t b = (size_t)layer * E;
    s->layer = layer;
    if (!n)
        return 0;
    memset(s->used, 0, E);
    for (uint32_t j = 0; j < n; j++)
        s->used[ids[j] % E] = 1;
    for (uint32_t e = 0; e < E; e++) { /* 1. P(routed | cell) */
        uint16_t c = s->cell[b + e];
        s->nG[c] += 1;
        if (s->used[e])
            s->kG[c] += 1;
    }
    learn_transitions(s, layer, ids, n);
    const uint16_t *A = s->A + (size_t)layer * E * E, *An = s->An + (size_t)layer * E;
    double *tv = s->tv, base = 0;
    memset(tv, 0, E * sizeof *tv);
    for (uint32_t j = 0; j < n; j++) { /* 3. transition feature */
        uint32_t r = ids[j] % E;
        const uint16_t *row = A + (size_t)r * E;
        double w = 1.0 / ((double)An[r] + 1.0);
        base += w;
        for (uint32_t e = 0; e < E; e++)
            tv[e] += (double)row[e] * w;
    }
    base *= (double)n / E;
    for (uint32_t e = 0; e < E; e++) { /* 4. cell and p */
        double t = (tv[e] + base) / n;
        uint32_t q = 0;
        while (q < TR_NQ - 1 && tr_edges[q] <= t)
            q++;
        uint32_t h = (s->hist[b + e] << 1) | s->used[e];
        s->hist[b + e] = h;
        uint32_t c = ((h & 1) * (TR_W + 1) + popcount16(h)) * TR_NQ + q;
        s->cell[b + e] = (uint16_t)c;
        double prior = (h & 1) ? TR_P_HI : TR_P_LO;
        s->psnap[b + e] = (s->kG[c] + TR_M * prior) / (s->nG[c] + TR_M);
    }
    return 0;
}

static void tr_hit(ferry__policy *p, uint32_t slot, uint32_t id)
{
    (void)slot;
    ((trans *)p)->last[id] = *p->env.step;
}

static int tr_insert(ferry__policy *p, uint32_t slot, uint32_t id, int prefetch)
{
    (void)slot;
    (void)prefetch;
    ((trans *)p)->last[id] = *p->env.step;
    return 0;
}

static void tr_remove(ferry__policy *p, uint32_t slot, uint32_t id, int evicted)
{
    (void)p;
    (void)slot;
    (void)id;
    (void)evicted;
}

/* the unpinned resident of p's slots with the least p / d under m's model
 * (then older use, lower slot) */
static int tr_scan(const trans *m, const ferry__policy *p, uint32_t *slot)
{
    uint32_t L = p->env.num_layers, E = p->env.num_experts, best = UINT32_MAX;
    double bp = 0, bd = 1;
    uint64_t bl = 0;
    for (uint32_t v = 0; v < p->env.slots; v++) {
        uint32_t o = p->env.occupant[v];
        if (o == FERRY_MOE_NONE || ferry__pinned(p, v))
            continue;
        uint32_t d = (o / E + L - m->layer) % L;
        double pa = m->psnap[o], da = d ? (double)d : (double)L;
        if (best != UINT32_MAX) {
            double lhs = pa * bd, rhs = bp * da;
            if (lhs > rhs || (lhs == rhs && m->last[o] >= bl))
                continue;
        }
        best = v;
        bp = pa;
        bd = da;
        bl = m->last[o];
    }
    if (best == UINT32_MAX)
        return -1;
    *slot = best;
    return 0;
}

static int tr_victim(ferry__policy *p, uint32_t id, int have_free, uint32_t *slot)
{
    (void)id;
    if (have_free)
        return 1;
    return tr_scan((const trans *)p, p, slot);
}

const ferry__policy_ops ferry__policy_transition = {
    .name = "transition",
    .describe = "learned same-layer token-to-token transitions, evicting the least p / steps "
                "to use (opt-in)",
    .state_size = sizeof(trans),
    .init = tr_init,
    .fini = tr_fini,
    .begin_step = tr_begin_step,
    .hit = tr_hit,
    .insert = tr_insert,
    .remove = tr_remove,
    .victim = tr_victim,
};

/* ---- a follower: its own slots, the lead's model ---- */
typedef struct trans_follower {
    ferry__policy base;
    const trans *lead;
} trans_follower;

static int tf_init(ferry__policy *p)
{
    (void)p;
    return 0;
}

static void tf_fini(ferry__policy *p)
{
    (void)p;
}

static void tf_hit(ferry__policy *p, uint32_t slot, uint32_t id)
{
    (void)p;
    (void)slot;
    (void)id;
}

static int tf_insert(ferry__policy *p, uint32_t slot, uint32_t id, int prefetch)
{
    (void)p;
    (void)slot;
    (void)id;
    (void)prefetch;
    return 0;
}

static int tf_victim(ferry__policy *p, uint32_t id, int have_free, uint32_t *slot)
{
    (void)id;
    if (have_free)
        return 1;
    const trans_follower *f = (const trans_follower *)p;
    return f->lead ? tr_scan(f->lead, p, slot) : -1;
}

const ferry__policy_ops ferry__policy_transition_follower = {
    .name = "transition-follower",
    .describe = "transition's victims over another set of slots, from a lead's model",
    .state_size = sizeof(trans_follower),
    .init = tf_init,
    .fini = tf_fini,
    .hit = tf_hit,
    .insert = tf_insert,
    .remove = tr_remove,
    .victim = tf_victim,
};

int ferry__transition_follow(ferry__policy *p, ferry__policy *lead)
{
    if (!p || !lead || lead->ops != &ferry__policy_transition ||
        p->ops != &ferry__policy_transition_follower ||
        p->env.num_layers != lead->env.num_layers || p->env.num_experts != lead->env.num_experts)
        return -EINVAL;
    ((trans_follower *)p)->lead = (const trans *)lead;
    return 0;
}
