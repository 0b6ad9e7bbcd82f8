/*
 * kvc.h - the server client: a backend of the ferry_kv API beside the
 * in-process store. ferry_kv_open with cfg->server opens one of these
 * instead of tiers; every public call on the store then goes here. Private.
 *
 * One connection per store (kv/client.c): a Unix-domain socket, the HELLO
 * handshake that checks the geometry and hands over the daemon's L1 pool
 * (mapped shared), and round trips bounded by the store's timeout. A round
 * trip that fails, times out or finds the daemon gone closes the
 * connection and answers FERRY_ECONN; the next call connects again. One
 * operation (its round trips and its copies) at a time per store.
 *
 * Close begun (ferry_kv_close_begin): a wait for the reply to a RESERVE or
 * an ACQUIRE (which the daemon holds back while it waits for a pool slot,
 * up to the client's pool_wait_ms) also polls the store's wake eventfd,
 * which the close makes readable for good; that round trip then ends
 * -ECANCELED and its own thread, the one that holds the connection, closes
 * it (the daemon lets go of what it held). Other replies are waited for as
 * before (they do not wait for slots); no call connects again.
 * No other thread touches the socket or the pool mapping, so no copy into
 * a slot the daemon may hand out again runs after the connection ended.
 */
#ifndef FERRY_SRC_KV_KVC_H
#define FERRY_SRC_KV_KVC_H

#include <pthread.h>

#include "kv/kv_impl.h"
#include "proto/proto.h"

typedef struct ferry__kvc {
    pthread_mutex_t mu;           /* one operation at a time */
    char *path;                   /* the socket */
    int fd;                       /* -1: not connected */
    int wake;                     /* the store's close-begun eventfd (the store's
                                     client owns it; its layer connections borrow it) */
    int own_wake;
    int cut;                      /* the reply awaited may wait for a slot: wake ends it */
    long fd_pid;                  /* the process that connected fd (drop: client.c) */
    uint32_t timeout_ms;
    uint32_t wait_ms;             /* pool_wait_ms: sent as WAIT at connect; a round trip
                                     may take timeout_ms plus this */
    int no_why;                   /* the daemon answered WAIT or WHY ENOTSUP */
    int want_pool;                /* 0: lookups only (no pool mapped) */
    unsigned char *pool;          /* the daemon's L1 pool, mapped shared */
    ferry_device *pool_dev;       /* the device pool is registered with, or NULL */
    size_t pool_bytes;
    uint64_t slot_bytes, nslots;
    uint64_t rid;                 /* the last request id */
    uint64_t connects;            /* connections made (the first and reconnects) */
    ferry__proto_buf out;         /* the frame being sent */
    uint8_t *in;                  /* the reply payload being read */
    size_t in_cap;
    ferry__proto_chunk *ch;       /* a request's chunks */
    size_t ch_cap;
    int no_prefetch;              /* the daemon answered PREFETCH ENOTSUP (per connection) */
    /* chunks pinned through this connection (held by the daemon until
     * unpinned or the connection ends: a reconnect forgets them) */
    struct ferry__kvc_pin {
        ferry_kv_hash id;
        uint64_t slot, gen;
    } *pins;
    size_t npins, cap_pins;
    pthread_mutex_t wmu;          /* starting the workers */
    unsigned nworkers;            /* for the asynchronous operations, started by the first */
    int workers_on;
    /* connections of layerwise operations kept for the next (under wmu) */
    struct ferry__kvc *idle, *idle_next;
    unsigned nidle;
} ferry__kvc;

/* client.c: the connection */
int ferry__kvc_open(ferry_kv *kv, const ferry_kv_config *cfg);
void ferry__kvc_close(ferry_kv *kv);
/* the store's workers running (the first asynchronous operation starts
 * them: a client that makes none, a scheduler, has no thread); 0 or a code */
int ferry__kvc_workers(ferry_kv *kv);
/* under c->mu: connected (connecting when not); 0 or FERRY_ECONN / the HELLO's code */
int ferry__kvc_ensure(ferry_kv *kv, ferry__kvc *c);
/* under c->mu: send c->out (a whole frame) and read the reply to it into
 * c->in; 0 and *rd over the reply's payload after its head, whose rc is
 * returned when negative (message on the store), or FERRY_ECONN (the
 * connection is closed) / FERRY_EPARSE (a reply that is not one: closed) */
int ferry__kvc_roundtrip(ferry_kv *kv, ferry__kvc *c, ferry__proto_rd *rd, int32_t *rc);
/* under c->mu, for requests in flight together (replies come in the
 * order the requests went): send c->out (a whole frame, its id c->rid)
 * without waiting; read the reply to request rid of type t (as
 * ferry__kvc_roundtrip; a reply to any other is out of step: closed) */
int ferry__kvc_send(ferry_kv *kv, ferry__kvc *c);
int ferry__kvc_recv(ferry_kv *kv, ferry__kvc *c, int t, uint64_t rid, ferry__proto_rd *rd,
                    int32_t *rc);
/* under c->mu: room for n chunks in c->ch */
int ferry__kvc_chunks(ferry_kv *kv, ferry__kvc *c, size_t n);
/* close the connection (and unmap the pool) after a failure */
void ferry__kvc_drop(ferry__kvc *c);
/* ferry_kv_close_begin: the wake eventfd readable (backend.h close_begin) */
void ferry__kvc_close_begin(ferry_kv *kv);

/* under c->mu: ask the daemon why its last chunk was declined (WHY) and
 * record its message on the store under code; code when it has none or
 * cannot say (an older daemon: the caller's own message stays) */
int ferry__kvc_why(ferry_kv *kv, ferry__kvc *c, int code);

/* client_ops.c: a request of type t over chunks c->ch[0..n) and its
 * reply's head (as ferry__kvc_roundtrip); the count of a reply's per-chunk
 * part (must be n) and its end (nothing left over): 0, or FERRY_ECONN with
 * the connection dropped */
int ferry__kvc_send_chunks(ferry_kv *kv, ferry__kvc *c, int t, size_t n, uint64_t tokens,
                           ferry__proto_rd *rd, int32_t *rc);
int ferry__kvc_reply_count(ferry_kv *kv, ferry__kvc *c, ferry__proto_rd *rd, size_t n);
int ferry__kvc_reply_end(ferry_kv *kv, ferry__kvc *c, ferry__proto_rd *rd);
/* client_ops.c: copy between buf and pool slot `slot` (chunk i of a
 * request of n tokens; to_chunk: into the slot), the tokens from skip on;
 * device: queued on s. 0 or a code */
int ferry__kvc_copy_slot(ferry_kv *kv, ferry__kvc *c, const ferry_kv_buffer *buf, size_t i,
                         size_t n, uint64_t slot, int to_chunk, ferry_stream *s, uint64_t skip);
/* client_retrieve.c: a retrieve's chunks ids[0..nch) (n tokens) into buf,
 * pipelined, under c->mu; st[] gets each chunk's code (FERRY_ENOTFOUND
 * before); 0 or the code that stopped it (-ECANCELED when *cancel) */
int ferry__kvc_retrieve_run(ferry_kv *kv, ferry__kvc *c, const ferry_kv_hash *ids, size_t nch,
                            size_t n, const ferry_kv_buffer *buf, ferry_stream *s, int *st,
                            uint64_t skip, const atomic_int *cancel);
/* client.c: a connection of a layerwise operation's own (kv_layers.h):
 * one kept idle, else a new one (connected); NULL with the code in *rc.
 * ferry__kvc_unlease keeps it for the next (a few at most) when it is
 * still up, else closes it. */
ferry__kvc *ferry__kvc_lease(ferry_kv *kv, int *rc);
void ferry__kvc_unlease(ferry_kv *kv, ferry__kvc *c);

/* client_ops.c: the operations */
int ferry__kvc_lookup(ferry_kv *kv, const ferry_kv_hash *ids, size_t nch, size_t n,
                      const ferry_kv_req *req);
int ferry__kvc_store(ferry_kv *kv, const ferry_kv_hash *ids, size_t nch, size_t n,
                     const ferry_kv_req *req, const ferry_kv_buffer *buf);
int ferry__kvc_retrieve(ferry_kv *kv, const ferry_kv_hash *ids, size_t nch, size_t n,
                        const ferry_kv_req *req, const ferry_kv_buffer *buf);
int ferry__kvc_delete(ferry_kv *kv, const ferry_kv_hash *ids, size_t nch);
/* bring the leading chunks up to the daemon's L1 (ACQUIRE, then RELEASE
 * at once: nothing copied); the leading tokens that are there */
int ferry__kvc_prefetch(ferry_kv *kv, const ferry_kv_hash *ids, size_t nch, size_t n);
/* pin (ACQUIRE kept until unpin) or unpin (RELEASE) the leading chunks;
 * the leading tokens pinned or unpinned */
int ferry__kvc_pin(ferry_kv *kv, const ferry_kv_hash *ids, size_t nch, size_t n, int pin);
/* FLUSH, SYNC, CLEAR, PING: the daemon's result */
int ferry__kvc_simple(ferry_kv *kv, int type);
/* the daemon's counters; *clients: connections it serves (NULL: not wanted) */
int ferry__kvc_stats(ferry_kv *kv, ferry_kv_stats *out, uint32_t *clients);

#endif
