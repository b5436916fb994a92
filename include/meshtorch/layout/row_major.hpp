#pragma once
// Row-major rank <-> coordinate arithmetic shared by the static Mesh type and the run-time
// MeshShape: the last axis varies fastest, as in torch's init_device_mesh, so the innermost
// axis (TP) groups neighbouring ranks, which a launcher places on the same node.
#include <array>
#include <cstddef>

namespace meshtorch::detail {

template <std::size_t Ndim>
constexpr int product(const std::array<int, Ndim>& extents) {
  int total = 1;
  for (int e : extents) total *= e;
  return total;
}

// Distance in ranks between neighbours along axis i: the product of the extents after it.
template <std::size_t Ndim>
constexpr int stride(const std::array<int, Ndim>& extents, std::size_t i) {
  int s = 1;
  for (std::size_t j = i + 1; j < Ndim; ++j) s *= extents[j];
  return s;
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

// The rank at position `position` of the slice along axis i that contains `rank`.
template <std::size_t Ndim>
constexpr int slice_member(const std::array<int, Ndim>& extents, std::size_t i, int rank,
                           int position) {
  const int s = stride(extents, i);
  const int coord = (rank / s) % extents[i];
  return rank + (position - coord) * s;
}

// The n-th slice along axis i, counting slices by their first (lowest) rank. Every rank walks
// the slices in this order when it creates process groups, so group creation never deadlocks.
template <std::size_t Ndim>
constexpr int slice_first_rank(const std::array<int, Ndim>& extents, std::size_t i, int n) {
  const int s = stride(extents, i);
  // Ranks with coordinate 0 on axis i: blocks of s consecutive ranks, every s * extent ranks.
  return (n / s) * s * extents[i] + n % s;
}

}  // namespace meshtorch::detail
