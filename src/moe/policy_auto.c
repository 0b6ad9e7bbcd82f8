/*
 * policy_auto.c - set dueling between replacement policies, as CPU caches
 * choose between theirs: "auto" (the planner's default) runs global LRU
 * or the successor policy, "trio" global LRU, the routing policy or the
 * transition policy - whichever has been hitting most lately.
 *
 * Every member orders the real residents all the time (every hit, insert
 * and remove goes to each), so the cache can follow any of them at any
 * victim. Which one names the victim is decided by shadow caches -
 * metadata only: where each expert would be, no rows - one per member,
 * fed the same steps, on a sample of the layers (every stride-th: at most
 * 16 sampled layers; auto samples every layer of a model of at most
 * AUTO_FULL_IDS ids) with the same share of the slots. The learners'
 * shadows learn nothing themselves: each follows the real member's model
 * (ferry__successor_follow, ferry__routing_follow,
 * ferry__transition_follow), so a sampled step costs a shadow its
 * placements, not a second learning of the turn. The shadows place a
 * step as the real members did: before routing learns the turn (its
 * end_step) and after transition and successor have (their begin_step).
 * Each counts its hits with a decay of 1/WINDOW per sampled step; the
 * highest count leads, a tie going to the simpler policy (LRU first): a
 * policy that has not shown it is better does not lead. Nor does one
 * whose lead is within noise: a challenger takes over only when its score
 * passes the leader's by more than one standard deviation of that
 * difference - the square root of the decayed sum of squares of the
 * per-step hit differences of the two (decayed by the square of the
 * score's factor, as the variance of a weighted sum is), a paired test
 * kept for each pair of shadows on the sampled steps alone. On the
 * 81-token Mixtral capture (README, issue 27) trio's lead changed 16
 * times without it, and it ended 0.29 points below LRU at 25%; with it,
 * twice. A learner joins only while its model fits
 * AUTO_TRANSITION_MAX_BYTES.
 *
 * The followers pay for the winner only: a learner that does not lead
 * sleeps on the layers the shadows do not sample (ferry__successor_sleep:
 * rows and window kept, not classes; ferry__transition_sleep: rows and
 * routed sets, not cells; ferry__routing_sleep: features, not cells), and
 * wakes, rebuilt as if it had never slept, when it takes the lead. On
 * `ferry moe bench --quick`, where LRU leads, auto's successor classes a
 * quarter of the layer-steps (README, issue 27: 0.66-0.84 us a layer-step
 * against successor's 1.07-1.09 alone).
 * Its LRU is a list (O(1) per hit, where "lru" keeps a heap): the same
 * order but for ties within one step, which go by use rather than by slot.
 * Measured on the generator's traces: 8 sampled layers followed the better
 * policy less closely (up to 1.9 points behind it on a 256-token trace),
 * and a window of 4096 reacted later than 1024. On real decode routing
 * (README, "Real decode routing") auto's successor leads on OLMoE and
 * granite, LRU or successor on Mixtral; trio's transition leads on OLMoE
 * and LRU or routing where transition learns less.
 */
#include <errno.h>
#include <math.h>
#include <string.h>

#include "moe/moe_internal.h"

#define WINDOW 1024.0 /* sampled steps of memory */
#define SAMPLED 16u   /* most layers a shadow follows */
/* auto's shadows follow every layer of a model of at most this many ids
 * (Mixtral's 256, OLMoE's 1,024): sampled halves of a few small layers
 * told LRU and successor apart by chance (README, issue 27) */
#define AUTO_FULL_IDS 4096u
#define SWITCH_SD 1.0 /* standard deviations a challenger must lead by */
/* the largest transition table auto keeps; beyond it, lru and routing */
#define AUTO_TRANSITION_MAX_BYTES ((size_t)64 << 20)

/* ---- LRU as an intrusive list: least recent at the head ---- */
typedef struct lrul {
    ferry__policy base;
    uint32_t *nx, *pv; /* per slot; NONE at the ends and off the list */
    uint32_t head, tail;
} lrul;

#define NIL UINT32_MAX

static int ll_init(ferry__policy *p)
{
    lrul *s = (lrul *)p;
    uint32_t n = p->env.slots;
    s->nx = ferry__malloc((size_t)n * sizeof *s->nx);
    s->pv = ferry__malloc((size_t)n * sizeof *s->pv);
    if (!s->nx || !s->pv) {
        ferry__free(s->nx);
        ferry__free(s->pv);
        return -ENOMEM;
    }
    memset(s->nx, 0xff, (size_t)n * sizeof *s->nx);
    memset(s->pv, 0xff, (size_t)n * sizeof *s->pv);
    s->head = s->tail = NIL;
    return 0;
}

static void ll_fini(ferry__policy *p)
{
    lrul *s = (lrul *)p;
    ferry__free(s->nx);
    ferry__free(s->pv);
}

static void ll_unlink(lrul *s, uint32_t v)
{
    uint32_t a = s->pv[v], b = s->nx[v];
    if (a != NIL)
        s->nx[a] = b;
    else if (s->head == v)
        s->head = b;
    else
        return; /* not listed */
    if (b != NIL)
        s->pv[b] = a;
    else
        s->tail = a;
    s->nx[v] = s->pv[v] = NIL;
}

static void ll_append(lrul *s, uint32_t v)
{
    s->pv[v] = s->tail;
    s->nx[v] = NIL;
    if (s->tail != NIL)
        s->nx[s->tail] = v;
    else
        s->head = v;
    s->tail = v;
}

static void ll_hit(ferry__policy *p, uint32_t slot, uint32_t id)
{
    lrul *s = (lrul *)p;
    (void)id;
    if (s->tail != slot) {
        ll_unlink(s, slot);
        ll_append(s, slot);
    }
}

static int ll_insert(ferry__policy *p, uint32_t slot, uint32_t id, int prefetch)
{
    (void)id;
    (void)prefetch;
    ll_unlink((lrul *)p, slot);
    ll_append((lrul *)p, slot);
    return 0;
}

static void ll_remove(ferry__policy *p, uint32_t slot, uint32_t id, int evicted)
{
    (void)id;
    (void)evicted;
    ll_unlink((lrul *)p, slot);
}

/* the least recent unpinned: pinned ones are the step's (recent, at the
 * tail) or hinted ones the planner kept; walked over */
static int ll_victim(ferry__policy *p, uint32_t id, int have_free, uint32_t *slot)
{
    lrul *s = (lrul *)p;
    (void)id;
    if (have_free)
        return 1;
    for (uint32_t v = s->head; v != NIL; v = s->nx[v])
        if (!ferry__pinned(p, v)) {
            *slot = v;
            return 0;
        }
    return -1;
}

static const ferry__policy_ops lru_list = {
    .name = "lru",
    .describe = "least recently used, as a list",
    .state_size = sizeof(lrul),
    .init = ll_init,
    .fini = ll_fini,
    .hit = ll_hit,
    .insert = ll_insert,
    .remove = ll_remove,
    .victim = ll_victim,
};

typedef struct shadow {
    ferry__policy *pol;
    uint32_t slots, used;
    uint32_t *occ, *where;
    uint64_t *pin_step, pin_now, step;
    uint32_t *miss;
    double score;
    uint32_t hits; /* at the last sampled step */
} shadow;

#define NSUB 3 /* auto: 0 lru, 1 successor; trio: 0 lru, 1 routing, 2 transition (when
                * their models fit) */

typedef struct autop {
    ferry__policy base;
    ferry__policy *sub[NSUB];
    shadow sh[NSUB];
    uint32_t nsub, stride;
    int lead;              /* index into sub */
    uint64_t switches;
    /* per pair (i < j): the decayed sum of squares of the per-step hit
     * differences, the variance of sh[i].score - sh[j].score */
    double var[NSUB][NSUB];
} autop;

static void sub_destroy(ferry__policy *q)
{
    if (!q)
        return;
    q->ops->fini(q);
    ferry__free(q);
}

static ferry__policy *sub_create(const ferry__policy_ops *ops, const ferry__policy_env *env)
{
    ferry__policy *q = ferry__calloc(1, ops->state_size);
    if (!q)
        return NULL;
    q->ops = ops;
    q->env = *env;
    if (ops->init(q) < 0) {
        ferry__free(q);
        return NULL;
    }
    return q;
}

static void shadow_fini(shadow *h)
{
    sub_destroy(h->pol);
    ferry__free(h->occ);
    ferry__free(h->where);
    ferry__free(h->pin_step);
    ferry__free(h->miss);
    memset(h, 0, sizeof *h);
}

/* the shadow's policy: LRU, or a follower of the real routing or
 * transition policy's model (lead) */
static ferry__policy *shadow_policy(const ferry__policy_ops *ops, const ferry__policy_env *env,
                                    ferry__policy *lead)
{
    const ferry__policy_ops *fops = ops == &ferry__policy_routing      ? &ferry__policy_routing_follower
                                    : ops == &ferry__policy_transition ? &ferry__policy_transition_follower
                                    : ops == &ferry__policy_successor  ? &ferry__policy_successor_follower
                                                                       : NULL;
    if (!fops)
        return sub_create(ops, env);
    ferry__policy *q = ferry__calloc(1, fops->state_size);
    if (!q)
        return NULL;
    q->ops = fops;
    q->env = *env;
    int rc = fops == &ferry__policy_routing_follower     ? ferry__routing_follow(q, lead)
             : fops == &ferry__policy_transition_follower ? ferry__transition_follow(q, lead)
                                                          : ferry__successor_follow(q, lead);
    if (rc < 0) {
        ferry__free(q);
        return NULL;
    }
    return q;
}

static int shadow_init(shadow *h, const ferry__policy_ops *ops, const ferry__policy *parent,
                       uint32_t slots, ferry__policy *lead)
{
    const ferry__policy_env *pe = &parent->env;
    size_t ids = (size_t)pe->num_layers * pe->num_experts;
    h->slots = slots;
    h->occ = ferry__malloc((size_t)slots * sizeof *h->occ);
    h->pin_step = ferry__calloc(slots, sizeof *h->pin_step);
    h->where = ferry__malloc(ids * sizeof *h->where);
    h->miss = ferry__malloc((size_t)pe->num_experts * sizeof *h->miss);
    if (!h->occ || !h->pin_step || !h->where || !h->miss)
        return -ENOMEM;
    memset(h->occ, 0xff, (size_t)slots * sizeof *h->occ);
    memset(h->where, 0xff, ids * sizeof *h->where);
    ferry__policy_env env = *pe;
    env.slots = slots;
    env.pin_step = h->pin_step;
    env.pin_now = &h->pin_now;
    env.step = &h->step;
    env.occupant = h->occ;
    env.where = h->where;
    env.oracle = NULL;
    h->pin_now = 1;
    h->pol = shadow_policy(ops, &env, lead);
    return h->pol ? 0 : -ENOMEM;
}

/* one step of the shadow: as the planner's ensure, counting its hits; its
 * policy's end_step is the caller's (after the real policies' end_step:
 * the routing shadow follows the real one's model, updated there) */
static void shadow_step(shadow *h, uint32_t layer, const uint32_t *ids, uint32_t n)
{
    if (n > h->slots)
        return;
    h->step++;
    h->pin_now++;
    if (h->pol->ops->begin_step) /* (successor's follower: its pins end, its routed touched) */
        (void)h->pol->ops->begin_step(h->pol, layer, ids, n);
    uint32_t nm = 0, hits = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t slot = h->where[ids[i]];
        if (slot == FERRY_MOE_NONE) {
            h->miss[nm++] = ids[i];
            continue;
        }
        h->pin_step[slot] = h->pin_now;
        h->pol->ops->hit(h->pol, slot, ids[i]);
        hits++;
    }
    for (uint32_t i = 0; i < nm; i++) {
        uint32_t id = h->miss[i], slot = FERRY_MOE_NONE;
        int r = h->pol->ops->victim(h->pol, id, h->used < h->slots, &slot);
        if (r == 1 && h->used < h->slots) {
            slot = h->used++;
        } else if (r == 0 && slot < h->slots && h->occ[slot] != FERRY_MOE_NONE) {
            uint32_t old = h->occ[slot];
            h->pol->ops->remove(h->pol, slot, old, 1);
            h->where[old] = FERRY_MOE_NONE;
        } else {
            continue; /* cannot happen: n <= slots */
        }
        h->occ[slot] = id;
        h->where[id] = slot;
        h->pin_step[slot] = h->pin_now;
        if (h->pol->ops->insert(h->pol, slot, id, 0) < 0) {
            h->occ[slot] = FERRY_MOE_NONE;
            h->where[id] = FERRY_MOE_NONE;
        }
    }
    h->score = h->score * (1.0 - 1.0 / WINDOW) + hits;
    h->hits = hits;
}

/* 1 when a challenger's decayed score passes the leader's by more than
 * SWITCH_SD standard deviations of the difference (var: its variance) */
int ferry__auto_overtakes(double challenger, double leader, double var)
{
    return challenger - leader > SWITCH_SD * sqrt(var > 0 ? var : 0);
}

/* the pairs' variances, after a sampled step of the shadows */
static void duel_var(autop *s)
{
    const double q = (1.0 - 1.0 / WINDOW) * (1.0 - 1.0 / WINDOW);
    for (uint32_t i = 0; i < s->nsub; i++)
        for (uint32_t j = i + 1; j < s->nsub; j++) {
            double d = (double)s->sh[i].hits - (double)s->sh[j].hits;
            s->var[i][j] = s->var[i][j] * q + d * d;
        }
}

static void au_fini(ferry__policy *p)
{
    autop *s = (autop *)p;
    for (int i = 0; i < NSUB; i++) {
        sub_destroy(s->sub[i]);
        shadow_fini(&s->sh[i]);
    }
}

/* a member that does not lead sleeps off the sampled layers (its shadow
 * follows its model there); the lead is awake everywhere */
static void member_rest(autop *s, uint32_t i, int awake)
{
    ferry__policy *q = s->sub[i];
    if (q->ops == &ferry__policy_routing)
        (void)ferry__routing_sleep(q, awake ? 0 : s->stride);
    else if (q->ops == &ferry__policy_transition)
        (void)ferry__transition_sleep(q, awake ? 0 : s->stride);
    else if (q->ops == &ferry__policy_successor)
        (void)ferry__successor_sleep(q, awake ? 0 : s->stride);
}

static int au_init(ferry__policy *p)
{
    autop *s = (autop *)p;
    uint32_t L = p->env.num_layers, E = p->env.num_experts;
    s->stride = L <= SAMPLED ? 1 : (L + SAMPLED - 1) / SAMPLED;
    if (p->ops == &ferry__policy_auto && (uint64_t)L * E <= AUTO_FULL_IDS)
        s->stride = 1; /* a small model: shadows of every layer cost little */
    uint32_t sampled = (L + s->stride - 1) / s->stride;
    uint64_t ss = ((uint64_t)p->env.slots * sampled + L / 2) / L;
    const ferry__policy_ops *ops[NSUB] = {&lru_list, &ferry__policy_successor, NULL};
    s->nsub = ferry__successor_bytes(L, E) <= AUTO_TRANSITION_MAX_BYTES ? 2 : 1;
    if (p->ops == &ferry__policy_trio) {
        ops[1] = &ferry__policy_routing;
        ops[2] = &ferry__policy_transition;
        s->nsub = ferry__transition_bytes(L, E) <= AUTO_TRANSITION_MAX_BYTES ? NSUB : NSUB - 1;
    }
    for (uint32_t i = 0; i < s->nsub; i++) {
        s->sub[i] = sub_create(ops[i], &p->env);
        if (!s->sub[i] || shadow_init(&s->sh[i], ops[i], p, ss ? (uint32_t)ss : 1, s->sub[i]) < 0) {
            au_fini(p);
            return -ENOMEM;
        }
    }
    for (uint32_t i = 1; i < s->nsub; i++) /* LRU leads first */
        member_rest(s, i, 0);
    return 0;
}

/* the transition policy learns the turn as it begins, before its victims */
static int au_begin_step(ferry__policy *p, uint32_t layer, const uint32_t *ids, uint32_t n)
{
    autop *s = (autop *)p;
    for (uint32_t i = 0; i < s->nsub; i++) {
        int rc = s->sub[i]->ops->begin_step ? s->sub[i]->ops->begin_step(s->sub[i], layer, ids, n)
                                            : 0;
        if (rc < 0)
            return rc;
    }
    return 0;
}

static void au_end_step(ferry__policy *p, uint32_t layer, const uint32_t *ids, uint32_t n)
{
    autop *s = (autop *)p;
    int sampled = layer % s->stride == 0;
    /* the shadows place the step as of before the turn, as the real ones
     * did (transition learned it at begin_step, before its real victims
     * too); the routing turn is then learned once, by the real policy */
    if (sampled)
        for (uint32_t i = 0; i < s->nsub; i++)
            shadow_step(&s->sh[i], layer, ids, n);
    for (uint32_t i = 0; i < s->nsub; i++)
        if (s->sub[i]->ops->end_step)
            s->sub[i]->ops->end_step(s->sub[i], layer, ids, n);
    if (!sampled)
        return;
    for (uint32_t i = 0; i < s->nsub; i++)
        if (n <= s->sh[i].slots && s->sh[i].pol->ops->end_step)
            s->sh[i].pol->ops->end_step(s->sh[i].pol, layer, ids, n);
    duel_var(s);
    /* the highest score leads, a tie going to the simpler policy, if it
     * passes the leader by more than the noise */
    int lead = 0;
    for (uint32_t i = 1; i < s->nsub; i++)
        if (s->sh[i].score > s->sh[lead].score)
            lead = (int)i;
    if (lead != s->lead) {
        int a = lead < s->lead ? lead : s->lead, b = lead < s->lead ? s->lead : lead;
        if (!ferry__auto_overtakes(s->sh[lead].score, s->sh[s->lead].score, s->var[a][b]))
            lead = s->lead;
    }
    if (lead != s->lead) {
        /* the lead is awake on every layer (waking rebuilds its cells
         * before its next victim); the others sleep off the samples */
        if (lead)
            member_rest(s, (uint32_t)lead, 1);
        if (s->lead)
            member_rest(s, (uint32_t)s->lead, 0);
        s->lead = lead;
        s->switches++;
    }
}

static void au_hit(ferry__policy *p, uint32_t slot, uint32_t id)
{
    autop *s = (autop *)p;
    ll_hit(s->sub[0], slot, id); /* (sub[0] is lru_list: a call inlined) */
    for (uint32_t i = 1; i < s->nsub; i++)
        s->sub[i]->ops->hit(s->sub[i], slot, id);
}

static int au_insert(ferry__policy *p, uint32_t slot, uint32_t id, int prefetch)
{
    autop *s = (autop *)p;
    for (uint32_t i = 0; i < s->nsub; i++) {
        int rc = s->sub[i]->ops->insert(s->sub[i], slot, id, prefetch);
        if (rc < 0) {
            while (i-- > 0)
                s->sub[i]->ops->remove(s->sub[i], slot, id, 0);
            return rc;
        }
    }
    return 0;
}

static void au_remove(ferry__policy *p, uint32_t slot, uint32_t id, int evicted)
{
    autop *s = (autop *)p;
    for (uint32_t i = 0; i < s->nsub; i++)
        s->sub[i]->ops->remove(s->sub[i], slot, id, evicted);
}

static int au_victim(ferry__policy *p, uint32_t id, int have_free, uint32_t *slot)
{
    autop *s = (autop *)p;
    return s->sub[s->lead]->ops->victim(s->sub[s->lead], id, have_free, slot);
}

/* (tests, bench) the policy that names the victims now and how often the
 * lead has changed */
static int is_auto(const ferry__policy *p)
{
    return p && (p->ops == &ferry__policy_auto || p->ops == &ferry__policy_trio);
}

int ferry__auto_lead(const ferry__policy *p, uint64_t *switches)
{
    if (!is_auto(p))
        return -1;
    const autop *s = (const autop *)p;
    if (switches)
        *switches = s->switches;
    return s->lead;
}

/* the member of auto or trio run by ops, or its shadow; NULL if none */
static const ferry__policy *member(const ferry__policy *p, const ferry__policy_ops *ops, int sh)
{
    if (!is_auto(p))
        return NULL;
    const autop *s = (const autop *)p;
    for (uint32_t i = 0; i < s->nsub; i++)
        if (s->sub[i]->ops == ops)
            return sh ? s->sh[i].pol : s->sub[i];
    return NULL;
}

/* (tests) the routing sub-policy, for its structure checker */
const ferry__policy *ferry__auto_routing(const ferry__policy *p)
{
    return member(p, &ferry__policy_routing, 0);
}

/* (tests) the routing shadow, a follower of the routing sub-policy */
const ferry__policy *ferry__auto_shadow_routing(const ferry__policy *p)
{
    return member(p, &ferry__policy_routing, 1);
}

/* (tests) the transition sub-policy and its shadow */
const ferry__policy *ferry__auto_transition(const ferry__policy *p)
{
    return member(p, &ferry__policy_transition, 0);
}

const ferry__policy *ferry__auto_shadow_transition(const ferry__policy *p)
{
    return member(p, &ferry__policy_transition, 1);
}

/* (tests) the successor sub-policy and its shadow */
const ferry__policy *ferry__auto_successor(const ferry__policy *p)
{
    return member(p, &ferry__policy_successor, 0);
}

const ferry__policy *ferry__auto_shadow_successor(const ferry__policy *p)
{
    return member(p, &ferry__policy_successor, 1);
}

const ferry__policy_ops ferry__policy_auto = {
    .name = "auto",
    .describe = "lru or successor, whichever hits most lately in shadow caches of sampled "
                "layers (set dueling)",
    .state_size = sizeof(autop),
    .init = au_init,
    .fini = au_fini,
    .begin_step = au_begin_step,
    .end_step = au_end_step,
    .hit = au_hit,
    .insert = au_insert,
    .remove = au_remove,
    .victim = au_victim,
};

const ferry__policy_ops ferry__policy_trio = {
    .name = "trio",
    .describe = "lru, routing or transition, whichever hits most lately in shadow caches of "
                "sampled layers (set dueling)",
    .state_size = sizeof(autop),
    .init = au_init,
    .fini = au_fini,
    .begin_step = au_begin_step,
    .end_step = au_end_step,
    .hit = au_hit,
    .insert = au_insert,
    .remove = au_remove,
    .victim = au_victim,
};
