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
 * server has closed. A library must not kill its host process nor change
 * its signal dispositions, so each exchange blocks SIGPIPE in the calling
 * thread, and consumes a SIGPIPE it caused before restoring the mask (the
 * technique libcurl and OpenSSL users apply).
 */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include <hiredis/hiredis.h>

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

typedef struct sigpipe_guard {
    sigset_t old;
    int was_pending, active;
} sigpipe_guard;

static void sigpipe_block(sigpipe_guard *g)
{
    /* most hosts (Python, so vLLM and SGLang) ignore SIGPIPE already: then
     * one query replaces the four calls of the mask dance */
    struct sigaction sa;
    g->active = !(sigaction(SIGPIPE, NULL, &sa) == 0 && sa.sa_handler == SIG_IGN);
    if (!g->active)
        return;
    sigset_t set, pend;
    sigemptyset(&set);
    sigaddset(&set, SIGPIPE);
    sigemptyset(&pend);
    sigpending(&pend);
    g->was_pending = sigismember(&pend, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &set, &g->old);
}

static void sigpipe_unblock(sigpipe_guard *g)
{
    if (!g->active)
        return;
    if (!g->was_pending) {
        sigset_t set, pend;
        sigemptyset(&set);
        sigaddset(&set, SIGPIPE);
        sigemptyset(&pend);
        if (sigpending(&pend) == 0 && sigismember(&pend, SIGPIPE)) {
            struct timespec zero = {0, 0};
            while (sigtimedwait(&set, NULL, &zero) < 0 && errno == EINTR) {
            }
        }
    }
    pthread_sigmask(SIG_SETMASK, &g->old, NULL);
}

/* phase: 1 send (append + write out), 2 receive, 3 both */
static int xfer(redisContext *ctx, ferry__rcmd **cmds, size_t n, int phase, int *saved_errno)
{
    if (phase & 1) {
        for (size_t i = 0; i < n; i++)
            if (redisAppendCommandArgv(ctx, cmds[i]->argc, cmds[i]->argv, cmds[i]->argvlen) !=
                REDIS_OK) {
                *saved_errno = errno;
                return -1;
            }
        int done = 0;
        while (!done)
            if (redisBufferWrite(ctx, &done) != REDIS_OK) {
                *saved_errno = errno;
                return -1;
            }
    }
    if (phase & 2)
        for (size_t i = 0; i < n; i++) {
            void *rep = NULL;
            if (redisGetReply(ctx, &rep) != REDIS_OK) {
                *saved_errno = errno;
                return -1;
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
    sigpipe_guard g;
    sigpipe_block(&g);
    int saved = 0;
    int rc = xfer(c->c, cmds, n, phase, &saved);
    sigpipe_unblock(&g);
    if (rc == 0)
        return 0;
    int code = map_err(c->c, saved);
    char w[300];
    where(c, NULL, w, sizeof w);
    char extra[64] = "";
    if (code == -ETIMEDOUT)
        snprintf(extra, sizeof extra, " (timed out: no answer within %u ms)", c->timeout_ms);
    rc = ferry__err_set(eb, code, "remote %s: %zu pipelined command(s) (first %.*s): %s%s",
                        c->port ? w : "unix socket", n, (int)cmds[0]->argvlen[0],
                        cmds[0]->argv[0], c->c->errstr, extra);
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
