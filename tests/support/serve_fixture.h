/*
 * serve_fixture.h - a ferry daemon in a thread of the test's process (or
 * in a child process, for the tests that kill it), for the tests that talk
 * to one through its socket; and the socket's SCM_RIGHTS framing, for the
 * tests that speak the wire themselves.
 */
#ifndef FERRY_TEST_SERVE_FIXTURE_H
#define FERRY_TEST_SERVE_FIXTURE_H

#include <pthread.h>
#include <stddef.h>
#include <sys/types.h>

#include "ferry/serve.h"
#include "proto/proto.h"

typedef struct ft_srv {
    ferry_serve *s;
    pthread_t th;
} ft_srv;

/* open a daemon with sc and run it on a thread (fails the test on an
 * error) */
void ft_srv_open(ft_srv *v, const ferry_serve_config *sc);
/* stop it, join its thread and close it: v->s is NULL after */
void ft_srv_close(ft_srv *v);

/* a daemon hosting a store of kc on a socket in a fresh temporary
 * directory, in a thread; and clients of it: the cases that run against
 * both backends of the KV API */
typedef struct ft_kv_daemon {
    ft_srv srv;
    char dir[256], sock[300];
} ft_kv_daemon;
void ft_kv_daemon_start(ft_kv_daemon *d, const ferry_kv_config *kc);
/* ferry_kv_open of c as a client of d (c's server fields set here: its
 * socket, a 5 s timeout, a pool mapped); fails the test on an error */
ferry_kv *ft_kv_daemon_client(ft_kv_daemon *d, ferry_kv_config c);
/* stop the daemon and remove its directory */
void ft_kv_daemon_stop(ft_kv_daemon *d);

/* fork a child that opens a daemon with sc (log_level >= 0: the child's
 * ferry_log_set_level first) and runs it until SIGTERM stops it; the child
 * exits 0 after a clean close, 3 when the open failed (the message on
 * stderr), 4 when the close failed. Returns the child's pid at once: the
 * caller waits until the daemon answers. */
pid_t ft_srv_fork(const ferry_serve_config *sc, int log_level);
/* how ft_srv_fork_ready knows the daemon listens: a connection to its
 * socket accepted (a killed daemon's socket file left behind does not
 * count), or the socket file there (no connection made: for the tests
 * that count the daemon's connections) */
enum { FT_SRV_READY_CONNECT, FT_SRV_READY_FILE };
/* ft_srv_fork (stdio flushed first), then wait at most timeout_ms until
 * the daemon listens on sc->socket_path (`how`); fails the test if it
 * never does. Returns the child's pid. */
pid_t ft_srv_fork_ready(const ferry_serve_config *sc, int log_level, int how,
                        unsigned timeout_ms);
/* SIGTERM to a daemon of ft_srv_fork and wait at most timeout_ms: fails
 * the test unless it exits 0 within them */
void ft_srv_fork_stop(pid_t pid, unsigned timeout_ms);

/* a fresh temporary directory into dir and the path of a socket in it,
 * "DIR/ferry.sock", into sock (fails the test on an error) */
void ft_sock_dir(char *dir, size_t dlen, char *sock, size_t slen);

/* one recvmsg of at most n bytes into buf with flags, taking a descriptor
 * passed with them (SCM_RIGHTS) into *fd; *fd is left as it was when none
 * came. Returns recvmsg's count (0: the peer closed; < 0: an error). */
ssize_t ft_recv_fd(int sock, void *buf, size_t n, int flags, int *fd);
/* send all n bytes, fd (>= 0) passed with the first of them (SCM_RIGHTS);
 * 0, or -1 when the peer is gone */
int ft_send_fd(int sock, const void *buf, size_t n, int fd);

/* a client speaking the wire by hand: its socket, the pool's fd once a
 * HELLO passed one, the next request id, and the last reply (h, rd over in) */
typedef struct ft_raw {
    int fd, pool_fd;
    uint64_t rid;
    ferry__proto_buf out;
    uint8_t in[1 << 16];
    ferry__proto_hdr h;
    ferry__proto_rd rd;
} ft_raw;

/* connect to sock: 0, or -errno (r closable either way) */
int ft_raw_connect(ft_raw *r, const char *sock);
void ft_raw_close(ft_raw *r);
/* request q, its rid the next one (fails the test when it cannot go) */
void ft_raw_req(ft_raw *r, ferry__proto_req *q);
/* one reply: 0 and r->h, r->rd after its head (*rc its code, msg its
 * message), or -1 when the daemon closed the connection */
int ft_raw_reply(ft_raw *r, int32_t *rc, char *msg, size_t len);
/* *q: a HELLO for ft_kv_layout(token_bytes) in chunk_tokens chunks, the
 * default hash seed, asking for the pool (pool 1) or not
 * (FERRY__HELLO_NO_POOL); its rid still 0 */
void ft_raw_hello_req(ferry__proto_req *q, unsigned token_bytes, uint32_t chunk_tokens, int pool);
/* that HELLO sent on r (ft_raw_req) and its reply read: the reply's code,
 * msg its message; fails the test when the daemon closed the connection */
int32_t ft_raw_hello(ft_raw *r, unsigned token_bytes, uint32_t chunk_tokens, int pool, char *msg,
                     size_t len);

#endif
