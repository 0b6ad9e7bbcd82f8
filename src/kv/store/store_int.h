/*
 * store_int.h - what the pieces of the tiered KV store share (store_*.c).
 * Private. The store: index, chunk states, tiers, eviction, and the
 * store / retrieve / lookup / prefetch / pin / delete operations.
 *
 * Design. One hash index maps a chunk id (chunk hash ^ namespace digest of
 * model, TP rank and world, salt) to an entry that records which tiers hold
 * the chunk's bytes and where. One mutex (kv->mu) guards the index, every
 * entry's fields, the tiers' reservations and the policies; it is held for
 * table work only. Bytes move outside it, under one of two protections:
 *  - a WRITING entry belongs to its writer: no reader sees it (lookups and
 *    retrieves treat it as absent) and nothing evicts it;
 *  - a READY entry with readers > 0 (a retrieve in flight, a write-through
 *    or promotion reading it, a pin) is never evicted or deleted.
 * Both protections expire after their TTL (write 600 s, read 300 s) so a
 * writer or pinner that died does not hold memory forever; past it the
 * entry may be reclaimed and its slots reused.
 *
 * Entry lifetime: an entry is either in the index or "doomed" (removed, its
 * tier space released). A doomed entry is freed when the last operation
 * holding a pointer to it (refs) lets go, so nobody ever touches freed
 * memory, and a retrieve that finds its chunk gone reports a miss for
 * exactly that chunk rather than reading bytes that now belong to another.
 *
 * Nothing half-written becomes visible: an entry turns READY only after all
 * its bytes landed (device copies synchronized); if any copy fails, the
 * entries of that call are removed and their slots released.
 *
 * The remote tier (tier_remote.c) never makes the engine wait on the
 * network except for what it asked: a lookup or retrieve that misses
 * locally asks the server once (pipelined) about the rest of the request,
 * and the chunks it reads are promoted into L1 slots like L2's. Its
 * write-throughs are queued on the I/O workers, which hand them to the
 * remote's own bounded queue. A chunk only becomes remote-resident in the
 * index on the server's word (exists), never because a put was queued.
 */
#ifndef FERRY_KV_STORE_INT_H
#define FERRY_KV_STORE_INT_H

#include "kv/kv_impl.h"

/* chunk ids of a request up to this many live on the caller's stack */
#define STACK_CHUNKS 512
/* how long a retrieve's landed read-ahead is kept from eviction at most
 * (its copy-out normally comes within milliseconds) */
#define KV_AHEAD_HOLD_NS ((uint64_t)500 * 1000 * 1000)

/* what reserve does when the tier is full and nothing can be evicted */
enum {
    RESERVE_NOW = 0,       /* decline at once (counted as a failure) */
    RESERVE_WAIT = 1,      /* L1: wait for a write-through to free a slot (-EAGAIN: start over) */
    RESERVE_TRY = 2,       /* decline at once, not a failure (a read-ahead that falls back) */
    RESERVE_WAIT_READS = 3 /* RESERVE_WAIT, and for other retrieves' async reads too (only
                              for a caller with no read of its own in flight: those land
                              only when it reaps them) */
};

/* what each file offers the others (all under kv->mu unless said) */
/* tierio.c */
uint64_t ferry__kv_now_ns(ferry_kv *kv);
/* a whole chunk image read asynchronously from t's loc into data: is it
 * chunk id? Piece by piece where the tier checks pieces, else its whole
 * checksum (aops verify); 0, or the tier's FERRY_ECORRUPT */
int ferry__kv_tier_check_whole(ferry__kv_tier *t, uint64_t loc, const ferry_kv_hash *id,
                               const void *data, uint64_t len);
/* piece k (len bytes) of chunk id read from t's loc hashed to got: 0 when
 * that is what was written, else FERRY_ECORRUPT naming the piece */
int ferry__kv_tier_piece_check(ferry__kv_tier *t, uint64_t loc, const ferry_kv_hash *id,
                               uint64_t k, uint64_t len, uint64_t got);
int ferry__kv_tier_fault(ferry_kv *kv, ferry__kv_tier *t, int write, uint64_t loc, size_t len);
int ferry__kv_tier_io_done(ferry_kv *kv, ferry__kv_tier *t, int write, uint64_t loc,
                        const ferry_kv_hash *id, size_t len, int rc);
int ferry__kv_tier_io(ferry_kv *kv, ferry__kv_tier *t, int write, uint64_t loc,
                   const ferry_kv_hash *id, void *buf, size_t len);

/* index.c */
uint64_t ferry__kv_bucket_of(const ferry_kv *kv, ferry_kv_hash id);
ferry__kv_entry *ferry__kv_find(ferry_kv *kv, ferry_kv_hash id);
void ferry__kv_index_insert(ferry_kv *kv, ferry__kv_entry *e);
void ferry__kv_index_remove(ferry_kv *kv, ferry__kv_entry *e);

/* entry.c */
int ferry__kv_write_locked(const ferry__kv_entry *e, uint64_t now);
int ferry__kv_locked(ferry_kv *kv, const ferry__kv_entry *e, uint64_t now);
void ferry__kv_count_expired(ferry_kv *kv, const ferry__kv_entry *e);
void ferry__kv_read_lock(ferry_kv *kv, ferry__kv_entry *e, uint64_t now);
void ferry__kv_read_unlock(ferry__kv_entry *e);
void ferry__kv_tier_release(ferry_kv *kv, int tier, uint64_t loc);
void ferry__kv_drop_tier(ferry_kv *kv, ferry__kv_entry *e, int tier);
void ferry__kv_doom(ferry_kv *kv, ferry__kv_entry *e);
void ferry__kv_put(ferry_kv *kv, ferry__kv_entry *e);

/* reserve.c */
int ferry__kv_reserve(ferry_kv *kv, int tier, uint64_t now, uint64_t *loc, int may_wait);

/*
 * Back-pressure (ferry_kv_config.pool_wait_ms). A caller that holds no L1
 * slot of its own and finds every slot locked waits, up to wait_ns, in a
 * first-come first-served queue of these (each on its caller's stack):
 * only the head reserves, so a slot that frees goes to the oldest waiter.
 * A caller that already holds slots never waits (it commits or copies out
 * what it holds, then asks again holding nothing): waiters hold nothing,
 * so no two of them wait for each other.
 */
typedef struct ferry__kv_waiter {
    struct ferry__kv_waiter *next;
    uint64_t t0, deadline;     /* monotonic ns; 0: has not waited yet */
    int queued;
} ferry__kv_waiter;
/* an L1 slot for a caller holding none: 0 and *loc; FERRY_ENOSPACE (the
 * deadline passed, or wait_ns 0 and nothing free: counted as a decline;
 * wait_ns FERRY__KV_TAKE_FREE (kv_slots.h): only what is free, no wait,
 * not counted),
 * -ENOMEM; -ECANCELED instead of a wait once the store's close began
 * (ferry_kv_close_begin; w left); or -EAGAIN after a wait: kv->mu was
 * released, the caller looks
 * its entry up again and calls once more with the same w. wait_ns 0: as
 * ferry__kv_reserve(last), and `last`
 * (RESERVE_WAIT or RESERVE_WAIT_READS) is also the last try once the
 * deadline passed. Every caller calls ferry__kv_wait_leave
 * once it stops asking (whatever the outcome; a no-op when not queued) */
int ferry__kv_reserve_l1(ferry_kv *kv, ferry__kv_waiter *w, uint64_t wait_ns, int last,
                         uint64_t *loc);
void ferry__kv_wait_leave(ferry_kv *kv, ferry__kv_waiter *w);
/* a slot may have freed or become evictable: wake the waiters (cheap when
 * none) */
void ferry__kv_room(ferry_kv *kv);
/* a message naming the pool and who holds its slots, for a decline:
 * "N of M L1 slots: W being written, R read-locked (P pinned), T written
 * through" */
void ferry__kv_pool_holders(ferry_kv *kv, char *buf, size_t len);

/* request.c */
int ferry__kv_stream_get(ferry_kv *kv, ferry_stream **out);
void ferry__kv_stream_put(ferry_kv *kv, ferry_stream *s);
uint32_t ferry__kv_chunk_ntok(const ferry_kv *kv, size_t i, size_t n);
ferry_kv_hash ferry__kv_ns_of(ferry_kv *kv, const ferry_kv_req *req);
int ferry__kv_req_ok(ferry_kv *kv, const ferry_kv_req *req, const char *what);
/* store_open.c: the struct of a store with the checked cfg's settings and
 * no tiers yet (its backend: the in-process store), or NULL; its free; the
 * check of cfg->pool_wait_ms (0 or -EINVAL with a message) */
ferry_kv *ferry__kv_alloc(const ferry_kv_config *cfg, uint32_t ct, uint64_t chunk_bytes);
void ferry__kv_free(ferry_kv *kv);
int ferry__kv_pool_wait_check(const ferry_kv_config *cfg);
/* the in-process store's backend operations (store_backend.c's table) */
struct ferry__kv_idsrc;
struct ferry_kv_op;
int ferry__kv_local_lookup(ferry_kv *kv, struct ferry__kv_idsrc *src, const ferry_kv_req *req);
int ferry__kv_local_prefetch(ferry_kv *kv, const ferry_kv_hash *ids, size_t nch, size_t n);
int ferry__kv_local_pin(ferry_kv *kv, const ferry_kv_hash *ids, size_t nch, size_t n, int pin);
int ferry__kv_local_clear(ferry_kv *kv);
int ferry__kv_local_flush(ferry_kv *kv);
int ferry__kv_local_sync(ferry_kv *kv);
int ferry__kv_local_stats(ferry_kv *kv, ferry_kv_stats *out);
size_t ferry__kv_lw_local_cap(ferry_kv *kv);
int ferry__kv_lw_local_acquire(ferry_kv *kv, struct ferry_kv_op *op, size_t cap);
void ferry__kv_lw_local_release(ferry_kv *kv, struct ferry_kv_op *op);
int ferry__kv_lw_local_reserve(ferry_kv *kv, struct ferry_kv_op *op, size_t cap);
void ferry__kv_lw_local_commit(ferry_kv *kv, struct ferry_kv_op *op, int abort);
/* store_lookup.c: the leading tokens of the chunks ids[0..nch) of an
 * n-token request that are cached (either backend; reports tiers in req) */
int ferry__kv_lookup_ids(ferry_kv *kv, const ferry_kv_hash *ids, size_t nch, size_t n,
                         const ferry_kv_req *req);
/* tokens present and each a token id (0 .. 2^31-1): 0 or -EINVAL naming
 * the first that is not */
int ferry__kv_tokens_ok(ferry_kv *kv, const int32_t *tokens, size_t n, const char *what);
int ferry__kv_make_ids(ferry_kv *kv, const int32_t *tokens, size_t n, const ferry_kv_req *req,
                    const char *what, ferry_kv_hash *stack, ferry_kv_hash **ids);
void ferry__kv_set_status(const ferry_kv_req *req, size_t i, int code);
void ferry__kv_set_tier(const ferry_kv_req *req, size_t i, int tier);

/* lookup.c */
void ferry__kv_remote_discover_missing(ferry_kv *kv, const ferry_kv_hash *ids, size_t nch, size_t n);

/* write.c */
void ferry__kv_write_through(ferry_kv *kv, ferry__kv_entry *e, ferry__kv_job *j,
                             ferry__kv_job *rj, uint64_t now, ferry__kv_job ***tail);

/* store_retrieve.c: the reads a retrieve keeps in flight from an
 * asynchronous tier: FERRY_KV_READ_DEPTH (1-32) when set to one, else dflt */
unsigned ferry__kv_read_depth(unsigned dflt);

/* promote.c */
int ferry__kv_lower_tier(const ferry_kv *kv, const ferry__kv_entry *e);
void ferry__kv_promote_finish(ferry_kv *kv, ferry__kv_entry *e, uint64_t slot, int rc, int src);

/* store_reserve.c: this thread's cut (ferry__kv_thread_cut), or NULL */
ferry__kv_cut *ferry__kv_thread_cut_get(void);

/* api.c */
size_t ferry__kv_prefetch_ids(ferry_kv *kv, const ferry_kv_hash *ids, size_t nch, size_t n,
                           int leading, uint8_t *queued);

#endif
