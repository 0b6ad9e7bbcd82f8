/*
 * cmd_kv.c - `ferry kv bench`: the KV store under the workloads LMCache
 * measures, over a real model's KV shape, with reference figures measured
 * in the same run (memcpy, hashing, a 32k-token lookup, the drive as
 * `ferry bench io` reads it, the Redis/Valkey server as its own client
 * reads it). The command: its options, their checks and the order of the
 * work; the parts are in kv_bench_*.c (kv_bench.h lists them).
 *
 * --remote URL adds the Redis/Valkey tier (keys under a prefix unique to
 * the run, with a 1-hour TTL): the run's stores write through to it and
 * chunks evicted locally are found there again.
 */
#include <stddef.h>
#include <stdio.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "remote/remote_int.h"
#include "kv_bench.h"

static void usage(FILE *f)
{
    fprintf(f,
            "usage: ferry kv bench [options]\n"
            "  --workload qa|chat       long-document QA (default) or multi-turn chat\n"
            "  --docs D --doc-tokens T --questions Q --zipf S --question-tokens q\n"
            "                           qa: D documents of T tokens asked Q times (8, 4096, 64, 1.0, 64)\n"
            "  --sessions S --turns N --turn-tokens t\n"
            "                           chat: S sessions of N turns adding t tokens each (8, 6, 512)\n"
            "  --model llama3-8b|qwen2.5-0.5b|tiny   KV shape (default llama3-8b: 32 MiB/256 tokens)\n"
            "  --layers L --heads H --head-dim D     override the shape\n"
            "  --chunk-tokens N         tokens per chunk (256)\n"
            "  --l1 SIZE                host tier (default 2G)\n"
            "  --dir DIR --l2 SIZE      NVMe slab tier in DIR, an existing directory (--create\n"
            "                           makes it); default size 8G\n"
            "  --engine auto|posix|uring  the slab's I/O engine\n"
            "  --persistent             the L2 slab survives restarts (ferry/pslab.h); also\n"
            "                           measures what that costs: the store workload against\n"
            "                           a non-persistent and a persistent L2 (and the drive's own\n"
            "                           durable writes) in alternating rounds\n"
            "  --persist-rounds N       with --persistent: rounds of each for that figure\n"
            "                           (default 5, 0: skip)\n"
            "  --cold N                 only the L2-only retrieve (qa): the documents in a\n"
            "                           persistent L2 under DIR (stored once, synced), then N\n"
            "                           rounds that each reopen the store and retrieve every\n"
            "                           document from the drive into plain host memory (needs\n"
            "                           --dir; with --server, the daemon's L2 and a new client\n"
            "                           each round)\n"
            "  --inflight N             with --cold: N documents retrieved at once (asynchronous\n"
            "                           retrieves, each into its own buffer; default 1: one after\n"
            "                           another)\n"
            "  --aligned                with --cold: the engine buffer page-aligned (as pinned\n"
            "                           host memory is), so chunks are read straight into it\n"
            "                           (default: malloc's, read through L1 and copied out)\n"
            "  --aligned-huge           --aligned, and the buffer advised huge pages\n"
            "                           (MADV_HUGEPAGE)\n"
            "  --layerwise N            only the layer-by-layer figures: the first prompt stored\n"
            "                           once, then N rounds of the plain retrieve, the layerwise\n"
            "                           one (time to its first layer and to its last) and memcpy\n"
            "                           of the same bytes, then N rounds of the plain and the\n"
            "                           layerwise store (with --server: through the daemon)\n"
            "  --policy lru|s3fifo      eviction (default lru)\n"
            "  --device host|cuda       the engine buffer in that device's memory (the store's\n"
            "                           device; host: the host backend standing in for a GPU);\n"
            "                           default: plain host memory, no device\n"
            "  --paged N                the engine buffer paged as vLLM's: blocks of N tokens\n"
            "                           through a block table (default: one contiguous tensor)\n"
            "  --remote URL             Redis/Valkey tier (redis://host:port/db, unix:///path)\n"
            "  --server URL             run against a `ferry serve` daemon (unix:/path; started\n"
            "                           with the same --model and --chunk-tokens): the workload\n"
            "                           through its shared pool, then the lookup latency of a\n"
            "                           32k-token prompt from --clients N processes at once (8);\n"
            "                           no TCP: the daemon listens on a Unix-domain socket\n"
            "  --server-timeout MS      how long one round trip to the daemon may take before\n"
            "                           the run fails (default %u, the library's; a flush or\n"
            "                           sync that waits for the daemon's L2 drive is one)\n"
            "  --seed N  --no-refs  --json  --plot FILE.png\n"
            "ranges: --docs 1..65536, --doc-tokens 1..1048576, --questions 1..1000000,\n"
            "  --question-tokens 0..65536, --sessions 1..65536, --turns 1..4096, --turn-tokens\n"
            "  1..1048576, --chunk-tokens 1..65536, --layers 1..1024, --heads 1..1024,\n"
            "  --head-dim 1..4096, --paged 1..65536, --persist-rounds 0..%d, --cold 1..%d,\n"
            "  --layerwise 1..%d, --server-timeout 1..%u, --inflight 1..%d,\n"
            "  --zipf 0..10, --l1/--l2 4K..16T;\n"
            "  all prompts at most 2^28 tokens, the longest prompt's KV at most 8 GiB\n",
            KVB_SERVER_TIMEOUT_DEFAULT_MS, PC_MAX_ROUNDS, COLD_MAX_ROUNDS,
            LAYERWISE_MAX_ROUNDS, KVB_SERVER_TIMEOUT_MAX_MS, COLD_MAX_INFLIGHT);
}

/* a count option: flag, its field, its range, the workload it shapes
 * ('q' qa, 'c' chat, 0 both) */
typedef struct num_opt {
    const char *flag;
    size_t off;
    unsigned min, max;
    char workload;
} num_opt;

static const num_opt num_opts[] = {
    {"--docs", offsetof(opts, docs), 1, 65536, 'q'},
    {"--doc-tokens", offsetof(opts, doc_tokens), 1, 1u << 20, 'q'},
    {"--questions", offsetof(opts, questions), 1, 1000000, 'q'},
    {"--question-tokens", offsetof(opts, qtokens), 0, 65536, 'q'},
    {"--sessions", offsetof(opts, sessions), 1, 65536, 'c'},
    {"--turns", offsetof(opts, turns), 1, 4096, 'c'},
    {"--turn-tokens", offsetof(opts, turn_tokens), 1, 1u << 20, 'c'},
    {"--chunk-tokens", offsetof(opts, chunk_tokens), 1, 65536, 0},
    {"--layers", offsetof(opts, layers), 1, 1024, 0},
    {"--heads", offsetof(opts, heads), 1, 1024, 0},
    {"--head-dim", offsetof(opts, head_dim), 1, 4096, 0},
    {"--persist-rounds", offsetof(opts, persist_rounds), 0, PC_MAX_ROUNDS, 0},
    {"--cold", offsetof(opts, cold_rounds), 1, COLD_MAX_ROUNDS, 'q'}, /* (the documents) */
    {"--inflight", offsetof(opts, cold_inflight), 1, COLD_MAX_INFLIGHT, 0},
    {"--paged", offsetof(opts, paged), 1, 65536, 0},
    {"--layerwise", offsetof(opts, layerwise_rounds), 1, LAYERWISE_MAX_ROUNDS, 0},
};

/* options that belong to one workload or need another option */
typedef struct given {
    const char *qa, *chat; /* the first option given of each workload */
    const char *clients;   /* --clients N */
    const char *rounds;    /* --persist-rounds N */
} given;

static int parse_check(opts *o, int l2_given, int engine_given, int create, const given *g);

/* 0 to run, 2 on a usage error (printed), -1 after --help */
static int parse(int argc, char **argv, opts *o)
{
    static const char *const workloads[] = {"qa", "chat", NULL};
    static const char *const models[] = {"llama3-8b", "qwen2.5-0.5b", "tiny", NULL};
    static const char *const policies[] = {"lru", "s3fifo", NULL};
    static const char *const engines[] = {"auto", "posix", "uring", NULL};
    static const char *const devices[] = {"host", "cuda", NULL};
    int create = 0, l2_given = 0, engine_given = 0;
    given g = {NULL, NULL, NULL, NULL};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        uint64_t x = 0;
        int k = 0, rc = 0, done = 0;
        for (size_t n = 0; n < sizeof num_opts / sizeof num_opts[0]; n++)
            if (!strcmp(a, num_opts[n].flag)) {
                rc = cli_opt_count(KVB_CMD, a, v, num_opts[n].min, num_opts[n].max, &x);
                if (rc)
                    return rc;
                *(unsigned *)(void *)((char *)o + num_opts[n].off) = (unsigned)x;
                if (num_opts[n].workload == 'q' && !g.qa)
                    g.qa = a;
                else if (num_opts[n].workload == 'c' && !g.chat)
                    g.chat = a;
                if (!strcmp(a, "--persist-rounds"))
                    g.rounds = a;
                i++;
                done = 1;
                break;
            }
        if (done)
            continue;
        if (!strcmp(a, "--l1") || !strcmp(a, "--l2")) {
            rc = cli_opt_size(KVB_CMD, a, v, 4096, 16ull << 40, 0, a[3] == '1' ? &o->l1 : &o->l2);
            l2_given |= a[3] == '2';
            i++;
        } else if (!strcmp(a, "--zipf")) {
            rc = cli_opt_real(KVB_CMD, a, v, 0, 10, &o->zipf);
            if (!g.qa)
                g.qa = a;
            i++;
        } else if (!strcmp(a, "--seed")) {
            rc = cli_opt_u64(KVB_CMD, a, v, &o->seed);
            i++;
        } else if (!strcmp(a, "--workload")) {
            if ((rc = cli_opt_choice(KVB_CMD, a, v, workloads, &k)) == 0)
                o->workload = workloads[k];
            i++;
        } else if (!strcmp(a, "--model")) {
            if ((rc = cli_opt_choice(KVB_CMD, a, v, models, &k)) == 0)
                o->model = models[k];
            i++;
        } else if (!strcmp(a, "--policy")) {
            if ((rc = cli_opt_choice(KVB_CMD, a, v, policies, &k)) == 0)
                o->policy = policies[k];
            i++;
        } else if (!strcmp(a, "--engine")) {
            if ((rc = cli_opt_choice(KVB_CMD, a, v, engines, &k)) == 0)
                o->engine = engines[k];
            engine_given = 1;
            i++;
        } else if (!strcmp(a, "--device")) {
            if ((rc = cli_opt_choice(KVB_CMD, a, v, devices, &k)) == 0)
                o->device = devices[k];
            i++;
        } else if (!strcmp(a, "--dir")) {
            rc = cli_opt_string(KVB_CMD, a, v, "a directory", &o->dir);
            i++;
        } else if (!strcmp(a, "--plot")) {
            rc = cli_opt_outfile(KVB_CMD, a, v, "a PNG file to write", &o->plot);
            i++;
        } else if (!strcmp(a, "--create")) {
            create = 1;
        } else if (!strcmp(a, "--aligned") || !strcmp(a, "--aligned-huge")) {
            o->cold_aligned = a[9] ? 2 : 1;
        } else if (!strcmp(a, "--json")) {
            o->json = 1;
        } else if (!strcmp(a, "--no-refs")) {
            o->refs = 0;
        } else if (!strcmp(a, "--persistent")) {
            o->persistent = 1;
        } else if (!strcmp(a, "--remote")) {
            const char *acc = "redis://[user:password@]host:port/db or unix:///path";
            rc = cli_opt_string(KVB_CMD, a, v, acc, &o->remote);
            /* the URL itself is not echoed: it may hold a password */
            if (rc == 0 && ferry_remote_url_validate(o->remote) < 0)
                rc = cli_bad(KVB_CMD, a, NULL, acc, "%s", ferry_last_error());
            i++;
        } else if (!strcmp(a, "--server")) {
            const char *path = NULL, *why = NULL;
            rc = cli_opt_string(KVB_CMD, a, v, CLI_SOCKET_FORMS, &o->server);
            if (rc == 0 && (why = cli_parse_socket(o->server, &path)) != NULL)
                rc = cli_bad(KVB_CMD, a, v, CLI_SOCKET_FORMS, "%s", why);
            i++;
        } else if (!strcmp(a, "--server-timeout")) {
            rc = cli_opt_count(KVB_CMD, a, v, 1, KVB_SERVER_TIMEOUT_MAX_MS, &x);
            o->server_timeout_ms = (uint32_t)x;
            i++;
        } else if (!strcmp(a, "--clients")) {
            rc = cli_opt_count(KVB_CMD, a, v, 1, 64, &x);
            o->clients = (unsigned)x;
            g.clients = a;
            i++;
        } else if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return -1;
        } else {
            return cli_unknown(KVB_CMD, a);
        }
        if (rc)
            return rc;
    }
    return parse_check(o, l2_given, engine_given, create, &g);
}

/* what no single option shows: flags that need another, the workload's size */
static int parse_check(opts *o, int l2_given, int engine_given, int create, const given *g)
{
    char sz[32];
    /* an option of the other workload would be ignored: refused instead */
    int qa = !strcmp(o->workload, "qa");
    if (qa && g->chat)
        return cli_usage(KVB_CMD, "%s: a chat workload's option, and the workload is qa; "
                                  "accepted: --workload chat %s ...", g->chat, g->chat);
    if (!qa && g->qa)
        return cli_usage(KVB_CMD, "%s: a qa workload's option, and the workload is chat; "
                                  "accepted: --workload qa %s ... (the default)", g->qa, g->qa);
    if (g->clients && !o->server)
        return cli_usage(KVB_CMD, "--clients %u: client processes of a daemon; accepted: "
                                  "--server ADDR --clients N", o->clients);
    if (g->rounds && !o->persistent)
        return cli_usage(KVB_CMD, "--persist-rounds %u: rounds of --persistent's cost figure; "
                                  "accepted: --dir DIR --persistent --persist-rounds N",
                         o->persist_rounds);
    if (o->cold_rounds && o->layerwise_rounds)
        return cli_usage(KVB_CMD, "--cold %u and --layerwise %u: each is a run of its own; "
                                  "accepted: one of them", o->cold_rounds, o->layerwise_rounds);
    if (!o->dir && l2_given)
        return cli_usage(KVB_CMD, "--l2 %s: the L2 tier needs --dir DIR; accepted: --dir DIR --l2 SIZE",
                         ferry__size_str(o->l2, sz, sizeof sz));
    if (!o->dir && o->persistent)
        return cli_usage(KVB_CMD, "--persistent: the L2 tier needs --dir DIR; accepted: --dir DIR "
                              "--persistent");
    if (!o->dir && !o->server && o->cold_rounds)
        return cli_usage(KVB_CMD, "--cold %u: the L2 tier needs --dir DIR; accepted: --dir DIR "
                              "--cold N, or --server URL --cold N", o->cold_rounds);
    if (o->cold_aligned && !o->cold_rounds)
        return cli_usage(KVB_CMD, "--aligned: the engine buffer of the --cold figure; accepted: "
                              "--cold N --aligned, --cold N --aligned-huge");
    if (o->cold_inflight && !o->cold_rounds)
        return cli_usage(KVB_CMD, "--inflight %u: documents at once in the --cold figure; "
                              "accepted: --cold N --inflight M", o->cold_inflight);
    if (!o->cold_inflight)
        o->cold_inflight = 1;
    if (!o->server && o->server_timeout_ms)
        return cli_usage(KVB_CMD, "--server-timeout %u: a server's round-trip limit needs "
                                  "--server; accepted: --server ADDR --server-timeout MS",
                         o->server_timeout_ms);
    if (o->server && (o->dir || o->remote || o->persistent || o->plot))
        return cli_usage(KVB_CMD, "--server %s: the daemon owns the tiers; accepted: --server "
                                  "without --dir, --remote, --persistent or --plot",
                         o->server);
    if (!o->dir && engine_given)
        return cli_usage(KVB_CMD, "--engine %s: the L2 tier needs --dir DIR; accepted: --dir DIR "
                              "--engine ENGINE", o->engine);
    /* the token ids of every prompt are held at once (4 bytes each) */
    uint64_t pool = !strcmp(o->workload, "qa")
                        ? (uint64_t)o->docs * o->doc_tokens +
                              (uint64_t)o->questions * (o->doc_tokens + o->qtokens)
                        : (uint64_t)o->sessions * o->turns * o->turn_tokens;
    if (pool > (1ull << 28))
        return cli_usage(KVB_CMD, "--%s: the workload's prompts hold %llu tokens; accepted: at most "
                              "268435456 (1G of token ids)",
                         !strcmp(o->workload, "qa") ? "questions x --doc-tokens"
                                                    : "sessions x --turns x --turn-tokens",
                         (unsigned long long)pool);
    if (o->dir)
        return cli_opt_dir(KVB_CMD, "--dir", o->dir, create);
    if (create)
        return cli_usage(KVB_CMD, "--create: it makes the --dir directory, and no --dir "
                                  "was given; accepted: --dir DIR --create");
    return 0;
}

/* the checks that need the layout: 0, or 2 (printed) */
static int check_sizes(const opts *o, const ferry_kv_layout *l, uint64_t *chunk)
{
    if (ferry_kv_layout_chunk_bytes(l, o->chunk_tokens, chunk) < 0)
        return cli_usage(KVB_CMD, "--chunk-tokens %u: %s; accepted: a chunk the layout can hold",
                         o->chunk_tokens, ferry_last_error());
    char c1[32], c2[32];
    if (o->l1 < *chunk)
        return cli_usage(KVB_CMD, "--l1 %s: less than one %s chunk of this layout; accepted: at "
                                  "least %s", ferry__size_str(o->l1, c1, sizeof c1),
                         ferry__size_str(*chunk, c2, sizeof c2), c2);
    if (o->dir && o->l2 < *chunk)
        return cli_usage(KVB_CMD, "--l2 %s: less than one %s chunk of this layout; accepted: at "
                                  "least %s", ferry__size_str(o->l2, c1, sizeof c1),
                         ferry__size_str(*chunk, c2, sizeof c2), c2);
    /* the engine buffer holds the longest prompt's KV */
    uint64_t longest = !strcmp(o->workload, "qa") ? (uint64_t)o->doc_tokens + o->qtokens
                                                  : (uint64_t)o->turns * o->turn_tokens;
    double buf_bytes = (double)*chunk / o->chunk_tokens * (double)longest;
    if (buf_bytes > (double)(8ull << 30))
        return cli_usage(KVB_CMD, "--%s %u: a prompt of %llu tokens needs %.1f GiB of KV in the "
                                  "engine buffer; accepted: at most 8 GiB",
                         !strcmp(o->workload, "qa") ? "doc-tokens" : "turn-tokens",
                         !strcmp(o->workload, "qa") ? o->doc_tokens : o->turn_tokens,
                         (unsigned long long)longest, buf_bytes / (1 << 30));
    return 0;
}

static void print_header(const opts *o, const ferry_kv_layout *l, uint64_t chunk)
{
    printf("ferry kv bench: %s", o->workload);
    if (!strcmp(o->workload, "qa"))
        printf(" (%u docs x %u tokens, %u questions of +%u tokens, zipf %.2f)", o->docs,
               o->doc_tokens, o->questions, o->qtokens, o->zipf);
    else
        printf(" (%u sessions x %u turns of %u tokens)", o->sessions, o->turns, o->turn_tokens);
    printf("\n  shape %s: %u layers x %u KV heads x %u dims, %s: %.2f MiB per %u-token chunk\n",
           o->model, l->num_layers, l->num_heads, l->head_dim, ferry_dtype_name(l->dtype),
           (double)chunk / (1 << 20), o->chunk_tokens);
    if (o->server)
        printf("  store: the daemon at %s (its tiers; %u client processes for the lookup "
               "figure)", o->server, o->clients);
    else
        printf("  tiers: L1 %.2f GiB (%s)", (double)o->l1 / (1 << 30), o->policy);
    if (o->dir)
        printf(", L2 %.2f GiB in %s%s", (double)o->l2 / (1 << 30), o->dir,
               o->persistent ? " (persistent)" : "");
    if (o->remote) {
        /* never the password: the URL as the remote module quotes it */
        static ferry__rurl u;
        if (ferry__rurl_parse(o->remote, strlen(o->remote), &u, NULL) == 0)
            printf(", remote %s", u.redacted);
    }
    printf("\n");
    if (o->dev || o->paged) {
        printf("  engine buffer: %s memory", kvb_buffer_mem(o));
        if (o->dev)
            printf(" (%s backend)", o->device);
        printf(", %s", kvb_buffer_form(o));
        if (o->paged)
            printf(" in blocks of %u tokens", o->paged);
        printf("\n");
    }
    fflush(stdout);
}

/* the workload on the run's store: 0, or 1 (printed) */
static int main_run(const opts *o, const ferry_kv_layout *l, const workload *w, run_result *rr,
                    double *wall)
{
    ferry_kv *kv;
    int rc = kvb_open_store(o, l, o->l1, o->l2, o->dir, &kv);
    if (rc < 0 && o->server) {
        char what[200];
        snprintf(what, sizeof what, "opening the store through %s (server timeout %u ms%s)",
                 o->server, kvb_server_timeout_ms(o),
                 o->server_timeout_ms ? ", --server-timeout"
                                      : ", the default; --server-timeout MS");
        return cli_fail(KVB_CMD, what, rc);
    }
    if (rc < 0)
        return cli_fail(KVB_CMD, "opening the store", rc);
    engine_buf buf;
    rc = kvb_buffer_alloc(o, l, w->max_tokens, &buf);
    if (rc < 0) {
        ferry_kv_close(kv);
        return cli_fail(KVB_CMD, "allocating the engine buffer", rc);
    }
    double t0 = kvb_now_s();
    rc = kvb_run_workload(kv, w, &buf.b, o->json, rr);
    *wall = kvb_now_s() - t0;
    ferry_kv_close(kv);
    kvb_buffer_free(&buf);
    return rc < 0 ? cli_fail(KVB_CMD, "running the workload", rc) : 0;
}

/* --cold: that figure alone, 0 or 1 (printed) */
static int cold_only(const opts *o, const ferry_kv_layout *l, uint64_t chunk, const workload *w)
{
    static cold_result c;
    int rc = kvb_cold_run(o, l, w, chunk, &c);
    if (o->json) {
        json_t *j = json_object();
        json_object_set_new(j, "cold_l2_retrieve", kvb_cold_json(o, &c));
        if (rc < 0)
            json_object_set_new(j, "error", json_string(ferry_last_error()));
        json_dumpf(j, stdout, JSON_INDENT(2));
        printf("\n");
        json_decref(j);
    } else {
        kvb_cold_print(o, &c);
    }
    return rc < 0 ? cli_fail(KVB_CMD, "--cold", rc) : 0;
}

/* the references, the persistence experiment and the sweep, the report */
static int measure_and_report(opts *o, const ferry_kv_layout *l, uint64_t chunk,
                              const workload *w, const run_result *rr, double wall)
{
    static refs rf;
    static persist_cost pcost;
    static srv_lookup sl;
    static srv_pool sp;
    const char *srv = o->server;
    report rp = {o, chunk, w->np, rr, wall, &rf, NULL, NULL, 0, 0, o->persistent, o->remote,
                 NULL, NULL};
    if (o->server) {
        kvb_server_lookup(o, l, &sl);
        rp.sl = &sl;
        kvb_server_pool(o, l, &sp);
        rp.sp = &sp;
    }
    o->remote = NULL; /* references and the sweep run on local tiers */
    o->server = NULL;
    if (o->refs) {
        o->persistent = 0; /* references start from empty tiers */
        kvb_refs_run(o, rp.remote, l, chunk, w, &rf);
    }
    if (rp.persistent && o->dir && o->persist_rounds > 0) {
        kvb_persist_cost_run(o, l, w, chunk, &pcost);
        rp.pc = &pcost;
    }
    point *pts = NULL;
    if (o->plot) {
        rp.plot_rc = kvb_sweep(o, w, &pts, &rp.npts);
        if (rp.plot_rc == 0)
            rp.plot_rc = kvb_plot(o, pts, rp.npts, chunk);
    }
    rp.pts = pts;
    if (o->json)
        kvb_report_json(&rp);
    else
        kvb_report_text(&rp);
    free(pts);
    if (rp.sp && sp.rc < 0) {
        fprintf(stderr, "ferry %s: the shared-pool figures through %s failed: %s%s\n", KVB_CMD,
                srv, ferry_strerror(sp.rc),
                sp.rc == -EIO ? " (a retrieved chunk differed from what was stored)" : "");
        return 1;
    }
    if (rp.pc && pcost.rc < 0) {
        fprintf(stderr, "ferry %s: the persistence-cost rounds failed: %s\n", KVB_CMD,
                ferry_strerror(pcost.rc));
        return 1;
    }
    if (o->plot && rp.plot_rc < 0) {
        fprintf(stderr, "ferry %s: the plot failed (%s); is gnuplot installed?\n", KVB_CMD,
                ferry_strerror(rp.plot_rc));
        return 1;
    }
    return 0;
}

int cmd_kv_bench(int argc, char **argv)
{
    opts o = {"qa", "llama3-8b", NULL, "lru", NULL, NULL, 2ull << 30, 8ull << 30, 8, 4096, 64, 64,
              8, 6, 512, 256, 0, 0, 0, 1.0, 1, 0, 1, 0, NULL, "", 5, NULL, 0, NULL, 0, 0, 0, NULL,
              8, 0, 0, 0};
    int rc = parse(argc, argv, &o);
    if (rc)
        return rc < 0 ? 0 : rc;
    snprintf(o.remote_prefix, sizeof o.remote_prefix, "ferry:kvbench:%ld:%llx:", (long)getpid(),
             (unsigned long long)time(NULL));
    ferry_kv_layout l;
    if (kvb_layout_for(&o, &l) < 0)
        return cli_usage(KVB_CMD, "--model %s: unknown; accepted: llama3-8b, qwen2.5-0.5b or tiny",
                         o.model);
    uint64_t chunk;
    if ((rc = check_sizes(&o, &l, &chunk)) != 0)
        return rc;
    if (o.device) {
        ferry_device_options d = FERRY_DEVICE_OPTIONS_INIT;
        d.backend = o.device;
        if ((rc = ferry_device_open(&d, &o.dev)) < 0)
            return cli_fail(KVB_CMD, o.device, rc);
    }
    workload w;
    rc = kvb_make_workload(&o, &w);
    if (rc < 0) {
        ferry_device_close(o.dev);
        return cli_fail(KVB_CMD, "building the workload", rc);
    }
    if (!o.json)
        print_header(&o, &l, chunk);
    run_result rr;
    double wall = 0;
    if (o.layerwise_rounds) {
        rc = kvb_layerwise_run(&o, &l, &w, chunk);
        kvb_workload_free(&w);
        ferry_device_close(o.dev);
        return rc;
    }
    if (o.cold_rounds) {
        o.persistent = 1; /* (the header says so) */
        rc = cold_only(&o, &l, chunk, &w);
        kvb_workload_free(&w);
        ferry_device_close(o.dev);
        return rc;
    }
    rc = main_run(&o, &l, &w, &rr, &wall);
    if (rc == 0)
        rc = measure_and_report(&o, &l, chunk, &w, &rr, wall);
    kvb_workload_free(&w);
    ferry_device_close(o.dev);
    return rc;
}
