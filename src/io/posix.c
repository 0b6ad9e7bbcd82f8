/*
 * posix.c - the portable engine: pread/pwrite on a pool of `depth` threads.
 *
 * Invariant: a part is owned by exactly one party at a time: the front
 * until it is pushed on the submission queue, one worker from the moment
 * it pops it until it pushes it on the completion queue, then the front
 * again once wait() hands it back. Both queues are guarded by one mutex,
 * whose lock/unlock pairs order every write to a part before the next
 * owner's reads (what TSan checks). Workers issue exactly one syscall per
 * part and report its raw result: continuation and retries live in the
 * front, identical for every engine.
 *
 * The queue holds twice `depth` parts so a worker finishing one finds the
 * next waiting instead of idling until the caller reaps.
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "io_impl.h"
#include "sys.h"

typedef struct posix_st {
    pthread_mutex_t mu;
    pthread_cond_t cv_work;
    pthread_cond_t cv_done;
    ferry__part *sq_head, *sq_tail;
    ferry__part *cq_head, *cq_tail;
    unsigned ncq;
    unsigned busy; /* submitted and not yet handed back by wait */
    int stop;
    unsigned nthreads;
    pthread_t *threads;
} posix_st;

static void *worker(void *arg)
{
    posix_st *st = arg;
    pthread_mutex_lock(&st->mu);
    for (;;) {
        while (!st->sq_head && !st->stop)
            pthread_cond_wait(&st->cv_work, &st->mu);
        if (!st->sq_head)
            break; /* stop, and nothing left */
        ferry__part *p = st->sq_head;
        st->sq_head = p->next;
        if (!st->sq_head)
            st->sq_tail = NULL;
        pthread_mutex_unlock(&st->mu);

        const ferry__sys *sys = ferry__sys_get();
        ssize_t r;
        if (p->iov)
            r = sys->preadv(p->fd, p->iov, (int)p->niov, (off_t)p->off);
        else if (p->op == FERRY_IO_READ)
            r = sys->pread(p->fd, p->buf, p->len, (off_t)p->off);
        else
            r = sys->pwrite(p->fd, p->buf, p->len, (off_t)p->off);
        p->res = r < 0 ? -(int64_t)(errno ? errno : EIO) : (int64_t)r;
        p->next = NULL;

        pthread_mutex_lock(&st->mu);
        if (st->cq_tail)
            st->cq_tail->next = p;
        else
            st->cq_head = p;
        st->cq_tail = p;
        st->ncq++;
        pthread_cond_signal(&st->cv_done);
    }
    pthread_mutex_unlock(&st->mu);
    return NULL;
}

static void stop_threads(posix_st *st, unsigned n)
{
    pthread_mutex_lock(&st->mu);
    st->stop = 1;
    pthread_cond_broadcast(&st->cv_work);
    pthread_mutex_unlock(&st->mu);
    for (unsigned i = 0; i < n; i++)
        pthread_join(st->threads[i], NULL);
}

int ferry__posix_create(ferry_io *io, unsigned threads, void **out)
{
    posix_st *st = ferry__calloc(1, sizeof *st);
    pthread_t *th = ferry__calloc(threads, sizeof *th);
    if (!st || !th) {
        ferry__free(st);
        ferry__free(th);
        return ferry__err_set(&io->err, -ENOMEM, "io posix: out of memory for %u workers",
                              threads);
    }
    st->threads = th;
    st->nthreads = threads;
    pthread_mutex_init(&st->mu, NULL);
    pthread_cond_init(&st->cv_work, NULL);
    ferry__cond_init_mono(&st->cv_done);
    for (unsigned i = 0; i < threads; i++) {
        int e = pthread_create(&th[i], NULL, worker, st);
        if (e != 0) {
            stop_threads(st, i);
            pthread_cond_destroy(&st->cv_work);
            pthread_cond_destroy(&st->cv_done);
            pthread_mutex_destroy(&st->mu);
            ferry__free(th);
            ferry__free(st);
            return ferry__err_set(&io->err, -e, "io posix: starting worker %u of %u failed: %s",
                                  i + 1, threads, strerror(e));
        }
    }
    *out = st;
    return 0;
}

void ferry__posix_destroy(void *p)
{
    posix_st *st = p;
    if (!st)
        return;
    stop_threads(st, st->nthreads);
    pthread_cond_destroy(&st->cv_work);
    pthread_cond_destroy(&st->cv_done);
    pthread_mutex_destroy(&st->mu);
    ferry__free(st->threads);
    ferry__free(st);
}

int ferry__posix_submit(void *p, ferry__part **parts, unsigned n)
{
    posix_st *st = p;
    pthread_mutex_lock(&st->mu);
    for (unsigned i = 0; i < n; i++) {
        parts[i]->next = NULL;
        if (st->sq_tail)
            st->sq_tail->next = parts[i];
        else
            st->sq_head = parts[i];
        st->sq_tail = parts[i];
    }
    st->busy += n;
    if (n == 1)
        pthread_cond_signal(&st->cv_work);
    else
        pthread_cond_broadcast(&st->cv_work);
    pthread_mutex_unlock(&st->mu);
    return (int)n;
}

int ferry__posix_wait(void *p, ferry__part **out, unsigned min, unsigned max, int timeout_ms)
{
    posix_st *st = p;
    struct timespec dl;
    if (timeout_ms > 0) {
        dl = ferry__deadline_ms((uint64_t)timeout_ms);
    }
    pthread_mutex_lock(&st->mu);
    if (min > st->busy)
        min = st->busy;
    while (st->ncq < min && timeout_ms != 0) {
        if (timeout_ms < 0)
            pthread_cond_wait(&st->cv_done, &st->mu);
        else if (pthread_cond_timedwait(&st->cv_done, &st->mu, &dl) == ETIMEDOUT)
            break;
    }
    unsigned k = 0;
    while (k < max && st->cq_head) {
        ferry__part *q = st->cq_head;
        st->cq_head = q->next;
        if (!st->cq_head)
            st->cq_tail = NULL;
        q->next = NULL;
        out[k++] = q;
    }
    st->ncq -= k;
    st->busy -= k;
    pthread_mutex_unlock(&st->mu);
    return (int)k;
}

unsigned ferry__posix_busy(void *p)
{
    posix_st *st = p;
    pthread_mutex_lock(&st->mu);
    unsigned b = st->busy;
    pthread_mutex_unlock(&st->mu);
    return b;
}

/* ---- the engine ---- */
static unsigned px_slots(unsigned depth)
{
    return depth * 2;
}

static int px_init(ferry_io *io)
{
    return ferry__posix_create(io, io->depth, &io->eng);
}

static void px_fini(ferry_io *io)
{
    ferry__posix_destroy(io->eng);
    io->eng = NULL;
}

static int px_submit(ferry_io *io, ferry__part **parts, unsigned n)
{
    return ferry__posix_submit(io->eng, parts, n);
}

static int px_wait(ferry_io *io, ferry__part **out, unsigned min, unsigned max, int timeout_ms)
{
    return ferry__posix_wait(io->eng, out, min, max, timeout_ms);
}

const ferry__io_ops ferry__io_posix_ops = {
    .name = "posix",
    .default_max_request = (size_t)32 << 20,
    .vec = 1,
    .slots = px_slots,
    .init = px_init,
    .fini = px_fini,
    .submit = px_submit,
    .wait = px_wait,
};
