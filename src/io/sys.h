/*
 * sys.h - the syscall seam of the I/O layer (private).
 *
 * Every engine reaches the kernel's file calls through this table, never
 * directly, so a test can install a table that fails the Nth call with EIO
 * or ENOSPC, returns short counts, or interrupts with EINTR, and check that
 * the engines continue, retry or report exactly as documented. The
 * functions follow libc's convention (-1 and errno), except fallocate,
 * which follows posix_fallocate (returns the error number, 0 on success).
 *
 * io_uring does its I/O in the kernel, so the table also carries a hook
 * that sees (and may rewrite) every completion result before the engine
 * acts on it: a test turns a full read into -EIO, a short count, -EINTR or
 * -EAGAIN that way; likewise a hook before each fixed-buffer registration.
 *
 * The table is swapped atomically; engines load it once per call, so a
 * test may install or restore it while worker threads run.
 */
#ifndef FERRY_SRC_IO_SYS_H
#define FERRY_SRC_IO_SYS_H

#include <stddef.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>

typedef struct ferry__sys {
    int (*open)(const char *path, int flags, mode_t mode);
    int (*close)(int fd);
    ssize_t (*pread)(int fd, void *buf, size_t n, off_t off);
    ssize_t (*pwrite)(int fd, const void *buf, size_t n, off_t off);
    /* posix_fallocate convention: 0 or an errno value (not -1) */
    int (*fallocate)(int fd, off_t off, off_t len);
    int (*fdatasync)(int fd);
    int (*fstat)(int fd, struct stat *st);
    int (*ftruncate)(int fd, off_t len);
    /* posix_fadvise convention: 0 or an errno value */
    int (*fadvise)(int fd, off_t off, off_t len, int advice);
    /*
     * io_uring completion hook, NULL for none: called with the request
     * (op FERRY_IO_READ/WRITE, fd, offset, length) and the kernel's result
     * (bytes or -errno); returns the result the engine should see.
     */
    int (*uring_result)(void *ctx, int op, int fd, uint64_t off, size_t len, int res);
    void *ctx;
    /* vectored reads (the posix engine's FERRY_IO_READV) */
    ssize_t (*preadv)(int fd, const struct iovec *iov, int n, off_t off);
    /*
     * io_uring buffer registration hook, NULL for none: called before the
     * kernel is asked to take [base, base + len) as fixed-buffer slot
     * `slot` (on the registering thread, which it may delay); a negative
     * errno fails that registration without asking the kernel.
     */
    int (*uring_register)(void *ctx, unsigned slot, void *base, size_t len);
} ferry__sys;

/* The table in force (never NULL). */
const ferry__sys *ferry__sys_get(void);
/* Install a table (copied by pointer: it must outlive its use); NULL
 * restores the real syscalls. */
void ferry__sys_set(const ferry__sys *s);
/* The real syscalls, for a test table to delegate to. */
const ferry__sys *ferry__sys_default(void);

#endif
