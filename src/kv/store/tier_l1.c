/*
 * tier_l1.c - L1: a pool of host memory carved into chunk slots.
 *
 * The pool is one allocation (pinned through the store's device when it has
 * one, so device copies are truly asynchronous and DMA-able; a private
 * anonymous mapping of its own otherwise), split into `capacity` slots of
 * slot_bytes, each a multiple of 4096 so a slot is also a valid O_DIRECT
 * buffer for the L2 write-through. Free slots are a stack of indices. A
 * pool that is not pinned is faulted in by a thread after open
 * (tier_l1_fill.c), not by open itself.
 *
 * Fork: the private pool is advised MADV_DONTFORK, so a fork's child has
 * no mapping at its address. Without it a child got a copy of the pool,
 * and once the L2 tier registered the pool (io_uring fixed buffers pin
 * every page, tier_l2_poolreg.c) Linux copies pinned pages at the fork
 * itself: forking an engine with an 8 GiB pool took 8 GiB more and
 * seconds, per DataLoader worker. A child never touches the pool: every
 * call on its parent's store is refused (guard.c). The pool is a mapping
 * of its own, never heap memory: MADV_DONTFORK stays on pages after free,
 * and heap pages missing in a child crash its malloc later. It is 2 MiB
 * aligned when that large, so the fill's MADV_HUGEPAGE can use huge pages
 * (as posix_memalign's 2 MiB alignment gave before), and unmapped at close.
 *
 * A shared pool (the one `ferry serve` hosts) lives in a memfd, with huge
 * pages where the kernel gives them (MFD_HUGETLB when huge pages are
 * reserved, else a plain memfd advised MADV_HUGEPAGE), sealed against
 * shrinking, so every client maps the same bytes and none can pull the
 * pages from under the others.
 *
 * Invariant: a slot index is either on the free stack or reserved, never
 * both (reserve/release run under the store's mutex); the bytes of a
 * reserved slot are only touched by whoever holds its chunk.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "core/meminfo.h"
#include "kv/kv_impl.h"
#include "kv/store/tier_l1_fill.h"

typedef struct l1 {
    ferry_device *dev;     /* NULL: pool mapped here (own_pool or shm_pool) */
    unsigned char *pool;
    int fd;                /* shared: the memfd (else -1) */
    size_t map_bytes;      /* without a device: the mapping's length */
    int present;           /* every page present from the allocation (pinned or
                            * MAP_POPULATE'd huge pages): no fill */
    uint64_t *free_stack;
    uint64_t nfree;
    /* unpinned pools: faulted in by a thread while the store is in use, so
     * that open does not pay a fault per page (tier_l1_fill.c); pinned
     * pools are faulted in by pinning */
    ferry__kv_l1_fill fill;
} l1;

static int l1_reserve(ferry__kv_tier *t, uint64_t *loc)
{
    l1 *p = t->impl;
    if (!p->nfree)
        return FERRY_ENOSPACE;
    *loc = p->free_stack[--p->nfree];
    return 0;
}

static void l1_release(ferry__kv_tier *t, uint64_t loc)
{
    l1 *p = t->impl;
    p->free_stack[p->nfree++] = loc;
}

static void *l1_host_ptr(ferry__kv_tier *t, uint64_t loc)
{
    l1 *p = t->impl;
    return p->pool + loc * t->slot_bytes;
}

static int l1_write(ferry__kv_tier *t, uint64_t loc, const ferry_kv_hash *id, const void *src,
                    size_t len)
{
    (void)id;
    memcpy(l1_host_ptr(t, loc), src, len);
    return 0;
}

static int l1_read(ferry__kv_tier *t, uint64_t loc, const ferry_kv_hash *id, void *dst, size_t len)
{
    (void)id;
    memcpy(dst, l1_host_ptr(t, loc), len);
    return 0;
}

static void l1_close(ferry__kv_tier *t)
{
    l1 *p = t->impl;
    if (!p)
        return;
    ferry__kv_l1_fill_stop(&p->fill); /* before the pool goes */
    if (p->pool && p->dev)
        ferry_device_host_free(p->dev, p->pool);
    else if (p->pool)
        munmap(p->pool, p->map_bytes);
    if (p->fd >= 0)
        close(p->fd);
    ferry__free(p->free_stack);
    ferry__free(p);
    t->impl = NULL;
}

static const ferry__kv_tier_ops l1_ops = {
    .name = "l1",
    .reserve = l1_reserve,
    .release = l1_release,
    .write = l1_write,
    .read = l1_read,
    .host_ptr = l1_host_ptr,
    .close = l1_close,
};

/* a memfd of at least bytes, mapped shared: huge pages when the kernel has
 * them reserved, else plain pages (advised huge) */
static int shm_pool(l1 *p, size_t bytes, ferry__errbuf *eb)
{
#ifdef MFD_HUGETLB
    size_t huge = FERRY__ALIGN_UP(bytes, (size_t)2 << 20);
    int fd = memfd_create("ferry-l1", MFD_CLOEXEC | MFD_ALLOW_SEALING | MFD_HUGETLB);
    if (fd >= 0 && ftruncate(fd, (off_t)huge) == 0) {
        void *m = mmap(NULL, huge, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
        if (m != MAP_FAILED) {
            p->fd = fd;
            p->pool = m;
            p->map_bytes = huge;
            p->present = 1;
            FERRY_LOGI("kv L1: shared pool of %zu bytes in huge pages", huge);
            goto sealed;
        }
    }
    if (fd >= 0)
        close(fd);
#endif
    p->fd = memfd_create("ferry-l1", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (p->fd < 0)
        return ferry__err_set(eb, -errno, "kv L1: memfd_create for a shared pool: %s",
                              strerror(errno));
    if (ftruncate(p->fd, (off_t)bytes) != 0)
        return ferry__err_set(eb, -errno, "kv L1: sizing the shared pool to %zu bytes: %s", bytes,
                              strerror(errno));
    void *m = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, p->fd, 0);
    if (m == MAP_FAILED)
        return ferry__err_set(eb, -errno, "kv L1: mapping the shared pool of %zu bytes: %s",
                              bytes, strerror(errno));
    p->pool = m;
    p->map_bytes = bytes;
    ferry__kv_l1_fill_start(&p->fill, p->pool, bytes);
sealed:
    if (fcntl(p->fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0)
        FERRY_LOGD("kv L1: sealing the shared pool: %s", strerror(errno));
    return 0;
}

/* a private anonymous mapping of at least bytes, 2 MiB aligned when it is
 * that large, kept out of a fork's child (MADV_DONTFORK) */
static int own_pool(l1 *p, size_t bytes, ferry__errbuf *eb)
{
    const size_t huge = (size_t)2 << 20;
    long pg = sysconf(_SC_PAGESIZE);
    size_t page = pg > 0 ? (size_t)pg : 4096;
    size_t len = FERRY__ALIGN_UP(bytes, page);
    size_t align = len >= huge ? huge : page;
    if (len < bytes || len > SIZE_MAX - align)
        return ferry__err_set(eb, -EOVERFLOW, "kv L1: a pool of %zu bytes overflows", bytes);
    size_t span = len + align - page; /* room to align inside */
    unsigned char *m = mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED)
        return ferry__err_set(eb, -ENOMEM, "kv L1: mapping a pool of %zu bytes: %s", len,
                              strerror(errno));
    unsigned char *at = (unsigned char *)FERRY__ALIGN_UP((uintptr_t)m, (uintptr_t)align);
    if (at > m)
        munmap(m, (size_t)(at - m));
    if (at + len < m + span)
        munmap(at + len, (size_t)(m + span - (at + len)));
    if (madvise(at, len, MADV_DONTFORK) != 0) /* (every Linux since 2.6.16 has it) */
        FERRY_LOGW("kv L1: madvise(MADV_DONTFORK) on the pool of %zu bytes: %s; a fork copies "
                   "the pool",
                   len, strerror(errno));
    p->pool = at;
    p->map_bytes = len;
    return 0;
}

int ferry__kv_tier_l1_fd(ferry__kv_tier *t, uint64_t *bytes)
{
    l1 *p = t->impl;
    if (p->fd >= 0 && bytes)
        *bytes = p->map_bytes;
    return p->fd;
}

int ferry__kv_tier_l1_filling(ferry__kv_tier *t)
{
    l1 *p = t->impl;
    return ferry__kv_l1_fill_busy(&p->fill);
}

int ferry__kv_tier_l1_faulted(ferry__kv_tier *t, int *err)
{
    l1 *p = t->impl;
    if (err)
        *err = 0;
    return p->present || ferry__kv_l1_fill_whole(&p->fill, err);
}

int ferry__kv_tier_l1_open(ferry_device *dev, uint64_t slot_bytes, uint64_t capacity, int shared,
                           ferry__errbuf *eb, ferry__kv_tier **out)
{
    if (!capacity || !slot_bytes || slot_bytes % 4096)
        return ferry__err_set(eb, -EINVAL, "kv L1: bad geometry (%llu slots of %llu bytes)",
                              (unsigned long long)capacity, (unsigned long long)slot_bytes);
    if (capacity > SIZE_MAX / slot_bytes)
        return ferry__err_set(eb, -EOVERFLOW, "kv L1: %llu slots of %llu bytes overflow",
                              (unsigned long long)capacity, (unsigned long long)slot_bytes);
    uint64_t host, avail, want = capacity * slot_bytes;
    ferry__memwatch mw; /* (the cgroup file of a limit named: a limit of 0 is one) */
    char file[FERRY__MEMWATCH_PATH], why[FERRY__MEMWATCH_PATH + 64];
    ferry__memwatch_open(&mw, NULL);
    ferry__memwatch_read(&mw, &host, &avail);
    if (ferry__memwatch_limit_file(&mw, file, sizeof file))
        snprintf(why, sizeof why, "the limit of %llu bytes in %s", (unsigned long long)host,
                 file);
    else
        snprintf(why, sizeof why, "the host's, or its cgroup's limit");
    ferry__memwatch_close(&mw);
    if (want > host) /* (it could never be backed: its pages would bring the OOM killer) */
        return ferry__err_set(eb, -ENOMEM,
                              "kv L1: a pool of %.2f GiB (%llu slots of %llu bytes) is more "
                              "than the %.2f GiB of memory this process may have (%s); give "
                              "an L1 that fits beside the engine",
                              (double)want / (1u << 30), (unsigned long long)capacity,
                              (unsigned long long)slot_bytes, (double)host / (1u << 30), why);
    if (want > avail)
        FERRY_LOGW("kv L1: a pool of %.2f GiB is more than the %.2f GiB of memory available "
                   "now: its pages are taken as chunks arrive, and the host may run out of "
                   "memory before the pool is full",
                   (double)want / (1u << 30), (double)avail / (1u << 30));
    ferry__kv_tier *t = ferry__calloc(1, sizeof *t);
    l1 *p = ferry__calloc(1, sizeof *p);
    if (!t || !p) {
        ferry__free(t);
        ferry__free(p);
        return ferry__err_set(eb, -ENOMEM, "kv L1: out of memory for the tier");
    }
    t->ops = &l1_ops;
    t->impl = p;
    t->id = FERRY_KV_TIER_L1;
    t->slot_bytes = slot_bytes;
    t->capacity = capacity;
    p->dev = dev;
    p->fd = -1;
    size_t bytes = (size_t)(capacity * slot_bytes);
    p->free_stack = ferry__malloc(capacity * sizeof *p->free_stack);
    if (!p->free_stack) {
        ferry__kv_tier_free(t);
        return ferry__err_set(eb, -ENOMEM, "kv L1: out of memory for %llu slot indices",
                              (unsigned long long)capacity);
    }
    if (shared) {
        int rc = shm_pool(p, bytes, eb);
        if (rc < 0) {
            ferry__kv_tier_free(t);
            return rc;
        }
    } else if (dev) {
        void *mem = NULL;
        int rc = ferry_device_host_alloc(dev, bytes, &mem);
        if (rc < 0) {
            ferry__kv_tier_free(t);
            return ferry__err_set(eb, rc, "kv L1: pinned pool of %zu bytes on %s: %s", bytes,
                                  ferry_device_name(dev), ferry_last_error());
        }
        p->pool = mem;
        p->present = 1;
    } else {
        int rc = own_pool(p, bytes, eb);
        if (rc < 0) {
            ferry__kv_tier_free(t);
            return rc;
        }
        ferry__kv_l1_fill_start(&p->fill, p->pool, bytes);
    }
    /* hand out low slots first: the stack pops from its end */
    for (uint64_t i = 0; i < capacity; i++)
        p->free_stack[i] = capacity - 1 - i;
    p->nfree = capacity;
    *out = t;
    return 0;
}

void ferry__kv_tier_free(ferry__kv_tier *t)
{
    if (!t)
        return;
    if (t->ops && t->ops->close)
        t->ops->close(t);
    ferry__kv_policy_destroy(t->policy);
    ferry__free(t);
}
