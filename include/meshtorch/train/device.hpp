#pragma once
// --device and --dtype as the guide uses them: a GPU in bf16 where there is one, else the CPU
// in fp32.
#include <string>

#include <torch/torch.h>

#include "meshtorch/error.hpp"

namespace meshtorch::train {

inline torch::Device resolve_device(const std::string& flag, int local_rank = 0) {
  const bool want_cuda = flag == "cuda" || (flag == "auto" && torch::cuda::is_available());
  if (!want_cuda) return torch::Device(torch::kCPU);
  if (!torch::cuda::is_available())
    throw ConfigError("--device cuda: no CUDA device is visible to this process (or LibTorch was built without CUDA)");
  const auto count = static_cast<int>(torch::cuda::device_count());
  return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(local_rank % count));
}

inline torch::ScalarType resolve_dtype(const std::string& flag, const torch::Device& device) {
  if (flag == "float32") return torch::kFloat;
  if (flag == "bfloat16") return torch::kBFloat16;
  return device.is_cuda() ? torch::kBFloat16 : torch::kFloat;
}

}  // namespace meshtorch::train
