/*
 * stripe.h - RAID-0 striping of one byte space over n drives (private).
 *
 * Byte o of the space lives on drive (o / unit) % n at file offset
 * (o / unit / n) * unit + o % unit: consecutive units go round the drives,
 * and each drive's file holds its units back to back. With one drive the
 * file offset is o and nothing is split (the unit is then ignored).
 *
 * Used by the GDS context (src/gds) for its slab files and by the
 * persistent slab (src/pslab), which adds its header block's offset.
 */
#ifndef FERRY_SRC_STRIPE_H
#define FERRY_SRC_STRIPE_H

#include <stdint.h>

/* where byte off lives: drive *d at file offset *foff, with *run bytes
 * before the next unit boundary (UINT64_MAX with one drive).
 * pre: n >= 1, unit >= 1 when n > 1 */
void ferry__stripe_map(uint64_t unit, unsigned n, uint64_t off, unsigned *d, uint64_t *foff,
                       uint64_t *run);

/* how many of a size-byte space's bytes drive d holds (its file's size) */
uint64_t ferry__stripe_share(uint64_t size, uint64_t unit, unsigned n, unsigned d);

#endif
