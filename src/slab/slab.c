/*
 * slab.c - the slab allocator: first fit by address in O(log n).
 *
 * Invariant: the free blocks and the allocated extents tile [0, capacity)
 * exactly; every offset and size is a multiple of the alignment; no two
 * free blocks touch (freeing coalesces with both neighbours).
 *
 * Why this shape: LMCache's L1 manager walks an address-ordered free list,
 * O(n) per allocation; with 100,000 chunks that is far below a million
 * operations a second. Here the free blocks live in a treap keyed by
 * offset, each node caching the largest block in its subtree, so "the
 * lowest-addressed block that fits" is one descent (go left whenever the
 * left subtree can hold the request). Taking the front of a free block or
 * growing one in place keeps the key order (the new range lies between the
 * same neighbours), so those only refresh cached maxima along one path.
 * Allocated extents sit in an open-addressed hash keyed by offset (linear
 * probing, backward-shift deletion): free() finds an extent's size and
 * state in O(1) and check() can walk the tiling without allocating.
 *
 * Nodes live in one array and refer to each other by index, so growing it
 * is one realloc; all growth happens before a call mutates anything, which
 * makes every failure leave the allocator exactly as it was.
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "ferry/slab.h"

#include "slab_impl.h"
#include "sized.h"

/* ---- dtypes and layouts ---- */

static const struct {
    const char *name;
    size_t bytes;
} dtypes[FERRY_DTYPE_COUNT] = {
    [FERRY_DTYPE_U8] = {"u8", 1},     [FERRY_DTYPE_I8] = {"i8", 1},
    [FERRY_DTYPE_FP8] = {"fp8", 1},   [FERRY_DTYPE_F16] = {"f16", 2},
    [FERRY_DTYPE_BF16] = {"bf16", 2}, [FERRY_DTYPE_I16] = {"i16", 2},
    [FERRY_DTYPE_F32] = {"f32", 4},   [FERRY_DTYPE_I32] = {"i32", 4},
    [FERRY_DTYPE_F64] = {"f64", 8},   [FERRY_DTYPE_I64] = {"i64", 8},
};

size_t ferry_dtype_size(int dtype)
{
    return dtype >= 0 && dtype < FERRY_DTYPE_COUNT ? dtypes[dtype].bytes : 0;
}

const char *ferry_dtype_name(int dtype)
{
    return dtype >= 0 && dtype < FERRY_DTYPE_COUNT ? dtypes[dtype].name : "?";
}

int ferry_layout_bytes(const ferry_layout *l, uint64_t *out)
{
    if (!l || !out)
        return ferry__err_set(NULL, -EINVAL, "layout: NULL %s", l ? "out" : "layout");
    if (l->n_shapes != l->n_dtypes)
        return ferry__err_set(NULL, FERRY_EMISMATCH,
                              "layout: %zu shapes but %zu dtypes (one dtype per shape)",
                              l->n_shapes, l->n_dtypes);
    if (l->n_shapes == 0 || !l->shapes || !l->dtypes)
        return ferry__err_set(NULL, -EINVAL, "layout: no tensors");
    uint64_t total = 0;
    for (size_t i = 0; i < l->n_shapes; i++) {
        const ferry_shape *sh = &l->shapes[i];
        size_t es = ferry_dtype_size(l->dtypes[i]);
        if (!es)
            return ferry__err_set(NULL, -EINVAL, "layout: tensor %zu has unknown dtype %d", i,
                                  l->dtypes[i]);
        if (sh->ndim > FERRY_SHAPE_MAX_DIMS)
            return ferry__err_set(NULL, -EINVAL, "layout: tensor %zu has %u dims (max %d)", i,
                                  sh->ndim, FERRY_SHAPE_MAX_DIMS);
        uint64_t n = es;
        for (unsigned d = 0; d < sh->ndim; d++) {
            if (sh->dims[d] && n > UINT64_MAX / sh->dims[d])
                return ferry__err_set(NULL, -EOVERFLOW, "layout: tensor %zu overflows 64 bits",
                                      i);
            n *= sh->dims[d];
        }
        if (total > UINT64_MAX - n)
            return ferry__err_set(NULL, -EOVERFLOW, "layout: total overflows 64 bits");
        total += n;
    }
    if (total == 0)
        return ferry__err_set(NULL, -EINVAL, "layout: objects of 0 bytes");
    *out = total;
    return 0;
}

/* ---- the treap ---- */

static inline uint64_t nmax(const ferry_slab *s, uint32_t i)
{
    return s->nodes[i].max;
}

static inline void pull(ferry_slab *s, uint32_t i)
{
    tnode *n = &s->nodes[i];
    uint64_t m = n->size, a = nmax(s, n->l), b = nmax(s, n->r);
    if (a > m)
        m = a;
    if (b > m)
        m = b;
    n->max = m;
}

static uint32_t next_prio(ferry_slab *s)
{
    /* xorshift32: priorities only need to be spread, not secret */
    uint32_t x = s->rng;
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    s->rng = x;
    return x;
}

/* make room for one more node; -ENOMEM leaves everything as it was */
static int reserve_node(ferry_slab *s)
{
    if (s->free_idx != NIL || s->nused_hw + 1 < s->ncap)
        return 0;
    uint32_t ncap = s->ncap ? s->ncap * 2 : 64;
    tnode *nn = ferry__realloc(s->nodes, (size_t)ncap * sizeof *nn);
    if (!nn)
        return -ENOMEM;
    s->nodes = nn;
    s->ncap = ncap;
    return 0;
}

static uint32_t new_node(ferry_slab *s, uint64_t off, uint64_t size)
{
    uint32_t i;
    if (s->free_idx != NIL) {
        i = s->free_idx;
        s->free_idx = s->nodes[i].l;
    } else {
        i = ++s->nused_hw;
    }
    tnode *n = &s->nodes[i];
    n->off = off;
    n->size = n->max = size;
    n->l = n->r = NIL;
    n->prio = next_prio(s);
    s->free_blocks++;
    return i;
}

static void drop_node(ferry_slab *s, uint32_t i)
{
    s->nodes[i].l = s->free_idx;
    s->nodes[i].size = s->nodes[i].max = 0;
    s->free_idx = i;
    s->free_blocks--;
}

/* split t into keys < off (*a) and >= off (*b) */
static void split(ferry_slab *s, uint32_t t, uint64_t off, uint32_t *a, uint32_t *b)
{
    if (t == NIL) {
        *a = *b = NIL;
        return;
    }
    if (s->nodes[t].off < off) {
        split(s, s->nodes[t].r, off, &s->nodes[t].r, b);
        *a = t;
    } else {
        split(s, s->nodes[t].l, off, a, &s->nodes[t].l);
        *b = t;
    }
    pull(s, t);
}

static uint32_t merge(ferry_slab *s, uint32_t a, uint32_t b)
{
    if (a == NIL)
        return b;
    if (b == NIL)
        return a;
    if (s->nodes[a].prio > s->nodes[b].prio) {
        s->nodes[a].r = merge(s, s->nodes[a].r, b);
        pull(s, a);
        return a;
    }
    s->nodes[b].l = merge(s, a, s->nodes[b].l);
    pull(s, b);
    return b;
}

static uint32_t t_insert(ferry_slab *s, uint32_t t, uint32_t n)
{
    if (t == NIL)
        return n;
    if (s->nodes[n].prio > s->nodes[t].prio) {
        split(s, t, s->nodes[n].off, &s->nodes[n].l, &s->nodes[n].r);
        pull(s, n);
        return n;
    }
    if (s->nodes[n].off < s->nodes[t].off)
        s->nodes[t].l = t_insert(s, s->nodes[t].l, n);
    else
        s->nodes[t].r = t_insert(s, s->nodes[t].r, n);
    pull(s, t);
    return t;
}

static uint32_t t_erase(ferry_slab *s, uint32_t t, uint64_t off)
{
    if (t == NIL)
        return NIL;
    if (s->nodes[t].off == off)
        return merge(s, s->nodes[t].l, s->nodes[t].r);
    if (off < s->nodes[t].off)
        s->nodes[t].l = t_erase(s, s->nodes[t].l, off);
    else
        s->nodes[t].r = t_erase(s, s->nodes[t].r, off);
    pull(s, t);
    return t;
}

/* refresh the cached maxima on the path to the node keyed off */
static void t_fix(ferry_slab *s, uint32_t t, uint64_t off)
{
    if (t == NIL)
        return;
    if (off < s->nodes[t].off)
        t_fix(s, s->nodes[t].l, off);
    else if (off > s->nodes[t].off)
        t_fix(s, s->nodes[t].r, off);
    pull(s, t);
}

/* the lowest-addressed free block of at least need bytes, or NIL */
static uint32_t first_fit(const ferry_slab *s, uint64_t need)
{
    uint32_t t = s->root;
    if (s->nodes[t].max < need)
        return NIL;
    for (;;) {
        const tnode *n = &s->nodes[t];
        if (s->nodes[n->l].max >= need)
            t = n->l;
        else if (n->size >= need)
            return t;
        else
            t = n->r;
    }
}

/* the free blocks just below and just above off (NIL when none) */
static void neighbours(const ferry_slab *s, uint64_t off, uint32_t *pred, uint32_t *succ)
{
    uint32_t t = s->root;
    *pred = *succ = NIL;
    while (t != NIL) {
        if (s->nodes[t].off < off) {
            *pred = t;
            t = s->nodes[t].r;
        } else {
            *succ = t;
            t = s->nodes[t].l;
        }
    }
}

/* ---- the extent hash ---- */

static inline uint64_t uhash(const ferry_slab *s, uint64_t off)
{
    return ((off >> s->align_shift) * 0x9E3779B97F4A7C15ull) >> 17;
}

static used_ent *u_find(const ferry_slab *s, uint64_t off)
{
    uint64_t mask = s->ucap - 1;
    for (uint64_t i = uhash(s, off) & mask;; i = (i + 1) & mask) {
        used_ent *e = &s->used[i];
        if (!e->size)
            return NULL;
        if (e->off == off)
            return e;
    }
}

static void u_put(ferry_slab *s, uint64_t off, uint64_t size)
{
    uint64_t mask = s->ucap - 1;
    uint64_t i = uhash(s, off) & mask;
    while (s->used[i].size)
        i = (i + 1) & mask;
    s->used[i] = (used_ent){off, size, 0, FERRY_EXTENT_WRITING};
    s->ucount++;
}

static void u_del(ferry_slab *s, used_ent *e)
{
    uint64_t mask = s->ucap - 1;
    uint64_t i = (uint64_t)(e - s->used);
    /* backward-shift deletion keeps every probe chain unbroken */
    for (uint64_t j = (i + 1) & mask; s->used[j].size; j = (j + 1) & mask) {
        uint64_t home = uhash(s, s->used[j].off) & mask;
        /* move j into the hole i when its home is not in (i, j] cyclically */
        int between = i <= j ? (home > i && home <= j) : (home > i || home <= j);
        if (!between) {
            s->used[i] = s->used[j];
            i = j;
        }
    }
    s->used[i].size = 0;
    s->ucount--;
}

/* room for `more` extents at load <= 1/2; -ENOMEM leaves the table as it was */
static int u_reserve(ferry_slab *s, uint64_t more)
{
    uint64_t want = (s->ucount + more) * 2;
    if (want <= s->ucap)
        return 0;
    uint64_t cap = s->ucap ? s->ucap : 64;
    while (cap < want)
        cap *= 2;
    if (cap > SIZE_MAX / sizeof(used_ent))
        return -ENOMEM;
    used_ent *nu = ferry__calloc((size_t)cap, sizeof *nu);
    if (!nu)
        return -ENOMEM;
    used_ent *old = s->used;
    uint64_t ocap = s->ucap;
    s->used = nu;
    s->ucap = cap;
    s->ucount = 0;
    for (uint64_t i = 0; i < ocap; i++)
        if (old[i].size) {
            u_put(s, old[i].off, old[i].size);
            used_ent *e = u_find(s, old[i].off);
            e->readers = old[i].readers;
            e->state = old[i].state;
        }
    ferry__free(old);
    return 0;
}

/* ---- life ---- */

int ferry_slab_create(const ferry_slab_options *uopt, ferry_slab **out)
{
    if (!uopt || !out)
        return ferry__err_set(NULL, -EINVAL, "slab: %s is NULL", uopt ? "out" : "options");
    static const ferry__member later[] = {FERRY__MEMBER(ferry_slab_options, alignment)};
    static const ferry__sized sized =
        FERRY__SIZED(ferry_slab_options, FERRY_SLAB_OPTIONS_MIN_SIZE, later);
    ferry_slab_options o = FERRY_SLAB_OPTIONS_INIT;
    int rc = ferry__opts_take(NULL, "slab create", &sized, &o, uopt);
    if (rc < 0)
        return rc;
    const ferry_slab_options *opt = &o;
    /* range first: the persistent slab stores the alignment in 32 bits and
     * divides by it, so 2^32 and beyond must not reach any arithmetic */
    uint64_t align = opt->alignment ? opt->alignment : 4096;
    if (align > FERRY_SLAB_ALIGN_MAX || (align & (align - 1)))
        return ferry__err_set(NULL, -EINVAL,
                              "slab: alignment %zu: accepted a power of two in 1..%llu (0 means "
                              "4096)",
                              opt->alignment, (unsigned long long)FERRY_SLAB_ALIGN_MAX);
    uint64_t cap = opt->capacity & ~(align - 1);
    if (cap == 0)
        return ferry__err_set(NULL, -EINVAL,
                              "slab: capacity %llu is below the alignment %llu",
                              (unsigned long long)opt->capacity, (unsigned long long)align);
    ferry_slab *s = ferry__calloc(1, sizeof *s);
    if (!s)
        return ferry__err_set(NULL, -ENOMEM, "slab: out of memory creating the allocator");
    s->capacity = cap;
    s->align = align;
    while ((1ull << s->align_shift) < align)
        s->align_shift++;
    s->rng = 0x9E3779B9u;
    if (reserve_node(s) < 0 || u_reserve(s, 16) < 0) {
        ferry__free(s->nodes);
        ferry__free(s->used);
        ferry__free(s);
        return ferry__err_set(NULL, -ENOMEM, "slab: out of memory creating the allocator");
    }
    memset(&s->nodes[0], 0, sizeof s->nodes[0]);
    s->root = new_node(s, 0, cap);
    pthread_mutex_init(&s->mu, NULL);
    *out = s;
    return 0;
}

void ferry_slab_destroy(ferry_slab *s)
{
    if (!s)
        return;
    pthread_mutex_destroy(&s->mu);
    ferry__free(s->nodes);
    ferry__free(s->used);
    ferry__free(s);
}

const char *ferry_slab_last_error(const ferry_slab *s)
{
    return s ? ferry__err_msg(&s->err) : "";
}

uint64_t ferry_slab_capacity(const ferry_slab *s)
{
    return s ? s->capacity : 0;
}

size_t ferry_slab_alignment(const ferry_slab *s)
{
    return s ? (size_t)s->align : 0;
}

/* ---- allocate and free (caller holds mu) ---- */

static int take(ferry_slab *s, uint64_t need, ferry_extent *out)
{
    uint32_t t = first_fit(s, need);
    if (t == NIL)
        return FERRY_ENOSPACE;
    tnode *n = &s->nodes[t];
    uint64_t off = n->off;
    /* first fit hands out an aligned free block that holds need, and the
     * free bytes cover it: free + used == capacity */
    FERRY__ASSERT(n->size >= need && !(off & (s->align - 1)));
    FERRY__ASSERT(s->used_bytes + need <= s->capacity);
    if (n->size == need) {
        s->root = t_erase(s, s->root, off);
        drop_node(s, t);
    } else {
        n->off += need;
        n->size -= need;
        t_fix(s, s->root, n->off);
    }
    u_put(s, off, need);
    s->used_bytes += need;
    out->offset = off;
    out->size = need;
    return 0;
}

/* free a known extent; needs one spare node (reserve_node before) */
static void give(ferry_slab *s, used_ent *e)
{
    uint64_t off = e->off, size = e->size;
    FERRY__ASSERT(e->readers == 0 && s->used_bytes >= size);
    u_del(s, e);
    s->used_bytes -= size;
    uint32_t p, q;
    neighbours(s, off, &p, &q);
    /* an allocated extent overlaps no free block */
    FERRY__ASSERT(p == NIL || s->nodes[p].off + s->nodes[p].size <= off);
    FERRY__ASSERT(q == NIL || off + size <= s->nodes[q].off);
    int lp = p != NIL && s->nodes[p].off + s->nodes[p].size == off;
    int lq = q != NIL && s->nodes[q].off == off + size;
    if (lp && lq) {
        uint64_t qoff = s->nodes[q].off, qsize = s->nodes[q].size;
        s->root = t_erase(s, s->root, qoff);
        drop_node(s, q);
        s->nodes[p].size += size + qsize;
        t_fix(s, s->root, s->nodes[p].off);
    } else if (lp) {
        s->nodes[p].size += size;
        t_fix(s, s->root, s->nodes[p].off);
    } else if (lq) {
        s->nodes[q].off = off;
        s->nodes[q].size += size;
        t_fix(s, s->root, off);
    } else {
        s->root = t_insert(s, s->root, new_node(s, off, size));
    }
}

/* FERRY_ENOSPACE when count objects of bytes each cannot fit in the free
 * bytes at all: refused before any bookkeeping is sized by count */
static int fits_at_all(ferry_slab *s, uint64_t bytes, unsigned count)
{
    if (bytes > s->capacity)
        return ferry__err_set(&s->err, FERRY_ENOSPACE,
                              "slab: %u object(s) of %llu bytes: larger than the slab (%llu bytes)",
                              count, (unsigned long long)bytes,
                              (unsigned long long)s->capacity);
    /* bytes <= capacity, a multiple of align: rounding up cannot wrap */
    uint64_t need = (bytes + s->align - 1) & ~(s->align - 1), total;
    if (__builtin_mul_overflow(need, (uint64_t)count, &total) ||
        total > s->capacity - s->used_bytes)
        return ferry__err_set(&s->err, FERRY_ENOSPACE,
                              "slab: out of space: %u object(s) of %llu bytes need more than the "
                              "%llu of %llu bytes free",
                              count, (unsigned long long)need,
                              (unsigned long long)(s->capacity - s->used_bytes),
                              (unsigned long long)s->capacity);
    return 0;
}

static int alloc_locked(ferry_slab *s, uint64_t bytes, unsigned count, ferry_extent *out)
{
    int rc = fits_at_all(s, bytes, count);
    if (rc < 0)
        return rc;
    uint64_t need = (bytes + s->align - 1) & ~(s->align - 1);
    if (u_reserve(s, count) < 0 || reserve_node(s) < 0)
        return ferry__err_set(&s->err, -ENOMEM,
                              "slab: out of memory for the bookkeeping of %u extent(s)", count);
    for (unsigned i = 0; i < count; i++) {
        if (take(s, need, &out[i]) == 0)
            continue;
        /* all-or-nothing: give back what this call took, newest first */
        for (unsigned j = i; j-- > 0;)
            give(s, u_find(s, out[j].offset));
        return ferry__err_set(
            &s->err, FERRY_ENOSPACE,
            "slab: out of space: object %u of %u needs %llu bytes; %llu of %llu bytes free, "
            "largest free block %llu",
            i + 1, count, (unsigned long long)need,
            (unsigned long long)(s->capacity - s->used_bytes), (unsigned long long)s->capacity,
            (unsigned long long)nmax(s, s->root));
    }
    s->allocs += count;
    return (int)count;
}

int ferry_slab_alloc(ferry_slab *s, const ferry_layout *l, unsigned count, ferry_extent *out)
{
    if (!s || !out || count == 0 || count > INT32_MAX)
        return ferry__err_set(s ? &s->err : NULL, -EINVAL,
                              "slab: alloc of %u objects: NULL slab/out or bad count", count);
    uint64_t bytes;
    int rc = ferry_layout_bytes(l, &bytes);
    pthread_mutex_lock(&s->mu);
    if (rc < 0) {
        ferry__err_pass(&s->err, rc);
        s->failures++;
    } else {
        /* out stays untouched on failure: stage the extents in a copy */
        ferry_extent small[16];
        ferry_extent *tmp = small;
        if ((rc = fits_at_all(s, bytes, count)) < 0)
            tmp = NULL;
        else if (count > FERRY__ARRAY_LEN(small) && !(tmp = ferry__malloc(count * sizeof *tmp)))
            rc = ferry__err_set(&s->err, -ENOMEM, "slab: out of memory staging %u extents",
                                count);
        if (tmp) {
            rc = alloc_locked(s, bytes, count, tmp);
            if (rc > 0)
                memcpy(out, tmp, count * sizeof *tmp);
            else
                s->failures++;
            if (tmp != small)
                ferry__free(tmp);
        } else {
            s->failures++;
        }
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}

int ferry_slab_alloc_bytes(ferry_slab *s, uint64_t bytes, ferry_extent *out)
{
    if (!s || !out || bytes == 0)
        return ferry__err_set(s ? &s->err : NULL, -EINVAL,
                              "slab: alloc of %llu bytes: NULL slab/out or zero size",
                              (unsigned long long)bytes);
    ferry_extent one;
    pthread_mutex_lock(&s->mu);
    int rc = alloc_locked(s, bytes, 1, &one);
    if (rc > 0)
        *out = one;
    else
        s->failures++;
    pthread_mutex_unlock(&s->mu);
    return rc;
}

int ferry_slab_free(ferry_slab *s, const ferry_extent *e)
{
    if (!s || !e)
        return ferry__err_set(s ? &s->err : NULL, -EINVAL, "slab: free of a NULL extent");
    int rc = 0;
    pthread_mutex_lock(&s->mu);
    used_ent *u = (e->offset & (s->align - 1)) ? NULL : u_find(s, e->offset);
    if (!u)
        rc = ferry__err_set(&s->err, FERRY_ENOTFOUND,
                            "slab: free at offset %llu: no extent starts there",
                            (unsigned long long)e->offset);
    else if (u->size != e->size)
        rc = ferry__err_set(&s->err, FERRY_EMISMATCH,
                            "slab: free at offset %llu of %llu bytes: the extent has %llu",
                            (unsigned long long)e->offset, (unsigned long long)e->size,
                            (unsigned long long)u->size);
    else if (u->readers)
        rc = ferry__err_set(&s->err, FERRY_ELOCKED,
                            "slab: free at offset %llu: %u read lock(s) held",
                            (unsigned long long)e->offset, u->readers);
    else if (reserve_node(s) < 0)
        rc = ferry__err_set(&s->err, -ENOMEM, "slab: free at offset %llu: out of memory",
                            (unsigned long long)e->offset);
    else {
        give(s, u);
        s->frees++;
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}

/* ---- key states ---- */

static used_ent *find_or_err(ferry_slab *s, uint64_t off, const char *what, int *rc)
{
    used_ent *u = (off & (s->align - 1)) ? NULL : u_find(s, off);
    if (!u)
        *rc = ferry__err_set(&s->err, FERRY_ENOTFOUND, "slab: %s at offset %llu: no extent",
                             what, (unsigned long long)off);
    return u;
}

static const char *state_name(const used_ent *u)
{
    if (u->readers)
        return "read-locked";
    return u->state == FERRY_EXTENT_WRITING ? "writing" : "ready";
}

/* -EINVAL for a call given no slab, recorded for the calling thread */
static int null_slab(const char *what)
{
    return ferry__err_set(NULL, -EINVAL, "slab: %s: NULL slab", what);
}

int ferry_slab_commit(ferry_slab *s, uint64_t offset)
{
    if (!s)
        return null_slab("commit");
    int rc = 0;
    pthread_mutex_lock(&s->mu);
    used_ent *u = find_or_err(s, offset, "commit", &rc);
    if (u && u->state != FERRY_EXTENT_WRITING)
        rc = ferry__err_set(&s->err, FERRY_ESTATE, "slab: commit at offset %llu: extent is %s",
                            (unsigned long long)offset, state_name(u));
    else if (u)
        u->state = FERRY_EXTENT_READY;
    pthread_mutex_unlock(&s->mu);
    return rc;
}

int ferry_slab_read_lock(ferry_slab *s, uint64_t offset)
{
    if (!s)
        return null_slab("read lock");
    int rc = 0;
    pthread_mutex_lock(&s->mu);
    used_ent *u = find_or_err(s, offset, "read lock", &rc);
    if (u && u->state == FERRY_EXTENT_WRITING)
        rc = ferry__err_set(&s->err, FERRY_ENOTREADABLE,
                            "slab: read lock at offset %llu: extent is being written",
                            (unsigned long long)offset);
    else if (u && u->readers == UINT32_MAX)
        rc = ferry__err_set(&s->err, -EOVERFLOW, "slab: read lock at offset %llu: too many",
                            (unsigned long long)offset);
    else if (u)
        u->readers++;
    pthread_mutex_unlock(&s->mu);
    return rc;
}

int ferry_slab_read_unlock(ferry_slab *s, uint64_t offset)
{
    if (!s)
        return null_slab("read unlock");
    int rc = 0;
    pthread_mutex_lock(&s->mu);
    used_ent *u = find_or_err(s, offset, "read unlock", &rc);
    if (u && !u->readers)
        rc = ferry__err_set(&s->err, FERRY_ESTATE,
                            "slab: read unlock at offset %llu: no read lock held (extent is %s)",
                            (unsigned long long)offset, state_name(u));
    else if (u)
        u->readers--;
    pthread_mutex_unlock(&s->mu);
    return rc;
}

int ferry_slab_write_lock(ferry_slab *s, uint64_t offset)
{
    if (!s)
        return null_slab("write lock");
    int rc = 0;
    pthread_mutex_lock(&s->mu);
    used_ent *u = find_or_err(s, offset, "write lock", &rc);
    if (u && u->readers)
        rc = ferry__err_set(&s->err, FERRY_ENOTWRITABLE,
                            "slab: write lock at offset %llu: %u read lock(s) held",
                            (unsigned long long)offset, u->readers);
    else if (u && u->state == FERRY_EXTENT_WRITING)
        rc = ferry__err_set(&s->err, FERRY_ESTATE,
                            "slab: write lock at offset %llu: already being written",
                            (unsigned long long)offset);
    else if (u)
        u->state = FERRY_EXTENT_WRITING;
    pthread_mutex_unlock(&s->mu);
    return rc;
}

int ferry_slab_state(ferry_slab *s, uint64_t offset, unsigned *readers)
{
    if (!s)
        return null_slab("state");
    pthread_mutex_lock(&s->mu);
    used_ent *u = (offset & (s->align - 1)) ? NULL : u_find(s, offset);
    int st = FERRY_EXTENT_ABSENT;
    unsigned r = 0;
    if (u) {
        r = u->readers;
        st = r ? FERRY_EXTENT_READING : (int)u->state;
    }
    pthread_mutex_unlock(&s->mu);
    if (readers)
        *readers = r;
    return st;
}

/* ---- accounting and the walker ---- */

int ferry_slab_stats_get(const ferry_slab *cs, ferry_slab_stats *out)
{
    if (!cs || !out)
        return ferry__err_set(NULL, -EINVAL, "ferry_slab_stats_get: slab or out is NULL");
    ferry_slab *s = (ferry_slab *)cs; /* its mutex is taken, nothing written */
    pthread_mutex_lock(&s->mu);
    ferry_slab_stats st = FERRY_SLAB_STATS_INIT;
    st.capacity = s->capacity;
    st.used = s->used_bytes;
    st.free = s->capacity - s->used_bytes;
    st.largest_free = nmax(s, s->root);
    st.used_blocks = s->ucount;
    st.free_blocks = s->free_blocks;
    st.usage = (double)st.used / (double)st.capacity;
    st.fragmentation = st.free ? 1.0 - (double)st.largest_free / (double)st.free : 0.0;
    st.allocs = s->allocs;
    st.frees = s->frees;
    st.failures = s->failures;
    pthread_mutex_unlock(&s->mu);
    return ferry__stats_put(&s->err, "ferry_slab_stats_get", out, &st, sizeof st);
}

typedef struct walk {
    ferry_slab *s;
    uint64_t cursor;   /* end of the tiling verified so far */
    uint64_t nfree, free_bytes, used_seen;
    int rc;
} walk;

/* record the first broken invariant (later ones are consequences) */
#define corrupt(w, fmt, a, b)                                                              \
    ((w)->rc ? (w)->rc                                                                     \
             : ((w)->rc = ferry__err_set(&(w)->s->err, FERRY_ECORRUPT, "slab check: " fmt, \
                                         (unsigned long long)(a), (unsigned long long)(b))))

/* used extents must tile [w->cursor, end) exactly */
static void walk_used(walk *w, uint64_t end)
{
    while (w->rc == 0 && w->cursor < end) {
        used_ent *u = u_find(w->s, w->cursor);
        if (!u) {
            corrupt(w, "bytes at %llu (before %llu) belong to no block", w->cursor, end);
            return;
        }
        if (u->size == 0 || (u->size & (w->s->align - 1)) || w->cursor + u->size > end) {
            corrupt(w, "extent at %llu of %llu bytes overlaps the next block", w->cursor,
                    u->size);
            return;
        }
        w->cursor += u->size;
        w->used_seen++;
    }
}

static void walk_free(walk *w, uint32_t t, uint64_t lo, uint64_t hi, unsigned depth)
{
    if (t == NIL || w->rc)
        return;
    ferry_slab *s = w->s;
    const tnode *n = &s->nodes[t];
    if (depth > 4096) {
        (void)corrupt(w, "tree deeper than %llu at node %llu", 4096, t);
        return;
    }
    if (n->off < lo || n->off >= hi)
        corrupt(w, "free block at %llu out of key order (bound %llu)", n->off,
                n->off < lo ? lo : hi);
    if (n->l != NIL && s->nodes[n->l].prio > n->prio)
        corrupt(w, "heap order broken below %llu (node %llu)", n->off, n->l);
    if (n->r != NIL && s->nodes[n->r].prio > n->prio)
        corrupt(w, "heap order broken below %llu (node %llu)", n->off, n->r);
    uint64_t m = n->size;
    m = FERRY__MAX(m, nmax(s, n->l));
    m = FERRY__MAX(m, nmax(s, n->r));
    if (m != n->max)
        corrupt(w, "cached maximum at %llu is %llu", n->off, n->max);
    walk_free(w, n->l, lo, n->off, depth + 1);
    if (w->rc)
        return;
    if (n->size == 0 || ((n->off | n->size) & (s->align - 1)))
        corrupt(w, "free block at %llu of %llu bytes is empty or unaligned", n->off, n->size);
    /* the cursor still at n->off after the previous free block: they touch */
    uint64_t before = w->cursor;
    walk_used(w, n->off);
    if (w->rc == 0 && w->nfree && before == n->off)
        corrupt(w, "free blocks touch at %llu (size %llu): not coalesced", n->off, n->size);
    if (w->rc == 0 && w->cursor != n->off)
        corrupt(w, "free block at %llu overlaps the block before (ends %llu)", n->off, w->cursor);
    if (w->rc == 0 && n->off + n->size > s->capacity)
        corrupt(w, "free block at %llu runs past the end (%llu)", n->off, s->capacity);
    w->cursor = n->off + n->size;
    w->nfree++;
    w->free_bytes += n->size;
    walk_free(w, n->r, n->off + 1, hi, depth + 1);
}

int ferry_slab_check(ferry_slab *s)
{
    if (!s)
        return null_slab("check");
    pthread_mutex_lock(&s->mu);
    walk w = {s, 0, 0, 0, 0, 0};
    walk_free(&w, s->root, 0, UINT64_MAX, 0);
    if (w.rc == 0)
        walk_used(&w, s->capacity);
    if (w.rc == 0 && w.cursor != s->capacity)
        corrupt(&w, "blocks end at %llu, not at the capacity %llu", w.cursor, s->capacity);
    if (w.rc == 0 && w.nfree != s->free_blocks)
        corrupt(&w, "%llu free blocks in the tree, %llu counted", w.nfree, s->free_blocks);
    if (w.rc == 0 && w.used_seen != s->ucount)
        corrupt(&w, "%llu extents tile the slab but %llu are recorded", w.used_seen, s->ucount);
    if (w.rc == 0 && w.free_bytes + s->used_bytes != s->capacity)
        corrupt(&w, "free %llu + used bytes do not add up to the capacity %llu", w.free_bytes,
                s->capacity);
    if (w.rc == 0 && nmax(s, NIL) != 0)
        corrupt(&w, "the nil node's maximum is %llu (%llu)", nmax(s, NIL), 0);
    pthread_mutex_unlock(&s->mu);
    return w.rc;
}
