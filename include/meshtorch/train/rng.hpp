#pragma once
// The random number generators' states in a checkpoint, so a resumed run draws the same numbers
// (init, dropout, sampling) as one that never stopped: the CPU generator's, as "rng.cpu", and on
// a machine with GPUs the generator of every GPU this process sees, as "rng.cuda.<index>" (torch's
// get_rng_state_all). Resuming on fewer visible GPUs restores those it sees; a checkpoint without
// CUDA states resumed where GPUs are visible is an error, since that run's GPU draws would start
// from the seed instead of where the saved run left off.
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include <torch/cuda.h>

#include <meshtorch/torch.hpp>

#include <meshtorch/error.hpp>
#include <meshtorch/io/safetensors.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::train {

MESHTORCH_DECL std::string cuda_rng_key(int device);

// GPUs whose generators are saved: all this process sees (none in a CPU-only build).
inline int rng_cuda_devices() { return static_cast<int>(torch::cuda::device_count()); }

MESHTORCH_DECL std::vector<std::pair<std::string, torch::Tensor>> capture_rng_states();

// Restores what capture_rng_states() saved into `file`.
MESHTORCH_DECL void restore_rng_states(const io::SafetensorsFile& contents, const std::filesystem::path& file);

}  // namespace meshtorch::train

#if MESHTORCH_DEFINES(core)
#include <mutex>

#include <ATen/Context.h>
#include <fmt/format.h>

namespace meshtorch::train {

MESHTORCH_DECL std::string cuda_rng_key(int device) { return fmt::format("rng.cuda.{}", device); }

MESHTORCH_DECL std::vector<std::pair<std::string, torch::Tensor>> capture_rng_states() {
  std::vector<std::pair<std::string, torch::Tensor>> states;
  states.emplace_back("rng.cpu", at::detail::getDefaultCPUGenerator().get_state());
  for (int device = 0; device < rng_cuda_devices(); ++device) {
    auto generator =
        at::globalContext().defaultGenerator(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device)));
    std::lock_guard<std::mutex> lock(generator.mutex());
    states.emplace_back(cuda_rng_key(device), generator.get_state());
  }
  return states;
}

MESHTORCH_DECL void restore_rng_states(const io::SafetensorsFile& contents, const std::filesystem::path& file) {
  const auto* cpu = contents.find("rng.cpu");
  if (!cpu) throw DataError(fmt::format("{}: 'rng.cpu' is missing", file.string()));
  // A state LibTorch refuses (a damaged file whose checksum was rewritten) is named, not c10's raw error.
  auto set_state = [&](at::Generator generator, const torch::Tensor& state, const std::string& key) {
    std::lock_guard<std::mutex> lock(generator.mutex());
    try {
      generator.set_state(state);
    } catch (const c10::Error& e) {
      throw DataError(fmt::format("{}: '{}' is not a random-number generator state LibTorch accepts ({})",
                                  file.string(), key, e.what_without_backtrace()));
    }
  };
  set_state(at::detail::getDefaultCPUGenerator(), *cpu, "rng.cpu");
  const int devices = rng_cuda_devices();
  if (devices > 0 && !contents.find(cuda_rng_key(0)))
    throw DataError(
        fmt::format("{}: '{}' is missing: the checkpoint was saved where no GPU was visible, and this "
                    "process sees {}; resume where it was saved, or start a new run (-e) to draw GPU "
                    "numbers from the seed",
                    file.string(), cuda_rng_key(0), devices));
  for (int device = 0; device < devices; ++device) {
    const auto* state = contents.find(cuda_rng_key(device));
    if (!state) continue;  // saved where fewer GPUs were visible: those it saw are restored
    set_state(at::globalContext().defaultGenerator(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device))),
              *state, cuda_rng_key(device));
  }
}

}  // namespace meshtorch::train
#endif  // MESHTORCH_DEFINES(core)
