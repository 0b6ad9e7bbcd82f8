/*
 * cmd_bench_remote.c - `ferry bench remote`: retrieve throughput of the
 * remote tier against what redis-benchmark reports for GET of the same
 * value size on the same server, in one run.
 *
 *   ferry bench remote --url URL [--value 1M] [--count 400] [--keys 8]
 *                      [--clients 1] [--rounds 3] [--no-redis-benchmark] [--json]
 *
 * ferry side: `clients` threads share one handle (one connection each)
 * and call ferry_remote_get (full value, checksums verified, copied into
 * the caller's buffer) `count` times in all over `keys` stored values.
 * Reference: redis-benchmark -c clients -n count -d value -t set,get
 * (its GET reads the value its SET stored) against the same host, port
 * or socket, password and database. The two alternate for `rounds`
 * rounds and the best of each is kept, so a burst of load from other
 * processes on the machine does not decide the ratio. The ratio is ferry
 * GET/s over redis-benchmark GET/s.
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <jansson.h>

#include "cli.h"
#include "core.h"
#include "remote/remote_int.h"

typedef struct bench_thread {
    ferry_remote *r;
    uint64_t ops, keys;
    size_t value;
    unsigned idx;
    int rc;
    uint64_t bytes;
} bench_thread;

static void *bench_get(void *p)
{
    bench_thread *t = p;
    uint8_t *buf = malloc(t->value);
    if (!buf) {
        t->rc = -ENOMEM;
        return NULL;
    }
    for (uint64_t i = 0; i < t->ops; i++) {
        char key[48];
        snprintf(key, sizeof key, "ferry-bench:%llu",
                 (unsigned long long)((i * 7 + t->idx) % t->keys));
        int rc = ferry_remote_get(t->r, key, strlen(key), buf, t->value);
        if (rc != (int)t->value) {
            t->rc = rc < 0 ? rc : -EIO;
            break;
        }
        t->bytes += (uint64_t)rc;
    }
    free(buf);
    return NULL;
}

/* run redis-benchmark; returns GET requests/s or a negative value */
static double run_redis_benchmark(const ferry__rurl *u, unsigned clients, uint64_t count,
                                  uint64_t value, char *why, size_t whylen)
{
    char port[16], c_s[16], n_s[24], d_s[24], db_s[16];
    snprintf(port, sizeof port, "%d", u->port);
    snprintf(c_s, sizeof c_s, "%u", clients);
    snprintf(n_s, sizeof n_s, "%llu", (unsigned long long)count);
    snprintf(d_s, sizeof d_s, "%llu", (unsigned long long)value);
    snprintf(db_s, sizeof db_s, "%d", u->db);
    const char *argv[32];
    int n = 0;
    argv[n++] = "redis-benchmark";
    if (u->is_unix) {
        argv[n++] = "-s";
        argv[n++] = u->path;
    } else {
        argv[n++] = "-h";
        argv[n++] = u->host;
        argv[n++] = "-p";
        argv[n++] = port;
    }
    if (u->has_user) {
        argv[n++] = "--user";
        argv[n++] = u->user;
    }
    if (u->has_password) {
        argv[n++] = "-a";
        argv[n++] = u->password;
    }
    argv[n++] = "--dbnum";
    argv[n++] = db_s;
    argv[n++] = "-c";
    argv[n++] = c_s;
    argv[n++] = "-n";
    argv[n++] = n_s;
    argv[n++] = "-d";
    argv[n++] = d_s;
    argv[n++] = "-t";
    argv[n++] = "set,get";
    argv[n++] = "--csv";
    argv[n] = NULL;
    int fds[2];
    if (pipe(fds) != 0) {
        snprintf(why, whylen, "pipe: %s", strerror(errno));
        return -1;
    }
    pid_t pid = fork();
    if (pid < 0) {
        snprintf(why, whylen, "fork: %s", strerror(errno));
        close(fds[0]);
        close(fds[1]);
        return -1;
    }
    if (pid == 0) {
        dup2(fds[1], 1);
        close(fds[0]);
        close(fds[1]);
        execvp("redis-benchmark", (char *const *)argv);
        _exit(127);
    }
    close(fds[1]);
    char out[8192];
    size_t got = 0;
    ssize_t k;
    while (got + 1 < sizeof out && (k = read(fds[0], out + got, sizeof out - 1 - got)) > 0)
        got += (size_t)k;
    out[got] = 0;
    close(fds[0]);
    int st;
    waitpid(pid, &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        snprintf(why, whylen, "redis-benchmark failed (status %d%s)",
                 WIFEXITED(st) ? WEXITSTATUS(st) : -1,
                 WIFEXITED(st) && WEXITSTATUS(st) == 127 ? ": not installed" : "");
        return -1;
    }
    const char *g = strstr(out, "\"GET\",\"");
    if (!g) {
        snprintf(why, whylen, "no GET line in redis-benchmark's output");
        return -1;
    }
    return strtod(g + 7, NULL);
}

static int usage_remote(FILE *f)
{
    fprintf(f, "usage: ferry bench remote --url URL [--value SIZE] [--count N] [--keys K]\n"
               "                          [--clients C] [--rounds R] [--no-redis-benchmark]\n"
               "                          [--json]\n"
               "  retrieve throughput of the remote tier vs redis-benchmark GET, alternating\n"
               "  for R rounds, best of each (defaults: --value 1M --count 400 --keys 8\n"
               "  --clients 1 --rounds 3; ranges: --value 1..256M, --count 1..10^8, --keys\n"
               "  1..10^6, --clients 1..256, --rounds 1..100, --keys x --value at most 4G)\n");
    return f == stdout ? 0 : 2;
}

#define RCMD "bench remote"

typedef struct rbench {
    const char *url;
    uint64_t value, count, keys, clients, rounds;
    int json, with_rb;
    ferry__rurl u;
    double ferry_ops, ferry_gbs, rb_ops; /* best rounds; rb_ops -1: not measured */
    char why[256];                       /* why redis-benchmark did not run */
} rbench;

/* 0 to run, 2 on a usage error (printed), -1 after --help */
static int parse_remote(int argc, char **argv, rbench *b)
{
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int rc = 0;
        if (!strcmp(a, "--url"))
            rc = cli_opt_string(RCMD, a, v, "redis://[user:password@]host:port/db or "
                                "unix:///path", &b->url), i++;
        else if (!strcmp(a, "--value"))
            rc = cli_opt_size(RCMD, a, v, 1, 256u << 20, 0, &b->value), i++;
        else if (!strcmp(a, "--count"))
            rc = cli_opt_count(RCMD, a, v, 1, 100000000, &b->count), i++;
        else if (!strcmp(a, "--keys"))
            rc = cli_opt_count(RCMD, a, v, 1, 1000000, &b->keys), i++;
        else if (!strcmp(a, "--clients"))
            rc = cli_opt_count(RCMD, a, v, 1, 256, &b->clients), i++;
        else if (!strcmp(a, "--rounds"))
            rc = cli_opt_count(RCMD, a, v, 1, 100, &b->rounds), i++;
        else if (!strcmp(a, "--json"))
            b->json = 1;
        else if (!strcmp(a, "--no-redis-benchmark"))
            b->with_rb = 0;
        else if (!strcmp(a, "-h") || !strcmp(a, "--help"))
            return usage_remote(stdout) == 0 ? -1 : 2;
        else
            return cli_unknown(RCMD, a);
        if (rc)
            return rc;
    }
    if (!b->url)
        return cli_usage(RCMD, "--url is required; accepted: --url "
                               "redis://127.0.0.1:6379/0 or unix:///path");
    /* keys x value are held on the server at once */
    if (b->keys * b->value > (4ull << 30))
        return cli_usage(RCMD, "--keys %llu: %llu values of %llu bytes; accepted: "
                               "--keys x --value at most 4G",
                         (unsigned long long)b->keys, (unsigned long long)b->keys,
                         (unsigned long long)b->value);
    if (ferry__rurl_parse(b->url, strlen(b->url), &b->u, NULL) != 0)
        return cli_bad(RCMD, "--url", NULL, "redis://[user:password@]host:port/db or unix:///path",
                       "%s", ferry_last_error());
    return 0;
}

/* the keys' values on the server: 0, or the exit status (printed) */
static int put_keys(ferry_remote *r, const rbench *b)
{
    uint8_t *buf = malloc(b->value);
    if (!buf)
        return cli_fail(RCMD, "buffer", -ENOMEM);
    for (uint64_t k = 0; k < b->keys; k++) {
        char key[48];
        snprintf(key, sizeof key, "ferry-bench:%llu", (unsigned long long)k);
        for (uint64_t i = 0; i < b->value; i++)
            buf[i] = (uint8_t)(i * 31 + k);
        int rc = ferry_remote_put_sync(r, key, strlen(key), buf, b->value);
        if (rc) {
            free(buf);
            return cli_fail(RCMD, "store", rc);
        }
    }
    free(buf);
    return 0;
}

/* remove what the benchmark stored */
static void delete_keys(ferry_remote *r, const rbench *b)
{
    for (uint64_t k = 0; k < b->keys; k++) {
        char key[48];
        snprintf(key, sizeof key, "ferry-bench:%llu", (unsigned long long)k);
        ferry_remote_key kk = {key, strlen(key)};
        ferry_remote_delete(r, &kk, 1);
    }
}

/* one pass of GETs on every client thread; pass 0 warms every connection
 * up (2 gets each), pass 1 is measured and kept when it is the best */
static int get_pass(ferry_remote *r, rbench *b, bench_thread *t, pthread_t *th, int pass)
{
    unsigned clients = (unsigned)b->clients;
    uint64_t per = pass == 0 ? 2 : b->count / clients, extra = pass == 0 ? 0 : b->count % clients;
    uint64_t t0 = ferry__now_ns();
    for (unsigned i = 0; i < clients; i++) {
        t[i] = (bench_thread){r, per + (i < extra), b->keys, (size_t)b->value, i, 0, 0};
        pthread_create(&th[i], NULL, bench_get, &t[i]);
    }
    for (unsigned i = 0; i < clients; i++)
        pthread_join(th[i], NULL);
    double secs = (double)(ferry__now_ns() - t0) / 1e9;
    uint64_t bytes = 0;
    for (unsigned i = 0; i < clients; i++) {
        if (t[i].rc)
            return t[i].rc;
        bytes += t[i].bytes;
    }
    if (pass == 1 && (double)b->count / secs > b->ferry_ops) {
        b->ferry_ops = (double)b->count / secs;
        b->ferry_gbs = (double)bytes / secs / 1e9;
    }
    return 0;
}

/* the rounds: ferry's GETs, then redis-benchmark's: 0, or the exit status */
static int measure_remote(ferry_remote *r, rbench *b)
{
    bench_thread *t = calloc(b->clients, sizeof *t);
    pthread_t *th = calloc(b->clients, sizeof *th);
    if (!t || !th) {
        free(t);
        free(th);
        return cli_fail(RCMD, "threads", -ENOMEM);
    }
    int rc = 0;
    for (uint64_t round = 0; round < b->rounds && rc == 0; round++) {
        for (int pass = 0; pass < 2 && rc == 0; pass++)
            rc = get_pass(r, b, t, th, pass);
        if (rc == 0 && b->with_rb) {
            double v = run_redis_benchmark(&b->u, (unsigned)b->clients, b->count, b->value,
                                           b->why, sizeof b->why);
            if (v < 0) {
                b->rb_ops = -1;
                b->with_rb = 0;
            } else if (v > b->rb_ops)
                b->rb_ops = v;
        }
    }
    free(t);
    free(th);
    return rc ? cli_fail(RCMD, "get", rc) : 0;
}

static void report_remote(const rbench *b)
{
    double ratio = b->rb_ops > 0 ? b->ferry_ops / b->rb_ops : -1;
    if (b->json) {
        json_t *j = json_object();
        json_object_set_new(j, "url", json_string(b->u.redacted));
        json_object_set_new(j, "value_bytes", json_integer((json_int_t)b->value));
        json_object_set_new(j, "count", json_integer((json_int_t)b->count));
        json_object_set_new(j, "clients", json_integer((json_int_t)b->clients));
        json_object_set_new(j, "rounds", json_integer((json_int_t)b->rounds));
        json_object_set_new(j, "ferry_get_per_s", json_real(b->ferry_ops));
        json_object_set_new(j, "ferry_get_gb_per_s", json_real(b->ferry_gbs));
        json_object_set_new(j, "redis_benchmark_get_per_s",
                            b->rb_ops > 0 ? json_real(b->rb_ops) : json_null());
        json_object_set_new(j, "ratio", ratio > 0 ? json_real(ratio) : json_null());
        if (b->why[0])
            json_object_set_new(j, "redis_benchmark_error", json_string(b->why));
        char *s = json_dumps(j, JSON_INDENT(2));
        printf("%s\n", s);
        free(s);
        json_decref(j);
        return;
    }
    printf("remote %s, value %llu bytes, %llu gets, %llu client(s), best of %llu round(s)\n",
           b->u.redacted, (unsigned long long)b->value, (unsigned long long)b->count,
           (unsigned long long)b->clients, (unsigned long long)b->rounds);
    printf("  ferry_remote_get:     %10.1f GET/s  %6.3f GB/s\n", b->ferry_ops, b->ferry_gbs);
    if (b->rb_ops > 0) {
        printf("  redis-benchmark GET:  %10.1f GET/s  %6.3f GB/s\n", b->rb_ops,
               b->rb_ops * (double)b->value / 1e9);
        printf("  ratio ferry/redis-benchmark: %.2fx\n", ratio);
    } else if (b->why[0]) {
        printf("  redis-benchmark: %s\n", b->why);
    }
}

int cmd_bench_remote(int argc, char **argv)
{
    static rbench b;
    memset(&b, 0, sizeof b);
    b.value = 1 << 20;
    b.count = 400;
    b.keys = 8;
    b.clients = 1;
    b.rounds = 3;
    b.with_rb = 1;
    b.rb_ops = -1;
    int rc = parse_remote(argc, argv, &b);
    if (rc)
        return rc < 0 ? 0 : rc;
    ferry_remote_options o = FERRY_REMOTE_OPTIONS_INIT;
    static const char layout[] = "ferry-bench";
    o.layout = layout;
    o.layout_len = sizeof layout - 1;
    o.connections = (uint32_t)b.clients;
    o.command_timeout_ms = 10000;
    ferry_remote *r = NULL;
    if ((rc = ferry_remote_open(b.url, &o, &r)) != 0)
        return cli_fail(RCMD, "open", rc);
    rc = put_keys(r, &b);
    if (rc == 0)
        rc = measure_remote(r, &b);
    if (rc == 0)
        delete_keys(r, &b);
    ferry_remote_close(r);
    if (rc == 0)
        report_remote(&b);
    return rc;
}
