#pragma once
// What the fused CPU kernels of kernels/ share: a [rows, width] tensor's rows split over LibTorch's
// intra-op threads in a fixed number of ranges (so that sums over rows, a norm weight's gradient,
// add up in the same order on every run), rows of fp32, bf16 or fp16 computed in fp32, and one
// loop body written once for ATen's vector type and for its scalar tail.
//
// LibTorch has no public "elementwise function of several tensors with several outputs in one
// pass" for C++ callers (TensorIterator's cpu_kernel_vec lives in ATen's native/cpu sources, which
// the LibTorch package does not ship), hence these few lines.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <meshtorch/torch.hpp>

namespace meshtorch::kernels::cpu {

using Vec = at::vec::Vectorized<float>;

// Ranges of rows for `rows` rows of `row_elements` each: one per intra-op thread, fewer when the
// tensor is small (a range below ~16k elements costs more to hand out than it saves).
inline std::int64_t row_ranges(std::int64_t rows, std::int64_t row_elements) {
  constexpr std::int64_t min_elements_per_range = 16 * 1024;
  const auto by_size = std::max<std::int64_t>(1, rows * row_elements / min_elements_per_range);
  return std::clamp<std::int64_t>(std::min<std::int64_t>(at::get_num_threads(), by_size), 1,
                                  std::max<std::int64_t>(rows, 1));
}

// body(range, first_row, end_row) for each of `ranges` contiguous ranges of [0, rows), in parallel.
template <class Body>
void for_row_ranges(std::int64_t rows, std::int64_t ranges, Body&& body) {
  at::parallel_for(0, ranges, 1, [&](std::int64_t begin, std::int64_t end) {
    for (auto range = begin; range < end; ++range) {
      body(range, rows * range / ranges, rows * (range + 1) / ranges);
    }
  });
}

// step(i, Vec{}) at each full vector of [0, n), then step(i, 0.0f) at each element left. Types
// other than fp32 run every element through the scalar step, where round_as<T> rounds the
// intermediate results as the composite ops' outputs in T are rounded.
template <class T, class Step>
void for_each_lane(std::int64_t n, Step&& step) {
  std::int64_t i = 0;
  if constexpr (std::is_same_v<T, float>)
    for (; i + Vec::size() <= n; i += Vec::size()) step(i, Vec{});
  for (; i < n; ++i) step(i, 0.0f);
}

// body(begin, end) over ranges of [0, count) split over the intra-op threads in blocks: for
// elementwise kernels, whose rows are any size.
template <class Body>
void for_element_ranges(std::int64_t count, Body&& body) {
  constexpr std::int64_t block = 4096;  // elements per row of the parallel split: any size works
  const auto rows = (count + block - 1) / block;
  for_row_ranges(rows, row_ranges(rows, block), [&](std::int64_t, std::int64_t first, std::int64_t end) {
    body(first * block, std::min(end * block, count));
  });
}

// step(i, lane) over [0, count) as for_each_lane does, split as for_element_ranges splits.
template <class T, class Step>
void for_each_element(std::int64_t count, Step&& step) {
  for_element_ranges(count, [&](std::int64_t begin, std::int64_t stop) {
    for_each_lane<T>(stop - begin, [&](std::int64_t j, auto lane) { step(begin + j, lane); });
  });
}

inline Vec load(const float* p, Vec) { return Vec::loadu(p); }
inline float load(const float* p, float) { return *p; }
template <class T>
requires(!std::is_same_v<T, float>) float load(const T* p, float) { return static_cast<float>(*p); }
inline void store(float* p, const Vec& v) { v.store(p); }
template <class T>
void store(T* p, float v) {
  *p = static_cast<T>(v);
}

// A value as an op's output in T holds it (identity in fp32).
template <class T>
float round_as(float v) {
  if constexpr (std::is_same_v<T, float>)
    return v;
  else
    return static_cast<float>(static_cast<T>(v));
}
template <class T>
Vec round_as(const Vec& v) {
  static_assert(std::is_same_v<T, float>, "vector lanes are computed in fp32 only");
  return v;
}

// The sum over [0, n) of term(i, lane) (a Vec of lanes i.. or the float at i), in fp32: the full
// vectors summed lane-wise, then the lanes and the tail.
template <class T, class Term>
float sum_over_lanes(std::int64_t n, Term&& term) {
  Vec vector_sum(0.0f);
  float scalar_sum = 0.0f;
  for_each_lane<T>(n, [&](std::int64_t i, auto lane) {
    if constexpr (std::is_same_v<decltype(lane), Vec>)
      vector_sum = vector_sum + term(i, lane);
    else
      scalar_sum += term(i, lane);
  });
  alignas(64) float lanes[Vec::size()];
  vector_sum.store(lanes);
  for (float lane : lanes) scalar_sum += lane;
  return scalar_sum;
}

// The sum of a[i] * b[i] over [0, n), in fp32.
template <class T>
float sum_of_products(const T* a, const T* b, std::int64_t n) {
  return sum_over_lanes<T>(n, [&](std::int64_t i, auto lane) { return load(a + i, lane) * load(b + i, lane); });
}

// At the top of a fused kernel's backward: its gradients are computed outside autograd, so a
// backward that builds a graph (create_graph, a gradient of a gradient) is refused, not given
// gradients that silently carry no history.
inline void refuse_double_backward(const char* op) {
  TORCH_CHECK(!at::GradMode::is_enabled(), "meshtorch::", op,
              ": the fused kernel's backward is not differentiable (create_graph, a gradient of a gradient); "
              "run with --fused off (LlamaForCausalLM::use_fused_kernels(false))");
}

// The fused kernels' element types: what LibTorch's CPU kernels for these ops take.
inline bool has_cpu_kernel(const torch::Tensor& t) {
  if (!t.device().is_cpu()) return false;
  const auto type = t.scalar_type();
  return type == torch::kFloat || type == torch::kBFloat16 || type == torch::kHalf;
}

// f.template operator()<T>() for the C++ type T of `type` (fp32, bf16 or fp16).
template <class F>
decltype(auto) with_element_type(torch::ScalarType type, F&& f) {
  switch (type) {
    case torch::kFloat:
      return f.template operator()<float>();
    case torch::kBFloat16:
      return f.template operator()<c10::BFloat16>();
    case torch::kHalf:
      return f.template operator()<c10::Half>();
    default:
      TORCH_CHECK(false, "meshtorch's fused CPU kernels take fp32, bf16 or fp16, not ", type);
  }
}

}  // namespace meshtorch::kernels::cpu
