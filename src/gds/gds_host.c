/*
 * gds_host.c - host buffers to and from the slab: synchronous
 * (ferry_gds_pread/pwrite) and the asynchronous host-I/O engine
 * (ferry_gds_submit/reap), both straight to the drive queues; host
 * buffer registration and allocation.
 *
 * Invariant: every engine request submitted to a drive completes exactly
 * once into its own hop, whoever reaps: a synchronous hop's caller waits
 * until its hop has nothing left; an asynchronous one lands on the done
 * list, where exactly one ferry_gds_reap takes it (or close drops it).
 * Why: several threads share the drive queues, and a completion reaped by
 * one thread may belong to another's request. An asynchronous hop is on
 * its context's live list, and its request in the process's table
 * (gds_live.c), from submit until reaped; close frees what is left on the
 * live list once the drive queues are closed, whether or not its
 * completions ever arrived (a queue that broke delivers none).
 */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "gds_impl.h"

/* ---- host buffers: straight to the drive queues ----
 *
 * A host transfer ("hop") is cut into engine requests per stripe run; each
 * request's user field points back at its hop. Whoever reaps a drive's
 * queue (under that drive's lock: a ferry_io is single-threaded) delivers
 * every completion to its own hop, whichever thread or call it belongs
 * to; a synchronous call waits until its own hop has nothing left, an
 * asynchronous one lands on the context's done list for ferry_gds_reap.
 */

typedef struct hop {
    struct hop *next;          /* done list */
    struct hop *lprev, *lnext; /* async: the live list, from submit until reaped */
    ferry_gds_req *req;        /* async: the caller's request; NULL when synchronous */
    ferry__gds_live reg;       /* async: req in the process's table */
    ferry_io_req *io;          /* n engine requests */
    size_t n;
    size_t left[FERRY_GDS_MAX_DIRS];
    _Atomic size_t left_total;
    int err;                   /* first failure's code */
    size_t bad;                /* its request's index */
    int dir;
    size_t len;
    uint64_t slab_off;
    ferry_io_req small[8];
} hop;

static unsigned req_drive(const ferry_gds *g, const ferry_io_req *r)
{
    for (unsigned d = 0; d < g->ndrives; d++)
        if (g->drives[d].f == r->file)
            return d;
    return 0;
}

static int host_check(ferry_gds *g, int dir, const void *buf, size_t len, uint64_t slab_off)
{
    const char *what = ferry__gds_dirname(dir);
    if (dir != FERRY_GDS_READ && dir != FERRY_GDS_WRITE)
        return ferry__err_set(&g->err, -EINVAL, "gds: host transfer direction %d", dir);
    if (!buf)
        return ferry__err_set(&g->err, -EINVAL, "gds: %s at slab offset %llu: NULL buffer", what,
                              (unsigned long long)slab_off);
    int rc = ferry__gds_check_range(g, what, slab_off, len);
    if (rc < 0)
        return rc;
    if (!FERRY__IS_ALIGNED((uintptr_t)buf, g->align) && ferry_file_is_direct(g->drives[0].f))
        return ferry__err_set(&g->err, FERRY_EALIGN,
                              "gds: %s of %zu bytes at slab offset %llu: host buffer %p is not "
                              "%zu-aligned (the slab is open with O_DIRECT)",
                              what, len, (unsigned long long)slab_off, buf, g->align);
    return 0;
}

/* cut [slab_off, +len) into engine requests of at most `piece` bytes that
 * never cross a stripe unit; -ENOMEM leaves h empty */
static int hop_build(ferry_gds *g, hop *h, int dir, void *buf, size_t len, uint64_t slab_off,
                     size_t piece)
{
    memset(h, 0, offsetof(hop, small));
    h->dir = dir;
    h->len = len;
    h->slab_off = slab_off;
    size_t n = 0;
    for (size_t pos = 0; pos < len; n++) {
        unsigned d;
        uint64_t foff, run;
        ferry__stripe_map(g->stripe, g->ndrives, slab_off + pos, &d, &foff, &run);
        pos += (size_t)FERRY__MIN((uint64_t)FERRY__MIN(len - pos, piece), run);
    }
    h->io = h->small;
    if (n > FERRY__ARRAY_LEN(h->small) && !(h->io = ferry__calloc(n, sizeof *h->io)))
        return ferry__err_set(&g->err, -ENOMEM, "gds: %s of %zu bytes: out of memory",
                              ferry__gds_dirname(dir), len);
    size_t i = 0;
    for (size_t pos = 0; pos < len; i++) {
        unsigned d;
        uint64_t foff, run;
        ferry__stripe_map(g->stripe, g->ndrives, slab_off + pos, &d, &foff, &run);
        size_t k = (size_t)FERRY__MIN((uint64_t)FERRY__MIN(len - pos, piece), run);
        ferry_io_req *r = &h->io[i];
        memset(r, 0, sizeof *r);
        r->op = dir == FERRY_GDS_READ ? FERRY_IO_READ : FERRY_IO_WRITE;
        r->file = g->drives[d].f;
        r->buf = (char *)buf + pos;
        r->len = k;
        r->offset = foff;
        r->user = h;
        h->left[d]++;
        pos += k;
    }
    h->n = n;
    atomic_store(&h->left_total, n);
    return 0;
}

static void hop_free_parts(hop *h)
{
    if (h->io != h->small)
        ferry__free(h->io);
    h->io = NULL;
}

/* the hop's outcome: 0, or its first failure with a message */
static int hop_result(ferry_gds *g, const hop *h)
{
    if (!h->err)
        return 0;
    const ferry_io_req *r = &h->io[h->bad];
    unsigned d = req_drive(g, r);
    return ferry__err_set(&g->err, h->err,
                          "gds: %s of %zu bytes at slab offset %llu: drive %u (%s) %s of %zu "
                          "bytes at file offset %llu: %s",
                          ferry__gds_dirname(h->dir), h->len, (unsigned long long)h->slab_off, d,
                          g->drives[d].path, ferry__gds_dirname(h->dir), r->len,
                          (unsigned long long)r->offset, ferry_strerror(h->err));
}

/* a completed engine request reaches its hop (caller holds drive d's lock) */
static void deliver(ferry_gds *g, unsigned d, ferry_io_req *r)
{
    hop *h = r->user;
    if (r->result != (int64_t)r->len) {
        /* parts of one hop complete on several drives' threads at once */
        pthread_mutex_lock(&g->amu);
        if (!h->err) {
            h->err = r->result < 0 ? (int)r->result : FERRY_ESHORT;
            h->bad = (size_t)(r - h->io);
        }
        pthread_mutex_unlock(&g->amu);
    }
    h->left[d]--;
    /* read req before the last decrement: once left_total reaches 0 a
     * synchronous caller may return and its stack-held hop is gone */
    ferry_gds_req *req = h->req;
    if (atomic_fetch_sub(&h->left_total, 1) != 1 || !req)
        return;
    /* an async hop is complete: hand it to ferry_gds_reap */
    req->result = h->err ? hop_result(g, h) : 0;
    if (!h->err)
        atomic_fetch_add(h->dir == FERRY_GDS_READ ? &g->bytes_read : &g->bytes_written, h->len);
    pthread_mutex_lock(&g->amu);
    h->next = NULL;
    if (g->done_tail)
        g->done_tail->next = h;
    else
        g->done_head = h;
    g->done_tail = h;
    g->ndone++;
    pthread_mutex_unlock(&g->amu);
}

static _Atomic(ferry__gds_reap_fn) g_reap_seam;

void ferry__gds_reap_seam(ferry__gds_reap_fn fn)
{
    atomic_store(&g_reap_seam, fn);
}

/* reap drive d once (caller holds its lock); returns completions or a code */
static int pump_drive(ferry_gds *g, unsigned d, unsigned min, int timeout_ms)
{
    ferry_io_req *done[32];
    ferry__gds_reap_fn reap = atomic_load(&g_reap_seam);
    int k = (reap ? reap : ferry_io_reap)(g->drives[d].io, done, min, 32, timeout_ms);
    if (k < 0)
        return ferry__err_set(&g->err, k, "gds: drive %u (%s): reap: %s", d, g->drives[d].path,
                              ferry_last_error());
    for (int i = 0; i < k; i++)
        deliver(g, d, done[i]);
    return k;
}

/* submit k engine requests to drive d (caller holds its lock); requests
 * the engine refuses (validation) complete at once as failures */
static void drive_flush(ferry_gds *g, unsigned d, ferry_io_req **ptrs, unsigned k, int *rc)
{
    int n = ferry_io_submit(g->drives[d].io, ptrs, k);
    if (n < 0 || (unsigned)n < k) {
        int code = n < 0 ? n : FERRY_EDRIVER;
        if (*rc == 0)
            *rc = ferry__err_set(&g->err, code, "gds: drive %u (%s): submit: %s", d,
                                 g->drives[d].path, ferry_last_error());
        for (unsigned q = n < 0 ? 0 : (unsigned)n; q < k; q++) {
            ptrs[q]->result = code;
            deliver(g, d, ptrs[q]);
        }
    }
    atomic_fetch_add(&g->engine_ios, (uint64_t)(n < 0 ? 0 : n));
}

/* hand built hops' requests to the drive queues: per drive, one lock and
 * one submission per 64 requests (one io_uring_submit for a batch).
 * An asynchronous hop may complete, be reaped and freed by another thread
 * as soon as its last request is submitted and its drive's lock dropped,
 * so nothing of a hop is read after that: how many requests each hop has
 * on each drive is counted before the first submission, and a hop is
 * scanned only while it has requests left to submit on the locked drive
 * (those cannot complete before the lock is dropped). */
static int hops_submit(ferry_gds *g, hop *const *hops, unsigned m)
{
    uint32_t todo[32][FERRY_GDS_MAX_DIRS];
    FERRY__ASSERT(m <= FERRY__ARRAY_LEN(todo));
    for (unsigned hi = 0; hi < m; hi++)
        for (unsigned d = 0; d < g->ndrives; d++)
            todo[hi][d] = (uint32_t)hops[hi]->left[d];
    int rc = 0;
    for (unsigned d = 0; d < g->ndrives; d++) {
        ferry_io_req *ptrs[64];
        unsigned k = 0;
        int locked = 0;
        for (unsigned hi = 0; hi < m; hi++) {
            if (!todo[hi][d])
                continue;
            if (!locked) {
                pthread_mutex_lock(&g->drives[d].mu);
                locked = 1;
            }
            /* (a refused request completes at once, inside drive_flush: the
             * hop is not read once its last one here is in ptrs) */
            ferry_io_req *io = hops[hi]->io;
            for (size_t j = 0; todo[hi][d]; j++) {
                if (io[j].file != g->drives[d].f)
                    continue;
                ptrs[k++] = &io[j];
                todo[hi][d]--;
                if (k == FERRY__ARRAY_LEN(ptrs)) {
                    drive_flush(g, d, ptrs, k, &rc);
                    k = 0;
                }
            }
        }
        if (k)
            drive_flush(g, d, ptrs, k, &rc);
        if (locked)
            pthread_mutex_unlock(&g->drives[d].mu);
    }
    return rc;
}

/* A synchronous call's reap of a drive failed: its requests are still
 * the engine's, and they point into this call's frame (the hop, its first
 * requests) and into the caller's buffer, so the call may not return
 * before every one of them has come back. It tries again a little later
 * (a reap that works again, this call's or another thread's, hands them
 * back), and says why it waits at the rate warnings may repeat. */
static void host_reap_failed(ferry_gds *g, const hop *h)
{
    static ferry__warnlim warned;
    uint64_t quiet = 0;
    if (ferry__warn_ok(&warned, &quiet)) {
        char more[64] = "";
        if (quiet)
            snprintf(more, sizeof more, " (%llu more like it held back)",
                     (unsigned long long)quiet);
        FERRY_LOGW("%s: waiting for the %zu request(s) of a synchronous %s still in the "
                   "drive's engine%s", ferry__err_msg(&g->err),
                   (size_t)atomic_load(&h->left_total), ferry__gds_dirname(h->dir), more);
    }
    nanosleep(&(struct timespec){0, 1000000}, NULL); /* 1 ms: no hot spin on a failing queue */
}

static int host_rw(ferry_gds *g, int dir, void *buf, size_t len, uint64_t slab_off)
{
    if (!g)
        return ferry__err_set(NULL, -EINVAL, "gds: %s on a NULL context", ferry__gds_dirname(dir));
    int rc = host_check(g, dir, buf, len, slab_off);
    if (rc < 0)
        return rc;
    /* a synchronous call brings its own parallelism: pieces so that each
     * drive has about `depth` requests in flight, as the engines' own
     * synchronous helpers do (one 32 MiB chunk at depth 8: 8 x 4 MiB) */
    size_t piece = (len + (size_t)g->ndrives * g->depth - 1) / ((size_t)g->ndrives * g->depth);
    piece = FERRY__ALIGN_UP(piece, g->align);
    if (piece < ((size_t)128 << 10))
        piece = (size_t)128 << 10;
    hop h, *hp = &h;
    if ((rc = hop_build(g, &h, dir, buf, len, slab_off, piece)) < 0)
        return rc;
    hops_submit(g, &hp, 1);
    /* wait for our own requests, delivering whatever else completes too,
     * until the last is back, a failed reap or not (above); the first
     * failure is the call's result */
    char why[FERRY__ERRMSG_MAX] = "";
    while (atomic_load(&h.left_total) > 0) {
        /* h.left[d] changes only under drive d's lock */
        for (unsigned d = 0; d < g->ndrives; d++) {
            pthread_mutex_lock(&g->drives[d].mu);
            int k = h.left[d] ? pump_drive(g, d, 1, -1) : 0;
            pthread_mutex_unlock(&g->drives[d].mu);
            if (k < 0) {
                if (rc == 0) {
                    rc = k;
                    const char *m = ferry_last_error(); /* "gds: drive ...: reap: ..." */
                    snprintf(why, sizeof why, "%s", m + (strncmp(m, "gds: ", 5) ? 0 : 5));
                }
                host_reap_failed(g, &h);
            }
        }
    }
    if (rc < 0)
        ferry__err_set(&g->err, rc, "gds: %s of %zu bytes at slab offset %llu: %s (returned "
                       "once its requests were back)", ferry__gds_dirname(dir), len,
                       (unsigned long long)slab_off, why);
    else if ((rc = hop_result(g, &h)) == 0)
        atomic_fetch_add(dir == FERRY_GDS_READ ? &g->bytes_read : &g->bytes_written, len);
    hop_free_parts(&h);
    return rc;
}

int ferry_gds_pwrite(ferry_gds *g, const void *buf, size_t len, uint64_t slab_off)
{
    return host_rw(g, FERRY_GDS_WRITE, (void *)(uintptr_t)buf, len, slab_off);
}

int ferry_gds_pread(ferry_gds *g, void *buf, size_t len, uint64_t slab_off)
{
    return host_rw(g, FERRY_GDS_READ, buf, len, slab_off);
}

/* The live list holds every asynchronous hop of this context from submit
 * until it is reaped (close frees what it still holds). Caller holds amu. */
static void live_unlink(ferry_gds *g, hop *h)
{
    if (h->lprev)
        h->lprev->lnext = h->lnext;
    else
        g->live = h->lnext;
    if (h->lnext)
        h->lnext->lprev = h->lprev;
}

/* hop h of g's is done with: its request is the caller's again, to
 * submit to any context (caller holds amu) */
static void hop_retire(ferry_gds *g, hop *h)
{
    h->req->priv_ = NULL;
    live_unlink(g, h);
    ferry__gds_live_drop(&h->reg);
    hop_free_parts(h);
    ferry__free(h);
}

/* close, before the drives close: host requests still in flight land
 * (unless a drive's queue broke: what it held never comes back) */
void ferry__gds_async_drain(ferry_gds *g)
{
    int broken = 0;
    while (g->on && !broken) {
        pthread_mutex_lock(&g->amu);
        int waiting = atomic_load(&g->async_hops) > g->ndone;
        pthread_mutex_unlock(&g->amu);
        if (!waiting)
            break;
        for (unsigned d = 0; d < g->ndrives; d++) {
            pthread_mutex_lock(&g->drives[d].mu);
            int k = ferry_io_inflight(g->drives[d].io) ? pump_drive(g, d, 1, 10) : 0;
            pthread_mutex_unlock(&g->drives[d].mu);
            if (k < 0) {
                FERRY_LOGW("%s (at close: its host requests in flight are dropped)",
                           ferry__err_msg(&g->err));
                broken = 1;
            }
        }
    }
}

/* close, after the drives closed (no engine holds a hop's requests): every
 * hop not reaped, landed or not, is freed and its request given back */
void ferry__gds_async_release(ferry_gds *g)
{
    pthread_mutex_lock(&g->amu);
    while (g->live)
        hop_retire(g, g->live);
    g->done_head = g->done_tail = NULL;
    g->ndone = 0;
    atomic_store(&g->async_hops, 0);
    pthread_mutex_unlock(&g->amu);
}

/* request k (q) is in flight on holder already: FERRY_EBUSY naming both */
static int submit_busy(ferry_gds *g, unsigned k, const ferry_gds_req *q, const ferry_gds *holder)
{
    if (holder == g)
        return ferry__err_set(&g->err, FERRY_EBUSY,
                              "gds: submit: request %u (%p, %s of %zu bytes at slab offset %llu) "
                              "is already in flight: a request is the context's from submit "
                              "until reaped",
                              k, (void *)q, ferry__gds_dirname(q->dir), q->len,
                              (unsigned long long)q->slab_off);
    return ferry__err_set(&g->err, FERRY_EBUSY,
                          "gds: submit: request %u (%p, %s of %zu bytes at slab offset %llu) is "
                          "in flight on another context (%p, not this one, %p): a request is "
                          "the context's it was submitted to until reaped there",
                          k, (void *)q, ferry__gds_dirname(q->dir), q->len,
                          (unsigned long long)q->slab_off, (const void *)holder, (void *)g);
}

int ferry_gds_submit(ferry_gds *g, ferry_gds_req *const *reqs, unsigned n)
{
    if (!g || (!reqs && n))
        return ferry__err_set(g ? &g->err : NULL, -EINVAL, "gds: submit: NULL context or reqs");
    unsigned k = 0;
    int rc = 0;
    while (k < n && rc == 0) {
        hop *batch[32];
        unsigned m = 0;
        for (; k < n && m < FERRY__ARRAY_LEN(batch); k++) {
            ferry_gds_req *q = reqs[k];
            if (!q) {
                rc = ferry__err_set(&g->err, -EINVAL, "gds: submit: request %u is NULL", k);
                break;
            }
            if ((rc = host_check(g, q->dir, q->buf, q->len, q->slab_off)) < 0)
                break;
            hop *h = ferry__malloc(sizeof *h);
            if (!h) {
                rc = ferry__err_set(&g->err, -ENOMEM, "gds: submit: out of memory");
                break;
            }
            /* the caller keeps `depth` requests in flight: no extra cutting */
            if ((rc = hop_build(g, h, q->dir, q->buf, q->len, q->slab_off, SIZE_MAX)) < 0) {
                ferry__free(h);
                break;
            }
            /* the check and the claim in one step: of threads submitting
             * q at once, to this context or another, one takes it */
            h->req = q;
            h->reg = (ferry__gds_live){{NULL}, q, g};
            ferry_gds *holder = ferry__gds_live_take(&h->reg);
            if (holder) {
                hop_free_parts(h);
                ferry__free(h);
                rc = submit_busy(g, k, q, holder);
                break;
            }
            q->result = 0;
            q->priv_ = h;
            pthread_mutex_lock(&g->amu);
            h->lprev = NULL;
            h->lnext = g->live;
            if (g->live)
                g->live->lprev = h;
            g->live = h;
            pthread_mutex_unlock(&g->amu);
            batch[m++] = h;
        }
        atomic_fetch_add(&g->async_hops, m);
        hops_submit(g, batch, m); /* a refused request completes with its error */
    }
    return k ? (int)k : rc;
}

int ferry_gds_reap(ferry_gds *g, ferry_gds_req **done, unsigned min, unsigned max,
                   int timeout_ms)
{
    if (!g || (!done && max))
        return ferry__err_set(g ? &g->err : NULL, -EINVAL, "gds: reap: NULL context or done");
    if (min > max)
        return ferry__err_set(&g->err, -EINVAL, "gds: reap: min %u > max %u", min, max);
    if (!g->on)
        return 0; /* nothing was submitted; the drives are read only once it is on */
    uint64_t deadline = timeout_ms < 0 ? 0 : ferry__now_ns() + (uint64_t)timeout_ms * 1000000ull;
    unsigned got = 0, turn = 0;
    /* a poll (min 0) collects what has finished without waiting; a wait
     * goes straight to the drives below, which collect it anyway */
    for (unsigned d = 0; min == 0 && d < g->ndrives; d++) {
        pthread_mutex_lock(&g->drives[d].mu);
        int k = ferry_io_inflight(g->drives[d].io) ? pump_drive(g, d, 0, 0) : 0;
        pthread_mutex_unlock(&g->drives[d].mu);
        if (k < 0)
            return k;
    }
    for (;;) {
        pthread_mutex_lock(&g->amu);
        while (got < max && g->done_head) {
            hop *h = g->done_head;
            g->done_head = h->next;
            if (!g->done_head)
                g->done_tail = NULL;
            g->ndone--;
            done[got++] = h->req;
            hop_retire(g, h);
            atomic_fetch_sub(&g->async_hops, 1);
        }
        unsigned waiting = (unsigned)atomic_load(&g->async_hops) - g->ndone;
        pthread_mutex_unlock(&g->amu);
        if (got >= min || got == max || waiting == 0)
            return (int)got;
        int left = -1;
        if (timeout_ms >= 0) {
            uint64_t now = ferry__now_ns();
            if (now >= deadline)
                return (int)got;
            left = (int)((deadline - now + 999999) / 1000000);
        }
        /* one drive: block on it; several: short turns round the drives */
        unsigned d = turn++ % g->ndrives;
        int slice = g->ndrives == 1 ? left : (left < 0 || left > 1 ? 1 : left);
        pthread_mutex_lock(&g->drives[d].mu);
        int k = ferry_io_inflight(g->drives[d].io) ? pump_drive(g, d, 1, slice) : 0;
        pthread_mutex_unlock(&g->drives[d].mu);
        if (k < 0)
            return got ? (int)got : k;
    }
}

/* ---- registered host buffers ----
 *
 * The context keeps its own table of what it registered: engines without
 * fixed buffers (posix, or io_uring where the kernel refused a table)
 * accept and ignore a registration, so only the table can say that an
 * unregister names a buffer never registered (FERRY_ENOTFOUND, whatever
 * the engine). The table and the engines' registrations change together
 * under hmu, never mu: a registration pins every page of the buffer
 * (seconds for a large one not yet faulted in) and device transfers take
 * mu, so holding mu across it would stall every other thread's device
 * transfers, which ferry/gds.h says may run meanwhile. */

/* the on flag, read under mu (init and close write it there) */
static int ctx_on(ferry_gds *g)
{
    pthread_mutex_lock(&g->mu);
    int on = g->on;
    pthread_mutex_unlock(&g->mu);
    return on;
}

static size_t hostbuf_find(const ferry_gds *g, const void *buf)
{
    for (size_t i = 0; i < g->nhost; i++)
        if (g->hostbufs[i].buf == buf)
            return i;
    return SIZE_MAX;
}

/* unregister buf from every drive (caller holds hmu); the first failure
 * other than "this engine has nothing registered" is returned */
static int host_unregister_drives(ferry_gds *g, void *buf)
{
    int rc = 0;
    for (unsigned d = 0; d < g->ndrives; d++) {
        pthread_mutex_lock(&g->drives[d].mu);
        int r = ferry_io_unregister_buffer(g->drives[d].io, buf);
        pthread_mutex_unlock(&g->drives[d].mu);
        if (r < 0 && r != FERRY_ENOTSUP && r != FERRY_ENOTFOUND && rc == 0)
            rc = ferry__err_set(&g->err, r, "gds: host unregister %p on drive %u: %s", buf, d,
                                ferry_last_error());
    }
    return rc;
}

int ferry_gds_host_register(ferry_gds *g, void *buf, size_t len)
{
    if (!g || !buf || !len)
        return ferry__err_set(g ? &g->err : NULL, -EINVAL,
                              "gds: host register needs a buffer and a length");
    pthread_mutex_lock(&g->hmu);
    int rc = 0;
    unsigned d = 0;
    if (!ctx_on(g)) {
        rc = ferry__err_set(&g->err, FERRY_ESTATE, "gds: host register: the context is off");
        goto out;
    }
    size_t at = hostbuf_find(g, buf);
    if (at != SIZE_MAX) { /* again: a no-op for the same length, as the engines' */
        if (g->hostbufs[at].len != len)
            rc = ferry__err_set(&g->err, FERRY_EEXIST, "gds: host register %p (%zu bytes): "
                                "registered already with %zu bytes",
                                buf, len, g->hostbufs[at].len);
        goto out;
    }
    if (g->nhost == g->caphost) {
        size_t nc = g->caphost ? g->caphost * 2 : 8;
        hostbuf *nv = ferry__realloc(g->hostbufs, nc * sizeof *nv);
        if (!nv) {
            rc = ferry__err_set(&g->err, -ENOMEM, "gds: host register %p: out of memory", buf);
            goto out;
        }
        g->hostbufs = nv;
        g->caphost = nc;
    }
    /* without the drive's lock or mu (hmu guards only the host buffer
     * table): a registration may run beside the drive's transfers
     * (ferry/io.h), and it pins every page, which must not hold up the
     * transfers of other threads meanwhile */
    for (; d < g->ndrives && rc == 0; d++)
        rc = ferry_io_register_buffer(g->drives[d].io, buf, len);
    if (rc == FERRY_ENOTSUP)
        rc = 0; /* this engine has no fixed buffers: nothing to gain, nothing to do */
    if (rc < 0) {
        char m[FERRY__ERRMSG_MAX];
        snprintf(m, sizeof m, "%s", ferry_last_error());
        for (unsigned j = 0; j + 1 < d; j++) {
            pthread_mutex_lock(&g->drives[j].mu);
            ferry_io_unregister_buffer(g->drives[j].io, buf);
            pthread_mutex_unlock(&g->drives[j].mu);
        }
        rc = ferry__err_set(&g->err, rc, "gds: host register %p (%zu bytes) on drive %u: %s",
                            buf, len, d - 1, m);
        goto out;
    }
    g->hostbufs[g->nhost++] = (hostbuf){buf, len};
out:
    pthread_mutex_unlock(&g->hmu);
    return rc;
}

int ferry_gds_host_unregister(ferry_gds *g, void *buf)
{
    if (!g || !buf)
        return ferry__err_set(g ? &g->err : NULL, -EINVAL, "gds: host unregister of NULL");
    pthread_mutex_lock(&g->hmu);
    int rc;
    size_t at;
    if (!ctx_on(g))
        rc = ferry__err_set(&g->err, FERRY_ESTATE, "gds: host unregister: the context is off");
    else if ((at = hostbuf_find(g, buf)) == SIZE_MAX)
        rc = ferry__err_set(&g->err, FERRY_ENOTFOUND,
                            "gds: host unregister %p: not registered (%zu host buffers are)", buf,
                            g->nhost);
    else {
        g->hostbufs[at] = g->hostbufs[--g->nhost];
        rc = host_unregister_drives(g, buf);
    }
    pthread_mutex_unlock(&g->hmu);
    return rc;
}

int ferry_gds_buffer_alloc(ferry_gds *g, size_t len, void **out)
{
    if (!g || !len || !out)
        return ferry__err_set(g ? &g->err : NULL, -EINVAL, "gds: buffer alloc needs a length");
    /* `on` is read once, atomically: init may be turning the context on
     * meanwhile, and what it set before (alignment, device) is read after */
    if (!atomic_load(&g->on))
        return ferry__err_set(&g->err, FERRY_ESTATE, "gds: buffer alloc: the context is off");
    if (len > SIZE_MAX - (g->align - 1)) /* rounding up would wrap to a tiny buffer */
        return ferry__err_set(&g->err, -EINVAL, "gds: buffer alloc of %zu bytes: too large "
                              "(rounded up to %zu it wraps)", len, g->align);
    size_t n = FERRY__ALIGN_UP(len, g->align);
    void *p = NULL;
    if (g->dev) {
        int rc = ferry_device_host_alloc(g->dev, n, &p);
        if (rc < 0)
            return ferry__err_pass(&g->err, rc);
    } else {
        /* large buffers on 2 MiB boundaries, backed by transparent huge
         * pages where the kernel allows (as the I/O layer's own buffers):
         * a direct request then maps onto a few large segments instead of
         * one per 4 KiB page, which costs real throughput (measured: 8 MiB
         * requests at depth 8 ran ~1.7x faster from huge pages) */
        size_t huge = (size_t)2 << 20;
        size_t align = n >= huge ? huge : g->align;
        if (!(p = ferry__aligned_alloc(align, n)))
            return ferry__err_set(&g->err, -ENOMEM, "gds: out of memory for a %zu-byte buffer",
                                  n);
        if (n >= huge && FERRY__IS_ALIGNED(p, huge))
            madvise(p, n & ~(huge - 1), MADV_HUGEPAGE);
    }
    /* best effort, as the engines' own buffers: unregistered still works.
     * The length asked for: registering (p, len) again is then a no-op */
    if (ferry_gds_host_register(g, p, len) < 0)
        FERRY_LOGD("gds: buffer %p not registered: %s", p, ferry__err_msg(&g->err));
    *out = p;
    return 0;
}

void ferry_gds_buffer_free(ferry_gds *g, void *buf)
{
    if (!g || !buf)
        return;
    pthread_mutex_lock(&g->hmu);
    size_t at = ctx_on(g) ? hostbuf_find(g, buf) : SIZE_MAX;
    if (at != SIZE_MAX) { /* (registration was best effort: it may not be) */
        g->hostbufs[at] = g->hostbufs[--g->nhost];
        host_unregister_drives(g, buf);
    }
    pthread_mutex_unlock(&g->hmu);
    if (g->dev)
        ferry_device_host_free(g->dev, buf);
    else
        ferry__free(buf);
}
