/*
 * planner.c - which expert lives in which slot (ferrox's ExpertCache).
 *
 * Invariants:
 *  - occupant[] and where[] are inverse maps: occupant[s] == id exactly
 *    when where[id] == s; a slot with no occupant is in the free heap and
 *    in no policy structure; a resident slot is in its policy's structure.
 *  - Every expert of the current step has pin_step[slot] == pin_now and is
 *    never a victim; a prefetch pins what it names with the same pin_now,
 *    so it can neither evict the current step's experts nor its own. A
 *    streamed step (more experts than slots, or a prefill) pins one wave
 *    at a time: pin_now advances between waves, so a wave may evict the
 *    experts of the waves before it, never its own.
 *  - A call that fails validation changes nothing: ensure() checks the
 *    whole route (and, for belady, the oracle) before the step advances.
 * Free slots are handed out lowest index first (a min-heap), the same
 * tie-break as the policies, so a run is a function of its inputs alone.
 * The planner holds no device memory; the executor (slots.c) does, and
 * forget() is how its failures reach the planner.
 *
 * Hints (ferry_moe_planner_hint): predicted routes of a later step live in
 * a table (hints.c) until that step has begun. A victim the policy names
 * whose expert is hinted is "soft pinned" for the rest of the round
 * (pin_step == pin_now, as a pin, so the policy offers another, but
 * soft_at[slot] == pin_now too and n_pinned does not count it), so victims
 * come from unhinted slots first - when the hint is worth it: the
 * probability that it is right (its confidence, calibrated by how often
 * hints came true) must beat the chance that the victim taken instead is
 * routed again within a token (measured on evictions). When the policy has
 * nothing left, the soft pinned slot of least value (that probability over
 * steps to its use) is evicted: a hint never makes a step fail. pin() turns
 * a soft pin into a real one when the step or a prefetch names the slot.
 * A hint prefetch plans a missing expert only when it is expected to save
 * more rows than it costs: into a free slot when it is right more often than
 * not, into a victim's slot only when that margin also pays for the
 * victim's expected return.
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "moe/moe_internal.h"
#include "sized.h"

struct ferry_moe_planner {
    ferry__errbuf err;
    uint32_t L, E, slots;
    uint32_t *occupant;   /* per slot */
    uint32_t *where;      /* per id */
    uint64_t *pin_step;   /* per slot */
    uint8_t *prefetched;  /* per slot: brought by prefetch, not routed since */
    /* free slots: every slot from free_fresh on (never handed out since
     * the slot arrays were made), and below it the heap of those freed
     * again; the lowest free slot is the heap's top, else free_fresh */
    ferry__heap freeh;
    uint32_t free_fresh;
    uint32_t *free_pos;
    double *free_key;     /* all zero: free slots order by index */
    uint64_t *seen;       /* per expert (a step's ids are one layer's): gen of the
                             call that last saw it */
    uint64_t gen, step, pin_now;
    uint32_t n_pinned;    /* slots with pin_step == pin_now */
    ferry__tok token;     /* tokens begun - 1 (64 bits: see ferry__tok) */
    uint32_t last_layer;
    int started;
    /* an open stream: its distinct ids (resident ones first), the next one
     * to serve, the wave buffers */
    int streaming, st_first;
    uint32_t st_layer, st_n, st_pos;
    uint32_t *st_ids, *wave_ex, *wave_slot; /* E each */
    uint32_t *uniq, *miss, *plan_dst, *plan_row, *iota;  /* E each */
    ferry__policy *pol;
    const ferry__policy_ops *pops;
    const ferry_moe_trace *oracle;
    uint64_t expert_bytes;
    uint32_t top_k;       /* 0: not known */
    ferry_moe_planner_stats st;
    /* hints: the table, the round's soft pins (soft_at per slot, the
     * list for the fallback), candidates of a hint prefetch, counts */
    ferry__hints hints;
    uint64_t *soft_at;
    uint32_t *soft_list, n_soft;
    struct hcand {
        double v;
        uint32_t id;
    } *hcand;
    ferry_moe_hint_stats hst;
};

static int soft_arrays(ferry_moe_planner *p, uint32_t n);

static int is_soft(const ferry_moe_planner *p, uint32_t slot)
{
    return p->soft_at && p->soft_at[slot] == p->pin_now && p->pin_step[slot] == p->pin_now;
}

/* pin a slot for the current step (or wave), counted once */
static void pin(ferry_moe_planner *p, uint32_t slot)
{
    if (p->pin_step[slot] != p->pin_now) {
        p->pin_step[slot] = p->pin_now;
        p->n_pinned++;
    } else if (is_soft(p, slot)) {
        p->soft_at[slot] = UINT64_MAX; /* a hinted one named now: pinned */
        p->n_pinned++;
    }
    FERRY__ASSERT(p->n_pinned <= p->slots);
}

static void unpin_all(ferry_moe_planner *p)
{
    p->pin_now++;
    p->n_pinned = 0;
    p->n_soft = 0;
}

static const ferry__policy_ops *const registry[] = {
    &ferry__policy_lru,    &ferry__policy_lru_layer, &ferry__policy_lfu,
    &ferry__policy_lfru,   &ferry__policy_s3fifo,    &ferry__policy_routing,
    &ferry__policy_arc,    &ferry__policy_auto,      &ferry__policy_belady,
    &ferry__policy_transition, &ferry__policy_successor, &ferry__policy_trio,
};

static const char *const policy_names[] = {"lru",     "lru-layer", "lfu",    "lfru",
                                           "s3fifo",  "routing",   "arc",    "auto",
                                           "belady",  "transition", "successor", "trio", NULL};

const char *const *ferry_moe_policies(void)
{
    return policy_names;
}

const ferry__policy_ops *ferry__policy_find(const char *name)
{
    for (size_t i = 0; i < FERRY__ARRAY_LEN(registry); i++)
        if (!strcmp(registry[i]->name, name))
            return registry[i];
    return NULL;
}

const char *ferry_moe_policy_describe(const char *name)
{
    const ferry__policy_ops *o = name ? ferry__policy_find(name) : NULL;
    return o ? o->describe : NULL;
}

static void policy_destroy(ferry__policy *pol)
{
    if (!pol)
        return;
    pol->ops->fini(pol);
    ferry__free(pol);
}

/* a policy over `slots` slots reading the given planner arrays */
static int policy_create(ferry_moe_planner *p, uint32_t slots, const uint64_t *pin_step,
                         const uint32_t *occupant, ferry__policy **out)
{
    ferry__policy *pol = ferry__calloc(1, p->pops->state_size);
    if (!pol)
        return -ENOMEM;
    pol->ops = p->pops;
    pol->env.num_layers = p->L;
    pol->env.num_experts = p->E;
    pol->env.slots = slots;
    pol->env.top_k = p->top_k;
    pol->env.pin_step = pin_step;
    pol->env.pin_now = &p->pin_now;
    pol->env.step = &p->step;
    pol->env.token = &p->token;
    pol->env.occupant = occupant;
    pol->env.where = p->where;
    pol->env.oracle = p->oracle;
    int rc = pol->ops->init(pol);
    if (rc < 0) {
        ferry__free(pol);
        return rc;
    }
    *out = pol;
    return 0;
}

void ferry_moe_planner_destroy(ferry_moe_planner *p)
{
    if (!p)
        return;
    policy_destroy(p->pol);
    ferry__heap_fini(&p->freeh);
    ferry__free(p->occupant);
    ferry__free(p->where);
    ferry__free(p->pin_step);
    ferry__free(p->prefetched);
    ferry__free(p->free_pos);
    ferry__free(p->free_key);
    ferry__free(p->seen);
    ferry__free(p->uniq);
    ferry__free(p->miss);
    ferry__free(p->plan_dst);
    ferry__free(p->plan_row);
    ferry__free(p->iota);
    ferry__free(p->st_ids);
    ferry__free(p->wave_ex);
    ferry__free(p->wave_slot);
    ferry__hints_fini(&p->hints);
    ferry__free(p->soft_at);
    ferry__free(p->soft_list);
    ferry__free(p->hcand);
    ferry__free(p);
}

/* slot arrays for n slots, all free */
static int slot_arrays(uint32_t n, uint32_t **occ, uint64_t **pin, uint8_t **pf, uint32_t **fpos,
                       double **fkey, ferry__heap *fh)
{
    *occ = ferry__malloc((size_t)n * sizeof **occ);
    *pin = ferry__malloc((size_t)n * sizeof **pin);
    *pf = ferry__calloc(n, 1);
    *fpos = ferry__malloc((size_t)n * sizeof **fpos);
    *fkey = ferry__calloc(n, sizeof **fkey);
    if (!*occ || !*pin || !*pf || !*fpos || !*fkey || ferry__heap_init(fh, n, *fpos, *fkey) < 0) {
        ferry__free(*occ);
        ferry__free(*pin);
        ferry__free(*pf);
        ferry__free(*fpos);
        ferry__free(*fkey);
        *occ = NULL;
        *pin = NULL;
        *pf = NULL;
        *fpos = NULL;
        *fkey = NULL;
        return -ENOMEM;
    }
    memset(*occ, 0xff, (size_t)n * sizeof **occ);
    memset(*pin, 0xff, (size_t)n * sizeof **pin);
    memset(*fpos, 0xff, (size_t)n * sizeof **fpos);
    return 0; /* (the heap is empty: every slot is fresh) */
}

/* free slots */
static uint32_t free_count(const ferry_moe_planner *p)
{
    return p->freeh.n + (p->slots - p->free_fresh);
}

/* the lowest free slot, taken; free_count() > 0. The heap's slots are
 * below free_fresh (each was handed out before it was freed). A fill
 * takes fresh slots in O(1), not a heap removal each. */
static uint32_t free_take(ferry_moe_planner *p)
{
    if (!p->freeh.n)
        return p->free_fresh++;
    uint32_t slot = ferry__heap_top(&p->freeh);
    ferry__heap_remove(&p->freeh, slot);
    return slot;
}

int ferry_moe_planner_create(const ferry_moe_planner_options *uopt, ferry_moe_planner **out)
{
    if (!uopt || !out)
        return ferry__err_set(NULL, -EINVAL, "moe planner: options missing");
    /* an older header's options: the members past its size keep their defaults */
    static const ferry__member later[] = {
        FERRY__MEMBER(ferry_moe_planner_options, policy),
        FERRY__MEMBER(ferry_moe_planner_options, oracle),
        FERRY__MEMBER(ferry_moe_planner_options, expert_bytes),
        FERRY__MEMBER(ferry_moe_planner_options, top_k)};
    static const ferry__sized sized =
        FERRY__SIZED(ferry_moe_planner_options, FERRY_MOE_PLANNER_OPTIONS_MIN_SIZE, later);
    ferry_moe_planner_options o = FERRY_MOE_PLANNER_OPTIONS_INIT;
    int rc = ferry__opts_take(NULL, "moe planner", &sized, &o, uopt);
    if (rc < 0)
        return rc;
    const ferry_moe_planner_options *opt = &o;
    /* the dense per-expert and per-slot arrays are sized by these: every
     * one in range before any product is formed */
    if (!opt->num_layers || opt->num_layers > FERRY_MOE_MAX_LAYERS)
        return ferry__err_set(NULL, -EINVAL, "moe planner: num_layers %u: accepted 1..%u",
                              opt->num_layers, FERRY_MOE_MAX_LAYERS);
    if (!opt->num_experts || opt->num_experts > FERRY_MOE_MAX_EXPERTS)
        return ferry__err_set(NULL, -EINVAL, "moe planner: num_experts %u: accepted 1..%u",
                              opt->num_experts, FERRY_MOE_MAX_EXPERTS);
    if (opt->top_k > opt->num_experts)
        return ferry__err_set(NULL, -EINVAL, "moe planner: top_k %u: accepted 0..num_experts (%u)",
                              opt->top_k, opt->num_experts);
    if (opt->slots < 1 || opt->slots > FERRY_MOE_MAX_SLOTS)
        return ferry__err_set(NULL, -EINVAL, "moe planner: slots %u: accepted 1..%u", opt->slots,
                              FERRY_MOE_MAX_SLOTS);
    const char *name = opt->policy ? opt->policy : "auto";
    const ferry__policy_ops *ops = ferry__policy_find(name);
    if (!ops)
        return ferry__err_set(NULL, -EINVAL,
                              "moe planner: policy '%s': unknown (see ferry_moe_policies(); NULL "
                              "means auto)",
                              name);
    if (ops == &ferry__policy_belady) {
        if (!opt->oracle)
            return ferry__err_set(NULL, -EINVAL, "moe planner: policy belady needs the trace (oracle)");
        const ferry_moe_model *m = &opt->oracle->model;
        if (m->num_layers != opt->num_layers || m->num_experts != opt->num_experts)
            return ferry__err_set(NULL, -EINVAL,
                                  "moe planner: oracle trace is %u x %u experts, planner %u x %u",
                                  m->num_layers, m->num_experts, opt->num_layers, opt->num_experts);
    }
    /* the learned models' size, bounded alike */
    size_t model = ops == &ferry__policy_transition
                       ? ferry__transition_bytes(opt->num_layers, opt->num_experts)
                   : ops == &ferry__policy_successor
                       ? ferry__successor_bytes(opt->num_layers, opt->num_experts)
                       : 0;
    if (model > FERRY__TRANSITION_MAX_BYTES)
        return ferry__err_set(NULL, -EINVAL,
                              "moe planner: policy %s: %u layers x %u experts need %zu bytes of "
                              "%s model, more than the %zu accepted",
                              ops->name, opt->num_layers, opt->num_experts, model, ops->name,
                              (size_t)FERRY__TRANSITION_MAX_BYTES);
    ferry_moe_planner *p = ferry__calloc(1, sizeof *p);
    if (!p)
        return ferry__err_set(NULL, -ENOMEM, "moe planner: out of memory");
    p->L = opt->num_layers;
    p->E = opt->num_experts;
    p->slots = opt->slots;
    p->pops = ops;
    p->oracle = ops == &ferry__policy_belady ? opt->oracle : NULL;
    p->expert_bytes = opt->expert_bytes;
    p->top_k = opt->top_k;
    size_t ids = (size_t)p->L * p->E;
    rc = slot_arrays(p->slots, &p->occupant, &p->pin_step, &p->prefetched, &p->free_pos,
                     &p->free_key, &p->freeh);
    if (rc < 0)
        goto oom;
    p->where = ferry__malloc(ids * sizeof *p->where);
    p->seen = ferry__calloc(p->E, sizeof *p->seen);
    p->uniq = ferry__malloc((size_t)p->E * sizeof(uint32_t));
    p->miss = ferry__malloc((size_t)p->E * sizeof(uint32_t));
    p->plan_dst = ferry__malloc((size_t)p->E * sizeof(uint32_t));
    p->plan_row = ferry__malloc((size_t)p->E * sizeof(uint32_t));
    p->iota = ferry__malloc((size_t)p->E * sizeof(uint32_t));
    p->st_ids = ferry__malloc((size_t)p->E * sizeof(uint32_t));
    p->wave_ex = ferry__malloc((size_t)p->E * sizeof(uint32_t));
    p->wave_slot = ferry__malloc((size_t)p->E * sizeof(uint32_t));
    if (!p->where || !p->seen || !p->uniq || !p->miss || !p->plan_dst || !p->plan_row || !p->iota ||
        !p->st_ids || !p->wave_ex || !p->wave_slot)
        goto oom;
    memset(p->where, 0xff, ids * sizeof *p->where);
    for (uint32_t e = 0; e < p->E; e++)
        p->iota[e] = e;
    rc = policy_create(p, p->slots, p->pin_step, p->occupant, &p->pol);
    if (rc < 0)
        goto oom;
    *out = p;
    return 0;
oom:
    ferry_moe_planner_destroy(p);
    return ferry__err_set(NULL, -ENOMEM, "moe planner: out of memory for %u slots, %u x %u experts",
                          opt->slots, opt->num_layers, opt->num_experts);
}

const char *ferry_moe_planner_last_error(const ferry_moe_planner *p)
{
    return p ? ferry__err_msg(&p->err) : "";
}

const char *ferry_moe_planner_policy(const ferry_moe_planner *p)
{
    return p ? p->pops->name : "";
}

const ferry__policy *ferry__planner_policy(const ferry_moe_planner *p)
{
    return p->pol;
}

int ferry__planner_skip_tokens(ferry_moe_planner *p, uint64_t tokens, uint64_t turns)
{
    if (!p)
        return -EINVAL;
    ferry__policy *r = p->pol->ops == &ferry__policy_routing
                           ? p->pol
                           : (ferry__policy *)ferry__auto_routing(p->pol);
    int rc = r ? ferry__routing_skip(r, tokens, turns) : 0;
    if (rc < 0)
        return rc;
    p->token += tokens;
    return 0;
}

double ferry__planner_hint_p(const ferry_moe_planner *p, double c)
{
    return p->hints.pos ? ferry__hints_pc(&p->hints, c, 1) : c;
}

uint32_t ferry_moe_planner_slots(const ferry_moe_planner *p)
{
    return p ? p->slots : 0;
}

/* validate a route and collect its distinct global ids into p->uniq */
static int collect(ferry_moe_planner *p, const char *what, uint32_t layer, const uint32_t *experts,
                   uint32_t n, uint32_t *nu)
{
    if (layer >= p->L)
        return ferry__err_set(&p->err, -EINVAL, "moe %s: layer %u out of range (model has %u)", what,
                              layer, p->L);
    if (n == 0 || !experts)
        return ferry__err_set(&p->err, -EINVAL, "moe %s: empty route at layer %u", what, layer);
    /* checked and deduplicated in one pass: a bad id leaves only marks of
     * this generation in seen[], which the next one's ignores */
    uint64_t gen = ++p->gen;
    uint32_t k = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t e = experts[i];
        if (e >= p->E)
            return ferry__err_set(&p->err, -EINVAL,
                                  "moe %s: layer %u route %u names expert %u, model has %u", what,
                                  layer, i, e, p->E);
        if (p->seen[e] == gen)
            continue;
        p->seen[e] = gen;
        p->uniq[k++] = layer * p->E + e;
    }
    *nu = k;
    return 0;
}

/* drop slot's occupant (evicted = chosen as a victim, else forgotten) */
static void drop(ferry_moe_planner *p, uint32_t slot, int evicted)
{
    uint32_t id = p->occupant[slot];
    FERRY__ASSERT(id != FERRY_MOE_NONE && p->where[id] == slot); /* inverse maps */
    p->pol->ops->remove(p->pol, slot, id, evicted);
    if (evicted && p->hints.pos)
        ferry__hints_evicted(&p->hints, id, p->step);
    p->where[id] = FERRY_MOE_NONE;
    p->occupant[slot] = FERRY_MOE_NONE;
    if (p->prefetched[slot]) {
        p->st.prefetch_wasted++;
        p->prefetched[slot] = 0;
    }
}

/* the soft pinned slot of least value (ties: the lowest slot), if its
 * value is below floor; NONE otherwise */
static uint32_t soft_victim(ferry_moe_planner *p, double floor)
{
    uint32_t best = FERRY_MOE_NONE;
    double bv = floor;
    for (uint32_t i = 0; i < p->n_soft; i++) {
        uint32_t s = p->soft_list[i];
        if (!is_soft(p, s) || p->occupant[s] == FERRY_MOE_NONE)
            continue;
        double v = ferry__hints_value(&p->hints, p->occupant[s], p->step, 0);
        if (v < bv || (v == bv && best != FERRY_MOE_NONE && s < best)) {
            bv = v;
            best = s;
        }
    }
    return best;
}

/* a resident hinted expert is kept over another victim only when it is
 * more likely used than an evicted expert is routed again within a token */
static int protected_hint(const ferry_moe_planner *p, uint32_t id)
{
    return ferry__hints_live(&p->hints, id) &&
           ferry__hints_p(&p->hints, id, 0) > ferry__hints_reuse(&p->hints);
}

/* find a home for id: a free slot or a victim; returns the slot or NONE.
 * A hinted victim is soft pinned and the policy asked again; when it has
 * none left, a soft pinned slot worth less than floor is evicted. */
static uint32_t place(ferry_moe_planner *p, uint32_t id, double floor)
{
    for (;;) {
        uint32_t slot = FERRY_MOE_NONE;
        int r = p->pol->ops->victim(p->pol, id, free_count(p) > 0, &slot);
        if (r == 1 && free_count(p))
            return free_take(p);
        if (r == 0 && (slot >= p->slots || p->occupant[slot] == FERRY_MOE_NONE ||
                       p->pin_step[slot] == p->pin_now))
            return FERRY_MOE_NONE; /* (no policy names a pinned slot) */
        if (r == 0 && !protected_hint(p, p->occupant[slot])) {
            drop(p, slot, 1);
            p->st.evictions++;
            return slot;
        }
        if (r == 0) { /* hinted: kept this round if anything else can go */
            p->pin_step[slot] = p->pin_now;
            p->soft_at[slot] = p->pin_now;
            p->soft_list[p->n_soft++] = slot;
            p->hst.saves++;
            continue;
        }
        slot = p->n_soft ? soft_victim(p, floor) : FERRY_MOE_NONE;
        if (slot == FERRY_MOE_NONE)
            return FERRY_MOE_NONE;
        p->soft_at[slot] = UINT64_MAX;
        p->pin_step[slot] = UINT64_MAX; /* pin() counts its next occupant */
        p->hst.saves--;
        p->hst.evicted++;
        drop(p, slot, 1);
        p->st.evictions++;
        return slot;
    }
}

uint64_t ferry__planner_fault_insert;

/* what settle() did to slot undone: free, unpinned, its occupant gone
 * (told to the policy when it had been told of it) */
static void unsettle(ferry_moe_planner *p, uint32_t slot, int told)
{
    uint32_t id = p->occupant[slot];
    if (told)
        p->pol->ops->remove(p->pol, slot, id, 0);
    p->where[id] = FERRY_MOE_NONE;
    p->occupant[slot] = FERRY_MOE_NONE;
    p->prefetched[slot] = 0;
    p->pin_step[slot] = UINT64_MAX;
    p->n_pinned--;
    (void)ferry__heap_set(&p->freeh, slot, 0);
}

/* id moves into slot (free now), pinned; a policy's failure frees it */
static int settle(ferry_moe_planner *p, const char *what, uint32_t layer, uint32_t slot,
                  uint32_t id, int prefetch)
{
    FERRY__ASSERT(p->occupant[slot] == FERRY_MOE_NONE && p->where[id] == FERRY_MOE_NONE);
    p->occupant[slot] = id;
    p->where[id] = slot;
    pin(p, slot);
    p->prefetched[slot] = (uint8_t)(prefetch != 0);
    int rc = ferry__planner_fault_insert && !--ferry__planner_fault_insert
                 ? -ENOMEM
                 : p->pol->ops->insert(p->pol, slot, id, prefetch);
    if (rc < 0) {
        unsettle(p, slot, 0);
        return ferry__err_set(&p->err, rc, "moe %s: layer %u expert %u: policy %s: %s", what,
                              layer, id % p->E, p->pops->name, ferry_strerror(rc));
    }
    return 0;
}

/* place the misses p->miss[0..nm) of layer; fills the plan. All or none:
 * a failure part way takes back the misses placed before it (their rows
 * were never copied: a later step must miss them, not find them resident
 * in slots that hold other bytes); the victims evicted for them stay out */
static int place_misses(ferry_moe_planner *p, const char *what, uint32_t layer, uint32_t nm,
                        int prefetch)
{
    for (uint32_t i = 0; i < nm; i++) {
        uint32_t id = p->miss[i];
        uint32_t slot = place(p, id, INFINITY);
        int rc = slot == FERRY_MOE_NONE
                     ? ferry__err_set(&p->err, FERRY_ENOSPACE,
                                      "moe %s: layer %u expert %u: every one of %u slots is "
                                      "pinned by the current step",
                                      what, layer, id % p->E, p->slots)
                     : settle(p, what, layer, slot, id, prefetch);
        if (rc < 0) {
            while (i-- > 0)
                unsettle(p, p->plan_dst[i], 1);
            return rc;
        }
        p->plan_dst[i] = slot;
        p->plan_row[i] = id % p->E;
    }
    return 0;
}

static void fill_plan(ferry_moe_planner *p, uint32_t layer, uint32_t n, ferry_moe_copy_plan *plan)
{
    if (!plan)
        return;
    plan->layer = layer;
    plan->n = n;
    plan->dst_slots = p->plan_dst;
    plan->src_rows = p->plan_row;
}

static int stream_open(ferry_moe_planner *p, const char *what)
{
    if (!p->streaming)
        return 0;
    return ferry__err_set(&p->err, FERRY_ESTATE,
                          "moe %s: a streamed step of layer %u is open (%u of %u experts "
                          "served): call ferry_moe_planner_stream_next until it returns 0",
                          what, p->st_layer, p->st_pos, p->st_n);
}

/* the step p->step began (its ids marked seen with p->gen): the hints
 * made for it are right or wrong now, and leave the table unless a later
 * step was hinted too */
static void settle_hints(ferry_moe_planner *p)
{
    uint32_t id;
    while ((id = ferry__hints_due(&p->hints, p->step)) != UINT32_MAX) {
        int right = p->hints.near[id] == (double)p->step &&
                    id - p->last_layer * p->E < p->E && p->seen[id % p->E] == p->gen;
        if (right)
            p->hst.right++;
        else
            p->hst.wrong++;
        ferry__hints_settled(&p->hints, id, right);
        ferry__hints_next(&p->hints, id, p->step);
    }
}

/* validate a step, let the policy see it, advance the step; stream: the
 * step may hold more experts than slots */
static int step_begin(ferry_moe_planner *p, const char *what, uint32_t layer,
                      const uint32_t *experts, uint32_t n, uint32_t *nu)
{
    int rc = stream_open(p, what);
    if (rc < 0 || (rc = collect(p, what, layer, experts, n, nu)) < 0)
        return rc;
    if (what[0] == 'e' && *nu > p->slots)
        return ferry__err_set(&p->err, FERRY_ENOSPACE,
                              "moe ensure: layer %u routes %u experts, more than the %u slots "
                              "hold at once: stream the step (ferry_moe_planner_stream_begin)",
                              layer, *nu, p->slots);
    if (p->pol->ops->begin_step && (rc = p->pol->ops->begin_step(p->pol, layer, p->uniq, *nu)) < 0)
        return ferry__err_set(&p->err, rc,
                              "moe %s: policy %s cannot follow step %llu (layer %u, %u "
                              "experts): not the next step of its trace",
                              what, p->pops->name, (unsigned long long)p->step + 1, layer, *nu);
    if (p->started && layer <= p->last_layer)
        p->token++;
    p->started = 1;
    p->last_layer = layer;
    p->step++;
    unpin_all(p);
    settle_hints(p);
    return 0;
}

/* the step's resident experts: pinned, hit; the others into miss[]
 * (*nm); returns how many of the resident ones a prefetch brought */
static uint32_t step_hits(ferry_moe_planner *p, uint32_t nu, uint32_t *nm, uint32_t *miss)
{
    uint32_t pf_hits = 0;
    for (uint32_t i = 0; i < nu; i++) {
        uint32_t id = p->uniq[i], slot = p->where[id];
        if (slot == FERRY_MOE_NONE) {
            miss[(*nm)++] = id;
            if (p->hints.pos)
                ferry__hints_missed(&p->hints, id, p->step, p->L);
            continue;
        }
        FERRY__ASSERT(p->occupant[slot] == id);
        pin(p, slot);
        if (p->prefetched[slot]) {
            p->prefetched[slot] = 0;
            pf_hits++;
        }
        p->pol->ops->hit(p->pol, slot, id);
    }
    return pf_hits;
}

static void step_count(ferry_moe_planner *p, uint32_t nu, uint32_t nm, uint32_t pf_hits,
                       ferry_moe_counts *counts)
{
    p->st.steps++;
    p->st.routes += nu;
    p->st.hits += nu - nm;
    p->st.misses += nm;
    p->st.prefetch_hits += pf_hits;
    if (counts) {
        counts->active = nu;
        counts->missing = nm;
        counts->fetched = nm;
        counts->prefetch_hits = pf_hits;
    }
}

int ferry_moe_planner_ensure(ferry_moe_planner *p, uint32_t layer, const uint32_t *experts,
                             uint32_t n, uint32_t *slots_out, ferry_moe_copy_plan *plan,
                             ferry_moe_counts *counts)
{
    if (!p)
        return ferry__err_set(NULL, -EINVAL, "moe ensure: no planner");
    uint32_t nu;
    int rc = step_begin(p, "ensure", layer, experts, n, &nu);
    if (rc < 0)
        return rc;
    uint32_t nm = 0, pf_hits = step_hits(p, nu, &nm, p->miss);
    rc = place_misses(p, "ensure", layer, nm, 0);
    if (rc < 0)
        return rc;
    if (slots_out)
        for (uint32_t i = 0; i < n; i++)
            slots_out[i] = p->where[layer * p->E + experts[i]];
    if (p->pol->ops->end_step)
        p->pol->ops->end_step(p->pol, layer, p->uniq, nu);
    step_count(p, nu, nm, pf_hits, counts);
    fill_plan(p, layer, nm, plan);
    return (int)nm;
}

int ferry_moe_planner_stream_begin(ferry_moe_planner *p, uint32_t layer, const uint32_t *experts,
                                   uint32_t n, ferry_moe_counts *counts)
{
    if (!p)
        return ferry__err_set(NULL, -EINVAL, "moe stream: no planner");
    uint32_t nu;
    int rc = step_begin(p, "stream", layer, experts, n, &nu);
    if (rc < 0)
        return rc;
    /* resident ones first: the first wave serves them before anything of
     * this step can evict them */
    uint32_t nr = 0;
    for (uint32_t i = 0; i < nu; i++)
        if (p->where[p->uniq[i]] != FERRY_MOE_NONE)
            p->st_ids[nr++] = p->uniq[i];
    uint32_t nm = 0, pf_hits = step_hits(p, nu, &nm, p->st_ids + nr);
    step_count(p, nu, nm, pf_hits, counts);
    p->streaming = 1;
    p->st_first = 1;
    p->st_layer = layer;
    p->st_n = nu;
    p->st_pos = 0;
    return (int)nm;
}

int ferry_moe_planner_stream_next(ferry_moe_planner *p, ferry_moe_wave *w)
{
    if (!p || !w)
        return ferry__err_set(p ? &p->err : NULL, -EINVAL, "moe stream: no planner or wave");
    memset(w, 0, sizeof *w);
    w->experts = p->wave_ex;
    w->slots = p->wave_slot;
    fill_plan(p, p->st_layer, 0, &w->plan);
    if (!p->streaming)
        return ferry__err_set(&p->err, FERRY_ESTATE, "moe stream: no streamed step is open");
    uint32_t layer = p->st_layer;
    if (p->st_pos == p->st_n) {
        p->streaming = 0;
        return 0;
    }
    if (!p->st_first)
        unpin_all(p); /* the waves before may be evicted now */
    p->st_first = 0;
    uint32_t k = p->st_n - p->st_pos < p->slots ? p->st_n - p->st_pos : p->slots, nm = 0;
    const uint32_t *ids = p->st_ids + p->st_pos;
    for (uint32_t i = 0; i < k; i++) {
        uint32_t slot = p->where[ids[i]];
        if (slot == FERRY_MOE_NONE)
            p->miss[nm++] = ids[i];
        else
            pin(p, slot);
    }
    int rc = place_misses(p, "stream", layer, nm, 0);
    if (rc < 0) {
        p->streaming = 0;
        return rc;
    }
    for (uint32_t i = 0; i < k; i++) {
        p->wave_ex[i] = ids[i] % p->E;
        p->wave_slot[i] = p->where[ids[i]];
    }
    /* the policy ends the step wave by wave, so that a wave's experts are
     * victims for the next (the first wave learns the turn) */
    if (p->pol->ops->end_step)
        p->pol->ops->end_step(p->pol, layer, ids, k);
    p->st_pos += k;
    w->n = k;
    fill_plan(p, layer, nm, &w->plan);
    return (int)k;
}

int ferry_moe_planner_prefetch(ferry_moe_planner *p, uint32_t layer, const uint32_t *experts,
                               uint32_t n, ferry_moe_copy_plan *plan)
{
    if (!p)
        return ferry__err_set(NULL, -EINVAL, "moe prefetch: no planner");
    if (p->pops == &ferry__policy_belady)
        return ferry__err_set(&p->err, FERRY_ENOTSUP,
                              "moe prefetch: policy belady replays a fixed trace");
    uint32_t nu;
    int rc = stream_open(p, "prefetch");
    if (rc < 0 || (rc = collect(p, "prefetch", layer, experts, n, &nu)) < 0)
        return rc;
    uint32_t nm = 0, np = 0;
    for (uint32_t i = 0; i < nu; i++) {
        uint32_t id = p->uniq[i], slot = p->where[id];
        if (slot == FERRY_MOE_NONE)
            p->miss[nm++] = id;
        else if (p->pin_step[slot] != p->pin_now || is_soft(p, slot))
            np++; /* named here: pinned below */
    }
    /* refused whole rather than half placed: every miss needs a slot that
     * no expert of the step (or of this call) pins; counted before
     * anything is pinned, so a refusal leaves the step's pins as they were */
    if (nm > p->slots - p->n_pinned - np)
        return ferry__err_set(&p->err, FERRY_ENOSPACE,
                              "moe prefetch: layer %u: %u experts to place, %u of %u slots "
                              "free of the current step's pins: nothing placed",
                              layer, nm, p->slots - p->n_pinned - np, p->slots);
    for (uint32_t i = 0; i < nu; i++) {
        uint32_t slot = p->where[p->uniq[i]];
        if (slot != FERRY_MOE_NONE)
            pin(p, slot); /* named here: not a victim now */
    }
    rc = place_misses(p, "prefetch", layer, nm, 1);
    if (rc < 0)
        return rc;
    p->st.prefetch_requests += nu;
    p->st.prefetch_fetched += nm;
    fill_plan(p, layer, nm, plan);
    return (int)nm;
}

int ferry_moe_planner_prefill(ferry_moe_planner *p, uint32_t layer, ferry_moe_copy_plan *plan,
                              ferry_moe_counts *counts)
{
    if (!p)
        return ferry__err_set(NULL, -EINVAL, "moe prefill: no planner");
    if (layer >= p->L) /* a bad layer is named as such, whatever the slots */
        return ferry__err_set(&p->err, -EINVAL, "moe prefill: layer %u out of range (model has %u)",
                              layer, p->L);
    if (p->E > p->slots)
        return ferry__err_set(&p->err, FERRY_ENOSPACE,
                              "moe prefill: layer %u has %u experts, more than the %u slots: "
                              "stream it (ferry_moe_planner_stream_begin with every expert)",
                              layer, p->E, p->slots);
    return ferry_moe_planner_ensure(p, layer, p->iota, p->E, NULL, plan, counts);
}

int ferry_moe_planner_forget(ferry_moe_planner *p, uint32_t slot)
{
    if (!p || slot >= p->slots)
        return ferry__err_set(p ? &p->err : NULL, -EINVAL, "moe forget: slot %u out of range (%u)",
                              slot, p ? p->slots : 0);
    if (p->occupant[slot] == FERRY_MOE_NONE)
        return 0;
    drop(p, slot, 0);
    if (p->pin_step[slot] == p->pin_now && !is_soft(p, slot))
        p->n_pinned--;
    if (p->soft_at)
        p->soft_at[slot] = UINT64_MAX;
    p->pin_step[slot] = UINT64_MAX;
    (void)ferry__heap_set(&p->freeh, slot, 0);
    p->st.forgotten++;
    return 0;
}

int ferry_moe_planner_resize(ferry_moe_planner *p, uint32_t new_slots)
{
    if (!p)
        return ferry__err_set(NULL, -EINVAL, "moe resize: no planner");
    if (new_slots < 1 || new_slots > FERRY_MOE_MAX_SLOTS)
        return ferry__err_set(&p->err, -EINVAL, "moe resize: new_slots %u: accepted 1..%u",
                              new_slots, FERRY_MOE_MAX_SLOTS);
    int so = stream_open(p, "resize");
    if (so < 0)
        return so;
    if (p->pops == &ferry__policy_belady)
        return ferry__err_set(&p->err, FERRY_ENOTSUP,
                              "moe resize: policy belady replays a fixed trace");
    uint32_t *occ, *fpos;
    uint64_t *pin;
    uint8_t *pf;
    double *fkey;
    ferry__heap fh;
    if (slot_arrays(new_slots, &occ, &pin, &pf, &fpos, &fkey, &fh) < 0)
        return ferry__err_set(&p->err, -ENOMEM, "moe resize: out of memory for %u slots", new_slots);
    /* the step's pins (and a prefetch's) hold across a resize: a prefetch
     * after it still never evicts an expert of the current step. Soft pins
     * (hinted victims) end with the round's soft pin arrays below. */
    uint32_t n_pinned = 0;
    for (uint32_t s = 0; s < p->slots && s < new_slots; s++)
        if (p->occupant[s] != FERRY_MOE_NONE && p->pin_step[s] == p->pin_now && !is_soft(p, s)) {
            pin[s] = p->pin_now;
            n_pinned++;
        }
    ferry__policy *pol;
    int rc = policy_create(p, new_slots, pin, occ, &pol);
    /* (as large as the old ones too; made last, so that a failure leaves
     * the planner as it was, soft pins and all) */
    const char *cause = "policy";
    if (rc == 0 && p->soft_at && soft_arrays(p, new_slots > p->slots ? new_slots : p->slots) < 0) {
        policy_destroy(pol);
        rc = -ENOMEM;
        cause = "soft pins of";
    }
    if (rc < 0) {
        ferry__heap_fini(&fh);
        ferry__free(occ);
        ferry__free(pin);
        ferry__free(pf);
        ferry__free(fpos);
        ferry__free(fkey);
        return ferry__err_set(&p->err, rc, "moe resize: %s %s for %u slots: %s", cause,
                              p->pops->name, new_slots, ferry_strerror(rc));
    }
    /* the policy's history restarts; survivors keep their slots, in slot
     * order, as if used now */
    int dropped = 0;
    uint32_t fresh = 0; /* above the last survivor */
    for (uint32_t s = 0; s < p->slots; s++) {
        uint32_t id = p->occupant[s];
        if (id == FERRY_MOE_NONE)
            continue;
        if (s >= new_slots) {
            p->where[id] = FERRY_MOE_NONE;
            if (p->prefetched[s])
                p->st.prefetch_wasted++;
            dropped++;
            continue;
        }
        occ[s] = id;
        pf[s] = p->prefetched[s];
        fresh = s + 1;
        (void)pol->ops->insert(pol, s, id, 1);
    }
    /* the free slots below it in the heap: pushed in index order, a
     * valid heap without sifting */
    for (uint32_t s = 0; s < fresh; s++)
        if (occ[s] == FERRY_MOE_NONE) {
            fh.h[fh.n] = s;
            fpos[s] = fh.n++;
        }
    policy_destroy(p->pol);
    ferry__heap_fini(&p->freeh);
    ferry__free(p->occupant);
    ferry__free(p->pin_step);
    ferry__free(p->prefetched);
    ferry__free(p->free_pos);
    ferry__free(p->free_key);
    p->pol = pol;
    p->occupant = occ;
    p->pin_step = pin;
    p->prefetched = pf;
    p->free_pos = fpos;
    p->free_key = fkey;
    p->freeh = fh;
    p->free_fresh = fresh;
    p->slots = new_slots;
    p->n_pinned = n_pinned;
    p->n_soft = 0;
    p->st.evictions += (uint64_t)dropped;
    return dropped;
}

/* the soft pin arrays for n slots (none soft); the old ones stay on
 * failure. Larger is harmless: resize shrinks without them. */
static int soft_arrays(ferry_moe_planner *p, uint32_t n)
{
    uint64_t *at = ferry__malloc((size_t)n * sizeof *at);
    uint32_t *list = ferry__malloc((size_t)n * sizeof *list);
    if (!at || !list) {
        ferry__free(at);
        ferry__free(list);
        return -ENOMEM;
    }
    memset(at, 0xff, (size_t)n * sizeof *at);
    ferry__free(p->soft_at);
    ferry__free(p->soft_list);
    p->soft_at = at;
    p->soft_list = list;
    p->n_soft = 0;
    return 0;
}

int ferry_moe_planner_hint(ferry_moe_planner *p, uint32_t layer, uint32_t steps_ahead,
                           const uint32_t *experts, uint32_t n, double confidence)
{
    if (!p)
        return ferry__err_set(NULL, -EINVAL, "moe hint: no planner");
    if (p->pops == &ferry__policy_belady)
        return ferry__err_set(&p->err, FERRY_ENOTSUP,
                              "moe hint: policy belady replays a fixed trace");
    if (steps_ahead < 1 || steps_ahead > FERRY_MOE_MAX_HINT_STEPS)
        return ferry__err_set(&p->err, -EINVAL, "moe hint: steps_ahead %u: accepted 1..%u",
                              steps_ahead, FERRY_MOE_MAX_HINT_STEPS);
    if (!(confidence >= 0 && confidence <= 1))
        return ferry__err_set(&p->err, -EINVAL, "moe hint: confidence %g: accepted 0..1",
                              confidence);
    uint32_t nu;
    int rc = collect(p, "hint", layer, experts, n, &nu);
    if (rc < 0)
        return rc;
    if (!p->hints.pos) {
        ferry__hints h;
        if (ferry__hints_init(&h, p->L * p->E) < 0 || soft_arrays(p, p->slots) < 0 ||
            !(p->hcand = ferry__malloc((size_t)p->E * sizeof *p->hcand))) {
            ferry__hints_fini(&h);
            return ferry__err_set(&p->err, -ENOMEM,
                                  "moe hint: out of memory for a hint table of %u x %u experts",
                                  p->L, p->E);
        }
        p->hints = h;
    }
    for (uint32_t i = 0; i < nu; i++)
        if ((rc = ferry__hints_add(&p->hints, p->uniq[i], p->step + steps_ahead,
                                   (float)confidence, p->where[p->uniq[i]] == FERRY_MOE_NONE)) < 0)
            return ferry__err_set(&p->err, rc, "moe hint: out of memory for %u live hints",
                                  p->hints.heap.n);
    p->hst.hinted += nu;
    return (int)nu;
}

static int hcand_cmp(const void *a, const void *b)
{
    const struct hcand *x = a, *y = b;
    if (x->v != y->v)
        return x->v > y->v ? -1 : 1;
    return x->id < y->id ? -1 : x->id > y->id;
}

/* the hinted experts not resident of the layer of the best one, best
 * first, into p->hcand; returns their count */
static uint32_t hint_candidates(ferry_moe_planner *p, uint32_t *layer)
{
    const ferry__heap *h = &p->hints.heap;
    uint32_t best = FERRY_MOE_NONE, n = 0;
    double bv = -1;
    for (uint32_t i = 0; i < h->n; i++) {
        uint32_t id = h->h[i];
        double v = ferry__hints_value(&p->hints, id, p->step, 1);
        if (p->where[id] == FERRY_MOE_NONE && (v > bv || (v == bv && id < best))) {
            bv = v;
            best = id;
        }
    }
    if (best == FERRY_MOE_NONE)
        return 0;
    *layer = best / p->E;
    for (uint32_t i = 0; i < h->n; i++) {
        uint32_t id = h->h[i];
        if (id / p->E == *layer && p->where[id] == FERRY_MOE_NONE) {
            p->hcand[n].v = ferry__hints_value(&p->hints, id, p->step, 1);
            p->hcand[n++].id = id;
        }
    }
    qsort(p->hcand, n, sizeof *p->hcand, hcand_cmp);
    return n;
}

int ferry_moe_planner_hint_prefetch(ferry_moe_planner *p, uint32_t max_rows,
                                    ferry_moe_copy_plan *plan)
{
    if (!p)
        return ferry__err_set(NULL, -EINVAL, "moe hint prefetch: no planner");
    if (p->pops == &ferry__policy_belady)
        return ferry__err_set(&p->err, FERRY_ENOTSUP,
                              "moe hint prefetch: policy belady replays a fixed trace");
    int rc = stream_open(p, "hint prefetch");
    if (rc < 0)
        return rc;
    uint32_t layer = 0, nc = max_rows && p->hints.pos ? hint_candidates(p, &layer) : 0, nm = 0;
    double q = p->hints.pos ? ferry__hints_reuse(&p->hints) : 0;
    for (uint32_t i = 0; i < nc && nm < max_rows; i++) {
        /* a row saves one copy when right and costs one when wrong (the
         * link's time), and a victim's return costs another: only when
         * more is expected saved than spent */
        uint32_t id = p->hcand[i].id, slot;
        double pr = ferry__hints_p(&p->hints, id, 1);
        if (pr <= 0.5)
            continue;
        if (pr <= 0.5 * (1 + q)) { /* worth a free slot, not a victim */
            if (!free_count(p))
                continue;
            slot = free_take(p);
        } else if ((slot = place(p, id, p->hcand[i].v)) == FERRY_MOE_NONE) {
            break; /* never at the cost of a hinted expert worth as much */
        }
        if ((rc = settle(p, "hint prefetch", layer, slot, id, 1)) < 0) {
            /* all or none, as place_misses: the caller gets no plan, so
             * the rows placed before are taken back (never copied) */
            while (nm-- > 0)
                unsettle(p, p->plan_dst[nm], 1);
            return rc;
        }
        p->plan_dst[nm] = slot;
        p->plan_row[nm++] = id % p->E;
    }
    p->st.prefetch_requests += nm;
    p->st.prefetch_fetched += nm;
    p->hst.fetched += nm;
    fill_plan(p, layer, nm, plan);
    return (int)nm;
}

int ferry_moe_planner_hint_stats_get(const ferry_moe_planner *p, ferry_moe_hint_stats *out)
{
    if (!p || !out)
        return ferry__err_set(NULL, -EINVAL,
                              "ferry_moe_planner_hint_stats_get: planner or out is NULL");
    ferry_moe_hint_stats v = p->hst;
    v.size = sizeof v;
    v.live = p->hints.heap.n;
    return ferry__stats_put(NULL, "ferry_moe_planner_hint_stats_get", out, &v, sizeof v);
}

uint32_t ferry_moe_planner_occupant(const ferry_moe_planner *p, uint32_t slot)
{
    return p && slot < p->slots ? p->occupant[slot] : FERRY_MOE_NONE;
}

uint32_t ferry_moe_planner_lookup(const ferry_moe_planner *p, uint32_t layer, uint32_t expert)
{
    if (!p || layer >= p->L || expert >= p->E)
        return FERRY_MOE_NONE;
    return p->where[layer * p->E + expert];
}

int ferry_moe_planner_stats_get(const ferry_moe_planner *p, ferry_moe_planner_stats *out)
{
    if (!p || !out)
        return ferry__err_set(NULL, -EINVAL, "ferry_moe_planner_stats_get: planner or out is NULL");
    ferry_moe_planner_stats v = p->st;
    v.size = sizeof v;
    /* any expert_bytes is accepted: a product past 64 bits saturates */
    if (__builtin_mul_overflow(p->st.prefetch_fetched, p->expert_bytes, &v.prefetch_bytes))
        v.prefetch_bytes = UINT64_MAX;
    if (__builtin_mul_overflow(p->st.prefetch_wasted, p->expert_bytes, &v.prefetch_wasted_bytes))
        v.prefetch_wasted_bytes = UINT64_MAX;
    return ferry__stats_put(NULL, "ferry_moe_planner_stats_get", out, &v, sizeof v);
}
