/*
 * policy_successor.c - "successor": transition's successor rows feeding
 * a victim order that costs a few vector passes over a layer's experts a
 * visit, no lists (issue 27, ninth pass).
 *
 * Model. As in "transition" (policy_transition.c), each expert r of layer
 * l keeps a row of TR_K successors counted by space-saving (ss_rows.h):
 * at each visit of l the rows of the last visit's routed set count this
 * one (every second visit: on the real traces of the README the same
 * hit rates as every visit, for half the learning). An expert's class at a visit of its layer is (routed at this
 * visit, routes in the last SC_W + 1 visits bucketed 0 / 1 / 2-3 / 4-7 /
 * 8+, predicted level): the level bins its mean share over this visit's
 * routed set R, sum over r in R of count_r(e) / (total_r + 1) / |R|,
 * quantized to eighths in a byte (scaled down past 31 routed), at the
 * edges 0.02 0.05 0.10 0.20 0.35 - the same quantity transition bins
 * (without its smoothing term), in 6 levels rather than 17. A class's p
 * = (k + 100 pg) / (n + 100), n the layer's experts in the class at each
 * visit, k those of them routed at the next, backed off to the class's
 * p over all layers, pg = (K + 20 prior) / (N + 20), prior 0.45 routed
 * and 0.08 not; counts halved every 512 visits, p read afresh at visits
 * 1, 2, 4 .. 32 and then every 64 (SC_REFRESH).
 *
 * Cost. Everything per expert sits in per-layer byte arrays (routed last,
 * window count, class, resident), so a visit computes all E classes with
 * SSE2 (16 experts an instruction) from the quantized shares, and only
 * the experts whose class changed are counted again (no list to move):
 * O(E / 16 + top_k x TR_K + changed) a visit, nothing per slot.
 *
 * Victim: the unpinned resident with the least p / d, d the steps until
 * its layer runs again, as transition's; ties to the layer run longer
 * ago, then the class of least p (ties by class), then the one touched
 * (routed, moved to another class, placed) longer ago. A layer's least
 * is found by one vector pass over its experts for its least non-empty
 * class (a mask of them by p), cached until the layer is visited or
 * gains or loses a resident, or a pin touches it (its cached one
 * pinned now, or a pinned one it passed over freed by a new round);
 * layers are offered from the furthest next use down, skipped when
 * not even their least class can win, and the search stops once no nearer layer can (pmin, as
 * transition). ferry__successor_verify() has every victim checked
 * against a scan of all the slots by the same rule (tests).
 *
 * Views. The residents a victim chooses among are a view: the policy's
 * own slots, and a follower's (ferry__successor_follow: auto's shadow
 * cache, another set of slots evicted by this model's classes), each with
 * its bit in res, its per-class counts and mask, touch clock and cached
 * layer least; a class change refiles the expert in every view holding
 * it. Sleep (ferry__successor_sleep): the layers off a stride learn their
 * rows and window only; a wake classes them as after their last visit.
 *
 * Memory: about 110 bytes an id (ferry__successor_bytes); shapes past
 * FERRY__TRANSITION_MAX_BYTES are refused at planner create.
 */
#include <errno.h>
#include <string.h>

#include "moe/moe_internal.h"
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define TR_K 16
#define TR_CNT 0x7fffu
#define TR_ROW (2 * TR_K)
#include "moe/ss_rows.h"

#define SC_W 16u           /* history window - 1 (visits of the id's layer) */
#define SC_NH 5u           /* history buckets: 0, 1, 2-3, 4-7, 8-17 */
#define SC_NP 6u           /* predicted levels */
#define SC_NC (2u * SC_NH * SC_NP)
#define SC_M 20.0           /* the all-layer p's strength toward the prior */
#define SC_MG 100.0        /* a layer's p's strength toward the all-layer p */
#define SC_LEARN 2u        /* the rows learn every SC_LEARN-th visit of their layer */
#define SC_REFRESH 64u
#define NIL UINT32_MAX
#define NOPIN UINT64_MAX
_Static_assert(SC_NC <= 64, "a layer's classes in one mask");

/* one set of slots' residents as the model classes them: the policy's
 * own, or a follower's (auto's shadow) */
typedef struct scview {
    ferry__policy *pol; /* whose env: where, occupant, pins */
    uint8_t bit;        /* its bit in res */
    uint32_t *rsz;      /* [L][SC_NC] residents in each class */
    uint64_t *rmask;    /* [L] classes with a resident, by rank */
    uint64_t *tch;      /* per id: when last touched (routed, refiled, inserted) */
    uint32_t *lslot;    /* [L] cached least resident; NIL: none; NIL - 1: find again */
    double *lp;         /* [L] its p */
    uint64_t *lpin;     /* [L] the pin round it passed over a pinned one in; NOPIN: none */
    uint64_t clk;       /* (64 bits: a decode loop touches 2^32 times within days) */
    uint32_t cur;       /* the layer of its step */
    int skipped;        /* (a find passed over a pinned resident) */
} scview;

typedef struct succ {
    ferry__policy base;
    uint32_t L, E, Ep;
    int wide;
    uint16_t *lanes;   /* [id][TR_ROW] */
    uint16_t *an;      /* [id] a row's total */
    uint64_t *V;       /* [L] visits (64 bits: the window's ring is V % 17, no wrap) */
    uint16_t *ring;    /* [L][SC_W + 1][E] routed sets (layer-local) */
    uint16_t *ring_n;  /* [L][SC_W + 1] */
    uint8_t *rl;       /* [L][Ep] routed at the last visit */
    uint8_t *h;        /* [L][Ep] routes in the window */
    uint8_t *hc;       /* [L][Ep] the class part of h */
    uint8_t *cls;      /* [L][Ep] class at the last visit */
    uint8_t *res;      /* [L][Ep] resident: a bit per view */
    uint8_t *q8;       /* [Ep] scratch: a visit's quantized shares */
    uint32_t *size;    /* [L][SC_NC] experts in each class */
    uint32_t *kc, *nc; /* [L][SC_NC] */
    /* all layers', halved at the visits of glead, the lowest layer
     * counted so far and awake (0 in a decode that routes layer 0; where the engine
     * numbers a model's dense first layers in, its first MoE layer: halved
     * at layer 0's alone they grew by E a visit for ever, a whole run's
     * average rather than a recent one, and past 2^32 within an hour at 32
     * bits) */
    uint64_t kg[SC_NC], ng[SC_NC];
    uint32_t glead;
    double *pc;        /* [L][SC_NC] */
    uint8_t *ord;      /* [L][SC_NC] classes by p, least first */
    uint8_t *rank;     /* [L][SC_NC] */
    double *lmin;      /* [L] least p of a layer */
    double pmin;
    scview own;        /* its slots */
    scview *fv;        /* a follower's (ferry__successor_follow), or NULL */
    uint16_t *le, *miss;
    trev *evv;
    uint32_t cur;      /* the current step's layer */
    uint32_t stride;   /* > 1: the layers not a multiple of it sleep (ferry__successor_sleep) */
    uint64_t ops;      /* work: experts refiled, lanes read, layers and blocks visited (tests) */
} succ;

static const double sc_prior[2] = {0.08, 0.45};
static const float sc_edge[SC_NP - 1] = {0.02f, 0.05f, 0.10f, 0.20f, 0.35f};
static const uint8_t sc_hb[SC_W + 2] = {0, 1, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4};

static void view_fini(scview *v)
{
    void *arr[] = {v->rsz, v->rmask, v->tch, v->lslot, v->lp, v->lpin};
    for (size_t i = 0; i < sizeof arr / sizeof arr[0]; i++)
        ferry__free(arr[i]);
    memset(v, 0, sizeof *v);
}

static int view_init(scview *v, ferry__policy *pol, uint8_t bit, uint32_t L, uint32_t E)
{
    v->pol = pol;
    v->bit = bit;
    v->rsz = ferry__calloc((size_t)L * SC_NC, sizeof *v->rsz);
    v->rmask = ferry__calloc(L, sizeof *v->rmask);
    v->tch = ferry__calloc((size_t)L * E, sizeof *v->tch);
    v->lslot = ferry__malloc((size_t)L * sizeof *v->lslot);
    v->lp = ferry__calloc(L, sizeof *v->lp);
    v->lpin = ferry__calloc(L, sizeof *v->lpin);
    if (!v->rsz || !v->rmask || !v->tch || !v->lslot || !v->lp || !v->lpin) {
        view_fini(v);
        return -ENOMEM;
    }
    for (uint32_t l = 0; l < L; l++)
        v->lslot[l] = NIL - 1;
    return 0;
}

static void sc_fini(ferry__policy *p)
{
    succ *s = (succ *)p;
    void *arr[] = {s->an, s->V, s->ring, s->ring_n, s->rl, s->h, s->hc, s->cls, s->res,
                   s->q8, s->size, s->kc, s->nc, s->pc, s->ord, s->rank,
                   s->lmin, s->le, s->miss, s->lanes, s->evv};
    for (size_t i = 0; i < sizeof arr / sizeof arr[0]; i++)
        ferry__free(arr[i]);
    view_fini(&s->own);
}

static void sc_refresh(succ *s, uint32_t l)
{
    size_t lc = (size_t)l * SC_NC;
    double *pc = s->pc + lc;
    const uint32_t *kc = s->kc + lc, *nc = s->nc + lc;
    uint8_t *o = s->ord + lc, *rk = s->rank + lc;
    for (uint32_t c = 0; c < SC_NC; c++) {
        double pg = ((double)s->kg[c] + SC_M * sc_prior[c & 1]) / ((double)s->ng[c] + SC_M);
        pc[c] = ((double)kc[c] + SC_MG * pg) / ((double)nc[c] + SC_MG);
    }
    for (uint32_t c = 0; c < SC_NC; c++) { /* insertion sort, ties by class */
        uint32_t j = c;
        while (j > 0 && pc[o[j - 1]] > pc[c]) {
            o[j] = o[j - 1];
            j--;
        }
        o[j] = (uint8_t)c;
    }
    for (uint32_t i = 0; i < SC_NC; i++)
        rk[o[i]] = (uint8_t)i;
    for (scview *v = &s->own; v; v = v == &s->own ? s->fv : NULL) {
        const uint32_t *rsz = v->rsz + lc;
        uint64_t m = 0;
        for (uint32_t i = 0; i < SC_NC; i++)
            m |= (uint64_t)(rsz[o[i]] != 0) << i;
        v->rmask[l] = m;
    }
    s->lmin[l] = pc[o[0]];
    double mn = s->lmin[0];
    for (uint32_t i = 1; i < s->L; i++)
        mn = s->lmin[i] < mn ? s->lmin[i] : mn;
    s->pmin = mn;
}

static int sc_init(ferry__policy *p)
{
    succ *s = (succ *)p;
    uint32_t L = p->env.num_layers, E = p->env.num_experts;
    size_t ids = (size_t)L * E;
    if (E > 0xfffe || ferry__successor_bytes(L, E) > FERRY__TRANSITION_MAX_BYTES)
        return -EINVAL;
    s->L = L;
    s->E = E;
    s->glead = UINT32_MAX; /* no layer counted yet */
    s->Ep = (E + 16) & ~15u; /* a pad byte at least: q8[E] takes unused lanes */
    size_t lp = (size_t)L * s->Ep;
#if defined(TR_ROWS_AVX2)
    s->wide = __builtin_cpu_supports("avx2");
#endif
    s->lanes = ferry__aligned_alloc(64, ids * TR_ROW * sizeof *s->lanes);
    s->an = ferry__calloc(ids, sizeof *s->an);
    s->V = ferry__calloc(L, sizeof *s->V);
    s->ring = ferry__calloc((size_t)L * (SC_W + 1) * E, sizeof *s->ring);
    s->ring_n = ferry__calloc((size_t)L * (SC_W + 1), sizeof *s->ring_n);
    s->rl = ferry__calloc(lp, 1);
    s->h = ferry__calloc(lp, 1);
    s->hc = ferry__calloc(lp, 1);
    s->cls = ferry__calloc(lp, 1);
    s->res = ferry__calloc(lp, 1);
    s->q8 = ferry__aligned_alloc(64, s->Ep);
    s->size = ferry__calloc((size_t)L * SC_NC, sizeof *s->size);
    s->kc = ferry__calloc((size_t)L * SC_NC, sizeof *s->kc);
    s->nc = ferry__calloc((size_t)L * SC_NC, sizeof *s->nc);
    s->pc = ferry__calloc((size_t)L * SC_NC, sizeof *s->pc);
    s->ord = ferry__calloc((size_t)L * SC_NC, sizeof *s->ord);
    s->rank = ferry__calloc((size_t)L * SC_NC, sizeof *s->rank);
    s->lmin = ferry__calloc(L, sizeof *s->lmin);
    s->le = ferry__malloc(((size_t)E + 1) * sizeof *s->le);
    s->miss = ferry__calloc((size_t)E + 8, sizeof *s->miss); /* (row_learn: E + 8) */
    s->evv = ferry__aligned_alloc(64, (size_t)E * sizeof(trev));
    if (!s->lanes || !s->an || !s->V || !s->ring || !s->ring_n || !s->rl || !s->h || !s->hc ||
        !s->cls || !s->res || !s->q8 || !s->size || !s->kc || !s->nc || !s->pc || !s->ord ||
        !s->rank || !s->lmin || !s->le || !s->miss || !s->evv ||
        view_init(&s->own, p, 1, L, E) < 0) {
        sc_fini(p);
        return -ENOMEM;
    }
    for (size_t i = 0; i < ids; i++) {
        memset(s->lanes + i * TR_ROW, 0xff, TR_K * sizeof *s->lanes);
        memset(s->lanes + i * TR_ROW + TR_K, 0, TR_K * sizeof *s->lanes);
    }
    memset(s->q8, 0, s->Ep);
    for (uint32_t l = 0; l < L; l++) {
        s->size[(size_t)l * SC_NC] = E;
        sc_refresh(s, l);
    }
    return 0;
}

/* ---- residents: counted per class, a mask of the classes that have one ---- */
static inline void rs_add(const succ *s, scview *v, uint32_t l, uint32_t c)
{
    size_t k = (size_t)l * SC_NC + c;
    if (v->rsz[k]++ == 0)
        v->rmask[l] |= (uint64_t)1 << s->rank[k];
}

static inline void rs_sub(const succ *s, scview *v, uint32_t l, uint32_t c)
{
    size_t k = (size_t)l * SC_NC + c;
    if (--v->rsz[k] == 0)
        v->rmask[l] &= ~((uint64_t)1 << s->rank[k]);
}

/* each expert's class from its quantized shares (q8, zeroed after),
 * routed-last and window bytes; the changed ones counted, residents
 * refiled */
static void sc_refile(succ *s, uint32_t layer, uint32_t e, uint32_t c)
{
    size_t lo = (size_t)layer * s->Ep;
    uint32_t *size = s->size + layer * SC_NC;
    uint8_t *cls = s->cls + lo;
    uint32_t o = cls[e];
    size[o]--;
    size[c]++;
    cls[e] = (uint8_t)c;
    s->ops++;
    uint8_t r = s->res[lo + e];
    for (scview *v = &s->own; r && v; v = v == &s->own ? s->fv : NULL)
        if (r & v->bit) {
            rs_sub(s, v, layer, o);
            rs_add(s, v, layer, c);
            v->tch[layer * s->E + e] = ++v->clk;
        }
}

#if defined(__SSE2__)
static void sc_classes(succ *s, uint32_t layer, const uint8_t *th)
{
    size_t lo = (size_t)layer * s->Ep;
    const uint8_t *rl = s->rl + lo, *hc = s->hc + lo, *cls = s->cls + lo;
    uint8_t *q8 = s->q8;
    __m128i t[SC_NP - 1], z = _mm_setzero_si128();
    for (uint32_t i = 0; i < SC_NP - 1; i++)
        t[i] = _mm_set1_epi8((char)th[i]);
    for (uint32_t b = 0; b < s->Ep; b += 16) {
        __m128i q = _mm_load_si128((const __m128i *)(const void *)(q8 + b)), lv = z;
        for (uint32_t i = 0; i < SC_NP - 1; i++) /* q >= t: max(q, t) == q */
            lv = _mm_sub_epi8(lv, _mm_cmpeq_epi8(_mm_max_epu8(q, t[i]), q));
        __m128i c = _mm_add_epi8(_mm_add_epi8(lv, lv),
                                 _mm_or_si128(_mm_loadu_si128((const __m128i *)(const void *)(rl + b)),
                                              _mm_loadu_si128((const __m128i *)(const void *)(hc + b))));
        _mm_store_si128((__m128i *)(void *)(q8 + b), z);
        uint32_t ch = 0xffffu & ~(uint32_t)_mm_movemask_epi8(
                          _mm_cmpeq_epi8(c, _mm_loadu_si128((const __m128i *)(const void *)(cls + b))));
        if (!ch)
            continue;
        uint8_t cb[16];
        _mm_storeu_si128((__m128i *)(void *)cb, c);
        for (; ch; ch &= ch - 1) {
            uint32_t i = (uint32_t)__builtin_ctz(ch);
            if (b + i < s->E)
                sc_refile(s, layer, b + i, cb[i]);
        }
    }
}
#else
static void sc_classes(succ *s, uint32_t layer, const uint8_t *th)
{
    size_t lo = (size_t)layer * s->Ep;
    const uint8_t *rl = s->rl + lo, *hc = s->hc + lo, *cls = s->cls + lo;
    uint8_t *q8 = s->q8;
    for (uint32_t e = 0; e < s->E; e++) {
        uint32_t lv = 0;
        for (uint32_t i = 0; i < SC_NP - 1; i++)
            lv += q8[e] >= th[i];
        q8[e] = 0;
        uint32_t c = (lv << 1) + (rl[e] | hc[e]);
        if (c != cls[e])
            sc_refile(s, layer, e, c);
    }
}
#endif

/* the classes' p: how many of each class (as of the last visit) were
 * routed at this one (le: the layer's experts), the layer's p read
 * afresh at its refresh visits */
static void sc_count(succ *s, uint32_t layer, const uint16_t *le, uint32_t n, uint64_t v)
{
    uint32_t lc = layer * SC_NC;
    const uint8_t *cls = s->cls + (size_t)layer * s->Ep;
    uint32_t *kc = s->kc + lc, *nc = s->nc + lc, *size = s->size + lc;
    s->glead = layer < s->glead ? layer : s->glead;
#if defined(__SSE2__)
    _Static_assert(SC_NC % 4 == 0, "a layer's class counts in whole registers");
    for (uint32_t c = 0; c < SC_NC; c += 4) {
        __m128i z = _mm_loadu_si128((const __m128i *)(const void *)(size + c));
        __m128i *a = (__m128i *)(void *)(nc + c);
        _mm_storeu_si128(a, _mm_add_epi32(_mm_loadu_si128(a), z));
    }
#else
    for (uint32_t c = 0; c < SC_NC; c++)
        nc[c] += size[c];
#endif
    for (uint32_t c = 0; c < SC_NC; c++)
        s->ng[c] += size[c];
    for (uint32_t j = 0; j < n; j++) {
        kc[cls[le[j]]]++;
        s->kg[cls[le[j]]]++;
    }
    if (v % SC_REFRESH == 0 || (v < SC_REFRESH && !(v & (v - 1)))) {
        if (v % (SC_REFRESH * 8) == 0)
            for (uint32_t c = 0; c < SC_NC; c++) {
                kc[c] >>= 1;
                nc[c] >>= 1;
                if (layer == s->glead) {
                    s->kg[c] >>= 1;
                    s->ng[c] >>= 1;
                }
            }
        sc_refresh(s, layer);
    }
}

/* each expert's class after a visit that routed le[0..n): its successor
 * shares over the set's rows, quantized to eighths (scaled down past 31
 * routed, so that a byte holds their sum), binned; refiled where changed */
static void sc_predict(succ *s, uint32_t layer, const uint16_t *le, uint32_t n)
{
    uint32_t E = s->E, base = layer * E;
    uint8_t *q8 = s->q8;
    uint32_t qs = n <= 31 ? 8 : 255 / n;
    for (uint32_t j = 0; j < n; j++) {
        uint32_t r = base + le[j];
        const uint16_t *top = s->lanes + (size_t)r * TR_ROW, *tc = top + TR_K;
        uint32_t m = (qs << 16) / (s->an[r] + 1u);
        for (uint32_t i = 0; i < TR_K; i++) { /* an unused lane into the pad byte */
            uint32_t e = top[i] < E ? top[i] : E;
            q8[e] = (uint8_t)(q8[e] + ((tc[i] * m) >> 16));
        }
    }
    uint8_t th[SC_NP - 1];
    for (uint32_t i = 0; i < SC_NP - 1; i++) {
        float t = sc_edge[i] * (float)(n * qs);
        th[i] = n == 0 || t > 255.0f ? 255 : (uint8_t)(t + 0.999f);
        th[i] = th[i] ? th[i] : 1;
    }
    sc_classes(s, layer, th);
    s->ops += s->Ep / 16 + n;
}

/* a visit: the rows of the last visit's routed set learn this one, the
 * window moves on; awake, the classes' p count it and every expert is
 * classed again; a layer asleep (ferry__successor_sleep) only learns its
 * rows and moves its window */
static int sc_begin(ferry__policy *p, uint32_t layer, const uint32_t *ids, uint32_t n)
{
    succ *s = (succ *)p;
    uint32_t E = s->E, Ep = s->Ep, base = layer * E;
    const uint32_t *where = p->env.where;
    s->own.lslot[s->cur] = NIL - 1; /* its pins end */
    s->own.lslot[layer] = NIL - 1;
    s->cur = s->own.cur = layer;
    uint64_t v = ++s->V[layer];
    int awake = !(s->stride > 1 && layer % s->stride);
    size_t lo = (size_t)layer * Ep;
    uint8_t *rl = s->rl + lo, *h = s->h + lo, *hc = s->hc + lo;
    uint16_t *ring = s->ring + (size_t)layer * (SC_W + 1) * E;
    uint16_t *rn = s->ring_n + (size_t)layer * (SC_W + 1);
    uint32_t prev = (uint32_t)((v - 1) % (SC_W + 1)), cur = (uint32_t)(v % (SC_W + 1));
    const uint16_t *pr = ring + (size_t)prev * E;
    uint32_t npr = v > 1 ? rn[prev] : 0, nlearn = v % SC_LEARN ? 0 : npr;
    uint16_t *le = s->le;
    for (uint32_t j = 0; j < n; j++) { /* (this set's rows are read below) */
        le[j] = (uint16_t)(ids[j] - base);
        __builtin_prefetch(s->lanes + (size_t)ids[j] * TR_ROW);
    }
    if (awake)
        sc_count(s, layer, le, n, v);
    /* the rows of the last visit's routed set learn this one */
    rowv_events(le, n, s->evv);
    for (uint32_t j = 0; j < nlearn; j++) {
        uint32_t r = base + pr[j];
        (void)row_learn(s->lanes + (size_t)r * TR_ROW, &s->an[r], s->evv, le, n, s->miss,
                        s->wide);
    }
    /* the window: the set SC_W + 1 visits ago leaves it (its ring entry reused) */
    uint16_t *out = ring + (size_t)cur * E;
    uint32_t nout = v > SC_W + 1 ? rn[cur] : 0;
    for (uint32_t j = 0; j < nout; j++) {
        uint32_t e = out[j];
        h[e]--;
        hc[e] = (uint8_t)(sc_hb[h[e]] * 2 * SC_NP);
    }
    for (uint32_t j = 0; j < npr; j++)
        rl[pr[j]] = 0;
    for (uint32_t j = 0; j < n; j++) {
        uint32_t e = le[j];
        h[e]++;
        hc[e] = (uint8_t)(sc_hb[h[e]] * 2 * SC_NP);
        rl[e] = 1;
        out[j] = (uint16_t)e;
    }
    rn[cur] = (uint16_t)n;
    if (awake)
        sc_predict(s, layer, le, n);
    for (uint32_t j = 0; j < n; j++) /* the routed residents: touched */
        if (where[ids[j]] != FERRY_MOE_NONE)
            s->own.tch[ids[j]] = ++s->own.clk;
    return 0;
}

int ferry__successor_sleep(ferry__policy *p, uint32_t stride)
{
    if (!p || p->ops != &ferry__policy_successor)
        return -EINVAL;
    succ *s = (succ *)p;
    uint32_t was = s->stride, woke = 0;
    s->stride = stride > 1 ? stride : 0;
    /* glead asleep counts no more visits: the all-layer counts halve at
     * the lowest layer counted from now on (layer 0, a multiple of every
     * stride, never sleeps) */
    if (s->glead != UINT32_MAX && s->stride > 1 && s->glead % s->stride)
        s->glead = UINT32_MAX;
    for (uint32_t l = 0; l < s->L; l++) { /* the layers awake again: classed as after their last visit */
        if (!(was > 1 && l % was) || (s->stride > 1 && l % s->stride))
            continue;
        uint64_t v = s->V[l];
        uint32_t cur = (uint32_t)(v % (SC_W + 1));
        if (v) {
            const uint16_t *set = s->ring + ((size_t)l * (SC_W + 1) + cur) * s->E;
            sc_predict(s, l, set, s->ring_n[(size_t)l * (SC_W + 1) + cur]);
        }
        woke++;
    }
    if (woke)
        for (uint32_t l = 0; l < s->L; l++) {
            sc_refresh(s, l);
            s->own.lslot[l] = NIL - 1;
            if (s->fv)
                s->fv->lslot[l] = NIL - 1;
        }
    return 0;
}

static void sc_hit(ferry__policy *p, uint32_t slot, uint32_t id)
{
    (void)p;
    (void)slot;
    (void)id;
}

/* a view's resident in and out */
static void view_insert(succ *s, scview *v, uint32_t id)
{
    uint32_t l = id / s->E;
    size_t at = (size_t)l * s->Ep + (id - l * s->E);
    v->lslot[l] = NIL - 1;
    if (!(s->res[at] & v->bit)) {
        s->res[at] |= v->bit;
        rs_add(s, v, l, s->cls[at]);
    }
    v->tch[id] = ++v->clk;
}

static void view_remove(succ *s, scview *v, uint32_t id)
{
    uint32_t l = id / s->E;
    size_t at = (size_t)l * s->Ep + (id - l * s->E);
    v->lslot[l] = NIL - 1;
    if (s->res[at] & v->bit) {
        s->res[at] &= (uint8_t)~v->bit;
        rs_sub(s, v, l, s->cls[at]);
    }
}

static int sc_insert(ferry__policy *p, uint32_t slot, uint32_t id, int prefetch)
{
    (void)prefetch;
    (void)slot;
    view_insert((succ *)p, &((succ *)p)->own, id);
    return 0;
}

static void sc_remove(ferry__policy *p, uint32_t slot, uint32_t id, int evicted)
{
    (void)evicted;
    (void)slot;
    view_remove((succ *)p, &((succ *)p)->own, id);
}

/* of layer l's residents of view v in class c, the unpinned one touched
 * longest ago */
static uint32_t sc_class_least(succ *s, scview *v, uint32_t l, uint32_t c)
{
    size_t lo = (size_t)l * s->Ep;
    const uint8_t *cls = s->cls + lo, *res = s->res + lo;
    const uint32_t *where = v->pol->env.where;
    const uint64_t *tch = v->tch + (size_t)l * s->E;
    uint32_t best = NIL, base = l * s->E;
    uint64_t bt = 0;
    s->ops += (s->E + 15) / 16;
#if defined(__SSE2__)
    __m128i cv = _mm_set1_epi8((char)c), bv = _mm_set1_epi8((char)v->bit);
    for (uint32_t b = 0; b < s->E; b += 16) {
        __m128i r = _mm_and_si128(_mm_loadu_si128((const __m128i *)(const void *)(res + b)), bv);
        __m128i m = _mm_and_si128(
            _mm_cmpeq_epi8(_mm_loadu_si128((const __m128i *)(const void *)(cls + b)), cv),
            _mm_cmpeq_epi8(r, bv));
        for (uint32_t k = (uint32_t)_mm_movemask_epi8(m); k; k &= k - 1) {
            uint32_t e = b + (uint32_t)__builtin_ctz(k);
#else
    for (uint32_t b = 0; b < 1; b++) {
        for (uint32_t e = 0; e < s->E; e++) {
            if (!(res[e] & v->bit) || cls[e] != c)
                continue;
#endif
            if (e >= s->E || (best != NIL && tch[e] >= bt))
                continue;
            uint32_t slot = where[base + e];
            if (ferry__pinned(v->pol, slot)) {
                v->skipped = 1;
                continue;
            }
            best = slot;
            bt = tch[e];
        }
    }
    return best;
}

/* a layer's least unpinned resident and its p; NIL when none */
static uint32_t sc_layer_find(succ *s, scview *v, uint32_t l, double *pout)
{
    const uint8_t *o = s->ord + (size_t)l * SC_NC;
    for (uint64_t m = v->rmask[l]; m; m &= m - 1) {
        uint32_t c = o[__builtin_ctzll(m)];
        uint32_t slot = sc_class_least(s, v, l, c);
        if (slot != NIL) {
            *pout = s->pc[(size_t)l * SC_NC + c];
            return slot;
        }
    }
    return NIL;
}

/* cached until the layer changes; pins change it too without a call
 * here (a prefetch or a kept hinted victim pins another layer's
 * residents, a new round ends the pins): found again when the cached one
 * is pinned now, or the find passed over a pinned one whose round ended */
static uint32_t sc_layer_least(succ *s, scview *v, uint32_t l, double *pout)
{
    uint32_t c = v->lslot[l];
    uint64_t now = *v->pol->env.pin_now;
    if (c == NIL - 1 || (c != NIL && ferry__pinned(v->pol, c)) ||
        (v->lpin[l] != NOPIN && v->lpin[l] != now)) {
        v->lp[l] = 0;
        v->skipped = 0;
        v->lslot[l] = sc_layer_find(s, v, l, &v->lp[l]);
        v->lpin[l] = v->skipped ? now : NOPIN;
    }
    *pout = v->lp[l];
    return v->lslot[l];
}

static int sc_verify_on;
static uint64_t sc_checked, sc_mismatched;

void ferry__successor_verify(int on)
{
    sc_verify_on = on;
    sc_checked = sc_mismatched = 0;
}

void ferry__successor_verified(uint64_t *checked, uint64_t *mismatched)
{
    *checked = sc_checked;
    *mismatched = sc_mismatched;
}

/* the victim by a scan of every slot of the view under the same rule:
 * least p / d, then the larger d, the class of lesser rank, the older
 * touch */
static void sc_verify(succ *s, scview *vw, uint32_t got)
{
    const ferry__policy_env *env = &vw->pol->env;
    uint32_t best = NIL, bd = 0, brk = 0;
    uint64_t bt = 0;
    double bp = 0;
    for (uint32_t v = 0; v < env->slots; v++) {
        uint32_t id = env->occupant[v];
        if (id == FERRY_MOE_NONE || ferry__pinned(vw->pol, v))
            continue;
        uint32_t l = id / s->E, c = s->cls[(size_t)l * s->Ep + (id - l * s->E)];
        uint32_t d = (l + s->L - vw->cur) % s->L, rk = s->rank[(size_t)l * SC_NC + c];
        d = d ? d : s->L;
        double pv = s->pc[(size_t)l * SC_NC + c];
        int better = best == NIL || pv * bd < bp * d ||
                     (pv * bd == bp * d &&
                      (d > bd || (d == bd && (rk < brk || (rk == brk && vw->tch[id] < bt)))));
        if (better) {
            best = v;
            bd = d;
            brk = rk;
            bt = vw->tch[id];
            bp = pv;
        }
    }
    sc_checked++;
    sc_mismatched += best != got;
}

uint64_t ferry__successor_ops(const ferry__policy *p)
{
    return p && p->ops == &ferry__policy_successor ? ((const succ *)p)->ops : 0;
}

int ferry__successor_skip(ferry__policy *p, uint64_t visits, uint64_t touches)
{
    if (!p || p->ops != &ferry__policy_successor || visits % ((SC_W + 1) * SC_REFRESH * 8))
        return -EINVAL;
    succ *s = (succ *)p;
    for (uint32_t l = 0; l < s->L; l++)
        s->V[l] += s->V[l] ? visits : 0;
    s->own.clk += touches;
    if (s->fv)
        s->fv->clk += touches;
    return 0;
}

uint64_t ferry__successor_global(const ferry__policy *p, uint32_t c, uint64_t *routed)
{
    if (!p || p->ops != &ferry__policy_successor || c >= SC_NC)
        return 0;
    const succ *s = (const succ *)p;
    *routed = s->kg[c];
    return s->ng[c];
}

uint32_t ferry__successor_class(const ferry__policy *p, uint32_t id)
{
    if (!p || p->ops != &ferry__policy_successor)
        return UINT32_MAX;
    const succ *s = (const succ *)p;
    uint32_t l = id / s->E;
    return l < s->L ? s->cls[(size_t)l * s->Ep + (id - l * s->E)] : UINT32_MAX;
}

size_t ferry__successor_bytes(uint32_t num_layers, uint32_t num_experts)
{
    size_t ids = (size_t)num_layers * num_experts;
    return ids * (TR_ROW * sizeof(uint16_t) + sizeof(uint16_t) + sizeof(uint64_t) +
                  (SC_W + 1) * sizeof(uint16_t) + 5) +
           (size_t)num_layers * SC_NC * 30;
}

/* the view's victim: layers offered from the furthest next use down */
static int view_victim(succ *s, scview *v, uint32_t *slot)
{
    uint32_t L = s->L, best = NIL;
    double bp = 0;
    uint32_t bd = 1;
    uint32_t l = v->cur; /* (cur + d) % L, stepped down with d: no division */
    for (uint32_t d = L; d >= 1; d--, l = l ? l - 1 : L - 1) {
        s->ops++;
        if (best != NIL && bp * d < s->pmin * bd)
            break; /* bp/bd < pmin/d: no nearer layer can win */
        uint64_t m = v->rmask[l];
        if (!m)
            continue;
        if (best != NIL &&
            s->pc[(size_t)l * SC_NC + s->ord[(size_t)l * SC_NC + __builtin_ctzll(m)]] * bd >= bp * d)
            continue; /* not even its least class can win */
        double pl;
        uint32_t c = sc_layer_least(s, v, l, &pl);
        if (c == NIL)
            continue;
        if (best == NIL || pl * bd < bp * d) {
            best = c;
            bp = pl;
            bd = d;
        }
    }
    if (sc_verify_on)
        sc_verify(s, v, best);
    if (best == NIL)
        return -1;
    *slot = best;
    return 0;
}

static int sc_victim(ferry__policy *p, uint32_t id, int have_free, uint32_t *slot)
{
    (void)id;
    return have_free ? 1 : view_victim((succ *)p, &((succ *)p)->own, slot);
}

const ferry__policy_ops ferry__policy_successor = {
    .name = "successor",
    .describe = "learned successors of the routed set, a few classes per layer, least p / steps to its layer",
    .state_size = sizeof(succ),
    .init = sc_init,
    .fini = sc_fini,
    .begin_step = sc_begin,
    .end_step = NULL,
    .hit = sc_hit,
    .insert = sc_insert,
    .remove = sc_remove,
    .victim = sc_victim,
};

/* ---- a follower: another set of slots, the lead's model ---- */
typedef struct sfollow {
    ferry__policy base;
    succ *m;
    scview v;
} sfollow;

int ferry__successor_follow(ferry__policy *p, ferry__policy *lead)
{
    if (!p || !lead || lead->ops != &ferry__policy_successor ||
        p->ops != &ferry__policy_successor_follower)
        return -EINVAL;
    succ *s = (succ *)lead;
    sfollow *f = (sfollow *)p;
    if (s->fv || p->env.num_layers != s->L || p->env.num_experts != s->E)
        return -EINVAL;
    int rc = view_init(&f->v, p, 2, s->L, s->E);
    if (rc < 0)
        return rc;
    f->m = s;
    s->fv = &f->v;
    return 0;
}

static int sf_init(ferry__policy *p)
{
    (void)p;
    return -EINVAL; /* made by ferry__successor_follow */
}

static void sf_fini(ferry__policy *p)
{
    /* (the lead is destroyed with it, not told: it may be gone already) */
    view_fini(&((sfollow *)p)->v);
}

/* the lead has learned the step (its begin_step ran first): only the
 * follower's own pins end and its routed residents are touched */
static int sf_begin(ferry__policy *p, uint32_t layer, const uint32_t *ids, uint32_t n)
{
    sfollow *f = (sfollow *)p;
    scview *v = &f->v;
    v->lslot[v->cur] = NIL - 1;
    v->lslot[layer] = NIL - 1;
    v->cur = layer;
    for (uint32_t j = 0; j < n; j++)
        if (p->env.where[ids[j]] != FERRY_MOE_NONE)
            v->tch[ids[j]] = ++v->clk;
    return 0;
}

static int sf_insert(ferry__policy *p, uint32_t slot, uint32_t id, int prefetch)
{
    (void)prefetch;
    (void)slot;
    view_insert(((sfollow *)p)->m, &((sfollow *)p)->v, id);
    return 0;
}

static void sf_remove(ferry__policy *p, uint32_t slot, uint32_t id, int evicted)
{
    (void)evicted;
    (void)slot;
    view_remove(((sfollow *)p)->m, &((sfollow *)p)->v, id);
}

static int sf_victim(ferry__policy *p, uint32_t id, int have_free, uint32_t *slot)
{
    (void)id;
    return have_free ? 1 : view_victim(((sfollow *)p)->m, &((sfollow *)p)->v, slot);
}

const ferry__policy_ops ferry__policy_successor_follower = {
    .name = "successor-follower",
    .describe = "successor's victims over another set of slots, from a lead's model",
    .state_size = sizeof(sfollow),
    .init = sf_init,
    .fini = sf_fini,
    .begin_step = sf_begin,
    .hit = sc_hit,
    .insert = sf_insert,
    .remove = sf_remove,
    .victim = sf_victim,
};
