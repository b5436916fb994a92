#pragma once
// A c10d::ProcessGroup over one mesh axis. PyTorch's DDP engine (c10d::Reducer) and its helpers
// (broadcast_coalesced) take a ProcessGroup, the dispatching front of one or more backends; an
// AxisGroup holds just the backend. This wraps that same backend, so the ProcessGroup's
// collectives share its queue and ordering with the AxisGroup's.
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <meshtorch/comm/axis_group.hpp>

namespace meshtorch::comm {

inline c10::intrusive_ptr<c10d::ProcessGroup> make_process_group(const AxisGroup& group) {
  auto process_group = c10::make_intrusive<c10d::ProcessGroup>(group.rank(), group.size());
  const bool cuda = group.device() == Device::cuda;
  const auto backend_type = cuda ? c10d::ProcessGroup::BackendType::NCCL : c10d::ProcessGroup::BackendType::GLOO;
  process_group->setBackend(cuda ? c10::DeviceType::CUDA : c10::DeviceType::CPU, backend_type, group.backend());
  process_group->setDefaultBackend(backend_type);
  return process_group;
}

}  // namespace meshtorch::comm
