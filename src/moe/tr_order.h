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
typedef struct trord {
    uint32_t *nx, *pv;   /* per slot; NIL at the ends */
    uint64_t *key;       /* per slot: when it was last touched (this order's clock) */
    uint16_t *scell;     /* per slot: the cell it is filed in, CELL_NONE */
    uint32_t *sli;       /* per slot, while filed: its list, layer x TR_NC + cell */
    uint32_t *ht;        /* [L][TR_NC][2]: head, tail */
    uint64_t *nz;        /* [L][TR_BMW]: non-empty lists */
    uint32_t *least;     /* [L]: least resident, pinned ones too; NIL: empty */
    uint64_t *lgen;      /* [L]: the p refresh the least is of; 0: find again */
    uint8_t *pend;       /* per slot: touched since the last victim */
    uint32_t *plist, pn; /* those slots, in the order first touched */
    uint64_t clock;
    uint32_t n;          /* slots; scell[n] and pend[n]: a slot never filed */
    uint64_t ops;        /* work done: events, filings, layers and cells visited (tests) */
} trord;

static void ord_fini(trord *o)
{
    ferry__free(o->nx);
    ferry__free(o->pv);
    ferry__free(o->key);
    ferry__free(o->scell);
    ferry__free(o->sli);
    ferry__free(o->ht);
    ferry__free(o->nz);
    ferry__free(o->least);
    ferry__free(o->lgen);
    ferry__free(o->pend);
    ferry__free(o->plist);
    memset(o, 0, sizeof *o);
}

static int ord_init(trord *o, const ferry__policy_env *env)
{
    uint32_t n = env->slots, L = env->num_layers;
    o->nx = ferry__malloc((size_t)n * sizeof *o->nx);
    o->pv = ferry__malloc((size_t)n * sizeof *o->pv);
    o->key = ferry__calloc(n, sizeof *o->key);
    o->scell = ferry__malloc(((size_t)n + 1) * sizeof *o->scell);
    o->sli = ferry__calloc((size_t)n + 1, sizeof *o->sli);
    o->ht = ferry__malloc((size_t)L * TR_NC * 2 * sizeof *o->ht);
    o->nz = ferry__calloc((size_t)L * TR_BMW, sizeof *o->nz);
    o->least = ferry__malloc((size_t)L * sizeof *o->least);
    o->lgen = ferry__calloc(L, sizeof *o->lgen);
    o->pend = ferry__calloc((size_t)n + 1, sizeof *o->pend);
    o->plist = ferry__malloc(((size_t)n + 1) * sizeof *o->plist);
    if (!o->pend || !o->plist || !o->nx || !o->pv || !o->key || !o->scell || !o->sli || !o->ht || !o->nz || !o->least || !o->lgen) {
        ord_fini(o);
        return -ENOMEM;
    }
    memset(o->nx, 0xff, (size_t)n * sizeof *o->nx);
    memset(o->pv, 0xff, (size_t)n * sizeof *o->pv);
    memset(o->scell, 0xff, ((size_t)n + 1) * sizeof *o->scell);
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
    o->scell[slot] = c;
    o->sli[slot] = l * TR_NC + c;
    o->key[slot] = ++o->clock;
    o->nx[slot] = NIL;
    o->pv[slot] = ht[1];
    if (ht[1] != NIL)
        o->nx[ht[1]] = slot;
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
    uint16_t c = o->scell[slot];
    if (c == CELL_NONE)
        return;
    uint32_t *ht = o->ht + ((size_t)l * TR_NC + c) * 2, a = o->pv[slot], b = o->nx[slot];
    if (a != NIL)
        o->nx[a] = b;
    else
        ht[0] = b;
    if (b != NIL)
        o->pv[b] = a;
    else
        ht[1] = a;
    if (ht[0] == NIL)
        o->nz[(size_t)l * TR_BMW + c / 64] &= ~(1ull << (c % 64));
    o->scell[slot] = CELL_NONE;
    o->nx[slot] = o->pv[slot] = NIL;
    o->lgen[l] = 0;
    o->ops++;
}

/* a filed slot (of layer l) is touched: its expert was used or moved to
 * another cell. It goes to the end of its cell's list before the next
 * victim is chosen (ord_flush): O(1) now, once however often touched. */
static inline void ord_touch(trord *o, uint32_t l, uint32_t slot)
{
    if (o->scell[slot] == CELL_NONE)
        return;
    o->lgen[l] = 0;
    o->ops++;
    /* listed once, without a branch (plist has room for one past the
     * slots) */
    o->plist[o->pn] = slot;
    o->pn += !o->pend[slot];
    o->pend[slot] = 1;
}

/* the same for a slot or FERRY_MOE_NONE (nothing then), without a
 * branch on which: whether an expert is resident is a coin toss to the
 * branch predictor */
static inline void ord_touch_any(trord *o, uint32_t l, uint32_t slot)
{
    uint32_t v = slot < o->n ? slot : o->n;
    uint32_t on = o->scell[v] != CELL_NONE;
    o->lgen[l] &= (uint64_t)on - 1; /* filed: 0, find the least again */
    o->ops += on;
    o->plist[o->pn] = v;
    o->pn += on & !o->pend[v];
    o->pend[v] |= (uint8_t)on;
}

/* the same for each of q[0..n), in that order: one loop, the order's
 * fields in registers */
static void ord_touch_all(trord *o, uint32_t l, const uint32_t *q, uint32_t n)
{
    uint32_t pn = o->pn, any = 0, *plist = o->plist, none = o->n, ops = 0;
    const uint16_t *scell = o->scell;
    uint8_t *pend = o->pend;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t v = q[i] < none ? q[i] : none;
        uint32_t on = scell[v] != CELL_NONE;
        any |= on;
        ops += on;
        plist[pn] = v;
        pn += on & !pend[v];
        pend[v] |= (uint8_t)on;
    }
    o->pn = pn;
    o->ops += ops;
    o->lgen[l] &= (uint64_t)any - 1; /* one filed: 0, find the least again */
}

/* every touched slot still filed, at the end of its expert's cell's list
 * now, in the order first touched (cell: per id, of the model): an
 * ord_unfile and an ord_file each, in one loop with the order's arrays in
 * registers and the slot's layer from its list, not its id */
static void ord_flush(trord *o, const struct trx *x, const uint32_t *occupant)
{
    uint32_t *nx = o->nx, *pv = o->pv, *ht = o->ht, *sli = o->sli, *plist = o->plist;
    uint64_t *nz = o->nz, *key = o->key, *lgen = o->lgen, clock = o->clock;
    uint16_t *scell = o->scell;
    uint8_t *pend = o->pend;
    uint32_t ops = 0;
    for (uint32_t i = 0; i < o->pn; i++) {
        uint32_t slot = plist[i], id = occupant[slot];
        pend[slot] = 0;
        uint16_t c = scell[slot];
        if (c == CELL_NONE || id == FERRY_MOE_NONE)
            continue;
        uint32_t li = sli[slot], l = li / TR_NC, a = pv[slot], b = nx[slot], *h = ht + 2 * (size_t)li;
        if (a != NIL)
            nx[a] = b;
        else
            h[0] = b;
        if (b != NIL)
            pv[b] = a;
        else if ((h[1] = a) == NIL) /* (its list empty now: a and b both NIL) */
            nz[(size_t)l * TR_BMW + c / 64] &= ~(1ull << (c % 64));
        uint16_t nc = x[id].cell;
        li = l * TR_NC + nc;
        h = ht + 2 * (size_t)li;
        scell[slot] = nc;
        sli[slot] = li;
        key[slot] = ++clock;
        nx[slot] = NIL;
        pv[slot] = h[1];
        if (h[1] != NIL) {
            nx[h[1]] = slot;
        } else { /* (its list was empty) */
            h[0] = slot;
            nz[(size_t)l * TR_BMW + nc / 64] |= 1ull << (nc % 64);
        }
        h[1] = slot;
        lgen[l] = 0;
        ops += 2;
    }
    o->clock = clock;
    o->ops += ops;
    o->pn = 0;
}

#endif
