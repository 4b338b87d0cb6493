/* Scalar conversions between fp32 and the 16-bit formats tpserve's kernels read and write:
 * bf16 rounded to nearest-even with NaN kept quiet (what torch's .to(bfloat16) does), fp16
 * through the compiler's _Float16. Shared by gemm_tiles.c and attention/attn_simd.h so the
 * matmul and the attention kernel round identically. */
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

#endif
