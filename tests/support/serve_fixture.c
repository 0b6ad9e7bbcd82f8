/*
 * serve_fixture.c - a ferry daemon in a thread (serve_fixture.h).
 */
#include "serve_fixture.h"

#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
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
        ferry_serve_run(g_child);
        _exit(ferry_serve_close(g_child) < 0 ? 4 : 0);
    }
    return pid;
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
    assert_non_null(ft_tmpdir(d->dir, sizeof d->dir));
    snprintf(d->sock, sizeof d->sock, "%s/ferry.sock", d->dir);
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
