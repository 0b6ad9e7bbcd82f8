/*
 * serve_int.h - what the daemon's files share (serve.c: socket, accept,
 * lifecycle; serve_conn.c: one connection's requests). Private.
 *
 * Locking: s->mu guards the connection list and its counts; each
 * connection's own state (buffers, what it holds) belongs to its thread.
 * A connection's fd is closed only by whoever joins its thread, so a
 * shutdown() from ferry_serve_close never hits a reused descriptor.
 *
 * A connection thread waiting for an L1 slot (back-pressure) sits in the
 * store, not on its socket, so others tell it when the wait is useless:
 * ferry_serve_run polls every connection for a hang-up (events 0: only
 * POLLHUP / POLLERR, never a request, wake it) and cuts the one whose
 * client went; ferry_serve_close cuts them all, and a connection's thread
 * cuts its own as it ends. A connection about to be refused for the
 * limit first has the counted ones whose clients hung up retired
 * (ferry__srv_retire_gone). A cut connection takes no slot and queues no
 * read-ahead (kv_slots.h), and what read-ahead it had queued and not begun
 * is dropped, its slots given back: nothing is given out to or read for a
 * client that is gone or about to be.
 */
#ifndef FERRY_SRC_SERVE_INT_H
#define FERRY_SRC_SERVE_INT_H

#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/types.h>

#include "core.h"
#include "ferry/serve.h"
#include "kv/kv_slots.h"
#include "proto/proto.h"

/* connections a daemon takes past max_clients, for monitors alone (HELLO
 * ANY: ferry serve status): a full daemon still shows its state */
#define FERRY__SRV_MONITORS 4u

/* why a connection was cut */
enum { FERRY__SRV_GONE = 1, FERRY__SRV_CLOSING = 2 };

/* a slot a connection holds: reserved for its store (W) or acquired (R) */
typedef struct ferry__srv_hold {
    ferry__kv_entry *e;
    ferry_kv_hash id;
    uint64_t slot, gen;
    int write;
} ferry__srv_hold;

typedef struct ferry__srv_conn {
    struct ferry__srv_conn *next;
    struct ferry_serve *s;
    int fd;
    pid_t pid;
    uid_t uid;
    pthread_t th;
    atomic_int done;              /* its thread finished: join and free it */
    ferry__kv_cut *cut;           /* why: FERRY__SRV_GONE / _CLOSING: it takes no slot
                                     (kv_slots.h: ferry__kv_thread_cut), so a wait
                                     for one ends, and its read-ahead is dropped
                                     unread; 0 while it may. A reference: read-ahead
                                     queued for it holds others */
    int hello;                    /* HELLO answered */
    int engine;                   /* counted in nengines (a HELLO not ANY); s->mu */
    int retired;                  /* no longer counted in nconns nor nengines: its
                                     thread ended, or its client hung up
                                     (ferry__srv_retire_gone); s->mu */
    int bye;                      /* its last reply sent: end the connection */
    uint8_t *in;                  /* the request payload */
    size_t in_cap;
    ferry__proto_chunk *ch;       /* its chunks */
    size_t ch_cap;
    uint8_t *tiers;               /* LOOKUP's answer */
    ferry__proto_buf out;         /* the reply */
    ferry__srv_hold *held;
    size_t nheld, cap_held;
    size_t nreserved;             /* of held: reservations */
    uint64_t wait_ns;             /* how long it waits for a slot (WAIT; else the store's) */
    int why_code;                 /* its last chunk declined (WHY answers it), 0: none */
    char why[FERRY__PROTO_MAX_MSG];
    /* back-pressure, for the metrics (written by its thread, read under
     * s->mu by ferry_serve_clients) */
    atomic_uint_fast64_t waits, wait_ns_total, declines;
    /* nheld and nreserved, for other threads' messages (who holds the pool) */
    atomic_uint_fast64_t held_now, reserved_now;
} ferry__srv_conn;

struct ferry_serve {
    ferry__errbuf err;
    ferry_kv *kv;
    char *path;
    int lfd;                      /* the listening socket */
    int stop_pipe[2];             /* ferry_serve_stop writes a byte */
    uid_t uid;
    uint32_t *allow;
    size_t nallow;
    unsigned max_clients;
    uint32_t send_timeout_ms;
    /* the pool and geometry every HELLO hands over */
    int pool_fd;
    uint64_t pool_bytes, slot_bytes, nslots, chunk_bytes;
    ferry_kv_layout layout;
    uint32_t chunk_tokens;
    uint64_t seed;
    size_t max_held;              /* holds one connection may have at once */
    size_t max_reserved;          /* of which reservations: half the pool, so no one
                                     client can starve the others of slots */

    pthread_mutex_t mu;
    ferry__srv_conn *conns;
    unsigned nconns;
    unsigned nengines;            /* connections past a HELLO not ANY: at most
                                     max_clients; monitors (ferry serve status)
                                     have FERRY__SRV_MONITORS more connections */
    /* ferry_serve_run's poll set (its thread's alone): the socket, the stop
     * pipe, then each connection not cut yet, watched for a hang-up */
    struct pollfd *watch;
    ferry__srv_conn **watch_c;
    size_t watch_cap;
    uint64_t accept_after;        /* (that thread's too) an accept failed for want of
                                     descriptors: the socket rests until then (ns) */
    atomic_uint_fast64_t connections, refused, requests, bad_frames, slow_clients, released;
    ferry__warnlim warn;          /* refusals and bad frames can come at any rate */
};

/* with s->mu held: the connections whose clients hung up (their sockets
 * show POLLHUP: the peer closed) retired from the counts and cut, so a
 * client that closed never holds a place under max_clients that a new one
 * asks for (its thread may not have seen it go yet); how many */
unsigned ferry__srv_retire_gone(struct ferry_serve *s);

/* serve_conn.c: a connection's thread */
void *ferry__srv_conn_main(void *arg);
/* send a whole frame within the send timeout (fd: passed along, or -1);
 * 0 or a negative code */
int ferry__srv_send(struct ferry_serve *s, int sock, const uint8_t *p, size_t n, int fd);
/* a warning that clients can trigger at any rate: the first few, then one a second */
void ferry__srv_warn(struct ferry_serve *s, const char *fmt, ...) FERRY__PRINTF(2, 3);
/* an ERROR reply (rid, code, message) on sock, best effort, not waiting */
void ferry__srv_refuse(int sock, uint64_t rid, int code, const char *msg);

#endif
