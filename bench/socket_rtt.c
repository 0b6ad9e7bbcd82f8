/*
 * socket_rtt.c - the floor under a lookup through `ferry serve`: a request
 * and its reply over a Unix stream socket between two processes, nothing
 * else (the peer reads the request and answers at once), with the sizes of
 * a 32k-token lookup's frames. bench/serve_pool.sh prints it next to the
 * daemon's lookup latency.
 *
 * usage: socket_rtt [--req-bytes N] [--reply-bytes N] [--iters N]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now_us(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e6 + (double)t.tv_nsec / 1e3;
}

static int full(int fd, char *p, size_t n, int wr)
{
    while (n) {
        ssize_t r = wr ? write(fd, p, n) : read(fd, p, n);
        if (r <= 0)
            return -1;
        p += r;
        n -= (size_t)r;
    }
    return 0;
}

static int cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv)
{
    /* a lookup of 128 chunks (docs/PROTOCOL.md): a 16-byte header, u64
     * tokens, u32 n and a 16-byte id a chunk; the reply a header, rc, an
     * empty message and a tier byte a chunk */
    size_t req = 16 + 12 + 128 * 16, rep = 16 + 8 + 128;
    int iters = 4000;
    for (int i = 1; i < argc; i++) {
        if (i + 1 < argc && !strcmp(argv[i], "--req-bytes"))
            req = strtoul(argv[++i], NULL, 0);
        else if (i + 1 < argc && !strcmp(argv[i], "--reply-bytes"))
            rep = strtoul(argv[++i], NULL, 0);
        else if (i + 1 < argc && !strcmp(argv[i], "--iters"))
            iters = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: socket_rtt [--req-bytes N] [--reply-bytes N] [--iters N]\n");
            return 2;
        }
    }
    if (req < 1 || req > (1u << 24) || rep < 1 || rep > (1u << 24) || iters < 10 ||
        iters > 10000000) {
        fprintf(stderr, "socket_rtt: sizes 1..16M, iters 10..10M\n");
        return 2;
    }
    int sv[2];
    char *buf = calloc(1, req > rep ? req : rep);
    double *v = malloc((size_t)iters * sizeof *v);
    if (!buf || !v || socketpair(AF_UNIX, SOCK_STREAM, 0, sv) < 0) {
        perror("socket_rtt");
        return 1;
    }
    pid_t pid = fork();
    if (pid < 0) {
        perror("socket_rtt: fork");
        return 1;
    }
    if (pid == 0) {
        close(sv[0]);
        while (full(sv[1], buf, req, 0) == 0 && full(sv[1], buf, rep, 1) == 0)
            ;
        _exit(0);
    }
    close(sv[1]);
    for (int i = 0; i < iters; i++) {
        double t0 = now_us();
        if (full(sv[0], buf, req, 1) < 0 || full(sv[0], buf, rep, 0) < 0) {
            fprintf(stderr, "socket_rtt: the peer went away\n");
            return 1;
        }
        v[i] = now_us() - t0;
    }
    close(sv[0]);
    waitpid(pid, NULL, 0);
    qsort(v, (size_t)iters, sizeof *v, cmp);
    printf("socket round trip (%zu-byte request, %zu-byte reply, two processes): p50 %.1f us, "
           "p99 %.1f us\n",
           req, rep, v[iters / 2], v[(size_t)iters * 99 / 100]);
    free(v);
    free(buf);
    return 0;
}
