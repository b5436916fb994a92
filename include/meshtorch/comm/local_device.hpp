#pragma once
// Which GPU a rank uses: one rule for the mesh's NCCL groups (comm::init) and for the training
// loop's tensors (train::resolve_device), so the two never disagree. local_rank modulo the
// visible GPUs: local_rank on a node whose GPUs are all visible to every rank (torchrun,
// meshrun), and GPU 0 where the launcher shows each task only its own (Slurm's
// --gpus-per-task=1, CUDA_VISIBLE_DEVICES set per rank).
#include <string>

#include <fmt/format.h>
#include <torch/cuda.h>

#include <meshtorch/error.hpp>

namespace meshtorch::comm {

// True when this program was compiled for CUDA (-DMESHTORCH_CUDA=ON).
inline constexpr bool built_with_cuda =
#if defined(MESHTORCH_WITH_CUDA)
    true;
#else
    false;
#endif

// The CUDA device index of the rank at `local_rank`; a ConfigError, naming the fix, when this
// program cannot use a GPU.
inline int local_cuda_device(int local_rank, const std::string& asked_by = "--device cuda") {
  if (!built_with_cuda)
    throw ConfigError(fmt::format("{}: this program was built without CUDA; build it with scripts/setup on a machine "
                                  "with a GPU and a CUDA LibTorch (or configure with -DMESHTORCH_CUDA=ON), or use "
                                  "--device cpu",
                                  asked_by));
  const auto count = static_cast<int>(torch::cuda::device_count());
  if (count == 0)
    throw ConfigError(fmt::format("{}: no CUDA device is visible to this process (nvidia-smi lists the GPUs; check "
                                  "CUDA_VISIBLE_DEVICES and the driver), or use --device cpu",
                                  asked_by));
  if (local_rank < 0)
    throw ConfigError(fmt::format("{}: local rank {} is negative", asked_by, local_rank));
  return local_rank % count;
}

}  // namespace meshtorch::comm
