/*
 * slots.c - the executor (ferrox's ExpertSlots): applies copy and gather
 * plans to a slot device and knows which expert each slot holds.
 *
 * Invariant: occupant[s] names an expert only when every bank of slot s is
 * known to hold that expert's row - the copy landed and the device said so
 * (flush returned 0). So:
 *  - a plan is validated WHOLE before the first byte moves: a plan that
 *    would fail half-way because of its own content never starts;
 *  - an empty plan is a warm step: no device call at all (the zero-copy
 *    fast path decode steps take once the cache is warm);
 *  - an occupant is cleared before its slot's first write and set only
 *    after the plan's flush: a batching device cannot say which copies
 *    landed when flush fails, so a failed flush leaves EVERY slot of the
 *    plan unknown, and a failed write leaves that slot and the plan's later
 *    ones unknown (the earlier ones count only if a flush then succeeds).
 * The slots left unknown are handed back so the caller can make the
 * planner forget them; ferry_moe_check() then finds both sides agreeing.
 * Bytes are billed by where they came from: host (or file) rows cross the
 * link, slot-to-slot gathers stay on the device.
 */
#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "moe/moe_internal.h"
#include "sized.h"

struct ferry_moe_slots {
    ferry__errbuf err;
    ferry_moe_geometry g;
    const ferry_moe_slot_device_ops *ops; /* &ops_own */
    /* the caller's table copied: it may live on a stack frame that ends
     * once the executor is made */
    ferry_moe_slot_device_ops ops_own;
    void *ctx;
    uint32_t *occupant;
    uint32_t *stamp;     /* per slot: gen of the plan that named it */
    uint32_t gen;
    size_t row_total;    /* sum of row_bytes over banks */
    /* one row, for file rows without read_file: the executor's own
     * memory, so it outlives no engine (the rows source's may be closed
     * before the executor is destroyed) */
    void *staging;
    size_t staging_len;
    int pending;         /* a prefetch plan is in flight */
    uint32_t pend_layer, pend_n;
    uint32_t *pend_dst, *pend_row; /* slots each */
    ferry_moe_slots_stats st;
    /* the reader: a thread of the executor's own that reads a file-backed
     * prefetch while the caller computes; it touches only the device
     * context, the staging row and the fields below while pend_async is
     * set, and the caller touches none of those until it has waited */
    pthread_t reader;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int reader_up, reader_quit, pend_async, job, job_done, job_rc;
    const ferry_moe_rows *job_rows;
    char job_err[FERRY__ERRMSG_MAX];
};

int ferry__geometry_check(const ferry_moe_geometry *g, const char *what, int need_slots)
{
    if (!g)
        return ferry__err_set(NULL, -EINVAL, "moe %s: geometry missing", what);
    static const ferry__sized sized =
        FERRY__SIZED0(ferry_moe_geometry, FERRY_MOE_GEOMETRY_MIN_SIZE);
    char who[64];
    snprintf(who, sizeof who, "moe %s", what);
    int rc = ferry__opts_size_ok(NULL, who, &sized, g->size);
    if (rc < 0)
        return rc;
    /* every field in range, and every product of them that is used as a
     * size or offset checked, before anything is sized by them */
    if (!g->num_layers || g->num_layers > FERRY_MOE_MAX_LAYERS)
        return ferry__err_set(NULL, -EINVAL, "moe %s: num_layers %u: accepted 1..%u", what,
                              g->num_layers, FERRY_MOE_MAX_LAYERS);
    if (!g->num_experts || g->num_experts > FERRY_MOE_MAX_EXPERTS)
        return ferry__err_set(NULL, -EINVAL, "moe %s: num_experts %u: accepted 1..%u", what,
                              g->num_experts, FERRY_MOE_MAX_EXPERTS);
    if (need_slots && (!g->slots || g->slots > FERRY_MOE_MAX_SLOTS))
        return ferry__err_set(NULL, -EINVAL, "moe %s: slots %u: accepted 1..%u", what, g->slots,
                              FERRY_MOE_MAX_SLOTS);
    if (g->banks < 1 || g->banks > FERRY_MOE_MAX_BANKS)
        return ferry__err_set(NULL, -EINVAL, "moe %s: banks %u: accepted 1..%d", what, g->banks,
                              FERRY_MOE_MAX_BANKS);
    uint64_t rows = (uint64_t)g->num_layers * g->num_experts; /* <= 2^24 */
    /* sizes are size_t in memory and signed 64-bit as file offsets */
    const uint64_t cap = (uint64_t)SIZE_MAX < (uint64_t)INT64_MAX ? (uint64_t)SIZE_MAX
                                                                  : (uint64_t)INT64_MAX;
    for (uint32_t b = 0; b < g->banks; b++) {
        uint64_t rb = g->row_bytes[b], bank, pool;
        if (!rb || rb > FERRY_MOE_MAX_ROW_BYTES)
            return ferry__err_set(NULL, -EINVAL,
                                  "moe %s: row_bytes[%u] %llu: accepted 1..%llu", what, b,
                                  (unsigned long long)rb,
                                  (unsigned long long)FERRY_MOE_MAX_ROW_BYTES);
        /* a whole bank (host memory, or a stretch of the rows file) */
        if (__builtin_mul_overflow(rows, rb, &bank) || bank > cap)
            return ferry__err_set(NULL, -EINVAL,
                                  "moe %s: num_layers %u x num_experts %u x row_bytes[%u] %llu "
                                  "overflows; accepted: a bank of at most %llu bytes",
                                  what, g->num_layers, g->num_experts, b, (unsigned long long)rb,
                                  (unsigned long long)cap);
        /* a device slot arena: rows at a 256-byte pitch */
        uint64_t pitch = (rb + 255) & ~(uint64_t)255;
        if (need_slots && (__builtin_mul_overflow((uint64_t)g->slots, pitch, &pool) || pool > cap))
            return ferry__err_set(NULL, -EINVAL,
                                  "moe %s: slots %u x row_bytes[%u] %llu overflows; accepted: "
                                  "an arena of at most %llu bytes",
                                  what, g->slots, b, (unsigned long long)rb,
                                  (unsigned long long)cap);
    }
    return 0;
}

int ferry_moe_slots_create(const ferry_moe_geometry *g, const ferry_moe_slot_device_ops *ops,
                           void *ctx, ferry_moe_slots **out)
{
    int rc = ferry__geometry_check(g, "slots", 1);
    if (rc == 0 && ops && ops->size < sizeof(ferry_moe_slot_device_ops))
        rc = ferry__err_set(NULL, -EINVAL,
                            "moe slots: ferry_moe_slot_device_ops size %zu is not accepted: "
                            "accepted %zu (its sizeof here) or more",
                            ops->size, sizeof(ferry_moe_slot_device_ops));
    if (rc == 0 && (!ops || !out))
        rc = ferry__err_set(NULL, -EINVAL, "moe slots: no %s", ops ? "out" : "device ops");
    if (rc == 0 && (!ops->write_slot || !ops->copy_slot || !ops->flush))
        rc = ferry__err_set(NULL, -EINVAL,
                            "moe slots: device ops have no %s (write_slot, copy_slot and flush "
                            "are required)",
                            !ops->write_slot ? "write_slot" : !ops->copy_slot ? "copy_slot" : "flush");
    ferry_moe_slots *s = NULL;
    if (rc == 0) {
        s = ferry__calloc(1, sizeof *s);
        if (s) {
            s->occupant = ferry__malloc((size_t)g->slots * sizeof *s->occupant);
            s->stamp = ferry__calloc(g->slots, sizeof *s->stamp);
            s->pend_dst = ferry__malloc((size_t)g->slots * sizeof *s->pend_dst);
            s->pend_row = ferry__malloc((size_t)g->slots * sizeof *s->pend_row);
        }
        if (!s || !s->occupant || !s->stamp || !s->pend_dst || !s->pend_row)
            rc = ferry__err_set(NULL, -ENOMEM, "moe slots: out of memory for %u slots", g->slots);
    }
    if (rc < 0) {
        if (s) {
            ferry__free(s->occupant);
            ferry__free(s->stamp);
            ferry__free(s->pend_dst);
            ferry__free(s->pend_row);
            ferry__free(s);
        }
        /* a table too short to hold destroy has none: read nothing past
         * the size it declares */
        if (ops && ops->size >= offsetof(ferry_moe_slot_device_ops, destroy) + sizeof ops->destroy &&
            ops->destroy && ctx)
            ops->destroy(ctx);
        return rc;
    }
    s->g = *g;
    s->ops_own = *ops; /* this header's members: ops->size covers them */
    s->ops_own.size = sizeof s->ops_own;
    s->ops = &s->ops_own;
    s->ctx = ctx;
    memset(s->occupant, 0xff, (size_t)g->slots * sizeof *s->occupant);
    for (uint32_t b = 0; b < g->banks; b++)
        s->row_total += g->row_bytes[b];
    *out = s;
    return 0;
}

/* ---- the reader thread (file-backed prefetches) ---- */
static int write_row(ferry_moe_slots *s, const ferry_moe_rows *rows, uint32_t b, uint32_t layer,
                     uint32_t row, uint32_t slot);

/* the pending plan's rows, then its stream: 0 or the first failure */
static int read_pending(ferry_moe_slots *s, const ferry_moe_rows *rows)
{
    int rc = 0;
    for (uint32_t i = 0; i < s->pend_n && rc == 0; i++)
        for (uint32_t b = 0; b < s->g.banks && rc == 0; b++)
            rc = write_row(s, rows, b, s->pend_layer, s->pend_row[i], s->pend_dst[i]);
    int frc = s->ops->flush_prefetch ? s->ops->flush_prefetch(s->ctx) : s->ops->flush(s->ctx);
    return rc < 0 ? rc : frc;
}

static void *reader_main(void *arg)
{
    ferry_moe_slots *s = arg;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (!s->job && !s->reader_quit)
            pthread_cond_wait(&s->cv, &s->mu);
        if (!s->job)
            break;
        const ferry_moe_rows *rows = s->job_rows;
        pthread_mutex_unlock(&s->mu);
        int rc = read_pending(s, rows);
        char err[FERRY__ERRMSG_MAX] = "";
        if (rc < 0)
            snprintf(err, sizeof err, "%s", ferry_last_error());
        pthread_mutex_lock(&s->mu);
        s->job_rc = rc;
        memcpy(s->job_err, err, sizeof err);
        s->job = 0;
        s->job_done = 1;
        pthread_cond_broadcast(&s->cv);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

static int reader_start(ferry_moe_slots *s)
{
    if (s->reader_up)
        return 0;
    if (pthread_mutex_init(&s->mu, NULL) != 0)
        return -ENOMEM;
    if (ferry__cond_init_mono(&s->cv) != 0) {
        pthread_mutex_destroy(&s->mu);
        return -ENOMEM;
    }
    s->reader_quit = 0;
    int e = pthread_create(&s->reader, NULL, reader_main, s);
    if (e != 0) {
        pthread_cond_destroy(&s->cv);
        pthread_mutex_destroy(&s->mu);
        return -e;
    }
    s->reader_up = 1;
    return 0;
}

/* wait for the reader's job: its rc (a message recorded on failure) */
static int reader_wait(ferry_moe_slots *s)
{
    pthread_mutex_lock(&s->mu);
    while (!s->job_done)
        pthread_cond_wait(&s->cv, &s->mu);
    s->job_done = 0;
    int rc = s->job_rc;
    char err[FERRY__ERRMSG_MAX];
    memcpy(err, s->job_err, sizeof err);
    pthread_mutex_unlock(&s->mu);
    s->pend_async = 0;
    if (rc < 0)
        ferry__err_set(NULL, rc, "%s", err);
    return rc;
}

static void reader_stop(ferry_moe_slots *s)
{
    if (!s->reader_up)
        return;
    if (s->pend_async)
        (void)reader_wait(s);
    pthread_mutex_lock(&s->mu);
    s->reader_quit = 1;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->reader, NULL);
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->mu);
    s->reader_up = 0;
}

void ferry_moe_slots_destroy(ferry_moe_slots *s)
{
    if (!s)
        return;
    reader_stop(s); /* a read in flight lands first */
    if (s->pending && s->ops->flush_prefetch)
        (void)s->ops->flush_prefetch(s->ctx); /* its buffers must not be freed under it */
    ferry__free(s->staging);
    if (s->ops->destroy && s->ctx)
        s->ops->destroy(s->ctx);
    ferry__free(s->occupant);
    ferry__free(s->stamp);
    ferry__free(s->pend_dst);
    ferry__free(s->pend_row);
    ferry__free(s);
}

const char *ferry_moe_slots_last_error(const ferry_moe_slots *s)
{
    return s ? ferry__err_msg(&s->err) : "";
}

void *ferry_moe_slots_device(const ferry_moe_slots *s)
{
    return s ? s->ctx : NULL;
}

uint32_t ferry_moe_slots_occupant(const ferry_moe_slots *s, uint32_t slot)
{
    return s && slot < s->g.slots ? s->occupant[slot] : FERRY_MOE_NONE;
}

int ferry_moe_slots_invalidate(ferry_moe_slots *s, uint32_t slot)
{
    if (!s || slot >= s->g.slots)
        return ferry__err_set(s ? &s->err : NULL, -EINVAL, "moe slots: slot %u out of range (%u)",
                              slot, s ? s->g.slots : 0);
    s->occupant[slot] = FERRY_MOE_NONE;
    return 0;
}

int ferry_moe_slots_stats_get(const ferry_moe_slots *s, ferry_moe_slots_stats *out)
{
    if (!s || !out)
        return ferry__err_set(NULL, -EINVAL, "ferry_moe_slots_stats_get: executor or out is NULL");
    ferry_moe_slots_stats v = s->st;
    v.size = sizeof v;
    return ferry__stats_put(NULL, "ferry_moe_slots_stats_get", out, &v, sizeof v);
}

/* a fresh generation for duplicate detection */
static uint32_t next_gen(ferry_moe_slots *s)
{
    if (++s->gen == 0) {
        memset(s->stamp, 0, (size_t)s->g.slots * sizeof *s->stamp);
        s->gen = 1;
    }
    return s->gen;
}

static void report_unknown(const uint32_t *slots, uint32_t from, uint32_t to, uint32_t *unknown_out,
                           uint32_t *n_unknown)
{
    uint32_t k = n_unknown ? *n_unknown : 0;
    for (uint32_t i = from; i < to; i++)
        if (unknown_out)
            unknown_out[k++] = slots[i];
        else
            k++;
    if (n_unknown)
        *n_unknown = k;
}

static int validate_copy(ferry_moe_slots *s, const ferry_moe_copy_plan *plan,
                         const ferry_moe_rows *rows)
{
    const ferry_moe_geometry *g = &s->g;
    if (plan->layer >= g->num_layers)
        return ferry__err_set(&s->err, -EINVAL, "moe apply: layer %u out of range (%u layers)",
                              plan->layer, g->num_layers);
    if (!plan->dst_slots || !plan->src_rows)
        return ferry__err_set(&s->err, -EINVAL, "moe apply: plan of %u rows without arrays",
                              plan->n);
    if (!rows)
        return ferry__err_set(&s->err, -EINVAL, "moe apply: layer %u: no rows source", plan->layer);
    if (rows->g.banks != g->banks)
        return ferry__err_set(&s->err, FERRY_EMISMATCH,
                              "moe apply: rows source has %u banks, slots have %u", rows->g.banks,
                              g->banks);
    uint32_t gen = next_gen(s);
    for (uint32_t i = 0; i < plan->n; i++) {
        uint32_t d = plan->dst_slots[i], r = plan->src_rows[i];
        if (d >= g->slots)
            return ferry__err_set(&s->err, -EINVAL, "moe apply: entry %u: slot %u out of range (%u)",
                                  i, d, g->slots);
        if (s->stamp[d] == gen)
            return ferry__err_set(&s->err, -EINVAL,
                                  "moe apply: layer %u: slot %u is written twice by one plan",
                                  plan->layer, d);
        s->stamp[d] = gen;
        if (r >= g->num_experts)
            return ferry__err_set(&s->err, -EINVAL,
                                  "moe apply: entry %u: row %u out of range (%u experts)", i, r,
                                  g->num_experts);
        for (uint32_t b = 0; b < g->banks; b++) {
            if (rows->ops->file_row) {
                ferry_io *io;
                ferry_file *f;
                uint64_t off;
                if (rows->ops->file_row(rows, b, plan->layer, r, &io, &f, &off) < 0)
                    return ferry__err_set(&s->err, -EINVAL,
                                          "moe apply: layer %u row %u bank %u: not in the file",
                                          plan->layer, r, b);
                if (rows->g.row_bytes[b] != g->row_bytes[b])
                    return ferry__err_set(&s->err, FERRY_EMISMATCH,
                                          "moe apply: bank %u: file rows are %zu bytes, slots %zu", b,
                                          rows->g.row_bytes[b], g->row_bytes[b]);
                continue;
            }
            size_t len = 0;
            const void *p = rows->ops->host_row(rows, b, plan->layer, r, &len);
            if (!p)
                return ferry__err_set(&s->err, -EINVAL,
                                      "moe apply: layer %u row %u bank %u: no such row", plan->layer,
                                      r, b);
            if (len != g->row_bytes[b])
                return ferry__err_set(&s->err, FERRY_EMISMATCH,
                                      "moe apply: layer %u row %u bank %u is %zu bytes, the bank's "
                                      "width is %zu",
                                      plan->layer, r, b, len, g->row_bytes[b]);
        }
    }
    return 0;
}

/* one bank of one row into its slot */
static int write_row(ferry_moe_slots *s, const ferry_moe_rows *rows, uint32_t b, uint32_t layer,
                     uint32_t row, uint32_t slot)
{
    size_t n = s->g.row_bytes[b];
    if (!rows->ops->file_row) {
        size_t len;
        const void *p = rows->ops->host_row(rows, b, layer, row, &len);
        return s->ops->write_slot(s->ctx, b, slot, p, n);
    }
    ferry_io *io;
    ferry_file *f;
    uint64_t off;
    int rc = rows->ops->file_row(rows, b, layer, row, &io, &f, &off);
    if (rc < 0)
        return rc;
    if (s->ops->read_file)
        return s->ops->read_file(s->ctx, b, slot, io, f, off, n);
    /* stage through one aligned host row; the device may copy it
     * asynchronously, so flush before the buffer is reused */
    size_t need = FERRY__ALIGN_UP(n, (size_t)FERRY_IO_ALIGN);
    if (s->staging_len < need) {
        ferry__free(s->staging);
        s->staging_len = 0;
        s->staging = ferry__aligned_alloc(FERRY_IO_ALIGN, need);
        if (!s->staging)
            return ferry__err_set(NULL, -ENOMEM, "moe apply: out of memory for a %zu-byte "
                                  "staging row", need);
        s->staging_len = need;
    }
    rc = ferry_io_pread(io, f, s->staging, n, off);
    if (rc < 0)
        return rc;
    rc = s->ops->write_slot(s->ctx, b, slot, s->staging, n);
    if (rc == 0)
        rc = s->ops->flush(s->ctx);
    return rc;
}

/* a later plan finishes the pending prefetch first (its slots may be the
 * ones the plan names); when it did not land, its slots are reported
 * unknown and the plan is not applied */
static int finish_pending(ferry_moe_slots *s, const char *what, uint32_t *unknown_out,
                          uint32_t *n_unknown)
{
    if (!s->pending)
        return 0;
    uint32_t n = s->pend_n, layer = s->pend_layer;
    int rc = ferry_moe_slots_prefetch_finish(s, unknown_out, n_unknown);
    if (rc >= 0)
        return 0;
    char cause[FERRY__ERRMSG_MAX];
    snprintf(cause, sizeof cause, "%s", ferry_last_error());
    return ferry__err_set(&s->err, rc,
                          "moe %s: not applied: the pending prefetch of %u rows (layer %u) it "
                          "finished first failed: %s",
                          what, n, layer, cause);
}

static int apply_plan(ferry_moe_slots *s, const ferry_moe_copy_plan *plan,
                      const ferry_moe_rows *rows, uint32_t *unknown_out, uint32_t *n_unknown,
                      int prefetch);

int ferry_moe_slots_apply(ferry_moe_slots *s, const ferry_moe_copy_plan *plan,
                          const ferry_moe_rows *rows, uint32_t *unknown_out, uint32_t *n_unknown)
{
    return apply_plan(s, plan, rows, unknown_out, n_unknown, 0);
}

int ferry_moe_slots_prefetch_start(ferry_moe_slots *s, const ferry_moe_copy_plan *plan,
                                   const ferry_moe_rows *rows, uint32_t *unknown_out,
                                   uint32_t *n_unknown)
{
    return apply_plan(s, plan, rows, unknown_out, n_unknown, 1);
}

int ferry_moe_slots_prefetch_finish(ferry_moe_slots *s, uint32_t *unknown_out, uint32_t *n_unknown)
{
    if (n_unknown)
        *n_unknown = 0;
    if (!s)
        return ferry__err_set(NULL, -EINVAL, "moe prefetch finish: no slots");
    if (!s->pending)
        return 0;
    s->pending = 0;
    int rc = s->pend_async ? reader_wait(s) : s->ops->flush_prefetch(s->ctx);
    if (rc < 0) {
        char cause[FERRY__ERRMSG_MAX];
        snprintf(cause, sizeof cause, "%s", ferry_last_error());
        s->st.failed_flushes++;
        report_unknown(s->pend_dst, 0, s->pend_n, unknown_out, n_unknown);
        return ferry__err_set(&s->err, rc,
                              "moe prefetch: layer %u: %u rows did not land, every slot of the "
                              "plan is unknown: %s",
                              s->pend_layer, s->pend_n, cause);
    }
    for (uint32_t i = 0; i < s->pend_n; i++) {
        /* cleared before its first write, set only now that it landed */
        FERRY__ASSERT(s->pend_dst[i] < s->g.slots && s->occupant[s->pend_dst[i]] == FERRY_MOE_NONE);
        s->occupant[s->pend_dst[i]] = s->pend_layer * s->g.num_experts + s->pend_row[i];
    }
    s->st.host_rows += s->pend_n;
    s->st.host_bytes += (uint64_t)s->pend_n * s->row_total;
    s->st.prefetch_rows += s->pend_n;
    s->st.prefetch_bytes += (uint64_t)s->pend_n * s->row_total;
    return (int)s->pend_n;
}

/* a validated prefetch of file rows: pending, its reads on the reader */
static int hand_to_reader(ferry_moe_slots *s, const ferry_moe_copy_plan *plan,
                          const ferry_moe_rows *rows)
{
    for (uint32_t k = 0; k < plan->n; k++)
        s->occupant[plan->dst_slots[k]] = FERRY_MOE_NONE;
    memcpy(s->pend_dst, plan->dst_slots, (size_t)plan->n * sizeof *s->pend_dst);
    memcpy(s->pend_row, plan->src_rows, (size_t)plan->n * sizeof *s->pend_row);
    s->pend_n = plan->n;
    s->pend_layer = plan->layer;
    s->pending = 1;
    s->pend_async = 1;
    pthread_mutex_lock(&s->mu);
    s->job_rows = rows;
    s->job = 1;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    return (int)plan->n;
}

static int apply_plan(ferry_moe_slots *s, const ferry_moe_copy_plan *plan,
                      const ferry_moe_rows *rows, uint32_t *unknown_out, uint32_t *n_unknown,
                      int prefetch)
{
    const char *what = prefetch ? "prefetch" : "apply";
    if (n_unknown)
        *n_unknown = 0;
    if (!s || !plan)
        return ferry__err_set(s ? &s->err : NULL, -EINVAL, "moe %s: no slots or plan", what);
    int rc = finish_pending(s, what, unknown_out, n_unknown);
    if (rc < 0)
        return rc;
    if (plan->n == 0) {
        s->st.plans++;
        s->st.warm_plans++;
        return 0;
    }
    rc = validate_copy(s, plan, rows);
    if (rc < 0)
        return rc;
    int route = FERRY_MOE_ROUTE_PER_ROW;
    if (rows->ops->klass && rows->ops->klass(rows, plan->layer) == FERRY_MOE_PAGEABLE)
        route = FERRY_MOE_ROUTE_WHOLE_LAYER_PAGEABLE;
    int async = prefetch && s->ops->flush_prefetch;
    if (async)
        route = FERRY_MOE_ROUTE_PREFETCH;
    /* rows on a file: the reads themselves are what takes time, so they
     * run on the executor's reader thread and land while the caller
     * computes (a device of one stream, too: then prefetch_finish flushes) */
    int on_file = prefetch && rows->ops->file_row != NULL;
    if (on_file && (rc = reader_start(s)) < 0)
        return ferry__err_set(&s->err, rc, "moe prefetch: layer %u: no reader thread: %s",
                              plan->layer, ferry_strerror(rc));
    if (on_file)
        route = s->ops->flush_prefetch ? FERRY_MOE_ROUTE_PREFETCH : route;
    if (s->ops->begin_plan && (rc = s->ops->begin_plan(s->ctx, route)) < 0)
        return ferry__err_set(&s->err, rc, "moe apply: layer %u: device refused the plan: %s",
                              plan->layer, ferry_last_error());
    s->st.plans++;
    if (prefetch)
        s->st.prefetch_plans++;
    if (on_file)
        return hand_to_reader(s, plan, rows);
    uint32_t i;
    for (i = 0; i < plan->n; i++) {
        uint32_t d = plan->dst_slots[i];
        s->occupant[d] = FERRY_MOE_NONE;
        for (uint32_t b = 0; b < s->g.banks && rc == 0; b++)
            rc = write_row(s, rows, b, plan->layer, plan->src_rows[i], d);
        if (rc < 0)
            break;
    }
    if (rc < 0) {
        char cause[FERRY__ERRMSG_MAX];
        snprintf(cause, sizeof cause, "%s", ferry_last_error());
        s->st.failed_writes++;
        /* the later slots were given to new experts by the planner and are
         * not written: they are unknown too */
        for (uint32_t j = i; j < plan->n; j++)
            s->occupant[plan->dst_slots[j]] = FERRY_MOE_NONE;
        report_unknown(plan->dst_slots, i, plan->n, unknown_out, n_unknown);
        int frc = async ? s->ops->flush_prefetch(s->ctx) : s->ops->flush(s->ctx);
        if (frc < 0) {
            s->st.failed_flushes++;
            report_unknown(plan->dst_slots, 0, i, unknown_out, n_unknown);
        } else {
            for (uint32_t j = 0; j < i; j++)
                s->occupant[plan->dst_slots[j]] = plan->layer * s->g.num_experts + plan->src_rows[j];
            s->st.host_rows += i;
            s->st.host_bytes += (uint64_t)i * s->row_total;
            if (prefetch) {
                s->st.prefetch_rows += i;
                s->st.prefetch_bytes += (uint64_t)i * s->row_total;
            }
        }
        return ferry__err_set(&s->err, rc,
                              "moe %s: layer %u row %u into slot %u failed (%u of %u slots now "
                              "unknown): %s",
                              what, plan->layer, plan->src_rows[i], plan->dst_slots[i],
                              n_unknown ? *n_unknown : plan->n - i, plan->n, cause);
    }
    if (async) {
        /* in flight on the prefetch stream: the occupants are set when
         * prefetch_finish sees it land */
        memcpy(s->pend_dst, plan->dst_slots, (size_t)plan->n * sizeof *s->pend_dst);
        memcpy(s->pend_row, plan->src_rows, (size_t)plan->n * sizeof *s->pend_row);
        s->pend_n = plan->n;
        s->pend_layer = plan->layer;
        s->pending = 1;
        return (int)plan->n;
    }
    rc = s->ops->flush(s->ctx);
    if (rc < 0) {
        char cause[FERRY__ERRMSG_MAX];
        snprintf(cause, sizeof cause, "%s", ferry_last_error());
        s->st.failed_flushes++;
        report_unknown(plan->dst_slots, 0, plan->n, unknown_out, n_unknown);
        return ferry__err_set(&s->err, rc,
                              "moe %s: layer %u: flush of %u rows failed, every slot of the plan "
                              "is unknown: %s",
                              what, plan->layer, plan->n, cause);
    }
    for (i = 0; i < plan->n; i++) {
        FERRY__ASSERT(s->occupant[plan->dst_slots[i]] == FERRY_MOE_NONE);
        s->occupant[plan->dst_slots[i]] = plan->layer * s->g.num_experts + plan->src_rows[i];
    }
    s->st.host_rows += plan->n;
    s->st.host_bytes += (uint64_t)plan->n * s->row_total;
    if (prefetch) {
        s->st.prefetch_rows += plan->n;
        s->st.prefetch_bytes += (uint64_t)plan->n * s->row_total;
    }
    return (int)plan->n;
}

int ferry_moe_slots_gather(ferry_moe_slots *s, const ferry_moe_gather_plan *plan,
                           uint32_t *unknown_out, uint32_t *n_unknown)
{
    if (n_unknown)
        *n_unknown = 0;
    if (!s || !plan)
        return ferry__err_set(s ? &s->err : NULL, -EINVAL, "moe gather: no slots or plan");
    int prc = finish_pending(s, "gather", unknown_out, n_unknown);
    if (prc < 0)
        return prc;
    if (plan->n == 0) {
        s->st.gather_plans++;
        s->st.warm_plans++;
        return 0;
    }
    if (!plan->dst_slots || !plan->src_slots)
        return ferry__err_set(&s->err, -EINVAL, "moe gather: plan of %u without arrays", plan->n);
    uint32_t gen = next_gen(s);
    for (uint32_t i = 0; i < plan->n; i++) {
        uint32_t d = plan->dst_slots[i], src = plan->src_slots[i];
        if (d >= s->g.slots || src >= s->g.slots)
            return ferry__err_set(&s->err, -EINVAL, "moe gather: entry %u: slot %u <- %u out of range (%u)",
                                  i, d, src, s->g.slots);
        if (d == src)
            return ferry__err_set(&s->err, -EINVAL, "moe gather: entry %u copies slot %u onto itself",
                                  i, d);
        if (s->occupant[src] == FERRY_MOE_NONE)
            return ferry__err_set(&s->err, -EINVAL,
                                  "moe gather: entry %u: source slot %u holds no known expert", i,
                                  src);
        if (s->stamp[d] == gen)
            return ferry__err_set(&s->err, -EINVAL, "moe gather: slot %u is written twice", d);
        s->stamp[d] = gen;
    }
    for (uint32_t i = 0; i < plan->n; i++)
        if (s->stamp[plan->src_slots[i]] == gen)
            return ferry__err_set(&s->err, -EINVAL,
                                  "moe gather: slot %u is both a source and a destination",
                                  plan->src_slots[i]);
    int rc = 0;
    if (s->ops->begin_plan && (rc = s->ops->begin_plan(s->ctx, FERRY_MOE_ROUTE_PER_ROW)) < 0)
        return ferry__err_set(&s->err, rc, "moe gather: device refused the plan: %s",
                              ferry_last_error());
    s->st.gather_plans++;
    /* sources are never destinations, so their occupants are stable here */
    uint32_t i;
    for (i = 0; i < plan->n && rc == 0; i++) {
        uint32_t d = plan->dst_slots[i];
        s->occupant[d] = FERRY_MOE_NONE;
        for (uint32_t b = 0; b < s->g.banks && rc == 0; b++)
            rc = s->ops->copy_slot(s->ctx, b, d, plan->src_slots[i]);
    }
    if (rc < 0)
        i--; /* the failed entry */
    int frc = s->ops->flush(s->ctx);
    if (rc < 0 || frc < 0) {
        char cause[FERRY__ERRMSG_MAX];
        snprintf(cause, sizeof cause, "%s", ferry_last_error());
        if (rc < 0)
            s->st.failed_writes++;
        if (frc < 0)
            s->st.failed_flushes++;
        uint32_t from = frc < 0 ? 0 : i;
        for (uint32_t j = from; j < plan->n; j++)
            s->occupant[plan->dst_slots[j]] = FERRY_MOE_NONE;
        report_unknown(plan->dst_slots, from, plan->n, unknown_out, n_unknown);
        for (uint32_t j = 0; j < from; j++)
            s->occupant[plan->dst_slots[j]] = s->occupant[plan->src_slots[j]];
        s->st.device_rows += from;
        s->st.device_bytes += (uint64_t)from * s->row_total;
        return ferry__err_set(&s->err, rc < 0 ? rc : frc,
                              "moe gather: %s failed, %u of %u slots unknown: %s",
                              rc < 0 ? "slot copy" : "flush", plan->n - from, plan->n, cause);
    }
    for (i = 0; i < plan->n; i++) {
        /* validated known, and never a destination: still known */
        FERRY__ASSERT(s->occupant[plan->src_slots[i]] != FERRY_MOE_NONE);
        s->occupant[plan->dst_slots[i]] = s->occupant[plan->src_slots[i]];
    }
    s->st.device_rows += plan->n;
    s->st.device_bytes += (uint64_t)plan->n * s->row_total;
    return (int)plan->n;
}

int ferry_moe_check(const ferry_moe_planner *p, const ferry_moe_slots *s)
{
    if (!p || !s)
        return ferry__err_set(NULL, -EINVAL, "moe check: no planner or slots");
    uint32_t ps = ferry_moe_planner_slots(p);
    if (ps != s->g.slots)
        return ferry__err_set(NULL, FERRY_EMISMATCH, "moe check: planner has %u slots, executor %u",
                              ps, s->g.slots);
    for (uint32_t slot = 0; slot < ps; slot++) {
        uint32_t po = ferry_moe_planner_occupant(p, slot), so = s->occupant[slot];
        if (so != FERRY_MOE_NONE && so != po && po == FERRY_MOE_NONE)
            return ferry__err_set(NULL, FERRY_EMISMATCH,
                                  "moe check: slot %u holds expert %u (layer %u, expert %u) but the "
                                  "planner says it is free",
                                  slot, so, so / s->g.num_experts, so % s->g.num_experts);
        if (so != FERRY_MOE_NONE && so != po)
            return ferry__err_set(NULL, FERRY_EMISMATCH,
                                  "moe check: slot %u holds expert %u (layer %u, expert %u) but the "
                                  "planner says expert %u (layer %u, expert %u)",
                                  slot, so, so / s->g.num_experts, so % s->g.num_experts, po,
                                  po / s->g.num_experts, po % s->g.num_experts);
        if (po != FERRY_MOE_NONE && so == FERRY_MOE_NONE)
            return ferry__err_set(NULL, FERRY_EMISMATCH,
                                  "moe check: the planner puts expert %u (layer %u, expert %u) in "
                                  "slot %u, which the executor does not know",
                                  po, po / s->g.num_experts, po % s->g.num_experts, slot);
    }
    return 0;
}
