/*
 * pslab_commit.c - the persistent slab's group commit: the pending batch,
 * the commit leader, the batch flusher, reclaim by commit and
 * ferry_pslab_sync.
 *
 * Invariant: a record reaches the journal only after the slab bytes it
 * names are fdatasync'ed, and the index changes only after the record is
 * durable, in sequence order, in the one leader (committing set) - so the
 * index callers see is one the journal reproduces after a crash. A failed
 * write or sync undoes every queued op, newest first, and fails the store
 * until it is reopened (fsyncgate: nothing queued can be trusted to reach
 * the disk). Extents leave only through ent_release, which waits for pins
 * (readers) and pending records, so no byte is reused while a reader or the
 * journal may still name it. pslab_impl.h lists the store's invariants.
 */
#include <errno.h>
#include <string.h>
#include <time.h>

#include "pslab/pslab_impl.h"

void ferry__pslab_ent_release(ferry_pslab *p, ferry__pslab_ent *e)
{
    /* a reader holds it, or its own record is still queued: the last one frees it */
    if (e->pins || e->pending) {
        e->doomed = 1;
        return;
    }
    /* after a failed journal write or sync no extent goes back to the
     * allocator: records of the failed batch may be on the disk (a short
     * append, a failed fdatasync of written pages), and a later write into
     * their extents would leave them naming another chunk's bytes. The
     * reopen rebuilds the allocator from what the journal really holds. */
    ferry_extent x = {e->offset, e->ext};
    if (e->ext && !p->frozen)
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
    size_t sz = type == FERRY__PSLAB_PUT ? ferry__pslab_rec_size_p(e->klen, e->npieces)
                                         : ferry__pslab_rec_size(e->klen);
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
        if (e->piece) {
            r.type = FERRY__PSLAB_PUTP;
            r.piece = e->piece;
            r.npieces = e->npieces;
            r.psum = e->psum;
        }
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
    size_t nrec = q.n, wrote = q.len; /* pend_apply empties q */
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
        /* nothing queued will become durable: undo newest first (later batch,
         * then ours). Some of ours may be on the disk all the same (whole
         * records before the point where an append ran out of space, or all
         * of them when only the fdatasync failed): their extents stay
         * allocated (frozen) until a reopen reads what the journal holds. */
        p->failed = rc;
        pthread_mutex_lock(&p->mu);
        p->frozen = 1;
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
        else if (wrote) /* records written, not synced: the next sync must */
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
        uint64_t wait = p->batch_ns / 2 ? p->batch_ns / 2 : 1000000;
        struct timespec ts = ferry__deadline_ms((wait + 999999) / 1000000);
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
