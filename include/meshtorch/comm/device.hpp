#pragma once
// The kind of device a mesh's groups communicate on: shared memory and Gloo serve the CPU, NCCL
// CUDA (comm/backend.hpp creates them).
#include <string>

namespace meshtorch::comm {

enum class Device { cpu, cuda };

inline std::string to_string(Device device) { return device == Device::cpu ? "cpu" : "cuda"; }

}  // namespace meshtorch::comm
