/*
 * store_aprefetch.c - prefetch from a tier with asynchronous reads (the
 * L2s) as one stream: the chunks one prefetch call queued are read by one
 * worker, in order, in the tier's pieces with its request depth in flight
 * (kv_impl.h's aops), and each is checked and promoted as its last piece
 * lands while the later reads go on. One synchronous read per worker
 * instead lands chunks in pairs, with the drive waiting between them.
 * What landed is replaced by the next reads before its chunk is checked:
 * a drive that completes its whole queue at once (a virtual disk: 16 x 2
 * MiB together) would otherwise sit idle for each 32 MiB check, 1.5-2 ms
 * of every 12 (a daemon's retrieve reads through here).
 *
 * A tier that checksums pieces (aops vpiece/psum) has each check piece
 * checked once the reads holding its bytes landed (after the replacing
 * reads went out), so a chunk's end leaves only its last piece to check,
 * not a whole 32 MiB pass (1.4-4 ms the drive idled for at each
 * document's end); a chunk without piece sums is checked whole as its
 * last read lands.
 *
 * A chunk's bytes count only after every byte of what landed in its L1
 * slot passed the tier's check (each piece's, or the whole verify); until
 * then the slot is unpublished (l1_loading), as for any promotion. A piece
 * that failed its check, like a read that failed, drops that copy (a miss
 * without another); a failure that is not the copy's (no memory for a
 * request, the tier's queue broken) keeps the copy and frees the slot, or
 * retires it when a read may still land there.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "kv/kv_impl.h"
#include "kv/store/store_int.h"

void (*ferry__kv_aprefetch_on_check)(ferry_kv *kv, unsigned inflight, unsigned depth, int more);
void (*ferry__kv_aprefetch_on_verify)(ferry_kv *kv, uint64_t bytes, int whole);

typedef struct ap_chunk {
    ferry__kv_job *j;
    char *dst;                /* its L1 slot */
    uint64_t loc;             /* its location in the tier */
    uint32_t sent, left;      /* pieces sent, pieces in flight */
    int res;                  /* its first failure */
    uint8_t begun;            /* the tier's end is due */
    uint8_t how;              /* FERRY__KV_LAND_*: what its landing does */
    uint8_t ready;            /* every read of it landed: its check and landing are due */
    uint32_t nlp;             /* its read pieces landed in order from the first */
    uint64_t vp;              /* bytes per check piece (0: checked whole once landed) */
    uint64_t cdone;           /* image bytes checked good so far (vp) */
    int bad;                  /* its first failed piece check (vp; message in why) */
    char why[200];            /* the first failure's message */
} ap_chunk;

typedef struct ap {
    ferry_kv *kv;
    ferry__kv_tier *t;
    ferry__kv_job *j0;        /* the group's first job (the pool frees it) */
    ap_chunk *c;
    size_t n, cur, done;      /* chunks; the one being sent; landed */
    size_t lfirst;            /* chunks before it are landed or not ready */
    uint64_t piece;
    uint32_t npieces;
    unsigned inflight, pdepth;
    uint8_t *lnd;             /* chunk i's read piece k landed: lnd[i * npieces + k]
                                 (NULL: no memory for it, chunks checked whole) */
    ferry__kv_abatch b;
} ap;

/* chunk i's first failure */
static void ap_fail(ap_chunk *c, int rc, const char *why)
{
    if (c->res < 0)
        return;
    c->res = rc;
    snprintf(c->why, sizeof c->why, "%s", why && *why ? why : ferry_strerror(rc));
}

/* the check pieces of chunk i whose bytes all landed (after the reads
 * were topped up): each against its sum, until one fails or a read of the
 * chunk did */
static void ap_check(ap *p, size_t i)
{
    ap_chunk *c = &p->c[i];
    ferry_kv *kv = p->kv;
    ferry__kv_tier *t = p->t;
    if (!c->vp || !c->j || c->res < 0 || c->bad < 0)
        return;
    const uint8_t *lnd = p->lnd + i * p->npieces;
    while (c->nlp < p->npieces && lnd[c->nlp])
        c->nlp++;
    uint64_t len = kv->chunk_bytes, lp = FERRY__MIN((uint64_t)c->nlp * p->piece, t->slot_bytes);
    while (c->cdone < len) {
        uint64_t c0 = c->cdone, c1 = FERRY__MIN(c0 + c->vp, len);
        if (c1 > lp)
            return;
        if (ferry__kv_aprefetch_on_verify)
            ferry__kv_aprefetch_on_verify(kv, c1 - c0, 0);
        int rc = ferry__kv_tier_piece_check(t, c->loc, &c->j->e->id, c0 / c->vp, c1 - c0,
                                            ferry__kv_sum(c->dst + c0, (size_t)(c1 - c0)));
        if (rc < 0) {
            c->bad = rc;
            snprintf(c->why, sizeof c->why, "%s", ferry_last_error());
            return;
        }
        c->cdone = c1;
    }
}

/* chunk i is over (nothing of it in flight): checked, promoted or not */
static void ap_land(ap *p, size_t i)
{
    ap_chunk *c = &p->c[i];
    ferry__kv_tier *t = p->t;
    ferry_kv *kv = p->kv;
    ferry__kv_job *j = c->j;
    if (c->begun) {
        t->aops->end(t, c->loc);
        c->begun = 0;
    }
    int rc = c->res;
    if (ferry__kv_aprefetch_on_check)
        ferry__kv_aprefetch_on_check(kv, p->inflight, p->pdepth, p->cur < p->n);
    if (c->how == FERRY__KV_LAND_PROMOTE) {
        if (rc < 0)
            ferry__err_set(NULL, rc, "%s", c->why);
        ferry__kv_tier_io_done(kv, t, 0, c->loc, &j->e->id, t->slot_bytes, rc);
        if (rc == 0 && t->aops->verify) {
            if (c->vp) {
                /* every read landed: what is left to check (its last piece) */
                ap_check(p, i);
                FERRY__ASSERT(c->bad < 0 || c->cdone == kv->chunk_bytes);
                rc = c->bad;
                if (rc < 0)
                    ferry__err_set(NULL, rc, "%s", c->why);
            } else {
                /* no piece sums (an older slab's chunk): its whole sum */
                if (ferry__kv_aprefetch_on_verify)
                    ferry__kv_aprefetch_on_verify(kv, kv->chunk_bytes, 1);
                rc = ferry__kv_tier_check_whole(t, c->loc, &j->e->id, c->dst, kv->chunk_bytes);
            }
            if (rc < 0)
                ferry__kv_tier_io_done(kv, t, 0, c->loc, &j->e->id, 0, rc);
        }
    } else if (c->how != FERRY__KV_LAND_DROP) {
        atomic_fetch_add(&kv->failures, 1);
    }
    ferry__kv_prefetch_land(kv, j, rc, c->how);
    if (j != p->j0)
        ferry__free(j);
    c->j = NULL;
    p->done++;
}

/* send the next piece of chunk p->cur */
static void ap_send(ap *p)
{
    size_t i = p->cur;
    ap_chunk *c = &p->c[i];
    ferry__kv_tier *t = p->t;
    uint64_t off = (uint64_t)c->sent * p->piece;
    size_t len = (size_t)FERRY__MIN(p->piece, t->slot_bytes - off);
    ferry__kv_aread *a = t->aops->get(t);
    int rc = a ? 0 : ferry__err_set(NULL, -ENOMEM, "kv prefetch: out of memory for a read");
    if (rc == 0 && c->sent == 0)
        rc = ferry__kv_tier_fault(p->kv, t, 0, c->loc, t->slot_bytes);
    int busy = 0; /* begin found the tier's location still being read */
    if (rc == 0 && c->sent == 0 && t->aops->begin) {
        rc = t->aops->begin(t, c->loc, &c->j->e->id, t->slot_bytes);
        c->begun = rc == 0;
        busy = rc == -EBUSY;
    }
    /* (between begin and end: whether the chunk has piece sums) */
    if (rc == 0 && c->sent == 0 && p->lnd && t->aops->vpiece && t->aops->psum)
        c->vp = t->aops->vpiece(t, c->loc);
    if (rc == 0) {
        a->idx = i;
        a->piece = c->sent;
        rc = t->aops->submit(t, &p->b, a, c->loc, off, c->dst + off, len);
    }
    if (rc == 0) {
        p->inflight++;
        c->left++;
        if (++c->sent == p->npieces)
            p->cur++;
        return;
    }
    t->aops->put(t, a);
    ap_fail(c, rc, ferry_last_error());
    /* memory, the queue, or the tier's slot still being read by an
     * earlier read (begin's -EBUSY): not this copy's failure */
    if (rc == -ENOMEM || busy || (t->aops->broken && t->aops->broken(t)))
        c->how = FERRY__KV_LAND_RELEASE;
    c->sent = p->npieces; /* no more of it */
    p->cur++;
    if (c->left == 0)
        ap_land(p, i);
}

/* the queue broke: every chunk not landed is lost to it (pieces in flight
 * may still land: those slots are retired) */
static void ap_broken(ap *p, int rc)
{
    char why[200];
    snprintf(why, sizeof why, "%s", ferry_last_error());
    for (size_t i = 0; i < p->n; i++) {
        ap_chunk *c = &p->c[i];
        if (!c->j)
            continue;
        ap_fail(c, rc, why);
        c->how = c->left ? FERRY__KV_LAND_RETIRE : FERRY__KV_LAND_RELEASE;
        ap_land(p, i);
    }
    p->inflight = 0;
}

/* take what landed: chunks whose every piece is in are checked and promoted */
static void ap_take(ap *p, ferry__kv_aread *a)
{
    ferry__kv_tier *t = p->t;
    for (ferry__kv_aread *next; a; a = next) {
        next = a->next;
        size_t i = a->idx;
        ap_chunk *c = &p->c[i];
        if (a->result < 0) {
            /* the disk failed a read of this copy: that outweighs memory
             * having run out for a later piece (the copy goes) */
            if (c->how == FERRY__KV_LAND_RELEASE) {
                c->how = FERRY__KV_LAND_PROMOTE;
                c->res = 0;
            }
            ap_fail(c, a->result, a->why);
            if (c->sent < p->npieces && p->cur == i)
                p->cur++; /* its pieces not sent yet never are */
            c->sent = p->npieces;
        } else if (p->lnd) {
            p->lnd[i * p->npieces + a->piece] = 1; /* (checked in ap_land_ready) */
        }
        t->aops->put(t, a);
        p->inflight--;
        c->left--;
        if (c->left == 0 && c->sent == p->npieces)
            c->ready = 1; /* checked once the reads are topped up (ap_land_ready) */
    }
}

/* check the pieces that landed and land the chunks whose reads are all
 * in: after the next reads went out, so the drive reads on while the
 * worker checks (a drive that completes its whole queue at once would
 * otherwise sit idle for each check) */
static void ap_land_ready(ap *p)
{
    while (p->lfirst < p->n && !p->c[p->lfirst].j)
        p->lfirst++;
    for (size_t i = p->lfirst; i < p->n && i <= p->cur; i++) {
        ap_check(p, i);
        if (p->c[i].j && p->c[i].ready)
            ap_land(p, i);
    }
}

/* the group is read-ahead for a daemon's client that is gone:
 * every chunk of the group no read was sent for is dropped now, its slot
 * given back (the group is one call's, one cut); those being read land */
static void ap_drop_gone(ap *p)
{
    size_t i = p->cur;
    while (i < p->n && !p->c[i].j)
        i++;
    if (i == p->n || !ferry__kv_ahead_gone(p->c[i].j))
        return;
    for (; i < p->n; i++) {
        ap_chunk *c = &p->c[i];
        if (!c->j || c->sent)
            continue;
        c->how = FERRY__KV_LAND_DROP;
        c->sent = p->npieces;
        ap_land(p, i);
    }
}

/* the next chunk with pieces to send (p->cur), or 0 */
static int ap_more(ap *p)
{
    while (p->cur < p->n && p->c[p->cur].sent == p->npieces)
        p->cur++;
    return p->cur < p->n;
}

/* a worker's job: the group of prefetches that starts with j0 */
static void ap_run(ferry_kv *kv, ferry__kv_job *j0)
{
    ap p;
    memset(&p, 0, sizeof p);
    p.kv = kv;
    p.j0 = j0;
    p.t = kv->tier[j0->src_tier];
    for (ferry__kv_job *j = j0; j; j = j->group)
        p.n++;
    p.c = ferry__calloc(p.n, sizeof *p.c);
    if (!p.c) {
        /* no memory for the stream: one synchronous read after another */
        for (ferry__kv_job *j = j0, *next; j; j = next) {
            next = j->group;
            ferry__kv_job_run(kv, j);
            if (j != j0)
                ferry__free(j);
        }
        return;
    }
    ferry__kv_tier *t = p.t, *l1 = kv->tier[FERRY_KV_TIER_L1];
    size_t i = 0;
    for (ferry__kv_job *j = j0; j; j = j->group, i++) {
        p.c[i].j = j;
        p.c[i].dst = l1->ops->host_ptr(l1, j->l1_loc);
        p.c[i].loc = j->e->loc[t->id]; /* (read-locked: its location is stable) */
    }
    p.piece = t->apiece && t->apiece < t->slot_bytes ? t->apiece : t->slot_bytes;
    p.npieces = (uint32_t)((t->slot_bytes + p.piece - 1) / p.piece);
    p.pdepth = p.npieces > 1 ? t->aops->pdepth : t->aops->depth;
    /* (no memory for the landed map: each chunk checked whole) */
    p.lnd = t->aops->vpiece && t->aops->psum ? ferry__calloc(p.n, p.npieces) : NULL;
    while (p.done < p.n) {
        ap_drop_gone(&p);
        while (p.inflight < p.pdepth && ap_more(&p))
            ap_send(&p);
        ap_land_ready(&p);
        if (!p.inflight) {
            /* every chunk was sent, and what failed to send has landed */
            FERRY__ASSERT(p.done == p.n);
            break;
        }
        ferry__kv_aread *a = NULL;
        int rc = t->aops->wait(t, &p.b, &a);
        if (rc < 0) {
            ap_broken(&p, rc);
            break;
        }
        ap_take(&p, a);
    }
    ferry__free(p.lnd);
    ferry__free(p.c);
}

void ferry__kv_prefetch_queue(ferry_kv *kv, ferry__kv_job *head, int leading)
{
    ferry__kv_job *group = NULL, **gtail = &group;
    for (ferry__kv_job *j = head, *next; j; j = next) {
        next = j->next;
        ferry__kv_tier *t = kv->tier[j->src_tier];
        int async = leading && t->aops && !(t->aops->broken && t->aops->broken(t)) &&
                    (!group || group->src_tier == j->src_tier);
        if (!async) {
            ferry__kv_enqueue(kv, j);
            continue;
        }
        j->group = NULL;
        *gtail = j;
        gtail = &j->group;
    }
    if (group) {
        group->run = ap_run;
        ferry__kv_enqueue(kv, group);
    }
}
