#pragma once
// DeviceMesh<M>: a Mesh type brought to life on this rank, made by comm::init<M>()
// (comm/init.hpp, which start-up code includes: it brings in Gloo, the rendezvous and the
// watchdog, which code that only uses a mesh does not compile). init rendezvouses through a
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
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <meshtorch/comm/axis_group.hpp>
#include <meshtorch/comm/env.hpp>
#include <meshtorch/error.hpp>
#include <meshtorch/layout/mesh.hpp>
#include <meshtorch/layout/mesh_shape.hpp>
#include <meshtorch/separate_compilation.hpp>

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

namespace detail {
// The body of comm::init, defined by comm/init.hpp. Declared here so that init<M>() below can
// say which header to include when it is missing, instead of "init is not a member of comm".
template <class Deferred>
struct MeshStartUp;

// DeviceMesh's banner and errors, which need no mesh type: compiled once, not once per mesh.
MESHTORCH_DECL std::string describe_rank(int rank, int world_size, Device device,
                                         std::span<const std::string_view> axis_names, std::span<const int> coords,
                                         std::span<const int> extents);
[[noreturn]] MESHTORCH_DECL void throw_no_axes(unsigned axis_mask, std::string_view mesh_name);
[[noreturn]] MESHTORCH_DECL void throw_no_node_group(const LaunchEnv& env);
}  // namespace detail

template <MeshType M>
class DeviceMesh;

// comm::init<M>(options): the start of a distributed program (rendezvous, fingerprint check,
// the groups, the watchdog). Its body is in comm/init.hpp, which the file that starts the
// program includes; `Deferred` only delays the check until init is called.
template <MeshType M, class Deferred = void>
DeviceMesh<M> init(InitOptions options = {}) {
  constexpr bool start_up_included = requires { sizeof(detail::MeshStartUp<Deferred>); };
  static_assert(start_up_included,
                "comm::init: the start-up is not in <meshtorch/meshtorch.hpp>; include "
                "<meshtorch/comm/init.hpp> (or <meshtorch/parallel/launch.hpp>) in the file that starts the program");
  if constexpr (start_up_included)
    return detail::MeshStartUp<Deferred>::template start<M>(std::move(options));
  else
    throw ConfigError("comm::init: comm/init.hpp is not included");  // not compiled: the assertion stops first
}

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
    return detail::describe_rank(rank(), world_size(), device_, M::axis_names, coords(), shape_.extents());
  }

  template <template <std::size_t> class Kind>
  requires MeshWithAxis<M, Kind>
  int coord() const { return shape_.template coord<Kind>(rank()); }

  template <template <std::size_t> class Kind>
  requires MeshWithAxis<M, Kind>
  int size() const { return shape_.template extent<Kind>(); }

  // The group along one axis, or along several merged axes: group<DP, FSDP>() holds the ranks
  // that share this rank's other coordinates, ordered row-major over DP and FSDP.
  template <template <std::size_t> class... Kinds>
  const AxisGroup& group() const {
    return group(M::template mask_of<Kinds...>);
  }
  const AxisGroup& group(unsigned axis_mask) const {
    if (axis_mask == 0 || axis_mask > MeshShape<M>::all_axes) detail::throw_no_axes(axis_mask, M::name);
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
    if (!node_) detail::throw_no_node_group(env_);
    return *node_;
  }

  // Only comm::init (comm/init.hpp) makes one.
  template <class Deferred>
  friend struct detail::MeshStartUp;

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

}  // namespace meshtorch::comm

#if MESHTORCH_DEFINES(core)
#include <fmt/format.h>

namespace meshtorch::comm::detail {

MESHTORCH_DECL std::string describe_rank(int rank, int world_size, Device device,
                                         std::span<const std::string_view> axis_names, std::span<const int> coords,
                                         std::span<const int> extents) {
  std::string out = fmt::format("rank {} of {} on {}:", rank, world_size, to_string(device));
  for (std::size_t i = 0; i < axis_names.size(); ++i)
    out += fmt::format("{}{} {} of {}", i ? ", " : " ", axis_names[i], coords[i], extents[i]);
  return out;
}

MESHTORCH_DECL void throw_no_axes(unsigned axis_mask, std::string_view mesh_name) {
  throw ConfigError(fmt::format("DeviceMesh::group: axis mask {} names no axes of {}", axis_mask, mesh_name));
}

MESHTORCH_DECL void throw_no_node_group(const LaunchEnv& env) {
  throw ConfigError(
      fmt::format("rank {}: no node group: LOCAL_WORLD_SIZE {} does not divide the world size {} "
                  "into nodes of consecutive ranks (rank {} is local rank {}); start the same "
                  "number of ranks on every node",
                  env.rank, env.local_world_size, env.world_size, env.rank, env.local_rank));
}

}  // namespace meshtorch::comm::detail
#endif  // MESHTORCH_DEFINES(core)
