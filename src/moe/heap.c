/*
 * heap.c - an indexed binary min-heap over slot numbers, the base of the
 * policies built on one such heap, and the RNG.
 *
 * Invariant: h[0..n) is a heap under (key[slot], slot) ascending, and
 * pos[h[i]] == i for every member; pos[s] == UINT32_MAX for non-members.
 * Ordering ties by slot index makes every policy built on it deterministic
 * (lowest slot first, as ferrox's planner), and the position index makes
 * update and removal O(log n) so no policy ever scans all slots.
 */
#include <errno.h>
#include <string.h>

#include "moe/moe_internal.h"

static int less(const ferry__heap *hp, uint32_t a, uint32_t b)
{
    double ka = hp->key[a], kb = hp->key[b];
    if (ka != kb)
        return ka < kb;
    return a < b;
}

static void place(ferry__heap *hp, uint32_t i, uint32_t slot)
{
    hp->h[i] = slot;
    hp->pos[slot] = i;
}

static void sift_up(ferry__heap *hp, uint32_t i)
{
    uint32_t s = hp->h[i];
    while (i > 0) {
        uint32_t parent = (i - 1) / 2;
        if (!less(hp, s, hp->h[parent]))
            break;
        place(hp, i, hp->h[parent]);
        i = parent;
    }
    place(hp, i, s);
}

static void sift_down(ferry__heap *hp, uint32_t i)
{
    uint32_t s = hp->h[i];
    for (;;) {
        uint32_t l = 2 * i + 1, best = i;
        uint32_t bs = s;
        if (l < hp->n && less(hp, hp->h[l], bs)) {
            best = l;
            bs = hp->h[l];
        }
        if (l + 1 < hp->n && less(hp, hp->h[l + 1], bs)) {
            best = l + 1;
            bs = hp->h[l + 1];
        }
        if (best == i)
            break;
        place(hp, i, bs);
        i = best;
    }
    place(hp, i, s);
}

int ferry__heap_init(ferry__heap *hp, uint32_t cap, uint32_t *pos, double *key)
{
    memset(hp, 0, sizeof *hp);
    hp->pos = pos;
    hp->key = key;
    if (cap) {
        hp->h = ferry__malloc((size_t)cap * sizeof *hp->h);
        if (!hp->h)
            return -ENOMEM;
        /* touch it now: a page fault in the middle of a decode step costs
         * more than the step */
        memset(hp->h, 0xff, (size_t)cap * sizeof *hp->h);
        hp->cap = cap;
    }
    return 0;
}

void ferry__heap_fini(ferry__heap *hp)
{
    ferry__free(hp->h);
    hp->h = NULL;
    hp->n = hp->cap = 0;
}

int ferry__heap_contains(const ferry__heap *hp, uint32_t slot)
{
    uint32_t i = hp->pos[slot];
    return i < hp->n && hp->h[i] == slot;
}

int ferry__heap_set(ferry__heap *hp, uint32_t slot, double key)
{
    if (ferry__heap_contains(hp, slot)) {
        double old = hp->key[slot];
        hp->key[slot] = key;
        if (key < old)
            sift_up(hp, hp->pos[slot]);
        else
            sift_down(hp, hp->pos[slot]);
        return 0;
    }
    if (hp->n == hp->cap) {
        uint32_t nc = hp->cap ? hp->cap * 2 : 16;
        uint32_t *nh = ferry__realloc(hp->h, (size_t)nc * sizeof *nh);
        if (!nh)
            return -ENOMEM;
        hp->h = nh;
        hp->cap = nc;
    }
    hp->key[slot] = key;
    place(hp, hp->n, slot);
    hp->n++;
    sift_up(hp, hp->n - 1);
    return 0;
}

void ferry__heap_remove(ferry__heap *hp, uint32_t slot)
{
    if (!ferry__heap_contains(hp, slot))
        return;
    uint32_t i = hp->pos[slot];
    hp->pos[slot] = UINT32_MAX;
    hp->n--;
    if (i == hp->n)
        return;
    uint32_t last = hp->h[hp->n];
    place(hp, i, last);
    if (i > 0 && less(hp, last, hp->h[(i - 1) / 2]))
        sift_up(hp, i);
    else
        sift_down(hp, i);
}

uint32_t ferry__heap_top(const ferry__heap *hp)
{
    FERRY__ASSERT(!hp->n || hp->pos[hp->h[0]] == 0); /* the position index */
    return hp->n ? hp->h[0] : UINT32_MAX;
}

uint32_t ferry__heap_first_unpinned(ferry__heap *hp, const uint64_t *pin_step, uint64_t step,
                                    uint32_t *scratch, uint32_t scratch_cap)
{
    uint32_t found = UINT32_MAX, popped = 0;
    while (hp->n) {
        uint32_t s = hp->h[0];
        if (pin_step[s] != step) {
            found = s;
            break;
        }
        if (popped == scratch_cap)
            break;
        scratch[popped++] = s;
        ferry__heap_remove(hp, s);
    }
    /* re-insertion cannot fail: the array had room for them a moment ago */
    for (uint32_t i = 0; i < popped; i++) {
        int rc = ferry__heap_set(hp, scratch[i], hp->key[scratch[i]]);
        FERRY__ASSERT(rc == 0);
        (void)rc;
    }
    return found;
}

/* ---- the heap policy base ---- */
void ferry__heap_policy_fini(ferry__policy *p)
{
    ferry__heap_policy *s = (ferry__heap_policy *)p;
    ferry__heap_fini(&s->heap);
    ferry__free(s->pos);
    ferry__free(s->scratch);
    ferry__free(s->key);
    s->pos = s->scratch = NULL;
    s->key = NULL;
}

int ferry__heap_policy_init(ferry__policy *p)
{
    ferry__heap_policy *s = (ferry__heap_policy *)p;
    uint32_t n = p->env.slots;
    s->pos = ferry__malloc((size_t)n * sizeof *s->pos);
    s->scratch = ferry__malloc((size_t)n * sizeof *s->scratch);
    s->key = ferry__calloc(n, sizeof *s->key);
    if (!s->pos || !s->scratch || !s->key || ferry__heap_init(&s->heap, n, s->pos, s->key) < 0) {
        ferry__heap_policy_fini(p);
        return -ENOMEM;
    }
    memset(s->pos, 0xff, (size_t)n * sizeof *s->pos);
    return 0;
}

void ferry__heap_policy_remove(ferry__policy *p, uint32_t slot, uint32_t id, int evicted)
{
    ferry__heap_remove(&((ferry__heap_policy *)p)->heap, slot);
}

int ferry__heap_policy_victim(ferry__policy *p, uint32_t id, int have_free, uint32_t *slot)
{
    ferry__heap_policy *s = (ferry__heap_policy *)p;
    if (have_free)
        return 1;
    uint32_t v = ferry__heap_first_unpinned(&s->heap, p->env.pin_step, *p->env.pin_now, s->scratch,
                                            p->env.slots);
    if (v == UINT32_MAX)
        return -1;
    *slot = v;
    return 0;
}

/* ---- xoshiro256** seeded by splitmix64 ---- */
static uint64_t splitmix(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

void ferry__rng_seed(ferry__rng *r, uint64_t seed)
{
    for (int i = 0; i < 4; i++)
        r->s[i] = splitmix(&seed);
}

static uint64_t rotl(uint64_t x, int k)
{
    return (x << k) | (x >> (64 - k));
}

uint64_t ferry__rng_next(ferry__rng *r)
{
    uint64_t *s = r->s;
    uint64_t result = rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

uint32_t ferry__rng_below(ferry__rng *r, uint32_t n)
{
    return (uint32_t)(((ferry__rng_next(r) >> 32) * (uint64_t)n) >> 32);
}

double ferry__rng_unit(ferry__rng *r)
{
    return (double)(ferry__rng_next(r) >> 11) * (1.0 / 9007199254740992.0);
}
