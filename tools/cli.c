/*
 * cli.c - helpers shared by the subcommands: errors, sizes, a progress bar.
 */
#include <stdarg.h>
#include <stdlib.h>
#include <unistd.h>

#include "cli.h"

int cli_usage(const char *cmd, const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "ferry %s: ", cmd);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, "\n");
    return 2;
}

int cli_fail(const char *cmd, const char *what, int code)
{
    const char *msg = ferry_last_error();
    fprintf(stderr, "ferry %s: %s: %s (%s)\n", cmd, what, msg && *msg ? msg : ferry_strerror(code),
            ferry_err_name(code));
    return 1;
}

int cli_size(const char *cmd, const char *flag, const char *val, uint64_t *out)
{
    if (!val)
        return cli_usage(cmd, "%s needs a value", flag);
    if (ferry_parse_size(val, out) < 0)
        return cli_usage(cmd, "%s: bad size '%s' (use e.g. 4096, 256K, 8M, 2G)", flag, val);
    return 0;
}

int cli_isatty(void)
{
    return isatty(2) && !getenv("FERRY_NO_PROGRESS");
}

void cli_progress(const char *label, uint64_t done, uint64_t total)
{
    if (!cli_isatty() || total == 0)
        return;
    int width = 30, fill = (int)(done * (uint64_t)width / total);
    fprintf(stderr, "\r%-12s [", label);
    for (int i = 0; i < width; i++)
        fputc(i < fill ? '#' : ' ', stderr);
    fprintf(stderr, "] %3d%%", (int)(done * 100 / total));
    fflush(stderr);
}

void cli_progress_end(void)
{
    if (cli_isatty())
        fprintf(stderr, "\r%60s\r", "");
}

int cli_cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

double cli_median(double *v, unsigned n)
{
    qsort(v, n, sizeof *v, cli_cmp_double);
    return n ? (n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2) : 0;
}
