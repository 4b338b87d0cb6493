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

#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/embedding.h>
#include <ATen/ops/eye.h>
#include <ATen/ops/floor_divide.h>
#include <ATen/ops/full_like.h>
#include <ATen/ops/full.h>
#include <ATen/ops/log_softmax.h>
#include <ATen/ops/sub.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>

namespace {

constexpr int64_t kDraftTensors = 14;

struct DraftWeights {
    const c10::List<std::optional<at::Tensor>> &w;
    at::Tensor at(int64_t i) const { return required(w, i, "tpserve::draft_tree"); }
    std::optional<at::Tensor> maybe(int64_t i) const { return w.get(i); }
};

// The cache slot of logical draft KV index `logical` of request b (drafter.py's page_slots).
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

// draft ids -> target ids (eagle3.py's to_target).
at::Tensor to_target(const at::Tensor &ids, const at::Tensor &d2t) {
    return at::add(ids, d2t.index({ids}));
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

// The rotary rows of `positions` as rotary.py's at() gathers and casts them.
at::Tensor rotary_rows(const at::Tensor &table, const at::Tensor &positions,
                       at::ScalarType dtype) {
    return table.index({positions}).unsqueeze(1).to(dtype);
}

// eagle3.py's forward through DraftBlocks: attention over the normed [embed, hidden]
// concatenation, then the MLP with the hidden state as the residual.
at::Tensor midlayer(const DraftWeights &d, const at::Tensor &embed_w, const at::Tensor &ids,
                    const at::Tensor &h_in, at::Tensor &k_cache, at::Tensor &v_cache,
                    const StepAttention &s, double eps) {
    at::Tensor x = at::cat({rms_norm(at::embedding(embed_w, ids), d.at(0), eps),
                            rms_norm(h_in, d.at(1), eps)},
                           -1);
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
    const at::Tensor cos = rotary_rows(cos_table, positions, feats.scalar_type());
    const at::Tensor sin = rotary_rows(sin_table, positions, feats.scalar_type());
    const std::optional<at::Tensor> none;
    const StepAttention s{cos,  sin,  page_table, indptr,  kv,       slots,    none,  none,
                          page_size, window, scale, q_heads, kv_heads, head_dim, narrow};
    return midlayer(d, embed_w, tokens, feats, k_cache, v_cache, s, eps).index_select(0, last);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> draft_candidates(
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
    const at::Tensor d2t = d.at(13);
    const int64_t batch = start.size(0), hidden = start.size(1);
    auto [score, ids] = at::log_softmax(draft_logits(start, d, eps, vocab), -1).topk(k, -1);
    at::Tensor tokens = to_target(ids, d2t);
    std::vector<at::Tensor> scores{score}, cands{tokens}, parents{at::full_like(ids, -1)};
    at::Tensor beam_hidden = start.unsqueeze(1).expand({batch, k, hidden});
    at::Tensor beam_score = score, beam_tokens = tokens;
    at::Tensor beam_cand = at::arange(k, ids.options()).expand({batch, k});
    auto flags = ids.options().dtype(at::kBool);
    at::Tensor ancestors = at::zeros({batch, k, 0}, flags);
    at::Tensor eye = at::eye(k, flags).expand({batch, k, k});
    at::Tensor base_positions = committed.to(at::kLong).unsqueeze(1).expand({batch, k});
    int64_t offset = k;
    for (int64_t step = 0; step + 1 < num_steps; step++) {
        at::Tensor own = at::cat({ancestors, eye}, 2);
        const DepthLayout layout = depth_layout(page_table, committed, k, step, page_size);
        const std::optional<at::Tensor> mask_start = committed, mask = own.contiguous();
        at::Tensor positions = at::add(base_positions, step).reshape(-1);
        const at::Tensor cos = rotary_rows(cos_table, positions, start.scalar_type());
        const at::Tensor sin = rotary_rows(sin_table, positions, start.scalar_type());
        const StepAttention s{cos,       sin,  page_table, layout.q_indptr, layout.kv_lens,
                              layout.write_slots, mask_start, mask, page_size, window,
                              scale,     q_heads, kv_heads, head_dim,    narrow};
        at::Tensor out = midlayer(d, embed_w, beam_tokens.reshape(-1),
                                  beam_hidden.reshape({-1, hidden}), k_cache, v_cache, s, eps);
        at::Tensor logp = at::log_softmax(draft_logits(out, d, eps, vocab), -1)
                              .view({batch, k, -1});
        auto [top_score, top_ids] = logp.topk(k, -1);
        at::Tensor child_score = at::add(beam_score.unsqueeze(2), top_score).reshape({batch, k * k});
        at::Tensor child_tokens = to_target(top_ids, d2t).reshape({batch, k * k});
        scores.push_back(child_score);
        cands.push_back(child_tokens);
        parents.push_back(beam_cand.unsqueeze(2).expand({batch, k, k}).reshape({batch, k * k}));
        auto [next_score, pick] = child_score.topk(k, -1);
        at::Tensor parent_beam = at::floor_divide(pick, k).unsqueeze(2);
        beam_score = next_score;
        beam_tokens = child_tokens.gather(1, pick);
        beam_cand = at::add(pick, offset);
        beam_hidden = out.view({batch, k, hidden}).gather(1, parent_beam.expand({batch, k, hidden}));
        ancestors = own.gather(1, parent_beam.expand({batch, k, own.size(2)}));
        offset += k * k;
    }
    return {at::cat(scores, 1), at::cat(cands, 1), at::cat(parents, 1)};
}

// tree.py's select_tree + _finish_tree: keep the num_nodes - 1 best candidates (a stable
// descending sort puts every parent before its children), renumber parents, and build the
// ancestor masks one level per iteration. Integer work on the same ATen ops as there.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> select_nodes(
    const at::Tensor &roots, const at::Tensor &scores, const at::Tensor &tokens,
    const at::Tensor &parents, int64_t num_nodes, int64_t max_depth) {
    const int64_t batch = roots.size(0);
    at::Tensor order = std::get<1>(scores.sort(/*stable=*/true, 1, /*descending=*/true))
                           .narrow(1, 0, num_nodes - 1);
    at::Tensor chosen = std::get<0>(order.sort(1));
    at::Tensor node_of = at::full_like(scores, -1, scores.options().dtype(at::kLong));
    node_of.scatter_(1, chosen,
                     at::arange(1, num_nodes, chosen.options()).expand({batch, -1}).contiguous());
    at::Tensor cand_parent = parents.gather(1, chosen);
    at::Tensor node_parent =
        at::where(cand_parent.lt(0), 0, node_of.gather(1, cand_parent.clamp_min(0))).clamp_min(0);
    at::Tensor all_tokens = at::cat({roots.unsqueeze(1), tokens.gather(1, chosen)}, 1);
    at::Tensor all_parents =
        at::cat({at::full({batch, 1}, -1, node_parent.options()), node_parent}, 1);
    at::Tensor mask = at::eye(num_nodes, roots.options().dtype(at::kBool))
                          .expand({batch, num_nodes, num_nodes})
                          .clone();
    at::Tensor node = all_parents;
    for (int64_t i = 0; i < max_depth; i++) {
        mask.scatter_(2, node.clamp_min(0).unsqueeze(2), true);
        node = at::where(node.ge(0), all_parents.gather(1, node.clamp_min(0)), -1);
    }
    at::Tensor depths = at::sub(mask.sum(2), 1);
    return {all_tokens, all_parents, depths, mask};
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
    auto [scores, cands, parents] =
        draft_candidates(start, embed_w, weights, k_cache, v_cache, cos_table, sin_table, page_table,
                   committed, k, num_steps, page_size, window, scale, q_heads, kv_heads,
                   head_dim, eps, narrow, vocab);
    return select_nodes(roots, scores, cands, parents, num_nodes, num_steps);
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
