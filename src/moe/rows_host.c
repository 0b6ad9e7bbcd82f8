/*
 * rows_host.c - expert rows in host memory: the caller's banks (with the
 * pinned / locked / pageable residency classes and a pin budget) and the
 * caller's own callback.
 *
 * Invariant: a layer's class says what was actually done to every bank's
 * range of that layer, and destroy undoes exactly that: ferry_device_unpin
 * for PINNED, munlock for LOCKED, nothing for PAGEABLE. Pinning goes layer
 * by layer, in order, while the budget lasts, so the budget is never
 * exceeded and a partial failure leaves a clean prefix pinned. Pinned
 * memory is what makes an asynchronous host-to-device copy truly
 * asynchronous (DMA); locked memory at least cannot be paged out mid-copy;
 * pageable layers are flagged so the device may stage them whole.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "moe/moe_internal.h"

typedef struct host_rows {
    ferry_moe_rows base;
    char *bank[FERRY_MOE_MAX_BANKS];
    ferry_device *dev;
    uint8_t *klass;  /* per layer */
} host_rows;

static size_t layer_bytes(const ferry_moe_geometry *g, uint32_t b)
{
    return (size_t)g->num_experts * g->row_bytes[b];
}

static const void *host_row(const ferry_moe_rows *r, uint32_t bank, uint32_t layer, uint32_t row,
                            size_t *len)
{
    const host_rows *h = (const host_rows *)r;
    const ferry_moe_geometry *g = &r->g;
    if (bank >= g->banks || layer >= g->num_layers || row >= g->num_experts)
        return NULL;
    *len = g->row_bytes[bank];
    return h->bank[bank] + ((size_t)layer * g->num_experts + row) * g->row_bytes[bank];
}

static int host_class(const ferry_moe_rows *r, uint32_t layer)
{
    const host_rows *h = (const host_rows *)r;
    if (layer >= r->g.num_layers)
        return -EINVAL;
    return h->klass[layer];
}

static void host_destroy(ferry_moe_rows *r)
{
    host_rows *h = (host_rows *)r;
    const ferry_moe_geometry *g = &r->g;
    for (uint32_t l = 0; l < g->num_layers; l++) {
        for (uint32_t b = 0; b < g->banks; b++) {
            char *p = h->bank[b] + (size_t)l * layer_bytes(g, b);
            if (h->klass[l] == FERRY_MOE_PINNED)
                (void)ferry_device_unpin(h->dev, p);
            else if (h->klass[l] == FERRY_MOE_LOCKED)
                (void)munlock(p, layer_bytes(g, b));
        }
    }
    ferry__free(h->klass);
    ferry__free(h);
}

static const ferry__rows_ops host_ops = {
    .name = "host",
    .host_row = host_row,
    .klass = host_class,
    .destroy = host_destroy,
};

/* pin every bank's range of layer l; all or nothing */
static int pin_layer(host_rows *h, uint32_t l)
{
    const ferry_moe_geometry *g = &h->base.g;
    for (uint32_t b = 0; b < g->banks; b++) {
        int rc = ferry_device_pin(h->dev, h->bank[b] + (size_t)l * layer_bytes(g, b),
                                  layer_bytes(g, b));
        if (rc < 0) {
            while (b-- > 0)
                (void)ferry_device_unpin(h->dev, h->bank[b] + (size_t)l * layer_bytes(g, b));
            return rc;
        }
    }
    return 0;
}

static int lock_layer(host_rows *h, uint32_t l)
{
    const ferry_moe_geometry *g = &h->base.g;
    for (uint32_t b = 0; b < g->banks; b++) {
        if (mlock(h->bank[b] + (size_t)l * layer_bytes(g, b), layer_bytes(g, b)) != 0) {
            while (b-- > 0)
                (void)munlock(h->bank[b] + (size_t)l * layer_bytes(g, b), layer_bytes(g, b));
            return -errno;
        }
    }
    return 0;
}

int ferry_moe_rows_host(const ferry_moe_geometry *g, void *const *base, ferry_device *dev,
                        uint64_t pin_budget, ferry_moe_rows **out)
{
    int rc = ferry__geometry_check(g, "host rows", 0);
    if (rc < 0)
        return rc;
    if (!base || !out)
        return ferry__err_set(NULL, -EINVAL, "moe host rows: no banks or out-parameter");
    for (uint32_t b = 0; b < g->banks; b++) {
        if (!base[b])
            return ferry__err_set(NULL, -EINVAL, "moe host rows: bank %u has no memory", b);
        /* rows are addressed as base + offset: the bank must not wrap */
        size_t bytes = (size_t)g->num_layers * layer_bytes(g, b);
        if (bytes > UINTPTR_MAX - (uintptr_t)base[b])
            return ferry__err_set(NULL, -EINVAL,
                                  "moe host rows: bank %u of %zu bytes at %p wraps around the "
                                  "address space",
                                  b, bytes, base[b]);
    }
    host_rows *h = ferry__calloc(1, sizeof *h);
    uint8_t *klass = ferry__malloc(g->num_layers);
    if (!h || !klass) {
        ferry__free(h);
        ferry__free(klass);
        return ferry__err_set(NULL, -ENOMEM, "moe host rows: out of memory");
    }
    h->base.ops = &host_ops;
    h->base.g = *g;
    h->dev = dev;
    h->klass = klass;
    for (uint32_t b = 0; b < g->banks; b++)
        h->bank[b] = base[b];
    if (!pin_budget) {
        const char *env = getenv("FERRY_MOE_PIN_BUDGET");
        if (env && ferry_parse_size(env, &pin_budget) < 0)
            FERRY_LOGW("moe host rows: FERRY_MOE_PIN_BUDGET='%s' is not a size; no budget", env);
    }
    uint64_t per_layer = 0, pinned = 0;
    for (uint32_t b = 0; b < g->banks; b++)
        per_layer += layer_bytes(g, b);
    int pin_ok = dev != NULL, lock_ok = dev != NULL;
    for (uint32_t l = 0; l < g->num_layers; l++) {
        klass[l] = FERRY_MOE_PAGEABLE;
        if (pin_ok && (!pin_budget || pinned + per_layer <= pin_budget)) {
            if (pin_layer(h, l) == 0) {
                klass[l] = FERRY_MOE_PINNED;
                pinned += per_layer;
                continue;
            }
            FERRY_LOGI("moe host rows: pinning layer %u (%llu bytes) failed: %s; the rest is "
                       "locked or pageable",
                       l, (unsigned long long)per_layer, ferry_last_error());
            pin_ok = 0;
        } else
            pin_ok = 0;
        if (lock_ok) {
            if (lock_layer(h, l) == 0)
                klass[l] = FERRY_MOE_LOCKED;
            else
                lock_ok = 0;
        }
    }
    *out = &h->base;
    return 0;
}

/* ---- the caller's callback ---- */
typedef struct fn_rows {
    ferry_moe_rows base;
    ferry_moe_row_fn fn;
    void *ctx;
} fn_rows;

static const void *fn_row(const ferry_moe_rows *r, uint32_t bank, uint32_t layer, uint32_t row,
                          size_t *len)
{
    const fn_rows *f = (const fn_rows *)r;
    *len = 0;
    return f->fn(f->ctx, bank, layer, row, len);
}

static int fn_class(const ferry_moe_rows *r, uint32_t layer)
{
    return layer < r->g.num_layers ? FERRY_MOE_PAGEABLE : -EINVAL;
}

static void fn_destroy(ferry_moe_rows *r)
{
    ferry__free(r);
}

static const ferry__rows_ops fn_ops = {
    .name = "callback",
    .host_row = fn_row,
    .klass = fn_class,
    .destroy = fn_destroy,
};

int ferry_moe_rows_fn(const ferry_moe_geometry *g, ferry_moe_row_fn fn, void *ctx,
                      ferry_moe_rows **out)
{
    int rc = ferry__geometry_check(g, "callback rows", 0);
    if (rc < 0)
        return rc;
    if (!fn || !out)
        return ferry__err_set(NULL, -EINVAL, "moe callback rows: no function or out-parameter");
    fn_rows *f = ferry__calloc(1, sizeof *f);
    if (!f)
        return ferry__err_set(NULL, -ENOMEM, "moe callback rows: out of memory");
    f->base.ops = &fn_ops;
    f->base.g = *g;
    f->fn = fn;
    f->ctx = ctx;
    *out = &f->base;
    return 0;
}

void ferry_moe_rows_destroy(ferry_moe_rows *r)
{
    if (r)
        r->ops->destroy(r);
}

int ferry_moe_rows_class(const ferry_moe_rows *r, uint32_t layer)
{
    if (!r)
        return -EINVAL;
    return r->ops->klass(r, layer);
}
