/*
 * ferry/pslab.h - the persistent slab: a crash-safe chunk store on NVMe.
 *
 * A ferry_pslab keeps chunks (a key of up to FERRY_PSLAB_KEY_MAX bytes ->
 * up to capacity bytes of data) in preallocated slab files, one per
 * directory (drive; the slab is striped across them), and an index of
 * every chunk in an append-only journal next to the first slab file:
 *
 *     dir[0]/ferry_pslab.bin   header block, then the data (striped)
 *     dir[i]/ferry_pslab.bin   header block, then drive i's share
 *     dir[0]/ferry_pslab.idx   journal: header, then records
 *
 * Each slab file opens with a versioned header (magic, format version,
 * geometry: capacity, alignment, drives, stripe, this file's drive index;
 * a creation id shared by every file of one slab; an XXH3-64 checksum).
 * Each journal record (put: key, slab offset, length, payload XXH3-64 -
 * per piece of the chunk since format 3 - sequence; delete: key,
 * sequence) carries its own XXH3-64 checksum seeded with the creation id. Reopening replays the journal and rebuilds the
 * index and the allocator from it. A bad record at the end (a torn tail
 * after a crash) is cut off; one that a later commit proves durable
 * (damage) makes the chunks it may have superseded misses (its own key
 * when one changed byte explains it, else every chunk recorded before it),
 * never older values. Each directory has one owner (a lock, FERRY_EBUSY for a second
 * opener); an application tag recorded at creation (what the chunks mean)
 * refuses an opener with another one (FERRY_EMISMATCH) unless it asks for
 * a reset. Files are created 0600 (directories 0700) unless a mode is given.
 *
 * Durability (docs/DURABILITY.md): a put is acknowledged when
 * ferry_pslab_put() returns 0 in FERRY_PSLAB_SYNC_FULL mode (the default):
 * its data was written and the slab files fdatasync'ed, then its record
 * appended to the journal and the journal fdatasync'ed. Concurrent puts
 * share these syncs (group commit); ferry_pslab_put_many() makes a batch
 * durable with one pair of syncs. A crash (kill -9, power loss) loses only
 * unacknowledged puts and deletes, and never makes a chunk return bytes
 * that its writer did not store: every get verifies the payload checksum,
 * and a mismatch is FERRY_ECORRUPT for that key (counted, the entry
 * dropped), never data.
 *
 * After a failed journal write or sync the store refuses further puts and
 * deletes (FERRY_ESTATE) - the kernel may have dropped the unsynced pages,
 * so only a reopen (which replays what really reached the disk) is safe.
 *
 * Thread-safety: every function may be called from several threads at once
 * on the same store, except close. Gets and puts run their I/O in parallel
 * up to `lanes` at a time.
 */
#ifndef FERRY_PSLAB_H
#define FERRY_PSLAB_H

#include "core.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FERRY_PSLAB_FILE "ferry_pslab.bin"
#define FERRY_PSLAB_JOURNAL "ferry_pslab.idx"
/** The format this library writes (a store's format is its journal's; slab
 *  file headers keep format 2's layout and number); a newer one is refused
 *  with FERRY_EVERSION (its message points to `ferry slab reset`).
 *  2: slab headers carry the application tag, journal records the commit
 *  barrier flag.
 *  3: a put's record carries a checksum for each piece of its chunk (2 MiB,
 *  or more for chunks over 128 GiB), checked by gets piece by piece.
 *  Format 1 and 2 stores are read as they are (a chunk of theirs is
 *  checked whole); the first writable open rewrites the journal as format
 *  3, keeping their records, and later puts carry piece checksums. A
 *  READONLY open modifies no file. */
#define FERRY_PSLAB_FORMAT 3u
#define FERRY_PSLAB_KEY_MAX 1024u
#define FERRY_PSLAB_MAX_DIRS 16u
/** Bytes of an application tag (ferry_pslab_options.tag) at most. */
#define FERRY_PSLAB_TAG_MAX 1024u
/** A directory's lock file (one owner per directory; see ferry_pslab_open). */
#define FERRY_PSLAB_LOCK "ferry.lock"
/** A reset in progress (in every drive's directory, naming all the drives):
 *  left by a reset that crashed part way, it makes every open not given
 *  exactly those drives fail with FERRY_EMISMATCH naming the one missing,
 *  so a later reset cannot make a slab of some of them alone. */
#define FERRY_PSLAB_RESET_MARK "ferry_pslab.reset"

typedef struct ferry_pslab ferry_pslab;

enum ferry_pslab_flags {
    /** Create the store when dir[0] holds none (no journal). */
    FERRY_PSLAB_CREATE = 1u << 0,
    /** Open for reading and checking only: no put, delete, repair or
     *  journal truncation; the files are not modified. */
    FERRY_PSLAB_READONLY = 1u << 1,
    /**
     * Start empty: whatever store the directories hold is dropped (its
     * chunks are gone) and a new one is created in its place, also when
     * the old one has another geometry or tag or cannot be read. Geometry
     * options left 0 (bytes, alignment, stripe_bytes) and a NULL tag are
     * taken from the old store when its first header is readable (when
     * it is not and bytes is 0, the open fails - -ENOENT without a slab
     * file - before anything is dropped). Never implied: without it
     * another geometry or tag is FERRY_EMISMATCH and nothing is touched.
     * Directories are made only with CREATE: a missing one is -ENOENT,
     * and so is a directory holding no store (no journal, lock or slab
     * file), with no file made there. Not with READONLY. A reset that
     * crashed part way leaves FERRY_PSLAB_RESET_MARK in every directory:
     * an open not given every drive it names is then FERRY_EMISMATCH
     * naming the one missing, and a reset given them all completes (the
     * size and tag kept, from the marker if the first header was lost).
     */
    FERRY_PSLAB_RESET = 1u << 2
};

enum ferry_pslab_sync {
    /** put/delete return after their data and record are on stable storage. */
    FERRY_PSLAB_SYNC_FULL = 0,
    /** put/delete return after write(); nothing is acknowledged until a
     *  later ferry_pslab_sync() returns 0 (or close). */
    FERRY_PSLAB_SYNC_NONE = 1,
    /**
     * put returns once its data is written and its record queued: the chunk
     * is visible at once, and durable with the next group commit, which
     * runs (with the full ordering of SYNC_FULL) on a background thread
     * when batch_bytes of data are queued or batch_ms after the oldest
     * queued put, or on the caller's thread at ferry_pslab_sync() / close.
     * A put that finds 2 x batch_bytes queued waits for the commit that
     * takes them, so a crash loses at most the puts of the commit in
     * flight and of the two batches queued behind it (about 4 x
     * batch_bytes, and never more than batch_ms old once the disk keeps
     * up), never returns their bytes torn, and never loses an older chunk.
     * delete and put_many still wait for their commit. For caches (the KV
     * store).
     */
    FERRY_PSLAB_SYNC_BATCH = 2
};

/*
 * Every field is range-checked before it is used (-EINVAL naming the field
 * and its range); the ranges are given with each field.
 */
typedef struct ferry_pslab_options {
    /** sizeof(ferry_pslab_options), or an older header's (a prefix of at
     *  least FERRY_PSLAB_OPTIONS_MIN_SIZE) */
    size_t size;
    /** one directory per drive (created, 0700 or per `mode`, with CREATE) */
    const char *const *dirs;
    unsigned n_dirs;           /**< 1..FERRY_PSLAB_MAX_DIRS */
    /** Data capacity in bytes, at most 2^56. Creating: required (rounded
     *  up to the alignment, and to stripe * n_dirs with several drives).
     *  Opening: 0 accepts the stored one, anything else must match it. */
    uint64_t bytes;
    /** a power of two in [512, 1 GiB]; 0 -> 4096 (create) / the stored one (open) */
    size_t alignment;
    /** a multiple of the alignment, at most 2^40; 0 -> 1 MiB (create) / the stored one */
    size_t stripe_bytes;
    int direct;                /**< 1: slab files O_DIRECT (falls back when refused) */
    const char *engine;        /**< I/O engine: NULL/"auto", "posix", "uring" */
    unsigned flags;            /**< enum ferry_pslab_flags */
    int sync;                  /**< enum ferry_pslab_sync */
    unsigned lanes;            /**< concurrent data I/Os, 0..32; 0 -> 2 */
    /** Compact the journal when it holds more than this many bytes and
     *  more dead than live records; 0 -> 4 MiB, at most 2^40. */
    uint64_t compact_bytes;
    /** SYNC_BATCH: commit when this much data is queued; 0 -> 64 MiB, at most 2^40 */
    uint64_t batch_bytes;
    /** SYNC_BATCH: commit at most this long after the oldest queued put;
     *  0 -> 100, at most 3600000 (an hour) */
    unsigned batch_ms;
    /** Requests in flight for one put or get (a chunk is split in that many
     *  pieces, at least 128 KiB each); 0 -> 4, at most 1024. */
    unsigned depth;
    /**
     * Application tag: up to FERRY_PSLAB_TAG_MAX bytes that say what the
     * chunks mean (the KV store records its layout, chunk size, hash seed
     * and model namespace). Creating: stored in every slab header. Opening:
     * NULL accepts any; otherwise a store with another tag (or none) is
     * FERRY_EMISMATCH quoting both, and nothing is touched (see
     * FERRY_PSLAB_RESET).
     */
    const void *tag;
    size_t tag_len;
    /** Mode of the files ferry creates: 0 -> 0600 (directories 0700);
     *  read/write bits only, the owner's included (0660 for a deliberate
     *  group; directories then get 0770). */
    unsigned mode;
} ferry_pslab_options;
/** The smallest size ferry_pslab_open takes: the first version's options,
 *  up to compact_bytes; the members past a caller's size keep their
 *  defaults (batch_bytes, batch_ms, depth 0, no tag, mode 0600). */
#define FERRY_PSLAB_OPTIONS_MIN_SIZE \
    (offsetof(ferry_pslab_options, compact_bytes) + sizeof(uint64_t))
#define FERRY_PSLAB_OPTIONS_INIT \
    {FERRY_FIELD(size) sizeof(ferry_pslab_options), FERRY_FIELD(dirs) NULL, \
     FERRY_FIELD(n_dirs) 0, FERRY_FIELD(bytes) 0, FERRY_FIELD(alignment) 0, \
     FERRY_FIELD(stripe_bytes) 0, FERRY_FIELD(direct) 1, FERRY_FIELD(engine) NULL, \
     FERRY_FIELD(flags) 0, FERRY_FIELD(sync) FERRY_PSLAB_SYNC_FULL, FERRY_FIELD(lanes) 0, \
     FERRY_FIELD(compact_bytes) 0, FERRY_FIELD(batch_bytes) 0, FERRY_FIELD(batch_ms) 0, \
     FERRY_FIELD(depth) 0, FERRY_FIELD(tag) NULL, FERRY_FIELD(tag_len) 0, FERRY_FIELD(mode) 0}

/**
 * Open (recover) the store in opt->dirs, or create it when there is none
 * and FERRY_PSLAB_CREATE is set.
 *
 * One owner per directory: before any other file is touched each
 * directory's lock file (FERRY_PSLAB_LOCK, an OFD lock: released at close
 * and by the kernel when the owner dies) is taken, exclusively, or shared
 * with READONLY (read-only checkers exclude owners and are excluded by
 * them). A second opener, in this process or another, gets FERRY_EBUSY
 * naming the directory and the holder's pid.
 *
 * Recovery checks every header and replays the journal. A bad record (its
 * checksum fails) with nothing after it that proves it was durable is a
 * torn tail: it and what follows are dropped (and cut off the journal
 * unless READONLY). A bad record that a later commit proves durable is
 * damage: every chunk whose latest record may be it is dropped (its key
 * when exactly one changed byte explains the bad bytes; else every chunk
 * recorded before it that no good record after it rewrites), so a get
 * misses instead of returning an older value; the journal is then
 * rewritten (unless READONLY). Records naming extents outside the slab or
 * overlapping a newer one are dropped; ferry_pslab_stats() counts all of
 * these. Payloads are not read at open (ferry_pslab_verify() reads them).
 * Errors: -EINVAL (bad options: every field is range-checked), -ENOENT
 * (no store and no CREATE - then no file, not even the lock file, is made
 * in a directory that holds none - a directory or slab file missing), FERRY_EBUSY
 * (a directory is another opener's), FERRY_EVERSION (a newer format),
 * FERRY_EMISMATCH (geometry or tag differs from opt, another slab's file,
 * drives in another order), FERRY_ECORRUPT (bad magic or header checksum,
 * a slab file shorter than its geometry), -ENOSPC (creating: the disk is
 * too small), -ENOMEM, I/O errors. Every failure names the file and the
 * cause (ferry_last_error()). A refused open removes the directories it
 * made (FERRY_PSLAB_CREATE) and the lock files it made, with the files of
 * ours it made in a directory it made; a directory or file that was there
 * before is left as it was (a reset's marker too: it outlives an
 * unfinished reset). *out owned by the caller: ferry_pslab_close().
 */
FERRY_API int ferry_pslab_open(const ferry_pslab_options *opt, ferry_pslab **out);
/**
 * Sync what is pending (SYNC_NONE), compact the journal when worthwhile,
 * close the files and free. Returns 0, or the first error of the final
 * sync (the store is freed either way). NULL does nothing.
 */
FERRY_API int ferry_pslab_close(ferry_pslab *p);
/** The message of this store's last failure, "" if none. */
FERRY_API const char *ferry_pslab_last_error(const ferry_pslab *p);

/**
 * Store len bytes (1..capacity) under key[0..klen) (klen 1..KEY_MAX),
 * replacing any chunk under that key once the new one is durable. Returns
 * 0 when acknowledged (see the sync modes). data stays the caller's.
 * Extents of deleted, forgotten or replaced chunks are reused once their
 * records are durable; a put that finds no free extent while such records
 * are queued commits them (or waits for the commit in flight) and tries
 * again, so FERRY_ENOSPACE means the slab is full of live chunks and
 * chunks whose records are still being written.
 * Errors: -EINVAL, FERRY_ENOSPACE (no free extent fits), FERRY_ESTATE
 * (read-only, or a journal write failed earlier), -ENOMEM, I/O errors.
 * On failure no entry is visible and the old chunk under key, if any, stays.
 */
FERRY_API int ferry_pslab_put(ferry_pslab *p, const void *key, size_t klen, const void *data,
                              size_t len);

/** One chunk of ferry_pslab_put_many(). result: 0 or the code of its put. */
typedef struct ferry_pslab_item {
    const void *key;
    size_t klen;
    const void *data;
    size_t len;
    int result;
} ferry_pslab_item;
/**
 * Put n chunks, made durable together by one group commit. Returns the
 * number stored (each item's result says which failed), or a negative code
 * when nothing could be stored (the journal failed: every result is set).
 */
FERRY_API int ferry_pslab_put_many(ferry_pslab *p, ferry_pslab_item *items, size_t n);

/**
 * Read the chunk under key into buf[0..cap), checking its XXH3-64 (each
 * piece's as it lands, for a chunk with piece checksums): *len gets its
 * length. Errors: FERRY_ENOTFOUND, -ENOBUFS (cap < length; *len
 * untouched: ask ferry_pslab_stat()), FERRY_ECORRUPT (the stored bytes fail
 * their checksum - the message names the key, and the piece, its slab
 * offset and length: nothing is returned, the entry is dropped and
 * counted, buf[0..length) is zeroed), -EINVAL, I/O errors. buf need not be aligned;
 * an aligned buf with cap >= the length rounded up to the alignment is
 * read into directly (O_DIRECT), so bytes of buf past *len, up to that
 * rounded length, may be overwritten.
 */
FERRY_API int ferry_pslab_get(ferry_pslab *p, const void *key, size_t klen, void *buf,
                              size_t cap, size_t *len);

/** What the index knows of one chunk. */
typedef struct ferry_pslab_info {
    uint64_t offset;     /**< slab offset of its extent */
    uint64_t length;     /**< bytes stored */
    /** XXH3-64 of the bytes (a chunk of a format 1 or 2 record); for a
     *  chunk written with piece checksums (format 3): XXH3-64 of its piece
     *  table - the XXH3-64 (seed 0) of each piece in order, as
     *  little-endian u64s */
    uint64_t checksum;
    uint64_t seq;        /**< sequence number of its put */
} ferry_pslab_info;
/** The index entry of key (no I/O). FERRY_ENOTFOUND, -EINVAL. */
FERRY_API int ferry_pslab_stat(ferry_pslab *p, const void *key, size_t klen,
                               ferry_pslab_info *out);

/**
 * Delete the chunk under key; durable like a put. FERRY_ENOTFOUND,
 * FERRY_ESTATE (read-only or failed journal), I/O errors.
 */
FERRY_API int ferry_pslab_delete(ferry_pslab *p, const void *key, size_t klen);

/**
 * Delete without waiting for the disk: the chunk leaves the index at once
 * (gets miss it), and its delete record rides with the next commit (the
 * next put, delete or sync, or close). A crash before that brings the
 * chunk back intact. Its extent is reused only after the record is
 * durable. For caches whose evictions need not survive a crash (the KV
 * store's persistent tier). Errors as ferry_pslab_delete.
 */
FERRY_API int ferry_pslab_forget(ferry_pslab *p, const void *key, size_t klen);

/**
 * Make every put and delete returned so far durable (one group commit).
 * In SYNC_FULL mode they already are; returns 0.
 */
FERRY_API int ferry_pslab_sync(ferry_pslab *p);

/**
 * Call fn for every chunk in the index (no particular order), under the
 * store's lock: fn must not call into this store. A non-zero return from
 * fn stops the walk and is returned. Returns 0 after a full walk.
 */
typedef int (*ferry_pslab_iter_fn)(const void *key, size_t klen, const ferry_pslab_info *info,
                                   void *ctx);
FERRY_API int ferry_pslab_iterate(ferry_pslab *p, ferry_pslab_iter_fn fn, void *ctx);

/**
 * Read every chunk and check its checksum (what `ferry slab check` does).
 * *bad gets the number that failed; with repair (not READONLY) they are
 * deleted durably, else they stay. report (may be NULL) is called for
 * each bad one. Returns 0 or an I/O / state error.
 */
typedef void (*ferry_pslab_bad_fn)(const void *key, size_t klen, const ferry_pslab_info *info,
                                   int code, void *ctx);
FERRY_API int ferry_pslab_verify(ferry_pslab *p, int repair, uint64_t *bad,
                                 ferry_pslab_bad_fn report, void *ctx);

/** Rewrite the journal as one record per live chunk (atomic rename). */
FERRY_API int ferry_pslab_compact(ferry_pslab *p);

typedef struct ferry_pslab_stats {
    size_t size;                /**< set by the caller: sizeof(ferry_pslab_stats) */
    uint64_t capacity;          /**< data bytes */
    size_t alignment;
    unsigned drives;
    uint64_t stripe_bytes;
    uint64_t creation_id;
    uint64_t chunks;            /**< in the index */
    uint64_t bytes_stored;      /**< sum of their lengths */
    uint64_t bytes_used;        /**< extents held (aligned) */
    double fragmentation;       /**< of the free space, as ferry_slab_stats */
    uint64_t journal_bytes;
    uint64_t journal_records;   /**< records in the journal (live and dead) */
    uint64_t generation;        /**< compactions since creation */
    /* recovery at open */
    uint64_t recovered;         /**< chunks found at open */
    uint64_t replayed_records;
    uint64_t dropped_records;   /**< records refused at open (range, overlap) */
    uint64_t torn_bytes;        /**< journal bytes cut at open (torn or bad tail) */
    uint64_t open_ns;           /**< time open took */
    /* since open */
    uint64_t puts, gets, hits, misses, deletes;
    uint64_t corrupt;           /**< gets (and verifies) that failed the checksum */
    uint64_t commits;           /**< group commits (journal syncs) */
    uint64_t committed_records; /**< records made durable by them */
    uint64_t compactions;
    uint64_t failures;
    int failed;                 /**< 1 when a journal write failed (writes refused) */
    int direct;                 /**< 1 when the slab files are O_DIRECT */
    /** chunks dropped at open because a bad record proven durable may have
     *  been their latest (damage in the middle of the journal) */
    uint64_t damaged_chunks;
    /** commits run by puts that found no free extent while freed extents
     *  waited for their records to become durable */
    uint64_t space_commits;
    /** every record with a sequence (ferry_pslab_info.seq) up to this one
     *  is durable: a chunk whose seq is at most this survives a crash */
    uint64_t durable_seq;
} ferry_pslab_stats;
#define FERRY_PSLAB_STATS_INIT \
    {FERRY_FIELD(size) sizeof(ferry_pslab_stats), FERRY_FIELD(capacity) 0, \
     FERRY_FIELD(alignment) 0, FERRY_FIELD(drives) 0, FERRY_FIELD(stripe_bytes) 0, \
     FERRY_FIELD(creation_id) 0, FERRY_FIELD(chunks) 0, FERRY_FIELD(bytes_stored) 0, \
     FERRY_FIELD(bytes_used) 0, FERRY_FIELD(fragmentation) 0, FERRY_FIELD(journal_bytes) 0, \
     FERRY_FIELD(journal_records) 0, FERRY_FIELD(generation) 0, FERRY_FIELD(recovered) 0, \
     FERRY_FIELD(replayed_records) 0, FERRY_FIELD(dropped_records) 0, FERRY_FIELD(torn_bytes) 0, \
     FERRY_FIELD(open_ns) 0, FERRY_FIELD(puts) 0, FERRY_FIELD(gets) 0, FERRY_FIELD(hits) 0, \
     FERRY_FIELD(misses) 0, FERRY_FIELD(deletes) 0, FERRY_FIELD(corrupt) 0, \
     FERRY_FIELD(commits) 0, FERRY_FIELD(committed_records) 0, FERRY_FIELD(compactions) 0, \
     FERRY_FIELD(failures) 0, FERRY_FIELD(failed) 0, FERRY_FIELD(direct) 0, \
     FERRY_FIELD(damaged_chunks) 0, FERRY_FIELD(space_commits) 0, FERRY_FIELD(durable_seq) 0}
/**
 * A snapshot of the counters: the caller sets out->size (its header's
 * sizeof(ferry_pslab_stats), e.g. with FERRY_PSLAB_STATS_INIT) and only
 * that many bytes are written; out->size stays. Errors: -EINVAL (NULL,
 * out->size not set).
 */
FERRY_API int ferry_pslab_stats_get(const ferry_pslab *p, ferry_pslab_stats *out);

#ifdef __cplusplus
}
#endif
#endif
