#pragma once
// The leaf layers of the Llama family, each holding one weight and no bias. Their parameters
// can be created on the meta device (shapes only, no memory) and given real storage later,
// which LibTorch's own modules cannot do: set_data refuses to move a meta tensor.
#include <functional>
#include <numbers>
#include <vector>
#include <torch/torch.h>

#include <meshtorch/models/forward_hooks.hpp>
#include <meshtorch/models/llama/config.hpp>

namespace meshtorch::llama {

class WeightModule : public torch::nn::Module {
 public:
  torch::Tensor weight;
  // Run around forward; empty unless a parallel plan set them.
  ForwardHooks hooks;
  // Functions of the weight that forward computes with instead of the weight itself, applied in
  // order (torch.nn.utils.parametrize): e.g. an identity whose backward all-reduces the
  // gradient, for a weight replicated over ranks that each see part of the data.
  std::vector<std::function<torch::Tensor(const torch::Tensor&)>> parametrizations;

  torch::Tensor weight_in_use() const {
    if (parametrizations.empty()) return weight;
    auto w = weight;
    for (const auto& p : parametrizations) w = p(w);
    return w;
  }

  // Gives the weight fresh, uninitialised storage with `options` (e.g. meta -> cuda/bf16);
  // the caller initialises it. Keeps the parameter's name and requires_grad.
  void materialize(const torch::TensorOptions& options) {
    auto fresh = torch::empty(weight.sizes(), options.requires_grad(false));
    fresh.set_requires_grad(weight.requires_grad());
    weight = fresh;
    parameters_["weight"] = weight;
  }

  // Replaces the weight by another tensor of the same shape (used by loaders and by
  // wrappers that keep parameters as views into flat buffers).
  void replace_weight(const torch::Tensor& replacement) {
    TORCH_CHECK(replacement.sizes() == weight.sizes(), "replace_weight: shape ", replacement.sizes(),
                " differs from ", weight.sizes());
    weight = replacement;
    parameters_["weight"] = weight;
  }

  // Replaces the weight by a tensor of any shape (a plan's shard of it), keeping the name and
  // requires_grad.
  void set_weight(const torch::Tensor& replacement) {
    auto fresh = replacement.detach();
    fresh.set_requires_grad(weight.requires_grad());
    weight = fresh;
    parameters_["weight"] = weight;
  }

 protected:
  void create_weight(torch::IntArrayRef sizes, const torch::TensorOptions& options) {
    weight = register_parameter("weight", torch::empty(sizes, options.requires_grad(false)));
  }
};

class LinearImpl : public WeightModule {
 public:
  LinearImpl(std::int64_t in_features, std::int64_t out_features, const torch::TensorOptions& options) {
    create_weight({out_features, in_features}, options);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return hooks.around(x, [&](const torch::Tensor& in) { return at::linear(in, weight_in_use()); });
  }
};
TORCH_MODULE(Linear);

class EmbeddingImpl : public WeightModule {
 public:
  EmbeddingImpl(std::int64_t num_embeddings, std::int64_t dim, const torch::TensorOptions& options) {
    create_weight({num_embeddings, dim}, options);
  }
  torch::Tensor forward(const torch::Tensor& ids) {
    return hooks.around(ids, [&](const torch::Tensor& in) { return at::embedding(weight_in_use(), in); });
  }
};
TORCH_MODULE(Embedding);

// HF's LlamaRMSNorm: the variance in fp32, the weight applied after casting back.
class RMSNormImpl : public WeightModule {
 public:
  RMSNormImpl(std::int64_t dim, double eps, const torch::TensorOptions& options) : eps_(eps) {
    create_weight({dim}, options);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return hooks.around(x, [&](const torch::Tensor& in) { return normalize(in); });
  }
  double eps() const { return eps_; }

 private:
  torch::Tensor normalize(const torch::Tensor& x) const {
    const auto w = weight_in_use();
    if (x.scalar_type() == torch::kFloat && w.scalar_type() == torch::kFloat)
      return at::rms_norm(x, {w.size(0)}, w, eps_);  // same math, one fused kernel
    auto h = x.to(torch::kFloat);
    h = h * torch::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps_);
    return w * h.to(x.scalar_type());
  }

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
  torch::Tensor inverse_frequencies(const torch::Device& device) const {
    const auto dim = config_.resolved_head_dim();
    auto exponents = torch::arange(0, dim, 2, torch::TensorOptions().dtype(torch::kLong).device(device))
                         .to(torch::kFloat) / static_cast<double>(dim);
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

  // cos and sin of shape [batch or 1, seq, head_dim] for the given positions, in `dtype`.
  std::pair<torch::Tensor, torch::Tensor> tables(const torch::Tensor& position_ids, torch::ScalarType dtype) const {
    auto inv_freq = inverse_frequencies(position_ids.device());
    auto freqs = position_ids.to(torch::kFloat).unsqueeze(-1) * inv_freq;  // [B, S, D/2]
    auto emb = torch::cat({freqs, freqs}, -1);
    return {emb.cos().to(dtype), emb.sin().to(dtype)};
  }

  static torch::Tensor rotate_half(const torch::Tensor& x) {
    const auto half = x.size(-1) / 2;
    return torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  }

  // x: [B, heads, S, D]; cos/sin: [B or 1, S, D].
  static torch::Tensor apply(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1);
  }

 private:
  Config config_;
};

}  // namespace meshtorch::llama
