/*
 * gds_region.c - the region and stream registry of a GDS context.
 *
 * Invariants:
 *  - regions[] is sorted by base, regions never overlap, each is at most
 *    region_cap bytes, and the regions of one buffer are adjacent in the
 *    array (they tile [buf, buf+len)). A lookup is one binary search.
 *  - A stream is registered with the driver exactly while at least one
 *    region names it: the first region on a stream registers it, the last
 *    one to go deregisters it.
 *  - Everything register may need to allocate is allocated before its
 *    first driver call, and a driver failure undoes what the call
 *    registered, so a failure never leaves a half-registered buffer.
 * Why regions at all: cuFile resolves a buffer by its registered base, so
 * the transfers (gds_xfer.c) hand the driver a region's base plus an
 * offset, never an interior pointer, which would silently take cuFile's
 * slow unregistered path.
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "gds_impl.h"

/* ---- streams (caller holds mu) ---- */

gstream *ferry__gds_stream_find(ferry_gds *g, ferry_stream *s)
{
    for (gstream *st = g->streams; st; st = st->next)
        if (st->s == s)
            return st;
    return NULL;
}

gstream *ferry__gds_stream_new(ferry_gds *g, ferry_stream *s)
{
    gstream *st = ferry__calloc(1, sizeof *st);
    if (!st)
        return NULL;
    st->s = s;
    st->raw = s ? ferry_stream_handle(s) : 0;
    return st;
}

void ferry__gds_stream_link(ferry_gds *g, gstream *st)
{
    st->next = g->streams;
    g->streams = st;
    g->nstreams++;
}

void ferry__gds_stream_unlink_free(ferry_gds *g, gstream *st)
{
    int found = 0;
    for (gstream **pp = &g->streams; *pp; pp = &(*pp)->next)
        if (*pp == st) {
            *pp = st->next;
            g->nstreams--;
            found = 1;
            break;
        }
    FERRY__ASSERT(found); /* only a linked stream is freed this way */
    (void)found;
    ferry__free(st);
}

/* ---- regions ---- */

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

const region *ferry__gds_region_find(const ferry_gds *g, ferry_devptr p)
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
    gstream *st = ferry__gds_stream_find(g, s);
    int new_stream = !st;
    if (new_stream && !(st = ferry__gds_stream_new(g, s))) {
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
        ferry__gds_stream_link(g, st);
    /* sorted, never overlapping: the new regions fit between up - 1 and up */
    FERRY__ASSERT(up == 0 || g->regions[up - 1].base + g->regions[up - 1].len <= buf);
    FERRY__ASSERT(up == g->nreg || buf + len <= g->regions[up].base);
    FERRY__ASSERT(g->nreg + npieces <= g->capreg);
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
    /* a buffer's regions are adjacent, on one stream that counts them */
    FERRY__ASSERT(st && st->nregions >= k && g->nbuffers > 0);
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
        ferry__gds_drain_batches(g, st);
        if (st->registered && g->drv.stream_deregister) {
            int drc = g->drv.stream_deregister(g->drv.ctx, st->s, st->raw);
            if (drc < 0 && drc != FERRY_ENOTSUP)
                FERRY_LOGW("gds: deregister stream 0x%llx: %s", (unsigned long long)st->raw,
                           ferry_last_error());
        }
        if (st->err)
            FERRY_LOGW("gds: stream 0x%llx dropped with an unreported error: %s",
                       (unsigned long long)st->raw, st->errmsg);
        ferry__gds_stream_unlink_free(g, st);
    }
out:
    pthread_mutex_unlock(&g->mu);
    return rc;
}

/* close: every stream synchronized, every region and stream deregistered
 * from the driver (caller holds mu; the context is on) */
void ferry__gds_regions_release(ferry_gds *g)
{
    for (gstream *st = g->streams; st; st = st->next) {
        if (st->s && ferry_stream_sync(st->s) < 0)
            FERRY_LOGW("gds: close: stream sync failed: %s", ferry_last_error());
        ferry__gds_drain_batches(g, st);
    }
    for (size_t j = 0; j < g->nreg; j++)
        if (g->drv.buf_deregister && g->drv.buf_deregister(g->drv.ctx, g->regions[j].base) < 0)
            FERRY_LOGW("gds: close: deregister region 0x%llx: %s",
                       (unsigned long long)g->regions[j].base, ferry_last_error());
    while (g->streams) {
        gstream *st = g->streams;
        if (st->registered && g->drv.stream_deregister)
            g->drv.stream_deregister(g->drv.ctx, st->s, st->raw);
        ferry__gds_stream_unlink_free(g, st);
    }
}
