/*
 * pslab.c - the persistent slab's data operations: put (one or many), get,
 * delete, forget, stat, iterate, verify and stats.
 *
 * Invariant: a put is acknowledged only once its record is durable
 * (SYNC_FULL, SYNC_NONE: in the journal), or in SYNC_BATCH once its bytes
 * are written and its record queued (visible at once; writers wait when
 * two batches are queued); a get returns bytes only after their XXH3-64
 * matched the one recorded at the put (each piece's, for a chunk written
 * with piece sums: format 3), and pins the entry while it reads,
 * so its extent cannot be reused under it. A chunk that fails its check
 * leaves the index and its delete is queued: corrupt bytes are reported,
 * never returned. pslab_impl.h has the store's design (lock order, group
 * commit, recovery).
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <xxhash.h>

#include "pslab/pslab_impl.h"
#include "sized.h"

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
    /* a failed store writes no byte: its free extents may be named by
     * records of the failed batch (see ent_release), and a put it took
     * would be refused at its commit anyway */
    pthread_mutex_lock(&p->cmu);
    int failed = p->failed;
    pthread_mutex_unlock(&p->cmu);
    if (failed)
        return ferry__err_set(&p->err, FERRY_ESTATE, "pslab %s: the journal failed earlier "
                              "(%s); reopen the store", p->dirs[0], ferry_err_name(failed));
    /* a format 3 store's puts carry piece sums (an upgraded format 2
     * store's older chunks keep their one sum) */
    uint32_t piece = p->piece_puts ? ferry__pslab_piece_for(len, p->g.alignment) : 0;
    ferry__pslab_ent *e =
        ferry__pslab_ent_new_p(key, klen, piece, ferry__pslab_npieces(len, piece));
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
        rc = ferry__pslab_data_write_sum(p, l, src, wlen, x.offset, data, len, e->piece,
                                         e->psum, &e->sum);
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
    ferry__pslab_ent **ents = NULL;
    if (rc == 0 && n && !(ents = ferry__calloc(n, sizeof *ents)))
        rc = ferry__err_set(&p->err, -ENOMEM, "pslab %s: out of memory staging %zu puts",
                            p->dirs[0], n);
    if (rc < 0) { /* nothing stored: every result says why */
        for (size_t i = 0; i < n; i++)
            items[i].result = rc;
        return rc;
    }
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
    if (queued)
        rc = ferry__pslab_commit_wait(p, p->batch_open);
    else if (n && p->failed) /* nothing stored: the journal failed, as put says */
        rc = ferry__err_set(&p->err, FERRY_ESTATE, "pslab %s: the journal failed earlier (%s); "
                            "reopen the store", p->dirs[0], ferry_err_name(p->failed));
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
    if (p->failed) {
        rc = ferry__err_set(&p->err, FERRY_ESTATE, "pslab %s: the journal failed earlier",
                            p->dirs[0]);
        ferry__free(d);
    } else if ((rc = ferry__pslab_pend_add(p, FERRY__PSLAB_DEL, d, seq)) == 0) {
        rc = ferry__pslab_commit_wait(p, p->batch_open);
    } else {
        ferry__free(d);
    }
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

void ferry__pslab_unpin(ferry_pslab *p, ferry__pslab_ent *e)
{
    FERRY__ASSERT(e->pins > 0);
    if (--e->pins == 0 && e->doomed)
        ferry__pslab_ent_release(p, e);
}

ferry__pslab_ent *ferry__pslab_pin_find(ferry_pslab *p, const void *key, size_t klen,
                                        const char *what)
{
    uint64_t h = ferry__pslab_key_hash(key, klen);
    pthread_mutex_lock(&p->mu);
    p->st.gets++;
    ferry__pslab_ent *e = ferry__pslab_index_find(&p->idx, key, klen, h);
    if (e)
        e->pins++;
    else
        p->st.misses++;
    pthread_mutex_unlock(&p->mu);
    if (!e)
        ferry__err_set(&p->err, FERRY_ENOTFOUND, "pslab %s: %s: key not found", p->dirs[0],
                       what);
    return e;
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

/* a key for a message: as text when printable, else hex; long ones cut */
static void key_text(const uint8_t *k, size_t n, char *out, size_t cap)
{
    int printable = 1;
    for (size_t i = 0; i < n; i++)
        printable &= k[i] >= 0x20 && k[i] < 0x7f && k[i] != '"';
    if (printable) {
        snprintf(out, cap, "\"%.*s\"%s", (int)FERRY__MIN(n, (size_t)64), (const char *)k,
                 n > 64 ? "..." : "");
        return;
    }
    size_t o = 0, m = FERRY__MIN(n, (size_t)32);
    out[0] = 0;
    for (size_t i = 0; i < m && o + 3 < cap; i++)
        o += (size_t)snprintf(out + o, cap - o, "%02x", k[i]);
    if (m < n && o + 4 < cap)
        snprintf(out + o, cap - o, "...");
}

/* e's bytes failed their check: say which (piece bad, hashed to got) */
static int corrupt_msg(ferry_pslab *p, const ferry__pslab_ent *e, uint32_t bad, uint64_t got)
{
    char kt[140];
    key_text(e->key, e->klen, kt, sizeof kt);
    if (!e->piece)
        return ferry__err_set(&p->err, FERRY_ECORRUPT,
                              "pslab %s: key %s: chunk of %llu bytes at slab offset %llu "
                              "(sequence %llu) fails its checksum (%016llx, recorded %016llx): "
                              "dropped", p->dirs[0], kt, (unsigned long long)e->length,
                              (unsigned long long)e->offset, (unsigned long long)e->seq,
                              (unsigned long long)got, (unsigned long long)e->sum);
    uint64_t at = (uint64_t)bad * e->piece;
    return ferry__err_set(&p->err, FERRY_ECORRUPT,
                          "pslab %s: key %s: piece %u of %u (%llu bytes at slab offset %llu) "
                          "fails its checksum (%016llx, recorded %016llx): the chunk of %llu "
                          "bytes at slab offset %llu (sequence %llu) is dropped", p->dirs[0],
                          kt, bad, e->npieces,
                          (unsigned long long)FERRY__MIN((uint64_t)e->piece, e->length - at),
                          (unsigned long long)(e->offset + at), (unsigned long long)got,
                          (unsigned long long)e->psum[bad], (unsigned long long)e->length,
                          (unsigned long long)e->offset, (unsigned long long)e->seq);
}

/*
 * Read e's bytes (pinned by the caller) into dst (cap bytes; NULL: into the
 * lane's staging buffer only) and check them: each piece as it lands, or
 * the whole payload (a chunk without piece sums).
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
    uint64_t sum = 0;
    uint32_t bad = 0;
    if (rc == 0)
        rc = ferry__pslab_data_read_sum(p, l, into, rlen, e->offset, e->length, e->piece,
                                        e->psum, &sum, &bad);
    if ((rc == 0 && !e->piece && sum != e->sum) || rc == FERRY_ECORRUPT)
        rc = corrupt_msg(p, e, bad, sum);
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
    ferry__pslab_ent *e = ferry__pslab_pin_find(p, key, klen, "get");
    if (!e)
        return FERRY_ENOTFOUND;
    if (e->length > cap) { /* (an entry's length and place never change) */
        uint64_t need = e->length;
        pthread_mutex_lock(&p->mu);
        ferry__pslab_unpin(p, e);
        pthread_mutex_unlock(&p->mu);
        return ferry__err_set(&p->err, -ENOBUFS, "pslab %s: get: chunk of %llu bytes, buffer "
                              "of %zu", p->dirs[0], (unsigned long long)need, cap);
    }
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
    ferry__pslab_unpin(p, e);
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
        ferry__pslab_unpin(p, e);
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

int ferry_pslab_stats_get(const ferry_pslab *cp, ferry_pslab_stats *out)
{
    if (!cp || !out)
        return ferry__err_set(NULL, -EINVAL, "ferry_pslab_stats_get: store or out is NULL");
    ferry_pslab *p = (ferry_pslab *)cp; /* its mutexes are taken, nothing written */
    ferry_slab_stats ss = FERRY_SLAB_STATS_INIT;
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
    s.size = sizeof s;
    return ferry__stats_put(&p->err, "ferry_pslab_stats_get", out, &s, sizeof s);
}
