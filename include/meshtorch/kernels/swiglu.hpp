#pragma once
// SwiGLU's gate, silu(gate) * up, in one pass forward and one backward on the CPU.
//
// Composed, silu and the product are two passes forward and three backward (silu's gradient, and
// the product's two), and autograd keeps gate, silu(gate) and up: three activations of the MLP's
// width per layer. Fused, the product and both gradients are one pass each, and only gate and up
// are kept. In fp32 on a CPU with AVX-512 (kernels/cpu_isa.hpp) sigmoid(gate) is computed in the
// registers of that pass; elsewhere it comes from LibTorch's own kernel, forward and again
// backward, a pass of its own each time: its vectorised exp is SLEEF's, which ATen compiles per
// instruction set and a header cannot reach (a baseline build's Vectorized<float>::exp is std::exp
// lane by lane, three times slower than the whole composite). Off the CPU the composite runs.
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

#include <meshtorch/kernels/cpu_isa.hpp>
#include <meshtorch/kernels/cpu_rows.hpp>
#include <meshtorch/kernels/vector_exp.hpp>

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

#if MESHTORCH_X86_KERNELS
// The one-pass loops for fp32 on AVX-512: sigmoid(gate) computed in the registers, so neither
// pass writes or reads it as a tensor: 1 / (1 + e^-x), e^-x by kernels/vector_exp.hpp (sigmoid
// within 2e-7 of its value in fp64; 0 or 1 in fp32 well before the exp's clamp).
__attribute__((target("avx512f"), always_inline)) inline __m512 sigmoid_avx512(__m512 x) {
  const __m512 exp_minus_x = exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), x));
  return _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_add_ps(_mm512_set1_ps(1.0f), exp_minus_x));
}

// out = silu(gate) * up over [0, count), the last part through a mask.
__attribute__((target("avx512f"))) inline void forward_avx512(const float* gate, const float* up, float* out,
                                                              std::int64_t count) {
  for (std::int64_t i = 0; i < count; i += 16) {
    const auto mask = first_lanes(count - i);
    const __m512 g = _mm512_maskz_loadu_ps(mask, gate + i);
    const __m512 silu = _mm512_mul_ps(g, sigmoid_avx512(g));
    _mm512_mask_storeu_ps(out + i, mask, _mm512_mul_ps(silu, _mm512_maskz_loadu_ps(mask, up + i)));
  }
}

// grad_up = grad silu(gate), grad_gate = grad up silu'(gate), as backward_elements.
__attribute__((target("avx512f"))) inline void backward_avx512(const float* grad, const float* gate, const float* up,
                                                               float* grad_gate, float* grad_up, std::int64_t count) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (std::int64_t i = 0; i < count; i += 16) {
    const auto mask = first_lanes(count - i);
    const __m512 g = _mm512_maskz_loadu_ps(mask, gate + i);
    const __m512 d = _mm512_maskz_loadu_ps(mask, grad + i);
    const __m512 s = sigmoid_avx512(g);
    _mm512_mask_storeu_ps(grad_up + i, mask, _mm512_mul_ps(d, _mm512_mul_ps(g, s)));
    const __m512 slope = _mm512_mul_ps(s, _mm512_fmadd_ps(g, _mm512_sub_ps(one, s), one));
    _mm512_mask_storeu_ps(grad_gate + i, mask,
                          _mm512_mul_ps(_mm512_mul_ps(d, _mm512_maskz_loadu_ps(mask, up + i)), slope));
  }
}
#endif  // MESHTORCH_X86_KERNELS

// Whether the one-pass loops take these rows.
inline bool one_pass(const torch::Tensor& gate) {
  return MESHTORCH_X86_KERNELS && gate.scalar_type() == torch::kFloat && cpu_isa() == Isa::avx512;
}

class FusedSwiGlu : public torch::autograd::Function<FusedSwiGlu> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& gate,
                               const torch::Tensor& up) {
    const auto g = gate.contiguous();
    const auto u = up.contiguous();
    auto out = torch::empty_like(g);
    ctx->save_for_backward({g, u});
#if MESHTORCH_X86_KERNELS
    if (one_pass(g)) {
      const float *gates = g.const_data_ptr<float>(), *ups = u.const_data_ptr<float>();
      float* outs = out.mutable_data_ptr<float>();
      cpu::for_element_ranges(g.numel(), [&](std::int64_t begin, std::int64_t end) {
        forward_avx512(gates + begin, ups + begin, outs + begin, end - begin);
      });
      return out;
    }
#endif
    const auto s = at::sigmoid(g);
    cpu::with_element_type(g.scalar_type(), [&]<class T>() {
      forward_elements<T>(g.const_data_ptr<T>(), s.const_data_ptr<T>(), u.const_data_ptr<T>(),
                          out.mutable_data_ptr<T>(), g.numel());
    });
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    cpu::refuse_double_backward("swiglu");
    const auto saved = ctx->get_saved_variables();
    const auto& g = saved[0];
    const auto& u = saved[1];
    const auto grad = grads[0].contiguous();
    auto grad_gate = torch::empty_like(g);
    auto grad_up = torch::empty_like(u);
#if MESHTORCH_X86_KERNELS
    if (one_pass(g)) {
      const float *grads_in = grad.const_data_ptr<float>(), *gates = g.const_data_ptr<float>(),
                  *ups = u.const_data_ptr<float>();
      float *gate_grads = grad_gate.mutable_data_ptr<float>(), *up_grads = grad_up.mutable_data_ptr<float>();
      cpu::for_element_ranges(g.numel(), [&](std::int64_t begin, std::int64_t end) {
        backward_avx512(grads_in + begin, gates + begin, ups + begin, gate_grads + begin, up_grads + begin,
                        end - begin);
      });
      return {grad_gate, grad_up};
    }
#endif
    const auto s = at::sigmoid(g);
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
