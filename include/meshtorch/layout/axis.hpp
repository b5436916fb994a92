#pragma once
// Mesh axis tags. An axis is a kind (what the ranks along it do) and an extent (how many ranks
// there are along it, or meshtorch::dynamic). The kind is the class template itself, so code asks
// for an axis by kind without its extent: Mesh::has<TP>, mesh.size<TP>(), axis<TP>.
//
// Adding a kind is one more tag below: derive from AxisExtent<N> and give it a name.
#include <concepts>
#include <cstddef>
#include <string_view>
#include <type_traits>

#include <meshtorch/layout/extent.hpp>

namespace meshtorch {

template <std::size_t N>
struct AxisExtent {
  static_assert(N != 0,
                "mesh axis has extent 0; give every axis an extent of at least 1, "
                "or meshtorch::dynamic to take it from the world size");
  static constexpr std::size_t extent = N;
  static constexpr bool is_dynamic = N == dynamic;
};

// Data parallel: parameters replicated, gradients all-reduced (DDP).
template <std::size_t N>
struct DP : AxisExtent<N> {
  static constexpr std::string_view name = "DP";
};

// Fully sharded data parallel: parameters, gradients and optimizer state sharded (FSDP, ZeRO-3).
template <std::size_t N>
struct FSDP : AxisExtent<N> {
  static constexpr std::string_view name = "FSDP";
};

// Tensor (and sequence) parallel: weights split inside each layer (Megatron-style).
template <std::size_t N>
struct TP : AxisExtent<N> {
  static constexpr std::string_view name = "TP";
};

// Pipeline parallel: the model's layers split into stages, one or more per rank; micro-batches flow
// through them in the order of a schedule (layout/pipeline_schedule.hpp). Put it outside TP, as in
// Mesh<DP, FSDP, PP, TP>: the outer an axis, the farther apart its ranks, and a stage sends only
// one activation per micro-batch while TP reduces inside every layer.
template <std::size_t N>
struct PP : AxisExtent<N> {
  static constexpr std::string_view name = "PP";
};

// Context parallel: every layer's sequence split over the ranks, each holding two chunks in the
// head-tail order (layout/context_split.hpp) and meeting the others' keys and values in attention.
// The CP ranks of a replica hold different tokens of the same batch, so their gradients are summed
// like data-parallel ones (FSDP shards over FSDP x CP). Put it inside PP and outside TP, as
// torchtitan does: Mesh<DP, FSDP, PP, CP, TP>.
template <std::size_t N>
struct CP : AxisExtent<N> {
  static constexpr std::string_view name = "CP";
};

namespace detail {

template <class T>
struct AxisTraits : std::false_type {};

template <template <std::size_t> class Kind, std::size_t N>
requires std::is_base_of_v<AxisExtent<N>, Kind<N>>
struct AxisTraits<Kind<N>> : std::true_type {
  template <std::size_t M>
  using with_extent = Kind<M>;

  template <template <std::size_t> class OtherKind>
  static constexpr bool is_kind = std::is_same_v<Kind<1>, OtherKind<1>>;
};

}  // namespace detail

// An axis tag: an instance of a kind template deriving from AxisExtent.
template <class T>
concept Axis = detail::AxisTraits<T>::value;

// An axis kind: DP, FSDP, TP (the template, not an instance).
template <template <std::size_t> class Kind>
concept AxisKind = Axis<Kind<1>>;

template <Axis A, template <std::size_t> class Kind>
inline constexpr bool is_axis_of_kind = detail::AxisTraits<A>::template is_kind<Kind>;

// DP<2> and DP<dynamic> have the same kind; DP<2> and TP<2> do not.
template <Axis A, Axis B>
inline constexpr bool same_axis_kind = std::is_same_v<typename detail::AxisTraits<A>::template with_extent<1>,
                                                      typename detail::AxisTraits<B>::template with_extent<1>>;

// A value naming an axis kind, for functions that take the axis as an argument:
// redistribute<Shard<0>, Replicate>(t, mesh, axis<TP>).
template <template <std::size_t> class Kind>
requires AxisKind<Kind>
struct AxisKey {
  static constexpr std::string_view name = Kind<1>::name;
};

template <template <std::size_t> class Kind>
requires AxisKind<Kind>
inline constexpr AxisKey<Kind> axis{};

}  // namespace meshtorch
