/*
 * slotdev_device.c - the slot device on a ferry_device (host or cuda
 * backend): expert slots in device memory, copies on one stream.
 *
 * One arena per bank, not one allocation per slot. The seed allocates each
 * slot separately because Rust cannot lend a shared and a mutable view of
 * one buffer at once; in C a slot is an integer device address,
 *     base[bank] + slot * pitch[bank],
 * computed only after slot < slots is checked, with pitch = row_bytes
 * rounded up to 256 bytes so no two slots overlap and every slot is as
 * aligned as a cuMemAlloc result. What the arena buys: `banks` allocations
 * instead of slots * banks (thousands of cuMemAlloc calls, each slow and
 * each rounded up to the allocator's granularity), a pool footprint known
 * and reserved before serving starts, and slots at a fixed stride that a
 * batched kernel can index. The safety the seed wanted from separate
 * allocations - a copy never spills into a neighbour - comes from the
 * bounds check and the pitch, and on the host backend the device layer
 * also refuses any copy that leaves a live allocation.
 *
 * Copies are asynchronous on the context's stream; flush synchronises it
 * and returns the first error any queued copy met, which is exactly the
 * contract the executor relies on (a failed flush: nothing of the plan is
 * trusted). Prefetch plans use a second stream, synchronised by
 * flush_prefetch, so they overlap what the engine does next.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "moe/moe_internal.h"

#define SLOT_ALIGN 256u

typedef struct devslots {
    ferry_device *dev;
    ferry_stream *stream;   /* plans */
    ferry_stream *pstream;  /* prefetch plans */
    ferry_stream *cur;      /* where the current plan's copies go */
    uint32_t slots, banks;
    size_t row_bytes[FERRY_MOE_MAX_BANKS], pitch[FERRY_MOE_MAX_BANKS];
    ferry_devptr base[FERRY_MOE_MAX_BANKS];
} devslots;

static void ds_destroy(void *ctx)
{
    devslots *d = ctx;
    if (!d)
        return;
    if (d->stream)
        (void)ferry_stream_destroy(d->stream);
    if (d->pstream)
        (void)ferry_stream_destroy(d->pstream);
    for (uint32_t b = 0; b < d->banks; b++)
        if (d->base[b])
            (void)ferry_device_free(d->dev, d->base[b]);
    ferry__free(d);
}

static int ds_begin(void *ctx, int route)
{
    /* pageable rows are copied from where they are (the driver stages
     * them), pinned rows go by DMA; a prefetch goes on its own stream so
     * it overlaps the plans and compute that follow */
    devslots *d = ctx;
    d->cur = route == FERRY_MOE_ROUTE_PREFETCH ? d->pstream : d->stream;
    return 0;
}

static int check(const devslots *d, uint32_t bank, uint32_t slot, const char *what)
{
    if (bank >= d->banks || slot >= d->slots)
        return ferry__err_set(NULL, -EINVAL, "moe device slots: %s: bank %u slot %u out of range "
                              "(%u banks, %u slots)", what, bank, slot, d->banks, d->slots);
    return 0;
}

static int ds_write(void *ctx, uint32_t bank, uint32_t slot, const void *src, size_t n)
{
    devslots *d = ctx;
    int rc = check(d, bank, slot, "write");
    if (rc < 0)
        return rc;
    if (n != d->row_bytes[bank])
        return ferry__err_set(NULL, FERRY_EMISMATCH,
                              "moe device slots: bank %u slot %u is %zu bytes, the row offered is %zu",
                              bank, slot, d->row_bytes[bank], n);
    return ferry_memcpy_htod_async(d->cur, d->base[bank] + (ferry_devptr)slot * d->pitch[bank],
                                   src, n);
}

static int ds_copy(void *ctx, uint32_t bank, uint32_t dst, uint32_t src)
{
    devslots *d = ctx;
    int rc = check(d, bank, dst, "copy");
    if (rc == 0)
        rc = check(d, bank, src, "copy");
    if (rc < 0)
        return rc;
    if (dst == src)
        return 0;
    return ferry_memcpy_dtod_async(d->cur, d->base[bank] + (ferry_devptr)dst * d->pitch[bank],
                                   d->base[bank] + (ferry_devptr)src * d->pitch[bank],
                                   d->row_bytes[bank]);
}

static int ds_read_file(void *ctx, uint32_t bank, uint32_t slot, ferry_io *io, ferry_file *f,
                        uint64_t off, size_t n)
{
    devslots *d = ctx;
    int rc = check(d, bank, slot, "read");
    if (rc < 0)
        return rc;
    if (n != d->row_bytes[bank])
        return ferry__err_set(NULL, FERRY_EMISMATCH,
                              "moe device slots: bank %u slot %u is %zu bytes, the file row is %zu",
                              bank, slot, d->row_bytes[bank], n);
    /* GDS moves it by DMA; otherwise the engine's bounce path copies on
     * our stream, so it is ordered with the plan's other copies */
    return ferry_io_read_dev(io, f, d->cur,
                             d->base[bank] + (ferry_devptr)slot * d->pitch[bank], n, off);
}

static int ds_flush(void *ctx)
{
    devslots *d = ctx;
    return ferry_stream_sync(d->stream);
}

static int ds_flush_prefetch(void *ctx)
{
    devslots *d = ctx;
    return ferry_stream_sync(d->pstream);
}

static const ferry_moe_slot_device_ops device_ops = {
    .size = sizeof(ferry_moe_slot_device_ops),
    .begin_plan = ds_begin,
    .write_slot = ds_write,
    .copy_slot = ds_copy,
    .read_file = ds_read_file,
    .flush = ds_flush,
    .destroy = ds_destroy,
    .flush_prefetch = ds_flush_prefetch,
};

int ferry_moe_device_slots_open(ferry_device *dev, const ferry_moe_geometry *g,
                                const ferry_moe_slot_device_ops **ops, void **ctx)
{
    int rc = ferry__geometry_check(g, "device slots", 1);
    if (rc < 0)
        return rc;
    if (!dev || !ops || !ctx)
        return ferry__err_set(NULL, -EINVAL, "moe device slots: no device or out-parameters");
    devslots *d = ferry__calloc(1, sizeof *d);
    if (!d)
        return ferry__err_set(NULL, -ENOMEM, "moe device slots: out of memory");
    d->dev = dev;
    d->slots = g->slots;
    d->banks = g->banks;
    for (uint32_t b = 0; b < g->banks; b++) {
        d->row_bytes[b] = g->row_bytes[b];
        d->pitch[b] = FERRY__ALIGN_UP(g->row_bytes[b], (size_t)SLOT_ALIGN);
        if (d->pitch[b] > SIZE_MAX / g->slots) {
            ds_destroy(d);
            return ferry__err_set(NULL, -EINVAL, "moe device slots: %u slots of %zu bytes overflow",
                                  g->slots, d->pitch[b]);
        }
        rc = ferry_device_alloc(dev, d->pitch[b] * g->slots, &d->base[b]);
        if (rc < 0) {
            char cause[FERRY__ERRMSG_MAX];
            snprintf(cause, sizeof cause, "%s", ferry_last_error());
            ds_destroy(d);
            return ferry__err_set(NULL, rc, "moe device slots: bank %u: %u slots x %zu bytes: %s",
                                  b, g->slots, FERRY__ALIGN_UP(g->row_bytes[b], (size_t)SLOT_ALIGN),
                                  cause);
        }
    }
    rc = ferry_stream_create(dev, &d->stream);
    if (rc == 0)
        rc = ferry_stream_create(dev, &d->pstream);
    d->cur = d->stream;
    if (rc < 0) {
        char cause[FERRY__ERRMSG_MAX];
        snprintf(cause, sizeof cause, "%s", ferry_last_error());
        ds_destroy(d);
        return ferry__err_set(NULL, rc, "moe device slots: stream: %s", cause);
    }
    *ops = &device_ops;
    *ctx = d;
    return 0;
}

ferry_devptr ferry_moe_device_slot_ptr(void *ctx, uint32_t bank, uint32_t slot)
{
    devslots *d = ctx;
    if (!d || bank >= d->banks || slot >= d->slots)
        return 0;
    return d->base[bank] + (ferry_devptr)slot * d->pitch[bank];
}
