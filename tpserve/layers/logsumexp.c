/* log(sum_i exp(row_i - top)) of one fp32 row whose maximum `top` is finite: the
 * log-sum-exp of a greedy row, less its maximum (so a greedy pick's log-probability is minus
 * this). One vector pass with attn_simd.h's exp, which clamps its argument at -87.
 *
 * Why not ATen's logsumexp: its vectorised exp leaves the fast path for arguments below about
 * -88 (results that underflow, and -inf) and then costs 30-140x more per element, whatever the
 * denormal flags (torch 2.13, AVX-512 Xeon, one thread: a [8, 2048] row block 33 us with
 * logits spread over a few units, 780 us spread over ~100; a [1, 32000] row 54 us vs 1.6 ms).
 * Logits spread that wide are ordinary (the random bench model's; any model's masked -inf
 * tokens), and the greedy pick runs every decode step: 0.27 ms of a 6.7 ms batch-1 step of the
 * bench model went there. Clamping at -87 adds at most ~1e-38 per element to a sum that is
 * at least 1 (the maximum's own term), below its rounding.
 *
 * cpu_ops.cpp includes this file (tpserve::greedy_logprob, tpserve::logsumexp); the tests
 * also build it alone with ctypes, with and without -mno-avx512f.
 */
#include <math.h>
#include <stdint.h>

#include "attention/attn_simd.h"

#define EXP_FLOOR (-87.0f)

float log_sum_exp_shifted(const float *row, int64_t n, float top) {
    float sum = 0.0f;
    int64_t i = 0;
#if LANES
    const vf shift = v_set1(top);
    vf acc0 = v_zero(), acc1 = v_zero();
    for (; i + 2 * LANES <= n; i += 2 * LANES) { /* two chains: exp's latency overlaps */
        acc0 = v_add(acc0, v_exp(v_sub(v_load(row + i), shift)));
        acc1 = v_add(acc1, v_exp(v_sub(v_load(row + i + LANES), shift)));
    }
    for (; i + LANES <= n; i += LANES) acc0 = v_add(acc0, v_exp(v_sub(v_load(row + i), shift)));
    sum = v_hsum(v_add(acc0, acc1));
#endif
    for (; i < n; i++) sum += expf(fmaxf(row[i] - top, EXP_FLOOR));
    return logf(sum);
}

/* For the ctypes build: which vector path this object was compiled with. */
int32_t logsumexp_lanes(void) { return LANES; }
