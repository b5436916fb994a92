#pragma once
// The cross entropy of logits against next tokens, summed over rows, in one pass forward and one
// backward on the CPU.
//
// Composed (log_softmax, then nll_loss), forward writes the log-probabilities, a tensor the size
// of the logits, and keeps it; backward fills another of that size with zeros for nll_loss's
// gradient, and log_softmax's backward reads both and writes the logits' gradient. At llama-6x384's
// vocabulary of 4096 and 2048 positions that is 10 ms forward and 17 backward of a chapter-1 step
// (docs/performance.md). Fused, forward reads each row twice while it is in the cache (its max,
// then the sum of e^(x - max)) and keeps those two floats a row; backward reads the logits once and
// writes their gradient, softmax(row) - onehot(target), once. In fp32 on a CPU with AVX-512 (the
// exp in the registers, kernels/vector_exp.hpp); elsewhere the composite runs. One difference
// from the composite: an ignored row's gradient is zero whatever its logits, where
// log_softmax's backward gives NaN across an ignored row that holds a NaN.
#include <cstdint>

#include <meshtorch/torch.hpp>

#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::kernels {

// The sum over the rows of logits [rows, vocab] of -log softmax(row)[target], rows whose target is
// ignore_index left out, in fp32. A target outside [0, vocab) is refused by row.
MESHTORCH_DECL torch::Tensor cross_entropy_sum(const torch::Tensor& logits, const torch::Tensor& targets,
                                               std::int64_t ignore_index = -100);

// Whether cross_entropy_sum runs its one-pass loops on fp32 CPU logits here (AVX-512), not the
// composite: what the memory plan's RunShape::fused_loss asks.
MESHTORCH_DECL bool fused_cross_entropy_available();

namespace composite {
MESHTORCH_DECL torch::Tensor cross_entropy_sum(const torch::Tensor& logits, const torch::Tensor& targets,
                                               std::int64_t ignore_index = -100);
}  // namespace composite

}  // namespace meshtorch::kernels

#if MESHTORCH_DEFINES(core)
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include <ATen/record_function.h>
#include <fmt/format.h>
#include <torch/autograd.h>

#include <meshtorch/kernels/cpu_isa.hpp>
#include <meshtorch/kernels/cpu_rows.hpp>
#include <meshtorch/kernels/vector_exp.hpp>

namespace meshtorch::kernels {

namespace cross_entropy_detail {

// A row's max and log(sum e^(x - max)), whose sum is log(sum e^x): kept apart, as log_softmax
// keeps them, so that x - max (exact near the max, where the probabilities are) is computed before
// the small log-sum is taken off, not x - logsumexp, which rounds at the logits' magnitude.
struct RowShift {
  float max, log_sum;
};

static_assert(sizeof(RowShift) == 2 * sizeof(float), "a RowShift is a row of 2 floats of a [rows, 2] tensor");

#if MESHTORCH_X86_KERNELS
MESHTORCH_REDUCE_WARNINGS_OFF

// The row of n floats' RowShift: its max, then the sum of e^(x - max), read from the cache.
__attribute__((target("avx512f"))) inline RowShift row_shift(const float* x, std::int64_t n) {
  const auto [max, sum] = shifted_exp_sum_avx512(x, n);
  return {max, std::log(sum)};
}

// out = scale e^((x - max) - log_sum) over a row: scale times its softmax.
__attribute__((target("avx512f"))) inline void scaled_softmax_row(const float* x, std::int64_t n, RowShift row,
                                                                  float scale, float* out) {
  const __m512 max = _mm512_set1_ps(row.max), log_sum = _mm512_set1_ps(row.log_sum);
  const __m512 factor = _mm512_set1_ps(scale);
  for (std::int64_t i = 0; i < n; i += 16) {
    const auto mask = first_lanes(n - i);
    const __m512 shifted = _mm512_sub_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, x + i), max), log_sum);
    const __m512 e = exp_avx512(shifted);
    _mm512_mask_storeu_ps(out + i, mask, _mm512_mul_ps(factor, e));
  }
}
MESHTORCH_REDUCE_WARNINGS_ON
#endif  // MESHTORCH_X86_KERNELS

// Whether the one-pass loops take these logits and targets.
inline bool one_pass(const torch::Tensor& logits, const torch::Tensor& targets) {
  // Plain tensors only: no nested ones, no lazily negated views (contiguous() keeps the flag, the
  // loops would read the values unnegated), no forward-mode tangents (this function has no
  // forward-mode derivative).
  return fused_cross_entropy_available() && logits.device().is_cpu() && logits.scalar_type() == torch::kFloat &&
         logits.dim() == 2 && logits.layout() == torch::kStrided && !logits.is_nested() && !logits.is_neg() &&
         !logits._fw_grad(0).defined() && targets.device().is_cpu() && targets.scalar_type() == torch::kLong &&
         targets.dim() == 1 && targets.size(0) == logits.size(0);
}

// Refuses a target outside [0, vocab) that is not ignore_index, naming its row: the one-pass loops
// would read past the row.
inline void check_targets(const std::int64_t* targets, std::int64_t rows, std::int64_t vocab,
                          std::int64_t ignore_index) {
  for (std::int64_t row = 0; row < rows; ++row) {
    const auto t = targets[row];
    TORCH_CHECK(t == ignore_index || (t >= 0 && t < vocab),
                fmt::format("meshtorch::cross_entropy_sum: the target of row {} is {}, outside the vocabulary "
                            "[0, {}) and not the ignored index {}",
                            row, t, vocab, ignore_index));
  }
}

class FusedCrossEntropy : public torch::autograd::Function<FusedCrossEntropy> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& logits,
                               const torch::Tensor& targets, std::int64_t ignore_index) {
    const auto x = logits.contiguous();
    const auto t = targets.contiguous();
    const auto rows = x.size(0), vocab = x.size(1);
    [[maybe_unused]] const float* xs = x.const_data_ptr<float>();
    const std::int64_t* ts = t.const_data_ptr<std::int64_t>();
    check_targets(ts, rows, vocab, ignore_index);
    auto shifts = torch::empty({rows, 2}, x.options());  // RowShift per row
    auto row_losses = torch::empty({rows}, x.options());
#if MESHTORCH_X86_KERNELS
    auto* row_shifts = reinterpret_cast<RowShift*>(shifts.mutable_data_ptr<float>());
    float* losses = row_losses.mutable_data_ptr<float>();
    cpu::for_row_ranges(rows, cpu::row_ranges(rows, vocab), [&](std::int64_t, std::int64_t first, std::int64_t end) {
      for (auto row = first; row < end; ++row) {
        const float* r = xs + row * vocab;
        const auto shift = row_shifts[row] = row_shift(r, vocab);
        losses[row] = ts[row] == ignore_index ? 0.0f : (shift.max - r[ts[row]]) + shift.log_sum;
      }
    });
#else
    TORCH_INTERNAL_ASSERT(false, "meshtorch::cross_entropy_sum: the one-pass loops exist on x86-64 only");
#endif
    ctx->save_for_backward({x, t, shifts});
    ctx->saved_data["ignore_index"] = ignore_index;
    return row_losses.sum();
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    cpu::refuse_double_backward("cross_entropy_sum");
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &t = saved[1], &shifts = saved[2];
    const auto ignore_index = ctx->saved_data["ignore_index"].toInt();
    const auto rows = x.size(0), vocab = x.size(1);
    const float scale = grads[0].item<float>();  // d(result)/d(the sum): a scalar
    auto grad = torch::empty_like(x);
#if MESHTORCH_X86_KERNELS
    const float* xs = x.const_data_ptr<float>();
    const auto* row_shifts = reinterpret_cast<const RowShift*>(shifts.const_data_ptr<float>());
    const std::int64_t* ts = t.const_data_ptr<std::int64_t>();
    float* out = grad.mutable_data_ptr<float>();
    cpu::for_row_ranges(rows, cpu::row_ranges(rows, vocab), [&](std::int64_t, std::int64_t first, std::int64_t end) {
      for (auto row = first; row < end; ++row) {
        float* g = out + row * vocab;
        if (ts[row] == ignore_index) {
          std::fill(g, g + vocab, 0.0f);
          continue;
        }
        scaled_softmax_row(xs + row * vocab, vocab, row_shifts[row], scale, g);
        g[ts[row]] -= scale;
      }
    });
#else
    (void)ignore_index, (void)rows, (void)vocab, (void)scale;
    TORCH_INTERNAL_ASSERT(false, "meshtorch::cross_entropy_sum: the one-pass loops exist on x86-64 only");
#endif
    return {grad, torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace cross_entropy_detail

MESHTORCH_DECL bool fused_cross_entropy_available() { return MESHTORCH_X86_KERNELS && cpu_isa() == Isa::avx512; }

MESHTORCH_DECL torch::Tensor cross_entropy_sum(const torch::Tensor& logits, const torch::Tensor& targets,
                                               std::int64_t ignore_index) {
  if (!cross_entropy_detail::one_pass(logits, targets))
    return composite::cross_entropy_sum(logits, targets, ignore_index);
  RECORD_FUNCTION("meshtorch::cross_entropy_sum", std::vector<c10::IValue>{});  // named in a profile
  return cross_entropy_detail::FusedCrossEntropy::apply(logits, targets, ignore_index);
}

namespace composite {
MESHTORCH_DECL torch::Tensor cross_entropy_sum(const torch::Tensor& logits, const torch::Tensor& targets,
                                               std::int64_t ignore_index) {
  return torch::nn::functional::cross_entropy(
      logits, targets,
      torch::nn::functional::CrossEntropyFuncOptions().ignore_index(ignore_index).reduction(torch::kSum));
}
}  // namespace composite

}  // namespace meshtorch::kernels
#endif  // MESHTORCH_DEFINES(core)
