#pragma once
// Copies between a GPU and pinned host memory issued with non_blocking: the host must not read
// (or overwrite) its side until the device's stream has run them. CopyInFlight marks the
// stream's position after the copies (a device event) and wait() blocks the host thread until
// the stream has passed it. On the CPU a copy is done when it returns: nothing to wait for.
//
// Device-generic (c10::Event through the device's guard), so the same code compiles and runs
// against a CPU LibTorch.
#include <optional>
#include <utility>

#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <meshtorch/torch.hpp>

namespace meshtorch::train {

class CopyInFlight {
 public:
  CopyInFlight() = default;  // nothing in flight

  // After issuing the copies on `device`'s current stream.
  static CopyInFlight after_copies_on(const torch::Device& device) {
    CopyInFlight copy;
    if (device.is_cpu()) return copy;
    const c10::impl::VirtualGuardImpl guard(device.type());
    copy.event_.emplace(device.type());
    copy.event_->record(guard.getStream(device));
    return copy;
  }

  void wait() {
    if (!event_) return;
    event_->synchronize();
    event_.reset();
  }

 private:
  std::optional<c10::Event> event_;
};

// Host memory that non_blocking copies to and from `device` can use: pinned when `device` is a
// GPU (pageable memory turns the copy into a synchronous one), plain on the CPU.
inline torch::TensorOptions host_options_for(const torch::Device& device, torch::ScalarType dtype) {
  return torch::TensorOptions().device(torch::kCPU).dtype(dtype).pinned_memory(!device.is_cpu());
}

}  // namespace meshtorch::train
