/*
 * proto.c - encoding and bounded decoding of the serve protocol's frames
 * (proto.h, docs/PROTOCOL.md).
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "core.h"
#include "le.h"
#include "proto/proto.h"

/* ---- output ---- */

void ferry__proto_buf_free(ferry__proto_buf *b)
{
    ferry__free(b->p);
    b->p = NULL;
    b->len = b->cap = 0;
    b->err = 0;
}

static uint8_t *grow(ferry__proto_buf *b, size_t n)
{
    if (b->err)
        return NULL;
    if (n > FERRY__PROTO_HDR + FERRY__PROTO_MAX_PAYLOAD - b->len) {
        b->err = -EMSGSIZE;
        return NULL;
    }
    if (b->len + n > b->cap) {
        size_t nc = b->cap ? b->cap : 256;
        while (nc < b->len + n)
            nc *= 2;
        uint8_t *np = ferry__realloc(b->p, nc);
        if (!np) {
            b->err = -ENOMEM;
            return NULL;
        }
        b->p = np;
        b->cap = nc;
    }
    uint8_t *at = b->p + b->len;
    b->len += n;
    return at;
}

void ferry__proto_put_u8(ferry__proto_buf *b, uint8_t v)
{
    uint8_t *p = grow(b, 1);
    if (p)
        *p = v;
}

void ferry__proto_put_u32(ferry__proto_buf *b, uint32_t v)
{
    uint8_t *p = grow(b, 4);
    if (p)
        ferry__put32(p, v);
}

void ferry__proto_put_u64(ferry__proto_buf *b, uint64_t v)
{
    uint8_t *p = grow(b, 8);
    if (p)
        ferry__put64(p, v);
}

void ferry__proto_put_bytes(ferry__proto_buf *b, const void *src, size_t n)
{
    uint8_t *p = grow(b, n);
    if (p && n)
        memcpy(p, src, n);
}

void ferry__proto_put_id(ferry__proto_buf *b, const ferry_kv_hash *id)
{
    ferry__proto_put_u64(b, id->lo);
    ferry__proto_put_u64(b, id->hi);
}

void ferry__proto_hdr_encode(uint8_t *p, const ferry__proto_hdr *h)
{
    p[0] = FERRY__PROTO_MAGIC;
    p[1] = h->version;
    p[2] = h->type;
    p[3] = h->flags;
    ferry__put32(p + 4, h->len);
    ferry__put64(p + 8, h->rid);
}

void ferry__proto_begin(ferry__proto_buf *b, uint8_t type, uint64_t rid)
{
    b->len = 0;
    b->err = 0;
    uint8_t *p = grow(b, FERRY__PROTO_HDR);
    if (p) {
        ferry__proto_hdr h = {FERRY__PROTO_VERSION, type, 0, 0, rid};
        ferry__proto_hdr_encode(p, &h);
    }
}

int ferry__proto_end(ferry__proto_buf *b)
{
    if (b->err)
        return b->err;
    ferry__put32(b->p + 4, (uint32_t)(b->len - FERRY__PROTO_HDR));
    return 0;
}

/* ---- input ---- */

static const uint8_t *take(ferry__proto_rd *r, size_t n)
{
    if (r->err || (size_t)(r->end - r->p) < n) {
        r->err = 1;
        return NULL;
    }
    const uint8_t *at = r->p;
    r->p += n;
    return at;
}

uint8_t ferry__proto_get_u8(ferry__proto_rd *r)
{
    const uint8_t *p = take(r, 1);
    return p ? *p : 0;
}

uint32_t ferry__proto_get_u32(ferry__proto_rd *r)
{
    const uint8_t *p = take(r, 4);
    return p ? ferry__get32(p) : 0;
}

uint64_t ferry__proto_get_u64(ferry__proto_rd *r)
{
    const uint8_t *p = take(r, 8);
    return p ? ferry__get64(p) : 0;
}

void ferry__proto_get_id(ferry__proto_rd *r, ferry_kv_hash *id)
{
    id->lo = ferry__proto_get_u64(r);
    id->hi = ferry__proto_get_u64(r);
}

int ferry__proto_hdr_decode(const uint8_t *p, size_t len, ferry__proto_hdr *h, char *why,
                            size_t whylen)
{
    if (len < FERRY__PROTO_HDR) {
        snprintf(why, whylen, "a header of %zu bytes (needs %u)", len, FERRY__PROTO_HDR);
        return FERRY_EPARSE;
    }
    h->version = p[1];
    h->type = p[2];
    h->flags = p[3];
    h->len = ferry__get32(p + 4);
    h->rid = ferry__get64(p + 8);
    if (p[0] != FERRY__PROTO_MAGIC) {
        snprintf(why, whylen, "bad magic 0x%02x (expected 0x%02x)", p[0], FERRY__PROTO_MAGIC);
        return FERRY_EPARSE;
    }
    if (h->version != FERRY__PROTO_VERSION) {
        snprintf(why, whylen, "protocol version %u (this side speaks %u)", h->version,
                 FERRY__PROTO_VERSION);
        return FERRY_EVERSION;
    }
    if (h->flags != 0) {
        snprintf(why, whylen, "frame flags 0x%02x (none are defined)", h->flags);
        return FERRY_EPARSE;
    }
    if (h->len > FERRY__PROTO_MAX_PAYLOAD) {
        snprintf(why, whylen, "a payload of %u bytes (at most %u)", h->len,
                 FERRY__PROTO_MAX_PAYLOAD);
        return FERRY_EPARSE;
    }
    return 0;
}

const char *ferry__proto_type_name(unsigned type)
{
    static const char *const names[FERRY__P_TYPES] = {
        "?", "HELLO", "LOOKUP", "RESERVE", "COMMIT", "ACQUIRE", "RELEASE",
        "DELETE", "STATS", "FLUSH", "SYNC", "CLEAR", "PING", "PREFETCH", "WAIT", "WHY"};
    type &= ~FERRY__PROTO_REPLY;
    if (type == FERRY__P_ERROR)
        return "ERROR";
    return type < FERRY__P_TYPES ? names[type] : "unknown";
}

/* bytes one chunk takes in a request of type t */
static size_t chunk_wire(unsigned t)
{
    switch (t) {
    case FERRY__P_LOOKUP:
    case FERRY__P_ACQUIRE:
    case FERRY__P_DELETE:
    case FERRY__P_PREFETCH:
        return 16;
    case FERRY__P_RESERVE:
        return 20;
    case FERRY__P_COMMIT:
        return 36;
    case FERRY__P_RELEASE:
        return 32;
    default:
        return 0;
    }
}

static int decode_hello(ferry__proto_rd *rd, ferry__proto_hello *h)
{
    h->layout.size = sizeof h->layout;
    h->layout.num_layers = ferry__proto_get_u32(rd);
    h->layout.kv = ferry__proto_get_u32(rd);
    h->layout.num_heads = ferry__proto_get_u32(rd);
    h->layout.head_dim = ferry__proto_get_u32(rd);
    h->layout.dtype = (int)ferry__proto_get_u32(rd);
    h->chunk_tokens = ferry__proto_get_u32(rd);
    h->seed = ferry__proto_get_u64(rd);
    h->flags = ferry__proto_get_u32(rd);
    return rd->err ? -1 : 0;
}

static void decode_chunk(ferry__proto_rd *rd, unsigned t, ferry__proto_chunk *c)
{
    memset(c, 0, sizeof *c);
    ferry__proto_get_id(rd, &c->id);
    if (t == FERRY__P_RESERVE)
        c->tokens = ferry__proto_get_u32(rd);
    if (t == FERRY__P_COMMIT || t == FERRY__P_RELEASE) {
        c->slot = ferry__proto_get_u64(rd);
        c->gen = ferry__proto_get_u64(rd);
    }
    if (t == FERRY__P_COMMIT)
        c->status = (int32_t)ferry__proto_get_u32(rd);
}

int ferry__proto_req_decode(const ferry__proto_hdr *h, const uint8_t *p, ferry__proto_req *r,
                            char *why, size_t whylen)
{
    ferry__proto_rd rd = {p, p + h->len, 0};
    unsigned t = h->type;
    r->hdr = *h;
    r->n = 0;
    if (t == 0 || t >= FERRY__P_TYPES) {
        snprintf(why, whylen, "unknown request type %u", t);
        return FERRY_ENOTSUP;
    }
    if (t == FERRY__P_HELLO) {
        if (decode_hello(&rd, &r->hello) < 0 || rd.p != rd.end) {
            snprintf(why, whylen, "HELLO of %u bytes (must be 36)", h->len);
            return FERRY_EPARSE;
        }
        return 0;
    }
    if (t == FERRY__P_WAIT) {
        r->tokens = ferry__proto_get_u32(&rd);
        if (rd.err || rd.p != rd.end || r->tokens > FERRY_KV_POOL_WAIT_MS_MAX) {
            snprintf(why, whylen, "WAIT of %u bytes, %llu ms (must be 4 bytes, 0 to %d ms)",
                     h->len, (unsigned long long)r->tokens, FERRY_KV_POOL_WAIT_MS_MAX);
            return FERRY_EPARSE;
        }
        return 0;
    }
    size_t cw = chunk_wire(t);
    if (!cw) {
        if (h->len != 0) {
            snprintf(why, whylen, "%s with a payload of %u bytes (must be empty)",
                     ferry__proto_type_name(t), h->len);
            return FERRY_EPARSE;
        }
        return 0;
    }
    if (t == FERRY__P_LOOKUP)
        r->tokens = ferry__proto_get_u64(&rd);
    uint32_t n = ferry__proto_get_u32(&rd);
    if (rd.err) {
        snprintf(why, whylen, "%s truncated before its chunk count (%u bytes)",
                 ferry__proto_type_name(t), h->len);
        return FERRY_EPARSE;
    }
    size_t left = (size_t)(rd.end - rd.p);
    if (n == 0 || n > FERRY__PROTO_MAX_CHUNKS || n > r->max_chunks) {
        snprintf(why, whylen, "%s names %u chunks (1 to %zu)", ferry__proto_type_name(t), n,
                 FERRY__MIN((size_t)FERRY__PROTO_MAX_CHUNKS, r->max_chunks));
        return FERRY_EPARSE;
    }
    if (left != (size_t)n * cw) {
        snprintf(why, whylen, "%s of %u chunks carries %zu bytes for them (must be %zu)",
                 ferry__proto_type_name(t), n, left, (size_t)n * cw);
        return FERRY_EPARSE;
    }
    for (uint32_t i = 0; i < n; i++) {
        decode_chunk(&rd, t, &r->chunks[i]);
        if (t == FERRY__P_COMMIT && (uint32_t)r->chunks[i].status > 1) {
            snprintf(why, whylen, "COMMIT chunk %u: action %d (0 commit, 1 abort)", i,
                     r->chunks[i].status);
            return FERRY_EPARSE;
        }
        if (t == FERRY__P_RESERVE && r->chunks[i].tokens == 0) {
            snprintf(why, whylen, "RESERVE chunk %u covers 0 tokens", i);
            return FERRY_EPARSE;
        }
    }
    r->n = n;
    return 0;
}

int ferry__proto_req_encode(ferry__proto_buf *b, const ferry__proto_req *r)
{
    unsigned t = r->hdr.type;
    ferry__proto_begin(b, (uint8_t)t, r->hdr.rid);
    if (t == FERRY__P_HELLO) {
        const ferry__proto_hello *h = &r->hello;
        ferry__proto_put_u32(b, h->layout.num_layers);
        ferry__proto_put_u32(b, h->layout.kv);
        ferry__proto_put_u32(b, h->layout.num_heads);
        ferry__proto_put_u32(b, h->layout.head_dim);
        ferry__proto_put_u32(b, (uint32_t)h->layout.dtype);
        ferry__proto_put_u32(b, h->chunk_tokens);
        ferry__proto_put_u64(b, h->seed);
        ferry__proto_put_u32(b, h->flags);
        return ferry__proto_end(b);
    }
    if (t == FERRY__P_WAIT)
        ferry__proto_put_u32(b, (uint32_t)r->tokens);
    if (!chunk_wire(t))
        return ferry__proto_end(b);
    if (t == FERRY__P_LOOKUP)
        ferry__proto_put_u64(b, r->tokens);
    ferry__proto_put_u32(b, r->n);
    for (uint32_t i = 0; i < r->n; i++) {
        const ferry__proto_chunk *c = &r->chunks[i];
        ferry__proto_put_id(b, &c->id);
        if (t == FERRY__P_RESERVE)
            ferry__proto_put_u32(b, c->tokens);
        if (t == FERRY__P_COMMIT || t == FERRY__P_RELEASE) {
            ferry__proto_put_u64(b, c->slot);
            ferry__proto_put_u64(b, c->gen);
        }
        if (t == FERRY__P_COMMIT)
            ferry__proto_put_u32(b, (uint32_t)c->status);
    }
    return ferry__proto_end(b);
}

void ferry__proto_reply_begin(ferry__proto_buf *b, uint8_t type, uint64_t rid, int32_t rc,
                              const char *msg)
{
    ferry__proto_begin(b, (uint8_t)(type | FERRY__PROTO_REPLY), rid);
    ferry__proto_put_u32(b, (uint32_t)rc);
    if (rc < 0) {
        size_t n = msg ? strnlen(msg, FERRY__PROTO_MAX_MSG) : 0;
        ferry__proto_put_u32(b, (uint32_t)n);
        ferry__proto_put_bytes(b, msg, n);
    }
}

int32_t ferry__proto_reply_head(ferry__proto_rd *r, char *msg, size_t msglen)
{
    int32_t rc = (int32_t)ferry__proto_get_u32(r);
    if (msglen)
        msg[0] = '\0';
    if (rc >= 0 || r->err)
        return r->err ? FERRY_EPARSE : rc;
    uint32_t n = ferry__proto_get_u32(r);
    if (r->err || n > FERRY__PROTO_MAX_MSG || n > (size_t)(r->end - r->p)) {
        r->err = 1;
        return FERRY_EPARSE;
    }
    if (msglen) {
        size_t k = FERRY__MIN((size_t)n, msglen - 1);
        for (size_t i = 0; i < k; i++) {
            unsigned char ch = r->p[i];
            msg[i] = (char)(ch >= 0x20 && ch < 0x7f ? ch : '?');
        }
        msg[k] = '\0';
    }
    r->p += n;
    return rc;
}
