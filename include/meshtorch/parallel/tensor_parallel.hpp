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
//                    (Replicate) or reduce-scatter along the sequence (Shard<1>). A bias stays
//                    whole, added by rank 0 alone; its gradient joins the norms' sum.
//   Colwise biases are split with their layer's output rows.
//   SequenceParallel the norm runs on its sequence shard; its weight's gradient is a partial
//                    sum, which Style::weight (f) all-reduces: once per backward for all the
//                    norms together (tp_detail::NormGradientSum), not once per norm.
//   PrepareModuleInput enters the region once for a module whose children (q, k, v) share the
//                    input, so those children do not enter it again.
// The one exception is the vocabulary-sharded embedding: token ids are not activations, so it
// masks the ids outside this rank's rows before its leave collective sums the ranks' rows.
// Qwen3's q/k norms have no style of their own: they follow q_proj and k_proj. Their weight (one
// for every head) stays whole; with the heads split by ColwiseParallel each rank's gradient
// covers its heads only, a partial sum that joins the sequence-parallel norms' all-reduce.
// The model builds its rotary tables from the token ids, which every TP rank holds whole, so
// positions stay right while the residual stream is sharded along the sequence.
#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include <meshtorch/torch.hpp>

#include <meshtorch/comm/axis_group.hpp>
#include <meshtorch/comm/differentiable.hpp>
#include <meshtorch/error.hpp>
#include <meshtorch/layout/parallel_style.hpp>
#include <meshtorch/models/forward_hooks.hpp>
#include <meshtorch/models/llama/model.hpp>
#include <meshtorch/models/llama/plan.hpp>
#include <meshtorch/models/weight_module.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch {

namespace tp_detail {

MESHTORCH_DECL torch::Tensor chunk_of(const torch::Tensor& full, const comm::AxisGroup& group, std::int64_t dim,
                                      const std::string& name);

enum class StyleKind { none, colwise, rowwise, sequence_parallel, prepare_input };

// A style as the run time applies it, made from its type at compile time. The code that applies
// styles takes these values, so it is compiled once per program, not once per plan.
struct StyleSteps {
  StyleKind kind = StyleKind::none;
  comm::RedistributionSteps enter, leave;
  bool replicated_input = true;  // the style takes its input whole (an embedding needs the ids so)
};

template <class Style>
constexpr StyleSteps steps_of() {
  const StyleKind kind = ColwiseStyle<Style>              ? StyleKind::colwise
                         : RowwiseStyle<Style>            ? StyleKind::rowwise
                         : SequenceParallelStyle<Style>   ? StyleKind::sequence_parallel
                         : PrepareModuleInputStyle<Style> ? StyleKind::prepare_input
                                                          : StyleKind::none;
  return {kind, comm::redistribution_steps<typename Style::enter>, comm::redistribution_steps<typename Style::leave>,
          std::is_same_v<typename Style::input, Replicate>};
}

// Every role's style of a plan, under the role's name (llama::LlamaRoles, the one role list).
struct PlanSteps {
  static constexpr std::size_t role_count = std::tuple_size_v<llama::LlamaRoles<llama::SequenceParallelStyles>>;
  std::array<std::pair<std::string_view, StyleSteps>, role_count> roles{};
  bool loss_parallel = false;

  // The role's steps; a name outside the role list is a bug here, not a user's mistake.
  MESHTORCH_DECL const StyleSteps& operator[](std::string_view role) const;
};

// What a style may be where TensorParallel applies it: checked when a plan is applied.
template <class S>
consteval bool check_applicable() {
  llama::for_each_role<S>([]<class R>() {
    using Style = typename R::style;
    constexpr std::string_view name = R::name;
    if constexpr (name == "self_attn" || name == "mlp") {
      static_assert(PrepareModuleInputStyle<Style> || std::is_same_v<Style, NoParallel>,
                    "self_attn and mlp take PrepareModuleInput<In, Replicate> or NoParallel");
    } else if constexpr (name == "lm_head") {
      static_assert(ColwiseStyle<Style> || std::is_same_v<Style, NoParallel>,
                    "lm_head takes ColwiseParallel or NoParallel");
    } else {
      static_assert(!PrepareModuleInputStyle<Style>, "this style does not apply to a leaf module");
    }
    if constexpr (SequenceParallelStyle<Style>)
      static_assert(Style::weight::forward == Collective::none && Style::weight::backward == Collective::all_reduce,
                    "a sequence-parallel norm's weight is replicated forward and its gradient summed over TP");
  });
  return true;
}

template <class PlanT>
constexpr PlanSteps plan_steps_of() {
  static_assert(std::tuple_size_v<llama::LlamaRoles<typename PlanT::styles>> == PlanSteps::role_count);
  PlanSteps out;
  std::size_t i = 0;
  llama::for_each_role<typename PlanT::styles>([&]<class R>() {
    out.roles[i++] = {R::name, steps_of<typename R::style>()};
  });
  out.loss_parallel = PlanT::loss_parallel;
  return out;
}

// The steps of a plan whose mesh may have no TP axis: none then (every wrapper of a mesh type asks).
template <class PlanT>
inline constexpr PlanSteps plan_steps_if_tp = [] {
  if constexpr (PlanT::has_tp) {
    static_assert(check_applicable<typename PlanT::styles>());
    return plan_steps_of<PlanT>();
  } else {
    return PlanSteps{};
  }
}();

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
  MESHTORCH_DECL void use_trained(const std::map<std::string, torch::Tensor>& by_name);
  bool empty() const { return trained_.empty(); }

  // On the loss: its gradient is the first of the backward, in the outermost graph task (a
  // checkpointed layer's recomputation runs a nested one), where the sum is queued.
  MESHTORCH_DECL torch::Tensor start_backward_at(const torch::Tensor& loss);

  // On a norm weight (a parametrization): TP x its gradient, summed when the backward ends.
  MESHTORCH_DECL torch::Tensor partial_gradient_of(const torch::Tensor& weight, const std::string& name);

  // For a caller that runs backward in pieces from other starts than the loss (a pipeline's
  // stages, micro-batch by micro-batch): the partials accumulate through all of them, and
  // sum_now() sums once, after the last.
  void expect_sum_by_caller() { queued_for_ = summed_by_caller; }
  void sum_now() { sum(); }

 private:
  MESHTORCH_DECL void queue_sum();
  MESHTORCH_DECL void sum();

  comm::AxisGroup group_;
  std::vector<std::pair<std::string, torch::Tensor>> trained_;
  static constexpr std::int64_t summed_by_caller = -2;
  std::int64_t queued_for_ = -1;  // the graph task the sum is queued for; -1: none; summed_by_caller
};

}  // namespace tp_detail

// What TensorParallel<Plan> does, for the plan's styles as values (tp_detail::PlanSteps): one
// copy of the code in a program however many plans it applies.
class TensorParallelRuntime {
 public:
  // Shards the model's weights in place and sets its modules' hooks. The plan was checked
  // against the model and the group before (TensorParallel's constructor does).
  MESHTORCH_DECL TensorParallelRuntime(llama::LlamaForCausalLM& model, const comm::AxisGroup& group,
                                       const tp_detail::PlanSteps& plan);

  const comm::AxisGroup& group() const { return group_; }

  // Mean next-token cross entropy of the batch. With loss parallel the logits stay sharded over
  // the vocabulary and the softmax is computed across the TP ranks (Megatron's vocab-parallel
  // cross entropy), so no rank ever holds [batch, seq, vocab] logits.
  torch::Tensor loss(const torch::Tensor& input_ids, const torch::Tensor& labels) {
    return start_backward_at(model_->loss(input_ids, labels));
  }

  // For a loss computed otherwise (context parallel's, of a rank's chunks): its backward sums the
  // sequence-parallel norms' gradients over TP when it ends, as loss()'s does.
  torch::Tensor start_backward_at(const torch::Tensor& loss) { return norm_gradients_->start_backward_at(loss); }

  // The sequence-parallel norms' weights, whose gradients are summed over TP when a backward ends:
  // a wrapper that trains pieces of them (FSDP) names those here, by weight name.
  void sum_norm_gradients_into(const std::map<std::string, torch::Tensor>& trained_by_name) {
    norm_gradients_->use_trained(trained_by_name);
  }

  // Backward run by the caller in pieces (a pipeline's schedule): between the two calls the norms'
  // partial gradients accumulate, and the second sums them over TP once.
  void begin_backward_in_pieces() { norm_gradients_->expect_sum_by_caller(); }
  void end_backward_in_pieces() { norm_gradients_->sum_now(); }

  // The full (unsharded) value of every parameter under its HF name, gathered over TP; every rank
  // of the group gets them. For saving a checkpoint that a single process or transformers loads.
  MESHTORCH_DECL std::vector<std::pair<std::string, torch::Tensor>> full_parameters() const;

  // This rank's piece of a full parameter value (for loading a full checkpoint into the shards).
  MESHTORCH_DECL torch::Tensor shard_of(const std::string& name, const torch::Tensor& full) const;

  // Along which dim each sharded parameter was cut (absent: replicated).
  std::optional<std::int64_t> shard_dim(const std::string& name) const {
    const auto it = sharded_.find(name);
    if (it == sharded_.end()) return std::nullopt;
    return it->second;
  }

  // The sum of the cross entropies of rows of this rank's vocabulary slice of the logits
  // [n, vocab / TP] against targets [n] (-100 ignored): the model's token_loss under loss parallel.
  MESHTORCH_DECL static torch::Tensor vocab_parallel_cross_entropy_sum(const torch::Tensor& local_logits,
                                                                       const torch::Tensor& targets,
                                                                       const comm::AxisGroup& group);

 private:
  // Colwise / rowwise / sequence parallel / none on one leaf module.
  MESHTORCH_DECL void apply(const std::string& name, WeightModule& module, const tp_detail::StyleSteps& style,
                            bool entered);
  // A style's collectives around a module.
  MESHTORCH_DECL void add_enter(ForwardHooks& hooks, const tp_detail::StyleSteps& style);
  MESHTORCH_DECL void add_leave(ForwardHooks& hooks, const tp_detail::StyleSteps& style);
  // The output projection is lm_head, or the embedding matrix when tied; its hooks are the
  // model's head_hooks either way.
  MESHTORCH_DECL void apply_head(const tp_detail::StyleSteps& style);
  MESHTORCH_DECL void shard(const std::string& name, WeightModule& module, std::int64_t dim);
  // A whole tensor whose gradient is a partial sum on each rank (a sequence-parallel norm's weight,
  // a per-head norm's with the heads split, a rowwise layer's bias): summed over the group when
  // the backward ends.
  MESHTORCH_DECL void sum_partial_gradient(const std::string& name, WeightModule& module,
                                           LeafSlot slot = LeafSlot::weight);

  llama::LlamaForCausalLM model_;
  comm::AxisGroup group_;
  // The dim along which each sharded weight was cut, by HF name, to gather it back for saving.
  std::map<std::string, std::int64_t> sharded_;
  std::shared_ptr<tp_detail::NormGradientSum> norm_gradients_;
};

// Tensor parallel for a plan: checks the plan against the model and the group, then applies its
// styles (TensorParallelRuntime, which takes them as values made here at compile time).
template <class PlanT>
class TensorParallel : public TensorParallelRuntime {
  static_assert(tp_detail::check_applicable<typename PlanT::styles>());
  static constexpr tp_detail::PlanSteps steps = tp_detail::plan_steps_of<PlanT>();

 public:
  TensorParallel(llama::LlamaForCausalLM& model, const comm::AxisGroup& group)
      : TensorParallelRuntime(model, checked(model, group), steps) {}

 private:
  static const comm::AxisGroup& checked(llama::LlamaForCausalLM& model, const comm::AxisGroup& group) {
    PlanT::validate(model->config, group.size());
    if (PlanT::tp_extent != dynamic && static_cast<int>(PlanT::tp_extent) != group.size())
      throw ConfigError(fmt::format("TensorParallel: the plan's TP extent is {} but the group {} has {} ranks",
                                    PlanT::tp_extent, group.describe(), group.size()));
    return group;
  }
};

// Applies Plan's tensor-parallel styles to `model` over the TP group (weights sharded in place).
// parallelize() (parallelize.hpp) does this for a mesh with a TP axis, with FSDP and DP after it.
template <class PlanT>
TensorParallel<PlanT> apply_tensor_parallel(llama::LlamaForCausalLM& model, const comm::AxisGroup& tp_group) {
  return TensorParallel<PlanT>(model, tp_group);
}

}  // namespace meshtorch

#if MESHTORCH_DEFINES(core)
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>

#include <meshtorch/comm/collectives.hpp>

namespace meshtorch {

namespace tp_detail {

MESHTORCH_DECL torch::Tensor chunk_of(const torch::Tensor& full, const comm::AxisGroup& group, std::int64_t dim,
                                      const std::string& name) {
  if (full.size(dim) % group.size() != 0)
    throw ConfigError(fmt::format("{}: dim {} of size {} is not divisible by the TP size {}", name, dim, full.size(dim),
                                  group.size()));
  return full.chunk(group.size(), dim)[group.rank()].contiguous();
}

MESHTORCH_DECL const StyleSteps& PlanSteps::operator[](std::string_view role) const {
  for (const auto& [name, steps] : roles)
    if (name == role) return steps;
  throw ConfigError(fmt::format("tensor parallel: no role '{}' in the plan's styles", role));
}

MESHTORCH_DECL void NormGradientSum::use_trained(const std::map<std::string, torch::Tensor>& by_name) {
  for (auto& [name, tensor] : trained_) {
    const auto it = by_name.find(name);
    if (it == by_name.end())
      throw ConfigError(fmt::format("tensor parallel: nothing trains '{}' (its gradient summed over TP) on {}", name,
                                    group_.describe()));
    tensor = it->second;
  }
}

MESHTORCH_DECL torch::Tensor NormGradientSum::start_backward_at(const torch::Tensor& loss) {
  if (trained_.empty() || !loss.requires_grad() || !torch::GradMode::is_enabled()) return loss;
  auto view = loss.view_as(loss);
  view.register_hook([self = shared_from_this()](const torch::Tensor& grad) {
    self->queue_sum();
    return grad;
  });
  return view;
}

MESHTORCH_DECL torch::Tensor NormGradientSum::partial_gradient_of(const torch::Tensor& weight,
                                                                  const std::string& name) {
  if (!weight.requires_grad() || !torch::GradMode::is_enabled()) return weight;  // no backward to come
  auto view = weight.view_as(weight);
  view.register_hook([self = shared_from_this(), name](const torch::Tensor& grad) {
    if (self->queued_for_ == -1)
      throw ConfigError(
          fmt::format("tensor parallel: the gradient of '{}' (a partial sum on each rank) reached a "
                      "backward that did not start at TensorParallel::loss (or ParallelLlama::loss), "
                      "so its sum over the {} would never run; compute the loss through them",
                      name, self->group_.describe()));
    return grad * static_cast<double>(self->group_.size());
  });
  return view;
}

MESHTORCH_DECL void NormGradientSum::queue_sum() {
  const auto task = torch::autograd::get_current_graph_task_id();
  if (task == queued_for_) return;
  queued_for_ = task;
  // Queued from the first final callback, the sum runs after every callback queued during the
  // backward: the wrappers' reductions are in .grad by then.
  torch::autograd::Engine::get_default_engine().queue_callback([self = shared_from_this()] {
    torch::autograd::Engine::get_default_engine().queue_callback([self] { self->sum(); });
  });
}

MESHTORCH_DECL void NormGradientSum::sum() {
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

}  // namespace tp_detail

MESHTORCH_DECL TensorParallelRuntime::TensorParallelRuntime(llama::LlamaForCausalLM& model,
                                                            const comm::AxisGroup& group,
                                                            const tp_detail::PlanSteps& plan)
    : model_(model), group_(group), norm_gradients_(std::make_shared<tp_detail::NormGradientSum>(group)) {
  if (group.size() == 1) return;  // a TP axis of one rank: nothing to split
  using tp_detail::StyleKind;
  auto& lm = *model;
  auto& inner = *lm.model;
  apply("model.embed_tokens", *inner.embed_tokens, plan["embed_tokens"], /*entered=*/false);
  const auto& attention_input = plan["self_attn"];
  const auto& mlp_input = plan["mlp"];
  // A module that prepares its input enters the region once for its children (q, k, v; gate, up).
  const bool attention_entered = attention_input.kind == StyleKind::prepare_input;
  const bool mlp_entered = mlp_input.kind == StyleKind::prepare_input;
  for (std::size_t i = 0; i < inner.decoder_layers.size(); ++i) {
    auto& layer = *inner.decoder_layers[i];
    const std::string prefix = fmt::format("model.layers.{}.", i);
    apply(prefix + "input_layernorm", *layer.input_layernorm, plan["input_layernorm"], false);
    if (attention_entered) add_enter(layer.self_attn->hooks, attention_input);
    auto& attn = *layer.self_attn;
    apply(prefix + "self_attn.q_proj", *attn.q_proj, plan["q_proj"], attention_entered);
    apply(prefix + "self_attn.k_proj", *attn.k_proj, plan["k_proj"], attention_entered);
    apply(prefix + "self_attn.v_proj", *attn.v_proj, plan["v_proj"], attention_entered);
    apply(prefix + "self_attn.o_proj", *attn.o_proj, plan["o_proj"], false);
    if (attn.q_norm && plan["q_proj"].kind == StyleKind::colwise)
      sum_partial_gradient(prefix + "self_attn.q_norm", *attn.q_norm);
    if (attn.k_norm && plan["k_proj"].kind == StyleKind::colwise)
      sum_partial_gradient(prefix + "self_attn.k_norm", *attn.k_norm);
    apply(prefix + "post_attention_layernorm", *layer.post_attention_layernorm, plan["post_attention_layernorm"],
          false);
    if (mlp_entered) add_enter(layer.mlp->hooks, mlp_input);
    auto& mlp = *layer.mlp;
    apply(prefix + "mlp.gate_proj", *mlp.gate_proj, plan["gate_proj"], mlp_entered);
    apply(prefix + "mlp.up_proj", *mlp.up_proj, plan["up_proj"], mlp_entered);
    apply(prefix + "mlp.down_proj", *mlp.down_proj, plan["down_proj"], false);
  }
  apply("model.norm", *inner.norm, plan["norm"], false);
  apply_head(plan["lm_head"]);
  // Loss parallel: the logits stay split over the vocabulary and the loss is computed across
  // the TP ranks (also chunk by chunk, as the model's loss() chooses).
  if (plan.loss_parallel)
    model_->token_loss = [group = group_](const torch::Tensor& logits, const torch::Tensor& targets) {
      return vocab_parallel_cross_entropy_sum(logits, targets, group);
    };
}

MESHTORCH_DECL std::vector<std::pair<std::string, torch::Tensor>> TensorParallelRuntime::full_parameters() const {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  torch::NoGradGuard no_grad;
  for (auto& item : model_->named_parameters()) {
    const auto it = sharded_.find(item.key());
    out.emplace_back(item.key(), it == sharded_.end() ? item.value().detach()
                                                      : comm::all_gather(group_, item.value().detach(), it->second));
  }
  return out;
}

MESHTORCH_DECL torch::Tensor TensorParallelRuntime::shard_of(const std::string& name, const torch::Tensor& full) const {
  const auto it = sharded_.find(name);
  return it == sharded_.end() ? full : tp_detail::chunk_of(full, group_, it->second, name);
}

MESHTORCH_DECL torch::Tensor TensorParallelRuntime::vocab_parallel_cross_entropy_sum(const torch::Tensor& local_logits,
                                                                                     const torch::Tensor& targets,
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

MESHTORCH_DECL void TensorParallelRuntime::apply(const std::string& name, WeightModule& module,
                                                 const tp_detail::StyleSteps& style, bool entered) {
  using tp_detail::StyleKind;
  switch (style.kind) {
    case StyleKind::colwise: {
      if (dynamic_cast<llama::EmbeddingImpl*>(&module) != nullptr)
        throw ConfigError(
            fmt::format("{}: ColwiseParallel on an embedding is not supported; shard the vocabulary "
                        "with RowwiseParallel<Replicate, ...> (as torchtitan does)",
                        name));
      shard(name, module, 0);
      if (!entered) add_enter(module.hooks, style);
      add_leave(module.hooks, style);
      return;
    }
    case StyleKind::rowwise: {
      auto* embedding = dynamic_cast<llama::EmbeddingImpl*>(&module);
      if (embedding == nullptr) {
        shard(name, module, 1);
        add_enter(module.hooks, style);
        add_leave(module.hooks, style);
        return;
      }
      if (!style.replicated_input)
        throw ConfigError(
            fmt::format("{}: RowwiseParallel on an embedding takes the token ids whole: use "
                        "RowwiseParallel<Replicate, ...>",
                        name));
      shard(name, module, 0);
      const std::int64_t rows = embedding->weight.size(0);
      const std::int64_t first = rows * group_.rank();
      // Token ids outside this rank's rows look up row 0 and are zeroed after: the sum over
      // the ranks (the reduction that leaves the region) holds every token's row once.
      module.hooks.pre.push_back([first, rows](const torch::Tensor& ids) {
        auto local = ids - first;
        return local.masked_fill(local.lt(0).logical_or(local.ge(rows)), 0);
      });
      module.hooks.post.push_back(
          [group = group_, leave = style.leave, first, rows](const torch::Tensor& ids, const torch::Tensor& out) {
            const auto outside = ids.lt(first).logical_or(ids.ge(first + rows)).unsqueeze(-1);
            return comm::redistribute_differentiable(out.masked_fill(outside, 0), group, leave);
          });
      return;
    }
    case StyleKind::sequence_parallel:
      // Each rank's gradient covers its part of the sequence; the weight's is their sum, the
      // all-reduce of the style's weight Redistribution.
      sum_partial_gradient(name, module);
      return;
    case StyleKind::none:
      return;
    case StyleKind::prepare_input:
      break;
  }
  throw ConfigError(fmt::format("{}: PrepareModuleInput applies to a module with children, not to a leaf", name));
}

MESHTORCH_DECL void TensorParallelRuntime::sum_partial_gradient(const std::string& name, WeightModule& module,
                                                                LeafSlot slot) {
  // Run for all such tensors at once when the backward ends. A parametrization, so it holds when
  // a wrapper (FSDP) swaps the tensor for a gathered one.
  const auto tensor_name = name + (slot == LeafSlot::weight ? ".weight" : ".bias");
  norm_gradients_->add(tensor_name, module.tensor(slot));
  auto& functions = slot == LeafSlot::weight ? module.parametrizations : module.bias_parametrizations;
  functions.push_back([sum = norm_gradients_, tensor_name](const torch::Tensor& t) {
    return sum->partial_gradient_of(t, tensor_name);
  });
}

MESHTORCH_DECL void TensorParallelRuntime::add_enter(ForwardHooks& hooks, const tp_detail::StyleSteps& style) {
  if (!style.enter.moves()) return;
  hooks.pre.push_back([group = group_, enter = style.enter](const torch::Tensor& x) {
    return comm::redistribute_differentiable(x, group, enter);
  });
}

MESHTORCH_DECL void TensorParallelRuntime::add_leave(ForwardHooks& hooks, const tp_detail::StyleSteps& style) {
  if (!style.leave.moves()) return;
  hooks.post.push_back([group = group_, leave = style.leave](const torch::Tensor&, const torch::Tensor& y) {
    return comm::redistribute_differentiable(y, group, leave);
  });
}

MESHTORCH_DECL void TensorParallelRuntime::apply_head(const tp_detail::StyleSteps& style) {
  if (style.kind != tp_detail::StyleKind::colwise) return;  // NoParallel (check_applicable allows no other)
  if (model_->lm_head) shard("lm_head", *model_->lm_head, 0);
  add_enter(model_->head_hooks, style);
  add_leave(model_->head_hooks, style);
}

MESHTORCH_DECL void TensorParallelRuntime::shard(const std::string& name, WeightModule& module, std::int64_t dim) {
  torch::NoGradGuard no_grad;
  module.set_weight(tp_detail::chunk_of(module.weight.detach(), group_, dim, name + ".weight"));
  sharded_[name + ".weight"] = dim;
  if (!module.bias.defined()) return;
  if (dim == 0) {  // a colwise layer's bias follows its output rows
    module.set(LeafSlot::bias, tp_detail::chunk_of(module.bias.detach(), group_, 0, name + ".bias"));
    sharded_[name + ".bias"] = 0;
    return;
  }
  // A rowwise layer's outputs are partial sums, reduced as they leave the layer: its bias, kept
  // whole on every rank, is added by rank 0 alone, so that the sum holds it once (DTensor's
  // Replicate -> Partial). Its gradient, whole on rank 0 and zero on the others, is summed over TP
  // when the backward ends, as a sequence-parallel norm's is.
  sum_partial_gradient(name, module, LeafSlot::bias);
  module.bias_parametrizations.push_back(
      [added_here = group_.rank() == 0](const torch::Tensor& bias) { return added_here ? bias : bias * 0.0; });
}

}  // namespace meshtorch
#endif  // MESHTORCH_DEFINES(core)
