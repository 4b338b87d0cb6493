// Greedy picks over a vocabulary split across tensor-parallel ranks, without gathering logits.
//
// tpserve::shard_pick(h, norm_w?, eps, lm_head_w, valid, start, rank, world) -> picks
//   [K, 3 * world] fp32: this rank's lm_head over rows h, final-normed here first where
//   norm_w is given (the same norm, matmul and fp32 rounding as decoder_head), then per row,
//   over the shard's first `valid` columns (ids start...): the maximum, the shifted sum of
//   exp(logit - maximum) (logsumexp.c's) and the first id holding the maximum (a NaN counts
//   as the maximum, as torch.argmax), at columns 3 * rank...; every other column 0, so
//   summing every rank's tensor is an all-gather (each value has one non-zero term: exact).
// tpserve::combine_picks(picks, exchange) -> (tokens [K] int64, log-probabilities [K] fp32):
//   with `exchange` (a `shm` rank: comm_backends/base.py's StackExchange, as decoder_layers
//   takes it) first that sum, in place; then per row the first shard holding the maximum wins
//   (the lowest id, as argmax over the whole vocabulary) and the log-probability is minus the
//   log of the shards' sums rescaled to that maximum, the most negative float where the maximum
//   is not finite (fused.finite_logprobs). One shard: exactly greedy_logprob's bits.
//
// Why: one rank's greedy step sent its logits through Python's sampler (~60 us), and at
// TP = 2 a batch-1 step also gathered 128 KB of fp32 logits (~100 us of a 2.6 ms step on the
// bench model) before rank 0 scanned all 32000 of them (~65 us), all on caches the weight
// stream had just emptied. Doing the few numbers either side of the exchange in Python was
// no cheaper: cold, each torch or numpy op there cost 5-10 us.

#include <ATen/ops/zeros.h>

namespace {

constexpr int64_t kPickFields = 3;  // maximum, shifted sum, id

at::Tensor shard_pick(const at::Tensor &h, const std::optional<at::Tensor> &norm_w, double eps,
                      const at::Tensor &lm_head_w, int64_t valid, int64_t start, int64_t rank,
                      int64_t world) {
    TORCH_CHECK(world >= 1 && rank >= 0 && rank < world, "tpserve::shard_pick: rank ", rank,
                " of ", world);
    TORCH_CHECK(valid >= 0 && valid <= lm_head_w.size(0), "tpserve::shard_pick: ", valid,
                " valid rows of a ", lm_head_w.size(0), "-row shard");
    const at::Tensor normed = norm_w.has_value() ? rms_norm(h, *norm_w, eps) : h;
    const at::Tensor logits = matmul(normed, lm_head_w).to(at::kFloat).contiguous();
    const int64_t rows = logits.size(0), width = logits.size(1);
    at::Tensor picks = at::zeros({rows, kPickFields * world}, logits.options());
    const float *x = logits.const_data_ptr<float>();
    float *p = picks.mutable_data_ptr<float>();
    for (int64_t r = 0; r < rows; r++) {
        float *mine = p + r * kPickFields * world + kPickFields * rank;
        const float *row = x + r * width;
        const int64_t best = valid > 0 ? argmax_first(row, valid) : 0;
        const float top = valid > 0 ? row[best] : -std::numeric_limits<float>::infinity();
        mine[0] = top;
        mine[1] = std::isfinite(top) ? exp_sum_shifted(row, valid, top) : 0.0f;
        mine[2] = static_cast<float>(start + best);
    }
    return picks;
}

std::tuple<at::Tensor, at::Tensor> combine_picks(at::Tensor &picks, c10::IntArrayRef exchange) {
    TORCH_CHECK(picks.dim() == 2 && picks.scalar_type() == at::kFloat && picks.is_contiguous() &&
                    picks.size(1) % kPickFields == 0,
                "tpserve::combine_picks: contiguous fp32 picks [K, 3 * world]");
    TORCH_CHECK(exchange.empty() || static_cast<int64_t>(exchange.size()) == kStackExchangeArgs,
                "tpserve::combine_picks: exchange is [] or ", kStackExchangeArgs, " integers");
    if (!exchange.empty()) StackReduce(exchange, "tpserve::combine_picks")(picks, std::nullopt);
    const int64_t rows = picks.size(0), world = picks.size(1) / kPickFields;
    at::Tensor tokens = at::empty({rows}, picks.options().dtype(at::kLong));
    at::Tensor logprobs = at::empty({rows}, picks.options());
    const float *p = picks.const_data_ptr<float>();
    int64_t *tok = tokens.mutable_data_ptr<int64_t>();
    float *lp = logprobs.mutable_data_ptr<float>();
    for (int64_t r = 0; r < rows; r++) {
        const float *all = p + r * kPickFields * world;
        int64_t win = 0;
        for (int64_t w = 1; w < world && !std::isnan(all[0 + kPickFields * win]); w++) {
            const float b = all[kPickFields * w];
            if (std::isnan(b) || b > all[kPickFields * win]) win = w;
        }
        const float top = all[kPickFields * win];
        tok[r] = static_cast<int64_t>(all[kPickFields * win + 2]);
        if (!std::isfinite(top)) {
            lp[r] = std::numeric_limits<float>::lowest();
        } else if (world == 1) {
            lp[r] = -logf(all[1]);  // greedy_logprob's expression
        } else {
            double total = 0.0;
            for (int64_t w = 0; w < world; w++) {
                const float b = all[kPickFields * w];
                if (std::isfinite(b)) total += std::exp(double(b) - top) * all[kPickFields * w + 1];
            }
            lp[r] = static_cast<float>(-std::log(total));
        }
    }
    return {tokens, logprobs};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tpserve, m) {
    m.def("shard_pick(Tensor h, Tensor? norm_w, float eps, Tensor lm_head_w, int valid, "
          "int start, int rank, int world) -> Tensor");
    m.def("combine_picks(Tensor(a!) picks, int[] exchange) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(tpserve, CPU, m) {
    m.impl("shard_pick", &shard_pick);
    m.impl("combine_picks", &combine_picks);
}
