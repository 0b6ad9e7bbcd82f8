/*
 * parse.c - the numbers and addresses people write in flags and config
 * files: sizes with binary suffixes (4096, 256K, 1.5G, 2T), counts, and
 * HOST:PORT, each read whole or refused with the reason (no partial
 * parse, no silent wrap). The CLI's flags and the daemon's config file
 * read them alike.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "parse.h"

const char *ferry__size_str(uint64_t v, char *buf, size_t n)
{
    /* the suffixes a size is read with (parse_number): 2^50 is "1024T",
     * not a "1P" no flag or key would take */
    static const char suf[] = "KMGT";
    int i = -1;
    while (v && v % 1024 == 0 && i < 3) {
        v /= 1024;
        i++;
    }
    if (i < 0)
        snprintf(buf, n, "%llu", (unsigned long long)v);
    else
        snprintf(buf, n, "%llu%c", (unsigned long long)v, suf[i]);
    return buf;
}

/* the number in s, with binary suffixes; 0 or a reason (static text) */
const char *ferry__parse_number(const char *s, int bytes, uint64_t *out)
{
    if (!*s)
        return "empty";
    if (s[0] == '0' && (s[1] == 'x' || s[1] == 'X'))
        return "hexadecimal is not accepted";
    if (*s < '0' || *s > '9')
        return "not a number";
    uint64_t ip = 0;
    const char *p = s;
    int big = 0;
    for (; *p >= '0' && *p <= '9'; p++) {
        uint64_t d = (uint64_t)(*p - '0');
        if (big || ip > (UINT64_MAX - d) / 10)
            big = 1; /* (exactly: 18446744073709551615 is a number) */
        else
            ip = ip * 10 + d;
    }
    uint64_t frac = 0, scale = 1;
    if (*p == '.') {
        p++;
        if (*p < '0' || *p > '9')
            return "not a number";
        for (; *p >= '0' && *p <= '9'; p++) {
            if (scale == 1000000)
                return "more than 6 decimals";
            frac = frac * 10 + (uint64_t)(*p - '0');
            scale *= 10;
        }
    }
    uint64_t mul = 1;
    switch (*p) {
    case 'k': case 'K': mul = 1ull << 10; p++; break;
    case 'm': case 'M': mul = 1ull << 20; p++; break;
    case 'g': case 'G': mul = 1ull << 30; p++; break;
    case 't': case 'T': mul = bytes ? 1ull << 40 : 1; p += bytes; break;
    default: break;
    }
    if (bytes) {
        /* a lowercase b is a bit to many readers: refused, not guessed */
        if ((mul > 1 && (*p == 'i' || *p == 'I') && p[1] == 'b') || *p == 'b')
            return mul > 1 ? "a lowercase b means bits; for bytes write the unit alone or "
                             "with iB or B (e.g. 64G, 64GiB or 64GB)"
                           : "a lowercase b means bits; for bytes write the number alone or "
                             "with B (e.g. 4096 or 4096B)";
        if (mul > 1 && (*p == 'i' || *p == 'I') && p[1] == 'B')
            p += 2;
        else if (*p == 'B')
            p++;
    }
    if (*p)
        return "trailing characters";
    if (big || (mul > 1 && ip > UINT64_MAX / mul))
        return "too large";
    /* frac < 1e6 and mul <= 2^40: the product fits */
    if ((frac * mul) % scale)
        return bytes ? "not a whole number of bytes" : "not a whole number";
    uint64_t v = ip * mul, f = frac * mul / scale;
    if (v > UINT64_MAX - f)
        return "too large";
    *out = v + f;
    return NULL;
}

int ferry__parse_inet4(const char *addr, struct sockaddr_in *sa)
{
    const char *colon = strrchr(addr, ':');
    if (!colon || colon == addr || (size_t)(colon - addr) >= 64)
        return -1;
    char host[64];
    memcpy(host, addr, (size_t)(colon - addr));
    host[colon - addr] = 0;
    char *end = NULL;
    errno = 0;
    unsigned long port = strtoul(colon + 1, &end, 10);
    if (errno || !end || *end || end == colon + 1 || port > 65535 || colon[1] == '-' ||
        colon[1] == '+')
        return -1;
    memset(sa, 0, sizeof *sa);
    sa->sin_family = AF_INET;
    sa->sin_port = htons((uint16_t)port);
    return inet_pton(AF_INET, host, &sa->sin_addr) == 1 ? 0 : -1;
}
