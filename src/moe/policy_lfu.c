/*
 * policy_lfu.c - frequency policies: LFU with exponential decay ("lfu") and
 * a frequency-weighted LRU ("lfru", after the vLLM expert-offload proposal).
 *
 * Frequency is a property of the expert, not of its stay in the cache, so
 * both keep per-expert history in dense arrays indexed by global id (the id
 * space is num_layers * num_experts, small) and it survives eviction.
 *
 * lfu: score(e) = sum over e's routes at step s of 2^(s / H), H the half-life
 * in steps (16 tokens * num_layers). Comparing such scores is comparing
 * decayed counts at any common time, and the key never has to be rewritten
 * as time passes; it is stored as log2 so it cannot overflow.
 *
 * lfru: key(e) = last use step + num_layers * log2(1 + routes(e)): recency
 * first, each doubling of an expert's route count buys it one more token of
 * protection.
 *
 * Both evict the minimum key (ties: lowest slot) from an indexed heap.
 */
#include <errno.h>
#include <math.h>

#include "moe/moe_internal.h"

#define LFU_HALF_LIFE_TOKENS 16.0

typedef struct freq {
    ferry__heap_policy hp;
    double *hist;   /* per id: lfu log2 score, or lfru route count */
    int lfru;
} freq;

static int freq_init_common(ferry__policy *p, int lfru)
{
    freq *s = (freq *)p;
    size_t ids = (size_t)p->env.num_layers * p->env.num_experts;
    s->lfru = lfru;
    if (ferry__heap_policy_init(p) < 0)
        return -ENOMEM;
    s->hist = ferry__malloc(ids * sizeof *s->hist);
    if (!s->hist) {
        ferry__heap_policy_fini(p);
        return -ENOMEM;
    }
    for (size_t i = 0; i < ids; i++)
        s->hist[i] = lfru ? 0.0 : -INFINITY;
    return 0;
}

static int lfu_init(ferry__policy *p)
{
    return freq_init_common(p, 0);
}

static int lfru_init(ferry__policy *p)
{
    return freq_init_common(p, 1);
}

static void freq_fini(ferry__policy *p)
{
    freq *s = (freq *)p;
    ferry__heap_policy_fini(p);
    ferry__free(s->hist);
}

static double log2add(double a, double b)
{
    if (a == -INFINITY)
        return b;
    double hi = a > b ? a : b, lo = a > b ? b : a;
    return hi + log2(1.0 + exp2(lo - hi));
}

/* record one route of id now and return its key */
static double freq_touch(freq *s, uint32_t id, int count_it)
{
    ferry__policy *p = &s->hp.base;
    double now = (double)*p->env.step;
    if (s->lfru) {
        if (count_it)
            s->hist[id] += 1.0;
        return now + (double)p->env.num_layers * log2(1.0 + s->hist[id]);
    }
    double t = now / (LFU_HALF_LIFE_TOKENS * p->env.num_layers);
    if (count_it)
        s->hist[id] = log2add(s->hist[id], t);
    /* a prefetched expert not yet routed ranks as one route now */
    return s->hist[id] == -INFINITY ? t : (count_it ? s->hist[id] : log2add(s->hist[id], t));
}

static void freq_hit(ferry__policy *p, uint32_t slot, uint32_t id)
{
    freq *s = (freq *)p;
    (void)ferry__heap_set(&s->hp.heap, slot, freq_touch(s, id, 1));
}

static int freq_insert(ferry__policy *p, uint32_t slot, uint32_t id, int prefetch)
{
    freq *s = (freq *)p;
    return ferry__heap_set(&s->hp.heap, slot, freq_touch(s, id, !prefetch));
}

const ferry__policy_ops ferry__policy_lfu = {
    .name = "lfu",
    .describe = "least frequently used, counts decaying with a half-life of 16 tokens",
    .state_size = sizeof(freq),
    .init = lfu_init,
    .fini = freq_fini,
    .hit = freq_hit,
    .insert = freq_insert,
    .remove = ferry__heap_policy_remove,
    .victim = ferry__heap_policy_victim,
};

const ferry__policy_ops ferry__policy_lfru = {
    .name = "lfru",
    .describe = "frequency-weighted LRU: last use + one token per doubling of route count",
    .state_size = sizeof(freq),
    .init = lfru_init,
    .fini = freq_fini,
    .hit = freq_hit,
    .insert = freq_insert,
    .remove = ferry__heap_policy_remove,
    .victim = ferry__heap_policy_victim,
};
