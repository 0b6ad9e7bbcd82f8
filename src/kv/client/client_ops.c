/*
 * client_ops.c - the ferry_kv operations through a `ferry serve` daemon
 * (kvc.h, docs/PROTOCOL.md).
 *
 * No payload crosses the socket. A store reserves slots in the daemon's
 * pool (RESERVE), copies the chunks into its mapping and commits them
 * (COMMIT), or aborts the ones whose copy failed. A retrieve acquires its
 * chunks (ACQUIRE: promoted into the pool and read-locked), copies them out
 * and releases them (RELEASE), pipelined (client_retrieve.c); a chunk
 * counts as retrieved only when the daemon confirms its slot was not
 * reused meanwhile (else its tokens in a host buffer are zeroed and it is
 * a miss). Batches hold at most a quarter of the pool, so clients sharing
 * it cannot lock each other out.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "kv/kv_impl.h"
#include "kv/client/kvc.h"
#include "kv/store/store_int.h"

/* lock the client and connect; with_pool: the call moves bytes */
static int begin(ferry_kv *kv, ferry__kvc *c, int with_pool, const char *what)
{
    pthread_mutex_lock(&c->mu);
    int r = ferry__kvc_ensure(kv, c);
    if (r == 0 && with_pool && !c->want_pool)
        r = ferry__kv_err(kv, FERRY_ENOTSUP,
                          "kv %s: this client of %s maps no pool (l1_bytes 0: lookups only)",
                          what, c->path);
    if (r < 0)
        pthread_mutex_unlock(&c->mu);
    return r;
}

/* a request of type t over chunks c->ch[0..n) */
int ferry__kvc_send_chunks(ferry_kv *kv, ferry__kvc *c, int t, size_t n, uint64_t tokens,
                       ferry__proto_rd *rd, int32_t *rc)
{
    ferry__proto_req q;
    memset(&q, 0, sizeof q);
    q.hdr.type = (uint8_t)t;
    q.hdr.rid = ++c->rid;
    q.n = (uint32_t)n;
    q.chunks = c->ch;
    q.tokens = tokens;
    if (ferry__proto_req_encode(&c->out, &q) < 0) {
        /* a RELEASE is a larger frame than the ACQUIRE before it, so its
         * encoding may be the one to grow the buffer: one not sent would
         * keep the read locks until their TTL, so the connection goes,
         * and they with it (a prefetch's, a layerwise retrieve's, pins') */
        if (t == FERRY__P_RELEASE)
            ferry__kvc_drop(c);
        return ferry__kv_err(kv, -ENOMEM, "kv server: out of memory for a %s of %zu chunks%s",
                             ferry__proto_type_name((unsigned)t), n,
                             t == FERRY__P_RELEASE ? " (the connection is closed: the daemon "
                                                     "drops its locks)" : "");
    }
    return ferry__kvc_roundtrip(kv, c, rd, rc);
}

/* the per-chunk part of a reply: n entries, each read by fields */
int ferry__kvc_reply_count(ferry_kv *kv, ferry__kvc *c, ferry__proto_rd *rd, size_t n)
{
    uint32_t k = ferry__proto_get_u32(rd);
    if (rd->err || k != n) {
        ferry__kvc_drop(c);
        return ferry__kv_err(kv, FERRY_ECONN, "kv server %s: a reply for %u chunks (asked %zu)",
                             c->path, k, n);
    }
    return 0;
}

int ferry__kvc_reply_end(ferry_kv *kv, ferry__kvc *c, ferry__proto_rd *rd)
{
    if (rd->err || rd->p != rd->end) {
        ferry__kvc_drop(c);
        return ferry__kv_err(kv, FERRY_ECONN, "kv server %s: a malformed reply", c->path);
    }
    return 0;
}

int ferry__kvc_lookup(ferry_kv *kv, const ferry_kv_hash *ids, size_t nch, size_t n,
                      const ferry_kv_req *req)
{
    ferry__kvc *c = kv->be_impl;
    int r = begin(kv, c, 0, "lookup");
    if (r < 0)
        return r;
    size_t m = FERRY__MIN(nch, (size_t)FERRY__PROTO_MAX_CHUNKS);
    if ((r = ferry__kvc_chunks(kv, c, m)) < 0)
        goto out;
    for (size_t i = 0; i < m; i++)
        c->ch[i].id = ids[i];
    ferry__proto_rd rd;
    int32_t rc;
    if ((r = ferry__kvc_send_chunks(kv, c, FERRY__P_LOOKUP, m, n, &rd, &rc)) < 0 || (r = rc) < 0)
        goto out;
    if ((size_t)rc > m) {
        ferry__kvc_drop(c);
        r = ferry__kv_err(kv, FERRY_ECONN, "kv server %s: lookup found %d of %zu chunks",
                          c->path, rc, m);
        goto out;
    }
    size_t tok = 0;
    for (size_t i = 0; i < (size_t)rc; i++) {
        uint8_t t = ferry__proto_get_u8(&rd);
        ferry__kv_set_tier(req, i, t < FERRY_KV_TIERS ? t : FERRY_KV_TIER_NONE);
        tok += ferry__kv_chunk_ntok(kv, i, n);
    }
    if ((r = ferry__kvc_reply_end(kv, c, &rd)) < 0)
        goto out;
    if ((size_t)rc < nch)
        ferry__kv_set_tier(req, (size_t)rc, FERRY_KV_TIER_NONE);
    r = (int)tok;
out:
    pthread_mutex_unlock(&c->mu);
    return r;
}

/* the chunks per batch: a quarter of the pool, at least one */
static size_t batch_of(ferry__kvc *c, size_t left)
{
    size_t b = (size_t)FERRY__MAX(c->nslots / 4, 1);
    return FERRY__MIN(FERRY__MIN(b, left), (size_t)FERRY__PROTO_MAX_CHUNKS);
}

int ferry__kvc_copy_slot(ferry_kv *kv, ferry__kvc *c, const ferry_kv_buffer *buf, size_t i,
                         size_t n, uint64_t slot, int to_chunk, ferry_stream *s, uint64_t skip)
{
    if (slot >= c->nslots)
        return ferry__kv_err(kv, FERRY_EPARSE, "kv server %s: slot %llu of %llu", c->path,
                             (unsigned long long)slot, (unsigned long long)c->nslots);
    unsigned char *p = c->pool + slot * c->slot_bytes;
    ferry__kv_span sp = ferry__kv_span_from(&kv->layout, kv->chunk_tokens, i,
                                            ferry__kv_chunk_ntok(kv, i, n), skip);
    if (!sp.ntok)
        return 0; /* wholly the engine's own tokens */
    int r = ferry__kv_xfer(buf, kv->chunk_tokens, sp.tok0, sp.ntok, p + sp.img_off, to_chunk,
                           s, NULL);
    return r < 0 ? ferry__kv_err_pass(kv, r) : 0;
}

/* one store batch, chunks [first, first + m): RESERVE, copy, COMMIT; st[]
 * gets each chunk's code, *placed the chunks reserved. 0, or the code that
 * ends the store */
static int store_batch(ferry_kv *kv, ferry__kvc *c, const ferry_kv_hash *ids, size_t first,
                       size_t m, size_t n, const ferry_kv_buffer *buf, ferry_stream *s, int *st,
                       size_t *placed)
{
    for (size_t k = 0; k < m; k++) {
        c->ch[k].id = ids[first + k];
        c->ch[k].tokens = ferry__kv_chunk_ntok(kv, first + k, n);
    }
    ferry__proto_rd rd;
    int32_t rc;
    int r = ferry__kvc_send_chunks(kv, c, FERRY__P_RESERVE, m, 0, &rd, &rc);
    if (r < 0 || (r = rc) < 0 || (r = ferry__kvc_reply_count(kv, c, &rd, m)) < 0)
        return r;
    size_t held = 0;
    int copy_rc = 0;
    for (size_t k = 0; k < m; k++) {
        int32_t cs = (int32_t)ferry__proto_get_u32(&rd);
        uint64_t slot = ferry__proto_get_u64(&rd), gen = ferry__proto_get_u64(&rd);
        st[first + k] = cs > 0 ? 0 : cs;
        if (cs != 0)
            continue;
        c->ch[held] = c->ch[k];
        c->ch[held].slot = slot;
        c->ch[held].gen = gen;
        c->ch[held].tokens = (uint32_t)k; /* which chunk of the batch, for the commit */
        if (copy_rc == 0)
            copy_rc = ferry__kvc_copy_slot(kv, c, buf, first + k, n, slot, 1, s, 0);
        held++;
    }
    *placed = held;
    /* the copies land before anything may end the connection (a malformed
     * reply drops it, and the daemon may then hand the slots out again),
     * those queued before a copy that failed too: its abort gives the
     * slots back, and nothing of this call reads the engine's buffer once
     * it returned */
    int sr = s && held ? ferry_stream_sync(s) : 0;
    if (sr < 0 && copy_rc == 0)
        copy_rc = ferry__kv_err(kv, sr, "kv store: device copies into the server's pool: %s",
                                ferry_last_error());
    if ((r = ferry__kvc_reply_end(kv, c, &rd)) < 0)
        goto lost;
    if (!held)
        return 0;
    for (size_t k = 0; k < held; k++)
        c->ch[k].status = copy_rc < 0;
    if ((r = ferry__kvc_send_chunks(kv, c, FERRY__P_COMMIT, held, 0, &rd, &rc)) < 0 ||
        (r = rc) < 0 ||
        (r = ferry__kvc_reply_count(kv, c, &rd, held)) < 0)
        goto lost;
    for (size_t k = 0; k < held; k++) {
        int32_t cs = (int32_t)ferry__proto_get_u32(&rd);
        st[first + c->ch[k].tokens] = copy_rc < 0 ? copy_rc : cs;
    }
    if ((r = ferry__kvc_reply_end(kv, c, &rd)) < 0)
        goto lost;
    return copy_rc;
lost:
    /* no commit was confirmed: the reservations went with the connection
     * (or the daemon refused the request), so none of these is stored */
    for (size_t k = 0; k < held; k++)
        st[first + c->ch[k].tokens] = r;
    return r;
}

/* a store or retrieve through the daemon: a store's chunks in batches of
 * a quarter of the pool, each one store_batch, a cancel honoured between
 * batches; a retrieve's pipelined (client_retrieve.c); req gets each
 * chunk's code */
static int run_batches(ferry_kv *kv, const ferry_kv_hash *ids, size_t nch, size_t n,
                       const ferry_kv_req *req, const ferry_kv_buffer *buf, int store)
{
    const char *what = store ? "store" : "retrieve";
    ferry__kvc *c = kv->be_impl;
    ferry_stream *s = NULL;
    int *st = ferry__malloc(nch * sizeof *st);
    if (!st)
        return ferry__kv_err(kv, -ENOMEM, "kv %s: out of memory for %zu chunks", what, nch);
    for (size_t i = 0; i < nch; i++)
        st[i] = FERRY_ENOTFOUND;
    int r = begin(kv, c, 1, what);
    if (r < 0) {
        ferry__free(st);
        return r;
    }
    if (buf->mem == FERRY_KV_MEM_DEVICE)
        r = ferry__kv_stream_get(kv, &s);
    const atomic_int *cancel = ferry__kv_cancel_flag(); /* an async op's, else NULL */
    if (!store && r == 0) /* pipelined, a cancel honoured between batches */
        r = ferry__kvc_retrieve_run(kv, c, ids, nch, n, buf, s, st, ferry__kv_req_skip(req),
                                    cancel);
    for (size_t i = 0; store && r == 0 && i < nch;) {
        if (ferry__kv_cancelled(cancel)) { /* between batches: nothing more moves */
            for (size_t k = i; k < nch; k++)
                st[k] = -ECANCELED;
            r = -ECANCELED;
            break;
        }
        size_t m = batch_of(c, nch - i), placed = 0;
        if ((r = ferry__kvc_chunks(kv, c, m)) < 0)
            break;
        r = store_batch(kv, c, ids, i, m, n, buf, s, st, &placed);
        if (r == -ECANCELED) { /* its wait ended by the close: none of the rest stored */
            for (size_t k = i; k < nch; k++)
                if (st[k] == FERRY_ENOTFOUND)
                    st[k] = -ECANCELED;
            break;
        }
        /* stop at the first chunk that could not be placed (as in-process);
         * but when the pool had room for part of the batch, that part is
         * committed now and the rest is asked for again (the daemon waits
         * for its first slot: this connection holds none now) */
        size_t next = i + m;
        for (size_t k = i; r == 0 && k < i + m; k++)
            if (st[k] < 0 && st[k] != FERRY_ELOCKED) {
                if (st[k] == FERRY_ENOSPACE && placed)
                    next = k;
                else
                    r = 1;
                break;
            }
        i = next;
    }
    /* a chunk declined or skipped: the daemon's word on why, as in-process */
    int why = 0;
    for (size_t i = 0; store && !why && i < nch; i++)
        if (st[i] < 0 && st[i] != FERRY_ENOTFOUND && st[i] != FERRY_ECONN)
            why = st[i];
    if (why)
        (void)ferry__kvc_why(kv, c, why);
    pthread_mutex_unlock(&c->mu);
    ferry__kv_stream_put(kv, s);
    size_t lead = 0;
    for (size_t i = 0; i < nch && st[i] == 0; i++)
        lead += ferry__kv_chunk_ntok(kv, i, n);
    for (size_t i = 0; i < nch; i++)
        ferry__kv_set_status(req, i, st[i]);
    int first = st[0];
    ferry__free(st);
    if (r < 0 && (!store || r == FERRY_ECONN || r == -ECANCELED || lead == 0 || first == r))
        return r;
    /* not even the first chunk placed: its code, as ferry__kv_do_store */
    if (store && lead == 0 && first < 0 && first != FERRY_ELOCKED && first != FERRY_ENOTFOUND)
        return first;
    return (int)lead;
}

int ferry__kvc_store(ferry_kv *kv, const ferry_kv_hash *ids, size_t nch, size_t n,
                     const ferry_kv_req *req, const ferry_kv_buffer *buf)
{
    return run_batches(kv, ids, nch, n, req, buf, 1);
}

int ferry__kvc_retrieve(ferry_kv *kv, const ferry_kv_hash *ids, size_t nch, size_t n,
                        const ferry_kv_req *req, const ferry_kv_buffer *buf)
{
    return run_batches(kv, ids, nch, n, req, buf, 0);
}

/* ACQUIRE chunks [first, first + m) and RELEASE them at once: *lead_ok
 * stays 1 while every chunk so far was found */
static int prefetch_batch(ferry_kv *kv, ferry__kvc *c, const ferry_kv_hash *ids, size_t first,
                          size_t m, size_t n, size_t *lead, int *lead_ok)
{
    for (size_t k = 0; k < m; k++)
        c->ch[k].id = ids[first + k];
    ferry__proto_rd rd;
    int32_t rc;
    int r = ferry__kvc_send_chunks(kv, c, FERRY__P_ACQUIRE, m, 0, &rd, &rc);
    if (r < 0 || (r = rc) < 0 || (r = ferry__kvc_reply_count(kv, c, &rd, m)) < 0)
        return r;
    size_t held = 0;
    for (size_t k = 0; k < m; k++) {
        int32_t cs = (int32_t)ferry__proto_get_u32(&rd);
        uint64_t slot = ferry__proto_get_u64(&rd), gen = ferry__proto_get_u64(&rd);
        (void)ferry__proto_get_u8(&rd);
        if (cs != 0) {
            *lead_ok = 0;
            continue;
        }
        if (*lead_ok)
            *lead += ferry__kv_chunk_ntok(kv, first + k, n);
        c->ch[held] = c->ch[k];
        c->ch[held].slot = slot;
        c->ch[held].gen = gen;
        held++;
    }
    if ((r = ferry__kvc_reply_end(kv, c, &rd)) < 0 || !held)
        return r;
    if ((r = ferry__kvc_send_chunks(kv, c, FERRY__P_RELEASE, held, 0, &rd, &rc)) < 0 ||
        (r = rc) < 0 ||
        (r = ferry__kvc_reply_count(kv, c, &rd, held)) < 0)
        return r;
    for (size_t k = 0; k < held; k++)
        (void)ferry__proto_get_u32(&rd);
    return ferry__kvc_reply_end(kv, c, &rd);
}

int ferry__kvc_prefetch(ferry_kv *kv, const ferry_kv_hash *ids, size_t nch, size_t n)
{
    ferry__kvc *c = kv->be_impl;
    int r = begin(kv, c, 0, "prefetch");
    if (r < 0)
        return r;
    size_t lead = 0;
    int lead_ok = 1;
    /* a lookup-only client has no pool: a quarter of one slot count is moot */
    for (size_t i = 0; r == 0 && lead_ok && i < nch;) {
        size_t m = c->nslots ? batch_of(c, nch - i) : FERRY__MIN(nch - i, (size_t)64);
        if ((r = ferry__kvc_chunks(kv, c, m)) == 0)
            r = prefetch_batch(kv, c, ids, i, m, n, &lead, &lead_ok);
        i += m;
    }
    pthread_mutex_unlock(&c->mu);
    return r < 0 ? r : (int)lead;
}

/* RELEASE c->ch[0..m) (statuses read and dropped: a pin's bytes are not read) */
static int release_all(ferry_kv *kv, ferry__kvc *c, size_t m)
{
    if (!m)
        return 0;
    ferry__proto_rd rd;
    int32_t rc;
    int r = ferry__kvc_send_chunks(kv, c, FERRY__P_RELEASE, m, 0, &rd, &rc);
    if (r < 0 || (r = rc) < 0 || (r = ferry__kvc_reply_count(kv, c, &rd, m)) < 0)
        return r;
    for (size_t k = 0; k < m; k++)
        (void)ferry__proto_get_u32(&rd);
    return ferry__kvc_reply_end(kv, c, &rd);
}

static int pin_add(ferry_kv *kv, ferry__kvc *c, const ferry__proto_chunk *ch)
{
    if (c->npins == c->cap_pins) {
        size_t nc = c->cap_pins ? 2 * c->cap_pins : 64;
        struct ferry__kvc_pin *p = ferry__realloc(c->pins, nc * sizeof *p);
        if (!p)
            return ferry__kv_err(kv, -ENOMEM, "kv pin: out of memory for %zu pins", nc);
        c->pins = p;
        c->cap_pins = nc;
    }
    c->pins[c->npins++] = (struct ferry__kvc_pin){ch->id, ch->slot, ch->gen};
    return 0;
}

/* pin: ACQUIRE the leading chunks and keep them; what is acquired past the
 * first miss is released at once */
static int pin_leading(ferry_kv *kv, ferry__kvc *c, const ferry_kv_hash *ids, size_t nch,
                       size_t n)
{
    size_t lead = 0;
    int r = 0, ok = 1;
    for (size_t i = 0; r == 0 && ok && i < nch;) {
        size_t m = FERRY__MIN(nch - i, (size_t)64);
        if ((r = ferry__kvc_chunks(kv, c, m)) < 0)
            break;
        for (size_t k = 0; k < m; k++)
            c->ch[k].id = ids[i + k];
        ferry__proto_rd rd;
        int32_t rc;
        if ((r = ferry__kvc_send_chunks(kv, c, FERRY__P_ACQUIRE, m, 0, &rd, &rc)) < 0 ||
            (r = rc) < 0 ||
            (r = ferry__kvc_reply_count(kv, c, &rd, m)) < 0)
            break;
        size_t drop = 0;
        for (size_t k = 0; k < m; k++) {
            int32_t cs = (int32_t)ferry__proto_get_u32(&rd);
            ferry__proto_chunk ch = c->ch[k];
            ch.slot = ferry__proto_get_u64(&rd);
            ch.gen = ferry__proto_get_u64(&rd);
            (void)ferry__proto_get_u8(&rd);
            if (cs != 0) {
                ok = 0;
                continue;
            }
            if (ok && pin_add(kv, c, &ch) == 0)
                lead += ferry__kv_chunk_ntok(kv, i + k, n);
            else
                c->ch[drop++] = ch; /* past the first miss (or no room): let go */
        }
        if ((r = ferry__kvc_reply_end(kv, c, &rd)) < 0 || (r = release_all(kv, c, drop)) < 0)
            break;
        i += m;
    }
    return r < 0 && !lead ? r : (int)lead;
}

/* unpin: RELEASE one pin of each leading chunk this store pinned */
static int unpin_leading(ferry_kv *kv, ferry__kvc *c, const ferry_kv_hash *ids, size_t nch,
                         size_t n)
{
    size_t lead = 0, m = 0;
    int r = ferry__kvc_chunks(kv, c, FERRY__MIN(nch, (size_t)FERRY__PROTO_MAX_CHUNKS));
    for (size_t i = 0; r == 0 && i < nch && m < c->ch_cap; i++) {
        size_t k = c->npins;
        while (k-- > 0)
            if (c->pins[k].id.lo == ids[i].lo && c->pins[k].id.hi == ids[i].hi)
                break;
        if (k == (size_t)-1)
            break;
        c->ch[m].id = c->pins[k].id;
        c->ch[m].slot = c->pins[k].slot;
        c->ch[m].gen = c->pins[k].gen;
        m++;
        c->pins[k] = c->pins[--c->npins];
        lead += ferry__kv_chunk_ntok(kv, i, n);
    }
    if (r == 0)
        r = release_all(kv, c, m);
    return r < 0 ? r : (int)lead;
}

int ferry__kvc_pin(ferry_kv *kv, const ferry_kv_hash *ids, size_t nch, size_t n, int pin)
{
    ferry__kvc *c = kv->be_impl;
    int r = begin(kv, c, 0, pin ? "pin" : "unpin");
    if (r < 0)
        return r;
    r = pin ? pin_leading(kv, c, ids, nch, n) : unpin_leading(kv, c, ids, nch, n);
    pthread_mutex_unlock(&c->mu);
    return r;
}

int ferry__kvc_delete(ferry_kv *kv, const ferry_kv_hash *ids, size_t nch)
{
    ferry__kvc *c = kv->be_impl;
    int r = begin(kv, c, 0, "delete");
    if (r < 0)
        return r;
    size_t m = FERRY__MIN(nch, (size_t)FERRY__PROTO_MAX_CHUNKS);
    if ((r = ferry__kvc_chunks(kv, c, m)) == 0) {
        for (size_t i = 0; i < m; i++)
            c->ch[i].id = ids[i];
        ferry__proto_rd rd;
        int32_t rc;
        if ((r = ferry__kvc_send_chunks(kv, c, FERRY__P_DELETE, m, 0, &rd, &rc)) == 0 &&
            (r = ferry__kvc_reply_end(kv, c, &rd)) == 0)
            r = rc;
    }
    pthread_mutex_unlock(&c->mu);
    return r;
}

int ferry__kvc_simple(ferry_kv *kv, int type)
{
    ferry__kvc *c = kv->be_impl;
    int r = begin(kv, c, 0, ferry__proto_type_name((unsigned)type));
    if (r < 0)
        return r;
    ferry__proto_req q;
    memset(&q, 0, sizeof q);
    q.hdr.type = (uint8_t)type;
    q.hdr.rid = ++c->rid;
    ferry__proto_rd rd;
    int32_t rc;
    if ((r = ferry__proto_req_encode(&c->out, &q)) < 0)
        r = ferry__kv_err(kv, -ENOMEM, "kv server: out of memory for a request");
    else if ((r = ferry__kvc_roundtrip(kv, c, &rd, &rc)) == 0 &&
             (r = ferry__kvc_reply_end(kv, c, &rd)) == 0)
        r = rc;
    pthread_mutex_unlock(&c->mu);
    return r;
}

int ferry__kvc_stats(ferry_kv *kv, ferry_kv_stats *out, uint32_t *clients)
{
    ferry__kvc *c = kv->be_impl;
    int r = begin(kv, c, 0, "stats");
    if (r < 0)
        return r;
    ferry__proto_req q;
    memset(&q, 0, sizeof q);
    q.hdr.type = FERRY__P_STATS;
    q.hdr.rid = ++c->rid;
    ferry__proto_rd rd;
    int32_t rc;
    if ((r = ferry__proto_req_encode(&c->out, &q)) < 0)
        r = ferry__kv_err(kv, -ENOMEM, "kv server: out of memory for a request");
    else if ((r = ferry__kvc_roundtrip(kv, c, &rd, &rc)) == 0 && (r = rc) == 0) {
        uint32_t nc = ferry__proto_get_u32(&rd);
        uint32_t size = ferry__proto_get_u32(&rd);
        if (rd.err || size > (size_t)(rd.end - rd.p) || size < sizeof out->size) {
            ferry__kvc_drop(c);
            r = ferry__kv_err(kv, FERRY_ECONN, "kv server %s: a malformed STATS reply",
                              c->path);
        } else {
            /* the daemon's struct is this one or a prefix or extension of it */
            memset(out, 0, sizeof *out);
            memcpy(out, rd.p, FERRY__MIN((size_t)size, sizeof *out));
            out->size = sizeof *out;
            if (clients)
                *clients = nc;
        }
    }
    pthread_mutex_unlock(&c->mu);
    return r;
}
