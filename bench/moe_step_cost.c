/*
 * moe_step_cost.c - what a policy costs a layer-step on a trace.
 *
 *   moe_step_cost TRACE [--slots P%] [--policies a,b,..] [--rounds N]
 *
 * Replays TRACE through one planner per policy (default auto, successor,
 * lru, trio; --slots default 12.5% of the ids), the policies taking turns
 * in each of N rounds (default 5), and prints per policy the nanoseconds
 * a layer-step takes once the slots are full (every miss evicting: the
 * steady state of a long decode), the least and the median over the
 * rounds, and the hit rate. `ferry moe bench --quick` times the
 * generator's DeepSeek-V3 trace; this times any trace, where the duel may
 * follow another member. Steps wider than the slots are refused.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moe/moe_internal.h"

#define MAXP 16
#define MAXR 64

static int cmp_dbl(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* one pass: ns per layer-step once full, and the hit rate */
static int pass(const ferry_moe_trace *t, const char *policy, uint32_t slots, double *ns,
                double *rate)
{
    ferry_moe_planner_options o = FERRY_MOE_PLANNER_OPTIONS_INIT;
    o.num_layers = t->model.num_layers;
    o.num_experts = t->model.num_experts;
    o.slots = slots;
    o.policy = policy;
    o.top_k = t->model.top_k <= t->model.num_experts ? t->model.top_k : 0;
    ferry_moe_planner *p;
    int rc = ferry_moe_planner_create(&o, &p);
    if (rc < 0)
        return rc;
    size_t n = t->n_steps, full = n;
    uint64_t missed = 0, tf = 0;
    for (size_t i = 0; i < n && rc >= 0; i++) {
        if (full == n && missed >= slots) {
            full = i;
            tf = ferry__now_ns();
        }
        ferry_moe_counts c;
        uint32_t k = (uint32_t)(t->off[i + 1] - t->off[i]);
        if (k > slots) {
            rc = -EINVAL;
            break;
        }
        rc = ferry_moe_planner_ensure(p, t->layer[i], t->ex + t->off[i], k, NULL, NULL, &c);
        missed += c.missing;
    }
    uint64_t t1 = ferry__now_ns();
    ferry_moe_planner_stats st = FERRY_MOE_PLANNER_STATS_INIT;
    ferry_moe_planner_stats_get(p, &st);
    ferry_moe_planner_destroy(p);
    if (rc < 0)
        return rc;
    *ns = full < n ? (double)(t1 - tf) / (double)(n - full) : 0.0;
    *rate = st.hits + st.misses ? 100.0 * (double)st.hits / (double)(st.hits + st.misses) : 0.0;
    return 0;
}

int main(int argc, char **argv)
{
    const char *path = NULL, *pols[MAXP] = {"auto", "successor", "lru", "trio"};
    char *plist = NULL;
    int np = 4, rounds = 5;
    double pct = 12.5;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--slots") && i + 1 < argc) {
            pct = atof(argv[++i]);
        } else if (!strcmp(argv[i], "--rounds") && i + 1 < argc) {
            rounds = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--policies") && i + 1 < argc) {
            plist = argv[++i];
            np = 0;
            for (char *s = strtok(plist, ","); s && np < MAXP; s = strtok(NULL, ","))
                pols[np++] = s;
        } else if (argv[i][0] != '-' && !path) {
            path = argv[i];
        } else {
            path = NULL;
            break;
        }
    }
    if (!path || !(pct > 0 && pct <= 100) || rounds < 1 || rounds > MAXR || np < 1) {
        fprintf(stderr, "usage: moe_step_cost TRACE [--slots P%%] [--policies a,b,..] "
                        "[--rounds 1..%d]\n", MAXR);
        return 2;
    }
    ferry_moe_trace *t;
    if (ferry_moe_trace_load(path, &t) < 0) {
        fprintf(stderr, "moe_step_cost: %s: %s\n", path, ferry_last_error());
        return 1;
    }
    uint32_t slots = (uint32_t)((double)t->model.num_layers * t->model.num_experts * pct / 100.0);
    static double ns[MAXP][MAXR];
    double rate[MAXP] = {0};
    int rc = 0;
    for (int r = 0; r < rounds && rc >= 0; r++)
        for (int k = 0; k < np && rc >= 0; k++)
            if ((rc = pass(t, pols[k], slots, &ns[k][r], &rate[k])) < 0)
                fprintf(stderr, "moe_step_cost: %s: %s\n", pols[k], ferry_last_error());
    if (rc >= 0) {
        printf("%s at %.4g%% (%u slots), %zu layer-steps, %d rounds:\n", path, pct, slots,
               t->n_steps, rounds);
        for (int k = 0; k < np; k++) {
            qsort(ns[k], (size_t)rounds, sizeof ns[k][0], cmp_dbl);
            printf("  %-11s %7.0f ns least, %7.0f median a layer-step once full; hit rate %.2f%%\n",
                   pols[k], ns[k][0], ns[k][rounds / 2], rate[k]);
        }
    }
    ferry_moe_trace_destroy(t);
    return rc < 0 ? 1 : 0;
}
