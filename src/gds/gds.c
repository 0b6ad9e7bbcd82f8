/*
 * gds.c - the GDS context: slab files, region registry, streams, transfers.
 *
 * Invariants:
 *  - Off until ferry_gds_init succeeds; while off, register/deregister
 *    return 0 without a single driver call (LMCache's no-op contract).
 *  - regions[] is sorted by base, regions never overlap, each is at most
 *    region_cap bytes, and the regions of one buffer are adjacent in the
 *    array (they tile [buf, buf+len)). A lookup is one binary search.
 *  - A stream is registered with the driver exactly while at least one
 *    region names it: the first region on a stream registers it, the last
 *    one to go deregisters it.
 *  - The driver always receives a region's base plus an offset, never an
 *    interior pointer: cuFile resolves a buffer by its registered base, and
 *    an interior pointer silently takes the slow unregistered path.
 *  - Every async submission's argument block (size, file offset, buffer
 *    offset, bytes done) stays alive until a checkpoint event recorded
 *    after it has completed: cuFile reads those through pointers when the
 *    stream reaches the op, long after the call returned. One event per 64
 *    submissions keeps the event count low; a batch is freed when its
 *    event completes (polled at each submission) or at a stream sync.
 *  - Everything a call may need to allocate is allocated before its first
 *    driver call, and a driver failure undoes what the call registered, so
 *    a failure never leaves a half-registered buffer behind.
 *
 * Ownership: each drive's directory is locked (core/dirlock.c) before its
 * slab file is created or truncated, and stays locked until the drive is
 * closed: the truncation itself is what handed one opener's bytes to
 * another, so the lock must come first.
 *
 * Striping: slab offset o lives on drive (o / unit) % n at file offset
 * (o / unit / n) * unit + o % unit; with one drive the file offset is o and
 * nothing is split. Each drive has its own ferry_io queue and its own lock;
 * a transfer submits to every drive it touches before it waits on any, so
 * the drives work at once.
 */
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/types.h>

#include "core.h"
#include "dirlock.h"
#include "driver.h"
#include "ferry/gds.h"

/* a config from before `mode` ends where mode begins */
#define CFG_SIZE_V1 offsetof(ferry_gds_config, mode)

typedef struct drive {
    char *dir, *path;
    int lock_fd; /* the directory's lock (-1: none) */
    ferry_io *io;
    ferry_file *f;
    void *handle;
    int handle_ok;
    uint64_t bytes; /* this drive's share of the slab */
    pthread_mutex_t mu;
} drive;

typedef struct argblk {
    size_t size;
    int64_t file_off;
    int64_t buf_off;
    int64_t done;
    uint64_t slab_off;
    unsigned drive;
    int op;
} argblk;

typedef struct abatch {
    struct abatch *next;
    ferry_event *ev;
    unsigned n;
    argblk a[FERRY_GDS_CHECKPOINT_EVERY];
} abatch;

typedef struct gstream {
    struct gstream *next;
    ferry_stream *s;
    uint64_t raw;
    unsigned nregions;
    int registered;        /* with the driver */
    abatch *open;          /* filling; no event yet */
    abatch *head, *tail;   /* closed, each with its checkpoint event */
    int err;               /* first async failure not yet reported */
    char errmsg[320];
} gstream;

typedef struct region {
    ferry_devptr base;
    size_t len;
    ferry_devptr owner; /* the registered buffer's start */
    gstream *st;
} region;

typedef struct seg {
    unsigned drive;
    ferry_devptr base;
    int64_t buf_off;
    int64_t file_off;
    size_t size;
    uint64_t slab_off;
} seg;

struct ferry_gds {
    pthread_mutex_t mu;
    int on;
    ferry__errbuf err;
    ferry_gds_driver drv;
    ferry__gds_destroy_fn destroy;
    int drv_open;
    ferry_device *dev;
    drive drives[FERRY_GDS_MAX_DIRS];
    unsigned ndrives;
    uint64_t size;
    size_t align, cap, stripe;
    unsigned depth;
    char fallback[640];
    ferry_slab *slab;
    region *regions;
    size_t nreg, capreg;
    unsigned nbuffers;
    gstream *streams;
    unsigned nstreams;
    uint64_t async_pending; /* under mu */
    _Atomic uint64_t bytes_read, bytes_written, driver_ios, engine_ios, checkpoints;
    /* asynchronous host requests: completed ones wait here for ferry_gds_reap */
    pthread_mutex_t amu;
    struct hop *done_head, *done_tail;
    unsigned ndone;
    _Atomic unsigned async_hops; /* submitted and not yet reaped */
};

static const char *dirname_of(int dir)
{
    return dir == FERRY_GDS_READ ? "read" : "write";
}

/* ---- life ---- */

int ferry_gds_create(ferry_gds **out)
{
    if (!out)
        return ferry__err_set(NULL, -EINVAL, "gds: create: NULL out");
    ferry_gds *g = ferry__calloc(1, sizeof *g);
    if (!g)
        return ferry__err_set(NULL, -ENOMEM, "gds: out of memory creating the context");
    pthread_mutex_init(&g->mu, NULL);
    pthread_mutex_init(&g->amu, NULL);
    *out = g;
    return 0;
}

static uint64_t drive_share(uint64_t size, uint64_t unit, unsigned n, unsigned d)
{
    if (n == 1)
        return size;
    uint64_t full = size / unit, rem = size % unit;
    uint64_t b = (full / n + (d < full % n ? 1 : 0)) * unit;
    if (rem && d == full % n)
        b += rem;
    return b;
}

static void stripe_map(const ferry_gds *g, uint64_t o, unsigned *d, uint64_t *foff, uint64_t *run)
{
    if (g->ndrives == 1) {
        *d = 0;
        *foff = o;
        *run = UINT64_MAX;
        return;
    }
    uint64_t k = o / g->stripe, in = o % g->stripe;
    *d = (unsigned)(k % g->ndrives);
    *foff = (k / g->ndrives) * g->stripe + in;
    *run = g->stripe - in;
}

static void add_fallback(ferry_gds *g, const char *fmt, ...) FERRY__PRINTF(2, 3);
static void add_fallback(ferry_gds *g, const char *fmt, ...)
{
    size_t n = strlen(g->fallback);
    if (n + 4 >= sizeof g->fallback)
        return;
    if (n) {
        memcpy(g->fallback + n, "; ", 3);
        n += 2;
    }
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g->fallback + n, sizeof g->fallback - n, fmt, ap);
    va_end(ap);
}

/* open the driver named `name`; 0, or a code with the reason in why */
static int driver_pick(ferry_gds *g, const char *name, char *why, size_t why_len)
{
    int (*mk)(ferry_gds_driver *, ferry__gds_destroy_fn *) = NULL;
    if (!strcmp(name, "cpu"))
        mk = ferry__gds_cpu_driver;
    else if (!strcmp(name, "cufile"))
        mk = ferry__gds_cufile_driver;
    else if (!strcmp(name, "hipfile"))
        mk = ferry__gds_hipfile_driver;
    else {
        snprintf(why, why_len, "unknown driver '%s' (auto|cufile|hipfile|cpu)", name);
        return -EINVAL;
    }
    ferry_gds_driver d;
    ferry__gds_destroy_fn destroy = NULL;
    int rc = mk(&d, &destroy);
    if (rc < 0) {
        snprintf(why, why_len, "%s", ferry_last_error());
        return rc;
    }
    rc = d.open ? d.open(d.ctx, g->dev) : 0;
    if (rc < 0) {
        snprintf(why, why_len, "%s", ferry_last_error());
        if (destroy)
            destroy(d.ctx);
        return rc;
    }
    g->drv = d;
    g->destroy = destroy;
    g->drv_open = 1;
    return 0;
}

static void driver_drop(ferry_gds *g)
{
    if (g->drv_open && g->drv.close)
        g->drv.close(g->drv.ctx);
    if (g->destroy)
        g->destroy(g->drv.ctx);
    g->drv_open = 0;
    g->destroy = NULL;
    memset(&g->drv, 0, sizeof g->drv);
}

static void drives_deregister(ferry_gds *g)
{
    for (unsigned i = 0; i < g->ndrives; i++)
        if (g->drives[i].handle_ok) {
            if (g->drv.handle_deregister)
                g->drv.handle_deregister(g->drv.ctx, g->drives[i].handle);
            g->drives[i].handle_ok = 0;
            g->drives[i].handle = NULL;
        }
}

static int drives_register(ferry_gds *g)
{
    for (unsigned i = 0; i < g->ndrives; i++) {
        drive *d = &g->drives[i];
        void *h = NULL;
        int rc = g->drv.handle_register ? g->drv.handle_register(g->drv.ctx, d->io, d->f, &h) : 0;
        if (rc < 0) {
            char m[FERRY__ERRMSG_MAX];
            snprintf(m, sizeof m, "%s", ferry_last_error());
            drives_deregister(g);
            return ferry__err_set(&g->err, rc, "gds: %s: registering %s with the %s driver: %s",
                                  d->dir, d->path, g->drv.name, m);
        }
        d->handle = h;
        d->handle_ok = 1;
    }
    return 0;
}

static void drives_close(ferry_gds *g)
{
    for (unsigned i = 0; i < g->ndrives; i++) {
        drive *d = &g->drives[i];
        ferry_file_close(d->f);
        ferry_io_close(d->io);
        ferry__dir_unlock(d->lock_fd); /* after the file: nobody may open it before */
        ferry__free(d->dir);
        ferry__free(d->path);
        pthread_mutex_destroy(&d->mu);
        memset(d, 0, sizeof *d);
    }
    g->ndrives = 0;
}

static int drive_open(ferry_gds *g, const ferry_gds_config *cfg, unsigned i, const char *engine)
{
    drive *d = &g->drives[i];
    const char *dir = cfg->dirs[i];
    int rc;
    d->lock_fd = -1;
    pthread_mutex_init(&d->mu, NULL);
    if ((rc = ferry__mkdir_p(dir, cfg->mode, 1, &g->err)) < 0) {
        char m[FERRY__ERRMSG_MAX];
        snprintf(m, sizeof m, "%s", ferry__err_msg(&g->err));
        return ferry__err_set(&g->err, rc, "gds: slab directory %s: %s", dir, m);
    }
    /* before the slab file is opened with O_TRUNC: truncating another
     * owner's slab is the very thing the lock prevents */
    if ((rc = ferry__dir_lock(dir, cfg->mode, 0, "gds", &g->err, &d->lock_fd)) < 0)
        return rc;
    size_t n = strlen(dir) + sizeof(FERRY_GDS_SLAB_NAME) + 2;
    d->dir = ferry__strdup(dir);
    d->path = ferry__malloc(n);
    if (!d->dir || !d->path)
        return ferry__err_set(&g->err, -ENOMEM, "gds: out of memory opening %s", dir);
    snprintf(d->path, n, "%s/%s", dir, FERRY_GDS_SLAB_NAME);
    ferry_io_options o = FERRY_IO_OPTIONS_INIT;
    o.engine = engine;
    o.depth = cfg->depth;
    o.device = g->dev;
    rc = ferry_io_open(&o, &d->io);
    int engine_auto = !cfg->engine || !*cfg->engine || !strcmp(cfg->engine, "auto");
    if (rc < 0 && !strcmp(engine, "uring") && engine_auto) {
        /* auto: io_uring refused here, the thread pool works everywhere */
        add_fallback(g, "uring refused (%s), using posix", ferry_last_error());
        o.engine = "posix";
        rc = ferry_io_open(&o, &d->io);
    }
    if (rc < 0)
        return ferry__err_pass(&g->err, rc);
    unsigned fl = FERRY_FILE_READ | FERRY_FILE_WRITE | FERRY_FILE_CREATE | FERRY_FILE_TRUNC;
    if (cfg->direct)
        fl |= FERRY_FILE_DIRECT;
    if ((rc = ferry_file_open_mode(d->io, d->path, fl, cfg->mode, &d->f)) < 0)
        return ferry__err_pass(&g->err, rc);
    const char *fb = ferry_file_fallback_reason(d->f);
    if (cfg->direct && fb) {
        add_fallback(g, "%s: O_DIRECT refused, buffered I/O: %s", d->path, fb);
        FERRY_LOGW("gds: %s: O_DIRECT refused by the file system, using buffered I/O: %s",
                   d->path, fb);
    }
    d->bytes = drive_share(g->size, g->stripe, g->ndrives, i);
    if ((rc = ferry_file_allocate(d->f, 0, d->bytes)) < 0) {
        char m[FERRY__ERRMSG_MAX];
        snprintf(m, sizeof m, "%s", ferry_last_error());
        return ferry__err_set(&g->err, rc,
                              "gds: slab of %llu bytes: reserving %llu bytes of %s failed "
                              "(%s): %s",
                              (unsigned long long)g->size, (unsigned long long)d->bytes, d->path,
                              rc == -ENOSPC ? "larger than the free disk" : ferry_strerror(rc),
                              m);
    }
    return 0;
}

/* every option in its range before any arithmetic on it; 0 or -EINVAL
 * naming the option and what it accepts */
static int config_check(ferry_gds *g, const ferry_gds_config *cfg)
{
    ferry__errbuf *eb = &g->err;
    if (!cfg->dirs || cfg->n_dirs == 0 || cfg->n_dirs > FERRY_GDS_MAX_DIRS)
        return ferry__err_set(eb, -EINVAL, "gds: n_dirs %u%s: accepted 1..%d directories",
                              cfg->n_dirs, cfg->dirs ? "" : " (dirs is NULL)",
                              FERRY_GDS_MAX_DIRS);
    for (unsigned i = 0; i < cfg->n_dirs; i++)
        if (!cfg->dirs[i] || !*cfg->dirs[i])
            return ferry__err_set(eb, -EINVAL, "gds: dirs[%u] is %s: every directory needs a name",
                                  i, cfg->dirs[i] ? "empty" : "NULL");
    if (cfg->bytes == 0 || cfg->bytes > FERRY_GDS_BYTES_MAX)
        return ferry__err_set(eb, -EINVAL, "gds: bytes %llu: accepted 1..%llu (2^62)",
                              (unsigned long long)cfg->bytes,
                              (unsigned long long)FERRY_GDS_BYTES_MAX);
    if (cfg->direct != 0 && cfg->direct != 1)
        return ferry__err_set(eb, -EINVAL, "gds: direct %d: accepted 0 (buffered) or 1 (O_DIRECT)",
                              cfg->direct);
    size_t align = cfg->alignment ? cfg->alignment : FERRY_GDS_ALIGN_DEFAULT;
    if (align < FERRY_IO_ALIGN || align > FERRY_GDS_ALIGN_MAX || (align & (align - 1)))
        return ferry__err_set(eb, -EINVAL,
                              "gds: alignment %zu: accepted 0 (4096) or a power of two from %u "
                              "to %u",
                              cfg->alignment, FERRY_IO_ALIGN, FERRY_GDS_ALIGN_MAX);
    if (cfg->region_cap &&
        (cfg->region_cap > FERRY_GDS_REGION_CAP_MAX || cfg->region_cap % align))
        return ferry__err_set(eb, -EINVAL,
                              "gds: region_cap %zu: accepted 0 (16 MiB) or a multiple of the "
                              "alignment %zu up to %zu",
                              cfg->region_cap, align, (size_t)FERRY_GDS_REGION_CAP_MAX);
    if (cfg->stripe_bytes &&
        (cfg->stripe_bytes > FERRY_GDS_STRIPE_MAX || cfg->stripe_bytes % align))
        return ferry__err_set(eb, -EINVAL,
                              "gds: stripe_bytes %zu: accepted 0 (4 MiB) or a multiple of the "
                              "alignment %zu up to %zu",
                              cfg->stripe_bytes, align, (size_t)FERRY_GDS_STRIPE_MAX);
    if (FERRY_GDS_REGION_CAP_DEFAULT % align && !cfg->region_cap)
        return ferry__err_set(eb, -EINVAL,
                              "gds: alignment %zu does not divide the default region_cap of "
                              "16 MiB: give a region_cap that it divides",
                              align);
    if (FERRY_GDS_STRIPE_DEFAULT % align && !cfg->stripe_bytes)
        return ferry__err_set(eb, -EINVAL,
                              "gds: alignment %zu does not divide the default stripe_bytes of "
                              "4 MiB: give a stripe_bytes that it divides",
                              align);
    if (cfg->depth > FERRY_IO_DEPTH_MAX)
        return ferry__err_set(eb, -EINVAL, "gds: depth %u: accepted 0 (8) or 1..%u", cfg->depth,
                              FERRY_IO_DEPTH_MAX);
    return ferry__mode_check(cfg->mode, "gds: mode", eb);
}

static int init_locked(ferry_gds *g, const ferry_gds_config *cfg)
{
    int rc = config_check(g, cfg);
    if (rc < 0)
        return rc;
    size_t align = cfg->alignment ? cfg->alignment : FERRY_GDS_ALIGN_DEFAULT;
    size_t cap = cfg->region_cap ? cfg->region_cap : FERRY_GDS_REGION_CAP_DEFAULT;
    size_t stripe = cfg->stripe_bytes ? cfg->stripe_bytes : FERRY_GDS_STRIPE_DEFAULT;
    const char *engine = cfg->engine && *cfg->engine && strcmp(cfg->engine, "auto") ? cfg->engine
                                                                                     : NULL;
    if (!engine) {
        /* auto: io_uring when the kernel allows it (FERRY_IO_ENGINE may force
         * posix); never the cufile engine, which would register the file
         * with cuFile a second time: the GDS driver owns that */
        const char *env = getenv("FERRY_IO_ENGINE");
        engine = env && !strcmp(env, "posix") ? "posix" : "uring";
    }
    if (!strcmp(engine, "cufile"))
        return ferry__err_set(&g->err, -EINVAL,
                              "gds: drive queues take posix or uring; choose cuFile with the "
                              "driver (driver=\"cufile\"), not the engine");
    g->dev = cfg->device;
    g->align = align;
    g->cap = cap;
    g->stripe = stripe;
    g->depth = cfg->depth ? cfg->depth : 8;
    g->size = FERRY__ALIGN_UP(cfg->bytes, (uint64_t)align);
    g->fallback[0] = 0;
    g->ndrives = cfg->n_dirs;

    /* the driver */
    char why[FERRY__ERRMSG_MAX];
    int auto_pick = 0;
    if (cfg->custom_driver) {
        const ferry_gds_driver *cd = cfg->custom_driver;
        if (cd->size < sizeof(ferry_gds_driver) || !cd->read || !cd->write)
            return ferry__err_set(&g->err, -EINVAL,
                                  "gds: custom driver '%s': short table or no read/write",
                                  cd->name ? cd->name : "?");
        g->drv = *cd;
        if (!g->drv.name)
            g->drv.name = "custom";
        rc = g->drv.open ? g->drv.open(g->drv.ctx, g->dev) : 0;
        if (rc < 0) {
            memset(&g->drv, 0, sizeof g->drv);
            return ferry__err_set(&g->err, rc, "gds: custom driver open failed: %s",
                                  ferry_last_error());
        }
        g->drv_open = 1;
    } else if (!cfg->driver || !*cfg->driver || !strcmp(cfg->driver, "auto")) {
        auto_pick = 1;
        const char *be = g->dev ? ferry_device_backend(g->dev) : "none";
        rc = -1;
        static const char *const tries[] = {"cufile", "hipfile"};
        int cuda = !strcmp(be, "cuda");
        if (cuda || ferry__gdsdl_test_override(tries[0]) || ferry__gdsdl_test_override(tries[1])) {
            for (size_t i = 0; i < 2 && rc < 0; i++) {
                if (!cuda && !ferry__gdsdl_test_override(tries[i]))
                    continue;
                rc = driver_pick(g, tries[i], why, sizeof why);
                if (rc < 0)
                    add_fallback(g, "%s driver: %s", tries[i], why);
            }
        } else {
            add_fallback(g, "GDS drivers not tried: device backend is %s, not cuda", be);
        }
        if (rc < 0 && (rc = driver_pick(g, "cpu", why, sizeof why)) < 0)
            return ferry__err_set(&g->err, rc, "gds: cpu driver: %s", why);
    } else if ((rc = driver_pick(g, cfg->driver, why, sizeof why)) < 0) {
        return ferry__err_set(&g->err, rc == -EINVAL ? rc : FERRY_ENODEV,
                              "gds: driver %s is not usable here: %s", cfg->driver, why);
    }

    /* the slab files, one per drive */
    unsigned opened = 0;
    for (unsigned i = 0; i < g->ndrives; i++, opened++)
        if ((rc = drive_open(g, cfg, i, engine)) < 0)
            break;
    if (rc >= 0) {
        rc = drives_register(g);
        if (rc < 0 && auto_pick && strcmp(g->drv.name, "cpu")) {
            /* LMCache users hit this on overlayfs/LVM: fall back, say so */
            char m[FERRY__ERRMSG_MAX];
            snprintf(m, sizeof m, "%s", ferry__err_msg(&g->err));
            FERRY_LOGW("%s; falling back to the cpu driver", m);
            add_fallback(g, "%s; using the cpu driver", m);
            driver_drop(g);
            rc = driver_pick(g, "cpu", why, sizeof why);
            if (rc < 0)
                ferry__err_set(&g->err, rc, "gds: cpu driver: %s", why);
            else
                rc = drives_register(g);
        }
    }
    if (rc >= 0) {
        ferry_slab_options so = FERRY_SLAB_OPTIONS_INIT;
        so.capacity = g->size;
        so.alignment = align;
        if ((rc = ferry_slab_create(&so, &g->slab)) < 0)
            ferry__err_pass(&g->err, rc);
    }
    if (rc < 0) {
        drives_deregister(g);
        g->ndrives = opened < g->ndrives ? opened + 1 : g->ndrives;
        drives_close(g);
        driver_drop(g);
        g->size = 0;
        return rc;
    }
    if (g->fallback[0])
        FERRY_LOGI("gds: on with driver %s, %u drive(s): %s", g->drv.name, g->ndrives,
                   g->fallback);
    g->on = 1;
    return 0;
}

int ferry_gds_init(ferry_gds *g, const ferry_gds_config *cfg)
{
    if (!g)
        return ferry__err_set(NULL, -EINVAL, "gds: init of a NULL context");
    if (!cfg)
        return 0; /* LMCache: no config leaves the context off */
    if (cfg->size < CFG_SIZE_V1 || cfg->size > sizeof(ferry_gds_config))
        return ferry__err_set(&g->err, -EINVAL,
                              "gds: config size %zu: accepted %zu (before `mode`) or %zu "
                              "(sizeof(ferry_gds_config))",
                              cfg->size, (size_t)CFG_SIZE_V1, sizeof(ferry_gds_config));
    /* an older caller's struct ends before the newer fields: they read as 0 */
    ferry_gds_config c;
    memset(&c, 0, sizeof c);
    memcpy(&c, cfg, cfg->size);
    c.size = sizeof c;
    pthread_mutex_lock(&g->mu);
    int rc;
    if (g->on)
        rc = ferry__err_set(&g->err, FERRY_ESTATE,
                            "gds: already initialized (driver %s, %u drive(s), %llu bytes)",
                            g->drv.name, g->ndrives, (unsigned long long)g->size);
    else
        rc = init_locked(g, &c);
    pthread_mutex_unlock(&g->mu);
    return rc;
}

int ferry_gds_open(const ferry_gds_config *cfg, ferry_gds **out)
{
    if (!cfg || !out)
        return ferry__err_set(NULL, -EINVAL, "gds: open: NULL config or out");
    ferry_gds *g;
    int rc = ferry_gds_create(&g);
    if (rc < 0)
        return rc;
    if ((rc = ferry_gds_init(g, cfg)) < 0) {
        ferry_gds_close(g);
        return rc;
    }
    *out = g;
    return 0;
}

/* ---- async argument batches ---- */

static void harvest(ferry_gds *g, gstream *st, abatch *b)
{
    for (unsigned i = 0; i < b->n; i++) {
        argblk *a = &b->a[i];
        if (a->done == (int64_t)a->size || st->err)
            continue;
        int code = a->done < 0 ? (int)a->done : FERRY_ESHORT;
        st->err = code;
        snprintf(st->errmsg, sizeof st->errmsg,
                 "async %s of %zu bytes at slab offset %llu (drive %u %s, file offset %lld): "
                 "%s%s",
                 dirname_of(a->op), a->size, (unsigned long long)a->slab_off, a->drive,
                 g->drives[a->drive].path, (long long)a->file_off,
                 a->done < 0 ? ferry_strerror(code) : "short transfer, ",
                 a->done < 0 ? "" : "bytes missing");
    }
    g->async_pending -= b->n;
    if (b->ev)
        ferry_event_destroy(b->ev);
    ferry__free(b);
}

/* free the closed batches whose checkpoint has passed */
static void poll_batches(ferry_gds *g, gstream *st)
{
    while (st->head && ferry_event_query(st->head->ev) == 0) {
        abatch *b = st->head;
        st->head = b->next;
        if (!st->head)
            st->tail = NULL;
        harvest(g, st, b);
    }
}

/* after the stream is synchronized: every batch is done */
static void drain_batches(ferry_gds *g, gstream *st)
{
    while (st->head) {
        abatch *b = st->head;
        st->head = b->next;
        harvest(g, st, b);
    }
    st->tail = NULL;
    if (st->open) {
        harvest(g, st, st->open);
        st->open = NULL;
    }
}

/* close the open batch with a checkpoint event; if no event can be had,
 * wait for the stream instead (slower, never unsafe) */
static void checkpoint(ferry_gds *g, gstream *st)
{
    abatch *b = st->open;
    st->open = NULL;
    ferry_event *ev = NULL;
    if (g->dev && ferry_event_create(g->dev, &ev) == 0 && ferry_event_record(ev, st->s) == 0) {
        b->ev = ev;
        b->next = NULL;
        if (st->tail)
            st->tail->next = b;
        else
            st->head = b;
        st->tail = b;
        atomic_fetch_add(&g->checkpoints, 1);
        return;
    }
    if (ev)
        ferry_event_destroy(ev);
    FERRY_LOGD("gds: no checkpoint event (%s): synchronizing the stream", ferry_last_error());
    ferry_stream_sync(st->s);
    b->ev = NULL;
    drain_batches(g, st);
    harvest(g, st, b);
}

/* ---- streams and regions (caller holds mu) ---- */

static gstream *stream_find(ferry_gds *g, ferry_stream *s)
{
    for (gstream *st = g->streams; st; st = st->next)
        if (st->s == s)
            return st;
    return NULL;
}

static gstream *stream_new(ferry_gds *g, ferry_stream *s)
{
    gstream *st = ferry__calloc(1, sizeof *st);
    if (!st)
        return NULL;
    st->s = s;
    st->raw = s ? ferry_stream_handle(s) : 0;
    return st;
}

static void stream_link(ferry_gds *g, gstream *st)
{
    st->next = g->streams;
    g->streams = st;
    g->nstreams++;
}

static void stream_unlink_free(ferry_gds *g, gstream *st)
{
    for (gstream **pp = &g->streams; *pp; pp = &(*pp)->next)
        if (*pp == st) {
            *pp = st->next;
            g->nstreams--;
            break;
        }
    ferry__free(st);
}

/* index of the first region whose base is > p */
static size_t region_upper(const ferry_gds *g, ferry_devptr p)
{
    size_t lo = 0, hi = g->nreg;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (g->regions[mid].base <= p)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static const region *region_find(const ferry_gds *g, ferry_devptr p)
{
    size_t i = region_upper(g, p);
    if (i == 0)
        return NULL;
    const region *r = &g->regions[i - 1];
    return p - r->base < r->len ? r : NULL;
}

int ferry_gds_register(ferry_gds *g, ferry_devptr buf, size_t len, ferry_stream *s)
{
    if (!g)
        return ferry__err_set(NULL, -EINVAL, "gds: register on a NULL context");
    pthread_mutex_lock(&g->mu);
    int rc = 0;
    if (!g->on)
        goto out; /* off: a no-op that calls nothing */
    if (len == 0 || buf + len < buf) {
        rc = ferry__err_set(&g->err, -EINVAL, "gds: register 0x%llx: length %zu is invalid",
                            (unsigned long long)buf, len);
        goto out;
    }
    size_t up = region_upper(g, buf + len - 1);
    if (up > 0) {
        const region *r = &g->regions[up - 1];
        if (r->base + r->len > buf) {
            rc = ferry__err_set(&g->err, FERRY_EEXIST,
                                "gds: register 0x%llx (+%zu): overlaps the buffer registered at "
                                "0x%llx (region 0x%llx, %zu bytes)",
                                (unsigned long long)buf, len, (unsigned long long)r->owner,
                                (unsigned long long)r->base, r->len);
            goto out;
        }
    }
    size_t npieces = len / g->cap + (len % g->cap != 0); /* len + cap - 1 may wrap */
    /* allocate everything before the first driver call */
    if (g->nreg + npieces > g->capreg) {
        size_t nc = g->capreg ? g->capreg : 16;
        while (nc < g->nreg + npieces)
            nc *= 2;
        region *nr = ferry__realloc(g->regions, nc * sizeof *nr);
        if (!nr) {
            rc = ferry__err_set(&g->err, -ENOMEM, "gds: register 0x%llx: out of memory",
                                (unsigned long long)buf);
            goto out;
        }
        g->regions = nr;
        g->capreg = nc;
    }
    gstream *st = stream_find(g, s);
    int new_stream = !st;
    if (new_stream && !(st = stream_new(g, s))) {
        rc = ferry__err_set(&g->err, -ENOMEM, "gds: register 0x%llx: out of memory",
                            (unsigned long long)buf);
        goto out;
    }
    if (!st->registered && g->drv.stream_register) {
        rc = g->drv.stream_register(g->drv.ctx, s, st->raw, FERRY_GDS_STREAM_FLAGS);
        if (rc == FERRY_ENOTSUP) {
            rc = 0; /* the library predates stream registration: still works */
        } else if (rc < 0) {
            char m[FERRY__ERRMSG_MAX];
            snprintf(m, sizeof m, "%s", ferry_last_error());
            uint64_t raw = st->raw;
            if (new_stream)
                ferry__free(st);
            rc = ferry__err_set(&g->err, rc,
                                "gds: register 0x%llx: stream 0x%llx registration failed: %s",
                                (unsigned long long)buf, (unsigned long long)raw, m);
            goto out;
        } else {
            st->registered = 1;
        }
    }
    size_t done = 0;
    for (; done < npieces; done++) {
        ferry_devptr b = buf + done * g->cap;
        size_t n = FERRY__MIN(g->cap, len - done * g->cap);
        rc = g->drv.buf_register ? g->drv.buf_register(g->drv.ctx, b, n, 0) : 0;
        if (rc < 0)
            break;
    }
    if (rc < 0) {
        char m[FERRY__ERRMSG_MAX];
        snprintf(m, sizeof m, "%s", ferry_last_error());
        /* roll back: nothing half-registered stays behind */
        for (size_t j = done; j-- > 0;)
            if (g->drv.buf_deregister)
                g->drv.buf_deregister(g->drv.ctx, buf + j * g->cap);
        if (st->nregions == 0 && st->registered) {
            if (g->drv.stream_deregister)
                g->drv.stream_deregister(g->drv.ctx, s, st->raw);
            st->registered = 0;
        }
        if (new_stream)
            ferry__free(st);
        rc = ferry__err_set(&g->err, rc,
                            "gds: register 0x%llx (+%zu): region %zu of %zu (0x%llx) failed: %s",
                            (unsigned long long)buf, len, done + 1, npieces,
                            (unsigned long long)(buf + done * g->cap), m);
        goto out;
    }
    if (new_stream)
        stream_link(g, st);
    memmove(&g->regions[up + npieces], &g->regions[up], (g->nreg - up) * sizeof(region));
    for (size_t j = 0; j < npieces; j++)
        g->regions[up + j] = (region){buf + j * g->cap, FERRY__MIN(g->cap, len - j * g->cap),
                                      buf, st};
    g->nreg += npieces;
    st->nregions += (unsigned)npieces;
    g->nbuffers++;
out:
    pthread_mutex_unlock(&g->mu);
    return rc;
}

int ferry_gds_deregister(ferry_gds *g, ferry_devptr buf)
{
    if (!g)
        return ferry__err_set(NULL, -EINVAL, "gds: deregister on a NULL context");
    pthread_mutex_lock(&g->mu);
    int rc = 0;
    if (!g->on)
        goto out;
    size_t i = region_upper(g, buf);
    if (i == 0 || g->regions[i - 1].base != buf || g->regions[i - 1].owner != buf) {
        rc = ferry__err_set(&g->err, FERRY_ENOTFOUND,
                            "gds: deregister 0x%llx: no buffer is registered there",
                            (unsigned long long)buf);
        goto out;
    }
    size_t first = i - 1, k = 0;
    while (first + k < g->nreg && g->regions[first + k].owner == buf)
        k++;
    gstream *st = g->regions[first].st;
    if (st->s) {
        int src = ferry_stream_sync(st->s);
        if (src < 0)
            FERRY_LOGW("gds: deregister 0x%llx: stream sync failed: %s", (unsigned long long)buf,
                       ferry_last_error());
    }
    for (size_t j = 0; j < k; j++) {
        const region *r = &g->regions[first + j];
        int drc = g->drv.buf_deregister ? g->drv.buf_deregister(g->drv.ctx, r->base) : 0;
        if (drc < 0)
            FERRY_LOGW("gds: deregister region 0x%llx (%zu bytes): %s",
                       (unsigned long long)r->base, r->len, ferry_last_error());
    }
    memmove(&g->regions[first], &g->regions[first + k], (g->nreg - first - k) * sizeof(region));
    g->nreg -= k;
    g->nbuffers--;
    st->nregions -= (unsigned)k;
    if (st->nregions == 0) {
        drain_batches(g, st);
        if (st->registered && g->drv.stream_deregister) {
            int drc = g->drv.stream_deregister(g->drv.ctx, st->s, st->raw);
            if (drc < 0 && drc != FERRY_ENOTSUP)
                FERRY_LOGW("gds: deregister stream 0x%llx: %s", (unsigned long long)st->raw,
                           ferry_last_error());
        }
        if (st->err)
            FERRY_LOGW("gds: stream 0x%llx dropped with an unreported error: %s",
                       (unsigned long long)st->raw, st->errmsg);
        stream_unlink_free(g, st);
    }
out:
    pthread_mutex_unlock(&g->mu);
    return rc;
}

static void async_drain(ferry_gds *g);

void ferry_gds_close(ferry_gds *g)
{
    if (!g)
        return;
    async_drain(g);
    pthread_mutex_lock(&g->mu);
    if (g->on) {
        for (gstream *st = g->streams; st; st = st->next) {
            if (st->s && ferry_stream_sync(st->s) < 0)
                FERRY_LOGW("gds: close: stream sync failed: %s", ferry_last_error());
            drain_batches(g, st);
        }
        for (size_t j = 0; j < g->nreg; j++)
            if (g->drv.buf_deregister && g->drv.buf_deregister(g->drv.ctx, g->regions[j].base) < 0)
                FERRY_LOGW("gds: close: deregister region 0x%llx: %s",
                           (unsigned long long)g->regions[j].base, ferry_last_error());
        while (g->streams) {
            gstream *st = g->streams;
            if (st->registered && g->drv.stream_deregister)
                g->drv.stream_deregister(g->drv.ctx, st->s, st->raw);
            stream_unlink_free(g, st);
        }
        drives_deregister(g);
        drives_close(g);
        driver_drop(g);
        ferry_slab_destroy(g->slab);
        g->on = 0;
    }
    ferry__free(g->regions);
    pthread_mutex_unlock(&g->mu);
    pthread_mutex_destroy(&g->mu);
    pthread_mutex_destroy(&g->amu);
    ferry__free(g);
}

/* ---- accessors ---- */

int ferry_gds_is_on(const ferry_gds *g)
{
    return g && g->on;
}

const char *ferry_gds_driver_name(const ferry_gds *g)
{
    return g && g->on ? g->drv.name : "off";
}

const char *ferry_gds_engine(const ferry_gds *g)
{
    return g && g->on ? ferry_io_engine(g->drives[0].io) : "off";
}

const char *ferry_gds_fallback_reason(const ferry_gds *g)
{
    return g && g->fallback[0] ? g->fallback : NULL;
}

const char *ferry_gds_last_error(const ferry_gds *g)
{
    return g ? ferry__err_msg(&g->err) : "";
}

uint64_t ferry_gds_size(const ferry_gds *g)
{
    return g && g->on ? g->size : 0;
}

ferry_slab *ferry_gds_slab(ferry_gds *g)
{
    return g && g->on ? g->slab : NULL;
}

int ferry_gds_stats_get(ferry_gds *g, ferry_gds_stats *out)
{
    if (!g || !out)
        return -EINVAL;
    pthread_mutex_lock(&g->mu);
    ferry_gds_stats s = {0};
    s.drives = g->on ? g->ndrives : 0;
    s.regions = (unsigned)g->nreg;
    s.buffers = g->nbuffers;
    for (gstream *st = g->streams; st; st = st->next)
        s.streams += st->registered;
    s.async_pending = g->async_pending;
    pthread_mutex_unlock(&g->mu);
    s.bytes_read = atomic_load(&g->bytes_read);
    s.bytes_written = atomic_load(&g->bytes_written);
    s.driver_ios = atomic_load(&g->driver_ios);
    s.engine_ios = atomic_load(&g->engine_ios);
    s.checkpoints = atomic_load(&g->checkpoints);
    *out = s;
    return 0;
}

/* ---- transfers ---- */

static int check_range(ferry_gds *g, const char *what, uint64_t slab_off, size_t len)
{
    if (!g->on)
        return ferry__err_set(&g->err, FERRY_ESTATE, "gds: %s: the context is off", what);
    if (len == 0)
        return ferry__err_set(&g->err, -EINVAL, "gds: %s at slab offset %llu: length 0", what,
                              (unsigned long long)slab_off);
    if (!FERRY__IS_ALIGNED(slab_off, g->align) || !FERRY__IS_ALIGNED(len, g->align))
        return ferry__err_set(&g->err, FERRY_EALIGN,
                              "gds: %s of %zu bytes at slab offset %llu: offset and length must "
                              "be multiples of %zu",
                              what, len, (unsigned long long)slab_off, g->align);
    if (slab_off > g->size || len > g->size - slab_off)
        return ferry__err_set(&g->err, FERRY_EBOUNDS,
                              "gds: %s of %zu bytes at slab offset %llu: past the slab's end "
                              "(%llu bytes)",
                              what, len, (unsigned long long)slab_off,
                              (unsigned long long)g->size);
    return 0;
}

typedef struct segv {
    seg *v;
    size_t n, cap;
    seg small[32];
} segv;

static int segv_push(segv *sv, seg s)
{
    if (sv->n == sv->cap) {
        size_t nc = sv->cap * 2;
        seg *nv = ferry__malloc(nc * sizeof *nv);
        if (!nv)
            return -ENOMEM;
        memcpy(nv, sv->v, sv->n * sizeof *nv);
        if (sv->v != sv->small)
            ferry__free(sv->v);
        sv->v = nv;
        sv->cap = nc;
    }
    sv->v[sv->n++] = s;
    return 0;
}

static void segv_init(segv *sv)
{
    sv->v = sv->small;
    sv->n = 0;
    sv->cap = FERRY__ARRAY_LEN(sv->small);
}

static void segv_free(segv *sv)
{
    if (sv->v != sv->small)
        ferry__free(sv->v);
}

/* the device slice [buf, buf+len) at slab_off -> segments, each inside one
 * region and one stripe unit; caller holds mu */
static int resolve(ferry_gds *g, int dir, uint64_t slab_off, size_t len, ferry_devptr buf,
                   segv *sv)
{
    size_t pos = 0;
    while (pos < len) {
        ferry_devptr p = buf + pos;
        const region *r = region_find(g, p);
        if (!r)
            return ferry__err_set(&g->err, FERRY_EBOUNDS,
                                  "gds: %s of %zu bytes at slab offset %llu: device address 0x%llx "
                                  "(byte %zu of the slice 0x%llx) is in no registered region",
                                  dirname_of(dir), len, (unsigned long long)slab_off,
                                  (unsigned long long)p, pos, (unsigned long long)buf);
        size_t in_region = FERRY__MIN(len - pos, (size_t)(r->base + r->len - p));
        size_t q = 0;
        while (q < in_region) {
            unsigned d;
            uint64_t foff, run;
            stripe_map(g, slab_off + pos + q, &d, &foff, &run);
            size_t n = (size_t)FERRY__MIN((uint64_t)(in_region - q), run);
            seg s = {d, r->base, (int64_t)(p + q - r->base), (int64_t)foff, n, slab_off + pos + q};
            if (segv_push(sv, s) < 0)
                return ferry__err_set(&g->err, -ENOMEM, "gds: %s of %zu bytes: out of memory",
                                      dirname_of(dir), len);
            q += n;
        }
        pos += in_region;
    }
    return 0;
}

static void lock_drives(ferry_gds *g, const unsigned char *used)
{
    for (unsigned d = 0; d < g->ndrives; d++)
        if (used[d])
            pthread_mutex_lock(&g->drives[d].mu);
}

static void unlock_drives(ferry_gds *g, const unsigned char *used)
{
    for (unsigned d = g->ndrives; d-- > 0;)
        if (used[d])
            pthread_mutex_unlock(&g->drives[d].mu);
}

static int seg_fail(ferry_gds *g, int dir, const seg *s, int code, const char *cause)
{
    return ferry__err_set(&g->err, code,
                          "gds: %s of %zu bytes at slab offset %llu (drive %u %s, file offset "
                          "%lld; region 0x%llx + %lld) with the %s driver: %s",
                          dirname_of(dir), s->size, (unsigned long long)s->slab_off, s->drive,
                          g->drives[s->drive].path, (long long)s->file_off,
                          (unsigned long long)s->base, (long long)s->buf_off, g->drv.name, cause);
}

/* one segment through read/write, continuing short transfers */
static int seg_io(ferry_gds *g, int dir, seg s)
{
    const seg orig = s;
    while (s.size) {
        atomic_fetch_add(&g->driver_ios, 1);
        int64_t r = dir == FERRY_GDS_READ
                        ? g->drv.read(g->drv.ctx, g->drives[s.drive].handle, s.base, s.size,
                                      s.file_off, s.buf_off)
                        : g->drv.write(g->drv.ctx, g->drives[s.drive].handle, s.base, s.size,
                                       s.file_off, s.buf_off);
        if (r < 0) {
            char m[FERRY__ERRMSG_MAX];
            snprintf(m, sizeof m, "%s (%s)", ferry_strerror((int)r), ferry_last_error());
            return seg_fail(g, dir, &orig, (int)r, m);
        }
        if (r == 0 || (uint64_t)r > s.size)
            return seg_fail(g, dir, &orig, FERRY_ESHORT,
                            r == 0 ? "the driver moved 0 bytes" : "the driver overran");
        s.size -= (size_t)r;
        s.file_off += r;
        s.buf_off += r;
    }
    return 0;
}

static int run_sync(ferry_gds *g, int dir, segv *sv)
{
    int rc = 0;
    if (sv->n > 1 && g->drv.batch) {
        ferry_gds_io small[32], *ios = small;
        if (sv->n > FERRY__ARRAY_LEN(small) && !(ios = ferry__malloc(sv->n * sizeof *ios)))
            ios = NULL; /* one at a time instead */
        if (ios) {
            for (size_t i = 0; i < sv->n; i++) {
                const seg *s = &sv->v[i];
                ios[i] = (ferry_gds_io){dir,     g->drives[s->drive].handle, s->base, s->size,
                                        s->file_off, s->buf_off,           -1};
            }
            rc = g->drv.batch(g->drv.ctx, ios, (unsigned)sv->n);
            if (rc != FERRY_ENOTSUP) {
                atomic_fetch_add(&g->driver_ios, sv->n);
                /* continue short ones; report the first failure */
                rc = 0;
                for (size_t i = 0; i < sv->n && rc == 0; i++) {
                    int64_t r = ios[i].result;
                    seg s = sv->v[i];
                    if (r < 0) {
                        char m[64];
                        snprintf(m, sizeof m, "%s (batch)", ferry_strerror((int)r));
                        rc = seg_fail(g, dir, &s, (int)r, m);
                    } else if ((uint64_t)r < s.size) {
                        s.size -= (size_t)r;
                        s.file_off += r;
                        s.buf_off += r;
                        rc = seg_io(g, dir, s);
                    }
                }
                if (ios != small)
                    ferry__free(ios);
                return rc;
            }
            if (ios != small)
                ferry__free(ios);
            rc = 0; /* no batch API in this library: one at a time */
        }
    }
    for (size_t i = 0; i < sv->n && rc == 0; i++)
        rc = seg_io(g, dir, sv->v[i]);
    return rc;
}

static void mark_drives(ferry_gds *g, const segv *sv, unsigned char *used)
{
    memset(used, 0, FERRY_GDS_MAX_DIRS);
    for (size_t i = 0; i < sv->n; i++)
        used[sv->v[i].drive] = 1;
}

int ferry_gds_transfer(ferry_gds *g, int dir, uint64_t slab_off, size_t len, ferry_devptr buf,
                       ferry_stream *s)
{
    if (!g)
        return ferry__err_set(NULL, -EINVAL, "gds: transfer on a NULL context");
    if (dir != FERRY_GDS_READ && dir != FERRY_GDS_WRITE)
        return ferry__err_set(&g->err, -EINVAL, "gds: transfer direction %d", dir);
    segv sv;
    segv_init(&sv);
    pthread_mutex_lock(&g->mu);
    int rc = check_range(g, dirname_of(dir), slab_off, len);
    if (rc == 0)
        rc = resolve(g, dir, slab_off, len, buf, &sv);
    pthread_mutex_unlock(&g->mu);
    if (rc == 0 && s && (rc = ferry_stream_sync(s)) < 0)
        rc = ferry__err_set(&g->err, rc, "gds: %s at slab offset %llu: stream sync: %s",
                            dirname_of(dir), (unsigned long long)slab_off, ferry_last_error());
    if (rc == 0) {
        unsigned char used[FERRY_GDS_MAX_DIRS];
        mark_drives(g, &sv, used);
        lock_drives(g, used);
        rc = run_sync(g, dir, &sv);
        unlock_drives(g, used);
    }
    if (rc == 0)
        atomic_fetch_add(dir == FERRY_GDS_READ ? &g->bytes_read : &g->bytes_written, len);
    segv_free(&sv);
    return rc;
}

int ferry_gds_transfer_async(ferry_gds *g, int dir, uint64_t slab_off, size_t len,
                             ferry_devptr buf, ferry_stream *s)
{
    if (!g)
        return ferry__err_set(NULL, -EINVAL, "gds: async transfer on a NULL context");
    if (dir != FERRY_GDS_READ && dir != FERRY_GDS_WRITE)
        return ferry__err_set(&g->err, -EINVAL, "gds: async transfer direction %d", dir);
    if (!s) {
        /* the default stream (cuFile's handle 0): ferry's device layer has
         * no queue there to record a checkpoint on or to wait for, so an
         * argument block handed to an async call could never be known to
         * be released; the transfer is done now instead, as the default
         * stream would have done it, with its errors returned here */
        return ferry_gds_transfer(g, dir, slab_off, len, buf, NULL);
    }
    segv sv;
    segv_init(&sv);
    pthread_mutex_lock(&g->mu);
    int rc = check_range(g, dirname_of(dir), slab_off, len);
    if (rc == 0)
        rc = resolve(g, dir, slab_off, len, buf, &sv);
    int (*afn)(void *, void *, ferry_devptr, size_t *, int64_t *, int64_t *, int64_t *,
               ferry_stream *) = dir == FERRY_GDS_READ ? g->drv.read_async : g->drv.write_async;
    gstream *st = rc == 0 ? stream_find(g, s) : NULL;
    int new_stream = 0;
    if (rc == 0 && !st) {
        /* a stream no buffer was registered with: tracked for its batches only */
        if (!(st = stream_new(g, s)))
            rc = ferry__err_set(&g->err, -ENOMEM, "gds: async %s: out of memory",
                                dirname_of(dir));
        else
            new_stream = 1;
    }
    /* every argument block this call needs, before the first submission */
    abatch *spare = NULL;
    if (rc == 0 && afn) {
        size_t room = st->open ? FERRY_GDS_CHECKPOINT_EVERY - st->open->n : 0;
        for (size_t need = sv.n > room ? sv.n - room : 0; need > 0 && rc == 0;) {
            abatch *b = ferry__calloc(1, sizeof *b);
            if (!b) {
                rc = ferry__err_set(&g->err, -ENOMEM, "gds: async %s: out of memory",
                                    dirname_of(dir));
                break;
            }
            b->next = spare;
            spare = b;
            need -= FERRY__MIN(need, (size_t)FERRY_GDS_CHECKPOINT_EVERY);
        }
    }
    if (rc < 0) {
        while (spare) {
            abatch *b = spare;
            spare = b->next;
            ferry__free(b);
        }
        if (new_stream)
            ferry__free(st);
        pthread_mutex_unlock(&g->mu);
        segv_free(&sv);
        return rc;
    }
    if (new_stream)
        stream_link(g, st);
    unsigned char used[FERRY_GDS_MAX_DIRS];
    mark_drives(g, &sv, used);
    lock_drives(g, used);
    if (!afn) {
        /* no async entry: order after the stream's work, then move synchronously */
        rc = ferry_stream_sync(s);
        if (rc < 0)
            rc = ferry__err_set(&g->err, rc, "gds: async %s: stream sync: %s", dirname_of(dir),
                                ferry_last_error());
        else
            rc = run_sync(g, dir, &sv);
    }
    for (size_t i = 0; afn && i < sv.n; i++) {
        const seg *sg = &sv.v[i];
        if (!st->open) {
            st->open = spare;
            spare = spare->next;
            st->open->next = NULL;
        }
        argblk *a = &st->open->a[st->open->n++];
        *a = (argblk){sg->size, sg->file_off, sg->buf_off, 0, sg->slab_off, sg->drive, dir};
        g->async_pending++;
        atomic_fetch_add(&g->driver_ios, 1);
        int r = afn(g->drv.ctx, g->drives[sg->drive].handle, sg->base, &a->size, &a->file_off,
                    &a->buf_off, &a->done, s);
        if (r == FERRY_ENOTSUP) {
            /* this library has no async call: finish synchronously, in order */
            a->done = (int64_t)a->size;
            r = ferry_stream_sync(s);
            if (r == 0) {
                segv rest = {sv.v + i, sv.n - i, sv.n - i, {{0}}};
                r = run_sync(g, dir, &rest);
            }
            if (st->open->n == FERRY_GDS_CHECKPOINT_EVERY)
                checkpoint(g, st);
            if (r < 0)
                rc = r;
            break;
        }
        if (r < 0) {
            a->done = (int64_t)a->size; /* never queued: nothing to wait for */
            char m[FERRY__ERRMSG_MAX];
            snprintf(m, sizeof m, "%s (async submission; earlier segments stay queued)",
                     ferry_last_error());
            rc = seg_fail(g, dir, sg, r, m);
            break;
        }
        if (st->open->n == FERRY_GDS_CHECKPOINT_EVERY)
            checkpoint(g, st);
    }
    unlock_drives(g, used);
    while (spare) {
        abatch *b = spare;
        spare = b->next;
        ferry__free(b);
    }
    poll_batches(g, st);
    pthread_mutex_unlock(&g->mu);
    if (rc == 0)
        atomic_fetch_add(dir == FERRY_GDS_READ ? &g->bytes_read : &g->bytes_written, len);
    segv_free(&sv);
    return rc;
}

int ferry_gds_stream_sync(ferry_gds *g, ferry_stream *s)
{
    if (!g)
        return ferry__err_set(NULL, -EINVAL, "gds: stream sync on a NULL context");
    int rc = 0;
    if (s && (rc = ferry_stream_sync(s)) < 0)
        rc = ferry__err_set(&g->err, rc, "gds: stream sync: %s", ferry_last_error());
    pthread_mutex_lock(&g->mu);
    gstream *st = stream_find(g, s);
    if (st) {
        drain_batches(g, st);
        if (st->err) {
            if (rc == 0)
                rc = ferry__err_set(&g->err, st->err, "gds: %s", st->errmsg);
            st->err = 0;
        }
        if (st->nregions == 0 && !st->registered)
            stream_unlink_free(g, st);
    }
    pthread_mutex_unlock(&g->mu);
    return rc;
}

/* ---- host buffers: straight to the drive queues ----
 *
 * A host transfer ("hop") is cut into engine requests per stripe run; each
 * request's user field points back at its hop. Whoever reaps a drive's
 * queue (under that drive's lock: a ferry_io is single-threaded) delivers
 * every completion to its own hop, whichever thread or call it belongs
 * to; a synchronous call waits until its own hop has nothing left, an
 * asynchronous one lands on the context's done list for ferry_gds_reap.
 */

typedef struct hop {
    struct hop *next;          /* done list */
    ferry_gds_req *req;        /* async: the caller's request; NULL when synchronous */
    ferry_io_req *io;          /* n engine requests */
    size_t n;
    size_t left[FERRY_GDS_MAX_DIRS];
    _Atomic size_t left_total;
    int err;                   /* first failure's code */
    size_t bad;                /* its request's index */
    int dir;
    size_t len;
    uint64_t slab_off;
    ferry_io_req small[8];
} hop;

static unsigned req_drive(const ferry_gds *g, const ferry_io_req *r)
{
    for (unsigned d = 0; d < g->ndrives; d++)
        if (g->drives[d].f == r->file)
            return d;
    return 0;
}

static int host_check(ferry_gds *g, int dir, const void *buf, size_t len, uint64_t slab_off)
{
    const char *what = dirname_of(dir);
    if (dir != FERRY_GDS_READ && dir != FERRY_GDS_WRITE)
        return ferry__err_set(&g->err, -EINVAL, "gds: host transfer direction %d", dir);
    if (!buf)
        return ferry__err_set(&g->err, -EINVAL, "gds: %s at slab offset %llu: NULL buffer", what,
                              (unsigned long long)slab_off);
    int rc = check_range(g, what, slab_off, len);
    if (rc < 0)
        return rc;
    if (!FERRY__IS_ALIGNED((uintptr_t)buf, g->align) && ferry_file_is_direct(g->drives[0].f))
        return ferry__err_set(&g->err, FERRY_EALIGN,
                              "gds: %s of %zu bytes at slab offset %llu: host buffer %p is not "
                              "%zu-aligned (the slab is open with O_DIRECT)",
                              what, len, (unsigned long long)slab_off, buf, g->align);
    return 0;
}

/* cut [slab_off, +len) into engine requests of at most `piece` bytes that
 * never cross a stripe unit; -ENOMEM leaves h empty */
static int hop_build(ferry_gds *g, hop *h, int dir, void *buf, size_t len, uint64_t slab_off,
                     size_t piece)
{
    memset(h, 0, offsetof(hop, small));
    h->dir = dir;
    h->len = len;
    h->slab_off = slab_off;
    size_t n = 0;
    for (size_t pos = 0; pos < len; n++) {
        unsigned d;
        uint64_t foff, run;
        stripe_map(g, slab_off + pos, &d, &foff, &run);
        pos += (size_t)FERRY__MIN((uint64_t)FERRY__MIN(len - pos, piece), run);
    }
    h->io = h->small;
    if (n > FERRY__ARRAY_LEN(h->small) && !(h->io = ferry__calloc(n, sizeof *h->io)))
        return ferry__err_set(&g->err, -ENOMEM, "gds: %s of %zu bytes: out of memory",
                              dirname_of(dir), len);
    size_t i = 0;
    for (size_t pos = 0; pos < len; i++) {
        unsigned d;
        uint64_t foff, run;
        stripe_map(g, slab_off + pos, &d, &foff, &run);
        size_t k = (size_t)FERRY__MIN((uint64_t)FERRY__MIN(len - pos, piece), run);
        ferry_io_req *r = &h->io[i];
        memset(r, 0, sizeof *r);
        r->op = dir == FERRY_GDS_READ ? FERRY_IO_READ : FERRY_IO_WRITE;
        r->file = g->drives[d].f;
        r->buf = (char *)buf + pos;
        r->len = k;
        r->offset = foff;
        r->user = h;
        h->left[d]++;
        pos += k;
    }
    h->n = n;
    atomic_store(&h->left_total, n);
    return 0;
}

static void hop_free_parts(hop *h)
{
    if (h->io != h->small)
        ferry__free(h->io);
    h->io = NULL;
}

/* the hop's outcome: 0, or its first failure with a message */
static int hop_result(ferry_gds *g, const hop *h)
{
    if (!h->err)
        return 0;
    const ferry_io_req *r = &h->io[h->bad];
    unsigned d = req_drive(g, r);
    return ferry__err_set(&g->err, h->err,
                          "gds: %s of %zu bytes at slab offset %llu: drive %u (%s) %s of %zu "
                          "bytes at file offset %llu: %s",
                          dirname_of(h->dir), h->len, (unsigned long long)h->slab_off, d,
                          g->drives[d].path, dirname_of(h->dir), r->len,
                          (unsigned long long)r->offset, ferry_strerror(h->err));
}

/* a completed engine request reaches its hop (caller holds drive d's lock) */
static void deliver(ferry_gds *g, unsigned d, ferry_io_req *r)
{
    hop *h = r->user;
    if (r->result != (int64_t)r->len) {
        /* parts of one hop complete on several drives' threads at once */
        pthread_mutex_lock(&g->amu);
        if (!h->err) {
            h->err = r->result < 0 ? (int)r->result : FERRY_ESHORT;
            h->bad = (size_t)(r - h->io);
        }
        pthread_mutex_unlock(&g->amu);
    }
    h->left[d]--;
    /* read req before the last decrement: once left_total reaches 0 a
     * synchronous caller may return and its stack-held hop is gone */
    ferry_gds_req *req = h->req;
    if (atomic_fetch_sub(&h->left_total, 1) != 1 || !req)
        return;
    /* an async hop is complete: hand it to ferry_gds_reap */
    req->result = h->err ? hop_result(g, h) : 0;
    if (!h->err)
        atomic_fetch_add(h->dir == FERRY_GDS_READ ? &g->bytes_read : &g->bytes_written, h->len);
    pthread_mutex_lock(&g->amu);
    h->next = NULL;
    if (g->done_tail)
        g->done_tail->next = h;
    else
        g->done_head = h;
    g->done_tail = h;
    g->ndone++;
    pthread_mutex_unlock(&g->amu);
}

/* reap drive d once (caller holds its lock); returns completions or a code */
static int pump_drive(ferry_gds *g, unsigned d, unsigned min, int timeout_ms)
{
    ferry_io_req *done[32];
    int k = ferry_io_reap(g->drives[d].io, done, min, 32, timeout_ms);
    if (k < 0)
        return ferry__err_set(&g->err, k, "gds: drive %u (%s): reap: %s", d, g->drives[d].path,
                              ferry_last_error());
    for (int i = 0; i < k; i++)
        deliver(g, d, done[i]);
    return k;
}

/* submit k engine requests to drive d (caller holds its lock); requests
 * the engine refuses (validation) complete at once as failures */
static void drive_flush(ferry_gds *g, unsigned d, ferry_io_req **ptrs, unsigned k, int *rc)
{
    int n = ferry_io_submit(g->drives[d].io, ptrs, k);
    if (n < 0 || (unsigned)n < k) {
        int code = n < 0 ? n : FERRY_EDRIVER;
        if (*rc == 0)
            *rc = ferry__err_set(&g->err, code, "gds: drive %u (%s): submit: %s", d,
                                 g->drives[d].path, ferry_last_error());
        for (unsigned q = n < 0 ? 0 : (unsigned)n; q < k; q++) {
            ptrs[q]->result = code;
            deliver(g, d, ptrs[q]);
        }
    }
    atomic_fetch_add(&g->engine_ios, (uint64_t)(n < 0 ? 0 : n));
}

/* hand built hops' requests to the drive queues: per drive, one lock and
 * one submission per 64 requests (one io_uring_submit for a batch) */
static int hops_submit(ferry_gds *g, hop *const *hops, unsigned m)
{
    int rc = 0;
    for (unsigned d = 0; d < g->ndrives; d++) {
        ferry_io_req *ptrs[64];
        unsigned k = 0;
        int locked = 0;
        for (unsigned hi = 0; hi < m; hi++) {
            const hop *h = hops[hi];
            if (!h->left[d])
                continue;
            if (!locked) {
                pthread_mutex_lock(&g->drives[d].mu);
                locked = 1;
            }
            for (size_t j = 0; j < h->n; j++) {
                if (h->io[j].file != g->drives[d].f)
                    continue;
                ptrs[k++] = &h->io[j];
                if (k == FERRY__ARRAY_LEN(ptrs)) {
                    drive_flush(g, d, ptrs, k, &rc);
                    k = 0;
                }
            }
        }
        if (k)
            drive_flush(g, d, ptrs, k, &rc);
        if (locked)
            pthread_mutex_unlock(&g->drives[d].mu);
    }
    return rc;
}

static int host_rw(ferry_gds *g, int dir, void *buf, size_t len, uint64_t slab_off)
{
    if (!g)
        return ferry__err_set(NULL, -EINVAL, "gds: %s on a NULL context", dirname_of(dir));
    int rc = host_check(g, dir, buf, len, slab_off);
    if (rc < 0)
        return rc;
    /* a synchronous call brings its own parallelism: pieces so that each
     * drive has about `depth` requests in flight, as the engines' own
     * synchronous helpers do (one 32 MiB chunk at depth 8: 8 x 4 MiB) */
    size_t piece = (len + (size_t)g->ndrives * g->depth - 1) / ((size_t)g->ndrives * g->depth);
    piece = FERRY__ALIGN_UP(piece, g->align);
    if (piece < ((size_t)128 << 10))
        piece = (size_t)128 << 10;
    hop h, *hp = &h;
    if ((rc = hop_build(g, &h, dir, buf, len, slab_off, piece)) < 0)
        return rc;
    hops_submit(g, &hp, 1);
    /* wait for our own requests, delivering whatever else completes too */
    while (rc == 0 && atomic_load(&h.left_total) > 0) {
        /* h.left[d] changes only under drive d's lock */
        for (unsigned d = 0; d < g->ndrives && rc == 0; d++) {
            pthread_mutex_lock(&g->drives[d].mu);
            int k = h.left[d] ? pump_drive(g, d, 1, -1) : 0;
            pthread_mutex_unlock(&g->drives[d].mu);
            if (k < 0)
                rc = k; /* the engine broke: nothing more will complete */
        }
    }
    if (rc == 0 && (rc = hop_result(g, &h)) == 0)
        atomic_fetch_add(dir == FERRY_GDS_READ ? &g->bytes_read : &g->bytes_written, len);
    hop_free_parts(&h);
    return rc;
}

int ferry_gds_pwrite(ferry_gds *g, const void *buf, size_t len, uint64_t slab_off)
{
    return host_rw(g, FERRY_GDS_WRITE, (void *)(uintptr_t)buf, len, slab_off);
}

int ferry_gds_pread(ferry_gds *g, void *buf, size_t len, uint64_t slab_off)
{
    return host_rw(g, FERRY_GDS_READ, buf, len, slab_off);
}

/* close: host requests still in flight land first; unreaped ones are dropped */
static void async_drain(ferry_gds *g)
{
    if (g->on) {
        int broken = 0;
        while (!broken && atomic_load(&g->async_hops) > g->ndone) {
            for (unsigned d = 0; d < g->ndrives; d++) {
                pthread_mutex_lock(&g->drives[d].mu);
                int k = ferry_io_inflight(g->drives[d].io) ? pump_drive(g, d, 1, 10) : 0;
                pthread_mutex_unlock(&g->drives[d].mu);
                if (k < 0)
                    broken = 1;
            }
        }
        while (g->done_head) {
            hop *h = g->done_head;
            g->done_head = h->next;
            h->req->priv_ = NULL;
            hop_free_parts(h);
            ferry__free(h);
        }
    }
}

int ferry_gds_submit(ferry_gds *g, ferry_gds_req *const *reqs, unsigned n)
{
    if (!g || (!reqs && n))
        return ferry__err_set(g ? &g->err : NULL, -EINVAL, "gds: submit: NULL context or reqs");
    unsigned k = 0;
    int rc = 0;
    while (k < n && rc == 0) {
        hop *batch[32];
        unsigned m = 0;
        for (; k < n && m < FERRY__ARRAY_LEN(batch); k++) {
            ferry_gds_req *q = reqs[k];
            if (!q) {
                rc = ferry__err_set(&g->err, -EINVAL, "gds: submit: request %u is NULL", k);
                break;
            }
            if ((rc = host_check(g, q->dir, q->buf, q->len, q->slab_off)) < 0)
                break;
            hop *h = ferry__malloc(sizeof *h);
            if (!h) {
                rc = ferry__err_set(&g->err, -ENOMEM, "gds: submit: out of memory");
                break;
            }
            /* the caller keeps `depth` requests in flight: no extra cutting */
            if ((rc = hop_build(g, h, q->dir, q->buf, q->len, q->slab_off, SIZE_MAX)) < 0) {
                ferry__free(h);
                break;
            }
            h->req = q;
            q->result = 0;
            q->priv_ = h;
            batch[m++] = h;
        }
        atomic_fetch_add(&g->async_hops, m);
        hops_submit(g, batch, m); /* a refused request completes with its error */
    }
    return k ? (int)k : rc;
}

int ferry_gds_reap(ferry_gds *g, ferry_gds_req **done, unsigned min, unsigned max,
                   int timeout_ms)
{
    if (!g || (!done && max))
        return ferry__err_set(g ? &g->err : NULL, -EINVAL, "gds: reap: NULL context or done");
    if (min > max)
        return ferry__err_set(&g->err, -EINVAL, "gds: reap: min %u > max %u", min, max);
    uint64_t deadline = timeout_ms < 0 ? 0 : ferry__now_ns() + (uint64_t)timeout_ms * 1000000ull;
    unsigned got = 0, turn = 0;
    /* a poll (min 0) collects what has finished without waiting; a wait
     * goes straight to the drives below, which collect it anyway */
    for (unsigned d = 0; min == 0 && d < g->ndrives; d++) {
        pthread_mutex_lock(&g->drives[d].mu);
        int k = ferry_io_inflight(g->drives[d].io) ? pump_drive(g, d, 0, 0) : 0;
        pthread_mutex_unlock(&g->drives[d].mu);
        if (k < 0)
            return k;
    }
    for (;;) {
        pthread_mutex_lock(&g->amu);
        while (got < max && g->done_head) {
            hop *h = g->done_head;
            g->done_head = h->next;
            if (!g->done_head)
                g->done_tail = NULL;
            g->ndone--;
            done[got++] = h->req;
            h->req->priv_ = NULL;
            hop_free_parts(h);
            ferry__free(h);
            atomic_fetch_sub(&g->async_hops, 1);
        }
        unsigned waiting = (unsigned)atomic_load(&g->async_hops) - g->ndone;
        pthread_mutex_unlock(&g->amu);
        if (got >= min || got == max || waiting == 0)
            return (int)got;
        int left = -1;
        if (timeout_ms >= 0) {
            uint64_t now = ferry__now_ns();
            if (now >= deadline)
                return (int)got;
            left = (int)((deadline - now + 999999) / 1000000);
        }
        /* one drive: block on it; several: short turns round the drives */
        unsigned d = turn++ % g->ndrives;
        int slice = g->ndrives == 1 ? left : (left < 0 || left > 1 ? 1 : left);
        pthread_mutex_lock(&g->drives[d].mu);
        int k = ferry_io_inflight(g->drives[d].io) ? pump_drive(g, d, 1, slice) : 0;
        pthread_mutex_unlock(&g->drives[d].mu);
        if (k < 0)
            return got ? (int)got : k;
    }
}

/* ---- registered host buffers ---- */

int ferry_gds_host_register(ferry_gds *g, void *buf, size_t len)
{
    if (!g || !buf || !len)
        return ferry__err_set(g ? &g->err : NULL, -EINVAL,
                              "gds: host register needs a buffer and a length");
    if (!g->on)
        return ferry__err_set(&g->err, FERRY_ESTATE, "gds: host register: the context is off");
    int rc = 0;
    unsigned d = 0;
    for (; d < g->ndrives && rc == 0; d++) {
        pthread_mutex_lock(&g->drives[d].mu);
        rc = ferry_io_register_buffer(g->drives[d].io, buf, len);
        pthread_mutex_unlock(&g->drives[d].mu);
    }
    if (rc == FERRY_ENOTSUP)
        rc = 0; /* this engine has no fixed buffers: nothing to gain, nothing to do */
    if (rc < 0) {
        char m[FERRY__ERRMSG_MAX];
        snprintf(m, sizeof m, "%s", ferry_last_error());
        for (unsigned j = 0; j + 1 < d; j++) {
            pthread_mutex_lock(&g->drives[j].mu);
            ferry_io_unregister_buffer(g->drives[j].io, buf);
            pthread_mutex_unlock(&g->drives[j].mu);
        }
        return ferry__err_set(&g->err, rc, "gds: host register %p (%zu bytes) on drive %u: %s",
                              buf, len, d - 1, m);
    }
    return 0;
}

int ferry_gds_host_unregister(ferry_gds *g, void *buf)
{
    if (!g || !buf)
        return ferry__err_set(g ? &g->err : NULL, -EINVAL, "gds: host unregister of NULL");
    if (!g->on)
        return ferry__err_set(&g->err, FERRY_ESTATE, "gds: host unregister: the context is off");
    int rc = 0;
    for (unsigned d = 0; d < g->ndrives; d++) {
        pthread_mutex_lock(&g->drives[d].mu);
        int r = ferry_io_unregister_buffer(g->drives[d].io, buf);
        pthread_mutex_unlock(&g->drives[d].mu);
        if (r < 0 && r != FERRY_ENOTSUP && rc == 0)
            rc = ferry__err_set(&g->err, r == -ENOENT ? FERRY_ENOTFOUND : r,
                                "gds: host unregister %p on drive %u: %s", buf, d,
                                ferry_last_error());
    }
    return rc;
}

int ferry_gds_buffer_alloc(ferry_gds *g, size_t len, void **out)
{
    if (!g || !len || !out)
        return ferry__err_set(g ? &g->err : NULL, -EINVAL, "gds: buffer alloc needs a length");
    if (!g->on)
        return ferry__err_set(&g->err, FERRY_ESTATE, "gds: buffer alloc: the context is off");
    size_t n = FERRY__ALIGN_UP(len, g->align);
    void *p = NULL;
    if (g->dev) {
        int rc = ferry_device_host_alloc(g->dev, n, &p);
        if (rc < 0)
            return ferry__err_pass(&g->err, rc);
    } else {
        /* large buffers on 2 MiB boundaries, backed by transparent huge
         * pages where the kernel allows (as the I/O layer's own buffers):
         * a direct request then maps onto a few large segments instead of
         * one per 4 KiB page, which costs real throughput (measured: 8 MiB
         * requests at depth 8 ran ~1.7x faster from huge pages) */
        size_t huge = (size_t)2 << 20;
        size_t align = n >= huge ? huge : g->align;
        if (!(p = ferry__aligned_alloc(align, n)))
            return ferry__err_set(&g->err, -ENOMEM, "gds: out of memory for a %zu-byte buffer",
                                  n);
        if (n >= huge && FERRY__IS_ALIGNED(p, huge))
            madvise(p, n & ~(huge - 1), MADV_HUGEPAGE);
    }
    /* best effort, as the engines' own buffers: unregistered still works */
    if (ferry_gds_host_register(g, p, n) < 0)
        FERRY_LOGD("gds: buffer %p not registered: %s", p, ferry__err_msg(&g->err));
    *out = p;
    return 0;
}

void ferry_gds_buffer_free(ferry_gds *g, void *buf)
{
    if (!g || !buf)
        return;
    if (g->on) {
        for (unsigned d = 0; d < g->ndrives; d++) {
            pthread_mutex_lock(&g->drives[d].mu);
            ferry_io_unregister_buffer(g->drives[d].io, buf);
            pthread_mutex_unlock(&g->drives[d].mu);
        }
    }
    if (g->dev)
        ferry_device_host_free(g->dev, buf);
    else
        ferry__free(buf);
}

/* ---- extents ---- */

static int ext_ok(ferry_gds *g, const ferry_extent *e)
{
    if (!e)
        return ferry__err_set(g ? &g->err : NULL, -EINVAL, "gds: NULL extent");
    if (e->size > SIZE_MAX)
        return ferry__err_set(g ? &g->err : NULL, -EINVAL, "gds: extent too large");
    return 0;
}

int ferry_gds_extent_transfer(ferry_gds *g, int dir, const ferry_extent *e, ferry_devptr buf,
                              ferry_stream *s)
{
    int rc = ext_ok(g, e);
    return rc < 0 ? rc : ferry_gds_transfer(g, dir, e->offset, (size_t)e->size, buf, s);
}

int ferry_gds_extent_transfer_async(ferry_gds *g, int dir, const ferry_extent *e,
                                    ferry_devptr buf, ferry_stream *s)
{
    int rc = ext_ok(g, e);
    return rc < 0 ? rc : ferry_gds_transfer_async(g, dir, e->offset, (size_t)e->size, buf, s);
}

int ferry_gds_extent_pwrite(ferry_gds *g, const ferry_extent *e, const void *buf)
{
    int rc = ext_ok(g, e);
    return rc < 0 ? rc : ferry_gds_pwrite(g, buf, (size_t)e->size, e->offset);
}

int ferry_gds_extent_pread(ferry_gds *g, const ferry_extent *e, void *buf)
{
    int rc = ext_ok(g, e);
    return rc < 0 ? rc : ferry_gds_pread(g, buf, (size_t)e->size, e->offset);
}
