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
 * slot. All residents of a layer share d, so the victim is the best of
 * each layer's least (p, last use, slot): kept per layer, found again
 * only when the layer's residents or the model's view of them change. The smoothing uses the step's own route count n where the
 * prototype uses top_k: the same on decode traces.
 *
 * Memory: A is L x E x E uint16 counters; a row is halved with its total
 * before a count would overflow (A[r][e] <= An[r] always holds), so the
 * ratios survive. Shapes whose A would pass FERRY__TRANSITION_MAX_BYTES
 * are refused at planner create. Victim: O(L) over the layers' cached
 * least, plus a pass over a layer's residents for each layer that changed
 * since (the visited one, as a rule); a visit costs O(E n).
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
#if defined(__GNUC__)
#define TR_PREFETCH(a) __builtin_prefetch(a)
#else
#define TR_PREFETCH(a) ((void)(a))
#endif

static const double tr_edges[TR_NQ - 1] = {0.01, 0.02, 0.03, 0.05, 0.07, 0.10, 0.13, 0.16,
                                           0.20, 0.25, 0.30, 0.35, 0.40, 0.50, 0.60, 0.70};

#define NIL UINT32_MAX

/* per layer, the resident slots and the least of them (p, last, slot) */
typedef struct trmin {
    uint32_t *list;  /* [L][E]: layer l's resident slots, cnt[l] of them */
    uint32_t *cnt;   /* [L] */
    uint32_t *pos;   /* [slots]: index in its layer's list, NIL if none */
    uint32_t *least; /* [L]: the least resident slot; NIL: find again */
    uint64_t *seen;  /* [L]: the model's epoch of the layer at that */
} trmin;

typedef struct trans {
    ferry__policy base;
    trmin mn;
    uint64_t *ep;      /* [L]: bumped when p or last of the layer's ids change */
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
    uint64_t nG[TR_NC], kG[TR_NC]; /* per cell: experts seen there, routed next */
    double pc[TR_NC];              /* per cell: p, as of visit pc_at */
    uint64_t pc_at[TR_NC], visits;
} trans;

size_t ferry__transition_bytes(uint32_t num_layers, uint32_t num_experts)
{
    return (size_t)num_layers * num_experts * num_experts * sizeof(uint16_t);
}

static void trmin_fini(trmin *m)
{
    ferry__free(m->list);
    ferry__free(m->cnt);
    ferry__free(m->pos);
    ferry__free(m->least);
    ferry__free(m->seen);
    memset(m, 0, sizeof *m);
}

static int trmin_init(trmin *m, const ferry__policy_env *env)
{
    uint32_t L = env->num_layers;
    m->list = ferry__malloc((size_t)L * env->num_experts * sizeof *m->list);
    m->cnt = ferry__calloc(L, sizeof *m->cnt);
    m->pos = ferry__malloc((size_t)env->slots * sizeof *m->pos);
    m->least = ferry__malloc((size_t)L * sizeof *m->least);
    m->seen = ferry__calloc(L, sizeof *m->seen);
    if (!m->list || !m->cnt || !m->pos || !m->least || !m->seen) {
        trmin_fini(m);
        return -ENOMEM;
    }
    memset(m->pos, 0xff, (size_t)env->slots * sizeof *m->pos);
    memset(m->least, 0xff, (size_t)L * sizeof *m->least);
    return 0;
}

static void trmin_add(trmin *m, const ferry__policy_env *env, uint32_t slot, uint32_t id)
{
    uint32_t l = id / env->num_experts, E = env->num_experts;
    FERRY__ASSERT(slot < env->slots && m->pos[slot] == NIL && m->cnt[l] < E);
    if (slot >= env->slots || m->pos[slot] != NIL || m->cnt[l] >= E)
        return;
    m->pos[slot] = m->cnt[l];
    m->list[(size_t)l * E + m->cnt[l]++] = slot;
    m->least[l] = NIL;
}

static void trmin_drop(trmin *m, const ferry__policy_env *env, uint32_t slot, uint32_t id)
{
    uint32_t l = id / env->num_experts, E = env->num_experts;
    if (slot >= env->slots || m->pos[slot] == NIL)
        return;
    uint32_t *lst = m->list + (size_t)l * E, i = m->pos[slot], last = lst[--m->cnt[l]];
    FERRY__ASSERT(lst[i] == slot);
    lst[i] = last;
    m->pos[last] = i;
    m->pos[slot] = NIL;
    if (m->least[l] == slot)
        m->least[l] = NIL;
}

static void tr_fini(ferry__policy *p)
{
    trans *s = (trans *)p;
    trmin_fini(&s->mn);
    ferry__free(s->ep);
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
    s->A = ferry__malloc(ids * E * sizeof *s->A); /* zeroed below */
    s->An = ferry__calloc(ids, sizeof *s->An);
    s->prev = ferry__calloc(ids, sizeof *s->prev);
    s->nprev = ferry__malloc((size_t)L * sizeof *s->nprev);
    s->tv = ferry__calloc(E, sizeof *s->tv);
    s->used = ferry__calloc(E, sizeof *s->used);
    s->ep = ferry__calloc(L, sizeof *s->ep);
    if (trmin_init(&s->mn, &p->env) < 0 || !s->ep || !s->hist || !s->cell || !s->psnap ||
        !s->last || !s->A || !s->An || !s->prev || !s->nprev || !s->tv || !s->used) {
        tr_fini(p);
        return -ENOMEM;
    }
    /* written now, so that its pages fault in at create and not one by one
     * in the first tokens of a decode */
    memset(s->A, 0, ids * E * sizeof *s->A);
    for (uint32_t l = 0; l < L; l++)
        s->nprev[l] = -1;
    return 0;
}

/* how many edges are <= i / 100: the bin of t within one, for t near i% */
static const uint8_t tr_bin_lut[101] = {
    0,  1,  2,  3,  3,  4,  4,  5,  5,  5,  6,  6,  6,  7,  7,  7,  8,  8,  8,  8,  9,
    9,  9,  9,  9,  10, 10, 10, 10, 10, 11, 11, 11, 11, 11, 12, 12, 12, 12, 12, 13, 13,
    13, 13, 13, 13, 13, 13, 13, 13, 14, 14, 14, 14, 14, 14, 14, 14, 14, 14, 15, 15, 15,
    15, 15, 15, 15, 15, 15, 15, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16,
    16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16};

/* t's bin: how many edges are <= t */
static uint32_t tr_bin(double t)
{
    double x = t * 100.0;
    if (!(x > 0))
        return 0; /* t <= 0 (or not a number): below every edge */
    if (x >= 100.0)
        return TR_NQ - 1;
    uint32_t i = (uint32_t)x, q = tr_bin_lut[i];
    double f = x - (double)i;
    if (f > 1e-9 && f < 1.0 - 1e-9)
        return q; /* t is clear of every edge: the table is exact */
    while (q > 0 && tr_edges[q - 1] > t)
        q--;
    while (q < TR_NQ - 1 && tr_edges[q] <= t)
        q++;
    return q;
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
    s->ep[layer]++;
    if (!n)
        return 0;
    s->visits++;
    /* the step's rows of A, read below: their misses overlap with step 1 */
    const uint16_t *A = s->A + (size_t)layer * E * E, *An = s->An + (size_t)layer * E;
    for (uint32_t j = 0; j < n; j++)
        for (size_t o = 0; o < (size_t)E * sizeof *A; o += 64)
            TR_PREFETCH((const char *)(A + (size_t)(ids[j] % E) * E) + o);
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
    double *restrict tv = s->tv, base = 0;
    memset(tv, 0, E * sizeof *tv);
    for (uint32_t j = 0; j < n; j++) { /* 3. transition feature */
        uint32_t r = ids[j] % E;
        const uint16_t *restrict row = A + (size_t)r * E;
        double w = 1.0 / ((double)An[r] + 1.0);
        base += w;
        uint32_t e = 0;
        for (; e + 4 <= E; e += 4) { /* four at a time: the compiler pairs them */
            tv[e] += (double)row[e] * w;
            tv[e + 1] += (double)row[e + 1] * w;
            tv[e + 2] += (double)row[e + 2] * w;
            tv[e + 3] += (double)row[e + 3] * w;
        }
        for (; e < E; e++)
            tv[e] += (double)row[e] * w;
    }
    base *= (double)n / E;
    for (uint32_t e = 0; e < E; e++) { /* 4. cell and p */
        uint32_t q = tr_bin((tv[e] + base) / n);
        uint32_t h = (s->hist[b + e] << 1) | s->used[e];
        s->hist[b + e] = h;
        uint32_t c = ((h & 1) * (TR_W + 1) + popcount16(h)) * TR_NQ + q;
        s->cell[b + e] = (uint16_t)c;
        if (s->pc_at[c] != s->visits) { /* the cell's p, once a visit */
            double prior = (h & 1) ? TR_P_HI : TR_P_LO;
            s->pc[c] = ((double)s->kG[c] + TR_M * prior) / ((double)s->nG[c] + TR_M);
            s->pc_at[c] = s->visits;
        }
        s->psnap[b + e] = s->pc[c];
    }
    return 0;
}

static void tr_used(trans *s, uint32_t id)
{
    if (s->last[id] != *s->base.env.step) {
        s->last[id] = *s->base.env.step;
        s->ep[id / s->base.env.num_experts]++;
    }
}

static void tr_hit(ferry__policy *p, uint32_t slot, uint32_t id)
{
    (void)slot;
    tr_used((trans *)p, id);
}

static int tr_insert(ferry__policy *p, uint32_t slot, uint32_t id, int prefetch)
{
    (void)prefetch;
    trans *s = (trans *)p;
    tr_used(s, id);
    trmin_add(&s->mn, &p->env, slot, id);
    return 0;
}

static void tr_remove(ferry__policy *p, uint32_t slot, uint32_t id, int evicted)
{
    (void)evicted;
    trmin_drop(&((trans *)p)->mn, &p->env, slot, id);
}

/* x before y within a layer: less p, then older use, then lower slot */
static int tr_before(const trans *m, const ferry__policy *p, uint32_t x, uint32_t y)
{
    uint32_t ox = p->env.occupant[x], oy = p->env.occupant[y];
    if (m->psnap[ox] != m->psnap[oy])
        return m->psnap[ox] < m->psnap[oy];
    if (m->last[ox] != m->last[oy])
        return m->last[ox] < m->last[oy];
    return x < y;
}

/* layer l's least resident of p's slots (pinned ones skipped when
 * unpinned_only), NIL when none */
static uint32_t tr_layer_least(const trans *m, const ferry__policy *p, const trmin *mn, uint32_t l,
                               int unpinned_only)
{
    const uint32_t *lst = mn->list + (size_t)l * p->env.num_experts;
    uint32_t best = NIL;
    for (uint32_t i = 0; i < mn->cnt[l]; i++) {
        uint32_t v = lst[i];
        if (unpinned_only && ferry__pinned(p, v))
            continue;
        if (best == NIL || tr_before(m, p, v, best))
            best = v;
    }
    return best;
}

/* the unpinned resident of p's slots (listed in mn) with the least p / d
 * under m's model, then older use, then lower slot */
static int tr_scan(const trans *m, const ferry__policy *p, trmin *mn, uint32_t *slot)
{
    uint32_t L = p->env.num_layers, best = NIL;
    double bp = 0, bd = 1;
    uint64_t bl = 0;
    for (uint32_t l = 0; l < L; l++) {
        if (!mn->cnt[l])
            continue;
        if (mn->least[l] == NIL || mn->seen[l] != m->ep[l]) {
            mn->least[l] = tr_layer_least(m, p, mn, l, 0);
            mn->seen[l] = m->ep[l];
        }
        uint32_t v = mn->least[l];
        if (ferry__pinned(p, v) && (v = tr_layer_least(m, p, mn, l, 1)) == NIL)
            continue;
        uint32_t o = p->env.occupant[v], d = (l + L - m->layer) % L;
        FERRY__ASSERT(o != FERRY_MOE_NONE && o / p->env.num_experts == l);
        double pa = m->psnap[o], da = d ? (double)d : (double)L;
        if (best != NIL) {
            double lhs = pa * bd, rhs = bp * da;
            if (lhs > rhs || (lhs == rhs && (m->last[o] > bl || (m->last[o] == bl && v > best))))
                continue;
        }
        best = v;
        bp = pa;
        bd = da;
        bl = m->last[o];
    }
    if (best == NIL)
        return -1;
    *slot = best;
    return 0;
}

static int tr_victim(ferry__policy *p, uint32_t id, int have_free, uint32_t *slot)
{
    (void)id;
    if (have_free)
        return 1;
    trans *s = (trans *)p;
    return tr_scan(s, p, &s->mn, slot);
}

const ferry__policy_ops ferry__policy_transition = {
    .name = "transition",
    .describe = "learned same-layer token-to-token transitions, evicting the least p / steps "
                "to use (alone: opt-in; one of auto's three)",
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
    trmin mn;
    const trans *lead;
} trans_follower;

static int tf_init(ferry__policy *p)
{
    return trmin_init(&((trans_follower *)p)->mn, &p->env);
}

static void tf_fini(ferry__policy *p)
{
    trmin_fini(&((trans_follower *)p)->mn);
}

static void tf_hit(ferry__policy *p, uint32_t slot, uint32_t id)
{
    (void)p;
    (void)slot;
    (void)id;
}

static int tf_insert(ferry__policy *p, uint32_t slot, uint32_t id, int prefetch)
{
    (void)prefetch;
    trmin_add(&((trans_follower *)p)->mn, &p->env, slot, id);
    return 0;
}

static void tf_remove(ferry__policy *p, uint32_t slot, uint32_t id, int evicted)
{
    (void)evicted;
    trmin_drop(&((trans_follower *)p)->mn, &p->env, slot, id);
}

static int tf_victim(ferry__policy *p, uint32_t id, int have_free, uint32_t *slot)
{
    (void)id;
    if (have_free)
        return 1;
    trans_follower *f = (trans_follower *)p;
    return f->lead ? tr_scan(f->lead, p, &f->mn, slot) : -1;
}

const ferry__policy_ops ferry__policy_transition_follower = {
    .name = "transition-follower",
    .describe = "transition's victims over another set of slots, from a lead's model",
    .state_size = sizeof(trans_follower),
    .init = tf_init,
    .fini = tf_fini,
    .hit = tf_hit,
    .insert = tf_insert,
    .remove = tf_remove,
    .victim = tf_victim,
};

int ferry__transition_follow(ferry__policy *p, ferry__policy *lead)
{
    if (!p || !lead || lead->ops != &ferry__policy_transition ||
        p->ops != &ferry__policy_transition_follower ||
        p->env.num_layers != lead->env.num_layers || p->env.num_experts != lead->env.num_experts)
        return -EINVAL;
    trans_follower *f = (trans_follower *)p;
    if (!f->mn.list && trmin_init(&f->mn, &p->env) < 0)
        return -ENOMEM;
    f->lead = (const trans *)lead;
    return 0;
}
