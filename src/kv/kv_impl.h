/*
 * kv_impl.h - the KV store's private structures: index entries, the tier
 * interface (an ops table that L1, L2 and later the remote tier implement),
 * the eviction-policy interface, and test seams. Not installed.
 *
 * Locking: one mutex (kv->mu) guards the index, every entry's state, the
 * tiers' bookkeeping (reserve/release, used counts) and the policies. It is
 * held for hash-table work only, never across a copy or an I/O; bytes move
 * while the entry is protected by its state (WRITING for its writer) or by
 * a read lock (readers > 0), which eviction and delete respect.
 */
#ifndef FERRY_SRC_KV_IMPL_H
#define FERRY_SRC_KV_IMPL_H

#include <pthread.h>
#include <stdatomic.h>
#include <sys/uio.h>

#include "core.h"
#include "ferry/kv.h"
#include "kv/kv_slots.h"

typedef struct ferry__kv_entry ferry__kv_entry;
typedef struct ferry__kv_tier ferry__kv_tier;
typedef struct ferry__kv_policy ferry__kv_policy;
typedef uint64_t (*ferry__kv_clock_fn)(void *ctx);

enum { FERRY__KV_WRITING = 1, FERRY__KV_READY = 2 };

/* a policy's links for one tier, inside the entry */
typedef struct ferry__kv_node {
    ferry__kv_entry *prev, *next;
    uint8_t queue;   /* which list (policy-specific); 0 = not linked */
    uint8_t freq;    /* S3-FIFO access counter */
} ferry__kv_node;

struct ferry__kv_entry {
    ferry_kv_hash id;          /* chunk hash ^ namespace digest: the index key */
    ferry__kv_entry *hnext;    /* hash chain */
    ferry__kv_entry *dnext;    /* doomed list */
    uint32_t state;            /* FERRY__KV_WRITING / READY */
    uint32_t readers;          /* read locks (ops in flight + pins) */
    uint32_t pins;             /* of which ferry_kv_pin's: only these can be unpinned, so
                                  an unpin never takes an operation's lock (a pinned
                                  entry that was dropped takes its pins with it) */
    uint32_t refs;             /* internal pointers held by ops in flight */
    uint32_t tokens;           /* tokens the chunk covers */
    uint64_t write_deadline;   /* ns; WRITING only */
    uint64_t read_deadline;    /* ns; latest read lock + TTL */
    uint64_t ahead_until;      /* ns; a retrieve's read-ahead landed: not evicted before
                                  a retrieve copies it out or this passes */
    uint8_t resident;          /* bit (1 << tier) per tier holding the bytes */
    uint8_t l1_loading;        /* an L2 -> L1 promotion is in flight */
    uint8_t l2_writing;        /* a write-through is in flight */
    uint8_t doomed;            /* unlinked from the index; freed when refs == 0 */
    uint64_t loc[FERRY_KV_TIERS];
    ferry__kv_node node[FERRY_KV_TIERS];
};

/* ---- tiers ---- */
/*
 * A tier stores whole chunks at locations it hands out. All calls but
 * read/write run under kv->mu; read/write run without it (the caller holds
 * the entry), possibly from several threads at once.
 *
 * The remote tier (tier_remote.c, over ferry/remote.h) implements the same
 * ops: reserve hands out a dummy location (the server keeps the bytes),
 * write is ferry_remote_put under a key made from `id` (the chunk hash xor
 * the namespace digest of model, TP rank/world and salt, so every process
 * agrees on it), read is ferry_remote_get, release only forgets. The store
 * falls through by residency bits (lookup reports FERRY_KV_TIER_REMOTE for
 * a chunk resident only there; retrieve and prefetch promote the copy of
 * the nearest tier below L1); on a local miss, lookup / retrieve /
 * prefetch ask the remote (ferry__kv_remote_exists, pipelined) and index
 * what it has as resident in FERRY_KV_TIER_REMOTE only. Stored chunks are
 * written through (a JOB_RWRITE per chunk) but not marked resident there:
 * the put may still be dropped, so only the server's answer makes a chunk
 * remote-resident.
 */
/* a chunk a persistent tier kept: its id, location and length; non-zero
 * stops the walk (that chunk and the rest are forgotten) */
typedef int (*ferry__kv_tier_recover_fn)(const ferry_kv_hash *id, uint64_t loc, uint64_t len,
                                         void *ctx);

typedef struct ferry__kv_tier_ops {
    const char *name;
    /* room for one chunk; FERRY_ENOSPACE when the tier is full */
    int (*reserve)(ferry__kv_tier *t, uint64_t *loc);
    void (*release)(ferry__kv_tier *t, uint64_t loc);
    /* host memory <-> the chunk at loc (len <= the tier's chunk size) */
    int (*write)(ferry__kv_tier *t, uint64_t loc, const ferry_kv_hash *id, const void *src,
                 size_t len);
    int (*read)(ferry__kv_tier *t, uint64_t loc, const ferry_kv_hash *id, void *dst,
                size_t len);
    /* the host address of the chunk at loc, or NULL when not host-addressable */
    void *(*host_ptr)(ferry__kv_tier *t, uint64_t loc);
    void (*close)(ferry__kv_tier *t);
    /* ---- optional (NULL: the tier has none); the store calls only these,
     * never a particular tier's functions ---- */
    /* a shared tier: how many of ids[0..n), counted from the first, it
     * holds (one round trip; 0 while it is unreachable); outside kv->mu */
    int (*exists)(ferry__kv_tier *t, const ferry_kv_hash *ids, size_t n);
    /* a shared tier: delete ids[0..n) there; how many existed, or a code */
    int (*forget)(ferry__kv_tier *t, const ferry_kv_hash *ids, size_t n);
    /* wait until the writes the tier queued itself landed or were dropped */
    int (*flush)(ferry__kv_tier *t);
    /* a persistent tier: report every chunk it kept from an earlier run
     * (see ferry__kv_tier_recover_fn); once, before any reserve */
    int (*recover)(ferry__kv_tier *t, ferry__kv_tier_recover_fn fn, void *ctx);
    /* register the L1 pool [pool, pool + len) for the tier's fixed-buffer
     * path / undo it (a no-op when not registered) */
    int (*reg_pool)(ferry__kv_tier *t, void *pool, size_t len);
    void (*unreg_pool)(ferry__kv_tier *t);
    /* fill the metrics fields that are the tier's own */
    void (*counts)(ferry__kv_tier *t, ferry_kv_stats *m);
} ferry__kv_tier_ops;

/*
 * Asynchronous chunk reads, for tiers that have them (L2, the persistent
 * L2 of tier_pslab_async.c): a retrieve
 * keeps several reads in flight into reserved L1 slots (whole chunks, or
 * pieces of apiece bytes) and copies each chunk out as its last piece
 * lands, in whatever order they land, so the copies overlap the reads
 * still in flight. The reads of every thread
 * share the tier's completion queue: whichever waiting thread reaps hands
 * each completion to the batch that submitted it (leader/followers), so a
 * thread never takes another's completion for its own.
 */
typedef struct ferry__kv_abatch ferry__kv_abatch;

typedef struct ferry__kv_aread {
    struct ferry__kv_aread *next;  /* the batch's ready list (the tier's while in flight) */
    ferry__kv_abatch *batch;
    size_t idx;                    /* the caller's: which chunk */
    uint32_t piece;                /* the caller's: which piece of it */
    int result;                    /* once ready: 0 or a negative code */
    const char *why;               /* once ready with result < 0: the message */
    struct ferry__kv_aread *all;   /* every request its queue allocated (aqueue.c) */
} ferry__kv_aread;

struct ferry__kv_abatch {
    ferry__kv_aread *ready;        /* completed, not yet taken (under the tier's lock) */
    unsigned inflight;             /* submitted, not yet completed (likewise) */
};

typedef struct ferry__kv_tier_aops {
    /* chunk reads worth keeping in flight for one batch */
    unsigned depth;
    /* requests worth keeping in flight for one batch when chunks are read
     * in pieces of the tier's apiece bytes */
    unsigned pdepth;
    /* a request from the tier's pool (NULL: out of memory) / back to it */
    ferry__kv_aread *(*get)(ferry__kv_tier *t);
    void (*put)(ferry__kv_tier *t, ferry__kv_aread *r);
    /* optional: before the first piece of the chunk at loc (chunk id,
     * len bytes in all) is submitted / after its last one landed (or the
     * queue broke), whatever the outcome. begin may refuse the chunk (a
     * code with the message set: the read fails with it, nothing is
     * submitted; -EBUSY: the tier's location is still being read by an
     * earlier read, which is not the copy's failure, so the copy stays);
     * end follows every begin that returned 0, once */
    int (*begin)(ferry__kv_tier *t, uint64_t loc, const ferry_kv_hash *id, size_t len);
    void (*end)(ferry__kv_tier *t, uint64_t loc);
    /* start reading len bytes from byte off of the chunk at loc (the whole
     * chunk, or a piece of it) into dst; 0, or a code with the message set
     * and nothing started */
    int (*submit)(ferry__kv_tier *t, ferry__kv_abatch *b, ferry__kv_aread *r, uint64_t loc,
                  uint64_t off, void *dst, size_t len);
    /* optional: submit, but the len bytes land in the runs iov[0..niov)
     * in order (host memory: an engine's buffer read without a copy;
     * every run's address and length a multiple of FERRY_IO_ALIGN, len at
     * most apiece, every byte within the chunk) */
    int (*submitv)(ferry__kv_tier *t, ferry__kv_abatch *b, ferry__kv_aread *r, uint64_t loc,
                   uint64_t off, const struct iovec *iov, unsigned niov, size_t len);
    /* wait until a read of b completed: 0 and *out, every completed read
     * of b not yet taken, linked by next (NULL when b has none in flight),
     * or a negative code when the tier's queue broke (b's reads in flight
     * are lost to it: never put them back) */
    int (*wait)(ferry__kv_tier *t, ferry__kv_abatch *b, ferry__kv_aread **out);
    /* nonzero (its code) once the queue broke: no read can be started */
    int (*broken)(ferry__kv_tier *t);
    /* the chunk read from loc is chunk id and its image (chunk_bytes)
     * has checksum sum (ferry__kv_sum): 0, or FERRY_ECORRUPT with the
     * message set (FERRY_ENOTFOUND: the location was read for another
     * chunk since, no damage). NULL: the tier's reads need no check. An async read's
     * bytes count as a hit only after this passed. */
    int (*verify)(ferry__kv_tier *t, uint64_t loc, const ferry_kv_hash *id, uint64_t sum);
    /* optional, between begin and end: the bytes of the chunk at loc are
     * checked in pieces of this many bytes as they land (psum), instead
     * of whole (verify); 0: this chunk has no piece checksums */
    uint64_t (*vpiece)(ferry__kv_tier *t, uint64_t loc);
    /* the XXH3-64 (ferry__kv_sum) recorded for piece k (bytes [k * vpiece,
     * min(chunk_bytes, (k + 1) * vpiece)) of the image) of chunk id read
     * from loc: 0 and *sum, or the code that makes the chunk a miss (the
     * message set): FERRY_ECORRUPT, loc holds another chunk (damage);
     * FERRY_ENOTFOUND, loc was read for another chunk since (no damage);
     * -EINVAL, no such piece. Any thread, also after end */
    int (*psum)(ferry__kv_tier *t, uint64_t loc, const ferry_kv_hash *id, uint64_t k,
                uint64_t *sum);
} ferry__kv_tier_aops;

/*
 * What the tiers with asynchronous reads share (aqueue.c): a pool of
 * requests (the tier's struct, its ferry__kv_aread first, rd_bytes each)
 * and the leader/followers wait. mu guards the pool, every batch's ready
 * list and in-flight count, the reaper's turn and broken.
 */
typedef struct ferry__kv_aq {
    pthread_mutex_t mu;
    pthread_cond_t cv;         /* a reaper finished its turn */
    size_t rd_bytes;
    int reaping;               /* a thread is inside the tier's reap */
    int broken;                /* the queue broke: its code */
    ferry__kv_aread *free_rd, *all_rd;
} ferry__kv_aq;

void ferry__kv_aq_init(ferry__kv_aq *q, size_t rd_bytes);
/* every request in flight has landed (or the queue broke): frees them all */
void ferry__kv_aq_fini(ferry__kv_aq *q);
/* the aops get / put */
ferry__kv_aread *ferry__kv_aq_get(ferry__kv_aq *q);
void ferry__kv_aq_put(ferry__kv_aq *q, ferry__kv_aread *r);
int ferry__kv_aq_broken(ferry__kv_aq *q);
/* before submitting r for batch b: 0 (b counts it in flight), or the
 * code the queue broke with (nothing counted); leave undoes the count
 * when the submit then failed */
int ferry__kv_aq_enter(ferry__kv_aq *q, ferry__kv_abatch *b, ferry__kv_aread *r);
void ferry__kv_aq_leave(ferry__kv_aq *q, ferry__kv_abatch *b);
/* mu held: r (result and why set) is done: onto its batch's ready list */
void ferry__kv_aq_land(ferry__kv_aread *r);
/* the aops wait: b's landed requests, one thread at a time calling
 * reap(ctx) without mu (it lands what completed, under mu, and returns
 * < 0 when the queue broke); what: the tier, for the message */
int ferry__kv_aq_wait(ferry__kv_aq *q, ferry__kv_abatch *b, ferry__kv_aread **out,
                      int (*reap)(void *ctx), void *ctx, const char *what);

struct ferry__kv_tier {
    const ferry__kv_tier_ops *ops;
    const ferry__kv_tier_aops *aops;   /* NULL: reads are synchronous only */
    void *impl;
    int id;                    /* enum ferry_kv_tier */
    uint64_t slot_bytes;       /* bytes one chunk takes in this tier */
    uint64_t chunk_bytes;      /* the chunk image's bytes (<= slot_bytes; 0: not set) */
    uint64_t apiece;           /* async reads: bytes per request (0: the whole chunk) */
    uint64_t capacity;         /* chunks */
    uint64_t used;             /* chunks reserved (under kv->mu) */
    ferry__kv_policy *policy;
    /* fault seam (tests): fail the Nth read / write (1-based) with code */
    atomic_uint_fast64_t n_reads, n_writes;
    /* (atomics, read without a lock: the seam costs an I/O two loads) */
    atomic_uint_fast64_t fail_read_nth, fail_write_nth;
    atomic_int fail_code;
    atomic_int fail_sticky;
    /* counters */
    atomic_uint_fast64_t hits, evictions, bytes_written, bytes_read, failures;
    atomic_uint_fast64_t aread_peak;   /* most asynchronous reads one retrieve had in flight */
    ferry__warnlim warn;               /* its failed reads' and writes' warnings */
};

/* L1: a host pool of capacity chunks of slot_bytes (pinned through dev when set;
 * shared: in a memfd another process can map, see ferry__kv_tier_l1_fd) */
int ferry__kv_tier_l1_open(ferry_device *dev, uint64_t slot_bytes, uint64_t capacity, int shared,
                           ferry__errbuf *eb, ferry__kv_tier **out);
/* the memfd of a shared L1 pool and its size, or -1 */
int ferry__kv_tier_l1_fd(ferry__kv_tier *t, uint64_t *bytes);
/* whether the L1 pool's fill thread is still faulting it in (any thread) */
int ferry__kv_tier_l1_filling(ferry__kv_tier *t);
/* once not filling: 1 when every page of the pool is present (pinned or
 * populated by its allocation, or faulted in whole by the fill), 0 when
 * the fill stopped early (*err, if given: its errno, 0 when stopped) */
int ferry__kv_tier_l1_faulted(ferry__kv_tier *t, int *err);
/* L2: an NVMe slab of `bytes` in all, striped over dirs[0..ndirs) (one
 * per drive), through the GDS context */
int ferry__kv_tier_l2_open(const char *const *dirs, unsigned ndirs, uint64_t bytes, int direct,
                           const char *engine, unsigned mode, uint64_t chunk_bytes,
                           uint64_t slot_bytes, ferry__errbuf *eb, ferry__kv_tier **out);
void ferry__kv_tier_free(ferry__kv_tier *t);
/* register the L1 pool [pool, pool + len) with the L2 tier's drive queues
 * (fixed buffers) / undo it (a no-op when not registered); the pool must
 * outlive the registration. 0 or the context's code (message set). */
int ferry__kv_tier_l2_register(ferry__kv_tier *t, void *pool, size_t len);
void ferry__kv_tier_l2_unregister(ferry__kv_tier *t);

/* the L1 pool registered with L2 by a thread after open
 * (store/tier_l2_poolreg.c) */
enum { FERRY__KV_POOLREG_PENDING = 0, FERRY__KV_POOLREG_DONE = 1 };
typedef struct ferry__kv_poolreg {
    ferry__kv_tier *l1, *l2;
    pthread_t th;
    int on;                 /* th runs (joined by _stop) */
    atomic_int stop;
    atomic_int state;       /* PENDING, DONE, or the registration's failure (< 0) */
} ferry__kv_poolreg;
/* start registering l1's pool with l2 (a tier with reg_pool; NULL or none:
 * nothing to do): once the fill thread has faulted the pool in, on a
 * thread of its own (without one: now). Never fails: an unregistered pool
 * moves the plain way. r stays put until _stop. */
void ferry__kv_poolreg_start(ferry__kv_poolreg *r, ferry__kv_tier *l1, ferry__kv_tier *l2);
/* PENDING, DONE or the failure's code (any thread) */
int ferry__kv_poolreg_state(const ferry__kv_poolreg *r);
/* stop the thread (at once while it waits, else once the registration
 * returned), join it and undo a registration; before the tiers close and
 * after the store's I/O ended. A zeroed r is a no-op. */
void ferry__kv_poolreg_stop(ferry__kv_poolreg *r);
/* test seam: while nonzero, the thread waits before registering (until
 * it is cleared or its store closes) */
extern _Atomic unsigned ferry__kv_poolreg_test_hold;
/* test seam: after `reaps` more reaps that found completions, the next
 * reap fails with code as if the engine's queue broke, its reads still in
 * flight (they land later, into memory the tier no longer tracks) */
void ferry__kv_tier_l2_break_after(ferry__kv_tier *t, unsigned reaps, int code);
/* the remote tier: a ferry_remote on url with opt (layout and key prefix
 * already set); capacity = remote-only chunks the index may remember */
int ferry__kv_tier_remote_open(const char *url, const ferry_remote_options *opt,
                               uint64_t chunk_bytes, uint64_t slot_bytes, uint64_t capacity,
                               ferry__errbuf *eb, ferry__kv_tier **out);
/* how many of ids[0..n), counted from the first, the server has (one
 * pipelined round trip; 0 while it is down); outside kv->mu */
int ferry__kv_remote_exists(ferry__kv_tier *t, const ferry_kv_hash *ids, size_t n);
/* delete ids[0..n) on the server; how many existed, or a code */
int ferry__kv_remote_delete(ferry__kv_tier *t, const ferry_kv_hash *ids, size_t n);
/* wait until the puts queued so far were written or dropped */
int ferry__kv_remote_flush(ferry__kv_tier *t);
/* fill m's remote_* fields */
void ferry__kv_remote_counts(ferry__kv_tier *t, ferry_kv_stats *m);
/* the server key of a chunk id, without the prefix: 32 hex digits (hi
 * then lo) and a NUL; len >= 33. Returns 32 or -EINVAL. */
int ferry__kv_remote_key(const ferry_kv_hash *id, char *buf, size_t len);

/* ---- eviction policies ---- */
typedef int (*ferry__kv_evictable_fn)(ferry__kv_entry *e, void *ctx);

typedef struct ferry__kv_policy_ops {
    const char *name;
    int (*init)(ferry__kv_policy *p, uint64_t capacity);
    void (*fini)(ferry__kv_policy *p);
    void (*insert)(ferry__kv_policy *p, ferry__kv_entry *e);   /* became resident */
    void (*touch)(ferry__kv_policy *p, ferry__kv_entry *e);    /* was used */
    void (*remove)(ferry__kv_policy *p, ferry__kv_entry *e);   /* left, not by eviction */
    /* choose a victim that ok() accepts and unlink it; NULL when none */
    ferry__kv_entry *(*victim)(ferry__kv_policy *p, ferry__kv_evictable_fn ok, void *ctx);
} ferry__kv_policy_ops;

struct ferry__kv_policy {
    const ferry__kv_policy_ops *ops;
    int tier;                  /* which node[] of the entry is ours */
    uint64_t capacity;
    void *state;
};

extern const ferry__kv_policy_ops ferry__kv_policy_lru;
extern const ferry__kv_policy_ops ferry__kv_policy_s3fifo;
int ferry__kv_policy_create(int policy, int tier, uint64_t capacity, ferry__kv_policy **out);
void ferry__kv_policy_destroy(ferry__kv_policy *p);

/* intrusive doubly linked list over node[tier] (used by the policies) */
typedef struct ferry__kv_list {
    ferry__kv_entry *head, *tail;
    uint64_t count;
} ferry__kv_list;
void ferry__kv_list_push_head(ferry__kv_list *l, int tier, ferry__kv_entry *e);
void ferry__kv_list_unlink(ferry__kv_list *l, int tier, ferry__kv_entry *e);

/* ---- hashing ---- */
/* chained chunk hashes; returns the number of chunks; writes min(that, max) */
size_t ferry__kv_hash_chain(uint64_t seed, const int32_t *tokens, size_t n, uint32_t chunk_tokens,
                            int partial, ferry_kv_hash *out, size_t max);
/* hash chunks [first, first + count) of tokens[0..n), chaining from *prev
 * (chunk first - 1's hash; zeros before chunk 0), which is updated */
void ferry__kv_hash_step(uint64_t seed, const int32_t *tokens, size_t n, uint32_t chunk_tokens,
                         size_t first, size_t count, ferry_kv_hash *prev, ferry_kv_hash *out);
/* the namespace digest of (model, rank, world, salt) */
ferry_kv_hash ferry__kv_namespace(uint64_t seed, const char *model, uint32_t rank,
                                  uint32_t world, const void *salt, size_t salt_len);

/* ---- moving a chunk between an engine buffer and host memory ---- */
/* take the caller's buffer `in` (any size it may have) into *buf, whole:
 * later members defaulted, a paged buffer's strides made explicit; and
 * validate it against layout and n tokens; 0 or a code with a message in
 * eb (*buf is what every later step reads) */
int ferry__kv_buffer_take(const ferry_kv_buffer *in, ferry_kv_buffer *buf,
                          const ferry_kv_layout *layout, ferry_device *dev, size_t n,
                          const char *what, ferry__errbuf *eb);
/*
 * Copy tokens [tok0, tok0 + ntok) between buf and a chunk image at host
 * address chunk (layout [kv][layers][chunk_tokens][token bytes]). to_chunk:
 * buf -> chunk. Device buffers: queued on s as one batch (the caller syncs
 * it). Returns the device driver calls it took (0 for host buffers) or a
 * negative code.
 */
int ferry__kv_xfer(const ferry_kv_buffer *buf, uint32_t chunk_tokens, uint64_t tok0,
                   uint32_t ntok, void *chunk, int to_chunk, ferry_stream *s, ferry__errbuf *eb);
/* one chunk of a layer-by-layer copy: its tokens [tok0, tok0 + ntok) and
 * the image address of tok0 (the chunk's image + that token's offset) */
typedef struct ferry__kv_lchunk {
    uint64_t tok0;
    uint32_t ntok;
    unsigned char *img;
} ferry__kv_lchunk;
/* ferry__kv_xfer of one layer (its K and V planes) of each of ch[0..nch):
 * device buffers: queued on s as one batch for all of them */
int ferry__kv_xfer_layer(const ferry_kv_buffer *buf, uint32_t chunk_tokens,
                         const ferry__kv_lchunk *ch, size_t nch, uint32_t layer, int to_chunk,
                         ferry_stream *s, ferry__errbuf *eb);
/* count one chunk moved by ferry__kv_xfer in `calls` driver calls
 * (device buffers only) */
void ferry__kv_count_device_copy(ferry_kv *kv, const ferry_kv_buffer *buf, int calls);
/* the part of chunk i (its ntok tokens from i * chunk_tokens) at or past
 * token skip: its first token and count (0: it lies wholly below skip)
 * and that token's offset in the chunk image's planes, in bytes */
/* a request's skip_tokens (0 when its size does not reach it), and a full
 * copy of a request that may be an older, shorter one */
uint64_t ferry__kv_req_skip(const ferry_kv_req *req);
void ferry__kv_req_copy(ferry_kv_req *dst, const ferry_kv_req *req);
typedef struct ferry__kv_span {
    uint64_t tok0;
    uint32_t ntok;
    uint64_t img_off;
} ferry__kv_span;
ferry__kv_span ferry__kv_span_from(const ferry_kv_layout *l, uint32_t chunk_tokens, size_t i,
                                   uint32_t ntok, uint64_t skip);
/* the runs of that copy, in the chunk image's address order: fn(ctx, the
 * buffer's address, the image's, length); stops at fn's first failure */
typedef int (*ferry__kv_run_fn)(void *ctx, uint64_t addr, unsigned char *img, uint64_t len);
int ferry__kv_xfer_walk(const ferry_kv_buffer *buf, uint32_t chunk_tokens, uint64_t tok0,
                        uint32_t ntok, void *chunk, ferry__kv_run_fn fn, void *ctx);

/* bytes of one token of one (kv, layer) plane: heads x head_dim x dtype */
static inline uint64_t ferry__kv_token_bytes(const ferry_kv_layout *l)
{
    return (uint64_t)l->num_heads * l->head_dim * ferry_dtype_size(l->dtype);
}

/* bytes [a, b) of a chunk image (whole tokens: multiples of a token's
 * bytes in one plane) into a HOST buffer, which holds the chunk's tokens
 * from tok0: the part of a chunk that landed and was checked */
int ferry__kv_xfer_out_range(const ferry_kv_buffer *buf, uint32_t chunk_tokens, uint64_t tok0,
                             const void *chunk, uint64_t a, uint64_t b);

/* (hash_share: the part of the wall time spent hashing, 0..1: how the
 * call's CPU time splits between checking and copying) */
/* the non-persistent L2 checks chunk images over this many bytes (2 MiB)
 * in pieces of it; read when a tier opens (a test seam) */
extern uint64_t ferry__kv_l2_check_piece;
/* a test seam (NULL but in tests): called by a prefetch stream
 * (store_aprefetch.c) as it checks a chunk that landed, with its reads in
 * flight then, the most it keeps in flight, and whether reads of the
 * group remain to be sent */
extern void (*ferry__kv_aprefetch_on_check)(ferry_kv *kv, unsigned inflight, unsigned depth,
                                            int more);
/* a test seam (NULL but in tests): called by a prefetch stream as it
 * checks bytes bytes of a chunk that landed, whole (its whole sum: a chunk
 * without piece sums) or one check piece */
extern void (*ferry__kv_aprefetch_on_verify)(ferry_kv *kv, uint64_t bytes, int whole);

/* ---- chunk checksums (sum.c) ---- */
/* XXH3-64 of n bytes, on the widest vector unit the CPU has */
uint64_t ferry__kv_sum(const void *p, size_t n);
/*
 * A whole chunk (ntok == chunk_tokens) from its image in host memory into
 * a HOST buffer, checksumming the image as it is copied (each block is
 * hashed, then copied while it is still in the CPU's cache): *sum is then
 * ferry__kv_sum(chunk, the image's bytes). The runs of a whole chunk cover
 * its image in order, which is what makes the two equal.
 */
int ferry__kv_xfer_out_sum(const ferry_kv_buffer *buf, uint32_t chunk_tokens, uint64_t tok0,
                           const void *chunk, uint64_t *sum);
/*
 * One piece of a chunk image that landed: *sum gets the XXH3-64 of image
 * bytes [c0, c1), and image bytes [o0, o1) (whole tokens; o0 == o1: none)
 * are copied into the HOST buffer buf (which holds the chunk's tokens
 * from tok0) as the hash goes, each block copied just after it was
 * hashed, while it is in the CPU's cache. The copy may run ahead of the
 * check: a caller whose check fails zeroes what was copied.
 */
void ferry__kv_piece_out(const ferry_kv_buffer *buf, uint32_t chunk_tokens, uint64_t tok0,
                         const void *chunk, uint64_t c0, uint64_t c1, uint64_t o0, uint64_t o1,
                         uint64_t *sum, double *hash_share);
/* a run of a chunk image that lies in a HOST buffer: image bytes [img,
 * img + len) at addr */
typedef struct ferry__kv_run {
    uint64_t img, addr, len;
} ferry__kv_run;
/* XXH3-64 of image bytes [a, b) where they lie in the buffer: runs[0..n)
 * in image order, back to back from image byte 0 (what ferry__kv_sum
 * gives over the same bytes of the image) */
uint64_t ferry__kv_sum_runs(const ferry__kv_run *runs, size_t n, uint64_t a, uint64_t b);
/* zero tokens [tok0, tok0 + ntok) of a HOST buffer: what a chunk copied
 * out by ferry__kv_xfer_out_sum leaves behind when its check failed */
void ferry__kv_xfer_out_zero(const ferry_kv_buffer *buf, uint32_t chunk_tokens, uint64_t tok0,
                             uint32_t ntok);

/* ---- the store ---- */
enum {
    FERRY__KV_JOB_OP = 1,
    FERRY__KV_JOB_L2WRITE = 2,
    FERRY__KV_JOB_PREFETCH = 3,
    FERRY__KV_JOB_RWRITE = 4, /* write-through to the remote tier from the L1 slot */
    FERRY__KV_JOB_COPY = 5    /* a retrieve's copy-out of one chunk to a host buffer */
};
enum { FERRY__KV_OP_STORE = 1, FERRY__KV_OP_RETRIEVE = 2 };

typedef struct ferry__kv_job {
    struct ferry__kv_job *next;
    int kind;                  /* which queue (OP: the operations'), and for reading */
    /* what a worker does with it (then frees it): the pool calls only this */
    void (*run)(ferry_kv *kv, struct ferry__kv_job *j);
    ferry_kv_op *op;           /* JOB_OP */
    ferry__kv_entry *e;        /* L2WRITE / PREFETCH: held (refs, readers) */
    uint64_t l1_loc, l2_loc;
    int src_tier;              /* PREFETCH: the tier read from */
    int ahead;                 /* PREFETCH: a retrieve's read-ahead (kept once landed) */
    struct ferry__kv_job *group; /* PREFETCH from an async tier: the next of its group */
    struct ferry__kv_cut *cut; /* PREFETCH for a daemon's connection: its cut (a reference,
                                  dropped as it lands), else NULL */
    void (*copy)(void *ctx, size_t idx); /* COPY: run copy(ctx, idx) */
    void *ctx;
    size_t idx;
} ferry__kv_job;

struct ferry_kv_op {
    ferry_kv *kv;
    long maker; /* ferry__pid() of the process that made it (its store's opener) */
    int kind;
    ferry_kv_hash *ids;
    size_t nchunks, n;
    ferry_kv_req req;
    ferry_kv_buffer buf;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int done;
    int result;
    atomic_int cancel; /* ferry_kv_op_cancel asked it to stop */
    struct ferry__kv_lw *lw; /* a layerwise op's state (kv_layers.h), else NULL */
    /* op.c, under its process-wide lock: the owner's reference (until
     * ferry_kv_op_free) plus one per call inside the op; the store's list
     * of its live ops; kv is NULL once the store closed (orphaned) */
    unsigned refs;
    int freed;
    int handed; /* its caller has it (ferry__kv_op_hand): made in full */
    struct ferry_kv_op *lprev, *lnext;
};

/* op.c: a new op of kv (refs 1, on kv's list, not started), or NULL (no
 * memory); ids copied. The layerwise part is attached by the caller. */
ferry_kv_op *ferry__kv_op_new(ferry_kv *kv, int kind, const ferry_kv_hash *ids, size_t nchunks,
                              size_t n, const ferry_kv_req *req, const ferry_kv_buffer *buf);
/* a call on op begins: its reference taken, and a call on its store when
 * the store is open and not closing. Returns that store, or NULL when the
 * call must not touch it (closing or closed): the op's own state only. */
ferry_kv *ferry__kv_op_enter(ferry_kv_op *op);
/* 0 in the process that made op; in a fork of it FERRY_ESTATE with a
 * message naming both processes (op call `what`), op untouched: checked
 * before ferry__kv_op_enter (op's locks may have been held at the fork,
 * its end comes from workers the child lacks) */
int ferry__kv_op_forked(const ferry_kv_op *op, const char *what);
/* the call that entered with kv ends (drops = references it gives back) */
void ferry__kv_op_leave(ferry_kv_op *op, ferry_kv *kv, unsigned drops);
/* the call that made op hands it to its caller: from now on close's early
 * abandonment may end it (before, that call still fills it in) */
void ferry__kv_op_hand(ferry_kv_op *op);
/* close, once new calls are refused: abandon every layerwise store of kv
 * still lacking layers, handed to its caller, that no call is inside (-ECANCELED, its slots given
 * back, as a cancel does) while the workers run, so an op waiting for an
 * L1 slot gets one before close waits for it and for the calls inside (a
 * thread waiting on that op) */
void ferry__kv_ops_abandon(ferry_kv *kv);
/* close: finish and detach every op of kv still alive (no call is inside
 * the store and no worker runs); an op nobody holds any more is freed */
void ferry__kv_ops_orphan(ferry_kv *kv);

/* guard.c: a public call on kv begins: 0, or FERRY_ESTATE (with a
 * message) when the store is closing or this process is a fork of its
 * opener. Every 0 is paired with a leave. */
int ferry__kv_enter(ferry_kv *kv, const char *what);
/* guard.c: 0 in the process that opened kv; in a fork of it FERRY_ESTATE
 * with a message naming both processes (call `what`), kv untouched but
 * for its last error */
int ferry__kv_forked(ferry_kv *kv, const char *what);
void ferry__kv_leave(ferry_kv *kv);
/* close: refuse new calls (the calls inside go on) */
void ferry__kv_refuse_calls(ferry_kv *kv);
/* ferry_kv_close_begin: refuse new calls on the store, not on its ops */
void ferry__kv_refuse_store_calls(ferry_kv *kv);
/* close: refuse new calls, then wait until no call is inside */
void ferry__kv_close_wait(ferry_kv *kv);
/* the body of public call `what` on kv: NULL refused, then expr evaluated
 * inside the call guard (enter, expr, leave); returns its result */
#define FERRY__KV_CALL(kv, what, expr)                                          \
    do {                                                                        \
        if (!(kv))                                                              \
            return ferry__err_set(NULL, -EINVAL, "kv %s: store is NULL", what); \
        int call_rc_ = ferry__kv_enter((kv), (what));                           \
        if (call_rc_ == 0) {                                                    \
            call_rc_ = (expr);                                                  \
            ferry__kv_leave(kv);                                                \
        }                                                                       \
        return call_rc_;                                                        \
    } while (0)

/* the cancel flag of the async operation this thread runs (NULL when it
 * runs none), and whether it is set */
const atomic_int *ferry__kv_cancel_flag(void);
static inline int ferry__kv_cancelled(const atomic_int *f)
{
    return f && atomic_load_explicit(f, memory_order_acquire);
}

typedef struct ferry__kv_hist {
    atomic_uint_fast64_t b[FERRY_KV_HIST_BUCKETS];
    atomic_uint_fast64_t sum_ns;
} ferry__kv_hist;

struct ferry_kv {
    ferry__errbuf err;             /* last failure; written under err_mu */
    pthread_mutex_t err_mu;
    long opener;                   /* ferry__pid() at open: a fork's child is not it */
    char *model;
    uint32_t tp_rank, tp_world;
    ferry_kv_layout layout;
    uint32_t chunk_tokens;
    uint64_t seed;
    uint64_t chunk_bytes, slot_bytes;
    /* layers_stage.c: the staged images a layerwise store gave back last,
     * kept (faulted in, pinned with lw_idle_dev or not) for the next long
     * one while no larger than lw_keep (the L1 pool's bytes; through a
     * server, the daemon's pool's, once known); under lw_mu */
    pthread_mutex_t lw_mu;
    unsigned char *lw_idle;
    size_t lw_idle_bytes;
    ferry_device *lw_idle_dev;
    _Atomic uint64_t lw_keep;
    ferry_kv_hash ns0;             /* namespace digest without salt */
    ferry_device *dev;
    double watermark, low;
    uint64_t write_ttl_ns, read_ttl_ns;
    ferry__kv_clock_fn clock;
    void *clock_ctx;

    pthread_mutex_t mu;            /* see the top of this file */
    pthread_cond_t loaded;         /* a promotion or a write-through finished */
    ferry__kv_entry **buckets;
    uint64_t nbuckets, count;
    ferry__kv_entry *doomed;
    ferry__kv_tier *tier[FERRY_KV_TIERS];
    ferry__kv_poolreg l2reg;       /* the L1 pool registered with L2 after open */
    ferry_stream **streams;        /* idle streams (under mu) */
    unsigned nstreams, cap_streams;
    uint64_t prefetch_inflight, prefetch_max;
    uint64_t handoff_min;          /* the smallest chunk whose copy-out goes to a worker
                                      (store_retrieve.c; a test seam sets it) */
    uint64_t l2_writes_inflight;   /* write-throughs (L2 or remote) holding an L1 slot */
    uint64_t l1_reading;           /* L1 slots reserved for retrieves' async reads in flight */
    uint64_t l1_retired;           /* L1 slots a broken read queue may still write: never reused */
    uint64_t *l1_gen;              /* per L1 slot: reservations so far (a server client's lock
                                      names the generation it saw: a reused slot never passes) */
    const struct ferry__kv_backend *be; /* the backend every call goes to (backend.h) */
    void *be_impl;                 /* its state beyond the store (a server's client), or NULL */
    /* back-pressure (store_reserve.c): how long a caller holding no L1 slot
     * waits for one, and the callers waiting, first come first served
     * (under mu; woken through `loaded`) */
    uint64_t pool_wait_ns;
    struct ferry__kv_waiter *wq_head, *wq_tail;
    atomic_uint_fast64_t pool_waits, pool_wait_ns_total, pool_declines;

    /* guard.c: public calls inside the store now, and close's refusal of
     * new ones (call_mu); op.c: the live ops (its own lock) */
    pthread_mutex_t call_mu;
    pthread_cond_t call_cv;
    uint64_t calls;
    int closing;
    int refusing;                  /* ferry_kv_close_begin: new calls on the store are
                                      refused; calls on its ops go on until the close */
    /* ferry_kv_close_begin was called: waits for L1 slots end (-ECANCELED;
     * store_reserve.c, a server client's client.c); set once, never cleared */
    atomic_int close_begun;
    struct ferry_kv_op *ops;

    /* workers: q[0] runs async operations (which may wait for a chunk's
     * promotion), q[1] runs write-throughs and prefetch reads (which never
     * wait for anything but kv->mu), so an operation never waits on work
     * stuck behind it in its own queue */
    pthread_mutex_t qmu;
    pthread_cond_t idle;
    struct ferry__kv_queue {
        ferry__kv_job *head, *tail;
        /* copies lent to this queue's idle workers (async.c: ferry__kv_lend),
         * taken before head; nlent of them, never more than workers idle */
        ferry__kv_job *lhead, *ltail;
        unsigned nlent;
        pthread_cond_t cv;
        unsigned active;
        /* withdrawals (ferry__kv_withdraw) whose jobs are still being
         * dropped by their withdrawer: flush and close wait for them too */
        unsigned withdrawing;
        pthread_t *threads;
        unsigned nthreads;
        ferry_kv *kv;
    } q[2];
    int stopping;

    /* counters */
    atomic_uint_fast64_t lookups, lookup_tokens, hit_tokens, stores, stored_chunks,
        stored_bytes, retrieves, retrieved_chunks, retrieved_bytes, misses, prefetched,
        deleted, failures, alloc_failures, lock_expired;
    atomic_uint_fast64_t ahead_dropped; /* read-ahead dropped unread: its connection was cut */
    atomic_uint_fast64_t corrupt; /* chunks read from below L1 that failed their check */
    atomic_uint_fast64_t device_chunks, device_calls; /* device buffer <-> L1 moves */
    ferry__kv_hist h_lookup, h_store, h_retrieve;
    ferry__kv_hist h_first_bytes, h_first_chunk; /* a retrieve's first chunk from L2 */
    atomic_uint_fast64_t rt_check_ns, rt_copy_ns; /* a retrieve's checks and copy-outs */
    atomic_uint_fast64_t rt_handed; /* piece checks a retrieve handed to a worker */
};

/* record a failure on the store (and the thread), under err_mu; returns code
 * (kv NULL: the thread only) */
int ferry__kv_err(ferry_kv *kv, int code, const char *fmt, ...) FERRY__PRINTF(3, 4);
/* copy the thread's last message onto the store; returns code */
int ferry__kv_err_pass(ferry_kv *kv, int code);

/* store.c: the operations behind the blocking and async calls */
int ferry__kv_do_store(ferry_kv *kv, const ferry_kv_hash *ids, size_t nchunks, size_t n,
                       const ferry_kv_req *req, const ferry_kv_buffer *buf);
int ferry__kv_do_retrieve(ferry_kv *kv, const ferry_kv_hash *ids, size_t nchunks, size_t n,
                          const ferry_kv_req *req, const ferry_kv_buffer *buf);
/* finish a job's L2 write or prefetch read (store_promote.c) */
void ferry__kv_job_run(ferry_kv *kv, ferry__kv_job *j);
/* a prefetch job's read finished with rc: PROMOTE its slot (or drop the
 * copy that failed), or, when the failure was not the copy's (a broken
 * queue, memory), RELEASE the slot or RETIRE it (a read may still land
 * there) keeping the copy; then the job's locks and budget go */
enum { FERRY__KV_LAND_PROMOTE = 0, FERRY__KV_LAND_RELEASE = 1, FERRY__KV_LAND_RETIRE = 2,
       FERRY__KV_LAND_DROP = 3 /* never read: its connection was cut (not a failure) */ };
/* whether j is read-ahead for a daemon connection that was cut since */
static inline int ferry__kv_ahead_gone(const ferry__kv_job *j)
{
    return j->cut && atomic_load_explicit(&j->cut->why, memory_order_acquire);
}
void ferry__kv_prefetch_land(ferry_kv *kv, ferry__kv_job *j, int rc, int how);
/* store_aprefetch.c: queue prefetch jobs (linked by next); those reading
 * from a tier with asynchronous reads go as one group when leading != 0
 * (a retrieve's own read-ahead, leading 0, skips such tiers) */
void ferry__kv_prefetch_queue(ferry_kv *kv, ferry__kv_job *head, int leading);
/* async.c: wait until no job is queued or running and the tiers' own
 * queues drained (ferry_kv_flush without the call guard) */
int ferry__kv_flush(ferry_kv *kv);
/* async.c: start/stop the workers, queue a job */
int ferry__kv_workers_start(ferry_kv *kv, unsigned n);
void ferry__kv_workers_stop(ferry_kv *kv);
void ferry__kv_enqueue(ferry_kv *kv, ferry__kv_job *j);
/* async.c: take the I/O queue's jobs that match out of it, in order (linked
 * by next): the caller runs their end itself, as a worker would, then
 * calls ferry__kv_withdraw_end when it took any (non-NULL): until then the
 * store is not idle (flush and close wait for those jobs as for a worker's) */
ferry__kv_job *ferry__kv_withdraw(ferry_kv *kv, int (*match)(const ferry__kv_job *, void *),
                                  void *ctx);
void ferry__kv_withdraw_end(ferry_kv *kv);
/* 1 when a job queued now runs at once or right after the caller's own:
 * nothing queued, and an I/O worker free or mine (> 0, fewer than the
 * workers) of the caller's jobs running or queued. A retrieve's copy-out
 * never waits behind write-throughs or prefetch reads */
int ferry__kv_io_worker_free(ferry_kv *kv, unsigned mine);
/* an operation worker is idle with nothing queued for it (a hint: it may
 * be gone by the time a job is ready; ferry__kv_lend decides) */
int ferry__kv_op_worker_free(ferry_kv *kv);
/* lend the copy job j to an idle operation worker: 1 when it was queued,
 * 0 (nothing queued) when no operation worker is idle and not already
 * promised to an earlier lent copy, or operations are queued. A lent copy
 * is taken before any operation, and an operation is only started while
 * every lent copy still has an idle worker of its own: operations may wait
 * for what a lent copy finishes (the chunk it checks and promotes, the
 * lender's own copies), so it must never queue behind them. */
int ferry__kv_lend(ferry_kv *kv, ferry__kv_job *j);
void ferry__kv_hist_record(ferry__kv_hist *h, uint64_t ns);

/* ---- test seams ---- */
/* the references an op holds now (owner + calls inside); calls inside kv */
unsigned ferry__kv_op_refs(ferry_kv_op *op);
uint64_t ferry__kv_calls(ferry_kv *kv);
/* the smallest chunk whose retrieve copy-out is handed to a worker (0:
 * every chunk's, as a test of the hand-off wants) */
void ferry__kv_set_handoff_min(ferry_kv *kv, uint64_t bytes);
/* replace the store's clock (lock TTLs); NULL restores the monotonic clock */
void ferry__kv_set_clock(ferry_kv *kv, ferry__kv_clock_fn fn, void *ctx);
/* fail the nth (1-based, from now) read or write of tier `tier` with code;
 * sticky: and every later one; nth 0 clears */
/* direct reads into a host buffer (store_rdirect.c): 0 never, 1 into any
 * aligned buffer, 2 only into huge pages (the default; FERRY_KV_DIRECT
 * sets it for the process); a test seam */
void ferry__kv_set_direct_mode(int mode);
void ferry__kv_set_tier_fault(ferry_kv *kv, int tier, int write, uint64_t nth, int code,
                              int sticky);
/* place WRITING entries for the chunks of tokens as a writer that died
 * before finishing would leave them (slot reserved, nobody holding them);
 * returns the number placed */
int ferry__kv_test_abandon_write(ferry_kv *kv, const int32_t *tokens, size_t n,
                                 const ferry_kv_req *req);
/* walk the index and the tiers: counts agree, every resident chunk is in
 * its policy, no free slot is used twice. 0 or FERRY_ECORRUPT + message */
int ferry__kv_check(ferry_kv *kv);
/* the state of the chunk with chunk hash h under salt (ns applied inside):
 * -1 absent, else FERRY__KV_* state; *resident and *readers when non-NULL */
int ferry__kv_chunk_state(ferry_kv *kv, ferry_kv_hash h, const void *salt, size_t salt_len,
                          uint8_t *resident, uint32_t *readers);

#endif
