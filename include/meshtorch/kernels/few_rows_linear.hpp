#pragma once
// x W^T (+ b) for a few rows of x on the CPU in fp32, in inference mode: the matrix products of a
// decoding step (models/llama/generate.hpp, one row per prompt), which read every weight once a
// token and compute little with it.
//
// Both read the same 400 MB of weights, yet LibTorch's CPU GEMM (MKL's sgemm) takes twice as long
// for 8 rows as for one over llama-100m's 112 matrices (36 against 17 ms, 2 threads); with the
// weights pre-transposed 31 ms, and MKL's pre-packed GEMM (mkl_linear) 27 ms. Here each weight row
// is read once for all rows of x, two weight rows at a time, with the rows ahead prefetched: 17 ms
// at two rows, 20 ms at eight. The loops are compiled for AVX-512 and for AVX2 with FMA through
// function target attributes (a header cannot choose compiler flags) and picked at run time;
// another CPU, type or device, other row counts, or a call outside inference mode take at::linear.
// Inference mode, not only no gradients: a checkpointed layer's forward runs without gradients and
// is recomputed with them, and both must compute alike.
#include <cstdint>

#include <meshtorch/torch.hpp>

#include <meshtorch/kernels/cpu_isa.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::kernels {

// The rows of x taken. Past 8 the products' arithmetic, not the weight's reading, sets the time,
// which LibTorch's GEMM does better; at one row its matrix-vector product reads as fast (3% faster
// in generate at llama-100m).
inline constexpr std::int64_t few_rows_minimum = 2;
inline constexpr std::int64_t few_rows_limit = 8;

// Whether few_rows_linear takes x [..., in], w [out, in] and b ([out] or undefined): in inference
// mode (c10::InferenceMode), without CPU autocast, plain fp32 tensors on the CPU, w contiguous,
// few_rows_minimum to few_rows_limit rows of x, and a CPU with AVX2 and FMA at least.
MESHTORCH_DECL bool few_rows_linear_applies(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b);

// at::linear(x, w, b) for tensors few_rows_linear_applies to, with the loops of `isa` (at most
// cpu_isa()). The sum over `in` runs in another order than the GEMM's: the results agree to
// fp32 rounding, not bit for bit.
MESHTORCH_DECL torch::Tensor few_rows_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b,
                                             Isa isa = cpu_isa());

// few_rows_linear where it applies, at::linear elsewhere: what a linear layer computes with.
MESHTORCH_DECL torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b = {});

}  // namespace meshtorch::kernels

#if MESHTORCH_DEFINES(core)
#include <algorithm>

#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>

#include <meshtorch/error.hpp>

namespace meshtorch::kernels {

namespace few_rows_detail {

#if MESHTORCH_X86_KERNELS
MESHTORCH_REDUCE_WARNINGS_OFF
// The weight rows after the ones being read are fetched this far ahead: 4 kB measured best of 1,
// 4 and 8 kB (26, 21 and 22 ms at 8 rows). A prefetch never faults, even past the matrix's end.
inline const char* ahead(const float* p) {
  constexpr std::uintptr_t prefetch_bytes = 4096;
  return reinterpret_cast<const char*>(reinterpret_cast<std::uintptr_t>(p) + prefetch_bytes);
}

// One step of `lanes` columns k.. of R weight rows starting at `row` against the M rows of x:
// acc[r][m] += w[r, k..] x[m, k..], the columns past the row's end masked off (Masked).
template <int M, int R, bool Masked>
__attribute__((target("avx512f"), always_inline)) inline void step_avx512(__m512 (&acc)[R][M], const float* x,
                                                                          const float* row, std::int64_t in,
                                                                          std::int64_t k, __mmask16 mask) {
  __m512 weights[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    const float* at = row + r * in + k;
    _mm_prefetch(ahead(at), _MM_HINT_T0);
    weights[r] = Masked ? _mm512_maskz_loadu_ps(mask, at) : _mm512_loadu_ps(at);
  }
#pragma GCC unroll 16
  for (int m = 0; m < M; ++m) {
    const float* at = x + m * in + k;
    const __m512 xs = Masked ? _mm512_maskz_loadu_ps(mask, at) : _mm512_loadu_ps(at);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[r][m] = _mm512_fmadd_ps(weights[r], xs, acc[r][m]);
  }
}

// y[m, n] = sum_k x[m, k] w[n, k] for the M rows of x and the weight rows [first, end), R rows at
// a time: R x M accumulators of 16 lanes each.
template <int M, int R>
__attribute__((target("avx512f"))) void rows_avx512(const float* x, const float* w, float* y, std::int64_t in,
                                                    std::int64_t out, std::int64_t first, std::int64_t end) {
  constexpr std::int64_t lanes = 16;
  const std::int64_t full = in - in % lanes;
  const auto tail = first_lanes(in % lanes);
  for (std::int64_t n = first; n + R <= end; n += R) {
    __m512 acc[R][M];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
    const float* row = w + n * in;
    for (std::int64_t k = 0; k < full; k += lanes) step_avx512<M, R, false>(acc, x, row, in, k, tail);
    if (full < in) step_avx512<M, R, true>(acc, x, row, in, full, tail);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
      for (int m = 0; m < M; ++m) y[m * out + n + r] = _mm512_reduce_add_ps(acc[r][m]);
  }
}

__attribute__((target("avx2,fma"))) inline float sum_of_lanes(__m256 v) {
  const __m128 halves = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pairs = _mm_add_ps(halves, _mm_movehl_ps(halves, halves));
  return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)));
}

template <int M, int R, bool Masked>
__attribute__((target("avx2,fma"), always_inline)) inline void step_avx2(__m256 (&acc)[R][M], const float* x,
                                                                         const float* row, std::int64_t in,
                                                                         std::int64_t k, __m256i mask) {
  __m256 weights[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    const float* at = row + r * in + k;
    _mm_prefetch(ahead(at), _MM_HINT_T0);
    weights[r] = Masked ? _mm256_maskload_ps(at, mask) : _mm256_loadu_ps(at);
  }
#pragma GCC unroll 16
  for (int m = 0; m < M; ++m) {
    const float* at = x + m * in + k;
    const __m256 xs = Masked ? _mm256_maskload_ps(at, mask) : _mm256_loadu_ps(at);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[r][m] = _mm256_fmadd_ps(weights[r], xs, acc[r][m]);
  }
}

// The same with 8 lanes: AVX2 has 16 vector registers, so R x M stays at 8 accumulators.
template <int M, int R>
__attribute__((target("avx2,fma"))) void rows_avx2(const float* x, const float* w, float* y, std::int64_t in,
                                                   std::int64_t out, std::int64_t first, std::int64_t end) {
  constexpr std::int64_t lanes = 8;
  const std::int64_t full = in - in % lanes;
  const __m256i tail =
      _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(in % lanes)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  for (std::int64_t n = first; n + R <= end; n += R) {
    __m256 acc[R][M];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
      for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
    const float* row = w + n * in;
    for (std::int64_t k = 0; k < full; k += lanes) step_avx2<M, R, false>(acc, x, row, in, k, tail);
    if (full < in) step_avx2<M, R, true>(acc, x, row, in, full, tail);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
      for (int m = 0; m < M; ++m) y[m * out + n + r] = sum_of_lanes(acc[r][m]);
  }
}

// The weight rows [first, end) with `isa`'s loops: pairs of rows (AVX2: pairs while the
// accumulators fit), then the odd row left.
template <int M>
void rows_of(Isa isa, const float* x, const float* w, float* y, std::int64_t in, std::int64_t out, std::int64_t first,
             std::int64_t end) {
  const auto paired = first + (end - first) / 2 * 2;
  if (isa == Isa::avx512) {
    rows_avx512<M, 2>(x, w, y, in, out, first, paired);
    rows_avx512<M, 1>(x, w, y, in, out, paired, end);
  } else if constexpr (M <= 4) {
    rows_avx2<M, 2>(x, w, y, in, out, first, paired);
    rows_avx2<M, 1>(x, w, y, in, out, paired, end);
  } else {
    rows_avx2<M, 1>(x, w, y, in, out, first, end);
  }
}

// The M rows of x against every weight row, split over LibTorch's intra-op threads by pairs of
// weight rows (at least 16 pairs a task: a small matrix is not worth more threads).
template <int M>
void product(Isa isa, const float* x, const float* w, float* y, std::int64_t in, std::int64_t out) {
  at::parallel_for(0, (out + 1) / 2, 16, [&](std::int64_t begin, std::int64_t end) {
    rows_of<M>(isa, x, w, y, in, out, 2 * begin, std::min(2 * end, out));
  });
}

// product<M> for the count of rows given at run time.
template <int M = few_rows_minimum>
void product_of_rows(std::int64_t rows, Isa isa, const float* x, const float* w, float* y, std::int64_t in,
                     std::int64_t out) {
  if constexpr (M <= few_rows_limit) {
    if (rows == M) return product<M>(isa, x, w, y, in, out);
    product_of_rows<M + 1>(rows, isa, x, w, y, in, out);
  }
}
MESHTORCH_REDUCE_WARNINGS_ON
#endif  // MESHTORCH_X86_KERNELS

}  // namespace few_rows_detail

MESHTORCH_DECL bool few_rows_linear_applies(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b) {
  if (cpu_isa() == Isa::none || !c10::InferenceMode::is_enabled() || at::autocast::is_autocast_enabled(at::kCPU) ||
      !x.defined() || !w.defined() || x.dim() < 1 || w.dim() != 2)
    return false;
  // Plain tensors only: no nested ones, no lazily negated views, no forward-mode tangents.
  const auto on_cpu_in_fp32 = [](const torch::Tensor& t) {
    return t.device().is_cpu() && t.layout() == torch::kStrided && t.scalar_type() == torch::kFloat && !t.is_nested() &&
           !t.is_neg() && !t.is_conj() && !t._fw_grad(0).defined();
  };
  if (!on_cpu_in_fp32(x) || !on_cpu_in_fp32(w) || !w.is_contiguous() || x.size(-1) != w.size(1) || w.size(1) == 0)
    return false;
  if (b.defined() && (!on_cpu_in_fp32(b) || b.dim() != 1 || b.size(0) != w.size(0))) return false;
  const auto rows = x.numel() / w.size(1);
  return rows >= few_rows_minimum && rows <= few_rows_limit;
}

namespace few_rows_detail {
// few_rows_linear for tensors already checked.
inline torch::Tensor product_of(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b, Isa isa) {
#if MESHTORCH_X86_KERNELS
  const auto in = w.size(1), out = w.size(0);
  const auto rows = x.reshape({-1, in}).contiguous();
  auto y = torch::empty({rows.size(0), out}, x.options());
  product_of_rows(rows.size(0), isa, rows.const_data_ptr<float>(), w.const_data_ptr<float>(),
                  y.mutable_data_ptr<float>(), in, out);
  if (b.defined()) y.add_(b);
  auto sizes = x.sizes().vec();
  sizes.back() = out;
  return y.view(sizes);
#else
  (void)isa;
  return at::linear(x, w, b);
#endif
}
}  // namespace few_rows_detail

MESHTORCH_DECL torch::Tensor few_rows_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b,
                                             Isa isa) {
  if (!few_rows_linear_applies(x, w, b))
    throw ConfigError("few_rows_linear: not for these tensors (see few_rows_linear_applies)");
  if (isa > cpu_isa() || isa == Isa::none)
    throw ConfigError("few_rows_linear: this CPU does not run the instruction set asked for");
  return few_rows_detail::product_of(x, w, b, isa);
}

// Checked once: a Linear layer calls this for every product, in training too.
MESHTORCH_DECL torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b) {
  return few_rows_linear_applies(x, w, b) ? few_rows_detail::product_of(x, w, b, cpu_isa()) : at::linear(x, w, b);
}

}  // namespace meshtorch::kernels
#endif  // MESHTORCH_DEFINES(core)
