#pragma once
// The leaf layers of the Llama family, each a WeightModule (models/weight_module.hpp): one
// weight, no bias, creatable on the meta device.
#include <cstdint>
#include <utility>

#include <meshtorch/torch.hpp>

#include <meshtorch/kernels/few_rows_linear.hpp>
#include <meshtorch/kernels/rms_norm.hpp>
#include <meshtorch/models/llama/config.hpp>
#include <meshtorch/models/weight_module.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::llama {

class LinearImpl : public WeightModule {
 public:
  // `with_bias`: y = x W^T + b (Qwen2's q, k and v projections); else y = x W^T.
  MESHTORCH_DECL LinearImpl(std::int64_t in_features, std::int64_t out_features, const torch::TensorOptions& options,
                            bool with_bias = false);
  MESHTORCH_DECL torch::Tensor forward(const torch::Tensor& x);

  // kernels/few_rows_linear.hpp's kernel for the few rows of a decoding step, or LibTorch's GEMM
  // always (--fused off)
  bool fused_kernels = true;
};
TORCH_MODULE(Linear);

class EmbeddingImpl : public WeightModule {
 public:
  MESHTORCH_DECL EmbeddingImpl(std::int64_t num_embeddings, std::int64_t dim, const torch::TensorOptions& options);
  MESHTORCH_DECL torch::Tensor forward(const torch::Tensor& ids);
};
TORCH_MODULE(Embedding);

// HF's LlamaRMSNorm: the variance in fp32, the weight applied after casting back.
class RMSNormImpl : public WeightModule {
 public:
  MESHTORCH_DECL RMSNormImpl(std::int64_t dim, double eps, const torch::TensorOptions& options);
  MESHTORCH_DECL torch::Tensor forward(const torch::Tensor& x);
  // (x + residual, forward(x + residual)): a decoder layer's residual add and the norm after it,
  // one kernel when fused and no hooks run around this norm.
  MESHTORCH_DECL std::pair<torch::Tensor, torch::Tensor> add_and_forward(const torch::Tensor& x,
                                                                         const torch::Tensor& residual);
  double eps() const { return eps_; }

  bool fused_kernels = true;  // kernels/rms_norm.hpp's fused CPU kernels, or the composite ops

 private:
  MESHTORCH_DECL torch::Tensor normalize(const torch::Tensor& x) const;

  double eps_;
};
TORCH_MODULE(RMSNorm);

// Rotary position embeddings in HF's layout (rotate-half), including llama3 frequency scaling.
// Holds no parameters or buffers: the tables are recomputed from the config, as they must be
// after meta-device construction anyway.
class Rotary {
 public:
  explicit Rotary(const Config& config) : config_(config) {}

  // inv_freq in fp32, computed exactly as HF's _compute_default/_compute_llama3_parameters.
  MESHTORCH_DECL torch::Tensor inverse_frequencies(const torch::Device& device) const;

  // cos and sin of shape [batch or 1, seq, head_dim] for the given positions, in `dtype`.
  MESHTORCH_DECL std::pair<torch::Tensor, torch::Tensor> tables(const torch::Tensor& position_ids,
                                                                torch::ScalarType dtype) const;

 private:
  Config config_;
};

}  // namespace meshtorch::llama

#if MESHTORCH_DEFINES(core)
#include <numbers>

namespace meshtorch::llama {

MESHTORCH_DECL LinearImpl::LinearImpl(std::int64_t in_features, std::int64_t out_features,
                                      const torch::TensorOptions& options, bool with_bias) {
  create_weight({out_features, in_features}, options);
  if (with_bias) create_bias(out_features, options);
}

MESHTORCH_DECL torch::Tensor LinearImpl::forward(const torch::Tensor& x) {
  return hooks.around(x, [&](const torch::Tensor& in) {
    return fused_kernels ? kernels::linear(in, weight_in_use(), bias_in_use())
                         : at::linear(in, weight_in_use(), bias_in_use());
  });
}

MESHTORCH_DECL EmbeddingImpl::EmbeddingImpl(std::int64_t num_embeddings, std::int64_t dim,
                                            const torch::TensorOptions& options) {
  create_weight({num_embeddings, dim}, options);
}

MESHTORCH_DECL torch::Tensor EmbeddingImpl::forward(const torch::Tensor& ids) {
  return hooks.around(ids, [&](const torch::Tensor& in) { return at::embedding(weight_in_use(), in); });
}

MESHTORCH_DECL RMSNormImpl::RMSNormImpl(std::int64_t dim, double eps, const torch::TensorOptions& options) : eps_(eps) {
  create_weight({dim}, options);
}

MESHTORCH_DECL torch::Tensor RMSNormImpl::forward(const torch::Tensor& x) {
  return hooks.around(x, [&](const torch::Tensor& in) { return normalize(in); });
}

MESHTORCH_DECL std::pair<torch::Tensor, torch::Tensor> RMSNormImpl::add_and_forward(const torch::Tensor& x,
                                                                                    const torch::Tensor& residual) {
  if (!hooks.empty()) {
    auto sum = x + residual;
    return {sum, forward(sum)};
  }
  const auto w = weight_in_use();
  return fused_kernels ? kernels::add_rms_norm(x, residual, w, eps_)
                       : kernels::composite::add_rms_norm(x, residual, w, eps_);
}

MESHTORCH_DECL torch::Tensor RMSNormImpl::normalize(const torch::Tensor& x) const {
  const auto w = weight_in_use();
  return fused_kernels ? kernels::rms_norm(x, w, eps_) : kernels::composite::rms_norm(x, w, eps_);
}

MESHTORCH_DECL torch::Tensor Rotary::inverse_frequencies(const torch::Device& device) const {
  const auto dim = config_.resolved_head_dim();
  auto exponents =
      torch::arange(0, dim, 2, torch::TensorOptions().dtype(torch::kLong).device(device)).to(torch::kFloat) /
      static_cast<double>(dim);
  auto inv_freq = 1.0 / torch::pow(config_.rope_theta, exponents);
  const auto& s = config_.rope_scaling;
  if (s.kind == RopeScalingKind::llama3) {
    const double old_len = static_cast<double>(s.original_max_position_embeddings);
    const double low_freq_wavelen = old_len / s.low_freq_factor;
    const double high_freq_wavelen = old_len / s.high_freq_factor;
    auto wavelen = 2 * std::numbers::pi / inv_freq;
    auto scaled = torch::where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq);
    auto smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
    auto smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled;
    auto is_medium = (wavelen >= high_freq_wavelen).logical_and(wavelen <= low_freq_wavelen);
    inv_freq = torch::where(is_medium, smoothed, scaled);
  }
  return inv_freq;
}

MESHTORCH_DECL std::pair<torch::Tensor, torch::Tensor> Rotary::tables(const torch::Tensor& position_ids,
                                                                      torch::ScalarType dtype) const {
  auto inv_freq = inverse_frequencies(position_ids.device());
  auto freqs = position_ids.to(torch::kFloat).unsqueeze(-1) * inv_freq;  // [B, S, D/2]
  auto emb = torch::cat({freqs, freqs}, -1);
  return {emb.cos().to(dtype), emb.sin().to(dtype)};
}

}  // namespace meshtorch::llama
#endif  // MESHTORCH_DEFINES(core)
