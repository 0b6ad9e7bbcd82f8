/*
 * cli.c - helpers shared by the subcommands: errors, option values, a
 * progress bar.
 */
#include <arpa/inet.h>
#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli.h"
#include "serve/serve_config.h"
#include "dirlock.h"

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

int cli_bad(const char *cmd, const char *flag, const char *val, const char *accepted,
            const char *why, ...)
{
    va_list ap;
    if (val)
        fprintf(stderr, "ferry %s: %s %s: ", cmd, flag, val);
    else
        fprintf(stderr, "ferry %s: %s: ", cmd, flag);
    va_start(ap, why);
    vfprintf(stderr, why, ap);
    va_end(ap);
    fprintf(stderr, "; accepted: %s\n", accepted);
    return 2;
}

int cli_unknown(const char *cmd, const char *arg)
{
    return cli_usage(cmd, "%s: unknown option; see ferry %s --help", arg, cmd);
}

int cli_opt_size(const char *cmd, const char *flag, const char *val, uint64_t min, uint64_t max,
                 uint64_t align, uint64_t *out)
{
    char a[48], b[48], c[48], acc[192];
    if (align > 1)
        snprintf(acc, sizeof acc, "a size %s..%s, a multiple of %s (e.g. 4K, 8M, 2G)",
                 ferry__size_str(min, a, sizeof a), ferry__size_str(max, b, sizeof b),
                 ferry__size_str(align, c, sizeof c));
    else
        snprintf(acc, sizeof acc, "a size %s..%s (e.g. 4096, 256K, 8M, 2G)",
                 ferry__size_str(min, a, sizeof a), ferry__size_str(max, b, sizeof b));
    if (!val)
        return cli_bad(cmd, flag, NULL, acc, "needs a value");
    uint64_t v;
    const char *why = ferry__parse_number(val, 1, &v);
    if (why)
        return cli_bad(cmd, flag, val, acc, "%s", why);
    if (v == 0 && min > 0)
        return cli_bad(cmd, flag, val, acc, "zero is not a size here");
    if (v < min)
        return cli_bad(cmd, flag, val, acc, "too small");
    if (v > max)
        return cli_bad(cmd, flag, val, acc, "too large");
    if (align > 1 && v % align)
        return cli_bad(cmd, flag, val, acc, "not a multiple of %s", ferry__size_str(align, c, sizeof c));
    *out = v;
    return 0;
}

int cli_opt_count(const char *cmd, const char *flag, const char *val, uint64_t min, uint64_t max,
                  uint64_t *out)
{
    char acc[96];
    snprintf(acc, sizeof acc, "a whole number %llu..%llu", (unsigned long long)min,
             (unsigned long long)max);
    if (!val)
        return cli_bad(cmd, flag, NULL, acc, "needs a value");
    uint64_t v;
    const char *why = ferry__parse_number(val, 0, &v);
    if (why)
        return cli_bad(cmd, flag, val, acc, "%s", why);
    if (v == 0 && min > 0)
        return cli_bad(cmd, flag, val, acc, "zero means nothing here");
    if (v < min)
        return cli_bad(cmd, flag, val, acc, "too small");
    if (v > max)
        return cli_bad(cmd, flag, val, acc, "too large");
    *out = v;
    return 0;
}

int cli_opt_u64(const char *cmd, const char *flag, const char *val, uint64_t *out)
{
    const char *acc = "a whole number 0..18446744073709551615";
    if (!val)
        return cli_bad(cmd, flag, NULL, acc, "needs a value");
    if (val[0] == '0' && (val[1] == 'x' || val[1] == 'X'))
        return cli_bad(cmd, flag, val, acc, "hexadecimal is not accepted");
    uint64_t v = 0;
    const char *p = val;
    if (!*p)
        return cli_bad(cmd, flag, val, acc, "empty");
    for (; *p; p++) {
        if (*p < '0' || *p > '9')
            return cli_bad(cmd, flag, val, acc, p == val ? "not a number" : "trailing characters");
        unsigned d = (unsigned)(*p - '0');
        if (v > (UINT64_MAX - d) / 10)
            return cli_bad(cmd, flag, val, acc, "too large");
        v = v * 10 + d;
    }
    *out = v;
    return 0;
}

int cli_opt_real(const char *cmd, const char *flag, const char *val, double min, double max,
                 double *out)
{
    char acc[96];
    snprintf(acc, sizeof acc, "a decimal number %g..%g", min, max);
    if (!val)
        return cli_bad(cmd, flag, NULL, acc, "needs a value");
    /* digits, one optional point: strtod alone would take hex, inf and nan */
    const char *p = val;
    int digits = 0, dots = 0;
    for (; *p; p++) {
        if (*p >= '0' && *p <= '9')
            digits++;
        else if (*p == '.' && !dots)
            dots++;
        else
            break;
    }
    if (!digits)
        return cli_bad(cmd, flag, val, acc, "not a number");
    if (*p)
        return cli_bad(cmd, flag, val, acc, "trailing characters");
    double v = strtod(val, NULL);
    if (!isfinite(v) || v < min || v > max)
        return cli_bad(cmd, flag, val, acc, "out of range");
    *out = v;
    return 0;
}

int cli_opt_percent(const char *cmd, const char *flag, const char *val, double *out)
{
    const char *acc = "a percentage P% with 0 < P <= 100 (e.g. 12.5%)";
    if (!val)
        return cli_bad(cmd, flag, NULL, acc, "needs a value");
    size_t n = strlen(val);
    char num[64];
    if (n < 2 || val[n - 1] != '%' || n - 1 >= sizeof num)
        return cli_bad(cmd, flag, val, acc, "not a percentage");
    memcpy(num, val, n - 1);
    num[n - 1] = 0;
    const char *p = num;
    int digits = 0, dots = 0;
    for (; *p; p++) {
        if (*p >= '0' && *p <= '9')
            digits++;
        else if (*p == '.' && !dots)
            dots++;
        else
            break;
    }
    if (!digits || *p)
        return cli_bad(cmd, flag, val, acc, "not a percentage");
    double v = strtod(num, NULL);
    if (v <= 0)
        return cli_bad(cmd, flag, val, acc, "zero is no share");
    if (v > 100)
        return cli_bad(cmd, flag, val, acc, "more than 100%%");
    *out = v;
    return 0;
}

int cli_opt_choice(const char *cmd, const char *flag, const char *val,
                   const char *const *choices, int *idx)
{
    char acc[256];
    size_t off = 0, n = 0;
    while (choices[n])
        n++;
    acc[0] = 0;
    for (size_t i = 0; i < n && off < sizeof acc; i++)
        off += (size_t)snprintf(acc + off, sizeof acc - off, "%s%s",
                                i == 0 ? "" : i + 1 == n ? " or " : ", ", choices[i]);
    if (!val)
        return cli_bad(cmd, flag, NULL, acc, "needs a value");
    for (size_t i = 0; i < n; i++)
        if (!strcmp(val, choices[i])) {
            *idx = (int)i;
            return 0;
        }
    return cli_bad(cmd, flag, val, acc, "unknown");
}

int cli_opt_string(const char *cmd, const char *flag, const char *val, const char *what,
                   const char **out)
{
    if (!val)
        return cli_bad(cmd, flag, NULL, what, "needs a value");
    if (!*val)
        return cli_bad(cmd, flag, "''", what, "empty");
    *out = val;
    return 0;
}

int cli_opt_outfile(const char *cmd, const char *flag, const char *val, const char *what,
                    const char **out)
{
    int rc = cli_opt_string(cmd, flag, val, what, out);
    if (rc)
        return rc;
    char dir[4096];
    const char *slash = strrchr(val, '/');
    if (!slash)
        return 0; /* the working directory */
    size_t n = slash == val ? 1 : (size_t)(slash - val);
    if (n >= sizeof dir)
        return cli_bad(cmd, flag, val, what, "too long a path");
    memcpy(dir, val, n);
    dir[n] = 0;
    struct stat st;
    if (stat(dir, &st) != 0)
        return cli_bad(cmd, flag, val, what, "its directory %s: %s", dir, strerror(errno));
    if (!S_ISDIR(st.st_mode))
        return cli_bad(cmd, flag, val, what, "%s is not a directory", dir);
    return 0;
}

int cli_opt_dir(const char *cmd, const char *flag, const char *dir, int create)
{
    struct stat st;
    if (stat(dir, &st) == 0) {
        if (!S_ISDIR(st.st_mode))
            return cli_bad(cmd, flag, dir, "a directory", "not a directory");
        return 0;
    }
    if (errno != ENOENT)
        return cli_bad(cmd, flag, dir, "a directory this user can reach", "%s", strerror(errno));
    if (!create)
        return cli_bad(cmd, flag, dir, "an existing directory, or add --create",
                       "no such directory");
    int rc = ferry__mkdir_p(dir, 0, 1, NULL); /* each new directory 0700 */
    if (rc < 0) {
        fprintf(stderr, "ferry %s: %s %s: cannot create it: %s\n", cmd, flag, dir,
                ferry_last_error());
        return 1;
    }
    return 0;
}

int cli_size(const char *cmd, const char *flag, const char *val, uint64_t *out)
{
    return cli_opt_size(cmd, flag, val, 1, 1ull << 50, 0, out);
}

int cli_isatty(void)
{
    const char *np = getenv("FERRY_NO_PROGRESS");
    return isatty(2) && !(np && *np && strcmp(np, "0"));
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

const char *cli_parse_socket(const char *addr, const char **path)
{
    return ferry__serve_socket_parse(addr, path);
}
