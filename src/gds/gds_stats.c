/*
 * gds_stats.c - what a caller may ask of a GDS context (driver, engine,
 * fallback reason, size, slab, stats) and the extent forms of the
 * transfers. Invariant: every accessor answers for a NULL or an off
 * context ("off", 0, NULL) instead of failing; stats are read under mu for
 * the registry and from atomics for the counters.
 */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "gds_impl.h"
#include "sized.h"

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
    /* (only once on: init writes the text before it turns `on` to 1) */
    return g && g->on && g->fallback[0] ? g->fallback : NULL;
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

int ferry_gds_stats_get(const ferry_gds *cg, ferry_gds_stats *out)
{
    if (!cg || !out)
        return ferry__err_set(NULL, -EINVAL, "ferry_gds_stats_get: context or out is NULL");
    ferry_gds *g = (ferry_gds *)cg; /* its mutex is taken, nothing written */
    pthread_mutex_lock(&g->mu);
    ferry_gds_stats s = FERRY_GDS_STATS_INIT;
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
    return ferry__stats_put(&g->err, "ferry_gds_stats_get", out, &s, sizeof s);
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
