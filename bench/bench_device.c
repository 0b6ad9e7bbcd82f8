/*
 * bench_device.c - copy throughput of a device backend, and how well its
 * asynchronous copies overlap with work the caller does meanwhile.
 *
 *   bench_device [--backend host|cuda|auto] [--size 256M] [--chunk 8M]
 *                [--rounds 3] [--json]
 *
 * For each direction (htod, dtoh, dtod) it queues size/chunk copies of
 * chunk bytes on one stream between pinned host memory and device memory
 * and reports GB/s from the wall clock and from the events around the
 * batch. The reference is a plain memcpy of the same bytes in the same
 * process (on host that is the ceiling: the ratio says what the stream
 * machinery costs). Overlap: while the stream does an htod of `size`
 * bytes the caller either (a) waits as long as that copy takes alone, as a
 * thread waiting on disk I/O does, or (b) memcpys `size` bytes itself;
 * overlap = (t_copy_alone + t_caller_alone) / t_both (1.0 = serialized, 2.0
 * = perfect). (b) is bounded by memory bandwidth, so its reference is two
 * plain threads memcpying in parallel in the same process. Best of --rounds
 * for every figure.
 */
#include <pthread.h>
#include <time.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "ferry.h"

static double now_s(void)
{
    return (double)ferry__now_ns() / 1e9;
}

static void die(const char *what, int rc)
{
    fprintf(stderr, "bench_device: %s: %s: %s\n", what, ferry_strerror(rc), ferry_last_error());
    exit(1);
}
#define CHECK(x)                  \
    do {                          \
        int rc_ = (x);            \
        if (rc_ < 0)              \
            die(#x, rc_);         \
    } while (0)

struct ctx {
    ferry_device *dev;
    ferry_stream *s;
    ferry_event *e0, *e1;
    unsigned char *host;  /* pinned */
    unsigned char *host2; /* pinned, for the reference memcpy */
    ferry_devptr a, b;
    size_t size, chunk;
};

/* one batch of copies; returns wall seconds, *ev_ms from the events */
static double batch(struct ctx *c, int dir, float *ev_ms)
{
    double t0 = now_s();
    CHECK(ferry_event_record(c->e0, c->s));
    for (size_t off = 0; off < c->size; off += c->chunk) {
        size_t n = FERRY__MIN(c->chunk, c->size - off);
        if (dir == 0)
            CHECK(ferry_memcpy_htod_async(c->s, c->a + off, c->host + off, n));
        else if (dir == 1)
            CHECK(ferry_memcpy_dtoh_async(c->s, c->host + off, c->a + off, n));
        else
            CHECK(ferry_memcpy_dtod_async(c->s, c->b + off, c->a + off, n));
    }
    CHECK(ferry_event_record(c->e1, c->s));
    CHECK(ferry_event_sync(c->e1));
    double t = now_s() - t0;
    CHECK(ferry_event_elapsed_ms(c->e0, c->e1, ev_ms));
    return t;
}

static void sleep_s(double s)
{
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    while (nanosleep(&ts, &ts) != 0)
        ;
}

static double ref_memcpy(struct ctx *c)
{
    double t0 = now_s();
    for (size_t off = 0; off < c->size; off += c->chunk) {
        size_t n = FERRY__MIN(c->chunk, c->size - off);
        memcpy(c->host2 + off, c->host + off, n);
    }
    return now_s() - t0;
}

struct plain_copy {
    unsigned char *dst, *src;
    size_t size, chunk;
};

static void *plain_copy_run(void *p)
{
    struct plain_copy *pc = p;
    for (size_t off = 0; off < pc->size; off += pc->chunk)
        memcpy(pc->dst + off, pc->src + off, FERRY__MIN(pc->chunk, pc->size - off));
    return NULL;
}

/* the stream's htod in flight while the caller waits `wait_s` or memcpys */
static double overlapped(struct ctx *c, double wait_s)
{
    double t0 = now_s();
    CHECK(ferry_event_record(c->e0, c->s));
    for (size_t off = 0; off < c->size; off += c->chunk)
        CHECK(ferry_memcpy_htod_async(c->s, c->a + off, c->host + off,
                                      FERRY__MIN(c->chunk, c->size - off)));
    CHECK(ferry_event_record(c->e1, c->s));
    if (wait_s > 0)
        sleep_s(wait_s);
    else
        ref_memcpy(c);
    CHECK(ferry_event_sync(c->e1));
    return now_s() - t0;
}

int main(int argc, char **argv)
{
    const char *backend = "auto";
    uint64_t size = 256ull << 20, chunk = 8ull << 20;
    int rounds = 3, json = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--backend") && i + 1 < argc)
            backend = argv[++i];
        else if (!strcmp(argv[i], "--size") && i + 1 < argc)
            CHECK(ferry_parse_size(argv[++i], &size));
        else if (!strcmp(argv[i], "--chunk") && i + 1 < argc)
            CHECK(ferry_parse_size(argv[++i], &chunk));
        else if (!strcmp(argv[i], "--rounds") && i + 1 < argc)
            rounds = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--json"))
            json = 1;
        else {
            fprintf(stderr,
                    "usage: bench_device [--backend host|cuda|auto] [--size 256M] [--chunk 8M] "
                    "[--rounds 3] [--json]\n");
            return 2;
        }
    }
    if (size == 0 || chunk == 0 || rounds < 1) {
        fprintf(stderr, "bench_device: size, chunk and rounds must be positive\n");
        return 2;
    }
    struct ctx c = {0};
    c.size = (size_t)size;
    c.chunk = (size_t)chunk;
    ferry_device_options o = FERRY_DEVICE_OPTIONS_INIT;
    o.backend = backend;
    CHECK(ferry_device_open(&o, &c.dev));
    CHECK(ferry_stream_create(c.dev, &c.s));
    CHECK(ferry_event_create(c.dev, &c.e0));
    CHECK(ferry_event_create(c.dev, &c.e1));
    CHECK(ferry_device_host_alloc(c.dev, c.size, (void **)&c.host));
    CHECK(ferry_device_host_alloc(c.dev, c.size, (void **)&c.host2));
    CHECK(ferry_device_alloc(c.dev, c.size, &c.a));
    CHECK(ferry_device_alloc(c.dev, c.size, &c.b));
    /* touch everything once so page faults are not measured */
    memset(c.host, 1, c.size);
    memset(c.host2, 2, c.size);
    CHECK(ferry_device_memset(c.dev, c.a, 3, c.size));
    CHECK(ferry_device_memset(c.dev, c.b, 4, c.size));

    double best_ref = 1e30;
    for (int r = 0; r < rounds; r++)
        best_ref = FERRY__MIN(best_ref, ref_memcpy(&c));
    double gb = (double)c.size / 1e9;
    const char *dirs[3] = {"htod", "dtoh", "dtod"};
    double best_wall[3], best_ev[3];
    for (int d = 0; d < 3; d++) {
        best_wall[d] = best_ev[d] = 1e30;
        for (int r = 0; r < rounds; r++) {
            float ms = 0;
            double t = batch(&c, d, &ms);
            best_wall[d] = FERRY__MIN(best_wall[d], t);
            best_ev[d] = FERRY__MIN(best_ev[d], (double)ms / 1e3);
        }
    }
    double best_wait = 1e30, best_both = 1e30, best_plain = 1e30;
    for (int r = 0; r < rounds; r++) {
        best_wait = FERRY__MIN(best_wait, overlapped(&c, best_wall[0]));
        best_both = FERRY__MIN(best_both, overlapped(&c, 0));
    }
    /* reference for (b): two plain threads, each copying size bytes */
    unsigned char *p1 = malloc(c.size), *p2 = malloc(c.size);
    if (!p1 || !p2)
        die("malloc", -ENOMEM);
    memset(p1, 5, c.size);
    memset(p2, 6, c.size);
    for (int r = 0; r < rounds; r++) {
        struct plain_copy pc = {p1, p2, c.size, c.chunk};
        pthread_t th;
        double t0 = now_s();
        if (pthread_create(&th, NULL, plain_copy_run, &pc) != 0)
            die("pthread_create", -EAGAIN);
        ref_memcpy(&c);
        pthread_join(th, NULL);
        best_plain = FERRY__MIN(best_plain, now_s() - t0);
    }
    free(p1);
    free(p2);
    double overlap_wait = (best_wall[0] * 2) / best_wait;
    double overlap = (best_wall[0] + best_ref) / best_both;
    double overlap_ref = (2 * best_ref) / best_plain;

    if (json) {
        printf("{\"backend\":\"%s\",\"device\":\"%s\",\"size\":%zu,\"chunk\":%zu,"
               "\"memcpy_gb_per_s\":%.3f",
               ferry_device_backend(c.dev), ferry_device_name(c.dev), c.size, c.chunk,
               gb / best_ref);
        for (int d = 0; d < 3; d++)
            printf(",\"%s\":{\"gb_per_s\":%.3f,\"event_gb_per_s\":%.3f,\"ratio_to_memcpy\":%.3f}",
                   dirs[d], gb / best_wall[d], gb / best_ev[d], best_ref / best_wall[d]);
        printf(",\"overlap_wait\":%.3f,\"overlap_memcpy\":%.3f,\"overlap_memcpy_plain_threads\":%.3f}\n",
               overlap_wait, overlap, overlap_ref);
    } else {
        printf("device %s (%s): %zu bytes in chunks of %zu, best of %d\n",
               ferry_device_backend(c.dev), ferry_device_name(c.dev), c.size, c.chunk, rounds);
        printf("  memcpy (reference)  %8.2f GB/s\n", gb / best_ref);
        for (int d = 0; d < 3; d++)
            printf("  %-4s                %8.2f GB/s (events %8.2f GB/s)  %.2f x memcpy\n",
                   dirs[d], gb / best_wall[d], gb / best_ev[d], best_ref / best_wall[d]);
        printf("  overlap, htod on the stream || caller waiting:  %.2f (1 = serialized, 2 = perfect)\n",
               overlap_wait);
        printf("  overlap, htod on the stream || caller memcpy:   %.2f (two plain threads: %.2f)\n",
               overlap, overlap_ref);
    }
    CHECK(ferry_device_free(c.dev, c.a));
    CHECK(ferry_device_free(c.dev, c.b));
    CHECK(ferry_device_host_free(c.dev, c.host));
    CHECK(ferry_device_host_free(c.dev, c.host2));
    ferry_event_destroy(c.e0);
    ferry_event_destroy(c.e1);
    CHECK(ferry_stream_destroy(c.s));
    ferry_device_close(c.dev);
    return 0;
}
