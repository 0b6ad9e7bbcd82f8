/*
 * moe_internal.h - private pieces of the MoE layer: an indexed heap over
 * slots and the eviction-policy interface the planner drives.
 *
 * A policy sees slots, never device memory. The planner owns occupancy
 * (which expert is in which slot) and pinning (pin_step[slot] == *pin_now
 * means the slot holds an expert of the current step, or of the current
 * wave of a streamed step, and must not be evicted); a policy only orders resident slots and names a victim. Every
 * victim choice is O(log n) or O(1) amortised: heaps with a (key, slot)
 * order, or intrusive FIFO lists.
 */
#ifndef FERRY_MOE_INTERNAL_H
#define FERRY_MOE_INTERNAL_H

#include <stdint.h>

#include "core.h"
#include "ferry/moe.h"

/* ---- indexed binary min-heap over slot numbers ----
 * Order: key ascending, then slot ascending (the deterministic tie-break
 * ferrox uses, so a GPU kernel and a CPU reference agree). pos[] and key[]
 * may be shared by several heaps whose members are disjoint (per-layer
 * heaps): each slot is in at most one of them. */
typedef struct ferry__heap {
    uint32_t *h;    /* heap array of slots */
    uint32_t n, cap;
    uint32_t *pos;  /* pos[slot] = index in h, UINT32_MAX if absent */
    double *key;    /* key[slot] */
} ferry__heap;

int ferry__heap_init(ferry__heap *hp, uint32_t cap, uint32_t *pos, double *key);
void ferry__heap_fini(ferry__heap *hp);
/* insert or update; -ENOMEM only when a growable heap cannot grow */
int ferry__heap_set(ferry__heap *hp, uint32_t slot, double key);
void ferry__heap_remove(ferry__heap *hp, uint32_t slot);
int ferry__heap_contains(const ferry__heap *hp, uint32_t slot);
/* the minimum's slot, UINT32_MAX when empty */
uint32_t ferry__heap_top(const ferry__heap *hp);
/* the least slot for which pinned(slot) is false, without removing it;
 * pops pinned ones into scratch and pushes them back (O(p log n) for p
 * pinned). UINT32_MAX when every member is pinned. */
uint32_t ferry__heap_first_unpinned(ferry__heap *hp, const uint64_t *pin_step, uint64_t step,
                                    uint32_t *scratch, uint32_t scratch_cap);

/* ---- the planner's hint table (hints.c) ----
 * At most one record per expert (global id): the nearest step it was
 * predicted for (near, the heap key), the latest (until) and the highest
 * confidence of the hints merged into it, and whether it was resident when
 * first hinted. A record is live while its heap holds it: the planner pops
 * every record whose near step has come, counts it right or wrong, and
 * keeps it (near = until) only while until is still ahead. Sized by
 * num_layers x num_experts, allocated at the first hint.
 *
 * What a hint is worth is measured, not taken on trust: the share of
 * stated confidence that came true, apart for hints of experts resident
 * when hinted and of missing ones (a missing hinted expert is right less
 * often: right ones were more likely resident already), decayed over
 * about 1024 of confidence; and how often an evicted expert is routed
 * again within a token (one step per layer), decayed over about 1024
 * evictions. */
#define FERRY__HINT_PRIOR 8.0   /* pseudo-confidence of the calibration's start (trust) */
#define FERRY__HINT_DECAY 1024.0
typedef struct ferry__hints {
    ferry__heap heap;  /* live ids by near step */
    uint32_t *pos;
    double *near;      /* per id: heap key */
    uint64_t *until;   /* per id */
    float *conf;       /* per id */
    uint8_t *missing;  /* per id: not resident when first hinted */
    uint64_t *ev_at;   /* per id: 1 + the step of its last eviction; 0: none */
    double cal_right[2], cal_conf[2]; /* [missing when hinted]: right, confidence */
    double ev_n, ev_regret;           /* evictions, routed again within a token */
} ferry__hints;

int ferry__hints_init(ferry__hints *h, uint32_t n_ids);
void ferry__hints_fini(ferry__hints *h);
/* merge a hint of id for step target (> the current step) at confidence c;
 * missing: id is not resident now */
int ferry__hints_add(ferry__hints *h, uint32_t id, uint64_t target, float c, int missing);
static inline int ferry__hints_live(const ferry__hints *h, uint32_t id)
{
    return h->pos && h->pos[id] != UINT32_MAX;
}
/* the calibrated probability that a hint of confidence c is right, for an
 * expert resident (missing 0) or not (1) when hinted */
static inline double ferry__hints_pc(const ferry__hints *h, double c, int missing)
{
    double r = (h->cal_right[missing] + FERRY__HINT_PRIOR) / (h->cal_conf[missing] + FERRY__HINT_PRIOR);
    double p = c * r;
    return p > 1 ? 1 : p;
}
static inline double ferry__hints_p(const ferry__hints *h, uint32_t id, int missing)
{
    return ferry__hints_pc(h, (double)h->conf[id], missing);
}
/* what a live hint is worth at step `now`: the probability that it is
 * right (resident or missing now) over the steps until its nearest use */
static inline double ferry__hints_value(const ferry__hints *h, uint32_t id, uint64_t now,
                                        int missing)
{
    double d = h->near[id] - (double)now;
    return ferry__hints_p(h, id, missing) / (d < 1 ? 1 : d);
}
/* the share of evicted experts routed again within a token (a prior of
 * one in four until evictions are seen) */
static inline double ferry__hints_reuse(const ferry__hints *h)
{
    return (h->ev_regret + 1.0) / (h->ev_n + 4.0);
}
/* a hinted expert's step came: right or wrong, for the calibration */
void ferry__hints_settled(ferry__hints *h, uint32_t id, int right);
/* id was evicted at step; id missed at step (window: steps of a token) */
void ferry__hints_evicted(ferry__hints *h, uint32_t id, uint64_t step);
void ferry__hints_missed(ferry__hints *h, uint32_t id, uint64_t step, uint64_t window);
/* the live record whose near step is the earliest, if it is <= step: its
 * id, else UINT32_MAX; ferry__hints_next then re-keys it (near = until
 * when until > step) or drops it */
uint32_t ferry__hints_due(const ferry__hints *h, uint64_t step);
void ferry__hints_next(ferry__hints *h, uint32_t id, uint64_t step);

/* ---- policies ---- */
typedef struct ferry__policy ferry__policy;

/* a token index (decode order). 64 bits: a decode loop of a few thousand
 * layer-steps a second passes 2^32 tokens within months (days for a
 * shallow model), and "routing" compares tokens and keys a ring by them */
typedef uint64_t ferry__tok;

/* What a policy may read of the planner. */
typedef struct ferry__policy_env {
    uint32_t num_layers, num_experts, slots;
    uint32_t top_k;            /* experts a token routes at a layer; 0: not known */
    const uint64_t *pin_step;  /* per slot */
    const uint64_t *pin_now;   /* pin_step[slot] == *pin_now: pinned (a step, or a wave of one) */
    const uint64_t *step;      /* current step (1-based; 0 before the first) */
    const ferry__tok *token;   /* current token index (decode order) */
    const uint32_t *occupant;  /* per slot: global id or FERRY_MOE_NONE */
    const uint32_t *where;     /* per global id: slot or FERRY_MOE_NONE */
    const ferry_moe_trace *oracle;
} ferry__policy_env;

typedef struct ferry__policy_ops {
    const char *name;
    const char *describe;
    size_t state_size;  /* bytes of the policy struct (starts with ferry__policy) */
    /* allocate per-slot state; -ENOMEM */
    int (*init)(ferry__policy *p);
    void (*fini)(ferry__policy *p);
    /* a step of `layer` begins with these (deduplicated) ids; -EINVAL when a
     * policy cannot follow (belady off its oracle). May be NULL. */
    int (*begin_step)(ferry__policy *p, uint32_t layer, const uint32_t *ids, uint32_t n);
    /* after all placements of a step. May be NULL. */
    void (*end_step)(ferry__policy *p, uint32_t layer, const uint32_t *ids, uint32_t n);
    void (*hit)(ferry__policy *p, uint32_t slot, uint32_t id);
    /* slot now holds id (fresh, or after a prefetch when prefetch != 0) */
    int (*insert)(ferry__policy *p, uint32_t slot, uint32_t id, int prefetch);
    /* slot leaves the cache: evicted (evicted=1) or forgotten */
    void (*remove)(ferry__policy *p, uint32_t slot, uint32_t id, int evicted);
    /* choose where id goes: return 1 to take the lowest free slot (only
     * offered when have_free), 0 with *slot = an unpinned resident slot to
     * evict, or -1 when no slot can be had. */
    int (*victim)(ferry__policy *p, uint32_t id, int have_free, uint32_t *slot);
} ferry__policy_ops;

struct ferry__policy {
    const ferry__policy_ops *ops;
    ferry__policy_env env;
};

static inline int ferry__pinned(const ferry__policy *p, uint32_t slot)
{
    return p->env.pin_step[slot] == *p->env.pin_now;
}

/* ---- a policy over one heap of every resident slot (heap.c) ----
 * lru, lfu, lfru and belady: each keys its residents its own way and
 * evicts the least unpinned one. A policy struct that starts with this
 * takes init, fini, remove and victim from it; its own init calls
 * ferry__heap_policy_init first. */
typedef struct ferry__heap_policy {
    ferry__policy base;
    ferry__heap heap;
    uint32_t *pos, *scratch;  /* per slot */
    double *key;              /* per slot */
} ferry__heap_policy;

/* 0, or -ENOMEM with nothing left allocated */
int ferry__heap_policy_init(ferry__policy *p);
void ferry__heap_policy_fini(ferry__policy *p);
void ferry__heap_policy_remove(ferry__policy *p, uint32_t slot, uint32_t id, int evicted);
/* 1 when a slot is free, else the least unpinned member (0), or -1 */
int ferry__heap_policy_victim(ferry__policy *p, uint32_t id, int have_free, uint32_t *slot);

/* the routing policy's structure checker: 0, or -EINVAL with a message
 * naming the first broken invariant in why (tests) */
int ferry__routing_check(const ferry__policy *p, char *why, size_t len);
/* (tests) > 0: the policy insert that many from now fails with -ENOMEM
 * (counted down by every planner of the process) */
extern uint64_t ferry__planner_fault_insert;
/* the planner's policy (tests) */
const ferry__policy *ferry__planner_policy(const ferry_moe_planner *p);
/* (tests) the planner's token count as if `tokens` more had passed, and
 * its routing policy's (the policy, or trio's) with it: the same
 * decisions after, past 2^32 tokens or turns (ferry__routing_skip). 0, or
 * that refusal (another policy only counts the tokens) */
int ferry__planner_skip_tokens(ferry_moe_planner *p, uint64_t tokens, uint64_t turns);
/* the calibrated probability that a hint of confidence c naming a missing
 * expert is right (c itself before the first hint) */
double ferry__planner_hint_p(const ferry_moe_planner *p, double c);

/* the registry */
const ferry__policy_ops *ferry__policy_find(const char *name);

extern const ferry__policy_ops ferry__policy_lru;
extern const ferry__policy_ops ferry__policy_lru_layer;
extern const ferry__policy_ops ferry__policy_lfu;
extern const ferry__policy_ops ferry__policy_lfru;
extern const ferry__policy_ops ferry__policy_s3fifo;
extern const ferry__policy_ops ferry__policy_routing;
/* a routing policy over another set of slots (p, allocated with
 * ferry__policy_routing_follower's state_size, ops and env set) that
 * shares lead's learned model; lead keeps its lists in step. lead must
 * outlive p's use and run its end_step before p's step of a layer;
 * -EINVAL (lead follows or is followed already, or another shape),
 * -ENOMEM */
extern const ferry__policy_ops ferry__policy_routing_follower;
int ferry__routing_follow(ferry__policy *p, ferry__policy *lead);
extern const ferry__policy_ops ferry__policy_arc;
extern const ferry__policy_ops ferry__policy_auto;
extern const ferry__policy_ops ferry__policy_trio;
/* (tests, bench) auto's or trio's lead - auto: 0 lru, 1 successor; trio:
 * 0 lru, 1 routing, 2 transition - and the times it changed (switches may
 * be NULL); -1 for another policy */
int ferry__auto_lead(const ferry__policy *p, uint64_t *switches);
/* auto's switching rule: 1 when a challenger's decayed score passes the
 * leader's by more than one standard deviation of the difference (var,
 * its variance); a tie or a lead within the noise keeps the leader */
int ferry__auto_overtakes(double challenger, double leader, double var);
/* a routing leader's layers that are not a multiple of stride (> 1)
 * sleep from their next turn: their experts' features and routed sets are
 * kept, not their cells, which no victim may read meanwhile; stride 0 or
 * 1 wakes them all (cells recomputed as if awake). -EINVAL for another
 * policy (auto's routing, while it does not lead) */
int ferry__routing_sleep(ferry__policy *p, uint32_t stride);
/* (tests) a routing leader's token stamps (its experts', layers', ring's,
 * its follower's) as if `tokens` more had passed, a multiple of 17 (the
 * ring's phase is the token mod 17), and its learned turns `turns` more, a
 * multiple of 256 (the refresh period) once past the early refreshes:
 * the same decisions after, past 2^32 of either. Move the planner's
 * token with it (ferry__planner_skip_tokens). -EINVAL for another policy,
 * another multiple, or turns before the early refreshes are over */
int ferry__routing_skip(ferry__policy *p, uint64_t tokens, uint64_t turns);
/* (tests) a routing leader's route counts (each expert's, each layer's)
 * 2^shift times what they are, shares kept: the same popularity buckets,
 * as after a run 2^shift times as long with the same shares, past 2^32
 * routes of one expert. -EINVAL for another policy or a shift past 40 */
int ferry__routing_scale_routes(ferry__policy *p, uint32_t shift);
/* (tests) the cell of id in a routing leader's model */
uint32_t ferry__routing_cell(const ferry__policy *p, uint32_t id);
/* (tests) trio's routing sub-policy, NULL for another policy */
const ferry__policy *ferry__auto_routing(const ferry__policy *p);
/* (tests) trio's routing shadow (a follower), NULL for another policy */
const ferry__policy *ferry__auto_shadow_routing(const ferry__policy *p);
/* (tests) auto's successor sub-policy and its shadow, NULL for another */
const ferry__policy *ferry__auto_successor(const ferry__policy *p);
const ferry__policy *ferry__auto_shadow_successor(const ferry__policy *p);
extern const ferry__policy_ops ferry__policy_belady;
extern const ferry__policy_ops ferry__policy_transition;
extern const ferry__policy_ops ferry__policy_successor;
/* "successor"'s bytes (rows, window ring, per-expert bytes); planner
 * create refuses shapes past FERRY__TRANSITION_MAX_BYTES of them */
size_t ferry__successor_bytes(uint32_t num_layers, uint32_t num_experts);
/* a successor policy's layers that are not a multiple of stride (> 1)
 * sleep from their next visit: they keep learning their rows and window,
 * not their classes or their classes' counts, so no victim may be asked
 * of it meanwhile; stride 0 or 1 wakes them, each classed as after its
 * last visit (as if it had not slept). auto puts its successor to sleep
 * while LRU leads, awake on the layers its shadow samples. -EINVAL for
 * another policy */
int ferry__successor_sleep(ferry__policy *p, uint32_t stride);
/* a successor policy over another set of slots (p, allocated with
 * ferry__policy_successor_follower's state_size, ops and env set) that
 * evicts by lead's classes: lead's begin_step of a step runs before p's;
 * a lead has one follower, the two destroyed together; -EINVAL (another
 * shape, not a successor lead, or one followed already), -ENOMEM */
extern const ferry__policy_ops ferry__policy_successor_follower;
int ferry__successor_follow(ferry__policy *p, ferry__policy *lead);
/* (tests) while on, every victim "successor" names is checked against a
 * scan of all its slots by the same rule; turning it on zeroes the counts */
void ferry__successor_verify(int on);
void ferry__successor_verified(uint64_t *checked, uint64_t *mismatched);
/* (tests) the work a successor policy has done: experts refiled, routed
 * rows, layers and 16-expert blocks visited (0 for another policy) */
uint64_t ferry__successor_ops(const ferry__policy *p);
/* (tests) a successor policy's layers as if each had been visited
 * `visits` more times (a multiple of 17 x 512: the window's ring and the
 * schedules keep their phase) and its clocks touched `touches` more: the
 * same decisions after, past 2^32 of either. -EINVAL for another policy
 * or another multiple */
int ferry__successor_skip(ferry__policy *p, uint64_t visits, uint64_t touches);
/* (tests) an arc policy's ghost sequence as if `ghosts` more ghost
 * entries had come and gone since (in the other list's ring: a ring sits
 * untouched while every victim comes from the other list): the same
 * decisions after, past 2^32 ghosts. -EINVAL for another policy */
int ferry__arc_skip(ferry__policy *p, uint64_t ghosts);
/* (tests) a successor policy's all-layer count of class c's members
 * over the visits (halved every 512 visits of layer 0), and in *routed
 * how many of them were routed (never more); 0 for another policy or c */
uint64_t ferry__successor_global(const ferry__policy *p, uint32_t c, uint64_t *routed);
/* (tests) id's class in a successor policy (as of its layer's last visit
 * awake); UINT32_MAX for another policy or an id past its shape */
uint32_t ferry__successor_class(const ferry__policy *p, uint32_t id);
/* "transition"'s model (per id: its row's successor lanes, ring,
 * history): its bytes, and the most a planner accepts (larger shapes are
 * refused at create) */
#define FERRY__TRANSITION_MAX_BYTES ((size_t)256 << 20)
size_t ferry__transition_bytes(uint32_t num_layers, uint32_t num_experts);
/* a transition policy over another set of slots (p, allocated with
 * ferry__policy_transition_follower's state_size, ops and env set) that
 * evicts by lead's model, which tells it of every change to an expert it
 * holds: lead's begin_step of a step must run before p chooses a victim
 * in it; a lead has one follower, and the two are destroyed together;
 * p's fini frees what this allocates; -EINVAL (another shape, not a
 * transition lead, or one followed already), -ENOMEM */
extern const ferry__policy_ops ferry__policy_transition_follower;
int ferry__transition_follow(ferry__policy *p, ferry__policy *lead);
/* (tests) while on, every victim a transition policy or follower names is
 * checked against a scan of all its slots by the same rule; turning it on
 * zeroes the counts of victims checked and of those that differed */
void ferry__transition_verify(int on);
/* (tests) non-zero: transition policies created from now count their rows
 * with SSE2 even where the processor has AVX2 (the same counts) */
extern int ferry__transition_narrow;
void ferry__transition_verified(uint64_t *checked, uint64_t *mismatched);
/* a transition policy's layers that are not a multiple of stride (> 1)
 * sleep from their next visit: they keep learning their rows and routed
 * sets but not their cells, which no victim may read meanwhile; stride
 * 0 or 1 wakes them all at once (each rebuilt as if it had not slept).
 * auto puts its transition to sleep while another policy leads, awake on
 * the layers its shadow samples. -EINVAL for another policy */
int ferry__transition_sleep(ferry__policy *p, uint32_t stride);
/* (tests) a transition policy's visited layers as if each had been
 * visited `visits` more times (a multiple of 17: its ring keeps its
 * phase): the same decisions after, past 2^32 visits. -EINVAL for another
 * policy or another multiple */
int ferry__transition_skip(ferry__policy *p, uint64_t visits);
/* (tests) how many ids' cells differ between two transition policies of
 * one shape (the layers asleep in either skipped); -1 if not both */
long ferry__transition_cells_differ(const ferry__policy *a, const ferry__policy *b);
/* (tests) how many ids' rows (successors, counts, total, lanes used)
 * differ between two transition policies of one shape; -1 if not both */
long ferry__transition_rows_differ(const ferry__policy *a, const ferry__policy *b);
/* (tests) a transition policy's order's clock moved on to `to` (if
 * later: every key stays below it; at most 2^31 - 2, the most a key is)
 * and returned; 0 for another policy */
uint32_t ferry__transition_clock(ferry__policy *p, uint32_t to);
/* (tests) the work a transition policy or follower has done: events,
 * filings, layers and cells visited (0 for another policy) */
uint64_t ferry__transition_ops(const ferry__policy *p);
/* (tests) trio's transition sub-policy and its shadow; NULL for another
 * policy or when trio runs without transition */
const ferry__policy *ferry__auto_transition(const ferry__policy *p);
const ferry__policy *ferry__auto_shadow_transition(const ferry__policy *p);

/* ---- traces ---- */
struct ferry_moe_trace {
    ferry_moe_model model;
    size_t n_steps, cap_steps;
    uint32_t *tok, *layer;  /* per step */
    uint32_t *ntok;         /* per step: tokens (a capture's batch; 1 for decode) */
    size_t *off;            /* per step + 1: start in ex[] */
    uint32_t *ex;
    size_t n_ex, cap_ex;
    uint32_t n_tokens;
    int sorted;             /* steps are in (token, layer) order */
    uint32_t *layer_ids;    /* num_layers model layer numbers; NULL: 0..L-1 */
    /* the engine's own predictions of steps' routes ("pred_ids"): step i's
     * are pex[poff[i]..poff[i+1]); poff is NULL while no step has one */
    uint32_t *poff, *pex;
    size_t n_pex, cap_pex;
    char stage[32];         /* the capture stage read ("" when none) */
};

/* attach a prediction of its routes (ids < num_experts) to the last step
 * appended; -EINVAL before any step, -ENOMEM */
int ferry__trace_set_pred(ferry_moe_trace *t, const uint32_t *pred, uint32_t n);
/* sort steps into (token, layer) order, stable; -ENOMEM */
int ferry__trace_sort(ferry_moe_trace *t);

/* What the trace reader accepts (FERRY_EPARSE beyond, naming the line) and
 * what `ferry moe gen` makes: a line of at most 1 MiB, at most 2^26 steps
 * and 2^29 expert ids (about 3 GiB of trace in memory), a file of at most
 * 64 GiB (blank lines included). */
#define FERRY__TRACE_MAX_LINE ((size_t)1 << 20)
#define FERRY__TRACE_MAX_STEPS ((size_t)1 << 26)
#define FERRY__TRACE_MAX_IDS ((size_t)1 << 29)
#define FERRY__TRACE_MAX_BYTES ((uint64_t)64 << 30)

/* ---- rows sources: one backend per file (rows_host.c, rows_file.c) ---- */
typedef struct ferry__rows_ops {
    const char *name;
    /* host bytes of a row and their length; NULL when absent or on a file */
    const void *(*host_row)(const ferry_moe_rows *r, uint32_t bank, uint32_t layer, uint32_t row,
                            size_t *len);
    /* file location of a row (NULL for host sources): 0, -EINVAL if absent */
    int (*file_row)(const ferry_moe_rows *r, uint32_t bank, uint32_t layer, uint32_t row,
                    ferry_io **io, ferry_file **f, uint64_t *off);
    int (*klass)(const ferry_moe_rows *r, uint32_t layer);
    void (*destroy)(ferry_moe_rows *r);
} ferry__rows_ops;

struct ferry_moe_rows {
    const ferry__rows_ops *ops;
    ferry_moe_geometry g;
};

/* checks a geometry's shape for a rows source or an executor */
int ferry__geometry_check(const ferry_moe_geometry *g, const char *what, int need_slots);

/* routing statistics of a trace (what the generator is calibrated to) */
typedef struct ferry__trace_stats {
    double top1_share;    /* mean over layers: routes of the top expert / routes */
    double top32_cover;   /* mean over layers: routes of the top 32 / routes (E >= 64) */
    double repeat_next;   /* selections at token t also routed at t-1, same layer */
    double within8;       /* selections whose previous route is <= 8 tokens back */
    double median_reuse;  /* median distance (tokens) to the previous route */
    double cross_lift;    /* P(best partner at l | a at l-1) / P(partner at l) */
    double *layer_repeat; /* per layer repeat_next (num_layers), caller frees */
} ferry__trace_stats;
int ferry__trace_stats_compute(const ferry_moe_trace *t, ferry__trace_stats *out);

/* ferry_moe_trace_load_opts / _save on an open descriptor (not closed; a
 * socket is taken as a pipe is), named name in messages: the CLI's "-" */
int ferry__moe_trace_load_fd(int fd, const char *name, const ferry_moe_trace_options *opt,
                             ferry_moe_trace **out);
int ferry__moe_trace_save_fd(const ferry_moe_trace *t, int fd, const char *name);

/* ---- the trace generator, one set at a time (tracegen.c) ----
 * ferry_moe_trace_generate() is open + next for every (token, layer) in
 * order + close; the evaluation bench (bench/moe_ceiling.c) also asks the
 * generator how likely an expert is at its layer's next turn, which is
 * what an online policy could know at best. */
typedef struct ferry__gen ferry__gen;
int ferry__gen_open(const ferry_moe_gen_options *opt, ferry__gen **out, ferry_moe_model *model);
/* draw the next set in (token, layer) order: top_k distinct experts, valid
 * until the same layer is drawn HIST (9) tokens later */
const uint32_t *ferry__gen_next(ferry__gen *g);
/* P(expert e is routed at layer l's turn at token tk), given every set drawn
 * so far; tk must be l's next turn (the one not yet drawn). Exact for the
 * mixture except the redraw of duplicates; the partner term, when layer
 * l-1 of tk is not drawn yet, uses its own probability without partner */
double ferry__gen_prob(const ferry__gen *g, uint32_t tk, uint32_t l, uint32_t e);
void ferry__gen_close(ferry__gen *g);

/* ---- deterministic RNG (xoshiro256**) shared by the generator and tests ---- */
typedef struct ferry__rng {
    uint64_t s[4];
} ferry__rng;
void ferry__rng_seed(ferry__rng *r, uint64_t seed);
uint64_t ferry__rng_next(ferry__rng *r);
/* uniform in [0, n) */
uint32_t ferry__rng_below(ferry__rng *r, uint32_t n);
/* uniform in [0, 1) */
double ferry__rng_unit(ferry__rng *r);

#endif
