/*
 * hints.c - the planner's table of predicted routes (ferry_moe_planner_hint).
 *
 * One record per expert, merged: a hint for a step already hinted keeps
 * the nearest step (when its prediction is checked first and what its
 * value is measured against), the latest (how long it is protected) and
 * the highest confidence. The live records are an indexed min-heap by
 * their nearest step, so each step finds the records it settles in
 * O(log n) each and the table never holds an expired one. The
 * calibration (what share of stated confidence comes true, and how often
 * an evicted expert comes back within a token) is a few decayed sums.
 * Memory: 33 bytes per expert of the model, allocated at the first hint,
 * and 4 per live record.
 */
#include <errno.h>
#include <string.h>

#include "moe/moe_internal.h"

int ferry__hints_init(ferry__hints *h, uint32_t n_ids)
{
    memset(h, 0, sizeof *h);
    h->pos = ferry__malloc((size_t)n_ids * sizeof *h->pos);
    h->near = ferry__calloc(n_ids, sizeof *h->near);
    h->until = ferry__calloc(n_ids, sizeof *h->until);
    h->conf = ferry__calloc(n_ids, sizeof *h->conf);
    h->missing = ferry__calloc(n_ids, sizeof *h->missing);
    h->ev_at = ferry__calloc(n_ids, sizeof *h->ev_at);
    if (!h->pos || !h->near || !h->until || !h->conf || !h->missing || !h->ev_at ||
        ferry__heap_init(&h->heap, 0, h->pos, h->near) < 0) {
        ferry__hints_fini(h);
        return -ENOMEM;
    }
    memset(h->pos, 0xff, (size_t)n_ids * sizeof *h->pos);
    return 0;
}

void ferry__hints_fini(ferry__hints *h)
{
    ferry__heap_fini(&h->heap);
    ferry__free(h->pos);
    ferry__free(h->near);
    ferry__free(h->until);
    ferry__free(h->conf);
    ferry__free(h->missing);
    ferry__free(h->ev_at);
    memset(h, 0, sizeof *h);
}

int ferry__hints_add(ferry__hints *h, uint32_t id, uint64_t target, float c, int missing)
{
    double t = (double)target;
    if (!ferry__hints_live(h, id)) {
        h->until[id] = target;
        h->conf[id] = c;
        h->missing[id] = (uint8_t)(missing != 0);
        return ferry__heap_set(&h->heap, id, t);
    }
    if (target > h->until[id])
        h->until[id] = target;
    if (c > h->conf[id])
        h->conf[id] = c;
    if (t < h->near[id])
        return ferry__heap_set(&h->heap, id, t);
    return 0;
}

uint32_t ferry__hints_due(const ferry__hints *h, uint64_t step)
{
    if (!h->pos)
        return UINT32_MAX;
    uint32_t id = ferry__heap_top(&h->heap);
    return id != UINT32_MAX && h->near[id] <= (double)step ? id : UINT32_MAX;
}

void ferry__hints_next(ferry__hints *h, uint32_t id, uint64_t step)
{
    if (h->until[id] > step)
        (void)ferry__heap_set(&h->heap, id, (double)h->until[id]); /* a member: no growth */
    else
        ferry__heap_remove(&h->heap, id);
}

void ferry__hints_settled(ferry__hints *h, uint32_t id, int right)
{
    int m = h->missing[id];
    h->cal_right[m] += right ? 1.0 : 0.0;
    h->cal_conf[m] += (double)h->conf[id];
    if (h->cal_conf[m] > FERRY__HINT_DECAY) {
        h->cal_right[m] /= 2;
        h->cal_conf[m] /= 2;
    }
}

void ferry__hints_evicted(ferry__hints *h, uint32_t id, uint64_t step)
{
    h->ev_at[id] = step + 1;
    if (++h->ev_n > FERRY__HINT_DECAY) {
        h->ev_n /= 2;
        h->ev_regret /= 2;
    }
}

void ferry__hints_missed(ferry__hints *h, uint32_t id, uint64_t step, uint64_t window)
{
    uint64_t at = h->ev_at[id];
    if (at && step + 1 - at <= window)
        h->ev_regret++;
    h->ev_at[id] = 0;
}
