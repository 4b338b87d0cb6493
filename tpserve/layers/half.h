/* Scalar conversions between fp32 and the 16-bit formats tpserve's kernels read and write:
 * bf16 rounded to nearest-even with NaN kept quiet (what torch's .to(bfloat16) does), fp16
 * through the compiler's _Float16; and, with AVX2, bf16 rounding of eight lanes. Shared by
 * gemm_tiles.c, fused.c and attention/attn_simd.h so the matmul, the fused ops and the
 * attention kernel round identically. */
#ifndef TPSERVE_HALF_H
#define TPSERVE_HALF_H
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline float f16_to_f32(uint16_t h) {
    _Float16 v;
    memcpy(&v, &h, sizeof v);
    return (float)v;
}

static inline uint16_t f32_to_f16(float f) {
    _Float16 v = (_Float16)f;
    uint16_t h;
    memcpy(&h, &v, sizeof h);
    return h;
}

#if defined(__AVX2__)
#include <immintrin.h>
/* f32_to_bf16 of eight lanes at once (nearest-even, NaN quiet), each result in the low half of
 * its 32-bit lane: the attention kernel's AVX2 stores and the fused rotary round through it. */
static inline __m256i f32x8_to_bf16_bits(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i top = _mm256_srli_epi32(u, 16);
    const __m256i even = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)),
                         _mm256_and_si256(top, _mm256_set1_epi32(1))), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF)),
                                           _mm256_set1_epi32(0x7F800000));
    return _mm256_blendv_epi8(even, _mm256_or_si256(top, _mm256_set1_epi32(0x40)), nan);
}
#endif

#if defined(__AVX512F__)
#include <immintrin.h>
/* The same for sixteen lanes: gemm.c's stores, the attention kernel's AVX-512 stores and
 * silu_mul.c round through it. Forced inline: gemm.c's store loop is compiled inside
 * cpu_ops.cpp's one large unit, past GCC's growth limit for plain `inline` hints. */
static inline __attribute__((always_inline)) __m512i f32x16_to_bf16_bits(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i top = _mm512_srli_epi32(u, 16);
    const __m512i even = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)),
                         _mm512_and_si512(top, _mm512_set1_epi32(1))), 16);
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)),
                                                  _mm512_set1_epi32(0x7F800000));
    return _mm512_mask_mov_epi32(even, nan, _mm512_or_si512(top, _mm512_set1_epi32(0x40)));
}
#endif

#endif
