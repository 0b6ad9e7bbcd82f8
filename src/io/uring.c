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
 * Registering a buffer may run on one thread while another submits and
 * reaps (ferry/io.h): the kv store registers its L1 pool after open, with
 * the pool's I/O already running. So the buffer table is written under its
 * own lock (regmu: register and unregister) and read by the submit path
 * without one: a slot's len is stored before its base, base last with
 * release, and only once the kernel took every piece of the buffer; submit
 * loads base with acquire, so it never names a buf_index whose
 * registration is incomplete (until then the part goes as a plain
 * read/write) and never sees a base without its len. Unregister clears base
 * first; it runs, as the io contract says, with no submit beside it for
 * that buffer (the kv store: at close, after its reads landed). The kernel
 * serializes the update with the ring's submissions itself (uring_lock:
 * io_uring_enter waits while pages are pinned, so the kv store registers
 * only once its pool's pages are present).
 *
 * The kernel does the I/O, so the syscall seam cannot see it; instead each
 * CQE's result passes through the seam's uring_result hook, which a test
 * uses to inject errors and short completions, and each buffer slot's
 * registration through uring_register, which may fail or delay it.
 */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
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
    char *owner;            /* what the caller registered (several pieces when > 1 GiB);
                             * claims the slot (regmu) */
    _Atomic(char *) base;   /* published last, once the kernel has the whole buffer */
    _Atomic size_t len;
} ur_buf;

typedef struct ur_st {
    struct io_uring ring;
    int have_files;
    unsigned char file_used[FILE_SLOTS];
    int have_bufs;
    pthread_mutex_t regmu;  /* bufs[].owner, and the kernel's buffer table */
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
    pthread_mutex_init(&st->regmu, NULL);
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
    pthread_mutex_destroy(&st->regmu);
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
    const ferry__sys *sys = ferry__sys_get();
    if (base && sys->uring_register) {
        int r = sys->uring_register(sys->ctx, i, base, len);
        if (r < 0)
            return r;
    }
    struct iovec iov = {base, len};
    int rc = io_uring_register_buffers_update_tag(&st->ring, i, &iov, NULL, 1);
    return rc == 1 ? 0 : rc < 0 ? rc : -EIO;
}

/* drop buf's slots (regmu held); published ones first leave the table
 * the submit path reads */
static int drop_slots(ur_st *st, const void *buf)
{
    int found = 0;
    for (unsigned i = 0; i < BUF_SLOTS; i++) {
        if (st->bufs[i].owner != buf)
            continue;
        atomic_store_explicit(&st->bufs[i].base, NULL, memory_order_release);
        set_buf_slot(st, i, NULL, 0);
        atomic_store_explicit(&st->bufs[i].len, 0, memory_order_relaxed);
        st->bufs[i].owner = NULL;
        found = 1;
    }
    return found;
}

static int ur_buf_unregister(ferry_io *io, void *buf)
{
    ur_st *st = io->eng;
    pthread_mutex_lock(&st->regmu);
    int found = drop_slots(st, buf);
    pthread_mutex_unlock(&st->regmu);
    if (!found)
        return ferry__err_set(&io->err, FERRY_ENOTFOUND, "io uring: buffer %p is not registered",
                              buf);
    return 0;
}

/* register buf's pieces in free slots (regmu held); published only once
 * the kernel took them all */
static int buf_register_locked(ferry_io *io, ur_st *st, char *buf, size_t len)
{
    /* registered already: the same length is a no-op, another (shorter
     * too: the slots hold the whole first one) is FERRY_EEXIST */
    size_t have = 0;
    for (unsigned i = 0; i < BUF_SLOTS; i++)
        if (st->bufs[i].owner == buf)
            have += atomic_load_explicit(&st->bufs[i].len, memory_order_relaxed);
    if (have == len)
        return 0;
    if (have)
        return ferry__err_set(&io->err, FERRY_EEXIST,
                              "io uring: buffer %p is already registered with another length "
                              "(%zu bytes, not %zu)", buf, have, len);
    size_t pieces = (len + BUF_PIECE - 1) / BUF_PIECE, free_slots = 0;
    for (unsigned i = 0; i < BUF_SLOTS; i++)
        free_slots += st->bufs[i].owner == NULL;
    if (pieces > free_slots)
        return ferry__err_set(&io->err, FERRY_ENOSPACE,
                              "io uring: buffer %p of %zu bytes needs %zu fixed-buffer slots, %zu "
                              "free of %u", buf, len, pieces, free_slots, BUF_SLOTS);
    unsigned slot[BUF_SLOTS], n = 0;
    size_t pos = 0;
    for (unsigned i = 0; i < BUF_SLOTS && pos < len; i++) {
        if (st->bufs[i].owner)
            continue;
        size_t k = FERRY__MIN(len - pos, BUF_PIECE);
        int rc = set_buf_slot(st, i, buf + pos, k);
        if (rc < 0) {
            drop_slots(st, buf); /* (never published: no submit saw them) */
            return ferry__err_set(&io->err, rc,
                                  "io uring: registering buffer %p (%zu bytes at +%zu) failed: "
                                  "%s (%s)", buf, k, pos, ferry_err_name(rc), strerror(-rc));
        }
        st->bufs[i].owner = buf;
        atomic_store_explicit(&st->bufs[i].len, k, memory_order_relaxed);
        slot[n++] = i;
        pos += k;
    }
    for (unsigned j = 0; j < n; j++) /* the whole buffer is the kernel's: publish */
        atomic_store_explicit(&st->bufs[slot[j]].base, buf + (size_t)j * BUF_PIECE,
                              memory_order_release);
    return 0;
}

static int ur_buf_register(ferry_io *io, void *buf, size_t len)
{
    ur_st *st = io->eng;
    if (!st->have_bufs)
        return ferry__err_set(&io->err, FERRY_ENOTSUP,
                              "io uring: the kernel refused a fixed-buffer table; buffer %p of "
                              "%zu bytes not registered", buf, len);
    pthread_mutex_lock(&st->regmu);
    int rc = buf_register_locked(io, st, buf, len);
    pthread_mutex_unlock(&st->regmu);
    return rc;
}

/* the published slot holding [p, p + len), or -1 (see the top: base with
 * acquire, then its len) */
static int find_buf(const ur_st *st, const char *p, size_t len)
{
    for (unsigned i = 0; i < BUF_SLOTS; i++) {
        const ur_buf *b = &st->bufs[i];
        const char *base = atomic_load_explicit(&b->base, memory_order_acquire);
        if (base && p >= base && p + len <= base + atomic_load_explicit(&b->len,
                                                                       memory_order_relaxed))
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
