/*
 * kv_bench_server.c - `ferry kv bench --server URL`: the lookup latency of
 * a long prompt through a `ferry serve` daemon, one client alone and N
 * client processes asking at once (the scheduler's question before it
 * allocates blocks), next to the in-process lookup of the references.
 *
 * The prompt (32k tokens, or as many whole chunks as half the daemon's
 * L1 holds) is stored once through the daemon; each client process then
 * opens a lookup-only store (no pool mapped, as a scheduler does), waits
 * for the others, and times its lookups one by one. Every lookup must find
 * the whole prompt, else the figure is void.
 */
#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kv_bench.h"

#define SL_REPS 2000   /* timed lookups per client */
#define SL_WARMUP 100

static ferry_kv_config client_cfg(const opts *o, const ferry_kv_layout *l, uint64_t l1)
{
    ferry_kv_config c = FERRY_KV_CONFIG_INIT;
    c.model = o->model;
    c.layout = *l;
    c.chunk_tokens = o->chunk_tokens;
    c.l1_bytes = l1;
    c.server = o->server;
    c.server_timeout_ms = o->server_timeout_ms; /* 0: the library's default */
    return c;
}

typedef struct lookup_arg {
    const opts *o;
    const ferry_kv_layout *l;
    const int32_t *t;
    size_t n;
} lookup_arg;

/* one client process: REPS latencies (us) into out; 0, or its exit status */
static int child(const void *arg, int go, void *out)
{
    const lookup_arg *a = arg;
    ferry_kv_config c = client_cfg(a->o, a->l, 0);
    ferry_kv *kv = NULL;
    if (ferry_kv_open(&c, &kv) < 0)
        return 3;
    char b;
    if (read(go, &b, 1) != 1)
        return 4;
    double *lat = out;
    for (int i = 0; i < SL_WARMUP; i++)
        if (ferry_kv_lookup(kv, a->t, a->n, NULL) != (int)a->n)
            return 5;
    for (int i = 0; i < SL_REPS; i++) {
        double t0 = kvb_now_s();
        int hit = ferry_kv_lookup(kv, a->t, a->n, NULL);
        lat[i] = (kvb_now_s() - t0) * 1e6;
        if (hit != (int)a->n)
            return 5;
    }
    ferry_kv_close(kv);
    return 0;
}

/* read exactly len bytes from fd: 0, or -EIO */
static int read_all(int fd, void *buf, size_t len)
{
    char *p = buf;
    while (len) {
        ssize_t r = read(fd, p, len);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return -EIO;
        p += r;
        len -= (size_t)r;
    }
    return 0;
}

static int write_all(int fd, const void *buf, size_t len)
{
    const char *p = buf;
    while (len) {
        ssize_t w = write(fd, p, len);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return -EIO;
        p += w;
        len -= (size_t)w;
    }
    return 0;
}

int kvb_fork_clients(unsigned clients, kvb_child_fn fn, const void *arg, void *out, size_t each)
{
    if (clients == 0 || clients > KVB_CLIENTS_MAX)
        return -EINVAL;
    int go[2], res[KVB_CLIENTS_MAX];
    pid_t pid[KVB_CLIENTS_MAX];
    if (pipe(go) != 0)
        return -errno;
    unsigned started = 0;
    int rc = 0;
    fflush(stdout);
    for (; started < clients; started++) {
        int p[2];
        if (pipe(p) != 0) {
            rc = -errno;
            break;
        }
        pid[started] = fork();
        if (pid[started] < 0) {
            rc = -errno;
            close(p[0]);
            close(p[1]);
            break;
        }
        if (pid[started] == 0) {
            close(go[1]);
            close(p[0]);
            void *mine = calloc(1, each);
            int st = mine ? fn(arg, go[0], mine) : 2;
            if (st == 0 && write_all(p[1], mine, each) < 0)
                st = 6;
            _exit(st);
        }
        close(p[1]);
        res[started] = p[0];
    }
    close(go[0]);
    usleep(200000); /* let every client connect before the start */
    for (unsigned i = 0; i < started; i++)
        if (write(go[1], "g", 1) != 1)
            rc = rc ? rc : -EIO;
    close(go[1]);
    for (unsigned i = 0; i < started; i++) {
        if (read_all(res[i], (char *)out + (size_t)i * each, each) < 0)
            rc = rc ? rc : -EIO;
        close(res[i]);
    }
    for (unsigned i = 0; i < started; i++) {
        int ws = 0;
        waitpid(pid[i], &ws, 0);
        if (!WIFEXITED(ws) || WEXITSTATUS(ws) != 0)
            rc = rc ? rc : FERRY_ECONN;
    }
    return rc;
}

int kvb_server_lookup(const opts *o, const ferry_kv_layout *l, srv_lookup *s)
{
    memset(s, 0, sizeof *s);
    s->clients = o->clients;
    ferry_kv_config c = client_cfg(o, l, 1);
    ferry_kv *kv = NULL;
    int rc = ferry_kv_open(&c, &kv);
    if (rc < 0)
        return s->rc = rc;
    ferry_kv_stats m = FERRY_KV_STATS_INIT;
    uint64_t chunk = ferry_kv_chunk_bytes(kv);
    rc = ferry_kv_stats_get(kv, &m);
    uint64_t fit = rc == 0 ? m.tier[FERRY_KV_TIER_L1].capacity_bytes / chunk / 2 : 0;
    uint64_t most = fit * o->chunk_tokens;
    size_t n = (size_t)(most < 32768 ? most : 32768);
    n -= n % o->chunk_tokens;
    s->tokens = n;
    int32_t *t = malloc((n ? n : 1) * sizeof *t);
    engine_buf b;
    memset(&b, 0, sizeof b);
    if (rc == 0 && (!n || !t))
        rc = -ENOMEM;
    if (rc == 0)
        rc = kvb_buffer_alloc(NULL, l, n, &b);
    if (rc == 0) {
        uint64_t seed = o->seed * 7919 + 32768;
        for (size_t i = 0; i < n; i++)
            t[i] = (int32_t)(kvb_rng_next(&seed) % 128000);
        int st = ferry_kv_store(kv, t, n, NULL, &b.b);
        rc = st == (int)n ? 0 : st < 0 ? st : -ENOSPC;
        kvb_buffer_free(&b);
    }
    ferry_kv_close(kv);
    double *lat = rc == 0 ? malloc((size_t)o->clients * SL_REPS * sizeof *lat) : NULL;
    if (rc == 0 && !lat)
        rc = -ENOMEM;
    lookup_arg a = {o, l, t, n};
    size_t each = SL_REPS * sizeof *lat;
    if (rc == 0 && (rc = kvb_fork_clients(1, child, &a, lat, each)) == 0) {
        s->one_p50_us = kvb_pct(lat, SL_REPS, 0.5);
        s->one_p99_us = kvb_pct(lat, SL_REPS, 0.99);
    }
    if (rc == 0 && (rc = kvb_fork_clients(o->clients, child, &a, lat, each)) == 0) {
        size_t all = (size_t)o->clients * SL_REPS;
        double sum = 0;
        for (size_t i = 0; i < all; i++)
            sum += lat[i];
        s->mean_us = sum / (double)all;
        s->p50_us = kvb_pct(lat, all, 0.5);
        s->p99_us = kvb_pct(lat, all, 0.99);
    }
    free(lat);
    free(t);
    return s->rc = rc;
}

void kvb_server_lookup_print(const srv_lookup *s, const refs *rf)
{
    if (s->rc < 0) {
        printf("  server lookup       failed: %s\n", ferry_strerror(s->rc));
        return;
    }
    printf("  server lookup       %zu tokens: 1 client p50 %.2f us, p99 %.2f us; %u clients "
           "at once p50 %.2f us, p99 %.2f us, mean %.2f us",
           s->tokens, s->one_p50_us, s->one_p99_us, s->clients, s->p50_us, s->p99_us,
           s->mean_us);
    if (rf && rf->lookup32k_p50_us > 0)
        printf(" (1 client p50 = %.1fx the in-process lookup)",
               kvb_ratio(s->one_p50_us, rf->lookup32k_p50_us));
    printf("\n");
}

json_t *kvb_server_lookup_json(const srv_lookup *s)
{
    json_t *j = json_object();
    json_object_set_new(j, "tokens", json_integer((json_int_t)s->tokens));
    json_object_set_new(j, "clients", json_integer(s->clients));
    json_object_set_new(j, "one_client_p50_us", json_real(s->one_p50_us));
    json_object_set_new(j, "one_client_p99_us", json_real(s->one_p99_us));
    json_object_set_new(j, "p50_us", json_real(s->p50_us));
    json_object_set_new(j, "p99_us", json_real(s->p99_us));
    json_object_set_new(j, "mean_us", json_real(s->mean_us));
    if (s->rc < 0)
        json_object_set_new(j, "error", json_string(ferry_strerror(s->rc)));
    return j;
}
