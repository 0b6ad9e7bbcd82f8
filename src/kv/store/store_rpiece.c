/*
 * store_rpiece.c - a retrieve's piece mode: the chunks of a tier that
 * checksums pieces (aops vpiece/check) are checked run by run as their
 * pieces land, on a free worker or the retrieving thread, and copied out
 * into a host buffer right after each check, so a chunk's check and copy
 * end with its last piece instead of following it.
 *
 * Invariant: a chunk counts as retrieved only when every piece passed; one
 * that failed in any way is a miss whose copied-out tokens are zeroed
 * before the retrieve returns, and its L1 slot is promoted (published)
 * only after its last check.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "kv/kv_impl.h"
#include "kv/store/store_int.h"
#include "kv/store/store_rt.h"

/* one check (and copy) of a piece-mode chunk: image bytes [c0, c1) are
 * checked, then [o0, o1) copied out when the chunk copies as it lands
 * (o1 > o0) and no check of it failed so far */
typedef struct rt_unit {
    rtv *r;
    struct rt_unit *next;       /* the retrieve's queue */
    size_t i;                   /* the chunk */
    ferry_kv_hash id;
    uint64_t c0, c1, o0, o1;
} rt_unit;

static void rt_unit_run(rtv *r, size_t i, const rt_unit *u)
{
    ferry_kv *kv = r->kv;
    rt_chunk *c = &r->c[i];
    if (c->direct) { /* (it landed in the engine's buffer: checked there) */
        ferry__kv_rt_direct_check(r, i, &u->id, u->c0, u->c1);
        return;
    }
    /* the copy goes with the hash, block by block, unless a check of the
     * chunk failed already. A cancel stops a chunk only before its first
     * copy (kv.h: copies under way finish): a chunk is then moved whole
     * (or zeroed after a failed check), or untouched */
    int copy = 0;
    if (u->o1 > u->o0) {
        if (r->wcopy)
            pthread_mutex_lock(&r->cmu);
        if (c->pstate == 0)
            c->pstate = ferry__kv_cancelled(r->cancel) ? 2 : 1;
        copy = c->pstate == 1 && c->pbad == 0;
        if (r->wcopy)
            pthread_mutex_unlock(&r->cmu);
    }
    uint64_t t = ferry__thread_cpu_ns(), got = 0;
    double hs = 1;
    ferry__kv_piece_out(r->buf, kv->chunk_tokens, (uint64_t)i * kv->chunk_tokens, c->adst, u->c0,
                        u->c1, copy ? u->o0 : 0, copy ? u->o1 : 0, &got, &hs);
    uint64_t cpu = ferry__thread_cpu_ns() - t, ch = (uint64_t)((double)cpu * hs);
    atomic_fetch_add_explicit(&kv->rt_check_ns, ch, memory_order_relaxed);
    atomic_fetch_add_explicit(&kv->rt_copy_ns, cpu - ch, memory_order_relaxed);
    int rc = ferry__kv_tier_piece_check(r->at, c->aloc, &u->id, u->c0 / c->vp, u->c1 - u->c0,
                                        got);
    if (r->wcopy)
        pthread_mutex_lock(&r->cmu);
    if (rc < 0 && c->pbad == 0) {
        c->pbad = rc;
        snprintf(r->why[i], sizeof r->why[i], "%s", ferry_last_error());
    }
    if (r->wcopy)
        pthread_mutex_unlock(&r->cmu);
    if (copy && rc == 0)
        rt_first(r, &r->first_bytes);
}

static void rt_unit_job(void *ctx, size_t i)
{
    rt_unit *u = ctx;
    rtv *r = u->r;
    rt_unit_run(r, i, u);
    ferry__free(u);
    pthread_mutex_lock(&r->cmu);
    r->c[i].pjobs--;
    r->wpending--;
    pthread_cond_broadcast(&r->ccv);
    pthread_mutex_unlock(&r->cmu);
}

/* read piece k of piece-mode chunk i landed: the runs of vp bytes now
 * landed whole are queued for their check (and copy out), which a free
 * worker or this thread runs after the reads are topped up */
void ferry__kv_rt_piece_landed(rtv *r, size_t i, uint32_t k)
{
    ferry_kv *kv = r->kv;
    rt_chunk *c = &r->c[i];
    uint8_t *lnd = r->plnd + i * r->npieces;
    lnd[k] = 1;
    while (c->nlp < r->npieces && lnd[c->nlp])
        c->nlp++;
    uint64_t len = kv->chunk_bytes, tb = ferry__kv_token_bytes(&kv->layout);
    c->lp = FERRY__MIN((uint64_t)c->nlp * r->piece, len);
    while (c->res == 0 && c->cdone < len) {
        rt_unit u = {r, NULL, i, c->pend->id, c->cdone, FERRY__MIN(c->cdone + c->vp, len),
                     c->odone, c->odone};
        if (u.c1 > c->lp)
            break;
        if (c->pcopy) /* whole tokens: a token cut by the piece's end goes with the next */
            u.o1 = u.c1 == len ? len : u.c1 - u.c1 % tb;
        c->cdone = u.c1;
        c->odone = u.o1;
        rt_unit *w = ferry__malloc(sizeof *w);
        if (!w) {
            rt_unit_run(r, i, &u);
            continue;
        }
        /* queued: handed to the workers once this thread topped the reads
         * up (ferry__kv_rt_units_hand), so a worker woken to check never
         * takes the CPU from the submission of the drive's next reads */
        *w = u;
        if (r->uq_tail)
            r->uq_tail->next = w;
        else
            r->uq = w;
        r->uq_tail = w;
        r->qbytes += w->c1 - w->c0;
    }
}

/* the queued checks beyond a chunk's bytes, from the first, to free
 * workers while there are any; the rest stay queued for this thread.
 * A check and copy streams memory: two at once on this machine's two
 * CPUs cost each about 1.5x the CPU of one alone (bench/check_copy_floor.c
 * runs one), and one stream clears a chunk's 2 MiB pieces at 12 GB/s or
 * so, far ahead of a drive that lands a chunk at a time. So the checks
 * stay with this thread, which runs them once the reads are topped up,
 * until a backlog of more than a chunk says that one stream no longer
 * keeps up with the drive (a faster drive, or many chunks landing at
 * once): then free workers take the excess */
void ferry__kv_rt_units_hand(rtv *r)
{
    if (!r->wcopy)
        return;
    while (r->uq && r->qbytes > r->kv->chunk_bytes) {
        rt_unit *w = r->uq;
        rt_chunk *c = &r->c[w->i];
        rt_unit *next = w->next;
        uint64_t len = w->c1 - w->c0; /* (w is the worker's once handed) */
        pthread_mutex_lock(&r->cmu);
        c->pjobs++;
        pthread_mutex_unlock(&r->cmu);
        if (ferry__kv_rt_hand_off(r, w->i, rt_unit_job, w)) {
            r->uq = next; /* (counted in wpending too; the job takes both back) */
            r->qbytes -= len;
            atomic_fetch_add_explicit(&r->kv->rt_handed, 1, memory_order_relaxed);
            continue;
        }
        pthread_mutex_lock(&r->cmu);
        c->pjobs--;
        pthread_mutex_unlock(&r->cmu);
        /* no worker free: the rest stay for this thread, in order */
        return;
    }
    if (!r->uq)
        r->uq_tail = NULL;
}

void ferry__kv_rt_units_run(rtv *r)
{
    ferry__kv_rt_units_hand(r);
    while (r->uq) {
        rt_unit *u = r->uq;
        r->uq = u->next;
        r->qbytes -= u->c1 - u->c0;
        if (!r->uq)
            r->uq_tail = NULL;
        rt_unit_run(r, u->i, u);
        ferry__free(u);
    }
}

/* chunk i's read begins: piece mode when its tier checks its pieces (and
 * the retrieve keeps a landed map); its pieces are copied out as they
 * pass when the whole chunk goes to a host buffer, else (a device buffer,
 * the last partial chunk, tokens the engine keeps, a cancelled op) it is
 * copied out once whole, after its last check */
void ferry__kv_rt_piece_mode(rtv *r, size_t i)
{
    ferry_kv *kv = r->kv;
    ferry__kv_tier *t = r->at;
    rt_chunk *c = &r->c[i];
    c->vp = r->plnd && t->aops->vpiece ? t->aops->vpiece(t, c->aloc) : 0;
    if (!c->vp && c->direct) { /* no piece sums: checked whole, in the buffer */
        c->vp = kv->chunk_bytes;
        c->vwhole = 1;
    }
    if (!c->vp)
        return;
    memset(r->plnd + i * r->npieces, 0, r->npieces);
    c->nlp = 0;
    c->lp = c->cdone = c->odone = 0;
    c->pbad = 0;
    c->pstate = 0;
    c->pcopy = !c->direct && !r->s && ferry__kv_chunk_ntok(kv, i, r->n) == kv->chunk_tokens &&
               r->skip <= (uint64_t)i * kv->chunk_tokens && !ferry__kv_cancelled(r->cancel) &&
               ferry__kv_rt_failed(r) == 0;
}

/* a piece-mode chunk's read is over: its checks are waited for; the
 * first that failed (0: none) */
int ferry__kv_rt_pieces_done(rtv *r, size_t i)
{
    rt_chunk *c = &r->c[i];
    ferry__kv_rt_units_run(r);
    if (!r->wcopy)
        return c->pbad;
    pthread_mutex_lock(&r->cmu);
    while (c->pjobs)
        pthread_cond_wait(&r->ccv, &r->cmu);
    int bad = c->pbad;
    pthread_mutex_unlock(&r->cmu);
    return bad;
}

/* a piece-mode chunk that passed every check and was copied out as it
 * landed: promoted into L1, counted */
void ferry__kv_rt_pieces_finish(rtv *r, size_t i, ferry__kv_entry *e)
{
    ferry_kv *kv = r->kv;
    pthread_mutex_lock(&kv->mu);
    FERRY__ASSERT(kv->l1_reading > 0);
    kv->l1_reading--;
    ferry__kv_promote_finish(kv, e, r->c[i].slot, 0, r->at->id); /* (wakes reserve's waiters) */
    ferry__kv_read_unlock(e);
    ferry__kv_put(kv, e);
    pthread_mutex_unlock(&kv->mu);
    if (r->wcopy)
        pthread_mutex_lock(&r->cmu);
    if (r->c[i].pstate != 1) { /* cancelled before any of it was copied out */
        r->c[i].st = -ECANCELED;
        r->ncancel++;
    } else {
        r->c[i].st = 0;
        r->got++;
        r->hits[r->at->id]++;
        rt_first(r, &r->first_chunk);
    }
    if (r->wcopy)
        pthread_mutex_unlock(&r->cmu);
}
