// tpserve's opaque ops, registered with the torch dispatcher from C++ (see cpu_ops.py).
//
// Why C++ rather than torch.library.custom_op in Python: batch-1 decode calls these ~50 times
// a step (33 projections, 17 norms on the 8-layer bench model), and a Python-defined op costs
// 17-29 us of dispatch per call against ~4 us here, i.e. ~1 ms of a ~10 ms step.
//
// tpserve::matmul(x [M, I], weight [O, I]) -> x @ weight^T [M, O]: CPU projections (decode,
//   speculative verify, mixed batches; linear.py sends up to native_matmul_rows() rows). 16-bit
//   CPU weights go through gemm.c on its own thread pool (tpserve::set_matmul_threads); anything
//   else is ATen: at::mv for one row, at::linear for more.
// tpserve::set_matmul_threads(n) -> n: threads of gemm.c's pool, caller included, for the
//   process (the server sets it beside torch.set_num_threads); tpserve::matmul_threads() reads it.
// tpserve::pool_handle() -> address of a `void (*)(fn, ctx, chunks)` that runs fn(ctx, c) for
//   every chunk on that pool; handed to tpserve::paged_attention_use_pool.
// tpserve::mean_square(x) -> mean(x^2) over the last dim, keepdim: RMSNorm's reduction. For
//   contiguous CPU fp32 rows it is one pass here (8 fp64 partial sums in a fixed order, then
//   one rounding: within an ulp of the exact value), ~1 us for a 512-wide row where ATen's
//   pow + mean took ~20; elsewhere (and for large inputs on several threads) ATen's.
//   Inductor's own fused reduction would sum in yet another order: keeping it opaque keeps
//   compiled decode bit-equal to eager.
//
// Both are opaque to inductor, so compiled decode rounds exactly like eager (which calls the
// same ops). TPSERVE_NATIVE_GEMM=0 (read once, at load) keeps ATen for every projection.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/logsumexp.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/mv.h>
#include <ATen/ops/silu.h>
#include <ATen/Version.h>

#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <tuple>
#include <vector>

extern "C" {
#include "gemm.c"
#include "fused.c"
#include "argmax.c"
#include "silu_mul.c"
#include "logsumexp.c"
}

namespace {

bool native_enabled() {
    static const bool enabled = [] {
        const char *v = std::getenv("TPSERVE_NATIVE_GEMM");
        return LANES > 0 && !(v && std::strcmp(v, "0") == 0);
    }();
    return enabled;
}

bool native_fits(const at::Tensor &x, const at::Tensor &w) {
    auto dt = w.scalar_type();
    return native_enabled() && (dt == at::kBFloat16 || dt == at::kHalf) && x.scalar_type() == dt &&
           w.device().is_cpu() && x.device().is_cpu() && w.dim() == 2 && x.dim() == 2 &&
           x.size(1) == w.size(1) && w.stride(1) == 1 && x.stride(1) == 1;
}

at::Tensor matmul(const at::Tensor &x, const at::Tensor &weight) {
#if LANES
    if (native_fits(x, weight)) {
        const int64_t m = x.size(0), rows = weight.size(0), cols = weight.size(1);
        at::Tensor y = at::empty({m, rows}, weight.options());
        auto *w = static_cast<const uint16_t *>(weight.const_data_ptr());
        auto *xh = static_cast<const uint16_t *>(x.const_data_ptr());
        auto *out = static_cast<uint16_t *>(y.mutable_data_ptr());
        const int64_t ldw = std::max(weight.stride(0), cols), ldx = std::max(x.stride(0), cols);
        int32_t status = weight.scalar_type() == at::kBFloat16
                             ? gemm_bf16(w, ldw, xh, ldx, m, rows, cols, out, rows)
                             : gemm_f16(w, ldw, xh, ldx, m, rows, cols, out, rows);
        if (status != 0) throw std::bad_alloc();
        return y;
    }
#endif
    if (x.dim() == 2 && x.size(0) == 1) return at::mv(weight, x[0]).unsqueeze(0);
    return at::linear(x, weight);
}

// Rows up to which the loop runs on any thread count. It is single-threaded (at::parallel_for
// would need this library built with OpenMP, a second runtime beside torch's), so larger
// inputs (prefill) with several threads keep ATen's parallel pow + mean.
constexpr int64_t kLoopRowsAnyThreads = 64;

at::Tensor mean_square(const at::Tensor &x) {
    const bool loop = x.device().is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous() &&
                      x.dim() >= 1 && x.size(-1) > 0 &&
                      (x.numel() / x.size(-1) <= kLoopRowsAnyThreads || at::get_num_threads() == 1);
    if (!loop) return x.pow(2).mean(-1, /*keepdim=*/true);
    auto sizes = x.sizes().vec();
    const int64_t n = sizes.back();
    sizes.back() = 1;
    at::Tensor out = at::empty(sizes, x.options());
    const float *src = x.const_data_ptr<float>();
    float *dst = out.mutable_data_ptr<float>();
    const int64_t rows = out.numel();
    for (int64_t r = 0; r < rows; r++) dst[r] = fused_mean_square(src + r * n, n);  // fused.c
    return out;
}

// ---- fused pointwise steps (fused.c); the Python reference of each is in fused.py ----

int fused_dtype(const at::Tensor &t) {
    switch (t.scalar_type()) {
    case at::kFloat: return FUSED_F32;
    case at::kBFloat16: return FUSED_BF16;
    case at::kHalf: return FUSED_F16;
    default: TORCH_CHECK(false, "tpserve fused op: unsupported dtype ", t.scalar_type());
    }
}

// 2-D view of [..., n] rows with unit inner stride (x may have a row stride, e.g. a split).
at::Tensor rows_of(const at::Tensor &x, const char *what) {
    TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1 && x.stride(-1) == 1,
                "tpserve::", what, ": needs a CPU tensor with contiguous rows");
    return x.dim() == 2 ? x : x.reshape({-1, x.size(-1)});
}

void check_norm(const at::Tensor &x, const at::Tensor &weight) {
    TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(-1) &&
                    weight.scalar_type() == x.scalar_type(),
                "tpserve::rms_norm: weight must be a contiguous [", x.size(-1), "] of x's dtype");
}

at::Tensor rms_norm(const at::Tensor &x, const at::Tensor &weight, double eps) {
    check_norm(x, weight);
    at::Tensor xr = rows_of(x, "rms_norm");
    at::Tensor out = at::empty(x.sizes(), x.options());
    int32_t status = fused_rms_norm(xr.const_data_ptr(), xr.stride(0), nullptr, 0,
                                    weight.const_data_ptr(), nullptr, out.mutable_data_ptr(),
                                    xr.size(0), xr.size(1), static_cast<float>(eps),
                                    fused_dtype(x));
    if (status != 0) throw std::bad_alloc();
    return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor &x, const at::Tensor &delta,
                                                const at::Tensor &weight, double eps) {
    check_norm(x, weight);
    TORCH_CHECK(delta.sizes() == x.sizes() && delta.scalar_type() == x.scalar_type(),
                "tpserve::add_rms_norm: x and delta must match");
    at::Tensor xr = rows_of(x, "add_rms_norm"), dr = rows_of(delta, "add_rms_norm");
    at::Tensor sum = at::empty(x.sizes(), x.options()), out = at::empty(x.sizes(), x.options());
    int32_t status = fused_rms_norm(xr.const_data_ptr(), xr.stride(0), dr.const_data_ptr(),
                                    dr.stride(0), weight.const_data_ptr(), sum.mutable_data_ptr(),
                                    out.mutable_data_ptr(), xr.size(0), xr.size(1),
                                    static_cast<float>(eps), fused_dtype(x));
    if (status != 0) throw std::bad_alloc();
    return {sum, out};
}

std::tuple<at::Tensor, at::Tensor> rotary_qk(const at::Tensor &qkv, const at::Tensor &cos,
                                             const at::Tensor &sin, int64_t q_heads,
                                             int64_t kv_heads, int64_t head_dim) {
    TORCH_CHECK(qkv.dim() == 2 && qkv.device().is_cpu() && qkv.stride(1) == 1 &&
                    qkv.size(1) >= (q_heads + kv_heads) * head_dim && head_dim % 2 == 0,
                "tpserve::rotary_qk: qkv must be CPU [tokens, >= (q + kv heads) * head_dim]");
    const int64_t n = qkv.size(0);
    TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(0) == n && cos.size(-1) == head_dim &&
                    cos.numel() == n * head_dim && cos.stride(-1) == 1 && sin.stride(-1) == 1 &&
                    cos.stride(0) == sin.stride(0) && cos.scalar_type() == qkv.scalar_type() &&
                    sin.scalar_type() == qkv.scalar_type(),
                "tpserve::rotary_qk: cos/sin must be one contiguous head_dim row per token");
    at::Tensor q = at::empty({n, q_heads, head_dim}, qkv.options());
    at::Tensor k = at::empty({n, kv_heads, head_dim}, qkv.options());
    fused_rotary(qkv.const_data_ptr(), qkv.stride(0), cos.const_data_ptr(), sin.const_data_ptr(),
                 cos.stride(0), q.mutable_data_ptr(), k.mutable_data_ptr(), n, q_heads, kv_heads,
                 head_dim, fused_dtype(qkv));
    return {q, k};
}

// rotary.py's at(): rows `positions` of the fp32 cos and sin tables, cast to `dtype`, as
// [N, 1, D] each. ATen's index + unsqueeze + cast is four dispatched ops (~18 us a table on
// the 2-core VM, paid by every forward and every draft depth); here it is one pass. The cast
// is c10's (round to nearest even), so the bits are ATen's.
template <typename T>
void gather_cast(const float *table, int64_t table_rows, int64_t dim, const int64_t *pos,
                 int64_t n, T *out) {
    for (int64_t i = 0; i < n; i++) {
        int64_t p = pos[i] < 0 ? pos[i] + table_rows : pos[i];  // ATen's negative indexing
        TORCH_CHECK(p >= 0 && p < table_rows, "tpserve::rotary_rows: position ", pos[i],
                    " is outside the rotary table (", table_rows, " positions)");
        const float *row = table + p * dim;
        for (int64_t j = 0; j < dim; j++) out[i * dim + j] = static_cast<T>(row[j]);
    }
}

at::Tensor rotary_table_rows(const at::Tensor &table, const at::Tensor &positions,
                             at::ScalarType dtype) {
    const int64_t n = positions.size(0), dim = table.size(1);
    at::Tensor out = at::empty({n, 1, dim}, table.options().dtype(dtype));
    const float *t = table.const_data_ptr<float>();
    const int64_t *pos = positions.const_data_ptr<int64_t>();
    switch (dtype) {
    case at::kFloat: gather_cast(t, table.size(0), dim, pos, n, out.mutable_data_ptr<float>()); break;
    case at::kBFloat16:
        gather_cast(t, table.size(0), dim, pos, n, out.mutable_data_ptr<c10::BFloat16>());
        break;
    case at::kHalf: gather_cast(t, table.size(0), dim, pos, n, out.mutable_data_ptr<c10::Half>()); break;
    default: TORCH_CHECK(false, "tpserve::rotary_rows: unsupported dtype ", dtype);
    }
    return out;
}

std::tuple<at::Tensor, at::Tensor> rotary_gather(const at::Tensor &cos_table,
                                               const at::Tensor &sin_table,
                                               const at::Tensor &positions, at::ScalarType dtype) {
    TORCH_CHECK(cos_table.dim() == 2 && cos_table.sizes() == sin_table.sizes() &&
                    cos_table.scalar_type() == at::kFloat && sin_table.scalar_type() == at::kFloat &&
                    cos_table.is_contiguous() && sin_table.is_contiguous() &&
                    cos_table.device().is_cpu() && sin_table.device().is_cpu(),
                "tpserve::rotary_rows: contiguous fp32 CPU cos and sin tables of one shape");
    TORCH_CHECK(positions.dim() == 1 && positions.device().is_cpu(),
                "tpserve::rotary_rows: positions must be a 1-D CPU tensor");
    const at::Tensor pos = positions.to(at::kLong).contiguous();
    return {rotary_table_rows(cos_table, pos, dtype), rotary_table_rows(sin_table, pos, dtype)};
}

// tpserve::embed_rotary: a decode step's inputs to the native layer stack in one call: rows
// `ids` of the embedding table (copied, as F.embedding's are) and rotary_rows of `positions`
// in the table's dtype. F.embedding alone cost ~30 us a batch-1 step on caches the step's
// weight stream had just emptied, and the rotary rows another dispatch (~15-20 us).
std::tuple<at::Tensor, at::Tensor, at::Tensor> embed_rotary(const at::Tensor &ids,
                                                            const at::Tensor &table,
                                                            const at::Tensor &cos_table,
                                                            const at::Tensor &sin_table,
                                                            const at::Tensor &positions) {
    TORCH_CHECK(table.dim() == 2 && table.is_contiguous() && table.device().is_cpu(),
                "tpserve::embed_rotary: a contiguous 2-D CPU embedding table");
    TORCH_CHECK(ids.dim() == 1 && ids.device().is_cpu() && ids.scalar_type() == at::kLong,
                "tpserve::embed_rotary: ids must be a 1-D CPU int64 tensor");
    const at::Tensor tokens = ids.contiguous();
    const int64_t n = tokens.size(0), rows = table.size(0);
    const int64_t row_bytes = table.size(1) * static_cast<int64_t>(table.element_size());
    at::Tensor x = at::empty({n, table.size(1)}, table.options());
    const char *src = static_cast<const char *>(table.const_data_ptr());
    char *dst = static_cast<char *>(x.mutable_data_ptr());
    const int64_t *tok = tokens.const_data_ptr<int64_t>();
    for (int64_t i = 0; i < n; i++) {
        TORCH_CHECK(tok[i] >= 0 && tok[i] < rows, "tpserve::embed_rotary: token id ", tok[i],
                    " is outside the embedding table (", rows, " rows)");
        std::memcpy(dst + i * row_bytes, src + tok[i] * row_bytes, static_cast<size_t>(row_bytes));
    }
    auto [cos, sin] = rotary_gather(cos_table, sin_table, positions, table.scalar_type());
    return {x, cos, sin};
}

// tpserve::silu_mul_native(x): whether silu_mul takes silu_mul.c's loop for x, i.e. whether
// that loop computes what ATen would: bf16, the vector width of ATen's runtime CPU
// capability, and a loop ATen runs on one thread (TensorIterator splits only from its
// 32768-element grain, and only with several intra-op threads). The tests check the loop is
// taken where it should be, not only that the bits match (ATen's would too).
bool silu_mul_native(const at::Tensor &x) {
    if (x.dim() < 1 || x.size(-1) % 2 != 0 || x.numel() == 0 ||
        x.scalar_type() != at::kBFloat16 || !x.is_contiguous() || !x.device().is_cpu())
        return false;
    if (x.numel() / 2 >= 32768 && at::get_num_threads() > 1) return false;
    // Fixed for the process (ATEN_CPU_CAPABILITY is read once, at ATen's start).
    static const int aten_lanes = [] {
        const std::string cap = at::get_cpu_capability();
        return cap == "AVX512" ? 16 : cap == "AVX2" ? 8 : -1;
    }();
    return silu_mul_lanes() == aten_lanes;
}

// silu(gate) * up: silu_mul.c where it gives ATen's bits (one pass, Sleef's exp as ATen calls
// it), else ATen's own silu and mul; from here either way, so a decode step pays one
// dispatch from Python instead of three.
at::Tensor silu_mul(const at::Tensor &x) {
    TORCH_CHECK(x.dim() >= 1 && x.size(-1) % 2 == 0,
                "tpserve::silu_mul: last dim must hold gate and up halves");
    const int64_t inter = x.size(-1) / 2;
    if (silu_mul_native(x)) {
        std::vector<int64_t> sizes = x.sizes().vec();
        sizes.back() = inter;
        at::Tensor out = at::empty(sizes, x.options());
        silu_mul_bf16(static_cast<const uint16_t *>(x.data_ptr()), x.numel() / (2 * inter),
                      inter, static_cast<uint16_t *>(out.data_ptr()));
        return out;
    }
    return at::silu(x.narrow(-1, 0, inter)).mul_(x.narrow(-1, inter, inter));
}

// The sampler's ops below take contiguous fp32 logits [rows, vocab].
void check_logit_rows(const at::Tensor &logits, const char *op) {
    TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous() &&
                    logits.size(1) > 0,
                "tpserve::", op, ": logits must be a contiguous fp32 [rows, vocab]");
}

// log-sum-exp of each row of contiguous fp32 logits [rows, vocab]: the maximum plus
// logsumexp.c's shifted sum (ATen's exp leaves its fast path on widely spread logits; see
// there). Rows whose maximum is not finite (+-inf, NaN) take ATen's value, with its rules.
at::Tensor logsumexp_rows(const at::Tensor &logits) {
    check_logit_rows(logits, "logsumexp");
    const int64_t rows = logits.size(0), vocab = logits.size(1);
    at::Tensor lse = at::empty({rows}, logits.options());
    const float *x = logits.const_data_ptr<float>();
    float *out = lse.mutable_data_ptr<float>();
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * vocab;
        const float top = row[argmax_first(row, vocab)];
        out[r] = std::isfinite(top) ? top + log_sum_exp_shifted(row, vocab, top)
                                    : at::logsumexp(logits[r], {-1}).item<float>();
    }
    return lse;
}

// softmax of each row of contiguous fp32 logits [rows, vocab] (the sampler's distribution),
// through logsumexp.c for the same reason; rows whose maximum is not finite take ATen's.
at::Tensor softmax_rows(const at::Tensor &logits) {
    check_logit_rows(logits, "softmax");
    const int64_t rows = logits.size(0), vocab = logits.size(1);
    at::Tensor probs = at::empty(logits.sizes(), logits.options());
    const float *x = logits.const_data_ptr<float>();
    float *out = probs.mutable_data_ptr<float>();
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * vocab;
        const float top = row[argmax_first(row, vocab)];
        if (std::isfinite(top))
            softmax_shifted(row, vocab, top, out + r * vocab);
        else
            probs[r].copy_(at::softmax(logits[r], -1));
    }
    return probs;
}

// Greedy rows' token and log-probability: argmax (the first maximum; a NaN counts as the
// maximum, as torch.argmax) and logit - logsumexp, i.e. minus logsumexp.c's shifted sum,
// pushed finite as fused.finite_logprobs (a row whose maximum is not finite gets the most
// negative float, as the torch expression's NaN does). One call instead of ~10 small ops.
std::tuple<at::Tensor, at::Tensor> greedy_logprob(const at::Tensor &logits) {
    check_logit_rows(logits, "greedy_logprob");
    const int64_t rows = logits.size(0), vocab = logits.size(1);
    at::Tensor tokens = at::empty({rows}, logits.options().dtype(at::kLong));
    at::Tensor logprobs = at::empty({rows}, logits.options());
    const float *x = logits.const_data_ptr<float>();
    int64_t *tok = tokens.mutable_data_ptr<int64_t>();
    float *lp = logprobs.mutable_data_ptr<float>();
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * vocab;
        const int64_t best = argmax_first(row, vocab);
        tok[r] = best;
        lp[r] = std::isfinite(row[best]) ? -log_sum_exp_shifted(row, vocab, row[best])
                                         : std::numeric_limits<float>::lowest();
    }
    return {tokens, logprobs};
}

// A filtered row's draw (top-k, top-p, min-p over its tempered weights, in sampler.py's
// order and with its rules: top-k keeps the k best by weight, ties to the lower index;
// top-p the shortest best-first prefix whose mass, among the top-k survivors, reaches p;
// min-p those at least p times the best), without sorting the vocabulary. Top-k and top-p
// both keep a best-first prefix, so what survives is every token better than the prefix's
// last one, less those under min-p. With top-k the k best come from one pass against a heap
// of them (top-p then cuts that list); with top-p alone a histogram over weight buckets (an
// eighth of an octave each, best first) says in which bucket the prefix ends, and only that
// bucket's tokens are ranked. Then one draw with u over the survivors in token order, as
// fused.inverse_cdf walks target_probs. `w`: tempered_weights (the best is 1), `total`
// their sum.
//
// Why: the general path sorts the whole row (torch.sort and ~15 more ops): 3 ms a row at a
// 32000-token vocabulary and 15 ms at 128256 on one thread, for every request that sends a
// top_p (most OpenAI clients do).
class FilteredDraw {
  public:
    int64_t operator()(const float *w, int64_t n, double total, int64_t top_k, double top_p,
                       double min_p, double u) {
        // The best-first prefix top-k and top-p keep: its last token (a tie to it goes by
        // index), or, where it ends at a bucket boundary, every token in a bucket before `cut`.
        int cut = kBuckets;
        int64_t take = 0;
        double prefix = total;  // the prefix's weight, where it is all that min-p leaves
        if (top_k > 0 && top_k < n) {
            best_k(w, n, top_k);  // ranked_: the k best, best first
            if (ranked_.empty()) return -1;
            take = static_cast<int64_t>(ranked_.size());
            if (top_p < 1.0) {  // measured among the top-k survivors
                double denom = 0.0;
                for (const auto &c : ranked_) denom += c.first;
                take = prefix_until(top_p * denom, 0.0, 0, take);
            }
            return draw_ranked(take, static_cast<float>(min_p), u);
        } else if (top_p < 1.0) {
            histogram(w, n);
            // First token j > 0 whose mass before it reaches top_p: it and all after go.
            const double limit = top_p * total;
            double before = 0.0;
            bool kept = false;  // any token before bucket b
            for (int b = 0; b < kBuckets; b++) {
                if (before + mass_[b] < limit || !(mass_[b] > 0.0)) {
                    before += mass_[b];
                    kept = kept || mass_[b] > 0.0;
                    continue;
                }
                if (kept && before >= limit) {  // ends before this bucket
                    cut = b;
                    break;
                }
                rank_bucket(w, n, b);
                cut = b;
                take = prefix_until(limit, before, kept ? 1 : 0,
                                    static_cast<int64_t>(ranked_.size()));
                for (int64_t j = 0; j < take; j++) before += ranked_[j].first;
                break;
            }
            prefix = before;
        }
        // What survives, as weight comparisons: better than the prefix's last token (a tie
        // to it by index), or in a bucket before `cut`; and at least min_p (the best is 1).
        const bool partial = cut < kBuckets && take > 0;
        const std::pair<float, int64_t> last = partial ? ranked_[take - 1]
                                                       : std::pair<float, int64_t>{0.0f, -1};
        const float edge = partial ? last.first
                           : cut >= kBuckets ? 0.0f
                           : cut > 0 ? lower_edge(cut - 1)
                                     : 2.0f;  // nothing before bucket 0: nothing kept
        const float low = std::max(edge, static_cast<float>(min_p));
        const auto keeps = [&](int64_t i) {
            const float x = w[i];
            return x > 0.0f && x >= low &&
                   (!partial || x > last.first || i <= last.second);
        };
        double kept = prefix;
        if (low > edge) {  // min-p drops some of the prefix: weigh what is left
            kept = 0.0;
            for (int64_t i = 0; i < n; i++)
                if (keeps(i)) kept += w[i];
        }
        if (!(kept > 0.0)) return -1;
        // The walk adds 0 for a dropped token rather than branching on it (which tokens
        // survive is unpredictable), so the running total passes the target only on a kept one.
        const double target = u * kept;
        double before = 0.0;
        int64_t last_kept = -1;
        for (int64_t i = 0; i < n; i++) {
            const bool k = keeps(i);
            before += k ? w[i] : 0.0f;
            last_kept = k ? i : last_kept;
            if (before > target) return i;
        }
        return last_kept;
    }

  private:
    static constexpr int kBuckets = 1024;

    // ranked_ best first (weight, then the lower index): better(a, b).
    static bool better(const std::pair<float, int64_t> &a, const std::pair<float, int64_t> &b) {
        return a.first > b.first || (a.first == b.first && a.second < b.second);
    }

    // The k best tokens of w (weight > 0), best first, into ranked_: one pass against the
    // worst so far (a heap of k), which few tokens beat; then k log k to order them.
    void best_k(const float *w, int64_t n, int64_t k) {
        ranked_.clear();
        for (int64_t i = 0; i < n; i++) {
            const float x = w[i];
            if (!(x > 0.0f)) continue;
            if (static_cast<int64_t>(ranked_.size()) < k) {
                ranked_.push_back({x, i});
                std::push_heap(ranked_.begin(), ranked_.end(), better);
            } else if (x > ranked_.front().first) {  // a tie loses: its index is higher
                std::pop_heap(ranked_.begin(), ranked_.end(), better);
                ranked_.back() = {x, i};
                std::push_heap(ranked_.begin(), ranked_.end(), better);
            }
        }
        std::sort(ranked_.begin(), ranked_.end(), better);
    }

    // A draw with u over ranked_'s first `take` tokens at least `floor` (min-p), in token
    // order: the top-k survivors are all in ranked_, so no pass over the vocabulary.
    int64_t draw_ranked(int64_t take, float floor, double u) {
        ranked_.resize(take);
        ranked_.erase(std::remove_if(ranked_.begin(), ranked_.end(),
                                     [floor](const std::pair<float, int64_t> &c) {
                                         return c.first < floor;
                                     }),
                      ranked_.end());
        std::sort(ranked_.begin(), ranked_.end(),
                  [](const std::pair<float, int64_t> &a, const std::pair<float, int64_t> &b) {
                      return a.second < b.second;
                  });
        double kept = 0.0;
        for (const auto &c : ranked_) kept += c.first;
        const double target = u * kept;
        double before = 0.0;
        for (const auto &c : ranked_) {
            before += c.first;
            if (before > target) return c.second;
        }
        return ranked_.empty() ? -1 : ranked_.back().second;
    }

    // How many of ranked_'s first `room` tokens top-p keeps after `kept` better ones of mass
    // `before`: up to the first whose mass before it reaches `limit` (the very first always).
    int64_t prefix_until(double limit, double before, int64_t kept, int64_t room) const {
        int64_t j = 0;
        for (; j < room; j++) {
            if (kept + j > 0 && before >= limit) break;
            before += ranked_[j].first;
        }
        return j;
    }

    // Weight per bucket, in two interleaved halves summed at the end: neighbouring tokens
    // often share a bucket, and one table made every update wait for the last one's store.
    // No branch on zero weights (masked tokens, unpredictable): they land in the last bucket,
    // adding nothing. A bucket holds tokens exactly where its weight is above 0.
    void histogram(const float *w, int64_t n) {
        double mass[2][kBuckets] = {};
        int64_t i = 0;
        for (; i + 1 < n; i += 2) {
            mass[0][bucket(w[i])] += w[i];
            mass[1][bucket(w[i + 1])] += w[i + 1];
        }
        if (i < n) mass[0][bucket(w[i])] += w[i];
        for (int b = 0; b < kBuckets; b++) mass_[b] = mass[0][b] + mass[1][b];
    }

    // The smallest weight in bucket b (its octave's exponent, its three mantissa bits).
    static float lower_edge(int b) {
        const uint32_t bits = (static_cast<uint32_t>(127 - b / 8) << 23) |
                              (static_cast<uint32_t>(7 - b % 8) << 20);
        float x;
        std::memcpy(&x, &bits, sizeof x);
        return x;
    }

    // A weight in (0, 1]'s bucket, best first: 8 per octave by the top three mantissa bits.
    static int bucket(float x) {
        uint32_t bits;
        std::memcpy(&bits, &x, sizeof bits);
        const int exponent = static_cast<int>((bits >> 23) & 0xff);
        const int octave = std::min(127, std::max(0, 127 - exponent));
        return octave * 8 + (7 - static_cast<int>((bits >> 20) & 7));
    }

    // Bucket b's tokens, best first (weight, then the lower index), into ranked_.
    void rank_bucket(const float *w, int64_t n, int b) {
        ranked_.clear();
        const float low = lower_edge(b), high = b > 0 ? lower_edge(b - 1) : 2.0f;
        for (int64_t i = 0; i < n; i++)
            if (w[i] >= low && w[i] < high) ranked_.push_back({w[i], i});
        std::sort(ranked_.begin(), ranked_.end(), better);
    }

    double mass_[kBuckets];
    std::vector<std::pair<float, int64_t>> ranked_;
};

// Sampled rows: each row's draw from softmax(logits * inv_temps[r]) (logsumexp.c's
// tempered_weights), filtered by top_k / top_p / min_p where a row asks (FilteredDraw, else
// the whole distribution: draw_weights), with the uniform uniforms[r]; and its
// log-probability under the model's own distribution, logit - logsumexp (what greedy_logprob
// and the sampler's general path report). One call instead of ~15 small ops, torch.sort and
// torch.multinomial. A row that cannot be drawn this way (a maximum that is not finite, a
// non-finite or non-positive inverse temperature) gets token -1: the sampler takes its
// general path for the batch.
std::tuple<at::Tensor, at::Tensor> sample_rows(const at::Tensor &logits,
                                               const at::Tensor &inv_temps,
                                               const at::Tensor &top_k, const at::Tensor &top_p,
                                               const at::Tensor &min_p,
                                               const at::Tensor &uniforms) {
    check_logit_rows(logits, "sample_rows");
    const int64_t rows = logits.size(0), vocab = logits.size(1);
    const auto one_each = [rows](const at::Tensor &t, at::ScalarType type) {
        return t.scalar_type() == type && t.is_contiguous() && t.numel() == rows;
    };
    TORCH_CHECK(one_each(inv_temps, at::kFloat) && one_each(top_k, at::kLong) &&
                    one_each(top_p, at::kDouble) && one_each(min_p, at::kDouble) &&
                    one_each(uniforms, at::kDouble),
                "tpserve::sample_rows: one per row: fp32 inv_temps, int64 top_k, float64 "
                "top_p, min_p and uniforms");
    at::Tensor tokens = at::empty({rows}, logits.options().dtype(at::kLong));
    at::Tensor logprobs = at::empty({rows}, logits.options());
    std::vector<float> weights(vocab);
    std::vector<double> sums(draw_blocks(vocab));
    FilteredDraw filtered;
    const float *x = logits.const_data_ptr<float>(), *inv = inv_temps.const_data_ptr<float>();
    const int64_t *k = top_k.const_data_ptr<int64_t>();
    const double *p = top_p.const_data_ptr<double>(), *m = min_p.const_data_ptr<double>();
    const double *u = uniforms.const_data_ptr<double>();
    int64_t *tok = tokens.mutable_data_ptr<int64_t>();
    float *lp = logprobs.mutable_data_ptr<float>();
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * vocab;
        const float top = row[argmax_first(row, vocab)];
        const double total = std::isfinite(top) ? tempered_weights(row, vocab, top, inv[r],
                                                                   weights.data(), sums.data())
                                                : -1.0;
        int64_t pick = -1;
        if (total > 0.0)
            pick = k[r] > 0 || p[r] < 1.0 || m[r] > 0.0
                       ? filtered(weights.data(), vocab, total, k[r], p[r], m[r], u[r])
                       : draw_weights(weights.data(), vocab, sums.data(), total, u[r]);
        tok[r] = pick;
        lp[r] = pick < 0 ? std::numeric_limits<float>::lowest()
                         : row[pick] - (top + log_sum_exp_shifted(row, vocab, top));
    }
    return {tokens, logprobs};
}

// Copy KV entries slot-wise in every layer of each pool [layers, slots, ...] (the accepted
// speculative nodes compacted onto consecutive slots). Every source of a layer is read before
// any destination is written: a compacted path shifts its nodes down onto each other's
// slots. One call instead of two index tensors and a gather + scatter per pool (~50 us of
// dispatch and allocation a speculative step on the critical path of the drafting rank).
void move_slots(at::TensorList pools, at::IntArrayRef src, at::IntArrayRef dst) {
    TORCH_CHECK(src.size() == dst.size(), "move_slots: ", src.size(), " sources for ",
                dst.size(), " destinations");
    const int64_t n = static_cast<int64_t>(src.size());
    if (n == 0) return;
    std::vector<char> staged;
    for (const at::Tensor &pool : pools) {
        TORCH_CHECK(pool.device().is_cpu() && pool.is_contiguous() && pool.dim() >= 2,
                    "move_slots: pools must be contiguous CPU tensors [layers, slots, ...]");
        const int64_t slots = pool.size(1);
        for (int64_t i = 0; i < n; i++)
            TORCH_CHECK(src[i] >= 0 && src[i] < slots && dst[i] >= 0 && dst[i] < slots,
                        "move_slots: slot out of range (", src[i], " -> ", dst[i], " of ",
                        slots, ")");
        const int64_t row = pool.stride(1) * pool.element_size();
        const int64_t layer_bytes = pool.stride(0) * pool.element_size();
        staged.resize(static_cast<size_t>(n * row));
        char *base = static_cast<char *>(pool.data_ptr());
        for (int64_t l = 0; l < pool.size(0); l++) {
            char *layer = base + l * layer_bytes;
            for (int64_t i = 0; i < n; i++)
                std::memcpy(staged.data() + i * row, layer + src[i] * row, row);
            for (int64_t i = 0; i < n; i++)
                std::memcpy(layer + dst[i] * row, staged.data() + i * row, row);
        }
    }
}

int64_t gemm_vector_lanes() { return native_enabled() ? LANES : 0; }

int64_t set_matmul_threads(int64_t threads) {
    return gemm_set_threads(static_cast<int32_t>(std::clamp<int64_t>(threads, 1, POOL_MAX_THREADS)));
}

int64_t matmul_threads() { return gemm_threads(); }

int64_t set_matmul_readahead(bool on) { return gemm_set_ends(on ? 1 : 0); }

// The pool's entry point as an integer, for the paged-attention library (a separate .so): its
// work items then run on these threads too, so a decode step never waits at an OpenMP
// fork-join barrier for a thread the OS has not scheduled (see cpu_native.py).
void run_on_pool(pool_chunk_fn fn, void *ctx, int64_t chunks) { pool_run(fn, ctx, chunks); }

int64_t pool_handle() { return reinterpret_cast<int64_t>(&run_on_pool); }

}  // namespace

TORCH_LIBRARY(tpserve, m) {
    m.def("matmul(Tensor x, Tensor weight) -> Tensor");
    m.def("mean_square(Tensor x) -> Tensor");
    m.def("gemm_lanes() -> int", &gemm_vector_lanes);
    m.def("set_matmul_threads(int threads) -> int", &set_matmul_threads);
    m.def("matmul_threads() -> int", &matmul_threads);
    m.def("set_matmul_readahead(bool on) -> int", &set_matmul_readahead);
    m.def("pool_handle() -> int", &pool_handle);
    m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
    m.def("add_rms_norm(Tensor x, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)");
    m.def("rotary_qk(Tensor qkv, Tensor cos, Tensor sin, int q_heads, int kv_heads, "
          "int head_dim) -> (Tensor, Tensor)");
    m.def("silu_mul(Tensor x) -> Tensor");
    m.def("silu_mul_native(Tensor x) -> bool", &silu_mul_native);
    m.def("rotary_rows(Tensor cos_table, Tensor sin_table, Tensor positions, ScalarType dtype) "
          "-> (Tensor, Tensor)");
    m.def("embed_rotary(Tensor ids, Tensor table, Tensor cos_table, Tensor sin_table, "
          "Tensor positions) -> (Tensor, Tensor, Tensor)");
    m.def("greedy_logprob(Tensor logits) -> (Tensor, Tensor)");
    m.def("logsumexp(Tensor logits) -> Tensor");
    m.def("softmax(Tensor logits) -> Tensor");
    m.def("sample_rows(Tensor logits, Tensor inv_temps, Tensor top_k, Tensor top_p, "
          "Tensor min_p, Tensor uniforms) -> (Tensor, Tensor)");
    m.def("move_slots(Tensor(a!)[] pools, int[] src, int[] dst) -> ()");
}

TORCH_LIBRARY_IMPL(tpserve, CompositeExplicitAutograd, m) {
    m.impl("matmul", &matmul);
    m.impl("mean_square", &mean_square);
}

// CPU only: other devices call the Python references in fused.py.
TORCH_LIBRARY_IMPL(tpserve, CPU, m) {
    m.impl("rms_norm", &rms_norm);
    m.impl("add_rms_norm", &add_rms_norm);
    m.impl("rotary_qk", &rotary_qk);
    m.impl("silu_mul", &silu_mul);
    m.impl("rotary_rows", &rotary_gather);
    m.impl("embed_rotary", &embed_rotary);
    m.impl("greedy_logprob", &greedy_logprob);
    m.impl("logsumexp", &logsumexp_rows);
    m.impl("softmax", &softmax_rows);
    m.impl("sample_rows", &sample_rows);
    m.impl("move_slots", &move_slots);
}

// The decoder layer as one op per half (after the ops it calls are defined and registered).
#include "decoder_stack.cpp"
// The EAGLE-3 draft's tree loop as one op (uses the layer halves above).
#include "draft_tree.cpp"
// Greedy picks in each rank's vocabulary shard (uses decoder_stack.cpp's exchange).
#include "vocab_pick.cpp"
