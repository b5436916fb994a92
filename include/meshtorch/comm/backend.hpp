#pragma once
// Creating one c10d backend: Gloo for CPU tensors (wrapped by the shared-memory transport where
// MESHTORCH_CPU_TRANSPORT=shm, comm/shared_memory_backend.hpp), NCCL for CUDA tensors. The NCCL
// path compiles only in a CUDA build (MESHTORCH_WITH_CUDA, set by -DMESHTORCH_CUDA=ON).
//
// An NCCL backend is bound to the rank's GPU and connected at once (PyTorch's
// init_process_group(device_id=...)): left unbound, ProcessGroupNCCL guesses the GPU from the
// group rank at the first collective, which in an axis group is a mesh coordinate, not a GPU.
#include <chrono>
#include <memory>

#include <gloo/transport/device.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <meshtorch/comm/device.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::comm {

// The network endpoint Gloo binds to. One job on one node talks over loopback; across nodes,
// GLOO_SOCKET_IFNAME picks the interface as it does in PyTorch, else the host name's address.
MESHTORCH_DECL std::shared_ptr<::gloo::transport::Device> make_gloo_device(bool single_node);

struct BackendRequest {
  Device device = Device::cpu;
  c10::intrusive_ptr<c10d::Store> store;  // already prefixed for this group
  int rank = 0;                           // in the group
  int size = 1;
  std::chrono::milliseconds timeout{600'000};
  std::shared_ptr<::gloo::transport::Device> gloo_device;  // shared by all Gloo groups
  int cuda_device = -1;                                    // the rank's GPU, for an NCCL backend
};

MESHTORCH_DECL c10::intrusive_ptr<c10d::Backend> make_backend(const BackendRequest& request);

}  // namespace meshtorch::comm

#if MESHTORCH_DEFINES(programs)
#include <cstdlib>
#include <string>

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#if defined(MESHTORCH_WITH_CUDA)
// c10d's headers hide ProcessGroupNCCL unless this is defined; TorchConfig does not define it.
#ifndef USE_C10D_NCCL
#define USE_C10D_NCCL
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <meshtorch/comm/shared_memory_backend.hpp>
#include <meshtorch/error.hpp>

namespace meshtorch::comm {

MESHTORCH_DECL std::shared_ptr<::gloo::transport::Device> make_gloo_device(bool single_node) {
  if (const char* interface = std::getenv("GLOO_SOCKET_IFNAME"); interface && *interface)
    return c10d::ProcessGroupGloo::createDeviceForInterface(interface);
  if (single_node) return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

MESHTORCH_DECL c10::intrusive_ptr<c10d::Backend> make_backend(const BackendRequest& request) {
  if (request.device == Device::cpu) {
    auto options = c10d::ProcessGroupGloo::Options::create(request.timeout);
    options->devices.push_back(request.gloo_device);
    // One thread per group: every rank is a process with one compute thread (OMP_NUM_THREADS=1
    // in tests), and meshes create several groups.
    options->threads = 1;
    c10::intrusive_ptr<c10d::Backend> gloo =
        c10::make_intrusive<c10d::ProcessGroupGloo>(request.store, request.rank, request.size, options);
    if (request.size > 1 && cpu_transport_from_environment() == CpuTransport::shared_memory)
      if (auto shared = make_shared_memory_backend(request.store, request.rank, request.size, request.timeout, gloo))
        return shared;
    return gloo;
  }
#if defined(MESHTORCH_WITH_CUDA)
  if (request.cuda_device < 0)
    throw ConfigError(
        "an NCCL group needs the rank's GPU (BackendRequest::cuda_device); comm::init "
        "sets it from comm::local_cuda_device");
  const at::Device gpu(at::kCUDA, static_cast<c10::DeviceIndex>(request.cuda_device));
  auto options = c10d::ProcessGroupNCCL::Options::create();
  // The watchdog's limit: a collective that does not finish in time aborts the communicator.
  options->timeout = request.timeout;
  auto nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(request.store, request.rank, request.size, options);
  nccl->setBoundDeviceId(gpu);
  nccl->eagerConnectSingleDevice(gpu);
  return nccl;
#else
  throw ConfigError(
      "device cuda asked of a meshtorch built without CUDA; configure with -DMESHTORCH_CUDA=ON, "
      "or init the mesh with comm::Device::cpu");
#endif
}

}  // namespace meshtorch::comm
#endif  // MESHTORCH_DEFINES(programs)
