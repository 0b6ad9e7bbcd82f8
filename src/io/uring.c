/*
 * uring.c - the io_uring engine (liburing).
 *
 * Invariant: every part handed to submit gets exactly one SQE whose
 * user_data is the part, and wait hands each part back once, when its CQE
 * is consumed. The ring has at least as many SQ entries as the front has
 * parts, so get_sqe cannot run dry, and the CQ (twice the SQ) cannot
 * overflow. Submission is batched: submit preps all SQEs and makes one
 * io_uring_submit call for the lot; wait consumes every CQE that is ready
 * in one pass and advances the CQ once.
 *
 * Files are registered in a sparse fixed-file table (IOSQE_FIXED_FILE saves
 * an fget/fput per request); host buffers given to ferry_io_register_buffer
 * go in a sparse fixed-buffer table and a part that lies entirely inside
 * one uses READ_FIXED/WRITE_FIXED (no page pinning per request). Both
 * tables are optional: when the kernel refuses them the engine still works
 * with plain reads and writes.
 *
 * The kernel does the I/O, so the syscall seam cannot see it; instead each
 * CQE's result passes through the seam's uring_result hook, which a test
 * uses to inject errors and short completions.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/uio.h>
#include <sys/utsname.h>
#include <time.h>

#include <liburing.h>

#include "io_impl.h"
#include "sys.h"

#define FILE_SLOTS 256u
#define BUF_SLOTS 64u
#define BUF_PIECE ((size_t)1 << 30) /* the kernel's cap on one fixed buffer */

typedef struct ur_buf {
    char *owner; /* what the caller registered (several pieces when > 1 GiB) */
    char *base;
    size_t len;
} ur_buf;

typedef struct ur_st {
    struct io_uring ring;
    int have_files;
    unsigned char file_used[FILE_SLOTS];
    int have_bufs;
    ur_buf bufs[BUF_SLOTS];
} ur_st;

static unsigned ur_slots(unsigned depth)
{
    return depth;
}

static unsigned pow2_at_least(unsigned n)
{
    unsigned p = 1;
    while (p < n)
        p <<= 1;
    return p;
}

static int ring_init(struct io_uring *ring, unsigned entries)
{
    struct io_uring_params p;
    memset(&p, 0, sizeof p);
#ifdef IORING_SETUP_COOP_TASKRUN
    p.flags = IORING_SETUP_COOP_TASKRUN;
    int rc = io_uring_queue_init_params(entries, ring, &p);
    if (rc != -EINVAL)
        return rc;
    memset(&p, 0, sizeof p);
#endif
    return io_uring_queue_init_params(entries, ring, &p);
}

static int ur_init(ferry_io *io)
{
    ur_st *st = ferry__calloc(1, sizeof *st);
    if (!st)
        return ferry__err_set(&io->err, -ENOMEM, "io uring: out of memory");
    unsigned entries = pow2_at_least(io->nparts < 2 ? 2 : io->nparts);
    int rc = ring_init(&st->ring, entries);
    if (rc < 0) {
        ferry__free(st);
        return ferry__err_set(&io->err, rc == -ENOMEM ? -ENOMEM : FERRY_ENODEV,
                              "io uring: io_uring_queue_init(%u) refused by the kernel: %s (%s)",
                              entries, ferry_err_name(rc), strerror(-rc));
    }
    st->have_files = io_uring_register_files_sparse(&st->ring, FILE_SLOTS) == 0;
    st->have_bufs = io_uring_register_buffers_sparse(&st->ring, BUF_SLOTS) == 0;
    if (!st->have_files || !st->have_bufs)
        FERRY_LOGD("io uring: fixed files %s, fixed buffers %s", st->have_files ? "on" : "off",
                   st->have_bufs ? "on" : "off");
    io->eng = st;
    return 0;
}

static void ur_fini(ferry_io *io)
{
    ur_st *st = io->eng;
    if (!st)
        return;
    io_uring_queue_exit(&st->ring);
    ferry__free(st);
    io->eng = NULL;
}

static int ur_file_open(ferry_io *io, ferry_file *f)
{
    ur_st *st = io->eng;
    if (!st->have_files)
        return 0;
    for (unsigned i = 0; i < FILE_SLOTS; i++) {
        if (st->file_used[i])
            continue;
        int fd = f->fd;
        int rc = io_uring_register_files_update(&st->ring, i, &fd, 1);
        if (rc == 1) {
            st->file_used[i] = 1;
            f->slot = (int)i;
        } else
            FERRY_LOGD("io uring: file %s not registered (%s); using its fd", f->path,
                       strerror(-rc));
        break;
    }
    return 0;
}

static void ur_file_close(ferry_io *io, ferry_file *f)
{
    ur_st *st = io->eng;
    if (f->slot < 0)
        return;
    int fd = -1;
    io_uring_register_files_update(&st->ring, (unsigned)f->slot, &fd, 1);
    st->file_used[f->slot] = 0;
    f->slot = -1;
}

static int set_buf_slot(ur_st *st, unsigned i, void *base, size_t len)
{
    struct iovec iov = {base, len};
    int rc = io_uring_register_buffers_update_tag(&st->ring, i, &iov, NULL, 1);
    return rc == 1 ? 0 : rc < 0 ? rc : -EIO;
}

static int ur_buf_unregister(ferry_io *io, void *buf)
{
    ur_st *st = io->eng;
    int found = 0;
    for (unsigned i = 0; i < BUF_SLOTS; i++) {
        if (st->bufs[i].owner != buf)
            continue;
        set_buf_slot(st, i, NULL, 0);
        memset(&st->bufs[i], 0, sizeof st->bufs[i]);
        found = 1;
    }
    if (!found)
        return ferry__err_set(&io->err, FERRY_ENOTFOUND, "io uring: buffer %p is not registered",
                              buf);
    return 0;
}

static int ur_buf_register(ferry_io *io, void *buf, size_t len)
{
    ur_st *st = io->eng;
    if (!st->have_bufs)
        return ferry__err_set(&io->err, FERRY_ENOTSUP,
                              "io uring: the kernel refused a fixed-buffer table; buffer %p of "
                              "%zu bytes not registered", buf, len);
    for (unsigned i = 0; i < BUF_SLOTS; i++)
        if (st->bufs[i].owner == buf) {
            if (st->bufs[i].base == buf && st->bufs[i].len >= FERRY__MIN(len, BUF_PIECE))
                return 0; /* already registered */
            return ferry__err_set(&io->err, FERRY_EEXIST,
                                  "io uring: buffer %p is already registered with another length",
                                  buf);
        }
    size_t pieces = (len + BUF_PIECE - 1) / BUF_PIECE, free_slots = 0;
    for (unsigned i = 0; i < BUF_SLOTS; i++)
        free_slots += st->bufs[i].owner == NULL;
    if (pieces > free_slots)
        return ferry__err_set(&io->err, FERRY_ENOSPACE,
                              "io uring: buffer %p of %zu bytes needs %zu fixed-buffer slots, %zu "
                              "free of %u", buf, len, pieces, free_slots, BUF_SLOTS);
    size_t pos = 0;
    for (unsigned i = 0; i < BUF_SLOTS && pos < len; i++) {
        if (st->bufs[i].owner)
            continue;
        size_t n = FERRY__MIN(len - pos, BUF_PIECE);
        int rc = set_buf_slot(st, i, (char *)buf + pos, n);
        if (rc < 0) {
            if (pos)
                ur_buf_unregister(io, buf);
            return ferry__err_set(&io->err, rc,
                                  "io uring: registering buffer %p (%zu bytes at +%zu) failed: "
                                  "%s (%s)", buf, n, pos, ferry_err_name(rc), strerror(-rc));
        }
        st->bufs[i].owner = buf;
        st->bufs[i].base = (char *)buf + pos;
        st->bufs[i].len = n;
        pos += n;
    }
    return 0;
}

static int find_buf(const ur_st *st, const char *p, size_t len)
{
    for (unsigned i = 0; i < BUF_SLOTS; i++) {
        const ur_buf *b = &st->bufs[i];
        if (b->base && p >= b->base && p + len <= b->base + b->len)
            return (int)i;
    }
    return -1;
}

static int ur_submit(ferry_io *io, ferry__part **parts, unsigned n)
{
    ur_st *st = io->eng;
    unsigned i;
    for (i = 0; i < n; i++) {
        ferry__part *p = parts[i];
        struct io_uring_sqe *sqe = io_uring_get_sqe(&st->ring);
        if (!sqe) {
            io_uring_submit(&st->ring);
            sqe = io_uring_get_sqe(&st->ring);
            if (!sqe)
                break;
        }
        int fixed_file = p->file->slot >= 0;
        int fd = fixed_file ? p->file->slot : p->fd;
        int bi = st->have_bufs && !p->iov ? find_buf(st, p->buf, p->len) : -1;
        unsigned len = (unsigned)p->len;
        if (p->iov) {
            io_uring_prep_readv(sqe, fd, p->iov, p->niov, p->off);
        } else if (p->op == FERRY_IO_READ) {
            if (bi >= 0)
                io_uring_prep_read_fixed(sqe, fd, p->buf, len, p->off, bi);
            else
                io_uring_prep_read(sqe, fd, p->buf, len, p->off);
        } else {
            if (bi >= 0)
                io_uring_prep_write_fixed(sqe, fd, p->buf, len, p->off, bi);
            else
                io_uring_prep_write(sqe, fd, p->buf, len, p->off);
        }
        if (fixed_file)
            sqe->flags |= IOSQE_FIXED_FILE;
        io_uring_sqe_set_data(sqe, p);
    }
    int rc = io_uring_submit(&st->ring);
    if (rc < 0 && rc != -EAGAIN && rc != -EBUSY && rc != -EINTR)
        FERRY_LOGW("io uring: io_uring_submit: %s; retrying at the next wait", strerror(-rc));
    if (i < n) {
        ferry__err_set(&io->err, -EBUSY, "io uring: submission queue full after %u of %u "
                       "requests", i, n);
        return i ? (int)i : -EBUSY;
    }
    return (int)n;
}

static unsigned drain(ferry_io *io, ur_st *st, ferry__part **out, unsigned max)
{
    const ferry__sys *sys = ferry__sys_get();
    unsigned head, n = 0;
    struct io_uring_cqe *cqe;
    io_uring_for_each_cqe(&st->ring, head, cqe)
    {
        if (n == max)
            break;
        ferry__part *p = io_uring_cqe_get_data(cqe);
        int res = cqe->res;
        if (sys->uring_result)
            res = sys->uring_result(sys->ctx, p->op, p->fd, p->off, p->len, res);
        p->res = res;
        out[n++] = p;
    }
    if (n)
        io_uring_cq_advance(&st->ring, n);
    (void)io;
    return n;
}

static int ur_wait(ferry_io *io, ferry__part **out, unsigned min, unsigned max, int timeout_ms)
{
    ur_st *st = io->eng;
    if (io_uring_sq_ready(&st->ring))
        io_uring_submit(&st->ring);
    unsigned k = drain(io, st, out, max);
    uint64_t deadline = timeout_ms > 0 ? ferry__now_ns() + (uint64_t)timeout_ms * 1000000ull : 0;
    while (k < min && k < max && timeout_ms != 0) {
        struct io_uring_cqe *cqe = NULL;
        int rc;
        if (timeout_ms < 0)
            rc = io_uring_wait_cqe_nr(&st->ring, &cqe, min - k);
        else {
            uint64_t now = ferry__now_ns();
            if (now >= deadline)
                break;
            uint64_t left = deadline - now;
            struct __kernel_timespec ts = {(long long)(left / 1000000000ull),
                                           (long long)(left % 1000000000ull)};
            rc = io_uring_wait_cqes(&st->ring, &cqe, min - k, &ts, NULL);
        }
        if (rc == -ETIME)
            break;
        if (rc < 0 && rc != -EINTR && rc != -EAGAIN) {
            FERRY_LOGE("io uring: waiting for completions: %s", strerror(-rc));
            break;
        }
        k += drain(io, st, out + k, max - k);
    }
    return (int)k;
}

int ferry__uring_probe(char *why, size_t why_len)
{
    struct io_uring ring;
    int rc = io_uring_queue_init(2, &ring, 0);
    struct utsname u;
    const char *rel = uname(&u) == 0 ? u.release : "?";
    if (rc < 0) {
        snprintf(why, why_len, "io_uring_queue_init refused by the kernel %s: %s (%s)%s", rel,
                 ferry_err_name(rc), strerror(-rc),
                 rc == -EPERM ? " (sysctl kernel.io_uring_disabled or a seccomp filter?)" : "");
        return FERRY_ENODEV;
    }
    int files = io_uring_register_files_sparse(&ring, 1) == 0;
    io_uring_queue_exit(&ring);
    snprintf(why, why_len, "io_uring works (kernel %s, fixed files %s)", rel,
             files ? "yes" : "no");
    return 0;
}

const ferry__io_ops ferry__io_uring_ops = {
    .name = "uring",
    .default_max_request = (size_t)32 << 20,
    .vec = 1,
    .slots = ur_slots,
    .init = ur_init,
    .fini = ur_fini,
    .file_open = ur_file_open,
    .file_close = ur_file_close,
    .buf_register = ur_buf_register,
    .buf_unregister = ur_buf_unregister,
    .submit = ur_submit,
    .wait = ur_wait,
};
