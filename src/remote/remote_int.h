/*
 * remote_int.h - private pieces of the Redis/Valkey client (src/remote/).
 *
 *  remote_url.c      strict URL parser (fuzzed: fuzz/fuzz_remote_url.c)
 *  remote_value.c    value header codec (fuzzed: fuzz/fuzz_remote_value.c)
 *  remote_conn.c     one hiredis connection: connect with timeouts, AUTH,
 *                    SELECT/PING, pipelined exchange under one deadline,
 *                    the reply framer (fuzz/fuzz_remote_frame.c), hiredis
 *                    error -> code
 *  remote_single.c   topology backend: one server
 *  remote_cluster.c  topology backend: Redis Cluster (slot map, MOVED/ASK)
 *  remote.c          the handle: connection pool, health/backoff, writer
 *                    thread and queue, the public API, metrics
 *
 * A "session" is one topology instance (its connections and, for a
 * cluster, its own slot map) used by one thread at a time; the handle keeps
 * a pool of them. Topology backends sit behind ferry__rtopo_ops.
 */
#ifndef FERRY_REMOTE_REMOTE_INT_H
#define FERRY_REMOTE_REMOTE_INT_H

#include <stddef.h>
#include <stdint.h>

#include "core.h"
#include "ferry/remote.h"

/* ---- URL ---- */
enum { FERRY__RURL_HOST_MAX = 256, FERRY__RURL_PATH_MAX = 108, FERRY__RURL_CRED_MAX = 256 };
enum ferry__rurl_cluster { FERRY__RCLUSTER_AUTO = -1, FERRY__RCLUSTER_NO = 0, FERRY__RCLUSTER_YES = 1 };

typedef struct ferry__rurl {
    int is_unix;                            /* 1: path, else host:port */
    char host[FERRY__RURL_HOST_MAX];        /* without [] for IPv6 */
    int port;                               /* 1..65535 */
    char path[FERRY__RURL_PATH_MAX];        /* unix socket path */
    int has_user, has_password;
    char user[FERRY__RURL_CRED_MAX];        /* decoded */
    char password[FERRY__RURL_CRED_MAX];    /* decoded */
    int db;                                 /* 0..(1<<24) */
    int cluster;                            /* enum ferry__rurl_cluster */
    char redacted[1024];                    /* the URL with the password as *** */
} ferry__rurl;

/* Parse url[0..len) (need not be NUL-terminated; an embedded NUL is an
 * error). Returns 0, FERRY_EPARSE or FERRY_ENOTSUP with a message in eb. */
int ferry__rurl_parse(const char *url, size_t len, ferry__rurl *out, ferry__errbuf *eb);

/* ---- value codec ---- */
#define FERRY__RVALUE_MAGIC "FRYV"
#define FERRY__RVALUE_VERSION 1u

typedef struct ferry__rvalue_hdr {
    uint16_t version;
    uint16_t header_len;      /* FERRY_REMOTE_HEADER_FIXED + layout_len */
    uint32_t flags;
    uint32_t layout_len;
    uint64_t payload_len;
    uint64_t payload_sum;     /* XXH3-64 of the payload */
    uint64_t key_sum;         /* XXH3-64 of the caller's key */
    const uint8_t *layout;    /* points into the parsed buffer */
} ferry__rvalue_hdr;

size_t ferry__rvalue_header_size(size_t layout_len);
/* Write the header for payload[0..len) into dst (header_size bytes). */
void ferry__rvalue_encode_header(void *dst, const void *layout, size_t layout_len,
                                 uint64_t key_sum, const void *payload, size_t len);
/* Parse and check a header from buf[0..len) (len may be just the header:
 * the payload is not looked at). 0 or FERRY_ECORRUPT/FERRY_EVERSION. */
int ferry__rvalue_parse_header(const void *buf, size_t len, ferry__rvalue_hdr *h,
                               ferry__errbuf *eb);
/* Check a header against what the reader expects: layout bytes and key
 * hash. 0 or FERRY_EMISMATCH. */
int ferry__rvalue_match(const ferry__rvalue_hdr *h, const void *layout, size_t layout_len,
                        uint64_t key_sum, ferry__errbuf *eb);
/* Full decode: header, total length, expected layout/key, payload checksum.
 * On success *payload points into buf. */
int ferry__rvalue_decode(const void *buf, size_t len, const void *layout, size_t layout_len,
                         uint64_t key_sum, const void **payload, size_t *payload_len,
                         ferry__errbuf *eb);
uint64_t ferry__rvalue_key_sum(const void *key, size_t len);

/* ---- commands and connections ---- */
struct redisContext;
struct redisReply;

/* Bounds on a reply, checked by ferry__rframe before a byte of it is
 * handed to hiredis: a server (hostile, broken, or a wrong port) cannot
 * make the client buffer more than this per command. */
enum {
    FERRY__RREPLY_SMALL = 64 * 1024,   /* reply_max 0: status, integer, error,
                                          a GETRANGE of a value header */
    FERRY__RREPLY_SLOTS = 8 << 20,     /* CLUSTER SLOTS */
    FERRY__RREPLY_SLOTS_ELEMS = 1 << 19,
    FERRY__RREPLY_DEPTH = 7,           /* nested arrays (hiredis's own limit) */
    FERRY__RREPLY_ENVELOPE = 64        /* "$<len>\r\n" + "\r\n" around a bulk */
};

#define FERRY__RCMD_ARGS 6
typedef struct ferry__rcmd {
    int argc;
    const char *argv[FERRY__RCMD_ARGS];
    size_t argvlen[FERRY__RCMD_ARGS];
    int key_arg;                /* index of the key in argv (cluster routing); -1 none */
    size_t reply_max;           /* bytes the reply may have; 0: FERRY__RREPLY_SMALL */
    uint32_t reply_elems;       /* array elements it may have in all; 0: no array */
    struct redisReply *reply;   /* out; freed with ferry__rcmd_release */
} ferry__rcmd;
void ferry__rcmd_release(ferry__rcmd *cmds, size_t n);
/* What a reply is, for a message ("integer -7", "status QUEUED", "nil"...) */
const char *ferry__rreply_desc(const struct redisReply *rep, char *buf, size_t cap);
/* 1 when a SET was acknowledged: the status reply +OK, nothing else */
int ferry__rreply_is_ok(const struct redisReply *rep);

/* An incremental RESP2 scanner that frames one reply at a time within its
 * bounds (fuzzed: fuzz/fuzz_remote_frame.c). */
typedef struct ferry__rframe {
    uint64_t max, used;      /* bytes the reply may have / has had so far */
    uint64_t elems_max, elems;
    uint64_t bulk_left;      /* payload bytes of the bulk being skipped */
    uint64_t stack[FERRY__RREPLY_DEPTH]; /* elements not yet started, per open array */
    int depth, state, cr;
    unsigned nlen;
    char type, num[24];
} ferry__rframe;
/* Start framing a reply of at most max bytes (0: FERRY__RREPLY_SMALL) and
 * elems array elements in all (0: none). */
void ferry__rframe_start(ferry__rframe *f, size_t max, uint32_t elems);
/* Scan buf[0..len) of the reply stream. Returns 1 when the reply ends in
 * it (*took: the bytes up to its end), 0 when all of buf belongs to it,
 * -EPROTO (not RESP2, or nested deeper than FERRY__RREPLY_DEPTH) or
 * -EMSGSIZE (over a bound, found from its header where it can be: a bulk
 * or array length that cannot fit is refused before its bytes arrive);
 * what (whatlen bytes) then says why. */
int ferry__rframe_scan(ferry__rframe *f, const void *buf, size_t len, size_t *took, char *what,
                       size_t whatlen);

typedef struct ferry__rconf {
    const ferry__rurl *url;
    uint32_t connect_timeout_ms, command_timeout_ms;
} ferry__rconf;

typedef struct ferry__rconn {
    struct redisContext *c;
    char host[FERRY__RURL_HOST_MAX];
    int port;
    uint32_t timeout_ms; /* command timeout, for messages */
} ferry__rconn;

/* The deadline (ferry__now_ns, CLOCK_MONOTONIC) of a call that moves
 * bytes bytes: now + timeout_ms + FERRY__RDEADLINE_NS_PER_BYTE per byte,
 * so a large value on a slow link has time to cross (a floor of ~60 MB/s)
 * while a stalled or dripping server fails after about timeout_ms. */
#define FERRY__RDEADLINE_NS_PER_BYTE 16u
uint64_t ferry__rdeadline(uint32_t timeout_ms, uint64_t bytes);

/* Connect to host:port (or the URL's unix path when host is NULL), set
 * timeouts, AUTH, SELECT (when select_db), or PING when neither was sent
 * so that a server that wants a password says so now (NOAUTH). Each
 * handshake command has its own command_timeout_ms deadline. Transport
 * codes or FERRY_EREMOTE (quoting the server, never the password). */
int ferry__rconn_open(ferry__rconn *c, const ferry__rconf *cf, const char *host, int port,
                      int select_db, ferry__errbuf *eb);
void ferry__rconn_close(ferry__rconn *c);
/* Send cmds (pointers) in one pipeline, read every reply into cmd->reply,
 * each framed within its bounds (reply_max, reply_elems) before hiredis
 * sees it, all before deadline_ns (0: now + the command timeout).
 * Returns 0 when every reply arrived (some may be error replies), else a
 * transport code (-ETIMEDOUT past the deadline, -EMSGSIZE/-EPROTO for a
 * reply out of bounds or not RESP2); the connection is then closed. */
int ferry__rconn_exchange(ferry__rconn *c, ferry__rcmd **cmds, size_t n, uint64_t deadline_ns,
                          ferry__errbuf *eb);
/* The two halves of an exchange, so that several connections can have
 * their pipelines in flight at once: send writes every command out, recv
 * reads their replies. Same failure rules. */
int ferry__rconn_send(ferry__rconn *c, ferry__rcmd **cmds, size_t n, uint64_t deadline_ns,
                      ferry__errbuf *eb);
int ferry__rconn_recv(ferry__rconn *c, ferry__rcmd **cmds, size_t n, uint64_t deadline_ns,
                      ferry__errbuf *eb);
/* GET straight into the caller's memory (no hiredis reply object, no
 * intermediate copies): the value header is read and checked first, then
 * the payload lands in dst and its checksum is verified there. */
enum { FERRY__RGET_VALUE = 1, FERRY__RGET_NIL = 2, FERRY__RGET_ERROR = 3 };
typedef struct ferry__rget {
    /* in */
    const void *key;
    size_t key_len;
    const void *layout;
    size_t layout_len;
    uint64_t key_sum;
    void *dst;
    size_t cap;
    /* out */
    int kind;            /* FERRY__RGET_* */
    int code;            /* VALUE: 0, FERRY_ECORRUPT/EMISMATCH/EVERSION or -ENOBUFS */
    size_t value_len;    /* VALUE: bytes the server sent */
    size_t read_len;     /* VALUE: of them, bytes received (fewer when refused unread) */
    size_t payload_len;  /* VALUE, code 0: bytes in dst */
    char msg[FERRY__ERRMSG_MAX]; /* ERROR: the server's text; VALUE: why refused */
} ferry__rget;
/* The outcome of a generic-path read of a value into g (kind VALUE, code,
 * payload copied into g->dst on success) from buf[0..len): the whole value
 * when whole, else only its first len bytes (the value is longer: refused
 * from its header as -ENOBUFS, FERRY_EMISMATCH, FERRY_ECORRUPT or
 * FERRY_EVERSION, never data). */
void ferry__rvalue_range_outcome(ferry__rget *g, const void *buf, size_t len, int whole);
/* 0 when the reply was dealt with (g filled in; a refused value longer
 * than cap + 64 KiB is not drained: the connection is closed instead),
 * else a transport code (-ETIMEDOUT after deadline_ns, 0: now + the
 * command timeout) and the connection is closed. */
int ferry__rconn_get_into(ferry__rconn *c, ferry__rget *g, uint64_t deadline_ns,
                          ferry__errbuf *eb);

/* 1 when code means the connection was found dead (EOF, reset, broken
 * pipe): worth one reconnect and retry. */
int ferry__rconn_stale_code(int code);

/* ---- topology backends ---- */
typedef struct ferry__rsession ferry__rsession;
typedef struct ferry__rtopo_ops {
    const char *name;
    /* make a session (no I/O) */
    int (*create)(const ferry__rconf *cf, void **state, ferry__errbuf *eb);
    /* (re)connect; 0 or a code */
    int (*connect)(void *state, ferry__errbuf *eb);
    int (*connected)(void *state);
    /* run cmds before deadline_ns; 0 when each has a reply (error replies
     * included) */
    int (*exec)(void *state, ferry__rcmd *cmds, size_t n, uint64_t deadline_ns,
                uint64_t *redirects, ferry__errbuf *eb);
    /* GET into the caller's memory (ferry__rconn_get_into); NULL when the
     * backend has no such path (the caller then uses exec) */
    int (*get_into)(void *state, ferry__rget *g, uint64_t deadline_ns, ferry__errbuf *eb);
    /* drop the connections (after a failure) */
    void (*reset)(void *state);
    void (*destroy)(void *state);
} ferry__rtopo_ops;

extern const ferry__rtopo_ops ferry__rtopo_single;
extern const ferry__rtopo_ops ferry__rtopo_cluster;

/* Probe a connected server: 1 when cluster support is enabled, 0 when not,
 * negative on failure. */
int ferry__rcluster_probe(ferry__rconn *c, ferry__errbuf *eb);
/* CRC16-CCITT/XMODEM as Redis Cluster uses it. */
uint16_t ferry__rcluster_crc16(const void *buf, size_t len);

#endif
