#pragma once
// Collectives that autograd can differentiate, as torch::autograd::Functions. Each forward
// collective has the adjoint collective as its backward:
//
//   function                                    forward          backward
//   copy_to_parallel_region            (f)      identity         all-reduce
//   reduce_from_parallel_region        (g)      all-reduce       identity
//   scatter_to_parallel_region                  local chunk      all-gather
//   gather_from_parallel_region                 all-gather       local chunk
//   gather_from_sequence_parallel_region        all-gather       reduce-scatter
//   reduce_scatter_to_sequence_parallel_region  reduce-scatter   all-gather
//
// f and g are Megatron-LM's operators around a column- then row-parallel pair; the sequence
// parallel pair replaces g when activations are sharded along the sequence.
#include <cstdint>

#include <torch/torch.h>

#include <meshtorch/comm/axis_group.hpp>
#include <meshtorch/comm/collectives.hpp>
#include <meshtorch/comm/redistribute.hpp>

namespace meshtorch::comm {

namespace detail {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The group rides in the autograd context as a capsule: IValue has no slot for our own types.
struct GroupCapsule : torch::CustomClassHolder {
  explicit GroupCapsule(AxisGroup g) : group(std::move(g)) {}
  AxisGroup group;
};

inline void save_group(AutogradContext* ctx, const AxisGroup& group, int64_t dim = 0) {
  ctx->saved_data["group"] = c10::IValue::make_capsule(c10::make_intrusive<GroupCapsule>(group));
  ctx->saved_data["dim"] = dim;
}

inline const AxisGroup& saved_group(AutogradContext* ctx) {
  return static_cast<GroupCapsule*>(ctx->saved_data["group"].toCapsule().get())->group;
}

inline int64_t saved_dim(AutogradContext* ctx) { return ctx->saved_data["dim"].toInt(); }

struct CopyToParallelRegion : torch::autograd::Function<CopyToParallelRegion> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const AxisGroup& group) {
    save_group(ctx, group);
    return x.view_as(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {all_reduce(saved_group(ctx), grads[0].clone()), torch::Tensor()};
  }
};

struct ReduceFromParallelRegion : torch::autograd::Function<ReduceFromParallelRegion> {
  static torch::Tensor forward(AutogradContext*, const torch::Tensor& x, const AxisGroup& group) {
    return all_reduce(group, x.clone());
  }
  static variable_list backward(AutogradContext*, variable_list grads) {
    return {grads[0], torch::Tensor()};
  }
};

struct ScatterToParallelRegion : torch::autograd::Function<ScatterToParallelRegion> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const AxisGroup& group,
                               int64_t dim) {
    dim = checked_dim("scatter_to_parallel_region", group, x, dim);
    save_group(ctx, group, dim);
    return local_chunk(group, x, dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {all_gather(saved_group(ctx), grads[0], saved_dim(ctx)), torch::Tensor(),
            torch::Tensor()};
  }
};

struct GatherFromParallelRegion : torch::autograd::Function<GatherFromParallelRegion> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const AxisGroup& group,
                               int64_t dim) {
    dim = checked_dim("gather_from_parallel_region", group, x, dim);
    save_group(ctx, group, dim);
    return all_gather(group, x, dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {local_chunk(saved_group(ctx), grads[0], saved_dim(ctx)), torch::Tensor(),
            torch::Tensor()};
  }
};

struct GatherFromSequenceParallelRegion
    : torch::autograd::Function<GatherFromSequenceParallelRegion> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const AxisGroup& group,
                               int64_t dim) {
    dim = checked_dim("gather_from_sequence_parallel_region", group, x, dim);
    save_group(ctx, group, dim);
    return all_gather(group, x, dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {reduce_scatter(saved_group(ctx), grads[0], saved_dim(ctx)), torch::Tensor(),
            torch::Tensor()};
  }
};

struct ReduceScatterToSequenceParallelRegion
    : torch::autograd::Function<ReduceScatterToSequenceParallelRegion> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const AxisGroup& group,
                               int64_t dim) {
    dim = checked_dim("reduce_scatter_to_sequence_parallel_region", group, x, dim);
    save_group(ctx, group, dim);
    return reduce_scatter(group, x, dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {all_gather(saved_group(ctx), grads[0], saved_dim(ctx)), torch::Tensor(),
            torch::Tensor()};
  }
};

}  // namespace detail

// f: identity forward, all-reduce (sum) backward. Enters a tensor-parallel region.
inline torch::Tensor copy_to_parallel_region(const torch::Tensor& x, const AxisGroup& group) {
  return detail::CopyToParallelRegion::apply(x, group);
}

// g: all-reduce (sum) forward, identity backward. Leaves a row-parallel region.
inline torch::Tensor reduce_from_parallel_region(const torch::Tensor& x, const AxisGroup& group) {
  return detail::ReduceFromParallelRegion::apply(x, group);
}

// This rank's piece along dim forward; all-gather backward.
inline torch::Tensor scatter_to_parallel_region(const torch::Tensor& x, const AxisGroup& group,
                                                int64_t dim = -1) {
  return detail::ScatterToParallelRegion::apply(x, group, dim);
}

// All-gather along dim forward; this rank's piece backward.
inline torch::Tensor gather_from_parallel_region(const torch::Tensor& x, const AxisGroup& group,
                                                 int64_t dim = -1) {
  return detail::GatherFromParallelRegion::apply(x, group, dim);
}

// All-gather along dim (the sequence) forward; reduce-scatter (sum) backward.
inline torch::Tensor gather_from_sequence_parallel_region(const torch::Tensor& x,
                                                          const AxisGroup& group, int64_t dim = 0) {
  return detail::GatherFromSequenceParallelRegion::apply(x, group, dim);
}

// Reduce-scatter (sum) along dim forward; all-gather backward.
inline torch::Tensor reduce_scatter_to_sequence_parallel_region(const torch::Tensor& x,
                                                                const AxisGroup& group,
                                                                int64_t dim = 0) {
  return detail::ReduceScatterToSequenceParallelRegion::apply(x, group, dim);
}

}  // namespace meshtorch::comm
