/*
 * cufile_api.h - ferry's own declarations of the cuFile API (private).
 *
 * No cufile.h exists on build machines, so the types and functions of
 * libcufile.so.0 are declared here from NVIDIA's documentation (layouts as
 * in cufile.h; see docs facts section 3) and resolved with dlopen/dlsym at
 * run time, once per process (cufile_lib.c). The resolved functions live
 * in one table, which a test can replace with fakes (ferry__cufile_set_api)
 * to drive the whole cufile engine, and the GDS cufile driver, on a
 * machine with no GPU.
 */
#ifndef FERRY_SRC_IO_CUFILE_API_H
#define FERRY_SRC_IO_CUFILE_API_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <time.h>

typedef struct ferry__CUfileError {
    int err;    /* CUfileOpError: 0 success, 5000 + n */
    int cu_err; /* CUresult when err == 5011 */
} ferry__CUfileError_t;

typedef void *ferry__CUfileHandle_t;
typedef void *ferry__CUfileBatchHandle_t;

#define FERRY__CU_FILE_HANDLE_TYPE_OPAQUE_FD 1
typedef struct ferry__CUfileDescr {
    int type;
    union {
        int fd;
        void *handle;
    } handle;
    const void *fs_ops;
} ferry__CUfileDescr_t;

#define FERRY__CUFILE_BATCH 1
#define FERRY__CUFILE_READ 0
#define FERRY__CUFILE_WRITE 1
typedef struct ferry__CUfileIOParams {
    int mode;
    union {
        struct {
            void *devPtr_base;
            off_t file_offset;
            off_t devPtr_offset;
            size_t size;
        } batch;
    } u;
    ferry__CUfileHandle_t fh;
    int opcode;
    void *cookie;
} ferry__CUfileIOParams_t;

/* batch status */
#define FERRY__CUFILE_WAITING 0x1
#define FERRY__CUFILE_PENDING 0x2
#define FERRY__CUFILE_INVALID 0x4
#define FERRY__CUFILE_CANCELED 0x8
#define FERRY__CUFILE_COMPLETE 0x10
#define FERRY__CUFILE_TIMEOUT 0x20
#define FERRY__CUFILE_FAILED 0x40
typedef struct ferry__CUfileIOEvents {
    void *cookie;
    int status;
    size_t ret;
} ferry__CUfileIOEvents_t;

/* stream registration flags */
#define FERRY__CU_FILE_STREAM_FIXED_BUF_OFFSET 1u
#define FERRY__CU_FILE_STREAM_FIXED_FILE_OFFSET 2u
#define FERRY__CU_FILE_STREAM_FIXED_FILE_SIZE 4u
#define FERRY__CU_FILE_STREAM_PAGE_ALIGNED_INPUTS 8u

/* error numbers used by the engine's logic */
#define FERRY__CU_FILE_DRIVER_NOT_INITIALIZED 5001
#define FERRY__CU_FILE_IO_NOT_SUPPORTED 5008
#define FERRY__CU_FILE_CUDA_DRIVER_ERROR 5011
#define FERRY__CU_FILE_CUDA_POINTER_INVALID 5012
#define FERRY__CU_FILE_MEMORY_ALREADY_REGISTERED 5023
#define FERRY__CU_FILE_HANDLE_ALREADY_REGISTERED 5028
#define FERRY__CU_FILE_INTERNAL_ERROR 5030

typedef struct ferry__cufile_api {
    ferry__CUfileError_t (*DriverOpen)(void);
    ferry__CUfileError_t (*DriverClose)(void); /* cuFileDriverClose_v2 or cuFileDriverClose */
    ferry__CUfileError_t (*HandleRegister)(ferry__CUfileHandle_t *fh, ferry__CUfileDescr_t *d);
    void (*HandleDeregister)(ferry__CUfileHandle_t fh);
    ferry__CUfileError_t (*BufRegister)(const void *base, size_t len, int flags);
    ferry__CUfileError_t (*BufDeregister)(const void *base);
    ssize_t (*Read)(ferry__CUfileHandle_t fh, void *base, size_t size, off_t file_off,
                    off_t buf_off);
    ssize_t (*Write)(ferry__CUfileHandle_t fh, const void *base, size_t size, off_t file_off,
                     off_t buf_off);
    /* since cuFile 1.7; NULL when the library is older */
    ferry__CUfileError_t (*ReadAsync)(ferry__CUfileHandle_t fh, void *base, size_t *size,
                                      off_t *file_off, off_t *buf_off, ssize_t *done,
                                      void *stream);
    ferry__CUfileError_t (*WriteAsync)(ferry__CUfileHandle_t fh, void *base, size_t *size,
                                       off_t *file_off, off_t *buf_off, ssize_t *done,
                                       void *stream);
    ferry__CUfileError_t (*StreamRegister)(void *stream, unsigned flags);
    ferry__CUfileError_t (*StreamDeregister)(void *stream);
    ferry__CUfileError_t (*BatchIOSetUp)(ferry__CUfileBatchHandle_t *id, unsigned nr);
    ferry__CUfileError_t (*BatchIOSubmit)(ferry__CUfileBatchHandle_t id, unsigned nr,
                                          ferry__CUfileIOParams_t *params, unsigned flags);
    ferry__CUfileError_t (*BatchIOGetStatus)(ferry__CUfileBatchHandle_t id, unsigned min_nr,
                                             unsigned *nr, ferry__CUfileIOEvents_t *events,
                                             struct timespec *timeout);
    ferry__CUfileError_t (*BatchIOCancel)(ferry__CUfileBatchHandle_t id);
    void (*BatchIODestroy)(ferry__CUfileBatchHandle_t id);
    /* tests only: accept a non-cuda device (the host backend as stand-in) */
    int allow_host_device;
} ferry__cufile_api;

/*
 * A library shaped like cuFile (cuFile itself; hipFile, whose hipFile*
 * calls mirror it one to one), loaded with dlopen once per process on
 * first use and never unloaded; its driver is opened by the first user
 * (a cufile I/O engine, a GDS context) and closed after the last. The
 * fields after sonames are the loader's (guarded by mu). A library is an
 * object of static storage: its first use lists it for the fork handlers
 * (cufile_lib.c), and the list is never shortened.
 */
typedef struct ferry__cufile_lib {
    const char *prefix;               /* "cuFile": symbol names, messages */
    const char *const *sonames;       /* tried in order, NULL-terminated */
    pthread_mutex_t mu;
    const ferry__cufile_api *test_api; /* a test's table, used instead of loading */
    ferry__cufile_api real;
    int real_rc;                      /* 1: not tried yet, 0: loaded, < 0: failed */
    char why[256];                    /* why loading failed */
    unsigned refs;                    /* users with the driver open */
    _Atomic int listed;               /* in the fork handlers' list (cufile_lib.c) */
    struct ferry__cufile_lib *next_listed;
} ferry__cufile_lib;

#define FERRY__CUFILE_LIB_INIT(prefix_, sonames_)                                           \
    {.prefix = (prefix_), .sonames = (sonames_), .mu = PTHREAD_MUTEX_INITIALIZER, .real_rc = 1}

/* NVIDIA's: libcufile.so.0 (libcufile.so), prefix "cuFile" */
extern ferry__cufile_lib ferry__cufile_lib_nv;

/* The table in force: the test's, else the library's (loaded on the first
 * call); NULL, with why[] filled, when the library cannot be loaded. */
const ferry__cufile_api *ferry__cufile_lib_api(ferry__cufile_lib *l, char *why, size_t why_len);
/* The test's table, or NULL; never loads anything. */
const ferry__cufile_api *ferry__cufile_lib_test_api(ferry__cufile_lib *l);
/* Install a fake table (NULL restores the real library); the driver's
 * user count restarts at 0. The table must outlive every user opened
 * while it is installed. Call with no user open. */
void ferry__cufile_lib_set_api(ferry__cufile_lib *l, const ferry__cufile_api *api);
/* One more user of the driver: DriverOpen when it is the first. 0, or
 * FERRY_EDRIVER with DriverOpen's error in *e (the user is not counted). */
int ferry__cufile_lib_open(ferry__cufile_lib *l, const ferry__cufile_api *a,
                           ferry__CUfileError_t *e);
/* One user fewer: DriverClose after the last; its error in *e (err 0 when
 * none). a is the table the user opened with. */
void ferry__cufile_lib_close(ferry__cufile_lib *l, const ferry__cufile_api *a,
                             ferry__CUfileError_t *e);

/*
 * Install a fake API for cuFile (ferry__cufile_lib_nv; NULL restores the
 * real library): the cufile engine and the GDS cufile driver both use it.
 * The table must outlive every cufile engine and GDS context opened while
 * it is installed. Not thread-safe: call with none open.
 */
void ferry__cufile_set_api(const ferry__cufile_api *api);

/* The text of a cuFile error number (5000 + n); never NULL. */
const char *ferry__cufile_strerror(int err);
/* ferry's code for a cuFile error number: FERRY_ENODEV, FERRY_ENOTSUP,
 * FERRY_EEXIST, -EFAULT, -EINVAL, ... or FERRY_EDRIVER. */
int ferry__cufile_code(int err);
/* ferry's code for a cuFileRead/Write return (< 0): -1 -> -errno, other
 * negatives -> ferry__cufile_code(-ret). */
int ferry__cufile_ret_code(ssize_t ret, int saved_errno);

#endif
