#pragma once
// Context parallel applied to a model from outside (docs/context-parallel.md): every attention's
// causal kernel is replaced by the split one over the CP group (parallel/context_parallel_attention.hpp),
// and each rank computes the loss of its head-tail chunks of the batch (layout/context_split.hpp)
// at their own positions, so rotary embeddings are those of the tokens it holds.
//
// The CP ranks of a replica read the same batch and hold different tokens of it, so their
// gradients are summed as data-parallel ones are: the wrappers that average gradients over
// DP x FSDP x CP (FSDP over FSDP x CP, DDP over DP x CP) see each rank's loss scaled by CP, so that
// the average is the whole batch's gradient, and the mean of the ranks' losses is its loss.
#include <cstdint>
#include <utility>

#include <meshtorch/torch.hpp>

#include <meshtorch/comm/axis_group.hpp>
#include <meshtorch/layout/context_split.hpp>
#include <meshtorch/models/llama/model.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch {

class ContextParallel {
 public:
  // Sets every decoder layer's attention to the split one over `group`, by `rotate`.
  MESHTORCH_DECL ContextParallel(llama::LlamaForCausalLM model, comm::AxisGroup group, cp::Rotate rotate);

  // This rank's two chunks of a [B, S] batch tensor along the sequence, concatenated.
  MESHTORCH_DECL torch::Tensor held(const torch::Tensor& whole) const;
  // The positions of those chunks in a sequence of `seq_length`, [1, S / CP].
  MESHTORCH_DECL torch::Tensor held_positions(std::int64_t seq_length, const torch::Device& device) const;
  // What this rank divides its chunks' summed token losses by, given the count the whole batch's
  // loss is averaged over: that count / CP, so that the wrappers' average over the CP ranks is
  // the batch's loss and gradient.
  torch::Tensor loss_divisor(const torch::Tensor& token_count) const {
    return token_count / static_cast<double>(group_.size());
  }

  // CP x the sum of this rank's token losses over the count of the whole batch's targets: see the
  // top of this header. `input_ids` and `labels` are the whole batch, as every CP rank reads it.
  MESHTORCH_DECL torch::Tensor loss(const torch::Tensor& input_ids, const torch::Tensor& labels);

  // Refuses a sequence length that does not split into 2 x CP chunks whose positions on a rank
  // also split over `tp` (sequence parallel), naming the flags and the nearest lengths that work.
  MESHTORCH_DECL void validate_sequence(std::int64_t seq_length, std::int64_t tp) const;

  const comm::AxisGroup& group() const { return group_; }
  cp::Rotate rotate() const { return rotate_; }

 private:
  llama::LlamaForCausalLM model_;
  comm::AxisGroup group_;
  cp::Rotate rotate_;
};

}  // namespace meshtorch

#if MESHTORCH_DEFINES(core)
#include <cmath>

#include <fmt/format.h>

#include <meshtorch/error.hpp>
#include <meshtorch/parallel/context_parallel_attention.hpp>

namespace meshtorch {

MESHTORCH_DECL ContextParallel::ContextParallel(llama::LlamaForCausalLM model, comm::AxisGroup group, cp::Rotate rotate)
    : model_(std::move(model)), group_(std::move(group)), rotate_(rotate) {
  for (auto& layer : model_->model->decoder_layers)
    layer->self_attn->causal_attention = [group = group_, rotate](const torch::Tensor& q, const torch::Tensor& k,
                                                                  const torch::Tensor& v) {
      return cp::split_attention(rotate, q, k, v, group, 1.0 / std::sqrt(static_cast<double>(q.size(-1))));
    };
}

MESHTORCH_DECL torch::Tensor ContextParallel::held(const torch::Tensor& whole) const {
  const int ranks = group_.size();
  const std::int64_t chunk = whole.size(1) / (2 * ranks);
  const auto chunks = cp::chunks_of(group_.rank(), ranks);
  return torch::cat({whole.narrow(1, chunks[0] * chunk, chunk), whole.narrow(1, chunks[1] * chunk, chunk)}, 1);
}

MESHTORCH_DECL torch::Tensor ContextParallel::loss(const torch::Tensor& input_ids, const torch::Tensor& labels) {
  if (const auto problem = cp::sequence_split_problem(input_ids.size(1), group_.size()); !problem.empty())
    throw ConfigError(fmt::format("context parallel over {}: a batch of {} positions: {}", group_.axis_name(),
                                  input_ids.size(1), problem));
  const auto targets = llama::LlamaForCausalLMImpl::next_token_targets(labels);
  return model_->loss_at(held(input_ids), held_positions(input_ids.size(1), input_ids.device()),
                         held(targets).reshape({-1}), loss_divisor(targets.ne(-100).sum().to(torch::kFloat)));
}

MESHTORCH_DECL torch::Tensor ContextParallel::held_positions(std::int64_t seq_length,
                                                             const torch::Device& device) const {
  return held(llama::LlamaModelImpl::default_positions(seq_length, device));
}

MESHTORCH_DECL void ContextParallel::validate_sequence(std::int64_t seq_length, std::int64_t tp) const {
  if (const auto problem = cp::sequence_split_problem(seq_length, group_.size(), tp); !problem.empty())
    throw ConfigError(problem);
}

}  // namespace meshtorch
#endif  // MESHTORCH_DEFINES(core)
