/*
 * policy_s3fifo.c - S3-FIFO (Yang et al., SOSP'23) over the slot pool.
 *
 * Three FIFO queues: a small one S (10% of the slots) where new experts
 * land, a main one M, and a ghost G of recently evicted expert ids. An
 * expert leaving S that was routed again while there moves to M, else it
 * is evicted into G; an expert inserted while in G goes straight to M. M is
 * a CLOCK: an expert at its head with a nonzero 2-bit counter is moved to
 * its tail with the counter decremented.
 *
 * S and M are intrusive doubly linked lists over slot numbers (O(1) moves);
 * G is a ring of ids with a per-id stamp, so membership is O(1). A pinned
 * expert reaching a queue head is moved to that queue's tail as if it had
 * been routed again (from S it is promoted to M); at most the current
 * step's experts are pinned, so the walk ends. Victim choice is O(1) amortised: every step of the walk either
 * evicts, moves an expert from S to M, or spends one of its counter's units.
 */
#include <errno.h>
#include <string.h>

#include "moe/moe_internal.h"

enum { Q_NONE = 0, Q_S = 1, Q_M = 2 };
#define NIL UINT32_MAX

typedef struct fifo {
    uint32_t head, tail, n;
} fifo;

typedef struct s3 {
    ferry__policy base;
    uint32_t *prev, *next;
    uint8_t *q, *freq;
    fifo s, m;
    uint32_t small_target;
    uint32_t *ghost;       /* ring of ids */
    uint64_t *ghost_seq;   /* per id: sequence number + 1 when entered G, 0 never */
    uint64_t gseq;
    uint32_t gcap;
} s3;

static void s3_fini(ferry__policy *p)
{
    s3 *s = (s3 *)p;
    ferry__free(s->prev);
    ferry__free(s->next);
    ferry__free(s->q);
    ferry__free(s->freq);
    ferry__free(s->ghost);
    ferry__free(s->ghost_seq);
}

static int s3_init(ferry__policy *p)
{
    s3 *s = (s3 *)p;
    uint32_t n = p->env.slots;
    size_t ids = (size_t)p->env.num_layers * p->env.num_experts;
    s->prev = ferry__malloc((size_t)n * sizeof *s->prev);
    s->next = ferry__malloc((size_t)n * sizeof *s->next);
    s->q = ferry__calloc(n, 1);
    s->freq = ferry__calloc(n, 1);
    s->gcap = n;
    s->ghost = ferry__malloc((size_t)s->gcap * sizeof *s->ghost);
    s->ghost_seq = ferry__calloc(ids, sizeof *s->ghost_seq);
    if (!s->prev || !s->next || !s->q || !s->freq || !s->ghost || !s->ghost_seq) {
        s3_fini(p);
        return -ENOMEM;
    }
    s->s.head = s->s.tail = s->m.head = s->m.tail = NIL;
    s->small_target = n / 10 ? n / 10 : 1;
    return 0;
}

static void unlink_slot(s3 *s, fifo *f, uint32_t slot)
{
    uint32_t pv = s->prev[slot], nx = s->next[slot];
    if (pv != NIL)
        s->next[pv] = nx;
    else
        f->head = nx;
    if (nx != NIL)
        s->prev[nx] = pv;
    else
        f->tail = pv;
    f->n--;
}

static void push_tail(s3 *s, fifo *f, uint32_t slot)
{
    s->prev[slot] = f->tail;
    s->next[slot] = NIL;
    if (f->tail != NIL)
        s->next[f->tail] = slot;
    else
        f->head = slot;
    f->tail = slot;
    f->n++;
}

static fifo *queue_of(s3 *s, uint32_t slot)
{
    return s->q[slot] == Q_S ? &s->s : &s->m;
}

static int in_ghost(const s3 *s, uint32_t id)
{
    uint64_t g = s->ghost_seq[id];
    return g && s->gseq - (g - 1) <= s->gcap;
}

static void ghost_add(s3 *s, uint32_t id)
{
    s->ghost[s->gseq % s->gcap] = id;
    s->ghost_seq[id] = s->gseq + 1;
    s->gseq++;
}

static void s3_hit(ferry__policy *p, uint32_t slot, uint32_t id)
{
    s3 *s = (s3 *)p;
    if (s->freq[slot] < 3)
        s->freq[slot]++;
}

static int s3_insert(ferry__policy *p, uint32_t slot, uint32_t id, int prefetch)
{
    s3 *s = (s3 *)p;
    int main_q = in_ghost(s, id);
    if (main_q)
        s->ghost_seq[id] = 0;
    s->q[slot] = main_q ? Q_M : Q_S;
    s->freq[slot] = 0;
    push_tail(s, main_q ? &s->m : &s->s, slot);
    return 0;
}

static void s3_remove(ferry__policy *p, uint32_t slot, uint32_t id, int evicted)
{
    s3 *s = (s3 *)p;
    if (s->q[slot] == Q_NONE)
        return;
    /* only experts that leave S unrouted become ghosts */
    if (evicted && s->q[slot] == Q_S)
        ghost_add(s, id);
    unlink_slot(s, queue_of(s, slot), slot);
    s->q[slot] = Q_NONE;
}

static int s3_victim(ferry__policy *p, uint32_t id, int have_free, uint32_t *slot)
{
    s3 *s = (s3 *)p;
    if (have_free)
        return 1;
    /* bound the walk: each expert can be passed over at most 4 times
     * (3 counter units and one move S -> M) plus once per pinned visit */
    uint64_t budget = 6ull * (s->s.n + s->m.n) + 16;
    /* M's pinned experts passed over in a row: a whole round of them (M
     * holds the step's experts alone) and the victim comes from S, however
     * small S is, rather than nowhere */
    uint32_t pinned_run = 0;
    while (budget--) {
        int from_s = s->s.n && (s->s.n > s->small_target || s->m.n == 0 || pinned_run >= s->m.n);
        fifo *f = from_s ? &s->s : &s->m;
        uint32_t v = f->head;
        if (v == NIL)
            return -1;
        if (from_s) {
            /* a pinned expert at S's head was routed this step: promote */
            if (s->freq[v] > 0 || ferry__pinned(p, v)) {
                unlink_slot(s, f, v);
                s->q[v] = Q_M;
                s->freq[v] = 0;
                push_tail(s, &s->m, v);
                continue;
            }
        } else if (s->freq[v] > 0 || ferry__pinned(p, v)) {
            if (s->freq[v] > 0)
                s->freq[v]--;
            pinned_run = s->freq[v] == 0 && ferry__pinned(p, v) ? pinned_run + 1 : 0;
            unlink_slot(s, f, v);
            push_tail(s, f, v);
            continue;
        }
        *slot = v;
        return 0;
    }
    return -1;
}

const ferry__policy_ops ferry__policy_s3fifo = {
    .name = "s3fifo",
    .describe = "S3-FIFO: small probation FIFO, main CLOCK FIFO and a ghost of evicted ids",
    .state_size = sizeof(s3),
    .init = s3_init,
    .fini = s3_fini,
    .hit = s3_hit,
    .insert = s3_insert,
    .remove = s3_remove,
    .victim = s3_victim,
};
