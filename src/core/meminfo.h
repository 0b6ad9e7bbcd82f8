/*
 * meminfo.h - the memory this process may have, watched (private;
 * meminfo.c).
 *
 * ferry__host_memory (core.h) finds the process's cgroups anew at every
 * call: /proc/self/cgroup read, every level's files opened by path. A
 * caller that asks again and again (the L1 fill, before each 8 MiB step)
 * opens a watch instead: the cgroups are found and their files opened
 * once, and each read re-reads only their numbers.
 */
#ifndef FERRY_SRC_CORE_MEMINFO_H
#define FERRY_SRC_CORE_MEMINFO_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

/* the levels of a hierarchy whose files a watch holds open (the deepest
 * first); levels above them are opened by path at each read */
#define FERRY__MEMWATCH_HELD 16
#define FERRY__MEMWATCH_PATH 4096

typedef struct ferry__memwatch {
    const char *root;  /* the files under it ("": this host's) */
    int seams;         /* this host's, the test seams apply */
    int meminfo;       /* root's /proc/meminfo, or -1 */
    int again;         /* a file went unopened for want of descriptors or memory:
                        * the cgroups are found anew at the next read */
    struct {
        int on;                            /* the process has a cgroup there, mounted */
        char dir[FERRY__MEMWATCH_PATH];    /* its directory (under root) ... */
        size_t top;                        /* ... below the mount point, dir's first top bytes */
        int fd[FERRY__MEMWATCH_HELD][3];   /* limit, use, stat of each level, or -1 */
    } cg[2];                               /* v2, v1 */
    int lim_cg;        /* the limit the last read's total is: in cg[lim_cg] ... */
    size_t lim_len;    /* ... at dir's first lim_len bytes (lim_cg -1: none) */
} ferry__memwatch;

/* find the process's cgroups (/proc/self/cgroup) and where their
 * hierarchies are mounted (/proc/self/mountinfo: v2 as cgroup2, v1's with
 * the memory controller; /sys/fs/cgroup and /sys/fs/cgroup/memory where
 * it cannot be read), and open their files: root NULL for this
 * host's (and the test seams), else the files under root (which must
 * outlive the watch). Never fails: what cannot be opened is read as absent. */
void ferry__memwatch_open(ferry__memwatch *w, const char *root);
/* what the process may have in all and what is available now, as
 * ferry__host_memory says, from the numbers the watch's files hold now
 * (found anew first where the open was short of descriptors or memory) */
void ferry__memwatch_read(ferry__memwatch *w, uint64_t *total, uint64_t *avail);
/* the cgroup file whose limit the last read's total is, into out; 0 where
 * the total is the host's memory (or a test's figure) */
int ferry__memwatch_limit_file(const ferry__memwatch *w, char *out, size_t len);
void ferry__memwatch_close(ferry__memwatch *w);

/* test seams: how many times the process's cgroups were found (a read of
 * /proc/self/cgroup and a walk of its levels' directories), and, while
 * set, the root that stands for this host's files */
extern _Atomic unsigned long ferry__test_mem_walks;
extern const char *_Atomic ferry__test_mem_root;
/* fuzz seam: while set, every file the readers open (its whole path,
 * root first) is opened by it: a descriptor to read, or -1 and errno */
extern int (*_Atomic ferry__test_mem_open)(const char *path);

#endif
