/*
 * pslab_fmt.c - the persistent slab's format codec, its in-memory index and
 * the journal replay that rebuilds both the index and the allocator.
 *
 * Invariant kept by the loader: what comes out describes only records that
 * a matching writer produced (magic, length bounds and an XXH3-64 seeded
 * with the slab's creation id all hold), in journal order, with extents
 * inside [0, capacity), aligned, and pairwise disjoint - so the allocator
 * rebuilt from them can never hand out bytes a live chunk still uses.
 * Records are appended in order and synced in batches, so a bad record is
 * a torn tail - it and what follows belong to a batch that was never
 * acknowledged: replay ends there - unless a barrier record follows it: the
 * writer sets that flag only when every byte before it was fdatasync'ed,
 * so the bad record was durable and was damaged afterwards. When exactly
 * one single-byte change makes the bad bytes a good record, or they are
 * a piece put whose head (a record of its own) is good and whose table is
 * not, that record names the only key it may have superseded, and that
 * key is dropped;
 * otherwise its key and type are unknowable, so every entry indexed before
 * it is dropped (any of them may have been overwritten or deleted by it:
 * an older value must never answer). Replay resynchronises on the next
 * good record.
 *
 * The allocator is rebuilt through ferry_slab's public calls only: first
 * fit on an empty slab hands out extents in address order, so allocating
 * each gap and each live extent in turn, then freeing the gaps, recreates
 * exactly the layout the journal describes.
 *
 * Everything here works on memory, never on files: the fuzz targets feed it
 * arbitrary bytes.
 */
#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>

#include "le.h"

#include "pslab/pslab_int.h"

static const char hdr_magic[8] = {'F', 'E', 'R', 'R', 'Y', 'P', 'S', 'B'};
static const char jhdr_magic[8] = {'F', 'E', 'R', 'R', 'Y', 'P', 'J', 'L'};

static int why_set(char *why, size_t why_len, int code, const char *fmt, ...)
    FERRY__PRINTF(4, 5);
static int why_set(char *why, size_t why_len, int code, const char *fmt, ...)
{
    if (why && why_len) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(why, why_len, fmt, ap);
        va_end(ap);
    }
    return code;
}

uint64_t ferry__pslab_data_off(uint32_t alignment)
{
    return alignment > FERRY__PSLAB_HDR_BLOCK ? alignment : FERRY__PSLAB_HDR_BLOCK;
}

static int pow2(uint64_t v)
{
    return v && !(v & (v - 1));
}

int ferry__pslab_geom_check(const ferry__pslab_geom *g, char *why, size_t why_len)
{
    if (!pow2(g->alignment) || g->alignment < 512 || g->alignment > (1u << 30))
        return why_set(why, why_len, FERRY_ECORRUPT, "alignment %u is not a power of two in "
                       "[512, 1 GiB]", g->alignment);
    if (g->drives < 1 || g->drives > FERRY_PSLAB_MAX_DIRS)
        return why_set(why, why_len, FERRY_ECORRUPT, "drive count %u outside 1..%u", g->drives,
                       FERRY_PSLAB_MAX_DIRS);
    if (!g->stripe || g->stripe % g->alignment || g->stripe > ((uint64_t)1 << 40))
        return why_set(why, why_len, FERRY_ECORRUPT,
                       "stripe %llu is not a multiple of the alignment %u",
                       (unsigned long long)g->stripe, g->alignment);
    if (!g->capacity || g->capacity % g->alignment || g->capacity > ((uint64_t)1 << 56))
        return why_set(why, why_len, FERRY_ECORRUPT,
                       "capacity %llu is 0, unaligned to %u or beyond 2^56",
                       (unsigned long long)g->capacity, g->alignment);
    if (g->drives > 1 && g->capacity % (g->stripe * g->drives))
        return why_set(why, why_len, FERRY_ECORRUPT,
                       "capacity %llu is not a multiple of stripe %llu x %u drives",
                       (unsigned long long)g->capacity, (unsigned long long)g->stripe,
                       g->drives);
    return 0;
}

void ferry__pslab_hdr_encode(const ferry__pslab_hdr *h, uint8_t *out)
{
    memset(out, 0, FERRY__PSLAB_HDR_BYTES);
    memcpy(out, hdr_magic, 8);
    ferry__put32(out + 8, h->version);
    ferry__put32(out + 12, FERRY__PSLAB_HDR_BYTES);
    ferry__put64(out + 16, h->g.capacity);
    ferry__put32(out + 24, h->g.alignment);
    ferry__put32(out + 28, h->g.drives);
    ferry__put32(out + 32, h->drive);
    ferry__put32(out + 36, 0);
    ferry__put64(out + 40, h->g.stripe);
    ferry__put64(out + 48, h->g.creation_id);
    ferry__put64(out + 56, h->created_ns);
    if (h->version >= 2 && h->tag_len) {
        ferry__put32(out + 64, h->tag_len);
        ferry__put64(out + 72, XXH3_64bits(h->tag, h->tag_len));
        memcpy(out + FERRY__PSLAB_HDR_BYTES, h->tag, h->tag_len);
    }
    ferry__put64(out + 120, XXH3_64bits(out, 120));
}

int ferry__pslab_hdr_decode(const void *buf, size_t len, ferry__pslab_hdr *out, char *why,
                            size_t why_len)
{
    const uint8_t *p = buf;
    if (!p || len < FERRY__PSLAB_HDR_BYTES)
        return why_set(why, why_len, FERRY_ECORRUPT, "header is %zu bytes, needs %u", len,
                       FERRY__PSLAB_HDR_BYTES);
    if (memcmp(p, hdr_magic, 8))
        return why_set(why, why_len, FERRY_ECORRUPT, "bad magic (not a ferry persistent slab)");
    uint32_t version = ferry__get32(p + 8);
    /* a newer writer may lay the rest out differently: the version decides first */
    if (version > FERRY_PSLAB_FORMAT)
        return why_set(why, why_len, FERRY_EVERSION,
                       "format version %u is newer than this library's %u (a newer ferry "
                       "wrote it: open it with that, or empty it with `ferry slab reset DIR`)",
                       version, FERRY_PSLAB_FORMAT);
    if (XXH3_64bits(p, 120) != ferry__get64(p + 120))
        return why_set(why, why_len, FERRY_ECORRUPT, "header checksum mismatch");
    if (version == 0 || ferry__get32(p + 12) != FERRY__PSLAB_HDR_BYTES || ferry__get32(p + 36) != 0)
        return why_set(why, why_len, FERRY_ECORRUPT, "header version %u / size %u / flags %u "
                       "invalid", version, ferry__get32(p + 12), ferry__get32(p + 36));
    /* reserved bytes are zero in every writer: a header that carries
     * anything there was not written by this format (format 2 uses 64..79
     * for its tag) */
    unsigned res0 = version >= 2 ? 80 : 64;
    for (unsigned i = res0; i < 120; i++)
        if (p[i] != 0)
            return why_set(why, why_len, FERRY_ECORRUPT, "reserved header byte %u is 0x%02x, "
                           "not 0", i, p[i]);
    ferry__pslab_hdr h;
    memset(&h, 0, sizeof h);
    if (version >= 2) {
        h.tag_len = ferry__get32(p + 64);
        uint64_t tsum = ferry__get64(p + 72);
        if (ferry__get32(p + 68) != 0 || h.tag_len > FERRY_PSLAB_TAG_MAX || (!h.tag_len && tsum))
            return why_set(why, why_len, FERRY_ECORRUPT, "header tag of %u bytes (at most %u) "
                           "invalid", h.tag_len, FERRY_PSLAB_TAG_MAX);
        if (h.tag_len) {
            if (len < FERRY__PSLAB_HDR_BYTES + (size_t)h.tag_len)
                return why_set(why, why_len, FERRY_ECORRUPT, "header tag of %u bytes runs past "
                               "the %zu bytes read", h.tag_len, len);
            h.tag = p + FERRY__PSLAB_HDR_BYTES;
            if (XXH3_64bits(h.tag, h.tag_len) != tsum)
                return why_set(why, why_len, FERRY_ECORRUPT, "header tag checksum mismatch");
        }
    }
    h.version = version;
    h.g.capacity = ferry__get64(p + 16);
    h.g.alignment = ferry__get32(p + 24);
    h.g.drives = ferry__get32(p + 28);
    h.drive = ferry__get32(p + 32);
    h.g.stripe = ferry__get64(p + 40);
    h.g.creation_id = ferry__get64(p + 48);
    h.created_ns = ferry__get64(p + 56);
    int rc = ferry__pslab_geom_check(&h.g, why, why_len);
    if (rc < 0)
        return rc;
    if (h.drive >= h.g.drives)
        return why_set(why, why_len, FERRY_ECORRUPT, "drive index %u of %u drives", h.drive,
                       h.g.drives);
    *out = h;
    return 0;
}

void ferry__pslab_jhdr_encode(const ferry__pslab_jhdr *h, uint8_t out[FERRY__PSLAB_JHDR_BYTES])
{
    memset(out, 0, FERRY__PSLAB_JHDR_BYTES);
    memcpy(out, jhdr_magic, 8);
    ferry__put32(out + 8, h->version);
    ferry__put32(out + 12, FERRY__PSLAB_JHDR_BYTES);
    ferry__put64(out + 16, h->g.creation_id);
    ferry__put64(out + 24, h->g.capacity);
    ferry__put64(out + 32, h->generation);
    ferry__put32(out + 40, h->g.alignment);
    ferry__put32(out + 44, h->g.drives);
    ferry__put64(out + 48, h->g.stripe);
    ferry__put64(out + 56, XXH3_64bits(out, 56));
}

int ferry__pslab_jhdr_decode(const void *buf, size_t len, ferry__pslab_jhdr *out, char *why,
                             size_t why_len)
{
    const uint8_t *p = buf;
    if (!p || len < FERRY__PSLAB_JHDR_BYTES)
        return why_set(why, why_len, FERRY_ECORRUPT, "journal header is %zu bytes, needs %u",
                       len, FERRY__PSLAB_JHDR_BYTES);
    if (memcmp(p, jhdr_magic, 8))
        return why_set(why, why_len, FERRY_ECORRUPT, "bad journal magic");
    uint32_t version = ferry__get32(p + 8);
    if (version > FERRY_PSLAB_FORMAT)
        return why_set(why, why_len, FERRY_EVERSION,
                       "journal format version %u is newer than this library's %u (a newer "
                       "ferry wrote it: open it with that, or empty it with `ferry slab reset "
                       "DIR`)", version, FERRY_PSLAB_FORMAT);
    if (XXH3_64bits(p, 56) != ferry__get64(p + 56))
        return why_set(why, why_len, FERRY_ECORRUPT, "journal header checksum mismatch");
    if (version == 0 || ferry__get32(p + 12) != FERRY__PSLAB_JHDR_BYTES)
        return why_set(why, why_len, FERRY_ECORRUPT, "journal header version %u / size %u "
                       "invalid", version, ferry__get32(p + 12));
    ferry__pslab_jhdr h;
    h.version = version;
    h.g.creation_id = ferry__get64(p + 16);
    h.g.capacity = ferry__get64(p + 24);
    h.generation = ferry__get64(p + 32);
    h.g.alignment = ferry__get32(p + 40);
    h.g.drives = ferry__get32(p + 44);
    h.g.stripe = ferry__get64(p + 48);
    int rc = ferry__pslab_geom_check(&h.g, why, why_len);
    if (rc < 0)
        return rc;
    *out = h;
    return 0;
}

uint32_t ferry__pslab_piece_for(uint64_t length, uint32_t alignment)
{
    uint64_t piece = FERRY__MAX((uint64_t)FERRY__PSLAB_PIECE, (uint64_t)alignment);
    while (piece <= FERRY__PSLAB_PIECE_MAX && length / piece + (length % piece != 0) >
                                                  FERRY__PSLAB_PIECES_MAX)
        piece *= 2;
    return piece <= FERRY__PSLAB_PIECE_MAX ? (uint32_t)piece : 0;
}

uint64_t ferry__pslab_table_sum(const uint64_t *psum, uint32_t n)
{
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    return XXH3_64bits(psum, 8 * (size_t)n);
#else
    XXH3_state_t st;
    XXH3_64bits_reset(&st);
    for (uint32_t i = 0; i < n; i++) {
        uint8_t b[8];
        ferry__put64(b, psum[i]);
        XXH3_64bits_update(&st, b, 8);
    }
    return XXH3_64bits_digest(&st);
#endif
}

void ferry__pslab_rec_encode(const ferry__pslab_rec *r, uint64_t seed, uint8_t *out)
{
    int pp = r->type == FERRY__PSLAB_PUTP;
    /* a piece put's sum is its table's (the caller's, computed at the write) */
    FERRY__ASSERT(!pp || (r->npieces && r->sum == ferry__pslab_table_sum(r->psum, r->npieces)));
    ferry__put16(out, FERRY__PSLAB_REC_MAGIC);
    out[2] = (uint8_t)r->type;
    out[3] = (uint8_t)(r->flags & FERRY__PSLAB_REC_BARRIER);
    ferry__put32(out + 4, r->klen);
    ferry__put64(out + 8, r->seq);
    ferry__put64(out + 16, r->offset);
    ferry__put64(out + 24, r->length);
    ferry__put64(out + 32, r->sum);
    memcpy(out + FERRY__PSLAB_REC_HEAD, r->key, r->klen);
    size_t n = FERRY__PSLAB_REC_HEAD + r->klen;
    if (pp) {
        ferry__put32(out + n, r->piece);
        ferry__put32(out + n + 4, r->npieces);
        n += 8;
    }
    ferry__put64(out + n, XXH3_64bits_withSeed(out, n, seed));
    if (pp)
        for (uint32_t i = 0; i < r->npieces; i++)
            ferry__put64(out + n + 8 + 8 * (size_t)i, r->psum[i]);
}

void ferry__pslab_rec_set_barrier(uint8_t *rec, uint64_t seed)
{
    /* the flags are in the head: only its checksum changes */
    size_t n = FERRY__PSLAB_REC_HEAD + ferry__get32(rec + 4);
    if (rec[2] == FERRY__PSLAB_PUTP)
        n += 8;
    rec[3] |= FERRY__PSLAB_REC_BARRIER;
    ferry__put64(rec + n, XXH3_64bits_withSeed(rec, n, seed));
}

/*
 * The head of the record at buf[0..avail) - a type 1 or 2 record whole,
 * a piece put through its head checksum: 0, r (all but the table's
 * bytes), *head its bytes and *total the whole record's (a piece put's
 * may run past avail); else FERRY_ECORRUPT. Reads at most *head bytes.
 */
static int rec_head(const uint8_t *buf, size_t avail, uint64_t seed, ferry__pslab_rec *r,
                    size_t *head, size_t *total)
{
    if (avail < FERRY__PSLAB_REC_FIXED)
        return FERRY_ECORRUPT;
    if (ferry__get16(buf) != FERRY__PSLAB_REC_MAGIC || (buf[3] & ~FERRY__PSLAB_REC_BARRIER))
        return FERRY_ECORRUPT;
    int type = buf[2];
    uint32_t klen = ferry__get32(buf + 4);
    if (type < FERRY__PSLAB_PUT || type > FERRY__PSLAB_PUTP || klen == 0 ||
        klen > FERRY_PSLAB_KEY_MAX)
        return FERRY_ECORRUPT;
    size_t n = FERRY__PSLAB_REC_HEAD + klen;
    uint64_t length = ferry__get64(buf + 24);
    uint32_t piece = 0, np = 0;
    if (type == FERRY__PSLAB_PUTP) {
        if (avail < n + 16)
            return FERRY_ECORRUPT;
        piece = ferry__get32(buf + n);
        np = ferry__get32(buf + n + 4);
        /* bounds first: the table's size comes from here */
        if (!pow2(piece) || piece < FERRY__PSLAB_PIECE_MIN || piece > FERRY__PSLAB_PIECE_MAX ||
            np == 0 || np > FERRY__PSLAB_PIECES_MAX ||
            length / piece + (length % piece != 0) != np)
            return FERRY_ECORRUPT;
        n += 8;
    }
    if (avail < n + 8)
        return FERRY_ECORRUPT;
    if (XXH3_64bits_withSeed(buf, n, seed) != ferry__get64(buf + n))
        return FERRY_ECORRUPT;
    r->type = type;
    r->flags = buf[3];
    r->klen = klen;
    r->key = buf + FERRY__PSLAB_REC_HEAD;
    r->seq = ferry__get64(buf + 8);
    r->offset = ferry__get64(buf + 16);
    r->length = length;
    r->sum = ferry__get64(buf + 32);
    r->piece = piece;
    r->npieces = np;
    r->psum = NULL;
    r->ptab = np ? buf + n + 8 : NULL;
    *head = n + 8;
    *total = n + 8 + 8 * (size_t)np;
    return 0;
}

int ferry__pslab_rec_decode(const uint8_t *buf, size_t avail, uint64_t seed,
                            ferry__pslab_rec *r, size_t *used)
{
    ferry__pslab_rec t;
    size_t head = 0, total = 0;
    if (rec_head(buf, avail, seed, &t, &head, &total) < 0)
        return FERRY_ECORRUPT;
    if (t.type == FERRY__PSLAB_PUTP &&
        (avail < total || XXH3_64bits(buf + head, total - head) != t.sum))
        return FERRY_ECORRUPT;
    *r = t;
    *used = total;
    return 0;
}

/* ---- index ---- */
uint64_t ferry__pslab_key_hash(const void *key, size_t klen)
{
    return XXH3_64bits(key, klen);
}

ferry__pslab_ent *ferry__pslab_ent_new_p(const void *key, size_t klen, uint32_t piece,
                                         uint32_t npieces)
{
    /* the sums after the key, 8-aligned: one allocation per entry */
    size_t at = (offsetof(ferry__pslab_ent, key) + klen + 7) & ~(size_t)7;
    size_t bytes = FERRY__MAX(sizeof(ferry__pslab_ent) + klen, at + 8 * (size_t)npieces);
    ferry__pslab_ent *e = ferry__calloc(1, bytes);
    if (!e)
        return NULL;
    memcpy(e->key, key, klen);
    e->klen = (uint32_t)klen;
    e->hash = ferry__pslab_key_hash(key, klen);
    if (npieces) {
        e->psum = (uint64_t *)(void *)((uint8_t *)e + at);
        e->piece = piece;
        e->npieces = npieces;
    }
    return e;
}

ferry__pslab_ent *ferry__pslab_ent_new(const void *key, size_t klen)
{
    return ferry__pslab_ent_new_p(key, klen, 0, 0);
}

int ferry__pslab_index_init(ferry__pslab_index *ix, size_t hint)
{
    size_t nb = 1024;
    while (nb < hint && nb < ((size_t)1 << 30))
        nb <<= 1;
    memset(ix, 0, sizeof *ix);
    ix->b = ferry__calloc(nb, sizeof *ix->b);
    if (!ix->b)
        return -ENOMEM;
    ix->nb = nb;
    return 0;
}

void ferry__pslab_index_fini(ferry__pslab_index *ix)
{
    if (!ix->b)
        return;
    for (size_t i = 0; i < ix->nb; i++) {
        ferry__pslab_ent *e = ix->b[i];
        while (e) {
            ferry__pslab_ent *n = e->hnext;
            ferry__free(e);
            e = n;
        }
    }
    ferry__free(ix->b);
    memset(ix, 0, sizeof *ix);
}

ferry__pslab_ent *ferry__pslab_index_find(ferry__pslab_index *ix, const void *key, size_t klen,
                                          uint64_t hash)
{
    for (ferry__pslab_ent *e = ix->b[hash & (ix->nb - 1)]; e; e = e->hnext)
        if (e->hash == hash && e->klen == klen && !memcmp(e->key, key, klen))
            return e;
    return NULL;
}

static void index_grow(ferry__pslab_index *ix)
{
    size_t nb = ix->nb * 2;
    ferry__pslab_ent **b = ferry__calloc(nb, sizeof *b);
    if (!b)
        return; /* keep the longer chains: still correct */
    for (size_t i = 0; i < ix->nb; i++) {
        ferry__pslab_ent *e = ix->b[i];
        while (e) {
            ferry__pslab_ent *n = e->hnext;
            size_t j = e->hash & (nb - 1);
            e->hnext = b[j];
            b[j] = e;
            e = n;
        }
    }
    ferry__free(ix->b);
    ix->b = b;
    ix->nb = nb;
}

void ferry__pslab_index_insert(ferry__pslab_index *ix, ferry__pslab_ent *e)
{
    if (ix->count >= ix->nb && ix->nb < ((size_t)1 << 30))
        index_grow(ix);
    FERRY__ASSERT(!e->linked); /* an entry is in the index at most once */
    size_t j = e->hash & (ix->nb - 1);
    e->hnext = ix->b[j];
    ix->b[j] = e;
    e->linked = 1;
    ix->count++;
    ix->bytes_stored += e->length;
    ix->bytes_used += e->ext;
}

void ferry__pslab_index_unlink(ferry__pslab_index *ix, ferry__pslab_ent *e)
{
    ferry__pslab_ent **pp = &ix->b[e->hash & (ix->nb - 1)];
    while (*pp && *pp != e)
        pp = &(*pp)->hnext;
    if (!*pp)
        return;
    /* found in its chain: inserted, and counted in the totals */
    FERRY__ASSERT(e->linked && ix->count > 0);
    FERRY__ASSERT(ix->bytes_stored >= e->length && ix->bytes_used >= e->ext);
    *pp = e->hnext;
    e->hnext = NULL;
    e->linked = 0;
    ix->count--;
    ix->bytes_stored -= e->length;
    ix->bytes_used -= e->ext;
}

/* ---- replay ---- */
static int by_offset(const void *a, const void *b)
{
    const ferry__pslab_ent *x = *(ferry__pslab_ent *const *)a;
    const ferry__pslab_ent *y = *(ferry__pslab_ent *const *)b;
    return x->offset < y->offset ? -1 : x->offset > y->offset;
}

static int geom_equal(const ferry__pslab_geom *a, const ferry__pslab_geom *b)
{
    return a->capacity == b->capacity && a->alignment == b->alignment &&
           a->drives == b->drives && a->stripe == b->stripe &&
           a->creation_id == b->creation_id;
}

/*
 * The bad bytes buf[0..n) between two good records: when they are one
 * record with one byte changed (the common damage: a flipped bit or byte),
 * exactly one single-byte change makes them a good record again, and that
 * record says which key the damage may have superseded. A piece put whose
 * head is good (a record of its own) and whose table is not says so
 * without a search, however many of the table's bytes changed. 1 and *r
 * (key in scratch, or in buf) when one record fits, else 0 (several bytes
 * of a head damaged, several records, or an ambiguous fit). Only the head
 * is searched (a change in a table leaves the head good): at most
 * FERRY__PSLAB_REC_HEAD_MAX bytes, 275,400 tries. A wrong fit needs a
 * forged 64-bit seeded checksum among them (about 2^-46), and even then
 * costs a stale value only for the key it misses.
 */
static int one_byte_fix(const uint8_t *buf, size_t n, uint64_t seed, uint8_t *scratch,
                        ferry__pslab_rec *r)
{
    size_t head = 0, total = 0;
    if (n < FERRY__PSLAB_REC_FIXED)
        return 0;
    if (rec_head(buf, n, seed, r, &head, &total) == 0)
        return r->type == FERRY__PSLAB_PUTP && total == n; /* (else: not one record) */
    size_t span = FERRY__MIN(n, (size_t)FERRY__PSLAB_REC_HEAD_MAX);
    memcpy(scratch, buf, span);
    int found = 0;
    size_t fi = 0;
    uint8_t fv = 0;
    for (size_t i = 0; i < span; i++) {
        uint8_t orig = scratch[i];
        for (unsigned v = 0; v < 256; v++) {
            if (v == orig)
                continue;
            scratch[i] = (uint8_t)v;
            ferry__pslab_rec t;
            /* (rec_head reads no byte past the head: within span) */
            if (rec_head(scratch, n, seed, &t, &head, &total) == 0 && total == n) {
                if (++found > 1)
                    return 0;
                fi = i;
                fv = (uint8_t)v;
            }
        }
        scratch[i] = orig;
    }
    if (found != 1)
        return 0;
    scratch[fi] = fv;
    if (rec_head(scratch, n, seed, r, &head, &total) < 0)
        return 0;
    /* the head was the one change: the table must be good as it is */
    if (r->type == FERRY__PSLAB_PUTP && XXH3_64bits(buf + head, total - head) != r->sum)
        return 0;
    r->ptab = r->npieces ? buf + head : NULL;
    return 1;
}

/* rebuild an allocator holding exactly the (sorted, disjoint) extents v[0..n) */
static int rebuild_alloc(const ferry__pslab_geom *g, ferry__pslab_ent **v, size_t n,
                         ferry_slab **out, char *why, size_t why_len)
{
    ferry_slab_options so = FERRY_SLAB_OPTIONS_INIT;
    so.capacity = g->capacity;
    so.alignment = g->alignment;
    ferry_slab *s = NULL;
    int rc = ferry_slab_create(&so, &s);
    if (rc < 0)
        return why_set(why, why_len, rc, "allocator over %llu bytes: %s",
                       (unsigned long long)g->capacity, ferry_strerror(rc));
    ferry_extent *gaps = n ? ferry__malloc(n * sizeof *gaps) : NULL;
    if (n && !gaps) {
        ferry_slab_destroy(s);
        return why_set(why, why_len, -ENOMEM, "out of memory rebuilding the allocator");
    }
    size_t ngaps = 0;
    uint64_t cursor = 0;
    for (size_t i = 0; i < n && rc >= 0; i++) {
        ferry_extent x;
        if (v[i]->offset > cursor) {
            rc = ferry_slab_alloc_bytes(s, v[i]->offset - cursor, &x);
            if (rc >= 0 && x.offset != cursor)
                rc = FERRY_ECORRUPT;
            if (rc >= 0)
                gaps[ngaps++] = x;
        }
        if (rc >= 0) {
            rc = ferry_slab_alloc_bytes(s, v[i]->ext, &x);
            if (rc >= 0 && x.offset != v[i]->offset)
                rc = FERRY_ECORRUPT;
        }
        if (rc >= 0 && (rc = ferry_slab_commit(s, x.offset)) >= 0)
            cursor = v[i]->offset + v[i]->ext;
    }
    for (size_t i = 0; i < ngaps && rc >= 0; i++)
        rc = ferry_slab_free(s, &gaps[i]);
    ferry__free(gaps);
    if (rc < 0) {
        ferry_slab_destroy(s);
        return why_set(why, why_len, rc, "rebuilding the allocator from the index: %s",
                       ferry_strerror(rc));
    }
    *out = s;
    return 0;
}

/*
 * Where the last good barrier record starts (0: none): a bad record before
 * it was durable when that barrier was written (the writer sets the flag
 * only when every earlier journal byte had been fdatasync'ed), so it is
 * damage, not a torn tail, and its key's older records must not speak for
 * it. Found by walking the records, resynchronising byte by byte after
 * each bad one (a good record needs the creation-id-seeded checksum, so a
 * false resync is as unlikely as a forged record).
 */
static uint64_t last_barrier_at(const uint8_t *buf, size_t len, uint64_t seed)
{
    uint64_t last_barrier = 0;
    for (size_t q = FERRY__PSLAB_JHDR_BYTES; q < len;) {
        ferry__pslab_rec r;
        size_t used = 0;
        if (ferry__pslab_rec_decode(buf + q, len - q, seed, &r, &used) < 0) {
            q++;
            continue;
        }
        if (r.flags & FERRY__PSLAB_REC_BARRIER)
            last_barrier = q;
        q += used;
    }
    return last_barrier;
}

/* free every entry of x: it is empty after */
static void index_clear(ferry__pslab_index *x)
{
    for (size_t i = 0; i < x->nb; i++) {
        ferry__pslab_ent *e = x->b[i];
        while (e) {
            ferry__pslab_ent *n = e->hnext;
            ferry__free(e);
            e = n;
        }
        x->b[i] = NULL;
    }
    x->count = 0;
    x->bytes_stored = x->bytes_used = 0;
}

/*
 * The bad bytes at buf[pos] were durable (a barrier follows them): damage.
 * Any indexed key may have been rewritten or deleted by the bad record, so
 * none of them may answer with what it held before - only the one key of
 * the record when one_byte_fix identifies it (while *fix_tries lasts);
 * what good records after it say still stands. Returns where the next good
 * record starts.
 */
static size_t skip_damage(const uint8_t *buf, size_t len, size_t pos, uint64_t seed,
                          ferry__pslab_index *x, ferry__pslab_load *L, unsigned *fix_tries)
{
    ferry__pslab_rec r;
    size_t used = 0;
    size_t q = pos + 1;
    while (q < len && ferry__pslab_rec_decode(buf + q, len - q, seed, &r, &used) < 0)
        q++;
    L->damaged++;
    L->damaged_bytes += q - pos;
    uint8_t scratch[FERRY__PSLAB_REC_HEAD_MAX];
    ferry__pslab_rec fx;
    int fixed = 0;
    if (*fix_tries) {
        (*fix_tries)--;
        fixed = one_byte_fix(buf + pos, q - pos, seed, scratch, &fx);
    }
    if (fixed) {
        /* the damaged record is known: only its key can have been
         * superseded by it, and that key becomes a miss */
        L->damaged_known++;
        ferry__pslab_ent *k = ferry__pslab_index_find(x, fx.key, fx.klen,
                                                      ferry__pslab_key_hash(fx.key, fx.klen));
        if (k) {
            ferry__pslab_index_unlink(x, k);
            ferry__free(k);
            L->damaged_chunks++;
        }
        if (fx.seq >= L->next_seq)
            L->next_seq = fx.seq + 1;
        return q;
    }
    L->damaged_chunks += x->count;
    index_clear(x);
    return q;
}

/* apply the good record r to x: 0, or -ENOMEM */
static int replay_record(ferry__pslab_index *x, ferry__pslab_load *L, const ferry__pslab_geom *g,
                         const ferry__pslab_rec *r)
{
    L->records++;
    if (r->seq >= L->next_seq)
        L->next_seq = r->seq + 1;
    uint64_t h = ferry__pslab_key_hash(r->key, r->klen);
    ferry__pslab_ent *old = ferry__pslab_index_find(x, r->key, r->klen, h);
    if (r->type == FERRY__PSLAB_DEL) {
        if (old && old->seq == r->sum) {
            ferry__pslab_index_unlink(x, old);
            ferry__free(old);
        }
        return 0;
    }
    uint64_t ext = r->length + (g->alignment - 1);
    ext -= ext % g->alignment;
    /* (a piece put's pieces start at aligned offsets: a reader of its own
     * reads them one by one with O_DIRECT) */
    if (!r->length || r->length > g->capacity || r->offset % g->alignment ||
        r->offset > g->capacity - ext || (r->piece && r->piece % g->alignment)) {
        L->dropped++;
        return 0;
    }
    if (old && old->seq > r->seq) {
        L->dropped++;
        return 0;
    }
    ferry__pslab_ent *e = ferry__pslab_ent_new_p(r->key, r->klen, r->piece, r->npieces);
    if (!e)
        return -ENOMEM;
    for (uint32_t i = 0; i < r->npieces; i++)
        e->psum[i] = ferry__get64(r->ptab + 8 * (size_t)i);
    e->offset = r->offset;
    e->length = r->length;
    e->ext = ext;
    e->sum = r->sum;
    e->seq = r->seq;
    if (old) {
        ferry__pslab_index_unlink(x, old);
        ferry__free(old);
    }
    ferry__pslab_index_insert(x, e);
    return 0;
}

/*
 * x's extents by address into *out (the caller frees it), the older of any
 * two that overlap dropped from x: *kept of them. 0, or -ENOMEM.
 */
static int disjoint_extents(ferry__pslab_index *x, ferry__pslab_load *L, ferry__pslab_ent ***out,
                            size_t *kept)
{
    ferry__pslab_ent **v = x->count ? ferry__malloc(x->count * sizeof *v) : NULL;
    if (x->count && !v)
        return -ENOMEM;
    size_t n = 0;
    for (size_t i = 0; i < x->nb; i++)
        for (ferry__pslab_ent *e = x->b[i]; e; e = e->hnext)
            v[n++] = e;
    if (n > 1)
        qsort(v, n, sizeof *v, by_offset);
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        ferry__pslab_ent *e = v[i];
        if (k && e->offset < v[k - 1]->offset + v[k - 1]->ext) {
            ferry__pslab_ent *prev = v[k - 1];
            ferry__pslab_ent *loser = prev->seq < e->seq ? prev : e;
            L->dropped++;
            ferry__pslab_index_unlink(x, loser);
            ferry__free(loser);
            if (loser == prev)
                v[k - 1] = e;
            continue;
        }
        v[k++] = e;
    }
    *out = v;
    *kept = k;
    return 0;
}

int ferry__pslab_index_load(const uint8_t *buf, size_t len, const ferry__pslab_geom *expect,
                            ferry__pslab_index *ix, ferry_slab **alloc, ferry__pslab_load *st,
                            char *why, size_t why_len)
{
    ferry__pslab_load L;
    memset(&L, 0, sizeof L);
    int rc = ferry__pslab_jhdr_decode(buf, len, &L.jh, why, why_len);
    if (rc < 0)
        return rc;
    if (expect && !geom_equal(expect, &L.jh.g))
        return why_set(why, why_len, FERRY_EMISMATCH,
                       "journal belongs to another slab or geometry (creation id %016llx, "
                       "capacity %llu; the slab's: %016llx, %llu)",
                       (unsigned long long)L.jh.g.creation_id,
                       (unsigned long long)L.jh.g.capacity,
                       (unsigned long long)expect->creation_id,
                       (unsigned long long)expect->capacity);
    const ferry__pslab_geom *g = &L.jh.g;
    uint64_t last_barrier = last_barrier_at(buf, len, g->creation_id);
    ferry__pslab_index x;
    size_t hint = len / (FERRY__PSLAB_REC_FIXED + 16);
    if ((rc = ferry__pslab_index_init(&x, hint)) < 0)
        return why_set(why, why_len, rc, "out of memory for the index");
    size_t pos = FERRY__PSLAB_JHDR_BYTES;
    L.next_seq = 1;
    int bad_seen = 0;
    /* each try costs up to 273,360 checksums of up to 1 KiB (tens of ms):
     * a journal damaged in many places drops everything before instead of
     * making the open slow */
    unsigned fix_tries = 16;
    while (pos < len) {
        ferry__pslab_rec r;
        size_t used = 0;
        if (ferry__pslab_rec_decode(buf + pos, len - pos, g->creation_id, &r, &used) < 0) {
            if (pos >= last_barrier)
                break; /* nothing proves it durable: a torn tail */
            if (!bad_seen) {
                L.bad_off = pos;
                bad_seen = 1;
            }
            pos = skip_damage(buf, len, pos, g->creation_id, &x, &L, &fix_tries);
            continue;
        }
        pos += used;
        if (replay_record(&x, &L, g, &r) < 0) {
            ferry__pslab_index_fini(&x);
            return why_set(why, why_len, -ENOMEM, "out of memory replaying the journal");
        }
    }
    L.good_end = pos;
    if (!bad_seen)
        L.bad_off = pos;
    L.torn = pos < len;

    /* the extents, by address: drop the older of two that overlap */
    ferry__pslab_ent **v = NULL;
    size_t k = 0;
    if (disjoint_extents(&x, &L, &v, &k) < 0) {
        ferry__pslab_index_fini(&x);
        return why_set(why, why_len, -ENOMEM, "out of memory sorting the index");
    }
    ferry_slab *s = NULL;
    rc = rebuild_alloc(g, v, k, &s, why, why_len);
    ferry__free(v);
    if (rc < 0) {
        ferry__pslab_index_fini(&x);
        return rc;
    }
    *ix = x;
    *alloc = s;
    if (st)
        *st = L;
    return 0;
}
