/*
 * remote_conn.c - one blocking hiredis connection with timeouts.
 *
 * Invariant: a ferry__rconn is either open and in sync with the server
 * (every command sent has had its reply read) or closed (c == NULL). Any
 * transport failure in the middle of an exchange closes it, because the
 * replies still in flight would otherwise be read as answers to the next
 * commands. Timeouts: connect_timeout_ms bounds the connect; every socket
 * read or write is bounded by command_timeout_ms (SO_RCVTIMEO/SO_SNDTIMEO),
 * so a hung server costs at most that per call, never a stall.
 *
 * hiredis 0.14 writes with write(2), which raises SIGPIPE on a socket the
 * server has closed, and a library must neither kill its host process nor
 * change its signal dispositions. So ferry never lets hiredis write: the
 * commands hiredis formats into its output buffer are sent here with
 * send(MSG_NOSIGNAL), and hiredis finds the buffer empty when it reads the
 * replies. A closed socket is then just -EPIPE.
 */
#include <errno.h>
#include <stdio.h>
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

void ferry__rcmd_release(ferry__rcmd *cmds, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (cmds[i].reply) {
            freeReplyObject(cmds[i].reply);
            cmds[i].reply = NULL;
        }
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

/* write hiredis's output buffer out without SIGPIPE; 0 or -errno */
static int flush_out(redisContext *ctx)
{
    size_t len = sdslen(ctx->obuf), off = 0;
    while (off < len) {
        ssize_t n = send(ctx->fd, ctx->obuf + off, len - off, MSG_NOSIGNAL);
        if (n > 0) {
            off += (size_t)n;
            continue;
        }
        if (n < 0 && errno == EINTR)
            continue;
        int e = n < 0 ? errno : EPIPE;
        sdsrange(ctx->obuf, (int)off, -1);
        return e == EAGAIN || e == EWOULDBLOCK ? -ETIMEDOUT : -e;
    }
    sdsclear(ctx->obuf);
    return 0;
}

/* phase: 1 send (append + write out), 2 receive, 3 both. 0, or a code
 * (*what says what failed) */
static int xfer(redisContext *ctx, ferry__rcmd **cmds, size_t n, int phase, const char **what)
{
    if (phase & 1) {
        for (size_t i = 0; i < n; i++)
            if (redisAppendCommandArgv(ctx, cmds[i]->argc, cmds[i]->argv, cmds[i]->argvlen) !=
                REDIS_OK) {
                *what = ctx->errstr;
                return map_err(ctx, errno);
            }
        int rc = flush_out(ctx);
        if (rc) {
            *what = strerror(-rc == ETIMEDOUT ? EAGAIN : -rc);
            return rc;
        }
    }
    if (phase & 2)
        for (size_t i = 0; i < n; i++) {
            void *rep = NULL;
            if (redisGetReply(ctx, &rep) != REDIS_OK) {
                *what = ctx->errstr;
                return map_err(ctx, errno);
            }
            cmds[i]->reply = rep;
        }
    return 0;
}

static int xfer_checked(ferry__rconn *c, ferry__rcmd **cmds, size_t n, int phase,
                        ferry__errbuf *eb)
{
    if (!c->c)
        return ferry__err_set(eb, -ENOTCONN, "remote %s:%d: not connected", c->host, c->port);
    const char *what = "";
    int code = xfer(c->c, cmds, n, phase, &what);
    if (code == 0)
        return 0;
    char w[300];
    where(c, NULL, w, sizeof w);
    char extra[64] = "";
    if (code == -ETIMEDOUT)
        snprintf(extra, sizeof extra, " (timed out: no answer within %u ms)", c->timeout_ms);
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

int ferry__rconn_exchange(ferry__rconn *c, ferry__rcmd **cmds, size_t n, ferry__errbuf *eb)
{
    return xfer_checked(c, cmds, n, 3, eb);
}

int ferry__rconn_send(ferry__rconn *c, ferry__rcmd **cmds, size_t n, ferry__errbuf *eb)
{
    return xfer_checked(c, cmds, n, 1, eb);
}

int ferry__rconn_recv(ferry__rconn *c, ferry__rcmd **cmds, size_t n, ferry__errbuf *eb)
{
    return xfer_checked(c, cmds, n, 2, eb);
}

/* ---- GET straight into the caller's memory ----
 * hiredis would read the reply in 16 KiB pieces into its buffer, copy it
 * into a freshly allocated reply object, and the caller would copy it
 * again. Here the header goes through a small buffer and the payload is
 * read from the socket into dst. The connection stays in sync on every
 * outcome that consumes the whole reply (absent, error reply, refused
 * value); any other failure closes it. */
#define RD_BUF 16384

typedef struct rd {
    int fd;
    size_t pos, len;
    char buf[RD_BUF];
} rd;

static int rd_errno(ssize_t n)
{
    if (n == 0)
        return -ECONNRESET;
    return errno == EAGAIN || errno == EWOULDBLOCK ? -ETIMEDOUT : -errno;
}

static int rd_fill(rd *r)
{
    for (;;) {
        ssize_t n = read(r->fd, r->buf, RD_BUF);
        if (n > 0) {
            r->pos = 0;
            r->len = (size_t)n;
            return 0;
        }
        if (n < 0 && errno == EINTR)
            continue;
        return rd_errno(n);
    }
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
            ssize_t got = read(r->fd, d, n);
            if (got > 0) {
                d += got;
                n -= (size_t)got;
                continue;
            }
            if (got < 0 && errno == EINTR)
                continue;
            return rd_errno(got);
        }
        int rc = rd_fill(r);
        if (rc)
            return rc;
    }
    return 0;
}

/* one line without its CRLF into out (truncated to cap - 1, NUL-ended) */
static int rd_line(rd *r, char *out, size_t cap)
{
    size_t o = 0;
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
            return 0;
        }
        if (o + 1 < cap)
            out[o++] = ch;
        prev = ch;
    }
}

static uint16_t le16(const uint8_t *p)
{
    return (uint16_t)(p[0] | (p[1] << 8));
}

static int get_fail(ferry__rconn *c, int code, const char *what, ferry__errbuf *eb)
{
    char extra[64] = "";
    if (code == -ETIMEDOUT)
        snprintf(extra, sizeof extra, " (timed out: no answer within %u ms)", c->timeout_ms);
    int rc = ferry__err_set(eb, code, "remote %s:%d: GET reply: %s%s", c->port ? c->host : "unix",
                            c->port, what, extra);
    ferry__rconn_close(c);
    return rc;
}

static void read_value(rd *r, ferry__rget *g, size_t vlen, int *io)
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
        *io = rd_take(r, NULL, rest);
        return;
    }
    if ((*io = rd_take(r, g->dst, rest)) != 0)
        return;
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

int ferry__rconn_get_into(ferry__rconn *c, ferry__rget *g, ferry__errbuf *eb)
{
    g->kind = 0;
    g->code = 0;
    if (!c->c)
        return ferry__err_set(eb, -ENOTCONN, "remote %s:%d: not connected", c->host, c->port);
    redisReader *rr = c->c->reader;
    if (rr->len > rr->pos) {
        /* bytes nobody asked for: never expected; start afresh */
        return get_fail(c, -ECONNABORTED, "unread bytes left on the connection", eb);
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
    int rc = xfer_checked(c, &p, 1, 1, eb);
    if (rc) {
        ferry__free(r);
        return rc;
    }
    r->fd = c->c->fd;
    r->pos = r->len = 0;
    char line[FERRY__ERRMSG_MAX];
    int io = rd_line(r, line, sizeof line);
    if (io == 0) {
        if (line[0] == '-') {
            g->kind = FERRY__RGET_ERROR;
            snprintf(g->msg, sizeof g->msg, "%s", line + 1);
        } else if (line[0] == '$' && !strcmp(line + 1, "-1")) {
            g->kind = FERRY__RGET_NIL;
        } else if (line[0] == '$' && line[1] >= '0' && line[1] <= '9' && strlen(line) <= 11) {
            char *end;
            unsigned long long v = strtoull(line + 1, &end, 10);
            if (*end || v > (1ull << 30)) {
                io = -EPROTO;
            } else {
                g->kind = FERRY__RGET_VALUE;
                g->value_len = (size_t)v;
                read_value(r, g, (size_t)v, &io);
                char crlf[2] = {0, 0};
                if (io == 0)
                    io = rd_take(r, crlf, 2);
                if (io == 0 && (crlf[0] != '\r' || crlf[1] != '\n'))
                    io = -EPROTO;
            }
        } else {
            io = -EPROTO;
        }
    }
    size_t left = r->len - r->pos;
    ferry__free(r);
    if (io)
        return get_fail(c, io, io == -EPROTO ? "not a bulk string, nil or error reply"
                                             : strerror(-io),
                        eb);
    if (left)
        ferry__rconn_close(c); /* more bytes than one reply: resync by reconnecting */
    return 0;
}

/* one command during the handshake; returns 0, a transport code or
 * FERRY_EREMOTE for an error reply */
static int handshake_cmd(ferry__rconn *c, const ferry__rconf *cf, ferry__rcmd *cmd,
                         const char *what, ferry__errbuf *eb)
{
    ferry__rcmd *p = cmd;
    int rc = ferry__rconn_exchange(c, &p, 1, eb);
    if (rc)
        return rc;
    if (cmd->reply->type == REDIS_REPLY_ERROR) {
        char w[300];
        where(c, cf, w, sizeof w);
        rc = ferry__err_set(eb, FERRY_EREMOTE, "remote %s: %s refused: %s", w, what,
                            cmd->reply->str);
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
