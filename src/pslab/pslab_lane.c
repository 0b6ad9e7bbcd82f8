/*
 * pslab_lane.c - the persistent slab's error helpers, file paths and I/O
 * lanes: the data path between callers' buffers and the striped slab files.
 *
 * Invariant: a lane is used by one thread at a time (lane_get hands out a
 * free one under lmu, lane_put gives it back), so its engine, its file
 * handles and its staging buffer need no lock of their own, and the lane
 * count bounds the data I/O in flight. Slab bytes are addressed as one
 * space and split at stripe boundaries here only, so no caller computes a
 * drive or a file offset. Every failure names the file, offset and length
 * with the I/O layer's own message appended (fail_io), because that
 * thread-local message is overwritten by the next call.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>
#include <xxh_x86dispatch.h>

#include "io/io_impl.h"
#include "pslab/pslab_impl.h"
#include "stripe.h"

int ferry__pslab_fail(ferry_pslab *p, int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int rc = ferry__err_vset(&p->err, code, fmt, ap);
    va_end(ap);
    return rc;
}

/* message with the lower layer's last error appended */
int ferry__pslab_fail_io(ferry_pslab *p, int code, const char *fmt, ...)
{
    char lower[FERRY__ERRMSG_MAX];
    snprintf(lower, sizeof lower, "%s", ferry_last_error());
    char msg[FERRY__ERRMSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return ferry__err_set(&p->err, code, "%s: %s (%s)", msg, ferry_err_name(code),
                          lower[0] ? lower : ferry_strerror(code));
}

int ferry__pslab_fsync_dir(const char *dir)
{
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        return -errno;
    int rc = fsync(fd) == 0 ? 0 : -errno;
    close(fd);
    return rc;
}

void ferry__pslab_slab_path(const ferry_pslab *p, unsigned i, char *out, size_t n)
{
    snprintf(out, n, "%s/%s", p->dirs[i], FERRY_PSLAB_FILE);
}

unsigned ferry__pslab_file_flags(const ferry_pslab *p)
{
    unsigned fl = FERRY_FILE_READ;
    if (!(p->flags & FERRY_PSLAB_READONLY))
        fl |= FERRY_FILE_WRITE;
    if (p->direct)
        fl |= FERRY_FILE_DIRECT;
    return fl;
}

void ferry__pslab_lane_close(lane *l)
{
    for (unsigned i = 0; i < FERRY_PSLAB_MAX_DIRS; i++)
        if (l->f[i])
            ferry_file_close(l->f[i]);
    if (l->stage)
        ferry_io_buffer_free(l->io, l->stage);
    ferry_io_close(l->io);
    memset(l, 0, sizeof *l);
}

int ferry__pslab_lane_open(ferry_pslab *p, lane *l, const char *engine, unsigned depth)
{
    ferry_io_options io = FERRY_IO_OPTIONS_INIT;
    io.engine = engine;
    io.depth = depth;
    int rc = ferry_io_open(&io, &l->io);
    if (rc < 0)
        return ferry__pslab_fail_io(p, rc, "pslab %s: opening an I/O engine (%s)", p->dirs[0],
                                    engine ? engine : "auto");
    for (unsigned i = 0; i < p->g.drives; i++) {
        char path[PATH_MAX_];
        ferry__pslab_slab_path(p, i, path, sizeof path);
        rc = ferry_file_open(l->io, path, ferry__pslab_file_flags(p), &l->f[i]);
        if (rc < 0) {
            rc = ferry__pslab_fail_io(p, rc, "pslab: opening slab file %s", path);
            ferry__pslab_lane_close(l);
            return rc;
        }
        if (i == 0 && p->direct && !ferry_file_is_direct(l->f[0]))
            p->st.direct = 0;
    }
    return 0;
}

lane *ferry__pslab_lane_get(ferry_pslab *p)
{
    pthread_mutex_lock(&p->lmu);
    while (!p->free_lanes)
        pthread_cond_wait(&p->lcv, &p->lmu);
    unsigned i = (unsigned)__builtin_ctz(p->free_lanes);
    FERRY__ASSERT(i < p->nlanes);
    p->free_lanes &= ~(1u << i);
    pthread_mutex_unlock(&p->lmu);
    return &p->lanes[i];
}

void ferry__pslab_lane_put(ferry_pslab *p, lane *l)
{
    pthread_mutex_lock(&p->lmu);
    /* one of this store's lanes, and taken: a lane has one user at a time */
    FERRY__ASSERT(l >= p->lanes && l < p->lanes + p->nlanes);
    FERRY__ASSERT(!(p->free_lanes & (1u << (unsigned)(l - p->lanes))));
    p->free_lanes |= 1u << (unsigned)(l - p->lanes);
    pthread_cond_signal(&p->lcv);
    pthread_mutex_unlock(&p->lmu);
}

int ferry__pslab_lane_stage(ferry_pslab *p, lane *l, size_t n)
{
    if (l->stage_cap >= n)
        return 0;
    void *b = NULL;
    size_t cap = align_up(n, FERRY_IO_ALIGN);
    int rc = ferry_io_buffer_alloc(l->io, cap, &b);
    if (rc < 0)
        return ferry__err_set(&p->err, -ENOMEM,
                              "pslab %s: out of memory for a %zu-byte staging buffer",
                              p->dirs[0], cap);
    if (l->stage)
        ferry_io_buffer_free(l->io, l->stage);
    l->stage = b;
    l->stage_cap = cap;
    return 0;
}

/* where slab bytes [off, off+len) start: drive *d at file offset *foff,
 * for *seg bytes up to the next stripe boundary (core's stripe map, after
 * each file's header block) */
static void stripe_at(const ferry_pslab *p, uint64_t off, uint64_t len, unsigned *d,
                      uint64_t *seg, uint64_t *foff)
{
    uint64_t run;
    ferry__pslab_locate(p, off, d, foff, &run);
    *seg = FERRY__MIN(len, run);
}

/* slab bytes [off, off+len) <-> buf through lane l, split at stripe boundaries */
int ferry__pslab_data_rw(ferry_pslab *p, lane *l, int op, void *buf, uint64_t len, uint64_t off)
{
    uint8_t *b = buf;
    while (len) {
        unsigned d;
        uint64_t seg, foff;
        stripe_at(p, off, len, &d, &seg, &foff);
        int rc = op == FERRY_IO_WRITE ? ferry_io_pwrite(l->io, l->f[d], b, seg, foff)
                                      : ferry_io_pread(l->io, l->f[d], b, seg, foff);
        if (rc < 0)
            return ferry__pslab_fail_io(p, rc, "pslab: %s of %llu bytes at slab offset %llu "
                                        "(file %s, offset %llu)",
                                        op == FERRY_IO_WRITE ? "write" : "read",
                                        (unsigned long long)seg, (unsigned long long)off,
                                        ferry_file_path(l->f[d]), (unsigned long long)foff);
        b += seg;
        off += seg;
        len -= seg;
    }
    return 0;
}

/* the sums of data[0..dlen): each piece's into psum and their table's
 * into *sum, or (piece 0) the whole payload's into *sum */
static void payload_sums(const uint8_t *data, size_t dlen, uint32_t piece, uint64_t *psum,
                         uint64_t *sum)
{
    if (!piece) {
        *sum = XXH3_64bits_dispatch(data, dlen);
        return;
    }
    uint32_t k = 0;
    for (size_t at = 0; at < dlen; at += piece)
        psum[k++] = XXH3_64bits_dispatch(data + at, FERRY__MIN((size_t)piece, dlen - at));
    *sum = ferry__pslab_table_sum(psum, k);
}

/*
 * data_rw's write, with the payload's sums computed while the write is
 * in flight: the first NSEG stripe segments are started, data[0..dlen) is
 * hashed (piece by piece), then they are finished (and the next ones run).
 * The hash of a 32 MiB chunk is a few ms of CPU; started first, the drive
 * works through it instead of waiting for it. buf and data stay unchanged
 * throughout (the caller's or the lane's staging copy), so the sums are of
 * what is written.
 */
int ferry__pslab_data_write_sum(ferry_pslab *p, lane *l, const void *buf, uint64_t len,
                                uint64_t off, const void *data, size_t dlen, uint32_t piece,
                                uint64_t *psum, uint64_t *sum)
{
    enum { NSEG = 16 };
    ferry_io_req r[NSEG];
    uint64_t soff[NSEG], slen[NSEG], foffs[NSEG];
    unsigned sdrv[NSEG];
    const uint8_t *b = buf;
    int hashed = 0, rc = 0;
    while (len && rc == 0) {
        unsigned n = 0;
        while (n < NSEG && len) {
            unsigned d;
            uint64_t seg, foff;
            stripe_at(p, off, len, &d, &seg, &foff);
            rc = ferry__io_start(l->io, &r[n], l->f[d], FERRY_IO_WRITE, (void *)(uintptr_t)b, 0,
                                 (size_t)seg, foff, (size_t)seg);
            if (rc < 0) {
                rc = ferry__pslab_fail_io(p, rc, "pslab: write of %llu bytes at slab offset "
                                          "%llu (file %s, offset %llu)", (unsigned long long)seg,
                                          (unsigned long long)off, ferry_file_path(l->f[d]),
                                          (unsigned long long)foff);
                break;
            }
            soff[n] = off;
            slen[n] = seg;
            foffs[n] = foff;
            sdrv[n] = d;
            n++;
            b += seg;
            off += seg;
            len -= seg;
        }
        if (!hashed) {
            payload_sums(data, dlen, piece, psum, sum);
            hashed = 1;
        }
        for (unsigned i = 0; i < n; i++) {
            int r2 = ferry__io_finish(l->io, &r[i]);
            if (r2 < 0 && rc == 0)
                rc = ferry__pslab_fail_io(p, r2, "pslab: write of %llu bytes at slab offset "
                                          "%llu (file %s, offset %llu)",
                                          (unsigned long long)slen[i], (unsigned long long)soff[i],
                                          ferry_file_path(l->f[sdrv[i]]),
                                          (unsigned long long)foffs[i]);
        }
    }
    if (!hashed)
        payload_sums(data, dlen, piece, psum, sum);
    return rc;
}

/*
 * data_rw's read, with the first hlen bytes checked as they land: the
 * bytes are read as requests of at most RPIECE, up to NREQ in flight (the
 * lane's depth: 32 MiB at once), and each landed prefix is hashed while
 * the later requests are still in flight - as one XXH3-64 into *sum with
 * piece 0, else piece by piece against psum, each piece as soon as it has
 * landed whole. The check of a 32 MiB chunk then ends a fraction of a
 * millisecond after its last byte lands instead of a whole hash later, and
 * the hash reads each piece while it is still in cache. A piece that
 * fails is FERRY_ECORRUPT (no message: the caller names the chunk) with
 * *bad its index and *sum what it hashed to; no request starts after it.
 * Every request started is finished before this returns, failed or not.
 */
int ferry__pslab_data_read_sum(ferry_pslab *p, lane *l, void *buf, uint64_t len, uint64_t off,
                               uint64_t hlen, uint32_t piece, const uint64_t *psum,
                               uint64_t *sum, uint32_t *bad)
{
    enum { NREQ = 16 };
    const uint64_t RPIECE = (uint64_t)2 << 20;
    ferry_io_req r[NREQ];
    uint64_t roff[NREQ], rlen[NREQ], rfoff[NREQ];
    unsigned rdrv[NREQ];
    uint8_t *b = buf;
    uint64_t sent = 0, done = 0, checked = 0; /* checked: pieces' bytes checked */
    uint32_t k = 0;
    unsigned head = 0, n = 0;
    int rc = 0;
    XXH3_state_t st;
    XXH3_64bits_reset(&st);
    while (done < len) {
        while (rc == 0 && n < NREQ && sent < len) {
            unsigned d;
            uint64_t seg, foff;
            stripe_at(p, off + sent, FERRY__MIN(len - sent, RPIECE), &d, &seg, &foff);
            unsigned q = (head + n) % NREQ;
            rc = ferry__io_start_piece(l->io, &r[q], l->f[d], FERRY_IO_READ, b + sent, 0,
                                       (size_t)seg, foff, (size_t)seg, (size_t)seg);
            if (rc < 0) {
                rc = ferry__pslab_fail_io(p, rc, "pslab: read of %llu bytes at slab offset "
                                          "%llu (file %s, offset %llu)", (unsigned long long)seg,
                                          (unsigned long long)(off + sent),
                                          ferry_file_path(l->f[d]), (unsigned long long)foff);
                break;
            }
            roff[q] = sent;
            rlen[q] = seg;
            rfoff[q] = foff;
            rdrv[q] = d;
            sent += seg;
            n++;
        }
        if (n == 0)
            break; /* (a failed start with nothing in flight) */
        int r2 = ferry__io_finish(l->io, &r[head]);
        if (r2 < 0 && rc == 0)
            rc = ferry__pslab_fail_io(p, r2, "pslab: read of %llu bytes at slab offset %llu "
                                      "(file %s, offset %llu)", (unsigned long long)rlen[head],
                                      (unsigned long long)(off + roff[head]),
                                      ferry_file_path(l->f[rdrv[head]]),
                                      (unsigned long long)rfoff[head]);
        if (rc == 0 && !piece && roff[head] < hlen)
            XXH3_64bits_update_dispatch(&st, b + roff[head],
                                        (size_t)FERRY__MIN(rlen[head], hlen - roff[head]));
        done = roff[head] + rlen[head];
        /* every piece that has landed whole */
        while (rc == 0 && piece && checked < hlen &&
               FERRY__MIN(checked + piece, hlen) <= done) {
            uint64_t m = FERRY__MIN((uint64_t)piece, hlen - checked);
            uint64_t s = XXH3_64bits_dispatch(b + checked, (size_t)m);
            if (s != psum[k]) {
                *sum = s;
                *bad = k;
                rc = FERRY_ECORRUPT;
            }
            checked += m;
            k++;
        }
        head = (head + 1) % NREQ;
        n--;
        if (rc < 0 && n == 0)
            break;
    }
    if (rc == 0 && !piece)
        *sum = XXH3_64bits_digest(&st);
    return rc;
}
