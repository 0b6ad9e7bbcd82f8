/*
 * drive_inflight.c - how busy a block device's read queue is while a
 * command runs: /sys/block/DEV/inflight (reads in flight, every process's)
 * sampled every 250 us until the command exits.
 *
 * usage: drive_inflight DEV MIB_PER_REQUEST -- COMMAND [ARGS...]
 *
 * Prints, over the window from the first sample with 4 or more reads in
 * flight to the last with any (so opening a store and tearing it down do
 * not count): the mean reads in flight (and that times MIB_PER_REQUEST,
 * the command's request size, as MiB in flight), the share of samples with
 * no read in flight, and the longest stretch without one. The command's
 * stdout and stderr pass through. E.g. the retrieve against fio:
 *
 *   build/drive_inflight vda 2 -- build/ferry kv bench --docs 8 \
 *       --doc-tokens 2048 --l1 256M --l2 3G --dir D --cold 1
 *   build/drive_inflight vda 4 -- fio --name=r --filename=D/f --rw=read \
 *       --size=2G --bs=4M --iodepth=16 --direct=1 --ioengine=io_uring
 *
 * Other processes' reads of the same device count too: on a shared drive
 * read the figures next to a run of the reference under the same load.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

typedef struct sample {
    double t;    /* seconds since the start */
    int reads;
} sample;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void report(const sample *s, size_t n, double mib)
{
    size_t a = n, b = 0;
    for (size_t i = 0; i < n; i++) {
        if (a == n && s[i].reads >= 4)
            a = i;
        if (s[i].reads > 0)
            b = i;
    }
    if (a == n || b <= a) {
        printf("drive_inflight: no reads seen (%zu samples)\n", n);
        return;
    }
    double sum = 0, idle_run = 0, longest = 0, t_idle = -1;
    size_t idle = 0;
    for (size_t i = a; i <= b; i++) {
        sum += s[i].reads;
        if (s[i].reads == 0) {
            idle++;
            if (t_idle < 0)
                t_idle = s[i].t;
            idle_run = s[i].t - t_idle;
            if (idle_run > longest)
                longest = idle_run;
        } else {
            t_idle = -1;
        }
    }
    size_t k = b - a + 1;
    double mean = sum / (double)k;
    printf("drive_inflight: window %.0f ms, %zu samples: reads in flight mean %.1f "
           "(%.0f MiB), none in flight %.1f%% of the samples, longest stretch %.1f ms\n",
           (s[b].t - s[a].t) * 1e3, k, mean, mean * mib, 100.0 * (double)idle / (double)k,
           longest * 1e3);
}

int main(int argc, char **argv)
{
    if (argc < 5 || strcmp(argv[3], "--")) {
        fprintf(stderr, "usage: drive_inflight DEV MIB_PER_REQUEST -- COMMAND [ARGS...]\n");
        return 2;
    }
    char path[256];
    snprintf(path, sizeof path, "/sys/block/%s/inflight", argv[1]);
    double mib = atof(argv[2]);
    int fd = open(path, O_RDONLY);
    if (fd < 0) {
        fprintf(stderr, "drive_inflight: %s: %s\n", path, strerror(errno));
        return 2;
    }
    size_t cap = (size_t)1 << 20, n = 0; /* (at 4 kHz: over 4 minutes) */
    sample *s = malloc(cap * sizeof *s);
    if (!s) {
        fprintf(stderr, "drive_inflight: out of memory\n");
        return 2;
    }
    pid_t pid = fork();
    if (pid < 0) {
        fprintf(stderr, "drive_inflight: fork: %s\n", strerror(errno));
        return 2;
    }
    if (pid == 0) {
        execvp(argv[4], argv + 4);
        fprintf(stderr, "drive_inflight: %s: %s\n", argv[4], strerror(errno));
        _exit(127);
    }
    double t0 = now_s();
    int status = 0;
    const struct timespec tick = {0, 250000};
    for (;;) {
        pid_t w = waitpid(pid, &status, WNOHANG);
        if (w == pid || (w < 0 && errno != EINTR))
            break;
        char b[128];
        ssize_t k = pread(fd, b, sizeof b - 1, 0);
        if (k > 0 && n < cap) {
            b[k] = 0;
            s[n].t = now_s() - t0;
            s[n++].reads = atoi(b);
        }
        nanosleep(&tick, NULL);
    }
    close(fd);
    fflush(stdout);
    report(s, n, mib);
    free(s);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
}
