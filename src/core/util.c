/*
 * util.c - version, size parsing and clocks.
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
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

int ferry_parse_size(const char *s, uint64_t *out)
{
    if (!s || !*s || !out)
        return ferry__err_set(NULL, -EINVAL, "size: empty");
    char *end = NULL;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || v < 0 || isnan(v))
        return ferry__err_set(NULL, -EINVAL, "size '%s': not a number", s);
    double mul = 1;
    switch (*end) {
    case 'k': case 'K': mul = 1024.0; end++; break;
    case 'm': case 'M': mul = 1024.0 * 1024; end++; break;
    case 'g': case 'G': mul = 1024.0 * 1024 * 1024; end++; break;
    case 't': case 'T': mul = 1024.0 * 1024 * 1024 * 1024; end++; break;
    default: break;
    }
    if (*end == 'i' || *end == 'I')
        end++;
    if (*end == 'b' || *end == 'B')
        end++;
    if (*end)
        return ferry__err_set(NULL, -EINVAL, "size '%s': unknown suffix '%s'", s, end);
    double r = v * mul;
    if (r > 1.8e19)
        return ferry__err_set(NULL, -ERANGE, "size '%s': too large", s);
    *out = (uint64_t)llround(r);
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
