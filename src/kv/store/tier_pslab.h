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
#include "kv/kv_impl.h"

/* what the persistent tier is opened with */
typedef struct ferry__kv_pslab_cfg {
    const char *dir;
    /* several directories (one per drive; the slab striped across them):
     * dirs[0..n_dirs) instead of dir */
    const char *const *dirs;
    unsigned n_dirs;
    uint64_t bytes;       /* slab size in all; a slab of another size is used as it is */
    int direct;
    const char *engine;
    uint64_t slot_bytes;  /* a multiple of 4096 */
    /* the chunk image's bytes: reads are asynchronous (tier_pslab_async.c)
     * when it fills the slot (0: unknown, reads synchronous) */
    uint64_t chunk_bytes;
    /* what the chunks mean (ferry__kv_pslab_tag); NULL: not checked */
    const char *tag;
    size_t tag_len;
    unsigned mode;        /* files ferry creates: 0 -> 0600 */
    int reset;            /* 1: start empty (FERRY_PSLAB_RESET) */
} ferry__kv_pslab_cfg;

/*
 * Open (or create) the persistent slab of c->bytes in c->dir as an L2 tier
 * of chunks of slot_bytes: capacity = bytes / slot_bytes locations. The
 * directory is locked (FERRY_EBUSY when another store has it). The slab
 * records c->tag at creation; a slab with another tag is FERRY_EMISMATCH
 * and left untouched unless c->reset. write = a put under the chunk id
 * (16 bytes), readable at once and durable with the slab's next group
 * commit (SYNC_BATCH: 64 MiB or 8 chunks queued, 200 ms, or close;
 * ferry_kv_sync(), or ferry_pslab_sync() on ferry__kv_tier_pslab_store(),
 * forces it; a full slab commits queued evictions itself before a write
 * fails), read = a checked get (a chunk of another length under that id,
 * or one failing its checksum, is a miss: FERRY_EMISMATCH / FERRY_ECORRUPT
 * / FERRY_ENOTFOUND), release = ferry_pslab_forget (the eviction need not
 * survive a crash: a chunk that comes back is still the right bytes for
 * its id). Errors: those of ferry_pslab_open, -EINVAL, -ENOMEM, with a
 * message in eb.
 */
int ferry__kv_tier_pslab_open(const ferry__kv_pslab_cfg *c, ferry__errbuf *eb,
                              ferry__kv_tier **out);

/* the tag of kv's chunks: layout, chunk tokens and bytes, hash seed, TP
 * rank/world, model; its length, or -ENAMETOOLONG when cap is too small */
int ferry__kv_pslab_tag(const ferry_kv *kv, char *out, size_t cap);

/* ferry__kv_tier_pslab_open for the store kv (its tag) with cfg's l2_dir
 * (or l2_dirs, l2_bytes on each), l2_bytes, l2_direct, l2_engine, l2_mode
 * and l2_reset */
int ferry__kv_tier_pslab_open_kv(const ferry_kv *kv, const ferry_kv_config *cfg,
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
int ferry__kv_tier_pslab_recover(ferry__kv_tier *t, ferry__kv_tier_recover_fn fn, void *ctx);

/* the slab under the tier (tests, metrics) */
ferry_pslab *ferry__kv_tier_pslab_store(ferry__kv_tier *t);

/* a chunk id's key in the slab: lo then hi, little endian */
#define FERRY__KV_PSLAB_KEY 16
void ferry__kv_pslab_key(const ferry_kv_hash *id, uint8_t k[FERRY__KV_PSLAB_KEY]);

/* ---- the tier's asynchronous reads (tier_pslab_async.c) ---- */
typedef struct ferry__kv_tpa ferry__kv_tpa;
extern const ferry__kv_tier_aops ferry__kv_tpa_aops;
/* an engine of its own over ps's files (s: its stats), for a tier of
 * capacity slots; engine: as the slab's (NULL: auto). 0, or a code with
 * the message set */
int ferry__kv_tpa_open(ferry_pslab *ps, const char *engine, uint64_t capacity,
                       const ferry_pslab_stats *s, ferry__kv_tpa **out);
/* after every read it started landed (or its queue broke) */
void ferry__kv_tpa_close(ferry__kv_tpa *a);
/* the L1 pool for the engine's fixed-buffer path / undo it */
int ferry__kv_tpa_register(ferry__kv_tpa *a, void *pool, size_t len);
void ferry__kv_tpa_unregister(ferry__kv_tpa *a);
/* the tier's reads, or NULL when they are synchronous */
ferry__kv_tpa *ferry__kv_tier_pslab_tpa(ferry__kv_tier *t);

#endif
