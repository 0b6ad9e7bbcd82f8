/*
 * remote_value.c - the header in front of every value the remote tier stores.
 *
 * Layout (little-endian), FERRY_REMOTE_HEADER_FIXED = 48 bytes + layout:
 *    0  "FRYV"        magic
 *    4  u16 version   FERRY__RVALUE_VERSION (1)
 *    6  u16 hdr_len   48 + layout_len
 *    8  u32 flags     0 in version 1
 *   12  u32 layout_len  <= FERRY_REMOTE_LAYOUT_MAX
 *   16  u64 payload_len
 *   24  u64 XXH3-64 of the payload
 *   32  u64 XXH3-64 of the caller's key (a value copied under another key,
 *           or a hash collision of a caller's key scheme, is refused)
 *   40  u64 XXH3-64 of bytes 0..40 and the layout bytes
 *   48  layout bytes (the writer's fingerprint of model and KV layout)
 *   hdr_len.. payload
 *
 * Invariant: a value is handed back as data only when every field checks
 * out: magic, version, lengths that add up to exactly what the server
 * returned, the header checksum, the reader's layout and key hash, and the
 * payload checksum. Anything else is FERRY_ECORRUPT, FERRY_EVERSION or
 * FERRY_EMISMATCH. The bytes come from the network and are fuzzed
 * (fuzz/fuzz_remote_value.c); the parser reads buf[0..len) only.
 * A value read through a bounded GETRANGE (the generic reply path) may be
 * only its first bytes: then it is refused from its header alone
 * (ferry__rvalue_range_outcome), never taken as data.
 */
#include <errno.h>
#include <string.h>

#include <xxhash.h>

#include "le.h"

#include "remote_int.h"

static uint64_t header_sum(const uint8_t *hdr, const void *layout, size_t layout_len)
{
    uint8_t tmp[40 + FERRY_REMOTE_LAYOUT_MAX];
    memcpy(tmp, hdr, 40);
    if (layout_len)
        memcpy(tmp + 40, layout, layout_len);
    return XXH3_64bits(tmp, 40 + layout_len);
}

uint64_t ferry__rvalue_key_sum(const void *key, size_t len)
{
    return XXH3_64bits(key, len);
}

size_t ferry__rvalue_header_size(size_t layout_len)
{
    return FERRY_REMOTE_HEADER_FIXED + layout_len;
}

void ferry__rvalue_encode_header(void *dst, const void *layout, size_t layout_len,
                                 uint64_t key_sum, const void *payload, size_t len)
{
    uint8_t *h = dst;
    memcpy(h, FERRY__RVALUE_MAGIC, 4);
    ferry__put16(h + 4, FERRY__RVALUE_VERSION);
    ferry__put16(h + 6, (uint16_t)(FERRY_REMOTE_HEADER_FIXED + layout_len));
    ferry__put32(h + 8, 0);
    ferry__put32(h + 12, (uint32_t)layout_len);
    ferry__put64(h + 16, len);
    ferry__put64(h + 24, XXH3_64bits(len ? payload : "", len));
    ferry__put64(h + 32, key_sum);
    if (layout_len)
        memcpy(h + FERRY_REMOTE_HEADER_FIXED, layout, layout_len);
    ferry__put64(h + 40, header_sum(h, layout, layout_len));
}

int ferry__rvalue_parse_header(const void *buf, size_t len, ferry__rvalue_hdr *out,
                               ferry__errbuf *eb)
{
    const uint8_t *p = buf;
    if (len < FERRY_REMOTE_HEADER_FIXED)
        return ferry__err_set(eb, FERRY_ECORRUPT,
                              "remote value: %zu bytes, shorter than the %u-byte header", len,
                              FERRY_REMOTE_HEADER_FIXED);
    if (memcmp(p, FERRY__RVALUE_MAGIC, 4))
        return ferry__err_set(eb, FERRY_ECORRUPT,
                              "remote value: bad magic %02x %02x %02x %02x (not a ferry value)",
                              p[0], p[1], p[2], p[3]);
    ferry__rvalue_hdr h;
    h.version = ferry__get16(p + 4);
    h.header_len = ferry__get16(p + 6);
    h.flags = ferry__get32(p + 8);
    h.layout_len = ferry__get32(p + 12);
    h.payload_len = ferry__get64(p + 16);
    h.payload_sum = ferry__get64(p + 24);
    h.key_sum = ferry__get64(p + 32);
    if (h.version == 0)
        return ferry__err_set(eb, FERRY_ECORRUPT, "remote value: format version 0");
    if (h.version > FERRY__RVALUE_VERSION)
        return ferry__err_set(eb, FERRY_EVERSION,
                              "remote value: format version %u is newer than this ferry's %u",
                              h.version, FERRY__RVALUE_VERSION);
    if (h.layout_len > FERRY_REMOTE_LAYOUT_MAX ||
        h.header_len != FERRY_REMOTE_HEADER_FIXED + h.layout_len)
        return ferry__err_set(eb, FERRY_ECORRUPT,
                              "remote value: header length %u does not match layout length %u "
                              "(max %u)",
                              h.header_len, h.layout_len, FERRY_REMOTE_LAYOUT_MAX);
    if (len < h.header_len)
        return ferry__err_set(eb, FERRY_ECORRUPT,
                              "remote value: %zu bytes, shorter than its %u-byte header", len,
                              h.header_len);
    h.layout = p + FERRY_REMOTE_HEADER_FIXED;
    uint64_t want = ferry__get64(p + 40), got = header_sum(p, h.layout, h.layout_len);
    if (want != got)
        return ferry__err_set(eb, FERRY_ECORRUPT,
                              "remote value: header checksum %016llx, stored %016llx",
                              (unsigned long long)got, (unsigned long long)want);
    if (h.flags != 0)
        return ferry__err_set(eb, FERRY_ECORRUPT, "remote value: unknown flags 0x%x in version 1",
                              h.flags);
    *out = h;
    return 0;
}

int ferry__rvalue_match(const ferry__rvalue_hdr *h, const void *layout, size_t layout_len,
                        uint64_t key_sum, ferry__errbuf *eb)
{
    if (h->layout_len != layout_len || (layout_len && memcmp(h->layout, layout, layout_len)))
        return ferry__err_set(eb, FERRY_EMISMATCH,
                              "remote value: written for another layout (%u-byte fingerprint, "
                              "reader has %zu bytes%s)",
                              h->layout_len, layout_len,
                              h->layout_len == layout_len ? ", contents differ" : "");
    if (h->key_sum != key_sum)
        return ferry__err_set(eb, FERRY_EMISMATCH,
                              "remote value: written for another key (key hash %016llx, "
                              "expected %016llx)",
                              (unsigned long long)h->key_sum, (unsigned long long)key_sum);
    return 0;
}

int ferry__rvalue_decode(const void *buf, size_t len, const void *layout, size_t layout_len,
                         uint64_t key_sum, const void **payload, size_t *payload_len,
                         ferry__errbuf *eb)
{
    ferry__rvalue_hdr h;
    int rc = ferry__rvalue_parse_header(buf, len, &h, eb);
    if (rc)
        return rc;
    if (h.payload_len != len - h.header_len)
        return ferry__err_set(eb, FERRY_ECORRUPT,
                              "remote value: header says %llu payload bytes, %zu arrived",
                              (unsigned long long)h.payload_len, len - h.header_len);
    rc = ferry__rvalue_match(&h, layout, layout_len, key_sum, eb);
    if (rc)
        return rc;
    const uint8_t *pl = (const uint8_t *)buf + h.header_len;
    uint64_t got = XXH3_64bits(h.payload_len ? (const void *)pl : "", (size_t)h.payload_len);
    if (got != h.payload_sum)
        return ferry__err_set(eb, FERRY_ECORRUPT,
                              "remote value: payload checksum %016llx over %llu bytes, stored "
                              "%016llx",
                              (unsigned long long)got, (unsigned long long)h.payload_len,
                              (unsigned long long)h.payload_sum);
    *payload = pl;
    *payload_len = (size_t)h.payload_len;
    return 0;
}

void ferry__rvalue_range_outcome(ferry__rget *g, const void *buf, size_t len, int whole)
{
    ferry__errbuf eb;
    const void *pl = NULL;
    size_t plen = 0;
    ferry__rvalue_hdr h;
    g->kind = FERRY__RGET_VALUE;
    g->value_len = len;
    g->read_len = len;
    g->code = 0;
    if (whole) {
        g->code = ferry__rvalue_decode(buf, len, g->layout, g->layout_len, g->key_sum, &pl,
                                       &plen, &eb);
        if (g->code == 0 && plen > g->cap)
            g->code = ferry__err_set(&eb, -ENOBUFS, "value of %zu bytes does not fit the "
                                     "%zu-byte destination", plen, g->cap);
    } else if (!(g->code = ferry__rvalue_parse_header(buf, len, &h, &eb)) &&
               !(g->code = ferry__rvalue_match(&h, g->layout, g->layout_len, g->key_sum,
                                                &eb))) {
        /* the value goes on past what was read: longer than the destination
         * by its header's word, or longer than its header says */
        if (h.payload_len > g->cap)
            g->code = ferry__err_set(&eb, -ENOBUFS, "value of %llu bytes does not fit the "
                                     "%zu-byte destination",
                                     (unsigned long long)h.payload_len, g->cap);
        else
            g->code = ferry__err_set(&eb, FERRY_ECORRUPT, "remote value: header says %llu "
                                     "payload bytes, more than %zu arrived",
                                     (unsigned long long)h.payload_len, len - h.header_len);
    }
    if (g->code) {
        memcpy(g->msg, eb.msg, sizeof g->msg);
        return;
    }
    if (plen)
        memcpy(g->dst, pl, plen);
    g->payload_len = plen;
}
