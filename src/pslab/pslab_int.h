/*
 * pslab_int.h - the persistent slab's on-disk format and in-memory index
 * (private). The codec and the index loader work on memory buffers only,
 * so the fuzz targets drive them without files.
 *
 * A store's format is its journal header's version. Slab file headers
 * carry the version of their own layout (FERRY__PSLAB_HDR_VERSION: 2 since
 * format 2, which format 3 leaves as it was), so a library of format 2
 * still reads a format 3 store's geometry and tag - it refuses the
 * journal (FERRY_EVERSION), and its reset can keep the size and tag.
 *
 * Slab file header (little endian, FERRY__PSLAB_HDR_BYTES, then zeros up
 * to the data offset = max(4096, alignment)):
 *     0  magic "FERRYPSB"          8  u32 format version
 *    12  u32 header bytes (128)    16  u64 capacity (all drives)
 *    24  u32 alignment             28  u32 drives
 *    32  u32 this file's drive     36  u32 flags (0)
 *    40  u64 stripe bytes          48  u64 creation id
 *    56  u64 created (ns, realtime)
 *    64  u32 tag bytes (format 2; 0 in format 1, 0..FERRY_PSLAB_TAG_MAX)
 *    68  u32 zero                  72  u64 XXH3-64 of the tag (0 without one)
 *    80..119 zero
 *   120  u64 XXH3-64 of bytes [0, 120)
 *   128  the tag's bytes (format 2), then zeros
 *
 * Journal header (FERRY__PSLAB_JHDR_BYTES):
 *     0  magic "FERRYPJL"          8  u32 format version
 *    12  u32 header bytes (64)     16  u64 creation id
 *    24  u64 capacity              32  u64 generation (compactions)
 *    40  u32 alignment             44  u32 drives
 *    48  u64 stripe bytes          56  u64 XXH3-64 of bytes [0, 56)
 *
 * Record, types 1 and 2 (FERRY__PSLAB_REC_FIXED + key bytes):
 *     0  u16 magic 0xF5E7   2 u8 type (1 put, 2 delete, 3 piece put)
 *     3  u8 flags: bit 0 = barrier (format 2): every journal byte before
 *        this record had been fdatasync'ed when it was written, so a bad
 *        record before a barrier is damage, never a torn tail
 *     4  u32 key bytes      8 u64 sequence
 *    16  u64 slab offset (put) / 0       24 u64 length (put) / 0
 *    32  u64 payload XXH3-64 (put) / the deleted put's sequence (delete)
 *    40  key bytes
 *    40 + k  u64 XXH3-64 of bytes [0, 40 + k), seeded with the creation id
 *
 * Piece put, type 3 (format 3; FERRY__PSLAB_REC_PFIXED + key bytes + 8 per
 * piece): the payload in pieces of `piece` bytes, each with its own sum,
 * so a reader checks each piece as it lands. Its head is a record of its
 * own (a good head names the key even when its table is damaged):
 *     0..39  as a put, but 32: u64 XXH3-64 (seed 0) of the piece table's
 *            8 x n bytes (little-endian u64s) - the chunk's checksum
 *     40  key bytes
 *    40 + k  u32 piece bytes: a power of two in [4096, 1 GiB], a multiple
 *            of the slab's alignment (replay drops a record whose is not)
 *    44 + k  u32 pieces n = ceil(length / piece), 1..FERRY__PSLAB_PIECES_MAX
 *    48 + k  u64 XXH3-64 of bytes [0, 48 + k), seeded with the creation id
 *    56 + k  n x u64: XXH3-64 (seed 0) of payload bytes
 *            [i * piece, min(length, (i + 1) * piece)), piece i
 * The head's checksum covers the table's XXH3-64 (32), which covers the
 * table. The writer's piece is FERRY__PSLAB_PIECE or the alignment, the
 * larger, doubled while a chunk would need more than
 * FERRY__PSLAB_PIECES_MAX pieces; a chunk too big for that at 1 GiB
 * pieces (beyond 64 TiB) gets a type 1 record.
 */
#ifndef FERRY_SRC_PSLAB_INT_H
#define FERRY_SRC_PSLAB_INT_H

#include <stddef.h>
#include <stdint.h>

#include "core.h"
#include "ferry/pslab.h"
#include "ferry/slab.h"

#define FERRY__PSLAB_HDR_BYTES 128u
#define FERRY__PSLAB_HDR_VERSION 2u  /* the slab header's layout (see above) */
#define FERRY__PSLAB_HDR_BLOCK 4096u
#define FERRY__PSLAB_JHDR_BYTES 64u
#define FERRY__PSLAB_REC_HEAD 40u
#define FERRY__PSLAB_REC_FIXED 48u
#define FERRY__PSLAB_REC_MAGIC 0xF5E7u
#define FERRY__PSLAB_JOURNAL_TMP FERRY_PSLAB_JOURNAL ".tmp"

enum { FERRY__PSLAB_PUT = 1, FERRY__PSLAB_DEL = 2, FERRY__PSLAB_PUTP = 3 };

#define FERRY__PSLAB_REC_PFIXED 56u          /* a piece put's bytes but key and table */
#define FERRY__PSLAB_PIECE (2u << 20)        /* the writer's piece (at least the alignment) */
#define FERRY__PSLAB_PIECE_MIN 4096u
#define FERRY__PSLAB_PIECE_MAX (1u << 30)
#define FERRY__PSLAB_PIECES_MAX 65536u       /* pieces of one chunk (a 512 KiB table) */
/* a record's head (through its checksum; a type 1 or 2 record is all
 * head), in bytes at most: a piece put's with the longest key */
#define FERRY__PSLAB_REC_HEAD_MAX (FERRY__PSLAB_REC_PFIXED + FERRY_PSLAB_KEY_MAX)

typedef struct ferry__pslab_geom {
    uint64_t capacity;
    uint32_t alignment;
    uint32_t drives;
    uint64_t stripe;
    uint64_t creation_id;
} ferry__pslab_geom;

typedef struct ferry__pslab_hdr {
    uint32_t version;
    ferry__pslab_geom g;
    uint32_t drive;
    uint64_t created_ns;
    uint32_t tag_len;
    const uint8_t *tag; /* tag_len bytes: into the decoded buffer, or the writer's */
} ferry__pslab_hdr;

#define FERRY__PSLAB_REC_BARRIER 0x01u

typedef struct ferry__pslab_jhdr {
    uint32_t version;
    ferry__pslab_geom g;
    uint64_t generation;
} ferry__pslab_jhdr;

typedef struct ferry__pslab_rec {
    int type;
    unsigned flags; /* FERRY__PSLAB_REC_BARRIER */
    uint32_t klen;
    const uint8_t *key;
    uint64_t seq, offset, length, sum; /* sum: payload checksum (piece put: of its table), or
                                        * the deleted seq */
    /* piece put (type 3): piece bytes, pieces, and their sums - encode: psum
     * (host order); decode: ptab, the table's little-endian bytes in buf */
    uint32_t piece, npieces;
    const uint64_t *psum;
    const uint8_t *ptab;
} ferry__pslab_rec;

/* bytes of the data area's offset in each slab file */
uint64_t ferry__pslab_data_off(uint32_t alignment);
/* sanity of a geometry (powers of two, sizes, bounds); 0 or FERRY_ECORRUPT + why */
int ferry__pslab_geom_check(const ferry__pslab_geom *g, char *why, size_t why_len);

/* writes FERRY__PSLAB_HDR_BYTES + h->tag_len bytes to out */
void ferry__pslab_hdr_encode(const ferry__pslab_hdr *h, uint8_t *out);
/* 0, FERRY_ECORRUPT (short, magic, checksum, geometry, tag) or FERRY_EVERSION;
 * why says which. A format 2 header's tag must lie within buf[0..len). */
int ferry__pslab_hdr_decode(const void *buf, size_t len, ferry__pslab_hdr *out, char *why,
                            size_t why_len);
void ferry__pslab_jhdr_encode(const ferry__pslab_jhdr *h, uint8_t out[FERRY__PSLAB_JHDR_BYTES]);
int ferry__pslab_jhdr_decode(const void *buf, size_t len, ferry__pslab_jhdr *out, char *why,
                             size_t why_len);

static inline size_t ferry__pslab_rec_size(uint32_t klen)
{
    return FERRY__PSLAB_REC_FIXED + (size_t)klen;
}
/* bytes of a record with klen key bytes and npieces piece sums (0: a
 * type 1 or 2 record) */
static inline size_t ferry__pslab_rec_size_p(uint32_t klen, uint32_t npieces)
{
    return npieces ? FERRY__PSLAB_REC_PFIXED + (size_t)klen + 8 * (size_t)npieces
                   : ferry__pslab_rec_size(klen);
}
/*
 * The piece size this library writes a chunk of length bytes with on a
 * slab of the given alignment (see the format above): 0 when the chunk is
 * too big for piece sums (a type 1 record).
 */
uint32_t ferry__pslab_piece_for(uint64_t length, uint32_t alignment);
static inline uint32_t ferry__pslab_npieces(uint64_t length, uint32_t piece)
{
    return piece ? (uint32_t)((length + piece - 1) / piece) : 0;
}
/* XXH3-64 (seed 0) of the piece table psum[0..n) as little-endian u64s */
uint64_t ferry__pslab_table_sum(const uint64_t *psum, uint32_t n);
/* writes ferry__pslab_rec_size_p(r->klen, r->npieces) bytes to out (a
 * type 3 record with r->npieces sums from r->psum, its sum field set to
 * their table's checksum) */
void ferry__pslab_rec_encode(const ferry__pslab_rec *r, uint64_t seed, uint8_t *out);
/* set the barrier flag of the encoded record at rec (and its checksum) */
void ferry__pslab_rec_set_barrier(uint8_t *rec, uint64_t seed);
/*
 * Decode the record at buf[0..avail): 0 and *used on success (r->key and
 * r->ptab point into buf); FERRY_ECORRUPT when it is incomplete,
 * malformed or fails its checksum (a piece put: its head's, or its
 * table's against the head's sum field).
 */
int ferry__pslab_rec_decode(const uint8_t *buf, size_t avail, uint64_t seed,
                            ferry__pslab_rec *r, size_t *used);

/* ---- the in-memory index ---- */
typedef struct ferry__pslab_ent {
    struct ferry__pslab_ent *hnext;
    uint64_t hash;
    uint64_t offset, length, ext, sum, seq;
    /* piece sums (a type 3 record): npieces of them, allocated with the
     * entry after its key; piece 0: only sum, the whole payload's */
    uint64_t *psum;
    uint32_t piece, npieces;
    uint32_t klen;
    uint32_t pins;     /* gets reading its extent */
    uint8_t doomed;    /* unlinked; extent freed when pins reaches 0 (and not pending) */
    uint8_t pending;   /* SYNC_BATCH: in the index, its record not yet durable */
    uint8_t linked;    /* in the index's hash table */
    uint8_t key[];
} ferry__pslab_ent;

typedef struct ferry__pslab_index {
    ferry__pslab_ent **b;
    size_t nb;            /* power of two */
    size_t count;
    uint64_t bytes_stored, bytes_used;
} ferry__pslab_index;

uint64_t ferry__pslab_key_hash(const void *key, size_t klen);
ferry__pslab_ent *ferry__pslab_ent_new(const void *key, size_t klen);
/* an entry with room for npieces piece sums (e->psum; piece and npieces
 * set, the sums zero) */
ferry__pslab_ent *ferry__pslab_ent_new_p(const void *key, size_t klen, uint32_t piece,
                                         uint32_t npieces);
int ferry__pslab_index_init(ferry__pslab_index *ix, size_t hint);
/* frees every entry still linked */
void ferry__pslab_index_fini(ferry__pslab_index *ix);
ferry__pslab_ent *ferry__pslab_index_find(ferry__pslab_index *ix, const void *key, size_t klen,
                                          uint64_t hash);
/* link e (no entry with its key may be linked); grows the table when it can */
void ferry__pslab_index_insert(ferry__pslab_index *ix, ferry__pslab_ent *e);
void ferry__pslab_index_unlink(ferry__pslab_index *ix, ferry__pslab_ent *e);

typedef struct ferry__pslab_load {
    ferry__pslab_jhdr jh;
    uint64_t good_end;        /* journal bytes up to the end of the last good record */
    uint64_t records;         /* good records replayed */
    uint64_t dropped;         /* good records refused (range, overlap) */
    uint64_t next_seq;        /* 1 + the largest sequence seen */
    uint64_t bad_off;         /* offset of the first bad record (== good_end), if any */
    int torn;                 /* 1 when bytes after good_end were cut */
    uint64_t damaged;         /* bad regions proven durable (a barrier after them) */
    uint64_t damaged_bytes;   /* their bytes */
    uint64_t damaged_chunks;  /* chunks dropped because such a region may hold their latest */
    uint64_t damaged_known;   /* regions found to be one record with one byte changed: only
                               * that record's key dropped */
} ferry__pslab_load;

/*
 * Replay the journal image buf[0..len): check its header (against expect
 * when non-NULL: FERRY_EMISMATCH if its geometry or creation id differ),
 * apply the good records in order to an empty index. A bad record followed
 * (after resynchronising on the next good record) by a good barrier record
 * was durable: it is damage, and every entry indexed so far is dropped (any
 * of them may have been rewritten or deleted by it) - only the key of the
 * record when the bad bytes are one record with exactly one byte changed
 * (found by trying every single-byte change) - then the replay goes on
 * after it. The first bad record with no barrier after it ends the
 * replay (a torn tail: good_end). A piece put whose head is good and
 * table bad is damage of its key alone, like a one-byte fit. Records
 * whose extent leaves [0, capacity) or is misaligned, or whose piece is
 * not a multiple of the alignment, are dropped,
 * then drop the older of any two overlapping extents and rebuild an
 * allocator holding exactly the indexed extents. On success *ix is
 * initialized and owned by the caller, *alloc too. Errors: header errors
 * (FERRY_ECORRUPT, FERRY_EVERSION, FERRY_EMISMATCH), -ENOMEM; why says more.
 */
int ferry__pslab_index_load(const uint8_t *buf, size_t len, const ferry__pslab_geom *expect,
                            ferry__pslab_index *ix, ferry_slab **alloc, ferry__pslab_load *st,
                            char *why, size_t why_len);

#endif
