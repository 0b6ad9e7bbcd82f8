/*
 * fuzz_meminfo.c - the host memory readers (core/meminfo.c) on arbitrary
 * files: /proc/meminfo, /proc/self/cgroup, /proc/self/mountinfo and the
 * cgroups' memory files, as an odd container or kernel may present them.
 *
 * The input is the files' texts, split at each 0x01 byte, in this order:
 *   0 /proc/meminfo   1 /proc/self/cgroup   2 /proc/self/mountinfo
 *   3 memory.max      4 memory.current      5 memory.stat (v2's and v1's)
 *   6 memory.limit_in_bytes                 7 memory.usage_in_bytes
 *   8 control: its first byte N (1..255) makes the Nth open fail with
 *     EMFILE (out of descriptors: the watch finds its cgroups anew)
 * A part not given is a file that is not there. A cgroup file's part
 * split at 0x02 gives each level its own text (the level whose path has
 * k slashes the (k mod parts)th), so a limit above the process's can
 * differ from its own. The files are served from memory through the
 * readers' open seam (ferry__test_mem_open): no file is written.
 *
 * Checks beyond "no crash, no UB, no leak": every file opened is under
 * the root given and every descriptor is closed again; the limit found is
 * never above the host's memory as the same /proc/meminfo alone gives it,
 * nor the memory available above the limit or above the host's; a read
 * from a watch says what a one-shot read says, and again the same; the
 * limit file is named exactly when a cgroup's limit is the answer. A
 * cgroup path that loops ("..") or runs deep must end (libFuzzer's
 * timeout finds a loop).
 */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "core/core.h"
#include "core/meminfo.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define ROOT "/ferry-fuzz-root"
#define NPART 9

static const char *g_part[NPART];
static size_t g_len[NPART];
static int g_given[NPART];
static unsigned g_opens, g_fail_at;
static int g_failed; /* the open made to fail failed */

static const struct {
    const char *name;
    int whole; /* the path whole (under ROOT), else its last component */
} FILES[NPART - 1] = {
    {"/proc/meminfo", 1},          {"/proc/self/cgroup", 1}, {"/proc/self/mountinfo", 1},
    {"memory.max", 0},             {"memory.current", 0},    {"memory.stat", 0},
    {"memory.limit_in_bytes", 0},  {"memory.usage_in_bytes", 0},
};

/* each text's file, made once an input (a deep cgroup path opens the
 * same level file thousands of times): a new descriptor to it each open */
static struct {
    const char *text;
    size_t len;
    int fd;
} g_made[64];
static int g_nmade;

static int make(const char *text, size_t len)
{
    int fd = memfd_create("ferry-fuzz", MFD_CLOEXEC);
    if (fd < 0)
        abort();
    for (size_t off = 0; off < len;) {
        ssize_t w = pwrite(fd, text + off, len - off, (off_t)off);
        if (w <= 0)
            abort();
        off += (size_t)w;
    }
    return fd;
}

static int serve(const char *text, size_t len)
{
    int i = 0;
    while (i < g_nmade && (g_made[i].text != text || g_made[i].len != len))
        i++;
    if (i == g_nmade) {
        if (i == 64)
            return make(text, len);
        g_made[i].text = text;
        g_made[i].len = len;
        g_made[i].fd = make(text, len);
        g_nmade++;
    }
    int fd = fcntl(g_made[i].fd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0)
        return -1; /* (errno: EMFILE as the kernel's would be) */
    lseek(fd, 0, SEEK_SET); /* (the offset is shared: a stream read it to the end) */
    return fd;
}

static int fuzz_open(const char *path)
{
    size_t rl = strlen(ROOT);
    if (strncmp(path, ROOT "/", rl + 1) || strstr(path, "/../"))
        abort(); /* a file outside the root given, or a path going up */
    if (++g_opens == g_fail_at) {
        g_failed = 1;
        errno = EMFILE;
        return -1;
    }
    const char *rel = path + rl, *last = strrchr(path, '/');
    for (int i = 0; i < NPART - 1; i++) {
        if (FILES[i].whole ? strcmp(rel, FILES[i].name) : strcmp(last + 1, FILES[i].name))
            continue;
        if (!g_given[i])
            break;
        if (FILES[i].whole)
            return serve(g_part[i], g_len[i]);
        /* a level's own text: by its depth */
        size_t k = 0, n = 1;
        for (const char *s = rel; *s; s++)
            k += *s == '/';
        for (size_t j = 0; j < g_len[i]; j++)
            n += g_part[i][j] == 2;
        const char *t = g_part[i], *end = t + g_len[i];
        for (size_t j = k % n; j > 0; j--)
            t = (const char *)memchr(t, 2, (size_t)(end - t)) + 1;
        const char *e = memchr(t, 2, (size_t)(end - t));
        return serve(t, (size_t)((e ? e : end) - t));
    }
    errno = ENOENT;
    return -1;
}

/* the lowest descriptor free now */
static int lowest_fd(void)
{
    int fd = dup(0);
    if (fd < 0)
        abort();
    close(fd);
    return fd;
}

static void split(const uint8_t *data, size_t size)
{
    memset(g_given, 0, sizeof g_given);
    const char *p = (const char *)data, *end = p + size;
    for (int i = 0; i < NPART; i++) {
        const char *e = memchr(p, 1, (size_t)(end - p));
        g_part[i] = p;
        g_len[i] = (size_t)((e ? e : end) - p);
        g_given[i] = 1;
        if (!e)
            break;
        p = e + 1;
    }
    g_fail_at = g_given[8] && g_len[8] ? (uint8_t)g_part[8][0] : 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    int fd0 = lowest_fd();
    split(data, size);
    atomic_store(&ferry__test_mem_open, fuzz_open);

    /* the host's memory: /proc/meminfo alone */
    int given[NPART];
    memcpy(given, g_given, sizeof given);
    memset(g_given + 1, 0, sizeof g_given - sizeof g_given[0]);
    unsigned fail_at = g_fail_at;
    g_fail_at = 0;
    g_opens = 0;
    uint64_t host, host_avail;
    ferry__host_memory_at(ROOT, &host, &host_avail);
    if (host_avail > host)
        abort();

    /* with the cgroups' files */
    memcpy(g_given, given, sizeof given);
    g_fail_at = fail_at;
    g_opens = 0;
    uint64_t total, avail;
    ferry__host_memory_at(ROOT, &total, &avail);
    if (total > host || avail > total || avail > host_avail)
        abort();

    /* a watch: the same answer, read after read (but where a cgroup
     * file's open failed in the first read: it is opened at the second) */
    g_opens = 0;
    g_failed = 0;
    ferry__memwatch w;
    ferry__memwatch_open(&w, ROOT);
    for (int r = 0; r < 2; r++) {
        uint64_t t, a;
        ferry__memwatch_read(&w, &t, &a);
        if (r == 0 ? t != total || a != avail
                   : !g_failed && (t != total || a != avail))
            abort();
        if (t > host || a > t || a > host_avail)
            abort();
        char file[2 * 4096 + 64];
        int named = ferry__memwatch_limit_file(&w, file, sizeof file);
        if (named != (t < host))
            abort();
        if (named) {
            const char *last = strrchr(file, '/');
            if (strncmp(file, ROOT "/", sizeof ROOT) || !last ||
                (strcmp(last, "/memory.max") && strcmp(last, "/memory.limit_in_bytes")))
                abort();
        }
    }
    ferry__memwatch_close(&w);

    atomic_store(&ferry__test_mem_open, NULL);
    for (int i = 0; i < g_nmade; i++)
        close(g_made[i].fd);
    g_nmade = 0;
    if (lowest_fd() != fd0)
        abort(); /* a descriptor left open */
    return 0;
}
