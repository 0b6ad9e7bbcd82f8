/*
 * dirlock.c - one owner per tier directory, and the modes ferry creates with.
 *
 * A tier directory (an L2 slab, a persistent slab, a GDS context's drive)
 * has exactly one opener at a time: two stores writing one slab file hand
 * each other's bytes back. The owner holds an open file description lock
 * (F_OFD_SETLK, write lock over the whole file) on DIR/ferry.lock. OFD
 * locks belong to the open file, not the process, so a second open in the
 * same process conflicts as one in another process does, and the kernel
 * drops the lock when the owner dies: a crash never leaves a stale lock.
 * The owner writes its pid into the file so a refused opener can name it
 * (the lock itself cannot: F_OFD_GETLK reports pid -1).
 *
 * A lock counts only on the file the name has: an opener refused after it
 * made the lock file removes it again (pslab), and whoever opened that file
 * before the removal and locked it after would hold a lock no later opener
 * sees - two owners. So once the lock is held, the descriptor's file is
 * compared with the name's (device and inode), and on a difference it is
 * let go and the name's file opened and locked again.
 *
 * Fork: a forked child inherits the owner's descriptor, and with it a
 * reference to the locked description: the lock would then outlive the
 * owner's unlock (and the owner's death) for as long as the child lives
 * (a worker, a DataLoader process), and the owner could not reopen its
 * own directory. So the held locks' descriptors are listed (held_mu), and
 * pthread_atfork replaces each in the child by /dev/null (dup2: the number
 * stays taken, so a later unlock of it in the child closes nothing of the
 * child's own), which drops the child's reference to the lock. The
 * handlers are registered once, before held_mu is first taken.
 *
 * Modes: files 0600 and directories 0700 unless the caller gives a mode
 * (0660 for a deliberate group, say); a directory gets the execute bit
 * wherever the file mode has the read bit.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core.h"
#include "dirlock.h"

unsigned ferry__file_mode(unsigned mode)
{
    return mode ? (mode & 0666u) : 0600u;
}

unsigned ferry__dir_mode(unsigned mode)
{
    unsigned m = ferry__file_mode(mode);
    return m | ((m & 0444u) >> 2);
}

int ferry__mode_check(unsigned mode, const char *what, ferry__errbuf *eb)
{
    if (mode & ~0666u)
        return ferry__err_set(eb, -EINVAL,
                              "%s: mode 0%o: only read and write bits (0666) may be given, "
                              "0 means 0600",
                              what, mode);
    if (mode && !(mode & 0600u))
        return ferry__err_set(eb, -EINVAL, "%s: mode 0%o leaves the owner without access", what,
                              mode);
    return 0;
}

static _Atomic(ferry__dirlock_seam_fn) g_seam;

void ferry__dirlock_seam(ferry__dirlock_seam_fn fn)
{
    atomic_store(&g_seam, fn);
}

static void seam(int step, const char *path)
{
    ferry__dirlock_seam_fn fn = atomic_load(&g_seam);
    if (fn)
        fn(step, path);
}

/* the name p[s..i) is empty, "." or "..": no directory a mkdir makes */
static int no_new_name(const char *p, size_t s, size_t i)
{
    size_t len = i - s;
    return len == 0 || (len == 1 && p[s] == '.') || (len == 2 && p[s] == '.' && p[s + 1] == '.');
}

/* rmdir p's directories deepest first from the one that ends before
 * `end` up to (not) the one ending at `own`, while empty ("." and ".."
 * name none): those a failed ferry__mkdir_p_made made */
static void unmake(char *p, size_t end, size_t own)
{
    while (end > 0 && p[end - 1] == '/')
        end--;
    while (end > own) {
        p[end] = 0;
        size_t s = end;
        while (s > 0 && p[s - 1] != '/')
            s--;
        if (!no_new_name(p, s, end))
            rmdir(p);
        while (s > 0 && p[s - 1] == '/')
            s--;
        end = s;
    }
}

/* one pass of mkdir over the names of dir (n bytes, copied into p): 0
 * and *own, *last (the end of the last name that was there, of the last
 * name tried), 1 where a name's parent, there a moment before, is gone
 * (another opener's cleanup removed the empty directory it made: a new
 * pass makes it) and `again`, or -errno set in eb; a pass that does not
 * return 0 removes the directories it made */
static int make_pass(char *p, const char *dir, size_t n, unsigned mode, int again, size_t *own,
                     size_t *last, ferry__errbuf *eb)
{
    *own = *last = 0;
    memcpy(p, dir, n + 1);
    for (size_t i = 1, s = p[0] == '/'; i <= n; i++) {
        if (p[i] != '/' && p[i] != 0)
            continue;
        size_t at = s;
        s = i + 1;
        if (no_new_name(p, at, i))
            continue;
        char c = p[i];
        p[i] = 0;
        seam(FERRY__DIRLOCK_MKDIR, p);
        int r = mkdir(p, (mode_t)ferry__dir_mode(mode));
        p[i] = c;
        size_t prev = *last;
        *last = i;
        if (r == 0)
            continue;
        if (errno != EEXIST) {
            int e = errno;
            if (e == ENOENT && prev && again) {
                unmake(p, at, *own);
                return 1;
            }
            ferry__err_set(eb, -e, "mkdir %s: %s", (p[i] = 0, p), strerror(e));
            unmake(p, at, *own); /* (a failed call leaves none of its own) */
            return -e;
        }
        *own = i;
    }
    return 0;
}

int ferry__mkdir_p(const char *dir, unsigned mode, int create, ferry__errbuf *eb)
{
    return ferry__mkdir_p_made(dir, mode, create, NULL, eb);
}

int ferry__mkdir_p_made(const char *dir, unsigned mode, int create, size_t *kept,
                        ferry__errbuf *eb)
{
    char p[4096];
    size_t n = dir ? strlen(dir) : 0;
    if (kept)
        *kept = n;
    if (n == 0 || n >= sizeof p)
        return ferry__err_set(eb, -EINVAL, "directory name %s", n ? "too long" : "empty");
    struct stat st;
    if (!create) {
        if (stat(dir, &st) < 0) {
            int e = errno;
            return ferry__err_set(eb, -e, "directory %s: %s", dir, strerror(e));
        }
    } else {
        /* a directory is this call's only when its mkdir returned 0: one
         * there already (EEXIST), made by another meanwhile too, is not.
         * One there that another's cleanup removes (empty) before this
         * call made the next name in it is made again (a few times) */
        size_t last = 0, own = 0;
        int rc, tries = 0;
        while ((rc = make_pass(p, dir, n, mode, ++tries < 16, &own, &last, eb)) == 1)
            ;
        if (rc < 0)
            return rc;
        if (kept)
            *kept = own == last ? n : own;
        if (stat(dir, &st) < 0) {
            int e = errno;
            return ferry__err_set(eb, -e, "directory %s: %s", dir, strerror(e));
        }
    }
    if (!S_ISDIR(st.st_mode))
        return ferry__err_set(eb, -ENOTDIR, "%s is not a directory", dir);
    return 0;
}

/* the descriptors of the locks this process holds (see Fork above) */
static pthread_mutex_t held_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t held_once = PTHREAD_ONCE_INIT;
static int *held_fds;
static size_t nheld, held_cap;

static void held_take(void)
{
    pthread_mutex_lock(&held_mu);
}

static void held_give(void)
{
    pthread_mutex_unlock(&held_mu);
}

/* in a forked child: its copies of the parent's lock descriptors become
 * /dev/null (or /, where there is none), the locks the parent's alone */
static void held_drop_in_child(void)
{
    int nul = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (nul < 0)
        nul = open("/", O_RDONLY | O_CLOEXEC);
    for (size_t i = 0; i < nheld && nul >= 0; i++)
        if (held_fds[i] != nul)
            dup3(nul, held_fds[i], O_CLOEXEC);
    if (nul >= 0)
        close(nul);
    nheld = 0; /* none of them is the child's */
    pthread_mutex_unlock(&held_mu);
}

static void held_atfork(void)
{
    pthread_atfork(held_take, held_give, held_drop_in_child);
}

static int held_add(int fd)
{
    pthread_once(&held_once, held_atfork);
    pthread_mutex_lock(&held_mu);
    int rc = 0;
    if (nheld == held_cap) {
        size_t cap = held_cap ? 2 * held_cap : 16;
        int *h = ferry__realloc(held_fds, cap * sizeof *h);
        if (h) {
            held_fds = h;
            held_cap = cap;
        } else {
            rc = -ENOMEM;
        }
    }
    if (rc == 0)
        held_fds[nheld++] = fd;
    pthread_mutex_unlock(&held_mu);
    return rc;
}

static void held_remove(int fd)
{
    pthread_once(&held_once, held_atfork);
    pthread_mutex_lock(&held_mu);
    for (size_t i = 0; i < nheld; i++)
        if (held_fds[i] == fd) {
            held_fds[i] = held_fds[--nheld];
            break;
        }
    pthread_mutex_unlock(&held_mu);
}

static int holder_pid(int fd)
{
    char b[32];
    ssize_t k = pread(fd, b, sizeof b - 1, 0);
    if (k <= 0)
        return 0;
    b[k] = 0;
    int pid = 0;
    return sscanf(b, "%d", &pid) == 1 && pid > 0 ? pid : 0;
}

static int lock_fd(int fd, short type, int wait)
{
    struct flock fl;
    memset(&fl, 0, sizeof fl);
    fl.l_type = type;
    fl.l_whence = SEEK_SET;
    for (;;) {
        if (fcntl(fd, wait ? F_OFD_SETLKW : F_OFD_SETLK, &fl) == 0)
            return 0;
        if (errno != EINTR)
            return -errno;
    }
}

/* the lock of path's file, opened (created but where a shared lock may
 * not): 0 and *fd, 1 (the lock is another's: *fd still open, to name its
 * holder), or -errno set in eb */
static int lock_file(const char *path, unsigned mode, int shared, const char *what,
                     ferry__errbuf *eb, int *fd)
{
    *fd = open(path, (shared ? O_RDONLY : O_RDWR) | O_CREAT | O_CLOEXEC,
               (mode_t)ferry__file_mode(mode));
    if (*fd < 0 && shared && (errno == EACCES || errno == EROFS))
        *fd = open(path, O_RDONLY | O_CLOEXEC);
    if (*fd < 0) {
        int e = errno;
        return ferry__err_set(eb, -e, "%s: lock file %s: %s", what, path, strerror(e));
    }
    seam(FERRY__DIRLOCK_LOCK, path);
    int rc = lock_fd(*fd, shared ? F_RDLCK : F_WRLCK, 0);
    if (rc == -EAGAIN || rc == -EACCES)
        return 1;
    if (rc < 0) {
        close(*fd);
        *fd = -1;
        return ferry__err_set(eb, rc, "%s: locking %s: %s", what, path, strerror(-rc));
    }
    return 0;
}

/* fd's file is the one path names now */
static int still_named(int fd, const char *path)
{
    struct stat a, b;
    return fstat(fd, &a) == 0 && stat(path, &b) == 0 && a.st_dev == b.st_dev &&
           a.st_ino == b.st_ino;
}

int ferry__dir_lock(const char *dir, unsigned mode, int shared, const char *what,
                    ferry__errbuf *eb, int *fd_out)
{
    char path[4200];
    if (!dir || !*dir || !fd_out)
        return ferry__err_set(eb, -EINVAL, "%s: no directory to lock", what);
    if ((size_t)snprintf(path, sizeof path, "%s/%s", dir, FERRY__LOCK_FILE) >= sizeof path)
        return ferry__err_set(eb, -ENAMETOOLONG, "%s: directory name %s too long", what, dir);
    /* the lock counts only on the file the name has once it is held: an
     * opener that made the lock file removes it when it is refused (pslab),
     * and a lock on the file it removed is one no later opener sees */
    int fd = -1, rc = 0, tries = 0;
    while ((rc = lock_file(path, mode, shared, what, eb, &fd)) == 0 && !still_named(fd, path)) {
        close(fd);
        fd = -1;
        if (++tries == 100)
            return ferry__err_set(eb, FERRY_EBUSY, "%s: lock file %s keeps being replaced "
                                  "while it is taken", what, path);
    }
    if (rc < 0)
        return rc;
    if (rc == 1) {
        int pid = holder_pid(fd);
        close(fd);
        if (pid)
            return ferry__err_set(eb, FERRY_EBUSY,
                                  "%s: directory %s is in use by process %d (lock %s); one "
                                  "directory has one owner: give each rank and store its own",
                                  what, dir, pid, path);
        return ferry__err_set(eb, FERRY_EBUSY,
                              "%s: directory %s is in use by another opener (lock %s); one "
                              "directory has one owner: give each rank and store its own",
                              what, dir, path);
    }
    if (held_add(fd) < 0) {
        close(fd);
        return ferry__err_set(eb, -ENOMEM, "%s: listing the lock on %s: out of memory", what,
                              path);
    }
    if (!shared) {
        char b[32];
        int k = snprintf(b, sizeof b, "%d\n", (int)getpid());
        if (ftruncate(fd, 0) < 0 || pwrite(fd, b, (size_t)k, 0) != k)
            FERRY_LOGD("%s: writing the owner's pid into %s: %s", what, path, strerror(errno));
    }
    *fd_out = fd;
    return 0;
}

void ferry__dir_unlock(int fd)
{
    if (fd < 0)
        return;
    held_remove(fd);
    close(fd); /* closing the description drops its OFD lock */
}

int ferry__dir_lock_holder(const char *dir)
{
    char path[4200];
    if (!dir || (size_t)snprintf(path, sizeof path, "%s/%s", dir, FERRY__LOCK_FILE) >= sizeof path)
        return 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    struct flock fl;
    memset(&fl, 0, sizeof fl);
    fl.l_type = F_WRLCK;
    fl.l_whence = SEEK_SET;
    int held = 0;
    if (fcntl(fd, F_OFD_GETLK, &fl) == 0 && fl.l_type != F_UNLCK) {
        held = holder_pid(fd);
        if (!held)
            held = -1;
    }
    close(fd);
    return held;
}
