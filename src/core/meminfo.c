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
 */
#include <limits.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/core.h"

_Atomic uint64_t ferry__test_mem_total;
_Atomic uint64_t ferry__test_mem_avail;

/* the number a one-line file holds; 0 where it is missing or says "max" */
static uint64_t file_u64(const char *p)
{
    FILE *f = fopen(p, "re");
    if (!f)
        return 0;
    unsigned long long v = 0;
    if (fscanf(f, "%llu", &v) != 1)
        v = 0;
    fclose(f);
    return (uint64_t)v;
}

/* the value of "key N" in a file of such lines (a cgroup's memory.stat);
 * 0 where it is missing */
static uint64_t key_u64(const char *p, const char *key)
{
    char line[256];
    FILE *f = fopen(p, "re");
    if (!f)
        return 0;
    size_t kl = strlen(key);
    unsigned long long v = 0;
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, key, kl) && line[kl] == ' ' && sscanf(line + kl, " %llu", &v) == 1)
            break;
    fclose(f);
    return (uint64_t)v;
}

/* the path of the process's cgroup of the hierarchy whose controllers are
 * `ctl` ("" for v2's "0::"), from root's /proc/self/cgroup, into out (""
 * for the hierarchy's root); 0 where it has none. Lines are read whole:
 * a cgroup's path may be as long as a file's (PATH_MAX), more than any
 * line buffer of a fixed size holds */
static int cgroup_of(const char *root, const char *ctl, char *out, size_t len)
{
    char p[PATH_MAX];
    if (snprintf(p, sizeof p, "%s/proc/self/cgroup", root) >= (int)sizeof p)
        return 0;
    FILE *f = fopen(p, "re");
    if (!f)
        return 0;
    char *line = NULL;
    size_t cap = 0;
    int found = 0;
    while (!found && getline(&line, &cap, f) > 0) {
        line[strcspn(line, "\n")] = 0;
        char *c1 = strchr(line, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
        if (!c2)
            continue;
        *c1 = *c2 = 0;
        const char *ctls = c1 + 1;
        int match = !*ctl ? !*ctls && !strcmp(line, "0") : 0;
        for (const char *s = ctls; *ctl && *s && !match;) { /* (a comma-separated list) */
            size_t n = strcspn(s, ",");
            match = n == strlen(ctl) && !strncmp(s, ctl, n);
            s += n + (s[n] == ',');
        }
        if (match && c2[1] == '/' && !strstr(c2 + 1, "/.."))
            found = snprintf(out, len, "%s", c2[1 + strspn(c2 + 1, "/")] ? c2 + 1 : "") <
                    (int)len;
    }
    free(line);
    fclose(f);
    return found;
}

typedef struct cg_files {
    const char *base, *ctl, *max, *cur, *stat, *inactive;
} cg_files;

static const cg_files CG_V2 = {"/sys/fs/cgroup", "", "memory.max", "memory.current",
                               "memory.stat", "inactive_file"};
static const cg_files CG_V1 = {"/sys/fs/cgroup/memory", "memory", "memory.limit_in_bytes",
                               "memory.usage_in_bytes", "memory.stat", "total_inactive_file"};

/* root, base, rel and "/name" into p; 0 where they do not fit */
static int cg_path(char *p, size_t len, const char *root, const cg_files *k, const char *rel,
                   const char *name)
{
    return snprintf(p, len, "%s%s%s/%s", root, k->base, rel, name) < (int)len;
}

/* the lowest limit of the process's cgroup and those above it (one
 * mounted as the hierarchy's root in a container included) into *limit,
 * and the least room any leaves (its limit less its working set) into
 * *room; neither touched where none has a limit below host (v1 says "no
 * limit" with a huge number). A level whose files' paths are too long to
 * open is passed over, not the levels above it. */
static void cgroup_walk(const char *root, const cg_files *k, uint64_t host, uint64_t *limit,
                        uint64_t *room)
{
    char rel[PATH_MAX], path[2 * PATH_MAX];
    if (!cgroup_of(root, k->ctl, rel, sizeof rel))
        return;
    for (;;) {
        uint64_t lim = cg_path(path, sizeof path, root, k, rel, k->max) ? file_u64(path) : 0;
        if (lim && lim < host) {
            uint64_t used = cg_path(path, sizeof path, root, k, rel, k->cur) ? file_u64(path) : 0;
            uint64_t inactive = cg_path(path, sizeof path, root, k, rel, k->stat)
                                    ? key_u64(path, k->inactive)
                                    : 0;
            used = used > inactive ? used - inactive : 0;
            uint64_t r = lim > used ? lim - used : 0;
            *limit = lim < *limit ? lim : *limit;
            *room = r < *room ? r : *room;
        }
        if (!*rel)
            break;
        char *slash = strrchr(rel, '/');
        *slash = 0; /* (rel starts with one: "/a" becomes "", the base) */
    }
}

/* MemTotal and MemAvailable of root's /proc/meminfo in bytes into *total
 * and *avail; what is missing is left as it was (a MemAvailable of 0 is
 * the kernel's floor under pressure: none available, not "unknown") */
static void meminfo(const char *root, uint64_t *total, uint64_t *avail)
{
    char p[PATH_MAX], line[128];
    if (snprintf(p, sizeof p, "%s/proc/meminfo", root) >= (int)sizeof p)
        return;
    FILE *f = fopen(p, "re");
    if (!f)
        return;
    unsigned long long kb;
    int seen = 0;
    while (seen != 3 && fgets(line, sizeof line, f)) {
        if (sscanf(line, "MemTotal: %llu kB", &kb) == 1) {
            *total = kb > UINT64_MAX >> 10 ? UINT64_MAX : (uint64_t)kb << 10;
            seen |= 1;
        } else if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1) {
            *avail = kb > UINT64_MAX >> 10 ? UINT64_MAX : (uint64_t)kb << 10;
            seen |= 2;
        }
    }
    fclose(f);
}

void ferry__host_memory_at(const char *root, uint64_t *total, uint64_t *avail)
{
    uint64_t t = 0, a = UINT64_MAX; /* (UINT64_MAX: no MemAvailable line) */
    meminfo(root, &t, &a);
    if (!t && !*root) {
        long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
        t = pages > 0 && page > 0 ? (uint64_t)pages * (uint64_t)page : 0;
    }
    if (!t)
        t = UINT64_MAX;
    if (a == UINT64_MAX || a > t)
        a = t;
    uint64_t limit = t, room = a;
    cgroup_walk(root, &CG_V2, t, &limit, &room);
    cgroup_walk(root, &CG_V1, t, &limit, &room);
    *total = limit;
    *avail = room < limit ? room : limit;
}

void ferry__host_memory(uint64_t *total, uint64_t *avail)
{
    ferry__host_memory_at("", total, avail);
    uint64_t tt = atomic_load_explicit(&ferry__test_mem_total, memory_order_relaxed);
    uint64_t ta = atomic_load_explicit(&ferry__test_mem_avail, memory_order_relaxed);
    if (tt)
        *total = tt;
    if (ta || tt)
        *avail = ta ? ta : *avail < *total ? *avail : *total;
}
