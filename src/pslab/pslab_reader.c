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

void ferry__pslab_locate(const ferry_pslab *p, uint64_t off, unsigned *d, uint64_t *foff,
                         uint64_t *run)
{
    ferry__stripe_map(p->g.stripe, p->g.drives, off, d, foff, run);
    *foff += p->data_off;
}
