/*
 * test_kv_l2reg.c - the L1 pool registered with the L2 tier's io_uring
 * engines by a thread after open (src/kv/store/tier_l2_poolreg.c), for
 * the L2 on the GDS context and the persistent one (each test runs for
 * both): open returns with nothing of the pool pinned, and the pool is
 * pinned once the thread registered it; chunks stored and retrieved
 * through L2 while the registration waits, and after it, come back byte
 * for byte; close while the thread waits or while it is inside the
 * registration returns and leaves nothing pinned; a registration the
 * engine refuses leaves L2 on the plain path, every byte right.
 *
 * What the kernel pinned is read from /proc/self/status (VmPin: io_uring
 * accounts every registered page there), so the tests see the engine's
 * registrations, not the store's own flag. The thread is held with the
 * seam ferry__kv_poolreg_test_hold; the registration itself is delayed or
 * failed through the io seam's uring_register hook.
 */
/* ferry-test-labels: concurrent */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ferry/io.h"
#include "ferry/kv.h"
#include "ferry_test.h"
#include "io/sys.h"
#include "kv/kv_impl.h"

#define CT 16u
#define TB 4096u                        /* bytes per token and plane */
#define PLANES 4u                       /* K and V of 2 layers */
#define CHUNK (PLANES * CT * TB)        /* 256 KiB */
#define MiB ((uint64_t)1 << 20)
#define L1_CHUNKS 64u                   /* 16 MiB: the fill thread has work */
#define POOL ((uint64_t)L1_CHUNKS * CHUNK)
#define PCH 8u                          /* chunks a prompt */
#define PTOK (PCH * CT)

static char g_dir[256];

/* ---- the registration hook (io/sys.h) ---- */
static struct {
    atomic_int fail;        /* the errno to fail with (0: none) */
    atomic_int delay_ms;    /* sleep this long first */
    atomic_int entered, left;
} g_h;
static ferry__sys g_table;

static int h_register(void *ctx, unsigned slot, void *base, size_t len)
{
    (void)ctx;
    (void)slot;
    (void)base;
    if (len != POOL) /* (the slab's own buffers) */
        return 0;
    atomic_fetch_add(&g_h.entered, 1);
    int ms = atomic_load(&g_h.delay_ms);
    if (ms) {
        struct timespec t = {ms / 1000, (long)(ms % 1000) * 1000000};
        nanosleep(&t, NULL);
    }
    int e = atomic_load(&g_h.fail);
    atomic_fetch_add(&g_h.left, 1);
    return e ? -e : 0;
}

static void hook(int fail, int delay_ms)
{
    atomic_store(&g_h.fail, fail);
    atomic_store(&g_h.delay_ms, delay_ms);
    atomic_store(&g_h.entered, 0);
    atomic_store(&g_h.left, 0);
    g_table = *ferry__sys_default();
    g_table.uring_register = h_register;
    ferry__sys_set(&g_table);
}

/* a slow disk: each write's completion comes write_ms late */
static atomic_int g_write_ms;

static int h_result(void *ctx, int op, int fd, uint64_t off, size_t len, int res)
{
    (void)ctx;
    (void)fd;
    (void)off;
    (void)len;
    int ms = atomic_load(&g_write_ms);
    if (op == FERRY_IO_WRITE && ms) {
        struct timespec t = {0, (long)ms * 1000000};
        nanosleep(&t, NULL);
    }
    return res;
}

/* posix's write, waiting before it reads the caller's bytes: the kernel
 * takes them only after the wait, so an L1 slot given to a newer chunk
 * meanwhile would be what L2 gets */
static ssize_t h_pwrite(int fd, const void *buf, size_t n, off_t off)
{
    int ms = atomic_load(&g_write_ms);
    if (ms) {
        struct timespec t = {0, (long)ms * 1000000};
        nanosleep(&t, NULL);
    }
    return ferry__sys_default()->pwrite(fd, buf, n, off);
}

static void hold(unsigned on)
{
    atomic_store(&ferry__kv_poolreg_test_hold, on);
}

/* bytes the kernel holds pinned for this process */
static uint64_t vmpin(void)
{
    FILE *f = fopen("/proc/self/status", "r");
    assert_non_null(f);
    char line[256];
    unsigned long long kb = 0;
    int seen = 0;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "VmPin: %llu kB", &kb) == 1) {
            seen = 1;
            break;
        }
    fclose(f);
    assert_true(seen);
    return (uint64_t)kb << 10;
}

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void sleep_ms(int ms)
{
    struct timespec t = {0, (long)ms * 1000000};
    nanosleep(&t, NULL);
}

/* io_uring with a fixed-buffer table, the only engine that registers:
 * else there is nothing to see here */
static int uring_registers(void)
{
    ferry_io_options o = FERRY_IO_OPTIONS_INIT;
    o.engine = "uring";
    ferry_io *io = NULL;
    if (ferry_io_open(&o, &io) < 0)
        return 0;
    void *b = NULL;
    int ok = posix_memalign(&b, 4096, 4096) == 0 && ferry_io_register_buffer(io, b, 4096) == 0;
    if (ok)
        ferry_io_unregister_buffer(io, b);
    ferry_io_close(io);
    free(b);
    return ok;
}

static int persistent_of(void **state)
{
    return !strcmp((const char *)*state, "persistent");
}

static const char *g_engine = "uring";
static uint32_t g_read_ttl_ms; /* 0: the default */

static ferry_kv *open_store(void **state)
{
    char dir[300];
    static unsigned n;
    snprintf(dir, sizeof dir, "%s/l2-%u", g_dir, n++);
    ferry_kv_config c = FERRY_KV_CONFIG_INIT;
    c.model = "l2reg";
    c.layout = ft_kv_layout(TB);
    c.chunk_tokens = CT;
    c.l1_bytes = POOL;
    c.l2_dir = dir;
    c.l2_bytes = 4 * POOL;
    c.l2_engine = g_engine;
    c.read_ttl_ms = g_read_ttl_ms;
    c.l2_persistent = persistent_of(state);
    c.workers = 2;
    ferry_kv *kv = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &kv));
    return kv;
}

static int reg_state(ferry_kv *kv)
{
    return ferry__kv_poolreg_state(&kv->l2reg);
}

/* wait until the thread is done (registered or failed) */
static int settled(ferry_kv *kv)
{
    double end = now_s() + 60;
    while (reg_state(kv) == FERRY__KV_POOLREG_PENDING && now_s() < end)
        sleep_ms(2);
    return reg_state(kv);
}

/* ---- stores and retrieves through L2 ---- */
static void tokens_of(int32_t *t, int p)
{
    for (unsigned i = 0; i < PTOK; i++)
        t[i] = p * 100003 + (int32_t)i;
}

static size_t img_bytes(void)
{
    return (size_t)PLANES * PTOK * TB;
}

static void store_prompt(ferry_kv *kv, unsigned char *img, int p)
{
    int32_t tok[PTOK];
    tokens_of(tok, p);
    ft_fill_pattern(img, img_bytes(), 7000u + (unsigned)p);
    ferry_kv_buffer b = ft_kv_host_buffer(img, PTOK, TB);
    assert_int_equal(ferry_kv_store(kv, tok, PTOK, NULL, &b), PTOK);
}

/* prompt p read back exactly; its chunks that lookup finds in L2 alone
 * come through L2. Which chunks L1 still holds is not the LRU order where
 * write-throughs lag (a loaded machine): eviction skips a chunk whose
 * write is in flight and takes a newer one, so an old chunk may stay in
 * L1 - answered from there, never with other bytes. Returns the chunks
 * read through L2. */
static unsigned retrieve_from_l2(ferry_kv *kv, unsigned char *img, int p)
{
    int32_t tok[PTOK];
    tokens_of(tok, p);
    uint8_t tiers[PCH];
    ferry_kv_req r = FERRY_KV_REQ_INIT;
    r.tiers = tiers;
    r.max_chunks = PCH;
    assert_int_equal(ferry_kv_lookup(kv, tok, PTOK, &r), PTOK);
    unsigned in_l2 = 0;
    for (unsigned i = 0; i < PCH; i++) {
        if (tiers[i] != FERRY_KV_TIER_L1 && tiers[i] != FERRY_KV_TIER_L2)
            fail_msg("prompt %d chunk %u: tier %u, neither L1 nor L2", p, i, tiers[i]);
        in_l2 += tiers[i] == FERRY_KV_TIER_L2;
    }
    ferry_kv_stats m0 = FERRY_KV_STATS_INIT, m1 = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(kv, &m0));
    memset(img, 0xA5, img_bytes());
    ferry_kv_buffer b = ft_kv_host_buffer(img, PTOK, TB);
    assert_int_equal(ferry_kv_retrieve(kv, tok, PTOK, NULL, &b), PTOK);
    assert_int_equal(ft_check_pattern(img, img_bytes(), 7000u + (unsigned)p), -1);
    FT_ASSERT_OK(ferry_kv_stats_get(kv, &m1));
    uint64_t l2 = m1.tier[FERRY_KV_TIER_L2].hits - m0.tier[FERRY_KV_TIER_L2].hits;
    uint64_t l1 = m1.tier[FERRY_KV_TIER_L1].hits - m0.tier[FERRY_KV_TIER_L1].hits;
    if (l2 < in_l2 || l1 + l2 != PCH)
        fail_msg("prompt %d: %u chunks in L2 alone, then %llu L2 and %llu L1 hits", p, in_l2,
                 (unsigned long long)l2, (unsigned long long)l1);
    return (unsigned)l2;
}

/* store prompts [from, to) (twice L1's worth pushes the first out of L1
 * into L2) and read the first quarter back: at least a prompt's worth of
 * it through L2 (most of it where the write-throughs kept up) */
static void l2_round(ferry_kv *kv, unsigned char *img, int from, int to)
{
    for (int p = from; p < to; p++)
        store_prompt(kv, img, p);
    FT_ASSERT_OK(ferry_kv_flush(kv));
    unsigned l2 = 0;
    for (int p = from; p < from + (to - from) / 4; p++)
        l2 += retrieve_from_l2(kv, img, p);
    if (l2 < PCH)
        fail_msg("prompts %d..%d stored: %u chunks of the first quarter read through L2", from,
                 to - 1, l2);
}

enum { ROUND = 2 * L1_CHUNKS / PCH }; /* prompts of a round: twice L1 */

/* ---- tests ---- */

/* open returns with the pool unregistered (nothing pinned); the thread,
 * once let go, registers it: the whole pool pinned, until close */
static void open_leaves_the_registration_to_a_thread(void **state)
{
    if (!uring_registers())
        skip();
    hold(1);
    uint64_t pin0 = vmpin();
    ferry_kv *kv = open_store(state);
    assert_true(vmpin() < pin0 + POOL / 2);
    sleep_ms(50); /* (the fill thread is done with 16 MiB by now: held still) */
    assert_int_equal(reg_state(kv), FERRY__KV_POOLREG_PENDING);
    assert_true(vmpin() < pin0 + POOL / 2);
    hold(0);
    assert_int_equal(settled(kv), FERRY__KV_POOLREG_DONE);
    assert_true(vmpin() >= pin0 + POOL);
    ferry_kv_close(kv);
    assert_true(vmpin() < pin0 + POOL / 2);
}

/* chunks through L2 while the registration is held (plain path), then
 * after it completed (fixed path), then stores while it is delayed inside
 * the kernel call: every retrieve returns the exact bytes */
static void l2_bytes_exact_before_during_and_after_registration(void **state)
{
    if (!uring_registers())
        skip();
    unsigned char *img = malloc(img_bytes());
    assert_non_null(img);
    uint64_t pin0 = vmpin();
    hold(1);
    ferry_kv *kv = open_store(state);
    l2_round(kv, img, 0, ROUND);
    assert_int_equal(reg_state(kv), FERRY__KV_POOLREG_PENDING);
    hold(0);
    assert_int_equal(settled(kv), FERRY__KV_POOLREG_DONE);
    assert_true(vmpin() >= pin0 + POOL);
    l2_round(kv, img, ROUND, 2 * ROUND);
    ferry_kv_close(kv);

    /* the registration in progress (the hook sleeps before the kernel
     * call) while stores and retrieves run */
    hook(0, 300);
    kv = open_store(state);
    double end = now_s() + 60;
    while (atomic_load(&g_h.entered) == 0 && now_s() < end)
        sleep_ms(1);
    assert_int_equal(atomic_load(&g_h.entered), 1);
    l2_round(kv, img, 0, ROUND);
    assert_int_equal(settled(kv), FERRY__KV_POOLREG_DONE);
    l2_round(kv, img, ROUND, 2 * ROUND);
    ferry_kv_close(kv);
    ferry__sys_set(NULL);
    free(img);
}

/* close while the thread is held, and while it is inside the
 * registration: close returns, joins it and leaves nothing pinned */
static void close_during_registration_returns_and_unpins(void **state)
{
    if (!uring_registers())
        skip();
    unsigned char *img = malloc(img_bytes());
    assert_non_null(img);
    uint64_t pin0 = vmpin();
    hold(1);
    for (int i = 0; i < 3; i++) {
        ferry_kv *kv = open_store(state);
        store_prompt(kv, img, i);
        double t0 = now_s();
        ferry_kv_close(kv);
        assert_true(now_s() - t0 < 5);
    }
    hold(0);
    assert_true(vmpin() < pin0 + POOL / 2);
    /* inside the registration: close waits for it, then undoes it */
    hook(0, 200);
    ferry_kv *kv = open_store(state);
    double end = now_s() + 60;
    while (atomic_load(&g_h.entered) == 0 && now_s() < end)
        sleep_ms(1);
    assert_int_equal(atomic_load(&g_h.entered), 1);
    ferry_kv_close(kv);
    assert_int_equal(atomic_load(&g_h.left), 1); /* (joined: the hook returned) */
    assert_true(vmpin() < pin0 + POOL / 2);
    ferry__sys_set(NULL);
    /* and right after open, the thread running */
    for (int i = 0; i < 3; i++)
        ferry_kv_close(open_store(state));
    assert_true(vmpin() < pin0 + POOL / 2);
    free(img);
}

/* the engine refuses the registration: the state says so, nothing is
 * pinned, and L2 keeps moving every byte the plain way */
static void failed_registration_leaves_the_plain_path(void **state)
{
    if (!uring_registers())
        skip();
    unsigned char *img = malloc(img_bytes());
    assert_non_null(img);
    uint64_t pin0 = vmpin();
    hook(ENOMEM, 0);
    ferry_kv *kv = open_store(state);
    assert_int_equal(settled(kv), -ENOMEM);
    assert_true(atomic_load(&g_h.entered) >= 1);
    assert_true(vmpin() < pin0 + POOL / 2);
    l2_round(kv, img, 0, ROUND);
    l2_round(kv, img, ROUND, 2 * ROUND);
    ferry_kv_close(kv);
    ferry__sys_set(NULL);
    assert_true(vmpin() < pin0 + POOL / 2);
    free(img);
}

/* write-throughs that lag the stores (a loaded machine, a slow disk): L1
 * skips a chunk whose write is in flight and evicts a newer one, so which
 * chunks stay in L1 is not the LRU order - a chunk may be answered from L1
 * where L2 was expected, never with other bytes. Every round reads back
 * through L2 all the same. */
static void l2_bytes_exact_while_write_throughs_lag(void **state)
{
    if (!uring_registers())
        skip();
    unsigned char *img = malloc(img_bytes());
    assert_non_null(img);
    g_table = *ferry__sys_default();
    g_table.uring_result = h_result;
    atomic_store(&g_write_ms, 3);
    ferry__sys_set(&g_table);
    ferry_kv *kv = open_store(state);
    assert_int_equal(settled(kv), FERRY__KV_POOLREG_DONE);
    l2_round(kv, img, 0, ROUND);
    l2_round(kv, img, ROUND, 2 * ROUND);
    ferry_kv_close(kv);
    ferry__sys_set(NULL);
    atomic_store(&g_write_ms, 0);
    free(img);
}

/* the same with writes that wait before the kernel reads the slot (the
 * posix engine, its pwrite delayed): a chunk whose write-through is in
 * flight keeps its L1 slot until the write is done, so every chunk read
 * back (from L1 or L2) is exactly the one stored; an L1 that gave the
 * slot to a newer chunk first would write that chunk's bytes into the
 * older one's L2 copy (refused by its checksum: a miss where the test
 * wants every token) */
static void l2_bytes_exact_while_writes_wait_to_read(void **state)
{
    unsigned char *img = malloc(img_bytes());
    assert_non_null(img);
    g_table = *ferry__sys_default();
    g_table.pwrite = h_pwrite;
    atomic_store(&g_write_ms, 3);
    ferry__sys_set(&g_table);
    g_engine = "posix";
    g_read_ttl_ms = 1; /* (the write-through's read lock lapses: its own flag holds the slot) */
    ferry_kv *kv = open_store(state);
    l2_round(kv, img, 0, ROUND);
    l2_round(kv, img, ROUND, 2 * ROUND);
    ferry_kv_close(kv);
    g_engine = "uring";
    g_read_ttl_ms = 0;
    ferry__sys_set(NULL);
    atomic_store(&g_write_ms, 0);
    free(img);
}

static int setup(void **state)
{
    (void)state;
    ft_tmpdir(g_dir, sizeof g_dir);
    return g_dir[0] ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    ferry__sys_set(NULL);
    hold(0);
    ft_rmtree(g_dir);
    return 0;
}

#define BOTH_L2(fn)                                                                     \
    cmocka_unit_test_prestate(fn, "gds"), cmocka_unit_test_prestate(fn, "persistent")

int main(void)
{
    const struct CMUnitTest tests[] = {
        BOTH_L2(open_leaves_the_registration_to_a_thread),
        BOTH_L2(l2_bytes_exact_before_during_and_after_registration),
        BOTH_L2(close_during_registration_returns_and_unpins),
        BOTH_L2(failed_registration_leaves_the_plain_path),
        BOTH_L2(l2_bytes_exact_while_write_throughs_lag),
        BOTH_L2(l2_bytes_exact_while_writes_wait_to_read),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
