/*
 * ferry/moe.h - the MoE expert slot cache: routing traces, a planner with
 * pluggable eviction policies, an executor that moves expert rows into
 * device slots, and trace replay against Belady's MIN.
 *
 * The model: num_layers MoE layers of num_experts experts each, top_k
 * experts routed per token per layer. An expert's global id is
 * layer * num_experts + expert. One pool of `slots` device slots is shared
 * by all layers, of any size from 1: a decode step needs its own experts
 * resident at once (top_k), and a step with more experts than slots (a
 * prefill layer, a wide batch) streams them through the slots in waves.
 *
 * The planner (ferry_moe_planner) decides residency and holds no device
 * memory. For each layer of each step the engine calls
 * ferry_moe_planner_ensure() with the router's choice and gets a slot per
 * route plus a copy plan (dst slots, layer-local source rows). The executor
 * (ferry_moe_slots) validates a copy plan whole, then moves the rows from a
 * rows source (pinned host banks or an NVMe file) into the slots through a
 * slot device (ops table: the core's ferry_device, or your own). After a
 * failed write or flush the executor reports which slots are unknown and
 * the caller tells the planner to forget them (ferry_moe_planner_forget),
 * so the two always agree on every occupant (ferry_moe_check walks both).
 *
 * Thread-safety: every object here is used by one thread at a time; distinct
 * objects are independent. (An executor reads a prefetch of rows on a file
 * on a thread of its own, which touches only its device context and rows
 * source until the caller's next call on the executor waits for it.)
 * Traces are immutable after loading and may be read from several threads.
 */
#ifndef FERRY_MOE_H
#define FERRY_MOE_H

#include "core.h"
#include "device.h"
#include "io.h"

#ifdef __cplusplus
extern "C" {
#endif

/** No expert / no slot. */
#define FERRY_MOE_NONE UINT32_MAX
/** Most banks an expert row may have: gate, up and down weights with
 * their scales (6) and two more. */
#define FERRY_MOE_MAX_BANKS 8
/** Most MoE layers of a model (traces, generator, planner, geometry). */
#define FERRY_MOE_MAX_LAYERS 1024u
/** Most experts per layer (traces, generator, planner, geometry). */
#define FERRY_MOE_MAX_EXPERTS 16384u
/** Most slots of a planner or slot pool: every expert of the largest
 * shape (FERRY_MOE_MAX_LAYERS x FERRY_MOE_MAX_EXPERTS). */
#define FERRY_MOE_MAX_SLOTS (1u << 24)
/** Most bytes of one row of one bank: 1 TiB. */
#define FERRY_MOE_MAX_ROW_BYTES ((uint64_t)1 << 40)

/* ======================================================================
 * Routing traces
 * ====================================================================== */

typedef struct ferry_moe_trace ferry_moe_trace;

/** A trace's model shape (the header record). */
typedef struct ferry_moe_model {
    char name[64];         /**< "deepseek-v3", "capture", ... */
    uint32_t num_layers;
    uint32_t num_experts;  /**< per layer */
    uint32_t top_k;        /**< widest route seen or declared */
    uint64_t expert_bytes; /**< bytes of one expert (all banks); 0 if unknown */
} ferry_moe_model;

/**
 * Load a routing trace (JSON Lines) from path. Two forms are read, one per
 * file:
 *  - ferry's: a header {"model":S,"num_layers":N,"num_experts":N,"top_k":N
 *    [,"expert_bytes":N][,"stage":S][,"layer_ids":[..]]} then one
 *    {"token":T,"layer":L,"experts":[..][,"tokens":N]} per step (a step is
 *    one forward pass at one layer; "tokens", default 1, is its batch and
 *    lets the route be up to top_k x tokens wide). Without a header the
 *    shape is the largest layer and expert ids + 1.
 *  - engine captures (a route logger at the MoE layer), one record per
 *    layer per forward pass: {"layer":"model.layers.N.mlp.experts" (or N),
 *    "num_experts":E, "topk_ids":[[..],[..]] [,"top_k":K][,"stage":S]},
 *    one list per token of the batch. The shape is what the records carry,
 *    never guessed from the ids: num_experts (required in every record
 *    unless a header gives it; all must agree), top_k (else the widest
 *    list). Only the layers logged are kept, in model order and numbered
 *    densely (ferry_moe_trace_layer_id() maps back; a header's "layer_ids"
 *    is refused in a capture). One stage is read
 *    (ferry_moe_trace_options.stage; else the file's only stage; else
 *    "apply", the stage that applies experts; a file of several stages and
 *    no "apply" is refused rather than counting each route once per
 *    stage). The n-th record of a layer is forward pass n of that layer;
 *    a pass is one step whose experts are the union of its tokens' lists,
 *    replayed layer by layer as the engine runs it (a prefill batch is not
 *    split into tokens). A record with "counts" but no "topk_ids" is
 *    refused: per-expert counts cannot be replayed. Optional "pred_ids"
 *    (lists like topk_ids) is the engine's own prediction of the record's
 *    routes, made before they were known (a pre-gating predictor, a
 *    draft); in ferry's form it is "pred":[..]. See
 *    ferry_moe_trace_step_pred() and ferry_moe_sim_options.hint_trace.
 * Steps are replayed in (pass, layer) order, file order within ties.
 * Shapes are bounded (num_layers <= 1024, num_experts <= 16384, at most 8
 * stages) and so is memory: a line at a time, at most 2^26 steps. Blank
 * lines are skipped. Errors: FERRY_EPARSE with a message naming the line
 * number and the field (a malformed line, an expert id >= num_experts, a
 * layer >= num_layers, an empty route, a missing num_experts, a
 * counts-only record, a mixed-stage file); -errno when the file cannot be
 * read; -ENOMEM. *out is the caller's, freed with ferry_moe_trace_destroy.
 */
FERRY_API int ferry_moe_trace_load(const char *path, ferry_moe_trace **out);
/** The same from a buffer (len bytes; need not be NUL-terminated). */
FERRY_API int ferry_moe_trace_parse(const char *buf, size_t len, ferry_moe_trace **out);

/** Options of the trace reader. */
typedef struct ferry_moe_trace_options {
    size_t size;       /**< sizeof(ferry_moe_trace_options) or more */
    /** captures: the stage to read (records of others are skipped); NULL:
     *  the only stage, else "apply". At most 31 bytes (-EINVAL). */
    const char *stage;
} ferry_moe_trace_options;
/** The smallest size the trace reader takes: this first version's struct. */
#define FERRY_MOE_TRACE_OPTIONS_MIN_SIZE sizeof(ferry_moe_trace_options)
#define FERRY_MOE_TRACE_OPTIONS_INIT \
    {FERRY_FIELD(size) sizeof(ferry_moe_trace_options), FERRY_FIELD(stage) NULL}

/** ferry_moe_trace_load with options (NULL: the defaults). */
FERRY_API int ferry_moe_trace_load_opts(const char *path, const ferry_moe_trace_options *opt,
                                        ferry_moe_trace **out);
/** ferry_moe_trace_parse with options (NULL: the defaults). */
FERRY_API int ferry_moe_trace_parse_opts(const char *buf, size_t len,
                                         const ferry_moe_trace_options *opt,
                                         ferry_moe_trace **out);
/** The model's number of trace layer `layer` (a capture keeps only the
 * layers logged); `layer` itself for dense traces; FERRY_MOE_NONE out of
 * range. */
FERRY_API uint32_t ferry_moe_trace_layer_id(const ferry_moe_trace *t, uint32_t layer);
/** The capture stage the steps come from ("" when none). */
FERRY_API const char *ferry_moe_trace_stage(const ferry_moe_trace *t);
/** Step i's predicted experts (the record's pred_ids, layer-local, NULL and
 * *n = 0 when it has none). -EINVAL when i is out of range. */
FERRY_API int ferry_moe_trace_step_pred(const ferry_moe_trace *t, size_t i, const uint32_t **pred,
                                        uint32_t *n);
/** Tokens of step i (its batch: 1 for decode); 0 when i is out of range. */
FERRY_API uint32_t ferry_moe_trace_step_tokens(const ferry_moe_trace *t, size_t i);
/** An empty trace of the given shape, to append to. -EINVAL for a shape
 * out of range (num_layers 1..1024, num_experts 1..16384, top_k
 * 0..num_experts, expert_bytes 0..INT64_MAX) or a name that is not UTF-8
 * text: what ferry_moe_trace_save writes loads back. */
FERRY_API int ferry_moe_trace_create(const ferry_moe_model *model, ferry_moe_trace **out);
/**
 * Append one step (token, layer, n experts). Errors: -EINVAL for a token
 * of UINT32_MAX (the token count must fit), a layer or expert out of range,
 * n == 0 or n > 16384, or a trace already at the reader's bounds (2^26
 * steps, 2^29 expert ids) (nothing appended); -ENOMEM.
 */
FERRY_API int ferry_moe_trace_append(ferry_moe_trace *t, uint32_t token, uint32_t layer,
                                     const uint32_t *experts, uint32_t n);
/** Write t as ferry JSON Lines (header first). -EINVAL (nothing written)
 * for a trace that would not load back as it is: one of no steps, or one
 * whose steps are not in (token, layer) order (the reader's order; a
 * loaded or generated trace always is). -errno on I/O failure. */
FERRY_API int ferry_moe_trace_save(const ferry_moe_trace *t, const char *path);
/** NULL does nothing. */
FERRY_API void ferry_moe_trace_destroy(ferry_moe_trace *t);
/** The trace's shape (valid while it lives; all zero for a NULL trace). */
FERRY_API const ferry_moe_model *ferry_moe_trace_model(const ferry_moe_trace *t);
/** Number of steps (one token at one layer). */
FERRY_API size_t ferry_moe_trace_steps(const ferry_moe_trace *t);
/** Number of distinct tokens (max token index + 1). */
FERRY_API uint32_t ferry_moe_trace_tokens(const ferry_moe_trace *t);
/**
 * Step i in replay order: its token, layer and routed experts (pointer
 * into the trace, valid while it lives). -EINVAL when i is out of range.
 */
FERRY_API int ferry_moe_trace_step(const ferry_moe_trace *t, size_t i, uint32_t *token,
                                   uint32_t *layer, const uint32_t **experts, uint32_t *n);

/** Options of the synthetic trace generator. */
typedef struct ferry_moe_gen_options {
    size_t size;          /**< sizeof(ferry_moe_gen_options) */
    const char *model;    /**< preset: "deepseek-v3" (NULL), "qwen3-30b-a3b",
                               "mixtral-8x7b", "small"; else -EINVAL */
    /** tokens to generate; 0 -> 2048. Bounded with the shape: tokens x
     *  num_layers at most 2^26 steps, and that x top_k at most 2^29 expert
     *  ids (what a trace holds) */
    uint32_t tokens;
    uint64_t seed;        /**< same seed, same trace; any value */
    /* 0 keeps the preset's value; num_layers 1..FERRY_MOE_MAX_LAYERS,
     * num_experts 1..FERRY_MOE_MAX_EXPERTS, top_k 1..num_experts (the
     * preset's top_k too must not exceed num_experts) */
    uint32_t num_layers, num_experts, top_k;
    /** the share of a token's selections routed again at the next token,
     *  same layer: 0 keeps the preset's (~45%, the generator's calibration);
     *  0.01..0.9 scales the temporal reuse to measure that (within about a
     *  point), e.g. 0.35 for what decode captures of large MoE models show
     *  (34-37%) */
    double repeat_next;
} ferry_moe_gen_options;
/** The smallest size the generator takes: the first version's options (up
 *  to top_k; repeat_next then 0). */
#define FERRY_MOE_GEN_OPTIONS_MIN_SIZE offsetof(ferry_moe_gen_options, repeat_next)
#define FERRY_MOE_GEN_OPTIONS_INIT \
    {FERRY_FIELD(size) sizeof(ferry_moe_gen_options), FERRY_FIELD(model) NULL, \
     FERRY_FIELD(tokens) 0, FERRY_FIELD(seed) 1, FERRY_FIELD(num_layers) 0, \
     FERRY_FIELD(num_experts) 0, FERRY_FIELD(top_k) 0, FERRY_FIELD(repeat_next) 0.0}

/**
 * Generate a realistic synthetic routing trace, calibrated to published
 * routing statistics: per-layer popularity skew (Zipf), temporal reuse
 * (about 45% of selections repeat at the next token, 80% within 8, median
 * reuse distance about 2 tokens), cross-layer correlation (an expert at
 * layer l pulls a fixed partner at layer l+1) and locality that is weaker
 * at the first and last layers (U-shaped miss rates over depth).
 * Deterministic for a given seed. Every option is range-checked before
 * anything is sized by it. Errors: -EINVAL with a message naming the
 * field, its value and the accepted range (options size, unknown preset,
 * num_layers, num_experts or top_k out of range, tokens past the trace
 * bounds), -ENOMEM.
 */
FERRY_API int ferry_moe_trace_generate(const ferry_moe_gen_options *opt, ferry_moe_trace **out);
/** The generator's preset names, NULL-terminated. */
FERRY_API const char *const *ferry_moe_gen_presets(void);

/* ======================================================================
 * Planner
 * ====================================================================== */

typedef struct ferry_moe_planner ferry_moe_planner;

typedef struct ferry_moe_planner_options {
    size_t size;           /**< sizeof(ferry_moe_planner_options), or an older
                                header's: at least FERRY_MOE_PLANNER_OPTIONS_MIN_SIZE */
    uint32_t num_layers;   /**< 1..FERRY_MOE_MAX_LAYERS (1024) */
    uint32_t num_experts;  /**< per layer: 1..FERRY_MOE_MAX_EXPERTS (16384) */
    uint32_t slots;        /**< 1..FERRY_MOE_MAX_SLOTS (2^24); below one layer's
                                experts is fine (see stream_begin) */
    const char *policy;    /**< see ferry_moe_policies(); NULL -> "auto"; else -EINVAL */
    /** The future, for "belady" only (required there, ignored otherwise):
     * ensure() must then be called with exactly this trace's steps in order. */
    const ferry_moe_trace *oracle;
    /** bytes of one expert (all banks), for the byte figures in the stats;
     * any value (a figure past 64 bits saturates at UINT64_MAX); 0: they
     * stay 0 */
    uint64_t expert_bytes;
    /** experts one token routes at a layer (the model's top_k), for the
     * policies that smooth by it ("transition", and "auto" through it);
     * 0..num_experts, 0: not known (the step's route count is used, the
     * same in decode). Members from here on are new: an older header's
     * options leave them 0. */
    uint32_t top_k;
} ferry_moe_planner_options;
/** The smallest size ferry_moe_planner_create takes: the options up to
 *  slots (policy then "auto", no oracle, expert_bytes 0, top_k 0). */
#define FERRY_MOE_PLANNER_OPTIONS_MIN_SIZE \
    (offsetof(ferry_moe_planner_options, slots) + sizeof(uint32_t))
#define FERRY_MOE_PLANNER_OPTIONS_INIT \
    {FERRY_FIELD(size) sizeof(ferry_moe_planner_options), FERRY_FIELD(num_layers) 0, \
     FERRY_FIELD(num_experts) 0, FERRY_FIELD(slots) 0, FERRY_FIELD(policy) NULL, \
     FERRY_FIELD(oracle) NULL, FERRY_FIELD(expert_bytes) 0, FERRY_FIELD(top_k) 0}

/**
 * Policy names, NULL-terminated:
 *  - "lru": global least recently used (the baseline; the cheapest:
 *    name it to have it); victim O(log slots).
 *  - "lru-layer": LRU inside a per-layer quota of slots / the layers
 *    routed so far; O(log slots), O(num_layers) on its rare
 *    fallback.
 *  - "lfu": least frequently used with a 16-token half-life; O(log slots).
 *  - "lfru": frequency-weighted LRU; O(log slots).
 *  - "s3fifo": S3-FIFO; O(1) amortised.
 *  - "routing": learned reuse probability per routing-feature cell (last
 *    turn, 8-turn window, recency, popularity, cross-layer partner),
 *    evicting the furthest predicted use in steps; O(log num_layers +
 *    log slots).
 *  - "arc": adaptive replacement, recency against frequency, balanced by
 *    ghosts of recent evictions; O(log slots).
 *  - "auto" (the default: policy NULL): "lru" or "successor", whichever
 *    has been hitting most lately in shadow caches (metadata only) of a
 *    sample of the layers (at most 16; every layer of a model of at most
 *    4096 expert ids) with their share of the slots, hits decayed over
 *    about 1024 sampled steps (set dueling): both order the real
 *    residents, the one ahead by more than the noise names the victim,
 *    ties to "lru"; the successor shadow evicts by the real successor's
 *    classes rather than learning again, and while "lru" leads the real
 *    successor learns only its rows and window on the layers no shadow
 *    samples (classed again exactly when it takes the lead). "successor"
 *    takes part while its model fits 64 MiB. On the 32 real decode rows
 *    of the README it closes at least 15% of the LRU -> Belady gap at
 *    12.5% of the ids and is never more than 0.2 points below LRU at 25%
 *    (README, issue 27, tenth pass).
 *  - "trio": the same duel between "lru", "routing" and "transition"
 *    (the default before "auto" above; a point or two better on the
 *    generator's traces, about twice auto's time a layer-step).
 *  - "belady": Belady's MIN, offline (needs the trace as oracle).
 *  - "transition": learns P(routed at its layer's next turn) per cell of
 *    (routed at the last turn, turns routed of the last 16, bin of a
 *    learned same-layer token-to-token transition probability from the
 *    turn's routed set, over each routed expert's 16 most frequent
 *    successors, counted by space-saving), backed off to an LRU-like
 *    prior, and evicts the least
 *    probability / steps until the layer runs again; ties to the older
 *    use. O(top_k x 16) a layer-step (only the experts whose cell
 *    changed), O(num_layers) a victim plus the cells of the layers that
 *    changed: nothing grows with the slots; smooths by top_k (the
 *    planner's option, else the step's route count); about 127 bytes
 *    per expert id (no E x E table): planner create refuses shapes
 *    needing over 256 MiB.
 *  - "successor": transition's successor rows (learned every second
 *    turn) into 60 classes per layer (routed at the last turn, turns
 *    routed of the last 17 in 5 buckets, 6 levels of the routed set's
 *    mean successor share), each class's P(routed at the next turn)
 *    learned per layer and backed off to all layers'; evicts the least
 *    probability / steps until the layer runs again, ties to the older
 *    touch. O(num_experts / 16 + top_k x 16 + experts whose class
 *    changed) a layer-step in byte arrays (SSE2), no lists; a victim
 *    O(num_layers) plus a pass over the experts of the layers that
 *    changed: nothing grows with the slots. About 110 bytes per expert
 *    id: planner create refuses shapes needing over 256 MiB. Alone it is
 *    below LRU by more than 0.2 points on 3 of the README's 16 real
 *    traces at 25% of the ids; "auto" duels it with "lru".
 * Every victim is unpinned (never an expert of the current step); ties go
 * to the lowest slot index. Under every policy, an expert hinted for a
 * later step (ferry_moe_planner_hint), likely enough to be right, is
 * passed over while another victim can be had.
 */
FERRY_API const char *const *ferry_moe_policies(void);
/** One line describing a policy, or NULL when unknown. */
FERRY_API const char *ferry_moe_policy_describe(const char *name);

/** A copy plan: row src_rows[i] of `layer` goes into slot dst_slots[i]. */
typedef struct ferry_moe_copy_plan {
    uint32_t layer;
    uint32_t n;
    const uint32_t *dst_slots;
    const uint32_t *src_rows;  /**< layer-local expert indices */
} ferry_moe_copy_plan;

/** A gather plan: slot src_slots[i] is copied onto dst_slots[i] on the device. */
typedef struct ferry_moe_gather_plan {
    uint32_t n;
    const uint32_t *dst_slots;
    const uint32_t *src_slots;
} ferry_moe_gather_plan;

/** What one ensure() decided. */
typedef struct ferry_moe_counts {
    uint32_t active;   /**< distinct experts routed */
    uint32_t missing;  /**< of those, not resident when the step started */
    uint32_t fetched;  /**< rows the copy plan moves (== missing) */
    uint32_t prefetch_hits; /**< of the resident ones, brought in by a prefetch */
} ferry_moe_counts;

/** Running totals of a planner. */
typedef struct ferry_moe_planner_stats {
    size_t size;                /**< set by the caller: sizeof(ferry_moe_planner_stats) */
    uint64_t steps, routes, hits, misses, evictions, forgotten;
    uint64_t prefetch_requests; /**< experts asked for by prefetch() */
    uint64_t prefetch_fetched;  /**< of those, rows planned (not resident) */
    uint64_t prefetch_hits;     /**< prefetched experts later routed while resident */
    uint64_t prefetch_wasted;   /**< prefetched experts evicted or forgotten unused */
    uint64_t prefetch_bytes;    /**< prefetch_fetched * expert_bytes */
    uint64_t prefetch_wasted_bytes; /**< prefetch_wasted * expert_bytes */
} ferry_moe_planner_stats;
#define FERRY_MOE_PLANNER_STATS_INIT \
    {FERRY_FIELD(size) sizeof(ferry_moe_planner_stats), FERRY_FIELD(steps) 0, \
     FERRY_FIELD(routes) 0, FERRY_FIELD(hits) 0, FERRY_FIELD(misses) 0, FERRY_FIELD(evictions) 0, \
     FERRY_FIELD(forgotten) 0, FERRY_FIELD(prefetch_requests) 0, FERRY_FIELD(prefetch_fetched) 0, \
     FERRY_FIELD(prefetch_hits) 0, FERRY_FIELD(prefetch_wasted) 0, FERRY_FIELD(prefetch_bytes) 0, \
     FERRY_FIELD(prefetch_wasted_bytes) 0}

/**
 * Create a planner. Every option is range-checked before anything is sized
 * by it. Errors: -EINVAL with a message naming the field, its value and
 * the accepted range (options size, num_layers, num_experts or slots out of
 * range, unknown policy, "belady" without an oracle or with an oracle of
 * another shape), -ENOMEM. Destroy with ferry_moe_planner_destroy.
 */
FERRY_API int ferry_moe_planner_create(const ferry_moe_planner_options *opt,
                                       ferry_moe_planner **out);
FERRY_API void ferry_moe_planner_destroy(ferry_moe_planner *p);
/** The last error's message ("" for a NULL planner). */
FERRY_API const char *ferry_moe_planner_last_error(const ferry_moe_planner *p);
/** The policy's name ("" for a NULL planner). */
FERRY_API const char *ferry_moe_planner_policy(const ferry_moe_planner *p);
/** The planner's slots (0 for a NULL planner). */
FERRY_API uint32_t ferry_moe_planner_slots(const ferry_moe_planner *p);

/**
 * One layer of one step: make every routed expert resident. Duplicate
 * routes are collapsed; every expert of this step is unevictable while the
 * step's misses are placed; free slots go lowest index first, victims come
 * from the policy (ties: lowest slot index). slots_out[i] (n entries, may
 * be NULL) gets the slot of experts[i]; *plan (may be NULL) gets the copy
 * plan, whose arrays are the planner's and valid until its next call;
 * *counts (may be NULL) gets the counts. Returns the number of rows to copy.
 * Errors (nothing changes): -EINVAL for layer >= num_layers, n == 0, an
 * expert >= num_experts, or (belady) a step that is not the oracle's next;
 * FERRY_ENOSPACE when the step's distinct experts outnumber the slots
 * (stream it); FERRY_ESTATE while a streamed step is open. A policy's
 * -ENOMEM part way through the misses places none of them (no expert is
 * called resident that a plan did not name); experts evicted for them
 * stay out, and the step counts as begun.
 */
FERRY_API int ferry_moe_planner_ensure(ferry_moe_planner *p, uint32_t layer,
                                       const uint32_t *experts, uint32_t n, uint32_t *slots_out,
                                       ferry_moe_copy_plan *plan, ferry_moe_counts *counts);
/**
 * Bring predicted experts of `layer` in ahead of need (e.g. the next
 * layer's likely routes). Experts already resident are left alone; a
 * prefetch never evicts an expert of the current step (the last ensure())
 * nor one named in this call. Does not advance the step and counts no
 * hits or misses. *plan as for ensure(). Returns the rows to copy.
 * Errors as ensure(); FERRY_ENOTSUP for "belady"; FERRY_ENOSPACE, with nothing
 * placed, when its misses outnumber the slots that neither the current
 * step nor this call pins.
 */
FERRY_API int ferry_moe_planner_prefetch(ferry_moe_planner *p, uint32_t layer,
                                         const uint32_t *experts, uint32_t n,
                                         ferry_moe_copy_plan *plan);
/** Most layer-steps ahead a hint may look (ferry_moe_planner_hint). */
#define FERRY_MOE_MAX_HINT_STEPS (1u << 20)

/**
 * Predicted routes: `experts` of `layer` are expected at the step
 * `steps_ahead` layer-steps from now (1: the next ensure() or
 * stream_begin(), e.g. a pre-gating predictor's next layer; num_layers: the
 * next token's same layer, e.g. a speculative draft), with `confidence`
 * 0..1 that they are right. The planner calibrates that confidence by
 * what came true: the probability a hint is right is its confidence times
 * the share of stated confidence that was right lately (about the last
 * 1024 of confidence; trusted as stated at first), counted apart for
 * experts resident when hinted and missing ones (a missing hinted expert
 * is right less often: a right one was likely resident already). Until
 * that step begins, eviction protects a hinted expert while that
 * probability beats the chance that an evicted expert is routed again
 * within a token (measured on the planner's evictions lately; 1/4 at
 * first): victims then come from unhinted slots first; only when every
 * other slot is pinned does a hinted expert go, the one of least value
 * first (probability / steps until its use: the least likely, then the
 * farthest, then the lowest slot). A hint never makes a step fail: a
 * step's own routed experts always win. When that step begins each
 * hinted expert counts as right (routed there) or wrong, and the hint
 * expires. Hints of one expert merge: protected until the latest step
 * hinted, valued by the nearest and the highest confidence, checked at
 * both. Experts not resident are brought in by
 * ferry_moe_planner_hint_prefetch(), not here. The table is bounded:
 * one record per expert of the model (33 bytes each, allocated at the
 * first hint). Returns the distinct experts hinted. Errors (nothing
 * changes): -EINVAL for layer >= num_layers, n == 0, an expert >=
 * num_experts, steps_ahead outside 1..FERRY_MOE_MAX_HINT_STEPS, confidence
 * outside 0..1 (or NaN); FERRY_ENOTSUP for "belady"; -ENOMEM.
 */
FERRY_API int ferry_moe_planner_hint(ferry_moe_planner *p, uint32_t layer, uint32_t steps_ahead,
                                     const uint32_t *experts, uint32_t n, double confidence);
/**
 * The copy plan for hinted experts that are not resident: the layer of the
 * most valuable one (calibrated probability / steps until its use), at
 * most max_rows of its hinted experts, most valuable first, each placed
 * as a prefetch (pinned until the next step, counted in the prefetch
 * stats) only where it is expected to save more copies than it costs
 * (a right row saves one, a wrong one wastes one, an evicted expert that
 * comes back costs one): an expert whose probability p is at most 1/2 is
 * skipped; up to (1 + q) / 2 (q: the evicted experts' return rate above)
 * it takes a free slot only; beyond, a free slot, an unhinted victim, or a
 * hinted one of strictly less value, and the plan stops at the first that
 * has no such slot. Call again for the next layer while the link has
 * room. *plan as for ensure(). Returns the rows to copy
 * (0: nothing hinted is missing, or no room). Errors: -EINVAL (NULL
 * planner), FERRY_ENOTSUP for "belady", FERRY_ESTATE while a streamed step
 * is open, a policy's -ENOMEM (no plan: none of the rows is placed, though
 * experts evicted for them stay out).
 */
FERRY_API int ferry_moe_planner_hint_prefetch(ferry_moe_planner *p, uint32_t max_rows,
                                              ferry_moe_copy_plan *plan);

/** What hints did (ferry_moe_planner_hint_stats_get). */
typedef struct ferry_moe_hint_stats {
    size_t size;      /**< set by the caller: sizeof(ferry_moe_hint_stats) */
    uint64_t hinted;  /**< experts named by hints (distinct per call) */
    uint64_t right;   /**< hinted experts routed at the step they were hinted for */
    uint64_t wrong;   /**< hinted experts that step did not route */
    /** evictions avoided: the policy's victim was hinted and another went */
    uint64_t saves;
    uint64_t evicted; /**< hinted experts evicted because nothing else could go */
    uint64_t fetched; /**< rows planned by ferry_moe_planner_hint_prefetch */
    uint64_t live;    /**< experts hinted now (not expired) */
} ferry_moe_hint_stats;
#define FERRY_MOE_HINT_STATS_INIT \
    {FERRY_FIELD(size) sizeof(ferry_moe_hint_stats), FERRY_FIELD(hinted) 0, FERRY_FIELD(right) 0, \
     FERRY_FIELD(wrong) 0, FERRY_FIELD(saves) 0, FERRY_FIELD(evicted) 0, FERRY_FIELD(fetched) 0, \
     FERRY_FIELD(live) 0}
/** The hint totals, written as far as out->size says (as
 *  ferry_moe_planner_stats_get). Errors: -EINVAL (NULL, size not set). */
FERRY_API int ferry_moe_planner_hint_stats_get(const ferry_moe_planner *p,
                                               ferry_moe_hint_stats *out);

/** One wave of a streamed step: compute these experts once their rows landed. */
typedef struct ferry_moe_wave {
    uint32_t n;               /**< experts in this wave (<= slots) */
    const uint32_t *experts;  /**< layer-local ids (planner's, valid until its next call) */
    const uint32_t *slots;    /**< slot of experts[i] */
    ferry_moe_copy_plan plan; /**< rows to copy before the wave is computed */
} ferry_moe_wave;

/**
 * A step whose experts may outnumber the slots (a prefill layer, a wide
 * batch, a budget below a layer): the experts go through the slots in
 * waves of at most `slots`. begin counts the step as ensure() does (a hit
 * is resident when the step starts; the resident ones are the first wave,
 * served before anything of the step can evict them) and returns the rows
 * the whole step will copy. Then each ferry_moe_planner_stream_next()
 * gives the next wave: apply its plan, compute its experts; the wave's
 * experts are pinned until the next call, which may evict them. It
 * returns the wave's experts, and 0 (with w->n == 0) once every expert
 * was served, which closes the step. Until then ensure, prefetch, resize
 * and another begin answer FERRY_ESTATE. Errors of begin as ensure()
 * (without the FERRY_ENOSPACE); of next: FERRY_ESTATE when no step is open,
 * a policy's -ENOMEM (the step is closed).
 */
FERRY_API int ferry_moe_planner_stream_begin(ferry_moe_planner *p, uint32_t layer,
                                             const uint32_t *experts, uint32_t n,
                                             ferry_moe_counts *counts);
FERRY_API int ferry_moe_planner_stream_next(ferry_moe_planner *p, ferry_moe_wave *w);
/**
 * Materialise a whole layer (prefill): ensure() of every expert of layer,
 * when they fit (slots >= num_experts); -EINVAL for a layer out of range
 * (whatever the slots), FERRY_ENOSPACE when they do not fit: stream
 * the layer (stream_begin with every expert). Same returns and plan as
 * ensure().
 */
FERRY_API int ferry_moe_planner_prefill(ferry_moe_planner *p, uint32_t layer,
                                        ferry_moe_copy_plan *plan, ferry_moe_counts *counts);
/**
 * The slot's occupant is no longer trusted (its copy failed): it becomes
 * free and the expert non-resident. Forgetting a free slot is a no-op.
 * -EINVAL when slot >= slots.
 */
FERRY_API int ferry_moe_planner_forget(ferry_moe_planner *p, uint32_t slot);
/**
 * Change the slot budget. Growing adds free slots. Shrinking drops the
 * occupants of slots >= new_slots (returns how many were dropped; the
 * executor must be resized to match). The experts of the current step
 * (and of its prefetches) that keep their slots stay pinned: a prefetch
 * after a resize still never evicts them. -EINVAL when new_slots is outside
 * 1..FERRY_MOE_MAX_SLOTS, FERRY_ESTATE while a streamed step is open,
 * -ENOMEM (nothing changes).
 */
FERRY_API int ferry_moe_planner_resize(ferry_moe_planner *p, uint32_t new_slots);
/** The global expert id in slot, or FERRY_MOE_NONE (also when out of range). */
FERRY_API uint32_t ferry_moe_planner_occupant(const ferry_moe_planner *p, uint32_t slot);
/** The slot holding (layer, expert), or FERRY_MOE_NONE. */
FERRY_API uint32_t ferry_moe_planner_lookup(const ferry_moe_planner *p, uint32_t layer,
                                            uint32_t expert);
/**
 * The running totals: the caller sets out->size (its header's
 * sizeof(ferry_moe_planner_stats), e.g. FERRY_MOE_PLANNER_STATS_INIT) and
 * only that many bytes are written. Errors: -EINVAL (NULL, size not set).
 */
FERRY_API int ferry_moe_planner_stats_get(const ferry_moe_planner *p,
                                          ferry_moe_planner_stats *out);

/* ======================================================================
 * Executor: expert slots on a device
 * ====================================================================== */

/** How a plan's rows are laid out in host memory. */
enum ferry_moe_route {
    FERRY_MOE_ROUTE_PER_ROW = 0,             /**< pinned rows, one copy each */
    FERRY_MOE_ROUTE_WHOLE_LAYER_PAGEABLE = 1, /**< a pageable layer staged whole */
    /** a prefetch plan: queue its copies on the prefetch stream (until the
     * next begin_plan) and complete them in flush_prefetch */
    FERRY_MOE_ROUTE_PREFETCH = 2
};

/**
 * A slot device: where slot memory lives and how bytes get there. Every
 * function returns 0 or a negative code and should record a message with
 * ferry_last_error()'s thread buffer (any ferry call that failed does).
 * write_slot/copy_slot may be asynchronous: they only have to have landed
 * when flush returns 0.
 */
typedef struct ferry_moe_slot_device_ops {
    size_t size;  /**< sizeof(ferry_moe_slot_device_ops) */
    /** Called once per non-empty plan before its first copy. */
    int (*begin_plan)(void *ctx, int route);
    /** Copy n host bytes into bank's slot. */
    int (*write_slot)(void *ctx, uint32_t bank, uint32_t slot, const void *src, size_t n);
    /** Copy bank's slot src onto slot dst (never equal), on the device. */
    int (*copy_slot)(void *ctx, uint32_t bank, uint32_t dst, uint32_t src);
    /** Read n bytes of file at off straight into bank's slot; NULL: the
     * executor stages through host memory and calls write_slot. */
    int (*read_file)(void *ctx, uint32_t bank, uint32_t slot, ferry_io *io, ferry_file *f,
                     uint64_t off, size_t n);
    /** Wait until every copy since begin_plan has landed. */
    int (*flush)(void *ctx);
    /** Free the context (called by ferry_moe_slots_destroy); may be NULL. */
    void (*destroy)(void *ctx);
    /** Wait until every copy of the last prefetch plan has landed. NULL:
     * the device has one stream; prefetch plans then complete in their
     * start call, through flush. */
    int (*flush_prefetch)(void *ctx);
} ferry_moe_slot_device_ops;

/**
 * The slot pool's geometry. Every function taking
 * one checks it whole before anything is sized by it: -EINVAL with a
 * message naming the field, its value and the accepted range.
 */
typedef struct ferry_moe_geometry {
    size_t size;        /**< sizeof(ferry_moe_geometry) */
    uint32_t num_layers;  /**< 1..FERRY_MOE_MAX_LAYERS (1024) */
    uint32_t num_experts; /**< rows per layer in a rows source: 1..FERRY_MOE_MAX_EXPERTS */
    /** 1..FERRY_MOE_MAX_SLOTS (2^24) for the executor and device slots;
     *  ignored by rows sources */
    uint32_t slots;
    uint32_t banks;     /**< 1..FERRY_MOE_MAX_BANKS */
    /** row_bytes[0..banks): 1..FERRY_MOE_MAX_ROW_BYTES (1 TiB) each, and
     *  num_layers x num_experts x row_bytes[b] (a bank) and, where slots
     *  are used, slots x row_bytes[b] rounded up to 256 (a slot arena) at
     *  most INT64_MAX (and SIZE_MAX); entries from banks on are ignored */
    size_t row_bytes[FERRY_MOE_MAX_BANKS];
} ferry_moe_geometry;
/** The smallest size a geometry may give: the first version's, which is
 *  this one (it has not grown yet). */
#define FERRY_MOE_GEOMETRY_MIN_SIZE sizeof(ferry_moe_geometry)
#define FERRY_MOE_GEOMETRY_INIT \
    {FERRY_FIELD(size) sizeof(ferry_moe_geometry), FERRY_FIELD(num_layers) 0, \
     FERRY_FIELD(num_experts) 0, FERRY_FIELD(slots) 0, FERRY_FIELD(banks) 0, \
     FERRY_FIELD(row_bytes) {0, 0, 0, 0, 0, 0, 0, 0}}

/**
 * Open a slot device on a ferry_device: the pool is ONE device allocation
 * per bank (an arena of slots * row_bytes, each row 256-byte aligned),
 * allocated up front; copies are queued on a stream of dev and flush
 * synchronises it; read_file reads through ferry_io_read_dev. Works on the
 * host and cuda backends. The ops and ctx go to ferry_moe_slots_create,
 * which then owns ctx. Errors: -EINVAL, -ENOMEM, device errors.
 */
FERRY_API int ferry_moe_device_slots_open(ferry_device *dev, const ferry_moe_geometry *g,
                                          const ferry_moe_slot_device_ops **ops, void **ctx);
/** The device address of bank's slot in such a context (0 when out of range). */
FERRY_API ferry_devptr ferry_moe_device_slot_ptr(void *ctx, uint32_t bank, uint32_t slot);

/** A rows source: where the experts' rows come from. */
typedef struct ferry_moe_rows ferry_moe_rows;

/**
 * Host banks: the caller's memory, bank b of layer l row r at
 * base[b] + ((size_t)l * num_experts + r) * row_bytes[b]. The memory stays
 * the caller's and must outlive the source. With dev non-NULL the banks
 * are pinned with ferry_device_pin up to pin_budget bytes (0: env
 * FERRY_MOE_PIN_BUDGET, else unlimited); layers that do not fit fall back
 * to mlock ("locked"), then stay pageable; ferry_moe_rows_class() says
 * which. Errors: -EINVAL (the geometry, a NULL bank, a bank that wraps
 * around the address space), -ENOMEM.
 */
FERRY_API int ferry_moe_rows_host(const ferry_moe_geometry *g, void *const *base,
                                  ferry_device *dev, uint64_t pin_budget, ferry_moe_rows **out);
/**
 * An NVMe file holding the rows in the same layout as host banks, bank
 * after bank: bank b starts at file offset bank_off[b] (NULL: packed, bank
 * b after bank b-1). Rows are read through io straight into slots when the
 * slot device can (read_file), else through a staging buffer. The file is
 * opened by this call (FERRY_FILE_DIRECT when every row is 4096-aligned)
 * and closed by ferry_moe_rows_destroy. Errors: -errno, -EINVAL (the
 * geometry; a bank_off[b] whose bank would end past INT64_MAX),
 * FERRY_EMISMATCH (file too short for the geometry).
 */
FERRY_API int ferry_moe_rows_file(const ferry_moe_geometry *g, ferry_io *io, const char *path,
                                  const uint64_t *bank_off, ferry_moe_rows **out);
/**
 * An NVMe file whose rows lie wherever an offset table says (a checkpoint's
 * tensors as they are, no repacking): row_off holds banks x num_layers x
 * num_experts file offsets, row `e` of layer `l` in bank `b` at
 * row_off[(b * num_layers + l) * num_experts + e], row_bytes[b] bytes long.
 * The table is copied. Every row is checked inside the file when the
 * source opens (FERRY_EMISMATCH naming the size needed); O_DIRECT when
 * every offset and width is FERRY_IO_ALIGN-aligned. Errors as
 * ferry_moe_rows_file; -EINVAL naming the first offset whose row would end
 * past INT64_MAX.
 */
FERRY_API int ferry_moe_rows_file_table(const ferry_moe_geometry *g, ferry_io *io,
                                        const char *path, const uint64_t *row_off,
                                        ferry_moe_rows **out);
/**
 * The caller's own rows: fn returns the host bytes of row `row` of
 * `layer` in `bank` and sets *len to their length, or returns NULL when it
 * has no such row (a plan naming it is then refused whole, -EINVAL). The
 * bytes must stay valid until the plan using them has been applied.
 * Errors: -EINVAL (the geometry, a NULL fn), -ENOMEM.
 */
typedef const void *(*ferry_moe_row_fn)(void *ctx, uint32_t bank, uint32_t layer, uint32_t row,
                                        size_t *len);
FERRY_API int ferry_moe_rows_fn(const ferry_moe_geometry *g, ferry_moe_row_fn fn, void *ctx,
                                ferry_moe_rows **out);
/** NULL does nothing. Unpins/unlocks what ferry_moe_rows_host pinned. */
FERRY_API void ferry_moe_rows_destroy(ferry_moe_rows *r);

enum ferry_moe_residency {
    FERRY_MOE_PINNED = 0,   /**< page-locked and registered for DMA */
    FERRY_MOE_LOCKED = 1,   /**< mlock'ed, not registered */
    FERRY_MOE_PAGEABLE = 2, /**< ordinary memory */
    FERRY_MOE_ON_FILE = 3   /**< rows on NVMe */
};
/** The residency class of a layer's rows (FERRY_MOE_*), -EINVAL if out of range. */
FERRY_API int ferry_moe_rows_class(const ferry_moe_rows *r, uint32_t layer);

typedef struct ferry_moe_slots ferry_moe_slots;

/** Executor totals. */
typedef struct ferry_moe_slots_stats {
    size_t size;                        /**< set by the caller: sizeof(ferry_moe_slots_stats) */
    uint64_t plans, warm_plans, gather_plans;
    uint64_t host_rows, host_bytes;     /**< crossed the link (host or file -> slot) */
    uint64_t device_rows, device_bytes; /**< slot -> slot on the device */
    uint64_t failed_writes, failed_flushes;
    uint64_t prefetch_plans, prefetch_rows, prefetch_bytes; /**< also in host_* */
} ferry_moe_slots_stats;
#define FERRY_MOE_SLOTS_STATS_INIT \
    {FERRY_FIELD(size) sizeof(ferry_moe_slots_stats), FERRY_FIELD(plans) 0, \
     FERRY_FIELD(warm_plans) 0, FERRY_FIELD(gather_plans) 0, FERRY_FIELD(host_rows) 0, \
     FERRY_FIELD(host_bytes) 0, FERRY_FIELD(device_rows) 0, FERRY_FIELD(device_bytes) 0, \
     FERRY_FIELD(failed_writes) 0, FERRY_FIELD(failed_flushes) 0, FERRY_FIELD(prefetch_plans) 0, \
     FERRY_FIELD(prefetch_rows) 0, FERRY_FIELD(prefetch_bytes) 0}

/**
 * The executor over a slot device. Takes ownership of ctx (ops->destroy is
 * called on it by ferry_moe_slots_destroy, and on failure here when
 * ops->size covers destroy; nothing past ops->size is read). The ops table
 * is copied: it stays the caller's and need not outlive this call. Errors:
 * -EINVAL (the geometry outside the ranges above; ops->size below this
 * header's sizeof; ops without write_slot, copy_slot or flush, named),
 * -ENOMEM.
 */
FERRY_API int ferry_moe_slots_create(const ferry_moe_geometry *g,
                                     const ferry_moe_slot_device_ops *ops, void *ctx,
                                     ferry_moe_slots **out);
/** Waits for a pending prefetch, then frees the executor and its device
 * context. NULL does nothing. */
FERRY_API void ferry_moe_slots_destroy(ferry_moe_slots *s);
/** The last error's message ("" for a NULL executor). */
FERRY_API const char *ferry_moe_slots_last_error(const ferry_moe_slots *s);
/** The device context the executor was created with. */
FERRY_API void *ferry_moe_slots_device(const ferry_moe_slots *s);

/**
 * Apply a copy plan. A pending prefetch is finished first (its slots may be
 * the ones the plan names); if it did not land, its slots are listed in
 * unknown_out, its error is returned and the plan is not applied (apply it
 * again after forgetting them). Then the plan is validated whole (-EINVAL,
 * nothing moves: halves
 * of the plan are one array pair so only n is checked, layer in range,
 * every slot in range and none named twice, every row present in rows and
 * exactly its bank's width - FERRY_EMISMATCH for a width). An empty plan is
 * a warm step: no device call at all. Each slot's occupant is cleared
 * before its first write and set after all its banks landed and the plan
 * flushed. A failed write leaves that slot (and the plan's later slots)
 * unknown; a failed flush leaves every slot of the plan unknown.
 * unknown_out (may be NULL; room for plan->n, and for the pending
 * prefetch's rows when one may be pending) receives the slots left
 * unknown by a failure and *n_unknown their count: pass each to
 * ferry_moe_planner_forget(). Returns the rows applied (0 for warm).
 */
FERRY_API int ferry_moe_slots_apply(ferry_moe_slots *s, const ferry_moe_copy_plan *plan,
                                    const ferry_moe_rows *rows, uint32_t *unknown_out,
                                    uint32_t *n_unknown);
/**
 * Apply a gather plan (slot -> slot on the device). Refuses (-EINVAL,
 * nothing moves) a source whose occupant is unknown, a slot out of range,
 * a destination named twice, a destination that is also a source, or
 * src == dst. Billed to device bytes, never host bytes. A pending prefetch
 * is finished first and failures are reported, as for apply.
 */
FERRY_API int ferry_moe_slots_gather(ferry_moe_slots *s, const ferry_moe_gather_plan *plan,
                                     uint32_t *unknown_out, uint32_t *n_unknown);
/**
 * Prefetch: start applying a plan from ferry_moe_planner_prefetch() and
 * return without waiting, so the copies overlap the caller's compute:
 * host rows go on the device's prefetch stream (FERRY_MOE_ROUTE_PREFETCH);
 * rows on a file are read by the executor's reader thread (the reads are
 * what takes time), the caller must then leave the rows source and the
 * device context alone until the next call on the executor. Validated as
 * apply; its slots are unknown until ferry_moe_slots_prefetch_finish()
 * (which any later apply, gather or prefetch_start calls first, so plans
 * never race on a slot). At most one prefetch is pending. Returns the rows
 * queued. A device without flush_prefetch completes a plan of host rows
 * here.
 */
FERRY_API int ferry_moe_slots_prefetch_start(ferry_moe_slots *s, const ferry_moe_copy_plan *plan,
                                             const ferry_moe_rows *rows, uint32_t *unknown_out,
                                             uint32_t *n_unknown);
/**
 * Wait for the pending prefetch and set its occupants; on failure every slot
 * of that plan is unknown and listed in unknown_out as for apply. No
 * pending prefetch: returns 0 at once. Returns the rows that landed.
 */
FERRY_API int ferry_moe_slots_prefetch_finish(ferry_moe_slots *s, uint32_t *unknown_out,
                                              uint32_t *n_unknown);
/** Occupant (global expert id) of slot, FERRY_MOE_NONE when unknown (also
 * out of range). */
FERRY_API uint32_t ferry_moe_slots_occupant(const ferry_moe_slots *s, uint32_t slot);
/** Mark a slot unknown (e.g. after the planner dropped it). -EINVAL when
 * slot >= slots. */
FERRY_API int ferry_moe_slots_invalidate(ferry_moe_slots *s, uint32_t slot);
/** The executor's totals, written as far as out->size says (as
 *  ferry_moe_planner_stats_get). Errors: -EINVAL (NULL, size not set). */
FERRY_API int ferry_moe_slots_stats_get(const ferry_moe_slots *s, ferry_moe_slots_stats *out);

/**
 * Walk planner and executor and check they agree on every occupant: each
 * slot the executor knows holds what the planner says, and each slot the
 * planner holds is known to the executor. Returns 0, or FERRY_EMISMATCH
 * with a message naming the first slot where they disagree; -EINVAL for
 * a NULL planner or executor.
 */
FERRY_API int ferry_moe_check(const ferry_moe_planner *p, const ferry_moe_slots *s);

/* ======================================================================
 * Replay
 * ====================================================================== */

typedef struct ferry_moe_replay_result {
    char policy[32];
    uint32_t slots;
    uint64_t steps, hits, misses;
    double hit_rate;      /**< hits / (hits + misses) */
    uint64_t host_bytes;  /**< misses * expert_bytes */
    uint64_t evictions;
    double ns_per_step;   /**< planner time per step */
} ferry_moe_replay_result;

/**
 * Replay trace t through a planner of `slots` slots and `policy` (belady
 * included): a step is one pass at one layer; hits and misses count the
 * step's distinct experts, a hit being resident when the step starts; a
 * step wider than the slots streams through them in waves. host_bytes
 * uses expert_bytes (0: the trace's; any value, saturating at
 * UINT64_MAX). slots: as ferry_moe_planner_options.slots. Errors as
 * ferry_moe_planner_create.
 */
FERRY_API int ferry_moe_replay(const ferry_moe_trace *t, const char *policy, uint32_t slots,
                               uint64_t expert_bytes, ferry_moe_replay_result *out);

/* ======================================================================
 * Decode timeline
 * ====================================================================== */

/** Options of the decode timeline (ferry_moe_sim). */
typedef struct ferry_moe_sim_options {
    size_t size;           /**< sizeof(ferry_moe_sim_options) or more */
    const char *policy;    /**< as the planner's (NULL: "auto"); "belady" takes no hints */
    uint32_t slots;        /**< as the planner's */
    double compute_us;     /**< compute of one layer-step: (0, 1e9] */
    double link_gbs;       /**< GB/s of the link rows cross (host or NVMe -> device): (0, 1e6] */
    uint64_t expert_bytes; /**< bytes of one expert; 0: the trace's (which must say) */
    /** hints: the routes of the step this many layer-steps ahead (1: the
     *  next layer, as a pre-gating predictor; L: the next token's same
     *  layer, as a draft), 0..2^20; 0: no hints */
    uint32_t hint_steps;
    /** share of a hint's experts that are right: 0..1 (with hint_trace:
     *  the confidence the engine puts in its predictions) */
    double hint_accuracy;
    uint64_t seed;         /**< of the hints' wrong experts */
    /** 1: the hints are the trace's own predictions (ferry_moe_trace_step_pred)
     *  of the step hint_steps ahead, not made from its routes; 0: made */
    int hint_trace;
    /** a model larger than host memory: this share (0..1) of every layer's
     *  experts (a fixed, spread set) has its rows on NVMe, copied at
     *  nvme_gbs ((0, 1e6] when the share is above 0) instead of link_gbs */
    double nvme_share, nvme_gbs;
} ferry_moe_sim_options;
/** The smallest size ferry_moe_sim takes: this first version's struct. */
#define FERRY_MOE_SIM_OPTIONS_MIN_SIZE sizeof(ferry_moe_sim_options)
#define FERRY_MOE_SIM_OPTIONS_INIT \
    {FERRY_FIELD(size) sizeof(ferry_moe_sim_options), FERRY_FIELD(policy) NULL, \
     FERRY_FIELD(slots) 0, FERRY_FIELD(compute_us) 100.0, FERRY_FIELD(link_gbs) 25.0, \
     FERRY_FIELD(expert_bytes) 0, FERRY_FIELD(hint_steps) 0, FERRY_FIELD(hint_accuracy) 0.9, \
     FERRY_FIELD(seed) 1, FERRY_FIELD(hint_trace) 0, FERRY_FIELD(nvme_share) 0.0, \
     FERRY_FIELD(nvme_gbs) 0.0}

/** What a decode timeline took. */
typedef struct ferry_moe_sim_result {
    /** set by the caller: sizeof(ferry_moe_sim_result), or an older
     * header's: the result is written only that far (the size itself is
     * left as set); below sizeof(size_t): -EINVAL, nothing written */
    size_t size;
    uint64_t steps, passes; /**< layer-steps; forward passes (tokens in decode) */
    double total_us, compute_us, stall_us;
    double tokens_per_s;    /**< passes per second of total time */
    double no_wait_share;   /**< share of layer-steps whose experts had all landed */
    uint64_t hits, misses;  /**< as replay counts them */
    uint64_t bytes_moved;   /**< every copy over the link (demand and prefetch) */
    uint64_t prefetch_bytes, prefetch_wasted_bytes;
} ferry_moe_sim_result;
#define FERRY_MOE_SIM_RESULT_INIT {FERRY_FIELD(size) sizeof(ferry_moe_sim_result)}

/**
 * A decode timeline of trace t: the planner (policy, slots) drives two
 * streams as the executor does, compute (compute_us per layer-step) and the
 * copy link (one expert_bytes row at a time at link_gbs). A step starts
 * when the previous one is computed and its experts have landed; the wait
 * is its stall. Misses are asked for when the step is reached and go
 * ahead of prefetch rows not yet on the link. With hint_steps, when a step
 * starts computing the planner is told the routes of the step that far
 * ahead (ferry_moe_planner_hint, confidence hint_accuracy), predicted from
 * the trace itself: its true experts, each replaced with probability 1 -
 * hint_accuracy by a wrong expert of that layer (or, with hint_trace, the
 * trace's own predictions); eviction protects them until that step. The
 * hinted experts not resident are prefetched, best first
 * (ferry_moe_planner_hint_prefetch: only those expected to save more than
 * they cost), while the link's backlog is shorter than the lead
 * (hint_steps x compute_us), at most the rows whose expected wrong ones
 * cost no more link time than the lead ((1 - p) x rows x copy time <=
 * lead, p the planner's calibrated probability that a missing hinted
 * expert is right, at most hint_accuracy). A prefetched expert its step did not route is then
 * released (forgotten; its copy cancelled if not started). Deterministic
 * for a seed. The caller sets out->size (FERRY_MOE_SIM_RESULT_INIT);
 * only that many bytes are written. Errors: -EINVAL naming the option and
 * its range (or out->size not set: nothing written), the planner's
 * errors, -ENOMEM.
 */
FERRY_API int ferry_moe_sim(const ferry_moe_trace *t, const ferry_moe_sim_options *o,
                            ferry_moe_sim_result *out);
/**
 * The timeline's two bounds for the same options: every expert resident
 * (no stall at all), and Belady's misses (policy and hints ignored) moved
 * by a link that never idles from time zero, each step starting once its
 * misses could have landed: no prefetch that moves as many rows does
 * better. Both results are written as far as their size says, as
 * ferry_moe_sim's. Errors as ferry_moe_sim.
 */
FERRY_API int ferry_moe_sim_bounds(const ferry_moe_trace *t, const ferry_moe_sim_options *o,
                                   ferry_moe_sim_result *resident, ferry_moe_sim_result *belady);

#ifdef __cplusplus
}
#endif
#endif
