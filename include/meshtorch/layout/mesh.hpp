#pragma once
// Mesh<Axes...>: a device mesh as a type. Ranks are laid out row-major, the last axis fastest, as
// torch's init_device_mesh does, so Mesh<DP<2>, TP<4>> puts ranks 0-3 in one TP group.
// Like std::extents, the type holds the static extents and any number of axes may be
// meshtorch::dynamic; MeshShape (mesh_shape.hpp) holds the resolved extents and is the one
// implementation of the rank maps (constexpr, so a static mesh's maps are compile-time values).
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
  ((found = (found == sizeof...(Axes) && is_kind_if_axis<Axes, Kind>()) ? index : found, ++index), ...);
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
struct Mesh : detail::MeshStaticSize<detail::dynamic_count<Axes...>() == 0, detail::static_product<Axes...>()> {
  static_assert((Axis<Axes> && ...),
                "Mesh takes only axis tags, and an argument is not one; "
                "use DP<N>, FSDP<N>, PP<N>, CP<N> or TP<N> (N a number or meshtorch::dynamic)");
  static_assert(sizeof...(Axes) > 0, "Mesh has no axes; give it at least one, e.g. Mesh<DP<meshtorch::dynamic>>");
  static_assert(detail::kinds_unique<Axes...>(),
                "Mesh repeats an axis kind (e.g. Mesh<DP<2>, DP<4>>); use each kind once, "
                "with the product of the extents (DP<8>)");

  static constexpr std::size_t ndim = sizeof...(Axes);
  // meshtorch::dynamic where the extent comes from the world size at init.
  static constexpr std::array<std::size_t, ndim> static_extents{detail::extent_or_one<Axes>()...};
  static constexpr bool is_static = detail::dynamic_count<Axes...>() == 0;
  static constexpr bool has_dynamic = !is_static;
  static constexpr std::size_t dynamic_count = detail::dynamic_count<Axes...>();
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

  // The extents when all are static (MeshShape<Mesh>{} answers the rank questions).
  static constexpr std::array<int, ndim> extents() requires is_static {
    std::array<int, ndim> e{};
    for (std::size_t i = 0; i < ndim; ++i) e[i] = static_cast<int>(static_extents[i]);
    return e;
  }

  // The set of axes Kinds... as a bit mask over axis indices: what a merged group
  // (mesh.group<DP, FSDP>()) spans.
  template <template <std::size_t> class... Kinds>
  static constexpr unsigned mask_of = [] {
    static_assert(sizeof...(Kinds) > 0, "name at least one axis kind to merge, e.g. group<DP, FSDP>()");
    static_assert((has<Kinds> && ...),
                  "merges an axis the mesh does not have; merge only axes of the Mesh type, or test "
                  "Mesh::has<Kind> first");
    static_assert(detail::kinds_unique<Kinds<1>...>(),
                  "names an axis kind twice in one merged group; name each axis once, e.g. group<DP, FSDP>()");
    return ((1u << detail::index_of_kind<Kinds, Axes...>()) | ...);
  }();

  // The axes among Kinds... that the mesh has, as a mask (0 for none): the group a wrapper spans
  // whichever of them a layout uses, mesh.group(Mesh::mask_of_present<DP, CP>).
  template <template <std::size_t> class... Kinds>
  static constexpr unsigned mask_of_present = ((has<Kinds> ? 1u << detail::index_of_kind<Kinds, Axes...>() : 0u) | ... |
                                               0u);
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
