/*
 * serve_metrics.c - `ferry serve --metrics HOST:PORT`: the daemon's
 * Prometheus metrics over HTTP, served by libmicrohttpd (its own thread,
 * a bounded number of connections, a timeout each). GET /metrics answers
 * the hosted store's families (ferry_kv_*, as ferry_kv_metrics_prometheus
 * writes them) and the daemon's own (ferry_serve_*); anything else is 404.
 *
 * libmicrohttpd's own messages ("Failed to bind to port ...") never reach
 * stderr raw: they go to the daemon's log function, which holds them while
 * the daemon starts; a start it refuses is said in the caller's one line.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <microhttpd.h>

#include "serve_metrics.h"

/* the daemon's own families, appended to buf at off; the new length */
static size_t serve_families(ferry_serve *s, char *buf, size_t cap, size_t off)
{
    ferry_serve_stats st = FERRY_SERVE_STATS_INIT;
    if (ferry_serve_stats_get(s, &st) < 0)
        return off;
    static const struct {
        const char *name, *type, *help;
        size_t off;
    } fam[] = {
        {"ferry_serve_clients", "gauge", "Client connections served now.",
         offsetof(ferry_serve_stats, clients)},
        {"ferry_serve_connections_total", "counter", "Client connections accepted.",
         offsetof(ferry_serve_stats, connections)},
        {"ferry_serve_refused_total", "counter",
         "Connections refused (another uid, past max_clients).",
         offsetof(ferry_serve_stats, refused)},
        {"ferry_serve_requests_total", "counter", "Requests answered.",
         offsetof(ferry_serve_stats, requests)},
        {"ferry_serve_bad_frames_total", "counter",
         "Malformed frames, unknown versions or types, slots not held.",
         offsetof(ferry_serve_stats, bad_frames)},
        {"ferry_serve_slow_clients_total", "counter",
         "Clients disconnected for not reading their replies.",
         offsetof(ferry_serve_stats, slow_clients)},
        {"ferry_serve_released_total", "counter",
         "Reservations and locks released by a closing connection.",
         offsetof(ferry_serve_stats, released)},
        {"ferry_serve_ahead_dropped_total", "counter",
         "Read-ahead chunks dropped unread because their client went.",
         offsetof(ferry_serve_stats, ahead_dropped)},
    };
    for (size_t i = 0; i < sizeof fam / sizeof fam[0] && off < cap; i++) {
        uint64_t v;
        memcpy(&v, (const char *)&st + fam[i].off, sizeof v);
        int n = snprintf(buf + off, cap - off, "# HELP %s %s\n# TYPE %s %s\n%s %llu\n",
                         fam[i].name, fam[i].help, fam[i].name, fam[i].type, fam[i].name,
                         (unsigned long long)v);
        if (n < 0 || (size_t)n >= cap - off)
            return off;
        off += (size_t)n;
    }
    return off;
}

/* the clients' back-pressure families, one sample per connected client
 * (labelled by pid and uid), appended to buf at off; the new length */
static size_t client_families(ferry_serve *s, char *buf, size_t cap, size_t off)
{
    ferry_serve_client cl[256];
    int n = ferry_serve_clients(s, cl, sizeof cl / sizeof cl[0], sizeof cl[0]);
    if (n < 0)
        return off;
    size_t k = (size_t)n < sizeof cl / sizeof cl[0] ? (size_t)n : sizeof cl / sizeof cl[0];
    static const char *const fam[3][3] = {
        {"ferry_serve_client_pool_waits_total", "counter",
         "Times the client found every L1 slot locked and waited for one."},
        {"ferry_serve_client_pool_wait_seconds_total", "counter",
         "Time the client spent waiting for L1 slots."},
        {"ferry_serve_client_pool_declines_total", "counter",
         "Chunks declined FERRY_ENOSPACE to the client (no slot in time, or past its share)."},
    };
    for (int f = 0; f < 3; f++) {
        int w = snprintf(buf + off, cap - off, "# HELP %s %s\n# TYPE %s %s\n", fam[f][0],
                         fam[f][2], fam[f][0], fam[f][1]);
        if (w < 0 || (size_t)w >= cap - off)
            return off;
        off += (size_t)w;
        for (size_t i = 0; i < k; i++) {
            if (f == 1)
                w = snprintf(buf + off, cap - off, "%s{pid=\"%d\",uid=\"%u\"} %.6f\n",
                             fam[f][0], (int)cl[i].pid, (unsigned)cl[i].uid,
                             (double)cl[i].wait_ns / 1e9);
            else
                w = snprintf(buf + off, cap - off, "%s{pid=\"%d\",uid=\"%u\"} %llu\n",
                             fam[f][0], (int)cl[i].pid, (unsigned)cl[i].uid,
                             (unsigned long long)(f == 0 ? cl[i].waits : cl[i].declines));
            if (w < 0 || (size_t)w >= cap - off)
                return off;
            off += (size_t)w;
        }
    }
    return off;
}

static enum MHD_Result answer(void *cls, struct MHD_Connection *conn, const char *url,
                              const char *method, const char *version, const char *upload,
                              size_t *upload_len, void **con_cls)
{
    (void)version;
    (void)upload;
    (void)con_cls;
    ferry_serve *s = cls;
    struct MHD_Response *r;
    unsigned code = MHD_HTTP_OK;
    if (strcmp(method, "GET") || *upload_len || strcmp(url, "/metrics")) {
        static char nf[] = "ferry serve: GET /metrics\n";
        code = strcmp(method, "GET") ? MHD_HTTP_METHOD_NOT_ALLOWED : MHD_HTTP_NOT_FOUND;
        r = MHD_create_response_from_buffer(strlen(nf), nf, MHD_RESPMEM_PERSISTENT);
    } else {
        int need = ferry_kv_metrics_prometheus(ferry_serve_kv(s), NULL, 0);
        size_t cap = (need > 0 ? (size_t)need : 0) + 4096 + 256 * 3 * 96;
        char *buf = malloc(cap);
        if (!buf)
            return MHD_NO;
        int n = ferry_kv_metrics_prometheus(ferry_serve_kv(s), buf, cap);
        size_t len = n > 0 && (size_t)n < cap ? (size_t)n : 0;
        len = serve_families(s, buf, cap, len);
        len = client_families(s, buf, cap, len);
        r = MHD_create_response_from_buffer(len, buf, MHD_RESPMEM_MUST_FREE);
        if (r)
            MHD_add_response_header(r, "Content-Type", "text/plain; version=0.0.4");
        else
            free(buf);
    }
    if (!r)
        return MHD_NO;
    enum MHD_Result ok = MHD_queue_response(conn, code, r);
    MHD_destroy_response(r);
    return ok;
}

/* where libmicrohttpd's messages go: one daemon per process, so one of
 * these, set before the daemon starts and read by its thread after */
static serve_metrics_log g_log;
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER; /* the two below */
static char g_first[512]; /* the first message while starting, for the reason */
static int g_starting;

static void http_log(void *cls, const char *fmt, va_list ap)
{
    (void)cls;
    char msg[512];
    int e = errno;
    if (vsnprintf(msg, sizeof msg, fmt, ap) < 0)
        snprintf(msg, sizeof msg, "%s", fmt);
    for (size_t n = strlen(msg); n && (msg[n - 1] == '\n' || msg[n - 1] == '\r');)
        msg[--n] = 0;
    pthread_mutex_lock(&g_mu);
    if (g_starting && !*g_first)
        snprintf(g_first, sizeof g_first, "%s", msg);
    pthread_mutex_unlock(&g_mu);
    if (g_log)
        g_log(msg);
    errno = e;
}

struct MHD_Daemon *serve_metrics_start(ferry_serve *s, const struct sockaddr_in *sa,
                                       serve_metrics_log log, char *why, size_t whylen)
{
    g_log = log;
    pthread_mutex_lock(&g_mu);
    g_first[0] = 0;
    g_starting = 1;
    pthread_mutex_unlock(&g_mu);
    errno = 0;
    struct MHD_Daemon *d = MHD_start_daemon(
        MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_ERROR_LOG, ntohs(sa->sin_port), NULL, NULL,
        answer, s, MHD_OPTION_EXTERNAL_LOGGER, http_log, NULL, MHD_OPTION_SOCK_ADDR,
        (const struct sockaddr *)sa, MHD_OPTION_CONNECTION_LIMIT, (unsigned)16,
        MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)5, MHD_OPTION_END);
    int e = errno;
    pthread_mutex_lock(&g_mu);
    g_starting = 0;
    if (!d && why && whylen)
        snprintf(why, whylen, "%s",
                 e ? strerror(e) : *g_first ? g_first : "libmicrohttpd refused to start");
    pthread_mutex_unlock(&g_mu);
    return d;
}

void serve_metrics_stop(struct MHD_Daemon *d)
{
    if (d)
        MHD_stop_daemon(d);
}
