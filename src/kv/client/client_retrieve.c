/*
 * client_retrieve.c - a retrieve through a `ferry serve` daemon
 * (docs/PROTOCOL.md "Retrieve"), pipelined.
 *
 * With a pool of 8 slots or more the chunks go in batches of an eighth of
 * it (at most PIPE_BATCH_MAX), and while the client copies batch k out of
 * the pool the daemon already works on batch k+1: before the copy the
 * client sends a PREFETCH naming batches k+1 to k+3 and the ACQUIRE of
 * batch k+1, after it the RELEASE of batch k. The drive so reads ahead
 * (within the daemon's read-ahead budget), and neither the ACQUIRE's
 * round trip nor its wait for the drive sits between two copies.
 *
 * Each step first reads every reply outstanding (replies come in the order
 * of the requests), so at most a PREFETCH, an ACQUIRE and a RELEASE are in
 * flight, all small (the bytes both ways fit the socket's buffers, so
 * neither side blocks sending while the other does), and the client holds
 * at most two batches, a quarter of the pool, as an unpipelined retrieve
 * of quarter-pool batches did. An ACQUIRE from a connection that holds
 * anything never waits for a slot (with every slot locked it answers
 * FERRY_ENOSPACE), so holding a batch while the next is acquired cannot
 * deadlock clients that share the pool. A chunk answered FERRY_ENOSPACE
 * is asked for again when the batch before it was released, and the rest of the retrieve goes one batch at
 * a time (ACQUIRE, copy, RELEASE, then the next), as it does from a pool of
 * fewer than 8 slots (batches of a quarter of it). Before a chunk declined
 * is asked for again, what the batch holds is copied out and released, so
 * the connection holds nothing and the daemon waits for room (up to the
 * client's pool_wait_ms); that repeats while each try gets some of them,
 * and a chunk declined by a try that got none is FERRY_ENOSPACE.
 *
 * No byte is trusted before its RELEASE answers 0 (the slot was not
 * reused meanwhile); a chunk whose RELEASE says otherwise, or goes
 * unanswered (the connection lost: the locks went with it), is zeroed in
 * a host buffer and is a miss. A RELEASE cannot fail to be encoded: the
 * frame buffer is grown at the start for the largest request of the
 * retrieve, before anything is acquired (were it refused anyway, the
 * connection is closed, so the daemon drops the locks at once rather than
 * at their TTL). A stop (cancel, a failed copy, a refused
 * request) releases what was acquired and not copied, and reads every
 * reply outstanding, so the connection stays in step for the next call.
 */
#include <errno.h>
#include <string.h>

#include "kv/kv_impl.h"
#include "kv/client/kvc.h"
#include "kv/store/store_int.h"

/* chunks a batch holds at most when pipelined (the requests and replies in
 * flight together stay within tens of KiB) */
#define PIPE_BATCH_MAX 1024u

typedef struct rbatch {
    size_t first, m;       /* the retrieve's chunks [first, first + m) */
    ferry__proto_chunk *h; /* those held: slot, gen; tokens = index in the batch */
    size_t held;
    size_t nospace;        /* chunks answered FERRY_ENOSPACE (asked again once) */
    int copy_rc;           /* the copy out of the pool: 0 or its code */
    int copied;            /* bytes went into the buffer (voided when not vouched for) */
} rbatch;

typedef struct rpipe {
    ferry_kv *kv;
    ferry__kvc *c;
    const ferry_kv_hash *ids;
    size_t nch, n;
    size_t b;              /* chunks a batch */
    size_t ahead;          /* chunks a PREFETCH names: the next batch and more */
    int pipelined;         /* the next batch acquired before this one's copy */
    const ferry_kv_buffer *buf;
    ferry_stream *s;
    uint64_t skip;
    int *st;               /* each chunk's code; a held one's is FERRY_ECONN
                              until its RELEASE answers */
    size_t cancel_from;    /* a cancel: the chunks from here on are -ECANCELED */
    struct {
        int type;
        uint64_t rid;
        rbatch *bt;
    } q[4];                /* the requests in flight, oldest first */
    size_t nq;
} rpipe;

/* send a request of type t over ch[0..m) without waiting for its reply */
static int send_req(rpipe *p, int t, ferry__proto_chunk *ch, size_t m, rbatch *bt)
{
    ferry__kvc *c = p->c;
    ferry__proto_req q;
    memset(&q, 0, sizeof q);
    q.hdr.type = (uint8_t)t;
    q.hdr.rid = ++c->rid;
    q.n = (uint32_t)m;
    q.chunks = ch;
    if (ferry__proto_req_encode(&c->out, &q) < 0) {
        /* (not for want of memory: reserve_frames grew the buffer) a
         * RELEASE not sent would keep the locks until their TTL: the
         * connection goes, and they with it */
        if (t == FERRY__P_RELEASE)
            ferry__kvc_drop(c);
        return ferry__kv_err(p->kv, -ENOMEM, "kv server: out of memory for a %s of %zu chunks%s",
                             ferry__proto_type_name((unsigned)t), m,
                             t == FERRY__P_RELEASE ? " (the connection is closed: the daemon "
                                                     "drops its locks)" : "");
    }
    int r = ferry__kvc_send(p->kv, c);
    if (r < 0)
        return r;
    FERRY__ASSERT(p->nq < FERRY__ARRAY_LEN(p->q));
    p->q[p->nq].type = t;
    p->q[p->nq].rid = q.hdr.rid;
    p->q[p->nq].bt = bt;
    p->nq++;
    return 0;
}

/* ACQUIRE (or PREFETCH) the retrieve's chunks [first, first + m) */
static int send_ids(rpipe *p, int t, size_t first, size_t m, rbatch *bt)
{
    ferry__proto_chunk *ch = p->c->ch;
    for (size_t k = 0; k < m; k++) {
        memset(&ch[k], 0, sizeof ch[k]);
        ch[k].id = p->ids[first + k];
    }
    return send_req(p, t, ch, m, bt);
}

/* an ACQUIRE's reply for bt; only when asked: the chunks of bt whose
 * status is `only` (FERRY_ENOSPACE: a second try), else all */
static int on_acquired(rpipe *p, rbatch *bt, ferry__proto_rd *rd, int32_t rc, size_t m,
                       int only)
{
    ferry_kv *kv = p->kv;
    ferry__kvc *c = p->c;
    int r;
    if (rc < 0) /* refused whole: the retrieve stops here */
        return rc;
    if ((r = ferry__kvc_reply_count(kv, c, rd, m)) < 0)
        return r;
    size_t k = 0;
    for (size_t j = 0; j < m; j++, k++) {
        if (only)
            while (p->st[bt->first + k] != only)
                k++;
        int32_t cs = (int32_t)ferry__proto_get_u32(rd);
        uint64_t slot = ferry__proto_get_u64(rd), gen = ferry__proto_get_u64(rd);
        (void)ferry__proto_get_u8(rd); /* the tier it was found in */
        /* held: not retrieved until its RELEASE vouches for the bytes */
        p->st[bt->first + k] = cs == 0 ? FERRY_ECONN : cs;
        bt->nospace += cs == FERRY_ENOSPACE;
        if (cs != 0 || rd->err)
            continue;
        ferry__proto_chunk *h = &bt->h[bt->held++];
        memset(h, 0, sizeof *h);
        h->id = p->ids[bt->first + k];
        h->slot = slot;
        h->gen = gen;
        h->tokens = (uint32_t)k;
    }
    return ferry__kvc_reply_end(kv, c, rd);
}

/* a RELEASE's reply for bt (r: the connection's code when it was lost):
 * each chunk's status; bytes the daemon did not vouch for are zeroed */
static void on_released(rpipe *p, rbatch *bt, ferry__proto_rd *rd, int32_t rc, int r)
{
    ferry_kv *kv = p->kv;
    if (r == 0 && (r = rc) == 0)
        r = ferry__kvc_reply_count(kv, p->c, rd, bt->held);
    for (size_t k = 0; k < bt->held; k++) {
        size_t i = bt->first + bt->h[k].tokens;
        int32_t cs = r < 0 ? r : (int32_t)ferry__proto_get_u32(rd);
        p->st[i] = bt->copy_rc < 0 ? bt->copy_rc : cs;
        if (p->st[i] != 0 && bt->copied && p->buf->mem == FERRY_KV_MEM_HOST) {
            ferry__kv_span sp = ferry__kv_span_from(&kv->layout, kv->chunk_tokens, i,
                                                    ferry__kv_chunk_ntok(kv, i, p->n), p->skip);
            if (sp.ntok) /* (never the engine's own tokens below skip) */
                ferry__kv_xfer_out_zero(p->buf, kv->chunk_tokens, sp.tok0, sp.ntok);
        }
    }
    if (r == 0 && ferry__kvc_reply_end(kv, p->c, rd) < 0)
        for (size_t k = 0; k < bt->held; k++)
            p->st[bt->first + bt->h[k].tokens] = FERRY_ECONN;
    bt->held = 0;
}

/* read every reply outstanding; 0, or the first failure (a lost
 * connection answers for everything still in flight) */
static int drain(rpipe *p)
{
    int first = 0;
    for (size_t i = 0; i < p->nq; i++) {
        int t = p->q[i].type;
        rbatch *bt = p->q[i].bt;
        ferry__proto_rd rd;
        int32_t rc = 0;
        int r = p->c->fd < 0 ? FERRY_ECONN : ferry__kvc_recv(p->kv, p->c, t, p->q[i].rid, &rd, &rc);
        if (t == FERRY__P_RELEASE) {
            on_released(p, bt, &rd, rc, r);
        } else if (t == FERRY__P_ACQUIRE) {
            if (r == 0)
                r = on_acquired(p, bt, &rd, rc, bt->m, 0);
            if (r < 0) /* held nothing, or the connection took it: no copy */
                bt->held = 0;
        } else if (r == 0) { /* PREFETCH: only a lost connection matters */
            if (rc == FERRY_ENOTSUP)
                p->c->no_prefetch = 1; /* a daemon from before PREFETCH */
            r = ferry__kvc_reply_end(p->kv, p->c, &rd) < 0 ? FERRY_ECONN : 0;
        }
        if (r < 0 && !first)
            first = r;
    }
    p->nq = 0;
    return first;
}

/* the chunks of bt answered FERRY_ENOSPACE, asked again (nothing else in
 * flight, nothing else held) */
static int reacquire(rpipe *p, rbatch *bt)
{
    size_t m = bt->nospace, j = 0;
    ferry__proto_chunk *ch = p->c->ch;
    for (size_t k = 0; k < bt->m; k++)
        if (p->st[bt->first + k] == FERRY_ENOSPACE) {
            memset(&ch[j], 0, sizeof ch[j]);
            ch[j++].id = p->ids[bt->first + k];
        }
    bt->nospace = 0;
    ferry__proto_rd rd;
    int32_t rc;
    int r = ferry__kvc_send_chunks(p->kv, p->c, FERRY__P_ACQUIRE, m, 0, &rd, &rc);
    return r < 0 ? r : on_acquired(p, bt, &rd, rc, m, FERRY_ENOSPACE);
}

/* copy bt's held chunks out of the pool (a device's copies synced) */
static void copy_out(rpipe *p, rbatch *bt)
{
    int rc = 0;
    for (size_t k = 0; k < bt->held && rc == 0; k++)
        rc = ferry__kvc_copy_slot(p->kv, p->c, p->buf, bt->first + bt->h[k].tokens, p->n,
                                  bt->h[k].slot, 0, p->s, p->skip);
    /* waited for even after a failed copy: those queued before it land
     * before the RELEASE lets the slots go, and never after the call
     * returned, in the engine's buffer */
    int sr = p->s && bt->held ? ferry_stream_sync(p->s) : 0;
    if (sr < 0 && rc == 0)
        rc = ferry__kv_err(p->kv, sr, "kv retrieve: device copies out of the server's pool: %s",
                           ferry_last_error());
    bt->copy_rc = rc;
    bt->copied = 1;
}

/* send the RELEASE of what bt holds (nothing held: 0). A connection lost
 * before it went took the locks with it: the daemon never vouched for the
 * bytes copied, so they are voided as a failed RELEASE's are (zeroed in a
 * host buffer, each chunk FERRY_ECONN or its copy's code) and the code is
 * returned: a chunk is never left written and unvouched for, and the
 * retrieve reports the lost daemon rather than a miss */
static int release(rpipe *p, rbatch *bt)
{
    if (!bt->held)
        return 0;
    int r = p->c->fd < 0 ? ferry__kv_err(p->kv, FERRY_ECONN, "kv server %s: the connection "
                                         "was lost before a RELEASE", p->c->path)
                         : send_req(p, FERRY__P_RELEASE, bt->h, bt->held, bt);
    if (r < 0)
        on_released(p, bt, NULL, 0, r); /* (held 0 after) */
    return r;
}

/* copy out and release what bt holds now (its chunks answered
 * FERRY_ENOSPACE are asked for next, with nothing held, so the daemon
 * may wait for room for them); 0 or the code that stops the retrieve */
static int let_go(rpipe *p, rbatch *bt)
{
    if (!bt->held)
        return 0;
    copy_out(p, bt);
    int r = release(p, bt);
    if (r < 0)
        return r;
    r = drain(p);
    bt->copied = 0;
    if (r == 0 && bt->copy_rc < 0)
        r = bt->copy_rc;
    return r;
}

static void batch_at(rpipe *p, rbatch *bt, size_t first)
{
    bt->first = first;
    bt->m = FERRY__MIN(p->b, p->nch - first);
    bt->held = bt->nospace = 0;
    bt->copy_rc = 0;
    bt->copied = 0;
}

/* batch nx in flight: a PREFETCH of it and the batches after it (when
 * there are any), then its ACQUIRE */
static int send_next(rpipe *p, rbatch *nx)
{
    int r = 0;
    size_t ahead = FERRY__MIN(p->ahead, p->nch - nx->first);
    if (ahead > nx->m && !p->c->no_prefetch)
        r = send_ids(p, FERRY__P_PREFETCH, nx->first, ahead, NULL);
    return r < 0 ? r : send_ids(p, FERRY__P_ACQUIRE, nx->first, nx->m, nx);
}

/* the pipeline over every batch; 0 or the code that stopped it */
static int pipe_run(rpipe *p, rbatch *cur, rbatch *nx, const atomic_int *cancel)
{
    batch_at(p, cur, 0);
    int r = send_next(p, cur);
    while (r == 0) {
        r = drain(p); /* cur acquired, the batch before it released */
        if (r == 0 && cur->nospace) {
            p->pipelined = 0; /* a pool this full: one batch held at a time from now */
            p->ahead = 2 * p->b;
        }
        /* what was declined is asked for again while that gets some: each
         * time holding nothing, so the daemon waits (up to the client's
         * pool_wait_ms) for a slot to promote the first into */
        for (int got = 1; r == 0 && cur->nospace && got;) {
            r = let_go(p, cur);
            if (r == 0)
                r = reacquire(p, cur);
            got = cur->held != 0;
        }
        if (r == 0 && ferry__kv_cancelled(cancel))
            r = -ECANCELED; /* nothing more moves: cur is let go uncopied */
        size_t next = cur->first + cur->m;
        int more = r == 0 && next < p->nch;
        if (more && p->pipelined) {
            batch_at(p, nx, next);
            r = send_next(p, nx);
        }
        if (r == 0)
            copy_out(p, cur);
        else
            cur->copy_rc = r; /* not copied: released, not retrieved */
        int lost = release(p, cur);
        if (r == 0 && lost < 0)
            r = lost;
        if (r == 0 && cur->copy_rc < 0)
            r = cur->copy_rc;
        more = more && r == 0;
        if (more && !p->pipelined) { /* one batch held at a time */
            batch_at(p, nx, next);
            if ((r = drain(p)) == 0)
                r = send_next(p, nx);
        }
        if (!more)
            break;
        rbatch *t = cur;
        cur = nx;
        nx = t;
    }
    /* a cancel, or a wait for an ACQUIRE the store's close cut short
     * (ferry_kv_close_begin): the chunks from cur on are not retrieved
     * (those before it were answered) */
    if (r == -ECANCELED)
        p->cancel_from = cur->first;
    return r;
}

/* grow c->out for the largest frame this retrieve sends - a PREFETCH or
 * ACQUIRE of `ahead` chunks, a RELEASE of a batch - by encoding them once
 * now, with nothing acquired: later encodings fit and allocate nothing */
static int reserve_frames(ferry_kv *kv, ferry__kvc *c, size_t b, size_t ahead)
{
    static const int types[] = {FERRY__P_PREFETCH, FERRY__P_RELEASE};
    memset(c->ch, 0, ahead * sizeof *c->ch);
    for (size_t i = 0; i < FERRY__ARRAY_LEN(types); i++) {
        ferry__proto_req q;
        memset(&q, 0, sizeof q);
        q.hdr.type = (uint8_t)types[i];
        q.n = (uint32_t)(types[i] == FERRY__P_RELEASE ? b : ahead);
        q.chunks = c->ch;
        int r = ferry__proto_req_encode(&c->out, &q);
        if (r < 0)
            return ferry__kv_err(kv, r, "kv retrieve: out of memory for the frames of %zu "
                                 "chunks", ahead);
    }
    return 0;
}

int ferry__kvc_retrieve_run(ferry_kv *kv, ferry__kvc *c, const ferry_kv_hash *ids, size_t nch,
                            size_t n, const ferry_kv_buffer *buf, ferry_stream *s, int *st,
                            uint64_t skip, const atomic_int *cancel)
{
    /* two batches of an eighth of the pool held at most (a quarter, as an
     * unpipelined retrieve holds); a pool of fewer than 8 slots is not
     * pipelined: a quarter of it a batch, one batch held at a time */
    int pipelined = c->nslots >= 8;
    size_t b = (size_t)(pipelined ? c->nslots / 8 : FERRY__MAX(c->nslots / 4, 1));
    b = FERRY__MIN(FERRY__MIN(b, (size_t)PIPE_BATCH_MAX), nch);
    ferry__proto_chunk *h = ferry__malloc(2 * b * sizeof *h);
    int r = h ? ferry__kvc_chunks(kv, c, 3 * b)
              : ferry__kv_err(kv, -ENOMEM, "kv retrieve: out of memory for %zu chunks", 2 * b);
    if (r == 0)
        r = reserve_frames(kv, c, b, 3 * b);
    if (r < 0) {
        ferry__free(h);
        return r;
    }
    rpipe p = {.kv = kv, .c = c, .ids = ids, .nch = nch, .n = n, .b = b, .buf = buf, .s = s,
               .skip = skip, .st = st, .pipelined = pipelined, .ahead = (pipelined ? 3 : 2) * b};
    rbatch cur = {.h = h}, nx = {.h = h + b};
    r = pipe_run(&p, &cur, &nx, cancel);
    /* a stop: the replies still due are read; what they hold is let go */
    int d = drain(&p);
    rbatch *left = cur.held ? &cur : nx.held ? &nx : NULL;
    /* (a RELEASE that cannot go closes the connection: the locks go with it) */
    if (left && c->fd >= 0 && send_req(&p, FERRY__P_RELEASE, left->h, left->held, left) == 0) {
        left->copy_rc = r < 0 ? r : FERRY_ECONN; /* nothing was copied: not retrieved */
        (void)drain(&p);
    }
    /* (a chunk held when the close cut the connection: not vouched for) */
    for (size_t i = 0; r == -ECANCELED && i < nch; i++)
        if (i >= p.cancel_from || st[i] == FERRY_ECONN)
            st[i] = -ECANCELED;
    ferry__free(h);
    return r < 0 ? r : d;
}
