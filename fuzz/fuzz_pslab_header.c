/*
 * fuzz_pslab_header.c - the persistent slab's header readers (slab file
 * header and journal header) on arbitrary bytes: no crash, no leak, and a
 * header that decodes re-encodes to the same bytes and decodes again to
 * the same fields, tag included (nothing accepted that a writer could not
 * have written).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pslab/pslab_int.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* field by field: the structs have padding */
static int geom_eq(const ferry__pslab_geom *a, const ferry__pslab_geom *b)
{
    return a->capacity == b->capacity && a->alignment == b->alignment &&
           a->drives == b->drives && a->stripe == b->stripe && a->creation_id == b->creation_id;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char why[256];
    ferry__pslab_hdr h, h2;
    if (ferry__pslab_hdr_decode(data, size, &h, why, sizeof why) == 0) {
        uint8_t out[FERRY__PSLAB_HDR_BYTES + FERRY_PSLAB_TAG_MAX];
        ferry__pslab_hdr_encode(&h, out);
        size_t n = FERRY__PSLAB_HDR_BYTES + h.tag_len;
        if (h.tag_len > FERRY_PSLAB_TAG_MAX || n > size || memcmp(out, data, n) != 0)
            abort();
        if (ferry__pslab_hdr_decode(out, n, &h2, why, sizeof why) != 0 ||
            !geom_eq(&h.g, &h2.g) || h.version != h2.version ||
            h.drive != h2.drive || h.created_ns != h2.created_ns ||
            h.tag_len != h2.tag_len || (h.tag_len && memcmp(h.tag, h2.tag, h.tag_len)))
            abort();
        if (ferry__pslab_geom_check(&h.g, why, sizeof why) != 0 || h.drive >= h.g.drives)
            abort();
    }
    ferry__pslab_jhdr j, j2;
    if (ferry__pslab_jhdr_decode(data, size, &j, why, sizeof why) == 0) {
        uint8_t out[FERRY__PSLAB_JHDR_BYTES];
        ferry__pslab_jhdr_encode(&j, out);
        if (memcmp(out, data, FERRY__PSLAB_JHDR_BYTES) != 0)
            abort();
        if (ferry__pslab_jhdr_decode(out, sizeof out, &j2, why, sizeof why) != 0 ||
            !geom_eq(&j.g, &j2.g) || j.version != j2.version ||
            j.generation != j2.generation)
            abort();
    }
    return 0;
}
