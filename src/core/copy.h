/*
 * copy.h - the runs of a large copy made of many short ones (a strided KV
 * cache's head_dim runs of a few cache lines each), inlined where they are
 * walked (private).
 *
 * Each run is written with streaming stores whatever its size (copy.c
 * says why streaming pays for an engine's buffer); a call per run and a
 * fence per run would cost more than the run itself, so there is neither:
 * the walker ends the whole copy with ferry__copy_fence() before anything
 * reads the destination or hands it on.
 */
#ifndef FERRY_SRC_CORE_COPY_H
#define FERRY_SRC_CORE_COPY_H

#include <stdint.h>
#include <string.h>
#if defined(__SSE2__) && !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
#define FERRY__COPY_RUNS_STREAM 1 /* (the sanitizers check memcpy's accesses) */
#include <emmintrin.h>
#endif

static inline void ferry__copy_stream_run(void *dst, const void *src, size_t n)
{
#if defined(FERRY__COPY_RUNS_STREAM)
    unsigned char *d = dst;
    const unsigned char *s = src;
    if (n < 64 || ((uintptr_t)d & 15)) { /* short or unaligned: cached stores */
        memcpy(d, s, n);
        return;
    }
    for (; n >= 64; n -= 64, d += 64, s += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(const void *)s);
        __m128i b = _mm_loadu_si128((const __m128i *)(const void *)(s + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(const void *)(s + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(const void *)(s + 48));
        _mm_stream_si128((__m128i *)(void *)d, a);
        _mm_stream_si128((__m128i *)(void *)(d + 16), b);
        _mm_stream_si128((__m128i *)(void *)(d + 32), c);
        _mm_stream_si128((__m128i *)(void *)(d + 48), e);
    }
    if (n)
        memcpy(d, s, n);
#else
    memcpy(dst, src, n);
#endif
}

/* the streamed lines are visible before any later store */
static inline void ferry__copy_fence(void)
{
#if defined(FERRY__COPY_RUNS_STREAM)
    _mm_sfence();
#endif
}

#endif
