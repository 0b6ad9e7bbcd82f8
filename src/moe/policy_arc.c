/*
 * policy_arc.c - adaptive replacement (ARC): recency against frequency,
 * the balance learned from what was evicted too early.
 *
 * Residents are in T1 (seen once since they came in) or T2 (routed again
 * while resident), each a heap by last use (LRU order). Evicted ids leave
 * a ghost in B1 or B2 (their list), bounded to `slots` each, FIFO. A miss
 * on a B1 ghost means recency was evicting too soon: the target size p of
 * T1 grows; a miss on a B2 ghost means frequency was: p shrinks. The victim
 * is T1's least recent while |T1| > p (or == p for a B2 ghost), else T2's;
 * the other list when all of the first are pinned. A prefetched expert
 * enters T1 and teaches nothing. O(log slots) per operation; a ghost is
 * removed lazily from its FIFO (a per-id sequence number).
 */
#include <errno.h>
#include <string.h>

#include "moe/moe_internal.h"

typedef struct ring {
    uint32_t *id;
    uint64_t *seq;      /* its ghost's sequence number (64 bits: see arc) */
    uint32_t cap, head, n; /* entries, live or stale */
    uint32_t live;
} ring;

typedef struct arc {
    ferry__policy base;
    ferry__heap t[2];   /* T1, T2 */
    uint32_t *pos, *scratch;
    double *key;
    uint8_t *list;      /* per slot: 0 none, 1 T1, 2 T2 */
    uint8_t *ghost;     /* per id: 0 none, 1 B1, 2 B2 */
    /* per id: sequence number of its ghost entry. 64 bits: while every
     * victim comes from one list, the other's ring keeps its stale
     * entries, and a 32-bit sequence come round would make one of them
     * the live ghost's again (its pop dropping that ghost early) */
    uint64_t *gseq;
    uint64_t seq;
    ring b[2];
    double p;           /* target size of T1 */
} arc;

static void arc_fini(ferry__policy *p)
{
    arc *s = (arc *)p;
    ferry__heap_fini(&s->t[0]);
    ferry__heap_fini(&s->t[1]);
    ferry__free(s->pos);
    ferry__free(s->scratch);
    ferry__free(s->key);
    ferry__free(s->list);
    ferry__free(s->ghost);
    ferry__free(s->gseq);
    for (int i = 0; i < 2; i++) {
        ferry__free(s->b[i].id);
        ferry__free(s->b[i].seq);
    }
}

static int arc_init(ferry__policy *p)
{
    arc *s = (arc *)p;
    uint32_t n = p->env.slots;
    size_t ids = (size_t)p->env.num_layers * p->env.num_experts;
    s->pos = ferry__malloc((size_t)n * sizeof *s->pos);
    s->scratch = ferry__malloc((size_t)n * sizeof *s->scratch);
    s->key = ferry__calloc(n, sizeof *s->key);
    s->list = ferry__calloc(n, 1);
    s->ghost = ferry__calloc(ids, 1);
    s->gseq = ferry__calloc(ids, sizeof *s->gseq);
    int ok = s->pos && s->scratch && s->key && s->list && s->ghost && s->gseq;
    for (int i = 0; i < 2 && ok; i++) {
        s->b[i].cap = n + 1;
        s->b[i].id = ferry__malloc((size_t)s->b[i].cap * sizeof *s->b[i].id);
        s->b[i].seq = ferry__malloc((size_t)s->b[i].cap * sizeof *s->b[i].seq);
        ok = s->b[i].id && s->b[i].seq;
    }
    if (ok)
        memset(s->pos, 0xff, (size_t)n * sizeof *s->pos);
    if (!ok || ferry__heap_init(&s->t[0], n, s->pos, s->key) < 0 ||
        ferry__heap_init(&s->t[1], n, s->pos, s->key) < 0) {
        arc_fini(p);
        return -ENOMEM;
    }
    return 0;
}

/* drop the ring's oldest entry (a live one leaves its ghost list) */
static void ring_pop(arc *s, int which)
{
    ring *r = &s->b[which];
    uint32_t id = r->id[r->head];
    uint64_t sq = r->seq[r->head];
    r->head = (r->head + 1) % r->cap;
    r->n--;
    if (s->ghost[id] == which + 1 && s->gseq[id] == sq) {
        s->ghost[id] = 0;
        r->live--;
    }
}

static void ghost_add(arc *s, uint32_t id, int which)
{
    ring *r = &s->b[which];
    while (r->n == r->cap || r->live >= s->base.env.slots)
        ring_pop(s, which);
    uint32_t at = (r->head + r->n) % r->cap;
    r->id[at] = id;
    r->seq[at] = ++s->seq;
    r->n++;
    r->live++;
    s->ghost[id] = (uint8_t)(which + 1);
    s->gseq[id] = s->seq;
}

static void ghost_del(arc *s, uint32_t id)
{
    if (s->ghost[id]) {
        s->b[s->ghost[id] - 1].live--;
        s->ghost[id] = 0; /* its ring entry goes stale */
    }
}

static void arc_hit(ferry__policy *p, uint32_t slot, uint32_t id)
{
    arc *s = (arc *)p;
    (void)id;
    if (s->list[slot] == 1) {
        ferry__heap_remove(&s->t[0], slot);
        s->list[slot] = 2;
    }
    (void)ferry__heap_set(&s->t[1], slot, (double)*p->env.step);
}

static int arc_insert(ferry__policy *p, uint32_t slot, uint32_t id, int prefetch)
{
    arc *s = (arc *)p;
    double c = p->env.slots;
    int to = 1;
    if (!prefetch && s->ghost[id]) {
        double b1 = s->b[0].live ? s->b[0].live : 1, b2 = s->b[1].live ? s->b[1].live : 1;
        if (s->ghost[id] == 1) {
            double d = b2 / b1 > 1 ? b2 / b1 : 1;
            s->p = s->p + d < c ? s->p + d : c;
        } else {
            double d = b1 / b2 > 1 ? b1 / b2 : 1;
            s->p = s->p - d > 0 ? s->p - d : 0;
        }
        to = 2;
    }
    ghost_del(s, id);
    s->list[slot] = (uint8_t)to;
    return ferry__heap_set(&s->t[to - 1], slot, (double)*p->env.step);
}

static void arc_remove(ferry__policy *p, uint32_t slot, uint32_t id, int evicted)
{
    arc *s = (arc *)p;
    int l = s->list[slot];
    if (!l)
        return;
    ferry__heap_remove(&s->t[l - 1], slot);
    s->list[slot] = 0;
    if (evicted)
        ghost_add(s, id, l - 1);
}

static int arc_victim(ferry__policy *p, uint32_t id, int have_free, uint32_t *slot)
{
    arc *s = (arc *)p;
    if (have_free)
        return 1;
    double n1 = s->t[0].n;
    int first = n1 > 0 && (n1 > s->p || (s->ghost[id] == 2 && n1 >= s->p)) ? 0 : 1;
    for (int k = 0; k < 2; k++) {
        ferry__heap *h = &s->t[first ^ k];
        uint32_t v = ferry__heap_first_unpinned(h, p->env.pin_step, *p->env.pin_now, s->scratch,
                                                p->env.slots);
        if (v != UINT32_MAX) {
            *slot = v;
            return 0;
        }
    }
    return -1;
}

int ferry__arc_skip(ferry__policy *p, uint64_t ghosts)
{
    if (!p || p->ops != &ferry__policy_arc)
        return -EINVAL;
    ((arc *)p)->seq += ghosts;
    return 0;
}

const ferry__policy_ops ferry__policy_arc = {
    .name = "arc",
    .describe = "adaptive replacement: recency (seen once) against frequency (seen again), "
                "balanced by the ghosts of what each evicted too early",
    .state_size = sizeof(arc),
    .init = arc_init,
    .fini = arc_fini,
    .hit = arc_hit,
    .insert = arc_insert,
    .remove = arc_remove,
    .victim = arc_victim,
};
