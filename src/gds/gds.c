/*
 * gds.c - the GDS context's life: create/init/open/close and its slab files.
 *
 * Invariants:
 *  - Off until ferry_gds_init succeeds; while off, register/deregister
 *    return 0 without a single driver call (LMCache's no-op contract).
 *  - init either turns the context on with every drive open, locked and
 *    registered with the driver, or leaves it off with nothing held: each
 *    step's failure undoes the steps before it, in reverse.
 *  - Every option is checked against its range before any arithmetic on it
 *    (config_check), so a bad config is one -EINVAL naming the option.
 *
 * Ownership: each drive's directory is locked (core/dirlock.c) before its
 * slab file is created or truncated, and stays locked until the drive is
 * closed: the truncation itself is what handed one opener's bytes to
 * another, so the lock must come first. Files and directories are created
 * with cfg->mode (0600 / 0700 when 0).
 *
 * Striping: slab offset o lives on drive (o / unit) % n at file offset
 * (o / unit / n) * unit + o % unit (src/core/stripe.c); each drive's file
 * holds its share. The driver (gds_driver.c), the registry (gds_region.c)
 * and the transfers (gds_xfer.c, gds_host.c) live in files of their own;
 * gds_impl.h holds the state they share.
 */
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dirlock.h"
#include "io/room.h"
#include "gds_impl.h"
#include "sized.h"

/* a config from before `mode` ends where mode begins */

/* ---- life ---- */

/* a context that is off */
static int gds_alloc(ferry_gds **out)
{
    ferry_gds *g = ferry__calloc(1, sizeof *g);
    if (!g)
        return ferry__err_set(NULL, -ENOMEM, "gds: out of memory creating the context");
    pthread_mutex_init(&g->hmu, NULL);
    pthread_mutex_init(&g->mu, NULL);
    pthread_mutex_init(&g->amu, NULL);
    *out = g;
    return 0;
}

/* one more reason in the fallback text ("a; b"), dropped when it is full */
void ferry__gds_add_fallback(ferry_gds *g, const char *fmt, ...)
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

/* nothing an engine holds may run once its file is closed: the request
 * would use a descriptor number the process may have given another file
 * meanwhile. Close's drain stops at a drive whose queue broke, leaving the
 * other drives' requests in flight: they finish here, their completions
 * dropped (ferry__gds_async_release frees their hops) */
static void drive_quiesce(drive *d)
{
    ferry_io_req *done[32];
    while (ferry_io_inflight(d->io) > 0)
        if (ferry_io_reap(d->io, done, 1, FERRY__ARRAY_LEN(done), -1) < 0)
            break;
}

static void drives_close(ferry_gds *g)
{
    for (unsigned i = 0; i < g->ndrives; i++) {
        drive *d = &g->drives[i];
        drive_quiesce(d);
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
        ferry__gds_add_fallback(g, "uring refused (%s), using posix", ferry_last_error());
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
        ferry__gds_add_fallback(g, "%s: O_DIRECT refused, buffered I/O: %s", d->path, fb);
        FERRY_LOGW("gds: %s: O_DIRECT refused by the file system, using buffered I/O: %s",
                   d->path, fb);
    }
    d->bytes = ferry__stripe_share(g->size, g->stripe, g->ndrives, i);
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

    /* the slab files on one file system together, before any is made:
     * checked one by one, each fits where their sum does not, and the last
     * one's allocate fails after those before it filled the disk */
    uint64_t part[FERRY_GDS_MAX_DIRS];
    for (unsigned i = 0; i < g->ndrives; i++)
        part[i] = ferry__stripe_share(g->size, g->stripe, g->ndrives, i);
    char what[64];
    snprintf(what, sizeof what, "gds: slab of %llu bytes", (unsigned long long)g->size);
    if ((rc = ferry__fs_room_check(cfg->dirs, FERRY_GDS_SLAB_NAME, part, g->ndrives, what,
                                   &g->err)) < 0) {
        g->ndrives = 0;
        g->size = 0;
        return rc;
    }

    /* the driver */
    int auto_pick = 0;
    if ((rc = ferry__gds_driver_select(g, cfg, &auto_pick)) < 0)
        return rc;

    /* the slab files, one per drive */
    unsigned opened = 0;
    for (unsigned i = 0; i < g->ndrives; i++, opened++)
        if ((rc = drive_open(g, cfg, i, engine)) < 0)
            break;
    if (rc >= 0)
        rc = ferry__gds_drives_attach(g, auto_pick);
    if (rc >= 0) {
        ferry_slab_options so = FERRY_SLAB_OPTIONS_INIT;
        so.capacity = g->size;
        so.alignment = align;
        if ((rc = ferry_slab_create(&so, &g->slab)) < 0)
            ferry__err_pass(&g->err, rc);
    }
    if (rc < 0) {
        ferry__gds_drives_deregister(g);
        g->ndrives = opened < g->ndrives ? opened + 1 : g->ndrives;
        drives_close(g);
        ferry__gds_driver_drop(g);
        g->size = 0;
        return rc;
    }
    if (g->fallback[0])
        FERRY_LOGI("gds: on with driver %s, %u drive(s): %s", g->drv.name, g->ndrives,
                   g->fallback);
    /* last: a thread reading `on` without mu sees everything above once it
     * sees 1 (gds_impl.h) */
    atomic_store(&g->on, 1);
    return 0;
}

int ferry_gds_init(ferry_gds *g, const ferry_gds_config *cfg)
{
    if (!g)
        return ferry__err_set(NULL, -EINVAL, "gds: init of a NULL context");
    if (!cfg)
        return 0; /* LMCache: no config leaves the context off */
    /* an older caller's struct ends before the newer members: their defaults */
    static const ferry__member later[] = {FERRY__MEMBER(ferry_gds_config, mode)};
    static const ferry__sized sized =
        FERRY__SIZED(ferry_gds_config, FERRY_GDS_CONFIG_MIN_SIZE, later);
    ferry_gds_config c = FERRY_GDS_CONFIG_INIT;
    int rc = ferry__opts_take(&g->err, "gds init", &sized, &c, cfg);
    if (rc < 0)
        return rc;
    pthread_mutex_lock(&g->mu);
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
    if (!out)
        return ferry__err_set(NULL, -EINVAL, "gds: open: NULL out");
    ferry_gds *g = NULL;
    int rc = gds_alloc(&g);
    if (rc < 0)
        return rc;
    if (cfg && (rc = ferry_gds_init(g, cfg)) < 0) {
        ferry_gds_close(g);
        return rc;
    }
    *out = g;
    return 0;
}

void ferry_gds_close(ferry_gds *g)
{
    if (!g)
        return;
    ferry__gds_async_drain(g);
    pthread_mutex_lock(&g->hmu); /* (waits for a registration still pinning) */
    pthread_mutex_lock(&g->mu);
    if (g->on) {
        ferry__gds_regions_release(g);
        ferry__gds_drives_deregister(g);
        drives_close(g);
        ferry__gds_async_release(g); /* (no queue holds a hop's requests now) */
        ferry__gds_driver_drop(g);
        ferry_slab_destroy(g->slab);
        atomic_store(&g->on, 0);
    }
    ferry__free(g->regions);
    ferry__free(g->hostbufs);
    pthread_mutex_unlock(&g->mu);
    pthread_mutex_unlock(&g->hmu);
    pthread_mutex_destroy(&g->mu);
    pthread_mutex_destroy(&g->hmu);
    pthread_mutex_destroy(&g->amu);
    ferry__free(g);
}
