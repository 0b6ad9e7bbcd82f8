/*
 * pslab.c - the persistent slab's I/O lanes, group commit, compaction and
 * data operations (put, get, delete, forget, stat, iterate, verify,
 * stats). pslab_impl.h holds the store's design: its invariants, the
 * group commit and the lock order.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#include "io/io_impl.h"
#include "pslab/pslab_impl.h"

int ferry__pslab_fail(ferry_pslab *p, int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int rc = ferry__err_vset(&p->err, code, fmt, ap);
    va_end(ap);
    return rc;
}

/* message with the lower layer's last error appended */
int ferry__pslab_fail_io(ferry_pslab *p, int code, const char *fmt, ...)
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

int ferry__pslab_fsync_dir(const char *dir)
{
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        return -errno;
    int rc = fsync(fd) == 0 ? 0 : -errno;
    close(fd);
    return rc;
}

void ferry__pslab_slab_path(const ferry_pslab *p, unsigned i, char *out, size_t n)
{
    snprintf(out, n, "%s/%s", p->dirs[i], FERRY_PSLAB_FILE);
}

unsigned ferry__pslab_file_flags(const ferry_pslab *p)
{
    unsigned fl = FERRY_FILE_READ;
    if (!(p->flags & FERRY_PSLAB_READONLY))
        fl |= FERRY_FILE_WRITE;
    if (p->direct)
        fl |= FERRY_FILE_DIRECT;
    return fl;
}

void ferry__pslab_lane_close(lane *l)
{
    for (unsigned i = 0; i < FERRY_PSLAB_MAX_DIRS; i++)
        if (l->f[i])
            ferry_file_close(l->f[i]);
    if (l->stage)
        ferry_io_buffer_free(l->io, l->stage);
    ferry_io_close(l->io);
    memset(l, 0, sizeof *l);
}

int ferry__pslab_lane_open(ferry_pslab *p, lane *l, const char *engine, unsigned depth)
{
    ferry_io_options io = FERRY_IO_OPTIONS_INIT;
    io.engine = engine;
    io.depth = depth;
    int rc = ferry_io_open(&io, &l->io);
    if (rc < 0)
        return ferry__pslab_fail_io(p, rc, "pslab %s: opening an I/O engine (%s)", p->dirs[0],
                                    engine ? engine : "auto");
    for (unsigned i = 0; i < p->g.drives; i++) {
        char path[PATH_MAX_];
        ferry__pslab_slab_path(p, i, path, sizeof path);
        rc = ferry_file_open(l->io, path, ferry__pslab_file_flags(p), &l->f[i]);
        if (rc < 0) {
            rc = ferry__pslab_fail_io(p, rc, "pslab: opening slab file %s", path);
            ferry__pslab_lane_close(l);
            return rc;
        }
        if (i == 0 && p->direct && !ferry_file_is_direct(l->f[0]))
            p->st.direct = 0;
    }
    return 0;
}

lane *ferry__pslab_lane_get(ferry_pslab *p)
{
    pthread_mutex_lock(&p->lmu);
    while (!p->free_lanes)
        pthread_cond_wait(&p->lcv, &p->lmu);
    unsigned i = (unsigned)__builtin_ctz(p->free_lanes);
    p->free_lanes &= ~(1u << i);
    pthread_mutex_unlock(&p->lmu);
    return &p->lanes[i];
}

void ferry__pslab_lane_put(ferry_pslab *p, lane *l)
{
    pthread_mutex_lock(&p->lmu);
    p->free_lanes |= 1u << (unsigned)(l - p->lanes);
    pthread_cond_signal(&p->lcv);
    pthread_mutex_unlock(&p->lmu);
}

int ferry__pslab_lane_stage(ferry_pslab *p, lane *l, size_t n)
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
int ferry__pslab_data_rw(ferry_pslab *p, lane *l, int op, void *buf, uint64_t len, uint64_t off)
{
    uint8_t *b = buf;
    while (len) {
        unsigned d;
        uint64_t seg, foff;
        stripe_at(p, off, len, &d, &seg, &foff);
        int rc = op == FERRY_IO_WRITE ? ferry_io_pwrite(l->io, l->f[d], b, seg, foff)
                                      : ferry_io_pread(l->io, l->f[d], b, seg, foff);
        if (rc < 0)
            return ferry__pslab_fail_io(p, rc, "pslab: %s of %llu bytes at slab offset %llu "
                                        "(file %s, offset %llu)",
                                        op == FERRY_IO_WRITE ? "write" : "read",
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
int ferry__pslab_data_write_sum(ferry_pslab *p, lane *l, const void *buf, uint64_t len,
                                uint64_t off, const void *data, size_t dlen, uint64_t *sum)
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
                rc = ferry__pslab_fail_io(p, rc, "pslab: write of %llu bytes at slab offset "
                                          "%llu (file %s, offset %llu)", (unsigned long long)seg,
                                          (unsigned long long)off, ferry_file_path(l->f[d]),
                                          (unsigned long long)foff);
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
                rc = ferry__pslab_fail_io(p, r2, "pslab: write of %llu bytes at slab offset "
                                          "%llu (file %s, offset %llu)",
                                          (unsigned long long)slen[i], (unsigned long long)soff[i],
                                          ferry_file_path(l->f[sdrv[i]]),
                                          (unsigned long long)foffs[i]);
        }
    }
    if (!hashed)
        *sum = XXH3_64bits(data, dlen);
    return rc;
}

void ferry__pslab_ent_release(ferry_pslab *p, ferry__pslab_ent *e)
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
int ferry__pslab_pend_add(ferry_pslab *p, int type, ferry__pslab_ent *e, uint64_t del_seq)
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
                ferry__pslab_ent_release(p, q->ops[i].victim);
            } else if (old && old->seq == e->seq) {
                ferry__pslab_index_unlink(&p->idx, old);
                ferry__pslab_ent_release(p, old);
            }
            ferry__free(e);
            continue;
        }
        if (q->ops[i].inserted) {
            /* in the index since its put: now durable */
            e->pending = 0;
            if (q->ops[i].victim)
                ferry__pslab_ent_release(p, q->ops[i].victim);
            if (e->doomed)
                ferry__pslab_ent_release(p, e);
            continue;
        }
        if (old) {
            ferry__pslab_index_unlink(&p->idx, old);
            ferry__pslab_ent_release(p, old);
        }
        ferry__pslab_index_insert(&p->idx, e);
    }
    q->n = 0;
    q->len = 0;
}

/* mu held: the batch will never be durable: give its extents back */
void ferry__pslab_pend_discard(ferry_pslab *p, pend *q)
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
                ferry__pslab_ent_release(p, v);
        }
        if (o->type == FERRY__PSLAB_DEL)
            ferry__free(e);
        else
            ferry__pslab_ent_release(p, e);
    }
    q->n = 0;
    q->len = 0;
}

int ferry__pslab_sync_slab_files(ferry_pslab *p)
{
    for (unsigned i = 0; i < p->g.drives; i++) {
        int rc = ferry_file_sync(p->cl.f[i]);
        if (rc < 0)
            return ferry__pslab_fail_io(p, rc, "pslab: fdatasync of slab file %s",
                                        ferry_file_path(p->cl.f[i]));
    }
    return 0;
}

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
void ferry__pslab_run_commit(ferry_pslab *p, int force_sync)
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
        rc = ferry__pslab_sync_slab_files(p);
    if (rc == 0 && q.len) {
        /* everything before this batch is on the disk: say so in its first
         * record, so that replay can tell damage before it from a torn tail */
        if (p->jversion >= 2 && p->jsynced == p->jsize)
            ferry__pslab_rec_set_barrier(q.buf, p->g.creation_id);
        rc = ferry_io_pwrite(p->cl.io, p->jf, q.buf, q.len, p->jsize);
        if (rc < 0)
            rc = ferry__pslab_fail_io(p, rc, "pslab: append of %zu journal bytes at offset "
                                      "%llu of %s", q.len, (unsigned long long)p->jsize,
                                      p->jpath);
    }
    if (rc == 0 && full && (q.len || (force_sync && had_dirty))) {
        rc = ferry_file_sync(p->jf);
        if (rc < 0)
            rc = ferry__pslab_fail_io(p, rc, "pslab: fdatasync of journal %s", p->jpath);
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
        int crc = ferry__pslab_compact_locked(p);
        if (crc < 0)
            warn_compaction(p);
    }

    pthread_mutex_lock(&p->cmu);
    if (rc < 0) {
        /* nothing queued will become durable: undo newest first (later batch, then ours) */
        p->failed = rc;
        pthread_mutex_lock(&p->mu);
        ferry__pslab_pend_discard(p, &p->cur);
        ferry__pslab_pend_discard(p, &q);
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
int ferry__pslab_commit_wait(ferry_pslab *p, uint64_t mine)
{
    for (;;) {
        if (p->durable >= mine)
            return 0;
        if (p->failed)
            return ferry__err_set(&p->err, p->failed,
                                  "pslab %s: the journal failed (%s); the store refuses writes "
                                  "until it is reopened", p->dirs[0], ferry_err_name(p->failed));
        if (!p->committing) {
            ferry__pslab_run_commit(p, 0);
            continue;
        }
        pthread_cond_wait(&p->ccv, &p->cmu);
    }
}

/*
 * cmu held, SYNC_BATCH: queue the put of e and make it visible at once; the
 * entry it replaces leaves the index now and is freed when e is durable.
 */
int ferry__pslab_pend_add_visible(ferry_pslab *p, ferry__pslab_ent *e)
{
    int rc = ferry__pslab_pend_add(p, FERRY__PSLAB_PUT, e, 0);
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

void *ferry__pslab_flusher_main(void *arg)
{
    ferry_pslab *p = arg;
    pthread_mutex_lock(&p->cmu);
    while (!p->stopping) {
        if (!p->committing && !p->failed && batch_due(p)) {
            ferry__pslab_run_commit(p, 0);
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

int ferry__pslab_writable(ferry_pslab *p)
{
    if (p->flags & FERRY_PSLAB_READONLY)
        return ferry__err_set(&p->err, FERRY_ESTATE, "pslab %s: opened read-only", p->dirs[0]);
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
int ferry__pslab_reclaim_by_commit(ferry_pslab *p)
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
            ferry__pslab_run_commit(p, 0);
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
                ferry__pslab_run_commit(p, 1);
            rc = p->failed;
            break;
        }
        pthread_cond_wait(&p->ccv, &p->cmu);
    }
    pthread_mutex_unlock(&p->cmu);
    return rc;
}

/*
 * Called by the commit leader (committing set, no lock held): write one
 * record per live entry to a new journal, sync it, rename it over the old
 * one, sync the directory, switch to it.
 */
int ferry__pslab_compact_locked(ferry_pslab *p)
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
        rc = ferry__pslab_fail_io(p, rc, "pslab: compacting into %s", tmp);
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
    rc = ferry__pslab_fsync_dir(p->dirs[0]);
    if (rc < 0)
        return ferry__err_set(&p->err, rc, "pslab: fsync of directory %s after compaction: %s",
                              p->dirs[0], strerror(-rc));
    return 0;
}

int ferry_pslab_compact(ferry_pslab *p)
{
    if (!p)
        return ferry__err_set(NULL, -EINVAL, "ferry_pslab_compact: NULL store");
    int rc = ferry__pslab_writable(p);
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
        rc = ferry__pslab_commit_wait(p, mine);
    if (rc == 0) {
        while (p->committing)
            pthread_cond_wait(&p->ccv, &p->cmu);
        p->committing = 1;
        pthread_mutex_unlock(&p->cmu);
        rc = p->sync_mode == FERRY_PSLAB_SYNC_NONE ? ferry__pslab_sync_slab_files(p) : 0;
        if (rc == 0)
            rc = ferry__pslab_compact_locked(p);
        pthread_mutex_lock(&p->cmu);
        p->committing = 0;
        pthread_cond_broadcast(&p->ccv);
    }
    pthread_mutex_unlock(&p->cmu);
    return rc;
}

static int check_key(ferry_pslab *p, const void *key, size_t klen)
{
    if (!key || klen == 0 || klen > FERRY_PSLAB_KEY_MAX)
        return ferry__err_set(&p->err, -EINVAL, "pslab %s: key of %zu bytes (1..%u)",
                              p->dirs[0], klen, FERRY_PSLAB_KEY_MAX);
    return 0;
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
        if (rc != FERRY_ENOSPACE || tries >= 16 || !ferry__pslab_reclaim_by_commit(p))
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
    lane *l = ferry__pslab_lane_get(p);
    const void *src = data;
    size_t wlen = len;
    if (p->direct && ((uintptr_t)data % FERRY_IO_ALIGN || len != x.size)) {
        rc = ferry__pslab_lane_stage(p, l, x.size);
        if (rc == 0) {
            memcpy(l->stage, data, len);
            memset((uint8_t *)l->stage + len, 0, x.size - len);
            src = l->stage;
        }
    }
    if (p->direct)
        wlen = x.size;
    if (rc == 0)
        rc = ferry__pslab_data_write_sum(p, l, src, wlen, x.offset, data, len, &e->sum);
    ferry__pslab_lane_put(p, l);
    if (rc < 0) {
        pthread_mutex_lock(&p->mu);
        ferry__pslab_ent_release(p, e);
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
    int rc = ferry__pslab_writable(p);
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
               (rc = ferry__pslab_pend_add_visible(p, e)) == 0) {
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
               (rc = ferry__pslab_pend_add(p, FERRY__PSLAB_PUT, e, 0)) == 0) {
        rc = ferry__pslab_commit_wait(p, p->batch_open);
        pthread_mutex_unlock(&p->cmu);
        pthread_mutex_lock(&p->mu);
        if (rc == 0)
            p->st.puts++;
        pthread_mutex_unlock(&p->mu);
        return rc;
    }
    pthread_mutex_unlock(&p->cmu);
    pthread_mutex_lock(&p->mu);
    ferry__pslab_ent_release(p, e);
    p->st.failures++;
    pthread_mutex_unlock(&p->mu);
    return rc;
}

int ferry_pslab_put_many(ferry_pslab *p, ferry_pslab_item *items, size_t n)
{
    if (!p || (!items && n))
        return ferry__err_set(p ? &p->err : NULL, -EINVAL, "ferry_pslab_put_many: NULL");
    int rc = ferry__pslab_writable(p);
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
            items[i].result = ferry__pslab_pend_add_visible(p, ents[i]);
        else
            items[i].result = ferry__pslab_pend_add(p, FERRY__PSLAB_PUT, ents[i], 0);
        if (items[i].result < 0) {
            pthread_mutex_lock(&p->mu);
            ferry__pslab_ent_release(p, ents[i]);
            pthread_mutex_unlock(&p->mu);
        } else {
            queued++;
        }
    }
    rc = queued ? ferry__pslab_commit_wait(p, p->batch_open) : 0;
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
    int rc = ferry__pslab_writable(p);
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
    else if ((rc = ferry__pslab_pend_add(p, FERRY__PSLAB_DEL, d, seq)) == 0)
        rc = ferry__pslab_commit_wait(p, p->batch_open);
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
    int rc = ferry__pslab_writable(p);
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
    if (e && (rc = ferry__pslab_pend_add(p, FERRY__PSLAB_DEL, d, e->seq)) == 0) {
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

static void unpin(ferry_pslab *p, ferry__pslab_ent *e)
{
    if (--e->pins == 0 && e->doomed)
        ferry__pslab_ent_release(p, e);
}

/* queue a delete of the put `seq` of e's key, not waiting (a dropped corrupt entry) */
static void drop_lazily(ferry_pslab *p, const ferry__pslab_ent *e, uint64_t seq)
{
    if (p->flags & FERRY_PSLAB_READONLY)
        return;
    ferry__pslab_ent *d = ferry__pslab_ent_new(e->key, e->klen);
    if (!d)
        return;
    pthread_mutex_lock(&p->cmu);
    if (p->failed || ferry__pslab_pend_add(p, FERRY__PSLAB_DEL, d, seq) < 0)
        ferry__free(d);
    pthread_mutex_unlock(&p->cmu);
}

/*
 * Read e's bytes (pinned by the caller) into dst (cap bytes; NULL: into the
 * lane's staging buffer only) and check them.
 */
static int read_chunk(ferry_pslab *p, const ferry__pslab_ent *e, void *dst, size_t cap)
{
    lane *l = ferry__pslab_lane_get(p);
    int rc = 0;
    void *into = dst;
    size_t rlen = p->direct ? e->ext : e->length;
    if (!dst || (p->direct && ((uintptr_t)dst % FERRY_IO_ALIGN || cap < e->ext))) {
        rc = ferry__pslab_lane_stage(p, l, e->ext);
        into = l->stage;
    }
    if (rc == 0)
        rc = ferry__pslab_data_rw(p, l, FERRY_IO_READ, into, rlen, e->offset);
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
    ferry__pslab_lane_put(p, l);
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
