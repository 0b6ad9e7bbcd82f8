/*
 * routing_state.h - the "routing" policy's state (policy_routing.c), and
 * what its test seams (policy_routing_check.c) read of it: the structure
 * checker and the jump of its token counters.
 */
#ifndef FERRY_MOE_ROUTING_STATE_H
#define FERRY_MOE_ROUTING_STATE_H

#include <math.h>

#include "moe/moe_internal.h"

#define WIN 8           /* turns of history: the last one + 7 before */
#define COLD 16         /* turns after which an expert counts as long cold */
#define RING (COLD + 1) /* routed sets kept per layer */
#define WINV (WIN + 2)  /* window values: counts 0..7, cold < COLD, colder */
#define RING_CAP 256u   /* experts of one routed set kept for events: wider
                           (prefill) sets only miss some cell refreshes */
#define POP_B 8         /* popularity buckets */
#define CELLS (2 * WINV * POP_B * 2)
#define BMW ((CELLS + 63) / 64)
#define CELL_NONE UINT16_MAX
#define NONE UINT32_MAX
#define TOK_NONE ((ferry__tok)-1)

/* what is known of one expert, kept together: each event touches them all */
typedef struct xinfo {
    ferry__tok last_tok; /* token of the last route, TOK_NONE never */
    ferry__tok hint_tok; /* hinted for this token's turn, TOK_NONE none */
    uint64_t cnt;        /* routes */
    uint32_t bits;       /* bit d: routed d turns before last_tok */
    uint16_t cell;       /* cell it is counted in */
    uint8_t pop;         /* popularity bucket, as of its last route */
} xinfo; /* (32 bytes: two to a cache line) */

typedef struct routing {
    ferry__policy base;
    /* resident slots by cell: per (layer, cell) a FIFO list of the slots
     * whose expert is in that cell; per layer a bitmap over cell ranks
     * (rank 0: the longest wait) of its non-empty lists */
    uint32_t *lk;              /* per slot: next, prev (NONE at the ends) */
    uint16_t *scell;           /* per slot: the cell it is listed in, CELL_NONE */
    uint32_t *ht;              /* [L][CELLS]: head, tail (one cache line) */
    uint64_t *bm;              /* [L][BMW] */
    uint64_t *ccbm;            /* [L][BMW] by cell: set where cell_count is non-zero */
    uint16_t rank[CELLS], at_rank[CELLS];
    xinfo *x;                  /* per id */
    /* per layer */
    uint16_t *cell_count;      /* [L][CELLS] (E <= 16384) */
    uint64_t *routes;          /* routes seen */
    ferry__tok *turn_tok;      /* token of its last turn, TOK_NONE none */
    uint16_t *ring;            /* [L][RING][ring_cap] routed sets, as experts
                                  of the layer (E <= 16384) */
    uint32_t ring_cap;         /* min(E, RING_CAP): a prefill set is cut */
    /* tournament over layers: the layer whose heap top is predicted
     * furthest (its next-turn offset included), O(log L) per change */
    uint32_t *seg;             /* [2 * seg_p] layer of the best leaf below */
    uint32_t seg_p;
    ferry__tok seg_tok;
    double *lval;              /* per layer: value of its top, -inf if empty */
    uint32_t *ltop;            /* per layer: its candidate slot, NONE if none */
    /* pinned slots met at the top and taken off their lists until the
     * step is over (a hit stays listed: most are never a candidate) */
    uint32_t *parked, n_parked;
    uint64_t park_step;
    uint32_t *ring_n;          /* [L][RING] */
    ferry__tok *ring_tok;      /* [L][RING] */
    /* learned */
    uint64_t opps[CELLS], uses[CELLS]; /* learned over all layers */
    /* opportunities are counted without a pass over the cells per turn:
     * a layer's count in cell c, held from its turn t1 to t2, adds
     * count * (t2 - t1), so opps[c] = sum over layers of count * turns
     * minus, for every change of a count by d at the layer's turn t,
     * d * t (kept in corr[c]); folded into opps at each refresh */
    uint64_t corr[CELLS];
    uint32_t *lturns;          /* per layer: turns taken */
    double wait[CELLS];              /* cached 1/lambda - 1 */
    uint64_t turns;            /* turns learned (refresh schedule) */
    /* a follower's leader (its model is the leader's), a leader's follower */
    struct routing *lead, *fol;
    int follower;
    int stale;                 /* a follower: its leader's end_step moved some
                                  of its slots, its layer's leaf not updated */
    uint32_t sleep_stride;     /* > 1: layers not a multiple of it sleep */
    uint8_t *asleep;           /* per layer (a leader's) */
} routing;

/* the expected wait, in turns, of a cell: 1/lambda - 1 with lambda =
 * uses / opportunities (a weak prior of 1 in 8 for an empty cell);
 * cached, refreshed every REFRESH turns since lambda drifts slowly */
#define REFRESH 256

/* cell a goes before cell b in rank order: longer wait first, ties by cell */
static inline int rank_before(const routing *s, uint32_t a, uint32_t b)
{
    if (s->wait[a] != s->wait[b])
        return s->wait[a] > s->wait[b];
    return a < b;
}

/* a layer's eviction candidate: the head of its non-empty list of the
 * lowest rank (the longest expected wait), CELL_NONE / NONE when none */
static inline uint32_t layer_top_cell(const routing *s, uint32_t m)
{
    const uint64_t *bm = s->bm + (size_t)m * BMW;
    for (uint32_t w = 0; w < BMW; w++)
        if (bm[w])
            return s->at_rank[w * 64 + (uint32_t)__builtin_ctzll(bm[w])];
    return CELL_NONE;
}

static inline uint32_t layer_top(const routing *s, uint32_t m)
{
    uint32_t c = layer_top_cell(s, m);
    return c == CELL_NONE ? NONE : s->ht[2 * ((size_t)m * CELLS + c)];
}

/* its value in the tournament over layers: the candidate's predicted use,
 * in steps from the start of the current token, (its next turn - token)
 * * L + layer + wait * L; -inf when it has none */
static inline double layer_value(const routing *s, uint32_t m)
{
    uint32_t c = layer_top_cell(s, m);
    if (c == CELL_NONE)
        return -INFINITY;
    uint32_t L = s->base.env.num_layers;
    ferry__tok tok = *s->base.env.token;
    uint32_t off = s->turn_tok[m] != TOK_NONE && s->turn_tok[m] >= tok ? 1 : 0;
    return (double)off * L + m + s->wait[c] * L;
}

#endif
