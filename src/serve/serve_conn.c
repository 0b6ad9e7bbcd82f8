/*
 * serve_conn.c - one client connection of `ferry serve`: read a frame,
 * check it, answer it, in order (a client may pipeline as many requests as
 * it likes; each reply carries its request's id). What the client holds is
 * kept here and released when the connection ends, however it ends.
 *
 * A frame whose header cannot be trusted (bad magic, flags, a length over
 * the bound, another version) ends the connection after an ERROR reply:
 * the stream cannot be resynchronized. A well-framed request that is
 * malformed inside gets an ERROR reply and the connection goes on.
 */
#include <errno.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "core.h"
#include "le.h"
#include "serve_int.h"

/* ---- sending ---- */

int ferry__srv_send(struct ferry_serve *s, int sock, const uint8_t *p, size_t n, int fd)
{
    uint64_t deadline = ferry__now_ns() + (uint64_t)s->send_timeout_ms * 1000000u;
    while (n) {
        union {
            struct cmsghdr h;
            char b[CMSG_SPACE(sizeof(int))];
        } ctl;
        struct iovec iov = {(void *)p, n};
        struct msghdr m = {0};
        m.msg_iov = &iov;
        m.msg_iovlen = 1;
        if (fd >= 0) {
            memset(&ctl, 0, sizeof ctl);
            m.msg_control = ctl.b;
            m.msg_controllen = sizeof ctl.b;
            struct cmsghdr *h = CMSG_FIRSTHDR(&m);
            h->cmsg_level = SOL_SOCKET;
            h->cmsg_type = SCM_RIGHTS;
            h->cmsg_len = CMSG_LEN(sizeof(int));
            memcpy(CMSG_DATA(h), &fd, sizeof fd);
        }
        ssize_t w = sendmsg(sock, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w > 0) {
            p += w;
            n -= (size_t)w;
            fd = -1; /* passed with the first bytes */
            continue;
        }
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            uint64_t now = ferry__now_ns();
            if (now >= deadline)
                return -ETIMEDOUT;
            struct pollfd pf = {sock, POLLOUT, 0};
            if (poll(&pf, 1, (int)((deadline - now + 999999) / 1000000)) < 0 && errno != EINTR)
                return -errno;
            continue;
        }
        return w < 0 ? -errno : -EPIPE;
    }
    return 0;
}

void ferry__srv_warn(struct ferry_serve *s, const char *fmt, ...)
{
    uint64_t quiet = 0;
    if (!ferry__log_enabled(FERRY_LOG_WARN) || !ferry__warn_ok(&s->warn, &quiet))
        return;
    char line[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    if (quiet)
        FERRY_LOGW("%s (%llu more like it held back)", line, (unsigned long long)quiet);
    else
        FERRY_LOGW("%s", line);
}

void ferry__srv_refuse(int sock, uint64_t rid, int code, const char *msg)
{
    ferry__proto_buf b = {0};
    ferry__proto_reply_begin(&b, FERRY__P_ERROR, rid, code, msg);
    if (ferry__proto_end(&b) == 0) {
        ssize_t w = send(sock, b.p, b.len, MSG_NOSIGNAL | MSG_DONTWAIT);
        (void)w;
    }
    ferry__proto_buf_free(&b);
}

/* ---- what a connection holds ---- */

static int hold_add(ferry__srv_conn *c, ferry__kv_entry *e, const ferry_kv_hash *id,
                    uint64_t slot, uint64_t gen, int write)
{
    if (c->nheld == c->cap_held) {
        size_t nc = c->cap_held ? 2 * c->cap_held : 64;
        ferry__srv_hold *n = ferry__realloc(c->held, nc * sizeof *n);
        if (!n)
            return -ENOMEM;
        c->held = n;
        c->cap_held = nc;
    }
    c->held[c->nheld++] = (ferry__srv_hold){e, *id, slot, gen, write};
    c->nreserved += write != 0;
    atomic_store(&c->held_now, c->nheld);
    atomic_store(&c->reserved_now, c->nreserved);
    return 0;
}

/* the hold matching a COMMIT or RELEASE chunk, or -1 */
static ssize_t hold_find(ferry__srv_conn *c, const ferry__proto_chunk *ch, int write)
{
    for (size_t i = c->nheld; i-- > 0;) {
        ferry__srv_hold *h = &c->held[i];
        if (h->write == write && h->slot == ch->slot && h->gen == ch->gen &&
            h->id.lo == ch->id.lo && h->id.hi == ch->id.hi)
            return (ssize_t)i;
    }
    return -1;
}

static void hold_drop(ferry__srv_conn *c, size_t i)
{
    c->nreserved -= c->held[i].write != 0;
    c->held[i] = c->held[--c->nheld];
    atomic_store(&c->held_now, c->nheld);
    atomic_store(&c->reserved_now, c->nreserved);
}

/* the connection ends: abort its reservations, release its locks */
static void holds_release(ferry__srv_conn *c)
{
    ferry_kv *kv = c->s->kv;
    for (size_t i = 0; i < c->nheld; i++) {
        ferry__srv_hold *h = &c->held[i];
        if (h->write)
            ferry__kv_slot_commit(kv, h->e, 1);
        else
            ferry__kv_slot_release(kv, h->e, h->slot, h->gen);
    }
    if (c->nheld)
        FERRY_LOGI("serve: client pid %d left holding %zu slots: released", (int)c->pid,
                   c->nheld);
    atomic_fetch_add(&c->s->released, c->nheld);
    c->nheld = 0;
    c->nreserved = 0;
    atomic_store(&c->held_now, 0);
    atomic_store(&c->reserved_now, 0);
}

/* who holds the pool: the clients holding the most slots, appended to msg */
static void holders(ferry__srv_conn *me, char *msg, size_t len)
{
    struct ferry_serve *s = me->s;
    size_t off = strlen(msg);
    int n = 0;
    pthread_mutex_lock(&s->mu);
    for (ferry__srv_conn *c = s->conns; c && off + 48 < len; c = c->next) {
        uint64_t h = atomic_load(&c->held_now), r = atomic_load(&c->reserved_now);
        if (!h)
            continue;
        int w = snprintf(msg + off, len - off, "%s pid %d%s holds %llu (%llu reserved)",
                         n++ ? ";" : "; clients:", (int)c->pid, c == me ? " (this one)" : "",
                         (unsigned long long)h, (unsigned long long)r);
        if (w < 0 || (size_t)w >= len - off)
            break;
        off += (size_t)w;
    }
    pthread_mutex_unlock(&s->mu);
}

/* ---- requests ---- */

static void on_hello(ferry__srv_conn *c, const ferry__proto_req *q, int *pass_fd)
{
    struct ferry_serve *s = c->s;
    const ferry__proto_hello *h = &q->hello;
    const ferry_kv_layout *l = &s->layout;
    int any = (h->flags & FERRY__HELLO_ANY) && (h->flags & FERRY__HELLO_NO_POOL);
    if (!any && (h->layout.num_layers != l->num_layers || h->layout.kv != l->kv ||
        h->layout.num_heads != l->num_heads || h->layout.head_dim != l->head_dim ||
        h->layout.dtype != l->dtype || h->chunk_tokens != s->chunk_tokens || h->seed != s->seed)) {
        char msg[256];
        snprintf(msg, sizeof msg,
                 "this daemon serves layers %u kv %u heads %u head_dim %u dtype %d, %u tokens a "
                 "chunk, seed %#llx: the client's layout, chunk size or seed differs",
                 l->num_layers, l->kv, l->num_heads, l->head_dim, l->dtype, s->chunk_tokens,
                 (unsigned long long)s->seed);
        ferry__proto_reply_begin(&c->out, FERRY__P_HELLO, q->hdr.rid, FERRY_EMISMATCH, msg);
        return;
    }
    /* an engine counts against max_clients; a monitor does not (its
     * connections past max_clients are few: FERRY__SRV_MONITORS) */
    int full = 0;
    pthread_mutex_lock(&s->mu);
    if (!any && !c->engine) {
        full = s->nengines >= s->max_clients && !(ferry__srv_retire_gone(s) &&
                                                 s->nengines < s->max_clients);
        /* one retired (its client hung up after this HELLO, and this or
         * another connection's ferry__srv_retire_gone saw it) is never
         * counted again: its thread's end would not take it off */
        c->engine = !full && !c->retired;
        s->nengines += c->engine ? 1u : 0u;
    }
    pthread_mutex_unlock(&s->mu);
    if (full) {
        char msg[128];
        snprintf(msg, sizeof msg, "the daemon serves as many clients as it may (max_clients %u)",
                 s->max_clients);
        ferry__srv_warn(s, "serve: refused pid %d: %s", (int)c->pid, msg);
        atomic_fetch_add(&s->refused, 1);
        ferry__proto_reply_begin(&c->out, FERRY__P_HELLO, q->hdr.rid, FERRY_EBUSY, msg);
        c->bye = 1;
        return;
    }
    int pool = !(h->flags & FERRY__HELLO_NO_POOL);
    ferry__proto_reply_begin(&c->out, FERRY__P_HELLO, q->hdr.rid, 0, NULL);
    ferry__proto_put_u32(&c->out, l->num_layers);
    ferry__proto_put_u32(&c->out, l->kv);
    ferry__proto_put_u32(&c->out, l->num_heads);
    ferry__proto_put_u32(&c->out, l->head_dim);
    ferry__proto_put_u32(&c->out, (uint32_t)l->dtype);
    ferry__proto_put_u32(&c->out, s->chunk_tokens);
    ferry__proto_put_u64(&c->out, s->seed);
    ferry__proto_put_u32(&c->out, (uint32_t)pool);
    ferry__proto_put_u64(&c->out, s->chunk_bytes);
    ferry__proto_put_u64(&c->out, s->slot_bytes);
    ferry__proto_put_u64(&c->out, s->nslots);
    ferry__proto_put_u64(&c->out, s->pool_bytes);
    c->hello = 1;
    if (pool)
        *pass_fd = s->pool_fd;
}

static void on_lookup(ferry__srv_conn *c, const ferry__proto_req *q)
{
    ferry_kv_hash ids[64], *idp = ids;
    ferry_kv_hash *heap = NULL;
    if (q->n > FERRY__ARRAY_LEN(ids))
        idp = heap = ferry__malloc(q->n * sizeof *heap);
    uint8_t *tiers = ferry__realloc(c->tiers, q->n);
    if (!idp || !tiers) {
        ferry__free(heap);
        if (tiers)
            c->tiers = tiers;
        ferry__proto_reply_begin(&c->out, FERRY__P_LOOKUP, q->hdr.rid, -ENOMEM,
                                 "out of memory for the lookup");
        return;
    }
    c->tiers = tiers;
    for (uint32_t i = 0; i < q->n; i++)
        idp[i] = q->chunks[i].id;
    int found = ferry__kv_slot_lookup(c->s->kv, idp, q->n, q->tokens, tiers);
    ferry__free(heap);
    ferry__proto_reply_begin(&c->out, FERRY__P_LOOKUP, q->hdr.rid, found, NULL);
    ferry__proto_put_bytes(&c->out, tiers, (size_t)found);
}

/* a chunk declined with rc: its message is what WHY answers next (the
 * kv's, this thread's last: the call that declined it just set it) */
static void declined(ferry__srv_conn *c, int rc, const char *msg, int count)
{
    if (rc >= 0)
        return;
    if (rc == FERRY_ENOSPACE && count) /* (not a holder's try for what is free) */
        atomic_fetch_add(&c->declines, 1);
    if (c->why_code && rc == FERRY_ELOCKED)
        return; /* a decline's message outranks a skipped chunk's */
    c->why_code = rc;
    snprintf(c->why, sizeof c->why, "%s", msg ? msg : ferry_last_error());
    if (rc == FERRY_ENOSPACE && !msg)
        holders(c, c->why, sizeof c->why);
}

/* the waits for a slot this connection's thread just made, counted */
static void count_waits(ferry__srv_conn *c)
{
    uint64_t n, ns;
    ferry__kv_thread_waits(&n, &ns);
    if (n)
        atomic_fetch_add(&c->waits, n);
    if (ns)
        atomic_fetch_add(&c->wait_ns_total, ns);
}

/* past its share of the pool: FERRY_ENOSPACE, as a full pool, and why */
static int over_share(ferry__srv_conn *c, int write)
{
    struct ferry_serve *s = c->s;
    if (c->nheld < s->max_held && (!write || c->nreserved < s->max_reserved))
        return 0;
    char msg[FERRY__PROTO_MAX_MSG];
    snprintf(msg, sizeof msg,
             "kv %s: client pid %d holds %zu slots (%zu reserved) of the daemon's L1 pool of "
             "%llu: its share is %zu reserved, %zu held at once",
             write ? "store" : "retrieve", (int)c->pid, c->nheld, c->nreserved,
             (unsigned long long)s->nslots, s->max_reserved, s->max_held);
    declined(c, FERRY_ENOSPACE, msg, 1);
    return FERRY_ENOSPACE;
}

/* a cut connection (its client hung up, or the daemon is closing) asks
 * for a slot: none taken, -ECANCELED, and why */
static int cut_off(ferry__srv_conn *c, int write)
{
    char msg[FERRY__PROTO_MAX_MSG];
    int closing = atomic_load(&c->cut->why) == FERRY__SRV_CLOSING;
    snprintf(msg, sizeof msg, "kv %s: client pid %d: %s: no L1 slot taken (not %s)",
             write ? "store" : "retrieve", (int)c->pid,
             closing ? "the daemon is closing" : "the client hung up",
             write ? "stored" : "promoted");
    declined(c, -ECANCELED, msg, 0);
    return -ECANCELED;
}

/* a wait for a slot (reserve or promotion) declined with rc; counted:
 * whether a decline for a full pool counts */
static void wait_declined(ferry__srv_conn *c, int rc, int write, int counted)
{
    if (rc == -ECANCELED && atomic_load(&c->cut->why))
        cut_off(c, write); /* (the store's message would name its own close) */
    else
        declined(c, rc, NULL, counted);
}

/* a RESERVE: a connection that holds no reservation waits for its first
 * slot (up to its deadline); one that holds some takes what is free, so
 * a waiter never holds what another waits for. After a decline the rest
 * of the request declines at once */
static void on_reserve(ferry__srv_conn *c, const ferry__proto_req *q)
{
    ferry__proto_reply_begin(&c->out, FERRY__P_RESERVE, q->hdr.rid, 0, NULL);
    ferry__proto_put_u32(&c->out, q->n);
    int full = 0;
    for (uint32_t i = 0; i < q->n; i++) {
        const ferry__proto_chunk *ch = &q->chunks[i];
        ferry__kv_entry *e = NULL;
        uint64_t slot = 0, gen = 0;
        uint64_t wait = c->nreserved || full ? FERRY__KV_TAKE_FREE : c->wait_ns;
        int rc = full                    ? FERRY_ENOSPACE
                 : atomic_load(&c->cut->why) ? cut_off(c, 1)
                                        : over_share(c, 1);
        if (rc == 0 &&
            (rc = ferry__kv_slot_reserve_wait(c->s->kv, ch->id, ch->tokens, wait, &e, &slot,
                                              &gen)) < 0)
            wait_declined(c, rc, 1, wait != FERRY__KV_TAKE_FREE);
        if (rc == 0 && hold_add(c, e, &ch->id, slot, gen, 1) < 0) {
            ferry__kv_slot_commit(c->s->kv, e, 1);
            rc = -ENOMEM;
        }
        if (rc == FERRY_ENOSPACE)
            full = 1;
        ferry__proto_put_u32(&c->out, (uint32_t)rc);
        ferry__proto_put_u64(&c->out, rc == 0 ? slot : 0);
        ferry__proto_put_u64(&c->out, rc == 0 ? gen : 0);
    }
}

/* COMMIT (write) or RELEASE: each chunk must be one this connection holds */
static void on_finish(ferry__srv_conn *c, const ferry__proto_req *q, int write)
{
    int type = write ? FERRY__P_COMMIT : FERRY__P_RELEASE;
    ferry__proto_reply_begin(&c->out, (uint8_t)type, q->hdr.rid, 0, NULL);
    ferry__proto_put_u32(&c->out, q->n);
    for (uint32_t i = 0; i < q->n; i++) {
        const ferry__proto_chunk *ch = &q->chunks[i];
        ssize_t k = hold_find(c, ch, write);
        int rc;
        if (k < 0) {
            rc = FERRY_ESTATE; /* a slot it does not hold: refused, nothing touched */
            atomic_fetch_add(&c->s->bad_frames, 1);
        } else {
            ferry__srv_hold h = c->held[k];
            hold_drop(c, (size_t)k);
            rc = write ? ferry__kv_slot_commit(c->s->kv, h.e, ch->status)
                       : ferry__kv_slot_release(c->s->kv, h.e, h.slot, h.gen);
        }
        ferry__proto_put_u32(&c->out, (uint32_t)rc);
    }
}

static void on_acquire(ferry__srv_conn *c, const ferry__proto_req *q)
{
    ferry_kv *kv = c->s->kv;
    ferry_kv_hash ids[64];
    for (uint32_t i = 0; i < q->n; i += (uint32_t)FERRY__ARRAY_LEN(ids)) {
        size_t k = FERRY__MIN((size_t)(q->n - i), FERRY__ARRAY_LEN(ids));
        for (size_t j = 0; j < k; j++)
            ids[j] = q->chunks[i + j].id;
        ferry__kv_slot_prefetch(kv, ids, k); /* L2 reads ahead of the acquires below */
    }
    ferry__proto_reply_begin(&c->out, FERRY__P_ACQUIRE, q->hdr.rid, 0, NULL);
    ferry__proto_put_u32(&c->out, q->n);
    int full = 0;
    for (uint32_t i = 0; i < q->n; i++) {
        const ferry__proto_chunk *ch = &q->chunks[i];
        ferry__kv_entry *e = NULL;
        uint64_t slot = 0, gen = 0;
        uint32_t tokens = 0;
        uint8_t tier = 0;
        /* holding nothing, it may wait for a slot to promote into */
        uint64_t wait = c->nheld || full ? FERRY__KV_TAKE_FREE : c->wait_ns;
        int rc = over_share(c, 0);
        if (rc == 0 && (rc = ferry__kv_slot_acquire_wait(kv, ch->id, wait, &e, &slot, &gen,
                                                         &tokens, &tier)) < 0 &&
            rc != FERRY_ENOTFOUND)
            wait_declined(c, rc, 0, wait != FERRY__KV_TAKE_FREE);
        if (rc == 0 && hold_add(c, e, &ch->id, slot, gen, 0) < 0) {
            ferry__kv_slot_release(kv, e, slot, gen);
            rc = -ENOMEM;
        }
        if (rc == FERRY_ENOSPACE)
            full = 1;
        ferry__proto_put_u32(&c->out, (uint32_t)rc);
        ferry__proto_put_u64(&c->out, rc == 0 ? slot : 0);
        ferry__proto_put_u64(&c->out, rc == 0 ? gen : 0);
        ferry__proto_put_u8(&c->out, rc == 0 ? tier : 0);
    }
}

static void on_simple(ferry__srv_conn *c, const ferry__proto_req *q)
{
    ferry_kv *kv = c->s->kv;
    int t = q->hdr.type, rc = 0;
    if (t == FERRY__P_DELETE) {
        ferry_kv_hash *ids = ferry__malloc(q->n * sizeof *ids);
        if (!ids) {
            rc = -ENOMEM;
        } else {
            for (uint32_t i = 0; i < q->n; i++)
                ids[i] = q->chunks[i].id;
            rc = ferry__kv_slot_delete(kv, ids, q->n);
            ferry__free(ids);
        }
    } else if (t == FERRY__P_PREFETCH) {
        /* queue L2 / remote reads of these chunks into L1 and answer at once */
        ferry_kv_hash ids[64];
        for (uint32_t i = 0; i < q->n; i += (uint32_t)FERRY__ARRAY_LEN(ids)) {
            size_t k = FERRY__MIN((size_t)(q->n - i), FERRY__ARRAY_LEN(ids));
            for (size_t j = 0; j < k; j++)
                ids[j] = q->chunks[i + j].id;
            ferry__kv_slot_prefetch(kv, ids, k);
        }
        rc = (int)q->n;
    } else if (t == FERRY__P_FLUSH) {
        rc = ferry_kv_flush(kv);
    } else if (t == FERRY__P_SYNC) {
        rc = ferry_kv_sync(kv);
    } else if (t == FERRY__P_CLEAR) {
        rc = ferry_kv_clear(kv);
    }
    ferry__proto_reply_begin(&c->out, (uint8_t)t, q->hdr.rid, rc,
                             rc < 0 ? ferry_kv_last_error(kv) : NULL);
}

static void on_stats(ferry__srv_conn *c, const ferry__proto_req *q)
{
    ferry_kv_stats m = FERRY_KV_STATS_INIT;
    int rc = ferry_kv_stats_get(c->s->kv, &m);
    ferry__proto_reply_begin(&c->out, FERRY__P_STATS, q->hdr.rid, rc,
                             rc < 0 ? ferry_kv_last_error(c->s->kv) : NULL);
    if (rc < 0)
        return;
    pthread_mutex_lock(&c->s->mu);
    unsigned n = c->s->nconns;
    pthread_mutex_unlock(&c->s->mu);
    ferry__proto_put_u32(&c->out, n);
    ferry__proto_put_u32(&c->out, (uint32_t)sizeof m);
    ferry__proto_put_bytes(&c->out, &m, sizeof m);
    /* then the daemon's own counters (a reader that knows only the store's
     * stops before them) */
    ferry_serve_stats ss = FERRY_SERVE_STATS_INIT;
    if (ferry_serve_stats_get(c->s, &ss) < 0)
        return;
    ferry__proto_put_u32(&c->out, (uint32_t)sizeof ss);
    ferry__proto_put_bytes(&c->out, &ss, sizeof ss);
}

/* answer one decoded request into c->out; *pass_fd: an fd to send along */
static void dispatch(ferry__srv_conn *c, const ferry__proto_req *q, int *pass_fd)
{
    switch (q->hdr.type) {
    case FERRY__P_HELLO: on_hello(c, q, pass_fd); break;
    case FERRY__P_LOOKUP: on_lookup(c, q); break;
    case FERRY__P_RESERVE: on_reserve(c, q); break;
    case FERRY__P_COMMIT: on_finish(c, q, 1); break;
    case FERRY__P_ACQUIRE: on_acquire(c, q); break;
    case FERRY__P_RELEASE: on_finish(c, q, 0); break;
    case FERRY__P_STATS: on_stats(c, q); break;
    case FERRY__P_PING:
        ferry__proto_reply_begin(&c->out, FERRY__P_PING, q->hdr.rid, 0, NULL);
        break;
    case FERRY__P_WAIT:
        c->wait_ns = q->tokens * 1000000u;
        ferry__proto_reply_begin(&c->out, FERRY__P_WAIT, q->hdr.rid, 0, NULL);
        break;
    case FERRY__P_WHY: /* rc: the last decline's code, its message after it */
        ferry__proto_reply_begin(&c->out, FERRY__P_WHY, q->hdr.rid, c->why_code,
                                 c->why_code ? c->why : NULL);
        c->why_code = 0;
        break;
    default: on_simple(c, q); break;
    }
}

/* ---- the connection's loop ---- */

static int recv_full(int fd, uint8_t *p, size_t n)
{
    while (n) {
        ssize_t r = recv(fd, p, n, 0);
        if (r > 0) {
            p += r;
            n -= (size_t)r;
        } else if (r == 0) {
            return -ECONNRESET;
        } else if (errno != EINTR) {
            return -errno;
        }
    }
    return 0;
}

/* room for a payload of len bytes and the chunks it may carry */
static int room(ferry__srv_conn *c, uint32_t len)
{
    if (len > c->in_cap) {
        uint8_t *n = ferry__realloc(c->in, len);
        if (!n)
            return -ENOMEM;
        c->in = n;
        c->in_cap = len;
    }
    size_t want = FERRY__MIN((size_t)len / 16 + 1, (size_t)FERRY__PROTO_MAX_CHUNKS);
    if (want > c->ch_cap) {
        ferry__proto_chunk *n = ferry__realloc(c->ch, want * sizeof *n);
        if (!n)
            return -ENOMEM;
        c->ch = n;
        c->ch_cap = want;
    }
    return 0;
}

/* one frame: 0 to go on, < 0 to end the connection */
static int serve_one(ferry__srv_conn *c)
{
    struct ferry_serve *s = c->s;
    uint8_t hb[FERRY__PROTO_HDR];
    int r = recv_full(c->fd, hb, sizeof hb);
    if (r < 0)
        return r;
    ferry__proto_hdr h;
    char why[200];
    r = ferry__proto_hdr_decode(hb, sizeof hb, &h, why, sizeof why);
    if (r < 0) {
        atomic_fetch_add(&s->bad_frames, 1);
        ferry__srv_warn(s, "serve: client pid %d sent a bad frame (%s): disconnected",
                        (int)c->pid, why);
        ferry__srv_refuse(c->fd, r == FERRY_EVERSION ? h.rid : 0, r, why);
        return r;
    }
    if ((r = room(c, h.len)) < 0) {
        ferry__srv_refuse(c->fd, h.rid, r, "out of memory for the request");
        return r;
    }
    if ((r = recv_full(c->fd, c->in, h.len)) < 0)
        return r; /* truncated: the client went away mid-frame */
    ferry__proto_req q;
    memset(&q, 0, sizeof q);
    q.chunks = c->ch;
    q.max_chunks = c->ch_cap;
    r = ferry__proto_req_decode(&h, c->in, &q, why, sizeof why);
    if (r == 0 && !c->hello && h.type != FERRY__P_HELLO) {
        snprintf(why, sizeof why, "%s before HELLO", ferry__proto_type_name(h.type));
        r = FERRY_ESTATE;
    }
    int pass_fd = -1;
    if (r < 0) {
        atomic_fetch_add(&s->bad_frames, 1);
        FERRY_LOGD("serve: client pid %d: request %llu refused: %s", (int)c->pid,
                   (unsigned long long)h.rid, why);
        ferry__proto_reply_begin(&c->out, FERRY__P_ERROR, h.rid, r, why);
    } else {
        dispatch(c, &q, &pass_fd);
        count_waits(c);
    }
    if ((r = ferry__proto_end(&c->out)) < 0) {
        ferry__srv_refuse(c->fd, h.rid, r, "the reply does not fit a frame");
        return r;
    }
    atomic_fetch_add(&s->requests, 1);
    r = ferry__srv_send(s, c->fd, c->out.p, c->out.len, pass_fd);
    if (r == -ETIMEDOUT) {
        atomic_fetch_add(&s->slow_clients, 1);
        ferry__srv_warn(s, "serve: client pid %d reads no replies (%u ms): disconnected",
                        (int)c->pid, s->send_timeout_ms);
    }
    if (r == 0 && c->bye)
        r = FERRY_EBUSY; /* (refused at HELLO: its reply said why) */
    return r;
}

void *ferry__srv_conn_main(void *arg)
{
    ferry__srv_conn *c = arg;
    FERRY_LOGD("serve: client pid %d uid %d connected", (int)c->pid, (int)c->uid);
    ferry__kv_thread_cut(c->cut);
    while (serve_one(c) == 0)
        ;
    /* nobody reads for it any more: what it queued and no read began for
     * is dropped now (the accept loop may not have seen it go) */
    int none = 0;
    atomic_compare_exchange_strong(&c->cut->why, &none, FERRY__SRV_GONE);
    ferry__kv_ahead_cut(c->s->kv, c->cut);
    ferry__kv_thread_cut(NULL);
    holds_release(c);
    shutdown(c->fd, SHUT_RDWR);
    FERRY_LOGD("serve: client pid %d disconnected", (int)c->pid);
    pthread_mutex_lock(&c->s->mu);
    if (!c->retired) {
        c->retired = 1;
        c->s->nconns--;
        c->s->nengines -= c->engine ? 1u : 0u;
    }
    pthread_mutex_unlock(&c->s->mu);
    atomic_store(&c->done, 1);
    return NULL;
}
