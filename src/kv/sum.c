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
