/*
 * test_remote.c - the remote tier against real redis-server processes
 * (started here on free loopback ports; skipped with 77 when redis-server
 * is not installed), plus its URL parser and value codec.
 */
/* ferry-test-labels: concurrent */
/* ferry-test-timeout: 300 */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdatomic.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <hiredis/hiredis.h>
#include <xxhash.h>

#include "ferry_test.h"
#include "remote/remote_int.h"
#include "redis_server.h"

static ft_redis g_srv; /* shared by the tests that do not stop it */
static const char LAYOUT_A[] = "llama-3-8b|bf16|L32|kv2|h8x128|tp0/1";
static const char LAYOUT_B[] = "mistral-7b|bf16|L32|kv2|h8x128|tp0/1";

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static ferry_remote_options opts_a(void)
{
    ferry_remote_options o = FERRY_REMOTE_OPTIONS_INIT;
    o.layout = LAYOUT_A;
    o.layout_len = sizeof LAYOUT_A - 1;
    o.connect_timeout_ms = 300;
    o.command_timeout_ms = 300;
    o.backoff_initial_ms = 20;
    o.backoff_max_ms = 100;
    return o;
}

static ferry_remote *open_a(const ft_redis *s, int db, const char *prefix)
{
    char url[128];
    ferry_remote_options o = opts_a();
    o.key_prefix = prefix;
    ferry_remote *r = NULL;
    FT_ASSERT_OK(ferry_remote_open(ft_redis_url(s, db, url, sizeof url), &o, &r));
    return r;
}

static ferry_remote_stats metrics(ferry_remote *r)
{
    ferry_remote_stats m = FERRY_REMOTE_STATS_INIT;
    FT_ASSERT_OK(ferry_remote_stats_get(r, &m));
    return m;
}

/* ---- a hostile or slow fake server ----
 * One loopback listener and one thread that serves one connection at a
 * time: PING is answered +PONG (the handshake); the first other command
 * gets what the mode says. */
enum fake_mode {
    FAKE_BIG_BULK,   /* "$335544320\r\n" then endless bytes */
    FAKE_ENDLESS_ARRAY, /* "*2147483647\r\n" then endless "*1\r\n" */
    FAKE_DRIP,       /* a 40-byte error reply, one byte per 100 ms */
    FAKE_LONG_LINE,  /* a 16 MiB status line without CRLF, then silence */
    FAKE_DEEP_ARRAY, /* "*1\r\n" nested without end */
    FAKE_LEN_11,     /* "$10737418240\r\n" (10 GiB: 11 digits) then endless bytes */
    FAKE_LEN_25,     /* a 25-digit length, past 2^64, then endless bytes */
    FAKE_REPLY,      /* fake.reply, then the connection closed */
};

typedef struct fake {
    int lfd, port, mode;
    const char *reply; /* FAKE_REPLY */
    atomic_int stop;
    atomic_ullong sent;
    pthread_t th;
} fake;

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* the name of the first complete command in buf[0..len), or "" */
static int fake_command(const char *buf, size_t len, char *name, size_t cap, size_t *used)
{
    const char *p = buf, *end = buf + len;
    const char *nl = memchr(p, '\n', (size_t)(end - p));
    if (!nl || *p != '*')
        return 0;
    long argc = strtol(p + 1, NULL, 10);
    p = nl + 1;
    name[0] = 0;
    for (long i = 0; i < argc; i++) {
        nl = p < end ? memchr(p, '\n', (size_t)(end - p)) : NULL;
        if (!nl || *p != '$')
            return 0;
        long l = strtol(p + 1, NULL, 10);
        p = nl + 1;
        if (end - p < l + 2)
            return 0;
        if (i == 0)
            snprintf(name, cap, "%.*s", (int)l, p);
        p += l + 2;
    }
    *used = (size_t)(p - buf);
    return 1;
}

static int fake_send(fake *f, int fd, const void *b, size_t n)
{
    size_t off = 0;
    while (off < n && !atomic_load(&f->stop)) {
        struct pollfd pf = {fd, POLLOUT, 0};
        if (poll(&pf, 1, 50) <= 0)
            continue;
        ssize_t k = send(fd, (const char *)b + off, n - off, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (k < 0 && (errno == EAGAIN || errno == EINTR))
            continue;
        if (k <= 0)
            return -1;
        off += (size_t)k;
        atomic_fetch_add(&f->sent, (unsigned long long)k);
    }
    return atomic_load(&f->stop) ? -1 : 0;
}

static void fake_hostile(fake *f, int fd)
{
    static char junk[65536];
    memset(junk, 'x', sizeof junk);
    const uint64_t limit = 640ull << 20; /* a client without bounds still ends */
    switch (f->mode) {
    case FAKE_REPLY:
        fake_send(f, fd, f->reply, strlen(f->reply));
        return;
    case FAKE_BIG_BULK:
        if (fake_send(f, fd, "$335544320\r\n", 12))
            return;
        while (atomic_load(&f->sent) < limit && fake_send(f, fd, junk, sizeof junk) == 0)
            ;
        return;
    case FAKE_LEN_11:
    case FAKE_LEN_25: {
        const char *h = f->mode == FAKE_LEN_11 ? "$10737418240\r\n" : "$1234567890123456789012345\r\n";
        if (fake_send(f, fd, h, strlen(h)))
            return;
        while (atomic_load(&f->sent) < limit && fake_send(f, fd, junk, sizeof junk) == 0)
            ;
        return;
    }
    case FAKE_ENDLESS_ARRAY: {
        if (fake_send(f, fd, "*2147483647\r\n", 13))
            return;
        static char ones[65536];
        for (size_t i = 0; i + 4 <= sizeof ones; i += 4)
            memcpy(ones + i, ":1\r\n", 4);
        while (atomic_load(&f->sent) < limit && fake_send(f, fd, ones, sizeof ones) == 0)
            ;
        return;
    }
    case FAKE_DEEP_ARRAY: {
        static char nest[65536];
        for (size_t i = 0; i + 4 <= sizeof nest; i += 4)
            memcpy(nest + i, "*1\r\n", 4);
        while (atomic_load(&f->sent) < limit && fake_send(f, fd, nest, sizeof nest) == 0)
            ;
        return;
    }
    case FAKE_DRIP: {
        const char *rep = "-ERR dripped one byte per 100 ms.......\r\n";
        for (size_t i = 0; rep[i]; i++) {
            if (fake_send(f, fd, rep + i, 1))
                return;
            for (int k = 0; k < 10 && !atomic_load(&f->stop); k++)
                nanosleep(&(struct timespec){0, 10000000L}, NULL);
        }
        return;
    }
    case FAKE_LONG_LINE:
        if (fake_send(f, fd, "+", 1))
            return;
        for (int i = 0; i < 256; i++)
            if (fake_send(f, fd, junk, sizeof junk))
                return;
        while (!atomic_load(&f->stop)) /* and no CRLF, ever */
            nanosleep(&(struct timespec){0, 10000000L}, NULL);
        return;
    }
}

static void *fake_main(void *arg)
{
    fake *f = arg;
    while (!atomic_load(&f->stop)) {
        struct pollfd pl = {f->lfd, POLLIN, 0};
        if (poll(&pl, 1, 50) <= 0)
            continue;
        int fd = accept(f->lfd, NULL, NULL);
        if (fd < 0)
            continue;
        char buf[8192];
        size_t have = 0;
        int done = 0;
        while (!done && !atomic_load(&f->stop)) {
            struct pollfd pc = {fd, POLLIN, 0};
            if (poll(&pc, 1, 50) <= 0)
                continue;
            ssize_t k = recv(fd, buf + have, sizeof buf - have, 0);
            if (k <= 0)
                break;
            have += (size_t)k;
            char name[32];
            size_t used;
            while (!done && fake_command(buf, have, name, sizeof name, &used)) {
                memmove(buf, buf + used, have - used);
                have -= used;
                if (!strcmp(name, "PING")) {
                    if (fake_send(f, fd, "+PONG\r\n", 7))
                        done = 1;
                } else {
                    fake_hostile(f, fd);
                    done = 1;
                }
            }
            if (have == sizeof buf)
                have = 0; /* a large SET value: its command is not needed whole */
        }
        close(fd);
    }
    return NULL;
}

static void fake_start(fake *f, int mode)
{
    memset(f, 0, sizeof *f);
    f->mode = mode;
    f->lfd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(f->lfd >= 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    assert_int_equal(bind(f->lfd, (struct sockaddr *)&a, sizeof a), 0);
    socklen_t al = sizeof a;
    assert_int_equal(getsockname(f->lfd, (struct sockaddr *)&a, &al), 0);
    f->port = ntohs(a.sin_port);
    assert_int_equal(listen(f->lfd, 8), 0);
    assert_int_equal(pthread_create(&f->th, NULL, fake_main, f), 0);
}

static void fake_stop(fake *f)
{
    atomic_store(&f->stop, 1);
    pthread_join(f->th, NULL);
    close(f->lfd);
}

/* A GET answered with a length of 11 digits or more (a server whose
 * proto-max-bulk-len was raised past 10 GB) is a value over the limit like
 * any other: refused unread, naming the length the server sent, the
 * connection dropped, the remote not down - where a length past 10 digits
 * was read as a broken reply and took the remote down. */
static void lengths_of_many_digits_are_over_the_limit(void **state)
{
    (void)state;
    static const int modes[] = {FAKE_LEN_11, FAKE_LEN_25};
    static const char *const text[] = {"10737418240", "1234567890123456789012345"};
    for (size_t mi = 0; mi < 2; mi++) {
        fake f;
        fake_start(&f, modes[mi]);
        char url[128];
        snprintf(url, sizeof url, "redis://127.0.0.1:%d/0?cluster=no", f.port);
        ferry_remote_options o = opts_a();
        o.command_timeout_ms = 2000;
        ferry_remote *r = NULL;
        FT_ASSERT_OK(ferry_remote_open(url, &o, &r));
        uint8_t dst[4096];
        memset(dst, 0xee, sizeof dst);
        int64_t t0 = now_ms();
        assert_int_equal(ferry_remote_get(r, "key", 3, dst, sizeof dst), FERRY_ECORRUPT);
        assert_true(now_ms() - t0 < 1500); /* refused at its first line, not timed out */
        const char *msg = ferry_remote_last_error(r);
        if (!strstr(msg, text[mi]) || !strstr(msg, "536870912"))
            fprintf(stderr, "message: %s\n", msg);
        assert_non_null(strstr(msg, text[mi]));
        assert_non_null(strstr(msg, "536870912"));
        for (size_t i = 0; i < sizeof dst; i++)
            assert_int_equal(dst[i], 0xee);
        ferry_remote_stats m = metrics(r);
        assert_int_equal(m.down, 0);
        assert_int_equal(m.corrupt, 1);
        assert_int_equal(m.bytes_read, 0);
        ferry_remote_close(r);
        fake_stop(&f);
    }
}

/* ferry__rconn_get_into on reply bytes from a socketpair (the fuzz
 * target's harness): its return, with g filled in */
static int get_from_bytes(const char *reply, size_t len, ferry__rget *g, ferry__errbuf *eb)
{
    int sv[2];
    assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
    assert_int_equal(write(sv[1], reply, len), (ssize_t)len);
    shutdown(sv[1], SHUT_WR);
    redisContext *ctx = redisConnectFd(sv[0]);
    assert_non_null(ctx);
    ferry__rconn c;
    memset(&c, 0, sizeof c);
    c.c = ctx;
    c.port = 1;
    c.timeout_ms = 1000;
    memcpy(c.host, "test", 5);
    static uint8_t dst[4096];
    memset(g, 0, sizeof *g);
    g->key = "k";
    g->key_len = 1;
    g->layout = "L";
    g->layout_len = 1;
    g->key_sum = ferry__rvalue_key_sum("k", 1);
    g->dst = dst;
    g->cap = sizeof dst;
    int rc = ferry__rconn_get_into(&c, g, 0, eb);
    ferry__rconn_close(&c);
    close(sv[1]);
    return rc;
}

/* A length line with more after its digits is a broken reply, whatever
 * hides the rest: a line longer than the reader's 512-byte buffer (its
 * tail, "x" here, cut off) or a NUL byte inside it. Neither is read as
 * the digits before it (an over-limit value, or 5 bytes to read). */
static void a_length_line_with_more_after_its_digits_is_broken(void **state)
{
    (void)state;
    char longline[700];
    size_t n = 0;
    longline[n++] = '$';
    for (int i = 0; i < 600; i++)
        longline[n++] = (char)('1' + i % 9);
    memcpy(longline + n, "x\r\nhello\r\n", 10);
    n += 10;
    static const char nul[] = "$5\0garbage\r\nhello\r\n";
    const struct {
        const char *bytes;
        size_t len;
    } cases[] = {{longline, n}, {nul, sizeof nul - 1}};
    for (size_t i = 0; i < 2; i++) {
        ferry__rget g;
        ferry__errbuf eb;
        memset(&eb, 0, sizeof eb);
        int rc = get_from_bytes(cases[i].bytes, cases[i].len, &g, &eb);
        if (rc != -EPROTO)
            fprintf(stderr, "case %zu: rc %d kind %d code %d: %s\n", i, rc, g.kind, g.code,
                    rc ? eb.msg : g.msg);
        assert_int_equal(rc, -EPROTO);
        assert_non_null(strstr(eb.msg, "not a bulk string"));
    }
    /* while digits alone are a length: over the limit (400 of them, whole
     * in the buffer; 600 are not seen whole, and are broken), and 5 */
    ferry__rget g;
    ferry__errbuf eb;
    memcpy(longline + 401, "\r\n", 2);
    assert_int_equal(get_from_bytes(longline, 403, &g, &eb), 0);
    assert_int_equal(g.kind, FERRY__RGET_VALUE);
    assert_int_equal(g.code, FERRY_ECORRUPT);
    assert_non_null(strstr(g.msg, "over the"));
    assert_int_equal(get_from_bytes("$5\r\nhello\r\n", 11, &g, &eb), 0);
    assert_int_equal(g.kind, FERRY__RGET_VALUE);
    assert_int_equal(g.value_len, 5);
}

static long maxrss_kib(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_maxrss;
}

enum { OP_EXISTS, OP_PUT_SYNC, OP_DELETE, OP_GET, OP_COUNT };
static const char *const op_name[] = {"exists", "put_sync", "delete", "get"};

/* One call against a fake in each mode, for each call that reads a reply:
 * it fails (never data, never success) within about the command timeout,
 * not per read, the client's memory stays bounded whatever the server
 * sends, the failure is counted and the remote is down. */
static void hostile_server_is_bounded_in_time_and_memory(void **state)
{
    (void)state;
    const uint32_t timeout_ms = 300;
    static const int modes[] = {FAKE_BIG_BULK, FAKE_ENDLESS_ARRAY, FAKE_DEEP_ARRAY, FAKE_DRIP,
                                FAKE_LONG_LINE};
    long rss0 = maxrss_kib();
    for (size_t mi = 0; mi < sizeof modes / sizeof modes[0]; mi++)
        for (int op = 0; op < OP_COUNT; op++) {
            fake f;
            fake_start(&f, modes[mi]);
            char url[128];
            snprintf(url, sizeof url, "redis://127.0.0.1:%d/0?cluster=no", f.port);
            ferry_remote_options o = opts_a();
            o.command_timeout_ms = timeout_ms;
            o.backoff_initial_ms = 60000;
            o.backoff_max_ms = 60000;
            ferry_remote *r = NULL;
            FT_ASSERT_OK(ferry_remote_open(url, &o, &r));
            ferry_remote_key k = {"key", 3};
            uint8_t dst[4096];
            int64_t t0 = now_ms();
            int rc = 0;
            switch (op) {
            case OP_EXISTS:
                rc = ferry_remote_exists(r, &k, 1);
                assert_int_equal(rc, 0); /* a miss, never a hit */
                break;
            case OP_PUT_SYNC:
                rc = ferry_remote_put_sync(r, "key", 3, "value", 5);
                assert_true(rc < 0);
                break;
            case OP_DELETE:
                rc = ferry_remote_delete(r, &k, 1);
                assert_true(rc < 0);
                break;
            case OP_GET:
                rc = ferry_remote_get(r, "key", 3, dst, sizeof dst);
                assert_true(rc < 0);
                break;
            }
            int64_t took = now_ms() - t0;
            ferry_remote_stats m = metrics(r);
            if (modes[mi] == FAKE_BIG_BULK && op == OP_GET) {
                /* the direct GET reads the value header, refuses it and
                 * drops the connection instead of draining 320 MiB */
                assert_int_equal(rc, FERRY_ECORRUPT);
                assert_int_equal(m.corrupt, 1);
                m.errors = 1;
                m.down = 1;
            }
            if (took >= 2 * (int64_t)timeout_ms || m.errors != 1 || m.down != 1)
                fprintf(stderr, "mode %zu %s: rc %d after %lld ms, errors %llu, down %u: %s\n",
                        mi, op_name[op], rc, (long long)took, (unsigned long long)m.errors,
                        m.down, ferry_remote_last_error(r));
            assert_true(took < 2 * (int64_t)timeout_ms);
            assert_int_equal(m.errors, 1);
            assert_int_equal(m.down, 1);
            assert_int_equal(m.hits, 0);
            if (modes[mi] == FAKE_DRIP)
                assert_non_null(strstr(ferry_remote_last_error(r), "deadline"));
            ferry_remote_close(r);
            fake_stop(&f);
            /* whatever was sent, the client grew by less than 48 MiB */
            long grown = maxrss_kib() - rss0;
            if (grown >= 48 * 1024)
                fprintf(stderr, "mode %zu %s: max RSS grew %ld KiB (server sent %llu bytes)\n",
                        mi, op_name[op], grown, (unsigned long long)atomic_load(&f.sent));
            assert_true(grown < 48 * 1024);
        }
}

/* A server (or a proxy before it) that answers well-formed RESP of the
 * wrong kind or range: never a hit, never a success, never a count out of
 * 0..n or one that reads as an error code. DEL of one key answers 0 or 1;
 * SET answers +OK. */
static ferry_remote *open_fake_reply(fake *f, const char *reply)
{
    fake_start(f, FAKE_REPLY);
    f->reply = reply;
    char url[128];
    snprintf(url, sizeof url, "redis://127.0.0.1:%d/0?cluster=no", f->port);
    ferry_remote_options o = opts_a();
    o.command_timeout_ms = 5000; /* (every answer is prompt: a loaded machine is not) */
    o.backoff_initial_ms = 60000;
    o.backoff_max_ms = 60000;
    ferry_remote *r = NULL;
    FT_ASSERT_OK(ferry_remote_open(url, &o, &r));
    return r;
}

static void wrong_kind_of_reply_is_never_success(void **state)
{
    (void)state;
    static const char *const del_replies[] = {":-7\r\n", ":3000000000\r\n", ":2\r\n",
                                              "+OK\r\n", "$1\r\n1\r\n"};
    for (size_t i = 0; i < sizeof del_replies / sizeof del_replies[0]; i++) {
        fake f;
        ferry_remote *r = open_fake_reply(&f, del_replies[i]);
        ferry_remote_key k = {"key", 3};
        int rc = ferry_remote_delete(r, &k, 1);
        if (rc != -EPROTO)
            fprintf(stderr, "DEL answered %s: rc %d: %s\n", del_replies[i], rc,
                    ferry_remote_last_error(r));
        assert_int_equal(rc, -EPROTO);
        assert_non_null(strstr(ferry_remote_last_error(r), "DEL"));
        assert_int_equal(metrics(r).deletes, 0);
        ferry_remote_close(r);
        fake_stop(&f);
    }
    static const char *const set_replies[] = {":1\r\n", "$2\r\nOK\r\n", "$-1\r\n", "+QUEUED\r\n",
                                              "*0\r\n"};
    for (size_t i = 0; i < sizeof set_replies / sizeof set_replies[0]; i++) {
        fake f;
        ferry_remote *r = open_fake_reply(&f, set_replies[i]);
        int rc = ferry_remote_put_sync(r, "key", 3, "value", 5);
        if (rc != -EPROTO)
            fprintf(stderr, "SET answered %s: rc %d: %s\n", set_replies[i], rc,
                    ferry_remote_last_error(r));
        assert_int_equal(rc, -EPROTO);
        assert_non_null(strstr(ferry_remote_last_error(r), "SET"));
        assert_int_equal(metrics(r).puts_written, 0);
        ferry_remote_close(r);
        fake_stop(&f);
    }
    /* a GET answered with something other than a value, or a value cut
     * off by the server closing: never a hit */
    static const char *const get_replies[] = {":1\r\n", "+OK\r\n", "*1\r\n$1\r\nx\r\n",
                                              "$100\r\nabc"};
    for (size_t i = 0; i < sizeof get_replies / sizeof get_replies[0]; i++) {
        fake f;
        ferry_remote *r = open_fake_reply(&f, get_replies[i]);
        uint8_t dst[256];
        memset(dst, 0, sizeof dst);
        int rc = ferry_remote_get(r, "key", 3, dst, sizeof dst);
        assert_true(rc < 0);
        assert_int_equal(metrics(r).hits, 0);
        ferry_remote_close(r);
        fake_stop(&f);
    }
}

/* the reply framer alone: bounds found from headers, before the bytes */
static void reply_framer_bounds(void **state)
{
    (void)state;
    ferry__rframe f;
    char what[200];
    size_t took;
    static const struct {
        const char *bytes;
        size_t max;
        uint32_t elems;
        int want;
        size_t took;
    } cases[] = {
        {"+OK\r\n", 0, 0, 1, 5},
        {"+OK\r\n+NEXT\r\n", 0, 0, 1, 5},
        {"-ERR x\r\n", 0, 0, 1, 8},
        {":-42\r\n", 0, 0, 1, 6},
        {"$-1\r\n", 0, 0, 1, 5},
        {"$3\r\nabc\r\n", 0, 0, 1, 9},
        {"$3\r\nab", 0, 0, 0, 6},
        {"*-1\r\n", 0, 0, 1, 5},
        {"*0\r\n", 0, 0, 1, 4},
        {"*2\r\n:1\r\n*1\r\n$1\r\nx\r\n", 0, 3, 1, 19},
        {"*1\r\n:1\r\n", 0, 0, -EMSGSIZE, 0},          /* no array expected */
        {"*3\r\n", 0, 2, -EMSGSIZE, 0},                  /* more elements than allowed */
        {"$335544320\r\n", 0, 0, -EMSGSIZE, 0},          /* over 64 KiB, from the header */
        {"$100\r\n", 64, 0, -EMSGSIZE, 0},
        {"*2147483647\r\n", 0, 1u << 30, -EMSGSIZE, 0},
        {"*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n", 0, 100, -EPROTO, 0},
        {"$3\r\nabcX\n", 0, 0, -EPROTO, 0},
        {"!3\r\n", 0, 0, -EPROTO, 0},
        {":12a\r\n", 0, 0, -EPROTO, 0},
        {"$-2\r\n", 0, 0, -EPROTO, 0},
        {":99999999999999999999\r\n", 0, 0, -EPROTO, 0},
        {"+abc", 3, 0, -EMSGSIZE, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        ferry__rframe_start(&f, cases[i].max, cases[i].elems);
        took = 12345;
        int rc = ferry__rframe_scan(&f, cases[i].bytes, strlen(cases[i].bytes), &took, what,
                                    sizeof what);
        if (rc != cases[i].want)
            fprintf(stderr, "case %zu: %d (%s)\n", i, rc, rc < 0 ? what : "");
        assert_int_equal(rc, cases[i].want);
        if (rc >= 0)
            assert_int_equal(took, cases[i].took);
    }
    /* byte by byte is the same as all at once */
    const char *multi = "*2\r\n$5\r\nhello\r\n*2\r\n:7\r\n+ok\r\n";
    ferry__rframe_start(&f, 0, 16);
    int rc = 0;
    size_t n = strlen(multi), i = 0;
    for (; i < n && rc == 0; i++)
        rc = ferry__rframe_scan(&f, multi + i, 1, &took, what, sizeof what);
    assert_int_equal(rc, 1);
    assert_int_equal(i, n);
}

/* every option is range-checked before use: one past its maximum is
 * -EINVAL naming the field and the range; the maximum itself is taken */
static void options_are_range_checked(void **state)
{
    (void)state;
    const char *url = "redis://127.0.0.1:1/0?cluster=no"; /* nobody listens */
    static const struct {
        const char *name;
        size_t off;
        uint64_t max;
        int wide;
    } f[] = {
        {"connect_timeout_ms", offsetof(ferry_remote_options, connect_timeout_ms),
         FERRY_REMOTE_TIMEOUT_MAX_MS, 0},
        {"command_timeout_ms", offsetof(ferry_remote_options, command_timeout_ms),
         FERRY_REMOTE_TIMEOUT_MAX_MS, 0},
        {"backoff_initial_ms", offsetof(ferry_remote_options, backoff_initial_ms),
         FERRY_REMOTE_BACKOFF_MAX_MS, 0},
        {"backoff_max_ms", offsetof(ferry_remote_options, backoff_max_ms),
         FERRY_REMOTE_BACKOFF_MAX_MS, 0},
        {"queue_max_items", offsetof(ferry_remote_options, queue_max_items),
         FERRY_REMOTE_QUEUE_ITEMS_MAX, 0},
        {"queue_max_bytes", offsetof(ferry_remote_options, queue_max_bytes),
         FERRY_REMOTE_QUEUE_BYTES_MAX, 1},
        {"connections", offsetof(ferry_remote_options, connections),
         FERRY_REMOTE_CONNECTIONS_MAX, 0},
        {"ttl_s", offsetof(ferry_remote_options, ttl_s), FERRY_REMOTE_TTL_MAX_S, 0},
    };
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) {
        for (int over = 1; over >= 0; over--) {
            ferry_remote_options o = opts_a();
            o.flags = FERRY_REMOTE_LAZY;
            o.backoff_initial_ms = 0;
            o.backoff_max_ms = 0;
            uint64_t v = f[i].max + (uint64_t)over;
            if (f[i].wide) {
                memcpy((char *)&o + f[i].off, &v, sizeof v);
            } else {
                uint32_t v32 = (uint32_t)v;
                if (over && f[i].max == UINT32_MAX)
                    continue;
                memcpy((char *)&o + f[i].off, &v32, sizeof v32);
            }
            if (!strcmp(f[i].name, "backoff_initial_ms"))
                o.backoff_max_ms = FERRY_REMOTE_BACKOFF_MAX_MS;
            ferry_remote *r = NULL;
            int rc = ferry_remote_open(url, &o, &r);
            if (over) {
                assert_int_equal(rc, -EINVAL);
                assert_null(r);
                assert_non_null(strstr(ferry_last_error(), f[i].name));
                assert_non_null(strstr(ferry_last_error(), "out of range"));
            } else {
                if (rc != 0)
                    fprintf(stderr, "%s = %llu: %s\n", f[i].name, (unsigned long long)v,
                            ferry_last_error());
                assert_int_equal(rc, 0);
                ferry_remote_close(r);
            }
        }
    }
    /* the cap below the start, a prefix too long, unknown flags */
    ferry_remote_options o = opts_a();
    o.backoff_initial_ms = 1000;
    o.backoff_max_ms = 999;
    ferry_remote *r = NULL;
    assert_int_equal(ferry_remote_open(url, &o, &r), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "backoff_max_ms"));
    o = opts_a();
    char prefix[FERRY_REMOTE_KEY_MAX / 2 + 1];
    memset(prefix, 'p', sizeof prefix - 1);
    prefix[sizeof prefix - 1] = 0;
    o.key_prefix = prefix;
    assert_int_equal(ferry_remote_open(url, &o, &r), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "key_prefix"));
    o = opts_a();
    o.flags = 0x80;
    assert_int_equal(ferry_remote_open(url, &o, &r), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "flags"));
    o = opts_a();
    o.layout = NULL;
    o.layout_len = 3;
    assert_int_equal(ferry_remote_open(url, &o, &r), -EINVAL);
    assert_non_null(strstr(ferry_last_error(), "layout_len"));
    assert_null(r);
}

/* ---- URL parser ---- */

static void url_valid_forms(void **state)
{
    (void)state;
    ferry__rurl u;
    assert_int_equal(ferry__rurl_parse("redis://h1:7000/3", 17, &u, NULL), 0);
    assert_string_equal(u.host, "h1");
    assert_int_equal(u.port, 7000);
    assert_int_equal(u.db, 3);
    assert_int_equal(u.is_unix, 0);
    assert_int_equal(u.has_password, 0);
    assert_int_equal(u.cluster, FERRY__RCLUSTER_AUTO);

    const char *s = "redis://alice:p%40ss%3Aw0rd@127.0.0.1";
    assert_int_equal(ferry__rurl_parse(s, strlen(s), &u, NULL), 0);
    assert_string_equal(u.user, "alice");
    assert_string_equal(u.password, "p@ss:w0rd");
    assert_int_equal(u.port, 6379);
    assert_int_equal(u.db, 0);
    assert_null(strstr(u.redacted, "p%40ss"));
    assert_non_null(strstr(u.redacted, "***"));

    s = "redis://:secret@[::1]:6380/0?cluster=no";
    assert_int_equal(ferry__rurl_parse(s, strlen(s), &u, NULL), 0);
    assert_string_equal(u.host, "::1");
    assert_int_equal(u.port, 6380);
    assert_int_equal(u.has_user, 0);
    assert_string_equal(u.password, "secret");
    assert_int_equal(u.cluster, FERRY__RCLUSTER_NO);

    s = "redis://onlypassword@host"; /* no ':' -> a password, as redis-cli reads it */
    assert_int_equal(ferry__rurl_parse(s, strlen(s), &u, NULL), 0);
    assert_int_equal(u.has_user, 0);
    assert_string_equal(u.password, "onlypassword");

    s = "unix:///var/run/redis/redis.sock?db=5&password=pw";
    assert_int_equal(ferry__rurl_parse(s, strlen(s), &u, NULL), 0);
    assert_int_equal(u.is_unix, 1);
    assert_string_equal(u.path, "/var/run/redis/redis.sock");
    assert_int_equal(u.db, 5);
    assert_string_equal(u.password, "pw");
    assert_null(strstr(u.redacted, "pw"));

    s = "redis+unix://bob:pw@/tmp/r.sock";
    assert_int_equal(ferry__rurl_parse(s, strlen(s), &u, NULL), 0);
    assert_string_equal(u.user, "bob");
    assert_string_equal(u.path, "/tmp/r.sock");

    s = "valkey://cache.example.com:6390/";
    assert_int_equal(ferry__rurl_parse(s, strlen(s), &u, NULL), 0);
    assert_string_equal(u.host, "cache.example.com");
    assert_int_equal(u.db, 0);
    assert_int_equal(ferry_remote_url_validate("redis://localhost"), 0);
}

static void url_invalid_forms(void **state)
{
    (void)state;
    static const char *const bad[] = {
        "",
        "localhost:6379",
        "http://localhost",
        "redis://",
        "redis://:6379",
        "redis://host:0",
        "redis://host:65536",
        "redis://host:12ab",
        "redis://host:",
        "redis://host/abc",
        "redis://host/1/2",
        "redis://host/99999999999",
        "redis://ho st",
        "redis://host#frag",
        "redis://[::1",
        "redis://[]:5",
        "redis://[::1]x",
        "redis://user:@host",
        "redis://a@b@host",
        "redis://host/1?db=2",
        "redis://host?foo=bar",
        "redis://host?cluster=maybe",
        "redis://host?",
        "redis://host?db",
        "redis://host?db=",
        "redis://host?cluster=yes&cluster=no",
        "redis://host/1?cluster=yes",
        "redis://p%zzw@host",
        "redis://p%4@host",
        "redis://p%00w@host",
        "unix://",
        "unix://host/path",
        "unix:///",
        "unix:///tmp/dir/",
        "unix:///tmp/s?cluster=yes",
        "redis://-host",
        "redis://host?user=bob",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        ferry__rurl u;
        memset(&u, 0x5a, sizeof u);
        ferry__errbuf eb;
        int rc = ferry__rurl_parse(bad[i], strlen(bad[i]), &u, &eb);
        if (rc != FERRY_EPARSE)
            fail_msg("'%s' -> %d, expected FERRY_EPARSE", bad[i], rc);
        assert_non_null(strstr(eb.msg, "remote URL"));
        assert_int_equal(u.port, 0x5a5a5a5a); /* untouched on failure */
    }
    /* a message never shows the password */
    ferry__rurl u;
    ferry__errbuf eb;
    const char *s = "redis://user:hunter2@host:99999";
    assert_int_equal(ferry__rurl_parse(s, strlen(s), &u, &eb), FERRY_EPARSE);
    assert_null(strstr(eb.msg, "hunter2"));
    assert_non_null(strstr(eb.msg, "99999"));
    s = "redis://host/0?password=hunter2&bogus=1";
    assert_int_equal(ferry__rurl_parse(s, strlen(s), &u, &eb), FERRY_EPARSE);
    assert_null(strstr(eb.msg, "hunter2"));
    assert_non_null(strstr(eb.msg, "unknown query key"));
    /* a URL that does not parse may carry an unescaped '?', '#', '&' or
     * '/' inside its password: no piece of it is quoted, in the URL or as
     * the fragment that failed */
    static const char *const leaky[] = {
        "redis://:hun?ter2xyz@host/0",  "redis://:hun#ter2xyz@host/0",
        "redis://u:hun/ter2xyz@host/0", "redis://host/0?password=hun&ter2xyz",
        "redis://:hunter2xyz@host:0/0", "redis://u:hun?ter2xyz@host?db=1",
        "unix://:hun?ter2xyz@/tmp/s",   "redis://:hunter2xyz@@host",
        /* the '@' forgotten: the "port" is the password */
        "redis://:hunter2xyz/tmp/host:1/0", "redis://user:hunter2xyz/0",
    };
    for (size_t i = 0; i < sizeof leaky / sizeof leaky[0]; i++) {
        memset(&eb, 0, sizeof eb);
        assert_int_equal(ferry__rurl_parse(leaky[i], strlen(leaky[i]), &u, &eb), FERRY_EPARSE);
        assert_true(eb.msg[0] != 0);
        assert_null(strstr(eb.msg, "hun"));
        assert_null(strstr(eb.msg, "ter2xyz"));
        assert_null(strstr(ferry_last_error(), "ter2xyz"));
    }
    /* an embedded NUL is refused, not truncated */
    assert_int_equal(ferry__rurl_parse("redis://h\0st", 12, &u, NULL), FERRY_EPARSE);
    /* TLS is named as unsupported */
    assert_int_equal(ferry_remote_url_validate("rediss://host:6380"), FERRY_ENOTSUP);
    assert_non_null(strstr(ferry_last_error(), "TLS"));
    assert_int_equal(ferry_remote_url_validate(NULL), FERRY_EPARSE);
}

/* ---- value codec ---- */

static uint8_t *encode(const char *layout, const void *key, size_t klen, const void *pl,
                       size_t plen, size_t *len)
{
    size_t hl = ferry__rvalue_header_size(strlen(layout));
    uint8_t *v = malloc(hl + plen + 1);
    ferry__rvalue_encode_header(v, layout, strlen(layout), ferry__rvalue_key_sum(key, klen), pl,
                                plen);
    memcpy(v + hl, pl, plen);
    *len = hl + plen;
    return v;
}

/* the generic path's bounded read (GETRANGE key 0 cap+hl, its end
 * inclusive: at most cap+hl+1 bytes, whole when no more than cap+hl came)
 * of a value whose payload is the destination's size -2..+2: what fits is
 * copied exactly, with not a byte past it; what does not is -ENOBUFS with
 * the destination untouched; a value longer than its header says (bytes
 * appended by another writer), cut at the read's end or whole, and one cut
 * inside its header, are refused, never data */
static void value_range_outcome_at_the_destination_size(void **state)
{
    (void)state;
    const size_t cap = 4096;
    size_t hl = ferry__rvalue_header_size(strlen(LAYOUT_A));
    uint64_t ks = ferry__rvalue_key_sum("k1", 2);
    uint8_t payload[4100], dst[4096 + 64];
    ft_fill_pattern(payload, sizeof payload, 11);
    size_t fetch = cap + hl;
    for (size_t p = cap - 2; p <= cap + 2; p++) {
        size_t len;
        uint8_t *v = encode(LAYOUT_A, "k1", 2, payload, p, &len);
        size_t got = FERRY__MIN(len, fetch + 1);
        memset(dst, 0xA5, sizeof dst);
        ferry__rget g = {.layout = LAYOUT_A, .layout_len = strlen(LAYOUT_A), .key_sum = ks,
                         .dst = dst, .cap = cap};
        ferry__rvalue_range_outcome(&g, v, got, got <= fetch);
        assert_int_equal(g.kind, FERRY__RGET_VALUE);
        if (p <= cap) {
            assert_int_equal(g.code, 0);
            assert_int_equal(g.payload_len, p);
            assert_memory_equal(dst, payload, p);
            for (size_t k = p; k < sizeof dst; k++)
                assert_int_equal(dst[k], 0xA5);
        } else {
            assert_int_equal(g.code, -ENOBUFS);
            for (size_t k = 0; k < sizeof dst; k++)
                assert_int_equal(dst[k], 0xA5);
        }
        free(v);
    }
    /* a value of cap bytes with bytes appended after it (APPEND by
     * another client): cut at the read's end it is longer than it says */
    for (size_t extra = 1; extra <= 3; extra++) {
        size_t len;
        uint8_t *v = encode(LAYOUT_A, "k1", 2, payload, cap - 1, &len);
        uint8_t *w = malloc(len + extra);
        memcpy(w, v, len);
        memset(w + len, 0x5A, extra);
        size_t got = FERRY__MIN(len + extra, fetch + 1);
        memset(dst, 0xA5, sizeof dst);
        ferry__rget g = {.layout = LAYOUT_A, .layout_len = strlen(LAYOUT_A), .key_sum = ks,
                         .dst = dst, .cap = cap};
        ferry__rvalue_range_outcome(&g, w, got, got <= fetch);
        assert_int_equal(g.code, FERRY_ECORRUPT);
        for (size_t k = 0; k < sizeof dst; k++)
            assert_int_equal(dst[k], 0xA5);
        free(w);
        free(v);
    }
    /* a read cut inside the header (a server that sent less than asked for
     * while saying there is more) */
    size_t len;
    uint8_t *v = encode(LAYOUT_A, "k1", 2, payload, 10, &len);
    for (size_t cut = 0; cut < hl; cut++) {
        memset(dst, 0xA5, sizeof dst);
        ferry__rget g = {.layout = LAYOUT_A, .layout_len = strlen(LAYOUT_A), .key_sum = ks,
                         .dst = dst, .cap = cap};
        ferry__rvalue_range_outcome(&g, v, cut, 0);
        assert_true(g.code < 0);
        assert_int_equal(dst[0], 0xA5);
    }
    free(v);
}

static void value_codec_checks_every_field(void **state)
{
    (void)state;
    uint8_t payload[1000];
    ft_fill_pattern(payload, sizeof payload, 7);
    size_t len;
    uint8_t *v = encode(LAYOUT_A, "k1", 2, payload, sizeof payload, &len);
    uint64_t ks = ferry__rvalue_key_sum("k1", 2);
    const void *pl;
    size_t plen;
    assert_int_equal(ferry__rvalue_decode(v, len, LAYOUT_A, strlen(LAYOUT_A), ks, &pl, &plen, NULL),
                     0);
    assert_int_equal(plen, sizeof payload);
    assert_memory_equal(pl, payload, sizeof payload);

    /* other layout, other key */
    assert_int_equal(ferry__rvalue_decode(v, len, LAYOUT_B, strlen(LAYOUT_B), ks, &pl, &plen, NULL),
                     FERRY_EMISMATCH);
    assert_int_equal(ferry__rvalue_decode(v, len, LAYOUT_A, 5, ks, &pl, &plen, NULL),
                     FERRY_EMISMATCH);
    assert_int_equal(ferry__rvalue_decode(v, len, LAYOUT_A, strlen(LAYOUT_A),
                                          ferry__rvalue_key_sum("k2", 2), &pl, &plen, NULL),
                     FERRY_EMISMATCH);
    /* every single-byte flip anywhere is refused */
    for (size_t i = 0; i < len; i += (i < 200 ? 1 : 97)) {
        v[i] ^= 0x10;
        int rc = ferry__rvalue_decode(v, len, LAYOUT_A, strlen(LAYOUT_A), ks, &pl, &plen, NULL);
        if (rc != FERRY_ECORRUPT && rc != FERRY_EVERSION && rc != FERRY_EMISMATCH)
            fail_msg("flip at %zu -> %d", i, rc);
        v[i] ^= 0x10;
    }
    /* truncated and extended values */
    for (size_t cut = 0; cut < len; cut += 37)
        assert_int_equal(
            ferry__rvalue_decode(v, cut, LAYOUT_A, strlen(LAYOUT_A), ks, &pl, &plen, NULL),
            FERRY_ECORRUPT);
    uint8_t *big = malloc(len + 1);
    memcpy(big, v, len);
    big[len] = 0;
    assert_int_equal(
        ferry__rvalue_decode(big, len + 1, LAYOUT_A, strlen(LAYOUT_A), ks, &pl, &plen, NULL),
        FERRY_ECORRUPT);
    free(big);
    /* a newer version with a valid header checksum is EVERSION */
    v[4] = 2;
    uint8_t tmp[40 + sizeof LAYOUT_A];
    memcpy(tmp, v, 40);
    memcpy(tmp + 40, LAYOUT_A, strlen(LAYOUT_A));
    /* re-seal the header checksum as a newer writer would */
    ferry__rvalue_hdr h;
    {
        uint64_t hs = XXH3_64bits(tmp, 40 + strlen(LAYOUT_A));
        for (int i = 0; i < 8; i++)
            v[40 + i] = (uint8_t)(hs >> (8 * i));
    }
    ferry__errbuf eb;
    assert_int_equal(ferry__rvalue_parse_header(v, len, &h, &eb), FERRY_EVERSION);
    assert_non_null(strstr(eb.msg, "version 2"));
    free(v);

    /* empty payload and empty layout */
    v = encode("", "k", 1, "", 0, &len);
    assert_int_equal(len, FERRY_REMOTE_HEADER_FIXED);
    assert_int_equal(
        ferry__rvalue_decode(v, len, "", 0, ferry__rvalue_key_sum("k", 1), &pl, &plen, NULL), 0);
    assert_int_equal(plen, 0);
    free(v);
}

static void key_slot_known_vectors(void **state)
{
    (void)state;
    /* CRC16/XMODEM check value */
    assert_int_equal(ferry__rcluster_crc16("123456789", 9), 0x31c3);
    /* values from CLUSTER KEYSLOT on a real Redis */
    assert_int_equal(ferry_remote_key_slot("foo", 3), 12182);
    assert_int_equal(ferry_remote_key_slot("bar", 3), 5061);
    assert_int_equal(ferry_remote_key_slot("hello", 5), 866);
    /* hash tags: only the part between the first { and the next } counts */
    assert_int_equal(ferry_remote_key_slot("{user1000}.following", 20),
                     ferry_remote_key_slot("{user1000}.followers", 20));
    assert_int_equal(ferry_remote_key_slot("x{foo}y", 7), 12182);
    /* empty tag: the whole key */
    assert_int_equal(ferry_remote_key_slot("foo{}{bar}", 10),
                     ferry__rcluster_crc16("foo{}{bar}", 10) & 16383);
    assert_int_equal(ferry_remote_key_slot("foo{{bar}}zap", 13),
                     ferry__rcluster_crc16("{bar", 4) & 16383);
    assert_int_equal(ferry_remote_key_slot("{bar", 4), ferry__rcluster_crc16("{bar", 4) & 16383);
}

/* ---- against a real server ---- */

static int srv_setup(void **state)
{
    (void)state;
    return ft_redis_start(&g_srv, NULL) == 0 ? 0 : -1;
}
static int srv_teardown(void **state)
{
    (void)state;
    ft_redis_destroy(&g_srv);
    return 0;
}

static void round_trip_sync_and_async(void **state)
{
    (void)state;
    ferry_remote *r = open_a(&g_srv, 0, "rt:");
    size_t n = 256 * 1024;
    uint8_t *src = malloc(n), *dst = malloc(n);
    ft_fill_pattern(src, n, 1);
    FT_ASSERT_OK(ferry_remote_put_sync(r, "chunk-1", 7, src, n));
    memset(dst, 0, n);
    assert_int_equal(ferry_remote_get(r, "chunk-1", 7, dst, n), (int)n);
    assert_int_equal(ft_check_pattern(dst, n, 1), -1);

    ft_fill_pattern(src, n, 2);
    FT_ASSERT_OK(ferry_remote_put(r, "chunk-2", 7, src, n));
    FT_ASSERT_OK(ferry_remote_put(r, "empty", 5, NULL, 0));
    FT_ASSERT_OK(ferry_remote_flush(r, 5000));
    assert_int_equal(ferry_remote_get(r, "chunk-2", 7, dst, n), (int)n);
    assert_int_equal(ft_check_pattern(dst, n, 2), -1);
    assert_int_equal(ferry_remote_get(r, "empty", 5, dst, n), 0);
    /* keys are bytes: NUL, 0xff and spaces are kept as they are */
    static const char bin1[] = {'a', 0, 'b', (char)0xff, ' '}, bin2[] = {'a', 0, 'c', (char)0xff, ' '};
    FT_ASSERT_OK(ferry_remote_put_sync(r, bin1, sizeof bin1, "one", 3));
    FT_ASSERT_OK(ferry_remote_put_sync(r, bin2, sizeof bin2, "two", 3));
    assert_int_equal(ferry_remote_get(r, bin1, sizeof bin1, dst, n), 3);
    assert_memory_equal(dst, "one", 3);
    assert_int_equal(ferry_remote_get(r, bin2, sizeof bin2, dst, n), 3);
    assert_memory_equal(dst, "two", 3);
    /* a destination one byte short is refused and says how big */
    assert_int_equal(ferry_remote_get(r, "chunk-2", 7, dst, n - 1), -ENOBUFS);
    assert_non_null(strstr(ferry_remote_last_error(r), "262144"));
    /* the refused reply was consumed whole: the connection is still in step */
    assert_int_equal(ferry_remote_get(r, "chunk-1", 7, dst, n), (int)n);
    assert_int_equal(ft_check_pattern(dst, n, 1), -1);

    ferry_remote_stats m = metrics(r);
    assert_int_equal(m.puts, 5);
    assert_int_equal(m.puts_written, 5);
    assert_int_equal(m.hits, 6);
    assert_int_equal(m.gets, 7);
    assert_int_equal(m.dropped, 0);
    assert_int_equal(m.cluster, 0);
    assert_true(m.bytes_read >= 2 * n);
    /* the server key carries the prefix */
    char out[64];
    static const char *const ex[] = {"EXISTS", "rt:chunk-1", NULL};
    ft_redis_cmd(&g_srv, out, sizeof out, ex);
    assert_string_equal(out, "1");
    free(src);
    free(dst);
    ferry_remote_close(r);
}

/* a first get on a fresh handle takes the generic path (a bounded
 * GETRANGE): values of the destination's size -1, +0, +1 are exact or
 * -ENOBUFS, the handle stays in step (the next get is exact), and a key
 * deleted between two gets is a miss with nothing written */
static void first_get_at_the_destination_size(void **state)
{
    (void)state;
    const size_t cap = 65536;
    uint8_t *src = malloc(cap + 2), *dst = malloc(cap + 64);
    ft_fill_pattern(src, cap + 2, 5);
    ferry_remote *w = open_a(&g_srv, 0, "edge:");
    FT_ASSERT_OK(ferry_remote_put_sync(w, "m1", 2, src, cap - 1));
    FT_ASSERT_OK(ferry_remote_put_sync(w, "m0", 2, src, cap));
    FT_ASSERT_OK(ferry_remote_put_sync(w, "p1", 2, src, cap + 1));
    ferry_remote_close(w);
    static const struct {
        const char *key;
        int want;
    } cases[] = {{"m1", 65535}, {"m0", 65536}, {"p1", -ENOBUFS}};
    for (size_t k = 0; k < FERRY__ARRAY_LEN(cases); k++) {
        ferry_remote *r = open_a(&g_srv, 0, "edge:");
        memset(dst, 0xA5, cap + 64);
        assert_int_equal(ferry_remote_get(r, cases[k].key, 2, dst, cap), cases[k].want);
        size_t n = cases[k].want > 0 ? (size_t)cases[k].want : 0;
        assert_memory_equal(dst, src, n);
        for (size_t b = n; b < cap + 64; b++)
            assert_int_equal(dst[b], 0xA5);
        assert_int_equal(ferry_remote_get(r, "m0", 2, dst, cap), (int)cap);
        assert_memory_equal(dst, src, cap);
        assert_int_equal(metrics(r).errors, 0);
        ferry_remote_close(r);
    }
    ferry_remote *r = open_a(&g_srv, 0, "edge:");
    char out[64];
    static const char *const del[] = {"DEL", "edge:m1", NULL};
    ft_redis_cmd(&g_srv, out, sizeof out, del);
    memset(dst, 0xA5, cap + 64);
    assert_int_equal(ferry_remote_get(r, "m1", 2, dst, cap), FERRY_ENOTFOUND);
    assert_int_equal(dst[0], 0xA5);
    assert_int_equal(ferry_remote_get(r, "m0", 2, dst, cap), (int)cap);
    ferry_remote_close(r);
    free(src);
    free(dst);
}

static void missing_key_is_a_miss(void **state)
{
    (void)state;
    ferry_remote *r = open_a(&g_srv, 0, "miss:");
    char buf[16];
    assert_int_equal(ferry_remote_get(r, "nope", 4, buf, sizeof buf), FERRY_ENOTFOUND);
    assert_non_null(strstr(ferry_remote_last_error(r), "no such key"));
    ferry_remote_stats m = metrics(r);
    assert_int_equal(m.misses, 1);
    assert_int_equal(m.hits, 0);
    assert_int_equal(m.errors, 0);
    ferry_remote_close(r);
}

/* read the raw stored value, let f damage it, write it back raw */
static void tamper(const char *key, void (*f)(char *v, size_t *len))
{
    redisContext *c = redisConnect("127.0.0.1", g_srv.port);
    assert_non_null(c);
    assert_int_equal(c->err, 0);
    redisReply *rep = redisCommand(c, "GET %s", key);
    assert_int_equal(rep->type, REDIS_REPLY_STRING);
    size_t len = rep->len;
    char *v = malloc(len + 64);
    memcpy(v, rep->str, len);
    freeReplyObject(rep);
    f(v, &len);
    rep = redisCommand(c, "SET %s %b", key, v, len);
    assert_int_equal(rep->type, REDIS_REPLY_STATUS);
    freeReplyObject(rep);
    free(v);
    redisFree(c);
}
static void flip_payload(char *v, size_t *len)
{
    v[*len - 100] ^= 1;
}
static void truncate_value(char *v, size_t *len)
{
    (void)v;
    *len -= 10;
}
static void flip_header(char *v, size_t *len)
{
    (void)len;
    v[20] ^= 0x80; /* payload length */
}

static void corruption_is_detected(void **state)
{
    (void)state;
    ferry_remote *r = open_a(&g_srv, 0, "cor:");
    uint8_t src[4096], dst[4096];
    ft_fill_pattern(src, sizeof src, 3);
    const char *names[] = {"c1", "c2", "c3"};
    void (*how[])(char *, size_t *) = {flip_payload, truncate_value, flip_header};
    for (int i = 0; i < 3; i++) {
        FT_ASSERT_OK(ferry_remote_put_sync(r, names[i], 2, src, sizeof src));
        char full[16];
        snprintf(full, sizeof full, "cor:%s", names[i]);
        tamper(full, how[i]);
        memset(dst, 0, sizeof dst);
        assert_int_equal(ferry_remote_get(r, names[i], 2, dst, sizeof dst), FERRY_ECORRUPT);
        assert_non_null(strstr(ferry_remote_last_error(r), names[i]));
    }
    /* a foreign value (not ferry's) under the key */
    static const char *const set[] = {
        "SET", "cor:foreign", "some other application stored this string here, not ferry", NULL};
    ft_redis_cmd(&g_srv, NULL, 0, set);
    assert_int_equal(ferry_remote_get(r, "foreign", 7, dst, sizeof dst), FERRY_ECORRUPT);
    assert_non_null(strstr(ferry_remote_last_error(r), "not a ferry value"));
    ferry_remote_stats m = metrics(r);
    assert_int_equal(m.corrupt, 4);
    assert_int_equal(m.hits, 0);
    assert_int_equal(m.misses, 4);
    /* the header-only prefix check refuses the damaged header and the foreign value */
    ferry_remote_key k3 = {"c3", 2}, kf = {"foreign", 7}, k1 = {"c1", 2};
    assert_int_equal(ferry_remote_exists(r, &k3, 1), 0);
    assert_int_equal(ferry_remote_exists(r, &kf, 1), 0);
    /* (a payload flip is only seen by a full read) */
    assert_int_equal(ferry_remote_exists(r, &k1, 1), 1);
    ferry_remote_close(r);
}

static void other_layout_or_key_is_refused(void **state)
{
    (void)state;
    char url[128];
    ferry_remote *a = open_a(&g_srv, 0, "lay:");
    ferry_remote_options ob = opts_a();
    ob.layout = LAYOUT_B;
    ob.layout_len = sizeof LAYOUT_B - 1;
    ob.key_prefix = "lay:";
    ferry_remote *b = NULL;
    FT_ASSERT_OK(ferry_remote_open(ft_redis_url(&g_srv, 0, url, sizeof url), &ob, &b));
    uint8_t src[1024], dst[1024];
    ft_fill_pattern(src, sizeof src, 4);
    FT_ASSERT_OK(ferry_remote_put_sync(a, "shared-key", 10, src, sizeof src));
    assert_int_equal(ferry_remote_get(b, "shared-key", 10, dst, sizeof dst), FERRY_EMISMATCH);
    assert_non_null(strstr(ferry_remote_last_error(b), "another layout"));
    ferry_remote_key k = {"shared-key", 10};
    assert_int_equal(ferry_remote_exists(b, &k, 1), 0);
    assert_int_equal(ferry_remote_exists(a, &k, 1), 1);
    assert_int_equal(metrics(b).mismatched, 2);

    /* the same bytes copied under another key are refused too */
    static const char *const copy[] = {"COPY", "lay:shared-key", "lay:other-key", NULL};
    char out[32];
    assert_int_equal(ft_redis_cmd(&g_srv, out, sizeof out, copy), REDIS_REPLY_INTEGER);
    assert_int_equal(ferry_remote_get(a, "other-key", 9, dst, sizeof dst), FERRY_EMISMATCH);
    assert_non_null(strstr(ferry_remote_last_error(a), "another key"));
    assert_int_equal(ferry_remote_get(a, "shared-key", 10, dst, sizeof dst), (int)sizeof src);
    ferry_remote_close(a);
    ferry_remote_close(b);
}

static void server_error_replies(void **state)
{
    (void)state;
    ferry_remote *r = open_a(&g_srv, 0, "err:");
    static const char *const lpush[] = {"LPUSH", "err:list", "x", NULL};
    ft_redis_cmd(&g_srv, NULL, 0, lpush);
    char dst[64];
    assert_int_equal(ferry_remote_get(r, "list", 4, dst, sizeof dst), FERRY_EREMOTE);
    assert_non_null(strstr(ferry_remote_last_error(r), "WRONGTYPE"));
    ferry_remote_key k = {"list", 4};
    assert_int_equal(ferry_remote_exists(r, &k, 1), 0);
    assert_non_null(strstr(ferry_remote_last_error(r), "WRONGTYPE"));

    /* out of memory on the server: SET is refused with its message */
    static const char *const lim[] = {"CONFIG", "SET", "maxmemory", "1", NULL};
    static const char *const unlim[] = {"CONFIG", "SET", "maxmemory", "0", NULL};
    ft_redis_cmd(&g_srv, NULL, 0, lim);
    assert_int_equal(ferry_remote_put_sync(r, "big", 3, "abc", 3), FERRY_EREMOTE);
    assert_non_null(strstr(ferry_remote_last_error(r), "OOM"));
    /* an async put refused the same way is counted, not retried forever */
    FT_ASSERT_OK(ferry_remote_put(r, "big2", 4, "abc", 3));
    FT_ASSERT_OK(ferry_remote_flush(r, 5000));
    ft_redis_cmd(&g_srv, NULL, 0, unlim);
    ferry_remote_stats m = metrics(r);
    assert_int_equal(m.dropped, 1);
    assert_int_equal(m.puts_written, 0);
    assert_true(m.errors >= 4);
    assert_int_equal(m.down, 0); /* error replies are not a dead remote */
    FT_ASSERT_OK(ferry_remote_put_sync(r, "big", 3, "abc", 3));
    ferry_remote_close(r);
}

static void exists_counts_leading_keys_and_delete(void **state)
{
    (void)state;
    ferry_remote *r = open_a(&g_srv, 0, "pre:");
    char names[10][8];
    ferry_remote_key keys[10];
    for (int i = 0; i < 10; i++) {
        snprintf(names[i], sizeof names[i], "k%d", i);
        keys[i].data = names[i];
        keys[i].len = strlen(names[i]);
        if (i != 6)
            FT_ASSERT_OK(ferry_remote_put(r, names[i], keys[i].len, names[i], keys[i].len));
    }
    FT_ASSERT_OK(ferry_remote_flush(r, 5000));
    assert_int_equal(ferry_remote_exists(r, keys, 10), 6);
    assert_int_equal(ferry_remote_exists(r, keys, 3), 3);
    assert_int_equal(ferry_remote_exists(r, keys + 6, 4), 0);
    assert_int_equal(ferry_remote_exists(r, keys + 7, 3), 3);
    assert_int_equal(ferry_remote_exists(r, keys, 0), 0);
    assert_int_equal(ferry_remote_delete(r, keys, 2), 2);
    assert_int_equal(ferry_remote_delete(r, keys, 2), 0);
    assert_int_equal(ferry_remote_exists(r, keys, 10), 0);
    assert_int_equal(ferry_remote_exists(r, keys + 2, 8), 4);
    char dst[8];
    assert_int_equal(ferry_remote_get(r, "k0", 2, dst, sizeof dst), FERRY_ENOTFOUND);
    ferry_remote_stats m = metrics(r);
    assert_int_equal(m.deletes, 2);
    assert_int_equal(m.exists_calls, 7);
    ferry_remote_key bad = {NULL, 0};
    assert_int_equal(ferry_remote_exists(r, &bad, 1), -EINVAL);
    ferry_remote_close(r);
}

static void two_processes_share_chunks(void **state)
{
    (void)state;
    /* the child writes before this process opens anything (no threads yet
     * to fork across); then each reads what the other wrote */
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        char url[128];
        ferry_remote_options o = opts_a();
        o.key_prefix = "share:";
        ferry_remote *c = NULL;
        if (ferry_remote_open(ft_redis_url(&g_srv, 0, url, sizeof url), &o, &c))
            _exit(2);
        uint8_t buf[8192];
        for (unsigned i = 0; i < 20; i++) {
            char k[16];
            snprintf(k, sizeof k, "child-%u", i);
            ft_fill_pattern(buf, sizeof buf, 100 + i);
            if (ferry_remote_put(c, k, strlen(k), buf, sizeof buf))
                _exit(3);
        }
        if (ferry_remote_flush(c, 5000))
            _exit(4);
        ferry_remote_close(c);
        _exit(0);
    }
    int st;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    assert_true(WIFEXITED(st));
    assert_int_equal(WEXITSTATUS(st), 0);
    ferry_remote *r = open_a(&g_srv, 0, "share:");
    uint8_t buf[8192];
    for (unsigned i = 0; i < 20; i++) {
        char k[16];
        snprintf(k, sizeof k, "child-%u", i);
        assert_int_equal(ferry_remote_get(r, k, strlen(k), buf, sizeof buf), (int)sizeof buf);
        assert_int_equal(ft_check_pattern(buf, sizeof buf, 100 + i), -1);
    }
    ft_fill_pattern(buf, sizeof buf, 77);
    FT_ASSERT_OK(ferry_remote_put_sync(r, "parent", 6, buf, sizeof buf));
    ferry_remote_close(r);
    /* a second process reads what this one wrote */
    pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        char url[128];
        ferry_remote_options o = opts_a();
        o.key_prefix = "share:";
        ferry_remote *c = NULL;
        if (ferry_remote_open(ft_redis_url(&g_srv, 0, url, sizeof url), &o, &c))
            _exit(2);
        uint8_t b2[8192];
        int rc = ferry_remote_get(c, "parent", 6, b2, sizeof b2);
        ferry_remote_close(c);
        _exit(rc == (int)sizeof b2 && ft_check_pattern(b2, sizeof b2, 77) == -1 ? 0 : 5);
    }
    assert_int_equal(waitpid(pid, &st, 0), pid);
    assert_true(WIFEXITED(st));
    assert_int_equal(WEXITSTATUS(st), 0);
}

static void unix_socket_and_database(void **state)
{
    (void)state;
    char url[512];
    snprintf(url, sizeof url, "unix://%s?db=2", g_srv.sock);
    ferry_remote_options o = opts_a();
    ferry_remote *u = NULL;
    FT_ASSERT_OK(ferry_remote_open(url, &o, &u));
    FT_ASSERT_OK(ferry_remote_put_sync(u, "in-db2", 6, "xyz", 3));
    char dst[8];
    assert_int_equal(ferry_remote_get(u, "in-db2", 6, dst, sizeof dst), 3);
    assert_memory_equal(dst, "xyz", 3);
    ferry_remote *d0 = open_a(&g_srv, 0, NULL);
    ferry_remote *d2 = open_a(&g_srv, 2, NULL);
    assert_int_equal(ferry_remote_get(d0, "in-db2", 6, dst, sizeof dst), FERRY_ENOTFOUND);
    assert_int_equal(ferry_remote_get(d2, "in-db2", 6, dst, sizeof dst), 3);
    ferry_remote_close(u);
    ferry_remote_close(d0);
    ferry_remote_close(d2);
    /* a database the server does not have: SELECT's error is quoted */
    ferry_remote *bad = NULL;
    assert_int_equal(ferry_remote_open(ft_redis_url(&g_srv, 999, url, sizeof url), &o, &bad),
                     FERRY_EREMOTE);
    assert_null(bad);
    assert_non_null(strstr(ferry_last_error(), "SELECT 999"));
}

static void ttl_is_applied(void **state)
{
    (void)state;
    char url[128];
    ferry_remote_options o = opts_a();
    o.ttl_s = 1000;
    o.key_prefix = "ttl:";
    ferry_remote *r = NULL;
    FT_ASSERT_OK(ferry_remote_open(ft_redis_url(&g_srv, 0, url, sizeof url), &o, &r));
    FT_ASSERT_OK(ferry_remote_put(r, "a", 1, "x", 1));
    FT_ASSERT_OK(ferry_remote_flush(r, 5000));
    static const char *const ttl[] = {"TTL", "ttl:a", NULL};
    char out[32];
    assert_int_equal(ft_redis_cmd(&g_srv, out, sizeof out, ttl), REDIS_REPLY_INTEGER);
    assert_true(atoi(out) > 900 && atoi(out) <= 1000);
    ferry_remote_close(r);
}

static void bad_arguments(void **state)
{
    (void)state;
    char url[128];
    ferry_remote *r = NULL;
    ferry_remote_options o = opts_a();
    o.layout_len = FERRY_REMOTE_LAYOUT_MAX + 1;
    assert_int_equal(ferry_remote_open(ft_redis_url(&g_srv, 0, url, sizeof url), &o, &r), -EINVAL);
    o = opts_a();
    o.size = 8;
    assert_int_equal(ferry_remote_open(url, &o, &r), -EINVAL);
    assert_int_equal(ferry_remote_open("redis://x:99999", NULL, &r), FERRY_EPARSE);
    assert_int_equal(ferry_remote_open("rediss://x", NULL, &r), FERRY_ENOTSUP);
    assert_null(r);
    r = open_a(&g_srv, 0, NULL);
    char big[FERRY_REMOTE_KEY_MAX + 1];
    memset(big, 'k', sizeof big);
    assert_int_equal(ferry_remote_put(r, big, sizeof big, "x", 1), -EINVAL);
    assert_int_equal(ferry_remote_put(r, "", 0, "x", 1), -EINVAL);
    assert_int_equal(ferry_remote_put(r, "k", 1, NULL, 5), -EINVAL);
    assert_int_equal(ferry_remote_get(r, NULL, 3, big, 1), -EINVAL);
    ferry_remote_stats m = FERRY_REMOTE_STATS_INIT;
    memset(&m, 0, sizeof m);
    assert_int_equal(ferry_remote_stats_get(r, &m), -EINVAL);
    ferry_remote_close(r);
    ferry_remote_close(NULL);
}

/* open with allocation n failing (and every later one); the close of a
 * handle that opened runs with the allocator paused */
static int oom_open_run(void *arg)
{
    const char *url = arg;
    ferry_remote_options o = opts_a();
    ferry_remote *r = NULL;
    int rc = ferry_remote_open(url, &o, &r);
    ft_oom_pause();
    if (rc == 0)
        ferry_remote_close(r);
    else
        assert_null(r);
    return rc;
}

static void out_of_memory_drops_and_leaks_nothing(void **state)
{
    (void)state;
    char url[128];
    ft_redis_url(&g_srv, 0, url, sizeof url);
    ferry_remote_options o = opts_a();
    /* open fails cleanly at every allocation until it succeeds */
    ft_oom_each(40, FT_OOM_STICKY, oom_open_run, url);
    /* a put whose queue item cannot be allocated is dropped and counted */
    ft_alloc_install(0, 0);
    ferry_remote *r = NULL;
    FT_ASSERT_OK(ferry_remote_open(url, &o, &r));
    ft_alloc_fail_next(1);
    assert_int_equal(ferry_remote_put(r, "oom", 3, "abc", 3), -ENOMEM);
    assert_int_equal(ft_alloc_failures(), 1);
    assert_int_equal(metrics(r).dropped, 1);
    /* a get whose read buffer cannot be allocated fails before sending:
     * the connection stays usable */
    FT_ASSERT_OK(ferry_remote_put_sync(r, "oom-get", 7, "abc", 3));
    ft_alloc_fail_next(1);
    char dst[8];
    assert_int_equal(ferry_remote_get(r, "oom-get", 7, dst, sizeof dst), -ENOMEM);
    assert_int_equal(ft_alloc_failures(), 2);
    uint64_t rec = metrics(r).reconnects;
    assert_int_equal(ferry_remote_get(r, "oom-get", 7, dst, sizeof dst), 3);
    assert_int_equal(metrics(r).reconnects, rec);
    assert_int_equal(metrics(r).down, 0);
    ferry_remote_close(r);
    assert_int_equal(ft_alloc_live(), 0);
    ft_alloc_reset();
}

/* ---- a server that goes away ---- */

static void stopped_server_degrades_then_reconnects(void **state)
{
    (void)state;
    ft_redis s;
    assert_int_equal(ft_redis_start(&s, NULL), 0);
    char url[128];
    ferry_remote_options o = opts_a();
    o.backoff_initial_ms = 300; /* long enough for the checks made while down */
    o.backoff_max_ms = 300;
    ferry_remote *r = NULL;
    FT_ASSERT_OK(ferry_remote_open(ft_redis_url(&s, 0, url, sizeof url), &o, &r));
    char dst[16];
    FT_ASSERT_OK(ferry_remote_put_sync(r, "k", 1, "before", 6));
    assert_int_equal(ferry_remote_get(r, "k", 1, dst, sizeof dst), 6);

    ft_redis_stop(&s);
    /* the first call finds the connection dead: a miss, and the remote down */
    assert_int_equal(ferry_remote_get(r, "k", 1, dst, sizeof dst), FERRY_ENOTFOUND);
    ferry_remote_stats m = metrics(r);
    assert_int_equal(m.down, 1);
    assert_true(m.errors >= 1);
    /* while backing off, calls answer at once without touching the network */
    uint64_t deg = m.degraded;
    assert_int_equal(ferry_remote_get(r, "k", 1, dst, sizeof dst), FERRY_ENOTFOUND);
    assert_non_null(strstr(ferry_last_error(), "answered as a miss"));
    ferry_remote_key k = {"k", 1};
    assert_int_equal(ferry_remote_exists(r, &k, 1), 0);
    assert_int_equal(ferry_remote_put_sync(r, "k2", 2, "x", 1), -EAGAIN);
    assert_int_equal(ferry_remote_delete(r, &k, 1), -EAGAIN);
    assert_int_equal(ferry_remote_put(r, "k3", 2, "x", 1), -EAGAIN); /* not even queued */
    assert_int_equal(metrics(r).degraded, deg + 5);
    assert_int_equal(metrics(r).queue_items, 0);

    /* back on the same port (empty: no persistence): the client reconnects */
    assert_int_equal(ft_redis_restart(&s), 0);
    int ok = 0;
    for (int i = 0; i < 400 && !ok; i++) {
        ok = ferry_remote_put_sync(r, "k", 1, "after", 5) == 0;
        if (!ok)
            sleep_ms(10);
    }
    assert_true(ok);
    assert_int_equal(ferry_remote_get(r, "k", 1, dst, sizeof dst), 5);
    assert_memory_equal(dst, "after", 5);
    m = metrics(r);
    assert_int_equal(m.down, 0);
    assert_true(m.reconnects >= 1);

    /* a restart without a pause in between: the dead connection is noticed
     * by EOF, reconnected and the call retried, without a miss */
    ft_redis_stop(&s);
    assert_int_equal(ft_redis_restart(&s), 0);
    uint64_t rec = metrics(r).reconnects;
    assert_int_equal(ferry_remote_get(r, "k", 1, dst, sizeof dst), FERRY_ENOTFOUND);
    assert_non_null(strstr(ferry_last_error(), "no such key")); /* asked, not degraded */
    assert_int_equal(metrics(r).reconnects, rec + 1);
    ft_redis_stop(&s);
    assert_int_equal(ft_redis_restart(&s), 0);
    FT_ASSERT_OK(ferry_remote_put_sync(r, "k", 1, "again", 5));
    assert_int_equal(ferry_remote_get(r, "k", 1, dst, sizeof dst), 5);
    ferry_remote_close(r);
    ft_redis_destroy(&s);
}

static void hung_server_times_out_then_answers_misses(void **state)
{
    (void)state;
    ft_redis s;
    assert_int_equal(ft_redis_start(&s, NULL), 0);
    char url[128];
    ferry_remote_options o = opts_a();
    o.command_timeout_ms = 200;
    o.backoff_initial_ms = 60000; /* stays down for the rest of the test */
    o.backoff_max_ms = 60000;
    ferry_remote *r = NULL;
    FT_ASSERT_OK(ferry_remote_open(ft_redis_url(&s, 0, url, sizeof url), &o, &r));
    FT_ASSERT_OK(ferry_remote_put_sync(r, "h", 1, "v", 1));
    ft_redis_pause(&s);
    char dst[4];
    /* the first call waits for its timeout and fails as a miss */
    assert_int_equal(ferry_remote_get(r, "h", 1, dst, sizeof dst), FERRY_ENOTFOUND);
    assert_non_null(strstr(ferry_last_error(), "within the call's 200 ms deadline"));
    /* then every call is answered without waiting: none reaches the network */
    uint64_t deg = metrics(r).degraded;
    for (int i = 0; i < 100; i++)
        assert_int_equal(ferry_remote_get(r, "h", 1, dst, sizeof dst), FERRY_ENOTFOUND);
    ferry_remote_stats m = metrics(r);
    assert_int_equal(m.degraded, deg + 100);
    assert_int_equal(m.errors, 1);
    ft_redis_resume(&s);
    ferry_remote_close(r);
    ft_redis_destroy(&s);
}

static void bounded_queue_drops_under_stopped_server(void **state)
{
    (void)state;
    ft_redis s;
    assert_int_equal(ft_redis_start(&s, NULL), 0);
    char url[128];
    ferry_remote_options o = opts_a();
    o.queue_max_items = 4;
    o.command_timeout_ms = 200;
    ferry_remote *r = NULL;
    FT_ASSERT_OK(ferry_remote_open(ft_redis_url(&s, 0, url, sizeof url), &o, &r));
    uint8_t v[1000];
    ft_fill_pattern(v, sizeof v, 9);
    /* a hung server: the writer waits on its timeout, the queue fills and
     * further puts are refused at once */
    ft_redis_pause(&s);
    int queued = 0, full = 0;
    for (int i = 0; i < 200; i++) {
        int rc = ferry_remote_put(r, "q", 1, v, sizeof v);
        if (rc == 0)
            queued++;
        else {
            assert_true(rc == FERRY_ENOSPACE || rc == -EAGAIN);
            full++;
        }
    }
    assert_true(full > 0);
    assert_true(queued >= 4);
    ferry_remote_stats m = metrics(r);
    assert_true(m.queue_items <= 4);
    assert_true(m.queue_bytes <= 4 * (sizeof v + 200));
    /* stopped outright: everything queued is dropped, nothing blocks */
    ft_redis_stop(&s);
    for (int i = 0; i < 200; i++) {
        int rc = ferry_remote_put(r, "q", 1, v, sizeof v);
        assert_true(rc == 0 || rc == FERRY_ENOSPACE || rc == -EAGAIN);
        if (rc == 0)
            queued++;
        else
            full++;
    }
    FT_ASSERT_OK(ferry_remote_flush(r, 10000));
    m = metrics(r);
    assert_int_equal(m.puts, (uint64_t)queued);
    assert_int_equal(m.puts_written + m.dropped, 400);
    assert_true(m.dropped >= (uint64_t)full);
    assert_int_equal(m.queue_items, 0);
    assert_int_equal(m.queue_bytes, 0);
    ferry_remote_close(r);
    ft_redis_destroy(&s);
}

static void unreachable_server_lazy_or_not(void **state)
{
    (void)state;
    ft_redis s;
    assert_int_equal(ft_redis_start(&s, NULL), 0);
    char url[128];
    ft_redis_url(&s, 0, url, sizeof url);
    ft_redis_stop(&s); /* nobody listens on that port now */
    ferry_remote_options o = opts_a();
    ferry_remote *r = NULL;
    assert_int_equal(ferry_remote_open(url, &o, &r), -ECONNREFUSED);
    assert_null(r);
    assert_non_null(strstr(ferry_last_error(), "connect"));
    o.flags = FERRY_REMOTE_LAZY;
    FT_ASSERT_OK(ferry_remote_open(url, &o, &r));
    char dst[4];
    assert_int_equal(ferry_remote_get(r, "k", 1, dst, sizeof dst), FERRY_ENOTFOUND);
    assert_int_equal(metrics(r).down, 1);
    assert_int_equal(ft_redis_restart(&s), 0);
    int ok = 0;
    for (int i = 0; i < 400 && !ok; i++) {
        ok = ferry_remote_put_sync(r, "k", 1, "v", 1) == 0;
        if (!ok)
            sleep_ms(10);
    }
    assert_true(ok);
    assert_int_equal(ferry_remote_get(r, "k", 1, dst, sizeof dst), 1);
    ferry_remote_close(r);
    ft_redis_destroy(&s);
}

static void passwords_and_acl_users(void **state)
{
    (void)state;
    static const char *const args[] = {"--requirepass", "s3cret", NULL};
    ft_redis s;
    assert_int_equal(ft_redis_start(&s, args), 0);
    ferry_remote_options o = opts_a();
    ferry_remote *r = NULL;
    char url[256];
    snprintf(url, sizeof url, "redis://:wrong@127.0.0.1:%d/0", s.port);
    assert_int_equal(ferry_remote_open(url, &o, &r), FERRY_EREMOTE);
    assert_null(r);
    assert_non_null(strstr(ferry_last_error(), "AUTH"));
    assert_non_null(strstr(ferry_last_error(), "WRONGPASS"));
    assert_null(strstr(ferry_last_error(), "wrong"));
    /* a wrong password is refused even with FERRY_REMOTE_LAZY: it is not transient */
    o.flags = FERRY_REMOTE_LAZY;
    assert_int_equal(ferry_remote_open(url, &o, &r), FERRY_EREMOTE);
    o.flags = 0;

    snprintf(url, sizeof url, "redis://:s3cret@127.0.0.1:%d/0", s.port);
    FT_ASSERT_OK(ferry_remote_open(url, &o, &r));
    assert_null(strstr(ferry_remote_url(r), "s3cret"));
    FT_ASSERT_OK(ferry_remote_put_sync(r, "p", 1, "ok", 2));
    ferry_remote_close(r);

    /* no password: the open asks (PING) and the server's NOAUTH fails it,
     * also with FERRY_REMOTE_LAZY (not transient) */
    snprintf(url, sizeof url, "redis://127.0.0.1:%d/0", s.port);
    r = NULL;
    assert_int_equal(ferry_remote_open(url, &o, &r), FERRY_EREMOTE);
    assert_null(r);
    assert_non_null(strstr(ferry_last_error(), "NOAUTH"));
    assert_non_null(strstr(ferry_last_error(), "requires a password"));
    o.flags = FERRY_REMOTE_LAZY;
    assert_int_equal(ferry_remote_open(url, &o, &r), FERRY_EREMOTE);
    assert_null(r);
    o.flags = 0;
    char dst[4];

    /* an ACL user */
    static const char *const acl[] = {"AUTH", "s3cret", NULL};
    (void)acl;
    redisContext *c = redisConnect("127.0.0.1", s.port);
    redisReply *rep = redisCommand(c, "AUTH s3cret");
    freeReplyObject(rep);
    rep = redisCommand(c, "ACL SETUSER alice on >al1ce ~* +@all");
    assert_int_equal(rep->type, REDIS_REPLY_STATUS);
    freeReplyObject(rep);
    redisFree(c);
    snprintf(url, sizeof url, "redis://alice:al1ce@127.0.0.1:%d/0", s.port);
    FT_ASSERT_OK(ferry_remote_open(url, &o, &r));
    assert_int_equal(ferry_remote_get(r, "p", 1, dst, sizeof dst), 2);
    ferry_remote_close(r);
    snprintf(url, sizeof url, "redis://alice:nope@127.0.0.1:%d/0", s.port);
    assert_int_equal(ferry_remote_open(url, &o, &r), FERRY_EREMOTE);
    assert_non_null(strstr(ferry_last_error(), "AUTH as user alice"));
    ft_redis_destroy(&s);
}

/* the server CI starts (.ci/run exports FERRY_TEST_REDIS_URL), when there is one */
static void ci_server_round_trip(void **state)
{
    (void)state;
    const char *url = getenv("FERRY_TEST_REDIS_URL");
    if (!url || !*url) {
        skip();
        return;
    }
    ferry_remote_options o = opts_a();
    char prefix[64];
    snprintf(prefix, sizeof prefix, "ferry-test-%d:", (int)getpid());
    o.key_prefix = prefix;
    ferry_remote *r = NULL;
    FT_ASSERT_OK(ferry_remote_open(url, &o, &r));
    uint8_t src[10000], dst[10000];
    ft_fill_pattern(src, sizeof src, 5);
    FT_ASSERT_OK(ferry_remote_put(r, "ci", 2, src, sizeof src));
    FT_ASSERT_OK(ferry_remote_flush(r, 5000));
    assert_int_equal(ferry_remote_get(r, "ci", 2, dst, sizeof dst), (int)sizeof dst);
    assert_int_equal(ft_check_pattern(dst, sizeof dst, 5), -1);
    ferry_remote_key k = {"ci", 2};
    assert_int_equal(ferry_remote_delete(r, &k, 1), 1);
    ferry_remote_close(r);
}

/* ---- threads ---- */

typedef struct worker_arg {
    ferry_remote *r;
    unsigned seed;
    int bad;
} worker_arg;

#define NKEYS 16
#define VLEN 4096

static void *worker(void *p)
{
    worker_arg *a = p;
    uint8_t buf[VLEN];
    for (int i = 0; i < 150; i++) {
        unsigned k = rand_r(&a->seed) % NKEYS;
        char key[16];
        snprintf(key, sizeof key, "t%u", k);
        int op = (int)(rand_r(&a->seed) % 7);
        if (op == 0) {
            ft_fill_pattern(buf, VLEN, k); /* the value of a key never changes */
            int rc = ferry_remote_put(a->r, key, strlen(key), buf, VLEN);
            if (rc != 0 && rc != FERRY_ENOSPACE)
                a->bad++;
        } else if (op == 1) {
            int rc = ferry_remote_get(a->r, key, strlen(key), buf, VLEN);
            if (rc == VLEN) {
                if (ft_check_pattern(buf, VLEN, k) != -1)
                    a->bad++;
            } else if (rc != FERRY_ENOTFOUND)
                a->bad++;
        } else if (op == 2) {
            ferry_remote_key ks[4];
            char names[4][16];
            for (int j = 0; j < 4; j++) {
                snprintf(names[j], sizeof names[j], "t%u", (k + (unsigned)j) % NKEYS);
                ks[j].data = names[j];
                ks[j].len = strlen(names[j]);
            }
            int rc = ferry_remote_exists(a->r, ks, 4);
            if (rc < 0 || rc > 4)
                a->bad++;
        } else if (op == 3) {
            ferry_remote_key kk = {key, strlen(key)};
            int rc = ferry_remote_delete(a->r, &kk, 1);
            if (rc < 0 || rc > 1)
                a->bad++;
        } else if (op == 4) {
            ft_fill_pattern(buf, VLEN, k);
            if (ferry_remote_put_sync(a->r, key, strlen(key), buf, VLEN) != 0)
                a->bad++;
        } else if (op == 5) {
            if (ferry_remote_flush(a->r, 10000) != 0)
                a->bad++;
        } else {
            ferry_remote_stats m = FERRY_REMOTE_STATS_INIT;
            if (ferry_remote_stats_get(a->r, &m) != 0 || m.hits > m.gets)
                a->bad++;
            /* read whole while the others (and the writer) may record */
            if (strlen(ferry_remote_last_error(a->r)) >= 4096)
                a->bad++;
        }
    }
    return NULL;
}

/* keys are byte strings: NUL, CR, LF and bytes >= 0x80 inside a key are
 * its own, so keys that differ only there never see each other's values */
static void binary_keys_are_distinct(void **state)
{
    (void)state;
    char url[128];
    ferry_remote_options o = opts_a();
    o.key_prefix = "bin:";
    ferry_remote *r = NULL;
    FT_ASSERT_OK(ferry_remote_open(ft_redis_url(&g_srv, 0, url, sizeof url), &o, &r));
    static const char k1[] = {'k', 0, '\r', '\n', '1'}, k2[] = {'k', 0, '\r', '\n', '2'},
                      k3[] = {'k', (char)0xff, '*', '1', '\r', '\n', '$'};
    const ferry_remote_key keys[3] = {{k1, sizeof k1}, {k2, sizeof k2}, {k3, sizeof k3}};
    for (int i = 0; i < 3; i++) {
        char v[64];
        memset(v, 'a' + i, sizeof v);
        FT_ASSERT_OK(ferry_remote_put_sync(r, keys[i].data, keys[i].len, v, sizeof v - (size_t)i));
    }
    for (int i = 0; i < 3; i++) {
        char v[64];
        memset(v, 0, sizeof v);
        assert_int_equal(ferry_remote_get(r, keys[i].data, keys[i].len, v, sizeof v),
                         (int)sizeof v - i);
        for (int j = 0; j < (int)sizeof v - i; j++)
            assert_int_equal(v[j], 'a' + i);
    }
    char v[64];
    assert_int_equal(ferry_remote_get(r, "k", 1, v, sizeof v), FERRY_ENOTFOUND);
    assert_int_equal(ferry_remote_exists(r, keys, 3), 3);
    assert_int_equal(ferry_remote_delete(r, keys + 1, 1), 1);
    assert_int_equal(ferry_remote_exists(r, keys, 3), 1);
    assert_int_equal(ferry_remote_get(r, keys[0].data, keys[0].len, v, sizeof v), 64);
    assert_int_equal(ferry_remote_delete(r, keys, 3), 2);
    ferry_remote_close(r);
}

static void threads_share_one_handle(void **state)
{
    (void)state;
    char url[128];
    ferry_remote_options o = opts_a();
    o.connections = 2; /* fewer connections than threads: they wait their turn */
    o.key_prefix = "thr:";
    ferry_remote *r = NULL;
    FT_ASSERT_OK(ferry_remote_open(ft_redis_url(&g_srv, 0, url, sizeof url), &o, &r));
    pthread_t th[4];
    worker_arg args[4];
    for (int i = 0; i < 4; i++) {
        args[i] = (worker_arg){r, (unsigned)i * 7919u + 1, 0};
        assert_int_equal(pthread_create(&th[i], NULL, worker, &args[i]), 0);
    }
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        assert_int_equal(args[i].bad, 0);
    }
    FT_ASSERT_OK(ferry_remote_flush(r, 10000));
    ferry_remote_stats m = metrics(r);
    assert_int_equal(m.errors, 0);
    assert_int_equal(m.corrupt + m.mismatched, 0);
    assert_int_equal(m.puts, m.puts_written);
    ferry_remote_close(r);
}

int main(void)
{
    /* first: the hostile-server test measures the growth of max RSS */
    const struct CMUnitTest offline[] = {
        cmocka_unit_test(url_valid_forms),
        cmocka_unit_test(url_invalid_forms),
        cmocka_unit_test(value_codec_checks_every_field),
        cmocka_unit_test(value_range_outcome_at_the_destination_size),
        cmocka_unit_test(key_slot_known_vectors),
        cmocka_unit_test(reply_framer_bounds),
        cmocka_unit_test(options_are_range_checked),
        cmocka_unit_test(hostile_server_is_bounded_in_time_and_memory),
        cmocka_unit_test(wrong_kind_of_reply_is_never_success),
        cmocka_unit_test(lengths_of_many_digits_are_over_the_limit),
        cmocka_unit_test(a_length_line_with_more_after_its_digits_is_broken),
    };
    const struct CMUnitTest online[] = {
        cmocka_unit_test(round_trip_sync_and_async),
        cmocka_unit_test(missing_key_is_a_miss),
        cmocka_unit_test(first_get_at_the_destination_size),
        cmocka_unit_test(corruption_is_detected),
        cmocka_unit_test(other_layout_or_key_is_refused),
        cmocka_unit_test(server_error_replies),
        cmocka_unit_test(exists_counts_leading_keys_and_delete),
        cmocka_unit_test(two_processes_share_chunks),
        cmocka_unit_test(unix_socket_and_database),
        cmocka_unit_test(ttl_is_applied),
        cmocka_unit_test(bad_arguments),
        cmocka_unit_test(out_of_memory_drops_and_leaks_nothing),
        cmocka_unit_test(stopped_server_degrades_then_reconnects),
        cmocka_unit_test(hung_server_times_out_then_answers_misses),
        cmocka_unit_test(bounded_queue_drops_under_stopped_server),
        cmocka_unit_test(unreachable_server_lazy_or_not),
        cmocka_unit_test(passwords_and_acl_users),
        cmocka_unit_test(threads_share_one_handle),
        cmocka_unit_test(binary_keys_are_distinct),
        cmocka_unit_test(ci_server_round_trip),
    };
    int rc = cmocka_run_group_tests_name("remote_offline", offline, NULL, NULL);
    if (!ft_redis_available()) {
        fprintf(stderr, "redis-server not installed: skipping the server tests\n");
        return rc ? rc : 77;
    }
    return rc | cmocka_run_group_tests_name("remote_server", online, srv_setup, srv_teardown);
}
