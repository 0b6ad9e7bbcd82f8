/*
 * policy_lru.c - least recently used, global ("lru") and per layer
 * ("lru-layer").
 *
 * "lru" is the ferrox / mixtral-offloading baseline: one heap over every
 * resident slot keyed by the step of its last use; the victim is the
 * minimum, ties (never-used slots) go to the lowest slot index.
 *
 * "lru-layer" is llama.cpp's per-layer cache over the global pool: each
 * layer owns a quota of slots / the layers routed so far (the first
 * slots % that many of them, in the order they appeared, one more: a trace
 * that declares 22 layers and routes 3 divides by 3, not 22) and a heap
 * of its own residents. A layer below its
 * quota takes a free slot; a layer at its quota evicts its own least
 * recently used. When that is impossible (all its residents are pinned,
 * or no free slot is left for a layer under quota) it falls back to the
 * free list, then to the layer most over its quota - the invariant kept
 * is only that a pinned slot is never chosen.
 */
#include <errno.h>
#include <string.h>

#include "moe/moe_internal.h"

static void lru_hit(ferry__policy *p, uint32_t slot, uint32_t id)
{
    ferry__heap_policy *s = (ferry__heap_policy *)p;
    (void)ferry__heap_set(&s->heap, slot, (double)*p->env.step);
}

static int lru_insert(ferry__policy *p, uint32_t slot, uint32_t id, int prefetch)
{
    ferry__heap_policy *s = (ferry__heap_policy *)p;
    return ferry__heap_set(&s->heap, slot, (double)*p->env.step);
}

const ferry__policy_ops ferry__policy_lru = {
    .name = "lru",
    .describe = "global least recently used (ferrox / mixtral-offloading baseline)",
    .state_size = sizeof(ferry__heap_policy),
    .init = ferry__heap_policy_init,
    .fini = ferry__heap_policy_fini,
    .hit = lru_hit,
    .insert = lru_insert,
    .remove = ferry__heap_policy_remove,
    .victim = ferry__heap_policy_victim,
};

/* ---- per layer ---- */
typedef struct lru_layer {
    ferry__policy base;
    ferry__heap *heaps;  /* one per layer */
    uint32_t *pos, *scratch, *count;
    uint32_t *rank;     /* per layer: order of its first route, UINT32_MAX: none yet */
    uint32_t n_seen;
    double *key;
} lru_layer;

/* the layer's share of the slots among the layers routed so far */
static uint32_t ll_quota(const lru_layer *s, uint32_t l)
{
    uint32_t n = s->base.env.slots;
    if (s->rank[l] == UINT32_MAX)
        return 0;
    return n / s->n_seen + (s->rank[l] < n % s->n_seen ? 1 : 0);
}

static void ll_see(lru_layer *s, uint32_t l)
{
    if (s->rank[l] == UINT32_MAX)
        s->rank[l] = s->n_seen++;
}

static void ll_fini(ferry__policy *p)
{
    lru_layer *s = (lru_layer *)p;
    if (s->heaps)
        for (uint32_t l = 0; l < p->env.num_layers; l++)
            ferry__heap_fini(&s->heaps[l]);
    ferry__free(s->heaps);
    ferry__free(s->pos);
    ferry__free(s->scratch);
    ferry__free(s->count);
    ferry__free(s->rank);
    ferry__free(s->key);
}

static int ll_init(ferry__policy *p)
{
    lru_layer *s = (lru_layer *)p;
    uint32_t n = p->env.slots, L = p->env.num_layers;
    s->heaps = ferry__calloc(L, sizeof *s->heaps);
    s->pos = ferry__malloc((size_t)n * sizeof *s->pos);
    s->scratch = ferry__malloc((size_t)n * sizeof *s->scratch);
    s->count = ferry__calloc(L, sizeof *s->count);
    s->rank = ferry__malloc((size_t)L * sizeof *s->rank);
    s->key = ferry__calloc(n, sizeof *s->key);
    if (!s->heaps || !s->pos || !s->scratch || !s->count || !s->rank || !s->key) {
        ll_fini(p);
        return -ENOMEM;
    }
    memset(s->pos, 0xff, (size_t)n * sizeof *s->pos);
    memset(s->rank, 0xff, (size_t)L * sizeof *s->rank);
    for (uint32_t l = 0; l < L; l++) {
        /* room for every slot: a layer may exceed its quota after a
         * fallback, and an insert must never fail half-way through a step */
        if (ferry__heap_init(&s->heaps[l], n, s->pos, s->key) < 0) {
            ll_fini(p);
            return -ENOMEM;
        }
    }
    return 0;
}

static void ll_hit(ferry__policy *p, uint32_t slot, uint32_t id)
{
    lru_layer *s = (lru_layer *)p;
    (void)ferry__heap_set(&s->heaps[id / p->env.num_experts], slot, (double)*p->env.step);
}

static int ll_insert(ferry__policy *p, uint32_t slot, uint32_t id, int prefetch)
{
    lru_layer *s = (lru_layer *)p;
    uint32_t l = id / p->env.num_experts;
    ll_see(s, l);
    int rc = ferry__heap_set(&s->heaps[l], slot, (double)*p->env.step);
    if (rc == 0)
        s->count[l]++;
    return rc;
}

static void ll_remove(ferry__policy *p, uint32_t slot, uint32_t id, int evicted)
{
    lru_layer *s = (lru_layer *)p;
    uint32_t l = id / p->env.num_experts;
    if (ferry__heap_contains(&s->heaps[l], slot)) {
        ferry__heap_remove(&s->heaps[l], slot);
        s->count[l]--;
    }
}

static uint32_t ll_pick(lru_layer *s, uint32_t l)
{
    ferry__policy *p = &s->base;
    return ferry__heap_first_unpinned(&s->heaps[l], p->env.pin_step, *p->env.pin_now, s->scratch,
                                      p->env.slots);
}

static int ll_victim(ferry__policy *p, uint32_t id, int have_free, uint32_t *slot)
{
    lru_layer *s = (lru_layer *)p;
    uint32_t l = id / p->env.num_experts;
    ll_see(s, l);
    uint32_t q = ll_quota(s, l);
    if (s->count[l] < q && have_free)
        return 1;
    if (s->count[l] >= q) {
        uint32_t v = ll_pick(s, l);
        if (v != UINT32_MAX) {
            *slot = v;
            return 0;
        }
    }
    if (have_free)
        return 1;
    /* fallback: the layer furthest over its quota that has an unpinned slot
     * (a rare path: O(num_layers)) */
    for (;;) {
        uint32_t best = UINT32_MAX;
        int64_t excess = INT64_MIN;
        for (uint32_t m = 0; m < p->env.num_layers; m++) {
            int64_t e = (int64_t)s->count[m] - (int64_t)ll_quota(s, m);
            if (s->heaps[m].n && e > excess && ll_pick(s, m) != UINT32_MAX) {
                excess = e;
                best = m;
            }
        }
        if (best == UINT32_MAX)
            return -1;
        *slot = ll_pick(s, best);
        return 0;
    }
}

const ferry__policy_ops ferry__policy_lru_layer = {
    .name = "lru-layer",
    .describe = "least recently used within a per-layer quota of slots / layers routed "
                "(llama.cpp)",
    .state_size = sizeof(lru_layer),
    .init = ll_init,
    .fini = ll_fini,
    .hit = ll_hit,
    .insert = ll_insert,
    .remove = ll_remove,
    .victim = ll_victim,
};
