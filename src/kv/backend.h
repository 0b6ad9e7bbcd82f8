/*
 * backend.h - the KV API's two backends behind one table (private).
 *
 * kv/'s front (api.c, named.c, layers.c, async.c,
 * metrics.c) checks a call's arguments, hashes its chunk ids and builds its
 * request once, then calls the store's table. There are two tables: the
 * in-process tiered store (store/: its tiers, index and policies) and a
 * client of `ferry serve` (client/: the same contract through the
 * daemon's socket and shared pool). ferry_kv_open picks one; nothing else
 * asks which it is. A member marked optional may be NULL (nothing to do).
 *
 * The contract each table keeps is kv.h's; one test suite
 * (tests/test_kv_contract.c) runs the same cases over both.
 */
#ifndef FERRY_SRC_KV_BACKEND_H
#define FERRY_SRC_KV_BACKEND_H

#include "kv/kv_impl.h"

/*
 * A lookup's chunk ids, made as they are asked for: a token chain is
 * hashed a block at a time, so a lookup that misses early hashes only as
 * far as it looked (the in-process store); a client takes them all at
 * once. Named chunks come precomputed.
 */
typedef struct ferry__kv_idsrc {
    const ferry_kv_hash *ids;   /* precomputed (named chunks), or NULL */
    const int32_t *tokens;      /* else: the chain of these tokens */
    size_t n;
    uint32_t chunk_tokens;
    uint64_t seed;
    ferry_kv_hash ns, prev;     /* the request's namespace; the last link */
    size_t nch, next;           /* chunks in all; the next to hand out */
} ferry__kv_idsrc;

/* the ids of chunks [s->next, s->next + k) into out (k <= what is left) */
void ferry__kv_idsrc_take(ferry__kv_idsrc *s, size_t k, ferry_kv_hash *out);

struct ferry_kv_op;

typedef struct ferry__kv_backend {
    const char *name;
    /* the leading tokens of the n-token request whose ids src hands out
     * that are cached (req->tiers per chunk) */
    int (*lookup)(ferry_kv *kv, ferry__kv_idsrc *src, const ferry_kv_req *req);
    /* kv.h's store / retrieve of chunks ids[0..nch) of an n-token request */
    int (*store)(ferry_kv *kv, const ferry_kv_hash *ids, size_t nch, size_t n,
                 const ferry_kv_req *req, const ferry_kv_buffer *buf);
    int (*retrieve)(ferry_kv *kv, const ferry_kv_hash *ids, size_t nch, size_t n,
                    const ferry_kv_req *req, const ferry_kv_buffer *buf);
    int (*prefetch)(ferry_kv *kv, const ferry_kv_hash *ids, size_t nch, size_t n);
    int (*pin)(ferry_kv *kv, const ferry_kv_hash *ids, size_t nch, size_t n, int pin);
    int (*del)(ferry_kv *kv, const ferry_kv_hash *ids, size_t nch);
    int (*clear)(ferry_kv *kv);
    /* after the store's own queues drained: what the backend still holds */
    int (*flush)(ferry_kv *kv);
    int (*sync)(ferry_kv *kv);
    /* this header's stats struct, whole */
    int (*stats)(ferry_kv *kv, ferry_kv_stats *out);
    /* optional: ready the workers for asynchronous operations */
    int (*async_start)(ferry_kv *kv);
    /* layer by layer (kv_layers.h): the chunks one op may hold, and the four
     * steps; each fills op->lw's chunks and codes */
    size_t (*lw_cap)(ferry_kv *kv);
    int (*lw_acquire)(ferry_kv *kv, struct ferry_kv_op *op, size_t cap);
    void (*lw_release)(ferry_kv *kv, struct ferry_kv_op *op);
    int (*lw_reserve)(ferry_kv *kv, struct ferry_kv_op *op, size_t cap);
    void (*lw_commit)(ferry_kv *kv, struct ferry_kv_op *op, int abort);
    /* optional: what an op holds of the backend beyond the store (a
     * connection of its own), given back */
    void (*lw_unlease)(ferry_kv *kv, struct ferry_kv_op *op);
    /* optional: the backend's own state, after the workers stopped and the
     * ops were detached */
    void (*close)(ferry_kv *kv);
    /* optional: ferry_kv_close_begin, after kv->close_begun is set: what
     * the backend's calls wait on (besides kv->loaded) ends at once; any
     * thread, calls inside, called once or more */
    void (*close_begin)(ferry_kv *kv);
} ferry__kv_backend;

/*
 * A store or retrieve through the table (store: 1 for kv->be->store), as
 * one call: the front counts it (stores or retrieves) and its latency, the
 * tables count chunks only. A layerwise store's staged chunks go through
 * the table too (layers_stage.c) without this: that store counted itself.
 */
int ferry__kv_be_call(ferry_kv *kv, int store, const ferry_kv_hash *ids, size_t nch, size_t n,
                      const ferry_kv_req *req, const ferry_kv_buffer *buf);

extern const ferry__kv_backend ferry__kv_backend_store;   /* in process */
/* ferry_kv_open with cfg->server: a store whose backend is a client */
int ferry__kv_client_open(const ferry_kv_config *cfg, ferry_kv **out);
extern const ferry__kv_backend ferry__kv_backend_client;  /* through `ferry serve` */

#endif
