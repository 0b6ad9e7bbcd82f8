/*
 * replay.c - run a routing trace through a planner and count what crossed
 * the link.
 *
 * A step is one pass at one layer; hits and misses count the step's
 * distinct experts, a hit being an expert resident when the step starts.
 * A step wider than the slots (a prefill batch, a budget below a layer) is
 * streamed through them in waves, as the engine would run it.
 * That is exactly ensure()'s (active - missing, missing), so replay adds
 * nothing of its own to the planner's decisions: the figures it prints are
 * the ones a serving engine driving the same planner would see.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "moe/moe_internal.h"

int ferry_moe_replay(const ferry_moe_trace *t, const char *policy, uint32_t slots,
                     uint64_t expert_bytes, ferry_moe_replay_result *out)
{
    if (!t || !out)
        return ferry__err_set(NULL, -EINVAL, "moe replay: no trace or result");
    ferry_moe_planner_options o = FERRY_MOE_PLANNER_OPTIONS_INIT;
    o.num_layers = t->model.num_layers;
    o.num_experts = t->model.num_experts;
    o.slots = slots;
    o.policy = policy;
    o.top_k = t->model.top_k <= t->model.num_experts ? t->model.top_k : 0;
    o.oracle = t;
    ferry_moe_planner *p;
    int rc = ferry_moe_planner_create(&o, &p);
    if (rc < 0)
        return rc;
    uint64_t t0 = ferry__now_ns();
    for (size_t i = 0; i < t->n_steps && rc >= 0; i++) {
        uint32_t n = (uint32_t)(t->off[i + 1] - t->off[i]);
        if (n <= slots) {
            rc = ferry_moe_planner_ensure(p, t->layer[i], t->ex + t->off[i], n, NULL, NULL, NULL);
            continue;
        }
        /* more experts than slots (a prefill batch, a small budget): waves */
        rc = ferry_moe_planner_stream_begin(p, t->layer[i], t->ex + t->off[i], n, NULL);
        ferry_moe_wave w;
        while (rc >= 0 && (rc = ferry_moe_planner_stream_next(p, &w)) > 0)
            ;
    }
    if (rc < 0) {
        ferry_moe_planner_destroy(p);
        return rc;
    }
    uint64_t t1 = ferry__now_ns();
    ferry_moe_planner_stats st = FERRY_MOE_PLANNER_STATS_INIT;
    ferry_moe_planner_stats_get(p, &st);
    ferry_moe_replay_result r;
    memset(&r, 0, sizeof r);
    snprintf(r.policy, sizeof r.policy, "%s", ferry_moe_planner_policy(p));
    r.slots = slots;
    r.steps = st.steps;
    r.hits = st.hits;
    r.misses = st.misses;
    r.hit_rate = st.hits + st.misses ? (double)st.hits / (double)(st.hits + st.misses) : 0.0;
    /* any expert_bytes is accepted: a product past 64 bits saturates */
    if (__builtin_mul_overflow(st.misses, expert_bytes ? expert_bytes : t->model.expert_bytes,
                               &r.host_bytes))
        r.host_bytes = UINT64_MAX;
    r.evictions = st.evictions;
    r.ns_per_step = st.steps ? (double)(t1 - t0) / (double)st.steps : 0.0;
    ferry_moe_planner_destroy(p);
    *out = r;
    return 0;
}
