/*
 * test_pslab_model.h - a model of what a persistent slab must hold, shared
 * by the crash and power-loss tests (header-only, static functions).
 *
 * Keys are "key-<n>"; a chunk's bytes derive from (key, version) alone, so
 * a checker regenerates what any acknowledged put stored. A script of ops
 * (put new key, overwrite, delete) is generated from a seed and the model
 * state; after a crash the store must equal the state after the acked
 * prefix of the script, or after that prefix plus the one op in flight.
 */
#ifndef TEST_PSLAB_MODEL_H
#define TEST_PSLAB_MODEL_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry.h"

#define PM_MAX_KEYS 4096
#define PM_MAX_LEN 20000

enum { PM_PUT = 1, PM_DEL = 2 };

typedef struct pm_op {
    int type;
    int key;
    int64_t ver; /* put: the version stored */
} pm_op;

typedef struct pm_state {
    int64_t ver[PM_MAX_KEYS]; /* -1: absent */
    int nkeys;                /* keys ever named */
} pm_state;

static uint64_t pm_mix(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
}

static size_t pm_key(int k, char *buf)
{
    return (size_t)sprintf(buf, "key-%d", k);
}

static size_t pm_len(int k, int64_t ver)
{
    return 1 + (size_t)(pm_mix(((uint64_t)k << 32) ^ (uint64_t)ver ^ 0x1234) % PM_MAX_LEN);
}

/* the bytes of (k, ver) into buf (PM_MAX_LEN); returns the length */
static size_t pm_fill(int k, int64_t ver, uint8_t *buf)
{
    size_t n = pm_len(k, ver);
    uint64_t s = pm_mix(((uint64_t)k << 40) ^ (uint64_t)ver ^ 0xabcdef);
    for (size_t i = 0; i < n; i++) {
        if (i % 8 == 0)
            s = pm_mix(s + i);
        buf[i] = (uint8_t)(s >> (8 * (i % 8)));
    }
    return n;
}

static void pm_init(pm_state *st)
{
    for (int i = 0; i < PM_MAX_KEYS; i++)
        st->ver[i] = -1;
    st->nkeys = 0;
}

static void pm_apply(pm_state *st, const pm_op *op)
{
    if (op->type == PM_PUT) {
        st->ver[op->key] = op->ver;
        if (op->key >= st->nkeys)
            st->nkeys = op->key + 1;
    } else {
        st->ver[op->key] = -1;
    }
}

/* a script of n ops starting from st (not modified); versions from *vctr */
static void pm_script(const pm_state *st0, uint64_t seed, pm_op *ops, int n, int64_t *vctr)
{
    pm_state *st = malloc(sizeof *st);
    *st = *st0;
    uint64_t r = seed;
    for (int i = 0; i < n; i++) {
        r = pm_mix(r + 0x9e3779b97f4a7c15ull);
        int kind = (int)(r % 10);
        int present[64], np = 0;
        for (int t = 0; t < 64 && st->nkeys > 0; t++) {
            int k = (int)(pm_mix(r + (uint64_t)t) % (uint64_t)st->nkeys);
            if (st->ver[k] >= 0)
                present[np++] = k;
        }
        if (kind >= 6 && np > 0) {
            int k = present[pm_mix(r ^ 77) % (uint64_t)np];
            ops[i].key = k;
            ops[i].type = kind >= 8 ? PM_DEL : PM_PUT;
        } else if (st->nkeys < PM_MAX_KEYS) {
            ops[i].key = st->nkeys;
            ops[i].type = PM_PUT;
        } else {
            ops[i].key = (int)(r % PM_MAX_KEYS);
            ops[i].type = PM_PUT;
        }
        ops[i].ver = (*vctr)++;
        pm_apply(st, &ops[i]);
    }
    free(st);
}

/* run op on the store; 0 or its code */
static int pm_do(ferry_pslab *p, const pm_op *op, uint8_t *buf)
{
    char key[32];
    size_t kl = pm_key(op->key, key);
    if (op->type == PM_DEL)
        return ferry_pslab_delete(p, key, kl);
    size_t n = pm_fill(op->key, op->ver, buf);
    return ferry_pslab_put(p, key, kl, buf, n);
}

/*
 * Compare the store with candidate states a and b. Returns a bit mask:
 * 1 when the store equals a, 2 when it equals b (0: neither). *wrong gets
 * the number of keys whose bytes matched no version of either (returned
 * data nobody stored), *corrupt the number of FERRY_ECORRUPT answers.
 */
static int pm_match(ferry_pslab *p, const pm_state *a, const pm_state *b, int *wrong,
                    int *corrupt)
{
    uint8_t *got = malloc(PM_MAX_LEN), *want = malloc(PM_MAX_LEN);
    int ok_a = 1, ok_b = 1;
    *wrong = 0;
    *corrupt = 0;
    int nk = a->nkeys > b->nkeys ? a->nkeys : b->nkeys;
    uint64_t present = 0;
    for (int k = 0; k < nk; k++) {
        char key[32];
        size_t kl = pm_key(k, key), len = 0;
        int rc = ferry_pslab_get(p, key, kl, got, PM_MAX_LEN, &len);
        int ma = 0, mb = 0;
        if (rc == FERRY_ENOTFOUND) {
            ma = a->ver[k] < 0;
            mb = b->ver[k] < 0;
        } else if (rc == 0) {
            present++;
            if (a->ver[k] >= 0 && pm_fill(k, a->ver[k], want) == len && !memcmp(want, got, len))
                ma = 1;
            if (b->ver[k] >= 0 && pm_fill(k, b->ver[k], want) == len && !memcmp(want, got, len))
                mb = 1;
            if (!ma && !mb)
                (*wrong)++;
        } else {
            if (rc == FERRY_ECORRUPT)
                (*corrupt)++;
            else
                (*wrong)++;
        }
        ok_a &= ma;
        ok_b &= mb;
    }
    ferry_pslab_stats s = FERRY_PSLAB_STATS_INIT;
    ferry_pslab_stats_get(p, &s);
    if (s.chunks != present) /* a key outside the model */
        ok_a = ok_b = 0, (*wrong)++;
    free(got);
    free(want);
    return (ok_a ? 1 : 0) | (ok_b ? 2 : 0);
}

#endif
