#pragma once
// Tensor (and sequence) parallel for Llama: applies a llama::Plan's styles to a model from
// outside, through the modules' forward hooks, as torch's parallelize_module does.
//
//   auto tp = meshtorch::apply_tensor_parallel<Plan>(model, mesh.group<TP>());   // shards weights in place
//   auto loss = tp.loss(input_ids, labels);                            // vocab-parallel when the plan says so
//
// Each style shards its module's weight (this rank keeps its chunk) and wraps the module's
// forward in the differentiable collectives its type names (Style::enter, Style::leave: forward
// and backward collective, chosen by collective_for<> at compile time; comm/differentiable.hpp
// runs them). Nothing here decides a collective again:
//   ColwiseParallel  enter: Replicate input -> f (identity, all-reduce of the gradient); Shard<d>
//                    input -> all-gather along d (reduce-scatter backward). Leave: Shard<-1> as
//                    it is, or all-gather to Replicate.
//   RowwiseParallel  Replicate input -> this rank's chunk; the partial sums leave by all-reduce
//                    (Replicate) or reduce-scatter along the sequence (Shard<1>).
//   SequenceParallel the norm runs on its sequence shard; its weight's gradient is a partial
//                    sum, which Style::weight (f) all-reduces: once per backward for all the
//                    norms together (tp_detail::NormGradientSum), not once per norm.
//   PrepareModuleInput enters the region once for a module whose children (q, k, v) share the
//                    input, so those children do not enter it again.
// The one exception is the vocabulary-sharded embedding: token ids are not activations, so it
// masks the ids outside this rank's rows before its leave collective sums the ranks' rows.
// The model builds its rotary tables from the token ids, which every TP rank holds whole, so
// positions stay right while the residual stream is sharded along the sequence.
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/torch.h>

#include <meshtorch/comm/axis_group.hpp>
#include <meshtorch/comm/collectives.hpp>
#include <meshtorch/comm/differentiable.hpp>
#include <meshtorch/error.hpp>
#include <meshtorch/layout/parallel_style.hpp>
#include <meshtorch/models/llama/model.hpp>
#include <meshtorch/parallel/llama_plan.hpp>

namespace meshtorch {

namespace tp_detail {

inline torch::Tensor chunk_of(const torch::Tensor& full, const comm::AxisGroup& group, std::int64_t dim,
                              const std::string& name) {
  if (full.size(dim) % group.size() != 0)
    throw ConfigError(fmt::format("{}: dim {} of size {} is not divisible by the TP size {}",
                                  name, dim, full.size(dim), group.size()));
  return full.chunk(group.size(), dim)[group.rank()].contiguous();
}

// The weights of the sequence-parallel norms: each rank's gradient of one covers its part of the
// sequence, and the weight's gradient is their sum over TP (the style's weight Redistribution,
// Partial -> Replicate: an all-reduce). Summed as backward reaches each norm, that is one
// blocking all-reduce per norm (2 per layer and the final norm). Instead each norm passes TP x its
// partial gradient on, and when the backward ends, after the wrappers' own callbacks (FSDP's
// reduce-scatters, DDP's buckets), the trained gradients of all the norms are averaged over TP in
// one all-reduce: the mean over ranks of g + TP x partial_r is g + the sum of the partials,
// whatever g held before (earlier micro-batches, the same on every TP rank) and whatever linear
// reductions (means over FSDP or DP) the wrappers applied in between.
class NormGradientSum : public std::enable_shared_from_this<NormGradientSum> {
 public:
  explicit NormGradientSum(comm::AxisGroup group) : group_(std::move(group)) {}

  void add(const std::string& name, torch::Tensor trained) { trained_.emplace_back(name, std::move(trained)); }
  // The tensors whose .grad the optimizer reads, by weight name: the norm weights themselves
  // unless a wrapper (FSDP, ZeRO-2) trains pieces of them.
  void use_trained(const std::map<std::string, torch::Tensor>& by_name) {
    for (auto& [name, tensor] : trained_) {
      const auto it = by_name.find(name);
      if (it == by_name.end())
        throw ConfigError(fmt::format("tensor parallel: nothing trains the sequence-parallel norm weight '{}' on {}",
                                      name, group_.describe()));
      tensor = it->second;
    }
  }
  bool empty() const { return trained_.empty(); }

  // On the loss: its gradient is the first of the backward, in the outermost graph task (a
  // checkpointed layer's recomputation runs a nested one), where the sum is queued.
  torch::Tensor start_backward_at(const torch::Tensor& loss) {
    if (trained_.empty() || !loss.requires_grad() || !torch::GradMode::is_enabled()) return loss;
    auto view = loss.view_as(loss);
    view.register_hook([self = shared_from_this()](const torch::Tensor& grad) {
      self->queue_sum();
      return grad;
    });
    return view;
  }

  // On a norm weight (a parametrization): TP x its gradient, summed when the backward ends.
  torch::Tensor partial_gradient_of(const torch::Tensor& weight, const std::string& name) {
    if (!weight.requires_grad() || !torch::GradMode::is_enabled()) return weight;  // no backward to come
    auto view = weight.view_as(weight);
    view.register_hook([self = shared_from_this(), name](const torch::Tensor& grad) {
      if (self->queued_for_ == -1)
        throw ConfigError(fmt::format("tensor parallel: the gradient of the sequence-parallel norm '{}' reached a "
                                      "backward that did not start at TensorParallel::loss (or ParallelLlama::loss), "
                                      "so its sum over the {} would never run; compute the loss through them",
                                      name, self->group_.describe()));
      return grad * static_cast<double>(self->group_.size());
    });
    return view;
  }

 private:
  void queue_sum() {
    const auto task = torch::autograd::get_current_graph_task_id();
    if (task == queued_for_) return;
    queued_for_ = task;
    // Queued from the first final callback, the sum runs after every callback queued during the
    // backward: the wrappers' reductions are in .grad by then.
    torch::autograd::Engine::get_default_engine().queue_callback([self = shared_from_this()] {
      torch::autograd::Engine::get_default_engine().queue_callback([self] { self->sum(); });
    });
  }

  void sum() {
    queued_for_ = -1;
    torch::NoGradGuard no_grad;
    std::vector<torch::Tensor> grads;
    for (auto& [name, tensor] : trained_)
      if (tensor.grad().defined()) grads.push_back(tensor.mutable_grad());
    if (grads.empty()) return;
    std::vector<torch::Tensor> flat_pieces;
    std::vector<std::int64_t> sizes;
    for (const auto& g : grads) {
      flat_pieces.push_back(g.reshape(-1));
      sizes.push_back(g.numel());
    }
    const auto on_group = torch::Device(group_.device_name());
    auto flat = comm::all_reduce(group_, torch::cat(flat_pieces).to(on_group), comm::ReduceOp::avg);
    auto averaged = flat.to(grads.front().device()).split_with_sizes(sizes);
    for (std::size_t i = 0; i < grads.size(); ++i) grads[i].copy_(averaged[i].view_as(grads[i]));
  }

  comm::AxisGroup group_;
  std::vector<std::pair<std::string, torch::Tensor>> trained_;
  std::int64_t queued_for_ = -1;  // the graph task the sum is queued for; -1: none
};

}  // namespace tp_detail

template <class PlanT>
class TensorParallel {
  using S = typename PlanT::styles;

 public:
  TensorParallel(llama::LlamaForCausalLM& model, const comm::AxisGroup& group)
      : model_(model), group_(group), norm_gradients_(std::make_shared<tp_detail::NormGradientSum>(group)) {
    PlanT::validate(model->config, group.size());
    if (PlanT::tp_extent != dynamic && static_cast<int>(PlanT::tp_extent) != group.size())
      throw ConfigError(fmt::format("TensorParallel: the plan's TP extent is {} but the group {} has {} ranks",
                                    PlanT::tp_extent, group.describe(), group.size()));
    if (group.size() == 1) return;  // a TP axis of one rank: nothing to split
    auto& lm = *model;
    auto& inner = *lm.model;
    apply<typename S::embed_tokens>("model.embed_tokens", *inner.embed_tokens, /*entered=*/false);
    for (std::size_t i = 0; i < inner.decoder_layers.size(); ++i) {
      auto& layer = *inner.decoder_layers[i];
      const std::string prefix = "model.layers." + std::to_string(i) + ".";
      apply<typename S::input_layernorm>(prefix + "input_layernorm", *layer.input_layernorm, false);
      prepare<typename S::self_attn>(layer.self_attn->hooks);
      constexpr bool attention_entered = PrepareModuleInputStyle<typename S::self_attn>;
      auto& attn = *layer.self_attn;
      apply<typename S::q_proj>(prefix + "self_attn.q_proj", *attn.q_proj, attention_entered);
      apply<typename S::k_proj>(prefix + "self_attn.k_proj", *attn.k_proj, attention_entered);
      apply<typename S::v_proj>(prefix + "self_attn.v_proj", *attn.v_proj, attention_entered);
      apply<typename S::o_proj>(prefix + "self_attn.o_proj", *attn.o_proj, false);
      apply<typename S::post_attention_layernorm>(prefix + "post_attention_layernorm",
                                                  *layer.post_attention_layernorm, false);
      prepare<typename S::mlp>(layer.mlp->hooks);
      constexpr bool mlp_entered = PrepareModuleInputStyle<typename S::mlp>;
      auto& mlp = *layer.mlp;
      apply<typename S::gate_proj>(prefix + "mlp.gate_proj", *mlp.gate_proj, mlp_entered);
      apply<typename S::up_proj>(prefix + "mlp.up_proj", *mlp.up_proj, mlp_entered);
      apply<typename S::down_proj>(prefix + "mlp.down_proj", *mlp.down_proj, false);
    }
    apply<typename S::norm>("model.norm", *inner.norm, false);
    apply_head();
    // Loss parallel: the logits stay split over the vocabulary and the loss is computed across
    // the TP ranks (also chunk by chunk, as the model's loss() chooses).
    if constexpr (PlanT::loss_parallel) {
      if (group_.size() > 1)
        model_->token_loss = [group = group_](const torch::Tensor& logits, const torch::Tensor& targets) {
          return vocab_parallel_cross_entropy_sum(logits, targets, group);
        };
    }
  }

  const comm::AxisGroup& group() const { return group_; }

  // Mean next-token cross entropy of the batch. With loss parallel the logits stay sharded over
  // the vocabulary and the softmax is computed across the TP ranks (Megatron's vocab-parallel
  // cross entropy), so no rank ever holds [batch, seq, vocab] logits.
  torch::Tensor loss(const torch::Tensor& input_ids, const torch::Tensor& labels) {
    return norm_gradients_->start_backward_at(model_->loss(input_ids, labels));
  }

  // The sequence-parallel norms' weights, whose gradients are summed over TP when a backward ends:
  // a wrapper that trains pieces of them (FSDP) names those here, by weight name.
  void sum_norm_gradients_into(const std::map<std::string, torch::Tensor>& trained_by_name) {
    norm_gradients_->use_trained(trained_by_name);
  }

  // The full (unsharded) value of every parameter under its HF name, gathered over TP; every rank
  // of the group gets them. For saving a checkpoint that a single process or transformers loads.
  std::vector<std::pair<std::string, torch::Tensor>> full_parameters() const {
    std::vector<std::pair<std::string, torch::Tensor>> out;
    torch::NoGradGuard no_grad;
    for (auto& item : model_->named_parameters()) {
      const auto it = sharded_.find(item.key());
      out.emplace_back(item.key(), it == sharded_.end() ? item.value().detach()
                                                        : comm::all_gather(group_, item.value().detach(), it->second));
    }
    return out;
  }

  // This rank's piece of a full parameter value (for loading a full checkpoint into the shards).
  torch::Tensor shard_of(const std::string& name, const torch::Tensor& full) const {
    const auto it = sharded_.find(name);
    return it == sharded_.end() ? full : tp_detail::chunk_of(full, group_, it->second, name);
  }

  // Along which dim each sharded parameter was cut (absent: replicated).
  std::optional<std::int64_t> shard_dim(const std::string& name) const {
    const auto it = sharded_.find(name);
    if (it == sharded_.end()) return std::nullopt;
    return it->second;
  }

  // The sum of the cross entropies of rows of this rank's vocabulary slice of the logits
  // [n, vocab / TP] against targets [n] (-100 ignored): the model's token_loss under loss parallel.
  static torch::Tensor vocab_parallel_cross_entropy_sum(const torch::Tensor& local_logits, const torch::Tensor& targets,
                                                        const comm::AxisGroup& group) {
    const auto local_vocab = local_logits.size(-1);
    const auto first = local_vocab * group.rank();
    auto logits = local_logits.to(torch::kFloat).reshape({-1, local_vocab});
    // A shift for a stable softmax; any value works, so it carries no gradient.
    auto shift = comm::all_reduce(group, logits.detach().amax(-1), comm::ReduceOp::max);
    auto shifted = logits - shift.unsqueeze(-1);
    auto sum_exp = comm::reduce_from_parallel_region(shifted.exp().sum(-1), group);
    const auto in_range = targets.ge(first).logical_and(targets.lt(first + local_vocab));
    auto local_targets = (targets - first).clamp(0, local_vocab - 1);
    auto picked = shifted.gather(1, local_targets.unsqueeze(1)).squeeze(1) * in_range.to(shifted.scalar_type());
    auto target_logit = comm::reduce_from_parallel_region(picked, group);
    const auto valid = targets.ne(-100).to(torch::kFloat);
    return ((sum_exp.log() - target_logit) * valid).sum();
  }

 private:
  // Colwise / rowwise / sequence parallel / none on one leaf module.
  template <class Style>
  void apply(const std::string& name, llama::WeightModule& module, bool entered) {
    if constexpr (ColwiseStyle<Style>) {
      const bool is_embedding = dynamic_cast<llama::EmbeddingImpl*>(&module) != nullptr;
      if (is_embedding)
        throw ConfigError(fmt::format("{}: ColwiseParallel on an embedding is not supported; shard the vocabulary "
                                      "with RowwiseParallel<Replicate, ...> (as torchtitan does)",
                                      name));
      shard(name, module, 0);
      if (!entered) add_enter<Style>(module.hooks);
      add_leave<Style>(module.hooks);
    } else if constexpr (RowwiseStyle<Style>) {
      const auto group = group_;
      if (auto* embedding = dynamic_cast<llama::EmbeddingImpl*>(&module)) {
        if (!std::is_same_v<typename Style::input, Replicate>)
          throw ConfigError(fmt::format("{}: RowwiseParallel on an embedding takes the token ids whole: use "
                                        "RowwiseParallel<Replicate, ...>",
                                        name));
        shard(name, module, 0);
        const std::int64_t rows = embedding->weight.size(0);
        const std::int64_t first = rows * group.rank();
        // Token ids outside this rank's rows look up row 0 and are zeroed after: the sum over
        // the ranks (the reduction that leaves the region) holds every token's row once.
        module.hooks.pre.push_back([first, rows](const torch::Tensor& ids) {
          auto local = ids - first;
          return local.masked_fill(local.lt(0).logical_or(local.ge(rows)), 0);
        });
        module.hooks.post.push_back([group, first, rows](const torch::Tensor& ids, const torch::Tensor& out) {
          const auto outside = ids.lt(first).logical_or(ids.ge(first + rows)).unsqueeze(-1);
          return comm::redistribute_differentiable<typename Style::leave>(out.masked_fill(outside, 0), group);
        });
      } else {
        shard(name, module, 1);
        add_enter<Style>(module.hooks);
        add_leave<Style>(module.hooks);
      }
    } else if constexpr (SequenceParallelStyle<Style>) {
      // Each rank's gradient covers its part of the sequence; the weight's is their sum, the
      // all-reduce of the style's weight Redistribution, run for all norms at once when the
      // backward ends. A parametrization, so it holds when a wrapper (FSDP) swaps the weight
      // tensor for a gathered one.
      static_assert(Style::weight::forward == Collective::none && Style::weight::backward == Collective::all_reduce,
                    "a sequence-parallel norm's weight is replicated forward and its gradient summed over TP");
      norm_gradients_->add(name + ".weight", module.weight);
      module.parametrizations.push_back([sum = norm_gradients_, weight_name = name + ".weight"](const torch::Tensor& w) {
        return sum->partial_gradient_of(w, weight_name);
      });
    } else {
      static_assert(std::is_same_v<Style, NoParallel>, "this style does not apply to a leaf module");
    }
  }

  template <class Style>
  void prepare(ForwardHooks& hooks) {
    if constexpr (PrepareModuleInputStyle<Style>) {
      add_enter<Style>(hooks);
    } else {
      static_assert(std::is_same_v<Style, NoParallel>,
                    "self_attn and mlp take PrepareModuleInput<In, Replicate> or NoParallel");
    }
  }

  // A style's collectives around a module, as the style's type names them.
  template <class Style>
  void add_enter(ForwardHooks& hooks) {
    using R = typename Style::enter;
    if constexpr (R::forward != Collective::none || R::backward != Collective::none) {
      const auto group = group_;
      hooks.pre.push_back([group](const torch::Tensor& x) { return comm::redistribute_differentiable<R>(x, group); });
    }
  }
  template <class Style>
  void add_leave(ForwardHooks& hooks) {
    using R = typename Style::leave;
    if constexpr (R::forward != Collective::none || R::backward != Collective::none) {
      const auto group = group_;
      hooks.post.push_back([group](const torch::Tensor&, const torch::Tensor& y) {
        return comm::redistribute_differentiable<R>(y, group);
      });
    }
  }

  // The output projection is lm_head, or the embedding matrix when tied; its hooks are the
  // model's head_hooks either way.
  void apply_head() {
    using Style = typename S::lm_head;
    auto& lm = *model_;
    if constexpr (ColwiseStyle<Style>) {
      if (lm.lm_head) shard("lm_head", *lm.lm_head, 0);
      add_enter<Style>(lm.head_hooks);
      add_leave<Style>(lm.head_hooks);
    } else {
      static_assert(std::is_same_v<Style, NoParallel>, "lm_head takes ColwiseParallel or NoParallel");
    }
  }

  void shard(const std::string& name, llama::WeightModule& module, std::int64_t dim) {
    torch::NoGradGuard no_grad;
    module.set_weight(tp_detail::chunk_of(module.weight.detach(), group_, dim, name + ".weight"));
    sharded_[name + ".weight"] = dim;
  }

  llama::LlamaForCausalLM model_;
  comm::AxisGroup group_;
  // The dim along which each sharded weight was cut, by HF name, to gather it back for saving.
  std::map<std::string, std::int64_t> sharded_;
  std::shared_ptr<tp_detail::NormGradientSum> norm_gradients_;
};

// Applies Plan's tensor-parallel styles to `model` over the TP group (weights sharded in place).
// parallelize() (parallelize.hpp) does this for a mesh with a TP axis, with FSDP and DP after it.
template <class PlanT>
TensorParallel<PlanT> apply_tensor_parallel(llama::LlamaForCausalLM& model, const comm::AxisGroup& tp_group) {
  return TensorParallel<PlanT>(model, tp_group);
}

}  // namespace meshtorch
