/*
 * error.c - error codes, names and the per-thread / per-handle messages.
 *
 * One X-macro list (ferry/core.h) generates the enum, the text and the
 * names, so a new code cannot be half-added. System errors are -errno and
 * are described by strerror_r into a per-thread buffer, so ferry_strerror
 * never returns NULL and is safe to call from any thread.
 */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "core.h"

static _Thread_local char tls_last[FERRY__ERRMSG_MAX];
static _Thread_local char tls_strerr[128];

const char *ferry_strerror(int code)
{
    if (code == 0)
        return "success";
    switch (code) {
#define FERRY__ERR_TEXT(name, value, text) \
    case value:                            \
        return text;
        FERRY_ERRORS(FERRY__ERR_TEXT)
#undef FERRY__ERR_TEXT
    default:
        break;
    }
    if (code < 0 && code > -4096) {
        /* XSI and GNU strerror_r differ; strerror is thread-safe in glibc
         * for known codes, but copy into our buffer to be safe. */
        const char *s = strerror(-code);
        snprintf(tls_strerr, sizeof tls_strerr, "%s", s ? s : "unknown error");
        return tls_strerr;
    }
    snprintf(tls_strerr, sizeof tls_strerr, "unknown error %d", code);
    return tls_strerr;
}

static const char *errno_name(int e)
{
    switch (e) {
#define N(x) \
    case x:  \
        return #x;
        N(EPERM) N(ENOENT) N(EINTR) N(EIO) N(ENXIO) N(EBADF) N(EAGAIN) N(ENOMEM) N(EACCES)
        N(EFAULT) N(EBUSY) N(EEXIST) N(ENODEV) N(ENOTDIR) N(EISDIR) N(EINVAL) N(ENFILE)
        N(EMFILE) N(EFBIG) N(ENOSPC) N(ESPIPE) N(EROFS) N(EPIPE) N(ERANGE) N(ENOSYS)
        N(EOVERFLOW) N(EOPNOTSUPP) N(ETIMEDOUT) N(ECONNREFUSED) N(ECONNRESET) N(ECANCELED)
        N(EDQUOT) N(ENAMETOOLONG) N(ENOTCONN) N(EPROTO) N(EMSGSIZE)
#undef N
    default:
        return NULL;
    }
}

const char *ferry_err_name(int code)
{
    if (code == 0)
        return "FERRY_OK";
    switch (code) {
#define FERRY__ERR_NAME(name, value, text) \
    case value:                            \
        return "FERRY_" #name;
        FERRY_ERRORS(FERRY__ERR_NAME)
#undef FERRY__ERR_NAME
    default:
        break;
    }
    if (code < 0 && code > -4096) {
        const char *n = errno_name(-code);
        if (n)
            return n;
        /* every other errno the C library knows by name (glibc 2.32+) */
        n = strerrorname_np(-code);
        if (n)
            return n;
    }
    return "FERRY_EUNKNOWN";
}

const char *ferry_last_error(void)
{
    return tls_last;
}

/* a handle's message is a few hundred bytes copied under a spin lock held
 * only for the copy: one of a few locks chosen by the buffer's address, so
 * a buffer on a caller's stack needs no initialization. The locks are the
 * process's: a fork while another thread holds one would leave it held in
 * the child (whose next message on a buffer of that lock spins forever),
 * so pthread_atfork takes them all around a fork and frees them on both
 * sides (registered before any is first taken). */
#define EB_LOCKS 64
static _Atomic int eb_locks[EB_LOCKS];
static pthread_once_t eb_atfork_once = PTHREAD_ONCE_INIT;

static _Atomic int *eb_lk(const ferry__errbuf *eb)
{
    uintptr_t a = (uintptr_t)eb;
    return &eb_locks[(a >> 6 ^ a >> 12) % EB_LOCKS];
}

static void eb_spin(_Atomic int *lk)
{
    int free_ = 0;
    while (!atomic_compare_exchange_weak_explicit(lk, &free_, 1, memory_order_acquire,
                                                  memory_order_relaxed))
        free_ = 0;
}

static void eb_take_all(void)
{
    for (int i = 0; i < EB_LOCKS; i++)
        eb_spin(&eb_locks[i]);
}

static void eb_give_all(void)
{
    for (int i = 0; i < EB_LOCKS; i++)
        atomic_store_explicit(&eb_locks[i], 0, memory_order_release);
}

static void eb_atfork(void)
{
    pthread_atfork(eb_take_all, eb_give_all, eb_give_all);
}

static void eb_lock(const ferry__errbuf *eb)
{
    pthread_once(&eb_atfork_once, eb_atfork);
    eb_spin(eb_lk(eb));
}

static void eb_unlock(const ferry__errbuf *eb)
{
    atomic_store_explicit(eb_lk(eb), 0, memory_order_release);
}

static void eb_write(ferry__errbuf *eb, int code, const char *msg)
{
    eb_lock(eb);
    eb->code = code;
    snprintf(eb->msg, sizeof eb->msg, "%s", msg);
    eb_unlock(eb);
}

int ferry__err_vset(ferry__errbuf *eb, int code, const char *fmt, va_list ap)
{
    char tmp[FERRY__ERRMSG_MAX];
    vsnprintf(tmp, sizeof tmp, fmt, ap);
    memcpy(tls_last, tmp, sizeof tls_last);
    if (eb)
        eb_write(eb, code, tmp);
    ferry__log(FERRY_LOG_DEBUG, "error %s: %s", ferry_err_name(code), tmp);
    return code;
}

int ferry__err_set(ferry__errbuf *eb, int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    ferry__err_vset(eb, code, fmt, ap);
    va_end(ap);
    return code;
}

int ferry__err_pass(ferry__errbuf *eb, int code)
{
    if (eb)
        eb_write(eb, code, tls_last[0] ? tls_last : ferry_strerror(code));
    return code;
}

int ferry__err_copy(ferry__errbuf *dst, const ferry__errbuf *src, int code)
{
    if (dst && src)
        eb_write(dst, code, ferry__err_msg(src));
    return code;
}

const char *ferry__err_msg(const ferry__errbuf *eb)
{
    static _Thread_local char copies[4][FERRY__ERRMSG_MAX];
    static _Thread_local unsigned turn;
    if (!eb)
        return "";
    char *c = copies[turn++ % 4];
    eb_lock(eb);
    memcpy(c, eb->msg, FERRY__ERRMSG_MAX);
    eb_unlock(eb);
    return c;
}
