/*
 * fuzz_serve_frame.c - the daemon's decoder of `ferry serve` frames
 * (ferry__proto_hdr_decode, ferry__proto_req_decode) on arbitrary bytes
 * from a "client", and the client's reading of a reply's head.
 *
 * The input is read as the daemon reads a connection: a header, its
 * payload, the next header... Byte 0 bounds the chunks the decoder may
 * take (1..256). Checks: a header is accepted only with a payload within
 * the bound; a request is accepted only when its payload is consumed
 * exactly, and then encodes back to the very bytes it came from (the
 * encoding is canonical: nothing the decoder let through was ignored); a
 * header that cannot be trusted ends the stream, as it ends a connection.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "proto/proto.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void check_request(const ferry__proto_hdr *h, const uint8_t *p, size_t max)
{
    ferry__proto_chunk *ch = malloc((max ? max : 1) * sizeof *ch);
    if (!ch)
        return;
    ferry__proto_req q;
    memset(&q, 0, sizeof q);
    q.chunks = ch;
    q.max_chunks = max;
    char why[256];
    int rc = ferry__proto_req_decode(h, p, &q, why, sizeof why);
    if (rc == 0) {
        if (q.n > max || q.n > FERRY__PROTO_MAX_CHUNKS)
            abort();
        ferry__proto_buf b = {0};
        if (ferry__proto_req_encode(&b, &q) == 0) {
            if (b.len != FERRY__PROTO_HDR + h->len || memcmp(b.p + FERRY__PROTO_HDR, p, h->len))
                abort();
        }
        ferry__proto_buf_free(&b);
    } else if (rc != FERRY_EPARSE && rc != FERRY_ENOTSUP) {
        abort();
    } else if (!why[0]) {
        abort(); /* every refusal says why */
    }
    free(ch);
}

static void check_reply_head(const uint8_t *p, size_t n)
{
    ferry__proto_rd rd = {p, p + n, 0};
    char msg[FERRY__PROTO_MAX_MSG + 1];
    int32_t rc = ferry__proto_reply_head(&rd, msg, sizeof msg);
    if (rd.p > rd.end || strlen(msg) > FERRY__PROTO_MAX_MSG || (rd.err && rc != FERRY_EPARSE))
        abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    size_t max = (size_t)data[0] + 1;
    data++;
    size--;
    check_reply_head(data, size);
    while (size >= FERRY__PROTO_HDR) {
        ferry__proto_hdr h;
        char why[256];
        int rc = ferry__proto_hdr_decode(data, size, &h, why, sizeof why);
        if (rc < 0) {
            if (rc != FERRY_EPARSE && rc != FERRY_EVERSION)
                abort();
            return 0; /* the daemon ends the connection here */
        }
        if (h.len > FERRY__PROTO_MAX_PAYLOAD)
            abort();
        data += FERRY__PROTO_HDR;
        size -= FERRY__PROTO_HDR;
        if (h.len > size)
            return 0; /* truncated: the daemon waits for the rest */
        /* a copy of exactly the payload, so a read past it is caught */
        uint8_t *p = malloc(h.len ? h.len : 1);
        if (!p)
            return 0;
        memcpy(p, data, h.len);
        check_request(&h, p, max);
        free(p);
        data += h.len;
        size -= h.len;
    }
    return 0;
}
