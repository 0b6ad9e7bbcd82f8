/*
 * util.c - version, size parsing and clocks.
 */
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
    char *end = NULL;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || v < 0 || isnan(v))
        return ferry__err_set(NULL, -EINVAL, "size '%s': not a number", s);
    const char *num_end = end;
    int shift = size_shift(*end);
    if (shift)
        end++;
    if (*end == 'i' || *end == 'I')
        end++;
    if (*end == 'b' || *end == 'B')
        end++;
    if (*end)
        return ferry__err_set(NULL, -EINVAL, "size '%s': unknown suffix '%s'", s, end);
    /* a plain run of digits is taken exactly (a double holds 53 bits) */
    if (s + strspn(s, "0123456789") == num_end) {
        errno = 0;
        unsigned long long u = strtoull(s, NULL, 10);
        if (errno == ERANGE || u > (UINT64_MAX >> shift))
            return ferry__err_set(NULL, -EINVAL, "size '%s': above 2^64 - 1 bytes", s);
        *out = (uint64_t)u << shift;
        return 0;
    }
    double r = ldexp(v, shift);
    if (!(r < 18446744073709551616.0)) /* 2^64; inf too */
        return ferry__err_set(NULL, -EINVAL, "size '%s': above 2^64 - 1 bytes", s);
    *out = (uint64_t)round(r);
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
