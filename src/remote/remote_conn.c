/*
 * remote_conn.c - one blocking hiredis connection with timeouts.
 *
 * Invariant: a ferry__rconn is either open and in sync with the server
 * (every command sent has had its reply read) or closed (c == NULL). Any
 * transport failure in the middle of an exchange closes it, because the
 * replies still in flight would otherwise be read as answers to the next
 * commands.
 *
 * Time: every exchange has a deadline for the whole of it (CLOCK_MONOTONIC,
 * ferry__rdeadline), not a timeout per read or write: each wait is a
 * poll() for what is left of it, so a server that drips one byte now and
 * then, or never ends a line, costs the caller about command_timeout_ms,
 * and the connection (in an unknown state) is dropped. connect_timeout_ms
 * bounds the connect.
 *
 * Memory: ferry reads the replies from the socket itself and frames each
 * one (ferry__rframe: RESP2 only, bulk and array lengths, nesting, total
 * bytes, all within the command's bounds) before it feeds the bytes to
 * hiredis's parser, so what a server sends can never make hiredis buffer
 * or allocate more than the bounds of the commands in flight. Bytes past
 * the last expected reply are a protocol error.
 *
 * hiredis 0.14 writes with write(2), which raises SIGPIPE on a socket the
 * server has closed, and a library must neither kill its host process nor
 * change its signal dispositions. So ferry never lets hiredis write: the
 * commands hiredis formats into its output buffer are sent here with
 * send(MSG_NOSIGNAL), and hiredis never touches the socket. A closed
 * socket is then just -EPIPE.
 */
#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <hiredis/hiredis.h>
#include <hiredis/sds.h>
#include <sys/socket.h>
#include <unistd.h>
#include <xxhash.h>

#include "remote_int.h"

static struct timeval tv_ms(uint32_t ms)
{
    struct timeval tv = {(time_t)(ms / 1000), (suseconds_t)((ms % 1000) * 1000)};
    return tv;
}

uint64_t ferry__rdeadline(uint32_t timeout_ms, uint64_t bytes)
{
    uint64_t extra = bytes > UINT64_MAX / 2 / FERRY__RDEADLINE_NS_PER_BYTE
                         ? UINT64_MAX / 2
                         : bytes * FERRY__RDEADLINE_NS_PER_BYTE;
    return ferry__now_ns() + (uint64_t)timeout_ms * 1000000ull + extra;
}

/* wait until fd is ready for ev or the deadline passes: 0, -ETIMEDOUT or
 * -errno */
static int wait_fd(int fd, short ev, uint64_t deadline)
{
    for (;;) {
        uint64_t now = ferry__now_ns();
        if (now >= deadline)
            return -ETIMEDOUT;
        uint64_t left_ms = (deadline - now + 999999) / 1000000;
        struct pollfd p = {fd, ev, 0};
        int k = poll(&p, 1, left_ms > INT_MAX ? INT_MAX : (int)left_ms);
        if (k > 0)
            return 0; /* ready, or an error/hangup the next recv/send reports */
        if (k < 0 && errno != EINTR)
            return -errno;
    }
}

/* up to len bytes, at least one, before the deadline: the count,
 * -ECONNRESET (EOF), -ETIMEDOUT or -errno. Bytes already there are taken
 * without a poll() first (a large value arrives in many pieces). */
static ssize_t recv_dl(int fd, void *buf, size_t len, uint64_t deadline)
{
    for (;;) {
        if (ferry__now_ns() >= deadline)
            return -ETIMEDOUT;
        ssize_t n = recv(fd, buf, len, MSG_DONTWAIT);
        if (n > 0)
            return n;
        if (n == 0)
            return -ECONNRESET;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            int rc = wait_fd(fd, POLLIN, deadline);
            if (rc)
                return rc;
        } else if (errno != EINTR) {
            return -errno;
        }
    }
}

/* ---- reply framing ---- */
enum { F_TYPE, F_TEXT, F_NUM, F_BULK, F_BULK_CR, F_BULK_LF };

void ferry__rframe_start(ferry__rframe *f, size_t max, uint32_t elems)
{
    memset(f, 0, sizeof *f);
    f->max = max ? max : FERRY__RREPLY_SMALL;
    f->elems_max = elems;
}

/* an element ended: close the arrays it completes; 1 when the reply did */
static int frame_elem_done(ferry__rframe *f)
{
    while (f->depth && f->stack[f->depth - 1] == 0)
        f->depth--;
    f->state = F_TYPE;
    return f->depth == 0;
}

/* bytes the elements not yet started need at least (3: "+\r\n") */
static uint64_t frame_pending(const ferry__rframe *f)
{
    uint64_t p = 0;
    for (int i = 0; i < f->depth; i++)
        p += f->stack[i] * 3;
    return p;
}

static int frame_err(char *what, size_t len, int code, const char *fmt, ...) FERRY__PRINTF(4, 5);
static int frame_err(char *what, size_t len, int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, len, fmt, ap);
    va_end(ap);
    return code;
}

/* the number line of a ':', '$' or '*' ended; 1 when the reply did, 0, or
 * a code */
static int frame_number(ferry__rframe *f, char *what, size_t wl)
{
    f->num[f->nlen] = 0;
    if (f->nlen == 0 || (f->nlen == 1 && f->num[0] == '-'))
        return frame_err(what, wl, -EPROTO, "reply '%c' without a number", f->type);
    errno = 0;
    char *end;
    long long v = strtoll(f->num, &end, 10);
    if (errno || *end)
        return frame_err(what, wl, -EPROTO, "reply number '%s' out of range", f->num);
    if (f->type == ':' || v == -1 || (f->type == '*' && v == 0))
        return frame_elem_done(f);
    if (v < 0)
        return frame_err(what, wl, -EPROTO, "reply '%c' with length %lld", f->type, v);
    uint64_t u = (uint64_t)v, pend = frame_pending(f);
    if (f->type == '$') {
        if (u > f->max || f->used + u + 2 + pend > f->max)
            return frame_err(what, wl, -EMSGSIZE,
                             "bulk reply of %llu bytes exceeds this reply's %llu-byte bound",
                             (unsigned long long)u, (unsigned long long)f->max);
        f->bulk_left = u;
        f->state = u ? F_BULK : F_BULK_CR;
        return 0;
    }
    if (f->depth == FERRY__RREPLY_DEPTH)
        return frame_err(what, wl, -EPROTO, "reply arrays nested deeper than %d",
                         FERRY__RREPLY_DEPTH);
    if (u > f->elems_max - f->elems || u > f->max || f->used + 3 * u + pend > f->max)
        return frame_err(what, wl, -EMSGSIZE,
                         "array reply of %llu elements exceeds this reply's bound (%llu "
                         "elements, %llu bytes)",
                         (unsigned long long)u, (unsigned long long)f->elems_max,
                         (unsigned long long)f->max);
    f->elems += u;
    f->stack[f->depth++] = u;
    f->state = F_TYPE;
    return 0;
}

int ferry__rframe_scan(ferry__rframe *f, const void *buf, size_t len, size_t *took, char *what,
                       size_t wl)
{
    const uint8_t *p = buf;
    size_t i = 0;
    int rc = 0;
    while (i < len && rc == 0) {
        if (f->state == F_BULK) {
            size_t k = (size_t)FERRY__MIN(f->bulk_left, (uint64_t)(len - i));
            i += k;
            f->used += k;
            f->bulk_left -= k;
            if (!f->bulk_left)
                f->state = F_BULK_CR;
            continue;
        }
        uint8_t ch = p[i++];
        if (++f->used > f->max)
            return frame_err(what, wl, -EMSGSIZE, "reply longer than its %llu-byte bound",
                             (unsigned long long)f->max);
        switch (f->state) {
        case F_TYPE:
            if (ch != '+' && ch != '-' && ch != ':' && ch != '$' && ch != '*')
                return frame_err(what, wl, -EPROTO, "reply starts with byte 0x%02x, not RESP2",
                                 ch);
            if (f->depth)
                f->stack[f->depth - 1]--;
            f->type = (char)ch;
            f->nlen = 0;
            f->cr = 0;
            f->state = ch == '+' || ch == '-' ? F_TEXT : F_NUM;
            break;
        case F_TEXT:
            if (ch == '\n' && f->cr)
                rc = frame_elem_done(f);
            else
                f->cr = ch == '\r';
            break;
        case F_NUM:
            if (f->cr) {
                if (ch != '\n')
                    return frame_err(what, wl, -EPROTO, "reply '%c': CR without LF", f->type);
                rc = frame_number(f, what, wl);
                if (rc < 0)
                    return rc;
            } else if (ch == '\r') {
                f->cr = 1;
            } else if (f->nlen < 20 && ((ch >= '0' && ch <= '9') || (ch == '-' && !f->nlen))) {
                f->num[f->nlen++] = (char)ch;
            } else {
                return frame_err(what, wl, -EPROTO, "reply '%c': bad length or integer",
                                 f->type);
            }
            break;
        case F_BULK_CR:
            if (ch != '\r')
                return frame_err(what, wl, -EPROTO, "bulk reply not ended by CRLF");
            f->state = F_BULK_LF;
            break;
        case F_BULK_LF:
            if (ch != '\n')
                return frame_err(what, wl, -EPROTO, "bulk reply not ended by CRLF");
            rc = frame_elem_done(f);
            break;
        }
    }
    *took = i;
    return rc;
}

void ferry__rcmd_release(ferry__rcmd *cmds, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (cmds[i].reply) {
            freeReplyObject(cmds[i].reply);
            cmds[i].reply = NULL;
        }
}

const char *ferry__rreply_desc(const redisReply *rep, char *buf, size_t cap)
{
    switch (rep->type) {
    case REDIS_REPLY_INTEGER:
        snprintf(buf, cap, "integer %lld", (long long)rep->integer);
        break;
    case REDIS_REPLY_STATUS:
    case REDIS_REPLY_ERROR:
        snprintf(buf, cap, "%s %.40s", rep->type == REDIS_REPLY_STATUS ? "status" : "error",
                 rep->str);
        break;
    case REDIS_REPLY_STRING:
        snprintf(buf, cap, "a string of %zu bytes", (size_t)rep->len);
        break;
    case REDIS_REPLY_ARRAY:
        snprintf(buf, cap, "an array of %zu", (size_t)rep->elements);
        break;
    case REDIS_REPLY_NIL:
        snprintf(buf, cap, "nil");
        break;
    default:
        snprintf(buf, cap, "reply type %d", rep->type);
    }
    return buf;
}

int ferry__rreply_is_ok(const redisReply *rep)
{
    return rep->type == REDIS_REPLY_STATUS && rep->len == 2 && !memcmp(rep->str, "OK", 2);
}

/* hiredis keeps the cause as text; errno may have been clobbered since.
 * Recover the errno whose strerror() hiredis recorded. */
static int map_err(const redisContext *ctx, int saved_errno)
{
    static const int cands[] = {ECONNREFUSED, ETIMEDOUT,  ECONNRESET, EPIPE,  EHOSTUNREACH,
                                ENETUNREACH,  ENOENT,     EACCES,     EAGAIN, ENOTCONN,
                                EADDRNOTAVAIL, ECONNABORTED, ENOMEM,  EINVAL, ENOTSOCK};
    if (ctx->err == REDIS_ERR_EOF)
        return -ECONNRESET;
    if (ctx->err == REDIS_ERR_PROTOCOL)
        return -EPROTO;
    if (ctx->err == REDIS_ERR_OOM)
        return -ENOMEM;
    for (size_t i = 0; i < sizeof cands / sizeof cands[0]; i++)
        if (!strcmp(ctx->errstr, strerror(cands[i])))
            return cands[i] == EAGAIN ? -ETIMEDOUT : -cands[i];
    if (ctx->err == REDIS_ERR_IO)
        return saved_errno == EAGAIN || saved_errno == EWOULDBLOCK ? -ETIMEDOUT
               : saved_errno > 0                                  ? -saved_errno
                                                                  : -EIO;
    /* REDIS_ERR_OTHER: name resolution and the like */
    return -EHOSTUNREACH;
}

int ferry__rconn_stale_code(int code)
{
    return code == -ECONNRESET || code == -EPIPE || code == -ENOTCONN || code == -ECONNABORTED;
}

static void where(const ferry__rconn *c, const ferry__rconf *cf, char *buf, size_t len)
{
    if (c->port)
        snprintf(buf, len, "%s:%d", c->host, c->port);
    else
        snprintf(buf, len, "unix:%s", cf && cf->url ? cf->url->path : "?");
}

/* write hiredis's output buffer out without SIGPIPE before the deadline;
 * 0 or a code */
static int flush_out(redisContext *ctx, uint64_t deadline)
{
    size_t len = sdslen(ctx->obuf), off = 0;
    int e = 0;
    while (off < len) {
        if (ferry__now_ns() >= deadline) {
            e = -ETIMEDOUT;
            break;
        }
        ssize_t n = send(ctx->fd, ctx->obuf + off, len - off, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0) {
            off += (size_t)n;
            continue;
        }
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            if ((e = wait_fd(ctx->fd, POLLOUT, deadline)) != 0)
                break;
            continue;
        }
        if (n < 0 && errno == EINTR)
            continue;
        e = n < 0 ? -errno : -EPIPE;
        break;
    }
    if (e) {
        sdsrange(ctx->obuf, (int)off, -1);
        return e;
    }
    sdsclear(ctx->obuf);
    return 0;
}

#define RECV_BUF 16384

/* read the replies of cmds[0..n), framing every byte before hiredis
 * parses it; 0 or a code (what says why) */
static int recv_replies(redisContext *ctx, ferry__rcmd **cmds, size_t n, uint64_t deadline,
                        char *what, size_t wl)
{
    redisReader *rr = ctx->reader;
    if (n == 0)
        return 0;
    if (rr->len > rr->pos)
        return frame_err(what, wl, -ECONNABORTED,
                         "%zu unread bytes were left on the connection", rr->len - rr->pos);
    ferry__rframe f;
    size_t framed = 0;
    ferry__rframe_start(&f, cmds[0]->reply_max, cmds[0]->reply_elems);
    char buf[RECV_BUF];
    for (size_t i = 0; i < n;) {
        void *rep = NULL;
        if (redisReaderGetReply(rr, &rep) != REDIS_OK)
            return frame_err(what, wl, rr->err == REDIS_ERR_OOM ? -ENOMEM : -EPROTO,
                             "reply %zu: %s", i, rr->errstr);
        if (rep) {
            cmds[i++]->reply = rep;
            continue;
        }
        ssize_t got = recv_dl(ctx->fd, buf, sizeof buf, deadline);
        if (got < 0)
            return frame_err(what, wl, (int)got, "reading reply %zu of %zu: %s", i + 1, n,
                             got == -ETIMEDOUT ? "deadline passed" : strerror((int)-got));
        for (size_t off = 0; off < (size_t)got;) {
            if (framed == n)
                return frame_err(what, wl, -EPROTO,
                                 "the server sent more than the replies to %zu command(s)", n);
            size_t took = 0;
            int fr = ferry__rframe_scan(&f, buf + off, (size_t)got - off, &took, what, wl);
            if (fr < 0)
                return fr;
            off += took;
            if (fr == 1 && ++framed < n)
                ferry__rframe_start(&f, cmds[framed]->reply_max, cmds[framed]->reply_elems);
        }
        if (redisReaderFeed(rr, buf, (size_t)got) != REDIS_OK)
            return frame_err(what, wl, -ENOMEM, "buffering %zd reply bytes", got);
    }
    return 0;
}

/* phase: 1 send (append + write out), 2 receive, 3 both. 0, or a code
 * (what says what failed) */
static int xfer(redisContext *ctx, ferry__rcmd **cmds, size_t n, int phase, uint64_t deadline,
                char *what, size_t wl)
{
    if (phase & 1) {
        for (size_t i = 0; i < n; i++)
            if (redisAppendCommandArgv(ctx, cmds[i]->argc, cmds[i]->argv, cmds[i]->argvlen) !=
                REDIS_OK) {
                snprintf(what, wl, "%s", ctx->errstr);
                return map_err(ctx, errno);
            }
        int rc = flush_out(ctx, deadline);
        if (rc)
            return frame_err(what, wl, rc, "sending: %s",
                             rc == -ETIMEDOUT ? "deadline passed" : strerror(-rc));
    }
    if (phase & 2)
        return recv_replies(ctx, cmds, n, deadline, what, wl);
    return 0;
}

static int xfer_checked(ferry__rconn *c, ferry__rcmd **cmds, size_t n, int phase,
                        uint64_t deadline, ferry__errbuf *eb)
{
    if (!c->c)
        return ferry__err_set(eb, -ENOTCONN, "remote %s:%d: not connected", c->host, c->port);
    uint64_t t0 = ferry__now_ns();
    if (!deadline)
        deadline = ferry__rdeadline(c->timeout_ms, 0);
    char what[FERRY__ERRMSG_MAX / 2] = "";
    int code = xfer(c->c, cmds, n, phase, deadline, what, sizeof what);
    if (code == 0)
        return 0;
    char w[300];
    where(c, NULL, w, sizeof w);
    char extra[128] = "";
    if (code == -ETIMEDOUT)
        snprintf(extra, sizeof extra,
                 " (timed out: no complete answer within the call's %llu ms deadline; "
                 "connection dropped)",
                 (unsigned long long)((deadline - FERRY__MIN(deadline, t0) + 500000) / 1000000));
    int rc = ferry__err_set(eb, code, "remote %s: %zu pipelined command(s) (first %.*s): %s%s",
                            c->port ? w : "unix socket", n, (int)cmds[0]->argvlen[0],
                            cmds[0]->argv[0], what, extra);
    for (size_t i = 0; i < n; i++)
        if (cmds[i]->reply) {
            freeReplyObject(cmds[i]->reply);
            cmds[i]->reply = NULL;
        }
    ferry__rconn_close(c);
    return rc;
}

int ferry__rconn_exchange(ferry__rconn *c, ferry__rcmd **cmds, size_t n, uint64_t deadline_ns,
                          ferry__errbuf *eb)
{
    return xfer_checked(c, cmds, n, 3, deadline_ns, eb);
}

int ferry__rconn_send(ferry__rconn *c, ferry__rcmd **cmds, size_t n, uint64_t deadline_ns,
                      ferry__errbuf *eb)
{
    return xfer_checked(c, cmds, n, 1, deadline_ns, eb);
}

int ferry__rconn_recv(ferry__rconn *c, ferry__rcmd **cmds, size_t n, uint64_t deadline_ns,
                      ferry__errbuf *eb)
{
    return xfer_checked(c, cmds, n, 2, deadline_ns, eb);
}

/* ---- GET straight into the caller's memory ----
 * hiredis would read the reply in 16 KiB pieces into its buffer, copy it
 * into a freshly allocated reply object, and the caller would copy it
 * again. Here the header goes through a small buffer and the payload is
 * read from the socket into dst. The connection stays in sync on every
 * outcome that consumes the whole reply (absent, error reply, refused
 * value); any other failure closes it. */
#define RD_BUF 16384
/* the first line of a GET reply: "$<len>", "-<error>" or a status */
#define RD_LINE_MAX 4096
/* a refused value longer than cap by more than this is not drained */
#define RD_DRAIN_SLACK (64u << 10)

typedef struct rd {
    int fd;
    uint64_t deadline;
    size_t pos, len;
    char buf[RD_BUF];
} rd;

static int rd_fill(rd *r)
{
    ssize_t n = recv_dl(r->fd, r->buf, RD_BUF, r->deadline);
    if (n < 0)
        return (int)n;
    r->pos = 0;
    r->len = (size_t)n;
    return 0;
}

/* exactly n bytes into dst (NULL: skip them) */
static int rd_take(rd *r, void *dst, size_t n)
{
    uint8_t *d = dst;
    while (n) {
        if (r->pos < r->len) {
            size_t k = FERRY__MIN(n, r->len - r->pos);
            if (d) {
                memcpy(d, r->buf + r->pos, k);
                d += k;
            }
            r->pos += k;
            n -= k;
            continue;
        }
        if (d && n >= RD_BUF) {
            ssize_t got = recv_dl(r->fd, d, n, r->deadline);
            if (got < 0)
                return (int)got;
            d += got;
            n -= (size_t)got;
            continue;
        }
        int rc = rd_fill(r);
        if (rc)
            return rc;
    }
    return 0;
}

/* one line without its CRLF into out (truncated to cap - 1, NUL-ended),
 * *len its whole length (more than strlen(out) when cut or holding a NUL);
 * -EMSGSIZE past RD_LINE_MAX bytes without one */
static int rd_line(rd *r, char *out, size_t cap, size_t *len)
{
    size_t o = 0, seen = 0;
    char prev = 0;
    for (;;) {
        if (r->pos == r->len) {
            int rc = rd_fill(r);
            if (rc)
                return rc;
        }
        char ch = r->buf[r->pos++];
        if (ch == '\n' && prev == '\r') {
            if (o && o < cap && out[o - 1] == '\r')
                o--;
            out[o < cap ? o : cap - 1] = 0;
            *len = seen - 1;
            return 0;
        }
        if (++seen > RD_LINE_MAX)
            return -EMSGSIZE;
        if (o + 1 < cap)
            out[o++] = ch;
        prev = ch;
    }
}

static uint16_t le16(const uint8_t *p)
{
    return (uint16_t)(p[0] | (p[1] << 8));
}

static int get_fail(ferry__rconn *c, int code, const char *what, uint64_t budget_ms,
                    ferry__errbuf *eb)
{
    char extra[128] = "";
    if (code == -ETIMEDOUT)
        snprintf(extra, sizeof extra,
                 " (timed out: no complete answer within the call's %llu ms deadline; "
                 "connection dropped)",
                 (unsigned long long)budget_ms);
    int rc = ferry__err_set(eb, code, "remote %s:%d: GET reply: %s%s", c->port ? c->host : "unix",
                            c->port, what, extra);
    ferry__rconn_close(c);
    return rc;
}

/* read the value of vlen bytes; *io: 0 or a transport code; *drop: the
 * rest of a refused value was left unread (the caller closes) */
static void read_value(rd *r, ferry__rget *g, size_t vlen, int *io, int *drop)
{
    uint8_t hb[FERRY_REMOTE_HEADER_FIXED + FERRY_REMOTE_LAYOUT_MAX];
    size_t have = FERRY__MIN(vlen, (size_t)FERRY_REMOTE_HEADER_FIXED);
    if ((*io = rd_take(r, hb, have)) != 0)
        return;
    if (have == FERRY_REMOTE_HEADER_FIXED) {
        size_t hl = le16(hb + 6);
        if (hl > FERRY_REMOTE_HEADER_FIXED && hl <= sizeof hb && hl <= vlen) {
            if ((*io = rd_take(r, hb + have, hl - have)) != 0)
                return;
            have = hl;
        }
    }
    size_t rest = vlen - have;
    ferry__errbuf veb;
    ferry__rvalue_hdr h;
    int code = ferry__rvalue_parse_header(hb, have, &h, &veb);
    if (code == 0 && h.payload_len != rest)
        code = ferry__err_set(&veb, FERRY_ECORRUPT,
                              "remote value: header says %llu payload bytes, %zu arrived",
                              (unsigned long long)h.payload_len, rest);
    if (code == 0)
        code = ferry__rvalue_match(&h, g->layout, g->layout_len, g->key_sum, &veb);
    if (code == 0 && rest > g->cap)
        code = ferry__err_set(&veb, -ENOBUFS,
                              "value of %zu bytes does not fit the %zu-byte destination", rest,
                              g->cap);
    if (code) {
        g->code = code;
        memcpy(g->msg, veb.msg, sizeof g->msg);
        /* draining costs time, not memory; past what the deadline was
         * sized for, dropping the connection is cheaper */
        if (rest > g->cap && rest - g->cap > RD_DRAIN_SLACK) {
            *drop = 1;
            g->read_len = have; /* its header only */
        } else if ((*io = rd_take(r, NULL, rest)) == 0) {
            g->read_len = vlen;
        }
        return;
    }
    if ((*io = rd_take(r, g->dst, rest)) != 0)
        return;
    g->read_len = vlen;
    uint64_t sum = XXH3_64bits(rest ? g->dst : (const void *)"", rest);
    if (sum != h.payload_sum) {
        g->code = ferry__err_set(&veb, FERRY_ECORRUPT,
                                 "remote value: payload checksum %016llx over %zu bytes, stored "
                                 "%016llx",
                                 (unsigned long long)sum, rest,
                                 (unsigned long long)h.payload_sum);
        memcpy(g->msg, veb.msg, sizeof g->msg);
        return;
    }
    g->code = 0;
    g->payload_len = rest;
}

int ferry__rconn_get_into(ferry__rconn *c, ferry__rget *g, uint64_t deadline_ns,
                          ferry__errbuf *eb)
{
    g->kind = 0;
    g->code = 0;
    g->read_len = 0;
    if (!c->c)
        return ferry__err_set(eb, -ENOTCONN, "remote %s:%d: not connected", c->host, c->port);
    uint64_t t0 = ferry__now_ns();
    if (!deadline_ns)
        deadline_ns = ferry__rdeadline(c->timeout_ms, g->cap);
    uint64_t budget_ms = (deadline_ns - FERRY__MIN(deadline_ns, t0) + 500000) / 1000000;
    redisReader *rr = c->c->reader;
    if (rr->len > rr->pos) {
        /* bytes nobody asked for: never expected; start afresh */
        return get_fail(c, -ECONNABORTED, "unread bytes left on the connection", 0, eb);
    }
    ferry__rcmd cmd;
    memset(&cmd, 0, sizeof cmd);
    cmd.argc = 2;
    cmd.argv[0] = "GET";
    cmd.argvlen[0] = 3;
    cmd.argv[1] = g->key;
    cmd.argvlen[1] = g->key_len;
    ferry__rcmd *p = &cmd;
    rd *r = ferry__malloc(sizeof *r);
    if (!r)
        return ferry__err_set(eb, -ENOMEM, "remote %s:%d: GET: out of memory for the read buffer",
                              c->host, c->port);
    int rc = xfer_checked(c, &p, 1, 1, deadline_ns, eb);
    if (rc) {
        ferry__free(r);
        return rc;
    }
    r->fd = c->c->fd;
    r->deadline = deadline_ns;
    r->pos = r->len = 0;
    char line[FERRY__ERRMSG_MAX];
    size_t line_len = 0;
    int drop = 0;
    int io = rd_line(r, line, sizeof line, &line_len);
    if (io == 0) {
        if (line[0] == '-') {
            g->kind = FERRY__RGET_ERROR;
            snprintf(g->msg, sizeof g->msg, "%s", line + 1);
        } else if (line[0] == '$' && !strcmp(line + 1, "-1")) {
            g->kind = FERRY__RGET_NIL;
        } else if (line[0] == '$' && line[1] >= '0' && line[1] <= '9') {
            /* (a length of any number of digits: past 2^64 it is read
             * as the most, over the limit as well, not a broken reply;
             * but digits then more, cut off or past a NUL, are broken) */
            char *end;
            unsigned long long v = strtoull(line + 1, &end, 10);
            if (*end || (size_t)(end - line) != line_len) {
                io = -EPROTO;
            } else if (v > FERRY_REMOTE_VALUE_MAX) {
                /* a server whose limit was raised, another writer's value:
                 * never ferry's, refused unread (the connection is dropped
                 * to resynchronize, the remote is not down) */
                g->kind = FERRY__RGET_VALUE;
                g->value_len = (size_t)v;
                ferry__errbuf veb;
                g->code = ferry__err_set(&veb, FERRY_ECORRUPT,
                                         "a value of %.40s bytes, over the %zu bytes (Redis's "
                                         "512 MiB string limit) that no ferry value exceeds",
                                         line + 1, FERRY_REMOTE_VALUE_MAX);
                memcpy(g->msg, veb.msg, sizeof g->msg);
                drop = 1;
            } else {
                g->kind = FERRY__RGET_VALUE;
                g->value_len = (size_t)v;
                g->read_len = 0;
                read_value(r, g, (size_t)v, &io, &drop);
                char crlf[2] = {0, 0};
                if (io == 0 && !drop)
                    io = rd_take(r, crlf, 2);
                if (io == 0 && !drop && (crlf[0] != '\r' || crlf[1] != '\n'))
                    io = -EPROTO;
            }
        } else {
            io = -EPROTO;
        }
    }
    size_t left = r->len - r->pos;
    ferry__free(r);
    if (io)
        return get_fail(c, io,
                        io == -EPROTO      ? "not a bulk string, nil or error reply"
                        : io == -EMSGSIZE  ? "first line longer than 4096 bytes"
                        : io == -ETIMEDOUT ? "deadline passed"
                                           : strerror(-io),
                        budget_ms, eb);
    if (left || drop)
        ferry__rconn_close(c); /* not at a reply boundary: resync by reconnecting */
    return 0;
}

/* the server's text with every copy of secret in it replaced by "***"
 * (a server or proxy may echo what it was sent) */
static void scrub(const char *text, const char *secret, char *out, size_t cap)
{
    size_t sl = secret ? strlen(secret) : 0, o = 0;
    for (const char *t = text; *t && o + 4 < cap;) {
        if (sl && !strncmp(t, secret, sl)) {
            memcpy(out + o, "***", 3);
            o += 3;
            t += sl;
        } else {
            out[o++] = *t++;
        }
    }
    out[o] = 0;
}

/* one command during the handshake; returns 0, a transport code or
 * FERRY_EREMOTE for an error reply */
static int handshake_cmd(ferry__rconn *c, const ferry__rconf *cf, ferry__rcmd *cmd,
                         const char *what, ferry__errbuf *eb)
{
    ferry__rcmd *p = cmd;
    int rc = ferry__rconn_exchange(c, &p, 1, 0, eb);
    if (rc)
        return rc;
    if (cmd->reply->type == REDIS_REPLY_ERROR) {
        char w[300], text[512];
        where(c, cf, w, sizeof w);
        scrub(cmd->reply->str, cf->url->has_password ? cf->url->password : NULL, text,
              sizeof text);
        int noauth = !strncmp(text, "NOAUTH", 6) && !cf->url->has_password;
        rc = ferry__err_set(eb, FERRY_EREMOTE, "remote %s: %s refused: %s%s", w, what, text,
                            noauth ? " (the server requires a password and the URL has none: "
                                     "redis://[user]:PASSWORD@host or ?password=)"
                                   : "");
        ferry__rcmd_release(cmd, 1);
        return rc;
    }
    ferry__rcmd_release(cmd, 1);
    return 0;
}

int ferry__rconn_open(ferry__rconn *c, const ferry__rconf *cf, const char *host, int port,
                      int select_db, ferry__errbuf *eb)
{
    ferry__rconn_close(c);
    c->timeout_ms = cf->command_timeout_ms;
    struct timeval ct = tv_ms(cf->connect_timeout_ms);
    redisContext *ctx;
    if (host) {
        snprintf(c->host, sizeof c->host, "%s", host);
        c->port = port;
        ctx = redisConnectWithTimeout(host, port, ct);
    } else {
        snprintf(c->host, sizeof c->host, "%s", cf->url->path);
        c->port = 0;
        ctx = redisConnectUnixWithTimeout(cf->url->path, ct);
    }
    char w[300];
    where(c, cf, w, sizeof w);
    if (!ctx)
        return ferry__err_set(eb, -ENOMEM, "remote %s: connect: out of memory", w);
    if (ctx->err) {
        int code = map_err(ctx, errno);
        int rc = ferry__err_set(eb, code, "remote %s: connect (timeout %u ms): %s", w,
                                cf->connect_timeout_ms, ctx->errstr);
        redisFree(ctx);
        return rc;
    }
    if (redisSetTimeout(ctx, tv_ms(cf->command_timeout_ms)) != REDIS_OK) {
        int code = map_err(ctx, errno);
        int rc = ferry__err_set(eb, code, "remote %s: setting the %u ms timeout: %s", w,
                                cf->command_timeout_ms, ctx->errstr);
        redisFree(ctx);
        return rc;
    }
    if (host)
        redisEnableKeepAlive(ctx);
    /* keep the read buffer between replies: values are large and regrowing
     * it for each one costs copies */
    ctx->reader->maxbuf = 0;
    c->c = ctx;
    const ferry__rurl *u = cf->url;
    if (u->has_password) {
        ferry__rcmd cmd = {0};
        cmd.key_arg = -1;
        cmd.argv[cmd.argc] = "AUTH";
        cmd.argvlen[cmd.argc++] = 4;
        if (u->has_user) {
            cmd.argv[cmd.argc] = u->user;
            cmd.argvlen[cmd.argc++] = strlen(u->user);
        }
        cmd.argv[cmd.argc] = u->password;
        cmd.argvlen[cmd.argc++] = strlen(u->password);
        char what[300];
        snprintf(what, sizeof what, "AUTH%s%s", u->has_user ? " as user " : "",
                 u->has_user ? u->user : "");
        int rc = handshake_cmd(c, cf, &cmd, what, eb);
        if (rc) {
            ferry__rconn_close(c);
            return rc;
        }
    }
    if (select_db && u->db != 0) {
        char db[16];
        snprintf(db, sizeof db, "%d", u->db);
        ferry__rcmd cmd = {0};
        cmd.key_arg = -1;
        cmd.argc = 2;
        cmd.argv[0] = "SELECT";
        cmd.argvlen[0] = 6;
        cmd.argv[1] = db;
        cmd.argvlen[1] = strlen(db);
        char what[64];
        snprintf(what, sizeof what, "SELECT %d", u->db);
        int rc = handshake_cmd(c, cf, &cmd, what, eb);
        if (rc) {
            ferry__rconn_close(c);
            return rc;
        }
    } else if (!u->has_password) {
        /* without AUTH or SELECT a server that wants a password would
         * only say so on the first real command, and the writer's SETs
         * would fail one by one: ask now */
        ferry__rcmd cmd = {0};
        cmd.key_arg = -1;
        cmd.argc = 1;
        cmd.argv[0] = "PING";
        cmd.argvlen[0] = 4;
        int rc = handshake_cmd(c, cf, &cmd, "PING", eb);
        if (rc) {
            ferry__rconn_close(c);
            return rc;
        }
    }
    return 0;
}

void ferry__rconn_close(ferry__rconn *c)
{
    if (c->c) {
        redisFree(c->c);
        c->c = NULL;
    }
}
