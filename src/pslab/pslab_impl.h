/*
 * pslab_impl.h - what the pieces of the persistent slab share (private):
 * the handle, its I/O lanes and pending batches, and the functions one
 * file offers the others.
 *
 *  pslab_lane.c     error helpers, file paths, I/O lanes, striped data I/O
 *  pslab_commit.c   entries' release, the pending batch, group commit, the
 *                   batch flusher, reclaim by commit, ferry_pslab_sync
 *  pslab_compact.c  journal compaction
 *  pslab_recover.c  checking the slab files against the options and each
 *                   other, journal replay and what it found (damage, torn
 *                   tails)
 *  pslab_open.c     options, create, reset, open and close
 *  pslab.c          put, get, delete, forget, stat, iterate, verify, stats
 *  pslab_fmt.c      the on-disk format, the index and the replay (memory only)
 *
 * Invariants, and why:
 *  - A journal record reaches the disk only after the bytes it names do:
 *    a commit fdatasyncs the slab files before it appends the batch's
 *    records, then fdatasyncs the journal, and only then reports the batch
 *    durable (SYNC_FULL). So every acknowledged put is intact after a crash,
 *    and a record whose data was lost can only belong to an unacknowledged
 *    put - which its payload checksum then refuses, never returns.
 *  - The in-memory index changes only in the commit leader, after the batch
 *    is durable, in sequence order; a delete record names the sequence of
 *    the put it deletes. Replay applies the same rules in the same order,
 *    so the index after a reopen is the index the writer had acknowledged.
 *  - An extent is freed only when no journal state can still point at it
 *    with the caller's data: the old extent of an overwritten key when the
 *    new record is durable, a deleted one when the delete is, and never
 *    while a get reads it (pins; the last reader frees a doomed entry).
 *  - After a failed journal write or sync the store refuses writes: the
 *    kernel may already have dropped the unsynced pages (fsyncgate), so the
 *    only trustworthy state is what a reopen finds on disk. Nor does it
 *    free another extent (frozen): the failed batch's records may be
 *    durable all the same - an append that ran out of space wrote the
 *    whole records before that point, and pages whose fdatasync failed
 *    may still reach the disk - so their extents must not be reused; a
 *    put into the failed store is refused before it allocates.
 *  - One owner per directory: open takes each directory's lock before it
 *    touches any other file there. Two owners would each rebuild the
 *    allocator from the journal and hand out the same extents.
 *  - The first record of a batch carries the barrier flag exactly when
 *    every journal byte before it is known fdatasync'ed (jsynced == jsize;
 *    open syncs what a killed predecessor left). So replay can tell a bad
 *    record that was durable (damage: a barrier follows it) from a torn
 *    tail, and drop every chunk the damaged record may have superseded.
 *    A compacted journal's last record is a barrier too: the file becomes
 *    the journal only whole and synced.
 *  - A close leaves a history-free journal (compacted when any record is
 *    not a live chunk's put): a damaged record then costs only chunks,
 *    never brings an older value back.
 *  - Freed extents wait for their records to be durable; a put that finds
 *    the slab full commits the records that would free some before it
 *    fails (reclaim_by_commit), so in SYNC_BATCH mode evictions (forgets)
 *    do not starve the writers until the next size- or age-triggered
 *    commit.
 *
 * Group commit: callers append encoded records to a pending batch under
 * cmu; the first caller to find no commit running becomes the leader, takes
 * the batch, does the syncs and the append without holding any lock, and
 * wakes everyone whose batch it carried. Records that arrive meanwhile form
 * the next batch, so N concurrent writers share each fdatasync pair. In
 * SYNC_BATCH mode the leader is the flusher thread (woken by the put that
 * fills a batch, or by the batch's age), so writers never wait for a sync
 * unless two batches are queued already; ferry_pslab_sync() leads on the
 * caller's thread.
 *
 * Lock order: cmu before mu; lmu is taken alone. mu guards the index, the
 * allocator calls made on its behalf, and the counters.
 */
#ifndef FERRY_SRC_PSLAB_IMPL_H
#define FERRY_SRC_PSLAB_IMPL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "core.h"
#include "ferry/io.h"
#include "ferry/pslab.h"
#include "pslab/pslab_int.h"
#include "pslab/pslab_reader.h"

#define PATH_MAX_ 4096

typedef struct lane {
    ferry_io *io;
    ferry_file *f[FERRY_PSLAB_MAX_DIRS];
    void *stage;
    size_t stage_cap;
} lane;

typedef struct pend_op {
    int type;
    int inserted;             /* SYNC_BATCH put: e is in the index already */
    ferry__pslab_ent *e;      /* put: the new entry; delete: key, seq = the put it deletes */
    ferry__pslab_ent *victim; /* forget, batch put: the entry it took out of the index */
} pend_op;

typedef struct pend {
    uint8_t *buf;
    size_t len, cap;
    pend_op *ops;
    size_t n, ncap;
} pend;

struct ferry_pslab {
    ferry__errbuf err;
    char *dirs[FERRY_PSLAB_MAX_DIRS];
    unsigned n_dirs;
    unsigned flags;
    int sync_mode;
    int direct;
    unsigned mode;   /* files ferry creates (0: 0600) */
    int lockfd[FERRY_PSLAB_MAX_DIRS];
    uint64_t compact_bytes;
    ferry__pslab_geom g;
    uint8_t *tag;    /* the application tag written at create (opt's copy) */
    uint32_t tag_len;
    uint64_t data_off, share;
    char jpath[PATH_MAX_];

    /* index and allocator (mu) */
    pthread_mutex_t mu;
    ferry__pslab_index idx;
    ferry_slab *alloc;
    ferry_pslab_stats st;
    int frozen;      /* the journal failed: no extent is freed until a reopen */

    /* data lanes (lmu) */
    pthread_mutex_t lmu;
    pthread_cond_t lcv;
    lane *lanes;
    unsigned nlanes;
    uint32_t free_lanes;

    /* commit (cmu) */
    pthread_mutex_t cmu;
    pthread_cond_t ccv;
    pend cur, spare;
    uint64_t batch_open, durable, next_seq;
    int committing;
    int failed;
    int dirty;       /* SYNC_NONE: written since the last sync */
    uint64_t cur_data, cur_t0;   /* SYNC_BATCH: data bytes queued, time of the first */
    uint64_t batch_bytes, batch_ns;
    pthread_t flusher;
    pthread_cond_t fcv;
    int flusher_on, stopping;
    lane cl;         /* commit lane: journal engine, slab files for fdatasync */
    ferry_file *jf;
    uint64_t jsize, jrecords, generation;
    uint32_t jversion; /* the journal's format: barriers only in 2 and later, piece
                        * puts only in 3 and later */
    uint64_t jsynced;  /* journal bytes known fdatasync'ed (committer only) */
    ferry__warnlim warn; /* compaction warnings */
    int need_compact;  /* open found damage, or an older format's journal: rewrite it */
    int piece_puts;    /* puts carry piece sums (a writable format 3 store; set at open) */
};

static inline uint64_t align_up(uint64_t v, uint64_t a)
{
    return (v + a - 1) / a * a;
}

/*
 * Test seam (not API): the format this library writes - new stores' slab
 * and journal headers, rewritten journals, and so whether puts carry
 * piece sums - when set to 1..FERRY_PSLAB_FORMAT; 0 (unarmed): the
 * current format. Tests of old stores make them with it. A relaxed load.
 */
extern _Atomic unsigned ferry__pslab_test_format;
static inline uint32_t ferry__pslab_write_format(void)
{
    unsigned f = atomic_load_explicit(&ferry__pslab_test_format, memory_order_relaxed);
    return f && f <= FERRY_PSLAB_FORMAT ? f : FERRY_PSLAB_FORMAT;
}

/* ---- pslab.c ---- */
/* pin the entry under key (counted as a get; a miss counted and its
 * message set, naming what): the entry, or NULL */
ferry__pslab_ent *ferry__pslab_pin_find(ferry_pslab *p, const void *key, size_t klen,
                                        const char *what);
/* mu held: drop a pin (the last one frees a doomed entry) */
void ferry__pslab_unpin(ferry_pslab *p, ferry__pslab_ent *e);

/* ---- pslab_lane.c ---- */
/* record a failure on p: the code, and the message */
int ferry__pslab_fail(ferry_pslab *p, int code, const char *fmt, ...) FERRY__PRINTF(3, 4);
/* the same, with the lower layer's last error appended */
int ferry__pslab_fail_io(ferry_pslab *p, int code, const char *fmt, ...) FERRY__PRINTF(3, 4);
int ferry__pslab_fsync_dir(const char *dir);
/* FERRY_FILE_* flags of the slab files: read, write unless read-only, direct */
unsigned ferry__pslab_file_flags(const ferry_pslab *p);
int ferry__pslab_lane_open(ferry_pslab *p, lane *l, const char *engine, unsigned depth);
void ferry__pslab_lane_close(lane *l);
/* take a free data lane (waits for one), give it back */
lane *ferry__pslab_lane_get(ferry_pslab *p);
void ferry__pslab_lane_put(ferry_pslab *p, lane *l);
/* the lane's staging buffer holds at least n bytes */
int ferry__pslab_lane_stage(ferry_pslab *p, lane *l, size_t n);
/* slab bytes [off, off+len) <-> buf (op: FERRY_IO_READ or FERRY_IO_WRITE) */
int ferry__pslab_data_rw(ferry_pslab *p, lane *l, int op, void *buf, uint64_t len, uint64_t off);
/* write buf to slab bytes [off, off+len), hashing data[0..dlen) meanwhile:
 * piece 0: *sum = its XXH3-64; else psum[i] = piece i's XXH3-64 and *sum =
 * their table's (ferry__pslab_table_sum) */
int ferry__pslab_data_write_sum(ferry_pslab *p, lane *l, const void *buf, uint64_t len,
                                uint64_t off, const void *data, size_t dlen, uint32_t piece,
                                uint64_t *psum, uint64_t *sum);
/* data_rw's read that checks buf[0..hlen) while the later parts of the
 * read are still in flight: piece 0: *sum = its XXH3-64 (the caller
 * compares); else each piece against psum: FERRY_ECORRUPT (no message)
 * with *bad = the first bad piece, *sum = its hash */
int ferry__pslab_data_read_sum(ferry_pslab *p, lane *l, void *buf, uint64_t len, uint64_t off,
                               uint64_t hlen, uint32_t piece, const uint64_t *psum,
                               uint64_t *sum, uint32_t *bad);

/* ---- pslab_commit.c ---- */
/* mu held: free e's extent and e, or mark it doomed while pinned or pending */
void ferry__pslab_ent_release(ferry_pslab *p, ferry__pslab_ent *e);
/* cmu held: queue one record (a put of e, or a delete of the put del_seq) */
int ferry__pslab_pend_add(ferry_pslab *p, int type, ferry__pslab_ent *e, uint64_t del_seq);
/* cmu held, SYNC_BATCH: queue the put of e and make it visible at once */
int ferry__pslab_pend_add_visible(ferry_pslab *p, ferry__pslab_ent *e);
/* mu held: the batch will never be durable: give its extents back */
void ferry__pslab_pend_discard(ferry_pslab *p, pend *q);
int ferry__pslab_sync_slab_files(ferry_pslab *p);
/* cmu held, no commit running: lead the commit of the open batch */
void ferry__pslab_run_commit(ferry_pslab *p, int force_sync);
/* cmu held: wait until batch `mine` is durable (leading a commit if needed) */
int ferry__pslab_commit_wait(ferry_pslab *p, uint64_t mine);
/* the SYNC_BATCH flusher thread */
void *ferry__pslab_flusher_main(void *arg);
/* 0, or FERRY_ESTATE for a read-only store */
int ferry__pslab_writable(ferry_pslab *p);
/* the slab is full: commit what would free space; 1 when a commit ran */
int ferry__pslab_reclaim_by_commit(ferry_pslab *p);

/* ---- pslab_compact.c ---- */
/* the commit leader (committing set, no lock held): rewrite the journal */
int ferry__pslab_compact_locked(ferry_pslab *p);

/* ---- pslab_mark.c: the reset-in-progress marker ---- */
/* what a marker keeps of the slab being reset, besides its drives: what a
 * reset that finds the first drive's header gone recreates it with */
typedef struct ferry__pslab_markgeo {
    uint64_t bytes, stripe;
    uint32_t alignment, tag_len;
    uint8_t tag[FERRY_PSLAB_TAG_MAX];
} ferry__pslab_markgeo;
/* every directory gets a marker naming all of p's and g, durably (before
 * a reset touches anything) */
int ferry__pslab_mark_write(ferry_pslab *p, const ferry__pslab_markgeo *g);
/* the markers removed, the first directory's last (the store whole again) */
int ferry__pslab_mark_clear(ferry_pslab *p);
/* a marker in any of p's directories must name exactly them: 0 (*found:
 * one was there), else FERRY_EMISMATCH naming the drive missing, or the
 * marker's read failure (FERRY_ECORRUPT) */
int ferry__pslab_mark_check(ferry_pslab *p, int *found, ferry__pslab_markgeo *g);

/* ---- pslab_recover.c ---- */
/* a requested size rounded up to the alignment and a whole stripe row */
uint64_t ferry__pslab_round_capacity(uint64_t bytes, uint64_t align, uint64_t stripe,
                                     unsigned drives);
/* check the slab files and replay the journal into p (the commit lane is open) */
int ferry__pslab_recover(ferry_pslab *p, const ferry_pslab_options *o);

#endif
