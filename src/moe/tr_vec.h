/*
 * tr_vec.h - transition's vector kernels (policy_transition.c): the
 * refresh's fold of the cell counts, the sums and bins of a visit's
 * tracked successors, and a layer's least rank of p over its non-empty
 * cells. Each has a form for SSE2 or none and, where the processor has
 * AVX2 (asked at run time: the caller's wide), one for AVX2; every form
 * gives the same result. Static functions for that one file; it defines
 * TR_NC, TR_NCP, TR_NQ, TR_K, TR_ROW and TR_RK_NONE and includes
 * ss_rows.h (rowv_terms, TR_ROWS_AVX2) before this.
 */
#ifndef FERRY_MOE_TR_VEC_H
#define FERRY_MOE_TR_VEC_H

/* ---- the refresh's fold ---- */
/* opps[c] += cc[c] x t over every cell, t > 0: four cells an instruction
 * where the processor has AVX2 (asked at run time, as the rows are) */
#if defined(TR_ROWS_AVX2)
static __attribute__((target("avx2"), noinline)) void fold_cells_avx2(uint64_t *opps,
                                                                       const uint16_t *cc,
                                                                       uint64_t t)
{
    __m256i tv = _mm256_set1_epi64x((long long)t);
    uint32_t c = 0;
    for (; c + 4 <= TR_NC; c += 4) {
        uint64_t four;
        memcpy(&four, cc + c, sizeof four);
        __m256i n = _mm256_cvtepu16_epi64(_mm_cvtsi64_si128((long long)four));
        __m256i *o = (__m256i *)(void *)(opps + c);
        _mm256_storeu_si256(o, _mm256_add_epi64(_mm256_loadu_si256(o), _mm256_mul_epu32(n, tv)));
    }
    for (; c < TR_NC; c++)
        opps[c] += (uint64_t)cc[c] * t;
}

/* every layer's counts held since its last fold (lt below 2^16: cc x lt
 * is one 16 x 16 product; 0: nothing held) into opps, through 32-bit
 * sums: 16 cells an instruction. A refresh comes every TR_REFRESH visits,
 * so the layers' lt sum to at most that and a cell's sum to at most E x
 * TR_REFRESH. The sums sit in each 16 cells' block as the products'
 * halves interleave: cells 0-3, 8-11, 4-7, 12-15. Returns the layers
 * folded, their lt now 0 */
static __attribute__((target("avx2"), noinline)) uint32_t
fold_all_avx2(uint64_t *opps, const uint16_t *cc, uint32_t *lt, uint32_t L)
{
    uint32_t sum[TR_NCP] __attribute__((aligned(32))), folded = 0;
    memset(sum, 0, TR_NCP * sizeof *sum);
    for (uint32_t l = 0; l < L; l++) {
        if (!lt[l] || lt[l] > 0xffffu)
            continue;
        __m256i tv = _mm256_set1_epi16((short)lt[l]);
        const uint16_t *lc = cc + (size_t)l * TR_NCP;
        for (uint32_t w = 0; w < TR_NCP; w += 16) {
            __m256i n = _mm256_loadu_si256((const __m256i *)(const void *)(lc + w));
            __m256i lo = _mm256_mullo_epi16(n, tv), hi = _mm256_mulhi_epu16(n, tv);
            __m256i *a = (__m256i *)(void *)(sum + w);
            a[0] = _mm256_add_epi32(a[0], _mm256_unpacklo_epi16(lo, hi));
            a[1] = _mm256_add_epi32(a[1], _mm256_unpackhi_epi16(lo, hi));
        }
        lt[l] = 0;
        folded++;
    }
    for (uint32_t c = 0; c < TR_NC; c++) {
        uint32_t i = c % 16;
        opps[c] += sum[c - i + ((i & 3) | (i & 8) >> 1 | (i & 4) << 1)];
    }
    return folded;
}
#endif

/* ---- a visit's tracked successors: sums and bins ---- */
/* a row's lane (expert e, term) summed into acc[e]; e listed in cand at
 * its first term, without a branch: acc is all zero between visits (a
 * lane's count is at least 1, and a sum of positive terms is never -0) */
static inline __attribute__((always_inline)) void ts_lane(double *acc, uint16_t *cand,
                                                          size_t *nc, uint32_t e, double term)
{
    double a = acc[e];
    uint64_t bits;
    memcpy(&bits, &a, sizeof bits);
    cand[*nc] = (uint16_t)e;
    *nc += bits == 0;
    acc[e] = a + term;
}

/* the routed set le[0..n)'s rows (lanes and lanes used of its layer),
 * each lane's term (its count x the row's weight wr) summed into acc, the
 * lanes' experts listed in cand at their first term; returns how many */
static inline __attribute__((always_inline)) size_t
ts_rows_in(const uint16_t *lanes, const uint8_t *tn, const uint16_t *le, uint32_t n,
           const double *wr, double *acc, uint16_t *cand, uint64_t *ops,
           void (*terms)(const uint16_t *, double, double *))
{
    size_t nc = 0;
    for (uint32_t j = 0; j < n; j++) {
        uint32_t r = le[j], used = tn[r];
        const uint16_t *top = lanes + (size_t)r * TR_ROW;
        double term[TR_K];
        terms(top + TR_K, wr[j], term);
        if (used == TR_K) { /* (a full row, the steady state: no loop count) */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC unroll 16
#endif
            for (uint32_t i = 0; i < TR_K; i++)
                ts_lane(acc, cand, &nc, top[i], term[i]);
        } else {
            for (uint32_t i = 0; i < used; i++)
                ts_lane(acc, cand, &nc, top[i], term[i]);
        }
        *ops += used;
    }
    return nc;
}

#if defined(TR_ROWS_AVX2)
/* rowv_terms four lanes an instruction: the same products */
static inline __attribute__((always_inline, target("avx2"))) void
rowv_terms_avx2(const uint16_t *tc, double w, double *term)
{
    __m256d wv = _mm256_set1_pd(w);
    for (int h = 0; h < 2; h++) {
        __m256i c = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(const void *)(tc + 8 * h)));
        _mm256_storeu_pd(term + 8 * h, _mm256_mul_pd(_mm256_cvtepi32_pd(_mm256_castsi256_si128(c)), wv));
        _mm256_storeu_pd(term + 8 * h + 4,
                         _mm256_mul_pd(_mm256_cvtepi32_pd(_mm256_extracti128_si256(c, 1)), wv));
    }
}

/* ts_rows_in with a full row's lanes four at a time: their sums loaded
 * into one register, each term added, stored back, and those that were 0
 * listed, in lane order (a row's lanes are distinct experts, so the four
 * are four sums; the adds are the same, in the same order) */
static __attribute__((target("avx2"), noinline)) size_t
ts_rows_avx2(const uint16_t *lanes, const uint8_t *tn, const uint16_t *le, uint32_t n,
             const double *wr, double *acc, uint16_t *cand, uint64_t *ops)
{
    size_t nc = 0;
    __m256d z = _mm256_setzero_pd();
    for (uint32_t j = 0; j < n; j++) {
        uint32_t r = le[j], used = tn[r];
        const uint16_t *top = lanes + (size_t)r * TR_ROW;
        *ops += used;
        if (used != TR_K) { /* (a row not yet full: a lane at a time) */
            double term[TR_K];
            rowv_terms_avx2(top + TR_K, wr[j], term);
            for (uint32_t i = 0; i < used; i++)
                ts_lane(acc, cand, &nc, top[i], term[i]);
            continue;
        }
        __m256d wv = _mm256_set1_pd(wr[j]);
        for (uint32_t g = 0; g < TR_K; g += 4) {
            __m256d term = _mm256_mul_pd(
                _mm256_cvtepi32_pd(_mm_cvtepu16_epi32(
                    _mm_loadl_epi64((const __m128i *)(const void *)(top + TR_K + g)))),
                wv);
            uint32_t e0 = top[g], e1 = top[g + 1], e2 = top[g + 2], e3 = top[g + 3];
            __m256d a = _mm256_set_pd(acc[e3], acc[e2], acc[e1], acc[e0]);
            uint32_t fresh = (uint32_t)_mm256_movemask_pd(_mm256_cmp_pd(a, z, _CMP_EQ_OQ));
            a = _mm256_add_pd(a, term);
            __m128d lo = _mm256_castpd256_pd128(a), hi = _mm256_extractf128_pd(a, 1);
            _mm_storel_pd(acc + e0, lo);
            _mm_storeh_pd(acc + e1, lo);
            _mm_storel_pd(acc + e2, hi);
            _mm_storeh_pd(acc + e3, hi);
            cand[nc] = (uint16_t)e0;
            nc += fresh & 1;
            cand[nc] = (uint16_t)e1;
            nc += fresh >> 1 & 1;
            cand[nc] = (uint16_t)e2;
            nc += fresh >> 2 & 1;
            cand[nc] = (uint16_t)e3;
            nc += fresh >> 3;
        }
    }
    return nc;
}

/* the edges, each in four lanes */
#define TR_E4(x) {x, x, x, x}
static const double tr_edges4[TR_NQ - 1][4] __attribute__((aligned(32))) = {
    TR_E4(0.01), TR_E4(0.02), TR_E4(0.03), TR_E4(0.05), TR_E4(0.07), TR_E4(0.10),
    TR_E4(0.13), TR_E4(0.16), TR_E4(0.20), TR_E4(0.25), TR_E4(0.30), TR_E4(0.35),
    TR_E4(0.40), TR_E4(0.50), TR_E4(0.60), TR_E4(0.70)};
#undef TR_E4

/* tracked_set's bins of cand[0..nc) four at a time: t = (acc + base) x
 * inv as tr_bin's caller rounds it, its bin the count of edges <= t (an
 * ordered compare: not a number is below every edge), acc zeroed, the bin
 * in qv, those above 0 listed in us (*nu of them); returns how many are
 * done (the rest: fewer than four) */
static __attribute__((target("avx2"), noinline)) size_t
bin_avx2(const uint16_t *cand, size_t nc, double *acc, double base, double inv, uint8_t *qv,
         uint16_t *us, uint32_t *nu)
{
    __m256d bv = _mm256_set1_pd(base), iv = _mm256_set1_pd(inv);
    uint32_t u = *nu;
    size_t i = 0;
    for (; i + 4 <= nc; i += 4) {
        uint32_t e0 = cand[i], e1 = cand[i + 1], e2 = cand[i + 2], e3 = cand[i + 3];
        __m256d a = _mm256_set_pd(acc[e3], acc[e2], acc[e1], acc[e0]);
        acc[e0] = acc[e1] = acc[e2] = acc[e3] = 0;
        __m256d t = _mm256_mul_pd(_mm256_add_pd(a, bv), iv);
        __m256i q = _mm256_setzero_si256();
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC unroll 16
#endif
        for (uint32_t k = 0; k < TR_NQ - 1; k++)
            q = _mm256_sub_epi64(q, _mm256_castpd_si256(_mm256_cmp_pd(
                                        t, _mm256_load_pd(tr_edges4[k]), _CMP_GE_OQ)));
        uint64_t qq[4];
        _mm256_storeu_si256((__m256i *)(void *)qq, q);
        qv[e0] = (uint8_t)qq[0];
        qv[e1] = (uint8_t)qq[1];
        qv[e2] = (uint8_t)qq[2];
        qv[e3] = (uint8_t)qq[3];
        us[u] = (uint16_t)e0;
        u += qq[0] != 0;
        us[u] = (uint16_t)e1;
        u += qq[1] != 0;
        us[u] = (uint16_t)e2;
        u += qq[2] != 0;
        us[u] = (uint16_t)e3;
        u += qq[3] != 0;
    }
    *nu = u;
    return i;
}
#endif

/* ---- a layer's least rank ---- */
/* the least rank of p, at or above lo, of the cells of cnt (a layer's
 * counts in o) with one filed, TR_RK_NONE when none; and those cells, in
 * at[w] bit 2i for cell 16w + i. Eight counts a compare (16 with AVX2,
 * where wide): ranks as signed, the empty cells and those below lo at
 * TR_RK_NONE, kept for a second pass against the least */
#define TR_NCW (TR_NCP / 16)
#if defined(TR_ROWS_AVX2)
static __attribute__((target("avx2"), noinline)) uint32_t
least_rank_avx2(const uint16_t *cnt, const uint16_t *rk, uint32_t lo, uint32_t *at)
{
    __m256i z = _mm256_setzero_si256(), none = _mm256_set1_epi16((short)TR_RK_NONE);
    __m256i lov = _mm256_set1_epi16((short)lo), m = none, key[TR_NCW];
    for (uint32_t w = 0; w < TR_NCW; w++) {
        __m256i n = _mm256_loadu_si256((const __m256i *)(const void *)(cnt + 16 * w));
        __m256i r = _mm256_loadu_si256((const __m256i *)(const void *)(rk + 16 * w));
        __m256i out = _mm256_or_si256(_mm256_cmpeq_epi16(n, z), _mm256_cmpgt_epi16(lov, r));
        key[w] = _mm256_blendv_epi8(r, none, out);
        m = _mm256_min_epi16(m, key[w]);
    }
    __m128i h = _mm_min_epi16(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
    h = _mm_min_epi16(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(1, 0, 3, 2)));
    h = _mm_min_epi16(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(2, 3, 0, 1)));
    h = _mm_min_epi16(h, _mm_shufflelo_epi16(h, _MM_SHUFFLE(2, 3, 0, 1)));
    uint32_t r = (uint32_t)_mm_cvtsi128_si32(h) & 0xffffu;
    __m256i rv = _mm256_broadcastw_epi16(h);
    for (uint32_t w = 0; w < TR_NCW; w++)
        at[w] = (uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi16(key[w], rv)) & 0x55555555u;
    return r;
}
#endif

static uint32_t least_rank(const uint16_t *rk, int wide, const uint16_t *cnt, uint32_t lo,
                           uint32_t *at)
{
    (void)wide;
#if defined(TR_ROWS_AVX2)
    if (wide)
        return least_rank_avx2(cnt, rk, lo, at);
#endif
#if defined(__SSE2__)
    __m128i z = _mm_setzero_si128(), none = _mm_set1_epi16((short)TR_RK_NONE);
    __m128i lov = _mm_set1_epi16((short)lo), mn = none, key[2 * TR_NCW];
    for (uint32_t c = 0; c < TR_NCP; c += 8) {
        __m128i n = _mm_loadu_si128((const __m128i *)(const void *)(cnt + c));
        __m128i r = _mm_loadu_si128((const __m128i *)(const void *)(rk + c));
        __m128i out = _mm_or_si128(_mm_cmpeq_epi16(n, z), _mm_cmplt_epi16(r, lov));
        key[c / 8] = _mm_or_si128(_mm_andnot_si128(out, r), _mm_and_si128(out, none));
        mn = _mm_min_epi16(mn, key[c / 8]);
    }
    mn = _mm_min_epi16(mn, _mm_shuffle_epi32(mn, _MM_SHUFFLE(1, 0, 3, 2)));
    mn = _mm_min_epi16(mn, _mm_shuffle_epi32(mn, _MM_SHUFFLE(2, 3, 0, 1)));
    mn = _mm_min_epi16(mn, _mm_shufflelo_epi16(mn, _MM_SHUFFLE(2, 3, 0, 1)));
    uint32_t r = (uint32_t)_mm_cvtsi128_si32(mn) & 0xffffu;
    __m128i rv = _mm_set1_epi16((short)r);
    for (uint32_t w = 0; w < TR_NCW; w++)
        at[w] = ((uint32_t)_mm_movemask_epi8(_mm_cmpeq_epi16(key[2 * w], rv)) |
                 (uint32_t)_mm_movemask_epi8(_mm_cmpeq_epi16(key[2 * w + 1], rv)) << 16) &
                0x55555555u;
    return r;
#else
    uint32_t r = TR_RK_NONE;
    for (uint32_t c = 0; c < TR_NC; c++)
        r = cnt[c] && rk[c] >= lo && rk[c] < r ? rk[c] : r;
    memset(at, 0, TR_NCW * sizeof *at);
    for (uint32_t c = 0; c < TR_NC; c++)
        at[c / 16] |= (uint32_t)(cnt[c] && rk[c] == r) << (2 * (c % 16));
    return r;
#endif
}

#endif
