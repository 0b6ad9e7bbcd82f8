/*
 * gds_driver.c - which driver a GDS context talks to, and its file handles.
 *
 * Invariant: a context holds exactly one open driver while it is on (a
 * custom table, or a shipped one: cufile | hipfile | cpu), and every
 * drive's slab file is registered with that driver (handle_ok) before the
 * context turns on. "auto" tries the GDS drivers that can work with the
 * context's device and ends at the cpu driver, which works everywhere;
 * each refusal on the way is kept in the fallback text, so a user who
 * wanted GDS learns why they did not get it. When auto's GDS driver opens
 * but refuses the slab files (overlayfs, LVM: cuFile 5030/5008), the
 * context drops it and registers the files with the cpu driver instead.
 *
 * Caller holds the context's mu for everything here but
 * ferry__gds_backend_find, which reads only the constant table.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "gds_impl.h"

/* the shipped drivers; "auto" tries the probed ones in this order, then
 * the cpu driver. Adding a driver: a drv_NAME.c defining its backend,
 * and a row here. */
static const ferry__gds_backend *const registry[] = {
    &ferry__gds_backend_cufile,
    &ferry__gds_backend_hipfile,
    &ferry__gds_backend_cpu,
};

const ferry__gds_backend *ferry__gds_backend_find(const char *name)
{
    for (size_t i = 0; i < FERRY__ARRAY_LEN(registry); i++)
        if (!strcmp(registry[i]->name, name))
            return registry[i];
    return NULL;
}

/* "auto|cufile|hipfile|cpu" */
static void backend_names(char *out, size_t len)
{
    size_t n = (size_t)snprintf(out, len, "auto");
    for (size_t i = 0; i < FERRY__ARRAY_LEN(registry) && n < len; i++)
        n += (size_t)snprintf(out + n, len - n, "|%s", registry[i]->name);
}

/* construct and open backend b; 0, or a code with the reason in why */
static int driver_pick(ferry_gds *g, const ferry__gds_backend *b, char *why, size_t why_len)
{
    ferry_gds_driver d;
    ferry__gds_destroy_fn destroy = NULL;
    int rc = b->make(&d, &destroy);
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

void ferry__gds_driver_drop(ferry_gds *g)
{
    if (g->drv_open && g->drv.close)
        g->drv.close(g->drv.ctx);
    if (g->destroy)
        g->destroy(g->drv.ctx);
    g->drv_open = 0;
    g->destroy = NULL;
    memset(&g->drv, 0, sizeof g->drv);
}

void ferry__gds_drives_deregister(ferry_gds *g)
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
            ferry__gds_drives_deregister(g);
            return ferry__err_set(&g->err, rc, "gds: %s: registering %s with the %s driver: %s",
                                  d->dir, d->path, g->drv.name, m);
        }
        d->handle = h;
        d->handle_ok = 1;
    }
    return 0;
}

/* a caller's own table (tests, vendors): checked, copied, opened */
static int custom_open(ferry_gds *g, const ferry_gds_driver *cd)
{
    if (cd->size < sizeof(ferry_gds_driver) || !cd->read || !cd->write)
        return ferry__err_set(&g->err, -EINVAL,
                              "gds: custom driver '%s': short table or no read/write",
                              cd->name ? cd->name : "?");
    g->drv = *cd;
    if (!g->drv.name)
        g->drv.name = "custom";
    int rc = g->drv.open ? g->drv.open(g->drv.ctx, g->dev) : 0;
    if (rc < 0) {
        memset(&g->drv, 0, sizeof g->drv);
        return ferry__err_set(&g->err, rc, "gds: custom driver open failed: %s",
                              ferry_last_error());
    }
    g->drv_open = 1;
    return 0;
}

/* auto: the GDS drivers this device can use, in table order, then the
 * cpu driver; each refusal is kept in the fallback text */
static int auto_open(ferry_gds *g)
{
    char why[FERRY__ERRMSG_MAX];
    int rc = -1, tried = 0;
    for (size_t i = 0; i < FERRY__ARRAY_LEN(registry) && rc < 0; i++) {
        const ferry__gds_backend *b = registry[i];
        if (!b->probe || !b->probe(g->dev))
            continue;
        tried = 1;
        rc = driver_pick(g, b, why, sizeof why);
        if (rc < 0)
            ferry__gds_add_fallback(g, "%s driver: %s", b->name, why);
    }
    if (!tried)
        ferry__gds_add_fallback(g, "GDS drivers not tried: device backend is %s, not cuda",
                                g->dev ? ferry_device_backend(g->dev) : "none");
    if (rc < 0 && (rc = driver_pick(g, &ferry__gds_backend_cpu, why, sizeof why)) < 0)
        return ferry__err_set(&g->err, rc, "gds: cpu driver: %s", why);
    return 0;
}

/* the driver cfg asks for; *auto_pick tells whether "auto" chose it */
int ferry__gds_driver_select(ferry_gds *g, const ferry_gds_config *cfg, int *auto_pick)
{
    *auto_pick = 0;
    if (cfg->custom_driver)
        return custom_open(g, cfg->custom_driver);
    if (!cfg->driver || !*cfg->driver || !strcmp(cfg->driver, "auto")) {
        *auto_pick = 1;
        return auto_open(g);
    }
    char why[FERRY__ERRMSG_MAX];
    const ferry__gds_backend *b = ferry__gds_backend_find(cfg->driver);
    int rc;
    if (!b) {
        char names[128];
        backend_names(names, sizeof names);
        snprintf(why, sizeof why, "unknown driver '%s' (%s)", cfg->driver, names);
        rc = -EINVAL;
    } else {
        rc = driver_pick(g, b, why, sizeof why);
    }
    if (rc < 0)
        return ferry__err_set(&g->err, rc == -EINVAL ? rc : FERRY_ENODEV,
                              "gds: driver %s is not usable here: %s", cfg->driver, why);
    return 0;
}

/* every drive's file registered with the driver; an auto-picked GDS
 * driver that refuses them gives way to the cpu driver */
int ferry__gds_drives_attach(ferry_gds *g, int auto_pick)
{
    int rc = drives_register(g);
    if (rc < 0 && auto_pick && strcmp(g->drv.name, ferry__gds_backend_cpu.name)) {
        /* LMCache users hit this on overlayfs/LVM: fall back, say so */
        char m[FERRY__ERRMSG_MAX], why[FERRY__ERRMSG_MAX];
        snprintf(m, sizeof m, "%s", ferry__err_msg(&g->err));
        FERRY_LOGW("%s; falling back to the cpu driver", m);
        ferry__gds_add_fallback(g, "%s; using the cpu driver", m);
        ferry__gds_driver_drop(g);
        rc = driver_pick(g, &ferry__gds_backend_cpu, why, sizeof why);
        if (rc < 0)
            ferry__err_set(&g->err, rc, "gds: cpu driver: %s", why);
        else
            rc = drives_register(g);
    }
    return rc;
}
