/*
 * fuzz_size.c - sizes as people write them: the public ferry_parse_size
 * and the CLI's and the daemon's config's ferry__parse_number (bytes and
 * counts), on arbitrary bytes (read up to the first NUL).
 *
 * Checks beyond "no crash, no UB", against a reference of the documented
 * grammar (include/ferry/core.h, README's "Sizes are decimal ..."):
 *   digits ["." digits] [K|M|G|T (either case) ["iB"|"IB"|"B"] | "B"]
 * and nothing else: no sign, space, hex, exponent, lowercase "b" or
 * trailing byte is ever accepted; a value is accepted exactly when it is
 * at most 2^64 - 1 bytes. The one documented difference: a fraction is
 * rounded to the nearest byte by ferry_parse_size, refused by
 * ferry__parse_number unless it is a whole number of bytes written with
 * at most 6 decimals. Where both accept, the value is the same and
 * exact; an accepted value written back as plain decimal bytes (and as
 * ferry__size_str writes it) parses to the same value. Counts (bytes 0)
 * take K, M, G only, no B and no T, else as sizes.
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <ferry/core.h>

#include "core/parse.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

typedef struct ref {
    int ok;             /* s is in the grammar */
    int shift;          /* the suffix's power of two (0: none) */
    int unit;           /* a B or iB was written */
    int tera;           /* the suffix is T */
    const char *ip, *fr; /* the integer's digits; the fraction's (NULL: none) */
    size_t nip, nfr;
} ref;

static int digit(char c)
{
    return c >= '0' && c <= '9';
}

static ref grammar(const char *s)
{
    ref r = {0};
    const char *p = s;
    r.ip = p;
    while (digit(*p))
        p++;
    r.nip = (size_t)(p - s);
    if (!r.nip)
        return r;
    if (*p == '.') {
        r.fr = ++p;
        while (digit(*p))
            p++;
        r.nfr = (size_t)(p - r.fr);
        if (!r.nfr)
            return r;
    }
    switch (*p) {
    case 'k': case 'K': r.shift = 10; break;
    case 'm': case 'M': r.shift = 20; break;
    case 'g': case 'G': r.shift = 30; break;
    case 't': case 'T': r.shift = 40; r.tera = 1; break;
    default: break;
    }
    if (r.shift)
        p++;
    if (r.shift && (p[0] == 'i' || p[0] == 'I') && p[1] == 'B') {
        p += 2;
        r.unit = 1;
    } else if (*p == 'B') {
        p++;
        r.unit = 1;
    }
    r.ok = !*p;
    return r;
}

/* the integer part times 2^shift, exactly (0: above 2^64 - 1) */
static int exact_int(const ref *r, unsigned __int128 *out)
{
    unsigned __int128 v = 0;
    for (size_t i = 0; i < r->nip; i++) {
        v = v * 10 + (unsigned)(r->ip[i] - '0');
        if (v > UINT64_MAX)
            return 0;
    }
    v <<= r->shift;
    *out = v;
    return v <= UINT64_MAX;
}

static void round_trip(uint64_t v)
{
    char buf[64];
    uint64_t w = 0;
    snprintf(buf, sizeof buf, "%llu", (unsigned long long)v);
    if (ferry_parse_size(buf, &w) != 0 || w != v)
        abort();
    if (ferry__parse_number(buf, 1, &w) || w != v)
        abort();
    if (ferry__parse_number(buf, 0, &w) || w != v)
        abort();
    ferry__size_str(v, buf, sizeof buf);
    if (ferry_parse_size(buf, &w) != 0 || w != v)
        abort();
    if (ferry__parse_number(buf, 1, &w) || w != v)
        abort();
}

static void check_counts(const char *s, const ref *r, int sz_ok, uint64_t sz)
{
    uint64_t c = 0x5a5a5a5a5a5a5a5aull;
    const char *why = ferry__parse_number(s, 0, &c);
    int in_grammar = r->ok && !r->unit && !r->tera;
    if (!why) {
        if (!in_grammar)
            abort();
        /* as a size of the same text */
        if (!sz_ok || c != sz)
            abort();
        return;
    }
    if (c != 0x5a5a5a5a5a5a5a5aull || !*why)
        abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *s = malloc(size + 1);
    if (!s)
        return 0;
    memcpy(s, data, size);
    s[size] = 0;
    ref r = grammar(s);

    const uint64_t poison = 0xa5a5a5a5a5a5a5a5ull;
    uint64_t v1 = poison, v2 = poison;
    int rc = ferry_parse_size(s, &v1);
    const char *why = ferry__parse_number(s, 1, &v2);
    if (rc != 0 && (rc != -EINVAL || v1 != poison))
        abort();
    if (why && (v2 != poison || !*why))
        abort();
    if (!r.ok && (rc == 0 || !why))
        abort(); /* outside the grammar: both refuse */

    unsigned __int128 ie = 0;
    int int_fits = r.ok && exact_int(&r, &ie);
    if (r.ok && !r.fr) {
        /* a whole number: accepted by both exactly when it fits */
        if ((rc == 0) != int_fits || (!why) != int_fits)
            abort();
        if (int_fits && (v1 != (uint64_t)ie || v2 != (uint64_t)ie))
            abort();
    }
    if (r.ok && r.fr) {
        /* the fraction's exact value, up to 24 digits (the rest cannot
         * move it by a byte) */
        unsigned __int128 num = 0, den = 1;
        for (size_t i = 0; i < r.nfr && i < 24; i++) {
            num = num * 10 + (unsigned)(r.fr[i] - '0');
            den *= 10;
        }
        unsigned __int128 f = num << r.shift; /* num < 10^24 < 2^80, shift <= 40 */
        unsigned __int128 fl = f / den, rem = f % den;
        int whole = rem == 0 && r.nfr <= 6;
        if (!why) {
            /* the CLI's: a whole number of bytes, exact */
            if (!whole || !int_fits || r.nfr > 6 || ie + fl > UINT64_MAX || v2 != (uint64_t)(ie + fl))
                abort();
        } else if (whole && int_fits && ie + fl <= UINT64_MAX &&
                   strcmp(why, "too large")) {
            abort(); /* refused a whole number of bytes that fits */
        }
        if (rc == 0) {
            /* the public one's: the nearest byte (within one of it) */
            if (!int_fits)
                abort();
            unsigned __int128 lo = ie + fl, hi = ie + fl + (rem ? 1 : 0);
            if (v1 < lo || v1 > hi)
                abort();
            if (!why && v1 != v2)
                abort();
        } else if (!why || (int_fits && ie + fl + (rem ? 1 : 0) <= UINT64_MAX)) {
            abort(); /* refused a size that fits */
        }
    }
    if (rc == 0)
        round_trip(v1);
    if (!why)
        round_trip(v2);
    check_counts(s, &r, !why, v2);
    free(s);
    return 0;
}
