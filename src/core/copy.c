/*
 * copy.c - large copies into memory that is not read again soon.
 *
 * glibc's memcpy switches to non-temporal stores only above a threshold
 * of hundreds of MiB (240 MiB on the development VM), so a KV chunk's
 * runs (512 KiB each for a Llama-3-8B chunk) are copied with ordinary
 * stores: each destination line is first read from memory (read for
 * ownership), then written back, three memory passes for two. Streaming
 * stores write the lines without reading them: about 1.25x memcpy's rate
 * on that VM for 512 KiB runs into an engine buffer. Used where the
 * destination is an engine's buffer that the engine (or a device's DMA)
 * reads later, never for small copies (below FERRY__COPY_STREAM_MIN the
 * ordinary memcpy, whose destination stays in cache, is the faster).
 */
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__) && !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
#define COPY_STREAM 1 /* (the sanitizers check memcpy's accesses, not the intrinsics') */
#include <emmintrin.h>
#endif

#include "core.h"

void ferry__copy_stream(void *dst, const void *src, size_t n)
{
#if defined(COPY_STREAM)
    if (n < FERRY__COPY_STREAM_MIN) {
        memcpy(dst, src, n);
        return;
    }
    unsigned char *d = dst;
    const unsigned char *s = src;
    size_t head = (16 - ((uintptr_t)d & 15)) & 15;
    memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
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
    memcpy(d, s, n);
    _mm_sfence(); /* the streamed lines are visible before any later store */
#else
    memcpy(dst, src, n);
#endif
}
