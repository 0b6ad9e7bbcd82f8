/*
 * serve.c - `ferry serve`'s daemon (ferry/serve.h): the hosted store, the
 * socket (0600, or 0660 with a group; a stale file replaced, a live
 * daemon's refused), the accept loop (peers checked by SO_PEERCRED, a
 * thread per connection, at most max_clients; out of descriptors, the
 * socket rests rather than spin), each connection watched
 * for its client hanging up (serve_int.h), and a clean stop (waits for a
 * slot cut short, requests received answered, disconnect, flush, sync,
 * close).
 *
 * Daemons starting on one path take turns (a lock on its directory) from
 * the stale check to the link, so one never removes the file another just
 * linked (then both would open, one serving a socket no client reaches);
 * a closing daemon removes its file while it still listens, so no other
 * can have replaced it by then.
 */
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <sys/un.h>
#include <unistd.h>

#include "core.h"
#include "serve_int.h"
#include "sized.h"

/* ---- the socket ---- */

static int addr_of(const char *path, struct sockaddr_un *a, ferry__errbuf *eb)
{
    memset(a, 0, sizeof *a);
    a->sun_family = AF_UNIX;
    if (strlen(path) >= sizeof a->sun_path)
        return ferry__err_set(eb, -ENAMETOOLONG, "serve: socket path %s is too long (%zu max)",
                              path, sizeof a->sun_path - 1);
    memcpy(a->sun_path, path, strlen(path) + 1);
    return 0;
}

/* a socket file already at path: a live daemon's (FERRY_EBUSY) or a dead
 * one's (removed when remove is set; else left for the start to replace) */
static int clear_stale(const char *path, const struct sockaddr_un *a, int remove,
                       ferry__errbuf *eb)
{
    struct stat st;
    if (lstat(path, &st) != 0)
        return 0;
    if (!S_ISSOCK(st.st_mode))
        return ferry__err_set(eb, -EEXIST, "serve: %s exists and is not a socket", path);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return ferry__err_set(eb, -errno, "serve: socket: %s", strerror(errno));
    int live = connect(fd, (const struct sockaddr *)a, sizeof *a) == 0;
    close(fd);
    if (live)
        return ferry__err_set(eb, FERRY_EBUSY, "serve: a daemon is already serving on %s",
                              path);
    if (!remove)
        return 0;
    if (unlink(path) != 0 && errno != ENOENT)
        return ferry__err_set(eb, -errno, "serve: removing the stale socket %s: %s", path,
                              strerror(errno));
    FERRY_LOGI("serve: replaced the stale socket %s", path);
    return 0;
}

/* path's directory into dir (cap bytes, at least 2): "." for a bare name */
static void dir_of(const char *path, char *dir, size_t cap)
{
    const char *sl = strrchr(path, '/');
    size_t n = !sl ? 0 : sl == path ? 1 : (size_t)(sl - path);
    if (n >= cap)
        n = cap - 1;
    memcpy(dir, n ? path : ".", n ? n : 1);
    dir[n ? n : 1] = 0;
}

/* what would refuse the socket, found before the store is opened (its
 * pool allocated, its L2 slab created): a path too long, a directory that
 * is not there, a file that is no socket, a live daemon on it, a group
 * that does not exist. A refused start then leaves nothing behind. Called
 * with the directory locked (lock_dir), held until listen_locked is done */
static int socket_usable(const char *path, const char *group, ferry__errbuf *eb)
{
    if (group) {
        struct group gr, *res = NULL;
        char buf[4096];
        if (getgrnam_r(group, &gr, buf, sizeof buf, &res) != 0 || !res)
            return ferry__err_set(eb, -EINVAL, "serve: no group named %s", group);
    }
    struct sockaddr_un a;
    int rc = addr_of(path, &a, eb);
    if (rc < 0)
        return rc;
    char dir[sizeof a.sun_path];
    struct stat st;
    dir_of(path, dir, sizeof dir);
    int e = stat(dir, &st) != 0 ? errno : S_ISDIR(st.st_mode) ? 0 : ENOTDIR;
    if (e)
        return ferry__err_set(eb, -e,
                              "serve: the socket's directory %s: %s; create it, or give a socket "
                              "path in an existing directory",
                              dir, strerror(e));
    return clear_stale(path, &a, 0, eb);
}

/* the name a socket is bound under until it listens: beside path, unique
 * to this process and call; 0 when it would not fit (then path itself) */
static int tmp_name(const char *path, char *out, size_t cap)
{
    static atomic_uint seq;
    int n = snprintf(out, cap, "%s.%ld.%u~", path, (long)getpid(), atomic_fetch_add(&seq, 1));
    return n > 0 && (size_t)n < cap;
}

/* the directory that holds path, opened and locked (flock) so that
 * daemons starting on the same path take turns; -1 where it cannot be
 * opened (then no lock: the start is as racy as without one) */
static int lock_dir(const char *path)
{
    char dir[sizeof ((struct sockaddr_un *)0)->sun_path];
    if (strlen(path) >= sizeof dir)
        return -1;
    dir_of(path, dir, sizeof dir);
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd >= 0)
        while (flock(fd, LOCK_EX) != 0 && errno == EINTR)
            ;
    return fd;
}

/* the socket bound, given its owner and mode and listening under a
 * temporary name, then linked at path: a client that sees path can
 * connect (a client that waits for the file and connects at once is never
 * refused), and a daemon that got there first keeps it (FERRY_EBUSY) */
static int listen_locked(ferry_serve *s, const char *group)
{
    struct sockaddr_un a, b;
    int rc = addr_of(s->path, &a, &s->err);
    if (rc == 0)
        rc = clear_stale(s->path, &a, 1, &s->err);
    if (rc < 0)
        return rc;
    b = a;
    int tmp = tmp_name(s->path, b.sun_path, sizeof b.sun_path);
    if (!tmp)
        b = a;
    const char *at = b.sun_path;
    s->lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s->lfd < 0)
        return ferry__err_set(&s->err, -errno, "serve: socket: %s", strerror(errno));
    if (bind(s->lfd, (struct sockaddr *)&b, sizeof b) != 0)
        return ferry__err_set(&s->err, -errno, "serve: bind %s: %s", s->path, strerror(errno));
    gid_t gid = (gid_t)-1;
    if (group) {
        struct group gr, *res = NULL;
        char buf[4096];
        if (getgrnam_r(group, &gr, buf, sizeof buf, &res) != 0 || !res) {
            unlink(at);
            return ferry__err_set(&s->err, -EINVAL, "serve: no group named %s", group);
        }
        gid = res->gr_gid;
    }
    if ((gid != (gid_t)-1 && chown(at, (uid_t)-1, gid) != 0) ||
        chmod(at, group ? 0660 : 0600) != 0) {
        int e = errno;
        unlink(at);
        return ferry__err_set(&s->err, -e, "serve: setting the owner and mode of %s: %s", at,
                              strerror(e));
    }
    if (listen(s->lfd, 1024) != 0) {
        int e = errno;
        unlink(at);
        return ferry__err_set(&s->err, -e, "serve: listen on %s: %s", at, strerror(e));
    }
    if (tmp) {
        int e = link(at, s->path) == 0 ? 0 : errno;
        unlink(at);
        if (e == EEXIST)
            return ferry__err_set(&s->err, FERRY_EBUSY,
                                  "serve: another daemon took %s while this one started",
                                  s->path);
        if (e)
            return ferry__err_set(&s->err, -e, "serve: linking the socket at %s: %s", s->path,
                                  strerror(e));
    }
    return 0;
}

/* ---- open / close ---- */

#define HUGETLBFS_MAGIC_ 0x958458f6u

/*
 * Say so when the pool is not in huge pages (none reserved: the kernel
 * gave a memfd of 4 KiB pages). Every L2 read lands in the pool with
 * O_DIRECT and every copy in or out walks it; with 4 KiB pages a read
 * pins 512 times the pages, and on some VMs the drive then delivers a
 * third of what it does into huge pages (fio shows the same), where an
 * in-process store's L1 gets transparent huge pages by itself.
 */
static void pool_pages_note(const ferry_serve *s)
{
    struct statfs f;
    if (fstatfs(s->pool_fd, &f) != 0 || (uint32_t)f.f_type == HUGETLBFS_MAGIC_)
        return;
    uint64_t pages = (s->pool_bytes + ((uint64_t)2 << 20) - 1) >> 21;
    FERRY_LOGI("serve: the pool (%llu MiB) is in 4 KiB pages: reads from L2 into it and "
               "copies out of it are slower than with huge pages (several times on some "
               "VMs); "
               "reserve %llu huge pages of 2 MiB (vm.nr_hugepages) before starting the daemon",
               (unsigned long long)(s->pool_bytes >> 20), (unsigned long long)pages);
}

static int host_store(ferry_serve *s, const ferry_kv_config *kcfg)
{
    if (kcfg->size >= offsetof(ferry_kv_config, server) + sizeof(char *) && kcfg->server)
        return ferry__err_set(&s->err, -EINVAL,
                              "serve: the hosted store's config names a server (%s)",
                              kcfg->server);
    int rc = ferry__kv_open_shared(kcfg, &s->kv);
    if (rc < 0)
        return ferry__err_pass(&s->err, rc);
    s->pool_fd = ferry__kv_pool(s->kv, &s->pool_bytes, &s->slot_bytes, &s->nslots);
    ferry__kv_geometry(s->kv, &s->layout, &s->chunk_tokens, &s->seed);
    s->chunk_bytes = ferry_kv_chunk_bytes(s->kv);
    /* a connection may hold every slot twice over (reserved, then a lock on
     * a chunk it stored), and no more */
    s->max_held = (size_t)(2 * s->nslots + 64);
    s->max_reserved = (size_t)(s->nslots > 1 ? s->nslots / 2 : 1);
    if (s->pool_fd < 0)
        return ferry__err_set(&s->err, -EINVAL, "serve: the pool is not shared");
    pool_pages_note(s);
    return 0;
}

int ferry_serve_open(const ferry_serve_config *ucfg, ferry_serve **out)
{
    static const ferry__sized sized =
        FERRY__SIZED0(ferry_serve_config, FERRY_SERVE_CONFIG_MIN_SIZE);
    if (!ucfg || !out)
        return ferry__err_set(NULL, -EINVAL, "serve open: config or out is NULL");
    ferry_serve_config cv = FERRY_SERVE_CONFIG_INIT;
    int rc = ferry__opts_take(NULL, "serve open", &sized, &cv, ucfg);
    if (rc < 0)
        return rc;
    const ferry_serve_config *cfg = &cv;
    if (!cfg->socket_path || !*cfg->socket_path || !cfg->kv)
        return ferry__err_set(NULL, -EINVAL,
                              "serve open: the config names no socket_path or kv config");
    ferry_serve *s = ferry__calloc(1, sizeof *s);
    if (!s)
        return ferry__err_set(NULL, -ENOMEM, "serve open: out of memory");
    pthread_mutex_init(&s->mu, NULL);
    s->lfd = -1;
    s->pool_fd = -1;
    s->stop_pipe[0] = s->stop_pipe[1] = -1;
    s->uid = getuid();
    s->max_clients = cfg->max_clients ? cfg->max_clients : FERRY_SERVE_MAX_CLIENTS_DEFAULT;
    s->send_timeout_ms =
        cfg->send_timeout_ms ? cfg->send_timeout_ms : FERRY_SERVE_SEND_TIMEOUT_MS_DEFAULT;
    s->path = ferry__strdup(cfg->socket_path);
    rc = s->path ? 0 : ferry__err_set(&s->err, -ENOMEM, "serve open: out of memory");
    if (rc == 0 && cfg->n_allow_uids) {
        s->allow = ferry__malloc(cfg->n_allow_uids * sizeof *s->allow);
        if (!s->allow || !cfg->allow_uids)
            rc = ferry__err_set(&s->err, s->allow ? -EINVAL : -ENOMEM,
                                "serve open: %zu allowed uids %s", cfg->n_allow_uids,
                                s->allow ? "but allow_uids is NULL" : "(out of memory)");
        else
            memcpy(s->allow, cfg->allow_uids, cfg->n_allow_uids * sizeof *s->allow);
        s->nallow = cfg->n_allow_uids;
    }
    if (rc == 0 && pipe2(s->stop_pipe, O_CLOEXEC | O_NONBLOCK) != 0)
        rc = ferry__err_set(&s->err, -errno, "serve open: pipe: %s", strerror(errno));
    /* the socket's directory is locked from the check to the listen: of
     * two daemons started on one path at once, the second looks once the
     * first listens, and is refused before it opens a store (no L2 slab
     * of its own left behind). (Starts in that directory take turns.) */
    int dfd = rc == 0 ? lock_dir(s->path) : -1;
    if (rc == 0)
        rc = socket_usable(s->path, cfg->group, &s->err);
    if (rc == 0)
        rc = host_store(s, cfg->kv);
    if (rc == 0)
        rc = listen_locked(s, cfg->group);
    if (dfd >= 0)
        close(dfd); /* (the lock goes with it) */
    if (rc < 0) {
        ferry__err_pass(NULL, rc);
        if (s->lfd >= 0)
            close(s->lfd);
        s->lfd = -1;
        ferry_kv_close(s->kv);
        s->kv = NULL;
        ferry_serve_close(s);
        return rc;
    }
    FERRY_LOGI("serve: serving %llu slots of %llu bytes on %s", (unsigned long long)s->nslots,
               (unsigned long long)s->slot_bytes, s->path);
    *out = s;
    return 0;
}

/* join and free the connections whose threads finished (all: every one,
 * after shutting their sockets down) */
static void reap(ferry_serve *s, int all)
{
    pthread_mutex_lock(&s->mu);
    if (all)
        for (ferry__srv_conn *c = s->conns; c; c = c->next)
            shutdown(c->fd, SHUT_RDWR);
    ferry__srv_conn **pp = &s->conns, *done = NULL;
    while (*pp) {
        ferry__srv_conn *c = *pp;
        if (all || atomic_load(&c->done)) {
            *pp = c->next;
            c->next = done;
            done = c;
        } else {
            pp = &c->next;
        }
    }
    pthread_mutex_unlock(&s->mu);
    for (ferry__srv_conn *c = done, *nx; c; c = nx) {
        nx = c->next;
        pthread_join(c->th, NULL);
        close(c->fd);
        ferry__free(c->in);
        ferry__free(c->ch);
        ferry__free(c->tiers);
        ferry__free(c->held);
        ferry__proto_buf_free(&c->out);
        ferry__kv_cut_put(c->cut); /* (read-ahead still landing may hold it a while) */
        ferry__free(c);
    }
}

/* how long a closing daemon lets its connections answer what they were
 * asking before it cuts them off (a client that reads no replies holds
 * its connection's send up to send_timeout_ms otherwise) */
#define CLOSE_GRACE_NS ((uint64_t)250 * 1000 * 1000)

/* every connection cut (its waits for a slot end, -ECANCELED, and it takes
 * none) and its reading side shut (its thread ends once it has answered
 * the requests already received), then a grace for those answers */
static void cut_all(ferry_serve *s)
{
    pthread_mutex_lock(&s->mu);
    for (ferry__srv_conn *c = s->conns; c; c = c->next) {
        atomic_store(&c->cut->why, FERRY__SRV_CLOSING);
        shutdown(c->fd, SHUT_RD);
        ferry__kv_ahead_cut(s->kv, c->cut); /* (its read-ahead not begun: dropped) */
    }
    pthread_mutex_unlock(&s->mu);
    for (uint64_t until = ferry__now_ns() + CLOSE_GRACE_NS; ferry__now_ns() < until;) {
        int busy = 0;
        pthread_mutex_lock(&s->mu);
        for (ferry__srv_conn *c = s->conns; c && !busy; c = c->next)
            busy = !atomic_load(&c->done);
        pthread_mutex_unlock(&s->mu);
        if (!busy)
            break;
        usleep(1000);
    }
}

int ferry_serve_close(ferry_serve *s)
{
    if (!s)
        return 0;
    cut_all(s);
    reap(s, 1);
    int rc = 0;
    if (s->kv) {
        rc = ferry_kv_sync(s->kv); /* flushes first */
        if (rc < 0)
            FERRY_LOGE("serve: sync at close: %s", ferry_kv_last_error(s->kv));
        ferry_kv_close(s->kv);
    }
    if (s->lfd >= 0) {
        /* the file first, while this daemon still listens: another daemon
         * finds it live until then and cannot have replaced it */
        unlink(s->path);
        close(s->lfd);
    }
    for (int i = 0; i < 2; i++)
        if (s->stop_pipe[i] >= 0)
            close(s->stop_pipe[i]);
    pthread_mutex_destroy(&s->mu);
    ferry__free(s->watch);
    ferry__free(s->watch_c);
    ferry__free(s->allow);
    ferry__free(s->path);
    ferry__free(s);
    return rc < 0 ? rc : 0;
}

/* ---- accepting ---- */

static int allowed(const ferry_serve *s, uid_t uid)
{
    if (uid == s->uid)
        return 1;
    for (size_t i = 0; i < s->nallow; i++)
        if (s->allow[i] == (uint32_t)uid)
            return 1;
    return 0;
}

unsigned ferry__srv_retire_gone(ferry_serve *s)
{
    unsigned n = 0;
    for (ferry__srv_conn *c = s->conns; c; c = c->next) {
        /* (its fd stays open while it is on the list: reap closes it
         * after taking it off, under s->mu) */
        struct pollfd p = {c->fd, 0, 0};
        if (c->retired || poll(&p, 1, 0) != 1 || !(p.revents & (POLLHUP | POLLERR)))
            continue;
        c->retired = 1;
        s->nconns--;
        s->nengines -= c->engine ? 1u : 0u;
        n++;
        int none = 0;
        if (atomic_compare_exchange_strong(&c->cut->why, &none, FERRY__SRV_GONE))
            ferry__kv_ahead_cut(s->kv, c->cut);
        FERRY_LOGD("serve: client pid %d hung up: no longer counted", (int)c->pid);
    }
    return n;
}

/* how long the listening socket rests after an accept failed for want of
 * something (descriptors, memory) that only a connection ending gives
 * back: its clients wait in the backlog, and the loop does not spin on a
 * connection it cannot take */
#define ACCEPT_REST_NS ((uint64_t)100 * 1000 * 1000)

static void accept_one(ferry_serve *s)
{
    int fd = accept4(s->lfd, NULL, NULL, SOCK_CLOEXEC);
    if (fd < 0) {
        int e = errno;
        if (e == EAGAIN || e == EINTR || e == ECONNABORTED)
            return;
        s->accept_after = ferry__now_ns() + ACCEPT_REST_NS;
        unsigned n = 0;
        pthread_mutex_lock(&s->mu);
        n = s->nconns;
        pthread_mutex_unlock(&s->mu);
        ferry__srv_warn(s, "serve: accept on %s: %s (serving %u clients, max_clients %u): "
                        "new clients wait until one ends%s", s->path, strerror(e), n,
                        s->max_clients,
                        e == EMFILE || e == ENFILE ? " (raise the open files limit, "
                                                     "ulimit -n, or lower max_clients)"
                                                   : "");
        return;
    }
    struct ucred cr;
    socklen_t len = sizeof cr;
    char msg[160];
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &len) != 0 || !allowed(s, cr.uid)) {
        snprintf(msg, sizeof msg, "uid %d may not use this daemon (allowed: uid %d and %zu more)",
                 (int)cr.uid, (int)s->uid, s->nallow);
        ferry__srv_warn(s, "serve: refused pid %d: %s", (int)cr.pid, msg);
        atomic_fetch_add(&s->refused, 1); /* (counted before the peer can read why) */
        ferry__srv_refuse(fd, 0, -EACCES, msg);
        close(fd);
        return;
    }
    ferry__srv_conn *c = ferry__calloc(1, sizeof *c);
    if (c && !(c->cut = ferry__kv_cut_new())) {
        ferry__free(c);
        c = NULL;
    }
    pthread_mutex_lock(&s->mu);
    unsigned most = s->max_clients + FERRY__SRV_MONITORS;
    int full = s->nconns >= most && !(ferry__srv_retire_gone(s) && s->nconns < most);
    pthread_mutex_unlock(&s->mu);
    if (!c || full) {
        snprintf(msg, sizeof msg, "%s (max_clients %u)",
                 c ? "the daemon serves as many clients as it may" : "out of memory",
                 s->max_clients);
        ferry__srv_warn(s, "serve: refused pid %d: %s", (int)cr.pid, msg);
        atomic_fetch_add(&s->refused, 1);
        ferry__srv_refuse(fd, 0, c ? FERRY_EBUSY : -ENOMEM, msg);
        if (c)
            ferry__kv_cut_put(c->cut);
        ferry__free(c);
        close(fd);
        return;
    }
    c->s = s;
    c->fd = fd;
    c->pid = cr.pid;
    c->wait_ns = ferry__kv_pool_wait_ns(s->kv);
    c->uid = cr.uid;
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setstacksize(&at, 256u << 10);
    pthread_mutex_lock(&s->mu);
    int rc = pthread_create(&c->th, &at, ferry__srv_conn_main, c);
    if (rc == 0) {
        c->next = s->conns;
        s->conns = c;
        s->nconns++;
    }
    pthread_mutex_unlock(&s->mu);
    pthread_attr_destroy(&at);
    if (rc != 0) {
        ferry__srv_refuse(fd, 0, -rc, "the daemon could not start a thread for this client");
        FERRY_LOGW("serve: no thread for pid %d: %s", (int)cr.pid, strerror(rc));
        close(fd);
        ferry__kv_cut_put(c->cut);
        ferry__free(c);
        return;
    }
    atomic_fetch_add(&s->connections, 1);
}

/* the poll set (s->watch): the socket, the stop pipe, and each connection
 * not cut, its thread still running, watched for a hang-up alone (events
 * 0); its size. Without memory for them, the first two */
static nfds_t watch_set(ferry_serve *s)
{
    pthread_mutex_lock(&s->mu);
    size_t want = 2;
    for (ferry__srv_conn *c = s->conns; c; c = c->next)
        want++;
    if (want > s->watch_cap) {
        struct pollfd *w = ferry__realloc(s->watch, want * sizeof *w);
        if (w)
            s->watch = w;
        ferry__srv_conn **wc = ferry__realloc(s->watch_c, want * sizeof *wc);
        if (wc)
            s->watch_c = wc;
        if (w && wc)
            s->watch_cap = want;
    }
    nfds_t n = 0;
    if (s->watch_cap >= 2) {
        s->watch[n++] = (struct pollfd){s->lfd, POLLIN, 0};
        s->watch[n++] = (struct pollfd){s->stop_pipe[0], POLLIN, 0};
        for (ferry__srv_conn *c = s->conns; c && n < s->watch_cap; c = c->next) {
            if (atomic_load(&c->cut->why) || atomic_load(&c->done))
                continue;
            s->watch_c[n] = c;
            s->watch[n++] = (struct pollfd){c->fd, 0, 0};
        }
    }
    pthread_mutex_unlock(&s->mu);
    return n;
}

/* the connections whose clients hung up: cut (a wait for a slot on their
 * behalf ends, their read-ahead not begun is dropped; they are reaped once
 * their threads notice) */
static void watch_hangups(ferry_serve *s, nfds_t n)
{
    for (nfds_t i = 2; i < n; i++) {
        if (!(s->watch[i].revents & (POLLHUP | POLLERR | POLLNVAL)))
            continue;
        ferry__srv_conn *c = s->watch_c[i];
        int none = 0;
        if (atomic_compare_exchange_strong(&c->cut->why, &none, FERRY__SRV_GONE)) {
            FERRY_LOGD("serve: client pid %d hung up", (int)c->pid);
            ferry__kv_ahead_cut(s->kv, c->cut);
        }
    }
}

int ferry_serve_run(ferry_serve *s)
{
    if (!s)
        return ferry__err_set(NULL, -EINVAL, "serve run: NULL");
    for (;;) {
        struct pollfd p2[2] = {{s->lfd, POLLIN, 0}, {s->stop_pipe[0], POLLIN, 0}};
        nfds_t n = watch_set(s);
        struct pollfd *p = n ? s->watch : p2;
        /* (after an accept that failed for want of descriptors, the
         * socket rests a while: the rest are still watched) */
        uint64_t now = ferry__now_ns();
        int ms = 500;
        if (now < s->accept_after) {
            p[0].events = 0;
            ms = (int)FERRY__MIN((s->accept_after - now + 999999) / 1000000, (uint64_t)ms);
        }
        int r = poll(p, n ? n : 2, ms);
        if (r < 0 && (errno == EINVAL || errno == ENOMEM) && n > 2) {
            /* more descriptors than the open files limit (lowered under a
             * running daemon) or no kernel memory for them: this turn
             * watches the socket and the stop pipe alone (a hang-up is
             * then noticed when its thread reads), the daemon goes on */
            ferry__srv_warn(s, "serve: poll of %lu descriptors: %s: hang-ups not watched "
                            "(the open files limit, ulimit -n, is below the clients served)",
                            (unsigned long)n, strerror(errno));
            n = 2;
            r = poll(p, n, ms);
        }
        if (r < 0 && errno != EINTR)
            return ferry__err_set(&s->err, -errno, "serve: poll: %s", strerror(errno));
        if (p[1].revents)
            break;
        if (r > 0 && (p[0].revents & POLLIN))
            accept_one(s);
        if (r > 0)
            watch_hangups(s, n);
        reap(s, 0);
    }
    char b[16];
    while (read(s->stop_pipe[0], b, sizeof b) > 0)
        ;
    FERRY_LOGI("serve: stopping");
    return 0;
}

void ferry_serve_stop(ferry_serve *s)
{
    if (s) {
        char b = 1;
        ssize_t w = write(s->stop_pipe[1], &b, 1);
        (void)w;
    }
}

ferry_kv *ferry_serve_kv(ferry_serve *s)
{
    return s ? s->kv : NULL;
}

const char *ferry_serve_last_error(const ferry_serve *s)
{
    return s ? ferry__err_msg(&s->err) : "";
}

int ferry_serve_stats_get(const ferry_serve *cs, ferry_serve_stats *out)
{
    if (!cs || !out)
        return ferry__err_set(NULL, -EINVAL, "ferry_serve_stats_get: daemon or out is NULL");
    ferry_serve *s = (ferry_serve *)cs; /* its mutex is taken, nothing written */
    ferry_serve_stats m = FERRY_SERVE_STATS_INIT;
    pthread_mutex_lock(&s->mu);
    m.clients = s->nconns;
    pthread_mutex_unlock(&s->mu);
    m.connections = atomic_load(&s->connections);
    m.refused = atomic_load(&s->refused);
    m.requests = atomic_load(&s->requests);
    m.bad_frames = atomic_load(&s->bad_frames);
    m.slow_clients = atomic_load(&s->slow_clients);
    m.released = atomic_load(&s->released);
    m.ahead_dropped = ferry__kv_ahead_dropped(s->kv);
    return ferry__stats_put(NULL, "ferry_serve_stats_get", out, &m, sizeof m);
}

int ferry_serve_clients(const ferry_serve *cs, ferry_serve_client *out, size_t max,
                        size_t elem_size)
{
    if (!cs || (!out && max) || !elem_size || elem_size > sizeof(ferry_serve_client))
        return ferry__err_set(NULL, -EINVAL,
                              "ferry_serve_clients: daemon NULL, out NULL or elem_size %zu "
                              "(1 to %zu)", elem_size, sizeof(ferry_serve_client));
    ferry_serve *s = (ferry_serve *)cs; /* its mutex is taken, nothing written */
    size_t n = 0;
    pthread_mutex_lock(&s->mu);
    for (ferry__srv_conn *c = s->conns; c; c = c->next) {
        if (c->retired) /* (its client hung up, or its thread ended) */
            continue;
        if (n < max) {
            ferry_serve_client m = {(int32_t)c->pid, (uint32_t)c->uid, atomic_load(&c->waits),
                                    atomic_load(&c->wait_ns_total), atomic_load(&c->declines)};
            memcpy((char *)out + n * elem_size, &m, elem_size);
        }
        n++;
    }
    pthread_mutex_unlock(&s->mu);
    return (int)FERRY__MIN(n, (size_t)INT32_MAX);
}
