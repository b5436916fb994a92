#pragma once
// Counts the bytes LibTorch's CPU allocator hands out, current and peak: on the CPU, what the
// CUDA caching allocator's allocated_bytes statistics say on a GPU. The process's RSS cannot tell
// this: glibc keeps freed blocks in its heap, LibTorch's own code and Gloo's buffers count too.
// Installed once for the whole process (it wraps the allocator every CPU tensor made afterwards
// comes from); tensors made before keep their own deleters.
//
//   auto& counter = train::CpuAllocationCounter::install();
//   counter.reset_peak();
//   ... forward and backward ...
//   counter.peak() - before   // what the step held at most, in bytes
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include <c10/core/Allocator.h>

#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::train {

class CpuAllocationCounter final : public c10::Allocator {
 public:
  MESHTORCH_DECL static CpuAllocationCounter& install();

  std::int64_t current() const { return current_.load(); }
  std::int64_t peak() const { return peak_.load(); }
  void reset_peak() { peak_.store(current_.load()); }

  MESHTORCH_DECL c10::DataPtr allocate(std::size_t nbytes) override;

  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }

 private:
  // The inner allocation and its size, freed (and subtracted) with the DataPtr.
  struct Held {
    c10::DataPtr inner;
    std::int64_t nbytes;
    CpuAllocationCounter* counter;
  };

  explicit CpuAllocationCounter(c10::Allocator* inner) : inner_(inner) {}

  static void release(void* context) {
    auto* held = static_cast<Held*>(context);
    held->counter->current_.fetch_sub(held->nbytes);
    delete held;
  }

  void add(std::int64_t nbytes) {
    const auto now = current_.fetch_add(nbytes) + nbytes;
    auto seen = peak_.load();
    while (now > seen && !peak_.compare_exchange_weak(seen, now)) {
    }
  }

  c10::Allocator* inner_;
  std::atomic<std::int64_t> current_{0}, peak_{0};
};

}  // namespace meshtorch::train

#if MESHTORCH_DEFINES(programs)
#include <utility>

#include <c10/core/CPUAllocator.h>

namespace meshtorch::train {

MESHTORCH_DECL CpuAllocationCounter& CpuAllocationCounter::install() {
  static CpuAllocationCounter* counter = [] {
    auto* made = new CpuAllocationCounter(c10::GetCPUAllocator());  // lives as long as the process
    c10::SetCPUAllocator(made, /*priority=*/1);
    return made;
  }();
  return *counter;
}

MESHTORCH_DECL c10::DataPtr CpuAllocationCounter::allocate(std::size_t nbytes) {
  auto inner = inner_->allocate(nbytes);
  void* data = inner.get();
  const auto device = inner.device();
  add(static_cast<std::int64_t>(nbytes));
  return {data, new Held{std::move(inner), static_cast<std::int64_t>(nbytes), this}, &release, device};
}

}  // namespace meshtorch::train
#endif  // MESHTORCH_DEFINES(programs)
