/*
 * cmd_serve.c - `ferry serve`: the host's KV cache daemon, in the
 * foreground (logs on stderr; SIGTERM, SIGINT or SIGHUP, unless started
 * with it ignored: disconnect, flush, sync, close), and `ferry serve status`: a running daemon's tiers, clients, hit
 * rates and its own counters (ferry_serve_stats).
 *
 * A start that is refused (the socket in use, the metrics port taken, a
 * bad directory) prints exactly one line, the reason: what the daemon
 * would say while it starts (the configuration's sources, the library's
 * info lines, libmicrohttpd's own messages) is held until it serves, then
 * printed in order before "serving on"; a refused start drops it.
 *
 * Addresses: the daemon listens on a Unix-domain socket, named by a path
 * or "unix:PATH" (cli_parse_socket); tcp:// or any other scheme is
 * refused wherever a socket is given (--socket, the file's socket key,
 * FERRY_SOCKET), never taken for a path.
 */
#include <errno.h>
#include <grp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "cli.h"
#include "proto/proto.h"
#include "serve/serve_config.h"
#include "serve_metrics.h"

#define SERVE_CMD "serve"
#define STATUS_CMD "serve status"
#define SOCKET_DEFAULT "/run/ferry/ferry.sock"
#define REMOTE_FORMS "redis://[user:password@]host:port/db or unix:///path"

static ferry_serve *g_serve;

/* ---- what the daemon says while it starts (see the note above) ---- */

#define SAY_HELD_MAX (64u << 10)

static struct {
    pthread_mutex_t mu;
    int live;      /* serving: lines go to stderr as they come */
    char *held;    /* the lines said before, in order */
    size_t len, cap;
    unsigned lost; /* lines past SAY_HELD_MAX */
} g_say = {PTHREAD_MUTEX_INITIALIZER, 0, NULL, 0, 0, 0};

static void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void say(const char *fmt, ...)
{
    char line[1200];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    if (n < 0)
        return;
    size_t len = (size_t)n < sizeof line ? (size_t)n : sizeof line - 1;
    pthread_mutex_lock(&g_say.mu);
    if (g_say.live) {
        fputs(line, stderr);
    } else if (g_say.len + len > SAY_HELD_MAX) {
        g_say.lost++;
    } else {
        if (g_say.len + len + 1 > g_say.cap) {
            size_t cap = g_say.cap ? g_say.cap * 2 : 4096;
            while (cap < g_say.len + len + 1)
                cap *= 2;
            char *p = realloc(g_say.held, cap);
            if (!p) {
                g_say.lost++;
                pthread_mutex_unlock(&g_say.mu);
                return;
            }
            g_say.held = p;
            g_say.cap = cap;
        }
        memcpy(g_say.held + g_say.len, line, len + 1);
        g_say.len += len;
    }
    pthread_mutex_unlock(&g_say.mu);
}

/* the daemon serves: what was held goes out, and from now on each line as
 * it comes */
static void say_live(void)
{
    pthread_mutex_lock(&g_say.mu);
    if (g_say.len)
        fputs(g_say.held, stderr);
    if (g_say.lost)
        fprintf(stderr, "ferry serve: (%u more lines while starting, not kept)\n", g_say.lost);
    free(g_say.held);
    g_say.held = NULL;
    g_say.len = g_say.cap = 0;
    g_say.lost = 0;
    g_say.live = 1;
    pthread_mutex_unlock(&g_say.mu);
}

/* the start was refused: what it said is dropped (its one error line is
 * printed by the caller) */
static void say_drop(void)
{
    pthread_mutex_lock(&g_say.mu);
    free(g_say.held);
    g_say.held = NULL;
    g_say.len = g_say.cap = 0;
    g_say.lost = 0;
    pthread_mutex_unlock(&g_say.mu);
}

/* the library's log lines, formatted as it formats them on stderr */
static void on_log(int level, const char *msg, void *ctx)
{
    static const char *const tags[] = {"", "error", "warn", "info", "debug", "trace"};
    (void)ctx;
    say("ferry %s: %s\n", tags[level < 0 ? 0 : level > 5 ? 5 : level], msg);
}

/* libmicrohttpd's messages, as the daemon's own */
static void on_http_log(const char *msg)
{
    say("ferry serve: metrics: %s\n", msg);
}

/* a stop asked for before the daemon was open: it stops as soon as it is */
static volatile sig_atomic_t g_stop;

static void on_signal(int sig)
{
    (void)sig;
    int e = errno; /* (the code the interrupted thread may be about to read) */
    g_stop = 1;
    ferry_serve_stop(g_serve); /* (NULL until open: does nothing; a write) */
    errno = e;
}

/* SIGTERM, SIGINT and SIGHUP stop the daemon cleanly from before it opens
 * (a script that waits for the socket file and then stops it is never a
 * kill that leaves the file behind); a hang-up (its terminal closed) too,
 * unless it was started with SIGHUP ignored (nohup) */
static void on_stop_signals(void)
{
    struct sigaction sa, old;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    if (sigaction(SIGHUP, NULL, &old) == 0 && old.sa_handler != SIG_IGN)
        sigaction(SIGHUP, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
}

static void usage(FILE *f)
{
    fprintf(f,
            "usage: ferry serve [--config FILE] [options]\n"
            "  --config FILE          YAML: ferry_kv_config's keys (model, l1_bytes, l2_dir or\n"
            "                         l2_dirs, l2_bytes, remote_url, workers, ...) and socket,\n"
            "                         group, allow_uids, max_clients, send_timeout_ms, metrics\n"
            "                         (README: \"Configuring ferry serve\"); FERRY_<KEY>\n"
            "                         variables override the file, flags override both\n"
            "  --socket PATH          Unix-domain socket, PATH or unix:PATH (default\n"
            "                         /run/ferry/ferry.sock; no TCP)\n"
            "  --group NAME           socket 0660 for this group (default: 0600, owner only)\n"
            "  --allow-uid UID        accept this uid too (repeatable, up to %d); needs\n"
            "                         --group, a group it is in (else a usage error: the\n"
            "                         0600 socket keeps any uid but root out)\n"
            "  --max-clients N        engines at once (default 256; serve status is none)\n"
            "  --l1 SIZE              shared-memory pool (default 2G)\n"
            "  --l2 DIR:SIZE          persistent NVMe slab in DIR (an existing directory);\n"
            "                         repeat it for several drives (the same SIZE on each,\n"
            "                         up to 16): one slab striped across them\n"
            "  --remote URL           Redis/Valkey tier (redis://host:port/db)\n"
            "  --model llama3-8b|qwen2.5-0.5b|tiny   the KV shape served (default llama3-8b)\n"
            "  --metrics HOST:PORT    Prometheus metrics over HTTP (GET /metrics), e.g.\n"
            "                         127.0.0.1:9400 (default: none)\n"
            "  --chunk-tokens N       tokens per chunk (default 256)\n"
            "clients open their store with ferry_kv_config.server = \"unix:PATH\" and the same\n"
            "layout and chunk size; SIGTERM, SIGINT or SIGHUP (unless ignored, nohup) stops\n"
            "cleanly (flush, sync, close); the configuration is read once, at start.\n"
            "ferry serve status [--socket PATH]: a running daemon's tiers, clients and hit\n"
            "rates (ferry serve status --help).\n",
            FERRY__SERVE_CONF_MAX_ALLOW);
}

/* --l2 DIR:SIZE: the directory (a string of c's) and the size */
static int l2_of(ferry__serve_conf *c, const char *spec, const char **dir, uint64_t *bytes)
{
    const char *colon = spec ? strrchr(spec, ':') : NULL;
    if (!spec || !colon || colon == spec)
        return cli_bad(SERVE_CMD, "--l2", spec, "DIR:SIZE, e.g. /nvme0/ferry:2T",
                       spec ? "no ':SIZE'" : "needs a value");
    char *d = strndup(spec, (size_t)(colon - spec));
    *dir = d ? ferry__serve_conf_strdup(c, d) : NULL;
    free(d);
    if (!*dir)
        return cli_fail(SERVE_CMD, "--l2", -ENOMEM);
    return cli_opt_size(SERVE_CMD, "--l2", colon + 1, 1u << 20, 1ull << 50, 0, bytes);
}

/* the list flags (--l2, --allow-uid): the first one given replaces what
 * the file and the environment said, the next ones add to it */
static int parse_list(ferry__serve_conf *c, const char *a, const char *v, int *l2_flags, int *uid_flags)
{
    uint64_t x = 0;
    if (!strcmp(a, "--l2")) {
        const char *dir = NULL;
        uint64_t bytes = 0;
        int rc = l2_of(c, v, &dir, &bytes);
        if (rc)
            return rc;
        if (*l2_flags && bytes != c->kv.l2_bytes)
            return cli_bad(SERVE_CMD, a, v, "the same SIZE for every --l2 (each directory "
                           "holds an equal share of the striped slab)", "another size");
        if (!*l2_flags)
            c->n_l2 = 0;
        for (unsigned i = 0; i < c->n_l2; i++)
            if (!strcmp(c->l2[i], dir))
                return cli_bad(SERVE_CMD, a, v, "each directory once", "given twice");
        if (c->n_l2 == FERRY__SERVE_CONF_MAX_L2)
            return cli_bad(SERVE_CMD, a, v, "at most 16 of them", "one too many");
        c->l2[c->n_l2++] = dir;
        c->kv.l2_bytes = bytes;
        (*l2_flags)++;
        ferry__serve_conf_mark(c, "l2_bytes", "--l2");
        ferry__serve_conf_mark(c, c->n_l2 > 1 ? "l2_dirs" : "l2_dir", "--l2");
        ferry__serve_conf_mark(c, c->n_l2 > 1 ? "l2_dir" : "l2_dirs", "");
        return 0;
    }
    if (c->nallow == FERRY__SERVE_CONF_MAX_ALLOW && *uid_flags)
        return cli_bad(SERVE_CMD, a, v, "at most 64 of them", "one too many");
    int rc = cli_opt_count(SERVE_CMD, a, v, 0, UINT32_MAX - 1, &x);
    if (rc == 0) {
        if (!(*uid_flags)++)
            c->nallow = 0;
        c->allow[c->nallow++] = (uint32_t)x;
        ferry__serve_conf_mark(c, "allow_uids", "--allow-uid");
    }
    return rc;
}

/* one flag over c; *used: it took the next argument */
static int parse_one(ferry__serve_conf *c, const char *a, const char *v, int *used, int *l2_flags,
                     int *uid_flags)
{
    static const char *const models[] = {"llama3-8b", "qwen2.5-0.5b", "tiny", NULL};
    uint64_t x = 0;
    int k = 0, rc;
    *used = 1;
    if (!strcmp(a, "--config"))
        return 0; /* read before the other flags */
    if (!strcmp(a, "--l2") || !strcmp(a, "--allow-uid"))
        return parse_list(c, a, v, l2_flags, uid_flags);
    if (!strcmp(a, "--socket"))
        rc = cli_opt_string(SERVE_CMD, a, v, CLI_SOCKET_FORMS, &c->socket);
    else if (!strcmp(a, "--group"))
        rc = cli_opt_string(SERVE_CMD, a, v, "a group name", &c->group);
    else if (!strcmp(a, "--metrics")) {
        struct sockaddr_in sa;
        rc = cli_opt_string(SERVE_CMD, a, v, "HOST:PORT, an IPv4 address and a port",
                            &c->metrics);
        if (rc == 0 && ferry__parse_inet4(c->metrics, &sa) < 0)
            rc = cli_bad(SERVE_CMD, a, v, "HOST:PORT, an IPv4 address and a port 0..65535",
                         "not an address and port");
    } else if (!strcmp(a, "--remote"))
        rc = cli_opt_string(SERVE_CMD, a, v, REMOTE_FORMS, &c->kv.remote_url);
    else if (!strcmp(a, "--l1"))
        rc = cli_opt_size(SERVE_CMD, a, v, 4096, 16ull << 40, 0, &c->kv.l1_bytes);
    else if (!strcmp(a, "--max-clients"))
        rc = cli_opt_count(SERVE_CMD, a, v, 1, 65536, &c->max_clients);
    else if (!strcmp(a, "--chunk-tokens")) {
        rc = cli_opt_count(SERVE_CMD, a, v, 1, 65536, &x);
        c->kv.chunk_tokens = (uint32_t)x;
    } else if (!strcmp(a, "--model")) {
        rc = cli_opt_choice(SERVE_CMD, a, v, models, &k);
        if (rc == 0) {
            c->kv.model = models[k];
            c->layout_set = 0; /* a known model: its own shape */
        }
    } else {
        *used = 0;
        return cli_unknown(SERVE_CMD, a);
    }
    return rc;
}

/* the flag's key, for its origin */
static const char *key_of_flag(const char *a)
{
    static const char *const map[][2] = {
        {"--socket", "socket"}, {"--group", "group"}, {"--metrics", "metrics"},
        {"--remote", "remote_url"}, {"--l1", "l1_bytes"}, {"--max-clients", "max_clients"},
        {"--chunk-tokens", "chunk_tokens"}, {"--model", "model"}};
    for (size_t i = 0; i < sizeof map / sizeof map[0]; i++)
        if (!strcmp(a, map[i][0]))
            return map[i][1];
    return NULL;
}

/* --config FILE (at most once) and FERRY_* under the flags: 0, -1 after
 * --help, or the exit status of a usage error (printed) */
static int configure(ferry__serve_conf *c, const char *cmd, int argc, char **argv)
{
    const char *file = NULL;
    char err[1024];
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help"))
            return -1;
        if (strcmp(argv[i], "--config"))
            continue;
        if (file)
            return cli_bad(cmd, "--config", argv[i + 1], "one --config FILE", "given twice");
        int rc = cli_opt_string(cmd, "--config", i + 1 < argc ? argv[i + 1] : NULL,
                                "a YAML file", &file);
        if (rc)
            return rc;
        i++;
    }
    if (file && ferry__serve_conf_load(c, file, err, sizeof err) < 0)
        return cli_usage(cmd, "%s", err);
    if (ferry__serve_conf_env(c, err, sizeof err) < 0)
        return cli_usage(cmd, "%s", err);
    return 0;
}

/* c's socket (from a flag, the file, FERRY_SOCKET or the default) as a
 * path: "unix:PATH" becomes PATH; another scheme is refused. 0, or 2
 * (printed, naming where the value came from) */
static int socket_of(ferry__serve_conf *c, const char *cmd)
{
    const char *path = NULL, *why = cli_parse_socket(c->socket, &path);
    char longer[64];
    if (!why && strlen(path) >= sizeof ((struct sockaddr_un *)0)->sun_path) {
        snprintf(longer, sizeof longer, "a path of at most %zu bytes (sun_path)",
                 sizeof ((struct sockaddr_un *)0)->sun_path - 1);
        const char *o = ferry__serve_conf_origin(c, "socket");
        if (!strcmp(o, "--socket"))
            return cli_bad(cmd, "--socket", c->socket, longer, "too long (%zu bytes)",
                           strlen(path));
        return cli_usage(cmd, "%s: socket %s: too long (%zu bytes); accepted: %s",
                         *o ? o : "the default", c->socket, strlen(path), longer);
    }
    if (!why) {
        c->socket = path;
        return 0;
    }
    const char *o = ferry__serve_conf_origin(c, "socket");
    if (!strcmp(o, "--socket"))
        return cli_bad(cmd, "--socket", c->socket, CLI_SOCKET_FORMS, "%s", why);
    return cli_usage(cmd, "%s: socket %s: %s; accepted: %s", *o ? o : "the default", c->socket,
                     why, CLI_SOCKET_FORMS);
}

/* a value from a flag ("--group") or elsewhere (the file's place or the
 * variable, with its key): a usage error naming where it came from */
static int bad_value(ferry__serve_conf *c, const char *flag, const char *key, const char *val,
                     const char *accepted, const char *why)
{
    const char *o = ferry__serve_conf_origin(c, key);
    if (!strcmp(o, flag))
        return cli_bad(SERVE_CMD, flag, val, accepted, "%s", why);
    return cli_usage(SERVE_CMD, "%s: %s %s: %s; accepted: %s", *o ? o : "the default", key, val,
                     why, accepted);
}

/* the socket's group exists and the remote URL parses: a value the user
 * gave, refused before anything is opened (exit 2), as the flags' are */
static int group_and_remote_ok(ferry__serve_conf *c)
{
    if (c->group && !getgrnam(c->group))
        return bad_value(c, "--group", "group", c->group, "the name of an existing group",
                         "no such group");
    if (c->kv.remote_url && ferry_remote_url_validate(c->kv.remote_url) < 0) {
        /* the URL is not echoed: it may hold a password (the message quotes
         * what it must) */
        const char *o = ferry__serve_conf_origin(c, "remote_url");
        if (!strcmp(o, "--remote"))
            return cli_bad(SERVE_CMD, "--remote", NULL, REMOTE_FORMS, "%s", ferry_last_error());
        return cli_usage(SERVE_CMD, "%s: remote_url: %s; accepted: %s", *o ? o : "the default",
                         ferry_last_error(), REMOTE_FORMS);
    }
    return 0;
}

/* every flag over c, then what no single value shows: 0 or 2 (printed) */
static int parse_flags(ferry__serve_conf *c, int argc, char **argv)
{
    int l2_flags = 0, uid_flags = 0;
    for (int i = 1; i < argc; i++) {
        int used = 0;
        int rc = parse_one(c, argv[i], i + 1 < argc ? argv[i + 1] : NULL, &used, &l2_flags,
                           &uid_flags);
        if (rc)
            return rc;
        const char *key = key_of_flag(argv[i]);
        if (key)
            ferry__serve_conf_mark(c, key, argv[i]);
        i += used;
    }
    char err[1024];
    if (ferry__serve_conf_finish(c, err, sizeof err) < 0)
        return cli_usage(SERVE_CMD, "%s", err);
    if (ferry__serve_conf_daemon(c, err, sizeof err) < 0)
        return cli_usage(SERVE_CMD, "%s", err);
    int rc = socket_of(c, SERVE_CMD);
    if (rc)
        return rc;
    if ((rc = group_and_remote_ok(c)) != 0)
        return rc;
    for (unsigned i = 0; i < c->n_l2; i++) {
        const char *key = c->n_l2 > 1 ? "l2_dirs" : "l2_dir", *o = ferry__serve_conf_origin(c, key);
        struct stat st;
        if (stat(c->l2[i], &st) == 0 && S_ISDIR(st.st_mode))
            continue;
        const char *why = errno == ENOENT ? "no such directory" : "not a directory";
        if (!strcmp(o, "--l2"))
            return cli_bad(SERVE_CMD, o, c->l2[i], "an existing directory", "%s", why);
        return cli_usage(SERVE_CMD, "%s: %s %s: %s; accepted: an existing directory", o, key,
                         c->l2[i], why);
    }
    return 0;
}

/* one line on what was read besides the flags, so a restart with another
 * file or environment is never a surprise */
static void say_sources(const ferry__serve_conf *c)
{
    char vars[512] = "", file[160] = "";
    size_t off = 0;
    for (int i = 0; ferry__serve_conf_key_name(i); i++) {
        const char *o = ferry__serve_conf_origin(c, ferry__serve_conf_key_name(i));
        if (!strncmp(o, "FERRY_", 6) && off < sizeof vars)
            off += (size_t)snprintf(vars + off, sizeof vars - off, "%s%s", off ? ", " : "", o);
        else if (*o && *o != '-' && !*file) /* "FILE:LINE:COL" */
            snprintf(file, sizeof file, "%s", o);
    }
    for (int cut = 0; cut < 2 && strrchr(file, ':'); cut++)
        *strrchr(file, ':') = 0;
    if (*file || *vars)
        say("ferry serve: configuration from %s%s%s%s (flags override)\n",
            *file ? file : "", *file && *vars ? " and " : "", *vars ? "the environment: " : "",
            vars);
}

/* serve c until SIGTERM or SIGINT: the exit status */
static int run(ferry__serve_conf *c)
{
    /* FERRY_LOG set: the caller asked for the library's lines as they come
     * (a refused start then shows them too); else info, held until serving.
     * The callback is set before the daemon has a thread and never again. */
    if (!getenv("FERRY_LOG")) {
        ferry_log_set_level(FERRY_LOG_INFO);
        ferry_log_set_callback(on_log, NULL);
    }
    say_sources(c);
    ferry_serve_config sc = FERRY_SERVE_CONFIG_INIT;
    sc.socket_path = c->socket;
    sc.group = c->group;
    sc.allow_uids = c->allow;
    sc.n_allow_uids = c->nallow;
    sc.max_clients = (unsigned)c->max_clients;
    sc.send_timeout_ms = (uint32_t)c->send_timeout_ms;
    sc.kv = &c->kv;
    on_stop_signals();
    int rc = ferry_serve_open(&sc, &g_serve);
    if (rc < 0) {
        say_drop();
        return cli_fail(SERVE_CMD, "open", rc);
    }
    struct MHD_Daemon *http = NULL;
    if (c->metrics) {
        struct sockaddr_in sa;
        char why[256];
        ferry__parse_inet4(c->metrics, &sa);
        http = serve_metrics_start(g_serve, &sa, on_http_log, why, sizeof why);
        if (!http) {
            ferry_serve *open = g_serve;
            g_serve = NULL; /* (a signal now stops nothing that is freed) */
            ferry_serve_close(open);
            say_drop();
            fprintf(stderr, "ferry serve: metrics %s: cannot serve HTTP there (%s)\n",
                    c->metrics, why);
            return 1;
        }
        say("ferry serve: metrics on http://%s/metrics\n", c->metrics);
    }
    say_live();
    if (g_stop)
        ferry_serve_stop(g_serve);
    fprintf(stderr, "ferry serve: serving on %s (pid %d)\n", c->socket, (int)getpid());
    ferry_serve_run(g_serve);
    serve_metrics_stop(http);
    ferry_serve *open = g_serve;
    g_serve = NULL;
    rc = ferry_serve_close(open);
    if (rc < 0)
        return cli_fail(SERVE_CMD, "close", rc);
    fprintf(stderr, "ferry serve: stopped cleanly\n");
    return 0;
}

int cmd_serve(int argc, char **argv)
{
    ferry__serve_conf c;
    ferry__serve_conf_init(&c);
    int rc = configure(&c, SERVE_CMD, argc, argv);
    if (rc < 0)
        usage(stdout);
    if (rc == 0)
        rc = parse_flags(&c, argc, argv);
    if (rc == 0)
        rc = run(&c);
    ferry__serve_conf_free(&c);
    return rc < 0 ? 0 : rc;
}

/* ---- status: a raw client (HELLO any geometry, no pool; STATS) ---- */

static int xfer(int fd, ferry__proto_buf *b, uint8_t *in, size_t cap, ferry__proto_rd *rd)
{
    /* (a send that fails still reads: a daemon that refused the
     * connection at accept, a uid it does not allow, said why and closed) */
    int sent = send(fd, b->p, b->len, MSG_NOSIGNAL) == (ssize_t)b->len;
    uint8_t hb[FERRY__PROTO_HDR];
    size_t got = 0;
    ferry__proto_hdr h;
    char why[128];
    while (got < sizeof hb) {
        struct pollfd p = {fd, POLLIN, 0};
        if (poll(&p, 1, sent ? 2000 : 0) <= 0)
            return sent ? -ETIMEDOUT : -EIO;
        ssize_t r = recv(fd, hb + got, sizeof hb - got, 0);
        if (r <= 0)
            return sent ? -ECONNRESET : -EIO;
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

/* the remote tier, once it has done anything (its counters are all 0
 * without one; its capacity is the server's, not known here) */
static void print_remote(const ferry_kv_stats *m)
{
    const ferry_kv_tier_stats *ts = &m->tier[FERRY_KV_TIER_REMOTE];
    if (!ts->chunks && !m->remote_lookups && !m->remote_puts && !m->remote_gets &&
        !m->remote_errors && !m->remote_down)
        return;
    printf("  %-6s %llu chunks known, %llu hits, %llu puts (%llu written, %llu dropped), "
           "%llu fetches (%llu misses), %llu refused, %llu errors%s\n", "remote",
           (unsigned long long)ts->chunks, (unsigned long long)ts->hits,
           (unsigned long long)m->remote_puts, (unsigned long long)m->remote_written,
           (unsigned long long)m->remote_dropped, (unsigned long long)m->remote_gets,
           (unsigned long long)m->remote_misses, (unsigned long long)m->remote_refused,
           (unsigned long long)m->remote_errors, m->remote_down ? ", down now" : "");
}

/* the daemon's own counters (ferry_serve_stats), after the store's in a
 * STATS reply; nothing from a daemon that sends none */
static void print_daemon(ferry__proto_rd *rd)
{
    uint32_t size = ferry__proto_get_u32(rd);
    if (rd->err || size < sizeof(uint64_t) || size > (size_t)(rd->end - rd->p))
        return;
    ferry_serve_stats ss;
    memset(&ss, 0, sizeof ss);
    memcpy(&ss, rd->p, size < sizeof ss ? size : sizeof ss);
    printf("  daemon %llu connections (%llu refused), %llu requests, %llu bad frames, "
           "%llu slow clients, %llu released, %llu read-ahead dropped\n",
           (unsigned long long)ss.connections, (unsigned long long)ss.refused,
           (unsigned long long)ss.requests, (unsigned long long)ss.bad_frames,
           (unsigned long long)ss.slow_clients, (unsigned long long)ss.released,
           (unsigned long long)ss.ahead_dropped);
}

static void print_status(ferry__proto_rd *rd, const char *path)
{
    uint32_t clients = ferry__proto_get_u32(rd), size = ferry__proto_get_u32(rd);
    ferry_kv_stats m;
    memset(&m, 0, sizeof m);
    int whole = !rd->err && size <= (size_t)(rd->end - rd->p);
    if (whole) {
        memcpy(&m, rd->p, size < sizeof m ? size : sizeof m);
        rd->p += size;
    }
    static const char *const names[FERRY_KV_TIERS] = {"-", "L1", "L2", "remote"};
    /* (the daemon counts every connection: this status query's among them) */
    clients -= clients > 0;
    printf("ferry serve on %s: %u client%s besides this status, %llu chunks indexed\n", path,
           clients, clients == 1 ? "" : "s", (unsigned long long)m.chunks);
    for (int t = 1; t < FERRY_KV_TIERS; t++) {
        const ferry_kv_tier_stats *ts = &m.tier[t];
        if (t == FERRY_KV_TIER_REMOTE) {
            print_remote(&m);
            continue;
        }
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
    if (whole && rd->p < rd->end)
        print_daemon(rd);
}

/* the daemon's socket for `serve status`: --socket, else the FILE's or
 * FERRY_SOCKET's socket, else the default; 0, -1 after --help, or 2 */
static int status_socket(int argc, char **argv, char *path, size_t len)
{
    ferry__serve_conf c;
    ferry__serve_conf_init(&c);
    int rc = configure(&c, STATUS_CMD, argc, argv);
    for (int i = 1; rc == 0 && i < argc; i++) {
        if (!strcmp(argv[i], "--config")) {
            i++;
            continue;
        }
        if (strcmp(argv[i], "--socket")) {
            rc = cli_unknown(STATUS_CMD, argv[i]);
            break;
        }
        rc = cli_opt_string(STATUS_CMD, argv[i], i + 1 < argc ? argv[i + 1] : NULL,
                            CLI_SOCKET_FORMS, &c.socket);
        ferry__serve_conf_mark(&c, "socket", "--socket");
        i++;
    }
    if (rc == 0)
        rc = socket_of(&c, STATUS_CMD);
    if (rc == 0 && strlen(c.socket) >= len)
        rc = cli_bad(STATUS_CMD, "--socket", c.socket, "a shorter path", "too long");
    if (rc == 0)
        snprintf(path, len, "%s", c.socket);
    ferry__serve_conf_free(&c);
    return rc;
}

int cmd_serve_status(int argc, char **argv)
{
    char path[sizeof ((struct sockaddr_un *)0)->sun_path];
    int rc = status_socket(argc, argv, path, sizeof path);
    if (rc < 0)
        printf("usage: ferry serve status [--config FILE] [--socket PATH|unix:PATH]\n"
               "  the daemon's socket: --socket, else the file's or FERRY_SOCKET's socket,\n"
               "  else " SOCKET_DEFAULT "\n");
    if (rc)
        return rc < 0 ? 0 : rc;
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
    char msg[FERRY__PROTO_MAX_MSG + 1] = "";
    rc = ferry__proto_req_encode(&b, &q);
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
