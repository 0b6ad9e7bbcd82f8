/*
 * named.c - chunks named by the caller (ferry/kv.h, "chunks named by the
 * caller"): the front of store, retrieve, lookup and delete by name.
 *
 * A name only chooses a chunk id; everything after is the token form's
 * path (either backend: the daemon sees ids, never names). The id is
 * XXH3-128 of a domain tag, the name's length and bytes under the store's
 * seed, then in the request's namespace like every id. The tag keeps the
 * two forms' ids apart by construction: a token chain's link hashes 16
 * bytes of the previous link and then tokens, never the tag's prefix.
 *
 * Names come as an array of ferry_kv_name, or (ferry_kv_lookup_named_packed)
 * as names of one length back to back: a binding's one-key exists then
 * builds no array (that array cost more than the lookup). Both forms
 * give the same ids and take the same path from there.
 *
 * Invariant: every name is checked (present, 1 .. FERRY_KV_NAME_MAX bytes)
 * and the request whole before an id is made or a byte moves.
 */
#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>

#include <errno.h>
#include <string.h>

#include "kv/backend.h"
#include "kv/kv_impl.h"
#include "kv/kv_slots.h"
#include "kv/store/store_int.h"

static const char tag[] = "ferry-kv-name-1";

/* where a call's names are: an array of ferry_kv_name, or n names of len
 * bytes back to back (ferry_kv_lookup_named_packed) */
typedef struct name_src {
    const ferry_kv_name *v;        /* the array form */
    const unsigned char *packed;   /* the packed form: name i at packed + i * len */
    size_t len;
    int is_packed;
} name_src;

static const void *name_at(const name_src *s, size_t i, size_t *len)
{
    if (s->is_packed) {
        *len = s->len;
        return s->packed + i * s->len;
    }
    *len = s->v[i].len;
    return s->v[i].bytes;
}

/* every name present and 1 .. FERRY_KV_NAME_MAX bytes; 0 or -EINVAL */
static int names_ok(ferry_kv *kv, const name_src *s, size_t n, const char *what)
{
    if ((s->is_packed ? !s->packed : !s->v) || n == 0)
        return ferry__kv_err(kv, -EINVAL, "kv %s: no names (names %p, n %zu)", what,
                             s->is_packed ? (const void *)s->packed : (const void *)s->v, n);
    if (n > INT32_MAX / 2 / kv->chunk_tokens)
        return ferry__kv_err(kv, -EINVAL, "kv %s: %zu names is too many", what, n);
    for (size_t i = 0; i < (s->is_packed ? 1 : n); i++) { /* packed: one length for all */
        size_t len;
        const void *b = name_at(s, i, &len);
        if (!b || len == 0 || len > FERRY_KV_NAME_MAX)
            return ferry__kv_err(kv, -EINVAL, "kv %s: name %zu of %zu is %s (%zu bytes; 1 .. %u)",
                                 what, i, n, !b ? "NULL" : "empty or too long", len,
                                 FERRY_KV_NAME_MAX);
    }
    if (s->is_packed && n > SIZE_MAX / s->len)
        return ferry__kv_err(kv, -EINVAL, "kv %s: %zu names of %zu bytes is too many", what, n,
                             s->len);
    return 0;
}

/* XXH3-128 of tag, the name's length (8 bytes, little-endian) and bytes.
 * One call over a copy on the stack: XXH3's one-shot and streaming forms
 * give the same hash of the same bytes, and for a short name the one-shot
 * costs a fraction of a streaming state's set-up. */
static XXH128_hash_t name_hash(uint64_t seed, const void *name, size_t len)
{
    unsigned char buf[sizeof tag - 1 + 8 + FERRY_KV_NAME_MAX];
    memcpy(buf, tag, sizeof tag - 1);
    for (int b = 0; b < 8; b++)
        buf[sizeof tag - 1 + b] = (unsigned char)((uint64_t)len >> (8 * b));
    memcpy(buf + sizeof tag - 1 + 8, name, len);
    return XXH3_128bits_withSeed(buf, sizeof tag - 1 + 8 + len, seed);
}

/* the ids of the n names (stack when it fits; free when != stack); n or a code */
static int name_ids(ferry_kv *kv, const name_src *names, size_t n, const ferry_kv_req *req,
                    const char *what, ferry_kv_hash *stack, ferry_kv_hash **ids)
{
    int rc = ferry__kv_req_ok(kv, req, what);
    if (rc < 0 || (rc = names_ok(kv, names, n, what)) < 0)
        return rc;
    if (req && ((req->flags & FERRY_KV_PARTIAL) || ferry__kv_req_skip(req)))
        return ferry__kv_err(kv, -EINVAL,
                             "kv %s: a named chunk is whole: no FERRY_KV_PARTIAL or skip_tokens",
                             what);
    ferry_kv_hash *out = stack;
    if (n > STACK_CHUNKS && !(out = ferry__malloc(n * sizeof *out)))
        return ferry__kv_err(kv, -ENOMEM, "kv %s: out of memory for %zu chunk ids", what, n);
    ferry_kv_hash ns = ferry__kv_ns_of(kv, req);
    for (size_t i = 0; i < n; i++) {
        size_t nl;
        const void *nb = name_at(names, i, &nl);
        XXH128_hash_t h = name_hash(kv->seed, nb, nl);
        out[i].lo = h.low64 ^ ns.lo;
        out[i].hi = h.high64 ^ ns.hi;
    }
    *ids = out;
    return (int)n;
}

enum { STORE, RETRIEVE, LOOKUP, DELETE, LOOKUP_PACKED };
static const char *const what_of[] = {"store_named", "retrieve_named", "lookup_named",
                                      "delete_named", "lookup_named_packed"};

static int named(ferry_kv *kv, int op, const name_src *names, size_t n,
                 const ferry_kv_req *req, const ferry_kv_buffer *in)
{
    const char *what = what_of[op];
    if (!kv)
        return ferry__err_set(NULL, -EINVAL, "kv %s: store is NULL", what);
    int rc = ferry__kv_enter(kv, what);
    if (rc < 0)
        return rc;
    ferry_kv_hash stack[STACK_CHUNKS], *ids = NULL;
    ferry_kv_buffer buf;
    int nch = name_ids(kv, names, n, req, what, stack, &ids);
    size_t ntok = n * kv->chunk_tokens;
    if (nch >= 0 && (op == STORE || op == RETRIEVE) &&
        (rc = ferry__kv_buffer_take(in, &buf, &kv->layout, kv->dev, ntok, what, NULL)) < 0)
        ferry__kv_err_pass(kv, rc);
    else if (nch < 0)
        rc = nch;
    else if (op == STORE)
        rc = ferry__kv_be_call(kv, 1, ids, n, ntok, req, &buf);
    else if (op == RETRIEVE)
        rc = ferry__kv_be_call(kv, 0, ids, n, ntok, req, &buf);
    else if (op == LOOKUP || op == LOOKUP_PACKED)
        rc = ferry__kv_lookup_ids(kv, ids, n, ntok, req);
    else
        rc = kv->be->del(kv, ids, n);
    if (rc > 0 && op != DELETE) /* tokens of whole chunks -> chunks */
        rc /= (int)kv->chunk_tokens;
    if (ids && ids != stack)
        ferry__free(ids);
    ferry__kv_leave(kv);
    return rc;
}

int ferry_kv_store_named(ferry_kv *kv, const ferry_kv_name *names, size_t n,
                         const ferry_kv_req *req, const ferry_kv_buffer *src)
{
    name_src s = {names, NULL, 0, 0};
    return named(kv, STORE, &s, n, req, src);
}

int ferry_kv_retrieve_named(ferry_kv *kv, const ferry_kv_name *names, size_t n,
                            const ferry_kv_req *req, const ferry_kv_buffer *dst)
{
    name_src s = {names, NULL, 0, 0};
    return named(kv, RETRIEVE, &s, n, req, dst);
}

int ferry_kv_lookup_named(ferry_kv *kv, const ferry_kv_name *names, size_t n,
                          const ferry_kv_req *req)
{
    name_src s = {names, NULL, 0, 0};
    return named(kv, LOOKUP, &s, n, req, NULL);
}

int ferry_kv_delete_named(ferry_kv *kv, const ferry_kv_name *names, size_t n,
                          const ferry_kv_req *req)
{
    name_src s = {names, NULL, 0, 0};
    return named(kv, DELETE, &s, n, req, NULL);
}

int ferry_kv_lookup_named_packed(ferry_kv *kv, const void *names, size_t name_len, size_t n,
                                 const ferry_kv_req *req)
{
    name_src s = {NULL, names, name_len, 1};
    return named(kv, LOOKUP_PACKED, &s, n, req, NULL);
}
