/*
 * client_layers.c - the layerwise operations through a `ferry serve`
 * daemon (kv_layers.h): the slots a layerwise op holds are acquired or
 * reserved on a connection of the op's own (ferry__kvc_lease), held while
 * the engine's layers come and go, and released or committed on it. The
 * per-layer copies are this process's, into or out of that connection's
 * mapping of the pool (layers.c); the daemon only reserves, commits,
 * acquires and releases, as for any client (docs/PROTOCOL.md). A process
 * that dies, or a connection that breaks, lets go of everything the op
 * held: its reservations are aborted, never committed.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "kv/kv_impl.h"
#include "kv/kv_layers.h"
#include "kv/client/kvc.h"
#include "kv/store/store_int.h"

size_t ferry__kvc_lw_cap(ferry_kv *kv)
{
    (void)kv; /* the daemon caps a connection's reservations at half its pool
               * (a store's window is a quarter: ask) */
    return FERRY__PROTO_MAX_CHUNKS;
}

/* the op's connection, leased on first use: 0 or a code */
static int conn(ferry_kv *kv, ferry_kv_op *op, const char *what)
{
    ferry__kv_lw *lw = op->lw;
    int r = 0;
    if (!lw->conn && !(lw->conn = ferry__kvc_lease(kv, &r)))
        return r;
    if (!lw->conn->want_pool)
        return ferry__kv_err(kv, FERRY_ENOTSUP,
                             "kv %s: this client of %s maps no pool (l1_bytes 0: lookups only)",
                             what, lw->conn->path);
    lw->pool = lw->conn->pool;
    return 0;
}

/* a slot the daemon named, checked against the pool: its image, or NULL */
static unsigned char *slot_img(ferry_kv *kv, ferry__kvc *c, uint64_t slot)
{
    if (slot >= c->nslots) {
        ferry__kv_err(kv, FERRY_EPARSE, "kv server %s: slot %llu of %llu", c->path,
                      (unsigned long long)slot, (unsigned long long)c->nslots);
        return NULL;
    }
    return c->pool + slot * c->slot_bytes;
}

/* RELEASE c->ch[0..n) (their slot and gen set); per-chunk codes in cs
 * (NULL: not wanted); 0 or the code that lost them all */
static int release(ferry_kv *kv, ferry__kvc *c, size_t n, int32_t *cs)
{
    ferry__proto_rd rd;
    int32_t rc;
    int r = ferry__kvc_send_chunks(kv, c, FERRY__P_RELEASE, n, 0, &rd, &rc);
    if (r == 0 && (r = rc) == 0)
        r = ferry__kvc_reply_count(kv, c, &rd, n);
    for (size_t k = 0; r == 0 && k < n; k++) {
        int32_t x = (int32_t)ferry__proto_get_u32(&rd);
        if (cs)
            cs[k] = x;
    }
    if (r == 0)
        r = ferry__kvc_reply_end(kv, c, &rd);
    return r;
}

/* send the op's first min(nchunks, cap) chunk ids (a RESERVE's with their
 * tokens) as a `type` request on the op's own connection and read the
 * reply's count: 0 and *m the chunks asked (0: none, nothing sent), or a
 * code */
static int ask(ferry_kv *kv, ferry_kv_op *op, size_t cap, const char *what, int type,
               size_t *m, ferry__proto_rd *rd)
{
    *m = 0;
    int r = conn(kv, op, what);
    if (r < 0)
        return r;
    ferry__kvc *c = op->lw->conn;
    size_t n = FERRY__MIN(op->nchunks, cap);
    if (type == FERRY__P_RESERVE) /* a store's window: a quarter of the pool (layers_stage.c) */
        n = FERRY__MIN(n, (size_t)FERRY__MAX(c->nslots / 4, 1));
    if (!n)
        return 0;
    if ((r = ferry__kvc_chunks(kv, c, n)) < 0)
        return r;
    for (size_t k = 0; k < n; k++) {
        c->ch[k].id = op->ids[k];
        if (type == FERRY__P_RESERVE)
            c->ch[k].tokens = ferry__kv_chunk_ntok(kv, k, op->n);
    }
    int32_t rc;
    r = ferry__kvc_send_chunks(kv, c, type, n, 0, rd, &rc);
    if (r < 0 || (r = rc) < 0 || (r = ferry__kvc_reply_count(kv, c, rd, n)) < 0)
        return r;
    *m = n;
    return 0;
}

int ferry__kvc_lw_acquire(ferry_kv *kv, ferry_kv_op *op, size_t cap)
{
    ferry__kv_lw *lw = op->lw;
    ferry__proto_rd rd;
    size_t m;
    int r = ask(kv, op, cap, "retrieve_layers", FERRY__P_ACQUIRE, &m, &rd);
    if (r < 0 || !m)
        return r;
    ferry__kvc *c = lw->conn;
    size_t extra = 0; /* hits past the first miss: let go at once */
    int lead = 1;
    for (size_t k = 0; k < m; k++) {
        int32_t cs = (int32_t)ferry__proto_get_u32(&rd);
        uint64_t slot = ferry__proto_get_u64(&rd), gen = ferry__proto_get_u64(&rd);
        uint8_t tier = ferry__proto_get_u8(&rd);
        if (rd.err)
            break;
        unsigned char *img = cs == 0 ? slot_img(kv, c, slot) : NULL;
        if (cs == 0 && !img)
            cs = FERRY_EPARSE;
        lw->st[k] = cs;
        if (cs != 0) {
            lead = 0;
            continue;
        }
        if (lead) {
            ferry__kv_set_tier(&op->req, k, tier < FERRY_KV_TIERS ? tier : FERRY_KV_TIER_NONE);
            ferry__kv_lw_hold(kv, op, k, NULL, slot, gen, img);
            continue;
        }
        lw->st[k] = FERRY_ENOTFOUND; /* not loaded: behind a miss */
        c->ch[extra].slot = slot;
        c->ch[extra].gen = gen;
        c->ch[extra++].id = op->ids[k];
    }
    if ((r = ferry__kvc_reply_end(kv, c, &rd)) < 0)
        return r; /* (the connection is gone, and with it every lock) */
    if (m < op->nchunks && lead)
        lw->st[m] = ferry__kv_err(kv, FERRY_ENOSPACE,
                                  "kv retrieve_layers: chunk %zu is past the %zu one op may hold",
                                  m, m);
    return extra ? release(kv, c, extra, NULL) : 0;
}

void ferry__kvc_lw_release(ferry_kv *kv, ferry_kv_op *op)
{
    ferry__kv_lw *lw = op->lw;
    ferry__kvc *c = lw->conn;
    if (!lw->nheld || !c)
        return;
    int32_t *cs = ferry__malloc(lw->nheld * sizeof *cs);
    int r = cs ? ferry__kvc_chunks(kv, c, lw->nheld) : -ENOMEM;
    if (r == 0 && c->fd < 0)
        r = ferry__kv_err(kv, FERRY_ECONN, "kv server %s: the connection was lost", c->path);
    for (size_t k = 0; r == 0 && k < lw->nheld; k++) {
        c->ch[k].id = op->ids[lw->ch[k].i];
        c->ch[k].slot = lw->ch[k].slot;
        c->ch[k].gen = lw->ch[k].gen;
    }
    if (r == 0)
        r = release(kv, c, lw->nheld, cs);
    else if (c->fd >= 0)
        ferry__kvc_drop(c); /* what it holds goes with the connection */
    for (size_t k = 0; k < lw->nheld; k++) {
        size_t i = lw->ch[k].i;
        if (lw->st[i] == 0)
            lw->st[i] = r < 0 ? r : cs[k];
    }
    ferry__free(cs);
}

int ferry__kvc_lw_reserve(ferry_kv *kv, ferry_kv_op *op, size_t cap)
{
    ferry__kv_lw *lw = op->lw;
    ferry__proto_rd rd;
    size_t m;
    int r = ask(kv, op, cap, "store_layers", FERRY__P_RESERVE, &m, &rd);
    if (r < 0 || !m)
        return r;
    ferry__kvc *c = lw->conn;
    int placed = 1;
    for (size_t k = 0; k < m; k++) {
        int32_t cs = (int32_t)ferry__proto_get_u32(&rd);
        uint64_t slot = ferry__proto_get_u64(&rd), gen = ferry__proto_get_u64(&rd);
        if (rd.err)
            break;
        unsigned char *img = cs == 0 ? slot_img(kv, c, slot) : NULL;
        if (cs == 0 && !img) { /* a slot outside the pool: never written */
            ferry__kvc_drop(c);
            return FERRY_EPARSE;
        }
        lw->st[k] = cs > 0 ? 0 : cs; /* > 0: present already */
        if (cs == 0)
            ferry__kv_lw_hold(kv, op, k, NULL, slot, gen, img);
        if (cs < 0 && cs != FERRY_ELOCKED)
            placed = 0;
    }
    if ((r = ferry__kvc_reply_end(kv, c, &rd)) < 0) {
        lw->nheld = 0; /* the reservations went with the connection */
        return r;
    }
    for (size_t k = 0; k < m; k++)
        if (lw->st[k] < 0) { /* the daemon's word on why, as in-process */
            (void)ferry__kvc_why(kv, c, lw->st[k]);
            break;
        }
    for (size_t k = m; placed && k < op->nchunks; k++)
        lw->st[k] = FERRY_ENOSPACE;
    return 0;
}

void ferry__kvc_lw_commit(ferry_kv *kv, ferry_kv_op *op, int abort)
{
    ferry__kv_lw *lw = op->lw;
    ferry__kvc *c = lw->conn;
    if (!lw->nheld || !c)
        return;
    int r = ferry__kvc_chunks(kv, c, lw->nheld);
    if (r == 0 && c->fd < 0)
        r = ferry__kv_err(kv, FERRY_ECONN, "kv server %s: the connection was lost", c->path);
    for (size_t k = 0; r == 0 && k < lw->nheld; k++) {
        c->ch[k].id = op->ids[lw->ch[k].i];
        c->ch[k].slot = lw->ch[k].slot;
        c->ch[k].gen = lw->ch[k].gen;
        c->ch[k].status = abort != 0;
    }
    ferry__proto_rd rd;
    int32_t rc;
    if (r == 0)
        r = ferry__kvc_send_chunks(kv, c, FERRY__P_COMMIT, lw->nheld, 0, &rd, &rc);
    if (r == 0 && (r = rc) == 0)
        r = ferry__kvc_reply_count(kv, c, &rd, lw->nheld);
    for (size_t k = 0; k < lw->nheld; k++) {
        int32_t cs = r < 0 ? r : (int32_t)ferry__proto_get_u32(&rd);
        if (!abort)
            lw->st[lw->ch[k].i] = cs;
    }
    if (r == 0)
        r = ferry__kvc_reply_end(kv, c, &rd);
    if (r < 0 && !abort) /* no commit confirmed: none of them is stored */
        for (size_t k = 0; k < lw->nheld; k++)
            lw->st[lw->ch[k].i] = r;
    if (r < 0 && c->fd >= 0)
        ferry__kvc_drop(c);
}

void ferry__kvc_lw_unlease(ferry_kv *kv, ferry_kv_op *op)
{
    if (!op->lw->conn)
        return;
    ferry__kvc_unlease(kv, op->lw->conn);
    op->lw->conn = NULL;
    op->lw->pool = NULL;
}
