/*
 * sized.h - structs versioned by their leading size field (private).
 *
 * Every public options struct starts with `size_t size` and accepts any
 * prefix of itself from its documented minimum (the first version's
 * struct) up to this header's sizeof; every stats struct starts with
 * `size_t size` set by the caller, and a snapshot fills only that many
 * bytes. These two calls are the whole rule, so every module applies it
 * the same way.
 */
#ifndef FERRY_SRC_CORE_SIZED_H
#define FERRY_SRC_CORE_SIZED_H

#include <stddef.h>

#include "core.h"

/* one member past an options struct's minimum: a caller's size may end
 * before or after it, never inside it */
typedef struct ferry__member {
    const char *name;
    size_t off, end;
} ferry__member;
#define FERRY__MEMBER(type, m) \
    {#m, offsetof(type, m), offsetof(type, m) + sizeof(((type *)0)->m)}

/*
 * Copy the caller's options src (any prefix: its size field first) over
 * dst, which holds this header's defaults (the struct's _INIT): the first
 * src->size bytes; dst->size becomes full (sizeof this header's struct).
 * -EINVAL, with a message naming `what`, the size and the accepted range
 * ("<what> size N ..."), for a size below min, above full or ending inside
 * one of members[0..n). src must not be NULL.
 */
int ferry__opts_take(ferry__errbuf *eb, const char *what, void *dst, size_t full,
                     const void *src, size_t min, const ferry__member *members, size_t n);

/*
 * Write the snapshot snap (this header's struct, full bytes, size first)
 * into the caller's out, only out->size bytes of it (the caller's header's
 * struct); out->size is left as the caller set it. -EINVAL when out->size
 * does not even cover the size field. out must not be NULL.
 */
int ferry__stats_put(ferry__errbuf *eb, const char *what, void *out, const void *snap,
                     size_t full);

#endif
