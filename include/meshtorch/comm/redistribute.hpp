#pragma once
// redistribute<From, To>(tensor, mesh, axis<TP>): runs the collective that collective_for<From, To>
// picks at compile time, so an impossible pair (Shard -> Partial) does not compile.
// Shards are equal pieces: the sharded dim must divide by the axis size.
#include <cstdint>
#include <string_view>

#include <meshtorch/torch.hpp>

#include <meshtorch/comm/axis_group.hpp>
#include <meshtorch/comm/collectives.hpp>
#include <meshtorch/layout/axis.hpp>
#include <meshtorch/layout/placement.hpp>
#include <meshtorch/layout/redistribution.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::comm {

namespace detail {

MESHTORCH_DECL int64_t shard_dim(const AxisGroup& group, const torch::Tensor& tensor, int dim,
                                 std::string_view placement);

}  // namespace detail

// The local piece of a replicated tensor along dim: no communication.
MESHTORCH_DECL torch::Tensor local_chunk(const AxisGroup& group, const torch::Tensor& tensor, int64_t dim);

// The collective collective_for<From, To> picked at compile time, as a value the run time
// performs. One run-time path for every pair keeps one copy of the code (and one autograd node
// type in differentiable.hpp) in a program, however many placements its plans name.
struct RedistributeStep {
  Collective collective = Collective::none;
  int from_dim = 0;  // the shard dims of From and To, where they are Shard placements
  int to_dim = 0;
  std::string_view from_name, to_name;  // for error messages
};

namespace detail {
template <Placement P>
inline constexpr int placement_dim = 0;
template <int Dim>
inline constexpr int placement_dim<Shard<Dim>> = Dim;
}  // namespace detail

template <Placement From, Placement To>
inline constexpr RedistributeStep redistribute_step{collective_for<From, To>, detail::placement_dim<From>,
                                                    detail::placement_dim<To>, From::name, To::name};

// Runs `step` on the tensor: the run-time path of every redistribute<From, To>.
MESHTORCH_DECL torch::Tensor redistribute(const torch::Tensor& tensor, const AxisGroup& group,
                                          const RedistributeStep& step);

template <Placement From, Placement To>
torch::Tensor redistribute(const torch::Tensor& tensor, const AxisGroup& group) {
  return redistribute(tensor, group, redistribute_step<From, To>);
}

template <Placement From, Placement To, class M, template <std::size_t> class Kind>
requires HasAxisGroup<M, Kind> torch::Tensor redistribute(const torch::Tensor& tensor, const M& mesh, AxisKey<Kind>) {
  return redistribute<From, To>(tensor, mesh.template group<Kind>());
}

}  // namespace meshtorch::comm

#if MESHTORCH_DEFINES(core)
#include <fmt/format.h>

namespace meshtorch::comm {

namespace detail {

MESHTORCH_DECL int64_t shard_dim(const AxisGroup& group, const torch::Tensor& tensor, int dim,
                                 std::string_view placement) {
  const int d = normalize_dim(dim, static_cast<int>(tensor.dim()));
  if (d < 0)
    throw collective_error("redistribute", group,
                           fmt::format("{} names dim {} of a tensor with {} dims", placement, dim, tensor.dim()));
  return d;
}

}  // namespace detail

MESHTORCH_DECL torch::Tensor local_chunk(const AxisGroup& group, const torch::Tensor& tensor, int64_t dim) {
  detail::check_divisible("local_chunk", group, tensor, dim);
  return tensor.chunk(group.size(), dim)[group.rank()].contiguous();
}

MESHTORCH_DECL torch::Tensor redistribute(const torch::Tensor& tensor, const AxisGroup& group,
                                          const RedistributeStep& step) {
  switch (step.collective) {
    case Collective::none:
      return tensor;
    case Collective::local_chunk:
      return local_chunk(group, tensor, detail::shard_dim(group, tensor, step.to_dim, step.to_name));
    case Collective::all_gather:
      return all_gather(group, tensor, detail::shard_dim(group, tensor, step.from_dim, step.from_name));
    case Collective::all_reduce:
      return all_reduce(group, tensor.clone());
    case Collective::reduce_scatter:
      return reduce_scatter(group, tensor, detail::shard_dim(group, tensor, step.to_dim, step.to_name));
    case Collective::all_to_all: {
      const int64_t from = detail::shard_dim(group, tensor, step.from_dim, step.from_name);
      const int64_t to = detail::shard_dim(group, tensor, step.to_dim, step.to_name);
      // Shard<-1> and Shard<1> of a 2-d tensor are the same placement.
      if (from == to) return tensor;
      return all_to_all(group, tensor, to, from);
    }
  }
  throw detail::collective_error("redistribute", group,
                                 fmt::format("unknown collective {}", static_cast<int>(step.collective)));
}

}  // namespace meshtorch::comm
#endif  // MESHTORCH_DEFINES(core)
