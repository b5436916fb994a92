#pragma once
// Collectives over one mesh axis. Each takes the axis' group (mesh.group<TP>()) or the mesh and
// an axis key (mesh, axis<TP>); the *_async forms return a Work to wait on, the plain forms wait.
// Every wait is bounded by the group's timeout (AxisGroup::with_timeout changes it per call).
//
//   all_reduce      in place; sum, avg, max or min over the group
//   all_gather      the group's tensors concatenated along `dim`, in coordinate order
//   reduce_scatter  the reduction's `rank()`-th piece along `dim` (the dim must divide evenly)
//   broadcast       in place; the tensor of the group rank `source`
//   all_to_all      split along `split_dim`, piece j to group rank j, received pieces
//                   concatenated along `concat_dim`
//   *_coalesced     the same for many tensors in one message (one dtype and device)
//
// Every collective checks first, even in a group of one rank, that its tensors are on the group's
// device (CPU for Gloo, the bound GPU for NCCL): NCCL rejects a CPU tensor only on a multi-GPU
// run, so without the check that mistake would pass every single-process test. Metadata that
// lives on the CPU goes through the metadata helpers at the end of this file, which use the
// group's CPU companion (AxisGroup::metadata()).
#include <concepts>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include <meshtorch/torch.hpp>

#include <meshtorch/comm/axis_group.hpp>
#include <meshtorch/comm/work.hpp>
#include <meshtorch/layout/axis.hpp>
#include <meshtorch/layout/placement.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::comm {

enum class ReduceOp { sum, avg, max, min };

// Anything that hands out the group of an axis kind: a DeviceMesh.
template <class M, template <std::size_t> class Kind>
concept HasAxisGroup = requires(const M& mesh) {
  { mesh.template group<Kind>() } -> std::convertible_to<const AxisGroup&>;
};

namespace detail {

inline c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::max:
      return c10d::ReduceOp::MAX;
    case ReduceOp::min:
      return c10d::ReduceOp::MIN;
    default:
      return c10d::ReduceOp::SUM;  // avg is a sum divided afterwards: Gloo has no AVG
  }
}

MESHTORCH_DECL int64_t checked_dim(std::string_view collective, const AxisGroup& group, const torch::Tensor& tensor,
                                   int64_t dim);

MESHTORCH_DECL void check_divisible(std::string_view collective, const AxisGroup& group, const torch::Tensor& tensor,
                                    int64_t dim);

MESHTORCH_DECL void check_same_kind(std::string_view collective, const AxisGroup& group,
                                    const std::vector<torch::Tensor>& tensors);

MESHTORCH_DECL void check_device(std::string_view collective, const AxisGroup& group, const torch::Tensor& tensor);

MESHTORCH_DECL torch::Tensor flatten_all(const std::vector<torch::Tensor>& tensors);

// A coalesced collective that works in place (all-reduce, broadcast): the tensors flattened into
// one message, `collective` started on it, and on wait() the result copied back into them.
template <class Collective>
Work<std::vector<torch::Tensor>> in_place_coalesced(const char* name, const AxisGroup& group,
                                                    std::vector<torch::Tensor> tensors, Collective collective) {
  if (tensors.empty()) return Work<std::vector<torch::Tensor>>::ready({});
  check_same_kind(name, group, tensors);
  check_device(name, group, tensors.front());
  auto flat = collective(flatten_all(tensors));
  return {nullptr,
          [flat = std::move(flat), tensors]() mutable {
            const torch::Tensor result = flat.wait();
            int64_t offset = 0;
            for (auto& t : tensors) {
              t.copy_(result.narrow(0, offset, t.numel()).view(t.sizes()));
              offset += t.numel();
            }
            return tensors;
          },
          name, group};
}

}  // namespace detail

MESHTORCH_DECL Work<torch::Tensor> all_reduce_async(const AxisGroup& group, torch::Tensor tensor,
                                                    ReduceOp op = ReduceOp::sum);
MESHTORCH_DECL torch::Tensor all_reduce(const AxisGroup& group, torch::Tensor tensor, ReduceOp op = ReduceOp::sum);

MESHTORCH_DECL Work<torch::Tensor> all_gather_async(const AxisGroup& group, const torch::Tensor& tensor,
                                                    int64_t dim = 0);
MESHTORCH_DECL torch::Tensor all_gather(const AxisGroup& group, const torch::Tensor& tensor, int64_t dim = 0);

MESHTORCH_DECL Work<torch::Tensor> reduce_scatter_async(const AxisGroup& group, const torch::Tensor& tensor,
                                                        int64_t dim = 0, ReduceOp op = ReduceOp::sum);
MESHTORCH_DECL torch::Tensor reduce_scatter(const AxisGroup& group, const torch::Tensor& tensor, int64_t dim = 0,
                                            ReduceOp op = ReduceOp::sum);

MESHTORCH_DECL Work<torch::Tensor> broadcast_async(const AxisGroup& group, torch::Tensor tensor, int source = 0);
MESHTORCH_DECL torch::Tensor broadcast(const AxisGroup& group, torch::Tensor tensor, int source = 0);

MESHTORCH_DECL Work<torch::Tensor> all_to_all_async(const AxisGroup& group, const torch::Tensor& tensor,
                                                    int64_t split_dim, int64_t concat_dim);
MESHTORCH_DECL torch::Tensor all_to_all(const AxisGroup& group, const torch::Tensor& tensor, int64_t split_dim,
                                        int64_t concat_dim);

MESHTORCH_DECL Work<std::monostate> barrier_async(const AxisGroup& group);
MESHTORCH_DECL void barrier(const AxisGroup& group);

// Coalesced forms: one flat message instead of one per tensor, which matters for the many small
// tensors of a model (norm weights, biases).

MESHTORCH_DECL Work<std::vector<torch::Tensor>> all_reduce_coalesced_async(const AxisGroup& group,
                                                                           std::vector<torch::Tensor> tensors,
                                                                           ReduceOp op = ReduceOp::sum);
MESHTORCH_DECL std::vector<torch::Tensor> all_reduce_coalesced(const AxisGroup& group,
                                                               std::vector<torch::Tensor> tensors,
                                                               ReduceOp op = ReduceOp::sum);

MESHTORCH_DECL Work<std::vector<torch::Tensor>> all_gather_coalesced_async(const AxisGroup& group,
                                                                           std::vector<torch::Tensor> tensors,
                                                                           int64_t dim = 0);
MESHTORCH_DECL std::vector<torch::Tensor> all_gather_coalesced(const AxisGroup& group,
                                                               std::vector<torch::Tensor> tensors, int64_t dim = 0);

MESHTORCH_DECL Work<std::vector<torch::Tensor>> reduce_scatter_coalesced_async(const AxisGroup& group,
                                                                               std::vector<torch::Tensor> tensors,
                                                                               int64_t dim = 0,
                                                                               ReduceOp op = ReduceOp::sum);
MESHTORCH_DECL std::vector<torch::Tensor> reduce_scatter_coalesced(const AxisGroup& group,
                                                                   std::vector<torch::Tensor> tensors, int64_t dim = 0,
                                                                   ReduceOp op = ReduceOp::sum);

MESHTORCH_DECL Work<std::vector<torch::Tensor>> broadcast_coalesced_async(const AxisGroup& group,
                                                                          std::vector<torch::Tensor> tensors,
                                                                          int source = 0);
MESHTORCH_DECL std::vector<torch::Tensor> broadcast_coalesced(const AxisGroup& group,
                                                              std::vector<torch::Tensor> tensors, int source = 0);

// Metadata collectives: CPU values exchanged over the group's CPU companion (AxisGroup::metadata),
// whatever the group's device, as torch's broadcast_object_list and all_gather_object do.

// `value` of the group rank `source`, on every rank of the group.
template <class T>
requires std::is_arithmetic_v<T> T broadcast_value(const AxisGroup& group, T value, int source = 0) {
  torch::Tensor buffer = std::is_integral_v<T> ? torch::tensor({static_cast<std::int64_t>(value)}, torch::kLong)
                                               : torch::tensor({static_cast<double>(value)}, torch::kDouble);
  broadcast(group.metadata(), buffer, source);
  return buffer.item().to<T>();
}

// Every group rank's string (any bytes), in group rank order.
MESHTORCH_DECL std::vector<std::string> all_gather_object(const AxisGroup& group, const std::string& object);

// A phase's outcome agreed by the group: every rank passes its error ("" for none) and, if any
// rank failed, every rank throws the lowest failing rank's error, so that no rank goes on to wait
// for one that has stopped.
template <class Error = DataError>
void raise_first_error(const AxisGroup& group, const std::string& error) {
  for (const auto& other : all_gather_object(group, error))
    if (!other.empty()) throw Error(other);
}

// The same collectives addressed by mesh and axis kind: all_reduce(mesh, axis<TP>, t).
#define MESHTORCH_AXIS_FORM(collective)                                          \
  template <class M, template <std::size_t> class Kind, class... Args>           \
  requires HasAxisGroup<M, Kind>                                                 \
  auto collective(const M& mesh, AxisKey<Kind>, Args&&... args) {                \
    return collective(mesh.template group<Kind>(), std::forward<Args>(args)...); \
  }
MESHTORCH_AXIS_FORM(all_reduce)
MESHTORCH_AXIS_FORM(all_reduce_async)
MESHTORCH_AXIS_FORM(all_gather)
MESHTORCH_AXIS_FORM(all_gather_async)
MESHTORCH_AXIS_FORM(reduce_scatter)
MESHTORCH_AXIS_FORM(reduce_scatter_async)
MESHTORCH_AXIS_FORM(broadcast)
MESHTORCH_AXIS_FORM(broadcast_async)
MESHTORCH_AXIS_FORM(all_to_all)
MESHTORCH_AXIS_FORM(all_to_all_async)
MESHTORCH_AXIS_FORM(barrier)
MESHTORCH_AXIS_FORM(barrier_async)
MESHTORCH_AXIS_FORM(all_reduce_coalesced)
MESHTORCH_AXIS_FORM(all_reduce_coalesced_async)
MESHTORCH_AXIS_FORM(all_gather_coalesced)
MESHTORCH_AXIS_FORM(all_gather_coalesced_async)
MESHTORCH_AXIS_FORM(reduce_scatter_coalesced)
MESHTORCH_AXIS_FORM(reduce_scatter_coalesced_async)
MESHTORCH_AXIS_FORM(broadcast_coalesced)
MESHTORCH_AXIS_FORM(broadcast_coalesced_async)
#undef MESHTORCH_AXIS_FORM

}  // namespace meshtorch::comm

#if MESHTORCH_DEFINES(core)
#include <algorithm>

#include <fmt/format.h>

namespace meshtorch::comm {

namespace detail {

MESHTORCH_DECL int64_t checked_dim(std::string_view collective, const AxisGroup& group, const torch::Tensor& tensor,
                                   int64_t dim) {
  const int d = normalize_dim(static_cast<int>(dim), static_cast<int>(tensor.dim()));
  if (d < 0)
    throw collective_error(collective, group,
                           fmt::format("dim {} is out of range for a tensor of {} dims", dim, tensor.dim()));
  return d;
}

MESHTORCH_DECL void check_divisible(std::string_view collective, const AxisGroup& group, const torch::Tensor& tensor,
                                    int64_t dim) {
  if (tensor.size(dim) % group.size() != 0)
    throw collective_error(collective, group,
                           fmt::format("dim {} has size {}, which the group size {} does not divide; pad the "
                                       "tensor or choose another dim",
                                       dim, tensor.size(dim), group.size()));
}

MESHTORCH_DECL void check_same_kind(std::string_view collective, const AxisGroup& group,
                                    const std::vector<torch::Tensor>& tensors) {
  for (const auto& t : tensors)
    if (t.scalar_type() != tensors.front().scalar_type() || t.device() != tensors.front().device())
      throw collective_error(collective, group,
                             "coalesced tensors must share one dtype and device; issue one call "
                             "per dtype");
}

MESHTORCH_DECL void check_device(std::string_view collective, const AxisGroup& group, const torch::Tensor& tensor) {
  const torch::Device device = tensor.device();
  const bool right = group.device() == Device::cpu
                         ? device.is_cpu()
                         : device.is_cuda() && (group.cuda_device() < 0 || device.index() == group.cuda_device());
  if (!right)
    throw collective_error(
        collective, group,
        fmt::format("it was handed a tensor on {} but the group moves {} tensors; move the tensor to {}{}",
                    device.str(), group.device_name(), group.device_name(),
                    group.device() == Device::cuda && device.is_cpu()
                        ? ", or send CPU metadata through group.metadata() (comm::broadcast_value, "
                          "comm::all_gather_object)"
                        : ""));
}

MESHTORCH_DECL torch::Tensor flatten_all(const std::vector<torch::Tensor>& tensors) {
  std::vector<torch::Tensor> flat;
  flat.reserve(tensors.size());
  for (const auto& t : tensors) flat.push_back(t.reshape({-1}));
  return torch::cat(flat);
}

}  // namespace detail

MESHTORCH_DECL Work<torch::Tensor> all_reduce_async(const AxisGroup& group, torch::Tensor tensor, ReduceOp op) {
  detail::check_device("all_reduce", group, tensor);
  if (group.size() == 1) return Work<torch::Tensor>::ready(tensor);
  torch::Tensor buffer = tensor.is_contiguous() ? tensor : tensor.contiguous();
  std::vector<torch::Tensor> buffers{buffer};
  c10d::AllreduceOptions options;
  options.reduceOp = detail::to_c10d(op);
  options.timeout = group.timeout();
  auto work = detail::issue("all_reduce", group, buffer, [&] { return group.backend()->allreduce(buffers, options); });
  return {work,
          [tensor, buffer, op, n = group.size()]() mutable {
            if (op == ReduceOp::avg) buffer.div_(n);
            if (!buffer.is_same(tensor)) tensor.copy_(buffer);
            return tensor;
          },
          "all_reduce", group};
}

MESHTORCH_DECL torch::Tensor all_reduce(const AxisGroup& group, torch::Tensor tensor, ReduceOp op) {
  return all_reduce_async(group, std::move(tensor), op).wait();
}

MESHTORCH_DECL Work<torch::Tensor> all_gather_async(const AxisGroup& group, const torch::Tensor& tensor, int64_t dim) {
  detail::check_device("all_gather", group, tensor);
  const int64_t d = detail::checked_dim("all_gather", group, tensor, dim);
  if (group.size() == 1) return Work<torch::Tensor>::ready(tensor);
  torch::Tensor input = tensor.contiguous();
  std::vector<std::vector<torch::Tensor>> outputs(1);
  for (int i = 0; i < group.size(); ++i) outputs[0].push_back(torch::empty_like(input));
  std::vector<torch::Tensor> inputs{input};
  c10d::AllgatherOptions options;
  options.timeout = group.timeout();
  auto work =
      detail::issue("all_gather", group, input, [&] { return group.backend()->allgather(outputs, inputs, options); });
  return {work, [pieces = outputs[0], input, d] { return torch::cat(pieces, d); }, "all_gather", group};
}

MESHTORCH_DECL torch::Tensor all_gather(const AxisGroup& group, const torch::Tensor& tensor, int64_t dim) {
  return all_gather_async(group, tensor, dim).wait();
}

MESHTORCH_DECL Work<torch::Tensor> reduce_scatter_async(const AxisGroup& group, const torch::Tensor& tensor,
                                                        int64_t dim, ReduceOp op) {
  detail::check_device("reduce_scatter", group, tensor);
  const int64_t d = detail::checked_dim("reduce_scatter", group, tensor, dim);
  detail::check_divisible("reduce_scatter", group, tensor, d);
  if (group.size() == 1) return Work<torch::Tensor>::ready(tensor.clone());
  std::vector<std::vector<torch::Tensor>> inputs(1);
  for (const auto& piece : tensor.chunk(group.size(), d)) inputs[0].push_back(piece.contiguous());
  std::vector<torch::Tensor> outputs{torch::empty_like(inputs[0][0])};
  c10d::ReduceScatterOptions options;
  options.reduceOp = detail::to_c10d(op);
  options.timeout = group.timeout();
  auto work = detail::issue("reduce_scatter", group, tensor,
                            [&] { return group.backend()->reduce_scatter(outputs, inputs, options); });
  return {work,
          [output = outputs[0], pieces = inputs[0], op, n = group.size()]() mutable {
            if (op == ReduceOp::avg) output.div_(n);
            return output;
          },
          "reduce_scatter", group};
}

MESHTORCH_DECL torch::Tensor reduce_scatter(const AxisGroup& group, const torch::Tensor& tensor, int64_t dim,
                                            ReduceOp op) {
  return reduce_scatter_async(group, tensor, dim, op).wait();
}

MESHTORCH_DECL Work<torch::Tensor> broadcast_async(const AxisGroup& group, torch::Tensor tensor, int source) {
  detail::check_device("broadcast", group, tensor);
  if (source < 0 || source >= group.size())
    throw detail::collective_error(
        "broadcast", group, fmt::format("source {} is not a rank of the group (0 to {})", source, group.size() - 1));
  if (group.size() == 1) return Work<torch::Tensor>::ready(tensor);
  torch::Tensor buffer = tensor.is_contiguous() ? tensor : tensor.contiguous();
  std::vector<torch::Tensor> buffers{buffer};
  c10d::BroadcastOptions options;
  options.rootRank = source;
  options.timeout = group.timeout();
  auto work = detail::issue("broadcast", group, buffer, [&] { return group.backend()->broadcast(buffers, options); });
  return {work,
          [tensor, buffer]() mutable {
            if (!buffer.is_same(tensor)) tensor.copy_(buffer);
            return tensor;
          },
          "broadcast", group};
}

MESHTORCH_DECL torch::Tensor broadcast(const AxisGroup& group, torch::Tensor tensor, int source) {
  return broadcast_async(group, std::move(tensor), source).wait();
}

MESHTORCH_DECL Work<torch::Tensor> all_to_all_async(const AxisGroup& group, const torch::Tensor& tensor,
                                                    int64_t split_dim, int64_t concat_dim) {
  detail::check_device("all_to_all", group, tensor);
  const int64_t split = detail::checked_dim("all_to_all", group, tensor, split_dim);
  const int64_t concat = detail::checked_dim("all_to_all", group, tensor, concat_dim);
  detail::check_divisible("all_to_all", group, tensor, split);
  if (group.size() == 1) return Work<torch::Tensor>::ready(tensor);
  // Stacking the pieces along a new leading dim lets one alltoall_base with equal splits move
  // piece j to group rank j; received piece i (from rank i) lands at index i.
  torch::Tensor input = torch::stack(tensor.chunk(group.size(), split), 0).contiguous();
  torch::Tensor output = torch::empty_like(input);
  std::vector<int64_t> equal_splits;
  c10d::AllToAllOptions options;
  options.timeout = group.timeout();
  auto work = detail::issue("all_to_all", group, input, [&] {
    return group.backend()->alltoall_base(output, input, equal_splits, equal_splits, options);
  });
  return {work, [output, input, concat] { return torch::cat(output.unbind(0), concat); }, "all_to_all", group};
}

MESHTORCH_DECL torch::Tensor all_to_all(const AxisGroup& group, const torch::Tensor& tensor, int64_t split_dim,
                                        int64_t concat_dim) {
  return all_to_all_async(group, tensor, split_dim, concat_dim).wait();
}

MESHTORCH_DECL Work<std::monostate> barrier_async(const AxisGroup& group) {
  if (group.size() == 1) return Work<std::monostate>::ready({});
  c10d::BarrierOptions options;
  options.timeout = group.timeout();
  auto work = detail::issue("barrier", group, [&] { return group.backend()->barrier(options); });
  return {work, [] { return std::monostate{}; }, "barrier", group};
}

MESHTORCH_DECL void barrier(const AxisGroup& group) { barrier_async(group).wait(); }

MESHTORCH_DECL Work<std::vector<torch::Tensor>> all_reduce_coalesced_async(const AxisGroup& group,
                                                                           std::vector<torch::Tensor> tensors,
                                                                           ReduceOp op) {
  return detail::in_place_coalesced("all_reduce_coalesced", group, std::move(tensors),
                                    [&](torch::Tensor flat) { return all_reduce_async(group, std::move(flat), op); });
}

MESHTORCH_DECL std::vector<torch::Tensor> all_reduce_coalesced(const AxisGroup& group,
                                                               std::vector<torch::Tensor> tensors, ReduceOp op) {
  return all_reduce_coalesced_async(group, std::move(tensors), op).wait();
}

MESHTORCH_DECL Work<std::vector<torch::Tensor>> all_gather_coalesced_async(const AxisGroup& group,
                                                                           std::vector<torch::Tensor> tensors,
                                                                           int64_t dim) {
  if (tensors.empty()) return Work<std::vector<torch::Tensor>>::ready({});
  detail::check_same_kind("all_gather_coalesced", group, tensors);
  detail::check_device("all_gather_coalesced", group, tensors.front());
  std::vector<int64_t> dims;
  for (const auto& t : tensors) dims.push_back(detail::checked_dim("all_gather_coalesced", group, t, dim));
  auto gathered = all_gather_async(group, detail::flatten_all(tensors), 0);
  return {nullptr,
          [gathered = std::move(gathered), tensors, dims, n = group.size()]() mutable {
            // Rank i's flat message is the i-th block of the gathered vector.
            const torch::Tensor all = gathered.wait().view({n, -1});
            std::vector<torch::Tensor> results;
            int64_t offset = 0;
            for (std::size_t k = 0; k < tensors.size(); ++k) {
              std::vector<torch::Tensor> pieces;
              for (int i = 0; i < n; ++i)
                pieces.push_back(all[i].narrow(0, offset, tensors[k].numel()).view(tensors[k].sizes()));
              results.push_back(torch::cat(pieces, dims[k]));
              offset += tensors[k].numel();
            }
            return results;
          },
          "all_gather_coalesced", group};
}

MESHTORCH_DECL std::vector<torch::Tensor> all_gather_coalesced(const AxisGroup& group,
                                                               std::vector<torch::Tensor> tensors, int64_t dim) {
  return all_gather_coalesced_async(group, std::move(tensors), dim).wait();
}

MESHTORCH_DECL Work<std::vector<torch::Tensor>> reduce_scatter_coalesced_async(const AxisGroup& group,
                                                                               std::vector<torch::Tensor> tensors,
                                                                               int64_t dim, ReduceOp op) {
  if (tensors.empty()) return Work<std::vector<torch::Tensor>>::ready({});
  detail::check_same_kind("reduce_scatter_coalesced", group, tensors);
  detail::check_device("reduce_scatter_coalesced", group, tensors.front());
  const int n = group.size();
  // Block j of the packed message holds, for every tensor, the piece that group rank j keeps.
  std::vector<torch::Tensor> blocks(n);
  std::vector<std::vector<int64_t>> piece_shapes;
  for (int j = 0; j < n; ++j) {
    std::vector<torch::Tensor> pieces;
    for (const auto& t : tensors) {
      const int64_t d = detail::checked_dim("reduce_scatter_coalesced", group, t, dim);
      detail::check_divisible("reduce_scatter_coalesced", group, t, d);
      torch::Tensor piece = t.chunk(n, d)[j];
      if (j == 0) piece_shapes.push_back(piece.sizes().vec());
      pieces.push_back(piece.reshape({-1}));
    }
    blocks[j] = torch::cat(pieces);
  }
  auto reduced = reduce_scatter_async(group, torch::cat(blocks), 0, op);
  return {nullptr,
          [reduced = std::move(reduced), piece_shapes]() mutable {
            const torch::Tensor mine = reduced.wait();
            std::vector<torch::Tensor> results;
            int64_t offset = 0;
            for (const auto& shape : piece_shapes) {
              int64_t numel = 1;
              for (int64_t s : shape) numel *= s;
              results.push_back(mine.narrow(0, offset, numel).view(shape));
              offset += numel;
            }
            return results;
          },
          "reduce_scatter_coalesced", group};
}

MESHTORCH_DECL std::vector<torch::Tensor> reduce_scatter_coalesced(const AxisGroup& group,
                                                                   std::vector<torch::Tensor> tensors, int64_t dim,
                                                                   ReduceOp op) {
  return reduce_scatter_coalesced_async(group, std::move(tensors), dim, op).wait();
}

MESHTORCH_DECL Work<std::vector<torch::Tensor>> broadcast_coalesced_async(const AxisGroup& group,
                                                                          std::vector<torch::Tensor> tensors,
                                                                          int source) {
  return detail::in_place_coalesced("broadcast_coalesced", group, std::move(tensors), [&](torch::Tensor flat) {
    return broadcast_async(group, std::move(flat), source);
  });
}

MESHTORCH_DECL std::vector<torch::Tensor> broadcast_coalesced(const AxisGroup& group,
                                                              std::vector<torch::Tensor> tensors, int source) {
  return broadcast_coalesced_async(group, std::move(tensors), source).wait();
}

MESHTORCH_DECL std::vector<std::string> all_gather_object(const AxisGroup& group, const std::string& object) {
  const AxisGroup metadata = group.metadata();
  const torch::Tensor lengths =
      all_gather(metadata, torch::tensor({static_cast<std::int64_t>(object.size())}, torch::kLong));
  const std::int64_t longest = lengths.max().item<std::int64_t>();
  torch::Tensor bytes = torch::zeros({1, std::max<std::int64_t>(longest, 1)}, torch::kUInt8);
  std::copy(object.begin(), object.end(), bytes.data_ptr<std::uint8_t>());
  const torch::Tensor all = all_gather(metadata, bytes, 0).contiguous();
  std::vector<std::string> objects;
  for (int r = 0; r < group.size(); ++r) {
    const auto* row = all[r].data_ptr<std::uint8_t>();
    objects.emplace_back(reinterpret_cast<const char*>(row), static_cast<std::size_t>(lengths[r].item<std::int64_t>()));
  }
  return objects;
}

}  // namespace meshtorch::comm
#endif  // MESHTORCH_DEFINES(core)
