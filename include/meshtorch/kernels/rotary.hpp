#pragma once
// Rotary position embeddings in HF's rotate-half layout, applied to q and k in one pass on the CPU.
//
// Composed, x * cos + rotate_half(x) * sin is a narrow, a negation, a concatenation (a copy),
// two products and a sum for each of q and k, forward and again backward. Fused, each head row
// is read and written once, straight from the projections' [batch, seq, heads, head_dim] layout,
// so no transpose is copied either. Off the CPU the composite runs.
#include <utility>

#include <meshtorch/torch.hpp>

#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::kernels {

// q [B, S, Hq, D] and k [B, S, Hk, D] rotated by the tables cos and sin [B or 1, S, D] of their
// positions: x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x[D/2:], x[:D/2]). Results are
// [B, S, H, D], contiguous.
MESHTORCH_DECL std::pair<torch::Tensor, torch::Tensor> rotary(const torch::Tensor& q, const torch::Tensor& k,
                                                              const torch::Tensor& cos, const torch::Tensor& sin);

namespace composite {
MESHTORCH_DECL std::pair<torch::Tensor, torch::Tensor> rotary(const torch::Tensor& q, const torch::Tensor& k,
                                                              const torch::Tensor& cos, const torch::Tensor& sin);
}  // namespace composite

}  // namespace meshtorch::kernels

#if MESHTORCH_DEFINES(core)
#include <vector>

#include <ATen/record_function.h>
#include <torch/autograd.h>

#include <meshtorch/kernels/cpu_rows.hpp>

namespace meshtorch::kernels {

namespace rotary_detail {

using cpu::load;
using cpu::round_as;
using cpu::store;

// Each row (b, s) of x [B, S, heads, D] (any strides but the last dimension's, which is 1) rotated
// by cos/sin row (b or 0, s) into out, contiguous. Backward (`inverse`) applies the transposed
// rotation: grad[i] cos[i] + grad[i + h] sin[i + h] and grad[i + h] cos[i + h] - grad[i] sin[i],
// with h = D / 2. Strides, because the gradients arrive as attention's [B, heads, S, D] tensors
// seen through the transpose: reading them in place saves a copy of each.
template <class T, bool inverse>
void rotate_rows(const T* x, torch::IntArrayRef strides, const T* cos, const T* sin, T* out, std::int64_t batch,
                 std::int64_t seq, std::int64_t table_batch, std::int64_t heads, std::int64_t dim) {
  const auto rows = batch * seq;
  const auto half = dim / 2;
  cpu::for_row_ranges(
      rows, cpu::row_ranges(rows, heads * dim), [&](std::int64_t, std::int64_t first, std::int64_t end) {
        for (auto row = first; row < end; ++row) {
          const auto b = row / seq, position = row % seq;
          const auto table_row = (table_batch == 1 ? 0 : b) * seq + position;
          const T* c = cos + table_row * dim;
          const T* s = sin + table_row * dim;
          for (std::int64_t head = 0; head < heads; ++head) {
            const T* in = x + b * strides[0] + position * strides[1] + head * strides[2];
            T* o = out + (row * heads + head) * dim;
            cpu::for_each_lane<T>(half, [&](std::int64_t i, auto lane) {
              const auto low = load(in + i, lane), high = load(in + half + i, lane);
              const auto c_low = load(c + i, lane), c_high = load(c + half + i, lane);
              const auto s_low = load(s + i, lane), s_high = load(s + half + i, lane);
              if constexpr (inverse) {
                store(o + i, low * c_low + high * s_high);
                store(o + half + i, high * c_high - low * s_low);
              } else {
                // As the composite rounds in T: x * cos, then rotate_half(x) * sin, then their sum.
                store(o + i, round_as<T>(round_as<T>(low * c_low) + round_as<T>(-high * s_low)));
                store(o + half + i, round_as<T>(round_as<T>(high * c_high) + round_as<T>(low * s_high)));
              }
            });
          }
        }
      });
}

template <bool inverse>
torch::Tensor rotate(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  const auto input = x.stride(3) == 1 ? x : x.contiguous();
  auto out = torch::empty(input.sizes(), input.options());
  cpu::with_element_type(input.scalar_type(), [&]<class T>() {
    rotate_rows<T, inverse>(input.const_data_ptr<T>(), input.strides(), cos.const_data_ptr<T>(),
                            sin.const_data_ptr<T>(), out.mutable_data_ptr<T>(), input.size(0), input.size(1),
                            cos.size(0), input.size(2), input.size(3));
  });
  return out;
}

class FusedRotary : public torch::autograd::Function<FusedRotary> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& q,
                                                const torch::Tensor& k, const torch::Tensor& cos,
                                                const torch::Tensor& sin) {
    ctx->save_for_backward({cos, sin});
    return {rotate<false>(q, cos, sin), rotate<false>(k, cos, sin)};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    cpu::refuse_double_backward("rotary");
    const auto saved = ctx->get_saved_variables();
    const auto rotated = [&](const torch::Tensor& grad) {
      return grad.defined() ? rotate<true>(grad, saved[0], saved[1]) : torch::Tensor();
    };
    return {rotated(grads[0]), rotated(grads[1]), torch::Tensor(), torch::Tensor()};
  }
};

inline void check_shapes(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& cos,
                         const torch::Tensor& sin) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4, "rotary: q and k are [batch, seq, heads, head_dim], not ", q.sizes(),
              " and ", k.sizes());
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(1) == k.size(1) && q.size(3) == k.size(3) && q.size(3) % 2 == 0,
              "rotary: q of ", q.sizes(), " and k of ", k.sizes(), " differ in batch, seq or an even head_dim");
  TORCH_CHECK(cos.dim() == 3 && cos.sizes() == sin.sizes() && cos.size(1) == q.size(1) && cos.size(2) == q.size(3) &&
                  (cos.size(0) == 1 || cos.size(0) == q.size(0)),
              "rotary: tables of ", cos.sizes(), " and ", sin.sizes(), " for q of ", q.sizes());
}

}  // namespace rotary_detail

MESHTORCH_DECL std::pair<torch::Tensor, torch::Tensor> rotary(const torch::Tensor& q, const torch::Tensor& k,
                                                              const torch::Tensor& cos, const torch::Tensor& sin) {
  rotary_detail::check_shapes(q, k, cos, sin);
  const auto type = q.scalar_type();
  if (!cpu::has_cpu_kernel(q) || k.scalar_type() != type || cos.scalar_type() != type || sin.scalar_type() != type ||
      !k.device().is_cpu() || !cos.device().is_cpu() || !sin.device().is_cpu())
    return composite::rotary(q, k, cos, sin);
  RECORD_FUNCTION("meshtorch::rotary", std::vector<c10::IValue>{});  // named in a profile, as an ATen op is
  auto out = rotary_detail::FusedRotary::apply(q, k, cos.detach().contiguous(), sin.detach().contiguous());
  return {out[0], out[1]};
}

namespace composite {

MESHTORCH_DECL std::pair<torch::Tensor, torch::Tensor> rotary(const torch::Tensor& q, const torch::Tensor& k,
                                                              const torch::Tensor& cos, const torch::Tensor& sin) {
  rotary_detail::check_shapes(q, k, cos, sin);
  const auto c = cos.unsqueeze(2), s = sin.unsqueeze(2);
  const auto rotate_half = [](const torch::Tensor& x) {
    const auto half = x.size(-1) / 2;
    return torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  };
  return {q * c + rotate_half(q) * s, k * c + rotate_half(k) * s};
}

}  // namespace composite

}  // namespace meshtorch::kernels
#endif  // MESHTORCH_DEFINES(core)
