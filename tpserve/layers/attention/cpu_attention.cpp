// tpserve::paged_attention: one call per layer that writes the step's K/V into the paged cache
// and attends over it in place (kernel and semantics: paged_attention.c; loader: cpu_native.py).
//
// Threads: work items (request, kv head, query block) are claimed one at a time, so long and
// short requests balance. They run on tpserve::matmul's pool when the loader hands it over
// (tpserve::paged_attention_use_pool): a decode step's projections and attention then share one
// set of threads, and neither waits for a thread that is not running. Otherwise they run inside
// one at::parallel_for region, in parallel when this file is compiled with -fopenmp against
// torch's own OpenMP runtime (the loader links the libgomp torch already loaded), else on the
// calling thread.
//
// On AVX-512 machines the loader builds this file twice: the default build (16 lanes, head_dim
// a multiple of 32) and a "narrow" one with -mno-avx512f -DTPSERVE_ATTN_SUFFIX=_narrow (the
// AVX2 path, head_dim a multiple of 16), whose ops carry the suffix: models with 16-wide heads
// (the built-in demo pair) then attend natively too.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <optional>
#include <vector>

extern "C" {
#include "paged_attention.c"
}

#ifndef TPSERVE_ATTN_SUFFIX
#define TPSERVE_ATTN_SUFFIX
#endif
#define TPSERVE_ATTN_STR2(x) #x
#define TPSERVE_ATTN_STR(x) TPSERVE_ATTN_STR2(x)
// An op name of this build: "paged_attention" ATTN_SUFFIX "(...)" and so on.
#define ATTN_SUFFIX TPSERVE_ATTN_STR(TPSERVE_ATTN_SUFFIX)

namespace {

int32_t dtype_code(const at::Tensor &t) {
    switch (t.scalar_type()) {
    case at::kFloat: return ATTN_F32;
    case at::kBFloat16: return ATTN_BF16;
    case at::kHalf: return ATTN_F16;
    default: TORCH_CHECK(false, "paged_attention: unsupported dtype ", t.scalar_type());
    }
}

// [tokens, heads, head_dim] with heads contiguous inside a token (rows may be strided).
void check_rows(const at::Tensor &t, const char *name, int64_t heads, int64_t head_dim) {
    TORCH_CHECK(t.device().is_cpu() && t.dim() == 3 && t.size(1) == heads && t.size(2) == head_dim,
                "paged_attention: ", name, " must be a CPU [tokens, ", heads, ", ", head_dim,
                "] tensor, got ", t.sizes());
    TORCH_CHECK(t.stride(2) == 1 && t.stride(1) == head_dim,
                "paged_attention: ", name, " must have contiguous heads inside a token");
}

const int32_t *int32_data(const at::Tensor &t, const char *name, int64_t numel) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kInt && t.is_contiguous() &&
                    t.numel() == numel,
                "paged_attention: ", name, " must be a contiguous CPU int32 tensor of ", numel,
                " elements");
    return t.const_data_ptr<int32_t>();
}

// Pages and slots are checked once per call: a bad table must raise, not read out of bounds.
void check_layout(const attn_problem &p, int64_t num_pages, int64_t tokens) {
    TORCH_CHECK(p.q_indptr[0] == 0 && p.q_indptr[p.batch] == tokens,
                "paged_attention: q_indptr must run from 0 to the number of query rows");
    for (int64_t b = 0; b < p.batch; b++) {
        const int64_t q_len = p.q_indptr[b + 1] - p.q_indptr[b], kv_len = p.kv_lens[b];
        TORCH_CHECK(q_len >= 0 && q_len <= kv_len, "paged_attention: request ", b, " has ",
                    q_len, " queries but ", kv_len, " keys");
        const int64_t used = (kv_len + p.page_size - 1) / p.page_size;
        TORCH_CHECK(used <= p.max_pages, "paged_attention: request ", b, " needs ", used,
                    " pages, the page table has ", p.max_pages);
        const int32_t *row = p.page_table + b * p.max_pages;
        for (int64_t i = 0; i < used; i++)
            TORCH_CHECK(row[i] >= 0 && row[i] < num_pages, "paged_attention: page id ", row[i],
                        " out of range");
        if (p.custom_mask != nullptr)
            TORCH_CHECK(q_len <= p.mask_rows && p.mask_start[b] >= 0,
                        "paged_attention: custom mask too small for request ", b);
    }
}

void write_kv(const at::Tensor &src, at::Tensor &cache, const int64_t *slots, int64_t tokens,
              int64_t slot_count) {
    for (int64_t t = 0; t < tokens; t++)
        TORCH_CHECK(slots[t] >= 0 && slots[t] < slot_count, "paged_attention: write slot ",
                    slots[t], " out of range");
    attn_write(src.const_data_ptr(), src.stride(0), dtype_code(src), cache.mutable_data_ptr(),
               dtype_code(cache), slots, tokens, cache.size(1), cache.size(2));
}

std::vector<char> &thread_scratch() {
    thread_local std::vector<char> scratch(attn_scratch_bytes());
    return scratch;
}

using pool_chunk_fn = void (*)(void *ctx, int64_t chunk);
using pool_run_fn = void (*)(pool_chunk_fn fn, void *ctx, int64_t chunks);

// Set once by the loader, before the first call (0: torch's threads).
std::atomic<pool_run_fn> shared_pool{nullptr};

int64_t use_pool(int64_t handle) {
    shared_pool.store(reinterpret_cast<pool_run_fn>(handle));
    return handle != 0;
}

template <typename F>
void pool_trampoline(void *ctx, int64_t i) {
    (*static_cast<const F *>(ctx))(i, thread_scratch().data());
}

// fn(i, scratch) for i in [0, n): on the shared pool, on the calling thread, or claimed from a
// shared counter by torch's threads (one parallel region per call).
template <typename F>
void for_items(int64_t n, const F &fn) {
    pool_run_fn pool = shared_pool.load(std::memory_order_relaxed);
    if (pool != nullptr && n > 1 && !at::in_parallel_region()) {
        pool(&pool_trampoline<F>, const_cast<void *>(static_cast<const void *>(&fn)), n);
        return;
    }
    const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
    if (threads <= 1 || at::in_parallel_region()) {
        void *scratch = thread_scratch().data();
        for (int64_t i = 0; i < n; i++) fn(i, scratch);
        return;
    }
    std::atomic<int64_t> next{0};
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
        void *scratch = thread_scratch().data();
        for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i, scratch);
    });
}

void run_items(attn_problem &p) {
    int64_t parts = 0;
    std::vector<attn_item> items(static_cast<size_t>(attn_plan(&p, nullptr, &parts)));
    attn_plan(&p, items.data(), &parts);
    std::vector<float> partials(static_cast<size_t>(parts * attn_partial_floats(&p)));
    p.partials = partials.data();
    for_items(static_cast<int64_t>(items.size()), [&](int64_t i, void *scratch) {
        attn_run_item(&p, &items[static_cast<size_t>(i)], scratch);
    });
    if (parts == 0) return;
    std::vector<const attn_item *> leaders;
    for (const attn_item &it : items)
        if (it.splits > 1 && it.split == 0) leaders.push_back(&it);
    for_items(static_cast<int64_t>(leaders.size()), [&](int64_t i, void *scratch) {
        attn_merge(&p, leaders[static_cast<size_t>(i)], scratch);
    });
}

at::Tensor paged_attention(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
                           at::Tensor &k_cache, at::Tensor &v_cache, const at::Tensor &page_table,
                           const at::Tensor &q_indptr, const at::Tensor &kv_lens,
                           const at::Tensor &write_slots, const std::optional<at::Tensor> &mask_start,
                           const std::optional<at::Tensor> &custom_mask, int64_t page_size,
                           int64_t window, double scale) {
    TORCH_CHECK(LANES > 0, "paged_attention: built without a vector path");
    const int64_t tokens = q.size(0), kv_heads = k_cache.size(1), head_dim = k_cache.size(2);
    TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                    v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type() &&
                    k_cache.device().is_cpu() && v_cache.device().is_cpu(),
                "paged_attention: caches must be equal contiguous CPU [slots, kv_heads, head_dim]");
    TORCH_CHECK(head_dim % attn_head_dim_multiple() == 0 && head_dim <= ATTN_MAX_HEAD_DIM,
                "paged_attention: head_dim ", head_dim, " must be a multiple of ",
                attn_head_dim_multiple(), " and at most ", ATTN_MAX_HEAD_DIM);
    TORCH_CHECK(q.dim() == 3 && q.size(1) % kv_heads == 0, "paged_attention: q heads ",
                q.sizes(), " must be a multiple of the ", kv_heads, " kv heads");
    TORCH_CHECK(page_size > 0 && k_cache.size(0) % page_size == 0, "paged_attention: bad page_size");
    check_rows(q, "q", q.size(1), head_dim);
    check_rows(k, "k", kv_heads, head_dim);
    check_rows(v, "v", kv_heads, head_dim);
    TORCH_CHECK(k.size(0) == tokens && v.size(0) == tokens && write_slots.numel() == tokens &&
                    write_slots.scalar_type() == at::kLong && write_slots.is_contiguous() &&
                    write_slots.device().is_cpu(),
                "paged_attention: k, v and write_slots (int64) need one row per query row");
    TORCH_CHECK(page_table.dim() == 2, "paged_attention: page_table must be [batch, pages]");
    const int64_t batch = page_table.size(0);
    attn_problem p{};
    p.batch = batch;
    p.max_pages = page_table.size(1);
    p.page_size = page_size;
    p.q_heads = q.size(1);
    p.kv_heads = kv_heads;
    p.head_dim = head_dim;
    p.window = window;
    p.scale = static_cast<float>(scale);
    p.page_table = int32_data(page_table, "page_table", batch * p.max_pages);
    p.q_indptr = int32_data(q_indptr, "q_indptr", batch + 1);
    p.kv_lens = int32_data(kv_lens, "kv_lens", batch);
    TORCH_CHECK(mask_start.has_value() == custom_mask.has_value(),
                "paged_attention: mask_start and custom_mask go together");
    if (custom_mask.has_value()) {
        const at::Tensor &m = *custom_mask;
        TORCH_CHECK(m.device().is_cpu() && m.scalar_type() == at::kBool && m.dim() == 3 &&
                        m.size(0) == batch && m.is_contiguous(),
                    "paged_attention: custom_mask must be a contiguous CPU bool [batch, rows, width]");
        p.mask_start = int32_data(*mask_start, "mask_start", batch);
        p.custom_mask = reinterpret_cast<const uint8_t *>(m.const_data_ptr<bool>());
        p.mask_rows = m.size(1);
        p.mask_width = m.size(2);
    }
    at::Tensor out = at::empty({tokens, p.q_heads * head_dim}, q.options());
    p.q = q.const_data_ptr();
    p.q_stride = q.stride(0);
    p.q_dtype = dtype_code(q);
    p.cache_dtype = dtype_code(k_cache);
    p.k_cache = k_cache.const_data_ptr();
    p.v_cache = v_cache.const_data_ptr();
    p.out = out.mutable_data_ptr();
    check_layout(p, k_cache.size(0) / page_size, tokens);
    const int64_t *slots = write_slots.const_data_ptr<int64_t>();
    write_kv(k, k_cache, slots, tokens, k_cache.size(0));
    write_kv(v, v_cache, slots, tokens, v_cache.size(0));
    run_items(p);
    return out;
}

int64_t paged_attention_lanes() { return LANES; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(tpserve, m) {
    m.def("paged_attention" ATTN_SUFFIX "(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, "
          "Tensor(b!) v_cache, Tensor page_table, Tensor q_indptr, Tensor kv_lens, "
          "Tensor write_slots, Tensor? mask_start, Tensor? custom_mask, int page_size, "
          "int window, float scale) -> Tensor");
    m.def("paged_attention_lanes" ATTN_SUFFIX "() -> int", &paged_attention_lanes);
    m.def("paged_attention_use_pool" ATTN_SUFFIX "(int handle) -> int", &use_pool);
}

TORCH_LIBRARY_IMPL(tpserve, CPU, m) { m.impl("paged_attention" ATTN_SUFFIX, &paged_attention); }
