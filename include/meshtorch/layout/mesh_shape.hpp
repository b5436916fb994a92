#pragma once
// MeshShape<M>: the extents of a mesh type once the dynamic one is known, like std::extents holds
// the dynamic part of an mdspan's shape. Answers the same rank questions as the static Mesh, at
// run time (and still in constexpr).
#include <array>
#include <cstddef>
#include <string>
#include <vector>

#include <meshtorch/error.hpp>
#include <meshtorch/layout/mesh.hpp>
#include <meshtorch/layout/row_major.hpp>

namespace meshtorch {

template <MeshType M>
class MeshShape {
 public:
  using mesh_type = M;
  static constexpr std::size_t ndim = M::ndim;

  // A static mesh needs no world size.
  constexpr MeshShape()
    requires M::is_static
      : extents_(M::extents()) {}

  // The shape for `world_size` ranks: the dynamic extent becomes world_size / (product of the
  // static ones). Throws EnvError when the launch cannot fit the mesh.
  static constexpr MeshShape resolve(int world_size) {
    const int fixed = static_cast<int>(M::static_product);
    if (world_size < 1)
      throw EnvError("world size " + std::to_string(world_size) + " is not a rank count; launch " +
                     "at least one rank for " + std::string(M::name));
    if constexpr (M::is_static) {
      if (world_size != fixed)
        throw EnvError("world size " + std::to_string(world_size) + " does not match " +
                       std::string(M::name) + ", which has " + std::to_string(fixed) +
                       " ranks; launch " + std::to_string(fixed) +
                       " ranks, or make one axis meshtorch::dynamic");
    } else if (world_size % fixed != 0) {
      throw EnvError("world size " + std::to_string(world_size) + " is not a multiple of " +
                     std::to_string(fixed) + ", the product of the static extents of " +
                     std::string(M::name) + "; launch a multiple of " + std::to_string(fixed) +
                     " ranks");
    }
    std::array<int, ndim> extents{};
    for (std::size_t i = 0; i < ndim; ++i)
      extents[i] = M::static_extents[i] == dynamic ? world_size / fixed
                                                   : static_cast<int>(M::static_extents[i]);
    return MeshShape(extents);
  }

  constexpr const std::array<int, ndim>& extents() const { return extents_; }
  constexpr int extent(std::size_t axis_index) const { return extents_[axis_index]; }
  template <template <std::size_t> class Kind>
  constexpr int extent() const {
    return extents_[M::template index_of<Kind>];
  }
  constexpr int size() const { return detail::product(extents_); }

  constexpr std::array<int, ndim> coord_of(int rank) const {
    return detail::coord_of(extents_, rank);
  }
  constexpr int rank_of(const std::array<int, ndim>& coords) const {
    return detail::rank_of(extents_, coords);
  }
  template <template <std::size_t> class Kind>
  constexpr int coord(int rank) const {
    return coord_of(rank)[M::template index_of<Kind>];
  }

  // The ranks of the slice along axis `axis_index` through `rank`, ordered by their coordinate.
  constexpr std::vector<int> slice_ranks(std::size_t axis_index, int rank) const {
    std::vector<int> ranks(static_cast<std::size_t>(extents_[axis_index]));
    for (int p = 0; p < extents_[axis_index]; ++p)
      ranks[p] = detail::slice_member(extents_, axis_index, rank, p);
    return ranks;
  }
  template <template <std::size_t> class Kind>
  constexpr std::vector<int> slice_ranks(int rank) const {
    return slice_ranks(M::template index_of<Kind>, rank);
  }

  // Every slice along the axis, ordered by its lowest rank: the order in which every rank
  // creates the axis' process groups.
  constexpr std::vector<std::vector<int>> slices(std::size_t axis_index) const {
    std::vector<std::vector<int>> all;
    const int count = size() / extents_[axis_index];
    for (int n = 0; n < count; ++n)
      all.push_back(slice_ranks(axis_index, detail::slice_first_rank(extents_, axis_index, n)));
    return all;
  }
  template <template <std::size_t> class Kind>
  constexpr std::vector<std::vector<int>> slices() const {
    return slices(M::template index_of<Kind>);
  }

  // "Mesh<DP=2, TP=4>": the resolved extents, for logs.
  std::string to_string() const {
    std::string out = "Mesh<";
    for (std::size_t i = 0; i < ndim; ++i) {
      if (i) out += ", ";
      out += std::string(M::axis_names[i]) + "=" + std::to_string(extents_[i]);
    }
    return out + ">";
  }

  friend constexpr bool operator==(const MeshShape&, const MeshShape&) = default;

 private:
  constexpr explicit MeshShape(const std::array<int, ndim>& extents) : extents_(extents) {}
  std::array<int, ndim> extents_;
};

}  // namespace meshtorch
