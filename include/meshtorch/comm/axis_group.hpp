#pragma once
// AxisGroup: this rank's process group along one mesh axis (or the whole world), with the global
// ranks it holds and the timeout its collectives use. Copies are cheap and share the backend.
//
// A group of a CUDA mesh moves CUDA tensors only (NCCL). Metadata that lives on the CPU (parameter
// signatures, a resume decision, a step count) goes through metadata(): the same ranks over a
// companion Gloo backend created beside the NCCL one, as PyTorch does for its object collectives.
// On a CPU mesh metadata() is the group itself.
#include <chrono>
#include <string>
#include <utility>
#include <vector>

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <meshtorch/comm/device.hpp>
#include <meshtorch/error.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::comm {

class AxisGroup {
 public:
  AxisGroup() = default;
  MESHTORCH_DECL AxisGroup(std::string axis_name, std::vector<int> ranks, int global_rank,
                           c10::intrusive_ptr<c10d::Backend> backend, std::chrono::milliseconds timeout, Device device,
                           c10::intrusive_ptr<c10d::Backend> metadata_backend = {}, int cuda_device = -1);

  // "TP", "DP", ... or "world".
  const std::string& axis_name() const { return axis_name_; }
  // Position in the group, which is this rank's coordinate on the axis.
  int rank() const { return rank_; }
  int size() const { return static_cast<int>(ranks_.size()); }
  // Global ranks of the group, ordered by coordinate.
  const std::vector<int>& ranks() const { return ranks_; }
  int global_rank() const { return global_rank_; }
  int global_rank_of(int group_rank) const { return ranks_.at(group_rank); }
  const c10::intrusive_ptr<c10d::Backend>& backend() const { return backend_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  Device device() const { return device_; }
  // The GPU an NCCL group is bound to; -1 on a CPU group (or one made without a bound GPU).
  int cuda_device() const { return cuda_device_; }
  // "cpu" or "cuda:1": the tensors this group's collectives take.
  MESHTORCH_DECL std::string device_name() const;

  // The same ranks over a CPU (Gloo) backend, for metadata; the group itself on a CPU mesh.
  MESHTORCH_DECL AxisGroup metadata() const;

  // The same group with another timeout for the collectives issued through the copy.
  AxisGroup with_timeout(std::chrono::milliseconds timeout) const {
    AxisGroup copy = *this;
    copy.timeout_ = timeout;
    return copy;
  }

  // "TP group [2, 3] on rank 3": how errors name the group.
  MESHTORCH_DECL std::string describe() const;

 private:
  std::string axis_name_;
  std::vector<int> ranks_;
  int global_rank_ = 0;
  int rank_ = 0;
  c10::intrusive_ptr<c10d::Backend> backend_;
  c10::intrusive_ptr<c10d::Backend> metadata_backend_;
  std::chrono::milliseconds timeout_{600'000};
  Device device_ = Device::cpu;
  int cuda_device_ = -1;
};

// The group of a process that runs alone (chapter 1): collectives over it return their input,
// so code written for a mesh (checkpoints) runs unchanged without one.
inline AxisGroup single_process_group() {
  return AxisGroup("world", {0}, 0, {}, std::chrono::milliseconds(600'000), Device::cpu);
}

}  // namespace meshtorch::comm

#if MESHTORCH_DEFINES(core)
#include <fmt/format.h>
#include <fmt/ranges.h>

namespace meshtorch::comm {

MESHTORCH_DECL AxisGroup::AxisGroup(std::string axis_name, std::vector<int> ranks, int global_rank,
                                    c10::intrusive_ptr<c10d::Backend> backend, std::chrono::milliseconds timeout,
                                    Device device, c10::intrusive_ptr<c10d::Backend> metadata_backend, int cuda_device)
    : axis_name_(std::move(axis_name)),
      ranks_(std::move(ranks)),
      global_rank_(global_rank),
      backend_(std::move(backend)),
      metadata_backend_(std::move(metadata_backend)),
      timeout_(timeout),
      device_(device),
      cuda_device_(cuda_device) {
  for (std::size_t i = 0; i < ranks_.size(); ++i)
    if (ranks_[i] == global_rank_) rank_ = static_cast<int>(i);
}

MESHTORCH_DECL std::string AxisGroup::device_name() const {
  return device_ == Device::cpu || cuda_device_ < 0 ? to_string(device_) : fmt::format("cuda:{}", cuda_device_);
}

MESHTORCH_DECL AxisGroup AxisGroup::metadata() const {
  if (device_ == Device::cpu) return *this;
  if (!metadata_backend_ && size() > 1)
    throw CommError(
        fmt::format("the {} has no CPU companion group for metadata; create the group with "
                    "comm::init, which makes one beside every NCCL group",
                    describe()));
  AxisGroup copy = *this;
  copy.backend_ = metadata_backend_;
  copy.metadata_backend_ = {};
  copy.device_ = Device::cpu;
  copy.cuda_device_ = -1;
  return copy;
}

MESHTORCH_DECL std::string AxisGroup::describe() const {
  return fmt::format("{} group [{}] on rank {}", axis_name_, fmt::join(ranks_, ", "), global_rank_);
}

}  // namespace meshtorch::comm
#endif  // MESHTORCH_DEFINES(core)
