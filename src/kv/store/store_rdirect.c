/*
 * store_rdirect.c - a retrieve's direct reads: a chunk only in the
 * asynchronous tier, bound whole for a host buffer, is read straight into
 * that buffer when it can be: each read piece is one vectored read whose
 * runs are the piece's place in the buffer (ferry__kv_xfer_walk's runs of
 * the chunk image), then each check piece is hashed where it landed (XXH3
 * streamed across the runs gives the image's sum). No L1 slot, no copy:
 * the chunk is not promoted into L1.
 *
 * It can when every run's address and length are multiples of
 * FERRY_IO_ALIGN (what O_DIRECT needs; pinned host memory, page-aligned
 * allocations and their block pools are), no two runs overlap (a block
 * table naming one block twice), nor any two tokens the retrieve writes
 * (checked once per retrieve), the whole chunk goes to the engine (no
 * token of it below skip_tokens), the tier reads exactly the chunk image
 * (its slot bytes are the chunk's) and the op was not cancelled. Else the
 * chunk takes the L1 path (store_rpiece.c, store_retrieve.c) unchanged.
 *
 * And it does, by default, only where the buffer lies in huge pages
 * (asked of the kernel with PAGEMAP_SCAN, Linux 6.7+, for the chunk's
 * first and last runs): on a VM's virtual disk a read into 4 KiB pages
 * went at half the rate of one into huge pages (fio reads there as
 * slowly), and hashing the landed bytes through 4 KiB pages cost more
 * than the copy it saved; the L1 pool has huge pages. FERRY_KV_DIRECT=1
 * reads into any aligned buffer (bare-metal NVMe reads 4 KiB pages at
 * full rate), FERRY_KV_DIRECT=0 never (read once per process).
 *
 * Invariant: the buffer holds a direct chunk's bytes as retrieved only
 * when every piece passed its check; a chunk with a bad piece, a failed or
 * torn read, or stopped part-way by a cancel, is zeroed after every read
 * of it landed and before the retrieve returns (untouched when none of
 * its reads was started), so once the retrieve (or the cancel waiting for
 * it) returned, ferry writes nothing more there.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include "ferry/io.h"
#include "core/env.h"
#include "kv/kv_impl.h"
#include "kv/store/store_int.h"
#include "kv/store/store_rt.h"

/* FERRY_KV_DIRECT: 0 never, 1 into any aligned buffer, 2 (unset or
 * anything else) only into huge pages; -1 until read */
static atomic_int direct_mode = -1;

void ferry__kv_set_direct_mode(int mode)
{
    atomic_store(&direct_mode, mode);
}

static int mode_get(void)
{
    int m = atomic_load(&direct_mode);
    if (m >= 0)
        return m;
    m = ferry__env_kv_direct(getenv("FERRY_KV_DIRECT"), NULL); /* (a bad value: warned at open) */
    int unset = -1;
    atomic_compare_exchange_strong(&direct_mode, &unset, m);
    return atomic_load(&direct_mode);
}

/* the kernel's PAGEMAP_SCAN (linux/fs.h since 6.7; the ABI, for older
 * headers) */
typedef struct pm_scan {
    uint64_t size, flags, start, end, walk_end, vec, vec_len, max_pages;
    uint64_t category_inverted, category_mask, category_anyof_mask, return_mask;
} pm_scan;
typedef struct pm_region {
    uint64_t start, end, categories;
} pm_region;
#define PM_SCAN _IOWR('f', 16, pm_scan)
#define PM_IS_HUGE (1ull << 6)

/* the runs' memory is in huge pages, as far as the first and the last
 * run tell (an engine's pool is one allocation): 1; 0 when not, or when
 * the kernel cannot say */
static int runs_huge(const ferry__kv_run *run, size_t n)
{
    int fd = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    int huge = 1;
    const size_t pick[2] = {0, n - 1};
    for (int j = 0; huge && j < (n > 1 ? 2 : 1); j++) {
        size_t k = pick[j];
        pm_region reg;
        /* the pages that are NOT huge: none found, all of the run is */
        pm_scan a = {.size = sizeof a, .start = run[k].addr, .end = run[k].addr + run[k].len,
                     .vec = (uint64_t)(uintptr_t)&reg, .vec_len = 1,
                     .category_inverted = PM_IS_HUGE, .category_mask = PM_IS_HUGE,
                     .return_mask = PM_IS_HUGE};
        huge = ioctl(fd, PM_SCAN, &a) == 0;
    }
    close(fd);
    return huge;
}

typedef struct plan_ctx {
    ferry__kv_run *run;
    size_t n, cap;
    const unsigned char *base; /* the image's stand-in address: img - base is the offset */
} plan_ctx;

/* a run appended to p's (joined to the one before when it follows it in
 * the buffer); -1 out of memory */
static int run_add(plan_ctx *p, uint64_t at, uint64_t addr, uint64_t len)
{
    ferry__kv_run *last = p->n ? &p->run[p->n - 1] : NULL;
    if (last && last->addr + last->len == addr) {
        last->len += len;
        return 0;
    }
    if (p->n == p->cap) {
        size_t cap = p->cap ? 2 * p->cap : 64;
        ferry__kv_run *g = ferry__realloc(p->run, cap * sizeof *g);
        if (!g)
            return -1;
        p->run = g;
        p->cap = cap;
    }
    p->run[p->n++] = (ferry__kv_run){at, addr, len};
    return 0;
}

/* one run of the chunk (ferry__kv_xfer_walk): kept, joined to the one
 * before when it follows it in both; -1 stops the walk (not direct) */
static int plan_run(void *ctx, uint64_t addr, unsigned char *img, uint64_t len)
{
    plan_ctx *p = ctx;
    uint64_t at = (uint64_t)(img - p->base);
    if (!FERRY__IS_ALIGNED(addr, FERRY_IO_ALIGN) || !FERRY__IS_ALIGNED(len, FERRY_IO_ALIGN))
        return -1;
    ferry__kv_run *last = p->n ? &p->run[p->n - 1] : NULL;
    if (at != (last ? last->img + last->len : 0)) /* (not in image order: never so now) */
        return -1;
    return run_add(p, at, addr, len);
}

static int by_addr(const void *a, const void *b)
{
    const ferry__kv_run *x = a, *y = b;
    return x->addr < y->addr ? -1 : x->addr > y->addr;
}

/* no two runs share a byte of the buffer */
static int runs_apart(const ferry__kv_run *run, size_t n)
{
    ferry__kv_run *s = ferry__malloc(n * sizeof *s);
    if (!s)
        return 0;
    memcpy(s, run, n * sizeof *s);
    qsort(s, n, sizeof *s, by_addr);
    int ok = 1;
    for (size_t k = 1; ok && k < n; k++)
        ok = s[k - 1].addr + s[k - 1].len <= s[k].addr;
    ferry__free(s);
    return ok;
}

/* one run of a token the retrieve writes, kept (joined to the one before
 * when it follows it) */
static int any_run(void *ctx, uint64_t addr, unsigned char *img, uint64_t len)
{
    (void)img;
    return run_add(ctx, 0, addr, len);
}

/* no two tokens the retrieve writes (from skip_tokens on) share a byte of
 * the buffer: else a chunk read straight in could be checked over another
 * chunk's bytes that landed on its own (a block table naming one block
 * for two chunks), fail, be dropped from L2 as damaged, and be zeroed over
 * the other chunk's checked bytes. A contiguous tensor's tokens never
 * share; a paged buffer's are walked once per retrieve */
static int request_apart(rtv *r)
{
    ferry_kv *kv = r->kv;
    if (r->buf->form != FERRY_KV_PAGED)
        return 1;
    plan_ctx p = {NULL, 0, 0, NULL};
    int rc = 0;
    for (size_t i = 0; rc >= 0 && i < r->nch; i++) {
        ferry__kv_span sp = ferry__kv_span_from(&kv->layout, kv->chunk_tokens, i,
                                                ferry__kv_chunk_ntok(kv, i, r->n), r->skip);
        if (sp.ntok)
            rc = ferry__kv_xfer_walk(r->buf, kv->chunk_tokens, sp.tok0, sp.ntok,
                                     (unsigned char *)(uintptr_t)FERRY_IO_ALIGN + sp.img_off,
                                     any_run, &p);
    }
    int ok = rc >= 0 && (p.n < 2 || runs_apart(p.run, p.n));
    ferry__free(p.run);
    return ok;
}

int ferry__kv_rt_direct_plan(rtv *r, size_t i)
{
    ferry_kv *kv = r->kv;
    ferry__kv_tier *t = r->at;
    rt_chunk *c = &r->c[i];
    uint64_t tok0 = (uint64_t)i * kv->chunk_tokens;
    int mode = mode_get();
    if (!mode || r->s || !t->aops->submitv || !r->plnd || t->slot_bytes != kv->chunk_bytes ||
        ferry__kv_chunk_ntok(kv, i, r->n) != kv->chunk_tokens || r->skip > tok0 ||
        ferry__kv_cancelled(r->cancel) || ferry__kv_rt_failed(r) < 0)
        return 0;
    if (!r->dapart)
        r->dapart = request_apart(r) ? 1 : 2;
    if (r->dapart != 1)
        return 0;
    plan_ctx p = {NULL, 0, 0, (const unsigned char *)(uintptr_t)FERRY_IO_ALIGN};
    int rc = ferry__kv_xfer_walk(r->buf, kv->chunk_tokens, tok0, kv->chunk_tokens,
                                 (void *)(uintptr_t)p.base, plan_run, &p);
    uint64_t end = p.n ? p.run[p.n - 1].img + p.run[p.n - 1].len : 0;
    if (rc < 0 || end != kv->chunk_bytes || !runs_apart(p.run, p.n) ||
        (mode == 2 && !runs_huge(p.run, p.n))) {
        ferry__free(p.run);
        return 0;
    }
    c->runs = p.run;
    c->nruns = (uint32_t)p.n;
    c->rcur = 0;
    c->direct = 1;
    c->vwhole = 0;
    c->dstop = 0;
    c->dsub = 0;
    return 1;
}

void ferry__kv_rt_direct_drop(rtv *r, size_t i)
{
    rt_chunk *c = &r->c[i];
    ferry__free(c->runs);
    c->runs = NULL;
    c->nruns = 0;
    c->direct = 0;
}

int ferry__kv_rt_direct_submit(rtv *r, size_t i, ferry__kv_aread *a, uint64_t off, size_t len)
{
    rt_chunk *c = &r->c[i];
    /* (pieces go in order: the runs before rcur lie wholly before off) */
    while (c->rcur < c->nruns && c->runs[c->rcur].img + c->runs[c->rcur].len <= off)
        c->rcur++;
    unsigned n = 0;
    for (uint64_t at = off, end = off + len; at < end; n++) {
        if (c->rcur + n >= c->nruns)
            return ferry__err_set(NULL, -EINVAL, "kv retrieve: a direct read of %zu bytes at "
                                  "byte %llu of chunk %zu reaches past its runs", len,
                                  (unsigned long long)off, i);
        if (n == r->iov_cap) {
            unsigned cap = r->iov_cap ? 2 * r->iov_cap : 64;
            struct iovec *g = ferry__realloc(r->iov, cap * sizeof *g);
            if (!g)
                return ferry__err_set(NULL, -ENOMEM, "kv retrieve: out of memory for a "
                                      "direct read's %u runs", cap);
            r->iov = g;
            r->iov_cap = cap;
        }
        const ferry__kv_run *u = &c->runs[c->rcur + n];
        uint64_t skip = at - u->img, k = FERRY__MIN(u->len - skip, end - at);
        r->iov[n] = (struct iovec){(void *)(uintptr_t)(u->addr + skip), (size_t)k};
        at += k;
    }
    ferry__kv_tier *t = r->at;
    int rc = t->aops->submitv(t, &r->batch, a, c->aloc, off, r->iov, n, len);
    c->dsub |= rc == 0; /* (a submit that failed started nothing) */
    return rc;
}

void ferry__kv_rt_direct_check(rtv *r, size_t i, const ferry_kv_hash *id, uint64_t c0,
                               uint64_t c1)
{
    ferry_kv *kv = r->kv;
    rt_chunk *c = &r->c[i];
    ferry__kv_tier *t = r->at;
    uint64_t ts = ferry__thread_cpu_ns();
    uint64_t sum = ferry__kv_sum_runs(c->runs, c->nruns, c0, c1);
    int rc = c->vwhole ? t->aops->verify(t, c->aloc, id, sum)
                       : ferry__kv_tier_piece_check(t, c->aloc, id, c0 / c->vp, c1 - c0, sum);
    rt_spent(&kv->rt_check_ns, ts);
    if (rc == 0) {
        rt_first(r, &r->first_bytes);
        return;
    }
    if (r->wcopy)
        pthread_mutex_lock(&r->cmu);
    if (c->pbad == 0) {
        c->pbad = rc;
        snprintf(r->why[i], sizeof r->why[i], "%s", ferry_last_error());
    }
    if (r->wcopy)
        pthread_mutex_unlock(&r->cmu);
}

/* the chunk is no longer read: the entry's promotion mark goes (a waiting
 * retrieve of it reads it itself), and a copy that read or checked bad is
 * dropped, as a failed promotion drops it (store_promote.c) */
static void direct_release(rtv *r, size_t i, ferry__kv_entry *e, int rc)
{
    ferry_kv *kv = r->kv;
    pthread_mutex_lock(&kv->mu);
    e->l1_loading = 0;
    pthread_cond_broadcast(&kv->loaded);
    if (rc < 0 && !r->c[i].lost && !e->doomed && (e->resident & (1u << r->at->id))) {
        ferry__kv_drop_tier(kv, e, r->at->id);
        if (!e->resident)
            ferry__kv_doom(kv, e);
    }
    ferry__kv_read_unlock(e);
    ferry__kv_put(kv, e);
    pthread_mutex_unlock(&kv->mu);
}

void ferry__kv_rt_direct_done(rtv *r, size_t i, ferry__kv_entry *e, int rc)
{
    ferry_kv *kv = r->kv;
    rt_chunk *c = &r->c[i];
    int bad = ferry__kv_rt_pieces_done(r, i);
    if (rc == 0 && bad < 0) {
        rc = bad;
        ferry__err_set(NULL, bad, "%s", r->why[i]);
        ferry__kv_tier_io_done(kv, r->at, 0, c->aloc, &e->id, 0, bad);
    }
    int ok = rc == 0 && !c->lost && !c->dstop;
    /* every read of it has landed (its last one is what brought it here):
     * whatever of it the drive wrote goes (kv.h: a miss is zeroed); none
     * started, its tokens are untouched */
    if (!ok && c->dsub)
        ferry__kv_xfer_out_zero(r->buf, kv->chunk_tokens, (uint64_t)i * kv->chunk_tokens,
                                kv->chunk_tokens);
    ferry__kv_rt_direct_drop(r, i);
    direct_release(r, i, e, rc);
    if (r->wcopy)
        pthread_mutex_lock(&r->cmu);
    if (ok) {
        c->st = 0;
        r->got++;
        r->dgot++;
        r->hits[r->at->id]++;
        rt_first(r, &r->first_chunk);
    } else if (c->dstop && rc == 0) {
        c->st = -ECANCELED;
        r->ncancel++;
    } else {
        if (bad < 0 && rc == bad)
            c->st = bad;
        r->misses++;
    }
    if (r->wcopy)
        pthread_mutex_unlock(&r->cmu);
}
