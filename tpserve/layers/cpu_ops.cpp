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
#include <ATen/ops/mv.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

extern "C" {
#include "gemm.c"
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

constexpr int kPartials = 8;

// sum(x[i]^2) / n in fp64: lane j of the partials takes elements j, j + 8, ...; partials are
// then added pairwise (0+4, 1+5, ... then 0+2, 1+3, then 0+1); the leftover elements follow.
float row_mean_square(const float *x, int64_t n) {
    double part[kPartials] = {0};
    int64_t i = 0;
    for (; i + kPartials <= n; i += kPartials)
        for (int j = 0; j < kPartials; j++) part[j] += (double)x[i + j] * (double)x[i + j];
    for (int width = kPartials / 2; width > 0; width /= 2)
        for (int j = 0; j < width; j++) part[j] += part[j + width];
    double sum = part[0];
    for (; i < n; i++) sum += (double)x[i] * (double)x[i];
    return (float)(sum / (double)n);
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
    for (int64_t r = 0; r < rows; r++) dst[r] = row_mean_square(src + r * n, n);
    return out;
}

int64_t gemm_vector_lanes() { return native_enabled() ? LANES : 0; }

int64_t set_matmul_threads(int64_t threads) {
    return gemm_set_threads(static_cast<int32_t>(std::clamp<int64_t>(threads, 1, POOL_MAX_THREADS)));
}

int64_t matmul_threads() { return gemm_threads(); }

}  // namespace

TORCH_LIBRARY(tpserve, m) {
    m.def("matmul(Tensor x, Tensor weight) -> Tensor");
    m.def("mean_square(Tensor x) -> Tensor");
    m.def("gemm_lanes() -> int", &gemm_vector_lanes);
    m.def("set_matmul_threads(int threads) -> int", &set_matmul_threads);
    m.def("matmul_threads() -> int", &matmul_threads);
}

TORCH_LIBRARY_IMPL(tpserve, CompositeExplicitAutograd, m) {
    m.impl("matmul", &matmul);
    m.impl("mean_square", &mean_square);
}
