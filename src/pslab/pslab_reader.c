/*
 * pslab_reader.c - pins and the slab's geometry for a reader that runs its
 * own I/O (pslab_reader.h).
 *
 * Invariant: a pinned entry's extent stays allocated to it (ent_release
 * waits for the last pin), so reads of [offset, offset + ext) return the
 * bytes of its put or, after damage, bytes its checksum refuses; never
 * another chunk's bytes under a good checksum.
 */
#include <errno.h>
#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>
#include <xxh_x86dispatch.h>

#include "pslab/pslab_impl.h"
#include "stripe.h"

int ferry__pslab_pin_get(ferry_pslab *p, const void *key, size_t klen, ferry__pslab_pin *out)
{
    if (!p || !out)
        return ferry__err_set(NULL, -EINVAL, "pslab: pin: NULL store or pin");
    out->ent = NULL;
    if (!key || klen == 0 || klen > FERRY_PSLAB_KEY_MAX)
        return ferry__err_set(&p->err, -EINVAL, "pslab %s: pin: key of %zu bytes (1..%u)",
                              p->dirs[0], klen, FERRY_PSLAB_KEY_MAX);
    ferry__pslab_ent *e = ferry__pslab_pin_find(p, key, klen, "pin");
    if (!e)
        return FERRY_ENOTFOUND;
    pthread_mutex_lock(&p->mu);
    p->st.hits++; /* (the reader checks the bytes; a get counts after its own check) */
    pthread_mutex_unlock(&p->mu);
    out->ent = e;
    out->offset = e->offset; /* (an entry's place and sums never change) */
    out->length = e->length;
    out->ext = e->ext;
    out->checksum = e->sum;
    out->piece = e->piece; /* (0 for a record of format 1 or 2) */
    out->npieces = e->npieces;
    out->psum = e->psum;   /* (allocated with the entry: freed after the last pin) */
    return 0;
}

void ferry__pslab_pin_put(ferry_pslab *p, ferry__pslab_pin *pin)
{
    if (!p || !pin || !pin->ent)
        return;
    ferry__pslab_ent *e = pin->ent;
    pin->ent = NULL;
    pthread_mutex_lock(&p->mu);
    ferry__pslab_unpin(p, e);
    pthread_mutex_unlock(&p->mu);
}

uint32_t ferry__pslab_format(const ferry_pslab *p)
{
    pthread_mutex_lock((pthread_mutex_t *)&p->mu); /* (compaction writes it under mu) */
    uint32_t v = p->jversion;
    pthread_mutex_unlock((pthread_mutex_t *)&p->mu);
    return v;
}

void ferry__pslab_locate(const ferry_pslab *p, uint64_t off, unsigned *d, uint64_t *foff,
                         uint64_t *run)
{
    ferry__stripe_map(p->g.stripe, p->g.drives, off, d, foff, run);
    *foff += p->data_off;
}

int ferry__pslab_pin_check(const ferry__pslab_pin *pin, const void *data, uint64_t off,
                           uint64_t len)
{
    if (!pin || !data || off > pin->length || len > pin->length - off)
        return ferry__err_set(NULL, -EINVAL, "pslab: check of bytes [%llu, +%llu) of a %llu-byte "
                              "chunk", (unsigned long long)off, (unsigned long long)len,
                              pin ? (unsigned long long)pin->length : 0ull);
    if (!pin->piece) {
        if (off || len != pin->length)
            return ferry__err_set(NULL, -EINVAL, "pslab: a chunk without piece checksums is "
                                  "checked whole, not bytes [%llu, +%llu)",
                                  (unsigned long long)off, (unsigned long long)len);
        uint64_t s = XXH3_64bits_dispatch(data, (size_t)len);
        if (s == pin->checksum)
            return 0;
        return ferry__err_set(NULL, FERRY_ECORRUPT, "pslab: the %llu bytes at slab offset %llu "
                              "fail their checksum (%016llx, recorded %016llx)",
                              (unsigned long long)len, (unsigned long long)pin->offset,
                              (unsigned long long)s, (unsigned long long)pin->checksum);
    }
    if (off % pin->piece || (len % pin->piece && off + len != pin->length))
        return ferry__err_set(NULL, -EINVAL, "pslab: bytes [%llu, +%llu) are not whole pieces of "
                              "%u bytes", (unsigned long long)off, (unsigned long long)len,
                              pin->piece);
    const unsigned char *d = data;
    for (uint64_t at = 0; at < len; at += pin->piece) {
        uint64_t k = (off + at) / pin->piece, n = FERRY__MIN((uint64_t)pin->piece, len - at);
        if (k >= pin->npieces)
            return ferry__err_set(NULL, -EINVAL, "pslab: piece %llu of %u",
                                  (unsigned long long)k, pin->npieces);
        uint64_t s = XXH3_64bits_dispatch(d + at, (size_t)n);
        if (s != pin->psum[k])
            return ferry__err_set(NULL, FERRY_ECORRUPT, "pslab: piece %llu (%llu bytes at slab "
                                  "offset %llu) fails its checksum (%016llx, recorded %016llx)",
                                  (unsigned long long)k, (unsigned long long)n,
                                  (unsigned long long)(pin->offset + off + at),
                                  (unsigned long long)s, (unsigned long long)pin->psum[k]);
    }
    return 0;
}
