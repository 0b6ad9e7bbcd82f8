/*
 * gds_xfer.c - device transfers: a slice of device memory to or from the
 * slab, synchronous (ferry_gds_transfer) or queued on a stream
 * (ferry_gds_transfer_async).
 *
 * A transfer is resolved first (under mu) into segments, each inside one
 * registered region and one stripe unit; the driver then receives each
 * segment as (region base, offset into it, drive handle, file offset).
 * Every drive a transfer touches is locked (in index order) while its
 * segments are submitted, so the drives work at once.
 *
 * Invariant (async): every submission's argument block (size, file offset,
 * buffer offset, bytes done) stays alive until a checkpoint event recorded
 * after it has completed: cuFile reads those through pointers when the
 * stream reaches the op, long after the call returned. One event per
 * FERRY_GDS_CHECKPOINT_EVERY submissions keeps the event count low; a
 * batch is freed when its event completes (polled at each submission) or
 * at a stream sync. All batches a call needs are allocated before its
 * first submission, so running out of memory never strands a half-queued
 * transfer.
 */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "gds_impl.h"

/* ---- async argument batches ---- */

static void harvest(ferry_gds *g, gstream *st, abatch *b)
{
    for (unsigned i = 0; i < b->n; i++) {
        argblk *a = &b->a[i];
        if (a->done == (int64_t)a->size || st->err)
            continue;
        int code = a->done < 0 ? (int)a->done : FERRY_ESHORT;
        st->err = code;
        snprintf(st->errmsg, sizeof st->errmsg,
                 "async %s of %zu bytes at slab offset %llu (drive %u %s, file offset %lld): "
                 "%s%s",
                 ferry__gds_dirname(a->op), a->size, (unsigned long long)a->slab_off, a->drive,
                 g->drives[a->drive].path, (long long)a->file_off,
                 a->done < 0 ? ferry_strerror(code) : "short transfer, ",
                 a->done < 0 ? "" : "bytes missing");
    }
    g->async_pending -= b->n;
    if (b->ev)
        ferry_event_destroy(b->ev);
    ferry__free(b);
}

/* free the closed batches whose checkpoint has passed */
static void poll_batches(ferry_gds *g, gstream *st)
{
    while (st->head && ferry_event_query(st->head->ev) == 0) {
        abatch *b = st->head;
        st->head = b->next;
        if (!st->head)
            st->tail = NULL;
        harvest(g, st, b);
    }
}

/* after the stream is synchronized: every batch is done */
void ferry__gds_drain_batches(ferry_gds *g, gstream *st)
{
    while (st->head) {
        abatch *b = st->head;
        st->head = b->next;
        harvest(g, st, b);
    }
    st->tail = NULL;
    if (st->open) {
        harvest(g, st, st->open);
        st->open = NULL;
    }
}

/* close the open batch with a checkpoint event; if no event can be had,
 * wait for the stream instead (slower, never unsafe) */
static void checkpoint(ferry_gds *g, gstream *st)
{
    abatch *b = st->open;
    st->open = NULL;
    ferry_event *ev = NULL;
    if (g->dev && ferry_event_create(g->dev, &ev) == 0 && ferry_event_record(ev, st->s) == 0) {
        b->ev = ev;
        b->next = NULL;
        if (st->tail)
            st->tail->next = b;
        else
            st->head = b;
        st->tail = b;
        atomic_fetch_add(&g->checkpoints, 1);
        return;
    }
    if (ev)
        ferry_event_destroy(ev);
    FERRY_LOGD("gds: no checkpoint event (%s): synchronizing the stream", ferry_last_error());
    ferry_stream_sync(st->s);
    b->ev = NULL;
    ferry__gds_drain_batches(g, st);
    harvest(g, st, b);
}

/* ---- segments ---- */

int ferry__gds_check_range(ferry_gds *g, const char *what, uint64_t slab_off, size_t len)
{
    if (!g->on)
        return ferry__err_set(&g->err, FERRY_ESTATE, "gds: %s: the context is off", what);
    if (len == 0)
        return ferry__err_set(&g->err, -EINVAL, "gds: %s at slab offset %llu: length 0", what,
                              (unsigned long long)slab_off);
    if (!FERRY__IS_ALIGNED(slab_off, g->align) || !FERRY__IS_ALIGNED(len, g->align))
        return ferry__err_set(&g->err, FERRY_EALIGN,
                              "gds: %s of %zu bytes at slab offset %llu: offset and length must "
                              "be multiples of %zu",
                              what, len, (unsigned long long)slab_off, g->align);
    if (slab_off > g->size || len > g->size - slab_off)
        return ferry__err_set(&g->err, FERRY_EBOUNDS,
                              "gds: %s of %zu bytes at slab offset %llu: past the slab's end "
                              "(%llu bytes)",
                              what, len, (unsigned long long)slab_off,
                              (unsigned long long)g->size);
    return 0;
}

static int segv_push(segv *sv, seg s)
{
    if (sv->n == sv->cap) {
        size_t nc = sv->cap * 2;
        seg *nv = ferry__malloc(nc * sizeof *nv);
        if (!nv)
            return -ENOMEM;
        memcpy(nv, sv->v, sv->n * sizeof *nv);
        if (sv->v != sv->small)
            ferry__free(sv->v);
        sv->v = nv;
        sv->cap = nc;
    }
    sv->v[sv->n++] = s;
    return 0;
}

static void segv_init(segv *sv)
{
    sv->v = sv->small;
    sv->n = 0;
    sv->cap = FERRY__ARRAY_LEN(sv->small);
}

static void segv_free(segv *sv)
{
    if (sv->v != sv->small)
        ferry__free(sv->v);
}

/* the device slice [buf, buf+len) at slab_off -> segments, each inside one
 * region and one stripe unit; caller holds mu */
static int resolve(ferry_gds *g, int dir, uint64_t slab_off, size_t len, ferry_devptr buf,
                   segv *sv)
{
    size_t pos = 0;
    while (pos < len) {
        ferry_devptr p = buf + pos;
        const region *r = ferry__gds_region_find(g, p);
        if (!r)
            return ferry__err_set(&g->err, FERRY_EBOUNDS,
                                  "gds: %s of %zu bytes at slab offset %llu: device address 0x%llx "
                                  "(byte %zu of the slice 0x%llx) is in no registered region",
                                  ferry__gds_dirname(dir), len, (unsigned long long)slab_off,
                                  (unsigned long long)p, pos, (unsigned long long)buf);
        size_t in_region = FERRY__MIN(len - pos, (size_t)(r->base + r->len - p));
        size_t q = 0;
        while (q < in_region) {
            unsigned d;
            uint64_t foff, run;
            ferry__stripe_map(g->stripe, g->ndrives, slab_off + pos + q, &d, &foff, &run);
            size_t n = (size_t)FERRY__MIN((uint64_t)(in_region - q), run);
            seg s = {d, r->base, (int64_t)(p + q - r->base), (int64_t)foff, n, slab_off + pos + q};
            if (segv_push(sv, s) < 0)
                return ferry__err_set(&g->err, -ENOMEM, "gds: %s of %zu bytes: out of memory",
                                      ferry__gds_dirname(dir), len);
            q += n;
        }
        pos += in_region;
    }
    return 0;
}

static void lock_drives(ferry_gds *g, const unsigned char *used)
{
    for (unsigned d = 0; d < g->ndrives; d++)
        if (used[d])
            pthread_mutex_lock(&g->drives[d].mu);
}

static void unlock_drives(ferry_gds *g, const unsigned char *used)
{
    for (unsigned d = g->ndrives; d-- > 0;)
        if (used[d])
            pthread_mutex_unlock(&g->drives[d].mu);
}

static int seg_fail(ferry_gds *g, int dir, const seg *s, int code, const char *cause)
{
    return ferry__err_set(&g->err, code,
                          "gds: %s of %zu bytes at slab offset %llu (drive %u %s, file offset "
                          "%lld; region 0x%llx + %lld) with the %s driver: %s",
                          ferry__gds_dirname(dir), s->size, (unsigned long long)s->slab_off, s->drive,
                          g->drives[s->drive].path, (long long)s->file_off,
                          (unsigned long long)s->base, (long long)s->buf_off, g->drv.name, cause);
}

/* one segment through read/write, continuing short transfers */
static int seg_io(ferry_gds *g, int dir, seg s)
{
    const seg orig = s;
    while (s.size) {
        atomic_fetch_add(&g->driver_ios, 1);
        int64_t r = dir == FERRY_GDS_READ
                        ? g->drv.read(g->drv.ctx, g->drives[s.drive].handle, s.base, s.size,
                                      s.file_off, s.buf_off)
                        : g->drv.write(g->drv.ctx, g->drives[s.drive].handle, s.base, s.size,
                                       s.file_off, s.buf_off);
        if (r < 0) {
            char m[FERRY__ERRMSG_MAX];
            snprintf(m, sizeof m, "%s (%s)", ferry_strerror((int)r), ferry_last_error());
            return seg_fail(g, dir, &orig, (int)r, m);
        }
        if (r == 0 || (uint64_t)r > s.size)
            return seg_fail(g, dir, &orig, FERRY_ESHORT,
                            r == 0 ? "the driver moved 0 bytes" : "the driver overran");
        s.size -= (size_t)r;
        s.file_off += r;
        s.buf_off += r;
    }
    return 0;
}

static int run_sync(ferry_gds *g, int dir, segv *sv)
{
    int rc = 0;
    if (sv->n > 1 && g->drv.batch) {
        ferry_gds_io small[32], *ios = small;
        if (sv->n > FERRY__ARRAY_LEN(small) && !(ios = ferry__malloc(sv->n * sizeof *ios)))
            ios = NULL; /* one at a time instead */
        if (ios) {
            for (size_t i = 0; i < sv->n; i++) {
                const seg *s = &sv->v[i];
                ios[i] = (ferry_gds_io){dir,     g->drives[s->drive].handle, s->base, s->size,
                                        s->file_off, s->buf_off,           -1};
            }
            rc = g->drv.batch(g->drv.ctx, ios, (unsigned)sv->n);
            if (rc != FERRY_ENOTSUP) {
                atomic_fetch_add(&g->driver_ios, sv->n);
                /* continue short ones; report the first failure */
                rc = 0;
                for (size_t i = 0; i < sv->n && rc == 0; i++) {
                    int64_t r = ios[i].result;
                    seg s = sv->v[i];
                    if (r < 0) {
                        char m[64];
                        snprintf(m, sizeof m, "%s (batch)", ferry_strerror((int)r));
                        rc = seg_fail(g, dir, &s, (int)r, m);
                    } else if ((uint64_t)r < s.size) {
                        s.size -= (size_t)r;
                        s.file_off += r;
                        s.buf_off += r;
                        rc = seg_io(g, dir, s);
                    }
                }
                if (ios != small)
                    ferry__free(ios);
                return rc;
            }
            if (ios != small)
                ferry__free(ios);
            rc = 0; /* no batch API in this library: one at a time */
        }
    }
    for (size_t i = 0; i < sv->n && rc == 0; i++)
        rc = seg_io(g, dir, sv->v[i]);
    return rc;
}

static void mark_drives(ferry_gds *g, const segv *sv, unsigned char *used)
{
    memset(used, 0, FERRY_GDS_MAX_DIRS);
    for (size_t i = 0; i < sv->n; i++)
        used[sv->v[i].drive] = 1;
}

int ferry_gds_transfer(ferry_gds *g, int dir, uint64_t slab_off, size_t len, ferry_devptr buf,
                       ferry_stream *s)
{
    if (!g)
        return ferry__err_set(NULL, -EINVAL, "gds: transfer on a NULL context");
    if (dir != FERRY_GDS_READ && dir != FERRY_GDS_WRITE)
        return ferry__err_set(&g->err, -EINVAL, "gds: transfer direction %d", dir);
    segv sv;
    segv_init(&sv);
    pthread_mutex_lock(&g->mu);
    int rc = ferry__gds_check_range(g, ferry__gds_dirname(dir), slab_off, len);
    if (rc == 0)
        rc = resolve(g, dir, slab_off, len, buf, &sv);
    pthread_mutex_unlock(&g->mu);
    if (rc == 0 && s && (rc = ferry_stream_sync(s)) < 0)
        rc = ferry__err_set(&g->err, rc, "gds: %s at slab offset %llu: stream sync: %s",
                            ferry__gds_dirname(dir), (unsigned long long)slab_off, ferry_last_error());
    if (rc == 0) {
        unsigned char used[FERRY_GDS_MAX_DIRS];
        mark_drives(g, &sv, used);
        lock_drives(g, used);
        rc = run_sync(g, dir, &sv);
        unlock_drives(g, used);
    }
    if (rc == 0)
        atomic_fetch_add(dir == FERRY_GDS_READ ? &g->bytes_read : &g->bytes_written, len);
    segv_free(&sv);
    return rc;
}

typedef int (*async_fn)(void *, void *, ferry_devptr, size_t *, int64_t *, int64_t *, int64_t *,
                        ferry_stream *);

static void spares_free(abatch *spare)
{
    while (spare) {
        abatch *b = spare;
        spare = b->next;
        ferry__free(b);
    }
}

/* every argument block n more submissions on st need, before the first
 * submission; -ENOMEM allocates none */
static int spares_alloc(ferry_gds *g, int dir, const gstream *st, size_t n, abatch **out)
{
    abatch *spare = NULL;
    size_t room = st->open ? FERRY_GDS_CHECKPOINT_EVERY - st->open->n : 0;
    for (size_t need = n > room ? n - room : 0; need > 0;) {
        abatch *b = ferry__calloc(1, sizeof *b);
        if (!b) {
            spares_free(spare);
            return ferry__err_set(&g->err, -ENOMEM, "gds: async %s: out of memory",
                                  ferry__gds_dirname(dir));
        }
        b->next = spare;
        spare = b;
        need -= FERRY__MIN(need, (size_t)FERRY_GDS_CHECKPOINT_EVERY);
    }
    *out = spare;
    return 0;
}

/* queue sv's segments on st with the driver's async call, each with its
 * argument block in the open batch (caller holds mu and the drives) */
static int submit_async(ferry_gds *g, int dir, gstream *st, segv *sv, abatch **spare,
                        async_fn afn, ferry_stream *s)
{
    int rc = 0;
    for (size_t i = 0; i < sv->n; i++) {
        const seg *sg = &sv->v[i];
        if (!st->open) {
            st->open = *spare;
            *spare = (*spare)->next;
            st->open->next = NULL;
        }
        argblk *a = &st->open->a[st->open->n++];
        *a = (argblk){sg->size, sg->file_off, sg->buf_off, 0, sg->slab_off, sg->drive, dir};
        g->async_pending++;
        atomic_fetch_add(&g->driver_ios, 1);
        int r = afn(g->drv.ctx, g->drives[sg->drive].handle, sg->base, &a->size, &a->file_off,
                    &a->buf_off, &a->done, s);
        if (r == FERRY_ENOTSUP) {
            /* this library has no async call: finish synchronously, in order */
            a->done = (int64_t)a->size;
            r = ferry_stream_sync(s);
            if (r == 0) {
                segv rest = {sv->v + i, sv->n - i, sv->n - i, {{0}}};
                r = run_sync(g, dir, &rest);
            }
            if (st->open->n == FERRY_GDS_CHECKPOINT_EVERY)
                checkpoint(g, st);
            if (r < 0)
                rc = r;
            break;
        }
        if (r < 0) {
            a->done = (int64_t)a->size; /* never queued: nothing to wait for */
            char m[FERRY__ERRMSG_MAX];
            snprintf(m, sizeof m, "%s (async submission; earlier segments stay queued)",
                     ferry_last_error());
            rc = seg_fail(g, dir, sg, r, m);
            break;
        }
        if (st->open->n == FERRY_GDS_CHECKPOINT_EVERY)
            checkpoint(g, st);
    }
    return rc;
}

int ferry_gds_transfer_async(ferry_gds *g, int dir, uint64_t slab_off, size_t len,
                             ferry_devptr buf, ferry_stream *s)
{
    if (!g)
        return ferry__err_set(NULL, -EINVAL, "gds: async transfer on a NULL context");
    if (dir != FERRY_GDS_READ && dir != FERRY_GDS_WRITE)
        return ferry__err_set(&g->err, -EINVAL, "gds: async transfer direction %d", dir);
    if (!s) {
        /* the default stream (cuFile's handle 0): ferry's device layer has
         * no queue there to record a checkpoint on or to wait for, so an
         * argument block handed to an async call could never be known to
         * be released; the transfer is done now instead, as the default
         * stream would have done it, with its errors returned here */
        return ferry_gds_transfer(g, dir, slab_off, len, buf, NULL);
    }
    segv sv;
    segv_init(&sv);
    pthread_mutex_lock(&g->mu);
    int rc = ferry__gds_check_range(g, ferry__gds_dirname(dir), slab_off, len);
    if (rc == 0)
        rc = resolve(g, dir, slab_off, len, buf, &sv);
    async_fn afn = dir == FERRY_GDS_READ ? g->drv.read_async : g->drv.write_async;
    gstream *st = rc == 0 ? ferry__gds_stream_find(g, s) : NULL;
    int new_stream = 0;
    if (rc == 0 && !st) {
        /* a stream no buffer was registered with: tracked for its batches only */
        if (!(st = ferry__gds_stream_new(g, s)))
            rc = ferry__err_set(&g->err, -ENOMEM, "gds: async %s: out of memory",
                                ferry__gds_dirname(dir));
        else
            new_stream = 1;
    }
    abatch *spare = NULL;
    if (rc == 0 && afn)
        rc = spares_alloc(g, dir, st, sv.n, &spare);
    if (rc < 0) {
        if (new_stream)
            ferry__free(st);
        pthread_mutex_unlock(&g->mu);
        segv_free(&sv);
        return rc;
    }
    if (new_stream)
        ferry__gds_stream_link(g, st);
    unsigned char used[FERRY_GDS_MAX_DIRS];
    mark_drives(g, &sv, used);
    lock_drives(g, used);
    if (!afn) {
        /* no async entry: order after the stream's work, then move synchronously */
        rc = ferry_stream_sync(s);
        if (rc < 0)
            rc = ferry__err_set(&g->err, rc, "gds: async %s: stream sync: %s",
                                ferry__gds_dirname(dir), ferry_last_error());
        else
            rc = run_sync(g, dir, &sv);
    } else {
        rc = submit_async(g, dir, st, &sv, &spare, afn, s);
    }
    unlock_drives(g, used);
    spares_free(spare);
    poll_batches(g, st);
    pthread_mutex_unlock(&g->mu);
    if (rc == 0)
        atomic_fetch_add(dir == FERRY_GDS_READ ? &g->bytes_read : &g->bytes_written, len);
    segv_free(&sv);
    return rc;
}

int ferry_gds_stream_sync(ferry_gds *g, ferry_stream *s)
{
    if (!g)
        return ferry__err_set(NULL, -EINVAL, "gds: stream sync on a NULL context");
    int rc = 0;
    if (s && (rc = ferry_stream_sync(s)) < 0)
        rc = ferry__err_set(&g->err, rc, "gds: stream sync: %s", ferry_last_error());
    pthread_mutex_lock(&g->mu);
    gstream *st = ferry__gds_stream_find(g, s);
    if (st) {
        ferry__gds_drain_batches(g, st);
        if (st->err) {
            if (rc == 0)
                rc = ferry__err_set(&g->err, st->err, "gds: %s", st->errmsg);
            st->err = 0;
        }
        if (st->nregions == 0 && !st->registered)
            ferry__gds_stream_unlink_free(g, st);
    }
    pthread_mutex_unlock(&g->mu);
    return rc;
}
