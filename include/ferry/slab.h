/*
 * ferry/slab.h - the slab allocator: byte extents of one large slab.
 *
 * A ferry_slab hands out extents [offset, offset + size) of a range
 * [0, capacity) - the bytes of an NVMe slab file (see ferry/gds.h) or of
 * any other arena:
 *  - first fit over an address-ordered free list, every extent aligned to
 *    `alignment` (4096 by default) and its size rounded up to it;
 *  - freeing coalesces with both neighbours, so no two free blocks touch;
 *  - ferry_slab_alloc(layout, count) is all-or-nothing: on failure nothing
 *    is held;
 *  - allocate and free are O(log n) in the number of blocks (a balanced
 *    tree by address, each node knowing the largest free block below it);
 *  - ferry_slab_check() walks every invariant (free + used == capacity, no
 *    two free blocks adjacent, no overlap, aligned, tree consistent).
 *
 * Each allocated extent also carries a key state, which callers may use
 * or ignore: a fresh extent is WRITING (invisible to readers);
 * ferry_slab_commit() makes it READY; readers take counted read locks.
 * The errors:
 *     FERRY_ENOTFOUND    no extent starts at that offset
 *     FERRY_ENOTREADABLE read lock on a WRITING extent
 *     FERRY_ENOTWRITABLE write lock on a read-locked one
 *     FERRY_ESTATE       commit of a READY extent, ...
 *     FERRY_ELOCKED      free of a read-locked extent
 *     FERRY_ENOSPACE     no free block fits: slab full
 *     -ENOMEM            ferry's own bookkeeping failed
 *
 * Thread-safety: every function may be called from several threads at once
 * on the same slab (one mutex; each call holds it for O(log n)).
 */
#ifndef FERRY_SLAB_H
#define FERRY_SLAB_H

#include "core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- layouts: lists of shapes and dtypes ---- */
enum ferry_dtype {
    FERRY_DTYPE_U8 = 0,
    FERRY_DTYPE_I8,
    FERRY_DTYPE_FP8,   /**< e4m3 / e5m2: one byte */
    FERRY_DTYPE_F16,
    FERRY_DTYPE_BF16,
    FERRY_DTYPE_I16,
    FERRY_DTYPE_F32,
    FERRY_DTYPE_I32,
    FERRY_DTYPE_F64,
    FERRY_DTYPE_I64,
    FERRY_DTYPE_COUNT
};
/** Bytes per element of a dtype; 0 for an unknown one. */
FERRY_API size_t ferry_dtype_size(int dtype);
/** "bf16", "u8", ...; "?" for an unknown one. Never NULL. */
FERRY_API const char *ferry_dtype_name(int dtype);

#define FERRY_SHAPE_MAX_DIMS 8
typedef struct ferry_shape {
    unsigned ndim;                         /**< 0..FERRY_SHAPE_MAX_DIMS (0: a scalar) */
    uint64_t dims[FERRY_SHAPE_MAX_DIMS];
} ferry_shape;

/**
 * One object = n tensors, tensor i of shapes[i] and dtypes[i], laid out back
 * to back. The two counts are separate so that a mismatch is caught
 * (FERRY_EMISMATCH).
 */
typedef struct ferry_layout {
    size_t n_shapes;
    const ferry_shape *shapes;
    size_t n_dtypes;
    const int *dtypes;
} ferry_layout;

/**
 * Bytes of one object of layout l (the sum of its tensors, unaligned).
 * Errors: -EINVAL (NULL, no tensors, unknown dtype, ndim too large, a zero
 * byte object), FERRY_EMISMATCH (n_shapes != n_dtypes), -EOVERFLOW.
 */
FERRY_API int ferry_layout_bytes(const ferry_layout *l, uint64_t *out);

/* ---- extents ---- */
typedef struct ferry_extent {
    uint64_t offset;   /**< byte offset in the slab, aligned */
    uint64_t size;     /**< bytes, rounded up to the alignment */
} ferry_extent;

enum ferry_extent_state {
    FERRY_EXTENT_ABSENT = 0,   /**< no extent starts there */
    FERRY_EXTENT_WRITING = 1,  /**< allocated, being written, invisible to readers */
    FERRY_EXTENT_READY = 2,    /**< committed; may be read-locked */
    FERRY_EXTENT_READING = 3   /**< READY with at least one read lock */
};

typedef struct ferry_slab ferry_slab;

/** The largest alignment a slab accepts: 1 GiB (what a persistent slab's
 * header can hold). */
#define FERRY_SLAB_ALIGN_MAX ((size_t)1 << 30)

typedef struct ferry_slab_options {
    size_t size;          /**< sizeof(ferry_slab_options), or an older header's:
                               at least FERRY_SLAB_OPTIONS_MIN_SIZE */
    /** bytes managed, 1..UINT64_MAX; rounded DOWN to the alignment, and
     *  that must leave at least one alignment unit */
    uint64_t capacity;
    /** a power of two in 1..FERRY_SLAB_ALIGN_MAX (1 GiB); 0 -> 4096 */
    size_t alignment;
} ferry_slab_options;
/** The smallest size ferry_slab_create takes: the options up to capacity
 *  (alignment then 4096). */
#define FERRY_SLAB_OPTIONS_MIN_SIZE (offsetof(ferry_slab_options, capacity) + sizeof(uint64_t))
#define FERRY_SLAB_OPTIONS_INIT \
    {FERRY_FIELD(size) sizeof(ferry_slab_options), FERRY_FIELD(capacity) 0, \
     FERRY_FIELD(alignment) 0}

/**
 * Create an allocator over [0, capacity). Every option is range-checked
 * before it is used. Errors: -EINVAL with a message naming the field, its
 * value and the accepted range (size too small, capacity below the
 * alignment, an alignment that is not a power of two or is above 1 GiB),
 * -ENOMEM. *out owned by the caller: ferry_slab_destroy().
 */
FERRY_API int ferry_slab_create(const ferry_slab_options *opt, ferry_slab **out);
/** Free the allocator (extents need not be freed first). NULL does nothing. */
FERRY_API void ferry_slab_destroy(ferry_slab *s);
/** The message of this slab's last failure, "" if none. */
FERRY_API const char *ferry_slab_last_error(const ferry_slab *s);

/**
 * Allocate `count` objects of layout l, each its own extent (size =
 * ferry_layout_bytes rounded up to the alignment), first fit by address,
 * into out[0..count). All-or-nothing: on failure no extent is held and out
 * is untouched. Returns count. Errors: -EINVAL (count 0 or above INT32_MAX,
 * NULL), layout errors (see ferry_layout_bytes), FERRY_ENOSPACE (no free
 * block fits one of them; refused before anything is sized by count when
 * count objects exceed the free bytes), -ENOMEM (bookkeeping). New extents
 * are WRITING.
 */
FERRY_API int ferry_slab_alloc(ferry_slab *s, const ferry_layout *l, unsigned count,
                               ferry_extent *out);
/** Allocate one extent of `bytes` (rounded up); same rules as ferry_slab_alloc. */
FERRY_API int ferry_slab_alloc_bytes(ferry_slab *s, uint64_t bytes, ferry_extent *out);
/**
 * Free an extent from ferry_slab_alloc*. Coalesces with free neighbours.
 * Errors: FERRY_ENOTFOUND (no extent starts at e->offset), FERRY_EMISMATCH
 * (e->size differs from the allocated size), FERRY_ELOCKED (read-locked).
 */
FERRY_API int ferry_slab_free(ferry_slab *s, const ferry_extent *e);

/* ---- key states (optional) ---- */
/** WRITING -> READY. FERRY_ENOTFOUND, FERRY_ESTATE (not WRITING). */
FERRY_API int ferry_slab_commit(ferry_slab *s, uint64_t offset);
/** READY -> read-locked (counted). FERRY_ENOTFOUND, FERRY_ENOTREADABLE (WRITING),
 *  -EOVERFLOW (2^32 - 1 read locks already held). */
FERRY_API int ferry_slab_read_lock(ferry_slab *s, uint64_t offset);
/** Drop one read lock. FERRY_ENOTFOUND, FERRY_ESTATE (no read lock held). */
FERRY_API int ferry_slab_read_unlock(ferry_slab *s, uint64_t offset);
/** READY (no readers) -> WRITING, to overwrite in place. FERRY_ENOTFOUND,
 *  FERRY_ENOTWRITABLE (read-locked), FERRY_ESTATE (already WRITING). */
FERRY_API int ferry_slab_write_lock(ferry_slab *s, uint64_t offset);
/** The state of the extent starting at offset (FERRY_EXTENT_ABSENT if none);
 *  *readers (may be NULL) gets the read-lock count. */
FERRY_API int ferry_slab_state(ferry_slab *s, uint64_t offset, unsigned *readers);

/* ---- accounting ---- */
typedef struct ferry_slab_stats {
    size_t size;             /**< set by the caller: sizeof(ferry_slab_stats) */
    uint64_t capacity;       /**< bytes managed */
    uint64_t used;           /**< bytes in allocated extents */
    uint64_t free;           /**< capacity - used */
    uint64_t largest_free;   /**< the largest free block */
    uint64_t used_blocks;    /**< allocated extents */
    uint64_t free_blocks;    /**< free blocks (never two adjacent) */
    double usage;            /**< used / capacity */
    /** 1 - largest_free / free: 0 when all free space is one block (or none is free) */
    double fragmentation;
    uint64_t allocs;         /**< extents handed out, lifetime */
    uint64_t frees;          /**< extents freed, lifetime */
    uint64_t failures;       /**< allocation calls that failed */
} ferry_slab_stats;
#define FERRY_SLAB_STATS_INIT \
    {FERRY_FIELD(size) sizeof(ferry_slab_stats), FERRY_FIELD(capacity) 0, FERRY_FIELD(used) 0, \
     FERRY_FIELD(free) 0, FERRY_FIELD(largest_free) 0, FERRY_FIELD(used_blocks) 0, \
     FERRY_FIELD(free_blocks) 0, FERRY_FIELD(usage) 0, FERRY_FIELD(fragmentation) 0, \
     FERRY_FIELD(allocs) 0, FERRY_FIELD(frees) 0, FERRY_FIELD(failures) 0}
/**
 * A snapshot of the counters, as every ferry_<object>_stats_get: the
 * caller sets out->size (its header's sizeof(ferry_slab_stats), e.g. with
 * FERRY_SLAB_STATS_INIT) and only that many bytes are written; out->size
 * stays. Errors: -EINVAL (NULL, out->size not set).
 */
FERRY_API int ferry_slab_stats_get(const ferry_slab *s, ferry_slab_stats *out);
FERRY_API uint64_t ferry_slab_capacity(const ferry_slab *s);
FERRY_API size_t ferry_slab_alignment(const ferry_slab *s);

/**
 * Walk every invariant: blocks cover [0, capacity) exactly, free + used ==
 * capacity, no two free blocks adjacent, no overlap, all aligned, the
 * tree's order, balance and cached maxima. 0 when sound, FERRY_ECORRUPT
 * with a message naming the first broken invariant otherwise. O(n).
 */
FERRY_API int ferry_slab_check(ferry_slab *s);

#ifdef __cplusplus
}
#endif
#endif
