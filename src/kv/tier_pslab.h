/*
 * tier_pslab.h - the KV store's persistent L2 tier over a ferry_pslab
 * (private). It implements the tier ops of kv_impl.h, so the store can use
 * it wherever it uses the non-persistent L2, and adds the one thing the
 * ops table cannot say: which chunks survived from the last run
 * (ferry__kv_tier_pslab_recover), so the store can put them back in its
 * index at open.
 */
#ifndef FERRY_SRC_KV_TIER_PSLAB_H
#define FERRY_SRC_KV_TIER_PSLAB_H

#include "ferry/pslab.h"
#include "kv_impl.h"

/*
 * Open (or create) the persistent slab of `bytes` in dir as an L2 tier of
 * chunks of slot_bytes (a multiple of 4096): capacity = bytes / slot_bytes
 * locations. write = a put under the chunk id (16 bytes), readable at
 * once and durable with the slab's next group commit (SYNC_BATCH: 64 MiB
 * or 8 chunks queued, 200 ms, or close; ferry_kv_sync(), or
 * ferry_pslab_sync() on ferry__kv_tier_pslab_store(), forces it), read =
 * a checked get (a chunk of another length under that id, or one failing
 * its checksum, is a miss: FERRY_EMISMATCH / FERRY_ECORRUPT / FERRY_ENOTFOUND),
 * release = ferry_pslab_forget (the eviction need not survive a crash: a
 * chunk that comes back is still the right bytes for its id).
 * Errors: those of ferry_pslab_open, -EINVAL, -ENOMEM, with a message in eb.
 */
int ferry__kv_tier_pslab_open(const char *dir, uint64_t bytes, int direct, const char *engine,
                              uint64_t slot_bytes, ferry__errbuf *eb, ferry__kv_tier **out);

/*
 * The chunks found in the slab at open, each given a slot: fn(id, loc,
 * len, ctx) once per chunk whose key is a chunk id and whose length fits a
 * slot. Chunks that cannot be this tier's (other keys, too long) and those
 * beyond the tier's capacity are forgotten. Call once, before any reserve.
 * Returns the number reported, or fn's first non-zero return (the walk
 * stops there; that chunk and the ones not yet reported are forgotten, so
 * no slot is held by a chunk the store does not know).
 */
typedef int (*ferry__kv_tier_recover_fn)(const ferry_kv_hash *id, uint64_t loc, uint64_t len,
                                         void *ctx);
int ferry__kv_tier_pslab_recover(ferry__kv_tier *t, ferry__kv_tier_recover_fn fn, void *ctx);

/* the slab under the tier (tests, metrics) */
ferry_pslab *ferry__kv_tier_pslab_store(ferry__kv_tier *t);

#endif
