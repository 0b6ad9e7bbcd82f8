/*
 * rows_file.c - expert rows on NVMe: one file, bank after bank, each bank
 * laid out as the host banks are (layer-major, row-minor, fixed width).
 *
 * Invariant: every row the executor may ask for lies inside the file - the
 * size is checked against the whole geometry when the source opens, so a
 * short file is FERRY_EMISMATCH up front, never a short read mid-plan. The
 * file is opened O_DIRECT exactly when every row offset and width is a
 * multiple of FERRY_IO_ALIGN (otherwise the engine would have to pad every
 * read); the I/O engine then moves rows straight into device slots (GDS
 * when the engine is cufile, its bounce path otherwise) - the third tier,
 * below pinned host memory, that no anchor library offers for experts.
 *
 * A checkpoint's tensors are not laid out bank after bank: with an offset
 * table (ferry_moe_rows_file_table) each row of each bank is wherever the
 * table says, every one checked inside the file when the source opens.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "moe/moe_internal.h"

typedef struct file_rows {
    ferry_moe_rows base;
    ferry_io *io;
    ferry_file *f;
    uint64_t bank_off[FERRY_MOE_MAX_BANKS];
    uint64_t *table; /* banks x layers x experts offsets, or NULL: bank_off */
} file_rows;

static int file_row(const ferry_moe_rows *r, uint32_t bank, uint32_t layer, uint32_t row,
                    ferry_io **io, ferry_file **f, uint64_t *off)
{
    const file_rows *fr = (const file_rows *)r;
    const ferry_moe_geometry *g = &r->g;
    if (bank >= g->banks || layer >= g->num_layers || row >= g->num_experts)
        return -EINVAL;
    *io = fr->io;
    *f = fr->f;
    if (fr->table)
        *off = fr->table[((size_t)bank * g->num_layers + layer) * g->num_experts + row];
    else
        *off = fr->bank_off[bank] + ((uint64_t)layer * g->num_experts + row) * g->row_bytes[bank];
    return 0;
}

static int file_class(const ferry_moe_rows *r, uint32_t layer)
{
    return layer < r->g.num_layers ? FERRY_MOE_ON_FILE : -EINVAL;
}

static void file_destroy(ferry_moe_rows *r)
{
    file_rows *fr = (file_rows *)r;
    (void)ferry_file_close(fr->f);
    ferry__free(fr->table);
    ferry__free(fr);
}

static const ferry__rows_ops file_ops = {
    .name = "file",
    .file_row = file_row,
    .klass = file_class,
    .destroy = file_destroy,
};

/* open the file (O_DIRECT when every row is aligned) and check it holds
 * `end` bytes; frees fr on failure */
static int open_checked(file_rows *fr, const char *path, int aligned, uint64_t end)
{
    const ferry_moe_geometry *g = &fr->base.g;
    unsigned flags = FERRY_FILE_READ | (aligned ? FERRY_FILE_DIRECT : 0u);
    int rc = ferry_file_open(fr->io, path, flags, &fr->f);
    if (rc < 0) {
        char cause[FERRY__ERRMSG_MAX];
        snprintf(cause, sizeof cause, "%s", ferry_last_error());
        ferry__free(fr->table);
        ferry__free(fr);
        return ferry__err_set(NULL, rc, "moe file rows %s: %s", path, cause);
    }
    uint64_t size = 0;
    rc = ferry_file_size(fr->f, &size);
    if (rc == 0 && size < end)
        rc = ferry__err_set(NULL, FERRY_EMISMATCH,
                            "moe file rows %s: %llu bytes, the geometry (%u layers x %u experts, "
                            "%u banks) needs %llu",
                            path, (unsigned long long)size, g->num_layers, g->num_experts, g->banks,
                            (unsigned long long)end);
    if (rc < 0) {
        (void)ferry_file_close(fr->f);
        ferry__free(fr->table);
        ferry__free(fr);
    }
    return rc;
}

int ferry_moe_rows_file(const ferry_moe_geometry *g, ferry_io *io, const char *path,
                        const uint64_t *bank_off, ferry_moe_rows **out)
{
    int rc = ferry__geometry_check(g, "file rows", 0);
    if (rc < 0)
        return rc;
    if (!io || !path || !out)
        return ferry__err_set(NULL, -EINVAL, "moe file rows: no engine, path or out-parameter");
    file_rows *fr = ferry__calloc(1, sizeof *fr);
    if (!fr)
        return ferry__err_set(NULL, -ENOMEM, "moe file rows %s: out of memory", path);
    fr->base.ops = &file_ops;
    fr->base.g = *g;
    fr->io = io;
    uint64_t end = 0, off = 0;
    int aligned = 1;
    for (uint32_t b = 0; b < g->banks; b++) {
        /* the geometry check bounded bytes to INT64_MAX */
        uint64_t bytes = (uint64_t)g->num_layers * g->num_experts * g->row_bytes[b];
        uint64_t start = bank_off ? bank_off[b] : off;
        if (start > (uint64_t)INT64_MAX - bytes) {
            ferry__free(fr);
            return ferry__err_set(NULL, -EINVAL,
                                  "moe file rows %s: bank_off[%u] %llu: its %llu bytes end past "
                                  "the largest file offset; accepted 0..%llu",
                                  path, b, (unsigned long long)start, (unsigned long long)bytes,
                                  (unsigned long long)((uint64_t)INT64_MAX - bytes));
        }
        fr->bank_off[b] = start;
        off = fr->bank_off[b] + bytes;
        if (off > end)
            end = off;
        if (!FERRY__IS_ALIGNED(fr->bank_off[b], FERRY_IO_ALIGN) ||
            !FERRY__IS_ALIGNED(g->row_bytes[b], FERRY_IO_ALIGN))
            aligned = 0;
    }
    rc = open_checked(fr, path, aligned, end);
    if (rc < 0)
        return rc;
    *out = &fr->base;
    return 0;
}

int ferry_moe_rows_file_table(const ferry_moe_geometry *g, ferry_io *io, const char *path,
                              const uint64_t *row_off, ferry_moe_rows **out)
{
    int rc = ferry__geometry_check(g, "file rows", 0);
    if (rc < 0)
        return rc;
    if (!io || !path || !row_off || !out)
        return ferry__err_set(NULL, -EINVAL,
                              "moe file rows: no engine, path, offset table or out-parameter");
    /* banks x layers x experts <= 8 x 2^24 entries (the geometry bounds) */
    size_t per_bank = (size_t)g->num_layers * g->num_experts, n = per_bank * g->banks;
    file_rows *fr = ferry__calloc(1, sizeof *fr);
    uint64_t *table = ferry__malloc(n * sizeof *table);
    if (!fr || !table) {
        ferry__free(fr);
        ferry__free(table);
        return ferry__err_set(NULL, -ENOMEM, "moe file rows %s: out of memory for %zu offsets",
                              path, n);
    }
    fr->base.ops = &file_ops;
    fr->base.g = *g;
    fr->io = io;
    uint64_t end = 0;
    int aligned = 1;
    for (uint32_t b = 0; b < g->banks; b++) {
        uint64_t w = g->row_bytes[b]; /* <= 2^40 */
        aligned &= FERRY__IS_ALIGNED(w, FERRY_IO_ALIGN);
        for (size_t i = 0; i < per_bank; i++) {
            uint64_t off = row_off[b * per_bank + i];
            if (off > (uint64_t)INT64_MAX - w) {
                ferry__free(table);
                ferry__free(fr);
                return ferry__err_set(NULL, -EINVAL,
                                      "moe file rows %s: row_off[%zu] (bank %u, layer %zu, "
                                      "expert %zu) %llu: its %llu bytes end past the largest "
                                      "file offset",
                                      path, b * per_bank + i, b, i / g->num_experts,
                                      i % g->num_experts, (unsigned long long)off,
                                      (unsigned long long)w);
            }
            table[b * per_bank + i] = off;
            if (off + w > end)
                end = off + w;
            aligned &= FERRY__IS_ALIGNED(off, FERRY_IO_ALIGN);
        }
    }
    fr->table = table;
    rc = open_checked(fr, path, aligned, end);
    if (rc < 0)
        return rc;
    *out = &fr->base;
    return 0;
}
