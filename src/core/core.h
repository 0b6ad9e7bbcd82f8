/*
 * core.h - private helpers every layer uses: allocation through the hook,
 * error recording, logging, time. Not installed.
 *
 * Error recording: ferry__err_set() formats a message into a handle's
 * ferry__errbuf (may be NULL) and into the calling thread's buffer, logs it
 * at debug level and returns the code, so failures read
 *     return ferry__err_set(&f->err, -EIO, "file %s: read of %zu bytes at %llu: %s", ...);
 */
#ifndef FERRY_SRC_CORE_H
#define FERRY_SRC_CORE_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include "ferry/core.h"

#define FERRY__ERRMSG_MAX 512

/* a handle's last failure; written and read only through the functions
 * below, which serialize them (a buffer needs no initialization for that) */
typedef struct ferry__errbuf {
    int code;
    char msg[FERRY__ERRMSG_MAX];
} ferry__errbuf;

/* allocation through the installed hook */
void *ferry__malloc(size_t n);
void *ferry__calloc(size_t n, size_t size);
void *ferry__realloc(void *p, size_t n);
/* alignment: power of two; size rounded up internally as needed */
void *ferry__aligned_alloc(size_t alignment, size_t n);
void ferry__free(void *p);
char *ferry__strdup(const char *s);
/* memcpy of n bytes with streaming stores when n >= FERRY__COPY_STREAM_MIN
 * (copy.c): for large copies into memory not read again soon (an engine's
 * buffer); plain memcpy otherwise, and under the sanitizers */
#define FERRY__COPY_STREAM_MIN ((size_t)64 << 10)
void ferry__copy_stream(void *dst, const void *src, size_t n);

#if defined(__GNUC__)
#define FERRY__PRINTF(a, b) __attribute__((format(printf, a, b)))
/* a walker whose callback is a constant at the call: inlined there, so the
 * callback is a direct (and inlined) call per run */
#define FERRY__ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define FERRY__PRINTF(a, b)
#define FERRY__ALWAYS_INLINE inline
#endif

/* record an error on eb (may be NULL) and the thread; returns code */
int ferry__err_set(ferry__errbuf *eb, int code, const char *fmt, ...) FERRY__PRINTF(3, 4);
int ferry__err_vset(ferry__errbuf *eb, int code, const char *fmt, va_list ap) FERRY__PRINTF(3, 0);
/* copy the thread's last message into eb (after a lower layer failed); returns code */
int ferry__err_pass(ferry__errbuf *eb, int code);
/* copy src's message (taken whole) into dst with code, the thread's own
 * message untouched (a failure recorded in a local buffer, published on a
 * handle); returns code */
int ferry__err_copy(ferry__errbuf *dst, const ferry__errbuf *src, int code);
/* eb's message as the calling thread's own copy ("" for NULL), taken whole
 * even while another thread records a failure on eb: every *_last_error
 * returns this. Each thread has a few such copies in turn, so one call's
 * result stays valid across the next three. */
const char *ferry__err_msg(const ferry__errbuf *eb);

/* the memory this process may have in all (the host's, or its cgroup's
 * limit where lower) and what of it is available now (meminfo.c) */
void ferry__host_memory(uint64_t *total, uint64_t *avail);
/* the same, of the files under root ("": this host's /proc and the
 * cgroup mounts its mountinfo names), without the test seams below */
void ferry__host_memory_at(const char *root, uint64_t *total, uint64_t *avail);
/* test seams: while nonzero, what ferry__host_memory answers */
extern _Atomic uint64_t ferry__test_mem_total;
extern _Atomic uint64_t ferry__test_mem_avail;

void ferry__log(int level, const char *fmt, ...) FERRY__PRINTF(2, 3);
int ferry__log_enabled(int level);
#define FERRY_LOGE(...) ferry__log(FERRY_LOG_ERROR, __VA_ARGS__)
#define FERRY_LOGW(...) ferry__log(FERRY_LOG_WARN, __VA_ARGS__)
#define FERRY_LOGI(...) ferry__log(FERRY_LOG_INFO, __VA_ARGS__)
#define FERRY_LOGD(...) ferry__log(FERRY_LOG_DEBUG, __VA_ARGS__)

/*
 * A warning that can repeat at the rate of the I/O (every failed write of
 * a full tier) is said the first FERRY__WARN_BURST times, then at most once
 * a second with how many were held back since. Zero-initialized; safe from
 * any number of threads.
 */
#define FERRY__WARN_BURST 5
typedef struct ferry__warnlim {
    _Atomic uint64_t said, next_ns, quiet;
} ferry__warnlim;
/* 1: say it now (*quiet: how many were held back before it), 0: hold it back */
int ferry__warn_ok(ferry__warnlim *w, uint64_t *quiet);

/*
 * An invariant: checked in debug builds, where a broken one aborts with
 * what, where and in which function; nothing in release builds (NDEBUG).
 * Where the code also guards against the broken case for release builds,
 * the assert says the guard is a seatbelt, not a path.
 */
#ifndef NDEBUG
#define FERRY__ASSERT(c) ((c) ? (void)0 : ferry__assert_fail(#c, __FILE__, __LINE__, __func__))
#else
#define FERRY__ASSERT(c) ((void)0)
#endif
_Noreturn void ferry__assert_fail(const char *what, const char *file, int line, const char *fn);

/* monotonic clock */
uint64_t ferry__now_ns(void);
/* the calling thread's CPU time (a system call: for work of many us) */
uint64_t ferry__thread_cpu_ns(void);

/*
 * Timed waits, all on the monotonic clock (a wall-clock step never makes
 * a wait end early or hang): a condition variable made by
 * ferry__cond_init_mono and a deadline from ferry__deadline_ms.
 */
#include <pthread.h>
#include <time.h>
int ferry__cond_init_mono(pthread_cond_t *cv);
/* the absolute monotonic time ms milliseconds from now */
struct timespec ferry__deadline_ms(uint64_t ms);
/* process CPU time (user + system), seconds */
double ferry__cpu_seconds(void);
/* getpid(), without a system call: kept right in every child that does not
 * share this process's memory (a MADV_WIPEONFORK page; fork()'s handler
 * where the kernel has none: pid.c) */
long ferry__pid(void);
/* 1 when this process's effective uid is the host's uid 0 (not a user
 * namespace's 0 that is another uid outside it): hostroot.c */
int ferry__host_root(void);

#define FERRY__MIN(a, b) ((a) < (b) ? (a) : (b))
#define FERRY__MAX(a, b) ((a) > (b) ? (a) : (b))
#define FERRY__ALIGN_UP(x, a) (((x) + ((a)-1)) & ~((__typeof__(x))(a)-1))
#define FERRY__IS_ALIGNED(x, a) ((((uint64_t)(x)) & ((uint64_t)(a)-1)) == 0)
#define FERRY__ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))

#endif
