/*
 * policy.c - the eviction-policy interface: creating a policy by id, and
 * the intrusive list every policy builds on.
 *
 * Invariant: an entry is linked in at most one list per tier (its node's
 * queue says which), and a list's count equals the entries linked in it,
 * so a policy can tell the tier's residents without a second index.
 */
#include <errno.h>

#include "kv/kv_impl.h"

void ferry__kv_list_push_head(ferry__kv_list *l, int tier, ferry__kv_entry *e)
{
    ferry__kv_node *n = &e->node[tier];
    n->prev = NULL;
    n->next = l->head;
    if (l->head)
        l->head->node[tier].prev = e;
    else
        l->tail = e;
    l->head = e;
    l->count++;
}

void ferry__kv_list_unlink(ferry__kv_list *l, int tier, ferry__kv_entry *e)
{
    ferry__kv_node *n = &e->node[tier];
    if (n->prev)
        n->prev->node[tier].next = n->next;
    else
        l->head = n->next;
    if (n->next)
        n->next->node[tier].prev = n->prev;
    else
        l->tail = n->prev;
    n->prev = n->next = NULL;
    FERRY__ASSERT(l->count > 0);
    l->count--;
}

int ferry__kv_policy_create(int policy, int tier, uint64_t capacity, ferry__kv_policy **out)
{
    const ferry__kv_policy_ops *ops;
    switch (policy) {
    case FERRY_KV_EVICT_LRU:
        ops = &ferry__kv_policy_lru;
        break;
    case FERRY_KV_EVICT_S3FIFO:
        ops = &ferry__kv_policy_s3fifo;
        break;
    default:
        return ferry__err_set(NULL, -EINVAL, "kv: unknown eviction policy %d", policy);
    }
    ferry__kv_policy *p = ferry__calloc(1, sizeof *p);
    if (!p)
        return ferry__err_set(NULL, -ENOMEM, "kv: out of memory for the %s policy", ops->name);
    p->ops = ops;
    p->tier = tier;
    p->capacity = capacity;
    int rc = ops->init(p, capacity);
    if (rc < 0) {
        ferry__free(p);
        return rc;
    }
    *out = p;
    return 0;
}

void ferry__kv_policy_destroy(ferry__kv_policy *p)
{
    if (!p)
        return;
    p->ops->fini(p);
    ferry__free(p);
}
