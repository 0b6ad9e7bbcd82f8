/*
 * request.c - validating a request and naming its chunks.
 *
 * A request's chunk ids are its chained token hashes xor the namespace digest
 * of model, TP rank/world and salt, so two stores (or ranks) never share a
 * key. Also the stream pool for device buffers and the per-chunk answers
 * (status, tier) a request may ask for.
 */
#include <errno.h>
#include <stddef.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv/backend.h"
#include "kv/kv_impl.h"
#include "sized.h"
#include "kv/store/store_int.h"

/* ---- streams for device buffers ---- */

int ferry__kv_stream_get(ferry_kv *kv, ferry_stream **out)
{
    pthread_mutex_lock(&kv->mu);
    if (kv->nstreams) {
        *out = kv->streams[--kv->nstreams];
        pthread_mutex_unlock(&kv->mu);
        return 0;
    }
    pthread_mutex_unlock(&kv->mu);
    int rc = ferry_stream_create(kv->dev, out);
    if (rc < 0)
        return ferry__kv_err(kv, rc, "kv: creating a stream on %s: %s",
                              ferry_device_name(kv->dev), ferry_last_error());
    return 0;
}

void ferry__kv_stream_put(ferry_kv *kv, ferry_stream *s)
{
    if (!s)
        return;
    pthread_mutex_lock(&kv->mu);
    if (kv->nstreams == kv->cap_streams) {
        unsigned nc = kv->cap_streams ? 2 * kv->cap_streams : 4;
        ferry_stream **n = ferry__realloc(kv->streams, nc * sizeof *n);
        if (!n) {
            pthread_mutex_unlock(&kv->mu);
            ferry_stream_destroy(s);
            return;
        }
        kv->streams = n;
        kv->cap_streams = nc;
    }
    kv->streams[kv->nstreams++] = s;
    pthread_mutex_unlock(&kv->mu);
}

/* ---- helpers ---- */

uint32_t ferry__kv_chunk_ntok(const ferry_kv *kv, size_t i, size_t n)
{
    uint64_t start = (uint64_t)i * kv->chunk_tokens;
    return (uint32_t)FERRY__MIN((uint64_t)kv->chunk_tokens, n - start);
}

ferry_kv_hash ferry__kv_ns_of(ferry_kv *kv, const ferry_kv_req *req)
{
    if (!req || !req->salt || !req->salt_len)
        return kv->ns0;
    return ferry__kv_namespace(kv->seed, kv->model, kv->tp_rank, kv->tp_world, req->salt,
                               req->salt_len);
}

uint64_t ferry__kv_req_skip(const ferry_kv_req *req)
{
    return req && req->size >= offsetof(ferry_kv_req, skip_tokens) + sizeof(uint64_t)
               ? req->skip_tokens
               : 0;
}

void ferry__kv_req_copy(ferry_kv_req *dst, const ferry_kv_req *req)
{
    ferry_kv_req d = FERRY_KV_REQ_INIT;
    if (req)
        memcpy(&d, req, FERRY__MIN(req->size, sizeof d)); /* a prefix: the rest defaults */
    d.size = sizeof d;
    *dst = d;
}

int ferry__kv_req_ok(ferry_kv *kv, const ferry_kv_req *req, const char *what)
{
    static const ferry__member later[] = {FERRY__MEMBER(ferry_kv_req, skip_tokens)};
    static const ferry__sized sized = FERRY__SIZED(ferry_kv_req, FERRY_KV_REQ_MIN_SIZE, later);
    if (req && !ferry__opts_size_fits(&sized, req->size)) {
        char who[64];
        snprintf(who, sizeof who, "kv %s: request", what);
        int rc = ferry__opts_size_ok(NULL, who, &sized, req->size);
        if (rc < 0)
            return ferry__kv_err_pass(kv, rc);
    }
    if (req && req->salt_len && !req->salt)
        return ferry__kv_err(kv, -EINVAL, "kv %s: salt_len %zu with a NULL salt", what,
                              req->salt_len);
    return 0;
}

int ferry__kv_tokens_ok(ferry_kv *kv, const int32_t *tokens, size_t n, const char *what)
{
    if (!tokens || n == 0)
        return ferry__kv_err(kv, -EINVAL, "kv %s: no tokens (tokens %p, n %zu)", what,
                             (const void *)tokens, n);
    /* one pass that vectorizes; the search only when something is negative */
    int32_t any = 0;
    for (size_t i = 0; i < n; i++)
        any |= tokens[i];
    if (any >= 0)
        return 0;
    size_t i = 0;
    while (tokens[i] >= 0)
        i++;
    return ferry__kv_err(kv, -EINVAL,
                         "kv %s: token id %ld at position %zu of %zu is negative (token ids "
                         "are 0 .. 2^31-1)",
                         what, (long)tokens[i], i, n);
}

/* hash tokens into ids (stack buffer when it fits); *ids must be freed when
 * != stack. Returns the number of chunks or a negative code. */
int ferry__kv_make_ids(ferry_kv *kv, const int32_t *tokens, size_t n, const ferry_kv_req *req,
                    const char *what, ferry_kv_hash *stack, ferry_kv_hash **ids)
{
    int rc = ferry__kv_req_ok(kv, req, what);
    if (rc < 0)
        return rc;
    if ((rc = ferry__kv_tokens_ok(kv, tokens, n, what)) < 0)
        return rc;
    int partial = req && (req->flags & FERRY_KV_PARTIAL);
    size_t nch = n / kv->chunk_tokens + (partial && n % kv->chunk_tokens ? 1 : 0);
    if (nch > INT32_MAX / 2)
        return ferry__kv_err(kv, -EINVAL, "kv %s: %zu tokens is too many", what, n);
    ferry_kv_hash *out = stack;
    if (nch > STACK_CHUNKS) {
        out = ferry__malloc(nch * sizeof *out);
        if (!out)
            return ferry__kv_err(kv, -ENOMEM, "kv %s: out of memory for %zu chunk ids",
                                  what, nch);
    }
    ferry__kv_hash_chain(kv->seed, tokens, n, kv->chunk_tokens, partial, out, nch);
    ferry_kv_hash ns = ferry__kv_ns_of(kv, req);
    for (size_t i = 0; i < nch; i++) {
        out[i].lo ^= ns.lo;
        out[i].hi ^= ns.hi;
    }
    *ids = out;
    return (int)nch;
}

void ferry__kv_set_status(const ferry_kv_req *req, size_t i, int code)
{
    if (req && req->status && i < req->max_chunks)
        req->status[i] = code;
}

void ferry__kv_set_tier(const ferry_kv_req *req, size_t i, int tier)
{
    if (req && req->tiers && i < req->max_chunks)
        req->tiers[i] = (uint8_t)tier;
}

void ferry__kv_idsrc_take(ferry__kv_idsrc *s, size_t k, ferry_kv_hash *out)
{
    FERRY__ASSERT(s->next + k <= s->nch);
    if (s->ids) {
        memcpy(out, s->ids + s->next, k * sizeof *out);
    } else {
        ferry__kv_hash_step(s->seed, s->tokens, s->n, s->chunk_tokens, s->next, k, &s->prev, out);
        for (size_t j = 0; j < k; j++) {
            out[j].lo ^= s->ns.lo;
            out[j].hi ^= s->ns.hi;
        }
    }
    s->next += k;
}
