/*
 * sized.h - structs versioned by their leading size field (private).
 *
 * Every public options struct starts with `size_t size` and accepts any
 * prefix of itself from its documented minimum (FERRY_<X>_MIN_SIZE: the
 * first version's struct, or the fewest members a call needs) up to this
 * header's sizeof, ending between two members; members past the caller's
 * size keep their defaults, and a size past ours (a newer header's, whose
 * members this library would ignore) is refused. Every stats struct starts
 * with `size_t size` set by the caller, and a snapshot fills only that many
 * bytes. These calls are the whole rule, so every module applies it alike.
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

/* what an options struct accepts */
typedef struct ferry__sized {
    const char *type;             /* "ferry_kv_config" */
    size_t min;                   /* FERRY_<X>_MIN_SIZE */
    const char *min_name;         /* "FERRY_KV_CONFIG_MIN_SIZE" */
    size_t full;                  /* sizeof in this library */
    const ferry__member *later;   /* the members past min, in order */
    size_t n_later;
} ferry__sized;

/* the descriptor of options struct T whose minimum is the macro MIN and
 * whose members past it are the array `later` (FERRY__SIZED0: none) */
#define FERRY__SIZED(T, MIN, later) {#T, MIN, #MIN, sizeof(T), later, FERRY__ARRAY_LEN(later)}
#define FERRY__SIZED0(T, MIN) {#T, MIN, #MIN, sizeof(T), NULL, 0}

/* 1 when size is one d accepts (no message: for per-call structs) */
int ferry__opts_size_fits(const ferry__sized *d, size_t size);
/* 0 when size is one d accepts, else -EINVAL with a message
 * "<what>: <type> size N is not accepted: ..." naming the range */
int ferry__opts_size_ok(ferry__errbuf *eb, const char *what, const ferry__sized *d, size_t size);

/*
 * Copy the caller's options src (its size field first; not NULL) over dst,
 * which holds this header's defaults (the struct's _INIT): the first
 * src->size bytes, after ferry__opts_size_ok; dst->size becomes d->full.
 */
int ferry__opts_take(ferry__errbuf *eb, const char *what, const ferry__sized *d, void *dst,
                     const void *src);

/*
 * Write the snapshot snap (this header's struct, full bytes, size first)
 * into the caller's out, only out->size bytes of it (the caller's header's
 * struct); out->size is left as the caller set it. -EINVAL when out->size
 * does not even cover the size field. out must not be NULL.
 */
int ferry__stats_put(ferry__errbuf *eb, const char *what, void *out, const void *snap,
                     size_t full);

#endif
