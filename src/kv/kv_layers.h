/*
 * kv_layers.h - layer-by-layer retrieves and stores (layers.c, and the
 * server client's side of them in client_layers.c). Private.
 *
 * A layerwise operation is a ferry_kv_op with a ferry__kv_lw attached. It
 * holds its chunks in L1 slots for its whole life (a retrieve: acquired,
 * read-locked, at most half of L1; a store: reserved, invisible, at most
 * its window, a quarter, the rest staged in images of its own:
 * layers_stage.c), through one of two
 * backends with the same four steps: acquire / release, reserve /
 * commit-or-abort. In-process they are kv_slots.h's; through a server,
 * RESERVE / COMMIT / ACQUIRE / RELEASE on a connection the operation
 * leases for itself (kvc.h), so what it holds ends with that connection.
 * Bytes move layer by layer between the engine's buffer and the slots'
 * images (ferry__kv_xfer_layer), in this process either way.
 *
 * Locking: op->mu guards every field of the lw and op->done / result;
 * op->cv is broadcast whenever a layer changes state or the op ends. A
 * store's copies run in the caller of ferry_kv_op_layer_done under op->mu;
 * a retrieve's on a worker, which takes op->mu only to publish.
 */
#ifndef FERRY_SRC_KV_LAYERS_H
#define FERRY_SRC_KV_LAYERS_H

#include "kv/kv_impl.h"

struct ferry__kvc;

enum { LW_PENDING = 0, LW_QUEUED = 1, LW_DONE = 2 };

/* one chunk the operation holds */
typedef struct ferry__kv_lwc {
    size_t i;               /* its index in the request */
    ferry__kv_entry *e;     /* in-process: the entry held */
    uint64_t slot, gen;     /* its L1 slot and that slot's generation */
} ferry__kv_lwc;

typedef struct ferry__kv_lw {
    int store;              /* 1: ferry_kv_store_layers, 0: ferry_kv_retrieve_layers */
    uint32_t nlayers;
    uint8_t *lst;           /* per layer: LW_* */
    uint32_t ndone;         /* store: layers copied */
    int sealed;             /* store: no more layers taken (finishing, failed or cancelled) */
    int stop;               /* the code that stopped the layers (< 0), else 0 */
    int acquired;           /* retrieve: the chunks are held (tokens is final) */
    uint64_t tokens;        /* leading tokens held */
    ferry__kv_lwc *ch;      /* chunks held, in request order */
    ferry__kv_lchunk *lc;   /* their tokens and image addresses, for the copies */
    size_t nheld;
    int *st;                /* per chunk of the request: its code */
    ferry_stream *s;        /* device buffers: the copy stream */
    int own_s;              /* s is one of the store's (given back at the end) */
    ferry_event **ev;       /* device buffers: one per layer */
    struct ferry__kvc *conn; /* through a server: the operation's own connection */
    unsigned char *pool;    /* through a server: that connection's mapping of the pool */
    /* store: the chunks past its window in L1 (layers_stage.c), whose
     * layers go into images of its own: chunks [stage0, stage0 + nstaged)
     * of the request, lc[nheld + k] the image of chunk stage0 + k */
    size_t stage0, nstaged;
    unsigned char *stage;   /* nstaged chunk images, back to back */
    size_t stage_bytes;
    ferry_device *stage_dev; /* the device stage is pinned with, or NULL */
} ferry__kv_lw;

/* op.c's hooks (layers.c), each a no-op for an op that is not layerwise:
 * ferry_kv_op_wait's refusal while a store lacks layers (0 when it may
 * wait; kv NULL: the store is closing and will abandon it); cancel, free
 * and close of a store not finished abandon it (nothing committed, slots
 * back; kv is the op's open store); detach gives back what the op holds of
 * its store (events, stream, connection) and free the rest */
int ferry__kv_lw_wait_check(ferry_kv *kv, ferry_kv_op *op);
void ferry__kv_lw_abandon(ferry_kv *kv, ferry_kv_op *op);
void ferry__kv_lw_detach(ferry_kv *kv, ferry_kv_op *op);
void ferry__kv_lw_free(ferry_kv_op *op);

/* record that op holds chunk i (entry e in-process, else NULL) in L1 slot
 * `slot` of generation gen, whose image is at pool_slot in this process */
void ferry__kv_lw_hold(ferry_kv *kv, ferry_kv_op *op, size_t i, ferry__kv_entry *e,
                       uint64_t slot, uint64_t gen, unsigned char *pool_slot);

/* layers_stage.c: after the reserve, give the trailing chunks the window
 * left out (FERRY_ENOSPACE) images of the op's own (their code 0 from
 * then on; none to be had: -ENOMEM). After the last layer (the window
 * committed): store the staged images as ferry_kv_store does (waits,
 * batches), their codes into lw->st. Free: give the images back, kept
 * on kv for the next store when they fit its bound (kv NULL: freed);
 * NULL-safe, idempotent. Drop: free what kv keeps (its close). */
void ferry__kv_lw_stage(ferry_kv *kv, ferry_kv_op *op);
void ferry__kv_lw_stage_store(ferry_kv *kv, ferry_kv_op *op);
void ferry__kv_lw_stage_free(ferry_kv *kv, ferry__kv_lw *lw);
void ferry__kv_lw_stage_drop(ferry_kv *kv);

/* the server client's backend (client_layers.c): each fills lw->ch /
 * nheld / st as the in-process one does; 0 or a code that ends the op */
int ferry__kvc_lw_acquire(ferry_kv *kv, ferry_kv_op *op, size_t cap);
void ferry__kvc_lw_release(ferry_kv *kv, ferry_kv_op *op);
int ferry__kvc_lw_reserve(ferry_kv *kv, ferry_kv_op *op, size_t cap);
void ferry__kvc_lw_commit(ferry_kv *kv, ferry_kv_op *op, int abort);
/* the chunks one layerwise op may hold through the server */
size_t ferry__kvc_lw_cap(ferry_kv *kv);
/* give the op's connection back (kept for the next op when still up) */
void ferry__kvc_lw_unlease(ferry_kv *kv, ferry_kv_op *op);

#endif
