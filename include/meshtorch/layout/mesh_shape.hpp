#pragma once
// MeshShape<M>: the extents of a mesh type once its dynamic ones are known, and the one
// implementation of the rank maps (rank <-> coordinates, the slices along an axis or a set of
// merged axes). As std::extents does, it stores only the dynamic extents: a static extent is read
// from the type, so MeshShape<Mesh<DP<2>, TP<4>>> is empty and answers everything at compile time.
#include <array>
#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include <meshtorch/error.hpp>
#include <meshtorch/layout/mesh.hpp>
#include <meshtorch/layout/row_major.hpp>

namespace meshtorch {

// In the extents given for a mesh's dynamic axes: "the ranks the world has left for this axis".
inline constexpr int from_world_size = 0;

template <MeshType M>
class MeshShape {
 public:
  using mesh_type = M;
  static constexpr std::size_t ndim = M::ndim;
  static constexpr unsigned all_axes = (1u << ndim) - 1;

  // A static mesh needs no world size.
  constexpr MeshShape() requires M::is_static = default;

  // The shape for `world_size` ranks. `given` holds the extents of the dynamic axes in axis
  // order, like std::extents' constructor arguments; a missing trailing value, or
  // from_world_size, is taken from the world size, which may be done for one axis only. Throws
  // EnvError when the launch cannot fit the mesh.
  static constexpr MeshShape resolve(int world_size, std::span<const int> given = {}) {
    if (world_size < 1)
      throw EnvError("world size " + std::to_string(world_size) + " is not a rank count; launch " +
                     "at least one rank for " + std::string(M::name));
    if (given.size() > M::dynamic_count)
      throw EnvError(std::to_string(given.size()) + " extents given for the " + std::to_string(M::dynamic_count) +
                     " dynamic axes of " + std::string(M::name) + "; give one per meshtorch::dynamic axis");
    std::array<int, ndim> extents{};
    int fixed = 1;
    std::size_t from_world = ndim, next_given = 0;
    for (std::size_t i = 0; i < ndim; ++i) {
      if (M::static_extents[i] != dynamic) {
        extents[i] = static_cast<int>(M::static_extents[i]);
      } else {
        const int value = next_given < given.size() ? given[next_given] : from_world_size;
        ++next_given;
        if (value < 0)
          throw EnvError("extent " + std::to_string(value) + " given for axis " + std::string(M::axis_names[i]) +
                         " of " + std::string(M::name) + "; give a positive extent, or from_world_size");
        if (value == from_world_size) {
          if (from_world != ndim)
            throw EnvError(std::string(M::name) + ": axes " + std::string(M::axis_names[from_world]) + " and " +
                           std::string(M::axis_names[i]) +
                           " both take their extent from the world size; give all dynamic extents but one");
          from_world = i;
          continue;
        }
        extents[i] = value;
      }
      fixed *= extents[i];
    }
    if (from_world == ndim) {
      if (world_size != fixed)
        throw EnvError("world size " + std::to_string(world_size) + " does not match " +
                       (M::is_static ? std::string(M::name) : describe(extents)) + ", which has " +
                       std::to_string(fixed) + " ranks; launch " + std::to_string(fixed) + " ranks" +
                       (M::is_static ? ", or make one axis meshtorch::dynamic" : ""));
    } else {
      if (world_size % fixed != 0)
        throw EnvError("world size " + std::to_string(world_size) + " is not a multiple of " + std::to_string(fixed) +
                       ", the product of the other extents of " + std::string(M::name) + "; launch a multiple of " +
                       std::to_string(fixed) + " ranks");
      extents[from_world] = world_size / fixed;
    }
    return MeshShape(extents);
  }

  constexpr std::array<int, ndim> extents() const {
    std::array<int, ndim> all{};
    for (std::size_t i = 0; i < ndim; ++i) all[i] = extent(i);
    return all;
  }
  constexpr int extent(std::size_t axis_index) const {
    return M::static_extents[axis_index] != dynamic ? static_cast<int>(M::static_extents[axis_index])
                                                    : dynamic_extents_[dynamic_index[axis_index]];
  }
  template <template <std::size_t> class Kind>
  constexpr int extent() const {
    if constexpr (M::template static_extent<Kind> != dynamic)
      return static_cast<int>(M::template static_extent<Kind>);
    else
      return dynamic_extents_[dynamic_index[M::template index_of<Kind>]];
  }
  constexpr int size() const { return detail::product(extents()); }
  // The number of ranks of a slice over the axes in `mask`.
  constexpr int size(unsigned mask) const {
    int n = 1;
    for (std::size_t i = 0; i < ndim; ++i)
      if (mask & (1u << i)) n *= extent(i);
    return n;
  }

  constexpr std::array<int, ndim> coord_of(int rank) const { return detail::coord_of(extents(), rank); }
  constexpr int rank_of(const std::array<int, ndim>& coords) const { return detail::rank_of(extents(), coords); }
  template <template <std::size_t> class Kind>
  constexpr int coord(int rank) const {
    return coord_of(rank)[M::template index_of<Kind>];
  }

  // The ranks that share `rank`'s coordinates on every axis outside `mask`, in row-major order of
  // their coordinates on the axes in `mask`: the members of a (merged) axis group, ordered by
  // their position in it.
  constexpr std::vector<int> slice_ranks(unsigned mask, int rank) const {
    const auto mine = coord_of(rank);
    std::vector<int> ranks;
    for (int other = 0; other < size(); ++other) {
      const auto theirs = coord_of(other);
      bool same = true;
      for (std::size_t i = 0; i < ndim; ++i)
        if (!(mask & (1u << i)) && theirs[i] != mine[i]) same = false;
      if (same) ranks.push_back(other);
    }
    return ranks;
  }
  template <template <std::size_t> class... Kinds>
  constexpr std::vector<int> slice_ranks(int rank) const {
    return slice_ranks(M::template mask_of<Kinds...>, rank);
  }
  constexpr std::vector<int> axis_slice_ranks(std::size_t axis_index, int rank) const {
    return slice_ranks(1u << axis_index, rank);
  }

  // Every slice over the axes in `mask`, ordered by its lowest rank: the order in which every
  // rank creates the groups, so group creation cannot deadlock.
  constexpr std::vector<std::vector<int>> slices(unsigned mask) const {
    std::vector<std::vector<int>> all;
    for (int rank = 0; rank < size(); ++rank) {
      auto ranks = slice_ranks(mask, rank);
      if (ranks.front() == rank) all.push_back(std::move(ranks));
    }
    return all;
  }
  template <template <std::size_t> class... Kinds>
  constexpr std::vector<std::vector<int>> slices() const {
    return slices(M::template mask_of<Kinds...>);
  }

  // "DP+FSDP": how logs and errors name a merged group.
  static std::string mask_name(unsigned mask) {
    std::string out;
    for (std::size_t i = 0; i < ndim; ++i)
      if (mask & (1u << i)) out += (out.empty() ? "" : "+") + std::string(M::axis_names[i]);
    return mask == all_axes && ndim > 1 ? "world" : out;
  }

  // "Mesh<DP=2, TP=4>": the resolved extents, for logs.
  std::string to_string() const { return describe(extents()); }

  friend constexpr bool operator==(const MeshShape&, const MeshShape&) = default;

 private:
  constexpr explicit MeshShape(const std::array<int, ndim>& extents) {
    for (std::size_t i = 0; i < ndim; ++i)
      if (M::static_extents[i] == dynamic) dynamic_extents_[dynamic_index[i]] = extents[i];
  }

  // Axis index -> its place among the dynamic extents (unused for a static axis).
  static constexpr std::array<std::size_t, ndim> dynamic_index = [] {
    std::array<std::size_t, ndim> index{};
    for (std::size_t i = 0, next = 0; i < ndim; ++i)
      if (M::static_extents[i] == dynamic) index[i] = next++;
    return index;
  }();

  static std::string describe(const std::array<int, ndim>& extents) {
    std::string out = "Mesh<";
    for (std::size_t i = 0; i < ndim; ++i) {
      if (i) out += ", ";
      out += std::string(M::axis_names[i]) + "=" + std::to_string(extents[i]);
    }
    return out + ">";
  }

  // What std::extents stores: the dynamic extents only, in axis order. [[no_unique_address]]
  // makes a static mesh's shape take no room.
  [[no_unique_address]] std::array<int, M::dynamic_count> dynamic_extents_{};
};

}  // namespace meshtorch
