/*
 * redis_server.h - real redis-server processes for tests: started on a free
 * loopback port (127.0.0.1 only) in a temp dir, stopped, paused, restarted
 * on the same port, and 3-node Redis Clusters built with redis-cli.
 *
 * The child gets PR_SET_PDEATHSIG so a crashed test leaves no server
 * behind. Tests skip (exit 77) when ft_redis_available() is 0.
 */
#ifndef FT_REDIS_SERVER_H
#define FT_REDIS_SERVER_H

#include <stddef.h>
#include <sys/types.h>

#define FT_REDIS_MAX_ARGS 24

typedef struct ft_redis {
    pid_t pid;                 /* 0 when not running */
    int port;
    char dir[256];             /* its temp dir (ft_tmpdir) */
    char sock[320];            /* unix socket path in dir */
    const char *extra[FT_REDIS_MAX_ARGS]; /* extra arguments, kept for restarts */
    int nextra;
    int own_dir;
} ft_redis;

/* 1 when redis-server (and redis-cli) can be run here */
int ft_redis_available(void);
/* Start on a free port with extra args (NULL-terminated, may be NULL;
 * the strings must outlive r). Waits until it answers PING. 0 or -1. */
int ft_redis_start(ft_redis *r, const char *const *extra);
/* Start again on the same port and dir after ft_redis_stop/kill. 0 or -1. */
int ft_redis_restart(ft_redis *r);
/* SIGTERM and wait; the port and dir stay for a restart. */
void ft_redis_stop(ft_redis *r);
/* SIGSTOP / SIGCONT: a hung server that still accepts connections. */
void ft_redis_pause(ft_redis *r);
void ft_redis_resume(ft_redis *r);
/* stop and remove the temp dir */
void ft_redis_destroy(ft_redis *r);
/* "redis://127.0.0.1:PORT/db" */
char *ft_redis_url(const ft_redis *r, int db, char *buf, size_t len);
/* Run a command on the server (argv form, NULL-terminated strings) through
 * a fresh raw hiredis connection; copies a string/status/error reply into
 * out (may be NULL). Returns the reply type (REDIS_REPLY_*) or -1. */
int ft_redis_cmd(const ft_redis *r, char *out, size_t outlen, const char *const *argv);
/* Same with explicit lengths (binary values). */
int ft_redis_cmd_bin(const ft_redis *r, char *out, size_t outlen, int argc, const char **argv,
                     const size_t *lens);

/* ---- a server per cmocka test ----
 * main calls ft_redis_check() once; each test that wants its own server
 * is listed as FT_REDIS_TEST(name) and begins
 *     ft_redis *s = *state;
 *     if (!s)
 *         return;
 * and the server is stopped and its directory removed after it, failed
 * or not. */
/* 1 when redis-server can be run here; else 0, saying on stderr that the
 * remote tests pass empty */
int ft_redis_check(void);
/* cmocka setup: *state a started ft_redis (no extra args), NULL when
 * redis-server is not installed; -1 (the test fails) when it cannot
 * start */
int ft_redis_setup(void **state);
/* cmocka teardown: ft_redis_destroy of ft_redis_setup's server */
int ft_redis_teardown(void **state);
#define FT_REDIS_TEST(f) cmocka_unit_test_setup_teardown(f, ft_redis_setup, ft_redis_teardown)

typedef struct ft_redis_cluster {
    ft_redis node[3];
    char ids[3][48]; /* node ids */
} ft_redis_cluster;
/* Three cluster-enabled servers joined by `redis-cli --cluster create`
 * (no replicas); returns when every node reports cluster_state:ok. */
int ft_redis_cluster_start(ft_redis_cluster *c);
void ft_redis_cluster_destroy(ft_redis_cluster *c);
/* index of the node that owns slot, -1 if unknown */
int ft_redis_cluster_owner(ft_redis_cluster *c, unsigned slot);

#endif
