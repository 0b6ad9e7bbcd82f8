/*
 * sum.c - the checksums that keep L2 reads honest.
 *
 * Every chunk the non-persistent L2 writes is checksummed (XXH3-64 of its
 * image) and every read is checked against it before the bytes count as a
 * hit, so a torn, stale or foreign chunk is a miss, never data. The check
 * sits on the retrieve's copy-out, so it must cost little next to the
 * copy: the shared library's dispatching entry points run XXH3 on AVX2
 * where the CPU has it (about 25-30 GB/s here against 11 for the SSE2
 * build), and a whole-chunk copy into a host buffer hashes each 64 KiB
 * block just before it copies it, so the image is read from memory once.
 */
#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>
#include <xxh_x86dispatch.h>

#include <string.h>

#include "kv/kv_impl.h"

#define SUM_BLOCK ((uint64_t)64 << 10)
#define PIECE_BLOCK ((uint64_t)256 << 10)

uint64_t ferry__kv_sum(const void *p, size_t n)
{
    return XXH3_64bits_dispatch(p, n);
}

typedef struct sctx {
    XXH3_state_t st;
} sctx;

static int sum_run(void *ctx, uint64_t addr, unsigned char *img, uint64_t len)
{
    sctx *c = ctx;
    unsigned char *dst = (unsigned char *)(uintptr_t)addr;
    for (uint64_t off = 0; off < len; off += SUM_BLOCK) {
        size_t k = (size_t)FERRY__MIN(SUM_BLOCK, len - off);
        XXH3_64bits_update_dispatch(&c->st, img + off, k);
        ferry__copy_stream(dst + off, img + off, k); /* (the block is in cache now) */
    }
    return 0;
}

static int zero_run(void *ctx, uint64_t addr, unsigned char *img, uint64_t len)
{
    (void)ctx;
    (void)img;
    memset((void *)(uintptr_t)addr, 0, len);
    return 0;
}

void ferry__kv_piece_out(const ferry_kv_buffer *buf, uint32_t chunk_tokens, uint64_t tok0,
                         const void *chunk, uint64_t c0, uint64_t c1, uint64_t o0, uint64_t o1,
                         uint64_t *sum, double *hash_share)
{
    const unsigned char *img = chunk;
    *hash_share = 1;
    if (o0 == o1) {
        *sum = XXH3_64bits_dispatch(img + c0, (size_t)(c1 - c0));
        return;
    }
    uint64_t th = 0, tc = 0; /* wall ns hashing, copying (the clock is cheap, a CPU clock not) */
    uint64_t tb = ferry__kv_token_bytes(&buf->layout);
    /* blocks of whole tokens, about PIECE_BLOCK bytes (each still in the
     * core's cache when it is copied, and long enough to be streamed) */
    uint64_t step = PIECE_BLOCK > tb ? PIECE_BLOCK - PIECE_BLOCK % tb : tb;
    XXH3_state_t st;
    XXH3_64bits_reset(&st);
    uint64_t h = c0;
    while (h < c1 || o0 < o1) {
        uint64_t hn = FERRY__MIN(c1, h + step), t0 = ferry__now_ns();
        if (hn > h)
            XXH3_64bits_update_dispatch(&st, img + h, (size_t)(hn - h));
        h = hn;
        /* the tokens hashed so far (all of the rest once the hash is done) */
        uint64_t on = h >= c1 ? o1 : FERRY__MIN(o1, h - h % tb), t1 = ferry__now_ns();
        if (on > o0)
            ferry__kv_xfer_out_range(buf, chunk_tokens, tok0, chunk, o0, on);
        o0 = FERRY__MAX(o0, on);
        th += t1 - t0;
        tc += ferry__now_ns() - t1;
    }
    *sum = XXH3_64bits_digest(&st);
    *hash_share = th + tc ? (double)th / (double)(th + tc) : 0;
}

uint64_t ferry__kv_sum_runs(const ferry__kv_run *runs, size_t n, uint64_t a, uint64_t b)
{
    size_t lo = 0, hi = n; /* the first run that ends past a */
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (runs[mid].img + runs[mid].len <= a)
            lo = mid + 1;
        else
            hi = mid;
    }
    XXH3_state_t st;
    XXH3_64bits_reset(&st);
    for (size_t k = lo; k < n && a < b; k++) {
        uint64_t skip = a - runs[k].img, len = FERRY__MIN(runs[k].len - skip, b - a);
        XXH3_64bits_update_dispatch(&st, (const unsigned char *)(uintptr_t)runs[k].addr + skip,
                                    (size_t)len);
        a += len;
    }
    return XXH3_64bits_digest(&st);
}

void ferry__kv_xfer_out_zero(const ferry_kv_buffer *buf, uint32_t chunk_tokens, uint64_t tok0,
                             uint32_t ntok)
{
    ferry__kv_xfer_walk(buf, chunk_tokens, tok0, ntok, NULL, zero_run, NULL);
}

int ferry__kv_xfer_out_sum(const ferry_kv_buffer *buf, uint32_t chunk_tokens, uint64_t tok0,
                           const void *chunk, uint64_t *sum)
{
    sctx c;
    XXH3_64bits_reset(&c.st);
    int rc = ferry__kv_xfer_walk(buf, chunk_tokens, tok0, chunk_tokens, (void *)(uintptr_t)chunk,
                                 sum_run, &c);
    if (rc == 0)
        *sum = XXH3_64bits_digest(&c.st);
    return rc;
}
