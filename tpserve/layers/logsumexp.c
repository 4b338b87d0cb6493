/* log(sum_i exp(row_i - top)) of one fp32 row whose maximum `top` is finite: the
 * log-sum-exp of a greedy row, less its maximum (so a greedy pick's log-probability is minus
 * this), and the row's softmax. Vector passes with attn_simd.h's exp, which clamps its
 * argument at -87 (this file clamps higher first: EXP_FLOOR below).
 *
 * Why not ATen's logsumexp: its vectorised exp leaves the fast path for arguments below about
 * -88 (results that underflow, and -inf) and then costs 30-140x more per element, whatever the
 * denormal flags (torch 2.13, AVX-512 Xeon, one thread: a [8, 2048] row block 33 us with
 * logits spread over a few units, 780 us spread over ~100; a [1, 32000] row 54 us vs 1.6 ms).
 * Logits spread that wide are ordinary (the random bench model's; any model's masked -inf
 * tokens), and the greedy pick runs every decode step: 0.27 ms of a 6.7 ms batch-1 step of the
 * bench model went there.
 *
 * The sampler's softmax (temperature sampling) hits the same cliff: a [1, 128256] row spread
 * over 130 took 1.1 ms in torch.softmax against 0.13 ms spread over 10.
 *
 * cpu_ops.cpp includes this file (tpserve::greedy_logprob, tpserve::logsumexp,
 * tpserve::softmax); the tests also build it alone with ctypes, with and without
 * -mno-avx512f.
 */
#include <math.h>
#include <stdint.h>

#include "attention/attn_simd.h"

/* Arguments are clamped here before attn_simd.h's exp (which clamps at -87): exp(-87) is
 * ~1.6e-38, just above the smallest normal float, so the softmax's scaling by 1 / sum made
 * it subnormal, and arithmetic on subnormals traps to microcode (our softmax of a
 * [1, 128256] row spread over 130 took 0.36 ms against 0.08 ms spread over 10). exp(-80)
 * ~ 1.8e-35 per term is still far below the rounding of a sum that is at least 1. */
#define EXP_FLOOR (-80.0f)

#if LANES
/* exp(max(d, EXP_FLOOR)) per lane */
static inline vf floored_exp(vf d) { return v_exp(v_max(d, v_set1(EXP_FLOOR))); }
#endif

/* sum_i exp(row_i - top), each term at least exp(EXP_FLOOR) */
static float exp_sum_shifted(const float *row, int64_t n, float top) {
    float sum = 0.0f;
    int64_t i = 0;
#if LANES
    const vf shift = v_set1(top);
    vf acc0 = v_zero(), acc1 = v_zero();
    for (; i + 2 * LANES <= n; i += 2 * LANES) { /* two chains: exp's latency overlaps */
        acc0 = v_add(acc0, floored_exp(v_sub(v_load(row + i), shift)));
        acc1 = v_add(acc1, floored_exp(v_sub(v_load(row + i + LANES), shift)));
    }
    for (; i + LANES <= n; i += LANES) acc0 = v_add(acc0, floored_exp(v_sub(v_load(row + i), shift)));
    sum = v_hsum(v_add(acc0, acc1));
#endif
    for (; i < n; i++) sum += expf(fmaxf(row[i] - top, EXP_FLOOR));
    return sum;
}

float log_sum_exp_shifted(const float *row, int64_t n, float top) {
    return logf(exp_sum_shifted(row, n, top));
}

/* out = softmax(row) for a row whose maximum `top` is finite: exp(row_i - top) / sum, with
 * the terms at or below exp(EXP_FLOOR) (masked -inf tokens among them) exactly 0 (torch's
 * -inf are 0 too: a sampler must never draw a masked token). */
void softmax_shifted(const float *row, int64_t n, float top, float *out) {
    const float scale = 1.0f / exp_sum_shifted(row, n, top);
    int64_t i = 0;
#if LANES
    const vf shift = v_set1(top), mul = v_set1(scale);
    for (; i + LANES <= n; i += LANES) {
        const vf d = v_sub(v_load(row + i), shift);
        v_store(out + i, v_select(v_above(d, EXP_FLOOR), v_mul(floored_exp(d), mul), v_zero()));
    }
#endif
    for (; i < n; i++) {
        const float d = row[i] - top;
        out[i] = d > EXP_FLOOR ? expf(d) * scale : 0.0f;
    }
}

/* Weights summed per block before the draw walks them: the walk finds the block whose running
 * total passes the target, then the token inside it, so it reads ~vocab / DRAW_BLOCK block
 * sums and at most one block of weights instead of every weight again. */
#define DRAW_BLOCK 256

int64_t draw_blocks(int64_t n) { return (n + DRAW_BLOCK - 1) / DRAW_BLOCK; }

/* The weights of softmax(row * inv_t) (temperature 1 / inv_t) into w: exp((row_i - top) *
 * inv_t), those at or below exp(EXP_FLOOR) exactly 0, as softmax_shifted (a masked -inf token
 * is never drawn); the top token's is 1. Per-block totals into `sums` (draw_blocks(n)
 * doubles), their float64 sum returned, or -1 when they are not a distribution (a non-finite
 * inv_t or weight). `top` is the row's finite maximum. */
double tempered_weights(const float *row, int64_t n, float top, float inv_t, float *w,
                        double *sums) {
    if (!isfinite(inv_t) || !(inv_t > 0.0f)) return -1.0;
    const int64_t blocks = draw_blocks(n);
    double total = 0.0;
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t start = b * DRAW_BLOCK, end = start + DRAW_BLOCK < n ? start + DRAW_BLOCK : n;
        float block = 0.0f;
        int64_t i = start;
#if LANES
        const vf shift = v_set1(top), scale = v_set1(inv_t);
        vf acc = v_zero();
        for (; i + LANES <= end; i += LANES) {
            const vf d = v_mul(v_sub(v_load(row + i), shift), scale);
            const vf e = v_select(v_above(d, EXP_FLOOR), floored_exp(d), v_zero());
            v_store(w + i, e);
            acc = v_add(acc, e);
        }
        block = v_hsum(acc);
#endif
        for (; i < end; i++) {
            const float d = (row[i] - top) * inv_t;
            w[i] = d > EXP_FLOOR ? expf(d) : 0.0f;
            block += w[i];
        }
        sums[b] = block;
        total += block;
    }
    return isfinite(total) && total > 0.0 ? total : -1.0;
}

/* One draw with the uniform u in [0, 1) from tempered_weights' w, sums and total: the first
 * token whose running weight (in float64) exceeds u times the total. The walk finds the
 * block first, then the token inside it.
 *
 * Why not torch.multinomial: it draws one sample by drawing an exponential per token (its
 * Gumbel-style fast path), ~650 us a row at a 32000-token vocabulary on one thread, on every
 * sampled decode step; this is one vector pass (tempered_weights) and a short walk. */
int64_t draw_weights(const float *w, int64_t n, const double *sums, double total, double u) {
    const int64_t blocks = draw_blocks(n);
    const double target = u * total;
    double before = 0.0;
    int64_t b = 0;
    while (b + 1 < blocks && before + sums[b] <= target) before += sums[b++];
    const int64_t start = b * DRAW_BLOCK, end = start + DRAW_BLOCK < n ? start + DRAW_BLOCK : n;
    int64_t last = -1;
    for (int64_t i = start; i < end; i++) {
        if (w[i] <= 0.0f) continue;
        before += w[i];
        last = i;
        if (before > target) return i;
    }
    return last; /* the block's sum rounded above its terms' double sum: its last token */
}

/* For the ctypes build: which vector path this object was compiled with. */
int32_t logsumexp_lanes(void) { return LANES; }
