/*
 * abi_dump: prints, as one JSON object, sizeof and the offset and size of
 * every field of the public structs the Python package mirrors with
 * ctypes, as this compiler lays them out. python/tests/test_abi.py
 * compares the package's structures with it field by field.
 */
#include <ferry/device.h>
#include <ferry/io.h>
#include <ferry/kv.h>
#include <ferry/moe.h>

#include <stddef.h>
#include <stdio.h>

static int first_struct = 1, first_field;

static void open_struct(const char *name, size_t size)
{
    printf("%s\n  \"%s\": {\"size\": %zu, \"fields\": {", first_struct ? "{" : ",", name, size);
    first_struct = 0;
    first_field = 1;
}

static void field(const char *name, size_t off, size_t size)
{
    printf("%s\"%s\": [%zu, %zu]", first_field ? "" : ", ", name, off, size);
    first_field = 0;
}

#define S(T) open_struct(#T, sizeof(T))
#define F(T, f) field(#f, offsetof(T, f), sizeof(((T *)0)->f))
#define E() printf("}}")

int main(void)
{
    S(ferry_kv_hash); F(ferry_kv_hash, lo); F(ferry_kv_hash, hi); E();

#define L(f) F(ferry_kv_layout, f)
    S(ferry_kv_layout); L(size); L(num_layers); L(kv); L(num_heads); L(head_dim); L(dtype); E();
#undef L
#define B(f) F(ferry_kv_buffer, f)
    S(ferry_kv_buffer); B(size); B(layout); B(mem); B(form); B(base); B(capacity_tokens);
    B(block_bases); B(block_tokens); B(block_stride); B(num_blocks); B(block_table);
    B(table_len); B(token_stride); B(head_stride); E();
#undef B
    S(ferry_kv_name); F(ferry_kv_name, bytes); F(ferry_kv_name, len); E();
#define C(f) F(ferry_kv_config, f)
    S(ferry_kv_config); C(size); C(model); C(tp_rank); C(tp_world); C(layout);
    C(chunk_tokens); C(hash_seed); C(l1_bytes); C(l2_dir); C(l2_bytes); C(l2_direct);
    C(l2_engine); C(l1_policy); C(l2_policy); C(watermark); C(evict_fraction);
    C(write_ttl_ms); C(read_ttl_ms); C(device); C(prefetch_max_bytes); C(workers);
    C(l2_persistent); C(remote_url); C(remote_options); C(remote_index_chunks); C(l2_reset);
    C(l2_mode); C(server); C(server_timeout_ms); C(l2_dirs); C(l2_n_dirs);
    C(pool_wait_ms); E();
#undef C
#define R(f) F(ferry_kv_req, f)
    S(ferry_kv_req); R(size); R(salt); R(salt_len); R(flags); R(tiers); R(status);
    R(max_chunks); R(skip_tokens); E();
#undef R
#define O(f) F(ferry_kv_layers_opt, f)
    S(ferry_kv_layers_opt); O(size); O(stream); O(flags); E();
#undef O
#define T(f) F(ferry_kv_tier_stats, f)
    S(ferry_kv_tier_stats); T(hits); T(evictions); T(bytes_written); T(bytes_read);
    T(used_bytes); T(capacity_bytes); T(chunks); T(usage); T(failures); E();
#undef T
#define K(f) F(ferry_kv_stats, f)
    S(ferry_kv_stats); K(size); K(lookups); K(lookup_tokens); K(hit_tokens); K(stores);
    K(stored_chunks); K(stored_bytes); K(retrieves); K(retrieved_chunks); K(retrieved_bytes);
    K(misses); K(prefetched_chunks); K(deleted_chunks); K(failures); K(alloc_failures);
    K(lock_expired); K(chunks); K(tier); K(lookup_ns); K(store_ns); K(retrieve_ns);
    K(remote_lookups); K(remote_lookup_chunks); K(remote_found_chunks); K(remote_puts);
    K(remote_put_bytes); K(remote_written); K(remote_dropped); K(remote_gets);
    K(remote_get_bytes); K(remote_misses); K(remote_refused); K(remote_errors);
    K(remote_degraded); K(remote_down); K(corrupt_chunks); K(device_chunks);
    K(device_copy_calls); K(pool_waits); K(pool_wait_us);
    K(pool_declines); K(retrieve_check_us); K(retrieve_copy_us); K(retrieve_first_bytes_ns);
    K(retrieve_first_chunk_ns); K(retrieve_first_bytes_sum_ns); K(retrieve_first_chunk_sum_ns);
    K(lookup_sum_ns); K(store_sum_ns); K(retrieve_sum_ns);
    E();
#undef K
#define D(f) F(ferry_device_options, f)
    S(ferry_device_options); D(size); D(backend); D(ordinal); D(mem_limit); E();
#undef D
#define IO(f) F(ferry_io_options, f)
    S(ferry_io_options); IO(size); IO(engine); IO(depth); IO(max_request); IO(device);
    IO(bounce_bytes); E();
#undef IO
#define G(f) F(ferry_moe_geometry, f)
    S(ferry_moe_geometry); G(size); G(num_layers); G(num_experts); G(slots); G(banks);
    G(row_bytes); E();
#undef G
#define P(f) F(ferry_moe_planner_options, f)
    S(ferry_moe_planner_options); P(size); P(num_layers); P(num_experts); P(slots); P(policy);
    P(oracle); P(expert_bytes); P(top_k); E();
#undef P
#define CP(f) F(ferry_moe_copy_plan, f)
    S(ferry_moe_copy_plan); CP(layer); CP(n); CP(dst_slots); CP(src_rows); E();
#undef CP
#define MC(f) F(ferry_moe_counts, f)
    S(ferry_moe_counts); MC(active); MC(missing); MC(fetched); MC(prefetch_hits); E();
#undef MC
#define PS(f) F(ferry_moe_planner_stats, f)
    S(ferry_moe_planner_stats); PS(size); PS(steps); PS(routes); PS(hits); PS(misses);
    PS(evictions); PS(forgotten); PS(prefetch_requests); PS(prefetch_fetched); PS(prefetch_hits);
    PS(prefetch_wasted); PS(prefetch_bytes); PS(prefetch_wasted_bytes); E();
#undef PS
#define HS(f) F(ferry_moe_hint_stats, f)
    S(ferry_moe_hint_stats); HS(size); HS(hinted); HS(right); HS(wrong); HS(saves); HS(evicted);
    HS(fetched); HS(live); E();
#undef HS
#define MM(f) F(ferry_moe_model, f)
    S(ferry_moe_model); MM(name); MM(num_layers); MM(num_experts); MM(top_k); MM(expert_bytes);
    E();
#undef MM
#define RR(f) F(ferry_moe_replay_result, f)
    S(ferry_moe_replay_result); RR(policy); RR(slots); RR(steps); RR(hits); RR(misses);
    RR(hit_rate); RR(host_bytes); RR(evictions); RR(ns_per_step); E();
#undef RR
    printf("\n}\n");
    return 0;
}
