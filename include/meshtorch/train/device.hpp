#pragma once
// --device and --dtype as the guide uses them: a GPU in bf16 where there is one, else the CPU
// in fp32. The GPU of a rank is comm::local_cuda_device's, the one its NCCL groups are bound to.
#include <string>

#include <fmt/format.h>
#include <torch/torch.h>

#include <meshtorch/comm/local_device.hpp>
#include <meshtorch/error.hpp>

namespace meshtorch::train {

inline torch::Device resolve_device(const std::string& flag, int local_rank = 0) {
  if (flag != "cpu" && flag != "cuda" && flag != "auto")
    throw ConfigError(fmt::format("--device {}: expected cpu, cuda or auto", flag));
  const bool want_cuda =
      flag == "cuda" || (flag == "auto" && comm::built_with_cuda && torch::cuda::is_available());
  if (!want_cuda) return torch::Device(torch::kCPU);
  return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(comm::local_cuda_device(local_rank)));
}

inline torch::ScalarType resolve_dtype(const std::string& flag, const torch::Device& device) {
  if (flag == "float32") return torch::kFloat;
  if (flag == "bfloat16") return torch::kBFloat16;
  return device.is_cuda() ? torch::kBFloat16 : torch::kFloat;
}

}  // namespace meshtorch::train
