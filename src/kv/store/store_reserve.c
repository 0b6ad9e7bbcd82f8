/*
 * store_reserve.c - eviction and reservation of tier slots (under kv->mu).
 *
 * A tier evicts by its policy from the watermark down, never a locked or
 * in-flight entry; a reservation that finds the tier full of those declines
 * or waits for a write-through or read, as its caller asked.
 *
 * Back-pressure (store_int.h: ferry__kv_waiter): a caller that holds no L1
 * slot waits up to its deadline in a FIFO queue, only the head reserving,
 * so slots that free go in arrival order; it re-checks at least every
 * WAIT_SLICE_NS besides the wake-ups (a lock's TTL passes without one).
 * Holders never queue, so the queue never waits on itself. Once the
 * store's close began (ferry_kv_close_begin: close_begun set and `loaded`
 * broadcast under mu) no caller waits: it gets -ECANCELED, holding
 * nothing, so no slot of it is ever written. A daemon's connection thread
 * that was cut (ferry__kv_thread_cut) gets -ECANCELED the same way, before
 * it could take a slot, at its next look (a slice at most).
 */
#include <errno.h>
#include <time.h>
#include <stddef.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv/kv_impl.h"
#include "kv/kv_slots.h"
#include "kv/store/store_int.h"

typedef struct evict_ctx {
    ferry_kv *kv;
    uint64_t now;
    int keep_ahead; /* spare a retrieve's landed read-ahead (kv_impl.h: ahead_until) */
} evict_ctx;

static int evictable(ferry__kv_entry *e, void *ctx)
{
    evict_ctx *c = ctx;
    return e->state == FERRY__KV_READY && !ferry__kv_locked(c->kv, e, c->now) &&
           (!c->keep_ahead || c->now >= e->ahead_until);
}

/* evict one chunk from tier; 1 when one went. keep_ahead: not a landed
 * read-ahead that a retrieve is about to copy out (a preference only: a
 * reservation that finds nothing else takes one rather than fail) */
static int evict_one(ferry_kv *kv, int tier, uint64_t now, int keep_ahead)
{
    ferry__kv_tier *t = kv->tier[tier];
    evict_ctx c = {kv, now, keep_ahead};
    ferry__kv_entry *v = t->policy->ops->victim(t->policy, evictable, &c);
    if (!v)
        return 0;
    /* the policy already unlinked it */
    ferry__kv_count_expired(kv, v);
    ferry__kv_tier_release(kv, tier, v->loc[tier]);
    v->resident &= (uint8_t) ~(1u << tier);
    atomic_fetch_add(&t->evictions, 1);
    if (!v->resident)
        ferry__kv_doom(kv, v);
    return 1;
}

/* reserve room for one chunk in tier, evicting by the watermark and when
 * full. 0 and *loc, or FERRY_ENOSPACE (everything left is locked) / -ENOMEM,
 * or (may_wait) -EAGAIN after waiting for a write-through to free a slot:
 * kv->mu was released, the caller must look its entry up again. */
int ferry__kv_reserve(ferry_kv *kv, int tier, uint64_t now, uint64_t *loc, int may_wait)
{
    ferry__kv_tier *t = kv->tier[tier];
    double cap = (double)t->capacity;
    if ((double)(t->used + 1) >= kv->watermark * cap && (double)t->used > kv->low * cap) {
        while ((double)t->used > kv->low * cap && evict_one(kv, tier, now, 1))
            ;
    }
    for (;;) {
        int rc = t->used < t->capacity ? t->ops->reserve(t, loc) : FERRY_ENOSPACE;
        if (rc == 0) {
            t->used++;
            if (tier == FERRY_KV_TIER_L1)
                kv->l1_gen[*loc]++;
            return 0;
        }
        if (rc == FERRY_ENOSPACE && (evict_one(kv, tier, now, 1) || evict_one(kv, tier, now, 0)))
            continue;
        /* L1 full of chunks whose write-through is in flight: those finish
         * without waiting for anyone, so wait for one rather than decline.
         * The mutex was released meanwhile: the caller starts over. */
        if (rc == FERRY_ENOSPACE && tier == FERRY_KV_TIER_L1 &&
            ((may_wait == RESERVE_WAIT && kv->l2_writes_inflight) ||
             (may_wait == RESERVE_WAIT_READS && (kv->l2_writes_inflight || kv->l1_reading)))) {
            pthread_cond_wait(&kv->loaded, &kv->mu);
            return -EAGAIN;
        }
        if (may_wait != RESERVE_TRY)
            atomic_fetch_add(&t->failures, 1);
        return rc;
    }
}

/* how long a waiter sleeps at most before it looks again */
#define WAIT_SLICE_NS ((uint64_t)5 * 1000 * 1000)

/* this thread's waits since it last asked (a daemon's connection thread:
 * its client's) */
static _Thread_local uint64_t t_waits, t_wait_ns;
/* this thread's cut (kv_slots.h), or NULL */
static _Thread_local ferry__kv_cut *t_cut;

void ferry__kv_thread_cut(ferry__kv_cut *cut)
{
    t_cut = cut;
}

ferry__kv_cut *ferry__kv_thread_cut_get(void)
{
    return t_cut;
}

ferry__kv_cut *ferry__kv_cut_new(void)
{
    ferry__kv_cut *c = ferry__malloc(sizeof *c);
    if (c) {
        atomic_init(&c->why, 0);
        atomic_init(&c->refs, 1);
    }
    return c;
}

void ferry__kv_cut_put(ferry__kv_cut *cut)
{
    if (cut && atomic_fetch_sub(&cut->refs, 1) == 1)
        ferry__free(cut);
}

void ferry__kv_thread_waits(uint64_t *waits, uint64_t *ns)
{
    *waits = t_waits;
    *ns = t_wait_ns;
    t_waits = t_wait_ns = 0;
}

void ferry__kv_room(ferry_kv *kv)
{
    if (kv->wq_head)
        pthread_cond_broadcast(&kv->loaded);
}

void ferry__kv_wait_leave(ferry_kv *kv, ferry__kv_waiter *w)
{
    if (w->deadline && w->t0) {
        uint64_t ns = ferry__now_ns() - w->t0;
        atomic_fetch_add(&kv->pool_wait_ns_total, ns);
        t_wait_ns += ns;
        w->t0 = 0;
    }
    if (!w->queued)
        return;
    ferry__kv_waiter **pp = &kv->wq_head, *prev = NULL;
    while (*pp && *pp != w) {
        prev = *pp;
        pp = &(*pp)->next;
    }
    if (*pp) {
        *pp = w->next;
        if (kv->wq_tail == w)
            kv->wq_tail = prev;
    }
    w->queued = 0;
    w->next = NULL;
    pthread_cond_broadcast(&kv->loaded); /* the next one may be the head now */
}

/* under mu: sleep on `loaded` until woken, the deadline, or a slice */
static void wait_a_while(ferry_kv *kv, uint64_t deadline, uint64_t now)
{
    uint64_t ns = FERRY__MIN(deadline - now, WAIT_SLICE_NS);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts); /* `loaded` runs on the default clock */
    uint64_t t = (uint64_t)ts.tv_nsec + ns;
    ts.tv_sec += (time_t)(t / 1000000000u);
    ts.tv_nsec = (long)(t % 1000000000u);
    pthread_cond_timedwait(&kv->loaded, &kv->mu, &ts);
}

int ferry__kv_reserve_l1(ferry_kv *kv, ferry__kv_waiter *w, uint64_t wait_ns, int last,
                         uint64_t *loc)
{
    uint64_t now = ferry__kv_now_ns(kv);
    int r;
    if (t_cut && ferry__kv_cancelled(&t_cut->why)) { /* (before any slot is taken: see kv_slots.h) */
        ferry__kv_wait_leave(kv, w);
        return -ECANCELED;
    }
    if (wait_ns == FERRY__KV_TAKE_FREE)
        return ferry__kv_reserve(kv, FERRY_KV_TIER_L1, now, loc, RESERVE_TRY);
    if (!wait_ns) {
        r = ferry__kv_reserve(kv, FERRY_KV_TIER_L1, now, loc, last);
        if (r == FERRY_ENOSPACE)
            atomic_fetch_add(&kv->pool_declines, 1);
        return r;
    }
    if (!kv->wq_head || kv->wq_head == w) {
        r = ferry__kv_reserve(kv, FERRY_KV_TIER_L1, now, loc, RESERVE_TRY);
        if (r != FERRY_ENOSPACE) {
            ferry__kv_wait_leave(kv, w);
            return r;
        }
    }
    if (atomic_load_explicit(&kv->close_begun, memory_order_acquire)) {
        ferry__kv_wait_leave(kv, w);
        return -ECANCELED;
    }
    uint64_t t = ferry__now_ns();
    if (!w->deadline) {
        w->t0 = t;
        w->deadline = t + wait_ns;
        atomic_fetch_add(&kv->pool_waits, 1);
        t_waits++;
    }
    if (t >= w->deadline) {
        ferry__kv_wait_leave(kv, w);
        /* the last word, as without a deadline: write-throughs in flight
         * finish on their own, so one is still waited for */
        r = ferry__kv_reserve(kv, FERRY_KV_TIER_L1, now, loc, last);
        if (r == FERRY_ENOSPACE)
            atomic_fetch_add(&kv->pool_declines, 1);
        return r;
    }
    if (!w->queued) {
        w->next = NULL;
        if (kv->wq_tail)
            kv->wq_tail->next = w;
        else
            kv->wq_head = w;
        kv->wq_tail = w;
        w->queued = 1;
    }
    wait_a_while(kv, w->deadline, t);
    return -EAGAIN;
}

void ferry__kv_pool_holders(ferry_kv *kv, char *buf, size_t len)
{
    ferry__kv_tier *l1 = kv->tier[FERRY_KV_TIER_L1];
    uint64_t now = ferry__kv_now_ns(kv), writing = 0, reading = 0, pinned = 0, through = 0,
             loading = 0, waiters = 0;
    for (uint64_t b = 0; b < kv->nbuckets; b++)
        for (ferry__kv_entry *e = kv->buckets[b]; e; e = e->hnext) {
            if (e->loc[FERRY_KV_TIER_L1] == UINT64_MAX)
                continue;
            if (e->state == FERRY__KV_WRITING)
                writing++;
            else if (e->l1_loading)
                loading++;
            else if (e->l2_writing)
                through++;
            else if (e->readers && now < e->read_deadline)
                reading++;
            pinned += e->pins != 0;
        }
    for (ferry__kv_waiter *w = kv->wq_head; w; w = w->next)
        waiters++;
    snprintf(buf, len,
             "the L1 pool's %llu slots: %llu used, %llu being written, %llu read-locked (%llu "
             "pinned), %llu being written through, %llu being loaded; %llu other callers "
             "waiting",
             (unsigned long long)l1->capacity, (unsigned long long)l1->used,
             (unsigned long long)writing, (unsigned long long)reading,
             (unsigned long long)pinned, (unsigned long long)through,
             (unsigned long long)loading, (unsigned long long)waiters);
}
