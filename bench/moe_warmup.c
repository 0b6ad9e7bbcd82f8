/*
 * moe_warmup.c - what auto's duel costs before it settles.
 *
 *   moe_warmup TRACE... [--slots P%] [--duel auto|trio] (default 12.5%, auto)
 *
 * Replays each trace through the duel and each of its members in lockstep
 * - auto, lru, successor; or trio, lru, routing, transition - as
 * ferry_moe_replay does (ensure, or waves for a step wider than the
 * slots), and after every step asks the duel which member names its
 * victims. Prints, per trace: the layer-step (and token)
 * at which auto's lead last changed ("settles"), how often it changed,
 * the eventual lead, and the hit rates of auto and of each single policy
 * over the steps before it settled and over the whole trace: the warm-up
 * cost is auto's rate below the eventual lead's own over the steps before
 * it settled (hits lost, and what they are of the whole trace's hits).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moe/moe_internal.h"

#define NPMAX 4
static const char *const duels[2][NPMAX] = {{"auto", "lru", "successor", NULL},
                                           {"trio", "lru", "routing", "transition"}};
static const char *const *pols = duels[0];
static int NP = 3;

static int step(ferry_moe_planner *p, const ferry_moe_trace *t, size_t i, uint32_t slots)
{
    uint32_t n = (uint32_t)(t->off[i + 1] - t->off[i]);
    if (n <= slots)
        return ferry_moe_planner_ensure(p, t->layer[i], t->ex + t->off[i], n, NULL, NULL, NULL);
    int rc = ferry_moe_planner_stream_begin(p, t->layer[i], t->ex + t->off[i], n, NULL);
    ferry_moe_wave w;
    while (rc >= 0 && (rc = ferry_moe_planner_stream_next(p, &w)) > 0)
        ;
    return rc;
}

static int run(const char *path, double pct)
{
    ferry_moe_trace *t;
    int rc = ferry_moe_trace_load(path, &t);
    if (rc < 0) {
        fprintf(stderr, "moe_warmup: %s: %s\n", path, ferry_last_error());
        return rc;
    }
    size_t n = t->n_steps;
    uint32_t slots = (uint32_t)((double)t->model.num_layers * t->model.num_experts * pct / 100.0);
    ferry_moe_planner *pl[NPMAX] = {0};
    uint64_t *hits = calloc((size_t)NP * (n + 1), sizeof *hits); /* cumulative, per step */
    uint64_t *routes = calloc(n + 1, sizeof *routes);
    size_t *tok = calloc(n + 1, sizeof *tok);
    int *lead = calloc(n + 1, sizeof *lead);
    if (!hits || !routes || !tok || !lead)
        rc = -ENOMEM;
    for (int k = 0; k < NP && rc >= 0; k++) {
        ferry_moe_planner_options o = FERRY_MOE_PLANNER_OPTIONS_INIT;
        o.num_layers = t->model.num_layers;
        o.num_experts = t->model.num_experts;
        o.slots = slots;
        o.policy = pols[k];
        o.top_k = t->model.top_k <= t->model.num_experts ? t->model.top_k : 0;
        rc = ferry_moe_planner_create(&o, &pl[k]);
    }
    uint64_t switches = 0;
    for (size_t i = 0; i < n && rc >= 0; i++) {
        for (int k = 0; k < NP && rc >= 0; k++) {
            rc = step(pl[k], t, i, slots);
            ferry_moe_planner_stats st = FERRY_MOE_PLANNER_STATS_INIT;
            ferry_moe_planner_stats_get(pl[k], &st);
            hits[(size_t)k * (n + 1) + i + 1] = st.hits;
            routes[i + 1] = st.hits + st.misses;
        }
        lead[i + 1] = ferry__auto_lead(ferry__planner_policy(pl[0]), &switches);
        tok[i + 1] = t->tok[i];
    }
    if (rc >= 0) {
        size_t settle = 0; /* the first step after which the lead never changed */
        for (size_t i = n; i >= 1; i--)
            if (lead[i] != lead[n]) {
                settle = i;
                break;
            }
        int win = 1 + lead[n]; /* the eventual lead's own planner */
        double r_all = (double)routes[n], r_w = (double)routes[settle];
#define H(k, i) ((double)hits[(size_t)(k) * (n + 1) + (i)])
        printf("%s at %.4g%% (%u slots): %zu layer-steps; %s's lead changed %llu times, "
               "last at layer-step %zu (token %zu), then %s to the end\n",
               path, pct, slots, n, pols[0], (unsigned long long)switches, settle,
               settle ? tok[settle] : 0, pols[win]);
        printf("  hit rate      before it settled   whole trace\n");
        for (int k = 0; k < NP; k++)
            printf("  %-11s   %8.2f%%           %8.2f%%\n", pols[k],
                   r_w > 0 ? 100 * H(k, settle) / r_w : 0.0, 100 * H(k, n) / r_all);
        double lost = H(win, settle) - H(0, settle);
        printf("  warm-up cost: %.0f hits below %s before it settled (%.2f points of the "
               "whole trace's hit rate); %s - %s over the whole trace: %+.2f points\n",
               lost, pols[win], 100 * lost / r_all, pols[0], pols[win],
               100 * (H(0, n) - H(win, n)) / r_all);
#undef H
    } else {
        fprintf(stderr, "moe_warmup: %s: %s\n", path, ferry_last_error());
    }
    for (int k = 0; k < NP; k++)
        ferry_moe_planner_destroy(pl[k]);
    free(hits);
    free(routes);
    free(tok);
    free(lead);
    ferry_moe_trace_destroy(t);
    return rc;
}

int main(int argc, char **argv)
{
    double pct = 12.5;
    int rc = 0, any = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--slots") && i + 1 < argc) {
            pct = atof(argv[++i]);
            if (!(pct > 0 && pct <= 100)) {
                fprintf(stderr, "moe_warmup: --slots %s: a share in (0, 100]%%\n", argv[i]);
                return 2;
            }
            continue;
        }
        if (!strcmp(argv[i], "--duel") && i + 1 < argc) {
            i++;
            if (strcmp(argv[i], "auto") && strcmp(argv[i], "trio")) {
                fprintf(stderr, "moe_warmup: --duel %s: auto or trio\n", argv[i]);
                return 2;
            }
            pols = duels[!strcmp(argv[i], "trio")];
            NP = pols == duels[1] ? 4 : 3;
            continue;
        }
        if (argv[i][0] == '-') {
            fprintf(stderr, "usage: moe_warmup TRACE... [--slots P%%] [--duel auto|trio]\n");
            return 2;
        }
        any = 1;
        if (run(argv[i], pct) < 0)
            rc = 1;
    }
    if (!any) {
        fprintf(stderr, "usage: moe_warmup TRACE... [--slots P%%] [--duel auto|trio]\n");
        return 2;
    }
    return rc;
}
