/*
 * kv_bench_persist.c - `ferry kv bench --persistent`: what persistence
 * costs, measured in this run.
 *
 * The same store workload (every prompt's ferry_kv_store, in order; no
 * lookups or retrieves) on a fresh store whose L2 is the non-persistent
 * slab (A, ferry/gds.h) or the persistent one (B, ferry/pslab.h), in
 * alternating rounds A B (C) A B (C) ... in one directory on one drive
 * (DIR/ferry-kv-bench-persist, emptied before each round and removed at
 * the end). Timed, per round, from the first store until every chunk is
 * on the slab: the store calls, then ferry_kv_flush (every write-through's
 * write has returned), then for B ferry_kv_sync (the last group commit:
 * slab fdatasync, journal append, journal fdatasync). B's clock thus
 * stops at the durable commit point; A's stops when its O_DIRECT writes
 * have returned, with no sync (the non-persistent slab promises nothing
 * across a crash, and on a host-cached virtual disk its bytes may still
 * be in the host's cache then). Not timed: opening the store (creating
 * and preallocating the slab files), closing it, removing the files.
 * Throughput = bytes written to L2 / that time; the figure is the
 * median of B's rounds over the median of A's.
 *
 * A third round in each cycle (C) measures the drive's own durable write
 * rate, with no store in the loop: the bytes B wrote, as chunk-size
 * O_DIRECT writes (16 requests in flight each, as the L2 tiers write a
 * chunk) into a preallocated file in the same directory, then one
 * fdatasync. B / C is what ferry's persistent path costs over what the
 * durable bytes cost the drive anyway; C / A is what durability itself
 * costs on this drive (on a host-cached virtual disk, the host's cache
 * against its physical disk).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kv_bench.h"

#define PC_SUBDIR "ferry-kv-bench-persist"
#define PC_RAW_FILE "ferry-kv-bench-raw.bin"

static void pc_clean(const char *sub)
{
    static const char *const names[] = {FERRY_GDS_SLAB_NAME, FERRY_PSLAB_FILE,
                                        FERRY_PSLAB_JOURNAL, FERRY_PSLAB_JOURNAL ".tmp",
                                        PC_RAW_FILE, "ferry.lock"};
    char path[4200];
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        snprintf(path, sizeof path, "%s/%s", sub, names[i]);
        unlink(path);
    }
}

static int pc_round_run(const opts *o, const ferry_kv_layout *l, const workload *w,
                        const ferry_kv_buffer *buf, const char *sub, int persistent, pc_round *r)
{
    opts so = *o;
    so.persistent = persistent;
    so.remote = NULL;
    memset(r, 0, sizeof *r);
    r->persistent = persistent;
    pc_clean(sub);
    ferry_kv *kv;
    int rc = kvb_open_store(&so, l, o->l1, o->l2, sub, &kv);
    if (rc < 0)
        return rc;
    ferry_kv_stats a = FERRY_KV_STATS_INIT, b = FERRY_KV_STATS_INIT;
    ferry_kv_stats_get(kv, &a);
    double t0 = kvb_now_s();
    for (size_t i = 0; i < w->np && rc >= 0; i++) {
        rc = ferry_kv_store(kv, w->p[i].tok, w->p[i].n, NULL, buf);
        if (rc == FERRY_ENOSPACE)
            rc = 0;
    }
    double t1 = kvb_now_s();
    if (rc >= 0)
        rc = ferry_kv_flush(kv);
    double t2 = kvb_now_s();
    if (rc >= 0 && persistent)
        rc = ferry_kv_sync(kv);
    double t3 = kvb_now_s();
    ferry_kv_stats_get(kv, &b);
    ferry_kv_close(kv);
    pc_clean(sub);
    if (rc < 0)
        return rc;
    r->store_s = t1 - t0;
    r->drain_s = t2 - t1;
    r->sync_s = t3 - t2;
    r->l2_bytes = b.tier[FERRY_KV_TIER_L2].bytes_written - a.tier[FERRY_KV_TIER_L2].bytes_written;
    r->l2_failures = b.tier[FERRY_KV_TIER_L2].failures - a.tier[FERRY_KV_TIER_L2].failures;
    r->stored_bytes = b.stored_bytes - a.stored_bytes;
    r->gbps = t3 > t0 ? (double)r->l2_bytes / (t3 - t0) / 1e9 : 0;
    return 0;
}

/* C: bytes as chunk-size O_DIRECT writes at depth 16, then one fdatasync */
static int pc_raw_run(const opts *o, const char *sub, uint64_t chunk, uint64_t bytes,
                      pc_round *r)
{
    memset(r, 0, sizeof *r);
    r->persistent = 2;
    pc_clean(sub);
    uint64_t slot = (chunk + 4095) & ~4095ull, n = bytes / slot;
    if (!n)
        return 0;
    char path[4200];
    snprintf(path, sizeof path, "%s/%s", sub, PC_RAW_FILE);
    ferry_io_options io_opt = FERRY_IO_OPTIONS_INIT;
    io_opt.engine = o->engine;
    io_opt.depth = 16;
    ferry_io *io = NULL;
    ferry_file *f = NULL;
    void *buf = NULL;
    int rc = ferry_io_open(&io_opt, &io);
    if (rc == 0)
        rc = ferry_file_open(io, path,
                             FERRY_FILE_WRITE | FERRY_FILE_CREATE | FERRY_FILE_TRUNC |
                                 FERRY_FILE_DIRECT,
                             &f);
    if (rc == 0)
        rc = ferry_file_allocate(f, 0, n * slot);
    if (rc == 0)
        rc = ferry_io_buffer_alloc(io, (size_t)slot, &buf);
    if (rc == 0) {
        memset(buf, 0x5a, (size_t)slot);
        double t0 = kvb_now_s();
        for (uint64_t i = 0; i < n && rc == 0; i++)
            rc = ferry_io_pwrite(io, f, buf, (size_t)slot, i * slot);
        double t1 = kvb_now_s();
        if (rc == 0)
            rc = ferry_file_sync(f);
        double t2 = kvb_now_s();
        r->store_s = t1 - t0;
        r->sync_s = t2 - t1;
        r->l2_bytes = n * slot;
        r->gbps = t2 > t0 ? (double)r->l2_bytes / (t2 - t0) / 1e9 : 0;
    }
    if (buf)
        ferry_io_buffer_free(io, buf);
    ferry_file_close(f);
    ferry_io_close(io);
    pc_clean(sub);
    return rc;
}

void kvb_persist_cost_run(const opts *o, const ferry_kv_layout *l, const workload *w,
                             uint64_t chunk, persist_cost *pc)
{
    memset(pc, 0, sizeof *pc);
    char sub[4096];
    snprintf(sub, sizeof sub, "%s/%s", o->dir, PC_SUBDIR);
    engine_buf buf;
    pc->rc = kvb_buffer_alloc(o, l, w->max_tokens, &buf);
    double v[3][PC_MAX_ROUNDS];
    unsigned nv[3] = {0, 0, 0};
    uint64_t b_bytes = 0;
    /* a progress line for a terminal only (not a log, a pipe or a file) */
    int progress = !o->json && cli_isatty();
    for (unsigned i = 0; pc->rc == 0 && i < 3 * o->persist_rounds; i++) {
        int p = (int)(i % 3); /* A B C A B C ... */
        if (progress)
            fprintf(stderr, "  persistence cost: round %u of %u (%s)\r", i + 1,
                    3 * o->persist_rounds,
                    p == 2 ? "raw durable writes" : p ? "persistent" : "non-persistent");
        if (p == 2)
            pc->rc = pc_raw_run(o, sub, chunk, b_bytes, &pc->r[i]);
        else
            pc->rc = pc_round_run(o, l, w, &buf.b, sub, p, &pc->r[i]);
        if (pc->rc == 0) {
            if (p == 1)
                b_bytes = pc->r[i].l2_bytes;
            v[p][nv[p]++] = pc->r[i].gbps;
            pc->n = i + 1;
        }
    }
    if (progress)
        fprintf(stderr, "%60s\r", "");
    rmdir(sub);
    kvb_buffer_free(&buf);
    pc->median[0] = kvb_pct(v[0], nv[0], 0.5);
    pc->median[1] = kvb_pct(v[1], nv[1], 0.5);
    pc->median[2] = kvb_pct(v[2], nv[2], 0.5);
    pc->ratio = kvb_ratio(pc->median[1], pc->median[0]);
    pc->raw_ratio = kvb_ratio(pc->median[1], pc->median[2]);
    if (getloadavg(pc->load, 3) < 0)
        pc->load[0] = pc->load[1] = pc->load[2] = 0;
}

json_t *kvb_persist_cost_json(const persist_cost *pc)
{
    json_t *j = json_object(), *a = json_array();
    for (unsigned i = 0; i < pc->n; i++) {
        const pc_round *r = &pc->r[i];
        json_t *x = json_object();
        json_object_set_new(x, "mode", json_string(r->persistent == 2 ? "raw_durable"
                                                   : r->persistent ? "persistent"
                                                                   : "nonpersistent"));
        json_object_set_new(x, "gb_per_s", json_real(r->gbps));
        json_object_set_new(x, "store_s", json_real(r->store_s));
        json_object_set_new(x, "drain_s", json_real(r->drain_s));
        json_object_set_new(x, "sync_s", json_real(r->sync_s));
        json_object_set_new(x, "l2_bytes", json_integer((json_int_t)r->l2_bytes));
        json_object_set_new(x, "l2_failures", json_integer((json_int_t)r->l2_failures));
        json_object_set_new(x, "stored_bytes", json_integer((json_int_t)r->stored_bytes));
        json_array_append_new(a, x);
    }
    json_object_set_new(j, "rounds", a);
    json_object_set_new(j, "nonpersistent_median_gb_per_s", json_real(pc->median[0]));
    json_object_set_new(j, "persistent_median_gb_per_s", json_real(pc->median[1]));
    json_object_set_new(j, "raw_durable_median_gb_per_s", json_real(pc->median[2]));
    json_object_set_new(j, "persist_store_ratio", json_real(pc->ratio));
    json_object_set_new(j, "persistent_vs_raw_durable_ratio", json_real(pc->raw_ratio));
    json_object_set_new(j, "raw_durable_vs_nonpersistent_ratio",
                        json_real(kvb_ratio(pc->median[2], pc->median[0])));
    json_object_set_new(j, "load_average", json_real(pc->load[0]));
    if (pc->rc < 0)
        json_object_set_new(j, "error", json_string(ferry_last_error()));
    return j;
}

void kvb_persist_cost_print(const persist_cost *pc)
{
    printf("\npersistence cost (same run: the store workload on a fresh store, L2 non-persistent "
           "(A) and persistent (B), and the drive's own durable writes of B's bytes (C), in "
           "alternating rounds; load average %.2f %.2f %.2f on %ld CPUs)\n",
           pc->load[0], pc->load[1], pc->load[2], sysconf(_SC_NPROCESSORS_ONLN));
    printf("  timed: A, B: stores + drain of the write-through (+ B's last durable commit); "
           "C: O_DIRECT writes + one fdatasync\n");
    for (unsigned i = 0; i < pc->n; i++) {
        const pc_round *r = &pc->r[i];
        if (r->persistent == 2)
            printf("  round %2u C raw durable      %6.2f GB/s  (%.2f GiB in %.3f s: writes %.3f, "
                   "fdatasync %.3f)\n",
                   i + 1, r->gbps, (double)r->l2_bytes / (1 << 30), r->store_s + r->sync_s,
                   r->store_s, r->sync_s);
        else
            printf("  round %2u %s  %6.2f GB/s  (%.2f GiB to L2 in %.3f s: stores %.3f, drain "
                   "%.3f, sync %.3f; L2 failures %llu)\n",
                   i + 1, r->persistent ? "B persistent    " : "A non-persistent", r->gbps,
                   (double)r->l2_bytes / (1 << 30), r->store_s + r->drain_s + r->sync_s,
                   r->store_s, r->drain_s, r->sync_s, (unsigned long long)r->l2_failures);
    }
    if (pc->rc < 0)
        printf("  stopped: %s\n", ferry_last_error());
    printf("  median              A %.2f GB/s, B %.2f GB/s, C %.2f GB/s\n", pc->median[0],
           pc->median[1], pc->median[2]);
    printf("  persistent / non-persistent (B/A) = %.3f; of that, the drive's "
           "durable rate C/A = %.3f and ferry's persistent path B/C = %.3f\n",
           pc->ratio, kvb_ratio(pc->median[2], pc->median[0]), pc->raw_ratio);
}
