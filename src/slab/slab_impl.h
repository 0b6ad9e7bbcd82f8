/*
 * slab_impl.h - the slab allocator's structures (private to slab.c; tests
 * include it to break invariants on purpose and watch ferry_slab_check()
 * name them).
 */
#ifndef FERRY_SRC_SLAB_IMPL_H
#define FERRY_SRC_SLAB_IMPL_H

#include <pthread.h>
#include <stdint.h>

#include "core.h"
#include "ferry/slab.h"

#define NIL 0u

typedef struct tnode {
    uint64_t off, size, max; /* max: largest size in this subtree */
    uint32_t l, r, prio;
} tnode;

typedef struct used_ent {
    uint64_t off;
    uint64_t size; /* 0 = empty slot */
    uint32_t readers;
    uint32_t state;
} used_ent;

struct ferry_slab {
    pthread_mutex_t mu;
    uint64_t capacity;
    uint64_t align;
    unsigned align_shift;
    /* free-block treap */
    tnode *nodes; /* nodes[0] is NIL: max 0 */
    uint32_t ncap, nused_hw; /* capacity, high-water index */
    uint32_t free_idx;       /* recycled node indices, linked through .l */
    uint32_t root;
    uint32_t rng;
    uint64_t free_blocks;
    /* allocated extents */
    used_ent *used;
    uint64_t ucap; /* power of two */
    uint64_t ucount;
    uint64_t used_bytes;
    /* lifetime counters */
    uint64_t allocs, frees, failures;
    ferry__errbuf err;
};

#endif
