/*
 * probe.c - what a host can do, asked without opening an engine:
 * ferry_io_direct_probe (does O_DIRECT work in this directory) and
 * ferry_io_engine_probe (is this engine usable here, and the directory
 * writable).
 *
 * Invariant: a probe really tries (a 4096-byte O_DIRECT write and read of
 * its own file, the engine's own setup) rather than guessing from names
 * or versions, and leaves nothing behind: its file is unlinked whatever
 * the outcome.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "io_impl.h"
#include "sys.h"

static int dir_writable(const char *dir, char *why, size_t why_len)
{
    if (access(dir, W_OK | X_OK) != 0) {
        int e = errno;
        snprintf(why, why_len, "directory %s is not usable: %s (%s)", dir, ferry_err_name(-e),
                 strerror(e));
        return -e;
    }
    return 0;
}

int ferry_io_direct_probe(const char *dir, char *why, size_t why_len)
{
    char dummy[8];
    if (!why || !why_len) {
        why = dummy;
        why_len = sizeof dummy;
    }
    why[0] = 0;
    if (!dir || !*dir) {
        snprintf(why, why_len, "no directory given");
        return -EINVAL;
    }
    static unsigned counter;
    char path[4096];
    snprintf(path, sizeof path, "%s/.ferry-direct-probe-%d-%u", dir, (int)getpid(),
             __atomic_add_fetch(&counter, 1, __ATOMIC_RELAXED));
    const ferry__sys *sys = ferry__sys_get();
    int fd = sys->open(path, O_CREAT | O_EXCL | O_RDWR | O_DIRECT | O_CLOEXEC, 0600);
    if (fd < 0) {
        int e = errno;
        if (e == EINVAL) {
            snprintf(why, why_len, "O_DIRECT refused by the file system of %s (open: EINVAL)",
                     dir);
            return -EINVAL;
        }
        snprintf(why, why_len, "cannot create a file in %s: %s (%s)", dir, ferry_err_name(-e),
                 strerror(e));
        return -e;
    }
    int rc = 0;
    void *buf = NULL;
    if (posix_memalign(&buf, FERRY_IO_ALIGN, FERRY_IO_ALIGN) != 0) {
        rc = -ENOMEM;
        snprintf(why, why_len, "out of memory");
    } else {
        memset(buf, 0, FERRY_IO_ALIGN);
        ssize_t w = sys->pwrite(fd, buf, FERRY_IO_ALIGN, 0);
        if (w != (ssize_t)FERRY_IO_ALIGN) {
            int e = w < 0 ? errno : EIO;
            rc = -e;
            snprintf(why, why_len, "O_DIRECT write of %u bytes in %s failed: %s (%s)",
                     FERRY_IO_ALIGN, dir, ferry_err_name(-e), strerror(e));
        } else {
            ssize_t r = sys->pread(fd, buf, FERRY_IO_ALIGN, 0);
            if (r != (ssize_t)FERRY_IO_ALIGN) {
                int e = r < 0 ? errno : EIO;
                rc = -e;
                snprintf(why, why_len, "O_DIRECT read of %u bytes in %s failed: %s (%s)",
                         FERRY_IO_ALIGN, dir, ferry_err_name(-e), strerror(e));
            }
        }
        free(buf);
    }
    sys->close(fd);
    unlink(path);
    if (rc == 0)
        snprintf(why, why_len, "O_DIRECT works in %s (4096-byte write and read)", dir);
    return rc;
}

int ferry_io_engine_probe(const char *engine, const char *dir, char *why, size_t why_len)
{
    char dummy[8];
    if (!why || !why_len) {
        why = dummy;
        why_len = sizeof dummy;
    }
    why[0] = 0;
    if (!engine || !*engine || !strcmp(engine, "auto")) {
        snprintf(why, why_len, "name an engine: posix, uring or cufile");
        return -EINVAL;
    }
    int rc;
    if (!strcmp(engine, "posix")) {
        rc = 0;
        snprintf(why, why_len, "pread/pwrite on a thread pool: always available");
    } else if (!strcmp(engine, "uring"))
        rc = ferry__uring_probe(why, why_len);
    else if (!strcmp(engine, "cufile"))
        rc = ferry__cufile_probe(why, why_len);
    else {
        snprintf(why, why_len, "unknown engine '%s' (posix|uring|cufile)", engine);
        return -EINVAL;
    }
    if (rc == 0 && dir && *dir)
        rc = dir_writable(dir, why, why_len);
    return rc;
}
