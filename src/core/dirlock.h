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
 * check it exists; -ENOTDIR when it is not a directory. A parent that was
 * there but is removed before the name in it is made (the empty directory
 * of another opener's cleanup) is made again, a few times at most */
int ferry__mkdir_p(const char *dir, unsigned mode, int create, ferry__errbuf *eb);
/* the same, and *kept (kept non-NULL): the length of dir's longest prefix
 * this call did not make - every directory below it was made by this
 * call's mkdir (returned 0; one another made meanwhile is not), strlen(dir)
 * when it made none. A failed call removes the directories it made (while
 * empty) and sets *kept to strlen(dir) */
int ferry__mkdir_p_made(const char *dir, unsigned mode, int create, size_t *kept,
                        ferry__errbuf *eb);

/* take DIR/ferry.lock: exclusive (owners), or shared (read-only checkers,
 * which exclude owners and are excluded by them), on the file the name
 * has once the lock is held (one removed meanwhile is let go, and the name's
 * new file locked). what names the caller in messages ("kv L2", "pslab").
 * 0 and *fd_out, FERRY_EBUSY, or -errno */
int ferry__dir_lock(const char *dir, unsigned mode, int shared, const char *what,
                    ferry__errbuf *eb, int *fd_out);
void ferry__dir_unlock(int fd);

/*
 * Test seam (not API): fn, when set (NULL: none), is called just before
 * ferry__mkdir_p's mkdir of each prefix (FERRY__DIRLOCK_MKDIR, the prefix)
 * and between ferry__dir_lock's open of the lock file and its lock
 * (FERRY__DIRLOCK_LOCK, the lock file's path): what another process does
 * in those gaps, a test does there.
 */
enum { FERRY__DIRLOCK_MKDIR = 1, FERRY__DIRLOCK_LOCK = 2 };
typedef void (*ferry__dirlock_seam_fn)(int step, const char *path);
void ferry__dirlock_seam(ferry__dirlock_seam_fn fn);

/* who owns dir now: its pid, -1 when owned by an unknown pid, 0 when free */
int ferry__dir_lock_holder(const char *dir);

#endif
