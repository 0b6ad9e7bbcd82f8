/*
 * test_pslab_diskfull.c - the persistent slab when the disk fills: a
 * journal append that fails with ENOSPC part way (whole records before
 * the point where space ran out reach the file), a journal fdatasync that
 * fails after its append, and the writers that go on storing into the
 * failed store; then space comes back, the store is reopened and closed,
 * and EVERY record the journal holds must still name an extent that holds
 * its own chunk (DURABILITY.md: no durable record names a reused extent).
 *
 * The disk is modelled through the I/O layer's syscall seam (a byte budget
 * that file growth consumes; writes into preallocated bytes never fail),
 * and, where mounts are permitted, filled for real: a tmpfs of a few
 * hundred KiB mounted by a child in its own mount namespace.
 */
/* ferry-test-labels: concurrent */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <grp.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/vfs.h>
#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>

#include "ferry/gds.h"
#include "ferry/kv.h"
#include "ferry_test.h"
#include "io/room.h"
#include "io/sys.h"
#include "pslab/pslab_int.h"

#define CHUNK 16384u
#define NCHUNKS 32u

/* ---- the full disk, through the syscall seam ---- */

static ferry__sys g_full;
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static int64_t g_budget = -1; /* bytes files may still grow by; -1: unlimited */
static int g_fail_jsync;      /* fdatasync of the journal fails with EIO (once per arm) */
static int g_jfd = -1;        /* the journal's fd (the last file opened with its name) */
static unsigned g_enospc, g_eio;

static int full_open(const char *path, int flags, mode_t mode)
{
    int fd = ferry__sys_default()->open(path, flags, mode);
    size_t n = strlen(path), k = strlen(FERRY_PSLAB_JOURNAL);
    if (fd >= 0 && n >= k && !strcmp(path + n - k, FERRY_PSLAB_JOURNAL)) {
        pthread_mutex_lock(&g_mu);
        g_jfd = fd;
        pthread_mutex_unlock(&g_mu);
    }
    return fd;
}

/* growth past a file's size takes from the budget; what does not fit is
 * written short, then ENOSPC - as a file system does when it fills */
static ssize_t full_pwrite(int fd, const void *buf, size_t n, off_t off)
{
    struct stat st;
    pthread_mutex_lock(&g_mu);
    if (g_budget >= 0 && fstat(fd, &st) == 0 && (int64_t)off + (int64_t)n > st.st_size) {
        int64_t end = (int64_t)st.st_size + g_budget;
        if (end <= (int64_t)off) {
            g_enospc++;
            pthread_mutex_unlock(&g_mu);
            errno = ENOSPC;
            return -1;
        }
        if ((int64_t)off + (int64_t)n > end)
            n = (size_t)(end - (int64_t)off);
        int64_t grow = (int64_t)off + (int64_t)n - (int64_t)st.st_size;
        g_budget -= grow > 0 ? grow : 0;
    }
    ssize_t r = ferry__sys_default()->pwrite(fd, buf, n, off);
    pthread_mutex_unlock(&g_mu);
    return r;
}

static int full_fdatasync(int fd)
{
    pthread_mutex_lock(&g_mu);
    int fail = g_fail_jsync && fd == g_jfd;
    if (fail) {
        g_fail_jsync = 0;
        g_eio++;
    }
    pthread_mutex_unlock(&g_mu);
    if (fail) {
        errno = EIO;
        return -1;
    }
    return ferry__sys_default()->fdatasync(fd);
}

static void full_install(void)
{
    g_full = *ferry__sys_default();
    g_full.open = full_open;
    g_full.pwrite = full_pwrite;
    g_full.fdatasync = full_fdatasync;
    g_budget = -1;
    g_fail_jsync = 0;
    g_enospc = g_eio = 0;
    ferry__sys_set(&g_full);
}

static void set_budget(int64_t b)
{
    pthread_mutex_lock(&g_mu);
    g_budget = b;
    pthread_mutex_unlock(&g_mu);
}

/* ---- the store and its chunks ---- */

static size_t key_of(int i, char *k)
{
    return (size_t)sprintf(k, "chunk-%04d", i);
}

static void fill(uint8_t *buf, int i)
{
    ft_fill_pattern(buf, CHUNK, 1000u + (unsigned)i);
}

static ferry_pslab_options opts_for(const char *const *dirs, int sync)
{
    ferry_pslab_options o = FERRY_PSLAB_OPTIONS_INIT;
    o.dirs = dirs;
    o.n_dirs = 1;
    o.bytes = (uint64_t)NCHUNKS * CHUNK;
    o.flags = FERRY_PSLAB_CREATE;
    o.direct = 0;
    o.engine = "posix";
    o.sync = sync;
    /* SYNC_BATCH: nothing commits by itself; ferry_pslab_sync does */
    o.batch_bytes = (uint64_t)1 << 40;
    o.batch_ms = 3600000;
    return o;
}

static int put_i(ferry_pslab *p, int i)
{
    uint8_t *buf = malloc(CHUNK);
    char k[32];
    size_t kl = key_of(i, k);
    fill(buf, i);
    int rc = ferry_pslab_put(p, k, kl, buf, CHUNK);
    free(buf);
    return rc;
}

/* put chunks [from, to) in one put_many: its result */
static int put_many_i(ferry_pslab *p, int from, int to)
{
    int n = to - from;
    ferry_pslab_item *it = calloc((size_t)n, sizeof *it);
    uint8_t *buf = malloc((size_t)n * CHUNK);
    char(*keys)[32] = calloc((size_t)n, 32);
    for (int j = 0; j < n; j++) {
        it[j].klen = key_of(from + j, keys[j]);
        it[j].key = keys[j];
        fill(buf + (size_t)j * CHUNK, from + j);
        it[j].data = buf + (size_t)j * CHUNK;
        it[j].len = CHUNK;
    }
    int rc = ferry_pslab_put_many(p, it, (size_t)n);
    free(keys);
    free(buf);
    free(it);
    return rc;
}

static int read_file(const char *path, uint8_t **out, size_t *len)
{
    int fd = open(path, O_RDONLY);
    if (fd < 0)
        return -errno;
    struct stat st;
    if (fstat(fd, &st) != 0) {
        close(fd);
        return -errno;
    }
    uint8_t *b = malloc((size_t)st.st_size + 1);
    ssize_t got = pread(fd, b, (size_t)st.st_size, 0);
    close(fd);
    if (got != st.st_size) {
        free(b);
        return -EIO;
    }
    *out = b;
    *len = (size_t)st.st_size;
    return 0;
}

/*
 * What `ferry slab check` proves, taken from the files alone: replay the
 * journal as it lies on the disk and read every extent a surviving record
 * names; the bytes must be the ones its checksum and key say (this test's
 * pattern for that key). Returns the number of records that name an
 * extent holding anything else (< 0: the files could not be read); *n:
 * the records checked.
 */
/* the checksum a record carries for the n bytes at b: their XXH3-64, or
 * (piece sums) that of the table of each piece's XXH3-64, little endian */
static uint64_t record_sum(const uint8_t *b, size_t n, uint32_t piece)
{
    if (!piece)
        return XXH3_64bits(b, n);
    size_t np = (n + piece - 1) / piece;
    uint8_t *t = malloc(8 * np);
    for (size_t i = 0; i < np; i++) {
        uint64_t s = XXH3_64bits(b + i * piece, n - i * piece < piece ? n - i * piece : piece);
        for (int j = 0; j < 8; j++)
            t[8 * i + (size_t)j] = (uint8_t)(s >> (8 * j));
    }
    uint64_t s = XXH3_64bits(t, 8 * np);
    free(t);
    return s;
}

static int bad_records(const char *dir, unsigned *n)
{
    char jp[512], sp[512], why[256];
    snprintf(jp, sizeof jp, "%s/%s", dir, FERRY_PSLAB_JOURNAL);
    snprintf(sp, sizeof sp, "%s/%s", dir, FERRY_PSLAB_FILE);
    uint8_t *j = NULL;
    size_t jl = 0;
    int rc = read_file(jp, &j, &jl);
    if (rc < 0)
        return rc;
    ferry__pslab_index ix;
    ferry_slab *alloc = NULL;
    ferry__pslab_load L;
    rc = ferry__pslab_index_load(j, jl, NULL, &ix, &alloc, &L, why, sizeof why);
    free(j);
    if (rc < 0) {
        fprintf(stderr, "journal %s: %s\n", jp, why);
        return rc;
    }
    int fd = open(sp, O_RDONLY);
    uint8_t *buf = malloc(CHUNK), *want = malloc(CHUNK);
    int bad = 0;
    *n = 0;
    for (size_t b = 0; fd >= 0 && b < ix.nb; b++)
        for (ferry__pslab_ent *e = ix.b[b]; e; e = e->hnext) {
            (*n)++;
            int i = -1;
            char k[32];
            if (e->klen < sizeof k) {
                memcpy(k, e->key, e->klen);
                k[e->klen] = 0;
                sscanf(k, "chunk-%d", &i);
            }
            int ok = e->length == CHUNK &&
                     pread(fd, buf, CHUNK, (off_t)(ferry__pslab_data_off(4096) + e->offset)) ==
                         (ssize_t)CHUNK &&
                     record_sum(buf, CHUNK, e->piece) == e->sum && i >= 0;
            if (ok) {
                fill(want, i);
                ok = !memcmp(buf, want, CHUNK);
            }
            if (!ok) {
                fprintf(stderr, "durable record of %.*s (sequence %llu) names extent %llu, "
                        "which holds another chunk\n", (int)e->klen, (const char *)e->key,
                        (unsigned long long)e->seq, (unsigned long long)e->offset);
                bad++;
            }
        }
    if (fd >= 0)
        close(fd);
    else
        bad = -errno;
    free(buf);
    free(want);
    ferry__pslab_index_fini(&ix);
    ferry_slab_destroy(alloc);
    return bad;
}

/* a read-only open and ferry_pslab_verify, as `ferry slab check` does: bad chunks */
static long verify_bad(const char *const *dirs, unsigned *chunks)
{
    ferry_pslab_options o = FERRY_PSLAB_OPTIONS_INIT;
    o.dirs = dirs;
    o.n_dirs = 1;
    o.flags = FERRY_PSLAB_READONLY;
    o.engine = "posix";
    ferry_pslab *p = NULL;
    int rc = ferry_pslab_open(&o, &p);
    if (rc < 0) {
        fprintf(stderr, "read-only open of %s: %s\n", dirs[0], ferry_last_error());
        return rc;
    }
    uint64_t bad = 0;
    rc = ferry_pslab_verify(p, 0, &bad, NULL, NULL);
    ferry_pslab_stats s = FERRY_PSLAB_STATS_INIT;
    ferry_pslab_stats_get(p, &s);
    *chunks = (unsigned)s.chunks;
    ferry_pslab_close(p);
    return rc < 0 ? rc : (long)bad;
}

/* every chunk of [0, n) holds its own bytes */
static int all_intact(const char *const *dirs, int n)
{
    ferry_pslab_options o = FERRY_PSLAB_OPTIONS_INIT;
    o.dirs = dirs;
    o.n_dirs = 1;
    o.flags = FERRY_PSLAB_READONLY;
    o.engine = "posix";
    ferry_pslab *p = NULL;
    if (ferry_pslab_open(&o, &p) < 0)
        return 0;
    uint8_t *buf = malloc(CHUNK), *want = malloc(CHUNK);
    int ok = 1;
    for (int i = 0; i < n && ok; i++) {
        char k[32];
        size_t kl = key_of(i, k), len = 0;
        fill(want, i);
        ok = ferry_pslab_get(p, k, kl, buf, CHUNK, &len) == 0 && len == CHUNK &&
             !memcmp(buf, want, CHUNK);
    }
    free(buf);
    free(want);
    ferry_pslab_close(p);
    return ok;
}

/* how the journal fails */
enum { FAIL_ENOSPC_PUT, FAIL_ENOSPC_PUT_MANY, FAIL_EIO_SYNC };

/*
 * 6 durable chunks; then the disk fills (or the journal's sync fails)
 * during the commit of 6 more, of which two whole records reach the
 * journal; the writers go on storing 12 more, forgetting and deleting;
 * space comes back; reopen, close. Every record the journal holds then
 * names its own bytes, and the 6 durable chunks are intact.
 */
static void run_disk_full(int how)
{
    char d[256];
    ft_tmpdir(d, sizeof d);
    const char *dirs[] = {d};
    full_install();
    int sync = how == FAIL_ENOSPC_PUT_MANY ? FERRY_PSLAB_SYNC_FULL : FERRY_PSLAB_SYNC_BATCH;
    ferry_pslab_options o = opts_for(dirs, sync);
    ferry_pslab *p = NULL;
    FT_ASSERT_OK(ferry_pslab_open(&o, &p));
    if (how == FAIL_ENOSPC_PUT_MANY) {
        assert_int_equal(put_many_i(p, 0, 6), 6);
    } else {
        for (int i = 0; i < 6; i++)
            FT_ASSERT_OK(put_i(p, i));
    }
    FT_ASSERT_OK(ferry_pslab_sync(p));

    /* the disk fills: the journal has room for two records and a half */
    size_t rec = ferry__pslab_rec_size_p((uint32_t)strlen("chunk-0000"), 1);
    if (how == FAIL_EIO_SYNC) {
        pthread_mutex_lock(&g_mu);
        g_fail_jsync = 1;
        pthread_mutex_unlock(&g_mu);
    } else {
        set_budget((int64_t)(2 * rec + rec / 2));
    }
    int rc;
    if (how == FAIL_ENOSPC_PUT_MANY) {
        rc = put_many_i(p, 6, 12);
        assert_true(rc < 0);
    } else {
        for (int i = 6; i < 12; i++)
            FT_ASSERT_OK(put_i(p, i)); /* queued, visible */
        /* an eviction in the same batch, as the KV store's L2 makes */
        char k[32];
        size_t kl = key_of(5, k);
        FT_ASSERT_OK(ferry_pslab_forget(p, k, kl));
        rc = ferry_pslab_sync(p);
    }
    assert_int_equal(rc, how == FAIL_EIO_SYNC ? -EIO : -ENOSPC);
    if (how == FAIL_EIO_SYNC)
        assert_int_equal(g_eio, 1);
    else
        assert_true(g_enospc >= 1);

    /* the failed batch's extents stay allocated: its records may be durable */
    ferry_pslab_stats s = FERRY_PSLAB_STATS_INIT;
    FT_ASSERT_OK(ferry_pslab_stats_get(p, &s));
    assert_int_equal(s.failed, 1);
    assert_true(s.bytes_used >= 12ull * CHUNK);

    /* the writers go on, as a KV store's write-through does: refused */
    for (int i = 12; i < 24; i++)
        assert_true(put_i(p, i) < 0);
    assert_true(put_many_i(p, 24, 30) <= 0); /* none stored */
    {
        char k[32];
        size_t kl = key_of(1, k);
        assert_true(ferry_pslab_delete(p, k, kl) < 0);
        assert_true(ferry_pslab_forget(p, k, kl) < 0);
    }
    FT_ASSERT_OK(ferry_pslab_stats_get(p, &s));
    assert_true(s.bytes_used >= 12ull * CHUNK);
    ferry_pslab_close(p);

    /* what the journal holds as the failed store left it */
    unsigned n = 0;
    assert_int_equal(bad_records(d, &n), 0);
    assert_true(n >= 6);

    /* space is freed; the slab is reopened and closed */
    set_budget(-1);
    o.flags = 0;
    FT_ASSERT_OK(ferry_pslab_open(&o, &p));
    FT_ASSERT_OK(ferry_pslab_close(p));
    ferry__sys_set(NULL);

    assert_int_equal(bad_records(d, &n), 0);
    unsigned chunks = 0;
    assert_int_equal(verify_bad(dirs, &chunks), 0);
    assert_int_equal(chunks, n);
    /* the chunks durable before the disk filled are all there */
    assert_true(all_intact(dirs, 5));
    ft_rmtree(d);
}

static void test_enospc_in_a_batch_append_reuses_no_named_extent(void **state)
{
    (void)state;
    run_disk_full(FAIL_ENOSPC_PUT);
}

static void test_enospc_in_a_put_many_append_reuses_no_named_extent(void **state)
{
    (void)state;
    run_disk_full(FAIL_ENOSPC_PUT_MANY);
}

static void test_failed_journal_sync_reuses_no_named_extent(void **state)
{
    (void)state;
    run_disk_full(FAIL_EIO_SYNC);
}

/* ---- a real small file system ---- */

/*
 * The child's side of the tmpfs test (no cmocka here: it reports by its
 * exit status, 0 pass, 1 fail, 77 skip). In its own user and mount
 * namespaces it mounts a tmpfs of 1 MiB on dir, creates a slab there,
 * fills the rest of the file system, commits batches until one fails,
 * goes on storing, frees the space, reopens and closes, and checks every
 * record.
 */
static int tmpfs_child(const char *dir)
{
    if (getuid() != 0) {
        uid_t uid = getuid();
        gid_t gid = getgid();
        if (unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0)
            return 77;
        char m[64];
        int fd = open("/proc/self/setgroups", O_WRONLY);
        if (fd >= 0) {
            (void)!write(fd, "deny", 4);
            close(fd);
        }
        snprintf(m, sizeof m, "0 %u 1", (unsigned)uid);
        fd = open("/proc/self/uid_map", O_WRONLY);
        if (fd < 0 || write(fd, m, strlen(m)) < 0)
            return 77;
        close(fd);
        snprintf(m, sizeof m, "0 %u 1", (unsigned)gid);
        fd = open("/proc/self/gid_map", O_WRONLY);
        if (fd < 0 || write(fd, m, strlen(m)) < 0)
            return 77;
        close(fd);
    } else if (unshare(CLONE_NEWNS) != 0) {
        return 77;
    }
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0 ||
        mount("tmpfs", dir, "tmpfs", 0, "size=1m,mode=0700") != 0)
        return 77;
    const char *dirs[] = {dir};
    ferry_pslab_options o = opts_for(dirs, FERRY_PSLAB_SYNC_BATCH);
    ferry_pslab *p = NULL;
    if (ferry_pslab_open(&o, &p) < 0) {
        fprintf(stderr, "open on tmpfs: %s\n", ferry_last_error());
        return 1;
    }
    int next = 0;
    for (; next < 6; next++)
        if (put_i(p, next) < 0)
            return 1;
    if (ferry_pslab_sync(p) < 0)
        return 1;
    /* fill the file system */
    char fp[512];
    snprintf(fp, sizeof fp, "%s/filler", dir);
    int ff = open(fp, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    static uint8_t blk[4096];
    while (ff >= 0 && write(ff, blk, sizeof blk) > 0) {
    }
    while (ff >= 0 && write(ff, blk, 1) > 0) {
    }
    if (ff >= 0)
        close(ff);
    /* batches of 6 puts (a forget of the oldest each, as an L2 evicts)
     * until a commit fails: the journal's last page fills part way
     * through one */
    int rc = 0, oldest = 0;
    for (int round = 0; round < 200 && rc == 0; round++) {
        for (int j = 0; j < 6 && rc == 0; j++) {
            char k[32];
            size_t kl = key_of(oldest, k);
            if (next - oldest >= (int)NCHUNKS - 8 && (rc = ferry_pslab_forget(p, k, kl)) == 0)
                oldest++;
            if (rc == 0)
                rc = put_i(p, next++);
        }
        if (rc == 0)
            rc = ferry_pslab_sync(p);
    }
    if (rc != -ENOSPC) {
        fprintf(stderr, "the commits did not fail with ENOSPC on a full tmpfs: %d (%s)\n", rc,
                ferry_last_error());
        return 1;
    }
    for (int i = 0; i < 12; i++)
        (void)put_i(p, next++);
    ferry_pslab_close(p);
    unlink(fp);
    o.flags = 0;
    if (ferry_pslab_open(&o, &p) < 0) {
        fprintf(stderr, "reopen on tmpfs: %s\n", ferry_last_error());
        return 1;
    }
    ferry_pslab_close(p);
    unsigned n = 0, chunks = 0;
    int bad = bad_records(dir, &n);
    long vbad = verify_bad(dirs, &chunks);
    if (bad != 0 || vbad != 0 || chunks != n) {
        fprintf(stderr, "after the disk filled: %d of %u records name extents holding other "
                "chunks; verify: %ld bad of %u\n", bad, n, vbad, chunks);
        return 1;
    }
    return 0;
}

static void test_full_tmpfs_reuses_no_named_extent(void **state)
{
    (void)state;
    char d[256];
    ft_tmpdir(d, sizeof d);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        int st = tmpfs_child(d);
        umount2(d, MNT_DETACH);
        _exit(st);
    }
    int st = 0;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    ft_rmtree(d);
    assert_true(WIFEXITED(st));
    if (WEXITSTATUS(st) == 77)
        skip(); /* no mount namespace here */
    assert_int_equal(WEXITSTATUS(st), 0);
}

/* ---- an L2 larger than the disk's free space ---- */

static _Atomic uint64_t g_asked; /* the largest fallocate asked for */

/* never takes a block: a request is only noted (and fails as a full disk) */
static int noted_fallocate(int fd, off_t off, off_t len)
{
    (void)fd;
    (void)off;
    if ((uint64_t)len > g_asked)
        g_asked = (uint64_t)len;
    return ENOSPC;
}

/* README's `KVStore(l2="/nvme/ferry:512G")` on a host with less free: the
 * store's open asked fallocate for the whole slab, which took the disk's
 * every free block (other processes on it failing with ENOSPC) for a
 * minute before it failed. Now the open is refused before any block is
 * taken, naming the free space; persistent and not. */
static void test_an_l2_larger_than_the_free_space_takes_no_block(void **state)
{
    (void)state;
    char d[256];
    assert_non_null(ft_tmpdir(d, sizeof d));
    struct statvfs sv;
    assert_int_equal(statvfs(d, &sv), 0);
    /* root may take the blocks the file system keeps for it (ext4's
     * reserve): its room is every free block */
    uint64_t room = (uint64_t)(geteuid() == 0 ? sv.f_bfree : sv.f_bavail) * sv.f_frsize;
    static ferry__sys noted;
    noted = *ferry__sys_default();
    noted.fallocate = noted_fallocate;
    for (int persistent = 0; persistent < 2; persistent++) {
        ferry_kv_config c = FERRY_KV_CONFIG_INIT;
        c.model = "diskfull";
        c.layout = ft_kv_layout(256);
        c.chunk_tokens = 16;
        c.l1_bytes = 1u << 20;
        c.l2_dir = d;
        c.l2_bytes = (room / (1u << 20) + 1024) << 20; /* 1 GiB more than is free */
        c.l2_persistent = persistent;
        ferry_kv *kv = NULL;
        g_asked = 0;
        ferry__sys_set(&noted);
        int rc = ferry_kv_open(&c, &kv);
        ferry__sys_set(NULL);
        if (rc == 0)
            ferry_kv_close(kv);
        if (rc != -ENOSPC || !strstr(ferry_last_error(), "bytes free") || g_asked > room)
            fail_msg("persistent %d: a %llu-byte L2 with %llu bytes free: open %d, fallocate "
                     "asked for %llu bytes; '%s'",
                     persistent, (unsigned long long)c.l2_bytes, (unsigned long long)room, rc,
                     (unsigned long long)g_asked, ferry_last_error());
    }
    ft_rmtree(d);
}

/* a posix engine and the file `name` in directory d, with a system
 * table whose fallocate takes no block (the disk is shared): set it with
 * ferry__sys_set(&t->noted) around the call under test */
typedef struct {
    ferry_io *io;
    ferry_file *f;
    ferry__sys noted;
} noted_file;

static void noted_file_open(noted_file *t, const char *d, const char *name)
{
    ferry_io_options o = FERRY_IO_OPTIONS_INIT;
    o.engine = "posix";
    t->io = NULL;
    FT_ASSERT_OK(ferry_io_open(&o, &t->io));
    char path[300];
    snprintf(path, sizeof path, "%s/%s", d, name);
    t->f = NULL;
    FT_ASSERT_OK(ferry_file_open(t->io, path,
                                 FERRY_FILE_READ | FERRY_FILE_WRITE | FERRY_FILE_CREATE, &t->f));
    t->noted = *ferry__sys_default();
    t->noted.fallocate = noted_fallocate;
}

static void noted_file_close(noted_file *t)
{
    ferry_file_close(t->f);
    ferry_io_close(t->io);
}

/* root writes into the blocks an ext4 keeps for it (5% by default; this
 * machine's / keeps more than half its free space): an allocate that only
 * they hold room for worked, and must not be refused as "no free space".
 * Runs where the process is root and the file system keeps a reserve. */
static void test_root_may_allocate_into_the_reserved_blocks(void **state)
{
    (void)state;
    char d[256];
    assert_non_null(ft_tmpdir(d, sizeof d));
    struct statvfs sv;
    assert_int_equal(statvfs(d, &sv), 0);
    uint64_t avail = (uint64_t)sv.f_bavail * sv.f_frsize, fr = (uint64_t)sv.f_bfree * sv.f_frsize;
    if (geteuid() != 0 || fr < avail + (2ull << 30)) {
        ft_rmtree(d);
        skip(); /* not root, or no reserve of 2 GiB to speak of */
    }
    static noted_file t;
    noted_file_open(&t, d, "reserve.bin");
    uint64_t len = avail + (1ull << 30);
    g_asked = 0;
    ferry__sys_set(&t.noted);
    int rc = ferry_file_allocate(t.f, 0, len);
    ferry__sys_set(NULL);
    if (g_asked != len)
        fail_msg("root, %llu bytes available to others, %llu free: an allocate of %llu was "
                 "refused before fallocate (%d, '%s')",
                 (unsigned long long)avail, (unsigned long long)fr, (unsigned long long)len, rc,
                 ferry_last_error());
    noted_file_close(&t);
    ft_rmtree(d);
}

/* uid and gid 0 of a new user namespace for this process, as uid and gid
 * `out` outside it (a rootless container's root); 0 when done */
static int become_namespace_root(unsigned out)
{
    char m[64];
    /* (dumpable again after the uid change, or /proc/self stays root's) */
    if (setgroups(0, NULL) != 0 || setgid(out) != 0 || setuid(out) != 0 ||
        prctl(PR_SET_DUMPABLE, 1) != 0 || unshare(CLONE_NEWUSER) != 0)
        return -1;
    int n = snprintf(m, sizeof m, "0 %u 1\n", out);
    int fu = open("/proc/self/uid_map", O_WRONLY), fs = open("/proc/self/setgroups", O_WRONLY),
        fg = open("/proc/self/gid_map", O_WRONLY);
    int ok = fu >= 0 && fs >= 0 && fg >= 0 && write(fu, m, (size_t)n) == n &&
             write(fs, "deny", 4) == 4 && write(fg, m, (size_t)n) == n;
    close(fu);
    close(fs);
    close(fg);
    return ok && geteuid() == 0 ? 0 : -1;
}

/* root of a user namespace whose uid 0 is another uid outside (rootless
 * containers) is not the file system's root: ext4 keeps its reserve for
 * the uid outside, 0 (resuid), and for CAP_SYS_RESOURCE in the host's
 * namespace. An allocate that only the reserve holds room for is refused
 * before a block is taken, as anyone's is. Before, geteuid() == 0 was
 * enough: fallocate ran and took every block others may use. Runs where
 * the process is root, the file system keeps a reserve of 2 GiB and user
 * namespaces may be made. */
static void test_a_user_namespaces_root_keeps_out_of_the_reserve(void **state)
{
    (void)state;
    char d[256];
    assert_non_null(ft_tmpdir(d, sizeof d));
    struct statvfs sv;
    assert_int_equal(statvfs(d, &sv), 0);
    uint64_t avail = (uint64_t)sv.f_bavail * sv.f_frsize, fr = (uint64_t)sv.f_bfree * sv.f_frsize;
    if (geteuid() != 0 || fr < avail + (2ull << 30)) {
        ft_rmtree(d);
        skip(); /* not root, or no reserve of 2 GiB to speak of */
    }
    static noted_file t;
    noted_file_open(&t, d, "reserve.bin");
    uint64_t len = avail + (1ull << 30);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        if (become_namespace_root(65534) != 0)
            _exit(3); /* (no user namespaces here) */
        g_asked = 0;
        ferry__sys_set(&t.noted);
        int rc = ferry_file_allocate(t.f, 0, len);
        _exit(rc == -ENOSPC && g_asked == 0 ? 0 : g_asked ? 1 : 2);
    }
    int st = 0;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    noted_file_close(&t);
    ft_rmtree(d);
    assert_true(WIFEXITED(st));
    if (WEXITSTATUS(st) == 3)
        skip();
    if (WEXITSTATUS(st) != 0)
        fail_msg("a user namespace's root (65534 outside), %llu bytes available to it, %llu "
                 "free: an allocate of %llu %s",
                 (unsigned long long)avail, (unsigned long long)fr, (unsigned long long)len,
                 WEXITSTATUS(st) == 1 ? "went to fallocate" : "failed otherwise");
}

/* an L2 striped over two directories of one file system (two
 * directories of one drive, l2_bytes on each): each part alone fits its
 * free space, both together do not. Before, each part was checked alone,
 * so the first one's fallocate took its blocks and the last one's failed
 * after the disk was full; now the open is refused before any block is
 * taken (no fallocate asked), naming the free bytes and the total;
 * persistent (pslab) and not (gds) */
static void test_parts_on_one_file_system_are_summed(void **state)
{
    (void)state;
    char d0[256], d1[256];
    assert_non_null(ft_tmpdir(d0, sizeof d0));
    assert_non_null(ft_tmpdir(d1, sizeof d1));
    struct statvfs sv;
    assert_int_equal(statvfs(d0, &sv), 0);
    uint64_t room = (uint64_t)(geteuid() == 0 ? sv.f_bfree : sv.f_bavail) * sv.f_frsize;
    static ferry__sys noted;
    noted = *ferry__sys_default();
    noted.fallocate = noted_fallocate;
    const char *dirs[2] = {d0, d1};
    for (int persistent = 0; persistent < 2; persistent++) {
        ferry_kv_config c = FERRY_KV_CONFIG_INIT;
        c.model = "diskfull";
        c.layout = ft_kv_layout(256);
        c.chunk_tokens = 16;
        c.l1_bytes = 1u << 20;
        c.l2_dirs = dirs;
        c.l2_n_dirs = 2;
        c.l2_bytes = (room / 10 * 6) & ~(((uint64_t)64 << 20) - 1); /* 60% on each */
        c.l2_persistent = persistent;
        ferry_kv *kv = NULL;
        g_asked = 0;
        ferry__sys_set(&noted);
        int rc = ferry_kv_open(&c, &kv);
        ferry__sys_set(NULL);
        if (rc == 0)
            ferry_kv_close(kv);
        const char *msg = ferry_last_error();
        if (rc != -ENOSPC || !strstr(msg, "bytes free and 2 files on it ask") || g_asked)
            fail_msg("persistent %d: two parts of %llu bytes with %llu bytes free: open %d, "
                     "fallocate asked for %llu bytes; '%s'",
                     persistent, (unsigned long long)c.l2_bytes, (unsigned long long)room, rc,
                     (unsigned long long)g_asked, msg);
    }
    ft_rmtree(d0);
    ft_rmtree(d1);
}

/* a file system as statfs says it of every fd: 4 GiB free, 1 GiB of it
 * (or g_fake_avail) to anyone, of type g_fs_type */
static unsigned long g_fs_type;
static uint64_t g_fake_avail; /* (0: 1 GiB) */
static int fake_fstatfs(int fd, struct statfs *st)
{
    (void)fd;
    memset(st, 0, sizeof *st);
    st->f_type = (__fsword_t)g_fs_type;
    st->f_bsize = st->f_frsize = 4096;
    st->f_blocks = (fsblkcnt_t)(64ull << 30) / 4096;
    st->f_bfree = (fsblkcnt_t)(4ull << 30) / 4096;
    st->f_bavail = (fsblkcnt_t)(g_fake_avail ? g_fake_avail : 1ull << 30) / 4096;
    return 0;
}

/* btrfs's f_bfree is no root reserve (its allocator cannot hand those
 * blocks to anyone): even the host's root has only f_bavail there, and
 * an allocate past it is refused before fallocate. ext4's is (the root
 * may take it, as before). Before, the root counted f_bfree on btrfs too */
static void test_btrfs_free_blocks_are_no_root_reserve(void **state)
{
    (void)state;
    char d[256];
    assert_non_null(ft_tmpdir(d, sizeof d));
    static noted_file t;
    noted_file_open(&t, d, "btrfs.bin");
    const unsigned long types[2] = {0x9123683EUL /* btrfs */, 0xEF53UL /* ext4 */};
    for (int k = 0; k < 2; k++) {
        g_fs_type = types[k];
        g_asked = 0;
        atomic_store(&ferry__test_fstatfs, fake_fstatfs);
        ferry__sys_set(&t.noted);
        int rc = ferry_file_allocate(t.f, 0, 2ull << 30);
        ferry__sys_set(NULL);
        atomic_store(&ferry__test_fstatfs, NULL);
        if (k == 0 && (rc != -ENOSPC || g_asked || !strstr(ferry_last_error(), "1073741824")))
            fail_msg("btrfs, 1 GiB available, 4 GiB free: an allocate of 2 GiB: %d, fallocate "
                     "asked %llu; '%s'",
                     rc, (unsigned long long)g_asked, ferry_last_error());
        if (k == 1 && (g_asked == 2ull << 30) != (ferry__host_root() == 1))
            fail_msg("ext4, 1 GiB available, 4 GiB free, %s the host's root: an allocate of "
                     "2 GiB: %d, fallocate asked %llu",
                     ferry__host_root() ? "as" : "not as", rc, (unsigned long long)g_asked);
    }
    noted_file_close(&t);
    ft_rmtree(d);
}

/* a directory still to be made is counted on its nearest existing
 * ancestor's file system, but a file of the slab's name in that ancestor
 * (a store of an earlier run, one directory up) is not the file the new
 * directory's part replaces: its blocks are not freed by it. Here 64 MiB
 * are available (statfs's seam), two parts of 48 MiB ask 96, and the
 * ancestor holds 40 MiB of an old slab. Before, those 40 MiB counted as
 * freed (104 >= 96), the check passed and the first part's fallocate was
 * asked on a disk that could not hold both */
static void test_a_file_in_the_ancestor_of_a_new_directory_is_not_freed(void **state)
{
    (void)state;
    char d0[256], up[256], d1[300], old[320];
    assert_non_null(ft_tmpdir(d0, sizeof d0));
    assert_non_null(ft_tmpdir(up, sizeof up));
    snprintf(d1, sizeof d1, "%s/new", up);
    snprintf(old, sizeof old, "%s/%s", up, FERRY_GDS_SLAB_NAME);
    int fd = open(old, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    assert_true(fd >= 0);
    assert_int_equal(posix_fallocate(fd, 0, 40 << 20), 0); /* (real blocks) */
    close(fd);
    static ferry__sys noted;
    noted = *ferry__sys_default();
    noted.fallocate = noted_fallocate;
    g_fs_type = 0x9123683EUL; /* (btrfs: f_bavail alone, root or not) */
    g_fake_avail = 64ull << 20;
    const char *dirs[2] = {d0, d1};
    ferry_kv_config c = FERRY_KV_CONFIG_INIT;
    c.model = "diskfull";
    c.layout = ft_kv_layout(256);
    c.chunk_tokens = 16;
    c.l1_bytes = 1u << 20;
    c.l2_dirs = dirs;
    c.l2_n_dirs = 2;
    c.l2_bytes = 48u << 20;
    ferry_kv *kv = NULL;
    g_asked = 0;
    atomic_store(&ferry__test_fstatfs, fake_fstatfs);
    ferry__sys_set(&noted);
    int rc = ferry_kv_open(&c, &kv);
    ferry__sys_set(NULL);
    atomic_store(&ferry__test_fstatfs, NULL);
    g_fake_avail = 0;
    if (rc == 0)
        ferry_kv_close(kv);
    const char *msg = ferry_last_error();
    if (rc != -ENOSPC || !strstr(msg, "67108864 bytes free and 2 files on it ask") || g_asked)
        fail_msg("two parts of 48 MiB, 64 MiB free, 40 MiB of another slab one directory up: "
                 "open %d, fallocate asked for %llu bytes; '%s'",
                 rc, (unsigned long long)g_asked, msg);
    ft_rmtree(d0);
    ft_rmtree(up);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_enospc_in_a_batch_append_reuses_no_named_extent),
        cmocka_unit_test(test_enospc_in_a_put_many_append_reuses_no_named_extent),
        cmocka_unit_test(test_failed_journal_sync_reuses_no_named_extent),
        cmocka_unit_test(test_full_tmpfs_reuses_no_named_extent),
        cmocka_unit_test(test_an_l2_larger_than_the_free_space_takes_no_block),
        cmocka_unit_test(test_root_may_allocate_into_the_reserved_blocks),
        cmocka_unit_test(test_a_user_namespaces_root_keeps_out_of_the_reserve),
        cmocka_unit_test(test_parts_on_one_file_system_are_summed),
        cmocka_unit_test(test_btrfs_free_blocks_are_no_root_reserve),
        cmocka_unit_test(test_a_file_in_the_ancestor_of_a_new_directory_is_not_freed),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
