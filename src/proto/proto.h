/*
 * proto.h - the wire protocol between `ferry serve` and its clients
 * (docs/PROTOCOL.md): frames, requests and replies, encoded and decoded.
 * Private. It lives in kv because both sides need it: the client backend
 * (kv/client*.c) and the daemon (serve/, above kv).
 *
 * A frame is a 16-byte header and a payload of at most
 * FERRY__PROTO_MAX_PAYLOAD bytes. Every integer is little-endian. The
 * decoders trust no length: each count is checked against the bytes left
 * and against its own bound before anything is read or allocated, and a
 * payload must be consumed exactly (trailing bytes are malformed).
 */
#ifndef FERRY_SRC_KV_PROTO_H
#define FERRY_SRC_KV_PROTO_H

#include <stddef.h>
#include <stdint.h>

#include "ferry/kv.h"

#define FERRY__PROTO_MAGIC 0x66u       /* 'f' */
#define FERRY__PROTO_VERSION 1u
#define FERRY__PROTO_HDR 16u
#define FERRY__PROTO_MAX_PAYLOAD (1u << 20)
/* chunks one request may name: 4M tokens at 256 a chunk */
#define FERRY__PROTO_MAX_CHUNKS 16384u
#define FERRY__PROTO_MAX_MSG 400u      /* bytes of an error message on the wire */
#define FERRY__PROTO_REPLY 0x80u       /* a reply's type: the request's | this */

enum ferry__proto_type {
    FERRY__P_HELLO = 1,
    FERRY__P_LOOKUP = 2,
    FERRY__P_RESERVE = 3,
    FERRY__P_COMMIT = 4,
    FERRY__P_ACQUIRE = 5,
    FERRY__P_RELEASE = 6,
    FERRY__P_DELETE = 7,
    FERRY__P_STATS = 8,
    FERRY__P_FLUSH = 9,
    FERRY__P_SYNC = 10,
    FERRY__P_CLEAR = 11,
    FERRY__P_PING = 12,
    FERRY__P_PREFETCH = 13,
    FERRY__P_WAIT = 14,    /* u32 ms: this connection's pool_wait_ms (back-pressure) */
    FERRY__P_WHY = 15,     /* the message of this connection's last chunk declined */
    FERRY__P_TYPES = 16,
    /* a reply to a frame the daemon could not take (rid as far as known) */
    FERRY__P_ERROR = 0x7f
};

/* HELLO flags */
#define FERRY__HELLO_NO_POOL 1u   /* lookups only: no pool mapping handed over */
#define FERRY__HELLO_ANY 2u       /* with NO_POOL: any geometry (`ferry serve status`) */

typedef struct ferry__proto_hdr {
    uint8_t version;
    uint8_t type;
    uint8_t flags;
    uint32_t len;     /* payload bytes */
    uint64_t rid;     /* request id, echoed by the reply */
} ferry__proto_hdr;

/* the client's geometry (HELLO request) and the daemon's (HELLO reply) */
typedef struct ferry__proto_hello {
    ferry_kv_layout layout;   /* size unused on the wire */
    uint32_t chunk_tokens;
    uint64_t seed;
    uint32_t flags;           /* request: FERRY__HELLO_*; reply: 1 = pool fd attached */
    /* reply only */
    uint64_t chunk_bytes, slot_bytes, nslots, pool_bytes;
} ferry__proto_hello;

/* one chunk of a request or a reply; which fields travel depends on the
 * type (docs/PROTOCOL.md) */
typedef struct ferry__proto_chunk {
    ferry_kv_hash id;
    uint64_t slot, gen;
    uint32_t tokens;
    int32_t status;       /* COMMIT request: 0 commit, 1 abort; replies: the chunk's code */
    uint8_t tier;         /* LOOKUP / ACQUIRE replies */
} ferry__proto_chunk;

/* a decoded request: chunks points into the caller's array (max_chunks) */
typedef struct ferry__proto_req {
    ferry__proto_hdr hdr;
    ferry__proto_hello hello;     /* HELLO */
    uint64_t tokens;              /* LOOKUP: tokens the chunks cover (statistics);
                                     WAIT: the milliseconds */
    uint32_t n;
    ferry__proto_chunk *chunks;
    size_t max_chunks;
} ferry__proto_req;

/* a growable output buffer; a failed growth sets err and drops what follows */
typedef struct ferry__proto_buf {
    uint8_t *p;
    size_t len, cap;
    int err;              /* 0 or -ENOMEM / -EMSGSIZE */
} ferry__proto_buf;

void ferry__proto_buf_free(ferry__proto_buf *b);
void ferry__proto_put_u8(ferry__proto_buf *b, uint8_t v);
void ferry__proto_put_u32(ferry__proto_buf *b, uint32_t v);
void ferry__proto_put_u64(ferry__proto_buf *b, uint64_t v);
void ferry__proto_put_bytes(ferry__proto_buf *b, const void *p, size_t n);
void ferry__proto_put_id(ferry__proto_buf *b, const ferry_kv_hash *id);
/* start a frame (header with length 0) / patch its length once the payload
 * is in: 0, or the buffer's error (-EMSGSIZE past the payload bound) */
void ferry__proto_begin(ferry__proto_buf *b, uint8_t type, uint64_t rid);
int ferry__proto_end(ferry__proto_buf *b);

/* a bounded reader over a payload */
typedef struct ferry__proto_rd {
    const uint8_t *p, *end;
    int err;              /* set once a read ran past the end */
} ferry__proto_rd;
uint8_t ferry__proto_get_u8(ferry__proto_rd *r);
uint32_t ferry__proto_get_u32(ferry__proto_rd *r);
uint64_t ferry__proto_get_u64(ferry__proto_rd *r);
void ferry__proto_get_id(ferry__proto_rd *r, ferry_kv_hash *id);

/*
 * Decode a header from p[0..len) (len >= FERRY__PROTO_HDR). 0, or
 * FERRY_EPARSE (bad magic, flags or a payload over the bound: the stream
 * cannot be resynchronized) or FERRY_EVERSION (another version: *h holds
 * the rid so the reply can name it); why gets the cause.
 */
int ferry__proto_hdr_decode(const uint8_t *p, size_t len, ferry__proto_hdr *h, char *why,
                            size_t whylen);
void ferry__proto_hdr_encode(uint8_t *p, const ferry__proto_hdr *h);

/*
 * Decode a request's payload (p, h->len bytes) into r (r->chunks and
 * r->max_chunks set by the caller). 0, or FERRY_EPARSE (malformed:
 * truncated, trailing bytes, a count over its bound or the caller's
 * array, a bad field), FERRY_ENOTSUP (an unknown type); why gets the
 * cause. The frame itself stays in sync either way.
 */
int ferry__proto_req_decode(const ferry__proto_hdr *h, const uint8_t *p, ferry__proto_req *r,
                            char *why, size_t whylen);
/* encode a request frame from r (r->hdr.type, rid; per-type fields) */
int ferry__proto_req_encode(ferry__proto_buf *b, const ferry__proto_req *r);

/* a reply's common head: rc and, when rc < 0, its message */
void ferry__proto_reply_begin(ferry__proto_buf *b, uint8_t type, uint64_t rid, int32_t rc,
                              const char *msg);
/* read the head of a reply payload: rc, and the message into msg */
int32_t ferry__proto_reply_head(ferry__proto_rd *r, char *msg, size_t msglen);

/* the name of a request type, for messages */
const char *ferry__proto_type_name(unsigned type);

#endif
