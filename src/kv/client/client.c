/*
 * client.c - the server client's connection (kvc.h): connect, HELLO (the
 * geometry checked both ways, the pool's memfd received with SCM_RIGHTS
 * and mapped), and round trips with a deadline. Nothing the daemon sends
 * is trusted: lengths are bounded, the pool's size is checked against the
 * file, and a reply that is not the one asked for closes the connection.
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "kv/kv_impl.h"
#include "kv/client/kvc.h"

#define TIMEOUT_MS_DEFAULT 2000u

/* the connection ends here: a forked child holds a copy of the socket (a
 * worker living on), which alone would keep it open, and the daemon would
 * serve it, pins and all, until the child ended; shutdown ends it for
 * every copy. Only the process that connected ends it (a child dropping
 * its copy of its parent's would cut the parent's). */
void ferry__kvc_drop(ferry__kvc *c)
{
    if (c->fd >= 0 && c->fd_pid == (long)getpid())
        (void)shutdown(c->fd, SHUT_RDWR);
    if (c->fd >= 0)
        close(c->fd);
    c->fd = -1;
    if (c->pool_dev) /* registered with the store's device: unregister first */
        (void)ferry_device_unpin(c->pool_dev, c->pool);
    c->pool_dev = NULL;
    if (c->pool)
        munmap(c->pool, c->pool_bytes);
    c->pool = NULL;
    c->pool_bytes = 0;
    c->npins = 0; /* the daemon let go of them with the connection */
}

static int lost(ferry_kv *kv, ferry__kvc *c, const char *fmt, const char *what)
{
    ferry__kvc_drop(c);
    return ferry__kv_err(kv, FERRY_ECONN, "kv server %s: %s: %s", c->path, fmt, what);
}

/* wait until fd is ready for ev or the deadline passed: 0, or a code
 * (-ECANCELED: the store's close began, wake is readable) */
static int wait_fd(int fd, int wake, short ev, uint64_t deadline)
{
    for (;;) {
        uint64_t now = ferry__now_ns();
        if (now >= deadline)
            return -ETIMEDOUT;
        struct pollfd p[2] = {{fd, ev, 0}, {wake, POLLIN, 0}};
        int ms = (int)((deadline - now + 999999) / 1000000);
        int r = poll(p, wake >= 0 ? 2 : 1, ms);
        if (r > 0 && wake >= 0 && p[1].revents)
            return -ECANCELED;
        if (r > 0)
            return (p[0].revents & (ev | POLLHUP | POLLERR)) ? 0 : -EIO;
        if (r < 0 && errno != EINTR)
            return -errno;
    }
}

void ferry__kvc_close_begin(ferry_kv *kv)
{
    ferry__kvc *c = kv->be_impl;
    uint64_t one = 1;
    if (c && c->wake >= 0 && write(c->wake, &one, sizeof one) != (ssize_t)sizeof one)
        FERRY_LOGW("kv server %s: close_begin: waking the calls inside: %s", c->path,
                   strerror(errno)); /* (only at 2^64 - 2 writes: readable already) */
}

/* a wait for a slot cut short by the store's close: the connection goes
 * (the daemon lets go of what it held); -ECANCELED with a message */
static int closing(ferry_kv *kv, ferry__kvc *c, const char *fmt)
{
    ferry__kvc_drop(c);
    return ferry__kv_err(kv, -ECANCELED,
                         "kv server %s: %s: the store is closing (ferry_kv_close_begin): the "
                         "request is abandoned and its connection closed", c->path, fmt);
}

static int send_all(ferry__kvc *c, const uint8_t *p, size_t n, uint64_t deadline)
{
    while (n) {
        ssize_t w = send(c->fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w > 0) {
            p += w;
            n -= (size_t)w;
            continue;
        }
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            int r = wait_fd(c->fd, -1, POLLOUT, deadline);
            if (r < 0)
                return r;
            continue;
        }
        return w < 0 ? -errno : -EPIPE;
    }
    return 0;
}

/* read n bytes; an fd passed with them lands in *fd (when fd is not NULL
 * and none came yet; any other is closed) */
static int recv_all(ferry__kvc *c, uint8_t *p, size_t n, uint64_t deadline, int *fd)
{
    while (n) {
        union {
            struct cmsghdr h;
            char b[CMSG_SPACE(sizeof(int) * 4)];
        } ctl;
        struct iovec iov = {p, n};
        struct msghdr m = {0};
        m.msg_iov = &iov;
        m.msg_iovlen = 1;
        m.msg_control = ctl.b;
        m.msg_controllen = sizeof ctl.b;
        ssize_t r = recvmsg(c->fd, &m, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
        for (struct cmsghdr *h = r >= 0 ? CMSG_FIRSTHDR(&m) : NULL; h; h = CMSG_NXTHDR(&m, h)) {
            if (h->cmsg_level != SOL_SOCKET || h->cmsg_type != SCM_RIGHTS)
                continue;
            size_t k = (h->cmsg_len - CMSG_LEN(0)) / sizeof(int);
            for (size_t i = 0; i < k; i++) {
                int got;
                memcpy(&got, CMSG_DATA(h) + i * sizeof(int), sizeof got);
                if (fd && *fd < 0)
                    *fd = got;
                else
                    close(got);
            }
        }
        if (r > 0) {
            p += r;
            n -= (size_t)r;
            continue;
        }
        if (r == 0)
            return -ECONNRESET;
        if (errno == EINTR)
            continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            int w = wait_fd(c->fd, c->cut ? c->wake : -1, POLLIN, deadline);
            if (w < 0)
                return w;
            continue;
        }
        return -errno;
    }
    return 0;
}

/* read one reply frame into c->in; 0 and *h, or a code */
static int read_reply(ferry_kv *kv, ferry__kvc *c, ferry__proto_hdr *h, uint64_t deadline,
                      int *fd)
{
    uint8_t hb[FERRY__PROTO_HDR];
    int r = recv_all(c, hb, sizeof hb, deadline, fd);
    if (r == -ECANCELED)
        return closing(kv, c, "waiting for an L1 slot");
    if (r < 0)
        return lost(kv, c, "reading a reply", r == -ETIMEDOUT ? "no answer within the timeout"
                                                               : ferry_strerror(r));
    char why[160];
    r = ferry__proto_hdr_decode(hb, sizeof hb, h, why, sizeof why);
    if (r < 0)
        return lost(kv, c, "a reply that is not one", why);
    if (h->len > c->in_cap) {
        uint8_t *n = ferry__realloc(c->in, h->len);
        if (!n) {
            ferry__kvc_drop(c);
            return ferry__kv_err(kv, -ENOMEM, "kv server: out of memory for a reply of %u bytes",
                                 h->len);
        }
        c->in = n;
        c->in_cap = h->len;
    }
    r = recv_all(c, c->in, h->len, deadline, fd);
    if (r == -ECANCELED)
        return closing(kv, c, "reading a reply's payload");
    if (r < 0)
        return lost(kv, c, "reading a reply's payload",
                    r == -ETIMEDOUT ? "no answer within the timeout" : ferry_strerror(r));
    return 0;
}

/* a round trip's deadline: the timeout, and the wait for a pool slot the
 * daemon may make on this client's behalf */
static uint64_t deadline_of(const ferry__kvc *c)
{
    return ferry__now_ns() + ((uint64_t)c->timeout_ms + c->wait_ms) * 1000000u;
}

/* an ERROR reply in c->in that ends the connection (request id 0: the
 * daemon refused it at accept, past max_clients or a uid it does not
 * allow, or a frame it could not read): its code and message, the
 * connection closed */
static int refused(ferry_kv *kv, ferry__kvc *c, const ferry__proto_hdr *h)
{
    ferry__proto_rd rd = {c->in, c->in + h->len, 0};
    char msg[FERRY__PROTO_MAX_MSG + 1];
    int32_t rc = ferry__proto_reply_head(&rd, msg, sizeof msg);
    if (rd.err || rc >= 0)
        return lost(kv, c, "a malformed reply", ferry__proto_type_name(h->type));
    ferry__kvc_drop(c);
    return ferry__kv_err(kv, rc, "kv server %s: %s", c->path, msg);
}

/* the daemon closed before this client's request went out: the ERROR it
 * said why in, when one waits unread (0 and *h), else -1 */
static int pending_refusal(ferry__kvc *c, ferry__proto_hdr *h)
{
    uint8_t hb[FERRY__PROTO_HDR];
    char why[160];
    uint64_t now = ferry__now_ns(); /* (no wait: it is there or it is not) */
    if (recv_all(c, hb, sizeof hb, now, NULL) < 0 ||
        ferry__proto_hdr_decode(hb, sizeof hb, h, why, sizeof why) < 0 ||
        h->type != (FERRY__P_ERROR | FERRY__PROTO_REPLY) || h->rid != 0)
        return -1;
    if (h->len > c->in_cap) {
        uint8_t *n = ferry__realloc(c->in, h->len);
        if (!n)
            return -1;
        c->in = n;
        c->in_cap = h->len;
    }
    return recv_all(c, c->in, h->len, now, NULL) < 0 ? -1 : 0;
}

/* send c->out (a whole frame): 0, or a code (connection closed) */
static int send_out(ferry_kv *kv, ferry__kvc *c, uint64_t deadline)
{
    int r = send_all(c, c->out.p, c->out.len, deadline);
    ferry__proto_hdr h;
    if (r < 0 && r != -ETIMEDOUT && pending_refusal(c, &h) == 0)
        return refused(kv, c, &h);
    if (r < 0)
        return lost(kv, c, "sending a request", r == -ETIMEDOUT ? "the daemon reads nothing"
                                                                 : ferry_strerror(r));
    return 0;
}

/* read the reply to request rid of the given type: 0 and *h, or a code
 * (connection closed: a reply to anything else is out of step) */
static int recv_reply(ferry_kv *kv, ferry__kvc *c, uint8_t type, uint64_t rid,
                      ferry__proto_hdr *h, int *fd, uint64_t deadline)
{
    /* the replies the daemon may hold back up to the client's pool_wait_ms,
     * waiting for a slot: the store's close cuts those waits short */
    c->cut = type == FERRY__P_RESERVE || type == FERRY__P_ACQUIRE;
    int r = read_reply(kv, c, h, deadline, fd);
    c->cut = 0;
    if (r < 0)
        return r;
    /* the daemon refused the frame: its code and message follow */
    if (h->type == (FERRY__P_ERROR | FERRY__PROTO_REPLY) && h->rid == rid)
        return 0;
    /* (rid 0, a request id no client uses) it refused the connection, at
     * accept (past max_clients, a uid it does not allow) or for a frame it
     * could not read, and closed it (docs/PROTOCOL.md): its code and
     * message, not a confusion of request ids */
    if (h->type == (FERRY__P_ERROR | FERRY__PROTO_REPLY) && h->rid == 0)
        return refused(kv, c, h);
    if (h->rid != rid || h->type != (type | FERRY__PROTO_REPLY)) {
        char why[96];
        snprintf(why, sizeof why, "reply %s to request %llu (asked %s, request %llu)",
                 ferry__proto_type_name(h->type), (unsigned long long)h->rid,
                 ferry__proto_type_name(type), (unsigned long long)rid);
        return lost(kv, c, "out of step", why);
    }
    return 0;
}

/* send c->out and read its reply: 0 and *h, or a code (connection closed) */
static int exchange(ferry_kv *kv, ferry__kvc *c, ferry__proto_hdr *h, int *fd)
{
    uint64_t deadline = deadline_of(c);
    uint8_t type = c->out.p[2];
    int r = send_out(kv, c, deadline);
    return r < 0 ? r : recv_reply(kv, c, type, c->rid, h, fd, deadline);
}

/* *rd over a reply's payload after its head; *rc its head's code */
static int reply_head(ferry_kv *kv, ferry__kvc *c, const ferry__proto_hdr *h,
                      ferry__proto_rd *rd, int32_t *rc)
{
    rd->p = c->in;
    rd->end = c->in + h->len;
    rd->err = 0;
    char msg[FERRY__PROTO_MAX_MSG + 1];
    *rc = ferry__proto_reply_head(rd, msg, sizeof msg);
    if (rd->err)
        return lost(kv, c, "a malformed reply", ferry__proto_type_name(h->type));
    if (*rc < 0)
        ferry__kv_err(kv, *rc, "kv server %s: %s", c->path, msg);
    return 0;
}

int ferry__kvc_send(ferry_kv *kv, ferry__kvc *c)
{
    return send_out(kv, c, deadline_of(c));
}

int ferry__kvc_recv(ferry_kv *kv, ferry__kvc *c, int type, uint64_t rid, ferry__proto_rd *rd,
                    int32_t *rc)
{
    ferry__proto_hdr h;
    int r = recv_reply(kv, c, (uint8_t)type, rid, &h, NULL, deadline_of(c));
    return r < 0 ? r : reply_head(kv, c, &h, rd, rc);
}

int ferry__kvc_roundtrip(ferry_kv *kv, ferry__kvc *c, ferry__proto_rd *rd, int32_t *rc)
{
    ferry__proto_hdr h;
    int r = exchange(kv, c, &h, NULL);
    return r < 0 ? r : reply_head(kv, c, &h, rd, rc);
}

int ferry__kvc_chunks(ferry_kv *kv, ferry__kvc *c, size_t n)
{
    if (n <= c->ch_cap)
        return 0;
    ferry__proto_chunk *p = ferry__realloc(c->ch, n * sizeof *p);
    if (!p)
        return ferry__kv_err(kv, -ENOMEM, "kv server: out of memory for %zu chunks", n);
    c->ch = p;
    c->ch_cap = n;
    return 0;
}

static int geometry_ok(ferry_kv *kv, ferry__kvc *c, const ferry__proto_hello *g)
{
    const ferry_kv_layout *l = &kv->layout;
    if (g->layout.num_layers != l->num_layers || g->layout.kv != l->kv ||
        g->layout.num_heads != l->num_heads || g->layout.head_dim != l->head_dim ||
        g->layout.dtype != l->dtype || g->chunk_tokens != kv->chunk_tokens ||
        g->seed != kv->seed || g->chunk_bytes != kv->chunk_bytes)
        return ferry__kv_err(kv, FERRY_EMISMATCH,
                             "kv server %s serves layers %u kv %u heads %u head_dim %u dtype %d, "
                             "%u tokens a chunk, seed %#llx; this store has %u %u %u %u %d, %u, "
                             "%#llx",
                             c->path, g->layout.num_layers, g->layout.kv, g->layout.num_heads,
                             g->layout.head_dim, g->layout.dtype, g->chunk_tokens,
                             (unsigned long long)g->seed, l->num_layers, l->kv, l->num_heads,
                             l->head_dim, l->dtype, kv->chunk_tokens,
                             (unsigned long long)kv->seed);
    return 0;
}

/* map the pool the daemon handed over, its size checked against the file */
static int map_pool(ferry_kv *kv, ferry__kvc *c, const ferry__proto_hello *g, int fd)
{
    struct stat st;
    if (g->slot_bytes < kv->chunk_bytes || !g->nslots || g->nslots > g->pool_bytes / g->slot_bytes ||
        fstat(fd, &st) != 0 || (uint64_t)st.st_size < g->pool_bytes)
        return lost(kv, c, "HELLO", "the pool handed over does not hold the slots it claims");
    /* the page tables filled now, not one fault per 4 KiB inside the first
     * stores and retrieves (the daemon faulted the pages in already) */
    void *m = mmap(NULL, (size_t)g->pool_bytes, PROT_READ | PROT_WRITE,
                   MAP_SHARED | MAP_POPULATE, fd, 0);
    if (m == MAP_FAILED)
        return ferry__kv_err(kv, -errno, "kv server %s: mapping its pool of %llu bytes: %s",
                             c->path, (unsigned long long)g->pool_bytes, strerror(errno));
    c->pool = m;
    c->pool_bytes = (size_t)g->pool_bytes;
    atomic_store(&kv->lw_keep, g->pool_bytes);
    /* with a device, the mapping is registered with it (page-locked, as an
     * in-process L1 is pinned), so device buffers move by DMA straight
     * between the engine's memory and the slots; refused (a locked-memory
     * limit), copies still work, through the driver's own staging */
    if (kv->dev) {
        int r = ferry_device_pin(kv->dev, m, c->pool_bytes);
        if (r == 0)
            c->pool_dev = kv->dev;
        else
            FERRY_LOGW("kv server %s: registering its pool (%zu bytes) with device %s: %s; "
                       "device copies go unregistered", c->path, c->pool_bytes,
                       ferry_device_name(kv->dev), ferry_strerror(r));
    }
    c->slot_bytes = g->slot_bytes;
    c->nslots = g->nslots;
    return 0;
}

static int hello(ferry_kv *kv, ferry__kvc *c)
{
    ferry__proto_req q;
    memset(&q, 0, sizeof q);
    q.hdr.type = FERRY__P_HELLO;
    q.hdr.rid = ++c->rid;
    q.hello.layout = kv->layout;
    q.hello.chunk_tokens = kv->chunk_tokens;
    q.hello.seed = kv->seed;
    q.hello.flags = c->want_pool ? 0 : FERRY__HELLO_NO_POOL;
    if (ferry__proto_req_encode(&c->out, &q) < 0)
        return ferry__kv_err(kv, -ENOMEM, "kv server: out of memory for HELLO");
    ferry__proto_hdr h;
    int fd = -1;
    int r = exchange(kv, c, &h, &fd);
    if (r < 0) {
        if (fd >= 0)
            close(fd);
        return r;
    }
    ferry__proto_rd rd = {c->in, c->in + h.len, 0};
    char msg[FERRY__PROTO_MAX_MSG + 1];
    int32_t rc = ferry__proto_reply_head(&rd, msg, sizeof msg);
    ferry__proto_hello g;
    memset(&g, 0, sizeof g);
    if (rc >= 0 && !rd.err) {
        g.layout.num_layers = ferry__proto_get_u32(&rd);
        g.layout.kv = ferry__proto_get_u32(&rd);
        g.layout.num_heads = ferry__proto_get_u32(&rd);
        g.layout.head_dim = ferry__proto_get_u32(&rd);
        g.layout.dtype = (int)ferry__proto_get_u32(&rd);
        g.chunk_tokens = ferry__proto_get_u32(&rd);
        g.seed = ferry__proto_get_u64(&rd);
        g.flags = ferry__proto_get_u32(&rd);
        g.chunk_bytes = ferry__proto_get_u64(&rd);
        g.slot_bytes = ferry__proto_get_u64(&rd);
        g.nslots = ferry__proto_get_u64(&rd);
        g.pool_bytes = ferry__proto_get_u64(&rd);
    }
    if (rd.err || rd.p != rd.end)
        r = lost(kv, c, "HELLO", "a malformed reply");
    else if (rc < 0) {
        ferry__kvc_drop(c);
        r = ferry__kv_err(kv, rc, "kv server %s refused this client: %s", c->path, msg);
    } else if ((r = geometry_ok(kv, c, &g)) < 0)
        ferry__kvc_drop(c);
    else if (c->want_pool && fd < 0)
        r = lost(kv, c, "HELLO", "no pool was handed over");
    else if (c->want_pool && (r = map_pool(kv, c, &g, fd)) < 0)
        ferry__kvc_drop(c);
    if (fd >= 0)
        close(fd);
    return r;
}

/* under c->mu: WAIT, this client's pool_wait_ms (a daemon without it
 * answers ENOTSUP: it uses its own) */
static int send_wait(ferry_kv *kv, ferry__kvc *c)
{
    ferry__proto_req q;
    memset(&q, 0, sizeof q);
    q.hdr.type = FERRY__P_WAIT;
    q.hdr.rid = ++c->rid;
    q.tokens = c->wait_ms;
    if (ferry__proto_req_encode(&c->out, &q) < 0)
        return ferry__kv_err(kv, -ENOMEM, "kv server: out of memory for WAIT");
    ferry__proto_rd rd;
    int32_t rc;
    int r = ferry__kvc_roundtrip(kv, c, &rd, &rc);
    if (r == 0 && rc == FERRY_ENOTSUP)
        c->no_why = 1;
    return r;
}

int ferry__kvc_why(ferry_kv *kv, ferry__kvc *c, int code)
{
    if (c->fd < 0 || c->no_why)
        return code;
    ferry__proto_req q;
    memset(&q, 0, sizeof q);
    q.hdr.type = FERRY__P_WHY;
    q.hdr.rid = ++c->rid;
    if (ferry__proto_req_encode(&c->out, &q) < 0)
        return code;
    ferry__proto_rd rd;
    int32_t rc = 0;
    int r = ferry__kvc_roundtrip(kv, c, &rd, &rc); /* rc < 0: its message is on the store */
    if (r == 0 && rc == FERRY_ENOTSUP)
        c->no_why = 1;
    if (r < 0) { /* (the message names the asking's failure: say what was answered first) */
        char lost[FERRY__ERRMSG_MAX];
        snprintf(lost, sizeof lost, "%s", ferry_kv_last_error(kv));
        ferry__kv_err(kv, code,
                      "kv server %s: the daemon answered %s (%s) and could not say why (it may "
                      "be closing): %s",
                      c->path, ferry_err_name(code), ferry_strerror(code), lost);
    }
    return code;
}

int ferry__kvc_ensure(ferry_kv *kv, ferry__kvc *c)
{
    if (c->fd >= 0)
        return 0;
    if (atomic_load_explicit(&kv->close_begun, memory_order_acquire))
        return ferry__kv_err(kv, -ECANCELED,
                             "kv server %s: the store is closing (ferry_kv_close_begin): not "
                             "connecting again", c->path);
    struct sockaddr_un a;
    memset(&a, 0, sizeof a);
    a.sun_family = AF_UNIX;
    if (strlen(c->path) >= sizeof a.sun_path)
        return ferry__kv_err(kv, -ENAMETOOLONG, "kv server %s: socket path too long (%zu max)",
                             c->path, sizeof a.sun_path - 1);
    memcpy(a.sun_path, c->path, strlen(c->path) + 1);
    c->fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    c->fd_pid = (long)getpid();
    if (c->fd < 0)
        return ferry__kv_err(kv, -errno, "kv server %s: socket: %s", c->path, strerror(errno));
    /* a listener whose queue is full (a daemon that stopped accepting) is
     * EAGAIN to a non-blocking connect: retried until the deadline, never
     * waited on forever */
    uint64_t dl = ferry__now_ns() + (uint64_t)c->timeout_ms * 1000000u;
    int e = 0;
    while (connect(c->fd, (struct sockaddr *)&a, sizeof a) != 0) {
        e = errno;
        if (e == EINTR)
            continue;
        if (e == EINPROGRESS) { /* (not for Unix sockets today; handled all the same) */
            struct pollfd p = {c->fd, POLLOUT, 0};
            socklen_t len = sizeof e;
            uint64_t now = ferry__now_ns();
            int ms = now < dl ? (int)((dl - now) / 1000000u) + 1 : 0;
            e = poll(&p, 1, ms) == 1 && getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &e, &len) == 0
                    ? e
                    : ETIMEDOUT;
            break;
        }
        if (e != EAGAIN || ferry__now_ns() >= dl)
            break;
        struct timespec ts = {0, 2000000}; /* 2 ms */
        nanosleep(&ts, NULL);
        e = 0;
    }
    if (e == 0 && fcntl(c->fd, F_SETFL, fcntl(c->fd, F_GETFL) & ~O_NONBLOCK) != 0)
        e = errno;
    if (e) {
        ferry__kvc_drop(c);
        return ferry__kv_err(kv, FERRY_ECONN, "kv server %s: connect: %s%s", c->path,
                             strerror(e == EAGAIN ? ETIMEDOUT : e),
                             e == EAGAIN ? " (its listen queue stayed full)" : "");
    }
    int r = hello(kv, c);
    c->no_why = 0;
    if (r == 0 && c->want_pool)
        r = send_wait(kv, c);
    if (r == 0) {
        c->connects++;
        c->no_prefetch = 0;
        FERRY_LOGD("kv server %s: connected (%llu)", c->path, (unsigned long long)c->connects);
    }
    return r;
}

int ferry__kvc_workers(ferry_kv *kv)
{
    ferry__kvc *c = kv->be_impl;
    int rc = 0;
    pthread_mutex_lock(&c->wmu);
    if (!c->workers_on && (rc = ferry__kv_workers_start(kv, c->nworkers)) == 0)
        c->workers_on = 1;
    pthread_mutex_unlock(&c->wmu);
    return rc;
}

int ferry__kvc_open(ferry_kv *kv, const ferry_kv_config *cfg)
{
    ferry__kvc *c = ferry__calloc(1, sizeof *c);
    if (!c)
        return ferry__err_set(NULL, -ENOMEM, "kv open: out of memory for the server client");
    pthread_mutex_init(&c->mu, NULL);
    pthread_mutex_init(&c->wmu, NULL);
    c->nworkers = cfg->workers ? cfg->workers : 1;
    c->fd = -1;
    c->wake = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    c->own_wake = 1;
    if (c->wake < 0) {
        kv->be_impl = c;
        return ferry__err_set(NULL, -errno, "kv open: eventfd for the server client: %s",
                              strerror(errno));
    }
    /* PATH, unix:PATH or unix:///PATH: a Unix socket, nothing else */
    const char *s = cfg->server;
    if (!strncmp(s, "unix://", 7) && s[7] == '/')
        s += 7;
    else if (!strncmp(s, "unix:", 5) && strncmp(s, "unix://", 7))
        s += 5;
    else if (strstr(s, "://")) {
        kv->be_impl = c;
        return ferry__err_set(NULL, -EINVAL,
                              "kv open: server \"%s\" is not a Unix socket (PATH, unix:PATH or "
                              "unix:///PATH; the daemon listens on no network address)",
                              cfg->server);
    }
    c->path = ferry__strdup(s);
    c->timeout_ms = cfg->server_timeout_ms ? cfg->server_timeout_ms : TIMEOUT_MS_DEFAULT;
    c->wait_ms = (uint32_t)cfg->pool_wait_ms;
    c->want_pool = cfg->l1_bytes != 0;
    kv->be_impl = c;
    if (!c->path)
        return ferry__err_set(NULL, -ENOMEM, "kv open: out of memory for the server client");
    if (!*c->path)
        return ferry__err_set(NULL, -EINVAL, "kv open: server \"%s\" names no socket",
                              cfg->server);
    int r = ferry__kvc_ensure(kv, c);
    if (r < 0)
        return ferry__err_pass(NULL, r);
    return 0;
}

static void kvc_free(ferry__kvc *c)
{
    ferry__kvc_drop(c);
    ferry__proto_buf_free(&c->out);
    ferry__free(c->in);
    ferry__free(c->ch);
    ferry__free(c->pins);
    ferry__free(c->path);
    if (c->own_wake && c->wake >= 0)
        close(c->wake);
    pthread_mutex_destroy(&c->mu);
    pthread_mutex_destroy(&c->wmu);
    ferry__free(c);
}

void ferry__kvc_close(ferry_kv *kv)
{
    ferry__kvc *c = kv->be_impl;
    if (!c)
        return;
    while (c->idle) {
        ferry__kvc *x = c->idle;
        c->idle = x->idle_next;
        kvc_free(x);
    }
    kvc_free(c);
    kv->be_impl = NULL;
}

/* layerwise operations' connections kept idle at most */
#define IDLE_MAX 4u

ferry__kvc *ferry__kvc_lease(ferry_kv *kv, int *rc)
{
    ferry__kvc *m = kv->be_impl, *c;
    pthread_mutex_lock(&m->wmu);
    c = m->idle;
    if (c) {
        m->idle = c->idle_next;
        m->nidle--;
    }
    pthread_mutex_unlock(&m->wmu);
    if (!c) {
        c = ferry__calloc(1, sizeof *c);
        if (!c || !(c->path = ferry__strdup(m->path))) {
            ferry__free(c);
            *rc = ferry__kv_err(kv, -ENOMEM, "kv server: out of memory for a connection");
            return NULL;
        }
        pthread_mutex_init(&c->mu, NULL);
        pthread_mutex_init(&c->wmu, NULL);
        c->fd = -1;
        c->wake = m->wake;
        c->timeout_ms = m->timeout_ms;
        c->wait_ms = m->wait_ms;
        c->want_pool = m->want_pool;
    }
    c->idle_next = NULL;
    if ((*rc = ferry__kvc_ensure(kv, c)) < 0) {
        kvc_free(c);
        return NULL;
    }
    return c;
}

void ferry__kvc_unlease(ferry_kv *kv, ferry__kvc *c)
{
    ferry__kvc *m = kv->be_impl;
    pthread_mutex_lock(&m->wmu);
    int keep = c->fd >= 0 && m->nidle < IDLE_MAX;
    if (keep) {
        c->idle_next = m->idle;
        m->idle = c;
        m->nidle++;
    }
    pthread_mutex_unlock(&m->wmu);
    if (!keep)
        kvc_free(c);
}
