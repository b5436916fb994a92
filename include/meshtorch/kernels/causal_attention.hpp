#pragma once
// Causal self-attention, softmax(q k^T / sqrt(D), causal) v, forward and backward on the CPU in
// blocks of query rows, each block's scores computed only up to its last key.
//
// LibTorch's CPU flash kernel (the one scaled_dot_product_attention runs on a CPU) walks key
// blocks of 512 with an online softmax and small GEMMs per block; at the sequences a CPU trains
// (256 at llama-6x384, head dim 64) its forward and backward run at about a third of the GEMM
// rate. Here a block of query rows takes all its keys at once: its scores are one GEMM, its
// softmax a pass over rows that stay in L1, its output one GEMM; backward recomputes the block's
// probabilities from the saved log-sum-exp, as flash attention does, and adds each block's share
// into dK and dV. Memory is the same as the flash kernel's: the output and a float per row saved.
// The scratch is a block of rows by the sequence, per thread.
//
// The GEMMs are the BLAS LibTorch links (MKL's sgemm_ in the x86 packages): ATen's own wrapper,
// at::native::cpublas::gemm, is not exported for fp32, and at::mm per block costs a dispatch of a
// few microseconds against products of a few. The symbol is taken weakly: a LibTorch that does not
// export it leaves the kernel untaken. The softmax is fp32 on AVX-512 (kernels/vector_exp.hpp).
// Elsewhere (bf16, fp16, another device, a CPU without AVX-512, no sgemm_, a mask, queries and
// keys of different lengths) the composite runs: LibTorch's own kernel.
#include <optional>

#include <meshtorch/torch.hpp>

#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::kernels {

// q [B, H, S, D], k and v [B, Hkv, S, D], H a multiple of Hkv (grouped-query attention: query
// head h reads key head h / (H / Hkv)); the result is [B, H, S, D], laid out as [B, S, H, D] so
// that the output projection reads it without a copy.
MESHTORCH_DECL torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v);

namespace composite {
// LibTorch's scaled_dot_product_attention, with grouped-query heads handled as fits the device.
MESHTORCH_DECL torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                       const std::optional<torch::Tensor>& mask, bool is_causal);
MESHTORCH_DECL torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v);
}  // namespace composite

}  // namespace meshtorch::kernels

#if MESHTORCH_DEFINES(core)
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <torch/autograd.h>

#include <meshtorch/kernels/cpu_isa.hpp>
#include <meshtorch/kernels/cpu_rows.hpp>
#include <meshtorch/kernels/vector_exp.hpp>

// Fortran BLAS, 32-bit integers (the LP64 interface LibTorch's MKL and OpenBLAS builds use).
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc) __attribute__((weak));
// MKL's threads for the calling thread (0: back to the global setting); returns the previous.
// The C name, which mkl_service.h maps mkl_set_num_threads_local to: the lower-case symbol is the
// Fortran interface, which takes a pointer.
extern "C" int MKL_Set_Num_Threads_Local(int threads) __attribute__((weak));

namespace meshtorch::kernels {

namespace causal_attention_detail {

// Query rows per block: a block's scores (64 x S floats) stay in L2 between its GEMMs and its
// softmax, and the diagonal block's masked half, computed and discarded, is an eighth of the
// products at S = 256.
constexpr std::int64_t block_rows = 64;

// A [B, heads, S, D] fp32 tensor's rows: D contiguous, any strides above.
template <class T>
struct Rows {
  T* data;
  std::int64_t batch_stride, head_stride, row_stride;
  explicit Rows(const torch::Tensor& t)
      : data(static_cast<T*>(t.data_ptr())),
        batch_stride(t.stride(0)),
        head_stride(t.stride(1)),
        row_stride(t.size(2) > 1 ? t.stride(2) : t.size(3)) {}  // one row: any stride, BLAS wants >= D
  T* at(std::int64_t b, std::int64_t h, std::int64_t s) const {
    return data + b * batch_stride + h * head_stride + s * row_stride;
  }
};

// c [m, n] = alpha op(a) op(b) + beta c, all row-major (BLAS is column-major: a row-major product
// is the column-major product of the transposes, operands swapped). Sizes and strides fit in int:
// takes() checks the tensors'.
// One BLAS thread while it lives: the blocks are already split over the intra-op threads, and
// LibTorch turns MKL's dynamic threading off, so a product inside at::parallel_for would start a
// team of its own on cores the other blocks are running on.
struct SingleThreadedBlas {
  int before = MKL_Set_Num_Threads_Local != nullptr ? MKL_Set_Num_Threads_Local(1) : 0;
  SingleThreadedBlas() = default;
  SingleThreadedBlas(const SingleThreadedBlas&) = delete;
  SingleThreadedBlas& operator=(const SingleThreadedBlas&) = delete;
  ~SingleThreadedBlas() {
    if (MKL_Set_Num_Threads_Local != nullptr) MKL_Set_Num_Threads_Local(before);
  }
};

inline void gemm(bool transpose_a, bool transpose_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
                 const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c,
                 std::int64_t ldc) {
  const char op_a = transpose_a ? 'T' : 'N', op_b = transpose_b ? 'T' : 'N';
  const int rows = static_cast<int>(m), cols = static_cast<int>(n), inner = static_cast<int>(k);
  const int ld_a = static_cast<int>(lda), ld_b = static_cast<int>(ldb), ld_c = static_cast<int>(ldc);
  sgemm_(&op_b, &op_a, &cols, &rows, &inner, &alpha, b, &ld_b, a, &ld_a, &beta, c, &ld_c);
}

#if MESHTORCH_X86_KERNELS
// A row of scores to probabilities in place: softmax over [0, valid), zeros over [valid, end).
// Returns the row's log-sum-exp, which backward recomputes the probabilities from.
__attribute__((target("avx512f"))) inline float softmax_row_avx512(float* row, std::int64_t valid, std::int64_t end) {
  const auto [row_max, sum] = shifted_exp_sum_avx512(row, valid, row);
  const __m512 inverse = _mm512_set1_ps(1.0f / sum);
  for (std::int64_t j = 0; j < valid; j += 16) {
    const auto mask = first_lanes(valid - j);
    _mm512_mask_storeu_ps(row + j, mask, _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, row + j), inverse));
  }
  std::fill(row + valid, row + end, 0.0f);
  return row_max + std::log(sum);
}

// Backward's probabilities again from the scores: e^(s - lse) over [0, valid), zeros beyond.
__attribute__((target("avx512f"))) inline void probabilities_row_avx512(float* row, std::int64_t valid,
                                                                        std::int64_t end, float log_sum_exp) {
  const __m512 shift = _mm512_set1_ps(log_sum_exp);
  for (std::int64_t j = 0; j < valid; j += 16) {
    const auto mask = first_lanes(valid - j);
    _mm512_mask_storeu_ps(row + j, mask, exp_avx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, row + j), shift)));
  }
  std::fill(row + valid, row + end, 0.0f);
}

// The scores' gradient in place of the probabilities' gradient: p (dp - delta), delta the row's
// sum of dO * O. Masked positions have p = 0, so their gradient is 0.
__attribute__((target("avx512f"))) inline void score_gradient_row_avx512(const float* probabilities, float* grad,
                                                                         std::int64_t end, float delta) {
  const __m512 shift = _mm512_set1_ps(delta);
  for (std::int64_t j = 0; j < end; j += 16) {
    const auto mask = first_lanes(end - j);
    const __m512 p = _mm512_maskz_loadu_ps(mask, probabilities + j);
    _mm512_mask_storeu_ps(grad + j, mask,
                          _mm512_mul_ps(p, _mm512_sub_ps(_mm512_maskz_loadu_ps(mask, grad + j), shift)));
  }
}

#endif  // MESHTORCH_X86_KERNELS

// 1 / sqrt(head dim), as scaled_dot_product_attention's default scale.
inline float score_scale(std::int64_t dim) { return static_cast<float>(1.0 / std::sqrt(static_cast<double>(dim))); }

// Whether the block kernel takes these heads.
inline bool takes(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  if (!MESHTORCH_X86_KERNELS || cpu_isa() != Isa::avx512) return false;
  const auto on_cpu_in_fp32 = [](const torch::Tensor& t) {
    return t.device().is_cpu() && t.scalar_type() == torch::kFloat && t.dim() == 4;
  };
  if (sgemm_ == nullptr || !on_cpu_in_fp32(q) || !on_cpu_in_fp32(k) || !on_cpu_in_fp32(v)) return false;
  // BLAS takes int sizes and strides; rows_contiguous copies a view whose row stride exceeds int.
  constexpr auto int_max = std::numeric_limits<int>::max();
  if (q.numel() >= int_max || k.numel() >= int_max) return false;
  return k.sizes() == v.sizes() && q.size(0) == k.size(0) && q.size(2) == k.size(2) && q.size(3) == k.size(3) &&
         k.size(1) > 0 && q.size(1) % k.size(1) == 0;
}

// The tensor itself when its rows are contiguous and apart (as BLAS reads them), else a copy.
// A dimension of size 1 may have any stride, in a tensor LibTorch calls contiguous too.
inline torch::Tensor rows_contiguous(const torch::Tensor& t) {
  const bool rows_apart =
      (t.size(3) <= 1 || t.stride(3) == 1) &&
      (t.size(2) <= 1 || (t.stride(2) >= t.size(3) && t.stride(2) < std::numeric_limits<int>::max()));
  return rows_apart ? t : t.contiguous();
}

// An uninitialised [B, H, S, D] tensor laid out as [B, S, H, D].
inline torch::Tensor empty_heads(std::int64_t batch, std::int64_t heads, std::int64_t seq, std::int64_t dim,
                                 const torch::TensorOptions& options) {
  return torch::empty({batch, seq, heads, dim}, options).transpose(1, 2);
}

#if MESHTORCH_X86_KERNELS
// out and the log-sum-exp of each row ([B, H, S]).
inline void forward_blocks(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& out,
                           torch::Tensor& log_sum_exp) {
  const auto batch = q.size(0), heads = q.size(1), seq = q.size(2), dim = q.size(3);
  const auto group = heads / k.size(1);
  const auto blocks = (seq + block_rows - 1) / block_rows;
  const float scale = score_scale(dim);
  const Rows<const float> queries(q), keys(k), values(v);
  const Rows<float> outs(out);
  float* lse = log_sum_exp.mutable_data_ptr<float>();
  at::parallel_for(0, batch * heads * blocks, 1, [&](std::int64_t begin, std::int64_t end) {
    const SingleThreadedBlas single_threaded;
    std::vector<float> scores(static_cast<std::size_t>(block_rows * seq));
    for (auto task = begin; task < end; ++task) {
      const auto block = task % blocks, head = task / blocks % heads, b = task / blocks / heads;
      const auto first = block * block_rows, rows = std::min(block_rows, seq - first), keys_end = first + rows;
      gemm(false, true, rows, keys_end, dim, scale, queries.at(b, head, first), queries.row_stride,
           keys.at(b, head / group, 0), keys.row_stride, 0.0f, scores.data(), keys_end);
      float* row_lse = lse + (b * heads + head) * seq + first;
      for (std::int64_t i = 0; i < rows; ++i)
        row_lse[i] = softmax_row_avx512(scores.data() + i * keys_end, first + i + 1, keys_end);
      gemm(false, false, rows, dim, keys_end, 1.0f, scores.data(), keys_end, values.at(b, head / group, 0),
           values.row_stride, 0.0f, outs.at(b, head, first), outs.row_stride);
    }
  });
}

// dq, and each query head's share of dk and dv (summed over a group's heads by the caller).
inline void backward_blocks(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            const torch::Tensor& out, const torch::Tensor& log_sum_exp, const torch::Tensor& grad_out,
                            torch::Tensor& grad_q, torch::Tensor& grad_k_heads, torch::Tensor& grad_v_heads) {
  const auto batch = q.size(0), heads = q.size(1), seq = q.size(2), dim = q.size(3);
  const auto group = heads / k.size(1);
  const float scale = score_scale(dim);
  const Rows<const float> queries(q), keys(k), values(v), outs(out), grad_outs(grad_out);
  const Rows<float> grad_queries(grad_q), grad_keys(grad_k_heads), grad_values(grad_v_heads);
  const float* lse = log_sum_exp.const_data_ptr<float>();
  at::parallel_for(0, batch * heads, 1, [&](std::int64_t begin, std::int64_t end) {
    const SingleThreadedBlas single_threaded;
    std::vector<float> probabilities(static_cast<std::size_t>(block_rows * seq));
    std::vector<float> grads(static_cast<std::size_t>(block_rows * seq));
    for (auto task = begin; task < end; ++task) {
      const auto head = task % heads, b = task / heads;
      const auto* key_rows = keys.at(b, head / group, 0);
      const auto* value_rows = values.at(b, head / group, 0);
      float* dk = grad_keys.at(b, head, 0);
      float* dv = grad_values.at(b, head, 0);
      for (std::int64_t s = 0; s < seq; ++s) {
        std::fill_n(dk + s * grad_keys.row_stride, dim, 0.0f);
        std::fill_n(dv + s * grad_values.row_stride, dim, 0.0f);
      }
      const float* row_lse = lse + (b * heads + head) * seq;
      for (std::int64_t first = 0; first < seq; first += block_rows) {
        const auto rows = std::min(block_rows, seq - first), keys_end = first + rows;
        const auto* q_block = queries.at(b, head, first);
        const auto* grad_out_block = grad_outs.at(b, head, first);
        gemm(false, true, rows, keys_end, dim, scale, q_block, queries.row_stride, key_rows, keys.row_stride, 0.0f,
             probabilities.data(), keys_end);
        for (std::int64_t i = 0; i < rows; ++i)
          probabilities_row_avx512(probabilities.data() + i * keys_end, first + i + 1, keys_end, row_lse[first + i]);
        // dV[:end] += P^T dO; dP = dO V^T.
        gemm(true, false, keys_end, dim, rows, 1.0f, probabilities.data(), keys_end, grad_out_block,
             grad_outs.row_stride, 1.0f, dv, grad_values.row_stride);
        gemm(false, true, rows, keys_end, dim, 1.0f, grad_out_block, grad_outs.row_stride, value_rows,
             values.row_stride, 0.0f, grads.data(), keys_end);
        for (std::int64_t i = 0; i < rows; ++i) {
          const float delta =
              cpu::sum_of_products(grad_out_block + i * grad_outs.row_stride, outs.at(b, head, first + i), dim);
          score_gradient_row_avx512(probabilities.data() + i * keys_end, grads.data() + i * keys_end, keys_end, delta);
        }
        // dQ = scale dS K; dK[:end] += scale dS^T Q.
        gemm(false, false, rows, dim, keys_end, scale, grads.data(), keys_end, key_rows, keys.row_stride, 0.0f,
             grad_queries.at(b, head, first), grad_queries.row_stride);
        gemm(true, false, keys_end, dim, rows, scale, grads.data(), keys_end, q_block, queries.row_stride, 1.0f, dk,
             grad_keys.row_stride);
      }
    }
  });
}
#endif  // MESHTORCH_X86_KERNELS

// The query heads' shares of a key head's gradient summed per group: [B, H, S, D] to [B, Hkv, S, D].
inline torch::Tensor sum_over_groups(const torch::Tensor& per_query_head, std::int64_t key_heads) {
  if (per_query_head.size(1) == key_heads) return per_query_head;
  const auto batch = per_query_head.size(0), seq = per_query_head.size(2), dim = per_query_head.size(3);
  // [B, S, H, D] in memory: the group's heads are adjacent.
  return per_query_head.transpose(1, 2).reshape({batch, seq, key_heads, -1, dim}).sum(3).transpose(1, 2);
}

class BlockCausalAttention : public torch::autograd::Function<BlockCausalAttention> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& query,
                               const torch::Tensor& key, const torch::Tensor& value) {
    const auto q = rows_contiguous(query), k = rows_contiguous(key), v = rows_contiguous(value);
    auto out = empty_heads(q.size(0), q.size(1), q.size(2), q.size(3), q.options());
    auto log_sum_exp = torch::empty({q.size(0), q.size(1), q.size(2)}, q.options());
#if MESHTORCH_X86_KERNELS
    forward_blocks(q, k, v, out, log_sum_exp);
#endif
    ctx->save_for_backward({q, k, v, out, log_sum_exp});
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    cpu::refuse_double_backward("causal_attention");
    const auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &log_sum_exp = saved[4];
    const auto grad_out = rows_contiguous(grads[0]);
    const auto batch = q.size(0), heads = q.size(1), seq = q.size(2), dim = q.size(3);
    auto grad_q = empty_heads(batch, heads, seq, dim, q.options());
    auto grad_k = empty_heads(batch, heads, seq, dim, q.options());
    auto grad_v = empty_heads(batch, heads, seq, dim, q.options());
#if MESHTORCH_X86_KERNELS
    backward_blocks(q, k, v, out, log_sum_exp, grad_out, grad_q, grad_k, grad_v);
#endif
    return {grad_q, sum_over_groups(grad_k, k.size(1)), sum_over_groups(grad_v, v.size(1))};
  }
};

}  // namespace causal_attention_detail

MESHTORCH_DECL torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  if (!causal_attention_detail::takes(q, k, v)) return composite::causal_attention(q, k, v);
  RECORD_FUNCTION("meshtorch::causal_attention", std::vector<c10::IValue>{});  // named in a profile
  return causal_attention_detail::BlockCausalAttention::apply(q, k, v);
}

namespace composite {
MESHTORCH_DECL torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                       const std::optional<torch::Tensor>& mask, bool is_causal) {
  const bool grouped = q.size(1) != k.size(1);
  // Grouped-query attention: SDPA's enable_gqa saves repeating the key/value heads, but the
  // CPU kernel in bf16 is slower with it than on repeated heads (55 against 45 ms for a
  // forward and backward at llama-tiny's shapes), so there, as HF does on the CPU, repeat them.
  const bool repeat_heads = grouped && q.is_cpu() && q.scalar_type() != torch::kFloat;
  if (repeat_heads) {
    const auto group = q.size(1) / k.size(1);
    return at::scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), mask,
                                            /*dropout_p=*/0.0, is_causal);
  }
  return at::scaled_dot_product_attention(q, k, v, mask, /*dropout_p=*/0.0, is_causal, /*scale=*/std::nullopt,
                                          /*enable_gqa=*/grouped);
}

MESHTORCH_DECL torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  return attention(q, k, v, std::nullopt, /*is_causal=*/q.size(2) > 1);
}
}  // namespace composite

}  // namespace meshtorch::kernels
#endif  // MESHTORCH_DEFINES(core)
