/* The small per-token steps of a decoder layer, one pass each instead of 5-15 ATen ops:
 * RMSNorm (optionally after the residual add) and NeoX rotary on the q/k part of the fused qkv
 * projection. At batch 1 each of those ATen ops costs 2-8 us of dispatch for well under a
 * microsecond of arithmetic, and a layer had ~60 of them. (SiLU * up is silu_mul.c, which calls
 * the vectorised exp ATen does: a scalar expf here was slower than ATen.)
 *
 * Each kernel rounds exactly where the unfused torch expression does, so outputs are the same
 * bits (tests/test_fused_ops.py checks that against the torch expressions):
 *   rms_norm:  y = w * to16(x * (1 / sqrt(mean(x^2) + eps)))   mean in fp64 as mean_square
 *   add:       s = to16(x + d) first (a 16-bit residual add rounds once)
 *   rotary:    y = to16(to16(x * cos) + to16(rotate_half(x) * sin))   cos/sin already 16-bit
 * where to16 rounds to the tensors' dtype (nothing for fp32). No fused multiply-adds: torch
 * rounds every product on its own, and a contracted a * b + c would not.
 *
 * Rows are independent; large inputs are split into row chunks on gemm.c's pool (this file is
 * included after gemm.c by cpu_ops.cpp).
 */
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif
#include <math.h>
#include <stdint.h>

#include "half.h"

enum { FUSED_F32 = 0, FUSED_BF16 = 1, FUSED_F16 = 2 };

/* Rows per pool chunk, and the fewest rows worth handing to the pool at all. */
#define FUSED_CHUNK_ROWS 32

static inline __attribute__((always_inline)) float fused_load(const void *p, int64_t i, int dt) {
    if (dt == FUSED_BF16) return bf16_to_f32(((const uint16_t *)p)[i]);
    if (dt == FUSED_F16) return f16_to_f32(((const uint16_t *)p)[i]);
    return ((const float *)p)[i];
}

static inline __attribute__((always_inline)) void fused_store(void *p, int64_t i, float v,
                                                              int dt) {
    if (dt == FUSED_BF16) ((uint16_t *)p)[i] = f32_to_bf16(v);
    else if (dt == FUSED_F16) ((uint16_t *)p)[i] = f32_to_f16(v);
    else ((float *)p)[i] = v;
}

/* v as the dtype holds it. */
static inline __attribute__((always_inline)) float fused_round(float v, int dt) {
    if (dt == FUSED_BF16) return bf16_to_f32(f32_to_bf16(v));
    if (dt == FUSED_F16) return f16_to_f32(f32_to_f16(v));
    return v;
}

/* mean(x^2) of one fp32 row (also tpserve::mean_square's per-row sum, cpu_ops.cpp): 8 fp64
 * partials over elements j, j + 8, ..., folded pairwise (0+4, 1+5, ... then 0+2, 1+3, then
 * 0+1), then the leftovers, one rounding at the end. */
static inline float fused_mean_square(const float *x, int64_t n) {
    double part[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) part[j] += (double)x[i + j] * (double)x[i + j];
    for (int width = 4; width > 0; width /= 2)
        for (int j = 0; j < width; j++) part[j] += part[j + width];
    double sum = part[0];
    for (; i < n; i++) sum += (double)x[i] * (double)x[i];
    return (float)(sum / (double)n);
}

typedef struct {
    const void *x, *delta, *weight; /* delta: NULL for a plain norm */
    void *sum, *out;                /* sum: where x + delta goes (NULL for a plain norm) */
    int64_t rows, cols, ldx, ldd;
    float eps;
    int dt;
    float *scratch; /* rows of `cols` floats, one per chunk */
} norm_job;

static inline __attribute__((always_inline)) void norm_rows(const norm_job *j, int64_t r0,
                                                            int64_t r1, float *row, int dt) {
    const int64_t n = j->cols;
    for (int64_t r = r0; r < r1; r++) {
        for (int64_t i = 0; i < n; i++) row[i] = fused_load(j->x, r * j->ldx + i, dt);
        if (j->delta) {
            for (int64_t i = 0; i < n; i++) {
                row[i] = fused_round(row[i] + fused_load(j->delta, r * j->ldd + i, dt), dt);
                fused_store(j->sum, r * n + i, row[i], dt);
            }
        }
        const float inv = 1.0f / sqrtf(fused_mean_square(row, n) + j->eps);
        for (int64_t i = 0; i < n; i++) {
            const float y = fused_round(row[i] * inv, dt) * fused_load(j->weight, i, dt);
            fused_store(j->out, r * n + i, y, dt);
        }
    }
}

static void norm_chunk(void *ctx, int64_t c) {
    const norm_job *j = (const norm_job *)ctx;
    const int64_t r0 = c * FUSED_CHUNK_ROWS;
    const int64_t r1 = r0 + FUSED_CHUNK_ROWS < j->rows ? r0 + FUSED_CHUNK_ROWS : j->rows;
    float *row = j->scratch + c * j->cols;
    if (j->dt == FUSED_BF16) norm_rows(j, r0, r1, row, FUSED_BF16);
    else if (j->dt == FUSED_F16) norm_rows(j, r0, r1, row, FUSED_F16);
    else norm_rows(j, r0, r1, row, FUSED_F32);
}

static int64_t fused_chunks(int64_t rows) { return (rows + FUSED_CHUNK_ROWS - 1) / FUSED_CHUNK_ROWS; }

/* out[r] = rms_norm(x[r] (+ delta[r], written to sum[r])) * weight. Returns -1 when the
 * scratch rows cannot be allocated. */
int32_t fused_rms_norm(const void *x, int64_t ldx, const void *delta, int64_t ldd,
                       const void *weight, void *sum, void *out, int64_t rows, int64_t cols,
                       float eps, int dt) {
    if (rows <= 0 || cols <= 0) return 0;
    const int64_t chunks = fused_chunks(rows);
    float *scratch = (float *)malloc((size_t)(chunks * cols) * sizeof(float));
    if (!scratch) return -1;
    norm_job job = {x, delta, weight, sum, out, rows, cols, ldx, ldd, eps, dt, scratch};
    pool_run(norm_chunk, &job, chunks);
    free(scratch);
    return 0;
}

typedef struct {
    const void *qkv, *cos, *sin;
    void *q, *k;
    int64_t rows, ldqkv, ldcs, q_heads, kv_heads, head_dim;
    int dt;
} rotary_job;

static inline __attribute__((always_inline)) void rotate_head(const void *src, int64_t s0,
                                                              const void *cos, const void *sin,
                                                              int64_t c0, void *dst, int64_t d0,
                                                              int64_t d, int dt) {
    const int64_t half = d / 2;
    for (int64_t i = 0; i < d; i++) {
        const float x = fused_load(src, s0 + i, dt);
        const float other = fused_load(src, s0 + (i < half ? i + half : i - half), dt);
        const float rotated = i < half ? -other : other;
        const float a = fused_round(x * fused_load(cos, c0 + i, dt), dt);
        const float b = fused_round(rotated * fused_load(sin, c0 + i, dt), dt);
        fused_store(dst, d0 + i, a + b, dt);
    }
}

#if defined(__AVX2__)
/* Eight lanes of rotate_head at once (bf16 or fp32; fp16 keeps the scalar loop): the same
 * products, roundings and sums, lane by lane. The demo target's verify (8 rows, 16 heads of
 * 16) spent ~7% of its layer stack in the scalar loop, more than in its norms and SiLU. */
static inline __m256 rot_load(const void *p, int64_t i, int dt) {
    if (dt == FUSED_F32) return _mm256_loadu_ps((const float *)p + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline __m256 rot_round(__m256 v, int dt) {
    if (dt == FUSED_F32) return v;
    return _mm256_castsi256_ps(_mm256_slli_epi32(f32x8_to_bf16_bits(v), 16));
}

static inline void rot_store(void *p, int64_t i, __m256 v, int dt) {
    if (dt == FUSED_F32) {
        _mm256_storeu_ps((float *)p + i, v);
        return;
    }
    const __m256i b = f32x8_to_bf16_bits(v);
    _mm_storeu_si128((__m128i *)((uint16_t *)p + i),
                     _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
}

/* y = round(round(x * cos) + round(rotated * sin)), rotated = -other in the first half. */
static inline __m256 rot_lane(__m256 x, __m256 rotated, __m256 c, __m256 s, int dt) {
    return _mm256_add_ps(rot_round(_mm256_mul_ps(x, c), dt), rot_round(_mm256_mul_ps(rotated, s), dt));
}

static inline __attribute__((always_inline)) void rotate_head_vec(
    const void *src, int64_t s0, const void *cos, const void *sin, int64_t c0, void *dst,
    int64_t d0, int64_t d, int dt) {
    const int64_t half = d / 2;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t i = 0; i < half; i += 8) {
        const __m256 lo = rot_load(src, s0 + i, dt), hi = rot_load(src, s0 + half + i, dt);
        rot_store(dst, d0 + i,
                  rot_lane(lo, _mm256_xor_ps(hi, sign), rot_load(cos, c0 + i, dt),
                           rot_load(sin, c0 + i, dt), dt), dt);
        rot_store(dst, d0 + half + i,
                  rot_lane(hi, lo, rot_load(cos, c0 + half + i, dt),
                           rot_load(sin, c0 + half + i, dt), dt), dt);
    }
}
#define ROT_VECTOR(d, dt) ((dt) != FUSED_F16 && (d) % 16 == 0)
#else
#define ROT_VECTOR(d, dt) 0
#define rotate_head_vec rotate_head
#endif

/* One head, by the vector lanes where they apply (the choice is the same for every head). */
static inline __attribute__((always_inline)) void rotate_any(int vector, const void *src,
                                                             int64_t s0, const void *cos,
                                                             const void *sin, int64_t c0,
                                                             void *dst, int64_t d0, int64_t d,
                                                             int dt) {
    if (vector) rotate_head_vec(src, s0, cos, sin, c0, dst, d0, d, dt);
    else rotate_head(src, s0, cos, sin, c0, dst, d0, d, dt);
}

static inline __attribute__((always_inline)) void rotary_rows(const rotary_job *j, int64_t r0,
                                                              int64_t r1, int dt) {
    const int64_t d = j->head_dim;
    const int vector = ROT_VECTOR(d, dt);
    for (int64_t r = r0; r < r1; r++) {
        for (int64_t h = 0; h < j->q_heads; h++)
            rotate_any(vector, j->qkv, r * j->ldqkv + h * d, j->cos, j->sin, r * j->ldcs, j->q,
                       (r * j->q_heads + h) * d, d, dt);
        for (int64_t h = 0; h < j->kv_heads; h++)
            rotate_any(vector, j->qkv, r * j->ldqkv + (j->q_heads + h) * d, j->cos, j->sin,
                       r * j->ldcs, j->k, (r * j->kv_heads + h) * d, d, dt);
    }
}

static void rotary_chunk(void *ctx, int64_t c) {
    const rotary_job *j = (const rotary_job *)ctx;
    const int64_t r0 = c * FUSED_CHUNK_ROWS;
    const int64_t r1 = r0 + FUSED_CHUNK_ROWS < j->rows ? r0 + FUSED_CHUNK_ROWS : j->rows;
    if (j->dt == FUSED_BF16) rotary_rows(j, r0, r1, FUSED_BF16);
    else if (j->dt == FUSED_F16) rotary_rows(j, r0, r1, FUSED_F16);
    else rotary_rows(j, r0, r1, FUSED_F32);
}

/* q[r, h] / k[r, h] = NeoX-rotated heads of qkv row r (q heads first, then kv heads), with
 * cos/sin rows `ldcs` elements apart (one row of head_dim per token). */
void fused_rotary(const void *qkv, int64_t ldqkv, const void *cos, const void *sin, int64_t ldcs,
                  void *q, void *k, int64_t rows, int64_t q_heads, int64_t kv_heads,
                  int64_t head_dim, int dt) {
    rotary_job job = {qkv, cos, sin, q, k, rows, ldqkv, ldcs, q_heads, kv_heads, head_dim, dt};
    pool_run(rotary_chunk, &job, fused_chunks(rows));
}
