/*
 * layers.c - layer-by-layer retrieves and stores (ferry/kv.h, "layer by
 * layer"; the state in kv_layers.h).
 *
 * A retrieve runs on an operation worker: it holds its chunks (acquire:
 * promoted into L1 and read-locked), then copies layer 0 of every chunk,
 * publishes it, layer 1, and so on; for a device buffer every layer's
 * copies go on one stream followed by that layer's event, and the worker
 * then waits for the events in order, publishing each layer as done.
 * Last it lets the chunks go. A cancel is seen between chunks and between
 * layers; the worker ends only after its stream drained, so once the op is
 * done nothing more is written into the engine's buffer.
 *
 * A store reserves its slots in the caller (ferry_kv_store_layers); each
 * ferry_kv_op_layer_done copies that layer into every slot (device: after
 * an event recorded on the engine's stream, on the copy stream, without
 * blocking) and the last one queues the finish on a worker: drain the
 * copy stream, commit every chunk (visible from then on) or, after a
 * failure or cancel, abort them. A store is sealed (takes no more layers)
 * from its finish, failure or cancel on, and it never commits a chunk
 * some layer of which was not copied.
 */
#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "kv/kv_impl.h"
#include "kv/kv_layers.h"
#include "kv/kv_slots.h"
#include "kv/backend.h"
#include "sized.h"
#include "kv/store/store_int.h"

/* ---- what both backends fill ---- */

void ferry__kv_lw_hold(ferry_kv *kv, ferry_kv_op *op, size_t i, ferry__kv_entry *e,
                       uint64_t slot, uint64_t gen, unsigned char *pool_slot)
{
    ferry__kv_lw *lw = op->lw;
    ferry__kv_span sp = ferry__kv_span_from(&kv->layout, kv->chunk_tokens, i,
                                            ferry__kv_chunk_ntok(kv, i, op->n),
                                            lw->store ? 0 : ferry__kv_req_skip(&op->req));
    ferry__kv_lwc *c = &lw->ch[lw->nheld];
    c->i = i;
    c->e = e;
    c->slot = slot;
    c->gen = gen;
    ferry__kv_lchunk *l = &lw->lc[lw->nheld++];
    l->tok0 = sp.tok0;
    l->ntok = sp.ntok;
    l->img = pool_slot + sp.img_off;
}

/* ---- the operation ---- */

/* what the layer state holds of the store: its events, its stream and
 * its server connection (under op->mu; the arrays stay for the op's
 * callers until ferry__kv_lw_free) */
static void lw_detach_locked(ferry_kv *kv, ferry_kv_op *op)
{
    ferry__kv_lw *lw = op->lw;
    if (kv->be->lw_unlease)
        kv->be->lw_unlease(kv, op);
    if (lw->ev)
        for (uint32_t l = 0; l < lw->nlayers; l++)
            ferry_event_destroy(lw->ev[l]);
    ferry__free(lw->ev);
    lw->ev = NULL;
    if (lw->own_s)
        ferry__kv_stream_put(kv, lw->s);
    lw->s = NULL;
    lw->own_s = 0;
    lw->nheld = 0; /* (the slots held are the store's: given back already) */
    ferry__kv_lw_stage_free(kv, lw);
}

static void lw_destroy(ferry__kv_lw *lw)
{
    if (!lw)
        return;
    FERRY__ASSERT(!lw->ev && !lw->s && !lw->conn);
    ferry__kv_lw_stage_free(NULL, lw);
    ferry__free(lw->lst);
    ferry__free(lw->ch);
    ferry__free(lw->lc);
    ferry__free(lw->st);
    ferry__free(lw);
}

/* the op's layer state: arrays, stream and events; 0 or a code */
static int lw_make(ferry_kv *kv, ferry_kv_op *op, int store, const ferry_kv_layers_opt *o)
{
    ferry__kv_lw *lw = ferry__calloc(1, sizeof *lw);
    size_t nch = op->nchunks ? op->nchunks : 1;
    if (lw) {
        op->lw = lw;
        lw->store = store;
        lw->nlayers = kv->layout.num_layers;
        lw->lst = ferry__calloc(lw->nlayers, 1);
        lw->ch = ferry__calloc(nch, sizeof *lw->ch);
        lw->lc = ferry__calloc(nch, sizeof *lw->lc);
        lw->st = ferry__malloc(nch * sizeof *lw->st);
    }
    if (!lw || !lw->lst || !lw->ch || !lw->lc || !lw->st)
        return ferry__kv_err(kv, -ENOMEM, "kv %s_layers: out of memory for %zu chunks",
                             store ? "store" : "retrieve", op->nchunks);
    for (size_t i = 0; i < nch; i++)
        lw->st[i] = FERRY_ENOTFOUND;
    if (op->buf.mem != FERRY_KV_MEM_DEVICE)
        return 0;
    int r = 0;
    lw->s = o->stream;
    if (!lw->s && (r = ferry__kv_stream_get(kv, &lw->s)) == 0)
        lw->own_s = 1;
    if (r == 0 && !(lw->ev = ferry__calloc(lw->nlayers, sizeof *lw->ev)))
        r = ferry__kv_err(kv, -ENOMEM, "kv layers: out of memory for %u events", lw->nlayers);
    for (uint32_t l = 0; r == 0 && l < lw->nlayers; l++)
        if ((r = ferry_event_create(kv->dev, &lw->ev[l])) < 0)
            r = ferry__kv_err(kv, r, "kv layers: creating the event of layer %u: %s", l,
                              ferry_last_error());
    return r;
}

/* validate, hash, and make the op (not started); 0 or a code */
static int lw_new(ferry_kv *kv, int store, const int32_t *tokens, size_t n,
                  const ferry_kv_req *req, const ferry_kv_buffer *buf,
                  const ferry_kv_layers_opt *opt, ferry_kv_op **out)
{
    static const ferry__member later[] = {FERRY__MEMBER(ferry_kv_layers_opt, flags)};
    static const ferry__sized sized =
        FERRY__SIZED(ferry_kv_layers_opt, FERRY_KV_LAYERS_OPT_MIN_SIZE, later);
    const char *what = store ? "store_layers" : "retrieve_layers";
    ferry_kv_layers_opt o = FERRY_KV_LAYERS_OPT_INIT;
    int r;
    if (!kv || !out)
        return kv ? ferry__kv_err(kv, -EINVAL, "kv %s: store or op is NULL", what)
                  : ferry__err_set(NULL, -EINVAL, "kv %s: store or op is NULL", what);
    if (opt && (r = ferry__opts_take(&kv->err, what, &sized, &o, opt)) < 0)
        return ferry__kv_err_pass(kv, r);
    if (o.flags)
        return ferry__kv_err(kv, -EINVAL, "kv %s: unknown flags %#x", what, o.flags);
    if (o.stream && ferry_stream_device(o.stream) != kv->dev)
        return ferry__kv_err(kv, -EINVAL, "kv %s: the stream is not on the store's device", what);
    if (kv->be->async_start && (r = kv->be->async_start(kv)) < 0)
        return r;
    ferry_kv_hash stack[STACK_CHUNKS], *ids = NULL;
    int nch = ferry__kv_make_ids(kv, tokens, n, req, what, stack, &ids);
    if (nch < 0)
        return nch;
    ferry_kv_buffer whole;
    if ((r = ferry__kv_buffer_take(buf, &whole, &kv->layout, kv->dev, n, what, NULL)) < 0) {
        if (ids != stack)
            ferry__free(ids);
        return ferry__kv_err_pass(kv, r);
    }
    ferry_kv_op *op = ferry__kv_op_new(kv, store ? FERRY__KV_OP_STORE : FERRY__KV_OP_RETRIEVE,
                                       ids, (size_t)nch, n, req, &whole);
    if (ids != stack)
        ferry__free(ids);
    if (!op)
        return ferry__kv_err(kv, -ENOMEM, "kv %s: out of memory for the operation", what);
    if ((r = lw_make(kv, op, store, &o)) < 0) {
        op->done = 1;
        ferry_kv_op_free(op);
        return r;
    }
    *out = op;
    return 0;
}

/* the leading tokens of the chunks whose code is 0 */
static uint64_t lead_tokens(ferry_kv *kv, ferry_kv_op *op)
{
    uint64_t lead = 0;
    for (size_t i = 0; i < op->nchunks && op->lw->st[i] == 0; i++)
        lead += ferry__kv_chunk_ntok(kv, i, op->n);
    return lead;
}

/* under op->mu: the op ends with rc; req gets each chunk's code */
static void finish_locked(ferry_kv_op *op, int rc)
{
    for (size_t i = 0; i < op->nchunks; i++)
        ferry__kv_set_status(&op->req, i, op->lw->st[i]);
    op->result = rc;
    op->done = 1;
    pthread_cond_broadcast(&op->cv);
}

static void publish(ferry_kv_op *op, uint32_t layer, int state)
{
    pthread_mutex_lock(&op->mu);
    op->lw->lst[layer] = (uint8_t)state;
    pthread_cond_broadcast(&op->cv);
    pthread_mutex_unlock(&op->mu);
}

static void stop_layers(ferry_kv_op *op, int rc)
{
    pthread_mutex_lock(&op->mu);
    if (!op->lw->stop)
        op->lw->stop = rc;
    pthread_cond_broadcast(&op->cv);
    pthread_mutex_unlock(&op->mu);
}

/* a retrieve's layers, in order; the stream drained when it returns */
static void retrieve_copy(ferry_kv *kv, ferry_kv_op *op)
{
    ferry__kv_lw *lw = op->lw;
    int dev = op->buf.mem == FERRY_KV_MEM_DEVICE;
    uint32_t queued = 0;
    if (!lw->nheld) { /* nothing cached: every layer is as complete as it gets */
        for (uint32_t l = 0; l < lw->nlayers; l++)
            publish(op, l, LW_DONE);
        return;
    }
    for (uint32_t l = 0; l < lw->nlayers; l++) {
        if (ferry__kv_cancelled(&op->cancel)) {
            stop_layers(op, -ECANCELED);
            break;
        }
        int r = ferry__kv_xfer_layer(&op->buf, kv->chunk_tokens, lw->lc, lw->nheld, l, 0,
                                     lw->s, NULL);
        if (r >= 0 && dev && (r = ferry_event_record(lw->ev[l], lw->s)) < 0)
            r = ferry__err_set(NULL, r, "kv retrieve_layers: recording layer %u: %s", l,
                               ferry_last_error());
        if (r < 0) {
            stop_layers(op, ferry__kv_err_pass(kv, r));
            break;
        }
        if (dev && r > 0)
            atomic_fetch_add(&kv->device_calls, (uint64_t)r);
        publish(op, l, dev ? LW_QUEUED : LW_DONE);
        queued = l + 1;
    }
    if (!dev)
        return;
    for (uint32_t l = 0; l < queued; l++) {
        int r = ferry_event_sync(lw->ev[l]);
        if (r < 0) {
            stop_layers(op, ferry__kv_err(kv, r, "kv retrieve_layers: the copies of layer %u: %s",
                                          l, ferry_last_error()));
            break;
        }
        publish(op, l, LW_DONE);
    }
    ferry_stream_sync(lw->s); /* whatever is left: nothing lands after the op is done */
    atomic_fetch_add(&kv->device_chunks, lw->nheld);
}

static void retrieve_run(ferry_kv *kv, ferry__kv_job *j)
{
    ferry_kv_op *op = j->op;
    ferry__kv_lw *lw = op->lw;
    atomic_fetch_add(&kv->retrieves, 1);
    uint64_t t0 = ferry__now_ns();
    int r = kv->be->lw_acquire(kv, op, kv->be->lw_cap(kv));
    pthread_mutex_lock(&op->mu);
    /* (acquires stop at the first miss: the chunks held are the leading ones) */
    for (size_t k = 0; k < lw->nheld; k++)
        lw->tokens += ferry__kv_chunk_ntok(kv, k, op->n);
    lw->acquired = 1;
    if (r < 0 && !lw->stop)
        lw->stop = r;
    pthread_cond_broadcast(&op->cv);
    pthread_mutex_unlock(&op->mu);
    if (r == 0)
        retrieve_copy(kv, op);
    kv->be->lw_release(kv, op);
    /* (before the op is done: stats read after its wait count it) */
    ferry__kv_hist_record(&kv->h_retrieve, ferry__now_ns() - t0);
    pthread_mutex_lock(&op->mu);
    int rc = lw->stop;
    for (size_t k = 0; k < lw->nheld; k++) {
        size_t i = lw->ch[k].i;
        if (rc < 0)
            lw->st[i] = rc;
        /* bytes nobody vouches for never stay in a host buffer (a cancel's
         * layers already copied are the chunk's own: they stay) */
        if (lw->st[i] != 0 && lw->st[i] != -ECANCELED && op->buf.mem == FERRY_KV_MEM_HOST &&
            lw->lc[k].ntok)
            ferry__kv_xfer_out_zero(&op->buf, kv->chunk_tokens, lw->lc[k].tok0, lw->lc[k].ntok);
    }
    if (rc == -ECANCELED)
        for (size_t i = 0; i < op->nchunks; i++)
            lw->st[i] = -ECANCELED;
    finish_locked(op, rc < 0 ? rc : (int)lead_tokens(kv, op));
    pthread_mutex_unlock(&op->mu);
}

static int retrieve_layers_call(ferry_kv *kv, const int32_t *tokens, size_t n,
                             const ferry_kv_req *req, const ferry_kv_buffer *dst,
                             const ferry_kv_layers_opt *opt, ferry_kv_op **out)
{
    ferry_kv_op *op = NULL;
    int r = out ? lw_new(kv, 0, tokens, n, req, dst, opt, &op)
                : lw_new(kv, 0, tokens, n, req, dst, opt, NULL);
    if (r < 0)
        return r;
    ferry__kv_job *j = ferry__calloc(1, sizeof *j);
    if (!j) {
        op->done = 1;
        ferry_kv_op_free(op);
        return ferry__kv_err(kv, -ENOMEM, "kv retrieve_layers: out of memory for a job");
    }
    j->kind = FERRY__KV_JOB_OP;
    j->run = retrieve_run;
    j->op = op;
    ferry__kv_enqueue(kv, j);
    *out = op;
    return 0;
}

int ferry_kv_retrieve_layers(ferry_kv *kv, const int32_t *tokens, size_t n,
                             const ferry_kv_req *req, const ferry_kv_buffer *dst,
                             const ferry_kv_layers_opt *opt, ferry_kv_op **out)
{
    FERRY__KV_CALL(kv, "retrieve_layers",
                   retrieve_layers_call(kv, tokens, n, req, dst, opt, out));
}

/* the wait for a layer of a retrieve (stream NULL: until it landed; else
 * until it is queued, then stream waits for it) */
static int wait_layer(ferry_kv_op *op, ferry_kv *kv, uint32_t layer, ferry_stream *stream,
                      int timeout_ms)
{
    const char *what = stream ? "stream_wait_layer" : "wait_layer";
    ferry__kv_lw *lw = op->lw;
    if (!lw || lw->store)
        return ferry__kv_err(kv, FERRY_ESTATE, "kv %s: the op is not a layerwise retrieve",
                             what);
    if (layer >= lw->nlayers)
        return ferry__kv_err(kv, -EINVAL, "kv %s: layer %u of a store of %u layers", what,
                             layer, lw->nlayers);
    if (stream && op->buf.mem != FERRY_KV_MEM_DEVICE)
        return ferry__kv_err(kv, FERRY_ESTATE,
                             "kv %s: the retrieve is into host memory (use wait_layer)", what);
    if (stream && kv && ferry_stream_device(stream) != kv->dev)
        return ferry__kv_err(kv, -EINVAL, "kv %s: the stream is not on the store's device",
                             what);
    int want = stream ? LW_QUEUED : LW_DONE;
    struct timespec dl = ferry__deadline_ms(timeout_ms > 0 ? (uint64_t)timeout_ms : 0);
    int rc;
    pthread_mutex_lock(&op->mu);
    for (;;) {
        if (lw->lst[layer] >= want) {
            rc = (int)lw->tokens;
            break;
        }
        if (op->done || lw->stop) {
            rc = lw->stop ? lw->stop : op->result < 0 ? op->result : FERRY_ESTATE;
            break;
        }
        if (timeout_ms == 0 ||
            (timeout_ms > 0 && pthread_cond_timedwait(&op->cv, &op->mu, &dl) == ETIMEDOUT)) {
            rc = -ETIMEDOUT;
            break;
        }
        if (timeout_ms < 0)
            pthread_cond_wait(&op->cv, &op->mu);
    }
    pthread_mutex_unlock(&op->mu);
    /* (a store closing or closed: its copies are done, its events gone) */
    if (rc >= 0 && stream && kv && lw->nheld) {
        int r = ferry_stream_wait_event(stream, lw->ev[layer]);
        if (r < 0)
            return ferry__kv_err(kv, r, "kv %s: the stream's wait for layer %u: %s", what, layer,
                                 ferry_last_error());
    }
    return rc;
}

int ferry_kv_op_wait_layer(ferry_kv_op *op, uint32_t layer, int timeout_ms)
{
    if (!op)
        return ferry__err_set(NULL, -EINVAL, "kv wait_layer: op is NULL");
    int forked = ferry__kv_op_forked(op, "wait_layer");
    if (forked < 0)
        return forked;
    ferry_kv *kv = ferry__kv_op_enter(op);
    int rc = wait_layer(op, kv, layer, NULL, timeout_ms);
    ferry__kv_op_leave(op, kv, 1);
    return rc;
}

int ferry_kv_op_stream_wait_layer(ferry_kv_op *op, uint32_t layer, ferry_stream *stream,
                                  int timeout_ms)
{
    if (!op)
        return ferry__err_set(NULL, -EINVAL, "kv stream_wait_layer: op is NULL");
    int forked = ferry__kv_op_forked(op, "stream_wait_layer");
    if (forked < 0)
        return forked;
    ferry_kv *kv = ferry__kv_op_enter(op);
    int rc = stream ? wait_layer(op, kv, layer, stream, timeout_ms)
                    : ferry__kv_err(kv, -EINVAL, "kv stream_wait_layer: stream is NULL");
    ferry__kv_op_leave(op, kv, 1);
    return rc;
}

/* ---- stores ---- */

/* under op->mu: end a store that is not finishing: drain its copies, then
 * commit (abort 0) or abort every chunk; the op's result */
static void store_end_locked(ferry_kv *kv, ferry_kv_op *op, int abort, int rc)
{
    ferry__kv_lw *lw = op->lw;
    lw->sealed = 1;
    if (lw->s) {
        int r = ferry_stream_sync(lw->s);
        if (r < 0 && !abort) {
            abort = 1;
            rc = ferry__kv_err(kv, r, "kv store_layers: the copies into L1: %s",
                               ferry_last_error());
        }
    }
    kv->be->lw_commit(kv, op, abort);
    if (!abort && op->buf.mem == FERRY_KV_MEM_DEVICE) /* as a retrieve counts its chunks */
        atomic_fetch_add(&kv->device_chunks, lw->nheld);
    if (!abort && lw->nstaged) {
        /* the window is committed (its slots are back): the staged chunks
         * are stored like any store's, waits and all, outside op->mu (the
         * store is sealed: nothing else ends it meanwhile) */
        pthread_mutex_unlock(&op->mu);
        ferry__kv_lw_stage_store(kv, op);
        pthread_mutex_lock(&op->mu);
    }
    if (abort) {
        for (size_t k = 0; k < lw->nheld; k++)
            lw->st[lw->ch[k].i] = rc;
        for (size_t k = 0; k < lw->nstaged; k++)
            lw->st[lw->stage0 + k] = rc;
        ferry__kv_lw_stage_free(kv, lw);
        if (rc == -ECANCELED)
            for (size_t i = 0; i < op->nchunks; i++)
                lw->st[i] = -ECANCELED;
    }
    if (!abort && lead_tokens(kv, op) == 0 && op->nchunks && lw->st[0] < 0 &&
        lw->st[0] != FERRY_ELOCKED) /* another writer's chunks: skipped, as ferry_kv_store */
        rc = lw->st[0];
    else if (!abort)
        rc = (int)lead_tokens(kv, op);
    finish_locked(op, rc);
}

static void store_finish(ferry_kv *kv, ferry__kv_job *j)
{
    ferry_kv_op *op = j->op;
    pthread_mutex_lock(&op->mu);
    if (!op->done) {
        int cancelled = ferry__kv_cancelled(&op->cancel);
        store_end_locked(kv, op, cancelled, cancelled ? -ECANCELED : 0);
    }
    pthread_mutex_unlock(&op->mu);
}

static int store_layers_call(ferry_kv *kv, const int32_t *tokens, size_t n,
                          const ferry_kv_req *req, const ferry_kv_buffer *src,
                          const ferry_kv_layers_opt *opt, ferry_kv_op **out)
{
    ferry_kv_op *op = NULL;
    int r = out ? lw_new(kv, 1, tokens, n, req, src, opt, &op)
                : lw_new(kv, 1, tokens, n, req, src, opt, NULL);
    if (r < 0)
        return r;
    ferry__kv_lw *lw = op->lw;
    atomic_fetch_add(&kv->stores, 1);
    /* the window: half of what a retrieve may hold (layers_stage.c) */
    r = kv->be->lw_reserve(kv, op, FERRY__MAX(kv->be->lw_cap(kv) / 2, 1));
    if (r == 0)
        ferry__kv_lw_stage(kv, op);
    if (r == 0 && op->nchunks && lw->st[0] < 0 && lw->st[0] != FERRY_ELOCKED)
        r = lw->st[0]; /* not even the first chunk: nothing to feed */
    if (r < 0) {
        pthread_mutex_lock(&op->mu);
        store_end_locked(kv, op, 1, r);
        pthread_mutex_unlock(&op->mu);
        ferry_kv_op_free(op);
        return r;
    }
    if (!lw->nheld && !lw->nstaged) { /* every chunk present (or locked by another writer) */
        pthread_mutex_lock(&op->mu);
        store_end_locked(kv, op, 0, 0);
        pthread_mutex_unlock(&op->mu);
    }
    ferry__kv_op_hand(op); /* made: close may abandon it from now on */
    *out = op;
    return 0;
}

int ferry_kv_store_layers(ferry_kv *kv, const int32_t *tokens, size_t n,
                          const ferry_kv_req *req, const ferry_kv_buffer *src,
                          const ferry_kv_layers_opt *opt, ferry_kv_op **out)
{
    FERRY__KV_CALL(kv, "store_layers", store_layers_call(kv, tokens, n, req, src, opt, out));
}

/* under op->mu: copy layer `layer` of src into the slots; 0 or a code */
static int store_copy(ferry_kv *kv, ferry_kv_op *op, uint32_t layer, ferry_stream *stream)
{
    ferry__kv_lw *lw = op->lw;
    int r;
    if (op->buf.mem != FERRY_KV_MEM_DEVICE) {
        if (stream && (r = ferry_stream_sync(stream)) < 0)
            return ferry__kv_err(kv, r, "kv layer_done: the engine's stream: %s",
                                 ferry_last_error());
    } else if (stream) {
        if ((r = ferry_event_record(lw->ev[layer], stream)) < 0 ||
            (r = ferry_stream_wait_event(lw->s, lw->ev[layer])) < 0)
            return ferry__kv_err(kv, r, "kv layer_done: ordering layer %u after the engine's "
                                 "stream: %s", layer, ferry_last_error());
    }
    r = ferry__kv_xfer_layer(&op->buf, kv->chunk_tokens, lw->lc, lw->nheld + lw->nstaged, layer,
                             1, lw->s, NULL);
    if (r < 0)
        return ferry__kv_err(kv, r, "kv layer_done: layer %u: %s", layer, ferry_last_error());
    if (op->buf.mem == FERRY_KV_MEM_DEVICE)
        atomic_fetch_add(&kv->device_calls, (uint64_t)r);
    return 0;
}

static int layer_done(ferry_kv_op *op, ferry_kv *kv, uint32_t layer, ferry_stream *stream)
{
    ferry__kv_lw *lw = op->lw;
    if (!lw || !lw->store)
        return ferry__kv_err(kv, FERRY_ESTATE, "kv layer_done: the op is not a layerwise store");
    if (layer >= lw->nlayers)
        return ferry__kv_err(kv, -EINVAL, "kv layer_done: layer %u of a store of %u layers",
                             layer, lw->nlayers);
    if (!kv) /* close abandons a store still lacking layers */
        return ferry__kv_err(kv, -ECANCELED, "kv layer_done: the store was closed");
    if (stream && ferry_stream_device(stream) != kv->dev)
        return ferry__kv_err(kv, -EINVAL, "kv layer_done: the stream is not on the store's "
                             "device");
    int rc = 0;
    pthread_mutex_lock(&op->mu);
    if (ferry__kv_cancelled(&op->cancel))
        rc = ferry__kv_err(kv, -ECANCELED, "kv layer_done: the store was cancelled");
    else if (lw->lst[layer] != LW_PENDING)
        rc = ferry__kv_err(kv, FERRY_ESTATE, "kv layer_done: layer %u was done already", layer);
    else if (lw->stop)
        rc = lw->stop;
    if (rc < 0) {
        pthread_mutex_unlock(&op->mu);
        return rc;
    }
    lw->lst[layer] = LW_DONE;
    lw->ndone++;
    if (lw->sealed) { /* nothing held: nothing to copy */
        pthread_mutex_unlock(&op->mu);
        return 0;
    }
    rc = store_copy(kv, op, layer, stream);
    if (rc < 0) {
        lw->stop = rc;
        store_end_locked(kv, op, 1, rc);
    } else if (lw->ndone == lw->nlayers) {
        ferry__kv_job *j = ferry__calloc(1, sizeof *j);
        lw->sealed = 1;
        if (j) {
            j->kind = FERRY__KV_JOB_OP;
            j->run = store_finish;
            j->op = op;
            ferry__kv_enqueue(kv, j);
        } else {
            store_end_locked(kv, op, 0, 0); /* (in this thread, then) */
        }
    }
    pthread_mutex_unlock(&op->mu);
    return rc;
}

int ferry_kv_op_layer_done(ferry_kv_op *op, uint32_t layer, ferry_stream *stream)
{
    if (!op)
        return ferry__err_set(NULL, -EINVAL, "kv layer_done: op is NULL");
    int forked = ferry__kv_op_forked(op, "layer_done");
    if (forked < 0)
        return forked;
    ferry_kv *kv = ferry__kv_op_enter(op);
    int rc = layer_done(op, kv, layer, stream);
    ferry__kv_op_leave(op, kv, 1);
    return rc;
}

/* ---- op.c's hooks ---- */

int ferry__kv_lw_wait_check(ferry_kv *kv, ferry_kv_op *op)
{
    ferry__kv_lw *lw = op->lw;
    if (!lw || !lw->store)
        return 0;
    pthread_mutex_lock(&op->mu);
    uint32_t missing = lw->sealed || op->done ? 0 : lw->nlayers - lw->ndone;
    pthread_mutex_unlock(&op->mu);
    if (missing && !kv) /* its store is closing: close abandons it, then it is done */
        return 0;
    if (missing)
        return ferry__kv_err(kv, FERRY_ESTATE,
                             "kv op wait: the layerwise store still lacks %u of %u layers "
                             "(ferry_kv_op_layer_done)",
                             missing, lw->nlayers);
    return 0;
}

void ferry__kv_lw_abandon(ferry_kv *kv, ferry_kv_op *op)
{
    ferry__kv_lw *lw = op->lw;
    if (!lw || !lw->store)
        return;
    pthread_mutex_lock(&op->mu);
    if (!lw->sealed && !op->done)
        store_end_locked(kv, op, 1, -ECANCELED);
    pthread_mutex_unlock(&op->mu);
}

void ferry__kv_lw_detach(ferry_kv *kv, ferry_kv_op *op)
{
    if (!op->lw)
        return;
    pthread_mutex_lock(&op->mu);
    lw_detach_locked(kv, op);
    pthread_mutex_unlock(&op->mu);
}

void ferry__kv_lw_free(ferry_kv_op *op)
{
    lw_destroy(op->lw);
    op->lw = NULL;
}
