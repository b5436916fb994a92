#pragma once
// redistribute<From, To>(tensor, mesh, axis<TP>): runs the collective that collective_for<From, To>
// picks at compile time, so an impossible pair (Shard -> Partial) does not compile.
// Shards are equal pieces: the sharded dim must divide by the axis size.
#include <cstdint>

#include <fmt/format.h>
#include <torch/torch.h>

#include <meshtorch/comm/axis_group.hpp>
#include <meshtorch/comm/collectives.hpp>
#include <meshtorch/layout/axis.hpp>
#include <meshtorch/layout/placement.hpp>
#include <meshtorch/layout/redistribution.hpp>

namespace meshtorch::comm {

namespace detail {

inline int64_t shard_dim(const AxisGroup& group, const torch::Tensor& tensor, int dim,
                         std::string_view placement) {
  const int d = normalize_dim(dim, static_cast<int>(tensor.dim()));
  if (d < 0)
    throw collective_error("redistribute", group,
                           fmt::format("{} names dim {} of a tensor with {} dims", placement, dim, tensor.dim()));
  return d;
}

}  // namespace detail

// The local piece of a replicated tensor along dim: no communication.
inline torch::Tensor local_chunk(const AxisGroup& group, const torch::Tensor& tensor, int64_t dim) {
  detail::check_divisible("local_chunk", group, tensor, dim);
  return tensor.chunk(group.size(), dim)[group.rank()].contiguous();
}

template <Placement From, Placement To>
torch::Tensor redistribute(const torch::Tensor& tensor, const AxisGroup& group) {
  constexpr Collective collective = collective_for<From, To>;
  if constexpr (collective == Collective::none) {
    return tensor;
  } else if constexpr (collective == Collective::local_chunk) {
    return local_chunk(group, tensor, detail::shard_dim(group, tensor, To::dim, To::name));
  } else if constexpr (collective == Collective::all_gather) {
    return all_gather(group, tensor, detail::shard_dim(group, tensor, From::dim, From::name));
  } else if constexpr (collective == Collective::all_reduce) {
    return all_reduce(group, tensor.clone());
  } else if constexpr (collective == Collective::reduce_scatter) {
    return reduce_scatter(group, tensor, detail::shard_dim(group, tensor, To::dim, To::name));
  } else {
    const int64_t from = detail::shard_dim(group, tensor, From::dim, From::name);
    const int64_t to = detail::shard_dim(group, tensor, To::dim, To::name);
    // Shard<-1> and Shard<1> of a 2-d tensor are the same placement.
    if (from == to) return tensor;
    return all_to_all(group, tensor, to, from);
  }
}

template <Placement From, Placement To, class M, template <std::size_t> class Kind>
  requires HasAxisGroup<M, Kind>
torch::Tensor redistribute(const torch::Tensor& tensor, const M& mesh, AxisKey<Kind>) {
  return redistribute<From, To>(tensor, mesh.template group<Kind>());
}

}  // namespace meshtorch::comm
