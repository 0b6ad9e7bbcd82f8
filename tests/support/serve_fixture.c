/*
 * serve_fixture.c - a ferry daemon in a thread (serve_fixture.h).
 */
#include "serve_fixture.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ferry_test.h"

static void *srv_main(void *arg)
{
    ferry_serve_run(arg);
    return NULL;
}

void ft_srv_open(ft_srv *v, const ferry_serve_config *sc)
{
    FT_ASSERT_OK(ferry_serve_open(sc, &v->s));
    assert_int_equal(pthread_create(&v->th, NULL, srv_main, v->s), 0);
}

void ft_srv_close(ft_srv *v)
{
    ferry_serve_stop(v->s);
    pthread_join(v->th, NULL);
    FT_ASSERT_OK(ferry_serve_close(v->s));
    v->s = NULL;
}

static ferry_serve *g_child;

static void child_term(int sig)
{
    (void)sig;
    ferry_serve_stop(g_child);
}

pid_t ft_srv_fork(const ferry_serve_config *sc, int log_level)
{
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        /* a SIGTERM sent before the handler is in place waits for it (a
         * stop asked at once after ready must still end in exit 0) */
        sigset_t term, old;
        sigemptyset(&term);
        sigaddset(&term, SIGTERM);
        sigprocmask(SIG_BLOCK, &term, &old);
        if (log_level >= 0)
            ferry_log_set_level(log_level);
        if (ferry_serve_open(sc, &g_child) < 0) {
            fprintf(stderr, "daemon: %s\n", ferry_last_error());
            _exit(3);
        }
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = child_term;
        sigaction(SIGTERM, &sa, NULL);
        sigprocmask(SIG_SETMASK, &old, NULL);
        ferry_serve_run(g_child);
        _exit(ferry_serve_close(g_child) < 0 ? 4 : 0);
    }
    return pid;
}

/* 1 once the daemon at sock listens, by `how` (FT_SRV_READY_*) */
static int srv_listens(const char *sock, int how)
{
    if (how == FT_SRV_READY_FILE) {
        struct stat st;
        return lstat(sock, &st) == 0;
    }
    ft_raw r;
    int rc = ft_raw_connect(&r, sock);
    ft_raw_close(&r);
    return rc == 0;
}

/* a daemon a failed wait leaves must not outlive the test (it holds
 * CTest's output pipes: the run would wait for its timeout) */
static void srv_kill(pid_t pid)
{
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
}

pid_t ft_srv_fork_ready(const ferry_serve_config *sc, int log_level, int how,
                        unsigned timeout_ms)
{
    fflush(NULL); /* (a child never prints what the parent buffered) */
    pid_t pid = ft_srv_fork(sc, log_level);
    for (unsigned waited = 0; !srv_listens(sc->socket_path, how); waited += 5) {
        int ws;
        if (waitpid(pid, &ws, WNOHANG) == pid)
            fail_msg("the daemon ended (%s %d) before it listened on %s",
                     WIFEXITED(ws) ? "exit" : "signal",
                     WIFEXITED(ws) ? WEXITSTATUS(ws) : WTERMSIG(ws), sc->socket_path);
        if (waited >= timeout_ms) {
            srv_kill(pid);
            fail_msg("the daemon never answered on %s within %u ms", sc->socket_path,
                     timeout_ms);
        }
        usleep(5000);
    }
    return pid;
}

void ft_srv_fork_stop(pid_t pid, unsigned timeout_ms)
{
    assert_int_equal(kill(pid, SIGTERM), 0);
    int ws = 0;
    pid_t got = 0;
    for (unsigned waited = 0; (got = waitpid(pid, &ws, WNOHANG)) == 0; waited += 10) {
        if (waited >= timeout_ms) {
            srv_kill(pid);
            fail_msg("the daemon did not stop within %u ms of SIGTERM", timeout_ms);
        }
        usleep(10000);
    }
    assert_int_equal(got, pid);
    if (!WIFEXITED(ws) || WEXITSTATUS(ws) != 0)
        fail_msg("the daemon ended with %s %d after SIGTERM", WIFEXITED(ws) ? "exit" : "signal",
                 WIFEXITED(ws) ? WEXITSTATUS(ws) : WTERMSIG(ws));
}

void ft_sock_dir(char *dir, size_t dlen, char *sock, size_t slen)
{
    ft_tmpdir(dir, dlen);
    if (!dir[0])
        fail_msg("no temporary directory for the daemon's socket");
    snprintf(sock, slen, "%s/ferry.sock", dir);
}

ssize_t ft_recv_fd(int sock, void *buf, size_t n, int flags, int *fd)
{
    union {
        struct cmsghdr h;
        char b[CMSG_SPACE(sizeof(int))];
    } ctl;
    struct iovec iov = {buf, n};
    struct msghdr m = {0};
    m.msg_iov = &iov;
    m.msg_iovlen = 1;
    m.msg_control = ctl.b;
    m.msg_controllen = sizeof ctl.b;
    ssize_t k = recvmsg(sock, &m, flags);
    if (k <= 0)
        return k;
    struct cmsghdr *h = CMSG_FIRSTHDR(&m);
    if (h && h->cmsg_type == SCM_RIGHTS)
        memcpy(fd, CMSG_DATA(h), sizeof *fd);
    return k;
}

int ft_send_fd(int sock, const void *buf, size_t n, int fd)
{
    const unsigned char *p = buf;
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
        ssize_t w = sendmsg(sock, &m, MSG_NOSIGNAL);
        if (w <= 0)
            return -1;
        p += w;
        n -= (size_t)w;
        fd = -1;
    }
    return 0;
}

void ft_kv_daemon_start(ft_kv_daemon *d, const ferry_kv_config *kc)
{
    memset(d, 0, sizeof *d);
    ft_sock_dir(d->dir, sizeof d->dir, d->sock, sizeof d->sock);
    ferry_serve_config sc = FERRY_SERVE_CONFIG_INIT;
    sc.socket_path = d->sock;
    sc.kv = kc;
    ft_srv_open(&d->srv, &sc);
}

ferry_kv *ft_kv_daemon_client(ft_kv_daemon *d, ferry_kv_config c)
{
    c.server = d->sock;
    c.server_timeout_ms = 5000;
    c.l1_bytes = 1; /* (any nonzero: the daemon's pool is mapped) */
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    return kv;
}

void ft_kv_daemon_stop(ft_kv_daemon *d)
{
    ft_srv_close(&d->srv);
    ft_rmtree(d->dir);
}

int ft_raw_connect(ft_raw *r, const char *sock)
{
    memset(r, 0, sizeof *r);
    r->pool_fd = -1;
    struct sockaddr_un a;
    memset(&a, 0, sizeof a);
    a.sun_family = AF_UNIX;
    memcpy(a.sun_path, sock, strlen(sock) + 1);
    r->fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (r->fd < 0 || connect(r->fd, (struct sockaddr *)&a, sizeof a) != 0)
        return -errno;
    return 0;
}

void ft_raw_close(ft_raw *r)
{
    if (r->fd >= 0)
        close(r->fd);
    if (r->pool_fd >= 0)
        close(r->pool_fd);
    r->fd = r->pool_fd = -1;
    ferry__proto_buf_free(&r->out);
}

void ft_raw_req(ft_raw *r, ferry__proto_req *q)
{
    q->hdr.rid = ++r->rid;
    FT_ASSERT_OK(ferry__proto_req_encode(&r->out, q));
    assert_int_equal(send(r->fd, r->out.p, r->out.len, MSG_NOSIGNAL), (ssize_t)r->out.len);
}

int ft_raw_reply(ft_raw *r, int32_t *rc, char *msg, size_t len)
{
    uint8_t hb[FERRY__PROTO_HDR];
    for (size_t got = 0; got < sizeof hb;) {
        ssize_t k = ft_recv_fd(r->fd, hb + got, sizeof hb - got, MSG_CMSG_CLOEXEC, &r->pool_fd);
        if (k <= 0)
            return -1;
        got += (size_t)k;
    }
    char why[128];
    assert_int_equal(ferry__proto_hdr_decode(hb, sizeof hb, &r->h, why, sizeof why), 0);
    assert_true(r->h.len <= sizeof r->in);
    for (size_t got = 0; got < r->h.len;) {
        ssize_t k = recv(r->fd, r->in + got, r->h.len - got, 0);
        if (k <= 0)
            return -1;
        got += (size_t)k;
    }
    r->rd = (ferry__proto_rd){r->in, r->in + r->h.len, 0};
    *rc = ferry__proto_reply_head(&r->rd, msg, len);
    return 0;
}

void ft_raw_hello_req(ferry__proto_req *q, unsigned token_bytes, uint32_t chunk_tokens, int pool)
{
    memset(q, 0, sizeof *q);
    q->hdr.type = FERRY__P_HELLO;
    q->hello.layout = ft_kv_layout(token_bytes);
    q->hello.chunk_tokens = chunk_tokens;
    q->hello.seed = FERRY_KV_HASH_SEED_DEFAULT;
    q->hello.flags = pool ? 0 : FERRY__HELLO_NO_POOL;
}

int32_t ft_raw_hello(ft_raw *r, unsigned token_bytes, uint32_t chunk_tokens, int pool, char *msg,
                     size_t len)
{
    ferry__proto_req q;
    ft_raw_hello_req(&q, token_bytes, chunk_tokens, pool);
    ft_raw_req(r, &q);
    int32_t rc;
    assert_int_equal(ft_raw_reply(r, &rc, msg, len), 0);
    return rc;
}
