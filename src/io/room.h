/*
 * room.h - how many bytes a file system has for this process's files
 * (private; room.c): what ferry_file_allocate checks a file's growth
 * against, and what the striped slabs (src/gds, src/pslab) check the sum
 * of their parts against before any part is made.
 */
#ifndef FERRY_SRC_IO_ROOM_H
#define FERRY_SRC_IO_ROOM_H

#include <stdatomic.h>
#include <stdint.h>
#include <sys/vfs.h>

#include "core/core.h"

/* the bytes the file system of fd (a file or a directory on it) has free
 * for this process into *room: its blocks available to anyone, and those
 * it keeps for root (ext4's reserve) too where the process is the host's
 * root; btrfs keeps none (its free blocks less those available are not a
 * root reserve, nobody may take them). 0, or -errno of fstatfs; -ENOTSUP
 * where it says nothing of its size (no blocks: a pseudo file system) */
int ferry__fs_room(int fd, uint64_t *room);

/*
 * The files dirs[i]/name (made anew: what one holds now is freed first)
 * of bytes[i] each, checked per file system (st_dev: several directories
 * of one drive share its free space) before any is made: 0 where each
 * file system has room for its files together, else -ENOSPC into eb,
 * "<what>: ..." naming the file system (a directory on it), its free
 * bytes and the total its files ask. A directory still to be made is
 * counted on its nearest existing ancestor's; one neither stat nor statfs
 * answers for is left to the allocation itself.
 */
int ferry__fs_room_check(const char *const *dirs, const char *name, const uint64_t *bytes,
                         unsigned n, const char *what, ferry__errbuf *eb);

/* test seam: while set, what fstatfs answers (f_type, the block counts) */
extern int (*_Atomic ferry__test_fstatfs)(int fd, struct statfs *st);

#endif
