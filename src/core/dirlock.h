/*
 * dirlock.h - one owner per tier directory; creation modes. Private.
 *
 * pre: dir names a directory (ferry__dir_lock does not create it: call
 * ferry__mkdir_p first). The lock lives until ferry__dir_unlock(fd) or the
 * owner's death; a second opener, in this process or another, gets
 * FERRY_EBUSY with a message naming the directory and the holder's pid.
 */
#ifndef FERRY_SRC_DIRLOCK_H
#define FERRY_SRC_DIRLOCK_H

#include "core.h"

#define FERRY__LOCK_FILE "ferry.lock"

/* the mode ferry creates files with: mode, or 0600 when mode is 0 */
unsigned ferry__file_mode(unsigned mode);
/* the directory mode that goes with it: 0600 -> 0700, 0660 -> 0770 */
unsigned ferry__dir_mode(unsigned mode);
/* a mode option is 0 or read/write bits only, with the owner's rw: 0 or -EINVAL */
int ferry__mode_check(unsigned mode, const char *what, ferry__errbuf *eb);

/* make dir and its parents (ferry__dir_mode(mode)) when create, else only
 * check it exists; -ENOTDIR when it is not a directory */
int ferry__mkdir_p(const char *dir, unsigned mode, int create, ferry__errbuf *eb);

/* take DIR/ferry.lock: exclusive (owners), or shared (read-only checkers,
 * which exclude owners and are excluded by them). what names the caller
 * in messages ("kv L2", "pslab"). 0 and *fd_out, FERRY_EBUSY, or -errno */
int ferry__dir_lock(const char *dir, unsigned mode, int shared, const char *what,
                    ferry__errbuf *eb, int *fd_out);
void ferry__dir_unlock(int fd);

/* who owns dir now: its pid, -1 when owned by an unknown pid, 0 when free */
int ferry__dir_lock_holder(const char *dir);

#endif
