/*
 * tr_order.h - transition's order over a set of slots (policy_transition.c):
 * per (layer, cell) an intrusive list of the cell's resident slots, the
 * least recently touched (filed, moved in, used) first, and per layer the
 * cached least. A touch is O(1): the slot is listed once and filed again
 * at the end of its cell's list before the next victim (ord_flush), in the
 * order first touched. Static functions for that one file; it defines
 * TR_NC, TR_BMW, NIL, CELL_NONE and struct trx before this.
 */
#ifndef FERRY_MOE_TR_ORDER_H
#define FERRY_MOE_TR_ORDER_H


/* ---- the order over a set of slots: per (layer, cell) a list of its
 * residents, the least recently touched (filed, moved in, used) first;
 * per layer the cached least ---- */
typedef struct trslot {
    uint64_t key;   /* when it was last touched (the order's clock) */
    uint32_t nx, pv; /* its list's next and previous; NIL at the ends */
    uint16_t cell;  /* the cell it is filed in, CELL_NONE */
    uint16_t layer; /* while filed: its layer */
    uint8_t pend;   /* touched since the last victim */
} trslot;
_Static_assert(sizeof(trslot) == 24, "a slot's order fields are 24 bytes");

typedef struct trord {
    trslot *sl;          /* per slot, and sl[n]: a slot never filed */
    uint32_t *ht;        /* [L][TR_NC][2]: head, tail */
    uint64_t *nz;        /* [L][TR_BMW]: non-empty lists */
    uint32_t *least;     /* [L]: least resident, pinned ones too; NIL: empty */
    uint64_t *lgen;      /* [L]: the p refresh the least is of; 0: find again */
    uint32_t *plist, pn; /* the touched slots, in the order first touched */
    uint64_t clock;
    uint32_t n;          /* slots */
    uint64_t ops;        /* work done: events, filings, layers and cells visited (tests) */
} trord;

static void ord_fini(trord *o)
{
    ferry__free(o->sl);
    ferry__free(o->ht);
    ferry__free(o->nz);
    ferry__free(o->least);
    ferry__free(o->lgen);
    ferry__free(o->plist);
    memset(o, 0, sizeof *o);
}

static int ord_init(trord *o, const ferry__policy_env *env)
{
    uint32_t n = env->slots, L = env->num_layers;
    o->sl = ferry__malloc(((size_t)n + 1) * sizeof *o->sl);
    o->ht = ferry__malloc((size_t)L * TR_NC * 2 * sizeof *o->ht);
    o->nz = ferry__calloc((size_t)L * TR_BMW, sizeof *o->nz);
    o->least = ferry__malloc((size_t)L * sizeof *o->least);
    o->lgen = ferry__calloc(L, sizeof *o->lgen);
    o->plist = ferry__malloc(((size_t)n + 1) * sizeof *o->plist);
    if (!o->sl || !o->plist || !o->ht || !o->nz || !o->least || !o->lgen) {
        ord_fini(o);
        return -ENOMEM;
    }
    for (size_t v = 0; v <= n; v++) /* (written now: the pages fault in at create) */
        o->sl[v] = (trslot){0, NIL, NIL, CELL_NONE, 0, 0};
    o->n = n;
    memset(o->ht, 0xff, (size_t)L * TR_NC * 2 * sizeof *o->ht);
    memset(o->least, 0xff, (size_t)L * sizeof *o->least);
    return 0;
}

/* slot (of layer l) at the end of cell c's list, touched now; not filed
 * before */
static void ord_file(trord *o, uint32_t l, uint32_t slot, uint16_t c)
{
    uint32_t *ht = o->ht + ((size_t)l * TR_NC + c) * 2;
    trslot *s = &o->sl[slot];
    s->cell = c;
    s->layer = (uint16_t)l;
    s->key = ++o->clock;
    s->nx = NIL;
    s->pv = ht[1];
    if (ht[1] != NIL)
        o->sl[ht[1]].nx = slot;
    else
        ht[0] = slot;
    ht[1] = slot;
    o->nz[(size_t)l * TR_BMW + c / 64] |= 1ull << (c % 64);
    o->lgen[l] = 0;
    o->ops++;
}

/* slot (of layer l) off its list; nothing if not filed */
static void ord_unfile(trord *o, uint32_t l, uint32_t slot)
{
    trslot *s = &o->sl[slot];
    uint16_t c = s->cell;
    if (c == CELL_NONE)
        return;
    uint32_t *ht = o->ht + ((size_t)l * TR_NC + c) * 2, a = s->pv, b = s->nx;
    if (a != NIL)
        o->sl[a].nx = b;
    else
        ht[0] = b;
    if (b != NIL)
        o->sl[b].pv = a;
    else
        ht[1] = a;
    if (ht[0] == NIL)
        o->nz[(size_t)l * TR_BMW + c / 64] &= ~(1ull << (c % 64));
    s->cell = CELL_NONE;
    s->nx = s->pv = NIL;
    o->lgen[l] = 0;
    o->ops++;
}

/* a filed slot (of layer l) is touched: its expert was used or moved to
 * another cell. It goes to the end of its cell's list before the next
 * victim is chosen (ord_flush): O(1) now, once however often touched. */
static inline void ord_touch(trord *o, uint32_t l, uint32_t slot)
{
    trslot *s = &o->sl[slot];
    if (s->cell == CELL_NONE)
        return;
    o->lgen[l] = 0;
    o->ops++;
    /* listed once, without a branch (plist has room for one past the
     * slots) */
    o->plist[o->pn] = slot;
    o->pn += !s->pend;
    s->pend = 1;
}

/* the same for a slot or FERRY_MOE_NONE (nothing then), without a
 * branch on which: whether an expert is resident is a coin toss to the
 * branch predictor */
static inline void ord_touch_any(trord *o, uint32_t l, uint32_t slot)
{
    uint32_t v = slot < o->n ? slot : o->n;
    trslot *s = &o->sl[v];
    uint32_t on = s->cell != CELL_NONE;
    o->lgen[l] &= (uint64_t)on - 1; /* filed: 0, find the least again */
    o->ops += on;
    o->plist[o->pn] = v;
    o->pn += on & !s->pend;
    s->pend |= (uint8_t)on;
}

/* every touched slot still filed, at the end of its expert's cell's list
 * now, in the order first touched (cell: per id, of the model): an
 * ord_unfile and an ord_file each, in one loop with the order's arrays in
 * registers. Its layer's least was dropped at the touch (lgen 0 till the
 * next pick), or at its filing since. */
static void ord_flush(trord *o, const struct trx *x, const uint32_t *occupant)
{
    uint32_t *ht = o->ht, *plist = o->plist, pn = o->pn;
    uint64_t *nz = o->nz, clock = o->clock;
    trslot *sl = o->sl;
    for (uint32_t i = 0; i < pn; i++) {
        uint32_t slot = plist[i], id = occupant[slot];
        trslot *s = &sl[slot];
        s->pend = 0;
        uint32_t c = s->cell;
        if (c == CELL_NONE || id == FERRY_MOE_NONE)
            continue;
        uint32_t nc = x[id].cell, a = s->pv, b = s->nx;
        size_t l = s->layer;
        uint32_t *lh = ht + l * (2 * TR_NC), *h = lh + 2 * c, *g = lh + 2 * nc;
        uint64_t *lz = nz + l * TR_BMW;
        *(a != NIL ? &sl[a].nx : &h[0]) = b;
        *(b != NIL ? &sl[b].pv : &h[1]) = a;
        if ((a & b) == NIL) /* (its list empty now: a and b both NIL) */
            lz[c / 64] &= ~(1ull << (c % 64));
        uint32_t t = g[1]; /* (read after the unlink: the same list, maybe) */
        if (t != NIL) {
            sl[t].nx = slot;
        } else { /* (its list was empty) */
            g[0] = slot;
            lz[nc / 64] |= 1ull << (nc % 64);
        }
        g[1] = slot;
        s->pv = t;
        s->nx = NIL;
        s->cell = (uint16_t)nc;
        s->key = ++clock;
    }
    o->ops += 2 * (uint64_t)(clock - o->clock);
    o->clock = clock;
    o->pn = 0;
}

#endif
