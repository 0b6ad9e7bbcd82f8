/*
 * guard.c - close against calls still inside the store.
 *
 * ferry_kv_close may be called while other threads are inside calls on
 * the same store (an engine shutting down while a request still runs).
 * Close then waits for them: every public call counts itself in while it
 * runs, and close first refuses new calls (FERRY_ESTATE, "closing"), then
 * waits until the count is zero, and only then stops the workers and frees
 * anything. A call that begins after close has returned uses freed memory,
 * as with any freed handle; that gap is the caller's (the Python package
 * closes it with a lock of its own).
 *
 * ferry_kv_close_begin refuses new calls on the store the same way
 * (refusing), but not calls on its ops (op.c looks at closing alone): a
 * layer_done an engine makes as its close begins still copies its layer,
 * as one made before would; ferry_kv_close then finishes those ops.
 *
 * A forked child's copy of a store is refused before anything of it is
 * touched (FERRY_ESTATE, naming the opener's pid and the child's): its
 * workers are not in the child, its L1 pool is not mapped there
 * (MADV_DONTFORK, tier_l1.c), its files, rings and connection are the
 * opener's, and call_mu may have been held by a thread of the opener at
 * the fork. The same holds for the store's ops (op.c). The check is one
 * load (ferry__pid), not a system call.
 *
 * Invariant: calls > 0 keeps the store's memory alive; closing only grows.
 * The count is guarded by call_mu, not an atomic: a leaving call must be
 * done with the store's memory before close can see zero.
 */
#include "kv/kv_impl.h"

int ferry__kv_forked(ferry_kv *kv, const char *what)
{
    long self = ferry__pid();
    if (self == kv->opener)
        return 0;
    /* the thread's message always; the store's too unless its lock was
     * held at the fork by a thread the child lacks; a warning once a
     * process (a data loader's worker may call on and on) */
    static _Atomic long warned;
    int rc = ferry__err_set(NULL, FERRY_ESTATE,
                            "kv %s: the store was opened in process %ld and is used in process "
                            "%ld, a fork of it: its threads, L1 pool, files and connection are "
                            "the opener's (open a store of its own in this process)",
                            what, kv->opener, self);
    if (pthread_mutex_trylock(&kv->err_mu) == 0) {
        ferry__err_pass(&kv->err, rc);
        pthread_mutex_unlock(&kv->err_mu);
    }
    if (atomic_exchange_explicit(&warned, self, memory_order_relaxed) != self)
        FERRY_LOGW("%s", ferry_last_error());
    return rc;
}

int ferry__kv_enter(ferry_kv *kv, const char *what)
{
    int forked = ferry__kv_forked(kv, what);
    if (forked < 0)
        return forked;
    pthread_mutex_lock(&kv->call_mu);
    int closing = kv->closing || kv->refusing;
    if (!closing)
        kv->calls++;
    pthread_mutex_unlock(&kv->call_mu);
    if (closing)
        return ferry__kv_err(kv, FERRY_ESTATE, "kv %s: the store is closing", what);
    return 0;
}

void ferry__kv_leave(ferry_kv *kv)
{
    pthread_mutex_lock(&kv->call_mu);
    FERRY__ASSERT(kv->calls > 0);
    if (--kv->calls == 0 && kv->closing)
        pthread_cond_broadcast(&kv->call_cv);
    pthread_mutex_unlock(&kv->call_mu);
}

void ferry__kv_refuse_calls(ferry_kv *kv)
{
    pthread_mutex_lock(&kv->call_mu);
    kv->closing = 1;
    pthread_mutex_unlock(&kv->call_mu);
}

void ferry__kv_refuse_store_calls(ferry_kv *kv)
{
    pthread_mutex_lock(&kv->call_mu);
    kv->refusing = 1;
    pthread_mutex_unlock(&kv->call_mu);
}

void ferry__kv_close_wait(ferry_kv *kv)
{
    pthread_mutex_lock(&kv->call_mu);
    kv->closing = 1;
    while (kv->calls)
        pthread_cond_wait(&kv->call_cv, &kv->call_mu);
    pthread_mutex_unlock(&kv->call_mu);
}

uint64_t ferry__kv_calls(ferry_kv *kv)
{
    pthread_mutex_lock(&kv->call_mu);
    uint64_t n = kv->calls;
    pthread_mutex_unlock(&kv->call_mu);
    return n;
}
