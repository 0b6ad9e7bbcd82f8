/*
 * cufile.c - the GPUDirect Storage engine: NVIDIA cuFile through dlopen.
 *
 * Invariant: a part with device memory on a file whose cuFile handle is
 * registered goes to the GPU by DMA (a batch entry); everything else
 * (host memory, files whose registration failed) goes to an embedded posix
 * pool, so one engine serves both kinds and the caller never has to know
 * which path a file ended up on. Every part handed to submit comes back
 * from wait exactly once: failures at submit time are queued as
 * completions, never returned to the front half-taken.
 *
 * I/O is issued with the base of a registered region plus a buffer offset,
 * never an interior pointer (cuFile looks registrations up by base), and
 * in pieces of at most max_request (16 MiB, cufile.json's
 * max_direct_io_size_kb). Batches are set up lazily, at most io_batchsize
 * (128) entries each, and reused once all their entries completed.
 *
 * libcufile.so.0 is loaded once per process and never unloaded; the
 * driver is opened by the first user (engine or GDS context) and closed by
 * the last: cufile_lib.c does both, for this engine and the GDS cufile
 * driver alike. All of it sits behind one table of functions that a test
 * replaces with fakes (ferry__cufile_set_api), which is how this file is
 * tested on machines without a GPU.
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "cufile_api.h"
#include "device/cuda_api.h"
#include "io_impl.h"
#include "sys.h"

#define CF_MAX_REQUEST ((size_t)16 << 20)
#define CF_BATCH_MAX 128u
#define CF_REGS 64u
#define CF_STREAMS 16u
#define CF_STREAM_FLAGS                                                                       \
    (FERRY__CU_FILE_STREAM_FIXED_BUF_OFFSET | FERRY__CU_FILE_STREAM_FIXED_FILE_OFFSET |       \
     FERRY__CU_FILE_STREAM_FIXED_FILE_SIZE)

/* ---- the library: loaded and its driver opened once per process, for
 * these engines and the GDS cufile driver alike (cufile_lib.c) ---- */
#define CF_LIB (&ferry__cufile_lib_nv)

/* the table in force, with the batch API the engine is built on; or NULL
 * with why[] filled */
static const ferry__cufile_api *get_api(char *why, size_t why_len)
{
    const ferry__cufile_api *a = ferry__cufile_lib_api(CF_LIB, why, why_len);
    if (a && !(a->BatchIOSetUp && a->BatchIOSubmit && a->BatchIOGetStatus && a->BatchIOCancel &&
               a->BatchIODestroy)) {
        if (why)
            snprintf(why, why_len, "libcufile.so.0 lacks cuFileBatchIO* (too old?)");
        return NULL;
    }
    return a;
}

static int driver_ref(const ferry__cufile_api *a, char *why, size_t why_len)
{
    ferry__CUfileError_t e;
    if (ferry__cufile_lib_open(CF_LIB, a, &e) == 0)
        return 0;
    snprintf(why, why_len, "cuFileDriverOpen failed: %d (%s)%s", e.err,
             ferry__cufile_strerror(e.err),
             e.err == FERRY__CU_FILE_CUDA_DRIVER_ERROR ? " (no usable CUDA driver)" : "");
    int rc = e.err == FERRY__CU_FILE_CUDA_DRIVER_ERROR ? FERRY_ENODEV : ferry__cufile_code(e.err);
    if (rc == FERRY_EDRIVER || rc == FERRY_ENOTSUP)
        rc = FERRY_ENODEV;
    return rc;
}

static void driver_unref(const ferry__cufile_api *a)
{
    ferry__CUfileError_t e;
    ferry__cufile_lib_close(CF_LIB, a, &e);
    if (e.err != 0)
        FERRY_LOGW("io cufile: cuFileDriverClose: %d (%s)", e.err, ferry__cufile_strerror(e.err));
}

int ferry__cufile_probe(char *why, size_t why_len)
{
    const ferry__cufile_api *a = get_api(why, why_len);
    if (!a)
        return FERRY_ENODEV;
    int rc = driver_ref(a, why, why_len);
    if (rc < 0)
        return rc;
    driver_unref(a);
    snprintf(why, why_len, "libcufile.so.0 loaded and cuFileDriverOpen succeeded");
    return 0;
}

/* ---- engine state ---- */
typedef struct cf_reg {
    ferry_devptr base;
    size_t len;
} cf_reg;

typedef struct cf_batch {
    ferry__CUfileBatchHandle_t id;
    int setup;
    unsigned outstanding;
    ferry__CUfileIOParams_t params[CF_BATCH_MAX];
    ferry__CUfileIOEvents_t events[CF_BATCH_MAX];
} cf_batch;

typedef struct cf_st {
    const ferry__cufile_api *api;
    void *cpu; /* posix pool for host memory and fallback files */
    unsigned cpu_busy;
    cf_reg regs[CF_REGS];
    void *streams[CF_STREAMS];
    unsigned nstreams;
    cf_batch *batches;
    unsigned nbatches;
    unsigned batch_cap;
    unsigned gpu_busy;
    ferry__part *imm_head, *imm_tail; /* failed at submit: handed back by wait */
} cf_st;

/*
 * cuFile works in the calling thread's CUDA context: make the device's
 * context current before each group of cuFile calls (a thread-local store,
 * as the device layer does before its own driver calls). Nothing to do
 * for the host device the fake tests use.
 */
static void ctx_enter(ferry_io *io)
{
    ferry__CUcontext c = ferry__cuda_context(io->device);
    const struct ferry__cuda_api *api = NULL;
    if (c && ferry__cuda_load(&api) == 0 && api->p_cuCtxSetCurrent(c) != 0)
        FERRY_LOGW("io cufile: cuCtxSetCurrent failed; cuFile may not see the device");
}

static unsigned cf_slots(unsigned depth)
{
    return depth * 2;
}

static int cf_init(ferry_io *io)
{
    char why[256] = "";
    const ferry__cufile_api *a = get_api(why, sizeof why);
    if (!a)
        return ferry__err_set(&io->err, FERRY_ENODEV, "io cufile: %s", why);
    if (!io->device)
        return ferry__err_set(&io->err, FERRY_ENODEV,
                              "io cufile: needs a cuda device in ferry_io_options.device");
    if (strcmp(ferry_device_backend(io->device), "cuda") != 0 && !a->allow_host_device)
        return ferry__err_set(&io->err, FERRY_ENODEV,
                              "io cufile: the device backend is %s; cuFile needs cuda",
                              ferry_device_backend(io->device));
    cf_st *st = ferry__calloc(1, sizeof *st);
    unsigned nb = (io->nparts + CF_BATCH_MAX - 1) / CF_BATCH_MAX + io->nparts;
    cf_batch *b = ferry__calloc(nb, sizeof *b);
    if (!st || !b) {
        ferry__free(st);
        ferry__free(b);
        return ferry__err_set(&io->err, -ENOMEM, "io cufile: out of memory");
    }
    st->api = a;
    st->batches = b;
    st->nbatches = nb;
    st->batch_cap = FERRY__MIN(io->nparts, CF_BATCH_MAX);
    ctx_enter(io);
    int rc = driver_ref(a, why, sizeof why);
    if (rc < 0) {
        ferry__free(b);
        ferry__free(st);
        return ferry__err_set(&io->err, rc, "io cufile: %s", why);
    }
    rc = ferry__posix_create(io, io->depth, &st->cpu);
    if (rc < 0) {
        driver_unref(a);
        ferry__free(b);
        ferry__free(st);
        return rc;
    }
    io->eng = st;
    return 0;
}

static void cf_fini(ferry_io *io)
{
    cf_st *st = io->eng;
    if (!st)
        return;
    const ferry__cufile_api *a = st->api;
    for (unsigned i = 0; i < st->nbatches; i++)
        if (st->batches[i].setup)
            a->BatchIODestroy(st->batches[i].id);
    for (unsigned i = 0; i < CF_REGS; i++)
        if (st->regs[i].base) {
            ferry__CUfileError_t e = a->BufDeregister((const void *)(uintptr_t)st->regs[i].base);
            if (e.err)
                FERRY_LOGW("io cufile: cuFileBufDeregister(0x%llx): %d (%s)",
                           (unsigned long long)st->regs[i].base, e.err,
                           ferry__cufile_strerror(e.err));
        }
    for (unsigned i = 0; i < st->nstreams; i++)
        if (a->StreamDeregister)
            a->StreamDeregister(st->streams[i]);
    ferry__posix_destroy(st->cpu);
    driver_unref(a);
    ferry__free(st->batches);
    ferry__free(st);
    io->eng = NULL;
}

static int cf_file_open(ferry_io *io, ferry_file *f)
{
    cf_st *st = io->eng;
    ctx_enter(io);
    ferry__CUfileDescr_t d;
    memset(&d, 0, sizeof d);
    d.type = FERRY__CU_FILE_HANDLE_TYPE_OPAQUE_FD;
    d.handle.fd = f->fd;
    ferry__CUfileHandle_t fh = NULL;
    ferry__CUfileError_t e = st->api->HandleRegister(&fh, &d);
    if (e.err != 0) {
        size_t used = strlen(f->fallback); /* keep an O_DIRECT fallback's reason */
        snprintf(f->fallback + used, sizeof f->fallback - used,
                 "%scuFile handle registration failed: %d (%s)%s; device transfers take the CPU "
                 "bounce path", used ? "; " : "", e.err, ferry__cufile_strerror(e.err),
                 e.err == FERRY__CU_FILE_INTERNAL_ERROR || e.err == FERRY__CU_FILE_IO_NOT_SUPPORTED
                     ? " (overlayfs, LVM, or no /run/udev in a container?)"
                     : "");
        FERRY_LOGW("file %s: %s", f->path, f->fallback);
        return 0;
    }
    f->eng = fh;
    f->gds = 1;
    return 0;
}

static void cf_file_close(ferry_io *io, ferry_file *f)
{
    cf_st *st = io->eng;
    if (f->gds)
        st->api->HandleDeregister(f->eng);
    f->gds = 0;
    f->eng = NULL;
}

static int cf_dev_ok(ferry_io *io, const ferry_file *f)
{
    (void)io;
    return f->gds;
}

static int cf_dev_register(ferry_io *io, ferry_devptr p, size_t len)
{
    cf_st *st = io->eng;
    int slot = -1;
    for (unsigned i = 0; i < CF_REGS; i++) {
        if (st->regs[i].base == p)
            return ferry__err_set(&io->err, FERRY_EEXIST,
                                  "io cufile: device buffer 0x%llx is already registered",
                                  (unsigned long long)p);
        if (!st->regs[i].base && slot < 0)
            slot = (int)i;
    }
    if (slot < 0)
        return ferry__err_set(&io->err, FERRY_ENOSPACE,
                              "io cufile: all %u buffer registrations in use",
                              CF_REGS);
    ctx_enter(io);
    ferry__CUfileError_t e = st->api->BufRegister((const void *)(uintptr_t)p, len, 0);
    if (e.err != 0)
        return ferry__err_set(&io->err, ferry__cufile_code(e.err),
                              "io cufile: cuFileBufRegister(0x%llx, %zu bytes) failed: %d (%s)",
                              (unsigned long long)p, len, e.err, ferry__cufile_strerror(e.err));
    st->regs[slot].base = p;
    st->regs[slot].len = len;
    return 0;
}

static int cf_dev_unregister(ferry_io *io, ferry_devptr p)
{
    cf_st *st = io->eng;
    for (unsigned i = 0; i < CF_REGS; i++) {
        if (st->regs[i].base != p)
            continue;
        ferry__CUfileError_t e = st->api->BufDeregister((const void *)(uintptr_t)p);
        st->regs[i].base = 0;
        st->regs[i].len = 0;
        if (e.err != 0)
            return ferry__err_set(&io->err, ferry__cufile_code(e.err),
                                  "io cufile: cuFileBufDeregister(0x%llx) failed: %d (%s)",
                                  (unsigned long long)p, e.err, ferry__cufile_strerror(e.err));
        return 0;
    }
    return ferry__err_set(&io->err, FERRY_ENOTFOUND,
                          "io cufile: device buffer 0x%llx is not registered",
                          (unsigned long long)p);
}

/* base and offset for [p, p+len): the registered region holding it, or p itself */
static ferry_devptr region_base(const cf_st *st, ferry_devptr p, size_t len, size_t *room)
{
    for (unsigned i = 0; i < CF_REGS; i++) {
        const cf_reg *r = &st->regs[i];
        if (r->base && p >= r->base && p < r->base + r->len) {
            if (room)
                *room = (size_t)(r->base + r->len - p);
            if (!room && p + len > r->base + r->len)
                break; /* crosses the region's end: unregistered I/O */
            return r->base;
        }
    }
    if (room)
        *room = len;
    return p;
}

static void imm_push(cf_st *st, ferry__part *p, int64_t res)
{
    p->res = res;
    p->next = NULL;
    if (st->imm_tail)
        st->imm_tail->next = p;
    else
        st->imm_head = p;
    st->imm_tail = p;
}

static cf_batch *free_batch(ferry_io *io, cf_st *st, int *err)
{
    for (unsigned i = 0; i < st->nbatches; i++) {
        cf_batch *b = &st->batches[i];
        if (b->outstanding)
            continue;
        if (!b->setup) {
            ferry__CUfileError_t e = st->api->BatchIOSetUp(&b->id, st->batch_cap);
            if (e.err != 0) {
                *err = ferry__err_set(&io->err, ferry__cufile_code(e.err),
                                      "io cufile: cuFileBatchIOSetUp(%u) failed: %d (%s)",
                                      st->batch_cap, e.err, ferry__cufile_strerror(e.err));
                return NULL;
            }
            b->setup = 1;
        }
        return b;
    }
    *err = ferry__err_set(&io->err, FERRY_ENOSPACE, "io cufile: no free batch");
    return NULL;
}

static void submit_gpu(ferry_io *io, cf_st *st, ferry__part **parts, unsigned n)
{
    unsigned i = 0;
    while (i < n) {
        int err = 0;
        cf_batch *b = free_batch(io, st, &err);
        unsigned k = FERRY__MIN(n - i, st->batch_cap);
        if (!b) {
            for (unsigned j = 0; j < k; j++)
                imm_push(st, parts[i + j], err);
            i += k;
            continue;
        }
        for (unsigned j = 0; j < k; j++) {
            ferry__part *p = parts[i + j];
            ferry__CUfileIOParams_t *q = &b->params[j];
            ferry_devptr base = region_base(st, p->dev, p->len, NULL);
            memset(q, 0, sizeof *q);
            q->mode = FERRY__CUFILE_BATCH;
            q->u.batch.devPtr_base = (void *)(uintptr_t)base;
            q->u.batch.devPtr_offset = (off_t)(p->dev - base);
            q->u.batch.file_offset = (off_t)p->off;
            q->u.batch.size = p->len;
            q->fh = p->file->eng;
            q->opcode = p->op == FERRY_IO_READ ? FERRY__CUFILE_READ : FERRY__CUFILE_WRITE;
            q->cookie = p;
            p->eng[0] = (uint64_t)(b - st->batches);
        }
        ferry__CUfileError_t e = st->api->BatchIOSubmit(b->id, k, b->params, 0);
        if (e.err != 0) {
            int code = ferry__cufile_code(e.err);
            FERRY_LOGW("io cufile: cuFileBatchIOSubmit of %u entries failed: %d (%s)", k, e.err,
                       ferry__cufile_strerror(e.err));
            for (unsigned j = 0; j < k; j++)
                imm_push(st, parts[i + j], code);
        } else {
            b->outstanding = k;
            st->gpu_busy += k;
        }
        i += k;
    }
}

static int cf_submit(ferry_io *io, ferry__part **parts, unsigned n)
{
    cf_st *st = io->eng;
    /* stable partition: device parts on GDS files first, the CPU rest after */
    unsigned ng = 0;
    for (unsigned i = 0; i < n; i++)
        if (!parts[i]->buf && parts[i]->file->gds) {
            ferry__part *t = parts[i];
            memmove(&parts[ng + 1], &parts[ng], (i - ng) * sizeof *parts);
            parts[ng++] = t;
        }
    if (ng) {
        ctx_enter(io);
        submit_gpu(io, st, parts, ng);
    }
    if (n > ng) {
        ferry__posix_submit(st->cpu, parts + ng, n - ng);
        st->cpu_busy += n - ng;
    }
    return (int)n;
}

static int64_t event_result(const ferry__CUfileIOEvents_t *ev)
{
    switch (ev->status) {
    case FERRY__CUFILE_COMPLETE:
        return (int64_t)ev->ret;
    case FERRY__CUFILE_FAILED: {
        ssize_t r = (ssize_t)ev->ret;
        if (r < 0) {
            FERRY_LOGW("io cufile: batch entry failed: %zd (%s)", r,
                       r == -1 ? "errno" : ferry__cufile_strerror((int)-r));
            return r == -1 ? -EIO : ferry__cufile_code((int)-r);
        }
        return FERRY_EDRIVER;
    }
    case FERRY__CUFILE_CANCELED:
        return -ECANCELED;
    case FERRY__CUFILE_TIMEOUT:
        return -ETIMEDOUT;
    case FERRY__CUFILE_INVALID:
        return -EINVAL;
    default:
        return FERRY_EDRIVER;
    }
}

/* collect finished entries of batch b (waiting for min of them up to ns) */
static unsigned poll_batch(ferry_io *io, cf_st *st, cf_batch *b, ferry__part **out, unsigned max,
                           unsigned min, uint64_t ns)
{
    if (!b->outstanding || !max)
        return 0;
    unsigned nr = FERRY__MIN(max, b->outstanding);
    if (min > nr)
        min = nr;
    struct timespec ts = {(time_t)(ns / 1000000000ull), (long)(ns % 1000000000ull)};
    ferry__CUfileError_t e = st->api->BatchIOGetStatus(b->id, min, &nr, b->events, &ts);
    if (e.err != 0) {
        /* the batch is unusable: fail what it holds rather than hang */
        int code = ferry__cufile_code(e.err);
        ferry__err_set(&io->err, code, "io cufile: cuFileBatchIOGetStatus failed: %d (%s); "
                       "cancelling %u entries", e.err, ferry__cufile_strerror(e.err),
                       b->outstanding);
        st->api->BatchIOCancel(b->id);
        st->api->BatchIODestroy(b->id);
        b->setup = 0;
        for (unsigned i = 0; i < st->batch_cap; i++) {
            ferry__part *p = b->params[i].cookie;
            b->params[i].cookie = NULL;
            if (p)
                imm_push(st, p, code);
        }
        st->gpu_busy -= b->outstanding;
        b->outstanding = 0;
        return 0;
    }
    unsigned k = 0;
    for (unsigned i = 0; i < nr && i < max; i++) {
        ferry__CUfileIOEvents_t *ev = &b->events[i];
        if (ev->status == FERRY__CUFILE_WAITING || ev->status == FERRY__CUFILE_PENDING)
            continue;
        ferry__part *p = ev->cookie;
        if (!p)
            continue;
        for (unsigned j = 0; j < st->batch_cap; j++)
            if (b->params[j].cookie == p) {
                b->params[j].cookie = NULL;
                break;
            }
        p->res = event_result(ev);
        out[k++] = p;
        b->outstanding--;
        st->gpu_busy--;
    }
    return k;
}

static unsigned take_imm(cf_st *st, ferry__part **out, unsigned max)
{
    unsigned k = 0;
    while (k < max && st->imm_head) {
        ferry__part *p = st->imm_head;
        st->imm_head = p->next;
        if (!st->imm_head)
            st->imm_tail = NULL;
        p->next = NULL;
        out[k++] = p;
    }
    return k;
}

static int cf_wait(ferry_io *io, ferry__part **out, unsigned min, unsigned max, int timeout_ms)
{
    cf_st *st = io->eng;
    uint64_t deadline = timeout_ms > 0 ? ferry__now_ns() + (uint64_t)timeout_ms * 1000000ull : 0;
    unsigned k = 0;
    for (;;) {
        k += take_imm(st, out + k, max - k);
        if (st->cpu_busy && k < max) {
            int c = ferry__posix_wait(st->cpu, out + k, 0, max - k, 0);
            k += (unsigned)c;
            st->cpu_busy -= (unsigned)c;
        }
        for (unsigned i = 0; i < st->nbatches && k < max && st->gpu_busy; i++)
            k += poll_batch(io, st, &st->batches[i], out + k, max - k, 0, 0);
        if (st->imm_head)
            continue;
        if (k >= min || k >= max || timeout_ms == 0)
            break;
        uint64_t now = ferry__now_ns();
        if (timeout_ms > 0 && now >= deadline)
            break;
        uint64_t left = timeout_ms > 0 ? deadline - now : UINT64_MAX;
        if (st->gpu_busy) {
            /* block on one batch; a short slice when CPU parts also run */
            uint64_t slice = st->cpu_busy ? 1000000ull : FERRY__MIN(left, 100000000ull);
            for (unsigned i = 0; i < st->nbatches; i++)
                if (st->batches[i].outstanding) {
                    k += poll_batch(io, st, &st->batches[i], out + k, max - k, 1,
                                    FERRY__MIN(slice, left));
                    break;
                }
        } else if (st->cpu_busy) {
            int ms = timeout_ms < 0 ? -1 : (int)((left + 999999) / 1000000);
            int c = ferry__posix_wait(st->cpu, out + k, min - k, max - k, ms);
            k += (unsigned)c;
            st->cpu_busy -= (unsigned)c;
        } else
            break;
    }
    return (int)k;
}

/* ---- synchronous device transfers ---- */
static int sync_rw(ferry_io *io, cf_st *st, ferry_file *f, int op, ferry_devptr p, size_t len,
                   uint64_t off)
{
    size_t pos = 0;
    unsigned zero = 0;
    while (pos < len) {
        size_t room = 0;
        ferry_devptr base = region_base(st, p + pos, len - pos, &room);
        size_t n = FERRY__MIN(FERRY__MIN(len - pos, io->max_request), room);
        errno = 0;
        ssize_t r = op == FERRY_IO_READ
                        ? st->api->Read(f->eng, (void *)(uintptr_t)base, n, (off_t)(off + pos),
                                        (off_t)(p + pos - base))
                        : st->api->Write(f->eng, (const void *)(uintptr_t)base, n,
                                         (off_t)(off + pos), (off_t)(p + pos - base));
        int saved = errno;
        if (r < 0) {
            int code = ferry__cufile_ret_code(r, saved);
            return ferry__err_set(&io->err, code,
                                  "file %s: cuFile %s of %zu bytes at offset %llu (device 0x%llx) "
                                  "failed: %zd (%s)", f->path, ferry__op_name(op), n,
                                  (unsigned long long)(off + pos),
                                  (unsigned long long)(p + pos), r,
                                  r == -1 ? strerror(saved) : ferry__cufile_strerror((int)-r));
        }
        if (r == 0) {
            if (op == FERRY_IO_READ || ++zero > 8)
                return ferry__err_set(&io->err, FERRY_ESHORT,
                                      "file %s: cuFile %s of %zu bytes at offset %llu: %s", f->path,
                                      ferry__op_name(op), len, (unsigned long long)off,
                                      op == FERRY_IO_READ ? "end of file" : "no progress");
            continue;
        }
        zero = 0;
        pos += (size_t)r > n ? n : (size_t)r;
    }
    return 0;
}

static void *stream_reg(ferry_io *io, cf_st *st, ferry_stream *s)
{
    void *cs = (void *)(uintptr_t)ferry_stream_handle(s);
    for (unsigned i = 0; i < st->nstreams; i++)
        if (st->streams[i] == cs)
            return cs;
    if (st->api->StreamRegister && st->nstreams < CF_STREAMS) {
        ferry__CUfileError_t e = st->api->StreamRegister(cs, CF_STREAM_FLAGS);
        if (e.err != 0)
            FERRY_LOGD("io cufile: cuFileStreamRegister: %d (%s); using the stream unregistered",
                       e.err, ferry__cufile_strerror(e.err));
        else
            st->streams[st->nstreams++] = cs;
    }
    (void)io;
    return cs;
}

#define CF_WINDOW 64u

static int cf_dev_rw(ferry_io *io, ferry_file *f, ferry_stream *s, int op, ferry_devptr p,
                     size_t len, uint64_t off)
{
    cf_st *st = io->eng;
    if (!f->gds)
        return FERRY_ENOTSUP;
    if (!s || !st->api->ReadAsync || !st->api->WriteAsync)
        return ferry__io_rw(io, f, op, NULL, p, len, off, len); /* batch API, depth in flight */
    ctx_enter(io);
    void *cs = stream_reg(io, st, s);
    /* cuFile reads these through pointers when the stream reaches the op:
     * they live until the stream is synchronized below */
    size_t sz[CF_WINDOW];
    off_t fo[CF_WINDOW], bo[CF_WINDOW];
    ssize_t dn[CF_WINDOW];
    ferry_devptr bases[CF_WINDOW];
    size_t pos = 0;
    while (pos < len) {
        unsigned n = 0;
        size_t wpos = pos;
        int err = 0;
        while (n < CF_WINDOW && pos < len) {
            size_t room = 0;
            ferry_devptr base = region_base(st, p + pos, len - pos, &room);
            sz[n] = FERRY__MIN(FERRY__MIN(len - pos, io->max_request), room);
            fo[n] = (off_t)(off + pos);
            bo[n] = (off_t)(p + pos - base);
            dn[n] = 0;
            bases[n] = base;
            ferry__CUfileError_t e =
                op == FERRY_IO_READ
                    ? st->api->ReadAsync(f->eng, (void *)(uintptr_t)base, &sz[n], &fo[n], &bo[n],
                                         &dn[n], cs)
                    : st->api->WriteAsync(f->eng, (void *)(uintptr_t)base, &sz[n], &fo[n], &bo[n],
                                          &dn[n], cs);
            if (e.err != 0) {
                err = ferry__err_set(&io->err, ferry__cufile_code(e.err),
                                     "file %s: cuFile%sAsync of %zu bytes at offset %llu failed: "
                                     "%d (%s)", f->path, op == FERRY_IO_READ ? "Read" : "Write",
                                     sz[n], (unsigned long long)fo[n], e.err,
                                     ferry__cufile_strerror(e.err));
                break;
            }
            pos += sz[n];
            n++;
        }
        int rc = ferry_stream_sync(s);
        if (err)
            return err;
        if (rc < 0)
            return ferry__err_pass(&io->err, rc);
        size_t q = wpos;
        for (unsigned i = 0; i < n; i++) {
            if (dn[i] < 0)
                return ferry__err_set(&io->err, ferry__cufile_ret_code(dn[i], EIO),
                                      "file %s: cuFile%sAsync of %zu bytes at offset %llu "
                                      "failed: %zd (%s)", f->path,
                                      op == FERRY_IO_READ ? "Read" : "Write", sz[i],
                                      (unsigned long long)fo[i], dn[i],
                                      dn[i] == -1 ? "errno" : ferry__cufile_strerror((int)-dn[i]));
            if ((size_t)dn[i] < sz[i]) { /* finish the piece synchronously */
                size_t d = (size_t)dn[i];
                rc = sync_rw(io, st, f, op, bases[i] + (ferry_devptr)bo[i] + d, sz[i] - d,
                             (uint64_t)fo[i] + d);
                if (rc < 0)
                    return rc;
            }
            q += sz[i];
        }
        (void)q;
    }
    return 0;
}

const ferry__io_ops ferry__io_cufile_ops = {
    .name = "cufile",
    .default_max_request = CF_MAX_REQUEST,
    .slots = cf_slots,
    .init = cf_init,
    .fini = cf_fini,
    .file_open = cf_file_open,
    .file_close = cf_file_close,
    .dev_register = cf_dev_register,
    .dev_unregister = cf_dev_unregister,
    .dev_ok = cf_dev_ok,
    .submit = cf_submit,
    .wait = cf_wait,
    .dev_rw = cf_dev_rw,
};
