#pragma once
// ZeroStage2: data parallelism with the gradients and the optimizer state sharded over the DP
// axis (DeepSpeed's ZeRO stage 2). Every rank holds the whole model, as with DDP; but instead of
// all-reducing each gradient bucket it reduce-scatters it, keeping the mean gradient of its own
// rows of every weight only, and steps only those rows. The next forward all-gathers the updated
// rows so every replica holds the same model again.
//
//   per rank, fp32 AdamW, N ranks     weights   gradients   AdamW state
//   DDP (stage 0)                      4         4           8            bytes per parameter
//   ZeroRedundancyOptimizer (1)        4         4           8 / N
//   ZeroStage2 (2)                     4         4 / N       8 / N
//   FSDP (3)                           4 / N     4 / N       8 / N
//
// Rows are cut as FSDP cuts them (ceil(rows / N) per rank, the last ranks may have fewer), so the
// optimizer's pieces are boxes of the global weights and checkpoints reshard across world sizes
// like FSDP's. A gradient lives whole only from the moment autograd accumulates it until it is
// copied into its bucket's send buffer (at once); each bucket's reduce-scatter starts when its
// last gradient arrives, in bucket order on every rank, overlapping the rest of backward.
//
//   ZeroStage2 zero(named_parameters, mesh.group<DP>());
//   train::AdamW optimizer(zero.named_shards(), {.lr = lr});   // steps this rank's rows
//   zero.before_forward(); model->loss(ids, ids).backward();    // gradients reduce-scattered
//   optimizer.step(); optimizer.zero_grad();                     // the next forward gathers
//
// With gradient accumulation every micro-batch is reduce-scattered and summed into the shards
// (DeepSpeed does the same): a full gradient never outlives its bucket, at the price of one
// reduce-scatter per micro-batch. Every parameter must get a gradient in every backward.
#include <algorithm>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/csrc/autograd/function.h>

#include <meshtorch/torch.hpp>

#include <meshtorch/comm/axis_group.hpp>
#include <meshtorch/comm/work.hpp>
#include <meshtorch/error.hpp>
#include <meshtorch/layout/row_block.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch {

struct ZeroStage2Options {
  // Bytes of full gradients per reduce-scatter bucket (DeepSpeed's reduce_bucket_size, in MiB).
  double bucket_cap_mb = 25;
  // Reduce-scatters in flight at once while backward goes on; more overlap, more send buffers
  // held. 0: each is waited for as soon as it is issued (DeepSpeed's overlap_comm false).
  int buckets_in_flight = 2;
};

class ZeroStage2 {
 public:
  struct Parameter {
    std::string name;
    torch::Tensor full;     // the module's parameter: whole on every rank
    std::int64_t rows = 0;  // full.size(0)
    std::int64_t row_numel = 1;
    RowBlock block;  // this rank's rows (layout/row_block.hpp)
    std::size_t bucket = 0;
    std::int64_t block_offset = 0;  // elements into its bucket's per-rank block
    torch::Tensor shard;            // a view of this rank's rows of `full`: what the optimizer steps
    bool arrived = false;           // its gradient of the running backward is in the send buffer
  };

  MESHTORCH_DECL ZeroStage2(std::vector<std::pair<std::string, torch::Tensor>> named, const comm::AxisGroup& group,
                            ZeroStage2Options options = {});

  // The hooks point at this object: it stays where it was built.
  ZeroStage2(const ZeroStage2&) = delete;
  ZeroStage2& operator=(const ZeroStage2&) = delete;

  // What the optimizer steps: this rank's rows of every weight (empty for weights with fewer rows
  // than ranks on the last ranks), named as the weights. Their .grad is the mean gradient.
  std::vector<std::pair<std::string, torch::Tensor>> named_shards() const {
    std::vector<std::pair<std::string, torch::Tensor>> named;
    for (const auto& p : params_) named.emplace_back(p.name, p.shard);
    return named;
  }
  // This rank's rows of `name`: [first row, number of rows).
  MESHTORCH_DECL std::pair<std::int64_t, std::int64_t> rows_of(const std::string& name) const;

  // Call before each forward: all-gathers the rows the optimizer updated since the last gather,
  // and checks that the last backward reduced every gradient. An optimizer step is seen in the
  // weights' version counters, or in its zero_grad dropping the gradients a backward reduced
  // (fused kernels do not always bump versions); with an optimizer that zeroes gradients in place
  // instead, call gather_parameters() after each step.
  MESHTORCH_DECL void before_forward();

  // All-gathers every rank's rows into the whole weights, bucket by bucket.
  MESHTORCH_DECL void gather_parameters();

  // Elements of gradients this rank holds now (the shards' buffers), for memory accounting.
  std::int64_t gradient_numel() const {
    std::int64_t n = 0;
    for (const auto& bucket : buckets_)
      if (bucket.grad_block.defined()) n += bucket.grad_block.numel();
    return n;
  }
  std::size_t bucket_count() const { return buckets_.size(); }
  const std::vector<Parameter>& parameters() const { return params_; }
  const comm::AxisGroup& group() const { return group_; }

 private:
  struct Bucket {
    std::vector<std::size_t> params;  // in the order their gradients usually arrive
    std::int64_t block_numel = 0;     // elements of one rank's block (with padding rows)
    std::int64_t bytes = 0;           // of the whole gradients it holds
    std::size_t arrived = 0;
    torch::Tensor send;        // [N x block]: the whole gradients, cut into rank blocks
    torch::Tensor grad_block;  // this rank's block of the mean gradient: the shards' .grad
  };

  RowBlock block_of(const Parameter& p, int rank) const { return row_block(p.rows, group_.size(), rank); }

  // Autograd has accumulated parameter k's gradient of this backward: cut it into the rank
  // blocks of its bucket's send buffer, free it, and reduce whatever buckets are now complete.
  MESHTORCH_DECL void gradient_arrived(std::size_t k);

  // Waits for the oldest reduce-scatter in flight and adds its result to the bucket's shards.
  MESHTORCH_DECL void finish_oldest();

  // Whether the shards of `bucket` still have their gradients in its grad block (zero_grad drops them).
  bool shard_grads_are(const Bucket& bucket) const {
    for (const auto k : bucket.params) {
      const auto& grad = params_[k].shard.grad();
      if (!grad.defined() || (grad.numel() > 0 && !grad.is_alias_of(bucket.grad_block))) return false;
    }
    return true;
  }

  MESHTORCH_DECL void check_backward_complete() const;

  // The optimizer updates the shards in place, which bumps the weights' version counters.
  void record_versions() {
    versions_.clear();
    for (const auto& p : params_) versions_.push_back(p.full._version());
  }
  bool versions_changed() const {
    for (std::size_t k = 0; k < params_.size(); ++k)
      if (params_[k].full._version() != versions_[k]) return true;
    return false;
  }

  comm::AxisGroup group_;
  ZeroStage2Options options_;
  std::vector<Parameter> params_;
  std::vector<Bucket> buckets_;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  std::deque<std::pair<std::size_t, comm::Work<torch::Tensor>>> in_flight_;
  std::size_t next_to_reduce_ = 0;
  std::size_t arrived_ = 0;
  bool gathered_once_ = false;
  // Set at construction, so the first forward gathers whatever a checkpoint load wrote into the
  // shards; afterwards set when a backward reduced gradients that an optimizer may have used.
  bool reduced_since_gather_ = true;
  std::vector<std::int64_t> versions_;
};

}  // namespace meshtorch

#if MESHTORCH_DEFINES(core)
#include <functional>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/autograd/function_hook.h>

#include <meshtorch/comm/collectives.hpp>
#include <meshtorch/parallel/ddp.hpp>

namespace meshtorch {

namespace zero_stage2_detail {

// Calls back once autograd has accumulated a parameter's gradient: a post hook of the
// parameter's AccumulateGrad node, as c10d's Reducer registers its own. (LambdaPostHook would do
// the same, but its header pulls in the compiled-autograd machinery.)
class GradientArrived : public torch::autograd::FunctionPostHook {
 public:
  explicit GradientArrived(std::function<void()> callback) : callback_(std::move(callback)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    callback_();
    return outputs;
  }

 private:
  std::function<void()> callback_;
};

}  // namespace zero_stage2_detail

MESHTORCH_DECL ZeroStage2::ZeroStage2(std::vector<std::pair<std::string, torch::Tensor>> named,
                                      const comm::AxisGroup& group, ZeroStage2Options options)
    : group_(group), options_(options) {
  if (named.empty()) throw ConfigError("ZeroStage2: there is no parameter that requires grad");
  if (options_.buckets_in_flight < 0)
    throw ConfigError(fmt::format("ZeroStage2: buckets_in_flight is {}; it must be 0 (no overlap) or more",
                                  options_.buckets_in_flight));
  detail::check_same_parameters(group_, named);
  const auto world = group_.size();
  const auto rank = group_.rank();
  torch::NoGradGuard no_grad;
  for (auto& [name, tensor] : named) {
    if (tensor.dim() == 0) throw ConfigError(fmt::format("ZeroStage2: '{}' is a scalar; rows cannot be sharded", name));
    Parameter p;
    p.name = name;
    p.full = tensor;
    p.rows = tensor.size(0);
    p.row_numel = tensor.numel() / std::max<std::int64_t>(p.rows, 1);
    p.block = row_block(p.rows, world, rank);
    p.shard = tensor.detach().narrow(0, p.block.first, p.block.count);
    params_.push_back(std::move(p));
  }
  // Buckets in the reverse of definition order, roughly the order backward produces gradients.
  const auto cap = static_cast<std::int64_t>(options_.bucket_cap_mb * 1024 * 1024);
  for (std::size_t k = params_.size(); k-- > 0;) {
    auto& p = params_[k];
    const auto bytes = p.full.numel() * static_cast<std::int64_t>(p.full.element_size());
    if (buckets_.empty() || (buckets_.back().bytes > 0 && buckets_.back().bytes + bytes > cap)) buckets_.emplace_back();
    auto& bucket = buckets_.back();
    p.bucket = buckets_.size() - 1;
    p.block_offset = bucket.block_numel;
    bucket.block_numel += p.block.rows_per_rank * p.row_numel;
    bucket.bytes += bytes;
    bucket.params.push_back(k);
  }
  // All replicas start from rank 0's weights, as DDP's do; a bucket at a time bounds the copy.
  if (world > 1)
    for (const auto& bucket : buckets_) {
      std::vector<torch::Tensor> tensors;
      for (const auto k : bucket.params) tensors.push_back(params_[k].full.detach());
      comm::broadcast_coalesced(group_, tensors, 0);
    }
  // After autograd accumulates a parameter's gradient, it goes into its bucket at once.
  for (std::size_t k = 0; k < params_.size(); ++k) {
    auto accumulator = torch::autograd::impl::grad_accumulator(params_[k].full);
    if (!accumulator)
      throw ConfigError(fmt::format("ZeroStage2: '{}' is not a leaf that requires grad", params_[k].name));
    accumulator->add_post_hook(
        std::make_unique<zero_stage2_detail::GradientArrived>([this, k] { gradient_arrived(k); }));
    accumulators_.push_back(std::move(accumulator));
  }
  record_versions();
}

MESHTORCH_DECL std::pair<std::int64_t, std::int64_t> ZeroStage2::rows_of(const std::string& name) const {
  for (const auto& p : params_)
    if (p.name == name) return {p.block.first, p.block.count};
  throw ConfigError(fmt::format("ZeroStage2: no parameter '{}'", name));
}

MESHTORCH_DECL void ZeroStage2::before_forward() {
  check_backward_complete();
  bool dropped = false;
  for (auto& bucket : buckets_)
    if (bucket.grad_block.defined() && !shard_grads_are(bucket)) {
      bucket.grad_block = torch::Tensor();  // free the buffer the dropped gradients lived in
      dropped = true;
    }
  if (versions_changed() || (reduced_since_gather_ && (dropped || !gathered_once_))) gather_parameters();
}

MESHTORCH_DECL void ZeroStage2::gather_parameters() {
  torch::NoGradGuard no_grad;
  const auto world = group_.size();
  if (world > 1) {
    std::deque<std::pair<std::size_t, comm::Work<torch::Tensor>>> pending;
    auto copy_out = [&] {
      auto [index, work] = std::move(pending.front());
      pending.pop_front();
      const auto blocks = work.wait().view({world, buckets_[index].block_numel});
      for (const auto k : buckets_[index].params) {
        const auto& p = params_[k];
        const auto full = p.full.detach().view({p.rows, p.row_numel});
        for (int r = 0; r < world; ++r) {
          const auto theirs = block_of(p, r);
          if (theirs.count == 0 || r == group_.rank()) continue;  // its own rows are already there
          full.narrow(0, theirs.first, theirs.count)
              .copy_(blocks[r].narrow(0, p.block_offset, theirs.count * p.row_numel).view({theirs.count, p.row_numel}));
        }
      }
    };
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      // Padding rows are never copied out: they may hold anything.
      auto block = torch::empty({buckets_[b].block_numel}, params_.front().full.options().requires_grad(false));
      for (const auto k : buckets_[b].params) {
        const auto& p = params_[k];
        block.narrow(0, p.block_offset, p.block.count * p.row_numel).copy_(p.shard.reshape({-1}));
      }
      pending.emplace_back(b, comm::all_gather_async(group_, block, 0));
      if (static_cast<int>(pending.size()) > options_.buckets_in_flight) copy_out();
    }
    while (!pending.empty()) copy_out();
  }
  record_versions();
  reduced_since_gather_ = false;
  gathered_once_ = true;
}

MESHTORCH_DECL void ZeroStage2::gradient_arrived(std::size_t k) {
  torch::NoGradGuard no_grad;
  auto& p = params_[k];
  if (p.arrived) throw ConfigError(fmt::format("ZeroStage2: '{}' got a second gradient in one backward", p.name));
  auto& bucket = buckets_[p.bucket];
  const auto world = group_.size();
  if (!bucket.send.defined())
    bucket.send = torch::empty({world * bucket.block_numel}, p.full.options().requires_grad(false));
  const auto blocks = bucket.send.view({world, bucket.block_numel});
  const auto grad = p.full.grad().reshape({p.rows, p.row_numel});
  for (int r = 0; r < world; ++r) {
    const auto theirs = block_of(p, r);
    auto block = blocks[r]
                     .narrow(0, p.block_offset, theirs.rows_per_rank * p.row_numel)
                     .view({theirs.rows_per_rank, p.row_numel});
    if (theirs.count > 0) block.narrow(0, 0, theirs.count).copy_(grad.narrow(0, theirs.first, theirs.count));
    // Padding rows (the last ranks' when rows do not divide) are summed too: zero, not garbage.
    if (theirs.padding() > 0) block.narrow(0, theirs.count, theirs.padding()).zero_();
  }
  p.full.mutable_grad() = torch::Tensor();
  p.arrived = true;
  ++bucket.arrived;
  ++arrived_;
  // Buckets are reduced in index order on every rank, whatever order their gradients came in.
  while (next_to_reduce_ < buckets_.size() &&
         buckets_[next_to_reduce_].arrived == buckets_[next_to_reduce_].params.size()) {
    auto& ready = buckets_[next_to_reduce_];
    in_flight_.emplace_back(
        next_to_reduce_,
        comm::reduce_scatter_async(group_, ready.send.view({world, ready.block_numel}), 0, comm::ReduceOp::avg));
    ready.send = torch::Tensor();  // the collective holds it until it completes
    ++next_to_reduce_;
    if (static_cast<int>(in_flight_.size()) > options_.buckets_in_flight) finish_oldest();
  }
  // The last gradient of the backward: every reduction completes before backward returns.
  if (arrived_ == params_.size()) {
    while (!in_flight_.empty()) finish_oldest();
    for (auto& q : params_) q.arrived = false;
    for (auto& b : buckets_) b.arrived = 0;
    arrived_ = 0;
    next_to_reduce_ = 0;
    reduced_since_gather_ = true;
  }
}

MESHTORCH_DECL void ZeroStage2::finish_oldest() {
  auto [index, work] = std::move(in_flight_.front());
  in_flight_.pop_front();
  auto mine = work.wait().view({-1});
  auto& bucket = buckets_[index];
  if (bucket.grad_block.defined() && shard_grads_are(bucket)) {
    bucket.grad_block.add_(mine);  // gradient accumulation over micro-batches
    return;
  }
  bucket.grad_block = mine;
  for (const auto k : bucket.params) {
    auto& p = params_[k];
    p.shard.mutable_grad() = mine.narrow(0, p.block_offset, p.block.count * p.row_numel).view(p.shard.sizes());
  }
}

MESHTORCH_DECL void ZeroStage2::check_backward_complete() const {
  if (arrived_ == 0) return;
  std::vector<std::string> missing;
  for (const auto& p : params_)
    if (!p.arrived) missing.push_back(p.name);
  throw ConfigError(
      fmt::format("ZeroStage2 on rank {}: the last backward gave no gradient to {} of {} parameters "
                  "({}{}); ZeRO-2 reduces a bucket when all its gradients have arrived, so every "
                  "parameter must take part in the loss",
                  group_.global_rank(), missing.size(), params_.size(),
                  fmt::join(missing.begin(), missing.begin() + std::min<std::size_t>(missing.size(), 3), ", "),
                  missing.size() > 3 ? ", ..." : ""));
}

}  // namespace meshtorch
#endif  // MESHTORCH_DEFINES(core)
