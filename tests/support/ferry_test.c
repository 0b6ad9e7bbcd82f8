/*
 * ferry_test.c - shared test helpers: a counting, failing allocator and
 * temporary directories.
 */
#include <ftw.h>
#include <malloc.h>
#include <stdatomic.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ferry_test.h"

static atomic_uint_fast64_t g_count, g_armed_count, g_fail_at, g_failures;
static atomic_int_fast64_t g_live;
static atomic_int g_paused;
static int g_sticky;
static atomic_size_t g_fail_size; /* a malloc of exactly this many bytes fails (0: none) */

static int should_fail(void)
{
    atomic_fetch_add(&g_count, 1);
    if (atomic_load(&g_paused))
        return 0;
    /* the index counts only allocations made while armed */
    uint64_t n = atomic_fetch_add(&g_armed_count, 1) + 1;
    uint64_t at = atomic_load(&g_fail_at);
    if (at && (n == at || (g_sticky && n > at))) {
        atomic_fetch_add(&g_failures, 1);
        return 1;
    }
    return 0;
}

/* each block carries a 64-byte header holding the raw pointer, so free
 * works for every kind of allocation and live counts are exact */
#define HDR 64
static void *wrap(void *raw, size_t off)
{
    if (!raw)
        return NULL;
    char *p = (char *)raw + off;
    ((void **)p)[-1] = raw;
    atomic_fetch_add(&g_live, 1);
    return p;
}
static void *t_malloc(size_t n, void *c)
{
    (void)c;
    if (should_fail())
        return NULL;
    if (n && n == atomic_load(&g_fail_size)) {
        atomic_fetch_add(&g_failures, 1);
        return NULL;
    }
    return wrap(malloc(n + HDR), HDR);
}
static void *t_calloc(size_t n, size_t s, void *c)
{
    (void)c;
    if (should_fail())
        return NULL;
    if (s && n > (SIZE_MAX - HDR) / s)
        return NULL;
    if (n * s != 0 && n * s == atomic_load(&g_fail_size)) {
        atomic_fetch_add(&g_failures, 1);
        return NULL;
    }
    return wrap(calloc(1, n * s + HDR), HDR);
}
static void t_free(void *p, void *c)
{
    (void)c;
    if (!p)
        return;
    atomic_fetch_sub(&g_live, 1);
    free(((void **)p)[-1]);
}
static void *t_aligned(size_t a, size_t n, void *c)
{
    (void)c;
    if (should_fail())
        return NULL;
    if (a < HDR)
        a = HDR;
    void *raw = NULL;
    if (posix_memalign(&raw, a, n + a) != 0)
        return NULL;
    return wrap(raw, a);
}
static void *t_realloc(void *p, size_t n, void *c)
{
    if (!p)
        return t_malloc(n, c);
    if (should_fail())
        return NULL;
    /* copy: we do not know the old size, so allocate new and copy n bytes at
     * most of what usable size allows */
    void *raw = ((void **)p)[-1];
    size_t off = (size_t)((char *)p - (char *)raw);
    void *np = malloc(n + HDR);
    if (!np)
        return NULL;
    size_t old = malloc_usable_size(raw) - off;
    memcpy((char *)np + HDR, p, old < n ? old : n);
    free(raw);
    ((void **)((char *)np + HDR))[-1] = np;
    return (char *)np + HDR;
}

void ft_alloc_install(uint64_t fail_at, int sticky)
{
    atomic_store(&g_count, 0);
    atomic_store(&g_armed_count, 0);
    atomic_store(&g_paused, 0);
    atomic_store(&g_failures, 0);
    atomic_store(&g_live, 0);
    atomic_store(&g_fail_at, fail_at);
    atomic_store(&g_fail_size, 0);
    g_sticky = sticky;
    ferry_allocator a = {t_malloc, t_calloc, t_realloc, t_aligned, t_free, NULL};
    ferry_set_allocator(&a);
}
void ft_fill_mixed(void *buf, size_t bytes, uint64_t seed)
{
    unsigned char *p = buf;
    for (size_t w = 0; w < bytes / 8; w++) {
        uint64_t z = (w + seed) * 0x9E3779B97F4A7C15ull;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        memcpy(p + 8 * w, &z, 8);
    }
}

void ft_alloc_fail_size(size_t n)
{
    atomic_store(&g_fail_size, n);
}
void ft_alloc_fail_next(uint64_t k)
{
    g_sticky = 0;
    atomic_store(&g_fail_at, atomic_load(&g_armed_count) + k);
    atomic_store(&g_paused, 0);
}
void ft_oom_pause(void)
{
    atomic_store(&g_paused, 1);
}
void ft_oom_resume(void)
{
    atomic_store(&g_paused, 0);
}
void ft_alloc_reset(void)
{
    ferry_set_allocator(NULL);
}
uint64_t ft_alloc_count(void)
{
    return atomic_load(&g_count);
}
int64_t ft_alloc_live(void)
{
    return atomic_load(&g_live);
}
uint64_t ft_alloc_failures(void)
{
    return atomic_load(&g_failures);
}

char *ft_tmpdir(char *buf, size_t len)
{
    const char *base = getenv("FERRY_TEST_TMPDIR");
    if (!base || !*base)
        base = "/var/tmp";
    snprintf(buf, len, "%s/ferry-test-XXXXXX", base);
    if (!mkdtemp(buf)) {
        snprintf(buf, len, "/tmp/ferry-test-XXXXXX");
        if (!mkdtemp(buf))
            buf[0] = 0;
    }
    return buf;
}

static int rm_cb(const char *p, const struct stat *st, int flag, struct FTW *ftw)
{
    (void)st;
    (void)flag;
    (void)ftw;
    return remove(p);
}
void ft_rmtree(const char *path)
{
    if (path && strstr(path, "ferry-test-"))
        nftw(path, rm_cb, 16, FTW_DEPTH | FTW_PHYS);
}

void ft_fill_pattern(void *buf, size_t len, unsigned seed)
{
    unsigned char *p = buf;
    unsigned v = seed % 251;
    for (size_t i = 0; i < len; i++) {
        p[i] = (unsigned char)v;
        if (++v == 251)
            v = 0;
    }
}
long ft_check_pattern(const void *buf, size_t len, unsigned seed)
{
    const unsigned char *p = buf;
    unsigned v = seed % 251;
    for (size_t i = 0; i < len; i++) {
        if (p[i] != v)
            return (long)i;
        if (++v == 251)
            v = 0;
    }
    return -1;
}

uint64_t ft_oom_each(uint64_t max, int flags, int (*run)(void *ctx), void *ctx)
{
    for (uint64_t n = 1; n <= max; n++) {
        ft_alloc_install(n, (flags & FT_OOM_STICKY) != 0);
        int rc = run(ctx);
        uint64_t failures = ft_alloc_failures();
        int64_t live = ft_alloc_live();
        ft_alloc_reset();
        if (live != 0)
            fail_msg("out of memory at allocation %llu: %lld blocks left allocated (rc %d)",
                     (unsigned long long)n, (long long)live, rc);
        if (failures == 0) {
            if (rc < 0)
                fail_msg("no allocation refused, yet the run failed: %d (%s)", rc,
                         ferry_last_error());
            if (n == 1)
                fail_msg("the run allocated nothing: out of memory was never tried");
            return n;
        }
        if (rc < 0 && rc != -ENOMEM)
            fail_msg("out of memory at allocation %llu gave %d (%s), not -ENOMEM: %s",
                     (unsigned long long)n, rc, ferry_strerror(rc), ferry_last_error());
        if ((flags & FT_OOM_STRICT) && rc >= 0)
            fail_msg("out of memory at allocation %llu, yet the run succeeded (%d)",
                     (unsigned long long)n, rc);
    }
    fail_msg("no run was clean within %llu allocations", (unsigned long long)max);
    return 0;
}

int ft_device_faults(ferry_device *dev, uint64_t fail_nth, int fail_code, size_t short_copy,
                     unsigned fault_mask)
{
    ferry_device_faults f = FERRY_DEVICE_FAULTS_INIT;
    f.fail_nth = fail_nth;
    f.fail_code = fail_code;
    f.short_copy = short_copy;
    f.fault_mask = fault_mask;
    return ferry_test_control(FERRY_TEST_DEVICE_FAULTS, dev, &f);
}

ferry_kv_layout ft_kv_layout(unsigned token_bytes)
{
    ferry_kv_layout l = FERRY_KV_LAYOUT_INIT;
    l.num_layers = 2;
    l.kv = 2;
    l.num_heads = 2;
    l.head_dim = token_bytes / 4;
    l.dtype = FERRY_DTYPE_BF16;
    return l;
}

ferry_kv_buffer ft_kv_host_buffer(void *img, uint64_t capacity, unsigned token_bytes)
{
    ferry_kv_buffer b = FERRY_KV_BUFFER_INIT;
    b.layout = ft_kv_layout(token_bytes);
    b.mem = FERRY_KV_MEM_HOST;
    b.base = (uint64_t)(uintptr_t)img;
    b.capacity_tokens = capacity;
    return b;
}

void *ft_write_byte_after_300ms(void *fd_ptr)
{
    struct timespec ts = {0, 300 * 1000 * 1000};
    nanosleep(&ts, NULL);
    char b = 1;
    if (write(*(int *)fd_ptr, &b, 1) != 1)
        abort();
    return NULL;
}

int ft_child_exit(pid_t pid)
{
    int ws = 0;
    pid_t r;
    while ((r = waitpid(pid, &ws, 0)) < 0 && errno == EINTR)
        ;
    if (r != pid)
        return 255;
    if (WIFSIGNALED(ws))
        return -WTERMSIG(ws);
    return WIFEXITED(ws) ? WEXITSTATUS(ws) : 255;
}
