/* The arithmetic of gemm.c: tiles of Y = X W^T for 16-bit W, accumulating in fp32.
 *
 * Decode on CPU is little but this: every weight is read once per step, so a step is as fast
 * as the weights stream. On one thread ATen's bf16 `mv` streams decode-shaped weights at
 * 7-11 GB/s on the CI-like Xeon, where a plain read runs at ~20; the one-row tile reaches 18-19
 * (see ROWS below), and the several-row tiles load each weight vector once for several x rows.
 * gemm.c includes this file (and cpu_ops.cpp gemm.c); the tests also build gemm.c alone with
 * the host C compiler (ctypes) to check the AVX2 path.
 *
 * Arithmetic, fixed so that every caller (eager and compiled decode, any tile) gets the same bits
 * for an output: x is widened to fp32 once; columns go in blocks of 2 x LANES, in order, each
 * half of a block into its own fp32 accumulator vector by fused multiply-add; the two
 * accumulators are added, their lanes summed as a fixed pairwise tree, the leftover columns
 * added one by one with fmaf, and the sum rounded once to the output format (nearest-even, NaN
 * kept). Subnormals are kept.
 *
 * bf16 on CPUs with AVX512-BF16 (DPBF16 below) instead: x stays bf16, and each 2 x LANES block
 * of columns is one dot-product instruction into an fp32 accumulator (each lane adds its two
 * exact products), blocks alternating between two accumulators, the last partial block (k not
 * a multiple of 2 x LANES) zero-padded by masked loads; then the same lane tree and rounding.
 * Every tile uses it, so the bits are still the same whatever the tile, batch or thread count.
 * bf16 subnormal inputs count as zero there (the instruction's DAZ; ATen keeps them). The
 * padded block replaced a scalar tail of fmaf's, one dependent chain per output: the demo
 * target's down projection at TP = 2 (k = 176, a 16-column tail) spent more time in it than
 * in its 5 vector blocks (8 layers + lm_head, one thread, C loop: 1 x row 56 -> 36 us, 8 rows
 * 309 -> 209 us).
 *
 * Explicit intrinsics chosen at compile time (-march=native): AVX-512 (16 lanes) or AVX2 + F16C
 * + FMA (8 lanes). Without them the library reports 0 lanes and the caller keeps ATen.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__F16C__) && defined(__FMA__))
#include <immintrin.h>
#endif

/* How far ahead of each weight row's loads to prefetch. Measured on the CI-like Xeon, one
 * thread, bf16, all 33 projections of the 84 MB bench_compile model in sequence, GB/s (same run,
 * two runs on a noisy machine): torch.mv 12.6 / 9.2; 4 rows with no prefetch 10.1 / 7.6, 2 KB
 * ahead 15.0 / 10.3, 4 KB 18.9 / 11.8, 8 KB 21.1 / 12.1; at 4 KB, 2 rows 20.5 / 11.4 and 8 rows
 * 12.9 / 8.9. On a 2-vCPU Zen 3 (AVX2) the distance hardly matters (one row at a time, 2
 * threads, 0 to 8 KB: 13-15 GB/s, within the noise). */
#define PREFETCH_BYTES 8192

#include "half.h"

/* The tiles' small helpers must be inlined: out of line, a tile's R x X accumulators go
 * through memory and the R, X loops are not unrolled. `static inline` alone is a hint, and
 * cpu_ops.cpp compiles this file inside one large unit, past GCC's growth limit for
 * inlining, where hints are dropped: store_sums was called out of line by every 2-row tile
 * (the projections of steps with 2+ rows), and ~40 more lines in draft_tree.cpp pushed it
 * out of the 1-row tiles too (23% of a draft tree's time in a tight loop). Forced inline,
 * served 16 streams of the bench model gained 1.03-1.11x (TP = 1, two servers alternating). */
#define TILE_HELPER static inline __attribute__((always_inline))

#if defined(__AVX512F__)
#define LANES 16
typedef __m512 vec;
#define vzero _mm512_setzero_ps
#define vadd _mm512_add_ps
#define vfma _mm512_fmadd_ps
#define vload _mm512_loadu_ps
TILE_HELPER vec f16_vec(const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define LANES 8
typedef __m256 vec;
#define vzero _mm256_setzero_ps
#define vadd _mm256_add_ps
#define vfma _mm256_fmadd_ps
#define vload _mm256_loadu_ps
TILE_HELPER vec f16_vec(const uint16_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
#else
#define LANES 0
#endif

/* Weight rows per pass at one x row (each x block is loaded once for all of them): the number of
 * weight streams a thread reads side by side. The Xeon above (AVX-512) streams best with 4; a
 * 2-vCPU Zen 3 (AVX2) with one, a plain sequential read: the 33 projections + lm_head of the
 * bench model (hidden 512 x 8, 79 MB), one thread, 11.3 GB/s with 1 row vs 8.5 with 4, 7.6 with
 * 2 and 8.0 with 8 (a plain AVX2 read of the same bytes: 12.7-13.1); 2 threads 13-15 vs 11.2.
 * AMD Zen with AVX-512 (Zen 4) too: a 2-vCPU EPYC, 8 layers of the bench model's projections
 * at one x row (ctypes harness, median of 9 alternating rounds), 1 thread 17.4 GB/s with 1 row
 * vs 10.1 with 4 and 14.1 with 2; 2 threads 35.4 vs 22.9 and 32.7. So one row on any Zen
 * (GCC's -march=native names it znverN; a GCC older than the chip names an older Zen).
 * Only the order in which outputs are computed changes, never an output's arithmetic. */
#if defined(__znver1__) || defined(__znver2__) || defined(__znver3__) || defined(__znver4__) \
    || defined(__znver5__)
#define AMD_ZEN 1
#else
#define AMD_ZEN 0
#endif
#ifndef ROWS
#if LANES == 16 && !AMD_ZEN
#define ROWS 4
#else
#define ROWS 1
#endif
#endif
#if ROWS != 1 && ROWS != 4
#error "ROWS: the streaming tile exists for 1 and 4 weight rows"
#endif

/* bf16 tiles by AVX512-BF16's dot product (32 multiply-adds per instruction, against 16 per FMA
 * plus the unpacking): the several-x-row tiles are bound by arithmetic, not by the weight stream
 * (batch 16 ran at 0.65-0.7x of llama.cpp's batched decode on a 2-vCPU AVX-512 EPYC with the
 * FMA tiles, 0.95x with these). -DDPBF16=0 builds the FMA tiles (the tests compare both). */
#ifndef DPBF16
#if LANES == 16 && defined(__AVX512BF16__)
#define DPBF16 1
#else
#define DPBF16 0
#endif
#endif
#if DPBF16 && !(LANES == 16 && defined(__AVX512BF16__))
#error "DPBF16 needs AVX-512 with AVX512-BF16"
#endif

#if LANES
/* Sum of the lanes as a fixed pairwise tree: low half + high half, halving each round. In
 * registers (a store and scalar adds per row cost as much as the row's loads for k = 512). */
TILE_HELPER float lanes_sum(vec v) {
#if LANES == 16
    __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), hi);
#else
    __m256 h = v;
#endif
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

/* lanes_sum of n vectors into out[0..n): the same pairwise tree per vector, but with AVX-512
 * four vectors share each shuffle and add (a tile of k = 128 spent ~45% of its time summing
 * lanes one vector at a time: 8 FMAs per output against ~9 reduction ops). IEEE addition is
 * commutative, so only the pairing matters, and it is lanes_sum's: i + (i + 8), then + 4,
 * then + 2, then + 1. */
#if LANES == 16
TILE_HELPER void lanes_sum4(vec a, vec b, vec c, vec d, float *out) {
    /* [a.lo256 + a.hi256, b.lo256 + b.hi256] as 128-bit blocks [a0+a2, a1+a3, b0+b2, b1+b3] */
    const vec ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
    const vec cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(3, 2, 3, 2)));
    /* each vector's 8-lane sum, low half + high half: one 128-bit block per vector */
    vec q = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(3, 1, 3, 1)));
    q = _mm512_add_ps(q, _mm512_permute_ps(q, _MM_SHUFFLE(3, 2, 3, 2))); /* q + movehl(q) */
    q = _mm512_add_ps(q, _mm512_movehdup_ps(q));                         /* lane 0 + lane 1 */
    float lanes[16];
    _mm512_storeu_ps(lanes, q);
    out[0] = lanes[0], out[1] = lanes[4], out[2] = lanes[8], out[3] = lanes[12];
}
#endif

/* The lane sums of a tile's R x X vectors (v[j * R + r]) into sums[j * lds + r]. Each is
 * written where the caller wants it: gathering them in a small array for the caller to copy
 * cost a store and a reload per output (store forwarding), ~15% of an 8-row pass at k = 128. */
TILE_HELPER void store_sums(const vec *v, int R, int X, float *sums, int64_t lds) {
#if LANES == 16
    float out[64];
    int i = 0, n = R * X;
    for (; i + 4 <= n; i += 4) lanes_sum4(v[i], v[i + 1], v[i + 2], v[i + 3], out + i);
    for (; i < n; i++) out[i] = lanes_sum(v[i]);
    for (int j = 0; j < X; j++)
        for (int r = 0; r < R; r++) sums[j * lds + r] = out[j * R + r];
#else
    for (int j = 0; j < X; j++)
        for (int r = 0; r < R; r++) sums[j * lds + r] = lanes_sum(v[j * R + r]);
#endif
}

/* bf16 without a shuffle: a vector of 2*LANES bf16 weights is LANES 32-bit words, each holding
 * an even column in its low half and the next odd column in its high half. `word << 16` is the
 * even column as fp32 and `word & 0xFFFF0000` the odd one, so each load costs two cheap integer
 * ops instead of a port-5 widening (which capped the loop at ~10 GB/s, half the read rate). x is
 * laid out to match: per block of 2*LANES columns, LANES even columns then LANES odd ones. */
TILE_HELPER void bf16_pair(const uint16_t *p, vec *even, vec *odd) {
#if LANES == 16
    __m512i words = _mm512_loadu_si512((const void *)p);
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(words, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(words, _mm512_set1_epi32((int)0xFFFF0000u)));
#else
    __m256i words = _mm256_loadu_si256((const __m256i *)p);
    *even = _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
    *odd = _mm256_castsi256_ps(_mm256_and_si256(words, _mm256_set1_epi32((int)0xFFFF0000u)));
#endif
}

/* fp16 has no such trick: one F16C widening per LANES columns, x in plain order. */
TILE_HELPER void f16_pair(const uint16_t *p, vec *even, vec *odd) {
    *even = f16_vec(p);
    *odd = f16_vec(p + LANES);
}

static void bf16_layout(const uint16_t *xh, int64_t k, float *x) {
#if DPBF16 /* x stays bf16, in column order: k 16-bit values at the start of the fp32 row */
    memcpy(x, xh, (size_t)k * sizeof(uint16_t));
#else
    int64_t c = 0;
    for (; c + 2 * LANES <= k; c += 2 * LANES)
        for (int j = 0; j < LANES; j++) {
            x[c + j] = bf16_to_f32(xh[c + 2 * j]);
            x[c + LANES + j] = bf16_to_f32(xh[c + 2 * j + 1]);
        }
    for (; c < k; c++) x[c] = bf16_to_f32(xh[c]);
#endif
}

static void f16_layout(const uint16_t *xh, int64_t k, float *x) {
    for (int64_t c = 0; c < k; c++) x[c] = f16_to_f32(xh[c]);
}

/* A tile: R weight rows x X rows of x, every weight vector loaded once for all X. Per (weight row,
 * x row) pair: two accumulators (the block's first and second halves), added together, then
 * the lanes as a fixed tree, then the tail columns one by one -- the same sequence whatever the
 * tile, so an output does not depend on which other rows were in the call (batch-invariant).
 * `x` holds X rows of the fp32 layout, `ldxf` floats apart; sums[j * R + r]. */
#define DEFINE_TILE(FMT, R, X)                                                                \
    static void tile_##FMT##_##R##_##X(const uint16_t *w, int64_t ldw, const float *x,        \
                                       int64_t ldxf, int64_t k, float *sums, int64_t lds) {   \
        vec a0[R][X], a1[R][X];                                                               \
        for (int r = 0; r < R; r++)                                                           \
            for (int j = 0; j < X; j++) a0[r][j] = a1[r][j] = vzero();                        \
        int64_t c = 0;                                                                        \
        for (; c + 2 * LANES <= k; c += 2 * LANES) {                                          \
            vec w0[R], w1[R]; /* all R rows' weights first: each x vector is loaded once */   \
            for (int r = 0; r < R; r++) {                                                     \
                _mm_prefetch((const char *)(w + r * ldw + c) + PREFETCH_BYTES, _MM_HINT_T0);  \
                FMT##_pair(w + r * ldw + c, &w0[r], &w1[r]);                                  \
            }                                                                                 \
            for (int j = 0; j < X; j++) {                                                     \
                const vec x0 = vload(x + j * ldxf + c), x1 = vload(x + j * ldxf + c + LANES); \
                for (int r = 0; r < R; r++) {                                                 \
                    a0[r][j] = vfma(w0[r], x0, a0[r][j]);                                     \
                    a1[r][j] = vfma(w1[r], x1, a1[r][j]);                                     \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        vec v[R * X];                                                                         \
        for (int r = 0; r < R; r++)                                                           \
            for (int j = 0; j < X; j++) v[j * R + r] = vadd(a0[r][j], a1[r][j]);              \
        store_sums(v, R, X, sums, lds);                                                       \
        if (c < k) /* tail columns one by one (the demo's k = 176 at TP = 2 has 16 here) */    \
            for (int r = 0; r < R; r++)                                                       \
                for (int j = 0; j < X; j++) {                                                 \
                    float s = sums[j * lds + r];                                              \
                    for (int64_t t = c; t < k; t++)                                           \
                        s = fmaf(FMT##_to_f32(w[r * ldw + t]), x[j * ldxf + t], s);           \
                    sums[j * lds + r] = s;                                                    \
                }                                                                             \
    }

#if DPBF16
/* DEFINE_TILE's shape for bf16 by dot products: blocks of 2 x LANES columns alternate between
 * the accumulators a0 and a1 (a lone last block goes to a0); x rows hold bf16 (bf16_layout). */
#define DEFINE_TILE_DP(R, X)                                                                  \
    static void tile_bf16_##R##_##X(const uint16_t *w, int64_t ldw, const float *xf,          \
                                    int64_t ldxf, int64_t k, float *sums, int64_t lds) {      \
        const uint16_t *x = (const uint16_t *)xf;                                             \
        const int64_t ldx = 2 * ldxf;                                                         \
        __m512 a0[R][X], a1[R][X];                                                            \
        for (int r = 0; r < R; r++)                                                           \
            for (int j = 0; j < X; j++) a0[r][j] = a1[r][j] = _mm512_setzero_ps();            \
        int64_t c = 0;                                                                        \
        for (; c + 4 * LANES <= k; c += 4 * LANES) {                                          \
            __m512bh w0[R], w1[R];                                                            \
            for (int r = 0; r < R; r++) {                                                     \
                const uint16_t *p = w + r * ldw + c;                                          \
                _mm_prefetch((const char *)p + PREFETCH_BYTES, _MM_HINT_T0);                  \
                _mm_prefetch((const char *)p + PREFETCH_BYTES + 64, _MM_HINT_T0);             \
                w0[r] = (__m512bh)_mm512_loadu_si512((const void *)p);                        \
                w1[r] = (__m512bh)_mm512_loadu_si512((const void *)(p + 2 * LANES));          \
            }                                                                                 \
            for (int j = 0; j < X; j++) {                                                     \
                const __m512bh x0 = (__m512bh)_mm512_loadu_si512((const void *)(x + j * ldx + c)); \
                const __m512bh x1 =                                                           \
                    (__m512bh)_mm512_loadu_si512((const void *)(x + j * ldx + c + 2 * LANES)); \
                for (int r = 0; r < R; r++) {                                                 \
                    a0[r][j] = _mm512_dpbf16_ps(a0[r][j], w0[r], x0);                         \
                    a1[r][j] = _mm512_dpbf16_ps(a1[r][j], w1[r], x1);                         \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        if (c + 2 * LANES <= k) {                                                             \
            for (int r = 0; r < R; r++) {                                                     \
                const __m512bh wv = (__m512bh)_mm512_loadu_si512((const void *)(w + r * ldw + c)); \
                for (int j = 0; j < X; j++)                                                   \
                    a0[r][j] = _mm512_dpbf16_ps(                                              \
                        a0[r][j], wv, (__m512bh)_mm512_loadu_si512((const void *)(x + j * ldx + c))); \
            }                                                                                 \
            c += 2 * LANES;                                                                   \
        }                                                                                     \
        if (c < k) { /* the last, partial block zero-padded (masked loads read nothing past  \
                        k), into the accumulator the next full block would have gone to */    \
            const __mmask32 keep = (__mmask32)((1u << (k - c)) - 1);                         \
            const int odd = (int)((c / (2 * LANES)) & 1);                                     \
            for (int r = 0; r < R; r++) {                                                     \
                const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(keep, w + r * ldw + c); \
                for (int j = 0; j < X; j++) {                                                 \
                    const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(keep, x + j * ldx + c); \
                    if (odd) a1[r][j] = _mm512_dpbf16_ps(a1[r][j], wv, xv);                   \
                    else a0[r][j] = _mm512_dpbf16_ps(a0[r][j], wv, xv);                       \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        vec v[R * X];                                                                         \
        for (int r = 0; r < R; r++)                                                           \
            for (int j = 0; j < X; j++) v[j * R + r] = vadd(a0[r][j], a1[r][j]);              \
        store_sums(v, R, X, sums, lds);                                                       \
    }
#define TILE_bf16(R, X) DEFINE_TILE_DP(R, X)
#else
#define TILE_bf16(R, X) DEFINE_TILE(bf16, R, X)
#endif
#define TILE_f16(R, X) DEFINE_TILE(f16, R, X)

#if ROWS == 4
#define DEFINE_STREAM_TILE(FMT) TILE_##FMT(4, 1)
#define STREAM_TILE(FMT) tile_##FMT##_4_1
#else
#define DEFINE_STREAM_TILE(FMT)
#define STREAM_TILE(FMT) tile_##FMT##_1_1
#endif

/* The tiles gemm.c uses. One x row: ROWS weight rows (STREAM_TILE). Several x rows: pairs of
 * weight rows against up to XPAIR x rows (2 x 2 x XPAIR accumulators: 24 of the 32 AVX-512
 * registers at XPAIR = 6, beside 4 weight and 2 x vectors), and single weight rows against up
 * to XMAX x rows for an odd row out or a longer block. */
#define XMAX 8
/* 6 rather than 4: each weight vector loaded serves 6 x rows. The AVX-512 EPYC (ctypes
 * harness, median of 9 alternating rounds, 2 x 6 / 2 x 4 time): the bench model's projections
 * + lm_head on 2 threads 0.81x at 6 x rows, 0.92-0.95x at 8, 0.89-0.96x at 16, 0.95x at 32,
 * 0.96-0.97x at 64; one thread 0.93x at 16, 0.96x at 64; the FMA tiles (-DDPBF16=0) 0.83x
 * at 6, 0.95x at 8 and 16, 0.94x at 64; the demo target's TP = 2 shapes on one thread 0.93x
 * at 5 rows, 0.86x at 6, 0.92x at 8; large k (4096 x 1024 and 14336 x 512 projections, 2
 * threads) 0.97-0.99x at 8-16 rows, 0.89-0.93x at 32-64, the FMA tiles 0.98-1.04x at 8-16
 * (6 fp32 x rows of 14336 columns are 344 KB) and 0.95x at 32-64. 2 x 5 tiles: between. */
#ifndef XPAIR
#define XPAIR 6
#endif
#if XPAIR < 2 || XPAIR > 6
#error "XPAIR: the 2-row tiles exist for 2 to 6 x rows"
#endif
/* The largest x block the 2-row tiles take. AVX-512 has 32 vector registers: a 2 x 6 tile's 24
 * accumulators fit beside its weight and x vectors. AVX2 has 16, where they spill: on a 2-vCPU
 * Zen 3 (C harness, the bench model's projections + lm_head, 2 threads, median of 9 passes)
 * one weight row against blocks of 4 x rows ran 5.3 / 5.6 / 9.6 / 16.2 / 74.0 ms at 2 / 4 / 8
 * / 16 / 64 rows against 7.7 / 10.7 / 13.1 / 22.0-32.0 / 98.0 with the 2 x 4 tiles (blocks of
 * 6 or 8: no better). Same bits: every output keeps its own two accumulators. */
#ifndef PAIR_XS
#if LANES == 16
#define PAIR_XS XPAIR
#else
#define PAIR_XS 1
#endif
#endif
/* Whether the first x block over a chunk (its weights still in memory, not cache) may use the
 * 2-row tiles. On AMD Zen two weight streams side by side read slower than one (see ROWS), and
 * a block of 2-4 x rows is bound by that read: the bench model's projections + lm_head, a
 * 2-vCPU AVX-512 EPYC, 2 threads, ctypes harness, median of 9 alternating rounds, two runs:
 * 2 x rows 3.2-3.4 ms with 1-row tiles against 4.7-5.7 with 2-row ones, 4 rows 3.4-3.8 against
 * 5.0-5.6; at 16-32 rows (later blocks over cached weights) the 2-row tiles win by 4-22%. */
#ifndef COLD_PAIRS
#define COLD_PAIRS (!AMD_ZEN)
#endif
typedef void (*tile_fn)(const uint16_t *, int64_t, const float *, int64_t, int64_t, float *,
                        int64_t);
#define DEFINE_TILES(FMT)                                                                     \
    DEFINE_STREAM_TILE(FMT) /* ROWS x 1 */                                                    \
    TILE_##FMT(1, 1)                                                                          \
    TILE_##FMT(1, 2)                                                                          \
    TILE_##FMT(1, 3)                                                                          \
    TILE_##FMT(1, 4)                                                                          \
    TILE_##FMT(1, 5)                                                                          \
    TILE_##FMT(1, 6)                                                                          \
    TILE_##FMT(1, 7)                                                                          \
    TILE_##FMT(1, 8)                                                                          \
    TILE_##FMT(2, 2)                                                                          \
    TILE_##FMT(2, 3)                                                                          \
    TILE_##FMT(2, 4)                                                                          \
    TILE_##FMT(2, 5)                                                                          \
    TILE_##FMT(2, 6)                                                                          \
    static const tile_fn one_row_tiles_##FMT[XMAX + 1] = {                                    \
        0, tile_##FMT##_1_1, tile_##FMT##_1_2, tile_##FMT##_1_3, tile_##FMT##_1_4,            \
        tile_##FMT##_1_5, tile_##FMT##_1_6, tile_##FMT##_1_7, tile_##FMT##_1_8};              \
    static const tile_fn two_row_tiles_##FMT[7] = {                                           \
        0, 0, tile_##FMT##_2_2, tile_##FMT##_2_3, tile_##FMT##_2_4, tile_##FMT##_2_5,         \
        tile_##FMT##_2_6};
DEFINE_TILES(bf16)
DEFINE_TILES(f16)
#endif
