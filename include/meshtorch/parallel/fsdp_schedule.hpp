#pragma once
// What the units of one FullyShardedDataParallel share while forward and backward run: the
// order they run in (to prefetch gathers) and the reduce-scatters in flight.
#include <cstdint>
#include <deque>
#include <functional>
#include <vector>

#include <meshtorch/torch.hpp>

#include <meshtorch/parallel/fsdp_buffers.hpp>
#include <meshtorch/parallel/fsdp_options.hpp>
#include <meshtorch/separate_compilation.hpp>
#include <meshtorch/train/copy_in_flight.hpp>

namespace meshtorch {

class FsdpUnit;

// A unit's reduce-scatter on the wire: its gradients arrive in the shards' .grad when finished.
struct FsdpReduction {
  FsdpUnit* unit = nullptr;
  fsdp_detail::PendingWork work;
  torch::Tensor send;    // what the collective reads; on Gloo summed in place and emptied when the sums arrive
  torch::Tensor output;  // this rank's block: the sum over the group
};

// A finished reduce-scatter's mean on its way to the shards' .grad: with cpu_offload on a GPU,
// copied to pinned host memory without blocking the host, which waits for it (`copy`) only
// when the gradients land (FSDP2 blocks on the copy only before the optimizer step).
struct FsdpGradientCopy {
  FsdpUnit* unit = nullptr;
  torch::Tensor flat;  // [shard_numel] in the shards' dtype, on their device
  train::CopyInFlight copy;
};

// What the units of one FullyShardedDataParallel share while forward and backward run: the
// order they run in (for prefetching) and the reduce-scatters in flight.
class FsdpSchedule {
 public:
  explicit FsdpSchedule(const FsdpOptions& options)
      : prefetch_(options.prefetch_layers), in_flight_(options.reduce_scatters_in_flight) {}

  // The root runs first (its hook wraps the whole model), then the layers in the order they
  // were sharded: parallelize shards them in the order they run. A unit prefetches only units of
  // its own prefetch group (a pipeline stage's; one group without stages).
  void add(FsdpUnit* unit, bool is_root) {
    if (is_root) {
      order_.insert(order_.begin(), unit);
      group_.insert(group_.begin(), prefetch_group_);
    } else {
      order_.push_back(unit);
      group_.push_back(prefetch_group_);
    }
  }
  // Units added from now on run apart from the earlier ones (another pipeline stage): neither
  // prefetches the other.
  void start_prefetch_group() { ++prefetch_group_; }

  MESHTORCH_DECL void before_forward(FsdpUnit& unit);
  MESHTORCH_DECL void before_backward(FsdpUnit& unit);
  // The unit's gradients: returned to autograd (reduce-scatters waited for at once), or left
  // in flight and accumulated into .grad later (returns no tensors).
  MESHTORCH_DECL std::vector<torch::Tensor> after_backward(FsdpUnit& unit,
                                                           const std::vector<torch::Tensor>& full_grads);
  // Waits for every reduce-scatter in flight (their results land in .grad) and drops gathers
  // prefetched for units that did not run. Backward calls it when it ends; call it before
  // reading .grad outside a backward that some other code drove.
  MESHTORCH_DECL void finish_gradients();

  // Called with a unit once a backward's gradients are in its shards' .grad (see
  // FullyShardedDataParallel::on_gradients_ready).
  std::function<void(FsdpUnit&)> gradients_ready;

 private:
  MESHTORCH_DECL void finish_oldest_reduction();
  // The oldest copy's gradients into .grad, then gradients_ready.
  MESHTORCH_DECL void land_oldest_gradients();
  // Backward ends before the optimizer steps: whatever reduce-scatters are left then are waited
  // for by the engine's final callback, queued once, in the outermost backward (a checkpointed
  // layer's recomputation runs a nested one, whose callbacks run when that layer is done).
  MESHTORCH_DECL void queue_final_callback_once();

  std::int64_t prefetch_;
  std::int64_t in_flight_;
  std::vector<FsdpUnit*> order_;
  std::vector<int> group_;  // each unit's prefetch group, beside order_
  int prefetch_group_ = 0;
  std::deque<FsdpReduction> reductions_;
  // With cpu_offload: gradients copied (or being copied) to the host, not yet in .grad; at most
  // as many as reduce-scatters in flight.
  std::deque<FsdpGradientCopy> gradient_copies_;
  bool final_callback_queued_ = false;
};

}  // namespace meshtorch

#if MESHTORCH_DEFINES(core)
#include <meshtorch/parallel/fsdp_unit.hpp>

namespace meshtorch {

MESHTORCH_DECL void FsdpSchedule::queue_final_callback_once() {
  if (final_callback_queued_) return;
  final_callback_queued_ = true;
  torch::autograd::Engine::get_default_engine().queue_callback([this] { finish_gradients(); });
}

MESHTORCH_DECL void FsdpSchedule::before_forward(FsdpUnit& unit) {
  const bool recomputing = fsdp_detail::in_backward();
  // A new forward: gradients of the last backward are all in (the final callback saw to it,
  // unless that backward failed half way).
  if (unit.is_root() && !recomputing) finish_gradients();
  unit.start_unshard();
  // The next units' gathers queue behind this one's and run while this unit computes.
  const auto here = std::find(order_.begin(), order_.end(), &unit);
  if (!recomputing && here != order_.end() && unit.prefetches()) {
    const int group = group_[static_cast<std::size_t>(here - order_.begin())];
    for (auto next = here + 1; next != order_.end() && next - here <= prefetch_; ++next)
      if (group_[static_cast<std::size_t>(next - order_.begin())] == group) (*next)->start_unshard();
  }
  unit.finish_unshard();
}

MESHTORCH_DECL void FsdpSchedule::before_backward(FsdpUnit& unit) {
  queue_final_callback_once();  // here, in the outermost backward
  unit.start_unshard();
  const auto here = std::find(order_.begin(), order_.end(), &unit);
  std::int64_t issued = 0;
  const bool prefetches = here != order_.end() && unit.prefetches();
  const int group = prefetches ? group_[static_cast<std::size_t>(here - order_.begin())] : 0;
  for (auto previous = here; prefetches && previous != order_.begin() && issued < prefetch_;) {
    --previous;
    if (group_[static_cast<std::size_t>(previous - order_.begin())] != group) break;
    if (!(*previous)->reshards_after_forward()) continue;  // kept gathered since forward
    (*previous)->start_unshard();
    ++issued;
  }
  unit.finish_unshard();
}

MESHTORCH_DECL std::vector<torch::Tensor> FsdpSchedule::after_backward(FsdpUnit& unit,
                                                                       const std::vector<torch::Tensor>& full_grads) {
  // The oldest reductions finish before this one's send buffer exists (FSDP2's order): they had
  // this unit's whole backward to run in, and their buffers are not held beside the new one.
  if (in_flight_ > 0)
    while (static_cast<std::int64_t>(reductions_.size()) >= in_flight_) finish_oldest_reduction();
  auto reduction = unit.start_reduce_scatter(full_grads);
  if (in_flight_ == 0) return unit.shard_gradients(reduction);
  queue_final_callback_once();
  reductions_.push_back(std::move(reduction));
  return std::vector<torch::Tensor>(full_grads.size());
}

MESHTORCH_DECL void FsdpSchedule::finish_oldest_reduction() {
  auto reduction = std::move(reductions_.front());
  reductions_.pop_front();
  auto* unit = reduction.unit;
  gradient_copies_.push_back(unit->start_gradient_copy(reduction));
  // Offloaded gradients land later, so the host does not wait for the copy while backward goes
  // on; the shards' .grad is host memory that nothing on the device waits for.
  const std::int64_t left_in_flight = unit->offloads() ? in_flight_ : 0;
  while (static_cast<std::int64_t>(gradient_copies_.size()) > left_in_flight) land_oldest_gradients();
}

MESHTORCH_DECL void FsdpSchedule::land_oldest_gradients() {
  auto copy = std::move(gradient_copies_.front());
  gradient_copies_.pop_front();
  copy.unit->land_gradients(copy);
  if (gradients_ready) gradients_ready(*copy.unit);
}

MESHTORCH_DECL void FsdpSchedule::finish_gradients() {
  final_callback_queued_ = false;
  while (!reductions_.empty()) finish_oldest_reduction();
  while (!gradient_copies_.empty()) land_oldest_gradients();
  for (auto* unit : order_)
    if (unit->is_gathering() && !unit->held()) unit->reshard();  // a held unit's gather is for its next use
}

}  // namespace meshtorch
#endif  // MESHTORCH_DEFINES(core)
