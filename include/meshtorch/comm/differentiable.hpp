#pragma once
// Collectives that autograd can differentiate. A layout Redistribution (layout/redistribution.hpp)
// names an activation's move between placements and its gradient's move back; one
// torch::autograd::Function runs both, each as the redistribute_step<From, To> (redistribute.hpp)
// that collective_for<> chose at compile time:
//
//   function (Megatron-LM's name)               forward          backward
//   copy_to_parallel_region            (f)      identity         all-reduce
//   reduce_from_parallel_region        (g)      all-reduce       identity
//   scatter_to_parallel_region<D>               local chunk      all-gather
//   gather_from_parallel_region<D>              all-gather       local chunk
//   gather_from_sequence_parallel_region<D>     all-gather       reduce-scatter
//   reduce_scatter_to_sequence_parallel_region<D> reduce-scatter all-gather
//
// f and g are Megatron-LM's operators around a column- then row-parallel pair; the sequence
// parallel pair replaces g when activations are sharded along the sequence. Parallel styles
// (layout/parallel_style.hpp) carry their own Redistributions, run through redistribute_differentiable.
#include <meshtorch/torch.hpp>

#include <meshtorch/comm/axis_group.hpp>
#include <meshtorch/comm/redistribute.hpp>
#include <meshtorch/layout/redistribution.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::comm {

namespace detail {

// The group and the backward step ride in the autograd context as a capsule: IValue has no slot
// for our own types.
struct RedistributeCapsule : torch::CustomClassHolder {
  RedistributeCapsule(AxisGroup g, RedistributeStep b) : group(std::move(g)), backward(b) {}
  AxisGroup group;
  RedistributeStep backward;
};

// One autograd function for every Redistribution: its steps are values made at compile time
// (redistribute_step), so a program has one node type, not one per placement pair.
struct RedistributeFunction : torch::autograd::Function<RedistributeFunction> {
  MESHTORCH_DECL static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                                              const AxisGroup& group, const RedistributeStep& forward_step,
                                              const RedistributeStep& backward_step);
  MESHTORCH_DECL static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                                torch::autograd::variable_list grads);
};

// RedistributeFunction::apply, out of line: its instantiation (the autograd node's code, some
// KB of it) is then compiled once, not in every unit that uses a parallel region.
MESHTORCH_DECL torch::Tensor apply_redistribute(const torch::Tensor& x, const AxisGroup& group,
                                                const RedistributeStep& forward_step,
                                                const RedistributeStep& backward_step);

}  // namespace detail

// A Redistribution as the run time performs it: the forward step of the activation and the
// backward step of its gradient, made by collective_for<> at compile time. Tensor parallel keeps
// its styles' Redistributions as these values, so the code that applies them is not a template.
struct RedistributionSteps {
  RedistributeStep forward, backward;
  constexpr bool moves() const {
    return forward.collective != Collective::none || backward.collective != Collective::none;
  }
};
template <RedistributionType R>
inline constexpr RedistributionSteps redistribution_steps{
    redistribute_step<typename R::from, typename R::to>,
    redistribute_step<typename R::grad_of_to, typename R::grad_of_from>};

// Runs the forward step on x and, in backward, the backward step on its gradient; x itself when
// neither moves.
inline torch::Tensor redistribute_differentiable(const torch::Tensor& x, const AxisGroup& group,
                                                 const RedistributionSteps& steps) {
  if (!steps.moves()) return x;
  return detail::apply_redistribute(x, group, steps.forward, steps.backward);
}

// Runs R's forward collective on x and, in backward, R's backward collective on its gradient.
template <RedistributionType R>
torch::Tensor redistribute_differentiable(const torch::Tensor& x, const AxisGroup& group) {
  return redistribute_differentiable(x, group, redistribution_steps<R>);
}

// f: identity forward, all-reduce (sum) backward. Enters a tensor-parallel region.
inline torch::Tensor copy_to_parallel_region(const torch::Tensor& x, const AxisGroup& group) {
  return redistribute_differentiable<CopyToParallelRegion>(x, group);
}

// g: all-reduce (sum) forward, identity backward. Leaves a row-parallel region.
inline torch::Tensor reduce_from_parallel_region(const torch::Tensor& x, const AxisGroup& group) {
  return redistribute_differentiable<ReduceFromParallelRegion>(x, group);
}

// This rank's piece along Dim forward; all-gather backward.
template <int Dim = -1>
torch::Tensor scatter_to_parallel_region(const torch::Tensor& x, const AxisGroup& group) {
  return redistribute_differentiable<ScatterToParallelRegion<Dim>>(x, group);
}

// All-gather along Dim forward; this rank's piece backward.
template <int Dim = -1>
torch::Tensor gather_from_parallel_region(const torch::Tensor& x, const AxisGroup& group) {
  return redistribute_differentiable<GatherFromParallelRegion<Dim>>(x, group);
}

// All-gather along Dim (the sequence) forward; reduce-scatter (sum) backward.
template <int Dim>
torch::Tensor gather_from_sequence_parallel_region(const torch::Tensor& x, const AxisGroup& group) {
  return redistribute_differentiable<GatherFromSequenceParallelRegion<Dim>>(x, group);
}

// Reduce-scatter (sum) along Dim forward; all-gather backward.
template <int Dim>
torch::Tensor reduce_scatter_to_sequence_parallel_region(const torch::Tensor& x, const AxisGroup& group) {
  return redistribute_differentiable<ReduceScatterToSequenceParallelRegion<Dim>>(x, group);
}

}  // namespace meshtorch::comm

#if MESHTORCH_DEFINES(core)
namespace meshtorch::comm::detail {

MESHTORCH_DECL torch::Tensor RedistributeFunction::forward(torch::autograd::AutogradContext* ctx,
                                                           const torch::Tensor& x, const AxisGroup& group,
                                                           const RedistributeStep& forward_step,
                                                           const RedistributeStep& backward_step) {
  ctx->saved_data["redistribute"] =
      c10::IValue::make_capsule(c10::make_intrusive<RedistributeCapsule>(group, backward_step));
  // An output that is the input itself would not be recorded as this function's output.
  if (forward_step.collective == Collective::none) return x.view_as(x);
  return redistribute(x, group, forward_step);
}

MESHTORCH_DECL torch::autograd::variable_list RedistributeFunction::backward(torch::autograd::AutogradContext* ctx,
                                                                             torch::autograd::variable_list grads) {
  const auto& saved = *static_cast<RedistributeCapsule*>(ctx->saved_data["redistribute"].toCapsule().get());
  return {redistribute(grads[0], saved.group, saved.backward), torch::Tensor(), torch::Tensor(), torch::Tensor()};
}

MESHTORCH_DECL torch::Tensor apply_redistribute(const torch::Tensor& x, const AxisGroup& group,
                                                const RedistributeStep& forward_step,
                                                const RedistributeStep& backward_step) {
  return RedistributeFunction::apply(x, group, forward_step, backward_step);
}

}  // namespace meshtorch::comm::detail
#endif  // MESHTORCH_DEFINES(core)
