/*
 * cuda_api.h - private: the CUDA driver API as ferry uses it, without the
 * CUDA headers. Not installed.
 *
 * One X-macro list names every driver function ferry calls, its return type
 * and its parameters, with the CUDA types as macro parameters. The library
 * expands it with its own types (below) to get the function-pointer table
 * and the dlsym loop; a test that has the real cuda.h expands the same list
 * with the real types and checks, at compile time, that every prototype
 * matches the driver's (test_cuda_fake.c). Symbol names are the exported
 * ones (the _v2 names that cuda.h's macros select).
 *
 * The seam: ferry__cuda_set_api_for_test() installs a fake table, so the
 * cuda backend's logic runs (and is tested) on machines without a GPU.
 */
#ifndef FERRY_SRC_CUDA_API_H
#define FERRY_SRC_CUDA_API_H

#include <stddef.h>

typedef int ferry__CUresult;
typedef int ferry__CUdevice;
typedef struct ferry__CUctx_st *ferry__CUcontext;
typedef struct ferry__CUstream_st *ferry__CUstream;
typedef struct ferry__CUevent_st *ferry__CUevent;
typedef unsigned long long ferry__CUdeviceptr;

/* CUresult values ferry tells apart */
#define FERRY__CUDA_SUCCESS 0
#define FERRY__CUDA_ERROR_INVALID_VALUE 1
#define FERRY__CUDA_ERROR_OUT_OF_MEMORY 2
#define FERRY__CUDA_ERROR_NOT_INITIALIZED 3
#define FERRY__CUDA_ERROR_NO_DEVICE 100
#define FERRY__CUDA_ERROR_INVALID_DEVICE 101
#define FERRY__CUDA_ERROR_NOT_READY 600
#define FERRY__CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED 712
/* flags */
#define FERRY__CU_MEMHOSTREGISTER_PORTABLE 0x01u
#define FERRY__CU_STREAM_NON_BLOCKING 0x1u
#define FERRY__CU_EVENT_DEFAULT 0x0u

/* X(name, R, (params)) with R = CUresult, D = CUdevice, C = CUcontext,
 * S = CUstream, E = CUevent, P = CUdeviceptr */
#define FERRY__CUDA_API_LIST(X, R, D, C, S, E, P)                                    \
    X(cuInit, R, (unsigned int Flags))                                               \
    X(cuDeviceGetCount, R, (int *count))                                             \
    X(cuDeviceGet, R, (D * device, int ordinal))                                     \
    X(cuDeviceGetName, R, (char *name, int len, D dev))                              \
    X(cuDevicePrimaryCtxRetain, R, (C * pctx, D dev))                                \
    X(cuDevicePrimaryCtxRelease_v2, R, (D dev))                                      \
    X(cuCtxSetCurrent, R, (C ctx))                                                   \
    X(cuMemAlloc_v2, R, (P * dptr, size_t bytesize))                                 \
    X(cuMemFree_v2, R, (P dptr))                                                     \
    X(cuMemAllocHost_v2, R, (void **pp, size_t bytesize))                            \
    X(cuMemFreeHost, R, (void *p))                                                   \
    X(cuMemHostRegister_v2, R, (void *p, size_t bytesize, unsigned int Flags))       \
    X(cuMemHostUnregister, R, (void *p))                                             \
    X(cuMemsetD8_v2, R, (P dstDevice, unsigned char uc, size_t N))                   \
    X(cuMemcpyHtoDAsync_v2, R, (P dstDevice, const void *srcHost, size_t n, S st))   \
    X(cuMemcpyDtoHAsync_v2, R, (void *dstHost, P srcDevice, size_t n, S st))         \
    X(cuMemcpyDtoDAsync_v2, R, (P dstDevice, P srcDevice, size_t n, S st))           \
    X(cuStreamCreate, R, (S * phStream, unsigned int Flags))                         \
    X(cuStreamDestroy_v2, R, (S hStream))                                            \
    X(cuStreamSynchronize, R, (S hStream))                                           \
    X(cuStreamWaitEvent, R, (S hStream, E hEvent, unsigned int Flags))               \
    X(cuEventCreate, R, (E * phEvent, unsigned int Flags))                           \
    X(cuEventDestroy_v2, R, (E hEvent))                                              \
    X(cuEventRecord, R, (E hEvent, S hStream))                                       \
    X(cuEventQuery, R, (E hEvent))                                                   \
    X(cuEventSynchronize, R, (E hEvent))                                             \
    X(cuEventElapsedTime, R, (float *pMilliseconds, E hStart, E hEnd))               \
    X(cuGetErrorName, R, (R error, const char **pStr))                               \
    X(cuGetErrorString, R, (R error, const char **pStr))

#define FERRY__CUDA_PFN(name, R, params) typedef R(*ferry__pfn_##name) params;
FERRY__CUDA_API_LIST(FERRY__CUDA_PFN, ferry__CUresult, ferry__CUdevice, ferry__CUcontext,
                     ferry__CUstream, ferry__CUevent, ferry__CUdeviceptr)
#undef FERRY__CUDA_PFN

/*
 * Batched copies (CUDA 12.8 and later), optional: a driver without them
 * leaves the pointers NULL and ferry copies one call per run. CUDA 13
 * exports cuMemcpyBatchAsync_v2 (what cuda.h's cuMemcpyBatchAsync means
 * there); 12.8 and 12.9 export cuMemcpyBatchAsync with a trailing failIdx.
 * Every copy of a batch needs attributes: ferry passes one entry for all
 * (attrsIdxs {0}) asking for source access in stream order.
 */
typedef struct ferry__CUmemLocation {
    int type; /* CUmemLocationType; 0 (invalid) = no hint */
    int id;
} ferry__CUmemLocation;
typedef struct ferry__CUmemcpyAttributes {
    int srcAccessOrder; /* CUmemcpySrcAccessOrder */
    ferry__CUmemLocation srcLocHint;
    ferry__CUmemLocation dstLocHint;
    unsigned int flags;
} ferry__CUmemcpyAttributes;
#define FERRY__CU_MEMCPY_SRC_ACCESS_ORDER_STREAM 1
typedef ferry__CUresult (*ferry__pfn_cuMemcpyBatchAsync_v2)(
    ferry__CUdeviceptr *dsts, ferry__CUdeviceptr *srcs, size_t *sizes, size_t count,
    ferry__CUmemcpyAttributes *attrs, size_t *attrsIdxs, size_t numAttrs, ferry__CUstream hStream);
typedef ferry__CUresult (*ferry__pfn_cuMemcpyBatchAsync_v1)(
    ferry__CUdeviceptr *dsts, ferry__CUdeviceptr *srcs, size_t *sizes, size_t count,
    ferry__CUmemcpyAttributes *attrs, size_t *attrsIdxs, size_t numAttrs, size_t *failIdx,
    ferry__CUstream hStream);

/* the resolved driver: one pointer per function, member p_<symbol>, then
 * the optional ones (NULL when the driver does not export them) */
struct ferry__cuda_api {
#define FERRY__CUDA_MEMBER(name, R, params) ferry__pfn_##name p_##name;
    FERRY__CUDA_API_LIST(FERRY__CUDA_MEMBER, ferry__CUresult, ferry__CUdevice,
                         ferry__CUcontext, ferry__CUstream, ferry__CUevent,
                         ferry__CUdeviceptr)
#undef FERRY__CUDA_MEMBER
    ferry__pfn_cuMemcpyBatchAsync_v2 p_cuMemcpyBatchAsync_v2; /* "cuMemcpyBatchAsync_v2" */
    ferry__pfn_cuMemcpyBatchAsync_v1 p_cuMemcpyBatchAsync_v1; /* "cuMemcpyBatchAsync" */
};

/*
 * Test seam: use *api (copied) instead of loading libcuda.so.1; NULL goes
 * back to the real driver. Not thread-safe: call when no cuda device is open.
 */
void ferry__cuda_set_api_for_test(const struct ferry__cuda_api *api);
/*
 * Test seam: the library name dlopen tries (NULL: "libcuda.so.1"); forgets
 * any earlier load result. Not thread-safe, as above.
 */
void ferry__cuda_set_library_for_test(const char *soname);

/*
 * Load the driver once per process (or take the test table): 0 and *out, or
 * FERRY_ENODEV with the thread's message saying why ("libcuda.so.1 not
 * found: ..." or which symbol is missing). Thread-safe.
 */
int ferry__cuda_load(const struct ferry__cuda_api **out);

/* The CUcontext a cuda device runs in (what a thread must make current
 * before its own driver calls), or NULL for other backends. */
struct ferry_device;
ferry__CUcontext ferry__cuda_context(const struct ferry_device *dev);
/* The CUdevice of a cuda ferry_device, or -1. */
int ferry__cuda_device_ordinal(const struct ferry_device *dev);

#endif
