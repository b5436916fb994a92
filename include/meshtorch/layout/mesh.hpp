#pragma once
// Mesh<Axes...>: a device mesh as a type. Ranks are laid out row-major, the last axis fastest, as
// torch's init_device_mesh does, so Mesh<DP<2>, TP<4>> puts ranks 0-3 in one TP group.
// Everything here is constexpr; the run-time counterpart with resolved dynamic extents is
// MeshShape (mesh_shape.hpp).
#include <array>
#include <cstddef>
#include <string_view>
#include <tuple>
#include <type_traits>

#include <meshtorch/layout/axis.hpp>
#include <meshtorch/layout/extent.hpp>
#include <meshtorch/layout/fixed_string.hpp>
#include <meshtorch/layout/row_major.hpp>

namespace meshtorch {

namespace detail {

// These helpers accept non-axis types too, so that a bad Mesh argument reports only the
// static_assert that names it, not a cascade of errors from the members below.
template <class T>
consteval std::size_t extent_or_one() {
  if constexpr (Axis<T>)
    return T::extent;
  else
    return 1;
}

template <class A, class B>
consteval bool same_kind_if_axes() {
  if constexpr (Axis<A> && Axis<B>)
    return same_axis_kind<A, B>;
  else
    return false;
}

template <class T, template <std::size_t> class Kind>
consteval bool is_kind_if_axis() {
  if constexpr (Axis<T>)
    return is_axis_of_kind<T, Kind>;
  else
    return false;
}

template <class... Axes>
consteval bool kinds_unique();

template <class First, class... Rest>
consteval bool first_kind_unique() {
  return (!same_kind_if_axes<First, Rest>() && ...) && kinds_unique<Rest...>();
}

template <class... Axes>
consteval bool kinds_unique() {
  if constexpr (sizeof...(Axes) <= 1)
    return true;
  else
    return first_kind_unique<Axes...>();
}

template <class T>
consteval std::string_view name_or_placeholder() {
  if constexpr (Axis<T>)
    return T::name;
  else
    return "?";
}

template <class... Axes>
consteval std::size_t dynamic_count() {
  return ((extent_or_one<Axes>() == dynamic ? 1u : 0u) + ... + 0u);
}

template <class... Axes>
consteval std::size_t static_product() {
  return ((extent_or_one<Axes>() == dynamic ? std::size_t{1} : extent_or_one<Axes>()) * ... * 1u);
}

template <template <std::size_t> class Kind, class... Axes>
consteval std::size_t index_of_kind() {
  std::size_t index = 0, found = sizeof...(Axes);
  ((found = (found == sizeof...(Axes) && is_kind_if_axis<Axes, Kind>()) ? index : found, ++index),
   ...);
  return found;
}

template <class T>
constexpr void append_axis_name(auto& out) {
  if constexpr (Axis<T>) {
    out.append(T::name).append("<");
    if constexpr (T::is_dynamic)
      out.append("dynamic");
    else
      out.append_number(static_cast<long long>(T::extent));
    out.append(">");
  } else {
    out.append("?");
  }
}

// Mesh::size exists only when every extent is static, like std::extents' static_extent.
template <bool IsStatic, std::size_t Product>
struct MeshStaticSize {};

template <std::size_t Product>
struct MeshStaticSize<true, Product> {
  static constexpr std::size_t size = Product;
};

}  // namespace detail

template <class... Axes>
struct Mesh : detail::MeshStaticSize<detail::dynamic_count<Axes...>() == 0,
                                     detail::static_product<Axes...>()> {
  static_assert((Axis<Axes> && ...),
                "Mesh takes only axis tags, and an argument is not one; "
                "use DP<N>, FSDP<N> or TP<N> (N a number or meshtorch::dynamic)");
  static_assert(sizeof...(Axes) > 0,
                "Mesh has no axes; give it at least one, e.g. Mesh<DP<meshtorch::dynamic>>");
  static_assert(detail::kinds_unique<Axes...>(),
                "Mesh repeats an axis kind (e.g. Mesh<DP<2>, DP<4>>); use each kind once, "
                "with the product of the extents (DP<8>)");
  static_assert(detail::dynamic_count<Axes...>() <= 1,
                "Mesh has more than one meshtorch::dynamic extent, so the world size cannot "
                "resolve them; make all axes but one static");

  static constexpr std::size_t ndim = sizeof...(Axes);
  // meshtorch::dynamic where the extent comes from the world size at init.
  static constexpr std::array<std::size_t, ndim> static_extents{detail::extent_or_one<Axes>()...};
  static constexpr bool is_static = detail::dynamic_count<Axes...>() == 0;
  static constexpr bool has_dynamic = !is_static;
  // Index of the dynamic axis, or ndim when there is none.
  static constexpr std::size_t dynamic_index = [] {
    for (std::size_t i = 0; i < ndim; ++i)
      if (static_extents[i] == dynamic) return i;
    return ndim;
  }();
  // Product of the static extents: the world size must be a multiple of it.
  static constexpr std::size_t static_product = detail::static_product<Axes...>();
  static constexpr std::array<std::string_view, ndim> axis_names{detail::name_or_placeholder<Axes>()...};

  template <template <std::size_t> class Kind>
  static constexpr bool has = (detail::is_kind_if_axis<Axes, Kind>() || ...);

  template <template <std::size_t> class Kind>
  static constexpr std::size_t index_of = [] {
    static_assert(has<Kind>,
                  "the mesh has no axis of the kind asked for; add that axis to the Mesh, "
                  "or test Mesh::has<Kind> first");
    return detail::index_of_kind<Kind, Axes...>();
  }();

  template <template <std::size_t> class Kind>
  using axis_type = std::tuple_element_t<index_of<Kind>, std::tuple<Axes...>>;

  // meshtorch::dynamic for the dynamic axis.
  template <template <std::size_t> class Kind>
  static constexpr std::size_t static_extent = static_extents[index_of<Kind>];

 private:
  static constexpr auto name_storage = [] {
    FixedString<40 + 24 * sizeof...(Axes)> out;
    out.append("Mesh<");
    std::size_t i = 0;
    ((out.append(i++ == 0 ? "" : ", "), detail::append_axis_name<Axes>(out)), ...);
    out.append(">");
    return out;
  }();

 public:
  // "Mesh<DP<2>, TP<dynamic>>": used in error messages and in the fingerprint ranks compare.
  static constexpr std::string_view name = name_storage.view();

  // The rank maps below need every extent; for a mesh with a dynamic axis use MeshShape.
  static constexpr std::array<int, ndim> extents()
    requires is_static
  {
    std::array<int, ndim> e{};
    for (std::size_t i = 0; i < ndim; ++i) e[i] = static_cast<int>(static_extents[i]);
    return e;
  }

  static constexpr std::array<int, ndim> coord_of(int rank)
    requires is_static
  {
    return detail::coord_of(extents(), rank);
  }

  static constexpr int rank_of(const std::array<int, ndim>& coords)
    requires is_static
  {
    return detail::rank_of(extents(), coords);
  }

  template <template <std::size_t> class Kind>
  static constexpr int coord(int rank)
    requires is_static
  {
    return coord_of(rank)[index_of<Kind>];
  }

  // The ranks of the slice along Kind through `rank`, ordered by their coordinate on Kind.
  template <template <std::size_t> class Kind>
  static constexpr std::array<int, static_extent<Kind>> slice_ranks(int rank)
    requires is_static
  {
    std::array<int, static_extent<Kind>> ranks{};
    for (int p = 0; p < static_cast<int>(ranks.size()); ++p)
      ranks[p] = detail::slice_member(extents(), index_of<Kind>, rank, p);
    return ranks;
  }

  // Every slice along Kind, ordered by its lowest rank.
  template <template <std::size_t> class Kind>
  static constexpr auto slices()
    requires is_static
  {
    constexpr std::size_t count = Mesh::size / static_extent<Kind>;
    std::array<std::array<int, static_extent<Kind>>, count> all{};
    for (int n = 0; n < static_cast<int>(count); ++n)
      all[n] = slice_ranks<Kind>(detail::slice_first_rank(extents(), index_of<Kind>, n));
    return all;
  }
};

namespace detail {
template <class T>
struct IsMesh : std::false_type {};
template <class... Axes>
struct IsMesh<Mesh<Axes...>> : std::true_type {};
}  // namespace detail

template <class T>
concept MeshType = detail::IsMesh<std::remove_cv_t<T>>::value;

// A mesh type that has an axis of the given kind: constrains functions like size<TP>(mesh).
template <class M, template <std::size_t> class Kind>
concept MeshWithAxis = MeshType<M> && M::template has<Kind>;

}  // namespace meshtorch
