/*
 * host.c - the "host" device backend: device memory simulated in host
 * memory, with streams that really run asynchronously.
 *
 * Each stream is a FIFO of operations run in order by its own worker thread,
 * so an asynchronous copy overlaps with whatever the caller does next (the
 * I/O layer's bounce path depends on this to overlap disk I/O with device
 * copies, exactly as on a GPU). Events are marks in a stream's queue: a
 * record bumps the event's generation and queues a mark carrying it; the
 * worker that reaches the mark completes that generation and stamps the
 * time. stream_wait_event queues a wait for the generation recorded at the
 * time of the call, so cross-stream waits always point backwards in time and
 * cannot deadlock.
 *
 * Invariants (all state under hd->lock, one lock per device: copies are
 * large, so the lock is never the bottleneck; the bytes move outside it):
 *  - done_seq <= enq_seq per stream; sync waits for done_seq to reach the
 *    enq_seq it saw.
 *  - A queued mark or wait holds a reference on its event, so destroying an
 *    event with work still queued is safe (as in CUDA).
 *  - Freeing memory first drains every stream (as cuMemFree does), so a
 *    queued copy never touches freed memory. While a drain walks the stream
 *    list, no stream unlinks itself (hd->draining).
 *  - The first asynchronous error of a stream is kept with its message until
 *    a stream_sync (or destroy) reports it; a mark copies it into the event,
 *    so event_sync reports it too.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "device/device_impl.h"

#define HOST_DEV_ALIGN 4096 /* >= 256 as on CUDA; 4096 so O_DIRECT works too */

enum { OP_COPY, OP_MARK, OP_WAIT };

struct host_event {
    int refs;             /* the handle + queued marks and waits */
    uint64_t record_gen;  /* bumped by each record */
    uint64_t done_gen;    /* highest generation whose mark was reached */
    uint64_t t_ns;        /* when done_gen was reached */
    int err;              /* async error seen by the stream before the mark */
    char errmsg[FERRY__ERRMSG_MAX];
};

struct host_op {
    struct host_op *next;
    int type;
    /* copy */
    void *dst;
    const void *src;
    size_t n;
    const char *what; /* "htod", "dtoh", "dtod" */
    int fail_code;
    size_t short_bytes;
    /* mark / wait */
    struct host_event *ev;
    uint64_t gen;
};

struct host_dev;

struct host_stream {
    struct host_dev *hd;
    pthread_t thread;
    pthread_cond_t work_cv;
    struct host_op *head, *tail;
    uint64_t enq_seq, done_seq;
    /* lowest done_seq a waiter on done_cv needs (UINT64_MAX: none). The
     * worker wakes the waiters only when it is reached, at a mark, or when
     * the queue empties: a broadcast per copy would cost a futex wake (and
     * a waiter's context switch) on the copying thread for every op. */
    uint64_t want_seq;
    int stop;
    int held; /* test seam: start nothing new */
    int err;
    char errmsg[FERRY__ERRMSG_MAX];
    struct host_stream *prev, *next;
};

struct host_dev {
    pthread_mutex_t lock;
    pthread_cond_t done_cv; /* broadcast when an op finishes or a drain ends */
    struct host_stream *streams;
    int draining;
    size_t page;
};

static struct host_dev *HD(const ferry_device *dev)
{
    return (struct host_dev *)dev->impl;
}

/* with hd->lock held */
static void event_unref(struct host_event *ev)
{
    if (--ev->refs == 0)
        ferry__free(ev);
}

/* with hd->lock held: wait until s has finished its first target ops */
static void wait_done_locked(struct host_stream *s, uint64_t target)
{
    while (s->done_seq < target) {
        if (target < s->want_seq)
            s->want_seq = target;
        pthread_cond_wait(&s->hd->done_cv, &s->hd->lock);
    }
}

/* with hd->lock held: wait until every stream finished what it had queued */
static void drain_all(struct host_dev *hd)
{
    hd->draining++;
    for (struct host_stream *s = hd->streams; s; s = s->next)
        wait_done_locked(s, s->enq_seq);
    if (--hd->draining == 0)
        pthread_cond_broadcast(&hd->done_cv);
}

static void run_copy(struct host_stream *s, struct host_op *op)
{
    size_t n = op->fail_code ? 0 : op->short_bytes;
    if (n)
        memmove(op->dst, op->src, n);
    pthread_mutex_lock(&s->hd->lock);
    if (s->err == 0 && (op->fail_code || n < op->n)) {
        if (op->fail_code) {
            s->err = op->fail_code;
            snprintf(s->errmsg, sizeof s->errmsg,
                     "device host: async memcpy %s of %zu bytes (%p -> %p): injected fault: %s",
                     op->what, op->n, op->src, op->dst, ferry_strerror(op->fail_code));
        } else {
            s->err = FERRY_ESHORT;
            snprintf(s->errmsg, sizeof s->errmsg,
                     "device host: async memcpy %s of %zu bytes (%p -> %p): moved only %zu "
                     "bytes (injected short copy)",
                     op->what, op->n, op->src, op->dst, n);
        }
    }
}

static void *stream_worker(void *arg)
{
    struct host_stream *s = arg;
    struct host_dev *hd = s->hd;
    pthread_mutex_lock(&hd->lock);
    for (;;) {
        while ((!s->head || s->held) && !s->stop)
            pthread_cond_wait(&s->work_cv, &hd->lock);
        if (!s->head)
            break;
        struct host_op *op = s->head;
        switch (op->type) {
        case OP_COPY:
            pthread_mutex_unlock(&hd->lock);
            run_copy(s, op); /* returns with the lock held */
            break;
        case OP_WAIT:
            while (op->ev->done_gen < op->gen)
                pthread_cond_wait(&hd->done_cv, &hd->lock);
            break;
        case OP_MARK:
            if (op->gen > op->ev->done_gen) {
                op->ev->done_gen = op->gen;
                op->ev->t_ns = ferry__now_ns();
                op->ev->err = s->err;
                if (s->err)
                    memcpy(op->ev->errmsg, s->errmsg, sizeof op->ev->errmsg);
            }
            break;
        }
        s->head = op->next;
        if (!s->head)
            s->tail = NULL;
        s->done_seq++;
        int wake = op->type == OP_MARK || !s->head || s->done_seq >= s->want_seq;
        if (op->ev)
            event_unref(op->ev);
        ferry__free(op);
        if (wake) {
            s->want_seq = UINT64_MAX;
            pthread_cond_broadcast(&hd->done_cv);
        }
    }
    pthread_mutex_unlock(&hd->lock);
    return NULL;
}

/* ---- device ---- */

static int h_open(ferry_device *dev, const ferry_device_options *opt)
{
    (void)opt;
    struct host_dev *hd = ferry__calloc(1, sizeof *hd);
    if (!hd)
        return ferry__err_set(NULL, -ENOMEM, "device host: open: out of memory");
    pthread_mutex_init(&hd->lock, NULL);
    pthread_cond_init(&hd->done_cv, NULL);
    long pg = sysconf(_SC_PAGESIZE);
    hd->page = pg > 0 ? (size_t)pg : 4096;
    dev->impl = hd;
    snprintf(dev->name, sizeof dev->name, "host (simulated)");
    return 0;
}

static void h_close(ferry_device *dev)
{
    struct host_dev *hd = HD(dev);
    pthread_cond_destroy(&hd->done_cv);
    pthread_mutex_destroy(&hd->lock);
    ferry__free(hd);
    dev->impl = NULL;
}

static int h_alloc(ferry_device *dev, size_t bytes, ferry_devptr *out)
{
    (void)dev;
    void *p = NULL;
    size_t rounded = FERRY__ALIGN_UP(bytes, (size_t)HOST_DEV_ALIGN);
    if (rounded < bytes || posix_memalign(&p, HOST_DEV_ALIGN, rounded) != 0)
        return ferry__err_set(NULL, -ENOMEM,
                              "device host: alloc of %zu bytes: out of (host) memory", bytes);
    *out = (ferry_devptr)(uintptr_t)p;
    return 0;
}

static int h_free(ferry_device *dev, ferry_devptr ptr, size_t bytes)
{
    (void)bytes;
    struct host_dev *hd = HD(dev);
    pthread_mutex_lock(&hd->lock);
    drain_all(hd);
    pthread_mutex_unlock(&hd->lock);
    free((void *)(uintptr_t)ptr);
    return 0;
}

static void lock_best_effort(void *p, size_t bytes)
{
    if (mlock(p, bytes) != 0)
        FERRY_LOGD("device host: mlock of %zu bytes at %p failed (%s); memory stays pageable",
                   bytes, p, strerror(errno));
}

static int h_host_alloc(ferry_device *dev, size_t bytes, void **out)
{
    struct host_dev *hd = HD(dev);
    size_t rounded = FERRY__ALIGN_UP(bytes, hd->page);
    void *p = NULL;
    if (rounded < bytes || posix_memalign(&p, hd->page, rounded) != 0)
        return ferry__err_set(NULL, -ENOMEM,
                              "device host: host_alloc of %zu bytes: out of memory", bytes);
    lock_best_effort(p, rounded);
    *out = p;
    return 0;
}

static int h_host_free(ferry_device *dev, void *ptr, size_t bytes)
{
    struct host_dev *hd = HD(dev);
    pthread_mutex_lock(&hd->lock);
    drain_all(hd);
    pthread_mutex_unlock(&hd->lock);
    munlock(ptr, FERRY__ALIGN_UP(bytes, hd->page));
    free(ptr);
    return 0;
}

static int h_pin(ferry_device *dev, void *host, size_t bytes)
{
    (void)dev;
    lock_best_effort(host, bytes);
    return 0;
}

static int h_unpin(ferry_device *dev, void *host, size_t bytes)
{
    struct host_dev *hd = HD(dev);
    pthread_mutex_lock(&hd->lock);
    drain_all(hd);
    pthread_mutex_unlock(&hd->lock);
    munlock(host, bytes);
    return 0;
}

static void *h_devptr_host(const ferry_device *dev, ferry_devptr ptr)
{
    (void)dev;
    return (void *)(uintptr_t)ptr;
}

static int h_memset(ferry_device *dev, ferry_devptr dst, int byte, size_t n)
{
    struct host_dev *hd = HD(dev);
    /* ordered after all queued work, as a legacy-stream memset is */
    pthread_mutex_lock(&hd->lock);
    drain_all(hd);
    pthread_mutex_unlock(&hd->lock);
    memset((void *)(uintptr_t)dst, byte, n);
    return 0;
}

/* ---- streams ---- */

static struct host_stream *HS(const ferry_stream *s)
{
    return (struct host_stream *)s->impl;
}

static int h_stream_create(ferry_device *dev, ferry_stream *fs)
{
    struct host_dev *hd = HD(dev);
    struct host_stream *s = ferry__calloc(1, sizeof *s);
    if (!s)
        return ferry__err_set(NULL, -ENOMEM, "device host: stream create: out of memory");
    s->hd = hd;
    s->want_seq = UINT64_MAX;
    pthread_cond_init(&s->work_cv, NULL);
    int e = pthread_create(&s->thread, NULL, stream_worker, s);
    if (e != 0) {
        pthread_cond_destroy(&s->work_cv);
        ferry__free(s);
        return ferry__err_set(NULL, -e, "device host: stream create: worker thread: %s",
                              strerror(e));
    }
    pthread_mutex_lock(&hd->lock);
    s->next = hd->streams;
    if (hd->streams)
        hd->streams->prev = s;
    hd->streams = s;
    pthread_mutex_unlock(&hd->lock);
    fs->impl = s;
    return 0;
}

/* with hd->lock held: wait for the queue; report and clear the async error */
static int stream_wait_locked(struct host_stream *s)
{
    wait_done_locked(s, s->enq_seq);
    int rc = s->err;
    if (rc) {
        ferry__err_set(NULL, rc, "%s", s->errmsg);
        s->err = 0;
    }
    return rc;
}

static int h_stream_destroy(ferry_stream *fs)
{
    struct host_stream *s = HS(fs);
    struct host_dev *hd = s->hd;
    pthread_mutex_lock(&hd->lock);
    s->held = 0;
    pthread_cond_signal(&s->work_cv);
    int rc = stream_wait_locked(s);
    s->stop = 1;
    pthread_cond_signal(&s->work_cv);
    while (hd->draining)
        pthread_cond_wait(&hd->done_cv, &hd->lock);
    if (s->prev)
        s->prev->next = s->next;
    else
        hd->streams = s->next;
    if (s->next)
        s->next->prev = s->prev;
    pthread_mutex_unlock(&hd->lock);
    pthread_join(s->thread, NULL);
    pthread_cond_destroy(&s->work_cv);
    ferry__free(s);
    fs->impl = NULL;
    return rc;
}

static int h_stream_sync(ferry_stream *fs)
{
    struct host_stream *s = HS(fs);
    pthread_mutex_lock(&s->hd->lock);
    int rc = stream_wait_locked(s);
    pthread_mutex_unlock(&s->hd->lock);
    return rc;
}

static uint64_t h_stream_handle(const ferry_stream *fs)
{
    return (uint64_t)(uintptr_t)fs->impl;
}

/* with hd->lock held */
static void enqueue_locked(struct host_stream *s, struct host_op *op)
{
    op->next = NULL;
    if (s->tail)
        s->tail->next = op;
    else
        s->head = op;
    s->tail = op;
    s->enq_seq++;
    pthread_cond_signal(&s->work_cv);
}

static int enqueue_copy(ferry_stream *fs, void *dst, const void *src, size_t n,
                        const char *what, const struct ferry__copy_fault *f)
{
    struct host_stream *s = HS(fs);
    struct host_op *op = ferry__calloc(1, sizeof *op);
    if (!op)
        return ferry__err_set(NULL, -ENOMEM,
                              "device host: memcpy %s of %zu bytes: out of memory for the queue",
                              what, n);
    op->type = OP_COPY;
    op->dst = dst;
    op->src = src;
    op->n = n;
    op->what = what;
    op->fail_code = f ? f->fail_code : 0;
    op->short_bytes = f ? f->short_bytes : n;
    pthread_mutex_lock(&s->hd->lock);
    enqueue_locked(s, op);
    pthread_mutex_unlock(&s->hd->lock);
    return 0;
}

static int h_memcpy_htod(ferry_stream *s, ferry_devptr dst, const void *src, size_t n,
                         const struct ferry__copy_fault *f)
{
    return enqueue_copy(s, (void *)(uintptr_t)dst, src, n, "htod", f);
}

static int h_memcpy_dtoh(ferry_stream *s, void *dst, ferry_devptr src, size_t n,
                         const struct ferry__copy_fault *f)
{
    return enqueue_copy(s, dst, (const void *)(uintptr_t)src, n, "dtoh", f);
}

static int h_memcpy_dtod(ferry_stream *s, ferry_devptr dst, ferry_devptr src, size_t n,
                         const struct ferry__copy_fault *f)
{
    return enqueue_copy(s, (void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n, "dtod", f);
}

/* ---- events ---- */

static struct host_event *HE(const ferry_event *e)
{
    return (struct host_event *)e->impl;
}

static int h_event_create(ferry_device *dev, ferry_event *fe)
{
    (void)dev;
    struct host_event *ev = ferry__calloc(1, sizeof *ev);
    if (!ev)
        return ferry__err_set(NULL, -ENOMEM, "device host: event create: out of memory");
    ev->refs = 1;
    fe->impl = ev;
    return 0;
}

static void h_event_destroy(ferry_event *fe)
{
    struct host_dev *hd = HD(fe->dev);
    pthread_mutex_lock(&hd->lock);
    event_unref(HE(fe));
    pthread_mutex_unlock(&hd->lock);
    fe->impl = NULL;
}

static int h_event_record(ferry_event *fe, ferry_stream *fs)
{
    struct host_event *ev = HE(fe);
    struct host_stream *s = HS(fs);
    struct host_op *op = ferry__calloc(1, sizeof *op);
    if (!op)
        return ferry__err_set(NULL, -ENOMEM, "device host: event record: out of memory");
    op->type = OP_MARK;
    op->ev = ev;
    pthread_mutex_lock(&s->hd->lock);
    op->gen = ++ev->record_gen;
    ev->refs++;
    enqueue_locked(s, op);
    pthread_mutex_unlock(&s->hd->lock);
    return 0;
}

/* with hd->lock held */
static int event_state_locked(struct host_event *ev)
{
    if (ev->done_gen < ev->record_gen)
        return -EAGAIN;
    if (ev->err) {
        ferry__err_set(NULL, ev->err, "%s", ev->errmsg);
        return ev->err;
    }
    return 0;
}

static int h_event_query(ferry_event *fe)
{
    struct host_dev *hd = HD(fe->dev);
    pthread_mutex_lock(&hd->lock);
    int rc = event_state_locked(HE(fe));
    pthread_mutex_unlock(&hd->lock);
    return rc;
}

static int h_event_sync(ferry_event *fe)
{
    struct host_dev *hd = HD(fe->dev);
    struct host_event *ev = HE(fe);
    pthread_mutex_lock(&hd->lock);
    uint64_t target = ev->record_gen;
    while (ev->done_gen < target)
        pthread_cond_wait(&hd->done_cv, &hd->lock);
    int rc = event_state_locked(ev);
    ev->err = 0; /* reported once */
    pthread_mutex_unlock(&hd->lock);
    return rc;
}

static int h_event_elapsed(ferry_event *fa, ferry_event *fb, float *ms)
{
    struct host_dev *hd = HD(fa->dev);
    struct host_event *a = HE(fa), *b = HE(fb);
    int rc = 0;
    pthread_mutex_lock(&hd->lock);
    if (a->record_gen == 0 || b->record_gen == 0)
        rc = ferry__err_set(NULL, FERRY_ESTATE,
                            "device host: event elapsed: the %s event was never recorded",
                            a->record_gen == 0 ? "start" : "end");
    else if (a->done_gen < a->record_gen || b->done_gen < b->record_gen)
        rc = ferry__err_set(NULL, -EAGAIN,
                            "device host: event elapsed: the %s event has not completed yet",
                            a->done_gen < a->record_gen ? "start" : "end");
    else
        *ms = (float)((double)((int64_t)(b->t_ns - a->t_ns)) / 1e6);
    pthread_mutex_unlock(&hd->lock);
    return rc;
}

static int h_stream_wait_event(ferry_stream *fs, ferry_event *fe)
{
    struct host_stream *s = HS(fs);
    struct host_event *ev = HE(fe);
    struct host_op *op = ferry__calloc(1, sizeof *op);
    if (!op)
        return ferry__err_set(NULL, -ENOMEM, "device host: stream wait_event: out of memory");
    op->type = OP_WAIT;
    op->ev = ev;
    pthread_mutex_lock(&s->hd->lock);
    op->gen = ev->record_gen;
    if (op->gen == 0 || ev->done_gen >= op->gen) {
        /* nothing to wait for */
        pthread_mutex_unlock(&s->hd->lock);
        ferry__free(op);
        return 0;
    }
    ev->refs++;
    enqueue_locked(s, op);
    pthread_mutex_unlock(&s->hd->lock);
    return 0;
}

int ferry__device_host_hold(ferry_stream *fs, int hold)
{
    if (!fs || fs->dev->ops != &ferry__device_host_ops)
        return ferry__err_set(NULL, FERRY_ENOTSUP, "device: hold is a host backend test seam");
    struct host_stream *s = HS(fs);
    pthread_mutex_lock(&s->hd->lock);
    s->held = hold != 0;
    pthread_cond_signal(&s->work_cv);
    pthread_mutex_unlock(&s->hd->lock);
    return 0;
}

const struct ferry__device_ops ferry__device_host_ops = {
    .name = "host",
    .simulated = 1,
    .open = h_open,
    .close = h_close,
    .alloc = h_alloc,
    .free = h_free,
    .host_alloc = h_host_alloc,
    .host_free = h_host_free,
    .pin = h_pin,
    .unpin = h_unpin,
    .devptr_host = h_devptr_host,
    .memset = h_memset,
    .stream_create = h_stream_create,
    .stream_destroy = h_stream_destroy,
    .stream_sync = h_stream_sync,
    .stream_handle = h_stream_handle,
    .memcpy_htod = h_memcpy_htod,
    .memcpy_dtoh = h_memcpy_dtoh,
    .memcpy_dtod = h_memcpy_dtod,
    .event_create = h_event_create,
    .event_destroy = h_event_destroy,
    .event_record = h_event_record,
    .event_query = h_event_query,
    .event_sync = h_event_sync,
    .event_elapsed = h_event_elapsed,
    .stream_wait_event = h_stream_wait_event,
};
