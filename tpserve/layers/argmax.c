/* torch.argmax of one fp32 row: the first maximum, or the first NaN if there is one (NaN
 * counts as the maximum). Two vector passes (max and NaN flags, then the first lane that
 * matches), AVX-512 or AVX2 by what the build targets, a scalar loop for the tail; plain C
 * loops with an early exit ran at 1-4 ns an element, no faster than ATen's argmax.
 *
 * cpu_ops.cpp includes this file (tpserve::greedy_logprob); the tests also build it alone
 * with ctypes, with and without -mno-avx512f.
 */
#include <math.h>
#include <stdint.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define ARGMAX_LANES 16
static float argmax_vector_max(const float *row, int64_t n, int64_t *end, int *nan) {
    __m512 top = _mm512_set1_ps(-INFINITY);
    __mmask16 unordered = 0;
    int64_t i = 0;
    for (; i + ARGMAX_LANES <= n; i += ARGMAX_LANES) {
        const __m512 v = _mm512_loadu_ps(row + i);
        unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        top = _mm512_max_ps(top, v);
    }
    *end = i;
    *nan = unordered != 0;
    return _mm512_reduce_max_ps(top);
}

static int64_t argmax_vector_find(const float *row, int64_t n, float value, int nan) {
    const __m512 want = _mm512_set1_ps(value);
    for (int64_t i = 0; i + ARGMAX_LANES <= n; i += ARGMAX_LANES) {
        const __m512 v = _mm512_loadu_ps(row + i);
        const __mmask16 hit = nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)
                                  : _mm512_cmp_ps_mask(v, want, _CMP_EQ_OQ);
        if (hit) return i + __builtin_ctz(hit);
    }
    return -1;
}
#elif defined(__AVX2__)
#define ARGMAX_LANES 8
static float argmax_vector_max(const float *row, int64_t n, int64_t *end, int *nan) {
    __m256 top = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + ARGMAX_LANES <= n; i += ARGMAX_LANES) {
        const __m256 v = _mm256_loadu_ps(row + i);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        top = _mm256_max_ps(top, v);
    }
    float lanes[ARGMAX_LANES];
    _mm256_storeu_ps(lanes, top);
    float best = lanes[0];
    for (int j = 1; j < ARGMAX_LANES; j++) best = lanes[j] > best ? lanes[j] : best;
    *end = i;
    *nan = _mm256_movemask_ps(unordered) != 0;
    return best;
}

static int64_t argmax_vector_find(const float *row, int64_t n, float value, int nan) {
    const __m256 want = _mm256_set1_ps(value);
    for (int64_t i = 0; i + ARGMAX_LANES <= n; i += ARGMAX_LANES) {
        const __m256 v = _mm256_loadu_ps(row + i);
        const int hit = _mm256_movemask_ps(nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q)
                                               : _mm256_cmp_ps(v, want, _CMP_EQ_OQ));
        if (hit) return i + __builtin_ctz(hit);
    }
    return -1;
}
#else
#define ARGMAX_LANES 0
static float argmax_vector_max(const float *row, int64_t n, int64_t *end, int *nan) {
    (void)row, (void)n;
    *end = 0;
    *nan = 0;
    return -INFINITY;
}

static int64_t argmax_vector_find(const float *row, int64_t n, float value, int nan) {
    (void)row, (void)n, (void)value, (void)nan;
    return -1;
}
#endif

int64_t argmax_first(const float *row, int64_t n) {
    int64_t end = 0;
    int nan = 0;
    float best = argmax_vector_max(row, n, &end, &nan);
    for (int64_t i = end; i < n; i++) { /* the tail past the last whole vector */
        nan |= row[i] != row[i];
        best = row[i] > best ? row[i] : best;
    }
    const int64_t whole = argmax_vector_find(row, end, best, nan);
    if (whole >= 0) return whole;
    for (int64_t i = end; i < n; i++)
        if (nan ? row[i] != row[i] : row[i] == best) return i;
    return 0;
}

int32_t argmax_lanes(void) { return ARGMAX_LANES; }
