#pragma once
// Causal attention computed block by block, the arithmetic under context parallel's ring: a
// rank's query chunks meet each key/value chunk in turn (as the ring brings it, or as an
// all-gather hands it over), each block gives a partial output and its log-sum-exp, and the
// partial results are merged with the log-sum-exp in fp32, which gives exactly the softmax over
// all the keys seen. Backward needs no second pass of forward: each block's gradients follow from
// the merged output and log-sum-exp (flash attention's backward), so a block's backward runs as
// the ring brings its keys and values back.
//
//   cp::PartialAttention total = cp::attend(q, k0, v0, cp::ChunkVisibility::all, scale);
//   cp::merge_into(total, cp::attend(q, k1, v1, cp::ChunkVisibility::causal, scale));
//   auto [dq1, dk1, dv1] = cp::attend_backward(grad, q, k1, v1, total, cp::ChunkVisibility::causal, scale);
//
// On the CPU each block runs LibTorch's flash attention kernel (_scaled_dot_product_flash_attention_for_cpu
// and its backward, which take the merged output and log-sum-exp); on other devices a composite of
// matrix products with the same arithmetic. Key/value heads fewer than query heads (grouped-query
// attention) are repeated for the block and their gradients summed back.
#include <tuple>
#include <vector>

#include <meshtorch/torch.hpp>

#include <meshtorch/layout/context_split.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::cp {

// Attention of queries [B, H, Sq, D] over some keys: the output in fp32 and the log-sum-exp of each
// query's scores over those keys [B, H, Sq] (fp32).
struct PartialAttention {
  torch::Tensor out, lse;
};

// One block: `q` against keys and values [B, Hkv, Sk, D] as `seen` says (all, or causal for a chunk
// against itself; `none` is the caller's to skip).
MESHTORCH_DECL PartialAttention attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                       ChunkVisibility seen, double scale);

// Adds `block` into `total` (empty `total`: becomes `block`): outputs weighed by exp(lse_i - lse).
MESHTORCH_DECL void merge_into(PartialAttention& total, const PartialAttention& block);

// The gradients of one block's q, k and v given the gradient of the merged output and the merged
// result itself; summing dq over the blocks gives the queries' gradient.
MESHTORCH_DECL std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> attend_backward(
    const torch::Tensor& grad_out, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
    const PartialAttention& total, ChunkVisibility seen, double scale);

// Causal attention of one rank's query chunks (`q_chunks`: chunk indices of the sequence, each
// [B, H, c, D]) over key/value chunks (`kv_chunks` their indices), as one autograd node: forward
// merges every visible block, backward runs each block's backward from the merged result. Returns
// the outputs of the query chunks, in `q_chunks`' order, concatenated along the sequence. Gradients
// flow to the queries, keys and values given.
MESHTORCH_DECL torch::Tensor attend_chunks(const std::vector<torch::Tensor>& queries, const std::vector<int>& q_chunks,
                                           const std::vector<torch::Tensor>& keys,
                                           const std::vector<torch::Tensor>& values, const std::vector<int>& kv_chunks,
                                           double scale);

}  // namespace meshtorch::cp

#if MESHTORCH_DEFINES(core)
#include <limits>
#include <stdexcept>

namespace meshtorch::cp {
namespace blockwise_detail {

// Key/value heads repeated to the query heads (grouped-query attention), and back (gradients summed).
inline torch::Tensor repeat_heads(const torch::Tensor& t, std::int64_t heads) {
  return t.size(1) == heads ? t : t.repeat_interleave(heads / t.size(1), 1);
}
inline torch::Tensor sum_heads(const torch::Tensor& grad, std::int64_t kv_heads) {
  if (grad.size(1) == kv_heads) return grad;
  auto sizes = grad.sizes().vec();
  return grad.reshape({sizes[0], kv_heads, sizes[1] / kv_heads, sizes[2], sizes[3]}).sum(2);
}

// Scores of the block in fp32, the masked positions -inf.
inline torch::Tensor scores(const torch::Tensor& q, const torch::Tensor& k, ChunkVisibility seen, double scale) {
  auto s = torch::matmul(q.to(torch::kFloat), k.to(torch::kFloat).transpose(-2, -1)) * scale;
  if (seen == ChunkVisibility::causal) {
    const auto above =
        torch::ones({q.size(2), k.size(2)}, torch::TensorOptions().dtype(torch::kBool).device(q.device())).triu(1);
    s = s.masked_fill(above, -std::numeric_limits<float>::infinity());
  }
  return s;
}

}  // namespace blockwise_detail

MESHTORCH_DECL PartialAttention attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                       ChunkVisibility seen, double scale) {
  if (seen == ChunkVisibility::none) throw std::logic_error("cp::attend: a block the queries do not see");
  torch::NoGradGuard no_grad;  // attend_chunks' backward is its own
  const auto kr = blockwise_detail::repeat_heads(k, q.size(1)), vr = blockwise_detail::repeat_heads(v, q.size(1));
  if (q.device().is_cpu()) {
    auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(
        q, kr, vr, /*dropout_p=*/0.0, /*is_causal=*/seen == ChunkVisibility::causal, /*attn_mask=*/{}, scale);
    return {out.to(torch::kFloat), lse.to(torch::kFloat)};
  }
  const auto s = blockwise_detail::scores(q, kr, seen, scale);
  auto lse = s.logsumexp(-1);
  return {torch::matmul((s - lse.unsqueeze(-1)).exp(), vr.to(torch::kFloat)), lse};
}

MESHTORCH_DECL void merge_into(PartialAttention& total, const PartialAttention& block) {
  if (!total.out.defined()) {
    total = block;
    return;
  }
  const auto lse = torch::logaddexp(total.lse, block.lse);
  total.out = total.out * (total.lse - lse).exp().unsqueeze(-1) + block.out * (block.lse - lse).exp().unsqueeze(-1);
  total.lse = lse;
}

MESHTORCH_DECL std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> attend_backward(
    const torch::Tensor& grad_out, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
    const PartialAttention& total, ChunkVisibility seen, double scale) {
  torch::NoGradGuard no_grad;
  const auto kr = blockwise_detail::repeat_heads(k, q.size(1)), vr = blockwise_detail::repeat_heads(v, q.size(1));
  torch::Tensor dq, dk, dv;
  if (q.device().is_cpu()) {
    std::tie(dq, dk, dv) = at::_scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out.to(q.scalar_type()).contiguous(), q, kr, vr, total.out.to(q.scalar_type()), total.lse,
        /*dropout_p=*/0.0, /*is_causal=*/seen == ChunkVisibility::causal, /*attn_mask=*/{}, scale);
  } else {
    // Flash attention's backward with the merged softmax: P = exp(S - lse); dV = Pᵀ dO;
    // dS = P ∘ (dO Vᵀ - rowsum(dO ∘ O)); dQ = dS K · scale; dK = dSᵀ Q · scale.
    const auto go = grad_out.to(torch::kFloat);
    const auto p = (blockwise_detail::scores(q, kr, seen, scale) - total.lse.unsqueeze(-1)).exp();
    dv = torch::matmul(p.transpose(-2, -1), go);
    const auto ds =
        p * (torch::matmul(go, vr.to(torch::kFloat).transpose(-2, -1)) - (go * total.out).sum(-1, /*keepdim=*/true));
    dq = torch::matmul(ds, kr.to(torch::kFloat)) * scale;
    dk = torch::matmul(ds.transpose(-2, -1), q.to(torch::kFloat)) * scale;
  }
  return {dq.to(q.scalar_type()), blockwise_detail::sum_heads(dk, k.size(1)).to(k.scalar_type()),
          blockwise_detail::sum_heads(dv, v.size(1)).to(v.scalar_type())};
}

namespace blockwise_detail {

// attend_chunks as an autograd node: the inputs are the query chunks, then the keys, then the values.
struct AttendChunks : torch::autograd::Function<AttendChunks> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, at::TensorList queries, at::TensorList keys,
                               at::TensorList values, const std::vector<int>& q_chunks,
                               const std::vector<int>& kv_chunks, double scale) {
    std::vector<torch::Tensor> outputs, saved(queries.begin(), queries.end());
    saved.insert(saved.end(), keys.begin(), keys.end());
    saved.insert(saved.end(), values.begin(), values.end());
    for (std::size_t i = 0; i < queries.size(); ++i) {
      PartialAttention total;
      for (std::size_t j = 0; j < keys.size(); ++j) {
        const auto seen = visibility(q_chunks[i], kv_chunks[j]);
        if (seen != ChunkVisibility::none) merge_into(total, attend(queries[i], keys[j], values[j], seen, scale));
      }
      if (!total.out.defined())
        throw std::invalid_argument("cp::attend_chunks: a query chunk sees none of the key chunks given");
      outputs.push_back(total.out.to(queries[i].scalar_type()));
      saved.push_back(total.out);
      saved.push_back(total.lse);
    }
    ctx->save_for_backward(saved);
    ctx->saved_data["q_chunks"] = c10::List<int64_t>(std::vector<int64_t>(q_chunks.begin(), q_chunks.end()));
    ctx->saved_data["kv_chunks"] = c10::List<int64_t>(std::vector<int64_t>(kv_chunks.begin(), kv_chunks.end()));
    ctx->saved_data["scale"] = scale;
    return torch::cat(outputs, 2);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const auto q_chunks = ctx->saved_data["q_chunks"].toIntVector();
    const auto kv_chunks = ctx->saved_data["kv_chunks"].toIntVector();
    const double scale = ctx->saved_data["scale"].toDouble();
    const std::size_t nq = q_chunks.size(), nkv = kv_chunks.size();
    const std::vector<torch::Tensor> queries(saved.begin(), saved.begin() + nq),
        keys(saved.begin() + nq, saved.begin() + nq + nkv),
        values(saved.begin() + nq + nkv, saved.begin() + nq + 2 * nkv);
    const auto results = saved.begin() + nq + 2 * nkv;  // out, lse per query chunk
    std::vector<std::int64_t> split;
    for (const auto& q : queries) split.push_back(q.size(2));
    const auto grads = grad_outputs[0].split_with_sizes(split, 2);
    torch::autograd::variable_list dq(queries.size()), dk(keys.size()), dv(values.size());
    for (std::size_t i = 0; i < queries.size(); ++i) {
      const PartialAttention total{results[2 * i], results[2 * i + 1]};
      for (std::size_t j = 0; j < keys.size(); ++j) {
        const auto seen = visibility(static_cast<int>(q_chunks[i]), static_cast<int>(kv_chunks[j]));
        if (seen == ChunkVisibility::none) continue;
        auto [q_grad, k_grad, v_grad] = attend_backward(grads[i], queries[i], keys[j], values[j], total, seen, scale);
        dq[i] = dq[i].defined() ? dq[i] + q_grad : q_grad;
        dk[j] = dk[j].defined() ? dk[j] + k_grad : k_grad;
        dv[j] = dv[j].defined() ? dv[j] + v_grad : v_grad;
      }
    }
    torch::autograd::variable_list all;
    for (auto* part : {&dq, &dk, &dv}) all.insert(all.end(), part->begin(), part->end());
    all.insert(all.end(), {torch::Tensor(), torch::Tensor(), torch::Tensor()});  // chunks and scale
    return all;
  }
};

}  // namespace blockwise_detail

MESHTORCH_DECL torch::Tensor attend_chunks(const std::vector<torch::Tensor>& queries, const std::vector<int>& q_chunks,
                                           const std::vector<torch::Tensor>& keys,
                                           const std::vector<torch::Tensor>& values, const std::vector<int>& kv_chunks,
                                           double scale) {
  if (queries.size() != q_chunks.size() || keys.size() != kv_chunks.size() || keys.size() != values.size())
    throw std::invalid_argument("cp::attend_chunks: one chunk index per query chunk and per key/value chunk");
  return blockwise_detail::AttendChunks::apply(at::TensorList(queries), at::TensorList(keys), at::TensorList(values),
                                               q_chunks, kv_chunks, scale);
}

}  // namespace meshtorch::cp
#endif  // MESHTORCH_DEFINES(core)
