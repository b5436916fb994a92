#pragma once
// e^x on 16 floats in AVX-512 registers, for the one-pass kernels (SwiGLU's sigmoid, the cross
// entropy's softmax) whose exp would otherwise be a pass of its own through LibTorch: ATen's
// vectorised exp is SLEEF's, compiled per instruction set inside ATen, which a header cannot
// reach. Cephes' expf: range reduction by ln 2 in two parts, a degree-6 polynomial, the power of 2
// by scalef; within 2 ulp of e^x in fp32.
#include <cstdint>
#include <limits>

#include <meshtorch/kernels/cpu_isa.hpp>

namespace meshtorch::kernels {

#if MESHTORCH_X86_KERNELS
// x is clamped to [-104, 88]: e^88 is 1.7e38, below fp32's largest; below -104 the result rounds
// to exactly 0, as e^-inf is (a masked logit's probability), and down to there the subnormals are
// kept. NaN passes through (max and min return their second operand when either is NaN).
__attribute__((target("avx512f"), always_inline)) inline __m512 exp_avx512(__m512 x) {
  const __m512 t = _mm512_min_ps(_mm512_set1_ps(88.0f), _mm512_max_ps(_mm512_set1_ps(-104.0f), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(t, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), t);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// A row's max and the sum of e^(x - max) over its n floats: the two passes of a softmax that read
// the row while it is in the cache (the cross entropy's log-sum-exp, attention's probabilities).
// With `exps`, each e^(x - max) is also written there (in place when exps == x).
struct ShiftedExpSum {
  float max, sum;
};

MESHTORCH_REDUCE_WARNINGS_OFF
__attribute__((target("avx512f"))) inline ShiftedExpSum shifted_exp_sum_avx512(const float* x, std::int64_t n,
                                                                               float* exps = nullptr) {
  const __m512 minus_infinity = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 max = minus_infinity;
  for (std::int64_t i = 0; i < n; i += 16)
    max = _mm512_max_ps(max, _mm512_mask_loadu_ps(minus_infinity, first_lanes(n - i), x + i));
  const float row_max = _mm512_reduce_max_ps(max);
  const __m512 shift = _mm512_set1_ps(row_max);
  __m512 sum = _mm512_setzero_ps();
  for (std::int64_t i = 0; i < n; i += 16) {
    const auto mask = first_lanes(n - i);
    const __m512 e = exp_avx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, x + i), shift));
    if (exps != nullptr) _mm512_mask_storeu_ps(exps + i, mask, e);
    sum = _mm512_mask_add_ps(sum, mask, sum, e);
  }
  return {row_max, _mm512_reduce_add_ps(sum)};
}
MESHTORCH_REDUCE_WARNINGS_ON
#endif  // MESHTORCH_X86_KERNELS

}  // namespace meshtorch::kernels
