#pragma once
// FullyShardedDataParallel: PyTorch FSDP2's fully_shard, over one axis of a mesh (the FSDP
// axis; the whole world for Mesh<FSDP<dynamic>>), for any module tree whose weights are
// WeightModules (models/weight_module.hpp). It knows no model: what a family adds (how its
// weights start, which state-dict tensors are not weights) comes in a FsdpModelAdapter.
//
// Each call to fully_shard(module) makes a *unit* of the weights under `module` that no earlier
// unit took: e.g. one per decoder layer, then the root (embedding, final norm, lm_head). Every rank
// keeps only its rows of each weight (Shard<0>, the row count padded up to a multiple of the
// group size), packed into one flat buffer per unit; those row blocks are the leaf tensors the
// optimizer steps, so gradients and AdamW state are sharded too. Around a unit's forward:
//
//   pre-forward    all-gather the unit's flat shard buffer (one collective per unit) and copy
//                  it out into the full weights the leaves compute with
//   post-forward   free the full weights' memory (reshard_after_forward; never for the root,
//                  whose weights backward needs at once), keeping the tensors themselves, which
//                  autograd saved; and put an identity on the unit's output whose backward
//                  all-gathers them again before the unit's backward runs
//   post-backward  once autograd has every full weight's gradient: reduce-scatter them
//                  (averaged over the group, in the reduce dtype) into the shards' .grad, and
//                  free the full weights
//
// The full weights are outputs of one autograd node per unit (GatherUnitParameters) whose
// inputs are the shards: autograd runs its backward exactly once all of the unit's gradients
// are in, and accumulates what it returns into the shards' .grad, so gradient accumulation
// over micro-batches needs nothing more. Freeing memory keeps the storage object and swaps its
// allocation out (FSDP2's untyped_storage().resize_(0)), so the tensors autograd saved see the
// re-gathered values in backward.
//
// Overlap, as FSDP2 does it: while a unit computes, the all-gather of the next
// FsdpOptions::prefetch_layers units (in forward: the order they run; in backward: the reverse)
// is already on the wire, and each unit's reduce-scatter runs while the units before it
// compute their backward (reduce_scatters_in_flight at once); the last ones are waited for when
// the backward ends (the autograd engine's final callback), so the optimizer always sees every
// gradient. The copy into the gathered weights and out of the gradients is one op per unit
// (split_with_sizes_copy, _chunk_cat): the full weights are stored with each weight's rows padded
// to a multiple of the group size, so each is one strided block of the gathered buffer.
//
//   llama::LlamaForCausalLM model(config, torch::TensorOptions().device(torch::kMeta));
//   FullyShardedDataParallel fsdp(model, mesh.group<FSDP>(), {.device = device},
//                                 llama_fsdp_adapter(config));  // parallel/fsdp_llama.hpp
//   for (auto& layer : model->model->decoder_layers) fsdp.fully_shard(layer);
//   fsdp.fully_shard(model);                       // the root, last
//   fsdp.init_weights();                           // only shards get memory
//   train::AdamW optimizer(fsdp.named_parameters(), {.lr = lr});
//   model->loss(ids, ids).backward();              // the hooks do the rest
//
// The parts: parallel/fsdp_options.hpp (what it is asked), fsdp_model_adapter.hpp (what a model
// family adds), fsdp_unit.hpp (one unit),
// fsdp_schedule.hpp (what the units share: prefetching and reductions in flight),
// fsdp_buffers.hpp (flat buffers, storage and their collectives).
#include <algorithm>
#include <concepts>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include <meshtorch/torch.hpp>

#include <meshtorch/comm/axis_group.hpp>
#include <meshtorch/error.hpp>
#include <meshtorch/io/safetensors.hpp>
#include <meshtorch/models/forward_hooks.hpp>
#include <meshtorch/models/weight_module.hpp>
#include <meshtorch/parallel/fsdp_buffers.hpp>
#include <meshtorch/parallel/fsdp_model_adapter.hpp>
#include <meshtorch/parallel/fsdp_options.hpp>
#include <meshtorch/parallel/fsdp_schedule.hpp>
#include <meshtorch/parallel/fsdp_unit.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch {

// A module FSDP can hook: LibTorch C++ calls no hooks around a forward, so a unit's module runs
// its body through a ForwardHooks member named `hooks` (every WeightModule does).
template <class Impl>
concept ForwardHooked = std::derived_from<Impl, torch::nn::Module> && requires(Impl& module) {
  { module.hooks } -> std::same_as<ForwardHooks&>;
};

// The model-level state: the units, in the order they were made (layers, then the root).
class FullyShardedDataParallel {
 public:
  // `root` is the whole tree; its weights (and biases) are named by their module paths from it
  // ("model.layers.0.mlp.up_proj.weight"). `adapter` says what the model family adds: without
  // one, FSDP shards, trains and saves the tree, but init_weights() refuses. `keeps` says which
  // weights this rank shards (unset: all); the others are no unit's and stay as they are (a
  // pipeline stage shards its own layers and leaves the other stages' on the meta device).
  template <class Holder>
  FullyShardedDataParallel(torch::nn::ModuleHolder<Holder>& root, const comm::AxisGroup& group,
                           FsdpOptions options = {}, FsdpModelAdapter adapter = {},
                           const std::function<bool(const std::string& name)>& keeps = {})
      : root_(std::static_pointer_cast<torch::nn::Module>(root.ptr())),
        group_(group),
        options_(options),
        adapter_(std::move(adapter)),
        schedule_(std::make_shared<FsdpSchedule>(options_)) {
    for (auto& tensor : leaf_tensors(*root_))
      if (!keeps || keeps(tensor.name)) all_leaves_.push_back(std::move(tensor));
    check_options();
  }

  FullyShardedDataParallel(const FullyShardedDataParallel&) = delete;
  FullyShardedDataParallel& operator=(const FullyShardedDataParallel&) = delete;

  // Makes a unit of the weights under `module` that no earlier unit holds, and hooks its
  // forward. Shard the decoder layers first, then the root (the model passed to the
  // constructor), which takes the rest. `reshard_after_forward` overrides the options' for this
  // unit (FSDP2's per-call argument); the root keeps its weights gathered whatever it says.
  template <class Impl>
  FsdpUnit& fully_shard(torch::nn::ModuleHolder<Impl>& module, std::optional<bool> reshard_after_forward = {}) {
    static_assert(ForwardHooked<Impl>,
                  "fully_shard: the module has no `ForwardHooks hooks` member (models/forward_hooks.hpp), so FSDP "
                  "cannot gather its weights before its forward; give it one and run its forward through "
                  "hooks.around(input, body), or shard its WeightModules (which have hooks) one by one");
    const bool is_root = module.ptr().get() == root_.get();
    const std::string name = module_name(module.ptr().get());
    if (name.empty() && !is_root)
      throw ConfigError(
          fmt::format("fully_shard: the module is not part of the model this FullyShardedDataParallel "
                      "was built for (rank {})",
                      group_.global_rank()));
    std::vector<const WeightModule*> inside;
    for (auto& [n, leaf] : weight_modules(*module)) inside.push_back(leaf);
    return make_unit(is_root ? std::string("root") : name, is_root, inside, {&module->hooks}, reshard_after_forward);
  }

  // Makes a unit of `modules`' weights (each in the tree, and in no earlier unit) that gathers
  // before any of `triggers` runs and keeps its weights gathered until its backward: for weights
  // used outside their own module's forward, as a pipeline stage's output projection reads
  // lm_head's (or a tied embedding's) under LlamaForCausalLM::head_hooks. A weight used twice in
  // one step (a tied embedding on a rank that embeds and projects) is one unit with two triggers:
  // each use gathers, and reduce-scatters its gradient in its own backward.
  // Such a unit does not prefetch others. `backward_reads_weights` false (an embedding's backward
  // needs only the ids): its backward does not gather the weights again once they are freed.
  MESHTORCH_DECL FsdpUnit& fully_shard_used_by(const std::string& name, const std::vector<const WeightModule*>& modules,
                                               const std::vector<ForwardHooks*>& triggers,
                                               bool backward_reads_weights = true);

  // Units made from now on run apart from the earlier ones (a pipeline's next stage): neither
  // prefetches the other's gathers.
  void start_prefetch_group() { schedule_->start_prefetch_group(); }

  // Whether every weight this rank shards is in a unit (fully_shard(root) takes the rest).
  bool complete() const { return claimed_.size() == all_leaves_.size(); }

  // The shards, named as the full weights: what the optimizer steps.
  MESHTORCH_DECL std::vector<std::pair<std::string, torch::Tensor>> named_parameters() const;

  // Initialises the shards as the adapter's `initialise` initialises a whole model from the
  // same seed: every rank draws each full weight in turn (one at a time on the compute device,
  // so only the biggest weight is ever whole) and keeps its rows.
  MESHTORCH_DECL void init_weights();

  // Copies this rank's rows of full weights, named as named_parameters() names them, into the
  // shards: `tensors` must hold every weight with its full shape, and nothing else but what the
  // adapter's `not_a_weight` passes over. `source` names the file in errors. (A folder of a
  // model family: parallel/fsdp_llama.hpp's llama::load_pretrained_weights.)
  MESHTORCH_DECL void load_full_state_dict(const io::NamedTensors& tensors, const std::string& source);

  // This rank's rows of a weight: the first row and the row count (the last ranks may hold
  // fewer rows, or none).
  MESHTORCH_DECL std::pair<std::int64_t, std::int64_t> rows_of(const std::string& name) const;

  // Every full weight, gathered (a collective: every rank of the group must call it) and
  // copied to the CPU in the shards' dtype, in the model's parameter order.
  MESHTORCH_DECL io::NamedTensors full_state_dict() const;

  // Waits for the reduce-scatters still in flight, so that every shard's .grad is complete. A
  // backward does it when it ends; a program that reads .grad after a backward that failed half
  // way calls it.
  void finish_gradients() { schedule_->finish_gradients(); }

  // Calls `ready` with a unit's shards (the leaves the optimizer steps) as soon as a backward's
  // reduce-scattered gradients are in their .grad, on the thread running the backward, before the
  // units after it in backward are done: what stepping the optimizer in backward needs (a unit
  // stepped and its gradients freed there, so the whole model's gradients never exist at once).
  // Only with reduce-scatters in flight: with none, gradients go back through autograd, which
  // calls nothing here.
  void on_gradients_ready(std::function<void(const std::vector<torch::Tensor>& shards)> ready) {
    if (options_.reduce_scatters_in_flight == 0)
      throw ConfigError(
          fmt::format("FullyShardedDataParallel::on_gradients_ready on rank {}: gradients go back "
                      "through autograd when reduce_scatters_in_flight is 0 (as under HSDP); "
                      "nothing would call it",
                      group_.global_rank()));
    schedule_->gradients_ready = [ready = std::move(ready)](FsdpUnit& unit) {
      std::vector<torch::Tensor> shards;
      for (const auto& p : unit.parameters()) shards.push_back(p.shard);
      ready(shards);
    };
  }

  const std::vector<std::unique_ptr<FsdpUnit>>& units() const { return units_; }
  const comm::AxisGroup& group() const { return group_; }
  const FsdpOptions& options() const { return options_; }
  // Elements this rank holds in shards (with padding), and the model's weight elements.
  std::int64_t local_numel() const {
    std::int64_t n = 0;
    for (const auto& u : units_) n += u->shard_numel();
    return n;
  }
  std::int64_t full_numel() const {
    std::int64_t n = 0;
    for (const auto& u : units_) n += u->full_numel();
    return n;
  }
  // The biggest unit's full weights: what one rank must hold at once, sharding or not.
  std::int64_t largest_unit_numel() const {
    std::int64_t n = 0;
    for (const auto& u : units_) n = std::max(n, u->full_numel());
    return n;
  }

 private:
  MESHTORCH_DECL const FsdpUnit::Parameter* find(const std::string& name) const;
  FsdpUnit::Parameter* find(const std::string& name) {
    return const_cast<FsdpUnit::Parameter*>(std::as_const(*this).find(name));
  }

  MESHTORCH_DECL std::string module_name(const torch::nn::Module* module) const;
  MESHTORCH_DECL void check_options() const;
  // The unit of the weights of `modules` that no earlier unit took, hooked on `triggers`.
  MESHTORCH_DECL FsdpUnit& make_unit(const std::string& name, bool is_root,
                                     const std::vector<const WeightModule*>& modules,
                                     const std::vector<ForwardHooks*>& triggers,
                                     std::optional<bool> reshard_after_forward);

  MESHTORCH_DECL void check_complete(const FsdpUnit& unit) const;
  MESHTORCH_DECL void check_complete_for(const std::string& what) const;

  std::shared_ptr<torch::nn::Module> root_;
  comm::AxisGroup group_;
  FsdpOptions options_;
  FsdpModelAdapter adapter_;
  std::vector<LeafTensor> all_leaves_;      // leaf_tensors() order
  std::set<std::string> claimed_;           // names of the tensors in a unit
  std::shared_ptr<FsdpSchedule> schedule_;  // before units_: the units point into it
  std::vector<std::unique_ptr<FsdpUnit>> units_;
  bool root_sharded_ = false;
};

}  // namespace meshtorch

#if MESHTORCH_DEFINES(core)
namespace meshtorch {

MESHTORCH_DECL std::vector<std::pair<std::string, torch::Tensor>> FullyShardedDataParallel::named_parameters() const {
  std::vector<std::pair<std::string, torch::Tensor>> named;
  for (const auto& tensor : all_leaves_)
    if (const auto* p = find(tensor.name)) named.emplace_back(tensor.name, p->shard);
  return named;
}

MESHTORCH_DECL void FullyShardedDataParallel::init_weights() {
  check_complete_for("init_weights");
  if (!adapter_.initialise)
    throw ConfigError(
        fmt::format("FullyShardedDataParallel::init_weights on rank {}: the FsdpModelAdapter given to the "
                    "constructor has no `initialise` (e.g. llama_fsdp_adapter(config)); or build the model "
                    "with real weights, which fully_shard keeps",
                    group_.global_rank()));
  torch::NoGradGuard no_grad;
  for (const auto& tensor : all_leaves_) {
    auto& p = *find(tensor.name);
    auto full = torch::empty(p.full_shape, torch::TensorOptions().device(options_.device).dtype(p.shard.scalar_type()));
    adapter_.initialise(tensor, full);
    p.shard.copy_(full.narrow(0, p.block.first, p.block.count));
  }
}

MESHTORCH_DECL void FullyShardedDataParallel::load_full_state_dict(const io::NamedTensors& tensors,
                                                                   const std::string& source) {
  torch::NoGradGuard no_grad;
  std::set<std::string> loaded;
  for (const auto& [name, tensor] : tensors) {
    auto* p = find(name);
    if (!p) {
      if (adapter_.not_a_weight && adapter_.not_a_weight(name)) continue;
      throw DataError(fmt::format("{}: tensor '{}' is not a weight of this model", source, name));
    }
    // The shards are trained, so floating point: converting integers would train on their values.
    if (!c10::isFloatingType(tensor.scalar_type()))
      throw DataError(
          fmt::format("{}: tensor '{}' is stored as {}, not a floating-point dtype; the model's weights are "
                      "floating point (F32, F16, BF16 or F64) and converting it would train on its integer "
                      "values",
                      source, name, c10::toString(tensor.scalar_type())));
    if (tensor.sizes().vec() != p->full_shape)
      throw DataError(fmt::format("{}: tensor '{}' has shape {}, the model needs {}", source, name,
                                  c10::str(tensor.sizes()), c10::str(c10::IntArrayRef(p->full_shape))));
    p->shard.copy_(tensor.narrow(0, p->block.first, p->block.count));
    loaded.insert(name);
  }
  for (const auto& tensor : all_leaves_)
    if (!loaded.count(tensor.name)) throw DataError(fmt::format("{}: weight '{}' is missing", source, tensor.name));
}

MESHTORCH_DECL std::pair<std::int64_t, std::int64_t> FullyShardedDataParallel::rows_of(const std::string& name) const {
  const auto* p = find(name);
  if (!p) throw ConfigError(fmt::format("FullyShardedDataParallel: no weight named '{}'", name));
  return {p->block.first, p->block.count};
}

MESHTORCH_DECL io::NamedTensors FullyShardedDataParallel::full_state_dict() const {
  check_complete_for("full_state_dict");
  std::map<std::string, torch::Tensor> by_name;
  for (const auto& unit : units_) {
    auto flat = torch::empty({unit->gathered_numel()},
                             torch::TensorOptions().device(options_.device).dtype(unit->shard_dtype()));
    unit->gather_full(flat, unit->shard_dtype());  // lossless, whatever the compute dtype
    for (const auto& p : unit->parameters())
      by_name[p.name] = flat.narrow(0, p.full_offset, p.rows * p.row_numel).view(p.full_shape).to(torch::kCPU).clone();
  }
  io::NamedTensors out;
  for (const auto& tensor : all_leaves_) out.emplace_back(tensor.name, by_name.at(tensor.name));
  return out;
}

MESHTORCH_DECL const FsdpUnit::Parameter* FullyShardedDataParallel::find(const std::string& name) const {
  for (const auto& unit : units_)
    for (const auto& p : unit->parameters())
      if (p.name == name) return &p;
  return nullptr;
}

MESHTORCH_DECL std::string FullyShardedDataParallel::module_name(const torch::nn::Module* module) const {
  for (const auto& item : root_->named_modules())
    if (item.value().get() == module) return item.key();
  return "";
}

MESHTORCH_DECL void FullyShardedDataParallel::check_options() const {
  if (options_.prefetch_layers < 0)
    throw ConfigError(fmt::format("FullyShardedDataParallel: prefetch_layers {} is negative (0: no prefetching)",
                                  options_.prefetch_layers));
  if (options_.reduce_scatters_in_flight < 0)
    throw ConfigError(
        fmt::format("FullyShardedDataParallel: reduce_scatters_in_flight {} is negative (0: each "
                    "waited for at once)",
                    options_.reduce_scatters_in_flight));
  if (options_.cpu_offload && options_.device.is_cuda() && !torch::cuda::is_available())
    throw ConfigError(fmt::format("FullyShardedDataParallel: cpu_offload with device {}, but CUDA is not available",
                                  options_.device.str()));
}

MESHTORCH_DECL FsdpUnit& FullyShardedDataParallel::make_unit(const std::string& name, bool is_root,
                                                             const std::vector<const WeightModule*>& modules,
                                                             const std::vector<ForwardHooks*>& triggers,
                                                             std::optional<bool> reshard_after_forward) {
  const std::string what = is_root ? std::string("the root") : "'" + name + "'";
  if (root_sharded_)
    throw ConfigError(
        fmt::format("fully_shard({}): the root is already sharded; shard the layers first, then "
                    "the root (rank {})",
                    what, group_.global_rank()));
  const std::set<const WeightModule*> inside(modules.begin(), modules.end());
  std::vector<LeafTensor> leaves;
  for (const auto& tensor : all_leaves_)
    if (inside.count(tensor.leaf) && !claimed_.count(tensor.name)) leaves.push_back(tensor);
  if (leaves.empty())
    throw ConfigError(
        fmt::format("fully_shard({}): it holds no weight that an earlier fully_shard did not take "
                    "and that this rank shards (the constructor's `keeps`) (rank {})",
                    what, group_.global_rank()));
  for (const auto& tensor : leaves) claimed_.insert(tensor.name);
  auto unit_options = options_;
  if (reshard_after_forward) unit_options.reshard_after_forward = *reshard_after_forward;
  units_.push_back(std::make_unique<FsdpUnit>(name, is_root, std::move(leaves), group_, unit_options, schedule_));
  FsdpUnit* unit = units_.back().get();
  schedule_->add(unit, is_root);
  for (ForwardHooks* hooks : triggers) {
    hooks->pre.push_back([this, unit](const torch::Tensor& input) {
      check_complete(*unit);
      unit->pre_forward();
      return input;
    });
    hooks->post.push_back(
        [unit](const torch::Tensor&, const torch::Tensor& output) { return unit->post_forward(output); });
  }
  if (is_root) root_sharded_ = true;
  return *unit;
}

MESHTORCH_DECL FsdpUnit& FullyShardedDataParallel::fully_shard_used_by(const std::string& name,
                                                                       const std::vector<const WeightModule*>& modules,
                                                                       const std::vector<ForwardHooks*>& triggers,
                                                                       bool backward_reads_weights) {
  for (const WeightModule* module : modules)
    if (module_name(module).empty())
      throw ConfigError(
          fmt::format("fully_shard_used_by('{}'): a module is not part of the model this "
                      "FullyShardedDataParallel was built for (rank {})",
                      name, group_.global_rank()));
  if (triggers.empty())
    throw ConfigError(fmt::format("fully_shard_used_by('{}'): no trigger; nothing would gather its weights (rank {})",
                                  name, group_.global_rank()));
  FsdpUnit& unit = make_unit(name, /*is_root=*/false, modules, triggers, /*reshard_after_forward=*/false);
  unit.set_prefetches(false);
  unit.set_backward_reads_weights(backward_reads_weights);
  return unit;
}

MESHTORCH_DECL void FullyShardedDataParallel::check_complete(const FsdpUnit& unit) const {
  if (!complete())
    throw ConfigError(
        fmt::format("FullyShardedDataParallel: forward of {} before every weight was in a unit; call "
                    "fully_shard(root) after the other units",
                    unit.describe()));
}

MESHTORCH_DECL void FullyShardedDataParallel::check_complete_for(const std::string& what) const {
  if (!complete())
    throw ConfigError(
        fmt::format("FullyShardedDataParallel::{} on rank {}: call fully_shard on the layers and "
                    "then on the root (the model) first",
                    what, group_.global_rank()));
}

}  // namespace meshtorch
#endif  // MESHTORCH_DEFINES(core)
