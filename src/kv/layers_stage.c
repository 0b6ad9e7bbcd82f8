/*
 * layers_stage.c - a layerwise store's chunks past its window in L1.
 *
 * A layerwise store holds what it reserves for the whole prefill, so it
 * reserves only a window of the pool (a quarter of L1; through a server,
 * of the daemon's pool): a longer prompt must not starve every other
 * writer while its layers trickle in. The chunks past the window take
 * their layers into chunk images of the operation's own (host memory of
 * this process, pinned when the engine's buffer is on a device), laid out
 * as the pool's slots are. After the last layer the window is committed
 * first, which gives its slots back, and then the staged images are
 * stored as ferry_kv_store stores: they wait for slots (pool_wait_ms) and
 * stream through the pool in batches that fit, so the store ends with
 * every chunk stored, or each one it could not place reported.
 *
 * The images a store gives back are kept for the next long store (one
 * set, the largest, up to the size of the pool it writes to; freed at
 * close): new memory's first touch, a page fault per 4 KiB, costs several
 * times the copies themselves.
 *
 * The staged images are an ordinary paged buffer to that store (one block
 * per chunk, block_tokens = chunk_tokens, plane p = kv * layers + layer at
 * p * chunk_tokens * token bytes), so nothing of the store's path is
 * duplicated here. Nothing staged is visible before the last layer, as
 * nothing reserved is: an abort just frees the images.
 */
#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <stdlib.h>

#include "kv/backend.h"
#include "kv/kv_impl.h"
#include "kv/kv_layers.h"
#include "kv/store/store_int.h"

/* n bytes of images: the kept ones when they are large enough (their
 * pages faulted in already: a first touch costs more than the copies),
 * else new ones; *dev the device they are pinned with, or NULL */
static unsigned char *stage_take(ferry_kv *kv, size_t n, size_t *got, ferry_device **dev)
{
    unsigned char *p = NULL;
    pthread_mutex_lock(&kv->lw_mu);
    if (kv->lw_idle && kv->lw_idle_bytes >= n) {
        p = kv->lw_idle;
        *got = kv->lw_idle_bytes;
        *dev = kv->lw_idle_dev;
        kv->lw_idle = NULL;
        kv->lw_idle_bytes = 0;
        kv->lw_idle_dev = NULL;
    }
    pthread_mutex_unlock(&kv->lw_mu);
    if (!p && (p = ferry__malloc(n))) {
        *got = n;
        *dev = NULL;
    }
    return p;
}

static void stage_release(unsigned char *p, ferry_device *dev)
{
    if (dev)
        (void)ferry_device_unpin(dev, p);
    ferry__free(p);
}

void ferry__kv_lw_stage(ferry_kv *kv, ferry_kv_op *op)
{
    ferry__kv_lw *lw = op->lw;
    size_t i0 = op->nchunks;
    for (size_t i = 0; i < op->nchunks; i++)
        if (lw->st[i] == FERRY_ENOSPACE) {
            i0 = i;
            break;
        }
    for (size_t k = 0; k < lw->nheld; k++)
        if (lw->ch[k].i >= i0) /* (a backend reserves a leading run) */
            return;
    size_t nst = op->nchunks - i0;
    if (!nst)
        return;
    uint64_t cb = kv->chunk_bytes;
    size_t got = 0;
    ferry_device *pinned = NULL;
    unsigned char *p = cb && nst <= SIZE_MAX / cb ? stage_take(kv, nst * cb, &got, &pinned) : NULL;
    if (!p) { /* the window's chunks go on; these are declined, and why */
        for (size_t i = i0; i < op->nchunks; i++)
            lw->st[i] = -ENOMEM;
        ferry__kv_err(kv, -ENOMEM,
                      "kv store_layers: no memory to stage chunks %zu..%zu past the window "
                      "in L1 (%zu bytes)",
                      i0, op->nchunks - 1, nst * (size_t)cb);
        return;
    }
    lw->stage = p;
    lw->stage_bytes = got;
    lw->stage_dev = pinned;
    lw->stage0 = i0;
    lw->nstaged = nst;
    /* a device buffer's copies into pinned images stay asynchronous; an
     * unpinned image is still copied, synchronously */
    if (op->buf.mem == FERRY_KV_MEM_DEVICE && kv->dev && pinned != kv->dev) {
        if (pinned)
            (void)ferry_device_unpin(pinned, p);
        lw->stage_dev = ferry_device_pin(kv->dev, p, got) == 0 ? kv->dev : NULL;
    }
    for (size_t k = 0; k < nst; k++) {
        ferry__kv_lchunk *l = &lw->lc[lw->nheld + k];
        l->tok0 = (uint64_t)(i0 + k) * kv->chunk_tokens;
        l->ntok = ferry__kv_chunk_ntok(kv, i0 + k, op->n);
        l->img = p + k * cb;
        lw->st[i0 + k] = 0;
    }
}

void ferry__kv_lw_stage_store(ferry_kv *kv, ferry_kv_op *op)
{
    ferry__kv_lw *lw = op->lw;
    size_t nst = lw->nstaged, i0 = lw->stage0;
    if (!nst)
        return;
    const ferry_kv_layout *l = &kv->layout;
    size_t nplanes = (size_t)l->kv * l->num_layers;
    uint64_t span = (uint64_t)kv->chunk_tokens * ferry__kv_token_bytes(l);
    uint64_t *bases = ferry__malloc(nplanes * sizeof *bases);
    int32_t *table = ferry__malloc(nst * sizeof *table);
    int *codes = ferry__malloc(nst * sizeof *codes);
    int rc = 0;
    if (!bases || !table || !codes || nst > INT32_MAX)
        rc = ferry__kv_err(kv, -ENOMEM, "kv store_layers: out of memory storing %zu staged "
                                        "chunks", nst);
    ferry_kv_buffer in = FERRY_KV_BUFFER_INIT, buf;
    size_t n = op->n - i0 * (size_t)kv->chunk_tokens;
    if (rc == 0) {
        for (size_t q = 0; q < nplanes; q++)
            bases[q] = (uintptr_t)lw->stage + q * span;
        for (size_t k = 0; k < nst; k++) {
            table[k] = (int32_t)k;
            codes[k] = INT_MIN; /* (not reported by the store) */
        }
        in.layout = *l;
        in.mem = FERRY_KV_MEM_HOST;
        in.form = FERRY_KV_PAGED;
        in.block_bases = bases;
        in.block_tokens = kv->chunk_tokens;
        in.block_stride = kv->chunk_bytes;
        in.num_blocks = nst;
        in.block_table = table;
        in.table_len = nst;
        rc = ferry__kv_buffer_take(&in, &buf, l, kv->dev, n, "store_layers", NULL);
        if (rc < 0)
            ferry__kv_err_pass(kv, rc);
    }
    if (rc == 0) {
        ferry_kv_req rq = FERRY_KV_REQ_INIT;
        rq.flags = op->req.flags;
        rq.status = codes;
        rq.max_chunks = nst;
        rc = kv->be->store(kv, op->ids + i0, nst, n, &rq, &buf);
    }
    for (size_t k = 0; k < nst; k++)
        lw->st[i0 + k] = !codes || codes[k] == INT_MIN ? (rc < 0 ? rc : FERRY_ENOSPACE) : codes[k];
    ferry__free(bases);
    ferry__free(table);
    ferry__free(codes);
    ferry__kv_lw_stage_free(kv, lw);
}

void ferry__kv_lw_stage_free(ferry_kv *kv, ferry__kv_lw *lw)
{
    if (!lw || !lw->stage)
        return;
    unsigned char *p = lw->stage, *drop = NULL;
    ferry_device *dev = lw->stage_dev, *drop_dev = NULL;
    size_t n = lw->stage_bytes;
    lw->stage = NULL;
    lw->stage_dev = NULL;
    lw->stage_bytes = 0;
    lw->nstaged = 0;
    if (!kv || n > atomic_load(&kv->lw_keep)) {
        stage_release(p, dev);
        return;
    }
    /* kept when larger than what is kept (the smaller one goes) */
    pthread_mutex_lock(&kv->lw_mu);
    if (n > kv->lw_idle_bytes) {
        drop = kv->lw_idle;
        drop_dev = kv->lw_idle_dev;
        kv->lw_idle = p;
        kv->lw_idle_bytes = n;
        kv->lw_idle_dev = dev;
    } else {
        drop = p;
        drop_dev = dev;
    }
    pthread_mutex_unlock(&kv->lw_mu);
    if (drop)
        stage_release(drop, drop_dev);
}

void ferry__kv_lw_stage_drop(ferry_kv *kv)
{
    if (kv->lw_idle)
        stage_release(kv->lw_idle, kv->lw_idle_dev);
    kv->lw_idle = NULL;
    kv->lw_idle_bytes = 0;
    kv->lw_idle_dev = NULL;
}
