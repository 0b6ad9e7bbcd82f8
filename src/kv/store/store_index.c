/*
 * store_index.c - the hash index from chunk id to entry (under kv->mu).
 *
 * Open hashing with chains; the table doubles when it holds as many entries
 * as buckets, so a lookup stays a short chain walk at any size.
 */
#include <errno.h>
#include <stddef.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv/kv_impl.h"
#include "kv/store/store_int.h"

/* ---- the index (under mu) ---- */

uint64_t ferry__kv_bucket_of(const ferry_kv *kv, ferry_kv_hash id)
{
    return (id.lo ^ (id.hi >> 17)) & (kv->nbuckets - 1);
}

ferry__kv_entry *ferry__kv_find(ferry_kv *kv, ferry_kv_hash id)
{
    for (ferry__kv_entry *e = kv->buckets[ferry__kv_bucket_of(kv, id)]; e; e = e->hnext)
        if (e->id.lo == id.lo && e->id.hi == id.hi)
            return e;
    return NULL;
}

static void index_grow(ferry_kv *kv)
{
    uint64_t nb = kv->nbuckets * 2;
    ferry__kv_entry **b = ferry__calloc(nb, sizeof *b);
    if (!b)
        return; /* longer chains, still correct */
    ferry__kv_entry **old = kv->buckets;
    uint64_t onb = kv->nbuckets;
    kv->buckets = b;
    kv->nbuckets = nb;
    for (uint64_t i = 0; i < onb; i++) {
        for (ferry__kv_entry *e = old[i], *next; e; e = next) {
            next = e->hnext;
            uint64_t k = ferry__kv_bucket_of(kv, e->id);
            e->hnext = b[k];
            b[k] = e;
        }
    }
    ferry__free(old);
}

void ferry__kv_index_insert(ferry_kv *kv, ferry__kv_entry *e)
{
    if (kv->count >= 2 * kv->nbuckets)
        index_grow(kv);
    uint64_t k = ferry__kv_bucket_of(kv, e->id);
    e->hnext = kv->buckets[k];
    kv->buckets[k] = e;
    kv->count++;
}

void ferry__kv_index_remove(ferry_kv *kv, ferry__kv_entry *e)
{
    ferry__kv_entry **pp = &kv->buckets[ferry__kv_bucket_of(kv, e->id)];
    while (*pp && *pp != e)
        pp = &(*pp)->hnext;
    FERRY__ASSERT(*pp == e); /* only an indexed entry is removed */
    if (*pp) {
        *pp = e->hnext;
        kv->count--;
    }
    e->hnext = NULL;
}
