#pragma once
// DeviceMesh<M>: a Mesh type brought to life on this rank. init<M>() rendezvouses through a
// TCPStore, checks that every rank runs the same mesh (fingerprint), resolves the dynamic
// extent from the world size and creates this rank's process group along each axis.
//
// Each slice's group gets its own store prefix ("meshtorch/TP/3/"), so only the slice's members
// construct it, and every rank creates its groups axis by axis in the mesh's order: each group
// waits only for ranks at the same step, which cannot deadlock.
#include <array>
#include <chrono>
#include <cstddef>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <meshtorch/comm/axis_group.hpp>
#include <meshtorch/comm/backend.hpp>
#include <meshtorch/comm/env.hpp>
#include <meshtorch/comm/fingerprint.hpp>
#include <meshtorch/comm/local_device.hpp>
#include <meshtorch/comm/rendezvous.hpp>
#include <meshtorch/error.hpp>
#include <meshtorch/layout/mesh.hpp>
#include <meshtorch/layout/mesh_shape.hpp>

namespace meshtorch::comm {

struct InitOptions {
  Device device = Device::cpu;
  // Bounds the rendezvous, the fingerprint exchange, group creation and, by default, every
  // collective of the mesh's groups.
  std::chrono::milliseconds timeout = std::chrono::minutes(10);
  // Compared across ranks with the mesh type: put the plan, model config and flags that must
  // agree here.
  std::string fingerprint;
  // Where this rank sits; read from the launcher's variables when absent.
  std::optional<LaunchEnv> env;
};

template <MeshType M>
class DeviceMesh;

template <MeshType M>
DeviceMesh<M> init(InitOptions options = {});

template <MeshType M>
class DeviceMesh {
 public:
  using mesh_type = M;
  static constexpr std::size_t ndim = M::ndim;

  int rank() const { return env_.rank; }
  int world_size() const { return shape_.size(); }
  const MeshShape<M>& shape() const { return shape_; }
  const LaunchEnv& env() const { return env_; }
  Device device() const { return device_; }
  const std::string& fingerprint() const { return fingerprint_; }
  const c10::intrusive_ptr<c10d::Store>& store() const { return store_; }

  std::array<int, ndim> coords() const { return shape_.coord_of(rank()); }

  template <template <std::size_t> class Kind>
    requires MeshWithAxis<M, Kind>
  int coord() const {
    return shape_.template coord<Kind>(rank());
  }

  template <template <std::size_t> class Kind>
    requires MeshWithAxis<M, Kind>
  int size() const {
    return shape_.template extent<Kind>();
  }

  template <template <std::size_t> class Kind>
    requires MeshWithAxis<M, Kind>
  const AxisGroup& group() const {
    return groups_[M::template index_of<Kind>];
  }
  const AxisGroup& group(std::size_t axis_index) const { return groups_.at(axis_index); }
  // All ranks, for job-wide barriers and broadcasts.
  const AxisGroup& world() const { return world_; }

  template <MeshType N>
  friend DeviceMesh<N> init(InitOptions options);

 private:
  DeviceMesh(LaunchEnv env, MeshShape<M> shape) : env_(std::move(env)), shape_(shape) {}

  LaunchEnv env_;
  MeshShape<M> shape_;
  Device device_ = Device::cpu;
  std::string fingerprint_;
  c10::intrusive_ptr<c10d::Store> store_;
  std::array<AxisGroup, ndim> groups_;
  AxisGroup world_;
};

// The fingerprint ranks compare: the mesh type, the device and the caller's string.
template <MeshType M>
std::string mesh_fingerprint(Device device, const std::string& user) {
  std::string out = std::string(M::name) + " on " + to_string(device);
  return user.empty() ? out : out + " | " + user;
}

template <MeshType M>
DeviceMesh<M> init(InitOptions options) {
  LaunchEnv env = options.env ? *options.env : launch_env();
  const std::string fingerprint = mesh_fingerprint<M>(options.device, options.fingerprint);
  auto store = rendezvous(env, options.timeout);
  // Before anything that depends on the mesh: ranks that disagree about it stop here.
  check_fingerprints(*store, env.rank, env.world_size, fingerprint, options.timeout);

  DeviceMesh<M> mesh(env, MeshShape<M>::resolve(env.world_size));
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
  // Gloo serves CPU meshes and, on CUDA meshes, each group's CPU companion for metadata.
  auto gloo_device = make_gloo_device(single_node);
  auto make_group = [&](const std::string& axis_name, const std::string& prefix,
                        std::vector<int> ranks) {
    int group_rank = 0;
    for (std::size_t i = 0; i < ranks.size(); ++i)
      if (ranks[i] == env.rank) group_rank = static_cast<int>(i);
    BackendRequest request{options.device,
                           c10::make_intrusive<c10d::PrefixStore>(prefix, store),
                           group_rank,
                           static_cast<int>(ranks.size()),
                           options.timeout,
                           gloo_device,
                           cuda_device};
    try {
      c10::intrusive_ptr<c10d::Backend> metadata_backend;
      if (options.device == Device::cuda) {
        BackendRequest metadata_request = request;
        metadata_request.device = Device::cpu;
        metadata_request.store = c10::make_intrusive<c10d::PrefixStore>(prefix + "metadata/", store);
        metadata_backend = make_backend(metadata_request);
      }
      return AxisGroup(axis_name, std::move(ranks), env.rank, make_backend(request),
                       options.timeout, options.device, std::move(metadata_backend), cuda_device);
    } catch (const ConfigError&) {
      throw;
    } catch (const std::exception& e) {
      throw CommError("rank " + std::to_string(env.rank) + ": creating its " + axis_name +
                      " group of " + std::string(M::name) + " failed: " + e.what());
    }
  };

  const auto& shape = mesh.shape_;
  for (std::size_t axis_index = 0; axis_index < M::ndim; ++axis_index) {
    const std::string axis_name(M::axis_names[axis_index]);
    auto ranks = shape.slice_ranks(axis_index, env.rank);
    // The slice is named by its lowest rank, the same on all its members.
    const std::string prefix = "meshtorch/" + axis_name + "/" + std::to_string(ranks.front()) + "/";
    mesh.groups_[axis_index] = make_group(axis_name, prefix, std::move(ranks));
  }
  std::vector<int> everyone(static_cast<std::size_t>(env.world_size));
  for (int r = 0; r < env.world_size; ++r) everyone[r] = r;
  mesh.world_ = make_group("world", "meshtorch/world/", std::move(everyone));
  return mesh;
}

}  // namespace meshtorch::comm
