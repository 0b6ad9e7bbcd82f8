/*
 * remote_url.c - the strict parser of remote tier URLs.
 *
 * Invariant: a URL is either fully understood or refused with FERRY_EPARSE
 * (FERRY_ENOTSUP for TLS) and a message that says which part is wrong; no
 * part is guessed, ignored or silently truncated, so a typo in a config
 * cannot send chunks to the wrong server or database. The input is outside
 * data (configs, command lines) and is fuzzed (fuzz/fuzz_remote_url.c):
 * the parser reads url[0..len) only and never assumes a terminating NUL.
 * Messages never contain the password: the URL is quoted with it replaced
 * by "***" and non-printable bytes escaped.
 *
 * Grammar:
 *   redis://[[user]:password@]host[:port][/db][?query]     (also valkey://)
 *   unix://[[user]:password@]/path[?query]                 (also redis+unix://,
 *                                                           valkey+unix://)
 *   userinfo without ':' is a password (as redis-cli reads it);
 *   query = key=value ('&' key=value)*, keys db, user, password, cluster.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "remote_int.h"

typedef struct span {
    const char *p;
    size_t n;
} span;

static int is_unreserved(unsigned char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
           c == '-' || c == '.' || c == '_' || c == '~';
}
static int is_subdelim(unsigned char c)
{
    return c && strchr("!$&'()*+,;=", c) != NULL;
}
static int hexval(unsigned char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

/* Where the userinfo password of url[0..len) may be: [*a, *b), both NULL
 * when there is none. wide: a URL that did not parse may have an
 * unescaped '?' or '#' in its password, so look for its '@' up to the end
 * (this over-redacts a '@' in a query value, harmless in a message). */
static void secret_span(const char *url, size_t len, int wide, const char **a, const char **b)
{
    const char *end = url + len, *ss = NULL;
    *a = *b = NULL;
    for (const char *q = url; q + 2 < end; q++)
        if (q[0] == ':' && q[1] == '/' && q[2] == '/') {
            ss = q + 3;
            break;
        }
    if (!ss)
        return;
    const char *ae = ss;
    while (ae < end && (wide || (*ae != '?' && *ae != '#')))
        ae++;
    /* the password runs from after the first ':' up to the last '@'
     * (over-redacting a unix path with '@' in it is harmless) */
    const char *at = NULL, *first_at = NULL;
    for (const char *q = ss; q < ae; q++)
        if (*q == '@') {
            at = q;
            if (!first_at)
                first_at = q;
        }
    if (!at) {
        /* no '@': a URL that did not parse may still be a password whose
         * '@' was forgotten ("redis://:pw/..."): what follows the colon of
         * its authority is hidden unless it is a port (digits) */
        if (!wide)
            return;
        const char *aend = ss;
        while (aend < end && *aend != '/')
            aend++;
        const char *colon = memchr(ss, ':', (size_t)(aend - ss));
        if (!colon)
            return;
        for (const char *q = colon + 1; q < aend; q++)
            if (*q < '0' || *q > '9') {
                *a = colon + 1;
                *b = aend;
                return;
            }
        return;
    }
    /* the user/password colon precedes the first '@' */
    const char *colon = memchr(ss, ':', (size_t)(first_at - ss));
    *a = colon ? colon + 1 : ss;
    *b = at;
}

/* where the first "password=" query value starts, else NULL (for a URL
 * that did not parse it runs to the end: an unescaped '&' may be in it) */
static const char *query_secret(const char *url, size_t len)
{
    for (const char *q = url; q + 9 <= url + len; q++)
        if (q > url && (q[-1] == '?' || q[-1] == '&') && !memcmp(q, "password=", 9))
            return q + 9;
    return NULL;
}

/* Redacted, printable copy of url for messages: the userinfo password and
 * any password= query value become "***". */
static void redact(const char *url, size_t len, int wide, char *out, size_t cap)
{
    size_t o = 0;
    const char *end = url + len;
    const char *pw_a, *pw_b;
    secret_span(url, len, wide, &pw_a, &pw_b);
    for (const char *q = url; q < end && o + 8 < cap;) {
        if (q == pw_a && pw_b) {
            o += (size_t)snprintf(out + o, cap - o, "***");
            q = pw_b;
            continue;
        }
        /* password=... in a query */
        if (q > url && (q[-1] == '?' || q[-1] == '&') && (size_t)(end - q) >= 9 &&
            !memcmp(q, "password=", 9)) {
            o += (size_t)snprintf(out + o, cap - o, "password=***");
            q += 9;
            while (q < end && (wide || *q != '&'))
                q++;
            continue;
        }
        unsigned char c = (unsigned char)*q++;
        if (c >= 0x20 && c < 0x7f && c != '\\')
            out[o++] = (char)c;
        else
            o += (size_t)snprintf(out + o, cap - o, "\\x%02x", c);
    }
    if (o + 8 >= cap && o + 4 <= cap) {
        o = cap - 4;
        memcpy(out + o, "...", 3);
        o += 3;
    }
    out[o < cap ? o : cap - 1] = 0;
}

typedef struct pctx {
    const char *url;
    size_t len;
    ferry__errbuf *eb;
    const char *sa, *sb, *qs; /* secret regions (wide): [sa, sb), [qs, end) */
    char shown[600];
} pctx;

static int perr_secret(pctx *c, const char *what);

static int perr(pctx *c, const char *what, span s)
{
    /* a fragment of a URL that did not parse may be a piece of its
     * password: never quote one that touches where a password may be */
    if (s.p && ((c->sa && s.p < c->sb && s.p + s.n > c->sa) ||
                (c->qs && s.p + s.n > c->qs)))
        return perr_secret(c, what);
    char frag[80];
    size_t o = 0;
    for (size_t i = 0; i < s.n && o + 8 < sizeof frag; i++) {
        unsigned char ch = (unsigned char)s.p[i];
        if (ch >= 0x20 && ch < 0x7f && ch != '\\')
            frag[o++] = (char)ch;
        else
            o += (size_t)snprintf(frag + o, sizeof frag - o, "\\x%02x", ch);
    }
    frag[o] = 0;
    if (s.p)
        return ferry__err_set(c->eb, FERRY_EPARSE, "remote URL '%s': %s ('%s')", c->shown, what,
                              frag);
    return ferry__err_set(c->eb, FERRY_EPARSE, "remote URL '%s': %s", c->shown, what);
}
static int perr_secret(pctx *c, const char *what)
{
    return ferry__err_set(c->eb, FERRY_EPARSE, "remote URL '%s': %s", c->shown, what);
}

/* percent-decode s into out (cap bytes, NUL-terminated); chars allowed raw:
 * unreserved, sub-delims (minus those in `except`), and `extra` */
static int decode(pctx *c, span s, const char *extra, const char *except, char *out, size_t cap,
                  const char *what, int secret)
{
    size_t o = 0;
    for (size_t i = 0; i < s.n; i++) {
        unsigned char ch = (unsigned char)s.p[i];
        if (ch == '%') {
            if (i + 2 >= s.n)
                return secret ? perr_secret(c, "truncated %-escape in the password")
                              : perr(c, "truncated %-escape", s);
            int hi = hexval((unsigned char)s.p[i + 1]), lo = hexval((unsigned char)s.p[i + 2]);
            if (hi < 0 || lo < 0)
                return secret ? perr_secret(c, "bad %-escape in the password")
                              : perr(c, "bad %-escape", s);
            ch = (unsigned char)(hi * 16 + lo);
            if (ch == 0)
                return secret ? perr_secret(c, "%00 in the password")
                              : perr(c, "%00 is not allowed", s);
            i += 2;
        } else if (!(is_unreserved(ch) || (is_subdelim(ch) && !(except && strchr(except, ch))) ||
                     (extra && ch && strchr(extra, ch)))) {
            if (secret)
                return perr_secret(c, "the password has a character that must be %-escaped");
            char w[160];
            snprintf(w, sizeof w, "%s has a character that must be %%-escaped: '%c'", what,
                     ch >= 0x20 && ch < 0x7f ? ch : '?');
            return perr(c, w, s);
        }
        if (o + 1 >= cap) {
            char w[160];
            snprintf(w, sizeof w, "%s longer than %zu bytes", what, cap - 1);
            return secret ? perr_secret(c, w) : perr(c, w, s);
        }
        out[o++] = (char)ch;
    }
    out[o] = 0;
    return 0;
}

static int parse_uint(span s, unsigned long max, unsigned long *out)
{
    if (s.n == 0 || s.n > 10)
        return -1;
    unsigned long v = 0;
    for (size_t i = 0; i < s.n; i++) {
        if (s.p[i] < '0' || s.p[i] > '9')
            return -1;
        v = v * 10 + (unsigned long)(s.p[i] - '0');
    }
    if (v > max)
        return -1;
    *out = v;
    return 0;
}

static int span_eq(span s, const char *lit)
{
    size_t n = strlen(lit);
    return s.n == n && !memcmp(s.p, lit, n);
}

static int parse_userinfo(pctx *c, span ui, ferry__rurl *u)
{
    const char *colon = memchr(ui.p, ':', ui.n);
    span pw = ui;
    if (colon) {
        span us = {ui.p, (size_t)(colon - ui.p)};
        pw.p = colon + 1;
        pw.n = ui.n - us.n - 1;
        if (us.n) {
            int rc = decode(c, us, NULL, NULL, u->user, sizeof u->user, "user name", 0);
            if (rc)
                return rc;
            u->has_user = 1;
        }
    }
    if (pw.n == 0)
        return perr_secret(c, "empty password before '@' (leave out the '@' part for none)");
    int rc = decode(c, pw, ":", NULL, u->password, sizeof u->password, "password", 1);
    if (rc)
        return rc;
    u->has_password = 1;
    return 0;
}

static int parse_query(pctx *c, span q, ferry__rurl *u, int *db_seen)
{
    int seen_user = u->has_user, seen_pw = u->has_password, seen_cluster = 0;
    const char *p = q.p, *end = q.p + q.n;
    if (q.n == 0)
        return perr(c, "empty query after '?'", q);
    while (p <= end) {
        const char *amp = memchr(p, '&', (size_t)(end - p));
        if (!amp)
            amp = end;
        span kv = {p, (size_t)(amp - p)};
        const char *eq = memchr(kv.p, '=', kv.n);
        if (!eq)
            return perr(c, "query item without '=' (expected key=value)", kv);
        span k = {kv.p, (size_t)(eq - kv.p)}, v = {eq + 1, kv.n - k.n - 1};
        int secret = span_eq(k, "password");
        if (v.n == 0)
            return perr(c, "query item with an empty value", k);
        if (span_eq(k, "db")) {
            unsigned long d;
            if (*db_seen)
                return perr(c, "db given twice", kv);
            if (parse_uint(v, 1ul << 24, &d))
                return perr(c, "db must be a decimal number in 0..16777216", v);
            u->db = (int)d;
            *db_seen = 1;
        } else if (span_eq(k, "user")) {
            if (seen_user)
                return perr(c, "user given twice", k);
            int rc = decode(c, v, ":@/?", "&=", u->user, sizeof u->user, "user name", 0);
            if (rc)
                return rc;
            u->has_user = seen_user = 1;
        } else if (secret) {
            if (seen_pw)
                return perr_secret(c, "password given twice");
            int rc = decode(c, v, ":@/?", "&=", u->password, sizeof u->password, "password", 1);
            if (rc)
                return rc;
            u->has_password = seen_pw = 1;
        } else if (span_eq(k, "cluster")) {
            if (seen_cluster)
                return perr(c, "cluster given twice", kv);
            seen_cluster = 1;
            if (span_eq(v, "auto"))
                u->cluster = FERRY__RCLUSTER_AUTO;
            else if (span_eq(v, "yes"))
                u->cluster = FERRY__RCLUSTER_YES;
            else if (span_eq(v, "no"))
                u->cluster = FERRY__RCLUSTER_NO;
            else
                return perr(c, "cluster must be auto, yes or no", v);
        } else {
            return perr(c, "unknown query key (known: db, user, password, cluster)", k);
        }
        if (amp == end)
            break;
        p = amp + 1;
        if (p == end)
            return perr(c, "query ends with '&'", q);
    }
    if (u->has_user && !u->has_password)
        return perr(c, "a user name needs a password", q);
    return 0;
}

static int parse_host_port(pctx *c, span hp, ferry__rurl *u)
{
    span host = hp, port = {NULL, 0};
    if (hp.n && hp.p[0] == '[') {
        const char *rb = memchr(hp.p, ']', hp.n);
        if (!rb)
            return perr(c, "IPv6 address without closing ']'", hp);
        host.p = hp.p + 1;
        host.n = (size_t)(rb - hp.p - 1);
        if (host.n == 0)
            return perr(c, "empty IPv6 address", hp);
        for (size_t i = 0; i < host.n; i++) {
            unsigned char ch = (unsigned char)host.p[i];
            if (!(hexval(ch) >= 0 || ch == ':' || ch == '.'))
                return perr(c, "bad character in IPv6 address", host);
        }
        const char *after = rb + 1, *end = hp.p + hp.n;
        if (after < end) {
            if (*after != ':')
                return perr(c, "expected ':port' after ']'", hp);
            port.p = after + 1;
            port.n = (size_t)(end - after - 1);
            if (port.n == 0)
                return perr(c, "empty port after ':'", hp);
        }
    } else {
        const char *colon = memchr(hp.p, ':', hp.n);
        if (colon) {
            host.n = (size_t)(colon - hp.p);
            port.p = colon + 1;
            port.n = hp.n - host.n - 1;
            if (port.n == 0)
                return perr(c, "empty port after ':'", hp);
        }
        if (host.n == 0)
            return perr(c, "empty host", hp);
        for (size_t i = 0; i < host.n; i++) {
            unsigned char ch = (unsigned char)host.p[i];
            if (!(is_unreserved(ch) && ch != '~'))
                return perr(c, "bad character in host name (IPv6 needs [brackets])", host);
        }
        if (host.p[0] == '.' || host.p[0] == '-')
            return perr(c, "host name starts with '.' or '-'", host);
    }
    if (host.n >= sizeof u->host)
        return perr(c, "host name longer than 255 bytes", (span){host.p, 32});
    memcpy(u->host, host.p, host.n);
    u->host[host.n] = 0;
    u->port = 6379;
    if (port.p) {
        unsigned long pv;
        if (parse_uint(port, 65535, &pv) || pv == 0)
            return perr(c, "port must be a decimal number in 1..65535", port);
        u->port = (int)pv;
    }
    return 0;
}

int ferry__rurl_parse(const char *url, size_t len, ferry__rurl *out, ferry__errbuf *eb)
{
    pctx c = {url, len, eb, NULL, NULL, NULL, ""};
    ferry__rurl u;
    memset(&u, 0, sizeof u);
    u.cluster = FERRY__RCLUSTER_AUTO;
    if (!url)
        return ferry__err_set(eb, FERRY_EPARSE, "remote URL: NULL");
    /* until it parses, quote it with everything that may be a password
     * hidden; once it has, with exactly the password hidden */
    redact(url, len, 1, c.shown, sizeof c.shown);
    secret_span(url, len, 1, &c.sa, &c.sb);
    c.qs = query_secret(url, len);
    if (memchr(url, 0, len))
        return perr(&c, "contains a NUL byte", (span){NULL, 0});
    if (len == 0)
        return perr(&c, "empty (expected redis://host:port/db or unix:///path)", (span){NULL, 0});
    if (len > 4000)
        return perr(&c, "longer than 4000 bytes", (span){NULL, 0});
    const char *ss = NULL;
    for (size_t i = 0; i + 2 < len; i++)
        if (url[i] == ':' && url[i + 1] == '/' && url[i + 2] == '/') {
            ss = url + i;
            break;
        }
    if (!ss)
        return perr(&c, "no scheme (expected redis://, valkey://, unix:// or redis+unix://)",
                    (span){NULL, 0});
    span scheme = {url, (size_t)(ss - url)};
    if (span_eq(scheme, "rediss") || span_eq(scheme, "valkeys"))
        return ferry__err_set(eb, FERRY_ENOTSUP,
                              "remote URL '%s': TLS (%.*s://) is not supported: this hiredis "
                              "(0.14) has no TLS; run a TLS tunnel (stunnel, spiped) on "
                              "loopback and give its redis:// address",
                              c.shown, (int)scheme.n, scheme.p);
    if (span_eq(scheme, "redis") || span_eq(scheme, "valkey"))
        u.is_unix = 0;
    else if (span_eq(scheme, "unix") || span_eq(scheme, "redis+unix") ||
             span_eq(scheme, "valkey+unix"))
        u.is_unix = 1;
    else
        return perr(&c, "unknown scheme (expected redis, valkey, unix, redis+unix)", scheme);

    const char *p = ss + 3, *end = url + len;
    if (memchr(p, '#', (size_t)(end - p)))
        return perr(&c, "fragments ('#') are not allowed", (span){NULL, 0});
    const char *qm = memchr(p, '?', (size_t)(end - p));
    span query = {NULL, 0};
    const char *rest_end = end;
    if (qm) {
        query.p = qm + 1;
        query.n = (size_t)(end - qm - 1);
        rest_end = qm;
    }
    /* authority (userinfo@host:port, or just userinfo@ for unix) */
    const char *slash = memchr(p, '/', (size_t)(rest_end - p));
    const char *auth_end = slash ? slash : rest_end;
    span auth = {p, (size_t)(auth_end - p)};
    span ui = {NULL, 0}, hp = auth;
    const char *at = memchr(auth.p, '@', auth.n);
    if (at) {
        if (memchr(at + 1, '@', (size_t)(auth_end - at - 1)))
            return perr_secret(&c, "more than one '@' (escape '@' in a password as %40)");
        ui.p = auth.p;
        ui.n = (size_t)(at - auth.p);
        hp.p = at + 1;
        hp.n = (size_t)(auth_end - at - 1);
        int rc = parse_userinfo(&c, ui, &u);
        if (rc)
            return rc;
    }
    int db_seen = 0;
    if (u.is_unix) {
        if (hp.n)
            return perr_secret(&c, "a unix socket URL has no host (write unix:///path/to/socket; "
                                   "'/' in a password must be %-escaped)");
        if (!slash)
            return perr(&c, "no socket path (write unix:///path/to/socket)", (span){NULL, 0});
        span path = {slash, (size_t)(rest_end - slash)};
        if (path.n < 2)
            return perr(&c, "empty socket path", path);
        int rc = decode(&c, path, "/:@", NULL, u.path, sizeof u.path, "socket path", 0);
        if (rc)
            return rc;
        if (path.p[path.n - 1] == '/')
            return perr(&c, "socket path ends with '/'", path);
    } else {
        if (slash && memchr(slash, '@', (size_t)(rest_end - slash)))
            return perr_secret(&c, "'@' after the host ('/' or '@' in a password must be "
                                   "%-escaped)");
        int rc = parse_host_port(&c, hp, &u);
        if (rc)
            return rc;
        if (slash) {
            span dbs = {slash + 1, (size_t)(rest_end - slash - 1)};
            if (dbs.n) {
                unsigned long d;
                if (parse_uint(dbs, 1ul << 24, &d))
                    return perr(&c, "database after '/' must be a decimal number in 0..16777216",
                                dbs);
                u.db = (int)d;
                db_seen = 1;
            }
        }
    }
    if (qm) {
        int rc = parse_query(&c, query, &u, &db_seen);
        if (rc)
            return rc;
    }
    if (u.cluster == FERRY__RCLUSTER_YES && u.is_unix)
        return perr(&c, "cluster=yes needs host:port addresses, not a unix socket",
                    (span){NULL, 0});
    if (u.cluster == FERRY__RCLUSTER_YES && u.db != 0)
        return perr(&c, "a Redis Cluster has only database 0", (span){NULL, 0});
    redact(url, len, 0, u.redacted, sizeof u.redacted);
    *out = u;
    return 0;
}

int ferry_remote_url_validate(const char *url)
{
    ferry__rurl u;
    return ferry__rurl_parse(url, url ? strlen(url) : 0, &u, NULL);
}
