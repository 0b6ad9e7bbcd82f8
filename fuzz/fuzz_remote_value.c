/*
 * fuzz_remote_value.c - the remote value header codec on arbitrary bytes.
 *
 * Input: byte 0 = length L of an expected layout taken from the next L
 * bytes, the rest is a value as the server would return it. Checks:
 *  - decode either refuses with FERRY_ECORRUPT/EVERSION/EMISMATCH or hands
 *    back a payload lying inside the input whose length adds up;
 *  - the same payload encoded with that layout decodes to itself, and any
 *    single flipped byte of that encoding is refused (never returned);
 *  - a bounded read's outcome (ferry__rvalue_range_outcome), of the whole
 *    value or of only its first bytes, into a destination of a size the
 *    input picks: data only for a whole value that decodes and fits, its
 *    payload copied exactly; a cut value is always refused.
 */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "remote/remote_int.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    size_t ll = data[0];
    if (ll > size - 1)
        ll = size - 1;
    const uint8_t *layout = data + 1, *val = data + 1 + ll;
    size_t vlen = size - 1 - ll;
    uint64_t ks = ferry__rvalue_key_sum("key", 3);
    const void *pl = NULL;
    size_t plen = 0;
    ferry__errbuf eb;
    int rc = ferry__rvalue_decode(val, vlen, layout, ll, ks, &pl, &plen, &eb);
    if (rc == 0) {
        const uint8_t *p = pl;
        if (p < val || p + plen != val + vlen)
            abort();
    } else if (rc != FERRY_ECORRUPT && rc != FERRY_EVERSION && rc != FERRY_EMISMATCH) {
        abort();
    }
    ferry__rvalue_hdr h;
    rc = ferry__rvalue_parse_header(val, vlen, &h, &eb);
    if (rc == 0 && (h.header_len > vlen || h.layout_len > FERRY_REMOTE_LAYOUT_MAX))
        abort();

    /* a bounded read: the whole value, or its first bytes only */
    for (int whole = 0; whole < 2; whole++) {
        uint8_t dst[256];
        ferry__rget g = {0};
        g.layout = layout;
        g.layout_len = ll;
        g.key_sum = ks;
        g.dst = dst;
        g.cap = vlen ? val[vlen - 1] : 0; /* <= sizeof dst */
        ferry__rvalue_range_outcome(&g, val, vlen, whole);
        if (g.kind != FERRY__RGET_VALUE || g.value_len != vlen)
            abort();
        if (g.code == 0) {
            if (!whole || ferry__rvalue_decode(val, vlen, layout, ll, ks, &pl, &plen, &eb) ||
                g.payload_len != plen || plen > g.cap || (plen && memcmp(dst, pl, plen)))
                abort();
        } else if (g.code != FERRY_ECORRUPT && g.code != FERRY_EVERSION &&
                   g.code != FERRY_EMISMATCH && g.code != -ENOBUFS) {
            abort();
        }
    }

    /* round trip of the value bytes as a payload */
    size_t hl = ferry__rvalue_header_size(ll);
    uint8_t *enc = malloc(hl + vlen + 1);
    if (!enc)
        return 0;
    ferry__rvalue_encode_header(enc, layout, ll, ks, val, vlen);
    memcpy(enc + hl, val, vlen);
    if (ferry__rvalue_decode(enc, hl + vlen, layout, ll, ks, &pl, &plen, &eb) != 0 ||
        plen != vlen || (vlen && memcmp(pl, val, vlen)))
        abort();
    size_t at = (vlen ? val[0] * 131u + vlen : ll) % (hl + vlen);
    enc[at] ^= 0x01;
    if (ferry__rvalue_decode(enc, hl + vlen, layout, ll, ks, &pl, &plen, &eb) == 0)
        abort();
    free(enc);
    return 0;
}
