#pragma once
// fmt formatters for layout types, so logs and errors print meshes and placements plainly:
// fmt::format("{}", Mesh<DP<2>, TP<4>>{}) is "Mesh<DP<2>, TP<4>>", a MeshShape prints its resolved
// extents. Compiles to nothing where fmt is absent: the layout core does not need fmt.
#if __has_include(<fmt/format.h>)
#include <fmt/format.h>

#include <meshtorch/layout/mesh.hpp>
#include <meshtorch/layout/mesh_shape.hpp>
#include <meshtorch/layout/placement.hpp>
#include <meshtorch/layout/redistribution.hpp>

template <class... Axes>
struct fmt::formatter<meshtorch::Mesh<Axes...>> : fmt::formatter<std::string_view> {
  auto format(const meshtorch::Mesh<Axes...>&, fmt::format_context& ctx) const {
    return fmt::formatter<std::string_view>::format(meshtorch::Mesh<Axes...>::name, ctx);
  }
};

template <class M>
struct fmt::formatter<meshtorch::MeshShape<M>> : fmt::formatter<std::string_view> {
  auto format(const meshtorch::MeshShape<M>& shape, fmt::format_context& ctx) const {
    return fmt::formatter<std::string_view>::format(shape.to_string(), ctx);
  }
};

template <meshtorch::Placement P>
struct fmt::formatter<P> : fmt::formatter<std::string_view> {
  auto format(const P&, fmt::format_context& ctx) const {
    return fmt::formatter<std::string_view>::format(P::name, ctx);
  }
};

template <>
struct fmt::formatter<meshtorch::Collective> : fmt::formatter<std::string_view> {
  auto format(meshtorch::Collective c, fmt::format_context& ctx) const {
    return fmt::formatter<std::string_view>::format(meshtorch::to_string(c), ctx);
  }
};
#endif
