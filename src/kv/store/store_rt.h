/*
 * store_rt.h - one retrieve's state, shared by its pipeline
 * (store_retrieve.c) and its piece-mode checks and copies (store_rpiece.c).
 * Private to the store.
 */
#ifndef FERRY_SRC_KV_STORE_RT_H
#define FERRY_SRC_KV_STORE_RT_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#include "kv/kv_impl.h"


/*
 * One retrieve. Chunks resolve in any order: a chunk whose bytes are in L1
 * (or on their way there by another operation) is copied out in prompt
 * order; a chunk only in a tier with asynchronous reads (L2, and the
 * persistent L2 when its chunk images fill their slots) gets an L1
 * slot and is read into it, whole or in the tier's pieces, in prompt
 * order, several requests in flight at once (the tier's depth), and is
 * copied out as soon as its last piece lands, whatever the order, while
 * the later reads go on. Chunks only in a tier without them (the remote,
 * a persistent slab of padded images) are read ahead on the I/O workers
 * (prefetch jobs) and copied out in order.
 */
enum { RT_OPEN = 0, RT_READING = 1, RT_LANDED = 2, RT_DONE = 3 };

/* what a retrieve knows of one chunk of its prompt */
typedef struct rt_chunk {
    ferry__kv_entry *held;      /* read-locked while a copy may still read its slot */
    ferry__kv_entry *pend;      /* RT_READING: the entry (read-locked, referenced) */
    uint64_t slot;              /* RT_READING: the L1 slot the read lands in */
    int st;                     /* its answer: 0, or why it is not retrieved */
    uint8_t fate;               /* RT_* */
    uint8_t lost;               /* RT_LANDED: lost with a broken queue: 1 pieces may
                                   still land (its L1 slot is never reused), 2 none
                                   was in flight */
    uint8_t begun;              /* the tier's begin was called and its end is due */
    int res;                    /* RT_READING: its first failure; RT_LANDED: the read's result */
    /* RT_READING: pieces sent (npieces: all, or no more after a failure),
     * pieces in flight, where from and where to */
    uint32_t sent, left;
    uint64_t aloc;
    char *adst;
    const void *csrc;           /* its L1 bytes, for a worker's copy */
    /* piece mode (the tier checks its pieces, vpiece): each run of vp
     * bytes is checked as soon as it landed (lp: bytes landed back to back
     * from byte 0; cdone: bytes handed to checks), and with pcopy copied
     * out after its check (odone: image bytes handed to copies), so a
     * chunk's check and copy end with its last piece, not after it */
    uint64_t vp, lp, cdone, odone;
    uint32_t nlp;               /* read pieces landed back to back */
    uint8_t pcopy;
    /* with pcopy (under cmu): 0 no copy decided yet, 1 copying (a cancel
     * then lets the chunk's copy finish: it is moved whole or zeroed), 2
     * cancelled before its first copy (untouched) */
    uint8_t pstate;
    uint8_t froml2;             /* read from the async tier: its copy-out counts as arrival */
    unsigned pjobs;             /* its checks on workers (under cmu) */
    int pbad;                   /* its first failed check (under cmu) */
    /* direct (store_rdirect.c): read straight into the engine's host
     * buffer, whose runs hold the image (runs[0..nruns), image order;
     * rcur: the first not yet wholly sent), no L1 slot; vwhole: checked
     * whole (no piece sums), as one unit once all of it landed; dstop: a
     * cancel stopped its reads part-way; dsub: a read of it was started
     * (the buffer may hold some of it) */
    ferry__kv_run *runs;
    uint32_t nruns, rcur;
    uint8_t direct, vwhole, dstop, dsub;
} rt_chunk;

typedef struct rtv {
    ferry_kv *kv;
    const ferry_kv_buffer *buf;
    ferry_stream *s;
    size_t nch, n;
    rt_chunk *c;                /* per chunk of the prompt */
    size_t *hidx;               /* the chunks held, nheld of them */
    uint8_t *plnd;              /* per chunk and read piece: landed (piece mode) */
    uint8_t *ahead;             /* per chunk: the tier a worker read-ahead was queued from
                                   (ferry__kv_prefetch_ids fills it) */
    char (*why)[FERRY__ERRMSG_MAX]; /* each chunk's first failure (allocated on the first) */
    size_t cur;                 /* the chunk with pieces still to send, or SIZE_MAX */
    uint64_t piece;             /* bytes per request */
    uint32_t npieces;           /* requests per chunk */
    unsigned reading;           /* chunks RT_READING */
    unsigned pdepth;            /* requests kept in flight */
    /* requests in flight for now: one at first, doubled as each lands up
     * to pdepth, so the first piece lands after one piece's read (not
     * after all of them, sharing the drive) and is checked and copied out
     * while the queue fills */
    unsigned ramp;
    /* until the first chunk read from the async tier landed, no other
     * chunk's read starts: the first chunk has the drive to itself (with
     * the ramp, chunk 1's pieces would share it and land it later) */
    int first_hold;
    uint64_t hits[FERRY_KV_TIERS], misses, got;
    int copy_rc;
    size_t nheld, batch_max;
    ferry__kv_tier *at;         /* the tier whose reads are asynchronous, or NULL */
    ferry__kv_abatch batch;
    unsigned inflight, depth;   /* requests in flight; chunks read at once */
    /* host copy-outs handed to an idle I/O or operation worker, so other
     * CPUs copy while the next reads are in flight: under cmu, the copies'
     * outcome (st, got, copy_rc) and how many are pending */
    int wcopy;                  /* copies may go to a worker */
    pthread_mutex_t cmu;
    pthread_cond_t ccv;
    unsigned wpending;
    uint64_t vbad;              /* chunks counted as hits that failed their check */
    const atomic_int *cancel;   /* the async op's cancel flag, or NULL */
    uint64_t skip;              /* tokens below this are the engine's: never written */
    unsigned ncancel;           /* chunks not copied out because of it (under cmu) */
    ferry__kv_waiter wt;        /* back-pressure: waiting for a slot to promote into */
    int declined;               /* a wait ran out: later chunks decline at once */
    uint64_t t0;                /* when it began */
    /* since t0: the first bytes / whole chunk from the async tier in the
     * engine's buffer, checked (0: none yet) */
    atomic_uint_fast64_t first_bytes, first_chunk;
    /* piece-mode checks queued as their pieces land, run by the
     * retrieving thread before it next waits for reads; only what is
     * queued beyond a chunk's pieces goes to free workers, once the reads
     * are topped up (store_rpiece.c says why) */
    struct rt_unit *uq, *uq_tail;
    uint64_t qbytes;            /* the bytes the queued checks cover */
    uint64_t dgot;              /* chunks read straight into the buffer (not out of L1) */
    struct iovec *iov;          /* a direct piece's runs, while it is submitted */
    unsigned iov_cap;
    /* direct reads: no two tokens the retrieve writes share a byte of the
     * buffer (1), some do (2: none is read directly), not asked yet (0) */
    int dapart;
} rtv;

/* *at, once: the time since the retrieve began */
static inline void rt_first(rtv *r, atomic_uint_fast64_t *at)
{
    if (atomic_load_explicit(at, memory_order_relaxed))
        return;
    uint_fast64_t z = 0, t = ferry__now_ns() - r->t0;
    atomic_compare_exchange_strong(at, &z, t ? t : 1);
}

/* the calling thread's CPU ns since t (ferry__thread_cpu_ns), into one
 * of the retrieve's CPU counters */
static inline void rt_spent(atomic_uint_fast64_t *c, uint64_t t)
{
    atomic_fetch_add_explicit(c, ferry__thread_cpu_ns() - t, memory_order_relaxed);
}

/* a copy failed (the first failure's code), read safely while a worker copies */
int ferry__kv_rt_failed(rtv *r);
/* chunk i's job(ctx, i) queued on a free worker: 1; 0: none is free, the
 * caller runs it (see store_retrieve.c) */
int ferry__kv_rt_hand_off(rtv *r, size_t i, void (*job)(void *ctx, size_t i), void *ctx);

/* ---- piece mode (store_rpiece.c) ---- */
/* chunk i's read begins: whether its pieces are checked as they land */
void ferry__kv_rt_piece_mode(rtv *r, size_t i);
/* read piece k of piece-mode chunk i landed */
void ferry__kv_rt_piece_landed(rtv *r, size_t i, uint32_t k);
/* the queued checks handed to free workers (called once the reads are
 * topped up); those no worker took stay queued */
void ferry__kv_rt_units_hand(rtv *r);
/* the queued checks handed to free workers, the rest run here (the
 * retrieving thread) */
void ferry__kv_rt_units_run(rtv *r);
/* its read is over: its checks waited for; the first that failed, or 0 */
int ferry__kv_rt_pieces_done(rtv *r, size_t i);
/* it passed and was copied out as it landed: promoted, counted */
void ferry__kv_rt_pieces_finish(rtv *r, size_t i, ferry__kv_entry *e);

/* ---- direct reads into a host buffer (store_rdirect.c) ---- */
/* chunk i, only in the async tier, may be read straight into the buffer:
 * its runs planned (c->runs, c->direct), 1; else 0 (the L1 path) */
int ferry__kv_rt_direct_plan(rtv *r, size_t i);
/* its runs freed, direct cleared (also for a chunk not started) */
void ferry__kv_rt_direct_drop(rtv *r, size_t i);
/* image bytes [off, off + len) of direct chunk i read (request a) */
int ferry__kv_rt_direct_submit(rtv *r, size_t i, ferry__kv_aread *a, uint64_t off, size_t len);
/* image bytes [c0, c1) of direct chunk i landed: checked in the buffer */
void ferry__kv_rt_direct_check(rtv *r, size_t i, const ferry_kv_hash *id, uint64_t c0,
                               uint64_t c1);
/* its read is over with rc (entry e): its checks waited for; exact and
 * counted, or zeroed (a miss, or cancelled); e unlocked */
void ferry__kv_rt_direct_done(rtv *r, size_t i, ferry__kv_entry *e, int rc);

#endif
