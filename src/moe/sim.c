/*
 * sim.c - a decode timeline: what a policy's misses cost in time, and how
 * much of that prefetch hints hide.
 *
 * Two streams, as the executor runs them: compute (one layer-step after
 * another, compute_us each) and the copy link (one row at a time at
 * link_gbs). A step starts when the previous one is computed and every
 * expert it routes has landed; the wait is its stall.
 *  - Demand: a step's misses are asked for when it is reached. The link
 *    serves demand first: a miss's copy goes after the row on the link now
 *    (a row is not split), ahead of every prefetch row not started; a
 *    routed expert whose prefetch copy has not started becomes a demand
 *    copy; one that is on the link is waited for.
 *  - Hints: when a step starts computing, the planner is told the routes
 *    of the step hint_steps ahead (ferry_moe_planner_hint), which it
 *    protects from eviction until then, and the hinted experts missing are
 *    prefetched best first (ferry_moe_planner_hint_prefetch), so their
 *    copies overlap the compute in between. The planner plans only rows
 *    expected to save more than they cost (its calibrated probability of
 *    a missing hinted expert being right above 1/2, more to take a
 *    victim's slot); they are sent while the link's backlog is shorter
 *    than that lead, at most those whose expected wrong ones cost the
 *    link no more than the lead saves ((1 - p) x rows x copy time <=
 *    lead): on a link much slower than the compute a wrong row costs more
 *    than a right one saves. A prefetched expert its
 *    step did not route is released after that step (forgotten, as an
 *    engine would invalidate it; its copy cancelled if not started), so
 *    wrong guesses do not displace experts in use.
 *  - Hints are made from the trace itself: the true experts of that step,
 *    each replaced with probability 1 - accuracy by a wrong expert of the
 *    same layer, so the value of a predictor is measured before it is
 *    built; or (hint_trace) they are the engine's own predictions the
 *    trace recorded.
 * The bounds: every expert resident (no stall), and Belady's misses moved
 * by a link that never idles from time zero (each step starts once its
 * misses could have landed: what a prefetch knowing the whole future would
 * reach with Belady's rows).
 */
#include <errno.h>
#include <math.h>
#include <string.h>

#include "sized.h"
#include "moe/moe_internal.h"

typedef struct sim {
    const ferry_moe_trace *t;
    ferry_moe_planner *p;
    double xfer_us, now, link_free, stall; /* xfer_us: a host row's copy */
    double nvme_us, nvme_share;            /* a row on NVMe; share of experts there */
    double demand_free; /* when the last demand copy lands */
    double *arrival;    /* per slot: when its last copy lands */
    uint32_t *copy_gen; /* per slot: copies into it so far */
    /* prefetch copies not landed yet, in link order: a demand copy goes
     * ahead of every one not started */
    struct pq {
        double start, end;
        uint32_t slot, gen;
    } *pq;
    size_t pq_head, pq_n;
    uint64_t bytes, demand, prefetch_rows;
    uint64_t no_wait;
    uint32_t *pred, *mark, mark_gen; /* the hint, marks over a layer's experts */
    size_t *htarget;                 /* per id: the nearest step it is hinted for */
    ferry__rng rng;
    /* prefetched rows waiting for their step: released unused after it */
    struct pend {
        size_t target;
        uint32_t slot, id;
    } *pend;
    size_t pend_head, pend_n, pend_cap;
} sim;

static int check_options(const ferry_moe_trace *t, const ferry_moe_sim_options *o)
{
    if (!t || !o)
        return ferry__err_set(NULL, -EINVAL, "moe sim: no trace or options");
    static const ferry__sized sized =
        FERRY__SIZED0(ferry_moe_sim_options, FERRY_MOE_SIM_OPTIONS_MIN_SIZE);
    int rc = ferry__opts_size_ok(NULL, "moe sim", &sized, o->size);
    if (rc < 0)
        return rc;
    if (!(o->compute_us > 0 && o->compute_us <= 1e9))
        return ferry__err_set(NULL, -EINVAL, "moe sim: compute_us %g: accepted (0, 1e9]",
                              o->compute_us);
    if (!(o->link_gbs > 0 && o->link_gbs <= 1e6))
        return ferry__err_set(NULL, -EINVAL, "moe sim: link_gbs %g: accepted (0, 1e6]",
                              o->link_gbs);
    if (!o->expert_bytes && !t->model.expert_bytes)
        return ferry__err_set(NULL, -EINVAL,
                              "moe sim: expert_bytes 0 and the trace does not say how big an "
                              "expert is");
    if (o->hint_steps > (1u << 20))
        return ferry__err_set(NULL, -EINVAL, "moe sim: hint_steps %u: accepted 0..%u",
                              o->hint_steps, 1u << 20);
    if (!(o->hint_accuracy >= 0 && o->hint_accuracy <= 1))
        return ferry__err_set(NULL, -EINVAL, "moe sim: hint_accuracy %g: accepted 0..1",
                              o->hint_accuracy);
    if (!(o->nvme_share >= 0 && o->nvme_share <= 1))
        return ferry__err_set(NULL, -EINVAL, "moe sim: nvme_share %g: accepted 0..1",
                              o->nvme_share);
    if (o->nvme_share > 0 && !(o->nvme_gbs > 0 && o->nvme_gbs <= 1e6))
        return ferry__err_set(NULL, -EINVAL,
                              "moe sim: nvme_gbs %g: accepted (0, 1e6] when nvme_share > 0",
                              o->nvme_gbs);
    if (o->hint_steps && o->policy && !strcmp(o->policy, "belady"))
        return ferry__err_set(NULL, -EINVAL, "moe sim: belady replays a fixed trace and takes "
                                             "no hints (hint_steps 0)");
    return 0;
}

/* which experts live on NVMe: a fixed, well-spread share of every layer's */
static int on_nvme(double share, uint32_t id)
{
    return share > 0 && (double)(uint32_t)(id * 2654435761u) / 4294967296.0 < share;
}

/* the copy time of the row going into slot (its occupant's source) */
static double row_us(const sim *s, uint32_t slot)
{
    uint32_t id = ferry_moe_planner_occupant(s->p, slot);
    return id != FERRY_MOE_NONE && on_nvme(s->nvme_share, id) ? s->nvme_us : s->xfer_us;
}

/* demand copies, asked for at s->now: after the row on the link now (a
 * row is not split), ahead of every prefetch row not started */
static void copy_demand(sim *s, const uint32_t *dst, uint32_t n)
{
    while (s->pq_head < s->pq_n && s->pq[s->pq_head].end <= s->now)
        s->pq_head++;
    for (uint32_t i = 0; i < n; i++) {
        double x = row_us(s, dst[i]);
        double t0 = s->demand_free > s->now ? s->demand_free : s->now;
        size_t k = s->pq_head;
        for (; k < s->pq_n && s->pq[k].start < t0; k++)
            if (s->pq[k].end > t0)
                t0 = s->pq[k].end; /* in flight: lands first */
        for (size_t q = k; q < s->pq_n; q++) { /* not started: pushed back */
            s->pq[q].start += x;
            s->pq[q].end += x;
            if (s->copy_gen[s->pq[q].slot] == s->pq[q].gen)
                s->arrival[s->pq[q].slot] = s->pq[q].end;
        }
        s->demand_free = t0 + x;
        if (k < s->pq_n)
            s->link_free += x;
        if (s->demand_free > s->link_free)
            s->link_free = s->demand_free;
        s->copy_gen[dst[i]]++;
        s->arrival[dst[i]] = s->demand_free;
    }
    s->bytes += n;
}

/* prefetch copies, after everything on the link */
static int copy_prefetch(sim *s, const uint32_t *dst, uint32_t n)
{
    if (s->pq_head && s->pq_head == s->pq_n)
        s->pq_head = s->pq_n = 0;
    struct pq *q = ferry__realloc(s->pq, (s->pq_n + n) * sizeof *q);
    if (!q)
        return ferry__err_set(NULL, -ENOMEM, "moe sim: out of memory");
    s->pq = q;
    for (uint32_t i = 0; i < n; i++) {
        double start = s->link_free > s->now ? s->link_free : s->now;
        s->link_free = start + row_us(s, dst[i]);
        struct pq *e = &s->pq[s->pq_n++];
        e->start = start;
        e->end = s->link_free;
        e->slot = dst[i];
        e->gen = ++s->copy_gen[dst[i]];
        s->arrival[dst[i]] = e->end;
    }
    s->bytes += n;
    return 0;
}

/* the index of slot's prefetch copy if it has not started, else pq_n */
static size_t pq_find_unstarted(const sim *s, uint32_t slot)
{
    if (s->arrival[slot] <= s->now)
        return s->pq_n;
    size_t k = s->pq_head;
    while (k < s->pq_n && !(s->pq[k].slot == slot && s->copy_gen[slot] == s->pq[k].gen))
        k++;
    return k < s->pq_n && s->pq[k].start > s->now ? k : s->pq_n;
}

/* take a prefetch copy that has not started off the link: the rows
 * behind it move up and its bytes are not moved */
static void pq_remove(sim *s, size_t k)
{
    double x = s->pq[k].end - s->pq[k].start;
    for (size_t q = k + 1; q < s->pq_n; q++) {
        s->pq[q].start -= x;
        s->pq[q].end -= x;
        if (s->copy_gen[s->pq[q].slot] == s->pq[q].gen)
            s->arrival[s->pq[q].slot] = s->pq[q].end;
    }
    memmove(s->pq + k, s->pq + k + 1, (s->pq_n - k - 1) * sizeof *s->pq);
    s->pq_n--;
    s->link_free -= x;
    if (s->link_free < s->demand_free)
        s->link_free = s->demand_free;
    s->bytes--;
}

/* a routed expert whose prefetch copy has not started is a demand copy
 * now: it goes ahead of the prefetches */
static void promote(sim *s, const uint32_t *slots, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++) {
        uint32_t slot = slots[i];
        size_t k = pq_find_unstarted(s, slot);
        if (k == s->pq_n)
            continue;
        pq_remove(s, k);
        copy_demand(s, &slot, 1);
    }
}

/* wait for the slots' copies: the stall */
static void wait_for(sim *s, const uint32_t *slots, uint32_t n)
{
    double ready = s->now;
    for (uint32_t i = 0; i < n; i++)
        if (s->arrival[slots[i]] > ready)
            ready = s->arrival[slots[i]];
    if (ready > s->now) {
        s->stall += ready - s->now;
        s->now = ready;
    } else {
        s->no_wait++;
    }
}

/* the hint for step j: its experts, a share replaced by wrong ones (of
 * the same layer, not routed at j); at most cap of them. Marks: g = routed
 * at j, g + 1 = in the hint already */
static uint32_t make_hint(sim *s, size_t j, double acc, uint32_t cap)
{
    const ferry_moe_trace *t = s->t;
    uint32_t E = t->model.num_experts, n = 0, truth = 0, wrong = 0;
    const uint32_t *ex = t->ex + t->off[j];
    uint32_t m = (uint32_t)(t->off[j + 1] - t->off[j]);
    if (s->mark_gen >= UINT32_MAX - 2) {
        memset(s->mark, 0, (size_t)E * sizeof *s->mark);
        s->mark_gen = 0;
    }
    uint32_t g = s->mark_gen + 1;
    s->mark_gen += 2;
    for (uint32_t i = 0; i < m; i++)
        if (s->mark[ex[i]] != g) {
            s->mark[ex[i]] = g;
            truth++;
        }
    for (uint32_t i = 0; i < m && n < cap; i++) {
        uint32_t e = ex[i];
        if (ferry__rng_unit(&s->rng) >= acc && truth + wrong < E) {
            do
                e = ferry__rng_below(&s->rng, E);
            while (s->mark[e] == g || s->mark[e] == g + 1);
            wrong++;
        }
        if (s->mark[e] == g + 1)
            continue; /* named already */
        s->mark[e] = g + 1;
        s->pred[n++] = e;
    }
    return n;
}

/* tell the planner the routes predicted for step j = i + hint_steps */
static int hint_give(sim *s, const ferry_moe_sim_options *o, size_t i)
{
    size_t j = i + o->hint_steps;
    uint32_t n = 0, E = s->t->model.num_experts;
    if (!o->hint_steps || j >= s->t->n_steps)
        return 0;
    if (o->hint_trace) { /* the engine's own prediction, as recorded */
        const uint32_t *pr = NULL;
        (void)ferry_moe_trace_step_pred(s->t, j, &pr, &n); /* j is in range */
        if (n)
            memcpy(s->pred, pr, (size_t)n * sizeof *pr);
    } else {
        n = make_hint(s, j, o->hint_accuracy, E);
    }
    if (!n)
        return 0;
    int rc = ferry_moe_planner_hint(s->p, s->t->layer[j], o->hint_steps, s->pred, n,
                                    o->hint_accuracy);
    if (rc < 0)
        return rc;
    size_t base = (size_t)s->t->layer[j] * E;
    for (uint32_t k = 0; k < n; k++) { /* the nearest step each is hinted for */
        size_t *ht = &s->htarget[base + s->pred[k]];
        if (*ht <= i || *ht > j)
            *ht = j;
    }
    return 0;
}

/* remember prefetched rows until their step, in step order */
static int pend_add(sim *s, const ferry_moe_copy_plan *plan)
{
    if (s->pend_n + plan->n > s->pend_cap) {
        if (s->pend_head) { /* compact first */
            memmove(s->pend, s->pend + s->pend_head, (s->pend_n - s->pend_head) * sizeof *s->pend);
            s->pend_n -= s->pend_head;
            s->pend_head = 0;
        }
        size_t nc = s->pend_cap ? s->pend_cap : 64;
        while (nc < s->pend_n + plan->n)
            nc *= 2;
        struct pend *np = ferry__realloc(s->pend, nc * sizeof *np);
        if (!np)
            return ferry__err_set(NULL, -ENOMEM, "moe sim: out of memory");
        s->pend = np;
        s->pend_cap = nc;
    }
    for (uint32_t k = 0; k < plan->n; k++) {
        uint32_t id = plan->layer * s->t->model.num_experts + plan->src_rows[k];
        size_t at = s->pend_n++, target = s->htarget[id];
        for (; at > s->pend_head && s->pend[at - 1].target > target; at--)
            s->pend[at] = s->pend[at - 1];
        s->pend[at].target = target;
        s->pend[at].slot = plan->dst_slots[k];
        s->pend[at].id = id;
    }
    return 0;
}

/* hint the step hint_steps ahead, then prefetch what hints name and is
 * missing, best first: while the link can start it within the hint's
 * lead, and no more rows than whose expected wrong ones cost the link
 * less than that lead saves ((1 - p) x rows x copy time <= lead, p the
 * planner's calibrated probability, at most the stated accuracy) */
static int hint(sim *s, const ferry_moe_sim_options *o, size_t i, uint32_t active)
{
    int rc = hint_give(s, o, i);
    uint32_t slots = ferry_moe_planner_slots(s->p);
    if (rc < 0 || !o->hint_steps || active >= slots)
        return rc;
    double lead = o->hint_steps * o->compute_us, backlog = s->link_free - s->now;
    if (backlog >= lead)
        return 0;
    uint32_t cap = slots - active;
    double mean = s->xfer_us * (1 - s->nvme_share) + s->nvme_us * s->nvme_share;
    double right = ferry__planner_hint_p(s->p, o->hint_accuracy); /* calibrated, missing */
    double wrong = (1 - (right < o->hint_accuracy ? right : o->hint_accuracy)) * mean;
    if (wrong > 0 && lead / wrong < cap)
        cap = (uint32_t)(lead / wrong);
    ferry_moe_copy_plan plan;
    while (cap > 0 && (rc = ferry_moe_planner_hint_prefetch(s->p, cap, &plan)) > 0) {
        if ((rc = copy_prefetch(s, plan.dst_slots, plan.n)) < 0 || (rc = pend_add(s, &plan)) < 0)
            return rc;
        s->prefetch_rows += plan.n;
        cap -= plan.n;
    }
    return rc < 0 ? rc : 0;
}

/* step i ran: a prefetched expert for it (or before) that it did not route
 * was a wrong guess; the engine releases it (forget, and invalidate in
 * the executor) so that it does not displace experts that are used */
static int release_wrong(sim *s, size_t i)
{
    const ferry_moe_trace *t = s->t;
    uint32_t E = t->model.num_experts;
    while (s->pend_head < s->pend_n && s->pend[s->pend_head].target <= i) {
        struct pend *e = &s->pend[s->pend_head++];
        if (ferry_moe_planner_occupant(s->p, e->slot) != e->id)
            continue; /* evicted already */
        int used = 0;
        if (e->target == i && t->layer[i] == e->id / E)
            for (size_t k = t->off[i]; k < t->off[i + 1] && !used; k++)
                used = t->ex[k] == e->id % E;
        if (!used) {
            size_t k = pq_find_unstarted(s, e->slot);
            if (k < s->pq_n) { /* not on the link yet: cancelled */
                pq_remove(s, k);
                s->prefetch_rows--;
                s->arrival[e->slot] = s->now;
            }
            int rc = ferry_moe_planner_forget(s->p, e->slot);
            if (rc < 0)
                return rc;
        }
    }
    return 0;
}

/* one step that fits: ensure, demand copies, wait, hint, compute */
static int step_fit(sim *s, const ferry_moe_sim_options *o, size_t i, uint32_t *slots_out)
{
    const ferry_moe_trace *t = s->t;
    uint32_t n = (uint32_t)(t->off[i + 1] - t->off[i]);
    ferry_moe_copy_plan plan;
    ferry_moe_counts c;
    int rc = ferry_moe_planner_ensure(s->p, t->layer[i], t->ex + t->off[i], n, slots_out, &plan,
                                      &c);
    if (rc < 0)
        return rc;
    copy_demand(s, plan.dst_slots, plan.n);
    s->demand += plan.n;
    promote(s, slots_out, n);
    wait_for(s, slots_out, n);
    if ((rc = release_wrong(s, i)) < 0 || (rc = hint(s, o, i, c.active)) < 0)
        return rc;
    s->now += o->compute_us;
    return 0;
}

/* a step wider than the slots: its waves one after another, the compute
 * split between them by their experts */
static int step_stream(sim *s, const ferry_moe_sim_options *o, size_t i)
{
    const ferry_moe_trace *t = s->t;
    uint32_t n = (uint32_t)(t->off[i + 1] - t->off[i]);
    ferry_moe_counts c;
    int rc = ferry_moe_planner_stream_begin(s->p, t->layer[i], t->ex + t->off[i], n, &c);
    ferry_moe_wave w;
    while (rc >= 0 && (rc = ferry_moe_planner_stream_next(s->p, &w)) > 0) {
        copy_demand(s, w.plan.dst_slots, w.plan.n);
        s->demand += w.plan.n;
        wait_for(s, w.slots, w.n);
        s->now += o->compute_us * w.n / c.active;
    }
    return rc;
}

/* a result's size, set by the caller (see ferry__stats_put): 0, or
 * -EINVAL before anything is run */
static int result_size_ok(const char *what, const ferry_moe_sim_result *r)
{
    size_t s;
    memcpy(&s, r, sizeof s);
    if (s < sizeof s)
        return ferry__err_set(NULL, -EINVAL,
                              "%s: out->size %zu is not set (this library's ferry_moe_sim_result "
                              "is %zu bytes; set size to your header's sizeof, e.g. "
                              "FERRY_MOE_SIM_RESULT_INIT)",
                              what, s, sizeof *r);
    return 0;
}

static void finish(sim *s, const ferry_moe_sim_options *o, ferry_moe_sim_result *r)
{
    ferry_moe_planner_stats st = FERRY_MOE_PLANNER_STATS_INIT;
    ferry_moe_planner_stats_get(s->p, &st);
    uint64_t B = o->expert_bytes ? o->expert_bytes : s->t->model.expert_bytes;
    memset(r, 0, sizeof *r);
    r->size = sizeof *r;
    r->steps = s->t->n_steps;
    r->passes = s->t->n_tokens;
    r->total_us = s->now;
    r->stall_us = s->stall;
    r->compute_us = s->now - s->stall;
    r->tokens_per_s = s->now > 0 ? r->passes / (s->now / 1e6) : 0;
    r->no_wait_share = s->t->n_steps ? (double)s->no_wait / (double)s->t->n_steps : 1.0;
    r->hits = st.hits;
    r->misses = st.misses;
    r->bytes_moved = s->bytes * B;
    r->prefetch_bytes = s->prefetch_rows * B;
    r->prefetch_wasted_bytes = st.prefetch_wasted * B;
}

int ferry_moe_sim(const ferry_moe_trace *t, const ferry_moe_sim_options *o,
                  ferry_moe_sim_result *out)
{
    int rc = check_options(t, o);
    if (rc < 0)
        return rc;
    if (!out)
        return ferry__err_set(NULL, -EINVAL, "moe sim: no result");
    if ((rc = result_size_ok("moe sim", out)) < 0)
        return rc;
    ferry_moe_planner_options po = FERRY_MOE_PLANNER_OPTIONS_INIT;
    po.num_layers = t->model.num_layers;
    po.num_experts = t->model.num_experts;
    po.slots = o->slots;
    po.policy = o->policy;
    po.oracle = t;
    po.top_k = t->model.top_k <= t->model.num_experts ? t->model.top_k : 0;
    po.expert_bytes = o->expert_bytes ? o->expert_bytes : t->model.expert_bytes;
    sim s;
    memset(&s, 0, sizeof s);
    s.t = t;
    if ((rc = ferry_moe_planner_create(&po, &s.p)) < 0)
        return rc;
    s.xfer_us = (double)po.expert_bytes / (o->link_gbs * 1e3);
    s.nvme_share = o->nvme_share;
    s.nvme_us = o->nvme_share > 0 ? (double)po.expert_bytes / (o->nvme_gbs * 1e3) : s.xfer_us;
    s.arrival = ferry__calloc(o->slots, sizeof *s.arrival);
    s.copy_gen = ferry__calloc(o->slots, sizeof *s.copy_gen);
    s.pred = ferry__malloc((size_t)t->model.num_experts * sizeof *s.pred);
    s.mark = ferry__calloc(t->model.num_experts, sizeof *s.mark);
    uint32_t *slots_out = ferry__malloc((size_t)t->model.num_experts * sizeof *slots_out);
    if (o->hint_steps)
        s.htarget = ferry__calloc((size_t)t->model.num_layers * t->model.num_experts,
                                  sizeof *s.htarget);
    if (!s.arrival || !s.copy_gen || !s.pred || !s.mark || !slots_out ||
        (o->hint_steps && !s.htarget)) {
        rc = ferry__err_set(NULL, -ENOMEM, "moe sim: out of memory");
        goto done;
    }
    ferry__rng_seed(&s.rng, o->seed);
    for (size_t i = 0; i < t->n_steps && rc >= 0; i++) {
        uint32_t n = (uint32_t)(t->off[i + 1] - t->off[i]);
        if (n <= o->slots && n <= t->model.num_experts)
            rc = step_fit(&s, o, i, slots_out);
        else
            rc = step_stream(&s, o, i);
    }
    if (rc >= 0) {
        ferry_moe_sim_result v;
        finish(&s, o, &v);
        rc = ferry__stats_put(NULL, "moe sim", out, &v, sizeof v);
    }
done:
    ferry__free(slots_out);
    ferry__free(s.arrival);
    ferry__free(s.pred);
    ferry__free(s.mark);
    ferry__free(s.pend);
    ferry__free(s.htarget);
    ferry__free(s.pq);
    ferry__free(s.copy_gen);
    ferry_moe_planner_destroy(s.p);
    return rc;
}

int ferry_moe_sim_bounds(const ferry_moe_trace *t, const ferry_moe_sim_options *o,
                         ferry_moe_sim_result *resident, ferry_moe_sim_result *belady)
{
    int rc = check_options(t, o);
    if (rc < 0)
        return rc;
    if (!resident || !belady)
        return ferry__err_set(NULL, -EINVAL, "moe sim bounds: no result");
    if ((rc = result_size_ok("moe sim bounds: resident", resident)) < 0 ||
        (rc = result_size_ok("moe sim bounds: belady", belady)) < 0)
        return rc;
    uint64_t B = o->expert_bytes ? o->expert_bytes : t->model.expert_bytes;
    ferry_moe_sim_result res_v, bel_v, *res = &res_v;
    memset(res, 0, sizeof *res);
    res->size = sizeof *res;
    res->steps = t->n_steps;
    res->passes = t->n_tokens;
    res->total_us = res->compute_us = (double)t->n_steps * o->compute_us;
    res->tokens_per_s = res->total_us > 0 ? t->n_tokens / (res->total_us / 1e6) : 0;
    res->no_wait_share = 1.0;
    ferry_moe_planner_options po = FERRY_MOE_PLANNER_OPTIONS_INIT;
    po.num_layers = t->model.num_layers;
    po.num_experts = t->model.num_experts;
    po.slots = o->slots;
    po.policy = "belady";
    po.oracle = t;
    ferry_moe_planner *p;
    if ((rc = ferry_moe_planner_create(&po, &p)) < 0)
        return rc;
    double xfer = (double)B / (o->link_gbs * 1e3), now = 0, link = 0, stall = 0;
    double xn = o->nvme_share > 0 ? (double)B / (o->nvme_gbs * 1e3) : xfer;
    uint64_t no_wait = 0, moved = 0;
    for (size_t i = 0; i < t->n_steps && rc >= 0; i++) {
        uint32_t n = (uint32_t)(t->off[i + 1] - t->off[i]), E = t->model.num_experts;
        ferry_moe_counts c;
        ferry_moe_copy_plan plan;
        double rows_us = 0; /* the link never idles: moved as early as it could */
        if (n <= o->slots) {
            rc = ferry_moe_planner_ensure(p, t->layer[i], t->ex + t->off[i], n, NULL, &plan, &c);
            for (uint32_t k = 0; rc >= 0 && k < plan.n; k++)
                rows_us += on_nvme(o->nvme_share, plan.layer * E + plan.src_rows[k]) ? xn : xfer;
        } else {
            rc = ferry_moe_planner_stream_begin(p, t->layer[i], t->ex + t->off[i], n, &c);
            ferry_moe_wave w;
            while (rc >= 0 && (rc = ferry_moe_planner_stream_next(p, &w)) > 0)
                for (uint32_t k = 0; k < w.plan.n; k++)
                    rows_us += on_nvme(o->nvme_share, w.plan.layer * E + w.plan.src_rows[k]) ? xn
                                                                                          : xfer;
        }
        if (rc < 0)
            break;
        link += rows_us;
        moved += c.missing;
        if (link > now) {
            stall += link - now;
            now = link;
        } else {
            no_wait++;
        }
        now += o->compute_us;
    }
    if (rc >= 0) {
        ferry_moe_planner_stats st = FERRY_MOE_PLANNER_STATS_INIT;
        ferry_moe_planner_stats_get(p, &st);
        ferry_moe_sim_result *bel = &bel_v;
        memset(bel, 0, sizeof *bel);
        bel->size = sizeof *bel;
        bel->steps = t->n_steps;
        bel->passes = t->n_tokens;
        bel->total_us = now;
        bel->stall_us = stall;
        bel->compute_us = now - stall;
        bel->tokens_per_s = now > 0 ? t->n_tokens / (now / 1e6) : 0;
        bel->no_wait_share = t->n_steps ? (double)no_wait / (double)t->n_steps : 1.0;
        bel->hits = st.hits;
        bel->misses = st.misses;
        bel->bytes_moved = moved * B;
        rc = ferry__stats_put(NULL, "moe sim bounds", resident, res, sizeof *res);
        if (rc == 0)
            rc = ferry__stats_put(NULL, "moe sim bounds", belady, bel, sizeof *bel);
    }
    ferry_moe_planner_destroy(p);
    return rc;
}
