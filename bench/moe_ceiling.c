/*
 * moe_ceiling.c - how far above global LRU any online expert-cache policy
 * can get on the generator's traces.
 *
 *   moe_ceiling [--model deepseek-v3|qwen3-30b-a3b|mixtral-8x7b|all]
 *               [--tokens 2048] [--seed 1] [--budgets 12.5%,25%] [--json]
 *
 * Belady's MIN bounds every policy from above, but it reads the future; an
 * online policy can at best know how likely each expert is at its layer's
 * next turn. The generator knows exactly that: its mixture (previous
 * token, 2-8 tokens back, the partner of an expert routed at the layer
 * before, popularity) gives each expert's probability from the sets drawn
 * so far (ferry__gen_prob). This bench replays the generator's own trace
 * through a cache that evicts by those true probabilities - the "oracle"
 * columns, which no learned policy can beat on average except by luck -
 * next to the library's LRU, routing and Belady replays of the same trace
 * (ferry_moe_replay, the same seed).
 *
 * The cache follows ensure()'s rules: one global pool, the step's distinct
 * experts are hits when resident at the start of the step, they cannot be
 * evicted during it, a miss takes the lowest free slot or evicts the
 * resident with the largest key (ties: lowest slot). Keys:
 *   oracle-wait  predicted next use in steps, (next turn - now) + (1/p - 1)
 *                * layers: the routing policy's key with the true p
 *   oracle-p     1/p: keep the most probable experts (the optimal policy
 *                when references are independent)
 * The cache's global LRU, run through the same loop, must equal the
 * library's LRU replay: the bench checks it, so the loop is the planner's.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry.h"
#include "moe/moe_internal.h"

enum { K_LRU, K_WAIT, K_P, NKEYS };

typedef struct sim {
    uint32_t L, E, S;
    uint32_t *occ;   /* per slot: id or NONE */
    uint32_t *where; /* per id: slot or NONE */
    uint64_t *last;  /* per id: step of last use (pinned when == step) */
    double *p;       /* per id: cached probability */
    uint64_t *pver;  /* per id: layer version of p */
    uint64_t *lver;  /* per layer: bumped when its probabilities change */
    uint64_t hits, misses;
} sim;

#define NONE UINT32_MAX

static void die(const char *what, int rc)
{
    fprintf(stderr, "moe_ceiling: %s: %s: %s\n", what, ferry_strerror(rc), ferry_last_error());
    exit(1);
}

static void *xcalloc(size_t n, size_t sz)
{
    void *p = calloc(n, sz);
    if (!p)
        die("calloc", -ENOMEM);
    return p;
}

static double prob(sim *s, ferry__gen *g, uint32_t id, uint32_t tk, uint32_t l)
{
    uint32_t m = id / s->E;
    if (s->pver[id] != s->lver[m]) {
        uint32_t next = m > l ? tk : tk + 1;
        s->p[id] = ferry__gen_prob(g, next, m, id % s->E);
        s->pver[id] = s->lver[m];
    }
    return s->p[id] > 1e-12 ? s->p[id] : 1e-12;
}

/* one replay of `tokens` tokens with eviction key `key` */
static double run(const ferry_moe_gen_options *go, uint32_t slots, int key)
{
    ferry_moe_model m;
    ferry__gen *g;
    int rc = ferry__gen_open(go, &g, &m);
    if (rc < 0)
        die("generator", rc);
    sim s = {0};
    s.L = m.num_layers;
    s.E = m.num_experts;
    s.S = slots;
    size_t ids = (size_t)s.L * s.E;
    s.occ = xcalloc(slots, sizeof *s.occ);
    s.where = xcalloc(ids, sizeof *s.where);
    s.last = xcalloc(ids, sizeof *s.last);
    s.p = xcalloc(ids, sizeof *s.p);
    s.pver = xcalloc(ids, sizeof *s.pver);
    s.lver = xcalloc(s.L, sizeof *s.lver);
    memset(s.occ, 0xff, slots * sizeof *s.occ);
    memset(s.where, 0xff, ids * sizeof *s.where);
    for (uint32_t i = 0; i < s.L; i++)
        s.lver[i] = 1;
    uint64_t step = 0;
    uint32_t tokens = go->tokens ? go->tokens : 2048;
    for (uint32_t tk = 0; tk < tokens; tk++)
        for (uint32_t l = 0; l < s.L; l++) {
            const uint32_t *set = ferry__gen_next(g);
            /* the layer's own history and the next layer's partner term moved */
            s.lver[l]++;
            if (l + 1 < s.L)
                s.lver[l + 1]++;
            step++;
            for (uint32_t k = 0; k < m.top_k; k++) {
                uint32_t id = l * s.E + set[k];
                if (s.last[id] == step)
                    continue; /* (sets are distinct; kept for safety) */
                if (s.where[id] != NONE)
                    s.hits++;
                s.last[id] = step; /* pinned for this step */
            }
            for (uint32_t k = 0; k < m.top_k; k++) {
                uint32_t id = l * s.E + set[k];
                if (s.where[id] != NONE)
                    continue;
                s.misses++;
                uint32_t v = NONE;
                double best = -INFINITY;
                for (uint32_t sl = 0; sl < s.S; sl++) {
                    uint32_t o = s.occ[sl];
                    if (o == NONE) {
                        v = sl;
                        break;
                    }
                    if (s.last[o] == step)
                        continue;
                    double kv;
                    if (key == K_LRU)
                        kv = -(double)s.last[o];
                    else {
                        double p = prob(&s, g, o, tk, l);
                        uint32_t om = o / s.E;
                        if (key == K_P)
                            kv = 1.0 / p;
                        else /* steps from now to its next turn, then the geometric wait */
                            kv = (double)(om > l ? om - l : s.L - l + om) + (1.0 / p - 1.0) * s.L;
                    }
                    if (kv > best) {
                        best = kv;
                        v = sl;
                    }
                }
                if (v == NONE)
                    die("no slot (fewer slots than top_k?)", -EINVAL);
                if (s.occ[v] != NONE)
                    s.where[s.occ[v]] = NONE;
                s.occ[v] = id;
                s.where[id] = v;
            }
        }
    double hr = s.hits + s.misses ? (double)s.hits / (double)(s.hits + s.misses) : 0;
    ferry__gen_close(g);
    free(s.occ);
    free(s.where);
    free(s.last);
    free(s.p);
    free(s.pver);
    free(s.lver);
    return hr;
}

int main(int argc, char **argv)
{
    const char *model = "all", *budgets = "12.5%,25%";
    uint32_t tokens = 2048;
    uint64_t seed = 1;
    int json = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--model") && v)
            model = argv[++i];
        else if (!strcmp(a, "--tokens") && v)
            tokens = (uint32_t)strtoul(argv[++i], NULL, 10);
        else if (!strcmp(a, "--seed") && v)
            seed = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(a, "--budgets") && v)
            budgets = argv[++i];
        else if (!strcmp(a, "--json"))
            json = 1;
        else {
            fprintf(stderr, "usage: moe_ceiling [--model NAME|all] [--tokens N] [--seed S] "
                            "[--budgets 12.5%%,25%%] [--json]\n");
            return 2;
        }
    }
    if (tokens == 0) {
        fprintf(stderr, "moe_ceiling: --tokens must be > 0\n");
        return 2;
    }
    static const char *const all[] = {"deepseek-v3", "qwen3-30b-a3b", "mixtral-8x7b", NULL};
    const char *one[] = {model, NULL};
    const char *const *models = strcmp(model, "all") ? one : all;
    if (!json)
        printf("hit rate %% (%u tokens, seed %llu); oracle = eviction by the generator's true "
               "next-turn probabilities\n"
               "%-14s %6s %7s %7s %12s %9s %7s  %s\n",
               tokens, (unsigned long long)seed, "preset", "slots", "lru", "routing",
               "oracle-wait", "oracle-p", "belady", "best online - lru");
    else
        printf("[");
    int first = 1;
    for (int mi = 0; models[mi]; mi++) {
        ferry_moe_gen_options go = FERRY_MOE_GEN_OPTIONS_INIT;
        go.model = models[mi];
        go.tokens = tokens;
        go.seed = seed;
        ferry_moe_trace *t;
        int rc = ferry_moe_trace_generate(&go, &t);
        if (rc < 0)
            die("generate", rc);
        const ferry_moe_model *mm = ferry_moe_trace_model(t);
        uint64_t all_ids = (uint64_t)mm->num_layers * mm->num_experts;
        char buf[256];
        snprintf(buf, sizeof buf, "%s", budgets);
        for (char *save = NULL, *b = strtok_r(buf, ",", &save); b; b = strtok_r(NULL, ",", &save)) {
            char *end;
            double x = strtod(b, &end);
            int pct = *end == '%';
            if (end == b || (*end && !(pct && !end[1])) || !(x > 0) || (pct && x > 100)) {
                fprintf(stderr, "moe_ceiling: --budgets: '%s' is not a slot count or a "
                                "percentage in (0, 100]\n", b);
                return 2;
            }
            uint32_t slots = pct ? (uint32_t)(x / 100.0 * (double)all_ids) : (uint32_t)x;
            if (slots < mm->num_experts)
                slots = mm->num_experts; /* as the planner: a prefill layer fits */
            ferry_moe_replay_result r_lru, r_rt, r_bel;
            if ((rc = ferry_moe_replay(t, "lru", slots, 0, &r_lru)) < 0 ||
                (rc = ferry_moe_replay(t, "routing", slots, 0, &r_rt)) < 0 ||
                (rc = ferry_moe_replay(t, "belady", slots, 0, &r_bel)) < 0)
                die("replay", rc);
            double h[NKEYS];
            for (int k = 0; k < NKEYS; k++)
                h[k] = run(&go, slots, k);
            if (fabs(h[K_LRU] - r_lru.hit_rate) > 1e-12) {
                fprintf(stderr,
                        "moe_ceiling: %s at %u slots: the loop's LRU %.6f is not the planner's "
                        "%.6f: the loop does not follow ensure()\n",
                        models[mi], slots, h[K_LRU], r_lru.hit_rate);
                return 1;
            }
            double best = h[K_WAIT] > h[K_P] ? h[K_WAIT] : h[K_P];
            if (best < r_rt.hit_rate)
                best = r_rt.hit_rate;
            if (json) {
                printf("%s{\"model\":\"%s\",\"slots\":%u,\"budget\":\"%s\",\"lru\":%.6f,"
                       "\"routing\":%.6f,\"oracle_wait\":%.6f,\"oracle_p\":%.6f,\"belady\":%.6f}",
                       first ? "" : ",", models[mi], slots, b, r_lru.hit_rate, r_rt.hit_rate,
                       h[K_WAIT], h[K_P], r_bel.hit_rate);
                first = 0;
            } else
                printf("%-14s %6u %7.2f %7.2f %12.2f %9.2f %7.2f  %+.2f (%s)\n", models[mi], slots,
                       100 * r_lru.hit_rate, 100 * r_rt.hit_rate, 100 * h[K_WAIT], 100 * h[K_P],
                       100 * r_bel.hit_rate, 100 * (best - r_lru.hit_rate), b);
            fflush(stdout);
        }
        ferry_moe_trace_destroy(t);
    }
    if (json)
        printf("]\n");
    return 0;
}
