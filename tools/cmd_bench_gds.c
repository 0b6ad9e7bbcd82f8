/*
 * cmd_bench_gds.c - `ferry bench gds`: store and load N chunks of a KV
 * layout through the GDS context, and in the same run the two references
 * its figures are judged against.
 *
 *  1. The context: allocate N extents of one chunk (Llama-3-8B: 32 MiB per
 *     256 tokens) from the context's slab, store each chunk (host buffers
 *     through the drive queues, or --device buffers through registered
 *     regions and the driver), then load each back; GB/s and p50/p99
 *     latency per chunk, the driver and engine in use.
 *  2. `ferry bench io`'s measurement with the same engine, chunk size and
 *     depth: `depth` chunk requests in flight on each drive's file - the
 *     context's own slab files, opened a second time, so that both sides
 *     move the same blocks; the ratio context / io says what the context's
 *     bookkeeping costs.
 *  3. The allocator: allocate and free on a slab of 100,000 chunks (half
 *     full, extents of 1..4 chunks, random order); operations per second
 *     and the fragmentation figure afterwards.
 *
 * Both files are written once untimed first (unwritten extents). Each
 * timed context phase is followed at once by the same reference phase, so
 * drive and machine state drifts hit both; the medians are reported. Loaded bytes are checked against what
 * was stored (a wrong byte fails the command).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <jansson.h>

#include "cli.h"

#define CMD "bench gds"
#define MAX_DIRS 16
#define MAX_ROUNDS 15

typedef struct phase {
    double gbps, p50_ms, p99_ms, secs;
} phase;

typedef struct gopts {
    const char *dirs[MAX_DIRS];
    unsigned ndirs;
    uint64_t chunk, size, stripe;
    unsigned depth, rounds;
    const char *driver, *engine, *device;
    uint64_t alloc_chunks, alloc_ops;
    int json, no_ref;
} gopts;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* this thread's CPU time: the allocator's figure holds on a busy machine too */
static double thread_cpu_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void finish(phase *p, double *lat, size_t n, uint64_t bytes, double secs)
{
    qsort(lat, n, sizeof *lat, cli_cmp_double);
    p->secs = secs;
    p->gbps = secs > 0 ? (double)bytes / secs / 1e9 : 0;
    p->p50_ms = n ? lat[(n - 1) / 2] * 1e3 : 0;
    p->p99_ms = n ? lat[(size_t)((double)(n - 1) * 0.99)] * 1e3 : 0;
}

/* ---- 1. the context ---- */
typedef struct ctx_run {
    ferry_gds *g;
    ferry_device *dev;
    ferry_devptr dbuf;  /* device mode: one chunk, registered */
    unsigned char *hbuf; /* host mode: one chunk, 4 KiB aligned */
    ferry_extent *ext;
    uint64_t n;
    unsigned inflight; /* chunk requests in flight: depth per drive, as the reference */
} ctx_run;

static void stamp(unsigned char *p, size_t len, uint64_t k)
{
    /* the chunk's number at both ends: cheap (touching every page of a
     * chunk between two submissions cost more than the I/O's refill gap
     * allows), and a swapped or misplaced chunk still shows */
    memcpy(p, &k, sizeof k);
    memcpy(p + len - sizeof k, &k, sizeof k);
}

/* device buffers: one chunk at a time through the registered region */
static int ctx_phase_dev(ctx_run *r, const gopts *o, int dir, phase *out)
{
    double *lat = malloc(r->n * sizeof *lat);
    if (!lat)
        return -ENOMEM;
    int rc = 0;
    double t0 = now_s();
    for (uint64_t k = 0; k < r->n && rc == 0; k++) {
        double t = now_s();
        rc = ferry_gds_extent_transfer(r->g, dir, &r->ext[k], r->dbuf, NULL);
        lat[k] = now_s() - t;
        cli_progress(dir == FERRY_GDS_WRITE ? "gds store" : "gds load", k + 1, r->n);
    }
    double secs = now_s() - t0;
    cli_progress_end();
    if (rc == 0)
        finish(out, lat, (size_t)r->n, r->n * o->chunk, secs);
    free(lat);
    return rc;
}

/* host buffers: `depth` chunk requests in flight, as bench io keeps them */
static int ctx_phase(ctx_run *r, const gopts *o, int dir, int verify, phase *out)
{
    if (r->dev)
        return ctx_phase_dev(r, o, dir, out);
    size_t chunk = (size_t)o->chunk;
    unsigned depth = r->inflight;
    double *lat = malloc(r->n * sizeof *lat);
    ferry_gds_req *rq = calloc(depth, sizeof *rq);
    double *tsub = calloc(depth, sizeof *tsub);
    uint64_t *which = calloc(depth, sizeof *which);
    if (!lat || !rq || !tsub || !which) {
        free(lat);
        free(rq);
        free(tsub);
        free(which);
        return -ENOMEM;
    }
    uint64_t next = 0, ndone = 0;
    unsigned char busy[64] = {0};
    int rc = 0;
    double t0 = now_s();
    while (ndone < r->n && rc == 0) {
        ferry_gds_req *ptrs[64];
        unsigned n = 0;
        for (unsigned sl = 0; sl < depth && next < r->n; sl++) {
            if (busy[sl])
                continue;
            unsigned char *b = r->hbuf + (size_t)sl * chunk;
            if (dir == FERRY_GDS_WRITE)
                stamp(b, chunk, next);
            rq[sl] = (ferry_gds_req){dir, b, chunk, r->ext[next].offset,
                                     (void *)(uintptr_t)sl, 0, NULL};
            which[sl] = next++;
            tsub[sl] = now_s();
            busy[sl] = 1;
            ptrs[n++] = &rq[sl];
        }
        if (n && ferry_gds_submit(r->g, ptrs, n) != (int)n) {
            rc = FERRY_EDRIVER;
            break;
        }
        ferry_gds_req *done[64];
        int k = ferry_gds_reap(r->g, done, 1, depth, -1);
        if (k < 0) {
            rc = k;
            break;
        }
        double tr = now_s();
        for (int i = 0; i < k; i++) {
            unsigned sl = (unsigned)(uintptr_t)done[i]->user;
            if (done[i]->result < 0 && rc == 0)
                rc = done[i]->result;
            if (dir == FERRY_GDS_READ && verify && rc == 0) {
                uint64_t got, got2;
                memcpy(&got, done[i]->buf, sizeof got);
                memcpy(&got2, (unsigned char *)done[i]->buf + chunk - sizeof got2, sizeof got2);
                if (got != which[sl] || got2 != which[sl]) {
                    fprintf(stderr, "ferry %s: chunk %llu read back as chunk %llu\n", CMD,
                            (unsigned long long)which[sl], (unsigned long long)got);
                    rc = FERRY_ECORRUPT;
                }
            }
            lat[ndone++] = tr - tsub[sl];
            busy[sl] = 0;
        }
        cli_progress(dir == FERRY_GDS_WRITE ? "gds store" : "gds load", ndone, r->n);
    }
    double secs = now_s() - t0;
    cli_progress_end();
    /* collect what is still in flight after an error */
    ferry_gds_req *rest[64];
    while (ferry_gds_reap(r->g, rest, 1, 64, -1) > 0)
        ;
    if (rc == 0)
        finish(out, lat, (size_t)r->n, r->n * chunk, secs);
    free(lat);
    free(rq);
    free(tsub);
    free(which);
    return rc;
}

/* ---- 2. the reference: bench io's loop, depth chunks in flight per file ---- */
typedef struct ref_run {
    ferry_io *io[MAX_DIRS];
    ferry_file *f[MAX_DIRS];
    unsigned char *buf; /* depth chunks */
    uint64_t per_file;  /* chunks per file */
} ref_run;

static int ref_phase(ref_run *r, const gopts *o, int op, phase *out)
{
    size_t chunk = (size_t)o->chunk;
    unsigned depth = o->depth, nd = o->ndirs;
    uint64_t total = r->per_file * nd;
    double *lat = malloc(total * sizeof *lat);
    ferry_io_req *reqs = calloc((size_t)depth * nd, sizeof *reqs);
    double *tsub = calloc((size_t)depth * nd, sizeof *tsub);
    if (!lat || !reqs || !tsub) {
        free(lat);
        free(reqs);
        free(tsub);
        return -ENOMEM;
    }
    uint64_t next[MAX_DIRS] = {0}, ndone = 0;
    unsigned busy[MAX_DIRS] = {0};
    int rc = 0;
    double t0 = now_s();
    /* every file gets depth requests, then each completion is refilled */
    while (ndone < total && rc == 0) {
        for (unsigned d = 0; d < nd && rc == 0; d++) {
            ferry_io_req *ptrs[64];
            unsigned n = 0;
            for (unsigned s = 0; s < depth && next[d] < r->per_file; s++) {
                ferry_io_req *q = &reqs[d * depth + s];
                if (q->user) /* in flight */
                    continue;
                memset(q, 0, sizeof *q);
                q->op = op;
                q->file = r->f[d];
                q->buf = r->buf + (size_t)s * chunk;
                q->len = chunk;
                q->offset = next[d]++ * chunk;
                q->user = (void *)1;
                tsub[d * depth + s] = now_s();
                ptrs[n++] = q;
            }
            if (n) {
                int k = ferry_io_submit(r->io[d], ptrs, n);
                if (k != (int)n)
                    rc = k < 0 ? k : -EAGAIN;
                busy[d] += n;
            }
        }
        for (unsigned d = 0; d < nd && rc == 0; d++) {
            if (!busy[d])
                continue;
            ferry_io_req *done[64];
            int k = ferry_io_reap(r->io[d], done, 1, depth, d + 1 == nd ? -1 : 0);
            if (k < 0) {
                rc = k;
                break;
            }
            double tr = now_s();
            for (int i = 0; i < k; i++) {
                if (done[i]->result != (int64_t)done[i]->len)
                    rc = done[i]->result < 0 ? (int)done[i]->result : -EIO;
                lat[ndone++] = tr - tsub[done[i] - reqs];
                done[i]->user = NULL;
            }
            busy[d] -= (unsigned)k;
        }
        cli_progress(op == FERRY_IO_WRITE ? "io write" : "io read", ndone, total);
    }
    double secs = now_s() - t0;
    cli_progress_end();
    for (unsigned d = 0; d < nd; d++)
        while (ferry_io_inflight(r->io[d])) {
            ferry_io_req *done[64];
            if (ferry_io_reap(r->io[d], done, 1, 64, -1) < 0)
                break;
        }
    if (rc == 0)
        finish(out, lat, (size_t)total, total * chunk, secs);
    free(lat);
    free(reqs);
    free(tsub);
    return rc;
}

static int ref_open(ref_run *r, const gopts *o, const char *engine)
{
    memset(r, 0, sizeof *r);
    /* the context's own slab files, so both sides move the same blocks of
     * the same files (a virtual disk is not equally fast everywhere) */
    r->per_file = o->size / o->ndirs / o->chunk;
    if (!r->per_file)
        r->per_file = 1;
    for (unsigned d = 0; d < o->ndirs; d++) {
        ferry_io_options io = FERRY_IO_OPTIONS_INIT;
        io.engine = engine;
        io.depth = o->depth;
        int rc = ferry_io_open(&io, &r->io[d]);
        if (rc < 0)
            return rc;
        char p[4096];
        snprintf(p, sizeof p, "%s/%s", o->dirs[d], FERRY_GDS_SLAB_NAME);
        rc = ferry_file_open(r->io[d], p, FERRY_FILE_READ | FERRY_FILE_WRITE | FERRY_FILE_DIRECT,
                             &r->f[d]);
        if (rc < 0)
            return rc;
        uint64_t fsz = 0;
        if ((rc = ferry_file_size(r->f[d], &fsz)) < 0)
            return rc;
        if (fsz < r->per_file * o->chunk)
            r->per_file = fsz / o->chunk;
    }
    if (!r->per_file)
        return -EINVAL;
    return ferry_io_buffer_alloc(r->io[0], (size_t)o->chunk * o->depth, (void **)&r->buf);
}

static void ref_close(ref_run *r, const gopts *o)
{
    if (r->buf)
        ferry_io_buffer_free(r->io[0], r->buf);
    for (unsigned d = 0; d < o->ndirs; d++) {
        ferry_file_close(r->f[d]);
        ferry_io_close(r->io[d]);
    }
}

/* ---- 3. the allocator ---- */
typedef struct alloc_res {
    double ops_per_s, ops_per_cpu_s, fragmentation;
    uint64_t ops, free_blocks, used_blocks;
} alloc_res;

static int bench_alloc(const gopts *o, alloc_res *out)
{
    ferry_slab_options so = FERRY_SLAB_OPTIONS_INIT;
    so.capacity = o->alloc_chunks * o->chunk;
    ferry_slab *s;
    int rc = ferry_slab_create(&so, &s);
    if (rc < 0)
        return rc;
    uint64_t cap = o->alloc_chunks; /* live extents never exceed the chunk count */
    ferry_extent *live = malloc(cap * sizeof *live);
    if (!live) {
        ferry_slab_destroy(s);
        return -ENOMEM;
    }
    uint64_t n = 0, x = 88172645463325252ull;
#define RND() (x ^= x << 13, x ^= x >> 7, x ^= x << 17, x)
    /* half full, extents of 1..4 chunks */
    while (rc >= 0) {
        ferry_slab_stats st = FERRY_SLAB_STATS_INIT;
        ferry_slab_stats_get(s, &st);
        if (st.usage >= 0.5)
            break;
        rc = ferry_slab_alloc_bytes(s, (1 + RND() % 4) * o->chunk, &live[n]);
        if (rc == 1)
            n++;
    }
    uint64_t ops = 0;
    double t0 = now_s(), c0 = thread_cpu_s();
    for (uint64_t i = 0; i < o->alloc_ops && rc >= 0; i++) {
        uint64_t k = RND() % n;
        if ((rc = ferry_slab_free(s, &live[k])) < 0)
            break;
        live[k] = live[--n];
        ops++;
        rc = ferry_slab_alloc_bytes(s, (1 + RND() % 4) * o->chunk, &live[n]);
        if (rc == 1)
            n++;
        else if (rc == FERRY_ENOSPACE)
            rc = 0;
        ops++;
    }
#undef RND
    double secs = now_s() - t0, cpu = thread_cpu_s() - c0;
    if (rc >= 0)
        rc = ferry_slab_check(s);
    ferry_slab_stats st = FERRY_SLAB_STATS_INIT;
    ferry_slab_stats_get(s, &st);
    out->ops = ops;
    out->ops_per_s = secs > 0 ? (double)ops / secs : 0;
    out->ops_per_cpu_s = cpu > 0 ? (double)ops / cpu : 0;
    out->fragmentation = st.fragmentation;
    out->free_blocks = st.free_blocks;
    out->used_blocks = st.used_blocks;
    free(live);
    ferry_slab_destroy(s);
    return rc < 0 ? rc : 0;
}

static void usage(FILE *f)
{
    fprintf(f,
            "usage: ferry bench gds [--dir DIR]... [--create] [--chunk 32M] [--size 1G] [--depth 8]\n"
            "                       [--stripe CHUNK] [--driver auto|cpu|cufile|hipfile]\n"
            "                       [--engine auto|posix|uring] [--device none|host|cuda]\n"
            "                       [--rounds 4] [--alloc-chunks 100000] [--alloc-ops 2000000]\n"
            "                       [--no-ref] [--json]\n"
            "Stores and loads size/chunk chunks through the GDS context (host buffers unless\n"
            "--device), runs `ferry bench io`'s loop with the same engine, chunk and depth for\n"
            "the ratio, and measures the slab allocator on a slab of --alloc-chunks chunks.\n"
            "  --dir DIR       up to %d existing directories (default $TMPDIR or /var/tmp);\n"
            "                  --create makes missing ones\n"
            "  --chunk         4K..1G, a multiple of 4K\n"
            "  --size          a multiple of --chunk, --chunk..16T\n"
            "  --stripe        4K..1G, a multiple of 4K (default: --chunk)\n"
            "  --depth 1..64  --rounds 1..%d  --alloc-chunks 16..10000000  --alloc-ops 1..10^10\n",
            MAX_DIRS, MAX_ROUNDS);
}

/* 0 to run, 2 on a usage error (printed), -1 after --help */
static int parse(int argc, char **argv, gopts *o, int *create)
{
    static const char *const drivers[] = {"auto", "cpu", "cufile", "hipfile", NULL};
    static const char *const engines[] = {"auto", "posix", "uring", NULL};
    static const char *const devices[] = {"none", "host", "cuda", NULL};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        uint64_t n = 0;
        int k = 0, rc = 0;
        if (!strcmp(a, "--json"))
            o->json = 1;
        else if (!strcmp(a, "--no-ref"))
            o->no_ref = 1;
        else if (!strcmp(a, "--create"))
            *create = 1;
        else if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return -1;
        } else if (!strcmp(a, "--dir")) {
            if (o->ndirs == MAX_DIRS) {
                char acc[48];
                snprintf(acc, sizeof acc, "at most %d --dir", MAX_DIRS);
                return cli_bad(CMD, a, v, acc, "one too many");
            }
            rc = cli_opt_string(CMD, a, v, "a directory", &o->dirs[o->ndirs]);
            if (rc == 0)
                o->ndirs++;
            i++;
        } else if (!strcmp(a, "--chunk")) {
            rc = cli_opt_size(CMD, a, v, 4096, 1ull << 30, 4096, &o->chunk);
            i++;
        } else if (!strcmp(a, "--stripe")) {
            rc = cli_opt_size(CMD, a, v, 4096, 1ull << 30, 4096, &o->stripe);
            i++;
        } else if (!strcmp(a, "--size")) {
            rc = cli_opt_size(CMD, a, v, 4096, 16ull << 40, 4096, &o->size);
            i++;
        } else if (!strcmp(a, "--depth")) {
            if ((rc = cli_opt_count(CMD, a, v, 1, 64, &n)) == 0)
                o->depth = (unsigned)n;
            i++;
        } else if (!strcmp(a, "--rounds")) {
            if ((rc = cli_opt_count(CMD, a, v, 1, MAX_ROUNDS, &n)) == 0)
                o->rounds = (unsigned)n;
            i++;
        } else if (!strcmp(a, "--alloc-chunks")) {
            /* below 16 the half-full slab cannot take the 1..4-chunk extents */
            rc = cli_opt_count(CMD, a, v, 16, 10000000, &o->alloc_chunks);
            i++;
        } else if (!strcmp(a, "--alloc-ops")) {
            rc = cli_opt_count(CMD, a, v, 1, 10000000000ull, &o->alloc_ops);
            i++;
        } else if (!strcmp(a, "--driver")) {
            if ((rc = cli_opt_choice(CMD, a, v, drivers, &k)) == 0)
                o->driver = drivers[k];
            i++;
        } else if (!strcmp(a, "--engine")) {
            if ((rc = cli_opt_choice(CMD, a, v, engines, &k)) == 0)
                o->engine = engines[k];
            i++;
        } else if (!strcmp(a, "--device")) {
            if ((rc = cli_opt_choice(CMD, a, v, devices, &k)) == 0)
                o->device = devices[k];
            i++;
        } else
            return cli_unknown(CMD, a);
        if (rc)
            return rc;
    }
    return 0;
}

/* what no single option shows: sizes against each other, the directories */
static int check(gopts *o, int create)
{
    char c1[32], c2[32];
    if (o->size < o->chunk)
        return cli_usage(CMD, "--size %s: smaller than --chunk %s; accepted: a multiple of "
                              "--chunk, at least one chunk", ferry__size_str(o->size, c1, sizeof c1),
                         ferry__size_str(o->chunk, c2, sizeof c2));
    if (o->size % o->chunk)
        return cli_usage(CMD, "--size %s: not a multiple of --chunk %s; accepted: a multiple of "
                              "--chunk", ferry__size_str(o->size, c1, sizeof c1),
                         ferry__size_str(o->chunk, c2, sizeof c2));
    if (create && !o->ndirs)
        return cli_usage(CMD, "--create: it makes the --dir directory, and no --dir "
                              "was given; accepted: --dir DIR --create");
    if (!o->ndirs)
        o->dirs[o->ndirs++] = getenv("TMPDIR") && *getenv("TMPDIR") ? getenv("TMPDIR") : "/var/tmp";
    for (unsigned d = 0; d < o->ndirs; d++) {
        int rc = cli_opt_dir(CMD, "--dir", o->dirs[d], create);
        if (rc)
            return rc;
    }
    return 0;
}

/* one run: the context, its chunks and buffers, the reference, the figures */
typedef struct gds_bench {
    const gopts *o;
    ferry_device *dev;
    ferry_gds *g;
    ctx_run cr;
    ref_run rr;
    int have_ref;
    phase pw, pr, qw, qr; /* the last round's store, load, and the reference's */
    double m_sw, m_sr, m_iw, m_ir, ratio_w, ratio_r; /* medians over the rounds */
    alloc_res ar;
} gds_bench;

/* the device, the context, the chunks' extents and buffers, the reference:
 * 0, or the exit status (printed) */
static int setup(gds_bench *b)
{
    const gopts *o = b->o;
    ctx_run *cr = &b->cr;
    int rc;
    if (strcmp(o->device, "none")) {
        ferry_device_options dopt = FERRY_DEVICE_OPTIONS_INIT;
        dopt.backend = o->device;
        if ((rc = ferry_device_open(&dopt, &b->dev)) < 0)
            return cli_fail(CMD, "open device", rc);
    }
    ferry_gds_config c = FERRY_GDS_CONFIG_INIT;
    c.dirs = o->dirs;
    c.n_dirs = o->ndirs;
    c.bytes = o->size;
    c.driver = o->driver;
    c.engine = o->engine;
    c.depth = o->depth;
    c.device = b->dev;
    /* per-chunk striping unless told: each chunk one request to one drive,
     * the drives kept busy by the chunks in flight (as the reference) */
    c.stripe_bytes = o->stripe ? o->stripe : o->chunk;
    if ((rc = ferry_gds_open(&c, &b->g)) < 0)
        return cli_fail(CMD, "open the GDS context", rc);
    cr->g = b->g;
    cr->dev = b->dev;
    cr->n = o->size / o->chunk;
    /* the reference keeps depth chunks in flight on each drive's file: so
     * does the context, over all drives (at most 1 GiB of buffers) */
    cr->inflight = o->depth * o->ndirs;
    if (cr->inflight > 64)
        cr->inflight = 64;
    while (cr->inflight > 1 && (uint64_t)cr->inflight * o->chunk > (1ull << 30))
        cr->inflight--;
    cr->ext = calloc(cr->n, sizeof *cr->ext);
    if (!cr->ext)
        return cli_fail(CMD, "allocate", -ENOMEM);
    ferry_shape sh = {1, {o->chunk}};
    int u8 = FERRY_DTYPE_U8;
    ferry_layout lay = {1, &sh, 1, &u8};
    if ((rc = ferry_slab_alloc(ferry_gds_slab(b->g), &lay, (unsigned)cr->n, cr->ext)) < 0)
        return cli_fail(CMD, "allocate the chunks' extents", rc);
    if (b->dev) {
        if ((rc = ferry_device_alloc(b->dev, (size_t)o->chunk, &cr->dbuf)) < 0 ||
            (rc = ferry_device_memset(b->dev, cr->dbuf, 0x5A, (size_t)o->chunk)) < 0 ||
            (rc = ferry_gds_register(b->g, cr->dbuf, (size_t)o->chunk, NULL)) < 0)
            return cli_fail(CMD, "device buffer", rc);
    } else if ((rc = ferry_gds_buffer_alloc(b->g, (size_t)o->chunk * cr->inflight,
                                            (void **)&cr->hbuf)) < 0) {
        return cli_fail(CMD, "allocate the chunk buffers", rc);
    }
    if (!o->no_ref && !b->dev) {
        if ((rc = ref_open(&b->rr, o, ferry_gds_engine(b->g))) < 0)
            return cli_fail(CMD, "open the bench io reference", rc);
        b->have_ref = 1;
    }
    return 0;
}

/* one round: store then load, each back to back with the reference's
 * write or read, the order swapped every round (the drive, or a virtual
 * disk's host cache, favours whichever side wrote or read last) */
static int round_run(gds_bench *b, unsigned r)
{
    int ref_first = b->have_ref && (r % 2);
    for (int ph = 0; ph < 2; ph++) {
        int gdir = ph == 0 ? FERRY_GDS_WRITE : FERRY_GDS_READ;
        int iop = ph == 0 ? FERRY_IO_WRITE : FERRY_IO_READ;
        phase *pg = ph == 0 ? &b->pw : &b->pr, *pi = ph == 0 ? &b->qw : &b->qr;
        for (int side = 0; side < 2; side++) {
            int ref_now = side == 0 ? ref_first : !ref_first;
            if (ref_now && !b->have_ref)
                continue;
            /* the reference writes the same files: the loaded chunks are
             * checked only when the context's store was the last write */
            int rc = ref_now ? ref_phase(&b->rr, b->o, iop, pi)
                             : ctx_phase(&b->cr, b->o, gdir, !b->have_ref || ref_first, pg);
            if (rc < 0)
                return cli_fail(CMD, ref_now ? "bench io reference" : "through the context", rc);
        }
    }
    return 0;
}

/* a warm-up, the rounds, the allocator: 0, or the exit status (printed) */
static int measure(gds_bench *b)
{
    const gopts *o = b->o;
    int rc;
    /* warm-up, untimed: the first write into preallocated space converts
     * the file system's unwritten extents, which neither side should pay */
    if ((rc = ctx_phase(&b->cr, o, FERRY_GDS_WRITE, 0, &b->pw)) < 0 ||
        (b->have_ref && (rc = ref_phase(&b->rr, o, FERRY_IO_WRITE, &b->qw)) < 0))
        return cli_fail(CMD, "warm-up write", rc);
    /* the ratio is the median of the rounds' own ratios */
    double sw[MAX_ROUNDS], sr[MAX_ROUNDS], iw[MAX_ROUNDS], ir[MAX_ROUNDS];
    double rw[MAX_ROUNDS], rr_[MAX_ROUNDS];
    for (unsigned r = 0; r < o->rounds; r++) {
        if ((rc = round_run(b, r)) != 0)
            return rc;
        sw[r] = b->pw.gbps;
        sr[r] = b->pr.gbps;
        iw[r] = b->have_ref ? b->qw.gbps : 0;
        ir[r] = b->have_ref ? b->qr.gbps : 0;
        rw[r] = iw[r] > 0 ? sw[r] / iw[r] : 0;
        rr_[r] = ir[r] > 0 ? sr[r] / ir[r] : 0;
    }
    b->ratio_w = cli_median(rw, o->rounds);
    b->ratio_r = cli_median(rr_, o->rounds);
    b->m_sw = cli_median(sw, o->rounds);
    b->m_sr = cli_median(sr, o->rounds);
    b->m_iw = b->have_ref ? cli_median(iw, o->rounds) : 0;
    b->m_ir = b->have_ref ? cli_median(ir, o->rounds) : 0;
    if ((rc = bench_alloc(o, &b->ar)) < 0)
        return cli_fail(CMD, "allocator benchmark", rc);
    return 0;
}

static void report_json(const gds_bench *b)
{
    const gopts *o = b->o;
    const alloc_res *ar = &b->ar;
    const char *fb = ferry_gds_fallback_reason(b->g);
    json_t *root = json_object();
    json_object_set_new(root, "driver", json_string(ferry_gds_driver_name(b->g)));
    json_object_set_new(root, "engine", json_string(ferry_gds_engine(b->g)));
    json_object_set_new(root, "drives", json_integer(o->ndirs));
    json_object_set_new(root, "buffers", json_string(b->dev ? "device" : "host"));
    json_object_set_new(root, "device", json_string(b->dev ? o->device : "none"));
    json_object_set_new(root, "chunk_bytes", json_integer((json_int_t)o->chunk));
    json_object_set_new(root, "chunks", json_integer((json_int_t)b->cr.n));
    json_object_set_new(root, "depth", json_integer(o->depth));
    json_object_set_new(root, "stripe_bytes", json_integer((json_int_t)(o->stripe ? o->stripe : o->chunk)));
    json_object_set_new(root, "rounds", json_integer(o->rounds));
    json_object_set_new(root, "fallback", fb ? json_string(fb) : json_null());
    json_t *js = json_pack("{s:f, s:f, s:f}", "gb_per_s", b->m_sw, "p50_ms", b->pw.p50_ms,
                           "p99_ms", b->pw.p99_ms);
    json_t *jl = json_pack("{s:f, s:f, s:f}", "gb_per_s", b->m_sr, "p50_ms", b->pr.p50_ms,
                           "p99_ms", b->pr.p99_ms);
    json_object_set_new(root, "store", js);
    json_object_set_new(root, "load", jl);
    if (b->have_ref) {
        json_object_set_new(root, "io_ref",
                            json_pack("{s:f, s:f}", "write_gb_per_s", b->m_iw, "read_gb_per_s",
                                      b->m_ir));
        json_object_set_new(root, "ratio",
                            json_pack("{s:f, s:f}", "store", b->ratio_w, "load", b->ratio_r));
    }
    json_object_set_new(root, "alloc",
                        json_pack("{s:I, s:I, s:f, s:f, s:f, s:I}", "slab_chunks",
                                  (json_int_t)o->alloc_chunks, "ops", (json_int_t)ar->ops,
                                  "ops_per_s", ar->ops_per_s, "ops_per_cpu_s", ar->ops_per_cpu_s,
                                  "fragmentation", ar->fragmentation, "free_blocks",
                                  (json_int_t)ar->free_blocks));
    char *str = json_dumps(root, JSON_INDENT(2));
    printf("%s\n", str);
    free(str);
    json_decref(root);
}

static void report_text(const gds_bench *b)
{
    const gopts *o = b->o;
    const alloc_res *ar = &b->ar;
    const char *fb = ferry_gds_fallback_reason(b->g);
    ferry_gds_stats gst = FERRY_GDS_STATS_INIT;
    ferry_gds_stats_get(b->g, &gst);
    printf("ferry bench gds: driver %s, engine %s, %u drive(s), %s buffers, chunk %llu KiB "
           "x %llu, depth %u per drive, %u round(s)\n",
           ferry_gds_driver_name(b->g), ferry_gds_engine(b->g), o->ndirs,
           b->dev ? (strcmp(o->device, "host") ? "device" : "device (host backend)") : "host",
           (unsigned long long)(o->chunk >> 10), (unsigned long long)b->cr.n, o->depth,
           o->rounds);
    if (fb)
        printf("  fallback: %s\n", fb);
    printf("  store  %7.2f GB/s   p50 %8.2f ms   p99 %8.2f ms\n", b->m_sw, b->pw.p50_ms,
           b->pw.p99_ms);
    printf("  load   %7.2f GB/s   p50 %8.2f ms   p99 %8.2f ms\n", b->m_sr, b->pr.p50_ms,
           b->pr.p99_ms);
    if (b->have_ref) {
        printf("  bench io (%s, same chunk and depth): write %.2f GB/s, read %.2f GB/s\n",
               ferry_gds_engine(b->g), b->m_iw, b->m_ir);
        printf("  ratio  store %.3fx   load %.3fx   (median of the rounds' ratios)\n", b->ratio_w,
               b->ratio_r);
    }
    printf("  allocator: slab of %llu chunks, %llu alloc+free ops: %.2f M ops/s wall, %.2f M "
           "ops per CPU second, %llu free blocks, fragmentation %.3f\n",
           (unsigned long long)o->alloc_chunks, (unsigned long long)ar->ops, ar->ops_per_s / 1e6,
           ar->ops_per_cpu_s / 1e6, (unsigned long long)ar->free_blocks, ar->fragmentation);
    printf("  context: %llu driver I/Os, %llu engine I/Os\n", (unsigned long long)gst.driver_ios,
           (unsigned long long)gst.engine_ios);
}

static void teardown(gds_bench *b)
{
    const gopts *o = b->o;
    ctx_run *cr = &b->cr;
    if (b->have_ref || b->rr.io[0])
        ref_close(&b->rr, o);
    if (b->g && cr->dbuf)
        ferry_gds_deregister(b->g, cr->dbuf);
    if (cr->hbuf)
        ferry_gds_buffer_free(b->g, cr->hbuf);
    ferry_gds_close(b->g);
    if (b->dev && cr->dbuf)
        ferry_device_free(b->dev, cr->dbuf);
    ferry_device_close(b->dev);
    free(cr->ext);
    /* the slab files stay for a next run to truncate; remove them here */
    for (unsigned d = 0; d < o->ndirs; d++) {
        char p[4096];
        snprintf(p, sizeof p, "%s/%s", o->dirs[d], FERRY_GDS_SLAB_NAME);
        remove(p);
    }
}

int cmd_bench_gds(int argc, char **argv)
{
    gopts o = {0};
    o.chunk = 32u << 20;
    o.size = 1ull << 30;
    o.depth = 8;
    o.rounds = 4;
    o.alloc_chunks = 100000;
    o.alloc_ops = 2000000;
    o.device = "none";
    int create = 0, rc = parse(argc, argv, &o, &create);
    if (rc)
        return rc < 0 ? 0 : rc;
    if ((rc = check(&o, create)) != 0)
        return rc;
    gds_bench b;
    memset(&b, 0, sizeof b);
    b.o = &o;
    rc = setup(&b);
    if (rc == 0)
        rc = measure(&b);
    if (rc == 0) {
        if (o.json)
            report_json(&b);
        else
            report_text(&b);
    }
    teardown(&b);
    return rc;
}
