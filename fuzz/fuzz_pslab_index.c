/*
 * fuzz_pslab_index.c - the persistent slab's journal replay (index and
 * allocator rebuild) on arbitrary bytes: no crash, no leak, and whatever
 * it accepts obeys the loader's invariant - every indexed extent inside
 * the slab, aligned, disjoint from the others, and exactly what the
 * rebuilt allocator holds (ferry_slab_check passes, used bytes agree).
 *
 * The first byte picks a mode: even - the bytes are the journal as is;
 * odd - the bytes after it are made well-formed first (header and record
 * checksums recomputed, key lengths bounded, piece puts given a piece
 * size, a count that fits their length and their table's sum), so the
 * fuzzer reaches the replay rules (overwrites, deletes by sequence,
 * ranges, overlaps, barrier flags, bad records before a barrier - damage,
 * in a head or in a piece table - or after the last one - a torn tail)
 * instead of stopping at the first checksum. An entry of a piece put
 * holds a piece size the format allows and one sum per piece.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "pslab/pslab_int.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static uint64_t rd64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}
static void wr64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

/* make buf a well-formed journal, as far as its bytes allow */
static void repair(uint8_t *b, size_t n)
{
    if (n < FERRY__PSLAB_JHDR_BYTES)
        return;
    memcpy(b, "FERRYPJL", 8);
    b[8] = (uint8_t)(1 + b[8] % FERRY_PSLAB_FORMAT), b[9] = b[10] = b[11] = 0;
    b[12] = FERRY__PSLAB_JHDR_BYTES, b[13] = b[14] = b[15] = 0;
    /* a small geometry: capacity 1..256 units of 4096, one drive */
    uint64_t cap = ((rd64(b + 24) % 256) + 1) * 4096;
    wr64(b + 24, cap);
    b[40] = 0, b[41] = 0x10, b[42] = b[43] = 0; /* alignment 4096 */
    b[44] = 1, b[45] = b[46] = b[47] = 0;       /* one drive */
    wr64(b + 48, 1u << 20);
    wr64(b + 56, XXH3_64bits(b, 56));
    uint64_t seed = rd64(b + 16);
    size_t pos = FERRY__PSLAB_JHDR_BYTES;
    while (pos + FERRY__PSLAB_REC_FIXED <= n) {
        uint8_t *r = b + pos;
        uint32_t klen = (uint32_t)(r[4] % 8) + 1;
        if (pos + FERRY__PSLAB_REC_FIXED + klen > n)
            break;
        r[0] = 0xE7, r[1] = 0xF5;
        r[2] = (uint8_t)(r[2] % 3 + 1);
        /* bit 0: a barrier; bit 6 set: leave this record bad (damage or
         * tail), in its table when bit 5 is set too (a piece put) */
        int bad = (r[3] & 0x40) != 0, bad_table = bad && (r[3] & 0x20);
        r[3] &= FERRY__PSLAB_REC_BARRIER;
        r[4] = (uint8_t)klen, r[5] = r[6] = r[7] = 0;
        /* offsets and lengths near the geometry, so ranges and overlaps matter */
        wr64(r + 16, (rd64(r + 16) % 300) * 4096 / ((r[9] & 1) ? 1 : 2));
        wr64(r + 24, rd64(r + 24) % (5 * 4096));
        wr64(r + 8, rd64(r + 8) % 64);
        if (r[2] == 2)
            wr64(r + 32, rd64(r + 32) % 64);
        size_t m = FERRY__PSLAB_REC_HEAD + klen, tab = 0;
        if (r[2] == FERRY__PSLAB_PUTP) {
            /* pieces of 4, 8 or 16 KiB (or a 2 KiB one replay must refuse) */
            uint64_t len = rd64(r + 24) + 1;
            wr64(r + 24, len);
            uint32_t piece = (r[10] & 0x80) ? 2048u : 4096u << (r[10] % 3);
            uint32_t np = (uint32_t)((len + piece - 1) / piece);
            tab = 8 * (size_t)np;
            if (pos + m + 16 + tab > n)
                break;
            for (int i = 0; i < 4; i++) {
                r[m + (size_t)i] = (uint8_t)(piece >> (8 * i));
                r[m + 4 + (size_t)i] = (uint8_t)(np >> (8 * i));
            }
            wr64(r + 32, XXH3_64bits(r + m + 16, tab));
            m += 8;
            if (bad_table)
                r[m + 8 + (rd64(r + 8) % tab)] ^= 0x10;
        }
        wr64(r + m, XXH3_64bits_withSeed(r, m, seed) ^ (bad && !bad_table ? 1u : 0u));
        pos += m + 8 + tab;
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1 || size > (1u << 20))
        return 0;
    size_t n = size - 1;
    uint8_t *b = malloc(n ? n : 1);
    if (!b)
        return 0;
    memcpy(b, data + 1, n);
    if (data[0] & 1)
        repair(b, n);
    ferry__pslab_index ix;
    ferry_slab *alloc = NULL;
    ferry__pslab_load st;
    char why[256];
    if (ferry__pslab_index_load(b, n, NULL, &ix, &alloc, &st, why, sizeof why) == 0) {
        const ferry__pslab_geom *g = &st.jh.g;
        uint64_t used = 0;
        for (size_t i = 0; i < ix.nb; i++)
            for (ferry__pslab_ent *e = ix.b[i]; e; e = e->hnext) {
                if (e->offset % g->alignment || e->ext % g->alignment || !e->length ||
                    e->length > e->ext || e->offset + e->ext > g->capacity)
                    abort();
                if (e->piece ? (e->piece & (e->piece - 1)) || e->piece < FERRY__PSLAB_PIECE_MIN ||
                                   e->piece > FERRY__PSLAB_PIECE_MAX ||
                                   e->piece % g->alignment || !e->psum ||
                                   e->npieces != (e->length + e->piece - 1) / e->piece ||
                                   e->sum != ferry__pslab_table_sum(e->psum, e->npieces)
                             : e->npieces || e->psum)
                    abort();
                if (ferry_slab_state(alloc, e->offset, NULL) == FERRY_EXTENT_ABSENT)
                    abort();
                used += e->ext;
            }
        ferry_slab_stats ss = FERRY_SLAB_STATS_INIT;
        if (ferry_slab_check(alloc) != 0 || ferry_slab_stats_get(alloc, &ss) != 0 ||
            ss.used != used || ss.used_blocks != ix.count || used != ix.bytes_used)
            abort();
        if (st.good_end > n || st.good_end < FERRY__PSLAB_JHDR_BYTES ||
            st.damaged_bytes > n || (st.damaged && st.bad_off >= st.good_end))
            abort();
        ferry__pslab_index_fini(&ix);
        ferry_slab_destroy(alloc);
    }
    free(b);
    return 0;
}
