/*
 * tr_order.h - transition's order over a set of slots (policy_transition.c):
 * which cell each filed id is in, when it was last touched (filed, moved
 * in, used: the order's clock), and per (layer, cell) how many are filed;
 * per layer the cached least. A touch is O(1): the slot is listed once and
 * its id keyed again (and its cell's count moved) before the next victim
 * (ord_flush), in the order first touched. A layer's least is found from
 * its non-empty cells' ranks of p (a pass over its counts, 8 or 16 a
 * compare) and a pass over the layer's ids of the least ones (E ids,
 * eight a compare): nothing grows with the slots.
 * Static functions for that one file; it defines TR_NC, TR_NCP (TR_NC
 * rounded up to 16: a layer's counts, the tail zero), NIL, CELL_NONE and
 * struct trx before this.
 */
#ifndef FERRY_MOE_TR_ORDER_H
#define FERRY_MOE_TR_ORDER_H

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define TR_KEY_MOST 0x7fffffffu         /* above every key (signed compares) */
#define TR_KEY_TOP (TR_KEY_MOST - 1u)   /* the most a key is */

typedef struct trslot {
    uint32_t id;    /* the id filed in it, NIL: none */
    uint16_t layer; /* while filed: its layer */
    uint8_t pend;   /* touched since the last victim */
    uint8_t pad;
} trslot;
_Static_assert(sizeof(trslot) == 8, "a slot's order fields are 8 bytes");

typedef struct trord {
    trslot *sl;          /* per slot, and sl[n]: a slot never filed */
    uint16_t *fc;        /* per id: the cell it is filed in, CELL_NONE: not filed */
    uint32_t *fs;        /* per id: its slot while filed */
    uint32_t *key;       /* per id: when it was last touched (the order's clock, at most
                            TR_KEY_TOP: renumbered, in order, before it would pass) */
    uint16_t *cnt;       /* [L][TR_NCP]: ids filed in each cell */
    uint32_t *least;     /* [L]: least filed id, pinned ones too; NIL: none */
    uint64_t *lgen;      /* [L]: the p refresh the least is of; 0: find again */
    uint32_t *plist, pn; /* the touched slots, in the order first touched */
    uint64_t *rn;        /* [slots]: a renumbering's scratch */
    uint32_t clock;
    uint32_t n, E;       /* slots; experts a layer */
    uint64_t ops;        /* work done: events, filings, layers and cells visited (tests) */
} trord;

static void ord_fini(trord *o)
{
    void *arr[] = {o->sl, o->fc, o->fs, o->key, o->least, o->lgen, o->plist, o->rn};
    for (size_t i = 0; i < sizeof arr / sizeof *arr; i++)
        ferry__free(arr[i]);
    ferry__free(o->cnt);
    memset(o, 0, sizeof *o);
}

static int ord_init(trord *o, const ferry__policy_env *env)
{
    uint32_t n = env->slots, L = env->num_layers, E = env->num_experts;
    size_t ids = (size_t)L * E;
    o->sl = ferry__malloc(((size_t)n + 1) * sizeof *o->sl);
    o->fc = ferry__malloc(ids * sizeof *o->fc);
    o->fs = ferry__calloc(ids, sizeof *o->fs);
    o->key = ferry__calloc(ids, sizeof *o->key);
    o->cnt = ferry__aligned_alloc(32, (size_t)L * TR_NCP * sizeof *o->cnt);
    o->least = ferry__malloc((size_t)L * sizeof *o->least);
    o->lgen = ferry__calloc(L, sizeof *o->lgen);
    o->plist = ferry__malloc(((size_t)n + 1) * sizeof *o->plist);
    o->rn = ferry__malloc(((size_t)n + 1) * sizeof *o->rn);
    if (!o->sl || !o->fc || !o->fs || !o->key || !o->cnt || !o->least || !o->lgen ||
        !o->plist || !o->rn) {
        ord_fini(o);
        return -ENOMEM;
    }
    memset(o->cnt, 0, (size_t)L * TR_NCP * sizeof *o->cnt);
    for (size_t v = 0; v <= n; v++) /* (written now: the pages fault in at create) */
        o->sl[v] = (trslot){NIL, 0, 0, 0};
    memset(o->fc, 0xff, ids * sizeof *o->fc);
    o->n = n;
    o->E = E;
    memset(o->least, 0xff, (size_t)L * sizeof *o->least);
    return 0;
}

/* slot's id off its cell; nothing if none is filed there */
static void ord_unfile(trord *o, uint32_t l, uint32_t slot)
{
    trslot *s = &o->sl[slot];
    uint32_t id = s->id;
    if (id == NIL)
        return;
    o->cnt[(size_t)s->layer * TR_NCP + o->fc[id]]--;
    o->fc[id] = CELL_NONE;
    s->id = NIL;
    o->lgen[l] = 0;
    o->lgen[s->layer] = 0;
    o->ops++;
}

static int u64_cmp(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

/* the filed ids' keys renumbered 1, 2, .. in their order (the clock
 * then their number): what a victim compares is the keys' order, so the
 * same victims; after about 2^31 touches */
static void ord_renumber(trord *o)
{
    uint32_t m = 0;
    for (uint32_t v = 0; v < o->n; v++)
        if (o->sl[v].id != NIL)
            o->rn[m++] = (uint64_t)o->key[o->sl[v].id] << 32 | o->sl[v].id;
    qsort(o->rn, m, sizeof *o->rn, u64_cmp);
    for (uint32_t i = 0; i < m; i++)
        o->key[(uint32_t)o->rn[i]] = i + 1;
    o->clock = m;
}

/* id (of layer l) filed in slot and cell c, touched now (its slot empty:
 * unfiled first; the id's slot before, if it is filed elsewhere, too) */
static void ord_file(trord *o, uint32_t l, uint32_t slot, uint32_t id, uint16_t c)
{
    if (o->fc[id] != CELL_NONE)
        ord_unfile(o, l, o->fs[id]);
    ord_unfile(o, l, slot);
    trslot *s = &o->sl[slot];
    s->id = id;
    s->layer = (uint16_t)l;
    o->fc[id] = c;
    o->fs[id] = slot;
    if (o->clock >= TR_KEY_TOP)
        ord_renumber(o);
    o->key[id] = ++o->clock;
    o->cnt[(size_t)l * TR_NCP + c]++;
    o->lgen[l] = 0;
    o->ops++;
}

/* a filed slot (of layer l) is touched: its expert was used or moved to
 * another cell. Its id is keyed again, in its cell now, before the next
 * victim is chosen (ord_flush): O(1) now, once however often touched. */
static inline void ord_touch(trord *o, uint32_t l, uint32_t slot)
{
    trslot *s = &o->sl[slot];
    if (s->id == NIL)
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
    uint32_t on = s->id != NIL;
    o->lgen[l] &= (uint64_t)on - 1; /* filed: 0, find the least again */
    o->ops += on;
    o->plist[o->pn] = v;
    o->pn += on & !s->pend;
    s->pend |= (uint8_t)on;
}

/* every touched slot still filed: its id in its cell of the model now
 * (x, per id) and keyed again, in the order first touched. Its layer's
 * least was dropped at the touch (lgen 0 till the next pick), or at its
 * filing since. */
static void ord_flush(trord *o, const struct trx *x)
{
    if (o->pn > TR_KEY_TOP - o->clock)
        ord_renumber(o);
    uint32_t *plist = o->plist, pn = o->pn, *key = o->key, clock = o->clock;
    uint16_t *fc = o->fc, *cnt = o->cnt;
    trslot *sl = o->sl;
    for (uint32_t i = 0; i < pn; i++) {
        trslot *s = &sl[plist[i]];
        uint32_t id = s->id;
        s->pend = 0;
        if (id == NIL)
            continue;
        size_t l = s->layer;
        uint32_t c = fc[id], nc = x[id].cell;
        uint16_t *lc = cnt + l * TR_NCP;
        /* (no branch on whether the cell changed: a count down and up) */
        lc[c]--;
        lc[nc]++;
        fc[id] = (uint16_t)nc;
        key[id] = ++clock;
    }
    o->ops += 2 * (uint64_t)(clock - o->clock); /* (no wrap: see above) */
    o->clock = clock;
    o->pn = 0;
}

/* the least-keyed of layer l's ids (b its first) filed in cell c, pinned
 * ones skipped when unpinned_only; best and bk the least so far. Eight
 * ids a compare (16 with AVX2, where wide) */
#if defined(TR_ROWS_AVX2)
static __attribute__((target("avx2"), noinline)) uint32_t
ord_cell_least_avx2(trord *o, const ferry__policy *p, uint32_t b, uint16_t c, int unpinned_only,
                    uint32_t *best, uint64_t *bk)
{
    const uint16_t *fc = o->fc + b;
    const uint32_t *key = o->key + b;
    uint32_t E = o->E, e = 0;
    __m256i cv = _mm256_set1_epi16((short)c);
    for (; e + 16 <= E; e += 16) {
        uint32_t m = (uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi16(
                         _mm256_loadu_si256((const __m256i *)(const void *)(fc + e)), cv)) &
                     0x55555555u;
        for (; m; m &= m - 1) {
            uint32_t i = e + (uint32_t)__builtin_ctz(m) / 2;
            if (key[i] < *bk && !(unpinned_only && ferry__pinned(p, o->fs[b + i]))) {
                *best = b + i;
                *bk = key[i];
            }
        }
    }
    o->ops += E / 16;
    return e;
}

/* the same without pinned ones to skip and without a branch on the ids
 * (how many of 16 are in the cell is a coin toss to the predictor): the
 * keys (below TR_KEY_MOST), eight a register, the others' raised to
 * TR_KEY_MOST; the least of each lane and its index, and of those the
 * least */
static __attribute__((target("avx2"), noinline)) uint32_t
ord_cell_min_avx2(trord *o, uint32_t b, uint16_t c, uint32_t *best, uint64_t *bk)
{
    const uint16_t *fc = o->fc + b;
    const uint32_t *key = o->key + b;
    uint32_t E = o->E, e = 0;
    __m256i cv = _mm256_set1_epi16((short)c), most = _mm256_set1_epi32(TR_KEY_MOST);
    __m256i m0 = most, m1 = most, i0 = _mm256_setzero_si256(), i1 = i0;
    __m256i ix = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), eight = _mm256_set1_epi32(8);
    for (; e + 16 <= E; e += 16) {
        __m256i eq = _mm256_cmpeq_epi16(_mm256_loadu_si256((const __m256i *)(const void *)(fc + e)), cv);
        __m256i q0 = _mm256_cvtepi16_epi32(_mm256_castsi256_si128(eq));
        __m256i q1 = _mm256_cvtepi16_epi32(_mm256_extracti128_si256(eq, 1));
        __m256i k0 = _mm256_blendv_epi8(most, _mm256_loadu_si256((const __m256i *)(const void *)(key + e)), q0);
        __m256i k1 = _mm256_blendv_epi8(most, _mm256_loadu_si256((const __m256i *)(const void *)(key + e + 8)), q1);
        __m256i lt0 = _mm256_cmpgt_epi32(m0, k0), lt1 = _mm256_cmpgt_epi32(m1, k1);
        m0 = _mm256_blendv_epi8(m0, k0, lt0);
        i0 = _mm256_blendv_epi8(i0, ix, lt0);
        ix = _mm256_add_epi32(ix, eight);
        m1 = _mm256_blendv_epi8(m1, k1, lt1);
        i1 = _mm256_blendv_epi8(i1, ix, lt1);
        ix = _mm256_add_epi32(ix, eight);
    }
    __m256i lt = _mm256_cmpgt_epi32(m0, m1); /* (keys are unique: any order) */
    uint32_t mk[8], mi[8];
    _mm256_storeu_si256((__m256i *)(void *)mk, _mm256_blendv_epi8(m0, m1, lt));
    _mm256_storeu_si256((__m256i *)(void *)mi, _mm256_blendv_epi8(i0, i1, lt));
    for (uint32_t j = 0; j < 8; j++) {
        int less = mk[j] < *bk && mk[j] != TR_KEY_MOST;
        *best = less ? b + mi[j] : *best;
        *bk = less ? mk[j] : *bk;
    }
    o->ops += E / 8;
    return e;
}
#endif

static void ord_cell_least(trord *o, const ferry__policy *p, uint32_t b, uint16_t c,
                           int unpinned_only, uint32_t *best, uint64_t *bk, int wide)
{
    const uint16_t *fc = o->fc + b;
    const uint32_t *key = o->key + b;
    uint32_t E = o->E, e = 0;
    (void)wide;
#if defined(TR_ROWS_AVX2)
    if (wide && !unpinned_only)
        e = ord_cell_min_avx2(o, b, c, best, bk);
    else if (wide)
        e = ord_cell_least_avx2(o, p, b, c, unpinned_only, best, bk);
#endif
#if defined(__SSE2__)
    __m128i cv = _mm_set1_epi16((short)c);
    for (; e + 8 <= E; e += 8) {
        uint32_t m = (uint32_t)_mm_movemask_epi8(
                         _mm_cmpeq_epi16(_mm_loadu_si128((const __m128i *)(const void *)(fc + e)), cv)) &
                     0x5555u;
        for (; m; m &= m - 1) {
            uint32_t i = e + (uint32_t)__builtin_ctz(m) / 2;
            if (key[i] < *bk && !(unpinned_only && ferry__pinned(p, o->fs[b + i]))) {
                *best = b + i;
                *bk = key[i];
            }
        }
    }
    o->ops += E / 8;
#endif
    for (; e < E; e++)
        if (fc[e] == c && key[e] < *bk && !(unpinned_only && ferry__pinned(p, o->fs[b + e]))) {
            *best = b + e;
            *bk = key[e];
        }
}

#endif
