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
 *
 * A streaming store writes a cache line to memory when the line's
 * write-combining buffer is full or evicted; a line written only in part
 * is written as a partial line (a read-modify-write in the memory
 * controller), which costs about what a whole line does. Short runs whose
 * destination does not start on a line (a strided cache 16 bytes past a
 * line: a head_dim run of 256 bytes is then 3 whole lines and 2 parts)
 * leave their parts to other runs written much later (the next token of
 * the same head, eight runs on in HND), long after the buffer went: that
 * halved an HND retrieve's rate. ferry__copy_lines_run holds such a run's
 * last part in a small table (ferry__copy_lines) until the run that
 * continues it arrives, then streams the whole line; a part that nothing
 * continues is written as it is (streamed where it is whole 16-byte
 * words, else with ordinary stores) when the table is full or flushed
 * (ferry__copy_lines_flush), the caller's end of a stretch whose runs may
 * continue each other (one block of a paged cache). Where few runs are
 * open at once (2 heads), the processor joins such parts by itself, and
 * the table's work makes the copy slower: 128-byte runs 16 bytes past a
 * line went at about two thirds of plain streaming's rate.
 */
#ifndef FERRY_SRC_CORE_COPY_H
#define FERRY_SRC_CORE_COPY_H

#include <stdint.h>
#include <string.h>
#if defined(__SSE2__) && !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
#define FERRY__COPY_RUNS_STREAM 1 /* (the sanitizers check memcpy's accesses) */
#include <emmintrin.h>
#endif

#if defined(FERRY__COPY_RUNS_STREAM)
/* 64 bytes from s streamed to d (16-byte aligned; a whole line where d is 64-byte aligned) */
static inline __attribute__((always_inline)) void ferry__copy_line_nt(unsigned char *d,
                                                                      const unsigned char *s)
{
    __m128i a = _mm_loadu_si128((const __m128i *)(const void *)s);
    __m128i b = _mm_loadu_si128((const __m128i *)(const void *)(s + 16));
    __m128i c = _mm_loadu_si128((const __m128i *)(const void *)(s + 32));
    __m128i e = _mm_loadu_si128((const __m128i *)(const void *)(s + 48));
    _mm_stream_si128((__m128i *)(void *)d, a);
    _mm_stream_si128((__m128i *)(void *)(d + 16), b);
    _mm_stream_si128((__m128i *)(void *)(d + 32), c);
    _mm_stream_si128((__m128i *)(void *)(d + 48), e);
}
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
    for (; n >= 64; n -= 64, d += 64, s += 64)
        ferry__copy_line_nt(d, s); /* (aligned to 16, as _mm_stream_si128 needs) */
    if (n)
        memcpy(d, s, n);
#else
    memcpy(dst, src, n);
#endif
}

/* partial lines of a stream of runs waiting for the run that continues
 * them (see above); ferry__copy_lines_init before the first run. A held
 * part is its source's address, not a copy: the source stays as it is
 * until the stream is flushed */
#define FERRY__COPY_LINES 16
typedef struct ferry__copy_lines {
    uintptr_t line[FERRY__COPY_LINES];           /* a line's bytes [0, have) */
    const unsigned char *src[FERRY__COPY_LINES]; /* come from here */
    unsigned char have[FERRY__COPY_LINES];
    unsigned n, next; /* held; the next to go when full */
} ferry__copy_lines;

static inline void ferry__copy_lines_init(ferry__copy_lines *w)
{
    w->n = 0;
    w->next = 0;
}

/* a part of a line: streamed where it is whole 16-byte words (the
 * processor may still join it with the rest of its line, and ordinary
 * stores into lines streamed around them cost more), else memcpy */
static inline void ferry__copy_part(unsigned char *d, const unsigned char *s, size_t n)
{
#if defined(FERRY__COPY_RUNS_STREAM)
    if (!(((uintptr_t)d | n) & 15)) {
        for (size_t o = 0; o < n; o += 16)
            _mm_stream_si128((__m128i *)(void *)(d + o),
                             _mm_loadu_si128((const __m128i *)(const void *)(s + o)));
        return;
    }
#endif
    memcpy(d, s, n);
}

/* n bytes (a multiple of 16) to 16-byte aligned d in streamed 16-byte
 * words, for runs whose lines are written whole one after another (a
 * strided store's runs into an image's lines) */
#if defined(FERRY__COPY_RUNS_STREAM)
static inline __attribute__((always_inline)) void ferry__copy_words_nt(unsigned char *d,
                                                                       const unsigned char *s,
                                                                       size_t n)
{
    for (size_t o = 0; o < n; o += 16)
        _mm_stream_si128((__m128i *)(void *)(d + o),
                         _mm_loadu_si128((const __m128i *)(const void *)(s + o)));
}
#endif

/* where the processor has AVX2 (ferry__copy_avx2(), asked at run time:
 * the build assumes no more than SSE2) the same in 32-byte words, d
 * 32-byte aligned, n a multiple of 32: a copy whose destination lines
 * lie apart (a strided store's image rows) measured 1.1-1.2x the 16-byte
 * words' rate; callers are themselves compiled for AVX2 */
#if defined(FERRY__COPY_RUNS_STREAM) && defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define FERRY__COPY_AVX2 1
#include <immintrin.h>
static inline __attribute__((always_inline, target("avx2"))) void
ferry__copy_words_nt32(unsigned char *d, const unsigned char *s, size_t n)
{
    for (size_t o = 0; o < n; o += 32)
        _mm256_stream_si256((__m256i *)(void *)(d + o),
                            _mm256_loadu_si256((const __m256i *)(const void *)(s + o)));
}
#endif

/* (tests: set, the 16-byte words where the processor has AVX2 too) */
extern int ferry__copy_narrow;

#if defined(FERRY__COPY_AVX2)
static inline int ferry__copy_avx2(void)
{
    return !ferry__copy_narrow && __builtin_cpu_supports("avx2");
}
#endif

/* write what w holds (each part is its run's own bytes) and empty it */
static inline void ferry__copy_lines_flush(ferry__copy_lines *w)
{
    for (unsigned i = 0; i < w->n; i++)
        ferry__copy_part((unsigned char *)w->line[i], w->src[i], w->have[i]);
    w->n = 0;
    w->next = 0;
}

#if defined(FERRY__COPY_RUNS_STREAM)
/* the line at 64-byte aligned d made of held's bytes [0, a) and s's
 * [a, 64) (0 < a < 64), streamed whole (inlined: where the caller's a is a constant,
 * the join is four loads and four stores) */
static inline __attribute__((always_inline)) void
ferry__copy_line_join(unsigned char *d, const unsigned char *held, unsigned a,
                      const unsigned char *s)
{
    if (!(a & 15)) { /* (16-byte parts: streamed straight from where they are, the
                      * words written out: a loop, which the compiler kept, cost
                      * a branch a word) */
        const unsigned char *f1 = a > 16 ? held + 16 : s + 16 - a;
        const unsigned char *f2 = a > 32 ? held + 32 : s + 32 - a;
        const unsigned char *f3 = a > 48 ? held + 48 : s + 48 - a;
        __m128i w0 = _mm_loadu_si128((const __m128i *)(const void *)held);
        __m128i w1 = _mm_loadu_si128((const __m128i *)(const void *)f1);
        __m128i w2 = _mm_loadu_si128((const __m128i *)(const void *)f2);
        __m128i w3 = _mm_loadu_si128((const __m128i *)(const void *)f3);
        _mm_stream_si128((__m128i *)(void *)d, w0);
        _mm_stream_si128((__m128i *)(void *)(d + 16), w1);
        _mm_stream_si128((__m128i *)(void *)(d + 32), w2);
        _mm_stream_si128((__m128i *)(void *)(d + 48), w3);
        return;
    }
    unsigned char line[64];
    memcpy(line, held, a);
    memcpy(line + a, s, 64 - a);
    ferry__copy_line_nt(d, line);
}
#endif

/* ferry__copy_stream_run of one run of a stream whose runs may continue
 * each other: whole lines streamed, a first part that continues a held
 * one completes it, a last part held. The runs between two flushes must
 * not overlap (a later run's bytes could land before an earlier held
 * part's), and their sources must stay as they are until the flush */
static inline __attribute__((always_inline)) void ferry__copy_lines_run(ferry__copy_lines *w, void *dst, const void *src,
                                         size_t n)
{
#if defined(FERRY__COPY_RUNS_STREAM)
    unsigned char *d = dst;
    const unsigned char *s = src;
    unsigned a = (unsigned)((uintptr_t)d & 63);
    if (a) {
        uintptr_t line = (uintptr_t)d - a;
        size_t k = 64 - a < n ? 64 - a : n;
        unsigned i = 0;
        while (i < w->n && (w->line[i] != line || w->have[i] != a))
            i++;
        if (i == w->n || a + k < 64) {
            ferry__copy_part(d, s, k); /* completes nothing held */
        } else { /* whole: streamed, its slot given to the last */
            ferry__copy_line_join((unsigned char *)line, w->src[i], a, s);
            w->n--;
            w->line[i] = w->line[w->n];
            w->src[i] = w->src[w->n];
            w->have[i] = w->have[w->n];
            if (w->next >= w->n)
                w->next = 0;
        }
        d += k;
        s += k;
        n -= k;
    }
    for (; n >= 64; n -= 64, d += 64, s += 64)
        ferry__copy_line_nt(d, s);
    if (n) {
        unsigned i = w->n;
        if (i < FERRY__COPY_LINES) {
            w->n++;
        } else { /* full: the oldest slot's part goes as it is */
            i = w->next;
            w->next = (w->next + 1) % FERRY__COPY_LINES;
            ferry__copy_part((unsigned char *)w->line[i], w->src[i], w->have[i]);
        }
        w->line[i] = (uintptr_t)d;
        w->src[i] = s;
        w->have[i] = (unsigned char)n;
    }
#else
    (void)w;
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
