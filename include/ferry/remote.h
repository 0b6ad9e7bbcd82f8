/*
 * ferry/remote.h - the shared remote tier: chunks kept in Redis or Valkey.
 *
 * A ferry_remote is a client of one Redis/Valkey deployment (a single
 * server or a Redis Cluster) reached through hiredis. Several ferry
 * processes (or machines) that open the same URL share what they store.
 *
 * Keys and values
 *  - A key is an opaque byte string (the KV store builds it from model, TP
 *    rank/world, chunk hash and salt). The server key is
 *    options.key_prefix followed by the key bytes.
 *  - A value is the caller's payload behind a small header: magic "FRYV",
 *    format version, the layout fingerprint given at open
 *    (options.layout, up to FERRY_REMOTE_LAYOUT_MAX bytes: whatever
 *    identifies model, dtype and KV shape), an XXH3-64 of the key, an
 *    XXH3-64 of the payload, the payload length and an XXH3-64 of the
 *    header itself. A value whose layout or key hash differs from the
 *    reader's is refused with FERRY_EMISMATCH, a value that fails a
 *    checksum or is malformed with FERRY_ECORRUPT, one from a newer format
 *    with FERRY_EVERSION; none of them is ever returned as data.
 *  - Shared servers: every writer of a key (any handle, process, layout)
 *    replaces the whole value (one SET). A get returns exactly one value
 *    some writer stored for that key and this layout, whole, or a
 *    refusal: never a mix of two writes, never bytes changed in place by
 *    another client (SETRANGE, APPEND: FERRY_ECORRUPT), never a value
 *    copied from another key. A value deleted, evicted (maxmemory) or
 *    flushed, even during the call, is a miss. Handles of different
 *    layouts (or sizes) under one key prefix displace each other's values
 *    (last write wins; the other sees a refusal): give them different
 *    key prefixes to keep both. Values not written by ferry, empty ones
 *    included, are refused (an empty value may read as a miss).
 *  - The checksums catch accidents (other writers, other versions,
 *    damage), not forgery: a client that may write to the database and
 *    knows the format can store bytes that pass them. Share a database
 *    only with writers you trust; give others an ACL user without write
 *    permission (its puts are refused with FERRY_EREMOTE, gets work).
 *
 * URLs (ferry_remote_url_validate says what is wrong with one)
 *    redis://[[user]:password@]host[:port][/db][?query]
 *    unix:///path/to/socket[?db=N&user=U&password=P]
 *    redis+unix://[[user]:password@]/path/to/socket[?query]
 *  valkey:// and valkey+unix:// are synonyms. host is a name, an IPv4
 *  address or [IPv6]; port defaults to 6379, db to 0. user and password
 *  are percent-decoded. query keys: db (or /db, not both), user, password,
 *  cluster=auto|yes|no (default auto: a server with cluster support
 *  enabled is used through the cluster path). rediss:// (TLS) is not
 *  supported: the Debian hiredis 0.14 has no TLS; run a TLS tunnel
 *  (stunnel, spiped) on loopback and point a redis:// URL at it.
 *
 * Redis Cluster: the client reads the slot map (CLUSTER SLOTS), routes each
 *  key to its master by CRC16 slot (hash tags honoured), follows MOVED
 *  (updating its map) and ASK (ASKING + retry) redirections, and pipelines
 *  per node (every node's pipeline is in flight at once). Only masters are
 *  used; db must be 0. A key_prefix holding a {hash tag} puts every key
 *  in one slot, so on one node: leave tags out of the prefix unless that is
 *  what you want.
 *
 * Bounds: what a server sends is never trusted to be small. Each reply is
 *  framed before it is buffered: a GET's within the destination size plus
 *  the value header (a value longer than that is refused as the get says,
 *  from its header: -ENOBUFS, FERRY_EMISMATCH...; it is not a transport
 *  failure and does not mark the remote down), CLUSTER SLOTS within
 *  8 MiB, every other reply within 64 KiB; arrays only where one is
 *  expected, nested at most 7 deep. A
 *  reply out of bounds or not RESP2 is a transport failure (-EMSGSIZE,
 *  -EPROTO): the connection is dropped. Every call has one deadline for
 *  the whole of it (command_timeout_ms, on CLOCK_MONOTONIC); a server that
 *  answers too slowly, even a byte at a time, fails the call with
 *  -ETIMEDOUT after about that long and its connection is dropped.
 *
 * Secrets: the password never appears in a message, a log line or
 *  ferry_remote_url(): URLs are quoted as redis://user:***@host:port/db.
 *
 * Failure model: a transport failure (refused, reset, timed out) marks the
 *  remote down for a backoff period that starts at backoff_initial_ms and
 *  doubles up to backoff_max_ms, plus up to 25% random jitter. While it
 *  is down every call answers as a miss at once, without I/O
 *  (stats.degraded counts them), and puts are dropped. After the period
 *  one caller probes (reconnects, with connect_timeout_ms); others keep
 *  answering misses until the probe succeeds. Error replies (WRONGTYPE,
 *  OOM, NOAUTH, READONLY...) are FERRY_EREMOTE and do not mark the remote
 *  down; each one, and each transport failure, counts in stats.errors
 *  (a refused queued put in stats.dropped too, with a warning logged at
 *  most every 10 s). A connection found dead by EOF or
 *  reset (a restarted server) is reconnected and the command retried once
 *  before the remote is marked down. A single cluster node down makes the
 *  whole remote down for the period (no per-node health).
 *
 * Thread-safety: every function may be called from any thread on one
 *  handle at the same time, except close. Synchronous calls take one of
 *  options.connections connections (waiting for a free one); puts are
 *  written by one background thread with its own connection.
 *
 * Memory: ferry's own bookkeeping (queue items, buffers) goes through the
 *  allocation hook; hiredis allocates with libc malloc (0.14 has no hook).
 *  On a single server a GET reads the payload from the socket straight
 *  into the caller's buffer; the cluster path goes through hiredis's reply
 *  objects (one more copy).
 *
 * Signals: ferry sends every command itself with send(MSG_NOSIGNAL)
 *  (never hiredis's write(2)), so a server that hangs up is -EPIPE, never a
 *  SIGPIPE that kills the host process; signal dispositions and masks are
 *  left alone.
 */
#ifndef FERRY_REMOTE_H
#define FERRY_REMOTE_H

#include "core.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ferry_remote ferry_remote;

/** Longest layout fingerprint a value header carries. */
#define FERRY_REMOTE_LAYOUT_MAX 1024u
/** Longest key (key_prefix included). */
#define FERRY_REMOTE_KEY_MAX 4096u
/** Bytes of a value header before the layout bytes. */
#define FERRY_REMOTE_HEADER_FIXED 48u
/** Longest value, header included, that ferry writes or reads: Redis's
 *  default limit on a string (proto-max-bulk-len, 512 MiB). A payload may
 *  have FERRY_REMOTE_VALUE_MAX - FERRY_REMOTE_HEADER_FIXED - layout_len
 *  bytes at most. */
#define FERRY_REMOTE_VALUE_MAX ((size_t)512 << 20)
/** Number of Redis Cluster hash slots. */
#define FERRY_REMOTE_SLOTS 16384u

enum ferry_remote_flags {
    /** Open succeeds even when the server cannot be reached (the handle
     *  starts down and probes after backoff). Without it, open fails. */
    FERRY_REMOTE_LAZY = 1u << 0
};

/* The ranges ferry_remote_open accepts (0 always means the default). */
#define FERRY_REMOTE_TIMEOUT_MAX_MS 600000u     /**< connect/command timeouts: 10 min */
#define FERRY_REMOTE_BACKOFF_MAX_MS 3600000u    /**< backoff periods: 1 h */
#define FERRY_REMOTE_QUEUE_ITEMS_MAX (1u << 24) /**< queue_max_items */
#define FERRY_REMOTE_QUEUE_BYTES_MAX (1ull << 36) /**< queue_max_bytes: 64 GiB */
#define FERRY_REMOTE_CONNECTIONS_MAX 1024u      /**< connections */
#define FERRY_REMOTE_TTL_MAX_S 2147483647u      /**< ttl_s (Redis's EX limit) */

/* Every field is range-checked by ferry_remote_open before it is used:
 * a value outside its range is -EINVAL with a message naming the field
 * and the range. */
typedef struct ferry_remote_options {
    size_t size;                 /**< sizeof(ferry_remote_options) */
    uint32_t connect_timeout_ms; /**< TCP/unix connect (each handshake command
                                      too); 0 -> 500; 1..FERRY_REMOTE_TIMEOUT_MAX_MS */
    uint32_t command_timeout_ms; /**< deadline of a whole call (every byte sent
                                      and every reply read, not each read), plus
                                      16 ns per byte it moves (a floor of ~60 MB/s
                                      for large values); 0 -> 1000;
                                      1..FERRY_REMOTE_TIMEOUT_MAX_MS */
    uint32_t backoff_initial_ms; /**< first down period; 0 -> 50;
                                      1..FERRY_REMOTE_BACKOFF_MAX_MS */
    uint32_t backoff_max_ms;     /**< cap of the doubling; 0 -> 5000 (or
                                      backoff_initial_ms when larger);
                                      backoff_initial_ms..FERRY_REMOTE_BACKOFF_MAX_MS */
    uint32_t queue_max_items;    /**< puts waiting to be written; 0 -> 1024;
                                      1..FERRY_REMOTE_QUEUE_ITEMS_MAX */
    uint64_t queue_max_bytes;    /**< their encoded bytes; 0 -> 256 MiB;
                                      1..FERRY_REMOTE_QUEUE_BYTES_MAX */
    uint32_t connections;        /**< for synchronous calls; 0 -> 4;
                                      1..FERRY_REMOTE_CONNECTIONS_MAX */
    uint32_t ttl_s;              /**< expire stored values after; 0 = never;
                                      1..FERRY_REMOTE_TTL_MAX_S */
    const char *key_prefix;      /**< prepended to every key; NULL = none; copied;
                                      shorter than FERRY_REMOTE_KEY_MAX / 2 */
    const void *layout;          /**< layout fingerprint; may be NULL; copied */
    size_t layout_len;           /**< 0..FERRY_REMOTE_LAYOUT_MAX (0 when layout is NULL) */
    uint32_t flags;              /**< ferry_remote_flags; other bits are -EINVAL */
} ferry_remote_options;
/** The smallest size ferry_remote_open takes: the first version's struct,
 *  which is this one (it has not grown yet). */
#define FERRY_REMOTE_OPTIONS_MIN_SIZE (offsetof(ferry_remote_options, flags) + sizeof(uint32_t))
#define FERRY_REMOTE_OPTIONS_INIT \
    {FERRY_FIELD(size) sizeof(ferry_remote_options), FERRY_FIELD(connect_timeout_ms) 0, \
     FERRY_FIELD(command_timeout_ms) 0, FERRY_FIELD(backoff_initial_ms) 0, \
     FERRY_FIELD(backoff_max_ms) 0, FERRY_FIELD(queue_max_items) 0, \
     FERRY_FIELD(queue_max_bytes) 0, FERRY_FIELD(connections) 0, FERRY_FIELD(ttl_s) 0, \
     FERRY_FIELD(key_prefix) NULL, FERRY_FIELD(layout) NULL, FERRY_FIELD(layout_len) 0, \
     FERRY_FIELD(flags) 0}

/** One key of a batch. */
typedef struct ferry_remote_key {
    const void *data;
    size_t len;
} ferry_remote_key;

typedef struct ferry_remote_stats {
    size_t size;            /**< set by the caller: sizeof(ferry_remote_stats) */
    uint64_t puts;          /**< puts accepted (queued or written synchronously) */
    uint64_t puts_written;  /**< values the server acknowledged */
    uint64_t gets;          /**< get calls */
    uint64_t hits;          /**< gets that returned data */
    uint64_t misses;        /**< gets answered as a miss (absent, down, refused) */
    uint64_t errors;        /**< transport failures and error replies */
    uint64_t dropped;       /**< puts dropped: queue full or remote down */
    uint64_t reconnects;    /**< connections made again after a failure */
    uint64_t degraded;      /**< calls answered at once because the remote was down */
    uint64_t corrupt;       /**< values refused by a checksum/format check */
    uint64_t mismatched;    /**< values refused for another layout or key */
    uint64_t redirects;     /**< cluster MOVED/ASK redirections followed */
    uint64_t bytes_written; /**< value bytes (header included) sent by puts */
    uint64_t bytes_read;    /**< value bytes (header included) received by gets */
    uint64_t exists_calls;  /**< ferry_remote_exists calls */
    uint64_t deletes;       /**< keys deleted */
    uint64_t queue_items;   /**< puts waiting now */
    uint64_t queue_bytes;   /**< their bytes now */
    uint32_t down;          /**< 1 while the remote is marked down */
    uint32_t cluster;       /**< 1 when the cluster path is in use */
} ferry_remote_stats;
#define FERRY_REMOTE_STATS_INIT \
    {FERRY_FIELD(size) sizeof(ferry_remote_stats), FERRY_FIELD(puts) 0, \
     FERRY_FIELD(puts_written) 0, FERRY_FIELD(gets) 0, FERRY_FIELD(hits) 0, \
     FERRY_FIELD(misses) 0, FERRY_FIELD(errors) 0, FERRY_FIELD(dropped) 0, \
     FERRY_FIELD(reconnects) 0, FERRY_FIELD(degraded) 0, FERRY_FIELD(corrupt) 0, \
     FERRY_FIELD(mismatched) 0, FERRY_FIELD(redirects) 0, FERRY_FIELD(bytes_written) 0, \
     FERRY_FIELD(bytes_read) 0, FERRY_FIELD(exists_calls) 0, FERRY_FIELD(deletes) 0, \
     FERRY_FIELD(queue_items) 0, FERRY_FIELD(queue_bytes) 0, FERRY_FIELD(down) 0, \
     FERRY_FIELD(cluster) 0}

/**
 * Connect to the server named by url (see the grammar above) with opt
 * (NULL: defaults): AUTH when a password is given, SELECT db, or PING when
 * neither is sent, detect a cluster, start the writer thread.
 * Errors: FERRY_EPARSE (bad URL; the message quotes it with the password
 * hidden), FERRY_ENOTSUP (rediss://), -EINVAL (an option out of its range:
 * the message names it and the range), FERRY_EREMOTE (the server refused
 * AUTH/SELECT/PING, e.g. NOAUTH when it wants a password the URL lacks,
 * even with FERRY_REMOTE_LAZY: its message is quoted),
 * -ECONNREFUSED/-ETIMEDOUT/-ECONNRESET/-EHOSTUNREACH/-EPROTO/-EMSGSIZE
 * (cannot reach it or it does not speak RESP2 within bounds, unless
 * FERRY_REMOTE_LAZY), -ENOMEM. *out is set only on success.
 * Ownership: close the handle with ferry_remote_close.
 */
FERRY_API int ferry_remote_open(const char *url, const ferry_remote_options *opt,
                                ferry_remote **out);

/**
 * Stop the writer after it wrote what is queued (or dropped it, when the
 * remote is down; each write bounded by the command timeout), close the
 * connections and free. NULL does nothing. No call may be in progress on
 * the handle.
 */
FERRY_API void ferry_remote_close(ferry_remote *r);

/**
 * Store data[0..len) under key, asynchronously: the value is encoded
 * (copied) and queued, and the writer thread sends it. Never blocks on the
 * network. Returns 0 when queued; FERRY_ENOSPACE when the queue is full
 * (the put is dropped and counted); -EAGAIN when the remote is down and
 * backing off (dropped without copying, counted); -ENOMEM (dropped);
 * -EINVAL for a NULL/empty key, a key over FERRY_REMOTE_KEY_MAX, data
 * NULL with len > 0, or a value over FERRY_REMOTE_VALUE_MAX with its header
 * (the message names the key, both sizes and the most a payload may
 * have). A queued put may still be dropped by the writer when
 * the remote goes down or refuses it (stats.dropped). Thread-safe.
 * A later put of the same key replaces the value.
 */
FERRY_API int ferry_remote_put(ferry_remote *r, const void *key, size_t key_len,
                               const void *data, size_t len);

/**
 * Store data under key now, waiting for the server's answer. Returns 0
 * when the server answered +OK.
 * Errors: FERRY_EREMOTE (error reply, e.g. OOM, quoted), -EPROTO (any
 * other answer, named in the message: the value may not be stored),
 * -ECONNREFUSED/-ETIMEDOUT/... (transport; the remote is marked down),
 * -EAGAIN (the remote is down and backing off: nothing was sent), -EINVAL.
 */
FERRY_API int ferry_remote_put_sync(ferry_remote *r, const void *key, size_t key_len,
                                    const void *data, size_t len);

/**
 * Fetch the value of key into dst[0..cap). Returns the payload length
 * (>= 0) on a hit. A miss is FERRY_ENOTFOUND: the key is absent, or the
 * remote is down (answered at once while backing off, or after at most the
 * timeouts when the failure happens during this call; the message says
 * which). FERRY_EMISMATCH: the value was stored for another layout or key.
 * FERRY_ECORRUPT: it failed a checksum or is malformed (or is longer than
 * FERRY_REMOTE_VALUE_MAX, on a server whose limit was raised: refused
 * unread, its connection dropped, the remote not marked down).
 * FERRY_EVERSION: a newer format. FERRY_EREMOTE: the server answered an error (e.g.
 * WRONGTYPE). -ENOBUFS: cap is smaller than the payload (the message says
 * how big it is). On every failure dst may have been written to but holds
 * nothing the caller should use.
 */
FERRY_API int ferry_remote_get(ferry_remote *r, const void *key, size_t key_len, void *dst,
                               size_t cap);

/**
 * Prefix lookup: how many of keys[0..n), counted from the first, are
 * present with a valid header for this handle's layout and their key. All
 * n are asked in one pipelined round trip (in a cluster every node's
 * pipeline is in flight at once), each reading only the value header, so
 * a value whose payload is damaged still counts here and is refused by
 * ferry_remote_get. Returns that count (0..n); 0 when the remote is down
 * (a miss). -EINVAL for a bad key. Thread-safe.
 */
FERRY_API int ferry_remote_exists(ferry_remote *r, const ferry_remote_key *keys, size_t n);

/**
 * Delete keys[0..n) (pipelined). Returns how many existed and were
 * deleted (0..n). Errors: -EAGAIN (down, nothing sent), transport codes,
 * FERRY_EREMOTE, -EPROTO (a key's answer was not 0 or 1: the message
 * names it), -EINVAL.
 */
FERRY_API int ferry_remote_delete(ferry_remote *r, const ferry_remote_key *keys, size_t n);

/**
 * Wait until every put queued before this call was written or dropped.
 * Returns 0, or -ETIMEDOUT after timeout_ms (0 = wait without limit).
 */
FERRY_API int ferry_remote_flush(ferry_remote *r, uint32_t timeout_ms);

/**
 * A snapshot of the counters, as every ferry_<object>_stats_get: the
 * caller sets out->size (its header's sizeof(ferry_remote_stats), e.g.
 * with FERRY_REMOTE_STATS_INIT) and only that many bytes are written;
 * out->size stays. Errors: -EINVAL (NULL, out->size not set).
 */
FERRY_API int ferry_remote_stats_get(const ferry_remote *r, ferry_remote_stats *out);

/** The handle's last failure message ("" if none) as the calling thread's
 *  own copy, taken whole (as every *_last_error): it does not change while
 *  it is read, whatever the writer thread records meanwhile, and stays
 *  valid across this thread's next three *_last_error calls. With several
 *  threads on one handle the last failure may be another thread's (or the
 *  writer's); ferry_last_error() is the calling thread's own. */
FERRY_API const char *ferry_remote_last_error(const ferry_remote *r);

/** The URL the handle was opened with, password replaced by "***". */
FERRY_API const char *ferry_remote_url(const ferry_remote *r);

/**
 * Check a URL without connecting. Returns 0, FERRY_EPARSE or FERRY_ENOTSUP;
 * the reason is in ferry_last_error(). Thread-safe.
 */
FERRY_API int ferry_remote_url_validate(const char *url);

/**
 * The Redis Cluster hash slot (0..16383) of a key, honouring a {hash tag}:
 * CRC16-CCITT (XMODEM) of the tag or the whole key, mod 16384. The slot is
 * computed over key_prefix + key by the handle; give the full key here.
 */
FERRY_API unsigned ferry_remote_key_slot(const void *key, size_t len);

#ifdef __cplusplus
}
#endif
#endif
