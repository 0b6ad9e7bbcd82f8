/*
 * test_kv_direct.c - retrieves that read a persistent L2's chunks straight
 * into a page-aligned host buffer (src/kv/store/store_rdirect.c), and the
 * vectored reads under them (FERRY_IO_READV, src/io/io.c): exact bytes
 * into contiguous and paged buffers, a bad piece or a torn read zeroing
 * its chunk, cancels at several moments leaving each chunk exact or
 * zeroed or untouched and nothing written after they return, and the L1
 * path kept for misaligned buffers and (by default) for buffers in 4 KiB
 * pages; old-format slabs read directly too; a block shared by two chunks
 * keeping every chunk off the direct path; two retrieves of one prefix at
 * once, direct and through L1; retrieves racing deletes and re-stores of
 * their chunks; the store closed under an in-flight direct retrieve.
 */
/* ferry-test-labels: concurrent */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "ferry_test.h"
#include "ferry/io.h"
#include "ferry/kv.h"
#include "io/sys.h"
#include "kv/kv_impl.h"
#include "pslab/pslab_impl.h"

/* 80 layers x 8 heads x 128 f16: a chunk of 16 tokens is 160 planes of 32
 * KiB, 5 MiB, so three pieces of 2 MiB (the last one short); 4 chunks */
enum { TB = 2048, PLANES = 160, CT = 16, CH = 4, N = CH * CT, CHUNK = PLANES * CT * TB,
       PIECE = 2 << 20, BT = 4, NBLK = N / BT };

typedef struct fix {
    char d[256];
    ferry_kv_config c;
    int32_t tok[N];
    uint8_t *mem;   /* what was stored: [plane][token][TB] */
    uint8_t *got;   /* a page-aligned buffer of the same shape */
    size_t bytes;
} fix;

/* the prompt stored into a persistent L2 of format `format` (0: the
 * current one), synced, the store closed */
static void stored(fix *f, unsigned format)
{
    ft_tmpdir(f->d, sizeof f->d);
    ferry_kv_config c = FERRY_KV_CONFIG_INIT;
    c.model = "direct";
    c.layout.num_layers = PLANES / 2;
    c.layout.num_heads = 8;
    c.layout.head_dim = 128;
    c.chunk_tokens = CT;
    c.l1_bytes = 2 * (uint64_t)CHUNK;
    c.l2_dir = f->d;
    c.l2_bytes = 8 * (uint64_t)CHUNK;
    c.l2_engine = "posix";
    c.l2_persistent = 1;
    c.workers = 2;
    f->c = c;
    f->bytes = (size_t)PLANES * N * TB;
    f->mem = malloc(f->bytes);
    assert_non_null(f->mem);
    assert_int_equal(posix_memalign((void **)&f->got, 4096, f->bytes + 4096), 0);
    for (size_t t = 0; t < N; t++)
        f->tok[t] = (int32_t)(77 * 100003u + (unsigned)t * 7u + 1u);
    /* (no period: a chunk's first token is found in the slab file by its bytes) */
    ft_fill_mixed(f->mem, f->bytes, 770);
    atomic_store(&ferry__pslab_test_format, format);
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&f->c, &kv));
    ferry_kv_buffer src = FERRY_KV_BUFFER_INIT;
    src.layout = f->c.layout;
    src.base = (uint64_t)(uintptr_t)f->mem;
    src.capacity_tokens = N;
    assert_int_equal(ferry_kv_store(kv, f->tok, N, NULL, &src), N);
    FT_ASSERT_OK(ferry_kv_flush(kv));
    assert_int_equal(ferry_kv_sync(kv), CH);
    ferry_kv_close(kv);
    atomic_store(&ferry__pslab_test_format, 0);
}

static void fix_free(fix *f)
{
    free(f->mem);
    free(f->got);
    ft_rmtree(f->d);
}

/* the slab file offset of chunk k's image (plane 0's first token) */
static off_t image_at(const fix *f, unsigned k)
{
    char path[400];
    snprintf(path, sizeof path, "%s/%s", f->d, FERRY_PSLAB_FILE);
    int fd = open(path, O_RDONLY);
    assert_true(fd >= 0);
    uint8_t blk[TB];
    const uint8_t *want = f->mem + (size_t)k * CT * TB;
    off_t at = -1;
    for (off_t o = 0; at < 0 && pread(fd, blk, TB, o) == TB; o += 4096)
        if (!memcmp(blk, want, TB))
            at = o;
    close(fd);
    assert_true(at >= 0);
    return at;
}

/* flip the byte at image offset off of chunk k on disk */
static void damage(const fix *f, unsigned k, off_t off)
{
    char path[400];
    snprintf(path, sizeof path, "%s/%s", f->d, FERRY_PSLAB_FILE);
    off_t at = image_at(f, k) + off;
    int fd = open(path, O_RDWR);
    assert_true(fd >= 0);
    uint8_t b;
    assert_int_equal(pread(fd, &b, 1, at), 1);
    b ^= 0x40;
    assert_int_equal(pwrite(fd, &b, 1, at), 1);
    assert_int_equal(fsync(fd), 0);
    close(fd);
}

/* ---- the engine buffers: contiguous at base, or paged ---- */

typedef struct dst {
    ferry_kv_buffer b;
    uint64_t bases[PLANES];
    int32_t table[NBLK];
} dst;

/* contiguous, at got + shift */
static void dst_contig(dst *d, const fix *f, size_t shift)
{
    d->b = (ferry_kv_buffer)FERRY_KV_BUFFER_INIT;
    d->b.layout = f->c.layout;
    d->b.base = (uint64_t)(uintptr_t)(f->got + shift);
    d->b.capacity_tokens = N;
}

/* paged: blocks of BT tokens (8 KiB), each plane's NBLK blocks at got +
 * plane * NBLK blocks, the table reversed (no two blocks of a chunk back
 * to back) */
static void dst_paged(dst *d, const fix *f)
{
    d->b = (ferry_kv_buffer)FERRY_KV_BUFFER_INIT;
    d->b.layout = f->c.layout;
    d->b.form = FERRY_KV_PAGED;
    for (unsigned p = 0; p < PLANES; p++)
        d->bases[p] = (uint64_t)(uintptr_t)(f->got + (size_t)p * NBLK * BT * TB);
    for (unsigned k = 0; k < NBLK; k++)
        d->table[k] = (int32_t)(NBLK - 1 - k);
    d->b.block_bases = d->bases;
    d->b.block_tokens = BT;
    d->b.num_blocks = NBLK;
    d->b.block_table = d->table;
    d->b.table_len = NBLK;
}

/* where token t of plane p lies in d's memory */
static const uint8_t *tok_at(const dst *d, unsigned p, unsigned t)
{
    if (d->b.form == FERRY_KV_CONTIGUOUS)
        return (const uint8_t *)(uintptr_t)d->b.base + ((size_t)p * N + t) * TB;
    return (const uint8_t *)(uintptr_t)d->bases[p] + ((size_t)d->table[t / BT] * BT + t % BT) * TB;
}

enum { EXACT, ZEROED, UNTOUCHED, UNTOUCHED_OR_ZEROED };

/* chunk k in d holds what `want` says (untouched: the 0xEE fill) */
static void chunk_is(const fix *f, const dst *d, unsigned k, int want)
{
    int seen = -1;
    for (unsigned p = 0; p < PLANES; p++)
        for (unsigned t = k * CT; t < (k + 1) * CT; t++) {
            const uint8_t *g = tok_at(d, p, t);
            if (want == EXACT) {
                assert_memory_equal(g, f->mem + ((size_t)p * N + t) * TB, TB);
                continue;
            }
            for (size_t x = 0; x < TB; x++) {
                int v = g[x];
                if (seen < 0)
                    seen = v;
                assert_int_equal(v, seen);
            }
        }
    if (want == ZEROED)
        assert_int_equal(seen, 0);
    if (want == UNTOUCHED)
        assert_int_equal(seen, 0xEE);
    if (want == UNTOUCHED_OR_ZEROED)
        assert_true(seen == 0 || seen == 0xEE);
}

/* a cold retrieve (store reopened, L1 empty) into d filled with 0xEE:
 * its result, statuses and counters */
static int cold(fix *f, const dst *d, int *st, ferry_kv_stats *m)
{
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&f->c, &kv));
    memset(f->got, 0xEE, f->bytes + 4096);
    ferry_kv_req r = FERRY_KV_REQ_INIT;
    r.status = st;
    r.max_chunks = CH;
    int rc = ferry_kv_retrieve(kv, f->tok, N, &r, &d->b);
    FT_ASSERT_OK(ferry_kv_flush(kv));
    *m = (ferry_kv_stats)FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(kv, m));
    ferry_kv_close(kv);
    return rc;
}

/* ---- vectored reads ---- */

static void readv_on(const char *engine)
{
    char d[256], path[300];
    ft_tmpdir(d, sizeof d);
    snprintf(path, sizeof path, "%s/f", d);
    enum { FB = 64 << 10 };
    uint8_t *src = malloc(FB), *buf = NULL;
    assert_int_equal(posix_memalign((void **)&buf, 4096, 4 * FB), 0);
    ft_fill_pattern(src, FB, 9);
    int fd = open(path, O_CREAT | O_WRONLY, 0600);
    assert_int_equal(pwrite(fd, src, FB, 0), FB);
    close(fd);
    ferry_io_options o = FERRY_IO_OPTIONS_INIT;
    o.engine = engine;
    ferry_io *io = NULL;
    if (ferry_io_open(&o, &io) < 0) {
        print_message("engine %s: not here (%s)\n", engine, ferry_last_error());
        free(src);
        free(buf);
        ft_rmtree(d);
        return;
    }
    ferry_file *f = NULL;
    FT_ASSERT_OK(ferry_file_open(io, path, FERRY_FILE_READ | FERRY_FILE_DIRECT, &f));
    memset(buf, 0xEE, 4 * FB);
    /* 8 KiB at +3 pieces, 4 KiB at +0, the rest at +1 piece: file order */
    struct iovec iov[3] = {{buf + 3 * FB, 8192}, {buf, 4096}, {buf + FB, FB - 12288}};
    ferry_io_vreq v = {{0}, iov, 3};
    v.req.op = FERRY_IO_READV;
    v.req.file = f;
    v.req.len = FB;
    v.req.offset = 0;
    ferry_io_req *q = &v.req, *done = NULL;
    assert_int_equal(ferry_io_submit(io, &q, 1), 1);
    assert_int_equal(ferry_io_reap(io, &done, 1, 1, -1), 1);
    assert_ptr_equal(done, &v.req);
    assert_int_equal(v.req.result, FB);
    assert_memory_equal(buf + 3 * FB, src, 8192);
    assert_memory_equal(buf, src + 8192, 4096);
    assert_memory_equal(buf + FB, src + 12288, FB - 12288);
    assert_int_equal(buf[3 * FB + 8192], 0xEE);
    /* lengths that do not add up, too many pieces: refused before any I/O */
    v.req.len = FB - 4096;
    assert_int_equal(ferry_io_submit(io, &q, 1), -EINVAL);
    v.req.len = FB;
    v.niov = FERRY_IO_IOV_MAX + 1;
    assert_int_equal(ferry_io_submit(io, &q, 1), -EINVAL);
    v.niov = 3;
    v.iov = NULL; /* no pieces, an empty one, one whose length wraps the sum */
    assert_int_equal(ferry_io_submit(io, &q, 1), -EINVAL);
    v.iov = iov;
    v.niov = 0;
    assert_int_equal(ferry_io_submit(io, &q, 1), -EINVAL);
    v.niov = 3;
    size_t len0 = iov[0].iov_len;
    iov[0].iov_len = 0;
    assert_int_equal(ferry_io_submit(io, &q, 1), -EINVAL);
    struct iovec wrap[2] = {{buf, (size_t)1 << 63}, {buf + FB, ((size_t)1 << 63) + FB}};
    ferry_io_vreq w = {{0}, wrap, 2};
    w.req = v.req;
    ferry_io_req *wq = &w.req;
    assert_int_equal(ferry_io_submit(io, &wq, 1), -EINVAL);
    iov[0].iov_len = len0;
    if (ferry_file_is_direct(f)) { /* a piece off 4096 on O_DIRECT */
        iov[1].iov_base = buf + 64;
        assert_int_equal(ferry_io_submit(io, &q, 1), FERRY_EALIGN);
        iov[1].iov_base = buf;
    }
    /* past the end of the file: short, not continued */
    v.req.offset = 4096;
    assert_int_equal(ferry_io_submit(io, &q, 1), 1);
    assert_int_equal(ferry_io_reap(io, &done, 1, 1, -1), 1);
    assert_int_equal(v.req.result, FERRY_ESHORT);
    ferry_file_close(f);
    ferry_io_close(io);
    free(src);
    free(buf);
    ft_rmtree(d);
}

static void test_readv_lands_in_its_pieces(void **state)
{
    (void)state;
    readv_on("posix");
    readv_on("uring");
}

/* ---- retrieves ---- */

/* a page-aligned buffer, contiguous and paged: every chunk exact, read
 * straight into it (none promoted into L1, nothing copied out) */
static void test_direct_reads_are_exact(void **state)
{
    (void)state;
    fix f;
    stored(&f, 0);
    dst d;
    int st[CH];
    ferry_kv_stats m;
    for (int paged = 0; paged < 2; paged++) {
        if (paged)
            dst_paged(&d, &f);
        else
            dst_contig(&d, &f, 0);
        assert_int_equal(cold(&f, &d, st, &m), N);
        for (unsigned k = 0; k < CH; k++) {
            assert_int_equal(st[k], 0);
            chunk_is(&f, &d, k, EXACT);
        }
        assert_int_equal(m.tier[FERRY_KV_TIER_L1].chunks, 0);
        assert_int_equal(m.tier[FERRY_KV_TIER_L1].bytes_read, 0); /* (not out of L1) */
        assert_int_equal(m.tier[FERRY_KV_TIER_L2].hits, CH);
        assert_int_equal(m.retrieved_bytes, (uint64_t)CH * CHUNK);
        assert_int_equal(m.retrieve_copy_us, 0);
        assert_int_equal(m.corrupt_chunks, 0);
        if (!paged) /* tokens past the prompt's chunks: never touched */
            assert_int_equal(f.got[f.bytes], 0xEE);
    }
    fix_free(&f);
}

/* a bad byte inside a piece, at a piece's edge or at the chunk's end: that
 * chunk is a miss whose tokens are zeroed (its bytes did land), the other
 * chunks exact */
static void test_direct_bad_piece_is_a_zeroed_miss(void **state)
{
    (void)state;
    const off_t bad[] = {PIECE + 100, 2 * PIECE - 1, 2 * PIECE, CHUNK - 1};
    for (size_t c = 0; c < sizeof bad / sizeof bad[0]; c++) {
        fix f;
        stored(&f, 0);
        damage(&f, 2, bad[c]);
        dst d;
        if (c % 2)
            dst_paged(&d, &f);
        else
            dst_contig(&d, &f, 0);
        int st[CH];
        ferry_kv_stats m;
        assert_int_equal(cold(&f, &d, st, &m), 2 * CT);
        for (unsigned k = 0; k < CH; k++) {
            assert_int_equal(st[k], k == 2 ? FERRY_ECORRUPT : 0);
            chunk_is(&f, &d, k, k == 2 ? ZEROED : EXACT);
        }
        assert_int_equal(m.corrupt_chunks, 1);
        assert_int_equal(m.tier[FERRY_KV_TIER_L1].chunks, 0);
        fix_free(&f);
    }
}

/* the io seam: a vectored read at file offset torn_at comes back short
 * (its bytes read, a part of them reported), or every read is slowed */
static atomic_llong torn_at = -1;
static atomic_int slow_us;
static atomic_int tears;
static atomic_llong late_at = -1; /* a read there reports its landing 30 ms late */

static ssize_t seam_preadv(int fd, const struct iovec *iov, int n, off_t off)
{
    if (atomic_load(&slow_us))
        usleep((useconds_t)atomic_load(&slow_us));
    ssize_t r = ferry__sys_default()->preadv(fd, iov, n, off);
    if (off == (off_t)atomic_load(&late_at))
        usleep(30000);
    if (r > 4096 && off == (off_t)atomic_load(&torn_at)) {
        atomic_fetch_add(&tears, 1);
        return 4096;
    }
    return r;
}

static ferry__sys seam_sys;

static void seam_on(void)
{
    seam_sys = *ferry__sys_default();
    seam_sys.preadv = seam_preadv;
    ferry__sys_set(&seam_sys);
}

/* a read torn inside chunk 1's second piece: chunk 1 a zeroed miss, the
 * rest exact, the L2 copy not blamed for damage */
static void test_direct_torn_read_is_a_zeroed_miss(void **state)
{
    (void)state;
    fix f;
    stored(&f, 0);
    atomic_store(&torn_at, (long long)(image_at(&f, 1) + PIECE));
    atomic_store(&tears, 0);
    seam_on();
    dst d;
    dst_contig(&d, &f, 0);
    int st[CH];
    ferry_kv_stats m;
    int rc = cold(&f, &d, st, &m);
    ferry__sys_set(NULL);
    atomic_store(&torn_at, -1);
    assert_int_equal(atomic_load(&tears), 1);
    assert_int_equal(rc, CT);
    for (unsigned k = 0; k < CH; k++) {
        assert_int_equal(st[k] == 0, k != 1);
        chunk_is(&f, &d, k, k == 1 ? ZEROED : EXACT);
    }
    assert_int_equal(m.corrupt_chunks, 0);
    fix_free(&f);
}

/* the third chunk's read fails at the store's fault seam, before any
 * read of it starts: a miss whose tokens are untouched, the rest exact */
static void test_direct_read_never_started_leaves_untouched(void **state)
{
    (void)state;
    fix f;
    stored(&f, 0);
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&f.c, &kv));
    ferry__kv_set_tier_fault(kv, FERRY_KV_TIER_L2, 0, 3, -EIO, 0);
    dst d;
    dst_paged(&d, &f);
    memset(f.got, 0xEE, f.bytes + 4096);
    int st[CH];
    ferry_kv_req r = FERRY_KV_REQ_INIT;
    r.status = st;
    r.max_chunks = CH;
    assert_int_equal(ferry_kv_retrieve(kv, f.tok, N, &r, &d.b), 2 * CT);
    for (unsigned k = 0; k < CH; k++) {
        assert_int_equal(st[k], k == 2 ? FERRY_ENOTFOUND : 0);
        chunk_is(&f, &d, k, k == 2 ? UNTOUCHED : EXACT);
    }
    ferry_kv_close(kv);
    fix_free(&f);
}

static void sleep_us(long us)
{
    struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
    nanosleep(&ts, NULL);
}

/* cancels from another thread while pieces are in flight (each read
 * slowed to 1 ms): every chunk is exact with status 0, or zeroed or
 * untouched with -ECANCELED; once the cancel returned, a pattern written
 * over the buffer stays (ferry writes nothing more there) */
static void test_direct_cancel_leaves_no_late_write(void **state)
{
    (void)state;
    fix f;
    stored(&f, 0);
    atomic_store(&slow_us, 1000);
    seam_on();
    const long when_us[] = {0, 500, 1500, 3000, 6000, 12000};
    for (size_t w = 0; w < sizeof when_us / sizeof when_us[0]; w++) {
        ferry_kv *kv = NULL;
        FT_ASSERT_OK(ferry_kv_open(&f.c, &kv));
        dst d;
        if (w % 2) /* (a paged buffer's chunks are many runs each) */
            dst_paged(&d, &f);
        else
            dst_contig(&d, &f, 0);
        memset(f.got, 0xEE, f.bytes + 4096);
        int st[CH];
        ferry_kv_req r = FERRY_KV_REQ_INIT;
        r.status = st;
        r.max_chunks = CH;
        ferry_kv_op *op = NULL;
        FT_ASSERT_OK(ferry_kv_retrieve_async(kv, f.tok, N, &r, &d.b, &op));
        sleep_us(when_us[w]);
        int rc = ferry_kv_op_cancel(op);
        assert_true(rc == -ECANCELED || rc == N);
        unsigned moved = 0;
        for (unsigned k = 0; k < CH; k++) {
            assert_true(st[k] == 0 || st[k] == -ECANCELED);
            chunk_is(&f, &d, k, st[k] == 0 ? EXACT : UNTOUCHED_OR_ZEROED);
            moved += st[k] == 0;
        }
        assert_int_equal(rc == N, moved == CH);
        memset(f.got, 0x77, f.bytes + 4096);
        sleep_us(20000);
        for (size_t x = 0; x < f.bytes + 4096; x += 512)
            assert_int_equal(f.got[x], 0x77);
        ferry_kv_op_free(op);
        ferry_kv_close(kv);
    }
    ferry__sys_set(NULL);
    atomic_store(&slow_us, 0);
    fix_free(&f);
}

/* a buffer off a page boundary takes the L1 path: exact, promoted */
static void test_misaligned_buffer_goes_through_l1(void **state)
{
    (void)state;
    fix f;
    stored(&f, 0);
    dst d;
    dst_contig(&d, &f, 64);
    int st[CH];
    ferry_kv_stats m;
    assert_int_equal(cold(&f, &d, st, &m), N);
    for (unsigned k = 0; k < CH; k++) {
        assert_int_equal(st[k], 0);
        chunk_is(&f, &d, k, EXACT);
    }
    assert_true(m.tier[FERRY_KV_TIER_L1].chunks > 0);
    assert_true(m.retrieve_copy_us > 0 || m.retrieve_check_us > 0);
    fix_free(&f);
}

/* a slab of format 2 (one checksum per chunk): read straight in too and
 * checked whole there; a bad byte is a zeroed miss */
static void test_old_format_read_directly_checked_whole(void **state)
{
    (void)state;
    fix f;
    stored(&f, 2);
    dst d;
    dst_paged(&d, &f);
    int st[CH];
    ferry_kv_stats m;
    assert_int_equal(cold(&f, &d, st, &m), N);
    for (unsigned k = 0; k < CH; k++)
        chunk_is(&f, &d, k, EXACT);
    assert_int_equal(m.tier[FERRY_KV_TIER_L1].chunks, 0);
    damage(&f, 1, PIECE + 7);
    assert_int_equal(cold(&f, &d, st, &m), CT);
    for (unsigned k = 0; k < CH; k++) {
        assert_int_equal(st[k], k == 1 ? FERRY_ECORRUPT : 0);
        chunk_is(&f, &d, k, k == 1 ? ZEROED : EXACT);
    }
    assert_int_equal(m.corrupt_chunks, 1);
    fix_free(&f);
}

/* by default only a buffer in huge pages is read into directly: one in 4
 * KiB pages (advised so) goes through L1, exact */
static void test_default_reads_only_into_huge_pages(void **state)
{
    (void)state;
    fix f;
    stored(&f, 0);
    free(f.got);
    assert_int_equal(posix_memalign((void **)&f.got, 2 << 20, f.bytes + 4096), 0);
    assert_int_equal(madvise(f.got, f.bytes + 4096, MADV_NOHUGEPAGE), 0);
    ferry__kv_set_direct_mode(2);
    dst d;
    dst_contig(&d, &f, 0);
    int st[CH];
    ferry_kv_stats m;
    assert_int_equal(cold(&f, &d, st, &m), N);
    for (unsigned k = 0; k < CH; k++)
        chunk_is(&f, &d, k, EXACT);
    assert_true(m.tier[FERRY_KV_TIER_L1].chunks > 0);
    ferry__kv_set_direct_mode(1);
    fix_free(&f);
}

/* a block table that names one block for a token of chunk 1 and one of
 * chunk 2 (the engine's aliasing, misuse or not): no chunk is read
 * straight into the buffer, so neither chunk's check sees the other's
 * bytes: every chunk is found (none blamed as corrupt, none dropped from
 * L2), the unshared blocks exact, the shared one whole rows of one of them */
static void test_direct_block_shared_across_chunks_not_direct(void **state)
{
    (void)state;
    fix f;
    stored(&f, 0);
    /* chunk 1's first piece lands in the shared block, and reports it
     * only after chunk 2's first piece landed there too */
    atomic_store(&late_at, (long long)image_at(&f, 1));
    seam_on();
    f.c.l1_bytes = 16 * (uint64_t)CHUNK; /* (several chunks read at once) */
    for (int rep = 0; rep < 2; rep++) {
        dst d;
        dst_paged(&d, &f);
        d.table[2 * CT / BT] = d.table[CT / BT]; /* chunk 2's first block is chunk 1's */
        int st[CH];
        ferry_kv_stats m;
        assert_int_equal(cold(&f, &d, st, &m), N);
        assert_int_equal(m.corrupt_chunks, 0);
        assert_int_equal(m.tier[FERRY_KV_TIER_L2].chunks, CH);
        for (unsigned k = 0; k < CH; k++)
            assert_int_equal(st[k], 0);
        chunk_is(&f, &d, 0, EXACT);
        chunk_is(&f, &d, 3, EXACT);
        for (unsigned p = 0; p < PLANES; p++)
            for (unsigned t = CT; t < 3 * CT; t++) {
                const uint8_t *g = tok_at(&d, p, t);
                unsigned row = t % BT, t1 = CT + row, t2 = 2 * CT + row;
                int shared = t / BT == CT / BT || t / BT == 2 * CT / BT;
                if (!shared) {
                    assert_memory_equal(g, f.mem + ((size_t)p * N + t) * TB, TB);
                    continue;
                }
                assert_true(!memcmp(g, f.mem + ((size_t)p * N + t1) * TB, TB) ||
                            !memcmp(g, f.mem + ((size_t)p * N + t2) * TB, TB));
            }
    }
    ferry__sys_set(NULL);
    atomic_store(&late_at, -1);
    fix_free(&f);
}

/* chunk k in d is src's chunk k, exact */
static int chunk_from(const dst *d, const uint8_t *src, unsigned k)
{
    for (unsigned p = 0; p < PLANES; p++)
        for (unsigned t = k * CT; t < (k + 1) * CT; t++)
            if (memcmp(tok_at(d, p, t), src + ((size_t)p * N + t) * TB, TB))
                return 0;
    return 1;
}

typedef struct rthread {
    ferry_kv *kv;
    const int32_t *tok;
    const dst *d;
    int st[CH];
    int rc;
    pthread_barrier_t *go;
} rthread;

static void *retrieve_thread(void *arg)
{
    rthread *t = arg;
    ferry_kv_req r = FERRY_KV_REQ_INIT;
    r.status = t->st;
    r.max_chunks = CH;
    pthread_barrier_wait(t->go);
    t->rc = ferry_kv_retrieve(t->kv, t->tok, N, &r, &t->d->b);
    return NULL;
}

/* two retrieves of one L2-only prefix at once, one into an aligned buffer
 * (read straight in), one into a buffer off a page boundary (through L1):
 * each waits for or reads the chunks the other is reading, and both get
 * every chunk exact */
static void test_direct_and_l1_retrieves_of_one_prefix_at_once(void **state)
{
    (void)state;
    fix f;
    stored(&f, 0);
    f.c.l1_bytes = 16 * (uint64_t)CHUNK;
    uint8_t *other = NULL;
    assert_int_equal(posix_memalign((void **)&other, 4096, f.bytes + 4096), 0);
    atomic_store(&slow_us, 200);
    seam_on();
    for (int rep = 0; rep < 4; rep++) {
        ferry_kv *kv = NULL;
        FT_ASSERT_OK(ferry_kv_open(&f.c, &kv));
        dst a, b;
        if (rep % 2)
            dst_paged(&a, &f);
        else
            dst_contig(&a, &f, 0);
        dst_contig(&b, &f, 0);
        b.b.base = (uint64_t)(uintptr_t)(other + 64);
        memset(f.got, 0xEE, f.bytes + 4096);
        memset(other, 0xEE, f.bytes + 4096);
        pthread_barrier_t go;
        pthread_barrier_init(&go, NULL, 2);
        rthread ta = {kv, f.tok, &a, {0}, 0, &go}, tb = {kv, f.tok, &b, {0}, 0, &go};
        pthread_t th;
        assert_int_equal(pthread_create(&th, NULL, retrieve_thread, &tb), 0);
        retrieve_thread(&ta);
        pthread_join(th, NULL);
        pthread_barrier_destroy(&go);
        assert_int_equal(ta.rc, N);
        assert_int_equal(tb.rc, N);
        for (unsigned k = 0; k < CH; k++) {
            assert_int_equal(ta.st[k], 0);
            assert_int_equal(tb.st[k], 0);
            assert_true(chunk_from(&a, f.mem, k));
            assert_true(chunk_from(&b, f.mem, k));
        }
        ferry_kv_stats m = FERRY_KV_STATS_INIT;
        FT_ASSERT_OK(ferry_kv_stats_get(kv, &m));
        assert_int_equal(m.corrupt_chunks, 0);
        FT_ASSERT_OK(ferry__kv_check(kv));
        ferry_kv_close(kv);
    }
    ferry__sys_set(NULL);
    atomic_store(&slow_us, 0);
    free(other);
    fix_free(&f);
}

typedef struct churn {
    ferry_kv *kv;
    fix *f;
    const uint8_t *alt;
    atomic_int stop;
    int deletes, locked;
} churn;

/* delete the prompt and store it again from the other source, over and over */
static void *churn_thread(void *arg)
{
    churn *c = arg;
    ferry_kv_buffer src = FERRY_KV_BUFFER_INIT;
    src.layout = c->f->c.layout;
    src.capacity_tokens = N;
    for (unsigned i = 0; !atomic_load(&c->stop); i++) {
        int rc = ferry_kv_delete(c->kv, c->f->tok, N, NULL);
        assert_true(rc >= 0 || rc == FERRY_ELOCKED);
        c->deletes++;
        c->locked += rc == FERRY_ELOCKED;
        src.base = (uint64_t)(uintptr_t)(i % 2 ? c->alt : c->f->mem);
        rc = ferry_kv_store(c->kv, c->f->tok, N, NULL, &src);
        assert_true(rc >= 0 || rc == FERRY_ENOSPACE);
    }
    return NULL;
}

/* retrieves, direct and not, while another thread deletes the prompt and
 * stores it again with other bytes (the L1 of two chunks sends the first
 * ones down to L2 only): every chunk retrieved is wholly one version
 * or the other, never a mix, and every chunk not retrieved is untouched
 * or zeroed */
static void test_direct_retrieve_while_deleted_and_restored(void **state)
{
    (void)state;
    fix f;
    stored(&f, 0);
    uint8_t *alt = malloc(f.bytes);
    assert_non_null(alt);
    ft_fill_mixed(alt, f.bytes, 771);
    atomic_store(&slow_us, 100);
    seam_on();
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&f.c, &kv));
    churn c = {kv, &f, alt, 0, 0, 0};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, churn_thread, &c), 0);
    unsigned got = 0, missed = 0;
    for (int rep = 0; rep < 24; rep++) {
        dst d;
        if (rep % 2)
            dst_paged(&d, &f);
        else
            dst_contig(&d, &f, rep % 4 == 2 ? 64 : 0);
        memset(f.got, 0xEE, f.bytes + 4096);
        int st[CH];
        ferry_kv_req r = FERRY_KV_REQ_INIT;
        r.status = st;
        r.max_chunks = CH;
        int rc = ferry_kv_retrieve(kv, f.tok, N, &r, &d.b);
        assert_true(rc >= 0 && rc <= N);
        for (unsigned k = 0; k < CH; k++) {
            if (st[k] == 0) {
                assert_true(chunk_from(&d, f.mem, k) || chunk_from(&d, alt, k));
                got++;
            } else {
                assert_true(st[k] == FERRY_ENOTFOUND || st[k] == FERRY_ENOSPACE);
                chunk_is(&f, &d, k, UNTOUCHED_OR_ZEROED);
                missed++;
            }
        }
    }
    atomic_store(&c.stop, 1);
    pthread_join(th, NULL);
    print_message("retrieved %u chunks, %u missed; %d deletes (%d locked)\n", got, missed,
                  c.deletes, c.locked);
    ferry_kv_stats m = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(kv, &m));
    assert_int_equal(m.corrupt_chunks, 0);
    FT_ASSERT_OK(ferry__kv_check(kv));
    ferry_kv_close(kv);
    ferry__sys_set(NULL);
    atomic_store(&slow_us, 0);
    free(alt);
    fix_free(&f);
}

/* the store closed while a direct retrieve is in flight (each read
 * slowed): close waits for it; the op, freed after the close, answers its
 * result, every chunk it reports exact, and nothing is written into the
 * buffer after the close returned */
static void test_close_with_direct_retrieve_in_flight(void **state)
{
    (void)state;
    fix f;
    stored(&f, 0);
    atomic_store(&slow_us, 1000);
    seam_on();
    for (int w = 0; w < 3; w++) {
        ferry_kv *kv = NULL;
        FT_ASSERT_OK(ferry_kv_open(&f.c, &kv));
        dst d;
        if (w == 1)
            dst_paged(&d, &f);
        else
            dst_contig(&d, &f, 0);
        memset(f.got, 0xEE, f.bytes + 4096);
        int st[CH];
        ferry_kv_req r = FERRY_KV_REQ_INIT;
        r.status = st;
        r.max_chunks = CH;
        ferry_kv_op *op = NULL;
        FT_ASSERT_OK(ferry_kv_retrieve_async(kv, f.tok, N, &r, &d.b, &op));
        sleep_us(w * 2000);
        ferry_kv_close(kv);
        memset(f.got, 0x77, f.bytes + 4096); /* (the engine reuses it at once) */
        int rc = ferry_kv_op_wait(op, 0);
        assert_int_equal(rc, N); /* (close waited for it: it ran to its end) */
        assert_int_equal(ferry_kv_op_test(op), N);
        for (unsigned k = 0; k < CH; k++)
            assert_int_equal(st[k], 0);
        sleep_us(5000);
        for (size_t x = 0; x < f.bytes + 4096; x += 512)
            assert_int_equal(f.got[x], 0x77);
        ferry_kv_op_free(op);
    }
    ferry__sys_set(NULL);
    atomic_store(&slow_us, 0);
    fix_free(&f);
}

/* a buffer aligned but for one plane (its blocks 2 KiB off a page), and a
 * retrieve whose skip_tokens falls inside a chunk: those chunks go through
 * L1 (the rest may be read straight in), every chunk exact, and no byte
 * below skip_tokens written */
static void test_partly_aligned_and_straddling_skip(void **state)
{
    (void)state;
    fix f;
    stored(&f, 0);
    dst d;
    dst_paged(&d, &f);
    d.bases[PLANES - 1] += 2048; /* (into the buffer's spare page) */
    int st[CH];
    ferry_kv_stats m;
    assert_int_equal(cold(&f, &d, st, &m), N);
    for (unsigned k = 0; k < CH; k++) {
        assert_int_equal(st[k], 0);
        assert_true(chunk_from(&d, f.mem, k));
    }
    /* (none read straight in: each counted out of L1) */
    assert_int_equal(m.tier[FERRY_KV_TIER_L1].bytes_read, (uint64_t)CH * CHUNK);

    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&f.c, &kv));
    dst_contig(&d, &f, 0);
    memset(f.got, 0xEE, f.bytes + 4096);
    ferry_kv_req r = FERRY_KV_REQ_INIT;
    r.status = st;
    r.max_chunks = CH;
    r.skip_tokens = CT + 3;
    assert_int_equal(ferry_kv_retrieve(kv, f.tok, N, &r, &d.b), N);
    for (unsigned p = 0; p < PLANES; p++)
        for (unsigned t = 0; t < N; t++) {
            const uint8_t *g = tok_at(&d, p, t);
            if (t < CT + 3)
                assert_true(g[0] == 0xEE && g[TB - 1] == 0xEE && !memcmp(g, g + 1, TB - 1));
            else
                assert_memory_equal(g, f.mem + ((size_t)p * N + t) * TB, TB);
        }
    m = (ferry_kv_stats)FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(kv, &m));
    assert_int_equal(m.tier[FERRY_KV_TIER_L1].bytes_read, 2 * (uint64_t)CHUNK); /* 0 and 1 */
    ferry_kv_close(kv);
    fix_free(&f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_readv_lands_in_its_pieces),
        cmocka_unit_test(test_direct_reads_are_exact),
        cmocka_unit_test(test_direct_bad_piece_is_a_zeroed_miss),
        cmocka_unit_test(test_direct_torn_read_is_a_zeroed_miss),
        cmocka_unit_test(test_direct_read_never_started_leaves_untouched),
        cmocka_unit_test(test_direct_cancel_leaves_no_late_write),
        cmocka_unit_test(test_misaligned_buffer_goes_through_l1),
        cmocka_unit_test(test_old_format_read_directly_checked_whole),
        cmocka_unit_test(test_default_reads_only_into_huge_pages),
        cmocka_unit_test(test_direct_block_shared_across_chunks_not_direct),
        cmocka_unit_test(test_direct_and_l1_retrieves_of_one_prefix_at_once),
        cmocka_unit_test(test_direct_retrieve_while_deleted_and_restored),
        cmocka_unit_test(test_close_with_direct_retrieve_in_flight),
        cmocka_unit_test(test_partly_aligned_and_straddling_skip),
    };
    /* (the test buffers are in 4 KiB pages: direct reads into any aligned one) */
    ferry__kv_set_direct_mode(1);
    return cmocka_run_group_tests(tests, NULL, NULL);
}
