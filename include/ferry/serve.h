/*
 * ferry/serve.h - `ferry serve`: one KV cache per host, shared by every
 * engine process on it.
 *
 * The daemon hosts one ferry_kv (its tiers: an L1 pool in shared memory,
 * L2 slabs, the remote tier) and serves it on a Unix-domain socket. Engine
 * processes open their store with ferry_kv_config.server naming the
 * socket, and every ferry_kv_* call then works against the daemon; the
 * protocol is in docs/PROTOCOL.md. Payload never crosses the socket: the
 * L1 pool is a memfd handed to each client at connect (SCM_RIGHTS), and a
 * client copies into reserved slots and out of read-locked ones.
 *
 * Clients. Each connection is served by its own thread. A peer is accepted
 * when its uid (SO_PEERCRED) is the daemon's or in allow_uids; the socket
 * file is 0600, or 0660 with the operator's group. Whatever a client holds
 * (slots reserved for a store, chunks acquired for a retrieve) is released
 * when its connection closes, for whatever reason (exit, kill -9): its
 * half-written chunks never become visible and no slot leaks. A malformed
 * or truncated frame, an unknown version, a request naming slots the
 * client does not hold, a peer of another uid, one connection past
 * max_clients, a client that does not read its replies for
 * send_timeout_ms: that client gets an error (or is disconnected), every
 * other client is served on.
 *
 * Crashes. The daemon's death loses L1 only: chunks written through to a
 * persistent L2 (l2_persistent, synced by ferry_kv_sync or at a clean
 * stop) are found by the next daemon on the same directory.
 */
#ifndef FERRY_SERVE_H
#define FERRY_SERVE_H

#include "core.h"
#include "kv.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FERRY_SERVE_MAX_CLIENTS_DEFAULT 256u
#define FERRY_SERVE_SEND_TIMEOUT_MS_DEFAULT 5000u

typedef struct ferry_serve_config {
    size_t size;                /**< sizeof(ferry_serve_config) */
    const char *socket_path;    /**< the Unix-domain socket to serve on; required */
    const char *group;          /**< NULL: the socket is 0600; a group name: 0660, that group */
    const uint32_t *allow_uids; /**< uids accepted besides the daemon's own */
    size_t n_allow_uids;
    unsigned max_clients;       /**< connections served at once; 0 -> 256 */
    uint32_t send_timeout_ms;   /**< a client that reads no reply for this long is
                                     disconnected; 0 -> 5000 */
    const ferry_kv_config *kv;  /**< the hosted store (its server field must be NULL) */
} ferry_serve_config;
/** The smallest size ferry_serve_open takes: the first version's config,
 *  which is this one (it has not grown yet). */
#define FERRY_SERVE_CONFIG_MIN_SIZE sizeof(ferry_serve_config)
#define FERRY_SERVE_CONFIG_INIT \
    {FERRY_FIELD(size) sizeof(ferry_serve_config), FERRY_FIELD(socket_path) NULL, \
     FERRY_FIELD(group) NULL, FERRY_FIELD(allow_uids) NULL, FERRY_FIELD(n_allow_uids) 0, \
     FERRY_FIELD(max_clients) 0, FERRY_FIELD(send_timeout_ms) 0, FERRY_FIELD(kv) NULL}

typedef struct ferry_serve ferry_serve;

/**
 * Open the store (its L1 pool in shared memory) and bind the socket. A
 * socket file left by a daemon that died is replaced; one a live daemon
 * answers on is FERRY_EBUSY. The socket file appears only once the store
 * is open and the socket listens (it is bound under a temporary name
 * beside it, then linked there): a client that waits for the file may
 * connect as soon as it sees it, and requests wait in the backlog until
 * ferry_serve_run serves them. What refuses the socket (a path too long
 * for sun_path, its directory missing, a file there that is no socket, a
 * live daemon on it, a group that does not exist) is found before the
 * store is opened: a refused start allocates no pool and creates no L2
 * slab. Errors: -EINVAL, FERRY_EBUSY, -EEXIST (the path is not a socket),
 * -ENAMETOOLONG, -ENOENT (no such directory), the store's and the
 * system's. *out: ferry_serve_close.
 */
FERRY_API int ferry_serve_open(const ferry_serve_config *cfg, ferry_serve **out);
/** Accept and serve clients until ferry_serve_stop(); returns 0. */
FERRY_API int ferry_serve_run(ferry_serve *s);
/** Make ferry_serve_run return. Async-signal-safe (a SIGTERM handler may call it). */
FERRY_API void ferry_serve_stop(ferry_serve *s);
/**
 * Disconnect every client (releasing what each held), flush and sync the
 * store, close it and remove the socket. Before the disconnect, waits for
 * a pool slot end (the chunk declined -ECANCELED) and the requests already
 * received are answered, for 250 ms at most. Returns 0 or the sync's
 * failure. NULL does nothing. Not thread-safe with ferry_serve_run.
 */
FERRY_API int ferry_serve_close(ferry_serve *s);
/** The hosted store (valid until ferry_serve_close). */
FERRY_API ferry_kv *ferry_serve_kv(ferry_serve *s);
FERRY_API const char *ferry_serve_last_error(const ferry_serve *s);

/* ---- the daemon's configuration file ---- */

/**
 * The YAML file `ferry serve --config FILE` reads, for a program that
 * embeds the daemon. Its keys are ferry_kv_config's member names (model,
 * layout, chunk_tokens, l1_bytes, l2_dirs, l2_bytes, pool_wait_ms, ...)
 * and the daemon's (socket, group, allow_uids, max_clients,
 * send_timeout_ms, metrics); sizes take suffixes (256K, 64G). With env
 * nonzero, every FERRY_<KEY> variable that is set replaces the file's
 * value. Nothing is ignored: an unknown key, a value of the wrong type, a
 * duplicate key or a second document is refused with the file, line and
 * column. Returns 0 and *out, freed with ferry_serve_file_free. Errors:
 * -EINVAL (NULL, or the file's content: the message names where and why),
 * -ENOENT and the like (the file cannot be read), -ENOMEM.
 */
typedef struct ferry_serve_file ferry_serve_file;
FERRY_API int ferry_serve_file_load(const char *path, int env, ferry_serve_file **out);
/**
 * The daemon's configuration the file gives (its kv member the hosted
 * store's), ready for ferry_serve_open; its strings and arrays are the
 * file handle's, valid until ferry_serve_file_free. NULL for NULL.
 */
FERRY_API const ferry_serve_config *ferry_serve_file_config(const ferry_serve_file *f);
/** The HOST:PORT the file's metrics key names (served by the CLI), or NULL. */
FERRY_API const char *ferry_serve_file_metrics(const ferry_serve_file *f);
/** Free what ferry_serve_file_load made. NULL does nothing. */
FERRY_API void ferry_serve_file_free(ferry_serve_file *f);

typedef struct ferry_serve_stats {
    size_t size;               /**< the caller's sizeof(ferry_serve_stats) */
    uint64_t clients;          /**< connections served now */
    uint64_t connections;      /**< connections accepted so far */
    uint64_t refused;          /**< refused: another uid, or past max_clients */
    uint64_t requests;         /**< requests answered */
    uint64_t bad_frames;       /**< malformed frames, unknown versions or types */
    uint64_t slow_clients;     /**< disconnected for not reading their replies */
    uint64_t released;         /**< reservations and locks released by a closing connection */
    /** read-ahead (PREFETCH, ACQUIRE) dropped unread because its client
     *  hung up or its connection ended: chunks whose queued read had not
     *  begun, their L1 slots given back at once */
    uint64_t ahead_dropped;
} ferry_serve_stats;
#define FERRY_SERVE_STATS_INIT \
    {FERRY_FIELD(size) sizeof(ferry_serve_stats), FERRY_FIELD(clients) 0, \
     FERRY_FIELD(connections) 0, FERRY_FIELD(refused) 0, FERRY_FIELD(requests) 0, \
     FERRY_FIELD(bad_frames) 0, FERRY_FIELD(slow_clients) 0, FERRY_FIELD(released) 0, \
     FERRY_FIELD(ahead_dropped) 0}
/** A snapshot of the daemon's counters: the caller sets out->size (start
 *  from FERRY_SERVE_STATS_INIT) and only that many bytes are written.
 *  Errors: -EINVAL (NULL, or out->size not set). */
FERRY_API int ferry_serve_stats_get(const ferry_serve *s, ferry_serve_stats *out);

/** One client connection's back-pressure counters (ferry_kv_config.pool_wait_ms). */
typedef struct ferry_serve_client {
    int32_t pid;               /**< the client's process (SO_PEERCRED) */
    uint32_t uid;
    uint64_t waits;            /**< times it found every L1 slot locked and waited */
    uint64_t wait_ns;          /**< time spent in those waits */
    uint64_t declines;         /**< chunks declined FERRY_ENOSPACE (no slot in time, or
                                    past its share of the pool) */
} ferry_serve_client;
/**
 * The clients connected now: up to max of them into out[] (elem_size:
 * the caller's sizeof(ferry_serve_client); only that many bytes of each
 * are written, so a caller built against an older header works). Returns
 * how many are connected (more than max: the rest were left out).
 * Errors: -EINVAL (s NULL, out NULL with max > 0, elem_size 0 or past
 * this header's struct). Thread-safe with ferry_serve_run.
 */
FERRY_API int ferry_serve_clients(const ferry_serve *s, ferry_serve_client *out, size_t max,
                                  size_t elem_size);

#ifdef __cplusplus
}
#endif
#endif
