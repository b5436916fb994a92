#pragma once
// Row-major rank <-> coordinate arithmetic of MeshShape: the last axis varies fastest, as in
// torch's init_device_mesh, so the innermost axis (TP) groups neighbouring ranks, which a
// launcher places on the same node.
#include <array>
#include <cstddef>

namespace meshtorch::detail {

template <std::size_t Ndim>
constexpr int product(const std::array<int, Ndim>& extents) {
  int total = 1;
  for (int e : extents) total *= e;
  return total;
}

template <std::size_t Ndim>
constexpr std::array<int, Ndim> coord_of(const std::array<int, Ndim>& extents, int rank) {
  std::array<int, Ndim> coords{};
  for (std::size_t i = Ndim; i-- > 0;) {
    coords[i] = rank % extents[i];
    rank /= extents[i];
  }
  return coords;
}

template <std::size_t Ndim>
constexpr int rank_of(const std::array<int, Ndim>& extents, const std::array<int, Ndim>& coords) {
  int rank = 0;
  for (std::size_t i = 0; i < Ndim; ++i) rank = rank * extents[i] + coords[i];
  return rank;
}

}  // namespace meshtorch::detail
