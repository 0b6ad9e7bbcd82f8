/*
 * hostroot.c - whether this process is the host's root.
 *
 * A file system's root privileges (ext4's reserved blocks: its resuid,
 * uid 0 by default, or CAP_SYS_RESOURCE in the host's namespace) are the
 * host's uid 0, not a user namespace's: a rootless container's root is uid
 * 0 inside and some other uid outside, and the kernel checks the uid
 * outside. So euid 0 here counts only where /proc/self/uid_map maps it to
 * 0 outside (or has no map: a kernel without user namespaces).
 */
#include <stdio.h>
#include <unistd.h>

#include "core.h"

int ferry__host_root(void)
{
    if (geteuid() != 0)
        return 0;
    FILE *f = fopen("/proc/self/uid_map", "re");
    if (!f)
        return 1;
    unsigned long long in, out, n;
    int root = 0;
    while (fscanf(f, "%llu %llu %llu", &in, &out, &n) == 3)
        if (in == 0 && n > 0) {
            root = out == 0;
            break;
        }
    fclose(f);
    return root;
}
