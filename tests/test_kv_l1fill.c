/*
 * test_kv_l1fill.c - the L1 pool faulted in by a thread after open
 * (src/kv/store/tier_l1_fill.c): open leaves the pool to the thread and
 * the process's memory still grows by the whole pool; stores and
 * retrieves while the thread runs (and before it reached their slots)
 * keep every byte; close while the thread is held returns and leaks
 * nothing.
 *
 * The thread is held with the seam ferry__kv_l1_test_hold (it waits after
 * that many 8 MiB steps while the hold is set, or until its pool closes).
 */
/* ferry-test-labels: concurrent */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "core/core.h"
#include "core/meminfo.h"
#include "ferry/kv.h"
#include "ferry/serve.h"
#include "ferry_test.h"
#include "kv/store/tier_l1_fill.h"

#define CT 16u
#define TB 4096u                        /* bytes per token and plane */
#define PLANES 4u                       /* K and V of 2 layers */
#define CHUNK (PLANES * CT * TB)        /* 256 KiB */
#define MiB ((uint64_t)1 << 20)
#define POOL (256 * MiB)                /* 1024 chunks */

static ferry_kv_config config(uint64_t l1_bytes)
{
    ferry_kv_config c = FERRY_KV_CONFIG_INIT;
    c.model = "l1fill";
    c.layout = ft_kv_layout(TB);
    c.chunk_tokens = CT;
    c.l1_bytes = l1_bytes;
    c.workers = 2;
    return c;
}

/* resident bytes of this process */
static uint64_t rss(void)
{
    FILE *f = fopen("/proc/self/statm", "r");
    assert_non_null(f);
    unsigned long size = 0, res = 0;
    assert_int_equal(fscanf(f, "%lu %lu", &size, &res), 2);
    fclose(f);
    return (uint64_t)res * (uint64_t)sysconf(_SC_PAGESIZE);
}

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* the kernel can populate without writing (Linux 5.14); else open touches
 * every page as it always did, and the thread is never started */
static int kernel_populates(void)
{
#ifdef MADV_POPULATE_WRITE
    void *m = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    assert_true(m != MAP_FAILED);
    int ok = madvise(m, 4096, MADV_POPULATE_WRITE) == 0;
    munmap(m, 4096);
    return ok;
#else
    return 0;
#endif
}

static void hold(unsigned steps)
{
    atomic_store(&ferry__kv_l1_test_hold, steps);
}

/* open faults at most its first step; the pool's memory comes after, all
 * of it, once the thread may go on */
static void open_leaves_the_pool_to_the_thread(void **state)
{
    (void)state;
    if (!kernel_populates())
        skip();
    hold(1);
    uint64_t before = rss();
    ferry_kv_config c = config(POOL);
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    uint64_t opened = rss();
    assert_true(opened < before + POOL / 4);
    hold(0);
    double end = now_s() + 60;
    while (rss() < before + POOL - 8 * MiB && now_s() < end) {
        struct timespec ms = {0, 5000000};
        nanosleep(&ms, NULL);
    }
    assert_true(rss() >= before + POOL - 8 * MiB);
    ferry_kv_close(kv);
}

static void tokens_of(int32_t *t, size_t n, int32_t prompt)
{
    for (size_t i = 0; i < n; i++)
        t[i] = prompt * 100003 + (int32_t)i;
}

enum { PROMPTS = 32, PCH = 8, PTOK = PCH * CT }; /* 256 chunks: a quarter of the pool */

static size_t img_bytes(void)
{
    return (size_t)PLANES * PTOK * TB;
}

/* prompt p's image, stored and then compared byte for byte */
static void store_prompt(ferry_kv *kv, unsigned char *img, int p)
{
    int32_t tok[PTOK];
    tokens_of(tok, PTOK, p);
    ft_fill_pattern(img, img_bytes(), 1000u + (unsigned)p);
    ferry_kv_buffer b = ft_kv_host_buffer(img, PTOK, TB);
    assert_int_equal(ferry_kv_store(kv, tok, PTOK, NULL, &b), PTOK);
}

static void retrieve_prompt(ferry_kv *kv, unsigned char *img, int p)
{
    int32_t tok[PTOK];
    tokens_of(tok, PTOK, p);
    memset(img, 0xA5, img_bytes());
    ferry_kv_buffer b = ft_kv_host_buffer(img, PTOK, TB);
    assert_int_equal(ferry_kv_retrieve(kv, tok, PTOK, NULL, &b), PTOK);
    assert_int_equal(ft_check_pattern(img, img_bytes(), 1000u + (unsigned)p), -1);
}

/* stores land in pages the thread has not reached (it is held after its
 * first step), then the thread runs over them while more stores and
 * retrieves go on: every retrieve returns the exact bytes stored */
static void stores_before_and_while_the_thread_runs_keep_their_bytes(void **state)
{
    (void)state;
    hold(1);
    ferry_kv_config c = config(POOL);
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    unsigned char *img = malloc(img_bytes());
    assert_non_null(img);
    for (int p = 0; p < PROMPTS / 2; p++)
        store_prompt(kv, img, p);
    hold(0);
    for (int p = PROMPTS / 2; p < PROMPTS; p++) {
        store_prompt(kv, img, p);
        retrieve_prompt(kv, img, p - PROMPTS / 2);
    }
    /* let the thread pass over every slot, then read them all */
    double end = now_s() + 60;
    while (rss() < POOL && now_s() < end) {
        struct timespec ms = {0, 5000000};
        nanosleep(&ms, NULL);
    }
    for (int p = 0; p < PROMPTS; p++)
        retrieve_prompt(kv, img, p);
    ferry_kv_stats m = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(kv, &m));
    assert_int_equal(m.stored_chunks, PROMPTS * PCH);
    ferry_kv_close(kv);
    free(img);
}

/* close while the thread waits (held, with most of the pool left):
 * close stops it and returns; the run's leak check sees nothing left */
static void close_while_the_thread_is_held_returns(void **state)
{
    (void)state;
    hold(1);
    for (int i = 0; i < 3; i++) {
        ferry_kv_config c = config(POOL);
        ferry_kv *kv = NULL;
        FT_ASSERT_OK(ferry_kv_open(&c, &kv));
        unsigned char *img = malloc(img_bytes());
        assert_non_null(img);
        store_prompt(kv, img, i);
        retrieve_prompt(kv, img, i);
        ferry_kv_close(kv);
        free(img);
    }
    hold(0);
    /* and with the thread running: close right after open */
    for (int i = 0; i < 3; i++) {
        ferry_kv_config c = config(POOL);
        ferry_kv *kv = NULL;
        FT_ASSERT_OK(ferry_kv_open(&c, &kv));
        ferry_kv_close(kv);
    }
}

static void host_memory(uint64_t total, uint64_t avail)
{
    atomic_store(&ferry__test_mem_total, total);
    atomic_store(&ferry__test_mem_avail, avail);
}

/* an L1 larger than all the memory the process may have could never be
 * backed: refused at open, naming both sizes, in process and for a
 * daemon's shared pool alike (before, it opened, and the thread faulted
 * the pool in until the OOM killer took the host's largest process) */
static void an_l1_larger_than_the_hosts_memory_is_refused(void **state)
{
    (void)state;
    host_memory(128 * MiB, 128 * MiB);
    ferry_kv_config c = config(POOL); /* 256 MiB */
    ferry_kv *kv = NULL;
    int rc = ferry_kv_open(&c, &kv);
    host_memory(0, 0);
    assert_int_equal(rc, -ENOMEM);
    assert_null(kv);
    const char *msg = ferry_last_error();
    assert_non_null(strstr(msg, "0.25 GiB"));
    assert_non_null(strstr(msg, "0.12 GiB of memory this process may have"));

    char dir[] = "/tmp/ferry_l1memXXXXXX", sock[64];
    assert_non_null(mkdtemp(dir));
    snprintf(sock, sizeof sock, "%s/s.sock", dir);
    ferry_serve_config sc = FERRY_SERVE_CONFIG_INIT;
    sc.socket_path = sock;
    sc.kv = &c;
    ferry_serve *srv = NULL;
    host_memory(128 * MiB, 128 * MiB);
    rc = ferry_serve_open(&sc, &srv);
    host_memory(0, 0);
    assert_int_equal(rc, -ENOMEM);
    assert_null(srv);
    assert_non_null(strstr(ferry_last_error(), "memory this process may have"));
    assert_int_equal(access(sock, F_OK), -1); /* (nothing left behind) */
    assert_int_equal(rmdir(dir), 0);
}

/* an L1 within the host's memory but above what is available now opens,
 * and its pages are faulted in ahead only while a reserve stays free
 * (here none is left above it: the process does not grow by the pool);
 * chunks stored later still keep their bytes */
static void the_pool_is_faulted_in_only_while_memory_is_available(void **state)
{
    (void)state;
    if (!kernel_populates())
        skip();
    host_memory(4096 * MiB, 64 * MiB + 40 * MiB); /* reserve 128 MiB: none left to fault */
    uint64_t before = rss();
    ferry_kv_config c = config(POOL);
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    struct timespec ms = {0, 200000000};
    nanosleep(&ms, NULL); /* (a thread, had one started, would be well into the pool) */
    assert_true(rss() < before + 32 * MiB);
    unsigned char *img = malloc(img_bytes());
    assert_non_null(img);
    store_prompt(kv, img, 7);
    retrieve_prompt(kv, img, 7);
    ferry_kv_close(kv);
    host_memory(0, 0);
    free(img);
}

/* ---- what the process may have, read from a host's files ---- */

static char g_root[64];

/* root/rel holds text (its directories made) */
static void put(const char *rel, const char *text)
{
    char p[4200];
    snprintf(p, sizeof p, "%s%s", g_root, rel);
    for (char *s = p + strlen(g_root) + 1; (s = strchr(s, '/')); s++) {
        *s = 0;
        (void)mkdir(p, 0755);
        *s = '/';
    }
    FILE *f = fopen(p, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

/* a host of 64 GiB, 60 of them available, its process in cgroup `cg` */
static void host_of(const char *cg)
{
    strcpy(g_root, "/tmp/ferry_meminfoXXXXXX");
    assert_non_null(mkdtemp(g_root));
    put("/proc/meminfo", "MemTotal:       67108864 kB\nMemFree:        1048576 kB\n"
                         "MemAvailable:   62914560 kB\nBuffers:           1024 kB\n");
    put("/proc/self/cgroup", cg);
}

static void host_gone(void)
{
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_root);
    assert_int_equal(system(cmd), 0);
}

#define GiB (1024 * MiB)

/* a cgroup's page cache (a model's weights read, the L2 tier's files)
 * counts in its use but is reclaimed before anything is killed: what is
 * available is its limit less its working set (use less inactive file
 * pages). Before, its limit less its whole use: a long-lived container
 * whose cache filled it had "no memory available", and the pool was
 * never faulted in ahead */
static void a_cgroups_page_cache_counts_as_available(void **state)
{
    (void)state;
    host_of("0::/\n");
    put("/sys/fs/cgroup/memory.max", "17179869184\n");        /* 16 GiB */
    put("/sys/fs/cgroup/memory.current", "16106127360\n");    /* 15 GiB, */
    put("/sys/fs/cgroup/memory.stat", "anon 2147483648\nfile 13958643712\n"
                                      "active_file 1073741824\n"
                                      "inactive_file 12884901888\n"); /* 12 of it cache */
    uint64_t total, avail;
    ferry__host_memory_at(g_root, &total, &avail);
    host_gone();
    assert_int_equal(total, 16 * GiB);
    assert_int_equal(avail, 13 * GiB);
}

/* a limit set on a cgroup above the process's (a systemd slice, a
 * Kubernetes pod) bounds it as its own would: the lowest of them is what
 * the process may have. Before, only its own cgroup's was read */
static void a_limit_above_the_processs_cgroup_bounds_it(void **state)
{
    (void)state;
    host_of("0::/pod/ctr\n");
    put("/sys/fs/cgroup/pod/memory.max", "8589934592\n");     /* 8 GiB */
    put("/sys/fs/cgroup/pod/memory.current", "2147483648\n");
    put("/sys/fs/cgroup/pod/memory.stat", "inactive_file 0\n");
    put("/sys/fs/cgroup/pod/ctr/memory.max", "max\n");
    put("/sys/fs/cgroup/pod/ctr/memory.current", "1073741824\n");
    uint64_t total, avail;
    ferry__host_memory_at(g_root, &total, &avail);
    host_gone();
    assert_int_equal(total, 8 * GiB);
    assert_int_equal(avail, 6 * GiB);

    /* cgroup v1: the process's own memory cgroup, not the hierarchy's
     * root (which says "no limit" with a huge number) */
    host_of("12:cpu,cpuacct:/svc\n4:memory:/system.slice/ferry.service\n0::/\n");
    put("/sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n");
    put("/sys/fs/cgroup/memory/system.slice/ferry.service/memory.limit_in_bytes",
        "4294967296\n");
    put("/sys/fs/cgroup/memory/system.slice/ferry.service/memory.usage_in_bytes",
        "3221225472\n");
    put("/sys/fs/cgroup/memory/system.slice/ferry.service/memory.stat",
        "cache 2147483648\ninactive_file 1\ntotal_inactive_file 2147483648\n");
    ferry__host_memory_at(g_root, &total, &avail);
    host_gone();
    assert_int_equal(total, 4 * GiB);
    assert_int_equal(avail, 3 * GiB);
}

/* no cgroup limit ("max", v1's huge number, no files): the host's */
static void without_a_cgroup_limit_the_hosts_memory(void **state)
{
    (void)state;
    const char *cgs[] = {"0::/user.slice/a.scope\n", "4:memory:/x\n0::/\n", "0::/\n"};
    for (size_t i = 0; i < 3; i++) {
        host_of(cgs[i]);
        if (i == 0)
            put("/sys/fs/cgroup/user.slice/a.scope/memory.max", "max\n");
        if (i == 1)
            put("/sys/fs/cgroup/memory/x/memory.limit_in_bytes", "9223372036854771712\n");
        uint64_t total, avail;
        ferry__host_memory_at(g_root, &total, &avail);
        host_gone();
        assert_int_equal(total, 64 * GiB);
        assert_int_equal(avail, 60 * GiB);
    }
}

/* a host whose MemAvailable is 0 (the kernel's floor under pressure, just
 * before the OOM killer) has no memory available: not all of it, as a
 * missing line would say. Before, a 0 read as "missing", and the L1 fill
 * faulted the pool in on a host with nothing to spare */
static void a_host_with_no_memory_available_says_so(void **state)
{
    (void)state;
    host_of("0::/\n");
    put("/proc/meminfo", "MemTotal:       67108864 kB\nMemFree:          131072 kB\n"
                         "MemAvailable:          0 kB\n");
    uint64_t total, avail;
    ferry__host_memory_at(g_root, &total, &avail);
    host_gone();
    assert_int_equal(total, 64 * GiB);
    assert_int_equal(avail, 0);
}

/* a deep cgroup path (nested containers, long unit names: 1,500 bytes
 * here, a line of /proc/self/cgroup longer than any fixed buffer) is
 * walked as a short one: its own limit and its ancestors' bound the
 * process. Before, a path past 600 bytes read as "no cgroup" and the
 * host's memory was what the process might have */
static void a_long_cgroup_path_is_walked_whole(void **state)
{
    (void)state;
    char cg[1700], rel[1600], file[1800];
    size_t n = 0;
    for (int i = 0; i < 7; i++) { /* 7 components of 200 bytes */
        rel[n++] = '/';
        memset(rel + n, 'a' + i, 200);
        n += 200;
    }
    rel[n] = 0;
    for (int v = 0; v < 2; v++) {
        snprintf(cg, sizeof cg, v ? "12:cpu:/\n4:memory:%s\n0::/\n" : "0::%s\n", rel);
        host_of(cg);
        const char *base = v ? "/sys/fs/cgroup/memory" : "/sys/fs/cgroup";
        snprintf(file, sizeof file, "%s%s/%s", base, rel,
                 v ? "memory.limit_in_bytes" : "memory.max");
        put(file, "4294967296\n"); /* 4 GiB, its own */
        snprintf(file, sizeof file, "%s%s/%s", base, rel,
                 v ? "memory.usage_in_bytes" : "memory.current");
        put(file, "1073741824\n");
        /* and 2 GiB on its parent, 1 of them used */
        snprintf(file, sizeof file, "%s%.*s/%s", base, (int)(n - 201), rel,
                 v ? "memory.limit_in_bytes" : "memory.max");
        put(file, "2147483648\n");
        snprintf(file, sizeof file, "%s%.*s/%s", base, (int)(n - 201), rel,
                 v ? "memory.usage_in_bytes" : "memory.current");
        put(file, "1073741824\n");
        uint64_t total, avail;
        ferry__host_memory_at(g_root, &total, &avail);
        host_gone();
        if (total != 2 * GiB || avail != 1 * GiB)
            fail_msg("cgroup v%d, a path of %zu bytes: %llu total, %llu available", v ? 1 : 2, n,
                     (unsigned long long)total, (unsigned long long)avail);
    }
}

/* the fill asks how much memory is available before each 8 MiB step (32
 * of them here) and finds the process's cgroups once, when it starts: one
 * walk of their directories for the fill and one for open's own check.
 * Before, every step read /proc/self/cgroup and opened each level's files
 * by path again (18 to 121 us a step) */
static void the_fill_finds_the_cgroups_once(void **state)
{
    (void)state;
    if (!kernel_populates())
        skip();
    atomic_store(&ferry__test_mem_walks, 0);
    uint64_t before = rss();
    ferry_kv_config c = config(POOL);
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    double end = now_s() + 60;
    while (rss() < before + POOL - 8 * MiB && now_s() < end) {
        struct timespec ms = {0, 5000000};
        nanosleep(&ms, NULL);
    }
    assert_true(rss() >= before + POOL - 8 * MiB);
    ferry_kv_close(kv);
    unsigned long walks = atomic_load(&ferry__test_mem_walks);
    if (walks > 2)
        fail_msg("a fill of %llu steps walked the cgroups %lu times",
                 (unsigned long long)(POOL / (8 * MiB)), walks);
}

/* ... and still reads their numbers at every step: a limit lowered while
 * the pool is being faulted in stops it (the thread held after its first
 * step, the limit then lowered to leave less than the reserve) */
static void a_limit_lowered_during_the_fill_stops_it(void **state)
{
    (void)state;
    if (!kernel_populates())
        skip();
    host_of("0::/ctr\n");
    put("/sys/fs/cgroup/ctr/memory.max", "17179869184\n"); /* 16 GiB */
    put("/sys/fs/cgroup/ctr/memory.current", "1073741824\n");
    put("/sys/fs/cgroup/ctr/memory.stat", "inactive_file 0\n");
    atomic_store(&ferry__test_mem_root, g_root);
    hold(1);
    uint64_t before = rss();
    ferry_kv_config c = config(POOL);
    ferry_kv *kv = NULL;
    int rc = ferry_kv_open(&c, &kv);
    put("/sys/fs/cgroup/ctr/memory.max", "1107296256\n"); /* 1 GiB + 32 MiB: 32 MiB left */
    hold(0);
    struct timespec ms = {0, 200000000};
    nanosleep(&ms, NULL); /* (the thread, had it gone on, would be well into the pool) */
    uint64_t grown = rss() - before;
    if (rc == 0)
        ferry_kv_close(kv);
    atomic_store(&ferry__test_mem_root, NULL);
    host_gone();
    assert_int_equal(rc, 0);
    if (grown >= 32 * MiB)
        fail_msg("the process grew by %llu MiB after the limit left 32 MiB",
                 (unsigned long long)(grown / MiB));
}

/* a cgroup limit of 0 is a limit: nothing may be had, and an L1 is
 * refused naming the file that says so (v2 memory.max, v1
 * memory.limit_in_bytes). Before, a 0 read as "no limit" and the host's
 * memory was what the process might have */
static void a_cgroup_limit_of_0_is_a_limit(void **state)
{
    (void)state;
    for (int v = 0; v < 2; v++) {
        const char *file = v ? "/sys/fs/cgroup/memory/ctr/memory.limit_in_bytes"
                             : "/sys/fs/cgroup/ctr/memory.max";
        host_of(v ? "4:memory:/ctr\n0::/\n" : "0::/ctr\n");
        put(file, "0\n");
        uint64_t total, avail;
        ferry__host_memory_at(g_root, &total, &avail);
        atomic_store(&ferry__test_mem_root, g_root);
        ferry_kv_config c = config(POOL);
        ferry_kv *kv = NULL;
        int rc = ferry_kv_open(&c, &kv);
        atomic_store(&ferry__test_mem_root, NULL);
        if (rc == 0)
            ferry_kv_close(kv);
        char want[256];
        snprintf(want, sizeof want, "limit of 0 bytes in %s%s", g_root, file);
        const char *msg = ferry_last_error();
        host_gone();
        if (total != 0 || avail != 0 || rc != -ENOMEM || !strstr(msg, want))
            fail_msg("cgroup v%d, %s of 0: %llu total, %llu available; open %d: '%s'",
                     v ? 1 : 2, file, (unsigned long long)total, (unsigned long long)avail, rc,
                     msg);
    }
}

/* a kernel without MemAvailable (before 3.14): what is available is its
 * own approximation, MemFree + Buffers + Cached. Before, all of the
 * host's memory read as available, and the fill faulted on */
static void without_memavailable_free_buffers_and_cache(void **state)
{
    (void)state;
    host_of("0::/\n");
    put("/proc/meminfo", "MemTotal:       67108864 kB\nMemFree:         1048576 kB\n"
                         "Buffers:            1024 kB\nCached:         10485760 kB\n"
                         "SwapCached:      4194304 kB\n");
    uint64_t total, avail;
    ferry__host_memory_at(g_root, &total, &avail);
    host_gone();
    assert_int_equal(total, 64 * GiB);
    assert_int_equal(avail, 11 * GiB + MiB);
}

/* where the hierarchies are mounted is read from /proc/self/mountinfo,
 * not assumed: a hybrid host mounts v2 at /sys/fs/cgroup/unified (with
 * the memory controller where v1 has none: cgroup_no_v1=memory); v1's
 * memory may be mounted elsewhere (a mount point's space escaped as \040);
 * a container without a cgroup namespace mounts its own cgroup (the
 * mount's root, /system.slice/docker-1.scope) at /sys/fs/cgroup, its
 * process's path below it, and the container's own system.slice there is
 * not the host's. Before, v2 was read at /sys/fs/cgroup and v1 at
 * /sys/fs/cgroup/memory only: the first two limits were missed (the
 * host's 64 GiB), and in the container the process's path was looked up
 * whole under the mount point, its own cgroup missed and the container's
 * system.slice (512 MiB) taken for the host's */
static void the_cgroup_mounts_are_read_from_mountinfo(void **state)
{
    (void)state;
    static const struct {
        const char *cgroup, *mountinfo, *limit, *use;
        uint64_t total, avail;
    } host[] = {
        {"4:cpu:/ctr\n0::/ctr\n",
         "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
         "32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime shared:7 - cgroup cgroup rw,cpu\n"
         "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime shared:5 - cgroup2 cgroup2 rw\n",
         "/sys/fs/cgroup/unified/ctr/memory.max", "/sys/fs/cgroup/unified/ctr/memory.current",
         2 * GiB, 1 * GiB},
        {"3:memory:/apps\n0::/\n",
         "22 1 0:20 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"
         "40 1 0:33 / /dev/mem\\040cg rw,nosuid - cgroup none rw,memory\n",
         "/dev/mem cg/apps/memory.limit_in_bytes", "/dev/mem cg/apps/memory.usage_in_bytes",
         3 * GiB, 2 * GiB},
        {"0::/system.slice/docker-1.scope/app\n",
         "900 880 0:27 /system.slice/docker-1.scope /sys/fs/cgroup ro,nosuid - cgroup2 cgroup "
         "rw,nsdelegate\n",
         "/sys/fs/cgroup/app/memory.max", "/sys/fs/cgroup/app/memory.current", 1 * GiB, 0},
    };
    for (size_t i = 0; i < FERRY__ARRAY_LEN(host); i++) {
        host_of(host[i].cgroup);
        put("/proc/self/mountinfo", host[i].mountinfo);
        put(host[i].limit, i == 0 ? "2147483648\n" : i == 1 ? "3221225472\n" : "1073741824\n");
        put(host[i].use, "1073741824\n");
        if (i == 2) { /* the container's own limit, and a cgroup of it that is not the process's */
            put("/sys/fs/cgroup/memory.max", "4294967296\n");
            put("/sys/fs/cgroup/system.slice/memory.max", "536870912\n");
        }
        uint64_t total, avail;
        ferry__memwatch w;
        ferry__memwatch_open(&w, g_root);
        ferry__memwatch_read(&w, &total, &avail);
        char file[FERRY__MEMWATCH_PATH] = "", want[FERRY__MEMWATCH_PATH];
        (void)ferry__memwatch_limit_file(&w, file, sizeof file);
        ferry__memwatch_close(&w);
        snprintf(want, sizeof want, "%s%s", g_root, host[i].limit);
        host_gone();
        if (total != host[i].total || avail != host[i].avail || strcmp(file, want))
            fail_msg("host %zu: %llu total, %llu available, the limit in '%s'; expected %llu, "
                     "%llu, '%s'",
                     i, (unsigned long long)total, (unsigned long long)avail, file,
                     (unsigned long long)host[i].total, (unsigned long long)host[i].avail, want);
    }
}

/* a watch opened while the process has no descriptor to spare (at its
 * RLIMIT_NOFILE: an engine's sockets) cannot open its files; the limit
 * they hold is not thereby absent: they are opened at a later read, once
 * descriptors are free again. Before, the watch of a whole fill read its
 * cgroup as limitless (the host's 64 GiB) from then on, and the pool was
 * faulted in past the cgroup's limit */
static void a_watch_short_of_descriptors_opens_its_files_later(void **state)
{
    (void)state;
    host_of("0::/ctr\n");
    put("/sys/fs/cgroup/ctr/memory.max", "2147483648\n");
    put("/sys/fs/cgroup/ctr/memory.current", "1073741824\n");
    struct rlimit old, none;
    assert_int_equal(getrlimit(RLIMIT_NOFILE, &old), 0);
    int lowest = dup(0); /* (every descriptor below it is taken) */
    assert_true(lowest >= 0);
    close(lowest);
    none = old;
    none.rlim_cur = (rlim_t)lowest;
    uint64_t total[2], avail[2];
    ferry__memwatch w;
    assert_int_equal(setrlimit(RLIMIT_NOFILE, &none), 0);
    ferry__memwatch_open(&w, g_root);
    ferry__memwatch_read(&w, &total[0], &avail[0]);
    assert_int_equal(setrlimit(RLIMIT_NOFILE, &old), 0);
    ferry__memwatch_read(&w, &total[1], &avail[1]);
    ferry__memwatch_close(&w);
    host_gone();
    if (total[1] != 2 * GiB || avail[1] != 1 * GiB)
        fail_msg("opened short of descriptors: %llu total, %llu available; once they are free "
                 "again: %llu, %llu",
                 (unsigned long long)total[0], (unsigned long long)avail[0],
                 (unsigned long long)total[1], (unsigned long long)avail[1]);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(open_leaves_the_pool_to_the_thread),
        cmocka_unit_test(stores_before_and_while_the_thread_runs_keep_their_bytes),
        cmocka_unit_test(close_while_the_thread_is_held_returns),
        cmocka_unit_test(an_l1_larger_than_the_hosts_memory_is_refused),
        cmocka_unit_test(the_pool_is_faulted_in_only_while_memory_is_available),
        cmocka_unit_test(a_cgroups_page_cache_counts_as_available),
        cmocka_unit_test(a_limit_above_the_processs_cgroup_bounds_it),
        cmocka_unit_test(without_a_cgroup_limit_the_hosts_memory),
        cmocka_unit_test(a_host_with_no_memory_available_says_so),
        cmocka_unit_test(a_long_cgroup_path_is_walked_whole),
        cmocka_unit_test(the_fill_finds_the_cgroups_once),
        cmocka_unit_test(a_limit_lowered_during_the_fill_stops_it),
        cmocka_unit_test(a_cgroup_limit_of_0_is_a_limit),
        cmocka_unit_test(without_memavailable_free_buffers_and_cache),
        cmocka_unit_test(the_cgroup_mounts_are_read_from_mountinfo),
        cmocka_unit_test(a_watch_short_of_descriptors_opens_its_files_later),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
