/*
 * ss_rows.h - a row of transition's successor counts (policy_transition.c):
 * TR_K lanes of (expert, count) kept by space-saving, counted a visit at a
 * time in SSE2 registers where there are some, a lane at a time where not.
 * Static inline functions for that one file; it defines TR_K, TR_CNT and
 * includes <stdint.h> and <string.h> before this. The registers hold 16
 * lanes: a TR_K other than 16 (a build-time experiment) takes the lane at
 * a time form.
 */
#ifndef FERRY_MOE_SS_ROWS_H
#define FERRY_MOE_SS_ROWS_H

/* ---- a row's successors: space-saving counts ----
 * Row r of layer l keeps TR_K lanes: an expert (top, TR_NOBODY when the
 * lane is unused) and a count (tc, 0 when unused, at least 1 when used).
 * A visit counts its routed experts in the row: first each that has a
 * lane (its lane up by one), then each of the others in order, given the
 * least lane (the first of the least: an unused one while any is left, so
 * the used lanes are a prefix), which goes up by one - the newcomer
 * inherits the count it displaces (Metwally et al.'s space-saving: a
 * lane's count is at most its expert's true count plus that inheritance,
 * and an expert counted more than 1/TR_K of all the row's counts has a
 * lane). A row is halved with its total before the total would pass
 * TR_CNT, its used lanes kept at 1 or more. A visit's counts of one row
 * run in registers: no branch on which lane, no store between two. */
#define TR_NOBODY 0xffffu

#if defined(__SSE2__) && TR_K == 16
#include <emmintrin.h>

_Static_assert(TR_K == 16, "a row is two registers of 8 lanes");

typedef struct trrowv {
    __m128i top[2], tc[2];
} trrowv;

/* a visit's successor as every row compares it: in all 8 lanes */
typedef __m128i trev;

static inline void rowv_events(const uint16_t *le, uint32_t n, trev *ev)
{
    for (uint32_t j = 0; j < n; j++)
        ev[j] = _mm_set1_epi16((short)le[j]);
}

static inline void rowv_load(trrowv *v, const uint16_t *top, const uint16_t *tc)
{
    v->top[0] = _mm_loadu_si128((const __m128i *)(const void *)top);
    v->top[1] = _mm_loadu_si128((const __m128i *)(const void *)(top + 8));
    v->tc[0] = _mm_loadu_si128((const __m128i *)(const void *)tc);
    v->tc[1] = _mm_loadu_si128((const __m128i *)(const void *)(tc + 8));
}

static inline void rowv_store(const trrowv *v, uint16_t *top, uint16_t *tc)
{
    _mm_storeu_si128((__m128i *)(void *)top, v->top[0]);
    _mm_storeu_si128((__m128i *)(void *)(top + 8), v->top[1]);
    _mm_storeu_si128((__m128i *)(void *)tc, v->tc[0]);
    _mm_storeu_si128((__m128i *)(void *)(tc + 8), v->tc[1]);
}

/* halved, used lanes kept at 1 or more */
static inline void rowv_halve(trrowv *v)
{
    __m128i none = _mm_set1_epi16((short)TR_NOBODY), one = _mm_set1_epi16(1);
    for (int h = 0; h < 2; h++) {
        __m128i used1 = _mm_andnot_si128(_mm_cmpeq_epi16(v->top[h], none), one);
        v->tc[h] = _mm_max_epi16(_mm_srli_epi16(v->tc[h], 1), used1);
    }
}

/* the first of the least count's lane (counts <= TR_CNT: signed compares) */
static inline uint32_t rowv_least(const trrowv *v)
{
    __m128i m = _mm_min_epi16(v->tc[0], v->tc[1]);
    m = _mm_min_epi16(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(1, 0, 3, 2)));
    m = _mm_min_epi16(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(2, 3, 0, 1)));
    m = _mm_min_epi16(m, _mm_shufflelo_epi16(m, _MM_SHUFFLE(2, 3, 0, 1)));
    m = _mm_shuffle_epi32(_mm_shufflelo_epi16(m, 0), 0);
    uint32_t k = (uint32_t)_mm_movemask_epi8(_mm_cmpeq_epi16(v->tc[0], m)) |
                 (uint32_t)_mm_movemask_epi8(_mm_cmpeq_epi16(v->tc[1], m)) << 16;
    return (uint32_t)__builtin_ctz(k) / 2;
}

/* lane i's mask: all ones in lane i of the two registers */
#define TR_LM(i) {(i) == 0 ? -1 : 0, (i) == 1 ? -1 : 0, (i) == 2 ? -1 : 0, (i) == 3 ? -1 : 0, \
                  (i) == 4 ? -1 : 0, (i) == 5 ? -1 : 0, (i) == 6 ? -1 : 0, (i) == 7 ? -1 : 0}
static const int16_t rowv_lane_mask[TR_K][2][8] __attribute__((aligned(16))) = {
    {TR_LM(0), TR_LM(8)},  {TR_LM(1), TR_LM(9)},   {TR_LM(2), TR_LM(10)}, {TR_LM(3), TR_LM(11)},
    {TR_LM(4), TR_LM(12)}, {TR_LM(5), TR_LM(13)},  {TR_LM(6), TR_LM(14)}, {TR_LM(7), TR_LM(15)},
    {TR_LM(8), TR_LM(0)},  {TR_LM(9), TR_LM(1)},   {TR_LM(10), TR_LM(2)}, {TR_LM(11), TR_LM(3)},
    {TR_LM(12), TR_LM(4)}, {TR_LM(13), TR_LM(5)},  {TR_LM(14), TR_LM(6)}, {TR_LM(15), TR_LM(7)}};
#undef TR_LM

/* the visit's successors le[0..n) (distinct; evs: rowv_events) that have
 * a lane counted in the row (independent adds); those without listed in
 * miss (their indices in le), their number returned */
static inline uint32_t rowv_count(trrowv *v, const trev *evs, uint32_t n, uint16_t *miss)
{
    __m128i h0 = _mm_setzero_si128(), h1 = _mm_setzero_si128();
    uint32_t nm = 0;
    for (uint32_t j = 0; j < n; j++) {
        __m128i ev = evs[j];
        __m128i eq0 = _mm_cmpeq_epi16(v->top[0], ev), eq1 = _mm_cmpeq_epi16(v->top[1], ev);
        h0 = _mm_or_si128(h0, eq0);
        h1 = _mm_or_si128(h1, eq1);
        miss[nm] = (uint16_t)j;
        nm += _mm_movemask_epi8(_mm_or_si128(eq0, eq1)) == 0;
    }
    /* (+1, saturating: a lane may pass the row's total by inheritances) */
    v->tc[0] = _mm_subs_epi16(v->tc[0], h0);
    v->tc[1] = _mm_subs_epi16(v->tc[1], h1);
    return nm;
}

/* the others (miss[0..nm), after rowv_count, used + nm > TR_K) in
 * order, each taking the least lane */
static inline void rowv_place(trrowv *v, const trev *evs, const uint16_t *miss, uint32_t nm,
                              uint32_t used)
{
    for (uint32_t j = 0; j < nm; j++) {
        /* an unused lane while any is left (the least, at count 0) */
        uint32_t at = used < TR_K ? used++ : rowv_least(v);
        const int16_t(*lm)[8] = rowv_lane_mask[at];
        __m128i ev = evs[miss[j]];
        __m128i n0 = _mm_load_si128((const __m128i *)(const void *)lm[0]);
        __m128i n1 = _mm_load_si128((const __m128i *)(const void *)lm[1]);
        v->tc[0] = _mm_subs_epi16(v->tc[0], n0);
        v->tc[1] = _mm_subs_epi16(v->tc[1], n1);
        v->top[0] = _mm_or_si128(_mm_andnot_si128(n0, v->top[0]), _mm_and_si128(n0, ev));
        v->top[1] = _mm_or_si128(_mm_andnot_si128(n1, v->top[1]), _mm_and_si128(n1, ev));
    }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
/* where the processor has AVX2 (asked at run time: the build assumes
 * SSE2), a row's 16 lanes in one register (row_learn_avx2): half the
 * compares and none of the copies the two-operand forms take */
#define TR_ROWS_AVX2 1
#include <immintrin.h>

#endif

/* term[i] = tc[i] x w, each rounded as (double)tc[i] * w is: the
 * conversions are exact and the products IEEE's, two lanes at a time */
static inline void rowv_terms(const uint16_t *tc, double w, double *term)
{
    __m128d wv = _mm_set1_pd(w);
    __m128i z = _mm_setzero_si128();
    for (int h = 0; h < 2; h++) {
        __m128i c = _mm_loadu_si128((const __m128i *)(const void *)(tc + 8 * h));
        __m128i lo = _mm_unpacklo_epi16(c, z), hi = _mm_unpackhi_epi16(c, z);
        double *t = term + 8 * h;
        _mm_storeu_pd(t, _mm_mul_pd(_mm_cvtepi32_pd(lo), wv));
        _mm_storeu_pd(t + 2, _mm_mul_pd(_mm_cvtepi32_pd(_mm_shuffle_epi32(lo, 0xee)), wv));
        _mm_storeu_pd(t + 4, _mm_mul_pd(_mm_cvtepi32_pd(hi), wv));
        _mm_storeu_pd(t + 6, _mm_mul_pd(_mm_cvtepi32_pd(_mm_shuffle_epi32(hi, 0xee)), wv));
    }
}

/* lanes used: a prefix */
static inline uint32_t rowv_used(const trrowv *v)
{
    __m128i none = _mm_set1_epi16((short)TR_NOBODY);
    uint32_t k = (uint32_t)_mm_movemask_epi8(_mm_cmpeq_epi16(v->top[0], none)) |
                 (uint32_t)_mm_movemask_epi8(_mm_cmpeq_epi16(v->top[1], none)) << 16;
    return k ? (uint32_t)__builtin_ctz(k) / 2 : TR_K;
}
#else
/* the same, a lane at a time */
typedef struct trrowv {
    uint16_t top[TR_K], tc[TR_K];
} trrowv;

typedef uint16_t trev;

static inline void rowv_events(const uint16_t *le, uint32_t n, trev *ev)
{
    memcpy(ev, le, n * sizeof *ev);
}

static inline void rowv_load(trrowv *v, const uint16_t *top, const uint16_t *tc)
{
    memcpy(v->top, top, sizeof v->top);
    memcpy(v->tc, tc, sizeof v->tc);
}

static inline void rowv_store(const trrowv *v, uint16_t *top, uint16_t *tc)
{
    memcpy(top, v->top, sizeof v->top);
    memcpy(tc, v->tc, sizeof v->tc);
}

static inline void rowv_halve(trrowv *v)
{
    for (uint32_t i = 0; i < TR_K; i++) {
        uint16_t h = (uint16_t)(v->tc[i] >> 1);
        v->tc[i] = v->top[i] != TR_NOBODY && h == 0 ? 1 : h;
    }
}

static inline uint32_t rowv_count(trrowv *v, const trev *le, uint32_t n, uint16_t *miss)
{
    uint32_t nm = 0;
    for (uint32_t j = 0; j < n; j++) {
        uint32_t i = 0;
        while (i < TR_K && v->top[i] != le[j])
            i++;
        if (i == TR_K)
            miss[nm++] = (uint16_t)j;
        else
            v->tc[i] = (uint16_t)(v->tc[i] + (v->tc[i] < TR_CNT));
    }
    return nm;
}

static inline void rowv_place(trrowv *v, const trev *le, const uint16_t *miss, uint32_t nm,
                              uint32_t used)
{
    for (uint32_t j = 0; j < nm; j++) {
        uint32_t mi = 0;
        if (used < TR_K)
            mi = used++;
        else
            for (uint32_t i = 1; i < TR_K; i++)
                mi = v->tc[i] < v->tc[mi] ? i : mi;
        v->top[mi] = le[miss[j]];
        v->tc[mi] = (uint16_t)(v->tc[mi] + (v->tc[mi] < TR_CNT));
    }
}

static inline void rowv_terms(const uint16_t *tc, double w, double *term)
{
    for (uint32_t i = 0; i < TR_K; i++)
        term[i] = (double)tc[i] * w;
}

static inline uint32_t rowv_used(const trrowv *v)
{
    uint32_t n = 0;
    while (n < TR_K && v->top[n] != TR_NOBODY)
        n++;
    return n;
}
#endif

/* the visit's successors le[0..n) (distinct; evs: rowv_events) counted in
 * the row at top, its total *an up by one (both halved first when the
 * total is full): first each that has a lane (count), then the others;
 * returns the lanes used after */
static inline __attribute__((always_inline)) uint32_t
row_learn_in(uint16_t *top, uint16_t *an, const trev *evs, const uint16_t *le, uint32_t n,
             uint16_t *miss, uint32_t (*count)(trrowv *, const trev *, uint32_t, uint16_t *))
{
    uint16_t *tc = top + TR_K;
    trrowv v;
    rowv_load(&v, top, tc);
    if (*an == TR_CNT) { /* halve the row with its total: order kept */
        rowv_halve(&v);
        *an >>= 1;
    }
    *an = (uint16_t)(*an + 1);
    uint32_t used = rowv_used(&v), nm = count(&v, evs, n, miss);
    if (used + nm > TR_K) /* not room for all: the others in order */
        rowv_place(&v, evs, miss, nm, used);
    rowv_store(&v, top, tc);
    if (used + nm > TR_K)
        return TR_K;
    for (uint32_t j = 0; j < nm; j++) { /* new successors into unused lanes */
        top[used + j] = le[miss[j]];
        tc[used + j] = 1;
    }
    return used + nm;
}

static __attribute__((noinline)) uint32_t
row_learn_narrow(uint16_t *top, uint16_t *an, const trev *evs, const uint16_t *le, uint32_t n,
                 uint16_t *miss)
{
    return row_learn_in(top, an, evs, le, n, miss, rowv_count);
}

#if defined(TR_ROWS_AVX2)
/* the first of the least count's lane of a row's 16 in one register */
static inline __attribute__((always_inline, target("avx2"))) uint32_t rowv_least_avx2(__m256i c)
{
    __m128i m = _mm_min_epi16(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    m = _mm_min_epi16(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(1, 0, 3, 2)));
    m = _mm_min_epi16(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(2, 3, 0, 1)));
    m = _mm_min_epi16(m, _mm_shufflelo_epi16(m, _MM_SHUFFLE(2, 3, 0, 1)));
    uint32_t k = (uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi16(c, _mm256_broadcastw_epi16(m)));
    return (uint32_t)__builtin_ctz(k) / 2;
}

/* S's lanes (in: all ones in each) up to each lane, itself excluded (its
 * rank in S), and S's size in every lane */
static inline __attribute__((always_inline, target("avx2"))) __m256i
rowv_rank_avx2(__m256i in, __m256i *size)
{
    const __m256i b7 = _mm256_set1_epi16(0x0f0e); /* each half's lane 7, in all its lanes */
    __m256i s1 = _mm256_and_si256(in, _mm256_set1_epi16(1));
    __m256i x = _mm256_add_epi16(s1, _mm256_slli_si256(s1, 2));
    x = _mm256_add_epi16(x, _mm256_slli_si256(x, 4));
    x = _mm256_add_epi16(x, _mm256_slli_si256(x, 8));
    __m256i lo = _mm256_shuffle_epi8(x, b7);
    x = _mm256_add_epi16(x, _mm256_permute2x128_si256(lo, lo, 0x08));
    __m256i hi = _mm256_shuffle_epi8(x, b7);
    *size = _mm256_permute2x128_si256(hi, hi, 0x11);
    return _mm256_sub_epi16(x, s1);
}

/* a row's first placements without a branch: the serial rule (each
 * newcomer the first least lane, which then holds one more) gives, where
 * the least count is u (below TR_CNT - 1: no add saturates), the first
 * newcomers to the lanes at u in lane order, one each, and the next ones to
 * the lanes then at u + 1 (those at u + 1 before, and those at u if all of
 * them took one) in lane order: lane i of a set, of rank r in it, takes
 * newcomer r (the first set) or |first set| + r (the second) where that is
 * below k, its expert from mv (the newcomers' experts, the first 8) by a
 * byte shuffle, its count one more; a lane in both keeps the second.
 * Returns the newcomers placed: the row is as the serial rule leaves it
 * after that many */
static inline __attribute__((always_inline, target("avx2"))) uint32_t
rowv_rounds_avx2(__m256i *tp, __m256i *cp, __m128i mv, uint32_t k)
{
    __m256i t = *tp, c = *cp, mb = _mm256_broadcastsi128_si256(mv);
    __m128i m = _mm_min_epu16(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    uint32_t u = (uint32_t)_mm_cvtsi128_si32(_mm_minpos_epu16(m)) & 0xffffu;
    k = k < 8 ? k : 8; /* (mv holds the first 8) */
    k = u < TR_CNT - 1 ? k : 0;
    __m256i kv = _mm256_set1_epi16((short)k), n1, n2;
    __m256i in1 = _mm256_cmpeq_epi16(c, _mm256_set1_epi16((short)u));
    __m256i in2 = _mm256_or_si256(in1, _mm256_cmpeq_epi16(c, _mm256_set1_epi16((short)(u + 1))));
    __m256i r1 = rowv_rank_avx2(in1, &n1), r2 = _mm256_add_epi16(rowv_rank_avx2(in2, &n2), n1);
    __m256i take1 = _mm256_and_si256(in1, _mm256_cmpgt_epi16(kv, r1));
    __m256i take2 = _mm256_and_si256(in2, _mm256_cmpgt_epi16(kv, r2));
    __m256i s1 = _mm256_or_si256(_mm256_slli_epi16(r1, 1), _mm256_slli_epi16(r1, 9));
    __m256i s2 = _mm256_or_si256(_mm256_slli_epi16(r2, 1), _mm256_slli_epi16(r2, 9));
    __m256i b = _mm256_set1_epi16(0x0100);
    t = _mm256_blendv_epi8(t, _mm256_shuffle_epi8(mb, _mm256_add_epi16(s1, b)), take1);
    t = _mm256_blendv_epi8(t, _mm256_shuffle_epi8(mb, _mm256_add_epi16(s2, b)), take2);
    *tp = t;
    *cp = _mm256_sub_epi16(_mm256_sub_epi16(c, take1), take2);
    uint32_t placed = (uint32_t)_mm256_extract_epi16(_mm256_add_epi16(n1, n2), 0);
    return placed < k ? placed : k;
}

/* row_learn_in with the row's 16 lanes of experts and of counts in one
 * AVX2 register each: the same counts, halving and placing, half the
 * compares; the newcomers (their experts listed in miss, which has room
 * for 8 at least) placed in rounds (rowv_rounds_avx2), the rest, if any,
 * one at a time (rowv_lane_mask[at]'s 32 bytes are lane at's mask over the
 * 16: one blend) */
static inline __attribute__((always_inline, target("avx2"))) uint32_t
row_learn_avx2_in(uint16_t *top, uint16_t *an, const trev *evs, const uint16_t *le, uint32_t n,
                  uint16_t *miss)
{
    uint16_t *tc = top + TR_K;
    __m256i t = _mm256_loadu_si256((const __m256i *)(const void *)top);
    __m256i c = _mm256_loadu_si256((const __m256i *)(const void *)tc);
    __m256i none = _mm256_set1_epi16((short)TR_NOBODY);
    if (*an == TR_CNT) { /* halve the row with its total: order kept */
        __m256i used1 = _mm256_andnot_si256(_mm256_cmpeq_epi16(t, none), _mm256_set1_epi16(1));
        c = _mm256_max_epi16(_mm256_srli_epi16(c, 1), used1);
        *an >>= 1;
    }
    *an = (uint16_t)(*an + 1);
    uint32_t nm = 0;
    __m256i h = _mm256_setzero_si256();
    for (uint32_t j = 0; j < n; j++) { /* each that has a lane: +1 (saturating) */
        __m256i eq = _mm256_cmpeq_epi16(t, _mm256_broadcastsi128_si256(evs[j]));
        h = _mm256_or_si256(h, eq);
        miss[nm] = le[j]; /* (the newcomers' experts) */
        nm += _mm256_movemask_epi8(eq) == 0;
    }
    c = _mm256_subs_epi16(c, h);
    /* the newcomers, in order, each the first least lane (an unused one,
     * at count 0, while any is left) */
    uint32_t j = rowv_rounds_avx2(&t, &c, _mm_loadu_si128((const __m128i *)(const void *)miss), nm);
    if (__builtin_expect(j < nm, 0)) {
        uint32_t k = (uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi16(t, none));
        uint32_t used = k ? (uint32_t)__builtin_ctz(k) / 2 : TR_K;
        for (; j < nm; j++) {
            uint32_t at = used < TR_K ? used++ : rowv_least_avx2(c);
            __m256i lm = _mm256_loadu_si256((const __m256i *)(const void *)rowv_lane_mask[at]);
            c = _mm256_subs_epi16(c, lm);
            t = _mm256_blendv_epi8(t, _mm256_set1_epi16((short)miss[j]), lm);
        }
    }
    _mm256_storeu_si256((__m256i *)(void *)top, t);
    _mm256_storeu_si256((__m256i *)(void *)tc, c);
    uint32_t k = (uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi16(t, none));
    return k ? (uint32_t)__builtin_ctz(k) / 2 : TR_K;
}

static __attribute__((target("avx2"), noinline)) uint32_t
row_learn_avx2(uint16_t *top, uint16_t *an, const trev *evs, const uint16_t *le, uint32_t n,
               uint16_t *miss)
{
    return row_learn_avx2_in(top, an, evs, le, n, miss);
}

/* row_learn_avx2 of the rows prev[0..np) (of lanes, their totals an and
 * lanes used tn): one call a visit */
static __attribute__((unused, target("avx2"), noinline)) void
rows_learn_avx2(uint16_t *lanes, uint16_t *an, uint8_t *tn, const uint16_t *prev, uint32_t np,
                const trev *evs, const uint16_t *le, uint32_t n, uint16_t *miss)
{
    for (uint32_t i = 0; i < np; i++) {
        uint32_t r = prev[i];
        tn[r] = (uint8_t)row_learn_avx2_in(lanes + (size_t)r * TR_ROW, &an[r], evs, le, n, miss);
    }
}
#endif

/* row_learn_in, or its AVX2 form (a row in two registers) where wide;
 * miss is scratch of n + 8 entries at least (the AVX2 form reads 8 as one
 * register), zeroed once so that none is read unwritten */
static inline uint32_t row_learn(uint16_t *top, uint16_t *an, const trev *evs, const uint16_t *le,
                                 uint32_t n, uint16_t *miss, int wide)
{
#if defined(TR_ROWS_AVX2)
    if (wide)
        return row_learn_avx2(top, an, evs, le, n, miss);
#endif
    (void)wide;
    return row_learn_narrow(top, an, evs, le, n, miss);
}

#endif
