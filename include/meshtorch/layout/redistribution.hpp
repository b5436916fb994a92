#pragma once
// Which collective turns one placement into another along a mesh axis, decided at compile time.
//
//   from \ to    Replicate       Shard<b>                  Partial
//   Replicate    none            local_chunk               (does not compile)
//   Shard<a>     all_gather      none (a == b)             (does not compile)
//                                all_to_all (a != b)
//   Partial      all_reduce      reduce_scatter            none
#include <concepts>
#include <string_view>
#include <type_traits>

#include <meshtorch/layout/placement.hpp>

namespace meshtorch {

enum class Collective { none, local_chunk, all_gather, all_reduce, reduce_scatter, all_to_all };

constexpr std::string_view to_string(Collective c) {
  switch (c) {
    case Collective::none:
      return "none";
    case Collective::local_chunk:
      return "local_chunk";
    case Collective::all_gather:
      return "all_gather";
    case Collective::all_reduce:
      return "all_reduce";
    case Collective::reduce_scatter:
      return "reduce_scatter";
    case Collective::all_to_all:
      return "all_to_all";
  }
  return "?";
}

namespace detail {

template <Placement From, Placement To>
consteval Collective choose_collective() {
  if constexpr (std::is_same_v<To, Partial>) {
    static_assert(!std::is_same_v<From, Replicate>,
                  "cannot redistribute Replicate to Partial: no collective turns a whole tensor "
                  "into addends of a sum; keep it Replicate, or zero it on all ranks but one "
                  "yourself");
    static_assert(!ShardPlacement<From>,
                  "cannot redistribute Shard<D> to Partial: no collective turns shards into "
                  "addends of a sum; redistribute to Replicate or to another Shard instead");
    return Collective::none;
  } else if constexpr (std::is_same_v<From, To>) {
    return Collective::none;
  } else if constexpr (std::is_same_v<From, Replicate>) {
    return Collective::local_chunk;
  } else if constexpr (std::is_same_v<From, Partial>) {
    return std::is_same_v<To, Replicate> ? Collective::all_reduce : Collective::reduce_scatter;
  } else if constexpr (std::is_same_v<To, Replicate>) {
    return Collective::all_gather;
  } else {
    // Shard<a> -> Shard<b> with a != b. A negative and a positive dim may name the same tensor
    // dim; redistribute() then finds at run time that nothing has to move.
    return Collective::all_to_all;
  }
}

}  // namespace detail

template <Placement From, Placement To>
inline constexpr Collective collective_for = detail::choose_collective<From, To>();

// An activation's move from one placement to another, and its gradient's move back: what a
// differentiable collective does. The gradient of a tensor placed P arrives placed GradOfTo
// and leaves placed GradOfFrom; e.g. Megatron's f (Replicate -> Replicate, feeding sharded
// weights) gets Partial gradients, which its backward all-reduces to Replicate.
template <Placement From, Placement To, Placement GradOfTo, Placement GradOfFrom>
struct Redistribution {
  using from = From;
  using to = To;
  using grad_of_to = GradOfTo;
  using grad_of_from = GradOfFrom;
  static constexpr Collective forward = collective_for<From, To>;
  static constexpr Collective backward = collective_for<GradOfTo, GradOfFrom>;
};

// The placement of the gradient of an activation placed P. A replicated activation that
// feeds sharded weights (the input of a column-parallel body) has partial-sum gradients;
// everywhere else a gradient is placed as its activation, and a partial sum's gradient is the
// whole (replicated) gradient.
template <Placement P, bool FeedsShardedWeights = false>
using gradient_placement = std::conditional_t<std::is_same_v<P, Replicate> && FeedsShardedWeights, Partial,
                                              std::conditional_t<std::is_same_v<P, Partial>, Replicate, P>>;

// The six differentiable collectives of Megatron-LM, as redistributions.
using CopyToParallelRegion = Redistribution<Replicate, Replicate, Partial, Replicate>;      // f
using ReduceFromParallelRegion = Redistribution<Partial, Replicate, Replicate, Replicate>;  // g
template <int Dim>
using ScatterToParallelRegion = Redistribution<Replicate, Shard<Dim>, Shard<Dim>, Replicate>;
template <int Dim>
using GatherFromParallelRegion = Redistribution<Shard<Dim>, Replicate, Replicate, Shard<Dim>>;
template <int Dim>
using GatherFromSequenceParallelRegion = Redistribution<Shard<Dim>, Replicate, Partial, Shard<Dim>>;
template <int Dim>
using ReduceScatterToSequenceParallelRegion = Redistribution<Partial, Shard<Dim>, Shard<Dim>, Replicate>;

template <class T>
concept RedistributionType = requires {
  typename T::from;
  typename T::to;
  { T::forward } -> std::convertible_to<Collective>;
  { T::backward } -> std::convertible_to<Collective>;
};

}  // namespace meshtorch
