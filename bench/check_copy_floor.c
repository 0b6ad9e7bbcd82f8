/*
 * check_copy_floor.c - the floor under a copying retrieve's CPU: ferry's
 * own fused check and copy (ferry__kv_piece_out, what a retrieve runs on
 * each 2 MiB piece of a chunk that lands) over Llama-3-8B chunk images
 * (32 MiB: 256 tokens x 32 layers x K/V x 8 heads x 128 x bf16) read from
 * FILE with O_DIRECT into huge pages, copied into an engine buffer of
 * plain malloc memory touched once (as `ferry kv bench --cold` retrieves
 * into). Thread CPU seconds per GB of each part alone and of the two
 * fused, nothing else: no reads in flight, no queues, no wake-ups.
 *
 *   check_copy_floor FILE [GIB] [ROUNDS]      (defaults 1 and 3)
 *
 * FILE: at least GIB GiB; the slab a cold retrieve reads gives the very
 * bytes. bench/check_copy_floor.sh runs this alone and with fio reading
 * the drive beside it, as the drive does during a retrieve, next to the
 * retrieve's own CPU per GB.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "ferry.h"
#include "kv/kv_impl.h"

#define CT 256u
#define PIECE ((uint64_t)2 << 20)

static double thread_cpu_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* what: 0 hash alone, 1 copy alone, 2 fused; the thread's CPU s/GB */
static double pass(const ferry_kv_buffer *b, const unsigned char *pool, uint64_t nch,
                   uint64_t chunk, int what, uint64_t *sink)
{
    double c0 = thread_cpu_s();
    for (uint64_t i = 0; i < nch; i++) {
        const unsigned char *img = pool + i * chunk;
        for (uint64_t a = 0; a < chunk; a += PIECE) {
            uint64_t z = a + PIECE < chunk ? a + PIECE : chunk, sum = 0;
            double hs;
            if (what == 1)
                ferry__kv_xfer_out_range(b, CT, i * CT, img, a, z);
            else
                ferry__kv_piece_out(b, CT, i * CT, img, a, z, what == 2 ? a : 0,
                                    what == 2 ? z : 0, &sum, &hs);
            *sink += sum;
        }
    }
    return (thread_cpu_s() - c0) / ((double)nch * (double)chunk / 1e9);
}

int main(int argc, char **argv)
{
    if (argc < 2 || argc > 4) {
        fprintf(stderr, "usage: check_copy_floor FILE [GIB] [ROUNDS]\n");
        return 2;
    }
    long gib = argc > 2 ? strtol(argv[2], NULL, 10) : 1;
    long rounds = argc > 3 ? strtol(argv[3], NULL, 10) : 3;
    if (gib < 1 || gib > 64 || rounds < 1 || rounds > 100) {
        fprintf(stderr, "check_copy_floor: GIB 1..64, ROUNDS 1..100\n");
        return 2;
    }
    ferry_kv_layout l = FERRY_KV_LAYOUT_INIT;
    uint64_t chunk = 0;
    if (ferry_kv_layout_chunk_bytes(&l, CT, &chunk) < 0)
        return 1;
    uint64_t bytes = (uint64_t)gib << 30, nch = bytes / chunk;
    int fd = open(argv[1], O_RDONLY | O_DIRECT);
    if (fd < 0) {
        fprintf(stderr, "check_copy_floor: %s: %s\n", argv[1], strerror(errno));
        return 1;
    }
    /* the chunk images in huge pages, as an L1 pool is */
    unsigned char *pool = mmap(NULL, bytes, PROT_READ | PROT_WRITE,
                               MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB, -1, 0);
    if (pool == MAP_FAILED) {
        pool = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (pool == MAP_FAILED) {
            fprintf(stderr, "check_copy_floor: %llu bytes for the chunk images: %s\n",
                    (unsigned long long)bytes, strerror(errno));
            return 1;
        }
        madvise(pool, bytes, MADV_HUGEPAGE);
    }
    /* the engine's buffer: malloc, touched once */
    unsigned char *eng = malloc(bytes);
    if (!eng) {
        fprintf(stderr, "check_copy_floor: %llu bytes for the engine buffer: out of memory\n",
                (unsigned long long)bytes);
        return 1;
    }
    memset(eng, 1, bytes);
    ferry_kv_buffer b = FERRY_KV_BUFFER_INIT;
    b.layout = l;
    b.base = (uint64_t)(uintptr_t)eng;
    b.capacity_tokens = nch * CT;
    uint64_t sink = 0;
    printf("chunks of %llu MiB, %llu of them, into malloc memory; thread CPU s/GB\n",
           (unsigned long long)(chunk >> 20), (unsigned long long)nch);
    for (long r = 0; r < rounds; r++) {
        double s[3];
        for (int what = 0; what < 3; what++) {
            /* bytes fresh from the drive each time (no cache holds 1 GiB) */
            for (uint64_t off = 0; off < nch * chunk; off += 4u << 20)
                if (pread(fd, pool + off, 4u << 20, (off_t)off) != (ssize_t)(4u << 20)) {
                    fprintf(stderr, "check_copy_floor: %s: a short read at %llu\n", argv[1],
                            (unsigned long long)off);
                    return 1;
                }
            s[what] = pass(&b, pool, nch, chunk, what, &sink);
        }
        printf("round %ld: check and copy fused %.4f (check alone %.4f, copy alone %.4f)\n",
               r + 1, s[2], s[0], s[1]);
    }
    fprintf(stderr, "(%llx)\n", (unsigned long long)sink);
    close(fd);
    return 0;
}
