/*
 * test_moe_prefetch.c - a prefetch of rows on NVMe is asynchronous: it
 * returns while its reads are still blocked in the device, they land on
 * the executor's reader thread, and a later call (finish, apply, destroy)
 * waits for them; a failed read leaves every slot of the plan unknown.
 */
/* ferry-test-labels: concurrent */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ferry_test.h"
#include "moe/moe_internal.h"

enum { L = 2, E = 4, SLOTS = 4, W = 256 };

/* a slot device in host memory whose file reads wait for a gate */
typedef struct gated {
    uint8_t mem[SLOTS * W];
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int open, fail, reads_started;
} gated;

static int g_write(void *ctx, uint32_t bank, uint32_t slot, const void *src, size_t n)
{
    gated *g = ctx;
    (void)bank;
    memcpy(g->mem + (size_t)slot * W, src, n);
    return 0;
}

static int g_copy(void *ctx, uint32_t bank, uint32_t dst, uint32_t src)
{
    gated *g = ctx;
    (void)bank;
    memmove(g->mem + (size_t)dst * W, g->mem + (size_t)src * W, W);
    return 0;
}

static int g_read(void *ctx, uint32_t bank, uint32_t slot, ferry_io *io, ferry_file *f,
                  uint64_t off, size_t n)
{
    gated *g = ctx;
    (void)bank;
    pthread_mutex_lock(&g->mu);
    g->reads_started++;
    pthread_cond_broadcast(&g->cv);
    struct timespec dl = ferry__deadline_ms(20000);
    int rc = 0;
    while (!g->open && rc == 0)
        rc = pthread_cond_timedwait(&g->cv, &g->mu, &dl);
    int fail = g->fail;
    pthread_mutex_unlock(&g->mu);
    if (rc != 0)
        return ferry__err_set(NULL, -ETIMEDOUT, "gated read: never opened");
    if (fail)
        return ferry__err_set(NULL, -EIO, "gated read: injected failure at slot %u", slot);
    int r = ferry_io_pread(io, f, g->mem + (size_t)slot * W, n, off);
    return r < 0 ? r : 0;
}

static int g_flush(void *ctx)
{
    (void)ctx;
    return 0;
}

static const ferry_moe_slot_device_ops gated_ops = {
    .size = sizeof(ferry_moe_slot_device_ops),
    .write_slot = g_write,
    .copy_slot = g_copy,
    .read_file = g_read,
    .flush = g_flush,
    .flush_prefetch = g_flush,
};

static void gate_init(gated *g)
{
    memset(g, 0, sizeof *g);
    pthread_mutex_init(&g->mu, NULL);
    FT_ASSERT_OK(ferry__cond_init_mono(&g->cv));
}

static void gate_open(gated *g, int fail)
{
    pthread_mutex_lock(&g->mu);
    g->open = 1;
    g->fail = fail;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
}

static void wait_started(gated *g)
{
    pthread_mutex_lock(&g->mu);
    struct timespec dl = ferry__deadline_ms(20000);
    while (!g->reads_started)
        assert_int_equal(pthread_cond_timedwait(&g->cv, &g->mu, &dl), 0);
    pthread_mutex_unlock(&g->mu);
}

typedef struct rig {
    char dir[256];
    uint8_t img[L * E * W];
    ferry_io *io;
    ferry_moe_rows *rows;
    ferry_moe_geometry g;
} rig;

static void rig_open(rig *x)
{
    ft_tmpdir(x->dir, sizeof x->dir);
    char path[300];
    snprintf(path, sizeof path, "%s/rows.bin", x->dir);
    ft_fill_pattern(x->img, sizeof x->img, 3);
    int fd = open(path, O_CREAT | O_WRONLY | O_TRUNC, 0600);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, x->img, sizeof x->img), (ssize_t)sizeof x->img);
    close(fd);
    ferry_io_options o = FERRY_IO_OPTIONS_INIT;
    o.engine = "posix";
    FT_ASSERT_OK(ferry_io_open(&o, &x->io));
    ferry_moe_geometry g = FERRY_MOE_GEOMETRY_INIT;
    g.num_layers = L;
    g.num_experts = E;
    g.slots = SLOTS;
    g.banks = 1;
    g.row_bytes[0] = W;
    x->g = g;
    FT_ASSERT_OK(ferry_moe_rows_file(&g, x->io, path, NULL, &x->rows));
}

static void rig_close(rig *x)
{
    ferry_moe_rows_destroy(x->rows);
    ferry_io_close(x->io);
    ft_rmtree(x->dir);
}

static void a_file_prefetch_returns_before_its_reads_land(void **state)
{
    (void)state;
    rig x;
    rig_open(&x);
    gated gd;
    gate_init(&gd);
    ferry_moe_slots *s;
    FT_ASSERT_OK(ferry_moe_slots_create(&x.g, &gated_ops, &gd, &s));
    uint32_t dst[] = {2, 0}, src[] = {3, 1}, unknown[SLOTS], nu;
    ferry_moe_copy_plan plan = {1, 2, dst, src};
    /* the reads block in the device until the gate opens: a synchronous
     * prefetch would not return */
    assert_int_equal(ferry_moe_slots_prefetch_start(s, &plan, x.rows, unknown, &nu), 2);
    wait_started(&gd);
    assert_int_equal(ferry_moe_slots_occupant(s, 2), FERRY_MOE_NONE);
    gate_open(&gd, 0);
    assert_int_equal(ferry_moe_slots_prefetch_finish(s, unknown, &nu), 2);
    assert_int_equal(nu, 0);
    for (int i = 0; i < 2; i++) {
        assert_int_equal(ferry_moe_slots_occupant(s, dst[i]), 1 * E + src[i]);
        assert_memory_equal(gd.mem + (size_t)dst[i] * W, x.img + (size_t)(1 * E + src[i]) * W, W);
    }
    ferry_moe_slots_stats st = FERRY_MOE_SLOTS_STATS_INIT;
    FT_ASSERT_OK(ferry_moe_slots_stats_get(s, &st));
    assert_int_equal(st.prefetch_rows, 2);
    assert_int_equal(st.prefetch_bytes, 2 * W);
    /* an apply while one is pending waits for it, then runs */
    pthread_mutex_lock(&gd.mu);
    gd.open = 0;
    gd.reads_started = 0;
    pthread_mutex_unlock(&gd.mu);
    uint32_t d1[] = {1}, r1[] = {0};
    ferry_moe_copy_plan one = {0, 1, d1, r1};
    assert_int_equal(ferry_moe_slots_prefetch_start(s, &one, x.rows, unknown, &nu), 1);
    wait_started(&gd);
    gate_open(&gd, 0);
    uint32_t d3[] = {3}, r3[] = {2};
    ferry_moe_copy_plan other = {0, 1, d3, r3};
    assert_int_equal(ferry_moe_slots_apply(s, &other, x.rows, unknown, &nu), 1);
    assert_int_equal(ferry_moe_slots_occupant(s, 1), 0);
    assert_int_equal(ferry_moe_slots_occupant(s, 3), 2);
    assert_memory_equal(gd.mem + 1 * W, x.img + 0 * W, W);
    ferry_moe_slots_destroy(s);
    rig_close(&x);
}

static void a_failed_file_prefetch_leaves_its_slots_unknown(void **state)
{
    (void)state;
    rig x;
    rig_open(&x);
    gated gd;
    gate_init(&gd);
    ferry_moe_slots *s;
    FT_ASSERT_OK(ferry_moe_slots_create(&x.g, &gated_ops, &gd, &s));
    uint32_t dst[] = {0, 1, 2}, src[] = {0, 1, 2}, unknown[SLOTS], nu;
    ferry_moe_copy_plan plan = {0, 3, dst, src};
    assert_int_equal(ferry_moe_slots_prefetch_start(s, &plan, x.rows, unknown, &nu), 3);
    gate_open(&gd, 1);
    assert_int_equal(ferry_moe_slots_prefetch_finish(s, unknown, &nu), -EIO);
    assert_non_null(strstr(ferry_last_error(), "injected failure"));
    assert_int_equal(nu, 3);
    for (int i = 0; i < 3; i++)
        assert_int_equal(ferry_moe_slots_occupant(s, dst[i]), FERRY_MOE_NONE);
    /* destroy while one is pending: it waits for the reads first */
    pthread_mutex_lock(&gd.mu);
    gd.fail = 0;
    pthread_mutex_unlock(&gd.mu);
    assert_int_equal(ferry_moe_slots_prefetch_start(s, &plan, x.rows, unknown, &nu), 3);
    ferry_moe_slots_destroy(s);
    rig_close(&x);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(a_file_prefetch_returns_before_its_reads_land),
        cmocka_unit_test(a_failed_file_prefetch_leaves_its_slots_unknown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
