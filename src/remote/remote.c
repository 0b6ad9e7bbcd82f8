/*
 * remote.c - the remote tier handle: a pool of sessions, the health state
 * with exponential backoff, the write-behind queue and its writer thread.
 *
 * Invariants and why:
 *  - The engine never waits on a dead remote. While the handle is "down"
 *    every call answers at once without I/O (a miss, 0, or -EAGAIN); only
 *    one caller at a time probes after the backoff period, so a hung server
 *    costs at most one thread one timeout per period. A call is bounded by
 *    the connect timeout and one deadline for all its I/O (command
 *    timeout plus 16 ns per byte it moves, retry included: run_work), and
 *    what the server sends by the bounds each command gives its reply.
 *  - put() never blocks: the value is encoded into one allocation and
 *    queued; when the queue's item or byte bound would be passed, the put
 *    is dropped and counted. The bound covers items being written too, so
 *    memory held by the queue never exceeds queue_max_bytes.
 *  - Nothing is returned as data unless the value header checks out
 *    (remote_value.c): a miss is always preferable to wrong KV bytes.
 *  - A session (one topology instance) is used by one thread at a time:
 *    synchronous calls take one from the pool, the writer has its own.
 *    Shared state (health, queue, pool, last error) is under mutexes;
 *    counters are relaxed atomics.
 *  - The topology (single server or cluster) is decided on the first
 *    successful connection, so a handle opened FERRY_REMOTE_LAZY against an
 *    unreachable cluster still takes the cluster path once it answers.
 */
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include <hiredis/hiredis.h>

#include "remote_int.h"
#include "sized.h"

#define BATCH_MAX 32
#define BATCH_BYTES (64u << 20)

typedef struct rsession {
    void *st;
    int ever_connected;
} rsession;

typedef struct qitem {
    struct qitem *next;
    size_t klen, vlen;
    uint8_t *key, *val; /* both inside this allocation */
} qitem;

typedef atomic_uint_fast64_t counter;

struct ferry_remote {
    ferry__rurl url;
    ferry__rconf cf;
    uint32_t backoff_initial_ms, backoff_max_ms, ttl_s, flags;
    uint64_t queue_max_items, queue_max_bytes;
    char *prefix;
    size_t prefix_len;
    uint8_t *layout;
    size_t layout_len, header_len;

    /* topology, decided once */
    pthread_mutex_t topo_mu;
    const ferry__rtopo_ops *_Atomic ops;

    /* session pool */
    pthread_mutex_t pool_mu;
    pthread_cond_t pool_cv;
    rsession *sessions; /* [0, nsessions): pool; [nsessions]: the writer's */
    size_t nsessions;
    rsession **free_list;
    size_t nfree;

    /* health */
    pthread_mutex_t health_mu;
    int down, probing;
    uint64_t down_until_ns, backoff_ns, jitter;
    int down_code;
    char down_reason[FERRY__ERRMSG_MAX];

    /* write-behind queue */
    pthread_mutex_t q_mu;
    pthread_cond_t q_cv, q_done_cv;
    qitem *qhead, *qtail;
    uint64_t q_items, q_bytes, q_enqueued, q_finished;
    int stop;
    pthread_t worker;
    int worker_started;
    ferry__warnlim refused_warn;            /* refused writes' warnings */

    counter puts, puts_written, gets, hits, misses, errors, dropped, reconnects, degraded,
        corrupt, mismatched, redirects, bytes_written, bytes_read, exists_calls, deletes;

    ferry__errbuf err;
};

#define INC(c) atomic_fetch_add_explicit(&(c), 1, memory_order_relaxed)
#define ADD(c, v) atomic_fetch_add_explicit(&(c), (uint64_t)(v), memory_order_relaxed)
#define LOAD(c) atomic_load_explicit(&(c), memory_order_relaxed)

/* ---- errors ---- */

/* copy a message recorded in a local errbuf into the handle's */
static int publish(ferry_remote *r, const ferry__errbuf *local, int code)
{
    return ferry__err_copy(&r->err, local, code);
}

static int rfail(ferry_remote *r, int code, const char *fmt, ...) FERRY__PRINTF(3, 4);
static int rfail(ferry_remote *r, int code, const char *fmt, ...)
{
    ferry__errbuf local;
    va_list ap;
    va_start(ap, fmt);
    ferry__err_vset(&local, code, fmt, ap);
    va_end(ap);
    return publish(r, &local, code);
}

/* printable preview of a key for messages */
static const char *key_str(const void *key, size_t len, char *buf, size_t cap)
{
    const unsigned char *k = key;
    size_t o = 0;
    for (size_t i = 0; i < len && o + 6 < cap; i++) {
        if (k[i] >= 0x20 && k[i] < 0x7f && k[i] != '\\')
            buf[o++] = (char)k[i];
        else
            o += (size_t)snprintf(buf + o, cap - o, "\\x%02x", k[i]);
        if (i + 1 < len && o + 6 >= cap) {
            memcpy(buf + o, "...", 3);
            o += 3;
            break;
        }
    }
    buf[o] = 0;
    return buf;
}

static int is_transport(int code)
{
    return code < 0 && code > -4096 && code != -ENOMEM && code != -EINVAL;
}

/* ---- health ---- */
enum { H_OK, H_PROBE, H_DOWN };

static int health_enter(ferry_remote *r, char *why, size_t len)
{
    pthread_mutex_lock(&r->health_mu);
    if (!r->down) {
        pthread_mutex_unlock(&r->health_mu);
        return H_OK;
    }
    uint64_t now = ferry__now_ns();
    if (now >= r->down_until_ns && !r->probing) {
        r->probing = 1;
        pthread_mutex_unlock(&r->health_mu);
        return H_PROBE;
    }
    uint64_t left = now < r->down_until_ns ? r->down_until_ns - now : 0;
    snprintf(why, len, "down for %llu ms more (probe in progress: %s) after: %.400s",
             (unsigned long long)(left / 1000000), r->probing ? "yes" : "no", r->down_reason);
    pthread_mutex_unlock(&r->health_mu);
    return H_DOWN;
}

static void health_fail(ferry_remote *r, int code, const char *msg, int probe)
{
    pthread_mutex_lock(&r->health_mu);
    if (probe)
        r->probing = 0;
    int was_down = r->down;
    if (!r->down || probe) {
        /* up to +25% jitter, so that many clients of one server that went
         * down together do not all probe it at the same instant */
        r->jitter ^= r->jitter << 13;
        r->jitter ^= r->jitter >> 7;
        r->jitter ^= r->jitter << 17;
        uint64_t period = r->backoff_ns + (r->jitter % (r->backoff_ns / 4 + 1));
        r->down = 1;
        r->down_until_ns = ferry__now_ns() + period;
        uint64_t next = r->backoff_ns * 2, cap = (uint64_t)r->backoff_max_ms * 1000000ull;
        r->backoff_ns = next > cap ? cap : next;
    }
    r->down_code = code;
    snprintf(r->down_reason, sizeof r->down_reason, "%s", msg);
    uint64_t until = r->down_until_ns;
    pthread_mutex_unlock(&r->health_mu);
    if (!was_down)
        FERRY_LOGW("remote %s is down (%s); calls answer as misses, retry in %llu ms",
                   r->url.redacted, msg,
                   (unsigned long long)((until - FERRY__MIN(until, ferry__now_ns())) / 1000000));
}

static void health_ok(ferry_remote *r, int probe)
{
    pthread_mutex_lock(&r->health_mu);
    if (probe)
        r->probing = 0;
    int was_down = r->down;
    if (r->down) {
        r->down = 0;
        r->backoff_ns = (uint64_t)r->backoff_initial_ms * 1000000ull;
    }
    pthread_mutex_unlock(&r->health_mu);
    if (was_down)
        FERRY_LOGI("remote %s is back", r->url.redacted);
}

/* ---- topology and sessions ---- */

static int topo_resolve(ferry_remote *r, ferry__errbuf *eb)
{
    if (atomic_load(&r->ops))
        return 0;
    pthread_mutex_lock(&r->topo_mu);
    int rc = 0;
    if (atomic_load(&r->ops))
        goto out;
    if (r->url.is_unix || r->url.cluster == FERRY__RCLUSTER_NO) {
        atomic_store(&r->ops, &ferry__rtopo_single);
        goto out;
    }
    ferry__rconn probe = {0};
    rc = ferry__rconn_open(&probe, &r->cf, r->url.host, r->url.port, 0, eb);
    if (rc)
        goto out;
    rc = ferry__rcluster_probe(&probe, eb);
    ferry__rconn_close(&probe);
    if (rc < 0)
        goto out;
    if (rc == 1 && r->url.db != 0) {
        rc = ferry__err_set(eb, -EINVAL,
                            "remote %s: the server is a Redis Cluster node, which has only "
                            "database 0, but the URL asks for database %d",
                            r->url.redacted, r->url.db);
        goto out;
    }
    if (rc == 0 && r->url.cluster == FERRY__RCLUSTER_YES) {
        rc = ferry__err_set(eb, FERRY_EREMOTE,
                            "remote %s: cluster=yes but the server has cluster support disabled",
                            r->url.redacted);
        goto out;
    }
    atomic_store(&r->ops, rc == 1 ? &ferry__rtopo_cluster : &ferry__rtopo_single);
    rc = 0;
out:
    pthread_mutex_unlock(&r->topo_mu);
    return rc;
}

static rsession *pool_take(ferry_remote *r)
{
    pthread_mutex_lock(&r->pool_mu);
    while (r->nfree == 0)
        pthread_cond_wait(&r->pool_cv, &r->pool_mu);
    FERRY__ASSERT(r->nfree <= r->nsessions);
    rsession *s = r->free_list[--r->nfree];
    pthread_mutex_unlock(&r->pool_mu);
    return s;
}

static void pool_put(ferry_remote *r, rsession *s)
{
    pthread_mutex_lock(&r->pool_mu);
    /* a pool session (never the writer's), taken and now given back once */
    FERRY__ASSERT(s >= r->sessions && s < r->sessions + r->nsessions);
    FERRY__ASSERT(r->nfree < r->nsessions);
    r->free_list[r->nfree++] = s;
    pthread_cond_signal(&r->pool_cv);
    pthread_mutex_unlock(&r->pool_mu);
}

/* make sure s is connected; 0 or a code */
static int session_ready(ferry_remote *r, rsession *s, ferry__errbuf *eb)
{
    const ferry__rtopo_ops *ops = atomic_load(&r->ops);
    if (!s->st) {
        int rc = ops->create(&r->cf, &s->st, eb);
        if (rc)
            return rc;
    }
    if (ops->connected(s->st))
        return 0;
    int rc = ops->connect(s->st, eb);
    if (rc)
        return rc;
    if (s->ever_connected)
        INC(r->reconnects);
    s->ever_connected = 1;
    return 0;
}

enum { RUN_OK = 0, RUN_DOWN = 1 };

/* what a call asks of a session */
typedef struct work {
    ferry__rcmd *cmds;
    size_t n;
    ferry__rget *get; /* non-NULL: a GET into the caller's memory */
} work;

static int do_work(const ferry__rtopo_ops *ops, void *st, work *w, uint64_t deadline,
                   uint64_t *redirects, ferry__errbuf *eb)
{
    if (w->get)
        return ops->get_into(st, w->get, deadline, eb);
    return ops->exec(st, w->cmds, w->n, deadline, redirects, eb);
}

/* the bytes a call moves, for its deadline: what it sends and the value
 * a GET may bring back */
static uint64_t work_bytes(const ferry_remote *r, const work *w)
{
    uint64_t b = 0;
    for (size_t i = 0; i < w->n; i++)
        for (int a = 0; a < w->cmds[i].argc; a++)
            b += w->cmds[i].argvlen[a];
    if (w->get)
        b += FERRY__MIN(w->get->cap, FERRY_REMOTE_VALUE_MAX) + r->header_len;
    return b;
}

/*
 * Run w on a session (the writer's when ws is non-NULL, else one from the
 * pool) under the health rules. RUN_OK: every command has its reply (or
 * the GET's outcome is in w->get). RUN_DOWN: the remote is down, or went
 * down during this call; eb says why; no replies are held. Negative: a
 * failure that is not the remote's health (out of memory, a cluster that
 * redirects forever).
 */
static int run_work(ferry_remote *r, rsession *ws, work *w, ferry__errbuf *eb)
{
    char why[FERRY__ERRMSG_MAX];
    int h = health_enter(r, why, sizeof why);
    if (h == H_DOWN) {
        INC(r->degraded);
        ferry__err_set(eb, -EAGAIN, "remote %s: %s", r->url.redacted, why);
        return RUN_DOWN;
    }
    int rc = topo_resolve(r, eb);
    if (rc) {
        INC(r->errors);
        health_fail(r, rc, eb->msg, h == H_PROBE);
        return RUN_DOWN;
    }
    const ferry__rtopo_ops *ops = atomic_load(&r->ops);
    rsession *s = ws ? ws : pool_take(r);
    uint64_t redirects = 0;
    int was_connected = s->st && ops->connected(s->st);
    rc = session_ready(r, s, eb);
    if (rc == 0) {
        /* one deadline for the whole call, the retry included: a server
         * that drips its answer costs about command_timeout_ms */
        uint64_t deadline = ferry__rdeadline(r->cf.command_timeout_ms, work_bytes(r, w));
        rc = do_work(ops, s->st, w, deadline, &redirects, eb);
        if (rc && was_connected && ferry__rconn_stale_code(rc)) {
            /* found dead by EOF/reset: most likely a restarted server */
            ops->reset(s->st);
            rc = session_ready(r, s, eb);
            if (rc == 0)
                rc = do_work(ops, s->st, w, deadline, &redirects, eb);
        }
    }
    if (redirects)
        ADD(r->redirects, redirects);
    if (rc && (is_transport(rc) || (rc == FERRY_EREMOTE && !ops->connected(s->st)))) {
        /* could not connect, or lost the connection: the remote is down */
        ops->reset(s->st);
        if (!ws)
            pool_put(r, s);
        INC(r->errors);
        health_fail(r, rc, eb->msg, h == H_PROBE);
        return RUN_DOWN;
    }
    if (!ws)
        pool_put(r, s);
    if (rc) {
        INC(r->errors);
        if (h == H_PROBE)
            health_ok(r, 1);
        return rc;
    }
    health_ok(r, h == H_PROBE);
    return RUN_OK;
}

static int run(ferry_remote *r, rsession *ws, ferry__rcmd *cmds, size_t n, ferry__errbuf *eb)
{
    work w = {cmds, n, NULL};
    return run_work(r, ws, &w, eb);
}

/* ---- keys and values ---- */

static int check_key(ferry_remote *r, const void *key, size_t klen, const char *what)
{
    if (!key || klen == 0)
        return rfail(r, -EINVAL, "remote %s: %s: empty or NULL key", r->url.redacted, what);
    if (klen + r->prefix_len > FERRY_REMOTE_KEY_MAX)
        return rfail(r, -EINVAL, "remote %s: %s: key of %zu bytes (+%zu prefix) exceeds %u",
                     r->url.redacted, what, klen, r->prefix_len, FERRY_REMOTE_KEY_MAX);
    return 0;
}

/* prefix + key into dst (FERRY_REMOTE_KEY_MAX bytes) */
static size_t full_key(const ferry_remote *r, const void *key, size_t klen, uint8_t *dst)
{
    memcpy(dst, r->prefix, r->prefix_len);
    memcpy(dst + r->prefix_len, key, klen);
    return r->prefix_len + klen;
}

static void cmd_set(ferry_remote *r, ferry__rcmd *c, const void *k, size_t kl, const void *v,
                    size_t vl, char *ttl)
{
    memset(c, 0, sizeof *c);
    c->argv[0] = "SET";
    c->argvlen[0] = 3;
    c->argv[1] = k;
    c->argvlen[1] = kl;
    c->argv[2] = v;
    c->argvlen[2] = vl;
    c->argc = 3;
    c->key_arg = 1;
    if (r->ttl_s) {
        c->argv[3] = "EX";
        c->argvlen[3] = 2;
        c->argv[4] = ttl;
        c->argvlen[4] = strlen(ttl);
        c->argc = 5;
    }
}

static int check_data(ferry_remote *r, const void *key, size_t key_len, const void *data,
                      size_t len, const char *what)
{
    char ks[80];
    if (!data && len)
        return rfail(r, -EINVAL, "remote %s: %s %s: NULL data of %zu bytes", r->url.redacted,
                     what, key_str(key, key_len, ks, sizeof ks), len);
    if (len > FERRY_REMOTE_VALUE_MAX - r->header_len)
        return rfail(r, -EINVAL,
                     "remote %s: %s %s: %zu bytes and the %zu-byte header make a value of %zu "
                     "bytes, over Redis's 512 MiB string limit (FERRY_REMOTE_VALUE_MAX, %zu "
                     "bytes): at most %zu bytes a value",
                     r->url.redacted, what, key_str(key, key_len, ks, sizeof ks), len,
                     r->header_len, len + r->header_len, FERRY_REMOTE_VALUE_MAX,
                     FERRY_REMOTE_VALUE_MAX - r->header_len);
    return 0;
}

/* ---- the writer ---- */

static void *writer_main(void *arg)
{
    ferry_remote *r = arg;
    rsession *ws = &r->sessions[r->nsessions];
    ferry__rcmd cmds[BATCH_MAX];
    qitem *batch[BATCH_MAX];
    char ttl[16];
    snprintf(ttl, sizeof ttl, "%u", r->ttl_s);
    for (;;) {
        pthread_mutex_lock(&r->q_mu);
        while (!r->qhead && !r->stop)
            pthread_cond_wait(&r->q_cv, &r->q_mu);
        if (!r->qhead) {
            pthread_mutex_unlock(&r->q_mu);
            break;
        }
        size_t n = 0, bytes = 0;
        while (r->qhead && n < BATCH_MAX && (n == 0 || bytes + r->qhead->vlen <= BATCH_BYTES)) {
            qitem *it = r->qhead;
            r->qhead = it->next;
            if (!r->qhead)
                r->qtail = NULL;
            bytes += it->vlen;
            batch[n++] = it;
        }
        pthread_mutex_unlock(&r->q_mu);

        for (size_t i = 0; i < n; i++)
            cmd_set(r, &cmds[i], batch[i]->key, batch[i]->klen, batch[i]->val, batch[i]->vlen,
                    ttl);
        ferry__errbuf eb;
        int rc = run(r, ws, cmds, n, &eb);
        if (rc == RUN_OK) {
            for (size_t i = 0; i < n; i++) {
                if (cmds[i].reply->type == REDIS_REPLY_ERROR) {
                    INC(r->errors);
                    INC(r->dropped);
                    char ks[80];
                    rfail(r, FERRY_EREMOTE, "remote %s: SET %s (%zu bytes): %s",
                          r->url.redacted, key_str(batch[i]->key, batch[i]->klen, ks, sizeof ks),
                          batch[i]->vlen, cmds[i].reply->str);
                    /* a server refusing every write (OOM, READONLY, NOAUTH
                     * after a restart) must be seen, once in a while */
                    uint64_t quiet = 0;
                    if (ferry__warn_ok(&r->refused_warn, &quiet))
                        FERRY_LOGW("%s (the write is dropped; %llu more refused since the "
                                   "last warning)",
                                   ferry_remote_last_error(r), (unsigned long long)quiet);
                } else if (!ferry__rreply_is_ok(cmds[i].reply)) {
                    INC(r->errors);
                    INC(r->dropped);
                    char ks[80], d[64];
                    rfail(r, -EPROTO, "remote %s: SET %s (%zu bytes): answered %s, not +OK",
                          r->url.redacted, key_str(batch[i]->key, batch[i]->klen, ks, sizeof ks),
                          batch[i]->vlen, ferry__rreply_desc(cmds[i].reply, d, sizeof d));
                } else {
                    INC(r->puts_written);
                    ADD(r->bytes_written, batch[i]->vlen);
                }
            }
            ferry__rcmd_release(cmds, n);
        } else {
            ADD(r->dropped, n);
            if (rc < 0)
                publish(r, &eb, rc);
        }
        uint64_t freed = 0;
        for (size_t i = 0; i < n; i++) {
            freed += batch[i]->vlen + batch[i]->klen;
            ferry__free(batch[i]);
        }
        pthread_mutex_lock(&r->q_mu);
        /* the bound covers items being written: they are still counted */
        FERRY__ASSERT(r->q_items >= n && r->q_bytes >= freed);
        FERRY__ASSERT(r->q_finished + n <= r->q_enqueued);
        r->q_items -= n;
        r->q_bytes -= freed;
        r->q_finished += n;
        pthread_cond_broadcast(&r->q_done_cv);
        pthread_mutex_unlock(&r->q_mu);
    }
    return NULL;
}

/* ---- open / close ---- */

/* every option within its documented range before any arithmetic on it
 * (ferry/remote.h says the ranges); 0 values mean the defaults */
static int check_options(const ferry_remote_options *o, const ferry__rurl *u)
{
    static const struct {
        const char *name;
        size_t off;
        uint32_t max;
    } ranges[] = {
        {"connect_timeout_ms", offsetof(ferry_remote_options, connect_timeout_ms),
         FERRY_REMOTE_TIMEOUT_MAX_MS},
        {"command_timeout_ms", offsetof(ferry_remote_options, command_timeout_ms),
         FERRY_REMOTE_TIMEOUT_MAX_MS},
        {"backoff_initial_ms", offsetof(ferry_remote_options, backoff_initial_ms),
         FERRY_REMOTE_BACKOFF_MAX_MS},
        {"backoff_max_ms", offsetof(ferry_remote_options, backoff_max_ms),
         FERRY_REMOTE_BACKOFF_MAX_MS},
        {"queue_max_items", offsetof(ferry_remote_options, queue_max_items),
         FERRY_REMOTE_QUEUE_ITEMS_MAX},
        {"connections", offsetof(ferry_remote_options, connections),
         FERRY_REMOTE_CONNECTIONS_MAX},
        {"ttl_s", offsetof(ferry_remote_options, ttl_s), FERRY_REMOTE_TTL_MAX_S},
    };
    for (size_t i = 0; i < sizeof ranges / sizeof ranges[0]; i++) {
        uint32_t v;
        memcpy(&v, (const char *)o + ranges[i].off, sizeof v);
        if (v > ranges[i].max)
            return ferry__err_set(NULL, -EINVAL,
                                  "remote %s: options.%s = %u is out of range (0 for the "
                                  "default, or 1..%u)",
                                  u->redacted, ranges[i].name, v, ranges[i].max);
    }
    if (o->queue_max_bytes > FERRY_REMOTE_QUEUE_BYTES_MAX)
        return ferry__err_set(NULL, -EINVAL,
                              "remote %s: options.queue_max_bytes = %llu is out of range (0 for "
                              "the default, or 1..%llu)",
                              u->redacted, (unsigned long long)o->queue_max_bytes,
                              (unsigned long long)FERRY_REMOTE_QUEUE_BYTES_MAX);
    if (o->backoff_max_ms && o->backoff_max_ms < o->backoff_initial_ms)
        return ferry__err_set(NULL, -EINVAL,
                              "remote %s: options.backoff_max_ms = %u is below "
                              "backoff_initial_ms = %u",
                              u->redacted, o->backoff_max_ms, o->backoff_initial_ms);
    if (o->layout_len > FERRY_REMOTE_LAYOUT_MAX || (!o->layout && o->layout_len))
        return ferry__err_set(NULL, -EINVAL,
                              "remote %s: options.layout_len = %zu is out of range (0..%u, with "
                              "a non-NULL layout)",
                              u->redacted, o->layout_len, FERRY_REMOTE_LAYOUT_MAX);
    size_t plen = o->key_prefix ? strnlen(o->key_prefix, FERRY_REMOTE_KEY_MAX) : 0;
    if (plen >= FERRY_REMOTE_KEY_MAX / 2)
        return ferry__err_set(NULL, -EINVAL,
                              "remote %s: options.key_prefix of %zu%s bytes is out of range "
                              "(0..%u)",
                              u->redacted, plen, plen == FERRY_REMOTE_KEY_MAX ? "+" : "",
                              FERRY_REMOTE_KEY_MAX / 2 - 1);
    if (o->flags & ~(uint32_t)FERRY_REMOTE_LAZY)
        return ferry__err_set(NULL, -EINVAL,
                              "remote %s: options.flags 0x%x has unknown bits (known: "
                              "FERRY_REMOTE_LAZY 0x%x)",
                              u->redacted, o->flags, (unsigned)FERRY_REMOTE_LAZY);
    return 0;
}

static void destroy(ferry_remote *r)
{
    const ferry__rtopo_ops *ops = atomic_load(&r->ops);
    if (r->sessions)
        for (size_t i = 0; i <= r->nsessions; i++)
            if (r->sessions[i].st && ops)
                ops->destroy(r->sessions[i].st);
    qitem *it = r->qhead;
    while (it) {
        qitem *nx = it->next;
        ferry__free(it);
        it = nx;
    }
    ferry__free(r->sessions);
    ferry__free(r->free_list);
    ferry__free(r->prefix);
    ferry__free(r->layout);
    pthread_mutex_destroy(&r->topo_mu);
    pthread_mutex_destroy(&r->pool_mu);
    pthread_cond_destroy(&r->pool_cv);
    pthread_mutex_destroy(&r->health_mu);
    pthread_mutex_destroy(&r->q_mu);
    pthread_cond_destroy(&r->q_cv);
    pthread_cond_destroy(&r->q_done_cv);
    ferry__free(r);
}

int ferry_remote_open(const char *url, const ferry_remote_options *opt, ferry_remote **out)
{
    ferry_remote_options o = FERRY_REMOTE_OPTIONS_INIT;
    if (!out)
        return ferry__err_set(NULL, -EINVAL, "ferry_remote_open: out is NULL");
    static const ferry__sized sized =
        FERRY__SIZED0(ferry_remote_options, FERRY_REMOTE_OPTIONS_MIN_SIZE);
    if (opt) {
        int rc = ferry__opts_take(NULL, "ferry_remote_open", &sized, &o, opt);
        if (rc < 0)
            return rc;
    }
    ferry__rurl u;
    int rc = ferry__rurl_parse(url, url ? strlen(url) : 0, &u, NULL);
    if (rc)
        return rc;
    rc = check_options(&o, &u);
    if (rc)
        return rc;
    size_t plen = o.key_prefix ? strlen(o.key_prefix) : 0;

    ferry_remote *r = ferry__calloc(1, sizeof *r);
    if (!r)
        return ferry__err_set(NULL, -ENOMEM, "remote %s: out of memory", u.redacted);
    r->url = u;
    r->cf.url = &r->url;
    r->cf.connect_timeout_ms = o.connect_timeout_ms ? o.connect_timeout_ms : 500;
    r->cf.command_timeout_ms = o.command_timeout_ms ? o.command_timeout_ms : 1000;
    r->backoff_initial_ms = o.backoff_initial_ms ? o.backoff_initial_ms : 50;
    r->backoff_max_ms = o.backoff_max_ms ? o.backoff_max_ms : 5000;
    if (r->backoff_max_ms < r->backoff_initial_ms) /* an initial above the default cap */
        r->backoff_max_ms = r->backoff_initial_ms;
    r->backoff_ns = (uint64_t)r->backoff_initial_ms * 1000000ull;
    r->jitter = (ferry__now_ns() ^ (uint64_t)(uintptr_t)r) | 1;
    r->queue_max_items = o.queue_max_items ? o.queue_max_items : 1024;
    r->queue_max_bytes = o.queue_max_bytes ? o.queue_max_bytes : (256ull << 20);
    r->ttl_s = o.ttl_s;
    r->flags = o.flags;
    r->nsessions = o.connections ? o.connections : 4;
    r->layout_len = o.layout_len;
    r->header_len = ferry__rvalue_header_size(o.layout_len);
    pthread_mutex_init(&r->topo_mu, NULL);
    pthread_mutex_init(&r->pool_mu, NULL);
    pthread_cond_init(&r->pool_cv, NULL);
    pthread_mutex_init(&r->health_mu, NULL);
    pthread_mutex_init(&r->q_mu, NULL);
    pthread_cond_init(&r->q_cv, NULL);
    ferry__cond_init_mono(&r->q_done_cv); /* (ferry_remote_flush's deadline) */
    r->prefix = ferry__malloc(plen + 1);
    r->layout = ferry__malloc(o.layout_len + 1);
    r->sessions = ferry__calloc(r->nsessions + 1, sizeof *r->sessions);
    r->free_list = ferry__calloc(r->nsessions, sizeof *r->free_list);
    if (!r->prefix || !r->layout || !r->sessions || !r->free_list) {
        destroy(r);
        return ferry__err_set(NULL, -ENOMEM, "remote %s: out of memory", u.redacted);
    }
    memcpy(r->prefix, o.key_prefix ? o.key_prefix : "", plen + 1);
    r->prefix_len = plen;
    if (o.layout_len)
        memcpy(r->layout, o.layout, o.layout_len);
    for (size_t i = 0; i < r->nsessions; i++)
        r->free_list[r->nfree++] = &r->sessions[r->nsessions - 1 - i];

    /* first contact: topology, credentials, database */
    ferry__errbuf eb;
    rc = topo_resolve(r, &eb);
    if (rc == 0) {
        rsession *s = pool_take(r);
        rc = session_ready(r, s, &eb);
        pool_put(r, s);
    }
    if (rc) {
        if (!(r->flags & FERRY_REMOTE_LAZY) || rc == FERRY_EREMOTE || rc == -EINVAL ||
            rc == -ENOMEM) {
            destroy(r);
            return ferry__err_pass(NULL, rc);
        }
        health_fail(r, rc, eb.msg, 0);
        INC(r->errors);
    }
    if (pthread_create(&r->worker, NULL, writer_main, r) != 0) {
        destroy(r);
        return ferry__err_set(NULL, -EAGAIN, "remote %s: cannot start the writer thread",
                              u.redacted);
    }
    r->worker_started = 1;
    *out = r;
    return 0;
}

void ferry_remote_close(ferry_remote *r)
{
    if (!r)
        return;
    if (r->worker_started) {
        pthread_mutex_lock(&r->q_mu);
        r->stop = 1;
        pthread_cond_broadcast(&r->q_cv);
        pthread_mutex_unlock(&r->q_mu);
        pthread_join(r->worker, NULL);
    }
    destroy(r);
}

/* ---- the API ---- */

/* a put's handle, key and value, checked before anything is queued or sent */
static int check_put(ferry_remote *r, const void *key, size_t key_len, const void *data,
                     size_t len, const char *fn)
{
    if (!r)
        return ferry__err_set(NULL, -EINVAL, "%s: NULL handle", fn);
    int rc = check_key(r, key, key_len, "put");
    return rc ? rc : check_data(r, key, key_len, data, len, "put");
}

int ferry_remote_put(ferry_remote *r, const void *key, size_t key_len, const void *data,
                     size_t len)
{
    int rc = check_put(r, key, key_len, data, len, "ferry_remote_put");
    if (rc)
        return rc;
    size_t klen = r->prefix_len + key_len, vlen = r->header_len + len;
    char ks[80];
    /* down and backing off: the writer would drop it; do not copy it first */
    pthread_mutex_lock(&r->health_mu);
    int down = r->down && ferry__now_ns() < r->down_until_ns;
    pthread_mutex_unlock(&r->health_mu);
    if (down) {
        INC(r->dropped);
        INC(r->degraded);
        return rfail(r, -EAGAIN, "remote %s: put %s (%zu bytes) dropped: the remote is down",
                     r->url.redacted, key_str(key, key_len, ks, sizeof ks), len);
    }
    pthread_mutex_lock(&r->q_mu);
    int full = r->q_items + 1 > r->queue_max_items || r->q_bytes + klen + vlen > r->queue_max_bytes;
    uint64_t items = r->q_items, bytes = r->q_bytes;
    pthread_mutex_unlock(&r->q_mu);
    if (full) {
    drop:
        INC(r->dropped);
        return rfail(r, FERRY_ENOSPACE,
                     "remote %s: put %s (%zu bytes) dropped: write queue full (%llu items, %llu "
                     "bytes; bounds %llu, %llu)",
                     r->url.redacted, key_str(key, key_len, ks, sizeof ks), len,
                     (unsigned long long)items, (unsigned long long)bytes,
                     (unsigned long long)r->queue_max_items,
                     (unsigned long long)r->queue_max_bytes);
    }
    qitem *it = ferry__malloc(sizeof *it + klen + vlen);
    if (!it) {
        INC(r->dropped);
        return rfail(r, -ENOMEM, "remote %s: put %s: out of memory for %zu bytes (dropped)",
                     r->url.redacted, key_str(key, key_len, ks, sizeof ks),
                     sizeof *it + klen + vlen);
    }
    it->next = NULL;
    it->key = (uint8_t *)(it + 1);
    it->val = it->key + klen;
    it->klen = full_key(r, key, key_len, it->key);
    it->vlen = vlen;
    ferry__rvalue_encode_header(it->val, r->layout, r->layout_len,
                                ferry__rvalue_key_sum(key, key_len), data, len);
    if (len)
        memcpy(it->val + r->header_len, data, len);
    pthread_mutex_lock(&r->q_mu);
    if (r->stop || r->q_items + 1 > r->queue_max_items ||
        r->q_bytes + klen + vlen > r->queue_max_bytes) {
        items = r->q_items;
        bytes = r->q_bytes;
        pthread_mutex_unlock(&r->q_mu);
        ferry__free(it);
        goto drop;
    }
    if (r->qtail)
        r->qtail->next = it;
    else
        r->qhead = it;
    r->qtail = it;
    r->q_items++;
    r->q_bytes += klen + vlen;
    r->q_enqueued++;
    FERRY__ASSERT(r->q_items <= r->queue_max_items && r->q_bytes <= r->queue_max_bytes);
    pthread_cond_signal(&r->q_cv);
    pthread_mutex_unlock(&r->q_mu);
    INC(r->puts);
    return 0;
}

int ferry_remote_put_sync(ferry_remote *r, const void *key, size_t key_len, const void *data,
                          size_t len)
{
    int rc = check_put(r, key, key_len, data, len, "ferry_remote_put_sync");
    if (rc)
        return rc;
    char ks[80];
    uint8_t kb[FERRY_REMOTE_KEY_MAX];
    size_t kl = full_key(r, key, key_len, kb);
    size_t vlen = r->header_len + len;
    uint8_t *v = ferry__malloc(vlen);
    if (!v)
        return rfail(r, -ENOMEM, "remote %s: put %s: out of memory for %zu bytes",
                     r->url.redacted, key_str(key, key_len, ks, sizeof ks), vlen);
    ferry__rvalue_encode_header(v, r->layout, r->layout_len, ferry__rvalue_key_sum(key, key_len),
                                data, len);
    if (len)
        memcpy(v + r->header_len, data, len);
    char ttl[16];
    snprintf(ttl, sizeof ttl, "%u", r->ttl_s);
    ferry__rcmd cmd;
    cmd_set(r, &cmd, kb, kl, v, vlen, ttl);
    ferry__errbuf eb;
    INC(r->puts);
    rc = run(r, NULL, &cmd, 1, &eb);
    ferry__free(v);
    if (rc == RUN_DOWN)
        return publish(r, &eb, -EAGAIN);
    if (rc < 0)
        return publish(r, &eb, rc);
    char d[64];
    if (cmd.reply->type == REDIS_REPLY_ERROR) {
        INC(r->errors);
        rc = rfail(r, FERRY_EREMOTE, "remote %s: SET %s (%zu bytes): %s", r->url.redacted,
                   key_str(key, key_len, ks, sizeof ks), vlen, cmd.reply->str);
    } else if (!ferry__rreply_is_ok(cmd.reply)) { /* (a proxy or no server of ours) */
        INC(r->errors);
        rc = rfail(r, -EPROTO, "remote %s: SET %s (%zu bytes): answered %s, not +OK",
                   r->url.redacted, key_str(key, key_len, ks, sizeof ks), vlen,
                   ferry__rreply_desc(cmd.reply, d, sizeof d));
    } else {
        INC(r->puts_written);
        ADD(r->bytes_written, vlen);
    }
    ferry__rcmd_release(&cmd, 1);
    return rc;
}

/* the outcome of a GET that came back whole, as ferry_remote_get reports it */
static int get_outcome(ferry_remote *r, const void *key, size_t key_len, const ferry__rget *g)
{
    char ks[80];
    key_str(key, key_len, ks, sizeof ks);
    if (g->kind == FERRY__RGET_NIL) {
        INC(r->misses);
        return rfail(r, FERRY_ENOTFOUND, "remote %s: get %s: no such key", r->url.redacted, ks);
    }
    if (g->kind == FERRY__RGET_ERROR) {
        INC(r->errors);
        INC(r->misses);
        return rfail(r, FERRY_EREMOTE, "remote %s: GET %s: %s", r->url.redacted, ks, g->msg);
    }
    ADD(r->bytes_read, g->read_len); /* (a value refused unread: none of it) */
    if (g->code) {
        INC(r->misses);
        if (g->code == FERRY_EMISMATCH)
            INC(r->mismatched);
        else if (g->code != -ENOBUFS)
            INC(r->corrupt);
        if (g->value_len > FERRY_REMOTE_VALUE_MAX) /* (its message names its length) */
            return rfail(r, g->code, "remote %s: get %s: %s", r->url.redacted, ks, g->msg);
        return rfail(r, g->code, "remote %s: get %s (%zu bytes): %s", r->url.redacted, ks,
                     g->value_len, g->msg);
    }
    INC(r->hits);
    return (int)g->payload_len;
}

int ferry_remote_get(ferry_remote *r, const void *key, size_t key_len, void *dst, size_t cap)
{
    if (!r)
        return ferry__err_set(NULL, -EINVAL, "ferry_remote_get: NULL handle");
    int rc = check_key(r, key, key_len, "get");
    if (rc)
        return rc;
    if (!dst && cap)
        return rfail(r, -EINVAL, "remote %s: get: NULL destination of %zu bytes",
                     r->url.redacted, cap);
    INC(r->gets);
    char ks[80];
    uint8_t kb[FERRY_REMOTE_KEY_MAX];
    ferry__rget g;
    memset(&g, 0, sizeof g);
    g.key = kb;
    g.key_len = full_key(r, key, key_len, kb);
    g.layout = r->layout;
    g.layout_len = r->layout_len;
    g.key_sum = ferry__rvalue_key_sum(key, key_len);
    g.dst = dst;
    g.cap = cap;
    /* the generic path (a cluster, or a first call before the topology is
     * known) reads at most one byte more than dst and the header can take,
     * with GETRANGE: a longer value (another writer's) is refused from its
     * header, not a reply out of bounds that would mark the remote down */
    size_t fetch = FERRY__MIN(cap, FERRY_REMOTE_VALUE_MAX) + r->header_len;
    char end[24];
    snprintf(end, sizeof end, "%zu", fetch);
    ferry__rcmd cmd;
    memset(&cmd, 0, sizeof cmd);
    cmd.argc = 4;
    cmd.argv[0] = "GETRANGE";
    cmd.argvlen[0] = 8;
    cmd.argv[1] = (const char *)kb;
    cmd.argvlen[1] = g.key_len;
    cmd.argv[2] = "0";
    cmd.argvlen[2] = 1;
    cmd.argv[3] = end;
    cmd.argvlen[3] = strlen(end);
    cmd.key_arg = 1;
    cmd.reply_max = FERRY__MAX((size_t)FERRY__RREPLY_SMALL, fetch + 1 + FERRY__RREPLY_ENVELOPE);
    /* the direct path when the topology has one, else a generic exchange */
    const ferry__rtopo_ops *ops = atomic_load(&r->ops);
    int direct = ops && ops->get_into;
    work w = {&cmd, 1, direct ? &g : NULL};
    ferry__errbuf eb;
    rc = run_work(r, NULL, &w, &eb);
    if (rc == RUN_DOWN) {
        INC(r->misses);
        return rfail(r, FERRY_ENOTFOUND, "remote get %s: answered as a miss: %s",
                     key_str(key, key_len, ks, sizeof ks), eb.msg);
    }
    if (rc < 0) {
        INC(r->misses);
        return publish(r, &eb, rc);
    }
    if (direct)
        return get_outcome(r, key, key_len, &g);
    redisReply *rep = cmd.reply;
    /* GETRANGE answers "" for an absent key (and for an empty value, which
     * is no ferry value either) */
    if (rep->type == REDIS_REPLY_STRING && rep->len == 0)
        g.kind = FERRY__RGET_NIL;
    else if (rep->type == REDIS_REPLY_STRING)
        ferry__rvalue_range_outcome(&g, rep->str, rep->len, rep->len <= fetch);
    else {
        g.kind = FERRY__RGET_ERROR;
        if (rep->type == REDIS_REPLY_ERROR)
            snprintf(g.msg, sizeof g.msg, "%s", rep->str);
        else
            snprintf(g.msg, sizeof g.msg, "unexpected reply type %d", rep->type);
    }
    ferry__rcmd_release(&cmd, 1);
    return get_outcome(r, key, key_len, &g);
}

/* build one command per key (n > 0): argv0 [key] extra... into cmds; keys
 * into kbuf. The count is an int's: -EINVAL past INT32_MAX keys. */
static int batch_cmds(ferry_remote *r, const ferry_remote_key *keys, size_t n, const char *verb,
                      const char *what, ferry__rcmd **cmds_out, uint8_t **kbuf_out)
{
    if (n > (size_t)INT32_MAX)
        return rfail(r, -EINVAL, "remote %s: %s: %zu keys", r->url.redacted, what, n);
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        int rc = check_key(r, keys[i].data, keys[i].len, what);
        if (rc)
            return rc;
        total += r->prefix_len + keys[i].len;
    }
    ferry__rcmd *cmds = ferry__calloc(n, sizeof *cmds);
    uint8_t *kb = ferry__malloc(total ? total : 1);
    if (!cmds || !kb) {
        ferry__free(cmds);
        ferry__free(kb);
        return rfail(r, -ENOMEM, "remote %s: %s: out of memory for %zu keys", r->url.redacted,
                     what, n);
    }
    uint8_t *p = kb;
    for (size_t i = 0; i < n; i++) {
        size_t kl = full_key(r, keys[i].data, keys[i].len, p);
        cmds[i].argv[0] = verb;
        cmds[i].argvlen[0] = strlen(verb);
        cmds[i].argv[1] = (const char *)p;
        cmds[i].argvlen[1] = kl;
        cmds[i].argc = 2;
        cmds[i].key_arg = 1;
        p += kl;
    }
    *cmds_out = cmds;
    *kbuf_out = kb;
    return 0;
}

int ferry_remote_exists(ferry_remote *r, const ferry_remote_key *keys, size_t n)
{
    if (!r || (!keys && n))
        return ferry__err_set(NULL, -EINVAL, "ferry_remote_exists: NULL argument");
    INC(r->exists_calls);
    if (n == 0)
        return 0;
    ferry__rcmd *cmds;
    uint8_t *kb;
    int rc = batch_cmds(r, keys, n, "GETRANGE", "exists", &cmds, &kb);
    if (rc)
        return rc;
    char end[24];
    snprintf(end, sizeof end, "%zu", r->header_len - 1);
    for (size_t i = 0; i < n; i++) {
        cmds[i].argv[2] = "0";
        cmds[i].argvlen[2] = 1;
        cmds[i].argv[3] = end;
        cmds[i].argvlen[3] = strlen(end);
        cmds[i].argc = 4;
    }
    ferry__errbuf eb;
    rc = run(r, NULL, cmds, n, &eb);
    if (rc == RUN_DOWN) {
        publish(r, &eb, FERRY_ENOTFOUND);
        rc = 0;
    } else if (rc == RUN_OK) {
        size_t count = 0;
        for (; count < n; count++) {
            redisReply *rep = cmds[count].reply;
            if (rep->type == REDIS_REPLY_ERROR) {
                INC(r->errors);
                rfail(r, FERRY_EREMOTE, "remote %s: exists: GETRANGE: %s", r->url.redacted,
                      rep->str);
                break;
            }
            if (rep->type != REDIS_REPLY_STRING || rep->len == 0)
                break;
            ferry__rvalue_hdr h;
            const ferry_remote_key *k = &keys[count];
            if (ferry__rvalue_parse_header(rep->str, rep->len, &h, &eb) ||
                ferry__rvalue_match(&h, r->layout, r->layout_len,
                                    ferry__rvalue_key_sum(k->data, k->len), &eb)) {
                if (eb.code == FERRY_EMISMATCH)
                    INC(r->mismatched);
                else
                    INC(r->corrupt);
                publish(r, &eb, eb.code);
                break;
            }
        }
        rc = (int)count;
        ferry__rcmd_release(cmds, n);
    } else {
        publish(r, &eb, rc);
    }
    ferry__free(cmds);
    ferry__free(kb);
    return rc;
}

int ferry_remote_delete(ferry_remote *r, const ferry_remote_key *keys, size_t n)
{
    if (!r || (!keys && n))
        return ferry__err_set(NULL, -EINVAL, "ferry_remote_delete: NULL argument");
    if (n == 0)
        return 0;
    ferry__rcmd *cmds;
    uint8_t *kb;
    int rc = batch_cmds(r, keys, n, "DEL", "delete", &cmds, &kb);
    if (rc)
        return rc;
    ferry__errbuf eb;
    rc = run(r, NULL, cmds, n, &eb);
    if (rc == RUN_DOWN) {
        rc = publish(r, &eb, -EAGAIN);
    } else if (rc == RUN_OK) {
        long long deleted = 0;
        for (size_t i = 0; i < n; i++) {
            /* DEL of one key answers 0 or 1: anything else is no count */
            redisReply *rep = cmds[i].reply;
            char d[64];
            if (rep->type == REDIS_REPLY_INTEGER && (rep->integer == 0 || rep->integer == 1))
                deleted += rep->integer;
            else if (rep->type == REDIS_REPLY_ERROR) {
                INC(r->errors);
                if (rc == 0)
                    rc = rfail(r, FERRY_EREMOTE, "remote %s: DEL: %s", r->url.redacted,
                               rep->str);
            } else {
                INC(r->errors);
                if (rc == 0)
                    rc = rfail(r, -EPROTO, "remote %s: DEL of key %zu: answered %s, not 0 or 1",
                               r->url.redacted, i, ferry__rreply_desc(rep, d, sizeof d));
            }
        }
        ADD(r->deletes, deleted);
        if (rc == 0)
            rc = (int)deleted;
        ferry__rcmd_release(cmds, n);
    } else {
        publish(r, &eb, rc);
    }
    ferry__free(cmds);
    ferry__free(kb);
    return rc;
}

int ferry_remote_flush(ferry_remote *r, uint32_t timeout_ms)
{
    if (!r)
        return ferry__err_set(NULL, -EINVAL, "ferry_remote_flush: NULL handle");
    struct timespec dl = ferry__deadline_ms((uint64_t)(timeout_ms > 0 ? timeout_ms : 0));
    int rc = 0;
    pthread_mutex_lock(&r->q_mu);
    uint64_t target = r->q_enqueued;
    while (r->q_finished < target) {
        if (timeout_ms == 0)
            pthread_cond_wait(&r->q_done_cv, &r->q_mu);
        else if (pthread_cond_timedwait(&r->q_done_cv, &r->q_mu, &dl) == ETIMEDOUT) {
            rc = -ETIMEDOUT;
            break;
        }
    }
    uint64_t left = target - FERRY__MIN(target, r->q_finished);
    pthread_mutex_unlock(&r->q_mu);
    if (rc)
        return rfail(r, rc, "remote %s: flush: %llu put(s) still queued after %u ms",
                     r->url.redacted, (unsigned long long)left, timeout_ms);
    return 0;
}

int ferry_remote_stats_get(const ferry_remote *cr, ferry_remote_stats *m)
{
    if (!cr || !m)
        return ferry__err_set(NULL, -EINVAL, "ferry_remote_stats_get: handle or out is NULL");
    /* the handle's locks are taken, nothing of it is written */
    ferry_remote *r = (ferry_remote *)cr;
    ferry_remote_stats v = FERRY_REMOTE_STATS_INIT;
    v.puts = LOAD(r->puts);
    v.puts_written = LOAD(r->puts_written);
    v.gets = LOAD(r->gets);
    v.hits = LOAD(r->hits);
    v.misses = LOAD(r->misses);
    v.errors = LOAD(r->errors);
    v.dropped = LOAD(r->dropped);
    v.reconnects = LOAD(r->reconnects);
    v.degraded = LOAD(r->degraded);
    v.corrupt = LOAD(r->corrupt);
    v.mismatched = LOAD(r->mismatched);
    v.redirects = LOAD(r->redirects);
    v.bytes_written = LOAD(r->bytes_written);
    v.bytes_read = LOAD(r->bytes_read);
    v.exists_calls = LOAD(r->exists_calls);
    v.deletes = LOAD(r->deletes);
    pthread_mutex_lock(&r->q_mu);
    v.queue_items = r->q_items;
    v.queue_bytes = r->q_bytes;
    pthread_mutex_unlock(&r->q_mu);
    pthread_mutex_lock(&r->health_mu);
    v.down = (uint32_t)r->down;
    pthread_mutex_unlock(&r->health_mu);
    v.cluster = atomic_load(&r->ops) == &ferry__rtopo_cluster;
    return ferry__stats_put(NULL, "ferry_remote_stats_get", m, &v, sizeof v);
}

const char *ferry_remote_last_error(const ferry_remote *r)
{
    /* the calling thread's own copy, taken whole: the writer thread may
     * record a failure meanwhile */
    return r ? ferry__err_msg(&r->err) : "";
}

const char *ferry_remote_url(const ferry_remote *r)
{
    return r ? r->url.redacted : "";
}
