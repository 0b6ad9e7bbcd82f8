/*
 * meminfo.c - how much memory the process may have: the host's physical
 * memory, or less where a cgroup says so (the process's own or any above
 * it: v2 memory.max, v1 memory.limit_in_bytes); and how much of it is
 * available now (MemAvailable, less where a cgroup's limit less its
 * working set is lower).
 *
 * A cgroup's working set is its use less its inactive file pages (v2
 * memory.stat inactive_file, v1 total_inactive_file), as the kernel
 * reclaims those before it ever kills: a cgroup's use counts the page
 * cache of every file its processes read or wrote (a model's weights, the
 * L2 tier's files), and a long-lived cgroup's use sits near its limit.
 * Its limit less its whole use would say no memory is available where
 * most of it is.
 *
 * The L1 pool asks before it takes memory: a pool larger than the whole
 * could never be backed (refused at open), and its pages are faulted in
 * ahead of use only while that leaves the host memory to spare (a pool
 * faulted past what is available brings the kernel's out-of-memory
 * killer onto whichever process is largest: the engine, the daemon, or a
 * bystander).
 *
 * The hierarchies are read where /proc/self/mountinfo says they are
 * mounted (v2 is /sys/fs/cgroup/unified on a hybrid host; v1's memory
 * controller may be anywhere), the process's cgroup below a mount of a
 * part of the hierarchy (a container without a cgroup namespace has its
 * own cgroup at /sys/fs/cgroup) found by the mount's root; where the file
 * cannot be read, /sys/fs/cgroup and /sys/fs/cgroup/memory.
 *
 * A limit of 0 is a limit (nothing may be had); only v2's "max" and v1's
 * huge number (any limit at or above the host's memory) mean none. A
 * kernel without MemAvailable (before 3.14) has what it had then:
 * MemFree + Buffers + Cached, the kernel's own approximation of it.
 *
 * The process's cgroups are found once by a watch (meminfo.h): the L1 fill
 * asks before each 8 MiB step, and finding them anew (/proc/self/cgroup
 * read, every level's files opened by path) costs 18 to 55 us a call on
 * the 2-core VM (121 seen elsewhere) where re-reading the numbers of the
 * files held open costs about 10 (most of it /proc/meminfo).
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/core.h"
#include "core/meminfo.h"

_Atomic uint64_t ferry__test_mem_total;
_Atomic uint64_t ferry__test_mem_avail;
_Atomic unsigned long ferry__test_mem_walks;
const char *_Atomic ferry__test_mem_root;
int (*_Atomic ferry__test_mem_open)(const char *path);

/* fd's text from its start (a kernel file makes it anew at each read from
 * offset 0) into buf, NUL-terminated; 0 where none could be read */
static int text_of(int fd, char *buf, size_t cap)
{
    size_t got = 0;
    while (fd >= 0 && got < cap - 1) {
        ssize_t r = pread(fd, buf + got, cap - 1 - got, (off_t)got);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            break;
        got += (size_t)r;
    }
    buf[got] = 0;
    return got > 0;
}

/* the number a one-line file holds into *v; 0 where it holds none ("max",
 * v2's word for no limit; a file missing or empty) */
static int num_of(int fd, uint64_t *v)
{
    char buf[64], *end;
    if (!text_of(fd, buf, sizeof buf) || buf[0] < '0' || buf[0] > '9')
        return 0;
    errno = 0;
    unsigned long long n = strtoull(buf, &end, 10);
    if (errno || (*end && *end != '\n'))
        return 0;
    *v = (uint64_t)n;
    return 1;
}

/* the value of "key N" in a file of such lines (a cgroup's memory.stat);
 * 0 where it is missing */
static uint64_t key_of(int fd, const char *key)
{
    char buf[8192];
    if (!text_of(fd, buf, sizeof buf))
        return 0;
    size_t kl = strlen(key);
    unsigned long long v = 0;
    for (const char *l = buf; l && *l; l = strchr(l, '\n'), l = l ? l + 1 : NULL)
        if (!strncmp(l, key, kl) && l[kl] == ' ' && sscanf(l + kl, " %llu", &v) == 1)
            break;
    return (uint64_t)v;
}

/* whether an open's errno e is for want of descriptors or memory (the
 * file is there: asked again later), not for the file's absence */
static int short_of(int e)
{
    return e == EMFILE || e == ENFILE || e == ENOMEM;
}

/* p opened to read (by the test seam's opener where one is set); -1
 * where it cannot be (*again |= 1 where it may be later: no descriptor or
 * memory for it now) */
static int open_ro(const char *p, int *again)
{
    int (*opener)(const char *) =
        atomic_load_explicit(&ferry__test_mem_open, memory_order_relaxed);
    int fd;
    do
        fd = opener ? opener(p) : open(p, O_RDONLY | O_CLOEXEC);
    while (fd < 0 && errno == EINTR);
    if (fd < 0)
        *again |= short_of(errno);
    return fd;
}

/* p opened to read as a stream, as open_ro */
static FILE *fopen_ro(const char *p, int *again)
{
    int fd = open_ro(p, again);
    FILE *f = fd >= 0 ? fdopen(fd, "r") : NULL;
    if (fd >= 0 && !f) {
        *again |= short_of(errno);
        close(fd);
    }
    return f;
}

/* whether the comma-separated list holds word */
static int has_word(const char *list, const char *word)
{
    size_t wl = strlen(word);
    for (const char *s = list; *s;) {
        size_t n = strcspn(s, ",");
        if (n == wl && !strncmp(s, word, n))
            return 1;
        s += n + (s[n] == ',');
    }
    return 0;
}

/* the path of the process's cgroup of the hierarchy whose controllers are
 * `ctl` ("" for v2's "0::"), from root's /proc/self/cgroup ("" for the
 * hierarchy's root; the caller frees it); NULL where it has none. Lines
 * are read whole: a cgroup's path may be longer than a file's (PATH_MAX) */
static char *cgroup_of(const char *root, const char *ctl, int *again)
{
    char p[PATH_MAX];
    if (snprintf(p, sizeof p, "%s/proc/self/cgroup", root) >= (int)sizeof p)
        return NULL;
    FILE *f = fopen_ro(p, again);
    if (!f)
        return NULL;
    char *line = NULL;
    size_t cap = 0;
    int found = 0;
    while (!found && getline(&line, &cap, f) > 0) {
        line[strcspn(line, "\n")] = 0;
        char *c1 = strchr(line, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
        if (!c2)
            continue;
        *c1 = *c2 = 0;
        int match = !*ctl ? !c1[1] && !strcmp(line, "0") : has_word(c1 + 1, ctl);
        if (match && c2[1] == '/' && !strstr(c2 + 1, "/..")) {
            const char *rel = c2[1 + strspn(c2 + 1, "/")] ? c2 + 1 : "";
            memmove(line, rel, strlen(rel) + 1);
            found = 1;
        }
    }
    fclose(f);
    if (!found)
        free(line);
    return found ? line : NULL;
}

/* mountinfo's octal escapes (\040 a space, \011, \012, \134) undone in s */
static void unescape(char *s)
{
    char *o = s;
    for (; *s; s++, o++) {
        if (s[0] == '\\' && s[1] >= '0' && s[1] <= '3' && s[2] >= '0' && s[2] <= '7' &&
            s[3] >= '0' && s[3] <= '7') {
            *o = (char)((s[1] - '0') << 6 | (s[2] - '0') << 3 | (s[3] - '0'));
            s += 3;
        } else {
            *o = *s;
        }
    }
    *o = 0;
}

/* the bytes of the cgroup path rel a mount of root mroot (its own path in
 * the hierarchy) leaves out: mroot's length where it is rel or one of its
 * ancestors ("/": 0); -1 where rel is not below it */
static long shown_below(const char *mroot, const char *rel)
{
    size_t n = strlen(mroot);
    while (n > 0 && mroot[n - 1] == '/')
        n--;
    return strncmp(mroot, rel, n) || (rel[n] && rel[n] != '/') ? -1 : (long)n;
}

/* the mount point of each hierarchy c whose rel[c] is set (v2: a cgroup2
 * mount; v1: a cgroup one with the memory controller) from root's
 * /proc/self/mountinfo into mp[c] (the caller frees it; NULL: none
 * mounted), and into skip[c] the bytes of rel[c] above it. Of several
 * mounts, the one showing the process's cgroup and the most levels above
 * it (a container's /sys/fs/cgroup without a cgroup namespace shows its
 * own cgroup, the host's whole hierarchy is elsewhere); where none shows
 * it (a cgroup namespace's paths), the first, and rel whole. 0 where the
 * file cannot be read (*again: for now) */
static int mounts_of(const char *root, char *const rel[2], char *mp[2], size_t skip[2],
                     int *again)
{
    char p[PATH_MAX];
    FILE *f = snprintf(p, sizeof p, "%s/proc/self/mountinfo", root) < (int)sizeof p
                  ? fopen_ro(p, again)
                  : NULL;
    if (!f)
        return 0;
    char *line = NULL;
    size_t cap = 0;
    long best[2] = {-2, -2}; /* (-2: none yet; -1: one that does not show rel) */
    while (getline(&line, &cap, f) > 0) {
        char *fld[64], *save = NULL;
        int n = 0, dash = -1;
        for (char *t = strtok_r(line, " \n", &save); t && n < 64; t = strtok_r(NULL, " \n", &save))
            if (!strcmp(fld[n++] = t, "-") && dash < 0 && n > 6)
                dash = n - 1;
        if (dash < 0 || dash + 3 >= n)
            continue;
        const char *type = fld[dash + 1], *opts = fld[dash + 3];
        int c = !strcmp(type, "cgroup2") ? 0
                : !strcmp(type, "cgroup") && has_word(opts, "memory") ? 1
                : -1;
        if (c < 0 || !rel[c])
            continue;
        unescape(fld[3]);
        unescape(fld[4]);
        /* a root or mount point not absolute, or going up (a line short
         * of fields, a file not the kernel's): never a path to open, not
         * one relative to the working directory or outside root */
        if (fld[3][0] != '/' || fld[4][0] != '/' || strstr(fld[3], "/..") ||
            strstr(fld[4], "/.."))
            continue;
        long s = shown_below(fld[3], rel[c]);
        if (best[c] == -2 || (s >= 0 && (best[c] < 0 || s < best[c]))) {
            char *m = strdup(fld[4]);
            if (!m)
                continue;
            free(mp[c]);
            mp[c] = m;
            best[c] = s;
            skip[c] = s > 0 ? (size_t)s : 0;
        }
    }
    free(line);
    fclose(f);
    return 1;
}

typedef struct cg_files {
    const char *base, *ctl, *file[3], *inactive; /* file: limit, use, stat */
} cg_files;

static const cg_files CG[2] = {
    {"/sys/fs/cgroup", "", {"memory.max", "memory.current", "memory.stat"}, "inactive_file"},
    {"/sys/fs/cgroup/memory",
     "memory",
     {"memory.limit_in_bytes", "memory.usage_in_bytes", "memory.stat"},
     "total_inactive_file"},
};

/* hierarchy c's directory of the process's cgroup: mount point mp ("/" as
 * "") and the cgroup's path below it, rel; where they do not fit, the
 * lowest of its ancestors that does (the levels below it have paths too
 * long to open) */
static void place(ferry__memwatch *w, int c, const char *mp, const char *rel)
{
    char *d = w->cg[c].dir;
    size_t cap = sizeof w->cg[c].dir, m = strcmp(mp, "/") ? strlen(mp) : 0, n = strlen(rel);
    if (m >= cap)
        return;
    while (n > 0 && m + n >= cap)
        while (n > 0 && rel[--n] != '/')
            ;
    memcpy(d, mp, m);
    memcpy(d + m, rel, n);
    d[m + n] = 0;
    w->cg[c].top = m;
    w->cg[c].on = 1;
}

/* root, dir's first n bytes and "/name" into p; 0 where they do not fit */
static int cg_path(char *p, size_t len, const char *root, const char *dir, size_t n,
                   const char *name)
{
    return snprintf(p, len, "%s%.*s/%s", root, (int)n, dir, name) < (int)len;
}

/* the length of the parent of hierarchy c's level at dir's first n bytes
 * (n above the mount point: "/m/a/b" -> "/m/a") */
static size_t parent_of(const ferry__memwatch *w, int c, size_t n)
{
    while (n > w->cg[c].top && w->cg[c].dir[--n] != '/')
        ;
    return n;
}

void ferry__memwatch_open(ferry__memwatch *w, const char *root)
{
    memset(w, 0, sizeof *w);
    w->seams = !root;
    if (!root)
        root = atomic_load_explicit(&ferry__test_mem_root, memory_order_relaxed);
    w->root = root ? root : "";
    w->lim_cg = -1;
    char p[2 * PATH_MAX];
    w->meminfo = snprintf(p, sizeof p, "%s/proc/meminfo", w->root) < (int)sizeof p
                     ? open_ro(p, &w->again)
                     : -1;
    atomic_fetch_add_explicit(&ferry__test_mem_walks, 1, memory_order_relaxed);
    char *rel[2], *mp[2] = {NULL, NULL};
    size_t skip[2] = {0, 0};
    for (int c = 0; c < 2; c++)
        rel[c] = cgroup_of(w->root, CG[c].ctl, &w->again);
    int mounts = mounts_of(w->root, rel, mp, skip, &w->again);
    for (int c = 0; c < 2; c++) {
        for (int l = 0; l < FERRY__MEMWATCH_HELD; l++)
            w->cg[c].fd[l][0] = w->cg[c].fd[l][1] = w->cg[c].fd[l][2] = -2;
        if (rel[c] && (mp[c] || (!mounts && !w->again)))
            place(w, c, mp[c] ? mp[c] : CG[c].base, rel[c] + skip[c]);
        free(rel[c]);
        free(mp[c]);
        size_t n = strlen(w->cg[c].dir);
        /* the deepest levels' limits, each to the mount point (their use
         * and stat are opened when a limit is first read); a level whose
         * files' paths are too long to open is passed over, not those above */
        for (int l = 0; w->cg[c].on && l < FERRY__MEMWATCH_HELD; l++) {
            w->cg[c].fd[l][0] =
                cg_path(p, sizeof p, w->root, w->cg[c].dir, n, CG[c].file[0])
                    ? open_ro(p, &w->again)
                    : -1;
            if (n == w->cg[c].top)
                break;
            n = parent_of(w, c, n);
        }
    }
}

void ferry__memwatch_close(ferry__memwatch *w)
{
    if (w->meminfo >= 0)
        close(w->meminfo);
    w->meminfo = -1;
    for (int c = 0; c < 2; c++)
        for (int l = 0; l < FERRY__MEMWATCH_HELD; l++)
            for (int i = 0; i < 3; i++) {
                if (w->cg[c].fd[l][i] >= 0)
                    close(w->cg[c].fd[l][i]);
                w->cg[c].fd[l][i] = -2;
            }
}

/* hierarchy c's file i of the level at rel's first n bytes (level l from
 * the deepest): held open from the first time it is asked for (-2: not
 * yet), or opened now where the level is above those held (*opened) */
static int level_fd(ferry__memwatch *w, int c, int l, size_t n, int i, int *opened)
{
    char p[2 * PATH_MAX];
    int *held = l < FERRY__MEMWATCH_HELD ? &w->cg[c].fd[l][i] : NULL;
    if (held && *held != -2)
        return *held;
    int again = 0;
    int fd = cg_path(p, sizeof p, w->root, w->cg[c].dir, n, CG[c].file[i]) ? open_ro(p, &again)
                                                                            : -1;
    if (held)
        *held = again ? -2 : fd; /* (-2: asked again at the next read) */
    else
        *opened |= fd >= 0 ? 1 << i : 0;
    return fd;
}

/* the limit, use and inactive file pages of hierarchy c's level at rel's
 * first n bytes (level l from the deepest); 0 where it has no limit below
 * host (none, "max", or v1's huge number for none) */
static int level_read(ferry__memwatch *w, int c, int l, size_t n, uint64_t host, uint64_t *lim,
                      uint64_t *used, uint64_t *inactive)
{
    int fd[3], opened = 0;
    fd[0] = level_fd(w, c, l, n, 0, &opened);
    int have = num_of(fd[0], lim) && *lim < host;
    *used = 0;
    *inactive = 0;
    if (have) {
        fd[1] = level_fd(w, c, l, n, 1, &opened);
        fd[2] = level_fd(w, c, l, n, 2, &opened);
        if (!num_of(fd[1], used))
            *used = 0;
        *inactive = key_of(fd[2], CG[c].inactive);
    }
    for (int i = 0; i < 3; i++)
        if (opened & 1 << i)
            close(fd[i]);
    return have;
}

/* the lowest limit of the process's cgroup and those above it in
 * hierarchy c, up to its mount point (a container's own cgroup, where
 * it has no cgroup namespace), into *limit, and the least room any leaves (its limit less
 * its working set) into *room; neither touched where none has a limit
 * below host (v1 says "no limit" with a huge number) */
static void cgroup_read(ferry__memwatch *w, int c, uint64_t host, uint64_t *limit, uint64_t *room)
{
    size_t n = strlen(w->cg[c].dir);
    for (int l = 0; w->cg[c].on; l++) {
        uint64_t lim = 0, used, inactive;
        if (level_read(w, c, l, n, host, &lim, &used, &inactive)) {
            used = used > inactive ? used - inactive : 0;
            uint64_t r = lim > used ? lim - used : 0;
            if (lim < *limit) {
                *limit = lim;
                w->lim_cg = c;
                w->lim_len = n;
            }
            *room = r < *room ? r : *room;
        }
        if (n == w->cg[c].top)
            break;
        n = parent_of(w, c, n);
    }
}

/* MemTotal and MemAvailable of /proc/meminfo in bytes into *total and
 * *avail; what is missing is left as it was (a MemAvailable of 0 is the
 * kernel's floor under pressure: none available, not "unknown"). A
 * kernel without MemAvailable (before 3.14): MemFree + Buffers + Cached */
static void meminfo(int fd, uint64_t *total, uint64_t *avail)
{
    char buf[4096];
    if (!text_of(fd, buf, sizeof buf))
        return;
    static const char *const key[] = {"MemTotal:", "MemAvailable:", "MemFree:", "Buffers:",
                                      "Cached:"};
    uint64_t v[5] = {0};
    unsigned seen = 0;
    for (const char *l = buf; l && *l; l = strchr(l, '\n'), l = l ? l + 1 : NULL)
        for (int k = 0; k < 5; k++) {
            unsigned long long kb;
            size_t kl = strlen(key[k]);
            if (!strncmp(l, key[k], kl) && sscanf(l + kl, " %llu", &kb) == 1) {
                v[k] = kb > UINT64_MAX >> 10 ? UINT64_MAX : (uint64_t)kb << 10;
                seen |= 1u << k;
            }
        }
    if (seen & 1)
        *total = v[0];
    if (seen & 2)
        *avail = v[1];
    else if ((seen & 0x1c) == 0x1c) /* (each under 2^54: no overflow) */
        *avail = v[2] + v[3] + v[4];
}

void ferry__memwatch_read(ferry__memwatch *w, uint64_t *total, uint64_t *avail)
{
    if (w->again) { /* (what it found short of descriptors or memory, found anew) */
        const char *root = w->seams ? NULL : w->root;
        ferry__memwatch_close(w);
        ferry__memwatch_open(w, root);
    }
    uint64_t t = 0, a = UINT64_MAX; /* (UINT64_MAX: no MemAvailable line) */
    meminfo(w->meminfo, &t, &a);
    if (!t && !*w->root) {
        long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
        t = pages > 0 && page > 0 ? (uint64_t)pages * (uint64_t)page : 0;
    }
    if (!t)
        t = UINT64_MAX;
    if (a == UINT64_MAX || a > t)
        a = t;
    uint64_t limit = t, room = a;
    w->lim_cg = -1;
    cgroup_read(w, 0, t, &limit, &room);
    cgroup_read(w, 1, t, &limit, &room);
    *total = limit;
    *avail = room < limit ? room : limit;
    if (!w->seams)
        return;
    uint64_t tt = atomic_load_explicit(&ferry__test_mem_total, memory_order_relaxed);
    uint64_t ta = atomic_load_explicit(&ferry__test_mem_avail, memory_order_relaxed);
    if (tt) {
        *total = tt;
        w->lim_cg = -1;
    }
    if (ta || tt)
        *avail = ta ? ta : *avail < *total ? *avail : *total;
}

int ferry__memwatch_limit_file(const ferry__memwatch *w, char *out, size_t len)
{
    if (w->lim_cg < 0)
        return 0;
    return cg_path(out, len, w->root, w->cg[w->lim_cg].dir, w->lim_len,
                   CG[w->lim_cg].file[0]);
}

void ferry__host_memory_at(const char *root, uint64_t *total, uint64_t *avail)
{
    ferry__memwatch w;
    ferry__memwatch_open(&w, root);
    ferry__memwatch_read(&w, total, avail);
    ferry__memwatch_close(&w);
}

void ferry__host_memory(uint64_t *total, uint64_t *avail)
{
    ferry__memwatch w;
    ferry__memwatch_open(&w, NULL);
    ferry__memwatch_read(&w, total, avail);
    ferry__memwatch_close(&w);
}
