#pragma once
// comm::init<M>(options): the start of a distributed program. Rendezvous through a TCPStore,
// the mesh fingerprint check, this rank's process group along each axis and each set of merged
// axes (shared memory and Gloo for CPU meshes, NCCL for CUDA ones), and the watchdog attached to
// the store.
// Start-up code includes it (parallel/launch.hpp does); the umbrella header does not, so that
// the translation units that only use a mesh do not compile Gloo's headers, the rendezvous
// and the watchdog (docs/performance.md "Compile time").
#include <atomic>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#if defined(MESHTORCH_WITH_CUDA)
#include <c10/cuda/CUDAFunctions.h>
#endif

#include <meshtorch/comm/axis_group.hpp>
#include <meshtorch/comm/backend.hpp>
#include <meshtorch/comm/device_mesh.hpp>
#include <meshtorch/comm/env.hpp>
#include <meshtorch/comm/local_device.hpp>
#include <meshtorch/comm/rendezvous.hpp>
#include <meshtorch/comm/shared_memory_backend.hpp>
#include <meshtorch/diagnostics/fingerprint.hpp>
#include <meshtorch/diagnostics/watchdog.hpp>
#include <meshtorch/error.hpp>
#include <meshtorch/layout/mesh.hpp>
#include <meshtorch/layout/mesh_shape.hpp>

namespace meshtorch::comm {

// The fingerprint ranks compare: the mesh type, the device, the CPU transport (ranks that differ
// would wait for each other's handshake until the store's timeout) and the caller's string.
template <MeshType M>
std::string mesh_fingerprint(Device device, const std::string& user) {
  std::string out = std::string(M::name) + " on " + to_string(device) + "\nMESHTORCH_CPU_TRANSPORT=" +
                    (cpu_transport_from_environment() == CpuTransport::shared_memory ? "shm" : "gloo");
  // The mesh on a line of its own: a mismatch names the first line that differs.
  return user.empty() ? out : out + "\n" + user;
}

namespace detail {

// comm::init<M>(options)'s body (comm::init itself is declared in device_mesh.hpp).
template <class Deferred>
struct MeshStartUp {
  template <MeshType M>
  static DeviceMesh<M> start(InitOptions options);
};

template <class Deferred>
template <MeshType M>
DeviceMesh<M> MeshStartUp<Deferred>::start(InitOptions options) {
  LaunchEnv env = options.env ? *options.env : launch_env();
  const std::string fingerprint = mesh_fingerprint<M>(options.device, options.fingerprint);
  // Each init of a process keys its store entries apart. A second init (a test that builds two
  // meshes in turn) starts a second store on the master port while rank 0 may still serve the
  // first: a rank that reaches the old one then waits for keys that never come and fails in the
  // fingerprint check below, instead of reading the old mesh's Gloo addresses and connecting to a
  // socket that may by then belong to another program.
  static std::atomic<int> inits{0};
  c10::intrusive_ptr<c10d::Store> store =
      c10::make_intrusive<c10d::PrefixStore>(fmt::format("init{}", inits++), rendezvous(env, options.timeout));
  // Before anything that depends on the mesh: ranks that disagree about it stop here.
  diagnostics::check_fingerprints(*store, env.rank, env.world_size, fingerprint, options.timeout);

  DeviceMesh<M> mesh(env, MeshShape<M>::resolve(env.world_size, options.extents));
  mesh.device_ = options.device;
  mesh.fingerprint_ = fingerprint;
  mesh.store_ = store;

  int cuda_device = -1;
  if (options.device == Device::cuda) {
    cuda_device = local_cuda_device(env.local_rank, "comm::init with Device::cuda");
#if defined(MESHTORCH_WITH_CUDA)
    c10::cuda::set_device(static_cast<c10::DeviceIndex>(cuda_device));
#endif
  }
  const bool single_node = env.local_world_size == env.world_size;
  // Gloo (under the shared-memory transport between the ranks of one host) serves CPU meshes and,
  // on CUDA meshes, each group's CPU companion for metadata.
  auto gloo_device = make_gloo_device(single_node);
  auto make_group = [&](const std::string& axis_name, const std::string& prefix, std::vector<int> ranks) {
    int group_rank = 0;
    for (std::size_t i = 0; i < ranks.size(); ++i)
      if (ranks[i] == env.rank) group_rank = static_cast<int>(i);
    BackendRequest request{options.device,  c10::make_intrusive<c10d::PrefixStore>(prefix, store),
                           group_rank,      static_cast<int>(ranks.size()),
                           options.timeout, gloo_device,
                           cuda_device};
    try {
      c10::intrusive_ptr<c10d::Backend> metadata_backend;
      if (options.device == Device::cuda) {
        BackendRequest metadata_request = request;
        metadata_request.device = Device::cpu;
        metadata_request.store = c10::make_intrusive<c10d::PrefixStore>(prefix + "metadata/", store);
        metadata_backend = make_backend(metadata_request);
      }
      return AxisGroup(axis_name, std::move(ranks), env.rank, make_backend(request), options.timeout, options.device,
                       std::move(metadata_backend), cuda_device);
    } catch (const ConfigError&) {
      throw;
    } catch (const std::exception& e) {
      throw CommError(
          fmt::format("rank {}: creating its {} group of {} failed: {}", env.rank, axis_name, M::name, e.what()));
    }
  };

  const auto& shape = mesh.shape_;
  for (unsigned mask = 1; mask <= MeshShape<M>::all_axes; ++mask) {
    if (M::ndim > 1 && mask == MeshShape<M>::all_axes) break;  // that one is the world
    const std::string axis_name = MeshShape<M>::mask_name(mask);
    auto ranks = shape.slice_ranks(mask, env.rank);
    // The slice is named by its lowest rank, the same on all its members.
    const std::string prefix = "meshtorch/" + axis_name + "/" + std::to_string(ranks.front()) + "/";
    mesh.groups_[mask] = make_group(axis_name, prefix, std::move(ranks));
  }
  std::vector<int> everyone(static_cast<std::size_t>(env.world_size));
  for (int r = 0; r < env.world_size; ++r) everyone[r] = r;
  mesh.world_ = make_group("world", "meshtorch/world/", std::move(everyone));
  if (single_node) {
    mesh.node_ = mesh.world_;
  } else if (env.world_size % env.local_world_size == 0 && env.rank % env.local_world_size == env.local_rank) {
    std::vector<int> node_ranks(static_cast<std::size_t>(env.local_world_size));
    for (int i = 0; i < env.local_world_size; ++i) node_ranks[i] = env.rank - env.local_rank + i;
    const std::string prefix = "meshtorch/node/" + std::to_string(node_ranks.front()) + "/";
    mesh.node_ = make_group("node", prefix, std::move(node_ranks));
  }
  // Progress reports through the store, so a stalled collective names its culprit.
  if (env.world_size > 1)
    diagnostics::Watchdog::instance().attach(store, env.rank, env.world_size, options.timeout, host_name());
  return mesh;
}

}  // namespace detail

}  // namespace meshtorch::comm
