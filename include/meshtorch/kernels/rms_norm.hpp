#pragma once
// RMSNorm, alone and after a residual add, as HF's LlamaRMSNorm computes it (the mean square in
// fp32, the normalised value rounded to the input's type, then times the weight), in one pass over
// the rows forward and one backward on the CPU.
//
// A decoder layer adds the attention's output to its input and normalises the sum for the MLP:
// composed, that is an add, a cast, a square, a mean, an rsqrt and two products (each a pass over
// the activations, the most of them saved for backward); fused, one read of each input and one
// write of each output, with only the sum and one fp32 per row saved. Off the CPU the composite
// runs (LibTorch's at::rms_norm is fused on CUDA).
#include <cstdint>
#include <utility>

#include <meshtorch/torch.hpp>

#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::kernels {

// x [..., n] normalised over its last dimension, times weight [n].
MESHTORCH_DECL torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);

// (x + residual, rms_norm(x + residual)): the sum (in x's type, as `x + residual` gives it) is the
// next residual, the normalised sum the next sub-layer's input.
MESHTORCH_DECL std::pair<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x,
                                                                    const torch::Tensor& residual,
                                                                    const torch::Tensor& weight, double eps);

// The same maths as separate LibTorch ops: what --fused off runs, and what the tests compare with.
namespace composite {
MESHTORCH_DECL torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);
MESHTORCH_DECL std::pair<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x,
                                                                    const torch::Tensor& residual,
                                                                    const torch::Tensor& weight, double eps);
}  // namespace composite

}  // namespace meshtorch::kernels

#if MESHTORCH_DEFINES(core)
#include <vector>

#include <ATen/record_function.h>
#include <torch/autograd.h>

#include <meshtorch/kernels/cpu_rows.hpp>

namespace meshtorch::kernels {

namespace rms_norm_detail {

using cpu::load;
using cpu::round_as;
using cpu::store;

// Rows of x (plus residual, when given: written to `sum`) normalised into y; each row's
// 1/sqrt(mean square + eps) into rstd (fp32).
template <class T>
void forward_rows(const T* x, const T* residual, const T* weight, T* sum, T* y, float* rstd, std::int64_t rows,
                  std::int64_t n, double eps) {
  cpu::for_row_ranges(rows, cpu::row_ranges(rows, n), [&](std::int64_t, std::int64_t first, std::int64_t end) {
    for (auto row = first; row < end; ++row) {
      const T* h = x + row * n;
      if (residual != nullptr) {
        const T* r = residual + row * n;
        T* s = sum + row * n;
        cpu::for_each_lane<T>(
            n, [&](std::int64_t i, auto lane) { store(s + i, round_as<T>(load(h + i, lane) + load(r + i, lane))); });
        h = s;
      }
      const float inverse =
          1.0f / std::sqrt(cpu::sum_of_products(h, h, n) / static_cast<float>(n) + static_cast<float>(eps));
      rstd[row] = inverse;
      T* out = y + row * n;
      cpu::for_each_lane<T>(n, [&](std::int64_t i, auto lane) {
        store(out + i, round_as<T>(load(weight + i, lane) * round_as<T>(load(h + i, lane) * inverse)));
      });
    }
  });
}

// The gradient of the normalised rows `h` (x, or the sum x + residual) from grad_y, plus
// grad_sum (the sum's own gradient, may be null), into grad_h; the weight's gradient summed per
// range into weight_partials [ranges, n] (null: not wanted).
template <class T>
void backward_rows(const T* grad_y, const T* grad_sum, const T* h, const T* weight, const float* rstd, T* grad_h,
                   float* weight_partials, std::int64_t ranges, std::int64_t rows, std::int64_t n) {
  cpu::for_row_ranges(rows, ranges, [&](std::int64_t range, std::int64_t first, std::int64_t end) {
    float* partial = weight_partials != nullptr ? weight_partials + range * n : nullptr;
    if (partial != nullptr) std::fill(partial, partial + n, 0.0f);
    for (auto row = first; row < end; ++row) {
      const T* g = grad_y + row * n;
      const T* x = h + row * n;
      const float inverse = rstd[row];
      // c = mean(grad_y * weight * normalised), one pass; then each element's gradient.
      const float dot = cpu::sum_over_lanes<T>(
          n, [&](std::int64_t i, auto lane) { return load(g + i, lane) * load(weight + i, lane) * load(x + i, lane); });
      const float c = dot * inverse * inverse / static_cast<float>(n);
      T* out = grad_h + row * n;
      const T* gs = grad_sum != nullptr ? grad_sum + row * n : nullptr;
      cpu::for_each_lane<T>(n, [&](std::int64_t i, auto lane) {
        const auto xi = load(x + i, lane);
        auto value = (load(g + i, lane) * load(weight + i, lane) - xi * c) * inverse;
        if (gs != nullptr) value = value + load(gs + i, lane);
        store(out + i, value);
        if (partial != nullptr) store(partial + i, load(partial + i, lane) + load(g + i, lane) * xi * inverse);
      });
    }
  });
}

// Forward of both functions below: y (and x + residual where `residual` is defined); saves the
// normalised rows (the sum, or x), the weight and rstd.
inline torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                                              const torch::Tensor& residual, const torch::Tensor& weight, double eps) {
  const auto n = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == n, "rms_norm: weight of shape ", weight.sizes(), " for rows of ",
              n);
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "rms_norm: weight in ", weight.scalar_type(), " for input in ",
              x.scalar_type());
  const auto input = x.contiguous();
  const auto w = weight.contiguous();
  const bool adds = residual.defined();
  const auto res = adds ? residual.contiguous() : torch::Tensor();
  const auto rows = input.numel() / n;
  auto sum = adds ? torch::empty_like(input) : input;
  auto y = torch::empty_like(input);
  auto rstd = torch::empty({rows}, input.options().dtype(torch::kFloat));
  cpu::with_element_type(input.scalar_type(), [&]<class T>() {
    forward_rows<T>(input.const_data_ptr<T>(), adds ? res.const_data_ptr<T>() : nullptr, w.const_data_ptr<T>(),
                    adds ? sum.mutable_data_ptr<T>() : nullptr, y.mutable_data_ptr<T>(), rstd.mutable_data_ptr<float>(),
                    rows, n, eps);
  });
  ctx->save_for_backward({sum, w, rstd});
  if (adds) return {sum, y};
  return {y};
}

// The gradients of the normalised rows (for x, and the residual alike) and of the weight
// (undefined unless `weight_input` needs one).
inline std::pair<torch::Tensor, torch::Tensor> backward(torch::autograd::AutogradContext* ctx,
                                                        const torch::Tensor& given_y, const torch::Tensor& given_sum,
                                                        std::size_t weight_input) {
  cpu::refuse_double_backward("rms_norm");
  const auto saved = ctx->get_saved_variables();
  const auto& h = saved[0];
  const auto& w = saved[1];
  const auto& rstd = saved[2];
  const auto n = h.size(-1);
  const auto rows = h.numel() / n;
  const auto grad_y = given_y.defined() ? given_y.contiguous() : torch::zeros_like(h);
  const auto grad_sum = given_sum.defined() ? given_sum.contiguous() : torch::Tensor();
  const bool wants_weight = ctx->needs_input_grad(weight_input);
  const auto ranges = cpu::row_ranges(rows, n);
  auto grad_h = torch::empty_like(h);
  auto partials = wants_weight ? torch::empty({ranges, n}, h.options().dtype(torch::kFloat)) : torch::Tensor();
  cpu::with_element_type(h.scalar_type(), [&]<class T>() {
    backward_rows<T>(grad_y.const_data_ptr<T>(), grad_sum.defined() ? grad_sum.const_data_ptr<T>() : nullptr,
                     h.const_data_ptr<T>(), w.const_data_ptr<T>(), rstd.const_data_ptr<float>(),
                     grad_h.mutable_data_ptr<T>(), wants_weight ? partials.mutable_data_ptr<float>() : nullptr, ranges,
                     rows, n);
  });
  return {grad_h, wants_weight ? partials.sum(0).to(w.scalar_type()) : torch::Tensor()};
}

// (x, weight) -> y.
class FusedRmsNorm : public torch::autograd::Function<FusedRmsNorm> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& weight, double eps) {
    return rms_norm_detail::forward(ctx, x, torch::Tensor(), weight, eps)[0];
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto [grad_x, grad_weight] = rms_norm_detail::backward(ctx, grads[0], torch::Tensor(), 1);
    return {grad_x, grad_weight, torch::Tensor()};
  }
};

// (x, residual, weight) -> (x + residual, y).
class FusedAddRmsNorm : public torch::autograd::Function<FusedAddRmsNorm> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                                                const torch::Tensor& residual, const torch::Tensor& weight,
                                                double eps) {
    return rms_norm_detail::forward(ctx, x, residual, weight, eps);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto [grad_h, grad_weight] = rms_norm_detail::backward(ctx, grads[1], grads[0], 2);
    // x and the residual enter the sum alike: the same gradient for both.
    return {grad_h, grad_h, grad_weight, torch::Tensor()};
  }
};

// Rows the kernel takes: on the CPU, a weight of the input's type and width (HF's fp32 weight under
// a bf16 input promotes: the composite's business), and rows that are not empty.
inline bool fits_kernel(const torch::Tensor& x, const torch::Tensor& weight) {
  return cpu::has_cpu_kernel(x) && x.dim() >= 1 && x.size(-1) > 0 && weight.device().is_cpu() &&
         weight.scalar_type() == x.scalar_type() && weight.dim() == 1 && weight.size(0) == x.size(-1);
}

}  // namespace rms_norm_detail

MESHTORCH_DECL torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  if (!rms_norm_detail::fits_kernel(x, weight)) return composite::rms_norm(x, weight, eps);
  RECORD_FUNCTION("meshtorch::rms_norm", std::vector<c10::IValue>{});  // named in a profile, as an ATen op is
  return rms_norm_detail::FusedRmsNorm::apply(x, weight, eps);
}

MESHTORCH_DECL std::pair<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x,
                                                                    const torch::Tensor& residual,
                                                                    const torch::Tensor& weight, double eps) {
  if (!rms_norm_detail::fits_kernel(x, weight) || x.sizes() != residual.sizes() ||
      x.scalar_type() != residual.scalar_type() || !residual.device().is_cpu())
    return composite::add_rms_norm(x, residual, weight, eps);
  RECORD_FUNCTION("meshtorch::add_rms_norm", std::vector<c10::IValue>{});
  auto outputs = rms_norm_detail::FusedAddRmsNorm::apply(x, residual, weight, eps);
  return {outputs[0], outputs[1]};
}

namespace composite {

MESHTORCH_DECL torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  if (x.scalar_type() == torch::kFloat && weight.scalar_type() == torch::kFloat)
    return at::rms_norm(x, {weight.size(0)}, weight, eps);  // the same maths in one ATen op
  auto h = x.to(torch::kFloat);
  h = h * torch::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return weight * h.to(x.scalar_type());
}

MESHTORCH_DECL std::pair<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x,
                                                                    const torch::Tensor& residual,
                                                                    const torch::Tensor& weight, double eps) {
  auto sum = x + residual;
  return {sum, rms_norm(sum, weight, eps)};
}

}  // namespace composite

}  // namespace meshtorch::kernels
#endif  // MESHTORCH_DEFINES(core)
