/*
 * pslab_mark.c - the reset-in-progress marker (FERRY_PSLAB_RESET_MARK in
 * every drive's directory).
 *
 * A reset drops the journal and rewrites every drive's slab file; a crash
 * part way leaves no journal, so nothing else says which directories were
 * one slab, and a reset given the first drive alone would make a new
 * one-drive slab of the whole size there, the other drives orphaned. So
 * before a reset touches anything it writes, in every directory given, a
 * marker naming all of them (device and inode, and the path for
 * messages), durably (a temporary file synced, renamed into place, the
 * directory synced); it removes them last, once the new store's journal
 * is in place (the first directory's last). An open that finds a marker
 * in any directory it is given is refused (FERRY_EMISMATCH, nothing
 * changed) unless it is given exactly the drives the marker names, and
 * the refusal names the first one missing (a drive is known by its inode
 * and device, or by its inode and real path: st_dev is the block device's
 * number, which the boot after a crash may give otherwise). A writable
 * open given them removes the markers once its store is whole.
 *
 * It keeps the slab's size, stripe, alignment and tag too, so a reset
 * that finds the first drive's header gone (the crash came between its
 * truncation and its rewrite) still recreates the slab as it was.
 *
 * Layout: magic "FERRYPRM", u32 version (1), u32 drives, u64 bytes, u64
 * stripe, u32 alignment, u32 tag length, the tag; per drive u64 device,
 * u64 inode, u32 path length, the path; then the XXH3-64 of all that.
 * Little-endian. The marker's own I/O goes through the syscall
 * table (io/sys.h), so the power-loss tests crash inside it too.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include "io/sys.h"
#include "le.h"
#include "pslab/pslab_impl.h"

#define MARK_MAGIC "FERRYPRM"
#define MARK_VERSION 1u
#define MARK_HEAD 40u
#define MARK_MAX (MARK_HEAD + FERRY_PSLAB_TAG_MAX + FERRY_PSLAB_MAX_DIRS * (20u + PATH_MAX_) + 8u)

typedef struct mark {
    ferry__pslab_markgeo g;
    unsigned n;
    uint64_t dev[FERRY_PSLAB_MAX_DIRS], ino[FERRY_PSLAB_MAX_DIRS];
    char path[FERRY_PSLAB_MAX_DIRS][PATH_MAX_];
} mark;

static void mark_path(const ferry_pslab *p, unsigned i, const char *suffix, char *out, size_t n)
{
    snprintf(out, n, "%s/%s%s", p->dirs[i], FERRY_PSLAB_RESET_MARK, suffix);
}

/* the marker of p's directories into buf: its length, or a negative code */
static int mark_encode(ferry_pslab *p, const ferry__pslab_markgeo *g, uint8_t *buf, size_t cap,
                       size_t *len)
{
    memcpy(buf, MARK_MAGIC, 8);
    ferry__put32(buf + 8, MARK_VERSION);
    ferry__put32(buf + 12, p->n_dirs);
    ferry__put64(buf + 16, g->bytes);
    ferry__put64(buf + 24, g->stripe);
    ferry__put32(buf + 32, g->alignment);
    ferry__put32(buf + 36, g->tag_len);
    memcpy(buf + MARK_HEAD, g->tag, g->tag_len);
    size_t off = MARK_HEAD + g->tag_len;
    for (unsigned i = 0; i < p->n_dirs; i++) {
        struct stat st;
        if (stat(p->dirs[i], &st) != 0)
            return ferry__pslab_fail(p, -errno, "pslab: reset: directory %s: %s", p->dirs[i],
                                     strerror(errno));
        char real[PATH_MAX_];
        const char *name = realpath(p->dirs[i], real) ? real : p->dirs[i];
        size_t pl = strlen(name);
        if (off + 20 + pl + 8 > cap)
            return ferry__pslab_fail(p, -ENAMETOOLONG, "pslab: reset: directory %s: path too "
                                     "long for the reset marker", p->dirs[i]);
        ferry__put64(buf + off, (uint64_t)st.st_dev);
        ferry__put64(buf + off + 8, (uint64_t)st.st_ino);
        ferry__put32(buf + off + 16, (uint32_t)pl);
        memcpy(buf + off + 20, name, pl);
        off += 20 + pl;
    }
    ferry__put64(buf + off, XXH3_64bits(buf, off));
    *len = off + 8;
    return 0;
}

static int mark_decode(const uint8_t *b, size_t len, mark *m)
{
    if (len < MARK_HEAD + 8 || memcmp(b, MARK_MAGIC, 8) != 0 ||
        ferry__get32(b + 8) != MARK_VERSION)
        return FERRY_ECORRUPT;
    if (ferry__get64(b + len - 8) != XXH3_64bits(b, len - 8))
        return FERRY_ECORRUPT;
    m->n = ferry__get32(b + 12);
    m->g.bytes = ferry__get64(b + 16);
    m->g.stripe = ferry__get64(b + 24);
    m->g.alignment = ferry__get32(b + 32);
    m->g.tag_len = ferry__get32(b + 36);
    if (m->n < 1 || m->n > FERRY_PSLAB_MAX_DIRS || m->g.tag_len > FERRY_PSLAB_TAG_MAX ||
        MARK_HEAD + m->g.tag_len > len - 8)
        return FERRY_ECORRUPT;
    memcpy(m->g.tag, b + MARK_HEAD, m->g.tag_len);
    size_t off = MARK_HEAD + m->g.tag_len;
    for (unsigned i = 0; i < m->n; i++) {
        if (off + 20 > len - 8)
            return FERRY_ECORRUPT;
        m->dev[i] = ferry__get64(b + off);
        m->ino[i] = ferry__get64(b + off + 8);
        uint32_t pl = ferry__get32(b + off + 16);
        if (pl >= PATH_MAX_ || off + 20 + pl > len - 8)
            return FERRY_ECORRUPT;
        memcpy(m->path[i], b + off + 20, pl);
        m->path[i][pl] = '\0';
        off += 20 + pl;
    }
    return off == len - 8 ? 0 : FERRY_ECORRUPT;
}

/* write all of buf to path through the syscall table, synced */
static int write_synced(const char *path, const uint8_t *buf, size_t len, unsigned mode)
{
    const ferry__sys *sys = ferry__sys_get();
    int fd = sys->open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, mode ? mode : 0600);
    if (fd < 0)
        return -errno;
    int rc = 0;
    for (size_t off = 0; off < len && rc == 0;) {
        ssize_t w = sys->pwrite(fd, buf + off, len - off, (off_t)off);
        if (w > 0)
            off += (size_t)w;
        else if (w < 0 && errno != EINTR)
            rc = -errno;
        else if (w == 0)
            rc = -EIO;
    }
    if (rc == 0 && sys->fdatasync(fd) != 0)
        rc = -errno;
    sys->close(fd);
    return rc;
}

int ferry__pslab_mark_write(ferry_pslab *p, const ferry__pslab_markgeo *g)
{
    uint8_t *buf = ferry__malloc(MARK_MAX);
    if (!buf)
        return ferry__pslab_fail(p, -ENOMEM, "pslab %s: out of memory", p->dirs[0]);
    size_t len = 0;
    int rc = mark_encode(p, g, buf, MARK_MAX, &len);
    for (unsigned i = 0; i < p->n_dirs && rc == 0; i++) {
        char tmp[PATH_MAX_ + 64], path[PATH_MAX_ + 64];
        mark_path(p, i, ".tmp", tmp, sizeof tmp);
        mark_path(p, i, "", path, sizeof path);
        if ((rc = write_synced(tmp, buf, len, p->mode)) < 0)
            rc = ferry__pslab_fail(p, rc, "pslab: reset: writing the reset marker %s: %s", tmp,
                                   strerror(-rc));
        else if (rename(tmp, path) != 0)
            rc = ferry__pslab_fail(p, -errno, "pslab: reset: renaming %s to %s: %s", tmp, path,
                                   strerror(errno));
        else if ((rc = ferry__pslab_fsync_dir(p->dirs[i])) < 0)
            rc = ferry__pslab_fail(p, rc, "pslab: reset: fsync of directory %s: %s",
                                   p->dirs[i], strerror(-rc));
    }
    ferry__free(buf);
    return rc;
}

int ferry__pslab_mark_clear(ferry_pslab *p)
{
    int rc = 0;
    for (unsigned k = p->n_dirs; k-- > 0 && rc == 0;) {
        char path[PATH_MAX_ + 64];
        mark_path(p, k, ".tmp", path, sizeof path);
        unlink(path); /* (a marker's write that a crash cut short) */
        mark_path(p, k, "", path, sizeof path);
        if (unlink(path) != 0 && errno != ENOENT)
            rc = ferry__pslab_fail(p, -errno, "pslab: removing the reset marker %s: %s", path,
                                   strerror(errno));
        else
            rc = ferry__pslab_fsync_dir(p->dirs[k]);
    }
    return rc;
}

/* read the marker at path into m: 0, 1 when there is none, or a code */
static int mark_read(const char *path, uint8_t *buf, mark *m)
{
    const ferry__sys *sys = ferry__sys_get();
    int fd = sys->open(path, O_RDONLY | O_CLOEXEC, 0);
    if (fd < 0)
        return errno == ENOENT ? 1 : -errno;
    size_t len = 0;
    int rc = 0;
    for (;;) {
        ssize_t r = sys->pread(fd, buf + len, MARK_MAX - len, (off_t)len);
        if (r > 0 && (len += (size_t)r) < MARK_MAX)
            continue;
        if (r < 0 && errno == EINTR)
            continue;
        rc = r < 0 ? -errno : len == MARK_MAX ? FERRY_ECORRUPT : 0;
        break;
    }
    sys->close(fd);
    return rc < 0 ? rc : mark_decode(buf, len, m);
}

/* directory dir is the marker's drive k: the same inode on the same device,
 * or, the device numbered otherwise (the boot after the crash that left the
 * marker may enumerate the drives in another order: st_dev is the block
 * device's number), the same inode at the same real path */
static int same_dir(const char *dir, const mark *m, unsigned k)
{
    struct stat st;
    if (stat(dir, &st) != 0 || (uint64_t)st.st_ino != m->ino[k])
        return 0;
    if ((uint64_t)st.st_dev == m->dev[k])
        return 1;
    char real[PATH_MAX_];
    return realpath(dir, real) && strcmp(real, m->path[k]) == 0;
}

/* the marker m (read from path) names exactly p's directories: 0, else
 * FERRY_EMISMATCH naming the first drive missing (or the one too many) */
static int mark_match(ferry_pslab *p, const mark *m, const char *path)
{
    int given[FERRY_PSLAB_MAX_DIRS] = {0};
    for (unsigned k = 0; k < m->n; k++) {
        unsigned i = 0;
        for (; i < p->n_dirs; i++)
            if (same_dir(p->dirs[i], m, k))
                break;
        if (i == p->n_dirs)
            return ferry__pslab_fail(p, FERRY_EMISMATCH,
                                     "pslab: a reset of the slab on %u drive(s) was interrupted "
                                     "(marker %s): its drive %u of %u, %s, is not among the "
                                     "%u directories given; nothing was changed. Give every "
                                     "drive of the slab (a reset then completes), or remove %s "
                                     "from each directory to give the drive up", m->n, path,
                                     k + 1, m->n, m->path[k], p->n_dirs, FERRY_PSLAB_RESET_MARK);
        given[i] = 1;
    }
    for (unsigned i = 0; i < p->n_dirs; i++)
        if (!given[i])
            return ferry__pslab_fail(p, FERRY_EMISMATCH,
                                     "pslab: a reset of the slab on %u drive(s) was interrupted "
                                     "(marker %s): directory %s is not one of its drives (%u "
                                     "directories given); nothing was changed", m->n, path,
                                     p->dirs[i], p->n_dirs);
    return 0;
}

int ferry__pslab_mark_check(ferry_pslab *p, int *found, ferry__pslab_markgeo *g)
{
    *found = 0;
    uint8_t *buf = ferry__malloc(MARK_MAX);
    mark *m = ferry__malloc(sizeof *m);
    int rc = buf && m ? 0 : ferry__pslab_fail(p, -ENOMEM, "pslab %s: out of memory", p->dirs[0]);
    for (unsigned i = 0; i < p->n_dirs && rc == 0; i++) {
        char path[PATH_MAX_ + 64];
        mark_path(p, i, "", path, sizeof path);
        int r = mark_read(path, buf, m);
        if (r == 1)
            continue;
        if (r < 0)
            rc = ferry__pslab_fail(p, r, "pslab: reset marker %s (a reset of this slab was "
                                   "interrupted) cannot be read: %s; nothing was changed. Reset "
                                   "again with every drive of the slab after removing it from "
                                   "each directory", path, ferry_strerror(r));
        else if ((rc = mark_match(p, m, path)) == 0 && !*found) {
            *found = 1;
            *g = m->g;
        }
    }
    ferry__free(buf);
    ferry__free(m);
    return rc;
}
