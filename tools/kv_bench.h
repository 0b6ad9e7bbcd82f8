/*
 * kv_bench.h - the parts of `ferry kv bench`, one concern per file:
 *
 *   kv_bench_workload.c  the workload generator (QA and chat prompts) and
 *                        one run of it on a store; small shared helpers
 *   kv_bench_store.c     opening a store for a run and the engine's buffer
 *                        (host or device memory, contiguous or paged)
 *   kv_bench_refs.c      the reference figures measured in the same run
 *                        (memcpy, hashing, lookup, the drive, the server)
 *   kv_bench_sweep.c     the hit-rate sweep over tier sizes and its plot
 *   kv_bench_persist.c   --persistent: what persistence costs
 *   kv_bench_cold.c      --cold: the L2-only retrieve of a fresh client
 *   kv_bench_server.c    --server: lookup latency through a daemon, N clients at once
 *   kv_bench_pool.c      --server: store/retrieve through the shared pool against
 *                        memcpy, and N clients moving chunks at once (fairness)
 *   kv_bench_report.c    the report, as text or as one JSON object
 *   cmd_kv.c             the command: options, checks, the order of work
 *
 * Private to the CLI; the names are not the library's.
 */
#ifndef FERRY_KV_BENCH_H
#define FERRY_KV_BENCH_H

#include <stddef.h>
#include <stdint.h>

#include <jansson.h>

#include "cli.h"

#define KVB_CMD "kv bench"
#define PC_MAX_ROUNDS 64 /* --persist-rounds */
#define L2_ROUNDS 15     /* measured rounds of the L2 reference, after one warm-up */

typedef struct opts {
    const char *workload, *model, *dir, *policy, *engine, *plot;
    uint64_t l1, l2;
    unsigned docs, doc_tokens, questions, qtokens;
    unsigned sessions, turns, turn_tokens;
    unsigned chunk_tokens;
    unsigned layers, heads, head_dim;
    double zipf;
    uint64_t seed;
    int json, refs, persistent;
    const char *remote;      /* --remote URL */
    char remote_prefix[64];  /* this run's key prefix */
    unsigned persist_rounds; /* --persistent: rounds of each mode in the cost figure */
    const char *device;      /* --device host|cuda: NULL, the engine buffer is host memory */
    unsigned paged;          /* --paged N: the engine buffer is paged, N tokens a block; 0 not */
    ferry_device *dev;       /* opened from device for the run */
    uint64_t prefetch_max;   /* the store's prefetch bound; 0: its default */
    unsigned cold_rounds;    /* --cold N: only the L2-only retrieve figure, N rounds */
    unsigned cold_inflight;  /* --inflight N: documents a --cold round retrieves at once (1) */
    const char *server;      /* --server URL: the run's store is a `ferry serve` daemon's */
    unsigned clients;        /* --clients N: processes asking the daemon at once (8) */
    unsigned layerwise_rounds; /* --layerwise N: only the layer-by-layer retrieve figure */
    uint32_t server_timeout_ms; /* --server-timeout MS: one round trip's limit; 0: the
                                 * library's default (ferry_kv_config.server_timeout_ms) */
    int cold_aligned;        /* --aligned: a --cold round's engine buffer page-aligned (1),
                              * --aligned-huge: and advised huge pages (2) */
} opts;

/* ferry_kv_config.server_timeout_ms's default (kv.h: "0 -> 2000 ms"), for
 * messages only: the run passes 0 and the library applies its own */
#define KVB_SERVER_TIMEOUT_DEFAULT_MS 2000u
#define KVB_SERVER_TIMEOUT_MAX_MS 3600000u /* --server-timeout: an hour */

/* the round-trip limit the run's server clients get, in ms */
static inline unsigned kvb_server_timeout_ms(const opts *o)
{
    return o->server_timeout_ms ? o->server_timeout_ms : KVB_SERVER_TIMEOUT_DEFAULT_MS;
}

/* ---- the workload: a list of prompts (kv_bench_workload.c) ---- */
typedef struct prompt {
    const int32_t *tok;
    size_t n;
} prompt;

typedef struct workload {
    int32_t *pool; /* every prompt's tokens */
    prompt *p;
    size_t np;
    size_t max_tokens;
    uint64_t unique_chunks; /* chunks a cache of infinite size would hold */
} workload;

/* one run of the workload on one store */
typedef struct run_result {
    uint64_t prompt_tokens, hit_tokens, retrieved_tokens;
    double store_s, retrieve_s;
    uint64_t stored_bytes, retrieved_bytes;
    double lookup_p50_us, lookup_p99_us;
    ferry_kv_stats m;
} run_result;

double kvb_now_s(void);
double kvb_cpu_now_s(void);
uint64_t kvb_rng_next(uint64_t *s);
/* the q-quantile of v[0..n) (sorts v); 0 when n == 0 */
double kvb_pct(double *v, size_t n, double q);
/* a / b, 0 when b is not positive */
double kvb_ratio(double a, double b);
/* the model's KV shape with the overrides of o; -1 for an unknown model */
int kvb_layout_for(const opts *o, ferry_kv_layout *l);
int kvb_make_workload(const opts *o, workload *w);
void kvb_workload_free(workload *w);
/* every prompt: lookup, retrieve the cached prefix into buf, store it whole */
int kvb_run_workload(ferry_kv *kv, const workload *w, const ferry_kv_buffer *buf, int quiet,
                     run_result *r);

/* ---- the store and the engine's buffer (kv_bench_store.c) ---- */
ferry_remote_options kvb_remote_opts(const opts *o);
int kvb_open_store(const opts *o, const ferry_kv_layout *l, uint64_t l1, uint64_t l2,
                   const char *dir, ferry_kv **kv);

/* An engine buffer of cap tokens: host memory (2 MiB-aligned, advised for
 * huge pages when large) or, with o->dev, device memory of that device;
 * one tensor, or with o->paged blocks of that many tokens placed through a
 * block table that is not the identity. */
typedef struct engine_buf {
    ferry_kv_buffer b;
    ferry_device *dev; /* owner of devmem, NULL for host memory */
    void *host;        /* host memory, NULL on a device */
    ferry_devptr devmem;
    uint64_t *bases;   /* paged: kv * layers cache bases */
    int32_t *table;    /* paged: the block table */
} engine_buf;

/* with o NULL (stand-in layouts: the sweep, the lookup reference) always a
 * contiguous host buffer */
int kvb_buffer_alloc(const opts *o, const ferry_kv_layout *l, uint64_t cap, engine_buf *e);
void kvb_buffer_free(engine_buf *e);
/* "host" or "device" (o->device names its backend), "contiguous" or "paged" */
const char *kvb_buffer_mem(const opts *o);
const char *kvb_buffer_form(const opts *o);

/* ---- references (kv_bench_refs.c) ---- */
typedef struct refs {
    double memcpy_gbps, l1_store_gbps, l1_retrieve_gbps;
    double memcpy_gbps_cpu, l1_store_gbps_cpu, l1_retrieve_gbps_cpu;
    double hash_gbps, hash_gbps_cpu;
    double lookup32k_p50_us, lookup32k_p99_us, lookup32k_mean_us, lookup32k_cpu_us;
    /* L2: medians over alternating rounds (io read, retrieve, prefetch),
     * the ratios the medians of each round's own ratio */
    double io_read_gbps, l2_retrieve_gbps, l2_promote_gbps;
    double l2_retrieve_ratio, l2_promote_ratio, l2_retrieve_ratio_min, l2_retrieve_ratio_max;
    double l2_round[L2_ROUNDS][3]; /* GB/s: io read, retrieve, prefetch */
    unsigned l2_rounds;
    const char *io_engine;
    int have_l2;
    /* --remote */
    double remote_retrieve_gbps, remote_get_gbps, remote_hit_rate, remote_lookup_p50_us;
    uint64_t remote_retrieved_bytes;
    int have_remote;
} refs;

/* every reference o asks for (o->remote NULL, o->persistent 0: they start
 * from empty local tiers); url: the run's remote, or NULL */
void kvb_refs_run(const opts *o, const char *url, const ferry_kv_layout *l, uint64_t chunk,
                  const workload *w, refs *r);

/* ---- the hit-rate sweep and its plot (kv_bench_sweep.c) ---- */
typedef struct point {
    uint64_t l1_chunks, l2_chunks;
    double hit_rate;
} point;

int kvb_sweep(const opts *o, const workload *w, point **out, size_t *np);
int kvb_plot(const opts *o, const point *p, size_t np, uint64_t chunk);

/* ---- --persistent: what persistence costs (kv_bench_persist.c) ---- */
typedef struct pc_round {
    int persistent; /* 0: A, 1: B, 2: C (raw durable writes) */
    double gbps, store_s, drain_s, sync_s;
    uint64_t l2_bytes, l2_failures, stored_bytes;
} pc_round;

typedef struct persist_cost {
    unsigned n; /* rounds run (both modes) */
    pc_round r[3 * PC_MAX_ROUNDS];
    double median[3], ratio, raw_ratio, load[3];
    int rc;
} persist_cost;

void kvb_persist_cost_run(const opts *o, const ferry_kv_layout *l, const workload *w,
                          uint64_t chunk, persist_cost *pc);
json_t *kvb_persist_cost_json(const persist_cost *pc);
void kvb_persist_cost_print(const persist_cost *pc);

/* ---- --cold N: the L2-only retrieve of a fresh client (kv_bench_cold.c) ---- */
#define COLD_MAX_ROUNDS 64
#define COLD_MAX_INFLIGHT 64
typedef struct cold_round {
    double gbps, seconds, cpu_s;
    uint64_t bytes, l2_bytes, tokens; /* retrieved; read from L2 (more: some twice) */
    /* the store's own account (the daemon's with --server): CPU seconds
     * checking and copying out; a retrieve's mean time to its first bytes
     * and first whole chunk from L2 */
    double check_s, copy_s, first_bytes_ms, first_chunk_ms;
} cold_round;

typedef struct cold_result {
    char dir[4200];
    uint64_t l1_chunks;
    unsigned stored_docs; /* documents this run had to store (0: all were there) */
    unsigned n;           /* rounds run */
    cold_round r[COLD_MAX_ROUNDS];
    double median_gbps;
} cold_result;

int kvb_cold_run(const opts *o, const ferry_kv_layout *l, const workload *w, uint64_t chunk,
                 cold_result *c);
json_t *kvb_cold_json(const opts *o, const cold_result *c);
void kvb_cold_print(const opts *o, const cold_result *c);

/* ---- --layerwise N: time to the first layer (kv_bench_layers.c) ---- */
#define LAYERWISE_MAX_ROUNDS 1000
/* the figure, printed (o->json: as JSON); 0, or 1/2 after a printed failure */
int kvb_layerwise_run(const opts *o, const ferry_kv_layout *l, const workload *w, uint64_t chunk);

/* ---- --server URL: lookups through a daemon (kv_bench_server.c) ---- */
typedef struct srv_lookup {
    unsigned clients;
    size_t tokens;                 /* the prompt looked up */
    double one_p50_us, one_p99_us; /* one client alone */
    double p50_us, p99_us, mean_us; /* every call of `clients` processes asking at once */
    int rc;
} srv_lookup;

/* store the prompt through o->server, then time lookups of it from one
 * client process and from o->clients at once */
int kvb_server_lookup(const opts *o, const ferry_kv_layout *l, srv_lookup *s);
void kvb_server_lookup_print(const srv_lookup *s, const refs *rf);
json_t *kvb_server_lookup_json(const srv_lookup *s);

/* N client processes (fork) started together: fn(arg, go, out) waits for
 * one byte on go, then works and fills its `each` bytes of results; they
 * land in out[i * each] for client i. 0, or the first failure (a client
 * that exited non-zero: FERRY_ECONN) */
#define KVB_CLIENTS_MAX 64u
typedef int (*kvb_child_fn)(const void *arg, int go, void *out);
int kvb_fork_clients(unsigned clients, kvb_child_fn fn, const void *arg, void *out, size_t each);

/* ---- --server: the shared pool (kv_bench_pool.c) ---- */
typedef struct srv_pool {
    size_t chunks;            /* per store/retrieve call of the copy figure */
    uint64_t bytes;           /* their bytes */
    unsigned rounds;          /* measured, alternating with memcpy */
    double memcpy_gbps, store_gbps, retrieve_gbps; /* medians */
    double store_ratio, retrieve_ratio;            /* medians of the rounds' ratios */
    double store_ratio_min, retrieve_ratio_min;
    double first_store_gbps;  /* the client's very first store (round 0: the pool's pages
                                 mapped populated, nothing faulted in by an earlier round) */
    /* fairness: clients processes storing and retrieving at once */
    unsigned clients;
    size_t fair_chunks;       /* per call, each client */
    double one_gbps;          /* one client alone, the same loop */
    double agg_gbps;          /* all clients at once */
    double min_share, max_share; /* of the aggregate bytes, per client */
    int rc;
} srv_pool;

int kvb_server_pool(const opts *o, const ferry_kv_layout *l, srv_pool *s);
void kvb_server_pool_print(const srv_pool *s);
json_t *kvb_server_pool_json(const srv_pool *s);

/* ---- the report (kv_bench_report.c) ---- */
typedef struct report {
    const opts *o;
    uint64_t chunk;
    size_t prompts;
    const run_result *rr;
    double wall;
    const refs *rf;         /* when o->refs */
    const persist_cost *pc; /* NULL: not measured */
    const point *pts;       /* with o->plot */
    size_t npts;
    int plot_rc;
    int persistent;     /* the run's L2 was persistent */
    const char *remote; /* the run's remote URL, NULL without */
    const srv_lookup *sl; /* --server: the lookup figure, NULL without */
    const srv_pool *sp;   /* --server: the pool figures, NULL without */
} report;

void kvb_report_json(const report *r);
void kvb_report_text(const report *r);

#endif
