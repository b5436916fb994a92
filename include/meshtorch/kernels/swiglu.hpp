#pragma once
// SwiGLU's gate, silu(gate) * up, in one pass forward and one backward on the CPU.
//
// Composed, silu and the product are two passes forward and three backward (silu's gradient, and
// the product's two), and autograd keeps gate, silu(gate) and up: three activations of the MLP's
// width per layer. Fused, the product and both gradients are one pass each, and only gate and up
// are kept. sigmoid(gate) comes from LibTorch's own kernel, forward and again backward: its
// vectorised exp is SLEEF's, which ATen compiles per instruction set and a header cannot reach
// (a baseline build's Vectorized<float>::exp is std::exp lane by lane, three times slower than
// the whole composite). Off the CPU the composite runs.
#include <meshtorch/torch.hpp>

#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::kernels {

// silu(gate) * up, elementwise, rounded as the composite's ops round in gate's type.
MESHTORCH_DECL torch::Tensor swiglu(const torch::Tensor& gate, const torch::Tensor& up);

namespace composite {
MESHTORCH_DECL torch::Tensor swiglu(const torch::Tensor& gate, const torch::Tensor& up);
}  // namespace composite

}  // namespace meshtorch::kernels

#if MESHTORCH_DEFINES(core)
#include <vector>

#include <ATen/record_function.h>
#include <torch/autograd.h>

#include <meshtorch/kernels/cpu_rows.hpp>

namespace meshtorch::kernels {

namespace swiglu_detail {

using cpu::load;
using cpu::round_as;
using cpu::store;

template <class T>
void forward_elements(const T* gate, const T* sigmoid, const T* up, T* out, std::int64_t count) {
  cpu::for_each_element<T>(count, [&](std::int64_t i, auto lane) {
    const auto silu = round_as<T>(load(gate + i, lane) * load(sigmoid + i, lane));
    store(out + i, round_as<T>(silu * load(up + i, lane)));
  });
}

// grad_gate = grad * up * silu'(gate), grad_up = grad * silu(gate), with
// silu'(g) = s (1 + g (1 - s)) for s = sigmoid(g).
template <class T>
void backward_elements(const T* grad, const T* gate, const T* sigmoids, const T* up, T* grad_gate, T* grad_up,
                       std::int64_t count) {
  cpu::for_each_element<T>(count, [&](std::int64_t i, auto lane) {
    const auto g = load(gate + i, lane);
    const auto d = load(grad + i, lane);
    const auto sigmoid = load(sigmoids + i, lane);
    const auto silu = g * sigmoid;
    store(grad_up + i, d * round_as<T>(silu));
    store(grad_gate + i, d * load(up + i, lane) * sigmoid * (1.0f + g * (1.0f - sigmoid)));
  });
}

class FusedSwiGlu : public torch::autograd::Function<FusedSwiGlu> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& gate,
                               const torch::Tensor& up) {
    const auto g = gate.contiguous();
    const auto u = up.contiguous();
    const auto s = at::sigmoid(g);
    auto out = torch::empty_like(g);
    cpu::with_element_type(g.scalar_type(), [&]<class T>() {
      forward_elements<T>(g.const_data_ptr<T>(), s.const_data_ptr<T>(), u.const_data_ptr<T>(),
                          out.mutable_data_ptr<T>(), g.numel());
    });
    ctx->save_for_backward({g, u});
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    cpu::refuse_double_backward("swiglu");
    const auto saved = ctx->get_saved_variables();
    const auto& g = saved[0];
    const auto& u = saved[1];
    const auto grad = grads[0].contiguous();
    const auto s = at::sigmoid(g);
    auto grad_gate = torch::empty_like(g);
    auto grad_up = torch::empty_like(u);
    cpu::with_element_type(g.scalar_type(), [&]<class T>() {
      backward_elements<T>(grad.const_data_ptr<T>(), g.const_data_ptr<T>(), s.const_data_ptr<T>(),
                           u.const_data_ptr<T>(), grad_gate.mutable_data_ptr<T>(), grad_up.mutable_data_ptr<T>(),
                           g.numel());
    });
    return {grad_gate, grad_up};
  }
};

}  // namespace swiglu_detail

MESHTORCH_DECL torch::Tensor swiglu(const torch::Tensor& gate, const torch::Tensor& up) {
  if (!cpu::has_cpu_kernel(gate) || gate.sizes() != up.sizes() || gate.scalar_type() != up.scalar_type() ||
      !up.device().is_cpu())
    return composite::swiglu(gate, up);
  RECORD_FUNCTION("meshtorch::swiglu", std::vector<c10::IValue>{});  // named in a profile, as an ATen op is
  return swiglu_detail::FusedSwiGlu::apply(gate, up);
}

namespace composite {
MESHTORCH_DECL torch::Tensor swiglu(const torch::Tensor& gate, const torch::Tensor& up) {
  return torch::silu(gate) * up;
}
}  // namespace composite

}  // namespace meshtorch::kernels
#endif  // MESHTORCH_DEFINES(core)
