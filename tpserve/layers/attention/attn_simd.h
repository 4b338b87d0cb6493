/* The vector layer of paged_attention.c: element conversions, one fp32 vector type per ISA
 * (AVX-512: 16 lanes, AVX2 + F16C + FMA: 8 lanes, else LANES 0) and the few operations the
 * kernel needs, so the kernel itself is written once. Chosen at compile time (-march=native on
 * the machine that runs it; the tests also build -mno-avx512f for the AVX2 path). */
#ifndef TPSERVE_ATTN_SIMD_H
#define TPSERVE_ATTN_SIMD_H
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__F16C__) && defined(__FMA__))
#include <immintrin.h>
#endif

enum { ATTN_F32 = 0, ATTN_BF16 = 1, ATTN_F16 = 2 };

#include "../half.h"

static inline float load_elem(const void *base, int32_t dtype, int64_t i) {
    if (dtype == ATTN_F32) return ((const float *)base)[i];
    uint16_t h = ((const uint16_t *)base)[i];
    return dtype == ATTN_BF16 ? bf16_to_f32(h) : f16_to_f32(h);
}

static inline void store_elem(void *base, int32_t dtype, int64_t i, float x) {
    if (dtype == ATTN_F32) {
        ((float *)base)[i] = x;
    } else if (dtype == ATTN_BF16) {
        ((uint16_t *)base)[i] = f32_to_bf16(x);
    } else {
        ((uint16_t *)base)[i] = f32_to_f16(x);
    }
}

static inline int64_t elem_size(int32_t dtype) { return dtype == ATTN_F32 ? 4 : 2; }

#if defined(__AVX512F__)
#define LANES 16
typedef __m512 vf;
static inline vf v_zero(void) { return _mm512_setzero_ps(); }
static inline vf v_set1(float x) { return _mm512_set1_ps(x); }
static inline vf v_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void v_store(float *p, vf x) { _mm512_storeu_ps(p, x); }
static inline vf v_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf v_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf v_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf v_max(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf v_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf v_fnma(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }
static inline vf v_round(vf x) {
    return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
static inline vf v_ldexp(vf y, vf n) { return _mm512_scalef_ps(y, n); }
static inline float v_hmax(vf x) { return _mm512_reduce_max_ps(x); }
static inline float v_hsum(vf x) { return _mm512_reduce_add_ps(x); }
/* lanes whose bit is clear take `fill` */
static inline vf v_select(uint32_t bits, vf x, vf fill) {
    return _mm512_mask_blend_ps((__mmask16)bits, fill, x);
}
/* bit i set where lane i of x is above `limit` (NaN lanes clear) */
static inline uint32_t v_above(vf x, float limit) {
    return (uint32_t)_mm512_cmp_ps_mask(x, _mm512_set1_ps(limit), _CMP_GT_OQ);
}
static inline void load_pair(const void *src, int dtype, vf *lo, vf *hi) {
    if (dtype == ATTN_BF16) {
        __m512i w = _mm512_loadu_si512(src);
        *lo = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
        *hi = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32((int)0xFFFF0000u)));
    } else if (dtype == ATTN_F16) {
        const __m256i *p = (const __m256i *)src;
        *lo = _mm512_cvtph_ps(_mm256_loadu_si256(p));
        *hi = _mm512_cvtph_ps(_mm256_loadu_si256(p + 1));
    } else {
        *lo = _mm512_loadu_ps((const float *)src);
        *hi = _mm512_loadu_ps((const float *)src + LANES);
    }
}
/* f32 -> bf16 bits (in the low half of each 32-bit lane), nearest-even, NaN kept quiet. */
static inline __m512i round_bf16(vf x) { return f32x16_to_bf16_bits(x); }
/* The inverse of load_pair: two vectors in the kernel's lane order -> 2*LANES elements. */
static inline void store_pair(void *dst, int dtype, vf lo, vf hi) {
    if (dtype == ATTN_BF16) {
        _mm512_storeu_si512(dst, _mm512_or_si512(round_bf16(lo), _mm512_slli_epi32(round_bf16(hi), 16)));
    } else if (dtype == ATTN_F16) {
        __m256i *p = (__m256i *)dst;
        _mm256_storeu_si256(p, _mm512_cvtps_ph(lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        _mm256_storeu_si256(p + 1, _mm512_cvtps_ph(hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    } else {
        _mm512_storeu_ps((float *)dst, lo);
        _mm512_storeu_ps((float *)dst + LANES, hi);
    }
}
/* Lane i of the result = sum of the lanes of v[i]: pairs, then quads inside each 128-bit
 * block (unpack), then across the four blocks (shuffle_f32x4). */
static inline vf v_transpose_sum(const vf *v) {
    __m512 t[8], u[4];
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    __m512 w01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88),
                               _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
    __m512 w23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88),
                               _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, 0x88), _mm512_shuffle_f32x4(w01, w23, 0xDD));
}
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define LANES 8
typedef __m256 vf;
static inline vf v_zero(void) { return _mm256_setzero_ps(); }
static inline vf v_set1(float x) { return _mm256_set1_ps(x); }
static inline vf v_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void v_store(float *p, vf x) { _mm256_storeu_ps(p, x); }
static inline vf v_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf v_sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf v_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf v_max(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf v_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf v_fnma(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
static inline vf v_round(vf x) {
    return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
/* y * 2^n through the exponent field: v_exp keeps n in [-126, 0] and y in [0.7, 1.5). */
static inline vf v_ldexp(vf y, vf n) {
    __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
    return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(y), e));
}
static inline float v_hmax(vf x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
static inline float v_hsum(vf x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline vf v_select(uint32_t bits, vf x, vf fill) {
    const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    __m256i on = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)bits), lane_bit), lane_bit);
    return _mm256_blendv_ps(fill, x, _mm256_castsi256_ps(on));
}
static inline uint32_t v_above(vf x, float limit) {
    return (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(x, _mm256_set1_ps(limit), _CMP_GT_OQ));
}
static inline void load_pair(const void *src, int dtype, vf *lo, vf *hi) {
    if (dtype == ATTN_BF16) {
        __m256i w = _mm256_loadu_si256((const __m256i *)src);
        *lo = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
        *hi = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32((int)0xFFFF0000u)));
    } else if (dtype == ATTN_F16) {
        const __m128i *p = (const __m128i *)src;
        *lo = _mm256_cvtph_ps(_mm_loadu_si128(p));
        *hi = _mm256_cvtph_ps(_mm_loadu_si128(p + 1));
    } else {
        *lo = _mm256_loadu_ps((const float *)src);
        *hi = _mm256_loadu_ps((const float *)src + LANES);
    }
}
static inline __m256i round_bf16(vf x) { return f32x8_to_bf16_bits(x); }
static inline void store_pair(void *dst, int dtype, vf lo, vf hi) {
    if (dtype == ATTN_BF16) {
        _mm256_storeu_si256((__m256i *)dst, _mm256_or_si256(round_bf16(lo), _mm256_slli_epi32(round_bf16(hi), 16)));
    } else if (dtype == ATTN_F16) {
        __m128i *p = (__m128i *)dst;
        _mm_storeu_si128(p, _mm256_cvtps_ph(lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        _mm_storeu_si128(p + 1, _mm256_cvtps_ph(hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    } else {
        _mm256_storeu_ps((float *)dst, lo);
        _mm256_storeu_ps((float *)dst + LANES, hi);
    }
}
static inline vf v_transpose_sum(const vf *v) {
    __m256 t[4], u[2];
    for (int i = 0; i < 4; i++)
        t[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 2; i++) {
        __m256d a = _mm256_castps_pd(t[2 * i]), b = _mm256_castps_pd(t[2 * i + 1]);
        u[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)),
                             _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
    }
    return _mm256_add_ps(_mm256_permute2f128_ps(u[0], u[1], 0x20),
                         _mm256_permute2f128_ps(u[0], u[1], 0x31));
}
#else
#define LANES 0
#endif

#if LANES
#ifndef ATTN_PREFETCH_HINT
#define ATTN_PREFETCH_HINT _MM_HINT_T1 /* into L2: 10.1 GB/s of KV vs 5.0 into L1 (16K keys) */
#endif
/* always_inline (here and on the callers that only prefetch): GCC 12 otherwise treats a void
 * function whose only effect is a prefetch as pure and deleted every call. */
static inline __attribute__((always_inline)) void prefetch(const void *p) {
    _mm_prefetch((const char *)p, ATTN_PREFETCH_HINT);
}

/* e^x for x <= 0 (lanes below -87 give ~1e-38, not 0: callers zero hidden lanes). Range
 * reduction x = n ln2 + r, |r| <= ln2 / 2, then a degree-7 Taylor polynomial: relative error
 * ~1e-8 before the final rounding. */
static inline vf v_exp(vf x) {
    x = v_max(x, v_set1(-87.0f));
    vf n = v_round(v_mul(x, v_set1(1.44269504088896341f)));
    vf r = v_fnma(n, v_set1(0.693359375f), x);
    r = v_fnma(n, v_set1(-2.12194440e-4f), r);
    vf y = v_set1(1.0f / 5040);
    y = v_fma(y, r, v_set1(1.0f / 720));
    y = v_fma(y, r, v_set1(1.0f / 120));
    y = v_fma(y, r, v_set1(1.0f / 24));
    y = v_fma(y, r, v_set1(1.0f / 6));
    y = v_fma(y, r, v_set1(0.5f));
    y = v_fma(y, r, v_set1(1.0f));
    y = v_fma(y, r, v_set1(1.0f));
    return v_ldexp(y, n);
}

#endif
#endif
