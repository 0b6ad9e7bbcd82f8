/*
 * policy_belady.c - Belady's MIN, the offline bound: evict the resident
 * expert whose next use is furthest in the future (never one of the
 * current step, which the planner pins).
 *
 * It reads the whole trace when created: a backward pass gives, for every
 * route of every step, the index of the next step routing the same expert
 * (or "never"). The planner must then be driven with exactly the trace's
 * steps in order; begin_step checks the layer and the routed set against
 * the oracle's step and refuses (-EINVAL) a step that is not the next one,
 * because a bound computed against another sequence would be meaningless.
 * Experts never used again tie at +inf and go lowest slot first.
 */
#include <errno.h>
#include <math.h>

#include "moe/moe_internal.h"

typedef struct belady {
    ferry__heap_policy hp;  /* key: -(next use step) -> top = furthest */
    uint64_t *next;     /* per route of the trace: next step index using it */
    uint64_t *next_of;  /* per id: next use after the current step */
    uint64_t *stamp;    /* per id: gen when routed in the step being checked */
    uint64_t gen;       /* one per begin_step call */
    size_t cursor;      /* index of the step now running */
} belady;

#define NEVER UINT64_MAX

static void bl_fini(ferry__policy *p)
{
    belady *s = (belady *)p;
    ferry__heap_policy_fini(p);
    ferry__free(s->next);
    ferry__free(s->next_of);
    ferry__free(s->stamp);
}

static int bl_init(ferry__policy *p)
{
    belady *s = (belady *)p;
    const ferry_moe_trace *t = p->env.oracle;
    size_t ids = (size_t)p->env.num_layers * p->env.num_experts;
    if (!t)
        return -EINVAL;
    if (ferry__heap_policy_init(p) < 0)
        return -ENOMEM;
    s->next = ferry__malloc((t->n_ex ? t->n_ex : 1) * sizeof *s->next);
    s->next_of = ferry__malloc(ids * sizeof *s->next_of);
    s->stamp = ferry__calloc(ids, sizeof *s->stamp);
    if (!s->next || !s->next_of || !s->stamp) {
        bl_fini(p);
        return -ENOMEM;
    }
    /* next_of doubles as "last seen" during the backward pass */
    for (size_t i = 0; i < ids; i++)
        s->next_of[i] = NEVER;
    for (size_t i = t->n_steps; i-- > 0;) {
        size_t base = (size_t)t->layer[i] * p->env.num_experts;
        for (size_t j = t->off[i]; j < t->off[i + 1]; j++)
            s->next[j] = s->next_of[base + t->ex[j]];
        for (size_t j = t->off[i]; j < t->off[i + 1]; j++)
            s->next_of[base + t->ex[j]] = i;
    }
    for (size_t i = 0; i < ids; i++)
        s->next_of[i] = NEVER;
    s->cursor = (size_t)-1;
    return 0;
}

static int bl_begin(ferry__policy *p, uint32_t layer, const uint32_t *ids, uint32_t n)
{
    belady *s = (belady *)p;
    const ferry_moe_trace *t = p->env.oracle;
    size_t i = s->cursor + 1;
    if (i >= t->n_steps || t->layer[i] != layer)
        return -EINVAL;
    size_t base = (size_t)layer * p->env.num_experts;
    uint32_t distinct = 0;
    uint64_t gen = ++s->gen;
    for (size_t j = t->off[i]; j < t->off[i + 1]; j++) {
        size_t id = base + t->ex[j];
        if (s->stamp[id] != gen) {
            s->stamp[id] = gen;
            distinct++;
        }
    }
    if (distinct != n)
        return -EINVAL;
    for (uint32_t k = 0; k < n; k++)
        if (s->stamp[ids[k]] != gen)
            return -EINVAL;
    for (size_t j = t->off[i]; j < t->off[i + 1]; j++)
        s->next_of[base + t->ex[j]] = s->next[j];
    s->cursor = i;
    return 0;
}

static double bl_key(const belady *s, uint32_t id)
{
    uint64_t nx = s->next_of[id];
    return nx == NEVER ? -INFINITY : -(double)nx;
}

static void bl_hit(ferry__policy *p, uint32_t slot, uint32_t id)
{
    belady *s = (belady *)p;
    (void)ferry__heap_set(&s->hp.heap, slot, bl_key(s, id));
}

static int bl_insert(ferry__policy *p, uint32_t slot, uint32_t id, int prefetch)
{
    belady *s = (belady *)p;
    if (prefetch)
        return FERRY_ENOTSUP;
    return ferry__heap_set(&s->hp.heap, slot, bl_key(s, id));
}

const ferry__policy_ops ferry__policy_belady = {
    .name = "belady",
    .describe = "Belady's MIN: evict the expert used furthest in the future (offline bound)",
    .state_size = sizeof(belady),
    .init = bl_init,
    .fini = bl_fini,
    .begin_step = bl_begin,
    .hit = bl_hit,
    .insert = bl_insert,
    .remove = ferry__heap_policy_remove,
    .victim = ferry__heap_policy_victim,
};
