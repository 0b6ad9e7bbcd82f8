/*
 * policy_routing.c - "routing": an online approximation of Belady's MIN
 * built from the structure of MoE routing.
 *
 * Belady evicts the resident expert whose next use is furthest away. This
 * policy estimates, for every expert, the probability lambda that it is
 * routed at its layer's next turn, predicts its next use at
 *     (token of its layer's next turn + 1/lambda - 1) * num_layers + layer
 * (the mean of a geometric wait, in steps) and evicts the furthest.
 *
 * Measuring in steps is what global LRU gets backwards: layers run in a
 * cycle, so while layer l runs, the experts layer l+1 used at the previous
 * token are the OLDEST in LRU order and yet the soonest needed.
 *
 * lambda is learned online, not assumed. Each expert of a layer sits in one
 * cell of a small table of routing features:
 *   - whether it was routed at its layer's last turn (next-token reuse);
 *   - how many of the 7 turns before that routed it (burst reuse within 8
 *     tokens), or, out of that window, whether its last route is less
 *     than COLD turns old (recency beyond the burst);
 *   - its long-run share of the layer's routes, in half-octaves around
 *     the uniform share (popularity skew);
 *   - whether it is hinted for its layer's next turn: a prefetch names it
 *     (the engine's own prediction, often from the hidden state of the
 *     layer before, i.e. cross-layer correlation).
 * A learned cross-layer partner table (space-saving counts of (expert at
 * l-1, expert at l) pairs, hinting each routed expert's strongest partner)
 * was measured and dropped: on the generator's traces (cross-layer lift
 * 1.4-2.4x) it moved hit rates by at most 0.02 points at 12.5% and 25% of
 * all experts, and cost about a third of the policy's time per step.
 * At every turn of a layer, each of its experts is one opportunity for its
 * cell and each routed one a use; lambda(cell) = uses / opportunities.
 * Counting opportunities costs one add per cell per turn: the table keeps
 * how many experts each layer has in each cell, and an expert changes cell
 * only when routed, when one of its routes leaves the last turn, the
 * 8-turn window or the COLD horizon, or when hinted - events found from
 * the last COLD+1 routed sets of its layer, so each route costs O(1)
 * amortised events.
 *
 * Two values are cached because they drift slowly and dividing for every
 * event would dominate a step: each cell's expected wait (refreshed every
 * REFRESH turns) and each expert's popularity bucket (refreshed when it
 * is routed).
 *
 * Within a layer, every expert's next turn is the same token, so experts
 * are ordered by their cell's wait alone: each (layer, cell) keeps a FIFO
 * list of its resident slots, and each layer a bitmap over cell ranks
 * (cells sorted by wait, refreshed with the waits) of its non-empty
 * lists, so moving a slot between cells is O(1) and a layer's candidate
 * is the head of its first non-empty list by rank (the slot that entered
 * that cell first: LRU order within a cell). Across layers a tournament
 * tree over the layer candidates, each with its layer's next-turn offset
 * added, names the victim: O(log num_layers) per candidate change (once
 * per end_step, after all the moves of its layer's experts), no scan
 * of the slots (a pinned best candidate - only a prefetch can leave one
 * there - falls back to every layer's first unpinned one). A routed
 * expert is off its list from its hit or insert until end_step re-lists
 * it, so no expert of the current step is ever a candidate.
 * ferry__routing_check() walks all of it for the tests.
 *
 * A follower (auto's shadow cache, ferry__routing_follow) orders another
 * set of slots by its leader's model (tables and features depend on the
 * routes alone): it keeps only its lists and tournament, which the leader
 * updates whenever an expert resident in the follower changes cell, and
 * a copy of the waits and ranks from each refresh. The leader's end_step
 * runs before the follower's step of the same layer.
 *
 * Tokens are 64-bit (ferry__tok): a decode server passes 2^32 tokens
 * within months, and the features compare tokens and key the ring by
 * them. The state's layout is in routing_state.h, shared with the test
 * seams (policy_routing_check.c: the structure checker, the token jump).
 */
#include <errno.h>
#include <math.h>
#include <string.h>

#include "moe/routing_state.h"


/* the lists and the tournament, a follower's own */
static void own_fini(routing *s)
{
    ferry__free(s->lk);
    ferry__free(s->scell);
    ferry__free(s->ht);
    ferry__free(s->bm);
    ferry__free(s->seg);
    ferry__free(s->lval);
    ferry__free(s->ltop);
    ferry__free(s->parked);
}

static void rt_fini(ferry__policy *p)
{
    routing *s = (routing *)p;
    own_fini(s);
    if (s->follower)
        return; /* the model is the leader's (which either may outlive) */
    ferry__free(s->ccbm);
    ferry__free(s->x);
    ferry__free(s->cell_count);
    ferry__free(s->lturns);
    ferry__free(s->routes);
    ferry__free(s->turn_tok);
    ferry__free(s->ring);
    ferry__free(s->ring_n);
    ferry__free(s->ring_tok);
    ferry__free(s->asleep);
}

static uint16_t cell_of(int last, uint32_t win, uint32_t pop, int hinted)
{
    return (uint16_t)((((uint32_t)last * WINV + win) * POP_B + pop) * 2 + (uint32_t)hinted);
}

/* fold the counts held since the last refresh into opps, and restart */
static void opps_fold(routing *s)
{
    for (uint32_t l = 0; l < s->base.env.num_layers; l++) {
        uint64_t *nz = s->ccbm + (size_t)l * BMW; /* (the empty cells' bits go now) */
        const uint16_t *cc = s->cell_count + (size_t)l * CELLS;
        for (uint32_t w = 0; w < BMW; w++)
            for (uint64_t b = nz[w]; b; b &= b - 1) {
                uint32_t c = w * 64 + (uint32_t)__builtin_ctzll(b);
                s->opps[c] += (uint64_t)cc[c] * s->lturns[l];
                nz[w] &= ~((uint64_t)(cc[c] == 0) << (c % 64));
            }
        s->lturns[l] = 0;
    }
    for (uint32_t c = 0; c < CELLS; c++)
        s->opps[c] -= s->corr[c];
    memset(s->corr, 0, sizeof s->corr);
}

/* carry every layer's bitmap from the ranks old_at to s->rank, where
 * only ranks lo..hi changed cells (a permutation of those cells) */
static void rerank(routing *s, const uint16_t *old_at, uint32_t lo, uint32_t hi)
{
    uint32_t w0 = lo / 64, w1 = hi / 64;
    uint64_t in[BMW];
    for (uint32_t w = 0; w < BMW; w++) { /* the bits of ranks lo..hi */
        uint64_t m = ~0ull;
        if (w < w0 || w > w1)
            m = 0;
        if (w == w0)
            m &= ~0ull << (lo % 64);
        if (w == w1)
            m &= ~0ull >> (63 - hi % 64);
        in[w] = m;
    }
    for (uint32_t l = 0; l < s->base.env.num_layers; l++) {
        uint64_t *bm = s->bm + (size_t)l * BMW, nb[BMW];
        for (uint32_t w = 0; w < BMW; w++)
            nb[w] = bm[w] & ~in[w];
        for (uint32_t w = w0; w <= w1; w++)
            for (uint64_t b = bm[w] & in[w]; b; b &= b - 1) {
                uint32_t nr = s->rank[old_at[w * 64 + (uint32_t)__builtin_ctzll(b)]];
                nb[nr / 64] |= 1ull << (nr % 64);
            }
        memcpy(bm, nb, sizeof nb);
    }
}

/* recompute the waits and the cells' rank order, and carry every layer's
 * bitmap over to the new ranks. The order drifts little between refreshes,
 * so an insertion sort of the previous order costs O(CELLS + inversions);
 * with the bitmaps, O(L * non-empty lists) every REFRESH turns. */
static void refresh_waits(routing *s)
{
    uint16_t old_at[CELLS];
    opps_fold(s);
    for (uint32_t c = 0; c < CELLS; c++)
        s->wait[c] = ((double)s->opps[c] + 1.0) / ((double)s->uses[c] + 0.125) - 1.0;
    memcpy(old_at, s->at_rank, sizeof old_at);
    for (uint32_t r = 1; r < CELLS; r++) {
        uint16_t c = s->at_rank[r];
        uint32_t i = r;
        for (; i > 0 && rank_before(s, c, s->at_rank[i - 1]); i--)
            s->at_rank[i] = s->at_rank[i - 1];
        s->at_rank[i] = c;
    }
    uint32_t lo = CELLS, hi = 0; /* the ranks whose cell changed */
    for (uint32_t r = 0; r < CELLS; r++) {
        if (s->at_rank[r] != old_at[r]) {
            lo = r < lo ? r : lo;
            hi = r;
        }
        s->rank[s->at_rank[r]] = (uint16_t)r;
    }
    int same = lo > hi;
    if (!same)
        rerank(s, old_at, lo, hi);
    if (s->fol) { /* the follower's lists, ranked by the same waits */
        memcpy(s->fol->wait, s->wait, sizeof s->wait);
        memcpy(s->fol->rank, s->rank, sizeof s->rank);
        memcpy(s->fol->at_rank, s->at_rank, sizeof s->at_rank);
        if (!same)
            rerank(s->fol, old_at, lo, hi);
    }
}

static void seg_rebuild(routing *s);

/* the lists and the tournament over p's slots, all empty */
static int own_init(routing *s)
{
    const ferry__policy *p = &s->base;
    uint32_t n = p->env.slots, L = p->env.num_layers;
    s->lk = ferry__malloc((size_t)n * 2 * sizeof(uint32_t));
    s->scell = ferry__malloc((size_t)n * sizeof(uint16_t));
    s->ht = ferry__malloc((size_t)L * CELLS * 2 * sizeof(uint32_t));
    s->bm = ferry__calloc((size_t)L * BMW, sizeof(uint64_t));
    /* a slot is parked at most twice a round: once, and once more after
     * the planner evicted it parked (a hinted expert, when nothing else
     * could go) and a prefetch refilled it */
    s->parked = ferry__malloc((size_t)2 * n * sizeof(uint32_t));
    for (s->seg_p = 1; s->seg_p < L; s->seg_p *= 2)
        ;
    s->seg = ferry__malloc(2 * (size_t)s->seg_p * sizeof(uint32_t));
    s->lval = ferry__malloc((size_t)L * sizeof(double));
    s->ltop = ferry__malloc((size_t)L * sizeof(uint32_t));
    if (!s->seg || !s->lval || !s->ltop || !s->parked || !s->lk || !s->scell || !s->ht || !s->bm)
        return -ENOMEM;
    /* every list is allocated whole: an insert never fails half-way
     * through a step */
    memset(s->scell, 0xff, (size_t)n * sizeof(uint16_t));
    memset(s->ht, 0xff, (size_t)L * CELLS * 2 * sizeof(uint32_t));
    return 0;
}

static int rt_init(ferry__policy *p)
{
    routing *s = (routing *)p;
    uint32_t L = p->env.num_layers, E = p->env.num_experts;
    size_t ids = (size_t)L * E;
    if (E > FERRY_MOE_MAX_EXPERTS) /* (16-bit cell counts and ring entries) */
        return -EINVAL;
    int own = own_init(s);
    s->ccbm = ferry__calloc((size_t)L * BMW, sizeof(uint64_t));
    s->x = ferry__calloc(ids, sizeof(xinfo));
    s->cell_count = ferry__calloc((size_t)L * CELLS, sizeof *s->cell_count);
    s->lturns = ferry__calloc(L, sizeof(uint32_t));
    s->routes = ferry__calloc(L, sizeof(uint64_t));
    s->turn_tok = ferry__malloc((size_t)L * sizeof *s->turn_tok);
    s->ring_cap = E < RING_CAP ? E : RING_CAP;
    s->ring = ferry__malloc((size_t)L * RING * s->ring_cap * sizeof *s->ring);
    s->ring_n = ferry__calloc((size_t)L * RING, sizeof(uint32_t));
    s->ring_tok = ferry__malloc((size_t)L * RING * sizeof *s->ring_tok);
    s->asleep = ferry__calloc(L, 1);
    if (own < 0 || !s->ccbm || !s->x || !s->cell_count || !s->lturns || !s->routes ||
        !s->turn_tok || !s->ring || !s->ring_n || !s->ring_tok || !s->asleep) {
        rt_fini(p);
        return -ENOMEM;
    }
    for (uint32_t c = 0; c < CELLS; c++)
        s->at_rank[c] = s->rank[c] = (uint16_t)c;
    memset(s->turn_tok, 0xff, (size_t)L * sizeof *s->turn_tok); /* TOK_NONE */
    memset(s->ring_tok, 0xff, (size_t)L * RING * sizeof *s->ring_tok);
    /* fault it in now (its contents are read only once written): a
     * write per page, not a memset of the whole */
    for (size_t b = 0; b < (size_t)L * RING * s->ring_cap * sizeof *s->ring; b += 4096)
        ((volatile uint8_t *)s->ring)[b] = 0;
    /* every expert starts never routed, unpopular, unhinted */
    uint16_t c0 = cell_of(0, WIN + 1, 0, 0);
    for (uint32_t l = 0; l < L; l++) {
        s->cell_count[(size_t)l * CELLS + c0] = (uint16_t)E;
        s->ccbm[(size_t)l * BMW + c0 / 64] |= 1ull << (c0 % 64);
    }
    refresh_waits(s);
    seg_rebuild(s);
    for (size_t i = 0; i < ids; i++) {
        s->x[i].last_tok = TOK_NONE;
        s->x[i].hint_tok = TOK_NONE;
        s->x[i].cell = c0;
    }
    return 0;
}

int ferry__routing_follow(ferry__policy *p, ferry__policy *lead)
{
    routing *s = (routing *)p, *l = (routing *)lead;
    if (l->lead || l->fol || p->env.num_layers != lead->env.num_layers ||
        p->env.num_experts != lead->env.num_experts)
        return -EINVAL;
    s->follower = 1; /* from here on, fini frees its own arrays only */
    if (own_init(s) < 0) {
        own_fini(s);
        return -ENOMEM;
    }
    /* the model: the leader's */
    s->x = l->x;
    s->cell_count = l->cell_count;
    s->ccbm = l->ccbm;
    s->lturns = l->lturns;
    s->routes = l->routes;
    s->turn_tok = l->turn_tok;
    s->ring = l->ring;
    s->ring_n = l->ring_n;
    s->ring_tok = l->ring_tok;
    s->ring_cap = l->ring_cap;
    memcpy(s->wait, l->wait, sizeof s->wait);
    memcpy(s->rank, l->rank, sizeof s->rank);
    memcpy(s->at_rank, l->at_rank, sizeof s->at_rank);
    s->lead = l;
    s->follower = 1;
    l->fol = s;
    seg_rebuild(s);
    return 0;
}

/* the (last turn, window) part of a cell, times POP_B * 2, for each
 * history byte a != 0 (bit d: routed d turns back): whether it was routed
 * at the last turn, and at how many of the 7 before (at most 7 < WIN) */
#define HB_PC(a) (((a) >> 1 & 1) + ((a) >> 2 & 1) + ((a) >> 3 & 1) + ((a) >> 4 & 1) + \
                  ((a) >> 5 & 1) + ((a) >> 6 & 1) + ((a) >> 7 & 1))
#define HB(a) (((a) & 1) * WINV + HB_PC(a)) * POP_B * 2
#define HB4(a) HB(a), HB((a) + 1), HB((a) + 2), HB((a) + 3)
#define HB16(a) HB4(a), HB4((a) + 4), HB4((a) + 8), HB4((a) + 12)
#define HB64(a) HB16(a), HB16((a) + 16), HB16((a) + 32), HB16((a) + 48)
static const uint16_t hist_base[256] = {HB64(0), HB64(64), HB64(128), HB64(192)};

/* the cell of an expert after its layer's turn at token `tok`: cell_of()
 * of its features, by table */
static inline uint16_t compute_cell(const xinfo *xi, ferry__tok tok)
{
    ferry__tok last = xi->last_tok, d = tok - last;
    uint32_t a = 0, base;
    /* (never routed: bits is 0) */
    if (tok >= last && d < 8)
        a = (xi->bits << d) & 0xffu;
    if (a)
        base = hist_base[a];
    else /* out of the window: how long? */
        base = (last != TOK_NONE && d < COLD ? WIN : WIN + 1) * POP_B * 2;
    return (uint16_t)(base + (uint32_t)xi->pop * 2 + (xi->hint_tok == tok + 1));
}

/* ---- per-layer lists by cell (the candidate: layer_top, routing_state.h) ----
 * A layer's eviction candidate is the head of its non-empty list of the
 * lowest rank (the longest expected wait): the slot that entered that
 * cell first. Moving a slot between cells is O(1): unlink, append, and a
 * bit set or cleared when a list empties or fills. A routed expert is
 * unlisted from its hit (or insert) until end_step lists it again, so the
 * current step's experts are never candidates; only a prefetched one can
 * be listed and pinned. */
static void unlist(routing *s, uint32_t m, uint32_t slot)
{
    uint16_t c = s->scell[slot];
    if (c == CELL_NONE)
        return;
    size_t lc = (size_t)m * CELLS + c;
    uint32_t a = s->lk[2 * slot + 1], b = s->lk[2 * slot];
    if (a != NONE)
        s->lk[2 * a] = b;
    else
        s->ht[2 * lc] = b;
    if (b != NONE)
        s->lk[2 * b + 1] = a;
    else
        s->ht[2 * lc + 1] = a;
    s->scell[slot] = CELL_NONE;
    if (s->ht[2 * lc] == NONE) {
        uint32_t r = s->rank[c];
        s->bm[(size_t)m * BMW + r / 64] &= ~(1ull << (r % 64));
    }
}

static void enlist(routing *s, uint32_t m, uint32_t slot, uint16_t c)
{
    size_t lc = (size_t)m * CELLS + c;
    uint32_t t = s->ht[2 * lc + 1];
    s->lk[2 * slot + 1] = t;
    s->lk[2 * slot] = NONE;
    if (t != NONE)
        s->lk[2 * t] = slot;
    else {
        s->ht[2 * lc] = slot;
        uint32_t r = s->rank[c];
        s->bm[(size_t)m * BMW + r / 64] |= 1ull << (r % 64);
    }
    s->ht[2 * lc + 1] = slot;
    s->scell[slot] = c;
}

/* ---- the tournament over layers ----
 * A layer's value is its candidate's predicted use, in steps from the start
 * of the current token: (its next turn - token) * L + layer + wait * L. It
 * changes when the layer's candidate changes, when the layer runs (its next
 * turn moves a token on), when the waits are refreshed, and when the token
 * changes (every layer's offset drops by L: a rebuild, O(L) once per token,
 * O(1) amortised per step). */
static int seg_better(const routing *s, uint32_t a, uint32_t b)
{
    if (b == UINT32_MAX)
        return a != UINT32_MAX;
    if (a == UINT32_MAX)
        return 0;
    if (s->lval[a] != s->lval[b])
        return s->lval[a] > s->lval[b];
    return s->ltop[a] < s->ltop[b];
}

static void seg_pull(routing *s, size_t i)
{
    uint32_t a = s->seg[2 * i], b = s->seg[2 * i + 1];
    s->seg[i] = seg_better(s, a, b) ? a : b;
}

static void seg_update(routing *s, uint32_t m)
{
    uint32_t c = layer_top_cell(s, m);
    double *lval = s->lval;
    uint32_t *ltop = s->ltop, *seg = s->seg;
    if (c == CELL_NONE) {
        lval[m] = -INFINITY;
        ltop[m] = NONE;
    } else {
        uint32_t L = s->base.env.num_layers;
        ferry__tok tok = *s->base.env.token;
        uint32_t off = s->turn_tok[m] != TOK_NONE && s->turn_tok[m] >= tok ? 1 : 0;
        lval[m] = (double)off * L + m + s->wait[c] * L;
        ltop[m] = s->ht[2 * ((size_t)m * CELLS + c)];
    }
    size_t i = s->seg_p + m;
    seg[i] = ltop[m] != NONE ? m : UINT32_MAX;
    /* seg_pull() up the path; a node whose winner stays another layer:
     * nothing above changes */
    for (i /= 2; i >= 1; i /= 2) {
        uint32_t a = seg[2 * i], b = seg[2 * i + 1], w;
        if (b == UINT32_MAX) /* seg_better(a, b) */
            w = a;
        else if (a == UINT32_MAX)
            w = b;
        else if (lval[a] != lval[b])
            w = lval[a] > lval[b] ? a : b;
        else
            w = ltop[a] < ltop[b] ? a : b;
        if (w == seg[i] && w != m)
            break;
        seg[i] = w;
    }
}

static void seg_rebuild(routing *s)
{
    uint32_t L = s->base.env.num_layers;
    for (uint32_t i = 0; i < s->seg_p; i++) {
        if (i < L) {
            s->lval[i] = layer_value(s, i);
            s->ltop[i] = layer_top(s, i);
        }
        s->seg[s->seg_p + i] = i < L && s->ltop[i] != NONE ? i : UINT32_MAX;
    }
    for (size_t i = s->seg_p - 1; i >= 1; i--)
        seg_pull(s, i);
    s->seg_tok = *s->base.env.token;
}

/* list slot in cell c (CELL_NONE: unlist it), keeping the tournament */
static void place(routing *s, uint32_t m, uint32_t slot, uint16_t c)
{
    if (s->scell[slot] == c && c != CELL_NONE) {
        /* same cell: a routed expert goes to the back of its list */
        if (s->lk[2 * slot] == NONE)
            return;
    }
    uint32_t old_top = s->ltop[m];
    unlist(s, m, slot);
    if (c != CELL_NONE)
        enlist(s, m, slot, c);
    /* most moves happen below the candidate: the layer's value stands
     * unless the candidate itself moved or the slot went to a list ranked
     * before the candidate's (appended to the candidate's own list, it
     * is behind the candidate) */
    if (slot != old_top &&
        (c == CELL_NONE || (old_top != NONE && s->rank[c] >= s->rank[s->scell[old_top]])))
        return;
    seg_update(s, m);
}

/* move a resident slot to the back of list c (from its list, or from
 * none), over a layer's list ends ht and rank bitmap bm, leaving the
 * tournament to the caller: end_step updates its layer's leaf once,
 * after all its moves (the tree is a function of the leaves, so one
 * update gives what one per move would) */
static inline __attribute__((always_inline)) void list_move(uint32_t *lk, uint16_t *scell,
                                                            uint32_t *ht, uint64_t *bm,
                                                            const uint16_t *rank, uint32_t slot,
                                                            uint16_t c)
{
    uint32_t *l = lk + 2 * (size_t)slot, *h;
    uint16_t sc = scell[slot];
    if (sc == c && l[0] == NONE)
        return; /* at the back already */
    if (sc != CELL_NONE) { /* unlist() */
        uint32_t a = l[1], b = l[0];
        h = ht + 2 * (size_t)sc;
        if (a != NONE)
            lk[2 * (size_t)a] = b;
        else
            h[0] = b;
        if (b != NONE)
            lk[2 * (size_t)b + 1] = a;
        else
            h[1] = a;
        if ((a & b) == NONE) { /* both ends: the list is empty */
            uint32_t r = rank[sc];
            bm[r / 64] &= ~(1ull << (r % 64));
        }
    }
    h = ht + 2 * (size_t)c; /* enlist() */
    uint32_t t = h[1];
    l[1] = t;
    l[0] = NONE;
    if (t != NONE) {
        lk[2 * (size_t)t] = slot;
    } else {
        h[0] = slot;
        uint32_t r = rank[c];
        bm[r / 64] |= 1ull << (r % 64);
    }
    h[1] = slot;
    scell[slot] = c;
}

/* the leader moved id of layer m to cell c: so does its follower, if id
 * is listed there (an unlisted one is listed at the end of the follower's
 * step). In the leader's end_step (raw) its leaf is updated at the end. */
static __attribute__((noinline)) void follow(routing *f, uint32_t m, uint32_t id, uint16_t c,
                                             int raw)
{
    uint32_t slot = f->base.env.where[id];
    if (slot == FERRY_MOE_NONE || f->scell[slot] == CELL_NONE)
        return;
    if (!raw) {
        place(f, m, slot, c);
        return;
    }
    list_move(f->lk, f->scell, f->ht + (size_t)m * CELLS * 2, f->bm + (size_t)m * BMW, f->rank,
              slot, c);
    f->stale = 1;
}

/* id of layer m leaves cell o for c: the layer's counts (see corr) */
static inline void count_move(routing *s, uint32_t m, uint16_t o, uint16_t c)
{
    uint16_t *cc = s->cell_count + (size_t)m * CELLS;
    uint64_t *nz = s->ccbm + (size_t)m * BMW;
    uint64_t t = s->lturns[m];
    s->corr[o] -= t; /* (unsigned: wraps, and the fold wraps back) */
    s->corr[c] += t;
    cc[o]--; /* (no branch on emptying: the fold drops an empty cell's bit) */
    cc[c]++;
    nz[c / 64] |= 1ull << (c % 64);
}

/* move id (of layer m) to the cell it is in after its layer's turn at
 * tok, keeping the tournament (a hint's move, outside end_step) */
static void recell(routing *s, uint32_t id, uint32_t m, ferry__tok tok)
{
    uint16_t c = compute_cell(&s->x[id], tok), o = s->x[id].cell;
    if (c == o)
        return; /* same cell, same key: nothing to do */
    count_move(s, m, o, c);
    s->x[id].cell = c;
    if (__builtin_expect(s->fol != NULL, 0))
        follow(s->fol, m, id, c, 0);
    uint32_t slot = s->base.env.where[id];
    if (slot != FERRY_MOE_NONE)
        place(s, m, slot, c);
}

/* end_step's view of its layer, in locals: each move of an expert of
 * the layer is inlined against it (no pointer reloaded per move) */
typedef struct stepv {
    xinfo *x;               /* the layer's experts */
    const uint32_t *where;  /* the layer's experts' slots */
    uint16_t *cc;           /* the layer's cell counts */
    uint64_t *nz, *corr, lt;
    uint32_t *lk, *ht;      /* slot links; the layer's list ends */
    uint16_t *scell;
    uint64_t *bm;           /* the layer's rank bitmap */
    const uint16_t *rank;
    routing *fol;
    ferry__tok tok;
    uint32_t m, base;
} stepv;

static void stepv_init(stepv *v, routing *s, uint32_t m, ferry__tok tok)
{
    uint32_t E = s->base.env.num_experts;
    v->base = m * E;
    v->x = s->x + v->base;
    v->where = s->base.env.where + v->base;
    v->cc = s->cell_count + (size_t)m * CELLS;
    v->nz = s->ccbm + (size_t)m * BMW;
    v->corr = s->corr;
    v->lt = s->lturns[m];
    v->lk = s->lk;
    v->ht = s->ht + (size_t)m * CELLS * 2;
    v->scell = s->scell;
    v->bm = s->bm + (size_t)m * BMW;
    v->rank = s->rank;
    /* the follower moves with the leader only where it lists slots of
     * this layer (auto's shadow: on sampled layers); none listed now,
     * none will be in end_step (it only relists listed ones) */
    v->fol = NULL;
    if (s->fol)
        for (uint32_t w = 0; w < BMW; w++)
            if (s->fol->bm[(size_t)m * BMW + w])
                v->fol = s->fol;
    v->m = m;
    v->tok = tok;
}

/* the move of expert e of the layer to cell c, the cell it is in after
 * the turn at v->tok: recell()'s, but a routed one moves to the back of
 * its cell even when its cell stays, and the tournament is left to
 * end_step */
static inline __attribute__((always_inline)) void step_move(stepv *v, uint32_t e, uint16_t c,
                                                            int routed)
{
    xinfo *xi = &v->x[e];
    uint16_t o = xi->cell;
    if (c != o) {
        v->corr[o] -= v->lt; /* count_move() */
        v->corr[c] += v->lt;
        v->cc[o]--;
        v->cc[c]++;
        v->nz[c / 64] |= 1ull << (c % 64);
        xi->cell = c;
        if (__builtin_expect(v->fol != NULL, 0))
            follow(v->fol, v->m, v->base + e, c, 1);
    } else if (!routed) {
        return; /* same cell, same key: nothing to do */
    }
    uint32_t slot = v->where[e];
    if (slot == FERRY_MOE_NONE)
        return;
    list_move(v->lk, v->scell, v->ht, v->bm, v->rank, slot, c);
}

static void rt_hit(ferry__policy *p, uint32_t slot, uint32_t id)
{
    /* stays listed: pinned, it is never a victim (rt_victim parks it if it
     * comes to the top), and end_step moves it to its new cell */
    (void)p;
    (void)slot;
    (void)id;
}

/* list the parked slots again: under their expert's cell, or not at all
 * when they left (forgotten) or are listed already (routed and re-keyed).
 * Those of layer `raw` (end_step's, NONE for none) leave the tournament
 * to the caller. */
static void unpark(routing *s, uint32_t raw)
{
    for (uint32_t i = 0; i < s->n_parked; i++) {
        uint32_t v = s->parked[i], id = s->base.env.occupant[v];
        if (id == FERRY_MOE_NONE || s->scell[v] != CELL_NONE)
            continue;
        uint32_t m = id / s->base.env.num_experts;
        if (m == raw)
            enlist(s, m, v, s->x[id].cell);
        else
            place(s, m, v, s->x[id].cell);
    }
    s->n_parked = 0;
}

static void hint(routing *s, uint32_t id, ferry__tok tok);

static int rt_insert(ferry__policy *p, uint32_t slot, uint32_t id, int prefetch)
{
    routing *s = (routing *)p;
    uint32_t m = id / p->env.num_experts;
    /* listed under its cell; a routed expert is listed in end_step. A
     * prefetched one was predicted by the engine for its layer's next
     * turn: hinted, so it is not the first victim of the steps before */
    if (prefetch) {
        ferry__tok tok = *p->env.token;
        ferry__tok next = s->turn_tok[m] == TOK_NONE || s->turn_tok[m] < tok ? tok : tok + 1;
        place(s, m, slot, s->x[id].cell);
        if (p->env.where[id] == slot)
            hint(s, id, next);
        return 0;
    }
    /* routed now: pinned for this step, listed in end_step */
    place(s, m, slot, CELL_NONE);
    return 0;
}

static void rt_remove(ferry__policy *p, uint32_t slot, uint32_t id, int evicted)
{
    (void)evicted;
    place((routing *)p, id / p->env.num_experts, slot, CELL_NONE);
}

static int rt_victim(ferry__policy *p, uint32_t id, int have_free, uint32_t *slot)
{
    routing *s = (routing *)p;
    (void)id;
    if (have_free)
        return 1;
    ferry__tok tok = *p->env.token;
    if (s->seg_tok != tok)
        seg_rebuild(s);
    if (s->n_parked && s->park_step != *p->env.pin_now)
        unpark(s, NONE);
    /* the furthest predicted use; a pinned one (an expert of this step, or
     * named by the prefetch in progress) is parked off its list until the
     * step is over, and the next best is asked: O(log L) per pinned slot,
     * at most the step's experts */
    for (;;) {
        uint32_t m = s->seg[1];
        if (m == UINT32_MAX)
            return -1;
        uint32_t v = s->ltop[m];
        if (!ferry__pinned(p, v)) {
            *slot = v;
            return 0;
        }
        place(s, m, v, CELL_NONE);
        s->parked[s->n_parked++] = v;
        s->park_step = *p->env.pin_now;
    }
}

static const uint16_t *ring_set(const routing *s, uint32_t layer, ferry__tok tok, uint32_t *n)
{
    size_t r = (size_t)layer * RING + tok % RING;
    if (s->ring_tok[r] != tok) {
        *n = 0;
        return NULL;
    }
    *n = s->ring_n[r];
    return s->ring + r * s->ring_cap;
}

/* id (of layer m) is expected at m's next turn: count it there in its
 * hinted cell. Only a turn at token `tok` can be hinted (the layer's last
 * turn must be tok - 1, so its cell can be re-read as of that turn). */
static void hint(routing *s, uint32_t id, ferry__tok tok)
{
    uint32_t E = s->base.env.num_experts, m = id / E;
    if (s->x[id].hint_tok == tok || tok == 0)
        return;
    ferry__tok ptok = s->turn_tok[m] == TOK_NONE ? tok - 1 : s->turn_tok[m];
    if (ptok + 1 != tok)
        return;
    s->x[id].hint_tok = tok;
    recell(s, id, m, ptok);
    /* it leaves the hinted cell at its turn: make sure that turn revisits
     * it (the previous turn's ring set holds it, or gets it) */
    size_t rr = (size_t)m * RING + ptok % RING;
    if (s->ring_tok[rr] == ptok && s->ring_n[rr] < s->ring_cap) {
        uint16_t *set = s->ring + rr * s->ring_cap, e = (uint16_t)(id - m * E);
        for (uint32_t i = 0; i < s->ring_n[rr]; i++)
            if (set[i] == e)
                return;
        set[s->ring_n[rr]++] = e;
    }
}

/* end_step's learning of the turn (its first ensure): the turn as an
 * opportunity for every expert of the layer (counted without visiting the
 * cells: see corr), a use for each routed one, counted in the cells they
 * were in before it; the waits refreshed when it is time */
static void learn_turn(routing *s, uint32_t layer, const uint32_t *ids, uint32_t n)
{
    s->lturns[layer]++;
    for (uint32_t j = 0; j < n; j++)
        s->uses[s->x[ids[j]].cell] += 1;
    /* early on (turns 16, 32, .., REFRESH) the waits move fast: refresh
     * at each doubling, then every REFRESH turns */
    ++s->turns;
    if (s->turns % REFRESH == 0 || (s->turns >= 16 && s->turns < REFRESH && !(s->turns & (s->turns - 1)))) {
        refresh_waits(s);
        seg_rebuild(s);
        if (s->fol)
            seg_rebuild(s->fol);
    }
}

/* the routed experts' features after the turn at tok, and their cells
 * (not when the layer sleeps: moves 0) */
static void routed_step(routing *s, stepv *v, const uint32_t *ids, uint32_t n, int moves)
{
    /* popularity bucket floor(2 log2(share * E)) + POP_B/2, clamped: the
     * number of half-octave thresholds the expert's share of its layer's
     * routes reaches, by binary search (3 compares against the thresholds
     * times the layer's routes, multiplied once per step). Refreshed when
     * it is routed: shares drift slowly. */
    static const double thr[POP_B - 1] = {0.35355339, 0.5, 0.70710678, 1.0,
                                          1.41421356, 2.0, 2.82842712};
    ferry__tok tok = v->tok;
    double routes = (double)(s->routes[v->m] += n), tr[POP_B - 1];
    for (uint32_t k = 0; k < POP_B - 1; k++)
        tr[k] = thr[k] * routes;
    double E = (double)s->base.env.num_experts;
    for (uint32_t j = 0; j < n; j++) {
        uint32_t e = ids[j] - v->base;
        xinfo *xi = &v->x[e];
        ferry__tok last = xi->last_tok;
        if (last != tok) {
            ferry__tok d = tok - last;
            uint32_t keep = (last != TOK_NONE) & (d < 32); /* (no branch) */
            xi->bits = keep ? (xi->bits << (d & 31)) | 1u : 1u;
            xi->last_tok = tok;
            xi->cnt++;
            double share_e = (double)xi->cnt * E;
            uint32_t pop = (uint32_t)(share_e >= tr[3]) * 4; /* (no branches) */
            pop += (uint32_t)(share_e >= tr[pop + 1]) * 2;
            pop += share_e >= tr[pop];
            xi->pop = (uint8_t)(routes > 0 ? pop : 0);
        }
        /* each expert's move reads only its own features: the same as
         * all features first, then all moves. Routed at tok, its history
         * byte has bit 0: compute_cell() without its tests. */
        if (moves)
            step_move(v, e,
                      (uint16_t)(hist_base[xi->bits & 0xffu] + (uint32_t)xi->pop * 2 +
                                 (xi->hint_tok == tok + 1)),
                      1);
    }
}

static void ring_put(routing *s, uint32_t layer, ferry__tok tok, uint32_t base, const uint32_t *ids,
                     uint32_t n)
{
    size_t r = (size_t)layer * RING + tok % RING;
    uint32_t keep = n < s->ring_cap ? n : s->ring_cap;
    uint16_t *out = s->ring + r * s->ring_cap;
    for (uint32_t j = 0; j < keep; j++)
        out[j] = (uint16_t)(ids[j] - base);
    s->ring_n[r] = keep;
    s->ring_tok[r] = tok;
}

/* ---- sleep: features, ring and lists kept, no events, moves or
 * learning; a wake recomputes each cell from the features (ferry__routing_sleep) */
static void layer_sleep_step(routing *s, uint32_t m, const uint32_t *ids, uint32_t n, ferry__tok tok)
{
    if (!s->asleep[m]) { /* its counts so far folded in (linear) */
        const uint16_t *cc = s->cell_count + (size_t)m * CELLS;
        for (uint32_t c = 0; c < CELLS; c++)
            s->opps[c] += (uint64_t)cc[c] * s->lturns[m];
        s->lturns[m] = 0;
        s->asleep[m] = 1;
    }
    s->turn_tok[m] = tok;
    stepv v; /* (no moves: the features' fields alone) */
    v.base = m * s->base.env.num_experts;
    v.x = s->x + v.base;
    v.m = m;
    v.tok = tok;
    routed_step(s, &v, ids, n, 0);
    for (uint32_t j = 0; j < n; j++) { /* (order within a cell: a wake's) */
        uint32_t slot = s->base.env.where[ids[j]];
        if (slot != FERRY_MOE_NONE && s->scell[slot] == CELL_NONE)
            list_move(s->lk, s->scell, s->ht + (size_t)m * CELLS * 2, s->bm + (size_t)m * BMW,
                      s->rank, slot, v.x[ids[j] - v.base].cell);
    }
    if (s->n_parked)
        unpark(s, m);
    /* (its leaf stays: auto asks no victim of it asleep; a wake updates it) */
    ring_put(s, m, tok, v.base, ids, n);
}

static void layer_wake(routing *s, uint32_t m)
{
    uint32_t E = s->base.env.num_experts;
    ferry__tok tok = s->turn_tok[m];
    s->asleep[m] = 0;
    if (tok == TOK_NONE)
        return; /* never ran: as created */
    xinfo *x = s->x + (size_t)m * E;
    uint16_t *cc = s->cell_count + (size_t)m * CELLS;
    uint64_t *nz = s->ccbm + (size_t)m * BMW;
    memset(cc, 0, CELLS * sizeof *cc);
    memset(nz, 0, BMW * sizeof *nz);
    for (uint32_t e = 0; e < E; e++) {
        uint16_t c = compute_cell(&x[e], tok);
        x[e].cell = c;
        if (cc[c]++ == 0)
            nz[c / 64] |= 1ull << (c % 64);
    }
    for (uint32_t v = 0, id; v < s->base.env.slots; v++)
        if (s->scell[v] != CELL_NONE && (id = s->base.env.occupant[v]) / E == m)
            list_move(s->lk, s->scell, s->ht + (size_t)m * CELLS * 2, s->bm + (size_t)m * BMW,
                      s->rank, v, s->x[id].cell);
    seg_update(s, m);
}

uint32_t ferry__routing_cell(const ferry__policy *p, uint32_t id)
{
    return ((const routing *)p)->x[id].cell;
}

int ferry__routing_sleep(ferry__policy *p, uint32_t stride)
{
    if (!p || p->ops != &ferry__policy_routing)
        return -EINVAL;
    routing *s = (routing *)p;
    s->sleep_stride = stride > 1 ? stride : 0;
    for (uint32_t m = 0; m < p->env.num_layers; m++)
        if (s->asleep[m] && (!s->sleep_stride || m % s->sleep_stride == 0))
            layer_wake(s, m);
    return 0;
}

static void rt_end_step(ferry__policy *p, uint32_t layer, const uint32_t *ids, uint32_t n)
{
    routing *s = (routing *)p;
    ferry__tok tok = *p->env.token;
    if (s->sleep_stride && layer % s->sleep_stride) {
        layer_sleep_step(s, layer, ids, n, tok);
        return;
    }

    if (s->turn_tok[layer] != tok) /* a second ensure of the same turn: learn nothing twice */
        learn_turn(s, layer, ids, n);
    s->turn_tok[layer] = tok;
    /* experts whose features changed: routed now, routed at the previous
     * turn (leave "last"), routed 8 turns back (leave the window), hinted
     * for this turn (hint expires). The layer's leaf of the tournament is
     * updated once, after them all. */
    if (s->fol)
        s->fol->stale = 0;
    stepv v;
    stepv_init(&v, s, layer, tok);
    const xinfo *xl = v.x;
    routed_step(s, &v, ids, n, 1);
    if (s->n_parked)
        unpark(s, layer); /* (the routed ones are listed again already) */
    uint32_t m;
    const uint16_t *set;
    /* (routed again now: already in its cell as of this turn) */
    if (tok >= 1 && (set = ring_set(s, layer, tok - 1, &m)) != NULL)
        for (uint32_t j = 0; j < m; j++)
            if (xl[set[j]].last_tok != tok)
                step_move(&v, set[j], compute_cell(&xl[set[j]], tok), 0);
    /* only an expert not routed since turns cold now */
    if (tok >= COLD && (set = ring_set(s, layer, tok - COLD, &m)) != NULL)
        for (uint32_t j = 0; j < m; j++)
            if (xl[set[j]].last_tok == tok - COLD)
                step_move(&v, set[j], compute_cell(&xl[set[j]], tok), 0);
    /* a route of tok - WIN leaves the window (a hinted member that was
     * not routed then, or one routed again now, has no such event) */
    if (tok >= WIN && (set = ring_set(s, layer, tok - WIN, &m)) != NULL)
        for (uint32_t j = 0; j < m; j++) {
            const xinfo *xi = &xl[set[j]];
            ferry__tok d = xi->last_tok - (tok - WIN);
            if (xi->last_tok != tok && xi->last_tok != TOK_NONE && d < 32 && (xi->bits >> d & 1u))
                step_move(&v, set[j], compute_cell(&xl[set[j]], tok), 0);
        }
    seg_update(s, layer);
    if (s->fol && s->fol->stale)
        seg_update(s->fol, layer);
    ring_put(s, layer, tok, v.base, ids, n); /* remember this turn's set */
}

const ferry__policy_ops ferry__policy_routing = {
    .name = "routing",
    .describe = "learned reuse probability per routing-feature cell (last turn, 8-turn window, "
                "popularity, prefetch hint); evicts the furthest predicted use in steps",
    .state_size = sizeof(routing),
    .init = rt_init,
    .fini = rt_fini,
    .end_step = rt_end_step,
    .hit = rt_hit,
    .insert = rt_insert,
    .remove = rt_remove,
    .victim = rt_victim,
};

/* a follower's step ends: its routed experts are listed under the cells
 * the leader's end_step gave them (the most recent of their cell last),
 * and its layer's value follows the turn */
static void fo_end_step(ferry__policy *p, uint32_t layer, const uint32_t *ids, uint32_t n)
{
    routing *s = (routing *)p;
    for (uint32_t j = 0; j < n; j++) {
        uint32_t slot = p->env.where[ids[j]];
        if (slot != FERRY_MOE_NONE)
            list_move(s->lk, s->scell, s->ht + (size_t)layer * CELLS * 2, s->bm + (size_t)layer * BMW,
                      s->rank, slot, s->x[ids[j]].cell);
    }
    if (s->n_parked)
        unpark(s, layer);
    seg_update(s, layer);
}

static int fo_init(ferry__policy *p)
{
    (void)p;
    return -EINVAL; /* made by ferry__routing_follow */
}

const ferry__policy_ops ferry__policy_routing_follower = {
    .name = "routing",
    .describe = "the routing policy's order over another set of slots, by its leader's model",
    .state_size = sizeof(routing),
    .init = fo_init,
    .fini = rt_fini,
    .end_step = fo_end_step,
    .hit = rt_hit,
    .insert = rt_insert,
    .remove = rt_remove,
    .victim = rt_victim,
};
