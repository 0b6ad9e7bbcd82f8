/*
 * cmd_bench_io.c - `ferry bench io`: write then read a file in chunks with
 * `depth` requests in flight, per engine, and report GB/s, IOPS, p50/p99
 * latency per chunk and CPU seconds.
 *
 * Reads never come from the page cache: files are opened O_DIRECT, and a
 * file that fell back to buffered I/O has its cache dropped
 * (fdatasync + posix_fadvise DONTNEED) between the write and the read.
 * The file is preallocated first, as fio does by default, so both measure
 * writes into allocated space.
 *
 * With --device, buffers are device memory: on cufile (GDS file) the same
 * asynchronous loop runs with device requests; otherwise each call moves
 * 2 x depth chunks through the double-buffered bounce path (segments of
 * depth chunks, so as many bytes are in flight as in the host loop), and
 * the bench also
 * measures the parts alone (file I/O from host memory, device copies
 * alone) so the overlap shows as (file_s + copy_s) / total_s.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>

#include "cli.h"

#define CMD "bench io"

typedef struct phase {
    double secs, gbps, iops, p50_us, p99_us, cpu_s;
} phase;

typedef struct bounce_parts {
    double file_s, copy_s, total_s;
} bounce_parts;

typedef struct result {
    char engine[16];
    size_t chunk;
    unsigned depth;
    uint64_t size;
    phase w, r;
    int bounce; /* device run on the CPU path: parts measured */
    bounce_parts bw, br;
    char note[256];
    int rc;
} result;

typedef struct opts {
    const char *engine, *dir, *device, *plot;
    uint64_t chunk, size;
    unsigned depth;
    int json, sweep;
} opts;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static double cpu_s(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec / 1e6 +
           (double)ru.ru_stime.tv_sec + (double)ru.ru_stime.tv_usec / 1e6;
}

/* incompressible contents (xorshift64), so storage that compresses or
 * deduplicates cannot flatter the figures */
static void fill_random(char *p, size_t n)
{
    uint64_t x = 0x9e3779b97f4a7c15ull;
    for (size_t i = 0; i + 8 <= n; i += 8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        memcpy(p + i, &x, 8);
    }
}

static void finish(phase *p, double *lat, size_t n, uint64_t bytes, double secs, double cpu)
{
    qsort(lat, n, sizeof *lat, cli_cmp_double);
    p->secs = secs;
    p->gbps = secs > 0 ? (double)bytes / secs / 1e9 : 0;
    p->iops = secs > 0 ? (double)n / secs : 0;
    p->p50_us = n ? lat[(n - 1) / 2] * 1e6 : 0;
    p->p99_us = n ? lat[(size_t)((double)(n - 1) * 0.99)] * 1e6 : 0;
    p->cpu_s = cpu;
}

/* `depth` requests in flight over the whole file; host buffers or device */
static int run_async(ferry_io *io, ferry_file *f, int op, char *hbuf, ferry_devptr dbuf,
                     const opts *o, phase *out, const char *label)
{
    size_t chunk = (size_t)o->chunk;
    unsigned depth = o->depth;
    uint64_t nreq = (o->size + chunk - 1) / chunk;
    double *lat = malloc(nreq * sizeof *lat);
    ferry_io_req *reqs = calloc(depth, sizeof *reqs);
    ferry_io_req **ptrs = calloc(depth, sizeof *ptrs), **done = calloc(depth, sizeof *done);
    double *t_sub = calloc(depth, sizeof *t_sub);
    unsigned *free_slots = calloc(depth, sizeof *free_slots);
    int rc = 0;
    if (!lat || !reqs || !ptrs || !done || !t_sub || !free_slots) {
        rc = -ENOMEM;
        goto out;
    }
    unsigned nfree = depth;
    for (unsigned i = 0; i < depth; i++)
        free_slots[i] = depth - 1 - i;
    uint64_t next = 0, ndone = 0;
    double c0 = cpu_s(), t0 = now_s();
    while (ndone < nreq) {
        unsigned n = 0;
        double t = now_s();
        while (nfree && next < nreq) {
            unsigned s = free_slots[--nfree];
            ferry_io_req *r = &reqs[s];
            memset(r, 0, sizeof *r);
            r->op = op;
            r->file = f;
            if (hbuf)
                r->buf = hbuf + (size_t)s * chunk;
            else
                r->dev = dbuf + (ferry_devptr)s * chunk;
            r->offset = next * chunk;
            r->len = (size_t)(o->size - r->offset < chunk ? o->size - r->offset : chunk);
            r->user = (void *)(uintptr_t)s;
            if (op == FERRY_IO_WRITE && hbuf) /* unique blocks, as fio's scramble_buffers */
                for (size_t b = 0; b < r->len; b += 4096)
                    *(uint64_t *)(void *)((char *)r->buf + b) ^= r->offset + b;
            t_sub[s] = t;
            ptrs[n++] = r;
            next++;
        }
        if (n) {
            int k = ferry_io_submit(io, ptrs, n);
            if (k != (int)n) {
                rc = k < 0 ? k : -EIO;
                break;
            }
        }
        int k = ferry_io_reap(io, done, 1, depth, -1);
        if (k < 0) {
            rc = k;
            break;
        }
        double tr = now_s();
        for (int i = 0; i < k; i++) {
            unsigned s = (unsigned)(uintptr_t)done[i]->user;
            if (done[i]->result != (int64_t)done[i]->len && rc == 0)
                rc = done[i]->result < 0 ? (int)done[i]->result : -EIO;
            lat[ndone++] = tr - t_sub[s];
            free_slots[nfree++] = s;
        }
        if (rc < 0)
            break;
        cli_progress(label, ndone, nreq);
    }
    /* drain what is still in flight after an error */
    while (ferry_io_inflight(io)) {
        if (ferry_io_reap(io, done, 1, depth, -1) < 0)
            break;
    }
    if (rc == 0)
        finish(out, lat, (size_t)nreq, o->size, now_s() - t0, cpu_s() - c0);
out:
    cli_progress_end();
    free(lat);
    free(reqs);
    free(ptrs);
    free(done);
    free(t_sub);
    free(free_slots);
    return rc;
}

/* device memory on the CPU path: each call moves 2 * depth chunks (two
 * bounce segments of depth chunks) */
static int run_bounce(ferry_io *io, ferry_file *f, int op, ferry_devptr dbuf, const opts *o,
                      phase *out, const char *label)
{
    size_t per = (size_t)o->chunk * o->depth * 2;
    uint64_t ncall = (o->size + per - 1) / per, nchunks = (o->size + o->chunk - 1) / o->chunk;
    double *lat = malloc(nchunks * sizeof *lat);
    if (!lat)
        return -ENOMEM;
    uint64_t k = 0;
    double c0 = cpu_s(), t0 = now_s();
    int rc = 0;
    for (uint64_t i = 0; i < ncall && rc == 0; i++) {
        uint64_t off = i * per;
        size_t len = (size_t)(o->size - off < per ? o->size - off : per);
        double t = now_s();
        rc = op == FERRY_IO_WRITE ? ferry_io_write_dev(io, f, NULL, dbuf, len, off)
                                  : ferry_io_read_dev(io, f, NULL, dbuf, len, off);
        double dt = now_s() - t;
        size_t nc = (len + o->chunk - 1) / o->chunk;
        for (size_t j = 0; j < nc && k < nchunks; j++)
            lat[k++] = dt / (double)nc;
        cli_progress(label, off + len, o->size);
    }
    cli_progress_end();
    if (rc == 0)
        finish(out, lat, (size_t)k, o->size, now_s() - t0, cpu_s() - c0);
    free(lat);
    return rc;
}

/* the device copies alone: the same bytes, in chunk pieces, through a
 * pinned buffer as large as a bounce segment (a small buffer would stay in
 * the CPU cache and flatter the copies) */
static int copy_only(ferry_device *dev, ferry_devptr dbuf, const opts *o, int op, double *secs)
{
    size_t seg = (size_t)o->chunk * o->depth;
    void *h = NULL;
    ferry_stream *s = NULL;
    int rc = ferry_device_host_alloc(dev, seg, &h);
    if (rc == 0) {
        memset(h, 0x5a, seg);
        rc = ferry_stream_create(dev, &s);
    }
    double t0 = now_s();
    for (uint64_t off = 0; rc == 0 && off < o->size; off += o->chunk) {
        size_t n = (size_t)(o->size - off < o->chunk ? o->size - off : o->chunk);
        size_t at = (size_t)(off % seg);
        rc = op == FERRY_IO_WRITE ? ferry_memcpy_dtoh_async(s, (char *)h + at, dbuf + at, n)
                                  : ferry_memcpy_htod_async(s, dbuf + at, (char *)h + at, n);
    }
    if (rc == 0)
        rc = ferry_stream_sync(s);
    *secs = now_s() - t0;
    ferry_stream_destroy(s);
    if (h)
        ferry_device_host_free(dev, h);
    return rc;
}

/* host buffers, or device buffers straight to the file (GDS): the write
 * then the read of the whole file, depth chunks in flight. The buffers go
 * to *hbuf / *dbuf for the caller to free. */
static int bench_direct(ferry_io *io, ferry_file *f, ferry_device *dev, const opts *oc,
                        result *res, char **hbuf, ferry_devptr *dbuf)
{
    int rc;
    size_t blen = oc->chunk * oc->depth;
    if (dev) {
        rc = ferry_device_alloc(dev, blen, dbuf);
        if (rc == 0)
            rc = ferry_device_memset(dev, *dbuf, 0x5a, blen);
        if (rc == 0)
            rc = ferry_io_register_dev(io, *dbuf, blen);
    } else {
        rc = ferry_io_buffer_alloc(io, blen, (void **)hbuf);
        if (rc == 0)
            fill_random(*hbuf, blen);
    }
    if (rc < 0)
        return rc;
    rc = run_async(io, f, FERRY_IO_WRITE, *hbuf, *dbuf, oc, &res->w, "write");
    if (rc == 0)
        rc = ferry_file_drop_cache(f);
    if (rc == 0)
        rc = run_async(io, f, FERRY_IO_READ, *hbuf, *dbuf, oc, &res->r, "read");
    return rc;
}

/* device buffers through the CPU path (bounce buffers), and its parts
 * alone: the file I/O from host memory and the device copies. The buffers
 * go to *hbufp / *dbufp for the caller to free. */
static int bench_bounce(ferry_io *io, ferry_file *f, ferry_device *dev, const opts *oc,
                        result *res, char **hbufp, ferry_devptr *dbufp)
{
    /* the bounce path, and its parts alone. The file is written once
     * first (unmeasured) so every measured write overwrites allocated
     * blocks: the parts and the whole then compare like with like. */
    size_t blen = oc->chunk * oc->depth;
    int rc;
    phase fw, fr, prefill;
    double cw = 0, cr = 0;
    memset(&fw, 0, sizeof fw);
    memset(&fr, 0, sizeof fr);
    rc = ferry_device_alloc(dev, 2 * blen, dbufp);
    ferry_devptr dbuf = *dbufp;
    if (rc == 0) /* touch it: first-touch page faults are not the bounce path's cost */
        rc = ferry_device_memset(dev, dbuf, 0x5a, 2 * blen);
    if (rc == 0)
        rc = ferry_io_buffer_alloc(io, blen, (void **)hbufp);
    if (rc < 0)
        return rc;
    char *hbuf = *hbufp;
    fill_random(hbuf, blen);
    res->bounce = 1;
    rc = run_async(io, f, FERRY_IO_WRITE, hbuf, 0, oc, &prefill, "prefill");
    if (rc == 0) /* set up the bounce buffers and stream outside the timing */
        rc = ferry_io_read_dev(io, f, NULL, dbuf, 4096, 0);
    /* each part and the whole twice, alternating, keeping the faster
     * run of each: the order of runs (write-back of the previous one,
     * other load) moves single figures more than the overlap does */
    for (int rep = 0; rep < 2 && rc == 0; rep++) {
        phase a, b, c, d;
        double cpw = 0, cpr = 0;
        rc = run_async(io, f, FERRY_IO_WRITE, hbuf, 0, oc, &a, "file write");
        if (rc == 0)
            rc = run_bounce(io, f, FERRY_IO_WRITE, dbuf, oc, &b, "write");
        if (rc == 0)
            rc = ferry_file_drop_cache(f);
        if (rc == 0)
            rc = run_async(io, f, FERRY_IO_READ, hbuf, 0, oc, &c, "file read");
        if (rc == 0)
            rc = ferry_file_drop_cache(f);
        if (rc == 0)
            rc = run_bounce(io, f, FERRY_IO_READ, dbuf, oc, &d, "read");
        if (rc == 0)
            rc = copy_only(dev, dbuf, oc, FERRY_IO_WRITE, &cpw);
        if (rc == 0)
            rc = copy_only(dev, dbuf, oc, FERRY_IO_READ, &cpr);
        if (rc < 0)
            break;
        if (rep == 0 || a.secs < fw.secs)
            fw = a;
        if (rep == 0 || b.secs < res->w.secs)
            res->w = b;
        if (rep == 0 || c.secs < fr.secs)
            fr = c;
        if (rep == 0 || d.secs < res->r.secs)
            res->r = d;
        if (rep == 0 || cpw < cw)
            cw = cpw;
        if (rep == 0 || cpr < cr)
            cr = cpr;
    }
    res->bw = (bounce_parts){fw.secs, cw, res->w.secs};
    res->br = (bounce_parts){fr.secs, cr, res->r.secs};
    return rc;
}

static int bench_one(const char *engine, const opts *o, size_t chunk, result *res)
{
    opts oc = *o;
    oc.chunk = chunk;
    memset(res, 0, sizeof *res);
    snprintf(res->engine, sizeof res->engine, "%s", engine);
    res->chunk = chunk;
    res->depth = o->depth;
    res->size = o->size;
    ferry_device *dev = NULL;
    ferry_io *io = NULL;
    ferry_file *f = NULL;
    char *hbuf = NULL;
    ferry_devptr dbuf = 0;
    char path[4096];
    int rc = 0;
    if (o->device) {
        ferry_device_options d = FERRY_DEVICE_OPTIONS_INIT;
        d.backend = o->device;
        rc = ferry_device_open(&d, &dev);
        if (rc < 0) {
            /* the library's message names the device ("device cuda: ...") */
            const char *m = ferry_last_error();
            if (!strncmp(m, "device ", 7))
                snprintf(res->note, sizeof res->note, "%s", m);
            else
                snprintf(res->note, sizeof res->note, "device %s: %s", o->device, m);
            goto out;
        }
    }
    ferry_io_options io_o = FERRY_IO_OPTIONS_INIT;
    io_o.engine = strcmp(engine, "auto") ? engine : NULL;
    io_o.depth = o->depth;
    io_o.device = dev;
    /* with a device, one bounce segment carries what the host loop keeps
     * in flight, as far as a segment goes */
    if (dev) {
        uint64_t seg = (uint64_t)chunk * o->depth;
        io_o.bounce_bytes = (size_t)(seg < FERRY_IO_BOUNCE_MAX ? seg : FERRY_IO_BOUNCE_MAX);
    }
    rc = ferry_io_open(&io_o, &io);
    if (rc < 0) {
        snprintf(res->note, sizeof res->note, "%s", ferry_last_error());
        goto out;
    }
    snprintf(res->engine, sizeof res->engine, "%s", ferry_io_engine(io));
    snprintf(path, sizeof path, "%s/ferry-bench-%d-%s.bin", o->dir, (int)getpid(), engine);
    rc = ferry_file_open(io, path, FERRY_FILE_READ | FERRY_FILE_WRITE | FERRY_FILE_CREATE |
                                       FERRY_FILE_TRUNC | FERRY_FILE_DIRECT, &f);
    if (rc < 0) {
        snprintf(res->note, sizeof res->note, "%s", ferry_last_error());
        goto out;
    }
    if (ferry_file_fallback_reason(f))
        snprintf(res->note, sizeof res->note, "%s", ferry_file_fallback_reason(f));
    rc = ferry_file_allocate(f, 0, o->size);
    if (rc < 0)
        goto fail;
    if (!dev || ferry_file_is_gds(f))
        rc = bench_direct(io, f, dev, &oc, res, &hbuf, &dbuf);
    else
        rc = bench_bounce(io, f, dev, &oc, res, &hbuf, &dbuf);
    if (rc == 0)
        goto out;
fail:
    snprintf(res->note, sizeof res->note, "%s", ferry_last_error());
out:
    if (dbuf) {
        if (ferry_file_is_gds(f))
            ferry_io_unregister_dev(io, dbuf);
        ferry_device_free(dev, dbuf);
    }
    if (hbuf)
        ferry_io_buffer_free(io, hbuf);
    if (f) {
        ferry_file_close(f);
        unlink(path);
    }
    ferry_io_close(io);
    ferry_device_close(dev);
    res->rc = rc;
    return rc;
}

static json_t *phase_json(const phase *p)
{
    return json_pack("{s:f, s:f, s:f, s:f, s:f}", "gb_per_s", p->gbps, "iops", p->iops, "p50_us",
                     p->p50_us, "p99_us", p->p99_us, "cpu_s", p->cpu_s);
}

static json_t *parts_json(const bounce_parts *b)
{
    return json_pack("{s:f, s:f, s:f, s:f}", "file_s", b->file_s, "copy_s", b->copy_s, "total_s",
                     b->total_s, "overlap",
                     b->total_s > 0 ? (b->file_s + b->copy_s) / b->total_s : 0.0);
}

/* list: where --json collects several runs; NULL prints the one run's object */
static void print_result(const result *r, const opts *o, json_t *list)
{
    if (o->json) {
        json_t *j = json_pack("{s:s, s:I, s:I, s:I}", "engine", r->engine, "chunk_bytes",
                              (json_int_t)r->chunk, "depth", (json_int_t)r->depth, "file_bytes",
                              (json_int_t)r->size);
        if (o->device)
            json_object_set_new(j, "device", json_string(o->device));
        if (r->rc == 0) {
            json_object_set_new(j, "write", phase_json(&r->w));
            json_object_set_new(j, "read", phase_json(&r->r));
            if (r->bounce)
                json_object_set_new(j, "bounce", json_pack("{s:o, s:o}", "write",
                                                           parts_json(&r->bw), "read",
                                                           parts_json(&r->br)));
        } else
            json_object_set_new(j, "error", json_string(r->note));
        if (r->rc == 0 && r->note[0])
            json_object_set_new(j, "note", json_string(r->note));
        if (list) {
            json_array_append_new(list, j);
            return;
        }
        char *s = json_dumps(j, JSON_COMPACT);
        printf("%s\n", s);
        free(s);
        json_decref(j);
        fflush(stdout);
        return;
    }
    if (r->rc < 0) {
        printf("%-7s %8zuK  unusable: %s\n", r->engine, r->chunk >> 10, r->note);
        return;
    }
    for (int i = 0; i < 2; i++) {
        const phase *p = i ? &r->r : &r->w;
        printf("%-7s %8zuK %5u %-5s %8.2f GB/s %9.0f IOPS  p50 %9.1f us  p99 %9.1f us  cpu "
               "%6.2f s\n", r->engine, r->chunk >> 10, r->depth, i ? "read" : "write", p->gbps,
               p->iops, p->p50_us, p->p99_us, p->cpu_s);
    }
    if (r->bounce)
        for (int i = 0; i < 2; i++) {
            const bounce_parts *b = i ? &r->br : &r->bw;
            printf("        bounce %-5s: file alone %.3f s + copies alone %.3f s = %.3f s; "
                   "together %.3f s (overlap x%.2f)\n", i ? "read" : "write", b->file_s,
                   b->copy_s, b->file_s + b->copy_s, b->total_s,
                   b->total_s > 0 ? (b->file_s + b->copy_s) / b->total_s : 0);
        }
    if (r->note[0])
        printf("        note: %s\n", r->note);
    fflush(stdout);
}

static int plot(const char *png, const result *res, size_t n)
{
    char dat[] = "/tmp/ferry-bench-plot-XXXXXX";
    int fd = mkstemp(dat);
    if (fd < 0)
        return -errno;
    FILE *f = fdopen(fd, "w");
    /* one block per engine and direction: chunk KiB, GB/s */
    const char *engines[8];
    size_t ne = 0;
    for (size_t i = 0; i < n; i++) {
        size_t j = 0;
        while (j < ne && strcmp(engines[j], res[i].engine))
            j++;
        if (j == ne && ne < 8 && res[i].rc == 0) /* engines with points only */
            engines[ne++] = res[i].engine;
    }
    for (size_t e = 0; e < ne; e++)
        for (int d = 0; d < 2; d++) {
            fprintf(f, "# %s %s\n", engines[e], d ? "read" : "write");
            for (size_t i = 0; i < n; i++)
                if (!strcmp(res[i].engine, engines[e]) && res[i].rc == 0)
                    fprintf(f, "%zu %f\n", res[i].chunk >> 10, d ? res[i].r.gbps : res[i].w.gbps);
            fprintf(f, "\n\n");
        }
    fclose(f);
    char script[8192];
    int off = snprintf(script, sizeof script,
                       "set terminal pngcairo size 900,560; set output '%s';"
                       "set title 'ferry bench io (file %llu MiB, depth %u)';"
                       "set logscale x 2; set xlabel 'chunk (KiB)'; set ylabel 'GB/s';"
                       "set key left top; set grid; plot ",
                       png, (unsigned long long)(res[0].size >> 20), res[0].depth);
    for (size_t e = 0; e < ne; e++)
        for (int d = 0; d < 2; d++)
            off += snprintf(script + off, sizeof script - (size_t)off,
                            "%s'%s' index %zu with linespoints title '%s %s'",
                            e || d ? ", " : "", dat, e * 2 + (size_t)d, engines[e],
                            d ? "read" : "write");
    char cmd[9000];
    snprintf(cmd, sizeof cmd, "gnuplot -e \"%s\"", script);
    int st = system(cmd);
    unlink(dat);
    return st == 0 ? 0 : -EIO;
}

static void usage(FILE *f)
{
    fprintf(f,
            "usage: ferry bench io [--engine auto|posix|uring|cufile|all] [--chunk 8M] "
            "[--depth 8]\n"
            "                      [--size 2G] [--dir DIR [--create]] [--device host|cuda] "
            "[--json]\n"
            "                      [--sweep] [--plot FILE.png]\n"
            "Writes then reads a file of --size in --chunk requests, --depth in flight, and\n"
            "prints GB/s, IOPS, p50/p99 latency per chunk and CPU seconds per engine.\n"
            "  --chunk    4K..1G, a multiple of 4K, at most --size\n"
            "  --size     4K..16T, a multiple of 4K (sizes: 4096, 256K, 8M, 2G; no hex)\n"
            "  --depth    1..4096 requests in flight (--chunk x --depth at most 4G)\n"
            "  --dir      an existing directory (default $TMPDIR or /var/tmp); --create makes it\n"
            "  --sweep    chunk sizes 64K..64M (those up to --size; --size at least 64K);\n"
            "             --plot draws the sweep with gnuplot\n"
            "  --json     one JSON document: the result object of the one run, or with\n"
            "             --engine all or --sweep {\"file_bytes\", \"depth\", \"results\": [...]}\n");
}

/* 0 to run, 2 on a usage error (printed), -1 after --help */
static int parse(int argc, char **argv, opts *o, int *create, int *chunk_given)
{
    static const char *const engine_names[] = {"auto", "posix", "uring", "cufile", "all", NULL};
    static const char *const device_names[] = {"host", "cuda", NULL};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        uint64_t x = 0;
        int k = 0, rc = 0;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return -1;
        } else if (!strcmp(a, "--json"))
            o->json = 1;
        else if (!strcmp(a, "--sweep"))
            o->sweep = 1;
        else if (!strcmp(a, "--create"))
            *create = 1;
        else if (!strcmp(a, "--engine")) {
            if ((rc = cli_opt_choice(CMD, a, v, engine_names, &k)) == 0)
                o->engine = engine_names[k];
            i++;
        } else if (!strcmp(a, "--dir")) {
            rc = cli_opt_string(CMD, a, v, "a directory", &o->dir);
            i++;
        } else if (!strcmp(a, "--device")) {
            if ((rc = cli_opt_choice(CMD, a, v, device_names, &k)) == 0)
                o->device = device_names[k];
            i++;
        } else if (!strcmp(a, "--plot")) {
            rc = cli_opt_outfile(CMD, a, v, "a PNG file to write", &o->plot);
            i++;
        } else if (!strcmp(a, "--chunk")) {
            if ((rc = cli_opt_size(CMD, a, v, 4096, 1ull << 30, 4096, &x)) == 0)
                o->chunk = x;
            *chunk_given = 1;
            i++;
        } else if (!strcmp(a, "--size")) {
            if ((rc = cli_opt_size(CMD, a, v, 4096, 16ull << 40, 4096, &x)) == 0)
                o->size = x;
            i++;
        } else if (!strcmp(a, "--depth")) {
            if ((rc = cli_opt_count(CMD, a, v, 1, 4096, &x)) == 0)
                o->depth = (unsigned)x;
            i++;
        } else
            return cli_unknown(CMD, a);
        if (rc)
            return rc;
    }
    return 0;
}

/* what no single option shows: the options against each other, the directory */
static int check(opts *o, int create, int chunk_given)
{
    char sz[32], ch[32];
    if (o->sweep && chunk_given)
        return cli_usage(CMD, "--chunk %s: --sweep picks the chunks (64K..64M); accepted: "
                              "--chunk or --sweep, not both", ferry__size_str(o->chunk, ch, sizeof ch));
    if (!o->sweep && o->chunk > o->size)
        return cli_usage(CMD, "--chunk %s: larger than --size %s; accepted: a chunk of at most "
                              "--size", ferry__size_str(o->chunk, ch, sizeof ch),
                         ferry__size_str(o->size, sz, sizeof sz));
    if (o->sweep && o->size < (64u << 10))
        return cli_usage(CMD, "--size %s: --sweep starts at 64K chunks; accepted: 64K..16T",
                         ferry__size_str(o->size, sz, sizeof sz));
    uint64_t top = o->sweep ? (o->size < (64u << 20) ? o->size : (64u << 20)) : o->chunk;
    if (top * o->depth > (4ull << 30))
        return cli_usage(CMD, "--depth %u: %u chunks of %s in flight need more than 4G of "
                              "buffers; accepted: --chunk x --depth at most 4G",
                         o->depth, o->depth, ferry__size_str(top, ch, sizeof ch));
    if (o->plot && !o->sweep)
        return cli_usage(CMD, "--plot %s: needs --sweep", o->plot);
    if (create && !o->dir)
        return cli_usage(CMD, "--create: it makes the --dir directory, and no --dir "
                              "was given; accepted: --dir DIR --create");
    if (!o->dir)
        o->dir = getenv("TMPDIR") && *getenv("TMPDIR") ? getenv("TMPDIR") : "/var/tmp";
    return cli_opt_dir(CMD, "--dir", o->dir, create);
}

int cmd_bench_io(int argc, char **argv)
{
    opts o = {"auto", NULL, NULL, NULL, (uint64_t)8 << 20, (uint64_t)2 << 30, 8, 0, 0};
    int create = 0, chunk_given = 0, prc = parse(argc, argv, &o, &create, &chunk_given);
    if (prc)
        return prc < 0 ? 0 : prc;
    if ((prc = check(&o, create, chunk_given)) != 0)
        return prc;
    const char *all[] = {"posix", "uring", "cufile"};
    const char *one[1] = {o.engine};
    const char **engines = one;
    size_t ne = 1;
    if (!strcmp(o.engine, "all")) {
        engines = all;
        ne = 3;
    }
    size_t chunks[16], nc = 0;
    if (o.sweep) {
        for (size_t c = (size_t)64 << 10; c <= ((size_t)64 << 20); c <<= 1)
            if (c <= o.size)
                chunks[nc++] = c;
    } else
        chunks[nc++] = (size_t)o.chunk;
    result *res = calloc(ne * nc, sizeof *res);
    if (!res)
        return cli_fail(CMD, "allocating results", -ENOMEM);
    char fsz[32];
    if (!o.json)
        printf("ferry bench io: %s file in %s, depth %u%s%s\n",
               ferry__size_str(o.size, fsz, sizeof fsz), o.dir, o.depth,
               o.device ? ", device " : ", host buffers", o.device ? o.device : "");
    /* one document in all: several runs are collected into a list */
    int many = o.sweep || ne > 1;
    json_t *list = o.json && many ? json_array() : NULL;
    size_t n = 0;
    int failures = 0, ok = 0;
    for (size_t e = 0; e < ne; e++)
        for (size_t c = 0; c < nc; c++) {
            int rc = bench_one(engines[e], &o, chunks[c], &res[n]);
            print_result(&res[n], &o, list);
            n++;
            /* an engine that cannot work here is reported once, not fatal
             * under "all"; the rest of its sweep is skipped */
            if (rc < 0) {
                failures++;
                break;
            }
            ok++;
        }
    int st = ok ? 0 : 1;
    if (failures && ne == 1)
        st = 1;
    if (st && !o.json)
        for (size_t i = 0; i < n; i++)
            if (res[i].rc < 0)
                fprintf(stderr, "ferry %s: %s: %s\n", CMD, res[i].engine,
                        res[i].note[0] ? res[i].note : ferry_strerror(res[i].rc));
    int plotted = 0;
    if (o.plot && ok) {
        int rc = plot(o.plot, res, n);
        if (rc < 0) {
            fprintf(stderr, "ferry bench io: gnuplot failed to draw %s\n", o.plot);
            st = 1;
        } else if (!o.json)
            printf("plot: %s\n", o.plot);
        else
            plotted = 1;
    }
    if (list) {
        json_t *j = json_pack("{s:I, s:I, s:o}", "file_bytes", (json_int_t)o.size, "depth",
                              (json_int_t)o.depth, "results", list);
        if (o.device)
            json_object_set_new(j, "device", json_string(o.device));
        if (plotted)
            json_object_set_new(j, "plot", json_string(o.plot));
        char *s = json_dumps(j, JSON_COMPACT);
        printf("%s\n", s ? s : "{}");
        free(s);
        json_decref(j);
    }
    free(res);
    return st;
}
