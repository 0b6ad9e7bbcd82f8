/*
 * kv_bench_report.c - `ferry kv bench`'s report: the run's figures and
 * the references measured next to them, as text or as one JSON object.
 * Measurements only: what they are judged against lives in bench/ and
 * the README.
 */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "kv_bench.h"

static json_t *tier_json(const ferry_kv_tier_stats *t)
{
    json_t *o = json_object();
    json_object_set_new(o, "hits", json_integer((json_int_t)t->hits));
    json_object_set_new(o, "evictions", json_integer((json_int_t)t->evictions));
    json_object_set_new(o, "bytes_written", json_integer((json_int_t)t->bytes_written));
    json_object_set_new(o, "bytes_read", json_integer((json_int_t)t->bytes_read));
    json_object_set_new(o, "capacity_bytes", json_integer((json_int_t)t->capacity_bytes));
    json_object_set_new(o, "used_bytes", json_integer((json_int_t)t->used_bytes));
    json_object_set_new(o, "failures", json_integer((json_int_t)t->failures));
    return o;
}

static json_t *remote_json(const ferry_kv_stats *m)
{
    json_t *x = json_object();
    json_object_set_new(x, "lookups", json_integer((json_int_t)m->remote_lookups));
    json_object_set_new(x, "found_chunks",
                        json_integer((json_int_t)m->remote_found_chunks));
    json_object_set_new(x, "puts", json_integer((json_int_t)m->remote_puts));
    json_object_set_new(x, "written", json_integer((json_int_t)m->remote_written));
    json_object_set_new(x, "dropped", json_integer((json_int_t)m->remote_dropped));
    json_object_set_new(x, "gets", json_integer((json_int_t)m->remote_gets));
    json_object_set_new(x, "get_bytes", json_integer((json_int_t)m->remote_get_bytes));
    json_object_set_new(x, "misses", json_integer((json_int_t)m->remote_misses));
    json_object_set_new(x, "refused", json_integer((json_int_t)m->remote_refused));
    json_object_set_new(x, "errors", json_integer((json_int_t)m->remote_errors));
    return x;
}

static double load_average(void)
{
    double la[3] = {0, 0, 0};
    if (getloadavg(la, 3) < 0)
        la[0] = 0;
    return la[0];
}

/* the run's own figures */
static void results_json(const report *rp, json_t *j)
{
    const opts *o = rp->o;
    const run_result *rr = rp->rr;
    double hit_rate = rr->prompt_tokens ? (double)rr->hit_tokens / (double)rr->prompt_tokens : 0;
    double st_gbps = rr->store_s > 0 ? (double)rr->stored_bytes / rr->store_s / 1e9 : 0;
    double rt_gbps = rr->retrieve_s > 0 ? (double)rr->retrieved_bytes / rr->retrieve_s / 1e9 : 0;
    const ferry_kv_tier_stats *t1 = &rr->m.tier[FERRY_KV_TIER_L1], *t2 = &rr->m.tier[FERRY_KV_TIER_L2];
    json_object_set_new(j, "workload", json_string(o->workload));
    json_object_set_new(j, "model", json_string(o->model));
    json_object_set_new(j, "chunk_tokens", json_integer(o->chunk_tokens));
    json_object_set_new(j, "chunk_bytes", json_integer((json_int_t)rp->chunk));
    json_object_set_new(j, "policy", json_string(o->policy));
    json_object_set_new(j, "l1_bytes", json_integer((json_int_t)o->l1));
    json_object_set_new(j, "l2_bytes", json_integer(o->dir ? (json_int_t)o->l2 : 0));
    json_object_set_new(j, "l2_persistent", json_boolean(o->dir && rp->persistent));
    json_object_set_new(j, "buffer_mem", json_string(kvb_buffer_mem(o)));
    json_object_set_new(j, "device", o->device ? json_string(o->device) : json_null());
    json_object_set_new(j, "buffer_form", json_string(kvb_buffer_form(o)));
    if (o->paged)
        json_object_set_new(j, "block_tokens", json_integer(o->paged));
    json_object_set_new(j, "prompts", json_integer((json_int_t)rp->prompts));
    json_object_set_new(j, "prompt_tokens", json_integer((json_int_t)rr->prompt_tokens));
    json_object_set_new(j, "hit_tokens", json_integer((json_int_t)rr->hit_tokens));
    json_object_set_new(j, "hit_rate", json_real(hit_rate));
    json_object_set_new(j, "recompute_avoided_tokens",
                        json_integer((json_int_t)rr->retrieved_tokens));
    json_object_set_new(j, "store_gb_per_s", json_real(st_gbps));
    json_object_set_new(j, "retrieve_gb_per_s", json_real(rt_gbps));
    json_object_set_new(j, "stored_bytes", json_integer((json_int_t)rr->stored_bytes));
    json_object_set_new(j, "retrieved_bytes", json_integer((json_int_t)rr->retrieved_bytes));
    json_object_set_new(j, "lookup_p50_us", json_real(rr->lookup_p50_us));
    json_object_set_new(j, "lookup_p99_us", json_real(rr->lookup_p99_us));
    json_object_set_new(j, "wall_s", json_real(rp->wall));
    json_t *tiers = json_object();
    json_object_set_new(tiers, "l1", tier_json(t1));
    if (o->dir)
        json_object_set_new(tiers, "l2", tier_json(t2));
    if (rp->remote)
        json_object_set_new(tiers, "remote", tier_json(&rr->m.tier[FERRY_KV_TIER_REMOTE]));
    json_object_set_new(j, "tiers", tiers);
    if (rp->remote)
        json_object_set_new(j, "remote", remote_json(&rr->m));
}

static json_t *refs_json(const report *rp)
{
    const opts *o = rp->o;
    const refs *rf = rp->rf;
    json_t *r = json_object();
    json_object_set_new(r, "memcpy_gb_per_s", json_real(rf->memcpy_gbps));
    json_object_set_new(r, "l1_store_gb_per_s", json_real(rf->l1_store_gbps));
    json_object_set_new(r, "l1_retrieve_gb_per_s", json_real(rf->l1_retrieve_gbps));
    json_object_set_new(r, "l1_store_ratio", json_real(kvb_ratio(rf->l1_store_gbps, rf->memcpy_gbps)));
    json_object_set_new(r, "l1_retrieve_ratio",
                        json_real(kvb_ratio(rf->l1_retrieve_gbps, rf->memcpy_gbps)));
    json_object_set_new(r, "memcpy_gb_per_cpu_s", json_real(rf->memcpy_gbps_cpu));
    json_object_set_new(r, "l1_store_gb_per_cpu_s", json_real(rf->l1_store_gbps_cpu));
    json_object_set_new(r, "l1_retrieve_gb_per_cpu_s", json_real(rf->l1_retrieve_gbps_cpu));
    json_object_set_new(r, "l1_store_ratio_cpu",
                        json_real(kvb_ratio(rf->l1_store_gbps_cpu, rf->memcpy_gbps_cpu)));
    json_object_set_new(r, "l1_retrieve_ratio_cpu",
                        json_real(kvb_ratio(rf->l1_retrieve_gbps_cpu, rf->memcpy_gbps_cpu)));
    json_object_set_new(r, "hash_gb_per_s", json_real(rf->hash_gbps));
    json_object_set_new(r, "hash_gb_per_cpu_s", json_real(rf->hash_gbps_cpu));
    json_object_set_new(r, "lookup_32k_cpu_us", json_real(rf->lookup32k_cpu_us));
    json_object_set_new(r, "lookup_32k_p50_us", json_real(rf->lookup32k_p50_us));
    json_object_set_new(r, "lookup_32k_p99_us", json_real(rf->lookup32k_p99_us));
    json_object_set_new(r, "lookup_32k_mean_us", json_real(rf->lookup32k_mean_us));
    if (o->dir) {
        json_object_set_new(r, "io_engine", json_string(rf->io_engine ? rf->io_engine : ""));
        json_object_set_new(r, "io_read_gb_per_s", json_real(rf->io_read_gbps));
        json_object_set_new(r, "l2_retrieve_gb_per_s", json_real(rf->l2_retrieve_gbps));
        json_object_set_new(r, "l2_retrieve_ratio", json_real(rf->l2_retrieve_ratio));
        json_object_set_new(r, "l2_promote_gb_per_s", json_real(rf->l2_promote_gbps));
        json_object_set_new(r, "l2_promote_ratio", json_real(rf->l2_promote_ratio));
        json_t *rounds = json_array();
        for (unsigned i = 0; i < rf->l2_rounds; i++) {
            json_t *x = json_object();
            json_object_set_new(x, "io_read_gb_per_s", json_real(rf->l2_round[i][0]));
            json_object_set_new(x, "l2_retrieve_gb_per_s", json_real(rf->l2_round[i][1]));
            json_object_set_new(x, "l2_promote_gb_per_s", json_real(rf->l2_round[i][2]));
            json_array_append_new(rounds, x);
        }
        json_object_set_new(r, "l2_rounds", rounds);
    }
    if (rf->have_remote) {
        json_object_set_new(r, "remote_cold_hit_rate", json_real(rf->remote_hit_rate));
        json_object_set_new(r, "remote_lookup_p50_us", json_real(rf->remote_lookup_p50_us));
        json_object_set_new(r, "remote_retrieve_gb_per_s",
                            json_real(rf->remote_retrieve_gbps));
        json_object_set_new(r, "remote_get_gb_per_s", json_real(rf->remote_get_gbps));
        json_object_set_new(r, "remote_retrieve_ratio",
                            json_real(kvb_ratio(rf->remote_retrieve_gbps, rf->remote_get_gbps)));
    }
    json_object_set_new(r, "load_average", json_real(load_average()));
    return r;
}

void kvb_report_json(const report *rp)
{
    const opts *o = rp->o;
    json_t *j = json_object();
    results_json(rp, j);
    if (o->refs)
        json_object_set_new(j, "references", refs_json(rp));
    if (rp->sl)
        json_object_set_new(j, "server_lookup", kvb_server_lookup_json(rp->sl));
    if (rp->sp)
        json_object_set_new(j, "server_pool", kvb_server_pool_json(rp->sp));
    if (rp->pc) {
        json_object_set_new(j, "persistence", kvb_persist_cost_json(rp->pc));
        json_object_set_new(j, "persist_store_ratio", json_real(rp->pc->ratio));
    }
    if (o->plot) {
        json_t *a = json_array();
        for (size_t i = 0; i < rp->npts; i++) {
            json_t *p = json_object();
            json_object_set_new(p, "l1_bytes", json_integer((json_int_t)(rp->pts[i].l1_chunks * rp->chunk)));
            json_object_set_new(p, "l2_bytes", json_integer((json_int_t)(rp->pts[i].l2_chunks * rp->chunk)));
            json_object_set_new(p, "hit_rate", json_real(rp->pts[i].hit_rate));
            json_array_append_new(a, p);
        }
        json_object_set_new(j, "sweep", a);
        json_object_set_new(j, "plot", json_string(rp->plot_rc == 0 ? o->plot : ""));
    }
    char *s = json_dumps(j, JSON_COMPACT);
    printf("%s\n", s ? s : "{}");
    free(s);
    json_decref(j);
}

static void results_text(const report *rp)
{
    const opts *o = rp->o;
    const run_result *rr = rp->rr;
    double hit_rate = rr->prompt_tokens ? (double)rr->hit_tokens / (double)rr->prompt_tokens : 0;
    double st_gbps = rr->store_s > 0 ? (double)rr->stored_bytes / rr->store_s / 1e9 : 0;
    double rt_gbps = rr->retrieve_s > 0 ? (double)rr->retrieved_bytes / rr->retrieve_s / 1e9 : 0;
    const ferry_kv_tier_stats *t1 = &rr->m.tier[FERRY_KV_TIER_L1], *t2 = &rr->m.tier[FERRY_KV_TIER_L2];
    printf("\nresults (%zu prompts, %.1f s)\n", rp->prompts, rp->wall);
    printf("  hit rate            %.4f  (%llu of %llu prompt tokens cached)\n", hit_rate,
           (unsigned long long)rr->hit_tokens, (unsigned long long)rr->prompt_tokens);
    printf("  recompute avoided   %llu tokens\n", (unsigned long long)rr->retrieved_tokens);
    printf("  store               %.2f GB/s (%.2f GiB new chunks)\n", st_gbps,
           (double)rr->stored_bytes / (1 << 30));
    printf("  retrieve            %.2f GB/s (%.2f GiB)\n", rt_gbps,
           (double)rr->retrieved_bytes / (1 << 30));
    printf("  lookup              p50 %.2f us, p99 %.2f us\n", rr->lookup_p50_us,
           rr->lookup_p99_us);
    printf("  L1                  hits %llu, evictions %llu, written %.2f GiB, read %.2f GiB\n",
           (unsigned long long)t1->hits, (unsigned long long)t1->evictions,
           (double)t1->bytes_written / (1 << 30), (double)t1->bytes_read / (1 << 30));
    if (o->dir)
        printf("  L2                  hits %llu, evictions %llu, written %.2f GiB, read %.2f "
               "GiB, failures %llu\n",
               (unsigned long long)t2->hits, (unsigned long long)t2->evictions,
               (double)t2->bytes_written / (1 << 30), (double)t2->bytes_read / (1 << 30),
               (unsigned long long)t2->failures);
    if (rp->remote)
        printf("  remote              hits %llu, %llu lookups found %llu chunks, fetched %.2f "
               "GiB; %llu puts (%llu written, %llu dropped), %llu misses, %llu refused, "
               "%llu errors\n",
               (unsigned long long)rr->m.tier[FERRY_KV_TIER_REMOTE].hits,
               (unsigned long long)rr->m.remote_lookups,
               (unsigned long long)rr->m.remote_found_chunks,
               (double)rr->m.remote_get_bytes / (1 << 30), (unsigned long long)rr->m.remote_puts,
               (unsigned long long)rr->m.remote_written, (unsigned long long)rr->m.remote_dropped,
               (unsigned long long)rr->m.remote_misses, (unsigned long long)rr->m.remote_refused,
               (unsigned long long)rr->m.remote_errors);
}

static void refs_text(const report *rp)
{
    const opts *o = rp->o;
    const refs *rf = rp->rf;
    printf("\nreferences (same run; load average %.2f on %ld CPUs)\n", load_average(),
           sysconf(_SC_NPROCESSORS_ONLN));
    printf("  memcpy              %.2f GB/s, %.2f GB per CPU second\n", rf->memcpy_gbps,
           rf->memcpy_gbps_cpu);
    printf("  L1 store            %.2f GB/s = %.2fx memcpy; per CPU second %.2f = %.2fx\n",
           rf->l1_store_gbps, kvb_ratio(rf->l1_store_gbps, rf->memcpy_gbps),
           rf->l1_store_gbps_cpu, kvb_ratio(rf->l1_store_gbps_cpu, rf->memcpy_gbps_cpu));
    printf("  L1 retrieve         %.2f GB/s = %.2fx memcpy; per CPU second %.2f = %.2fx\n",
           rf->l1_retrieve_gbps, kvb_ratio(rf->l1_retrieve_gbps, rf->memcpy_gbps),
           rf->l1_retrieve_gbps_cpu, kvb_ratio(rf->l1_retrieve_gbps_cpu, rf->memcpy_gbps_cpu));
    printf("  hashing             %.2f GB/s of token ids, %.2f GB per CPU second\n",
           rf->hash_gbps, rf->hash_gbps_cpu);
    printf("  lookup 32k tokens   p50 %.2f us, p99 %.2f us, mean %.2f us, %.2f CPU us, with "
           "128 chunks indexed\n",
           rf->lookup32k_p50_us, rf->lookup32k_p99_us, rf->lookup32k_mean_us,
           rf->lookup32k_cpu_us);
    if (o->dir) {
        printf("  L2, %u alternating rounds (GB/s: slab reads as ferry bench io, %s, "
               "chunk-size requests at depth 8 / L2 retrieve / L2 -> L1 prefetch):\n   ",
               rf->l2_rounds, rf->io_engine ? rf->io_engine : "?");
        for (unsigned i = 0; i < rf->l2_rounds; i++)
            printf(" %.2f/%.2f/%.2f", rf->l2_round[i][0], rf->l2_round[i][1],
                   rf->l2_round[i][2]);
        printf("\n  slab reads          %.2f GB/s (median)\n", rf->io_read_gbps);
        printf("  L2 -> L1            %.2f GB/s, median ratio %.2fx (prefetch: the slab "
               "leg)\n",
               rf->l2_promote_gbps, rf->l2_promote_ratio);
        printf("  L2 retrieve         %.2f GB/s, median ratio %.2fx, rounds %.2f..%.2fx "
               "(slab -> L1 -> engine buffer, the last leg a copy by the CPU into "
               "host memory, by the device into device memory)\n",
               rf->l2_retrieve_gbps, rf->l2_retrieve_ratio, rf->l2_retrieve_ratio_min,
               rf->l2_retrieve_ratio_max);
    }
    if (rf->have_remote) {
        printf("  remote, cold store  hit rate %.4f, lookup p50 %.1f us (one round trip)\n",
               rf->remote_hit_rate, rf->remote_lookup_p50_us);
        printf("  remote retrieve     %.2f GB/s = %.2fx ferry_remote_get of the same value "
               "size (%.2f GB/s; server -> L1 -> engine buffer, %.2f GiB)\n",
               rf->remote_retrieve_gbps, kvb_ratio(rf->remote_retrieve_gbps, rf->remote_get_gbps),
               rf->remote_get_gbps, (double)rf->remote_retrieved_bytes / (1 << 30));
    }
}

void kvb_report_text(const report *rp)
{
    const opts *o = rp->o;
    results_text(rp);
    if (o->refs)
        refs_text(rp);
    if (rp->sl) {
        printf("\nthrough the daemon (%s)\n", rp->sl->rc == 0 ? "the workload above ran there"
                                                             : "failed");
        kvb_server_lookup_print(rp->sl, o->refs ? rp->rf : NULL);
        if (rp->sp)
            kvb_server_pool_print(rp->sp);
    }
    if (rp->pc)
        kvb_persist_cost_print(rp->pc);
    if (o->plot) {
        printf("\nhit rate by tier size (%s)\n", rp->plot_rc == 0 ? o->plot : "plot failed");
        for (size_t i = 0; i < rp->npts; i++)
            printf("  L1 %10.1f MiB  L2 %10.1f MiB  hit rate %.4f\n",
                   (double)(rp->pts[i].l1_chunks * rp->chunk) / (1 << 20),
                   (double)(rp->pts[i].l2_chunks * rp->chunk) / (1 << 20), rp->pts[i].hit_rate);
    }
}
