/*
 * meminfo.c - how much memory the process may have: the host's physical
 * memory, or less where its cgroup (v2 memory.max, v1
 * memory.limit_in_bytes) says so; and how much of it is available now
 * (MemAvailable, less where the cgroup's limit less its use is lower).
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

/* the number a one-line file holds; 0 where it is missing or says "max" */
static uint64_t file_u64(const char *path)
{
    FILE *f = fopen(path, "re");
    if (!f)
        return 0;
    unsigned long long v = 0;
    if (fscanf(f, "%llu", &v) != 1)
        v = 0;
    fclose(f);
    return (uint64_t)v;
}

/* MemAvailable of /proc/meminfo in bytes; 0 where it cannot be read */
static uint64_t mem_available(void)
{
    FILE *f = fopen("/proc/meminfo", "re");
    if (!f)
        return 0;
    char line[128];
    unsigned long long kb = 0;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1)
            break;
    fclose(f);
    return (uint64_t)kb << 10;
}

/* the process's cgroup v2 directory under /sys/fs/cgroup ("" for the root,
 * or a v1 host: then 0 is returned) into dir */
static int cgroup2_dir(char *dir, size_t len)
{
    FILE *f = fopen("/proc/self/cgroup", "re");
    if (!f)
        return 0;
    char line[512];
    int found = 0;
    while (!found && fgets(line, sizeof line, f)) {
        if (strncmp(line, "0::", 3) != 0)
            continue;
        line[strcspn(line, "\n")] = 0;
        found = snprintf(dir, len, "/sys/fs/cgroup%s", line + 3) < (int)len;
    }
    fclose(f);
    return found;
}

/* the cgroup's limit and use (0, 0 where it has none) */
static void cgroup_memory(uint64_t *limit, uint64_t *used)
{
    char dir[600], path[700];
    *limit = *used = 0;
    if (cgroup2_dir(dir, sizeof dir)) {
        snprintf(path, sizeof path, "%s/memory.max", dir);
        *limit = file_u64(path);
        snprintf(path, sizeof path, "%s/memory.current", dir);
        *used = *limit ? file_u64(path) : 0;
        if (*limit)
            return;
    }
    *limit = file_u64("/sys/fs/cgroup/memory/memory.limit_in_bytes");
    *used = *limit ? file_u64("/sys/fs/cgroup/memory/memory.usage_in_bytes") : 0;
}

void ferry__host_memory(uint64_t *total, uint64_t *avail)
{
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    uint64_t t = pages > 0 && page > 0 ? (uint64_t)pages * (uint64_t)page : UINT64_MAX;
    uint64_t a = mem_available(), limit, used;
    if (!a)
        a = t;
    cgroup_memory(&limit, &used);
    if (limit && limit < t) /* (v1 says "no limit" with a huge number) */
        t = limit;
    if (limit && a > (limit > used ? limit - used : 0))
        a = limit > used ? limit - used : 0;
    uint64_t tt = atomic_load_explicit(&ferry__test_mem_total, memory_order_relaxed);
    uint64_t ta = atomic_load_explicit(&ferry__test_mem_avail, memory_order_relaxed);
    *total = tt ? tt : t;
    *avail = ta ? ta : a < *total ? a : *total;
}
