/*
 * test_moe_exec.c - the expert slot executor: the seed's tests (a slot
 * pair split the right way round, a plan landing each expert in the slot
 * it named, a gather without host traffic, a warm step with zero bytes and
 * no device call) on the host device, plus validation, failed writes and
 * flushes with the planner/executor checker, host and NVMe rows sources,
 * and out-of-memory.
 */
#include <errno.h>
#include <malloc.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ferry_test.h"
#include "moe_traces.h"
#include "moe/moe_internal.h"

#define W 64 /* row width of the small tests */

/* ---- a recording fake slot device ---- */
typedef struct fake {
    uint32_t banks, slots;
    size_t width[FERRY_MOE_MAX_BANKS];
    uint8_t *mem[FERRY_MOE_MAX_BANKS]; /* slots * width */
    int calls, begins, writes, copies, flushes, last_route;
    int fail_write_at, fail_flush_at;  /* 1-based counts; 0 never */
    int pflushes, fail_pflush_at, prefetch_routes;
} fake;

static int fk_begin(void *c, int route)
{
    fake *f = c;
    f->calls++;
    f->begins++;
    f->last_route = route;
    if (route == FERRY_MOE_ROUTE_PREFETCH)
        f->prefetch_routes++;
    return 0;
}

static int fk_flush_prefetch(void *c)
{
    fake *f = c;
    f->calls++;
    if (++f->pflushes == f->fail_pflush_at)
        return ferry__err_set(NULL, -EIO, "fake: prefetch flush %d failed", f->pflushes);
    return 0;
}

static int fk_write(void *c, uint32_t bank, uint32_t slot, const void *src, size_t n)
{
    fake *f = c;
    f->calls++;
    if (++f->writes == f->fail_write_at)
        return ferry__err_set(NULL, FERRY_EINJECTED, "fake: write %d into slot %u refused",
                              f->writes, slot);
    assert_int_equal(n, f->width[bank]);
    memcpy(f->mem[bank] + (size_t)slot * n, src, n);
    return 0;
}

static int fk_copy(void *c, uint32_t bank, uint32_t dst, uint32_t src)
{
    fake *f = c;
    f->calls++;
    f->copies++;
    memcpy(f->mem[bank] + (size_t)dst * f->width[bank], f->mem[bank] + (size_t)src * f->width[bank],
           f->width[bank]);
    return 0;
}

static int fk_flush(void *c)
{
    fake *f = c;
    f->calls++;
    if (++f->flushes == f->fail_flush_at)
        return ferry__err_set(NULL, -EIO, "fake: flush %d failed", f->flushes);
    return 0;
}

static const ferry_moe_slot_device_ops fake_ops = {
    .size = sizeof(ferry_moe_slot_device_ops),
    .begin_plan = fk_begin,
    .write_slot = fk_write,
    .copy_slot = fk_copy,
    .flush = fk_flush,
};

static const ferry_moe_slot_device_ops fake_ops2 = {
    .size = sizeof(ferry_moe_slot_device_ops),
    .begin_plan = fk_begin,
    .write_slot = fk_write,
    .copy_slot = fk_copy,
    .flush = fk_flush,
    .flush_prefetch = fk_flush_prefetch,
};

static void fake_init(fake *f, const ferry_moe_geometry *g)
{
    memset(f, 0, sizeof *f);
    f->banks = g->banks;
    f->slots = g->slots;
    for (uint32_t b = 0; b < g->banks; b++) {
        f->width[b] = g->row_bytes[b];
        f->mem[b] = calloc(g->slots, g->row_bytes[b]);
    }
}

static void fake_fini(fake *f)
{
    for (uint32_t b = 0; b < f->banks; b++)
        free(f->mem[b]);
}

/* ---- rows whose bytes name their expert (the seed's NamedRows) ---- */
typedef struct named {
    uint32_t layers, experts;
    size_t width;
    uint8_t *rows;         /* [layer][expert][width] */
    size_t odd_width_row;  /* report this row with a wrong width; SIZE_MAX none */
} named;

static uint8_t name_byte(uint32_t layer, uint32_t expert, size_t i)
{
    return (uint8_t)((layer * 31 + expert) << 4 | (i & 15));
}

static void named_init(named *n, uint32_t layers, uint32_t experts, size_t width)
{
    n->layers = layers;
    n->experts = experts;
    n->width = width;
    n->odd_width_row = SIZE_MAX;
    n->rows = malloc((size_t)layers * experts * width);
    for (uint32_t l = 0; l < layers; l++)
        for (uint32_t e = 0; e < experts; e++)
            for (size_t i = 0; i < width; i++)
                n->rows[((size_t)l * experts + e) * width + i] = name_byte(l, e, i);
}

static const void *named_row(void *ctx, uint32_t bank, uint32_t layer, uint32_t row, size_t *len)
{
    named *n = ctx;
    if (bank > 0 || layer >= n->layers || row >= n->experts)
        return NULL;
    *len = row == n->odd_width_row ? n->width - 1 : n->width;
    return n->rows + ((size_t)layer * n->experts + row) * n->width;
}

static ferry_device *host_dev(void)
{
    ferry_device_options o = FERRY_DEVICE_OPTIONS_INIT;
    o.backend = "host";
    ferry_device *d = NULL;
    FT_ASSERT_OK(ferry_device_open(&o, &d));
    return d;
}

static void read_slot(ferry_device *dev, void *ctx, uint32_t bank, uint32_t slot, void *buf, size_t n)
{
    FT_ASSERT_OK(ferry_device_download(dev, buf, ferry_moe_device_slot_ptr(ctx, bank, slot), n));
}

/* the one line of the gather path a compiler cannot check: which slot is
 * the source and which the destination, for every order of the pair */
/* every function taking a geometry refuses it whole, naming the field,
 * before anything is sized by it */
static void geometries_are_range_checked(void **state)
{
    (void)state;
    ferry_device *dev = host_dev();
    ferry_io_options io_o = FERRY_IO_OPTIONS_INIT;
    io_o.engine = "posix";
    io_o.depth = 1;
    ferry_io *io = NULL;
    FT_ASSERT_OK(ferry_io_open(&io_o, &io));
    struct {
        uint32_t layers, experts, slots, banks;
        size_t row;
        const char *field;
        int slots_only; /* only where slots are used (executor, device slots) */
    } bad[] = {
        {0, 8, 8, 1, 64, "num_layers 0", 0},
        {1025, 8, 8, 1, 64, "num_layers 1025", 0},
        {UINT32_MAX, 8, 8, 1, 64, "num_layers", 0},
        {2, 0, 8, 1, 64, "num_experts 0", 0},
        {2, 16385, 8, 1, 64, "num_experts 16385", 0},
        {2, UINT32_MAX, 8, 1, 64, "num_experts", 0},
        {2, 8, 0, 1, 64, "slots 0", 1},
        {2, 8, (1u << 24) + 1, 1, 64, "slots 16777217", 1},
        {2, 8, UINT32_MAX, 1, 64, "slots", 1},
        {2, 8, 8, 0, 64, "banks 0", 0},
        {2, 8, 8, FERRY_MOE_MAX_BANKS + 1, 64, "banks 9", 0},
        {2, 8, 8, UINT32_MAX, 64, "banks", 0},
        {2, 8, 8, 1, 0, "row_bytes[0] 0", 0},
        {2, 8, 8, 1, (size_t)FERRY_MOE_MAX_ROW_BYTES + 1, "row_bytes[0]", 0},
        {2, 8, 8, 1, SIZE_MAX, "row_bytes[0]", 0},
        {2, 8, 8, 1, (size_t)1 << 63, "row_bytes[0]", 0},
        /* each field in range, their product not: 2^24 rows of 1 TiB */
        {1024, 16384, 8, 1, (size_t)FERRY_MOE_MAX_ROW_BYTES, "overflows", 0},
        /* a bank fits, the slot arena does not: 2^24 slots x 2^39 bytes */
        {1, 1, 1u << 24, 1, (size_t)1 << 39, "slots 16777216 x row_bytes[0]", 1},
    };
    for (size_t i = 0; i < FERRY__ARRAY_LEN(bad); i++) {
        ferry_moe_geometry g = FERRY_MOE_GEOMETRY_INIT;
        g.num_layers = bad[i].layers;
        g.num_experts = bad[i].experts;
        g.slots = bad[i].slots;
        g.banks = bad[i].banks;
        for (int b = 0; b < FERRY_MOE_MAX_BANKS; b++)
            g.row_bytes[b] = bad[i].row;
        /* what each entry point answers, with its name for the report */
        int rc[5];
        const char *who[5] = {"slots_create", "device_slots_open", "rows_host", "rows_fn",
                              "rows_file"};
        char *msgs[5];
        ferry_moe_slots *s = (ferry_moe_slots *)0x1;
        rc[0] = ferry_moe_slots_create(&g, &fake_ops, NULL, &s);
        msgs[0] = strdup(ferry_last_error());
        assert_ptr_equal(s, (ferry_moe_slots *)0x1);
        const ferry_moe_slot_device_ops *ops = NULL;
        void *ctx = NULL;
        rc[1] = ferry_moe_device_slots_open(dev, &g, &ops, &ctx);
        msgs[1] = strdup(ferry_last_error());
        assert_null(ctx);
        /* rows sources ignore slots: where only slots are wrong they may
         * open (without a device nothing touches the bank memory) */
        char bank[64];
        void *base[FERRY_MOE_MAX_BANKS] = {bank, bank, bank, bank, bank, bank, bank, bank};
        for (int k = 2; k < 5; k++) {
            ferry_moe_rows *r = (ferry_moe_rows *)0x1;
            if (k == 2)
                rc[k] = ferry_moe_rows_host(&g, base, NULL, 0, &r);
            else if (k == 3)
                rc[k] = ferry_moe_rows_fn(&g, named_row, NULL, &r);
            else
                rc[k] = ferry_moe_rows_file(&g, io, "/nonexistent/rows.bin", NULL, &r);
            msgs[k] = strdup(ferry_last_error());
            if (rc[k] == 0)
                ferry_moe_rows_destroy(r);
            else
                assert_ptr_equal(r, (ferry_moe_rows *)0x1);
        }
        for (int k = 0; k < 5; k++) {
            int checked = k < 2 || !bad[i].slots_only;
            if (checked && (rc[k] != -EINVAL || !strstr(msgs[k], bad[i].field)))
                fail_msg("case %zu, %s: %d '%s', want -EINVAL naming '%s'", i, who[k], rc[k],
                         msgs[k], bad[i].field);
            if (!checked && rc[k] == -EINVAL && strstr(msgs[k], "slots"))
                fail_msg("case %zu, %s: a rows source checked slots: '%s'", i, who[k], msgs[k]);
            free(msgs[k]);
        }
    }
    ferry_moe_geometry g = ft_moe_geom(1, 1, 1, 64);
    g.size = 1;
    assert_int_equal(ferry_moe_slots_create(&g, &fake_ops, NULL, NULL), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "geometry size 1"));

    /* the sources' own sizes: a bank that wraps the address space, a file
     * bank that would end past the largest offset */
    g = ft_moe_geom(1, 1, 1, 4096);
    void *base[1] = {(void *)(UINTPTR_MAX - 100)};
    ferry_moe_rows *r = NULL;
    assert_int_equal(ferry_moe_rows_host(&g, base, NULL, 0, &r), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "wraps"));
    const uint64_t offs[2][1] = {{(uint64_t)INT64_MAX}, {UINT64_MAX}};
    for (int k = 0; k < 2; k++) {
        assert_int_equal(ferry_moe_rows_file(&g, io, "/nonexistent/rows.bin", offs[k], &r),
                         -EINVAL);
        assert_non_null(strstr(ferry_last_error(), "bank_off[0]"));
    }
    ferry_io_close(io);
    ferry_device_close(dev);
}

static void a_slot_pair_copies_the_way_the_caller_asked(void **state)
{
    (void)state;
    ferry_device *dev = host_dev();
    ferry_moe_geometry g = ft_moe_geom(1, 4, 4, W);
    named rows_mem;
    named_init(&rows_mem, 1, 4, W);
    ferry_moe_rows *rows;
    FT_ASSERT_OK(ferry_moe_rows_fn(&g, named_row, &rows_mem, &rows));
    const uint32_t pairs[][2] = {{0, 3}, {3, 0}, {1, 2}, {2, 1}, {0, 1}, {3, 2}};
    for (size_t k = 0; k < 6; k++) {
        const ferry_moe_slot_device_ops *ops;
        void *ctx;
        ferry_moe_slots *s;
        FT_ASSERT_OK(ferry_moe_device_slots_open(dev, &g, &ops, &ctx));
        FT_ASSERT_OK(ferry_moe_slots_create(&g, ops, ctx, &s));
        uint32_t dst[] = {0, 1, 2, 3}, src[] = {0, 1, 2, 3};
        ferry_moe_copy_plan plan = {0, 4, dst, src};
        assert_int_equal(ferry_moe_slots_apply(s, &plan, rows, NULL, NULL), 4);
        uint32_t d = pairs[k][0], from = pairs[k][1];
        ferry_moe_gather_plan gp = {1, &d, &from};
        assert_int_equal(ferry_moe_slots_gather(s, &gp, NULL, NULL), 1);
        uint8_t buf[W];
        read_slot(dev, ctx, 0, d, buf, W);
        assert_memory_equal(buf, rows_mem.rows + (size_t)from * W, W);
        read_slot(dev, ctx, 0, from, buf, W);
        assert_memory_equal(buf, rows_mem.rows + (size_t)from * W, W);
        assert_int_equal(ferry_moe_slots_occupant(s, d), from);
        ferry_moe_slots_destroy(s);
    }
    /* a self-copy and an out-of-range slot are refused, not performed */
    const ferry_moe_slot_device_ops *ops;
    void *ctx;
    ferry_moe_slots *s;
    FT_ASSERT_OK(ferry_moe_device_slots_open(dev, &g, &ops, &ctx));
    FT_ASSERT_OK(ferry_moe_slots_create(&g, ops, ctx, &s));
    uint32_t dst[] = {2}, src[] = {1};
    ferry_moe_copy_plan plan = {0, 1, dst, src};
    assert_int_equal(ferry_moe_slots_apply(s, &plan, rows, NULL, NULL), 1);
    uint32_t two = 2, four = 4;
    ferry_moe_gather_plan self = {1, &two, &two}, out = {1, &four, &two}, in = {1, &two, &four};
    assert_int_equal(ferry_moe_slots_gather(s, &self, NULL, NULL), -EINVAL);
    assert_int_equal(ferry_moe_slots_gather(s, &out, NULL, NULL), -EINVAL);
    assert_int_equal(ferry_moe_slots_gather(s, &in, NULL, NULL), -EINVAL);
    assert_int_equal(ferry_moe_device_slot_ptr(ctx, 0, 4), 0);
    assert_int_equal(ferry_moe_device_slot_ptr(ctx, 1, 0), 0);
    ferry_moe_slots_destroy(s);
    ferry_moe_rows_destroy(rows);
    free(rows_mem.rows);
    ferry_device_close(dev);
}

/* the seed's hardware test, on the host device: a plan lands the bytes the
 * planner named in the slots it named, a gather moves a slot without
 * touching the host, and a warm step copies nothing */
static void a_plan_lands_each_expert_in_the_slot_it_named(void **state)
{
    (void)state;
    ferry_device *dev = host_dev();
    ferry_moe_geometry g = ft_moe_geom(1, 4, 4, W);
    named rows_mem;
    named_init(&rows_mem, 1, 4, W);
    ferry_moe_rows *rows;
    FT_ASSERT_OK(ferry_moe_rows_fn(&g, named_row, &rows_mem, &rows));
    const ferry_moe_slot_device_ops *ops;
    void *ctx;
    ferry_moe_slots *s;
    FT_ASSERT_OK(ferry_moe_device_slots_open(dev, &g, &ops, &ctx));
    FT_ASSERT_OK(ferry_moe_slots_create(&g, ops, ctx, &s));
    assert_ptr_equal(ferry_moe_slots_device(s), ctx);

    uint32_t dst[] = {0, 2}, src[] = {3, 1};
    ferry_moe_copy_plan plan = {0, 2, dst, src};
    assert_int_equal(ferry_moe_slots_apply(s, &plan, rows, NULL, NULL), 2);
    uint8_t buf[W];
    for (int i = 0; i < 2; i++) {
        read_slot(dev, ctx, 0, dst[i], buf, W);
        assert_memory_equal(buf, rows_mem.rows + (size_t)src[i] * W, W);
        assert_int_equal(ferry_moe_slots_occupant(s, dst[i]), src[i]);
    }
    assert_int_equal(ferry_moe_slots_occupant(s, 1), FERRY_MOE_NONE);

    uint32_t gd = 1, gs = 0;
    ferry_moe_gather_plan gp = {1, &gd, &gs};
    assert_int_equal(ferry_moe_slots_gather(s, &gp, NULL, NULL), 1);
    read_slot(dev, ctx, 0, 1, buf, W);
    assert_memory_equal(buf, rows_mem.rows + 3 * W, W); /* slot 0's contents, not a neighbour's */
    assert_int_equal(ferry_moe_slots_occupant(s, 1), 3);

    ferry_moe_slots_stats st = FERRY_MOE_SLOTS_STATS_INIT;
    ferry_moe_slots_stats_get(s, &st);
    assert_int_equal(st.host_rows, 2);
    assert_int_equal(st.host_bytes, 2 * W);
    assert_int_equal(st.device_rows, 1);
    assert_int_equal(st.device_bytes, W); /* not billed to the link */

    ferry_moe_copy_plan warm = {0, 0, dst, src};
    assert_int_equal(ferry_moe_slots_apply(s, &warm, rows, NULL, NULL), 0);
    ferry_moe_slots_stats st2 = FERRY_MOE_SLOTS_STATS_INIT;
    ferry_moe_slots_stats_get(s, &st2);
    assert_int_equal(st2.host_bytes, st.host_bytes);
    assert_int_equal(st2.warm_plans, 1);
    assert_int_equal(st2.plans, 2);
    ferry_moe_slots_destroy(s);
    ferry_moe_rows_destroy(rows);
    free(rows_mem.rows);
    ferry_device_close(dev);
}

static void a_warm_step_makes_no_device_call(void **state)
{
    (void)state;
    ferry_moe_geometry g = ft_moe_geom(2, 4, 4, W);
    fake f;
    fake_init(&f, &g);
    ferry_moe_slots *s;
    FT_ASSERT_OK(ferry_moe_slots_create(&g, &fake_ops, &f, &s));
    ferry_moe_copy_plan warm = {1, 0, NULL, NULL};
    assert_int_equal(ferry_moe_slots_apply(s, &warm, NULL, NULL, NULL), 0);
    ferry_moe_gather_plan gwarm = {0, NULL, NULL};
    assert_int_equal(ferry_moe_slots_gather(s, &gwarm, NULL, NULL), 0);
    assert_int_equal(f.calls, 0);
    ferry_moe_slots_stats st = FERRY_MOE_SLOTS_STATS_INIT;
    ferry_moe_slots_stats_get(s, &st);
    assert_int_equal(st.warm_plans, 2);
    assert_int_equal(st.host_bytes + st.device_bytes, 0);
    ferry_moe_slots_destroy(s);
    fake_fini(&f);
}

/* a plan is validated whole: a bad entry anywhere means no device call */
static void invalid_plans_are_refused_before_any_byte_moves(void **state)
{
    (void)state;
    ferry_moe_geometry g = ft_moe_geom(2, 4, 4, W);
    fake f;
    fake_init(&f, &g);
    named rows_mem;
    named_init(&rows_mem, 2, 4, W);
    ferry_moe_rows *rows;
    FT_ASSERT_OK(ferry_moe_rows_fn(&g, named_row, &rows_mem, &rows));
    ferry_moe_slots *s;
    FT_ASSERT_OK(ferry_moe_slots_create(&g, &fake_ops, &f, &s));

    uint32_t twice_d[] = {1, 2, 1}, rows3[] = {0, 1, 2};
    ferry_moe_copy_plan p1 = {0, 3, twice_d, rows3};
    assert_int_equal(ferry_moe_slots_apply(s, &p1, rows, NULL, NULL), -EINVAL);
    assert_non_null(strstr(ferry_moe_slots_last_error(s), "slot 1 is written twice"));

    uint32_t d2[] = {0, 1}, r2[] = {0, 2};
    rows_mem.odd_width_row = 2;
    ferry_moe_copy_plan p2 = {1, 2, d2, r2};
    assert_int_equal(ferry_moe_slots_apply(s, &p2, rows, NULL, NULL), FERRY_EMISMATCH);
    assert_non_null(strstr(ferry_last_error(), "63 bytes"));
    rows_mem.odd_width_row = SIZE_MAX;

    uint32_t r_absent[] = {0, 4};
    ferry_moe_copy_plan p3 = {1, 2, d2, r_absent};
    assert_int_equal(ferry_moe_slots_apply(s, &p3, rows, NULL, NULL), -EINVAL);
    ferry_moe_copy_plan p4 = {2, 2, d2, r2};
    assert_int_equal(ferry_moe_slots_apply(s, &p4, rows, NULL, NULL), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "layer 2"));
    uint32_t d_out[] = {0, 4};
    ferry_moe_copy_plan p5 = {1, 2, d_out, r2};
    assert_int_equal(ferry_moe_slots_apply(s, &p5, rows, NULL, NULL), -EINVAL);
    ferry_moe_copy_plan p6 = {1, 2, d2, r2};
    assert_int_equal(ferry_moe_slots_apply(s, &p6, NULL, NULL, NULL), -EINVAL);
    /* a gather from a slot nobody wrote */
    uint32_t gd = 0, gs = 3;
    ferry_moe_gather_plan gp = {1, &gd, &gs};
    assert_int_equal(ferry_moe_slots_gather(s, &gp, NULL, NULL), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "source slot 3"));
    assert_int_equal(f.calls, 0);

    /* and a good one goes through, routed as the rows' class says */
    assert_int_equal(ferry_moe_slots_apply(s, &p6, rows, NULL, NULL), 2);
    assert_int_equal(f.begins, 1);
    assert_int_equal(f.writes, 2);
    assert_int_equal(f.flushes, 1);
    assert_int_equal(f.last_route, FERRY_MOE_ROUTE_WHOLE_LAYER_PAGEABLE);
    assert_memory_equal(f.mem[0] + W, rows_mem.rows + (4 + 2) * W, W);
    ferry_moe_slots_destroy(s);
    ferry_moe_rows_destroy(rows);
    free(rows_mem.rows);
    fake_fini(&f);
}

static void forget_all(ferry_moe_planner *p, const uint32_t *unknown, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++)
        FT_ASSERT_OK(ferry_moe_planner_forget(p, unknown[i]));
}

/* failed write: that slot and the plan's later ones are unknown, the
 * earlier ones landed; failed flush: every slot of the plan is unknown;
 * after the planner forgets what the executor reports, both agree */
static void failures_leave_planner_and_executor_agreeing(void **state)
{
    (void)state;
    ferry_moe_geometry g = ft_moe_geom(2, 8, 8, W);
    fake f;
    fake_init(&f, &g);
    named rows_mem;
    named_init(&rows_mem, 2, 8, W);
    ferry_moe_rows *rows;
    FT_ASSERT_OK(ferry_moe_rows_fn(&g, named_row, &rows_mem, &rows));
    ferry_moe_slots *s;
    FT_ASSERT_OK(ferry_moe_slots_create(&g, &fake_ops, &f, &s));
    ferry_moe_planner_options o = FERRY_MOE_PLANNER_OPTIONS_INIT;
    o.num_layers = 2;
    o.num_experts = 8;
    o.slots = 8;
    ferry_moe_planner *p;
    FT_ASSERT_OK(ferry_moe_planner_create(&o, &p));

    uint32_t route[] = {0, 1, 2, 3}, unknown[8], nu = 99;
    ferry_moe_copy_plan plan;
    assert_int_equal(ferry_moe_planner_ensure(p, 0, route, 4, NULL, &plan, NULL), 4);
    f.fail_write_at = 3;
    assert_int_equal(ferry_moe_slots_apply(s, &plan, rows, unknown, &nu), FERRY_EINJECTED);
    assert_int_equal(nu, 2);
    assert_int_equal(unknown[0], plan.dst_slots[2]);
    assert_int_equal(unknown[1], plan.dst_slots[3]);
    assert_non_null(strstr(ferry_last_error(), "refused"));
    assert_int_equal(ferry_moe_slots_occupant(s, plan.dst_slots[0]), 0);
    assert_int_equal(ferry_moe_slots_occupant(s, plan.dst_slots[2]), FERRY_MOE_NONE);
    assert_int_equal(ferry_moe_check(p, s), FERRY_EMISMATCH);
    assert_non_null(strstr(ferry_last_error(), "does not know"));
    forget_all(p, unknown, nu);
    FT_ASSERT_OK(ferry_moe_check(p, s));

    /* the next step re-fetches exactly the two lost experts */
    ferry_moe_counts c;
    assert_int_equal(ferry_moe_planner_ensure(p, 0, route, 4, NULL, &plan, &c), 2);
    assert_int_equal(c.missing, 2);
    f.fail_flush_at = f.flushes + 1;
    assert_int_equal(ferry_moe_slots_apply(s, &plan, rows, unknown, &nu), -EIO);
    assert_int_equal(nu, 2);
    assert_non_null(strstr(ferry_last_error(), "every slot of the plan"));
    forget_all(p, unknown, nu);
    FT_ASSERT_OK(ferry_moe_check(p, s));
    assert_int_equal(ferry_moe_planner_ensure(p, 0, route, 4, NULL, &plan, NULL), 2);
    assert_int_equal(ferry_moe_slots_apply(s, &plan, rows, unknown, &nu), 2);
    assert_int_equal(nu, 0);
    FT_ASSERT_OK(ferry_moe_check(p, s));
    for (uint32_t e = 0; e < 4; e++) {
        uint32_t slot = ferry_moe_planner_lookup(p, 0, e);
        assert_memory_equal(f.mem[0] + (size_t)slot * W, rows_mem.rows + (size_t)e * W, W);
    }
    ferry_moe_slots_stats st = FERRY_MOE_SLOTS_STATS_INIT;
    ferry_moe_slots_stats_get(s, &st);
    assert_int_equal(st.failed_writes, 1);
    assert_int_equal(st.failed_flushes, 1);

    /* the checker also catches a slot the executor holds and the planner
     * does not (a gather outside the planner) */
    uint32_t gd = ferry_moe_planner_lookup(p, 1, 0) == FERRY_MOE_NONE ? 7 : 6;
    uint32_t gs = ferry_moe_planner_lookup(p, 0, 0);
    ferry_moe_gather_plan gp = {1, &gd, &gs};
    assert_int_equal(ferry_moe_slots_gather(s, &gp, NULL, NULL), 1);
    assert_int_equal(ferry_moe_check(p, s), FERRY_EMISMATCH);
    {   /* the message ends there (it read "it is free0") */
        const char *m = strstr(ferry_last_error(), "planner says it is free");
        assert_non_null(m);
        assert_string_equal(m, "planner says it is free");
    }
    FT_ASSERT_OK(ferry_moe_slots_invalidate(s, gd));
    FT_ASSERT_OK(ferry_moe_check(p, s));

    ferry_moe_planner_destroy(p);
    ferry_moe_slots_destroy(s);
    ferry_moe_rows_destroy(rows);
    free(rows_mem.rows);
    fake_fini(&f);
}

/* a whole trace through planner + executor on the host device with copy
 * and sync faults injected: after every step the checker passes and every
 * slot the planner names holds that expert's bytes */
static void a_faulty_device_never_desynchronises_the_pool(void **state)
{
    (void)state;
    ferry_device *dev = host_dev();
    ferry_moe_gen_options go = FERRY_MOE_GEN_OPTIONS_INIT;
    go.model = "small";
    go.tokens = 60;
    go.seed = 5;
    ferry_moe_trace *t;
    FT_ASSERT_OK(ferry_moe_trace_generate(&go, &t));
    const ferry_moe_model *m = ferry_moe_trace_model(t);
    ferry_moe_geometry g = ft_moe_geom(m->num_layers, m->num_experts, m->num_experts + 4, W);
    g.banks = 2;
    g.row_bytes[1] = 3 * W;
    void *banks[2];
    named a, b;
    named_init(&a, m->num_layers, m->num_experts, W);
    named_init(&b, m->num_layers, m->num_experts, 3 * W);
    banks[0] = a.rows;
    banks[1] = b.rows;
    ferry_moe_rows *rows;
    FT_ASSERT_OK(ferry_moe_rows_host(&g, banks, dev, 0, &rows));
    assert_int_equal(ferry_moe_rows_class(rows, 0), FERRY_MOE_PINNED);
    const ferry_moe_slot_device_ops *ops;
    void *ctx;
    ferry_moe_slots *s;
    FT_ASSERT_OK(ferry_moe_device_slots_open(dev, &g, &ops, &ctx));
    FT_ASSERT_OK(ferry_moe_slots_create(&g, ops, ctx, &s));
    ferry_moe_planner_options o = FERRY_MOE_PLANNER_OPTIONS_INIT;
    o.num_layers = m->num_layers;
    o.num_experts = m->num_experts;
    o.slots = g.slots;
    o.policy = "routing";
    ferry_moe_planner *p;
    FT_ASSERT_OK(ferry_moe_planner_create(&o, &p));
    int failures = 0;
    uint8_t buf[3 * W];
    for (size_t i = 0; i < ferry_moe_trace_steps(t); i++) {
        if (i % 7 == 3) /* every few steps, one of the next copies or syncs fails */
            FT_ASSERT_OK(ft_device_faults(dev, 1 + i % 3, 0, 0,
                                          i % 2 ? FERRY_FAULT_COPY : FERRY_FAULT_SYNC));
        uint32_t layer, n, unknown[64], nu = 0;
        const uint32_t *ex;
        FT_ASSERT_OK(ferry_moe_trace_step(t, i, NULL, &layer, &ex, &n));
        ferry_moe_copy_plan plan;
        assert_true(ferry_moe_planner_ensure(p, layer, ex, n, NULL, &plan, NULL) >= 0);
        int rc = ferry_moe_slots_apply(s, &plan, rows, unknown, &nu);
        if (rc < 0) {
            failures++;
            assert_true(nu > 0);
            forget_all(p, unknown, nu);
        }
        FT_ASSERT_OK(ferry_moe_check(p, s));
        FT_ASSERT_OK(ft_device_faults(dev, 0, 0, 0, 0));
        if (i % 10 == 0) {
            for (uint32_t slot = 0; slot < g.slots; slot++) {
                uint32_t id = ferry_moe_planner_occupant(p, slot);
                if (id == FERRY_MOE_NONE)
                    continue;
                read_slot(dev, ctx, 0, slot, buf, W);
                assert_memory_equal(buf, a.rows + (size_t)id * W, W);
                read_slot(dev, ctx, 1, slot, buf, 3 * W);
                assert_memory_equal(buf, b.rows + (size_t)id * 3 * W, 3 * W);
            }
        }
    }
    assert_true(failures > 0);
    ferry_moe_planner_destroy(p);
    ferry_moe_slots_destroy(s);
    ferry_moe_rows_destroy(rows);
    ferry_moe_trace_destroy(t);
    free(a.rows);
    free(b.rows);
    ferry_device_close(dev);
}

static void a_pin_budget_splits_layers_into_classes(void **state)
{
    (void)state;
    ferry_device *dev = host_dev();
    ferry_moe_geometry g = ft_moe_geom(3, 4, 4, 4096);
    void *bank = NULL;
    assert_int_equal(posix_memalign(&bank, 4096, 3 * 4 * 4096), 0);
    memset(bank, 1, 3 * 4 * 4096);
    ferry_moe_rows *rows;
    FT_ASSERT_OK(ferry_moe_rows_host(&g, &bank, dev, 2 * 4 * 4096, &rows));
    assert_int_equal(ferry_moe_rows_class(rows, 0), FERRY_MOE_PINNED);
    assert_int_equal(ferry_moe_rows_class(rows, 1), FERRY_MOE_PINNED);
    int c2 = ferry_moe_rows_class(rows, 2);
    assert_true(c2 == FERRY_MOE_LOCKED || c2 == FERRY_MOE_PAGEABLE);
    assert_int_equal(ferry_moe_rows_class(rows, 3), -EINVAL);
    ferry_moe_rows_destroy(rows);
    /* the pins are gone: pinning again works */
    FT_ASSERT_OK(ferry_device_pin(dev, bank, 4096));
    FT_ASSERT_OK(ferry_device_unpin(dev, bank));
    /* without a device nothing is pinned */
    FT_ASSERT_OK(ferry_moe_rows_host(&g, &bank, NULL, 0, &rows));
    assert_int_equal(ferry_moe_rows_class(rows, 0), FERRY_MOE_PAGEABLE);
    ferry_moe_rows_destroy(rows);
    free(bank);
    ferry_device_close(dev);
}

/* rows on NVMe: straight into slots through the I/O engine on the host
 * device, and staged through host memory for a device without read_file */
static void nvme_rows_land_in_their_slots(void **state)
{
    (void)state;
    char dir[256], path[300];
    ft_tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/experts.bin", dir);
    const uint32_t L = 2, E = 4;
    const size_t w0 = 4096, w1 = 8192;
    size_t total = (size_t)L * E * (w0 + w1);
    uint8_t *img = malloc(total);
    ft_fill_pattern(img, total, 7);
    int fd = open(path, O_CREAT | O_WRONLY | O_TRUNC, 0600);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, img, total), (ssize_t)total);
    close(fd);
    ferry_device *dev = host_dev();
    ferry_io_options io_o = FERRY_IO_OPTIONS_INIT;
    io_o.engine = "posix";
    io_o.device = dev;
    ferry_io *io;
    FT_ASSERT_OK(ferry_io_open(&io_o, &io));
    ferry_moe_geometry g = ft_moe_geom(L, E, 4, w0);
    g.banks = 2;
    g.row_bytes[1] = w1;
    ferry_moe_rows *rows;
    FT_ASSERT_OK(ferry_moe_rows_file(&g, io, path, NULL, &rows));
    assert_int_equal(ferry_moe_rows_class(rows, 1), FERRY_MOE_ON_FILE);

    uint32_t dst[] = {3, 0}, src[] = {2, 1};
    ferry_moe_copy_plan plan = {1, 2, dst, src};
    uint8_t *buf = malloc(w1);
    /* 1: the device slot backend reads the file into the slot */
    const ferry_moe_slot_device_ops *ops;
    void *ctx;
    ferry_moe_slots *s;
    FT_ASSERT_OK(ferry_moe_device_slots_open(dev, &g, &ops, &ctx));
    FT_ASSERT_OK(ferry_moe_slots_create(&g, ops, ctx, &s));
    assert_int_equal(ferry_moe_slots_apply(s, &plan, rows, NULL, NULL), 2);
    for (int i = 0; i < 2; i++) {
        size_t r = (size_t)1 * E + src[i];
        read_slot(dev, ctx, 0, dst[i], buf, w0);
        assert_memory_equal(buf, img + r * w0, w0);
        read_slot(dev, ctx, 1, dst[i], buf, w1);
        assert_memory_equal(buf, img + (size_t)L * E * w0 + r * w1, w1);
    }
    ferry_moe_slots_stats st = FERRY_MOE_SLOTS_STATS_INIT;
    ferry_moe_slots_stats_get(s, &st);
    assert_int_equal(st.host_bytes, 2 * (w0 + w1));
    ferry_moe_slots_destroy(s);
    /* 2: a device without read_file: staged */
    fake f;
    fake_init(&f, &g);
    FT_ASSERT_OK(ferry_moe_slots_create(&g, &fake_ops, &f, &s));
    assert_int_equal(ferry_moe_slots_apply(s, &plan, rows, NULL, NULL), 2);
    for (int i = 0; i < 2; i++) {
        size_t r = (size_t)1 * E + src[i];
        assert_memory_equal(f.mem[0] + dst[i] * w0, img + r * w0, w0);
        assert_memory_equal(f.mem[1] + dst[i] * w1, img + (size_t)L * E * w0 + r * w1, w1);
    }
    assert_int_equal(f.last_route, FERRY_MOE_ROUTE_PER_ROW);
    ferry_moe_slots_destroy(s);
    fake_fini(&f);
    ferry_moe_rows_destroy(rows);
    /* a file too short for the geometry */
    g.num_layers = 3;
    assert_int_equal(ferry_moe_rows_file(&g, io, path, NULL, &rows), FERRY_EMISMATCH);
    assert_non_null(strstr(ferry_last_error(), "experts.bin"));
    snprintf(path, sizeof path, "%s/none.bin", dir);
    assert_int_equal(ferry_moe_rows_file(&g, io, path, NULL, &rows), -ENOENT);
    free(buf);
    free(img);
    ferry_io_close(io);
    ferry_device_close(dev);
    ft_rmtree(dir);
}

/* an allocator that scribbles over what it frees and keeps it (freed at
 * the end): a use after free of ferry's own memory reads garbage, not the
 * old values */
static void *pz_held[4096];
static size_t pz_n;
static void *pz_malloc(size_t n, void *c) { (void)c; return malloc(n); }
static void *pz_calloc(size_t n, size_t m, void *c) { (void)c; return calloc(n, m); }
static void *pz_realloc(void *p, size_t n, void *c) { (void)c; return realloc(p, n); }
static void *pz_aligned(size_t a, size_t n, void *c)
{
    (void)c;
    void *p = NULL;
    return posix_memalign(&p, a, n ? n : 1) == 0 ? p : NULL;
}
static void pz_free(void *p, void *c)
{
    (void)c;
    if (!p)
        return;
    memset(p, 0xa5, malloc_usable_size(p));
    if (pz_n < sizeof pz_held / sizeof pz_held[0])
        pz_held[pz_n++] = p;
    else
        free(p);
}

/* the executor keeps nothing of the rows' engine: rows and engine may go
 * before the executor does */
static void an_executor_outlives_the_engine_of_its_staged_rows(void **state)
{
    (void)state;
    const ferry_allocator pz = {pz_malloc, pz_calloc, pz_realloc, pz_aligned, pz_free, NULL};
    ferry_set_allocator(&pz);
    char dir[256], path[300];
    ft_tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/experts.bin", dir);
    ferry_moe_geometry g = ft_moe_geom(1, 2, 2, 4096);
    uint8_t img[2 * 4096];
    ft_fill_pattern(img, sizeof img, 3);
    int fd = open(path, O_CREAT | O_WRONLY | O_TRUNC, 0600);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, img, sizeof img), (ssize_t)sizeof img);
    close(fd);
    ferry_io_options io_o = FERRY_IO_OPTIONS_INIT;
    io_o.engine = "posix";
    ferry_io *io;
    FT_ASSERT_OK(ferry_io_open(&io_o, &io));
    ferry_moe_rows *rows;
    FT_ASSERT_OK(ferry_moe_rows_file(&g, io, path, NULL, &rows));
    fake f;
    fake_init(&f, &g);
    ferry_moe_slots *s;
    FT_ASSERT_OK(ferry_moe_slots_create(&g, &fake_ops, &f, &s));
    uint32_t dst[] = {1}, src[] = {1};
    ferry_moe_copy_plan plan = {0, 1, dst, src};
    assert_int_equal(ferry_moe_slots_apply(s, &plan, rows, NULL, NULL), 1);
    assert_memory_equal(f.mem[0] + 4096, img + 4096, 4096);
    ferry_moe_rows_destroy(rows);
    ferry_io_close(io);
    ferry_moe_slots_destroy(s); /* touched the closed engine before */
    fake_fini(&f);
    ferry_set_allocator(NULL);
    while (pz_n)
        free(pz_held[--pz_n]);
    ft_rmtree(dir);
}

static int oom_slots(void *ctx)
{
    const ferry_moe_geometry *g = ctx;
    fake f;
    fake_init(&f, g);
    ferry_moe_slots *s = NULL;
    int rc = ferry_moe_slots_create(g, &fake_ops, &f, &s);
    ferry_moe_slots_destroy(s);
    fake_fini(&f);
    return rc;
}

static void count_destroy(void *ctx)
{
    ++*(int *)ctx;
}

static void out_of_memory_and_device_faults_leak_nothing(void **state)
{
    (void)state;
    ferry_moe_geometry g = ft_moe_geom(2, 4, 6, W);
    ft_oom_each(50, FT_OOM_STICKY, oom_slots, &g);
    /* the device refuses the arena: nothing is left allocated on it */
    ferry_device *dev = host_dev();
    FT_ASSERT_OK(ft_device_faults(dev, 1, -ENOMEM, 0, FERRY_FAULT_ALLOC));
    const ferry_moe_slot_device_ops *ops;
    void *ctx;
    assert_int_equal(ferry_moe_device_slots_open(dev, &g, &ops, &ctx), -ENOMEM);
    assert_non_null(strstr(ferry_last_error(), "bank 0"));
    FT_ASSERT_OK(ft_device_faults(dev, 0, 0, 0, 0));
    /* bad geometries */
    ferry_moe_geometry bad = g;
    bad.banks = 5;
    assert_int_equal(ferry_moe_device_slots_open(dev, &bad, &ops, &ctx), -EINVAL);
    bad = g;
    bad.row_bytes[0] = 0;
    assert_int_equal(ferry_moe_slots_create(&bad, &fake_ops, NULL, NULL), -EINVAL);
    ferry_moe_slot_device_ops no_flush = fake_ops;
    no_flush.flush = NULL;
    ferry_moe_slots *s;
    assert_int_equal(ferry_moe_slots_create(&g, &no_flush, NULL, &s), -EINVAL);
    /* an ops table of the wrong size is named as such, not as one
     * missing its functions */
    ferry_moe_slot_device_ops short_ops = fake_ops;
    short_ops.size = offsetof(ferry_moe_slot_device_ops, flush_prefetch);
    assert_int_equal(ferry_moe_slots_create(&g, &short_ops, NULL, &s), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "size"));
    /* the refused table's context is still destroyed when the table holds
     * destroy, and nothing past the size it declares is read when not */
    int destroyed = 0;
    short_ops.destroy = count_destroy;
    assert_int_equal(ferry_moe_slots_create(&g, &short_ops, &destroyed, &s), -EINVAL);
    assert_int_equal(destroyed, 1);
    short_ops.size = offsetof(ferry_moe_slot_device_ops, destroy);
    assert_int_equal(ferry_moe_slots_create(&g, &short_ops, &destroyed, &s), -EINVAL);
    assert_int_equal(destroyed, 1);
    ferry_device_close(dev);
}

/* prefetch: the planner brings the next layer's predicted experts in on
 * the device's prefetch stream while nothing waits; the executor refuses
 * other plans until it is finished; the experts then hit */
static void a_prefetch_overlaps_and_then_hits(void **state)
{
    (void)state;
    ferry_device *dev = host_dev();
    ferry_moe_geometry g = ft_moe_geom(2, 8, 10, W);
    named rows_mem;
    named_init(&rows_mem, 2, 8, W);
    ferry_moe_rows *rows;
    FT_ASSERT_OK(ferry_moe_rows_fn(&g, named_row, &rows_mem, &rows));
    const ferry_moe_slot_device_ops *ops;
    void *ctx;
    ferry_moe_slots *s;
    FT_ASSERT_OK(ferry_moe_device_slots_open(dev, &g, &ops, &ctx));
    FT_ASSERT_OK(ferry_moe_slots_create(&g, ops, ctx, &s));
    ferry_moe_planner_options o = FERRY_MOE_PLANNER_OPTIONS_INIT;
    o.num_layers = 2;
    o.num_experts = 8;
    o.slots = 10;
    o.policy = "routing";
    o.expert_bytes = W;
    ferry_moe_planner *p;
    FT_ASSERT_OK(ferry_moe_planner_create(&o, &p));
    uint32_t now[] = {0, 1, 2}, next[] = {5, 6, 7}, unknown[16], nu;
    ferry_moe_copy_plan plan;
    assert_int_equal(ferry_moe_planner_ensure(p, 0, now, 3, NULL, &plan, NULL), 3);
    assert_int_equal(ferry_moe_slots_apply(s, &plan, rows, unknown, &nu), 3);
    assert_int_equal(ferry_moe_planner_prefetch(p, 1, next, 3, &plan), 3);
    assert_int_equal(ferry_moe_slots_prefetch_start(s, &plan, rows, unknown, &nu), 3);
    /* pending: its slots are unknown until it is finished */
    assert_int_equal(ferry_moe_slots_occupant(s, plan.dst_slots[0]), FERRY_MOE_NONE);
    assert_int_equal(ferry_moe_slots_prefetch_finish(s, unknown, &nu), 3);
    assert_int_equal(ferry_moe_slots_prefetch_finish(s, unknown, &nu), 0);
    FT_ASSERT_OK(ferry_moe_check(p, s));
    /* a later apply (here a warm one) finishes a pending prefetch first */
    uint32_t r4[] = {4};
    assert_int_equal(ferry_moe_planner_prefetch(p, 1, r4, 1, &plan), 1);
    uint32_t pslot = plan.dst_slots[0];
    ferry_moe_copy_plan warm = {0, 0, r4, r4};
    assert_int_equal(ferry_moe_slots_prefetch_start(s, &plan, rows, unknown, &nu), 1);
    assert_int_equal(ferry_moe_slots_occupant(s, pslot), FERRY_MOE_NONE);
    assert_int_equal(ferry_moe_slots_apply(s, &warm, rows, unknown, &nu), 0);
    assert_int_equal(ferry_moe_slots_occupant(s, pslot), 8 + 4);
    assert_int_equal(ferry_moe_slots_prefetch_finish(s, unknown, &nu), 0);
    FT_ASSERT_OK(ferry_moe_check(p, s));
    ferry_moe_counts c;
    uint32_t used[] = {5, 6, 3};
    assert_int_equal(ferry_moe_planner_ensure(p, 1, used, 3, NULL, &plan, &c), 1);
    assert_int_equal(c.prefetch_hits, 2);
    assert_int_equal(ferry_moe_slots_apply(s, &plan, rows, unknown, &nu), 1);
    FT_ASSERT_OK(ferry_moe_check(p, s));
    uint8_t buf[W];
    for (int i = 0; i < 3; i++) {
        uint32_t slot = ferry_moe_planner_lookup(p, 1, used[i]);
        read_slot(dev, ctx, 0, slot, buf, W);
        assert_memory_equal(buf, rows_mem.rows + (size_t)(8 + used[i]) * W, W);
    }
    ferry_moe_slots_stats st = FERRY_MOE_SLOTS_STATS_INIT;
    ferry_moe_slots_stats_get(s, &st);
    assert_int_equal(st.prefetch_plans, 2);
    assert_int_equal(st.prefetch_rows, 4);
    assert_int_equal(st.prefetch_bytes, 4 * W);
    assert_int_equal(st.host_rows, 8);
    ferry_moe_planner_stats ps = FERRY_MOE_PLANNER_STATS_INIT;
    ferry_moe_planner_stats_get(p, &ps);
    assert_int_equal(ps.prefetch_bytes, 4 * W);
    ferry_moe_planner_destroy(p);
    ferry_moe_slots_destroy(s);

    /* a prefetch whose stream fails: every slot of it is unknown */
    fake f;
    fake_init(&f, &g);
    FT_ASSERT_OK(ferry_moe_slots_create(&g, &fake_ops2, &f, &s));
    FT_ASSERT_OK(ferry_moe_planner_create(&o, &p));
    assert_int_equal(ferry_moe_planner_ensure(p, 0, now, 3, NULL, &plan, NULL), 3);
    assert_int_equal(ferry_moe_slots_apply(s, &plan, rows, unknown, &nu), 3);
    assert_int_equal(ferry_moe_planner_prefetch(p, 1, next, 3, &plan), 3);
    assert_int_equal(ferry_moe_slots_prefetch_start(s, &plan, rows, unknown, &nu), 3);
    assert_int_equal(f.prefetch_routes, 1);
    f.fail_pflush_at = 1;
    /* the apply that finishes it reports the prefetch's slots and applies
     * nothing of its own plan */
    uint32_t u4[] = {4};
    ferry_moe_copy_plan mine = {0, 1, u4, u4};
    uint32_t before = ferry_moe_slots_occupant(s, 4);
    assert_int_equal(ferry_moe_slots_apply(s, &mine, rows, unknown, &nu), -EIO);
    assert_non_null(strstr(ferry_last_error(), "not applied"));
    assert_int_equal(ferry_moe_slots_occupant(s, 4), before);
    assert_int_equal(nu, 3);
    for (uint32_t i = 0; i < nu; i++)
        FT_ASSERT_OK(ferry_moe_planner_forget(p, unknown[i]));
    FT_ASSERT_OK(ferry_moe_check(p, s));
    assert_int_equal(ferry_moe_slots_prefetch_finish(s, unknown, &nu), 0);
    ferry_moe_planner_stats_get(p, &ps);
    assert_int_equal(ps.prefetch_wasted, 3);
    assert_int_equal(ps.prefetch_wasted_bytes, 3 * W);
    ferry_moe_planner_destroy(p);
    ferry_moe_slots_destroy(s);
    fake_fini(&f);

    /* a one-stream device completes a prefetch in its start call */
    fake_init(&f, &g);
    FT_ASSERT_OK(ferry_moe_slots_create(&g, &fake_ops, &f, &s));
    uint32_t d[] = {4}, r[] = {2};
    ferry_moe_copy_plan one = {1, 1, d, r};
    assert_int_equal(ferry_moe_slots_prefetch_start(s, &one, rows, unknown, &nu), 1);
    assert_int_equal(ferry_moe_slots_occupant(s, 4), 8 + 2);
    assert_int_equal(ferry_moe_slots_prefetch_finish(s, unknown, &nu), 0);
    assert_int_equal(f.flushes, 1);
    ferry_moe_slots_destroy(s);
    fake_fini(&f);
    ferry_moe_rows_destroy(rows);
    free(rows_mem.rows);
    ferry_device_close(dev);
}

/* eight banks (gate, up and down weights, their scales, two more) of eight
 * widths, from host memory and from a file packed bank after bank: every
 * bank of every slot holds its own row */
static void eight_banks_land_whole(void **state)
{
    (void)state;
    enum { NB = FERRY_MOE_MAX_BANKS };
    const uint32_t L = 2, E = 4;
    ferry_moe_geometry g = ft_moe_geom(L, E, 4, 64);
    g.banks = NB;
    size_t off[NB], total = 0;
    for (int b = 0; b < NB; b++) {
        g.row_bytes[b] = 64 * (size_t)(b + 1) + (b & 1 ? 4096 : 0);
        off[b] = total;
        total += (size_t)L * E * g.row_bytes[b];
    }
    uint8_t *img = malloc(total);
    assert_non_null(img);
    ft_fill_pattern(img, total, 11);
    void *base[NB];
    for (int b = 0; b < NB; b++)
        base[b] = img + off[b];
    char dir[256], path[300];
    ft_tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/banks8.bin", dir);
    int fd = open(path, O_CREAT | O_WRONLY | O_TRUNC, 0600);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, img, total), (ssize_t)total);
    close(fd);
    ferry_device *dev = host_dev();
    ferry_io_options io_o = FERRY_IO_OPTIONS_INIT;
    io_o.engine = "posix";
    io_o.device = dev;
    ferry_io *io;
    FT_ASSERT_OK(ferry_io_open(&io_o, &io));
    ferry_moe_rows *src[2];
    FT_ASSERT_OK(ferry_moe_rows_host(&g, base, NULL, 0, &src[0]));
    FT_ASSERT_OK(ferry_moe_rows_file(&g, io, path, NULL, &src[1]));
    uint8_t *buf = malloc(g.row_bytes[NB - 1]);
    for (int k = 0; k < 2; k++) {
        const ferry_moe_slot_device_ops *ops;
        void *ctx;
        ferry_moe_slots *s;
        FT_ASSERT_OK(ferry_moe_device_slots_open(dev, &g, &ops, &ctx));
        FT_ASSERT_OK(ferry_moe_slots_create(&g, ops, ctx, &s));
        uint32_t dst[] = {2, 0, 3}, rowi[] = {3, 1, 0};
        ferry_moe_copy_plan plan = {1, 3, dst, rowi};
        assert_int_equal(ferry_moe_slots_apply(s, &plan, src[k], NULL, NULL), 3);
        for (int i = 0; i < 3; i++)
            for (int b = 0; b < NB; b++) {
                size_t w = g.row_bytes[b];
                read_slot(dev, ctx, (uint32_t)b, dst[i], buf, w);
                assert_memory_equal(buf, img + off[b] + ((size_t)1 * E + rowi[i]) * w, w);
            }
        ferry_moe_slots_destroy(s);
    }
    free(buf);
    ferry_moe_rows_destroy(src[0]);
    ferry_moe_rows_destroy(src[1]);
    ferry_io_close(io);
    ferry_device_close(dev);
    ft_rmtree(dir);
    free(img);
}

/* a checkpoint's layout, rows through an offset table: a header, then per
 * expert its three banks side by side ([layer][expert][bank]), the
 * transpose of the packed layout; every byte lands, and a table that
 * points past the file or past INT64_MAX is refused */
static void rows_read_through_an_offset_table(void **state)
{
    (void)state;
    enum { NB = 3 };
    const uint32_t L = 2, E = 3;
    ferry_moe_geometry g = ft_moe_geom(L, E, 4, 96);
    g.banks = NB;
    g.row_bytes[1] = 160;
    g.row_bytes[2] = 64;
    size_t per = g.row_bytes[0] + g.row_bytes[1] + g.row_bytes[2], hdr = 1000;
    size_t total = hdr + (size_t)L * E * per;
    uint8_t *img = malloc(total);
    assert_non_null(img);
    ft_fill_pattern(img, total, 5);
    uint64_t table[NB * 2 * 3];
    for (uint32_t l = 0; l < L; l++)
        for (uint32_t e = 0; e < E; e++) {
            uint64_t at = hdr + ((uint64_t)l * E + e) * per;
            for (uint32_t b = 0; b < NB; b++) {
                table[(b * L + l) * E + e] = at;
                at += g.row_bytes[b];
            }
        }
    char dir[256], path[300];
    ft_tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/ckpt.bin", dir);
    int fd = open(path, O_CREAT | O_WRONLY | O_TRUNC, 0600);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, img, total), (ssize_t)total);
    close(fd);
    ferry_device *dev = host_dev();
    ferry_io_options io_o = FERRY_IO_OPTIONS_INIT;
    io_o.engine = "posix";
    io_o.device = dev;
    ferry_io *io;
    FT_ASSERT_OK(ferry_io_open(&io_o, &io));
    ferry_moe_rows *rows;
    FT_ASSERT_OK(ferry_moe_rows_file_table(&g, io, path, table, &rows));
    const ferry_moe_slot_device_ops *ops;
    void *ctx;
    ferry_moe_slots *s;
    FT_ASSERT_OK(ferry_moe_device_slots_open(dev, &g, &ops, &ctx));
    FT_ASSERT_OK(ferry_moe_slots_create(&g, ops, ctx, &s));
    uint32_t dst[] = {1, 3, 0}, src[] = {2, 0, 1};
    ferry_moe_copy_plan plan = {1, 3, dst, src};
    assert_int_equal(ferry_moe_slots_apply(s, &plan, rows, NULL, NULL), 3);
    uint8_t buf[160];
    for (int i = 0; i < 3; i++)
        for (uint32_t b = 0; b < NB; b++) {
            read_slot(dev, ctx, b, dst[i], buf, g.row_bytes[b]);
            assert_memory_equal(buf, img + table[(b * L + 1) * E + src[i]], g.row_bytes[b]);
        }
    ferry_moe_slots_destroy(s);
    ferry_moe_rows_destroy(rows);
    /* the last row one byte past the end */
    uint64_t keep = table[NB * L * E - 1];
    table[NB * L * E - 1] = total - g.row_bytes[2] + 1;
    assert_int_equal(ferry_moe_rows_file_table(&g, io, path, table, &rows), FERRY_EMISMATCH);
    assert_non_null(strstr(ferry_last_error(), "ckpt.bin"));
    table[NB * L * E - 1] = (uint64_t)INT64_MAX;
    assert_int_equal(ferry_moe_rows_file_table(&g, io, path, table, &rows), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "row_off[17] (bank 2, layer 1, expert 2)"));
    table[NB * L * E - 1] = keep;
    assert_int_equal(ferry_moe_rows_file_table(&g, io, path, NULL, &rows), -EINVAL);
    ferry_io_close(io);
    ferry_device_close(dev);
    ft_rmtree(dir);
    free(img);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(geometries_are_range_checked),
        cmocka_unit_test(a_slot_pair_copies_the_way_the_caller_asked),
        cmocka_unit_test(a_plan_lands_each_expert_in_the_slot_it_named),
        cmocka_unit_test(a_warm_step_makes_no_device_call),
        cmocka_unit_test(invalid_plans_are_refused_before_any_byte_moves),
        cmocka_unit_test(failures_leave_planner_and_executor_agreeing),
        cmocka_unit_test(a_faulty_device_never_desynchronises_the_pool),
        cmocka_unit_test(a_pin_budget_splits_layers_into_classes),
        cmocka_unit_test(nvme_rows_land_in_their_slots),
        cmocka_unit_test(an_executor_outlives_the_engine_of_its_staged_rows),
        cmocka_unit_test(out_of_memory_and_device_faults_leak_nothing),
        cmocka_unit_test(a_prefetch_overlaps_and_then_hits),
        cmocka_unit_test(eight_banks_land_whole),
        cmocka_unit_test(rows_read_through_an_offset_table),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
