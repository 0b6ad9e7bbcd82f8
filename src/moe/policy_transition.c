/*
 * policy_transition.c - "transition": a learned same-layer token-to-token
 * transition model (the research prototype's "trans2-lite",
 * /work/research-policy/REPORT.md section 3), kept at O(top_k x TR_K) a
 * layer-step: no pass over a layer's experts, none over the slots.
 *
 * Each expert of layer l sits in a cell: (routed at l's last visit, how
 * many of l's last 16 visits routed it, q), q the bin of its transition
 * feature - the mean over the visit's routed set R of the smoothed
 * probability that it follows r:
 *     tv(e) = (sum over r in R of C[l][r][e] / (An[l][r] + 1)
 *              + (k / E) sum over r in R of 1 / (An[l][r] + 1)) / |R|,
 * k the model's top_k (the step's route count when not given), An[l][r]
 * the visits of l that followed one routing r, C[l][r][e] the count of
 * those that routed e - for the experts that one of R's rows tracks; all
 * the others are in the lowest bin (0), as are tracked ones whose tv is
 * below its edge. A row tracks TR_K successors by space-saving (Metwally,
 * Agrawal and El Abbadi, 2005; see "a row's successors" below): no E x E
 * table, a row's counts in two vector registers while a visit counts it,
 * and at most |R| x TR_K experts of a visit with a bin above 0. (The
 * prototype sums every row over every expert: O(E x |R|) a visit. Until
 * issue 27 a row kept all E exact counts and tracked its 16 most counted
 * exactly: a visit's 64 counts cost as much as the rest of the visit, and
 * on the real decode traces of the README space-saving hits more at 12.5%
 * (OLMoE: 15-40% -> 17-37% of the LRU -> Belady gap) and about a point
 * less at 25%, still 8-11 above LRU.)
 * A cell's p = (k[c] + 20 prior[c]) / (n[c] + 20), prior 0.45 when routed
 * at the last visit and 0.08 otherwise: n[c] counts every expert in cell
 * c at each visit of its layer, k[c] those of them routed then.
 *
 * Incremental: an expert's cell changes only at a visit of its layer that
 * routes it, follows one that did (it leaves "routed last"), comes 16
 * visits after one that did (a route leaves the window), or whose routed
 * set's rows give it a bin above 0 or whose previous one's did. Those are
 * found from the last 17 routed sets of the layer and the last visit's
 * list of binned experts: O(|R| x TR_K) events a visit. n[c] is counted
 * without visiting the cells (a layer's count in c held over t visits
 * adds count x t: see corr), folded in, with the p of every cell, at
 * visits 1, 2, 4, .. TR_REFRESH and then every TR_REFRESH (each awake
 * layer's every cell, four at a time: no list of the non-empty ones is
 * kept at each move): the p
 * used between refreshes is the last one's (the prototype's, every
 * visit). A move's slot is touched as it moves, the order's fields in
 * locals for the visit (mv_move).
 * A resident whose cell changed or that was used is "touched": its slot
 * is marked, and marked slots are filed again, in the order first
 * marked, before the next victim.
 *
 * The victim is the unpinned resident with the least p / d, d the steps
 * until its layer runs again ((layer - l) mod L, 0 read as L), compared by
 * cross-multiplication; ties to the one touched (filed, moved to its cell
 * or used) longer ago - a clock value unique to each filing, so no tie is
 * left. (The prototype's tie is the older last use; a cell holds the
 * experts of one history and bin, so the two mostly agree: on the real
 * traces auto moved by at most 0.36 points, transition alone 0.65.) All
 * residents of a layer share d, so the victim is the best of each layer's
 * least (p, touched): each resident's cell and key are kept by id, and
 * each (layer, cell) counts its residents, so filing is O(1) and never
 * allocates; a layer's least is the cell of least p among its non-empty
 * ones (the cells ranked by p at each refresh) and, of its residents, the
 * least key (a pass over the layer's ids, eight a compare), found again
 * only when the layer changed or the p were refreshed (the order:
 * tr_order.h). A victim costs O(L) over the layers' cached least, plus,
 * for a layer that changed, its non-empty cells and O(E) compares.
 * ferry__transition_verify() has every victim checked against a scan of
 * all the slots by the same rule (tests).
 *
 * Memory: about 133 bytes an id (ferry__transition_bytes: DeepSeek-V3's
 * 58 x 256, 1.9 MiB); shapes past FERRY__TRANSITION_MAX_BYTES are
 * refused at planner create.
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "moe/moe_internal.h"

/* TR_W, TR_K and TR_REFRESH may be set at build time (-DTR_W=8) to
 * measure another model; the tests and the README's figures are of these
 * defaults (a TR_K other than 16 counts its rows a lane at a time) */
#ifndef TR_W
#define TR_W 16            /* history window (visits of the id's layer) */
#endif
#define TR_HMASK ((1u << TR_W) - 1u) /* a history's bits in the window */
#define TR_NQ 17           /* transition bins: 1 + the edges */
#define TR_NCQ TR_NQ       /* q values */
#define TR_NC (2 * (TR_W + 1) * TR_NCQ)
#define TR_NCP ((TR_NC + 15) / 16 * 16) /* a layer's cell counts, padded for compares */
#define TR_M 20.0 /* backoff strength toward the prior */
#define TR_P_HI 0.45
#define TR_P_LO 0.08
#ifndef TR_K
#define TR_K 16         /* successors a row tracks */
#endif
#define TR_ROW (2 * TR_K) /* a row's lanes: experts, then counts */
#define TR_RING (TR_W + 1)
#ifndef TR_REFRESH
#define TR_REFRESH 256u /* visits between refreshes of the cells' p */
#endif
#define TR_CNT 0x7fffu  /* the most a count or a row's total holds */
#if defined(__GNUC__)
#define TR_PREFETCH(a) __builtin_prefetch(a)
#else
#define TR_PREFETCH(a) ((void)(a))
#endif

/* the edges, between two that no feature is above or below (not numbers:
 * every compare with them is false) */
static const double tr_edges[TR_NQ + 1] = {NAN,  0.01, 0.02, 0.03, 0.05, 0.07, 0.10,
                                           0.13, 0.16, 0.20, 0.25, 0.30, 0.35, 0.40,
                                           0.50, 0.60, 0.70, NAN};

#define TR_RK_NONE 0x7fffu /* above every rank (ranks < TR_NC) */
#define NIL UINT32_MAX
#define CELL_NONE UINT16_MAX

#include "moe/ss_rows.h"

int ferry__transition_narrow; /* (tests) set: SSE2 rows and a scalar fold where AVX2 is */

/* what an event reads and writes of one expert, together in 8 bytes (a
 * layer's 256 in 2 KiB: a decode's sweep of all layers stays in L2) */
typedef struct trx {
    uint32_t hv;   /* the visit hist is of */
    uint16_t hist; /* bit i = routed at its layer's visit hv - i (the window) */
    uint16_t cell;
} trx;
_Static_assert(sizeof(trx) == 8 && TR_W >= 2 && TR_W <= 16, "an expert's state is 8 bytes");
_Static_assert(TR_K >= 1 && TR_K <= 255 && TR_REFRESH >= 1, "a row's lanes used fit a byte");
_Static_assert(TR_REFRESH <= 65536u, "a refresh's fold sums E x TR_REFRESH in 32 bits");

#include "moe/tr_order.h"
#include "moe/tr_vec.h"

typedef struct trwk { /* a resident of a waking layer: its last use */
    uint64_t last;
    uint32_t slot;
} trwk;

typedef struct trans {
    ferry__policy base;
    trord o;
    struct trord *fol_o;             /* a follower's order, told of every change */
    const ferry__policy *fol;        /* that follower */
    uint32_t layer;                  /* the current step's layer */
    uint32_t k;                      /* top_k, 0: the step's route count */
    struct trx *x;                   /* per id */
    uint64_t *last;                  /* per id: step of its last use (ties) */
    /* per layer */
    uint64_t *V;                     /* visits (64 bits: the ring is V % 17, no wrap) */
    uint32_t *lt;                    /* visits since the last fold */
    uint16_t *cc;                    /* [L][TR_NCP] experts in each cell */
    uint16_t *ring;                  /* [L][TR_RING][E] routed sets (layer-local) */
    uint32_t *ring_n;                /* [L][TR_RING] */
    uint64_t *ring_v;                /* [L][TR_RING] the visit a ring entry holds */
    uint16_t *uset;                  /* [L][E] the last visit's tracked experts */
    uint32_t *un;                    /* [L] */
    int32_t *nprev;                  /* [L] experts of the last visit, -1 before it */
    uint64_t *lv;                    /* [L] the last visit whose transitions are learned */
    /* transitions */
    uint16_t *An;                    /* [L][E] */
    uint16_t *lanes;                 /* [L][E] rows of TR_K experts then TR_K counts:
                                        a 64-byte line each */
    uint8_t *tn;                     /* [L][E] lanes used */
    /* per visit scratch (E) */
    double *acc, *wr;
    uint8_t *qv;                     /* the visit's bins (tracked_set), 0 between visits */
    uint32_t *emark, stamp;          /* (E) the visit's events and bins' moves, once each */
    uint16_t *ev, *tk, *miss;
    void *evv;                       /* (E) the visit's successors as rows compare them */
    /* learned */
    uint64_t opps[TR_NC], kG[TR_NC], corr[TR_NC];
    double P[TR_NC], pmin;           /* pmin: the least of the P */
    uint16_t cbase[TR_NC];           /* a cell less its bin: c - c % TR_NCQ */
    uint16_t srt[TR_NC];             /* the cells by p, least first */
    uint16_t rk[TR_NCP];             /* each cell's rank in srt (equal p, equal rank;
                                        the padding's TR_RK_NONE) */
    uint32_t nr0;                    /* the cells of rank 0: srt[0..nr0) */
    uint64_t visits, pgen;
    uint32_t sleep_stride;           /* > 1: layers not a multiple of it may sleep */
    uint8_t *asleep;                 /* [L] */
    int wide;                        /* the rows counted with AVX2 (row_learn) */
    trwk *wk;                        /* [slots] a wake's scratch */
} trans;


/* ---- the model ---- */
size_t ferry__transition_bytes(uint32_t num_layers, uint32_t num_experts)
{
    /* per id: its row's lanes, its place in the ring of routed sets, what
     * is known of it, its last use, its row's total, its place in the
     * tracked set and its row's lanes used; and in the victims' order, its
     * cell, slot and key (counted at 8 bytes, though 4 now: the shapes
     * refused, and auto's members, as they were) */
    size_t per_id = TR_K * 2 * sizeof(uint16_t) + TR_RING * sizeof(uint16_t) + sizeof(trx) +
                    sizeof(uint64_t) + 2 * sizeof(uint16_t) + 1 + sizeof(uint16_t) +
                    sizeof(uint32_t) + sizeof(uint64_t);
    return (size_t)num_layers * num_experts * per_id;
}

static void tr_fini(ferry__policy *p)
{
    trans *s = (trans *)p;
    ord_fini(&s->o);
    void *arr[] = {s->x, s->last, s->V, s->asleep, s->wk,    s->lt,   s->cc,
                   s->ring, s->ring_n, s->ring_v, s->uset, s->un, s->nprev, s->lv, s->An, s->tn,
                   s->acc, s->wr,  s->ev, s->emark, s->tk, s->miss, s->qv};
    for (size_t i = 0; i < sizeof arr / sizeof *arr; i++)
        ferry__free(arr[i]);
    ferry__free(s->lanes);
    ferry__free(s->evv);
}

static uint16_t tr_cell(uint32_t h, uint32_t q);

static void refresh_p(trans *s);

static int tr_init(ferry__policy *p)
{
    trans *s = (trans *)p;
    uint32_t L = p->env.num_layers, E = p->env.num_experts;
    if (ferry__transition_bytes(L, E) > FERRY__TRANSITION_MAX_BYTES)
        return -EINVAL;
    size_t ids = (size_t)L * E;
    s->k = p->env.top_k;
#if defined(TR_ROWS_AVX2)
    s->wide = !ferry__transition_narrow && __builtin_cpu_supports("avx2");
#endif
    s->x = ferry__calloc(ids, sizeof *s->x);
    s->last = ferry__calloc(ids, sizeof *s->last);
    s->V = ferry__calloc(L, sizeof *s->V);
    s->asleep = ferry__calloc(L, 1);
    s->wk = ferry__malloc(((size_t)p->env.slots + 1) * sizeof *s->wk);
    s->lt = ferry__calloc(L, sizeof *s->lt);
    s->cc = ferry__calloc((size_t)L * TR_NCP, sizeof *s->cc);
    s->ring = ferry__malloc((size_t)L * TR_RING * E * sizeof *s->ring);
    s->ring_n = ferry__calloc((size_t)L * TR_RING, sizeof *s->ring_n);
    s->ring_v = ferry__calloc((size_t)L * TR_RING, sizeof *s->ring_v);
    s->uset = ferry__malloc(ids * sizeof *s->uset);
    s->un = ferry__calloc(L, sizeof *s->un);
    s->nprev = ferry__malloc((size_t)L * sizeof *s->nprev);
    s->lv = ferry__calloc(L, sizeof *s->lv);
    s->An = ferry__calloc(ids, sizeof *s->An);
    s->tn = ferry__calloc(ids, sizeof *s->tn);
    s->lanes = ferry__aligned_alloc(64, ids * TR_ROW * sizeof *s->lanes);
    s->evv = ferry__aligned_alloc(64, (size_t)E * 16);
    s->acc = ferry__calloc(E, sizeof *s->acc);
    s->wr = ferry__malloc((size_t)E * sizeof *s->wr);
    s->ev = ferry__malloc(((size_t)2 * E + 1) * sizeof *s->ev); /* (+1: a branchless append) */
    s->qv = ferry__calloc(E, sizeof *s->qv);
    s->emark = ferry__calloc(E, sizeof *s->emark);
    s->tk = ferry__malloc((size_t)E * sizeof *s->tk);
    /* (+1: a branchless append; 8 at least: the AVX2 rows read 8) */
    s->miss = ferry__calloc((size_t)E + 8, sizeof *s->miss);
    if (ord_init(&s->o, &p->env) < 0 || !s->x || !s->last || !s->V || !s->asleep || !s->wk ||
        !s->lt || !s->cc || !s->ring || !s->ring_n || !s->ring_v || !s->uset ||
        !s->un || !s->nprev || !s->lv || !s->An || !s->tn || !s->lanes || !s->evv || !s->acc || !s->wr ||
        !s->ev || !s->tk || !s->miss || !s->qv || !s->emark) {
        tr_fini(p);
        return -ENOMEM;
    }
    /* written now, so that its pages fault in at create and not one by one
     * in the first tokens of a decode */
    memset(s->ring, 0, (size_t)L * TR_RING * E * sizeof *s->ring);
    memset(s->uset, 0, ids * sizeof *s->uset);
    memset(s->last, 0, ids * sizeof *s->last); /* (zero already: the pages) */
    memset(s->An, 0, ids * sizeof *s->An);
    memset(s->cc, 0, (size_t)L * TR_NCP * sizeof *s->cc);
    for (size_t i = 0; i < ids; i++) { /* no expert (TR_NOBODY), count 0 */
        memset(s->lanes + i * TR_ROW, 0xff, TR_K * sizeof *s->lanes);
        memset(s->lanes + i * TR_ROW + TR_K, 0, TR_K * sizeof *s->lanes);
    }
    uint16_t c0 = tr_cell(0, 0);
    for (size_t i = 0; i < ids; i++)
        s->x[i].cell = c0;
    for (uint32_t l = 0; l < L; l++) {
        s->nprev[l] = -1;
        s->cc[(size_t)l * TR_NCP + c0] = (uint16_t)E;
    }
    for (uint32_t c = 0; c < TR_NC; c++) {
        s->srt[c] = (uint16_t)c;
        s->cbase[c] = (uint16_t)(c - c % TR_NCQ);
    }
    for (uint32_t c = TR_NC; c < TR_NCP; c++)
        s->rk[c] = TR_RK_NONE;
    refresh_p(s); /* the priors */
    return 0;
}

/* how many edges are <= i / 100: the bin of t within one, for t near i% */
static const uint8_t tr_bin_lut[101] = {
    0,  1,  2,  3,  3,  4,  4,  5,  5,  5,  6,  6,  6,  7,  7,  7,  8,  8,  8,  8,  9,
    9,  9,  9,  9,  10, 10, 10, 10, 10, 11, 11, 11, 11, 11, 12, 12, 12, 12, 12, 13, 13,
    13, 13, 13, 13, 13, 13, 13, 13, 14, 14, 14, 14, 14, 14, 14, 14, 14, 14, 15, 15, 15,
    15, 15, 15, 15, 15, 15, 15, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16,
    16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16};

/* t's bin: how many edges are <= t. The table's, from t x 100 (rounded
 * down, 0 to 100), is exact but within an edge's rounding, where it is
 * one off: moved up or down by the edges either side (no branch) */
static inline uint32_t tr_bin(double t)
{
    double x = t * 100.0;
    x = x > 0 ? x : 0; /* (t <= 0 or not a number: below every edge) */
    x = x < 100.0 ? x : 100.0;
    uint32_t q = tr_bin_lut[(uint32_t)x];
    q += t >= tr_edges[q + 1];
    q -= t < tr_edges[q];
    return q;
}

/* bits set in each byte */
#define TR_B2(n) n, n + 1, n + 1, n + 2
#define TR_B4(n) TR_B2(n), TR_B2(n + 1), TR_B2(n + 1), TR_B2(n + 2)
#define TR_B6(n) TR_B4(n), TR_B4(n + 1), TR_B4(n + 1), TR_B4(n + 2)
static const uint8_t tr_pop8[256] = {TR_B6(0), TR_B6(1), TR_B6(1), TR_B6(2)};
#undef TR_B2
#undef TR_B4
#undef TR_B6

static uint32_t popcount16(uint32_t x)
{
    return (uint32_t)tr_pop8[x & 0xffu] + tr_pop8[(x >> 8) & 0xffu];
}

/* the cell of history h (bit 0: routed now) and bin q */
static uint16_t tr_cell(uint32_t h, uint32_t q)
{
    return (uint16_t)(((h & 1) * (TR_W + 1) + popcount16(h)) * TR_NCQ + q);
}


/* layer l's counts held since its last fold into opps: every cell, four
 * at a time (a layer's 578 counts; a refresh folds each layer's once in
 * TR_REFRESH visits, so no list of the non-empty ones is kept at each
 * move) */
static void fold_layer(trans *s, uint32_t l)
{
    const uint16_t *cc = s->cc + (size_t)l * TR_NCP;
    uint64_t t = s->lt[l];
    if (!t)
        return; /* (asleep, or folded already) */
    /* (t counts visits: below 2^32, so cc x t is one 32 x 32 product) */
#if defined(TR_ROWS_AVX2)
    if (s->wide && t <= UINT32_MAX) {
        fold_cells_avx2(s->opps, cc, t);
        s->o.ops += TR_NC / 4;
        s->lt[l] = 0;
        return;
    }
#endif
    for (uint32_t c = 0; c < TR_NC; c++)
        s->opps[c] += (uint64_t)cc[c] * t;
    s->o.ops += TR_NC / 4;
    s->lt[l] = 0;
}

/* the cells in order of p (srt: an insertion sort from the last order,
 * which the p mostly keep) and each one's rank, equal p equal rank: a
 * layer's least compares ranks (tr_order.h) */
static void rank_p(trans *s)
{
    uint16_t *srt = s->srt;
    const double *P = s->P;
    for (uint32_t i = 1; i < TR_NC; i++) {
        uint16_t c = srt[i];
        double pc = P[c];
        uint32_t j = i;
        for (; j > 0 && P[srt[j - 1]] > pc; j--)
            srt[j] = srt[j - 1];
        srt[j] = c;
    }
    uint16_t r = 0;
    s->rk[srt[0]] = 0;
    s->nr0 = 1;
    for (uint32_t i = 1; i < TR_NC; i++) {
        r = (uint16_t)(r + (P[srt[i]] != P[srt[i - 1]]));
        s->rk[srt[i]] = r;
        s->nr0 += r == 0;
    }
    s->o.ops += TR_NC;
}

/* fold the counts held since the last fold into opps; every cell's p */
static void refresh_p(trans *s)
{
    uint32_t L = s->base.env.num_layers;
#if defined(TR_ROWS_AVX2)
    if (s->wide)
        s->o.ops += fold_all_avx2(s->opps, s->cc, s->lt, L) * (TR_NCP / 16);
#endif
    for (uint32_t l = 0; l < L; l++)
        fold_layer(s, l); /* (the rest: none where wide, but lt past 2^16) */
    for (uint32_t c = 0; c < TR_NC; c++) {
        s->opps[c] -= s->corr[c];
        double prior = c / TR_NCQ >= TR_W + 1 ? TR_P_HI : TR_P_LO;
        s->P[c] = ((double)s->kG[c] + TR_M * prior) / ((double)s->opps[c] + TR_M);
        s->pmin = c == 0 || s->P[c] < s->pmin ? s->P[c] : s->pmin;
    }
    s->o.ops += TR_NC;
    rank_p(s);
    memset(s->corr, 0, sizeof s->corr);
    s->pgen++; /* every layer's least is of the old p */
}

/* the transitions from a visit of layer l (its routed set prev[0..np))
 * to the next one's routes le[0..n) */
static void learn_transitions(trans *s, uint32_t l, const uint16_t *le, uint32_t n,
                              const uint16_t *prev, int32_t np)
{
    size_t b = (size_t)l * s->base.env.num_experts;
    /* (locals: a store to a count would have every field read again) */
    uint16_t *An = s->An + b, *lanes = s->lanes + b * TR_ROW, *miss = s->miss;
    trev *evs = s->evv;
    int wide = s->wide;
    rowv_events(le, n, evs);
    uint8_t *tn = s->tn + b;
#if defined(TR_ROWS_AVX2)
    if (wide && np > 0) {
        rows_learn_avx2(lanes, An, tn, prev, (uint32_t)np, evs, le, n, miss);
        s->o.ops += (uint64_t)n * (uint32_t)np;
        return;
    }
#endif
    for (int32_t i = 0; i < np; i++)
        tn[prev[i]] = (uint8_t)row_learn(lanes + (size_t)prev[i] * TR_ROW, &An[prev[i]], evs, le,
                                         n, miss, wide);
    s->o.ops += (uint64_t)n * (uint32_t)(np > 0 ? np : 0);
}

/* the rows layer l's visit u + 1 counts in: its visit u's set's */
static void prefetch_rows(const trans *s, uint32_t l, uint64_t u)
{
    size_t a = (size_t)l * TR_RING + u % TR_RING, b = (size_t)l * s->base.env.num_experts;
    const uint16_t *set = s->ring + a * s->base.env.num_experts;
    for (uint32_t i = 0; i < s->ring_n[a]; i++) {
        TR_PREFETCH(s->lanes + (b + set[i]) * TR_ROW);
        TR_PREFETCH(s->An + b + set[i]);
    }
}

/* layer l's transitions of the visits after lv[l] through its last,
 * learned now from the ring, in order (a sleeping layer's, in batches:
 * see "sleep"); each visit's rows asked for a visit ahead */
static void learn_pending(trans *s, uint32_t l)
{
    uint32_t E = s->base.env.num_experts;
    uint64_t V = s->V[l];
    if (s->lv[l] >= 1 && s->lv[l] + 1 < V)
        prefetch_rows(s, l, s->lv[l]);
    for (uint64_t u = s->lv[l] + 1; u <= V; u++) {
        if (u < V)
            prefetch_rows(s, l, u);
        if (u < 2)
            continue; /* (the first visit follows none) */
        size_t a = (size_t)l * TR_RING + (u - 1) % TR_RING, c = (size_t)l * TR_RING + u % TR_RING;
        learn_transitions(s, l, s->ring + c * E, s->ring_n[c], s->ring + a * E,
                          (int32_t)s->ring_n[a]);
    }
    s->lv[l] = V;
}

/* the rows the next layer's visit will count in (its last routed set's:
 * it runs next in a decode), asked for a step ahead */
static void prefetch_next_rows(const trans *s, uint32_t layer)
{
    uint32_t E = s->base.env.num_experts, L = s->base.env.num_layers, l = layer + 1 == L ? 0 : layer + 1;
    const uint16_t *pv = s->ring + ((size_t)l * TR_RING + (s->V[l] % TR_RING)) * E;
    if (s->sleep_stride && l % s->sleep_stride)
        return; /* asleep: its rows are learned in a batch */
    for (int32_t i = 0; i < s->nprev[l]; i++) {
        size_t ri = (size_t)l * E + pv[i];
        TR_PREFETCH(s->lanes + ri * TR_ROW);
        TR_PREFETCH(s->An + ri); /* (its total and lanes used, and the expert: */
        TR_PREFETCH(s->tn + ri); /* an event of that visit) */
        TR_PREFETCH(s->x + ri);
    }
}

/* a visit's moves, against its layer's arrays in locals (a store to a
 * count would have every field of the policy read again) */
typedef struct trmv {
    struct trx *x;         /* the layer's experts */
    const uint32_t *where; /* their slots */
    uint16_t *cc;          /* the layer's cell counts */
    uint64_t *corr, t;
    trslot *sl;            /* the lead's order: its slots, touched at each move */
    uint32_t *plist, pn, none, on;
    const uint32_t *fwhere; /* a follower's slots of the layer's experts, NULL: none */
    trord *fo;              /* its order */
    uint32_t l, b;
} trmv;

static inline void mv_init(trmv *m, trans *s, uint32_t l)
{
    uint32_t E = s->base.env.num_experts;
    m->b = l * E;
    m->x = s->x + m->b;
    m->where = s->base.env.where + m->b;
    m->cc = s->cc + (size_t)l * TR_NCP;
    m->corr = s->corr;
    m->t = s->lt[l];
    m->sl = s->o.sl;
    m->plist = s->o.plist;
    m->pn = s->o.pn;
    m->none = s->o.n;
    m->on = 0;
    m->fwhere = s->fol ? s->fol->env.where + m->b : NULL;
    m->fo = s->fol_o;
    m->l = l;
}

/* the visit's moves' touches of the lead's slots, into its order */
static inline void mv_done(trmv *m, trans *s)
{
    uint32_t listed = m->pn - s->o.pn;
    s->o.pn = m->pn;
    s->o.ops += listed;
    /* one listed: 0, find the least again (one listed before is of a
     * layer whose least is found again already: no pick since) */
    s->o.lgen[m->l] &= (uint64_t)m->on - 1;
}

/* expert e (layer-local) gets cell c now: counts, and its slot touched
 * in the lead's order (ord_touch_any's, the order's fields in locals) and
 * the follower's */
static inline __attribute__((always_inline)) void mv_move(trmv *m, uint32_t e, uint16_t c,
                                                          int fol)
{
    struct trx *xe = &m->x[e];
    uint16_t old = xe->cell;
    /* (no branch on whether it moved: a count down and up, a correction
     * off and on, and a touch only where it moved) */
    uint32_t moved = old != c;
    m->cc[old]--;
    m->cc[c]++;
    m->corr[old] -= m->t; /* a count down by one at fold-visit t */
    m->corr[c] += m->t;
    xe->cell = c;
    uint32_t v = m->where[e] < m->none ? m->where[e] : m->none, on;
    trslot *sv = &m->sl[v];
    on = (sv->id != NIL) & moved;
    m->on |= on;
    m->plist[m->pn] = v;
    m->pn += on & !sv->pend;
    sv->pend |= (uint8_t)on;
    if (fol) { /* (a follower's shadow holds the layers it samples alone) */
        uint32_t slot = m->fwhere[e];
        slot = moved ? slot : FERRY_MOE_NONE;
        if (slot != FERRY_MOE_NONE)
            ord_touch(m->fo, m->l, slot);
    }
}

/* the visit's moves, its layer's arrays in registers: each history event
 * ev[0..nev) brought to visit v32 (routed now: the first nr), in its new
 * cell; then the bins moved (listed past the events, nbm of them) */
static inline __attribute__((always_inline)) void
visit_moves_in(trmv *mp, const uint16_t *ev, uint32_t nev, uint32_t nr, uint32_t v32, uint32_t nbm,
               uint8_t *qv, const uint16_t *cb, int fol)
{
    trmv m = *mp;
    for (uint32_t i = 0; i < nev; i++) {
        uint32_t e = ev[i], d = v32 - m.x[e].hv;
        uint16_t h = (uint16_t)((d >= TR_W ? 0 : (m.x[e].hist << d) & TR_HMASK) | (i < nr));
        m.x[e].hist = h;
        m.x[e].hv = v32;
        mv_move(&m, e, tr_cell(h, qv[e]), fol);
        qv[e] = 0; /* (zero between visits: its cell holds it now) */
    }
    const uint16_t *bm = ev + nev;
    for (uint32_t i = 0; i < nbm; i++) {
        uint32_t e = bm[i];
        mv_move(&m, e, (uint16_t)(cb[m.x[e].cell] + qv[e]), fol);
        qv[e] = 0;
    }
    *mp = m;
}

static __attribute__((noinline)) void visit_moves(trmv *m, const uint16_t *ev, uint32_t nev,
                                                  uint32_t nr, uint32_t v32, uint32_t nbm,
                                                  uint8_t *qv, const uint16_t *cb)
{
    visit_moves_in(m, ev, nev, nr, v32, nbm, qv, cb, 0);
}

static __attribute__((noinline)) void visit_moves_fol(trmv *m, const uint16_t *ev, uint32_t nev,
                                                      uint32_t nr, uint32_t v32, uint32_t nbm,
                                                      uint8_t *qv, const uint16_t *cb)
{
    visit_moves_in(m, ev, nev, nr, v32, nbm, qv, cb, 1);
}


/* the experts the routed set's rows track whose feature's bin is above
 * the lowest: listed in us, their bin in qv; the others' is the lowest
 * (0, as qv holds between visits: the caller zeroes the listed ones) */
static uint32_t tracked_set(trans *s, uint32_t l, const uint16_t *le, uint32_t n, uint16_t *us)
{
    uint32_t E = s->base.env.num_experts, nu = 0;
    size_t nc = 0;
    const uint16_t *An = s->An + (size_t)l * E;
    double wsum = 0;
    double *wr = s->wr;
    for (uint32_t j = 0; j < n; j++) {
        wr[j] = 1.0 / ((double)An[le[j]] + 1.0);
        wsum += wr[j];
    }
    uint16_t *cand = s->ev + E; /* (the second half of the scratch) */
    double *acc = s->acc;
    const uint16_t *lanes = s->lanes + (size_t)l * E * TR_ROW;
    const uint8_t *tn = s->tn + (size_t)l * E;
#if defined(TR_ROWS_AVX2)
    if (s->wide)
        nc = ts_rows_avx2(lanes, tn, le, n, wr, acc, cand, &s->o.ops);
    else
#endif
        nc = ts_rows_in(lanes, tn, le, n, wr, acc, cand, &s->o.ops, rowv_terms);
    double kk = s->k ? (double)s->k : (double)n, base = wsum * kk / E, inv = 1.0 / n;
    uint8_t *qv = s->qv;
    size_t i = 0;
#if defined(TR_ROWS_AVX2)
    if (s->wide)
        i = bin_avx2(cand, nc, acc, base, inv, qv, us, &nu);
#endif
    for (; i < nc; i++) { /* (no branch: mostly every one is above 0) */
        uint32_t e = cand[i], q = tr_bin((acc[e] + base) * inv);
        acc[e] = 0;
        qv[e] = (uint8_t)q;
        us[nu] = (uint16_t)e;
        nu += q != 0;
    }
    return nu;
}

/* a fresh stamp for the visit's marks */
static void tr_new_stamp(trans *s)
{
    if (++s->stamp == 0) { /* (after 2^32 visits) the marks start over */
        memset(s->emark, 0, s->base.env.num_experts * sizeof *s->emark);
        s->stamp = 1;
    }
}

/* e (layer-local) joins the visit's events ev once (marked in emark) */
static inline void ev_add(uint16_t *ev, uint32_t *emark, uint32_t stamp, uint32_t e, uint32_t *nev)
{
    ev[*nev] = (uint16_t)e;
    *nev += emark[e] != stamp;
    emark[e] = stamp;
}

static void tr_end_visit(trans *s, uint32_t layer)
{
    if (s->visits < TR_REFRESH ? !(s->visits & (s->visits - 1)) : s->visits % TR_REFRESH == 0)
        refresh_p(s);
    prefetch_next_rows(s, layer);
}

/* ---- sleep: a layer whose cells no one reads (auto's transition while
 * another policy leads, on the layers its shadow does not sample) keeps
 * its ring of routed sets and learns its rows from it (learn_pending: 16
 * visits at a time, before the ring forgets a set they need, and at its
 * wake: the same counts in the same order), and nothing else: no events,
 * no bins, no cells, no counts for the p. Waking it rebuilds every
 * expert's cell from the ring and the rows, as the visits it slept
 * through would have left it (the rows are the same: they never slept);
 * only the p have learned from the layers awake meanwhile. ---- */

/* layer l falls asleep: its counts so far folded into the p's (the
 * corrections of its moves stay where they are: a fold is linear) */
static void layer_sleep(trans *s, uint32_t l)
{
    fold_layer(s, l);
    s->asleep[l] = 1;
}

static int wk_cmp(const void *a, const void *b)
{
    const trwk *x = a, *y = b;
    if (x->last != y->last)
        return x->last < y->last ? -1 : 1;
    return x->slot < y->slot ? -1 : x->slot > y->slot;
}

/* layer l wakes: each expert's history from the ring, its bin from the
 * last visit's rows, its cell; the cell counts anew; each resident of the
 * layer touched (filed again before the next victim). O(E + slots) */
static void layer_wake(trans *s, uint32_t l)
{
    uint32_t E = s->base.env.num_experts;
    uint64_t V = s->V[l];
    size_t b = (size_t)l * E;
    learn_pending(s, l);
    for (uint32_t e = 0; e < E; e++) {
        s->x[b + e].hist = 0;
        s->x[b + e].hv = (uint32_t)V; /* (its low half: distances under 2^32) */
    }
    for (uint32_t back = 0; back <= TR_W && back < V; back++) {
        size_t ri = (size_t)l * TR_RING + (V - back) % TR_RING;
        if (s->ring_v[ri] != V - back)
            continue;
        const uint16_t *set = s->ring + ri * E;
        for (uint32_t i = 0; i < s->ring_n[ri]; i++)
            s->x[b + set[i]].hist |= (uint16_t)((1u << back) & TR_HMASK); /* (TR_W: out of it) */
    }
    size_t rr = (size_t)l * TR_RING + V % TR_RING;
    uint32_t nu = 0;
    if (V > 0 && s->ring_v[rr] == V && s->ring_n[rr] > 0)
        nu = tracked_set(s, l, s->ring + rr * E, s->ring_n[rr], s->uset + b);
    s->un[l] = nu;
    uint16_t *cc = s->cc + (size_t)l * TR_NCP;
    memset(cc, 0, TR_NC * sizeof *cc);
    for (uint32_t e = 0; e < E; e++) {
        uint16_t c = tr_cell(s->x[b + e].hist, s->qv[e]);
        s->x[b + e].cell = c;
        cc[c]++;
    }
    memset(s->qv, 0, E * sizeof *s->qv); /* (zero between visits) */
    /* its residents filed again from the least recently used, as their
     * uses while it slept would have (a slept layer's uses touch nothing) */
    const ferry__policy_env *env = &s->base.env;
    uint32_t nw = 0;
    for (uint32_t v = 0; v < env->slots; v++)
        if (env->occupant[v] != FERRY_MOE_NONE && env->occupant[v] / E == l)
            s->wk[nw++] = (trwk){s->last[env->occupant[v]], v};
    qsort(s->wk, nw, sizeof *s->wk, wk_cmp);
    for (uint32_t i = 0; i < nw; i++)
        ord_touch(&s->o, l, s->wk[i].slot);
    if (s->fol)
        for (uint32_t v = 0; v < s->fol->env.slots; v++)
            if (s->fol->env.occupant[v] != FERRY_MOE_NONE && s->fol->env.occupant[v] / E == l)
                ord_touch(s->fol_o, l, v);
    s->o.ops += E;
    s->asleep[l] = 0;
}

int ferry__transition_sleep(ferry__policy *p, uint32_t stride)
{
    if (!p || p->ops != &ferry__policy_transition)
        return -EINVAL;
    trans *s = (trans *)p;
    s->sleep_stride = stride > 1 ? stride : 0;
    for (uint32_t l = 0; l < p->env.num_layers; l++)
        if (s->asleep[l] && (!s->sleep_stride || l % s->sleep_stride == 0))
            layer_wake(s, l);
    return 0;
}

static int tr_begin_step(ferry__policy *p, uint32_t layer, const uint32_t *ids, uint32_t n)
{
    trans *s = (trans *)p;
    uint32_t E = p->env.num_experts;
    size_t b = (size_t)layer * E;
    s->layer = layer;
    if (!n)
        return 0;
    s->visits++;
    uint64_t V = ++s->V[layer];
    tr_new_stamp(s);
    /* this visit's set, layer-local (for the next visit and the one 16
     * later): the step's ids are its layer's, so a subtraction, not a
     * division (an id of another layer would take the division) */
    size_t rr = (size_t)layer * TR_RING + V % TR_RING;
    uint16_t *le = s->ring + rr * E;
    for (uint32_t j = 0; j < n; j++) {
        uint32_t e = ids[j] - (uint32_t)b;
        le[j] = (uint16_t)(e < E ? e : ids[j] % E);
    }
    s->ring_n[rr] = n;
    s->ring_v[rr] = V;
    s->nprev[layer] = (int32_t)n;
    if (s->sleep_stride && layer % s->sleep_stride) { /* asleep: the ring, the rows in batches */
        if (!s->asleep[layer])
            layer_sleep(s, layer);
        if (V - s->lv[layer] >= TR_RING - 1) /* before the ring forgets a set they need */
            learn_pending(s, layer);
        tr_end_visit(s, layer);
        return 0;
    }
    s->lt[layer]++;
    trmv mv;
    mv_init(&mv, s, layer);
    for (uint32_t j = 0; j < n; j++) { /* routed now, counted in the cells of before */
        s->kG[s->x[b + le[j]].cell] += 1;
        TR_PREFETCH(s->lanes + (b + le[j]) * TR_ROW); /* (tracked_set's rows, */
        TR_PREFETCH(s->tn + b + le[j]); /* asked for while the last visit's learn) */
    }
    learn_pending(s, layer); /* (this visit's alone) */
    /* history events: routed now, at the last visit, 16 visits ago, each
     * once (marked in emark, without a branch: the sets overlap by chance) */
    uint32_t nev = 0, nold = s->un[layer];
    uint16_t *us = s->uset + b, *tk = s->tk, *ev = s->ev;
    uint32_t *emark = s->emark, stamp = s->stamp;
    for (uint32_t j = 0; j < n; j++)
        ev_add(ev, emark, stamp, le[j], &nev);
    uint32_t nr = nev; /* the routed set's events come first */
    for (uint32_t back = 1; back <= TR_W; back += TR_W - 1) {
        size_t ri = (size_t)layer * TR_RING + (V - back) % TR_RING;
        if (V <= back || s->ring_v[ri] != V - back)
            continue;
        const uint16_t *set = s->ring + ri * E;
        for (uint32_t i = 0; i < s->ring_n[ri]; i++)
            ev_add(ev, emark, stamp, set[i], &nev);
    }
    uint32_t ntk = tracked_set(s, layer, le, n, tk);
    /* the bins moved: the last visit's tracked experts, then this one's,
     * each once and none of the events' (moved with their history) */
    uint16_t *bm = ev + nev; /* (the scratch past the events) */
    uint32_t nbm = 0;
    for (uint32_t i = 0; i < nold; i++) {
        uint32_t e = us[i];
        bm[nbm] = (uint16_t)e;
        nbm += emark[e] != stamp;
        emark[e] = stamp;
    }
    for (uint32_t i = 0; i < ntk; i++) {
        uint32_t e = tk[i];
        bm[nbm] = (uint16_t)e;
        nbm += emark[e] != stamp;
        emark[e] = stamp;
    }
    if (__builtin_expect(mv.fwhere != NULL, 0))
        visit_moves_fol(&mv, ev, nev, nr, (uint32_t)V, nbm, s->qv, s->cbase);
    else
        visit_moves(&mv, ev, nev, nr, (uint32_t)V, nbm, s->qv, s->cbase);
    memcpy(us, tk, ntk * sizeof *us); /* named for the next visit's events */
    s->o.ops += nold + ntk;
    s->un[layer] = ntk;
    s->o.ops += nev + n;
    mv_done(&mv, s);
    tr_end_visit(s, layer);
    return 0;
}

/* id's layer: mostly the step's own, known without a division */
static inline uint32_t tr_layer_of(const trans *s, uint32_t id)
{
    uint32_t E = s->base.env.num_experts;
    return id - s->layer * E < E ? s->layer : id / E;
}

static inline __attribute__((always_inline)) void tr_used(trans *s, uint32_t id)
{
    uint64_t now = *s->base.env.step;
    if (s->last[id] == now)
        return;
    s->last[id] = now;
    uint32_t l = tr_layer_of(s, id), slot = s->base.env.where[id];
    if (!s->asleep[l]) /* (a wake touches them all) */
        ord_touch_any(&s->o, l, slot);
    if (s->fol && (slot = s->fol->env.where[id]) != FERRY_MOE_NONE)
        ord_touch(s->fol_o, l, slot);
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
    if (slot >= p->env.slots || id >= p->env.num_layers * p->env.num_experts)
        return -EINVAL;
    tr_used(s, id);
    uint32_t l = tr_layer_of(s, id);
    ord_file(&s->o, l, slot, id, s->x[id].cell);
    return 0;
}

static void tr_remove(ferry__policy *p, uint32_t slot, uint32_t id, int evicted)
{
    (void)evicted;
    if (slot < p->env.slots)
        ord_unfile(&((trans *)p)->o, tr_layer_of((trans *)p, id), slot);
}

/* layer l's least filed id of o (pinned ones skipped when unpinned_only),
 * NIL when none: the least p, then touched longer ago (keys are unique).
 * The least rank of p over the layer's non-empty cells, then the ids
 * filed in the cells of that rank (mostly one); the next rank only where
 * all of those are pinned */
static uint32_t layer_least(const trans *m, const ferry__policy *p, trord *o, uint32_t l,
                            int unpinned_only)
{
    const uint16_t *cnt = o->cnt + (size_t)l * TR_NCP;
    uint32_t best = NIL, lo = 0, b = l * o->E, at[TR_NCW];
    uint64_t bk = UINT64_MAX;
    if (cnt[m->srt[0]]) { /* (mostly: the least p's cell holds one) rank 0 */
        for (uint32_t i = 0; i < m->nr0; i++)
            if (cnt[m->srt[i]])
                ord_cell_least(o, p, b, m->srt[i], unpinned_only, &best, &bk, m->wide);
        o->ops += m->nr0;
        if (best != NIL || !unpinned_only)
            return best;
        lo = 1;
    }
    for (;;) {
        uint32_t r = least_rank(m->rk, m->wide, cnt, lo, at);
        o->ops += TR_NCW;
        if (r == TR_RK_NONE)
            break;
        for (uint32_t w = 0; w < TR_NCW; w++) /* (which cell first: keys are unique) */
            for (uint32_t k = at[w]; k; k &= k - 1)
                ord_cell_least(o, p, b, (uint16_t)(16 * w + (uint32_t)__builtin_ctz(k) / 2),
                               unpinned_only, &best, &bk, m->wide);
        if (best != NIL || !unpinned_only)
            break;
        lo = r + 1;
    }
    return best;
}

/* the victim of the rule below over a layer's candidates: the least p /
 * d, then the one touched longer ago */
typedef struct trbest {
    uint32_t slot;
    double p, d;
    uint64_t key;
} trbest;

static void best_offer(trbest *b, uint32_t v, double pa, double da, uint64_t key)
{
    if (b->slot != NIL) {
        double lhs = pa * b->d, rhs = b->p * da;
        if (lhs > rhs || (lhs == rhs && key > b->key))
            return;
    }
    b->slot = v;
    b->p = pa;
    b->d = da;
    b->key = key;
}

/* the unpinned resident of p's slots (filed in o) with the least p / d
 * under m's model, then touched longer ago. The layers are offered from
 * the furthest d down, and none is looked at once the best so far is
 * below what any later one could offer (the least P over the nearer d:
 * pmin / d, compared as best_offer does, strictly, so a tie is still
 * looked at): the same victim as offering every layer, whose cached
 * least is mostly of the layer just run, the furthest. */
static uint32_t tr_pick(const trans *m, const ferry__policy *p, trord *o)
{
    uint32_t L = p->env.num_layers;
    trbest b = {NIL, 0, 1, 0};
    ord_flush(o, m->x);
    for (uint32_t i = 0, l = m->layer; i < L; i++, l = l ? l - 1 : L - 1) {
        double d = (double)(L - i); /* (l + L - layer) % L, 0 read as L */
        if (b.slot != NIL && b.p * d < m->pmin * b.d)
            break;
        o->ops++;
        if (o->lgen[l] != m->pgen) {
            o->least[l] = layer_least(m, p, o, l, 0);
            o->lgen[l] = m->pgen;
        }
        uint32_t v = o->least[l]; /* (an id) */
        if (v == NIL || (ferry__pinned(p, o->fs[v]) && (v = layer_least(m, p, o, l, 1)) == NIL))
            continue;
        best_offer(&b, o->fs[v], m->P[o->fc[v]], d, o->key[v]);
    }
    return b.slot;
}

/* the same rule by a scan of every slot, with p from the model's cells:
 * the reference the tests hold the order to (ferry__transition_verify) */
static uint32_t tr_scan_all(const trans *m, const ferry__policy *p, const trord *o)
{
    uint32_t L = p->env.num_layers, E = p->env.num_experts;
    trbest b = {NIL, 0, 1, 0};
    for (uint32_t l = 0; l < L; l++) {
        uint32_t best = NIL;
        double bp = 0;
        uint64_t bk = 0;
        for (uint32_t v = 0; v < p->env.slots; v++) {
            uint32_t id = p->env.occupant[v];
            if (id == FERRY_MOE_NONE || id / E != l || ferry__pinned(p, v))
                continue;
            double pv = m->P[m->x[id].cell];
            if (best == NIL || pv < bp || (pv == bp && o->key[id] < bk)) {
                best = v;
                bp = pv;
                bk = o->key[id];
            }
        }
        if (best == NIL)
            continue;
        uint32_t d = (l + L - m->layer) % L;
        best_offer(&b, best, bp, d ? (double)d : (double)L, bk);
    }
    return b.slot;
}

static int tr_verify_on;
static uint64_t tr_checked, tr_mismatched;

void ferry__transition_verify(int on)
{
    tr_verify_on = on;
    tr_checked = tr_mismatched = 0;
}

void ferry__transition_verified(uint64_t *checked, uint64_t *mismatched)
{
    *checked = tr_checked;
    *mismatched = tr_mismatched;
}

static int tr_choose(const trans *m, const ferry__policy *p, trord *o, uint32_t *slot)
{
    uint32_t v = tr_pick(m, p, o);
    if (tr_verify_on) {
        tr_checked++;
        tr_mismatched += tr_scan_all(m, p, o) != v;
    }
    if (v == NIL)
        return -1;
    *slot = v;
    return 0;
}

static int tr_victim(ferry__policy *p, uint32_t id, int have_free, uint32_t *slot)
{
    (void)id;
    if (have_free)
        return 1;
    trans *s = (trans *)p;
    return tr_choose(s, p, &s->o, slot);
}

const ferry__policy_ops ferry__policy_transition = {
    .name = "transition",
    .describe = "learned same-layer token-to-token transitions, evicting the least p / steps "
                "to use (one of trio's three)",
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
    trord o;
    trans *lead;
} trans_follower;

static int tf_init(ferry__policy *p)
{
    return ord_init(&((trans_follower *)p)->o, &p->env);
}

static void tf_fini(ferry__policy *p)
{
    /* (the lead is destroyed with it, not told: it may be gone already) */
    ord_fini(&((trans_follower *)p)->o);
}

/* (the lead touches its slots: every routed expert is used in the lead) */
static void tf_hit(ferry__policy *p, uint32_t slot, uint32_t id)
{
    (void)p;
    (void)slot;
    (void)id;
}

static int tf_insert(ferry__policy *p, uint32_t slot, uint32_t id, int prefetch)
{
    (void)prefetch;
    trans_follower *f = (trans_follower *)p;
    if (!f->lead || slot >= p->env.slots || id >= p->env.num_layers * p->env.num_experts)
        return -EINVAL;
    uint32_t l = tr_layer_of(f->lead, id);
    ord_file(&f->o, l, slot, id, f->lead->x[id].cell);
    return 0;
}

static void tf_remove(ferry__policy *p, uint32_t slot, uint32_t id, int evicted)
{
    (void)evicted;
    trans_follower *f = (trans_follower *)p;
    if (slot < p->env.slots && f->lead)
        ord_unfile(&f->o, tr_layer_of(f->lead, id), slot);
    else if (slot < p->env.slots)
        ord_unfile(&f->o, id / p->env.num_experts, slot);
}

static int tf_victim(ferry__policy *p, uint32_t id, int have_free, uint32_t *slot)
{
    (void)id;
    if (have_free)
        return 1;
    trans_follower *f = (trans_follower *)p;
    return f->lead ? tr_choose(f->lead, p, &f->o, slot) : -1;
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
    trans *m = (trans *)lead;
    if (m->fol && m->fol != p)
        return -EINVAL; /* one follower a lead */
    if (!f->o.sl && ord_init(&f->o, &p->env) < 0)
        return -ENOMEM;
    f->lead = m;
    m->fol = p;
    m->fol_o = &f->o;
    return 0;
}

long ferry__transition_cells_differ(const ferry__policy *a, const ferry__policy *b)
{
    if (!a || !b || a->ops != &ferry__policy_transition || b->ops != &ferry__policy_transition ||
        a->env.num_layers != b->env.num_layers || a->env.num_experts != b->env.num_experts)
        return -1;
    const trans *x = (const trans *)a, *y = (const trans *)b;
    uint32_t E = a->env.num_experts;
    long d = 0;
    for (uint32_t l = 0; l < a->env.num_layers; l++)
        if (!x->asleep[l] && !y->asleep[l])
            for (size_t i = (size_t)l * E; i < (size_t)(l + 1) * E; i++)
                d += x->x[i].cell != y->x[i].cell;
    return d;
}

long ferry__transition_rows_differ(const ferry__policy *a, const ferry__policy *b)
{
    if (!a || !b || a->ops != &ferry__policy_transition || b->ops != &ferry__policy_transition ||
        a->env.num_layers != b->env.num_layers || a->env.num_experts != b->env.num_experts)
        return -1;
    const trans *x = (const trans *)a, *y = (const trans *)b;
    long d = 0;
    for (size_t i = 0; i < (size_t)a->env.num_layers * a->env.num_experts; i++)
        d += x->An[i] != y->An[i] || x->tn[i] != y->tn[i] ||
             memcmp(x->lanes + i * TR_ROW, y->lanes + i * TR_ROW, TR_ROW * sizeof *x->lanes);
    return d;
}

int ferry__transition_skip(ferry__policy *p, uint64_t visits)
{
    if (!p || p->ops != &ferry__policy_transition || visits % TR_RING)
        return -EINVAL;
    trans *s = (trans *)p;
    uint32_t L = p->env.num_layers, E = p->env.num_experts;
    for (uint32_t l = 0; l < L; l++) {
        if (!s->V[l])
            continue;
        s->V[l] += visits;
        s->lv[l] += s->lv[l] ? visits : 0;
        for (uint32_t i = 0; i < TR_RING; i++)
            s->ring_v[(size_t)l * TR_RING + i] += s->ring_v[(size_t)l * TR_RING + i] ? visits : 0;
        for (uint32_t e = 0; e < E; e++)
            s->x[(size_t)l * E + e].hv = (uint32_t)(s->x[(size_t)l * E + e].hv + visits);
    }
    return 0;
}

uint32_t ferry__transition_clock(ferry__policy *p, uint32_t to)
{
    if (p->ops != &ferry__policy_transition)
        return 0;
    trord *o = &((trans *)p)->o;
    o->clock = to > o->clock ? (to < TR_KEY_TOP ? to : TR_KEY_TOP) : o->clock;
    return o->clock;
}

uint64_t ferry__transition_ops(const ferry__policy *p)
{
    if (p->ops == &ferry__policy_transition)
        return ((const trans *)p)->o.ops;
    if (p->ops == &ferry__policy_transition_follower)
        return ((const trans_follower *)p)->o.ops;
    return 0;
}
