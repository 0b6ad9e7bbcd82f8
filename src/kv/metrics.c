/*
 * metrics.c - the store's counters as a struct and as Prometheus text.
 *
 * Counters are relaxed atomics bumped outside the store's mutex; a snapshot
 * reads them one by one, so it is consistent per counter, not across them
 * (the tiers' used/capacity figures are read under the mutex and agree with
 * each other). Latency histograms have power-of-two buckets in nanoseconds:
 * cheap to record (one count-leading-zeros), and p50/p99 are read within a
 * factor of two, interpolated inside the bucket.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stddef.h>
#include <string.h>

#include "kv/backend.h"
#include "kv/kv_impl.h"
#include "kv/store/store_int.h"
#include "sized.h"

void ferry__kv_hist_record(ferry__kv_hist *h, uint64_t ns)
{
    int b = ns ? 63 - __builtin_clzll(ns) : 0;
    if (b >= FERRY_KV_HIST_BUCKETS)
        b = FERRY_KV_HIST_BUCKETS - 1;
    atomic_fetch_add_explicit(&h->b[b], 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&h->sum_ns, ns, memory_order_relaxed);
}

double ferry_kv_hist_quantile(const uint64_t hist[FERRY_KV_HIST_BUCKETS], double q)
{
    uint64_t total = 0;
    for (int b = 0; b < FERRY_KV_HIST_BUCKETS; b++)
        total += hist[b];
    if (!total)
        return 0;
    if (q < 0)
        q = 0;
    if (q > 1)
        q = 1;
    double want = q * (double)total, seen = 0;
    for (int b = 0; b < FERRY_KV_HIST_BUCKETS; b++) {
        if (!hist[b])
            continue;
        if (seen + (double)hist[b] >= want) {
            double lo = b ? (double)(1ull << b) : 0, hi = (double)(1ull << b) * 2;
            double frac = ((want - seen) / (double)hist[b]);
            return lo + frac * (hi - lo);
        }
        seen += (double)hist[b];
    }
    return (double)(1ull << (FERRY_KV_HIST_BUCKETS - 1)) * 2;
}

static void hist_copy(uint64_t *out, const ferry__kv_hist *h)
{
    for (int b = 0; b < FERRY_KV_HIST_BUCKETS; b++)
        out[b] = atomic_load_explicit(&h->b[b], memory_order_relaxed);
}

#define LD(x) atomic_load_explicit(&(x), memory_order_relaxed)

/* the whole snapshot, this header's struct (a server's client: the
 * daemon's); 0 or the client's failure */
static int snapshot(ferry_kv *kv, ferry_kv_stats *out)
{
    return kv->be->stats(kv, out);
}

int ferry__kv_local_stats(ferry_kv *kv, ferry_kv_stats *out)
{
    ferry_kv_stats m = FERRY_KV_STATS_INIT;
    m.lookups = LD(kv->lookups);
    m.lookup_tokens = LD(kv->lookup_tokens);
    m.hit_tokens = LD(kv->hit_tokens);
    m.stores = LD(kv->stores);
    m.stored_chunks = LD(kv->stored_chunks);
    m.stored_bytes = LD(kv->stored_bytes);
    m.retrieves = LD(kv->retrieves);
    m.retrieved_chunks = LD(kv->retrieved_chunks);
    m.retrieved_bytes = LD(kv->retrieved_bytes);
    m.misses = LD(kv->misses);
    m.prefetched_chunks = LD(kv->prefetched);
    m.deleted_chunks = LD(kv->deleted);
    m.failures = LD(kv->failures);
    m.alloc_failures = LD(kv->alloc_failures);
    m.lock_expired = LD(kv->lock_expired);
    m.corrupt_chunks = LD(kv->corrupt);
    m.device_chunks = LD(kv->device_chunks);
    m.device_copy_calls = LD(kv->device_calls);
    m.pool_waits = LD(kv->pool_waits);
    m.pool_wait_us = LD(kv->pool_wait_ns_total) / 1000u;
    m.pool_declines = LD(kv->pool_declines);
    pthread_mutex_lock(&kv->mu);
    m.chunks = kv->count;
    for (int t = 1; t < FERRY_KV_TIERS; t++) {
        ferry__kv_tier *tr = kv->tier[t];
        if (!tr)
            continue;
        ferry_kv_tier_stats *ts = &m.tier[t];
        ts->chunks = tr->used;
        ts->used_bytes = tr->used * kv->chunk_bytes;
        /* the remote tier's capacity is the server's, unknown here; its
         * chunks are the remote-resident ones the index remembers */
        ts->capacity_bytes = t == FERRY_KV_TIER_REMOTE ? 0 : tr->capacity * kv->chunk_bytes;
        ts->usage = tr->capacity ? (double)tr->used / (double)tr->capacity : 0;
    }
    pthread_mutex_unlock(&kv->mu);
    for (int t = 1; t < FERRY_KV_TIERS; t++) {
        ferry__kv_tier *tr = kv->tier[t];
        if (!tr)
            continue;
        ferry_kv_tier_stats *ts = &m.tier[t];
        ts->hits = LD(tr->hits);
        ts->evictions = LD(tr->evictions);
        ts->bytes_written = LD(tr->bytes_written);
        ts->bytes_read = LD(tr->bytes_read);
        ts->failures = LD(tr->failures);
    }
    for (int t = 0; t < FERRY_KV_TIERS; t++)
        if (kv->tier[t] && kv->tier[t]->ops->counts)
            kv->tier[t]->ops->counts(kv->tier[t], &m);
    hist_copy(m.lookup_ns, &kv->h_lookup);
    hist_copy(m.store_ns, &kv->h_store);
    hist_copy(m.retrieve_ns, &kv->h_retrieve);
    hist_copy(m.retrieve_first_bytes_ns, &kv->h_first_bytes);
    hist_copy(m.retrieve_first_chunk_ns, &kv->h_first_chunk);
    m.retrieve_first_bytes_sum_ns = LD(kv->h_first_bytes.sum_ns);
    m.retrieve_first_chunk_sum_ns = LD(kv->h_first_chunk.sum_ns);
    m.lookup_sum_ns = LD(kv->h_lookup.sum_ns);
    m.store_sum_ns = LD(kv->h_store.sum_ns);
    m.retrieve_sum_ns = LD(kv->h_retrieve.sum_ns);
    m.retrieve_check_us = LD(kv->rt_check_ns) / 1000u;
    m.retrieve_copy_us = LD(kv->rt_copy_ns) / 1000u;
    memcpy(out, &m, sizeof m);
    return 0;
}

int ferry_kv_stats_get(const ferry_kv *kv, ferry_kv_stats *out)
{
    if (!kv || !out)
        return ferry__err_set(NULL, -EINVAL, "ferry_kv_stats_get: store or out is NULL");
    ferry_kv_stats m = FERRY_KV_STATS_INIT;
    /* the store's mutex and atomics are taken, never written through */
    ferry_kv *k = (ferry_kv *)kv;
    int rc = ferry__kv_enter(k, "stats_get");
    if (rc < 0)
        return rc;
    rc = snapshot(k, &m);
    ferry__kv_leave(k);
    if (rc < 0)
        return rc;
    return ferry__stats_put(NULL, "ferry_kv_stats_get", out, &m, sizeof m);
}

/* an snprintf-style appender that keeps counting past the end */
typedef struct sb {
    char *buf;
    size_t len, pos;
} sb;

FERRY__PRINTF(2, 3)
static void put(sb *b, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    size_t room = b->pos < b->len ? b->len - b->pos : 0;
    int n = vsnprintf(room ? b->buf + b->pos : NULL, room, fmt, ap);
    va_end(ap);
    if (n > 0)
        b->pos += (size_t)n;
}

static void counter(sb *b, const char *name, const char *help, uint64_t v)
{
    put(b, "# HELP ferry_kv_%s %s\n# TYPE ferry_kv_%s counter\nferry_kv_%s %llu\n", name, help,
        name, name, (unsigned long long)v);
}

static const char *const tier_names[FERRY_KV_TIERS] = {"none", "l1", "l2", "remote"};

static void tier_family(sb *b, const ferry_kv *kv, const ferry_kv_stats *m, const char *name,
                        const char *type, const char *help, size_t off, int is_double)
{
    put(b, "# HELP ferry_kv_tier_%s %s\n# TYPE ferry_kv_tier_%s %s\n", name, help, name, type);
    for (int t = 1; t < FERRY_KV_TIERS; t++) {
        if (!kv->tier[t])
            continue;
        const char *p = (const char *)&m->tier[t] + off;
        if (is_double) {
            double v;
            memcpy(&v, p, sizeof v);
            put(b, "ferry_kv_tier_%s{tier=\"%s\"} %.6f\n", name, tier_names[t], v);
        } else {
            uint64_t v;
            memcpy(&v, p, sizeof v);
            put(b, "ferry_kv_tier_%s{tier=\"%s\"} %llu\n", name, tier_names[t],
                (unsigned long long)v);
        }
    }
}

/* buckets h and sum_ns from one snapshot (a client's: the daemon's, or
 * its own calls', as its stats say) */
static void histogram(sb *b, const char *name, const char *help, const uint64_t *h,
                      uint64_t sum_ns)
{
    put(b, "# HELP ferry_kv_%s_seconds %s\n# TYPE ferry_kv_%s_seconds histogram\n", name, help,
        name);
    uint64_t cum = 0;
    for (int i = 0; i < FERRY_KV_HIST_BUCKETS; i++) {
        cum += h[i];
        put(b, "ferry_kv_%s_seconds_bucket{le=\"%.9g\"} %llu\n", name,
            (double)(1ull << i) * 2 / 1e9, (unsigned long long)cum);
    }
    put(b, "ferry_kv_%s_seconds_bucket{le=\"+Inf\"} %llu\n", name, (unsigned long long)cum);
    put(b, "ferry_kv_%s_seconds_sum %.9f\n", name, (double)sum_ns / 1e9);
    put(b, "ferry_kv_%s_seconds_count %llu\n", name, (unsigned long long)cum);
}

static int metrics_prometheus_call(ferry_kv *kv, char *buf, size_t len)
{
    if (!kv || (!buf && len))
        return ferry__err_set(NULL, -EINVAL, "kv metrics: store or buffer is NULL");
    ferry_kv_stats m = FERRY_KV_STATS_INIT;
    int rc = snapshot(kv, &m);
    if (rc < 0)
        return rc;
    sb b = {buf, len, 0};
    if (len)
        buf[0] = 0;
    counter(&b, "lookups_total", "Lookup calls.", m.lookups);
    counter(&b, "lookup_tokens_total", "Tokens asked about by lookups.", m.lookup_tokens);
    counter(&b, "hit_tokens_total", "Leading tokens lookups found cached.", m.hit_tokens);
    counter(&b, "stores_total", "Store calls.", m.stores);
    counter(&b, "stored_chunks_total", "Chunks written by stores.", m.stored_chunks);
    counter(&b, "stored_bytes_total", "Bytes written by stores.", m.stored_bytes);
    counter(&b, "retrieves_total", "Retrieve calls.", m.retrieves);
    counter(&b, "retrieved_chunks_total", "Chunks loaded by retrieves.", m.retrieved_chunks);
    counter(&b, "retrieved_bytes_total", "Bytes loaded by retrieves.", m.retrieved_bytes);
    counter(&b, "misses_total", "Chunks asked of retrieve and not found.", m.misses);
    counter(&b, "prefetched_chunks_total", "Chunks brought into L1 by prefetch.",
            m.prefetched_chunks);
    counter(&b, "deleted_chunks_total", "Chunks deleted.", m.deleted_chunks);
    counter(&b, "failures_total", "Failed calls or chunks.", m.failures);
    counter(&b, "alloc_failures_total", "Stores declined for lack of memory.", m.alloc_failures);
    counter(&b, "lock_expired_total", "Locks ignored after their TTL.", m.lock_expired);
    counter(&b, "corrupt_chunks_total",
            "Chunks read from below L1 that failed their key or checksum check (misses).",
            m.corrupt_chunks);
    counter(&b, "device_chunks_total", "Chunks moved between device buffers and L1.",
            m.device_chunks);
    counter(&b, "device_copy_calls_total",
            "Device driver calls that moved them (a batched copy is one).", m.device_copy_calls);
    counter(&b, "pool_waits_total",
            "Times a store or retrieve found every L1 slot locked and waited for one.",
            m.pool_waits);
    put(&b, "# HELP ferry_kv_pool_wait_seconds_total Time spent in those waits.\n"
            "# TYPE ferry_kv_pool_wait_seconds_total counter\n"
            "ferry_kv_pool_wait_seconds_total %.6f\n",
        (double)m.pool_wait_us / 1e6);
    counter(&b, "pool_declines_total",
            "Chunks declined FERRY_ENOSPACE: no L1 slot within the deadline.", m.pool_declines);
    put(&b, "# HELP ferry_kv_chunks Chunks in the index.\n# TYPE ferry_kv_chunks gauge\n"
            "ferry_kv_chunks %llu\n",
        (unsigned long long)m.chunks);
    tier_family(&b, kv, &m, "hits_total", "counter", "Chunks found in this tier.",
                offsetof(ferry_kv_tier_stats, hits), 0);
    tier_family(&b, kv, &m, "evictions_total", "counter", "Chunks evicted from this tier.",
                offsetof(ferry_kv_tier_stats, evictions), 0);
    tier_family(&b, kv, &m, "written_bytes_total", "counter", "Bytes written into this tier.",
                offsetof(ferry_kv_tier_stats, bytes_written), 0);
    tier_family(&b, kv, &m, "read_bytes_total", "counter", "Bytes read out of this tier.",
                offsetof(ferry_kv_tier_stats, bytes_read), 0);
    tier_family(&b, kv, &m, "failures_total", "counter", "Allocation or I/O failures.",
                offsetof(ferry_kv_tier_stats, failures), 0);
    tier_family(&b, kv, &m, "used_bytes", "gauge", "Bytes of chunks held.",
                offsetof(ferry_kv_tier_stats, used_bytes), 0);
    tier_family(&b, kv, &m, "capacity_bytes", "gauge", "Bytes of chunks the tier can hold.",
                offsetof(ferry_kv_tier_stats, capacity_bytes), 0);
    tier_family(&b, kv, &m, "chunks", "gauge", "Chunks held.",
                offsetof(ferry_kv_tier_stats, chunks), 0);
    tier_family(&b, kv, &m, "usage_ratio", "gauge", "Used over capacity.",
                offsetof(ferry_kv_tier_stats, usage), 1);
    if (kv->tier[FERRY_KV_TIER_REMOTE]) {
        counter(&b, "remote_lookups_total", "Round trips asking the remote which chunks it has.",
                m.remote_lookups);
        counter(&b, "remote_lookup_chunks_total", "Chunks asked of the remote.",
                m.remote_lookup_chunks);
        counter(&b, "remote_found_chunks_total", "Chunks the remote had.", m.remote_found_chunks);
        counter(&b, "remote_puts_total", "Write-throughs queued for the remote.", m.remote_puts);
        counter(&b, "remote_put_bytes_total", "Payload bytes of write-throughs queued.",
                m.remote_put_bytes);
        counter(&b, "remote_written_total", "Values the remote server acknowledged.",
                m.remote_written);
        counter(&b, "remote_dropped_total", "Write-throughs dropped (remote down, queue full).",
                m.remote_dropped);
        counter(&b, "remote_gets_total", "Chunk fetches from the remote.", m.remote_gets);
        counter(&b, "remote_get_bytes_total", "Payload bytes fetched and verified.",
                m.remote_get_bytes);
        counter(&b, "remote_misses_total", "Fetches that found nothing (gone, or remote down).",
                m.remote_misses);
        counter(&b, "remote_refused_total",
                "Values refused (other layout or key, corrupt, newer format).", m.remote_refused);
        counter(&b, "remote_errors_total", "Remote transport failures and error replies.",
                m.remote_errors);
        counter(&b, "remote_degraded_total", "Remote calls answered at once while it was down.",
                m.remote_degraded);
        put(&b, "# HELP ferry_kv_remote_down 1 while the remote is marked down.\n"
                "# TYPE ferry_kv_remote_down gauge\nferry_kv_remote_down %u\n",
            m.remote_down);
    }
    histogram(&b, "lookup", "Lookup latency.", m.lookup_ns, m.lookup_sum_ns);
    histogram(&b, "store", "Store latency.", m.store_ns, m.store_sum_ns);
    histogram(&b, "retrieve", "Retrieve latency.", m.retrieve_ns, m.retrieve_sum_ns);
    histogram(&b, "retrieve_first_bytes", "Time until a retrieve's first bytes from L2 are "
              "checked and in the engine's buffer.", m.retrieve_first_bytes_ns,
              m.retrieve_first_bytes_sum_ns);
    histogram(&b, "retrieve_first_chunk", "Time until a retrieve's first whole chunk from L2 "
              "is checked and in the engine's buffer.", m.retrieve_first_chunk_ns,
              m.retrieve_first_chunk_sum_ns);
    put(&b, "# HELP ferry_kv_retrieve_check_seconds_total CPU spent checking chunks read from "
            "L2.\n# TYPE ferry_kv_retrieve_check_seconds_total counter\n"
            "ferry_kv_retrieve_check_seconds_total %.6f\n",
        (double)m.retrieve_check_us / 1e6);
    put(&b, "# HELP ferry_kv_retrieve_copy_seconds_total CPU spent copying chunks out into host "
            "buffers.\n# TYPE ferry_kv_retrieve_copy_seconds_total counter\n"
            "ferry_kv_retrieve_copy_seconds_total %.6f\n",
        (double)m.retrieve_copy_us / 1e6);
    if (b.pos > INT32_MAX)
        return ferry__kv_err(kv, -EOVERFLOW, "kv metrics: text too long");
    return (int)b.pos;
}

int ferry_kv_metrics_prometheus(ferry_kv *kv, char *buf, size_t len)
{
    FERRY__KV_CALL(kv, "metrics", metrics_prometheus_call(kv, buf, len));
}
