/*
 * redis_server.c - start and control real redis-server processes for tests.
 *
 * Invariant: every server listens on 127.0.0.1 only, lives in its own temp
 * dir with persistence off, and dies with the test (PR_SET_PDEATHSIG and
 * ft_redis_destroy). A port is chosen by probing random ports in
 * 20000..29999 whose cluster bus port (+10000) is free too; a start that
 * loses a race for the port is retried on another one.
 */
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <hiredis/hiredis.h>

#include "ferry_test.h"
#include "redis_server.h"

static int on_path(const char *name)
{
    const char *path = getenv("PATH");
    if (!path)
        path = "/usr/bin:/bin";
    char buf[4096];
    while (*path) {
        const char *c = strchr(path, ':');
        size_t n = c ? (size_t)(c - path) : strlen(path);
        snprintf(buf, sizeof buf, "%.*s/%s", (int)n, path, name);
        if (access(buf, X_OK) == 0)
            return 1;
        path += n + (c ? 1 : 0);
    }
    return 0;
}

int ft_redis_available(void)
{
    return on_path("redis-server") && on_path("redis-cli");
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static int port_free(int port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0)
        return 0;
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int ok = bind(fd, (struct sockaddr *)&a, sizeof a) == 0;
    close(fd);
    return ok;
}

static int pick_port(void)
{
    static unsigned seed;
    if (!seed)
        seed = (unsigned)getpid() * 2654435761u ^ (unsigned)time(NULL);
    for (int i = 0; i < 200; i++) {
        int p = 20000 + (int)(rand_r(&seed) % 10000);
        if (port_free(p) && port_free(p + 10000))
            return p;
    }
    return -1;
}

static int ping(const ft_redis *r)
{
    struct timeval tv = {0, 200000};
    redisContext *c = redisConnectWithTimeout("127.0.0.1", r->port, tv);
    if (!c || c->err) {
        if (c)
            redisFree(c);
        return 0;
    }
    redisSetTimeout(c, tv);
    redisReply *rep = redisCommand(c, "PING");
    /* LOADING and similar errors mean "not yet" */
    int ok = rep && rep->type == REDIS_REPLY_STATUS;
    if (!ok && rep && rep->type == REDIS_REPLY_ERROR && strstr(rep->str, "NOAUTH"))
        ok = 1; /* up, but wants a password */
    if (rep)
        freeReplyObject(rep);
    redisFree(c);
    return ok;
}

static int spawn(ft_redis *r)
{
    char port[16];
    snprintf(port, sizeof port, "%d", r->port);
    char log[400];
    snprintf(log, sizeof log, "%s/redis.log", r->dir);
    const char *argv[16 + FT_REDIS_MAX_ARGS];
    int n = 0;
    argv[n++] = "redis-server";
    argv[n++] = "--port";
    argv[n++] = port;
    argv[n++] = "--bind";
    argv[n++] = "127.0.0.1";
    argv[n++] = "--save";
    argv[n++] = "";
    argv[n++] = "--appendonly";
    argv[n++] = "no";
    argv[n++] = "--dir";
    argv[n++] = r->dir;
    argv[n++] = "--logfile";
    argv[n++] = log;
    argv[n++] = "--unixsocket";
    argv[n++] = r->sock;
    for (int i = 0; i < r->nextra; i++)
        argv[n++] = r->extra[i];
    argv[n] = NULL;
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent)
            _exit(127);
        int dn = open("/dev/null", O_RDWR);
        if (dn >= 0) {
            dup2(dn, 0);
            dup2(dn, 1);
        }
        execvp("redis-server", (char *const *)argv);
        _exit(127);
    }
    r->pid = pid;
    for (int i = 0; i < 500; i++) {
        int st;
        if (waitpid(pid, &st, WNOHANG) == pid) {
            r->pid = 0;
            return -1;
        }
        if (ping(r))
            return 0;
        sleep_ms(10);
    }
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    r->pid = 0;
    return -1;
}

int ft_redis_start(ft_redis *r, const char *const *extra)
{
    memset(r, 0, sizeof *r);
    for (int i = 0; extra && extra[i] && i < FT_REDIS_MAX_ARGS; i++)
        r->extra[r->nextra++] = extra[i];
    ft_tmpdir(r->dir, sizeof r->dir);
    if (!r->dir[0])
        return -1;
    r->own_dir = 1;
    snprintf(r->sock, sizeof r->sock, "%s/redis.sock", r->dir);
    for (int attempt = 0; attempt < 5; attempt++) {
        r->port = pick_port();
        if (r->port < 0)
            return -1;
        if (spawn(r) == 0)
            return 0;
    }
    char cmd[600];
    snprintf(cmd, sizeof cmd, "tail -5 %s/redis.log >&2", r->dir);
    if (system(cmd) != 0) {
        /* the log may not exist */
    }
    return -1;
}

int ft_redis_restart(ft_redis *r)
{
    if (r->pid)
        return 0;
    for (int attempt = 0; attempt < 50; attempt++) {
        if (spawn(r) == 0)
            return 0;
        sleep_ms(20); /* the port may still be in TIME_WAIT handover */
    }
    return -1;
}

void ft_redis_stop(ft_redis *r)
{
    if (!r->pid)
        return;
    kill(r->pid, SIGCONT);
    kill(r->pid, SIGTERM);
    int st;
    for (int i = 0; i < 300; i++) {
        if (waitpid(r->pid, &st, WNOHANG) == r->pid) {
            r->pid = 0;
            return;
        }
        sleep_ms(10);
    }
    kill(r->pid, SIGKILL);
    waitpid(r->pid, &st, 0);
    r->pid = 0;
}

void ft_redis_pause(ft_redis *r)
{
    if (r->pid)
        kill(r->pid, SIGSTOP);
}

void ft_redis_resume(ft_redis *r)
{
    if (r->pid)
        kill(r->pid, SIGCONT);
}

void ft_redis_destroy(ft_redis *r)
{
    ft_redis_stop(r);
    if (r->own_dir && r->dir[0])
        ft_rmtree(r->dir);
    r->own_dir = 0;
}

char *ft_redis_url(const ft_redis *r, int db, char *buf, size_t len)
{
    snprintf(buf, len, "redis://127.0.0.1:%d/%d", r->port, db);
    return buf;
}

int ft_redis_cmd_bin(const ft_redis *r, char *out, size_t outlen, int argc, const char **argv,
                     const size_t *lens)
{
    /* (a command may take its time on a loaded machine: a SETRANGE that
     * grows a value to 512 MiB zeroes it, seconds under sanitizers) */
    struct timeval tv = {10, 0};
    redisContext *c = redisConnectWithTimeout("127.0.0.1", r->port, tv);
    if (!c || c->err) {
        if (c)
            redisFree(c);
        return -1;
    }
    redisSetTimeout(c, tv);
    redisReply *rep = redisCommandArgv(c, argc, argv, lens);
    int type = -1;
    if (rep) {
        type = rep->type;
        if (out && outlen) {
            out[0] = 0;
            if (rep->type == REDIS_REPLY_STRING || rep->type == REDIS_REPLY_STATUS ||
                rep->type == REDIS_REPLY_ERROR) {
                size_t n = rep->len < outlen - 1 ? rep->len : outlen - 1;
                memcpy(out, rep->str, n);
                out[n] = 0;
            } else if (rep->type == REDIS_REPLY_INTEGER)
                snprintf(out, outlen, "%lld", rep->integer);
        }
        freeReplyObject(rep);
    }
    redisFree(c);
    return type;
}

int ft_redis_cmd(const ft_redis *r, char *out, size_t outlen, const char *const *argv)
{
    const char *a[32];
    size_t l[32];
    int n = 0;
    while (argv[n] && n < 32) {
        a[n] = argv[n];
        l[n] = strlen(argv[n]);
        n++;
    }
    return ft_redis_cmd_bin(r, out, outlen, n, a, l);
}

int ft_redis_check(void)
{
    int have = ft_redis_available();
    if (!have)
        fprintf(stderr, "redis-server not installed: remote tests pass empty\n");
    return have;
}

int ft_redis_setup(void **state)
{
    *state = NULL;
    if (!ft_redis_available())
        return 0;
    ft_redis *r = malloc(sizeof *r);
    if (!r)
        return -1;
    if (ft_redis_start(r, NULL) != 0) {
        fprintf(stderr, "redis-server did not start\n");
        ft_redis_destroy(r);
        free(r);
        return -1;
    }
    *state = r;
    return 0;
}

int ft_redis_teardown(void **state)
{
    ft_redis *r = *state;
    if (r) {
        ft_redis_destroy(r);
        free(r);
    }
    *state = NULL;
    return 0;
}

static int run_cli_create(ft_redis_cluster *c)
{
    char addr[3][32];
    for (int i = 0; i < 3; i++)
        snprintf(addr[i], sizeof addr[i], "127.0.0.1:%d", c->node[i].port);
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        int dn = open("/dev/null", O_RDWR);
        if (dn >= 0) {
            dup2(dn, 0);
            dup2(dn, 1);
            dup2(dn, 2);
        }
        execlp("redis-cli", "redis-cli", "--cluster", "create", addr[0], addr[1], addr[2],
               "--cluster-replicas", "0", "--cluster-yes", (char *)NULL);
        _exit(127);
    }
    int st;
    if (waitpid(pid, &st, 0) != pid)
        return -1;
    return WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : -1;
}

int ft_redis_cluster_start(ft_redis_cluster *c)
{
    static const char *const args[] = {"--cluster-enabled", "yes", "--cluster-config-file",
                                       "nodes.conf", "--cluster-node-timeout", "5000", NULL};
    memset(c, 0, sizeof *c);
    for (int i = 0; i < 3; i++)
        if (ft_redis_start(&c->node[i], args) != 0) {
            ft_redis_cluster_destroy(c);
            return -1;
        }
    if (run_cli_create(c) != 0) {
        ft_redis_cluster_destroy(c);
        return -1;
    }
    for (int i = 0; i < 3; i++) {
        static const char *const myid[] = {"CLUSTER", "MYID", NULL};
        if (ft_redis_cmd(&c->node[i], c->ids[i], sizeof c->ids[i], myid) != REDIS_REPLY_STRING) {
            ft_redis_cluster_destroy(c);
            return -1;
        }
    }
    for (int t = 0; t < 1000; t++) {
        int ok = 0;
        for (int i = 0; i < 3; i++) {
            static const char *const info[] = {"CLUSTER", "INFO", NULL};
            char out[2048];
            if (ft_redis_cmd(&c->node[i], out, sizeof out, info) == REDIS_REPLY_STRING &&
                strstr(out, "cluster_state:ok"))
                ok++;
        }
        if (ok == 3)
            return 0;
        sleep_ms(10);
    }
    ft_redis_cluster_destroy(c);
    return -1;
}

void ft_redis_cluster_destroy(ft_redis_cluster *c)
{
    for (int i = 0; i < 3; i++)
        ft_redis_destroy(&c->node[i]);
}

int ft_redis_cluster_owner(ft_redis_cluster *c, unsigned slot)
{
    static const char *const slots[] = {"CLUSTER", "SLOTS", NULL};
    (void)slots;
    for (int i = 0; i < 3; i++) {
        struct timeval tv = {2, 0};
        redisContext *ctx = redisConnectWithTimeout("127.0.0.1", c->node[i].port, tv);
        if (!ctx || ctx->err) {
            if (ctx)
                redisFree(ctx);
            continue;
        }
        redisReply *rep = redisCommand(ctx, "CLUSTER SLOTS");
        int owner = -1;
        if (rep && rep->type == REDIS_REPLY_ARRAY) {
            for (size_t e = 0; e < rep->elements; e++) {
                redisReply *en = rep->element[e];
                if (en->elements < 3 || (unsigned long long)en->element[0]->integer > slot ||
                    (unsigned long long)en->element[1]->integer < slot)
                    continue;
                int port = (int)en->element[2]->element[1]->integer;
                for (int j = 0; j < 3; j++)
                    if (c->node[j].port == port)
                        owner = j;
            }
        }
        if (rep)
            freeReplyObject(rep);
        redisFree(ctx);
        return owner;
    }
    return -1;
}
