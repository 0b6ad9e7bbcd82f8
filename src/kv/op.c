/*
 * op.c - an asynchronous operation's handle: made, shared between threads,
 * freed once, and outliving its store.
 *
 * An engine waits on an op from one thread, cancels it from another, and
 * may close the store before it frees the op (an interpreter finalizes
 * objects in any order). So:
 * - refs counts the owner's reference (until ferry_kv_op_free) plus one for
 *   every call inside the op now. The memory goes when it reaches zero: a
 *   thread still inside ferry_kv_op_wait while the owner frees the op
 *   finishes on live memory, and the op is freed by whichever leaves last.
 * - Every op is on its store's list (kv->ops) from its making until its
 *   memory goes or the store closes. The list and op->kv are guarded by one
 *   process-wide lock (ops_mu), so a close detaching ops and a free
 *   unlinking one never race.
 * - A call on an op is also a call on its store (guard.c) while the store
 *   is open, so close waits for it. A call that finds the store closing or
 *   closed touches only the op: waits and tests answer from its state, and
 *   close finishes what would need the store (a layerwise store lacking
 *   layers is abandoned: -ECANCELED, nothing committed).
 * - Close abandons those stores first (ferry__kv_ops_abandon), once new
 *   calls are refused and before it waits for the calls inside and the
 *   other ops: their slots are free for an op waiting for one
 *   (pool_wait_ms), which would otherwise wait its deadline out. A store
 *   a call is inside (a layer_done), or one its store_layers call is still
 *   making (op->handed not yet set), is left to ops_orphan, after it.
 * - Close detaches each op (ferry__kv_ops_orphan): whatever it holds of the
 *   store (layer events, a stream, a server connection) is given back, and
 *   op->kv becomes NULL. An op whose references all went while its store
 *   was closing is freed there.
 *
 * Lock order: ops_mu before kv->call_mu and op->mu; close takes call_mu
 * alone first (guard.c), then ops_mu.
 *
 * Fork: ops_mu is the process's, so a thread inside an op call (an engine
 * polling op_test) when another thread forks would leave it locked in the
 * child, and the child's first op on a store of its own would wait on it
 * forever. pthread_atfork takes ops_mu around every fork (registered once,
 * before ops_mu is first taken: ops_lock) and releases it on both sides.
 * The parent's stores and ops themselves stay the parent's: a child does
 * not use them (their workers are not in it).
 */
#include <errno.h>
#include <string.h>
#include <time.h>

#include "kv/kv_impl.h"
#include "kv/kv_layers.h"

static pthread_mutex_t ops_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t ops_atfork_once = PTHREAD_ONCE_INIT;

static void ops_mu_take(void)
{
    pthread_mutex_lock(&ops_mu);
}

static void ops_mu_give(void)
{
    pthread_mutex_unlock(&ops_mu);
}

static void ops_atfork(void)
{
    pthread_atfork(ops_mu_take, ops_mu_give, ops_mu_give);
}

static void ops_lock(void)
{
    pthread_once(&ops_atfork_once, ops_atfork);
    pthread_mutex_lock(&ops_mu);
}

ferry_kv_op *ferry__kv_op_new(ferry_kv *kv, int kind, const ferry_kv_hash *ids, size_t nchunks,
                              size_t n, const ferry_kv_req *req, const ferry_kv_buffer *buf)
{
    ferry_kv_op *op = ferry__calloc(1, sizeof *op);
    ferry_kv_hash *copy = nchunks ? ferry__malloc(nchunks * sizeof *copy) : NULL;
    if (!op || (nchunks && !copy)) {
        ferry__free(op);
        ferry__free(copy);
        return NULL;
    }
    if (nchunks)
        memcpy(copy, ids, nchunks * sizeof *copy);
    op->kv = kv;
    op->maker = kv->opener;
    op->kind = kind;
    op->ids = copy;
    op->nchunks = nchunks;
    op->n = n;
    ferry__kv_req_copy(&op->req, req); /* (an older caller's request is shorter) */
    op->req.salt = NULL; /* already folded into the ids */
    op->req.salt_len = 0;
    op->buf = *buf;
    pthread_mutex_init(&op->mu, NULL);
    ferry__cond_init_mono(&op->cv); /* (ferry_kv_op_wait's deadline) */
    op->refs = 1;
    ops_lock();
    op->lnext = kv->ops;
    if (kv->ops)
        kv->ops->lprev = op;
    kv->ops = op;
    pthread_mutex_unlock(&ops_mu);
    return op;
}

/* under ops_mu: take op off its store's list */
static void unlink_op(ferry_kv_op *op)
{
    if (op->lprev)
        op->lprev->lnext = op->lnext;
    else if (op->kv)
        op->kv->ops = op->lnext;
    if (op->lnext)
        op->lnext->lprev = op->lprev;
    op->lprev = op->lnext = NULL;
}

/* the op's memory (nothing of a store is left in it) */
static void destroy(ferry_kv_op *op)
{
    ferry__kv_lw_free(op);
    pthread_mutex_destroy(&op->mu);
    pthread_cond_destroy(&op->cv);
    ferry__free(op->ids);
    ferry__free(op);
}

int ferry__kv_op_forked(const ferry_kv_op *op, const char *what)
{
    long self = ferry__pid();
    if (self == op->maker)
        return 0;
    return ferry__err_set(NULL, FERRY_ESTATE,
                          "kv op %s: the op was made in process %ld and is used in process %ld, "
                          "a fork of it: the op and its store are the maker's (nothing done)",
                          what, op->maker, self);
}

ferry_kv *ferry__kv_op_enter(ferry_kv_op *op)
{
    ops_lock();
    op->refs++;
    ferry_kv *s = op->kv, *kv = NULL;
    if (s) {
        pthread_mutex_lock(&s->call_mu);
        if (!s->closing) {
            s->calls++;
            kv = s;
        }
        pthread_mutex_unlock(&s->call_mu);
    }
    pthread_mutex_unlock(&ops_mu);
    return kv;
}

void ferry__kv_op_leave(ferry_kv_op *op, ferry_kv *kv, unsigned drops)
{
    ops_lock();
    FERRY__ASSERT(op->refs >= drops);
    op->refs -= drops;
    int dead = op->refs == 0;
    /* a store that is closing detaches and frees it (close holds what the
     * op still has of the store); an open one (this call is inside it)
     * lets it go here, before the call leaves the store */
    if (dead && op->kv && !kv)
        dead = 0;
    if (dead && op->kv)
        unlink_op(op);
    pthread_mutex_unlock(&ops_mu);
    if (dead) {
        if (kv)
            ferry__kv_lw_detach(kv, op);
        destroy(op);
    }
    if (kv)
        ferry__kv_leave(kv);
}

void ferry__kv_op_hand(ferry_kv_op *op)
{
    ops_lock();
    op->handed = 1;
    pthread_mutex_unlock(&ops_mu);
}

void ferry__kv_ops_abandon(ferry_kv *kv)
{
    ops_lock();
    /* only a store no call is inside (refs: the owner's, if not freed): a
     * layer_done that entered before close began finishes first, as close
     * promises (its last layer commits the store); the calls entering from
     * now on find the store closing. The others wait for ops_orphan, as
     * does an op its caller does not have yet: the store_layers call
     * making it (inside the store) still reserves its slots and fills its
     * layer state in without op->mu, and may wait for a slot meanwhile. */
    for (ferry_kv_op *op = kv->ops; op; op = op->lnext)
        if (op->handed && op->refs <= 1)
            ferry__kv_lw_abandon(kv, op);
    pthread_mutex_unlock(&ops_mu);
}

void ferry__kv_ops_orphan(ferry_kv *kv)
{
    ops_lock();
    while (kv->ops) {
        ferry_kv_op *op = kv->ops;
        unlink_op(op);
        /* a layerwise store still lacking layers: nothing of it commits */
        ferry__kv_lw_abandon(kv, op);
        ferry__kv_lw_detach(kv, op);
        op->kv = NULL;
        if (op->refs == 0)
            destroy(op);
    }
    pthread_mutex_unlock(&ops_mu);
}

/* ---- the public calls ---- */

/* under op->mu's discipline: wait up to timeout_ms for op to be done */
static int wait_done(ferry_kv_op *op, int timeout_ms)
{
    pthread_mutex_lock(&op->mu);
    if (timeout_ms < 0) {
        while (!op->done)
            pthread_cond_wait(&op->cv, &op->mu);
    } else if (!op->done && timeout_ms > 0) {
        struct timespec ts = ferry__deadline_ms((uint64_t)timeout_ms);
        while (!op->done)
            if (pthread_cond_timedwait(&op->cv, &op->mu, &ts) == ETIMEDOUT)
                break;
    }
    int done = op->done, rc = op->result;
    pthread_mutex_unlock(&op->mu);
    return done ? rc : -ETIMEDOUT;
}

int ferry_kv_op_wait(ferry_kv_op *op, int timeout_ms)
{
    if (!op)
        return ferry__err_set(NULL, -EINVAL, "kv op wait: op is NULL");
    int forked = ferry__kv_op_forked(op, "wait");
    if (forked < 0)
        return forked;
    ferry_kv *kv = ferry__kv_op_enter(op);
    int rc = ferry__kv_lw_wait_check(kv, op); /* a layerwise store lacking layers */
    if (rc == 0)
        rc = wait_done(op, timeout_ms);
    ferry__kv_op_leave(op, kv, 1);
    return rc;
}

int ferry_kv_op_cancel(ferry_kv_op *op)
{
    if (!op)
        return ferry__err_set(NULL, -EINVAL, "kv op cancel: op is NULL");
    int forked = ferry__kv_op_forked(op, "cancel");
    if (forked < 0)
        return forked;
    ferry_kv *kv = ferry__kv_op_enter(op);
    atomic_store_explicit(&op->cancel, 1, memory_order_release);
    if (kv) /* a layerwise store not finished: aborted now (else by close) */
        ferry__kv_lw_abandon(kv, op);
    int rc = wait_done(op, -1);
    ferry__kv_op_leave(op, kv, 1);
    return rc;
}

int ferry_kv_op_test(ferry_kv_op *op)
{
    int rc = ferry_kv_op_wait(op, 0);
    return rc == -ETIMEDOUT ? -EAGAIN : rc;
}

void ferry_kv_op_free(ferry_kv_op *op)
{
    if (!op)
        return;
    if (ferry__kv_op_forked(op, "free") < 0) { /* the maker's to free: left as it is */
        FERRY_LOGW("%s", ferry_last_error());
        return;
    }
    ferry_kv *kv = ferry__kv_op_enter(op);
    ops_lock();
    int twice = op->freed;
    op->freed = 1;
    pthread_mutex_unlock(&ops_mu);
    if (twice) { /* a second free while the first's call still runs: refused */
        ferry__err_set(NULL, -EINVAL, "kv op free: the op was freed already");
        ferry__kv_op_leave(op, kv, 1);
        return;
    }
    if (kv)
        ferry__kv_lw_abandon(kv, op);
    wait_done(op, -1);
    ferry__kv_op_leave(op, kv, 2); /* this call's reference and the owner's */
}

unsigned ferry__kv_op_refs(ferry_kv_op *op)
{
    ops_lock();
    unsigned r = op->refs;
    pthread_mutex_unlock(&ops_mu);
    return r;
}
