/*
 * policy_routing_check.c - the "routing" policy's test seams: the
 * structure checker (ferry__routing_check) and the jump of its token
 * counters past 2^32 (ferry__routing_skip), over its state as
 * routing_state.h lays it out.
 */
#include <errno.h>
#include <stdio.h>

#include "moe/routing_state.h"

int ferry__routing_skip(ferry__policy *p, uint64_t tokens, uint64_t turns)
{
    if (!p || p->ops != &ferry__policy_routing || tokens % RING || turns % REFRESH)
        return -EINVAL;
    routing *s = (routing *)p;
    if (turns && s->turns < REFRESH)
        return -EINVAL; /* (the early refreshes go by the count itself) */
    uint32_t L = p->env.num_layers;
    size_t ids = (size_t)L * p->env.num_experts;
    /* every stamp moves with the token; TOK_NONE stays none. A ring
     * entry keeps its slot (tok % RING): tokens is a multiple of RING */
    for (size_t i = 0; i < ids; i++) {
        s->x[i].last_tok += s->x[i].last_tok != TOK_NONE ? tokens : 0;
        s->x[i].hint_tok += s->x[i].hint_tok != TOK_NONE ? tokens : 0;
    }
    for (uint32_t l = 0; l < L; l++)
        s->turn_tok[l] += s->turn_tok[l] != TOK_NONE ? tokens : 0;
    for (size_t r = 0; r < (size_t)L * RING; r++)
        s->ring_tok[r] += s->ring_tok[r] != TOK_NONE ? tokens : 0;
    s->seg_tok += tokens;
    if (s->fol)
        s->fol->seg_tok += tokens;
    s->turns += turns;
    return 0;
}

int ferry__routing_scale_routes(ferry__policy *p, uint32_t shift)
{
    if (!p || p->ops != &ferry__policy_routing || shift > 40)
        return -EINVAL;
    routing *s = (routing *)p;
    uint32_t L = p->env.num_layers;
    size_t ids = (size_t)L * p->env.num_experts;
    for (size_t i = 0; i < ids; i++)
        s->x[i].cnt <<= shift;
    for (uint32_t l = 0; l < L; l++)
        s->routes[l] <<= shift;
    return 0;
}

/* ---- invariant checker (tests) ---- */
#define FAIL(...) (snprintf(why, len, __VA_ARGS__), -EINVAL)

int ferry__routing_check(const ferry__policy *p, char *why, size_t len)
{
    const routing *s = (const routing *)p;
    uint32_t L = p->env.num_layers, E = p->env.num_experts, n = p->env.slots;
    uint32_t listed = 0;
    /* ranks: a permutation, in (wait desc, cell asc) order */
    for (uint32_t r = 0; r < CELLS; r++) {
        if (s->rank[s->at_rank[r]] != r)
            return FAIL("rank %u: at_rank %u has rank %u", r, s->at_rank[r], s->rank[s->at_rank[r]]);
        if (r && !rank_before(s, s->at_rank[r - 1], s->at_rank[r]))
            return FAIL("rank %u: cell %u out of order after cell %u", r, s->at_rank[r],
                        s->at_rank[r - 1]);
    }
    for (uint32_t m = 0; m < L; m++) {
        uint64_t sum = 0;
        for (uint32_t c = 0; c < CELLS; c++) {
            uint32_t cnt = s->cell_count[(size_t)m * CELLS + c];
            sum += cnt;
            int nz = (int)(s->ccbm[(size_t)m * BMW + c / 64] >> (c % 64) & 1u);
            if (cnt && !nz)
                return FAIL("layer %u cell %u: count %u, non-zero bit %d", m, c, cnt, nz);
            size_t lc = (size_t)m * CELLS + c;
            uint32_t r = s->rank[c], prev = NONE, k = 0;
            int bit = (int)(s->bm[(size_t)m * BMW + r / 64] >> (r % 64) & 1u);
            if (bit != (s->ht[2 * lc] != NONE))
                return FAIL("layer %u cell %u: list %s, bitmap bit %d", m, c,
                            s->ht[2 * lc] != NONE ? "non-empty" : "empty", bit);
            for (uint32_t v = s->ht[2 * lc]; v != NONE; prev = v, v = s->lk[2 * v]) {
                if (v >= n || ++k > n)
                    return FAIL("layer %u cell %u: list broken at slot %u", m, c, v);
                uint32_t id = p->env.occupant[v];
                if (s->lk[2 * v + 1] != prev || s->scell[v] != c)
                    return FAIL("slot %u: links or cell (%u) disagree with list %u/%u", v,
                                s->scell[v], m, c);
                if (id == FERRY_MOE_NONE || id / E != m || s->x[id].cell != c)
                    return FAIL("slot %u listed in %u/%u holds expert %u (cell %u)", v, m, c, id,
                                id == FERRY_MOE_NONE ? CELL_NONE : s->x[id].cell);
                listed++;
            }
            if (s->ht[2 * lc + 1] != prev)
                return FAIL("layer %u cell %u: tail %u, last %u", m, c, s->ht[2 * lc + 1], prev);
        }
        if (sum != E)
            return FAIL("layer %u: cell counts sum to %llu, not %u", m, (unsigned long long)sum, E);
    }
    /* between calls every resident slot is listed, but for the pinned ones
     * a victim choice parked (after a prefetch, until the next step) */
    uint32_t resident = 0;
    for (uint32_t v = 0; v < n; v++) {
        if (p->env.occupant[v] == FERRY_MOE_NONE) {
            if (s->scell[v] != CELL_NONE)
                return FAIL("free slot %u is listed in cell %u", v, s->scell[v]);
            continue;
        }
        if (s->scell[v] != CELL_NONE) {
            resident++;
            continue;
        }
        /* off its list: only a pinned slot parked by a victim choice */
        int parked = 0;
        for (uint32_t i = 0; i < s->n_parked && !parked; i++)
            parked = s->parked[i] == v;
        if (!ferry__pinned(p, v) || !parked)
            return FAIL("slot %u (expert %u) is resident and unlisted, %s", v, p->env.occupant[v],
                        ferry__pinned(p, v) ? "pinned but not parked" : "unpinned");
    }
    if (listed != resident)
        return FAIL("%u slots listed, %u resident", listed, resident);
    /* the tournament: an awake layer's cached candidate and value are
     * current (a sleeping one's as it left them); the root, the furthest */
    if (s->seg_tok == *p->env.token) {
        double best = -INFINITY;
        for (uint32_t m = 0; m < L; m++) {
            if (!(!s->follower && s->asleep[m]) && (s->ltop[m] != layer_top(s, m) || s->lval[m] != layer_value(s, m)))
                return FAIL("layer %u: cached candidate %u / value stale", m, s->ltop[m]);
            if (s->ltop[m] != NONE && s->lval[m] > best)
                best = s->lval[m];
        }
        uint32_t w = s->seg[1];
        if ((w == UINT32_MAX) != (best == -INFINITY) || (w != UINT32_MAX && s->lval[w] != best))
            return FAIL("tournament root %u is not the furthest layer", w);
    }
    return 0;
}
