#pragma once
// DeviceMesh<M>: a Mesh type brought to life on this rank. init<M>() rendezvouses through a
// TCPStore, checks that every rank runs the same mesh (fingerprint), resolves the dynamic
// extents (given in InitOptions::extents, one of them left to the world size) and creates this
// rank's process group along each axis and along each set of merged axes (group<DP, FSDP>(),
// the data-parallel group of an HSDP or 3D mesh).
//
// Each slice's group gets its own store prefix ("meshtorch/TP/3/"), so only the slice's members
// construct it, and every rank creates its groups in the same order (by axis set): each group
// waits only for ranks at the same step, which cannot deadlock.
#include <array>
#include <chrono>
#include <cstddef>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <meshtorch/comm/axis_group.hpp>
#include <meshtorch/comm/backend.hpp>
#include <meshtorch/comm/env.hpp>
#include <meshtorch/comm/fingerprint.hpp>
#include <meshtorch/comm/local_device.hpp>
#include <meshtorch/comm/rendezvous.hpp>
#include <meshtorch/comm/watchdog.hpp>
#include <meshtorch/error.hpp>
#include <meshtorch/layout/mesh.hpp>
#include <meshtorch/layout/mesh_shape.hpp>

namespace meshtorch::comm {

struct InitOptions {
  Device device = Device::cpu;
  // Bounds the rendezvous, the fingerprint exchange, group creation and, by default, every
  // collective of the mesh's groups. Default: MESHTORCH_TIMEOUT seconds, else 600 s.
  std::chrono::milliseconds timeout = collective_timeout();
  // Compared across ranks with the mesh type: put the plan, model config and flags that must
  // agree here.
  std::string fingerprint;
  // Where this rank sits; read from the launcher's variables when absent.
  std::optional<LaunchEnv> env;
  // The extents of the mesh's dynamic axes, in axis order, as std::extents takes them; a
  // missing trailing value or from_world_size takes the ranks the world has left.
  std::vector<int> extents;
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

  // "rank 5 of 8 on cpu: DP 1 of 2, FSDP 0 of 2, TP 1 of 2": the banner every rank logs.
  std::string describe() const {
    std::string out = fmt::format("rank {} of {} on {}:", rank(), world_size(), to_string(device_));
    const auto mine = coords();
    for (std::size_t i = 0; i < ndim; ++i)
      out += fmt::format("{}{} {} of {}", i ? ", " : " ", M::axis_names[i], mine[i], shape_.extent(i));
    return out;
  }

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

  // The group along one axis, or along several merged axes: group<DP, FSDP>() holds the ranks
  // that share this rank's other coordinates, ordered row-major over DP and FSDP.
  template <template <std::size_t> class... Kinds>
  const AxisGroup& group() const {
    return group(M::template mask_of<Kinds...>);
  }
  const AxisGroup& group(unsigned axis_mask) const {
    if (axis_mask == 0 || axis_mask > MeshShape<M>::all_axes)
      throw ConfigError(fmt::format("DeviceMesh::group: axis mask {} names no axes of {}", axis_mask, M::name));
    if (ndim > 1 && axis_mask == MeshShape<M>::all_axes) return world_;
    return groups_[axis_mask];
  }
  const AxisGroup& axis_group(std::size_t axis_index) const { return group(1u << axis_index); }
  // All ranks, for job-wide barriers and broadcasts.
  const AxisGroup& world() const { return world_; }
  // The ranks of this rank's node (LOCAL_RANK 0 .. LOCAL_WORLD_SIZE-1), which share node-local
  // storage: the world on one node. Launchers number a node's ranks contiguously (torchrun,
  // meshrun); a job whose nodes run different numbers of ranks has no node group.
  const AxisGroup& node() const {
    if (!node_)
      throw ConfigError(fmt::format("rank {}: no node group: LOCAL_WORLD_SIZE {} does not divide the world size {} "
                                    "into nodes of consecutive ranks (rank {} is local rank {}); start the same "
                                    "number of ranks on every node",
                                    env_.rank, env_.local_world_size, env_.world_size, env_.rank, env_.local_rank));
    return *node_;
  }

  template <MeshType N>
  friend DeviceMesh<N> init(InitOptions options);

 private:
  DeviceMesh(LaunchEnv env, MeshShape<M> shape) : env_(std::move(env)), shape_(shape) {}

  LaunchEnv env_;
  MeshShape<M> shape_;
  Device device_ = Device::cpu;
  std::string fingerprint_;
  c10::intrusive_ptr<c10d::Store> store_;
  // Indexed by axis mask; the mask of every axis is world_.
  std::array<AxisGroup, (1u << ndim)> groups_;
  AxisGroup world_;
  std::optional<AxisGroup> node_;
};

// The fingerprint ranks compare: the mesh type, the device and the caller's string.
template <MeshType M>
std::string mesh_fingerprint(Device device, const std::string& user) {
  std::string out = std::string(M::name) + " on " + to_string(device);
  // The mesh on a line of its own: a mismatch names the first line that differs.
  return user.empty() ? out : out + "\n" + user;
}

template <MeshType M>
DeviceMesh<M> init(InitOptions options) {
  LaunchEnv env = options.env ? *options.env : launch_env();
  const std::string fingerprint = mesh_fingerprint<M>(options.device, options.fingerprint);
  auto store = rendezvous(env, options.timeout);
  // Before anything that depends on the mesh: ranks that disagree about it stop here.
  check_fingerprints(*store, env.rank, env.world_size, fingerprint, options.timeout);

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
      throw CommError(fmt::format("rank {}: creating its {} group of {} failed: {}",
                                  env.rank, axis_name, M::name, e.what()));
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
  if (env.world_size > 1) Watchdog::instance().attach(store, env.rank, env.world_size, options.timeout);
  return mesh;
}

}  // namespace meshtorch::comm
