/* Sum rows (each a contiguous array) into one or two contiguous outputs, accumulating in fp32.
 *
 * Used by the `shm` allreduce for its reduction step (shm_native.py compiles this file with
 * the host C compiler at first use and loads it with ctypes). `rows` holds one pointer per
 * rank, in rank order; `out2` (may be NULL) receives a second copy of the result. Every rank
 * runs the same code in the same order (row 0, 1, 2, ..., then one rounding), so results are
 * bit-identical across ranks. A vector step loads all rows before it stores, so an output may
 * alias the row it replaces (in-place reduction into the caller's tensor).
 *
 * 16-bit values are widened to fp32, added, and rounded once to nearest-even (NaN kept,
 * quietened): the same arithmetic as torch's CPU bf16/fp16 add, so a 2-rank sum equals
 * torch.add bit for bit. Subnormals are kept (no fast-math, no flush-to-zero instructions such
 * as AVX512-BF16's converts).
 *
 * Explicit intrinsics per instruction set, chosen at compile time (-march=native): AVX-512
 * (16 lanes), AVX2 + F16C (8 lanes), else scalar. Measured on the CI-like Xeon, one thread,
 * 2 rows of 32K bf16: 5.8 us with AVX-512 intrinsics, 10.3 us with GCC vector extensions
 * (which also left fp16 conversions scalar), 14.7 us for torch.add.
 *
 * bf16 is widened without shuffles: each 32-bit word holds an even element (low half) and an
 * odd one (high half), so `word << 16` and `word & 0xFFFF0000` are both exact fp32 values, and
 * the two rounded sums are merged back into words with a mask. The widening/narrowing shuffles
 * run on one port and had made this loop compute-bound (2 local rows of 32K: 8.3 -> 5.6 us).
 *
 * Every row is prefetched PREFETCH_BYTES ahead. In the allreduce the rows are lines a peer core
 * has just written, so each miss is a cross-core transfer that the hardware prefetcher covers
 * poorly; 2 ranks, 64 KB one-shot exchange in C: 25 us -> 16-18 us (distances 512-4096 bytes
 * all within noise of each other; no prefetch was the outlier). `out2` (two-shot: the copy
 * peers gather) is prefetched for writing: its lines sit in the peer's cache from the last
 * round, and taking ownership of them one store miss at a time had cost more than the reads
 * (1 MB two-shot at 2 ranks, reduce phase 120-145 -> 88-97 us).
 */
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__F16C__))
#include <immintrin.h>
#define PREFETCH_BYTES 1024
#define PREFETCH(p) _mm_prefetch((const char *)(p) + PREFETCH_BYTES, _MM_HINT_T0)
/* prefetchw where the CPU has it (else a plain prefetch): fetch a line to overwrite */
#define PREFETCH_WRITE(p) __builtin_prefetch((const char *)(p) + PREFETCH_BYTES, 1, 3)
#endif

/* ---- scalar conversions (the tail of every row, and the fallback) ---- */

static inline float bf16_in1(const uint16_t *p) {
    uint32_t u = (uint32_t)*p << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline void bf16_out1(uint16_t *p, float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    int nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
    *p = (uint16_t)(nan ? (u >> 16) | 0x40u : (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline float f16_in1(const _Float16 *p) { return (float)*p; }
static inline void f16_out1(_Float16 *p, float f) { *p = (_Float16)f; }
static inline float f32_in1(const float *p) { return *p; }
static inline void f32_out1(float *p, float f) { *p = f; }

/* ---- vector conversions: LANES elements to / from one fp32 register ---- */

#if defined(__AVX512F__)
#define LANES 16
typedef __m512 vec;
#define vadd _mm512_add_ps
#define I(x) _mm512_set1_epi32(x)

static inline vec f16_in(const _Float16 *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

static inline void f16_out(_Float16 *p, vec f) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT));
}

static inline vec f32_in(const float *p) { return _mm512_loadu_ps(p); }
static inline void f32_out(float *p, vec f) { _mm512_storeu_ps(p, f); }

/* bf16 pairs: 2 * LANES elements as LANES 32-bit words */
typedef __m512i words;
static inline words words_in(const uint16_t *p) { return _mm512_loadu_si512(p); }
static inline void words_out(uint16_t *p, words w) { _mm512_storeu_si512(p, w); }
static inline vec even_of(words w) { return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)); }
static inline vec odd_of(words w) { return _mm512_castsi512_ps(_mm512_and_si512(w, I(0xFFFF0000))); }

/* fp32 -> bf16 in the high half of each word (low half is garbage), nearest-even, NaN quiet */
static inline words round_high(vec f) {
    __m512i u = _mm512_castps_si512(f);
    __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(u, I(0x7FFF)),
                                       _mm512_and_si512(_mm512_srli_epi32(u, 16), I(1)));
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, I(0x7FFFFFFF)), I(0x7F800000));
    return _mm512_mask_blend_epi32(nan, rounded, _mm512_or_si512(u, I(0x400000)));
}

static inline words pack_pairs(vec even, vec odd) {
    /* truth table 0xCA: bitwise select, mask ? odd : even >> 16 */
    return _mm512_ternarylogic_epi32(I(0xFFFF0000), round_high(odd),
                                     _mm512_srli_epi32(round_high(even), 16), 0xCA);
}

#elif defined(__AVX2__) && defined(__F16C__)
#define LANES 8
typedef __m256 vec;
#define vadd _mm256_add_ps
#define I(x) _mm256_set1_epi32(x)

static inline vec f16_in(const _Float16 *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

static inline void f16_out(_Float16 *p, vec f) {
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT));
}

static inline vec f32_in(const float *p) { return _mm256_loadu_ps(p); }
static inline void f32_out(float *p, vec f) { _mm256_storeu_ps(p, f); }

/* bf16 pairs: 2 * LANES elements as LANES 32-bit words */
typedef __m256i words;
static inline words words_in(const uint16_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline void words_out(uint16_t *p, words w) { _mm256_storeu_si256((__m256i *)p, w); }
static inline vec even_of(words w) { return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)); }
static inline vec odd_of(words w) { return _mm256_castsi256_ps(_mm256_and_si256(w, I(0xFFFF0000))); }

/* fp32 -> bf16 in the high half of each word (low half is garbage), nearest-even, NaN quiet */
static inline words round_high(vec f) {
    __m256i u = _mm256_castps_si256(f);
    __m256i rounded = _mm256_add_epi32(_mm256_add_epi32(u, I(0x7FFF)),
                                       _mm256_and_si256(_mm256_srli_epi32(u, 16), I(1)));
    __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, I(0x7FFFFFFF)), I(0x7F800000));
    return _mm256_blendv_epi8(rounded, _mm256_or_si256(u, I(0x400000)), nan);
}

static inline words pack_pairs(vec even, vec odd) {
    return _mm256_blend_epi16(_mm256_srli_epi32(round_high(even), 16), round_high(odd), 0xAA);
}

#else
#define LANES 0 /* scalar only */
#endif

/* ---- the reduction, one instance per format ---- */

#define ROW(T, k) ((const T *)rows[k])

#if LANES
#define VECTOR_PART(T, FMT)                                                          \
    for (; i + LANES <= n; i += LANES) {                                             \
        for (int32_t k = 0; k < nrows; k++) PREFETCH(ROW(T, k) + i);                 \
        if (out2) PREFETCH_WRITE(out2 + i);                                          \
        vec acc = FMT##_in(ROW(T, 0) + i);                                           \
        for (int32_t k = 1; k < nrows; k++) acc = vadd(acc, FMT##_in(ROW(T, k) + i)); \
        FMT##_out(out + i, acc);                                                     \
        if (out2) FMT##_out(out2 + i, acc);                                          \
    }

/* bf16 only: even and odd elements accumulate separately (see the top of the file) */
#define PAIRS_PART(T, FMT)                                                           \
    for (; i + 2 * LANES <= n; i += 2 * LANES) {                                     \
        for (int32_t k = 0; k < nrows; k++) PREFETCH(ROW(T, k) + i);                 \
        if (out2) PREFETCH_WRITE(out2 + i);                                          \
        words w = words_in(ROW(T, 0) + i);                                           \
        vec even = even_of(w), odd = odd_of(w);                                      \
        for (int32_t k = 1; k < nrows; k++) {                                        \
            w = words_in(ROW(T, k) + i);                                             \
            even = vadd(even, even_of(w));                                           \
            odd = vadd(odd, odd_of(w));                                              \
        }                                                                            \
        w = pack_pairs(even, odd);                                                   \
        words_out(out + i, w);                                                       \
        if (out2) words_out(out2 + i, w);                                            \
    }
#else
#define VECTOR_PART(T, FMT)
#define PAIRS_PART(T, FMT)
#endif

#define DEFINE_REDUCE(NAME, T, FMT, VECTOR)                                                 \
    void NAME(const void *const *rows, int32_t nrows, T *out, T *out2, int64_t n) {         \
        int64_t i = 0;                                                                      \
        VECTOR(T, FMT)                                                                      \
        for (; i < n; i++) {                                                                \
            float acc = FMT##_in1(ROW(T, 0) + i);                                           \
            for (int32_t k = 1; k < nrows; k++) acc += FMT##_in1(ROW(T, k) + i);            \
            FMT##_out1(out + i, acc);                                                       \
            if (out2) FMT##_out1(out2 + i, acc);                                            \
        }                                                                                   \
    }

DEFINE_REDUCE(reduce_bf16, uint16_t, bf16, PAIRS_PART)
DEFINE_REDUCE(reduce_f16, _Float16, f16, VECTOR_PART)
DEFINE_REDUCE(reduce_f32, float, f32, VECTOR_PART)

/* Lanes per vector step in this build: 0 means scalar only (the caller prefers torch then). */
int32_t reduce_lanes(void) { return LANES; }
