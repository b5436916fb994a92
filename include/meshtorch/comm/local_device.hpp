#pragma once
// Which GPU a rank uses: one rule for the mesh's NCCL groups (comm::init) and for the training
// loop's tensors (train::resolve_device), so the two never disagree: local_rank on a node whose
// GPUs are all visible to every rank (torchrun, meshrun), and GPU 0 where the launcher shows each
// task only its own (Slurm's --gpus-per-task=1, CUDA_VISIBLE_DEVICES set per rank).
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

// The rule alone, for `visible` GPUs (at least 1). A node with several visible GPUs and more
// local ranks than GPUs would put two ranks on one GPU, which NCCL refuses at its first
// collective ("Duplicate GPU detected"): a ConfigError at start-up instead. With one visible GPU
// the launcher may be showing each rank its own, so every rank takes it.
inline int cuda_device_for(int local_rank, int visible, const std::string& asked_by = "--device cuda") {
  if (local_rank < 0) throw ConfigError(fmt::format("{}: local rank {} is negative", asked_by, local_rank));
  if (visible > 1 && local_rank >= visible)
    throw ConfigError(fmt::format(
        "{}: local rank {} on a node where this process sees {} GPUs (cuda:0 to cuda:{}): one GPU per rank allows "
        "at most {} ranks here (--nproc-per-node {}), or show each rank only its own GPU (CUDA_VISIBLE_DEVICES "
        "per rank, Slurm's --gpus-per-task=1)",
        asked_by, local_rank, visible, visible - 1, visible, visible));
  return local_rank % visible;
}

// The CUDA device index of the rank at `local_rank`; a ConfigError, naming the fix, when this
// program cannot use a GPU.
inline int local_cuda_device(int local_rank, const std::string& asked_by = "--device cuda") {
  if (!built_with_cuda)
    throw ConfigError(
        fmt::format("{}: this program was built without CUDA; build it with scripts/setup on a machine "
                    "with a GPU and a CUDA LibTorch (or configure with -DMESHTORCH_CUDA=ON), or use "
                    "--device cpu",
                    asked_by));
  const auto count = static_cast<int>(torch::cuda::device_count());
  if (count == 0)
    throw ConfigError(
        fmt::format("{}: no CUDA device is visible to this process (nvidia-smi lists the GPUs; check "
                    "CUDA_VISIBLE_DEVICES and the driver), or use --device cpu",
                    asked_by));
  return cuda_device_for(local_rank, count, asked_by);
}

}  // namespace meshtorch::comm
