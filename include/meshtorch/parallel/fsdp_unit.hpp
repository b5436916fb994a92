#pragma once
// One fully_shard call's weights (parallel/fsdp.hpp): their shards packed in a flat buffer, the
// full weights gathered for forward and backward, the reduce-scatter of their gradients, and the
// autograd nodes that put the gathers and reduce-scatters where forward and backward need them.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <meshtorch/torch.hpp>

#include <meshtorch/comm/axis_group.hpp>
#include <meshtorch/layout/row_block.hpp>
#include <meshtorch/models/weight_module.hpp>
#include <meshtorch/parallel/fsdp_buffers.hpp>
#include <meshtorch/parallel/fsdp_options.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch {

// parallel/fsdp_schedule.hpp
class FsdpSchedule;
struct FsdpReduction;
struct FsdpGradientCopy;

// One fully_shard call's weights: their shards, the flat buffers and the hooks' work.
class FsdpUnit {
 public:
  struct Parameter {
    std::string name;  // module path + ".weight" (or ".bias"), e.g. "model.layers.0.mlp.up_proj.weight"
    WeightModule* leaf = nullptr;
    LeafSlot slot = LeafSlot::weight;
    std::vector<std::int64_t> full_shape;
    std::int64_t rows = 0;          // full_shape[0]
    std::int64_t row_numel = 1;     // elements per row
    RowBlock block;                 // this rank's rows of the weight (layout/row_block.hpp)
    std::int64_t shard_offset = 0;  // elements into the flat shard buffer
    std::int64_t full_offset = 0;   // elements into the full storage (rows padded to group size x block rows)
    torch::Tensor shard;            // leaf [block.count, ...]: what the optimizer steps
    std::int64_t block_numel() const { return block.rows_per_rank * row_numel; }  // one rank's part, padded
  };

  MESHTORCH_DECL FsdpUnit(std::string name, bool is_root, std::vector<LeafTensor> leaves, const comm::AxisGroup& group,
                          const FsdpOptions& options, std::shared_ptr<FsdpSchedule> schedule);

  FsdpUnit(const FsdpUnit&) = delete;
  FsdpUnit& operator=(const FsdpUnit&) = delete;

  const std::string& name() const { return name_; }
  bool is_root() const { return is_root_; }
  std::vector<Parameter>& parameters() { return params_; }
  const std::vector<Parameter>& parameters() const { return params_; }
  // Elements of this rank's shard buffer (with padding), of the full weights, and of the
  // gathered storage (the full weights with each one's rows padded to group size x rows per rank).
  std::int64_t shard_numel() const { return shard_numel_; }
  std::int64_t full_numel() const { return full_numel_; }
  std::int64_t gathered_numel() const { return group_.size() * shard_numel_; }
  // Whether the full weights hold memory now, and whether an all-gather for them is on the wire.
  bool is_unsharded() const { return full_storage_.nbytes() > 0; }
  bool is_gathering() const { return gather_.has_value(); }
  const c10::Storage& full_storage() const { return full_storage_; }
  torch::ScalarType shard_dtype() const { return shard_dtype_; }
  torch::ScalarType param_dtype() const { return options_.mixed_precision.param_dtype.value_or(shard_dtype_); }
  torch::ScalarType reduce_dtype() const { return options_.mixed_precision.reduce_dtype.value_or(param_dtype()); }
  bool reshards_after_forward() const { return options_.reshard_after_forward && !is_root_ && holds_ == 0; }

  // Keeps the full weights from one use to the next, through forwards and backwards, until every
  // hold is released: a pipeline stage's weights between its UNSHARD and RESHARD (a tied embedding
  // used by two stages of one rank is held by both). The last release frees them.
  void hold() { ++holds_; }
  MESHTORCH_DECL void release();
  bool held() const { return holds_ > 0; }
  // Whether the unit's gather issues the next units' (the previous ones' in backward): not for a
  // unit gathered outside the order the layers run in (FullyShardedDataParallel::fully_shard_used_by).
  bool prefetches() const { return prefetches_; }
  void set_prefetches(bool prefetches) { prefetches_ = prefetches; }
  // Whether backward reads the full weights, so that a unit freed since its forward must gather
  // them again before its backward (not an embedding's, which needs only the ids).
  void set_backward_reads_weights(bool reads) { backward_reads_weights_ = reads; }
  // All-gathers of the unit's weights issued so far (for tests and logs: what a schedule costs).
  std::int64_t gathers_issued() const { return gathers_issued_; }

  // Issues the all-gather of the shards (cast to the compute dtype) without waiting for it,
  // unless the full weights already hold the current shards or a gather is on its way.
  MESHTORCH_DECL void start_unshard();

  // Waits for the issued all-gather and copies it into the full weights (one op for the unit).
  MESHTORCH_DECL void finish_unshard();

  // All-gathers the shards into the full weights, unless they already hold the current shards.
  void unshard() {
    start_unshard();
    finish_unshard();
  }

  // Frees the full weights; a prefetched gather that was never used is waited for and dropped.
  MESHTORCH_DECL void reshard();

  // Writes every full weight into `destination` (gathered_numel() elements on the compute
  // device, the weights at their full_offset): one all-gather of the flat shards cast to `dtype`.
  MESHTORCH_DECL void gather_full(torch::Tensor destination, torch::ScalarType dtype) const;

  // The pre-forward hook: gather, and hand the leaves full weights that are outputs of the
  // unit's autograd node (so its backward sees all their gradients at once).
  MESHTORCH_DECL void pre_forward();
  // The post-forward hook: free the full weights (reshards_after_forward), and mark the output
  // so that its gradient re-gathers them first if they are not there then.
  MESHTORCH_DECL torch::Tensor post_forward(const torch::Tensor& output);
  // Called from the output's backward, before the unit's own backward.
  MESHTORCH_DECL void pre_backward();
  // Called once autograd has every full weight's gradient (undefined: unused in this forward,
  // a zero gradient).
  MESHTORCH_DECL std::vector<torch::Tensor> post_backward(const std::vector<torch::Tensor>& full_grads);

  // Issues the reduce-scatter of the full gradients (one copy into the send buffer for the
  // unit, each weight's rows padded to group size x rows per rank) and frees the full weights.
  MESHTORCH_DECL FsdpReduction start_reduce_scatter(const std::vector<torch::Tensor>& full_grads);

  // A finished reduce-scatter's result as one gradient per shard: the mean over the group, in
  // the shards' dtype and on their device.
  MESHTORCH_DECL std::vector<torch::Tensor> shard_gradients(FsdpReduction& reduction);

  // Waits for the reduce-scatter and starts taking its mean to the shards' dtype and device
  // (with cpu_offload on a GPU, a non_blocking copy into pinned host memory).
  MESHTORCH_DECL FsdpGradientCopy start_gradient_copy(FsdpReduction& reduction);

  // Waits for the copy and adds its gradients to the shards' .grad (or sets them), as
  // autograd's accumulation would.
  MESHTORCH_DECL void land_gradients(FsdpGradientCopy& copy);

  // Whether the shards live in host memory (cpu_offload).
  bool offloads() const { return options_.cpu_offload; }

  MESHTORCH_DECL std::string describe() const;

 private:
  struct Gather {
    fsdp_detail::PendingWork work;
    torch::Tensor input;     // read by the collective until it is done
    torch::Tensor gathered;  // [group size x shard_numel]
    std::int64_t version;    // of the shards it was issued from
  };

  // [group size, shard_numel] -> each weight's [group size, block]: one op for the unit.
  MESHTORCH_DECL void copy_out(const torch::Tensor& gathered, const std::vector<torch::Tensor>& targets) const;

  torch::TensorOptions compute_options() const {
    return torch::TensorOptions().device(options_.device).dtype(param_dtype());
  }
  MESHTORCH_DECL torch::Tensor full_weight(const Parameter& p) const;
  // One view per weight of a [shard_numel] buffer: its shard's shape.
  MESHTORCH_DECL std::vector<torch::Tensor> shard_views(const torch::Tensor& flat) const;

  std::string name_;
  bool is_root_;
  comm::AxisGroup group_;
  FsdpOptions options_;
  std::shared_ptr<FsdpSchedule> schedule_;
  torch::ScalarType shard_dtype_ = torch::kFloat;
  std::vector<Parameter> params_;
  std::int64_t shard_numel_ = 0, full_numel_ = 0;
  torch::Tensor shard_flat_;
  c10::Storage full_storage_;
  std::vector<torch::Tensor> gather_targets_;  // per weight: [group size, block] aliases of the full storage
  std::vector<std::int64_t> block_sizes_;
  std::optional<Gather> gather_;
  std::int64_t gathered_version_ = -1;
  int holds_ = 0;
  bool prefetches_ = true, backward_reads_weights_ = true;
  std::int64_t gathers_issued_ = 0;
};

}  // namespace meshtorch

#if MESHTORCH_DEFINES(core)
#include <algorithm>
#include <stdexcept>

#include <fmt/format.h>

#include <meshtorch/error.hpp>
#include <meshtorch/parallel/fsdp_schedule.hpp>

namespace meshtorch {

MESHTORCH_DECL FsdpUnit::FsdpUnit(std::string name, bool is_root, std::vector<LeafTensor> leaves,
                                  const comm::AxisGroup& group, const FsdpOptions& options,
                                  std::shared_ptr<FsdpSchedule> schedule)
    : name_(std::move(name)), is_root_(is_root), group_(group), options_(options), schedule_(std::move(schedule)) {
  const auto world = group_.size();
  const auto rank = group_.rank();
  shard_dtype_ = leaves.front().tensor().scalar_type();
  for (auto& [leaf_name, leaf, slot] : leaves) {
    const auto& w = leaf->tensor(slot);
    if (w.scalar_type() != shard_dtype_)
      throw ConfigError(fmt::format(
          "fully_shard({}): '{}' is {} but '{}' is {}; build the model in one dtype "
          "(mixed precision is FsdpOptions::mixed_precision)",
          describe(), leaf_name, c10::toString(w.scalar_type()), leaves.front().name, c10::toString(shard_dtype_)));
    if (w.dim() == 0) throw ConfigError(fmt::format("fully_shard({}): '{}' is a scalar", describe(), leaf_name));
    Parameter p;
    p.name = leaf_name;
    p.leaf = leaf;
    p.slot = slot;
    p.full_shape = w.sizes().vec();
    p.rows = w.size(0);
    p.row_numel = w.numel() / std::max<std::int64_t>(p.rows, 1);
    p.block = row_block(p.rows, world, rank);
    p.shard_offset = shard_numel_;
    p.full_offset = world * shard_numel_;
    shard_numel_ += p.block_numel();
    full_numel_ += w.numel();
    params_.push_back(std::move(p));
  }
  const auto shard_device = options_.cpu_offload ? torch::Device(torch::kCPU) : options_.device;
  // Padding rows stay zero: they are part of no shard view, so nothing ever writes them.
  shard_flat_ = torch::zeros({shard_numel_}, torch::TensorOptions().device(shard_device).dtype(shard_dtype_));
  if (options_.cpu_offload && options_.device.is_cuda()) shard_flat_ = shard_flat_.pin_memory();
  torch::NoGradGuard no_grad;
  for (auto& p : params_) {
    auto local_shape = p.full_shape;
    local_shape[0] = p.block.count;
    p.shard = shard_flat_.narrow(0, p.shard_offset, p.block.count * p.row_numel).view(local_shape);
    // A module that already has real weights (not built on the meta device) keeps its values.
    const auto& own = p.leaf->tensor(p.slot);
    if (!own.is_meta()) p.shard.copy_(own.narrow(0, p.block.first, p.block.count));
    p.shard.set_requires_grad(true);
  }
  // The full weights: one storage for the unit, freed until a forward needs it. The gather
  // writes through per-weight [group size, block] aliases, never through the leaves'.
  full_storage_ = torch::empty({gathered_numel()}, compute_options()).storage();
  fsdp_detail::free_storage(full_storage_);
  for (auto& p : params_) {
    gather_targets_.push_back(
        fsdp_detail::alias(full_storage_, param_dtype(), p.full_offset, {world, p.block_numel()}));
    block_sizes_.push_back(p.block_numel());
    p.leaf->replace(p.slot, full_weight(p));
  }
}

MESHTORCH_DECL void FsdpUnit::start_unshard() {
  torch::NoGradGuard no_grad;
  const auto version = shard_flat_._version();
  if (gather_ || (is_unsharded() && gathered_version_ == version)) return;
  auto input = shard_flat_.to(options_.device, param_dtype(), /*non_blocking=*/true);
  auto gathered = torch::empty({gathered_numel()}, input.options());
  auto work = fsdp_detail::start_all_gather_flat(group_, gathered, input, "FSDP all_gather of " + describe());
  gather_.emplace(Gather{std::move(work), std::move(input), std::move(gathered), version});
  ++gathers_issued_;
}

MESHTORCH_DECL void FsdpUnit::finish_unshard() {
  if (!gather_) return;
  torch::NoGradGuard no_grad;
  gather_->work.wait();
  if (!is_unsharded())
    fsdp_detail::allocate_storage(full_storage_,
                                  static_cast<std::size_t>(gathered_numel()) * c10::elementSize(param_dtype()));
  copy_out(gather_->gathered, gather_targets_);
  gathered_version_ = gather_->version;
  gather_.reset();
}

MESHTORCH_DECL void FsdpUnit::reshard() {
  if (gather_) {
    gather_->work.wait();
    gather_.reset();
  }
  fsdp_detail::free_storage(full_storage_);
}

MESHTORCH_DECL void FsdpUnit::release() {
  if (holds_ == 0) throw std::logic_error("FsdpUnit::release of " + describe() + " without a hold");
  if (--holds_ == 0) reshard();
}

MESHTORCH_DECL void FsdpUnit::gather_full(torch::Tensor destination, torch::ScalarType dtype) const {
  torch::NoGradGuard no_grad;
  auto input = shard_flat_.to(options_.device, dtype);
  auto gathered = torch::empty({gathered_numel()}, input.options());
  fsdp_detail::start_all_gather_flat(group_, gathered, input, "FSDP all_gather of " + describe()).wait();
  std::vector<torch::Tensor> targets;
  for (const auto& p : params_)
    targets.push_back(destination.narrow(0, p.full_offset, group_.size() * p.block_numel()).view({group_.size(), -1}));
  copy_out(gathered, targets);
}

MESHTORCH_DECL FsdpReduction FsdpUnit::start_reduce_scatter(const std::vector<torch::Tensor>& full_grads) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> grads;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const auto& p = params_[i];
    auto grad = full_grads[i].defined() ? full_grads[i] : torch::zeros(p.full_shape, compute_options());
    grads.push_back(grad.reshape({p.rows, p.row_numel}));
  }
  // FSDP2's order, for the peak: the full weights are freed before the send buffer exists, and
  // each gradient is converted to the reduce dtype as it is packed into it, with no copy of its own
  // (at 405B in bf16 the copies and the weights held beside the buffer were 32 GB of a layer's peak).
  // A held unit keeps them for its next use.
  if (!held()) reshard();
  auto send = torch::empty({group_.size(), shard_numel_}, compute_options().dtype(reduce_dtype()));
  at::_chunk_cat_out(send, grads, /*dim=*/0, /*num_chunks=*/group_.size());
  send = send.view({-1});
  auto output = torch::empty({shard_numel_}, send.options());
  auto work = fsdp_detail::start_reduce_scatter_sum_flat(group_, output, send, "FSDP reduce_scatter of " + describe());
  return {this, std::move(work), std::move(send), std::move(output)};
}

MESHTORCH_DECL std::vector<torch::Tensor> FsdpUnit::shard_gradients(FsdpReduction& reduction) {
  auto copy = start_gradient_copy(reduction);
  copy.copy.wait();
  return shard_views(copy.flat);
}

MESHTORCH_DECL FsdpGradientCopy FsdpUnit::start_gradient_copy(FsdpReduction& reduction) {
  torch::NoGradGuard no_grad;
  reduction.work.wait();
  reduction.output.div_(group_.size());
  FsdpGradientCopy result{this, reduction.output.to(shard_dtype_), {}};
  if (shard_flat_.device() != result.flat.device()) {
    const auto from = result.flat.device();
    auto host = torch::empty({shard_numel_}, train::host_options_for(from, shard_dtype_));
    host.copy_(result.flat, /*non_blocking=*/true);
    result.flat = std::move(host);
    result.copy = train::CopyInFlight::after_copies_on(from);
  }
  return result;
}

MESHTORCH_DECL void FsdpUnit::land_gradients(FsdpGradientCopy& copy) {
  copy.copy.wait();
  torch::NoGradGuard no_grad;
  auto grads = shard_views(copy.flat);
  for (std::size_t i = 0; i < params_.size(); ++i) {
    auto& slot = params_[i].shard.mutable_grad();
    if (slot.defined())
      slot.add_(grads[i]);
    else
      slot = grads[i];
  }
}

MESHTORCH_DECL std::vector<torch::Tensor> FsdpUnit::shard_views(const torch::Tensor& flat) const {
  std::vector<torch::Tensor> views;
  for (const auto& p : params_)
    views.push_back(flat.narrow(0, p.shard_offset, p.block.count * p.row_numel).view(p.shard.sizes()));
  return views;
}

MESHTORCH_DECL std::string FsdpUnit::describe() const {
  return fmt::format("{} on rank {}", is_root_ ? std::string("the root") : fmt::format("'{}'", name_),
                     group_.global_rank());
}

MESHTORCH_DECL void FsdpUnit::copy_out(const torch::Tensor& gathered, const std::vector<torch::Tensor>& targets) const {
  at::split_with_sizes_copy_out(targets, gathered.view({group_.size(), shard_numel_}), block_sizes_, /*dim=*/1);
}

MESHTORCH_DECL torch::Tensor FsdpUnit::full_weight(const Parameter& p) const {
  return fsdp_detail::alias(full_storage_, param_dtype(), p.full_offset, p.full_shape);
}

MESHTORCH_DECL std::vector<torch::Tensor> FsdpUnit::post_backward(const std::vector<torch::Tensor>& full_grads) {
  return schedule_->after_backward(*this, full_grads);
}

namespace fsdp_detail {

struct UnitCapsule : torch::CustomClassHolder {
  explicit UnitCapsule(FsdpUnit* u) : unit(u) {}
  FsdpUnit* unit;
};

inline FsdpUnit* saved_unit(torch::autograd::AutogradContext* ctx) {
  return static_cast<UnitCapsule*>(ctx->saved_data["unit"].toCapsule().get())->unit;
}

// shards -> the full weights (already gathered into the unit's storage); backward: the
// reduce-scatter of their gradients.
struct GatherUnitParameters : torch::autograd::Function<GatherUnitParameters> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, at::TensorList shards,
                                                FsdpUnit* unit, std::vector<torch::Tensor> fulls) {
    (void)shards;
    ctx->saved_data["unit"] = c10::IValue::make_capsule(c10::make_intrusive<UnitCapsule>(unit));
    ctx->set_materialize_grads(false);
    return fulls;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto shard_grads = saved_unit(ctx)->post_backward(grads);
    shard_grads.emplace_back();  // unit
    shard_grads.emplace_back();  // fulls
    return shard_grads;
  }
};

// Identity on a unit's output; its backward re-gathers the unit's weights, and it runs before
// any of the unit's own backward, which needs the output's gradient first.
struct UnshardBeforeBackward : torch::autograd::Function<UnshardBeforeBackward> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& output, FsdpUnit* unit) {
    ctx->saved_data["unit"] = c10::IValue::make_capsule(c10::make_intrusive<UnitCapsule>(unit));
    return output.view_as(output);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    saved_unit(ctx)->pre_backward();
    return {grads[0], torch::Tensor()};
  }
};

}  // namespace fsdp_detail

MESHTORCH_DECL void FsdpUnit::pre_forward() {
  schedule_->before_forward(*this);
  std::vector<torch::Tensor> shards, fulls;
  for (const auto& p : params_) {
    shards.push_back(p.shard);
    fulls.push_back(full_weight(p));
  }
  auto weights = fsdp_detail::GatherUnitParameters::apply(at::TensorList(shards), this, std::move(fulls));
  for (std::size_t i = 0; i < params_.size(); ++i) params_[i].leaf->replace(params_[i].slot, weights[i]);
}

MESHTORCH_DECL void FsdpUnit::pre_backward() { schedule_->before_backward(*this); }

MESHTORCH_DECL torch::Tensor FsdpUnit::post_forward(const torch::Tensor& output) {
  if (reshards_after_forward()) reshard();
  if (!torch::GradMode::is_enabled() || !output.requires_grad() || !backward_reads_weights_) return output;
  // Also on a unit that stays gathered: another forward's backward may have freed its weights
  // since (a pipeline runs several micro-batches' forwards before their backwards), and then this
  // one's gathers them again. When they are still there it costs nothing.
  return fsdp_detail::UnshardBeforeBackward::apply(output, this);
}

}  // namespace meshtorch
#endif  // MESHTORCH_DEFINES(core)
