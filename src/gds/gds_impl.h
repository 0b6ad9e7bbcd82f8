/*
 * gds_impl.h - the GDS context's state, shared by its files (private).
 *
 * One context, one concept per file:
 *   gds.c         life: create/init/open/close, config checks, slab files
 *                 (one per drive, each directory locked before its file is
 *                 created or truncated), creation modes
 *   gds_driver.c  the driver table, selection ("auto" and by name) and the
 *                 fallback to the cpu driver; file handles with the driver
 *   gds_region.c  the region and stream registry (register/deregister)
 *   gds_xfer.c    device transfers: segments, sync and async, checkpoint
 *                 batches that keep async argument blocks alive
 *   gds_host.c    host transfers: the asynchronous host-I/O engine
 *                 (submit/reap) over the drive queues, host buffers
 *   gds_live.c    the process's table of asynchronous host requests in
 *                 flight, whichever context took them
 *   gds_stats.c   accessors, stats, the extent forms of the transfers
 *
 * Locks: hmu guards the table of registered host buffers and is held
 * across a host registration (which may pin for seconds: device transfers
 * take mu, so mu is never held across it); mu guards the registry
 * (regions, streams, batches, the on flag); each drive's mu guards its
 * ferry_io (single-threaded) and the hops' per-drive counters; amu guards
 * the done list of asynchronous host requests; a chain lock of the
 * table of requests in flight (gds_live.c over core's live_table.c)
 * guards its chain. Order: hmu before mu; mu before a drive's mu; drives
 * in index order; amu; a live chain last.
 * `on` is atomic besides: init sets it (under mu) only after everything
 * it publishes is in place, and callers that take no lock (host
 * transfers, buffer alloc, the accessors) read it once before the rest.
 * A function named "..._locked" or documented "caller holds mu" expects mu.
 */
#ifndef FERRY_SRC_GDS_IMPL_H
#define FERRY_SRC_GDS_IMPL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "core.h"
#include "driver.h"
#include "ferry/gds.h"
#include "live_table.h"
#include "stripe.h"

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

/* a host buffer registered with the drive queues (ferry_gds_host_register) */
typedef struct hostbuf {
    void *buf;
    size_t len;
} hostbuf;

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

/* an asynchronous host request in the process's table (gds_live.c) */
typedef struct ferry__gds_live {
    ferry__live_node node;        /* in the table, from submit until reaped */
    const ferry_gds_req *req;     /* the key */
    ferry_gds *owner;             /* the context that took it */
} ferry__gds_live;

struct ferry_gds {
    pthread_mutex_t mu;
    _Atomic int on;
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
    pthread_mutex_t hmu;
    hostbuf *hostbufs;           /* registered host buffers (under hmu) */
    size_t nhost, caphost;
    uint64_t async_pending; /* under mu */
    _Atomic uint64_t bytes_read, bytes_written, driver_ios, engine_ios, checkpoints;
    /* asynchronous host requests: completed ones wait here for ferry_gds_reap */
    pthread_mutex_t amu;
    struct hop *done_head, *done_tail;
    struct hop *live;            /* submitted and not yet reaped (under amu) */
    unsigned ndone;
    _Atomic unsigned async_hops; /* submitted and not yet reaped */
};

/* a list of segments, the first 32 without an allocation */
typedef struct segv {
    seg *v;
    size_t n, cap;
    seg small[32];
} segv;

static inline const char *ferry__gds_dirname(int dir)
{
    return dir == FERRY_GDS_READ ? "read" : "write";
}

/* gds.c */
void ferry__gds_add_fallback(ferry_gds *g, const char *fmt, ...) FERRY__PRINTF(2, 3);

/* gds_driver.c (caller holds mu) */
int ferry__gds_driver_select(ferry_gds *g, const ferry_gds_config *cfg, int *auto_pick);
int ferry__gds_drives_attach(ferry_gds *g, int auto_pick);
void ferry__gds_drives_deregister(ferry_gds *g);
void ferry__gds_driver_drop(ferry_gds *g);

/* gds_region.c (caller holds mu) */
gstream *ferry__gds_stream_find(ferry_gds *g, ferry_stream *s);
gstream *ferry__gds_stream_new(ferry_gds *g, ferry_stream *s);
void ferry__gds_stream_link(ferry_gds *g, gstream *st);
void ferry__gds_stream_unlink_free(ferry_gds *g, gstream *st);
const region *ferry__gds_region_find(const ferry_gds *g, ferry_devptr p);
void ferry__gds_regions_release(ferry_gds *g);

/* gds_xfer.c */
int ferry__gds_check_range(ferry_gds *g, const char *what, uint64_t slab_off, size_t len);
void ferry__gds_drain_batches(ferry_gds *g, gstream *st); /* caller holds mu */

/* gds_host.c (close: drain before the drives close, release after) */
void ferry__gds_async_drain(ferry_gds *g);
void ferry__gds_async_release(ferry_gds *g);
/* test seam: how a drive's queue is reaped (NULL: ferry_io_reap), so a
 * test can make a drive's queue break */
typedef int (*ferry__gds_reap_fn)(ferry_io *io, ferry_io_req **done, unsigned min, unsigned max,
                                  int timeout_ms);
void ferry__gds_reap_seam(ferry__gds_reap_fn fn);

/* gds_live.c: take e->req for e->owner; NULL when taken, else the context
 * it is in flight on already (e->owner itself, or another) */
ferry_gds *ferry__gds_live_take(ferry__gds_live *e);
void ferry__gds_live_drop(ferry__gds_live *e);
/* (tests) the most requests one chain of the table holds now */
unsigned ferry__gds_live_longest(void);

#endif
