/*
 * kv_slots.h - the store seen slot by slot, for a server that lets other
 * processes move the bytes (serve/, above kv). Private.
 *
 * The store's L1 pool is then a memfd (ferry__kv_open_shared) every client
 * maps. A client's store reserves a slot per chunk (the entry WRITING,
 * invisible), copies into it and commits (READY, written through like any
 * store) or aborts; its retrieve acquires chunks (promoted from a lower
 * tier into L1 first, then read-locked), copies out and releases. A slot
 * carries a generation that every reservation of it bumps: a release
 * answers 0 only when the slot was not reserved again since its acquire,
 * so bytes copied out of a slot that was reused (a lock past its TTL) are
 * never taken for the chunk's. A server's reservation has no TTL: it is
 * held until committed, aborted, or its connection closes (abort).
 *
 * Each held chunk is an opaque entry pointer the server keeps per
 * connection; every function takes kv->mu itself.
 */
#ifndef FERRY_SRC_KV_SLOTS_H
#define FERRY_SRC_KV_SLOTS_H

#include <stdatomic.h>

#include "ferry/kv.h"

typedef struct ferry__kv_entry ferry__kv_entry;

/* ferry_kv_open, with the L1 pool in a memfd (ignores cfg->device and cfg->server) */
int ferry__kv_open_shared(const ferry_kv_config *cfg, ferry_kv **out);
/* the pool: its memfd (owned by the store), mapping bytes, slot bytes and
 * slot count; -1 when the pool is not shared */
int ferry__kv_pool(ferry_kv *kv, uint64_t *map_bytes, uint64_t *slot_bytes, uint64_t *nslots);
/* the store's chunk geometry */
void ferry__kv_geometry(ferry_kv *kv, ferry_kv_layout *layout, uint32_t *chunk_tokens,
                        uint64_t *seed);

/* a wait_ns that takes only a slot free (or evictable) now: for a caller
 * that holds slots already, which must never wait; a miss is not counted
 * as a decline (the caller commits what it holds and asks again) */
#define FERRY__KV_TAKE_FREE UINT64_MAX

/* the store's pool_wait_ms, in ns: how long a client that sends no WAIT
 * waits for a slot */
uint64_t ferry__kv_pool_wait_ns(ferry_kv *kv);
/* a daemon connection's cut: why (0 while its client may still use what
 * it asked for; else the daemon's reason, nonzero), and references: the
 * connection's and one per read-ahead chunk queued on its behalf, which
 * may outlive the connection (the last put frees it) */
typedef struct ferry__kv_cut {
    atomic_int why;
    atomic_uint refs;
} ferry__kv_cut;
/* a cut not set yet, one reference (the caller's); NULL: no memory */
ferry__kv_cut *ferry__kv_cut_new(void);
/* drop a reference (NULL: nothing) */
void ferry__kv_cut_put(ferry__kv_cut *cut);
/* from now on this thread takes no L1 slot once cut->why is set: its waits
 * for one end (within a few ms: they look at least that often) and its
 * reservations and promotions fail, -ECANCELED, nothing taken; and its
 * read-ahead (ferry__kv_slot_prefetch) is queued under cut. For a
 * daemon's connection thread (its client hung up, or the daemon is
 * closing); NULL: never */
void ferry__kv_thread_cut(ferry__kv_cut *cut);
/* cut->why was set: the read-ahead queued under it that no read has begun
 * for is dropped now, its L1 slots and locks given back (what is being
 * read lands first: a slot a read may still write is never handed on).
 * Read-ahead a worker picks up later under a cut that is set is dropped
 * the same way, unread */
void ferry__kv_ahead_cut(ferry_kv *kv, ferry__kv_cut *cut);
/* read-ahead chunks dropped unread because their connection was cut */
uint64_t ferry__kv_ahead_dropped(ferry_kv *kv);
/* the waits for a slot this thread made since it last asked, and their
 * time (read and reset) */
void ferry__kv_thread_waits(uint64_t *waits, uint64_t *ns);

/* how many of ids[0..n), from the first, are present; tiers[i] gets each
 * one's nearest tier. Asks the remote tier about local misses. tokens:
 * what the ids cover, for the statistics */
int ferry__kv_slot_lookup(ferry_kv *kv, const ferry_kv_hash *ids, size_t n, uint64_t tokens,
                          uint8_t *tiers);
/* reserve an L1 slot for chunk id (tokens it covers): 0 and *e, *slot,
 * *gen; 1 when the chunk is present already (nothing held); FERRY_ELOCKED
 * (another writer has it: a message says it was skipped), FERRY_ENOSPACE
 * (with a message naming the pool and what holds it) / -ENOMEM */
int ferry__kv_slot_reserve(ferry_kv *kv, ferry_kv_hash id, uint32_t tokens, ferry__kv_entry **e,
                           uint64_t *slot, uint64_t *gen);
/* the same, waiting up to wait_ns for a slot when every one is locked
 * (ferry_kv_config.pool_wait_ms; 0: as ferry__kv_slot_reserve). Only for
 * a caller that holds no slot (a connection with no reservation) */
int ferry__kv_slot_reserve_wait(ferry_kv *kv, ferry_kv_hash id, uint32_t tokens, uint64_t wait_ns,
                                ferry__kv_entry **e, uint64_t *slot, uint64_t *gen);
/* commit (abort 0: READY and written through) or abort a reservation; 0, or
 * FERRY_ESTATE when it was lost meanwhile (the chunk is not stored) */
int ferry__kv_slot_commit(ferry_kv *kv, ferry__kv_entry *e, int abort);
/* promote chunk id into L1 when it is only below, then read-lock it: 0 and
 * *e, *slot, *gen, *tokens, *tier (where it was found); FERRY_ENOTFOUND,
 * FERRY_ENOSPACE (no L1 slot for the promotion), or the lower tier's read
 * or check failure (the chunk is then a miss) */
int ferry__kv_slot_acquire(ferry_kv *kv, ferry_kv_hash id, ferry__kv_entry **e, uint64_t *slot,
                           uint64_t *gen, uint32_t *tokens, uint8_t *tier);
/* the same, waiting up to wait_ns for a slot to promote into (only for a
 * caller that holds nothing); FERRY_ENOSPACE when the pool stays too
 * crowded, never FERRY_ENOTFOUND for a chunk that is there */
int ferry__kv_slot_acquire_wait(ferry_kv *kv, ferry_kv_hash id, uint64_t wait_ns,
                                ferry__kv_entry **e, uint64_t *slot, uint64_t *gen,
                                uint32_t *tokens, uint8_t *tier);
/* let go of an acquire: 0 when slot still held the chunk untouched since
 * the acquire (generation gen), FERRY_ESTATE when it did not */
int ferry__kv_slot_release(ferry_kv *kv, ferry__kv_entry *e, uint64_t slot, uint64_t gen);
/* queue the L2 reads of the chunks of ids that are only below L1 (ahead of
 * their acquires), under this thread's cut; nothing once it is set (its
 * client is gone: nothing read for it) */
void ferry__kv_slot_prefetch(ferry_kv *kv, const ferry_kv_hash *ids, size_t n);
/* delete ids[0..n) (as ferry_kv_delete) */
int ferry__kv_slot_delete(ferry_kv *kv, const ferry_kv_hash *ids, size_t n);

#endif
