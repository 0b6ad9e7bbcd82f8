/*
 * cmd_serve.c - `ferry serve`: the host's KV cache daemon, in the
 * foreground (logs on stderr; SIGTERM or SIGINT: disconnect, flush, sync,
 * close), and `ferry serve status`: a running daemon's tiers, clients and
 * hit rates.
 */
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "cli.h"
#include "kv/proto.h"
#include "serve_metrics.h"

#define SERVE_CMD "serve"
#define STATUS_CMD "serve status"
#define SOCKET_DEFAULT "/run/ferry/ferry.sock"
#define MAX_ALLOW 64

static ferry_serve *g_serve;

static void on_signal(int sig)
{
    (void)sig;
    ferry_serve_stop(g_serve);
}

static void usage(FILE *f)
{
    fprintf(f,
            "usage: ferry serve [options]\n"
            "  --socket PATH          Unix-domain socket (default " SOCKET_DEFAULT ")\n"
            "  --group NAME           socket 0660 for this group (default: 0600, owner only)\n"
            "  --allow-uid UID        accept this uid too (repeatable, up to %d)\n"
            "  --max-clients N        connections at once (default 256)\n"
            "  --l1 SIZE              shared-memory pool (default 2G)\n"
            "  --l2 DIR:SIZE          persistent NVMe slab in DIR (an existing directory)\n"
            "  --remote URL           Redis/Valkey tier (redis://host:port/db)\n"
            "  --model llama3-8b|qwen2.5-0.5b|tiny   the KV shape served (default llama3-8b)\n"
            "  --metrics HOST:PORT    Prometheus metrics over HTTP (GET /metrics), e.g.\n"
            "                         127.0.0.1:9400 (default: none)\n"
            "  --chunk-tokens N       tokens per chunk (default 256)\n"
            "clients open their store with ferry_kv_config.server = \"unix:PATH\" and the same\n"
            "layout and chunk size; SIGTERM stops cleanly (flush, sync, close).\n",
            MAX_ALLOW);
}

typedef struct serve_opts {
    const char *socket, *group, *l2, *remote, *model, *metrics;
    uint32_t allow[MAX_ALLOW];
    size_t nallow;
    uint64_t max_clients, l1, chunk_tokens;
} serve_opts;

static int layout_of(const char *model, ferry_kv_layout *l)
{
    ferry_kv_layout d = FERRY_KV_LAYOUT_INIT;
    if (!strcmp(model, "qwen2.5-0.5b")) {
        d.num_layers = 24;
        d.num_heads = 2;
        d.head_dim = 64;
    } else if (!strcmp(model, "tiny")) {
        d.num_layers = 2;
        d.num_heads = 2;
        d.head_dim = 64;
    }
    *l = d;
    return 0;
}

static int parse_one(serve_opts *o, const char *a, const char *v, int *used)
{
    static const char *const models[] = {"llama3-8b", "qwen2.5-0.5b", "tiny", NULL};
    uint64_t x = 0;
    int k = 0;
    *used = 1;
    if (!strcmp(a, "--socket"))
        return cli_opt_string(SERVE_CMD, a, v, "a socket path", &o->socket);
    if (!strcmp(a, "--group"))
        return cli_opt_string(SERVE_CMD, a, v, "a group name", &o->group);
    if (!strcmp(a, "--l2"))
        return cli_opt_string(SERVE_CMD, a, v, "DIR:SIZE", &o->l2);
    if (!strcmp(a, "--metrics")) {
        struct sockaddr_in sa;
        int rc = cli_opt_string(SERVE_CMD, a, v, "HOST:PORT, an IPv4 address and a port",
                                &o->metrics);
        if (rc == 0 && serve_metrics_addr(o->metrics, &sa) < 0)
            rc = cli_bad(SERVE_CMD, a, v, "HOST:PORT, an IPv4 address and a port 0..65535",
                         "not an address and port");
        return rc;
    }
    if (!strcmp(a, "--remote"))
        return cli_opt_string(SERVE_CMD, a, v, "redis://host:port/db", &o->remote);
    if (!strcmp(a, "--l1"))
        return cli_opt_size(SERVE_CMD, a, v, 4096, 16ull << 40, 0, &o->l1);
    if (!strcmp(a, "--max-clients"))
        return cli_opt_count(SERVE_CMD, a, v, 1, 65536, &o->max_clients);
    if (!strcmp(a, "--chunk-tokens"))
        return cli_opt_count(SERVE_CMD, a, v, 1, 65536, &o->chunk_tokens);
    if (!strcmp(a, "--model")) {
        int rc = cli_opt_choice(SERVE_CMD, a, v, models, &k);
        if (rc == 0)
            o->model = models[k];
        return rc;
    }
    if (!strcmp(a, "--allow-uid")) {
        if (o->nallow == MAX_ALLOW)
            return cli_bad(SERVE_CMD, a, v, "at most 64 of them", "one too many");
        int rc = cli_opt_count(SERVE_CMD, a, v, 0, UINT32_MAX - 1, &x);
        if (rc == 0)
            o->allow[o->nallow++] = (uint32_t)x;
        return rc;
    }
    *used = 0;
    return cli_unknown(SERVE_CMD, a);
}

/* --l2 DIR:SIZE into the store's config (dir points into the argument copy) */
static int l2_of(const char *spec, char **dir, uint64_t *bytes)
{
    const char *colon = strrchr(spec, ':');
    if (!colon || colon == spec)
        return cli_bad(SERVE_CMD, "--l2", spec, "DIR:SIZE, e.g. /nvme0/ferry:2T", "no ':SIZE'");
    *dir = strndup(spec, (size_t)(colon - spec));
    if (!*dir)
        return cli_fail(SERVE_CMD, "--l2", -ENOMEM);
    int rc = cli_opt_size(SERVE_CMD, "--l2", colon + 1, 1u << 20, 1ull << 50, 0, bytes);
    if (rc == 0)
        rc = cli_opt_dir(SERVE_CMD, "--l2", *dir, 0);
    return rc;
}

int cmd_serve(int argc, char **argv)
{
    serve_opts o;
    memset(&o, 0, sizeof o);
    o.socket = SOCKET_DEFAULT;
    o.model = "llama3-8b";
    o.l1 = 2ull << 30;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            usage(stdout);
            return 0;
        }
        int used = 0;
        int rc = parse_one(&o, argv[i], i + 1 < argc ? argv[i + 1] : NULL, &used);
        if (rc)
            return rc;
        i += used;
    }
    ferry_kv_config kc = FERRY_KV_CONFIG_INIT;
    kc.model = o.model;
    layout_of(o.model, &kc.layout);
    kc.chunk_tokens = (uint32_t)o.chunk_tokens;
    kc.l1_bytes = o.l1;
    kc.remote_url = o.remote;
    char *dir = NULL;
    if (o.l2) {
        int rc = l2_of(o.l2, &dir, &kc.l2_bytes);
        if (rc) {
            free(dir);
            return rc;
        }
        kc.l2_dir = dir;
        kc.l2_persistent = 1;
    }
    if (!getenv("FERRY_LOG"))
        ferry_log_set_level(FERRY_LOG_INFO);
    ferry_serve_config sc = FERRY_SERVE_CONFIG_INIT;
    sc.socket_path = o.socket;
    sc.group = o.group;
    sc.allow_uids = o.allow;
    sc.n_allow_uids = o.nallow;
    sc.max_clients = (unsigned)o.max_clients;
    sc.kv = &kc;
    int rc = ferry_serve_open(&sc, &g_serve);
    if (rc < 0) {
        free(dir);
        return cli_fail(SERVE_CMD, "open", rc);
    }
    struct MHD_Daemon *http = NULL;
    if (o.metrics) {
        struct sockaddr_in sa;
        serve_metrics_addr(o.metrics, &sa);
        http = serve_metrics_start(g_serve, &sa);
        if (!http) {
            fprintf(stderr, "ferry serve: --metrics %s: cannot serve HTTP there (%s)\n",
                    o.metrics, strerror(errno));
            ferry_serve_close(g_serve);
            free(dir);
            return 1;
        }
        fprintf(stderr, "ferry serve: metrics on http://%s/metrics\n", o.metrics);
    }
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    fprintf(stderr, "ferry serve: serving on %s (pid %d)\n", o.socket, (int)getpid());
    ferry_serve_run(g_serve);
    serve_metrics_stop(http);
    rc = ferry_serve_close(g_serve);
    g_serve = NULL;
    free(dir);
    if (rc < 0)
        return cli_fail(SERVE_CMD, "close", rc);
    fprintf(stderr, "ferry serve: stopped cleanly\n");
    return 0;
}

/* ---- status: a raw client (HELLO any geometry, no pool; STATS) ---- */

static int xfer(int fd, ferry__proto_buf *b, uint8_t *in, size_t cap, ferry__proto_rd *rd)
{
    if (send(fd, b->p, b->len, MSG_NOSIGNAL) != (ssize_t)b->len)
        return -EIO;
    uint8_t hb[FERRY__PROTO_HDR];
    size_t got = 0;
    ferry__proto_hdr h;
    char why[128];
    while (got < sizeof hb) {
        struct pollfd p = {fd, POLLIN, 0};
        if (poll(&p, 1, 2000) <= 0)
            return -ETIMEDOUT;
        ssize_t r = recv(fd, hb + got, sizeof hb - got, 0);
        if (r <= 0)
            return -ECONNRESET;
        got += (size_t)r;
    }
    if (ferry__proto_hdr_decode(hb, sizeof hb, &h, why, sizeof why) < 0 || h.len > cap)
        return FERRY_EPARSE;
    for (got = 0; got < h.len;) {
        struct pollfd p = {fd, POLLIN, 0};
        if (poll(&p, 1, 2000) <= 0)
            return -ETIMEDOUT;
        ssize_t r = recv(fd, in + got, h.len - got, 0);
        if (r <= 0)
            return -ECONNRESET;
        got += (size_t)r;
    }
    rd->p = in;
    rd->end = in + h.len;
    rd->err = 0;
    return 0;
}

static void print_status(ferry__proto_rd *rd, const char *path)
{
    uint32_t clients = ferry__proto_get_u32(rd), size = ferry__proto_get_u32(rd);
    ferry_kv_stats m;
    memset(&m, 0, sizeof m);
    if (!rd->err && size <= (size_t)(rd->end - rd->p))
        memcpy(&m, rd->p, size < sizeof m ? size : sizeof m);
    static const char *const names[FERRY_KV_TIERS] = {"-", "L1", "L2", "remote"};
    printf("ferry serve on %s: %u clients, %llu chunks indexed\n", path, clients,
           (unsigned long long)m.chunks);
    for (int t = 1; t < FERRY_KV_TIERS; t++) {
        const ferry_kv_tier_stats *ts = &m.tier[t];
        if (!ts->capacity_bytes && !ts->chunks)
            continue;
        printf("  %-6s %llu chunks, %.1f%% of %llu bytes, %llu hits, %llu evictions\n", names[t],
               (unsigned long long)ts->chunks, ts->usage * 100,
               (unsigned long long)ts->capacity_bytes, (unsigned long long)ts->hits,
               (unsigned long long)ts->evictions);
    }
    double hr = m.lookup_tokens ? (double)m.hit_tokens / (double)m.lookup_tokens : 0;
    printf("  lookups %llu, token hit rate %.1f%%, stored %llu chunks, retrieved %llu, "
           "misses %llu\n",
           (unsigned long long)m.lookups, hr * 100, (unsigned long long)m.stored_chunks,
           (unsigned long long)m.retrieved_chunks, (unsigned long long)m.misses);
}

int cmd_serve_status(int argc, char **argv)
{
    const char *path = SOCKET_DEFAULT;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            printf("usage: ferry serve status [--socket PATH]   (default " SOCKET_DEFAULT ")\n");
            return 0;
        }
        if (strcmp(argv[i], "--socket"))
            return cli_unknown(STATUS_CMD, argv[i]);
        int rc = cli_opt_string(STATUS_CMD, argv[i], i + 1 < argc ? argv[i + 1] : NULL,
                                "a socket path", &path);
        if (rc)
            return rc;
        i++;
    }
    struct sockaddr_un a;
    memset(&a, 0, sizeof a);
    a.sun_family = AF_UNIX;
    if (strlen(path) >= sizeof a.sun_path)
        return cli_bad(STATUS_CMD, "--socket", path, "a shorter path", "too long");
    memcpy(a.sun_path, path, strlen(path) + 1);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        fprintf(stderr, "ferry serve status: %s: no daemon answers (%s)\n", path,
                strerror(errno));
        if (fd >= 0)
            close(fd);
        return 1;
    }
    ferry__proto_buf b = {0};
    static uint8_t in[64 << 10];
    ferry__proto_rd rd;
    ferry__proto_req q;
    memset(&q, 0, sizeof q);
    q.hdr.type = FERRY__P_HELLO;
    q.hdr.rid = 1;
    q.hello.flags = FERRY__HELLO_NO_POOL | FERRY__HELLO_ANY;
    char msg[FERRY__PROTO_MAX_MSG + 1];
    int rc = ferry__proto_req_encode(&b, &q);
    if (rc == 0)
        rc = xfer(fd, &b, in, sizeof in, &rd);
    if (rc == 0)
        rc = ferry__proto_reply_head(&rd, msg, sizeof msg);
    if (rc >= 0) {
        q.hdr.type = FERRY__P_STATS;
        q.hdr.rid = 2;
        rc = ferry__proto_req_encode(&b, &q);
    }
    if (rc == 0)
        rc = xfer(fd, &b, in, sizeof in, &rd);
    if (rc == 0)
        rc = ferry__proto_reply_head(&rd, msg, sizeof msg);
    if (rc >= 0)
        print_status(&rd, path);
    else
        fprintf(stderr, "ferry serve status: %s: %s%s%s\n", path, ferry_strerror(rc),
                *msg ? ": " : "", msg);
    ferry__proto_buf_free(&b);
    close(fd);
    return rc < 0 ? 1 : 0;
}
