/*
 * gdsdl.c - a GDS driver over any library shaped like cuFile, loaded with
 * dlopen: cuFile (NVIDIA, libcufile.so.0) and hipFile (AMD, libhipfile.so,
 * whose hipFile* calls mirror cuFile's one to one). drv_cufile.c and
 * drv_hipfile.c only name the library and the symbol prefix.
 *
 * Invariants: nothing is resolved or opened until a context opens the
 * driver, so building and loading ferry never needs the library; every
 * call the library lacks (stream and async calls before cuFile 1.7)
 * answers FERRY_ENOTSUP, on which the context falls back; every cuFile
 * error becomes a ferry code (the I/O layer's ferry__cufile_code) and a
 * message that names the call, the error number and its meaning (NVIDIA's
 * own error-string function is inline in cufile.h, so it is not in the
 * library to be called).
 *
 * The library itself is the I/O layer's (io/cufile_lib.c): loaded once
 * per process, its driver opened by the first user and closed after the
 * last, so a process with cufile I/O engines and cufile GDS contexts
 * loads and initializes cuFile once. The function table is the I/O
 * layer's ferry__cufile_api, so one fake table drives both the cufile
 * I/O engine and these drivers in tests.
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/types.h>
#include <time.h>

#include "core.h"
#include "driver.h"
#include "io/cufile_api.h"

_Static_assert(sizeof(off_t) == sizeof(int64_t), "cuFile offsets are 64-bit off_t");
_Static_assert(sizeof(ssize_t) == sizeof(int64_t), "cuFile byte counts are 64-bit ssize_t");

#define BATCH_MAX 128 /* cufile.json io_batchsize default */

typedef struct dl_drv {
    const ferry__gdsdl_spec *spec;
    const ferry__cufile_api *api; /* the table this driver opened with */
    int driver_open;
} dl_drv;

void ferry__gdsdl_set_api(const char *driver_name, const struct ferry__cufile_api *api)
{
    const ferry__gds_backend *b = ferry__gds_backend_find(driver_name);
    if (b && b->dl)
        ferry__cufile_lib_set_api(b->dl->lib, api);
}

int ferry__gdsdl_probe(const ferry__gdsdl_spec *spec, ferry_device *dev)
{
    const char *be = dev ? ferry_device_backend(dev) : "none";
    if (!strcmp(be, "cuda"))
        return 1;
    const ferry__cufile_api *a = ferry__cufile_lib_test_api(spec->lib);
    return a && a->allow_host_device;
}

/* a failed cuFile call's error as a ferry code, with a message */
static int fail(dl_drv *d, const char *call, ferry__CUfileError_t e, const char *what)
{
    int code = ferry__cufile_code(e.err);
    if (code == 0)
        code = FERRY_EDRIVER;
    return ferry__err_set(NULL, code, "%s%s(%s): cuFile error %d (%s)%s%d", d->spec->lib->prefix, call,
                          what, e.err, ferry__cufile_strerror(e.err),
                          e.err == FERRY__CU_FILE_CUDA_DRIVER_ERROR ? ", CUresult " : "",
                          e.err == FERRY__CU_FILE_CUDA_DRIVER_ERROR ? e.cu_err : 0);
}

static int dl_open(void *ctx, ferry_device *dev)
{
    dl_drv *d = ctx;
    ferry__cufile_lib *lib = d->spec->lib;
    const ferry__cufile_api *ov = ferry__cufile_lib_test_api(lib);
    const char *be = dev ? ferry_device_backend(dev) : "none";
    if (strcmp(be, "cuda") != 0 && !(ov && ov->allow_host_device))
        return ferry__err_set(NULL, FERRY_ENODEV,
                              "%s driver: needs a cuda device (the context's device is %s)",
                              d->spec->driver_name, be);
    char why[256] = "";
    const ferry__cufile_api *a = ferry__cufile_lib_api(lib, why, sizeof why);
    if (!a)
        return ferry__err_set(NULL, FERRY_ENODEV, "%s driver: %s", d->spec->driver_name, why);
    ferry__CUfileError_t e;
    if (ferry__cufile_lib_open(lib, a, &e) < 0) {
        int rc = fail(d, "DriverOpen", e, "");
        return rc == FERRY_EDRIVER ? FERRY_ENODEV : rc;
    }
    d->api = a;
    d->driver_open = 1;
    return 0;
}

static void dl_close(void *ctx)
{
    dl_drv *d = ctx;
    if (d->driver_open) {
        ferry__CUfileError_t e;
        ferry__cufile_lib_close(d->spec->lib, d->api, &e);
        if (e.err != 0)
            FERRY_LOGW("%s driver: %sDriverClose: error %d (%s)", d->spec->driver_name,
                       d->spec->lib->prefix, e.err, ferry__cufile_strerror(e.err));
    }
    d->driver_open = 0;
}

static int dl_handle_register(void *ctx, ferry_io *io, ferry_file *f, void **handle)
{
    dl_drv *d = ctx;
    (void)io;
    ferry__CUfileDescr_t desc;
    memset(&desc, 0, sizeof desc);
    desc.type = FERRY__CU_FILE_HANDLE_TYPE_OPAQUE_FD;
    desc.handle.fd = ferry_file_fd(f);
    ferry__CUfileHandle_t fh = NULL;
    ferry__CUfileError_t e = d->api->HandleRegister(&fh, &desc);
    if (e.err != 0)
        return fail(d, "HandleRegister", e, ferry_file_path(f));
    *handle = fh;
    return 0;
}

static void dl_handle_deregister(void *ctx, void *handle)
{
    ((dl_drv *)ctx)->api->HandleDeregister(handle);
}

static int dl_buf_register(void *ctx, ferry_devptr base, size_t len, int flags)
{
    dl_drv *d = ctx;
    ferry__CUfileError_t e = d->api->BufRegister((const void *)(uintptr_t)base, len, flags);
    if (e.err != 0) {
        char w[64];
        snprintf(w, sizeof w, "0x%llx, %zu", (unsigned long long)base, len);
        return fail(d, "BufRegister", e, w);
    }
    return 0;
}

static int dl_buf_deregister(void *ctx, ferry_devptr base)
{
    dl_drv *d = ctx;
    ferry__CUfileError_t e = d->api->BufDeregister((const void *)(uintptr_t)base);
    if (e.err != 0) {
        char w[32];
        snprintf(w, sizeof w, "0x%llx", (unsigned long long)base);
        return fail(d, "BufDeregister", e, w);
    }
    return 0;
}

static int dl_stream_register(void *ctx, ferry_stream *s, uint64_t raw, unsigned flags)
{
    dl_drv *d = ctx;
    (void)s;
    if (!d->api->StreamRegister)
        return FERRY_ENOTSUP;
    ferry__CUfileError_t e = d->api->StreamRegister((void *)(uintptr_t)raw, flags);
    if (e.err != 0) {
        char w[48];
        snprintf(w, sizeof w, "stream 0x%llx, flags 0x%x", (unsigned long long)raw, flags);
        return fail(d, "StreamRegister", e, w);
    }
    return 0;
}

static int dl_stream_deregister(void *ctx, ferry_stream *s, uint64_t raw)
{
    dl_drv *d = ctx;
    (void)s;
    if (!d->api->StreamDeregister)
        return FERRY_ENOTSUP;
    ferry__CUfileError_t e = d->api->StreamDeregister((void *)(uintptr_t)raw);
    if (e.err != 0) {
        char w[32];
        snprintf(w, sizeof w, "stream 0x%llx", (unsigned long long)raw);
        return fail(d, "StreamDeregister", e, w);
    }
    return 0;
}

static int64_t io_ret(dl_drv *d, const char *call, ssize_t ret, int saved_errno, size_t size,
                      int64_t file_off)
{
    if (ret >= 0)
        return ret;
    int code = ferry__cufile_ret_code(ret, saved_errno);
    return ferry__err_set(NULL, code, "%s%s of %zu bytes at file offset %lld: %s%s", d->spec->lib->prefix,
                          call, size, (long long)file_off,
                          ret == -1 ? "errno " : "cuFile error ",
                          ret == -1 ? strerror(saved_errno ? saved_errno : EIO)
                                    : ferry__cufile_strerror((int)-ret));
}

static int64_t dl_read(void *ctx, void *handle, ferry_devptr base, size_t size, int64_t file_off,
                       int64_t buf_off)
{
    dl_drv *d = ctx;
    errno = 0;
    ssize_t r = d->api->Read(handle, (void *)(uintptr_t)base, size, (off_t)file_off, (off_t)buf_off);
    return io_ret(d, "Read", r, errno, size, file_off);
}

static int64_t dl_write(void *ctx, void *handle, ferry_devptr base, size_t size, int64_t file_off,
                        int64_t buf_off)
{
    dl_drv *d = ctx;
    errno = 0;
    ssize_t r =
        d->api->Write(handle, (const void *)(uintptr_t)base, size, (off_t)file_off, (off_t)buf_off);
    return io_ret(d, "Write", r, errno, size, file_off);
}

static int dl_async(dl_drv *d, int op, void *handle, ferry_devptr base, size_t *size,
                    int64_t *file_off, int64_t *buf_off, int64_t *done, ferry_stream *s)
{
    ferry__CUfileError_t (*fn)(ferry__CUfileHandle_t, void *, size_t *, off_t *, off_t *,
                               ssize_t *, void *) =
        op == FERRY_GDS_READ ? d->api->ReadAsync : d->api->WriteAsync;
    if (!fn)
        return FERRY_ENOTSUP;
    void *raw = s ? (void *)(uintptr_t)ferry_stream_handle(s) : NULL;
    ferry__CUfileError_t e = fn(handle, (void *)(uintptr_t)base, size, (off_t *)file_off,
                                (off_t *)buf_off, (ssize_t *)done, raw);
    if (e.err != 0) {
        char w[96];
        snprintf(w, sizeof w, "%zu bytes at file offset %lld", *size, (long long)*file_off);
        return fail(d, op == FERRY_GDS_READ ? "ReadAsync" : "WriteAsync", e, w);
    }
    return 0;
}

static int dl_read_async(void *ctx, void *handle, ferry_devptr base, size_t *size,
                         int64_t *file_off, int64_t *buf_off, int64_t *done, ferry_stream *s)
{
    return dl_async(ctx, FERRY_GDS_READ, handle, base, size, file_off, buf_off, done, s);
}

static int dl_write_async(void *ctx, void *handle, ferry_devptr base, size_t *size,
                          int64_t *file_off, int64_t *buf_off, int64_t *done, ferry_stream *s)
{
    return dl_async(ctx, FERRY_GDS_WRITE, handle, base, size, file_off, buf_off, done, s);
}

/* up to BATCH_MAX I/Os: set up, submit, collect every event, destroy */
static int batch_once(dl_drv *d, ferry_gds_io *ios, unsigned n)
{
    ferry__CUfileBatchHandle_t id = NULL;
    ferry__CUfileError_t e = d->api->BatchIOSetUp(&id, n);
    if (e.err != 0)
        return fail(d, "BatchIOSetUp", e, "");
    ferry__CUfileIOParams_t p[BATCH_MAX];
    for (unsigned i = 0; i < n; i++) {
        memset(&p[i], 0, sizeof p[i]);
        p[i].mode = FERRY__CUFILE_BATCH;
        p[i].u.batch.devPtr_base = (void *)(uintptr_t)ios[i].base;
        p[i].u.batch.file_offset = (off_t)ios[i].file_off;
        p[i].u.batch.devPtr_offset = (off_t)ios[i].buf_off;
        p[i].u.batch.size = ios[i].size;
        p[i].fh = ios[i].handle;
        p[i].opcode = ios[i].op == FERRY_GDS_READ ? FERRY__CUFILE_READ : FERRY__CUFILE_WRITE;
        p[i].cookie = &ios[i];
        ios[i].result = FERRY_EDRIVER;
    }
    e = d->api->BatchIOSubmit(id, n, p, 0);
    if (e.err != 0) {
        int rc = fail(d, "BatchIOSubmit", e, "");
        d->api->BatchIODestroy(id);
        return rc;
    }
    unsigned got = 0;
    int rc = 0;
    while (got < n) {
        ferry__CUfileIOEvents_t ev[BATCH_MAX];
        unsigned nr = n - got;
        struct timespec to = {1, 0};
        e = d->api->BatchIOGetStatus(id, 1, &nr, ev, &to);
        if (e.err != 0) {
            rc = fail(d, "BatchIOGetStatus", e, "");
            if (d->api->BatchIOCancel)
                d->api->BatchIOCancel(id);
            break;
        }
        for (unsigned i = 0; i < nr; i++) {
            ferry_gds_io *io = ev[i].cookie;
            io->result = ev[i].status == FERRY__CUFILE_COMPLETE ? (int64_t)ev[i].ret
                         : ev[i].status == FERRY__CUFILE_CANCELED ? -ECANCELED
                                                                  : FERRY_EDRIVER;
            if (io->result < 0 && rc == 0)
                rc = ferry__err_set(NULL, (int)io->result,
                                    "%sBatchIO: %s of %zu bytes at file offset %lld: status 0x%x",
                                    d->spec->lib->prefix, io->op == FERRY_GDS_READ ? "read" : "write",
                                    io->size, (long long)io->file_off, ev[i].status);
        }
        got += nr;
    }
    d->api->BatchIODestroy(id);
    return rc;
}

static int dl_batch(void *ctx, ferry_gds_io *ios, unsigned n)
{
    dl_drv *d = ctx;
    if (!d->api->BatchIOSetUp || !d->api->BatchIOSubmit || !d->api->BatchIOGetStatus ||
        !d->api->BatchIODestroy)
        return FERRY_ENOTSUP;
    int rc = 0;
    for (unsigned i = 0; i < n; i += BATCH_MAX) {
        int r = batch_once(d, ios + i, FERRY__MIN(n - i, (unsigned)BATCH_MAX));
        if (r < 0 && rc == 0)
            rc = r;
    }
    return rc;
}

static void dl_destroy(void *ctx)
{
    ferry__free(ctx);
}

int ferry__gdsdl_driver(const ferry__gdsdl_spec *spec, ferry_gds_driver *out,
                        ferry__gds_destroy_fn *destroy)
{
    dl_drv *d = ferry__calloc(1, sizeof *d);
    if (!d)
        return ferry__err_set(NULL, -ENOMEM, "%s driver: out of memory", spec->driver_name);
    d->spec = spec;
    *out = (ferry_gds_driver){
        .size = sizeof(ferry_gds_driver),
        .name = spec->driver_name,
        .ctx = d,
        .open = dl_open,
        .close = dl_close,
        .handle_register = dl_handle_register,
        .handle_deregister = dl_handle_deregister,
        .buf_register = dl_buf_register,
        .buf_deregister = dl_buf_deregister,
        .stream_register = dl_stream_register,
        .stream_deregister = dl_stream_deregister,
        .read = dl_read,
        .write = dl_write,
        .read_async = dl_read_async,
        .write_async = dl_write_async,
        .batch = dl_batch,
    };
    *destroy = dl_destroy;
    return 0;
}
