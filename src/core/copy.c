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

#include "copy.h"
#include "core.h"

int ferry__copy_narrow;

void ferry__copy_stream(void *dst, const void *src, size_t n)
{
#if defined(FERRY__COPY_RUNS_STREAM)
    if (n < FERRY__COPY_STREAM_MIN) {
        memcpy(dst, src, n);
        return;
    }
    unsigned char *d = dst;
    const unsigned char *s = src;
    size_t head = (16 - ((uintptr_t)d & 15)) & 15;
    memcpy(d, s, head);
    ferry__copy_stream_run(d + head, s + head, n - head);
    ferry__copy_fence();
#else
    memcpy(dst, src, n);
#endif
}
