/*
 * pslab_open.c - the persistent slab's life: options, create, reset, open
 * and close.
 *
 * Invariant: one owner per directory - open takes each directory's lock
 * before it touches any other file there - and a store exists only once
 * its journal does: create writes and syncs every slab file's header first
 * and renames the journal into place last, and a reset removes the journal
 * first, so a crash in either leaves no store or a whole one, never a mix.
 * An open that fails frees all it made and keeps the first failure's
 * message; on disk it leaves what it found: the files of ours it made in
 * a directory whose lock it held (the lock file last, still held: a
 * later opener of the name finds its own file, and one that opened the
 * removed file meanwhile sees it is not the name's and locks again) and
 * the directories it made (empty by then), never a file or directory
 * that was there before. A close commits what is queued and leaves a history-free
 * journal, so a record damaged later can only cost its own chunk.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#include "core/dirlock.h"
#include "io/room.h"
#include "pslab/pslab_impl.h"
#include "sized.h"

_Atomic unsigned ferry__pslab_test_format;

static uint64_t new_creation_id(void)
{
    uint64_t id = 0;
    if (getrandom(&id, sizeof id, 0) != (ssize_t)sizeof id || id == 0) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        uint64_t mix[3] = {(uint64_t)ts.tv_sec, (uint64_t)ts.tv_nsec, (uint64_t)getpid()};
        id = XXH3_64bits(mix, sizeof mix) | 1;
    }
    return id;
}

static int create_store(ferry_pslab *p, const ferry__pslab_geom *g)
{
    lane *l = &p->cl;
    uint8_t *blk = NULL;
    int rc = ferry_io_buffer_alloc(l->io, p->data_off, (void **)&blk);
    if (rc < 0)
        return ferry__err_set(&p->err, -ENOMEM, "pslab %s: out of memory creating", p->dirs[0]);
    memset(blk, 0, p->data_off);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    /* the parts on one file system together, before any is made: checked
     * one by one, each fits where their sum does not, and the last one's
     * allocate fails after those before it filled the disk */
    uint64_t part[FERRY_PSLAB_MAX_DIRS];
    for (unsigned i = 0; i < g->drives; i++)
        part[i] = p->data_off + p->share;
    rc = ferry__fs_room_check((const char *const *)p->dirs, FERRY_PSLAB_FILE, part, g->drives,
                              "pslab: creating the slab files", &p->err);
    for (unsigned i = 0; i < g->drives && rc >= 0; i++) {
        char path[PATH_MAX_];
        ferry__pslab_slab_path(p, i, path, sizeof path);
        ferry_file *f = NULL;
        unsigned fl = FERRY_FILE_READ | FERRY_FILE_WRITE | FERRY_FILE_CREATE | FERRY_FILE_TRUNC;
        if (p->direct)
            fl |= FERRY_FILE_DIRECT;
        rc = ferry_file_open_mode(l->io, path, fl, p->mode, &f);
        if (rc < 0) {
            rc = ferry__pslab_fail_io(p, rc, "pslab: creating slab file %s", path);
            break;
        }
        rc = ferry_file_allocate(f, 0, p->data_off + p->share);
        if (rc < 0) {
            rc = ferry__pslab_fail_io(p, rc, "pslab: reserving %llu bytes for slab file %s",
                                      (unsigned long long)(p->data_off + p->share), path);
        } else {
            ferry__pslab_hdr h;
            memset(&h, 0, sizeof h);
            /* (the header's layout is format 2's: an older library reads it) */
            h.version = FERRY__MIN(ferry__pslab_write_format(), FERRY__PSLAB_HDR_VERSION);
            h.g = *g;
            h.drive = i;
            h.created_ns = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
            h.tag = p->tag;
            h.tag_len = p->tag_len;
            memset(blk, 0, p->data_off);
            ferry__pslab_hdr_encode(&h, blk);
            rc = ferry_io_pwrite(l->io, f, blk, p->data_off, 0);
            if (rc == 0)
                rc = ferry_file_sync(f);
            if (rc < 0)
                rc = ferry__pslab_fail_io(p, rc, "pslab: writing the header of slab file %s", path);
        }
        ferry_file_close(f);
    }
    if (rc >= 0) {
        /* the journal last: its presence says the slab files are complete */
        char tmp[PATH_MAX_];
        snprintf(tmp, sizeof tmp, "%s/%s", p->dirs[0], FERRY__PSLAB_JOURNAL_TMP);
        ferry__pslab_jhdr jh;
        jh.version = ferry__pslab_write_format();
        jh.g = *g;
        jh.generation = 0;
        ferry__pslab_jhdr_encode(&jh, blk);
        ferry_file *f = NULL;
        rc = ferry_file_open_mode(l->io, tmp,
                                  FERRY_FILE_READ | FERRY_FILE_WRITE | FERRY_FILE_CREATE |
                                      FERRY_FILE_TRUNC,
                                  p->mode, &f);
        if (rc == 0 && (rc = ferry_io_pwrite(l->io, f, blk, FERRY__PSLAB_JHDR_BYTES, 0)) == 0)
            rc = ferry_file_sync(f);
        if (rc < 0)
            rc = ferry__pslab_fail_io(p, rc, "pslab: creating journal %s", tmp);
        ferry_file_close(f);
        if (rc == 0 && rename(tmp, p->jpath) != 0)
            rc = ferry__err_set(&p->err, -errno, "pslab: rename %s -> %s: %s", tmp, p->jpath,
                                strerror(errno));
        if (rc == 0 && (rc = ferry__pslab_fsync_dir(p->dirs[0])) < 0)
            rc = ferry__err_set(&p->err, rc, "pslab: fsync of directory %s: %s", p->dirs[0],
                                strerror(-rc));
        if (rc < 0)
            unlink(tmp);
    }
    ferry_io_buffer_free(l->io, blk);
    return rc;
}

/*
 * No journal in dirs[0]: before creating (which truncates the slab files),
 * make sure the directories do not hold another store given in another
 * order - a journal in a later directory, or a valid slab header in
 * dirs[0] that says it is not drive 0.
 */
static int refuse_foreign(ferry_pslab *p)
{
    for (unsigned i = 0; i < p->n_dirs; i++) {
        char path[PATH_MAX_];
        struct stat st;
        snprintf(path, sizeof path, "%s/%s", p->dirs[i], FERRY_PSLAB_JOURNAL);
        if (i > 0 && stat(path, &st) == 0)
            return ferry__pslab_fail(p, FERRY_EMISMATCH, "pslab: directory %u (%s) holds the "
                                     "journal of a store (its first drive): directories in "
                                     "another order?", i, p->dirs[i]);
        ferry__pslab_slab_path(p, i, path, sizeof path);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0)
            continue;
        uint8_t blk[FERRY__PSLAB_HDR_BYTES + FERRY_PSLAB_TAG_MAX];
        ssize_t n = pread(fd, blk, sizeof blk, 0);
        close(fd);
        ferry__pslab_hdr h;
        if (n >= (ssize_t)FERRY__PSLAB_HDR_BYTES &&
            ferry__pslab_hdr_decode(blk, (size_t)n, &h, NULL, 0) == 0 && h.drive != i)
            return ferry__pslab_fail(p, FERRY_EMISMATCH, "pslab: slab file %s is drive %u of a "
                                     "store but was given as directory %u (directories in "
                                     "another order)", path, h.drive, i);
    }
    return 0;
}

static void pslab_free(ferry_pslab *p)
{
    for (unsigned i = 0; i < p->nlanes; i++)
        ferry__pslab_lane_close(&p->lanes[i]);
    ferry__free(p->lanes);
    if (p->jf)
        ferry_file_close(p->jf);
    ferry__pslab_lane_close(&p->cl);
    if (p->alloc) {
        ferry__pslab_pend_discard(p, &p->cur);
        ferry__pslab_pend_discard(p, &p->spare);
    }
    ferry__free(p->cur.buf);
    ferry__free(p->cur.ops);
    ferry__free(p->spare.buf);
    ferry__free(p->spare.ops);
    ferry__pslab_index_fini(&p->idx);
    ferry_slab_destroy(p->alloc);
    for (unsigned i = 0; i < FERRY_PSLAB_MAX_DIRS; i++) {
        ferry__free(p->dirs[i]);
        ferry__dir_unlock(p->lockfd[i]);
    }
    ferry__free(p->tag);
    pthread_mutex_destroy(&p->mu);
    pthread_mutex_destroy(&p->lmu);
    pthread_mutex_destroy(&p->cmu);
    pthread_cond_destroy(&p->lcv);
    pthread_cond_destroy(&p->ccv);
    pthread_cond_destroy(&p->fcv);
    ferry__free(p);
}

/* directory i is none of the ones before it (by device and inode: another
 * spelling of a path, or a link to it, is the same directory): -EINVAL
 * naming both, where its lock would say this process holds it */
static int same_dir_twice(ferry_pslab *p, unsigned i)
{
    struct stat a, b;
    if (stat(p->dirs[i], &a) != 0)
        return 0; /* (what follows names a directory that is not there) */
    for (unsigned j = 0; j < i; j++)
        if (stat(p->dirs[j], &b) == 0 && a.st_dev == b.st_dev && a.st_ino == b.st_ino)
            return ferry__err_set(&p->err, -EINVAL, "ferry_pslab_open: directories %u (%s) "
                                  "and %u (%s) are one directory; give each drive's once",
                                  j, p->dirs[j], i, p->dirs[i]);
    return 0;
}

/* every option in range before any arithmetic on it: 0 or -EINVAL naming the field */
static int check_options(const ferry_pslab_options *o)
{
    if (!o->dirs || o->n_dirs < 1 || o->n_dirs > FERRY_PSLAB_MAX_DIRS)
        return ferry__err_set(NULL, -EINVAL, "ferry_pslab_open: %u directories (1..%u)",
                              o->n_dirs, FERRY_PSLAB_MAX_DIRS);
    for (unsigned i = 0; i < o->n_dirs; i++)
        if (!o->dirs[i] || !*o->dirs[i] || strlen(o->dirs[i]) > PATH_MAX_ - 64)
            return ferry__err_set(NULL, -EINVAL, "ferry_pslab_open: directory %u is empty or "
                                  "too long (at most %d bytes)", i, PATH_MAX_ - 64);
    if (o->alignment &&
        (o->alignment & (o->alignment - 1) || o->alignment < 512 || o->alignment > (1u << 30)))
        return ferry__err_set(NULL, -EINVAL, "ferry_pslab_open: alignment %zu is not a power "
                              "of two in [512, 1 GiB] (0: 4096 or the stored one)",
                              o->alignment);
    if (o->stripe_bytes > ((uint64_t)1 << 40) ||
        (o->stripe_bytes && o->alignment && o->stripe_bytes % o->alignment))
        return ferry__err_set(NULL, -EINVAL, "ferry_pslab_open: stripe_bytes %zu is not a "
                              "multiple of the alignment %zu up to 2^40", o->stripe_bytes,
                              o->alignment);
    if (o->bytes > ((uint64_t)1 << 56))
        return ferry__err_set(NULL, -EINVAL, "ferry_pslab_open: bytes %llu beyond 2^56",
                              (unsigned long long)o->bytes);
    if (o->sync != FERRY_PSLAB_SYNC_FULL && o->sync != FERRY_PSLAB_SYNC_NONE &&
        o->sync != FERRY_PSLAB_SYNC_BATCH)
        return ferry__err_set(NULL, -EINVAL, "ferry_pslab_open: unknown sync mode %d (0..2)",
                              o->sync);
    unsigned known = FERRY_PSLAB_CREATE | FERRY_PSLAB_READONLY | FERRY_PSLAB_RESET;
    if (o->flags & ~known)
        return ferry__err_set(NULL, -EINVAL, "ferry_pslab_open: unknown flags 0x%x", o->flags);
    if ((o->flags & FERRY_PSLAB_RESET) && (o->flags & FERRY_PSLAB_READONLY))
        return ferry__err_set(NULL, -EINVAL, "ferry_pslab_open: FERRY_PSLAB_RESET with "
                              "FERRY_PSLAB_READONLY");
    if (o->depth > 1024)
        return ferry__err_set(NULL, -EINVAL, "ferry_pslab_open: depth %u (0..1024)", o->depth);
    if (o->lanes > 32)
        return ferry__err_set(NULL, -EINVAL, "ferry_pslab_open: %u lanes (0..32)", o->lanes);
    if (o->compact_bytes > ((uint64_t)1 << 40) || o->batch_bytes > ((uint64_t)1 << 40))
        return ferry__err_set(NULL, -EINVAL, "ferry_pslab_open: compact_bytes %llu / "
                              "batch_bytes %llu: each at most 2^40",
                              (unsigned long long)o->compact_bytes,
                              (unsigned long long)o->batch_bytes);
    if (o->batch_ms > 3600000u)
        return ferry__err_set(NULL, -EINVAL, "ferry_pslab_open: batch_ms %u (0..3600000)",
                              o->batch_ms);
    if (o->tag_len > FERRY_PSLAB_TAG_MAX || (o->tag_len && !o->tag))
        return ferry__err_set(NULL, -EINVAL, "ferry_pslab_open: tag of %zu bytes (at most %u, "
                              "and tag must be given with tag_len)", o->tag_len,
                              FERRY_PSLAB_TAG_MAX);
    return ferry__mode_check(o->mode, "ferry_pslab_open", NULL);
}

/* the first drive's header, when readable: defaults for a reset */
static int old_header(ferry_pslab *p, ferry__pslab_hdr *h, uint8_t *blk)
{
    char path[PATH_MAX_];
    ferry__pslab_slab_path(p, 0, path, sizeof path);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -errno;
    ssize_t n = pread(fd, blk, FERRY__PSLAB_HDR_BLOCK, 0);
    close(fd);
    if (n < (ssize_t)FERRY__PSLAB_HDR_BYTES)
        return FERRY_ECORRUPT;
    return ferry__pslab_hdr_decode(blk, (size_t)n, h, NULL, 0);
}

/* a reset that failed with rc before it dropped the journal: nothing else
 * was changed, so the markers it wrote go too (unless an earlier reset's
 * were there: they still say what that one left); rc, its message kept */
static int unmark(ferry_pslab *p, int rc, int marked)
{
    if (!marked) {
        ferry__errbuf keep;
        ferry__err_copy(&keep, &p->err, rc);
        if (ferry__pslab_mark_clear(p) < 0)
            FERRY_LOGW("%s", ferry__err_msg(&p->err));
        ferry__err_copy(&p->err, &keep, rc);
    }
    return rc;
}

/*
 * FERRY_PSLAB_RESET: mark every directory as one slab being reset, then
 * drop the journal (without it the slab files are nobody's, so a crash
 * during the reset leaves no store, never a mix), then create a new store
 * over the old files; the open removes the markers once it is whole. A
 * crash part way leaves the markers: only an open given every drive goes
 * on (pslab_mark.c).
 */
static int reset_store(ferry_pslab *p, const ferry_pslab_options *o, ferry_pslab_options *eff,
                       ferry__pslab_markgeo *mg, int marked)
{
    uint8_t *blk = ferry__malloc(FERRY__PSLAB_HDR_BLOCK);
    if (!blk)
        return ferry__err_set(&p->err, -ENOMEM, "pslab %s: out of memory", p->dirs[0]);
    ferry__pslab_hdr h;
    *eff = *o;
    int hrc = old_header(p, &h, blk);
    int have = hrc == 0;
    if (!have && mg->bytes) {
        /* an interrupted reset's marker keeps what the header said */
        h.g.capacity = mg->bytes;
        h.g.alignment = mg->alignment;
        h.g.stripe = mg->stripe;
        h.tag_len = mg->tag_len;
        h.tag = mg->tag;
        have = 1;
    }
    if (!have && !o->bytes) {
        /* nothing to recreate the store from: say so before anything is dropped */
        char path[PATH_MAX_];
        ferry__pslab_slab_path(p, 0, path, sizeof path);
        ferry__free(blk);
        return ferry__err_set(&p->err, hrc == -ENOENT ? -ENOENT : hrc,
                              "pslab: reset of %s: slab file %s %s, so its size cannot be "
                              "kept: give one (options.bytes); nothing was changed", p->dirs[0],
                              path, hrc == -ENOENT ? "does not exist" : "has no readable header");
    }
    if (have) {
        if (!eff->bytes)
            eff->bytes = h.g.capacity;
        if (!eff->alignment)
            eff->alignment = h.g.alignment;
        if (!eff->stripe_bytes)
            eff->stripe_bytes = h.g.stripe;
        if (!eff->tag && h.tag_len) {
            ferry__free(p->tag);
            p->tag = ferry__malloc(h.tag_len);
            if (!p->tag) {
                ferry__free(blk);
                return ferry__err_set(&p->err, -ENOMEM, "pslab %s: out of memory", p->dirs[0]);
            }
            memcpy(p->tag, h.tag, h.tag_len);
            p->tag_len = h.tag_len;
        }
    }
    ferry__free(blk);
    /* before anything is touched: which directories are this slab, and
     * its size and tag, should the reset not finish (pslab_mark.c) */
    mg->bytes = eff->bytes;
    mg->stripe = eff->stripe_bytes;
    mg->alignment = (uint32_t)eff->alignment;
    mg->tag_len = p->tag_len;
    if (p->tag_len)
        memcpy(mg->tag, p->tag, p->tag_len);
    int rc = ferry__pslab_mark_write(p, mg);
    if (rc < 0)
        return unmark(p, rc, marked);
    char tmp[PATH_MAX_];
    snprintf(tmp, sizeof tmp, "%s/%s", p->dirs[0], FERRY__PSLAB_JOURNAL_TMP);
    unlink(tmp);
    if (unlink(p->jpath) != 0 && errno != ENOENT)
        return unmark(p, ferry__err_set(&p->err, -errno, "pslab: reset: removing journal %s: "
                                        "%s", p->jpath, strerror(errno)), marked);
    /* a journal in another drive's directory (the drives given in
     * another order than the store's, or a store that was one of them):
     * its store is dropped too, never left naming slab files the new
     * store takes */
    for (unsigned i = 0; i < p->n_dirs; i++) {
        char jp[PATH_MAX_];
        snprintf(jp, sizeof jp, "%s/%s", p->dirs[i], FERRY__PSLAB_JOURNAL_TMP);
        if (i > 0)
            unlink(jp);
        snprintf(jp, sizeof jp, "%s/%s", p->dirs[i], FERRY_PSLAB_JOURNAL);
        if (i > 0 && unlink(jp) != 0 && errno != ENOENT)
            return ferry__err_set(&p->err, -errno, "pslab: reset: removing journal %s: %s", jp,
                                  strerror(errno));
        rc = ferry__pslab_fsync_dir(p->dirs[i]);
        if (rc < 0)
            return ferry__err_set(&p->err, rc, "pslab: reset: fsync of directory %s: %s",
                                  p->dirs[i], strerror(-rc));
    }
    FERRY_LOGI("pslab %s: reset asked: the old store (if any) is dropped", p->dirs[0]);
    return 0;
}

/*
 * An open that may not create (READONLY, or no FERRY_PSLAB_CREATE) of a
 * first directory that holds no store - no journal, no lock file, and for
 * a reset no slab file either - is -ENOENT before any file is made there:
 * a check of a plain directory must not leave a lock file behind. (A lock
 * file there means an owner may be creating a store: the lock decides.)
 * 1: go on to the locks.
 */
static int nothing_here(ferry_pslab *p, const ferry_pslab_options *o)
{
    struct stat st;
    char path[PATH_MAX_];
    if (stat(p->dirs[0], &st) != 0 || !S_ISDIR(st.st_mode))
        return 1; /* the locking says what is wrong with it */
    if (stat(p->jpath, &st) == 0)
        return 1;
    snprintf(path, sizeof path, "%s/%s", p->dirs[0], FERRY_PSLAB_LOCK);
    if (stat(path, &st) == 0)
        return 1;
    int reset = (o->flags & FERRY_PSLAB_RESET) != 0;
    ferry__pslab_slab_path(p, 0, path, sizeof path);
    if (reset && stat(path, &st) == 0)
        return 1;
    return ferry__err_set(&p->err, -ENOENT, "pslab: no store in %s (no journal %s%s)%s",
                          p->dirs[0], p->jpath, reset ? ", no slab file" : "",
                          reset ? ": nothing to reset" : "; FERRY_PSLAB_CREATE creates one");
}

/*
 * Directory i (after the first) of an open that may not create and is no
 * reset, holding nothing of a store - no lock file, slab file or journal:
 * 1, and the open takes no lock there (a lock file made there would be
 * left behind: `ferry slab check a b c` of a slab on a and b). Such an
 * open fails on it (another count of drives, or no slab file) before it
 * reads anything there, and whoever makes a store there meanwhile cannot
 * make this one's drive i: that needs the first directory's lock, held.
 */
static int bare_later_dir(const ferry_pslab *p, const ferry_pslab_options *o, int mk, unsigned i)
{
    static const char *const names[] = {FERRY_PSLAB_LOCK, FERRY_PSLAB_FILE, FERRY_PSLAB_JOURNAL,
                                        FERRY_PSLAB_RESET_MARK};
    if (i == 0 || mk || (o->flags & FERRY_PSLAB_RESET))
        return 0;
    for (size_t k = 0; k < sizeof names / sizeof names[0]; k++) {
        char path[PATH_MAX_];
        struct stat st;
        snprintf(path, sizeof path, "%s/%s", p->dirs[i], names[k]);
        if (lstat(path, &st) == 0 || errno != ENOENT)
            return 0;
    }
    return 1;
}

/* what an open made on disk, so that a refused one removes it again. Not
 * the reset marker: it outlives a reset that did not finish on purpose */
static const char *const made_names[] = {FERRY_PSLAB_FILE, FERRY_PSLAB_JOURNAL,
                                         FERRY__PSLAB_JOURNAL_TMP,
                                         FERRY_PSLAB_LOCK}; /* (the lock last) */
#define MADE_N (sizeof made_names / sizeof made_names[0])
typedef struct {
    size_t kept[FERRY_PSLAB_MAX_DIRS]; /* length of dirs[i]'s longest prefix not made here */
    unsigned had[FERRY_PSLAB_MAX_DIRS]; /* bit k: made_names[k] was there (when locked) */
} pslab_made;

/* the end of the path's last name before `end` (trailing slashes skipped) */
static size_t name_start(const char *d, size_t end)
{
    while (end > 1 && d[end - 1] == '/')
        end--;
    while (end > 0 && d[end - 1] != '/')
        end--;
    return end;
}

/* no opener but this one holds the lock of fd (path's file): 1 once it
 * is taken exclusively, kept until the caller closes *w (>= 0 when a
 * second descriptor took it), else 0. A read-only open's descriptor
 * cannot take a write lock (EBADF): one opened for writing takes it once
 * the shared lock is let go, and only on the file fd has */
static int lock_alone(int fd, const char *path, int *w)
{
    struct flock ex = {.l_type = F_WRLCK, .l_whence = SEEK_SET};
    struct flock un = {.l_type = F_UNLCK, .l_whence = SEEK_SET};
    *w = -1;
    if (fcntl(fd, F_OFD_SETLK, &ex) == 0)
        return 1;
    if (errno != EBADF)
        return 0;
    int x = open(path, O_RDWR | O_NOFOLLOW | O_CLOEXEC);
    struct stat a, b;
    if (x < 0)
        return 0;
    if (fstat(fd, &a) != 0 || fstat(x, &b) != 0 || a.st_dev != b.st_dev ||
        a.st_ino != b.st_ino || fcntl(fd, F_OFD_SETLK, &un) != 0 ||
        fcntl(x, F_OFD_SETLK, &ex) != 0) {
        close(x);
        return 0;
    }
    *w = x;
    return 1;
}

/* the lock file of dirs[i] if this open made it (and holds it); the
 * other files of ours it made there too when it made the directory (in
 * one that was there, a slab file without a journal is no store, and a
 * reset's files are the reset's to finish); then the directories made for
 * it, deepest first, while empty ("." and ".." names are no directory of
 * ours) */
static void undo_made(const ferry_pslab *p, const pslab_made *m, unsigned i)
{
    char b[PATH_MAX_];
    int made_dir = m->kept[i] < strlen(p->dirs[i]);
    for (size_t k = 0; k < MADE_N && p->lockfd[i] >= 0; k++) {
        if ((m->had[i] & (1u << k)) || (!made_dir && k < MADE_N - 1))
            continue;
        snprintf(b, sizeof b, "%s/%s", p->dirs[i], made_names[k]);
        /* the lock file only when no other opener holds it: a read-only
         * one sharing it (verified before) would keep a lock on a file
         * the name no longer has, which an owner would not see */
        int w = -1;
        if (k == MADE_N - 1 && !lock_alone(p->lockfd[i], b, &w))
            continue;
        if (unlink(b) == 0)
            FERRY_LOGD("pslab: refused open: removed %s, which it made", b);
        if (w >= 0)
            close(w);
    }
    size_t n = strlen(p->dirs[i]);
    memcpy(b, p->dirs[i], n + 1);
    while (n > m->kept[i]) {
        size_t k = name_start(b, n);
        const char *nm = b + k;
        size_t len = n - k;
        while (len && nm[len - 1] == '/')
            len--;
        b[n] = 0;
        if (!(len == 1 && nm[0] == '.') && !(len == 2 && nm[0] == '.' && nm[1] == '.') &&
            rmdir(b) == 0)
            FERRY_LOGD("pslab: refused open: removed directory %s, which it made", b);
        while (k > 0 && b[k - 1] == '/')
            k--;
        n = k;
    }
}

/* the files of made_names in dir that are there: bit k for made_names[k] */
static unsigned present(const char *dir)
{
    unsigned bits = 0;
    for (size_t k = 0; k < MADE_N; k++) {
        char b[PATH_MAX_];
        struct stat st;
        snprintf(b, sizeof b, "%s/%s", dir, made_names[k]);
        if (lstat(b, &st) == 0 || errno != ENOENT)
            bits |= 1u << k;
    }
    return bits;
}

/* a handle for o (checked), its locks, settings, directories and tag copied; no file touched */
static int pslab_new(const ferry_pslab_options *o, ferry_pslab **out)
{
    int rc = 0;
    ferry_pslab *p = ferry__calloc(1, sizeof *p);
    if (!p)
        return ferry__err_set(NULL, -ENOMEM, "pslab %s: out of memory", o->dirs[0]);
    pthread_mutex_init(&p->mu, NULL);
    pthread_mutex_init(&p->lmu, NULL);
    pthread_mutex_init(&p->cmu, NULL);
    pthread_cond_init(&p->lcv, NULL);
    pthread_cond_init(&p->ccv, NULL);
    for (unsigned i = 0; i < FERRY_PSLAB_MAX_DIRS; i++)
        p->lockfd[i] = -1;
    p->n_dirs = o->n_dirs;
    p->flags = o->flags;
    p->sync_mode = o->sync;
    p->direct = o->direct ? 1 : 0;
    p->mode = o->mode;
    p->st.direct = p->direct;
    p->compact_bytes = o->compact_bytes ? o->compact_bytes : (4u << 20);
    p->batch_bytes = o->batch_bytes ? o->batch_bytes : (64u << 20);
    p->batch_ns = (uint64_t)(o->batch_ms ? o->batch_ms : 100) * 1000000u;
    ferry__cond_init_mono(&p->fcv); /* (the flusher's timed wait) */
    p->batch_open = 1;
    for (unsigned i = 0; i < o->n_dirs; i++)
        if (!(p->dirs[i] = ferry__strdup(o->dirs[i])))
            rc = -ENOMEM;
    if (rc == 0 && o->tag_len) {
        if ((p->tag = ferry__malloc(o->tag_len)) != NULL) {
            memcpy(p->tag, o->tag, o->tag_len);
            p->tag_len = (uint32_t)o->tag_len;
        } else {
            rc = -ENOMEM;
        }
    }
    if (rc < 0) {
        pslab_free(p);
        return ferry__err_set(NULL, -ENOMEM, "pslab %s: out of memory", o->dirs[0]);
    }
    snprintf(p->jpath, sizeof p->jpath, "%s/%s", p->dirs[0], FERRY_PSLAB_JOURNAL);
    *out = p;
    return 0;
}

/*
 * No journal in dirs[0]: create a store when o asks for one (CREATE or
 * RESET, not read-only, with a size), after making sure the directories
 * hold no other store. A journal there: nothing to do.
 */
static int create_if_missing(ferry_pslab *p, const ferry_pslab_options *o, int ro, int marked)
{
    int rc;
    struct stat jst;
    if (stat(p->jpath, &jst) == 0)
        return 0;
    int e = errno;
    if (e == ENOENT && !(o->flags & FERRY_PSLAB_RESET) && (rc = refuse_foreign(p)) < 0)
        return rc;
    if (e != ENOENT || !(o->flags & (FERRY_PSLAB_CREATE | FERRY_PSLAB_RESET)) || ro)
        return ferry__err_set(&p->err, -e, "pslab: no store in %s (journal %s: %s)%s",
                              p->dirs[0], p->jpath, strerror(e),
                              e != ENOENT ? ""
                              : marked    ? ": a reset of it was interrupted (" FERRY_PSLAB_RESET_MARK
                                            "); a reset given every drive completes it"
                                          : "; FERRY_PSLAB_CREATE creates one");
    if (!o->bytes)
        return ferry__err_set(&p->err, -EINVAL, "pslab: creating a store in %s needs a size "
                              "(options.bytes)", p->dirs[0]);
    ferry__pslab_geom g;
    g.alignment = (uint32_t)(o->alignment ? o->alignment : 4096);
    g.drives = o->n_dirs;
    g.stripe = o->stripe_bytes ? o->stripe_bytes : (1u << 20);
    if (g.stripe % g.alignment)
        return ferry__err_set(&p->err, -EINVAL, "pslab %s: stripe %llu is not a multiple of "
                              "the alignment %u", p->dirs[0], (unsigned long long)g.stripe,
                              g.alignment);
    g.capacity = ferry__pslab_round_capacity(o->bytes, g.alignment, g.stripe, g.drives);
    g.creation_id = new_creation_id();
    char why[256];
    if ((rc = ferry__pslab_geom_check(&g, why, sizeof why)) < 0)
        return ferry__err_set(&p->err, -EINVAL, "pslab %s: %s", p->dirs[0], why);
    p->data_off = ferry__pslab_data_off(g.alignment);
    p->share = g.capacity / g.drives;
    return create_store(p, &g);
}

/*
 * Damage dropped chunks: a rewrite keeps them dropped after the bad bytes
 * are gone; an older format's journal becomes this library's (format 1 ->
 * 2: barriers; 2 -> 3: piece puts may follow; its records stay as they
 * are, and its slab headers too: their layout is format 2's).
 */
static int compact_at_open(ferry_pslab *p)
{
    pthread_mutex_lock(&p->cmu);
    p->committing = 1;
    pthread_mutex_unlock(&p->cmu);
    int rc = ferry__pslab_compact_locked(p);
    pthread_mutex_lock(&p->cmu);
    p->committing = 0;
    pthread_mutex_unlock(&p->cmu);
    return rc;
}

/* the data lanes, and the flusher thread of a writable SYNC_BATCH store */
static int start_lanes(ferry_pslab *p, const ferry_pslab_options *o, int ro)
{
    int rc;
    unsigned nlanes = o->lanes ? o->lanes : 2;
    p->lanes = ferry__calloc(nlanes, sizeof *p->lanes);
    if (!p->lanes)
        return ferry__err_set(&p->err, -ENOMEM, "pslab %s: out of memory", p->dirs[0]);
    for (unsigned i = 0; i < nlanes; i++) {
        if ((rc = ferry__pslab_lane_open(p, &p->lanes[i], o->engine, o->depth ? o->depth : 4)) < 0)
            return rc;
        p->nlanes = i + 1;
        p->free_lanes |= 1u << i;
    }
    if (p->sync_mode == FERRY_PSLAB_SYNC_BATCH && !ro) {
        if (pthread_create(&p->flusher, NULL, ferry__pslab_flusher_main, p) != 0)
            return ferry__err_set(&p->err, -EAGAIN, "pslab %s: cannot start the batch flusher "
                                  "thread", p->dirs[0]);
        p->flusher_on = 1;
    }
    return 0;
}

#define PS_OPT(m) FERRY__MEMBER(ferry_pslab_options, m)
static const ferry__member pslab_later[] = {PS_OPT(batch_bytes), PS_OPT(batch_ms),
                                            PS_OPT(depth),       PS_OPT(tag),
                                            PS_OPT(tag_len),     PS_OPT(mode)};
#undef PS_OPT
static const ferry__sized pslab_sized =
    FERRY__SIZED(ferry_pslab_options, FERRY_PSLAB_OPTIONS_MIN_SIZE, pslab_later);

int ferry_pslab_open(const ferry_pslab_options *uo, ferry_pslab **out)
{
    if (!uo || !out)
        return ferry__err_set(NULL, -EINVAL, "ferry_pslab_open: options and out must be given");
    /* an older header's options: the members past its size keep their defaults */
    ferry_pslab_options ov = FERRY_PSLAB_OPTIONS_INIT;
    int rc = ferry__opts_take(NULL, "ferry_pslab_open", &pslab_sized, &ov, uo);
    if (rc < 0)
        return rc;
    const ferry_pslab_options *o = &ov;
    rc = check_options(o);
    if (rc < 0)
        return rc;

    uint64_t t0 = ferry__now_ns();
    ferry_pslab *p = NULL;
    if ((rc = pslab_new(o, &p)) < 0)
        return rc;

    /* one owner per directory, before any other file in it is touched:
     * two stores on one slab hand each other's bytes back */
    int ro = (o->flags & FERRY_PSLAB_READONLY) != 0;
    int mk = !ro && (o->flags & FERRY_PSLAB_CREATE);
    pslab_made made;
    memset(&made, 0, sizeof made);
    for (unsigned i = 0; i < o->n_dirs; i++)
        made.kept[i] = strlen(p->dirs[i]);
    if (!mk && (rc = nothing_here(p, o)) <= 0)
        goto out;
    rc = 0;
    for (unsigned i = 0; i < o->n_dirs; i++) {
        if ((rc = ferry__mkdir_p_made(p->dirs[i], p->mode, mk, &made.kept[i], &p->err)) < 0 ||
            (rc = same_dir_twice(p, i)) < 0)
            goto out;
        if (bare_later_dir(p, o, mk, i))
            continue;
        /* the lock file as found before the lock; the others once it is
         * held too: an owner that held it meanwhile may have made them */
        made.had[i] = present(p->dirs[i]);
        if ((rc = ferry__dir_lock(p->dirs[i], p->mode, ro, "pslab", &p->err, &p->lockfd[i])) < 0)
            goto out;
        made.had[i] |= present(p->dirs[i]) & ~(1u << (MADE_N - 1));
    }

    /* the commit lane: posix, one request at a time (the journal is appended in order) */
    ferry_io_options io = FERRY_IO_OPTIONS_INIT;
    io.engine = "posix";
    io.depth = 1;
    if ((rc = ferry_io_open(&io, &p->cl.io)) < 0) {
        rc = ferry__pslab_fail_io(p, rc, "pslab %s: opening the journal's I/O engine",
                                  p->dirs[0]);
        goto out;
    }
    /* a reset that did not finish: every one of its drives, or nothing */
    ferry_pslab_options eff = *o;
    int marked = 0;
    ferry__pslab_markgeo *mg = ferry__calloc(1, sizeof *mg);
    if (!mg) {
        rc = ferry__pslab_fail(p, -ENOMEM, "pslab %s: out of memory", p->dirs[0]);
        goto out;
    }
    if ((rc = ferry__pslab_mark_check(p, &marked, mg)) == 0 && (o->flags & FERRY_PSLAB_RESET))
        rc = reset_store(p, o, &eff, mg, marked);
    ferry__free(mg);
    if (rc < 0)
        goto out;
    o = &eff;
    if ((rc = create_if_missing(p, o, ro, marked)) < 0)
        goto out;
    /* the store is whole (its journal in place): the reset is over */
    if (!ro && (marked || (o->flags & FERRY_PSLAB_RESET)) && (rc = ferry__pslab_mark_clear(p)) < 0)
        goto out;
    if ((rc = ferry__pslab_recover(p, o)) < 0)
        goto out;
    if (p->need_compact && (rc = compact_at_open(p)) < 0)
        goto out;
    /* (only a journal of format 3 may hold piece puts: an older library
     * refuses it, where it would take them for torn or damaged records) */
    p->piece_puts = !ro && p->jversion >= 3;
    if ((rc = start_lanes(p, o, ro)) < 0)
        goto out;
    p->st.open_ns = ferry__now_ns() - t0;
    *out = p;
    return 0;
out:
    /* keep the message of the failure, not of the cleanup */
    {
        ferry__errbuf keep = p->err;
        for (unsigned i = o->n_dirs; i-- > 0;)
            undo_made(p, &made, i);
        pslab_free(p);
        return ferry__err_set(NULL, rc, "%s", keep.msg[0] ? keep.msg : ferry_strerror(rc));
    }
}

int ferry_pslab_close(ferry_pslab *p)
{
    if (!p)
        return 0;
    int rc = 0;
    if (p->flusher_on) {
        pthread_mutex_lock(&p->cmu);
        p->stopping = 1;
        pthread_cond_signal(&p->fcv);
        pthread_mutex_unlock(&p->cmu);
        pthread_join(p->flusher, NULL);
        p->flusher_on = 0;
    }
    if (!(p->flags & FERRY_PSLAB_READONLY) && !p->failed) {
        pthread_mutex_lock(&p->cmu);
        if (p->cur.n || p->dirty)
            ferry__pslab_run_commit(p, 1);
        rc = p->failed;
        /* a journal with history (overwritten, deleted or forgotten chunks'
         * records) is rewritten as one record per live chunk: a record
         * damaged later can then only lose its own chunk, never let an
         * older record of its key speak for it */
        pthread_mutex_lock(&p->mu);
        int want = !p->failed && p->jrecords > (uint64_t)p->idx.count;
        pthread_mutex_unlock(&p->mu);
        pthread_mutex_unlock(&p->cmu);
        if (want && ferry__pslab_compact_locked(p) < 0)
            FERRY_LOGW("%s", ferry__err_msg(&p->err));
    }
    if (rc < 0)
        rc = ferry__err_set(NULL, rc, "%s", ferry__err_msg(&p->err));
    pslab_free(p);
    return rc;
}

const char *ferry_pslab_last_error(const ferry_pslab *p)
{
    return p ? ferry__err_msg(&p->err) : "";
}
