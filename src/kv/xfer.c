/*
 * xfer.c - moving one chunk between an engine's KV buffer and a chunk image
 * in host memory.
 *
 * A chunk image is [kv][layers][chunk_tokens][heads*head_dim]; the engine's
 * buffer is either one contiguous tensor [kv][layers][capacity][...] or
 * vLLM's paged blocks. Either way the copy is a list of runs, one per
 * (kv, layer) for a contiguous buffer and one per (kv, layer, block) for a
 * paged one, where consecutive block ids that lie back to back in memory
 * make one run (a sequence whose blocks were allocated in order costs as
 * few copies as a contiguous buffer); each run is a memcpy (host) or an asynchronous device copy
 * queued on the caller's stream (device), so the runs of a chunk and of
 * the next chunk overlap with whatever the caller does meanwhile.
 *
 * On the host the runs of a large copy are streamed in whole cache lines:
 * a run that starts or ends inside a line leaves that part until the run
 * that finishes the line (copy.h), so an engine's buffer that does not
 * start on a line costs about what one that does. The side that is read
 * is walked front to back: a retrieve in the image's order, a store in
 * the engine's where a block holds its heads apart (HND, packed K|V).
 * Such a block is copied whole (xtile: tile_store, tile_retrieve) rather
 * than run by run: with runs of 64 bytes (head_dim 32 at bf16) the work
 * around each run (a call, a search of the lines table) cost more than
 * its copy. A retrieve of a whole block whose heads lie back to back
 * (tile_retrieve_whole: HND's, packed K|V's) joins each line that two
 * runs share straight from their two sources, the run before known from
 * the indices, and holds the block's last part for the next block where
 * that one follows in memory; a block that a chunk splits keeps one part
 * of a line per head, which the head's next run finishes. A store
 * fetches the next block ahead.
 *
 * Invariant: a buffer is validated whole (layout, capacity, every block id
 * the request touches) before the first byte moves, so a bad request never
 * leaves a half-written destination.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "kv/kv_impl.h"
#include "copy.h"
#include "sized.h"

int ferry_kv_layout_chunk_bytes(const ferry_kv_layout *l, uint32_t chunk_tokens, uint64_t *out)
{
    if (!l || !out || !l->num_layers || !l->num_heads || !l->head_dim || !chunk_tokens ||
        (l->kv != 1 && l->kv != 2) || !ferry_dtype_size(l->dtype))
        return ferry__err_set(NULL, -EINVAL,
                              "kv layout: bad layout (layers %u, kv %u, heads %u, head_dim %u, "
                              "dtype %d, chunk_tokens %u)",
                              l ? l->num_layers : 0, l ? l->kv : 0, l ? l->num_heads : 0,
                              l ? l->head_dim : 0, l ? l->dtype : -1, chunk_tokens);
    __uint128_t b = (__uint128_t)l->kv * l->num_layers * chunk_tokens * l->num_heads *
                    l->head_dim * ferry_dtype_size(l->dtype);
    if (b > (__uint128_t)INT64_MAX)
        return ferry__err_set(NULL, -EOVERFLOW, "kv layout: chunk size overflows");
    *out = (uint64_t)b;
    return 0;
}

static int same_layout(const ferry_kv_layout *a, const ferry_kv_layout *b)
{
    return a->num_layers == b->num_layers && a->kv == b->kv && a->num_heads == b->num_heads &&
           a->head_dim == b->head_dim && a->dtype == b->dtype;
}

/* a paged buffer's strides made whole (0 -> NHD's, the block's extent)
 * and checked: no two runs of a block overlap, no block the next; 0 or
 * -EINVAL naming the stride */
static int paged_strides(ferry_kv_buffer *b, const char *what, ferry__errbuf *eb)
{
    const ferry_kv_layout *l = &b->layout;
    uint64_t run = (uint64_t)l->head_dim * ferry_dtype_size(l->dtype);
    uint64_t tb = run * l->num_heads, bt = b->block_tokens, h = l->num_heads;
    if (!b->head_stride || h == 1)
        b->head_stride = run;
    if (!b->token_stride)
        b->token_stride = tb;
    uint64_t ts = b->token_stride, hs = b->head_stride;
    /* (in 128 bits: a hostile stride times a row count must not wrap) */
    const __uint128_t far = (__uint128_t)1 << 56; /* past any address space */
    __uint128_t ext = (__uint128_t)(bt - 1) * ts + (__uint128_t)(h - 1) * hs + run;
    if (ext >= far || b->block_stride >= far ||
        (__uint128_t)b->block_stride * b->num_blocks >= far)
        return ferry__err_set(eb, -EINVAL,
                              "kv %s: strides (token %llu, head %llu, block %llu) over %llu "
                              "blocks of %llu tokens reach past any address space",
                              what, (unsigned long long)ts, (unsigned long long)hs,
                              (unsigned long long)b->block_stride,
                              (unsigned long long)b->num_blocks, (unsigned long long)bt);
    if (ts < run || hs < run)
        return ferry__err_set(eb, -EINVAL,
                              "kv %s: %s stride %llu is below one head_dim run of %llu bytes",
                              what, ts < run ? "token" : "head",
                              (unsigned long long)(ts < run ? ts : hs),
                              (unsigned long long)run);
    /* heads inside a row and rows apart (NHD), or rows inside a head and
     * heads apart (HND, packed K|V): anything else may overlap */
    int nhd = (__uint128_t)ts >= (__uint128_t)(h - 1) * hs + run;
    int hnd = (__uint128_t)hs >= (__uint128_t)(bt - 1) * ts + run;
    if (!nhd && !hnd)
        return ferry__err_set(eb, -EINVAL,
                              "kv %s: token stride %llu and head stride %llu overlap the runs of "
                              "a block (%llu heads of %llu bytes, %llu rows): rows must hold "
                              "their heads or heads their rows",
                              what, (unsigned long long)ts, (unsigned long long)hs,
                              (unsigned long long)h, (unsigned long long)run,
                              (unsigned long long)bt);
    uint64_t extent = (uint64_t)ext;
    if (!b->block_stride)
        b->block_stride = extent;
    if (b->block_stride < extent)
        return ferry__err_set(eb, -EINVAL,
                              "kv %s: block stride %llu is below one block (%llu bytes)", what,
                              (unsigned long long)b->block_stride, (unsigned long long)extent);
    return 0;
}

int ferry__kv_buffer_take(const ferry_kv_buffer *in, ferry_kv_buffer *buf,
                          const ferry_kv_layout *layout, ferry_device *dev, size_t n,
                          const char *what, ferry__errbuf *eb)
{
    static const ferry__member later[] = {FERRY__MEMBER(ferry_kv_buffer, token_stride),
                                          FERRY__MEMBER(ferry_kv_buffer, head_stride)};
    static const ferry__sized sized =
        FERRY__SIZED(ferry_kv_buffer, FERRY_KV_BUFFER_MIN_SIZE, later);
    if (!in)
        return ferry__err_set(eb, -EINVAL, "kv %s: buffer is NULL", what);
    if (!ferry__opts_size_fits(&sized, in->size)) {
        char who[64];
        snprintf(who, sizeof who, "kv %s: buffer", what);
        return ferry__opts_size_ok(eb, who, &sized, in->size);
    }
    *buf = (ferry_kv_buffer)FERRY_KV_BUFFER_INIT;
    memcpy(buf, in, in->size);
    buf->size = sizeof *buf;
    const ferry_kv_layout *l = &buf->layout;
    if (!same_layout(l, layout))
        return ferry__err_set(eb, FERRY_EMISMATCH,
                              "kv %s: buffer layout (layers %u, kv %u, heads %u, head_dim %u, %s) "
                              "differs from the store's (layers %u, kv %u, heads %u, head_dim %u, "
                              "%s)",
                              what, l->num_layers, l->kv, l->num_heads, l->head_dim,
                              ferry_dtype_name(l->dtype), layout->num_layers, layout->kv,
                              layout->num_heads, layout->head_dim,
                              ferry_dtype_name(layout->dtype));
    if (buf->mem != FERRY_KV_MEM_HOST && buf->mem != FERRY_KV_MEM_DEVICE)
        return ferry__err_set(eb, -EINVAL, "kv %s: unknown memory kind %d", what, buf->mem);
    if (buf->mem == FERRY_KV_MEM_DEVICE && !dev)
        return ferry__err_set(eb, FERRY_ENODEV,
                              "kv %s: device buffer but the store was opened without a device",
                              what);
    if (buf->form == FERRY_KV_CONTIGUOUS) {
        if (!buf->base)
            return ferry__err_set(eb, -EINVAL, "kv %s: contiguous buffer has no base address",
                                  what);
        if (buf->capacity_tokens < n)
            return ferry__err_set(eb, -ENOBUFS,
                                  "kv %s: buffer holds %llu tokens, the request has %zu", what,
                                  (unsigned long long)buf->capacity_tokens, n);
        return 0;
    }
    if (buf->form != FERRY_KV_PAGED)
        return ferry__err_set(eb, -EINVAL, "kv %s: unknown buffer form %d", what, buf->form);
    if (!buf->block_bases || !buf->block_table || !buf->block_tokens)
        return ferry__err_set(eb, -EINVAL,
                              "kv %s: paged buffer needs block_bases, block_table and "
                              "block_tokens",
                              what);
    int rc = paged_strides(buf, what, eb);
    if (rc < 0)
        return rc;
    uint64_t need = (n + buf->block_tokens - 1) / buf->block_tokens;
    if (buf->table_len < need)
        return ferry__err_set(eb, -ENOBUFS,
                              "kv %s: block table has %zu blocks of %u tokens, the request needs "
                              "%llu for %zu tokens",
                              what, buf->table_len, buf->block_tokens, (unsigned long long)need,
                              n);
    for (uint32_t i = 0; i < layout->kv * layout->num_layers; i++)
        if (!buf->block_bases[i])
            return ferry__err_set(eb, -EINVAL, "kv %s: block base %u is 0", what, i);
    for (uint64_t b = 0; b < need; b++)
        if (buf->block_table[b] < 0 || (uint64_t)buf->block_table[b] >= buf->num_blocks)
            return ferry__err_set(eb, -EINVAL,
                                  "kv %s: block table entry %llu is %d, outside [0, %llu)", what,
                                  (unsigned long long)b, buf->block_table[b],
                                  (unsigned long long)buf->num_blocks);
    return 0;
}

/* one block's rows of a cache whose heads lie apart (HND, packed K|V),
 * handed whole to a copy that can do better than run by run: rows
 * [0, rows) of heads [0, heads) of planes [0, np), the run of (row r,
 * head h, plane p) at eng[p] + r*ts + h*hs in the engine's buffer and at
 * img[p] + r*tb + h*run in the image; next: the engine's bytes [next[0],
 * next[1]) of the walk's next block (else both 0) */
typedef struct xtile {
    uint64_t eng[2];
    unsigned char *img[2];
    unsigned np;
    uint32_t heads;
    uint64_t rows, ts, hs, tb, run;
    uint64_t next[2];
} xtile;
/* 0 (copied), 1 (left to the walk, run by run) or an error */
#define XTILE_HEADS 128 /* (the most heads a tile's copy takes) */
typedef int (*xtile_fn)(void *ctx, const xtile *t);

/* a tile fn's call for one block (k rows from off in each plane's blocks,
 * at in the image parts; nxt: where the next block of plane pl[0] starts
 * in the engine's buffer, or 0) */
static FERRY__ALWAYS_INLINE int tile_block(const ferry_kv_buffer *buf, const uint64_t *pl,
                                           unsigned char *const *part, unsigned np, uint64_t off,
                                           uint64_t at, uint64_t k, uint64_t nxt, xtile_fn tile,
                                           void *ctx)
{
    const ferry_kv_layout *l = &buf->layout;
    xtile t = {{0, 0}, {NULL, NULL}, np, l->num_heads, k, buf->token_stride, buf->head_stride,
               ferry__kv_token_bytes(l), (uint64_t)l->head_dim * ferry_dtype_size(l->dtype), {0, 0}};
    if (np > 2 || !t.ts || !t.hs)
        return 1;
    for (unsigned p = 0; p < np; p++) {
        t.eng[p] = buf->block_bases[pl[p]] + off;
        t.img[p] = part[p] + at;
    }
    if (nxt) { /* (a block's planes: one span where they share its rows) */
        uint64_t b0 = buf->block_bases[pl[0]], b1 = np > 1 ? buf->block_bases[pl[1]] : b0;
        uint64_t d = b1 > b0 ? b1 - b0 : b0 - b1;
        d = d < t.ts ? d : 0;
        t.next[0] = nxt - (b1 < b0 ? d : 0);
        t.next[1] = nxt + (b1 > b0 ? d : 0) + (uint64_t)(l->num_heads - 1) * t.hs +
                    (uint64_t)(buf->block_tokens - 1) * t.ts + t.run;
    }
    return tile(ctx, &t);
}

/* the runs of planes pl[0..np) of a paged buffer for tokens [tok0,
 * tok0+ntok), part[i] the image part of plane pl[i]; each plane's runs in
 * the order of the image part they fill (the checksum's order, and the
 * faster one for a retrieve: the image is read front to back, the
 * engine's lines written whole wherever they are), or with engine_order
 * in the engine's order where a block holds its heads apart (HND, packed
 * K|V: each head's rows, then the next head's), the faster one for a
 * store, which reads the engine's buffer: reads that jump cost more than
 * whole lines written where they jump to. A block's rows are one run
 * where they lie back to back (and consecutive blocks too, where blocks
 * do), else a row of heads, else one head's run. Two planes (a plain
 * copy's K and V of one layer) go run by run together, so K and V that
 * share the engine's rows or blocks (packed K|V, FlashInfer) are read
 * front to back too. blk_end (when not NULL) is called after each block's
 * runs: no two runs of one block overlap (paged_strides), those of two
 * blocks may (a table naming one block twice) */
static FERRY__ALWAYS_INLINE int walk_paged(const ferry_kv_buffer *buf, const uint64_t *pl,
                                           unsigned char *const *part, unsigned np, uint64_t tb,
                                           uint64_t tok0, uint32_t ntok, int engine_order,
                                           ferry__kv_run_fn fn, xtile_fn tile,
                                           void (*blk_end)(void *), void *ctx)
{
    const ferry_kv_layout *l = &buf->layout;
    uint64_t run = (uint64_t)l->head_dim * ferry_dtype_size(l->dtype);
    /* (taken buffers have every stride; a bare one's 0s are NHD's) */
    uint64_t ts = buf->token_stride ? buf->token_stride : tb;
    uint64_t hs = buf->head_stride ? buf->head_stride : run;
    uint64_t stride = buf->block_stride ? buf->block_stride : buf->block_tokens * tb;
    int row_whole = hs == run || l->num_heads == 1;   /* a row's heads back to back */
    int block_whole = row_whole && ts == tb;          /* a block's rows too */
    int packed = block_whole && stride == (uint64_t)buf->block_tokens * tb;
    uint64_t t = tok0, end = tok0 + ntok;
    while (t < end) {
        uint64_t blk = t / buf->block_tokens, row = t % buf->block_tokens;
        uint64_t k = FERRY__MIN(end - t, buf->block_tokens - row);
        uint64_t off = (uint64_t)buf->block_table[blk] * stride, at = (t - tok0) * tb;
        int rc = 0, tiled;
        if (block_whole) {
            /* blocks that follow each other in memory are one run */
            while (packed && t + k < end &&
                   buf->block_table[blk + 1] == buf->block_table[blk] + 1) {
                blk++;
                k += FERRY__MIN(end - (t + k), (uint64_t)buf->block_tokens);
            }
            for (unsigned p = 0; rc == 0 && p < np; p++)
                rc = fn(ctx, buf->block_bases[pl[p]] + off + row * tb, part[p] + at, k * tb);
        } else if (tile && !row_whole &&
                   (tiled = tile_block(buf, pl, part, np, off + row * ts, at, k,
                                       t + k < end ? buf->block_bases[pl[0]] +
                                                         buf->block_table[blk + 1] * stride
                                                   : 0,
                                       tile, ctx)) != 1) {
            rc = tiled; /* copied whole, or failed */
        } else if (engine_order && !row_whole && hs > ts) {
            for (uint32_t h = 0; rc == 0 && h < l->num_heads; h++)
                for (uint64_t r = row, a = at; rc == 0 && r < row + k; r++, a += tb)
                    for (unsigned p = 0; rc == 0 && p < np; p++)
                        rc = fn(ctx, buf->block_bases[pl[p]] + off + r * ts + h * hs,
                                part[p] + a + h * run, run);
        } else {
            for (uint64_t r = row; rc == 0 && r < row + k; r++, at += tb) {
                if (row_whole) {
                    for (unsigned p = 0; rc == 0 && p < np; p++)
                        rc = fn(ctx, buf->block_bases[pl[p]] + off + r * ts, part[p] + at, tb);
                    continue;
                }
                for (uint32_t h = 0; rc == 0 && h < l->num_heads; h++)
                    for (unsigned p = 0; rc == 0 && p < np; p++)
                        rc = fn(ctx, buf->block_bases[pl[p]] + off + r * ts + h * hs,
                                part[p] + at + h * run, run);
            }
        }
        if (blk_end)
            blk_end(ctx);
        if (rc < 0)
            return rc;
        t += k;
    }
    return 0;
}

/* the runs of layers [layer0, layer1) (see ferry__kv_xfer_walk); kv_together:
 * a paged buffer's K and V of a layer walked together where they share
 * blocks (a plain copy; the checksum and ferry__kv_xfer_walk want each
 * plane whole, in order); engine_order and blk_end: see walk_paged */
static FERRY__ALWAYS_INLINE int walk_layers(const ferry_kv_buffer *buf, uint32_t chunk_tokens,
                                            uint64_t tok0, uint32_t ntok, void *chunk,
                                            uint32_t layer0, uint32_t layer1, int kv_together,
                                            int engine_order, ferry__kv_run_fn fn,
                                            xtile_fn tile, void (*blk_end)(void *), void *ctx)
{
    const ferry_kv_layout *l = &buf->layout;
    uint64_t tb = ferry__kv_token_bytes(l);
    unsigned char *img = chunk;
    uint64_t span = (uint64_t)chunk_tokens * tb; /* one plane of the image */
    /* together only where a layer's K and V share blocks (FlashInfer's
     * [blocks][2], packed K|V): apart (NHD, HND) two far streams cost more */
    uint64_t bstride = buf->block_stride ? buf->block_stride : buf->block_tokens * tb;
    for (uint32_t layer = layer0;
         kv_together && buf->form == FERRY_KV_PAGED && l->kv == 2 && layer < layer1; layer++) {
        uint64_t k = buf->block_bases[layer], v = buf->block_bases[l->num_layers + layer];
        kv_together = (k > v ? k - v : v - k) < bstride;
    }
    if (kv_together && buf->form == FERRY_KV_PAGED && l->kv == 2) {
        for (uint32_t layer = layer0; layer < layer1; layer++) {
            uint64_t pl[2] = {layer, (uint64_t)l->num_layers + layer};
            unsigned char *part[2] = {img + pl[0] * span, img + pl[1] * span};
            int rc = walk_paged(buf, pl, part, 2, tb, tok0, ntok, engine_order, fn, tile,
                                blk_end, ctx);
            if (rc < 0)
                return rc;
        }
        return 0;
    }
    for (uint32_t kvi = 0; kvi < l->kv; kvi++) {
        for (uint32_t layer = layer0; layer < layer1; layer++) {
            uint64_t plane = (uint64_t)kvi * l->num_layers + layer;
            unsigned char *part = img + plane * span;
            int rc;
            if (buf->form == FERRY_KV_CONTIGUOUS)
                rc = fn(ctx, buf->base + (plane * buf->capacity_tokens + tok0) * tb, part,
                        (uint64_t)ntok * tb);
            else
                rc = walk_paged(buf, &plane, &part, 1, tb, tok0, ntok, engine_order, fn, tile,
                                blk_end, ctx);
            if (rc < 0)
                return rc;
        }
    }
    return 0;
}

int ferry__kv_xfer_walk(const ferry_kv_buffer *buf, uint32_t chunk_tokens, uint64_t tok0,
                        uint32_t ntok, void *chunk, ferry__kv_run_fn fn, void *ctx)
{
    return walk_layers(buf, chunk_tokens, tok0, ntok, chunk, 0, buf->layout.num_layers, 0, 0, fn,
                       NULL, NULL, ctx);
}

/* the last part of a line that a whole block (tile_retrieve_whole) left,
 * written when the next block does not continue it (n: 0, none) */
typedef struct xpend {
    unsigned char *d;
    const unsigned char *s;
    unsigned n;
} xpend;

static inline void xpend_flush(xpend *pe)
{
    if (pe->n)
        ferry__copy_part(pe->d, pe->s, pe->n);
    pe->n = 0;
}

/* a chunk's runs as one batch of device copies */
typedef struct xctx {
    const ferry_kv_buffer *buf;
    int to_chunk;
    int stream;      /* host: a copy of many runs that streams each (fenced at the end) */
    int join;        /* (stream) parts of lines joined across runs (lines): more than two
                      * heads, whose parts the processor's own write combining loses */
    ferry__copy_lines lines; /* (stream) the parts of lines its runs leave */
    xpend pend;              /* (stream) and the last whole block's */
    ferry_copy *c;
    size_t n, cap;
    ferry_copy local[128];
} xctx;

static FERRY__ALWAYS_INLINE int xrun(void *ctx, uint64_t addr, unsigned char *img, uint64_t len)
{
    xctx *x = ctx;
    if (x->buf->mem == FERRY_KV_MEM_HOST) {
        /* into a tier's image (read later by another copy) or the engine's
         * buffer (which it reads later): streaming stores, in whole lines
         * wherever the runs start (copy.h); a large copy of short runs (a
         * strided cache's heads) streams each run too */
        void *dst = x->to_chunk ? (void *)img : (void *)(uintptr_t)addr;
        const void *src = x->to_chunk ? (const void *)(uintptr_t)addr : (const void *)img;
        xpend_flush(&x->pend);
        if (x->join)
            ferry__copy_lines_run(&x->lines, dst, src, len);
        else if (x->stream && len < FERRY__COPY_STREAM_MIN)
            ferry__copy_stream_run(dst, src, len);
        else
            ferry__copy_stream(dst, src, len); /* (small: memcpy) */
        return 0;
    }
    if (x->n == x->cap) {
        size_t cap = x->cap * 2;
        ferry_copy *c = x->c == x->local ? ferry__malloc(cap * sizeof *c)
                                         : ferry__realloc(x->c, cap * sizeof *c);
        if (!c)
            return ferry__err_set(NULL, -ENOMEM, "kv: a batch of %zu device copies: out of memory",
                                  cap);
        if (x->c == x->local)
            memcpy(c, x->local, sizeof x->local);
        x->c = c;
        x->cap = cap;
    }
    ferry_copy *c = &x->c[x->n++];
    c->dst = x->to_chunk ? (uint64_t)(uintptr_t)img : addr;
    c->src = x->to_chunk ? addr : (uint64_t)(uintptr_t)img;
    c->bytes = len;
    return 0;
}

#if defined(FERRY__COPY_RUNS_STREAM)
/* a tile out of the engine's buffer (a store), in the engine's order,
 * which reads it front to back; each run lands on whole lines of the
 * image (pre). The next block (wherever it lies: the processor's own
 * prefetcher stops at each page, and does not guess a jump) is fetched a
 * line for each line copied, into the outer caches: all at once, or into
 * the innermost, the fetches crowd out the copy's own. COPY: the words'
 * copy (16 or 32 bytes) */
#define TILE_STORE(t, run, COPY)                                                                  \
    do {                                                                                          \
        uint64_t pf_ = (t)->next[0] & ~(uint64_t)63;                                              \
        for (uint32_t h_ = 0; h_ < (t)->heads; h_++)                                              \
            for (uint64_t r_ = 0; r_ < (t)->rows; r_++)                                           \
                for (unsigned p_ = 0; p_ < (t)->np; p_++) {                                       \
                    COPY((t)->img[p_] + r_ * (t)->tb + h_ * (run),                                \
                         (const unsigned char *)(uintptr_t)((t)->eng[p_] + r_ * (t)->ts +          \
                                                            h_ * (t)->hs),                         \
                         (run));                                                                  \
                    for (uint64_t o_ = 0; o_ < (run) && pf_ < (t)->next[1]; o_ += 64, pf_ += 64)  \
                        _mm_prefetch((const char *)(uintptr_t)pf_, _MM_HINT_T2);                  \
                }                                                                                 \
    } while (0)

static void tile_store(const xtile *t)
{
    if (t->run == 64) /* (a line: unrolled) */
        TILE_STORE(t, 64, ferry__copy_words_nt);
    else
        TILE_STORE(t, t->run, ferry__copy_words_nt);
}

#if defined(FERRY__COPY_AVX2)
__attribute__((target("avx2"))) static void tile_store_avx2(const xtile *t)
{
    if (t->run == 64)
        TILE_STORE(t, 64, ferry__copy_words_nt32);
    else
        TILE_STORE(t, t->run, ferry__copy_words_nt32);
}
#endif

/* a tile into the engine's buffer (a retrieve), in the image's order,
 * which reads the image front to back. Each head's runs lie back to back
 * in the engine's buffer (pre), so the part of a line that a run leaves
 * (its source's address in tail[h], have[h] bytes) is finished by the
 * same head's next run, and the whole line streamed; a head's first part
 * (first[h], lead[h] bytes) waits for the tile's end, where the previous
 * head's last part finishes it where the heads lie back to back (HND's
 * whole blocks); what nothing finishes goes as a part. Runs of at least
 * a line, 16-byte aligned in the engine's buffer (pre); fa: where in its
 * line every run starts, where all do at one place (else 64): a join of
 * parts whose length the compiler knows costs half what one of any
 * length does */
static FERRY__ALWAYS_INLINE void tile_retrieve(const xtile *t, uint64_t run, unsigned fa)
{
    const unsigned char *tail[XTILE_HEADS], *first[XTILE_HEADS];
    unsigned char have[XTILE_HEADS], lead[XTILE_HEADS];
    for (uint32_t h = 0; h < t->heads; h++) {
        have[h] = lead[h] = 0;
        first[h] = tail[h] = NULL;
    }
    for (uint64_t r = 0; r < t->rows; r++)
        for (uint32_t h = 0; h < t->heads; h++)
            for (unsigned p = 0; p < t->np; p++) {
                unsigned char *d = (unsigned char *)(uintptr_t)(t->eng[p] + r * t->ts + h * t->hs);
                const unsigned char *s = t->img[p] + r * t->tb + h * run;
                uint64_t n = run;
                unsigned a = fa < 64 ? fa : (unsigned)((uintptr_t)d & 63);
                if (a) {
                    if (have[h] == a)
                        ferry__copy_line_join(d - a, tail[h], a, s);
                    else if (!lead[h]) {
                        first[h] = s;
                        lead[h] = (unsigned char)(64 - a);
                    } else /* (not a head's first run: the strides rule it out) */
                        ferry__copy_part(d, s, 64 - a);
                    d += 64 - a;
                    s += 64 - a;
                    n -= 64 - a;
                }
                for (; n >= 64; n -= 64, d += 64, s += 64)
                    ferry__copy_line_nt(d, s);
                tail[h] = s;
                have[h] = (unsigned char)n;
            }
    uint64_t len = t->rows * t->ts; /* of a head's stretch */
    for (uint32_t h = 0; h < t->heads; h++) {
        unsigned char *d = (unsigned char *)(uintptr_t)(t->eng[0] + h * t->hs);
        if (!lead[h])
            continue;
        if (h && have[h - 1] && t->hs == len) { /* (then have[h - 1] is fa, where fixed) */
            unsigned a = fa < 64 ? fa : have[h - 1];
            ferry__copy_line_join(d - a, tail[h - 1], a, first[h]);
            have[h - 1] = 0;
        } else {
            ferry__copy_part(d, first[h], lead[h]);
        }
    }
    for (uint32_t h = 0; h < t->heads; h++)
        if (have[h])
            ferry__copy_part((unsigned char *)(uintptr_t)(t->eng[0] + h * t->hs + len) - have[h],
                             tail[h], have[h]);
}

/* a whole block whose heads lie back to back in the engine's buffer
 * (HND's or packed K|V's blocks of block_tokens rows: heads * rows * np
 * runs, one stretch) into it (a retrieve), in the image's order as
 * tile_retrieve; NP planes (1, or 2 whose rows interleave), RUN a
 * multiple of 64, FA where in its line the block (and so every run)
 * starts, a multiple of 16. The run before each in the engine's order is
 * known without keeping it: the same head's previous plane or row, or
 * for a head's first run the previous head's last row, read last; so a
 * line that two runs share is joined from both sources with no per-head
 * slots to read and write: with runs of a line (head_dim 32 at bf16),
 * tile_retrieve's work around each run held it below NHD's rate where
 * memory was fast. The block's first part finishes the line that the block before
 * left in pe where that one ends right here (blocks that follow each
 * other in memory), else goes as a part; its last part is left in pe
 * (xpend_flush writes it) */
static FERRY__ALWAYS_INLINE void tile_retrieve_whole(const xtile *t, xpend *pe, unsigned np,
                                                     uint64_t run, unsigned fa)
{
    unsigned char *e = (unsigned char *)(uintptr_t)t->eng[0];
    const unsigned char *i0 = t->img[0], *i1 = np > 1 ? t->img[1] : t->img[0];
    const uint64_t tb = t->tb, hs = t->hs, rows = t->rows, lead = fa ? 64 - fa : 0;
    if (fa && pe->n == fa && pe->d + fa == e) { /* continues the block before */
        ferry__copy_line_join(e - fa, pe->s, fa, i0);
        pe->n = 0;
    } else {
        xpend_flush(pe);
        if (fa)
            ferry__copy_part(e, i0, lead);
    }
    for (uint64_t r = 0; r < rows; r++) {
        unsigned char *d = e + r * np * run;
        const unsigned char *s0 = i0 + r * tb, *s1 = i1 + r * tb;
        for (uint32_t h = 0; h < t->heads; h++, d += hs, s0 += run, s1 += run)
            for (unsigned p = 0; p < np; p++) {
                unsigned char *dp = d + p * run;
                const unsigned char *s = p ? s1 : s0;
                if (fa && (r || p)) /* the line it shares with the run before */
                    ferry__copy_line_join(dp - fa, (p ? s0 : (np > 1 ? s1 : s0) - tb) + run - fa,
                                          fa, s);
                for (uint64_t o = lead; o + 64 <= run; o += 64)
                    ferry__copy_line_nt(dp + o, s + o);
            }
    }
    if (!fa)
        return;
    const unsigned char *last = i1 + (rows - 1) * tb + run - fa; /* (of head 0) */
    for (uint32_t h = 1; h < t->heads; h++)
        ferry__copy_line_join(e + h * hs - fa, last + (h - 1) * run, fa, i0 + h * run);
    *pe = (xpend){e + t->heads * hs - fa, last + (t->heads - 1) * run, fa};
}

/* tile_retrieve_whole with its constants (1 where it does not apply) */
static int tile_retrieve_whole_any(const xtile *t, xpend *pe)
{
    unsigned fa = (unsigned)(t->eng[0] & 63);
    if (t->run % 64 || fa % 16 || t->np < 1 || t->hs != t->rows * t->ts)
        return 1;
#define TRW(np_, fa_)                                                                             \
    case (np_) * 64 + (fa_):                                                                      \
        if (t->run == 64)                                                                         \
            tile_retrieve_whole(t, pe, np_, 64, fa_);                                             \
        else                                                                                      \
            tile_retrieve_whole(t, pe, np_, t->run, fa_);                                         \
        return 0;
    switch (t->np * 64 + fa) {
        TRW(1, 0) TRW(1, 16) TRW(1, 32) TRW(1, 48)
        TRW(2, 0) TRW(2, 16) TRW(2, 32) TRW(2, 48)
    }
#undef TRW
    return 1;
}
#endif

/* a block of a cache whose heads lie apart (HND, packed K|V) copied whole
 * on the host (see tile_store and tile_retrieve); 1 where its runs go
 * one by one: a short copy (cached stores), short runs, runs that do not
 * fit those whole lines */
static int xtile_run(void *ctx, const xtile *t)
{
#if defined(FERRY__COPY_RUNS_STREAM)
    xctx *x = ctx;
    if (!x->stream || t->run % 16 || t->heads > XTILE_HEADS || t->hs <= t->ts)
        return 1;
    if (x->to_chunk) {
        uint64_t al = t->run | t->tb;
        for (unsigned p = 0; p < t->np; p++)
            al |= (uintptr_t)t->img[p];
        if (al & 63)
            return 1;
#if defined(FERRY__COPY_AVX2)
        if (ferry__copy_avx2()) {
            tile_store_avx2(t);
            return 0;
        }
#endif
        tile_store(t);
        return 0;
    }
    if (t->run < 64 || ((t->eng[0] | t->hs) & 15) || t->ts != t->np * t->run ||
        (t->np > 1 && t->eng[1] != t->eng[0] + t->run))
        return 1;
    if (!tile_retrieve_whole_any(t, &x->pend))
        return 0;
    xpend_flush(&x->pend);
    unsigned fa = (t->run | t->hs) % 64 ? 64 : (unsigned)(t->eng[0] & 63);
    if (t->run == 64) /* (the compiler's own copy for each place in a line) */
        switch (fa) {
        case 0: tile_retrieve(t, 64, 0); break;
        case 16: tile_retrieve(t, 64, 16); break;
        case 32: tile_retrieve(t, 64, 32); break;
        case 48: tile_retrieve(t, 64, 48); break;
        default: tile_retrieve(t, 64, 64); break;
        }
    else
        switch (fa) {
        case 0: tile_retrieve(t, t->run, 0); break;
        case 16: tile_retrieve(t, t->run, 16); break;
        case 32: tile_retrieve(t, t->run, 32); break;
        case 48: tile_retrieve(t, t->run, 48); break;
        default: tile_retrieve(t, t->run, 64); break;
        }
    return 0;
#else
    (void)ctx, (void)t;
    return 1;
#endif
}

/* the end of a block: parts of lines its runs left are written (the
 * next block's runs never continue them, and may overwrite them) */
static void xblock_end(void *ctx)
{
    xctx *x = ctx;
    if (x->stream)
        ferry__copy_lines_flush(&x->lines);
}

/* queue (device) what x gathered; frees it */
static int xflush(xctx *x, ferry_stream *s, int rc, ferry__errbuf *eb)
{
    const ferry_kv_buffer *buf = x->buf;
    int to_chunk = x->to_chunk;
    if (x->stream) {
        xpend_flush(&x->pend);
        ferry__copy_lines_flush(&x->lines);
        ferry__copy_fence();
    }
    if (rc == 0 && buf->mem != FERRY_KV_MEM_HOST) {
        rc = ferry_memcpy_batch_async(s, to_chunk ? FERRY_COPY_DTOH : FERRY_COPY_HTOD, x->c, x->n);
        if (rc < 0)
            rc = ferry__err_set(eb, rc, "kv: %zu device copies %s the engine's buffer: %s", x->n,
                                to_chunk ? "from" : "to", ferry_last_error());
    } else if (rc < 0 && eb) {
        ferry__err_set(eb, rc, "%s", ferry_last_error());
    }
    if (x->c != x->local)
        ferry__free(x->c);
    return rc;
}

/* bytes: what the whole copy moves */
static void xinit(xctx *x, const ferry_kv_buffer *buf, int to_chunk, uint64_t bytes)
{
    x->buf = buf;
    x->to_chunk = to_chunk;
    x->stream = buf->mem == FERRY_KV_MEM_HOST && bytes >= FERRY__COPY_STREAM_MIN;
    /* with one or two heads a line's parts come back to back or one run
     * apart, and the processor joins them itself: the table would only
     * cost (128-byte runs 16 bytes past a line: 0.75x NHD with it, about
     * 0.9x without) */
    x->join = x->stream && buf->layout.num_heads > 2;
    ferry__copy_lines_init(&x->lines);
    x->pend.n = 0;
    x->c = x->local;
    x->n = 0;
    x->cap = sizeof x->local / sizeof x->local[0];
}

int ferry__kv_xfer_layer(const ferry_kv_buffer *buf, uint32_t chunk_tokens,
                         const ferry__kv_lchunk *ch, size_t nch, uint32_t layer, int to_chunk,
                         ferry_stream *s, ferry__errbuf *eb)
{
    xctx x;
    uint64_t bytes = 0;
    for (size_t k = 0; k < nch; k++)
        bytes += (uint64_t)ch[k].ntok * ferry__kv_token_bytes(&buf->layout) * buf->layout.kv;
    xinit(&x, buf, to_chunk, bytes);
    int rc = 0;
    for (size_t k = 0; rc == 0 && k < nch; k++)
        if (ch[k].ntok)
            rc = walk_layers(buf, chunk_tokens, ch[k].tok0, ch[k].ntok, ch[k].img, layer,
                             layer + 1, 1, to_chunk, xrun, xtile_run, xblock_end, &x);
    return xflush(&x, s, rc, eb);
}

int ferry__kv_xfer(const ferry_kv_buffer *buf, uint32_t chunk_tokens, uint64_t tok0,
                   uint32_t ntok, void *chunk, int to_chunk, ferry_stream *s, ferry__errbuf *eb)
{
    xctx x;
    xinit(&x, buf, to_chunk,
          (uint64_t)ntok * ferry__kv_token_bytes(&buf->layout) * buf->layout.kv * buf->layout.num_layers);
    int rc = walk_layers(buf, chunk_tokens, tok0, ntok, chunk, 0, buf->layout.num_layers, 1,
                         to_chunk, xrun, xtile_run, xblock_end, &x);
    return xflush(&x, s, rc, eb);
}
int ferry__kv_xfer_out_range(const ferry_kv_buffer *buf, uint32_t chunk_tokens, uint64_t tok0,
                             const void *chunk, uint64_t a, uint64_t b)
{
    const ferry_kv_layout *l = &buf->layout;
    uint64_t tb = ferry__kv_token_bytes(l), span = (uint64_t)chunk_tokens * tb;
    FERRY__ASSERT(buf->mem == FERRY_KV_MEM_HOST && a % tb == 0 && b % tb == 0 && a <= b);
    xctx x;
    xinit(&x, buf, 0, b - a);
    unsigned char *img = (unsigned char *)(uintptr_t)chunk;
    int rc = 0;
    /* plane by plane (kv-major, then layer: the image's order), the
     * plane's tokens that lie in [a, b) */
    for (uint64_t p = a / span; rc == 0 && a < b; p++) {
        uint64_t t0 = (a - p * span) / tb;
        uint64_t t1 = FERRY__MIN(b - p * span, span) / tb;
        unsigned char *part = img + p * span + t0 * tb;
        if (buf->form == FERRY_KV_CONTIGUOUS)
            rc = xrun(&x, buf->base + (p * buf->capacity_tokens + tok0 + t0) * tb, part,
                      (t1 - t0) * tb);
        else
            rc = walk_paged(buf, &p, &part, 1, tb, tok0 + t0, (uint32_t)(t1 - t0), 0, xrun,
                            xtile_run, xblock_end, &x);
        a = (p + 1) * span;
    }
    return xflush(&x, NULL, rc, NULL);
}

void ferry__kv_count_device_copy(ferry_kv *kv, const ferry_kv_buffer *buf, int calls)
{
    if (buf->mem != FERRY_KV_MEM_DEVICE)
        return;
    atomic_fetch_add_explicit(&kv->device_chunks, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&kv->device_calls, (uint64_t)calls, memory_order_relaxed);
}

ferry__kv_span ferry__kv_span_from(const ferry_kv_layout *l, uint32_t chunk_tokens, size_t i,
                                   uint32_t ntok, uint64_t skip)
{
    ferry__kv_span sp = {(uint64_t)i * chunk_tokens, ntok, 0};
    if (skip <= sp.tok0)
        return sp;
    uint64_t o = FERRY__MIN(skip - sp.tok0, (uint64_t)ntok);
    sp.tok0 += o;
    sp.ntok = (uint32_t)(ntok - o);
    sp.img_off = o * ferry__kv_token_bytes(l);
    return sp;
}
