/*
 * sys.c - the real syscalls behind the I/O seam (see sys.h).
 *
 * The installed table is one atomic pointer: readers never see a half
 * written table, and a test that swaps it while workers run is race-free.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <unistd.h>

#include "sys.h"

static int s_open(const char *path, int flags, mode_t mode)
{
    return open(path, flags, mode);
}
static int s_close(int fd)
{
    return close(fd);
}
static ssize_t s_pread(int fd, void *buf, size_t n, off_t off)
{
    return pread(fd, buf, n, off);
}
static ssize_t s_pwrite(int fd, const void *buf, size_t n, off_t off)
{
    return pwrite(fd, buf, n, off);
}
static ssize_t s_preadv(int fd, const struct iovec *iov, int n, off_t off)
{
    return preadv(fd, iov, n, off);
}
static int s_fallocate(int fd, off_t off, off_t len)
{
    return posix_fallocate(fd, off, len);
}
static int s_fdatasync(int fd)
{
    return fdatasync(fd);
}
static int s_fstat(int fd, struct stat *st)
{
    return fstat(fd, st);
}
static int s_ftruncate(int fd, off_t len)
{
    return ftruncate(fd, len);
}
static int s_fadvise(int fd, off_t off, off_t len, int advice)
{
    return posix_fadvise(fd, off, len, advice);
}

static const ferry__sys g_default = {s_open,      s_close,    s_pread,     s_pwrite,
                                     s_fallocate, s_fdatasync, s_fstat,    s_ftruncate,
                                     s_fadvise,   NULL,        NULL,       s_preadv,
                                     NULL};
static _Atomic(const ferry__sys *) g_sys = &g_default;

const ferry__sys *ferry__sys_get(void)
{
    return atomic_load_explicit(&g_sys, memory_order_acquire);
}

void ferry__sys_set(const ferry__sys *s)
{
    atomic_store_explicit(&g_sys, s ? s : &g_default, memory_order_release);
}

const ferry__sys *ferry__sys_default(void)
{
    return &g_default;
}
