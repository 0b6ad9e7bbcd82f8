/*
 * util.c - version, size parsing and clocks.
 */
#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

#include "core.h"

const char *ferry_version(void)
{
    return FERRY_VERSION_STRING;
}

int ferry_version_number(void)
{
    return FERRY_VERSION_NUMBER;
}

/* the power of two a size suffix letter stands for (0: none) */
static int size_shift(char c)
{
    switch (c) {
    case 'k': case 'K': return 10;
    case 'm': case 'M': return 20;
    case 'g': case 'G': return 30;
    case 't': case 'T': return 40;
    default: return 0;
    }
}

int ferry_parse_size(const char *s, uint64_t *out)
{
    if (!s || !*s || !out)
        return ferry__err_set(NULL, -EINVAL, "size: %s", !s ? "NULL" : !out ? "NULL out" : "empty");
    /* digits, an optional fraction, an optional K/M/G/T, then "iB" (after a
     * suffix) or "B" (never "b": bits to many): no sign, space, hex or
     * exponent (strtod's forms) */
    const char *p = s, *ip_end, *fr = NULL;
    if (*p < '0' || *p > '9')
        return ferry__err_set(NULL, -EINVAL, "size '%s': not a number (digits first)", s);
    if (p[0] == '0' && (p[1] == 'x' || p[1] == 'X'))
        return ferry__err_set(NULL, -EINVAL, "size '%s': hexadecimal is not accepted", s);
    p += strspn(p, "0123456789");
    ip_end = p;
    if (*p == '.') {
        fr = ++p;
        p += strspn(p, "0123456789");
        if (p == fr)
            return ferry__err_set(NULL, -EINVAL, "size '%s': no digits after the point", s);
    }
    const char *sfx = p;
    int shift = size_shift(*p);
    if (shift)
        p++;
    /* a lowercase b is a bit to many readers ("64Gb" is 8 GB to them, 64
     * GiB to a reader of "B"): refused rather than guessed either way */
    const char *b = shift && (*p == 'i' || *p == 'I') ? p + 1 : p;
    if (*b == 'b') {
        int n = (int)(sfx - s);
        if (!shift)
            return ferry__err_set(NULL, -EINVAL, "size '%s': a lowercase 'b' means bits; for "
                                  "bytes write %.*s or %.*sB", s, n, s, n, s);
        char u = (char)toupper((unsigned char)*sfx);
        return ferry__err_set(NULL, -EINVAL, "size '%s': a lowercase 'b' means bits; for bytes "
                              "write %.*s%c, %.*s%ciB or %.*s%cB", s, n, s, u, n, s, u, n, s, u);
    }
    if (shift && (*p == 'i' || *p == 'I') && p[1] == 'B')
        p += 2;
    else if (*p == 'B')
        p++;
    if (*p)
        return ferry__err_set(NULL, -EINVAL, "size '%s': unknown suffix '%s' (accepted: K, M, G "
                              "or T, then an optional iB or B)", s, p);
    uint64_t ip = 0;
    for (const char *d = s; d < ip_end; d++) {
        uint64_t digit = (uint64_t)(*d - '0');
        if (ip > (UINT64_MAX - digit) / 10)
            return ferry__err_set(NULL, -EINVAL, "size '%s': above 2^64 - 1 bytes", s);
        ip = ip * 10 + digit;
    }
    if (ip > (UINT64_MAX >> shift))
        return ferry__err_set(NULL, -EINVAL, "size '%s': above 2^64 - 1 bytes", s);
    uint64_t v = ip << shift, f = 0;
    if (fr) { /* the fraction's bytes, rounded to the nearest (no strtod: a
                 * locale's decimal comma would read ".5" as 0) */
        double x = 0, unit = 1;
        for (const char *d = fr; *d >= '0' && *d <= '9' && unit > 1e-18; d++) {
            unit /= 10;
            x += (*d - '0') * unit;
        }
        f = (uint64_t)round(ldexp(x, shift));
    }
    if (v > UINT64_MAX - f)
        return ferry__err_set(NULL, -EINVAL, "size '%s': above 2^64 - 1 bytes", s);
    *out = v + f;
    return 0;
}

uint64_t ferry__now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

uint64_t ferry__thread_cpu_ns(void)
{
    struct timespec ts;
    if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts) != 0)
        return 0;
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

double ferry__cpu_seconds(void)
{
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) != 0)
        return 0;
    return (double)ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6 + (double)ru.ru_stime.tv_sec +
           ru.ru_stime.tv_usec / 1e6;
}

int ferry__cond_init_mono(pthread_cond_t *cv)
{
    pthread_condattr_t ca;
    int rc = pthread_condattr_init(&ca);
    if (rc == 0)
        rc = pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    if (rc == 0)
        rc = pthread_cond_init(cv, &ca);
    pthread_condattr_destroy(&ca);
    return -rc;
}

struct timespec ferry__deadline_ms(uint64_t ms)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    ts.tv_sec += (time_t)(ms / 1000);
    ts.tv_nsec += (long)(ms % 1000) * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    return ts;
}
