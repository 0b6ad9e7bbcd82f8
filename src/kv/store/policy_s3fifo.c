/*
 * policy_s3fifo.c - S3-FIFO eviction (Yang et al., SOSP 2023).
 *
 * Three queues: a small FIFO S (about 10% of the tier) that new chunks
 * enter, a main FIFO M, and a ghost FIFO G of the ids recently evicted from
 * S. A chunk leaving S that was used while there moves to M; one that was
 * not is evicted and remembered in G; a chunk stored again while its id is
 * in G goes straight to M. M is a CLOCK: a used chunk at its tail is given
 * another round with its counter decremented. One-hit wonders (a prompt
 * seen once) thus leave quickly without pushing out the popular documents.
 *
 * Invariants: an entry is in exactly one of S and M while resident; G holds
 * ids only (no pointers), at most `capacity` of them, findable in O(1)
 * through a small chained hash over ring positions.
 */
#include <errno.h>

#include "kv/kv_impl.h"

#define Q_SMALL 1
#define Q_MAIN 2
#define FREQ_MAX 3

typedef struct ghost {
    uint64_t cap;        /* ring positions */
    uint64_t cursor;     /* next position to overwrite */
    uint64_t nbuckets;   /* power of two */
    int64_t *bucket;     /* head position per bucket, -1 = none */
    int64_t *next;       /* per position */
    ferry_kv_hash *ids;
    uint8_t *valid;
} ghost;

typedef struct s3 {
    ferry__kv_list small, main;
    uint64_t small_target;
    ghost g;
} s3;

static uint64_t bucket_of(const ghost *g, ferry_kv_hash id)
{
    return (id.lo ^ (id.hi * 0x9E3779B97F4A7C15ull)) & (g->nbuckets - 1);
}

static void ghost_unlink(ghost *g, uint64_t pos)
{
    uint64_t b = bucket_of(g, g->ids[pos]);
    int64_t *pp = &g->bucket[b];
    while (*pp >= 0 && (uint64_t)*pp != pos)
        pp = &g->next[*pp];
    if (*pp >= 0)
        *pp = g->next[pos];
    g->valid[pos] = 0;
}

static void ghost_add(ghost *g, ferry_kv_hash id)
{
    uint64_t pos = g->cursor;
    g->cursor = (g->cursor + 1) % g->cap;
    if (g->valid[pos])
        ghost_unlink(g, pos);
    g->ids[pos] = id;
    g->valid[pos] = 1;
    uint64_t b = bucket_of(g, id);
    g->next[pos] = g->bucket[b];
    g->bucket[b] = (int64_t)pos;
}

/* remove id from the ghost if it is there; 1 when it was */
static int ghost_take(ghost *g, ferry_kv_hash id)
{
    for (int64_t p = g->bucket[bucket_of(g, id)]; p >= 0; p = g->next[p]) {
        if (g->ids[p].lo == id.lo && g->ids[p].hi == id.hi) {
            ghost_unlink(g, (uint64_t)p);
            return 1;
        }
    }
    return 0;
}

static void s3_fini(ferry__kv_policy *p)
{
    s3 *s = p->state;
    if (!s)
        return;
    ferry__free(s->g.bucket);
    ferry__free(s->g.next);
    ferry__free(s->g.ids);
    ferry__free(s->g.valid);
    ferry__free(s);
    p->state = NULL;
}

static int s3_init(ferry__kv_policy *p, uint64_t capacity)
{
    s3 *s = ferry__calloc(1, sizeof *s);
    if (!s)
        return ferry__err_set(NULL, -ENOMEM, "kv: out of memory for the S3-FIFO policy");
    p->state = s;
    s->small_target = capacity / 10 ? capacity / 10 : 1;
    ghost *g = &s->g;
    g->cap = capacity ? capacity : 1;
    g->nbuckets = 1;
    while (g->nbuckets < 2 * g->cap)
        g->nbuckets <<= 1;
    g->bucket = ferry__malloc(g->nbuckets * sizeof *g->bucket);
    g->next = ferry__malloc(g->cap * sizeof *g->next);
    g->ids = ferry__malloc(g->cap * sizeof *g->ids);
    g->valid = ferry__calloc(g->cap, 1);
    if (!g->bucket || !g->next || !g->ids || !g->valid) {
        s3_fini(p);
        return ferry__err_set(NULL, -ENOMEM, "kv: out of memory for the S3-FIFO ghost of %llu",
                              (unsigned long long)g->cap);
    }
    for (uint64_t i = 0; i < g->nbuckets; i++)
        g->bucket[i] = -1;
    return 0;
}

static void s3_remove(ferry__kv_policy *p, ferry__kv_entry *e)
{
    s3 *s = p->state;
    ferry__kv_node *n = &e->node[p->tier];
    if (n->queue == Q_SMALL)
        ferry__kv_list_unlink(&s->small, p->tier, e);
    else if (n->queue == Q_MAIN)
        ferry__kv_list_unlink(&s->main, p->tier, e);
    n->queue = 0;
}

static void s3_insert(ferry__kv_policy *p, ferry__kv_entry *e)
{
    s3 *s = p->state;
    ferry__kv_node *n = &e->node[p->tier];
    if (n->queue)
        s3_remove(p, e);
    n->freq = 0;
    if (ghost_take(&s->g, e->id)) {
        ferry__kv_list_push_head(&s->main, p->tier, e);
        n->queue = Q_MAIN;
    } else {
        ferry__kv_list_push_head(&s->small, p->tier, e);
        n->queue = Q_SMALL;
    }
}

static void s3_touch(ferry__kv_policy *p, ferry__kv_entry *e)
{
    ferry__kv_node *n = &e->node[p->tier];
    if (n->queue && n->freq < FREQ_MAX)
        n->freq++;
}

static ferry__kv_entry *s3_victim(ferry__kv_policy *p, ferry__kv_evictable_fn ok, void *ctx)
{
    s3 *s = p->state;
    int t = p->tier;
    /* every resident entry can be looked at a bounded number of times: moves
     * from S to M happen once per entry, M's counters only go down */
    uint64_t budget = 2 * (s->small.count + s->main.count) * (FREQ_MAX + 2) + 4;
    uint64_t small_skips = 0, main_skips = 0;
    while (budget--) {
        int from_small = s->small.count && (s->small.count > s->small_target ||
                                            !s->main.count || main_skips >= s->main.count);
        if (from_small && small_skips >= s->small.count)
            from_small = 0;
        if (!from_small && (!s->main.count || main_skips >= s->main.count))
            return NULL;
        if (from_small) {
            ferry__kv_entry *e = s->small.tail;
            ferry__kv_node *n = &e->node[t];
            ferry__kv_list_unlink(&s->small, t, e);
            if (n->freq > 0) {
                n->freq = 0;
                ferry__kv_list_push_head(&s->main, t, e);
                n->queue = Q_MAIN;
                continue;
            }
            if (!ok(e, ctx)) {
                ferry__kv_list_push_head(&s->small, t, e);
                small_skips++;
                continue;
            }
            n->queue = 0;
            ghost_add(&s->g, e->id);
            return e;
        }
        ferry__kv_entry *e = s->main.tail;
        ferry__kv_node *n = &e->node[t];
        ferry__kv_list_unlink(&s->main, t, e);
        if (n->freq > 0) {
            n->freq--;
            ferry__kv_list_push_head(&s->main, t, e);
            continue;
        }
        if (!ok(e, ctx)) {
            ferry__kv_list_push_head(&s->main, t, e);
            main_skips++;
            continue;
        }
        n->queue = 0;
        return e;
    }
    return NULL;
}

const ferry__kv_policy_ops ferry__kv_policy_s3fifo = {
    "s3fifo", s3_init, s3_fini, s3_insert, s3_touch, s3_remove, s3_victim,
};
