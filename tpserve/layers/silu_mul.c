/* silu(gate) * up over bf16 rows [gate | up], the same bits as ATen's `at::silu(gate).mul_(up)`
 * in one pass and without two TensorIterator set-ups.
 *
 * Why: at batch 1 those two ATen calls cost ~4 us a layer of dispatch, allocation and iterator
 * set-up for well under a microsecond of arithmetic (~8% of a plain decode step of the demo
 * pair at TP = 2, whose layers are tiny). A fused loop with the C library's scalar expf was
 * slower than ATen's vectorised exp; this one calls the very vectorised exp ATen calls
 * (Sleef's, exported by libtorch_cpu), so it is fast and rounds identically.
 *
 * ATen's bf16 silu, per row (the gate is a strided view: rows do not merge), in its own order:
 *   - blocks of 2 x Vectorized<BFloat16>::size() elements (4 x LANES): widened to fp32,
 *     x / (1 + exp(-x)) with Sleef_expf{16,8}_u10, rounded to bf16 nearest-even;
 *   - the rest one at a time: float(x) / (1.0f + std::exp(-float(x))) (the C library's expf);
 * then the product rounds float(silu) * float(up) to bf16 nearest-even. Only when ATen itself
 * would run that loop on one thread (fewer than its 32768-element grain, or one intra-op
 * thread: a split elsewhere moves the tails) and with the same vector width (its runtime CPU
 * capability, ATEN_CPU_CAPABILITY included), which cpu_ops.cpp checks before calling here.
 */
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif
#include <math.h>
#include <stdint.h>

#include "half.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define SILU_LANES 16
#ifdef __cplusplus
extern "C" {
#endif
__m512 Sleef_expf16_u10(__m512);
#ifdef __cplusplus
}
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SILU_LANES 8
#ifdef __cplusplus
extern "C" {
#endif
__m256 Sleef_expf8_u10(__m256);
#ifdef __cplusplus
}
#endif
#else
#define SILU_LANES 0
#endif

/* fp32 lanes per vector of this build: 16 (AVX-512), 8 (AVX2) or 0 (no native silu_mul). The
 * tests also build this file alone (ctypes, linked to libtorch_cpu for Sleef). */
int32_t silu_mul_lanes(void) { return SILU_LANES; }

static inline uint16_t silu_scalar_bf16(uint16_t g) {
    const float x = bf16_to_f32(g);
    return f32_to_bf16(x / (1.0f + expf(-x)));
}

#if SILU_LANES == 16
/* LANES bf16 values widened to fp32 (exact). */
static inline __m512 bf16_widen(const uint16_t *p) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* LANES silu values, rounded to bf16 as ATen's vector path rounds them, back in fp32 lanes. */
static inline __m512 silu_vec(const uint16_t *g) {
    const __m512 x = bf16_widen(g);
    const __m512 neg = _mm512_castsi512_ps(
        _mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000u)));
    const __m512 s = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), Sleef_expf16_u10(neg)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(f32x16_to_bf16_bits(s), 16));
}

static inline void silu_mul_block(const uint16_t *g, const uint16_t *u, uint16_t *o) {
    const __m512i p = f32x16_to_bf16_bits(_mm512_mul_ps(silu_vec(g), bf16_widen(u)));
    _mm256_storeu_si256((__m256i *)o, _mm512_cvtepi32_epi16(p));
}
#elif SILU_LANES == 8
/* LANES bf16 values widened to fp32 (exact). */
static inline __m256 bf16_widen(const uint16_t *p) {
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* LANES silu values, rounded to bf16 as ATen's vector path rounds them, back in fp32 lanes. */
static inline __m256 silu_vec(const uint16_t *g) {
    const __m256 x = bf16_widen(g);
    const __m256 neg = _mm256_xor_ps(x, _mm256_set1_ps(-0.0f));
    const __m256 s = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), Sleef_expf8_u10(neg)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(f32x8_to_bf16_bits(s), 16));
}

static inline void silu_mul_block(const uint16_t *g, const uint16_t *u, uint16_t *o) {
    /* f32x8_to_bf16_bits leaves each result in the low half of its lane */
    const __m256i p = f32x8_to_bf16_bits(_mm256_mul_ps(silu_vec(g), bf16_widen(u)));
    _mm_storeu_si128((__m128i *)o, _mm_packus_epi32(_mm256_castsi256_si128(p),
                                                    _mm256_extracti128_si256(p, 1)));
}
#endif

/* out[r, :inter] = silu(x[r, :inter]) * x[r, inter:2 inter] for `rows` contiguous rows of
 * 2 * inter bf16 values; out is [rows, inter]. */
void silu_mul_bf16(const uint16_t *x, int64_t rows, int64_t inter, uint16_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = x + r * 2 * inter, *u = g + inter;
        uint16_t *o = out + r * inter;
        int64_t i = 0;
#if SILU_LANES
        for (; i + 4 * SILU_LANES <= inter; i += 4 * SILU_LANES)
            for (int b = 0; b < 4; b++)
                silu_mul_block(g + i + b * SILU_LANES, u + i + b * SILU_LANES,
                               o + i + b * SILU_LANES);
#endif
        for (; i < inter; i++)
            o[i] = f32_to_bf16(bf16_to_f32(silu_scalar_bf16(g[i])) * bf16_to_f32(u[i]));
    }
}
