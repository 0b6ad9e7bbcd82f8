/*
 * stripe.c - the stripe arithmetic, once (see stripe.h).
 *
 * Invariant: ferry__stripe_map and ferry__stripe_share agree: the bytes
 * that map to drive d are exactly its share, at file offsets 0 up to the
 * share, so a drive's file is never larger than what maps to it. Kept in
 * core because every tier that stripes over drives needs the same answer
 * for the same (unit, n), and two copies of it drift.
 */
#include "stripe.h"

void ferry__stripe_map(uint64_t unit, unsigned n, uint64_t off, unsigned *d, uint64_t *foff,
                       uint64_t *run)
{
    if (n <= 1) {
        *d = 0;
        *foff = off;
        *run = UINT64_MAX;
        return;
    }
    uint64_t k = off / unit, in = off % unit;
    *d = (unsigned)(k % n);
    *foff = (k / n) * unit + in;
    *run = unit - in;
}

uint64_t ferry__stripe_share(uint64_t size, uint64_t unit, unsigned n, unsigned d)
{
    if (n <= 1)
        return size;
    uint64_t full = size / unit, rem = size % unit;
    uint64_t b = (full / n + (d < full % n ? 1 : 0)) * unit;
    if (rem && d == full % n)
        b += rem;
    return b;
}
