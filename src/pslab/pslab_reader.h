/*
 * pslab_reader.h - what a reader that runs its own I/O needs of a
 * persistent slab (private to ferry; the KV store's asynchronous reads of
 * its persistent L2 use it).
 *
 * ferry_pslab_get reads a chunk on one of the slab's lanes and returns
 * when it is read and checked. A reader that keeps many reads in flight on
 * its own engine instead pins the chunk's entry (so its extent is not
 * freed or reused while the reads run), maps the slab offsets to drives
 * and file offsets itself, reads the slab files through its own handles,
 * and checks what landed against the checksum the pin returned before the
 * bytes count. The pin says nothing about the bytes on disk: only that
 * check does.
 */
#ifndef FERRY_SRC_PSLAB_READER_H
#define FERRY_SRC_PSLAB_READER_H

#include <stddef.h>
#include <stdint.h>

#include "ferry/pslab.h"

/* a pinned chunk: where its bytes are and what they must hash to */
typedef struct ferry__pslab_pin {
    void *ent;           /* the pinned entry (the slab's) */
    uint64_t offset;     /* slab offset of its extent */
    uint64_t length;     /* bytes stored */
    uint64_t ext;        /* bytes an O_DIRECT read takes: length rounded up to the alignment */
    uint64_t checksum;   /* the record's checksum (ferry_pslab_info.checksum) */
    /* its piece checksums (format 3 records): piece k covers bytes
     * [k * piece, min(length, (k + 1) * piece)) and must hash (XXH3-64,
     * seed 0) to psum[k]. piece 0 (format 1 and 2 records): only the
     * whole-payload checksum above, XXH3-64 of the length bytes. psum is
     * valid while the pin is held: a reader that checks later copies it */
    uint32_t piece;
    uint32_t npieces;
    const uint64_t *psum;
} ferry__pslab_pin;

/*
 * Check landed bytes of a pinned chunk: data holds bytes [off, off + len)
 * of it, where off is a piece boundary and len whole pieces (the last one
 * may end at length). 0 when every piece hashes to its psum; FERRY_ECORRUPT
 * with the message naming the piece, its slab offset and both sums.
 * With piece 0 only a whole payload (off 0, len length) can be checked,
 * against checksum; anything else is -EINVAL.
 */
int ferry__pslab_pin_check(const ferry__pslab_pin *pin, const void *data, uint64_t off,
                           uint64_t len);

/* pin the chunk under key: 0, FERRY_ENOTFOUND, -EINVAL (message set on p) */
int ferry__pslab_pin_get(ferry_pslab *p, const void *key, size_t klen, ferry__pslab_pin *out);
/* unpin it (a chunk deleted or replaced meanwhile is freed now); pin->ent
 * becomes NULL; a pin whose ent is NULL is ignored */
void ferry__pslab_pin_put(ferry_pslab *p, ferry__pslab_pin *pin);

/* slab bytes at off: drive *d, at file offset *foff (after the file's
 * header block), for *run bytes up to the next stripe boundary
 * (UINT64_MAX with one drive) */
void ferry__pslab_locate(const ferry_pslab *p, uint64_t off, unsigned *d, uint64_t *foff,
                         uint64_t *run);
/* (the slab's drives, alignment, stripe and whether its files are
 * O_DIRECT: ferry_pslab_stats_get) */
/* the store's format: its journal's version (1..FERRY_PSLAB_FORMAT; a
 * writable open has made it FERRY_PSLAB_FORMAT) */
uint32_t ferry__pslab_format(const ferry_pslab *p);
/* dirs[i]/FERRY_PSLAB_FILE */
void ferry__pslab_slab_path(const ferry_pslab *p, unsigned i, char *out, size_t n);

#endif
