#pragma once
// Memory figures for the metrics: allocator statistics on CUDA (as torch.cuda.memory_stats),
// the process's peak resident set on CPU. Peaks are reset after each log line, as in the guide.
#include <cstdint>
#include <map>
#include <string>

#include <meshtorch/torch.hpp>

#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::train {

MESHTORCH_DECL double kib_field_from_proc_status(const std::string& field);

// This process's resident set now and at its peak (since start or the last reset_peak_rss()).
inline std::int64_t rss_bytes() { return static_cast<std::int64_t>(kib_field_from_proc_status("VmRSS")) * 1024; }
inline std::int64_t peak_rss_bytes() { return static_cast<std::int64_t>(kib_field_from_proc_status("VmHWM")) * 1024; }
MESHTORCH_DECL void reset_peak_rss();  // VmHWM := VmRSS

// GiB figures under the guide's names: on CUDA the device's total memory and the caching
// allocator's current and peak allocated and reserved bytes (torch.cuda.memory_stats), peaks
// since the last reset_peak_memory().
MESHTORCH_DECL std::map<std::string, double> memory_figures(const torch::Device& device);

MESHTORCH_DECL void reset_peak_memory(const torch::Device& device);

}  // namespace meshtorch::train

#if MESHTORCH_DEFINES(core)
#include <fstream>

#if defined(MESHTORCH_WITH_CUDA)
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace meshtorch::train {

MESHTORCH_DECL double kib_field_from_proc_status(const std::string& field) {
  std::ifstream status("/proc/self/status");
  std::string key;
  double value = 0;
  std::string unit;
  while (status >> key) {
    if (key == field + ":") {
      status >> value >> unit;
      return value;
    }
    status.ignore(1 << 12, '\n');
  }
  return 0;
}

MESHTORCH_DECL void reset_peak_rss() { std::ofstream("/proc/self/clear_refs") << "5"; }

MESHTORCH_DECL std::map<std::string, double> memory_figures(const torch::Device& device) {
  constexpr double gib = 1024.0 * 1024.0 * 1024.0;
  std::map<std::string, double> figures;
#if defined(MESHTORCH_WITH_CUDA)
  if (device.is_cuda()) {
    const auto index = device.index() < 0 ? c10::cuda::current_device() : device.index();
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(index);
    const auto all = static_cast<std::size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    figures["total_gb"] = static_cast<double>(at::cuda::getDeviceProperties(index)->totalGlobalMem) / gib;
    figures["curr_alloc_gb"] = stats.allocated_bytes[all].current / gib;
    figures["peak_alloc_gb"] = stats.allocated_bytes[all].peak / gib;
    figures["curr_resv_gb"] = stats.reserved_bytes[all].current / gib;
    figures["peak_resv_gb"] = stats.reserved_bytes[all].peak / gib;
  }
#else
  (void)device;
#endif
  figures["peak_rss_gb"] = kib_field_from_proc_status("VmHWM") * 1024.0 / gib;
  figures["curr_rss_gb"] = kib_field_from_proc_status("VmRSS") * 1024.0 / gib;
  return figures;
}

MESHTORCH_DECL void reset_peak_memory(const torch::Device& device) {
#if defined(MESHTORCH_WITH_CUDA)
  if (device.is_cuda())
    c10::cuda::CUDACachingAllocator::resetPeakStats(device.index() < 0 ? c10::cuda::current_device() : device.index());
#else
  (void)device;
#endif
  reset_peak_rss();
}

}  // namespace meshtorch::train
#endif  // MESHTORCH_DEFINES(core)
