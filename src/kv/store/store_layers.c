/*
 * store_layers.c - the in-process store's side of layerwise operations
 * (backend.h's four steps, kv_layers.h): a retrieve's chunks acquired
 * (promoted into L1, read-locked) and released, a store's slots reserved
 * (invisible until committed) and committed or aborted, through the slot
 * calls of kv_slots.h. At most half of L1 is held by one operation (a
 * store asks for half of that: its window, layers_stage.c).
 */
#include <errno.h>

#include "kv/kv_impl.h"
#include "kv/kv_layers.h"
#include "kv/kv_slots.h"
#include "kv/store/store_int.h"

size_t ferry__kv_lw_local_cap(ferry_kv *kv)
{
    return (size_t)FERRY__MAX(kv->tier[FERRY_KV_TIER_L1]->capacity / 2, 1);
}


int ferry__kv_lw_local_acquire(ferry_kv *kv, ferry_kv_op *op, size_t cap)
{
    ferry__kv_lw *lw = op->lw;
    ferry__kv_tier *l1 = kv->tier[FERRY_KV_TIER_L1];
    ferry__kv_slot_prefetch(kv, op->ids, FERRY__MIN(op->nchunks, cap));
    for (size_t i = 0; i < op->nchunks; i++) {
        if (ferry__kv_cancelled(&op->cancel))
            return -ECANCELED;
        if (i >= cap) {
            lw->st[i] = ferry__kv_err(kv, FERRY_ENOSPACE,
                                      "kv retrieve_layers: chunk %zu is past the %zu one op may "
                                      "hold in L1",
                                      i, cap);
            break;
        }
        ferry__kv_entry *e;
        uint64_t slot, gen;
        uint32_t tokens;
        uint8_t tier;
        int r = ferry__kv_slot_acquire(kv, op->ids[i], &e, &slot, &gen, &tokens, &tier);
        lw->st[i] = r;
        if (r < 0)
            break;
        ferry__kv_set_tier(&op->req, i, tier);
        ferry__kv_lw_hold(kv, op, i, e, slot, gen, l1->ops->host_ptr(l1, slot));
    }
    return 0;
}

void ferry__kv_lw_local_release(ferry_kv *kv, ferry_kv_op *op)
{
    ferry__kv_lw *lw = op->lw;
    for (size_t k = 0; k < lw->nheld; k++) {
        int r = ferry__kv_slot_release(kv, lw->ch[k].e, lw->ch[k].slot, lw->ch[k].gen);
        if (lw->st[lw->ch[k].i] == 0)
            lw->st[lw->ch[k].i] = r;
    }
}

int ferry__kv_lw_local_reserve(ferry_kv *kv, ferry_kv_op *op, size_t cap)
{
    ferry__kv_lw *lw = op->lw;
    ferry__kv_tier *l1 = kv->tier[FERRY_KV_TIER_L1];
    for (size_t i = 0; i < op->nchunks; i++) {
        int r;
        ferry__kv_entry *e = NULL;
        uint64_t slot = 0, gen = 0;
        if (lw->nheld >= cap)
            r = ferry__kv_err(kv, FERRY_ENOSPACE,
                              "kv store_layers: chunk %zu is past the %zu one op may hold in L1",
                              i, cap);
        else
            r = ferry__kv_slot_reserve_wait(kv, op->ids[i], ferry__kv_chunk_ntok(kv, i, op->n),
                                            lw->nheld ? FERRY__KV_TAKE_FREE : kv->pool_wait_ns, &e,
                                            &slot, &gen);
        lw->st[i] = r > 0 ? 0 : r; /* 1: present already */
        if (r == 0)
            ferry__kv_lw_hold(kv, op, i, e, slot, gen, l1->ops->host_ptr(l1, slot));
        else if (r < 0 && r != FERRY_ELOCKED) {
            for (size_t k = i + 1; k < op->nchunks; k++)
                lw->st[k] = r;
            break;
        }
    }
    return 0;
}

void ferry__kv_lw_local_commit(ferry_kv *kv, ferry_kv_op *op, int abort)
{
    ferry__kv_lw *lw = op->lw;
    for (size_t k = 0; k < lw->nheld; k++) {
        int r = ferry__kv_slot_commit(kv, lw->ch[k].e, abort);
        if (!abort)
            lw->st[lw->ch[k].i] = r;
    }
}

