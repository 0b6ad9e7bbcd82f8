/*
 * pslab_compact.c - journal compaction: one put record per live chunk, in
 * a new file that replaces the journal by rename.
 *
 * Invariant: the journal is always a whole file - the new one is written
 * and fdatasync'ed under a temporary name and becomes the journal only by
 * the rename (then the directory is synced), so a crash leaves the old
 * journal or the new one, never a mix. Only the commit leader compacts
 * (committing set), so no append lands in the old file after the snapshot;
 * the snapshot is what is durable (queued SYNC_BATCH puts are left out,
 * the durable entries they displaced kept), and its last record is a
 * barrier, because every byte before it is synced.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "pslab/pslab_impl.h"

/* the put record of e, as the journal holds it: with its piece sums when it has them */
static ferry__pslab_rec put_record(const ferry__pslab_ent *e)
{
    ferry__pslab_rec r;
    memset(&r, 0, sizeof r);
    r.type = e->piece ? FERRY__PSLAB_PUTP : FERRY__PSLAB_PUT;
    r.klen = e->klen;
    r.key = e->key;
    r.seq = e->seq;
    r.offset = e->offset;
    r.length = e->length;
    r.sum = e->sum;
    r.piece = e->piece;
    r.npieces = e->npieces;
    r.psum = e->psum;
    return r;
}

/*
 * Called by the commit leader (committing set, no lock held): write one
 * record per live entry to a new journal, sync it, rename it over the old
 * one, sync the directory, switch to it. The new journal is in the format
 * this library writes (an older store's is upgraded: its records stay as
 * they were, its header says the newer format) - never older than the
 * journal it replaces.
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
                bytes += ferry__pslab_rec_size_p(e->klen, e->npieces);
    for (size_t i = 0; i < p->cur.n; i++)
        if (p->cur.ops[i].victim && !p->cur.ops[i].victim->pending)
            bytes += ferry__pslab_rec_size_p(p->cur.ops[i].victim->klen,
                                             p->cur.ops[i].victim->npieces);
    uint8_t *buf = ferry__malloc(bytes);
    if (!buf) {
        pthread_mutex_unlock(&p->mu);
        pthread_mutex_unlock(&p->cmu);
        return ferry__err_set(&p->err, -ENOMEM,
                              "pslab %s: out of memory compacting the journal (%zu bytes)",
                              p->jpath, bytes);
    }
    ferry__pslab_jhdr jh;
    jh.version = FERRY__MAX(p->jversion, ferry__pslab_write_format());
    jh.g = p->g;
    jh.generation = p->generation + 1;
    ferry__pslab_jhdr_encode(&jh, buf);
    size_t pos = FERRY__PSLAB_JHDR_BYTES, last = 0;
    uint64_t n = 0;
    for (size_t i = 0; i < p->idx.nb; i++)
        for (ferry__pslab_ent *e = p->idx.b[i]; e; e = e->hnext) {
            if (e->pending)
                continue;
            ferry__pslab_rec r = put_record(e);
            ferry__pslab_rec_encode(&r, p->g.creation_id, buf + pos);
            last = pos;
            pos += ferry__pslab_rec_size_p(e->klen, e->npieces);
            n++;
        }
    for (size_t i = 0; i < p->cur.n; i++) {
        ferry__pslab_ent *e = p->cur.ops[i].victim;
        if (!e || e->pending)
            continue;
        ferry__pslab_rec r = put_record(e);
        ferry__pslab_rec_encode(&r, p->g.creation_id, buf + pos);
        last = pos;
        pos += ferry__pslab_rec_size_p(e->klen, e->npieces);
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
    p->jversion = jh.version;
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
