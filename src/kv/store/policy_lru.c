/*
 * policy_lru.c - least recently used eviction.
 *
 * Invariant: the list runs from the most recently used (head) to the least
 * (tail); a victim is the entry nearest the tail that the store says may go
 * (not locked, not in flight), so a locked chunk is skipped, never evicted,
 * and keeps its place.
 */
#include <errno.h>

#include "kv/kv_impl.h"

#define Q_LRU 1

static int lru_init(ferry__kv_policy *p, uint64_t capacity)
{
    (void)capacity;
    p->state = ferry__calloc(1, sizeof(ferry__kv_list));
    if (!p->state)
        return ferry__err_set(NULL, -ENOMEM, "kv: out of memory for the LRU policy");
    return 0;
}

static void lru_fini(ferry__kv_policy *p)
{
    ferry__free(p->state);
}

static void lru_insert(ferry__kv_policy *p, ferry__kv_entry *e)
{
    ferry__kv_list *l = p->state;
    if (e->node[p->tier].queue)
        ferry__kv_list_unlink(l, p->tier, e);
    ferry__kv_list_push_head(l, p->tier, e);
    e->node[p->tier].queue = Q_LRU;
}

static void lru_touch(ferry__kv_policy *p, ferry__kv_entry *e)
{
    if (e->node[p->tier].queue)
        lru_insert(p, e);
}

static void lru_remove(ferry__kv_policy *p, ferry__kv_entry *e)
{
    if (!e->node[p->tier].queue)
        return;
    ferry__kv_list_unlink(p->state, p->tier, e);
    e->node[p->tier].queue = 0;
}

static ferry__kv_entry *lru_victim(ferry__kv_policy *p, ferry__kv_evictable_fn ok, void *ctx)
{
    ferry__kv_list *l = p->state;
    for (ferry__kv_entry *e = l->tail; e; e = e->node[p->tier].prev) {
        if (ok(e, ctx)) {
            lru_remove(p, e);
            return e;
        }
    }
    return NULL;
}

const ferry__kv_policy_ops ferry__kv_policy_lru = {
    "lru", lru_init, lru_fini, lru_insert, lru_touch, lru_remove, lru_victim,
};
