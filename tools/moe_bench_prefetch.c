/*
 * moe_bench_prefetch.c - what a prefetch of rows on NVMe costs the caller:
 * the time prefetch_start takes to return, against the synchronous apply of
 * the same plan (the reference: the reads done in the caller's thread), in
 * the same run, alternating, median of the rounds.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "moe_cli.h"
#include "moe/moe_internal.h"

int moe_bench_file_prefetch(const char *cmd, const char *backend, size_t row_bytes,
                            uint32_t nrows, int rounds, moe_prefetch_bench *out)
{
    char path[] = "/var/tmp/ferry-moe-rows-XXXXXX";
    int fd = mkstemp(path);
    if (fd < 0)
        return cli_fail(cmd, "rows file", -errno);
    size_t total = row_bytes * nrows;
    char *buf = malloc(total);
    int ok = buf && write(fd, memset(buf, 0x3c, total), total) == (ssize_t)total;
    close(fd);
    free(buf);
    ferry_device_options dopt = FERRY_DEVICE_OPTIONS_INIT;
    dopt.backend = backend;
    ferry_device *dev = NULL;
    ferry_io *io = NULL;
    ferry_moe_rows *rows = NULL;
    ferry_moe_slots *s = NULL;
    uint32_t *dst = malloc(nrows * sizeof *dst), *src = malloc(nrows * sizeof *src);
    int rc = ok && dst && src ? ferry_device_open(&dopt, &dev) : -ENOMEM;
    ferry_io_options io_o = FERRY_IO_OPTIONS_INIT;
    io_o.engine = "posix";
    io_o.device = dev;
    if (rc == 0)
        rc = ferry_io_open(&io_o, &io);
    ferry_moe_geometry g = FERRY_MOE_GEOMETRY_INIT;
    g.num_layers = 1;
    g.num_experts = nrows;
    g.slots = nrows;
    g.banks = 1;
    g.row_bytes[0] = row_bytes;
    const ferry_moe_slot_device_ops *ops;
    void *ctx;
    if (rc == 0)
        rc = ferry_moe_rows_file(&g, io, path, NULL, &rows);
    if (rc == 0 && (rc = ferry_moe_device_slots_open(dev, &g, &ops, &ctx)) == 0)
        rc = ferry_moe_slots_create(&g, ops, ctx, &s);
    double ts[64], tl[64], ta[64];
    if (rounds > 64)
        rounds = 64;
    for (uint32_t i = 0; rc == 0 && i < nrows; i++) {
        dst[i] = i;
        src[i] = (i * 5 + 1) % nrows;
    }
    ferry_moe_copy_plan plan = {0, nrows, dst, src};
    for (int r = 0; rc >= 0 && r < rounds; r++)
        for (int side = 0; side < 2 && rc >= 0; side++) {
            uint64_t t0 = ferry__now_ns();
            if ((side ^ (r & 1)) == 0) {
                rc = ferry_moe_slots_prefetch_start(s, &plan, rows, NULL, NULL);
                uint64_t t1 = ferry__now_ns();
                if (rc >= 0)
                    rc = ferry_moe_slots_prefetch_finish(s, NULL, NULL);
                ts[r] = (double)(t1 - t0) / 1e3;
                tl[r] = (double)(ferry__now_ns() - t0) / 1e3;
            } else {
                rc = ferry_moe_slots_apply(s, &plan, rows, NULL, NULL);
                ta[r] = (double)(ferry__now_ns() - t0) / 1e3;
            }
        }
    if (rc < 0)
        rc = cli_fail(cmd, "nvme prefetch", rc);
    else {
        out->start_us = cli_median(ts, (unsigned)rounds);
        out->landed_us = cli_median(tl, (unsigned)rounds);
        out->sync_us = cli_median(ta, (unsigned)rounds);
        out->rows = nrows;
        out->row_bytes = row_bytes;
        rc = 0;
    }
    ferry_moe_slots_destroy(s);
    ferry_moe_rows_destroy(rows);
    if (io)
        ferry_io_close(io);
    ferry_device_close(dev);
    unlink(path);
    free(dst);
    free(src);
    return rc;
}
