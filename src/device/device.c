/*
 * device.c - the front of the device layer: argument checks, backend
 * selection, allocation tables, host fault injection, per-device messages.
 *
 * Invariants:
 *  - Every device allocation, pinned host allocation and pinned range a
 *    caller holds is in one of the device's sorted region tables, so an
 *    unknown, interior or double free is -EINVAL with a message (never a
 *    crash in the driver), and close can give back whatever is left. A
 *    region leaves its table BEFORE the backend frees it, so two threads
 *    freeing the same pointer cannot both reach the backend.
 *  - Capacity for one more table entry is reserved before the backend
 *    allocates, so a bookkeeping out-of-memory never has to undo a driver
 *    allocation half-way.
 *  - On the simulated (host) backend every device range a copy touches must
 *    lie inside one live allocation (FERRY_EBOUNDS otherwise): a bad address
 *    fails with a message here instead of corrupting the heap, as a GPU
 *    would fault. On cuda, foreign device pointers (another library's
 *    tensors) are allowed and the driver checks them.
 *  - Faults are counted under the device lock: "the Nth counted call" is
 *    well defined even when several threads use the device.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "device/device_impl.h"
#include "ferry/testctl.h"
#include "sized.h"

/* ---- messages ---- */

static int dev_fail(ferry_device *dev, int code, const char *fmt, ...) FERRY__PRINTF(3, 4);
static int dev_fail(ferry_device *dev, int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    if (dev) {
        pthread_mutex_lock(&dev->lock);
        ferry__err_vset(&dev->err, code, fmt, ap);
        pthread_mutex_unlock(&dev->lock);
    } else {
        ferry__err_vset(NULL, code, fmt, ap);
    }
    va_end(ap);
    return code;
}

/* a backend failed and left its message in the thread's buffer */
static int dev_pass(ferry_device *dev, int code)
{
    pthread_mutex_lock(&dev->lock);
    ferry__err_pass(&dev->err, code);
    pthread_mutex_unlock(&dev->lock);
    return code;
}

/* ---- region tables (caller holds dev->lock) ---- */

static int table_reserve(struct ferry__region_table *t)
{
    if (t->n < t->cap)
        return 0;
    size_t cap = t->cap ? t->cap * 2 : 16;
    struct ferry__region *v = ferry__realloc(t->v, cap * sizeof *v);
    if (!v)
        return -ENOMEM;
    t->v = v;
    t->cap = cap;
    return 0;
}

/* index of the first region whose base is > addr */
static size_t table_upper(const struct ferry__region_table *t, uint64_t addr)
{
    size_t lo = 0, hi = t->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (t->v[mid].base <= addr)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* the region containing addr, or NULL */
static struct ferry__region *table_find(const struct ferry__region_table *t, uint64_t addr)
{
    size_t i = table_upper(t, addr);
    if (i == 0)
        return NULL;
    struct ferry__region *r = &t->v[i - 1];
    return addr - r->base < r->len ? r : NULL;
}

/* a region overlapping [addr, addr + len), or NULL */
static struct ferry__region *table_overlap(const struct ferry__region_table *t, uint64_t addr,
                                           size_t len)
{
    size_t i = table_upper(t, addr);
    if (i > 0 && addr - t->v[i - 1].base < t->v[i - 1].len)
        return &t->v[i - 1];
    if (i < t->n && t->v[i].base - addr < len)
        return &t->v[i];
    return NULL;
}

/* needs table_reserve first */
static void table_insert(struct ferry__region_table *t, uint64_t base, size_t len, int kind)
{
    size_t i = table_upper(t, base);
    memmove(&t->v[i + 1], &t->v[i], (t->n - i) * sizeof t->v[0]);
    t->v[i] = (struct ferry__region){base, len, kind};
    t->n++;
}

static void table_remove(struct ferry__region_table *t, struct ferry__region *r)
{
    size_t i = (size_t)(r - t->v);
    memmove(&t->v[i], &t->v[i + 1], (t->n - i - 1) * sizeof t->v[0]);
    t->n--;
}

static const char *kind_name(int kind)
{
    switch (kind) {
    case FERRY__REG_DEVICE: return "device allocation";
    case FERRY__REG_HOST_ALLOC: return "pinned host allocation";
    default: return "pinned range";
    }
}

/* ---- fault injection ---- */

static const char *fault_kind_name(unsigned kind)
{
    switch (kind) {
    case FERRY_FAULT_ALLOC: return "alloc";
    case FERRY_FAULT_COPY: return "copy";
    case FERRY_FAULT_SYNC: return "sync";
    default: return "event";
    }
}

/* counts a call of this kind; its fail code when it is the Nth, else 0 */
static int fault_take(ferry_device *dev, unsigned kind, uint64_t *nth)
{
    /* unarmed (no ferry_test_control): one relaxed load, no lock */
    if (!dev->ops->simulated || !atomic_load_explicit(&dev->faults_on, memory_order_acquire))
        return 0;
    int code = 0;
    pthread_mutex_lock(&dev->lock);
    if (dev->fail_nth && (dev->fault_mask == 0 || (dev->fault_mask & kind))) {
        dev->fault_count++;
        if (dev->fault_count == dev->fail_nth) {
            code = dev->fail_code ? dev->fail_code : FERRY_EINJECTED;
            *nth = dev->fault_count;
        }
    }
    pthread_mutex_unlock(&dev->lock);
    return code;
}

static int fault_fail(ferry_device *dev, int code, uint64_t nth, unsigned kind, const char *what)
{
    return dev_fail(dev, code, "device %s: %s: injected fault (%s call %" PRIu64 "): %s",
                    dev->ops->name, what, fault_kind_name(kind), nth, ferry_strerror(code));
}

/* the fault for a copy of n bytes, in *f; returns f or NULL if none */
static const struct ferry__copy_fault *copy_fault(ferry_device *dev, size_t n,
                                                  struct ferry__copy_fault *f)
{
    if (!dev->ops->simulated || !atomic_load_explicit(&dev->faults_on, memory_order_acquire))
        return NULL;
    uint64_t nth = 0;
    f->fail_code = fault_take(dev, FERRY_FAULT_COPY, &nth);
    pthread_mutex_lock(&dev->lock);
    size_t sc = dev->short_copy;
    pthread_mutex_unlock(&dev->lock);
    f->short_bytes = (sc && sc < n) ? sc : n;
    if (f->fail_code)
        FERRY_LOGD("device %s: injecting failure %s into copy call %" PRIu64 " (%zu bytes)",
                   dev->ops->name, ferry_err_name(f->fail_code), nth, n);
    return (f->fail_code || f->short_bytes < n) ? f : NULL;
}

/* ---- backend selection ---- */

static const struct ferry__device_ops *backend_by_name(const char *name)
{
    if (strcmp(name, "host") == 0)
        return &ferry__device_host_ops;
    if (strcmp(name, "cuda") == 0)
        return &ferry__device_cuda_ops;
    return NULL;
}

int ferry_device_backend_available(const char *backend, const char **why)
{
    const char *dummy;
    if (!why)
        why = &dummy;
    if (!backend || strcmp(backend, "auto") == 0 || strcmp(backend, "host") == 0) {
        *why = "";
        return 1;
    }
    if (strcmp(backend, "cuda") == 0)
        return ferry__cuda_available(why);
    *why = "unknown device backend (known: auto, host, cuda)";
    return 0;
}

#define FAULT_KNOWN                                                                     \
    ((unsigned)(FERRY_FAULT_ALLOC | FERRY_FAULT_COPY | FERRY_FAULT_SYNC | FERRY_FAULT_EVENT))

static int device_try_open(const struct ferry__device_ops *ops, const ferry_device_options *opt,
                           ferry_device **out)
{
    ferry_device *dev = ferry__calloc(1, sizeof *dev);
    if (!dev)
        return ferry__err_set(NULL, -ENOMEM, "device %s: open: out of memory for the handle",
                              ops->name);
    dev->ops = ops;
    pthread_mutex_init(&dev->lock, NULL);
    pthread_mutex_init(&dev->helper_lock, NULL);
    atomic_init(&dev->faults_on, 0);
    dev->mem_limit = opt->mem_limit;
    int rc = ops->open(dev, opt);
    if (rc < 0) {
        pthread_mutex_destroy(&dev->lock);
        pthread_mutex_destroy(&dev->helper_lock);
        ferry__free(dev);
        return rc;
    }
    *out = dev;
    return 0;
}

int ferry_device_open(const ferry_device_options *uopt, ferry_device **out)
{
    if (!out)
        return ferry__err_set(NULL, -EINVAL, "device open: out is NULL");
    /* any prefix of the options from the minimum; the rest keeps its default */
    static const ferry__member later[] = {FERRY__MEMBER(ferry_device_options, mem_limit)};
    static const ferry__sized sized =
        FERRY__SIZED(ferry_device_options, FERRY_DEVICE_OPTIONS_MIN_SIZE, later);
    ferry_device_options o = FERRY_DEVICE_OPTIONS_INIT;
    if (uopt) {
        int rc = ferry__opts_take(NULL, "device open", &sized, &o, uopt);
        if (rc < 0)
            return rc;
    }
    const ferry_device_options *opt = &o;
    if (opt->ordinal < 0)
        return ferry__err_set(NULL, -EINVAL,
                              "device open: ordinal %d is negative; accepted 0..INT_MAX",
                              opt->ordinal);
    if (opt->backend && !*opt->backend)
        return ferry__err_set(NULL, -EINVAL,
                              "device open: backend is empty; accepted NULL, \"auto\", "
                              "\"host\" or \"cuda\"");
    const char *name = opt->backend ? opt->backend : "auto";
    const char *from = "options";
    if (strcmp(name, "auto") == 0) {
        const char *env = getenv("FERRY_DEVICE");
        if (env && *env) {
            name = env;
            from = "env FERRY_DEVICE";
        }
    }
    if (strcmp(name, "auto") == 0) {
        int rc = device_try_open(&ferry__device_cuda_ops, opt, out);
        if (rc == 0)
            return 0;
        if (rc == -ENOMEM)
            return rc;
        /* no driver or no device is the normal case on a CPU machine; a
         * driver that is there but fails deserves a warning */
        if (rc == FERRY_ENODEV)
            FERRY_LOGI("device auto: cuda unusable (%s); using host", ferry_last_error());
        else
            FERRY_LOGW("device auto: cuda failed (%s); using host", ferry_last_error());
        return device_try_open(&ferry__device_host_ops, opt, out);
    }
    const struct ferry__device_ops *ops = backend_by_name(name);
    if (!ops)
        return ferry__err_set(NULL, -EINVAL,
                              "device open: unknown backend '%s' (from %s; known: auto, host, "
                              "cuda)",
                              name, from);
    return device_try_open(ops, opt, out);
}

void ferry_device_close(ferry_device *dev)
{
    if (!dev)
        return;
    if (dev->helper) {
        dev->ops->stream_destroy(dev->helper);
        ferry__free(dev->helper);
        dev->helper = NULL;
    }
    /* leftovers: streams first (they may still be copying into the memory
     * freed below), then events, then memory */
    while (dev->streams) {
        ferry_stream *s = dev->streams;
        FERRY_LOGW("device %s: close: %s a stream the caller did not destroy", dev->ops->name,
                   s->imported ? "forgetting (not destroying) an engine's" : "destroying");
        dev->streams = s->next;
        if (!s->imported)
            dev->ops->stream_destroy(s);
        ferry__free(s);
    }
    while (dev->events) {
        ferry_event *e = dev->events;
        dev->events = e->next;
        if (!e->imported)
            dev->ops->event_destroy(e);
        ferry__free(e);
    }
    for (size_t i = dev->dev_regions.n; i-- > 0;) {
        struct ferry__region r = dev->dev_regions.v[i];
        FERRY_LOGD("device %s: close: freeing device allocation 0x%" PRIx64 " (%zu bytes)",
                   dev->ops->name, r.base, r.len);
        dev->ops->free(dev, r.base, r.len);
    }
    for (size_t i = dev->host_regions.n; i-- > 0;) {
        struct ferry__region r = dev->host_regions.v[i];
        if (r.kind == FERRY__REG_HOST_ALLOC)
            dev->ops->host_free(dev, (void *)(uintptr_t)r.base, r.len);
        else
            dev->ops->unpin(dev, (void *)(uintptr_t)r.base, r.len);
    }
    dev->ops->close(dev);
    ferry__free(dev->dev_regions.v);
    ferry__free(dev->host_regions.v);
    pthread_mutex_destroy(&dev->lock);
    pthread_mutex_destroy(&dev->helper_lock);
    ferry__free(dev);
}

const char *ferry_device_backend(const ferry_device *dev)
{
    return dev ? dev->ops->name : "";
}

const char *ferry_device_name(const ferry_device *dev)
{
    return dev ? dev->name : "";
}

const char *ferry_device_last_error(const ferry_device *dev)
{
    return dev ? ferry__err_msg(&dev->err) : "";
}

/* ferry_test_control(FERRY_TEST_DEVICE_FAULTS, dev, f) */
static int device_set_faults(ferry_device *dev, const ferry_device_faults *f)
{
    if (!dev)
        return ferry__err_set(NULL, -EINVAL, "device faults: dev is NULL");
    ferry_device_faults none = FERRY_DEVICE_FAULTS_INIT;
    if (!f)
        f = &none;
    if (f->size != sizeof *f)
        return dev_fail(dev, -EINVAL,
                        "device %s: faults: size %zu; accepted sizeof(ferry_device_faults), %zu",
                        dev->ops->name, f->size, sizeof *f);
    uint64_t fail_nth = f->fail_nth;
    int fail_code = f->fail_code;
    size_t short_copy = f->short_copy;
    unsigned fault_mask = f->fault_mask;
    if (!dev->ops->simulated && (fail_nth || short_copy))
        return dev_fail(dev, FERRY_ENOTSUP,
                        "device %s: fault injection is only available on the host backend",
                        dev->ops->name);
    if (fail_code > 0)
        return dev_fail(dev, -EINVAL,
                        "device %s: faults: fail_code %d is positive; accepted a negative code, "
                        "or 0 for FERRY_EINJECTED",
                        dev->ops->name, fail_code);
    if (fault_mask & ~FAULT_KNOWN)
        return dev_fail(dev, -EINVAL,
                        "device %s: faults: fault_mask 0x%x has unknown bits 0x%x; accepted "
                        "FERRY_FAULT_* bits (0x%x), 0 for all",
                        dev->ops->name, fault_mask, fault_mask & ~FAULT_KNOWN, FAULT_KNOWN);
    pthread_mutex_lock(&dev->lock);
    dev->fail_nth = fail_nth;
    dev->fail_code = fail_code;
    dev->short_copy = short_copy;
    dev->fault_mask = fault_mask;
    dev->fault_count = 0;
    atomic_store_explicit(&dev->faults_on, fail_nth != 0 || short_copy != 0, memory_order_release);
    pthread_mutex_unlock(&dev->lock);
    return 0;
}

int ferry_test_control(int op, void *target, const void *arg)
{
    switch (op) {
    case FERRY_TEST_DEVICE_FAULTS: return device_set_faults(target, arg);
    default:
        return ferry__err_set(NULL, -EINVAL,
                              "ferry_test_control: unknown op %d; accepted "
                              "FERRY_TEST_DEVICE_FAULTS (%d)",
                              op, (int)FERRY_TEST_DEVICE_FAULTS);
    }
}

/* ---- memory ---- */

int ferry_device_alloc(ferry_device *dev, size_t bytes, ferry_devptr *out)
{
    if (!dev || !out)
        return ferry__err_set(NULL, -EINVAL, "device alloc: %s is NULL", dev ? "out" : "dev");
    const char *bn = dev->ops->name;
    if (bytes == 0)
        return dev_fail(dev, -EINVAL, "device %s: alloc of 0 bytes", bn);
    uint64_t nth = 0;
    int code = fault_take(dev, FERRY_FAULT_ALLOC, &nth);
    if (code) {
        char what[64];
        snprintf(what, sizeof what, "alloc of %zu bytes", bytes);
        return fault_fail(dev, code, nth, FERRY_FAULT_ALLOC, what);
    }
    pthread_mutex_lock(&dev->lock);
    if (dev->mem_limit && bytes > dev->mem_limit - FERRY__MIN(dev->mem_used, dev->mem_limit)) {
        int rc = ferry__err_set(&dev->err, -ENOMEM,
                                "device %s: alloc of %zu bytes: out of device memory (%" PRIu64
                                " of %" PRIu64 " bytes in use)",
                                bn, bytes, dev->mem_used, dev->mem_limit);
        pthread_mutex_unlock(&dev->lock);
        return rc;
    }
    if (table_reserve(&dev->dev_regions) < 0) {
        int rc = ferry__err_set(&dev->err, -ENOMEM,
                                "device %s: alloc of %zu bytes: out of memory for the "
                                "allocation table",
                                bn, bytes);
        pthread_mutex_unlock(&dev->lock);
        return rc;
    }
    dev->mem_used += bytes;
    pthread_mutex_unlock(&dev->lock);

    ferry_devptr p = 0;
    int rc = dev->ops->alloc(dev, bytes, &p);
    pthread_mutex_lock(&dev->lock);
    if (rc < 0) {
        dev->mem_used -= bytes;
        ferry__err_pass(&dev->err, rc);
    } else {
        /* reserved above, but another thread may have used the slot */
        if (table_reserve(&dev->dev_regions) < 0) {
            dev->mem_used -= bytes;
            rc = ferry__err_set(&dev->err, -ENOMEM,
                                "device %s: alloc of %zu bytes: out of memory for the "
                                "allocation table",
                                bn, bytes);
        } else {
            table_insert(&dev->dev_regions, p, bytes, FERRY__REG_DEVICE);
        }
    }
    pthread_mutex_unlock(&dev->lock);
    if (rc < 0) {
        if (p)
            dev->ops->free(dev, p, bytes);
        return rc;
    }
    *out = p;
    return 0;
}

int ferry_device_free(ferry_device *dev, ferry_devptr ptr)
{
    if (!dev)
        return ferry__err_set(NULL, -EINVAL, "device free: dev is NULL");
    const char *bn = dev->ops->name;
    pthread_mutex_lock(&dev->lock);
    struct ferry__region *r = table_find(&dev->dev_regions, ptr);
    if (!r || r->base != ptr) {
        int rc;
        if (r)
            rc = ferry__err_set(&dev->err, -EINVAL,
                                "device %s: free of 0x%" PRIx64 ": interior pointer (+%" PRIu64
                                ") of allocation 0x%" PRIx64 " of %zu bytes",
                                bn, ptr, ptr - r->base, r->base, r->len);
        else
            rc = ferry__err_set(&dev->err, -EINVAL,
                                "device %s: free of 0x%" PRIx64
                                ": not a live allocation of this device (unknown or already "
                                "freed)",
                                bn, ptr);
        pthread_mutex_unlock(&dev->lock);
        return rc;
    }
    size_t len = r->len;
    table_remove(&dev->dev_regions, r);
    dev->mem_used -= len;
    pthread_mutex_unlock(&dev->lock);
    int rc = dev->ops->free(dev, ptr, len);
    return rc < 0 ? dev_pass(dev, rc) : 0;
}

int ferry_device_host_alloc(ferry_device *dev, size_t bytes, void **out)
{
    if (!dev || !out)
        return ferry__err_set(NULL, -EINVAL, "device host_alloc: %s is NULL",
                              dev ? "out" : "dev");
    const char *bn = dev->ops->name;
    if (bytes == 0)
        return dev_fail(dev, -EINVAL, "device %s: host_alloc of 0 bytes", bn);
    uint64_t nth = 0;
    int code = fault_take(dev, FERRY_FAULT_ALLOC, &nth);
    if (code) {
        char what[64];
        snprintf(what, sizeof what, "host_alloc of %zu bytes", bytes);
        return fault_fail(dev, code, nth, FERRY_FAULT_ALLOC, what);
    }
    pthread_mutex_lock(&dev->lock);
    int rc = table_reserve(&dev->host_regions);
    pthread_mutex_unlock(&dev->lock);
    if (rc < 0)
        return dev_fail(dev, -ENOMEM,
                        "device %s: host_alloc of %zu bytes: out of memory for the table", bn,
                        bytes);
    void *p = NULL;
    rc = dev->ops->host_alloc(dev, bytes, &p);
    if (rc < 0)
        return dev_pass(dev, rc);
    pthread_mutex_lock(&dev->lock);
    if (table_reserve(&dev->host_regions) < 0) {
        rc = ferry__err_set(&dev->err, -ENOMEM,
                            "device %s: host_alloc of %zu bytes: out of memory for the table",
                            bn, bytes);
    } else {
        table_insert(&dev->host_regions, (uint64_t)(uintptr_t)p, bytes, FERRY__REG_HOST_ALLOC);
    }
    pthread_mutex_unlock(&dev->lock);
    if (rc < 0) {
        dev->ops->host_free(dev, p, bytes);
        return rc;
    }
    *out = p;
    return 0;
}

/* removes a host region of this kind starting exactly at p; its length or an error */
static int host_region_take(ferry_device *dev, void *p, int kind, const char *what, size_t *len)
{
    const char *bn = dev->ops->name;
    uint64_t a = (uint64_t)(uintptr_t)p;
    int rc = 0;
    pthread_mutex_lock(&dev->lock);
    struct ferry__region *r = table_find(&dev->host_regions, a);
    if (!r)
        rc = ferry__err_set(&dev->err, -EINVAL,
                            "device %s: %s of %p: not a live %s of this device (unknown or "
                            "already released)",
                            bn, what, p, kind_name(kind));
    else if (r->base != a)
        rc = ferry__err_set(&dev->err, -EINVAL,
                            "device %s: %s of %p: interior pointer (+%" PRIu64
                            ") of %s 0x%" PRIx64 " of %zu bytes",
                            bn, what, p, a - r->base, kind_name(r->kind), r->base, r->len);
    else if (r->kind != kind)
        rc = ferry__err_set(&dev->err, -EINVAL, "device %s: %s of %p: it is a %s, not a %s", bn,
                            what, p, kind_name(r->kind), kind_name(kind));
    else {
        *len = r->len;
        table_remove(&dev->host_regions, r);
    }
    pthread_mutex_unlock(&dev->lock);
    return rc;
}

int ferry_device_host_free(ferry_device *dev, void *ptr)
{
    if (!dev)
        return ferry__err_set(NULL, -EINVAL, "device host_free: dev is NULL");
    size_t len = 0;
    int rc = host_region_take(dev, ptr, FERRY__REG_HOST_ALLOC, "host_free", &len);
    if (rc < 0)
        return rc;
    rc = dev->ops->host_free(dev, ptr, len);
    return rc < 0 ? dev_pass(dev, rc) : 0;
}

int ferry_device_pin(ferry_device *dev, void *host, size_t bytes)
{
    if (!dev || !host)
        return ferry__err_set(NULL, -EINVAL, "device pin: %s is NULL", dev ? "host" : "dev");
    const char *bn = dev->ops->name;
    if (bytes == 0)
        return dev_fail(dev, -EINVAL, "device %s: pin of 0 bytes at %p", bn, host);
    uint64_t a = (uint64_t)(uintptr_t)host;
    if (bytes > UINT64_MAX - a)
        return dev_fail(dev, -EINVAL, "device %s: pin of %zu bytes at %p wraps around", bn,
                        bytes, host);
    uint64_t nth = 0;
    int code = fault_take(dev, FERRY_FAULT_ALLOC, &nth);
    if (code) {
        char what[80];
        snprintf(what, sizeof what, "pin of %zu bytes at %p", bytes, host);
        return fault_fail(dev, code, nth, FERRY_FAULT_ALLOC, what);
    }
    pthread_mutex_lock(&dev->lock);
    struct ferry__region *r = table_overlap(&dev->host_regions, a, bytes);
    int rc = 0;
    if (r)
        rc = ferry__err_set(&dev->err, FERRY_EEXIST,
                            "device %s: pin of %zu bytes at %p: overlaps %s 0x%" PRIx64
                            " of %zu bytes",
                            bn, bytes, host, kind_name(r->kind), r->base, r->len);
    else if (table_reserve(&dev->host_regions) < 0)
        rc = ferry__err_set(&dev->err, -ENOMEM,
                            "device %s: pin of %zu bytes at %p: out of memory for the table", bn,
                            bytes, host);
    else /* claim the range now so a concurrent pin of it fails */
        table_insert(&dev->host_regions, a, bytes, FERRY__REG_PINNED);
    pthread_mutex_unlock(&dev->lock);
    if (rc < 0)
        return rc;
    rc = dev->ops->pin(dev, host, bytes);
    if (rc < 0) {
        pthread_mutex_lock(&dev->lock);
        struct ferry__region *mine = table_find(&dev->host_regions, a);
        if (mine)
            table_remove(&dev->host_regions, mine);
        ferry__err_pass(&dev->err, rc);
        pthread_mutex_unlock(&dev->lock);
        return rc;
    }
    return 0;
}

int ferry_device_unpin(ferry_device *dev, void *host)
{
    if (!dev)
        return ferry__err_set(NULL, -EINVAL, "device unpin: dev is NULL");
    size_t len = 0;
    int rc = host_region_take(dev, host, FERRY__REG_PINNED, "unpin", &len);
    if (rc < 0)
        return rc;
    rc = dev->ops->unpin(dev, host, len);
    return rc < 0 ? dev_pass(dev, rc) : 0;
}

void *ferry_devptr_host(const ferry_device *dev, ferry_devptr ptr)
{
    if (!dev || !dev->ops->simulated)
        return NULL;
    ferry_device *d = (ferry_device *)dev;
    pthread_mutex_lock(&d->lock);
    struct ferry__region *r = table_find(&d->dev_regions, ptr);
    pthread_mutex_unlock(&d->lock);
    return r ? dev->ops->devptr_host(dev, ptr) : NULL;
}

/* on the simulated backend: [p, p + n) inside one live device allocation */
static int check_range(ferry_device *dev, ferry_devptr p, size_t n, const char *what,
                       const char *role)
{
    if (p == 0)
        return dev_fail(dev, -EINVAL, "device %s: %s of %zu bytes: %s device pointer is 0",
                        dev->ops->name, what, n, role);
    if (!dev->ops->simulated)
        return 0;
    int rc = 0;
    pthread_mutex_lock(&dev->lock);
    struct ferry__region *r = table_find(&dev->dev_regions, p);
    if (!r)
        rc = ferry__err_set(&dev->err, FERRY_EBOUNDS,
                            "device %s: %s of %zu bytes: %s 0x%" PRIx64
                            " is not inside any live device allocation",
                            dev->ops->name, what, n, role, p);
    else if (n > r->len - (p - r->base))
        rc = ferry__err_set(&dev->err, FERRY_EBOUNDS,
                            "device %s: %s of %zu bytes: %s range 0x%" PRIx64 "+%zu runs %" PRIu64
                            " bytes past the end of allocation 0x%" PRIx64 " of %zu bytes",
                            dev->ops->name, what, n, role, p, n,
                            (uint64_t)n - (r->len - (p - r->base)), r->base, r->len);
    pthread_mutex_unlock(&dev->lock);
    return rc;
}

/* ---- streams ---- */

static int stream_new(ferry_device *dev, ferry_stream **out)
{
    ferry_stream *s = ferry__calloc(1, sizeof *s);
    if (!s)
        return dev_fail(dev, -ENOMEM, "device %s: stream create: out of memory",
                        dev->ops->name);
    s->dev = dev;
    int rc = dev->ops->stream_create(dev, s);
    if (rc < 0) {
        ferry__free(s);
        return dev_pass(dev, rc);
    }
    *out = s;
    return 0;
}

int ferry_stream_create(ferry_device *dev, ferry_stream **out)
{
    if (!dev || !out)
        return ferry__err_set(NULL, -EINVAL, "stream create: %s is NULL", dev ? "out" : "dev");
    ferry_stream *s = NULL;
    int rc = stream_new(dev, &s);
    if (rc < 0)
        return rc;
    ferry__dev_track_stream(dev, s);
    *out = s;
    return 0;
}

void ferry__dev_track_stream(ferry_device *dev, ferry_stream *s)
{
    pthread_mutex_lock(&dev->lock);
    s->next = dev->streams;
    if (dev->streams)
        dev->streams->prev = s;
    dev->streams = s;
    pthread_mutex_unlock(&dev->lock);
}

int ferry_stream_destroy(ferry_stream *s)
{
    if (!s)
        return 0;
    ferry_device *dev = s->dev;
    pthread_mutex_lock(&dev->lock);
    if (s->prev)
        s->prev->next = s->next;
    else
        dev->streams = s->next;
    if (s->next)
        s->next->prev = s->prev;
    pthread_mutex_unlock(&dev->lock);
    int rc = s->imported ? 0 : dev->ops->stream_destroy(s); /* the engine's: only forgotten */
    ferry__free(s);
    return rc < 0 ? dev_pass(dev, rc) : 0;
}

int ferry_stream_sync(ferry_stream *s)
{
    if (!s)
        return ferry__err_set(NULL, -EINVAL, "stream sync: stream is NULL");
    ferry_device *dev = s->dev;
    uint64_t nth = 0;
    int code = fault_take(dev, FERRY_FAULT_SYNC, &nth);
    /* even an injected failure waits, so the caller may release buffers */
    int rc = dev->ops->stream_sync(s);
    if (rc < 0)
        return dev_pass(dev, rc);
    if (code)
        return fault_fail(dev, code, nth, FERRY_FAULT_SYNC, "stream sync");
    return 0;
}

uint64_t ferry_stream_handle(const ferry_stream *s)
{
    return s ? s->dev->ops->stream_handle(s) : 0;
}

ferry_device *ferry_stream_device(const ferry_stream *s)
{
    return s ? s->dev : NULL;
}

int ferry_memcpy_htod_async(ferry_stream *s, ferry_devptr dst, const void *src, size_t n)
{
    if (!s || !src)
        return ferry__err_set(NULL, -EINVAL, "memcpy htod: %s is NULL", s ? "src" : "stream");
    if (n == 0)
        return 0;
    ferry_device *dev = s->dev;
    int rc = check_range(dev, dst, n, "memcpy htod", "destination");
    if (rc < 0)
        return rc;
    struct ferry__copy_fault f;
    rc = dev->ops->memcpy_htod(s, dst, src, n, copy_fault(dev, n, &f));
    return rc < 0 ? dev_pass(dev, rc) : 0;
}

int ferry_memcpy_dtoh_async(ferry_stream *s, void *dst, ferry_devptr src, size_t n)
{
    if (!s || !dst)
        return ferry__err_set(NULL, -EINVAL, "memcpy dtoh: %s is NULL", s ? "dst" : "stream");
    if (n == 0)
        return 0;
    ferry_device *dev = s->dev;
    int rc = check_range(dev, src, n, "memcpy dtoh", "source");
    if (rc < 0)
        return rc;
    struct ferry__copy_fault f;
    rc = dev->ops->memcpy_dtoh(s, dst, src, n, copy_fault(dev, n, &f));
    return rc < 0 ? dev_pass(dev, rc) : 0;
}

int ferry_memcpy_dtod_async(ferry_stream *s, ferry_devptr dst, ferry_devptr src, size_t n)
{
    if (!s)
        return ferry__err_set(NULL, -EINVAL, "memcpy dtod: stream is NULL");
    if (n == 0)
        return 0;
    ferry_device *dev = s->dev;
    int rc = check_range(dev, src, n, "memcpy dtod", "source");
    if (rc == 0)
        rc = check_range(dev, dst, n, "memcpy dtod", "destination");
    if (rc < 0)
        return rc;
    struct ferry__copy_fault f;
    rc = dev->ops->memcpy_dtod(s, dst, src, n, copy_fault(dev, n, &f));
    return rc < 0 ? dev_pass(dev, rc) : 0;
}

static int copy_one(ferry_stream *s, int kind, const ferry_copy *c)
{
    switch (kind) {
    case FERRY_COPY_HTOD:
        return ferry_memcpy_htod_async(s, c->dst, (const void *)(uintptr_t)c->src, c->bytes);
    case FERRY_COPY_DTOH:
        return ferry_memcpy_dtoh_async(s, (void *)(uintptr_t)c->dst, c->src, c->bytes);
    default:
        return ferry_memcpy_dtod_async(s, c->dst, c->src, c->bytes);
    }
}

/* every copy of a batch checked before any is queued; *nonempty counts them */
static int batch_check(ferry_stream *s, int kind, const ferry_copy *copies, size_t n,
                       size_t *nonempty)
{
    ferry_device *dev = s->dev;
    *nonempty = 0;
    for (size_t i = 0; i < n; i++) {
        const ferry_copy *c = &copies[i];
        if (c->bytes == 0)
            continue;
        if (c->bytes > SIZE_MAX || !c->dst || !c->src)
            return dev_fail(dev, -EINVAL,
                            "device %s: memcpy batch: copy %zu of %zu (%" PRIu64 " bytes) has %s",
                            dev->ops->name, i, n, c->bytes,
                            c->bytes > SIZE_MAX ? "a length past SIZE_MAX" : "an address 0");
        int rc = 0;
        if (kind != FERRY_COPY_HTOD)
            rc = check_range(dev, c->src, (size_t)c->bytes, "memcpy batch", "source");
        if (rc == 0 && kind != FERRY_COPY_DTOH)
            rc = check_range(dev, c->dst, (size_t)c->bytes, "memcpy batch", "destination");
        if (rc < 0)
            return rc;
        (*nonempty)++;
    }
    return 0;
}

int ferry_memcpy_batch_async(ferry_stream *s, int kind, const ferry_copy *copies, size_t n)
{
    if (!s || (!copies && n))
        return ferry__err_set(NULL, -EINVAL, "memcpy batch: %s is NULL", s ? "copies" : "stream");
    ferry_device *dev = s->dev;
    if (kind != FERRY_COPY_HTOD && kind != FERRY_COPY_DTOH && kind != FERRY_COPY_DTOD)
        return dev_fail(dev, -EINVAL, "device %s: memcpy batch: unknown kind %d",
                        dev->ops->name, kind);
    size_t nonempty = 0;
    int rc = batch_check(s, kind, copies, n, &nonempty);
    if (rc < 0 || nonempty == 0)
        return rc;
    /* one driver call when the backend has one and no test fault is armed
     * (faults count copy calls one by one) */
    if (dev->ops->memcpy_batch && nonempty > 1 &&
        !atomic_load_explicit(&dev->faults_on, memory_order_acquire)) {
        rc = dev->ops->memcpy_batch(s, kind, copies, n);
        if (rc != FERRY_ENOTSUP)
            return rc < 0 ? dev_pass(dev, rc) : 1;
    }
    int calls = 0;
    for (size_t i = 0; i < n; i++) {
        if (copies[i].bytes == 0)
            continue;
        rc = copy_one(s, kind, &copies[i]);
        if (rc < 0)
            return rc;
        calls++;
    }
    return calls;
}

/* ---- synchronous helpers on the internal stream ---- */

/* with helper_lock held */
static int helper_stream(ferry_device *dev, ferry_stream **out)
{
    if (!dev->helper) {
        int rc = stream_new(dev, &dev->helper);
        if (rc < 0)
            return rc;
    }
    *out = dev->helper;
    return 0;
}

int ferry_device_memset(ferry_device *dev, ferry_devptr dst, int byte, size_t n)
{
    if (!dev)
        return ferry__err_set(NULL, -EINVAL, "device memset: dev is NULL");
    if (n == 0)
        return 0;
    int rc = check_range(dev, dst, n, "memset", "destination");
    if (rc < 0)
        return rc;
    rc = dev->ops->memset(dev, dst, byte, n);
    return rc < 0 ? dev_pass(dev, rc) : 0;
}

/* upload and download: one copy on the device's helper stream, waited for */
static int sync_copy(ferry_device *dev, int to_device, ferry_devptr dptr, void *host, size_t n)
{
    const char *what = to_device ? "upload" : "download";
    if (!dev || !host)
        return ferry__err_set(NULL, -EINVAL, "device %s: %s is NULL", what,
                              !dev ? "dev" : to_device ? "src" : "dst");
    if (n == 0)
        return 0;
    int rc = check_range(dev, dptr, n, what, to_device ? "destination" : "source");
    if (rc < 0)
        return rc;
    pthread_mutex_lock(&dev->helper_lock);
    ferry_stream *s = NULL;
    rc = helper_stream(dev, &s);
    if (rc == 0) {
        struct ferry__copy_fault f;
        rc = to_device ? dev->ops->memcpy_htod(s, dptr, host, n, copy_fault(dev, n, &f))
                       : dev->ops->memcpy_dtoh(s, host, dptr, n, copy_fault(dev, n, &f));
        int rs = dev->ops->stream_sync(s);
        if (rc == 0)
            rc = rs;
        if (rc < 0)
            dev_pass(dev, rc);
    }
    pthread_mutex_unlock(&dev->helper_lock);
    return rc;
}

int ferry_device_upload(ferry_device *dev, ferry_devptr dst, const void *src, size_t n)
{
    return sync_copy(dev, 1, dst, (void *)(uintptr_t)src, n);
}

int ferry_device_download(ferry_device *dev, void *dst, ferry_devptr src, size_t n)
{
    return sync_copy(dev, 0, src, dst, n);
}

/* ---- events ---- */

int ferry_event_create(ferry_device *dev, ferry_event **out)
{
    if (!dev || !out)
        return ferry__err_set(NULL, -EINVAL, "event create: %s is NULL", dev ? "out" : "dev");
    ferry_event *e = ferry__calloc(1, sizeof *e);
    if (!e)
        return dev_fail(dev, -ENOMEM, "device %s: event create: out of memory",
                        dev->ops->name);
    e->dev = dev;
    int rc = dev->ops->event_create(dev, e);
    if (rc < 0) {
        ferry__free(e);
        return dev_pass(dev, rc);
    }
    ferry__dev_track_event(dev, e);
    *out = e;
    return 0;
}

void ferry__dev_track_event(ferry_device *dev, ferry_event *e)
{
    pthread_mutex_lock(&dev->lock);
    e->next = dev->events;
    if (dev->events)
        dev->events->prev = e;
    dev->events = e;
    pthread_mutex_unlock(&dev->lock);
}

void ferry_event_destroy(ferry_event *e)
{
    if (!e)
        return;
    ferry_device *dev = e->dev;
    pthread_mutex_lock(&dev->lock);
    if (e->prev)
        e->prev->next = e->next;
    else
        dev->events = e->next;
    if (e->next)
        e->next->prev = e->prev;
    pthread_mutex_unlock(&dev->lock);
    if (!e->imported)
        dev->ops->event_destroy(e);
    ferry__free(e);
}

int ferry_event_record(ferry_event *e, ferry_stream *s)
{
    if (!e || !s)
        return ferry__err_set(NULL, -EINVAL, "event record: %s is NULL", e ? "stream" : "event");
    ferry_device *dev = e->dev;
    if (s->dev != dev)
        return dev_fail(dev, -EINVAL, "device %s: event record: the stream belongs to another "
                        "device", dev->ops->name);
    uint64_t nth = 0;
    int code = fault_take(dev, FERRY_FAULT_EVENT, &nth);
    if (code)
        return fault_fail(dev, code, nth, FERRY_FAULT_EVENT, "event record");
    int rc = dev->ops->event_record(e, s);
    return rc < 0 ? dev_pass(dev, rc) : 0;
}

int ferry_event_query(ferry_event *e)
{
    if (!e)
        return ferry__err_set(NULL, -EINVAL, "event query: event is NULL");
    int rc = e->dev->ops->event_query(e);
    if (rc < 0 && rc != -EAGAIN)
        return dev_pass(e->dev, rc);
    return rc;
}

int ferry_event_sync(ferry_event *e)
{
    if (!e)
        return ferry__err_set(NULL, -EINVAL, "event sync: event is NULL");
    ferry_device *dev = e->dev;
    uint64_t nth = 0;
    int code = fault_take(dev, FERRY_FAULT_SYNC, &nth);
    int rc = dev->ops->event_sync(e);
    if (rc < 0)
        return dev_pass(dev, rc);
    if (code)
        return fault_fail(dev, code, nth, FERRY_FAULT_SYNC, "event sync");
    return 0;
}

int ferry_stream_wait_event(ferry_stream *s, ferry_event *e)
{
    if (!s || !e)
        return ferry__err_set(NULL, -EINVAL, "stream wait_event: %s is NULL",
                              s ? "event" : "stream");
    ferry_device *dev = s->dev;
    if (e->dev != dev)
        return dev_fail(dev, -EINVAL,
                        "device %s: stream wait_event: the event belongs to another device",
                        dev->ops->name);
    int rc = dev->ops->stream_wait_event(s, e);
    return rc < 0 ? dev_pass(dev, rc) : 0;
}

int ferry_event_elapsed_ms(ferry_event *start, ferry_event *end, float *ms)
{
    if (!start || !end || !ms)
        return ferry__err_set(NULL, -EINVAL, "event elapsed: %s is NULL",
                              !start ? "start" : !end ? "end" : "ms");
    ferry_device *dev = start->dev;
    if (end->dev != dev)
        return dev_fail(dev, -EINVAL, "device %s: event elapsed: the events belong to "
                        "different devices", dev->ops->name);
    float v = 0;
    int rc = dev->ops->event_elapsed(start, end, &v);
    if (rc < 0)
        return dev_pass(dev, rc);
    *ms = v;
    return 0;
}
