// The EAGLE-3 draft's tree growth (spec/eagle.py's draft_tree loop) as one call, for CPU steps
// whose beam fits the native matmul (batch x topk rows) and a draft every rank holds whole.
//
// Why: on the demo pair a draft depth cost ~0.35 ms, nearly all Python: ~25 small ops (embed,
// two norms, a concat, the two native halves of the midlayer, norm + lm_head, log_softmax,
// top-k twice, the beam's gathers) plus the attention metadata of every depth built with numpy.
// The same ATen ops and tpserve kernels in the same order run here, so scores, tokens, parents
// and the draft KV written for the temporary nodes are bit-equal to the Python loop
// (tests/test_draft_tree_native.py); only the Python between them is gone.
//
// tpserve::draft_tree(hidden, tokens?, lens?, starts?, roots [B], embed [V, H], weights,
//   k_cache, v_cache, cos, sin, page_table [B, P] int32, committed [B] int32, topk, num_steps,
//   num_nodes, ...) -> (tokens [B, N], parents [B, N], depths [B, N], mask [B, N, N]):
//   tree.py's DraftTree. With tokens/lens/starts, `hidden` holds the pending features [M, H]
//   and the op first extends the draft over them (drafter.py's _draft_extend: lens[b] rows of
//   request b at draft KV indices starts[b] + j); without, `hidden` is the root output [B, H].
//   The loop proposes topk + (num_steps - 1) * topk^2 candidates (scores, target tokens,
//   parents in proposal order); select_tree's steps then keep the num_nodes - 1 best.
// Weights, in this order (eagle3.py's draft; absent biases None): input_layernorm,
// hidden_norm, qkv, qkv bias, o, o bias, post_attention_layernorm, gate_up, gate_up bias,
// down, down bias, final norm, lm_head, d2t.

#include <ATen/ops/empty_like.h>
#include <ATen/ops/log_softmax.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kDraftTensors = 14;

struct DraftWeights {
    const c10::List<std::optional<at::Tensor>> &w;
    at::Tensor at(int64_t i) const { return required(w, i, "tpserve::draft_tree"); }
    std::optional<at::Tensor> maybe(int64_t i) const { return w.get(i); }
};

// The cache slot of logical draft KV index `logical` of request b (metadata.py's write slots).
int64_t page_slot(const int32_t *pages, int64_t width, int64_t b, int64_t logical,
                  int64_t page_size) {
    TORCH_CHECK(logical / page_size < width,
                "tpserve::draft_tree: a draft KV entry lies past the page table");
    return static_cast<int64_t>(pages[b * width + logical / page_size]) * page_size +
           logical % page_size;
}

// eagle3.py's logits(): lm_head(norm(h)) as linear() computes it, in float32, cut to the vocab.
at::Tensor draft_logits(const at::Tensor &h, const DraftWeights &d, double eps, int64_t vocab) {
    return matmul(rms_norm(h, d.at(11), eps), d.at(12)).to(at::kFloat).narrow(-1, 0, vocab);
}

// The attention metadata of draft step `step` (tree.py's draft_step_metadata): K rows per
// request at logical indices committed + step * K + j, each seeing the committed keys and the
// temporary nodes its mask row marks.
struct DepthLayout {
    at::Tensor q_indptr, kv_lens, write_slots;
};

DepthLayout depth_layout(const at::Tensor &pages, const at::Tensor &committed, int64_t k,
                         int64_t step, int64_t page_size) {
    const int64_t batch = pages.size(0), width = pages.size(1);
    auto i32 = committed.options().dtype(at::kInt);
    at::Tensor indptr = at::empty({batch + 1}, i32), kv = at::empty({batch}, i32);
    at::Tensor slots = at::empty({batch * k}, committed.options().dtype(at::kLong));
    const int32_t *page = pages.const_data_ptr<int32_t>();
    const int32_t *base = committed.const_data_ptr<int32_t>();
    int32_t *ip = indptr.mutable_data_ptr<int32_t>(), *kl = kv.mutable_data_ptr<int32_t>();
    int64_t *slot = slots.mutable_data_ptr<int64_t>();
    ip[0] = 0;
    for (int64_t b = 0; b < batch; b++) {
        ip[b + 1] = static_cast<int32_t>((b + 1) * k);
        kl[b] = static_cast<int32_t>(base[b] + (step + 1) * k);
        for (int64_t j = 0; j < k; j++)
            slot[b * k + j] = page_slot(page, width, b, base[b] + step * k + j, page_size);
    }
    return {indptr, kv, slots};
}

// One row normed into `out` (rms_norm on a single row: the norm is per row, so these are
// the bits a batched rms_norm gives that row).
void norm_row(const void *x, const at::Tensor &weight, void *out, int64_t cols, double eps,
              int dtype) {
    if (fused_rms_norm(x, cols, nullptr, 0, weight.const_data_ptr(), nullptr, out, 1, cols,
                       static_cast<float>(eps), dtype) != 0)
        throw std::bad_alloc();
}

// The midlayer's attention input, cat([rms_norm(embedding(ids)), rms_norm(h_in)], -1), written
// row by row into one [n, 2H] tensor: the same bits without the embedding gather, the two
// norm outputs and the concatenation (five allocations and two copies a depth).
at::Tensor normed_inputs(const DraftWeights &d, const at::Tensor &embed_w, const int64_t *ids,
                         const at::Tensor &h_in, double eps) {
    const at::Tensor h = h_in.contiguous(), e_norm = d.at(0), h_norm = d.at(1);
    const int64_t n = h.size(0), cols = h.size(1), vocab = embed_w.size(0);
    TORCH_CHECK(h.dim() == 2 && embed_w.dim() == 2 && embed_w.is_contiguous() &&
                    embed_w.size(1) == cols && embed_w.scalar_type() == h.scalar_type(),
                "tpserve::draft_tree: embedding [V, H] and hidden rows [n, H] of one dtype");
    check_norm(h, e_norm);
    check_norm(h, h_norm);
    const int dtype = fused_dtype(h);
    const int64_t bytes = cols * static_cast<int64_t>(h.element_size());
    at::Tensor x = at::empty({n, 2 * cols}, h.options());
    const char *table = static_cast<const char *>(embed_w.const_data_ptr());
    const char *hidden = static_cast<const char *>(h.const_data_ptr());
    char *to = static_cast<char *>(x.mutable_data_ptr());
    for (int64_t r = 0; r < n; r++) {
        TORCH_CHECK(ids[r] >= 0 && ids[r] < vocab, "tpserve::draft_tree: token id ", ids[r],
                    " outside the embedding's ", vocab, " rows");
        norm_row(table + ids[r] * bytes, e_norm, to + 2 * r * bytes, cols, eps, dtype);
        norm_row(hidden + r * bytes, h_norm, to + (2 * r + 1) * bytes, cols, eps, dtype);
    }
    return x;
}

// eagle3.py's forward through DraftBlocks: attention over the normed [embed, hidden]
// concatenation, then the MLP with the hidden state as the residual. `ids`: h_in.size(0)
// token ids.
at::Tensor midlayer(const DraftWeights &d, const at::Tensor &embed_w, const int64_t *ids,
                    const at::Tensor &h_in, at::Tensor &k_cache, at::Tensor &v_cache,
                    const StepAttention &s, double eps) {
    at::Tensor x = normed_inputs(d, embed_w, ids, h_in, eps);
    auto [_, o] = attn_block(x, std::nullopt, std::nullopt, d.at(2), d.maybe(3), d.at(4),
                             d.maybe(5), k_cache, v_cache, s, eps);
    auto [h, m] = mlp_block(h_in, o, d.at(6), d.at(7), d.maybe(8), d.at(9), d.maybe(10), eps);
    return at::add(h, m);
}

// drafter.py's _draft_extend: lens[b] committed rows per request written at logical indices
// starts[b] + j, causal (plan.py's build_forward_batch); returns each request's last output.
at::Tensor draft_extend(const DraftWeights &d, const at::Tensor &embed_w, const at::Tensor &feats,
                        const at::Tensor &tokens, const at::Tensor &lens,
                        const at::Tensor &starts, at::Tensor &k_cache, at::Tensor &v_cache,
                        const at::Tensor &cos_table, const at::Tensor &sin_table,
                        const at::Tensor &page_table, int64_t page_size, int64_t window,
                        double scale, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                        double eps, bool narrow) {
    TORCH_CHECK(lens.scalar_type() == at::kInt && starts.scalar_type() == at::kInt &&
                    lens.is_contiguous() && starts.is_contiguous() &&
                    lens.size(0) == page_table.size(0) && starts.size(0) == page_table.size(0),
                "tpserve::draft_tree: int32 extend lens and starts, one per request");
    const int64_t batch = page_table.size(0), width = page_table.size(1), rows = tokens.size(0);
    auto i32 = lens.options();
    at::Tensor indptr = at::empty({batch + 1}, i32), kv = at::empty({batch}, i32);
    at::Tensor slots = at::empty({rows}, i32.dtype(at::kLong));
    at::Tensor positions = at::empty({rows}, i32.dtype(at::kLong));
    at::Tensor last = at::empty({batch}, i32.dtype(at::kLong));
    const int32_t *page = page_table.const_data_ptr<int32_t>();
    const int32_t *len = lens.const_data_ptr<int32_t>(), *first = starts.const_data_ptr<int32_t>();
    int32_t *ip = indptr.mutable_data_ptr<int32_t>(), *kl = kv.mutable_data_ptr<int32_t>();
    int64_t *slot = slots.mutable_data_ptr<int64_t>(), *pos = positions.mutable_data_ptr<int64_t>();
    int64_t *end = last.mutable_data_ptr<int64_t>();
    int64_t row = 0;
    ip[0] = 0;
    for (int64_t b = 0; b < batch; b++) {
        TORCH_CHECK(len[b] >= 1, "tpserve::draft_tree: every request extends by a row or more");
        for (int64_t j = 0; j < len[b]; j++, row++) {
            TORCH_CHECK(row < rows, "tpserve::draft_tree: extend lens exceed the tokens");
            pos[row] = first[b] + j;
            slot[row] = page_slot(page, width, b, first[b] + j, page_size);
        }
        ip[b + 1] = static_cast<int32_t>(row);
        kl[b] = first[b] + len[b];
        end[b] = row - 1;
    }
    TORCH_CHECK(row == rows, "tpserve::draft_tree: extend lens do not add up to the tokens");
    const auto [cos, sin] = rotary_gather(cos_table, sin_table, positions, feats.scalar_type());
    const std::optional<at::Tensor> none;
    const StepAttention s{cos,  sin,  page_table, indptr,  kv,       slots,    none,  none,
                          page_size, window, scale, q_heads, kv_heads, head_dim, narrow};
    TORCH_CHECK(tokens.scalar_type() == at::kLong && tokens.is_contiguous(),
                "tpserve::draft_tree: extend tokens must be contiguous int64");
    return midlayer(d, embed_w, tokens.const_data_ptr<int64_t>(), feats, k_cache, v_cache, s,
                    eps)
        .index_select(0, last);
}

// The proposals of every depth, in proposal order: scores (cumulative log-probabilities),
// target token ids and parent candidate indices (-1: the root), each [B, C].
struct Candidates {
    at::Tensor scores, tokens, parents;
};

// Row `r` of each of `rows` copied out of `src` [*, H] into a new contiguous [n, H] tensor.
at::Tensor take_rows(const at::Tensor &src, const std::vector<int64_t> &rows) {
    const at::Tensor from = src.contiguous();
    const int64_t hidden = from.size(1), bytes = hidden * static_cast<int64_t>(from.element_size());
    at::Tensor out = at::empty({static_cast<int64_t>(rows.size()), hidden}, from.options());
    const char *in = static_cast<const char *>(from.const_data_ptr());
    char *to = static_cast<char *>(out.mutable_data_ptr());
    for (size_t i = 0; i < rows.size(); i++)
        std::memcpy(to + static_cast<int64_t>(i) * bytes, in + rows[i] * bytes, bytes);
    return out;
}

// torch.topk(k, -1) of each row of a contiguous [rows, n] float block: the same indices in
// the same order, ties included, as this torch's CPU kernel gives (checked against it on
// tied rows by tests/test_draft_tree_native.py): (value, index) pairs in index order, NaN
// ranking highest; where k * 64 <= n the first k are put in order by a partial sort, else
// the k-th is selected and the k - 1 before it are sorted. (torch sources also carry a heap
// selection with other tie orders; a torch that ships it fails that test, the cue to follow.)
// The op around that kernel (the dispatcher, two output tensors, a fresh n-pair queue per
// row: 16 KB at the demo draft's vocabulary, malloc_consolidate in the profile) and the
// kernel were ~3.5% of a tree in a tight loop; here one queue serves the whole tree.
class RowTopK {
  public:
    void operator()(const float *x, int64_t rows, int64_t n, int64_t k, float *scores,
                    int64_t *ids) {
        TORCH_CHECK(k >= 1 && k <= n, "tpserve::draft_tree: top-", k, " of ", n, " values");
        const First first;
        queue_.resize(n);
        for (int64_t r = 0; r < rows; r++) {
            const float *row = x + r * n;
            for (int64_t j = 0; j < n; j++) queue_[j] = {row[j], j};
            if (k * 64 <= n) {
                std::partial_sort(queue_.begin(), queue_.begin() + k, queue_.end(), first);
            } else {
                std::nth_element(queue_.begin(), queue_.begin() + (k - 1), queue_.end(), first);
                std::sort(queue_.begin(), queue_.begin() + (k - 1), first);
            }
            for (int64_t j = 0; j < k; j++) {
                scores[r * k + j] = queue_[j].first;
                ids[r * k + j] = queue_[j].second;
            }
        }
    }

  private:
    using Pair = std::pair<float, int64_t>;
    // Ranks a before b (NaN highest). Forced inline: this file is part of one large unit
    // past GCC's inlining growth limit, where a lambda here was called out of line.
    struct First {
        __attribute__((always_inline)) bool operator()(const Pair &a, const Pair &b) const {
            return (std::isnan(a.first) && !std::isnan(b.first)) || a.first > b.first;
        }
    };
    std::vector<Pair> queue_;
};

// log_softmax(logits).topk(k, -1) as eagle.py computes it: ATen's log_softmax (its bits),
// then RowTopK into `scores` / `ids`, [rows, k] each.
void draft_top(const at::Tensor &logits, int64_t k, RowTopK &top, std::vector<float> &scores,
               std::vector<int64_t> &ids) {
    const at::Tensor logp = at::log_softmax(logits, -1).contiguous();
    const int64_t rows = logp.size(0), n = logp.size(1);
    scores.resize(rows * k);
    ids.resize(rows * k);
    top(logp.const_data_ptr<float>(), rows, n, k, scores.data(), ids.data());
}

// spec/eagle.py's draft loop: the root's top-k, then per depth the beam's midlayer forward,
// log-softmax over the draft vocabulary and top-k, the k best children (by cumulative score)
// as the next beam. Floating point runs on the same ATen ops as there (log_softmax, topk, the
// score additions in fp32); the beam bookkeeping (gathers, parent indices, ancestor masks,
// token mapping) is integer and copy work, done here in plain loops: as ATen ops it was ~70%
// of the call (~35 small ops a depth at a few microseconds each).
Candidates draft_candidates(
    const at::Tensor &start, const at::Tensor &embed_w,
    const c10::List<std::optional<at::Tensor>> &weights, at::Tensor &k_cache,
    at::Tensor &v_cache, const at::Tensor &cos_table, const at::Tensor &sin_table,
    const at::Tensor &page_table, const at::Tensor &committed, int64_t k, int64_t num_steps,
    int64_t page_size, int64_t window, double scale, int64_t q_heads, int64_t kv_heads,
    int64_t head_dim, double eps, bool narrow, int64_t vocab) {
    TORCH_CHECK(static_cast<int64_t>(weights.size()) == kDraftTensors,
                "tpserve::draft_tree: ", kDraftTensors, " weights");
    TORCH_CHECK(start.dim() == 2 && page_table.scalar_type() == at::kInt &&
                    committed.scalar_type() == at::kInt && page_table.is_contiguous() &&
                    committed.is_contiguous() && page_table.size(0) == start.size(0) &&
                    committed.size(0) == start.size(0) && k >= 1 && num_steps >= 1,
                "tpserve::draft_tree: start [B, H], int32 page_table [B, P] and committed [B]");
    const DraftWeights d{weights};
    const at::Tensor d2t = d.at(13).to(at::kLong).contiguous();
    const int64_t batch = start.size(0), kk = k * k;
    const int64_t total = k + (num_steps - 1) * kk;
    const int64_t *map = d2t.const_data_ptr<int64_t>();
    const auto to_target = [map](int64_t id) { return id + map[id]; };  // eagle3.py's to_target
    const int32_t *base = committed.const_data_ptr<int32_t>();
    auto i64 = at::TensorOptions().dtype(at::kLong);
    Candidates c{at::empty({batch, total}, i64.dtype(at::kFloat)), at::empty({batch, total}, i64),
                 at::empty({batch, total}, i64)};
    float *cs = c.scores.mutable_data_ptr<float>();
    int64_t *ct = c.tokens.mutable_data_ptr<int64_t>(), *cp = c.parents.mutable_data_ptr<int64_t>();

    RowTopK top;
    std::vector<float> top_score, child(batch * kk), next(batch * k);
    std::vector<int64_t> top_ids, pick(batch * k);
    draft_top(draft_logits(start, d, eps, vocab), k, top, top_score, top_ids);
    // The beam, [B, k] each: scores, target tokens, candidate index; the hidden rows it
    // continues from; and for every beam node, which temporary nodes (s * k + j) it descends
    // from, as a [B, k, (num_steps - 1) * k] bit table (the attention mask's history part).
    std::vector<float> beam_score(batch * k);
    std::vector<int64_t> beam_tokens(batch * k), beam_cand(batch * k), rows(batch * k);
    const int64_t width = (num_steps - 1) * k;
    std::vector<uint8_t> ancestors(batch * k * std::max<int64_t>(width, 1), 0), next_anc(ancestors);
    for (int64_t b = 0; b < batch; b++)
        for (int64_t j = 0; j < k; j++) {
            const int64_t i = b * k + j, id = top_ids[i];
            beam_score[i] = top_score[i];
            beam_tokens[i] = to_target(id);
            beam_cand[i] = j;
            rows[i] = b;
            cs[b * total + j] = beam_score[i];
            ct[b * total + j] = beam_tokens[i];
            cp[b * total + j] = -1;
        }
    at::Tensor beam_hidden = take_rows(start, rows);
    at::Tensor positions = at::empty({batch * k}, i64);
    int64_t offset = k;
    for (int64_t step = 0; step + 1 < num_steps; step++) {
        const int64_t seen = (step + 1) * k;  // mask width: earlier temporary nodes and this depth's
        at::Tensor mask = at::empty({batch, k, seen}, i64.dtype(at::kBool));
        bool *m = mask.mutable_data_ptr<bool>();
        int64_t *pos = positions.mutable_data_ptr<int64_t>();
        for (int64_t b = 0; b < batch; b++)
            for (int64_t j = 0; j < k; j++) {
                const int64_t i = b * k + j;
                for (int64_t t = 0; t < step * k; t++) m[i * seen + t] = ancestors[i * width + t];
                for (int64_t t = 0; t < k; t++) m[i * seen + step * k + t] = t == j;
                pos[i] = base[b] + step;
            }
        const DepthLayout layout = depth_layout(page_table, committed, k, step, page_size);
        const std::optional<at::Tensor> mask_start = committed, own = mask;
        const auto [cos, sin] = rotary_gather(cos_table, sin_table, positions, start.scalar_type());
        const StepAttention s{cos,       sin,  page_table, layout.q_indptr, layout.kv_lens,
                              layout.write_slots, mask_start, own, page_size, window,
                              scale,     q_heads, kv_heads, head_dim,    narrow};
        at::Tensor out =
            midlayer(d, embed_w, beam_tokens.data(), beam_hidden, k_cache, v_cache, s, eps);
        draft_top(draft_logits(out, d, eps, vocab), k, top, top_score, top_ids);
        const float *ts = top_score.data();
        const int64_t *ti = top_ids.data();
        // Children of beam node j: cumulative score (one fp32 addition, as in eagle.py),
        // target token, parent candidate; row-major over (j, child) as eagle.py reshapes.
        for (int64_t b = 0; b < batch; b++)
            for (int64_t j = 0; j < k; j++)
                for (int64_t t = 0; t < k; t++) {
                    const int64_t q = (b * k + j) * k + t, col = offset + j * k + t;
                    child[b * kk + j * k + t] = beam_score[b * k + j] + ts[q];
                    cs[b * total + col] = child[b * kk + j * k + t];
                    ct[b * total + col] = to_target(ti[q]);
                    cp[b * total + col] = beam_cand[b * k + j];
                }
        if (step + 2 < num_steps) {  // the next beam (the last depth's is never used)
            top(child.data(), batch, kk, k, next.data(), pick.data());
            const float *ns = next.data();
            const int64_t *pk = pick.data();
            for (int64_t b = 0; b < batch; b++)
                for (int64_t j = 0; j < k; j++) {
                    const int64_t i = b * k + j, p = pk[i], parent = b * k + p / k;
                    beam_score[i] = ns[i];
                    beam_tokens[i] = ct[b * total + offset + p];
                    beam_cand[i] = offset + p;
                    rows[i] = parent;
                    for (int64_t t = 0; t < seen; t++)
                        next_anc[i * width + t] = m[parent * seen + t];
                }
            ancestors.swap(next_anc);
            beam_hidden = take_rows(out, rows);
        }
        offset += kk;
    }
    return c;
}

// tree.py's select_tree + finish_tree: keep the num_nodes - 1 best candidates (a stable
// descending sort, NaN first as torch.sort orders it, puts every parent before its children),
// renumber parents, and build the ancestor masks one level per iteration. Integer work only:
// plain loops give exactly tree.py's tensors.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> select_nodes(
    const at::Tensor &roots, const Candidates &c, int64_t num_nodes, int64_t max_depth) {
    const int64_t batch = roots.size(0), total = c.scores.size(1), keep = num_nodes - 1;
    TORCH_CHECK(keep <= total, "tpserve::draft_tree: more nodes than candidates");
    const at::Tensor root_ids = roots.to(at::kLong).contiguous();
    auto i64 = at::TensorOptions().dtype(at::kLong);
    at::Tensor tokens = at::empty({batch, num_nodes}, i64), parents = at::empty_like(tokens);
    at::Tensor depths = at::empty_like(tokens);
    at::Tensor mask = at::zeros({batch, num_nodes, num_nodes}, i64.dtype(at::kBool));
    const float *score = c.scores.const_data_ptr<float>();
    const int64_t *cand_tok = c.tokens.const_data_ptr<int64_t>();
    const int64_t *cand_par = c.parents.const_data_ptr<int64_t>();
    int64_t *tok = tokens.mutable_data_ptr<int64_t>(), *par = parents.mutable_data_ptr<int64_t>();
    int64_t *dep = depths.mutable_data_ptr<int64_t>();
    bool *m = mask.mutable_data_ptr<bool>();
    std::vector<int64_t> order(total), node_of(total);
    for (int64_t b = 0; b < batch; b++) {
        const float *sc = score + b * total;
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [sc](int64_t x, int64_t y) {
            const float a = sc[x], v = sc[y];
            return std::isnan(a) ? !std::isnan(v) : a > v;  // descending, NaN largest
        });
        std::sort(order.begin(), order.begin() + keep);  // proposal order
        std::fill(node_of.begin(), node_of.end(), -1);
        for (int64_t j = 0; j < keep; j++) node_of[order[j]] = j + 1;
        int64_t *t = tok + b * num_nodes, *p = par + b * num_nodes;
        t[0] = root_ids.const_data_ptr<int64_t>()[b];
        p[0] = -1;
        for (int64_t j = 0; j < keep; j++) {
            const int64_t cand = order[j], up = cand_par[b * total + cand];
            t[j + 1] = cand_tok[b * total + cand];
            // An unchosen parent (possible only with NaN scores) maps to the root.
            p[j + 1] = up < 0 ? 0 : std::max<int64_t>(node_of[up], 0);
        }
        for (int64_t n = 0; n < num_nodes; n++) {
            bool *row = m + (b * num_nodes + n) * num_nodes;
            row[n] = true;
            int64_t node = p[n];
            for (int64_t i = 0; i < max_depth; i++) {
                row[std::max<int64_t>(node, 0)] = true;
                node = node >= 0 ? p[std::max<int64_t>(node, 0)] : -1;
            }
            int64_t count = 0;
            for (int64_t x = 0; x < num_nodes; x++) count += row[x];
            dep[b * num_nodes + n] = count - 1;
        }
    }
    return {tokens, parents, depths, mask};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> draft_tree(
    const at::Tensor &hidden, const std::optional<at::Tensor> &tokens,
    const std::optional<at::Tensor> &lens, const std::optional<at::Tensor> &starts,
    const at::Tensor &roots, const at::Tensor &embed_w,
    const c10::List<std::optional<at::Tensor>> &weights, at::Tensor &k_cache,
    at::Tensor &v_cache, const at::Tensor &cos_table, const at::Tensor &sin_table,
    const at::Tensor &page_table, const at::Tensor &committed, int64_t k, int64_t num_steps,
    int64_t num_nodes, int64_t page_size, int64_t window, double scale, int64_t q_heads,
    int64_t kv_heads, int64_t head_dim, double eps, bool narrow, int64_t vocab) {
    TORCH_CHECK(tokens.has_value() == lens.has_value() && lens.has_value() == starts.has_value(),
                "tpserve::draft_tree: extend tokens, lens and starts go together");
    const at::Tensor start =
        tokens.has_value()
            ? draft_extend(DraftWeights{weights}, embed_w, hidden, *tokens, *lens, *starts,
                           k_cache, v_cache, cos_table, sin_table, page_table, page_size, window,
                           scale, q_heads, kv_heads, head_dim, eps, narrow)
            : hidden;
    const Candidates cands =
        draft_candidates(start, embed_w, weights, k_cache, v_cache, cos_table, sin_table,
                         page_table, committed, k, num_steps, page_size, window, scale, q_heads,
                         kv_heads, head_dim, eps, narrow, vocab);
    return select_nodes(roots, cands, num_nodes, num_steps);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tpserve, m) {
    m.def("draft_tree(Tensor hidden, Tensor? tokens, Tensor? lens, Tensor? starts, "
          "Tensor roots, Tensor embed, Tensor?[] weights, "
          "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cos, Tensor sin, Tensor page_table, "
          "Tensor committed, int topk, int num_steps, int num_nodes, int page_size, int window, "
          "float scale, int q_heads, int kv_heads, int head_dim, float eps, bool narrow, "
          "int vocab) -> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(tpserve, CPU, m) {
    m.impl("draft_tree", &draft_tree);
}
