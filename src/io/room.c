/*
 * room.c - the free space a file system has for this process's files.
 *
 * A file system keeps part of its free blocks for root: ext4 its reserve
 * (5% by default; for resuid, uid 0, and CAP_SYS_RESOURCE in the host's
 * namespace), so statfs says f_bfree (free) and f_bavail (free to anyone).
 * The host's root (hostroot.c) may take both. btrfs is not so: its
 * f_bfree counts space its allocator cannot hand out (metadata, global
 * reserve, chunk slack), f_bavail is what a file may have, root's or not.
 *
 * A slab striped over several directories makes one file in each; where
 * two of them are on one file system (st_dev), their parts share its free
 * space, and each part checked alone fits while their sum does not: the
 * last part's fallocate then fails after the ones before it filled the
 * disk. So the parts are summed per file system and checked before any
 * is made.
 */
#include <errno.h>
#include <stdatomic.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "io/room.h"

#ifndef BTRFS_SUPER_MAGIC
#define BTRFS_SUPER_MAGIC 0x9123683E
#endif

int (*_Atomic ferry__test_fstatfs)(int fd, struct statfs *st);

int ferry__fs_room(int fd, uint64_t *room)
{
    struct statfs sf;
    int (*seam)(int, struct statfs *) = atomic_load_explicit(&ferry__test_fstatfs,
                                                             memory_order_relaxed);
    if ((seam ? seam(fd, &sf) : fstatfs(fd, &sf)) != 0)
        return -errno;
    if (!sf.f_blocks)
        return -ENOTSUP;
    uint64_t unit = sf.f_frsize ? (uint64_t)sf.f_frsize : (uint64_t)sf.f_bsize;
    int reserve = (unsigned long)sf.f_type != (unsigned long)BTRFS_SUPER_MAGIC;
    uint64_t blocks = reserve && ferry__host_root() ? sf.f_bfree : sf.f_bavail;
    *room = blocks > UINT64_MAX / unit ? UINT64_MAX : blocks * unit;
    return 0;
}

/* a file system of the check: a directory on it, its id, free bytes,
 * what its files ask in all and how many they are */
typedef struct fs_sum {
    const char *dir;
    dev_t dev;
    uint64_t room, asked;
    unsigned files;
} fs_sum;

/* dir, or its nearest existing ancestor, opened; *itself: it was dir */
static int open_dir(const char *dir, int *itself)
{
    char d[PATH_MAX];
    if (snprintf(d, sizeof d, "%s", dir) >= (int)sizeof d)
        return -1;
    for (*itself = 1;;) {
        int fd = open(d, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (fd >= 0 || errno != ENOENT)
            return fd;
        *itself = 0;
        char *slash = strrchr(d, '/');
        while (slash && slash > d && slash[1] == 0) { /* ("a/b/": "a/b") */
            *slash = 0;
            slash = strrchr(d, '/');
        }
        if (!slash)
            return open(".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (slash == d && !d[1])
            return -1;
        slash[slash == d] = 0; /* ("/x": "/") */
    }
}

/* the file system of dir's file `name` into fs[] (*nfs of them), its
 * bytes added; 0 where it cannot be told */
static int add_file(fs_sum *fs, unsigned *nfs, unsigned max, const char *dir, const char *name,
                    uint64_t bytes)
{
    int itself;
    int fd = open_dir(dir, &itself);
    struct stat st, fst;
    uint64_t room;
    if (fd < 0)
        return 0;
    int ok = fstat(fd, &st) == 0 && ferry__fs_room(fd, &room) == 0;
    /* the file there now is made anew: its blocks are freed first (not a
     * file of that name in the ancestor of a directory still to be made) */
    uint64_t freed = ok && itself && fstatat(fd, name, &fst, 0) == 0 && S_ISREG(fst.st_mode) &&
                             fst.st_dev == st.st_dev
                         ? (uint64_t)fst.st_blocks * 512
                         : 0;
    close(fd);
    unsigned k = 0;
    while (ok && k < *nfs && fs[k].dev != st.st_dev)
        k++;
    if (!ok || k == max)
        return 0;
    if (k == *nfs)
        fs[(*nfs)++] = (fs_sum){dir, st.st_dev, room, 0, 0};
    fs[k].room = fs[k].room > UINT64_MAX - freed ? UINT64_MAX : fs[k].room + freed;
    fs[k].asked = fs[k].asked > UINT64_MAX - bytes ? UINT64_MAX : fs[k].asked + bytes;
    fs[k].files++;
    return 1;
}

int ferry__fs_room_check(const char *const *dirs, const char *name, const uint64_t *bytes,
                         unsigned n, const char *what, ferry__errbuf *eb)
{
    fs_sum fs[64];
    unsigned nfs = 0;
    for (unsigned i = 0; i < n; i++)
        (void)add_file(fs, &nfs, FERRY__ARRAY_LEN(fs), dirs[i], name, bytes[i]);
    for (unsigned k = 0; k < nfs; k++)
        if (fs[k].asked > fs[k].room)
            return ferry__err_set(eb, -ENOSPC,
                                  "%s: the file system of %s has %llu bytes free and %u "
                                  "file%s on it ask %llu bytes in all (ENOSPC), before any "
                                  "block was taken; accepted: sizes that fit there together, "
                                  "or free space first",
                                  what, fs[k].dir, (unsigned long long)fs[k].room, fs[k].files,
                                  fs[k].files == 1 ? "" : "s", (unsigned long long)fs[k].asked);
    return 0;
}
