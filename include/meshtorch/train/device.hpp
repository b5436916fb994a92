#pragma once
// --device and --dtype as the guide uses them: a GPU in bf16 where there is one, else the CPU
// in fp32. The GPU of a rank is comm::local_cuda_device's, the one its NCCL groups are bound to.
#include <optional>
#include <string>

#include <meshtorch/torch.hpp>

#include <meshtorch/error.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::train {

MESHTORCH_DECL torch::Device resolve_device(const std::string& flag, int local_rank = 0);

// Intra-op threads for a rank that computes on a GPU: the CPUs this process may run on, shared
// by the ranks of its node, as the guide sets OMP_NUM_THREADS to the CPUs per GPU. Launchers
// set 1 (torchrun, meshrun), which would leave CPU offload's AdamW and the data on one core.
MESHTORCH_DECL int host_threads_per_rank(int local_world_size);

// `weights_dtype`: the dtype of the pretrained weights -m loads, if it says one
// (llama::weights_dtype): `--dtype auto` takes it, as transformers 5's from_pretrained does;
// otherwise auto is bf16 on a GPU and fp32 on the CPU. float16 is refused: training in it needs
// loss scaling, which meshtorch does not do.
MESHTORCH_DECL torch::ScalarType resolve_dtype(const std::string& flag, const torch::Device& device,
                                               std::optional<torch::ScalarType> weights_dtype = std::nullopt);

// --deterministic, as torch.use_deterministic_algorithms(True) with its companions: an op without
// a deterministic kernel becomes an error instead of a silent source of run-to-run differences,
// cuDNN chooses no algorithm by timing, and cuBLAS gets the fixed workspace its deterministic
// mode needs (read at its first use, so this comes before any CUDA work).
MESHTORCH_DECL void use_deterministic_algorithms(bool on);

}  // namespace meshtorch::train

#if MESHTORCH_DEFINES(core)
#include <sched.h>

#include <algorithm>
#include <thread>

#include <fmt/format.h>
#include <stdlib.h>

#include <meshtorch/comm/local_device.hpp>

namespace meshtorch::train {

MESHTORCH_DECL torch::Device resolve_device(const std::string& flag, int local_rank) {
  if (flag != "cpu" && flag != "cuda" && flag != "auto")
    throw ConfigError(fmt::format("--device {}: expected cpu, cuda or auto", flag));
  const bool want_cuda = flag == "cuda" || (flag == "auto" && comm::built_with_cuda && torch::cuda::is_available());
  if (!want_cuda) return torch::Device(torch::kCPU);
  return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(comm::local_cuda_device(local_rank)));
}

MESHTORCH_DECL int host_threads_per_rank(int local_world_size) {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  const int cpus = sched_getaffinity(0, sizeof allowed, &allowed) == 0
                       ? CPU_COUNT(&allowed)
                       : static_cast<int>(std::thread::hardware_concurrency());
  return std::max(1, cpus / std::max(1, local_world_size));
}

MESHTORCH_DECL torch::ScalarType resolve_dtype(const std::string& flag, const torch::Device& device,
                                               std::optional<torch::ScalarType> weights_dtype) {
  if (flag == "float32") return torch::kFloat;
  if (flag == "bfloat16") return torch::kBFloat16;
  if (weights_dtype == torch::kHalf)
    throw ConfigError(
        "--dtype auto: -m's config.json says its weights are float16, and training in float16 needs "
        "loss scaling, which meshtorch does not do; pass --dtype bfloat16 or --dtype float32");
  if (weights_dtype) return *weights_dtype;
  return device.is_cuda() ? torch::kBFloat16 : torch::kFloat;
}

MESHTORCH_DECL void use_deterministic_algorithms(bool on) {
  if (!on) return;
  ::setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", /*overwrite=*/0);
  at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/false);
  at::globalContext().setDeterministicCuDNN(true);
  at::globalContext().setBenchmarkCuDNN(false);
}

}  // namespace meshtorch::train
#endif  // MESHTORCH_DEFINES(core)
