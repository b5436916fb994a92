#pragma once
// ZeroRedundancyOptimizer: AdamW with its state sharded over a data-parallel group (ZeRO stage
// 1, torch.distributed.optim.ZeroRedundancyOptimizer). Each rank owns a subset of the
// parameters, keeps exp_avg / exp_avg_sq / step only for those, and steps only those (from the
// gradients DDP already averaged); then every parameter is broadcast from its owner, so all
// replicas hold the same updated model. Optimizer memory per rank falls to ~1/world; the cost is
// one broadcast of the parameters per step (the same volume as DDP's all-reduce, half of it), in
// buckets so that no flat copy of all of them is ever made.
//
// Ownership is PyTorch's greedy rule: parameters sorted by size, largest first, each to the
// rank that owns the fewest elements so far. The rule depends only on the shapes, so every rank
// computes the same partition.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <meshtorch/torch.hpp>

#include <meshtorch/comm/axis_group.hpp>
#include <meshtorch/io/safetensors.hpp>
#include <meshtorch/separate_compilation.hpp>
#include <meshtorch/train/adamw.hpp>
#include <meshtorch/train/optimizer.hpp>

namespace meshtorch {

// owner[i] = the group rank that owns parameter i.
MESHTORCH_DECL std::vector<int> partition_parameters_greedy(const std::vector<torch::Tensor>& params, int world_size);

class ZeroRedundancyOptimizer : public train::Optimizer {
 public:
  ZeroRedundancyOptimizer(std::vector<std::pair<std::string, torch::Tensor>> named_parameters,
                          const comm::AxisGroup& group, train::AdamWOptions options)
      : group_(group), params_(std::move(named_parameters)), local_(make_local(options)) {}

  double lr() const override { return local_.lr(); }
  void set_lr(double lr) override { local_.set_lr(lr); }

  // All parameters' gradients, not only the owned ones: every rank computed them all.
  void zero_grad(bool set_to_none = true) override { train::zero_gradients(params_, set_to_none); }

  MESHTORCH_DECL void step() override;

  // This rank's shard of the state: "<param>.exp_avg", "<param>.exp_avg_sq", "<param>.step"
  // for the parameters it owns. Checkpoints save one shard per rank.
  io::NamedTensors state() const override { return local_.state(); }
  void load_state(const io::SafetensorsFile& file, const std::string& source) override {
    local_.load_state(file, source);
  }

  // Elements of optimizer state this rank holds.
  std::int64_t state_numel() const {
    std::int64_t n = 0;
    for (const auto& [name, t] : local_.state()) n += t.numel();
    return n;
  }
  // What this rank holds, for the start-up log.
  MESHTORCH_DECL std::string summary() const;
  const std::vector<int>& owners() const { return owner_; }
  const std::vector<std::pair<std::string, torch::Tensor>>& parameters() const { return params_; }
  const std::vector<std::pair<std::string, torch::Tensor>>& owned_parameters() const { return local_.parameters(); }
  const comm::AxisGroup& group() const { return group_; }

 private:
  MESHTORCH_DECL train::AdamW make_local(const train::AdamWOptions& options);

  static constexpr std::int64_t broadcast_bucket_bytes = std::int64_t{25} << 20;  // as DDP's buckets

  comm::AxisGroup group_;
  std::vector<std::pair<std::string, torch::Tensor>> params_;
  std::vector<int> owner_;
  train::AdamW local_;
};

}  // namespace meshtorch

#if MESHTORCH_DEFINES(core)
#include <algorithm>
#include <deque>
#include <map>
#include <numeric>

#include <fmt/format.h>

#include <meshtorch/comm/collectives.hpp>

namespace meshtorch {

MESHTORCH_DECL std::string ZeroRedundancyOptimizer::summary() const {
  return fmt::format("ZeroRedundancyOptimizer: this rank holds {} elements of optimizer state for {} of {} parameters",
                     state_numel(), owned_parameters().size(), parameters().size());
}

MESHTORCH_DECL std::vector<int> partition_parameters_greedy(const std::vector<torch::Tensor>& params, int world_size) {
  std::vector<std::size_t> order(params.size());
  std::iota(order.begin(), order.end(), 0);
  // stable: equal sizes keep their definition order, the same on every rank.
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return params[a].numel() > params[b].numel(); });
  std::vector<std::int64_t> load(static_cast<std::size_t>(world_size), 0);
  std::vector<int> owner(params.size(), 0);
  for (std::size_t i : order) {
    const auto least = std::min_element(load.begin(), load.end()) - load.begin();
    owner[i] = static_cast<int>(least);
    load[least] += params[i].numel();
  }
  return owner;
}

MESHTORCH_DECL void ZeroRedundancyOptimizer::step() {
  local_.step();
  torch::NoGradGuard no_grad;
  if (group_.size() == 1) return;
  // Coalesced broadcasts from each owner, in buckets of at most broadcast_bucket_bytes (one
  // flat copy of everything an owner holds would cost as much memory as AdamW's shard saves),
  // two in flight at a time.
  std::deque<comm::Work<std::vector<torch::Tensor>>> pending;
  auto issue = [&](std::vector<torch::Tensor>& bucket, int source) {
    if (bucket.empty()) return;
    pending.push_back(comm::broadcast_coalesced_async(group_, std::move(bucket), source));
    bucket.clear();
    if (pending.size() > 2) {
      pending.front().wait();
      pending.pop_front();
    }
  };
  for (int source = 0; source < group_.size(); ++source) {
    std::map<int, std::pair<std::vector<torch::Tensor>, std::int64_t>> by_dtype;  // tensors, bytes
    for (std::size_t i = 0; i < params_.size(); ++i) {
      if (owner_[i] != source) continue;
      const auto& p = params_[i].second;
      auto& [bucket, bytes] = by_dtype[static_cast<int>(p.scalar_type())];
      const auto size = static_cast<std::int64_t>(p.numel() * p.element_size());
      if (!bucket.empty() && bytes + size > broadcast_bucket_bytes) {
        issue(bucket, source);
        bytes = 0;
      }
      bucket.push_back(p);
      bytes += size;
    }
    for (auto& [dtype, bucket] : by_dtype) issue(bucket.first, source);
  }
  for (auto& work : pending) work.wait();
}

MESHTORCH_DECL train::AdamW ZeroRedundancyOptimizer::make_local(const train::AdamWOptions& options) {
  std::vector<torch::Tensor> tensors;
  for (const auto& [name, p] : params_) tensors.push_back(p);
  owner_ = partition_parameters_greedy(tensors, group_.size());
  std::vector<std::pair<std::string, torch::Tensor>> mine;
  for (std::size_t i = 0; i < params_.size(); ++i)
    if (owner_[i] == group_.rank()) mine.push_back(params_[i]);
  return train::AdamW(std::move(mine), options);
}

}  // namespace meshtorch
#endif  // MESHTORCH_DEFINES(core)
