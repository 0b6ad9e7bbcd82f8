/*
 * cli.h - the `ferry` command's subcommands and shared helpers.
 *
 * Each subcommand lives in its own tools/cmd_<name>.c and is listed once in
 * the table in tools/ferry.c. A subcommand gets argv starting at its own
 * name and returns the process exit status (0 ok, 1 failure, 2 usage).
 */
#ifndef FERRY_CLI_H
#define FERRY_CLI_H

#include <stdint.h>
#include <stdio.h>

#include "ferry.h"

typedef struct cli_command {
    const char *name;   /* "info", "bench io", "moe replay", ... */
    int (*run)(int argc, char **argv);
    const char *summary;
} cli_command;

int cmd_info(int argc, char **argv);
int cmd_kv_bench(int argc, char **argv);
int cmd_bench_remote(int argc, char **argv);
int cmd_bench_io(int argc, char **argv);
int cmd_bench_gds(int argc, char **argv);
int cmd_slab_check(int argc, char **argv);
int cmd_slab_bench(int argc, char **argv);
int cmd_moe_gen(int argc, char **argv);
int cmd_moe_replay(int argc, char **argv);
int cmd_moe_bench(int argc, char **argv);

/* print "ferry <cmd>: <msg>" to stderr and return 2 */
int cli_usage(const char *cmd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* print "ferry <cmd>: <what>: <ferry_last_error or strerror>" and return 1 */
int cli_fail(const char *cmd, const char *what, int code);
/* parse a size ("8M") or exit-style error: returns 0 or 2 after printing */
int cli_size(const char *cmd, const char *flag, const char *val, uint64_t *out);
/* progress bar on stderr when it is a terminal: done/total, label */
void cli_progress(const char *label, uint64_t done, uint64_t total);
void cli_progress_end(void);
/* qsort comparator: doubles ascending */
int cli_cmp_double(const void *a, const void *b);
/* median of v[0..n) (sorts v in place); 0 when n == 0 */
double cli_median(double *v, unsigned n);
/* 1 when stderr is a terminal and FERRY_NO_PROGRESS is unset */
int cli_isatty(void);

#endif
