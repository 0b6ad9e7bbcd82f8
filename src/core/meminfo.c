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
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "core/core.h"

_Atomic uint64_t ferry__test_mem_total;
_Atomic uint64_t ferry__test_mem_avail;

/* the number a one-line file under root holds; 0 where it is missing or
 * says "max" */
static uint64_t file_u64(const char *root, const char *path)
{
    char p[1024];
    if (snprintf(p, sizeof p, "%s%s", root, path) >= (int)sizeof p)
        return 0;
    FILE *f = fopen(p, "re");
    if (!f)
        return 0;
    unsigned long long v = 0;
    if (fscanf(f, "%llu", &v) != 1)
        v = 0;
    fclose(f);
    return (uint64_t)v;
}

/* the value of "key N" in a file of such lines under root (a cgroup's
 * memory.stat); 0 where it is missing */
static uint64_t key_u64(const char *root, const char *path, const char *key)
{
    char p[1024], line[256];
    if (snprintf(p, sizeof p, "%s%s", root, path) >= (int)sizeof p)
        return 0;
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
 * `ctl` ("" for v2's "0::"), from root's /proc/self/cgroup, into out;
 * 0 where it has none */
static int cgroup_of(const char *root, const char *ctl, char *out, size_t len)
{
    char p[1024], line[1024];
    snprintf(p, sizeof p, "%s/proc/self/cgroup", root);
    FILE *f = fopen(p, "re");
    if (!f)
        return 0;
    int found = 0;
    while (!found && fgets(line, sizeof line, f)) {
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

/* the lowest limit of the process's cgroup and those above it (one
 * mounted as the hierarchy's root in a container included) into *limit,
 * and the least room any leaves (its limit less its working set) into
 * *room; neither touched where none has a limit below host (v1 says "no
 * limit" with a huge number) */
static void cgroup_walk(const char *root, const cg_files *k, uint64_t host, uint64_t *limit,
                        uint64_t *room)
{
    char rel[600], dir[700], path[800];
    if (!cgroup_of(root, k->ctl, rel, sizeof rel))
        return;
    for (;;) {
        snprintf(dir, sizeof dir, "%s%s", k->base, rel);
        snprintf(path, sizeof path, "%s/%s", dir, k->max);
        uint64_t lim = file_u64(root, path);
        if (lim && lim < host) {
            snprintf(path, sizeof path, "%s/%s", dir, k->cur);
            uint64_t used = file_u64(root, path);
            snprintf(path, sizeof path, "%s/%s", dir, k->stat);
            uint64_t inactive = key_u64(root, path, k->inactive);
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

/* MemTotal and MemAvailable of root's /proc/meminfo in bytes (0: none) */
static void meminfo(const char *root, uint64_t *total, uint64_t *avail)
{
    char p[1024], line[128];
    *total = *avail = 0;
    snprintf(p, sizeof p, "%s/proc/meminfo", root);
    FILE *f = fopen(p, "re");
    if (!f)
        return;
    unsigned long long kb;
    while ((!*total || !*avail) && fgets(line, sizeof line, f)) {
        if (sscanf(line, "MemTotal: %llu kB", &kb) == 1)
            *total = (uint64_t)kb << 10;
        else if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1)
            *avail = (uint64_t)kb << 10;
    }
    fclose(f);
}

void ferry__host_memory_at(const char *root, uint64_t *total, uint64_t *avail)
{
    uint64_t t, a;
    meminfo(root, &t, &a);
    if (!t && !*root) {
        long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
        t = pages > 0 && page > 0 ? (uint64_t)pages * (uint64_t)page : 0;
    }
    if (!t)
        t = UINT64_MAX;
    if (!a)
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
