// The Llama-family decoder layer as one call per layer half (or one call for the whole stack),
// for CPU steps of a few tokens (decode, speculative verify, small mixed steps).
//
// Why: a batch-1 decode step of the 8-layer bench model spends ~2.2 ms streaming weights and,
// with every layer in Python, ~1.2 ms more dispatching ~14 ops a layer from Python (module
// calls, argument parsing, the dispatcher). Here the same ops run from C++: the same kernels in
// the same order with the same roundings (norms, projections, rotary, paged attention, SiLU,
// residual adds), so the outputs are bit-equal to the Python layer (tests/test_decoder_stack.py).
//
// Ops (fused_decoder.py is the Python side and says when they apply):
// tpserve::decoder_attn_block(x, delta?, norm?, ...) -> (x', o): x' = x + delta (x when none:
//   the residual add the previous layer's MLP left), o = o_proj(attention(rotary(qkv_proj(
//   rms_norm(x'))))) -- this rank's partial sum, which a tensor-parallel caller reduces.
//   Without a norm weight qkv_proj reads x' as it is (the EAGLE-3 draft's normed concat).
// tpserve::decoder_mlp_block(x, delta, ...) -> (x', m): x' = x + delta (delta = the reduced
//   attention output), m = down(silu(gate) * up)(rms_norm(x')), partial like o.
// tpserve::decoder_layers(x, weights, caches, ..., exchange, aux_at) -> [x after every layer,
//   then the input of each layer in `aux_at` (the EAGLE-3 draft's auxiliary states; the
//   layer count for the output itself)]: one call a step instead of two a layer; with
//   `exchange` (a tensor-parallel rank on `shm`) the allreduces between the halves run inside
//   it, through the backend's compiled exchange.
// tpserve::decoder_head(x, norm_w, eps, lm_head_w) -> (rms_norm(x), fp32 logits): the final norm
//   and a single rank's lm_head after decoder_layers, as the Python model's norm, linear() and
//   .float() round them. A batch-1 decode step spent ~0.2 ms of Python around that matmul
//   (modules, the gather a one-rank vocabulary does not need, the row pick), most of it on
//   caches the weight stream had just emptied.
//
// Attention is tpserve::paged_attention (cpu_attention.cpp, a separate library), called through
// the dispatcher; the rest are this library's own functions (cpu_ops.cpp includes this file).

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/add.h>
#include <chrono>

namespace {

// Per-step attention inputs shared by every layer (see cpu_backend.py's forward).
struct StepAttention {
    const at::Tensor &cos, &sin, &page_table, &q_indptr, &kv_lens, &write_slots;
    const std::optional<at::Tensor> &mask_start, &custom_mask;
    int64_t page_size, window;
    double scale;
    int64_t q_heads, kv_heads, head_dim;
    bool narrow;  // tpserve::paged_attention_narrow (cpu_native.py: 16-wide heads on AVX-512)
};

at::Tensor paged_attention_call(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
                                at::Tensor &k_cache, at::Tensor &v_cache, const StepAttention &s) {
    using Fn = at::Tensor(const at::Tensor &, const at::Tensor &, const at::Tensor &,
                          at::Tensor &, at::Tensor &, const at::Tensor &, const at::Tensor &,
                          const at::Tensor &, const at::Tensor &,
                          const std::optional<at::Tensor> &, const std::optional<at::Tensor> &,
                          int64_t, int64_t, double);
    // Looked up at the first call: the attention libraries load after this one (and the
    // narrow one only exists on AVX-512 machines, so it is looked up only when asked for).
    auto lookup = [](const char *name) {
        return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
    };
    static const auto wide = lookup("tpserve::paged_attention");
    const auto *op = &wide;
    if (s.narrow) {
        static const auto narrow = lookup("tpserve::paged_attention_narrow");
        op = &narrow;
    }
    return op->call(q, k, v, k_cache, v_cache, s.page_table, s.q_indptr, s.kv_lens,
                    s.write_slots, s.mask_start, s.custom_mask, s.page_size, s.window, s.scale);
}

// linear.py's linear() for the rows it sends to tpserve::matmul: y = x W^T, then `y + bias`.
at::Tensor project(const at::Tensor &x, const at::Tensor &weight,
                   const std::optional<at::Tensor> &bias) {
    at::Tensor y = matmul(x, weight);
    return bias.has_value() ? at::add(y, *bias) : y;
}

std::tuple<at::Tensor, at::Tensor> attn_block(const at::Tensor &x_in,
                                              const std::optional<at::Tensor> &delta,
                                              const std::optional<at::Tensor> &norm_w,
                                              const at::Tensor &qkv_w,
                                              const std::optional<at::Tensor> &qkv_b,
                                              const at::Tensor &o_w,
                                              const std::optional<at::Tensor> &o_b,
                                              at::Tensor &k_cache, at::Tensor &v_cache,
                                              const StepAttention &s, double eps) {
    // llama.py's DecoderLayer: the previous layer ended with `x + mlp(h)` (an ATen add), then
    // this one norms it: one pass of add_rms_norm (the same bits; one ATen add fewer a layer).
    at::Tensor x = x_in, h;
    if (delta.has_value() && norm_w.has_value()) {
        std::tie(x, h) = add_rms_norm(x_in, *delta, *norm_w, eps);
    } else {
        x = delta.has_value() ? at::add(x_in, *delta) : x_in;
        // No norm: the caller normed its input already (the EAGLE-3 draft's concatenation).
        h = norm_w.has_value() ? rms_norm(x, *norm_w, eps) : x;
    }
    at::Tensor qkv = project(h, qkv_w, qkv_b);
    const int64_t n = qkv.size(0), d = s.head_dim;
    at::Tensor v = qkv.narrow(1, (s.q_heads + s.kv_heads) * d, s.kv_heads * d)
                       .view({n, s.kv_heads, d});
    auto [q, k] = rotary_qk(qkv, s.cos, s.sin, s.q_heads, s.kv_heads, d);
    at::Tensor attn = paged_attention_call(q, k, v, k_cache, v_cache, s);
    return {x, project(attn, o_w, o_b)};
}

std::tuple<at::Tensor, at::Tensor> mlp_block(const at::Tensor &x, const at::Tensor &delta,
                                             const at::Tensor &norm_w, const at::Tensor &gate_up_w,
                                             const std::optional<at::Tensor> &gate_up_b,
                                             const at::Tensor &down_w,
                                             const std::optional<at::Tensor> &down_b, double eps) {
    auto [sum, h] = add_rms_norm(x, delta, norm_w, eps);
    return {sum, project(silu_mul(project(h, gate_up_w, gate_up_b)), down_w, down_b)};
}

std::tuple<at::Tensor, at::Tensor> decoder_attn_block(
    const at::Tensor &x, const std::optional<at::Tensor> &delta,
    const std::optional<at::Tensor> &norm_w,
    const at::Tensor &qkv_w, const std::optional<at::Tensor> &qkv_b, const at::Tensor &o_w,
    const std::optional<at::Tensor> &o_b, const at::Tensor &cos, const at::Tensor &sin,
    at::Tensor &k_cache, at::Tensor &v_cache, const at::Tensor &page_table,
    const at::Tensor &q_indptr, const at::Tensor &kv_lens, const at::Tensor &write_slots,
    const std::optional<at::Tensor> &mask_start, const std::optional<at::Tensor> &custom_mask,
    int64_t page_size, int64_t window, double scale, int64_t q_heads, int64_t kv_heads,
    int64_t head_dim, double eps, bool narrow) {
    const StepAttention s{cos,         sin,         page_table, q_indptr, kv_lens, write_slots,
                          mask_start,  custom_mask, page_size,  window,   scale,   q_heads,
                          kv_heads,    head_dim,    narrow};
    return attn_block(x, delta, norm_w, qkv_w, qkv_b, o_w, o_b, k_cache, v_cache, s, eps);
}

// Per layer, in this order (fused_decoder.py builds the list): input norm, qkv weight, qkv
// bias, o weight, o bias, post-attention norm, gate_up weight, gate_up bias, down weight,
// down bias; absent biases are None.
constexpr int64_t kLayerTensors = 10;

// Entry i of an op's weight list, which must be there (biases are the optional entries).
at::Tensor required(const c10::List<std::optional<at::Tensor>> &w, int64_t i, const char *op) {
    std::optional<at::Tensor> t = w.get(i);
    TORCH_CHECK(t.has_value(), op, ": weight ", i, " is missing");
    return *t;
}

// A tensor-parallel rank's allreduce from native code (between layer halves; vocab_pick.cpp's
// picks), run by the `shm` backend's compiled exchange (comm_backends/base.py's
// StackExchange): `ex` = [fn, even plan, odd plan, first seq, rounds per call, timeout ns,
// pids, clock]. In place, then the row-parallel bias once (as fused_decoder.py's _reduced
// adds it after comm.all_reduce: the same bits). `clock`, where
// not 0, is the address of an int64 each call adds its nanoseconds to: the backend's
// statistics time these allreduces too (the profiler's allreduce ms left them out).
class StackReduce {
  public:
    explicit StackReduce(c10::IntArrayRef ex, const char *op = "tpserve::decoder_layers")
        : ex_(ex), op_(op) {}

    at::Tensor operator()(const at::Tensor &partial, const std::optional<at::Tensor> &bias) {
        using Fn = int32_t (*)(const void *, char *, int64_t, int64_t, const int32_t *);
        TORCH_CHECK(partial.is_contiguous() && partial.device().is_cpu(),
                    op_, ": a partial sum to reduce must be contiguous CPU");
        const int64_t i = calls_++;
        const auto fn = reinterpret_cast<Fn>(ex_[0]);
        const auto start = std::chrono::steady_clock::now();
        const int32_t status =
            fn(reinterpret_cast<const void *>(ex_[1 + (i & 1)]),
               static_cast<char *>(partial.data_ptr()), ex_[3] + i * ex_[4], ex_[5],
               reinterpret_cast<const int32_t *>(ex_[6]));
        if (ex_[7] != 0)
            *reinterpret_cast<int64_t *>(ex_[7]) +=
                std::chrono::duration_cast<std::chrono::nanoseconds>(
                    std::chrono::steady_clock::now() - start).count();
        TORCH_CHECK(status == 0, op_, ": allreduce ", i, " failed: ",
                    status == -1 ? "a peer stopped" : status == -2 ? "timed out waiting for a peer"
                                                    : "a peer's process is gone");
        return bias.has_value() ? at::add(partial, *bias) : partial;
    }

  private:
    c10::IntArrayRef ex_;
    const char *op_;
    int64_t calls_ = 0;
};

constexpr int64_t kStackExchangeArgs = 8;

// Without `exchange` (one rank): the layers as a single rank computes them. With it (a
// tensor-parallel rank): o_proj and down_proj give this rank's partial sums, reduced across
// the ranks between the halves, their biases added after the reduction, as
// fused_decoder.py's per-layer loop does with comm.all_reduce.
// The residual stream entering a layer, as one tensor: `x + delta` (the previous layer's MLP
// output not added yet), the same add the next layer's attention block would make.
at::Tensor settle(at::Tensor &x, std::optional<at::Tensor> &delta) {
    if (delta.has_value()) {
        x = at::add(x, *delta);
        delta.reset();
    }
    return x;
}

std::vector<at::Tensor> decoder_layers(
                          const at::Tensor &x_in, const c10::List<std::optional<at::Tensor>> &w,
                          at::TensorList k_caches, at::TensorList v_caches, const at::Tensor &cos,
                          const at::Tensor &sin, const at::Tensor &page_table,
                          const at::Tensor &q_indptr, const at::Tensor &kv_lens,
                          const at::Tensor &write_slots,
                          const std::optional<at::Tensor> &mask_start,
                          const std::optional<at::Tensor> &custom_mask, int64_t page_size,
                          int64_t window, double scale, int64_t q_heads, int64_t kv_heads,
                          int64_t head_dim, double eps, bool narrow, c10::IntArrayRef exchange,
                          c10::IntArrayRef aux_at) {
    const int64_t layers = static_cast<int64_t>(k_caches.size());
    TORCH_CHECK(static_cast<int64_t>(w.size()) == layers * kLayerTensors &&
                    v_caches.size() == k_caches.size(),
                "tpserve::decoder_layers: ", kLayerTensors, " weights and two caches a layer");
    TORCH_CHECK(exchange.empty() || static_cast<int64_t>(exchange.size()) == kStackExchangeArgs,
                "tpserve::decoder_layers: exchange is [] or ", kStackExchangeArgs, " integers");
    const StepAttention s{cos,         sin,         page_table, q_indptr, kv_lens, write_slots,
                          mask_start,  custom_mask, page_size,  window,   scale,   q_heads,
                          kv_heads,    head_dim,    narrow};
    const bool split = !exchange.empty();
    StackReduce reduce(exchange);
    const std::optional<at::Tensor> none;
    at::Tensor x = x_in;
    std::optional<at::Tensor> delta;
    // Outputs: [final x, aux...]; each aux state is settled where the layer loop reaches it
    // (a split call used to return it and start the next call from it: the same bits).
    std::vector<at::Tensor> out(1 + aux_at.size());
    auto capture = [&](int64_t l) {
        for (size_t i = 0; i < aux_at.size(); i++)
            if (aux_at[i] == l) out[1 + i] = settle(x, delta);
    };
    for (int64_t a : aux_at)
        TORCH_CHECK(a >= 0 && a <= layers, "tpserve::decoder_layers: aux layer ", a,
                    " outside 0..", layers);
    for (int64_t l = 0; l < layers; l++) {
        capture(l);
        const int64_t b = l * kLayerTensors;
        // Caches are written in place; the list holds views of the engine's pools.
        at::Tensor kc = k_caches[l], vc = v_caches[l];
        auto weight = [&](int64_t i) { return required(w, b + i, "tpserve::decoder_layers"); };
        auto [xa, o] = attn_block(x, delta, weight(0), weight(1), w.get(b + 2), weight(3),
                                  split ? none : w.get(b + 4), kc, vc, s, eps);
        if (split) o = reduce(o, w.get(b + 4));
        auto [xm, m] = mlp_block(xa, o, weight(5), weight(6), w.get(b + 7), weight(8),
                                 split ? none : w.get(b + 9), eps);
        if (split) m = reduce(m, w.get(b + 9));
        x = xm;
        delta = m;
    }
    capture(layers);
    out[0] = settle(x, delta);
    return out;
}

std::tuple<at::Tensor, at::Tensor> decoder_head(const at::Tensor &x, const at::Tensor &norm_w,
                                                double eps, const at::Tensor &lm_head_w) {
    at::Tensor h = rms_norm(x, norm_w, eps);
    return {h, matmul(h, lm_head_w).to(at::kFloat)};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tpserve, m) {
    m.def("decoder_attn_block(Tensor x, Tensor? delta, Tensor? norm_w, Tensor qkv_w, "
          "Tensor? qkv_b, Tensor o_w, Tensor? o_b, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
          "Tensor(b!) v_cache, Tensor page_table, Tensor q_indptr, Tensor kv_lens, "
          "Tensor write_slots, Tensor? mask_start, Tensor? custom_mask, int page_size, "
          "int window, float scale, int q_heads, int kv_heads, int head_dim, float eps, "
          "bool narrow) -> (Tensor, Tensor)");
    m.def("decoder_mlp_block(Tensor x, Tensor delta, Tensor norm_w, Tensor gate_up_w, "
          "Tensor? gate_up_b, Tensor down_w, Tensor? down_b, float eps) -> (Tensor, Tensor)");
    m.def("decoder_layers(Tensor x, Tensor?[] weights, Tensor(a!)[] k_caches, "
          "Tensor(b!)[] v_caches, Tensor cos, Tensor sin, Tensor page_table, Tensor q_indptr, "
          "Tensor kv_lens, Tensor write_slots, Tensor? mask_start, Tensor? custom_mask, "
          "int page_size, int window, float scale, int q_heads, int kv_heads, int head_dim, "
          "float eps, bool narrow, int[] exchange, int[] aux_at) -> Tensor[]");
    m.def("decoder_head(Tensor x, Tensor norm_w, float eps, Tensor lm_head_w) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(tpserve, CPU, m) {
    m.impl("decoder_attn_block", &decoder_attn_block);
    m.impl("decoder_mlp_block", &mlp_block);
    m.impl("decoder_layers", &decoder_layers);
    m.impl("decoder_head", &decoder_head);
}
