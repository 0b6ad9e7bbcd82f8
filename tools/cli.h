/*
 * cli.h - the `ferry` command's subcommands and shared helpers.
 *
 * Each subcommand lives in its own tools/cmd_<name>.c and is listed once in
 * the table in tools/ferry.c. A subcommand gets argv starting at its own
 * name and returns the process exit status: 0 ok, 1 failure (the work
 * itself failed), 2 usage (an option, value or path the user gave is
 * wrong; nothing was run).
 *
 * Option values go through the cli_opt_* parsers below and nothing else,
 * so every subcommand refuses alike: trailing junk, hexadecimal, zero
 * where zero means nothing, overflow ("99999T") and values out of range
 * each print one line on stderr,
 *   ferry <cmd>: --flag VALUE: <why>; accepted: <range>
 * and the parser returns 2 for the subcommand to return.
 */
#ifndef FERRY_CLI_H
#define FERRY_CLI_H

#include <netinet/in.h>
#include <stdint.h>
#include <stdio.h>

#include "ferry.h"
#include "parse.h"

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
int cmd_slab_reset(int argc, char **argv);
int cmd_slab_bench(int argc, char **argv);
int cmd_moe_gen(int argc, char **argv);
int cmd_moe_replay(int argc, char **argv);
int cmd_moe_bench(int argc, char **argv);
int cmd_serve(int argc, char **argv);
int cmd_serve_status(int argc, char **argv);
int cmd_moe_sim(int argc, char **argv);

/* print "ferry <cmd>: <msg>" to stderr and return 2 */
int cli_usage(const char *cmd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* print "ferry <cmd>: <what>: <ferry_last_error or strerror>" and return 1 */
int cli_fail(const char *cmd, const char *what, int code);

/* "ferry <cmd>: <flag> <val>: <why>; accepted: <accepted>" on stderr; returns 2.
 * val NULL: the flag was last on the line ("<flag>: needs a value; ..."). */
int cli_bad(const char *cmd, const char *flag, const char *val, const char *accepted,
            const char *why, ...) __attribute__((format(printf, 5, 6)));
/* "ferry <cmd>: <arg>: unknown option; see ferry <cmd> --help"; returns 2 */
int cli_unknown(const char *cmd, const char *arg);

/* A size: decimal digits, an optional fraction of up to 6 digits, an
 * optional binary suffix K, M, G or T (optionally followed by "iB" or "B"),
 * e.g. 4096, 256K, 1.5G. min..max inclusive; align: the value must be a
 * multiple of it (0 or 1: any). 0 when stored in *out, else 2 (printed). */
int cli_opt_size(const char *cmd, const char *flag, const char *val, uint64_t min, uint64_t max,
                 uint64_t align, uint64_t *out);
/* A count: a whole number, optionally with K, M or G (x1024). min..max. */
int cli_opt_count(const char *cmd, const char *flag, const char *val, uint64_t min, uint64_t max,
                  uint64_t *out);
/* Any unsigned 64-bit number, decimal (seeds). */
int cli_opt_u64(const char *cmd, const char *flag, const char *val, uint64_t *out);
/* A decimal real in min..max (no inf, no nan, no hex). */
int cli_opt_real(const char *cmd, const char *flag, const char *val, double min, double max,
                 double *out);
/* A percentage "P%" with 0 < P <= 100. */
int cli_opt_percent(const char *cmd, const char *flag, const char *val, double *out);
/* One of choices (NULL-terminated); *idx its index. */
int cli_opt_choice(const char *cmd, const char *flag, const char *val,
                   const char *const *choices, int *idx);
/* A non-empty string (a path, a URL). */
int cli_opt_string(const char *cmd, const char *flag, const char *val, const char *what,
                   const char **out);
/* A file to write (--plot, -o): non-empty, in a directory that exists,
 * so the work is not run only to fail at its end. 0, or 2 (printed). */
int cli_opt_outfile(const char *cmd, const char *flag, const char *val, const char *what,
                    const char **out);
/* A directory given with flag: 0 when it is one; when it does not exist,
 * 2 unless create (then made, with its parents, mode 0700; 1 when that
 * fails); 2 when it is not a directory. */
int cli_opt_dir(const char *cmd, const char *flag, const char *dir, int create);

/* numbers, sizes and HOST:PORT as flags and config files write them:
 * ferry__parse_number, ferry__parse_inet4, ferry__size_str (core/parse.h) */

/* A `ferry serve` address: "unix:PATH" (also "unix:///abs/path") or a bare
 * PATH, for the daemon speaks over a Unix-domain socket only. Any
 * "scheme://..." other than unix (tcp://, http://, redis://) and
 * "unix://HOST/..." are refused, never taken for a path. NULL and *path
 * (the path within addr), or the reason (static text). */
const char *cli_parse_socket(const char *addr, const char **path);
/* what cli_parse_socket accepts, for messages */
#define CLI_SOCKET_FORMS "unix:/path/to/ferry.sock or /path/to/ferry.sock (a Unix-domain socket)"

/* compatibility for the slab group: cli_opt_size with 1..1P, any alignment */
int cli_size(const char *cmd, const char *flag, const char *val, uint64_t *out);

/* progress bar on stderr when it is a terminal: done/total, label */
void cli_progress(const char *label, uint64_t done, uint64_t total);
void cli_progress_end(void);
/* qsort comparator: doubles ascending */
int cli_cmp_double(const void *a, const void *b);
/* median of v[0..n) (sorts v in place); 0 when n == 0 */
double cli_median(double *v, unsigned n);
/* 1 when stderr is a terminal and FERRY_NO_PROGRESS is unset (or "0") */
int cli_isatty(void);

#endif
