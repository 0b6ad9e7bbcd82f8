/*
 * pslab.c - the persistent slab: chunks in preallocated slab files, their
 * index in an append-only journal, group commit, recovery.
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
 *    only trustworthy state is what a reopen finds on disk.
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
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#include "core.h"
#include "core/dirlock.h"
#include "ferry/io.h"
#include "ferry/pslab.h"
#include "io/io_impl.h"
#include "pslab/pslab_int.h"

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
    uint32_t jversion; /* the journal's format: barriers only in 2 and later */
    uint64_t jsynced;  /* journal bytes known fdatasync'ed (committer only) */
    ferry__warnlim warn; /* compaction warnings */
    int need_compact;  /* open found damage, or a format 1 journal: rewrite it */
};

/* ---- small helpers ---- */
static int fail(ferry_pslab *p, int code, const char *fmt, ...) FERRY__PRINTF(3, 4);
static int fail(ferry_pslab *p, int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int rc = ferry__err_vset(&p->err, code, fmt, ap);
    va_end(ap);
    return rc;
}

/* message with the lower layer's last error appended */
static int fail_io(ferry_pslab *p, int code, const char *fmt, ...) FERRY__PRINTF(3, 4);
static int fail_io(ferry_pslab *p, int code, const char *fmt, ...)
{
    char lower[FERRY__ERRMSG_MAX];
    snprintf(lower, sizeof lower, "%s", ferry_last_error());
    char msg[FERRY__ERRMSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return ferry__err_set(&p->err, code, "%s: %s (%s)", msg, ferry_err_name(code),
                          lower[0] ? lower : ferry_strerror(code));
}

static uint64_t align_up(uint64_t v, uint64_t a)
{
    return (v + a - 1) / a * a;
}

static int fsync_dir(const char *dir)
{
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        return -errno;
    int rc = fsync(fd) == 0 ? 0 : -errno;
    close(fd);
    return rc;
}

static uint64_t new_creation_id(void)
{
    uint64_t id = 0;
    if (getrandom(&id, sizeof id, 0) != (ssize_t)sizeof id || id == 0) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        uint64_t mix[3] = {(uint64_t)ts.tv_sec, (uint64_t)ts.tv_nsec, (uint64_t)getpid()};
        id = XXH3_64bits(mix, sizeof mix) | 1;
    }
    return id;
}

static void slab_path(const ferry_pslab *p, unsigned i, char *out, size_t n)
{
    snprintf(out, n, "%s/%s", p->dirs[i], FERRY_PSLAB_FILE);
}

/* ---- lanes ---- */
static unsigned file_flags(const ferry_pslab *p)
{
    unsigned fl = FERRY_FILE_READ;
    if (!(p->flags & FERRY_PSLAB_READONLY))
        fl |= FERRY_FILE_WRITE;
    if (p->direct)
        fl |= FERRY_FILE_DIRECT;
    return fl;
}

static void lane_close(lane *l)
{
    for (unsigned i = 0; i < FERRY_PSLAB_MAX_DIRS; i++)
        if (l->f[i])
            ferry_file_close(l->f[i]);
    if (l->stage)
        ferry_io_buffer_free(l->io, l->stage);
    ferry_io_close(l->io);
    memset(l, 0, sizeof *l);
}

static int lane_open(ferry_pslab *p, lane *l, const char *engine, unsigned depth)
{
    ferry_io_options io = FERRY_IO_OPTIONS_INIT;
    io.engine = engine;
    io.depth = depth;
    int rc = ferry_io_open(&io, &l->io);
    if (rc < 0)
        return fail_io(p, rc, "pslab %s: opening an I/O engine (%s)", p->dirs[0],
                       engine ? engine : "auto");
    for (unsigned i = 0; i < p->g.drives; i++) {
        char path[PATH_MAX_];
        slab_path(p, i, path, sizeof path);
        rc = ferry_file_open(l->io, path, file_flags(p), &l->f[i]);
        if (rc < 0) {
            rc = fail_io(p, rc, "pslab: opening slab file %s", path);
            lane_close(l);
            return rc;
        }
        if (i == 0 && p->direct && !ferry_file_is_direct(l->f[0]))
            p->st.direct = 0;
    }
    return 0;
}

static lane *lane_get(ferry_pslab *p)
{
    pthread_mutex_lock(&p->lmu);
    while (!p->free_lanes)
        pthread_cond_wait(&p->lcv, &p->lmu);
    unsigned i = (unsigned)__builtin_ctz(p->free_lanes);
    p->free_lanes &= ~(1u << i);
    pthread_mutex_unlock(&p->lmu);
    return &p->lanes[i];
}

static void lane_put(ferry_pslab *p, lane *l)
{
    pthread_mutex_lock(&p->lmu);
    p->free_lanes |= 1u << (unsigned)(l - p->lanes);
    pthread_cond_signal(&p->lcv);
    pthread_mutex_unlock(&p->lmu);
}

static int lane_stage(ferry_pslab *p, lane *l, size_t n)
{
    if (l->stage_cap >= n)
        return 0;
    void *b = NULL;
    size_t cap = align_up(n, FERRY_IO_ALIGN);
    int rc = ferry_io_buffer_alloc(l->io, cap, &b);
    if (rc < 0)
        return ferry__err_set(&p->err, -ENOMEM,
                              "pslab %s: out of memory for a %zu-byte staging buffer",
                              p->dirs[0], cap);
    if (l->stage)
        ferry_io_buffer_free(l->io, l->stage);
    l->stage = b;
    l->stage_cap = cap;
    return 0;
}

/* where slab bytes [off, off+len) start: drive *d at file offset *foff,
 * for *seg bytes up to the next stripe boundary */
static void stripe_at(const ferry_pslab *p, uint64_t off, uint64_t len, unsigned *d,
                      uint64_t *seg, uint64_t *foff)
{
    *d = 0;
    *seg = len;
    *foff = p->data_off + off;
    if (p->g.drives > 1) {
        uint64_t unit = off / p->g.stripe, within = off % p->g.stripe;
        *d = (unsigned)(unit % p->g.drives);
        *seg = FERRY__MIN(len, p->g.stripe - within);
        *foff = p->data_off + (unit / p->g.drives) * p->g.stripe + within;
    }
}

/* slab bytes [off, off+len) <-> buf through lane l, split at stripe boundaries */
static int data_rw(ferry_pslab *p, lane *l, int op, void *buf, uint64_t len, uint64_t off)
{
    uint8_t *b = buf;
    while (len) {
        unsigned d;
        uint64_t seg, foff;
        stripe_at(p, off, len, &d, &seg, &foff);
        int rc = op == FERRY_IO_WRITE ? ferry_io_pwrite(l->io, l->f[d], b, seg, foff)
                                      : ferry_io_pread(l->io, l->f[d], b, seg, foff);
        if (rc < 0)
            return fail_io(p, rc, "pslab: %s of %llu bytes at slab offset %llu (file %s, "
                           "offset %llu)", op == FERRY_IO_WRITE ? "write" : "read",
                           (unsigned long long)seg, (unsigned long long)off,
                           ferry_file_path(l->f[d]), (unsigned long long)foff);
        b += seg;
        off += seg;
        len -= seg;
    }
    return 0;
}

/*
 * data_rw's write, with the payload's XXH3-64 computed while the write is
 * in flight: the first NSEG stripe segments are started, data[0..dlen) is
 * hashed, then they are finished (and the next ones run). The hash of a
 * 32 MiB chunk is a few ms of CPU; started first, the drive works through
 * it instead of waiting for it. buf and data stay unchanged throughout (the
 * caller's or the lane's staging copy), so the sum is of what is written.
 */
static int data_write_sum(ferry_pslab *p, lane *l, const void *buf, uint64_t len, uint64_t off,
                          const void *data, size_t dlen, uint64_t *sum)
{
    enum { NSEG = 16 };
    ferry_io_req r[NSEG];
    uint64_t soff[NSEG], slen[NSEG], foffs[NSEG];
    unsigned sdrv[NSEG];
    const uint8_t *b = buf;
    int hashed = 0, rc = 0;
    while (len && rc == 0) {
        unsigned n = 0;
        while (n < NSEG && len) {
            unsigned d;
            uint64_t seg, foff;
            stripe_at(p, off, len, &d, &seg, &foff);
            rc = ferry__io_start(l->io, &r[n], l->f[d], FERRY_IO_WRITE, (void *)(uintptr_t)b, 0,
                                 (size_t)seg, foff, (size_t)seg);
            if (rc < 0) {
                rc = fail_io(p, rc, "pslab: write of %llu bytes at slab offset %llu (file %s, "
                             "offset %llu)", (unsigned long long)seg, (unsigned long long)off,
                             ferry_file_path(l->f[d]), (unsigned long long)foff);
                break;
            }
            soff[n] = off;
            slen[n] = seg;
            foffs[n] = foff;
            sdrv[n] = d;
            n++;
            b += seg;
            off += seg;
            len -= seg;
        }
        if (!hashed) {
            *sum = XXH3_64bits(data, dlen);
            hashed = 1;
        }
        for (unsigned i = 0; i < n; i++) {
            int r2 = ferry__io_finish(l->io, &r[i]);
            if (r2 < 0 && rc == 0)
                rc = fail_io(p, r2, "pslab: write of %llu bytes at slab offset %llu (file %s, "
                             "offset %llu)", (unsigned long long)slen[i],
                             (unsigned long long)soff[i], ferry_file_path(l->f[sdrv[i]]),
                             (unsigned long long)foffs[i]);
        }
    }
    if (!hashed)
        *sum = XXH3_64bits(data, dlen);
    return rc;
}

/* ---- entries ---- */
static void ent_release(ferry_pslab *p, ferry__pslab_ent *e)
{
    /* a reader holds it, or its own record is still queued: the last one frees it */
    if (e->pins || e->pending) {
        e->doomed = 1;
        return;
    }
    ferry_extent x = {e->offset, e->ext};
    if (e->ext)
        ferry_slab_free(p->alloc, &x);
    ferry__free(e);
}

static void unpin(ferry_pslab *p, ferry__pslab_ent *e)
{
    if (--e->pins == 0 && e->doomed)
        ent_release(p, e);
}

/* ---- commit ---- */
static int pend_reserve(pend *q, size_t bytes)
{
    if (q->len + bytes > q->cap) {
        size_t cap = FERRY__MAX(q->cap * 2, q->len + bytes + 4096);
        uint8_t *b = ferry__realloc(q->buf, cap);
        if (!b)
            return -ENOMEM;
        q->buf = b;
        q->cap = cap;
    }
    if (q->n + 1 > q->ncap) {
        size_t ncap = FERRY__MAX(q->ncap * 2, 64);
        pend_op *o = ferry__realloc(q->ops, ncap * sizeof *o);
        if (!o)
            return -ENOMEM;
        q->ops = o;
        q->ncap = ncap;
    }
    return 0;
}

/* cmu held: add one record of e (a put's new entry, or a delete) to the batch */
static int pend_add(ferry_pslab *p, int type, ferry__pslab_ent *e, uint64_t del_seq)
{
    size_t sz = ferry__pslab_rec_size(e->klen);
    if (pend_reserve(&p->cur, sz) < 0)
        return ferry__err_set(&p->err, -ENOMEM, "pslab %s: out of memory queueing a record",
                              p->dirs[0]);
    ferry__pslab_rec r;
    memset(&r, 0, sizeof r);
    r.type = type;
    r.klen = e->klen;
    r.key = e->key;
    r.seq = p->next_seq++;
    if (type == FERRY__PSLAB_PUT) {
        e->seq = r.seq;
        r.offset = e->offset;
        r.length = e->length;
        r.sum = e->sum;
    } else {
        e->seq = del_seq;
        r.sum = del_seq;
    }
    ferry__pslab_rec_encode(&r, p->g.creation_id, p->cur.buf + p->cur.len);
    p->cur.len += sz;
    p->cur.ops[p->cur.n].type = type;
    p->cur.ops[p->cur.n].inserted = 0;
    p->cur.ops[p->cur.n].e = e;
    p->cur.ops[p->cur.n].victim = NULL;
    p->cur.n++;
    return 0;
}

/* mu held: the batch is durable: apply it to the index in order */
static void pend_apply(ferry_pslab *p, pend *q)
{
    for (size_t i = 0; i < q->n; i++) {
        ferry__pslab_ent *e = q->ops[i].e;
        ferry__pslab_ent *old = ferry__pslab_index_find(&p->idx, e->key, e->klen, e->hash);
        if (q->ops[i].type == FERRY__PSLAB_DEL) {
            if (q->ops[i].victim) {
                ent_release(p, q->ops[i].victim);
            } else if (old && old->seq == e->seq) {
                ferry__pslab_index_unlink(&p->idx, old);
                ent_release(p, old);
            }
            ferry__free(e);
            continue;
        }
        if (q->ops[i].inserted) {
            /* in the index since its put: now durable */
            e->pending = 0;
            if (q->ops[i].victim)
                ent_release(p, q->ops[i].victim);
            if (e->doomed)
                ent_release(p, e);
            continue;
        }
        if (old) {
            ferry__pslab_index_unlink(&p->idx, old);
            ent_release(p, old);
        }
        ferry__pslab_index_insert(&p->idx, e);
    }
    q->n = 0;
    q->len = 0;
}

/* mu held: the batch will never be durable: give its extents back */
static void pend_discard(ferry_pslab *p, pend *q)
{
    /* newest first, so each victim goes back where its successor was */
    for (size_t i = q->n; i-- > 0;) {
        pend_op *o = &q->ops[i];
        ferry__pslab_ent *e = o->e, *v = o->victim;
        if (o->inserted) {
            e->pending = 0;
            if (e->linked)
                ferry__pslab_index_unlink(&p->idx, e);
        }
        if (v) {
            if (!v->doomed && !ferry__pslab_index_find(&p->idx, v->key, v->klen, v->hash))
                ferry__pslab_index_insert(&p->idx, v);
            else
                ent_release(p, v);
        }
        if (o->type == FERRY__PSLAB_DEL)
            ferry__free(e);
        else
            ent_release(p, e);
    }
    q->n = 0;
    q->len = 0;
}

static int sync_slab_files(ferry_pslab *p)
{
    for (unsigned i = 0; i < p->g.drives; i++) {
        int rc = ferry_file_sync(p->cl.f[i]);
        if (rc < 0)
            return fail_io(p, rc, "pslab: fdatasync of slab file %s",
                           ferry_file_path(p->cl.f[i]));
    }
    return 0;
}

static int compact_locked(ferry_pslab *p);

/* a failing compaction fails at every commit: the first few warnings, then
 * one a second saying how many were suppressed */
static void warn_compaction(ferry_pslab *p)
{
    uint64_t quiet = 0;
    if (!ferry__warn_ok(&p->warn, &quiet))
        return;
    if (quiet)
        FERRY_LOGW("%s (%llu more suppressed)", ferry__err_msg(&p->err),
                   (unsigned long long)quiet);
    else
        FERRY_LOGW("%s", ferry__err_msg(&p->err));
}

/*
 * cmu held, no commit running: become the leader for the open batch. Does
 * the I/O without locks, applies the batch, wakes the waiters. Returns with
 * cmu held.
 */
static void run_commit(ferry_pslab *p, int force_sync)
{
    p->committing = 1;
    uint64_t batch = p->batch_open++;
    uint64_t top = p->next_seq - 1; /* every record queued so far is in q or durable */
    pend q = p->cur;
    p->cur = p->spare;
    p->cur.n = 0;
    p->cur.len = 0;
    p->cur_data = 0;
    int had_dirty = p->dirty;
    pthread_mutex_unlock(&p->cmu);

    int full = p->sync_mode != FERRY_PSLAB_SYNC_NONE || force_sync;
    int has_put = 0;
    for (size_t i = 0; i < q.n && !has_put; i++)
        has_put = q.ops[i].type == FERRY__PSLAB_PUT;
    int rc = 0;
    if (full && (has_put || (force_sync && had_dirty)))
        rc = sync_slab_files(p);
    if (rc == 0 && q.len) {
        /* everything before this batch is on the disk: say so in its first
         * record, so that replay can tell damage before it from a torn tail */
        if (p->jversion >= 2 && p->jsynced == p->jsize)
            ferry__pslab_rec_set_barrier(q.buf, p->g.creation_id);
        rc = ferry_io_pwrite(p->cl.io, p->jf, q.buf, q.len, p->jsize);
        if (rc < 0)
            rc = fail_io(p, rc, "pslab: append of %zu journal bytes at offset %llu of %s",
                         q.len, (unsigned long long)p->jsize, p->jpath);
    }
    if (rc == 0 && full && (q.len || (force_sync && had_dirty))) {
        rc = ferry_file_sync(p->jf);
        if (rc < 0)
            rc = fail_io(p, rc, "pslab: fdatasync of journal %s", p->jpath);
        else
            p->jsynced = p->jsize + q.len;
    }
    size_t nrec = q.n;
    int want_compact = 0;
    if (rc == 0) {
        pthread_mutex_lock(&p->mu);
        p->jsize += q.len;
        pend_apply(p, &q);
        p->jrecords += nrec;
        if (nrec || full) {
            p->st.commits++;
            p->st.committed_records += nrec;
        }
        if (full)
            p->st.durable_seq = top;
        want_compact = p->jsize > p->compact_bytes && p->jrecords > 2 * (uint64_t)p->idx.count + 64;
        pthread_mutex_unlock(&p->mu);
    }
    if (want_compact) {
        int crc = compact_locked(p);
        if (crc < 0)
            warn_compaction(p);
    }

    pthread_mutex_lock(&p->cmu);
    if (rc < 0) {
        /* nothing queued will become durable: undo newest first (later batch, then ours) */
        p->failed = rc;
        pthread_mutex_lock(&p->mu);
        pend_discard(p, &p->cur);
        pend_discard(p, &q);
        p->st.failures++;
        pthread_mutex_unlock(&p->mu);
        p->cur_data = 0;
        p->batch_open++;
    } else {
        p->durable = batch;
        if (full)
            p->dirty = 0;
        else if (q.len)
            p->dirty = 1;
    }
    p->spare = q;
    p->committing = 0;
    pthread_cond_broadcast(&p->ccv);
    if (p->flusher_on && p->cur_data >= p->batch_bytes)
        pthread_cond_signal(&p->fcv);
}

/* cmu held: wait until batch `mine` is durable (leading a commit if needed) */
static int commit_wait(ferry_pslab *p, uint64_t mine)
{
    for (;;) {
        if (p->durable >= mine)
            return 0;
        if (p->failed)
            return ferry__err_set(&p->err, p->failed,
                                  "pslab %s: the journal failed (%s); the store refuses writes "
                                  "until it is reopened", p->dirs[0], ferry_err_name(p->failed));
        if (!p->committing) {
            run_commit(p, 0);
            continue;
        }
        pthread_cond_wait(&p->ccv, &p->cmu);
    }
}

/*
 * cmu held, SYNC_BATCH: queue the put of e and make it visible at once; the
 * entry it replaces leaves the index now and is freed when e is durable.
 */
static int pend_add_visible(ferry_pslab *p, ferry__pslab_ent *e)
{
    int rc = pend_add(p, FERRY__PSLAB_PUT, e, 0);
    if (rc < 0)
        return rc;
    pend_op *o = &p->cur.ops[p->cur.n - 1];
    o->inserted = 1;
    pthread_mutex_lock(&p->mu);
    e->pending = 1;
    ferry__pslab_ent *old = ferry__pslab_index_find(&p->idx, e->key, e->klen, e->hash);
    if (old) {
        ferry__pslab_index_unlink(&p->idx, old);
        o->victim = old;
    }
    ferry__pslab_index_insert(&p->idx, e);
    pthread_mutex_unlock(&p->mu);
    if (p->cur.n == 1)
        p->cur_t0 = ferry__now_ns();
    p->cur_data += e->length;
    return 0;
}

/* cmu held, SYNC_BATCH: whether the queued batch is due */
static int batch_due(const ferry_pslab *p)
{
    return p->cur.n &&
           (p->cur_data >= p->batch_bytes || ferry__now_ns() - p->cur_t0 >= p->batch_ns);
}

static void *flusher_main(void *arg)
{
    ferry_pslab *p = arg;
    pthread_mutex_lock(&p->cmu);
    while (!p->stopping) {
        if (!p->committing && !p->failed && batch_due(p)) {
            run_commit(p, 0);
            continue; /* the next batch may be due already */
        }
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        uint64_t wait = p->batch_ns / 2 ? p->batch_ns / 2 : 1000000;
        uint64_t ns = (uint64_t)ts.tv_nsec + wait % 1000000000ull;
        ts.tv_sec += (time_t)(wait / 1000000000ull + ns / 1000000000ull);
        ts.tv_nsec = (long)(ns % 1000000000ull);
        pthread_cond_timedwait(&p->fcv, &p->cmu, &ts);
    }
    pthread_mutex_unlock(&p->cmu);
    return NULL;
}

static int writable(ferry_pslab *p)
{
    if (p->flags & FERRY_PSLAB_READONLY)
        return ferry__err_set(&p->err, FERRY_ESTATE, "pslab %s: opened read-only", p->dirs[0]);
    return 0;
}

/* ---- compaction ---- */
/*
 * Called by the commit leader (committing set, no lock held): write one
 * record per live entry to a new journal, sync it, rename it over the old
 * one, sync the directory, switch to it.
 */
static int compact_locked(ferry_pslab *p)
{
    char tmp[PATH_MAX_];
    snprintf(tmp, sizeof tmp, "%s/%s", p->dirs[0], FERRY__PSLAB_JOURNAL_TMP);
    /*
     * The snapshot is what is durable now: every indexed entry but the
     * SYNC_BATCH ones whose records are still queued, plus the durable
     * entries that queued records took out of the index (their records
     * follow the snapshot into the new journal, in order).
     */
    pthread_mutex_lock(&p->cmu);
    pthread_mutex_lock(&p->mu);
    size_t bytes = FERRY__PSLAB_JHDR_BYTES;
    for (size_t i = 0; i < p->idx.nb; i++)
        for (ferry__pslab_ent *e = p->idx.b[i]; e; e = e->hnext)
            if (!e->pending)
                bytes += ferry__pslab_rec_size(e->klen);
    for (size_t i = 0; i < p->cur.n; i++)
        if (p->cur.ops[i].victim && !p->cur.ops[i].victim->pending)
            bytes += ferry__pslab_rec_size(p->cur.ops[i].victim->klen);
    uint8_t *buf = ferry__malloc(bytes);
    if (!buf) {
        pthread_mutex_unlock(&p->mu);
        pthread_mutex_unlock(&p->cmu);
        return ferry__err_set(&p->err, -ENOMEM,
                              "pslab %s: out of memory compacting the journal (%zu bytes)",
                              p->jpath, bytes);
    }
    ferry__pslab_jhdr jh;
    jh.version = FERRY_PSLAB_FORMAT;
    jh.g = p->g;
    jh.generation = p->generation + 1;
    ferry__pslab_jhdr_encode(&jh, buf);
    size_t pos = FERRY__PSLAB_JHDR_BYTES, last = 0;
    uint64_t n = 0;
    for (size_t i = 0; i < p->idx.nb; i++)
        for (ferry__pslab_ent *e = p->idx.b[i]; e; e = e->hnext) {
            if (e->pending)
                continue;
            ferry__pslab_rec r = {FERRY__PSLAB_PUT, 0, e->klen, e->key, e->seq, e->offset,
                                  e->length, e->sum};
            ferry__pslab_rec_encode(&r, p->g.creation_id, buf + pos);
            last = pos;
            pos += ferry__pslab_rec_size(e->klen);
            n++;
        }
    for (size_t i = 0; i < p->cur.n; i++) {
        ferry__pslab_ent *e = p->cur.ops[i].victim;
        if (!e || e->pending)
            continue;
        ferry__pslab_rec r = {FERRY__PSLAB_PUT, 0, e->klen, e->key, e->seq, e->offset, e->length,
                              e->sum};
        ferry__pslab_rec_encode(&r, p->g.creation_id, buf + pos);
        last = pos;
        pos += ferry__pslab_rec_size(e->klen);
        n++;
    }
    /* the new file becomes the journal only once it is whole and synced, so
     * none of it can be a torn tail: its last record is a barrier, and a
     * byte damaged before it later costs one key, not the records after it */
    if (n)
        ferry__pslab_rec_set_barrier(buf + last, p->g.creation_id);
    pthread_mutex_unlock(&p->mu);
    pthread_mutex_unlock(&p->cmu);

    ferry_file *nf = NULL;
    int rc = ferry_file_open_mode(p->cl.io, tmp,
                                  FERRY_FILE_READ | FERRY_FILE_WRITE | FERRY_FILE_CREATE |
                                      FERRY_FILE_TRUNC,
                                  p->mode, &nf);
    if (rc == 0 && (rc = ferry_io_pwrite(p->cl.io, nf, buf, bytes, 0)) == 0)
        rc = ferry_file_sync(nf);
    ferry__free(buf);
    if (rc < 0) {
        rc = fail_io(p, rc, "pslab: compacting into %s", tmp);
        ferry_file_close(nf);
        unlink(tmp);
        return rc;
    }
    if (rename(tmp, p->jpath) != 0) {
        rc = -errno;
        ferry_file_close(nf);
        unlink(tmp);
        return ferry__err_set(&p->err, rc, "pslab: rename %s -> %s: %s", tmp, p->jpath,
                              strerror(-rc));
    }
    /* the rename is the switch: from here the new file is the journal */
    ferry_file_close(p->jf);
    p->jf = nf;
    pthread_mutex_lock(&p->mu);
    p->jsize = bytes;
    p->jsynced = bytes;
    p->jversion = FERRY_PSLAB_FORMAT;
    p->jrecords = n;
    p->generation++;
    p->st.compactions++;
    pthread_mutex_unlock(&p->mu);
    rc = fsync_dir(p->dirs[0]);
    if (rc < 0)
        return ferry__err_set(&p->err, rc, "pslab: fsync of directory %s after compaction: %s",
                              p->dirs[0], strerror(-rc));
    return 0;
}

int ferry_pslab_compact(ferry_pslab *p)
{
    if (!p)
        return ferry__err_set(NULL, -EINVAL, "ferry_pslab_compact: NULL store");
    int rc = writable(p);
    if (rc < 0)
        return rc;
    pthread_mutex_lock(&p->cmu);
    while (p->committing)
        pthread_cond_wait(&p->ccv, &p->cmu);
    if (p->failed) {
        pthread_mutex_unlock(&p->cmu);
        return ferry__err_set(&p->err, FERRY_ESTATE, "pslab %s: the journal failed earlier",
                              p->dirs[0]);
    }
    /* flush what is pending first, so the snapshot covers it */
    uint64_t mine = p->batch_open;
    if (p->cur.n)
        rc = commit_wait(p, mine);
    if (rc == 0) {
        while (p->committing)
            pthread_cond_wait(&p->ccv, &p->cmu);
        p->committing = 1;
        pthread_mutex_unlock(&p->cmu);
        rc = p->sync_mode == FERRY_PSLAB_SYNC_NONE ? sync_slab_files(p) : 0;
        if (rc == 0)
            rc = compact_locked(p);
        pthread_mutex_lock(&p->cmu);
        p->committing = 0;
        pthread_cond_broadcast(&p->ccv);
    }
    pthread_mutex_unlock(&p->cmu);
    return rc;
}

/* ---- create and recover ---- */
static int create_store(ferry_pslab *p, const ferry__pslab_geom *g)
{
    lane *l = &p->cl;
    uint8_t *blk = NULL;
    int rc = ferry_io_buffer_alloc(l->io, p->data_off, (void **)&blk);
    if (rc < 0)
        return ferry__err_set(&p->err, -ENOMEM, "pslab %s: out of memory creating", p->dirs[0]);
    memset(blk, 0, p->data_off);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    for (unsigned i = 0; i < g->drives && rc >= 0; i++) {
        char path[PATH_MAX_];
        slab_path(p, i, path, sizeof path);
        ferry_file *f = NULL;
        unsigned fl = FERRY_FILE_READ | FERRY_FILE_WRITE | FERRY_FILE_CREATE | FERRY_FILE_TRUNC;
        if (p->direct)
            fl |= FERRY_FILE_DIRECT;
        rc = ferry_file_open_mode(l->io, path, fl, p->mode, &f);
        if (rc < 0) {
            rc = fail_io(p, rc, "pslab: creating slab file %s", path);
            break;
        }
        rc = ferry_file_allocate(f, 0, p->data_off + p->share);
        if (rc < 0) {
            rc = fail_io(p, rc, "pslab: reserving %llu bytes for slab file %s",
                         (unsigned long long)(p->data_off + p->share), path);
        } else {
            ferry__pslab_hdr h;
            memset(&h, 0, sizeof h);
            h.version = FERRY_PSLAB_FORMAT;
            h.g = *g;
            h.drive = i;
            h.created_ns = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
            h.tag = p->tag;
            h.tag_len = p->tag_len;
            memset(blk, 0, p->data_off);
            ferry__pslab_hdr_encode(&h, blk);
            rc = ferry_io_pwrite(l->io, f, blk, p->data_off, 0);
            if (rc == 0)
                rc = ferry_file_sync(f);
            if (rc < 0)
                rc = fail_io(p, rc, "pslab: writing the header of slab file %s", path);
        }
        ferry_file_close(f);
    }
    if (rc >= 0) {
        /* the journal last: its presence says the slab files are complete */
        char tmp[PATH_MAX_];
        snprintf(tmp, sizeof tmp, "%s/%s", p->dirs[0], FERRY__PSLAB_JOURNAL_TMP);
        ferry__pslab_jhdr jh;
        jh.version = FERRY_PSLAB_FORMAT;
        jh.g = *g;
        jh.generation = 0;
        ferry__pslab_jhdr_encode(&jh, blk);
        ferry_file *f = NULL;
        rc = ferry_file_open_mode(l->io, tmp,
                                  FERRY_FILE_READ | FERRY_FILE_WRITE | FERRY_FILE_CREATE |
                                      FERRY_FILE_TRUNC,
                                  p->mode, &f);
        if (rc == 0 && (rc = ferry_io_pwrite(l->io, f, blk, FERRY__PSLAB_JHDR_BYTES, 0)) == 0)
            rc = ferry_file_sync(f);
        if (rc < 0)
            rc = fail_io(p, rc, "pslab: creating journal %s", tmp);
        ferry_file_close(f);
        if (rc == 0 && rename(tmp, p->jpath) != 0)
            rc = ferry__err_set(&p->err, -errno, "pslab: rename %s -> %s: %s", tmp, p->jpath,
                                strerror(errno));
        if (rc == 0 && (rc = fsync_dir(p->dirs[0])) < 0)
            rc = ferry__err_set(&p->err, rc, "pslab: fsync of directory %s: %s", p->dirs[0],
                                strerror(-rc));
        if (rc < 0)
            unlink(tmp);
    }
    ferry_io_buffer_free(l->io, blk);
    return rc;
}

static uint64_t round_capacity(uint64_t bytes, uint64_t align, uint64_t stripe, unsigned drives)
{
    uint64_t c = align_up(bytes, align);
    if (drives > 1)
        c = align_up(c, stripe * drives);
    return c;
}

static int check_against_options(ferry_pslab *p, const ferry_pslab_options *o,
                                 const ferry__pslab_geom *g, const char *path)
{
    if (o->n_dirs != g->drives)
        return fail(p, FERRY_EMISMATCH, "pslab: %s belongs to a slab of %u drives, %u "
                    "directories given", path, g->drives, o->n_dirs);
    if (o->alignment && o->alignment != g->alignment)
        return fail(p, FERRY_EMISMATCH, "pslab: %s has alignment %u, %zu asked", path,
                    g->alignment, o->alignment);
    if (o->stripe_bytes && g->drives > 1 && o->stripe_bytes != g->stripe)
        return fail(p, FERRY_EMISMATCH, "pslab: %s has stripe %llu, %zu asked", path,
                    (unsigned long long)g->stripe, o->stripe_bytes);
    if (o->bytes && round_capacity(o->bytes, g->alignment, g->stripe, g->drives) != g->capacity)
        return fail(p, FERRY_EMISMATCH, "pslab: %s holds %llu bytes, %llu asked", path,
                    (unsigned long long)g->capacity, (unsigned long long)o->bytes);
    return 0;
}

/* tag bytes as text for a message: printable as is, else hex */
static void tag_text(const uint8_t *t, size_t n, char *out, size_t cap)
{
    if (!n) {
        snprintf(out, cap, "(none)");
        return;
    }
    int printable = 1;
    for (size_t i = 0; i < n; i++)
        printable &= t[i] >= 0x20 && t[i] < 0x7f;
    size_t o = 0;
    out[0] = 0;
    if (printable) {
        snprintf(out, cap, "\"%.*s\"", (int)FERRY__MIN(n, cap - 3), (const char *)t);
        return;
    }
    for (size_t i = 0; i < n && o + 3 < cap; i++)
        o += (size_t)snprintf(out + o, cap - o, "%02x", t[i]);
}

/*
 * For tags of "key=value" fields separated by ';' (the KV store's), name
 * the fields that differ - "heads: 2 here, 4 asked" - so the message says
 * what differs without a diff by eye. Empty when the tags are not of that
 * form.
 */
static void tag_diff(const uint8_t *have, size_t hn, const uint8_t *want, size_t wn, char *out,
                     size_t cap)
{
    size_t o = 0;
    out[0] = 0;
    for (size_t i = 0; i < wn && o + 64 < cap;) {
        size_t j = i;
        while (j < wn && want[j] != ';')
            j++;
        const uint8_t *eq = memchr(want + i, '=', j - i);
        if (eq) {
            size_t kl = (size_t)(eq - (want + i)) + 1; /* "key=" */
            const uint8_t *hv = NULL;
            size_t hl = 0;
            for (size_t a = 0; a < hn;) {
                size_t b = a;
                while (b < hn && have[b] != ';')
                    b++;
                if (b - a >= kl && !memcmp(have + a, want + i, kl)) {
                    hv = have + a + kl;
                    hl = b - a - kl;
                }
                a = b + 1;
            }
            size_t vl = j - i - kl;
            if (!hv || hl != vl || memcmp(hv, want + i + kl, vl)) {
                int k = snprintf(out + o, cap - o, "%s%.*s %.*s here, %.*s asked",
                                 o ? "; " : "", (int)(kl - 1), (const char *)(want + i),
                                 hv ? (int)hl : 4, hv ? (const char *)hv : "none", (int)vl,
                                 (const char *)(want + i + kl));
                if (k < 0 || (size_t)k >= cap - o)
                    break;
                o += (size_t)k;
            }
        }
        i = j + 1;
    }
}

/* the stored tag against the one asked: equal, or FERRY_EMISMATCH quoting both */
static int check_tag(ferry_pslab *p, const ferry_pslab_options *o, const ferry__pslab_hdr *h,
                     const char *path)
{
    if (!o->tag)
        return 0;
    if (h->tag_len == o->tag_len && (!h->tag_len || !memcmp(h->tag, o->tag, o->tag_len)))
        return 0;
    char have[400], want[400], diff[300] = "";
    tag_text(h->tag, h->tag_len, have, sizeof have);
    tag_text(o->tag, o->tag_len, want, sizeof want);
    if (h->tag_len)
        tag_diff(h->tag, h->tag_len, o->tag, o->tag_len, diff, sizeof diff);
    return fail(p, FERRY_EMISMATCH, "pslab: %s was made for %s, not %s%s%s%s: refused, nothing "
                "changed (FERRY_PSLAB_RESET, or `ferry slab check --reset`, starts it empty)",
                path, have, want, diff[0] ? " (" : "", diff, diff[0] ? ")" : "");
}

static int recover(ferry_pslab *p, const ferry_pslab_options *o)
{
    lane *l = &p->cl;
    uint8_t *blk = NULL;
    int rc = ferry_io_buffer_alloc(l->io, FERRY__PSLAB_HDR_BLOCK, (void **)&blk);
    if (rc < 0)
        return ferry__err_set(&p->err, -ENOMEM, "pslab %s: out of memory", p->dirs[0]);
    char why[256];
    for (unsigned i = 0; i < o->n_dirs && rc >= 0; i++) {
        char path[PATH_MAX_];
        slab_path(p, i, path, sizeof path);
        rc = ferry_file_open(l->io, path, file_flags(p), &l->f[i]);
        if (rc < 0) {
            rc = fail_io(p, rc, "pslab: opening slab file %s", path);
            break;
        }
        uint64_t size = 0;
        if ((rc = ferry_file_size(l->f[i], &size)) < 0) {
            rc = fail_io(p, rc, "pslab: size of %s", path);
            break;
        }
        if (size < FERRY__PSLAB_HDR_BLOCK) {
            rc = fail(p, FERRY_ECORRUPT, "pslab: slab file %s is truncated: %llu bytes, "
                      "shorter than its header block", path, (unsigned long long)size);
            break;
        }
        if ((rc = ferry_io_pread(l->io, l->f[i], blk, FERRY__PSLAB_HDR_BLOCK, 0)) < 0) {
            rc = fail_io(p, rc, "pslab: reading the header of %s", path);
            break;
        }
        ferry__pslab_hdr h;
        rc = ferry__pslab_hdr_decode(blk, FERRY__PSLAB_HDR_BLOCK, &h, why, sizeof why);
        if (rc < 0) {
            rc = fail(p, rc, "pslab: slab file %s: %s", path, why);
            break;
        }
        if (i == 0) {
            if ((rc = check_against_options(p, o, &h.g, path)) < 0 ||
                (rc = check_tag(p, o, &h, path)) < 0)
                break;
            p->g = h.g;
            p->data_off = ferry__pslab_data_off(h.g.alignment);
            p->share = h.g.capacity / h.g.drives;
            if (p->direct && h.g.alignment < FERRY_IO_ALIGN) {
                FERRY_LOGW("pslab: %s: alignment %u is below O_DIRECT's %u: buffered I/O",
                           path, h.g.alignment, FERRY_IO_ALIGN);
                p->direct = 0;
                p->st.direct = 0;
            }
        } else if (memcmp(&h.g, &p->g, sizeof h.g) != 0) {
            rc = fail(p, FERRY_EMISMATCH, "pslab: slab file %s belongs to another slab "
                      "(creation id %016llx, the first drive's: %016llx)", path,
                      (unsigned long long)h.g.creation_id,
                      (unsigned long long)p->g.creation_id);
            break;
        }
        if (h.drive != i) {
            rc = fail(p, FERRY_EMISMATCH, "pslab: slab file %s is drive %u of the slab but was "
                      "given as directory %u (directories in another order)", path, h.drive, i);
            break;
        }
        if (size < p->data_off + p->share) {
            rc = fail(p, FERRY_ECORRUPT, "pslab: slab file %s is truncated: %llu bytes, its "
                      "geometry needs %llu", path, (unsigned long long)size,
                      (unsigned long long)(p->data_off + p->share));
            break;
        }
    }
    ferry_io_buffer_free(l->io, blk);
    if (rc < 0)
        return rc;

    unsigned jfl = FERRY_FILE_READ;
    if (!(p->flags & FERRY_PSLAB_READONLY))
        jfl |= FERRY_FILE_WRITE;
    rc = ferry_file_open(l->io, p->jpath, jfl, &p->jf);
    if (rc < 0)
        return fail_io(p, rc, "pslab: opening journal %s", p->jpath);
    uint64_t jlen = 0;
    if ((rc = ferry_file_size(p->jf, &jlen)) < 0)
        return fail_io(p, rc, "pslab: size of %s", p->jpath);
    if (jlen > ((uint64_t)1 << 40))
        return fail(p, FERRY_ECORRUPT, "pslab: journal %s is %llu bytes: not a journal",
                    p->jpath, (unsigned long long)jlen);
    uint8_t *jb = ferry__malloc(jlen ? (size_t)jlen : 1);
    if (!jb)
        return ferry__err_set(&p->err, -ENOMEM, "pslab: out of memory reading journal %s "
                              "(%llu bytes)", p->jpath, (unsigned long long)jlen);
    if (jlen && (rc = ferry_io_pread(l->io, p->jf, jb, (size_t)jlen, 0)) < 0) {
        ferry__free(jb);
        return fail_io(p, rc, "pslab: reading journal %s", p->jpath);
    }
    ferry__pslab_load L;
    rc = ferry__pslab_index_load(jb, (size_t)jlen, &p->g, &p->idx, &p->alloc, &L, why,
                                 sizeof why);
    ferry__free(jb);
    if (rc < 0)
        return fail(p, rc, "pslab: journal %s: %s", p->jpath, why);
    if (L.damaged)
        FERRY_LOGW("pslab: journal %s: %llu bad record(s) from offset %llu (%llu bytes) that "
                   "later commits prove durable: damage, not a torn tail (%llu identified as "
                   "one record with one byte changed: only its key dropped; any other drops "
                   "every chunk recorded before it); %llu chunk(s) dropped%s",
                   p->jpath, (unsigned long long)L.damaged,
                   (unsigned long long)L.bad_off, (unsigned long long)L.damaged_bytes,
                   (unsigned long long)L.damaged_known, (unsigned long long)L.damaged_chunks,
                   (p->flags & FERRY_PSLAB_READONLY) ? " (read-only: file left as is)"
                                                     : "; the journal is rewritten");
    if (L.torn) {
        FERRY_LOGW("pslab: journal %s: bad or torn record at offset %llu; %llu bytes after it "
                   "dropped%s", p->jpath, (unsigned long long)L.good_end,
                   (unsigned long long)(jlen - L.good_end),
                   (p->flags & FERRY_PSLAB_READONLY) ? " (read-only: file left as is)" : "");
        if (!(p->flags & FERRY_PSLAB_READONLY)) {
            rc = ferry_file_truncate(p->jf, L.good_end);
            if (rc == 0)
                rc = ferry_file_sync(p->jf);
            if (rc < 0)
                return fail_io(p, rc, "pslab: cutting journal %s at %llu", p->jpath,
                               (unsigned long long)L.good_end);
        }
    }
    p->jsize = L.good_end;
    p->jversion = L.jh.version;
    if (!(p->flags & FERRY_PSLAB_READONLY)) {
        /* what a killed predecessor appended may still sit in the page
         * cache: on the disk before a barrier may say it is */
        rc = ferry_file_sync(p->jf);
        if (rc < 0)
            return fail_io(p, rc, "pslab: fdatasync of journal %s", p->jpath);
        p->jsynced = p->jsize;
    }
    p->jrecords = L.records;
    p->generation = L.jh.generation;
    p->next_seq = L.next_seq;
    p->st.durable_seq = L.next_seq - 1;
    p->st.recovered = p->idx.count;
    p->st.replayed_records = L.records;
    p->st.dropped_records = L.dropped;
    p->st.torn_bytes = jlen - L.good_end + L.damaged_bytes;
    p->st.damaged_chunks = L.damaged_chunks;
    p->need_compact = !(p->flags & FERRY_PSLAB_READONLY) && (L.damaged || p->jversion < 2);
    return 0;
}

/*
 * No journal in dirs[0]: before creating (which truncates the slab files),
 * make sure the directories do not hold another store given in another
 * order - a journal in a later directory, or a valid slab header in
 * dirs[0] that says it is not drive 0.
 */
static int refuse_foreign(ferry_pslab *p)
{
    for (unsigned i = 0; i < p->n_dirs; i++) {
        char path[PATH_MAX_];
        struct stat st;
        snprintf(path, sizeof path, "%s/%s", p->dirs[i], FERRY_PSLAB_JOURNAL);
        if (i > 0 && stat(path, &st) == 0)
            return fail(p, FERRY_EMISMATCH, "pslab: directory %u (%s) holds the journal of a "
                        "store (its first drive): directories in another order?", i,
                        p->dirs[i]);
        slab_path(p, i, path, sizeof path);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0)
            continue;
        uint8_t blk[FERRY__PSLAB_HDR_BYTES + FERRY_PSLAB_TAG_MAX];
        ssize_t n = pread(fd, blk, sizeof blk, 0);
        close(fd);
        ferry__pslab_hdr h;
        if (n >= (ssize_t)FERRY__PSLAB_HDR_BYTES &&
            ferry__pslab_hdr_decode(blk, (size_t)n, &h, NULL, 0) == 0 && h.drive != i)
            return fail(p, FERRY_EMISMATCH, "pslab: slab file %s is drive %u of a store but "
                        "was given as directory %u (directories in another order)", path,
                        h.drive, i);
    }
    return 0;
}

static void pslab_free(ferry_pslab *p)
{
    for (unsigned i = 0; i < p->nlanes; i++)
        lane_close(&p->lanes[i]);
    ferry__free(p->lanes);
    if (p->jf)
        ferry_file_close(p->jf);
    lane_close(&p->cl);
    if (p->alloc) {
        pend_discard(p, &p->cur);
        pend_discard(p, &p->spare);
    }
    ferry__free(p->cur.buf);
    ferry__free(p->cur.ops);
    ferry__free(p->spare.buf);
    ferry__free(p->spare.ops);
    ferry__pslab_index_fini(&p->idx);
    ferry_slab_destroy(p->alloc);
    for (unsigned i = 0; i < FERRY_PSLAB_MAX_DIRS; i++) {
        ferry__free(p->dirs[i]);
        ferry__dir_unlock(p->lockfd[i]);
    }
    ferry__free(p->tag);
    pthread_mutex_destroy(&p->mu);
    pthread_mutex_destroy(&p->lmu);
    pthread_mutex_destroy(&p->cmu);
    pthread_cond_destroy(&p->lcv);
    pthread_cond_destroy(&p->ccv);
    pthread_cond_destroy(&p->fcv);
    ferry__free(p);
}

/* every option in range before any arithmetic on it: 0 or -EINVAL naming the field */
static int check_options(const ferry_pslab_options *o)
{
    if (!o->dirs || o->n_dirs < 1 || o->n_dirs > FERRY_PSLAB_MAX_DIRS)
        return ferry__err_set(NULL, -EINVAL, "ferry_pslab_open: %u directories (1..%u)",
                              o->n_dirs, FERRY_PSLAB_MAX_DIRS);
    for (unsigned i = 0; i < o->n_dirs; i++)
        if (!o->dirs[i] || !*o->dirs[i] || strlen(o->dirs[i]) > PATH_MAX_ - 64)
            return ferry__err_set(NULL, -EINVAL, "ferry_pslab_open: directory %u is empty or "
                                  "too long (at most %d bytes)", i, PATH_MAX_ - 64);
    if (o->alignment &&
        (o->alignment & (o->alignment - 1) || o->alignment < 512 || o->alignment > (1u << 30)))
        return ferry__err_set(NULL, -EINVAL, "ferry_pslab_open: alignment %zu is not a power "
                              "of two in [512, 1 GiB] (0: 4096 or the stored one)",
                              o->alignment);
    if (o->stripe_bytes > ((uint64_t)1 << 40) ||
        (o->stripe_bytes && o->alignment && o->stripe_bytes % o->alignment))
        return ferry__err_set(NULL, -EINVAL, "ferry_pslab_open: stripe_bytes %zu is not a "
                              "multiple of the alignment %zu up to 2^40", o->stripe_bytes,
                              o->alignment);
    if (o->bytes > ((uint64_t)1 << 56))
        return ferry__err_set(NULL, -EINVAL, "ferry_pslab_open: bytes %llu beyond 2^56",
                              (unsigned long long)o->bytes);
    if (o->sync != FERRY_PSLAB_SYNC_FULL && o->sync != FERRY_PSLAB_SYNC_NONE &&
        o->sync != FERRY_PSLAB_SYNC_BATCH)
        return ferry__err_set(NULL, -EINVAL, "ferry_pslab_open: unknown sync mode %d (0..2)",
                              o->sync);
    unsigned known = FERRY_PSLAB_CREATE | FERRY_PSLAB_READONLY | FERRY_PSLAB_RESET;
    if (o->flags & ~known)
        return ferry__err_set(NULL, -EINVAL, "ferry_pslab_open: unknown flags 0x%x", o->flags);
    if ((o->flags & FERRY_PSLAB_RESET) && (o->flags & FERRY_PSLAB_READONLY))
        return ferry__err_set(NULL, -EINVAL, "ferry_pslab_open: FERRY_PSLAB_RESET with "
                              "FERRY_PSLAB_READONLY");
    if (o->depth > 1024)
        return ferry__err_set(NULL, -EINVAL, "ferry_pslab_open: depth %u (0..1024)", o->depth);
    if (o->lanes > 32)
        return ferry__err_set(NULL, -EINVAL, "ferry_pslab_open: %u lanes (0..32)", o->lanes);
    if (o->compact_bytes > ((uint64_t)1 << 40) || o->batch_bytes > ((uint64_t)1 << 40))
        return ferry__err_set(NULL, -EINVAL, "ferry_pslab_open: compact_bytes %llu / "
                              "batch_bytes %llu: each at most 2^40",
                              (unsigned long long)o->compact_bytes,
                              (unsigned long long)o->batch_bytes);
    if (o->batch_ms > 3600000u)
        return ferry__err_set(NULL, -EINVAL, "ferry_pslab_open: batch_ms %u (0..3600000)",
                              o->batch_ms);
    if (o->tag_len > FERRY_PSLAB_TAG_MAX || (o->tag_len && !o->tag))
        return ferry__err_set(NULL, -EINVAL, "ferry_pslab_open: tag of %zu bytes (at most %u, "
                              "and tag must be given with tag_len)", o->tag_len,
                              FERRY_PSLAB_TAG_MAX);
    return ferry__mode_check(o->mode, "ferry_pslab_open", NULL);
}

/* the first drive's header, when readable: defaults for a reset */
static int old_header(ferry_pslab *p, ferry__pslab_hdr *h, uint8_t *blk)
{
    char path[PATH_MAX_];
    slab_path(p, 0, path, sizeof path);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -errno;
    ssize_t n = pread(fd, blk, FERRY__PSLAB_HDR_BLOCK, 0);
    close(fd);
    if (n < (ssize_t)FERRY__PSLAB_HDR_BYTES)
        return FERRY_ECORRUPT;
    return ferry__pslab_hdr_decode(blk, (size_t)n, h, NULL, 0);
}

/*
 * FERRY_PSLAB_RESET: drop the journal first (without it the slab files are
 * nobody's, so a crash during the reset leaves no store, never a mix), then
 * create a new store over the old files.
 */
static int reset_store(ferry_pslab *p, const ferry_pslab_options *o, ferry_pslab_options *eff)
{
    uint8_t *blk = ferry__malloc(FERRY__PSLAB_HDR_BLOCK);
    if (!blk)
        return ferry__err_set(&p->err, -ENOMEM, "pslab %s: out of memory", p->dirs[0]);
    ferry__pslab_hdr h;
    *eff = *o;
    int have = old_header(p, &h, blk) == 0;
    if (have) {
        if (!eff->bytes)
            eff->bytes = h.g.capacity;
        if (!eff->alignment)
            eff->alignment = h.g.alignment;
        if (!eff->stripe_bytes)
            eff->stripe_bytes = h.g.stripe;
        if (!eff->tag && h.tag_len) {
            ferry__free(p->tag);
            p->tag = ferry__malloc(h.tag_len);
            if (!p->tag) {
                ferry__free(blk);
                return ferry__err_set(&p->err, -ENOMEM, "pslab %s: out of memory", p->dirs[0]);
            }
            memcpy(p->tag, h.tag, h.tag_len);
            p->tag_len = h.tag_len;
        }
    }
    ferry__free(blk);
    char tmp[PATH_MAX_];
    snprintf(tmp, sizeof tmp, "%s/%s", p->dirs[0], FERRY__PSLAB_JOURNAL_TMP);
    unlink(tmp);
    if (unlink(p->jpath) != 0 && errno != ENOENT)
        return ferry__err_set(&p->err, -errno, "pslab: reset: removing journal %s: %s",
                              p->jpath, strerror(errno));
    int rc = fsync_dir(p->dirs[0]);
    if (rc < 0)
        return ferry__err_set(&p->err, rc, "pslab: reset: fsync of directory %s: %s",
                              p->dirs[0], strerror(-rc));
    FERRY_LOGI("pslab %s: reset asked: the old store (if any) is dropped", p->dirs[0]);
    return 0;
}

int ferry_pslab_open(const ferry_pslab_options *o, ferry_pslab **out)
{
    if (!o || !out || o->size < sizeof *o)
        return ferry__err_set(NULL, -EINVAL, "ferry_pslab_open: options and out must be given "
                              "(options.size = sizeof(ferry_pslab_options))");
    int rc = check_options(o);
    if (rc < 0)
        return rc;

    uint64_t t0 = ferry__now_ns();
    ferry_pslab *p = ferry__calloc(1, sizeof *p);
    if (!p)
        return ferry__err_set(NULL, -ENOMEM, "pslab %s: out of memory", o->dirs[0]);
    pthread_mutex_init(&p->mu, NULL);
    pthread_mutex_init(&p->lmu, NULL);
    pthread_mutex_init(&p->cmu, NULL);
    pthread_cond_init(&p->lcv, NULL);
    pthread_cond_init(&p->ccv, NULL);
    for (unsigned i = 0; i < FERRY_PSLAB_MAX_DIRS; i++)
        p->lockfd[i] = -1;
    p->n_dirs = o->n_dirs;
    p->flags = o->flags;
    p->sync_mode = o->sync;
    p->direct = o->direct ? 1 : 0;
    p->mode = o->mode;
    p->st.direct = p->direct;
    p->compact_bytes = o->compact_bytes ? o->compact_bytes : (4u << 20);
    p->batch_bytes = o->batch_bytes ? o->batch_bytes : (64u << 20);
    p->batch_ns = (uint64_t)(o->batch_ms ? o->batch_ms : 100) * 1000000u;
    pthread_cond_init(&p->fcv, NULL);
    p->batch_open = 1;
    for (unsigned i = 0; i < o->n_dirs; i++)
        if (!(p->dirs[i] = ferry__strdup(o->dirs[i])))
            rc = -ENOMEM;
    if (rc == 0 && o->tag_len) {
        if ((p->tag = ferry__malloc(o->tag_len)) != NULL) {
            memcpy(p->tag, o->tag, o->tag_len);
            p->tag_len = (uint32_t)o->tag_len;
        } else {
            rc = -ENOMEM;
        }
    }
    if (rc < 0) {
        pslab_free(p);
        return ferry__err_set(NULL, -ENOMEM, "pslab %s: out of memory", o->dirs[0]);
    }
    snprintf(p->jpath, sizeof p->jpath, "%s/%s", p->dirs[0], FERRY_PSLAB_JOURNAL);

    /* one owner per directory, before any other file in it is touched:
     * two stores on one slab hand each other's bytes back */
    int ro = (o->flags & FERRY_PSLAB_READONLY) != 0;
    int mk = !ro && (o->flags & (FERRY_PSLAB_CREATE | FERRY_PSLAB_RESET));
    for (unsigned i = 0; i < o->n_dirs; i++) {
        if ((rc = ferry__mkdir_p(p->dirs[i], p->mode, mk, &p->err)) < 0 ||
            (rc = ferry__dir_lock(p->dirs[i], p->mode, ro, "pslab", &p->err, &p->lockfd[i])) < 0)
            goto out;
    }

    /* the commit lane: posix, one request at a time (the journal is appended in order) */
    ferry_io_options io = FERRY_IO_OPTIONS_INIT;
    io.engine = "posix";
    io.depth = 1;
    if ((rc = ferry_io_open(&io, &p->cl.io)) < 0) {
        rc = fail_io(p, rc, "pslab %s: opening the journal's I/O engine", p->dirs[0]);
        goto out;
    }
    ferry_pslab_options eff = *o;
    if ((o->flags & FERRY_PSLAB_RESET) && (rc = reset_store(p, o, &eff)) < 0)
        goto out;
    o = &eff;
    struct stat jst;
    if (stat(p->jpath, &jst) != 0) {
        int e = errno;
        if (e == ENOENT && !(o->flags & FERRY_PSLAB_RESET) && (rc = refuse_foreign(p)) < 0)
            goto out;
        if (e != ENOENT || !(o->flags & (FERRY_PSLAB_CREATE | FERRY_PSLAB_RESET)) || ro) {
            rc = ferry__err_set(&p->err, -e, "pslab: no store in %s (journal %s: %s)%s",
                                p->dirs[0], p->jpath, strerror(e),
                                e == ENOENT ? "; FERRY_PSLAB_CREATE creates one" : "");
            goto out;
        }
        if (!o->bytes) {
            rc = ferry__err_set(&p->err, -EINVAL, "pslab: creating a store in %s needs a size "
                                "(options.bytes)", p->dirs[0]);
            goto out;
        }
        ferry__pslab_geom g;
        g.alignment = (uint32_t)(o->alignment ? o->alignment : 4096);
        g.drives = o->n_dirs;
        g.stripe = o->stripe_bytes ? o->stripe_bytes : (1u << 20);
        if (g.stripe % g.alignment) {
            rc = ferry__err_set(&p->err, -EINVAL, "pslab %s: stripe %llu is not a multiple of "
                                "the alignment %u", p->dirs[0],
                                (unsigned long long)g.stripe, g.alignment);
            goto out;
        }
        g.capacity = round_capacity(o->bytes, g.alignment, g.stripe, g.drives);
        g.creation_id = new_creation_id();
        char why[256];
        if ((rc = ferry__pslab_geom_check(&g, why, sizeof why)) < 0) {
            rc = ferry__err_set(&p->err, -EINVAL, "pslab %s: %s", p->dirs[0], why);
            goto out;
        }
        p->data_off = ferry__pslab_data_off(g.alignment);
        p->share = g.capacity / g.drives;
        if ((rc = create_store(p, &g)) < 0)
            goto out;
    }
    if ((rc = recover(p, o)) < 0)
        goto out;
    if (p->need_compact) {
        /* damage dropped chunks: a rewrite keeps them dropped after the bad
         * bytes are gone; a format 1 journal becomes format 2 (barriers) */
        pthread_mutex_lock(&p->cmu);
        p->committing = 1;
        pthread_mutex_unlock(&p->cmu);
        rc = compact_locked(p);
        pthread_mutex_lock(&p->cmu);
        p->committing = 0;
        pthread_mutex_unlock(&p->cmu);
        if (rc < 0)
            goto out;
    }

    unsigned nlanes = o->lanes ? o->lanes : 2;
    p->lanes = ferry__calloc(nlanes, sizeof *p->lanes);
    if (!p->lanes) {
        rc = ferry__err_set(&p->err, -ENOMEM, "pslab %s: out of memory", p->dirs[0]);
        goto out;
    }
    for (unsigned i = 0; i < nlanes; i++) {
        if ((rc = lane_open(p, &p->lanes[i], o->engine, o->depth ? o->depth : 4)) < 0)
            goto out;
        p->nlanes = i + 1;
        p->free_lanes |= 1u << i;
    }
    if (p->sync_mode == FERRY_PSLAB_SYNC_BATCH && !ro) {
        if (pthread_create(&p->flusher, NULL, flusher_main, p) != 0) {
            rc = ferry__err_set(&p->err, -EAGAIN, "pslab %s: cannot start the batch flusher "
                                "thread", p->dirs[0]);
            goto out;
        }
        p->flusher_on = 1;
    }
    p->st.open_ns = ferry__now_ns() - t0;
    *out = p;
    return 0;
out:
    /* keep the message of the failure, not of the cleanup */
    {
        ferry__errbuf keep = p->err;
        pslab_free(p);
        return ferry__err_set(NULL, rc, "%s", keep.msg[0] ? keep.msg : ferry_strerror(rc));
    }
}

int ferry_pslab_close(ferry_pslab *p)
{
    if (!p)
        return 0;
    int rc = 0;
    if (p->flusher_on) {
        pthread_mutex_lock(&p->cmu);
        p->stopping = 1;
        pthread_cond_signal(&p->fcv);
        pthread_mutex_unlock(&p->cmu);
        pthread_join(p->flusher, NULL);
        p->flusher_on = 0;
    }
    if (!(p->flags & FERRY_PSLAB_READONLY) && !p->failed) {
        pthread_mutex_lock(&p->cmu);
        if (p->cur.n || p->dirty)
            run_commit(p, 1);
        rc = p->failed;
        /* a journal with history (overwritten, deleted or forgotten chunks'
         * records) is rewritten as one record per live chunk: a record
         * damaged later can then only lose its own chunk, never let an
         * older record of its key speak for it */
        pthread_mutex_lock(&p->mu);
        int want = !p->failed && p->jrecords > (uint64_t)p->idx.count;
        pthread_mutex_unlock(&p->mu);
        pthread_mutex_unlock(&p->cmu);
        if (want && compact_locked(p) < 0)
            FERRY_LOGW("%s", ferry__err_msg(&p->err));
    }
    if (rc < 0)
        rc = ferry__err_set(NULL, rc, "%s", ferry__err_msg(&p->err));
    pslab_free(p);
    return rc;
}

const char *ferry_pslab_last_error(const ferry_pslab *p)
{
    return p ? ferry__err_msg(&p->err) : "";
}

/* ---- put ---- */
static int check_key(ferry_pslab *p, const void *key, size_t klen)
{
    if (!key || klen == 0 || klen > FERRY_PSLAB_KEY_MAX)
        return ferry__err_set(&p->err, -EINVAL, "pslab %s: key of %zu bytes (1..%u)",
                              p->dirs[0], klen, FERRY_PSLAB_KEY_MAX);
    return 0;
}

/* cmu held: whether committing the open batch would free an extent (a
 * forget's or a replaced chunk's waits for its record to be durable) */
static int batch_frees(const ferry_pslab *p)
{
    for (size_t i = 0; i < p->cur.n; i++)
        if (p->cur.ops[i].victim || p->cur.ops[i].type == FERRY__PSLAB_DEL)
            return 1;
    return 0;
}

/*
 * No free extent fits: extents of forgotten, deleted and replaced chunks
 * come back only when their records are durable, and in SYNC_BATCH mode
 * (the KV store's evictions are forgets) nothing else commits until the
 * batch is big or old. So a full slab first commits what would free space
 * - or waits for the commit in flight, which may - before a put fails.
 * Returns 1 when a commit ran (try again), 0 when none could help.
 */
static int reclaim_by_commit(ferry_pslab *p)
{
    pthread_mutex_lock(&p->cmu);
    int ran = 0;
    if (!p->failed && !(p->flags & FERRY_PSLAB_READONLY)) {
        if (p->committing) {
            uint64_t b = p->batch_open;
            while (p->committing && p->batch_open == b && !p->failed)
                pthread_cond_wait(&p->ccv, &p->cmu);
            ran = 1;
        } else if (batch_frees(p)) {
            run_commit(p, 0);
            ran = !p->failed;
        }
    }
    pthread_mutex_unlock(&p->cmu);
    if (ran) {
        pthread_mutex_lock(&p->mu);
        p->st.space_commits++;
        pthread_mutex_unlock(&p->mu);
    }
    return ran;
}

/* allocate an extent for len bytes and write data there; *out: the entry to queue */
static int put_data(ferry_pslab *p, const void *key, size_t klen, const void *data, size_t len,
                    ferry__pslab_ent **out)
{
    int rc = check_key(p, key, klen);
    if (rc < 0)
        return rc;
    if (!data || len == 0 || len > p->g.capacity)
        return ferry__err_set(&p->err, -EINVAL, "pslab %s: put of %zu bytes (1..%llu)",
                              p->dirs[0], len, (unsigned long long)p->g.capacity);
    ferry__pslab_ent *e = ferry__pslab_ent_new(key, klen);
    if (!e)
        return ferry__err_set(&p->err, -ENOMEM, "pslab %s: out of memory for an entry",
                              p->dirs[0]);
    e->length = len;
    ferry_extent x;
    /* a bound on the retries: other writers may take what a commit freed */
    for (int tries = 0;; tries++) {
        pthread_mutex_lock(&p->mu);
        rc = ferry_slab_alloc_bytes(p->alloc, len, &x);
        if (rc >= 0)
            ferry_slab_commit(p->alloc, x.offset);
        pthread_mutex_unlock(&p->mu);
        if (rc != FERRY_ENOSPACE || tries >= 16 || !reclaim_by_commit(p))
            break;
    }
    if (rc < 0) {
        pthread_mutex_lock(&p->mu);
        p->st.failures++;
        pthread_mutex_unlock(&p->mu);
    }
    if (rc < 0) {
        ferry__free(e);
        if (rc == FERRY_ENOSPACE)
            return ferry__err_set(&p->err, rc, "pslab %s: no free extent of %zu bytes (slab "
                                  "of %llu bytes full or fragmented)", p->dirs[0], len,
                                  (unsigned long long)p->g.capacity);
        return ferry__err_set(&p->err, rc, "pslab %s: allocating %zu bytes: %s", p->dirs[0],
                              len, ferry_slab_last_error(p->alloc));
    }
    e->offset = x.offset;
    e->ext = x.size;
    rc = 0; /* ferry_slab_alloc_bytes returned its count */
    lane *l = lane_get(p);
    const void *src = data;
    size_t wlen = len;
    if (p->direct && ((uintptr_t)data % FERRY_IO_ALIGN || len != x.size)) {
        rc = lane_stage(p, l, x.size);
        if (rc == 0) {
            memcpy(l->stage, data, len);
            memset((uint8_t *)l->stage + len, 0, x.size - len);
            src = l->stage;
        }
    }
    if (p->direct)
        wlen = x.size;
    if (rc == 0)
        rc = data_write_sum(p, l, src, wlen, x.offset, data, len, &e->sum);
    lane_put(p, l);
    if (rc < 0) {
        pthread_mutex_lock(&p->mu);
        ent_release(p, e);
        p->st.failures++;
        pthread_mutex_unlock(&p->mu);
        return rc;
    }
    *out = e;
    return 0;
}

int ferry_pslab_put(ferry_pslab *p, const void *key, size_t klen, const void *data, size_t len)
{
    if (!p)
        return ferry__err_set(NULL, -EINVAL, "ferry_pslab_put: NULL store");
    int rc = writable(p);
    if (rc < 0)
        return rc;
    ferry__pslab_ent *e = NULL;
    if ((rc = put_data(p, key, klen, data, len, &e)) < 0)
        return rc;
    pthread_mutex_lock(&p->cmu);
    if (p->failed) {
        rc = ferry__err_set(&p->err, FERRY_ESTATE, "pslab %s: the journal failed earlier (%s); "
                            "reopen the store", p->dirs[0], ferry_err_name(p->failed));
    } else if (p->sync_mode == FERRY_PSLAB_SYNC_BATCH &&
               (rc = pend_add_visible(p, e)) == 0) {
        /* the flusher commits a full batch (and one that is batch_ms old),
         * so the writer goes on while the fdatasyncs run */
        if (p->cur_data >= p->batch_bytes)
            pthread_cond_signal(&p->fcv);
        /* but never more than two batches queued: the writer waits for
         * the commit that takes them, which bounds what a crash can lose
         * (and how far the writers run ahead of the disk) */
        int waited = 0;
        while (!p->failed && !p->stopping && p->cur_data >= 2 * p->batch_bytes) {
            pthread_cond_wait(&p->ccv, &p->cmu);
            waited = 1;
        }
        /* a commit that failed while this put waited took every queued put
         * back out of the index, this one with them: say so */
        int failed = waited ? p->failed : 0;
        pthread_mutex_unlock(&p->cmu);
        pthread_mutex_lock(&p->mu);
        if (failed)
            p->st.failures++;
        else
            p->st.puts++;
        pthread_mutex_unlock(&p->mu);
        if (failed)
            return ferry__err_set(&p->err, FERRY_ESTATE,
                                  "pslab %s: put of %zu bytes: the commit of its batch failed "
                                  "(%s); the chunk was not kept",
                                  p->dirs[0], len, ferry_err_name(failed));
        return 0;
    } else if (p->sync_mode != FERRY_PSLAB_SYNC_BATCH &&
               (rc = pend_add(p, FERRY__PSLAB_PUT, e, 0)) == 0) {
        rc = commit_wait(p, p->batch_open);
        pthread_mutex_unlock(&p->cmu);
        pthread_mutex_lock(&p->mu);
        if (rc == 0)
            p->st.puts++;
        pthread_mutex_unlock(&p->mu);
        return rc;
    }
    pthread_mutex_unlock(&p->cmu);
    pthread_mutex_lock(&p->mu);
    ent_release(p, e);
    p->st.failures++;
    pthread_mutex_unlock(&p->mu);
    return rc;
}

int ferry_pslab_put_many(ferry_pslab *p, ferry_pslab_item *items, size_t n)
{
    if (!p || (!items && n))
        return ferry__err_set(p ? &p->err : NULL, -EINVAL, "ferry_pslab_put_many: NULL");
    int rc = writable(p);
    if (rc < 0)
        return rc;
    ferry__pslab_ent **ents = n ? ferry__calloc(n, sizeof *ents) : NULL;
    if (n && !ents)
        return ferry__err_set(&p->err, -ENOMEM, "pslab %s: out of memory", p->dirs[0]);
    for (size_t i = 0; i < n; i++)
        items[i].result =
            put_data(p, items[i].key, items[i].klen, items[i].data, items[i].len, &ents[i]);
    pthread_mutex_lock(&p->cmu);
    size_t queued = 0;
    for (size_t i = 0; i < n; i++) {
        if (items[i].result < 0)
            continue;
        if (p->failed)
            items[i].result = FERRY_ESTATE;
        else if (p->sync_mode == FERRY_PSLAB_SYNC_BATCH)
            items[i].result = pend_add_visible(p, ents[i]);
        else
            items[i].result = pend_add(p, FERRY__PSLAB_PUT, ents[i], 0);
        if (items[i].result < 0) {
            pthread_mutex_lock(&p->mu);
            ent_release(p, ents[i]);
            pthread_mutex_unlock(&p->mu);
        } else {
            queued++;
        }
    }
    rc = queued ? commit_wait(p, p->batch_open) : 0;
    pthread_mutex_unlock(&p->cmu);
    ferry__free(ents);
    size_t ok = 0;
    for (size_t i = 0; i < n; i++) {
        if (rc < 0 && items[i].result == 0)
            items[i].result = rc;
        ok += items[i].result == 0;
    }
    pthread_mutex_lock(&p->mu);
    p->st.puts += ok;
    p->st.failures += n - ok;
    pthread_mutex_unlock(&p->mu);
    if (rc < 0)
        return rc;
    return (int)ok;
}

int ferry_pslab_delete(ferry_pslab *p, const void *key, size_t klen)
{
    if (!p)
        return ferry__err_set(NULL, -EINVAL, "ferry_pslab_delete: NULL store");
    int rc = writable(p);
    if (rc < 0 || (rc = check_key(p, key, klen)) < 0)
        return rc;
    ferry__pslab_ent *d = ferry__pslab_ent_new(key, klen);
    if (!d)
        return ferry__err_set(&p->err, -ENOMEM, "pslab %s: out of memory", p->dirs[0]);
    pthread_mutex_lock(&p->cmu);
    pthread_mutex_lock(&p->mu);
    ferry__pslab_ent *e = ferry__pslab_index_find(&p->idx, key, klen, d->hash);
    uint64_t seq = e ? e->seq : 0;
    pthread_mutex_unlock(&p->mu);
    if (!e) {
        pthread_mutex_unlock(&p->cmu);
        ferry__free(d);
        return ferry__err_set(&p->err, FERRY_ENOTFOUND, "pslab %s: delete: key not found",
                              p->dirs[0]);
    }
    if (p->failed)
        rc = ferry__err_set(&p->err, FERRY_ESTATE, "pslab %s: the journal failed earlier",
                            p->dirs[0]);
    else if ((rc = pend_add(p, FERRY__PSLAB_DEL, d, seq)) == 0)
        rc = commit_wait(p, p->batch_open);
    else
        ferry__free(d);
    pthread_mutex_unlock(&p->cmu);
    if (rc == 0) {
        pthread_mutex_lock(&p->mu);
        p->st.deletes++;
        pthread_mutex_unlock(&p->mu);
    }
    return rc;
}

int ferry_pslab_forget(ferry_pslab *p, const void *key, size_t klen)
{
    if (!p)
        return ferry__err_set(NULL, -EINVAL, "ferry_pslab_forget: NULL store");
    int rc = writable(p);
    if (rc < 0 || (rc = check_key(p, key, klen)) < 0)
        return rc;
    ferry__pslab_ent *d = ferry__pslab_ent_new(key, klen);
    if (!d)
        return ferry__err_set(&p->err, -ENOMEM, "pslab %s: out of memory", p->dirs[0]);
    pthread_mutex_lock(&p->cmu);
    if (p->failed) {
        pthread_mutex_unlock(&p->cmu);
        ferry__free(d);
        return ferry__err_set(&p->err, FERRY_ESTATE, "pslab %s: the journal failed earlier",
                              p->dirs[0]);
    }
    pthread_mutex_lock(&p->mu);
    ferry__pslab_ent *e = ferry__pslab_index_find(&p->idx, key, klen, d->hash);
    if (e && (rc = pend_add(p, FERRY__PSLAB_DEL, d, e->seq)) == 0) {
        /* out of the index now; its extent is freed once the delete is durable */
        p->cur.ops[p->cur.n - 1].victim = e;
        ferry__pslab_index_unlink(&p->idx, e);
        p->st.deletes++;
    }
    pthread_mutex_unlock(&p->mu);
    pthread_mutex_unlock(&p->cmu);
    if (!e) {
        ferry__free(d);
        return ferry__err_set(&p->err, FERRY_ENOTFOUND, "pslab %s: forget: key not found",
                              p->dirs[0]);
    }
    if (rc < 0)
        ferry__free(d);
    return rc;
}

int ferry_pslab_sync(ferry_pslab *p)
{
    if (!p)
        return ferry__err_set(NULL, -EINVAL, "ferry_pslab_sync: NULL store");
    if (p->flags & FERRY_PSLAB_READONLY)
        return 0;
    pthread_mutex_lock(&p->cmu);
    int rc = 0;
    for (;;) {
        if (p->failed) {
            rc = ferry__err_set(&p->err, p->failed, "pslab %s: the journal failed (%s)",
                                p->dirs[0], ferry_err_name(p->failed));
            break;
        }
        if (!p->committing) {
            if (p->cur.n || p->dirty)
                run_commit(p, 1);
            rc = p->failed;
            break;
        }
        pthread_cond_wait(&p->ccv, &p->cmu);
    }
    pthread_mutex_unlock(&p->cmu);
    return rc;
}

/* ---- get ---- */
/* queue a delete of the put `seq` of e's key, not waiting (a dropped corrupt entry) */
static void drop_lazily(ferry_pslab *p, const ferry__pslab_ent *e, uint64_t seq)
{
    if (p->flags & FERRY_PSLAB_READONLY)
        return;
    ferry__pslab_ent *d = ferry__pslab_ent_new(e->key, e->klen);
    if (!d)
        return;
    pthread_mutex_lock(&p->cmu);
    if (p->failed || pend_add(p, FERRY__PSLAB_DEL, d, seq) < 0)
        ferry__free(d);
    pthread_mutex_unlock(&p->cmu);
}

/*
 * Read e's bytes (pinned by the caller) into dst (cap bytes; NULL: into the
 * lane's staging buffer only) and check them.
 */
static int read_chunk(ferry_pslab *p, const ferry__pslab_ent *e, void *dst, size_t cap)
{
    lane *l = lane_get(p);
    int rc = 0;
    void *into = dst;
    size_t rlen = p->direct ? e->ext : e->length;
    if (!dst || (p->direct && ((uintptr_t)dst % FERRY_IO_ALIGN || cap < e->ext))) {
        rc = lane_stage(p, l, e->ext);
        into = l->stage;
    }
    if (rc == 0)
        rc = data_rw(p, l, FERRY_IO_READ, into, rlen, e->offset);
    if (rc == 0 && XXH3_64bits(into, e->length) != e->sum)
        rc = ferry__err_set(&p->err, FERRY_ECORRUPT,
                            "pslab %s: chunk of %llu bytes at slab offset %llu (sequence %llu) "
                            "fails its checksum: dropped", p->dirs[0],
                            (unsigned long long)e->length, (unsigned long long)e->offset,
                            (unsigned long long)e->seq);
    if (rc == 0 && dst && into != dst)
        memcpy(dst, into, e->length);
    else if (rc < 0 && dst)
        memset(dst, 0, FERRY__MIN(cap, e->length));
    lane_put(p, l);
    return rc;
}

/* mu held: e (pinned) failed its checksum: take it out of the index */
static int drop_corrupt(ferry_pslab *p, ferry__pslab_ent *e)
{
    p->st.corrupt++;
    if (e->doomed)
        return 0;
    ferry__pslab_index_unlink(&p->idx, e);
    e->doomed = 1;
    return 1;
}

int ferry_pslab_get(ferry_pslab *p, const void *key, size_t klen, void *buf, size_t cap,
                    size_t *len)
{
    if (!p)
        return ferry__err_set(NULL, -EINVAL, "ferry_pslab_get: NULL store");
    int rc = check_key(p, key, klen);
    if (rc < 0)
        return rc;
    if (!buf || !len)
        return ferry__err_set(&p->err, -EINVAL, "pslab %s: get needs buf and len", p->dirs[0]);
    uint64_t h = ferry__pslab_key_hash(key, klen);
    pthread_mutex_lock(&p->mu);
    p->st.gets++;
    ferry__pslab_ent *e = ferry__pslab_index_find(&p->idx, key, klen, h);
    if (!e) {
        p->st.misses++;
        pthread_mutex_unlock(&p->mu);
        return ferry__err_set(&p->err, FERRY_ENOTFOUND, "pslab %s: get: key not found",
                              p->dirs[0]);
    }
    if (e->length > cap) {
        uint64_t need = e->length;
        pthread_mutex_unlock(&p->mu);
        return ferry__err_set(&p->err, -ENOBUFS, "pslab %s: get: chunk of %llu bytes, buffer "
                              "of %zu", p->dirs[0], (unsigned long long)need, cap);
    }
    e->pins++;
    pthread_mutex_unlock(&p->mu);
    rc = read_chunk(p, e, buf, cap);
    pthread_mutex_lock(&p->mu);
    int dropped = 0;
    uint64_t seq = e->seq;
    if (rc == FERRY_ECORRUPT) {
        p->st.misses++;
        dropped = drop_corrupt(p, e);
    } else if (rc == 0) {
        p->st.hits++;
        *len = e->length;
    } else {
        p->st.failures++;
    }
    ferry__pslab_ent *copy = dropped ? ferry__pslab_ent_new(e->key, e->klen) : NULL;
    unpin(p, e);
    pthread_mutex_unlock(&p->mu);
    if (copy) {
        drop_lazily(p, copy, seq);
        ferry__free(copy);
    }
    return rc;
}

int ferry_pslab_stat(ferry_pslab *p, const void *key, size_t klen, ferry_pslab_info *out)
{
    if (!p)
        return ferry__err_set(NULL, -EINVAL, "ferry_pslab_stat: NULL store");
    int rc = check_key(p, key, klen);
    if (rc < 0)
        return rc;
    if (!out)
        return ferry__err_set(&p->err, -EINVAL, "pslab %s: stat: out is NULL", p->dirs[0]);
    uint64_t h = ferry__pslab_key_hash(key, klen);
    pthread_mutex_lock(&p->mu);
    ferry__pslab_ent *e = ferry__pslab_index_find(&p->idx, key, klen, h);
    if (e) {
        out->offset = e->offset;
        out->length = e->length;
        out->checksum = e->sum;
        out->seq = e->seq;
    }
    pthread_mutex_unlock(&p->mu);
    if (!e)
        return ferry__err_set(&p->err, FERRY_ENOTFOUND, "pslab %s: stat: key not found",
                              p->dirs[0]);
    return 0;
}

int ferry_pslab_iterate(ferry_pslab *p, ferry_pslab_iter_fn fn, void *ctx)
{
    if (!p || !fn)
        return ferry__err_set(p ? &p->err : NULL, -EINVAL, "ferry_pslab_iterate: NULL");
    int rc = 0;
    pthread_mutex_lock(&p->mu);
    for (size_t i = 0; i < p->idx.nb && rc == 0; i++)
        for (ferry__pslab_ent *e = p->idx.b[i]; e && rc == 0; e = e->hnext) {
            ferry_pslab_info info = {e->offset, e->length, e->sum, e->seq};
            rc = fn(e->key, e->klen, &info, ctx);
        }
    pthread_mutex_unlock(&p->mu);
    return rc;
}

int ferry_pslab_verify(ferry_pslab *p, int repair, uint64_t *bad, ferry_pslab_bad_fn report,
                       void *ctx)
{
    if (!p)
        return ferry__err_set(NULL, -EINVAL, "ferry_pslab_verify: NULL store");
    if (repair && (p->flags & FERRY_PSLAB_READONLY))
        return ferry__err_set(&p->err, FERRY_ESTATE, "pslab %s: repair of a read-only store",
                              p->dirs[0]);
    pthread_mutex_lock(&p->mu);
    size_t n = p->idx.count, k = 0;
    ferry__pslab_ent **v = ferry__malloc((n ? n : 1) * sizeof *v);
    if (!v) {
        pthread_mutex_unlock(&p->mu);
        return ferry__err_set(&p->err, -ENOMEM, "pslab %s: out of memory", p->dirs[0]);
    }
    for (size_t i = 0; i < p->idx.nb; i++)
        for (ferry__pslab_ent *e = p->idx.b[i]; e; e = e->hnext) {
            e->pins++;
            v[k++] = e;
        }
    pthread_mutex_unlock(&p->mu);
    uint64_t nbad = 0;
    int rc = 0;
    for (size_t i = 0; i < k; i++) {
        ferry__pslab_ent *e = v[i];
        int r = rc < 0 ? 0 : read_chunk(p, e, NULL, 0);
        if (r < 0 && r != FERRY_ECORRUPT)
            rc = r;
        if (r == FERRY_ECORRUPT) {
            nbad++;
            if (report) {
                ferry_pslab_info info = {e->offset, e->length, e->sum, e->seq};
                report(e->key, e->klen, &info, r, ctx);
            }
        }
        pthread_mutex_lock(&p->mu);
        int dropped = (r == FERRY_ECORRUPT && repair) ? drop_corrupt(p, e) : 0;
        if (r == FERRY_ECORRUPT && !repair)
            p->st.corrupt++;
        uint64_t seq = e->seq;
        ferry__pslab_ent *copy = dropped ? ferry__pslab_ent_new(e->key, e->klen) : NULL;
        unpin(p, e);
        pthread_mutex_unlock(&p->mu);
        if (copy) {
            drop_lazily(p, copy, seq);
            ferry__free(copy);
        }
    }
    ferry__free(v);
    if (rc == 0 && repair && nbad)
        rc = ferry_pslab_sync(p);
    if (rc == 0 && bad)
        *bad = nbad;
    return rc;
}

int ferry_pslab_stats_get(ferry_pslab *p, ferry_pslab_stats *out)
{
    if (!p || !out)
        return ferry__err_set(p ? &p->err : NULL, -EINVAL, "ferry_pslab_stats_get: NULL");
    ferry_slab_stats ss;
    pthread_mutex_lock(&p->cmu);
    int failed = p->failed;
    pthread_mutex_unlock(&p->cmu);
    pthread_mutex_lock(&p->mu);
    uint64_t jsize = p->jsize, jrec = p->jrecords, gen = p->generation;
    ferry_pslab_stats s = p->st;
    ferry_slab_stats_get(p->alloc, &ss);
    s.capacity = p->g.capacity;
    s.alignment = p->g.alignment;
    s.drives = p->g.drives;
    s.stripe_bytes = p->g.stripe;
    s.creation_id = p->g.creation_id;
    s.chunks = p->idx.count;
    s.bytes_stored = p->idx.bytes_stored;
    s.bytes_used = ss.used;
    s.fragmentation = ss.fragmentation;
    pthread_mutex_unlock(&p->mu);
    s.journal_bytes = jsize;
    s.journal_records = jrec;
    s.generation = gen;
    s.failed = failed != 0;
    *out = s;
    return 0;
}
